// Ragged columns' offsets (Arrow's int32 or int64) rebased and widened to int64 straight into
// caller-owned memory (the pinned slot): the Parquet source's string and list columns, whose
// batches span row groups. No Python or torch headers here.
#pragma once

#include <cstdint>
#include <vector>

namespace tfl {

// dst[k] = int64(src[k]) + shifts[i] for k in [0, counts[i]) of every piece i, where src is
// src_ptrs[i] read as int32 (src_widths[i] == 4) or int64 (8) and dst is dst_ptrs[i] as int64.
// Pieces run in parallel on the engine's pool (num_threads wide); they must not overlap.
// Returns the bytes written.
int64_t rebase_offsets(const std::vector<int64_t>& dst_ptrs, const std::vector<int64_t>& src_ptrs,
                       const std::vector<int64_t>& counts, const std::vector<int64_t>& shifts,
                       const std::vector<int64_t>& src_widths, int num_threads);

}  // namespace tfl

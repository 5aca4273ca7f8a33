// Ragged columns' offsets (Arrow's int32 or int64) rebased and widened to int64 straight into
// caller-owned memory (the pinned slot): the Parquet source's string and list columns, whose
// batches span row groups. No Python or torch headers here.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace tfl {

// dst[k] = int64(src[k]) + shifts[i] for k in [0, counts[i]) of every piece i, where src is
// src_ptrs[i] read as int32 (src_widths[i] == 4) or int64 (8) and dst is dst_ptrs[i] as int64.
// Pieces run in parallel on the engine's pool (num_threads wide); they must not overlap.
// Returns the bytes written.
int64_t rebase_offsets(const std::vector<int64_t>& dst_ptrs, const std::vector<int64_t>& src_ptrs,
                       const std::vector<int64_t>& counts, const std::vector<int64_t>& shifts,
                       const std::vector<int64_t>& src_widths, int num_threads);

// One source of a column for gather_rows (a decoded row group's column): fixed-size rows
// (offsets == nullptr, each row elem_bytes at values + row * elem_bytes), or ragged rows
// (strings, lists: row r is values [offsets[r], offsets[r + 1]) of elem_bytes each, offsets
// int32 or int64 per offsets_width).
struct GatherColumn {
  const char* offsets = nullptr;
  int offsets_width = 0;
  int64_t num_rows = 0;
  const uint8_t* values = nullptr;
  int64_t values_bytes = 0;
  int64_t elem_bytes = 0;
};

// A column's rows gathered: values (`values_bytes`) and, for a ragged column, its int64 offsets
// from 0 (rows + 1 values), both from gathered_buffer(); the caller gives both back with
// release_gathered().
struct GatheredColumn {
  int64_t* offsets = nullptr;
  uint8_t* values = nullptr;
  int64_t values_bytes = 0;
};

// Rows `rows[0..n)` of every column, in that order, into new buffers: a shuffled Parquet batch
// cut from its decoded row groups in one call without the GIL (pyarrow's take runs column by
// column, a Python call each, copies each string one append at a time, and joins a column's
// row groups before it gathers). A column is one or more sources (its row groups, all ragged or
// all fixed, one elem_bytes); a row indexes the sources' rows back to back. Rows are read in
// row order. Rows out of range and offsets that leave the values (a corrupt page) throw
// Error::kRange naming the column's position and the row; nothing is returned then.
// Buffers for gather_rows' results, reused: a fresh malloc of a batch's columns (a few MB) was
// page-faulted in on every batch (140 faults a 16K-row alert batch from 16K-row groups, the
// route's whole lead over pyarrow's take, whose pool keeps its pages). At least `bytes`
// (>= 1), 64-byte aligned; freed buffers are kept by power-of-two size, up to 256 MiB in all.
uint8_t* gathered_buffer(int64_t bytes);
void release_gathered(void* buffer);  // nullptr: nothing
// A region of `bytes` (rounded up to 2 MiB; mapped on the first call, later calls return it)
// that gathered_buffer carves its blocks from before it mallocs: the caller registers it with
// CUDA and declares it a direct region, so a shuffled batch's columns go to the device from
// where they were gathered, not through a slot. Returns (address, bytes).
std::pair<uintptr_t, int64_t> gathered_region(int64_t bytes);

std::vector<GatheredColumn> gather_rows(const std::vector<std::vector<GatherColumn>>& columns, const int64_t* rows,
                                        int64_t n, int num_threads);

}  // namespace tfl

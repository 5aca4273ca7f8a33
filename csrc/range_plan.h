// A batch of consecutive rows cut from decoded Parquet row groups, planned in one call: where
// each field lies in the batch's flat buffer, which bytes are copied into the pinned slot, which
// go to the device from where they lie (a direct region: the pinned decode arena), and which
// Arrow offsets are rebased and widened there. The Python route did this per column and per
// piece (range_tensors, plan_batch, plan_copy: ~20 Python calls a column, each a GIL hand-off
// beside the stage threads and the training thread); this is one call without the GIL.
// No Python or torch headers here.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "host_stage.h"

namespace tfl {

// One decoded row group's column, as the decode thread described it once (parquet_tensors.py
// range_descriptor): fixed-size rows (offsets == 0, `elem_bytes` a row) or ragged rows (strings,
// lists: row r is values [offsets[r], offsets[r + 1]) of `elem_bytes` each).
struct RangeColumn {
  int64_t offsets = 0;  // address of num_rows + 1 int32/int64 offsets, 0 for fixed-size rows
  int offsets_width = 0;
  int64_t values = 0;  // address of the values (or rows)
  int64_t values_bytes = 0;
  int64_t elem_bytes = 0;
  int64_t num_rows = 0;
  int64_t valid = 0;  // address of num_rows bool bytes (0: no nulls)
};
constexpr int kRangeColumnWidth = 7;  // int64 values a RangeColumn takes in a descriptor array

// Rows [start, stop) of row group `group` (an index into the planned row groups).
struct RangeSpan {
  int group = 0;
  int64_t start = 0, stop = 0;
};

struct RangePlan {
  // per field, in the batch dict's order (values, then offsets if ragged, then the mask if
  // masked, column after column): byte offset in the flat buffer, bytes, leading dimension
  std::vector<int64_t> field_offset, field_bytes, field_rows;
  // slot-relative copies into the slot, rebases into the slot, and direct copies to the device
  std::vector<int64_t> copy_dst, copy_src, copy_sizes;
  std::vector<int64_t> rebase_dst, rebase_src, rebase_counts, rebase_shifts, rebase_widths;
  std::vector<int64_t> direct_dst, direct_src, direct_sizes;
  int64_t total = 0;    // bytes of the flat buffer (alignment padding included)
  int64_t payload = 0;  // bytes of the fields
  int64_t rows = 0;
  int bad_column = -1;  // a column not masked whose rows hold nulls (nothing else planned then)
  int bad_group = -1;   // the span's row group (its index in the planned row groups) where it does
};

// The plan of rows `spans` (in order, each non-empty) of `groups` (per row group, one
// RangeColumn per column). `masked[j]`: column j has a validity field. `regions`: [start, end)
// pairs of direct regions. Every row range and every ragged row's values are checked against the
// row group first: an error of kind kRange names the column's position and the row group.
RangePlan plan_range(const std::vector<std::vector<RangeColumn>>& groups, const std::vector<RangeSpan>& spans,
                     const std::vector<uint8_t>& masked, int64_t align,
                     const std::vector<std::pair<int64_t, int64_t>>& regions);

// The plan as a one-call stage of a slot at `slot` (copies and rebases there, then the slot and
// the direct fields to `device_ptr`); threads/task_size/streaming as copy_ranges takes them.
HostStage range_stage(const RangePlan& plan, uintptr_t slot, uintptr_t device_ptr, uintptr_t stream, int threads,
                      int64_t task_size, bool streaming);

// The batch written whole into host memory at `dst` (plan.total bytes): the direct fields copied
// too. For a CPU batch, and outside a loader. Returns the bytes written.
int64_t write_range_host(const RangePlan& plan, uintptr_t dst, int threads);

}  // namespace tfl

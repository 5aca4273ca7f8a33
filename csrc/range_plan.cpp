#include "range_plan.h"

#include <cstring>
#include <string>

#include "engine.h"
#include "offsets.h"

namespace tfl {
namespace {

constexpr int64_t kOnesBytes = int64_t(1) << 20;

// True bytes a masked column's rows without nulls copy their validity from (read only).
const uint8_t* ones() {
  static const std::vector<uint8_t> bytes(static_cast<size_t>(kOnesBytes), 1);
  return bytes.data();
}

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

int64_t offset_at(const RangeColumn& c, int64_t row) {
  if (c.offsets_width == 4) {
    int32_t v;
    std::memcpy(&v, reinterpret_cast<const char*>(c.offsets) + row * 4, 4);
    return v;
  }
  int64_t v;
  std::memcpy(&v, reinterpret_cast<const char*>(c.offsets) + row * 8, 8);
  return v;
}

class Planner {
 public:
  Planner(const std::vector<std::pair<int64_t, int64_t>>& regions, int64_t align) : regions_(regions), align_(align) {}

  RangePlan plan;

  int64_t begin_field() { return cursor_ = round_up(cursor_, align_); }
  void end_field(int64_t start, int64_t rows) {
    plan.field_offset.push_back(start);
    plan.field_bytes.push_back(cursor_ - start);
    plan.field_rows.push_back(rows);
    plan.payload += cursor_ - start;
  }
  // `size` bytes at `src` to the field's cursor: to the device from where they lie when the
  // whole piece is in a direct region, else into the slot
  void piece(int64_t src, int64_t size) {
    if (size <= 0) return;
    if (in_region(src, size)) {
      plan.direct_dst.push_back(cursor_), plan.direct_src.push_back(src), plan.direct_sizes.push_back(size);
    } else {
      plan.copy_dst.push_back(cursor_), plan.copy_src.push_back(src), plan.copy_sizes.push_back(size);
    }
    cursor_ += size;
  }
  void rebase(int64_t src, int64_t count, int64_t shift, int width) {
    if (count <= 0) return;
    plan.rebase_dst.push_back(cursor_), plan.rebase_src.push_back(src), plan.rebase_counts.push_back(count);
    plan.rebase_shifts.push_back(shift), plan.rebase_widths.push_back(width);
    cursor_ += 8 * count;
  }
  int64_t cursor() const { return cursor_; }

 private:
  bool in_region(int64_t src, int64_t size) const {
    for (const auto& [start, end] : regions_)
      if (start <= src && src + size <= end) return true;
    return false;
  }
  const std::vector<std::pair<int64_t, int64_t>>& regions_;
  int64_t align_;
  int64_t cursor_ = 0;
};

}  // namespace

RangePlan plan_range(const std::vector<std::vector<RangeColumn>>& groups, const std::vector<RangeSpan>& spans,
                     const std::vector<uint8_t>& masked, int64_t align,
                     const std::vector<std::pair<int64_t, int64_t>>& regions) {
  if (align < 1) throw Error(Error::kInvalid, "align must be >= 1");
  if (spans.empty()) throw Error(Error::kInvalid, "a range batch needs at least one span");
  const size_t columns = masked.size();
  for (const auto& g : groups)
    if (g.size() != columns)
      throw Error(Error::kInvalid, "every row group needs one descriptor per column (" + std::to_string(columns) +
                                       "), got " + std::to_string(g.size()));
  int64_t rows = 0;
  for (const RangeSpan& s : spans) {
    if (s.group < 0 || static_cast<size_t>(s.group) >= groups.size())
      throw Error(Error::kInvalid, "span of row group #" + std::to_string(s.group) + " outside the " +
                                       std::to_string(groups.size()) + " given");
    if (s.stop <= s.start) throw Error(Error::kInvalid, "spans must not be empty");
    rows += s.stop - s.start;
  }
  Planner p(regions, align);
  p.plan.rows = rows;
  for (size_t j = 0; j < columns; ++j) {
    auto bad = [&](const RangeSpan& s, const std::string& why) {
      return Error(Error::kRange, "column #" + std::to_string(j) + ", rows [" + std::to_string(s.start) + ", " +
                                      std::to_string(s.stop) + ") of row group #" + std::to_string(s.group) + ": " +
                                      why);
    };
    const RangeColumn& first = groups[spans[0].group][j];
    const bool ragged = first.offsets_width != 0;
    for (const RangeSpan& s : spans) {
      const RangeColumn& c = groups[s.group][j];
      if ((c.offsets_width != 0) != ragged || c.elem_bytes != first.elem_bytes)
        throw bad(s, "its row groups differ in layout (fixed against ragged, or value size)");
      if (c.elem_bytes < 1) throw bad(s, "value size must be >= 1");
      if (s.start < 0 || s.stop > c.num_rows) throw bad(s, "outside its " + std::to_string(c.num_rows) + " rows");
      if (ragged && (c.offsets == 0 || (c.offsets_width != 4 && c.offsets_width != 8)))
        throw bad(s, "ragged rows need int32 or int64 offsets");
      if (!masked[j] && c.valid != 0 &&
          std::memchr(reinterpret_cast<const void*>(c.valid + s.start), 0, static_cast<size_t>(s.stop - s.start))) {
        RangePlan refused;
        refused.bad_column = static_cast<int>(j);
        refused.bad_group = s.group;
        return refused;
      }
    }
    // the values (rows, or the ragged rows' values back to back)
    const int64_t values_at = p.begin_field();
    std::vector<int64_t> lows(spans.size()), highs(spans.size());
    for (size_t k = 0; k < spans.size(); ++k) {
      const RangeSpan& s = spans[k];
      const RangeColumn& c = groups[s.group][j];
      int64_t low = s.start, high = s.stop;
      if (ragged) {
        low = offset_at(c, s.start), high = offset_at(c, s.stop);
        if (low < 0 || high < low) throw bad(s, "its offsets run backwards (a corrupt page)");
      }
      if (high * c.elem_bytes > c.values_bytes) throw bad(s, "its offsets leave the values (a corrupt page)");
      lows[k] = low, highs[k] = high;
      p.piece(c.values + low * c.elem_bytes, (high - low) * c.elem_bytes);
    }
    const int64_t values_bytes = p.cursor() - values_at;
    p.end_field(values_at, ragged ? values_bytes / first.elem_bytes : rows);
    if (ragged) {  // rebased onto one another, the batch's leading 0 from the first span
      const int64_t offsets_at = p.begin_field();
      int64_t before = 0;
      for (size_t k = 0; k < spans.size(); ++k) {
        const RangeSpan& s = spans[k];
        const RangeColumn& c = groups[s.group][j];
        const int64_t from = k == 0 ? s.start : s.start + 1;
        p.rebase(c.offsets + from * c.offsets_width, s.stop + 1 - from, before - lows[k], c.offsets_width);
        before += highs[k] - lows[k];
      }
      p.end_field(offsets_at, rows + 1);
    }
    if (masked[j]) {
      const int64_t mask_at = p.begin_field();
      for (const RangeSpan& s : spans) {
        const RangeColumn& c = groups[s.group][j];
        if (c.valid != 0) {
          p.piece(c.valid + s.start, s.stop - s.start);
        } else {
          for (int64_t left = s.stop - s.start; left > 0; left -= kOnesBytes)
            p.piece(reinterpret_cast<int64_t>(ones()), left < kOnesBytes ? left : kOnesBytes);
        }
      }
      p.end_field(mask_at, rows);
    }
  }
  p.plan.total = p.cursor();
  return std::move(p.plan);
}

HostStage range_stage(const RangePlan& plan, uintptr_t slot, uintptr_t device_ptr, uintptr_t stream, int threads,
                      int64_t task_size, bool streaming) {
  HostStage s;
  const int64_t base = static_cast<int64_t>(slot);
  s.copy_dst.reserve(plan.copy_dst.size());
  for (int64_t at : plan.copy_dst) s.copy_dst.push_back(base + at);
  s.copy_src = plan.copy_src, s.copy_sizes = plan.copy_sizes;
  s.rebase_dst.reserve(plan.rebase_dst.size());
  for (int64_t at : plan.rebase_dst) s.rebase_dst.push_back(base + at);
  s.rebase_src = plan.rebase_src, s.rebase_counts = plan.rebase_counts;
  s.rebase_shifts = plan.rebase_shifts, s.rebase_widths = plan.rebase_widths;
  s.direct_dst = plan.direct_dst, s.direct_src = plan.direct_src, s.direct_sizes = plan.direct_sizes;
  s.threads = threads, s.task_size = task_size, s.streaming = streaming;
  s.slot = slot, s.device_ptr = device_ptr, s.stream = stream, s.nbytes = plan.total;
  return s;
}

int64_t write_range_host(const RangePlan& plan, uintptr_t dst, int threads) {
  if (dst == 0 && plan.total > 0) throw Error(Error::kInvalid, "write_host needs a destination");
  HostStage s = range_stage(plan, dst, 0, 0, threads, int64_t(2) << 20, false);
  for (size_t i = 0; i < plan.direct_sizes.size(); ++i) {  // no device: the direct fields are copied too
    s.copy_dst.push_back(static_cast<int64_t>(dst) + plan.direct_dst[i]);
    s.copy_src.push_back(plan.direct_src[i]);
    s.copy_sizes.push_back(plan.direct_sizes[i]);
  }
  s.direct_dst.clear(), s.direct_src.clear(), s.direct_sizes.clear();
  return run_host_stage(s, nullptr, nullptr);
}

}  // namespace tfl

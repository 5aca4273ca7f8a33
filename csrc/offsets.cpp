#include "offsets.h"

#include <algorithm>
#include <string>

#include "engine.h"

namespace tfl {
namespace {

constexpr int64_t kTaskValues = int64_t(1) << 16;  // values a task: below this, a thread costs more

struct OffsetsPiece {
  int64_t* dst;
  const char* src;
  int64_t count, shift;
  int width;
};

template <typename T>
void rebase(int64_t* dst, const char* src, int64_t count, int64_t shift) {
  const T* in = reinterpret_cast<const T*>(src);
  for (int64_t k = 0; k < count; ++k) dst[k] = static_cast<int64_t>(in[k]) + shift;
}

}  // namespace

int64_t rebase_offsets(const std::vector<int64_t>& dst_ptrs, const std::vector<int64_t>& src_ptrs,
                       const std::vector<int64_t>& counts, const std::vector<int64_t>& shifts,
                       const std::vector<int64_t>& src_widths, int num_threads) {
  const size_t n = counts.size();
  if (dst_ptrs.size() != n || src_ptrs.size() != n || shifts.size() != n || src_widths.size() != n)
    throw Error(Error::kInvalid, "dst_ptrs, src_ptrs, counts, shifts and src_widths must have the same length");
  if (num_threads < 1 || num_threads > kMaxThreads)
    throw Error(Error::kInvalid, "num_threads must be in [1, " + std::to_string(kMaxThreads) + "], got " +
                                     std::to_string(num_threads));
  std::vector<OffsetsPiece> tasks;
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t count = counts[i], width = src_widths[i];
    auto bad = [&](const std::string& why) {
      return Error(Error::kRange, "offsets piece #" + std::to_string(i) + " (count=" + std::to_string(count) +
                                      ", width=" + std::to_string(width) + "): " + why);
    };
    if (count < 0) throw bad("count must be >= 0");
    if (width != 4 && width != 8) throw bad("src_widths must be 4 or 8");
    if (count == 0) continue;
    if (dst_ptrs[i] <= 0 || src_ptrs[i] <= 0) throw bad("pointers must be non-null");
    total += count * 8;
    for (int64_t at = 0; at < count; at += kTaskValues) {
      tasks.push_back({reinterpret_cast<int64_t*>(dst_ptrs[i]) + at, reinterpret_cast<const char*>(src_ptrs[i]) + at * width,
                       std::min(kTaskValues, count - at), shifts[i], static_cast<int>(width)});
    }
  }
  ThreadPool::instance().run(tasks.size(), static_cast<size_t>(num_threads), [&](size_t t, const std::atomic<bool>&) {
    const OffsetsPiece& p = tasks[t];
    if (p.width == 4)
      rebase<int32_t>(p.dst, p.src, p.count, p.shift);
    else
      rebase<int64_t>(p.dst, p.src, p.count, p.shift);
  });
  return total;
}

}  // namespace tfl

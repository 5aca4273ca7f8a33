#include "offsets.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include <pthread.h>
#include <sys/mman.h>

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

namespace {

constexpr int64_t kGatherRowsPerTask = 8192;

// The batch positions in the order of their rows (a stable LSD radix sort, 11 bits a pass): a
// gather reads each column front to back in this order, so the hardware prefetcher hides the
// misses a shuffled order takes on every row (8.3 ms -> 3.0 ms for a 16K-row alert batch out of
// a 131K-row group on one core), and writes land in the batch's own small output.
std::vector<uint32_t> row_order(const int64_t* rows, int64_t n, int64_t num_rows) {
  std::vector<uint32_t> order(static_cast<size_t>(n)), spare(static_cast<size_t>(n));
  bool sorted = true;
  for (int64_t k = 0; k < n; ++k) {
    order[k] = static_cast<uint32_t>(k);
    if (k && rows[k] < rows[k - 1]) sorted = false;
  }
  if (sorted) return order;
  constexpr int kBits = 11;
  constexpr size_t kBuckets = size_t(1) << kBits;
  std::vector<uint32_t> count(kBuckets);
  for (int shift = 0; (num_rows - 1) >> shift > 0; shift += kBits) {
    std::fill(count.begin(), count.end(), 0u);
    for (int64_t k = 0; k < n; ++k) ++count[(static_cast<uint64_t>(rows[order[k]]) >> shift) & (kBuckets - 1)];
    uint32_t at = 0;
    for (size_t b = 0; b < kBuckets; ++b) {
      const uint32_t c = count[b];
      count[b] = at;
      at += c;
    }
    for (int64_t k = 0; k < n; ++k)
      spare[count[(static_cast<uint64_t>(rows[order[k]]) >> shift) & (kBuckets - 1)]++] = order[k];
    order.swap(spare);
  }
  return order;
}

template <typename T>
inline int64_t offset_at(const char* offsets, int64_t k) {
  return static_cast<int64_t>(reinterpret_cast<const T*>(offsets)[k]);
}

inline int64_t offset_of(const GatherColumn& c, int64_t k) {
  return c.offsets_width == 4 ? offset_at<int32_t>(c.offsets, k) : offset_at<int64_t>(c.offsets, k);
}

// A column's sources with their first rows: a row of the column is (source, row in it).
struct Sources {
  const std::vector<GatherColumn>* parts;
  std::vector<int64_t> first;  // first[s]: the column's first row in source s; first.back(): its rows
  bool ragged;

  explicit Sources(const std::vector<GatherColumn>& p) : parts(&p), first(p.size() + 1, 0), ragged(false) {
    for (size_t s = 0; s < p.size(); ++s) first[s + 1] = first[s] + p[s].num_rows;
    ragged = !p.empty() && p[0].offsets != nullptr;
  }
  int64_t rows() const { return first.back(); }
  // the source of row `r` (0 <= r < rows()) and r's row in it
  size_t locate(int64_t r, int64_t* local) const {
    size_t s = 0;
    if (parts->size() > 1) s = static_cast<size_t>(std::upper_bound(first.begin() + 1, first.end() - 1, r) - first.begin() - 1);
    *local = r - first[s];
    return s;
  }
};

std::string row_error(size_t position, int64_t row, int64_t k, int64_t rows) {
  return "gather_rows: column #" + std::to_string(position) + ": row " + std::to_string(row) + " (batch position " +
         std::to_string(k) + ") is outside its " + std::to_string(rows) + " rows";
}

// memcpy for the short values of string columns (ids, codes: most under 32 bytes) without a
// call a row: two overlapping fixed-size copies inside [0, n) cover 4-32 bytes.
inline void copy_small(uint8_t* dst, const uint8_t* src, int64_t n) {
  if (n >= 16 && n <= 32) {
    std::memcpy(dst, src, 16);
    std::memcpy(dst + n - 16, src + n - 16, 16);
  } else if (n >= 8 && n < 16) {
    std::memcpy(dst, src, 8);
    std::memcpy(dst + n - 8, src + n - 8, 8);
  } else if (n >= 4 && n < 8) {
    std::memcpy(dst, src, 4);
    std::memcpy(dst + n - 4, src + n - 4, 4);
  } else if (n > 32) {
    std::memcpy(dst, src, static_cast<size_t>(n));
  } else {
    for (int64_t k = 0; k < n; ++k) dst[k] = src[k];
  }
}

// Walks a column's sources in increasing row order: the source of each row and its row there.
struct Cursor {
  const Sources& src;
  size_t s;
  Cursor(const Sources& sources, int64_t first_row) : src(sources), s(0) {
    int64_t unused = 0;
    s = src.locate(first_row, &unused);
  }
  int64_t local(int64_t r) {
    while (s + 2 < src.first.size() && r >= src.first[s + 1]) ++s;
    return r - src.first[s];
  }
};

// A ragged column's output offsets (from 0) in batch order, each row's length read in row order
// (`order`), and every row's values checked to lie inside its source's values.
void ragged_offsets(const std::vector<GatherColumn>& parts, const Sources& src, size_t position, const int64_t* rows,
                    const uint32_t* order, int64_t n, int64_t* out) {
  out[0] = 0;
  if (n == 0) return;
  Cursor cursor(src, rows[order[0]]);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t p = order[k], r = rows[p];
    const int64_t local = cursor.local(r);
    const GatherColumn& c = parts[cursor.s];
    const int64_t capacity = c.values_bytes / c.elem_bytes;
    const int64_t begin = offset_of(c, local), end = offset_of(c, local + 1);
    if (begin < 0 || end < begin || end > capacity)
      throw Error(Error::kRange, "gather_rows: column #" + std::to_string(position) + ": row " + std::to_string(r) +
                                     " spans values [" + std::to_string(begin) + ", " + std::to_string(end) +
                                     ") outside its " + std::to_string(capacity) + " values (corrupt offsets)");
    out[p + 1] = end - begin;
  }
  for (int64_t k = 0; k < n; ++k) out[k + 1] += out[k];
}

// Batch positions order[0..count) (increasing rows) of a fixed-size column: out[p] = row rows[p].
template <typename T>
void gather_fixed(const std::vector<GatherColumn>& parts, const Sources& src, uint8_t* dst, const int64_t* rows,
                  const uint32_t* order, int64_t count) {
  T* out = reinterpret_cast<T*>(dst);
  const int64_t* first = src.first.data();
  const size_t last = parts.size() - 1;
  size_t s = 0;
  int64_t unused = 0;
  s = src.locate(rows[order[0]], &unused);
  const T* in = reinterpret_cast<const T*>(parts[s].values);
  int64_t end = first[s + 1], at = first[s];
  for (int64_t k = 0; k < count; ++k) {
    const int64_t p = order[k], r = rows[p];
    while (r >= end && s < last) {  // the next source (rows come in increasing order)
      ++s;
      in = reinterpret_cast<const T*>(parts[s].values);
      at = first[s];
      end = first[s + 1];
    }
    out[p] = in[r - at];
  }
}

struct GatheredOwner {  // frees what gather_rows allocated if it throws before handing it over
  std::vector<GatheredColumn> columns;
  ~GatheredOwner() {
    for (GatheredColumn& g : columns) {
      release_gathered(g.offsets);
      release_gathered(g.values);
    }
  }
};

}  // namespace

namespace {

// Free gathered buffers by size class (2^k bytes, 4 KiB and up), each with a 64-byte header
// holding its class. Blocks come from the pinned region where one is made (carved, never
// returned to it), else from aligned_alloc; malloc'd blocks are kept for reuse only while there
// is no region (with one, they are what did not fit, freed when given back).
constexpr int kMinClass = 12, kMaxClass = 40;
constexpr size_t kHeader = 64;
constexpr size_t kKeepBytes = size_t(256) << 20;

struct GatheredPool {
  std::mutex mu;
  std::vector<std::vector<uint8_t*>> free{size_t(kMaxClass + 1)};
  size_t kept = 0;  // bytes of malloc'd blocks on the free lists
  uint8_t* region = nullptr;
  size_t region_bytes = 0, carved = 0;
  bool owns(const uint8_t* p) const { return region != nullptr && p >= region && p < region + region_bytes; }
};

GatheredPool& gathered_pool() {
  static GatheredPool* pool = [] {
    auto* p = new GatheredPool();  // never destroyed: buffers may be given back at exit
    // a fork while another thread holds the lock would leave it held in the child
    pthread_atfork([] { gathered_pool().mu.lock(); }, [] { gathered_pool().mu.unlock(); },
                   [] { gathered_pool().mu.unlock(); });
    return p;
  }();
  return *pool;
}

}  // namespace

std::pair<uintptr_t, int64_t> gathered_region(int64_t bytes) {
  GatheredPool& pool = gathered_pool();
  std::lock_guard<std::mutex> lock(pool.mu);
  if (pool.region == nullptr && bytes > 0) {
    const size_t size = (size_t(bytes) + (size_t(1) << 21) - 1) & ~((size_t(1) << 21) - 1);
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw Error(Error::kInvalid, "could not map a " + std::to_string(size) + "-byte gather region");
    ::madvise(p, size, MADV_HUGEPAGE);
    // faulted in now: CUDA registers touched pages far faster, and no batch pays the faults
    for (size_t at = 0; at < size; at += 4096) static_cast<volatile uint8_t*>(p)[at] = 0;
    pool.region = static_cast<uint8_t*>(p);
    pool.region_bytes = size;
    // blocks malloc'd before it are not reused (they would be staged through a slot): freed now,
    // and from here on as they come back
    for (std::vector<uint8_t*>& list : pool.free) {
      for (uint8_t* buffer : list) std::free(buffer - kHeader);
      list.clear();
    }
    pool.kept = 0;
  }
  return {reinterpret_cast<uintptr_t>(pool.region), int64_t(pool.region_bytes)};
}

uint8_t* gathered_buffer(int64_t bytes) {
  int k = kMinClass;
  while (k < kMaxClass && (int64_t(1) << k) < bytes) ++k;
  if ((int64_t(1) << k) < bytes) throw Error(Error::kInvalid, "gather_rows: a column of " + std::to_string(bytes) + " bytes");
  GatheredPool& pool = gathered_pool();
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    std::vector<uint8_t*>& list = pool.free[k];
    if (!list.empty()) {
      uint8_t* buffer = list.back();
      list.pop_back();
      if (!pool.owns(buffer)) pool.kept -= size_t(1) << k;
      return buffer;
    }
    const size_t block = kHeader + (size_t(1) << k);
    if (pool.region != nullptr && pool.carved + block <= pool.region_bytes) {
      uint8_t* raw = pool.region + pool.carved;
      pool.carved += block;
      *reinterpret_cast<int*>(raw) = k;
      return raw + kHeader;
    }
  }
  void* raw = std::aligned_alloc(kHeader, kHeader + (size_t(1) << k));
  if (raw == nullptr) throw std::bad_alloc();
  *static_cast<int*>(raw) = k;
  return static_cast<uint8_t*>(raw) + kHeader;
}

void release_gathered(void* buffer) {
  if (buffer == nullptr) return;
  uint8_t* raw = static_cast<uint8_t*>(buffer) - kHeader;
  const int k = *reinterpret_cast<int*>(raw);
  GatheredPool& pool = gathered_pool();
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    if (pool.owns(raw)) {  // the region's blocks always go back to their list
      pool.free[k].push_back(static_cast<uint8_t*>(buffer));
      return;
    }
    if (pool.region == nullptr && pool.kept + (size_t(1) << k) <= kKeepBytes) {
      pool.free[k].push_back(static_cast<uint8_t*>(buffer));
      pool.kept += size_t(1) << k;
      return;
    }
  }
  std::free(raw);
}

std::vector<GatheredColumn> gather_rows(const std::vector<std::vector<GatherColumn>>& columns, const int64_t* rows,
                                        int64_t n, int num_threads) {
  if (num_threads < 1 || num_threads > kMaxThreads)
    throw Error(Error::kInvalid, "num_threads must be in [1, " + std::to_string(kMaxThreads) + "], got " +
                                     std::to_string(num_threads));
  if (n < 0) throw Error(Error::kInvalid, "gather_rows: n must be >= 0");
  if (n > int64_t(UINT32_MAX)) throw Error(Error::kInvalid, "gather_rows: at most 2^32 - 1 rows a call");
  std::vector<Sources> sources;
  sources.reserve(columns.size());
  for (size_t i = 0; i < columns.size(); ++i) {
    const std::string name = "gather_rows: column #" + std::to_string(i);
    if (columns[i].empty()) throw Error(Error::kInvalid, name + ": no sources");
    const bool ragged = columns[i][0].offsets != nullptr;
    for (const GatherColumn& c : columns[i]) {
      if (c.elem_bytes <= 0 || c.num_rows < 0 || c.values_bytes < 0) throw Error(Error::kInvalid, name + ": bad sizes");
      if (c.elem_bytes != columns[i][0].elem_bytes || (c.offsets != nullptr) != ragged)
        throw Error(Error::kInvalid, name + ": its sources differ in kind or element size");
      if ((c.values == nullptr && c.values_bytes) || (ragged && c.offsets_width != 4 && c.offsets_width != 8))
        throw Error(Error::kInvalid, name + ": bad pointers or offsets width");
      if (!ragged && c.num_rows * c.elem_bytes > c.values_bytes)
        throw Error(Error::kRange, name + ": " + std::to_string(c.num_rows) + " rows of " +
                                       std::to_string(c.elem_bytes) + " bytes exceed its " +
                                       std::to_string(c.values_bytes) + " bytes");
    }
    sources.emplace_back(columns[i]);
  }
  // every row checked against every column first: the batch is refused whole, naming the row
  int64_t lowest = 0, highest = -1;
  for (int64_t k = 0; k < n; ++k) {
    lowest = k ? std::min(lowest, rows[k]) : rows[k];
    highest = std::max(highest, rows[k]);
  }
  for (size_t i = 0; i < sources.size(); ++i) {
    if (n && (lowest < 0 || highest >= sources[i].rows())) {
      for (int64_t k = 0; k < n; ++k)
        if (rows[k] < 0 || rows[k] >= sources[i].rows())
          throw Error(Error::kRange, row_error(i, rows[k], k, sources[i].rows()));
    }
  }
  const std::vector<uint32_t> order = row_order(rows, n, std::max<int64_t>(1, highest + 1));
  GatheredOwner owner;
  owner.columns.resize(columns.size());
  const size_t width = static_cast<size_t>(num_threads);
  // 1. ragged columns' offsets made (their values checked), every column's values allocated
  ThreadPool::instance().run(columns.size(), width, [&](size_t i, const std::atomic<bool>&) {
    GatheredColumn& g = owner.columns[i];
    int64_t values = n;
    if (sources[i].ragged) {
      g.offsets = reinterpret_cast<int64_t*>(gathered_buffer(int64_t(sizeof(int64_t)) * (n + 1)));
      ragged_offsets(columns[i], sources[i], i, rows, order.data(), n, g.offsets);
      values = g.offsets[n];
    }
    g.values_bytes = values * columns[i][0].elem_bytes;
    g.values = gathered_buffer(std::max<int64_t>(1, g.values_bytes));
  });
  // 2. the values copied, each column in tasks of kGatherRowsPerTask rows taken in row order
  const int64_t per_column = std::max<int64_t>(1, (n + kGatherRowsPerTask - 1) / kGatherRowsPerTask);
  ThreadPool::instance().run(columns.size() * per_column, width, [&](size_t t, const std::atomic<bool>&) {
    const size_t i = t / per_column;
    const int64_t first = static_cast<int64_t>(t % per_column) * kGatherRowsPerTask;
    const int64_t count = std::min(kGatherRowsPerTask, n - first);
    if (count <= 0) return;
    const std::vector<GatherColumn>& parts = columns[i];
    const Sources& src = sources[i];
    const int64_t elem = parts[0].elem_bytes;
    GatheredColumn& g = owner.columns[i];
    const uint32_t* o = order.data() + first;
    if (!src.ragged) {
      switch (elem) {
        case 1: gather_fixed<uint8_t>(parts, src, g.values, rows, o, count); return;
        case 2: gather_fixed<uint16_t>(parts, src, g.values, rows, o, count); return;
        case 4: gather_fixed<uint32_t>(parts, src, g.values, rows, o, count); return;
        case 8: gather_fixed<uint64_t>(parts, src, g.values, rows, o, count); return;
        default: break;
      }
    }
    Cursor cursor(src, rows[o[0]]);
    for (int64_t k = 0; k < count; ++k) {
      const int64_t p = o[k];
      const int64_t local = cursor.local(rows[p]);
      const GatherColumn& c = parts[cursor.s];
      if (!src.ragged) {
        std::memcpy(g.values + p * elem, c.values + local * elem, static_cast<size_t>(elem));
        continue;
      }
      const int64_t begin = offset_of(c, local);
      copy_small(g.values + g.offsets[p] * elem, c.values + begin * elem, (g.offsets[p + 1] - g.offsets[p]) * elem);
    }
  });
  std::vector<GatheredColumn> out;
  out.swap(owner.columns);
  return out;
}

}  // namespace tfl

// torch_fastload._arrow: Parquet row groups decoded by pyarrow's own C++ (the wheel's headers and
// libraries) into a pinned arena, returned to Python as pyarrow Tables.
//
// The loader copies a decoded column to the GPU from wherever its buffer lies. Arrow's default
// pool gives pageable memory, so every decoded byte used to be copied once more into a pinned
// slot first (on the H100 machine that host copy and the DMA reading it took the Parquet loader
// from pyarrow's decode rate to 0.72-0.85x of it). Here the decode's output buffers come from one
// arena the loader registers with CUDA once: the copy engines read them where they lie.
// Built only where pyarrow's headers are found at build time (setup.py); ABI-tied to that
// pyarrow's version (checked at import, torch_fastload/sources/parquet_arena.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/mman.h>

#include <arrow/api.h>
#include <arrow/io/file.h>
#include <arrow/python/pyarrow.h>
#include <arrow/util/thread_pool.h>
#include <parquet/arrow/reader.h>
#include <parquet/exception.h>
#include <parquet/properties.h>

#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <queue>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "page_decode.h"

namespace py = pybind11;

namespace {

#ifdef MADV_POPULATE_WRITE
constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kPopulateWrite = 23;  // Linux 5.14's value; older kernels refuse it (EINVAL)
#endif

// A buddy allocator over one anonymous mapping: power-of-2 blocks (1 KiB up: the page decoder
// sizes its buffers exactly, a 500-row int64 column is 4000 bytes), a larger free block split
// in halves for a smaller request, and a freed block merged with its free buddy again. Blocks
// used to be carved once per class and never split or merged: after row groups of another
// shape (a 1M-row group's 32 MiB strings) every small request took a whole large block, and a
// benchmark process sent 4.2 GB of decodes to the fallback (RESULTS.md, twenty-fifth session).
// A Reallocate within its block's class grows in place (Arrow's builders grow geometrically).
// Allocations below the smallest class, or that find no room, go to Arrow's default pool: the
// loader then stages them through a pinned slot as before (correct, slower).
class ArenaPool : public arrow::MemoryPool {
 public:
  static constexpr int64_t kSmallest = 1 << 10;
  static constexpr int kMaxClasses = 40;

  explicit ArenaPool(int64_t nbytes) {
    arena_bytes_ = (nbytes + kSmallest - 1) / kSmallest * kSmallest;
    void* p = ::mmap(nullptr, static_cast<size_t>(arena_bytes_), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("could not map a " + std::to_string(arena_bytes_) + "-byte arena");
    arena_ = static_cast<uint8_t*>(p);
    // Faulted in now (CUDA registers touched pages ~37x faster than fresh ones), on huge pages
    // where the kernel allows: 1 GiB in ~0.1 s against ~0.4 s in 4 KiB pages (the dev machine).
    ::madvise(p, static_cast<size_t>(arena_bytes_), MADV_HUGEPAGE);
    if (::madvise(p, static_cast<size_t>(arena_bytes_), kPopulateWrite) != 0) {  // before Linux 5.14
      for (int64_t at = 0; at < arena_bytes_; at += 4096) arena_[at] = 0;
    }
    // Roots: the size's binary digits, largest first, so each root's offset is a multiple of its
    // size and a block's buddy is at offset ^ its size.
    int64_t at = 0;
    for (int c = kMaxClasses - 1; c >= 0; --c) {
      if (capacity(c) > arena_bytes_ - at) continue;
      roots_.push_back({at, c});
      free_[c].insert(at);
      classes_ = std::max(classes_, c + 1);
      at += capacity(c);
    }
  }
  ~ArenaPool() override = default;  // the mapping lives as long as the process: tables may outlive any owner

  uintptr_t base() const { return reinterpret_cast<uintptr_t>(arena_); }
  int64_t size() const { return arena_bytes_; }
  bool owns(const uint8_t* p) const { return p >= arena_ && p < arena_ + arena_bytes_; }

  arrow::Status Allocate(int64_t size, int64_t alignment, uint8_t** out) override {
    if (size >= kSmallest && size <= arena_bytes_ && alignment <= kSmallest && take(class_of(size), out)) {
      live_ += size, allocated_ += size, ++count_;
      return arrow::Status::OK();
    }
    ++fallback_, fallback_bytes_ += size;
    if (size < kSmallest) ++fallback_small_;
    return fallback()->Allocate(size, alignment, out);
  }

  arrow::Status Reallocate(int64_t old_size, int64_t new_size, int64_t alignment, uint8_t** ptr) override {
    if (!owns(*ptr)) {
      if (new_size < kSmallest) return fallback()->Reallocate(old_size, new_size, alignment, ptr);
      uint8_t* fresh = nullptr;
      ARROW_RETURN_NOT_OK(Allocate(new_size, alignment, &fresh));
      if (!owns(fresh)) {  // no room in the arena either: let the default pool move it
        fallback()->Free(fresh, new_size, alignment);
        return fallback()->Reallocate(old_size, new_size, alignment, ptr);
      }
      std::memcpy(fresh, *ptr, static_cast<size_t>(std::min(old_size, new_size)));
      fallback()->Free(*ptr, old_size, alignment);
      *ptr = fresh;
      return arrow::Status::OK();
    }
    int c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = class_at_.find(*ptr);
      if (it == class_at_.end()) return arrow::Status::Invalid("reallocation of a block the arena did not hand out");
      c = it->second;
    }
    if (new_size <= capacity(c)) {
      live_ += new_size - old_size;
      return arrow::Status::OK();
    }
    uint8_t* fresh = nullptr;
    ARROW_RETURN_NOT_OK(Allocate(new_size, alignment, &fresh));
    std::memcpy(fresh, *ptr, static_cast<size_t>(std::min(old_size, new_size)));
    Free(*ptr, old_size, alignment);
    *ptr = fresh;
    return arrow::Status::OK();
  }

  void Free(uint8_t* buffer, int64_t size, int64_t alignment) override {
    if (!owns(buffer)) return fallback()->Free(buffer, size, alignment);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = class_at_.find(buffer);
    if (it == class_at_.end()) return;  // not a block of ours (never happens with Arrow's pairing)
    int c = it->second;
    class_at_.erase(it);
    live_ -= size;
    int64_t at = buffer - arena_;
    const int top = root_class(at);
    while (c < top) {  // merged with its buddy while the buddy is free
      auto buddy = free_[c].find(at ^ capacity(c));
      if (buddy == free_[c].end()) break;
      free_[c].erase(buddy);
      at &= ~capacity(c);
      ++c;
    }
    free_[c].insert(at);
  }

  int64_t bytes_allocated() const override { return live_ + fallback()->bytes_allocated(); }
  int64_t total_bytes_allocated() const override { return allocated_ + fallback()->total_bytes_allocated(); }
  int64_t num_allocations() const override { return count_ + fallback()->num_allocations(); }
  std::string backend_name() const override { return "torch_fastload pinned arena"; }

  py::dict stats() const {
    py::dict d;
    std::lock_guard<std::mutex> lock(mu_);
    int64_t largest = 0;
    for (int c = classes_ - 1; c >= 0 && !largest; --c) largest = free_[c].empty() ? 0 : capacity(c);
    // carved_bytes: the highest arena offset handed out so far; largest_free: the largest
    // block free now (the arena whole again once nothing is live)
    d["arena_bytes"] = arena_bytes_, d["carved_bytes"] = high_water_, d["live_bytes"] = int64_t(live_);
    d["largest_free"] = largest;
    d["allocations"] = int64_t(count_), d["fallback_allocations"] = int64_t(fallback_);
    // below the smallest class (scratch, short columns' bitmaps), and the bytes of all of them:
    // what the loader stages through the slot instead of copying in place
    d["fallback_small"] = int64_t(fallback_small_), d["fallback_bytes"] = int64_t(fallback_bytes_);
    return d;
  }

 private:
  struct Root {
    int64_t at;
    int c;
  };
  static arrow::MemoryPool* fallback() { return arrow::default_memory_pool(); }
  static int64_t capacity(int c) { return kSmallest << c; }
  static int class_of(int64_t size) {
    int c = 0;
    while (capacity(c) < size) ++c;
    return c;
  }
  int root_class(int64_t at) const {
    for (const Root& r : roots_)
      if (at >= r.at && at < r.at + capacity(r.c)) return r.c;
    return 0;
  }
  // A block of class `c`: the lowest free block of the smallest class that has one, split down.
  bool take(int c, uint8_t** out) {
    if (c >= classes_) return false;
    std::lock_guard<std::mutex> lock(mu_);
    int used = c;
    while (used < classes_ && free_[used].empty()) ++used;
    if (used >= classes_) return false;
    const int64_t at = *free_[used].begin();
    free_[used].erase(free_[used].begin());
    while (used > c) {  // the upper halves stay free
      --used;
      free_[used].insert(at + capacity(used));
    }
    *out = arena_ + at;
    class_at_[*out] = c;
    high_water_ = std::max(high_water_, at + capacity(c));
    return true;
  }

  uint8_t* arena_ = nullptr;
  int64_t arena_bytes_ = 0, high_water_ = 0;
  int classes_ = 0;
  std::vector<Root> roots_;
  mutable std::mutex mu_;
  std::set<int64_t> free_[kMaxClasses];
  std::unordered_map<uint8_t*, int> class_at_;
  std::atomic<int64_t> live_{0}, allocated_{0}, count_{0}, fallback_{0}, fallback_small_{0}, fallback_bytes_{0};
};

std::unique_ptr<ArenaPool> g_arena;
std::mutex g_arena_mu;

ArenaPool& arena() {
  if (!g_arena) throw std::runtime_error("the decode arena is not made yet (make_arena)");
  return *g_arena;
}

// A few FileReaders per thread (a reader is not shared between threads): footers parsed once.
struct OpenReader {
  std::string path;
  bool threads;
  arrow::MemoryPool* pool;
  std::unique_ptr<parquet::arrow::FileReader> reader;
};
constexpr size_t kReadersPerThread = 4;

arrow::Result<parquet::arrow::FileReader*> reader_for(const std::string& path, bool threads,
                                                      arrow::MemoryPool* pool) {
  thread_local std::list<OpenReader> readers;
  for (auto it = readers.begin(); it != readers.end(); ++it) {
    if (it->path == path && it->threads == threads && it->pool == pool) {
      readers.splice(readers.begin(), readers, it);
      return readers.front().reader.get();
    }
  }
  ARROW_ASSIGN_OR_RAISE(auto file, arrow::io::ReadableFile::Open(path));
  parquet::ArrowReaderProperties props;
  props.set_use_threads(threads);
  props.set_pre_buffer(true);
  parquet::arrow::FileReaderBuilder builder;
  ARROW_RETURN_NOT_OK(builder.Open(file));  // decompression scratch: Arrow's default pool
  builder.memory_pool(pool)->properties(props);
  std::unique_ptr<parquet::arrow::FileReader> reader;
  ARROW_ASSIGN_OR_RAISE(reader, builder.Build());
  if (readers.size() >= kReadersPerThread) readers.pop_back();
  readers.push_front(OpenReader{path, threads, pool, std::move(reader)});
  return readers.front().reader.get();
}

struct DecodeFailure {
  bool io;
  std::string message;
};

// Columns decoded by page_decode and by pyarrow's reader (taken, or fallen back to at a page
// page_decode does not take): what `decode_stats` reports.
std::atomic<int64_t> g_page_columns{0}, g_pyarrow_columns{0}, g_fallbacks{0};

// Every column of a row group's table as long as the footer says the row group is: a damaged
// page or footer can make pyarrow's reader return other rows (0 of 200 where a page header is
// damaged; a list column's levels read differently alone and beside other columns).
arrow::Status check_rows(parquet::arrow::FileReader* reader, int row_group, const arrow::Table& table) {
  const int64_t rows = reader->parquet_reader()->metadata()->RowGroup(row_group)->num_rows();
  for (int k = 0; k < table.num_columns(); ++k) {
    if (table.column(k)->length() != rows)
      return arrow::Status::Invalid("column '", table.field(k)->name(), "' decoded ", table.column(k)->length(),
                                    " rows, its row group has ", rows);
  }
  return arrow::Status::OK();
}

// Column-chunk decodes handed to pyarrow's CPU pool in the order their row groups were asked for,
// not the order their threads got there. Each submit queues its task here and spawns one runner
// on the pool; a runner runs the queued task of the lowest order (then the earliest queued). With
// three row groups decoding at once, their chunks were interleaved in the pool's FIFO and the
// first row group (the next batch's) finished with the other two, ~3x later than it could.
class OrderedTasks {
 public:
  void submit(int64_t order, std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push(Entry{order, next_++, std::move(task)});
    }
    // never fails while the pool is open; at exit, every queued task is run here (this one
    // among them: its caller waits for it)
    if (!arrow::internal::GetCpuThreadPool()->Spawn([this] { run_one(); }).ok()) {
      while (run_one()) {
      }
    }
  }

 private:
  struct Entry {
    int64_t order, seq;
    std::function<void()> task;
    bool operator>(const Entry& other) const {
      return order != other.order ? order > other.order : seq > other.seq;
    }
  };

  // Runs the queued task of the lowest order; false where none was queued (its runner's task
  // already ran on a thread that drained the queue).
  bool run_one() {
    std::function<void()> task;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (queue_.empty()) return false;
      task = std::move(const_cast<Entry&>(queue_.top()).task);  // moved out, then popped
      queue_.pop();
    }
    task();
    return true;
  }

  std::mutex mu_;
  int64_t next_ = 0;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue_;
};

OrderedTasks g_ordered;
std::atomic<int64_t> g_arrival{0};  // the order of a call that gives none: its arrival
constexpr int64_t kArrivalBase = int64_t(1) << 62;  // after every order a caller gives

// Leaf columns `columns` of a row group, all by pyarrow's reader.
arrow::Status read_by_pyarrow(parquet::arrow::FileReader* reader, int row_group, const std::vector<int>& columns,
                              std::shared_ptr<arrow::Table>* out) {
  g_pyarrow_columns += columns.size();
  ARROW_ASSIGN_OR_RAISE(*out, reader->ReadRowGroups(std::vector<int>{row_group}, columns));
  return check_rows(reader, row_group, **out);
}

// Leaf columns `columns` of a row group: those page_decode takes on pyarrow's CPU pool (one task
// a column chunk, run in `order` among the row groups decoding: OrderedTasks), the rest by
// pyarrow's reader on this thread meanwhile; one table in that order.
arrow::Status read_by_pages(parquet::arrow::FileReader* reader, int row_group, const std::vector<int>& columns,
                            bool threads, int64_t order, arrow::MemoryPool* pool,
                            std::shared_ptr<arrow::Table>* out) {
  const size_t n = columns.size();
  std::vector<std::shared_ptr<arrow::Field>> fields(n);
  std::vector<std::shared_ptr<arrow::ChunkedArray>> chunks(n);
  std::vector<size_t> by_pages, by_pyarrow;
  for (size_t k = 0; k < n; ++k) {
    const bool ours = fastload_parquet::fast_decodable(*reader, columns[k], &fields[k]);
    (ours ? by_pages : by_pyarrow).push_back(k);
  }
  if (by_pages.empty()) return read_by_pyarrow(reader, row_group, columns, out);
  std::shared_ptr<parquet::RowGroupReader> group = reader->parquet_reader()->RowGroup(row_group);
  std::vector<arrow::Status> status(by_pages.size());
  auto decode = [&](size_t i) {  // on a pool thread: nothing may be thrown out of it
    const size_t k = by_pages[i];
    try {
      auto array = fastload_parquet::decode_column(*group, columns[k], fields[k]->type(), pool);
      if (array.ok()) chunks[k] = std::make_shared<arrow::ChunkedArray>(*array);
      status[i] = array.status();
    } catch (const std::exception& e) {  // parquet::ParquetException: a corrupt page header, a failed read
      status[i] = arrow::Status::Invalid(e.what());
    }
  };
  std::vector<arrow::Future<>> running;
  // the tasks use this frame's vectors: every one is waited for before the frame goes, whatever
  // leaves it (a failed submit, an error or an exception out of pyarrow's reader below)
  struct WaitAll {
    std::vector<arrow::Future<>>& futures;
    ~WaitAll() {
      for (auto& f : futures) f.Wait();
    }
  } wait_all{running};
  if (threads && by_pages.size() > 1) {
    for (size_t i = 0; i < by_pages.size(); ++i) {
      // the chunk's future, finished by whichever pool thread runs it (g_ordered picks the task)
      arrow::Future<> done = arrow::Future<>::Make();
      g_ordered.submit(order, [&decode, i, done]() mutable {
        decode(i);
        done.MarkFinished();
      });
      running.push_back(std::move(done));
    }
  } else {
    for (size_t i = 0; i < by_pages.size(); ++i) decode(i);
  }
  auto by_reader = [&](const std::vector<size_t>& which) -> arrow::Status {
    if (which.empty()) return arrow::Status::OK();
    std::vector<int> leaves;
    for (size_t k : which) leaves.push_back(columns[k]);
    ARROW_ASSIGN_OR_RAISE(auto table, reader->ReadRowGroups(std::vector<int>{row_group}, leaves));
    for (size_t j = 0; j < which.size(); ++j) {
      fields[which[j]] = table->schema()->field(j);
      chunks[which[j]] = table->column(j);
    }
    g_pyarrow_columns += which.size();
    return arrow::Status::OK();
  };
  arrow::Status read = by_reader(by_pyarrow);
  for (auto& f : running) f.Wait();
  ARROW_RETURN_NOT_OK(read);
  std::vector<size_t> fell_back;
  for (size_t i = 0; i < by_pages.size(); ++i) {
    if (status[i].IsNotImplemented()) {
      fell_back.push_back(by_pages[i]);
    } else {
      ARROW_RETURN_NOT_OK(status[i]);
      ++g_page_columns;
    }
  }
  g_fallbacks += fell_back.size();
  ARROW_RETURN_NOT_OK(by_reader(fell_back));
  *out = arrow::Table::Make(arrow::schema(fields), chunks, group->metadata()->num_rows());
  return check_rows(reader, row_group, **out);
}

py::object read_row_group(const std::string& path, int row_group, const std::vector<int>& columns, bool threads,
                          bool by_pages, bool into_arena, int64_t order) {
  arrow::MemoryPool* pool = into_arena ? &arena() : arrow::default_memory_pool();
  if (order < 0) order = kArrivalBase + g_arrival++;
  std::shared_ptr<arrow::Table> table;
  DecodeFailure failure{false, ""};
  {
    py::gil_scoped_release nogil;
    try {
      arrow::Status st = [&]() -> arrow::Status {
        ARROW_ASSIGN_OR_RAISE(auto reader, reader_for(path, threads, pool));
        if (by_pages) return read_by_pages(reader, row_group, columns, threads, order, pool, &table);
        return read_by_pyarrow(reader, row_group, columns, &table);
      }();
      if (!st.ok()) failure = {st.IsIOError(), st.ToString()};
    } catch (const std::exception& e) {  // parquet::ParquetException out of the footer's accessors
      failure = {false, e.what()};
    }
  }
  if (!failure.message.empty()) {
    PyErr_SetString(failure.io ? PyExc_OSError : PyExc_ValueError, failure.message.c_str());
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(arrow::py::wrap_table(table));
}

}  // namespace

PYBIND11_MODULE(_arrow, m) {
  if (arrow::py::import_pyarrow() != 0) throw py::error_already_set();
  m.attr("ARROW_VERSION") = ARROW_VERSION_STRING;
  m.def(
      "make_arena",
      [](int64_t nbytes) {
        std::lock_guard<std::mutex> lock(g_arena_mu);
        if (!g_arena) g_arena = std::make_unique<ArenaPool>(nbytes);
        return py::make_tuple(g_arena->base(), g_arena->size());
      },
      py::arg("nbytes"),
      "The process's decode arena, mapped and faulted in on the first call (later calls return the same):\n"
      "(address, bytes). The caller registers it with CUDA.");
  m.def("arena_stats", [] { return arena().stats(); }, "Bytes carved, live, allocations in and out of the arena.");
  m.def("read_row_group", &read_row_group, py::arg("path"), py::arg("row_group"), py::arg("columns"),
        py::arg("threads") = true, py::arg("by_pages") = true, py::arg("into_arena") = true, py::arg("order") = -1,
        "Row group `row_group` of `path`, leaf columns `columns`, decoded without the GIL into the arena\n"
        "(into_arena; else Arrow's default pool); a pyarrow.Table. by_pages: the columns page_decode.cpp\n"
        "takes are decoded by it from pyarrow's pages, the rest by pyarrow's reader. A table whose columns\n"
        "hold other rows than the footer's is refused. Arrow's errors raise ValueError (OSError for I/O),\n"
        "with Arrow's message. order: the column chunks of calls decoding at once run on pyarrow's pool\n"
        "lowest order first (-1: after every ordered call, in arrival order).");
  m.def(
      "ordered_probe",
      [](const std::vector<int64_t>& orders, bool ordered) {
        // tasks of `orders` queued while the first runner is held, then let go: the orders in
        // the sequence they ran (with a pool of one thread: lowest first; not `ordered`: as queued)
        std::vector<int64_t> ran;
        std::mutex mu;
        std::condition_variable cv;
        bool go = false;
        int64_t left = static_cast<int64_t>(orders.size()) + 1;
        auto finished = [&] {
          std::lock_guard<std::mutex> lock(mu);
          if (--left == 0) cv.notify_all();
        };
        {
          py::gil_scoped_release nogil;
          g_ordered.submit(INT64_MIN, [&] {
            std::unique_lock<std::mutex> lock(mu);
            cv.wait(lock, [&] { return go; });
            lock.unlock();
            finished();
          });
          int64_t k = 0;
          for (int64_t order : orders) {
            g_ordered.submit(ordered ? order : k++, [&, order] {
              {
                std::lock_guard<std::mutex> lock(mu);
                ran.push_back(order);
              }
              finished();
            });
          }
          {
            std::lock_guard<std::mutex> lock(mu);
            go = true;
          }
          cv.notify_all();
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return left == 0; });
        }
        return ran;
      },
      py::arg("orders"), py::arg("ordered") = true,
      "Tests: the order in which the ordered decode queue ran tasks of `orders`, queued behind a held\n"
      "task (ordered=False: each queued with its arrival as its order, the FIFO it replaced).");
  m.def(
      "decode_stats",
      [] {
        py::dict d;
        d["page_columns"] = int64_t(g_page_columns), d["pyarrow_columns"] = int64_t(g_pyarrow_columns);
        d["fallbacks"] = int64_t(g_fallbacks);
        return d;
      },
      "Column chunks decoded so far by page_decode, by pyarrow's reader, and fallen back to it at a page\n"
      "page_decode does not take (counted in pyarrow_columns too).");
}

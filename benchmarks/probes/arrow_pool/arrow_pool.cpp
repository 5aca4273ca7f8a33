// Probe for issue 21: decode a Parquet row group with pyarrow's own C++ (the wheel's headers
// and libraries) into memory from an arrow::MemoryPool of ours, and hand the table to Python as a
// pyarrow.Table. A pool over a registered (pinned) arena would let the loader copy the decoded
// buffers to the GPU where they lie, without the host copy into a pinned slot that caps the
// Parquet loader below read_table. Build and check: build.sh, check.py. PROTO_DEFAULT_POOL=1
// decodes through arrow's default pool instead (the comparison).
#include <Python.h>
#include <arrow/api.h>
#include <arrow/io/file.h>
#include <arrow/python/pyarrow.h>
#include <parquet/arrow/reader.h>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {
// Blocks of power-of-4 size classes (64 KiB .. 256 MiB) carved from one arena (here malloc'd; in
// the loader it would be registered with CUDA once), kept on per-class free lists and never given
// back: a Reallocate within the block's class grows in place (arrow's builders grow their buffers
// geometrically: 44 reallocations a row group here), a larger one moves to the next class.
class CountingPool : public arrow::MemoryPool {
 public:
  static constexpr int kClasses = 7;
  static constexpr int64_t kSmallest = 64 << 10;
  CountingPool() {
    arena_bytes_ = int64_t(4) << 30;
    arena_ = static_cast<uint8_t*>(std::aligned_alloc(4096, static_cast<size_t>(arena_bytes_)));
  }
  static int class_of(int64_t size) {
    int c = 0;
    for (int64_t cap = kSmallest; cap < size && c < kClasses; cap <<= 2) ++c;
    return c;  // kClasses: too large for the arena
  }
  static int64_t capacity(int c) { return kSmallest << (2 * c); }
  arrow::Status Allocate(int64_t size, int64_t alignment, uint8_t** out) override {
    const int c = class_of(size);
    if (c >= kClasses || alignment > 4096) return arrow::Status::OutOfMemory("too large for the arena");
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& free = free_[c];
      if (!free.empty()) {
        *out = free.back();
        free.pop_back();
      } else {
        if (used_ + capacity(c) > arena_bytes_) return arrow::Status::OutOfMemory("arena full");
        *out = arena_ + used_;
        used_ += capacity(c);
      }
      size_of_[*out] = c;
    }
    allocated_ += size, live_ += size, ++count_;
    return arrow::Status::OK();
  }
  arrow::Status Reallocate(int64_t old_size, int64_t new_size, int64_t alignment, uint8_t** ptr) override {
    int c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      c = size_of_.at(*ptr);
    }
    if (new_size <= capacity(c)) {  // in place
      live_ += new_size - old_size;
      ++in_place_;
      return arrow::Status::OK();
    }
    uint8_t* fresh = nullptr;
    ARROW_RETURN_NOT_OK(Allocate(new_size, alignment, &fresh));
    std::memcpy(fresh, *ptr, static_cast<size_t>(std::min(old_size, new_size)));
    Free(*ptr, old_size, alignment);
    *ptr = fresh;
    ++reallocs_;
    return arrow::Status::OK();
  }
  void Free(uint8_t* buffer, int64_t size, int64_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = size_of_.find(buffer);
    free_[it->second].push_back(buffer);
    size_of_.erase(it);
    live_ -= size;
  }
  int64_t bytes_allocated() const override { return live_; }
  int64_t total_bytes_allocated() const override { return allocated_; }
  int64_t num_allocations() const override { return count_; }
  std::string backend_name() const override { return "size-class arena"; }
  std::atomic<int64_t> allocated_{0}, live_{0}, count_{0}, reallocs_{0}, in_place_{0};
  int64_t used_ = 0, arena_bytes_ = 0;

 private:
  uint8_t* arena_ = nullptr;
  std::mutex mu_;
  std::vector<uint8_t*> free_[kClasses];
  std::unordered_map<uint8_t*, int> size_of_;
};
CountingPool g_counting;
arrow::MemoryPool& pool() {
  static arrow::MemoryPool* p = std::getenv("PROTO_DEFAULT_POOL") ? arrow::default_memory_pool() : &g_counting;
  return *p;
}
#define g_pool pool()

PyObject* read_row_group(PyObject*, PyObject* args) {
  const char* path; int rg;
  if (!PyArg_ParseTuple(args, "si", &path, &rg)) return nullptr;
  std::shared_ptr<arrow::Table> table;
  arrow::Status st;
  Py_BEGIN_ALLOW_THREADS
  st = [&]() -> arrow::Status {
    ARROW_ASSIGN_OR_RAISE(auto file, arrow::io::ReadableFile::Open(path, &g_pool));
    parquet::arrow::FileReaderBuilder builder;
    ARROW_RETURN_NOT_OK(builder.Open(file));
    builder.memory_pool(&g_pool);
    std::unique_ptr<parquet::arrow::FileReader> reader;
    ARROW_ASSIGN_OR_RAISE(reader, builder.Build());
    ARROW_ASSIGN_OR_RAISE(table, reader->ReadRowGroups(std::vector<int>{rg}));
    return arrow::Status::OK();
  }();
  Py_END_ALLOW_THREADS
  if (!st.ok()) { PyErr_SetString(PyExc_OSError, st.ToString().c_str()); return nullptr; }
  return arrow::py::wrap_table(table);
}
PyObject* pool_stats(PyObject*, PyObject*) {
  return Py_BuildValue("(LLLLLL)", (long long)g_counting.allocated_, (long long)g_counting.live_,
                       (long long)g_counting.count_, (long long)g_counting.reallocs_,
                       (long long)g_counting.in_place_, (long long)g_counting.used_);
}
PyMethodDef methods[] = {{"read_row_group", read_row_group, METH_VARARGS, ""}, {"pool_stats", pool_stats, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
PyModuleDef mod = {PyModuleDef_HEAD_INIT, "arrow_pool", nullptr, -1, methods};
}  // namespace
PyMODINIT_FUNC PyInit_arrow_pool() {
  if (arrow::py::import_pyarrow() != 0) return nullptr;
  return PyModule_Create(&mod);
}

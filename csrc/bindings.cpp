// Python bindings for the engine: convert arguments under the GIL, run without it, and turn
// engine errors into the matching Python exception types.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <deque>
#include <cstring>
#include <optional>

#include "cuda_driver.h"
#include "device_stager.h"
#include "image_probe.h"
#include "jpeg_decode.h"
#include "mapped_file.h"
#include "offsets.h"
#include "engine.h"
#include "host_stage.h"
#include "py_arrays.h"
#include "sampler.h"

namespace py = pybind11;

void bind_native_loop(py::module_& m);  // bindings_loop.cpp
void bind_range_plan(py::module_& m);   // bindings_range.cpp

namespace {

PyObject* g_range_error = nullptr;       // torch_fastload._C.RangeError(ValueError)
PyObject* g_short_read_error = nullptr;  // torch_fastload._C.ShortReadError(RangeError, EOFError)

PyObject* text(const std::string& s) {
  return PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "backslashreplace");
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const tfl::Error& e) {
    PyObject* message = text(e.what());
    if (message == nullptr) return;  // a Python error is already set
    switch (e.kind) {
      case tfl::Error::kOS: {
        // OSError(errno, strerror, filename) picks the subclass: FileNotFoundError, ...
        PyObject* args = e.path.empty()
                             ? Py_BuildValue("(iN)", e.err, message)
                             : Py_BuildValue("(iNN)", e.err, message,
                                             PyUnicode_DecodeFSDefaultAndSize(
                                                 e.path.data(), static_cast<Py_ssize_t>(e.path.size())));
        if (args != nullptr) {
          PyErr_SetObject(PyExc_OSError, args);
          Py_DECREF(args);
        }
        return;
      }
      case tfl::Error::kRange:
        PyErr_SetObject(g_range_error, message);
        break;
      case tfl::Error::kShortRead:
        PyErr_SetObject(g_short_read_error, message);
        break;
      case tfl::Error::kInvalid:
        PyErr_SetObject(PyExc_ValueError, message);
        break;
      case tfl::Error::kIndex:
        PyErr_SetObject(PyExc_IndexError, message);
        break;
    }
    Py_DECREF(message);
  }
}

tfl::ReadRequest make_request(std::vector<std::string> paths, const I64Array& file_index, const I64Array& offsets,
                              const I64Array& lengths, uint64_t dst_ptr, int64_t dst_size,
                              const I64Array& dst_offsets, int num_threads, int64_t task_size, bool o_direct) {
  tfl::ReadRequest req;
  req.paths = std::move(paths);
  req.file_index = to_vector(file_index, "file_index");
  req.offsets = to_vector(offsets, "offsets");
  req.lengths = to_vector(lengths, "lengths");
  req.dst_offsets = to_vector(dst_offsets, "dst_offsets");
  req.dst_ptr = static_cast<uintptr_t>(dst_ptr);
  req.dst_size = dst_size;
  req.num_threads = num_threads;
  req.task_size = task_size;
  req.o_direct = o_direct;
  return req;
}

int64_t read_ranges(std::vector<std::string> paths, const I64Array& file_index, const I64Array& offsets,
                    const I64Array& lengths, uint64_t dst_ptr, int64_t dst_size, const I64Array& dst_offsets,
                    int num_threads, int64_t task_size, bool o_direct) {
  const tfl::ReadRequest req = make_request(std::move(paths), file_index, offsets, lengths, dst_ptr, dst_size,
                                            dst_offsets, num_threads, task_size, o_direct);
  py::gil_scoped_release nogil;
  return tfl::read_ranges(req);
}

py::list plan_ranges(std::vector<std::string> paths, const I64Array& file_index, const I64Array& offsets,
                     const I64Array& lengths, int64_t dst_size, const I64Array& dst_offsets, int64_t task_size,
                     bool o_direct, std::vector<int64_t> dst_breaks) {
  tfl::ReadRequest req = make_request(std::move(paths), file_index, offsets, lengths, 0, dst_size, dst_offsets, 1,
                                      task_size, o_direct);
  std::sort(dst_breaks.begin(), dst_breaks.end());
  req.dst_breaks = std::move(dst_breaks);
  std::vector<std::vector<tfl::PlannedRead>> tasks;
  {
    py::gil_scoped_release nogil;
    tasks = tfl::plan_ranges(req);
  }
  py::list out;
  for (const auto& task : tasks) {
    py::list reads;
    for (const auto& p : task) reads.append(py::make_tuple(p.file_index, p.offset, p.length, p.dst_offset));
    out.append(reads);
  }
  return out;
}

int64_t stager_read(tfl::DeviceStager& stager, std::vector<std::string> paths, const I64Array& file_index,
                    const I64Array& offsets, const I64Array& lengths, uint64_t dst_ptr, int64_t dst_size,
                    const I64Array& dst_offsets, uint64_t stream, int num_threads, int64_t task_size, bool o_direct,
                    bool wait_for_chunks) {
  const tfl::ReadRequest req = make_request(std::move(paths), file_index, offsets, lengths, dst_ptr, dst_size,
                                            dst_offsets, num_threads, task_size, o_direct);
  py::gil_scoped_release nogil;
  return stager.read(req, static_cast<uintptr_t>(stream), wait_for_chunks);
}

std::vector<std::string> paths_of(const std::vector<const tfl::MappedFile*>& files) {
  std::vector<std::string> paths;
  for (const tfl::MappedFile* f : files) {
    if (f == nullptr) throw py::value_error("a mapped file is None");
    paths.push_back(f->path());
  }
  return paths;
}

int64_t stager_gather_mapped(tfl::DeviceStager& stager, const std::vector<const tfl::MappedFile*>& files,
                             const I64Array& file_index, const I64Array& offsets, const I64Array& lengths,
                             uint64_t dst_ptr, int64_t dst_size, const I64Array& dst_offsets, uint64_t stream,
                             uint64_t function, int piece_bytes, int blocks) {
  const tfl::ReadRequest req =
      make_request(paths_of(files), file_index, offsets, lengths, dst_ptr, dst_size, dst_offsets, 1, 1, false);
  py::gil_scoped_release nogil;
  return stager.gather_mapped(files, req, static_cast<uintptr_t>(stream), static_cast<uintptr_t>(function),
                              piece_bytes, blocks);
}

int64_t mapped_copy(const std::vector<const tfl::MappedFile*>& files, const I64Array& file_index,
                    const I64Array& offsets, const I64Array& lengths, uint64_t dst_ptr, int64_t dst_size,
                    const I64Array& dst_offsets, const std::vector<uint64_t>& streams) {
  const tfl::ReadRequest req =
      make_request(paths_of(files), file_index, offsets, lengths, dst_ptr, dst_size, dst_offsets, 1, 1, false);
  std::vector<uintptr_t> handles(streams.begin(), streams.end());
  py::gil_scoped_release nogil;
  return tfl::copy_mapped(files, req, handles);
}

int64_t copy_ranges(const I64Array& dst_ptrs, const I64Array& src_ptrs, const I64Array& sizes, int num_threads,
                    int64_t task_size, bool streaming) {
  std::vector<int64_t> dst = to_vector(dst_ptrs, "dst_ptrs"), src = to_vector(src_ptrs, "src_ptrs"),
                       len = to_vector(sizes, "sizes");
  py::gil_scoped_release nogil;
  return tfl::copy_ranges(dst, src, len, num_threads, task_size, streaming);
}

int64_t rebase_offsets(const I64Array& dst_ptrs, const I64Array& src_ptrs, const I64Array& counts,
                       const I64Array& shifts, const I64Array& src_widths, int num_threads) {
  std::vector<int64_t> dst = to_vector(dst_ptrs, "dst_ptrs"), src = to_vector(src_ptrs, "src_ptrs"),
                       count = to_vector(counts, "counts"), shift = to_vector(shifts, "shifts"),
                       width = to_vector(src_widths, "src_widths");
  py::gil_scoped_release nogil;
  return tfl::rebase_offsets(dst, src, count, shift, width, num_threads);
}

int64_t stage_host_batch(const I64Array& copy_dst, const I64Array& copy_src, const I64Array& copy_sizes,
                         const I64Array& rebase_dst, const I64Array& rebase_src, const I64Array& rebase_counts,
                         const I64Array& rebase_shifts, const I64Array& rebase_widths, int threads, int64_t task_size,
                         bool streaming, uint64_t slot, uint64_t device_ptr, int64_t nbytes, uint64_t stream,
                         tfl::CopyEvent* start, tfl::CopyEvent* end, const std::optional<I64Array>& direct_dst,
                         const std::optional<I64Array>& direct_src, const std::optional<I64Array>& direct_sizes) {
  tfl::HostStage s;
  s.copy_dst = to_vector(copy_dst, "copy_dst"), s.copy_src = to_vector(copy_src, "copy_src");
  s.copy_sizes = to_vector(copy_sizes, "copy_sizes");
  s.rebase_dst = to_vector(rebase_dst, "rebase_dst"), s.rebase_src = to_vector(rebase_src, "rebase_src");
  s.rebase_counts = to_vector(rebase_counts, "rebase_counts"), s.rebase_shifts = to_vector(rebase_shifts, "rebase_shifts");
  s.rebase_widths = to_vector(rebase_widths, "rebase_widths");
  s.threads = threads, s.task_size = task_size, s.streaming = streaming;
  s.slot = slot, s.device_ptr = device_ptr, s.nbytes = nbytes, s.stream = stream;
  if (direct_sizes) {
    if (!direct_dst || !direct_src) throw py::value_error("direct_dst, direct_src and direct_sizes go together");
    s.direct_dst = to_vector(*direct_dst, "direct_dst"), s.direct_src = to_vector(*direct_src, "direct_src");
    s.direct_sizes = to_vector(*direct_sizes, "direct_sizes");
  }
  py::gil_scoped_release nogil;
  return tfl::run_host_stage(s, start, end);
}

// A CSR graph's arrays held through the buffer protocol, in place (no copy: they can be GBs),
// for the sampler's lifetime; the Py_buffer views keep their exporters alive.
struct PyNeighborSampler {
  py::buffer_info indptr, indices;
  std::unique_ptr<tfl::NeighborSampler> impl;
};

// Result arrays handed over without a copy: np.asarray / np.frombuffer view them.
struct PyInt64Buffer {
  tfl::Int64Array array;
  std::vector<py::ssize_t> shape;
};

// A 1-D C-contiguous buffer of signed integers; returns its itemsize (4 or 8).
py::buffer_info int_buffer(const py::object& a, const char* name, int* itemsize) {
  if (!PyObject_CheckBuffer(a.ptr()))
    throw py::type_error(std::string(name) + " must support the buffer protocol (a numpy array), got " +
                         std::string(py::str(py::type::of(a))));
  py::buffer_info info = py::reinterpret_borrow<py::buffer>(a).request();
  if (info.ndim != 1)
    throw py::value_error(std::string(name) + " must be 1-D, got " + std::to_string(info.ndim) + "-D");
  std::string format = info.format;
  if (!format.empty() && std::string("@=<").find(format[0]) != std::string::npos) format = format.substr(1);
  const bool is_int = format.size() == 1 && std::string("qlni").find(format[0]) != std::string::npos;
  if (!is_int || (info.itemsize != 4 && info.itemsize != 8))
    throw py::type_error(std::string(name) + " must hold int32 or int64, got buffer format '" + info.format +
                         "' with itemsize " + std::to_string(info.itemsize));
  if (info.shape[0] > 1 && info.strides[0] != info.itemsize)
    throw py::value_error(std::string(name) + " must be contiguous (np.ascontiguousarray)");
  *itemsize = static_cast<int>(info.itemsize);
  return info;
}

PyNeighborSampler* make_sampler(const py::object& indptr, const py::object& indices) {
  auto s = std::make_unique<PyNeighborSampler>();
  int indptr_bytes = 0, index_bytes = 0;
  s->indptr = int_buffer(indptr, "indptr", &indptr_bytes);
  s->indices = int_buffer(indices, "indices", &index_bytes);
  if (indptr_bytes != 8) throw py::type_error("indptr must hold int64");
  if (s->indptr.shape[0] < 1) throw py::value_error("indptr must hold num_nodes + 1 >= 1 values");
  s->impl = std::make_unique<tfl::NeighborSampler>(static_cast<const int64_t*>(s->indptr.ptr),
                                                   static_cast<int64_t>(s->indptr.shape[0]) - 1, s->indices.ptr,
                                                   index_bytes, static_cast<int64_t>(s->indices.shape[0]));
  return s.release();
}

py::tuple sampler_sample(const PyNeighborSampler& s, const I64Array& seeds, const I64Array& fanouts, uint64_t key,
                         int num_threads) {
  const std::vector<int64_t> ids = to_vector(seeds, "seeds"), fan = to_vector(fanouts, "fanouts");
  tfl::SampleResult r;
  {
    py::gil_scoped_release nogil;
    r = s.impl->sample(ids, fan, key, num_threads);
  }
  const py::ssize_t nodes = static_cast<py::ssize_t>(r.n_id.size), edges = static_cast<py::ssize_t>(r.num_edges);
  py::object n_id = py::cast(PyInt64Buffer{std::move(r.n_id), {nodes}});
  py::object edge_index = py::cast(PyInt64Buffer{std::move(r.edge_index), {2, edges}});
  return py::make_tuple(n_id, edge_index);
}

// Bytes of C++'s gathered-buffer pool (gather_rows' results) handed over without a copy: np.frombuffer and
// torch.frombuffer view them, and keep this object (so the memory) alive.
struct PyOwnedBytes {
  uint8_t* data = nullptr;
  py::ssize_t size = 0;
  PyOwnedBytes(uint8_t* d, py::ssize_t n) : data(d), size(n) {}
  PyOwnedBytes(PyOwnedBytes&& o) noexcept : data(o.data), size(o.size) { o.data = nullptr; }
  PyOwnedBytes(const PyOwnedBytes&) = delete;
  ~PyOwnedBytes() { tfl::release_gathered(data); }
};

// columns: each a list of sources (a column's row groups, rows back to back), each source
// (offsets: 1-D int32/int64 array of num_rows + 1 values, or None for fixed-size rows, values
// pointer, values bytes, bytes of a value (ragged) or of a row (fixed), num_rows); a bare tuple is
// one source. rows: a 1-D int64 array. The arrays and the memory behind the pointers must
// outlive the call.
py::list gather_rows(const py::list& columns, const py::object& rows, int num_threads) {
  int width = 0;
  const py::buffer_info row_info = int_buffer(rows, "rows", &width);
  if (width != 8) throw py::type_error("rows must be int64");
  std::vector<std::vector<tfl::GatherColumn>> specs;
  std::deque<py::buffer_info> keep;  // the offsets' buffer views, held through the call
  auto source = [&](const py::handle item) {
    const py::tuple t = py::reinterpret_borrow<py::tuple>(item);
    if (t.size() != 5) throw py::value_error("each source is (offsets, values_ptr, values_bytes, elem_bytes, num_rows)");
    tfl::GatherColumn c;
    c.values = reinterpret_cast<const uint8_t*>(t[1].cast<uint64_t>());
    c.values_bytes = t[2].cast<int64_t>();
    c.elem_bytes = t[3].cast<int64_t>();
    c.num_rows = t[4].cast<int64_t>();
    if (!t[0].is_none()) {
      int offsets_width = 0;
      keep.push_back(int_buffer(py::reinterpret_borrow<py::object>(t[0]), "offsets", &offsets_width));
      if (keep.back().shape[0] != c.num_rows + 1)
        throw py::value_error("offsets must hold num_rows + 1 values, got " + std::to_string(keep.back().shape[0]) +
                              " for " + std::to_string(c.num_rows) + " rows");
      c.offsets = static_cast<const char*>(keep.back().ptr);
      c.offsets_width = offsets_width;
    }
    return c;
  };
  for (const py::handle item : columns) {
    std::vector<tfl::GatherColumn> parts;
    if (py::isinstance<py::tuple>(item)) {
      parts.push_back(source(item));
    } else {
      for (const py::handle part : py::reinterpret_borrow<py::sequence>(item)) parts.push_back(source(part));
    }
    specs.push_back(std::move(parts));
  }
  const auto* row_ptr = static_cast<const int64_t*>(row_info.ptr);
  const int64_t n = static_cast<int64_t>(row_info.shape[0]);
  std::vector<tfl::GatheredColumn> gathered;
  {
    py::gil_scoped_release nogil;
    gathered = tfl::gather_rows(specs, row_ptr, n, num_threads);
  }
  std::vector<PyOwnedBytes> owned;  // every buffer owned before any Python call can throw
  owned.reserve(2 * gathered.size());
  for (const tfl::GatheredColumn& g : gathered) {
    owned.emplace_back(reinterpret_cast<uint8_t*>(g.offsets), g.offsets ? (n + 1) * 8 : 0);
    owned.emplace_back(g.values, g.values_bytes);
  }
  py::list out;
  for (size_t i = 0; i < gathered.size(); ++i) {
    py::object offsets = gathered[i].offsets ? py::cast(std::move(owned[2 * i])) : py::object(py::none());
    out.append(py::make_tuple(offsets, py::cast(std::move(owned[2 * i + 1]))));
  }
  return out;
}

}  // namespace

// The arguments of a batched JPEG decode, checked under the GIL: every source range inside the
// source buffer, every (3, H, W) place inside the destination.
struct JpegBatchArgs {
  std::vector<const uint8_t*> sources;
  std::vector<int64_t> lengths, places, heights, widths;
  std::vector<tfl::JpegRegion> regions;
  uint8_t* dst;

  // `regions_`: None (whole images) or int64 (top, left, height, width) per image, flattened.
  JpegBatchArgs(uint64_t src_ptr, int64_t src_size, const I64Array& starts, const I64Array& lengths_,
                uint64_t dst_ptr, int64_t dst_size, const I64Array& dst_offsets, const I64Array& heights_,
                const I64Array& widths_, const py::object& regions_ = py::none())
      : lengths(to_vector(lengths_, "lengths")),
        places(to_vector(dst_offsets, "dst_offsets")),
        heights(to_vector(heights_, "heights")),
        widths(to_vector(widths_, "widths")),
        dst(reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(dst_ptr))) {
    const std::vector<int64_t> start = to_vector(starts, "starts");
    const size_t n = start.size();
    if (lengths.size() != n || places.size() != n || heights.size() != n || widths.size() != n)
      throw py::value_error("starts, lengths, dst_offsets, heights and widths must have one entry per image");
    const auto* src = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(src_ptr));
    const std::vector<int64_t> boxes = regions_.is_none() ? std::vector<int64_t>() : to_vector(regions_, "regions");
    if (!regions_.is_none() && boxes.size() != 4 * n)
      throw py::value_error("regions must have 4 entries (top, left, height, width) per image");
    sources.resize(n);
    regions.resize(n);
    for (size_t k = 0; k < n; ++k) {
      if (start[k] < 0 || lengths[k] <= 0 || start[k] > src_size - lengths[k])
        throw py::value_error("image " + std::to_string(k) + ": bytes [" + std::to_string(start[k]) + ", +" +
                              std::to_string(lengths[k]) + ") outside the " + std::to_string(src_size) +
                              "-byte source");
      const int64_t limit = int64_t(1) << 30;  // pixels; far above any image routed here
      if (heights[k] <= 0 || widths[k] <= 0 || heights[k] > limit / widths[k])
        throw py::value_error("image " + std::to_string(k) + ": bad size " + std::to_string(heights[k]) + "x" +
                              std::to_string(widths[k]));
      tfl::JpegRegion& r = regions[k];
      if (boxes.empty()) {
        r = {0, 0, heights[k], widths[k]};
      } else {
        r = {boxes[4 * k], boxes[4 * k + 1], boxes[4 * k + 2], boxes[4 * k + 3]};
        if (r.top < 0 || r.left < 0 || r.height <= 0 || r.width <= 0 || r.top > heights[k] - r.height ||
            r.left > widths[k] - r.width)
          throw py::value_error("image " + std::to_string(k) + ": region (top, left, height, width) = (" +
                                std::to_string(r.top) + ", " + std::to_string(r.left) + ", " +
                                std::to_string(r.height) + ", " + std::to_string(r.width) + ") outside its " +
                                std::to_string(heights[k]) + "x" + std::to_string(widths[k]) + " image");
      }
      if (places[k] < 0 || places[k] > dst_size - 3 * r.height * r.width)
        throw py::value_error("image " + std::to_string(k) + ": its 3x" + std::to_string(r.height) + "x" +
                              std::to_string(r.width) + " place at " + std::to_string(places[k]) +
                              " runs past the " + std::to_string(dst_size) + "-byte destination");
      sources[k] = src + start[k];
    }
  }
};

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_fastload C++ I/O engine (thread pool, bounds-checked range reads, parallel memcpy)";

  g_range_error = PyErr_NewExceptionWithDoc(
      "torch_fastload._C.RangeError",
      "A range lies outside its file or the destination buffer, or is malformed.", PyExc_ValueError, nullptr);
  if (g_range_error == nullptr) throw py::error_already_set();
  PyObject* bases = PyTuple_Pack(2, g_range_error, PyExc_EOFError);
  if (bases == nullptr) throw py::error_already_set();
  g_short_read_error = PyErr_NewExceptionWithDoc(
      "torch_fastload._C.ShortReadError",
      "A file ended before a range that passed the size check (the file shrank during the read).", bases, nullptr);
  Py_DECREF(bases);
  if (g_short_read_error == nullptr) throw py::error_already_set();
  m.attr("RangeError") = py::handle(g_range_error);
  m.attr("ShortReadError") = py::handle(g_short_read_error);
  py::register_exception_translator(&translate);

  m.attr("DIRECT_ALIGNMENT") = tfl::kDirectAlign;
  m.attr("MAX_THREADS") = tfl::kMaxThreads;

  m.def("read_ranges", &read_ranges, py::arg("paths"), py::arg("file_index"), py::arg("offsets"),
        py::arg("lengths"), py::arg("dst_ptr"), py::arg("dst_size"), py::arg("dst_offsets"),
        py::arg("num_threads") = 16, py::arg("task_size") = int64_t(4) << 20, py::arg("o_direct") = false,
        "Read (paths[file_index[i]], offsets[i], lengths[i]) to dst_ptr + dst_offsets[i] for every i.\n"
        "Every range is checked against its file size and [0, dst_size) before any byte is read;\n"
        "the GIL is released throughout. Returns the total bytes read.");
  m.def("plan_ranges", &plan_ranges, py::arg("paths"), py::arg("file_index"), py::arg("offsets"),
        py::arg("lengths"), py::arg("dst_size"), py::arg("dst_offsets"), py::arg("task_size") = int64_t(4) << 20,
        py::arg("o_direct") = false, py::arg("dst_breaks") = std::vector<int64_t>{},
        "The tasks read_ranges would run, each a list of (file_index, offset, length, dst_offset) reads\n"
        "after coalescing and slicing; validates and opens the files like read_ranges, reads nothing.\n"
        "dst_breaks: destination offsets where a separate allocation starts (no read coalesced across).");
  m.def("copy_ranges", &copy_ranges, py::arg("dst_ptrs"), py::arg("src_ptrs"), py::arg("sizes"),
        py::arg("num_threads") = 16, py::arg("task_size") = int64_t(4) << 20, py::arg("streaming") = false,
        "memcpy(dst_ptrs[i], src_ptrs[i], sizes[i]) for every i on the pool; ranges must not overlap.\n"
        "streaming=True uses non-temporal stores (for destinations the CPU does not read next).\n"
        "Returns the total bytes copied.");
  m.def("rebase_offsets", &rebase_offsets, py::arg("dst_ptrs"), py::arg("src_ptrs"), py::arg("counts"),
        py::arg("shifts"), py::arg("src_widths"), py::arg("num_threads") = 16,
        "int64 dst_ptrs[i][k] = src_ptrs[i][k] + shifts[i] for k < counts[i], src read as int32 or int64\n"
        "(src_widths[i] 4 or 8): Arrow offsets rebased and widened into the slot, GIL released.\n"
        "Returns the bytes written.");
  py::class_<tfl::CopyEvent>(m, "CopyEvent",
                             "A CUDA event (timing on) of the driver API, made in `stream`'s context; recorded by\n"
                             "stage_host_batch without the GIL. query/elapsed_ms keep the GIL (they never block).")
      .def(py::init<uint64_t>(), py::arg("stream"))
      .def_property_readonly("handle", &tfl::CopyEvent::handle)
      .def_property_readonly("recorded", &tfl::CopyEvent::recorded)
      .def("record", &tfl::CopyEvent::record, py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("query", &tfl::CopyEvent::query)
      .def("synchronize", &tfl::CopyEvent::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("elapsed_ms", &tfl::CopyEvent::elapsed_ms, py::arg("end"))
      .def("elapsed_time", &tfl::CopyEvent::elapsed_ms, py::arg("end"), "Milliseconds to `end` (torch's name).")
      .def(
          "wait",
          [](const tfl::CopyEvent& event, const py::object& stream) {
            // a torch.cuda.Stream (Stream.wait_event calls event.wait(stream)) or a raw handle
            const uint64_t handle = py::hasattr(stream, "cuda_stream") ? stream.attr("cuda_stream").cast<uint64_t>()
                                                                        : stream.cast<uint64_t>();
            py::gil_scoped_release nogil;
            event.wait(handle);
          },
          py::arg("stream"));
  m.def("stage_host_batch", &stage_host_batch, py::arg("copy_dst"), py::arg("copy_src"), py::arg("copy_sizes"),
        py::arg("rebase_dst"), py::arg("rebase_src"), py::arg("rebase_counts"), py::arg("rebase_shifts"),
        py::arg("rebase_widths"), py::arg("threads"), py::arg("task_size"), py::arg("streaming"), py::arg("slot"),
        py::arg("device_ptr"), py::arg("nbytes"), py::arg("stream"), py::arg("start").none(true),
        py::arg("end").none(true), py::arg("direct_dst") = py::none(), py::arg("direct_src") = py::none(),
        py::arg("direct_sizes") = py::none(),
        "One batch staged without the GIL: copy_ranges into the slot, rebase_offsets there, then (device_ptr != 0)\n"
        "`start` recorded, slot[0, nbytes) -> device_ptr on `stream`, `end` recorded. Returns the host bytes written.\n"
        "direct_*: fields copied to device_ptr + direct_dst[i] from registered host memory direct_src[i] where it\n"
        "lies; the slot's copy skips their ranges (one cuMemcpyBatchAsync for all).");
  py::class_<tfl::DeviceStager>(m, "DeviceStager",
                                 "File ranges into GPU memory through a ring of pinned chunks that stays in\n"
                                 "the CPU cache: pread into a chunk, H2D on the caller's stream in groups of chunks, event-guarded reuse.")
      .def(py::init<uint64_t, int64_t, int64_t, int64_t>(), py::arg("ring_ptr"), py::arg("ring_bytes"),
           py::arg("chunk_bytes"), py::arg("group_chunks") = 0,
           "ring_ptr: pinned host memory the caller keeps alive until idle() returns True. group_chunks: chunks\n"
           "whose copies are enqueued together, one cuMemcpyBatchAsync and one event (0: the default).")
      .def("read", &stager_read, py::arg("paths"), py::arg("file_index"), py::arg("offsets"), py::arg("lengths"),
           py::arg("dst_ptr"), py::arg("dst_size"), py::arg("dst_offsets"), py::arg("stream"),
           py::arg("num_threads") = 16, py::arg("task_size") = int64_t(4) << 20, py::arg("o_direct") = false,
           py::arg("wait_for_chunks") = true,
           "Read every range into device memory at dst_ptr + dst_offsets[i], copies enqueued on `stream`;\n"
           "returns the bytes once every copy is enqueued. Same checks and errors as read_ranges.")
      .def("gather_mapped", &stager_gather_mapped, py::arg("files"), py::arg("file_index"), py::arg("offsets"),
           py::arg("lengths"), py::arg("dst_ptr"), py::arg("dst_size"), py::arg("dst_offsets"), py::arg("stream"),
           py::arg("function"), py::arg("piece_bytes"), py::arg("blocks"),
           "Gather ranges of MappedFiles into device memory with the given CUfunction (uva.py's kernel)\n"
           "on `stream`, its range tables in ring chunks; every range checked first. GIL released.")
      .def(
          "idle",
          [](tfl::DeviceStager& s, double timeout) {
            py::gil_scoped_release nogil;
            return s.idle(timeout);
          },
          py::arg("timeout") = 10.0, "Wait until no enqueued copy reads the ring; False on timeout.")
      .def_property_readonly("chunk_bytes", &tfl::DeviceStager::chunk_bytes)
      .def_property_readonly("chunks", &tfl::DeviceStager::chunks)
      .def_property_readonly("group_chunks", &tfl::DeviceStager::group_chunks)
      .def_property_readonly("free_chunks", &tfl::DeviceStager::free_chunks);
  py::class_<tfl::MappedFile>(m, "MappedFile",
                               "A file mapped read-only and registered with CUDA: the GPU's copy engines read\n"
                               "its page-cache pages directly. Pins the file's pages in RAM while it lives.")
      .def(py::init([](const std::string& path) {
             py::gil_scoped_release nogil;  // registering faults every page in
             return new tfl::MappedFile(path);
           }),
           py::arg("path"))
      .def_property_readonly("path", &tfl::MappedFile::path)
      .def_property_readonly("size", &tfl::MappedFile::size)
      .def_property_readonly(
          "data_ptr", [](const tfl::MappedFile& f) { return reinterpret_cast<uintptr_t>(f.data()); },
          "Address of byte 0: also the device address (unified addressing) for zero-copy kernels.");
  m.def("mapped_copy", &mapped_copy, py::arg("files"), py::arg("file_index"), py::arg("offsets"), py::arg("lengths"),
        py::arg("dst_ptr"), py::arg("dst_size"), py::arg("dst_offsets"), py::arg("streams"),
        "Enqueue DMA copies of (files[file_index[i]], offsets[i], lengths[i]) to device memory at\n"
        "dst_ptr + dst_offsets[i], round-robin over `streams`; every range checked first.");
  m.def(
      "page_cache_residency",
      [](const std::string& path) {
        py::gil_scoped_release nogil;
        return tfl::page_cache_residency(path);
      },
      py::arg("path"), "(resident pages, total pages) of the file in the page cache (mincore).");
  m.def(
      "probe_images",
      [](uint64_t data_ptr, int64_t size, const I64Array& offsets) {
        const std::vector<int64_t> bounds = to_vector(offsets, "offsets");
        if (bounds.empty()) throw py::value_error("offsets must hold count + 1 values");
        for (size_t i = 0; i + 1 < bounds.size(); ++i)
          if (bounds[i] < 0 || bounds[i + 1] < bounds[i] || bounds[i + 1] > size)
            throw py::value_error("image " + std::to_string(i) + " spans [" + std::to_string(bounds[i]) + ", " +
                                  std::to_string(bounds[i + 1]) + ") outside the " + std::to_string(size) +
                                  "-byte buffer");
        const int64_t count = static_cast<int64_t>(bounds.size()) - 1;
        std::string out(static_cast<size_t>(count * tfl::kProbeColumns) * sizeof(int64_t), '\0');
        {
          py::gil_scoped_release nogil;
          tfl::probe_images(reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(data_ptr)), size, bounds.data(),
                            count, reinterpret_cast<int64_t*>(&out[0]));
        }
        return py::bytes(out);
      },
      py::arg("data_ptr"), py::arg("size"), py::arg("offsets"),
      "Header probe of the encoded images [offsets[i], offsets[i+1]) of a host buffer: int64 rows of\n"
      "(format, height, width, components, flags, status) as bytes (see csrc/image_probe.h). GIL released.");
  m.attr("PROBE_COLUMNS") = tfl::kProbeColumns;
  py::class_<tfl::JpegSplitJob>(m, "JpegSplitJob",
                                 "A batch's JPEGs split between nvJPEG (claim_front) and CPU threads (run_back) by\n"
                                 "work stealing; the same arguments as decode_jpegs_planar, without num_threads.")
      .def(py::init([](uint64_t src_ptr, int64_t src_size, const I64Array& starts, const I64Array& lengths,
                       uint64_t dst_ptr, int64_t dst_size, const I64Array& dst_offsets, const I64Array& heights,
                       const I64Array& widths, const py::object& regions) {
             JpegBatchArgs a(src_ptr, src_size, starts, lengths, dst_ptr, dst_size, dst_offsets, heights, widths,
                             regions);
             return new tfl::JpegSplitJob(a.sources, a.lengths, a.dst, a.places, a.heights, a.widths, a.regions);
           }),
           py::arg("src_ptr"), py::arg("src_size"), py::arg("starts"), py::arg("lengths"), py::arg("dst_ptr"),
           py::arg("dst_size"), py::arg("dst_offsets"), py::arg("heights"), py::arg("widths"),
           py::arg("regions") = py::none())
      .def("run_back", &tfl::JpegSplitJob::run_back, py::arg("num_threads"), py::call_guard<py::gil_scoped_release>(),
           "Decode from the back on num_threads threads (GIL released) until the ends meet.")
      .def("claim_front", &tfl::JpegSplitJob::claim_front, py::arg("count"),
           py::call_guard<py::gil_scoped_release>(), "(first, last): up to count images from the front, for nvJPEG.")
      .def_property_readonly("split", &tfl::JpegSplitJob::split,
                             "Images [split, size) were taken by the CPU threads (final after run_back).")
      .def_property_readonly("size", &tfl::JpegSplitJob::size)
      .def_property_readonly("messages", &tfl::JpegSplitJob::messages,
                             "Per image: '' where the CPU decoded it (or never took it), else why not.");
  m.attr("HAVE_LIBJPEG") = tfl::jpeg_decoder_available();
  m.attr("JPEG_REGIONS") = tfl::jpeg_regions_available();
  m.def(
      "decode_jpegs_planar",
      [](uint64_t src_ptr, int64_t src_size, const I64Array& starts, const I64Array& lengths, uint64_t dst_ptr,
         int64_t dst_size, const I64Array& dst_offsets, const I64Array& heights, const I64Array& widths,
         int num_threads, const py::object& regions) {
        JpegBatchArgs a(src_ptr, src_size, starts, lengths, dst_ptr, dst_size, dst_offsets, heights, widths,
                        regions);
        std::vector<std::string> messages;
        {
          py::gil_scoped_release nogil;
          messages = tfl::decode_jpegs_planar(a.sources, a.lengths, a.dst, a.places, a.heights, a.widths, a.regions,
                                              num_threads);
        }
        return messages;
      },
      py::arg("src_ptr"), py::arg("src_size"), py::arg("starts"), py::arg("lengths"), py::arg("dst_ptr"),
      py::arg("dst_size"), py::arg("dst_offsets"), py::arg("heights"), py::arg("widths"), py::arg("num_threads"),
      py::arg("regions") = py::none(),
      "Decode the JPEGs [starts[k], starts[k] + lengths[k]) of a host buffer to RGB, planar uint8 at\n"
      "dst_ptr + dst_offsets[k], on num_threads threads of the engine's pool, GIL released (libjpeg-\n"
      "turbo; HAVE_LIBJPEG says whether it was built in). regions: None (each whole (3, H, W) image)\n"
      "or int64 (top, left, height, width) per image, flattened: only that part is decoded and\n"
      "written, (3, height, width), with a whole decode's pixels (JPEG_REGIONS: the rows and columns\n"
      "outside it are skipped, not decoded). Returns one message per image: '' where decoded, else\n"
      "why not (libjpeg's error, or a size other than heights[k] x widths[k]).");
  py::class_<PyOwnedBytes>(m, "OwnedBytes", py::buffer_protocol(),
                           "Bytes owned by C++ (gather_rows' results): view them with np.frombuffer.")
      .def_buffer([](PyOwnedBytes& b) {
        return py::buffer_info(b.data, 1, py::format_descriptor<uint8_t>::format(), 1, {b.size}, {py::ssize_t(1)});
      })
      .def("__len__", [](const PyOwnedBytes& b) { return b.size; });
  m.def("gather_rows", &gather_rows, py::arg("columns"), py::arg("rows"), py::arg("num_threads") = 8,
        "Rows `rows` (int64) of each column, in order, into new buffers, the GIL released: a column is a\n"
        "list of sources (its row groups, rows back to back; a bare tuple is one), each (offsets int32/int64\n"
        "array or None, values_ptr, values_bytes, elem_bytes, num_rows); a ragged source's rows are\n"
        "values[offsets[r]:offsets[r+1]] of elem_bytes each, a fixed one's elem_bytes a row.\n"
        "Returns [(offsets OwnedBytes of int64 from 0, or None; values OwnedBytes)].\n"
        "A row out of range or offsets outside the values raise RangeError naming the column and row.");
  m.def(
      "gathered_region",
      [](int64_t nbytes) {
        auto [base, size] = tfl::gathered_region(nbytes);
        return py::make_tuple(base, size);
      },
      py::arg("nbytes"),
      "Map (once a process; later calls return it) the region gather_rows' buffers are carved from\n"
      "before malloc, rounded up to 2 MiB and faulted in; returns (address, bytes), (0, 0) where none\n"
      "is made. The caller registers it with CUDA so batches copy from it in place.");
  py::class_<PyInt64Buffer>(m, "Int64Buffer", py::buffer_protocol(),
                            "An int64 array owned by C++ (a sampler's result): view it with np.asarray.")
      .def_buffer([](PyInt64Buffer& b) {
        std::vector<py::ssize_t> strides(b.shape.size());
        py::ssize_t stride = sizeof(int64_t);
        for (size_t i = b.shape.size(); i-- > 0;) {
          strides[i] = stride;
          stride *= b.shape[i];
        }
        return py::buffer_info(b.array.data.get(), sizeof(int64_t), py::format_descriptor<int64_t>::format(),
                               static_cast<py::ssize_t>(b.shape.size()), b.shape, strides);
      });
  py::class_<PyNeighborSampler>(m, "NeighborSampler",
                                "Uniform neighbour sampling over a CSR graph (indptr int64, indices int32/int64),\n"
                                "multi-threaded, the GIL released; the arrays are read in place and kept alive.")
      .def(py::init(&make_sampler), py::arg("indptr"), py::arg("indices"))
      .def("sample", &sampler_sample, py::arg("seeds"), py::arg("fanouts"), py::arg("key"),
           py::arg("num_threads") = 0,
           "(n_id, edge_index) as Int64Buffers (shapes (n,) and (2, E)): the seeds, then each hop's new\n"
           "nodes; edge_index rows source (sampled neighbour), target, in local ids. Draw j of frontier\n"
           "node i at hop h comes from a hash of (key, h, i, j): the result depends on nothing else\n"
           "(not on num_threads; 0 = min(8, usable CPUs)). ValueError for seeds outside [0, num_nodes).")
      .def_property_readonly("num_nodes", [](const PyNeighborSampler& s) { return s.impl->num_nodes(); })
      .def_property_readonly("num_edges", [](const PyNeighborSampler& s) { return s.impl->num_edges(); })
      .def_property_readonly("index_bytes", [](const PyNeighborSampler& s) { return s.impl->index_bytes(); })
      .def_property_readonly("max_degree", [](const PyNeighborSampler& s) { return s.impl->max_degree(); })
      .def("scratch_slot_bytes", [](const PyNeighborSampler& s) { return s.impl->scratch_slot_bytes(); },
           "Bytes the idle scratch sets hold in per-slot arrays (min(fanout, max degree) slots per node)")
      .def_static("default_threads", &tfl::NeighborSampler::default_threads,
                  "min(8, CPUs this process may run on): the threads num_threads=0 uses.");
  m.def(
      "pool_size", [] { return tfl::ThreadPool::instance().num_workers(); },
      "Worker threads in the persistent pool (the calling thread works too).");
  m.def(
      "driver_call_counts",
      [] {
        py::dict out;
        for (const auto& c : tfl::cuda::call_counts()) {
          py::object thread = py::int_(c.thread);
          if (!out.contains(thread)) out[thread] = py::dict();
          out[thread].cast<py::dict>()[c.name] = c.calls;
        }
        return out;
      },
      "{thread id: {driver entry point: calls}} of the engine's own driver calls so far, counted\n"
      "where TORCH_FASTLOAD_COUNT_DRIVER_CALLS=1 was set before its first driver call (probes);\n"
      "empty otherwise.");
  bind_native_loop(m);
  bind_range_plan(m);
}

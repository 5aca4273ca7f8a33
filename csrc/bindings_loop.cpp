// Python bindings of NativeLoop (native_loop.h): arguments converted under the GIL, every wait
// and every batch's work run without it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cuda_driver.h"
#include "native_loop.h"
#include "py_arrays.h"

namespace {

// A field from Python: (kind, rows, row_bytes, memory, file, file_offset, records, name, dma).
tfl::LoopField field_of(const py::tuple& t) {
  if (t.size() != 9) throw py::value_error("a native loop field is a 9-tuple");
  tfl::LoopField f;
  f.kind = t[0].cast<int>();
  f.rows = t[1].cast<int64_t>();
  f.row_bytes = t[2].cast<int64_t>();
  f.memory = t[3].cast<uintptr_t>();
  f.file = t[4].cast<int32_t>();
  f.file_offset = t[5].cast<int64_t>();
  f.records = t[6].cast<uintptr_t>();
  f.name = t[7].cast<std::string>();
  f.dma = t[8].cast<bool>();
  return f;
}

std::unique_ptr<tfl::NativeLoop> make_loop(const py::list& fields, std::vector<std::string> paths, bool cuda,
                                           uint64_t stream, uint64_t slots, int64_t slot_bytes, int num_slots,
                                           int workers, int copy_threads, int io_threads, int64_t task_size,
                                           bool o_direct, bool nontemporal, tfl::DeviceStager* ring,
                                           uint64_t gather_function, int piece_bytes, int blocks,
                                           bool unsafe_slot_reuse, int debug_jitter_us, bool memory_rows_kernel,
                                           bool unsafe_skip_allocation_wait, bool debug_lose_wakeups,
                                           int debug_idle_pause_us, bool debug_old_idle_wait,
                                           int copy_timing_every, bool wake_all, bool debug_no_pass_on,
                                           int debug_submit_pause_us, bool ordered_copies, bool copies_on_consumer) {
  tfl::LoopConfig cfg;
  for (const py::handle item : fields) cfg.fields.push_back(field_of(py::reinterpret_borrow<py::tuple>(item)));
  cfg.paths = std::move(paths);
  cfg.cuda = cuda, cfg.stream = stream, cfg.slots = slots, cfg.slot_bytes = slot_bytes, cfg.num_slots = num_slots;
  cfg.workers = workers, cfg.copy_threads = copy_threads, cfg.io_threads = io_threads, cfg.task_size = task_size;
  cfg.o_direct = o_direct, cfg.nontemporal = nontemporal, cfg.ring = ring;
  cfg.gather_function = gather_function, cfg.piece_bytes = piece_bytes, cfg.blocks = blocks;
  cfg.unsafe_slot_reuse = unsafe_slot_reuse;
  cfg.unsafe_skip_allocation_wait = unsafe_skip_allocation_wait;
  cfg.debug_jitter_us = debug_jitter_us;
  cfg.debug_lose_wakeups = debug_lose_wakeups, cfg.debug_idle_pause_us = debug_idle_pause_us;
  cfg.debug_old_idle_wait = debug_old_idle_wait, cfg.wake_all = wake_all;
  cfg.debug_no_pass_on = debug_no_pass_on, cfg.debug_submit_pause_us = debug_submit_pause_us;
  cfg.ordered_copies = ordered_copies;
  cfg.copies_on_consumer = copies_on_consumer && cuda;
  if (copy_timing_every < 0) throw py::value_error("copy_timing_every must be >= 0");
  cfg.copy_timing_every = copy_timing_every;
  cfg.memory_rows_kernel = memory_rows_kernel && gather_function != 0;
  return std::make_unique<tfl::NativeLoop>(std::move(cfg));
}

py::dict stats_dict(const tfl::LoopStats& s) {
  py::dict d;
  d["batches"] = s.batches, d["samples"] = s.samples;
  d["stage_s"] = s.stage_s, d["read_s"] = s.read_s, d["copy_s"] = s.copy_s, d["timed_bytes"] = s.timed_bytes;
  d["staged_bytes"] = s.staged_bytes, d["copied_bytes"] = s.copied_bytes;
  d["memory_bytes"] = s.memory_bytes, d["mapped_bytes"] = s.mapped_bytes;
  d["ring_bytes"] = s.ring_bytes, d["pread_bytes"] = s.pread_bytes, d["dma_bytes"] = s.dma_bytes;
  d["late_copies"] = s.late_copies;
  return d;
}

}  // namespace

void bind_native_loop(py::module_& m) {
  // Host registration through the driver: the runtime's cudaHostRegister leaves a failure in the
  // calling thread's last-error slot, and torch's next kernel-launch check raises it as its own.
  m.def(
      "host_register",
      [](uintptr_t ptr, size_t nbytes, int device, unsigned flags) {
        return tfl::cuda::in_primary_context(device, [&] {
          return tfl::cuda::api().mem_host_register(reinterpret_cast<void*>(ptr), nbytes, flags);
        });
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("device"), py::arg("flags") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "cuMemHostRegister of [ptr, ptr + nbytes) in device `device`'s primary context; the CUresult (0: done).");
  m.def(
      "host_unregister",
      [](uintptr_t ptr, int device) {
        return tfl::cuda::in_primary_context(
            device, [&] { return tfl::cuda::api().mem_host_unregister(reinterpret_cast<void*>(ptr)); });
      },
      py::arg("ptr"), py::arg("device"), py::call_guard<py::gil_scoped_release>(),
      "cuMemHostUnregister in device `device`'s primary context; the CUresult (0: done).");
  m.def("stream_wait_stream", &tfl::cuda::stream_wait_stream, py::arg("waiter"), py::arg("producer"),
        py::call_guard<py::gil_scoped_release>(),
        "Stream `waiter` waits for the work enqueued on `producer` so far (raw CUstream handles), GIL released.");
  py::class_<tfl::NativeLoop>(m, "NativeLoop",
                              "The loader's GIL-free steady state for planned sources: index batches in,\n"
                              "batches staged into a device (or host) buffer out (csrc/native_loop.h).")
      .def(py::init(&make_loop), py::arg("fields"), py::arg("paths"), py::arg("cuda"), py::arg("stream"),
           py::arg("slots"), py::arg("slot_bytes"), py::arg("num_slots"), py::arg("workers"), py::arg("copy_threads"),
           py::arg("io_threads"), py::arg("task_size"), py::arg("o_direct"), py::arg("nontemporal"),
           py::arg("ring").none(true), py::arg("gather_function"), py::arg("piece_bytes"), py::arg("blocks"),
           py::arg("unsafe_slot_reuse") = false, py::arg("debug_jitter_us") = 0, py::arg("memory_rows_kernel") = false,
           py::arg("unsafe_skip_allocation_wait") = false, py::arg("debug_lose_wakeups") = false,
           py::arg("debug_idle_pause_us") = 0, py::arg("debug_old_idle_wait") = false,
           py::arg("copy_timing_every") = 16, py::arg("wake_all") = false,
           py::arg("debug_no_pass_on") = false, py::arg("debug_submit_pause_us") = 0,
           py::arg("ordered_copies") = true, py::arg("copies_on_consumer") = false, py::keep_alive<1, 15>())
      .def(
          "submit",
          [](tfl::NativeLoop& loop, int64_t position, const I64Array& indices, uint64_t out, int64_t out_bytes,
             uint64_t home) {
            std::vector<int64_t> v = to_vector(indices, "indices");
            py::gil_scoped_release no_gil;  // the loop's own lock guards it: the GIL is not needed
            return loop.submit(position, std::move(v), out, out_bytes, home);
          },
          py::arg("position"), py::arg("indices"), py::arg("out") = 0, py::arg("out_bytes") = -1,
          py::arg("home") = 0,
          "Register a batch; returns [output bytes, (offset, bytes) per field...] or [-1] (take() raises\n"
          "why). With out_bytes >= 0 it also starts into `out` (a layout known from row_layout).")
      .def(
          "submit_fields",
          [](tfl::NativeLoop& loop, int64_t position, const I64Array& indices, const I64Array& outs,
             const I64Array& capacities, uint64_t home) {
            std::vector<int64_t> v = to_vector(indices, "indices");
            std::vector<int64_t> out_addresses = to_vector(outs, "outs"), sizes = to_vector(capacities, "capacities");
            py::gil_scoped_release no_gil;
            return loop.submit_fields(position, std::move(v), out_addresses, sizes, home);
          },
          py::arg("position"), py::arg("indices"), py::arg("outs"), py::arg("capacities"), py::arg("home") = 0,
          "submit() and start into one buffer per output field (addresses `outs`, sizes `capacities`).")
      .def(
          "submit_group",
          [](tfl::NativeLoop& loop, int64_t first_position, const I64Array& indices, int64_t count,
             const I64Array& outs, const I64Array& capacities, uint64_t home, const std::optional<I64Array>& pitches) {
            std::vector<int64_t> addresses = to_vector(outs, "outs");
            if (pitches) {  // outs: each field's block; batch j's field f at outs[f] + j * pitches[f]
              const std::vector<int64_t> pitch = to_vector(*pitches, "pitches");
              if (pitch.size() != addresses.size() || count < 1)
                throw py::value_error("pitches needs one pitch per block in outs and count >= 1");
              std::vector<int64_t> bases = std::move(addresses);
              addresses.resize(bases.size() * size_t(count));
              for (size_t j = 0; j < size_t(count); ++j)
                for (size_t f = 0; f < bases.size(); ++f) addresses[j * bases.size() + f] = bases[f] + int64_t(j) * pitch[f];
            }
            std::vector<int64_t> flat = to_vector(indices, "indices"), sizes = to_vector(capacities, "capacities");
            // Without the GIL: on the turn thread the training thread runs Python meanwhile (a
            // group's submit is ~50 us inside the main job on an H200).
            py::gil_scoped_release no_gil;
            return loop.submit_group(first_position, flat, count, addresses, sizes, home);
          },
          py::arg("first_position"), py::arg("indices"), py::arg("count"), py::arg("outs"), py::arg("capacities"),
          py::arg("home") = 0, py::arg("pitches") = py::none(),
          "submit_fields() for `count` batches in one call (indices: count x n flat, outs: count x fields,\n"
          "or with `pitches` each field's block, batch j at j pitches), waking one worker; returns each\n"
          "batch's output bytes, or -1 where take() will raise.")
      .def(
          "start_fields",
          [](tfl::NativeLoop& loop, int64_t position, const I64Array& outs, const I64Array& capacities,
             uint64_t home) {
            loop.start_fields(position, to_vector(outs, "outs"), to_vector(capacities, "capacities"), home);
          },
          py::arg("position"), py::arg("outs"), py::arg("capacities"), py::arg("home") = 0,
          "start() with one buffer per output field.")
      .def("row_layout", &tfl::NativeLoop::row_layout, py::arg("n"),
           "The layout of any batch of n samples (fields of fixed-size rows only).")
      .def("start", &tfl::NativeLoop::start, py::arg("position"), py::arg("out"), py::arg("out_bytes"),
           py::arg("home") = 0,
           "Stage the batch into `out`: device memory allocated on stream `home`, or host memory.")
      .def("take", &tfl::NativeLoop::take, py::arg("position"), py::arg("consumer"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>(),
           "Wait up to `timeout` s for the batch; False if not staged. Else the consumer stream waits on\n"
           "its copies (unless already done) and the batch is forgotten; raises its error.")
      .def("wait_below", &tfl::NativeLoop::wait_below, py::arg("n"), py::arg("timeout"), py::arg("settle_us") = 0,
           py::call_guard<py::gil_scoped_release>(),
           "Wait up to `timeout` s, without the GIL, until fewer than n batches are submitted and not yet\n"
           "taken: 1 (then sleep settle_us), 0 at the timeout, -1 once the loop stops.")
      .def("set_rows_kernel", &tfl::NativeLoop::set_rows_kernel, py::arg("on"),
           "Registered in-memory rows of batches started from now on go by the gather kernel (True) or the\n"
           "copy engines (False); True needs memory_rows_kernel.")
      .def_property_readonly("rows_kernel", &tfl::NativeLoop::rows_kernel)
      .def("set_mapped_kernel", &tfl::NativeLoop::set_mapped_kernel, py::arg("on"),
           "Whether batches started from now on move ranges of mapped files by the gather kernel (True)\n"
           "or by the copy engines (False); True needs the gather function and the ring.")
      .def_property_readonly("mapped_kernel", &tfl::NativeLoop::mapped_kernel)
      .def("set_mapped", &tfl::NativeLoop::set_mapped, py::arg("file"), py::arg("mapped").none(true),
           py::keep_alive<1, 3>(), "Copy this file's ranges out of its registered mapping from now on.")
      .def("stop", &tfl::NativeLoop::stop, py::arg("timeout"), py::arg("wait_for_copies"),
           py::call_guard<py::gil_scoped_release>(),
           "Stop and join the workers; with wait_for_copies, True once every copy enqueued so far completed.")
      .def("stats", [](tfl::NativeLoop& loop) { return stats_dict(loop.stats()); });
}

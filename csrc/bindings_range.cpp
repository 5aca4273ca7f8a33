// Python bindings of the range-batch planner (range_plan.h): descriptors converted under the GIL,
// the plan made and the batch staged or written without it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "host_stage.h"
#include "py_arrays.h"
#include "range_plan.h"

namespace {

// groups: one flat int64 descriptor array a row group (kRangeColumnWidth values a column);
// spans: (group, start, stop) triples, flattened; masked: one 0/1 a column; regions: (start, end)
// pairs, flattened.
tfl::RangePlan plan_range(const py::list& groups, const I64Array& spans, const I64Array& masked, int64_t align,
                          const I64Array& regions) {
  const std::vector<int64_t> flat_masked = to_vector(masked, "masked");
  const size_t columns = flat_masked.size();
  std::vector<std::vector<tfl::RangeColumn>> described;
  for (const py::handle g : groups) {
    const std::vector<int64_t> d = to_vector(py::reinterpret_borrow<py::object>(g), "descriptor");
    if (d.size() != columns * tfl::kRangeColumnWidth)
      throw py::value_error("a row group's descriptor holds " + std::to_string(d.size()) + " values, not " +
                            std::to_string(columns) + " columns x " + std::to_string(tfl::kRangeColumnWidth));
    std::vector<tfl::RangeColumn> cols(columns);
    for (size_t j = 0; j < columns; ++j) {
      const int64_t* v = d.data() + j * tfl::kRangeColumnWidth;
      cols[j] = tfl::RangeColumn{v[0], static_cast<int>(v[1]), v[2], v[3], v[4], v[5], v[6]};
    }
    described.push_back(std::move(cols));
  }
  const std::vector<int64_t> flat_spans = to_vector(spans, "spans");
  if (flat_spans.size() % 3) throw py::value_error("spans are (group, start, stop) triples");
  std::vector<tfl::RangeSpan> cut;
  for (size_t i = 0; i < flat_spans.size(); i += 3)
    cut.push_back(tfl::RangeSpan{static_cast<int>(flat_spans[i]), flat_spans[i + 1], flat_spans[i + 2]});
  const std::vector<int64_t> flat_regions = to_vector(regions, "regions");
  if (flat_regions.size() % 2) throw py::value_error("regions are (start, end) pairs");
  std::vector<std::pair<int64_t, int64_t>> pairs;
  for (size_t i = 0; i < flat_regions.size(); i += 2) pairs.emplace_back(flat_regions[i], flat_regions[i + 1]);
  std::vector<uint8_t> mask_flags(columns);
  for (size_t j = 0; j < columns; ++j) mask_flags[j] = flat_masked[j] != 0;
  py::gil_scoped_release nogil;
  return tfl::plan_range(described, cut, mask_flags, align, pairs);
}

int64_t sum(const std::vector<int64_t>& v) {
  int64_t total = 0;
  for (int64_t x : v) total += x;
  return total;
}

}  // namespace

void bind_range_plan(py::module_& m) {
  py::class_<tfl::RangePlan>(m, "RangePlan",
                             "A batch of consecutive Parquet rows planned by plan_range: its fields' places in\n"
                             "the flat buffer and the copies, rebases and direct copies that fill it.")
      .def_readonly("total", &tfl::RangePlan::total, "Bytes of the flat buffer (padding included).")
      .def_readonly("payload", &tfl::RangePlan::payload, "Bytes of the fields.")
      .def_readonly("rows", &tfl::RangePlan::rows)
      .def_readonly("bad_column", &tfl::RangePlan::bad_column,
                    "A column not masked whose rows hold nulls (-1: none); nothing else is planned then.")
      .def_readonly("bad_group", &tfl::RangePlan::bad_group, "The index in `groups` of the row group it does it in.")
      .def_property_readonly("fields",
                             [](const tfl::RangePlan& p) {
                               py::list out;
                               for (size_t i = 0; i < p.field_offset.size(); ++i)
                                 out.append(py::make_tuple(p.field_offset[i], p.field_bytes[i], p.field_rows[i]));
                               return out;
                             },
                             "(offset, bytes, leading dimension) of each field, in the batch dict's order.")
      .def_property_readonly("direct_bytes", [](const tfl::RangePlan& p) { return sum(p.direct_sizes); })
      .def_property_readonly("slot_bytes", [](const tfl::RangePlan& p) { return sum(p.copy_sizes); },
                             "Bytes copied into the slot (the rebased offsets not counted).")
      .def(
          "write_host",
          [](const tfl::RangePlan& p, uint64_t dst, int threads) {
            py::gil_scoped_release nogil;
            return tfl::write_range_host(p, dst, threads);
          },
          py::arg("dst"), py::arg("threads") = 4,
          "The whole batch written into host memory at dst (total bytes), the direct fields too; GIL released.");
  m.def("plan_range", &plan_range, py::arg("groups"), py::arg("spans"), py::arg("masked"), py::arg("align"),
        py::arg("regions"),
        "A RangePlan of consecutive rows, the GIL released: groups, one int64 descriptor array a row group\n"
        "(per column: offsets address or 0, offsets width 4/8 or 0, values address, values bytes, bytes of\n"
        "a value (ragged) or of a row (fixed), rows, validity address or 0); spans, (group, start, stop)\n"
        "flattened, in order, none empty; masked, 0/1 a column; regions, (start, end) of direct regions\n"
        "flattened. Rows or offsets outside a row group raise RangeError naming the column.");
  m.def(
      "stage_range_plan",
      [](const tfl::RangePlan& plan, int threads, int64_t task_size, bool streaming, uint64_t slot,
         uint64_t device_ptr, uint64_t stream, tfl::CopyEvent* start, tfl::CopyEvent* end) {
        const tfl::HostStage s = tfl::range_stage(plan, slot, device_ptr, stream, threads, task_size, streaming);
        py::gil_scoped_release nogil;
        return tfl::run_host_stage(s, start, end);
      },
      py::arg("plan"), py::arg("threads"), py::arg("task_size"), py::arg("streaming"), py::arg("slot"),
      py::arg("device_ptr"), py::arg("stream"), py::arg("start").none(true), py::arg("end").none(true),
      "stage_host_batch of a RangePlan into the slot at `slot`: its copies and rebases there, then `start`,\n"
      "the slot (less the direct fields) and the direct fields to device_ptr on `stream`, `end`. GIL released.");
}

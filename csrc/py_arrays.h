// Integer arrays from Python for the bindings: through the buffer protocol (numpy arrays,
// array.array, memoryview) or as sequences of ints. pybind11's numpy caster is not used, so the
// module does not depend on numpy's C API (or its version). Copied before the GIL is released,
// so another Python thread mutating an array cannot change a range after it was checked.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace py = pybind11;

using I64Array = py::object;

template <typename T>
inline void widen(const py::buffer_info& info, std::vector<int64_t>& out) {
  const char* base = static_cast<const char*>(info.ptr);
  for (size_t i = 0; i < out.size(); ++i) {
    T value;
    std::memcpy(&value, base + static_cast<ptrdiff_t>(i) * info.strides[0], sizeof(T));
    out[i] = static_cast<int64_t>(value);
  }
}

inline std::vector<int64_t> to_vector(const py::object& a, const char* name) {
  if (PyObject_CheckBuffer(a.ptr())) {
    const py::buffer_info info = py::reinterpret_borrow<py::buffer>(a).request();
    if (info.ndim != 1)
      throw py::value_error(std::string(name) + " must be 1-D, got " + std::to_string(info.ndim) + "-D");
    std::string format = info.format;
    if (!format.empty() && std::string("@=<").find(format[0]) != std::string::npos) format = format.substr(1);
    std::vector<int64_t> out(static_cast<size_t>(info.shape[0]));
    if (format.size() == 1 && (format[0] == 'q' || format[0] == 'l' || format[0] == 'n') && info.itemsize == 8)
      widen<int64_t>(info, out);
    else if (format.size() == 1 && (format[0] == 'i' || format[0] == 'l') && info.itemsize == 4)
      widen<int32_t>(info, out);
    else if (format == "h" && info.itemsize == 2)
      widen<int16_t>(info, out);
    else if (format == "b" && info.itemsize == 1)
      widen<int8_t>(info, out);
    else
      throw py::type_error(std::string(name) + " must hold signed integers, got buffer format '" + info.format +
                           "' with itemsize " + std::to_string(info.itemsize));
    return out;
  }
  if (!PySequence_Check(a.ptr()) || PyUnicode_Check(a.ptr()) || PyBytes_Check(a.ptr()))
    throw py::type_error(std::string(name) + " must be a 1-D integer array or a sequence of ints");
  const py::sequence seq = py::reinterpret_borrow<py::sequence>(a);
  std::vector<int64_t> out;
  out.reserve(seq.size());
  for (const py::handle item : seq) {
    if (!PyLong_Check(item.ptr()))
      throw py::type_error(std::string(name) + " must hold ints, got " + std::string(py::str(py::type::of(item))));
    out.push_back(item.cast<int64_t>());
  }
  return out;
}


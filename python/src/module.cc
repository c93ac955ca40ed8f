// pskv._pskv: the C++ client and server for Python. The pure-Python package `pskv` re-exports it.
#include <pybind11/pybind11.h>

#include <array>

#include "client_binding.h"
#include "pskv/error.h"

namespace py = pybind11;

namespace {
constexpr std::size_t kErrcCount = static_cast<std::size_t>(pskv::Errc::unsupported) + 1;
// pskv.Error's subclasses, one per Errc, handed over by pskv/__init__.py (the hierarchy lives in
// Python so that they can also derive from ValueError, TimeoutError and so on). Strong references
// kept for the life of the process.
std::array<PyObject*, kErrcCount> g_error_classes{};
}  // namespace

PYBIND11_MODULE(_pskv, m) {
  m.doc() = "pskv's C++ client and server (see the pskv package)";
  m.def("_set_error_classes", [](py::dict classes) {
    for (std::size_t i = 0; i < kErrcCount; ++i) {
      const auto name = pskv::errc_name(static_cast<pskv::Errc>(i));
      py::object cls = classes[py::str(name.data(), name.size())];
      Py_XDECREF(g_error_classes[i]);
      g_error_classes[i] = cls.release().ptr();
    }
  });
  m.def("errc_names", [] {
    py::list names;
    for (std::size_t i = 0; i < kErrcCount; ++i) {
      const auto name = pskv::errc_name(static_cast<pskv::Errc>(i));
      names.append(py::str(name.data(), name.size()));
    }
    return names;
  });
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const pskv::Error& e) {
      const auto index = static_cast<std::size_t>(e.code());
      PyObject* cls = index < kErrcCount && g_error_classes[index] ? g_error_classes[index] : PyExc_RuntimeError;
      PyErr_SetString(cls, e.what());
    }
  });
  pskv::python::bind_client(m);
  pskv::python::bind_server(m);
}

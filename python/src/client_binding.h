#pragma once

#include <pybind11/pybind11.h>

#include <chrono>

namespace pskv::python {

// Seconds from Python as whole milliseconds (rounded); pskv::Error(invalid_argument) naming
// `name` unless >= 0.
std::chrono::milliseconds to_ms(double seconds, const char* name);

void bind_client(pybind11::module_& m);
void bind_server(pybind11::module_& m);

}  // namespace pskv::python

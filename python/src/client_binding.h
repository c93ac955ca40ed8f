#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <string>

#include "pskv/update_rule.h"

namespace pskv::python {

// Seconds from Python as whole milliseconds (rounded); pskv::Error(invalid_argument) naming
// `name` unless >= 0.
std::chrono::milliseconds to_ms(double seconds, const char* name);

// An update rule named from Python with its parameters (the servers' keyword arguments and a
// table's); pskv::Error(invalid_argument) listing the rules for an unknown name.
UpdateRuleConfig rule_config(const std::string& rule, float lr, float momentum, float beta1, float beta2, float eps,
                             float weight_decay);

void bind_client(pybind11::module_& m);
void bind_server(pybind11::module_& m);

}  // namespace pskv::python

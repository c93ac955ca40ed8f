#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <limits>
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

// An integer argument as Python passed it. pybind11 refuses -1 for an unsigned parameter (and
// "2" for any integer one) with a dump of the whole signature; taking the object as it is lets
// whole_number() name the argument and its range instead.
struct PyInteger {
  pybind11::object value;
};

// `value` as a T in [low, high]; pskv::Error(invalid_argument) naming `name`, the range and the
// value otherwise (a bool, a float or a str is refused too: counts are never converted).
template <class T>
T whole_number(const PyInteger& value, const char* name, T low = 0, T high = std::numeric_limits<T>::max());

void bind_client(pybind11::module_& m);
void bind_server(pybind11::module_& m);

}  // namespace pskv::python

namespace pybind11::detail {
template <>
struct type_caster<pskv::python::PyInteger> {
  PYBIND11_TYPE_CASTER(pskv::python::PyInteger, const_name("int"));
  bool load(handle source, bool) {
    if (!source) return false;
    value.value = reinterpret_borrow<object>(source);
    return true;
  }
  static handle cast(const pskv::python::PyInteger& v, return_value_policy, handle) { return v.value.inc_ref(); }
};
}  // namespace pybind11::detail

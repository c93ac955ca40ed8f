// What a pull may see of a value that one pusher keeps adding 1 to, for the tests that pull
// while it pushes. Header-only, so unit tests that do not link the support library can use it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <span>

namespace pskv::testing {

// Every float is from the same push.
inline ::testing::AssertionResult one_push(std::span<const float> v) {
  const auto other = std::find_if(v.begin(), v.end(), [&](float x) { return x != v[0]; });
  if (other == v.end()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "float " << (other - v.begin()) << " is " << *other << ", float 0 is "
                                       << v[0];
}

// The newer push's floats up to some point, the older push's after it: a push applied piece by
// piece, in order, each piece whole.
inline ::testing::AssertionResult newer_push_then_older(std::span<const float> v) {
  const auto older = std::find_if(v.begin(), v.end(), [&](float x) { return x != v[0]; });
  if (older == v.end()) return ::testing::AssertionSuccess();
  if (*older != v[0] - 1.0f)
    return ::testing::AssertionFailure() << "float " << (older - v.begin()) << " is " << *older << ", float 0 is "
                                         << v[0] << ": more than one push apart";
  const auto other = std::find_if(older, v.end(), [&](float x) { return x != *older; });
  if (other == v.end()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "float " << (other - v.begin()) << " is " << *other
                                       << " after the older push's floats began at float " << (older - v.begin())
                                       << ": the pieces did not land in order, or one tore";
}

}  // namespace pskv::testing

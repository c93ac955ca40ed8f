// The error a call throws, for the tests that check what a refusal says. Header-only, so unit
// tests that do not link the support library can use it.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <initializer_list>
#include <string>

#include "pskv/error.h"

namespace pskv::testing {

// Runs f, which must throw pskv::Error with `code` and a message holding every one of `parts`.
inline void expect_error(const std::function<void()>& f, Errc code, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
  }
}

}  // namespace pskv::testing

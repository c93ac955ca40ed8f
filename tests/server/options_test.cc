// Options that would make a server wait forever, compute NaN or silently ignore what it was asked
// are refused before anything starts, with a message naming the flag.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "pskv/error.h"
#include "pskv/server.h"

namespace pskv {
namespace {

void expect_refused(const std::function<void(ServerOptions&)>& change, const std::string& names) {
  ServerOptions o;
  o.uri = "tcp://127.0.0.1:0";
  change(o);
  try {
    Server s(o);
    ADD_FAILURE() << "a server started with options that name " << names;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << e.what();
  }
}

TEST(ServerOptions, WaitsMustBeBounded) {
  expect_refused([](ServerOptions& o) { o.wait_timeout = std::chrono::milliseconds(-1); }, "--wait-timeout-ms");
  expect_refused([](ServerOptions& o) { o.wait_timeout = std::chrono::milliseconds(0); }, "--wait-timeout-ms");
  expect_refused([](ServerOptions& o) { o.frame_timeout = std::chrono::milliseconds(0); }, "--frame-timeout-ms");
  expect_refused([](ServerOptions& o) { o.handshake_timeout = std::chrono::milliseconds(-5); },
                 "--handshake-timeout-ms");
}

TEST(ServerOptions, TheUpdateRuleMustBeFinite) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  expect_refused([&](ServerOptions& o) { o.rule.lr = nan; }, "--lr");
  expect_refused([&](ServerOptions& o) { o.rule.lr = -0.1f; }, "--lr");
  expect_refused([&](ServerOptions& o) { o.rule.momentum = 1.0f; }, "--momentum");
  expect_refused([&](ServerOptions& o) { o.rule.beta1 = nan; }, "--beta1");
  expect_refused([&](ServerOptions& o) { o.rule.beta2 = 1.5f; }, "--beta2");
  expect_refused([&](ServerOptions& o) { o.rule.eps = 0.0f; }, "--eps");
  expect_refused([&](ServerOptions& o) { o.rule.weight_decay = inf; }, "--weight-decay");
}

TEST(ServerOptions, SettingsAModeIgnoresAreRefused) {
  expect_refused(
      [](ServerOptions& o) {
        o.mode = ConsistencyMode::asp;
        o.staleness = 3;
      },
      "--staleness 3 applies to --mode ssp only");
  expect_refused(
      [](ServerOptions& o) {
        o.mode = ConsistencyMode::bsp;
        o.num_workers = 2;
        o.sync_required = 1;
      },
      "--sync-required applies to --mode sync only");
  expect_refused([](ServerOptions& o) { o.mode = ConsistencyMode::bsp; }, "needs --workers");
  // Every client checks a server's worker count against the same bound before sizing by it.
  expect_refused([](ServerOptions& o) { o.num_workers = kMaxWorkers + 1; }, "a server clocks");
}

TEST(ServerOptions, LimitsMustLetTheLargestRequestThrough) {
  expect_refused(
      [](ServerOptions& o) {
        o.max_request_bytes = 64ull << 20;
        o.memory_budget_bytes = 32ull << 20;
      },
      "--memory-budget-mb");
  expect_refused([](ServerOptions& o) { o.max_connections_per_address = 0; }, "--max-connections-per-address");
}

TEST(ServerOptions, SensibleOptionsStart) {
  ServerOptions o;
  o.uri = "tcp://127.0.0.1:0";
  o.mode = ConsistencyMode::ssp;
  o.num_workers = 2;
  o.staleness = 3;
  o.rule.rule = UpdateRule::adam;
  o.rule.lr = 1e-3f;
  Server s(o);
  EXPECT_NE(s.uri().find("tcp://127.0.0.1:"), std::string::npos);
}

}  // namespace
}  // namespace pskv

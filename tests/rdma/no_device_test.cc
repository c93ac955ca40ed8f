// On a host without RDMA (no driver, no device), asking for rdma:// must fail at once with an
// error that says what to do, never crash or hang.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include "pskv/client.h"
#include "pskv/server.h"

namespace pskv {
namespace {

bool device_present() {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list) ibv_free_device_list(list);
  return n > 0;
}

void expect_clear_no_device_error(const Error& e) {
  const std::string what = e.what();
  EXPECT_EQ(e.code(), Errc::no_device) << what;
  EXPECT_NE(what.find("no RDMA device found"), std::string::npos) << what;
  EXPECT_NE(what.find("modprobe rdma_rxe"), std::string::npos) << "names the fix: " << what;
  EXPECT_NE(what.find("tcp://"), std::string::npos) << "names the alternative: " << what;
}

TEST(RdmaNoDevice, ClientAndServerSayWhatToDo) {
  if (device_present()) GTEST_SKIP() << "this machine has an RDMA device; the rdma tests cover it";
  ClientOptions o;
  o.servers = {"rdma://127.0.0.1:9700"};
  // Fails at once, not after the connect timeout: waiting these 10 minutes would hit ctest's limit.
  o.connect_timeout = std::chrono::minutes(10);
  try {
    Client c(o);
    ADD_FAILURE() << "a client connected over rdma without a device";
  } catch (const Error& e) {
    expect_clear_no_device_error(e);
  }
  ServerOptions so;
  so.uri = "rdma://127.0.0.1:0";
  so.arena_bytes = 1 << 20;
  try {
    Server s(so);
    ADD_FAILURE() << "a server started over rdma without a device";
  } catch (const Error& e) {
    expect_clear_no_device_error(e);
  }
}

}  // namespace
}  // namespace pskv

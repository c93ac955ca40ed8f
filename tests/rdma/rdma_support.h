// Shared by the RDMA tests: where the Soft-RoCE device is, and starting rdma:// servers.
#pragma once

#include <string>
#include <vector>

#include "pskv/client.h"
#include "support/process.h"

namespace pskv::testing {

bool rdma_device_present();
// The address of the RDMA interface: $RXE_IP in the VM.
std::string rdma_ip();
// Empty when the RDMA tests may run here; otherwise why they are skipped. Outside the VM
// (RDMA_VM unset) with no device they skip; inside it a missing device is a failure.
std::string rdma_skip_reason();

// `extra` with this VM's small defaults for the flags it does not set (the VM has 2 GiB, and a
// server pins its store and every receive region).
std::vector<std::string> rdma_server_args(std::vector<std::string> extra);
ServerProcess start_rdma_server(std::vector<std::string> extra = {});
ClientOptions rdma_client(const std::vector<std::string>& uris);

}  // namespace pskv::testing

#define PSKV_REQUIRE_RDMA()                                                                             \
  do {                                                                                                  \
    if (const std::string why = ::pskv::testing::rdma_skip_reason(); !why.empty()) GTEST_SKIP() << why; \
    ASSERT_TRUE(::pskv::testing::rdma_device_present())                                                 \
        << "RDMA_VM is set but no RDMA device is visible: the VM failed to create rxe0";                \
    ASSERT_FALSE(::pskv::testing::rdma_ip().empty()) << "set RXE_IP to the RDMA interface's address";   \
  } while (0)

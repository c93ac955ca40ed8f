#include "rdma_support.h"

#include <infiniband/verbs.h>

#include <algorithm>
#include <cstdlib>

namespace pskv::testing {

bool rdma_device_present() {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list) ibv_free_device_list(list);
  return n > 0;
}

std::string rdma_ip() {
  const char* ip = std::getenv("RXE_IP");
  return ip ? ip : "";
}

std::string rdma_skip_reason() {
  if (std::getenv("RDMA_VM") || rdma_device_present()) return {};
  return "no RDMA device here: run the rdma tests in the Soft-RoCE VM "
         "(scripts/rdma-vm.sh 'cd build-rdma && ctest -L rdma --output-on-failure')";
}

std::vector<std::string> rdma_server_args(std::vector<std::string> extra) {
  const std::vector<std::pair<std::string, std::string>> defaults{{"--uri", "rdma://" + rdma_ip() + ":0"},
                                                                  {"--io-threads", "2"},
                                                                  {"--arena-mb", "48"},
                                                                  {"--max-keys", "4096"},
                                                                  {"--rdma-recv-mb", "24"}};
  std::vector<std::string> args = extra;
  for (const auto& [flag, value] : defaults)
    if (std::find(extra.begin(), extra.end(), flag) == extra.end()) args.insert(args.end(), {flag, value});
  return args;
}

ServerProcess start_rdma_server(std::vector<std::string> extra) {
  return ServerProcess::start(rdma_server_args(std::move(extra)));
}

ClientOptions rdma_client(const std::vector<std::string>& uris) {
  ClientOptions o;
  o.servers = uris;
  o.io_timeout = std::chrono::seconds(30);
  o.connect_timeout = std::chrono::seconds(20);
  return o;
}

}  // namespace pskv::testing

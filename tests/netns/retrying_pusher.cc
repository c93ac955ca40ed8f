// A worker that keeps pushing +1 to every one of its keys through whatever the netns test does
// to the links, with ClientOptions::retry_timeout, so that it should never see an error.
//   retrying_pusher SERVERS(comma-separated) KEYS STOP_FILE [--keys-only]
// Initialises keys [0, KEYS) (1,024 zeros each, spread over the servers by the client's hash),
// then pushes all of them in one push at a time until STOP_FILE exists, printing
// "acknowledged N" after every 50 pushes (flushed) so the test can follow its progress. Then it
// reads every key back: each must equal the number of pushes, all of which were acknowledged,
// and (without --keys-only: after a failover a stopped server stays stopped) every replica of
// every server must be synced again.
// Prints "PASSED acknowledged N" and exits 0, or "error: WHY" and exits 1.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "pskv/client.h"

int main(int argc, char** argv) {
  const bool keys_only = argc == 5 && std::string(argv[4]) == "--keys-only";
  if (argc != 4 && !keys_only) {
    std::fprintf(stderr, "usage: %s SERVERS KEYS STOP_FILE [--keys-only]\n", argv[0]);
    return 2;
  }
  constexpr std::size_t kFloats = 1024;
  try {
    pskv::ClientOptions o;
    std::stringstream list(argv[1]);
    for (std::string uri; std::getline(list, uri, ',');) o.servers.push_back(uri);
    o.worker_id = 0;
    o.io_timeout = std::chrono::seconds(2);  // a silent link is given up on, and retried, quickly
    o.connect_timeout = std::chrono::seconds(1);
    o.retry_timeout = std::chrono::seconds(60);
    pskv::Client client(o);
    const auto count = static_cast<pskv::Key>(std::stoul(argv[2]));
    std::vector<pskv::Key> keys;
    const std::vector<float> zeros(kFloats, 0.0f), ones(kFloats, 1.0f);
    for (pskv::Key k = 0; k < count; ++k) {
      keys.push_back(k);
      client.wait(client.init(k, zeros));
    }
    const std::vector<std::span<const float>> values(keys.size(), ones);
    std::uint64_t acknowledged = 0;
    while (access(argv[3], F_OK) != 0) {
      client.wait(client.push(keys, values));
      if (++acknowledged % 50 == 0) {
        std::printf("acknowledged %llu\n", static_cast<unsigned long long>(acknowledged));
        std::fflush(stdout);
      }
    }
    std::vector<float> out(kFloats);
    for (pskv::Key k : keys) {
      client.wait(client.pull(k, out));
      for (float x : out)
        if (x != static_cast<float>(acknowledged)) {
          std::printf("error: key %llu holds %.0f after %llu acknowledged pushes\n", static_cast<unsigned long long>(k),
                      static_cast<double>(x), static_cast<unsigned long long>(acknowledged));
          return 1;
        }
    }
    // Every server's replicas, and its replicas of others, must be whole again (a replica cut
    // off is dropped and sent everything again once it is back).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (std::size_t s = 0; s < client.num_servers() && !keys_only; ++s)
      for (;;) {
        const std::string stats = client.server_stats(s);
        const bool whole =
            stats.find("_state\":\"") != std::string::npos && stats.find("_state\":\"syncing") == std::string::npos &&
            stats.find("_state\":\"pending") == std::string::npos &&
            stats.find("_state\":\"down") == std::string::npos && stats.find("_state\":\"empty") == std::string::npos;
        if (whole) break;
        if (std::chrono::steady_clock::now() > deadline) {
          std::printf("error: server %zu's replicas are not all synced a minute after: %s\n", s, stats.c_str());
          return 1;
        }
        usleep(50000);
      }
    std::printf("PASSED acknowledged %llu\n", static_cast<unsigned long long>(acknowledged));
    return 0;
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
}

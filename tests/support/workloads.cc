#include "support/workloads.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "support/process.h"

namespace pskv::testing {

void expect_pushes_between(Client& c, Key keys, std::size_t length, std::uint64_t acked, std::uint64_t failed,
                           const std::string& context) {
  std::vector<float> out(length);
  for (Key k = 0; k < keys; ++k) {
    c.wait(c.pull(k, out));
    for (float x : out) ASSERT_EQ(x, out[0]) << "key " << k << " is torn, " << context;
    EXPECT_GE(out[0], float(acked)) << "key " << k << " lost acknowledged pushes, " << context;
    EXPECT_LE(out[0], float(acked + failed)) << "key " << k << " holds a push applied twice, " << context;
  }
}

void wait_replicas_synced(Client& c, std::uint32_t replicas, std::chrono::seconds limit) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  const std::size_t n = c.num_servers();
  for (std::size_t s = 0; s < n; ++s)
    for (std::uint32_t j = 1; j < replicas; ++j) {
      const std::string field = "\"replica_" + std::to_string((s + j) % n) + "_state\":\"synced\"";
      while (c.server_stats(s).find(field) == std::string::npos) {
        ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "server " << s << ": " << c.server_stats(s);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
}

void expect_nothing_lost(const ClientOptions& options, const NothingLostOptions& w) {
  {
    Client admin(options);
    std::vector<float> zeros(w.length, 0.0f);
    for (Key k = 0; k < Key(w.keys); ++k) admin.wait(admin.init(k, zeros));
  }
  std::vector<pid_t> pids;
  for (int c = 0; c < w.clients; ++c)
    pids.push_back(fork_worker([&, c] {
      Client client(options);
      std::vector<float> one(w.length, 1.0f), out(w.length);
      if (w.register_every_other && c % 2) client.register_buffer(one.data(), one.size() * sizeof(float));
      std::vector<Ticket> pending;
      for (int i = 0; i < w.pushes; ++i) {
        pending.push_back(client.push(Key((i + c) % w.keys), one));
        if (pending.size() < w.batch) continue;
        for (Ticket t : pending) client.wait(t);
        pending.clear();
        if (w.pull_between_batches) {
          client.wait(client.pull(Key(i % w.keys), out));
          for (float x : out)
            if (x != out[0]) return 3;  // torn read
        }
      }
      for (Ticket t : pending) client.wait(t);
      return 0;
    }));
  for (pid_t p : pids) EXPECT_EQ(wait_pid(p, w.worker_limit), 0) << "a client failed (3: it read a torn value)";
  Client check(options);
  double total = 0;
  std::vector<float> out(w.length);
  for (Key k = 0; k < Key(w.keys); ++k) {
    check.wait(check.pull(k, out));
    for (float x : out) ASSERT_EQ(x, out[0]) << "key " << k << " is torn";
    total += out[0];
  }
  EXPECT_EQ(total, double(w.clients) * w.pushes);
}

int push_through_failures(const ClientOptions& options, std::span<const Key> keys, std::uint32_t length,
                          PushTally& tally, const std::atomic<int>& stop, std::chrono::seconds reconnect_within) {
  const std::vector<float> one(length, 1.0f);
  const std::vector<std::span<const float>> values(keys.size(), std::span<const float>(one));
  std::unique_ptr<Client> c;
  auto reconnect_by = std::chrono::steady_clock::now() + reconnect_within;
  while (stop.load() == 0) {
    bool sent = false;
    try {
      if (!c) {
        c = std::make_unique<Client>(options);
        reconnect_by = std::chrono::steady_clock::now() + reconnect_within;
      }
      sent = true;
      c->wait(c->push(keys, values));
      tally.acknowledged.fetch_add(1);
    } catch (const Error& e) {
      if (sent) tally.failed.fetch_add(1);
      if (c) c->disconnect();
      c.reset();
      if (std::chrono::steady_clock::now() > reconnect_by) {
        std::fprintf(stderr, "pusher %d: no server took it back within %lld s: %s\n", getpid(),
                     static_cast<long long>(reconnect_within.count()), e.what());
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  return 0;
}

std::vector<Key> make_zero_keys(const ClientOptions& options, Key count, std::size_t length) {
  std::vector<Key> keys(count);
  Client admin(options);
  const std::vector<float> zeros(length, 0.0f);
  for (Key k = 0; k < count; ++k) admin.wait(admin.init(keys[k] = k, zeros));
  return keys;
}

}  // namespace pskv::testing

#include "support/workloads.h"

#include <gtest/gtest.h>

#include <vector>

#include "support/process.h"

namespace pskv::testing {

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

}  // namespace pskv::testing

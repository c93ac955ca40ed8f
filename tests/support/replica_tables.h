// What a replicated server's copy of another's embedding table holds, read as the origin's
// rejoin reads it (replica_table_rows, over any transport), and the check that every copy equals
// its origin.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <random>

#include "pskv/client.h"
#include "pskv/types.h"
#include "support/workloads.h"

namespace pskv::testing {

// The two tables the row kill tests push to. Table 0 counts: +1 to each of 300 ids, `add` from
// zeros, so a row's value is the number of pushes that reached it. Table 1 is capped (Adam, LRU
// at 300 rows) and takes 100 random ids of 2,000 a round, so rows, moments and evictions all
// have to cross a rejoin.
struct RowTables {
  static constexpr std::uint32_t kDim = 16;
  TableSpec counted, capped;
  std::vector<Key> ids;  // table 0's
  std::vector<float> ones;
  RowTables();
  void create(Client& c) const;
  // One round: random rows of table 1 and every id of table 0, both in flight, then waits for
  // both; *sent is set once table 0's push is on its way (it may land even if the round fails).
  void push_round(Client& c, std::mt19937& rng, bool* sent) const;
  // Table 0's rows are whole and each lies between `acked` and acked + `failed` pushes.
  void expect_counted(Client& c, std::uint64_t acked, std::uint64_t failed, const std::string& context) const;
  // Run in a forked worker: rounds until `stop` is set, each counted in `tally` (acknowledged,
  // or failed once sent), with a new client (and the tables created again) after a failed one.
  // Returns 1, saying why on stderr, at an error when `fail_fast` (a retrying worker must see
  // none) or once errors go on for 60 s; 0 otherwise.
  int push_rounds(const ClientOptions& options, std::mt19937 rng, PushTally& tally, const std::atomic<int>& stop,
                  bool fail_fast) const;
};

// A replica's copy of `origin`'s table `table`, as the server at `uri` holds it: each row's id
// with its record [value | optimizer state], and the copy's push marks.
struct TableCopy {
  bool exists = false, synced = false;
  std::uint32_t record_floats = 0;
  std::map<Key, std::vector<float>> rows;
  std::vector<std::uint64_t> marks;  // per worker, the newest identified push the rows hold
};
// Read over a connection that says it is a server (`uri` may be the server's own: its table).
TableCopy table_copy(const std::string& uri, std::uint32_t origin, std::uint32_t table);

// Every server's (`uris`, in server-id order) table rows against each of its R-1 replicas'
// copies: the same ids, each with the very bytes of its value and optimizer state, and the same
// push marks. A replica restarted a moment ago may still be listed synced by its origin, which
// notices within its next look (500 ms) and transfers again, so a copy that differs is read
// again for up to 30 s before it counts as different. Failures through GoogleTest.
void expect_table_copies_equal(const std::vector<std::string>& uris, std::uint32_t replicas, std::uint32_t table);

}  // namespace pskv::testing

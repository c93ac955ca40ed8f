#include "support/replica_tables.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

#include "support/requests.h"
#include "transport/transport.h"
#include "transport/uri.h"
#include "transport/wire.h"

namespace pskv::testing {

RowTables::RowTables() : ids(300), ones(300 * kDim, 1.0f) {
  counted.dim = kDim;
  counted.init = RowInit::zeros;
  counted.rule = UpdateRuleConfig{UpdateRule::add};
  counted.max_rows = 10000;
  capped.dim = kDim;
  capped.rule = UpdateRuleConfig{UpdateRule::adam};
  capped.eviction = RowEviction::lru;
  capped.max_rows = 300;
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = i * 7919 + 3;
}

void RowTables::create(Client& c) const {
  c.create_table(1, capped);
  c.create_table(0, counted);
}

void RowTables::push_round(Client& c, std::mt19937& rng, bool* sent) const {
  std::vector<Key> others(100);
  for (Key& id : others) id = rng() % 2000;
  std::sort(others.begin(), others.end());
  others.erase(std::unique(others.begin(), others.end()), others.end());
  const Ticket a = c.push_rows(1, others, std::span<const float>(ones).first(others.size() * kDim));
  const Ticket b = c.push_rows(0, ids, ones);
  *sent = true;
  c.wait(a);
  c.wait(b);
}

void RowTables::expect_counted(Client& c, std::uint64_t acked, std::uint64_t failed, const std::string& context) const {
  c.create_table(0, counted);
  std::vector<float> rows(ids.size() * kDim);
  c.wait(c.pull_rows(0, ids, rows));
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const float got = rows[i * kDim];
    for (std::uint32_t d = 0; d < kDim; ++d) ASSERT_EQ(rows[i * kDim + d], got) << "row " << ids[i] << " is torn";
    EXPECT_GE(got, float(acked)) << "row " << ids[i] << " lost acknowledged pushes (" << context << ")";
    EXPECT_LE(got, float(acked + failed)) << "row " << ids[i] << " holds a push applied twice (" << context << ")";
  }
}

int RowTables::push_rounds(const ClientOptions& options, std::mt19937 rng, PushTally& tally,
                           const std::atomic<int>& stop, bool fail_fast) const {
  std::unique_ptr<Client> c;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (stop.load() == 0) {
    bool sent = false;
    try {
      if (!c) {
        c = std::make_unique<Client>(options);
        create(*c);
      }
      push_round(*c, rng, &sent);
      tally.acknowledged.fetch_add(1);
    } catch (const Error& e) {
      if (sent) tally.failed.fetch_add(1);
      c.reset();
      if (fail_fast || std::chrono::steady_clock::now() > give_up) {
        std::fprintf(stderr, "row pusher (worker %u): %s\n", options.worker_id, e.what());
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  return 0;
}

namespace {

std::shared_ptr<transport::Connection> connect_as_server(const std::string& uri) {
  transport::ConnectOptions c;
  c.worker_id = wire::kServerPeer;
  return transport::connect(parse_uri(uri), c);
}

// The copy read over `conn` (to the server at `uri`), page by page.
TableCopy read_copy(std::shared_ptr<transport::Connection>& conn, const std::string& uri, std::uint32_t origin,
                    std::uint32_t table) {
  TableCopy copy;
  if (!conn) {
    ADD_FAILURE() << uri << " went silent earlier";
    return copy;
  }
  std::uint32_t cursor = 0;
  do {
    const transport::KeySlice page{cursor, 1000, nullptr};
    const Answer got = ask(conn, wire::Op::replica_table_rows, origin, table, {&page, 1});
    if (!conn) {
      ADD_FAILURE() << uri << " did not answer a replica_table_rows in 20 s";
      return copy;
    }
    EXPECT_EQ(got.code, Errc::ok) << got.text;
    const std::string& bytes = got.text;
    wire::ReplicaRowsHeader head{};
    if (bytes.size() < sizeof head) {
      ADD_FAILURE() << "a short replica_table_rows reply from " << uri;
      return copy;
    }
    std::memcpy(&head, bytes.data(), sizeof head);
    copy.exists = head.exists != 0;
    copy.synced = head.synced != 0;
    copy.record_floats = head.record_floats;
    if (!copy.exists) return copy;
    const std::size_t marks_end = sizeof head + head.marks * sizeof(std::uint64_t);
    EXPECT_EQ(bytes.size(), marks_end + head.rows * (sizeof(Key) + head.record_floats * sizeof(float)));
    copy.marks.resize(head.marks);
    if (head.marks) std::memcpy(copy.marks.data(), bytes.data() + sizeof head, head.marks * sizeof(std::uint64_t));
    const char* ids = bytes.data() + marks_end;
    const auto* records = reinterpret_cast<const float*>(ids + head.rows * sizeof(Key));
    for (std::uint32_t i = 0; i < head.rows; ++i) {
      Key id;
      std::memcpy(&id, ids + i * sizeof id, sizeof id);
      EXPECT_TRUE(copy.rows
                      .emplace(id, std::vector<float>(records + std::size_t{i} * head.record_floats,
                                                      records + std::size_t{i + 1} * head.record_floats))
                      .second)
          << "row " << id << " twice in " << uri << "'s copy of server " << origin << "'s table";
    }
    cursor = head.next;
  } while (cursor != 0);
  return copy;
}

}  // namespace

TableCopy table_copy(const std::string& uri, std::uint32_t origin, std::uint32_t table) {
  auto conn = connect_as_server(uri);
  return read_copy(conn, uri, origin, table);
}

void expect_table_copies_equal(const std::vector<std::string>& uris, std::uint32_t replicas, std::uint32_t table) {
  const auto n = static_cast<std::uint32_t>(uris.size());
  // One connection per server, read again and again (over rdma each one costs a registered
  // receive region on the server).
  std::vector<std::shared_ptr<transport::Connection>> conns;
  for (const auto& uri : uris) conns.push_back(connect_as_server(uri));
  for (std::uint32_t s = 0; s < n; ++s) {
    const TableCopy own = read_copy(conns[s], uris[s], s, table);
    ASSERT_TRUE(conns[s]) << "server " << s << " went silent";
    ASSERT_TRUE(own.exists) << "server " << s << " has no table " << table;
    for (std::uint32_t j = 1; j < replicas; ++j) {
      const std::uint32_t r = (s + j) % n;
      const std::string& at = uris[r];
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      TableCopy copy;
      while (!(copy = read_copy(conns[r], at, s, table)).synced || copy.rows != own.rows || copy.marks != own.marks) {
        if (!conns[r] || std::chrono::steady_clock::now() > give_up) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      ASSERT_TRUE(copy.exists) << "server " << (s + j) % n << " has no copy of server " << s << "'s table";
      EXPECT_TRUE(copy.synced);
      ASSERT_EQ(copy.record_floats, own.record_floats);
      EXPECT_EQ(copy.rows.size(), own.rows.size())
          << "server " << (s + j) % n << "'s copy of server " << s << "'s table has another row count";
      std::size_t differ = 0, missing = 0;
      for (const auto& [id, record] : own.rows) {
        const auto it = copy.rows.find(id);
        if (it == copy.rows.end())
          ++missing;
        else if (std::memcmp(it->second.data(), record.data(), record.size() * sizeof(float)) != 0)
          ++differ;
      }
      EXPECT_EQ(missing, 0u) << "rows of server " << s << " missing from server " << (s + j) % n << "'s copy";
      EXPECT_EQ(differ, 0u) << "rows of server " << s << " whose bytes differ on server " << (s + j) % n;
      EXPECT_EQ(copy.marks, own.marks) << "server " << (s + j) % n << "'s copy of server " << s
                                       << "'s table holds other push marks";
    }
  }
}

}  // namespace pskv::testing

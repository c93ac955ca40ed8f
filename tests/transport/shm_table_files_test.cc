// Tables of an shm server started to be adopted keep their rows in files of /dev/shm
// (transport/shm/table_files.h): whatever instant the process dies at, inside a row write or not,
// a successor reads back every row whole, optimizer state included.
#include "transport/shm/table_files.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "support/shm_files.h"

namespace pskv::shm {
namespace {

namespace fs = std::filesystem;

// A tables directory of this test's own.
struct Root : testing::ScratchTablesDirectory {
  explicit Root(const std::string& tag) : ScratchTablesDirectory("table-files-" + tag) {}
};

// Runs `body` in a child that leaves as a killed server would: without destructors (_exit), so its
// table's files stay as they are. Returns its pid.
template <class Body>
pid_t in_child(Body body) {
  const pid_t pid = fork();
  if (pid == 0) {
    try {
      body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
      _exit(1);
    }
    _exit(0);
  }
  return pid;
}

int wait_for(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

using Rows = std::map<Key, std::vector<float>>;

Rows read_rows(const LeftTable& table, EmbeddingTable::LeftRows* counts) {
  Rows rows;
  const std::uint64_t state = EmbeddingTable::state_floats_for(table.requested);
  *counts = read_left_rows(table, [&](Key id, const float* row, const float* st) {
    std::vector<float>& r = rows[id];
    EXPECT_TRUE(r.empty()) << "id " << id << " is in two rows";
    r.assign(row, row + table.requested.dim);
    if (state > 0) r.insert(r.end(), st, st + state);
  });
  return rows;
}

// An Adam table at an LRU cap, pushed past it: the files hold exactly the rows the table held,
// bit for bit with their moments and counts, and the spec it was made with, whether read row by
// row (read_left_rows) or taken over in place by a new table (TableFiles' take_from).
TEST(TableFiles, ATableInFilesComesBackWithEveryRowAndItsState) {
  const Root root("state");
  TableSpec spec;
  spec.dim = 16;
  spec.init = RowInit::normal;
  spec.seed = 5;
  spec.rule = UpdateRuleConfig{UpdateRule::adam};
  spec.rule.lr = 0.01f;
  spec.eviction = RowEviction::lru;
  spec.max_rows = 3000;
  const std::string expected_file = root.path + ".expected";
  const pid_t child = in_child([&] {
    EmbeddingTable table(spec, spec.max_rows, std::make_unique<TableFiles>(root.path, 3, spec, spec.max_rows));
    std::mt19937 rng(3);
    std::normal_distribution<float> g;
    std::vector<Key> ids(500);
    std::vector<float> grads(ids.size() * spec.dim);
    for (int round = 0; round < 40; ++round) {
      for (Key& id : ids) id = rng() % 9000;
      for (float& x : grads) x = g(rng);
      table.push(ids, grads.data(), static_cast<std::uint64_t>(round));
    }
    std::ofstream out(expected_file, std::ios::binary);
    table.scan(0, UINT32_MAX, [&](Key id, const float* row, const float* st) {
      out.write(reinterpret_cast<const char*>(&id), sizeof id);
      out.write(reinterpret_cast<const char*>(row), spec.dim * sizeof(float));
      out.write(reinterpret_cast<const char*>(st), EmbeddingTable::state_floats_for(spec) * sizeof(float));
    });
    out.close();
    std::fflush(nullptr);
    _exit(table.stats().evicted > 0 ? 0 : 2);  // the table itself is never destroyed
  });
  ASSERT_EQ(wait_for(child), 0) << "the child failed, or evicted nothing";
  Rows expected;
  {
    const std::size_t floats = spec.dim + EmbeddingTable::state_floats_for(spec);
    std::ifstream in(expected_file, std::ios::binary);
    Key id;
    while (in.read(reinterpret_cast<char*>(&id), sizeof id)) {
      std::vector<float>& r = expected[id];
      r.resize(floats);
      in.read(reinterpret_cast<char*>(r.data()), static_cast<std::streamsize>(floats * sizeof(float)));
    }
    fs::remove(expected_file);
  }
  ASSERT_EQ(expected.size(), spec.max_rows);
  const std::vector<LeftTable> left = left_tables(root.path);
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].id, 3u);
  EXPECT_EQ(left[0].requested, spec);
  EXPECT_EQ(left[0].max_rows, spec.max_rows);
  EmbeddingTable::LeftRows counts;
  const Rows got = read_rows(left[0], &counts);
  EXPECT_EQ(counts.rows, expected.size());
  EXPECT_EQ(counts.torn, 0u);
  ASSERT_EQ(got.size(), expected.size());
  for (const auto& [id, row] : expected) {
    const auto it = got.find(id);
    ASSERT_NE(it, got.end()) << "id " << id << " is missing";
    ASSERT_EQ(std::memcmp(it->second.data(), row.data(), row.size() * sizeof(float)), 0) << "id " << id;
  }

  // Taken over in place by a table of another server's directory: the same rows, and a table
  // that goes on as any other (new ids take the free rows and new segments, under the cap).
  const Root mine("state-taken");
  EmbeddingTable taken(spec, spec.max_rows,
                       std::make_unique<TableFiles>(mine.path, 3, spec, spec.max_rows, left[0].dir));
  EXPECT_EQ(taken.adopted().rows, expected.size());
  EXPECT_EQ(taken.stats().rows, expected.size());
  Rows scanned;
  taken.scan(0, UINT32_MAX, [&](Key id, const float* row, const float* st) {
    std::vector<float>& r = scanned[id];
    EXPECT_TRUE(r.empty()) << "id " << id << " is in two rows";
    r.assign(row, row + spec.dim);
    r.insert(r.end(), st, st + EmbeddingTable::state_floats_for(spec));
  });
  ASSERT_EQ(scanned, expected);
  std::vector<Key> fresh(2000);
  for (Key i = 0; i < fresh.size(); ++i) fresh[i] = 100000 + i;
  const std::vector<float> g(fresh.size() * spec.dim, 0.5f);
  taken.push(fresh, g.data(), 50);
  const TableStats after = taken.stats();
  EXPECT_EQ(after.rows, spec.max_rows) << "the cap";
  EXPECT_GT(after.evicted, 0u);
  std::vector<float> row(spec.dim);
  Key last = fresh.back();
  taken.pull({&last, 1}, row.data());
  EXPECT_TRUE(taken.contains(last)) << "the newest row was not made";
  std::uint64_t live = 0;
  taken.scan(0, UINT32_MAX, [&](Key, const float*, const float*) { ++live; });
  EXPECT_EQ(live, spec.max_rows);
}

// A child pushes +1 to 64 rows of 128 floats, all of them in each push, until it is SIGKILLed at a random
// instant, often inside a row write. Every row read back is whole (all its floats equal), and
// the rows are counts of the pushes in push order: non-increasing along the batch, and within one
// of each other. Without the undo records a row cut mid-write comes back torn.
TEST(TableFiles, ARowWriteCutByADeathIsRolledBack) {
  constexpr std::uint32_t kDim = 128;  // a 32 MiB segment: room in a container's small /dev/shm
  constexpr Key kIds = 64;
  TableSpec spec;
  spec.dim = kDim;
  spec.init = RowInit::zeros;
  spec.rule = UpdateRuleConfig{UpdateRule::add};
  std::mt19937 rng(42);
  std::uint64_t rolled_back = 0;
  int trials = 0;
  for (; trials < 60 && rolled_back < 3; ++trials) {
    const Root root("cut");
    int ready[2];
    ASSERT_EQ(pipe(ready), 0);
    const pid_t child = in_child([&] {
      close(ready[0]);
      EmbeddingTable table(spec, 0, std::make_unique<TableFiles>(root.path, 0, spec, 1000));
      std::vector<Key> ids(kIds);
      for (Key i = 0; i < kIds; ++i) ids[i] = i * 7919;
      const std::vector<float> ones(kIds * kDim, 1.0f);
      table.push(ids, ones.data(), 0);
      const char c = 1;
      if (write(ready[1], &c, 1) != 1) _exit(3);
      for (;;) table.push(ids, ones.data(), 0);
    });
    close(ready[1]);
    char c = 0;
    ASSERT_EQ(read(ready[0], &c, 1), 1) << "the child never pushed";
    close(ready[0]);
    std::this_thread::sleep_for(std::chrono::microseconds(500 + rng() % 20000));
    kill(child, SIGKILL);
    ASSERT_TRUE(WIFSIGNALED(wait_for(child)));

    const std::vector<LeftTable> left = left_tables(root.path);
    ASSERT_EQ(left.size(), 1u);
    EmbeddingTable::LeftRows counts;
    const Rows got = read_rows(left[0], &counts);
    ASSERT_EQ(counts.torn, 0u) << "trial " << trials;
    ASSERT_EQ(got.size(), kIds) << "trial " << trials;
    float first = -1, last = -1;
    for (Key i = 0; i < kIds; ++i) {
      const std::vector<float>& row = got.at(i * 7919);
      for (const float x : row) ASSERT_EQ(x, row[0]) << "row " << i << " is torn, trial " << trials;
      if (i == 0) first = row[0];
      ASSERT_LE(row[0], last < 0 ? row[0] : last) << "row " << i << " has more pushes than the row before it";
      last = row[0];
    }
    EXPECT_LE(first - last, 1.0f) << "trial " << trials;
    EXPECT_GE(last, 1.0f);
    rolled_back += counts.rolled_back;
  }
  std::printf("[ cut      ] %llu row writes rolled back in %d kills\n", static_cast<unsigned long long>(rolled_back),
              trials);
  EXPECT_GT(rolled_back, 0u) << "no kill landed inside a row write: the undo records were never needed";
}

// A spec file that does not check out is refused by name, before any row is read; so is a
// segment that is not the size the spec lays out.
// Runs `body` on a thread of its own and gives it `patience`; a body still running then is a
// thread spinning for good, so the test binary is ended with the failure rather than hung.
template <class Body>
void within(std::chrono::seconds patience, const std::string& what, Body body) {
  std::atomic<bool> done{false};
  std::thread t([&] {
    body();
    done.store(true);
  });
  const auto until = std::chrono::steady_clock::now() + patience;
  while (!done.load() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (!done.load()) {
    std::fprintf(stderr, "%s: still running after %lld s\n", what.c_str(), static_cast<long long>(patience.count()));
    std::_Exit(1);
  }
  t.join();
}

// A row's seqlock word lives in the table's files, which any process of the user may write. Left
// odd there, it once spun every reader of the row for good (a pull on an shm server thread, a
// checkpoint's scan), and every push kept it odd. Readers now settle it under the row's shard
// lock, and a write starts from the next even value: the row reads and updates as its twin
// without files does.
TEST(TableFiles, ARowWordLeftOddInTheFilesIsSettledNotSpunOn) {
  const Root root("odd");
  TableSpec spec;
  spec.dim = 16;
  spec.max_rows = 1000;
  spec.rule = UpdateRuleConfig{UpdateRule::adagrad};
  EmbeddingTable table(spec, spec.max_rows, std::make_unique<TableFiles>(root.path, 0, spec, spec.max_rows));
  EmbeddingTable twin(spec);
  const std::vector<Key> ids{42};
  const std::vector<float> grad(spec.dim, 0.5f);
  table.push(ids, grad.data(), 1);
  twin.push(ids, grad.data(), 1);

  const std::string segment = root.path + "/table-0/segment-0";
  const int fd = ::open(segment.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << segment;
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  auto* base = static_cast<unsigned char*>(
      ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  ASSERT_NE(base, MAP_FAILED);
  // Row 1 is the first handed out: [key, next, version] at 16 bytes a row.
  ASSERT_EQ(*reinterpret_cast<const Key*>(base + 16), 42u);
  auto& version = *reinterpret_cast<std::atomic<std::uint32_t>*>(base + 16 + 12);
  const auto scribble = [&] { version.store(version.load() | 1); };

  std::vector<float> got(spec.dim), want(spec.dim);
  const auto same = [&](const std::string& when) {
    twin.pull(ids, want.data());
    EXPECT_EQ(got, want) << when;
  };
  scribble();
  within(std::chrono::seconds(10), "pull of an odd row", [&] { table.pull(ids, got.data()); });
  same("a pull after the word was left odd");
  EXPECT_EQ(version.load() & 1, 0u);

  scribble();
  table.push(ids, grad.data(), 2);  // the writer meets the odd word first
  twin.push(ids, grad.data(), 2);
  EXPECT_EQ(version.load() & 1, 0u) << "a write left the word odd";
  within(std::chrono::seconds(10), "pull after a write", [&] { table.pull(ids, got.data()); });
  same("a pull after a write over an odd word");

  scribble();
  std::size_t visited = 0;
  within(std::chrono::seconds(10), "scan of an odd row", [&] {
    table.scan(0, UINT32_MAX, [&](Key id, const float* row, const float*) {
      ++visited;
      EXPECT_EQ(id, 42u);
      got.assign(row, row + spec.dim);
    });
  });
  EXPECT_EQ(visited, 1u);
  same("a scan after the word was left odd");
  ::munmap(base, static_cast<std::size_t>(st.st_size));
}

TEST(TableFiles, FilesThatDoNotCheckOutAreRefusedByName) {
  const Root root("bad");
  TableSpec spec;
  spec.dim = 8;
  spec.init = RowInit::zeros;
  const pid_t child = in_child([&] {
    EmbeddingTable table(spec, 0, std::make_unique<TableFiles>(root.path, 1, spec, 100));
    const std::vector<Key> ids = {1, 2, 3};
    const std::vector<float> g(ids.size() * spec.dim, 1.0f);
    table.push(ids, g.data(), 0);
    _exit(0);
  });
  ASSERT_EQ(wait_for(child), 0);
  const std::string dir = root.path + "/table-1";
  const std::vector<LeftTable> good = left_tables(root.path);
  ASSERT_EQ(good.size(), 1u);
  {
    // The segment's file emptied: taken over in place it was carved from no memory (SIGSEGV).
    fs::resize_file(dir + "/segment-0", 0);
    const Root mine("bad-taken");
    try {
      EmbeddingTable taken(spec, 0, std::make_unique<TableFiles>(mine.path, 1, spec, 100, good[0].dir));
      ADD_FAILURE() << "an empty segment was taken over";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("has 0 bytes"), std::string::npos) << e.what();
    }
    fs::remove_all(mine.path);  // its link of the empty segment
  }
  {
    // One byte of the segment's file more.
    std::ofstream grow(dir + "/segment-0", std::ios::binary | std::ios::app);
    grow.put('x');
  }
  try {
    EmbeddingTable::LeftRows counts;
    read_rows(good[0], &counts);
    ADD_FAILURE() << "a segment of the wrong size was read";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::stale_resource);
    EXPECT_NE(std::string(e.what()).find(dir), std::string::npos) << e.what();
  }
  {
    std::fstream f(dir + "/spec", std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(20);
    f.put('\x7f');  // a byte of the cap
  }
  try {
    left_tables(root.path);
    ADD_FAILURE() << "a spec file failing its CRC was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::stale_resource);
    EXPECT_NE(std::string(e.what()).find(dir + "/spec"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("CRC"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace pskv::shm

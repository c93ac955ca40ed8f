#include "store/store.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "layout/store_format.h"
#include "support/stop.h"

namespace pskv {
namespace {

std::unique_ptr<Store> make_store(StoreOptions o = {}) {
  return Store::create(std::make_unique<HeapMemory>(Store::required_bytes(o)), o);
}

TEST(Store, InitPullRoundTrip) {
  auto s = make_store();
  std::vector<float> v{1, 2, 3, 4, 5};
  ASSERT_EQ(s->init(7, v), Errc::ok);
  std::vector<float> out(5);
  ASSERT_EQ(s->pull(7, out).status, Errc::ok);
  EXPECT_EQ(out, v);
  EXPECT_EQ(s->key_count(), 1u);
}

TEST(Store, UnknownKeyAndWrongLength) {
  auto s = make_store();
  std::vector<float> out(3);
  EXPECT_EQ(s->pull(1, out).status, Errc::not_found);
  EXPECT_EQ(s->push(1, out), Errc::not_found);
  ASSERT_EQ(s->init_zero(1, 4), Errc::ok);
  EXPECT_EQ(s->pull(1, out).status, Errc::length_mismatch);
  EXPECT_EQ(s->push(1, out), Errc::length_mismatch);
  EXPECT_EQ(s->init_zero(1, 3), Errc::length_mismatch);
  EXPECT_EQ(s->init_zero(2, 0), Errc::invalid_argument);
}

TEST(Store, FirstInitialiserWins) {
  auto s = make_store();
  std::vector<float> a{1, 1}, b{2, 2}, out(2);
  ASSERT_EQ(s->init(3, a), Errc::ok);
  ASSERT_EQ(s->init(3, b), Errc::ok);
  s->pull(3, out);
  EXPECT_EQ(out, a);
  EXPECT_EQ(s->key_count(), 1u);
}

TEST(Store, SlotsAreCacheAlignedAndContiguous) {
  auto s = make_store();
  for (Key k = 0; k < 100; ++k) ASSERT_EQ(s->init_zero(k * 7919, 1 + k % 37), Errc::ok);
  std::size_t expected_offset = 0;
  std::size_t n = 0;
  s->for_each_slot([&](const Store::SlotEntry& e) {
    const SlotHeader& slot = *e.slot;
    EXPECT_EQ(e.length, slot.length);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(slot.values()) % 64, 0u);
    EXPECT_EQ(reinterpret_cast<const std::byte*>(&slot) - s->value_arena(),
              static_cast<std::ptrdiff_t>(expected_offset));
    expected_offset += slot_bytes(e.length);
    ++n;
  });
  EXPECT_EQ(n, 100u);
  EXPECT_EQ(s->value_bytes_used(), expected_offset);
}

TEST(Store, CapacityLimitsAreReported) {
  StoreOptions o;
  o.max_keys = 4;
  o.arena_bytes = 4096;
  auto s = make_store(o);
  for (Key k = 0; k < 4; ++k) ASSERT_EQ(s->init_zero(k, 1), Errc::ok);
  EXPECT_EQ(s->init_zero(99, 1), Errc::capacity);
  StoreOptions small;
  small.arena_bytes = 256;
  auto t = make_store(small);
  EXPECT_EQ(t->init_zero(1, 1000), Errc::capacity);
  EXPECT_EQ(t->key_count(), 0u);
}

TEST(Store, RejectsBadOptions) {
  StoreOptions o;
  o.stripes = 6;
  EXPECT_THROW(Store::required_bytes(o), Error);
  o.stripes = 8;
  o.max_keys = 0;
  EXPECT_THROW(Store::required_bytes(o), Error);
}

// A non-owning view of a store's bytes, as a second process mapping the segment would have.
struct View final : MemoryResource {
  std::byte* p;
  std::size_t n;
  View(std::byte* p, std::size_t n) : p(p), n(n) {}
  std::byte* data() noexcept override { return p; }
  std::size_t size() const noexcept override { return n; }
};

TEST(Store, AttachSeesTheSameData) {
  StoreOptions o;
  auto mem = std::make_unique<HeapMemory>(Store::required_bytes(o));
  std::byte* base = mem->data();
  std::size_t size = mem->size();
  auto s = Store::create(std::move(mem), o);
  std::vector<float> v{4, 5, 6};
  ASSERT_EQ(s->init(42, v), Errc::ok);

  auto view = Store::attach(std::make_unique<View>(base, size));
  std::vector<float> out(3);
  ASSERT_EQ(view->pull(42, out).status, Errc::ok);
  EXPECT_EQ(out, v);
  std::vector<float> bad(64, 0.0f);
  EXPECT_THROW(Store::attach(std::make_unique<View>(reinterpret_cast<std::byte*>(bad.data()), 256)), Error);
}

// A successor attaches a dead server's store from a header any process of the user could have
// rewritten. An offset just below 2^64 makes its sum with a size wrap into the region, and a
// state arena shorter than the values need puts state pointers past the end: each is refused.
TEST(Store, AttachRefusesOffsetsThatWrapAndAShortStateArena) {
  StoreOptions o;
  o.max_keys = 64;
  o.arena_bytes = 1 << 20;
  o.stripes = 16;
  o.rule.rule = UpdateRule::adam;
  auto mem = std::make_unique<HeapMemory>(Store::required_bytes(o));
  std::byte* base = mem->data();
  const std::size_t size = mem->size();
  auto s = Store::create(std::move(mem), o);
  ASSERT_EQ(s->init(1, std::vector<float>(8, 1.0f)), Errc::ok);
  auto& h = *reinterpret_cast<StoreHeader*>(base);
  std::vector<std::byte> saved(kStoreFixedHeaderBytes);
  std::memcpy(saved.data(), &h, saved.size());
  const auto restore = [&] { std::memcpy(static_cast<void*>(&h), saved.data(), saved.size()); };
  const std::vector<std::function<void()>> forgeries = {
      [&] {  // index_offset + index_capacity * 16 wraps to 0
        h.index_offset = 0ull - (1ull << 40);
        h.index_capacity = 1ull << 36;
      },
      [&] {  // stripes_offset + stripes * 64 wraps
        h.stripes = 1u << 24;
        h.stripes_offset = 0ull - (1ull << 30) + 256;
      },
      [&] { h.values_offset = 0ull - 64; },
      [&] { h.state_offset = 0ull - 64; },
      [&] {  // adam needs two floats of state per value
        h.state_offset = h.total_bytes;
        h.state_bytes = 0;
      },
      [&] { h.state_bytes = h.values_bytes; },
  };
  for (std::size_t i = 0; i < forgeries.size(); ++i) {
    forgeries[i]();
    try {
      (void)Store::attach(std::make_unique<View>(base, size));
      ADD_FAILURE() << "forgery " << i << " was attached";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::protocol) << "forgery " << i;
    }
    restore();
  }
  auto again = Store::attach(std::make_unique<View>(base, size));
  std::vector<float> out(8);
  ASSERT_EQ(again->pull(1, out).status, Errc::ok);
  EXPECT_EQ(out[0], 1.0f);
}

// A successor adopting a dead server's store takes every published key whose slot checks out; a
// rewritten length, key word or index entry costs only that key, never the ones after it.
TEST(Store, AdoptableSlotsCostAScribbledKeyOnlyItself) {
  StoreOptions o;
  o.rule.rule = UpdateRule::momentum;
  auto mem = std::make_unique<HeapMemory>(Store::required_bytes(o));
  std::byte* base = mem->data();
  const std::size_t size = mem->size();
  auto s = Store::create(std::move(mem), o);
  for (Key k = 0; k < 8; ++k) ASSERT_EQ(s->init(k, std::vector<float>(20 + k, float(k))), Errc::ok);
  {
    auto old = Store::attach(std::make_unique<View>(base, size));
    std::vector<std::string> refused;
    const auto all = old->adoptable_slots(&refused);
    EXPECT_TRUE(refused.empty());
    ASSERT_EQ(all.size(), 8u);
    for (Key k = 0; k < 8; ++k) {
      EXPECT_EQ(all[k].key, k);  // creation order
      EXPECT_EQ(all[k].ref.length, 20 + k);
      EXPECT_EQ(all[k].ref.slot->values()[0], float(k));
      EXPECT_NE(all[k].ref.state, nullptr);
    }
  }
  s->find(2)->length = 1000;  // runs into key 3
  s->find(4)->key = 99;       // names another key
  s->find(6)->length = 0;     // nothing
  auto old = Store::attach(std::make_unique<View>(base, size));
  std::vector<std::string> refused;
  const auto kept = old->adoptable_slots(&refused);
  std::vector<Key> keys;
  for (const auto& a : kept) keys.push_back(a.key);
  EXPECT_EQ(keys, (std::vector<Key>{0, 1, 3, 5, 7}));
  ASSERT_EQ(refused.size(), 3u);
  EXPECT_NE(refused[0].find("key 2"), std::string::npos) << refused[0];
  EXPECT_NE(refused[1].find("names key 99"), std::string::npos) << refused[1];
}

// A request's init is all or nothing: any refused key (an existing key of another length, the
// same key twice with two lengths, no room) leaves every key of it uncreated.
TEST(Store, InitAllCreatesEveryKeyOrNone) {
  StoreOptions o;
  o.max_keys = 4;
  auto s = Store::create(std::make_unique<HeapMemory>(Store::required_bytes(o)), o);
  ASSERT_EQ(s->init(1, std::vector<float>(4, 1.0f)), Errc::ok);
  const std::vector<float> values(64, 7.0f);
  std::size_t failed = 99;
  const auto init_all = [&](std::vector<KeyEntry> keys) { return s->init_all(keys, values.data(), &failed); };
  EXPECT_EQ(init_all({{2, 4, 0}, {1, 5, 0}}), Errc::length_mismatch);
  EXPECT_EQ(failed, 1u);
  EXPECT_EQ(init_all({{2, 4, 0}, {3, 4, 0}, {2, 6, 0}}), Errc::invalid_argument);
  EXPECT_EQ(failed, 2u);
  EXPECT_EQ(init_all({{2, 4, 0}, {3, 0, 0}}), Errc::invalid_argument);
  EXPECT_EQ(init_all({{2, 4, 0}, {3, 4, 0}, {4, 4, 0}, {5, 4, 0}}), Errc::capacity);  // 1 + 4 keys > 4
  EXPECT_EQ(failed, 3u);
  for (Key k = 2; k <= 5; ++k) EXPECT_EQ(s->find(k), nullptr) << "key " << k << " of a refused init";
  EXPECT_EQ(s->key_count(), 1u);
  // Taken: an existing key of the same length and a repeat are left as they are.
  EXPECT_EQ(init_all({{2, 4, 0}, {1, 4, 0}, {2, 4, 0}, {3, 8, 0}}), Errc::ok);
  EXPECT_EQ(s->key_count(), 3u);
  std::vector<float> out(4);
  ASSERT_EQ(s->pull(1, out).status, Errc::ok);
  EXPECT_EQ(out[0], 1.0f);
  ASSERT_EQ(s->pull(2, out).status, Errc::ok);
  EXPECT_EQ(out[0], 7.0f);
  std::vector<float> eight(8);
  ASSERT_EQ(s->pull(3, eight).status, Errc::ok);
}

TEST(Store, BatchOperations) {
  auto s = make_store();
  std::vector<Key> keys{1, 2, 3};
  for (Key k : keys) ASSERT_EQ(s->init_zero(k, 4), Errc::ok);
  std::vector<float> g1(4, 1.0f), g2(4, 2.0f), g3(4, 3.0f);
  std::vector<std::span<const float>> grads{g1, g2, g3};
  ASSERT_EQ(s->push_batch(keys, grads), Errc::ok);
  std::vector<float> o1(4), o2(4), o3(4);
  std::vector<std::span<float>> outs{o1, o2, o3};
  ASSERT_EQ(s->pull_batch(keys, outs), Errc::ok);
  EXPECT_EQ(o3, g3);
  std::vector<Key> with_unknown{1, 99, 3};
  std::size_t failed = 0;
  EXPECT_EQ(s->pull_batch(with_unknown, outs, &failed), Errc::not_found);
  EXPECT_EQ(failed, 1u);
}

TEST(Store, VersionAdvancesByTwoPerUpdate) {
  auto s = make_store();
  ASSERT_EQ(s->init_zero(5, 8), Errc::ok);
  std::vector<float> g(8, 1.0f), out(8);
  const auto v0 = s->pull(5, out).version;
  ASSERT_EQ(s->push(5, g), Errc::ok);
  const auto v1 = s->pull(5, out).version;
  EXPECT_EQ(v1, v0 + 2);
  EXPECT_EQ(v1 % 2, 0u);
}

// A push sent again (the client retried after a failure) is recognised by the mark of its worker's
// session: the same or an earlier sequence number of that session is a duplicate, a new session
// is not, and the marks travel with a copy (snapshot_slot) into another store (put_if_newer).
TEST(Store, PushMarksSkipAPushAlreadyApplied) {
  StoreOptions o;
  o.rule.rule = UpdateRule::add;
  auto s = make_store(o);
  s->keep_push_marks(2);
  ASSERT_EQ(s->push_marks(), 2u);
  const std::vector<float> zeros(4, 0.0f), ones(4, 1.0f);
  ASSERT_EQ(s->init(1, zeros), Errc::ok);
  const SlotRef ref = s->find_ref(1);
  auto apply = [&](PushId id) {
    bool duplicate = true;
    EXPECT_EQ(s->apply_slot(ref, ones.data(), o.rule, 1.0f, id, &duplicate), Errc::ok);
    return duplicate;
  };
  EXPECT_FALSE(apply({.worker = 0, .session = 7, .seq = 1}));
  EXPECT_FALSE(apply({.worker = 0, .session = 7, .seq = 2}));
  EXPECT_TRUE(apply({.worker = 0, .session = 7, .seq = 2}));
  EXPECT_TRUE(apply({.worker = 0, .session = 7, .seq = 1}));
  EXPECT_FALSE(apply({.worker = 1, .session = 7, .seq = 2}));  // another worker's marks are its own
  EXPECT_FALSE(apply({.worker = 0, .session = 8, .seq = 1}));  // a new client of worker 0
  EXPECT_FALSE(apply({.worker = 0, .session = 0, .seq = 1}));  // not identified: always applied
  EXPECT_FALSE(apply({.worker = 5, .session = 7, .seq = 1}));  // beyond the marks kept: applied
  // Sequence numbers wrap: 1 comes after 2^32 - 1.
  EXPECT_FALSE(apply({.worker = 1, .session = 9, .seq = 0xFFFFFFFFu}));
  EXPECT_FALSE(apply({.worker = 1, .session = 9, .seq = 1}));
  EXPECT_TRUE(apply({.worker = 1, .session = 9, .seq = 0xFFFFFFFFu}));
  std::vector<float> out(4);
  ASSERT_EQ(s->pull(1, out).status, Errc::ok);
  EXPECT_EQ(out, std::vector<float>(4, 8.0f));

  std::vector<float> value(4);
  std::uint64_t count = 0, seq = 0, marks[2] = {};
  s->snapshot_slot(*ref.slot, value.data(), nullptr, &count, &seq, nullptr, marks);
  auto replica = make_store(o);
  replica->keep_push_marks(2);
  ASSERT_EQ(replica->put_if_newer(1, value, {}, count, 1, seq, marks), Errc::ok);
  const SlotRef copy = replica->find_ref(1);
  bool duplicate = false;
  ASSERT_EQ(replica->apply_slot(copy, ones.data(), o.rule, 1.0f, {.worker = 0, .session = 8, .seq = 1}, &duplicate),
            Errc::ok);
  EXPECT_TRUE(duplicate);
  ASSERT_EQ(replica->apply_slot(copy, ones.data(), o.rule, 1.0f, {.worker = 0, .session = 8, .seq = 2}, &duplicate),
            Errc::ok);
  EXPECT_FALSE(duplicate);
  ASSERT_EQ(replica->pull(1, out).status, Errc::ok);
  EXPECT_EQ(out, std::vector<float>(4, 9.0f));
}

TEST(Store, StatefulOverrideOnStatelessStoreIsRefused) {
  auto s = make_store();  // rule add: no state arena
  ASSERT_EQ(s->init_zero(1, 4), Errc::ok);
  std::vector<float> g(4, 1.0f);
  UpdateRuleConfig adam;
  adam.rule = UpdateRule::adam;
  EXPECT_EQ(s->apply(1, g, adam), Errc::unsupported);
  UpdateRuleConfig assign;
  assign.rule = UpdateRule::assign;
  EXPECT_EQ(s->apply(1, g, assign), Errc::ok);
}

// apply_logged must give exactly what apply gives, optimizer state and update count included,
// and leave its record idle with the old value in the undo buffer.
TEST(Store, ApplyLoggedMatchesApply) {
  StoreOptions o;
  o.rule.rule = UpdateRule::adam;
  o.rule.lr = 0.01f;
  auto a = make_store(o), b = make_store(o);
  std::vector<float> init{1, -2, 3, 0.5f, 7}, g{0.1f, 0.2f, -0.3f, 0.4f, -0.5f};
  ASSERT_EQ(a->init(3, init), Errc::ok);
  ASSERT_EQ(b->init(3, init), Errc::ok);
  SlotHeader* slot = b->find(3);
  UndoRecord log{};
  std::vector<float> undo(b->undo_floats(*slot));
  ASSERT_EQ(undo.size(), 15u);  // value + Adam's m and s
  for (int step = 0; step < 3; ++step) {
    ASSERT_EQ(a->push(3, g), Errc::ok);
    ASSERT_EQ(b->apply_logged(*slot, g.data(), 5, 1.0f, 9, log, undo.data(), undo.size(), std::chrono::nanoseconds(0)),
              Errc::ok);
  }
  EXPECT_EQ(log.phase.load(), UndoPhase::idle);
  EXPECT_EQ(b->stripe_holder(3), 0u);
  std::vector<float> va(5), vb(5);
  a->pull(3, va);
  b->pull(3, vb);
  EXPECT_EQ(va, vb);
  EXPECT_EQ(a->find(3)->update_count, 3u);
  EXPECT_EQ(slot->update_count, 3u);
  std::vector<float> sa(10), sb(10), ignored(5);
  std::uint64_t ca = 0, cb = 0;
  a->snapshot_slot(*a->find(3), ignored.data(), sa.data(), &ca);
  b->snapshot_slot(*slot, ignored.data(), sb.data(), &cb);
  EXPECT_EQ(sa, sb);
  // The undo buffer holds the value before the last update.
  EXPECT_EQ(log.update_count, 2u);
  EXPECT_NE(std::vector<float>(undo.begin(), undo.begin() + 5), vb);
}

// Memory shared with forked children, like a shm segment.
class SharedMemory final : public MemoryResource {
 public:
  explicit SharedMemory(std::size_t bytes) : size_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    data_ = static_cast<std::byte*>(p);
  }
  ~SharedMemory() override { munmap(data_, size_); }
  std::byte* data() noexcept override { return data_; }
  std::size_t size() const noexcept override { return size_; }

 private:
  std::byte* data_;
  std::size_t size_;
};

// A process applying its own updates is SIGKILLed at random instants. It is stopped first, so
// the phase its record shows and whether it holds the lock are those it dies with, and recover()
// must answer for exactly that: roll back an update it had saved, release a lock it held in any
// other phase, touch nothing otherwise. The value is then some whole number of updates (every
// float equal to the update count), the seqlock even and the lock free, and a waiter on that
// lock gets it. Every other trial waits for the dangerous instant (the value half-updated under
// the lock), so that case is covered in every run, not only when the timing allows.
TEST(Store, RecoverRollsBackAnUpdateCutShortBySigkill) {
  // 512 KiB: below the size that apply_update spreads over oneTBB threads, which a forked child
  // must not use. The child still spends nearly all its time inside updates.
  constexpr std::uint32_t kLen = 1u << 17;
  constexpr int kTrials = 20;
  StoreOptions o;
  o.rule.rule = UpdateRule::add;
  o.arena_bytes = 4ull << 20;
  o.max_keys = 16;
  auto store = Store::create(std::make_unique<SharedMemory>(Store::required_bytes(o)), o);
  ASSERT_EQ(store->init_zero(5, kLen), Errc::ok);
  SlotHeader* slot = store->find(5);
  SharedMemory scratch(sizeof(UndoRecord) + 64 + std::size_t{kLen} * sizeof(float));
  auto* log = new (scratch.data()) UndoRecord{};
  auto* undo = reinterpret_cast<float*>(scratch.data() + 64);
  const std::vector<float> ones(kLen, 1.0f);
  std::mt19937 rng(7);
  int rolled_back = 0;
  std::vector<float> out(kLen);
  for (int trial = 0; trial < kTrials; ++trial) {
    const std::uint32_t owner = 100 + static_cast<std::uint32_t>(trial);
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      for (;;) store->apply_logged(*slot, ones.data(), kLen, 1.0f, owner, *log, undo, kLen, std::chrono::hours(1));
    }
    // A failed assertion below must not leave a stopped child holding the test's output open.
    struct KillOnExit {
      pid_t pid;
      ~KillOnExit() {
        if (pid > 0) kill(pid, SIGKILL), waitpid(pid, nullptr, 0);
      }
    } reaper{child};
    std::this_thread::sleep_for(std::chrono::microseconds(1000 + rng() % 5000));
    const bool wait_for_saved = trial % 2 == 1;
    UndoPhase phase;
    bool holds;
    ASSERT_TRUE(testing::stop_when(
        child,
        [&] {
          phase = log->phase.load();
          holds = store->stripe_holder(5) == owner;
          return !wait_for_saved || (phase == UndoPhase::saved && holds);
        },
        rng))
        << "the child was never caught with its update saved";
    kill(child, SIGKILL);
    int status = 0;
    reaper.pid = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    // Another writer already waiting on the dead owner's lock is let in by the recovery.
    std::thread waiter([&] { EXPECT_EQ(store->push(5, ones), Errc::ok); });
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const Store::Recovery r = store->recover(*log, owner, undo, kLen);
    waiter.join();
    const Store::Recovery expected = !holds                      ? Store::Recovery::nothing
                                     : phase == UndoPhase::saved ? Store::Recovery::rolled_back
                                                                 : Store::Recovery::released;
    EXPECT_EQ(r, expected) << "trial " << trial << ", killed in phase " << int(phase)
                           << (holds ? " holding" : " not holding") << " the lock";
    rolled_back += r == Store::Recovery::rolled_back;
    EXPECT_EQ(log->phase.load(), UndoPhase::idle);
    EXPECT_EQ(store->stripe_holder(5), 0u);
    ASSERT_EQ(slot->seq.load() % 2, 0u) << "an odd version would keep every reader waiting";
    ASSERT_EQ(store->pull(5, out).status, Errc::ok);
    for (std::uint32_t i = 0; i < kLen; ++i)
      ASSERT_EQ(out[i], float(slot->update_count)) << "element " << i << " after trial " << trial;
  }
  EXPECT_GE(rolled_back, kTrials / 2);
  // Recovering again, or for an owner that holds nothing, changes nothing.
  EXPECT_EQ(store->recover(*log, 100, undo, kLen), Store::Recovery::nothing);
}

// The record comes from a process that may have been hostile: nonsense is refused, not followed.
TEST(Store, RecoverIgnoresAForgedRecord) {
  auto s = make_store();
  std::vector<float> v(8, 2.0f), undo(8, 9.0f);
  ASSERT_EQ(s->init(1, v), Errc::ok);
  ASSERT_EQ(s->init(2, v), Errc::ok);
  UndoRecord log{};
  log.phase.store(UndoPhase::saved);
  log.stripe = 1u << 30;  // no such stripe
  EXPECT_EQ(s->recover(log, 5, undo.data(), undo.size()), Store::Recovery::nothing);
  EXPECT_EQ(log.phase.load(), UndoPhase::idle);
  std::vector<float> out(8);
  s->pull(1, out);
  EXPECT_EQ(out, v);
}

// recover() only restores into a slot that slot_at() accepts: a real slot header, not any
// offset a dead writer left in its record.
TEST(Store, SlotAtAcceptsOnlyRealSlots) {
  auto s = make_store();
  std::vector<float> v(40, 1.0f);
  ASSERT_EQ(s->init(1, v), Errc::ok);
  ASSERT_EQ(s->init(2, v), Errc::ok);
  const std::uint64_t first = s->slot_offset(*s->find(1)), second = s->slot_offset(*s->find(2));
  EXPECT_EQ(s->slot_at(first), s->find(1));
  EXPECT_EQ(s->slot_at(second), s->find(2));
  EXPECT_EQ(s->slot_at(0), nullptr);                        // the store header
  EXPECT_EQ(s->slot_at(first + 8), nullptr);                // not line-aligned
  EXPECT_EQ(s->slot_at(first + 64), nullptr);               // inside a slot's values
  EXPECT_EQ(s->slot_at(second + slot_bytes(40)), nullptr);  // past the used arena
  EXPECT_EQ(s->slot_at(~0ull - 63), nullptr);
}

}  // namespace
}  // namespace pskv

#include "transport/shm/adoption.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <thread>
#include <unordered_set>
#include <vector>

#include "common/log.h"
#include "layout/clock_table.h"
#include "table/embedding_table.h"
#include "transport/shm/sync_file.h"
#include "transport/shm/table_files.h"

namespace pskv::shm {

namespace fs = std::filesystem;

JsonObject AdoptionReport::fields() const {
  JsonObject j;
  j.add("adopted_from_pid", predecessor_pid)
      .add("adopted_keys", keys)
      .add("adopted_value_bytes", value_bytes)
      .add("adopted_rolled_back", rolled_back)
      .add("adopted_refused", refused)
      .add("adopted_torn", torn)
      .add("adopted_clocks", clocks)
      .add("adopted_tables", tables)
      .add("adopted_rows", rows)
      .add("adopted_rows_rolled_back", rows_rolled_back)
      .add("adopted_rows_torn", rows_torn)
      .add("adopted_rows_refused", rows_refused)
      .add("adopted_sync_keys", sync_keys)
      .add("adopted_sync_refused", sync_refused)
      .add("adopted_ms", milliseconds, 1);
  return j;
}

Predecessor::~Predecessor() {
  if (aside_.empty()) return;
  if (copied_) {
    ::unlink(aside_.c_str());
    std::error_code ec;
    std::filesystem::remove_all(tables_, ec);
    return;
  }
  // Not copied: this server failed to start. Back under its name (unless a segment took it since).
  if (::renameat2(AT_FDCWD, aside_.c_str(), AT_FDCWD, name_.c_str(), RENAME_NOREPLACE) != 0)
    log::warn("shm.adopt", "the dead server's segment stays at " + aside_ + " (" + std::strerror(errno) +
                               "); move it back to " + name_ + " to adopt it, or remove it");
}

namespace {

ino_t inode_of(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

// The segments successors moved aside to adopt them (NAME.adopting-PID), with their PIDs.
std::vector<std::pair<std::string, pid_t>> set_aside(const std::string& object) {
  const std::string prefix = fs::path(object).filename().string() + ".adopting-";
  std::vector<std::pair<std::string, pid_t>> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/dev/shm", ec)) {
    const std::string file = entry.path().filename().string();
    if (file.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string pid = file.substr(prefix.size());
    if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) continue;
    out.emplace_back(entry.path().string(), static_cast<pid_t>(std::stol(pid)));
  }
  return out;
}

// Whether the successor `pid`, which moved a segment aside, is gone. This process's own pid is
// one an earlier, dead process had (a restarted container's, say).
bool adopter_gone(pid_t pid) {
  return pid == ::getpid() || !process_alive(pid, 0);
}

// Removes the object at `path` if it is still `inode` (renamed to a name of this process's own
// first, so that nothing another process put there meanwhile goes). False if it was not.
bool remove_if_still(const std::string& path, ino_t inode) {
  const std::string mine = path + ".removing-" + std::to_string(::getpid());
  if (::renameat2(AT_FDCWD, path.c_str(), AT_FDCWD, mine.c_str(), RENAME_NOREPLACE) != 0) return false;
  if (inode_of(mine) == inode) return ::unlink(mine.c_str()) == 0;
  ::renameat2(AT_FDCWD, mine.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE);
  return false;
}

}  // namespace

std::unique_ptr<Predecessor> Predecessor::take(const std::string& name, std::chrono::milliseconds patience) {
  const auto began = std::chrono::steady_clock::now();
  const std::string object = "/dev/shm" + segment_object_name(name);
  // A successor at work holds the segment it adopts aside: starting beside it would serve nothing
  // of it (and the successor could then not make its own).
  for (const auto& [path, pid] : set_aside(object))
    if (!adopter_gone(pid))
      throw Error(Errc::stale_resource, "pskv-server pid " + std::to_string(pid) +
                                            " is adopting the segment of shm://" + name + " (moved to " + path +
                                            "); wait for it to serve, or stop it");
  std::unique_ptr<Segment> segment = Segment::open_left_by_dead_server(name);
  if (!segment) {
    // Nothing under the name: a successor died right after moving its predecessor's segment
    // aside, before it made its own. That segment goes back under the name.
    for (const auto& [path, pid] : set_aside(object)) {
      if (!adopter_gone(pid) || ::renameat2(AT_FDCWD, path.c_str(), AT_FDCWD, object.c_str(), RENAME_NOREPLACE) != 0)
        continue;
      log::warn("shm.adopt", "pskv-server pid " + std::to_string(pid) +
                                 " died while adopting the segment it moved to " + path + "; adopting that one");
      return take(name, patience);
    }
    return nullptr;
  }
  if (segment->header().ready.load(std::memory_order_acquire) == 0) {
    // Its server died before it served anyone (a server is made ready only once its adoption or
    // restore is done), so it holds nothing any client was told. If it was adopting, the segment
    // it took aside holds what clients were told, and this one at most part of a copy of it;
    // if not, it holds part of a checkpoint, which is still on disk. Either way it goes.
    const pid_t pid = segment->header().server_pid;
    const std::string earlier = object + ".adopting-" + std::to_string(pid);
    const std::string its_tables = shm::tables_directory(name, segment->header().job_nonce);
    const ino_t inode = segment->inode();
    segment.reset();
    if (!remove_if_still(object, inode)) return take(name, patience);  // another server was quicker
    std::error_code ec;
    fs::remove_all(its_tables, ec);
    if (::access(earlier.c_str(), F_OK) != 0) {
      log::warn("shm.adopt", "removed the segment of pskv-server pid " + std::to_string(pid) +
                                 ", which died before it served anyone");
      return nullptr;
    }
    log::warn("shm.adopt", "pskv-server pid " + std::to_string(pid) + " died while adopting the segment at " + earlier +
                               ", before it served anyone; adopting that one instead of its copy");
    if (::renameat2(AT_FDCWD, earlier.c_str(), AT_FDCWD, object.c_str(), RENAME_NOREPLACE) != 0 && errno != ENOENT &&
        errno != EEXIST)
      throw Error(Errc::io, "cannot move " + earlier + " back to " + object + ": " + std::strerror(errno));
    return take(name, patience);
  }
  log::info("shm.adopt", "adopting the segment pskv-server pid " + std::to_string(segment->header().server_pid) +
                             " left at shm://" + name);
  auto p = std::unique_ptr<Predecessor>(new Predecessor());
  p->began_ = began;
  // Claimed first, by moving it aside: of two successors started at once only one gets it (the
  // other finds no segment, or its own rename fails), and the name is free for this server's own.
  p->name_ = object;
  p->aside_ = p->name_ + ".adopting-" + std::to_string(::getpid());
  if (::renameat2(AT_FDCWD, p->name_.c_str(), AT_FDCWD, p->aside_.c_str(), RENAME_NOREPLACE) != 0) {
    if (errno == ENOENT) return nullptr;
    throw Error(Errc::io, "cannot move the dead server's segment " + p->name_ + " aside: " + std::strerror(errno));
  }
  if (inode_of(p->aside_) != segment->inode()) {
    // Another server replaced the object under the name after this one mapped it: not ours.
    ::renameat2(AT_FDCWD, p->aside_.c_str(), AT_FDCWD, p->name_.c_str(), RENAME_NOREPLACE);
    p->aside_.clear();
    return take(name, patience);
  }
  const SegmentGeometry& g = segment->geometry();
  p->report_.predecessor_pid = g.server_pid;
  p->tables_ = shm::tables_directory(name, segment->header().job_nonce);
  p->dead_ = "pskv-server pid " + std::to_string(g.server_pid);
  const std::string& dead = p->dead_;
  auto& h = segment->header();
  h.accepting.store(0, std::memory_order_seq_cst);
  h.closing.store(1, std::memory_order_seq_cst);

  // Pushes clients announced before they could see `closing` finish (or are rolled back below).
  const auto give_up = began + patience + std::chrono::seconds(1);
  std::vector<bool> live(g.clients, false);
  for (std::uint32_t i = 0; i < g.clients; ++i) {
    ClientArea& s = segment->area(i);
    for (;;) {
      const std::int32_t pid = s.owner_pid.load(std::memory_order_acquire);
      live[i] = pid > 0 && process_alive(pid, s.owner_start);
      if (!live[i] || s.undo.phase.load(std::memory_order_seq_cst) == UndoPhase::idle) break;
      if (std::chrono::steady_clock::now() > give_up) {
        log::warn("shm.adopt", "client area " + std::to_string(i) + " (pid " + std::to_string(pid) +
                                   ") of the dead server is still inside a push it applies itself; rolling it back "
                                   "(that push was never acknowledged by a live server)");
        live[i] = false;
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  try {
    p->store_ = Store::attach(segment->store_memory());
  } catch (const Error& e) {
    throw Error(e.code(), "cannot adopt the segment " + dead + " left at shm://" + name + ": " + e.what());
  }
  Store& store = *p->store_;
  // What dead processes left: a client's half-applied push rolled back from its undo record, its
  // stripe locks and the dead server's released. A live client is idle and fenced.
  for (std::uint32_t i = 0; i < g.clients; ++i) {
    if (live[i]) continue;
    ClientArea& s = segment->area(i);
    const std::uint32_t tag = area_owner_tag(i);
    const Store::Recovery r =
        store.recover(s.undo, tag, reinterpret_cast<const float*>(segment->area_data(i)), g.area_bytes / sizeof(float));
    if (r == Store::Recovery::rolled_back) ++p->report_.rolled_back;
    store.release_locks_of(tag);
  }
  // Sync mode's pending steps, if it kept them for a successor; refused whole if they do not
  // check out (the start fails, and the segment is put back).
  try {
    p->sync_ = SyncStateFile::open_left(p->tables_);
  } catch (const Error& e) {
    throw Error(e.code(), "cannot adopt the segment " + dead + " left at shm://" + name + ": " + e.what());
  }
  // A step's apply counts as done once its pending steps say so (SyncApplyMark): from then on
  // the undo record, which may still say `saved`, must not take it back.
  const std::uint32_t applied_whole = p->sync_ ? p->sync_->applied_marks() : 0;
  // The dead server's own threads: a ring push one of them was applying, and their locks.
  for (std::uint32_t t = 0; t < g.server_threads; ++t) {
    const std::uint32_t tag = server_thread_owner_tag(t);
    if ((applied_whole >> t & 1) && h.server_undo[t].phase.load(std::memory_order_acquire) == UndoPhase::saved)
      h.server_undo[t].phase.store(UndoPhase::applied, std::memory_order_release);
    const Store::Recovery r =
        store.recover(h.server_undo[t], tag, segment->server_undo_buffer(t), g.server_undo_bytes / sizeof(float));
    if (r == Store::Recovery::rolled_back) ++p->report_.rolled_back;
    store.release_locks_of(tag);
  }
  store.release_locks_of(SharedMutex::kAnonymousOwner);

  std::vector<std::string> refused;
  p->slots_ = store.adoptable_slots(&refused);
  p->report_.refused = refused.size();
  for (const std::string& why : refused) log::warn("shm.adopt", "not adopted from " + dead + ": " + why);
  for (const Store::Adoptable& a : p->slots_)
    if (a.ref.slot->seq.load(std::memory_order_acquire) & 1) {
      ++p->report_.torn;
      log::warn("shm.adopt", "key " + std::to_string(a.key) + " was left inside an update by " + dead +
                                 " that no undo record covers; adopted as it is");
    }
  p->segment_ = std::move(segment);
  return p;
}

AdoptionReport Predecessor::copy_into(ShardEngine& engine, const std::string& tables_root) {
  Store& to = engine.store();
  const Store& from = *store_;
  const std::string& dead = dead_;
  if (to.rule().rule != from.rule().rule)
    throw Error(Errc::invalid_argument, "the segment of " + dead + " keeps the optimizer state of rule '" +
                                            std::string(to_string(from.rule().rule)) + "', this server's rule is '" +
                                            std::string(to_string(to.rule().rule)) + "': restart with --rule " +
                                            std::string(to_string(from.rule().rule)) + " to adopt it");
  for (const Store::Adoptable& a : slots_) {
    const SlotHeader& slot = *a.ref.slot;
    const std::span<const float> value(slot.values(), a.ref.length);
    const std::span<const float> state(a.ref.state, a.ref.state ? from.state_floats(slot) : 0);
    if (const Errc e = to.restore_slot(a.key, value, state, slot.update_count); e != Errc::ok)
      throw Error(e, "cannot adopt key " + std::to_string(a.key) + " (" + std::to_string(a.ref.length) +
                         " floats) from " + dead + ": " +
                         (e == Errc::capacity ? "this server is smaller; start it with the dead one's --arena-mb "
                                                "and --max-keys"
                                              : std::string(errc_name(e))));
    ++report_.keys;
    report_.value_bytes += std::uint64_t{a.ref.length} * sizeof(float);
  }
  const SegmentGeometry& g = segment_->geometry();
  if (ClockTable* clocks = engine.clocks(); clocks && g.num_workers) {
    try {
      const ClockTable old(segment_->clock_memory(), g.num_workers, false);
      if (old.workers() != clocks->workers())
        throw Error(Errc::invalid_argument, "it had " + std::to_string(old.workers()) + " workers, this server has " +
                                                std::to_string(clocks->workers()));
      for (std::uint32_t w = 0; w < old.workers(); ++w) {
        if (old.evicted(w))
          clocks->evict(w);
        else
          clocks->advance_to(w, old.clock(w));
        ++report_.clocks;
      }
    } catch (const Error& e) {
      log::warn("shm.adopt", "the workers' clocks of " + dead + " were not adopted (" + e.what() +
                                 "): workers announce theirs again when they reconnect");
    }
  }
  copy_sync_steps_into(engine);
  copy_tables_into(engine, tables_root);
  report_.milliseconds = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began_).count();
  log::info("shm.adopt", "adopted " + std::to_string(report_.keys) + " keys (" +
                             std::to_string(report_.value_bytes >> 20) + " MiB of values) and " +
                             std::to_string(report_.clocks) + " worker clocks, the pending sync steps of " +
                             std::to_string(report_.sync_keys) + " keys, " + std::to_string(report_.rows) +
                             " rows of " + std::to_string(report_.tables) + " tables from the segment of " + dead +
                             " in " + std::to_string(static_cast<long long>(report_.milliseconds)) + " ms; " +
                             std::to_string(report_.rolled_back) + " half-applied pushes rolled back, " +
                             std::to_string(report_.refused) + " keys refused");
  return report_;
}

namespace {

// A table --restore made first cannot be taken over: it gets the dead server's rows one by one
// and keeps only those. *refused: rows it had no room for.
EmbeddingTable::LeftRows copy_left_rows(EmbeddingTable& table, const LeftTable& left, std::uint64_t* refused) {
  // Rows the dead server no longer held (evicted since the checkpoint) go first: restored after
  // the dead server's rows, a row of theirs could evict one of those.
  std::vector<Key> before, held;
  table.scan(0, UINT32_MAX, [&](Key id, const float*, const float*) { before.push_back(id); });
  const std::uint64_t rolled_back =
      read_left_rows(left, [&](Key id, const float*, const float*) { held.push_back(id); }).rolled_back;
  std::sort(before.begin(), before.end());
  std::sort(held.begin(), held.end());
  std::vector<Key> gone;
  std::set_difference(before.begin(), before.end(), held.begin(), held.end(), std::back_inserter(gone));
  for (const Key id : gone) table.remove_row(id);
  // The second reading finds the rows the first put back already.
  EmbeddingTable::LeftRows rows = read_left_rows(left, [&](Key id, const float* row, const float* state) {
    if (!table.restore_row(id, row, state)) ++*refused;
  });
  rows.rolled_back += rolled_back;
  rows.rows -= *refused;
  return rows;
}

}  // namespace

void Predecessor::copy_sync_steps_into(ShardEngine& engine) {
  SyncAccumulator* sync = engine.sync();
  if (!sync_) return;
  const std::string& dead = dead_;
  const std::string restart = ": restart with its --mode sync and --workers " + std::to_string(sync_->workers()) +
                              " to adopt the steps its workers' pushes were summed into";
  if (!sync)
    throw Error(Errc::invalid_argument, dead + " summed sync mode's steps, this server is not in sync mode" + restart);
  if (sync->options().num_workers != sync_->workers() || sync->options().window != sync_->window())
    throw Error(Errc::invalid_argument, dead + " had " + std::to_string(sync_->workers()) +
                                            " workers and a window of " + std::to_string(sync_->window()) +
                                            " steps, this server " + std::to_string(sync->options().num_workers) +
                                            " and " + std::to_string(sync->options().window) + restart);
  std::string stopped;
  // A key has one record. A second (a record copied over another, or a key word flipped) would
  // have its steps adopted again and a completed one applied twice: such a key starts over.
  std::unordered_set<Key> seen;
  sync_->visit(
      [&](Key key, std::uint32_t length, const std::uint64_t* block, std::uint64_t words) {
        std::string why;
        if (!seen.insert(key).second) {
          why = "the file holds a second record of it; its steps start over";
        } else if (sync->adopt_block(key, length, block, words, &why) == Errc::ok) {
          ++report_.sync_keys;
          return;
        }
        ++report_.sync_refused;
        log::warn("shm.adopt", "the pending sync steps of key " + std::to_string(key) + " left by " + dead +
                                   " were not adopted: " + why);
        // Steps a --restore gave the key are older than its adopted value: completed, they would
        // apply sums the value already holds. The key starts over at step 0 instead.
        if (const SlotHeader* slot = engine.store().find(key); slot && engine.store().length_of(*slot) == length) {
          const std::vector<float> none(sync->state_floats(length), 0.0f);
          std::string reset;
          if (sync->restore_state(key, length, none.data(), &reset) != Errc::ok)
            log::warn("shm.adopt", "key " + std::to_string(key) + " keeps the steps of its checkpoint: " + reset);
        }
      },
      &stopped);
  if (!stopped.empty()) {
    ++report_.sync_refused;
    log::warn("shm.adopt", "the sync steps left by " + dead + " were read only up to a record: " + stopped);
  }
}

void Predecessor::copy_tables_into(ShardEngine& engine, const std::string& tables_root) {
  const std::string& dead = dead_;
  for (const LeftTable& left : left_tables(tables_)) {
    const std::string table_of_dead = "table " + std::to_string(left.id) + " of " + dead;
    std::string why;
    EmbeddingTable::LeftRows rows;
    std::uint64_t refused = 0;
    if (!engine.table_at(left.id)) {
      // Taken over in place: no copy of the rows, only their index built again.
      if (const Errc e = engine.adopt_table(
              left.id, left.requested, left.max_rows,
              std::make_unique<TableFiles>(tables_root, left.id, left.requested, left.max_rows, left.dir), &why);
          e != Errc::ok)
        throw Error(e, "cannot adopt " + table_of_dead + ": " + why);
      rows = engine.table_at(left.id)->adopted();
    } else {
      // Checks the spec against the restored table's.
      if (const Errc e = engine.restore_table_rows(left.id, left.requested, left.max_rows, {}, nullptr, &why);
          e != Errc::ok)
        throw Error(e, "cannot adopt " + table_of_dead + ": " + why);
      rows = copy_left_rows(*engine.table_at(left.id), left, &refused);
    }
    ++report_.tables;
    report_.rows += rows.rows;
    report_.rows_refused += refused;
    report_.rows_rolled_back += rows.rolled_back;
    report_.rows_torn += rows.torn;
    if (rows.torn > 0)
      log::warn("shm.adopt", std::to_string(rows.torn) + " rows of " + table_of_dead +
                                 " were left inside a write that no undo record covers; adopted as they are");
    if (refused > 0)
      log::warn("shm.adopt", std::to_string(refused) + " rows of " + table_of_dead +
                                 " found no room in this server's table (its cap is " +
                                 std::to_string(engine.table_at(left.id)->spec().max_rows) + " rows): not adopted");
  }
}

}  // namespace pskv::shm

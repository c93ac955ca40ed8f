#include "server/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <utility>
#include <vector>

#include "layout/crc.h"

namespace pskv {

namespace {
constexpr char kMagic[8] = {'P', 'S', 'K', 'V', 'C', 'K', 'P', '1'};
constexpr char kEnd[8] = {'P', 'S', 'K', 'V', 'E', 'N', 'D', '1'};
constexpr std::uint32_t kVersion = 2;

#pragma pack(push, 1)
// Version 1's headers are these fields and their crc; version 2 adds the sync fields before it.
struct FileFields {
  char magic[8];
  std::uint32_t version;
  std::uint32_t server_id;
  std::uint32_t rule;
  std::uint64_t keys;
  std::uint64_t started_unix_ns;
};
struct FileHeader {
  FileFields f;
  std::uint32_t sync_workers;
  std::uint32_t sync_required;
  std::uint32_t sync_window;
  std::uint32_t crc;
};
struct KeyFields {
  std::uint64_t key;
  std::uint32_t length;
  std::uint32_t state_floats;
  std::uint64_t update_count;
};
struct KeyHeader {
  KeyFields f;
  std::uint32_t sync_floats;
  std::uint32_t crc;
};
struct Footer {
  char magic[8];
  std::uint64_t keys;
  std::uint32_t crc;
};
#pragma pack(pop)

[[noreturn]] void io_fail(const std::string& what, const std::string& path) {
  throw Error(Errc::io, what + " " + path + ": " + std::strerror(errno) + " (check the directory and free space)");
}

}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
  std::error_code made;
  std::filesystem::create_directories(std::filesystem::path(path_).parent_path(), made);  // else the open fails
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd_ < 0) io_fail("cannot create", tmp_);
  buf_.reserve(1 << 20);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());  // abandoned: the previous file stays
  }
}

void AtomicFile::put(const void* p, std::size_t n) {
  const auto* c = static_cast<const char*>(p);
  bytes_ += n;
  if (buf_.size() + n > (1u << 20)) flush();
  if (n > (1u << 20)) {
    write_all(c, n);
    return;
  }
  buf_.insert(buf_.end(), c, c + n);
}

void AtomicFile::commit() {
  flush();
  if (::fsync(fd_) != 0) io_fail("cannot fsync", tmp_);
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) io_fail("cannot close", tmp_);
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) io_fail("cannot rename checkpoint into place at", path_);
  const std::string dir = std::filesystem::path(path_).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // makes the rename itself durable
    ::close(dfd);
  }
}

void AtomicFile::flush() {
  write_all(buf_.data(), buf_.size());
  buf_.clear();
}

void AtomicFile::write_all(const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) io_fail("cannot write", tmp_);
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

CheckpointFile::CheckpointFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw Error(Errc::not_found, "cannot open checkpoint " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(Errc::io, "checkpoint " + path + " is not a regular file");
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      throw Error(Errc::io,
                  "cannot map checkpoint " + path + " (" + std::to_string(size_) + " bytes): " + std::strerror(err));
    }
    data_ = static_cast<const std::uint8_t*>(p);
  }
  ::close(fd);
}

CheckpointFile::~CheckpointFile() {
  if (data_) ::munmap(const_cast<std::uint8_t*>(data_), size_);
}

std::string checkpoint_path(const std::string& dir, std::uint32_t server_id) {
  return dir + "/shard-" + std::to_string(server_id) + ".ckpt";
}

CheckpointInfo write_checkpoint(Store& store, const SyncAccumulator* sync, const std::string& dir,
                                std::uint32_t server_id) {
  CheckpointInfo info;
  {
    AtomicFile w(checkpoint_path(dir, server_id));
    FileHeader h{};
    std::memcpy(h.f.magic, kMagic, 8);
    h.f.version = kVersion;
    h.f.server_id = server_id;
    h.f.rule = static_cast<std::uint32_t>(store.rule().rule);
    h.f.keys = store.key_count();
    h.f.started_unix_ns = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count());
    if (sync) {
      h.sync_workers = sync->options().num_workers;
      h.sync_required = sync->options().required;
      h.sync_window = sync->options().window;
    }
    info.started_unix_ns = h.f.started_unix_ns;
    h.crc = crc32_update(0, &h, offsetof(FileHeader, crc));
    w.put(&h, sizeof h);
    std::vector<float> value, state, steps;
    // An shm client applying its own push holds its key's stripe; one stopped there (SIGSTOP, or
    // a scribbled lock word) would hold the checkpointing thread, and with it the server's stop.
    constexpr auto kLockPatience = std::chrono::seconds(2);
    const auto held = [&](Key key) {
      return Error(Errc::timeout, "key " + std::to_string(key) + ": its stripe lock stayed held for " +
                                      std::to_string(kLockPatience.count()) +
                                      " s (an shm client stopped inside a push it applies itself?); this checkpoint "
                                      "is abandoned and the last one stays");
    };
    std::uint32_t crc_of_crcs = 0;
    std::uint64_t written = 0;
    store.for_each_slot([&](const Store::SlotEntry& e) {
      if (written == h.f.keys) return;  // keys created after the header was written wait for the next one
      // Key and length as the store trusts them, never the slot header's words, which an shm
      // client can rewrite.
      value.assign(e.length, 0.0f);
      state.assign(std::size_t{e.length} * state_floats_per_value(store.rule().rule), 0.0f);
      if (state.size() > UINT32_MAX)
        throw Error(Errc::capacity, "key " + std::to_string(e.key) + ": its optimizer state takes " +
                                        std::to_string(state.size()) + " floats, more than a checkpoint records");
      KeyHeader k{{e.key, e.length, static_cast<std::uint32_t>(state.size()), 0}, 0, 0};
      std::uint64_t update_count = 0;  // k's own is packed, not aligned
      if (sync) {
        // The value and the pending steps of one moment: add() changes both under the key's stripe.
        steps.resize(sync->state_floats(e.length));
        bool taken = false;
        sync->with_key(e.key, [&] {
          taken = store.snapshot_slot(*e.slot, value.data(), state.data(), &update_count, nullptr, nullptr, nullptr,
                                      kLockPatience);
          if (taken) sync->export_state(e.key, e.length, steps.data());
        });
        if (!taken) throw held(e.key);
        const std::uint64_t used = sync->used_state_floats(e.length, steps.data());
        if (used > UINT32_MAX)
          throw Error(Errc::capacity, "key " + std::to_string(e.key) + ": its pending steps take " +
                                          std::to_string(used) + " floats, more than a checkpoint records for a key");
        k.sync_floats = static_cast<std::uint32_t>(used);
      } else if (!store.snapshot_slot(*e.slot, value.data(), state.data(), &update_count, nullptr, nullptr, nullptr,
                                      kLockPatience)) {
        throw held(e.key);
      }
      k.f.update_count = update_count;
      k.crc = crc32_update(0, &k, offsetof(KeyHeader, crc));
      k.crc = crc32_update(k.crc, value.data(), value.size() * sizeof(float));
      k.crc = crc32_update(k.crc, state.data(), state.size() * sizeof(float));
      k.crc = crc32_update(k.crc, steps.data(), std::size_t{k.sync_floats} * sizeof(float));
      w.put(&k, sizeof k);
      w.put(value.data(), value.size() * sizeof(float));
      w.put(state.data(), state.size() * sizeof(float));
      w.put(steps.data(), std::size_t{k.sync_floats} * sizeof(float));
      crc_of_crcs = crc32_update(crc_of_crcs, &k.crc, sizeof k.crc);
      ++written;
    });
    Footer f{};
    std::memcpy(f.magic, kEnd, 8);
    f.keys = written;
    f.crc = crc_of_crcs;
    w.put(&f, sizeof f);
    info.keys = written;
    info.bytes = w.bytes();
    w.commit();
  }
  return info;
}

CheckpointInfo parse_checkpoint(const std::uint8_t* data, std::size_t size, Store* store, SyncAccumulator* sync,
                                const std::string& name, std::optional<std::uint32_t> server_id) {
  std::size_t at = 0;
  auto corrupt = [&](const std::string& why) -> Error {
    return Error(Errc::protocol, "checkpoint " + name + " is corrupt at byte " + std::to_string(at) + ": " + why +
                                     "; restore an older checkpoint or start without --restore");
  };
  auto take = [&](void* out, std::size_t n, const char* what) {
    if (size - at < n) throw corrupt(std::string("truncated in ") + what);
    if (n) std::memcpy(out, data + at, n);
    at += n;
  };
  FileHeader h{};
  take(&h.f, sizeof h.f, "the header");
  if (std::memcmp(h.f.magic, kMagic, 8) != 0) throw corrupt("not a pskv checkpoint (bad magic)");
  const bool v1 = h.f.version == 1;
  if (v1)
    take(&h.crc, sizeof h.crc, "the header");
  else
    take(&h.sync_workers, sizeof h - sizeof h.f, "the header");
  if (h.crc != crc32_update(0, &h, v1 ? sizeof h.f : offsetof(FileHeader, crc)))
    throw corrupt("header checksum mismatch");
  if (!v1 && h.f.version != kVersion)
    throw corrupt("version " + std::to_string(h.f.version) + " is not readable by this build");
  if (server_id && h.f.server_id != *server_id)
    throw Error(Errc::invalid_argument, "checkpoint " + name + " holds server " + std::to_string(h.f.server_id) +
                                            "'s shard, not server " + std::to_string(*server_id) +
                                            "'s: restore each server from its own shard-N.ckpt");
  if (store && h.f.rule != static_cast<std::uint32_t>(store->rule().rule))
    throw Error(Errc::invalid_argument, "checkpoint " + name + " was written with update rule " +
                                            std::string(to_string(static_cast<UpdateRule>(h.f.rule))) +
                                            "; start the server with the same --rule");
  if (h.sync_workers == 0 ? h.sync_required != 0 || h.sync_window != 0
                          : h.sync_window == 0 || h.sync_window > SyncAccumulator::kMaxWindow || h.sync_required == 0 ||
                                h.sync_required > h.sync_workers)
    throw corrupt("sync mode with " + std::to_string(h.sync_workers) + " workers, K=" +
                  std::to_string(h.sync_required) + " and a window of " + std::to_string(h.sync_window));
  // Pending steps go only into an accumulator that counts the same workers in the same window.
  const bool same_sync = sync && h.sync_workers == sync->options().num_workers &&
                         h.sync_required == sync->options().required && h.sync_window == sync->options().window;
  auto cannot_take_steps = [&](Key key) {
    const std::string written = "--mode sync with " + std::to_string(h.sync_workers) +
                                " workers (K=" + std::to_string(h.sync_required) + ", a window of " +
                                std::to_string(h.sync_window) + ")";
    const std::string here = sync ? "with " + std::to_string(sync->options().num_workers) +
                                        " workers (K=" + std::to_string(sync->options().required) + ", a window of " +
                                        std::to_string(sync->options().window) + ")"
                                  : "outside sync mode";
    return Error(Errc::invalid_argument, "checkpoint " + name + " holds acknowledged gradients of key " +
                                             std::to_string(key) + " summed for steps not yet applied, written " +
                                             written + "; this server runs " + here +
                                             ": restore it with the same --mode, --workers and --sync-required");
  };
  std::vector<float> value, state, steps;
  std::uint32_t crc_of_crcs = 0;
  for (std::uint64_t i = 0; i < h.f.keys; ++i) {
    KeyHeader k{};
    take(&k.f, sizeof k.f, "a key header");
    if (v1)
      take(&k.crc, sizeof k.crc, "a key header");
    else
      take(&k.sync_floats, sizeof k - sizeof k.f, "a key header");
    const Key key = k.f.key;
    const std::uint32_t length = k.f.length;
    const std::uint64_t floats = std::uint64_t{length} + k.f.state_floats + k.sync_floats;
    if (length == 0 || floats * sizeof(float) > size - at)
      throw corrupt("key " + std::to_string(key) + " claims more data than the file holds");
    std::uint32_t crc = crc32_update(0, &k, v1 ? sizeof k.f : offsetof(KeyHeader, crc));
    crc = crc32_update(crc, data + at, floats * sizeof(float));
    if (crc != k.crc) throw corrupt("checksum mismatch in key " + std::to_string(key));
    crc_of_crcs = crc32_update(crc_of_crcs, &k.crc, sizeof k.crc);
    if (k.sync_floats > 0) {
      // The next step, then whole entries, at most a window of them: what the header says.
      const std::uint64_t entry = SyncAccumulator::state_entry_floats(h.sync_workers, length);
      if (h.sync_workers == 0 || k.sync_floats < 2 || (k.sync_floats - 2) % entry != 0 ||
          (k.sync_floats - 2) / entry > h.sync_window)
        throw corrupt("key " + std::to_string(key) + " has " + std::to_string(k.sync_floats) +
                      " floats of sync steps, not a next step and whole entries");
    }
    if (k.sync_floats > 2 && !same_sync && store) throw cannot_take_steps(key);
    if (!store) {
      at += floats * sizeof(float);
      continue;
    }
    value.resize(length);
    state.resize(k.f.state_floats);
    take(value.data(), value.size() * sizeof(float), "values");
    take(state.data(), state.size() * sizeof(float), "state");
    if (Errc e = store->restore_slot(key, value, state, k.f.update_count); e != Errc::ok)
      throw Error(e, "cannot restore key " + std::to_string(key) + " from " + name + ": " + std::string(errc_name(e)) +
                         " (is the server's --arena-mb/--max-keys large enough, and the --rule the same?)");
    if (!sync || k.sync_floats == 0) {
      at += std::size_t{k.sync_floats} * sizeof(float);
      continue;
    }
    // Just a next step reads the same in any window; pending steps are this window's (same_sync).
    steps.assign(sync->state_floats(length), 0.0f);
    take(steps.data(), std::size_t{k.sync_floats} * sizeof(float), "sync steps");
    if (sync->used_state_floats(length, steps.data()) != k.sync_floats)
      throw corrupt("key " + std::to_string(key) + ": its sync steps are not as a checkpoint writes them");
    std::string why;
    if (const Errc e = sync->restore_state(key, length, steps.data(), &why); e == Errc::protocol)
      throw corrupt("key " + std::to_string(key) + ": " + why);
    else if (e != Errc::ok)
      throw Error(e, "cannot restore the sync steps of key " + std::to_string(key) + " from " + name + ": " + why);
  }
  Footer f;
  take(&f, sizeof f, "the footer");
  if (std::memcmp(f.magic, kEnd, 8) != 0 || f.keys != h.f.keys || f.crc != crc_of_crcs) throw corrupt("bad footer");
  if (at != size) throw corrupt("trailing bytes after the footer");
  return {h.f.keys, size, h.f.started_unix_ns};
}

CheckpointInfo read_checkpoint(Store& store, SyncAccumulator* sync, const std::string& path,
                               std::optional<std::uint32_t> server_id) {
  const CheckpointFile file(path);
  return parse_checkpoint(file.data(), file.size(), &store, sync, path, server_id);
}

}  // namespace pskv

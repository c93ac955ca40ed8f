#include "transport/shm/sync_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "transport/shm/segment.h"
#include "transport/shm/table_files.h"

namespace pskv::shm {

namespace {

constexpr char kMagic[8] = {'P', 'S', 'K', 'V', 'S', 'Y', 'N', 'C'};
constexpr std::uint32_t kVersion = 1;
constexpr std::size_t kHeaderBytes = 4096;
constexpr std::uint64_t kRecordHeadWords = 3;  // key, length, words

std::string errno_text() {
  return std::strerror(errno);
}

}  // namespace

struct SyncStateFile::Header {
  char magic[8];
  std::uint32_t version, window, workers, threads;
  std::uint64_t capacity;                  // bytes of records the file has room for, after the header
  std::atomic<std::uint64_t> used;         // bytes of whole records
  SyncApplyMark marks[kMaxServerThreads];  // a cache line each
};
SyncStateFile::SyncStateFile(std::string path, std::byte* base, std::size_t size, int fd)
    : path_(std::move(path)), base_(base), size_(size), fd_(fd) {
  static_assert(sizeof(Header) <= kHeaderBytes);
}

SyncStateFile::~SyncStateFile() {
  ::munmap(base_, size_);
  if (fd_ >= 0) ::close(fd_);
}

std::shared_ptr<SyncStateFile> SyncStateFile::create(const std::string& dir, const StoreOptions& store,
                                                     const SyncOptions& sync, std::uint32_t threads) {
  make_private_directory(dir);
  // Every key the store can hold, each block with its record's head.
  const std::uint64_t capacity =
      8 * (store.max_keys * kRecordHeadWords + SyncAccumulator::store_words(sync, store.max_keys, store.arena_bytes));
  const std::string path = dir + "/sync";
  ::unlink(path.c_str());
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw Error(Errc::io, "cannot create " + path + ": " + errno_text());
  const std::size_t size = kHeaderBytes + capacity;
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0 || ::posix_fallocate(fd, 0, kHeaderBytes) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    ::unlink(path.c_str());
    throw Error(Errc::io, "cannot size " + path + ": " + why);
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const std::string why = errno_text();
    ::close(fd);
    ::unlink(path.c_str());
    throw Error(Errc::io, "cannot map " + path + ": " + why);
  }
  auto f = std::shared_ptr<SyncStateFile>(new SyncStateFile(path, static_cast<std::byte*>(p), size, fd));
  Header& h = f->header();
  h.version = kVersion;
  h.window = sync.window;
  h.workers = sync.num_workers;
  h.threads = threads;
  h.capacity = capacity;
  h.used.store(0, std::memory_order_relaxed);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  std::memcpy(h.magic, kMagic, sizeof kMagic);  // last: a file without it was never made whole
  return f;
}

std::unique_ptr<SyncStateFile> SyncStateFile::open_left(const std::string& dir) {
  const std::string path = dir + "/sync";
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return nullptr;
    throw Error(Errc::io, "cannot open " + path + ": " + errno_text());
  }
  struct stat st {};
  const bool sized = ::fstat(fd, &st) == 0 && static_cast<std::uint64_t>(st.st_size) >= kHeaderBytes;
  void* p = sized ? ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                  : MAP_FAILED;
  ::close(fd);
  auto refuse = [&](const std::string& what) {
    return Error(Errc::stale_resource, path + " " + what + "; remove it to start without the dead server's sync steps");
  };
  if (p == MAP_FAILED) throw refuse(sized ? "cannot be mapped: " + errno_text() : "is shorter than its header");
  const auto size = static_cast<std::size_t>(st.st_size);
  auto f = std::unique_ptr<SyncStateFile>(new SyncStateFile(path, static_cast<std::byte*>(p), size, -1));
  const Header& h = f->header();
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0 || h.version != kVersion)
    throw refuse("is not a pskv sync-step file of version " + std::to_string(kVersion));
  if (h.capacity > size - kHeaderBytes || h.used.load(std::memory_order_acquire) > h.capacity ||
      h.threads > kMaxServerThreads || h.window == 0 || h.workers == 0)
    throw refuse("has a header that does not fit the file");
  return f;
}

namespace {

// Backs [at, at + bytes) of the file, whole pages, so that no write there meets SIGBUS.
void back_range(int fd, std::uint64_t at, std::uint64_t bytes, const std::string& path, const std::string& what) {
  const std::uint64_t first = at & ~std::uint64_t{4095}, last = (at + bytes + 4095) & ~std::uint64_t{4095};
  if (const int e = ::posix_fallocate(fd, static_cast<off_t>(first), static_cast<off_t>(last - first)); e != 0)
    throw Error(e == ENOSPC ? Errc::capacity : Errc::io,
                "cannot back " + what + " in " + path + ": " + std::strerror(e) +
                    (e == ENOSPC ? " (/dev/shm is full: its size is a mount option, df /dev/shm shows it)" : ""));
}

}  // namespace

std::uint64_t* SyncStateFile::allocate(Key key, std::uint32_t length, std::size_t words) {
  std::lock_guard lock(mu_);
  Header& h = header();
  const std::uint64_t used = h.used.load(std::memory_order_relaxed);
  const std::uint64_t bytes = (kRecordHeadWords + words) * 8;
  if (words == 0 || bytes > h.capacity - used)
    throw Error(Errc::capacity, path_ + " has no room for the sync steps of key " + std::to_string(key));
  const std::uint64_t at = kHeaderBytes + used;
  // The head and the control word now; the entries as steps need them (back()). The file is
  // new, so every word of it reads as zero until written.
  back_range(fd_, at, (kRecordHeadWords + 1) * 8, path_, "the sync steps of key " + std::to_string(key));
  auto* record = reinterpret_cast<std::uint64_t*>(base_ + at);
  record[0] = key;
  record[1] = length;
  record[2] = words;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  h.used.store(used + bytes, std::memory_order_release);
  return record + kRecordHeadWords;
}

void SyncStateFile::back(std::uint64_t* at, std::size_t words) {
  const auto offset = static_cast<std::uint64_t>(reinterpret_cast<std::byte*>(at) - base_);
  back_range(fd_, offset, words * 8, path_, "a sync step's sum");
}

SyncApplyMark* SyncStateFile::mark(std::uint32_t t) noexcept {
  return t < header().threads ? &header().marks[t] : nullptr;
}
std::uint32_t SyncStateFile::threads() const noexcept {
  return header().threads;
}
std::uint32_t SyncStateFile::window() const noexcept {
  return header().window;
}
std::uint32_t SyncStateFile::workers() const noexcept {
  return header().workers;
}

void SyncStateFile::visit(
    const std::function<void(Key, std::uint32_t length, const std::uint64_t* block, std::uint64_t words)>& f,
    std::string* stopped) const {
  // Any process of the job's user could be writing this file: each word is read once, and only
  // the copies are checked and used.
  const std::uint64_t used = std::min(header().used.load(std::memory_order_acquire), header().capacity);
  std::uint64_t at = 0;
  while (at < used) {
    const auto* record = reinterpret_cast<const std::uint64_t*>(base_ + kHeaderBytes + at);
    const std::uint64_t room = (used - at) / 8;
    if (room < kRecordHeadWords) break;
    const Key key = record[0];
    const std::uint64_t length = record[1], words = record[2];
    if (length == 0 || length > UINT32_MAX || words == 0 || words > room - kRecordHeadWords) break;
    f(key, static_cast<std::uint32_t>(length), record + kRecordHeadWords, words);
    at += (kRecordHeadWords + words) * 8;
  }
  if (at < used && stopped)
    *stopped = "the record at byte " + std::to_string(kHeaderBytes + at) + " of " + path_ + " is cut short";
}

std::uint32_t SyncStateFile::applied_marks() const {
  // Each mark's words are read once (any process of the job's user could be writing them).
  struct Marked {
    Key key;
    std::uint64_t control;
  };
  std::vector<std::pair<std::uint32_t, Marked>> active;
  for (std::uint32_t t = 0; t < header().threads; ++t) {
    const SyncApplyMark& m = header().marks[t];
    if (m.active.load(std::memory_order_acquire) != 0) active.push_back({t, {m.key, m.control}});
  }
  std::uint32_t whole = 0;
  if (active.empty()) return whole;
  visit(
      [&](Key key, std::uint32_t, const std::uint64_t* block, std::uint64_t) {
        for (const auto& [t, m] : active)
          if (m.key == key && SyncAccumulator::control_of(block) == m.control) whole |= 1u << t;
      },
      nullptr);
  return whole;
}

}  // namespace pskv::shm

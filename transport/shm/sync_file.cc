#include "transport/shm/sync_file.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "transport/shm/mapped_file.h"
#include "transport/shm/segment.h"
#include "transport/shm/table_files.h"

namespace pskv::shm {

namespace {

constexpr char kMagic[8] = {'P', 'S', 'K', 'V', 'S', 'Y', 'N', 'C'};
constexpr std::uint32_t kVersion = 1;
constexpr std::size_t kHeaderBytes = 4096;
constexpr std::uint64_t kRecordHeadWords = 3;  // key, length, words

}  // namespace

struct SyncStateFile::Header {
  char magic[8];
  std::uint32_t version, window, workers, threads;
  std::uint64_t capacity;                  // bytes of records the file has room for, after the header
  std::atomic<std::uint64_t> used;         // bytes of whole records
  SyncApplyMark marks[kMaxServerThreads];  // a cache line each
};
SyncStateFile::SyncStateFile(std::unique_ptr<MappedFile> file) : file_(std::move(file)) {
  static_assert(sizeof(Header) <= kHeaderBytes);
}

SyncStateFile::~SyncStateFile() = default;

void SyncStateFile::keep_geometry() noexcept {
  const Header& h = header();
  threads_ = h.threads;
  window_ = h.window;
  workers_ = h.workers;
  capacity_ = h.capacity;
  used_ = h.used.load(std::memory_order_acquire);
}

std::shared_ptr<SyncStateFile> SyncStateFile::create(const std::string& dir, const StoreOptions& store,
                                                     const SyncOptions& sync, std::uint32_t threads) {
  make_private_directory(dir);
  // Every key the store can hold, each block with its record's head.
  const std::uint64_t capacity =
      8 * (store.max_keys * kRecordHeadWords + SyncAccumulator::store_words(sync, store.max_keys, store.arena_bytes));
  const std::string path = dir + "/sync";
  ::unlink(path.c_str());
  auto mapped = MappedFile::create_sparse(path, kHeaderBytes + capacity);
  mapped->back(0, kHeaderBytes, "the header");
  mapped->keep(path);  // a successor's, once this server is killed; its directory goes with a stop
  auto f = std::shared_ptr<SyncStateFile>(new SyncStateFile(std::move(mapped)));
  Header& h = f->header();
  h.version = kVersion;
  h.window = sync.window;
  h.workers = sync.num_workers;
  h.threads = threads;
  h.capacity = capacity;
  h.used.store(0, std::memory_order_relaxed);
  f->keep_geometry();
  std::atomic_signal_fence(std::memory_order_seq_cst);
  std::memcpy(h.magic, kMagic, sizeof kMagic);  // last: a file without it was never made whole
  return f;
}

std::unique_ptr<SyncStateFile> SyncStateFile::open_left(const std::string& dir) {
  const std::string path = dir + "/sync";
  if (::access(path.c_str(), F_OK) != 0 && errno == ENOENT) return nullptr;
  auto mapped = MappedFile::open(path);
  auto refuse = [&](const std::string& what) {
    return Error(Errc::stale_resource, path + " " + what + "; remove it to start without the dead server's sync steps");
  };
  const std::size_t size = mapped->size();
  if (size < kHeaderBytes) throw refuse("is shorter than its header");
  auto f = std::unique_ptr<SyncStateFile>(new SyncStateFile(std::move(mapped)));
  const Header& h = f->header();
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0 || h.version != kVersion)
    throw refuse("is not a pskv sync-step file of version " + std::to_string(kVersion));
  f->keep_geometry();  // first: the copies are what is checked, and all that is used
  if (f->capacity_ > size - kHeaderBytes || f->used_ > f->capacity_ || f->threads_ > kMaxServerThreads ||
      f->window_ == 0 || f->workers_ == 0)
    throw refuse("has a header that does not fit the file");
  return f;
}

std::uint64_t* SyncStateFile::allocate(Key key, std::uint32_t length, std::size_t words) {
  std::lock_guard lock(mu_);
  Header& h = header();
  const std::uint64_t used = used_;  // the file's word is a mirror for a successor, never read back
  const std::uint64_t bytes = (kRecordHeadWords + words) * 8;
  if (words == 0 || used > capacity_ || bytes > capacity_ - used)
    throw Error(Errc::capacity, path() + " has no room for the sync steps of key " + std::to_string(key));
  const std::uint64_t at = kHeaderBytes + used;
  // The head and the control word now; the entries as steps need them (back()). The file is
  // new, so every word of it reads as zero until written.
  file_->back(at, (kRecordHeadWords + 1) * 8, "the sync steps of key " + std::to_string(key));
  auto* record = reinterpret_cast<std::uint64_t*>(file_->data() + at);
  record[0] = key;
  record[1] = length;
  record[2] = words;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  used_ = used + bytes;
  h.used.store(used_, std::memory_order_release);
  return record + kRecordHeadWords;
}

void SyncStateFile::back(std::uint64_t* at, std::size_t words) {
  file_->back(static_cast<std::uint64_t>(reinterpret_cast<std::byte*>(at) - file_->data()), words * 8,
              "a sync step's sum");
}

SyncApplyMark* SyncStateFile::mark(std::uint32_t t) noexcept {
  return t < threads_ ? &header().marks[t] : nullptr;
}
std::uint32_t SyncStateFile::threads() const noexcept {
  return threads_;
}
std::uint32_t SyncStateFile::window() const noexcept {
  return window_;
}
std::uint32_t SyncStateFile::workers() const noexcept {
  return workers_;
}

void SyncStateFile::visit(
    const std::function<void(Key, std::uint32_t length, const std::uint64_t* block, std::uint64_t words)>& f,
    std::string* stopped) const {
  // Any process of the job's user could be writing this file: each word is read once, and only
  // the copies are checked and used.
  const std::uint64_t used = std::min(header().used.load(std::memory_order_acquire), capacity_);
  std::uint64_t at = 0;
  while (at < used) {
    const auto* record = reinterpret_cast<const std::uint64_t*>(file_->data() + kHeaderBytes + at);
    const std::uint64_t room = (used - at) / 8;
    if (room < kRecordHeadWords) break;
    const Key key = record[0];
    const std::uint64_t length = record[1], words = record[2];
    if (length == 0 || length > UINT32_MAX || words == 0 || words > room - kRecordHeadWords) break;
    f(key, static_cast<std::uint32_t>(length), record + kRecordHeadWords, words);
    at += (kRecordHeadWords + words) * 8;
  }
  if (at < used && stopped)
    *stopped = "the record at byte " + std::to_string(kHeaderBytes + at) + " of " + path() + " is cut short";
}

std::uint32_t SyncStateFile::applied_marks() const {
  // Each mark's words are read once (any process of the job's user could be writing them).
  struct Marked {
    Key key;
    std::uint64_t control;
  };
  std::vector<std::pair<std::uint32_t, Marked>> active;
  for (std::uint32_t t = 0; t < threads_; ++t) {
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

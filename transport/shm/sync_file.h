// Sync mode's pending steps of an shm server started to be adopted (shm://NAME?adopt=1 with
// --mode sync) live in a file beside its tables' (tables_directory()/sync), so that a successor
// goes on from every step the dead server had summed: a push is acknowledged once it is summed,
// before its step is applied (docs/ARCHITECTURE.md, "Restarting an shm server").
//
// Layout: a header page [magic | version | window | workers | threads | capacity | used] with one
// SyncApplyMark per server thread, then records [key | length | words | the accumulator's block
// of `words`]. A record is made whole before `used` passes it, so a successor reads records up to
// `used`. The file is sparse: a record's head is backed (posix_fallocate) when it is made, and
// each of its entries when a step first needs it (the entries a key's steps never used cost
// nothing), so a full /dev/shm fails that push with Error(capacity), never a write with SIGBUS.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "store/store.h"
#include "store/sync_accumulator.h"
#include "transport/shm/mapped_file.h"

namespace pskv::shm {

// Thread-safety: allocate() from any thread (it locks); mark(t) by server thread t only; the
// rest by one thread, before the server serves.
class SyncStateFile final : public SyncSpace {
 public:
  // Makes DIR/sync (DIR too, mode 0700, if absent) with room for the pending steps of every key
  // a store of `store` can hold, reserved only as keys are pushed. Throws Error(io) when it cannot.
  static std::shared_ptr<SyncStateFile> create(const std::string& dir, const StoreOptions& store,
                                               const SyncOptions& sync, std::uint32_t threads);
  // What a dead server left in DIR; nullptr when it left none. Throws Error(stale_resource) naming
  // the file when its header does not check out.
  static std::unique_ptr<SyncStateFile> open_left(const std::string& dir);
  ~SyncStateFile() override;
  SyncStateFile(const SyncStateFile&) = delete;
  SyncStateFile& operator=(const SyncStateFile&) = delete;

  std::uint64_t* allocate(Key key, std::uint32_t length, std::size_t words) override;
  void back(std::uint64_t* at, std::size_t words) override;
  // Server thread t's mark (t < threads()).
  SyncApplyMark* mark(std::uint32_t t) noexcept;
  std::uint32_t threads() const noexcept;
  std::uint32_t window() const noexcept;
  std::uint32_t workers() const noexcept;
  const std::string& path() const noexcept { return file_->path(); }

  // A left file's records, in the order they were made. Stops at the first whose header does not
  // check out (its length or its room in the file), and says why in *stopped.
  void visit(const std::function<void(Key, std::uint32_t length, const std::uint64_t* block, std::uint64_t words)>& f,
             std::string* stopped) const;
  // The dead server's threads (bit t: thread t) that were inside an apply that had already
  // counted as done (the key's control word is at the mark's): their store undo records must not
  // roll it back. One reading of the file.
  std::uint32_t applied_marks() const;

 private:
  struct Header;
  explicit SyncStateFile(std::unique_ptr<MappedFile> file);
  Header& header() const noexcept { return *reinterpret_cast<Header*>(file_->data()); }
  // The header's geometry as made or as checked at open_left, read once: any process of the
  // job's user may rewrite the file's words afterwards.
  void keep_geometry() noexcept;
  std::unique_ptr<MappedFile> file_;  // sparse, backed as records and entries are made (see above)
  std::mutex mu_;
  std::uint32_t threads_ = 0, window_ = 0, workers_ = 0;
  std::uint64_t capacity_ = 0;
  std::uint64_t used_ = 0;  // bytes of records this process made (under mu_), or found at open_left
};

}  // namespace pskv::shm

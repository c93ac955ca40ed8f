// Files of /dev/shm mapped shared: what an shm server keeps for its successor (table segments and
// undo records, sync mode's pending steps) lives in them, so that a successor maps the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/memory.h"

namespace pskv::shm {

// One made here is removed with its object unless kept. Thread-safety: as MemoryResource;
// back() from any thread; keep() by the one thread that owns it.
class MappedFile final : public MemoryResource {
 public:
  // A new file of `bytes`, backed now (posix_fallocate): a full tmpfs fails here with
  // Error(capacity), not later with SIGBUS in a write.
  static std::unique_ptr<MappedFile> create(const std::string& path, std::size_t bytes);
  // A new file of `bytes` that reads as zeros and is backed only where back() is called: a write
  // anywhere else may meet SIGBUS on a full tmpfs.
  static std::unique_ptr<MappedFile> create_sparse(const std::string& path, std::size_t bytes);
  // An existing file, whole (a dead server's), kept when the object goes.
  static std::unique_ptr<MappedFile> open(const std::string& path);
  ~MappedFile() override;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::byte* data() noexcept override { return data_; }
  std::size_t size() const noexcept override { return size_; }
  const std::string& path() const noexcept { return path_; }
  // Backs the whole pages of [offset, offset + bytes) of a create_sparse() file. Throws
  // Error(capacity) on a full tmpfs, naming `what`.
  void back(std::uint64_t offset, std::uint64_t bytes, const std::string& what);
  // Not removed when the object goes, and known as `path` now (it was renamed).
  void keep(const std::string& path) {
    path_ = path;
    kept_ = true;
  }

 private:
  explicit MappedFile(std::string path) : path_(std::move(path)) {}
  static std::unique_ptr<MappedFile> make(const std::string& path, std::size_t bytes, bool sparse);
  void map(int fd, std::size_t bytes);
  std::string path_;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  int fd_ = -1;  // kept open for back(), on a sparse file only
  bool kept_ = false;
};

}  // namespace pskv::shm

// The allocator seam under the store: a store is laid out in one contiguous region of memory
// that it does not own the mechanics of. The heap backend maps anonymous memory; the
// shared-memory backend maps a Boost.Interprocess segment; the RDMA backend registers whichever
// region it is given as one memory region.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace pskv {

// Thread-safety: data()/size() are immutable after construction and safe from any thread.
class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  // At least 64-byte aligned; stays mapped at this address for the object's lifetime.
  virtual std::byte* data() noexcept = 0;
  virtual std::size_t size() const noexcept = 0;
};

// Anonymous private mapping, page aligned and zero-filled. Pages are backed only once written
// and go back to the system when the object is destroyed, whatever the allocator's state: what
// a buffer costs in RSS is what was written to it. `huge_pages`: transparent huge pages are
// requested (fewer TLB misses, RSS grows 2 MiB at a time). `purpose` names it in errors.
class HeapMemory final : public MemoryResource {
 public:
  explicit HeapMemory(std::size_t bytes, const char* purpose = "the store arena", bool huge_pages = true);
  ~HeapMemory() override;
  HeapMemory(const HeapMemory&) = delete;
  HeapMemory& operator=(const HeapMemory&) = delete;
  std::byte* data() noexcept override { return data_; }
  std::size_t size() const noexcept override { return size_; }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

// Equal slices of memory carved back to back out of huge-page mappings of several slices each.
// A HeapMemory per slice leaves each one's last partial 2 MiB on 4 KiB pages: a fifth of an
// embedding table's 5 MiB segments, whose random lookups then pay a page walk in four rows of
// twenty. Every slice is zero-filled when taken and page aligned; its memory returns to the
// arena when its MemoryResource is destroyed, and the mappings go back to the system once the
// arena and every slice are gone. What a slice costs in RSS is what was written to it, rounded
// to the huge pages it touches.
// Thread-safety: take() from any thread; slices may be destroyed from any thread, before or
// after the arena.
class SliceArena : public std::enable_shared_from_this<SliceArena> {
 public:
  static std::shared_ptr<SliceArena> make(std::size_t slice_bytes, const char* purpose);
  // Throws Error(capacity) when no mapping can be had, as HeapMemory does.
  std::unique_ptr<MemoryResource> take();

 private:
  SliceArena(std::size_t slice_bytes, const char* purpose);
  class Slice;
  void give_back(std::shared_ptr<MemoryResource> mapping, std::byte* at);

  const std::size_t slice_bytes_, stride_, slices_per_mapping_;
  const char* const purpose_;
  std::mutex mu_;
  std::shared_ptr<MemoryResource> mapping_;  // the one being carved
  std::size_t carved_ = 0;                   // slices taken from it
  std::vector<std::pair<std::shared_ptr<MemoryResource>, std::byte*>> returned_;
};

inline constexpr std::size_t kCacheLine = 64;
constexpr std::size_t align_up(std::size_t n, std::size_t a) noexcept {
  return (n + a - 1) / a * a;
}

// A software prefetch for reading. Through this helper, not __builtin_prefetch directly: GCC 12
// deletes a __builtin_prefetch whose address it computes from a hash like mix64 (seen at -O1 and
// up: a sparse batch's index probes lost every prefetch and ran at 0.65x), and the empty asm
// makes the address opaque so the prefetch stays. It costs no instruction.
inline void prefetch(const void* p) noexcept {
  asm volatile("" : "+r"(p));
  __builtin_prefetch(p);
}

}  // namespace pskv

#include "common/memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <tuple>

#include "pskv/error.h"

namespace pskv {

HeapMemory::HeapMemory(std::size_t bytes, const char* purpose, bool huge_pages) : size_(bytes) {
  if (bytes == 0) throw Error(Errc::invalid_argument, "HeapMemory: zero bytes requested");
  constexpr std::size_t kHugePage = 2u << 20;
  huge_pages = huge_pages && bytes >= kHugePage;
  // A huge page covers only an aligned 2 MiB of the mapping, and mmap aligns to 4 KiB: an
  // embedding table's 5 MiB segments had 57% of their bytes on huge pages. The mapping is made
  // 2 MiB longer and its unaligned head and tail are given back.
  const std::size_t mapped = huge_pages ? bytes + kHugePage : bytes;
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw Error(Errc::capacity, "cannot map " + std::to_string(bytes) + " bytes for " + purpose + " (" +
                                    std::strerror(errno) + "); lower the limit that sizes it or free memory");
  auto* start = static_cast<std::byte*>(p);
  if (huge_pages) {
    const std::size_t head = (kHugePage - reinterpret_cast<std::uintptr_t>(start) % kHugePage) % kHugePage;
    const std::size_t end = align_up(head + bytes, static_cast<std::size_t>(sysconf(_SC_PAGESIZE)));
    if (head > 0) munmap(start, head);
    if (mapped > end) munmap(start + end, mapped - end);
    start += head;
    madvise(start, bytes, MADV_HUGEPAGE);
  }
  data_ = start;
}

HeapMemory::~HeapMemory() {
  if (data_) munmap(data_, size_);
}

namespace {
constexpr std::size_t kHugePageBytes = 2u << 20;
constexpr std::size_t kArenaMappingBytes = 32u << 20;  // slices per mapping: as many as fit
}  // namespace

class SliceArena::Slice final : public MemoryResource {
 public:
  Slice(std::weak_ptr<SliceArena> arena, std::shared_ptr<MemoryResource> mapping, std::byte* at, std::size_t bytes)
      : arena_(std::move(arena)), mapping_(std::move(mapping)), at_(at), bytes_(bytes) {}
  ~Slice() override {
    if (auto arena = arena_.lock()) arena->give_back(std::move(mapping_), at_);
  }
  std::byte* data() noexcept override { return at_; }
  std::size_t size() const noexcept override { return bytes_; }

 private:
  std::weak_ptr<SliceArena> arena_;
  std::shared_ptr<MemoryResource> mapping_;
  std::byte* at_;
  std::size_t bytes_;
};

std::shared_ptr<SliceArena> SliceArena::make(std::size_t slice_bytes, const char* purpose) {
  if (slice_bytes == 0) throw Error(Errc::invalid_argument, "SliceArena: zero-byte slices requested");
  return std::shared_ptr<SliceArena>(new SliceArena(slice_bytes, purpose));
}

SliceArena::SliceArena(std::size_t slice_bytes, const char* purpose)
    : slice_bytes_(slice_bytes),
      stride_(align_up(slice_bytes, static_cast<std::size_t>(sysconf(_SC_PAGESIZE)))),
      slices_per_mapping_(std::max<std::size_t>(1, kArenaMappingBytes / stride_)),
      purpose_(purpose) {}

std::unique_ptr<MemoryResource> SliceArena::take() {
  std::shared_ptr<MemoryResource> mapping;
  std::byte* at = nullptr;
  bool reused = false;
  {
    std::lock_guard lock(mu_);
    if (!returned_.empty()) {
      std::tie(mapping, at) = std::move(returned_.back());
      returned_.pop_back();
      reused = true;
    } else {
      if (!mapping_ || carved_ == slices_per_mapping_) {
        // Whole huge pages: the last slice's tail is covered too (HeapMemory aligns the start).
        mapping_ = std::make_shared<HeapMemory>(align_up(stride_ * slices_per_mapping_, kHugePageBytes), purpose_);
        carved_ = 0;
      }
      mapping = mapping_;
      at = mapping_->data() + stride_ * carved_++;
    }
  }
  // Rare (a slice given back early): its last holder may have written it.
  if (reused) std::memset(at, 0, slice_bytes_);
  return std::make_unique<Slice>(weak_from_this(), std::move(mapping), at, slice_bytes_);
}

void SliceArena::give_back(std::shared_ptr<MemoryResource> mapping, std::byte* at) {
  std::lock_guard lock(mu_);
  try {
    returned_.emplace_back(std::move(mapping), at);
  } catch (const std::bad_alloc&) {
    // Not reused: its mapping goes when its other slices do.
  }
}

}  // namespace pskv

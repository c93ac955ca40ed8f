#include "common/memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

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

}  // namespace pskv

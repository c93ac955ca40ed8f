#include "common/memory.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "pskv/error.h"

namespace pskv {

HeapMemory::HeapMemory(std::size_t bytes, const char* purpose, bool huge_pages) : size_(bytes) {
  if (bytes == 0) throw Error(Errc::invalid_argument, "HeapMemory: zero bytes requested");
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw Error(Errc::capacity, "cannot map " + std::to_string(bytes) + " bytes for " + purpose + " (" +
                                    std::strerror(errno) + "); lower the limit that sizes it or free memory");
  if (huge_pages && bytes >= (2u << 20)) madvise(p, bytes, MADV_HUGEPAGE);
  data_ = static_cast<std::byte*>(p);
}

HeapMemory::~HeapMemory() {
  if (data_) munmap(data_, size_);
}

}  // namespace pskv

// The IDX loader through its real file path (plain or gzip detection included): the input is
// split into an images file and a labels file in memory-backed files.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "apps/mnist/idx.h"
#include "pskv/error.h"

namespace {
std::string memfile(const std::uint8_t* data, std::size_t size, int* fd) {
  *fd = memfd_create("idx", 0);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = write(*fd, data + done, size - done);
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  return "/proc/self/fd/" + std::to_string(*fd);
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  // The first two bytes choose where the images file ends and the labels file begins.
  const std::size_t split = std::min<std::size_t>(size - 2, (std::size_t{data[0]} << 8 | data[1]));
  int a = -1, b = -1;
  const std::string images = memfile(data + 2, split, &a);
  const std::string labels = memfile(data + 2 + split, size - 2 - split, &b);
  try {
    pskv::mnist::load_idx(images, labels);
  } catch (const pskv::Error&) {
  }
  close(a);
  close(b);
  return 0;
}

#include "transport/shm/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "pskv/error.h"

namespace pskv::shm {

namespace {

std::string errno_text() {
  return std::strerror(errno);
}

Error backing_error(int e, const std::string& what, const std::string& path) {
  return Error(e == ENOSPC ? Errc::capacity : Errc::io,
               "cannot back " + what + " of " + path + ": " + std::strerror(e) +
                   (e == ENOSPC ? " (/dev/shm is full: its size is a mount option, df /dev/shm shows it)" : ""));
}

}  // namespace

std::unique_ptr<MappedFile> MappedFile::make(const std::string& path, std::size_t bytes, bool sparse) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw Error(Errc::io, "cannot create " + path + ": " + errno_text());
  auto f = std::unique_ptr<MappedFile>(new MappedFile(path));  // removes the file if this fails
  if (sparse) {
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const std::string why = errno_text();
      ::close(fd);
      throw Error(Errc::io, "cannot size " + path + ": " + why);
    }
    f->fd_ = ::dup(fd);
  } else if (const int e = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); e != 0) {
    ::close(fd);
    throw backing_error(e, std::to_string(bytes >> 20) + " MiB", path);
  }
  f->map(fd, bytes);
  return f;
}

std::unique_ptr<MappedFile> MappedFile::create(const std::string& path, std::size_t bytes) {
  return make(path, bytes, false);
}

std::unique_ptr<MappedFile> MappedFile::create_sparse(const std::string& path, std::size_t bytes) {
  return make(path, bytes, true);
}

std::unique_ptr<MappedFile> MappedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) throw Error(Errc::io, "cannot open " + path + ": " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw Error(Errc::io, "cannot stat " + path + ": " + errno_text());
  }
  auto f = std::unique_ptr<MappedFile>(new MappedFile(path));
  f->kept_ = true;
  if (st.st_size > 0)
    f->map(fd, static_cast<std::size_t>(st.st_size));
  else
    ::close(fd);
  return f;
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
  if (!kept_) ::unlink(path_.c_str());
}

void MappedFile::back(std::uint64_t offset, std::uint64_t bytes, const std::string& what) {
  const std::uint64_t first = offset & ~std::uint64_t{4095}, last = (offset + bytes + 4095) & ~std::uint64_t{4095};
  if (const int e = ::posix_fallocate(fd_, static_cast<off_t>(first), static_cast<off_t>(last - first)); e != 0)
    throw backing_error(e, what, path_);
}

void MappedFile::map(int fd, std::size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw Error(Errc::io, "cannot map " + path_ + ": " + errno_text());
  data_ = static_cast<std::byte*>(p);
  size_ = bytes;
  ::madvise(p, bytes, MADV_HUGEPAGE);  // where shmem huge pages are enabled; harmless elsewhere
}

}  // namespace pskv::shm

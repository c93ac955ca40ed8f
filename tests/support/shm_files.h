// A directory of /dev/shm files of a test's own (an shm server's tables_directory), removed before
// and after the test. Header-only, for unit tests that link no support library.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>

#include "transport/shm/table_files.h"

namespace pskv::testing {

struct ScratchTablesDirectory {
  std::string path;
  explicit ScratchTablesDirectory(const std::string& tag)
      : path(shm::tables_directory(tag + "-" + std::to_string(getpid()), std::random_device{}())) {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  ~ScratchTablesDirectory() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  ScratchTablesDirectory(const ScratchTablesDirectory&) = delete;
  ScratchTablesDirectory& operator=(const ScratchTablesDirectory&) = delete;
};

}  // namespace pskv::testing

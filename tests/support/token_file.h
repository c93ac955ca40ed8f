// Shared by the authentication tests (tests/transport, tests/integration, tests/rdma).
#pragma once

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "pskv/client.h"
#include "pskv/error.h"

namespace pskv::testing {

// A token file under /tmp holding `secret`, with `mode`; removed when it goes out of scope.
class TokenFile {
 public:
  explicit TokenFile(const std::string& secret, mode_t mode = 0600) {
    char tmpl[] = "/tmp/pskv-token-XXXXXX";
    const int fd = ::mkstemp(tmpl);
    path = tmpl;
    EXPECT_EQ(::write(fd, secret.data(), secret.size()), static_cast<ssize_t>(secret.size()));
    ::close(fd);
    ::chmod(path.c_str(), mode);
  }
  ~TokenFile() { ::unlink(path.c_str()); }
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  std::string path;
};

// Connecting with `o` must fail with Errc::permission and a message that contains `hint`.
inline void expect_permission_error(const ClientOptions& o, const std::string& hint) {
  try {
    Client c(o);
    ADD_FAILURE() << "connected without passing authentication";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::permission) << e.what();
    EXPECT_NE(std::string(e.what()).find(hint), std::string::npos) << e.what();
  }
}

}  // namespace pskv::testing

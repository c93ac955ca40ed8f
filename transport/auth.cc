#include "transport/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/log.h"
#include "pskv/error.h"
#include "transport/wire.h"

namespace pskv::auth {

namespace {
constexpr char kProtocolLabel[] = "pskv-auth-1 ";
static_assert(kNonceBytes == wire::kAuthNonceBytes && kProofBytes == wire::kAuthProofBytes);
}  // namespace

Nonce random_nonce() {
  Nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1)
    throw Error(Errc::io, "OpenSSL RAND_bytes failed: the system has no entropy source for authentication nonces");
  return n;
}

std::shared_ptr<const Token> Token::load_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw Error(Errc::permission, "auth token file " + path + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw Error(Errc::permission, "auth token file " + path + " is not a regular file");
  if (st.st_mode & (S_IRWXG | S_IRWXO))
    throw Error(Errc::permission,
                "auth token file " + path + " is accessible by group or others; restrict it with chmod 600 " + path);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(Errc::permission, "cannot read auth token file " + path + ": " + std::strerror(errno));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  std::string secret = bytes.str();
  while (!secret.empty() && std::strchr(" \t\r\n", secret.back())) secret.pop_back();
  if (secret.size() < kMinTokenBytes)
    throw Error(Errc::permission, "auth token in " + path + " has " + std::to_string(secret.size()) +
                                      " bytes; use at least " + std::to_string(kMinTokenBytes) +
                                      " (e.g. head -c 32 /dev/urandom | base64 > " + path + ")");
  return std::make_shared<const Token>(std::move(secret));
}

Token::Token(std::string secret) : secret_(std::move(secret)) {
  if (secret_.empty()) throw Error(Errc::invalid_argument, "empty authentication token");
}

Proof Token::mac(const char* label, const Nonce& first, const Nonce& second) const {
  unsigned char message[sizeof kProtocolLabel + 8 + 2 * kNonceBytes];
  std::size_t n = 0;
  std::memcpy(message, kProtocolLabel, sizeof kProtocolLabel - 1);
  n += sizeof kProtocolLabel - 1;
  const std::size_t label_bytes = std::strlen(label);
  std::memcpy(message + n, label, label_bytes);
  n += label_bytes;
  std::memcpy(message + n, first.data(), kNonceBytes);
  n += kNonceBytes;
  std::memcpy(message + n, second.data(), kNonceBytes);
  n += kNonceBytes;
  Proof out{};
  unsigned int out_bytes = 0;
  if (!HMAC(EVP_sha256(), secret_.data(), static_cast<int>(secret_.size()), message, n, out.data(), &out_bytes) ||
      out_bytes != kProofBytes)
    throw Error(Errc::io, "OpenSSL HMAC-SHA256 failed");
  return out;
}

Proof Token::server_proof(const Nonce& client, const Nonce& server) const {
  return mac("server", client, server);
}
Proof Token::client_proof(const Nonce& server, const Nonce& client) const {
  return mac("client", server, client);
}

bool proofs_equal(const Proof& a, const Proof& b) noexcept {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::optional<Proof> answer(const Token* token, const Nonce& client_nonce, const std::uint8_t* server_nonce,
                            const std::uint8_t* server_proof, const std::string& endpoint) {
  if (!server_nonce) {
    if (token)
      throw Error(Errc::permission, endpoint +
                                        " did not ask for authentication, but this client has a token: refusing "
                                        "a server that cannot prove it (start it with the same --auth-token-file)");
    return std::nullopt;
  }
  if (!token)
    throw Error(Errc::permission, endpoint +
                                      " requires authentication: give this client the server's token "
                                      "(--auth-token-file or PSKV_AUTH_TOKEN_FILE)");
  Nonce nonce;
  Proof proof;
  std::memcpy(nonce.data(), server_nonce, kNonceBytes);
  std::memcpy(proof.data(), server_proof, kProofBytes);
  if (!proofs_equal(proof, token->server_proof(client_nonce, nonce)))
    throw Error(Errc::permission, endpoint +
                                      " failed to prove it holds the token: it is not the server this "
                                      "client's --auth-token-file belongs to");
  return token->client_proof(nonce, client_nonce);
}

std::string refuse(std::uint32_t server_id, const std::string& address, const std::string& what) {
  log::warn("auth",
            "server " + std::to_string(server_id) + " refused unauthenticated peer " + address + ": it " + what);
  // Short enough for an rdma_cm REJ (132 bytes of text) with the reasons used.
  return "authentication failed: this server requires a token (--auth-token-file or PSKV_AUTH_TOKEN_FILE); "
         "this connection " +
         what;
}

}  // namespace pskv::auth

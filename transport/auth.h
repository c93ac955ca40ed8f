// Shared-secret authentication of TCP and RDMA connections (docs/protocol.md, "Authentication").
// Both sides prove they hold the token with HMAC-SHA256 over two fresh nonces, one from each
// side, so neither proof can be replayed on another connection, and a label per direction keeps
// one side's proof from being reflected back as the other's.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace pskv::auth {

inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kProofBytes = 32;  // HMAC-SHA256
// Tokens shorter than this are refused: they could be guessed from one observed proof.
inline constexpr std::size_t kMinTokenBytes = 16;

using Nonce = std::array<std::uint8_t, kNonceBytes>;
using Proof = std::array<std::uint8_t, kProofBytes>;

// A fresh nonce from the OpenSSL CSPRNG; throws Error(io) if it has no entropy.
Nonce random_nonce();

// The shared secret. Thread-safety: immutable after construction; safe to share.
class Token {
 public:
  // Reads the token from `path`: the file's bytes without trailing whitespace. Throws
  // Error(permission) when the file is missing, unreadable, readable by group or others (it
  // must be chmod 600, like an ssh key), or shorter than kMinTokenBytes.
  static std::shared_ptr<const Token> load_file(const std::string& path);
  explicit Token(std::string secret);

  // What the server sends to prove the token: HMAC(token, "server" | client nonce | server nonce).
  Proof server_proof(const Nonce& client, const Nonce& server) const;
  // What the client sends: HMAC(token, "client" | server nonce | client nonce).
  Proof client_proof(const Nonce& server, const Nonce& client) const;

 private:
  Proof mac(const char* label, const Nonce& first, const Nonce& second) const;
  std::string secret_;
};

// Constant-time comparison (CRYPTO_memcmp), so a forger learns nothing from the reply's timing.
bool proofs_equal(const Proof& a, const Proof& b) noexcept;

// The client's side, shared by every backend. With the server's challenge (its nonce and proof
// over both nonces): checks that proof and returns the client's. Without one (nullptr): returns
// nothing, or refuses when the client has a token (a server that cannot prove it is not trusted).
// Throws Error(permission) naming `endpoint` when the client has no token or the proof is wrong.
std::optional<Proof> answer(const Token* token, const Nonce& client_nonce, const std::uint8_t* server_nonce,
                            const std::uint8_t* server_proof, const std::string& endpoint);

// The server's side of a refusal: logs it ("pskv-server N: refused unauthenticated peer ADDRESS:
// it WHAT") and returns the error text the peer is sent.
std::string refuse(std::uint32_t server_id, const std::string& address, const std::string& what);

}  // namespace pskv::auth

// The token challenge's building blocks: the proof construction (pinned by a known answer, so
// both ends of a mixed-version cluster agree), nonces, and the token file's safety checks.
#include "transport/auth.h"

#include <gtest/gtest.h>
#include <cstdio>

#include "pskv/error.h"
#include "support/token_file.h"

namespace pskv::auth {
namespace {

std::string hex(const Proof& p) {
  std::string out;
  char b[3];
  for (std::uint8_t x : p) {
    std::snprintf(b, sizeof b, "%02x", x);
    out += b;
  }
  return out;
}

Nonce counting_nonce(std::uint8_t first) {
  Nonce n{};
  for (std::size_t i = 0; i < n.size(); ++i) n[i] = static_cast<std::uint8_t>(first + i);
  return n;
}

using testing::TokenFile;

TEST(AuthProof, MatchesHmacSha256OverTheLabelledNonces) {
  // Expected values: Python's hmac.new(key, b"pskv-auth-1 server" + client + server, sha256).
  const Token t("0123456789abcdef-secret");
  const Nonce client = counting_nonce(0), server = counting_nonce(32);
  EXPECT_EQ(hex(t.server_proof(client, server)), "12f1f35b2f85f0e45f87848166d5afad9233a69d371106424ca85fcebcab7976");
  EXPECT_EQ(hex(t.client_proof(server, client)), "91d9cb791395a73fd203200f92603b6a1eb061dc961a33e901ee318e34d97284");
}

TEST(AuthProof, DirectionsNoncesAndTokensAllChangeTheProof) {
  const Token t("0123456789abcdef-secret"), other("0123456789abcdef-secreT");
  const Nonce a = counting_nonce(1), b = counting_nonce(2);
  // A server's proof cannot be reflected back as a client's over the same nonces.
  EXPECT_FALSE(proofs_equal(t.server_proof(a, b), t.client_proof(a, b)));
  EXPECT_FALSE(proofs_equal(t.client_proof(a, b), t.client_proof(b, a)));
  EXPECT_FALSE(proofs_equal(t.client_proof(a, b), other.client_proof(a, b)));
  EXPECT_TRUE(proofs_equal(t.client_proof(a, b), Token("0123456789abcdef-secret").client_proof(a, b)));
}

TEST(AuthNonce, IsFreshEachTime) {
  EXPECT_NE(random_nonce(), random_nonce());
}

TEST(AuthTokenFile, TrailingNewlineIsNotPartOfTheToken) {
  TokenFile f("0123456789abcdef-secret\n", 0600);
  const auto t = Token::load_file(f.path);
  const Nonce a = counting_nonce(1), b = counting_nonce(2);
  EXPECT_TRUE(proofs_equal(t->client_proof(a, b), Token("0123456789abcdef-secret").client_proof(a, b)));
}

void expect_refused(const std::string& path, const std::string& hint) {
  try {
    Token::load_file(path);
    ADD_FAILURE() << "loaded " << path;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::permission);
    EXPECT_NE(std::string(e.what()).find(hint), std::string::npos) << e.what();
  }
}

TEST(AuthTokenFile, UnsafeShortOrMissingFilesAreRefusedWithTheFix) {
  TokenFile readable("0123456789abcdef-secret", 0644);
  expect_refused(readable.path, "chmod 600");
  TokenFile short_token("short\n", 0600);
  expect_refused(short_token.path, "at least 16");
  expect_refused("/nonexistent/pskv-token", "No such file");
}

}  // namespace
}  // namespace pskv::auth

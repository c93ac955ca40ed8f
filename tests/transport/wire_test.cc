#include "transport/wire.h"

#include <gtest/gtest.h>

#include "transport/uri.h"

namespace pskv {
namespace {

using namespace wire;

TEST(Wire, ValidHeaderPasses) {
  FrameHeader h = make_header(Op::push, 7, 2, 64);
  std::string why;
  EXPECT_EQ(validate_header(h, {}, false, &why), Errc::ok) << why;
}

TEST(Wire, RejectsBadMagicVersionOpAndDirection) {
  std::string why;
  FrameHeader h = make_header(Op::pull, 1, 1, 0);
  h.magic = 0xdeadbeef;
  EXPECT_EQ(validate_header(h, {}, false, &why), Errc::protocol);
  EXPECT_NE(why.find("magic"), std::string::npos);
  h = make_header(Op::pull, 1, 1, 0);
  h.version = 99;
  EXPECT_EQ(validate_header(h, {}, false, &why), Errc::protocol);
  EXPECT_NE(why.find("matching pskv builds"), std::string::npos);
  h = make_header(Op::pull, 1, 1, 0);
  h.op = 250;
  EXPECT_EQ(validate_header(h, {}, false, &why), Errc::protocol);
  h = make_header(Op::pull, 1, 1, 0);
  h.flags = kResponse;
  EXPECT_EQ(validate_header(h, {}, false, &why), Errc::protocol);
  EXPECT_EQ(validate_header(h, {}, true, &why), Errc::ok);
}

TEST(Wire, EnforcesLimitsBeforeAnyAllocation) {
  Limits limits{.max_keys = 10, .max_payload_bytes = 1000};
  std::string why;
  EXPECT_EQ(validate_header(make_header(Op::push, 1, 11, 40), limits, false, &why), Errc::capacity);
  EXPECT_EQ(validate_header(make_header(Op::push, 1, 1, 1ull << 40), limits, false, &why), Errc::capacity);
  EXPECT_NE(why.find("--max-request-mb"), std::string::npos);
  EXPECT_EQ(validate_header(make_header(Op::pull, 1, 1, 8), limits, false, &why), Errc::protocol)
      << "a pull request carries no payload";
  EXPECT_EQ(validate_header(make_header(Op::push, 1, 1, 6), limits, false, &why), Errc::protocol) << "partial float";
}

TEST(Wire, KeyTableMustMatchPayload) {
  std::vector<KeyEntry> keys{{1, 4, 0}, {2, 2, 0}};
  std::string why;
  EXPECT_EQ(validate_keys(make_header(Op::push, 1, 2, 24), keys, &why), Errc::ok);
  EXPECT_EQ(validate_keys(make_header(Op::push, 1, 2, 28), keys, &why), Errc::protocol);
  EXPECT_EQ(validate_keys(make_header(Op::pull, 1, 2, 0), keys, &why), Errc::ok);
  keys[1].length = 0;
  EXPECT_EQ(validate_keys(make_header(Op::pull, 1, 2, 0), keys, &why), Errc::invalid_argument);
}

TEST(Wire, Crc32MatchesKnownValue) {
  const char* text = "123456789";
  EXPECT_EQ(crc32_update(0, text, 9), 0xCBF43926u);
  EXPECT_EQ(crc32_update(crc32_update(0, text, 4), text + 4, 5), 0xCBF43926u);
}

TEST(Uri, ParsesEveryScheme) {
  Uri t = parse_uri("tcp://127.0.0.1:9000");
  EXPECT_EQ(t.scheme, "tcp");
  EXPECT_EQ(t.host, "127.0.0.1");
  EXPECT_EQ(t.port, 9000);
  EXPECT_EQ(t.str(), "tcp://127.0.0.1:9000");
  Uri v6 = parse_uri("rdma://[fe80::1]:7000?dev=rxe0&gid=1");
  EXPECT_EQ(v6.host, "fe80::1");
  EXPECT_EQ(v6.params.at("dev"), "rxe0");
  EXPECT_EQ(v6.str(), "rdma://[fe80::1]:7000?dev=rxe0&gid=1");
  EXPECT_EQ(parse_uri("shm://job-42_a").name, "job-42_a");
}

TEST(Uri, RejectsMalformed) {
  for (const char* bad : {"127.0.0.1:9000", "udp://h:1", "tcp://h", "tcp://:1", "tcp://h:99999", "tcp://h:1x",
                          "shm://", "shm://../etc/passwd", "shm://a b", "rdma://h:1?novalue"})
    EXPECT_THROW(parse_uri(bad), Error) << bad;
}

}  // namespace
}  // namespace pskv

#include "transport/wire.h"

#include <gtest/gtest.h>

#include "transport/listener.h"
#include "transport/transport.h"
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
  for (const char* bad : {"127.0.0.1:9000", "://h:1", "tcp://h", "tcp://:1", "tcp://h:99999", "tcp://h:1x", "shm://",
                          "shm://../etc/passwd", "shm://a b", "fake://", "rdma://h:1?novalue"})
    EXPECT_THROW(parse_uri(bad), Error) << bad;
}

// Which schemes exist is the factories' business: an unknown one parses, and is refused there.
TEST(Uri, UnknownSchemesAreRefusedByTheFactories) {
  const Uri udp = parse_uri("udp://h:1");
  try {
    transport::connect(udp, {});
    ADD_FAILURE() << "connect accepted udp://";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported);
    EXPECT_NE(std::string(e.what()).find("no udp transport"), std::string::npos) << e.what();
  }
  EXPECT_THROW(transport::listen(udp, {}), Error);
}

// Backend settings are URI parameters: each taken once, within its bounds, and none unknown.
TEST(Uri, ParamsAreCheckedAndUnknownOnesRefused) {
  const Uri u = parse_uri("shm://job?clients=8&push=server&colour=blue");
  UriParams p(u);
  EXPECT_EQ(p.number("clients", 64, 1, 4096), 8u);
  EXPECT_EQ(p.number("area_mb", 32, 1, 4096), 32u);  // absent: the fallback
  EXPECT_EQ(p.choice("push", "worker", {"worker", "server"}), "server");
  try {
    p.finish();
    ADD_FAILURE() << "an unknown parameter was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("colour"), std::string::npos) << e.what();
  }
  UriParams q(parse_uri("shm://job?clients=0"));
  EXPECT_THROW(q.number("clients", 64, 1, 4096), Error);
  UriParams r(parse_uri("tcp://h:1?push=sideways"));
  EXPECT_THROW(r.choice("push", "pieces", {"pieces", "whole"}), Error);
  EXPECT_THROW(transport::listen(parse_uri("tcp://127.0.0.1:0?colour=blue"), {}), Error);
}

}  // namespace
}  // namespace pskv

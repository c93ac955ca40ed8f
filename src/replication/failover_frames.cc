#include "replication/failover_frames.h"

namespace pskv::replication {
namespace {
std::string no_failover(const ShardEngine& engine) {
  return "server " + std::to_string(engine.options().server_id) +
         " runs without --failover-ms: it takes no part in failover";
}
}  // namespace

Errc take_failover_frame(ShardEngine& engine, wire::Op op, std::span<const KeyEntry> keys, const float* payload,
                         std::uint64_t payload_bytes, std::string* why) {
  Membership* membership = engine.membership();
  if (!membership) {
    *why = no_failover(engine);
    return Errc::unsupported;
  }
  wire::Certificate c;
  std::uint32_t requester = 0;
  if (const Errc e = wire::decode_down_vote(keys, payload, payload_bytes, &c, &requester, why); e != Errc::ok) return e;
  switch (op) {
    case wire::Op::down_vote:
      return membership->vote(c.server, c.incarnation, c.holder, c.uri, requester, why);
    case wire::Op::down_certified:
      return membership->certified(c.server, c.incarnation, c.holder, c.uri, why);
    case wire::Op::hand_back:
      return membership->hand_back(c.server, c.incarnation, c.holder, c.uri, requester, why);
    default:
      *why = std::string(wire::op_name(static_cast<std::uint16_t>(op))) + " is not a failover frame";
      return Errc::protocol;
  }
}

Errc read_certificates(const ShardEngine& engine, std::uint64_t arg0, std::string* text, std::string* why) {
  const Membership* membership = engine.membership();
  if (!membership) {
    *why = no_failover(engine);
    return Errc::unsupported;
  }
  *text = membership->certificates(wire::certificates_of(arg0));
  return Errc::ok;
}

}  // namespace pskv::replication

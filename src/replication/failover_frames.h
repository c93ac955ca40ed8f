// Failover's frames (docs/protocol.md, ops 25-28) as a backend takes them: the votes,
// certificates and hand-backs servers send each other, and the certificates anyone may ask for.
// tcp and rdma servers receive the same frames and answer them here alike.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "engine/shard_engine.h"
#include "transport/wire.h"

namespace pskv::replication {

// down_vote, down_certified or hand_back from another server: decoded, checked and handed to the
// engine's Membership. unsupported (with *why) from a server run without --failover-ms.
Errc take_failover_frame(ShardEngine& engine, wire::Op op, std::span<const KeyEntry> keys, const float* payload,
                         std::uint64_t payload_bytes, std::string* why);

// certificates (its arg0: wire::certificates_about): every certificate this server knows to have
// won, of one server or of all, as the answer's text (wire::encode_certificates). unsupported
// from a server without --failover-ms, which clients take to mean that the ring has no failover.
Errc read_certificates(const ShardEngine& engine, std::uint64_t arg0, std::string* text, std::string* why);

}  // namespace pskv::replication

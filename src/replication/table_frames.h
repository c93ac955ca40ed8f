// The replication frames of embedding tables (docs/protocol.md, ops 20-24) as a server backend
// takes them: tcp and rdma servers receive the same frames, and decode, check and answer them
// here alike.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "engine/shard_engine.h"
#include "transport/wire.h"

namespace pskv::replication {

// replica_table, replica_rows, replica_unrows or replica_rows_marked, from the connection the
// backend tags `connection` (tags grow with every accept: ShardEngine::mark_replica): decoded,
// checked and applied to `engine`'s replica of the origin (arg0). protocol for a frame of the
// wrong shape, with *why.
Errc apply_table_frame(ShardEngine& engine, const wire::FrameHeader& h, std::span<const KeyEntry> keys,
                       const float* payload, std::uint64_t connection, std::string* why);

// replica_table_rows: a page of the replica's copy of the origin's table (or of the server's
// own table, when arg0 is its id), encoded as its answer in at most `max_bytes`: a
// ReplicaRowsHeader, the push marks, the row ids, then their records.
Errc read_table_page(const ShardEngine& engine, const wire::FrameHeader& h, std::span<const KeyEntry> keys,
                     std::uint64_t max_bytes, std::string* bytes, std::string* why);

}  // namespace pskv::replication

// Embedding tables on a replicated server, as a backend takes them: a client's table_create and
// table_push (applied, and shipped to the replicas before the reply), and the replication frames
// (docs/protocol.md, ops 20-24). tcp and rdma servers receive the same requests and frames, and
// decode, check and answer them here alike.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "engine/shard_engine.h"
#include "transport/wire.h"

namespace pskv::replication {

// Makes a reply a backend resumes later (its connection, its request).
using Park = std::function<std::unique_ptr<Parked>()>;

// table_create's key table and value. With a replicator the table is made, and its empty copy
// queued to the replicas, in one step, and the creator's answer waits for the copies: park() is
// called and *parked set. Otherwise the status to answer at once.
Errc create_table(ShardEngine& engine, std::span<const KeyEntry> keys, const float* payload, const Park& park,
                  std::string* why, bool* parked);

// table_push from `worker` (its key table led by a retrying client's identity, if any). With a
// replicator, room for the rows' records is taken first, and the answer (park(), *parked set)
// waits until every live replica holds the rows; an identified push is applied and shipped with
// its mark in the table stream's order (Replicator::push_rows_in_order). Otherwise the status to
// answer at once.
Errc push_table(ShardEngine& engine, const wire::FrameHeader& h, std::span<const KeyEntry> keys, const float* grads,
                std::uint32_t worker, const Park& park, std::string* why, bool* parked);

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

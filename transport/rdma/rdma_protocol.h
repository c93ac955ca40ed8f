// What the RDMA client and server agree on (docs/protocol.md, "RDMA"): the rdma_cm private data
// exchanged at connect time, the layout of a push descriptor in a client's receive region, the
// LOOKUP reply entries, and the sizes both sides bound their messages by. Everything else reuses
// the wire frames of transport/wire.h. Little-endian, as every supported host is.
#pragma once

#include <cstddef>
#include <cstdint>

#include "transport/wire.h"

namespace pskv::rdma {

// Bumped whenever anything in this file changes meaning; checked in both directions at connect.
inline constexpr std::uint16_t kRdmaVersion = 3;
inline constexpr std::uint32_t kCmMagic = 0x41444d52;  // "RMDA" in memory: a pskv rdma peer

// Every control message (SEND) and every reply fits one receive buffer of this size.
inline constexpr std::size_t kControlBytes = 16u << 10;
// Keys per LOOKUP: the reply carries one LookupEntry per key and must fit kControlBytes.
inline constexpr std::uint32_t kLookupBatch =
    static_cast<std::uint32_t>((kControlBytes - sizeof(wire::FrameHeader)) / sizeof(wire::KeyEntry));
// Push descriptors start at multiples of this in the receive region; the immediate carries the
// offset in these units, so 32 bits address 256 GiB.
inline constexpr std::size_t kDescriptorAlign = 64;
// The largest receive region a server grants (recv_mb): a region's offsets, in kDescriptorAlign
// units, travel in a 32-bit immediate.
inline constexpr std::uint64_t kMaxRegionMb = 262143;

// rdma_cm private data limits of the IB CM (RoCE uses the same): REQ 56 bytes, REP 196, REJ 148.
inline constexpr std::size_t kReqPrivateBytes = 56, kRepPrivateBytes = 196, kRejPrivateBytes = 148;

// Client -> server, in rdma_connect's private data.
struct ConnectRequest {
  std::uint32_t magic;
  std::uint16_t wire_version;
  std::uint16_t rdma_version;
  std::uint32_t worker_id;      // kNoWorker for anonymous clients
  std::uint32_t max_in_flight;  // the client's receive queue depth: replies it can take at once
  std::uint32_t flags;          // kHasToken: `nonce` is the client's authentication nonce
  std::uint8_t nonce[wire::kAuthNonceBytes];
};
static_assert(sizeof(ConnectRequest) <= kReqPrivateBytes);
inline constexpr std::uint32_t kHasToken = 1;

// Where the data path reads and writes. With authentication it is withheld from the accept data
// and sent only in the reply to a passed AUTH message, so an unauthenticated peer never learns a
// remote key.
struct Grant {
  std::uint64_t store_addr;  // the whole store region, REMOTE_READ
  std::uint64_t store_bytes;
  std::uint64_t clock_addr;  // the clock table, REMOTE_READ; 0 when the server has no workers
  std::uint64_t clock_bytes;
  std::uint64_t region_addr;  // this client's receive region, REMOTE_WRITE
  std::uint64_t region_bytes;
  std::uint32_t store_rkey;
  std::uint32_t clock_rkey;
  std::uint32_t region_rkey;
  std::uint32_t reserved;
};
static_assert(sizeof(Grant) == 64);

// Server -> client, in rdma_accept's private data: all a client needs to read and write.
struct AcceptInfo {
  std::uint32_t magic;
  std::uint16_t wire_version;
  std::uint16_t rdma_version;
  std::uint32_t server_id;
  std::uint32_t num_workers;
  std::uint8_t mode;   // ConsistencyMode
  std::uint8_t flags;  // kAuthRequired: `grant` is empty; send AUTH with the client's proof first
  std::uint8_t reserved[2];
  std::uint32_t staleness;
  std::uint32_t quorum;  // sync: K of N for the bound (0 = all live workers)
  std::uint32_t wait_timeout_ms;
  std::uint32_t credits;  // messages (SEND or WRITE_WITH_IMM) the client may have unanswered
  std::uint32_t control_bytes;
  std::uint32_t max_keys;     // the server's wire::Limits
  std::uint32_t incarnation;  // the engine's start in seconds (0 from builds before failover ran here)
  std::uint64_t max_payload_bytes;
  Grant grant;
  std::uint8_t nonce[wire::kAuthNonceBytes];  // with kAuthRequired: the server's nonce
  std::uint8_t proof[wire::kAuthProofBytes];  // and its proof of the token over both nonces
};
static_assert(sizeof(AcceptInfo) <= kRepPrivateBytes);
inline constexpr std::uint8_t kAuthRequired = 1;

// Server -> client, in rdma_reject's private data: why the connection was refused.
struct RejectInfo {
  std::uint32_t magic;
  std::uint16_t status;  // Errc
  std::uint16_t length;
  char text[132];
};
static_assert(sizeof(RejectInfo) <= kRejPrivateBytes);

// Requests whose answer is bulk (table_pull's rows, replica_pull's records, replica_index) travel
// like a push: written into the receive region, with room after their key table for the answer
// (at least sizeof(RowsTarget) bytes; for the first two, at least the rows asked for). The room
// starts with this: where in the client's own memory the server is to RDMA WRITE the answer,
// before its reply SEND. The server copies it out, reads the answer into the room (rows under
// their seqlocks), and WRITEs it from there, so the NIC never reads a row a push is changing.
struct RowsTarget {
  std::uint64_t addr;
  std::uint32_t rkey;
  std::uint32_t room;  // bytes the client left after the key table, this struct included
};
static_assert(sizeof(RowsTarget) == 16);

// Requests answered into the room they leave in the receive region (RowsTarget).
inline bool answered_into_room(wire::Op op) noexcept {
  return op == wire::Op::table_pull || op == wire::Op::replica_pull || op == wire::Op::replica_index ||
         op == wire::Op::replica_table_rows;
}
// ... with bytes whose size only the server knows (an index, a table page), not the keys' values:
// the room is half the region.
inline bool answered_with_bytes(wire::Op op) noexcept {
  return op == wire::Op::replica_index || op == wire::Op::replica_table_rows;
}
// Requests written into the receive region, not SENT: what carries values, what is answered
// into its room, and a replica_unrows' key table (ids, no values). Everything else is a control
// message.
inline bool written_into_region(wire::Op op) noexcept {
  return wire::op_carries_values(op) || answered_into_room(op) || op == wire::Op::replica_unrows;
}

// One per key in a LOOKUP reply, in request order. offset 0 means "no such key" (offset 0 of the
// region is the store header, never a slot).
struct LookupEntry {
  std::uint64_t offset;  // of the SlotHeader from the store region's base
  std::uint32_t length;  // floats
  std::uint32_t reserved;
};
static_assert(sizeof(LookupEntry) == 16);

// wr_id of work requests: [kind:8][chain length:24][index:32]. A chain's last work request is
// the only signaled one; its completion frees `chain length` send-queue entries at once.
enum class WrKind : std::uint8_t { recv = 1, inner, send_end, clock_end, round_end };
inline std::uint64_t make_wr_id(WrKind kind, std::uint32_t index, std::uint32_t chain = 0) {
  return (std::uint64_t{static_cast<std::uint8_t>(kind)} << 56) | (std::uint64_t{chain & 0xffffff} << 32) | index;
}
inline WrKind wr_kind(std::uint64_t wr_id) {
  return static_cast<WrKind>(wr_id >> 56);
}
inline std::uint32_t wr_chain(std::uint64_t wr_id) {
  return static_cast<std::uint32_t>(wr_id >> 32) & 0xffffff;
}
inline std::uint32_t wr_index(std::uint64_t wr_id) {
  return static_cast<std::uint32_t>(wr_id);
}

}  // namespace pskv::rdma

// Hot path of the RDMA client: building and posting work-request chains, and turning
// completions and replies into finished requests.
//
// Pull, and why a torn value is never returned. For each key the client posts, on one RC queue
// pair, READ #1 of [64-byte SlotHeader | values] scattered with two SGEs (the header into a
// small registered scratch area, the values straight into the caller's buffer), then READ #2 of
// the header's 8-byte seqlock word again. The server's writers make the word odd, change the
// values, and make it even again (Store::apply_slot). An RC responder executes READs in order,
// so READ #2 samples the word after READ #1 read everything; seq1 even and seq1 == seq2 means
// no writer was inside between the moment READ #1 read the header, which it reads first
// (Soft-RoCE copies in ascending order, as do NICs for one request in practice; the verbs
// spec leaves that order open), and the end of the values. Anything else is re-read, at
// once a few times, then with exponential backoff, and it fails with a timeout only if writers
// kept the key busy for a whole io_timeout.
//
// SSP, and the ordering pitfall. A pull at clock c may read once the bound (the slowest live
// worker's clock) is >= c - s. The client reads with whatever bound it already knows (clock
// replies, earlier reads of the server's clock table); if that is too old it reads the clock
// table with one RDMA READ, and if the bound still does not allow the read, it sends WAIT, which
// the server parks in its engine and answers when the bound moves. Clocks are never advanced
// with a remote FETCH_ADD: a worker's clock is a SEND on the same queue pair after that step's
// push WRITE_WITH_IMMs, and the server takes receive completions in queue-pair order and applies
// each push before it looks at the next message, so a clock can never become visible (in the
// table other clients READ) before the pushes of its step are in the store. An atomic would be
// executed by the NIC as soon as it arrived, possibly while the server CPU is still applying.
#include <arpa/inet.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "common/sync.h"
#include "layout/clock_table.h"
#include "store/store.h"
#include "transport/rdma/rdma_connection.h"

namespace pskv::rdma {

using transport::KeySlice;
using transport::Request;

namespace {

constexpr std::size_t kHeader = sizeof(wire::FrameHeader);
constexpr std::size_t kSlotHeader = sizeof(SlotHeader);
constexpr std::uint32_t kImmediateRetries = 8;
// One gather entry, one WRITE and one READ stay below the 32-bit SGE length and the port's
// largest message (2 GiB on most NICs, 8 MiB on Soft-RoCE).
constexpr std::size_t kMaxPiece = 1u << 30;
constexpr auto kFlushGrace = std::chrono::seconds(2);
constexpr int kTickMs = 500;

// The fields of a SlotHeader as they arrive in the scratch area (plain bytes, not atomics).
struct SlotImage {
  std::uint64_t seq;
  std::uint64_t key;
  std::uint32_t length;
};
static_assert(offsetof(SlotHeader, seq) == offsetof(SlotImage, seq) &&
              offsetof(SlotHeader, key) == offsetof(SlotImage, key) &&
              offsetof(SlotHeader, length) == offsetof(SlotImage, length));

// A request answered into its room: where the room starts in its message (after the key table).
std::uint64_t room_at(const Request& r) {
  return kHeader + r.keys.size() * sizeof(wire::KeyEntry);
}

// Pushes, as the pulls of this client wait behind them (program order).
bool is_push(wire::Op op) {
  return op == wire::Op::push || op == wire::Op::init;
}

}  // namespace

std::size_t RdmaConnection::clock_area() const noexcept {
  return align_up(server_.grant.clock_bytes, kCacheLine);
}

std::size_t RdmaConnection::bounce_base() const noexcept {
  return align_up(clock_area() + std::size_t{kMaxRoundKeys} * (kSlotHeader + sizeof(std::uint64_t)), kCacheLine);
}

std::size_t RdmaConnection::max_piece() const noexcept {
  return std::max<std::size_t>(4096, std::min<std::size_t>(kMaxPiece, max_message_) / kCacheLine * kCacheLine);
}

// READ #1 carries the header and as many values as one message holds; values beyond that take
// more READs in between; READ #2 re-reads the seqlock word last.
std::uint32_t RdmaConnection::reads_for(std::uint32_t length) const noexcept {
  const std::size_t bytes = std::size_t{length} * sizeof(float), first = max_piece() - kSlotHeader;
  return 2 + static_cast<std::uint32_t>(bytes > first ? (bytes - first + max_piece() - 1) / max_piece() : 0);
}

std::string RdmaConnection::key_text(const InFlight& op, std::uint32_t k) const {
  return "key " + std::to_string(op.request->keys[k].key);
}

// --- submission -------------------------------------------------------------------------------

void RdmaConnection::submit(Request& request) {
  const wire::Op op = request.op;
  const bool ours = op == wire::Op::init || op == wire::Op::push || op == wire::Op::pull || op == wire::Op::clock ||
                    op == wire::Op::barrier || op == wire::Op::stats || op == wire::Op::certificates ||
                    wire::op_is_table(op) || (wire::op_is_replication(op) && options_.worker_id == wire::kServerPeer);
  if (!ours) {
    request.completion->complete_part(
        Errc::unsupported,
        "op " + std::string(wire::op_name(static_cast<std::uint16_t>(op))) + " is not a client request on rdma://");
    return;
  }
  const std::uint32_t index = acquire_slot(&request);
  if (index == UINT32_MAX) {
    std::unique_lock lock(mu_);
    const Errc status = broken_status_;
    const std::string why = broken_why_;
    lock.unlock();
    request.completion->complete_part(status, why);
    return;
  }
  // The entry belongs to this thread until start(): registration and staging happen unlocked.
  Errc status = Errc::ok;
  std::string why;
  try {
    prepare(in_flight_[index]);
  } catch (const Error& e) {
    status = e.code();
    why = message_of(e);
  }
  {
    std::lock_guard lock(mu_);
    if (status != Errc::ok)
      finish(index, status, why);
    else
      start(index);
  }
  flush_deliveries();
}

std::uint32_t RdmaConnection::acquire_slot(Request* request) {
  std::unique_lock lock(mu_);
  slot_free_.wait(lock, [&] { return !free_.empty() || broken_; });
  if (broken_) return UINT32_MAX;
  const std::uint32_t i = free_.back();
  free_.pop_back();
  InFlight& s = in_flight_[i];
  s.request = request;
  s.id = next_generation_++ * options_.max_in_flight + i;
  s.phase = Phase::preparing;
  s.status = Errc::ok;
  s.why.clear();
  s.have_bound = s.snapshot = s.tried_clock_read = false;
  s.torn_rounds = 0;
  s.round_end = 0;
  s.round.clear();
  s.lookup.clear();
  s.started = Clock::now();
  return i;
}

void RdmaConnection::prepare(InFlight& s) {
  const Request& r = *s.request;
  const auto keys = r.keys;
  s.temporary.clear();
  s.lkeys.clear();
  s.gather.clear();
  s.wr_groups.clear();
  s.remote.assign(keys.size(), {});
  if (r.op == wire::Op::pull) {
    std::size_t bounce = 0;
    for (const KeySlice& k : keys) {
      const std::size_t bytes = std::size_t{k.length} * sizeof(float);
      if (reads_for(k.length) >= send_depth_ / 2)
        throw Error(Errc::capacity, key_text(s, static_cast<std::uint32_t>(&k - keys.data())) + " has " +
                                        std::to_string(bytes >> 20) + " MiB on " + endpoint_ +
                                        ", more than one pull's RDMA READs can carry: lower --chunk-floats");
      const std::uint32_t lkey = local_key(s, k.data, bytes);
      s.lkeys.push_back(lkey);
      if (lkey == 0) bounce += align_up(bytes, kCacheLine);
    }
    ensure_staging(s, std::max(kControlBytes, bounce_base() + std::min(bounce, kRoundBounce)));
    return;
  }
  if (!written_into_region(r.op)) {
    ensure_staging(s, kControlBytes);
    s.text_total = 0;
    const wire::FrameHeader h = wire::make_header(r.op, s.id, 0, 0, r.arg0, r.arg1);
    std::memcpy(s.staging.data(), &h, kHeader);
    s.message_bytes = kHeader;
    s.sent_op = r.op;
    return;
  }

  // [FrameHeader | KeyEntry x n | values] lands in the receive region; a request answered into
  // its room has, in place of values, room for the answer, beginning with where it is to go.
  const std::size_t n = keys.size();
  const bool rows_back = answered_into_room(r.op);
  // What travels after the key table: values, or nothing (an answer's room, a replica_unrows).
  const bool sends_values = !rows_back && wire::op_carries_values(r.op);
  std::uint64_t floats_bytes = 0;
  for (const KeySlice& k : keys) floats_bytes += std::uint64_t{k.length} * sizeof(float);
  const std::uint64_t payload = sends_values ? floats_bytes : 0;
  const std::uint64_t table = kHeader + n * sizeof(wire::KeyEntry);
  // An index's size is the server's to know: it gets half the region, and is refused past it.
  // RowsTarget::room is 32 bits: an index gets at most 1 GiB, and rows past 4 GiB are refused below.
  const std::uint64_t answer =
      answered_with_bytes(r.op) ? std::min<std::uint64_t>(server_.grant.region_bytes / 2, 1ull << 30) : floats_bytes;
  s.message_total = table + (rows_back ? std::max<std::uint64_t>(answer, sizeof(RowsTarget)) : payload);
  auto what = [&] {
    return "a " + std::string(wire::op_name(static_cast<std::uint16_t>(r.op))) + " of " + std::to_string(n) +
           " keys and " + std::to_string(floats_bytes >> 20) + " MiB";
  };
  const char* smaller = rows_back ? "pull fewer rows at a time" : "lower --chunk-floats";
  if (n > server_.max_keys)
    throw Error(Errc::capacity, what() + " exceeds the " + std::to_string(server_.max_keys) + "-key limit of " +
                                    endpoint_ + " (split the batch or raise --max-keys-per-request)");
  if (floats_bytes > server_.max_payload_bytes)
    throw Error(Errc::capacity,
                what() + " exceeds the request limit of " + endpoint_ + " (raise --max-request-mb or " + smaller + ")");
  if (rows_back && s.message_total - table > UINT32_MAX)
    throw Error(Errc::capacity, what() + " asks for more than 4 GiB of answer at once: " + smaller);
  if (align_up(s.message_total, kDescriptorAlign) > server_.grant.region_bytes)
    throw Error(Errc::capacity, what() + " does not fit the " + std::to_string(server_.grant.region_bytes >> 20) +
                                    " MiB receive region of " + endpoint_ + ": raise the server's --rdma-recv-mb or " +
                                    smaller);
  if (rows_back) {
    // The answer lands in a ring of ours that mirrors the receive region: a request's room there
    // is its own until its reply, so the mirror needs no allocator of its own.
    std::call_once(rows_ring_once_, [&] {
      rows_ring_ = RegisteredBuffer(verbs_->pd, server_.grant.region_bytes,
                                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, "table rows ring");
    });
  }
  // Registered slices are gathered in place (zero copy); small unannounced ones are copied next
  // to the descriptor. A push of very many registered slices would need more gather entries
  // than the send queue holds, so then everything is copied into staging. A request answered
  // into its room sends no values: its descriptor ends with the RowsTarget, which post_message()
  // fills in once it knows where in the ring the message goes.
  std::uint64_t copied = 0;
  if (sends_values) {
    const std::size_t max_entries = std::size_t{std::max(1u, send_depth_ / 4)} * max_sge_;
    std::size_t in_place = 0;
    for (const KeySlice& k : keys) in_place += cache_->find(k.data, std::size_t{k.length} * sizeof(float)) != 0;
    const bool copy_all = 1 + 2 * in_place > max_entries;
    for (const KeySlice& k : keys) {
      const std::size_t bytes = std::size_t{k.length} * sizeof(float);
      const std::uint32_t lkey = copy_all ? 0 : local_key(s, k.data, bytes);
      s.lkeys.push_back(lkey);
      if (lkey == 0) copied += bytes;
    }
  }
  const std::uint64_t descriptor = table + (rows_back ? sizeof(RowsTarget) : 0);
  ensure_staging(s, descriptor + copied);
  std::byte* staging = s.staging.data();
  wire::FrameHeader h = wire::make_header(r.op, s.id, static_cast<std::uint32_t>(n), payload, r.arg0, r.arg1);
  auto* entries = reinterpret_cast<wire::KeyEntry*>(staging + kHeader);
  for (std::size_t i = 0; i < n; ++i) entries[i] = {keys[i].key, keys[i].length, 0};
  if (options_.checksum) {
    h.flags |= wire::kChecksum;
    std::uint32_t crc = wire::crc32_update(0, entries, n * sizeof(wire::KeyEntry));
    if (sends_values)
      for (const KeySlice& k : keys) crc = wire::crc32_update(crc, k.data, std::size_t{k.length} * sizeof(float));
    h.checksum = crc;
  }
  std::memcpy(staging, &h, kHeader);

  const std::uint32_t staging_key = s.staging.mr.lkey();
  auto add = [&](const std::byte* p, std::uint64_t bytes, std::uint32_t lkey) {
    while (bytes > 0) {
      const std::uint64_t len = std::min<std::uint64_t>(bytes, max_piece());
      ibv_sge* last = s.gather.empty() ? nullptr : &s.gather.back();
      if (last && last->lkey == lkey && last->addr + last->length == reinterpret_cast<std::uint64_t>(p) &&
          last->length + len <= max_piece())
        last->length += static_cast<std::uint32_t>(len);
      else
        s.gather.push_back({reinterpret_cast<std::uint64_t>(p), static_cast<std::uint32_t>(len), lkey});
      p += len;
      bytes -= len;
    }
  };
  add(staging, descriptor, staging_key);
  std::byte* copy_at = staging + descriptor;
  for (std::size_t i = 0; i < s.lkeys.size(); ++i) {
    const std::size_t bytes = std::size_t{keys[i].length} * sizeof(float);
    if (s.lkeys[i] == 0) {
      std::memcpy(copy_at, keys[i].data, bytes);
      add(copy_at, bytes, staging_key);
      copy_at += bytes;
    } else {
      add(reinterpret_cast<const std::byte*>(keys[i].data), bytes, s.lkeys[i]);
    }
  }
  // Each WRITE takes up to max_sge entries and at most one message's worth of bytes.
  std::uint32_t count = 0;
  std::uint64_t bytes = 0;
  for (const ibv_sge& g : s.gather) {
    if (count == max_sge_ || (count > 0 && bytes + g.length > max_piece())) {
      s.wr_groups.push_back(count);
      count = 0;
      bytes = 0;
    }
    ++count;
    bytes += g.length;
  }
  s.wr_groups.push_back(count);
  if (s.wr_groups.size() > send_depth_ / 2)
    throw Error(Errc::capacity, what() + " needs " + std::to_string(s.wr_groups.size()) +
                                    " RDMA WRITEs, more than the send queue of " + endpoint_ +
                                    " holds (lower --chunk-floats or split the batch)");
  s.sent_op = r.op;
}

void RdmaConnection::start(std::uint32_t index) {
  InFlight& s = in_flight_[index];
  if (broken_) {
    finish(index, broken_status_, broken_why_);
    return;
  }
  const wire::Op op = s.request->op;
  if (op == wire::Op::pull) {
    s.after_push = pushes_started_;
    if (s.request->keys.empty())
      finish(index, Errc::ok, {});
    else
      continue_pull(index);
  } else {
    if (is_push(op)) ++pushes_started_;
    s.phase = Phase::send_queued;
    send_queue_.push_back(index);
  }
  pump();
}

// --- posting ----------------------------------------------------------------------------------

void RdmaConnection::pump() {
  // Popped before posting: a failed post breaks the connection, which empties the queues.
  while (!send_queue_.empty() && !broken_) {
    const std::uint32_t i = send_queue_.front();
    send_queue_.pop_front();
    if (!post_message(i)) {
      send_queue_.push_front(i);
      break;
    }
  }
  while (!read_queue_.empty() && !broken_) {
    const std::uint32_t i = read_queue_.front();
    read_queue_.pop_front();
    const bool posted = in_flight_[i].phase == Phase::clock_queued ? post_clock_read(i) : post_round(i);
    if (!posted) {
      read_queue_.push_front(i);
      break;
    }
  }
}

bool RdmaConnection::post_message(std::uint32_t index) {
  InFlight& s = in_flight_[index];
  if (credits_ == 0) return false;
  ibv_send_wr* bad = nullptr;
  std::uint32_t chain = 1;
  if (!written_into_region(s.sent_op)) {
    if (sq_free() < 1) return false;
    ibv_sge sge{reinterpret_cast<std::uint64_t>(s.staging.data()), s.message_bytes, s.staging.mr.lkey()};
    ibv_send_wr wr{};
    wr.wr_id = make_wr_id(WrKind::send_end, index, 1);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    if (const int rc = ibv_post_send(verbs_->qp, &wr, &bad); rc != 0) {
      fail_all(Errc::io, "posting a SEND to " + endpoint_ + " failed: " + errno_text(rc));
      return true;
    }
  } else {
    chain = static_cast<std::uint32_t>(s.wr_groups.size());
    if (sq_free() < chain) return false;
    // The ring: a message is contiguous, so one that would straddle the end starts over at 0.
    const std::uint64_t ring = server_.grant.region_bytes;
    const std::uint64_t need = align_up(s.message_total, kDescriptorAlign);
    std::uint64_t at = region_head_;
    if (at % ring + need > ring) at += ring - at % ring;
    if (at + need - region_tail_ > ring) return false;
    const std::uint64_t offset = at % ring;
    if (answered_into_room(s.sent_op)) {
      const std::uint64_t at = room_at(*s.request);
      const RowsTarget target{reinterpret_cast<std::uint64_t>(rows_ring_.data() + offset + at), rows_ring_.mr.rkey(),
                              static_cast<std::uint32_t>(s.message_total - at)};
      std::memcpy(s.staging.data() + at, &target, sizeof target);
    }
    wrs_.assign(chain, ibv_send_wr{});
    std::uint64_t remote = server_.grant.region_addr + offset;
    std::size_t g = 0;
    for (std::uint32_t w = 0; w < chain; ++w) {
      ibv_send_wr& wr = wrs_[w];
      wr.wr_id = make_wr_id(WrKind::inner, index);
      wr.sg_list = &s.gather[g];
      wr.num_sge = static_cast<int>(s.wr_groups[w]);
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.wr.rdma.remote_addr = remote;
      wr.wr.rdma.rkey = server_.grant.region_rkey;
      for (std::uint32_t e = 0; e < s.wr_groups[w]; ++e) remote += s.gather[g++].length;
      wr.next = w + 1 < chain ? &wrs_[w + 1] : nullptr;
    }
    ibv_send_wr& last = wrs_.back();
    last.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    last.imm_data = htonl(static_cast<std::uint32_t>(offset / kDescriptorAlign));
    last.send_flags = IBV_SEND_SIGNALED;
    last.wr_id = make_wr_id(WrKind::send_end, index, chain);
    if (const int rc = ibv_post_send(verbs_->qp, wrs_.data(), &bad); rc != 0) {
      fail_all(Errc::io, "posting RDMA WRITEs to " + endpoint_ + " failed: " + errno_text(rc));
      return true;
    }
    region_head_ = at + need;
    s.region_end = at + need;
    s.region_offset = offset;
  }
  --credits_;
  sq_used_ += chain;
  ++s.chains;
  s.awaiting_reply = true;
  s.phase = Phase::sent;
  last_progress_ = Clock::now();
  return true;
}

bool RdmaConnection::post_clock_read(std::uint32_t index) {
  InFlight& s = in_flight_[index];
  if (sq_free() < 1) return false;
  ibv_sge sge{reinterpret_cast<std::uint64_t>(s.staging.data()), static_cast<std::uint32_t>(server_.grant.clock_bytes),
              s.staging.mr.lkey()};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = make_wr_id(WrKind::clock_end, index, 1);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_READ;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = server_.grant.clock_addr;
  wr.wr.rdma.rkey = server_.grant.clock_rkey;
  if (const int rc = ibv_post_send(verbs_->qp, &wr, &bad); rc != 0) {
    fail_all(Errc::io, "posting an RDMA READ to " + endpoint_ + " failed: " + errno_text(rc));
    return true;
  }
  sq_used_ += 1;
  ++s.chains;
  s.phase = Phase::clock_read;
  last_progress_ = Clock::now();
  return true;
}

void RdmaConnection::next_round(InFlight& s) {
  const auto keys = s.request->keys;
  s.round.clear();
  std::size_t bounced = 0;
  std::uint32_t wrs = 1, k = s.round_end;
  while (k < keys.size() && s.round.size() < kMaxRoundKeys) {
    const std::uint32_t reads = reads_for(keys[k].length);
    if (!s.round.empty() && wrs + reads > send_depth_ / 2) break;
    wrs += reads;
    if (s.lkeys[k] == 0) {
      const std::size_t bytes = align_up(std::size_t{keys[k].length} * sizeof(float), kCacheLine);
      if (!s.round.empty() && bounced + bytes > kRoundBounce) break;
      bounced += bytes;
    }
    s.round.push_back(k++);
  }
  s.round_end = k;
  assign_bounce(s);
}

void RdmaConnection::assign_bounce(InFlight& s) {
  s.bounce_at.clear();
  std::uint32_t at = 0;
  for (std::uint32_t k : s.round) {
    s.bounce_at.push_back(at);
    if (s.lkeys[k] == 0)
      at += static_cast<std::uint32_t>(align_up(std::size_t{s.request->keys[k].length} * sizeof(float), kCacheLine));
  }
}

bool RdmaConnection::post_round(std::uint32_t index) {
  InFlight& s = in_flight_[index];
  const auto keys = s.request->keys;
  std::uint32_t chain = s.snapshot ? 1 : 0;
  for (std::uint32_t k : s.round) chain += reads_for(keys[k].length);
  if (sq_free() < chain) return false;
  std::byte* staging = s.staging.data();
  const std::uint32_t skey = s.staging.mr.lkey();
  const std::size_t headers = clock_area(), seqs = headers + kMaxRoundKeys * kSlotHeader;
  wrs_.assign(chain, ibv_send_wr{});
  sges_.assign(chain + s.round.size(), ibv_sge{});
  std::uint32_t w = 0, g = 0;
  auto read = [&](std::uint64_t remote, std::uint32_t rkey, std::uint32_t num_sge) {
    ibv_send_wr& wr = wrs_[w];
    wr.wr_id = make_wr_id(WrKind::inner, index);
    wr.sg_list = &sges_[g - num_sge];
    wr.num_sge = static_cast<int>(num_sge);
    wr.opcode = IBV_WR_RDMA_READ;
    wr.wr.rdma.remote_addr = remote;
    wr.wr.rdma.rkey = rkey;
    wr.next = w + 1 < chain ? &wrs_[w + 1] : nullptr;
    ++w;
  };
  if (s.snapshot) {
    sges_[g++] = {reinterpret_cast<std::uint64_t>(staging), static_cast<std::uint32_t>(server_.grant.clock_bytes),
                  skey};
    read(server_.grant.clock_addr, server_.grant.clock_rkey, 1);
  }
  for (std::size_t j = 0; j < s.round.size(); ++j) {
    const std::uint32_t k = s.round[j];
    const std::uint64_t remote = server_.grant.store_addr + s.remote[k].offset;
    const std::size_t bytes = std::size_t{keys[k].length} * sizeof(float);
    auto* dest =
        s.lkeys[k] != 0 ? reinterpret_cast<std::byte*>(keys[k].data) : staging + bounce_base() + s.bounce_at[j];
    const std::uint32_t dkey = s.lkeys[k] != 0 ? s.lkeys[k] : skey;
    std::size_t done = std::min(bytes, max_piece() - kSlotHeader);
    sges_[g++] = {reinterpret_cast<std::uint64_t>(staging + headers + j * kSlotHeader), kSlotHeader, skey};
    sges_[g++] = {reinterpret_cast<std::uint64_t>(dest), static_cast<std::uint32_t>(done), dkey};
    read(remote, server_.grant.store_rkey, 2);
    while (done < bytes) {
      const std::size_t len = std::min(bytes - done, max_piece());
      sges_[g++] = {reinterpret_cast<std::uint64_t>(dest + done), static_cast<std::uint32_t>(len), dkey};
      read(remote + kSlotHeader + done, server_.grant.store_rkey, 1);
      done += len;
    }
    sges_[g++] = {reinterpret_cast<std::uint64_t>(staging + seqs + j * sizeof(std::uint64_t)), sizeof(std::uint64_t),
                  skey};
    read(remote, server_.grant.store_rkey, 1);
  }
  ibv_send_wr& last = wrs_[chain - 1];
  last.send_flags = IBV_SEND_SIGNALED;
  last.wr_id = make_wr_id(WrKind::round_end, index, chain);
  ibv_send_wr* bad = nullptr;
  if (const int rc = ibv_post_send(verbs_->qp, wrs_.data(), &bad); rc != 0) {
    fail_all(Errc::io, "posting RDMA READs to " + endpoint_ + " failed: " + errno_text(rc));
    return true;
  }
  sq_used_ += chain;
  ++s.chains;
  s.phase = Phase::reading;
  last_progress_ = Clock::now();
  return true;
}

void RdmaConnection::post_recv(std::uint32_t buffer) {
  ibv_sge sge{reinterpret_cast<std::uint64_t>(recv_.data() + std::size_t{buffer} * kControlBytes),
              static_cast<std::uint32_t>(kControlBytes), recv_.mr.lkey()};
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = make_wr_id(WrKind::recv, buffer);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  if (const int rc = ibv_post_recv(verbs_->qp, &wr, &bad); rc != 0)
    fail_all(Errc::io, "re-posting a receive buffer for " + endpoint_ + " failed: " + errno_text(rc));
}

// --- the pull state machine --------------------------------------------------------------------

bool RdmaConnection::bound_needed(const InFlight& s, std::uint64_t* need) const {
  const std::uint64_t clock = s.request->arg0;
  if (!bounded_ || options_.worker_id == kNoWorker || clock <= staleness_) return false;
  *need = clock - staleness_;
  return true;
}

void RdmaConnection::continue_pull(std::uint32_t index) {
  InFlight& s = in_flight_[index];
  // Program order: a pull sees this client's own earlier pushes, so it waits behind them.
  if (pushes_done_ < s.after_push) {
    s.phase = Phase::own_pushes;
    own_push_waiters_.push_back(index);
    return;
  }
  const auto keys = s.request->keys;
  s.lookup.clear();
  for (std::uint32_t k = 0; k < keys.size(); ++k) {
    if (s.remote[k].offset != 0) continue;
    if (auto it = slot_cache_.find(keys[k].key); it != slot_cache_.end())
      s.remote[k] = it->second;
    else if (s.lookup.size() < kLookupBatch)
      s.lookup.push_back(k);
  }
  if (!s.lookup.empty()) {
    const auto m = static_cast<std::uint32_t>(s.lookup.size());
    const wire::FrameHeader h = wire::make_header(wire::Op::lookup, s.id, m, 0);
    std::memcpy(s.staging.data(), &h, kHeader);
    auto* entries = reinterpret_cast<wire::KeyEntry*>(s.staging.data() + kHeader);
    for (std::uint32_t j = 0; j < m; ++j) entries[j] = {keys[s.lookup[j]].key, keys[s.lookup[j]].length, 0};
    s.message_bytes = static_cast<std::uint32_t>(kHeader + m * sizeof(wire::KeyEntry));
    s.sent_op = wire::Op::lookup;
    s.phase = Phase::send_queued;
    send_queue_.push_back(index);
    return;
  }
  for (std::uint32_t k = 0; k < keys.size(); ++k)
    if (s.remote[k].length != keys[k].length) {
      finish(index, Errc::length_mismatch,
             key_text(s, k) + " has " + std::to_string(s.remote[k].length) + " floats, the request says " +
                 std::to_string(keys[k].length));
      return;
    }
  std::uint64_t need = 0;
  if (bound_needed(s, &need) && known_bound_ < need && !(s.have_bound && s.bound >= need)) {
    if (server_.grant.clock_addr != 0 && !s.tried_clock_read) {
      s.tried_clock_read = true;
      s.phase = Phase::clock_queued;
      read_queue_.push_back(index);
      return;
    }
    const wire::FrameHeader h = wire::make_header(wire::Op::wait, s.id, 0, 0, s.request->arg0);
    std::memcpy(s.staging.data(), &h, kHeader);
    s.message_bytes = kHeader;
    s.sent_op = wire::Op::wait;
    s.phase = Phase::send_queued;
    send_queue_.push_back(index);
    return;
  }
  begin_reads(index);
}

void RdmaConnection::begin_reads(std::uint32_t index) {
  InFlight& s = in_flight_[index];
  // With a clock table, the first round also reads it (before the values), so the bound the
  // pull reports for staleness statistics is the one in force when it read.
  s.snapshot = server_.grant.clock_addr != 0 && options_.worker_id != kNoWorker && !s.have_bound;
  s.round_end = 0;
  next_round(s);
  s.phase = Phase::read_queued;
  read_queue_.push_back(index);
}

void RdmaConnection::on_clock_read(std::uint32_t index) {
  InFlight& s = in_flight_[index];
  try {
    // A READ of the table is not one atomic snapshot, but every clock only grows and evictions
    // only lift the bound, so the bound computed from it is one that held by the READ's end.
    const ClockTable table(s.staging.data(), server_.num_workers, false);
    s.bound = table.bound(server_.quorum);
  } catch (const Error& e) {
    finish(index, Errc::protocol, endpoint_ + "'s clock table: " + message_of(e));
    return;
  }
  s.have_bound = true;
  known_bound_ = std::max(known_bound_, s.bound);
}

void RdmaConnection::round_done(std::uint32_t index) {
  InFlight& s = in_flight_[index];
  const auto keys = s.request->keys;
  if (s.snapshot) {
    s.snapshot = false;
    on_clock_read(index);
    if (s.phase == Phase::done) return;
  }
  const std::byte* staging = s.staging.data();
  const std::size_t headers = clock_area(), seqs = headers + kMaxRoundKeys * kSlotHeader;
  std::vector<std::uint32_t> torn;
  for (std::size_t j = 0; j < s.round.size(); ++j) {
    const std::uint32_t k = s.round[j];
    SlotImage image;
    std::uint64_t seq2;
    std::memcpy(&image, staging + headers + j * kSlotHeader, sizeof image);
    std::memcpy(&seq2, staging + seqs + j * sizeof seq2, sizeof seq2);
    if (image.key != keys[k].key || image.length != keys[k].length) {
      finish(index, Errc::protocol,
             "the slot " + endpoint_ + " named for " + key_text(s, k) + " holds key " + std::to_string(image.key) +
                 " with " + std::to_string(image.length) + " floats: the server's store is not what it advertised");
      return;
    }
    if ((image.seq & 1) != 0 || image.seq != seq2) {
      torn.push_back(k);
    } else if (s.lkeys[k] == 0) {
      std::memcpy(keys[k].data, staging + bounce_base() + s.bounce_at[j], std::size_t{keys[k].length} * sizeof(float));
    }
  }
  if (torn.empty()) {
    s.torn_rounds = 0;
    if (s.round_end == keys.size()) {
      finish(index, Errc::ok, {});
      return;
    }
    next_round(s);
    s.phase = Phase::read_queued;
    read_queue_.push_back(index);
    return;
  }
  s.round.swap(torn);
  assign_bounce(s);
  ++s.torn_rounds;
  const auto now = Clock::now();
  if (s.torn_rounds <= kImmediateRetries) {
    s.phase = Phase::read_queued;
    read_queue_.push_back(index);
  } else if (now - s.started > options_.io_timeout) {
    finish(index, Errc::timeout,
           key_text(s, s.round[0]) + " on " + endpoint_ + " was being rewritten during each of " +
               std::to_string(s.torn_rounds) + " reads for " + std::to_string(options_.io_timeout.count()) +
               " ms; writers never left it alone long enough (push less often or split the key)");
  } else {
    const auto shift = std::min<std::uint32_t>(s.torn_rounds - kImmediateRetries, 8);
    s.retry_at = now + std::min<std::chrono::microseconds>(std::chrono::microseconds(50L << shift),
                                                           std::chrono::milliseconds(10));
    s.phase = Phase::backoff;
    backoff_.push_back(index);
  }
}

// --- completions and replies -----------------------------------------------------------------

void RdmaConnection::on_completion(const ibv_wc& wc) {
  last_progress_ = Clock::now();
  const WrKind kind = wr_kind(wc.wr_id);
  const std::uint32_t index = wr_index(wc.wr_id);
  if (kind == WrKind::recv) {
    if (broken_) return;
    if (wc.status != IBV_WC_SUCCESS) {
      fail_all(Errc::peer_failure,
               "the connection to " + endpoint_ + " failed: " + wc_text(wc) + "; did the server die?");
      return;
    }
    if (wc.opcode != IBV_WC_RECV || index >= recv_depth_) {
      fail_all(Errc::protocol,
               endpoint_ + " sent something other than a reply (opcode " + std::to_string(wc.opcode) + ")");
      return;
    }
    on_reply(index, wc.byte_len);
    if (!broken_) post_recv(index);
    return;
  }
  if (wc.status != IBV_WC_SUCCESS && !broken_) {
    const bool timed_out = wc.status == IBV_WC_RETRY_EXC_ERR;
    fail_all(timed_out ? Errc::timeout : Errc::peer_failure,
             "the connection to " + endpoint_ + " failed: " + wc_text(wc) +
                 (timed_out ? "; the server stopped acknowledging (did it die, or is the network down?)" : ""));
  }
  if (kind == WrKind::inner || index >= in_flight_.size()) return;
  InFlight& s = in_flight_[index];
  sq_used_ -= std::min(sq_used_, wr_chain(wc.wr_id));
  if (s.chains > 0) --s.chains;
  if (broken_ || wc.status != IBV_WC_SUCCESS) {
    maybe_release(index);
    return;
  }
  switch (kind) {
    case WrKind::clock_end:
      on_clock_read(index);
      if (s.phase != Phase::done) continue_pull(index);
      break;
    case WrKind::round_end:
      round_done(index);
      break;
    default:
      maybe_release(index);
      break;
  }
}

void RdmaConnection::on_reply(std::uint32_t buffer, std::uint32_t bytes) {
  const std::byte* p = recv_.data() + std::size_t{buffer} * kControlBytes;
  wire::FrameHeader h;
  std::string why;
  if (bytes < kHeader) {
    fail_all(Errc::protocol,
             endpoint_ + " sent a " + std::to_string(bytes) + "-byte reply, shorter than a frame header");
    return;
  }
  std::memcpy(&h, p, kHeader);
  if (Errc e = wire::validate_header(h, options_.limits, true, &why); e != Errc::ok) {
    fail_all(Errc::protocol, "bad reply from " + endpoint_ + ": " + why);
    return;
  }
  if (h.num_keys != 0 || kHeader + h.payload_bytes != bytes) {
    fail_all(Errc::protocol, "bad reply from " + endpoint_ + ": it declares " + std::to_string(h.payload_bytes) +
                                 " payload bytes in a " + std::to_string(bytes) + "-byte message");
    return;
  }
  const auto index = static_cast<std::uint32_t>(h.request_id % options_.max_in_flight);
  InFlight& s = in_flight_[index];
  if (!s.request || s.id != h.request_id || !s.awaiting_reply || h.op != static_cast<std::uint16_t>(s.sent_op)) {
    fail_all(Errc::protocol, endpoint_ + " answered request " + std::to_string(h.request_id) + " (" +
                                 std::string(wire::op_name(h.op)) + ") that is not outstanding");
    return;
  }
  s.awaiting_reply = false;
  ++credits_;
  auto status = static_cast<Errc>(h.status);
  std::string text;
  if (h.flags & wire::kText) text.assign(reinterpret_cast<const char*>(p + kHeader), h.payload_bytes);
  if (status != Errc::ok && text.empty()) text = std::string(errc_name(status));
  const wire::Op op = s.request->op;
  if (written_into_region(op)) {
    // Replies may come out of order (a push parked for its replicas, a later request refused at
    // once), but the server consumed every message before the one it answers, so the tail only
    // moves forward.
    region_tail_ = std::max(region_tail_, s.region_end);
    // RC order: the rows this reply follows were WRITTEN into the ring before it arrived. They
    // are taken now, before the next request may be given this room.
    if (answered_into_room(op) && status == Errc::ok) {
      const std::uint64_t at = room_at(*s.request);
      const std::byte* room = rows_ring_.data() + s.region_offset + at;
      if (!answered_with_bytes(op)) {
        for (const KeySlice& k : s.request->keys) {
          std::memcpy(k.data, room, std::size_t{k.length} * sizeof(float));
          room += std::size_t{k.length} * sizeof(float);
        }
      } else if (h.arg1 <= s.message_total - at && s.request->text_out) {
        s.request->text_out->assign(reinterpret_cast<const char*>(room), h.arg1);
      } else {
        fail_all(Errc::protocol, endpoint_ + " answered a " + std::string(wire::op_name(h.op)) + " with " +
                                     std::to_string(h.arg1) + " bytes, more than the room it was given");
        return;
      }
    }
    finish(index, status, text);
    if (is_push(op)) {
      ++pushes_done_;
      wake_own_push_waiters();
    }
    return;
  }
  if (op != wire::Op::pull) {
    if (status == Errc::ok && op == wire::Op::clock) {
      known_bound_ = std::max(known_bound_, h.arg0);
      s.bound = h.arg0;
      s.have_bound = true;
    }
    if (status == Errc::ok && op == wire::Op::stats && s.request->text_out &&
        (s.text_total != 0 || h.arg0 > text.size())) {
      // A text longer than one reply comes in pages (rdma_server_io.cc): ask for the next one.
      // Every page but the last is full, so a server cannot drag this out a byte at a time.
      std::string& whole = *s.request->text_out;
      if (s.text_total == 0) whole.clear();
      const std::uint64_t limit = options_.limits.max_payload_bytes;
      const std::uint64_t after = whole.size() + text.size();
      if (text.empty() || h.arg0 > limit || (s.text_total != 0 && h.arg0 != s.text_total) || after > h.arg0 ||
          (after < h.arg0 && text.size() != kControlBytes - kHeader)) {
        fail_all(Errc::protocol, endpoint_ + " sent a page of " + std::to_string(text.size()) + " bytes of a " +
                                     std::to_string(h.arg0) + "-byte stats text, which does not follow the " +
                                     std::to_string(whole.size()) + " bytes it sent before (of " +
                                     std::to_string(s.text_total) + ")");
        return;
      }
      s.text_total = h.arg0;
      whole += text;
      text.clear();
      if (whole.size() < s.text_total) {
        wire::FrameHeader next;
        std::memcpy(&next, s.staging.data(), kHeader);
        next.arg0 = whole.size();
        std::memcpy(s.staging.data(), &next, kHeader);
        s.phase = Phase::send_queued;
        send_queue_.push_back(index);
        pump();
        return;
      }
    } else if (status == Errc::ok && (op == wire::Op::stats || op == wire::Op::certificates)) {
      if (s.request->text_out)
        s.request->text_out->swap(text);
      else
        status = Errc::protocol;
    }
    finish(index, status, text);
    return;
  }
  if (status != Errc::ok) {
    finish(index, status, text);
    return;
  }
  if (s.sent_op == wire::Op::wait) {
    known_bound_ = std::max(known_bound_, h.arg0);
    s.bound = h.arg0;
    s.have_bound = true;
    begin_reads(index);
    return;
  }
  // LOOKUP: one entry per key asked, each checked against the region it claims to be in.
  if (h.flags & wire::kText || h.payload_bytes != s.lookup.size() * sizeof(LookupEntry)) {
    fail_all(Errc::protocol, endpoint_ + " answered a lookup of " + std::to_string(s.lookup.size()) + " keys with " +
                                 std::to_string(h.payload_bytes) + " bytes");
    return;
  }
  const auto keys = s.request->keys;
  for (std::size_t j = 0; j < s.lookup.size(); ++j) {
    LookupEntry e;
    std::memcpy(&e, p + kHeader + j * sizeof e, sizeof e);
    const std::uint32_t k = s.lookup[j];
    if (e.offset == 0) {
      finish(index, Errc::not_found,
             key_text(s, k) + " does not exist on " + endpoint_ + ": init it before pushing or pulling");
      return;
    }
    if (e.offset % kCacheLine != 0 || e.length == 0 || e.offset + slot_bytes(e.length) > server_.grant.store_bytes) {
      fail_all(Errc::protocol, endpoint_ + " placed " + key_text(s, k) + " outside its store region");
      return;
    }
    const RemoteSlot remote{e.offset, e.length};
    slot_cache_[keys[k].key] = remote;
    s.remote[k] = remote;
  }
  continue_pull(index);
}

void RdmaConnection::wake_own_push_waiters() {
  for (std::size_t i = 0; i < own_push_waiters_.size();) {
    const std::uint32_t index = own_push_waiters_[i];
    if (in_flight_[index].after_push <= pushes_done_) {
      own_push_waiters_[i] = own_push_waiters_.back();
      own_push_waiters_.pop_back();
      continue_pull(index);
    } else {
      ++i;
    }
  }
}

void RdmaConnection::finish(std::uint32_t index, Errc status, std::string why) {
  InFlight& s = in_flight_[index];
  if (s.phase == Phase::done) return;
  s.status = status;
  s.why = std::move(why);
  s.phase = Phase::done;
  maybe_release(index);
}

void RdmaConnection::maybe_release(std::uint32_t index) {
  InFlight& s = in_flight_[index];
  if (s.phase != Phase::done || s.chains > 0 || s.awaiting_reply || !s.request) return;
  const wire::Op op = s.request->op;
  const bool note = s.status == Errc::ok && (op == wire::Op::pull || op == wire::Op::clock);
  // Without a clock table there is no bound; the other backends report "done" then too.
  const std::uint64_t bound = s.have_bound ? s.bound : server_.num_workers ? known_bound_ : kClockDone;
  deliveries_.push_back({s.request, s.status, std::move(s.why), bound, note, std::move(s.temporary)});
  s.temporary.clear();
  s.request = nullptr;
  s.phase = Phase::idle;
  free_.push_back(index);
  slot_free_.notify_one();
}

void RdmaConnection::fail_all(Errc status, const std::string& why) {
  if (broken_) return;
  broken_ = true;
  broken_status_ = status;
  broken_why_ = why;
  broken_at_ = Clock::now();
  // The error state stops the NIC and flushes every posted work request; an entry whose buffers
  // the NIC might still touch is released only when its flush completion arrives.
  // Should even that fail, the flush grace in on_tick still bounds the wait.
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  if (ibv_modify_qp(verbs_->qp, &attr, IBV_QP_STATE) != 0) broken_why_ += " (and the queue pair could not be stopped)";
  for (std::uint32_t i = 0; i < in_flight_.size(); ++i) {
    // An entry still being prepared is its submitter's: start() sees broken_ and finishes it.
    if (!in_flight_[i].request || in_flight_[i].phase == Phase::preparing) continue;
    in_flight_[i].awaiting_reply = false;
    finish(i, status, why);
  }
  send_queue_.clear();
  read_queue_.clear();
  own_push_waiters_.clear();
  backoff_.clear();
  slot_free_.notify_all();
}

void RdmaConnection::flush_deliveries() {
  thread_local std::vector<Delivery> out;
  {
    std::lock_guard lock(mu_);
    if (deliveries_.empty()) return;
    out.swap(deliveries_);
  }
  for (Delivery& d : out) {
    d.temporary.clear();
    if (d.note_bound) d.request->completion->note_bound(d.bound);
    d.request->completion->complete_part(d.status, d.status == Errc::ok ? std::string_view{} : std::string_view(d.why));
  }
  out.clear();
}

// --- the completion thread ----------------------------------------------------------------------

int RdmaConnection::drain_cq() {
  ibv_wc wc[32];
  int total = 0;
  for (;;) {
    const int n = ibv_poll_cq(verbs_->cq, 32, wc);
    if (n < 0) {
      std::lock_guard lock(mu_);
      fail_all(Errc::io, "polling the completion queue of " + endpoint_ + " failed");
      return total;
    }
    if (n == 0) break;
    {
      std::lock_guard lock(mu_);
      for (int j = 0; j < n; ++j) on_completion(wc[j]);
      pump();
    }
    flush_deliveries();
    total += n;
    if (n < 32) break;
  }
  return total;
}

void RdmaConnection::handle_cm_events() {
  rdma_cm_event* ev = nullptr;
  while (rdma_get_cm_event(verbs_->events, &ev) == 0) {
    const rdma_cm_event_type type = ev->event;
    rdma_ack_cm_event(ev);
    if (type == RDMA_CM_EVENT_DISCONNECTED || type == RDMA_CM_EVENT_DEVICE_REMOVAL) {
      std::lock_guard lock(mu_);
      fail_all(Errc::peer_failure, "lost the connection to " + endpoint_ + " (" +
                                       (type == RDMA_CM_EVENT_DISCONNECTED ? "the server disconnected; did it die?"
                                                                           : "the RDMA device was removed") +
                                       ")");
    }
  }
}

void RdmaConnection::on_tick(Clock::time_point now) {
  for (std::size_t i = 0; i < backoff_.size();) {
    const std::uint32_t index = backoff_[i];
    if (in_flight_[index].retry_at <= now) {
      backoff_[i] = backoff_.back();
      backoff_.pop_back();
      in_flight_[index].phase = Phase::read_queued;
      read_queue_.push_back(index);
    } else {
      ++i;
    }
  }
  if (broken_ && now - broken_at_ > kFlushGrace) {
    // Flushes that never came: the queue pair is in the error state, release what waits.
    for (std::uint32_t i = 0; i < in_flight_.size(); ++i)
      if (in_flight_[i].chains > 0) {
        in_flight_[i].chains = 0;
        maybe_release(i);
      }
  }
  if (!broken_ && now - last_progress_ > options_.io_timeout) {
    const bool outstanding = std::any_of(in_flight_.begin(), in_flight_.end(), [](const InFlight& s) {
      return s.request && (s.chains > 0 || s.awaiting_reply);
    });
    if (outstanding)
      fail_all(Errc::timeout, endpoint_ + " answered nothing for " + std::to_string(options_.io_timeout.count()) +
                                  " ms with requests outstanding; the server is hung or unreachable");
    else
      last_progress_ = now;
  }
  pump();
}

int RdmaConnection::tick_ms(Clock::time_point now) {
  auto next = now + std::chrono::milliseconds(kTickMs);
  for (std::uint32_t index : backoff_) next = std::min(next, in_flight_[index].retry_at);
  return static_cast<int>(std::max<long long>(
      0, std::chrono::duration_cast<std::chrono::milliseconds>(next - now + std::chrono::microseconds(999)).count()));
}

void RdmaConnection::completion_loop() {
  ibv_comp_channel* channel = verbs_->channel;
  const int events_fd = verbs_->events->fd;
  unsigned spins = 0;
  while (!stopping_.load(std::memory_order_relaxed)) {
    if (params_.busy_poll) {
      // Spin on the CQ; look at rdma_cm events, the wake-up fd and timers now and then.
      if (drain_cq() > 0) {
        spins = 0;
        continue;
      }
      if (++spins % 4096 != 0) {
        cpu_relax();
        continue;
      }
    } else {
      // The notify/poll/re-poll dance: a completion that lands between the last empty poll and
      // the re-arm would raise no event, so poll once more after arming before sleeping.
      if (drain_cq() > 0) continue;
      if (ibv_req_notify_cq(verbs_->cq, 0) != 0) {
        std::lock_guard lock(mu_);
        fail_all(Errc::io, "ibv_req_notify_cq failed for " + endpoint_);
      }
      if (drain_cq() > 0) continue;
    }
    int timeout;
    {
      std::lock_guard lock(mu_);
      timeout = params_.busy_poll ? 0 : tick_ms(Clock::now());
    }
    pollfd fds[3] = {{channel->fd, POLLIN, 0}, {events_fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    ::poll(fds, 3, timeout);
    if (fds[0].revents & POLLIN) {
      ibv_cq* cq = nullptr;
      void* context = nullptr;
      while (ibv_get_cq_event(channel, &cq, &context) == 0)
        if (++verbs_->unacked_events >= 64) {
          ibv_ack_cq_events(verbs_->cq, verbs_->unacked_events);
          verbs_->unacked_events = 0;
        }
    }
    if (fds[1].revents & POLLIN) handle_cm_events();
    if (fds[2].revents & POLLIN) {
      std::uint64_t value;
      [[maybe_unused]] auto n = ::read(wake_fd_, &value, sizeof value);
    }
    {
      std::lock_guard lock(mu_);
      on_tick(Clock::now());
    }
    flush_deliveries();
  }
}

}  // namespace pskv::rdma

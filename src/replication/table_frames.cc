#include "replication/table_frames.h"

#include <cstring>
#include <vector>

namespace pskv::replication {

namespace {

std::uint32_t origin_of(const wire::FrameHeader& h) noexcept {
  return static_cast<std::uint32_t>(h.arg0);
}
std::uint32_t position_of(const wire::FrameHeader& h) noexcept {
  return static_cast<std::uint32_t>(h.arg0 >> 32);
}

Errc apply_replica_table(ShardEngine& engine, const wire::FrameHeader& h, std::span<const KeyEntry> keys,
                         const float* payload, std::uint64_t connection, std::string* why) {
  constexpr std::uint32_t kFixed = wire::kTableSpecFloats + 2;  // the spec and the cap (u64)
  if (keys.size() != 1 || keys[0].length < kFixed || (keys[0].length - kFixed) % 2 != 0 || keys[0].key != h.arg1) {
    *why = "replica_table carries one key, the table id, with its spec, cap and push marks";
    return Errc::protocol;
  }
  TableSpec spec;
  if (Errc e = wire::decode_table_spec(payload, &spec, why); e != Errc::ok) return e;
  std::uint64_t cap = 0;
  std::memcpy(&cap, payload + wire::kTableSpecFloats, sizeof cap);
  const std::uint64_t count = (keys[0].length - kFixed) / 2;
  if (Errc e = engine.check_table_marks(origin_of(h), h.arg1, count, why); e != Errc::ok) return e;
  std::vector<std::uint64_t> marks(count);  // sized once the count is checked
  if (!marks.empty()) std::memcpy(marks.data(), payload + kFixed, marks.size() * sizeof(std::uint64_t));
  return engine.apply_replica_table(origin_of(h), connection, position_of(h), h.arg1, spec, cap, marks, why);
}

}  // namespace

Errc create_table(ShardEngine& engine, std::span<const KeyEntry> keys, const float* payload, const Park& park,
                  std::string* why, bool* parked) {
  *parked = false;
  TableSpec spec;
  std::uint32_t table = 0;
  if (Errc e = wire::decode_table_create(keys, payload, &table, &spec, why); e != Errc::ok) return e;
  Replicator* replicator = engine.replicator();
  if (!replicator) return engine.create_table(table, spec, why);
  return replicator->create_table(table, spec, why, park, parked);
}

Errc push_table(ShardEngine& engine, const wire::FrameHeader& h, std::span<const KeyEntry> keys, const float* grads,
                std::uint32_t worker, const Park& park, std::string* why, bool* parked) {
  *parked = false;
  std::span<const KeyEntry> rows = keys;
  const std::uint64_t identity = wire::take_table_push_identity(&rows);
  const PushId push{.worker = worker,
                    .session = static_cast<std::uint32_t>(identity >> 32),
                    .seq = static_cast<std::uint32_t>(identity)};
  const auto apply = [&] { return engine.table_push(h.arg1, h.arg0, rows, grads, why, push); };
  Replicator* replicator = engine.replicator();
  if (!replicator) return apply();
  // The rows' records (and a mark's two floats), reserved before anything is applied.
  const std::uint64_t reserved = (rows.size() * engine.table_record_floats(h.arg1) + 2) * sizeof(float);
  if (Errc e = replicator->reserve_bytes(reserved, why); e != Errc::ok) return e;
  Errc status = Errc::ok;
  if (push.identified() && engine.table_push_marks() > 0) {
    status = replicator->push_rows_in_order(h.arg1, push.worker, rows, reserved, apply, park, why, parked);
    if (*parked) return Errc::ok;
  } else if ((status = apply()) == Errc::ok) {
    replicator->ship_rows(h.arg1, rows, reserved, park());
    *parked = true;
    return Errc::ok;
  }
  replicator->release_bytes(reserved);
  return status;
}

Errc apply_table_frame(ShardEngine& engine, const wire::FrameHeader& h, std::span<const KeyEntry> keys,
                       const float* payload, std::uint64_t connection, std::string* why) {
  switch (static_cast<wire::Op>(h.op)) {
    case wire::Op::replica_table:
      return apply_replica_table(engine, h, keys, payload, connection, why);
    case wire::Op::replica_rows:
      return engine.apply_replica_rows(origin_of(h), connection, position_of(h), h.arg1, keys, payload, why);
    case wire::Op::replica_unrows:
      return engine.apply_replica_rows(origin_of(h), connection, position_of(h), h.arg1, keys, nullptr, why);
    case wire::Op::replica_rows_marked: {
      // Its first key is the mark: {worker, 2} and the u64 the origin set with these rows.
      if (keys.empty() || keys[0].length != 2 || keys[0].key > UINT32_MAX) {
        *why = "replica_rows_marked begins with its push mark: {worker, 2} and the u64 mark";
        return Errc::protocol;
      }
      ShardEngine::RowsMark marked{static_cast<std::uint32_t>(keys[0].key), 0};
      std::memcpy(&marked.mark, payload, sizeof marked.mark);
      return engine.apply_replica_rows(origin_of(h), connection, position_of(h), h.arg1, keys.subspan(1), payload + 2,
                                       why, &marked);
    }
    default:
      *why = std::string(wire::op_name(h.op)) + " is not a table replication frame";
      return Errc::protocol;
  }
}

Errc read_table_page(const ShardEngine& engine, const wire::FrameHeader& h, std::span<const KeyEntry> keys,
                     std::uint64_t max_bytes, std::string* bytes, std::string* why) {
  if (keys.size() != 1) {
    *why = "replica_table_rows carries one key: {cursor, rows}";
    return Errc::protocol;
  }
  if (keys[0].key > UINT32_MAX) {
    *why = "a cursor past the table's rows";
    return Errc::protocol;
  }
  if (max_bytes <= sizeof(wire::ReplicaRowsHeader)) {
    *why = "no room for a table page's header";
    return Errc::capacity;
  }
  ReplicaTableRows got;
  if (Errc e = engine.replica_table_rows(origin_of(h), h.arg1, static_cast<std::uint32_t>(keys[0].key), keys[0].length,
                                         max_bytes - sizeof(wire::ReplicaRowsHeader), &got, why);
      e != Errc::ok)
    return e;
  wire::ReplicaRowsHeader head{};
  head.exists = got.exists ? 1 : 0;
  head.position = got.position;
  head.next = got.next;
  head.rows = static_cast<std::uint32_t>(got.ids.size());
  head.record_floats = got.record_floats;
  head.synced = got.synced ? 1 : 0;
  head.max_rows = got.max_rows;
  wire::encode_table_spec(got.requested, head.spec);
  head.marks = static_cast<std::uint32_t>(got.marks.size());
  head.epoch = got.epoch;
  const std::size_t marks_end = sizeof head + got.marks.size() * sizeof(std::uint64_t);
  const std::size_t ids_bytes = got.ids.size() * sizeof(Key);
  bytes->assign(marks_end + ids_bytes + got.records.size() * sizeof(float), '\0');
  std::memcpy(bytes->data(), &head, sizeof head);
  if (!got.marks.empty())
    std::memcpy(bytes->data() + sizeof head, got.marks.data(), got.marks.size() * sizeof(std::uint64_t));
  if (!got.ids.empty()) {
    std::memcpy(bytes->data() + marks_end, got.ids.data(), ids_bytes);
    std::memcpy(bytes->data() + marks_end + ids_bytes, got.records.data(), got.records.size() * sizeof(float));
  }
  return Errc::ok;
}

}  // namespace pskv::replication

#include "transport/wire.h"

#include <bit>
#include <cstring>

namespace pskv::wire {

bool op_carries_values(Op op) noexcept {
  return op == Op::init || op == Op::push || op == Op::replicate || op == Op::table_create || op == Op::table_push ||
         op == Op::replica_table || op == Op::replica_rows || op == Op::replica_rows_marked || op == Op::down_vote ||
         op == Op::down_certified || op == Op::hand_back;
}

void encode_table_spec(const TableSpec& spec, float out[kTableSpecFloats]) noexcept {
  const std::uint32_t words[kTableSpecFloats] = {spec.dim,
                                                 static_cast<std::uint32_t>(spec.init),
                                                 std::bit_cast<std::uint32_t>(spec.init_scale),
                                                 static_cast<std::uint32_t>(spec.seed),
                                                 static_cast<std::uint32_t>(spec.seed >> 32),
                                                 static_cast<std::uint32_t>(spec.rule.rule),
                                                 std::bit_cast<std::uint32_t>(spec.rule.lr),
                                                 std::bit_cast<std::uint32_t>(spec.rule.momentum),
                                                 std::bit_cast<std::uint32_t>(spec.rule.beta1),
                                                 std::bit_cast<std::uint32_t>(spec.rule.beta2),
                                                 std::bit_cast<std::uint32_t>(spec.rule.eps),
                                                 std::bit_cast<std::uint32_t>(spec.rule.weight_decay),
                                                 spec.admit_after,
                                                 static_cast<std::uint32_t>(spec.eviction),
                                                 static_cast<std::uint32_t>(spec.max_rows),
                                                 static_cast<std::uint32_t>(spec.max_rows >> 32)};
  std::memcpy(out, words, sizeof words);
}

Errc decode_table_spec(const float in[kTableSpecFloats], TableSpec* spec, std::string* why) {
  std::uint32_t w[kTableSpecFloats];
  std::memcpy(w, in, sizeof w);
  if (w[1] > static_cast<std::uint32_t>(RowInit::normal) || w[5] > static_cast<std::uint32_t>(UpdateRule::adagrad) ||
      w[13] > static_cast<std::uint32_t>(RowEviction::step)) {
    *why = "table spec names an unknown initializer (" + std::to_string(w[1]) + "), update rule (" +
           std::to_string(w[5]) + ") or eviction policy (" + std::to_string(w[13]) + ")";
    return Errc::invalid_argument;
  }
  TableSpec s;
  s.dim = w[0];
  s.init = static_cast<RowInit>(w[1]);
  s.init_scale = std::bit_cast<float>(w[2]);
  s.seed = w[3] | (std::uint64_t{w[4]} << 32);
  s.rule.rule = static_cast<UpdateRule>(w[5]);
  s.rule.lr = std::bit_cast<float>(w[6]);
  s.rule.momentum = std::bit_cast<float>(w[7]);
  s.rule.beta1 = std::bit_cast<float>(w[8]);
  s.rule.beta2 = std::bit_cast<float>(w[9]);
  s.rule.eps = std::bit_cast<float>(w[10]);
  s.rule.weight_decay = std::bit_cast<float>(w[11]);
  s.admit_after = w[12];
  s.eviction = static_cast<RowEviction>(w[13]);
  s.max_rows = w[14] | (std::uint64_t{w[15]} << 32);
  if (std::string problem = check_table_spec(s); !problem.empty()) {
    *why = problem;
    return Errc::invalid_argument;
  }
  *spec = s;
  return Errc::ok;
}

Errc decode_table_create(std::span<const KeyEntry> keys, const float* payload, std::uint32_t* table, TableSpec* spec,
                         std::string* why) {
  if (keys.size() != 1 || keys[0].length != kTableSpecFloats) {
    *why = "table_create carries one key (the table id) of " + std::to_string(kTableSpecFloats) + " words";
    return Errc::protocol;
  }
  if (keys[0].key >= kMaxTables) {
    *why = "table id " + std::to_string(keys[0].key) + " is past the " + std::to_string(kMaxTables) +
           " tables a server holds";
    return Errc::invalid_argument;
  }
  *table = static_cast<std::uint32_t>(keys[0].key);
  return decode_table_spec(payload, spec, why);
}

std::string_view op_name(std::uint16_t op) noexcept {
  switch (static_cast<Op>(op)) {
    case Op::hello:
      return "hello";
    case Op::init:
      return "init";
    case Op::push:
      return "push";
    case Op::pull:
      return "pull";
    case Op::clock:
      return "clock";
    case Op::barrier:
      return "barrier";
    case Op::stats:
      return "stats";
    case Op::auth:
      return "auth";
    case Op::lookup:
      return "lookup";
    case Op::wait:
      return "wait";
    case Op::replicate:
      return "replicate";
    case Op::replica_pull:
      return "replica_pull";
    case Op::replica_index:
      return "replica_index";
    case Op::replica_clock:
      return "replica_clock";
    case Op::replica_barrier:
      return "replica_barrier";
    case Op::replica_evict:
      return "replica_evict";
    case Op::table_create:
      return "table_create";
    case Op::table_pull:
      return "table_pull";
    case Op::table_push:
      return "table_push";
    case Op::replica_table:
      return "replica_table";
    case Op::replica_rows:
      return "replica_rows";
    case Op::replica_unrows:
      return "replica_unrows";
    case Op::replica_table_rows:
      return "replica_table_rows";
    case Op::replica_rows_marked:
      return "replica_rows_marked";
    case Op::down_vote:
      return "down_vote";
    case Op::down_certified:
      return "down_certified";
    case Op::certificates:
      return "certificates";
    case Op::hand_back:
      return "hand_back";
  }
  return "unknown";
}

Errc validate_header(const FrameHeader& h, const Limits& limits, bool expect_response, std::string* why) {
  auto fail = [&](Errc e, std::string msg) {
    if (why) *why = std::move(msg);
    return e;
  };
  if (h.magic != kMagic)
    return fail(
        Errc::protocol, "bad magic 0x" + [&] {
          char buf[16];
          std::snprintf(buf, sizeof buf, "%08x", h.magic);
          return std::string(buf);
        }() + ": the peer does not speak the pskv protocol");
  if (h.version != kVersion)
    return fail(Errc::protocol, "protocol version " + std::to_string(h.version) + ", this side speaks " +
                                    std::to_string(kVersion) + ": run matching pskv builds on clients and servers");
  if (op_name(h.op) == "unknown") return fail(Errc::protocol, "unknown op " + std::to_string(h.op));
  if (bool(h.flags & kResponse) != expect_response)
    return fail(Errc::protocol, expect_response ? "expected a response frame" : "unexpected response frame");
  if (h.num_keys > limits.max_keys)
    return fail(Errc::capacity, "frame declares " + std::to_string(h.num_keys) + " keys; the limit is " +
                                    std::to_string(limits.max_keys) +
                                    " (split the batch or raise --max-keys-per-request)");
  if (h.payload_bytes > limits.max_payload_bytes)
    return fail(Errc::capacity, "frame declares " + std::to_string(h.payload_bytes) + " payload bytes; the limit is " +
                                    std::to_string(limits.max_payload_bytes) +
                                    " (raise --max-request-mb or lower --chunk-floats)");
  if (!expect_response) {
    const Op op = static_cast<Op>(h.op);
    if (op == Op::hello) {
      if (h.payload_bytes != 0 && h.payload_bytes != kAuthNonceBytes)
        return fail(Errc::protocol, "hello carries nothing or a " + std::to_string(kAuthNonceBytes) +
                                        "-byte nonce, not " + std::to_string(h.payload_bytes) + " bytes");
    } else if (op == Op::auth) {
      if (h.payload_bytes != kAuthProofBytes)
        return fail(Errc::protocol, "auth carries a " + std::to_string(kAuthProofBytes) + "-byte proof, not " +
                                        std::to_string(h.payload_bytes) + " bytes");
    } else if (!op_carries_values(op) && h.payload_bytes != 0) {
      return fail(Errc::protocol, std::string(op_name(h.op)) + " request must not carry a payload");
    }
    if (op_carries_values(op) && h.payload_bytes % sizeof(float) != 0)
      return fail(Errc::protocol, "payload of " + std::to_string(h.payload_bytes) + " bytes is not whole floats");
  }
  return Errc::ok;
}

std::string encode_replica_index(bool synced, std::span<const std::pair<std::uint64_t, std::uint32_t>> keys,
                                 std::span<const std::uint64_t> words) {
  const auto workers = static_cast<std::uint32_t>(words.size() / std::size(kWorkerWordOps));
  const ReplicaIndexHeader head{synced ? 1u : 0u, workers, keys.size()};
  const std::size_t entries = sizeof head + keys.size() * sizeof(ReplicaIndexEntry);
  std::string bytes(entries + words.size() * sizeof(std::uint64_t), '\0');
  std::memcpy(bytes.data(), &head, sizeof head);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const ReplicaIndexEntry e{keys[i].first, keys[i].second};
    std::memcpy(bytes.data() + sizeof head + i * sizeof e, &e, sizeof e);
  }
  if (!words.empty()) std::memcpy(bytes.data() + entries, words.data(), words.size() * sizeof(std::uint64_t));
  return bytes;
}

Errc validate_keys(const FrameHeader& h, std::span<const KeyEntry> keys, std::string* why) {
  std::uint64_t floats = 0;
  for (const KeyEntry& k : keys) {
    if (k.length == 0 && &k == keys.data() && static_cast<Op>(h.op) == Op::table_push) {
      // A retrying client's identity (take_table_push_identity): a session and a sequence number.
      if ((k.key >> 32) == 0 || static_cast<std::uint32_t>(k.key) == 0) {
        if (why) *why = "a table_push identity without a session or a sequence number";
        return Errc::protocol;
      }
      continue;
    }
    if (k.length == 0) {
      if (why) *why = "key " + std::to_string(k.key) + " has length 0";
      return Errc::invalid_argument;
    }
    floats += k.length;
  }
  if (op_carries_values(static_cast<Op>(h.op)) && floats * sizeof(float) != h.payload_bytes) {
    if (why)
      *why = "key table sums to " + std::to_string(floats * sizeof(float)) + " bytes but the payload has " +
             std::to_string(h.payload_bytes);
    return Errc::protocol;
  }
  return Errc::ok;
}

ParseResult parse_request(const std::byte* data, std::size_t avail, const Limits& limits, ParsedFrame* out,
                          std::vector<KeyEntry>* keys, Errc* status, std::string* why) {
  if (avail < sizeof(FrameHeader)) return ParseResult::need_more;
  std::memcpy(&out->header, data, sizeof(FrameHeader));
  const FrameHeader& h = out->header;
  if (Errc e = validate_header(h, limits, false, why); e != Errc::ok) {
    *status = e;
    return ParseResult::bad;
  }
  const std::uint64_t key_bytes = std::uint64_t{h.num_keys} * sizeof(KeyEntry);
  out->frame_bytes = sizeof(FrameHeader) + key_bytes + h.payload_bytes;
  if (avail < out->frame_bytes) return ParseResult::need_more;
  keys->resize(h.num_keys);
  if (key_bytes) std::memcpy(keys->data(), data + sizeof(FrameHeader), key_bytes);
  if (Errc e = validate_keys(h, *keys, why); e != Errc::ok) {
    *status = e;
    return ParseResult::bad;
  }
  out->payload = data + sizeof(FrameHeader) + key_bytes;
  return ParseResult::complete;
}

std::vector<float> encode_down_vote(const Certificate& c, std::uint32_t requester) {
  const DownVote v{c.server, c.incarnation, c.holder, requester, static_cast<std::uint32_t>(c.uri.size()), 0};
  std::vector<float> out((sizeof v + c.uri.size() + sizeof(float) - 1) / sizeof(float), 0.0f);
  std::memcpy(out.data(), &v, sizeof v);
  std::memcpy(reinterpret_cast<char*>(out.data()) + sizeof v, c.uri.data(), c.uri.size());
  return out;
}

namespace {
// A holder's URI as a client will connect to it: tcp:// or rdma://, nothing it could not parse.
bool plausible_uri(std::string_view uri) noexcept {
  if (uri.size() > kMaxCertificateUri || (uri.rfind("tcp://", 0) != 0 && uri.rfind("rdma://", 0) != 0)) return false;
  for (char ch : uri)
    if (ch <= ' ' || ch > '~') return false;
  return true;
}
}  // namespace

Errc decode_down_vote(std::span<const KeyEntry> keys, const float* payload, std::uint64_t payload_bytes, Certificate* c,
                      std::uint32_t* requester, std::string* why) {
  DownVote v{};
  if (keys.size() != 1 || keys[0].key != 0 || payload_bytes < sizeof v) {
    *why = "a down vote carries one key {0, floats} holding a DownVote and the holder's URI";
    return Errc::protocol;
  }
  std::memcpy(&v, payload, sizeof v);
  const std::uint64_t need =
      (sizeof v + std::uint64_t{v.uri_bytes} + sizeof(float) - 1) / sizeof(float) * sizeof(float);
  if (v.uri_bytes > kMaxCertificateUri || need != payload_bytes) {
    *why = "a down vote whose URI length (" + std::to_string(v.uri_bytes) + " bytes) does not match its payload";
    return Errc::protocol;
  }
  c->server = v.server;
  c->incarnation = v.incarnation;
  c->holder = v.holder;
  c->uri.assign(reinterpret_cast<const char*>(payload) + sizeof v, v.uri_bytes);
  if (!c->uri.empty() && !plausible_uri(c->uri)) {
    *why = "a down vote names a holder URI that is not tcp:// or rdma://HOST:PORT";
    return Errc::protocol;
  }
  *requester = v.requester;
  return Errc::ok;
}

std::string encode_certificates(std::span<const Certificate> certificates) {
  std::string text;
  for (const Certificate& c : certificates)
    text += std::to_string(c.server) + ' ' + std::to_string(c.incarnation) + ' ' + std::to_string(c.holder) + ' ' +
            (c.uri.empty() ? "-" : c.uri) + '\n';
  return text;
}

Errc decode_certificates(std::string_view text, std::vector<Certificate>* out, std::string* why) {
  out->clear();
  while (!text.empty()) {
    const std::size_t end = text.find('\n');
    if (end == std::string_view::npos) {
      *why = "a certificates reply that does not end its last line";
      return Errc::protocol;
    }
    std::string_view line = text.substr(0, end);
    text.remove_prefix(end + 1);
    std::uint32_t fields[3] = {};
    for (std::uint32_t& f : fields) {
      const std::size_t space = line.find(' ');
      const std::string_view digits = line.substr(0, space);
      if (space == std::string_view::npos || digits.empty() || digits.size() > 10) {
        *why = "a malformed certificate line";
        return Errc::protocol;
      }
      std::uint64_t value = 0;
      for (char ch : digits) {
        if (ch < '0' || ch > '9') {
          *why = "a malformed certificate line";
          return Errc::protocol;
        }
        value = value * 10 + static_cast<std::uint64_t>(ch - '0');
      }
      if (value > UINT32_MAX) {
        *why = "a certificate names a number past 32 bits";
        return Errc::protocol;
      }
      f = static_cast<std::uint32_t>(value);
      line.remove_prefix(space + 1);
    }
    Certificate c{fields[0], fields[1], fields[2], line == "-" ? std::string() : std::string(line)};
    if (line != "-" && !plausible_uri(line)) {
      *why = "a certificate names a holder URI that is not tcp:// or rdma://HOST:PORT";
      return Errc::protocol;
    }
    out->push_back(std::move(c));
  }
  return Errc::ok;
}

}  // namespace pskv::wire

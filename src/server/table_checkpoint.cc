#include "server/table_checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <map>
#include <optional>
#include <vector>

#include "layout/crc.h"
#include "server/checkpoint.h"
#include "table/embedding_table.h"
#include "transport/wire.h"

namespace pskv {

namespace {

constexpr char kMagic[8] = {'P', 'S', 'K', 'V', 'T', 'B', 'L', '1'};
constexpr char kEnd[8] = {'P', 'S', 'K', 'V', 'E', 'N', 'D', '1'};
// 2: the trailer's counts are under its checksum, and a manifest names each table's newest file.
constexpr std::uint32_t kVersion = 2;
constexpr char kManifestMagic[8] = {'P', 'S', 'K', 'V', 'T', 'M', 'F', '1'};
constexpr std::uint32_t kManifestVersion = 1;
// How every refusal of what restore reads ends.
constexpr const char* kRefuseTail = "; restore an older checkpoint or start without --restore";

#pragma pack(push, 1)
struct Header {
  char magic[8];
  std::uint32_t version;
  std::uint32_t server_id;
  std::uint32_t table;
  std::uint32_t seq;
  std::uint64_t generation;
  std::uint32_t spec[wire::kTableSpecFloats];
  std::uint32_t state_floats;
  std::uint32_t crc;
};
struct Trailer {
  char magic[8];
  std::uint64_t rows;
  std::uint64_t removed;
  std::uint32_t crc;
};
struct ManifestHeader {
  char magic[8];
  std::uint32_t version;
  std::uint32_t server_id;
  std::uint32_t tables;
};
struct ManifestEntry {
  std::uint32_t table;
  std::uint32_t seq;
  std::uint64_t generation;
  std::uint32_t crc;  // the trailer checksum of that file
};
#pragma pack(pop)

std::string file_name(std::uint32_t table, std::uint32_t server, std::uint64_t generation, std::uint32_t seq) {
  return "table-" + std::to_string(table) + ".server-" + std::to_string(server) + ".g" + std::to_string(generation) +
         "." + std::to_string(seq) + ".ckpt";
}

std::string manifest_name(std::uint32_t server) {
  return "tables.server-" + std::to_string(server) + ".manifest";
}

// The manifest's entries by table, or nothing if `dir` has none for `server`. Error(protocol)
// naming it if it does not check out.
std::optional<std::map<std::uint32_t, ManifestEntry>> read_manifest(const std::string& dir, std::uint32_t server) {
  const std::string path = dir + "/" + manifest_name(server);
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::symlink_status(path, ec))) return std::nullopt;
  const CheckpointFile file(path);
  auto corrupt = [&](const std::string& why) {
    return Error(Errc::protocol, "table checkpoint manifest " + path + " " + why + kRefuseTail);
  };
  ManifestHeader h;
  if (file.size() < sizeof h + sizeof(std::uint32_t)) throw corrupt("is too short");
  std::memcpy(&h, file.data(), sizeof h);
  if (std::memcmp(h.magic, kManifestMagic, 8) != 0) throw corrupt("is not a pskv table manifest (bad magic)");
  if (h.tables > kMaxTables || file.size() != sizeof h + h.tables * sizeof(ManifestEntry) + sizeof(std::uint32_t))
    throw corrupt("has a table count that does not match its size");
  std::uint32_t crc;
  std::memcpy(&crc, file.data() + file.size() - sizeof crc, sizeof crc);
  if (crc != crc32_update(0, file.data(), file.size() - sizeof crc)) throw corrupt("fails its checksum");
  if (h.version != kManifestVersion)
    throw corrupt("is of version " + std::to_string(h.version) + ", not readable by this build");
  if (h.server_id != server) throw corrupt("is server " + std::to_string(h.server_id) + "'s");
  std::map<std::uint32_t, ManifestEntry> out;
  for (std::uint32_t i = 0; i < h.tables; ++i) {
    ManifestEntry e;
    std::memcpy(&e, file.data() + sizeof h + i * sizeof e, sizeof e);
    if (e.table >= kMaxTables || !out.emplace(e.table, e).second)
      throw corrupt("names table " + std::to_string(e.table) + " twice or past the table ids");
  }
  return out;
}

// table -> generation -> seq -> path, of `server`'s files in `dir`.
using Files = std::map<std::uint32_t, std::map<std::uint64_t, std::map<std::uint32_t, std::string>>>;
Files scan(const std::string& dir, std::uint32_t server) {
  Files out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    unsigned table = 0, srv = 0, seq = 0;
    unsigned long long generation = 0;
    int used = 0;
    if (std::sscanf(name.c_str(), "table-%u.server-%u.g%llu.%u.ckpt%n", &table, &srv, &generation, &seq, &used) != 4 ||
        static_cast<std::size_t>(used) != name.size() || srv != server ||
        name != file_name(table, srv, generation, seq))  // no leading zeros or signs: one name per file
      continue;
    out[table][generation][seq] = entry.path().string();
  }
  return out;
}

}  // namespace

TableCheckpointInfo TableCheckpointer::write(ShardEngine& engine) {
  TableCheckpointInfo info;
  if (!manifest_seeded_) {
    // The manifest goes on naming what an earlier run committed until this one replaces it; and
    // a directory without one gets one before any file of this version, so that a crash before
    // the first manifest leaves files that restore accepts (as newer than what it names).
    bool found = false;
    try {
      if (const auto earlier = read_manifest(dir_, server_id_)) {
        found = true;
        for (const auto& [table, e] : *earlier) {
          Chain& c = chains_[table];
          c.committed = true;
          c.generation = e.generation;
          c.seq = e.seq;
          c.crc = e.crc;
        }
      }
    } catch (const Error&) {  // unreadable: replaced by this run's
    }
    if (!found) write_manifest(/*even_empty=*/true);
    manifest_seeded_ = true;
  }
  try {
    write_tables(engine, info);
  } catch (...) {
    // What was committed before the failure is named, so that its restore is checked too.
    try {
      write_manifest();
    } catch (...) {
    }
    throw;
  }
  write_manifest();
  return info;
}

void TableCheckpointer::write_manifest(bool even_empty) {
  std::vector<ManifestEntry> entries;
  for (std::uint32_t id = 0; id < kMaxTables; ++id)
    if (const Chain& c = chains_[id]; c.committed) entries.push_back({id, c.seq, c.generation, c.crc});
  if (entries.empty() && !even_empty) return;
  AtomicFile file(dir_ + "/" + manifest_name(server_id_));
  ManifestHeader h{};
  std::memcpy(h.magic, kManifestMagic, 8);
  h.version = kManifestVersion;
  h.server_id = server_id_;
  h.tables = static_cast<std::uint32_t>(entries.size());
  file.put(&h, sizeof h);
  file.put(entries.data(), entries.size() * sizeof(ManifestEntry));
  std::uint32_t crc = crc32_update(0, &h, sizeof h);
  crc = crc32_update(crc, entries.data(), entries.size() * sizeof(ManifestEntry));
  file.put(&crc, sizeof crc);
  file.commit();
}

void TableCheckpointer::write_tables(ShardEngine& engine, TableCheckpointInfo& info) {
  for (std::uint32_t id = 0; id < kMaxTables; ++id) {
    TableSpec spec;
    EmbeddingTable* table = engine.table_at(id, &spec);
    if (!table) continue;
    Chain& chain = chains_[id];
    // A new snapshot once replaying the deltas would cost more than reading one.
    const bool full = !chain.started || chain.delta_rows > chain.full_rows;
    std::uint64_t generation = chain.generation;
    std::uint32_t seq = chain.seq + 1;
    std::map<std::uint64_t, std::map<std::uint32_t, std::string>> older;  // a snapshot's predecessors
    if (full) {
      if (Files files = scan(dir_, server_id_); files.count(id)) older = std::move(files[id]);
      if (!older.empty()) generation = std::max(generation, older.rbegin()->first);
      ++generation;
      seq = 0;
    }
    // Taking the changes consumes them: should this file not be committed, the next one must be
    // a snapshot, or what was taken here would be lost from the chain.
    chain.started = false;
    AtomicFile file(dir_ + "/" + file_name(id, server_id_, generation, seq));
    Header h{};
    std::memcpy(h.magic, kMagic, 8);
    h.version = kVersion;
    h.server_id = server_id_;
    h.table = id;
    h.seq = seq;
    h.generation = generation;
    wire::encode_table_spec(spec, reinterpret_cast<float*>(h.spec));
    h.state_floats = static_cast<std::uint32_t>(table->state_floats_per_row());
    h.crc = crc32_update(0, &h, offsetof(Header, crc));
    file.put(&h, sizeof h);
    std::uint32_t crc = 0;  // of the body: rows, then removed ids
    auto body = [&](const void* p, std::size_t n) {
      file.put(p, n);
      crc = crc32_update(crc, p, n);
    };
    std::uint64_t rows = 0;
    std::vector<Key> removed;
    table->take_changes(
        full,
        [&](Key key, const float* values, const float* state) {
          body(&key, sizeof key);
          body(values, table->dim() * sizeof(float));
          body(state, h.state_floats * sizeof(float));
          ++rows;
        },
        &removed);
    body(removed.data(), removed.size() * sizeof(Key));
    Trailer t{};
    std::memcpy(t.magic, kEnd, 8);
    t.rows = rows;
    t.removed = removed.size();
    t.crc = crc32_update(crc, &t, offsetof(Trailer, crc));
    file.put(&t, sizeof t);
    info.bytes += file.bytes();
    file.commit();
    ++info.files;
    info.rows += rows;
    info.removed += removed.size();
    chain.started = true;
    chain.generation = generation;
    chain.seq = seq;
    chain.committed = true;
    chain.crc = t.crc;
    if (full) {
      chain.full_rows = rows;
      chain.delta_rows = 0;
      // The new snapshot is durable: the older generations are not needed any more.
      for (const auto& [g, seqs] : older)
        for (const auto& [s, path] : seqs) {
          std::error_code ignored;  // an old file left behind is skipped by restore
          std::filesystem::remove(path, ignored);
        }
    } else {
      chain.delta_rows += rows + removed.size();
    }
  }
}

TableCheckpointer::Parsed TableCheckpointer::parse(const std::uint8_t* data, std::size_t size, std::uint32_t server_id,
                                                   std::uint32_t table_id, std::uint64_t generation, std::uint32_t seq,
                                                   const std::string& name) {
  std::size_t at = 0;
  auto corrupt = [&](const std::string& why) {
    return Error(Errc::protocol,
                 "table checkpoint " + name + " is corrupt at byte " + std::to_string(at) + ": " + why + kRefuseTail);
  };
  Header h;
  Trailer t;
  if (size < sizeof h + sizeof t) throw corrupt("shorter than a header and a trailer");
  std::memcpy(&h, data, sizeof h);
  if (std::memcmp(h.magic, kMagic, 8) != 0) throw corrupt("not a pskv table checkpoint (bad magic)");
  if (h.crc != crc32_update(0, &h, offsetof(Header, crc))) throw corrupt("header checksum mismatch");
  if (h.version != 1 && h.version != kVersion)
    throw corrupt("version " + std::to_string(h.version) + " is not readable by this build");
  if (h.server_id != server_id || h.table != table_id || h.generation != generation || h.seq != seq)
    throw corrupt("its header names another server, table, generation or sequence number than its file name");
  Parsed p;
  std::string why;
  if (wire::decode_table_spec(reinterpret_cast<const float*>(h.spec), &p.spec, &why) != Errc::ok)
    throw corrupt("its table spec is refused: " + why);
  if (h.state_floats != EmbeddingTable::state_floats_for(p.spec))
    throw corrupt("state floats per row disagree with the spec");
  at = size - sizeof t;
  std::memcpy(&t, data + at, sizeof t);
  if (std::memcmp(t.magic, kEnd, 8) != 0) throw corrupt("bad trailer");
  const std::uint64_t body = size - sizeof h - sizeof t;
  p.state_floats = h.state_floats;
  p.row_bytes = sizeof(Key) + (std::uint64_t{p.spec.dim} + h.state_floats) * sizeof(float);
  if (t.rows > body / p.row_bytes || t.removed > body / sizeof(Key) ||
      t.rows * p.row_bytes + t.removed * sizeof(Key) != body)
    throw corrupt("its row and removal counts do not add up to its size");
  // Version 1 left the trailer's own words out of its checksum.
  std::uint32_t crc = crc32_update(0, data + sizeof h, body);
  if (h.version >= 2) crc = crc32_update(crc, &t, offsetof(Trailer, crc));
  if (crc != t.crc) throw corrupt("checksum mismatch in its rows or counts");
  p.rows = data + sizeof h;
  p.removed = p.rows + t.rows * p.row_bytes;
  p.info = {1, t.rows, t.removed, size};
  p.version = h.version;
  p.crc = t.crc;
  return p;
}

void TableCheckpointer::apply_rows(const Parsed& p, EmbeddingTable& table, const std::string& name) {
  for (std::uint64_t i = 0; i < p.info.removed; ++i) {
    Key id;
    std::memcpy(&id, p.removed + i * sizeof id, sizeof id);
    table.remove_row(id);
  }
  std::vector<float> values(p.spec.dim), state(p.state_floats);
  for (std::uint64_t i = 0; i < p.info.rows; ++i) {
    const std::uint8_t* r = p.rows + i * p.row_bytes;
    Key id;
    std::memcpy(&id, r, sizeof id);
    std::memcpy(values.data(), r + sizeof id, values.size() * sizeof(float));
    if (!state.empty())  // (an empty vector's data() may be null, which memcpy must not get)
      std::memcpy(state.data(), r + sizeof id + values.size() * sizeof(float), state.size() * sizeof(float));
    if (!table.restore_row(id, values.data(), state.data()))
      throw Error(Errc::capacity, "cannot restore row " + std::to_string(id) + " from " + name +
                                      ": the table is full (is --table-memory-mb as large as when it was written?)");
  }
}

TableCheckpointInfo TableCheckpointer::apply(const std::uint8_t* data, std::size_t size, std::uint32_t server_id,
                                             std::uint32_t table_id, std::uint64_t generation, std::uint32_t seq,
                                             TableSpec* spec, EmbeddingTable* table, const std::string& name) {
  const Parsed p = parse(data, size, server_id, table_id, generation, seq, name);
  *spec = p.spec;
  if (table) apply_rows(p, *table, name);
  return p.info;
}

namespace {

// Whether the table checkpoint at `path` is of a table declared with a cap. Unreadable: true,
// so that its restore comes first and reports what is wrong with it.
bool declared_with_a_cap(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return true;
  Header h{};
  const bool read = std::fread(&h, sizeof h, 1, f) == 1;
  std::fclose(f);
  TableSpec spec;
  std::string why;
  return !read || wire::decode_table_spec(reinterpret_cast<const float*>(h.spec), &spec, &why) != Errc::ok ||
         spec.max_rows != 0;
}

}  // namespace

TableCheckpointInfo TableCheckpointer::restore(ShardEngine& engine, const std::string& dir, std::uint32_t server_id) {
  // Per table, the newest generation whose snapshot exists (a crash may leave a newer one
  // without it). Tables declared with a cap first: one declared without gets what the table
  // memory has left when it is made, and made first it could leave a capped one none (on the
  // server that wrote them, the capped one was made first, or it would have been refused).
  const Files files = scan(dir, server_id);
  const auto manifest = read_manifest(dir, server_id);
  std::vector<std::pair<std::uint32_t, Files::mapped_type::const_iterator>> order;
  for (const auto& [table_id, generations] : files) {
    auto g = generations.rbegin();
    while (g != generations.rend() && !g->second.count(0)) ++g;
    if (g != generations.rend()) order.emplace_back(table_id, std::prev(g.base()));
  }
  if (manifest)
    for (const auto& [named_table, entry] : *manifest)
      if (const std::uint32_t table_id = named_table;  // clang 14 cannot capture a structured binding
          std::none_of(order.begin(), order.end(), [&](const auto& t) { return t.first == table_id; }))
        throw Error(Errc::protocol, "table " + std::to_string(table_id) + " is named by the manifest in " + dir +
                                        " (generation " + std::to_string(entry.generation) + ", file " +
                                        std::to_string(entry.seq) + ") but has no snapshot there" + kRefuseTail);
  std::stable_partition(order.begin(), order.end(),
                        [](const auto& t) { return declared_with_a_cap(t.second->second.at(0)); });
  TableCheckpointInfo total;
  for (const auto& [table_id, g] : order) {
    const std::uint64_t generation = g->first;
    std::uint32_t expected = 0;
    EmbeddingTable* table = nullptr;
    TableSpec first_spec;
    // What the manifest says this table's newest file is. A newer generation, or files past the
    // one it names, were committed after it (a crash before the manifest followed): each file is
    // whole, having been renamed into place, and is checked on its own.
    const ManifestEntry* named = nullptr;
    if (manifest)
      if (auto it = manifest->find(table_id); it != manifest->end()) named = &it->second;
    if (named && named->generation > generation)
      throw Error(Errc::protocol, "the manifest in " + dir + " names generation " + std::to_string(named->generation) +
                                      " of table " + std::to_string(table_id) + ", whose snapshot is missing" +
                                      kRefuseTail);
    if (named && named->generation == generation && !g->second.count(named->seq))
      throw Error(Errc::protocol, "the manifest in " + dir + " names " +
                                      file_name(table_id, server_id, generation, named->seq) + ", which is missing" +
                                      kRefuseTail);
    for (const auto& [seq, path] : g->second) {
      if (seq != expected)
        throw Error(Errc::protocol, "table checkpoint " + path + " follows a missing delta " +
                                        std::to_string(expected) + " of its generation" + kRefuseTail);
      const CheckpointFile bytes(path);
      // Validated whole before anything of it is applied.
      const Parsed p = parse(bytes.data(), bytes.size(), server_id, table_id, generation, seq, path);
      if (p.version >= 2 && !manifest)
        throw Error(Errc::protocol, "table checkpoint " + path + " was written with a manifest, " +
                                        manifest_name(server_id) + ", which is missing from " + dir + kRefuseTail);
      if (named && named->generation == generation && named->seq == seq && named->crc != p.crc)
        throw Error(Errc::protocol, "table checkpoint " + path + " is not the file the manifest in " + dir +
                                        " names (another checksum)" + kRefuseTail);
      if (seq == 0) {
        std::string why;
        if (Errc e = engine.create_table(table_id, p.spec, &why); e != Errc::ok)
          throw Error(e, "cannot recreate table " + std::to_string(table_id) + " from " + path + ": " + why);
        table = engine.table_at(table_id);
        first_spec = p.spec;
      } else if (!(p.spec == first_spec)) {
        throw Error(Errc::protocol, "table checkpoint " + path + " has another spec than its generation's snapshot");
      }
      apply_rows(p, *table, path);
      const TableCheckpointInfo& one = p.info;
      total.files += one.files;
      total.rows += one.rows;
      total.removed += one.removed;
      total.bytes += one.bytes;
      ++expected;
    }
  }
  return total;
}

}  // namespace pskv

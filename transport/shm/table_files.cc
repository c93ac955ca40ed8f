#include "transport/shm/table_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <span>

#include "layout/crc.h"
#include "transport/shm/mapped_file.h"
#include "transport/shm/segment.h"
#include "transport/wire.h"

namespace pskv::shm {
namespace {

namespace fs = std::filesystem;

constexpr char kSpecMagic[8] = {'P', 'S', 'K', 'V', 'T', 'A', 'B', '1'};

struct SpecFile {
  char magic[8];
  std::uint32_t id;
  std::uint32_t reserved;
  std::uint64_t max_rows;
  float spec[wire::kTableSpecFloats];
  std::uint32_t crc;  // of everything before it
  std::uint32_t reserved2;
};

std::string errno_text() {
  return std::strerror(errno);
}

// The number after `prefix` in `name` (written as this file writes it: digits in `base`, no
// leading zero), if it is one.
std::optional<std::uint64_t> number_after(const std::string& name, std::string_view prefix, int base = 10) {
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  std::uint64_t n = 0;
  const char* first = name.data() + prefix.size();
  const char* last = name.data() + name.size();
  const auto [end, ec] = std::from_chars(first, last, n, base);
  if (ec != std::errc() || end != last || (*first == '0' && last - first > 1)) return std::nullopt;
  return n;
}

std::string hex(std::uint64_t n) {
  char text[17];
  const auto [end, ec] = std::to_chars(text, text + sizeof text, n, 16);
  return std::string(text, end);
}

// A dead server's file, as this server reads it: failures name the file and the way out.
Error left_file_error(const std::string& table_dir, const std::string& what) {
  return Error(Errc::stale_resource, what + "; remove " + table_dir + " to start without that table");
}

// A table directory's published segments, by index (new-K files were never published, so they
// hold no row). Throws Error naming a segment past the last a table has.
std::vector<std::pair<std::uint32_t, std::string>> segment_files(const std::string& dir) {
  std::vector<std::pair<std::uint32_t, std::string>> out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto index = number_after(entry.path().filename().string(), "segment-");
    if (!index) continue;
    if (*index >= (1u << 16))
      throw Error(Errc::stale_resource, entry.path().string() + " is past the segments a table has");
    out.emplace_back(static_cast<std::uint32_t>(*index), entry.path().string());
  }
  return out;
}

}  // namespace

std::string tables_directory(const std::string& name, std::uint64_t job_nonce) {
  return "/dev/shm" + segment_object_name(name) + ".tables." + hex(job_nonce);
}

void remove_left_tables(const std::string& name, const std::string& keep) {
  const std::string prefix = segment_object_name(name).substr(1) + ".tables.";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/dev/shm", ec)) {
    const std::string file = entry.path().filename().string();
    if (!number_after(file, prefix, 16) || entry.path().string() == keep) continue;
    fs::remove_all(entry.path(), ec);
  }
}

void make_private_directory(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw Error(Errc::io, "cannot make " + dir + ": " + errno_text());
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid())
    throw Error(Errc::permission, dir + " is not a directory of this user's: not keeping a successor's files in it");
}

TableFiles::TableFiles(const std::string& root, std::uint32_t id, const TableSpec& requested, std::uint64_t max_rows,
                       const std::string& take_from)
    : take_from_(take_from),
      dir_(root + "/table-" + std::to_string(id) + ".new"),
      final_dir_(root + "/table-" + std::to_string(id)) {
  make_private_directory(root);
  std::error_code ec;
  fs::remove_all(dir_, ec);  // a table of this id made here before and dropped (a failed create)
  fs::remove_all(final_dir_, ec);
  if (::mkdir(dir_.c_str(), 0700) != 0) throw Error(Errc::io, "cannot make " + dir_ + ": " + errno_text());
  SpecFile f{};
  std::memcpy(f.magic, kSpecMagic, sizeof kSpecMagic);
  f.id = id;
  f.max_rows = max_rows;
  wire::encode_table_spec(requested, f.spec);
  f.crc = crc32_update(0, &f, offsetof(SpecFile, crc));
  const std::string temp = dir_ + "/spec.new";
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw Error(Errc::io, "cannot create " + temp + ": " + errno_text());
  const bool written = ::write(fd, &f, sizeof f) == static_cast<ssize_t>(sizeof f);
  ::close(fd);
  if (!written || ::rename(temp.c_str(), (dir_ + "/spec").c_str()) != 0)
    throw Error(Errc::io, "cannot write " + dir_ + "/spec: " + errno_text());
}

TableFiles::~TableFiles() {
  std::error_code ec;
  fs::remove_all(dir_, ec);
  fs::remove_all(final_dir_, ec);
  // The server's directory too once it holds no table: its stop removed it already, unless the
  // table's thread was making a segment file in it meanwhile.
  ::rmdir(fs::path(final_dir_).parent_path().c_str());
}

std::unique_ptr<MemoryResource> TableFiles::segment(std::size_t bytes) {
  return MappedFile::create(dir_ + "/new-" + std::to_string(made_.fetch_add(1)), bytes);
}

void TableFiles::publish(MemoryResource& memory, std::uint32_t index) {
  auto& file = static_cast<MappedFile&>(memory);
  const std::string name = dir_ + "/segment-" + std::to_string(index);
  if (::rename(file.path().c_str(), name.c_str()) != 0)
    throw Error(Errc::io, "cannot name " + file.path() + " " + name + ": " + errno_text());
  file.keep(name);
}

std::unique_ptr<MemoryResource> TableFiles::undo(std::size_t bytes) {
  auto f = MappedFile::create(dir_ + "/undo", bytes);
  // The table is whole now (spec and undo records): under its name it is adopted.
  if (::rename(dir_.c_str(), final_dir_.c_str()) != 0)
    throw Error(Errc::io, "cannot name " + dir_ + " " + final_dir_ + ": " + errno_text());
  dir_ = final_dir_;
  f->keep(dir_ + "/undo");
  return f;
}

TableStorage::Left TableFiles::take_left() {
  Left left;
  if (take_from_.empty()) return left;
  try {
    left.undo = MappedFile::open(take_from_ + "/undo");
    for (const auto& [index, path] : segment_files(take_from_)) {
      const std::string mine = final_dir_ + "/segment-" + std::to_string(index);
      if (::link(path.c_str(), mine.c_str()) != 0)
        throw Error(Errc::io, "cannot link " + path + " to " + mine + ": " + errno_text());
      left.segments.emplace_back(index, MappedFile::open(mine));
    }
  } catch (const std::exception& e) {
    throw left_file_error(take_from_, e.what());
  }
  return left;
}

std::vector<LeftTable> left_tables(const std::string& root) {
  std::vector<LeftTable> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const auto id = number_after(entry.path().filename().string(), "table-");
    if (!id) continue;
    const std::string path = entry.path().string() + "/spec";
    auto bad = [&](const std::string& why) {
      return left_file_error(entry.path().string(), "the table file " + path + " " + why);
    };
    SpecFile f{};
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw bad("cannot be opened: " + errno_text());
    const ssize_t got = ::read(fd, &f, sizeof f);
    char extra;
    const ssize_t more = got == static_cast<ssize_t>(sizeof f) ? ::read(fd, &extra, 1) : 0;
    ::close(fd);
    if (got != static_cast<ssize_t>(sizeof f) || more != 0) throw bad("is not " + std::to_string(sizeof f) + " bytes");
    if (std::memcmp(f.magic, kSpecMagic, sizeof kSpecMagic) != 0) throw bad("is not a pskv table spec");
    if (f.crc != crc32_update(0, &f, offsetof(SpecFile, crc))) throw bad("fails its CRC");
    if (f.id != *id || f.id >= kMaxTables) throw bad("names table " + std::to_string(f.id));
    LeftTable t;
    t.id = f.id;
    t.max_rows = f.max_rows;
    t.dir = entry.path().string();
    std::string why;
    if (wire::decode_table_spec(f.spec, &t.requested, &why) != Errc::ok) throw bad("holds a bad spec: " + why);
    out.push_back(std::move(t));
  }
  std::sort(out.begin(), out.end(), [](const LeftTable& a, const LeftTable& b) { return a.id < b.id; });
  return out;
}

EmbeddingTable::LeftRows read_left_rows(const LeftTable& table,
                                        const std::function<void(Key, const float*, const float*)>& visit) {
  std::unique_ptr<MappedFile> undo;
  std::vector<std::unique_ptr<MappedFile>> files;
  std::vector<std::span<std::byte>> segments;
  try {
    undo = MappedFile::open(table.dir + "/undo");
    for (const auto& [index, path] : segment_files(table.dir)) {
      files.push_back(MappedFile::open(path));
      if (segments.size() <= index) segments.resize(std::size_t{index} + 1);
      segments[index] = {files.back()->data(), files.back()->size()};
    }
  } catch (const std::exception& e) {
    throw left_file_error(table.dir, e.what());
  }
  TableSpec spec = table.requested;
  spec.max_rows = table.max_rows;
  try {
    return EmbeddingTable::recover_rows(spec, segments, {undo->data(), undo->size()}, visit);
  } catch (const Error& e) {
    throw left_file_error(table.dir, std::string("its rows do not match its spec: ") + e.what());
  }
}

}  // namespace pskv::shm

#include "transport/shm/segment.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "layout/clock_table.h"
#include "pskv/error.h"

namespace bip = boost::interprocess;

namespace pskv::shm {

namespace {
constexpr std::uint64_t kSegmentMagic = 0x474553564b53502eULL;  // ".PSKVSEG"
// 2: ClientArea::client_polling, 3: SegmentHeader::spinners, 4: ClientArea::waiters_sleeping, waiter_word,
// 5: ClientArea::undo, worker_pushes, SegmentHeader::worker_push, recovered_pushes
// 6: accepting and closing
constexpr std::uint32_t kLayoutVersion = 7;  // 7: server_undo

class RegionView final : public MemoryResource {
 public:
  RegionView(std::byte* p, std::size_t n) : p_(p), n_(n) {}
  std::byte* data() noexcept override { return p_; }
  std::size_t size() const noexcept override { return n_; }

 private:
  std::byte* p_;
  std::size_t n_;
};

// Opens the object and maps all of it through Boost.Interprocess, MAP_NORESERVE: a store of
// hundreds of MiB is backed by pages only as they are touched, and a full /dev/shm then fails
// those writes, not the mapping. The server (create) sizes it first.
bip::mapped_region map_object(const std::string& object, std::size_t size, bool create, ino_t* inode) {
  const std::string path = "/dev/shm" + object;
  bip::shared_memory_object shm;
  try {
    shm = bip::shared_memory_object(bip::open_only, object.c_str(), bip::read_write);
  } catch (const bip::interprocess_exception& e) {
    throw Error(Errc::io, "cannot open " + path + ": " + e.what());
  }
  struct stat st {};
  if (::fstat(shm.get_mapping_handle().handle, &st) == 0) *inode = st.st_ino;
  if (create) {
    try {
      shm.truncate(static_cast<bip::offset_t>(size));
    } catch (const bip::interprocess_exception& e) {
      throw Error(Errc::capacity, "cannot size shared memory " + path + " to " + std::to_string(size >> 20) +
                                      " MiB: " + e.what() + " (is /dev/shm large enough?)");
    }
  }
  bip::mapped_region region;
  try {
    region = bip::mapped_region(shm, bip::read_write, 0, size, nullptr, MAP_NORESERVE);
  } catch (const bip::interprocess_exception& e) {
    throw Error(Errc::io, "cannot map " + path + ": " + e.what());
  }
  // Random lookups in a large store miss the TLB on nearly every key with 4 KiB pages (sparse
  // pulls from 2 clients: 12-16 M keys/s, with 2 MiB pages 16-23 M). Takes effect where the
  // admin allows it for /dev/shm (mount -o remount,huge=advise /dev/shm); harmless elsewhere.
  // (mapped_region::advise has no huge-page advice.)
  ::madvise(region.get_address(), size, MADV_HUGEPAGE);
  return region;
}
}  // namespace

std::string segment_object_name(const std::string& name) {
  return "/pskv-" + name;
}

Errc decode_entry(const RingEntry& e, const std::byte* area, std::uint64_t area_bytes,
                  std::vector<wire::KeyEntry>* keys, const float** payload, wire::Op* op_out, std::string* why,
                  std::uint64_t* data_bytes_out) {
  // Read each field once: the client can change them under us.
  const std::uint64_t data_offset = e.data_offset, data_bytes = e.data_bytes, payload_bytes = e.payload_bytes;
  const std::uint32_t num_keys = e.num_keys;
  const std::uint16_t op = e.op;
  const std::uint64_t key_bytes = std::uint64_t{num_keys} * sizeof(wire::KeyEntry);
  if (data_offset % 64 != 0 || data_offset > area_bytes || data_bytes > area_bytes - data_offset ||
      key_bytes > data_bytes || payload_bytes > data_bytes - key_bytes) {
    *why = "ring entry points outside the client's data area";
    return Errc::protocol;
  }
  if (wire::op_name(op) == "unknown") {
    *why = "unknown op " + std::to_string(op);
    return Errc::protocol;
  }
  const std::byte* data = area + data_offset;
  keys->resize(num_keys);
  if (key_bytes) std::memcpy(keys->data(), data, key_bytes);
  *payload = reinterpret_cast<const float*>(data + key_bytes);
  *op_out = static_cast<wire::Op>(op);
  if (data_bytes_out) *data_bytes_out = data_bytes;  // as checked: the entry's word may have changed since
  const wire::FrameHeader h = wire::make_header(*op_out, e.seq, num_keys, payload_bytes, e.arg0);
  if (!wire::op_carries_values(*op_out) && payload_bytes != 0) {
    *why = std::string(wire::op_name(op)) + " carries no payload";
    return Errc::protocol;
  }
  return wire::validate_keys(h, *keys, why);
}

namespace {
struct ProcessStat {
  char state = 0;  // 0: no such process
  std::uint64_t start_time = 0;
};

ProcessStat read_process_stat(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return {};
  // Fields 3 (state) and 22 (starttime); skip past the parenthesised command name, which may
  // contain spaces.
  const auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return {};
  ProcessStat out;
  out.state = stat[close + 2];
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i)
    if (i == 22) out.start_time = std::stoull(field);
  return out;
}
}  // namespace

std::uint64_t process_start_time(pid_t pid) {
  return read_process_stat(pid).start_time;
}

bool process_alive(pid_t pid, std::uint64_t start_time) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno != EPERM) return false;
  // A killed process that its parent has not reaped yet is a zombie: it holds nothing and will
  // never run again, so what it left must be repaired now, not when the parent gets round to it.
  const ProcessStat st = read_process_stat(pid);
  if (st.state == 'Z' || st.state == 'X') return false;
  return start_time == 0 || st.start_time == start_time;
}

std::unique_ptr<Segment> Segment::create(const std::string& name, const SegmentConfig& c) {
  if (c.server_threads == 0 || c.server_threads > kMaxServerThreads)
    throw Error(Errc::invalid_argument, "shm server threads must be 1.." + std::to_string(kMaxServerThreads));
  if (c.clients == 0 || c.clients > 4096)
    throw Error(Errc::invalid_argument, "shm clients (client areas) must be 1..4096");
  const std::string object = segment_object_name(name);

  SegmentHeader layout{};
  layout.clock_offset = align_up(sizeof(SegmentHeader), 4096);
  const std::size_t clock_bytes = c.num_workers ? ClockTable::bytes_for(c.num_workers) : 0;
  layout.areas_offset = align_up(layout.clock_offset + clock_bytes, 4096);
  layout.area_stride = align_up(sizeof(ClientArea) + c.area_bytes, 4096);
  layout.store_offset = align_up(layout.areas_offset + std::uint64_t{c.clients} * layout.area_stride, 4096);
  layout.store_bytes = c.store_bytes;
  // Each server thread's undo buffer holds the largest value a ring entry can carry (its whole
  // data area) with that value's optimizer state.
  const std::uint64_t undo_offset = align_up(layout.store_offset + c.store_bytes, 4096);
  const std::uint64_t undo_bytes =
      c.server_undo ? align_up(c.area_bytes * (1 + std::uint64_t{c.state_per_value}), 4096) : 0;
  layout.total_bytes = undo_offset + std::uint64_t{c.server_threads} * undo_bytes;

  for (int attempt = 0;; ++attempt) {
    try {
      bip::shared_memory_object shm(bip::create_only, object.c_str(), bip::read_write, bip::permissions(0600));
      break;
    } catch (const bip::interprocess_exception&) {
      if (attempt > 0) throw Error(Errc::io, "cannot create shared memory " + object);
    }
    // The name exists. Reclaim it only if it is ours and its server is dead.
    std::unique_ptr<Segment> old;
    try {
      old = open(name);
    } catch (const Error& e) {
      // Only a complete pskv segment whose server is dead is reclaimed; anything else (another
      // program's object, or a server still laying it out) is reported, never deleted.
      if (e.code() != Errc::stale_resource)
        throw Error(Errc::stale_resource, "shared memory " + object + " exists but is not a usable pskv segment (" +
                                              e.what() + "); remove /dev/shm" + object + " if no job uses it");
    }
    if (old)
      throw Error(Errc::stale_resource, "shm://" + name + " is in use by a running pskv-server (pid " +
                                            std::to_string(old->header().server_pid) +
                                            "); pick another name for this job");
    bip::shared_memory_object::remove(object.c_str());
  }

  auto seg = std::unique_ptr<Segment>(new Segment());
  seg->name_ = name;
  seg->owner_ = true;
  seg->geo_ = SegmentGeometry{c.num_workers,
                              c.clients,
                              c.server_threads,
                              c.area_bytes,
                              layout.clock_offset,
                              layout.areas_offset,
                              layout.area_stride,
                              layout.store_offset,
                              layout.store_bytes,
                              layout.total_bytes,
                              undo_offset,
                              undo_bytes,
                              c.mode,
                              c.worker_push,
                              c.staleness,
                              c.sync_required,
                              c.wait_timeout_ms};
  try {
    seg->region_ = std::make_unique<bip::mapped_region>(map_object(object, layout.total_bytes, true, &seg->inode_));
    seg->base_ = static_cast<std::byte*>(seg->region_->get_address());
  } catch (...) {
    bip::shared_memory_object::remove(object.c_str());
    throw;
  }
  auto& h = *new (seg->base_) SegmentHeader{};
  h.layout_version = kLayoutVersion;
  h.server_pid = ::getpid();
  h.server_start = process_start_time(h.server_pid);
  h.job_nonce = std::random_device{}() | (std::uint64_t{std::random_device{}()} << 32);
  h.num_workers = c.num_workers;
  h.clients = c.clients;
  h.server_threads = c.server_threads;
  h.mode = static_cast<std::uint8_t>(c.mode);
  h.worker_push = c.worker_push ? 1 : 0;
  h.staleness = c.staleness;
  h.sync_required = c.sync_required;
  h.wait_timeout_ms = c.wait_timeout_ms;
  h.area_bytes = c.area_bytes;
  h.clock_offset = layout.clock_offset;
  h.areas_offset = layout.areas_offset;
  h.area_stride = layout.area_stride;
  h.store_offset = layout.store_offset;
  h.store_bytes = layout.store_bytes;
  h.total_bytes = layout.total_bytes;
  h.server_undo_offset = undo_offset;
  h.server_undo_bytes = undo_bytes;
  seg->geo_.server_pid = h.server_pid;
  seg->geo_.server_start = h.server_start;
  for (std::uint32_t i = 0; i < c.clients; ++i) new (&seg->area(i)) ClientArea{};
  std::atomic_ref<std::uint64_t>(h.magic).store(kSegmentMagic, std::memory_order_release);
  return seg;
}

std::unique_ptr<Segment> Segment::open(const std::string& name) {
  return open_checked(name, true);
}

std::unique_ptr<Segment> Segment::open_left_by_dead_server(const std::string& name) {
  return open_checked(name, false);
}

std::unique_ptr<Segment> Segment::open_checked(const std::string& name, bool server_must_live) {
  const std::string object = segment_object_name(name);
  std::size_t size = 0;
  try {
    bip::shared_memory_object shm(bip::open_only, object.c_str(), bip::read_write);
    bip::offset_t n = 0;
    shm.get_size(n);
    size = static_cast<std::size_t>(n);
  } catch (const bip::interprocess_exception&) {
    if (!server_must_live) return nullptr;
    throw Error(Errc::peer_failure, "no pskv server at shm://" + name + " (/dev/shm" + object +
                                        " does not exist); start pskv-server --uri shm://" + name + " first");
  }
  if (size < sizeof(SegmentHeader)) throw Error(Errc::protocol, "shm://" + name + " is too small to be a pskv segment");
  auto seg = std::unique_ptr<Segment>(new Segment());
  seg->name_ = name;
  seg->region_ = std::make_unique<bip::mapped_region>(map_object(object, size, false, &seg->inode_));
  seg->base_ = static_cast<std::byte*>(seg->region_->get_address());
  auto& h = seg->header();
  if (std::atomic_ref<std::uint64_t>(h.magic).load(std::memory_order_acquire) != kSegmentMagic ||
      h.layout_version != kLayoutVersion || h.total_bytes > size)
    throw Error(Errc::protocol, "shm://" + name + " does not hold a pskv segment of this version");
  const bool alive = process_alive(h.server_pid, h.server_start);
  if (server_must_live && !alive)
    throw Error(Errc::stale_resource, "shm://" + name + " was left by pskv-server pid " + std::to_string(h.server_pid) +
                                          ", which is no longer running; restart the server (it reclaims the name)");
  if (!server_must_live && alive)
    throw Error(Errc::stale_resource, "shm://" + name + " is in use by a running pskv-server (pid " +
                                          std::to_string(h.server_pid) +
                                          "); stop it before another adopts its segment");
  // One copy of the header, checked once: every later access goes through it, so a process
  // that rewrites the header afterwards cannot move this client's accesses.
  SegmentGeometry g;
  g.num_workers = h.num_workers;
  g.clients = h.clients;
  g.server_threads = h.server_threads;
  g.area_bytes = h.area_bytes;
  g.clock_offset = h.clock_offset;
  g.areas_offset = h.areas_offset;
  g.area_stride = h.area_stride;
  g.store_offset = h.store_offset;
  g.store_bytes = h.store_bytes;
  g.total_bytes = h.total_bytes;
  g.server_undo_offset = h.server_undo_offset;
  g.server_undo_bytes = h.server_undo_bytes;
  g.mode = static_cast<ConsistencyMode>(h.mode);
  g.worker_push = h.worker_push != 0;
  g.staleness = h.staleness;
  g.sync_required = h.sync_required;
  g.wait_timeout_ms = h.wait_timeout_ms;
  g.server_pid = h.server_pid;
  g.server_start = h.server_start;
  const std::uint64_t clock_bytes = g.num_workers ? ClockTable::bytes_for(g.num_workers) : 0;
  const bool sane =
      g.clients >= 1 && g.clients <= 4096 && g.server_threads >= 1 && g.server_threads <= kMaxServerThreads &&
      g.mode <= ConsistencyMode::sync && g.num_workers <= kMaxWorkers && g.clock_offset >= sizeof(SegmentHeader) &&
      g.clock_offset <= size && g.areas_offset <= size &&  // so that no sum below wraps back into the region
      g.clock_offset % 64 == 0 && g.areas_offset % 64 == 0 && g.area_stride % 64 == 0 && g.store_offset % 64 == 0 &&
      g.areas_offset >= g.clock_offset + clock_bytes && g.area_bytes <= (1ull << 40) &&
      g.area_stride >= sizeof(ClientArea) + g.area_bytes && g.area_stride <= (1ull << 41) &&
      g.store_offset >= g.areas_offset + std::uint64_t{g.clients} * g.area_stride && g.store_bytes <= size &&
      g.store_offset <= size - g.store_bytes && g.total_bytes <= size && g.server_undo_offset % 64 == 0 &&
      g.server_undo_bytes % 64 == 0 && g.server_undo_bytes <= (1ull << 44) &&
      g.server_undo_offset >= g.store_offset + g.store_bytes && g.server_undo_offset <= size &&
      std::uint64_t{g.server_threads} * g.server_undo_bytes <= size - g.server_undo_offset;
  if (!sane)
    throw Error(Errc::protocol, "shm://" + name + " has a segment header that does not describe its own mapping");
  seg->geo_ = g;
  return seg;
}

Segment::~Segment() = default;

std::unique_ptr<MemoryResource> Segment::store_memory() {
  return std::make_unique<RegionView>(base_ + geo_.store_offset, geo_.store_bytes);
}

bool Segment::server_alive() {
  if (!process_alive(geo_.server_pid, geo_.server_start)) return false;
  if (std::atomic_ref<std::int32_t>(header().server_pid).load(std::memory_order_acquire) != 0) return true;
  struct stat st {};
  return ::stat(("/dev/shm/" + segment_object_name(name_).substr(1)).c_str(), &st) == 0 && st.st_ino == inode_;
}

void Segment::remove() {
  bip::shared_memory_object::remove(segment_object_name(name_).c_str());
}

}  // namespace pskv::shm

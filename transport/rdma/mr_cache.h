// The client's registration cache: buffers announced with Connection::register_buffer() are
// registered once (LOCAL_WRITE, so pulls may land in them) and found again by address.
//
// Only announced buffers are cached. A buffer used without announcement is registered on the
// fly for that one request and deregistered when it completes (or, when small, copied through
// the request's registered staging buffer instead): caching it would be unsafe, because once
// the caller frees it, a later allocation at the same virtual address gets new pages while the
// cached registration still pins, and the NIC still uses, the old ones: silently wrong data.
// An announced buffer must stay mapped while the connection lives.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace pskv::rdma {

// Thread-safety: all members may be called concurrently.
class MrCache {
 public:
  explicit MrCache(ibv_pd* pd) : pd_(pd) {}
  ~MrCache();
  MrCache(const MrCache&) = delete;
  MrCache& operator=(const MrCache&) = delete;

  // Registers [data, data + bytes), merged with any cached range it overlaps or touches.
  // Throws Error(permission) with the memlock fix, or Error(io).
  void add(const void* data, std::size_t bytes);
  // The lkey of a cached registration covering the whole range, or 0 if none does.
  std::uint32_t find(const void* data, std::size_t bytes) const;

 private:
  struct Entry {
    std::uintptr_t end;
    ibv_mr* mr;
  };
  ibv_pd* pd_;
  std::mutex add_mu_;
  mutable std::mutex mu_;
  std::map<std::uintptr_t, Entry> ranges_;  // by start; never overlapping
  // Registrations replaced by a merged one: requests in flight may still use their lkeys, so
  // they live until the connection closes.
  std::vector<ibv_mr*> retired_;
};

}  // namespace pskv::rdma

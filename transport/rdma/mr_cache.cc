#include "transport/rdma/mr_cache.h"

#include <cerrno>

#include "transport/rdma/verbs.h"

namespace pskv::rdma {

MrCache::~MrCache() {
  for (auto& [start, e] : ranges_) ibv_dereg_mr(e.mr);
  for (ibv_mr* mr : retired_) ibv_dereg_mr(mr);
}

void MrCache::add(const void* data, std::size_t bytes) {
  if (bytes == 0) return;
  // Adds are serialised (registration is control path); lookups only wait for the short map
  // updates, never for ibv_reg_mr, which pins pages and can take milliseconds.
  std::lock_guard add_lock(add_mu_);
  if (find(data, bytes) != 0) return;
  auto start = reinterpret_cast<std::uintptr_t>(data);
  auto end = start + bytes;
  {
    std::lock_guard lock(mu_);
    auto it = ranges_.upper_bound(start);
    if (it != ranges_.begin() && std::prev(it)->second.end >= start) --it;
    for (; it != ranges_.end() && it->first <= end; ++it) {
      start = std::min(start, it->first);
      end = std::max(end, it->second.end);
    }
  }
  ibv_mr* mr = ibv_reg_mr(pd_, reinterpret_cast<void*>(start), end - start, IBV_ACCESS_LOCAL_WRITE);
  if (!mr) throw_registration_error(errno, end - start, "a buffer passed to register_buffer()");
  std::lock_guard lock(mu_);
  for (auto it = ranges_.lower_bound(start); it != ranges_.end() && it->first <= end;) {
    retired_.push_back(it->second.mr);
    it = ranges_.erase(it);
  }
  ranges_.emplace(start, Entry{end, mr});
}

std::uint32_t MrCache::find(const void* data, std::size_t bytes) const {
  const auto start = reinterpret_cast<std::uintptr_t>(data);
  std::lock_guard lock(mu_);
  auto it = ranges_.upper_bound(start);
  if (it == ranges_.begin()) return 0;
  --it;  // ranges never overlap: only the last one starting at or before `start` can cover
  return start + bytes <= it->second.end ? it->second.mr->lkey : 0;
}

}  // namespace pskv::rdma

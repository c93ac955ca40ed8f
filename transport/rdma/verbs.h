// Control-path helpers shared by the RDMA client and server: process setup (fork safety),
// device discovery and the one-line log of the device/port/GID in use, pinned buffers and memory
// registration with errors that say what to do, and rdma_cm event waits bounded by a deadline.
// Nothing here is on the hot path.
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "pskv/error.h"
#include "transport/uri.h"

namespace pskv::rdma {

using Deadline = std::chrono::steady_clock::time_point;

// Makes verbs safe across fork() before the first verbs object exists: the tests and launchers
// fork workers after a process has connected. ibv_fork_init() marks registered memory
// MADV_DONTFORK so a child's copy-on-write cannot move pages under the NIC; on kernels >= 5.13,
// which copy pinned pages at fork themselves, rdma-core makes it a no-op. Setting
// RDMAV_FORK_SAFE=1 in the environment has the same effect. Idempotent and thread-safe.
void prepare_process();

// Throws Error(no_device) with the fix when this process sees no RDMA device at all.
void require_device(const std::string& endpoint);

// The endpoint options a URI may carry: dev=NAME, port=N, gid=INDEX (checked against what
// rdma_cm resolved the address to) and poll=busy|event. Throws invalid_argument on anything else.
struct EndpointParams {
  std::string device;
  int port = -1;
  int gid_index = -1;
  bool busy_poll = false;
};
EndpointParams parse_params(const Uri& uri);

// rdma_cm routes by IP address, so the address picks the device and port. This checks the
// requested dev/port/gid against that choice (an explicit mismatch is an error naming both) and
// logs the choice to stderr once per process and device/port/GID.
// `ctx` is the caller's own context on that device (queries go through it).
void check_and_log_device(rdma_cm_id* id, ibv_context* ctx, const EndpointParams& want, const std::string& role,
                          const std::string& endpoint);

// Opens this process's own context on the device rdma_cm routed an id to. rdma_cm opens its
// contexts once per process and a forked child inherits them, but the kernel refuses a context
// to any process but its opener (every write()-based verbs command fails with EACCES), so each
// connection opens its own, creates its queue pair there, and drives it with move_qp().
ibv_context* open_own_context(ibv_context* cm_context);
// Moves `qp` to `state` with the attributes rdma_cm computed for `id` (path, remote QPN, PSN,
// timeouts, read depths). INIT also grants remote READ and WRITE (the MRs still decide).
void move_qp(rdma_cm_id* id, ibv_qp* qp, ibv_qp_state state, const std::string& endpoint);

// Resolves host:port for rdma_cm (numeric or by name). Throws invalid_argument.
sockaddr_storage resolve_host(const std::string& host, std::uint16_t port, bool passive);

// Page-aligned, zeroed anonymous memory that NICs may DMA to and from.
// Thread-safety: immutable after construction.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(std::size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

// One registered memory region. ibv_reg_mr's ENOMEM/EPERM become Errc::permission with the
// memlock fix; `what` names the memory in messages. Thread-safety: immutable after construction.
class MemoryRegion {
 public:
  MemoryRegion() = default;
  MemoryRegion(ibv_pd* pd, void* addr, std::size_t bytes, int access, const std::string& what);
  ~MemoryRegion();
  MemoryRegion(MemoryRegion&& o) noexcept : mr_(o.mr_) { o.mr_ = nullptr; }
  MemoryRegion& operator=(MemoryRegion&& o) noexcept;
  ibv_mr* get() const noexcept { return mr_; }
  std::uint32_t lkey() const noexcept { return mr_->lkey; }
  std::uint32_t rkey() const noexcept { return mr_->rkey; }

 private:
  ibv_mr* mr_ = nullptr;
};

// Registration failures share this text (also used by the client's registration cache).
[[noreturn]] void throw_registration_error(int err, std::size_t bytes, const std::string& what);

// A pinned buffer and its registration, released in reverse order.
struct RegisteredBuffer {
  PinnedBuffer buffer;
  MemoryRegion mr;
  RegisteredBuffer() = default;
  RegisteredBuffer(ibv_pd* pd, std::size_t bytes, int access, const std::string& what)
      : buffer(bytes), mr(pd, buffer.data(), bytes, access, what) {}
  std::byte* data() const noexcept { return buffer.data(); }
  std::size_t size() const noexcept { return buffer.size(); }
};

// Waits for the next rdma_cm event until `deadline`: nullptr on timeout. The caller acks it.
// The channel's fd must be non-blocking. Throws Error(peer_failure) once *cancel (if given) is
// true, looked at every 50 ms.
rdma_cm_event* next_cm_event(rdma_event_channel* channel, Deadline deadline, const std::atomic<bool>* cancel = nullptr);

// An Error's message without the "pskv <code>: " prefix, for passing it on inside another error.
std::string message_of(const Error& e);

void set_nonblocking(int fd);
std::string errno_text(int err);
// "RETRY_EXC_ERR (transport retry counter exceeded)" and the like.
std::string wc_text(const ibv_wc& wc);

}  // namespace pskv::rdma

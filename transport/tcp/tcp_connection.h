// Client side of the TCP backend: one pipelined connection to one server. Requests go out with
// one sendmsg of [header | key table | the caller's value buffers]; a receiver thread reads each
// reply header and readv()s pull payloads straight into the caller's buffers.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <sys/uio.h>

#include "transport/tcp/socket.h"
#include "transport/transport.h"

namespace pskv::tcp {

// Thread-safety: submit() from any number of threads (sends are serialised by a mutex); one
// internal receiver thread completes requests.
class TcpConnection final : public transport::Connection {
 public:
  TcpConnection(const Uri& uri, const transport::ConnectOptions& options);
  ~TcpConnection() override;

  void submit(transport::Request& request) override;
  const transport::ServerInfo& info() const noexcept override { return info_; }
  const std::string& endpoint() const noexcept override { return endpoint_; }

 private:
  struct Slot {
    transport::Request* request = nullptr;
    std::uint64_t id = 0;
  };
  void handshake();
  wire::FrameHeader read_handshake_reply(const char* step);
  // Writes the request's frame (header, key table, values) under send_mu_.
  IoResult send_request(std::uint64_t id, const transport::Request& request, std::uint16_t flags);
  void receive_loop();
  bool receive_one(const wire::FrameHeader& h, std::string* why);
  void fail_all(Errc status, const std::string& why);
  // Returns the slot's index (UINT32_MAX once broken) and its request id in *id.
  std::uint32_t acquire_slot(transport::Request* request, std::uint64_t* id);
  void release_slot(std::uint32_t index);

  transport::ConnectOptions options_;
  std::string endpoint_;
  transport::ServerInfo info_;
  Fd fd_;

  std::mutex send_mu_;
  std::vector<iovec> iov_;

  std::mutex slots_mu_;
  std::condition_variable slot_free_;
  std::vector<Slot> slots_;
  std::vector<std::uint32_t> free_;
  std::uint64_t next_generation_ = 1;
  bool broken_ = false;
  bool send_broken_ = false;  // the server closed while we sent; replies may still be read
  std::string broken_why_;

  std::vector<iovec> recv_iov_;
  std::thread receiver_;
};

}  // namespace pskv::tcp

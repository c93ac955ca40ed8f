#include "support/requests.h"

namespace pskv::testing {

Answer ask(std::shared_ptr<transport::Connection>& conn, wire::Op op, std::uint64_t arg0, std::uint32_t arg1,
           std::span<const transport::KeySlice> keys, std::chrono::seconds limit) {
  std::string text;
  transport::Completion done;
  done.reset(1);
  transport::Request q;
  q.op = op;
  q.arg0 = arg0;
  q.arg1 = arg1;
  q.keys = keys;
  q.completion = &done;
  q.text_out = &text;
  conn->submit(q);
  // A backend whose answers are taken by polling (shm) gets its poller driven meanwhile.
  if (!done.wait(std::chrono::steady_clock::now() + limit, conn->poller())) {
    conn.reset();
    return {Errc::timeout, "no answer"};
  }
  if (done.status() != Errc::ok) return {done.status(), std::string(done.message())};
  return {Errc::ok, std::move(text)};
}

}  // namespace pskv::testing

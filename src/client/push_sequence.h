// The identities a retrying client gives its pushes: a random session and a sequence number
// (docs/protocol.md, "Replication"). A replicated server keeps, per key and worker, the
// (session, seq) of the newest push applied and skips a push sent again that is at or before it
// (compared modulo 2^32). Numbers must therefore never wrap around onto a mark still held: past
// kRotateSeq pushes the session is replaced, at the first push issued while none of the current
// session's may still be sent again; past kLastSeq without such a moment, pushes are refused.
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "pskv/error.h"

namespace pskv::detail {

// Thread-safety: none; the client calls it under the lock that orders its submissions.
class PushSequence {
 public:
  static constexpr std::uint32_t kRotateSeq = 1u << 30, kLastSeq = (1u << 31) - 1;

  // `last_seq`: the number the first push follows (tests start near the thresholds).
  explicit PushSequence(std::uint32_t last_seq = 0) : session_(new_session(0)), seq_(last_seq) {}

  // The next push's sequence number (session() is its session). `may_be_sent_again()` says
  // whether a push of the current session is unanswered or lost with its connection; it is
  // asked only past kRotateSeq. Throws Error(capacity) past kLastSeq while it stays true.
  template <class MayBeSentAgain>
  std::uint32_t next(MayBeSentAgain&& may_be_sent_again) {
    if (seq_ >= kRotateSeq && !may_be_sent_again()) {
      session_ = new_session(session_);
      seq_ = 0;
    }
    if (seq_ >= kLastSeq)
      throw Error(Errc::capacity,
                  "2^31 pushes were issued while earlier ones of this client stayed unanswered; wait() for them");
    return ++seq_;
  }
  std::uint32_t session() const noexcept { return session_; }

 private:
  static std::uint32_t new_session(std::uint32_t old) {
    static thread_local std::random_device entropy;
    std::uint32_t s = 0;
    while (s == 0 || s == old) s = entropy();
    return s;
  }
  std::uint32_t session_;
  std::uint32_t seq_;
};

}  // namespace pskv::detail

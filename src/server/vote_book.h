// A server's votes on failover certificates, and the certificates it knows to have won, kept in a
// file so that a restarted server never votes twice on the same question (docs/ARCHITECTURE.md,
// "Failover").
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "pskv/error.h"
#include "transport/wire.h"

namespace pskv {

// One entry per server id: the last certificate this server granted about it (or learned won).
// The rules, which make at most one holder win for each incarnation of a server, and make a
// server certified down unable to win anything:
// - a requester, or a holder, that some granted certificate names as taken over is refused
//   (stale_resource for the requester: it is down, and learns it from this refusal);
// - a takeover of server X (holder != X) is granted if nothing was granted about X, if the same
//   takeover was (a retry, or a second requester), or if X's last claim is of an incarnation no
//   later than the one asked about; another holder is refused (permission) unless the one
//   granted is down itself, and so is an incarnation that a later one's claim replaced
//   (not_found);
// - a restarted X's claim of its own keys (holder == X == requester) is granted unless a takeover
//   of X was granted;
// - a hand-back (holder == X, requested by another server) is granted to the holder the last
//   takeover of X named, for a later incarnation of X than that takeover's, or when nothing
//   moved X's keys;
// - an announcement of a takeover of an incarnation that a later claim replaced is ignored.
// Thread-safety: every member from any thread.
class VoteBook {
 public:
  // Reads `path` when it exists (an empty path: nothing is kept, for tests). Throws Error when
  // it cannot be read or parsed, or names a server past `servers` (the ring's size): a voter
  // that forgot or misread its votes could grant two holders.
  explicit VoteBook(std::string path, std::uint32_t servers = UINT32_MAX);
  // Writes the file as it stands: throws Error(io) if it cannot be kept (checked at start, not
  // at the first vote).
  void check_writable();
  // Whether the file was there when this book was made: the server ran before in this ring.
  bool existed() const noexcept { return existed_; }
  // This server's incarnation at its latest start (0: none recorded). A restart's incarnation
  // must be later (ShardEngine's EngineOptions::min_incarnation), even within the same second.
  std::uint32_t last_start() const noexcept { return last_start_; }
  // Records this start (written to the file before it returns; throws Error(io) if it cannot be).
  void record_start(std::uint32_t incarnation);

  // Grants (recorded, and written to the file, before it returns) or refuses with *why.
  Errc vote(const wire::Certificate& c, std::uint32_t requester, std::string* why);
  // A majority granted `c`: recorded as won.
  Errc certified(const wire::Certificate& c, std::string* why);
  // Every certificate known to have won.
  std::vector<wire::Certificate> won() const;
  // The takeover of `server` granted or won here, if any.
  std::optional<wire::Certificate> takeover_of(std::uint32_t server) const;
  bool won_takeover_of(std::uint32_t server) const;
  // The incarnation of `server`'s last claim of its own keys granted here; 0 if the last
  // entry about it is a takeover, or there is none.
  std::uint32_t claimed_incarnation(std::uint32_t server) const;

 private:
  struct Entry {
    wire::Certificate c;
    bool won = false;
  };
  bool taken_over(std::uint32_t server) const;  // under mu_
  void save();                                  // under mu_; throws Error(io)

  std::string path_;
  bool existed_ = false;
  std::uint32_t last_start_ = 0;  // under mu_ once constructed
  mutable std::mutex mu_;
  std::map<std::uint32_t, Entry> entries_;
};

}  // namespace pskv

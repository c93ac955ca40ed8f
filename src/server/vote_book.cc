#include "server/vote_book.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <sstream>

namespace pskv {
namespace {
[[noreturn]] void io_fail(const std::string& what, const std::string& path) {
  throw Error(Errc::io, what + " " + path + ": " + std::strerror(errno));
}
}  // namespace

namespace {
// One whitespace-separated number of a vote line, whole: no sign, no rest, within `max`.
bool number(std::istringstream& fields, std::uint64_t max, std::uint64_t* out) {
  std::string word;
  if (!(fields >> word)) return false;
  const auto [end, ec] = std::from_chars(word.data(), word.data() + word.size(), *out);
  return ec == std::errc() && end == word.data() + word.size() && *out <= max;
}
}  // namespace

VoteBook::VoteBook(std::string path, std::uint32_t servers) : path_(std::move(path)) {
  if (path_.empty()) return;
  std::ifstream in(path_);
  if (!in) {
    if (errno == ENOENT) return;
    io_fail("cannot read the failover votes in", path_);
  }
  existed_ = true;
  // One line per server: "server incarnation holder won uri", uri "-" when none; and
  // "start incarnation", this server's latest start.
  // Every word is checked: a flipped digit that still parsed could name another holder.
  std::string line;
  std::uint64_t at = 0;
  const auto malformed = [&](const std::string& why) {
    return Error(Errc::protocol, "line " + std::to_string(at) + " of the failover votes in " + path_ + " " + why +
                                     "; the file is written by pskv-server alone: restore it, or remove it and "
                                     "restart every server of the ring");
  };
  const std::uint64_t last_server = std::uint64_t{servers} - 1;
  while (std::getline(in, line)) {
    ++at;
    std::istringstream fields(line);
    std::string rest;
    std::uint64_t v[4] = {};
    if (line.rfind("start ", 0) == 0) {
      fields >> rest;
      // UINT32_MAX would wrap the next start's incarnation (last + 1) to 0.
      if (!number(fields, UINT32_MAX - 1, &v[0]) || (fields >> rest)) throw malformed("is malformed");
      last_start_ = static_cast<std::uint32_t>(v[0]);
      continue;
    }
    Entry e;
    std::string uri;
    if (!number(fields, last_server, &v[0]) || !number(fields, UINT32_MAX, &v[1]) ||
        !number(fields, last_server, &v[2]) || !number(fields, 1, &v[3]) || !(fields >> uri) || (fields >> rest))
      throw malformed("is malformed, or names a server past the ring's " + std::to_string(servers));
    e.c.server = static_cast<std::uint32_t>(v[0]);
    e.c.incarnation = static_cast<std::uint32_t>(v[1]);
    e.c.holder = static_cast<std::uint32_t>(v[2]);
    e.won = v[3] == 1;
    if (uri != "-") e.c.uri = uri;
    if (!entries_.emplace(e.c.server, e).second) throw malformed("is a second entry of server " + std::to_string(v[0]));
  }
  if (in.bad() || !in.eof()) io_fail("cannot read the failover votes in", path_);  // a short book forgets votes
}

void VoteBook::check_writable() {
  std::lock_guard lock(mu_);
  save();
}

void VoteBook::record_start(std::uint32_t incarnation) {
  std::lock_guard lock(mu_);
  last_start_ = incarnation;
  save();
}

void VoteBook::save() {
  if (path_.empty()) return;
  std::string text = last_start_ ? "start " + std::to_string(last_start_) + '\n' : std::string();
  for (const auto& [server, e] : entries_)
    text += std::to_string(e.c.server) + ' ' + std::to_string(e.c.incarnation) + ' ' + std::to_string(e.c.holder) +
            ' ' + (e.won ? "1 " : "0 ") + (e.c.uri.empty() ? "-" : e.c.uri) + '\n';
  const std::string tmp = path_ + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) io_fail("cannot write the failover votes to", tmp);
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      io_fail("cannot write the failover votes to", tmp);
    }
    done += static_cast<std::size_t>(n);
  }
  // The vote is answered only once it would survive a crash of this host.
  if (::fsync(fd) != 0) {
    ::close(fd);
    io_fail("cannot fsync", tmp);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path_.c_str()) != 0) io_fail("cannot rename the failover votes into place at", path_);
  const std::string dir = path_.substr(0, path_.rfind('/') == std::string::npos ? 1 : path_.rfind('/'));
  const int dfd = ::open(path_.find('/') == std::string::npos ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

bool VoteBook::taken_over(std::uint32_t server) const {
  const auto it = entries_.find(server);
  return it != entries_.end() && it->second.c.holder != server;
}

Errc VoteBook::vote(const wire::Certificate& c, std::uint32_t requester, std::string* why) {
  using std::to_string;
  std::lock_guard lock(mu_);
  if (taken_over(requester)) {
    *why = "server " + to_string(requester) + " is down: its keys were voted to server " +
           to_string(entries_.at(requester).c.holder);
    return Errc::stale_resource;
  }
  const auto it = entries_.find(c.server);
  if (c.holder == c.server) {
    if (requester != c.server) {
      // A hand-back: the holder of X's keys claims them for X's later incarnation, once it has
      // stopped serving them. A voter that never heard of a takeover grants it as X's own claim.
      const bool holder_gives_back = it != entries_.end() && it->second.c.holder == requester &&
                                     requester != c.server && c.incarnation > it->second.c.incarnation;
      const bool nothing_moved =
          it == entries_.end() || (it->second.c.holder == c.server && c.incarnation >= it->second.c.incarnation);
      if (!holder_gives_back && !nothing_moved) {
        *why = "only server " + to_string(c.server) + ", or the server holding its keys, may claim them for it";
        return Errc::permission;
      }
    }
    // (taken_over(requester) refused X's own claim after a takeover above.)
  } else if (taken_over(c.holder)) {
    *why =
        "server " + to_string(c.holder) + ", named to hold server " + to_string(c.server) + "'s keys, is down itself";
    return Errc::permission;
  } else if (it != entries_.end()) {
    const wire::Certificate& had = it->second.c;
    // Another holder was granted X's keys: refused, unless that holder is down itself (its
    // keys, X's among them, move on to the next server of X's chain).
    if (had.holder != c.server && (had.holder != c.holder || had.incarnation != c.incarnation) &&
        !taken_over(had.holder)) {
      *why = "server " + to_string(c.server) + "'s keys were already voted to server " + to_string(had.holder);
      return Errc::permission;
    }
    if (had.holder == c.server && had.incarnation > c.incarnation) {
      *why = "server " + to_string(c.server) + " restarted (incarnation " + to_string(had.incarnation) +
             ") after the incarnation " + to_string(c.incarnation) + " this asks about";
      return Errc::not_found;
    }
  }
  Entry e{c, it != entries_.end() && it->second.won && it->second.c.holder == c.holder &&
                 it->second.c.incarnation == c.incarnation};
  // A retried or second request for the same takeover may name the holder's URI where the first
  // did not: the URI is kept once known.
  if (e.c.uri.empty() && it != entries_.end() && it->second.c.holder == c.holder) e.c.uri = it->second.c.uri;
  const std::optional<Entry> before = it != entries_.end() ? std::optional<Entry>(it->second) : std::nullopt;
  entries_[c.server] = e;
  try {
    save();
  } catch (const Error& err) {
    if (before)
      entries_[c.server] = *before;
    else
      entries_.erase(c.server);
    *why = std::string("this server could not keep its vote: ") + err.what();
    return Errc::io;
  }
  return Errc::ok;
}

Errc VoteBook::certified(const wire::Certificate& c, std::string* why) {
  std::lock_guard lock(mu_);
  // An announcement about an incarnation that a later one's claim replaced, arriving late,
  // changes nothing: the keys went back to that later incarnation.
  if (const auto it = entries_.find(c.server); it != entries_.end() && it->second.c.holder == c.server &&
                                               c.holder != c.server && it->second.c.incarnation > c.incarnation)
    return Errc::ok;
  Entry& e = entries_[c.server];
  const std::string uri = !c.uri.empty() || e.c.holder != c.holder ? c.uri : e.c.uri;
  e.c = c;
  e.c.uri = uri;
  e.won = true;
  try {
    save();
  } catch (const Error& err) {
    *why = err.what();
    return Errc::io;
  }
  return Errc::ok;
}

std::vector<wire::Certificate> VoteBook::won() const {
  std::lock_guard lock(mu_);
  std::vector<wire::Certificate> out;
  for (const auto& [server, e] : entries_)
    if (e.won) out.push_back(e.c);
  return out;
}

std::optional<wire::Certificate> VoteBook::takeover_of(std::uint32_t server) const {
  std::lock_guard lock(mu_);
  if (!taken_over(server)) return std::nullopt;
  return entries_.at(server).c;
}

std::uint32_t VoteBook::claimed_incarnation(std::uint32_t server) const {
  std::lock_guard lock(mu_);
  const auto it = entries_.find(server);
  return it != entries_.end() && it->second.c.holder == server ? it->second.c.incarnation : 0;
}

bool VoteBook::won_takeover_of(std::uint32_t server) const {
  std::lock_guard lock(mu_);
  const auto it = entries_.find(server);
  return it != entries_.end() && it->second.won && it->second.c.holder != server;
}

}  // namespace pskv

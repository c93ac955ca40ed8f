// pskv.Client and pskv.Work: the C++ client with Python's lifetimes, GIL and signals.
//
// Lifetime rule: memory handed to pskv must stay valid until its operation completes, so every
// operation's buffers are held by its Work; a Work dropped before completion hands them to its
// session ("orphans"), which spends the ticket once the operation is done. close() completes or
// cancels every operation before the C++ client goes, and only then lets the buffers go.
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "buffers.h"
#include "client_binding.h"
#include "pskv/client.h"
#include "pskv/table.h"
#include "pskv/update_rule.h"

namespace py = pybind11;

namespace pskv::python {

namespace {

using namespace std::chrono_literals;

// How often a waiting thread takes the GIL back to look for Ctrl-C (the goal is 100 ms).
constexpr auto kSignalSlice = 50ms;
// Below this many bytes, issuing an operation is quicker than handing the GIL over and back.
constexpr std::size_t kReleaseGilBytes = 64 << 10;

// One operation in flight and the memory it reads or writes.
struct Pending {
  Ticket ticket = 0;
  HeldBuffer first;
  std::vector<HeldBuffer> rest;  // only for operations over several keys
};

// `seconds` from now (None: no deadline). NaN is refused; anything past a few decades is forever.
std::chrono::steady_clock::time_point deadline_after(std::optional<double> seconds) {
  if (!seconds) return std::chrono::steady_clock::time_point::max();
  if (std::isnan(*seconds)) throw Error(Errc::invalid_argument, "timeout is NaN; pass seconds >= 0 or None");
  constexpr double kForever = 1e9;  // about 31 years, far inside the clock's range
  if (*seconds >= kForever) return std::chrono::steady_clock::time_point::max();
  return std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                std::chrono::duration<double>(std::max(0.0, *seconds)));
}

// Waits up to `slice` for `ticket`. True once it completed (and is spent), its error, if any, in
// `failure`; false if still in flight. Does not touch the GIL: callers that may block release it,
// reap_orphans (which may not let another thread into the orphan list) keeps it.
bool wait_slice(Client& client, Ticket ticket, std::chrono::milliseconds slice, std::optional<Error>& failure) {
  try {
    return client.wait_for(ticket, slice);
  } catch (const Error& e) {
    failure = e;
    return true;
  }
}

class Work;
struct Session;

enum class OpKind { init, push, pull };

enum class Waited { completed, timed_out, interrupted, closing };

// Waits for `ticket` until `deadline`, in slices with the GIL released, so that Ctrl-C is seen
// within kSignalSlice (interrupted: the Python error is set, the operation stays in flight) and
// close() from another thread is too (closing, when `watch_closing`). completed: the ticket is
// spent and its error, if any, is in `failure`. The caller holds the GIL and an ActiveCall.
Waited wait_ticket(Session& s, Ticket ticket, std::chrono::steady_clock::time_point deadline, bool watch_closing,
                   std::optional<Error>& failure);

// What a pskv.Client and its Works share. Thread-safety: every member is guarded by the GIL;
// `client` is also used without the GIL by calls counted in `active`, and close() destroys it
// only once no such call is left.
struct Session {
  // Buffers announced with register_buffer, held (and their exports) until the client goes: an
  // RDMA registration is found by address, so freed memory reused at the same address would be
  // served from the old registration's pages. Declared first, so destroyed after the client.
  std::vector<HeldBuffer> registered;
  std::unique_ptr<Client> client;
  bool closing = false;  // no new calls; set by close()
  int active = 0;        // calls that may release the GIL (Python callbacks included)
  // Set by a close() on a thread that is inside a call of this client (a signal handler, which
  // runs within the wait it interrupted): the client goes when the last call ends.
  enum class Deferred { no, finished, abandoned } deferred = Deferred::no;
  std::size_t in_flight = 0;  // operations issued and not yet completed (live Works and orphans)
  std::size_t window = 1;     // ClientOptions.max_in_flight: past it, issuing waits for room
  Work* live = nullptr;       // in-flight Works still referenced from Python (intrusive list)
  std::deque<Pending> orphans;
  // The first failure of an operation whose Work was dropped unwaited: raised by the next
  // clock(), barrier() or close() so that it is not lost.
  std::optional<Error> orphan_error;

  ~Session();
  // What a call interrupted by close() raises: a close() from inside a call (deferred) abandons
  // what is in flight rather than completing it.
  Error closing_error(const std::string& what, const char* thing) const {
    if (deferred != Deferred::no || !client)
      return Error(Errc::invalid_argument, what +
                                               ": the client was closed from inside a call (a signal handler?); this " +
                                               thing + " is abandoned, not completed");
    return Error(Errc::invalid_argument, what + ": the client is being closed; it completes this " + thing);
  }
  // Whether this thread is inside a call of this session (ActiveCall keeps the chain).
  bool active_on_this_thread() const;
  // Ends the client once a deferred close() has no call left: as close(), except that nothing
  // can be raised and nothing still in flight is waited for.
  void finish_deferred_close() noexcept;
  // Destroys the C++ client (announcing "finished" unless `disconnect`) with the GIL released,
  // fails what is still in flight and lets every buffer go: the end of close() and of a
  // deferred one.
  void end_client(bool disconnect) noexcept;
  void require_open() const {
    if (closing || !client) throw Error(Errc::invalid_argument, "this pskv.Client is closed; create a new one");
  }
  void reap_orphans();
  // The oldest orphan completed with `failure` (if any): forget it.
  void spend_orphan(const std::optional<Error>& failure);
  void raise_orphan_error() {
    if (!orphan_error) return;
    Error e = *orphan_error;
    orphan_error.reset();
    throw Error(e.code(), std::string("an operation whose Work was dropped without wait() failed: ") + e.what());
  }
};

// Counts a call that runs with the GIL released (constructed and destroyed with the GIL held).
// Each thread's calls form a chain, innermost first: close() from a signal handler runs on a
// thread inside a call of its own, which cannot end until the handler returns. Two pointer
// writes per call, where push and pull cost a few hundred ns.
class ActiveCall {
 public:
  explicit ActiveCall(Session& s) : s_(s), outer_(innermost_) {
    innermost_ = this;
    ++s_.active;
  }
  ~ActiveCall() {
    innermost_ = outer_;
    if (--s_.active == 0 && s_.deferred != Session::Deferred::no) s_.finish_deferred_close();
  }
  ActiveCall(const ActiveCall&) = delete;
  ActiveCall& operator=(const ActiveCall&) = delete;

  static bool on_this_thread(const Session& s) noexcept {
    for (const ActiveCall* c = innermost_; c; c = c->outer_)
      if (&c->s_ == &s) return true;
    return false;
  }

 private:
  Session& s_;
  ActiveCall* const outer_;
  static thread_local ActiveCall* innermost_;
};

thread_local ActiveCall* ActiveCall::innermost_ = nullptr;

bool Session::active_on_this_thread() const {
  return ActiveCall::on_this_thread(*this);
}

// Thread-safety: methods hold the GIL except while waiting; one thread waits for a Work at a time
// (a second one gets an error rather than a wait on a ticket that may already be spent).
class Work {
 public:
  Work(std::shared_ptr<Session> session, Pending pending, const char* op)
      : session_(std::move(session)), pending_(std::move(pending)), op_(op) {
    next_ = session_->live;
    if (next_) next_->prev_ = this;
    session_->live = this;
  }
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  ~Work() {
    if (state_ != State::in_flight) return;
    unlink();
    session_->orphans.push_back(std::move(pending_));
  }

  // True once complete (raising its error, if any); False if `timeout` seconds passed first.
  bool wait(std::optional<double> timeout) {
    if (state_ == State::in_flight && waiting_)
      throw Error(Errc::invalid_argument, "another thread is already waiting for this pskv.Work");
    if (state_ == State::in_flight) {
      if (session_->closing) throw session_->closing_error(op_, "operation");
      const auto deadline = deadline_after(timeout);  // validated even when not needed
      std::optional<Error> failure;
      Waited w;
      // Often already complete (an shm pull copies inside submit): spend it without handing the
      // GIL over and back, which a large operation has just done once around its submit.
      if (session_->client->done(pending_.ticket) &&
          wait_slice(*session_->client, pending_.ticket, std::chrono::milliseconds(0), failure)) {
        complete(failure);
        if (error_) throw *error_;
        return true;
      }
      {
        ActiveCall call(*session_);
        waiting_ = true;
        w = wait_ticket(*session_, pending_.ticket, deadline, /*watch_closing=*/true, failure);
        waiting_ = false;
        // Before the call ends: the last call to end may close the client (a deferred close),
        // which must find this Work completed, its ticket spent.
        if (w == Waited::completed) complete(failure);
      }
      switch (w) {
        case Waited::completed:
          break;
        case Waited::timed_out:
          return false;
        case Waited::interrupted:
          throw py::error_already_set();  // KeyboardInterrupt; still in flight
        case Waited::closing:
          throw session_->closing_error(op_, "operation");
      }
    }
    if (error_) throw *error_;
    return true;
  }

  // Does not block; drives the connection so an answer that landed completes.
  bool done() {
    if (state_ != State::in_flight) return true;
    if (waiting_ || session_->closing || !session_->client) return false;
    return session_->client->done(pending_.ticket);
  }

  // Used by close(): completes this operation on the owner's behalf.
  bool waiting() const noexcept { return waiting_; }
  Ticket ticket() const noexcept { return pending_.ticket; }
  Work* next() const noexcept { return next_; }
  void complete(const std::optional<Error>& failure) {
    --session_->in_flight;
    state_ = failure ? State::failed : State::completed;
    if (failure) error_ = failure;
    unlink();
    pending_.first.reset();
    pending_.rest.clear();
  }

 private:
  void unlink() {
    if (prev_)
      prev_->next_ = next_;
    else if (session_->live == this)
      session_->live = next_;
    if (next_) next_->prev_ = prev_;
    prev_ = next_ = nullptr;
  }

  enum class State { in_flight, completed, failed };
  std::shared_ptr<Session> session_;
  Pending pending_;
  const char* op_;
  State state_ = State::in_flight;
  bool waiting_ = false;
  std::optional<Error> error_;
  Work* prev_ = nullptr;
  Work* next_ = nullptr;
};

void Session::reap_orphans() {
  // Operations complete roughly in issue order: look at the oldest only, so this stays O(1).
  // done() first: wait_for spins briefly even with no time left.
  while (!orphans.empty() && client->done(orphans.front().ticket)) {
    std::optional<Error> failure;
    wait_slice(*client, orphans.front().ticket, 0ms, failure);
    spend_orphan(failure);
  }
}

void Session::spend_orphan(const std::optional<Error>& failure) {
  if (failure && !orphan_error) orphan_error = failure;
  orphans.pop_front();
  --in_flight;
}

Waited wait_ticket(Session& s, Ticket ticket, std::chrono::steady_clock::time_point deadline, bool watch_closing,
                   std::optional<Error>& failure) {
  Client& client = *s.client;
  for (;;) {
    // Looked at at least once, so a zero timeout still completes a finished operation.
    const auto left = std::max<std::chrono::steady_clock::duration>(std::chrono::steady_clock::duration::zero(),
                                                                    deadline - std::chrono::steady_clock::now());
    const auto slice =
        std::chrono::ceil<std::chrono::milliseconds>(std::min<std::chrono::steady_clock::duration>(kSignalSlice, left));
    bool completed;
    {
      py::gil_scoped_release unlocked;
      completed = wait_slice(client, ticket, slice, failure);
    }
    if (completed) return Waited::completed;
    if (PyErr_CheckSignals() != 0) return Waited::interrupted;
    if (watch_closing && s.closing) return Waited::closing;
    if (std::chrono::steady_clock::now() >= deadline) return Waited::timed_out;
  }
}

void Session::finish_deferred_close() noexcept {
  const bool finished = deferred == Deferred::finished;
  deferred = Deferred::no;
  // What already completed keeps its outcome; the rest is not waited for (a barrier may never
  // come from a handler's point of view). The C++ client's goodbye is bounded.
  for (Work *w = live, *next = nullptr; w; w = next) {
    next = w->next();  // complete() unlinks w
    std::optional<Error> failure;
    try {
      if (client->done(w->ticket()) && wait_slice(*client, w->ticket(), 0ms, failure)) w->complete(failure);
    } catch (const Error& e) {
      w->complete(e);
    }
  }
  end_client(/*disconnect=*/!finished);
}

void Session::end_client(bool disconnect) noexcept {
  {
    std::unique_ptr<Client> doomed = std::move(client);
    py::gil_scoped_release unlocked;
    try {
      if (disconnect) doomed->disconnect();
    } catch (const Error&) {
    }
    doomed.reset();  // announces "finished" unless disconnected; ends whatever is still in flight
  }
  while (live) live->complete(Error(Errc::invalid_argument, "the client was closed before this operation completed"));
  orphans.clear();
  in_flight = 0;
  registered.clear();
}

Session::~Session() {
  // Dropped without close(): like the C++ destructor, announce "finished" (Works hold the
  // session, so none is alive; orphans' buffers outlive the client, whose teardown ends them).
  if (client) {
    std::unique_ptr<Client> doomed = std::move(client);
    py::gil_scoped_release unlocked;
    doomed.reset();
  }
  orphans.clear();
}

Key to_key(PyObject* object, std::size_t index) {
  PyObject* number = PyNumber_Index(object);
  if (!number) {
    PyErr_Clear();
    throw Error(Errc::invalid_argument, "key " + std::to_string(index) + " is a " + Py_TYPE(object)->tp_name +
                                            "; keys are integers in [0, 2**64)");
  }
  const unsigned long long key = PyLong_AsUnsignedLongLong(number);
  const bool bad = key == static_cast<unsigned long long>(-1) && PyErr_Occurred();
  std::string text;
  if (bad) {
    PyErr_Clear();
    text = str_of(number);
  }
  Py_DECREF(number);
  if (bad) throw Error(Errc::invalid_argument, "key " + text + " is out of range: keys are integers in [0, 2**64)");
  return key;
}

// pskv.Client. Thread-safety: as the C++ client: init/push/pull and Work.wait from any thread;
// clock() and barrier() from the training loop's thread; close() from any one thread.
class PyClient {
 public:
  PyClient(const ClientOptions& options) : session_(std::make_shared<Session>()), worker_id_(options.worker_id) {
    session_->window = std::max<std::uint32_t>(1, options.max_in_flight);
    py::gil_scoped_release unlocked;
    session_->client = std::make_unique<Client>(options);
  }

  // async_op=False (torch.distributed's spelling): waits here and returns None. No Work object is
  // made, and a large operation hands the GIL over once around both its send and its wait.
  py::object issue(OpKind op, py::handle keys, py::handle values, bool async_op) {
    Session& s = *session_;
    s.require_open();
    // Reading keys and buffers runs Python code (__index__, a tensor's methods, a collection)
    // that may let another thread in, close() included: counted from here, the client stays.
    ActiveCall call(s);
    s.reap_orphans();
    const Access access = op == OpKind::pull ? Access::write : Access::read;
    const char* what = op == OpKind::pull ? "pull target" : op == OpKind::push ? "push value" : "init value";
    thread_local std::vector<Key> key_list;
    thread_local std::vector<std::span<float>> spans;
    key_list.clear();
    spans.clear();
    Pending pending;
    std::size_t bytes = 0;
    if (PyUnicode_Check(keys.ptr()) || PyBytes_Check(keys.ptr()))
      throw Error(Errc::invalid_argument,
                  std::string(what) + ": keys are integers, not " + (PyUnicode_Check(keys.ptr()) ? "str" : "bytes"));
    const bool many = PySequence_Check(keys.ptr()) && !PyLong_Check(keys.ptr());
    if (!many) {
      if (PyList_Check(values.ptr()) || PyTuple_Check(values.ptr()))
        throw Error(Errc::invalid_argument, std::string(what) + ": one key but a list of " +
                                                std::to_string(py::len(values)) +
                                                " items; pass one float32 array (lists are never converted), or a "
                                                "list of keys with one array each");
      key_list.push_back(to_key(keys.ptr(), 0));
      pending.first = HeldBuffer(values.ptr(), access, what, static_cast<std::size_t>(-1));
      spans.emplace_back(pending.first.data(), pending.first.floats());
      bytes = pending.first.floats() * sizeof(float);
    } else {
      const py::sequence key_seq = py::reinterpret_borrow<py::sequence>(keys);
      if (!PyList_Check(values.ptr()) && !PyTuple_Check(values.ptr()))
        throw Error(Errc::invalid_argument, std::to_string(py::len(key_seq)) +
                                                " keys need a list (or tuple) of as many " + what + "s, one per key");
      const py::sequence value_seq = py::reinterpret_borrow<py::sequence>(values);
      const std::size_t n = py::len(key_seq);
      if (py::len(value_seq) != n)
        throw Error(Errc::invalid_argument, std::to_string(n) + " keys but " + std::to_string(py::len(value_seq)) +
                                                " " + what + "s; pass one per key");
      if (n == 0) throw Error(Errc::invalid_argument, "no keys given");
      pending.rest.reserve(n);
      for (std::size_t i = 0; i < n; ++i) {
        key_list.push_back(to_key(py::object(key_seq[i]).ptr(), i));
        pending.rest.emplace_back(py::object(value_seq[i]).ptr(), access, what, i);
        spans.emplace_back(pending.rest.back().data(), pending.rest.back().floats());
        bytes += pending.rest.back().floats() * sizeof(float);
      }
    }
    Client& client = *s.client;
    auto submit = [&] {
      if (op == OpKind::pull) return client.pull(key_list, spans);
      // std::span<float> and std::span<const float> differ; the C++ API takes the latter to push.
      thread_local std::vector<std::span<const float>> sources;
      sources.assign(spans.begin(), spans.end());
      return op == OpKind::push ? client.push(key_list, sources) : client.init(key_list, sources);
    };
    return run(std::move(pending), submit, bytes, async_op, what);
  }

  // pull_rows and push_rows of an embedding table: `ids` an int64/uint64 array (numpy, CPU
  // torch tensor) or a sequence of ints, `values` one float32 array of len(ids) * dim floats.
  py::object rows(bool push, std::uint32_t table, py::handle ids, py::handle values, bool async_op) {
    Session& s = *session_;
    s.require_open();
    ActiveCall call(s);
    s.reap_orphans();
    const char* what = push ? "push_rows gradients" : "pull_rows target";
    thread_local std::vector<Key> id_list;
    read_ids(ids, id_list);
    Pending pending;
    pending.first = HeldBuffer(values.ptr(), push ? Access::read : Access::write, what, static_cast<std::size_t>(-1));
    const std::span<float> buffer(pending.first.data(), pending.first.floats());
    Client& client = *s.client;
    auto submit = [&] {
      return push ? client.push_rows(table, id_list, std::span<const float>(buffer))
                  : client.pull_rows(table, id_list, buffer);
    };
    return run(std::move(pending), submit, buffer.size_bytes(), async_op, what);
  }

  void create_table(std::uint32_t table, const TableSpec& spec) {
    Session& s = *session_;
    s.require_open();
    ActiveCall call(s);
    py::gil_scoped_release unlocked;
    s.client->create_table(table, spec);
  }

 private:
  // Row ids as the C++ client takes them, copied (8 bytes a row, beside its floats).
  static void read_ids(py::handle ids, std::vector<Key>& out) {
    out.clear();
    py::object source = py::reinterpret_borrow<py::object>(ids);
    // A CPU torch tensor exports no buffer; its numpy view shares the memory.
    if (!PyObject_CheckBuffer(source.ptr()) && py::hasattr(source, "numpy") && py::hasattr(source, "dtype"))
      source = source.attr("numpy")();
    if (PyObject_CheckBuffer(source.ptr())) {
      Py_buffer view;
      if (PyObject_GetBuffer(source.ptr(), &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        throw Error(Errc::invalid_argument, "row ids: pass a C-contiguous int64 or uint64 array");
      }
      std::string format = view.format ? view.format : "B";
      if (!format.empty() && (format[0] == '@' || format[0] == '=' || format[0] == '<')) format.erase(0, 1);
      const bool ok = view.itemsize == 8 && (format == "q" || format == "Q" || format == "l" || format == "L");
      if (ok) {
        // An int64 array's words are taken as the uint64 ids they spell: torch has no uint64, and
        // hashed feature ids use all 64 bits (examples/ctr_fm.py's bias id is past 2**63).
        const auto* data = static_cast<const Key*>(view.buf);
        out.assign(data, data + view.len / 8);
      }
      PyBuffer_Release(&view);
      if (!ok)
        throw Error(Errc::invalid_argument, "row ids are " + format + " items of " + std::to_string(view.itemsize) +
                                                " bytes; pass int64 or uint64 (ids are never converted from floats)");
    } else if (PyLong_Check(source.ptr())) {
      out.push_back(to_key(source.ptr(), 0));  // one id, as push(7, value) takes one key
    } else {
      if (!PySequence_Check(source.ptr()) || PyUnicode_Check(source.ptr()) || PyBytes_Check(source.ptr()))
        throw Error(Errc::invalid_argument, std::string("row ids: pass an int, a sequence of ints or an int64 array, "
                                                        "not ") +
                                                Py_TYPE(source.ptr())->tp_name);
      const py::sequence seq = py::reinterpret_borrow<py::sequence>(ids);
      out.reserve(py::len(seq));
      for (std::size_t i = 0; i < py::len(seq); ++i) out.push_back(to_key(py::object(seq[i]).ptr(), i));
    }
    if (out.empty()) throw Error(Errc::invalid_argument, "no row ids given");
  }

  // Issues `submit` (which reads `pending`'s buffers) and, unless async_op, waits for it.
  template <class Submit>
  py::object run(Pending pending, Submit& submit, std::size_t bytes, bool async_op, const char* what) {
    Session& s = *session_;
    Client& client = *s.client;
    // Issuing waits for room once the window is full: other Python threads must not wait with it.
    const bool keep_gil = bytes < kReleaseGilBytes && s.in_flight < s.window / 2;
    if (async_op) {
      if (keep_gil) {
        pending.ticket = submit();
      } else {
        py::gil_scoped_release unlocked;
        pending.ticket = submit();
      }
      ++s.in_flight;
      return py::cast(std::make_unique<Work>(session_, std::move(pending), what));
    }
    std::optional<Error> failure;
    bool completed;
    if (keep_gil) {
      pending.ticket = submit();
      completed = client.done(pending.ticket) && wait_slice(client, pending.ticket, 0ms, failure);
    } else {
      py::gil_scoped_release unlocked;
      pending.ticket = submit();
      completed = wait_slice(client, pending.ticket, kSignalSlice, failure);
    }
    ++s.in_flight;
    if (!completed) {
      switch (wait_ticket(s, pending.ticket, std::chrono::steady_clock::time_point::max(), /*watch_closing=*/true,
                          failure)) {
        case Waited::completed:
          break;
        case Waited::interrupted:  // still in flight: the session completes it, as for a dropped Work
          s.orphans.push_back(std::move(pending));
          throw py::error_already_set();
        case Waited::closing:
          s.orphans.push_back(std::move(pending));
          throw s.closing_error(what, "operation");
        case Waited::timed_out:  // no deadline
          break;
      }
    }
    --s.in_flight;
    if (failure) throw *failure;
    return py::none();
  }

 public:
  void clock() { step(&Client::clock_async, "clock()"); }
  void barrier() { step(&Client::barrier_async, "barrier()"); }

  std::uint64_t current_clock() const {
    session_->require_open();
    return session_->client->current_clock();
  }
  std::size_t num_servers() const {
    session_->require_open();
    return session_->client->num_servers();
  }
  bool closed() const { return session_->closing; }
  std::optional<std::uint32_t> worker_id() const {
    return worker_id_ == kNoWorker ? std::nullopt : std::optional<std::uint32_t>(worker_id_);
  }

  py::dict staleness() const {
    session_->require_open();
    const StalenessStats st = session_->client->staleness();
    py::dict d;
    d["reads"] = st.reads;
    d["max"] = st.max;
    d["histogram"] = std::vector<std::uint64_t>(st.histogram.begin(), st.histogram.end());
    return d;
  }

  py::object server_stats(std::size_t server) {
    Session& s = *session_;
    s.require_open();
    std::string text;
    {
      ActiveCall call(s);
      py::gil_scoped_release unlocked;
      text = s.client->server_stats(server);
    }
    return py::module_::import("json").attr("loads")(text);
  }

  void register_buffer(py::handle buffer) {
    session_->require_open();
    ActiveCall call(*session_);  // HeldBuffer may run Python code
    HeldBuffer held(buffer.ptr(), Access::read, "register_buffer argument", static_cast<std::size_t>(-1));
    for (const HeldBuffer& r : session_->registered)
      if (r.data() == held.data() && r.floats() == held.floats()) return;  // announced already, and still held
    session_->client->register_buffer(held.data(), held.floats() * sizeof(float));
    session_->registered.push_back(std::move(held));
  }

  // pskv.bench's C++ side: `op` ("push" or "pull") of `key` with `buffer`, one in flight, in a
  // C++ loop for `seconds` on this client's own connections: what pskv-bench times, measured next
  // to the Python loop in the same process. Returns (bytes per second, p50 in microseconds).
  py::tuple cpp_loop(Key key, py::handle buffer, const std::string& op, double seconds) {
    Session& s = *session_;
    s.require_open();
    if (op != "push" && op != "pull") throw Error(Errc::invalid_argument, "op must be 'push' or 'pull'");
    ActiveCall call(s);
    HeldBuffer held(buffer.ptr(), op == "pull" ? Access::write : Access::read, "bench buffer",
                    static_cast<std::size_t>(-1));
    const std::span<float> values(held.data(), held.floats());
    std::vector<std::int64_t> latencies;
    double elapsed = 0;
    {
      py::gil_scoped_release unlocked;
      Client& c = *s.client;
      const auto start = std::chrono::steady_clock::now();
      const auto end = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                   std::chrono::duration<double>(seconds));
      for (;;) {
        const auto t0 = std::chrono::steady_clock::now();
        c.wait(op == "push" ? c.push(key, std::span<const float>(values)) : c.pull(key, values));
        const auto t1 = std::chrono::steady_clock::now();
        latencies.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
        if (t1 >= end && latencies.size() >= 5) break;
      }
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    std::nth_element(latencies.begin(), latencies.begin() + latencies.size() / 2, latencies.end());
    const double p50_us = static_cast<double>(latencies[latencies.size() / 2]) / 1000;
    return py::make_tuple(static_cast<double>(values.size_bytes()) * latencies.size() / elapsed, p50_us);
  }

  // finished=False: like the C++ client destroyed by an exception (the job will not wait for a
  // worker that failed). Completes (finished) or cancels (not) every operation still in flight.
  void close(bool finished) {
    Session& s = *session_;
    if (s.closing) return;
    s.closing = true;
    if (s.active_on_this_thread()) {
      // Called from a signal handler (or a callback) while this thread is inside a call of this
      // client, which waits for that very call: the interrupted call ends with "being closed",
      // and the last call to end closes the client.
      s.deferred = finished ? Session::Deferred::finished : Session::Deferred::abandoned;
      return;
    }
    // Calls in other threads finish or notice `closing` within one signal slice (one blocked in
    // a Python callback may take longer: Ctrl-C leaves this client closed, its memory with it).
    while (s.active > 0) {
      {
        py::gil_scoped_release unlocked;
        std::this_thread::sleep_for(1ms);
      }
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
    bool interrupted = false;
    std::optional<py::error_already_set> interrupt;  // Ctrl-C while completing: cancel the rest instead
    if (finished && !complete_all()) {
      interrupted = true;
      interrupt.emplace();
    }
    s.end_client(/*disconnect=*/!finished || interrupted);
    if (interrupt) throw *interrupt;
    s.raise_orphan_error();
  }

 private:
  // clock() and barrier(): first raises what a dropped Work's operation failed with, then waits
  // in slices. Ctrl-C leaves the step in flight, completed by the client like a dropped Work
  // (its error, if any, raised by the next clock(), barrier() or close()): the client stays
  // usable, and a clock() interrupted still counts as this worker's step.
  void step(Ticket (Client::*start)(), const char* what) {
    Session& s = *session_;
    s.require_open();
    ActiveCall call(s);
    s.reap_orphans();
    s.raise_orphan_error();
    Pending pending;
    {
      py::gil_scoped_release unlocked;
      pending.ticket = (s.client.get()->*start)();
    }
    ++s.in_flight;
    std::optional<Error> failure;
    switch (
        wait_ticket(s, pending.ticket, std::chrono::steady_clock::time_point::max(), /*watch_closing=*/true, failure)) {
      case Waited::completed:
        --s.in_flight;
        if (failure) throw *failure;
        return;
      case Waited::interrupted:
        s.orphans.push_back(std::move(pending));
        throw py::error_already_set();
      case Waited::closing:
        s.orphans.push_back(std::move(pending));
        throw s.closing_error(what, "step");
      case Waited::timed_out:  // no deadline
        break;
    }
  }

  // Waits for every live and orphaned operation, in slices, watching for Ctrl-C. False if
  // interrupted (the Python error is set). While it waits without the GIL, other threads may drop
  // Works (which then move to the orphans): each completed ticket is looked up again afterwards.
  bool complete_all() {
    Session& s = *session_;
    while (s.live || !s.orphans.empty()) {
      const Ticket t = s.live ? s.live->ticket() : s.orphans.front().ticket;
      std::optional<Error> failure;
      if (wait_ticket(s, t, std::chrono::steady_clock::time_point::max(), /*watch_closing=*/false, failure) !=
          Waited::completed)
        return false;
      spend(t, failure);
    }
    return true;
  }

  // The operation of ticket `t` completed: whoever holds it now (a live Work or the orphans).
  void spend(Ticket t, const std::optional<Error>& failure) {
    Session& s = *session_;
    for (Work* w = s.live; w; w = w->next())
      if (w->ticket() == t) {
        w->complete(failure);
        return;
      }
    for (auto it = s.orphans.begin(); it != s.orphans.end(); ++it)
      if (it->ticket == t) {
        if (failure && !s.orphan_error) s.orphan_error = failure;
        s.orphans.erase(it);
        --s.in_flight;
        return;
      }
  }

  std::shared_ptr<Session> session_;
  std::uint32_t worker_id_;
};

// push, pull, init and Work.wait are the calls a training loop makes thousands of times a
// second. Through pybind11's dispatcher a 64-byte pull cost 0.94 us against 0.41 us parsed
// directly (it copies the kwargs dict to find `async_op=`, allocates argument vectors, hashes
// type names): more than the pull itself over shm. These take the vectorcall arguments as they
// come.

// Fills out[0..names.size()) from positional and keyword arguments: at most `positional`
// positional ones, the first `required` names required, the rest left null when absent.
// False with a TypeError set, worded as Python's own.
bool parse_args(const char* function, std::span<const char* const> names, std::size_t required, std::size_t positional,
                PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, PyObject** out) {
  if (static_cast<std::size_t>(nargs) > positional) {
    PyErr_Format(PyExc_TypeError, "%s() takes %zu positional argument%s but %zd were given", function, positional,
                 positional == 1 ? "" : "s", nargs);
    return false;
  }
  std::fill_n(out, names.size(), nullptr);
  std::copy_n(args, nargs, out);
  const Py_ssize_t keywords = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < keywords; ++k) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, k);
    std::size_t which = 0;
    while (which < names.size() && PyUnicode_CompareWithASCIIString(name, names[which]) != 0) ++which;
    if (which == names.size()) {
      PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", function, name);
      return false;
    }
    if (out[which]) {
      PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", function, names[which]);
      return false;
    }
    out[which] = args[nargs + k];
  }
  for (std::size_t j = 0; j < required; ++j)
    if (!out[j]) {
      PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", function, names[j]);
      return false;
    }
  return true;
}

// Sets the Python error for the exception being handled, as pybind11's dispatcher would: the
// module's pskv.Error translator first, then pybind11's own (which restores an
// error_already_set and maps the std exceptions). Call only inside a catch block.
void raise_current_exception() noexcept {
  if (py::detail::apply_exception_translators(py::detail::get_local_internals().registered_exception_translators))
    return;
  if (py::detail::apply_exception_translators(py::detail::get_internals().registered_exception_translators)) return;
  PyErr_SetString(PyExc_SystemError, "an exception escaped pskv's exception translators");
}

template <OpKind kOp>
PyObject* issue_fastcall(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) noexcept {
  static constexpr const char* kName = kOp == OpKind::pull ? "pull" : kOp == OpKind::push ? "push" : "init";
  static constexpr const char* kNames[] = {"keys", kOp == OpKind::pull ? "out" : "values", "async_op"};
  PyObject* parsed[3];
  if (!parse_args(kName, kNames, 2, 2, args, nargs, kwnames, parsed)) return nullptr;
  const int async_op = parsed[2] ? PyObject_IsTrue(parsed[2]) : 1;
  if (async_op < 0) return nullptr;
  try {
    return py::handle(self).cast<PyClient&>().issue(kOp, parsed[0], parsed[1], async_op != 0).release().ptr();
  } catch (...) {
    raise_current_exception();
    return nullptr;
  }
}

PyObject* wait_fastcall(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) noexcept {
  static constexpr const char* kNames[] = {"timeout"};
  PyObject* timeout;
  if (!parse_args("wait", kNames, 0, 1, args, nargs, kwnames, &timeout)) return nullptr;
  std::optional<double> seconds;
  if (timeout && timeout != Py_None) {
    seconds = PyFloat_AsDouble(timeout);
    if (*seconds == -1.0 && PyErr_Occurred()) return nullptr;
  }
  try {
    return py::bool_(py::handle(self).cast<Work&>().wait(seconds)).release().ptr();
  } catch (...) {
    raise_current_exception();
    return nullptr;
  }
}

// Installs `def` (static storage: the type keeps pointing at it) as a method of `cls`.
void def_fastcall(py::handle cls, PyMethodDef& def) {
  PyObject* method = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), &def);
  if (!method) throw py::error_already_set();
  cls.attr(def.ml_name) = py::reinterpret_steal<py::object>(method);
}

// CPython's own idiom: METH_FASTCALL functions are stored as a PyCFunction, via void (*)().
template <class F>
PyCFunction as_cfunction(F* f) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

}  // namespace

UpdateRuleConfig rule_config(const std::string& rule, float lr, float momentum, float beta1, float beta2, float eps,
                             float weight_decay) {
  const auto parsed = parse_update_rule(rule);
  if (!parsed)
    throw Error(Errc::invalid_argument, "rule must be assign, add, sgd, momentum, adam or adagrad, not '" + rule + "'");
  return {*parsed, lr, momentum, beta1, beta2, eps, weight_decay};
}

template <class T>
T whole_number(const PyInteger& value, const char* name, T low, T high) {
  static_assert(std::is_unsigned_v<T> && sizeof(T) <= sizeof(unsigned long long));
  PyObject* object = value.value.ptr();
  const auto refuse = [&]() -> T {
    PyObject* shown = object ? PyObject_Repr(object) : nullptr;
    std::string text = "?";
    if (shown) {
      text = str_of(shown);
      Py_DECREF(shown);
    } else {
      PyErr_Clear();
    }
    throw Error(Errc::invalid_argument, std::string(name) + " must be an int from " + std::to_string(low) + " to " +
                                            std::to_string(high) + ", not " + text);
  };
  // numpy's integers pass (they have __index__); True, 2.0 and "2" do not.
  if (!object || PyBool_Check(object)) return refuse();
  const py::object number = py::reinterpret_steal<py::object>(PyNumber_Index(object));
  if (!number) {
    PyErr_Clear();
    return refuse();
  }
  int overflow = 0;
  const long long as_signed = PyLong_AsLongLongAndOverflow(number.ptr(), &overflow);
  if (as_signed == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return refuse();
  }
  if (overflow < 0 || (overflow == 0 && as_signed < 0)) return refuse();
  unsigned long long n = static_cast<unsigned long long>(as_signed);
  if (overflow > 0) {
    n = PyLong_AsUnsignedLongLong(number.ptr());
    if (n == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      return refuse();
    }
  }
  if (n < low || n > high) return refuse();
  return static_cast<T>(n);
}

template std::uint32_t whole_number(const PyInteger&, const char*, std::uint32_t, std::uint32_t);
template std::uint64_t whole_number(const PyInteger&, const char*, std::uint64_t, std::uint64_t);

std::chrono::milliseconds to_ms(double seconds, const char* name) {
  // Past a year (inf among them) the conversion would overflow the nanoseconds deadlines use.
  constexpr double kYear = 365.0 * 24 * 3600;
  if (!(seconds >= 0) || !(seconds <= kYear))
    throw Error(Errc::invalid_argument, std::string(name) + " is seconds, >= 0 and at most a year (" +
                                            std::to_string(kYear) + "), not " + std::to_string(seconds));
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000 + 0.5));
}

void bind_client(py::module_& m) {
  // The keyword defaults are the C++ ones, in the units of the Python arguments.
  const ClientOptions d;
  const auto seconds = [](std::chrono::milliseconds ms) { return static_cast<double>(ms.count()) / 1000; };
  py::class_<Work> work_class(m, "Work",
                              "An operation in flight (the shape of torch.distributed's Work). It keeps its arrays "
                              "alive until it completes; dropping it unwaited is allowed (the client finishes it).");
  work_class.def("done", &Work::done, "True once the operation completed (wait() then returns or raises at once).")
      .def("is_completed", &Work::done, "Same as done(), as torch.distributed.Work names it.");

  py::class_<PyClient> client_class(m, "Client");
  client_class
      .def(py::init([](py::object servers, py::object worker_id, const std::string& partition,
                       const PyInteger& range_keys, const PyInteger& chunk_floats, double connect_timeout,
                       double io_timeout, const PyInteger& max_in_flight, bool checksum,
                       const std::string& auth_token_file, const PyInteger& initial_clock, double retry_timeout) {
             ClientOptions o;
             if (py::isinstance<py::str>(servers))
               o.servers = {servers.cast<std::string>()};
             else
               o.servers = servers.cast<std::vector<std::string>>();
             // Checked here rather than by pybind's conversion, whose refusal of -1 is a dump of
             // the whole signature.
             if (!worker_id.is_none()) {
               const bool integer = py::isinstance<py::int_>(worker_id) && !py::isinstance<py::bool_>(worker_id);
               if (!integer || worker_id < py::int_(0) || worker_id >= py::int_(kNoWorker))
                 throw Error(Errc::invalid_argument, "worker_id must be None or an int from 0 to " +
                                                         std::to_string(kNoWorker - 1) + ", not " +
                                                         py::repr(worker_id).cast<std::string>());
               o.worker_id = worker_id.cast<std::uint32_t>();
             }
             if (partition != "hash" && partition != "range")
               throw Error(Errc::invalid_argument, "partition must be 'hash' or 'range', not '" + partition + "'");
             o.partition = partition == "range" ? Partition::range : Partition::hash;
             o.range_keys = whole_number<std::uint64_t>(range_keys, "range_keys");
             o.chunk_floats = whole_number<std::uint64_t>(chunk_floats, "chunk_floats");
             o.connect_timeout = to_ms(connect_timeout, "connect_timeout");
             o.io_timeout = to_ms(io_timeout, "io_timeout");
             o.max_in_flight = whole_number<std::uint32_t>(max_in_flight, "max_in_flight");
             o.checksum = checksum;
             o.auth_token_file = auth_token_file;
             o.initial_clock = whole_number<std::uint64_t>(initial_clock, "initial_clock");
             o.retry_timeout = to_ms(retry_timeout, "retry_timeout");
             return std::make_unique<PyClient>(o);
           }),
           py::arg("servers"), py::arg("worker_id") = py::none(),
           py::arg("partition") = d.partition == Partition::range ? "range" : "hash",
           py::arg("range_keys") = d.range_keys, py::arg("chunk_floats") = d.chunk_floats,
           py::arg("connect_timeout") = seconds(d.connect_timeout), py::arg("io_timeout") = seconds(d.io_timeout),
           py::arg("max_in_flight") = d.max_in_flight, py::arg("checksum") = d.checksum,
           py::arg("auth_token_file") = d.auth_token_file, py::arg("initial_clock") = d.initial_clock,
           py::arg("retry_timeout") = seconds(d.retry_timeout))
      .def("clock", &PyClient::clock, "Ends this worker's step (after its pushes are applied everywhere).")
      .def("barrier", &PyClient::barrier, "Waits until every live worker reached this barrier.")
      .def("current_clock", &PyClient::current_clock)
      .def("num_servers", &PyClient::num_servers)
      .def("staleness", &PyClient::staleness, "{'reads', 'max', 'histogram'}: staleness seen by bounded reads.")
      .def(
          "server_stats",
          [](PyClient& c, const PyInteger& server) {
            return c.server_stats(whole_number<std::uint64_t>(server, "server"));
          },
          py::arg("server"), "Server `server`'s counters, parsed from JSON.")
      .def("_cpp_loop", &PyClient::cpp_loop, py::arg("key"), py::arg("buffer"), py::arg("op"), py::arg("seconds"),
           "pskv.bench's C++ baseline: (bytes/s, p50 us) of a one-in-flight C++ loop on this client.")
      .def(
          "create_table",
          [](PyClient& c, const PyInteger& table, const PyInteger& dim, const std::string& init, float init_scale,
             const PyInteger& seed, const std::string& rule, float lr, float momentum, float beta1, float beta2,
             float eps, float weight_decay, const PyInteger& admit_after, const std::string& eviction,
             const PyInteger& max_rows) {
            TableSpec spec;
            spec.dim = whole_number<std::uint32_t>(dim, "dim");
            const auto i = parse_row_init(init);
            if (!i)
              throw Error(Errc::invalid_argument, "init must be 'zeros', 'uniform' or 'normal', not '" + init + "'");
            spec.init = *i;
            spec.init_scale = init_scale;
            spec.seed = whole_number<std::uint64_t>(seed, "seed");
            spec.rule = rule_config(rule, lr, momentum, beta1, beta2, eps, weight_decay);
            spec.admit_after = whole_number<std::uint32_t>(admit_after, "admit_after");
            const auto e = parse_row_eviction(eviction);
            if (!e)
              throw Error(Errc::invalid_argument,
                          "eviction must be 'none', 'lru', 'lfu' or 'step', not '" + eviction + "'");
            spec.eviction = *e;
            spec.max_rows = whole_number<std::uint64_t>(max_rows, "max_rows");
            c.create_table(whole_number<std::uint32_t>(table, "table"), spec);
          },
          py::arg("table"), py::arg("dim"), py::kw_only(), py::arg("init") = "uniform", py::arg("init_scale") = 0.01f,
          py::arg("seed") = 0, py::arg("rule") = "sgd", py::arg("lr") = 0.01f, py::arg("momentum") = 0.9f,
          py::arg("beta1") = 0.9f, py::arg("beta2") = 0.999f, py::arg("eps") = 1e-8f, py::arg("weight_decay") = 0.0f,
          py::arg("admit_after") = 1, py::arg("eviction") = "none", py::arg("max_rows") = 0,
          "Declares embedding table `table` (an id below 64) on every server: rows of `dim` floats created when "
          "an id is admitted (at its admit_after-th push), starting from init ('zeros', 'uniform' or 'normal', "
          "scaled by init_scale, seeded by seed and the id), updated by `rule` ('sgd', 'adagrad', 'adam', ...) "
          "row by row, at most max_rows per server (0: what the server's --table-memory-mb leaves), evicting by "
          "eviction ('none': refuse new ids at the cap, 'lru', 'lfu', 'step'). Every worker may call it with the "
          "same arguments; another spec for the same table raises pskv.InvalidArgument.")
      .def(
          "pull_rows",
          [](PyClient& c, const PyInteger& table, py::handle ids, py::handle out, bool async_op) {
            return c.rows(false, whole_number<std::uint32_t>(table, "table"), ids, out, async_op);
          },
          py::arg("table"), py::arg("ids"), py::arg("out"), py::kw_only(), py::arg("async_op") = true,
          "Reads the rows of `ids` (int64/uint64 array or ints) into `out` (float32, len(ids) * dim, row by row); "
          "an id without a row reads as its initial value. A repeated id is fetched once. Returns a Work, or with "
          "async_op=False waits and returns None.")
      .def(
          "push_rows",
          [](PyClient& c, const PyInteger& table, py::handle ids, py::handle grads, bool async_op) {
            return c.rows(true, whole_number<std::uint32_t>(table, "table"), ids, grads, async_op);
          },
          py::arg("table"), py::arg("ids"), py::arg("grads"), py::kw_only(), py::arg("async_op") = true,
          "Sends the gradients of `ids` (float32, len(ids) * dim), applied row by row by the table's rule; the "
          "gradients of a repeated id are summed and sent once. Returns a Work, or with async_op=False waits.")
      .def("register_buffer", &PyClient::register_buffer, py::arg("buffer"),
           "Announces memory later used for pushes or pulls (RDMA registers it once). The client holds the "
           "buffer until it is closed, so that its memory is not freed and reused while registered.")
      .def("close", &PyClient::close, py::arg("finished") = true,
           "Completes what is in flight, tells the servers this worker finished (unless finished=False) and "
           "disconnects. Later calls raise pskv.InvalidArgument.")
      .def_property_readonly("closed", &PyClient::closed)
      .def_property_readonly("worker_id", &PyClient::worker_id, "This client's worker id, or None if anonymous.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyClient& c, py::handle type, py::handle, py::handle) {
        c.close(type.is_none());
        return false;
      });
  constexpr int kFastcall = METH_FASTCALL | METH_KEYWORDS;
  static PyMethodDef init{"init", as_cfunction(&issue_fastcall<OpKind::init>), kFastcall,
                          "init($self, keys, values, *, async_op=True)\n--\n\n"
                          "Creates keys with these values; the first initialiser wins. One key and one array, or "
                          "lists. Returns a Work, or with async_op=False waits and returns None."};
  static PyMethodDef push{"push", as_cfunction(&issue_fastcall<OpKind::push>), kFastcall,
                          "push($self, keys, values, *, async_op=True)\n--\n\n"
                          "Sends values (read in place) to be applied by the servers' rule. Returns a Work, or "
                          "with async_op=False waits (Ctrl-C as in Work.wait) and returns None."};
  static PyMethodDef pull{"pull", as_cfunction(&issue_fastcall<OpKind::pull>), kFastcall,
                          "pull($self, keys, out, *, async_op=True)\n--\n\n"
                          "Reads values straight into `out` (writable float32 arrays). Returns a Work, or with "
                          "async_op=False waits (Ctrl-C as in Work.wait) and returns None."};
  static PyMethodDef wait{"wait", as_cfunction(&wait_fastcall), kFastcall,
                          "wait($self, timeout=None)\n--\n\n"
                          "Blocks until the operation completes (True) or `timeout` seconds pass (False; still in "
                          "flight). Raises the operation's pskv.Error. The GIL is released; Ctrl-C raises "
                          "KeyboardInterrupt within 100 ms and leaves the operation in flight."};
  for (PyMethodDef* def : {&init, &push, &pull}) def_fastcall(client_class, *def);
  def_fastcall(work_class, wait);
}

}  // namespace pskv::python

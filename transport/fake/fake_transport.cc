#include "transport/fake/fake_transport.h"

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "engine/shard_engine.h"

namespace pskv::fake {
namespace {

class Hub;

// One client connection's state, shared by the connection, the hub's queue and the engine's
// parked requests. Thread-safety: guarded by `mu`.
struct Link {
  std::mutex mu;
  std::condition_variable idle;
  bool closed = false;                    // the connection is gone: its requests are not touched any more
  std::uint32_t active = 0;               // requests being served right now (outside `mu`)
  std::set<transport::Request*> pending;  // submitted, not yet completed
  std::uint32_t worker = kNoWorker;
  bool finished = false;  // announced clock kClockDone
  std::uint32_t max_in_flight = 128;
  std::condition_variable room;
};

struct Item {
  std::shared_ptr<Link> link;
  transport::Request* request;
};

// The server side: a thread applying queued requests in order against the engine.
// Thread-safety: every member is guarded by `mu_` except the engine, which is thread-safe.
class Hub : public std::enable_shared_from_this<Hub> {
 public:
  Hub(ShardEngine& engine, std::uint32_t server_id) : engine_(engine), server_id_(server_id) {}

  void start() {
    thread_ = std::thread([self = shared_from_this()] { self->run(); });
  }
  ShardEngine& engine() noexcept { return engine_; }
  std::uint32_t server_id() const noexcept { return server_id_; }

  void add_link(const std::shared_ptr<Link>& link) {
    std::lock_guard lock(mu_);
    std::erase_if(links_, [](const std::weak_ptr<Link>& l) { return l.expired(); });
    links_.push_back(link);
  }
  std::vector<std::shared_ptr<Link>> links() {
    std::lock_guard lock(mu_);
    std::vector<std::shared_ptr<Link>> live;
    for (const std::weak_ptr<Link>& l : links_)
      if (std::shared_ptr<Link> p = l.lock()) live.push_back(std::move(p));
    return live;
  }

  bool submit(const std::shared_ptr<Link>& link, transport::Request& r) {
    std::lock_guard lock(mu_);
    if (closed_) return false;
    queue_.push_back({link, &r});
    wake_.notify_one();
    return true;
  }
  // No request is applied after this returns; what is queued stays queued (answered by close).
  void drain() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      wake_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
  }
  // Queued requests fail; later submits are refused.
  void close() {
    drain();
    std::deque<Item> left;
    {
      std::lock_guard lock(mu_);
      closed_ = true;
      left.swap(queue_);
    }
    for (Item& i : left) finish(i, Errc::peer_failure, "the fake server stopped before serving this request");
  }

  // Completes a request of `link` unless its connection went away meanwhile.
  static void finish(const Item& i, Errc status, const std::string& why, std::uint64_t bound = ~0ull) {
    std::lock_guard lock(i.link->mu);
    if (i.link->closed) return;
    if (!i.link->pending.erase(i.request)) return;
    if (bound != ~0ull) i.request->completion->note_bound(bound);
    i.request->completion->complete_part(status, why);
    i.link->room.notify_one();
  }

  // Runs `serve` on a request of a live connection, counted as active so that the connection's
  // destructor waits for it. False if the connection is gone.
  template <class F>
  static bool with_link(const Item& i, F&& serve) {
    {
      std::lock_guard lock(i.link->mu);
      if (i.link->closed) return false;
      ++i.link->active;
    }
    serve();
    std::lock_guard lock(i.link->mu);
    if (--i.link->active == 0) i.link->idle.notify_all();
    return true;
  }

  void pull(const Item& i) {
    std::vector<KeyEntry> keys = entries(*i.request);
    std::vector<float> staged(floats(keys));
    std::string why;
    Errc e = engine_.pull(keys, staged.data(), &why);
    if (e == Errc::ok) scatter(*i.request, staged);
    finish(i, e, why, engine_.observed_bound());
  }

 private:
  void run() {
    for (;;) {
      Item item;
      {
        std::unique_lock lock(mu_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        item = queue_.front();
        queue_.pop_front();
      }
      with_link(item, [&] { serve(item); });
    }
  }

  static std::vector<KeyEntry> entries(const transport::Request& r) {
    std::vector<KeyEntry> keys;
    keys.reserve(r.keys.size());
    for (const transport::KeySlice& k : r.keys) keys.push_back({k.key, k.length, 0});
    return keys;
  }
  static std::size_t floats(std::span<const KeyEntry> keys) {
    std::size_t n = 0;
    for (const KeyEntry& k : keys) n += k.length;
    return n;
  }
  static std::vector<float> gather(const transport::Request& r) {
    std::vector<float> v;
    for (const transport::KeySlice& k : r.keys) v.insert(v.end(), k.data, k.data + k.length);
    return v;
  }
  static void scatter(const transport::Request& r, const std::vector<float>& v) {
    const float* p = v.data();
    for (const transport::KeySlice& k : r.keys) {
      std::copy(p, p + k.length, k.data);
      p += k.length;
    }
  }

  // A pull or barrier waiting in the engine; resumed on whichever thread moves the bound.
  class Parked final : public pskv::Parked {
   public:
    Parked(std::shared_ptr<Hub> hub, Item item) : hub_(std::move(hub)), item_(std::move(item)) {}
    void resume(Errc status, const std::string& why) noexcept override {
      with_link(item_, [&] {
        if (status != Errc::ok)
          finish(item_, status, why);
        else if (item_.request->op == wire::Op::pull)
          hub_->pull(item_);
        else
          finish(item_, Errc::ok, {});
      });
    }

   private:
    std::shared_ptr<Hub> hub_;
    Item item_;
  };

  void serve(const Item& i) {
    transport::Request& r = *i.request;
    const std::uint32_t worker = i.link->worker;
    std::string why;
    Errc e = Errc::ok;
    switch (r.op) {
      case wire::Op::init: {
        const std::vector<float> v = gather(r);
        e = engine_.init(entries(r), v.data(), &why);
        break;
      }
      case wire::Op::push: {
        const std::vector<float> v = gather(r);
        e = engine_.push(worker, r.arg0, entries(r), v.data(), &why);
        break;
      }
      case wire::Op::pull: {
        if (engine_.pull_allowed(worker, r.arg0)) return pull(i);
        if ((e = engine_.check_pull_clock(worker, r.arg0, &why)) != Errc::ok) break;
        engine_.park_pull(worker, r.arg0, std::make_unique<Parked>(shared_from_this(), i));
        return;
      }
      case wire::Op::clock: {
        if ((e = engine_.check_worker(worker, &why)) != Errc::ok) break;
        if (r.arg0 == kClockDone) {
          std::lock_guard lock(i.link->mu);
          i.link->finished = true;
        }
        return finish(i, Errc::ok, {}, engine_.advance_clock(worker, r.arg0));
      }
      case wire::Op::barrier:
        if ((e = engine_.check_worker(worker, &why)) != Errc::ok) break;
        engine_.barrier(worker, r.arg0, std::make_unique<Parked>(shared_from_this(), i));
        return;
      case wire::Op::stats:
        if (r.text_out) r.text_out->assign(engine_.stats_json());
        break;
      default:
        e = Errc::unsupported;
        why = std::string(wire::op_name(static_cast<std::uint16_t>(r.op))) + " is not a fake:// operation";
    }
    finish(i, e, why);
  }

  ShardEngine& engine_;
  const std::uint32_t server_id_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Item> queue_;
  std::vector<std::weak_ptr<Link>> links_;
  bool stopping_ = false, closed_ = false;
  std::thread thread_;
};

// Servers by name, while they accept clients. Thread-safety: guarded by g_mu.
std::mutex g_mu;
std::map<std::string, std::shared_ptr<Hub>> g_hubs;

// Thread-safety: as transport::Connection.
class FakeConnection final : public transport::Connection {
 public:
  FakeConnection(std::shared_ptr<Hub> hub, const Uri& uri, const transport::ConnectOptions& o)
      : hub_(std::move(hub)), link_(std::make_shared<Link>()), endpoint_(uri.str()) {
    ShardEngine& engine = hub_->engine();
    if (o.worker_id != kNoWorker) {
      std::string why;
      if (Errc e = engine.check_worker(o.worker_id, &why); e != Errc::ok) throw Error(e, endpoint_ + ": " + why);
      engine.worker_joined(o.worker_id);
    }
    link_->worker = o.worker_id;
    link_->max_in_flight = std::max(1u, o.max_in_flight);
    hub_->add_link(link_);
    info_.server_id = hub_->server_id();
    info_.num_workers = engine.options().num_workers;
  }
  ~FakeConnection() override {
    bool left;
    const bool finished = close_link(*link_, "the connection to " + endpoint_ + " was closed by the client", &left);
    if (link_->worker != kNoWorker && !left) hub_->engine().worker_left(link_->worker, finished);
  }

  // Marks the link closed, waits for the hub to leave it, and fails what is still queued or
  // parked (the hub skips it when its turn comes): its waiters must not wait for a connection
  // that is gone. Returns whether the worker announced it finished; *already_left whether the
  // link had been closed before (by sever), so its worker has left already.
  static bool close_link(Link& link, const std::string& why, bool* already_left) {
    std::unique_lock lock(link.mu);
    *already_left = link.closed;
    link.closed = true;  // nothing of ours is served or completed by the hub from here on
    link.idle.wait(lock, [&] { return link.active == 0; });
    for (transport::Request* r : link.pending) r->completion->complete_part(Errc::peer_failure, why);
    link.pending.clear();
    link.room.notify_all();
    return link.finished;
  }

  void submit(transport::Request& request) override {
    {
      std::unique_lock lock(link_->mu);
      link_->room.wait(lock, [&] { return link_->closed || link_->pending.size() < link_->max_in_flight; });
      if (link_->closed) {
        request.completion->complete_part(Errc::peer_failure, "the connection to " + endpoint_ + " was cut");
        return;
      }
      link_->pending.insert(&request);
    }
    if (!hub_->submit(link_, request)) {
      std::lock_guard lock(link_->mu);
      link_->pending.erase(&request);
      request.completion->complete_part(Errc::peer_failure, endpoint_ + " has stopped");
    }
  }
  const transport::ServerInfo& info() const noexcept override { return info_; }
  const std::string& endpoint() const noexcept override { return endpoint_; }

 private:
  std::shared_ptr<Hub> hub_;
  std::shared_ptr<Link> link_;
  std::string endpoint_;
  transport::ServerInfo info_;
};

// Thread-safety: as transport::Listener.
class FakeListener final : public transport::Listener {
 public:
  FakeListener(const Uri& uri, const transport::ListenOptions& o) : uri_(uri), server_id_(o.server_id) {
    UriParams(uri).finish();
    std::lock_guard lock(g_mu);
    if (g_hubs.count(uri.name)) throw Error(Errc::stale_resource, uri.str() + " is already served in this process");
    g_hubs[uri.name] = nullptr;  // claimed: the name is taken from here on
  }
  ~FakeListener() override {
    close();
    std::lock_guard lock(g_mu);
    if (auto it = g_hubs.find(uri_.name); it != g_hubs.end() && it->second == hub_) g_hubs.erase(it);
  }
  transport::EngineMemory engine_memory(const EngineOptions&) override { return {}; }
  void start(ShardEngine& engine) override {
    hub_ = std::make_shared<Hub>(engine, server_id_);
    hub_->start();
    std::lock_guard lock(g_mu);
    g_hubs[uri_.name] = hub_;
  }
  std::string uri() const override { return uri_.str(); }
  void stop_accepting() noexcept override {
    std::lock_guard lock(g_mu);
    if (auto it = g_hubs.find(uri_.name); it != g_hubs.end() && it->second == hub_) g_hubs.erase(it);
  }
  void drain() noexcept override {
    if (hub_) hub_->drain();
  }
  void close() noexcept override {
    stop_accepting();
    if (hub_) hub_->close();
  }
  transport::ListenerStats stats() const override { return {}; }

 private:
  Uri uri_;
  std::uint32_t server_id_;
  std::shared_ptr<Hub> hub_;
};

}  // namespace

std::unique_ptr<transport::Connection> connect(const Uri& uri, const transport::ConnectOptions& options) {
  std::shared_ptr<Hub> hub;
  {
    std::lock_guard lock(g_mu);
    if (auto it = g_hubs.find(uri.name); it != g_hubs.end()) hub = it->second;
  }
  if (!hub)
    throw Error(Errc::peer_failure, "no fake server " + uri.str() + " in this process (fake:// is in-process only)");
  return std::make_unique<FakeConnection>(std::move(hub), uri, options);
}

std::unique_ptr<transport::Listener> make_listener(const Uri& uri, const transport::ListenOptions& options) {
  return std::make_unique<FakeListener>(uri, options);
}

std::size_t sever(const std::string& name, std::uint32_t worker) {
  std::shared_ptr<Hub> hub;
  {
    std::lock_guard lock(g_mu);
    if (auto it = g_hubs.find(name); it != g_hubs.end()) hub = it->second;
  }
  if (!hub) return 0;
  std::size_t cut = 0;
  for (const std::shared_ptr<Link>& link : hub->links()) {
    if (link->worker != worker) continue;
    bool already_left;
    FakeConnection::close_link(*link, "the connection to fake://" + name + " was cut", &already_left);
    if (already_left) continue;
    hub->engine().worker_left(worker, false);
    ++cut;
  }
  return cut;
}

}  // namespace pskv::fake

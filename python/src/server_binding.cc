// pskv.Server: one shard served by threads of this process.
#include <pybind11/stl.h>

#include <limits>
#include <memory>
#include <optional>
#include <string>

#include "client_binding.h"
#include "pskv/error.h"
#include "pskv/server.h"

namespace py = pybind11;

namespace pskv::python {

namespace {

// Thread-safety: as pskv::Server, any method from any thread; stop() is idempotent.
class PyServer {
 public:
  explicit PyServer(const ServerOptions& o) {
    py::gil_scoped_release unlocked;
    server_ = std::make_unique<Server>(o);
  }
  // Stopping joins the server's threads and may write a final checkpoint: other Python threads
  // run meanwhile.
  ~PyServer() {
    py::gil_scoped_release unlocked;
    server_.reset();
  }
  PyServer(const PyServer&) = delete;
  PyServer& operator=(const PyServer&) = delete;
  std::string uri() const { return server_->uri(); }
  py::object stats() const {
    const std::string text = server_->stats_json();
    return py::module_::import("json").attr("loads")(text);
  }
  bool workers_finished() const { return server_->workers_finished(); }
  py::object failure() const {
    const std::string f = server_->failure();
    return f.empty() ? py::object(py::none()) : py::object(py::str(f));
  }
  void stop() {
    py::gil_scoped_release unlocked;
    server_->stop();
  }

 private:
  std::unique_ptr<Server> server_;
};

}  // namespace

void bind_server(py::module_& m) {
  // The keyword defaults are the C++ ones, in the units of the Python arguments.
  const ServerOptions d;
  const auto seconds = [](std::chrono::milliseconds ms) { return static_cast<double>(ms.count()) / 1000; };
  py::class_<PyServer>(m, "Server", "One pskv server shard, served by threads of this process until stop().")
      .def(py::init([](const std::string& uri, const PyInteger& workers, const std::string& mode,
                       const PyInteger& staleness, const std::string& rule, float lr, float momentum, float beta1,
                       float beta2, float eps, float weight_decay, const PyInteger& server_id,
                       const PyInteger& sync_required, double wait_timeout, const std::string& straggler,
                       const PyInteger& arena_mb, const PyInteger& max_keys, const PyInteger& stripes,
                       const PyInteger& io_threads, const PyInteger& max_connections, const PyInteger& max_request_mb,
                       const std::string& checkpoint_dir, double checkpoint_every, const std::string& restore_dir,
                       const std::string& auth_token_file, std::optional<PyInteger> shm_clients,
                       std::optional<PyInteger> shm_area_mb, std::optional<std::string> shm_push,
                       std::optional<std::string> tcp_push, const PyInteger& table_memory_mb) {
             // Megabytes are shifted into bytes: past this they would wrap.
             constexpr std::uint64_t kMaxMb = std::numeric_limits<std::uint64_t>::max() >> 20;
             ServerOptions o;
             o.uri = uri;
             o.num_workers = whole_number<std::uint32_t>(workers, "workers");
             const auto parsed_mode = parse_consistency_mode(mode);
             if (!parsed_mode)
               throw Error(Errc::invalid_argument, "mode must be asp, bsp, ssp or sync, not '" + mode + "'");
             o.mode = *parsed_mode;
             o.staleness = whole_number<std::uint32_t>(staleness, "staleness");
             o.rule = rule_config(rule, lr, momentum, beta1, beta2, eps, weight_decay);
             o.server_id = whole_number<std::uint32_t>(server_id, "server_id");
             o.sync_required = whole_number<std::uint32_t>(sync_required, "sync_required");
             o.wait_timeout = to_ms(wait_timeout, "wait_timeout");
             if (straggler != "fail" && straggler != "evict")
               throw Error(Errc::invalid_argument, "straggler must be 'fail' or 'evict', not '" + straggler + "'");
             o.straggler = straggler == "evict" ? StragglerPolicy::evict : StragglerPolicy::fail;
             o.arena_bytes = whole_number<std::uint64_t>(arena_mb, "arena_mb", 0, kMaxMb) << 20;
             o.max_keys = whole_number<std::uint64_t>(max_keys, "max_keys");
             o.stripes = whole_number<std::uint32_t>(stripes, "stripes");
             o.io_threads = whole_number<std::uint32_t>(io_threads, "io_threads");
             o.max_connections = whole_number<std::uint32_t>(max_connections, "max_connections");
             o.max_request_bytes = whole_number<std::uint64_t>(max_request_mb, "max_request_mb", 0, kMaxMb) << 20;
             o.checkpoint_dir = checkpoint_dir;
             o.checkpoint_interval = to_ms(checkpoint_every, "checkpoint_every");
             o.restore_dir = restore_dir;
             o.auth_token_file = auth_token_file;
             o.table_memory_bytes = whole_number<std::uint64_t>(table_memory_mb, "table_memory_mb", 0, kMaxMb) << 20;
             // Backend settings travel as URI parameters; these keywords are a shorter way to write them.
             const std::string scheme = uri.substr(0, uri.find("://"));
             auto param = [&](const char* keyword, const char* for_scheme, const char* name,
                              const std::optional<std::string>& value) {
               if (!value) return;
               if (scheme != for_scheme)
                 throw Error(Errc::invalid_argument,
                             std::string(keyword) + " applies to " + for_scheme + ":// servers, not " + uri);
               o.uri += (o.uri.find('?') == std::string::npos ? "?" : "&") + std::string(name) + "=" + *value;
             };
             auto text = [](const std::optional<PyInteger>& n, const char* name) {
               return n ? std::optional<std::string>(std::to_string(whole_number<std::uint64_t>(*n, name)))
                        : std::nullopt;
             };
             param("shm_clients", "shm", "clients", text(shm_clients, "shm_clients"));
             param("shm_area_mb", "shm", "area_mb", text(shm_area_mb, "shm_area_mb"));
             param("shm_push", "shm", "push", shm_push);
             param("tcp_push", "tcp", "push", tcp_push);
             return std::make_unique<PyServer>(o);
           }),
           py::arg("uri") = d.uri, py::arg("workers") = d.num_workers, py::arg("mode") = std::string(to_string(d.mode)),
           py::arg("staleness") = d.staleness, py::arg("rule") = std::string(to_string(d.rule.rule)),
           py::arg("lr") = d.rule.lr, py::arg("momentum") = d.rule.momentum, py::arg("beta1") = d.rule.beta1,
           py::arg("beta2") = d.rule.beta2, py::arg("eps") = d.rule.eps, py::arg("weight_decay") = d.rule.weight_decay,
           py::arg("server_id") = d.server_id, py::arg("sync_required") = d.sync_required,
           py::arg("wait_timeout") = seconds(d.wait_timeout),
           py::arg("straggler") = d.straggler == StragglerPolicy::evict ? "evict" : "fail",
           py::arg("arena_mb") = d.arena_bytes >> 20, py::arg("max_keys") = d.max_keys, py::arg("stripes") = d.stripes,
           py::arg("io_threads") = d.io_threads, py::arg("max_connections") = d.max_connections,
           py::arg("max_request_mb") = d.max_request_bytes >> 20, py::arg("checkpoint_dir") = d.checkpoint_dir,
           py::arg("checkpoint_every") = seconds(d.checkpoint_interval), py::arg("restore_dir") = d.restore_dir,
           py::arg("auth_token_file") = d.auth_token_file, py::arg("shm_clients") = py::none(),
           py::arg("shm_area_mb") = py::none(), py::arg("shm_push") = py::none(), py::arg("tcp_push") = py::none(),
           py::arg("table_memory_mb") = d.table_memory_bytes >> 20)
      .def_property_readonly("uri", &PyServer::uri, "The URI clients use (with the real port if 0 was asked).")
      .def("stats", &PyServer::stats, "The shard's counters, parsed from JSON.")
      .def("workers_finished", &PyServer::workers_finished, "True once every worker finished or was evicted.")
      .def("failure", &PyServer::failure, "Why the job cannot go on (a worker died or stalled), or None.")
      .def("stop", &PyServer::stop)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyServer& s, py::handle, py::handle, py::handle) {
        s.stop();
        return false;
      });
}

}  // namespace pskv::python

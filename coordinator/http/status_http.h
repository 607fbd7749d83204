#pragma once
// The status page (--status-listen): a read-only web view of the jobs for
// operators, served with civetweb (Debian's libcivetweb, the server
// prometheus-cpp's exposer uses too) on a port of its own, so that the
// unauthenticated /metrics port stays what Prometheus scrapes and the page
// can sit behind a different firewall rule or proxy.
//
//   GET /                  the job list (HTML; the page polls /api/jobs)
//   GET /jobs/ID           one job: members, generations, throughput and
//                          loss plots (inline SVG; polls /api/jobs/ID)
//   GET /static/app.js, /static/app.css   the page's code (embedded)
//   GET /api/jobs          {"jobs": [...]}: `concordctl jobs -o json`
//   GET /api/jobs/ID       `concordctl status ID -o json` plus "history"
//                          and "generations" (see Note [Job history])
//
// Every request needs the operator token: `Authorization: Bearer TOKEN`, or
// HTTP Basic with the token as the password (any user name), which is what a
// browser sends after its prompt. Else 401 with `WWW-Authenticate: Basic
// realm="concord"`. Then: a method other than GET is 405, an unknown path
// (or job) 404. Plain HTTP only: keep it on loopback or behind a TLS proxy
// (docs/operators.md "Status page").
//
// Thread-safety: handlers run on civetweb's threads and read the core
// through CoreHost (its mutex).

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "coordinator/host/host.h"

struct mg_context;

namespace concord::coordinator {

class StatusHttpServer {
 public:
  // Binds host:port (port 0 picks one); `host` must outlive the server.
  // Errors: INVALID_ARGUMENT (not host:port), UNAVAILABLE (cannot bind).
  static absl::StatusOr<std::unique_ptr<StatusHttpServer>> Start(
      const std::string& address, std::string operator_token, CoreHost* host);
  // Stops serving; returns once every handler has returned.
  ~StatusHttpServer();
  StatusHttpServer(const StatusHttpServer&) = delete;
  StatusHttpServer& operator=(const StatusHttpServer&) = delete;

  int port() const { return port_; }

  // For the handler (civetweb's C callback).
  struct Response {
    int status = 200;
    std::string content_type = "text/plain; charset=utf-8";
    std::string body;
    std::string extra_headers;  // "Name: value\r\n" each
  };
  Response Handle(const std::string& method, const std::string& path,
                  const std::string& authorization) const;

 private:
  StatusHttpServer() = default;
  bool Authorized(const std::string& authorization) const;

  mg_context* ctx_ = nullptr;
  int port_ = 0;
  std::string operator_token_;
  CoreHost* host_ = nullptr;
};

}  // namespace concord::coordinator

#include "coordinator/http/status_http.h"

#include <civetweb.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "common/operator_json.h"
#include "coordinator/http/status_assets.h"

namespace concord::coordinator {
namespace {

using Response = StatusHttpServer::Response;

constexpr char kJson[] = "application/json";

Response Text(int status, std::string body) {
  Response r;
  r.status = status;
  r.body = std::move(body) + "\n";
  return r;
}

Response Json(const OrderedJson& j) {
  Response r;
  r.content_type = kJson;
  r.body = j.dump() + "\n";
  return r;
}

Response Asset(const char* content_type, const char* body) {
  Response r;
  r.content_type = content_type;
  r.body = body;
  return r;
}

OrderedJson HistoryJson(const JobHistory& h) {
  OrderedJson points = OrderedJson::array();
  for (const ProgressPoint& p : h.points()) {
    OrderedJson j{{"time_unix_ms", absl::ToUnixMillis(p.time)},
                  {"step", p.step},
                  {"samples_per_second", p.samples_per_second},
                  {"loss", nullptr},
                  {"members", p.members}};
    if (p.loss.has_value()) j["loss"] = *p.loss;
    points.push_back(std::move(j));
  }
  return OrderedJson{{"spacing_ms", absl::ToInt64Milliseconds(h.spacing())},
                     {"steps_per_second", h.StepsPerSecond()},
                     {"failures", h.failures()},
                     {"points", std::move(points)}};
}

OrderedJson GenerationsJson(const JobHistory& h) {
  OrderedJson out = OrderedJson::array();
  for (const GenerationRecord& g : h.generations()) {
    OrderedJson j{{"generation", g.generation},
                  {"formed_unix_ms", absl::ToUnixMillis(g.formed)},
                  {"members", g.members},
                  {"ended_unix_ms", nullptr},
                  {"end_reason", g.end_reason},
                  {"reform_ms", nullptr}};
    if (g.ended.has_value()) j["ended_unix_ms"] = absl::ToUnixMillis(*g.ended);
    if (g.reform.has_value()) {
      j["reform_ms"] = absl::ToInt64Milliseconds(*g.reform);
    }
    out.push_back(std::move(j));
  }
  return out;
}

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 401:
      return "Unauthorized";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    default:
      return "Internal Server Error";
  }
}

int HandleRequest(mg_connection* conn, void* data) {
  const auto* server = static_cast<const StatusHttpServer*>(data);
  const mg_request_info* info = mg_get_request_info(conn);
  const char* authorization = mg_get_header(conn, "Authorization");
  const Response r = server->Handle(
      info->request_method != nullptr ? info->request_method : "",
      info->local_uri != nullptr ? info->local_uri : "",
      authorization != nullptr ? authorization : "");
  const std::string head = absl::StrCat(
      "HTTP/1.1 ", r.status, " ", Reason(r.status),
      "\r\nContent-Type: ", r.content_type,
      "\r\nContent-Length: ", r.body.size(),
      "\r\nCache-Control: no-store\r\nX-Content-Type-Options: nosniff"
      "\r\nContent-Security-Policy: default-src 'self'; "
      "style-src 'self'; script-src 'self'; img-src 'self' data:"
      "\r\nConnection: close\r\n",
      r.extra_headers, "\r\n");
  mg_write(conn, head.data(), head.size());
  mg_write(conn, r.body.data(), r.body.size());
  return r.status;
}

int LogMessage(const mg_connection*, const char* message) {
  spdlog::warn("status page: {}", message);
  return 1;
}

}  // namespace

absl::StatusOr<std::unique_ptr<StatusHttpServer>> StatusHttpServer::Start(
    const std::string& address, std::string operator_token, CoreHost* host) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("status address '", address, "' is not host:port"));
  }
  std::unique_ptr<StatusHttpServer> server(new StatusHttpServer());
  server->operator_token_ = std::move(operator_token);
  server->host_ = host;
  std::string host_part = address.substr(0, colon);
  if (host_part == "localhost") host_part = "127.0.0.1";
  const std::string ports =
      absl::StrCat(host_part, ":", address.substr(colon + 1));
  const char* options[] = {"listening_ports",
                           ports.c_str(),
                           "num_threads",
                           "4",
                           "request_timeout_ms",
                           "10000",
                           "enable_keep_alive",
                           "no",
                           nullptr};
  mg_callbacks callbacks{};
  callbacks.log_message = LogMessage;
  char error_text[256] = "";
  mg_error_data error{};
  error.text = error_text;
  error.text_buffer_size = sizeof(error_text);
#if CIVETWEB_VERSION_MAJOR == 1 && CIVETWEB_VERSION_MINOR < 16
  // civetweb 1.15 (Debian 12) writes the code through a pointer; 1.16
  // (Debian 13) holds it, with a sub code, in the struct.
  unsigned error_code = 0;
  error.code = &error_code;
#endif
  mg_init_data init{&callbacks, nullptr, options};
  mg_init_library(0);
  server->ctx_ = mg_start2(&init, &error);
  if (server->ctx_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve the status page on '", address, "': ", error_text));
  }
  mg_set_request_handler(server->ctx_, "**", HandleRequest, server.get());
  mg_server_port port{};
  if (mg_get_server_ports(server->ctx_, 1, &port) >= 1) {
    server->port_ = port.port;
  }
  return server;
}

StatusHttpServer::~StatusHttpServer() {
  if (ctx_ != nullptr) mg_stop(ctx_);
}

bool StatusHttpServer::Authorized(const std::string& authorization) const {
  const std::string bearer = BearerTokenOf(authorization);
  if (!bearer.empty()) return ConstantTimeEquals(bearer, operator_token_);
  constexpr absl::string_view kBasic = "Basic ";
  if (!absl::StartsWith(authorization, kBasic)) return false;
  std::string decoded;
  if (!absl::Base64Unescape(authorization.substr(kBasic.size()), &decoded)) {
    return false;
  }
  const size_t colon = decoded.find(':');
  if (colon == std::string::npos) return false;
  return ConstantTimeEquals(decoded.substr(colon + 1), operator_token_);
}

StatusHttpServer::Response StatusHttpServer::Handle(
    const std::string& method, const std::string& path,
    const std::string& authorization) const {
  if (!Authorized(authorization)) {
    Response r = Text(401, "401 unauthorized: the operator token is needed");
    r.extra_headers = "WWW-Authenticate: Basic realm=\"concord\"\r\n";
    return r;
  }
  if (method != "GET") {
    Response r = Text(405,
                      "405 method not allowed: the status page is "
                      "read-only (GET)");
    r.extra_headers = "Allow: GET\r\n";
    return r;
  }
  constexpr absl::string_view kJobPage = "/jobs/";
  constexpr absl::string_view kJobApi = "/api/jobs/";
  if (path == "/" ||
      (absl::StartsWith(path, kJobPage) && path.size() > kJobPage.size() &&
       path.find('/', kJobPage.size()) == std::string::npos)) {
    return Asset("text/html; charset=utf-8", kStatusIndexHtml);
  }
  if (path == "/static/app.js") {
    return Asset("text/javascript; charset=utf-8", kStatusAppJs);
  }
  if (path == "/static/app.css") {
    return Asset("text/css; charset=utf-8", kStatusAppCss);
  }
  if (path == "/api/jobs") {
    const v1::ListJobsResponse jobs =
        host_->Read([](const Core& core) { return core.ListJobs(); });
    OrderedJson j{{"jobs", OrderedJson::array()}};
    for (const auto& job : jobs.jobs()) j["jobs"].push_back(SummaryJson(job));
    return Json(j);
  }
  if (absl::StartsWith(path, kJobApi)) {
    v1::GetJobRequest request;
    request.set_job_id(path.substr(kJobApi.size()));
    auto [status, history] = host_->Read([&](const Core& core) {
      return std::make_pair(core.GetJob(request),
                            core.History(request.job_id()));
    });
    if (!status.ok() || !history.ok()) {
      return Text(
          404,
          absl::StrCat(
              "404 ",
              (status.ok() ? history.status() : status.status()).message()));
    }
    OrderedJson j = StatusJson(*status);
    j["history"] = HistoryJson(*history);
    j["generations"] = GenerationsJson(*history);
    return Json(j);
  }
  return Text(404, absl::StrCat("404 no such page: ", path));
}

}  // namespace concord::coordinator

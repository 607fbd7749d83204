// concordctl: the operator's command line for a coordinator.
//
//   concordctl --endpoint HOST:PORT --token-file F [-o table|json]
//              [--tls-ca F [--tls-cert F --tls-key F]] COMMAND
//     jobs                      every job, one line each
//     status [JOB]              one job in detail (without JOB: as `jobs`)
//     events JOB [--after N] [--limit N]
//     checkpoints JOB           its newest complete checkpoints
//     drain JOB WORKER [--reason TEXT]
//     stop JOB [--reason TEXT]
//     watch JOB [--interval SECONDS]   follow a job until it ends
//                                      (concordctl_watch.h)
//
// The token comes from --token-file or CONCORD_TOKEN_FILE (an operator
// token). Output: a table by default; `-o json` prints one JSON object whose
// field names are documented in docs/operators.md and never change meaning.
// Exit status: 0 on success, 1 when the coordinator refuses or cannot be
// reached (one line on stderr naming the gRPC code), 2 for bad flags; watch:
// 3 when the job FAILED or was STOPPED.

#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "common/environment.h"
#include "common/grpc_auth.h"
#include "common/grpc_status.h"
#include "common/operator_json.h"
#include "common/tls.h"
#include "concord/v1/operator.grpc.pb.h"
#include "tools/concordctl_watch.h"

namespace {

using json = nlohmann::ordered_json;
namespace v1 = concord::v1;

constexpr int kUsageError = 2;
constexpr int kCallError = 1;

struct Flags {
  std::string endpoint = "127.0.0.1:7070";
  std::string token_file;
  concord::TlsFiles tls;
  std::string output = "table";
  int64_t timeout_ms = 10000;
  std::string job;
  std::string worker;
  std::string reason;
  int64_t after = 0;
  int limit = 100;
  double interval_s = 2;
};

// Commands by group, as `concordctl --help` lists them (kubectl's layout).
struct CommandHelp {
  const char* group;
  const char* name;
  const char* description;
};
constexpr CommandHelp kCommands[] = {
    {"Basic commands", "jobs", "List every job, one line each"},
    {"Basic commands", "status",
     "Show one job in detail (without JOB: as jobs)"},
    {"Basic commands", "events", "Print a job's events"},
    {"Basic commands", "checkpoints",
     "List a job's newest complete checkpoints"},
    {"Basic commands", "watch", "Follow a job live until it ends"},
    {"Admin commands", "drain", "Remove a worker from its job"},
    {"Admin commands", "stop", "Stop a job"},
};

void PrintTopHelp() {
  std::string out =
      "concordctl controls a Concord coordinator: it shows jobs and acts on "
      "them.\n";
  std::string group;
  for (const CommandHelp& c : kCommands) {
    if (group != c.group) {
      group = c.group;
      out += absl::StrCat("\n", group, ":\n");
    }
    out += absl::StrFormat("  %-12s %s\n", c.name, c.description);
  }
  out +=
      "\nExamples:\n"
      "  # List every job\n"
      "  concordctl --endpoint 127.0.0.1:7070 --token-file operator.token "
      "jobs\n\n"
      "  # One job as JSON (field names: docs/operators.md)\n"
      "  concordctl status my-job -o json\n\n"
      "  # Follow a job every second until it ends (exit 0: succeeded)\n"
      "  concordctl watch my-job --interval 1\n\n"
      "  # Take a worker out of a job\n"
      "  concordctl drain my-job worker-3 --reason 'bad host'\n"
      "\nOptions (every command):\n"
      "  --endpoint HOST:PORT[,HOST:PORT]  coordinator, or its replicas "
      "(default 127.0.0.1:7070)\n"
      "  --token-file FILE                 operator token (default "
      "$CONCORD_TOKEN_FILE)\n"
      "  -o, --output table|json           output format (default table)\n"
      "  --timeout-ms MS                   deadline of each call (default "
      "10000)\n"
      "  --tls-ca FILE [--tls-cert FILE --tls-key FILE]  TLS / mTLS\n"
      "\nUsage:\n"
      "  concordctl [options] <command> [arguments] [options]\n"
      "\nUse \"concordctl <command> --help\" for more information about a "
      "command.\n";
  std::cout << out;
}

std::string StateName(v1::JobState state) {
  return concord::JobStateName(state);
}

std::string FormatTime(int64_t unix_ms) {
  return concord::FormatUnixMs(unix_ms);
}

using concord::CheckpointJson;
using concord::CheckpointTotalsJson;
using concord::EventJson;
using concord::StatusJson;
using concord::SummaryJson;

// Left-aligned columns separated by two spaces.
void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t i = 0; i < row.size(); ++i) {
      width[i] = std::max(width[i], row[i].size());
    }
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size())
        line += std::string(width[i] - row[i].size() + 2, ' ');
    }
    std::cout << line << "\n";
  }
}

std::string Age(int64_t ms) { return absl::StrFormat("%.1fs", ms / 1000.0); }

void PrintJobsTable(const v1::ListJobsResponse& r) {
  std::vector<std::vector<std::string>> rows = {{"JOB", "STATE", "GENERATION",
                                                 "MEMBERS", "WAITING", "MIN",
                                                 "MAX", "FAILURE"}};
  for (const auto& s : r.jobs()) {
    rows.push_back({s.job_id(), StateName(s.state()),
                    absl::StrCat(s.generation()), absl::StrCat(s.world_size()),
                    absl::StrCat(s.waiting()), absl::StrCat(s.min_workers()),
                    absl::StrCat(s.max_workers()), s.failure()});
  }
  PrintTable(rows);
}

void PrintEventsTable(const google::protobuf::RepeatedPtrField<v1::Event>& es) {
  std::vector<std::vector<std::string>> rows = {
      {"SEQ", "TIME", "KIND", "WORKER", "MESSAGE"}};
  for (const auto& e : es) {
    rows.push_back({absl::StrCat(e.seq()), FormatTime(e.time_unix_ms()),
                    e.kind(), e.worker_id(), e.message()});
  }
  PrintTable(rows);
}

// A write that failed and none written since: one line.
void PrintCheckpointFailing(const v1::CheckpointTotals& t) {
  if (!t.has_failing()) return;
  const v1::CheckpointReport& c = t.failing();
  std::cout << "checkpoints failing: step " << c.step() << " not written to "
            << c.path() << " on " << c.node() << " at "
            << FormatTime(c.written_unix_ms()) << ": " << c.error() << "\n";
}

void PrintStatusTable(const v1::JobStatus& s) {
  std::cout << "job " << s.spec().job_id() << ": " << StateName(s.state())
            << ", generation " << s.generation() << ", " << s.members_size()
            << " member(s) (min " << s.spec().min_workers() << ", max "
            << s.spec().max_workers() << "), " << s.waiting_size()
            << " waiting, authoritative rank " << s.authoritative_rank();
  if (s.state() == v1::JOB_STATE_RUNNING) {
    std::cout << ", hang timeout "
              << (s.hang_timeout_ms() > 0
                      ? absl::StrFormat("%.1fs", s.hang_timeout_ms() / 1000.0)
                      : std::string("off"));
  }
  std::cout << "\n";
  if (!s.failure().empty()) std::cout << "reason: " << s.failure() << "\n";
  std::vector<std::vector<std::string>> rows = {
      {"RANK", "WORKER", "HOST", "STEP", "HEARTBEAT", "SAMPLES/S", "STEP_MS",
       "ALLREDUCE_MS", "NOTE"}};
  auto add = [&](const v1::MemberStatus& m, bool waiting) {
    std::string note = waiting ? "waiting" : "";
    if (m.rank() == s.authoritative_rank() && !waiting) note = "authoritative";
    if (m.completed()) note = "completed";
    if (const std::string health = concord::ctl::HealthNote(m);
        !health.empty()) {
      note = note.empty() ? health : absl::StrCat(note, ", ", health);
    }
    rows.push_back(
        {waiting ? "-" : absl::StrCat(m.rank()), m.worker_id(), m.host(),
         absl::StrCat(m.committed_step()), Age(m.last_heartbeat_age_ms()),
         absl::StrFormat("%.1f", m.samples_per_second()),
         absl::StrFormat("%.1f", m.ddp().step_ms()),
         absl::StrFormat("%.1f", m.ddp().allreduce_wait_ms()), note});
  };
  for (const auto& m : s.members()) add(m, false);
  for (const auto& m : s.waiting()) add(m, true);
  for (const auto& m : s.expected()) {
    add(m, true);
    rows.back().back() = "expected";  // a survivor not back yet
  }
  std::cout << "\n";
  PrintTable(rows);
  // See Note [Flight recorder]: sent while something may be wrong.
  bool said = false;
  for (const auto& m : s.members()) {
    const v1::WorkerProgress& p = m.progress();
    if (p.recent_size() == 0) continue;
    if (!said) std::cout << "\nlast collectives (flight recorder):\n";
    said = true;
    std::cout << "  rank " << m.rank() << " (" << m.worker_id() << "):";
    for (const v1::FlightRecord& r : p.recent()) {
      std::cout << "\n    "
                << (r.seq() > 0 ? absl::StrCat("#", r.seq()) : "group") << " "
                << r.kind() << " " << r.bytes() << " B, issued "
                << Age(r.issued_ago_ms()) << " ago, "
                << (r.ended_ago_ms() >= 0
                        ? absl::StrCat("ended ", Age(r.ended_ago_ms()), " ago")
                        : std::string("in flight"));
    }
    std::cout << "\n";
  }
  if (s.checkpoints_size() > 0) {
    const v1::CheckpointReport& c = *s.checkpoints().rbegin();
    std::cout << "\nlast checkpoint: step " << c.step() << " at "
              << FormatTime(c.written_unix_ms()) << ", " << c.path() << " on "
              << c.node() << " (" << s.checkpoint_totals().written()
              << " written; concordctl checkpoints " << s.spec().job_id()
              << ")\n";
  }
  PrintCheckpointFailing(s.checkpoint_totals());
  std::cout << "\nrecent events:\n";
  PrintEventsTable(s.recent_events());
}

void PrintCheckpointsTable(const v1::JobStatus& s) {
  std::vector<std::vector<std::string>> rows = {
      {"STEP", "EPOCH", "SAMPLES", "WORLD", "MB", "STALL_MS", "WRITE_S",
       "WRITTEN", "NODE", "PATH"}};
  for (auto it = s.checkpoints().rbegin(); it != s.checkpoints().rend(); ++it) {
    const v1::CheckpointReport& c = *it;
    rows.push_back({absl::StrCat(c.step()), absl::StrCat(c.epoch()),
                    absl::StrCat(c.samples()), absl::StrCat(c.world_size()),
                    absl::StrFormat("%.1f", c.bytes() / 1e6),
                    absl::StrFormat("%.1f", c.stall_seconds() * 1e3),
                    absl::StrFormat("%.2f", c.write_seconds()),
                    FormatTime(c.written_unix_ms()), c.node(), c.path()});
  }
  PrintTable(rows);
  const v1::CheckpointTotals& t = s.checkpoint_totals();
  std::cout << "\n"
            << t.written() << " written, " << t.skipped()
            << " skipped (due while the previous one was being written), "
            << t.failed() << " failed\n";
  PrintCheckpointFailing(t);
}

[[noreturn]] void Fail(const grpc::Status& status) {
  const absl::Status s = concord::FromGrpcStatus(status);
  std::cerr << "concordctl: " << absl::StatusCodeToString(s.code()) << ": "
            << s.message() << "\n";
  std::exit(kCallError);
}

// `concordctl --help` with no command named prints kubectl's layout, not
// CLI11's.
bool WantsTopHelp(int argc, char** argv) {
  bool help = false;
  bool command = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") help = true;
    for (const CommandHelp& c : kCommands) command |= a == c.name;
  }
  return help && !command;
}

// The subcommands, each parsed into `Flags`.
struct Commands {
  CLI::App* jobs;
  CLI::App* status;
  CLI::App* events;
  CLI::App* checkpoints;
  CLI::App* drain;
  CLI::App* stop;
  CLI::App* watch;
};

void DeclareGlobalOptions(CLI::App& app, Flags& f) {
  app.add_option("--endpoint", f.endpoint,
                 "Coordinator HOST:PORT (or replicas: HOST:PORT,HOST:PORT)")
      ->capture_default_str();
  app.add_option("--token-file", f.token_file,
                 "Operator token file (default $CONCORD_TOKEN_FILE)");
  app.add_option("--tls-ca", f.tls.ca,
                 "PEM CA that signed the coordinator's certificate (TLS)");
  app.add_option("--tls-cert", f.tls.cert,
                 "PEM client certificate for mTLS (with --tls-key)");
  app.add_option("--tls-key", f.tls.key, "PEM private key of --tls-cert");
  app.add_option("-o,--output", f.output, "table or json")
      ->capture_default_str()
      ->check(CLI::IsMember({"table", "json"}));
  app.add_option("--timeout-ms", f.timeout_ms, "Deadline of the call")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
}

Commands DeclareCommands(CLI::App& app, Flags& f) {
  Commands c;
  c.jobs = app.add_subcommand("jobs", "List every job");
  c.status = app.add_subcommand("status", "Show one job (or all)");
  c.status->add_option("job", f.job, "Job id");
  c.events = app.add_subcommand("events", "A job's events");
  c.events->add_option("job", f.job, "Job id")->required();
  c.events->add_option("--after", f.after, "Only events after this seq")
      ->check(CLI::NonNegativeNumber);
  c.events->add_option("--limit", f.limit, "At most this many (1-1000)")
      ->check(CLI::Range(1, 1000));
  c.checkpoints = app.add_subcommand(
      "checkpoints",
      "A job's newest complete checkpoints (as its node agents reported "
      "them), newest first");
  c.checkpoints->add_option("job", f.job, "Job id")->required();
  c.drain = app.add_subcommand("drain", "Remove a worker from a job");
  c.drain->add_option("job", f.job, "Job id")->required();
  c.drain->add_option("worker", f.worker, "Worker id")->required();
  c.drain->add_option("--reason", f.reason, "Why (recorded in the events)");
  c.stop = app.add_subcommand("stop", "Stop a job");
  c.stop->add_option("job", f.job, "Job id")->required();
  c.stop->add_option("--reason", f.reason, "Why (recorded in the events)");
  c.watch = app.add_subcommand(
      "watch",
      "Follow a job live until it ends: a table redrawn in place on a "
      "terminal, one snapshot per interval otherwise (-o json: one object "
      "per line). Exit 0 when the job succeeded, 3 when it failed or was "
      "stopped, 1 when the coordinator refuses (unknown job) or stays "
      "unreachable");
  c.watch->add_option("job", f.job, "Job id")->required();
  c.watch->add_option("--interval", f.interval_s, "Seconds between updates")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  c.watch->footer(
      "Example:\n  concordctl watch my-job --interval 1 --endpoint "
      "127.0.0.1:7070 --token-file operator.token");
  return c;
}

[[noreturn]] void UsageError(const std::string& message) {
  std::fprintf(stderr, "concordctl: %s\n", message.c_str());
  std::exit(kUsageError);
}

// The operator token and the TLS credentials the flags name; a usage error
// (exit 2) when either is missing or unreadable.
struct Credentials {
  std::string token;
  std::shared_ptr<grpc::ChannelCredentials> channel;
};

Credentials LoadCredentials(Flags& f) {
  auto loaded = concord::LoadClientCredentials(&f.token_file, f.tls);
  if (!loaded.ok()) UsageError(std::string(loaded.status().message()));
  return {loaded->token, concord::ChannelCredentials(loaded->tls)};
}

// Replicas (A,B,...): only the leader listens; take the first that accepts a
// connection within its share of the deadline (the last one otherwise).
std::shared_ptr<grpc::Channel> Connect(
    const Flags& f, const std::shared_ptr<grpc::ChannelCredentials>& creds) {
  const std::vector<std::string> replicas =
      absl::StrSplit(f.endpoint, ',', absl::SkipWhitespace());
  std::shared_ptr<grpc::Channel> channel;
  for (const std::string& replica : replicas) {
    channel = grpc::CreateChannel(replica, creds);
    if (replicas.size() == 1 ||
        channel->WaitForConnected(
            std::chrono::system_clock::now() +
            std::chrono::milliseconds(f.timeout_ms /
                                      static_cast<int>(replicas.size())))) {
      break;
    }
  }
  return channel != nullptr ? channel : grpc::CreateChannel(f.endpoint, creds);
}

// One command's call to the coordinator and its output; a refused call ends
// the program through `Fail`.
class Ctl {
 public:
  using ContextFn = std::function<std::unique_ptr<grpc::ClientContext>()>;
  Ctl(v1::OperatorService::Stub& stub, ContextFn context, const Flags& f)
      : stub_(stub),
        context_(std::move(context)),
        f_(f),
        json_(f.output == "json") {}

  int Watch() {
    concord::ctl::WatchOptions w;
    w.job = f_.job;
    w.interval = absl::Seconds(f_.interval_s);
    w.json = json_;
    return concord::ctl::Watch(stub_, context_, w);
  }

  void Jobs() {
    v1::ListJobsResponse r;
    Check(stub_.ListJobs(context_().get(), {}, &r));
    if (!json_) return PrintJobsTable(r);
    json j{{"jobs", json::array()}};
    for (const auto& job : r.jobs()) j["jobs"].push_back(SummaryJson(job));
    Print(j);
  }

  void Status() {
    const v1::JobStatus r = GetJob();
    if (!json_) return PrintStatusTable(r);
    Print(StatusJson(r));
  }

  void Events() {
    v1::ListEventsRequest req;
    req.set_job_id(f_.job);
    req.set_after_seq(f_.after);
    req.set_limit(f_.limit);
    v1::ListEventsResponse r;
    Check(stub_.ListEvents(context_().get(), req, &r));
    if (!json_) return PrintEventsTable(r.events());
    json j{{"job_id", f_.job}, {"events", json::array()}};
    for (const auto& e : r.events()) j["events"].push_back(EventJson(e));
    Print(j);
  }

  void Checkpoints() {
    const v1::JobStatus r = GetJob();
    if (!json_) return PrintCheckpointsTable(r);
    json j{{"job_id", f_.job},
           {"checkpoints", json::array()},
           {"totals", CheckpointTotalsJson(r.checkpoint_totals())}};
    for (auto it = r.checkpoints().rbegin(); it != r.checkpoints().rend();
         ++it) {
      j["checkpoints"].push_back(CheckpointJson(*it));
    }
    Print(j);
  }

  void Drain() {
    v1::DrainWorkerRequest req;
    req.set_job_id(f_.job);
    req.set_worker_id(f_.worker);
    req.set_reason(f_.reason);
    v1::DrainWorkerResponse r;
    Check(stub_.DrainWorker(context_().get(), req, &r));
    if (json_) {
      return Print({{"job_id", f_.job},
                    {"worker_id", f_.worker},
                    {"ended_generation", r.ended_generation()}});
    }
    std::cout << "drained " << f_.worker << " from " << f_.job;
    if (r.ended_generation() > 0) {
      std::cout << " (generation " << r.ended_generation() << " ended)";
    }
    std::cout << "\n";
  }

  void Stop() {
    v1::StopJobRequest req;
    req.set_job_id(f_.job);
    req.set_reason(f_.reason);
    v1::StopJobResponse r;
    Check(stub_.StopJob(context_().get(), req, &r));
    if (json_) {
      return Print({{"job_id", f_.job}, {"state", StateName(r.state())}});
    }
    std::cout << "job " << f_.job << ": " << StateName(r.state()) << "\n";
  }

 private:
  static void Check(const grpc::Status& s) {
    if (!s.ok()) Fail(s);
  }
  static void Print(const json& j) { std::cout << j.dump(2) << "\n"; }

  v1::JobStatus GetJob() {
    v1::GetJobRequest req;
    req.set_job_id(f_.job);
    v1::JobStatus r;
    Check(stub_.GetJob(context_().get(), req, &r));
    return r;
  }

  v1::OperatorService::Stub& stub_;
  ContextFn context_;
  const Flags& f_;
  const bool json_;
};

}  // namespace

int main(int argc, char** argv) {
  if (WantsTopHelp(argc, argv)) {
    PrintTopHelp();
    return 0;
  }
  Flags f;
  CLI::App app{"Operator CLI of a Concord coordinator", "concordctl"};
  app.require_subcommand(1);
  // Global options may follow the subcommand too (`status JOB -o json`).
  app.fallthrough();
  DeclareGlobalOptions(app, f);
  const Commands commands = DeclareCommands(app, f);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string message = e.what();
    std::replace(message.begin(), message.end(), '\n', ' ');
    UsageError(message);
  }
  const Credentials credentials = LoadCredentials(f);
  auto stub = v1::OperatorService::NewStub(Connect(f, credentials.channel));
  Ctl ctl(
      *stub,
      [&] {
        auto c = std::make_unique<grpc::ClientContext>();
        c->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(f.timeout_ms));
        concord::AddBearerToken(*c, credentials.token);
        return c;
      },
      f);
  if (commands.watch->parsed()) return ctl.Watch();
  if (commands.jobs->parsed() || (commands.status->parsed() && f.job.empty())) {
    ctl.Jobs();
  } else if (commands.status->parsed()) {
    ctl.Status();
  } else if (commands.events->parsed()) {
    ctl.Events();
  } else if (commands.checkpoints->parsed()) {
    ctl.Checkpoints();
  } else if (commands.drain->parsed()) {
    ctl.Drain();
  } else if (commands.stop->parsed()) {
    ctl.Stop();
  }
  return 0;
}

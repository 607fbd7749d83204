#include "tools/concordctl_watch.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/operator_json.h"

namespace concord::ctl {

std::string HealthNote(const v1::MemberStatus& m) {
  const v1::WorkerProgress& p = m.progress();
  if (m.health() == "waiting") {
    return absl::StrFormat(
        "waiting %.1fs in %s", p.pending_ms() / 1000.0,
        p.pending_seq() > 0
            ? absl::StrCat("#", p.pending_seq(), " (", p.pending_kind(), ")")
            : absl::StrCat("a group's ", p.pending_kind()));
  }
  if (m.health() == "busy") return absl::StrCat("busy: ", p.activity());
  if (m.health() == "slow") {
    return absl::StrFormat("straggler: own work %.1f ms a step", p.own_ms());
  }
  if (m.health() == "stopped") {
    return absl::StrFormat("process stopped (seen %.1fs ago)",
                           m.process_age_ms() / 1000.0);
  }
  std::string note = m.health();
  // What its node agent sees, where that tells more than the health.
  if (m.has_process() && m.process().state() == "disk") {
    absl::StrAppend(&note, note.empty() ? "" : ", ", "process in a disk wait");
  }
  return note;
}
namespace {

constexpr int kSucceeded = 0;
constexpr int kCallError = 1;
constexpr int kJobFailed = 3;

std::string Table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t i = 0; i < row.size(); ++i) {
      width[i] = std::max(width[i], row[i].size());
    }
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) {
        line += std::string(width[i] - row[i].size() + 2, ' ');
      }
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

int64_t MaxStep(const v1::JobStatus& s) {
  int64_t step = 0;
  for (const auto& m : s.members()) step = std::max(step, m.committed_step());
  return step;
}

// One snapshot as text; `steps_per_second` < 0: not known yet.
std::string Render(const v1::JobStatus& s, double steps_per_second) {
  double samples = 0;
  for (const auto& m : s.members()) samples += m.samples_per_second();
  std::string out = absl::StrFormat(
      "job %s  %s  generation %d  members %d (min %d, max %d)  waiting %d\n"
      "step %d  %s steps/s  %.1f samples/s  %s\n",
      s.spec().job_id(), JobStateName(s.state()), s.generation(),
      s.members_size(), s.spec().min_workers(), s.spec().max_workers(),
      s.waiting_size(), MaxStep(s),
      steps_per_second < 0 ? std::string("-")
                           : absl::StrFormat("%.1f", steps_per_second),
      samples,
      absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::Now(),
                       absl::LocalTimeZone()));
  if (!s.failure().empty()) out += absl::StrCat("reason: ", s.failure(), "\n");
  std::vector<std::vector<std::string>> rows = {{"RANK", "WORKER", "HOST",
                                                 "STEP", "SAMPLES/S", "LOSS",
                                                 "HEARTBEAT", "NOTE"}};
  auto add = [&](const v1::MemberStatus& m, const std::string& note) {
    rows.push_back(
        {m.rank() < 0 ? "-" : absl::StrCat(m.rank()), m.worker_id(), m.host(),
         absl::StrCat(m.committed_step()),
         absl::StrFormat("%.1f", m.samples_per_second()),
         m.has_loss() ? absl::StrFormat("%.4g", m.loss()) : "-",
         absl::StrFormat("%.1fs", m.last_heartbeat_age_ms() / 1000.0), note});
  };
  for (const auto& m : s.members()) {
    std::string note = m.completed()                        ? "completed"
                       : m.rank() == s.authoritative_rank() ? "authoritative"
                                                            : "";
    if (const std::string health = HealthNote(m); !health.empty()) {
      note = note.empty() ? health : absl::StrCat(note, ", ", health);
    }
    add(m, note);
  }
  for (const auto& m : s.waiting()) add(m, "waiting");
  for (const auto& m : s.expected()) add(m, "expected");
  return out + "\n" + Table(rows);
}

bool Ended(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_STOPPED;
}

}  // namespace

int Watch(v1::OperatorService::Stub& stub,
          const std::function<std::unique_ptr<grpc::ClientContext>()>& context,
          const WatchOptions& options) {
  const bool tty = !options.json && isatty(STDOUT_FILENO) == 1;
  std::optional<std::pair<absl::Time, int64_t>> previous;
  std::optional<absl::Time> unreachable_since;
  bool first = true;
  while (true) {
    v1::GetJobRequest request;
    request.set_job_id(options.job);
    v1::JobStatus status;
    const grpc::Status s = stub.GetJob(context().get(), request, &status);
    const absl::Time now = absl::Now();
    if (!s.ok()) {
      const absl::Status error = FromGrpcStatus(s);
      const bool transient =
          error.code() == absl::StatusCode::kUnavailable ||
          error.code() == absl::StatusCode::kDeadlineExceeded;
      if (!unreachable_since.has_value()) unreachable_since = now;
      if (!transient || now - *unreachable_since > options.timeout) {
        std::cerr << "concordctl: " << absl::StatusCodeToString(error.code())
                  << ": " << error.message() << "\n";
        return kCallError;
      }
      std::cerr << "concordctl: " << absl::StatusCodeToString(error.code())
                << ": " << error.message() << " (retrying)\n";
    } else {
      unreachable_since.reset();
      const int64_t step = MaxStep(status);
      double rate = -1;
      if (previous.has_value() && now > previous->first &&
          step >= previous->second) {
        rate = static_cast<double>(step - previous->second) /
               absl::ToDoubleSeconds(now - previous->first);
      }
      previous = std::make_pair(now, step);
      if (options.json) {
        OrderedJson j = StatusJson(status);
        std::cout << j.dump() << std::endl;
      } else if (tty) {
        // Home, the snapshot with each line's rest cleared, clear below.
        std::string text = Render(status, rate);
        std::string framed = "\x1b[H";
        std::istringstream lines(text);
        for (std::string line; std::getline(lines, line);) {
          framed += line + "\x1b[K\n";
        }
        framed += "\x1b[J";
        if (first) std::cout << "\x1b[2J";
        std::cout << framed << std::flush;
      } else {
        if (!first) std::cout << "\n";
        std::cout << Render(status, rate) << std::flush;
      }
      first = false;
      if (Ended(status.state())) {
        return status.state() == v1::JOB_STATE_SUCCEEDED ? kSucceeded
                                                         : kJobFailed;
      }
    }
    absl::SleepFor(options.interval);
  }
}

}  // namespace concord::ctl

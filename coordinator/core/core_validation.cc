#include "coordinator/core/core_validation.h"

#include <cmath>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/job_defaults.h"
#include "common/status_macros.h"

namespace concord::coordinator {
namespace {

constexpr size_t kMinSecretLength = 16;
constexpr size_t kMaxSecretLength = 256;
constexpr size_t kMaxHostLength = 255;
constexpr size_t kMaxMessageLength = 4096;
constexpr size_t kMaxKeyLength = 1024;
constexpr size_t kMaxValueLength = 4 << 20;
constexpr int kMaxKeys = 4096;
constexpr int64_t kMaxHeartbeatIntervalMs = 3600 * 1000;
constexpr int64_t kMaxHeartbeatTimeoutMs = 24 * 3600 * 1000;
constexpr int64_t kMaxRendezvousTimeoutMs = 7LL * 24 * 3600 * 1000;
constexpr int64_t kDefaultSettleMs = 2000;
constexpr int64_t kMaxHangTimeoutMs = 24 * 3600 * 1000;
constexpr int64_t kMaxStragglerCooldownMs = 24 * 3600 * 1000;
// A collective's kind or an activity in WorkerProgress.
constexpr size_t kMaxKindLength = 64;
// WorkerProgress.recent's entries.
constexpr int kMaxRecent = 64;

absl::Status Invalid(const char* field, const std::string& rule) {
  return absl::InvalidArgumentError(absl::StrCat(field, " ", rule));
}

absl::Status ValidateSecret(const std::string& secret) {
  if (secret.size() < kMinSecretLength || secret.size() > kMaxSecretLength) {
    return Invalid(
        "worker_secret",
        absl::StrFormat("must have %d to %d characters; got %d",
                        kMinSecretLength, kMaxSecretLength, secret.size()));
  }
  for (char c : secret) {
    if (c < '!' || c > '~') {
      return Invalid("worker_secret", "must be printable ASCII");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateCaller(const std::string& job_id,
                            const std::string& worker_id,
                            const std::string& secret) {
  CONCORD_RETURN_IF_ERROR(ValidateId("job_id", job_id));
  CONCORD_RETURN_IF_ERROR(ValidateId("worker_id", worker_id));
  return ValidateSecret(secret);
}

// Strict UTF-8 (no overlong forms, surrogates or code points past
// U+10FFFF): what protobuf requires of a proto3 `string` when it parses
// one. gRPC refuses other bytes before they arrive, but a record holding
// them could not be read back after a restart, so the core checks too.
bool IsUtf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;  // truncated sequence
    for (size_t k = 1; k <= n; ++k) {
      const auto t = static_cast<unsigned char>(s[i + k]);
      if ((t & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (t & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += n + 1;
  }
  return true;
}

// Free text and string keys: at most `max` bytes of UTF-8.
absl::Status ValidText(const char* field, const std::string& s, size_t max) {
  if (s.size() > max) {
    return Invalid(field,
                   absl::StrFormat("is %d bytes; at most %d", s.size(), max));
  }
  if (!IsUtf8(s)) return Invalid(field, "is not valid UTF-8");
  return absl::OkStatus();
}

absl::Status NonNegative(const char* field, int64_t v) {
  if (v >= 0) return absl::OkStatus();
  return Invalid(field, absl::StrCat("must not be negative; got ", v));
}

absl::Status FiniteNonNegative(const char* field, double v) {
  if (std::isfinite(v) && v >= 0) return absl::OkStatus();
  return Invalid(field, absl::StrCat("must be finite and >= 0; got ", v));
}

absl::Status ValidateWait(int64_t ms) {
  if (ms >= 0 && ms <= kMaxWaitMs) return absl::OkStatus();
  return Invalid("wait_timeout_ms",
                 absl::StrFormat("must be in [0, %d]; got %d", kMaxWaitMs, ms));
}

absl::Status ValidateKey(const std::string& key) {
  if (key.empty()) return Invalid("key", "is empty");
  return ValidText("key", key, kMaxKeyLength);
}

absl::Status ValidateGeneration(int64_t generation) {
  return NonNegative("generation", generation);
}

}  // namespace

absl::Status ValidateId(const char* field, const std::string& id) {
  if (id.empty()) return Invalid(field, "is empty");
  if (id.size() > kMaxIdLength) {
    return Invalid(field, absl::StrFormat("is %d characters; at most %d",
                                          id.size(), kMaxIdLength));
  }
  if (id[0] == '.') return Invalid(field, "must not start with '.'");
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '.' || c == '_' ||
                    c == '-' || c == ':';
    if (!ok) {
      return Invalid(field, "may only contain letters, digits and . _ : -");
    }
  }
  return absl::OkStatus();
}

v1::JobSpec WithDefaults(v1::JobSpec spec) {
  if (spec.heartbeat_interval_ms() == 0) {
    spec.set_heartbeat_interval_ms(kDefaultHeartbeatIntervalMs);
  }
  if (spec.heartbeat_timeout_ms() == 0) {
    spec.set_heartbeat_timeout_ms(kDefaultHeartbeatTimeoutMs);
  }
  if (spec.rendezvous_timeout_ms() == 0) {
    spec.set_rendezvous_timeout_ms(kDefaultRendezvousTimeoutMs);
  }
  if (spec.settle_ms() == 0) {
    spec.set_settle_ms(
        std::min(kDefaultSettleMs, spec.rendezvous_timeout_ms() / 2));
  }
  if (spec.stragglers().empty()) spec.set_stragglers("report");
  if (spec.straggler_cooldown_ms() == 0) {
    spec.set_straggler_cooldown_ms(kDefaultStragglerCooldownMs);
  }
  return spec;
}

absl::Status ValidateSpec(const v1::JobSpec& spec) {
  auto field = [](const char* name) { return absl::StrCat("spec.", name); };
  if (absl::Status s = ValidateId("spec.job_id", spec.job_id()); !s.ok()) {
    return s;
  }
  if (spec.min_workers() < 1 || spec.min_workers() > spec.max_workers() ||
      spec.max_workers() > kMaxWorkersPerJob) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "need 1 <= min_workers <= max_workers <= %d; got min_workers %d, "
        "max_workers %d",
        kMaxWorkersPerJob, spec.min_workers(), spec.max_workers()));
  }
  if (spec.heartbeat_interval_ms() <= 0 ||
      spec.heartbeat_interval_ms() > kMaxHeartbeatIntervalMs) {
    return absl::InvalidArgumentError(
        absl::StrFormat("heartbeat_interval_ms must be in [1, %d]; got %d",
                        kMaxHeartbeatIntervalMs, spec.heartbeat_interval_ms()));
  }
  if (const std::string problem = HeartbeatTimeoutProblem(
          spec.heartbeat_interval_ms(), spec.heartbeat_timeout_ms(),
          "heartbeat_interval_ms", "heartbeat_timeout_ms");
      !problem.empty()) {
    return absl::InvalidArgumentError(problem);
  }
  if (spec.heartbeat_timeout_ms() > kMaxHeartbeatTimeoutMs) {
    return absl::InvalidArgumentError(
        absl::StrFormat("heartbeat_timeout_ms must be at most %d; got %d",
                        kMaxHeartbeatTimeoutMs, spec.heartbeat_timeout_ms()));
  }
  if (spec.rendezvous_timeout_ms() <= 0 ||
      spec.rendezvous_timeout_ms() > kMaxRendezvousTimeoutMs) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rendezvous_timeout_ms must be in [1, %d]; got %d",
                        kMaxRendezvousTimeoutMs, spec.rendezvous_timeout_ms()));
  }
  if (spec.settle_ms() < 0 ||
      spec.settle_ms() >= spec.rendezvous_timeout_ms()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s must be in [0, rendezvous_timeout_ms (%d)); got %d",
        field("settle_ms"), spec.rendezvous_timeout_ms(), spec.settle_ms()));
  }
  if (spec.hang_timeout_ms() < -1 ||
      spec.hang_timeout_ms() > kMaxHangTimeoutMs) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s must be -1 (off), 0 (derived) or a time in ms up to %d; got %d",
        field("hang_timeout_ms"), kMaxHangTimeoutMs, spec.hang_timeout_ms()));
  }
  if (!spec.stragglers().empty() && spec.stragglers() != "report" &&
      spec.stragglers() != "evict") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s must be \"report\" or \"evict\"; got \"%s\"", field("stragglers"),
        absl::CHexEscape(spec.stragglers().substr(0, 64))));
  }
  if (spec.straggler_cooldown_ms() < 0 ||
      spec.straggler_cooldown_ms() > kMaxStragglerCooldownMs) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must be in [0, %d] (0: the default); got %d",
                        field("straggler_cooldown_ms"), kMaxStragglerCooldownMs,
                        spec.straggler_cooldown_ms()));
  }
  CONCORD_RETURN_IF_ERROR(ValidText(
      "spec.checkpoint_dir", spec.checkpoint_dir(), kMaxCheckpointDirLength));
  if (const std::string problem = CheckpointDirProblem(spec.checkpoint_dir());
      !problem.empty()) {
    return Invalid("spec.checkpoint_dir", problem);
  }
  return absl::OkStatus();
}

absl::Status CompareSpecs(const v1::JobSpec& job, const v1::JobSpec& got) {
  auto differs = [&](const char* field, int64_t have, int64_t want) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "spec.%s differs from job %s: job has %d, request has %d", field,
        job.job_id(), have, want));
  };
  if (job.min_workers() != got.min_workers()) {
    return differs("min_workers", job.min_workers(), got.min_workers());
  }
  if (job.max_workers() != got.max_workers()) {
    return differs("max_workers", job.max_workers(), got.max_workers());
  }
  if (job.heartbeat_interval_ms() != got.heartbeat_interval_ms()) {
    return differs("heartbeat_interval_ms", job.heartbeat_interval_ms(),
                   got.heartbeat_interval_ms());
  }
  if (job.heartbeat_timeout_ms() != got.heartbeat_timeout_ms()) {
    return differs("heartbeat_timeout_ms", job.heartbeat_timeout_ms(),
                   got.heartbeat_timeout_ms());
  }
  if (job.rendezvous_timeout_ms() != got.rendezvous_timeout_ms()) {
    return differs("rendezvous_timeout_ms", job.rendezvous_timeout_ms(),
                   got.rendezvous_timeout_ms());
  }
  if (job.settle_ms() != got.settle_ms()) {
    return differs("settle_ms", job.settle_ms(), got.settle_ms());
  }
  if (job.hang_timeout_ms() != got.hang_timeout_ms()) {
    return differs("hang_timeout_ms", job.hang_timeout_ms(),
                   got.hang_timeout_ms());
  }
  if (job.stragglers() != got.stragglers()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "spec.stragglers differs from job %s: job has \"%s\", request has "
        "\"%s\"",
        job.job_id(), job.stragglers(), got.stragglers()));
  }
  if (job.straggler_cooldown_ms() != got.straggler_cooldown_ms()) {
    return differs("straggler_cooldown_ms", job.straggler_cooldown_ms(),
                   got.straggler_cooldown_ms());
  }
  if (job.checkpoint_dir() != got.checkpoint_dir()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "spec.checkpoint_dir differs from job %s: job has \"%s\", request "
        "has \"%s\" (one job's checkpoints live in one folder)",
        job.job_id(), job.checkpoint_dir(), got.checkpoint_dir()));
  }
  return absl::OkStatus();
}

absl::Status ValidateRequest(const v1::JoinRequest& r) {
  CONCORD_RETURN_IF_ERROR(ValidateId("worker_id", r.worker_id()));
  CONCORD_RETURN_IF_ERROR(ValidateSecret(r.worker_secret()));
  CONCORD_RETURN_IF_ERROR(ValidText("host", r.host(), kMaxHostLength));
  CONCORD_RETURN_IF_ERROR(NonNegative("committed_step", r.committed_step()));
  CONCORD_RETURN_IF_ERROR(
      NonNegative("previous_generation", r.previous_generation()));
  CONCORD_RETURN_IF_ERROR(
      ValidText("reform_reason", r.reform_reason(), kMaxMessageLength));
  if (r.probe_port() < 0 || r.probe_port() > 65535) {
    return Invalid("probe_port", absl::StrCat("must be a port (0..65535); got ",
                                              r.probe_port()));
  }
  if (r.unreachable_size() > r.spec().max_workers()) {
    return Invalid("unreachable",
                   absl::StrCat(r.unreachable_size(),
                                " workers named, more than max_workers"));
  }
  for (const std::string& w : r.unreachable()) {
    CONCORD_RETURN_IF_ERROR(ValidateId("unreachable", w));
    if (w == r.worker_id()) {
      return Invalid("unreachable", "names the worker itself");
    }
  }
  return ValidateWait(r.wait_timeout_ms());
}

absl::Status ValidateRequest(const v1::HeartbeatRequest& r) {
  CONCORD_RETURN_IF_ERROR(
      ValidateCaller(r.job_id(), r.worker_id(), r.worker_secret()));
  CONCORD_RETURN_IF_ERROR(ValidateGeneration(r.generation()));
  CONCORD_RETURN_IF_ERROR(NonNegative("step", r.step()));
  CONCORD_RETURN_IF_ERROR(
      FiniteNonNegative("samples_per_second", r.samples_per_second()));
  if (r.has_loss() && !std::isfinite(r.loss())) {
    return Invalid("loss", absl::StrCat("must be finite; got ", r.loss()));
  }
  const v1::DdpTimings& d = r.ddp();
  CONCORD_RETURN_IF_ERROR(FiniteNonNegative("ddp.step_ms", d.step_ms()));
  CONCORD_RETURN_IF_ERROR(FiniteNonNegative("ddp.forward_ms", d.forward_ms()));
  CONCORD_RETURN_IF_ERROR(
      FiniteNonNegative("ddp.backward_ms", d.backward_ms()));
  CONCORD_RETURN_IF_ERROR(
      FiniteNonNegative("ddp.allreduce_wait_ms", d.allreduce_wait_ms()));
  CONCORD_RETURN_IF_ERROR(
      FiniteNonNegative("ddp.optimizer_ms", d.optimizer_ms()));
  CONCORD_RETURN_IF_ERROR(NonNegative("ddp.buckets", d.buckets()));
  if (!r.has_progress()) return absl::OkStatus();
  const v1::WorkerProgress& p = r.progress();
  CONCORD_RETURN_IF_ERROR(NonNegative("progress.generation", p.generation()));
  CONCORD_RETURN_IF_ERROR(NonNegative("progress.collectives", p.collectives()));
  CONCORD_RETURN_IF_ERROR(NonNegative("progress.pending_seq", p.pending_seq()));
  if (p.pending_seq() > p.collectives()) {
    return Invalid("progress.pending_seq",
                   absl::StrFormat("%d is above collectives (%d)",
                                   p.pending_seq(), p.collectives()));
  }
  CONCORD_RETURN_IF_ERROR(
      ValidText("progress.pending_kind", p.pending_kind(), kMaxKindLength));
  CONCORD_RETURN_IF_ERROR(NonNegative("progress.pending_ms", p.pending_ms()));
  CONCORD_RETURN_IF_ERROR(
      ValidText("progress.last_kind", p.last_kind(), kMaxKindLength));
  CONCORD_RETURN_IF_ERROR(NonNegative("progress.last_ago_ms", p.last_ago_ms()));
  CONCORD_RETURN_IF_ERROR(NonNegative("progress.cpu_ms", p.cpu_ms()));
  CONCORD_RETURN_IF_ERROR(
      ValidText("progress.activity", p.activity(), kMaxKindLength));
  if (p.recent_size() > kMaxRecent) {
    return Invalid("progress.recent",
                   absl::StrFormat("holds %d entries; at most %d",
                                   p.recent_size(), kMaxRecent));
  }
  for (const v1::FlightRecord& r : p.recent()) {
    CONCORD_RETURN_IF_ERROR(
        NonNegative("progress.recent.generation", r.generation()));
    CONCORD_RETURN_IF_ERROR(NonNegative("progress.recent.seq", r.seq()));
    CONCORD_RETURN_IF_ERROR(
        ValidText("progress.recent.kind", r.kind(), kMaxKindLength));
    CONCORD_RETURN_IF_ERROR(NonNegative("progress.recent.bytes", r.bytes()));
    CONCORD_RETURN_IF_ERROR(
        NonNegative("progress.recent.issued_ago_ms", r.issued_ago_ms()));
    if (r.ended_ago_ms() < -1) {
      return Invalid("progress.recent.ended_ago_ms",
                     absl::StrCat("must be -1 (in flight) or more; got ",
                                  r.ended_ago_ms()));
    }
  }
  CONCORD_RETURN_IF_ERROR(FiniteNonNegative("progress.wait_ms", p.wait_ms()));
  CONCORD_RETURN_IF_ERROR(FiniteNonNegative("progress.own_ms", p.own_ms()));
  CONCORD_RETURN_IF_ERROR(NonNegative("progress.pid", p.pid()));
  return FiniteNonNegative("progress.step_ms", p.step_ms());
}

absl::Status ValidateProcess(const std::string& job_id,
                             const std::string& worker_id,
                             const v1::ProcessView& v) {
  CONCORD_RETURN_IF_ERROR(ValidateId("job_id", job_id));
  CONCORD_RETURN_IF_ERROR(ValidateId("worker_id", worker_id));
  static const std::set<std::string> kStates = {"running", "sleeping", "disk",
                                                "stopped", "zombie"};
  if (kStates.count(v.state()) == 0) {
    return Invalid(
        "process.state",
        absl::StrCat("must be running, sleeping, disk, stopped or "
                     "zombie; got '",
                     absl::CHexEscape(v.state().substr(0, 32)), "'"));
  }
  CONCORD_RETURN_IF_ERROR(NonNegative("process.cpu_ms", v.cpu_ms()));
  if (v.has_gpu_percent() && (v.gpu_percent() < 0 || v.gpu_percent() > 100)) {
    return Invalid("process.gpu_percent",
                   absl::StrCat("must be 0 to 100; got ", v.gpu_percent()));
  }
  return NonNegative("process.age_ms", v.age_ms());
}

absl::Status ValidateRequest(const v1::LeaveRequest& r) {
  CONCORD_RETURN_IF_ERROR(
      ValidateCaller(r.job_id(), r.worker_id(), r.worker_secret()));
  CONCORD_RETURN_IF_ERROR(ValidateGeneration(r.generation()));
  if (!v1::LeaveReason_IsValid(r.reason())) {
    return Invalid("reason",
                   absl::StrCat("is not a LeaveReason: ", r.reason()));
  }
  return ValidText("message", r.message(), kMaxMessageLength);
}

absl::Status ValidateRequest(const v1::KvSetRequest& r) {
  CONCORD_RETURN_IF_ERROR(
      ValidateCaller(r.job_id(), r.worker_id(), r.worker_secret()));
  CONCORD_RETURN_IF_ERROR(ValidateGeneration(r.generation()));
  CONCORD_RETURN_IF_ERROR(ValidateKey(r.key()));
  if (r.value().size() > kMaxValueLength) {  // bytes: any content
    return Invalid("value", absl::StrFormat("is %d bytes; at most %d",
                                            r.value().size(), kMaxValueLength));
  }
  return absl::OkStatus();
}

absl::Status ValidateRequest(const v1::KvGetRequest& r) {
  CONCORD_RETURN_IF_ERROR(
      ValidateCaller(r.job_id(), r.worker_id(), r.worker_secret()));
  CONCORD_RETURN_IF_ERROR(ValidateGeneration(r.generation()));
  if (r.keys_size() == 0 || r.keys_size() > kMaxKeys) {
    return Invalid("keys", absl::StrFormat("must hold 1 to %d keys; got %d",
                                           kMaxKeys, r.keys_size()));
  }
  for (const std::string& key : r.keys()) {
    CONCORD_RETURN_IF_ERROR(ValidateKey(key));
  }
  return ValidateWait(r.wait_timeout_ms());
}

absl::Status ValidateRequest(const v1::WatchMembershipRequest& r) {
  return ValidateCaller(r.job_id(), r.worker_id(), r.worker_secret());
}

absl::Status ValidateExit(const std::string& job_id,
                          const std::string& worker_id,
                          const std::string& secret, const std::string& how) {
  CONCORD_RETURN_IF_ERROR(ValidateCaller(job_id, worker_id, secret));
  return ValidText("how", how, kMaxMessageLength);
}

bool OlderCheckpoint(const v1::CheckpointReport& a,
                     const v1::CheckpointReport& b) {
  return std::make_pair(a.run(), a.step()) < std::make_pair(b.run(), b.step());
}

absl::Status ValidateCheckpoint(const std::string& job_id,
                                const v1::CheckpointReport& r) {
  CONCORD_RETURN_IF_ERROR(ValidateId("job_id", job_id));
  if (r.step() < 1) {
    return Invalid("step", absl::StrCat("must be at least 1; got ", r.step()));
  }
  CONCORD_RETURN_IF_ERROR(NonNegative("epoch", r.epoch()));
  CONCORD_RETURN_IF_ERROR(NonNegative("samples", r.samples()));
  CONCORD_RETURN_IF_ERROR(NonNegative("world_size", r.world_size()));
  CONCORD_RETURN_IF_ERROR(NonNegative("generation", r.generation()));
  CONCORD_RETURN_IF_ERROR(NonNegative("run", r.run()));
  CONCORD_RETURN_IF_ERROR(NonNegative("written_unix_ms", r.written_unix_ms()));
  CONCORD_RETURN_IF_ERROR(NonNegative("skipped", r.skipped()));
  CONCORD_RETURN_IF_ERROR(
      FiniteNonNegative("write_seconds", r.write_seconds()));
  CONCORD_RETURN_IF_ERROR(
      FiniteNonNegative("stall_seconds", r.stall_seconds()));
  if (r.memory()) {
    if (r.node().empty())
      return Invalid("node", "is empty for a memory snapshot");
    if (!r.error().empty() || !r.path().empty()) {
      return Invalid("memory", "a memory snapshot has no path and no error");
    }
  } else if (r.path().empty()) {
    return Invalid("path", "is empty");
  }
  CONCORD_RETURN_IF_ERROR(ValidText("path", r.path(), kMaxMessageLength));
  CONCORD_RETURN_IF_ERROR(ValidText("error", r.error(), kMaxMessageLength));
  return ValidText("node", r.node(), kMaxMessageLength);
}

absl::Status ValidateRequest(const v1::ReportCheckpointRequest& r) {
  CONCORD_RETURN_IF_ERROR(
      ValidateCaller(r.job_id(), r.worker_id(), r.worker_secret()));
  CONCORD_RETURN_IF_ERROR(ValidateCheckpoint(r.job_id(), r.report()));
  if (r.report().memory()) {
    return Invalid("report.memory",
                   "a worker reports what it wrote to disk, not a memory "
                   "snapshot");
  }
  return absl::OkStatus();
}

absl::Status CheckCheckpointPath(const std::string& job_id,
                                 const std::string& checkpoint_dir,
                                 const v1::CheckpointReport& r) {
  if (r.memory() ||
      r.path() == CheckpointStepPath(checkpoint_dir, job_id, r.step())) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      checkpoint_dir.empty()
          ? absl::StrFormat("a checkpoint at %s reported for job %s, whose "
                            "workers gave no checkpoint folder",
                            absl::CHexEscape(r.path().substr(0, 256)), job_id)
          : absl::StrFormat(
                "a checkpoint at %s reported for job %s, whose step %d can "
                "only be %s",
                absl::CHexEscape(r.path().substr(0, 256)), job_id, r.step(),
                CheckpointStepPath(checkpoint_dir, job_id, r.step())));
}

absl::Status ValidateRequest(const v1::GetJobRequest& r) {
  return ValidateId("job_id", r.job_id());
}

absl::Status ValidateRequest(const v1::ListEventsRequest& r) {
  CONCORD_RETURN_IF_ERROR(ValidateId("job_id", r.job_id()));
  CONCORD_RETURN_IF_ERROR(NonNegative("after_seq", r.after_seq()));
  if (r.limit() < 0 || r.limit() > 1000) {
    return Invalid("limit",
                   absl::StrCat("must be in [0, 1000]; got ", r.limit()));
  }
  return absl::OkStatus();
}

absl::Status ValidateRequest(const v1::DrainWorkerRequest& r) {
  CONCORD_RETURN_IF_ERROR(ValidateId("job_id", r.job_id()));
  CONCORD_RETURN_IF_ERROR(ValidateId("worker_id", r.worker_id()));
  return ValidText("reason", r.reason(), kMaxMessageLength);
}

absl::Status ValidateRequest(const v1::StopJobRequest& r) {
  CONCORD_RETURN_IF_ERROR(ValidateId("job_id", r.job_id()));
  return ValidText("reason", r.reason(), kMaxMessageLength);
}

}  // namespace concord::coordinator

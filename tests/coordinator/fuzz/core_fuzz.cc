// Note [Core fuzzing]
// ~~~~~~~~~~~~~~~~~~~
// An input is a program of operations on one Core with a FakeClock. Each
// operation is picked by one byte and takes its fields from the bytes that
// follow, either
//  - structured: ids from small pools (so that workers meet in the same
//    jobs and generations), the right secret or a wrong one, the current
//    generation or one near it, small specs and steps, occasionally raw
//    strings and numbers; or
//  - raw: a length-prefixed slice parsed as the request proto itself
//    (arbitrary bytes, whatever protobuf makes of them).
// Clock advances and Tick() are operations too, so heartbeat timeouts,
// settle periods and rendezvous timeouts all happen; a structured
// Membership call may also open or close (lose) a watch stream, so expected
// survivors are dropped for lost streams too.
//
// After every operation the invariants are checked:
//  1. no job's generation ever goes backwards, and no job disappears;
//  2. a request refused with INVALID_ARGUMENT changed nothing (the core's
//     version and every job's exported record are as before);
//  3. every assignment is consistent (0 <= rank < world size = members);
//  4. expected survivors (see Note [Re-forming]) only exist between
//     generations and are never members;
// and at the end every job survives ExportJob -> RestoreJob unchanged.

#include "tests/coordinator/fuzz/core_fuzz.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/stubs/logging.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "coordinator/core/core.h"

namespace concord::coordinator::fuzz {
namespace {

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "core fuzz invariant broken: %s\n", what.c_str());
  std::abort();
}

// Reads fields from the input; past the end every read returns zeros.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  uint8_t U8() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint64_t U64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | U8();
    return v;
  }
  std::string Take(size_t n) {
    n = std::min(n, size_ - std::min(pos_, size_));
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return s;
  }
  template <typename T>
  const T& Pick(const std::vector<T>& pool) {
    return pool[U8() % pool.size()];
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

const std::vector<std::string> kJobs = {"j0", "j1",      "j2",
                                        "",   "bad id!", ".hidden"};
const std::vector<std::string> kWorkers = {"w0", "w1", "w2", "w3",
                                           "w4", "",   "-"};

std::string SecretOf(const std::string& worker) {
  return worker + "-secret-0123456789abcdef";
}

class Harness {
 public:
  Harness() : core_(&clock_) {}

  // Returns the highest generation any job reached.
  int64_t Run(Bytes& in) {
    for (int ops = 0; !in.empty() && ops < kMaxOps; ++ops) {
      const uint8_t op = in.U8();
      const bool raw = op >= 0xf0;
      std::map<std::string, std::string> before = Snapshot();
      const uint64_t version = core_.version();
      const absl::Status status = Apply(op, raw, in);
      if (status.code() == absl::StatusCode::kInvalidArgument) {
        if (core_.version() != version || Snapshot() != before) {
          Fail(absl::StrCat("op ", op, " was INVALID_ARGUMENT (",
                            status.message(), ") but changed the core"));
        }
      }
      CheckGenerations();
      CheckAssignments();
      CheckSurvivors();
    }
    CheckRoundTrip();
    int64_t highest = 0;
    for (const auto& [job, generation] : generations_) {
      highest = std::max(highest, generation);
    }
    return highest;
  }

 private:
  static constexpr int kMaxOps = 512;
  static constexpr size_t kMaxRaw = 4096;

  std::string Job(Bytes& in) {
    const uint8_t b = in.U8();
    return b < 240 ? kJobs[b % kJobs.size()] : in.Take(in.U8());
  }
  std::string Worker(Bytes& in) {
    const uint8_t b = in.U8();
    return b < 240 ? kWorkers[b % kWorkers.size()] : in.Take(in.U8());
  }
  std::string Secret(Bytes& in, const std::string& worker) {
    switch (in.U8() % 8) {
      case 0:
        return "wrong-secret-0123456789";
      case 1:
        return in.Take(in.U8());
      default:
        return SecretOf(worker);
    }
  }
  int64_t Generation(Bytes& in, const std::string& job) {
    const uint8_t b = in.U8();
    if (b >= 250) return static_cast<int64_t>(in.U64());
    return core_.CurrentGeneration(job) + (b % 5) - 2;
  }
  int64_t Small(Bytes& in) {
    const uint8_t b = in.U8();
    return b >= 250 ? static_cast<int64_t>(in.U64()) : b % 20;
  }
  double Rate(Bytes& in) {
    const uint64_t bits = in.U64();
    double d;
    static_assert(sizeof(d) == sizeof(bits));
    std::memcpy(&d, &bits, sizeof(d));
    return (bits & 1) ? d : static_cast<double>(bits % 1000);
  }

  template <typename Proto>
  bool ParseRaw(Bytes& in, Proto* proto) {
    const size_t n =
        in.U8() % 8 == 0 ? (size_t{in.U8()} << 8 | in.U8()) % kMaxRaw : in.U8();
    return proto->ParseFromString(in.Take(n));
  }

  // `op` also picks previous_generation, without reading more input (so the
  // corpus keeps its meaning): none, the current one (a re-form request from
  // a member, see Note [Re-forming]), or one ahead (INVALID_ARGUMENT).
  v1::JoinRequest JoinOf(Bytes& in, uint8_t op) {
    v1::JoinRequest r;
    v1::JobSpec& spec = *r.mutable_spec();
    spec.set_job_id(Job(in));
    const uint8_t shape = in.U8();
    spec.set_min_workers(shape % 4);
    spec.set_max_workers(shape % 4 + (shape >> 2) % 4);
    if (in.U8() % 4 == 0) {
      spec.set_heartbeat_interval_ms(Small(in) * 50);
      spec.set_heartbeat_timeout_ms(Small(in) * 200);
      spec.set_rendezvous_timeout_ms(Small(in) * 1000);
      spec.set_settle_ms(Small(in) * 100);
    } else {
      // One fixed spec per job so that joins of the same job agree.
      spec.set_heartbeat_interval_ms(100);
      spec.set_heartbeat_timeout_ms(1000);
      spec.set_rendezvous_timeout_ms(10000);
      spec.set_settle_ms(200);
      spec.set_min_workers(1 + static_cast<int>(spec.job_id().size() % 2));
      spec.set_max_workers(3);
      spec.set_checkpoint_dir("/ckpt");
    }
    r.set_worker_id(Worker(in));
    r.set_worker_secret(Secret(in, r.worker_id()));
    r.set_host(in.U8() % 8 == 0 ? in.Take(in.U8()) : "127.0.0.1");
    r.set_committed_step(Small(in));
    r.set_wait_timeout_ms(Small(in) * 100);
    if (op >= 0x80) {
      const int64_t current = core_.CurrentGeneration(spec.job_id());
      r.set_previous_generation(op >= 0xd0 ? current + 1 : current);
      r.set_reform_reason("fuzz");
    }
    return r;
  }

  // Fills the common fields of a worker request.
  template <typename Proto>
  void Identify(Bytes& in, Proto* r) {
    r->set_job_id(Job(in));
    r->set_worker_id(Worker(in));
    r->set_worker_secret(Secret(in, r->worker_id()));
  }

  absl::Status Apply(uint8_t op, bool raw, Bytes& in) {
    switch (op % 13) {
      case 0: {
        v1::JoinRequest r;
        if (raw ? !ParseRaw(in, &r) : (r = JoinOf(in, op), false)) break;
        return core_.Join(r);
      }
      case 1: {
        v1::HeartbeatRequest r;
        if (raw) {
          if (!ParseRaw(in, &r)) break;
        } else {
          Identify(in, &r);
          r.set_generation(Generation(in, r.job_id()));
          r.set_step(Small(in));
          r.set_samples_per_second(Rate(in));
          if (in.U8() % 4 == 0) r.mutable_ddp()->set_step_ms(Rate(in));
        }
        return core_.Heartbeat(r).status();
      }
      case 2: {
        v1::LeaveRequest r;
        if (raw) {
          if (!ParseRaw(in, &r)) break;
        } else {
          Identify(in, &r);
          r.set_generation(Generation(in, r.job_id()));
          r.set_reason(static_cast<v1::LeaveReason>(in.U8() % 4));
          r.set_message(in.Take(in.U8() % 16));
        }
        return core_.Leave(r).status();
      }
      case 3: {
        v1::KvSetRequest r;
        if (raw) {
          if (!ParseRaw(in, &r)) break;
        } else {
          Identify(in, &r);
          r.set_generation(Generation(in, r.job_id()));
          r.set_key(in.U8() % 8 == 0 ? in.Take(in.U8()) : "k");
          r.set_value(in.Take(in.U8() % 32));
        }
        return core_.KvSet(r);
      }
      case 4: {
        v1::KvGetRequest r;
        if (raw) {
          if (!ParseRaw(in, &r)) break;
        } else {
          Identify(in, &r);
          r.set_generation(Generation(in, r.job_id()));
          for (int i = in.U8() % 3; i > 0; --i)
            r.add_keys(in.Take(in.U8() % 4));
          r.set_wait_timeout_ms(Small(in));
        }
        return core_.KvGet(r).status();
      }
      case 5: {
        // A node agent's report: a checkpoint written or failed, or a
        // snapshot in its memory (see Note [Resume source]).
        v1::CheckpointReport r;
        const std::string job = Job(in);
        if (raw) {
          if (!ParseRaw(in, &r)) break;
        } else {
          r.set_step(Small(in));
          r.set_node(in.Take(in.U8() % 4));
          r.set_memory(in.U8() % 2 == 0);
          if (!r.memory()) {
            r.set_path(absl::StrCat("/ckpt/", job, "/step-", r.step()));
            if (in.U8() % 4 == 0) r.set_error(in.Take(in.U8() % 8));
          }
          r.set_stall_seconds(in.U8() / 100.0);
        }
        return core_.CheckpointReported(job, r);
      }
      case 6: {
        v1::WatchMembershipRequest r;
        if (raw) {
          if (!ParseRaw(in, &r)) break;
        } else {
          Identify(in, &r);
        }
        absl::Status status = core_.Membership(r).status();
        // The stream opens, or one closes (lost or not), as the service
        // would report it after a good Membership; unmatched closes too. Or
        // the worker's node agent reports that its process exited (see Note
        // [Exited workers]).
        if (!raw && status.ok()) {
          switch (in.U8() % 5) {
            case 1:
              core_.WatchOpened(r.job_id(), r.worker_id());
              break;
            case 2:
              core_.WatchClosed(r.job_id(), r.worker_id(), /*lost=*/true);
              break;
            case 3:
              core_.WatchClosed(r.job_id(), r.worker_id(), /*lost=*/false);
              break;
            case 4:
              status = core_
                           .WorkerExited(r.job_id(), r.worker_id(),
                                         r.worker_secret(), "fuzz")
                           .status();
              break;
            default:
              break;
          }
        }
        return status;
      }
      case 7: {
        v1::GetJobRequest r;
        if (raw ? !ParseRaw(in, &r) : (r.set_job_id(Job(in)), false)) break;
        return core_.GetJob(r).status();
      }
      case 8: {
        v1::ListEventsRequest r;
        if (raw) {
          if (!ParseRaw(in, &r)) break;
        } else {
          r.set_job_id(Job(in));
          r.set_after_seq(Small(in));
          r.set_limit(static_cast<int32_t>(Small(in)));
        }
        return core_.ListEvents(r).status();
      }
      case 9: {
        v1::DrainWorkerRequest r;
        if (raw) {
          if (!ParseRaw(in, &r)) break;
        } else {
          r.set_job_id(Job(in));
          r.set_worker_id(Worker(in));
          r.set_reason(in.Take(in.U8() % 16));
        }
        return core_.DrainWorker(r).status();
      }
      case 10: {
        v1::StopJobRequest r;
        if (raw) {
          if (!ParseRaw(in, &r)) break;
        } else {
          r.set_job_id(Job(in));
          r.set_reason(in.Take(in.U8() % 16));
        }
        return core_.StopJob(r).status();
      }
      case 11:
        clock_.Advance(absl::Milliseconds(int64_t{in.U8()} * 37));
        core_.Tick();
        return absl::OkStatus();
      default:
        (void)core_.ListJobs();
        (void)core_.TakeDirtyJobs();
        return absl::OkStatus();
    }
    return absl::OkStatus();  // unparsable raw bytes: nothing to call
  }

  // Every job's record, serialised deterministically.
  std::map<std::string, std::string> Snapshot() const {
    std::map<std::string, std::string> out;
    const v1::ListJobsResponse jobs = core_.ListJobs();
    for (const v1::JobSummary& job : jobs.jobs()) {
      std::optional<v1::JobRecord> record = core_.ExportJob(job.job_id());
      if (!record) Fail("listed job " + job.job_id() + " cannot be exported");
      std::string bytes;
      {
        google::protobuf::io::StringOutputStream stream(&bytes);
        google::protobuf::io::CodedOutputStream coded(&stream);
        coded.SetSerializationDeterministic(true);
        record->SerializeToCodedStream(&coded);
      }
      out[job.job_id()] = std::move(bytes);
    }
    return out;
  }

  void CheckGenerations() {
    std::map<std::string, int64_t> now;
    const v1::ListJobsResponse jobs = core_.ListJobs();
    for (const v1::JobSummary& job : jobs.jobs()) {
      now[job.job_id()] = job.generation();
      if (job.generation() != core_.CurrentGeneration(job.job_id())) {
        Fail("ListJobs and CurrentGeneration disagree for " + job.job_id());
      }
    }
    for (const auto& [job, generation] : generations_) {
      auto it = now.find(job);
      if (it == now.end()) Fail("job " + job + " disappeared");
      if (it->second < generation) {
        Fail(absl::StrCat("job ", job, " went from generation ", generation,
                          " back to ", it->second));
      }
    }
    generations_ = std::move(now);
  }

  void CheckAssignments() const {
    for (const auto& [job, generation] : generations_) {
      for (const std::string& worker : kWorkers) {
        auto assignment = core_.GetAssignment(job, worker);
        if (!assignment.ok() || !assignment->has_value()) continue;
        const Assignment& a = **assignment;
        if (a.world_size != static_cast<int32_t>(a.members->size()) ||
            a.rank < 0 || a.rank >= a.world_size || a.authoritative_rank < 0 ||
            a.authoritative_rank >= a.world_size || a.generation > generation) {
          Fail(absl::StrCat("inconsistent assignment of ", worker, " in ", job,
                            ": rank ", a.rank, " of ", a.world_size, " (",
                            a.members->size(), " members), generation ",
                            a.generation, " of ", generation));
        }
        for (size_t r = 0; r < a.members->size(); ++r) {
          if ((*a.members)[r].rank() != static_cast<int32_t>(r)) {
            Fail("members not ordered by rank in " + job);
          }
        }
        // The rank change names ranks of the generation before, ascending,
        // and leaves no more survivors than there are members.
        if (a.rank_change.has_value()) {
          const v1::RankChange& c = *a.rank_change;
          bool ok = c.previous_generation() + 1 == a.generation &&
                    c.departed_size() <= c.previous_world_size() &&
                    c.previous_world_size() - c.departed_size() <= a.world_size;
          for (int i = 0; i < c.departed_size(); ++i) {
            ok = ok && c.departed(i) >= 0 &&
                 c.departed(i) < c.previous_world_size() &&
                 (i == 0 || c.departed(i - 1) < c.departed(i));
          }
          if (!ok) {
            Fail(absl::StrCat("inconsistent rank change of ", worker, " in ",
                              job, ": ", c.ShortDebugString()));
          }
        }
      }
    }
  }

  void CheckSurvivors() const {
    for (const auto& [job, generation] : generations_) {
      std::optional<v1::JobRecord> record = core_.ExportJob(job);
      if (!record || record->expected().empty()) continue;
      if (record->state() != v1::JOB_STATE_RENDEZVOUS ||
          !record->members().empty() || record->generation() < 1) {
        Fail(absl::StrCat("expected survivors in ", job, " in state ",
                          record->state(), " with ", record->members_size(),
                          " members"));
      }
      // GetJob shows exactly the expected survivors that are not waiting.
      std::set<std::string> waiting, missing, shown;
      for (const auto& m : record->waiting()) waiting.insert(m.worker_id());
      for (const auto& m : record->expected()) {
        if (waiting.count(m.worker_id()) == 0) missing.insert(m.worker_id());
      }
      v1::GetJobRequest get;
      get.set_job_id(job);
      const absl::StatusOr<v1::JobStatus> status = core_.GetJob(get);
      if (!status.ok()) Fail("GetJob failed for " + job);
      for (const auto& m : status->expected()) shown.insert(m.worker_id());
      if (shown != missing) {
        Fail("GetJob's expected survivors differ from the record's in " + job);
      }
    }
  }

  void CheckRoundTrip() const {
    Core restored(&clock_);
    const v1::ListJobsResponse jobs = core_.ListJobs();
    for (const v1::JobSummary& job : jobs.jobs()) {
      const absl::Status s =
          restored.RestoreJob(*core_.ExportJob(job.job_id()));
      if (!s.ok())
        Fail("RestoreJob refused an exported record: " + s.ToString());
      if (restored.CurrentGeneration(job.job_id()) != job.generation()) {
        Fail("restored generation differs for " + job.job_id());
      }
    }
    if (restored.job_count() != core_.job_count()) {
      Fail("restored job count differs");
    }
  }

  FakeClock clock_{absl::FromUnixSeconds(1700000000)};
  Core core_;
  std::map<std::string, int64_t> generations_;
};

}  // namespace

int64_t RunOneInput(const uint8_t* data, size_t size) {
  // The core logs every event and protobuf every invalid UTF-8 string it
  // parses: millions of lines under a fuzzer.
  static const bool quiet = [] {
    spdlog::set_level(spdlog::level::off);
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)quiet;
  Bytes in(data, size);
  Harness harness;
  return harness.Run(in);
}

}  // namespace concord::coordinator::fuzz

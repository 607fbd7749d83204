#include "worker/session.h"

#include <sys/resource.h>
#include <torch/cuda.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/environment.h"
#include "common/host.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "concord/config.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/next_communicator.h"
#include "worker/coordinator_store.h"
#if CONCORD_HAVE_NCCL && CONCORD_TORCH_CUDA
#include <nccl.h>

#include "worker/comm/nccl/nccl_communicator.h"
#endif

namespace concord::worker {
namespace {

// How long a peer's reachability port has to answer (see Note [Unreachable
// peers]): a host that answers at all does so in a round trip.
constexpr absl::Duration kProbeTimeout = absl::Seconds(2);

// Parses variable `v`, when set, into `out`; INVALID_ARGUMENT names it.
template <typename T, typename Parse>
absl::Status EnvParsed(const env::Variable& v, Parse parse, T* out) {
  const std::string text = env::Get(v);
  if (text.empty()) return absl::OkStatus();
  absl::StatusOr<T> parsed = parse(text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(v.name, ": ", parsed.status().message()));
  }
  *out = *std::move(parsed);
  return absl::OkStatus();
}

std::string DefaultWorkerId() {
  return absl::StrCat(HostName(), "-", getpid());
}

}  // namespace

absl::StatusOr<WorkerOptions> WorkerOptions::FromEnvironment() {
  WorkerOptions o;
  o.coordinator = env::Get(env::kCoordinator);
  o.spec.set_job_id(env::Get(env::kJobId, "default"));
  int64_t min_workers, max_workers, hb_interval, hb_timeout, rdzv_timeout,
      collective_timeout, settle_ms, hang_timeout;
  CONCORD_RETURN_IF_ERROR(env::GetInt(env::kMinWorkers, &min_workers));
  CONCORD_RETURN_IF_ERROR(
      env::GetInt(env::kMaxWorkers, min_workers, min_workers, &max_workers));
  CONCORD_RETURN_IF_ERROR(env::GetInt(env::kHeartbeatIntervalMs, &hb_interval));
  CONCORD_RETURN_IF_ERROR(env::GetInt(env::kHeartbeatTimeoutMs, &hb_timeout));
  CONCORD_RETURN_IF_ERROR(
      env::GetInt(env::kRendezvousTimeoutMs, &rdzv_timeout));
  CONCORD_RETURN_IF_ERROR(
      env::GetInt(env::kCollectiveTimeoutMs, &collective_timeout));
  CONCORD_RETURN_IF_ERROR(env::GetInt(env::kSettleMs, &settle_ms));
  CONCORD_RETURN_IF_ERROR(env::GetInt(env::kHangTimeoutMs, &hang_timeout));
  o.spec.set_hang_timeout_ms(hang_timeout);
  o.spec.set_stragglers(env::Get(env::kStragglers, "report"));
  if (const std::string problem = StragglerPolicyProblem(
          o.spec.stragglers(), std::string(env::kStragglers.name));
      !problem.empty()) {
    return absl::InvalidArgumentError(problem);
  }
  int64_t cooldown;
  CONCORD_RETURN_IF_ERROR(env::GetInt(env::kStragglerCooldownMs, &cooldown));
  o.spec.set_straggler_cooldown_ms(cooldown);
  o.spec.set_settle_ms(settle_ms);
  o.spec.set_min_workers(static_cast<int32_t>(min_workers));
  o.spec.set_max_workers(static_cast<int32_t>(max_workers));
  o.spec.set_heartbeat_interval_ms(hb_interval);
  o.spec.set_heartbeat_timeout_ms(hb_timeout);
  o.spec.set_rendezvous_timeout_ms(rdzv_timeout);
  o.worker_id = env::Get(env::kWorkerId, DefaultWorkerId());
  o.comm_host = env::Get(env::kCommHost, "127.0.0.1");
  int64_t shm;
  CONCORD_RETURN_IF_ERROR(env::GetInt(env::kSharedMemory, &shm));
  o.shared_memory = shm == 1;
  o.log_level = env::Get(env::kLogLevel);
  if (!o.log_level.empty()) {
    if (auto level = ParseLogLevel(o.log_level); !level.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(env::kLogLevel.name, ": ", level.status().message()));
    }
  }
  o.trace_file = env::Get(env::kTraceFile);
  o.history_file = env::Get(env::kHistoryFile);
  o.node_id = env::Get(env::kNodeId, HostName());
  CONCORD_RETURN_IF_ERROR(
      EnvParsed(env::kDevice, ParseDeviceRequest, &o.device));
  CONCORD_RETURN_IF_ERROR(
      EnvParsed(env::kBackend, ParseBackendRequest, &o.backend));
  int64_t local_rank;
  CONCORD_RETURN_IF_ERROR(env::GetLocalRank(&local_rank));
  o.local_rank = static_cast<int>(local_rank);
  // A restarted worker does not die again (worker/test_fault.h).
  int64_t restarts;
  CONCORD_RETURN_IF_ERROR(env::GetInt(env::kRestartCount, &restarts));
  if (restarts == 0) {
    CONCORD_ASSIGN_OR_RETURN(
        o.test_faults,
        ParseTestFaults(env::Get(env::kTestFault), o.local_rank));
  }
  CONCORD_ASSIGN_OR_RETURN(o.checkpoint, checkpoint::FromEnvironment());
  o.join_timeout = absl::Milliseconds(rdzv_timeout);
  o.collective_timeout = absl::Milliseconds(collective_timeout);
  if (!o.coordinator.empty()) {
    const std::string token_file = env::Get(env::kTokenFile);
    if (!token_file.empty()) {
      absl::StatusOr<std::string> token = ReadTokenFile(token_file);
      if (!token.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(env::kTokenFile.name, ": ", token.status().message()));
      }
      o.token = *std::move(token);
    } else {
      o.token = env::Get(env::kToken);
      if (o.token.empty()) {
        return absl::InvalidArgumentError(
            "CONCORD_TOKEN_FILE is not set: the coordinator needs a worker "
            "token");
      }
      CONCORD_RETURN_IF_ERROR(ValidateToken(o.token));
    }
    TlsFiles files{env::Get(env::kTlsCa), env::Get(env::kTlsCert),
                   env::Get(env::kTlsKey)};
    CONCORD_ASSIGN_OR_RETURN(
        o.tls, LoadClientTls(files, {std::string(env::kTlsCa.name),
                                     std::string(env::kTlsCert.name),
                                     std::string(env::kTlsKey.name)}));
  }
  return o;
}

#if CONCORD_HAVE_NCCL && CONCORD_TORCH_CUDA
constexpr int kNcclVersion = NCCL_VERSION_CODE;
#else
constexpr int kNcclVersion = 0;
#endif

absl::StatusOr<ResolvedDevice> ResolveWorkerDevice(
    const WorkerOptions& options) {
  const int devices = static_cast<int>(torch::cuda::device_count());
  std::string why;
#if CONCORD_TORCH_CUDA
  why = "no CUDA driver or device, or CUDA_VISIBLE_DEVICES hides them";
#else
  why = absl::StrCat("LibTorch ", TORCH_VERSION, " was built without CUDA");
#endif
  return ResolveDevice(options.device, options.local_rank, devices, why);
}

absl::StatusOr<Backend> ResolveBackend(const WorkerOptions& options,
                                       const WorkerDevice& device) {
  // NCCL needs CUDA tensors, which only a CUDA LibTorch makes.
  return ChooseBackend(options.backend, device,
                       CONCORD_HAVE_NCCL && CONCORD_TORCH_CUDA);
}

absl::StatusOr<std::unique_ptr<comm::Communicator>> Session::Connect(
    int rank, int size, int64_t generation, comm::Store* store,
    absl::Duration timeout) const {
  if (backend_ == Backend::kNccl) {
#if CONCORD_HAVE_NCCL && CONCORD_TORCH_CUDA
    comm::NcclOptions nccl;
    nccl.rank = rank;
    nccl.size = size;
    nccl.generation = generation;
    nccl.device = device_.index;
    nccl.connect_timeout = timeout;
    comm::PrefixStore nccl_store("nccl/", store);
    return comm::NcclCommunicator::Create(nccl, &nccl_store);
#else
    return absl::FailedPreconditionError("this Concord has no NCCL");
#endif
  }
  comm::GlooOptions gloo;
  gloo.hostname = options_.comm_host;
  gloo.connect_timeout = timeout;
  gloo.rank = rank;
  gloo.size = size;
  gloo.generation = generation;
  gloo.shared_memory = options_.shared_memory;
  comm::PrefixStore gloo_store("gloo/", store);
  return comm::GlooCommunicator::Create(gloo, &gloo_store);
}

absl::StatusOr<std::unique_ptr<Session>> Session::Start(
    const WorkerOptions& options) {
  std::unique_ptr<Session> session(new Session(options));
  CONCORD_ASSIGN_OR_RETURN(ResolvedDevice device, ResolveWorkerDevice(options));
  if (!device.note.empty()) Log()->warn("{}", device.note);
  session->device_ = device.device;
  CONCORD_ASSIGN_OR_RETURN(session->backend_,
                           ResolveBackend(options, session->device_));
  Log()->debug("worker device {}, backend {}", session->device_.ToString(),
               std::string(BackendName(session->backend_)));
  // Made before joining: a bad path joins nothing.
  if (!options.history_file.empty()) {
    CONCORD_ASSIGN_OR_RETURN(
        session->history_,
        trace::HistoryLog::Create(options.history_file, options.worker_id,
                                  options.spec.job_id()));
  }
  if (options.coordinator.empty()) {
    // Alone: world size 1, nothing to rendezvous with.
    session->store_ = std::make_unique<comm::InMemoryStore>();
    CONCORD_ASSIGN_OR_RETURN(
        session->comm_,
        session->Connect(0, 1, 0, session->store_.get(), options.join_timeout));
    if (session->history_) session->history_->Generation(0, 0, 1);
    return session;
  }
  // A fresh secret per process binds the worker id (see Note [Worker binding]
  // in coordinator/core/core.h).
  session->client_ = std::make_unique<CoordinatorClient>(
      options.coordinator, ClientIdentity{options.token, options.worker_id,
                                          GenerateToken(), options.tls});
  // Gloo writes to sockets whose peer may have just died: that must be an
  // error on the work, not a SIGPIPE that kills this process.
  std::signal(SIGPIPE, SIG_IGN);
  auto probe = ProbeListener::Start(options.comm_host);
  if (probe.ok()) {
    session->probe_ = *std::move(probe);
  } else {
    Log()->warn("{} (peers cannot check that they reach this worker)",
                std::string(probe.status().message()));
  }
  // Watching from before the first join (an unbound worker may watch): a
  // worker that waits beyond the job's size hears so at once, and waits on
  // while the job runs (WarnIfBeyondSize, JoinAndConnect).
  Session* s = session.get();
  auto watch = [s] {
    return std::make_unique<MembershipWatcher>(
        s->client_.get(), s->options_.spec.job_id(),
        [s](const v1::MembershipUpdate& update) { s->OnMembership(update); });
  };
  session->watcher_ = watch();
  CONCORD_RETURN_IF_ERROR(session->JoinAndConnect(
      /*previous_generation=*/0, "", /*committed_step=*/0,
      session->JoinDeadline()));
  // A watch that saw an earlier run of the job end before this one started
  // it again (see Note [Starting again] in coordinator/core/core.h) has
  // stopped: watch this run.
  if (!session->watcher_->Live().has_value()) session->watcher_ = watch();
  return session;
}

namespace {

// A communicator given up may still be inside a Gloo operation that only
// returns at its timeout; its destructor waits for that, so it is destroyed
// on a thread of its own rather than on the training thread. This reference
// may not be the last (State::Reform and an engine hold the generation's
// too): the session's communicators are RecordedCommunicators, which once
// aborted let the inner one go the same way whoever drops them last (see
// Note [Flight recorder]); an NCCL derivation's parent is not wrapped.
void Retire(std::shared_ptr<comm::Communicator> comm) {
  if (comm == nullptr) return;
  comm->Abort();
  std::thread([c = std::move(comm)]() mutable { c.reset(); }).detach();
}

bool Terminal(v1::JobState state) {
  return state == v1::JOB_STATE_FAILED || state == v1::JOB_STATE_STOPPED ||
         state == v1::JOB_STATE_SUCCEEDED;
}

}  // namespace

absl::Status Session::JoinAndConnect(
    int64_t previous_generation, const std::string& reason,
    int64_t committed_step, absl::Time deadline,
    std::shared_ptr<comm::Communicator> parent) {
  std::string why = reason;
  // Whatever way this ends, a parent not derived from is given up.
  struct RetireParent {
    std::shared_ptr<comm::Communicator>& parent;
    ~RetireParent() { Retire(std::move(parent)); }
  } retire_parent{parent};
  // See Note [Unreachable peers]: after a timeout, check the next members
  // before connecting to them.
  bool probe = SuggestsUnreachablePeer(why);
  std::vector<std::string> unreachable;
  // A job that runs without this worker (at its size, or this worker held
  // back as an evicted straggler: see Note [Evicting stragglers] in
  // coordinator/core/hang_rule.h) may make a place at any step: the wait
  // goes on while the coordinator says so on the open watch, not only for
  // the rendezvous timeout, which is for generations that do not form.
  auto waits_for_a_place = [&] {
    if (watcher_ == nullptr) return false;
    const std::optional<v1::MembershipUpdate> view = watcher_->Live();
    if (!view.has_value() || view->state() != v1::JOB_STATE_RUNNING ||
        view->is_member()) {
      return false;
    }
    Log()->info(
        "job {} runs with {} member(s) without this worker: waiting "
        "on for a place",
        options_.spec.job_id(), view->world_size());
    deadline = absl::Now() + options_.join_timeout;
    return true;
  };
  for (;;) {
    const v1::JoinRequest request = MakeJoinRequest(
        previous_generation, why, committed_step, probe, unreachable);
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      if (waits_for_a_place()) continue;
      return absl::DeadlineExceededError(absl::StrCat(
          "no generation of job ", options_.spec.job_id(), " formed within ",
          absl::FormatDuration(options_.join_timeout)));
    }
    absl::StatusOr<v1::JoinResponse> response = client_->Join(request, left);
    if (absl::IsDeadlineExceeded(response.status()) && waits_for_a_place()) {
      continue;
    }
    if (absl::IsAborted(response.status())) {
      // Placed in a generation that ended before we heard of it: again.
      Log()->info("join: {}", std::string(response.status().message()));
      continue;
    }
    CONCORD_RETURN_IF_ERROR(response.status());
    const v1::JoinResponse& joined = *response;
    TakeAssignment(joined);
    if (probe || joined.members_size() > 0) {
      unreachable = UnreachableMembers(joined);
      if (!unreachable.empty()) {
        why = absl::StrCat("cannot reach ", absl::StrJoin(unreachable, ", "));
        Log()->warn("generation {}: {}; giving it up", joined.generation(),
                    why);
        previous_generation = joined.generation();
        probe = true;
        continue;
      }
    }
    if (!heartbeat_.joinable()) {
      // Heartbeat while the communicator connects: that can take a while.
      const absl::Duration interval =
          absl::Milliseconds(joined.heartbeat_interval_ms());
      heartbeat_ = std::thread([this, interval] { HeartbeatLoop(interval); });
    }
    const comm::NextCommunicatorRequest next =
        PlanNextCommunicator(joined, std::min(options_.join_timeout, left));
    auto comm =
        comm::MakeNextCommunicator(next, std::move(parent), store_.get(), [&] {
          return Connect(joined.rank(), joined.world_size(),
                         joined.generation(), store_.get(), next.timeout);
        });
    taken_for_reform_->store(-1);
    if (comm.ok()) {
      if (backend_ == Backend::kNccl) {
        Log()->info("generation {}: NCCL communicator by {} ({})",
                    joined.generation(),
                    std::string(comm::HowName(comm->plan.how)), comm->plan.why);
      }
      std::lock_guard<std::mutex> lock(comm_mu_);
      // See Note [Flight recorder]: its collectives are recorded.
      comm_ = std::make_shared<comm::RecordedCommunicator>(
          std::move(comm->communicator), recorder_, /*main=*/true);
      reform_wanted_.store(false);
      return absl::OkStatus();
    }
    // A member of the new generation did not connect (it died, or the
    // generation ended meanwhile): ask for the next one.
    Log()->warn("communicator of generation {} did not connect: {}",
                joined.generation(), comm.status().ToString());
    previous_generation = joined.generation();
    why = absl::StrCat("communicator of generation ", joined.generation(),
                       " did not connect: ", comm.status().message());
    probe = true;
  }
}

v1::JoinRequest Session::MakeJoinRequest(
    int64_t previous_generation, const std::string& why, int64_t committed_step,
    bool probe, const std::vector<std::string>& unreachable) const {
  v1::JoinRequest request;
  *request.mutable_spec() = options_.spec;
  request.set_worker_id(options_.worker_id);
  request.set_host(options_.comm_host);
  request.set_committed_step(committed_step);
  request.set_previous_generation(previous_generation);
  request.set_reform_reason(why.substr(0, 1000));
  request.set_probe_port(probe_ ? probe_->port() : 0);
  request.set_include_members(probe);
  // A newcomer checks the members of a running job it joins.
  request.set_members_if_running(!probe && previous_generation == 0);
  for (const std::string& w : unreachable) request.add_unreachable(w);
  return request;
}

void Session::TakeAssignment(const v1::JoinResponse& joined) {
  generation_.store(joined.generation());
  run_.store(joined.run());
  rank_.store(joined.rank());
  world_size_.store(joined.world_size());
  finished_workers_.store(joined.finished_workers());
  authoritative_rank_.store(joined.authoritative_rank());
  resume_from_.reset();
  if (joined.has_resume_from()) resume_from_ = joined.resume_from();
  resume_memory_.reset();
  if (joined.has_resume_memory()) resume_memory_ = joined.resume_memory();
  store_ = std::make_unique<CoordinatorStore>(
      client_.get(), options_.spec.job_id(), joined.generation());
  Log()->info("joined job '{}' generation {} as rank {} of {}",
              options_.spec.job_id(), joined.generation(), joined.rank(),
              joined.world_size());
  if (history_) {
    history_->Generation(joined.generation(), joined.rank(),
                         joined.world_size());
  }
}

comm::NextCommunicatorRequest Session::PlanNextCommunicator(
    const v1::JoinResponse& joined, absl::Duration timeout) {
  // See Note [Re-forming NCCL]: the members agree how to make the new
  // communicator (NCCL: derived from the old one where they can).
  comm::NextCommunicatorRequest next;
  next.backend = backend_;
  next.nccl_version = kNcclVersion;
  next.previous = members_;
  std::optional<comm::RankChange> change;
  if (joined.has_rank_change()) {
    const v1::RankChange& c = joined.rank_change();
    change.emplace();
    change->previous_generation = c.previous_generation();
    change->previous_world_size = c.previous_world_size();
    change->departed.assign(c.departed().begin(), c.departed().end());
    change->order_kept = c.order_kept();
  }
  next.next =
      comm::NextRankLabels(members_, members_generation_, joined.generation(),
                           joined.world_size(), change);
  int departed = 0;
  for (const std::string& id : members_) {
    departed +=
        std::find(next.next.begin(), next.next.end(), id) == next.next.end();
  }
  next.departed_cleanly =
      joined.finished_workers() - finished_at_formation_ >= departed;
  members_changed_ = !change || departed > 0 ||
                     change->previous_world_size != joined.world_size() ||
                     change->previous_generation != members_generation_;
  next.rank = joined.rank();
  next.generation = joined.generation();
  next.timeout = timeout;
  members_ = next.next;
  members_generation_ = joined.generation();
  finished_at_formation_ = joined.finished_workers();
  return next;
}

std::vector<std::string> Session::UnreachableMembers(
    const v1::JoinResponse& joined) const {
  std::vector<std::pair<std::string, int>> endpoints;
  std::vector<std::string> ids;
  for (const v1::Member& m : joined.members()) {
    if (m.worker_id() == options_.worker_id || m.probe_port() == 0) continue;
    endpoints.emplace_back(m.host(), m.probe_port());
    ids.push_back(m.worker_id());
  }
  const std::vector<bool> reachable = ProbeReachable(endpoints, kProbeTimeout);
  std::vector<std::string> out;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!reachable[i]) out.push_back(ids[i]);
  }
  return out;
}

absl::Time Session::JoinDeadline() const {
  // The coordinator fails a job whose rendezvous outlived the timeout on
  // its next tick: wait a little longer, so that the worker hears why
  // (below min_workers) instead of giving up first with a bare deadline.
  return absl::Now() + options_.join_timeout + absl::Seconds(2);
}

absl::Status Session::Reform(int64_t committed_step,
                             const std::string& reason) {
  if (client_ == nullptr) {
    return absl::FailedPreconditionError(
        "a worker without a coordinator cannot re-form (world of one)");
  }
  std::shared_ptr<comm::Communicator> old;
  std::vector<std::weak_ptr<comm::Communicator>> groups;
  {
    std::lock_guard<std::mutex> lock(comm_mu_);
    old = std::move(comm_);
    groups.swap(groups_);
  }
  const int64_t previous = old ? old->generation() : generation_.load();
  for (auto& group : groups) {
    if (auto g = group.lock()) g->Abort();
  }
  // See Note [Re-forming NCCL]: an NCCL communicator is kept until the next
  // generation's plan says whether to derive from it; Gloo's goes now.
  std::shared_ptr<comm::Communicator> parent;
  if (backend_ == Backend::kNccl && old != nullptr) {
    taken_for_reform_->store(old->generation());
    // The derivation needs the communicator itself (see Note [Flight
    // recorder]: the session's is a recording wrapper).
    parent = comm::RecordedCommunicator::Inner(old);
    old.reset();
  } else {
    Retire(std::move(old));
  }
  Log()->info("leaving generation {} at step {}: {}", previous, committed_step,
              reason);
  return JoinAndConnect(previous, reason, committed_step, JoinDeadline(),
                        std::move(parent));
}

absl::StatusOr<std::shared_ptr<comm::Communicator>> Session::CreateGroup(
    const comm::Communicator& parent, const std::string& name,
    const std::vector<int>& members) {
  {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (comm_ == nullptr || comm_.get() != &parent) {
      return absl::AbortedError(absl::StrCat("group '", name, "': generation ",
                                             parent.generation(),
                                             " is not the current one"));
    }
  }
  CONCORD_RETURN_IF_ERROR(comm::CheckGroupMembers(parent, members));
  const int rank = static_cast<int>(
      std::find(members.begin(), members.end(), parent.rank()) -
      members.begin());
  comm::PrefixStore group_store(
      absl::StrCat("group/", parent.generation(), "/", name, "/"),
      store_.get());
  CONCORD_ASSIGN_OR_RETURN(
      std::shared_ptr<comm::Communicator> connected,
      Connect(rank, static_cast<int>(members.size()), parent.generation(),
              &group_store, options_.join_timeout));
  std::shared_ptr<comm::Communicator> group =
      std::make_shared<comm::RecordedCommunicator>(std::move(connected),
                                                   recorder_, /*main=*/false);
  std::lock_guard<std::mutex> lock(comm_mu_);
  if (comm_.get() != &parent) {
    // The generation ended while the group connected.
    group->Abort();
    return absl::AbortedError(absl::StrCat("group '", name, "': generation ",
                                           parent.generation(), " ended"));
  }
  groups_.push_back(group);
  return group;
}

std::shared_ptr<comm::Communicator> Session::shared_communicator() const {
  std::lock_guard<std::mutex> lock(comm_mu_);
  return comm_;
}

void Session::WarnIfBeyondSize(const v1::MembershipUpdate& update) {
  if (update.is_member() || update.state() != v1::JOB_STATE_RUNNING ||
      update.world_size() < options_.spec.max_workers() ||
      beyond_size_warned_.exchange(true)) {
    return;
  }
  Log()->warn(
      "job {} already runs at its largest size, max_workers {} (concord-run "
      "--max-workers, default --nproc): worker {} waits, and trains only "
      "when a member leaves; to train on N nodes at once start every node "
      "with --nnodes N",
      options_.spec.job_id(), options_.spec.max_workers(), options_.worker_id);
}

void Session::OnMembership(const v1::MembershipUpdate& update) {
  WarnIfBeyondSize(update);
  std::shared_ptr<comm::Communicator> comm = shared_communicator();
  if (comm == nullptr) return;  // between generations
  const int64_t mine = comm->generation();
  const bool over = update.generation() > mine ||
                    (update.generation() == mine && !update.is_member()) ||
                    (update.generation() == mine && Terminal(update.state()) &&
                     update.state() != v1::JOB_STATE_SUCCEEDED);
  if (over) {
    // The collective in flight may still complete: the others may have
    // finished it and moved on before we did (a re-form at a step boundary).
    // Give it a moment, then abort what is left, so that nothing waits out
    // its timeout on a peer that is gone.
    const absl::Duration grace = std::clamp(
        2 * absl::Milliseconds(options_.spec.heartbeat_interval_ms()),
        absl::Milliseconds(200), absl::Seconds(2));
    Log()->info(
        "generation {} is over (coordinator at generation {}{}); "
        "aborting its collectives in {} ms",
        mine, update.generation(),
        update.failure().empty() ? "" : absl::StrCat(": ", update.failure()),
        absl::ToInt64Milliseconds(grace));
    std::vector<std::weak_ptr<comm::Communicator>> groups;
    {
      std::lock_guard<std::mutex> lock(comm_mu_);
      if (comm_ == comm) groups = groups_;
    }
    std::thread([comm = std::move(comm), groups = std::move(groups), grace,
                 taken = taken_for_reform_]() mutable {
      absl::SleepFor(grace);
      // See Note [Re-forming NCCL]: once Reform has taken the communicator
      // over, the training thread is in no collective on it, and the members'
      // plan derives from it or aborts it; an abort here, in the middle of
      // a shrink, would leave the other members waiting for this one.
      if (taken->load() != comm->generation()) comm->Abort();
      for (auto& group : groups) {
        if (auto g = group.lock()) g->Abort();
      }
      comm.reset();
    }).detach();
    return;
  }
  if (update.generation() == mine && update.waiting_workers() > 0) {
    reform_wanted_.store(true);
  }
}

Session::~Session() {
  StopHeartbeat();
  watcher_.reset();
}

void Session::ReportCheckpoint(const v1::CheckpointReport& report) {
  if (client_ == nullptr) return;
  if (absl::Status s = client_->ReportCheckpoint(options_.spec.job_id(), report,
                                                 absl::Seconds(10));
      !s.ok()) {
    Log()->warn("checkpoint of step {}: the coordinator was not told: {}",
                report.step(), std::string(s.message()));
  }
}

void Session::ReportProgress(int64_t step, double samples_per_second,
                             std::optional<double> loss) {
  step_.store(step, std::memory_order_relaxed);
  samples_per_second_.store(samples_per_second, std::memory_order_relaxed);
  // The coordinator refuses a non-finite loss (a diverged run must not make
  // its heartbeats fail): such a step reports none.
  loss_.store(loss.has_value() && std::isfinite(*loss)
                  ? *loss
                  : std::numeric_limits<double>::quiet_NaN(),
              std::memory_order_relaxed);
}

void Session::ReportCommittedStep(int64_t step) {
  step_.store(step, std::memory_order_relaxed);
  // The time between commits of consecutive steps (a restore's commit of
  // an older step, or a step committed again, starts over).
  const absl::Time now = absl::Now();
  const absl::Duration waited = recorder_->waited();
  std::lock_guard<std::mutex> lock(activity_mu_);
  if (last_commit_.has_value() && step == last_commit_step_ + 1) {
    const absl::Duration step_time = now - *last_commit_;
    step_times_.push_back(
        {step_time, std::min(step_time, waited - last_commit_waited_)});
    if (step_times_.size() > kStepTimesKept) step_times_.pop_front();
  }
  last_commit_ = now;
  last_commit_waited_ = waited;
  last_commit_step_ = step;
}

Session::Busy::Busy(Session* session, std::string what) : session_(session) {
  if (session_ == nullptr) return;
  std::lock_guard<std::mutex> lock(session_->activity_mu_);
  previous_ = std::exchange(session_->activity_, std::move(what));
}

Session::Busy::~Busy() {
  if (session_ == nullptr) return;
  std::lock_guard<std::mutex> lock(session_->activity_mu_);
  session_->activity_ = std::move(previous_);
}

v1::WorkerProgress Session::progress_report(absl::Time now) const {
  v1::WorkerProgress p;
  p.set_pid(getpid());  // for its node agent (see Note [What the agent sees])
  const comm::FlightRecorder::Snapshot s = recorder_->Poll(now);
  p.set_generation(s.generation);
  p.set_collectives(s.collectives);
  if (s.pending.has_value()) {
    p.set_pending_seq(s.pending->seq);
    p.set_pending_kind(s.pending->kind);
    p.set_pending_ms(std::max<int64_t>(
        0, absl::ToInt64Milliseconds(now - s.pending->issued)));
  }
  if (s.last.has_value()) {
    p.set_last_kind(s.last->kind);
    p.set_last_ago_ms(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(now - *s.last->ended)));
  }
  // See Note [Flight recorder]: the last collectives, while something may be
  // wrong (one in flight for a second, or none issued for a second).
  const bool stuck =
      s.pending.has_value() && now - s.pending->issued >= kRecentAfter;
  const bool quiet = !s.pending.has_value() && s.last.has_value() &&
                     now - *s.last->ended >= kRecentAfter;
  if (stuck || quiet) {
    const std::vector<comm::CollectiveRecord> recent = recorder_->Recent();
    const size_t first =
        recent.size() > kRecentSent ? recent.size() - kRecentSent : 0;
    for (size_t i = first; i < recent.size(); ++i) {
      const comm::CollectiveRecord& r = recent[i];
      v1::FlightRecord& out = *p.add_recent();
      out.set_generation(r.generation);
      out.set_seq(r.seq);
      out.set_kind(r.kind);
      out.set_bytes(r.bytes);
      out.set_issued_ago_ms(
          std::max<int64_t>(0, absl::ToInt64Milliseconds(now - r.issued)));
      out.set_ended_ago_ms(
          r.ended.has_value()
              ? std::max<int64_t>(0, absl::ToInt64Milliseconds(now - *r.ended))
              : -1);
    }
  }
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) == 0) {
    auto ms = [](const timeval& t) {
      return int64_t{t.tv_sec} * 1000 + int64_t{t.tv_usec} / 1000;
    };
    p.set_cpu_ms(ms(usage.ru_utime) + ms(usage.ru_stime));
  }
  std::lock_guard<std::mutex> lock(activity_mu_);
  p.set_activity(activity_);
  if (!step_times_.empty()) {
    auto median = [&](auto part) {
      std::vector<absl::Duration> v;
      for (const StepTime& t : step_times_) v.push_back(part(t));
      std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
      return absl::ToDoubleMilliseconds(v[v.size() / 2]);
    };
    p.set_step_ms(median([](const StepTime& t) { return t.step; }));
    p.set_wait_ms(median([](const StepTime& t) { return t.wait; }));
    p.set_own_ms(median([](const StepTime& t) { return t.step - t.wait; }));
  }
  return p;
}

Session::Progress Session::progress() const {
  Progress p;
  p.step = step_.load(std::memory_order_relaxed);
  p.samples_per_second = samples_per_second_.load(std::memory_order_relaxed);
  const double loss = loss_.load(std::memory_order_relaxed);
  if (!std::isnan(loss)) p.loss = loss;
  return p;
}

void Session::ReportDdpTimings(const v1::DdpTimings& timings) {
  std::lock_guard<std::mutex> lock(timings_mu_);
  timings_ = timings;
}

void Session::HeartbeatLoop(absl::Duration interval) {
  std::string last_refusal;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    v1::HeartbeatRequest request;
    request.set_job_id(options_.spec.job_id());
    request.set_worker_id(options_.worker_id);
    request.set_generation(generation_.load());
    request.set_step(step_.load(std::memory_order_relaxed));
    request.set_samples_per_second(
        samples_per_second_.load(std::memory_order_relaxed));
    if (const double loss = loss_.load(std::memory_order_relaxed);
        std::isfinite(loss)) {
      request.set_loss(loss);
    }
    {
      std::lock_guard<std::mutex> timings_lock(timings_mu_);
      if (timings_) *request.mutable_ddp() = *timings_;
    }
    *request.mutable_progress() = progress_report(absl::Now());
    auto response = client_->Heartbeat(std::move(request), interval);
    if (response.ok() && response->waiting_workers() > 0 &&
        response->current_generation() == generation_.load()) {
      reform_wanted_.store(true);
    }
    if (!response.ok()) {
      // ABORTED: between generations (see Note [Re-forming]); not news.
      // The same refusal again (a worker taken out while it hung, until it
      // joins again) is said once.
      const std::string said = response.status().ToString();
      if (response.status().code() == absl::StatusCode::kAborted ||
          said == last_refusal) {
        Log()->debug("heartbeat: {}", said);
      } else {
        Log()->warn("heartbeat: {}", said);
      }
      last_refusal = said;
    } else {
      last_refusal.clear();
    }
    lock.lock();
    cv_.wait_for(lock, absl::ToChronoNanoseconds(interval),
                 [this] { return stop_; });
  }
}

void Session::StopHeartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
}

absl::Status Session::Finish(bool ok, const std::string& message) {
  if (history_ && !finished_) history_->Finish(ok, message);
  return LeaveOnce(ok ? v1::LEAVE_REASON_COMPLETED : v1::LEAVE_REASON_ERROR,
                   message);
}

absl::Status Session::LeaveAtEndOfData(int64_t last_step) {
  return LeaveOnce(v1::LEAVE_REASON_END_OF_DATA,
                   absl::StrCat("no more data after step ", last_step));
}

absl::Status Session::LeaveOnce(v1::LeaveReason reason,
                                const std::string& message) {
  StopHeartbeat();
  if (finished_ || client_ == nullptr) return absl::OkStatus();
  finished_ = true;
  watcher_.reset();
  v1::LeaveRequest request;
  request.set_job_id(options_.spec.job_id());
  request.set_worker_id(options_.worker_id);
  request.set_generation(generation_.load());
  request.set_reason(reason);
  request.set_message(message);
  return client_->Leave(std::move(request), absl::Seconds(10)).status();
}

c10::Device Session::torch_device() const {
  if (!device_.is_cuda()) return c10::Device(c10::kCPU);
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_.index));
}

}  // namespace concord::worker

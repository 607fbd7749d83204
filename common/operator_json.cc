#include "common/operator_json.h"

#include "absl/time/time.h"

namespace concord {

std::string JobStateName(v1::JobState state) {
  std::string name = v1::JobState_Name(state);
  const std::string prefix = "JOB_STATE_";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  return name;
}

std::string FormatUnixMs(int64_t unix_ms) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromUnixMillis(unix_ms),
                          absl::UTCTimeZone());
}

OrderedJson EventJson(const v1::Event& e) {
  return OrderedJson{{"seq", e.seq()},
                     {"time", FormatUnixMs(e.time_unix_ms())},
                     {"time_unix_ms", e.time_unix_ms()},
                     {"kind", e.kind()},
                     {"worker_id", e.worker_id()},
                     {"message", e.message()}};
}

OrderedJson MemberJson(const v1::MemberStatus& m) {
  OrderedJson j{{"worker_id", m.worker_id()},
                {"rank", m.rank()},
                {"host", m.host()},
                {"committed_step", m.committed_step()},
                {"last_heartbeat_age_ms", m.last_heartbeat_age_ms()},
                {"samples_per_second", m.samples_per_second()},
                {"completed", m.completed()},
                {"ddp",
                 {{"step_ms", m.ddp().step_ms()},
                  {"forward_ms", m.ddp().forward_ms()},
                  {"backward_ms", m.ddp().backward_ms()},
                  {"allreduce_wait_ms", m.ddp().allreduce_wait_ms()},
                  {"optimizer_ms", m.ddp().optimizer_ms()},
                  {"buckets", m.ddp().buckets()}}},
                {"loss", nullptr}};
  if (m.has_loss()) j["loss"] = m.loss();
  // How the coordinator sees it, and what its last heartbeat said it was
  // doing (docs/reliability.md, "Gray failures").
  j["health"] = m.health();
  if (m.has_progress()) {
    const v1::WorkerProgress& p = m.progress();
    OrderedJson recent = OrderedJson::array();
    for (const v1::FlightRecord& r : p.recent()) {
      recent.push_back(OrderedJson{{"generation", r.generation()},
                                   {"seq", r.seq()},
                                   {"kind", r.kind()},
                                   {"bytes", r.bytes()},
                                   {"issued_ago_ms", r.issued_ago_ms()},
                                   {"ended_ago_ms", r.ended_ago_ms()}});
    }
    j["progress"] = OrderedJson{
        {"generation", p.generation()},   {"collectives", p.collectives()},
        {"pending_seq", p.pending_seq()}, {"pending_kind", p.pending_kind()},
        {"pending_ms", p.pending_ms()},   {"last_kind", p.last_kind()},
        {"last_ago_ms", p.last_ago_ms()}, {"cpu_ms", p.cpu_ms()},
        {"activity", p.activity()},       {"step_ms", p.step_ms()},
        {"wait_ms", p.wait_ms()},         {"own_ms", p.own_ms()},
        {"recent", std::move(recent)}};
  } else {
    j["progress"] = nullptr;
  }
  // What its node agent saw of its process (docs/reliability.md).
  if (m.has_process()) {
    const v1::ProcessView& v = m.process();
    j["process"] = OrderedJson{
        {"state", v.state()},
        {"cpu_ms", v.cpu_ms()},
        {"gpu_percent",
         v.has_gpu_percent() ? OrderedJson(v.gpu_percent()) : OrderedJson()},
        {"age_ms", m.process_age_ms()}};
  } else {
    j["process"] = nullptr;
  }
  return j;
}

OrderedJson SummaryJson(const v1::JobSummary& s) {
  return OrderedJson{
      {"job_id", s.job_id()},           {"state", JobStateName(s.state())},
      {"generation", s.generation()},   {"world_size", s.world_size()},
      {"waiting", s.waiting()},         {"min_workers", s.min_workers()},
      {"max_workers", s.max_workers()}, {"failure", s.failure()}};
}

OrderedJson CheckpointJson(const v1::CheckpointReport& c) {
  return OrderedJson{{"step", c.step()},
                     {"epoch", c.epoch()},
                     {"samples", c.samples()},
                     {"world_size", c.world_size()},
                     {"generation", c.generation()},
                     {"run", c.run()},
                     {"path", c.path()},
                     {"node", c.node()},
                     {"bytes", c.bytes()},
                     {"write_seconds", c.write_seconds()},
                     {"stall_seconds", c.stall_seconds()},
                     {"skipped", c.skipped()},
                     {"error", c.error()},
                     {"written_unix_ms", c.written_unix_ms()}};
}

OrderedJson CheckpointTotalsJson(const v1::CheckpointTotals& t) {
  return OrderedJson{
      {"written", t.written()},
      {"skipped", t.skipped()},
      {"failed", t.failed()},
      {"failing", t.has_failing() ? CheckpointJson(t.failing()) : nullptr}};
}

OrderedJson StatusJson(const v1::JobStatus& s) {
  OrderedJson j{
      {"job_id", s.spec().job_id()},
      {"state", JobStateName(s.state())},
      {"failure", s.failure()},
      {"generation", s.generation()},
      {"run", s.run()},
      {"authoritative_rank", s.authoritative_rank()},
      {"min_workers", s.spec().min_workers()},
      {"max_workers", s.spec().max_workers()},
      {"hang_timeout_ms", s.hang_timeout_ms()},
      {"stragglers", s.spec().stragglers()},
      {"members", OrderedJson::array()},
      {"waiting", OrderedJson::array()},
      {"expected", OrderedJson::array()},
      {"recent_events", OrderedJson::array()},
      {"checkpoints", OrderedJson::array()},
      {"checkpoint_totals", CheckpointTotalsJson(s.checkpoint_totals())}};
  for (const auto& m : s.members()) j["members"].push_back(MemberJson(m));
  for (const auto& m : s.waiting()) j["waiting"].push_back(MemberJson(m));
  for (const auto& m : s.expected()) j["expected"].push_back(MemberJson(m));
  for (const auto& e : s.recent_events()) {
    j["recent_events"].push_back(EventJson(e));
  }
  for (const auto& c : s.checkpoints()) {
    j["checkpoints"].push_back(CheckpointJson(c));
  }
  return j;
}

}  // namespace concord

#include "worker/trace/recorder.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/write_all.h"

namespace concord::trace {
namespace {

nlohmann::json ToJson(const Args& args) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [key, value] : args) out[key] = value;
  return out;
}

}  // namespace

int64_t NowMicros() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

absl::StatusOr<std::shared_ptr<Recorder>> Recorder::Create(
    const std::string& path, std::string label) {
  const int fd =
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot write the trace file ", path, ": ", std::strerror(errno)));
  }
  std::shared_ptr<Recorder> r(new Recorder(fd, std::move(label)));
  WriteAll(fd, "[\n");
  return r;
}

Recorder::~Recorder() {
  WriteAll(fd_, "\n]\n");
  ::close(fd_);
}

void Recorder::WriteLocked(const std::string& event_json) {
  WriteAll(fd_, first_ ? event_json : absl::StrCat("\n,", event_json));
  first_ = false;
}

void Recorder::NameThreadLocked(int tid, std::string_view name) {
  if (!named_threads_.insert({rank_, tid}).second) return;
  nlohmann::json e = {{"ph", "M"},    {"name", "thread_name"},
                      {"pid", rank_}, {"tid", tid},
                      {"ts", 0},      {"args", {{"name", name}}}};
  WriteLocked(e.dump());
  nlohmann::json order = {{"ph", "M"},    {"name", "thread_sort_index"},
                          {"pid", rank_}, {"tid", tid},
                          {"ts", 0},      {"args", {{"sort_index", tid}}}};
  WriteLocked(order.dump());
}

void Recorder::SetGeneration(int64_t generation, int rank, int world_size) {
  std::lock_guard<std::mutex> lock(mu_);
  rank_ = rank;
  if (named_processes_.insert(rank).second) {
    for (const auto& [key, args] :
         {std::pair<const char*, nlohmann::json>{
              "process_name", {{"name", absl::StrCat("rank ", rank)}}},
          {"process_labels", {{"labels", label_}}},
          {"process_sort_index", {{"sort_index", rank}}}}) {
      nlohmann::json e = {{"ph", "M"}, {"name", key}, {"pid", rank},
                          {"tid", 0},  {"ts", 0},     {"args", args}};
      WriteLocked(e.dump());
    }
  }
  NameThreadLocked(kTrainThread, "train");
  nlohmann::json e = {{"ph", "i"},
                      {"s", "g"},
                      {"name", absl::StrCat("generation ", generation)},
                      {"cat", "membership"},
                      {"pid", rank_},
                      {"tid", kTrainThread},
                      {"ts", NowMicros()},
                      {"args",
                       {{"generation", generation},
                        {"rank", rank},
                        {"world_size", world_size},
                        {"step", step_}}}};
  WriteLocked(e.dump());
}

void Recorder::SetStep(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  step_ = step;
}

int64_t Recorder::step() const {
  std::lock_guard<std::mutex> lock(mu_);
  return step_;
}

int Recorder::rank() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rank_;
}

void Recorder::Complete(std::string_view name, int tid, int64_t start_us,
                        int64_t end_us, Args args, int rank) {
  nlohmann::json a = ToJson(args);
  std::lock_guard<std::mutex> lock(mu_);
  if (!a.contains("step")) a["step"] = step_;
  nlohmann::json e = {{"ph", "X"},
                      {"name", name},
                      {"cat", "train"},
                      {"pid", rank < 0 ? rank_ : rank},
                      {"tid", tid},
                      {"ts", start_us},
                      {"dur", std::max<int64_t>(0, end_us - start_us)},
                      {"args", a}};
  WriteLocked(e.dump());
}

void Recorder::Instant(std::string_view name, Args args, bool global) {
  nlohmann::json a = ToJson(args);
  std::lock_guard<std::mutex> lock(mu_);
  if (!a.contains("step")) a["step"] = step_;
  nlohmann::json e = {{"ph", "i"},         {"s", global ? "g" : "t"},
                      {"name", name},      {"cat", "train"},
                      {"pid", rank_},      {"tid", kTrainThread},
                      {"ts", NowMicros()}, {"args", a}};
  WriteLocked(e.dump());
}

void Recorder::NameThread(int tid, std::string_view name) {
  std::lock_guard<std::mutex> lock(mu_);
  NameThreadLocked(tid, name);
}

}  // namespace concord::trace

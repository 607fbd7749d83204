#include "worker/trace/history.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/write_all.h"
#include "worker/trace/recorder.h"

namespace concord::trace {

absl::StatusOr<std::shared_ptr<HistoryLog>> HistoryLog::Create(
    const std::string& path, std::string worker_id, std::string job_id) {
  const int fd =
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot write the history file ", path, ": ", std::strerror(errno)));
  }
  return std::shared_ptr<HistoryLog>(
      new HistoryLog(fd, std::move(worker_id), std::move(job_id)));
}

HistoryLog::~HistoryLog() { ::close(fd_); }

void HistoryLog::Write(const std::string& event, const std::string& fields) {
  nlohmann::json head = {{"event", event},
                         {"worker", worker_id_},
                         {"pid", static_cast<int64_t>(::getpid())},
                         {"job", job_id_},
                         {"time_us", NowMicros()}};
  std::string line = head.dump();
  line.pop_back();  // the closing brace: the record's own fields follow
  absl::StrAppend(&line, fields.empty() ? "" : ",", fields, "}\n");
  std::lock_guard<std::mutex> lock(mu_);
  // O_APPEND: one write(2) is one whole line, even with several writers.
  WriteAll(fd_, line);  // best effort: a full disk loses records
}

namespace {

// `object` without its braces.
std::string Fields(const nlohmann::json& object) {
  std::string s = object.dump();
  return s.size() <= 2 ? std::string() : s.substr(1, s.size() - 2);
}

}  // namespace

void HistoryLog::Generation(int64_t generation, int rank, int world_size) {
  Write("generation", Fields({{"generation", generation},
                              {"rank", rank},
                              {"world", world_size}}));
}

void HistoryLog::Restore(int64_t generation, int64_t step, int64_t epoch,
                         uint64_t digest, bool replicated) {
  Write("restore", Fields({{"generation", generation},
                           {"step", step},
                           {"epoch", epoch},
                           {"digest", absl::StrFormat("%016x", digest)},
                           {"replicated", replicated}}));
}

void HistoryLog::Checkpoint(int64_t generation, int64_t step, int64_t epoch,
                            bool disk) {
  Write("checkpoint", Fields({{"generation", generation},
                              {"step", step},
                              {"epoch", epoch},
                              {"disk", disk}}));
}

void HistoryLog::Resume(int64_t generation, int64_t step,
                        const std::string& source, uint64_t digest,
                        bool replicated) {
  Write("resume", Fields({{"generation", generation},
                          {"step", step},
                          {"source", source},
                          {"digest", absl::StrFormat("%016x", digest)},
                          {"replicated", replicated}}));
}

void HistoryLog::Commit(const CommitRecord& r) {
  nlohmann::json o = {{"generation", r.generation},
                      {"rank", r.rank},
                      {"world", r.world_size},
                      {"step", r.step},
                      {"epoch", r.epoch},
                      {"digest", absl::StrFormat("%016x", r.digest)},
                      {"replicated", r.replicated}};
  if (r.samples.has_value()) o["samples"] = *r.samples;
  Write("commit", Fields(o));
}

void HistoryLog::Finish(bool ok, const std::string& message) {
  Write("finish", Fields({{"ok", ok}, {"message", message}}));
}

uint64_t DigestBytes(uint64_t hash, const void* data, size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    hash ^= bytes[i];
    hash *= 1099511628211ull;
  }
  return hash;
}

}  // namespace concord::trace

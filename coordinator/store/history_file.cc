#include "coordinator/store/history_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/write_all.h"

namespace concord::coordinator {

absl::StatusOr<std::unique_ptr<HistoryFile>> HistoryFile::Open(
    const std::string& path) {
  const int fd =
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot write the history file ", path, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<HistoryFile>(new HistoryFile(fd));
}

HistoryFile::~HistoryFile() { ::close(fd_); }

void HistoryFile::WriteLine(const std::string& line) {
  std::lock_guard<std::mutex> lock(mu_);
  WriteAll(fd_, line);  // best effort: a full disk loses lines
}

void HistoryFile::Write(const std::string& job_id,
                        const std::vector<Event>& events, int64_t lost) {
  const int64_t pid = ::getpid();
  std::string out;
  if (lost > 0) {
    nlohmann::json gap = {{"event", "gap"},
                          {"job", job_id},
                          {"lost", lost},
                          {"time_us", absl::ToUnixMicros(absl::Now())},
                          {"pid", pid}};
    absl::StrAppend(&out, gap.dump(), "\n");
  }
  for (const Event& e : events) {
    nlohmann::json line = {{"event", e.kind},
                           {"job", job_id},
                           {"seq", e.seq},
                           {"time_us", absl::ToUnixMicros(e.time)},
                           {"pid", pid}};
    if (!e.worker_id.empty()) line["worker"] = e.worker_id;
    if (!e.message.empty()) line["message"] = e.message;
    if (e.generation != 0) line["generation"] = e.generation;
    if (!e.members.empty()) line["members"] = e.members;
    absl::StrAppend(&out, line.dump(), "\n");
  }
  if (!out.empty()) WriteLine(out);
}

}  // namespace concord::coordinator

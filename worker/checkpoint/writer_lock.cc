#include "worker/checkpoint/writer_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/errno_status.h"
#include "common/host.h"

namespace concord::checkpoint {
namespace {

constexpr char kLockFile[] = ".writer";
// Tries before giving up while other processes are taking the lock (each
// waits 5-25 ms): about a second.
constexpr int kTries = 60;

std::string ReadLine(int fd) {
  std::string text(4096, '\0');
  const ssize_t n = ::pread(fd, text.data(), text.size(), 0);
  text.resize(n > 0 ? static_cast<size_t>(n) : 0);
  return text;
}

absl::Status WriteLine(int fd, const std::string& path,
                       const WriterIdentity& me) {
  const std::string line = nlohmann::json{{"run", me.run},
                                          {"host", me.host},
                                          {"pid", me.pid},
                                          {"since_unix_ms", me.since_unix_ms}}
                               .dump() +
                           "\n";
  if (::ftruncate(fd, 0) != 0) return ErrnoStatus("cannot truncate", path);
  if (::pwrite(fd, line.data(), line.size(), 0) !=
      static_cast<ssize_t>(line.size())) {
    return ErrnoStatus("cannot write", path);
  }
  if (::fsync(fd) != 0) return ErrnoStatus("cannot sync", path);
  return absl::OkStatus();
}

void Pause() {
  thread_local std::minstd_rand random(
      static_cast<unsigned>(::getpid()) ^
      static_cast<unsigned>(
          std::chrono::steady_clock::now().time_since_epoch().count()));
  std::this_thread::sleep_for(
      std::chrono::milliseconds(5 + static_cast<int>(random() % 21)));
}

}  // namespace

std::string WriterIdentity::Describe() const {
  return absl::StrCat("run ", run, " (host ", host, ", pid ", pid, ", since ",
                      absl::FormatTime("%Y-%m-%d %H:%M:%S UTC",
                                       absl::FromUnixMillis(since_unix_ms),
                                       absl::UTCTimeZone()),
                      ")");
}

absl::StatusOr<WriterIdentity> ParseWriterIdentity(const std::string& text) {
  const nlohmann::json j =
      nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  WriterIdentity id;
  try {
    if (j.is_discarded() || !j.is_object()) throw std::invalid_argument("");
    id.run = j.at("run").get<int64_t>();
    id.host = j.at("host").get<std::string>();
    id.pid = j.at("pid").get<int64_t>();
    id.since_unix_ms = j.at("since_unix_ms").get<int64_t>();
  } catch (const std::exception&) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a writer lock line: '", text.substr(0, 200), "'"));
  }
  return id;
}

absl::Status WriterLock::Hold(const std::string& job_dir, int64_t run) {
  if (fd_ >= 0 && dir_ == job_dir && run_ == run) return absl::OkStatus();
  Release();
  const std::string path = absl::StrCat(job_dir, "/", kLockFile);
  const int fd =
      ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return ErrnoStatus("cannot open the writer lock", path);
  const WriterIdentity me{run, HostName(), ::getpid(),
                          absl::ToUnixMillis(absl::Now())};
  // A holder of another run is named only when seen holding it several
  // times in a row: two runs taking a folder at once settle who got it.
  int sightings = 0;
  int64_t seen = -1;
  int error = 0;
  for (int i = 0; i < kTries && error == 0; ++i) {
    if (::flock(fd, LOCK_SH | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK) error = errno;
      Pause();  // another process is taking it
      continue;
    }
    absl::StatusOr<WriterIdentity> holder = ParseWriterIdentity(ReadLine(fd));
    if (holder.ok() && holder->run == run) {
      fd_ = fd;
      dir_ = job_dir;
      run_ = run;
      return absl::OkStatus();
    }
    // Another run's, or nobody's yet: ours when nobody else holds it.
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
      if (absl::Status s = WriteLine(fd, path, me); !s.ok()) {
        ::close(fd);
        return s;
      }
      (void)::flock(fd, LOCK_SH);  // then checked as any holder's
      continue;
    }
    if (errno != EWOULDBLOCK) {
      error = errno;
      continue;
    }
    holder = ParseWriterIdentity(ReadLine(fd));
    (void)::flock(fd, LOCK_UN);
    if (holder.ok()) {
      sightings = holder->run == seen ? sightings + 1 : 1;
      seen = holder->run;
      if (sightings >= 3) {
        ::close(fd);
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint folder ", job_dir, " is written by ",
            holder->Describe(), ", still running; run ", run,
            " of the job may not write there (stop that run, or give this "
            "one another --checkpoint-dir)"));
      }
    }
    Pause();  // being taken, or taken by a process of this run meanwhile
  }
  ::close(fd);
  if (error != 0) {
    errno = error;
    return ErrnoStatus("cannot lock the writer lock", path);
  }
  return absl::UnavailableError(
      absl::StrCat("cannot take the writer lock ", path, " for run ", run,
                   ": other processes keep taking it"));
}

void WriterLock::Release() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  dir_.clear();
  run_ = 0;
}

absl::Status HoldWriterLock(const std::string& job_dir, int64_t run) {
  static std::mutex mu;
  static auto* held = new std::map<std::string, std::unique_ptr<WriterLock>>();
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<WriterLock>& mine = (*held)[job_dir];
  if (mine == nullptr) mine = std::make_unique<WriterLock>();
  return mine->Hold(job_dir, run);
}

}  // namespace concord::checkpoint

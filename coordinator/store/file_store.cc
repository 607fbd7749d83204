#include "coordinator/store/file_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace concord::coordinator {
namespace {

constexpr char kSuffix[] = ".pb";
constexpr char kTmpSuffix[] = ".pb.tmp";

std::string Errno(const std::string& what) {
  return absl::StrCat(what, ": ", std::strerror(errno));
}

absl::Status MakeDir(const std::string& dir) {
  if (mkdir(dir.c_str(), 0700) == 0 || errno == EEXIST) {
    struct stat st;
    if (stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(
        absl::StrCat("state dir ", dir, " is not a directory"));
  }
  return absl::FailedPreconditionError(
      Errno(absl::StrCat("cannot create state dir ", dir)));
}

absl::Status SyncDir(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return absl::UnavailableError(Errno("open " + dir));
  const int rc = fsync(fd);
  close(fd);
  if (rc != 0) return absl::UnavailableError(Errno("fsync " + dir));
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const std::string& data,
                      const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(Errno("write " + path));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<FileStore>> FileStore::Open(
    const std::string& dir) {
  if (dir.empty()) return absl::FailedPreconditionError("empty state dir");
  if (absl::Status s = MakeDir(dir); !s.ok()) return s;
  const std::string jobs = dir + "/jobs";
  if (absl::Status s = MakeDir(jobs); !s.ok()) return s;
  const std::string lock_path = dir + "/LOCK";
  const int fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        Errno(absl::StrCat("state dir ", dir, " is not writable")));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("state dir ", dir, " is in use by another coordinator"));
  }
  // A write probe: a read-only directory must fail here, not at first Save.
  const std::string probe = jobs + "/.probe";
  const int probe_fd =
      open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (probe_fd < 0) {
    close(fd);
    return absl::FailedPreconditionError(
        Errno(absl::StrCat("state dir ", dir, " is not writable")));
  }
  close(probe_fd);
  unlink(probe.c_str());
  return std::unique_ptr<FileStore>(new FileStore(jobs, fd));
}

FileStore::~FileStore() {
  if (lock_fd_ >= 0) close(lock_fd_);  // releases the flock
}

absl::Status FileStore::Save(const v1::JobRecord& record) {
  std::string data;
  if (!record.SerializeToString(&data)) {
    return absl::InternalError("cannot serialize a job record");
  }
  const std::string path =
      absl::StrCat(jobs_dir_, "/", record.spec().job_id(), kSuffix);
  const std::string tmp = path + ".tmp";
  const int fd =
      open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::UnavailableError(Errno("open " + tmp));
  absl::Status status = WriteAll(fd, data, tmp);
  if (status.ok() && fsync(fd) != 0) {
    status = absl::UnavailableError(Errno("fsync " + tmp));
  }
  close(fd);
  if (status.ok() && rename(tmp.c_str(), path.c_str()) != 0) {
    status = absl::UnavailableError(Errno("rename " + tmp));
  }
  if (!status.ok()) {
    unlink(tmp.c_str());
    return status;
  }
  return SyncDir(jobs_dir_);
}

absl::StatusOr<std::vector<v1::JobRecord>> FileStore::LoadAll() {
  DIR* d = opendir(jobs_dir_.c_str());
  if (d == nullptr) return absl::UnavailableError(Errno("open " + jobs_dir_));
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) names.emplace_back(e->d_name);
  closedir(d);
  std::vector<v1::JobRecord> records;
  for (const std::string& name : names) {
    const std::string path = absl::StrCat(jobs_dir_, "/", name);
    if (absl::EndsWith(name, kTmpSuffix)) {
      unlink(path.c_str());  // an interrupted Save: the old record stands
      continue;
    }
    if (!absl::EndsWith(name, kSuffix)) continue;
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::DataLossError(Errno("open " + path));
    std::string data;
    char buf[65536];
    ssize_t n;
    while ((n = read(fd, buf, sizeof(buf))) > 0) {
      data.append(buf, static_cast<size_t>(n));
    }
    close(fd);
    v1::JobRecord record;
    if (n < 0 || !record.ParseFromString(data)) {
      return absl::DataLossError(absl::StrCat("corrupt job record ", path));
    }
    if (absl::StrCat(record.spec().job_id(), kSuffix) != name) {
      return absl::DataLossError(absl::StrCat(
          "job record ", path, " names job '", record.spec().job_id(), "'"));
    }
    records.push_back(std::move(record));
  }
  return records;
}

}  // namespace concord::coordinator

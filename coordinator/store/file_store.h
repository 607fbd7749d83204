#pragma once
// The embedded Store: one file per job in a state directory.
//
// Note [File store]
// ~~~~~~~~~~~~~~~~~
// `DIR/jobs/<job_id>.pb` holds the job's JobRecord (protobuf binary). Save
// writes `<job_id>.pb.tmp`, fsyncs it, renames it over the record and fsyncs
// the directory, so after SIGKILL (or power loss) at any point each record is
// either the old or the new one, never a mix. Leftover `.tmp` files are ignored
// and removed on open. Job ids are validated (core_validation.h) to be safe
// file names. `DIR/LOCK` is held with flock(2) while the store is open, so two
// coordinators never share a directory.

#include <memory>
#include <string>
#include <vector>

#include "coordinator/store/store.h"

namespace concord::coordinator {

class FileStore final : public Store {
 public:
  // Creates the directory if needed and locks it. Errors: FAILED_PRECONDITION
  // (cannot create or write the directory, or another process holds it).
  static absl::StatusOr<std::unique_ptr<FileStore>> Open(
      const std::string& dir);
  ~FileStore() override;
  FileStore(const FileStore&) = delete;
  FileStore& operator=(const FileStore&) = delete;

  absl::Status Save(const v1::JobRecord& record) override;
  absl::StatusOr<std::vector<v1::JobRecord>> LoadAll() override;

 private:
  FileStore(std::string jobs_dir, int lock_fd)
      : jobs_dir_(std::move(jobs_dir)), lock_fd_(lock_fd) {}

  std::string jobs_dir_;
  int lock_fd_;
};

}  // namespace concord::coordinator

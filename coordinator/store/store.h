#pragma once
// Where the coordinator keeps its jobs across restarts (see Note [Persistence]
// in core.h). One record per job; Save replaces the job's record as a whole.
//
// Implementations side by side: MemoryStore (here: tests, and coordinators
// without --state-dir), FileStore (file_store.h: the embedded default).
// Thread-compatible: the service calls them under its own mutex.

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "concord/v1/coordinator_state.pb.h"

namespace concord::coordinator {

class Store {
 public:
  virtual ~Store() = default;
  // Durably replaces the job's record: once it returns OK, the record
  // survives a crash of this process (and, for FileStore, of the machine).
  // Errors: UNAVAILABLE / INTERNAL (I/O), the record is then unchanged.
  virtual absl::Status Save(const v1::JobRecord& record) = 0;
  // Every saved record. Errors: DATA_LOSS for a record that cannot be read.
  virtual absl::StatusOr<std::vector<v1::JobRecord>> LoadAll() = 0;
};

class MemoryStore final : public Store {
 public:
  absl::Status Save(const v1::JobRecord& record) override {
    records_[record.spec().job_id()] = record;
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<v1::JobRecord>> LoadAll() override {
    std::vector<v1::JobRecord> out;
    for (const auto& [id, r] : records_) out.push_back(r);
    return out;
  }

 private:
  std::map<std::string, v1::JobRecord> records_;
};

}  // namespace concord::coordinator

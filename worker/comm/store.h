#pragma once
// Key-value store for communicator rendezvous, scoped to one generation.
// Implementations: an in-memory one (single process, tests) and one backed by
// the coordinator (worker/coordinator_store.h).

#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace concord::comm {

class Store {
 public:
  virtual ~Store() = default;
  // Errors: ABORTED (generation over), UNAVAILABLE (store unreachable).
  virtual absl::Status Set(const std::string& key,
                           const std::string& value) = 0;
  // Blocks until every key is set; DEADLINE_EXCEEDED after `timeout`.
  virtual absl::StatusOr<std::vector<std::string>> Get(
      const std::vector<std::string>& keys, absl::Duration timeout) = 0;
};

// Thread-safe in-memory store, for ranks that share a process.
class InMemoryStore final : public Store {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::vector<std::string>> Get(
      const std::vector<std::string>& keys, absl::Duration timeout) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> data_;
};

// Adds `prefix` to every key of `base`, so that several communicators can
// rendezvous through one store.
class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, Store* base)
      : prefix_(std::move(prefix)), base_(base) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    return base_->Set(prefix_ + key, value);
  }
  absl::StatusOr<std::vector<std::string>> Get(
      const std::vector<std::string>& keys, absl::Duration timeout) override;

 private:
  std::string prefix_;
  Store* base_;
};

}  // namespace concord::comm

#pragma once
// Key-value store for communicator rendezvous, scoped to one generation.
// Implementations: an in-memory one (single process, tests) and one backed by
// the coordinator (worker/coordinator_store.h).

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
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

// Note [Rank tables]
// ~~~~~~~~~~~~~~~~~~
// A full-mesh rendezvous publishes one value per rank under "<prefix><rank>"
// and every rank reads every other rank's value. Read a key at a time (Gloo's
// connectFullMesh: "rank_<i>" for the hosts, then "<i>" for the pair addresses)
// that is N gets per rank, N^2 messages to the coordinator per generation of N
// ranks. RankTableStore reads the whole table of a prefix in one Get the first
// time any key of it is wanted and answers the others from memory: O(N)
// messages per generation. Values that are large (Gloo's address lists grow
// with N) are fetched in several Gets of about `batch_bytes` each, judged by
// the size of this rank's own value under the prefix, so that no answer nears
// gRPC's 4 MiB message limit. Every rank sets its key of a table before it
// reads any (as connectFullMesh does), so waiting for the whole table waits for
// nothing a key-by-key reader would not. Keys of other prefixes pass through.
// Not thread-safe (one rendezvous).
class RankTableStore final : public Store {
 public:
  // `keys_per_get`: the most keys one Get of `base` may name.
  RankTableStore(Store* base, int size, std::vector<std::string> prefixes,
                 size_t keys_per_get = 1024,
                 size_t batch_bytes = size_t{1} << 20)
      : base_(base),
        size_(size),
        prefixes_(std::move(prefixes)),
        keys_per_get_(std::max<size_t>(keys_per_get, 1)),
        batch_bytes_(batch_bytes) {}

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::vector<std::string>> Get(
      const std::vector<std::string>& keys, absl::Duration timeout) override;

 private:
  // The table prefix of `key` (an index into prefixes_) and its rank, if it
  // is a key of a table.
  std::optional<std::pair<size_t, int>> TableKey(const std::string& key) const;
  absl::Status FetchTable(size_t table, absl::Duration timeout);

  Store* base_;
  int size_;
  std::vector<std::string> prefixes_;
  size_t keys_per_get_;
  size_t batch_bytes_;
  // Per prefix: the size of this rank's own value, and the table once read.
  std::map<size_t, size_t> own_size_;
  std::map<size_t, std::vector<std::string>> tables_;
};

}  // namespace concord::comm

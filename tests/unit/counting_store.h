#pragma once
// A store that counts what reaches it: one Get is one message to the
// coordinator (a KvGet), one Set one KvSet.

#include <atomic>
#include <string>
#include <vector>

#include "worker/comm/store.h"

namespace concord::testing {

class CountingStore final : public comm::Store {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override {
    ++sets;
    return base.Set(key, value);
  }
  absl::StatusOr<std::vector<std::string>> Get(
      const std::vector<std::string>& keys, absl::Duration timeout) override {
    ++gets;
    keys_read += static_cast<int>(keys.size());
    return base.Get(keys, timeout);
  }

  comm::InMemoryStore base;
  std::atomic<int> sets{0}, gets{0}, keys_read{0};
};

}  // namespace concord::testing

#include "worker/comm/store.h"

#include "absl/strings/str_cat.h"

namespace concord::comm {

absl::Status InMemoryStore::Set(const std::string& key,
                                const std::string& value) {
  if (key.empty()) return absl::InvalidArgumentError("empty store key");
  {
    std::lock_guard<std::mutex> lock(mu_);
    data_[key] = value;
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> InMemoryStore::Get(
    const std::vector<std::string>& keys, absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto all_set = [&] {
    for (const auto& k : keys) {
      if (data_.count(k) == 0) return false;
    }
    return true;
  };
  if (!cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), all_set)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "store keys not set within ", absl::FormatDuration(timeout)));
  }
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (const auto& k : keys) values.push_back(data_[k]);
  return values;
}

absl::StatusOr<std::vector<std::string>> PrefixStore::Get(
    const std::vector<std::string>& keys, absl::Duration timeout) {
  std::vector<std::string> prefixed;
  prefixed.reserve(keys.size());
  for (const auto& k : keys) prefixed.push_back(prefix_ + k);
  return base_->Get(prefixed, timeout);
}

}  // namespace concord::comm

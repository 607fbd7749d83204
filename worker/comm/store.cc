#include "worker/comm/store.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

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

std::optional<std::pair<size_t, int>> RankTableStore::TableKey(
    const std::string& key) const {
  for (size_t t = 0; t < prefixes_.size(); ++t) {
    const std::string& prefix = prefixes_[t];
    if (key.size() <= prefix.size() ||
        key.compare(0, prefix.size(), prefix) != 0) {
      continue;
    }
    const std::string digits = key.substr(prefix.size());
    if (digits.size() > 1 && digits[0] == '0') continue;
    int rank = 0;
    if (!absl::SimpleAtoi(digits, &rank) ||
        digits.find_first_not_of("0123456789") != std::string::npos ||
        rank >= size_) {
      continue;
    }
    return std::make_pair(t, rank);
  }
  return std::nullopt;
}

absl::Status RankTableStore::Set(const std::string& key,
                                 const std::string& value) {
  if (auto table = TableKey(key)) own_size_[table->first] = value.size();
  return base_->Set(key, value);
}

absl::Status RankTableStore::FetchTable(size_t table, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  const auto own = own_size_.find(table);
  const size_t value_bytes =
      std::max<size_t>(own == own_size_.end() ? 0 : own->second, 1);
  const size_t per_get =
      std::clamp<size_t>(batch_bytes_ / value_bytes, 1,
                         std::min(keys_per_get_, static_cast<size_t>(size_)));
  std::vector<std::string> values;
  values.reserve(static_cast<size_t>(size_));
  for (size_t begin = 0; begin < static_cast<size_t>(size_); begin += per_get) {
    std::vector<std::string> keys;
    for (size_t r = begin;
         r < std::min(begin + per_get, static_cast<size_t>(size_)); ++r) {
      keys.push_back(absl::StrCat(prefixes_[table], r));
    }
    CONCORD_ASSIGN_OR_RETURN(std::vector<std::string> got,
                             base_->Get(keys, deadline - absl::Now()));
    if (got.size() != keys.size()) {
      return absl::InternalError(absl::StrCat("the store answered ", got.size(),
                                              " values for ", keys.size(),
                                              " keys"));
    }
    for (std::string& v : got) values.push_back(std::move(v));
  }
  tables_[table] = std::move(values);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> RankTableStore::Get(
    const std::vector<std::string>& keys, absl::Duration timeout) {
  std::vector<std::pair<size_t, int>> wanted;
  for (const std::string& key : keys) {
    auto table = TableKey(key);
    if (!table) return base_->Get(keys, timeout);
    wanted.push_back(*table);
  }
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (const auto& [table, rank] : wanted) {
    if (tables_.count(table) == 0) {
      CONCORD_RETURN_IF_ERROR(FetchTable(table, deadline - absl::Now()));
    }
    values.push_back(tables_[table][static_cast<size_t>(rank)]);
  }
  return values;
}

}  // namespace concord::comm

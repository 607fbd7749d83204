#include "worker/elastic/powersgd_participant.h"

#include <ATen/ATen.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/comm/coalesced.h"

namespace concord::elastic {
namespace {

at::Tensor BytesTensor(const std::string& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::string TensorBytes(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU, at::kByte).contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()),
                     static_cast<size_t>(c.numel()));
}

}  // namespace

absl::Status PowerSgdParticipant::SyncState(
    std::shared_ptr<comm::Communicator> comm, int authoritative_rank,
    int64_t /*step*/, torch::optim::Optimizer& /*optimizer*/) {
  comm_ = std::move(comm);
  const bool root = comm_->rank() == authoritative_rank;
  std::string bytes = root ? state_->SaveReplicated() : std::string();
  CONCORD_RETURN_IF_ERROR(
      comm::BroadcastBytes(*comm_, authoritative_rank, &bytes, opts_));
  if (root) return absl::OkStatus();
  return state_->LoadReplicated(bytes, options_);
}

absl::StatusOr<NamedTensors> PowerSgdParticipant::CheckpointState(
    const torch::optim::Optimizer& /*optimizer*/) {
  if (comm_ == nullptr) {
    return absl::FailedPreconditionError("PowerSGD: no generation yet");
  }
  NamedTensors out;
  out.emplace_back("replicated", BytesTensor(state_->SaveReplicated()));
  // For people (the archive holds it too).
  out.emplace_back("iteration", at::tensor(state_->iteration(), at::kLong));
  // Every rank's buckets with error feedback ("index:numel,..."): a
  // newcomer may have none yet.
  std::string mine;
  for (const auto& [index, e] : state_->errors()) {
    absl::StrAppend(&mine, index, ":", e.numel(), ",");
  }
  CONCORD_ASSIGN_OR_RETURN(const std::vector<std::string> all,
                           comm::AllgatherStrings(*comm_, mine, opts_));
  std::map<size_t, int64_t> sizes;
  for (const std::string& one : all) {
    for (absl::string_view item : absl::StrSplit(one, ',', absl::SkipEmpty())) {
      const std::vector<std::string> parts = absl::StrSplit(item, ':');
      size_t index = 0;
      int64_t numel = 0;
      if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &index) ||
          !absl::SimpleAtoi(parts[1], &numel)) {
        return absl::InternalError(absl::StrCat("a bad bucket list: ", one));
      }
      auto [it, added] = sizes.emplace(index, numel);
      if (!added && it->second != numel) {
        return absl::FailedPreconditionError(absl::StrCat(
            "PowerSGD error feedback of bucket ", index, ": ", it->second,
            " elements on one rank, ", numel, " on another"));
      }
    }
  }
  if (sizes.empty()) return out;
  int64_t total = 0;
  for (const auto& [index, numel] : sizes) total += numel;
  at::Tensor flat = at::zeros({total}, options_);
  int64_t at = 0;
  for (const auto& [index, numel] : sizes) {
    const auto e = state_->errors().find(index);
    if (e != state_->errors().end()) {
      flat.narrow(0, at, numel).copy_(e->second.reshape({-1}));
    }
    at += numel;
  }
  CONCORD_RETURN_IF_ERROR(comm_->AllreduceSum(flat, opts_)->Wait());
  at = 0;
  for (const auto& [index, numel] : sizes) {
    out.emplace_back(absl::StrCat("error/", index), flat.narrow(0, at, numel));
    at += numel;
  }
  return out;
}

absl::Status PowerSgdParticipant::ResumeState(
    const NamedTensors* saved, torch::optim::Optimizer& /*optimizer*/) {
  if (saved == nullptr) {
    state_->SetErrors({});
    return absl::OkStatus();
  }
  const at::Tensor* replicated = nullptr;
  std::map<size_t, at::Tensor> errors;
  for (const auto& [key, t] : *saved) {
    size_t index = 0;
    if (key == "replicated") {
      replicated = &t;
    } else if (absl::StartsWith(key, "error/") &&
               absl::SimpleAtoi(key.substr(6), &index)) {
      errors[index] = t.to(options_).clone();
    }
  }
  if (replicated == nullptr) {
    // Saved without PowerSGD: it starts as at the job's start.
    Log()->info(
        "PowerSGD: the checkpoint has no state for it; it starts "
        "afresh");
    state_->SetErrors({});
    return absl::OkStatus();
  }
  CONCORD_RETURN_IF_ERROR(
      state_->LoadReplicated(TensorBytes(*replicated), options_));
  state_->SetErrors(std::move(errors));
  return absl::OkStatus();
}

}  // namespace concord::elastic

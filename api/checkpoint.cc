#include "concord/checkpoint.h"

#include <torch/torch.h>

#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/internal.h"
#include "worker/checkpoint/content.h"
#include "worker/checkpoint/disk.h"
#include "worker/error.h"

namespace concord {
namespace {

NamedTensors NamedStateOf(torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    out.emplace_back(p.key(), p.value());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    out.emplace_back(b.key(), b.value());
  }
  return out;
}

void CheckName(const std::string& name, std::set<std::string>& taken) {
  if (name.empty() || !taken.insert(name).second) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("CheckpointState::add('", name,
                             "'): a name of its own is needed"));
  }
}

}  // namespace

CheckpointState& CheckpointState::add_module(
    const std::string& name, std::shared_ptr<torch::nn::Module> module) {
  std::set<std::string> taken;
  for (const auto& [n, m] : modules_) taken.insert(n);
  CheckName(name, taken);
  if (module == nullptr) {
    throw Error(
        ErrorCode::kInvalidArgument,
        absl::StrCat("CheckpointState::add('", name, "'): an empty module"));
  }
  modules_.emplace_back(name, std::move(module));
  return *this;
}

CheckpointState& CheckpointState::add(const std::string& name,
                                      torch::optim::Optimizer& optimizer) {
  std::set<std::string> taken;
  for (const auto& [n, o] : optimizers_) taken.insert(n);
  CheckName(name, taken);
  optimizers_.emplace_back(name, &optimizer);
  return *this;
}

void save_checkpoint(const Job& job, const std::string& dir, int64_t step,
                     const CheckpointState& state, int keep) {
  if (step < 1 || keep < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("save_checkpoint: step ", step, " and keep ", keep,
                             " must be at least 1"));
  }
  // A sharded optimizer's state is gathered on rank 0 first, every rank
  // sending its shard (a collective: every rank calls save_checkpoint).
  std::map<std::string, checkpoint::OptimizerContent> sharded;
  for (const auto& [name, optimizer] : state.optimizers()) {
    if (auto* zero = dynamic_cast<ZeroRedundancyOptimizer*>(optimizer)) {
      sharded[name] = detail::ZeroCheckpoint(*zero, name, /*root=*/0);
    }
  }
  if (job.rank() != 0) return;
  checkpoint::Content c;
  c.counters.step = step;
  c.counters.world_size = job.world_size();
  c.counters.generation = job.generation();
  c.counters.run = job.state()->session().run();
  for (const auto& [name, module] : state.modules()) {
    c.modules.emplace_back(name, NamedStateOf(*module));
  }
  for (const auto& [name, optimizer] : state.optimizers()) {
    auto it = sharded.find(name);
    c.optimizers.push_back(
        it != sharded.end() ? std::move(it->second)
                            : checkpoint::CaptureOptimizer(name, *optimizer));
  }
  for (const auto& [name, v] : state.values()) {
    c.extra.emplace_back(absl::StrCat("values/", name), v);
  }
  checkpoint::WriteOptions options;
  options.keep = keep;
  auto written = checkpoint::WriteCheckpoint(
      c, dir, job.state()->session().options().spec.job_id(), options);
  ThrowIfError(written.status());
}

std::optional<int64_t> load_checkpoint(const Job& job, const std::string& dir,
                                       CheckpointState& state) {
  auto loaded = checkpoint::LoadNewest(
      dir, job.state()->session().options().spec.job_id());
  if (absl::IsNotFound(loaded.status())) return std::nullopt;
  ThrowIfError(loaded.status());
  const checkpoint::Content& c = loaded->content;
  checkpoint::Live live;
  for (const auto& [name, module] : state.modules()) {
    live.modules.emplace_back(name, NamedStateOf(*module));
  }
  // A sharded optimizer takes its shards from the whole state, checked
  // first (nothing changes when anything does not fit).
  std::vector<std::pair<ZeroRedundancyOptimizer*,
                        std::shared_ptr<torch::optim::Optimizer>>>
      sharded;
  for (const auto& [name, optimizer] : state.optimizers()) {
    auto* zero = dynamic_cast<ZeroRedundancyOptimizer*>(optimizer);
    if (zero == nullptr) {
      live.optimizers.emplace_back(name, optimizer);
      continue;
    }
    const checkpoint::OptimizerContent* saved = nullptr;
    for (const auto& o : c.optimizers) {
      if (o.name == name) saved = &o;
    }
    absl::StatusOr<std::shared_ptr<torch::optim::Optimizer>> whole =
        saved == nullptr ? absl::FailedPreconditionError(absl::StrCat(
                               "the checkpoint has no optimizer '", name, "'"))
                         : detail::ZeroCheck(*zero, *saved);
    if (!whole.ok()) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat("load_checkpoint: ", whole.status().message()));
    }
    sharded.emplace_back(zero, *std::move(whole));
  }
  auto values = checkpoint::ApplyTo(c, live);
  if (!values.ok()) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("load_checkpoint: ", values.status().message()));
  }
  for (const auto& [zero, whole] : sharded) detail::ZeroApply(*zero, *whole);
  state.values() = *std::move(values);
  return c.counters.step;
}

}  // namespace concord

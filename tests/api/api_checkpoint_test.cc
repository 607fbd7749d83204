// The public API's checkpoints of a loop without run_elastic
// (concord/checkpoint.h), in one process: a world of one.

#include <concord/concord.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "api_test_util.h"

namespace {

using concord_test::CodeOf;
using concord_test::Net;
using concord_test::TwoInputs;

// A fresh directory for one test's checkpoints.
std::string TempDir() {
  char tmpl[] = "/tmp/concord-api-ckpt-XXXXXX";
  EXPECT_NE(mkdtemp(tmpl), nullptr);
  return tmpl;
}

// One training step of `net` with `opt` on the k-th batch.
void Step(Net& net, torch::optim::Optimizer& opt, int k) {
  opt.zero_grad();
  net->forward(torch::full({3, 4}, 0.25f * static_cast<float>(k)))
      .pow(2)
      .sum()
      .backward();
  opt.step();
}

// A plain loop's checkpoints (concord/checkpoint.h): saved at a step,
// loaded into a fresh model and optimizer, the next steps are the same bit
// for bit; a model of another shape is refused and changes nothing.
TEST(CheckpointTest, APlainLoopSavesAndResumes) {
  const std::string dir = TempDir();
  concord::Job job;
  const auto step = Step;
  Net net;
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(0.01));
  concord::CheckpointState state;
  state.add("model", net).add("optimizer", opt);
  state.values()["seen"] = torch::tensor({7});
  {
    concord::CheckpointState empty;
    EXPECT_EQ(concord::load_checkpoint(job, dir, empty), std::nullopt);
  }
  for (int k = 1; k <= 3; ++k) step(net, opt, k);
  concord::save_checkpoint(job, dir, 3, state);
  for (int k = 4; k <= 5; ++k) step(net, opt, k);

  Net fresh;
  torch::optim::Adam fresh_opt(fresh->parameters(),
                               torch::optim::AdamOptions(0.5));
  concord::CheckpointState restored;
  restored.add("model", fresh).add("optimizer", fresh_opt);
  EXPECT_EQ(concord::load_checkpoint(job, dir, restored), 3);
  EXPECT_TRUE(restored.values().at("seen").equal(torch::tensor({7})));
  for (int k = 4; k <= 5; ++k) step(fresh, fresh_opt, k);
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(net->parameters()[i].equal(fresh->parameters()[i]));
  }

  TwoInputs other;
  torch::optim::Adam other_opt(other->parameters());
  const auto before = other->parameters()[0].clone();
  concord::CheckpointState wrong;
  wrong.add("model", other).add("optimizer", other_opt);
  EXPECT_EQ(CodeOf([&] { concord::load_checkpoint(job, dir, wrong); }),
            concord::ErrorCode::kFailedPrecondition);
  EXPECT_TRUE(other->parameters()[0].equal(before));
  EXPECT_EQ(CodeOf([&] { concord::save_checkpoint(job, dir, 0, state); }),
            concord::ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] { state.add("model", fresh); }),
            concord::ErrorCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

// A ZeroRedundancyOptimizer in a plain loop's checkpoint: its whole state
// as an unsharded Adam's (PyTorch's state_dict), which a plain Adam loads
// and goes on with bit for bit, as does a fresh ZeroRedundancyOptimizer; a
// sharded optimizer over another model is refused and changes nothing.
TEST(CheckpointTest, AShardedOptimizersStateIsSavedWholeAndLoadsEitherWay) {
  const std::string dir = TempDir();
  concord::Job job;
  const auto step = Step;
  Net net;
  concord::ZeroRedundancyOptimizer zero(net->parameters(),
                                        torch::optim::AdamOptions(0.01), job);
  concord::CheckpointState state;
  state.add("model", net).add("optimizer", zero);
  for (int k = 1; k <= 3; ++k) step(net, zero, k);
  concord::save_checkpoint(job, dir, 3, state);
  for (int k = 4; k <= 5; ++k) step(net, zero, k);
  // optimizer.pt is PyTorch's state_dict: "state" (every parameter's) and
  // "param_groups".
  std::string file;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.path().filename() == "optimizer.pt") file = e.path().string();
  }
  ASSERT_FALSE(file.empty());
  std::ifstream in(file, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  const c10::IValue dict = torch::pickle_load(bytes);
  ASSERT_TRUE(dict.isGenericDict());
  EXPECT_EQ(dict.toGenericDict().at("state").toGenericDict().size(),
            net->parameters().size());
  EXPECT_TRUE(dict.toGenericDict().contains("param_groups"));

  // Into an unsharded Adam (PyTorch's format: the plain path loads it).
  Net plain;
  torch::optim::Adam plain_opt(plain->parameters(),
                               torch::optim::AdamOptions(0.5));
  concord::CheckpointState as_plain;
  as_plain.add("model", plain).add("optimizer", plain_opt);
  EXPECT_EQ(concord::load_checkpoint(job, dir, as_plain), 3);
  EXPECT_EQ(plain_opt.state().size(), net->parameters().size());
  // Into a fresh sharded one.
  Net fresh;
  concord::ZeroRedundancyOptimizer fresh_zero(
      fresh->parameters(), torch::optim::AdamOptions(0.5), job);
  concord::CheckpointState as_zero;
  as_zero.add("model", fresh).add("optimizer", fresh_zero);
  EXPECT_EQ(concord::load_checkpoint(job, dir, as_zero), 3);
  for (int k = 4; k <= 5; ++k) {
    step(plain, plain_opt, k);
    step(fresh, fresh_zero, k);
  }
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(net->parameters()[i].equal(plain->parameters()[i])) << i;
    EXPECT_TRUE(net->parameters()[i].equal(fresh->parameters()[i])) << i;
  }

  TwoInputs other;
  concord::ZeroRedundancyOptimizer other_zero(other->parameters(),
                                              torch::optim::AdamOptions(), job);
  const auto before = other->parameters()[0].clone();
  concord::CheckpointState wrong;
  wrong.add("model", other).add("optimizer", other_zero);
  EXPECT_EQ(CodeOf([&] { concord::load_checkpoint(job, dir, wrong); }),
            concord::ErrorCode::kFailedPrecondition);
  EXPECT_TRUE(other->parameters()[0].equal(before));
  EXPECT_TRUE(other_zero.local_optimizer().state().empty());
  std::filesystem::remove_all(dir);
}

}  // namespace

// checkpoint::OptimizerSnapshot: StepTaking against LibTorch's own step()
// bit for bit, and what it keeps (see Note [Steps that keep their start] in
// worker/checkpoint/optimizer_snapshot.h).
#include "worker/checkpoint/optimizer_snapshot.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "worker/torch_compat.h"

namespace concord::checkpoint {
namespace {

namespace optim = torch::optim;

using Make = std::function<std::unique_ptr<optim::Optimizer>(
    std::vector<torch::Tensor>)>;

// Parameters of a few shapes (one without a gradient at some steps), two
// of them larger than a folded step's chunk and of odd sizes (see Note
// [Folded steps in chunks] in worker/checkpoint/optimizer_snapshot.cc), one
// not contiguous.
std::vector<torch::Tensor> Params(int64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({7, 5}),    torch::randn({33}),
          torch::randn({2, 3, 4}), torch::randn({1}),
          torch::randn({70001}),   torch::randn({301, 257}),
          torch::randn({9, 6}).t()};
}

// Gradients for `step`: the same on both sides; parameter 3 has none at
// odd steps.
void SetGrads(std::vector<torch::Tensor>& params, int step) {
  torch::manual_seed(1000 + step);
  for (size_t i = 0; i < params.size(); ++i) {
    if (i == 3 && step % 2 == 1) {
      params[i].mutable_grad() = torch::Tensor();
    } else {
      params[i].mutable_grad() = torch::randn_like(params[i]);
    }
  }
}

// Every state tensor of `o`, by parameter and name, in parameter order.
std::vector<torch::Tensor> StateTensors(optim::Optimizer& o,
                                        const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> out;
  for (const auto& p : ps) {
    auto it = o.state().find(compat::OptimizerStateKey(p));
    if (it == o.state().end()) continue;
    const auto adam_like = [&out](const auto& a) {
      out.push_back(torch::tensor(a.step()));
      out.push_back(a.exp_avg());
      out.push_back(a.exp_avg_sq());
      if (a.max_exp_avg_sq().defined()) out.push_back(a.max_exp_avg_sq());
    };
    if (auto* a = dynamic_cast<optim::AdamParamState*>(it->second.get())) {
      adam_like(*a);
    } else if (auto* w =
                   dynamic_cast<optim::AdamWParamState*>(it->second.get())) {
      adam_like(*w);
    } else if (auto* s =
                   dynamic_cast<optim::SGDParamState*>(it->second.get())) {
      out.push_back(s->momentum_buffer());
    }
  }
  return out;
}

std::vector<torch::Tensor> Clones(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.clone());
  return out;
}

void ExpectEqual(const std::vector<torch::Tensor>& got,
                 const std::vector<torch::Tensor>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(torch::equal(got[i], want[i])) << what << " tensor " << i;
  }
}

struct Case {
  std::string name;
  Make make;
  bool folds;  // after the first step
};

std::vector<Case> Cases() {
  auto adam = [](optim::AdamOptions o) {
    return [o](std::vector<torch::Tensor> ps) {
      return std::unique_ptr<optim::Optimizer>(
          std::make_unique<optim::Adam>(ps, o));
    };
  };
  auto adamw = [](optim::AdamWOptions o) {
    return [o](std::vector<torch::Tensor> ps) {
      return std::unique_ptr<optim::Optimizer>(
          std::make_unique<optim::AdamW>(ps, o));
    };
  };
  return {
      {"Adam", adam(optim::AdamOptions(0.01)), true},
      {"Adam weight_decay", adam(optim::AdamOptions(0.01).weight_decay(0.1)),
       true},
      {"Adam amsgrad betas eps",
       adam(optim::AdamOptions(0.02).amsgrad(true).betas({0.8, 0.9}).eps(1e-6)),
       true},
      {"AdamW", adamw(optim::AdamWOptions(0.01)), true},
      {"AdamW amsgrad no decay",
       adamw(optim::AdamWOptions(0.03).amsgrad(true).weight_decay(0)), true},
      {"SGD momentum (copied)",
       [](std::vector<torch::Tensor> ps) {
         return std::unique_ptr<optim::Optimizer>(std::make_unique<optim::SGD>(
             ps, optim::SGDOptions(0.1).momentum(0.9).nesterov(true)));
       },
       false},
  };
}

// One case's two sides: LibTorch's own step over `a`, the snapshot's over
// `b`, the same parameters with the same gradients.
struct Sides {
  Sides(const Case& c, int64_t seed)
      : a(Params(seed)), b(Params(seed)), plain(c.make(a)), other(c.make(b)) {}

  // Gives both sides the step's gradients and takes LibTorch's step;
  // `before` and `state_before` are b's parameters and state until then.
  void Step(int step) {
    SetGrads(a, step);
    SetGrads(b, step);
    before = Clones(b);
    state_before = Clones(StateTensors(*other, b));
    plain->step();
  }

  std::vector<torch::Tensor> a, b;
  std::unique_ptr<optim::Optimizer> plain, other;
  std::vector<torch::Tensor> before, state_before;
};

// Calls f(case, sides, snapshot, step) after each of five steps of
// LibTorch's of every case (Sides::Step).
template <typename F>
void OverEveryCase(int64_t seed, F&& f) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    Sides sides(c, seed);
    OptimizerSnapshot snapshot;
    for (int step = 0; step < 5; ++step) {
      sides.Step(step);
      f(c, sides, snapshot, step);
    }
  }
}

TEST(OptimizerSnapshotTest, StepTakingIsLibTorchsStepBitForBit) {
  OverEveryCase(3, [](const Case& c, Sides& sides, OptimizerSnapshot& snapshot,
                      int step) {
    auto& [a, b, plain, taking, before, state_before] = sides;
    EXPECT_EQ(OptimizerSnapshot::Folds(*taking), c.folds && step > 0);
    snapshot.TakeParams(*taking);
    snapshot.StepTaking(*taking);
    ExpectEqual(b, a, "parameters after step " + std::to_string(step));
    ExpectEqual(StateTensors(*taking, b), StateTensors(*plain, a),
                "state after step " + std::to_string(step));
    // What Restore puts back is the step's start, bit for bit; stepping
    // again from there is the same step.
    if (step == 3) {
      snapshot.Restore(*taking);
      ExpectEqual(b, before, "parameters restored");
      ExpectEqual(StateTensors(*taking, b), state_before, "state restored");
      snapshot.TakeParams(*taking);
      snapshot.StepTaking(*taking);
      ExpectEqual(b, a, "parameters stepped again");
      ExpectEqual(StateTensors(*taking, b), StateTensors(*plain, a),
                  "state stepped again");
    }
  });
}

// A mirror's step (see Note [ZeRO mirrors] in worker/zero/partition.h):
// the state as LibTorch's step makes it and the parameters untouched (their
// owner sends them); FinishParams then makes the parameters' update, and
// Restore still puts back the step's start.
TEST(OptimizerSnapshotTest, StepStateTakingLeavesTheParametersToFinishParams) {
  OverEveryCase(4, [](const Case& c, Sides& sides, OptimizerSnapshot& snapshot,
                      int step) {
    auto& [a, b, plain, mirror, before, state_before] = sides;
    snapshot.TakeParams(*mirror);
    const bool deferred = snapshot.StepStateTaking(*mirror);
    EXPECT_EQ(deferred, c.folds && step > 0);
    ExpectEqual(StateTensors(*mirror, b), StateTensors(*plain, a),
                "state after step " + std::to_string(step));
    if (!deferred) {
      ExpectEqual(b, a, "parameters stepped whole");
      return;
    }
    ExpectEqual(b, before, "parameters left alone");
    if (step == 2) {
      // Half-written by a broadcast that never finished: FinishParams
      // starts from the step's start regardless.
      b[0].zero_();
    }
    if (step == 3) {
      snapshot.Restore(*mirror);
      ExpectEqual(b, before, "parameters restored");
      ExpectEqual(StateTensors(*mirror, b), state_before, "state restored");
      snapshot.TakeParams(*mirror);
      EXPECT_TRUE(snapshot.StepStateTaking(*mirror));
    }
    snapshot.FinishParams(*mirror);
    ExpectEqual(b, a, "parameters finished at step " + std::to_string(step));
    // Parameter 3 has no gradient at odd steps: FinishParams leaves it.
    ExpectEqual(StateTensors(*mirror, b), StateTensors(*plain, a),
                "state after FinishParams");
  });
}

TEST(OptimizerSnapshotTest, StepTakingKeepsTheStateWithoutCopyingIt) {
  std::vector<torch::Tensor> ps = Params(5);
  optim::Adam adam(ps, optim::AdamOptions(0.01));
  OptimizerSnapshot snapshot;
  SetGrads(ps, 0);
  adam.step();  // makes the state
  auto exp_avg = [&]() {
    return static_cast<optim::AdamParamState&>(
               *adam.state().at(compat::OptimizerStateKey(ps[0])))
        .exp_avg();
  };
  std::vector<const void*> seen;
  for (int step = 1; step < 6; ++step) {
    SetGrads(ps, 2 * step);  // every parameter has a gradient
    const torch::Tensor live = exp_avg();
    const torch::Tensor was = live.clone();
    snapshot.TakeParams(adam);
    snapshot.StepTaking(adam);
    // The tensor the step started from is the snapshot's now, untouched:
    // Restore puts back exactly it.
    EXPECT_FALSE(exp_avg().is_same(live));
    EXPECT_TRUE(torch::equal(live, was));
    seen.push_back(exp_avg().data_ptr());
  }
  // Two buffers alternate: nothing allocated after the second step.
  for (size_t i = 2; i < seen.size(); ++i) EXPECT_EQ(seen[i], seen[i - 2]);
  EXPECT_NE(seen[1], seen[0]);
  // Its bytes: the parameters' copies and the kept moments.
  int64_t params = 0;
  for (const auto& p : ps) params += int64_t(p.nbytes());
  EXPECT_EQ(snapshot.bytes(), 3 * params);
}

TEST(OptimizerSnapshotTest, AStepWithAClosureIsLibTorchsOwn) {
  // The closure gives parameter 3 its first gradient: the step must update
  // it (and make its state) as LibTorch's does.
  std::vector<torch::Tensor> a = Params(9), b = Params(9);
  optim::Adam plain(a, optim::AdamOptions(0.01));
  optim::Adam taking(b, optim::AdamOptions(0.01));
  OptimizerSnapshot snapshot;
  SetGrads(a, 1);  // parameter 3 without a gradient
  SetGrads(b, 1);
  plain.step();
  snapshot.TakeParams(taking);
  snapshot.StepTaking(taking);
  auto closure = [](std::vector<torch::Tensor>& ps) {
    return [&ps]() {
      SetGrads(ps, 2);  // every parameter
      return torch::ones({});
    };
  };
  EXPECT_TRUE(OptimizerSnapshot::Folds(taking));
  const auto before = Clones(b);
  plain.step(closure(a));
  snapshot.TakeParams(taking);
  EXPECT_TRUE(
      torch::equal(snapshot.StepTaking(taking, closure(b)), torch::ones({})));
  ExpectEqual(b, a, "parameters");
  ExpectEqual(StateTensors(taking, b), StateTensors(plain, a), "state");
  snapshot.Restore(taking);
  ExpectEqual(b, before, "parameters restored");
  EXPECT_EQ(taking.state().size(), b.size() - 1);  // parameter 3's dropped
}

TEST(OptimizerSnapshotTest, ASubclassOrAFirstStepIsNotFolded) {
  struct MyAdam : optim::Adam {
    using optim::Adam::Adam;
  };
  std::vector<torch::Tensor> ps = Params(7);
  MyAdam mine(ps, optim::AdamOptions(0.01));
  SetGrads(ps, 0);
  EXPECT_FALSE(OptimizerSnapshot::Folds(mine));
  mine.step();
  EXPECT_FALSE(OptimizerSnapshot::Folds(mine));  // its step() may differ
  std::vector<torch::Tensor> qs = Params(7);
  optim::Adam adam(qs, optim::AdamOptions(0.01));
  SetGrads(qs, 0);
  EXPECT_FALSE(OptimizerSnapshot::Folds(adam));  // no state yet
  // A first step through StepTaking: Restore drops the state it made.
  OptimizerSnapshot snapshot;
  const auto before = Clones(qs);
  snapshot.TakeParams(adam);
  snapshot.StepTaking(adam);
  EXPECT_EQ(adam.state().size(), qs.size());
  EXPECT_TRUE(OptimizerSnapshot::Folds(adam));
  snapshot.Restore(adam);
  EXPECT_TRUE(adam.state().empty());
  ExpectEqual(qs, before, "parameters restored");
}

}  // namespace
}  // namespace concord::checkpoint

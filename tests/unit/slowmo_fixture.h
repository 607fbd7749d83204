#pragma once
// SlowMo tests' fixed model, gradients and the plain reference (shared by
// slowmo_test.cc and slowmo_hierarchy_test.cc).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "worker/slowmo/options.h"

namespace concord::slowmo::fixture {

inline constexpr int64_t kSizes[] = {5, 7};   // two parameters, 12 elements
inline constexpr double kLr[] = {0.1, 0.05};  // one optimizer group each
inline constexpr int64_t kTotal = 12;

// The gradient of element i (flat) on `rank` at update `step`; the first
// step's is the same everywhere, so x_old starts equal on every rank.
inline float Grad(int rank, int64_t step, int64_t i) {
  const double r = step == 0 ? 0 : rank;
  return static_cast<float>(std::sin(1.0 + 0.7 * r + 1.3 * step + 0.1 * i));
}
inline float Init(int rank, int64_t i) {
  return static_cast<float>(0.5 * std::cos(0.3 * i) + 0.01 * rank);
}
inline double LrOf(int64_t i) { return i < kSizes[0] ? kLr[0] : kLr[1]; }

struct Model {
  std::vector<torch::Tensor> params;
  std::unique_ptr<torch::optim::SGD> opt;
};

// Parameters start equal on every rank (as after DDP's broadcast) unless
// `differ`.
inline Model MakeModel(int rank, bool differ = false) {
  Model m;
  int64_t at = 0;
  for (int64_t n : kSizes) {
    torch::Tensor p = torch::empty({n});
    for (int64_t i = 0; i < n; ++i) {
      p[i] = Init(differ ? rank : 0, at + i);
    }
    m.params.push_back(p.requires_grad_());
    at += n;
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (size_t g = 0; g < m.params.size(); ++g) {
    groups.emplace_back(std::vector<torch::Tensor>{m.params[g]},
                        std::make_unique<torch::optim::SGDOptions>(kLr[g]));
  }
  m.opt = std::make_unique<torch::optim::SGD>(std::move(groups),
                                              torch::optim::SGDOptions(0.1));
  return m;
}

inline void LocalStep(Model& m, int rank, int64_t step) {
  int64_t at = 0;
  for (auto& p : m.params) {
    torch::Tensor g = torch::empty_like(p);
    for (int64_t i = 0; i < p.numel(); ++i) g[i] = Grad(rank, step, at + i);
    p.mutable_grad() = g;
    at += p.numel();
  }
  m.opt->step();
}

inline torch::Tensor Flat(const Model& m) {
  return torch::cat(
      {m.params[0].detach().reshape(-1), m.params[1].detach().reshape(-1)});
}

// The reference: every rank's flat parameters, and the full u and x_old.
struct Reference {
  std::vector<torch::Tensor> x;
  torch::Tensor u, x_old;
  bool initialized = false;
};

inline Reference Start(int world) {
  Reference ref;
  for (int r = 0; r < world; ++r) {
    torch::Tensor x = torch::empty({kTotal});
    for (int64_t i = 0; i < kTotal; ++i) x[i] = Init(0, i);
    ref.x.push_back(x);
  }
  return ref;
}

// One update of LocalSGD + slow momentum, written out plainly.
// `grad(unit, n, i)`: unit `unit`'s gradient (a rank's, or a node's
// average with a hierarchy).
using GradFn = std::function<float(int, int64_t, int64_t)>;
inline void ReferenceUpdate(Reference& ref, int64_t n, const SlowMoOptions& o,
                            const GradFn& grad = Grad) {
  const int world = static_cast<int>(ref.x.size());
  for (int r = 0; r < world; ++r) {
    for (int64_t i = 0; i < kTotal; ++i) {
      ref.x[r][i] = ref.x[r][i].item<float>() -
                    static_cast<float>(LrOf(i)) * grad(r, n, i);
    }
  }
  const bool slowmo = o.slowmo_lr() != 1.0 || o.slowmo_momentum() != 0.0;
  if (slowmo && !ref.initialized) {
    ref.x_old = ref.x[0].clone();
    ref.u = torch::zeros({kTotal});
    ref.initialized = true;
  }
  const bool slow = slowmo && (n + 1) % o.slowmo_frequency() == 0;
  const bool average = (n + 1) % o.localsgd_frequency() == 0 || slow;
  if (average) {
    torch::Tensor mean = torch::zeros({kTotal});
    for (int r = 0; r < world; ++r) mean += ref.x[r] / world;
    for (int r = 0; r < world; ++r) ref.x[r] = mean.clone();
  }
  if (slow) {
    for (int64_t i = 0; i < kTotal; ++i) {
      const double lr = LrOf(i);
      const double x = ref.x[0][i].item<float>();
      const double xo = ref.x_old[i].item<float>();
      const double u =
          o.slowmo_momentum() * ref.u[i].item<float>() + (xo - x) / lr;
      ref.u[i] = u;
      ref.x_old[i] = xo - o.slowmo_lr() * lr * u;
    }
    for (int r = 0; r < world; ++r) ref.x[r] = ref.x_old.clone();
  }
}

inline void ExpectClose(const torch::Tensor& a, const torch::Tensor& b,
                        const std::string& what) {
  ASSERT_EQ(a.numel(), b.numel()) << what;
  EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-6)) << what << "\n"
                                                 << a << "\n"
                                                 << b;
}

}  // namespace concord::slowmo::fixture

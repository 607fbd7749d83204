// SlowMo's fp16 path (see Note [fp16 masters] in worker/slowmo/slowmo.h): fp16
// module parameters, fp32 masters that the optimizer steps, fairscale's
// error feedback. Each rank (a thread over real Gloo) compares with every
// rank's trajectory written out here with the same torch ops in the same
// dtypes, so the fp16 arithmetic must match bit for bit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rank_threads.h"
#include "slowmo_fixture.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/slowmo/slowmo.h"

namespace concord::slowmo {
namespace {

using concord::testing::RunRanks;
using fixture::Grad;
using fixture::Init;
using fixture::kLr;
using fixture::kSizes;

// One rank's model as an fp16 trainer holds it (fairseq's FP16Optimizer):
// fp16 parameters, fp32 masters stepped by SGD, then copied into the fp16
// parameters.
struct Fp16Model {
  std::vector<torch::Tensor> p16, p32;
  std::unique_ptr<torch::optim::SGD> opt;
};

Fp16Model MakeFp16(int rank, bool differ = false) {
  Fp16Model m;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  int64_t at = 0;
  for (size_t g = 0; g < 2; ++g) {
    const int64_t n = kSizes[g];
    torch::Tensor p = torch::empty({n});
    for (int64_t i = 0; i < n; ++i) p[i] = Init(differ ? rank : 0, at + i);
    at += n;
    m.p16.push_back(p.to(torch::kHalf).requires_grad_());
    m.p32.push_back(p.requires_grad_());
    groups.emplace_back(std::vector<torch::Tensor>{m.p32.back()},
                        std::make_unique<torch::optim::SGDOptions>(kLr[g]));
  }
  m.opt = std::make_unique<torch::optim::SGD>(std::move(groups),
                                              torch::optim::SGDOptions(0.1));
  return m;
}

// Gradients into the masters, optimizer.step(), masters into fp16.
void Fp16Step(Fp16Model& m, int rank, int64_t step) {
  torch::NoGradGuard no_grad;
  int64_t at = 0;
  for (auto& p : m.p32) {
    torch::Tensor g = torch::empty_like(p);
    for (int64_t i = 0; i < p.numel(); ++i) g[i] = Grad(rank, step, at + i);
    p.mutable_grad() = g;
    at += p.numel();
  }
  m.opt->step();
  for (size_t j = 0; j < m.p16.size(); ++j) m.p16[j].copy_(m.p32[j]);
}

torch::Tensor Cat(const std::vector<torch::Tensor>& v) {
  return torch::cat({v[0].detach().reshape(-1), v[1].detach().reshape(-1)});
}

// The slow-momentum state of the reference, per parameter. Unsharded, every
// rank steps its own masters, which differ by their fp16 errors (as in
// fairscale): one state per rank. Sharded, the owners step the average.
struct SlowRef {
  std::vector<torch::Tensor> u, x_old;
  bool initialized = false;
};

// fairscale's perform_slowmo(optimizer, fp32_params) for LocalSGD, every
// rank's arithmetic written out.
void LocalSgdReference(std::vector<Fp16Model>& ref, int64_t n,
                       const SlowMoOptions& o, std::vector<SlowRef>& slows) {
  torch::NoGradGuard no_grad;
  const int world = static_cast<int>(ref.size());
  const bool slowmo = o.slowmo_lr() != 1.0 || o.slowmo_momentum() != 0.0;
  for (int r = 0; r < world && slowmo; ++r) {
    SlowRef& slow = slows[r];
    if (slow.initialized) continue;
    // x_old from the optimizer's parameters: the masters.
    for (const auto& p : ref[r].p32) {
      slow.x_old.push_back(p.detach().clone());
      slow.u.push_back(torch::zeros_like(p));
    }
    slow.initialized = true;
  }
  const bool slow_step = slowmo && (n + 1) % o.slowmo_frequency() == 0;
  const bool average = (n + 1) % o.localsgd_frequency() == 0 &&
                       !(o.slowmo_memory_efficient() && slow_step);
  if (average) {
    for (auto& r : ref) {
      for (size_t j = 0; j < 2; ++j) {
        r.p16[j].div_(world);
        r.p16[j].mul_(world);
        r.p32[j].sub_(r.p16[j].to(torch::kFloat));
      }
    }
    for (size_t j = 0; j < 2; ++j) {
      torch::Tensor sum = ref[0].p16[j].div(world);
      for (int r = 1; r < world; ++r) sum = sum + ref[r].p16[j].div(world);
      for (auto& r : ref) {
        r.p16[j].copy_(sum);
        r.p32[j].add_(r.p16[j].to(torch::kFloat));
      }
    }
  }
  const bool sharded = o.slowmo_memory_efficient();
  for (int r = 0; r < (sharded ? 1 : world) && slow_step; ++r) {
    SlowRef& slow = slows[r];
    for (size_t j = 0; j < 2; ++j) {
      torch::Tensor x;
      if (sharded) {  // reduce of the fp32 masters
        x = ref[0].p32[j].div(world);
        for (int q = 1; q < world; ++q) x = x + ref[q].p32[j].div(world);
      } else {
        x = ref[r].p32[j].detach().clone();
      }
      const double lr = kLr[j];
      slow.u[j]
          .mul_(o.slowmo_momentum())
          .sub_(x, 1.0 / lr)
          .add_(slow.x_old[j], 1.0 / lr);
      slow.x_old[j].add_(slow.u[j], -lr * o.slowmo_lr());
      if (sharded) {
        for (auto& q : ref) q.p32[j].copy_(slow.x_old[j]);
      } else {
        ref[r].p32[j].copy_(slow.x_old[j]);
      }
    }
  }
  if (average || slow_step) {
    for (auto& r : ref) {
      for (size_t j = 0; j < 2; ++j) r.p16[j].copy_(r.p32[j]);
    }
  }
}

SlowMoOptions LocalSgd(int64_t tau) {
  SlowMoOptions o;
  o.base_algorithm(BaseAlgorithm::kLocalSgd);
  o.localsgd_frequency(tau);
  o.slowmo_lr(1.0);
  o.slowmo_momentum(0.0);
  return o;
}

void Close(const torch::Tensor& a, const torch::Tensor& b, double rtol,
           const std::string& what) {
  ASSERT_EQ(a.numel(), b.numel()) << what;
  EXPECT_TRUE(torch::allclose(a.to(torch::kDouble), b.to(torch::kDouble), rtol,
                              rtol / 10))
      << what << ": max |difference| "
      << (a.to(torch::kDouble) - b.to(torch::kDouble))
             .abs()
             .max()
             .item<double>()
      << "\n"
      << a << "\n"
      << b;
}

// Trains `steps` updates; `exact`: fp16 and fp32 parameters, u and x_old
// bit for bit, else within 1e-5 (masters, u, x_old) and 1e-3 (fp16: one
// rounding). Slow momentum on fp16 values instead of the masters would be
// off by about 1e-4 (x) and 1e-3 (u).
void RunFp16LocalSgd(int world, const SlowMoOptions& o, int64_t steps,
                     bool exact) {
  RunRanks(world, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Fp16Model m = MakeFp16(rank);
    auto s = SlowMo::Create(m.p16, {}, comm, 0, o);
    ASSERT_TRUE(s.ok()) << s.status();
    std::vector<Fp16Model> ref;
    for (int r = 0; r < world; ++r) ref.push_back(MakeFp16(r));
    std::vector<SlowRef> slows(world);
    // Sharded, the owner's state (every rank's, the same at the start).
    const SlowRef& slow = slows[o.slowmo_memory_efficient() ? 0 : rank];
    bool differed = false, error_kept = false;
    for (int64_t n = 0; n < steps; ++n) {
      ASSERT_TRUE((*s)->PrepareForward().ok());
      ASSERT_TRUE((*s)->AfterBackward().ok());
      Fp16Step(m, rank, n);
      absl::Status st = (*s)->PerformSlowMo(*m.opt, m.p32);
      ASSERT_TRUE(st.ok()) << st;
      for (int r = 0; r < world; ++r) Fp16Step(ref[r], r, n);
      LocalSgdReference(ref, n, o, slows);
      const std::string at = " after update " + std::to_string(n);
      if (exact) {
        EXPECT_TRUE(torch::equal(Cat(m.p16), Cat(ref[rank].p16)))
            << "p16" << at;
        EXPECT_TRUE(torch::equal(Cat(m.p32), Cat(ref[rank].p32)))
            << "p32" << at;
      } else {
        Close(Cat(m.p16), Cat(ref[rank].p16), 1e-3, "p16" + at);
        Close(Cat(m.p32), Cat(ref[rank].p32), 1e-5, "p32" + at);
      }
      differed |= !torch::equal(Cat(ref[0].p32), Cat(ref[world - 1].p32));
      // The masters keep what fp16 cannot hold.
      error_kept |= !torch::equal(Cat(m.p32), Cat(m.p16).to(torch::kFloat));
      if ((*s)->slowmo_enabled() && slow.initialized) {
        const int64_t a = (*s)->portion_start(), b = (*s)->portion_end();
        if (b > a) {
          ASSERT_EQ((*s)->momentum_buffer().scalar_type(), torch::kFloat);
          const torch::Tensor u = Cat(slow.u).narrow(0, a, b - a);
          const torch::Tensor x_old = Cat(slow.x_old).narrow(0, a, b - a);
          Close((*s)->momentum_buffer(), u, 1e-5, "u" + at);
          Close((*s)->old_params(), x_old, 1e-5, "x_old" + at);
          if (exact) {
            EXPECT_TRUE(torch::equal((*s)->momentum_buffer(), u)) << "u" << at;
            EXPECT_TRUE(torch::equal((*s)->old_params(), x_old))
                << "x_old" << at;
          }
        }
      }
    }
    EXPECT_TRUE(error_kept);
    if (world > 1) {
      EXPECT_TRUE(differed);  // ranks drift between averages
    }
    EXPECT_EQ((*s)->num_updates(), steps);
  });
}

TEST(SlowMoFp16Test, LocalSgdErrorFeedbackBitForBit) {
  RunFp16LocalSgd(2, LocalSgd(3), 7, /*exact=*/true);
  RunFp16LocalSgd(1, LocalSgd(2), 4, /*exact=*/true);
}

TEST(SlowMoFp16Test, SlowMomentumStepsTheFp32Masters) {
  SlowMoOptions o = LocalSgd(2);
  o.slowmo_momentum(0.5);
  o.slowmo_lr(0.7);
  o.slowmo_frequency(4);
  o.slowmo_memory_efficient(false);
  RunFp16LocalSgd(2, o, 9, /*exact=*/true);
  o.slowmo_memory_efficient(true);  // sharded: reduce of the masters
  o.slowmo_num_shards(2);
  RunFp16LocalSgd(2, o, 9, /*exact=*/true);
}

// One push-sum round per update on the fp16 numerators (n-peer directed
// exponential over 3 ranks: in-peer r - 1, then r - 2), with error feedback.
TEST(SlowMoFp16Test, SgpRoundWithFp16Parameters) {
  SlowMoOptions o;
  o.base_algorithm(BaseAlgorithm::kSgp);
  o.slowmo_lr(1.0);
  o.slowmo_momentum(0.0);
  const int world = 3;
  RunRanks(world, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    torch::NoGradGuard no_grad;
    Fp16Model m = MakeFp16(rank, /*differ=*/true);
    auto s = *SlowMo::Create(m.p16, {}, comm, 0, o);
    ASSERT_TRUE(s->SetFp32Params(m.p32).ok());
    std::vector<Fp16Model> ref;
    for (int r = 0; r < world; ++r) ref.push_back(MakeFp16(r, true));
    const torch::Tensor lo =
        torch::tensor({0.5}, torch::kFloat).to(torch::kHalf);
    const int offsets[] = {1, 2};
    for (int64_t n = 0; n < 5; ++n) {
      ASSERT_TRUE(s->PrepareForward().ok());
      ASSERT_TRUE(s->AfterBackward().ok());
      Fp16Step(m, rank, n);
      ASSERT_TRUE(s->PerformSlowMo(*m.opt).ok());
      for (int r = 0; r < world; ++r) Fp16Step(ref[r], r, n);
      for (auto& r : ref) {
        for (size_t j = 0; j < 2; ++j) {
          r.p32[j].sub_(r.p16[j].to(torch::kFloat));
        }
      }
      std::vector<std::vector<torch::Tensor>> mixed(world);
      for (int r = 0; r < world; ++r) {
        const int in = (r - offsets[n % 2] + world) % world;
        for (size_t j = 0; j < 2; ++j) {
          mixed[r].push_back((ref[r].p16[j] + ref[in].p16[j]).mul_(lo));
        }
      }
      for (int r = 0; r < world; ++r) {
        for (size_t j = 0; j < 2; ++j) {
          ref[r].p16[j].copy_(mixed[r][j]);
          ref[r].p32[j].add_(ref[r].p16[j].to(torch::kFloat));
          ref[r].p16[j].copy_(ref[r].p32[j]);
        }
      }
      const std::string at = " after update " + std::to_string(n);
      EXPECT_TRUE(torch::equal(Cat(m.p16), Cat(ref[rank].p16))) << "p16" << at;
      EXPECT_TRUE(torch::equal(Cat(m.p32), Cat(ref[rank].p32))) << "p32" << at;
      EXPECT_EQ(s->ps_weight(), 1.0);
    }
    EXPECT_EQ(s->gossip_round(), 5);
    // Gossip really mixed different values (the test can fail).
    EXPECT_FALSE(torch::equal(Cat(ref[0].p32), Cat(ref[1].p32)));
  });
}

// The fixed gradient of `rank` at `step`, per parameter, in fp16 (as a
// backward through an fp16 model leaves it).
std::vector<torch::Tensor> Grads16(int rank, int64_t step) {
  std::vector<torch::Tensor> g;
  int64_t at = 0;
  for (int64_t n : kSizes) {
    torch::Tensor t = torch::empty({n});
    for (int64_t i = 0; i < n; ++i) t[i] = Grad(rank, step, at + i);
    g.push_back(t.to(torch::kHalf));
    at += n;
  }
  return g;
}

// fairseq: the fp16 gradients into the masters, step, masters into fp16.
void StepWith(Fp16Model& m, const std::vector<torch::Tensor>& g16) {
  torch::NoGradGuard no_grad;
  for (size_t j = 0; j < m.p32.size(); ++j) {
    m.p32[j].mutable_grad() = g16[j].to(torch::kFloat);
  }
  m.opt->step();
  for (size_t j = 0; j < m.p16.size(); ++j) m.p16[j].copy_(m.p32[j]);
}

// The node hierarchy with fp16 (see Note [Node hierarchy]): 4 ranks = 2 nodes x
// 2 (interleaved), fp16 gradients averaged in the node, LocalSGD with error
// feedback and sharded slow momentum between the masters, the master's fp32
// masters broadcast in the node; every rank equals its node's unit of a 2-unit
// reference (gradient: the node's fp16 average) bit for bit.
TEST(SlowMoFp16Test, HierarchyNodesTakeTheirMastersFp32) {
  SlowMoOptions o = LocalSgd(2);
  o.slowmo_momentum(0.5);
  o.slowmo_lr(0.7);
  o.slowmo_frequency(4);
  o.slowmo_memory_efficient(true);
  o.slowmo_num_shards(2);
  o.nprocs_per_node(2);
  const std::vector<std::string> ids = {"n0", "n1", "n0", "n1"};
  const std::vector<std::vector<int>> node_ranks = {{0, 2}, {1, 3}};
  comm::InMemoryStore group_store;
  comm::GlooGroupFactory factory(&group_store, comm::GlooOptions());
  RunRanks(4, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Fp16Model m = MakeFp16(rank);
    SlowMoOptions mine = o;
    SlowMoInternals internals;
    internals.node_id = ids[static_cast<size_t>(rank)];
    auto made = SlowMo::Create(m.p16, {}, comm, 0, mine, internals, &factory);
    ASSERT_TRUE(made.ok()) << made.status();
    auto& s = *made;
    ASSERT_TRUE(s->SetFp32Params(m.p32).ok());
    const int node = rank % 2;
    std::vector<Fp16Model> ref;
    for (int u = 0; u < 2; ++u) ref.push_back(MakeFp16(u));
    std::vector<SlowRef> slows(2);
    bool differed = false;
    for (int64_t n = 0; n < 9; ++n) {
      ASSERT_TRUE(s->PrepareForward().ok());
      {
        torch::NoGradGuard no_grad;
        std::vector<torch::Tensor> g = Grads16(rank, n);
        for (size_t j = 0; j < 2; ++j) m.p16[j].mutable_grad() = g[j];
      }
      ASSERT_TRUE(s->AfterBackward().ok());
      StepWith(m, {m.p16[0].grad(), m.p16[1].grad()});
      absl::Status st = s->PerformSlowMo(*m.opt);
      ASSERT_TRUE(st.ok()) << st;
      for (int u = 0; u < 2; ++u) {
        const auto a = Grads16(node_ranks[u][0], n);
        const auto b = Grads16(node_ranks[u][1], n);
        StepWith(ref[u],
                 {a[0].div(2) + b[0].div(2), a[1].div(2) + b[1].div(2)});
      }
      LocalSgdReference(ref, n, o, slows);
      const std::string at =
          "rank " + std::to_string(rank) + " after update " + std::to_string(n);
      EXPECT_TRUE(torch::equal(Cat(m.p16), Cat(ref[node].p16))) << "p16 " << at;
      EXPECT_TRUE(torch::equal(Cat(m.p32), Cat(ref[node].p32))) << "p32 " << at;
      differed |= !torch::equal(Cat(ref[0].p32), Cat(ref[1].p32));
      const int64_t a = s->portion_start(), b = s->portion_end();
      if (b > a) {
        EXPECT_TRUE(torch::equal(s->old_params(),
                                 Cat(slows[0].x_old).narrow(0, a, b - a)))
            << "x_old " << at;
      }
    }
    EXPECT_EQ(s->num_nodes(), 2);
    EXPECT_EQ(s->is_master(), rank < 2);
    EXPECT_TRUE(differed) << "the nodes never drifted apart";
  });
}

// fairscale also takes one flat fp32 tensor of every element: with one
// learning rate it trains exactly like one master per parameter (two
// SlowMo instances side by side on the same ranks).
TEST(SlowMoFp16Test, OneFlatMasterWorksLikeOnePerParameter) {
  SlowMoOptions o = LocalSgd(2);
  o.slowmo_momentum(0.5);
  o.slowmo_lr(0.7);
  o.slowmo_frequency(4);
  o.slowmo_num_shards(2);
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Fp16Model a = MakeFp16(rank);  // one master per parameter
    a.opt = std::make_unique<torch::optim::SGD>(a.p32,
                                                torch::optim::SGDOptions(0.1));
    Fp16Model b = MakeFp16(rank);  // one flat master
    torch::Tensor flat32 = Cat(b.p32).clone().requires_grad_();
    b.opt = std::make_unique<torch::optim::SGD>(
        std::vector<torch::Tensor>{flat32}, torch::optim::SGDOptions(0.1));
    auto sa = *SlowMo::Create(a.p16, {}, comm, 0, o);
    auto sb = *SlowMo::Create(b.p16, {}, comm, 0, o);
    for (int64_t n = 0; n < 9; ++n) {
      const std::vector<torch::Tensor> g = Grads16(rank, n);
      StepWith(a, g);
      {
        torch::NoGradGuard no_grad;
        flat32.mutable_grad() = Cat(g).to(torch::kFloat);
        b.opt->step();
        b.p16[0].copy_(flat32.narrow(0, 0, kSizes[0]));
        b.p16[1].copy_(flat32.narrow(0, kSizes[0], kSizes[1]));
      }
      ASSERT_TRUE(sa->PerformSlowMo(*a.opt, a.p32).ok());
      ASSERT_TRUE(sb->PerformSlowMo(*b.opt, {flat32}).ok());
      const std::string at = " after update " + std::to_string(n);
      EXPECT_TRUE(torch::equal(Cat(a.p16), Cat(b.p16))) << "p16" << at;
      EXPECT_TRUE(torch::equal(Cat(a.p32), flat32.detach())) << "p32" << at;
      EXPECT_TRUE(torch::equal(sa->momentum_buffer(), sb->momentum_buffer()))
          << "u" << at;
      EXPECT_TRUE(torch::equal(sa->old_params(), sb->old_params()))
          << "x_old" << at;
    }
    // The masters moved away from their start (the test can fail).
    EXPECT_FALSE(torch::equal(flat32.detach(), Cat(MakeFp16(rank).p32)));
  });
}

// Masters that do not match the parameters, or that the optimizer does not
// step: INVALID_ARGUMENT with a one-line message, nothing changed.
TEST(SlowMoFp16Test, MismatchedFp32ParamsChangeNothing) {
  SlowMoOptions o = LocalSgd(1);
  o.slowmo_momentum(0.5);
  o.slowmo_frequency(1);
  RunRanks(1, [&](int, std::shared_ptr<comm::Communicator> comm) {
    Fp16Model m = MakeFp16(0);
    auto s = *SlowMo::Create(m.p16, {}, comm, 0, o);
    Fp16Step(m, 0, 0);
    const torch::Tensor p16 = Cat(m.p16).clone(), p32 = Cat(m.p32).clone();
    std::vector<std::vector<torch::Tensor>> bad = {
        {m.p32[0]},                              // too few
        {m.p32[0], m.p32[0]},                    // 5 elements where 7 are
        {m.p32[0], m.p32[1], m.p32[1]},          // too many
        {torch::zeros({13})},                    // flat, wrong length
        {m.p16[0].detach(), m.p16[1].detach()},  // not float32
        {m.p32[0].detach().clone(), m.p32[1].detach().clone()},  // not the
                                                                 // optimizer's
    };
    for (size_t c = 0; c < bad.size(); ++c) {
      absl::Status st = s->PerformSlowMo(*m.opt, bad[c]);
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument)
          << "case " << c << ": " << st;
      EXPECT_EQ(std::string(st.message()).find('\n'), std::string::npos);
      EXPECT_TRUE(torch::equal(Cat(m.p16), p16)) << "case " << c;
      EXPECT_TRUE(torch::equal(Cat(m.p32), p32)) << "case " << c;
      EXPECT_TRUE(s->fp32_params().empty()) << "case " << c;
      EXPECT_EQ(s->num_updates(), 0);
      EXPECT_FALSE(s->initialized());
    }
    EXPECT_EQ(s->SetFp32Params({torch::zeros({12}, torch::kFloat)}).code(),
              absl::StatusCode::kOk);  // one flat tensor is accepted
    ASSERT_TRUE(s->PerformSlowMo(*m.opt, m.p32).ok());
    EXPECT_EQ(s->num_updates(), 1);
    EXPECT_TRUE(s->initialized());
  });
}

// The masters are the user's optimizer state outside the model: SyncState
// gives every rank the authoritative rank's.
TEST(SlowMoFp16Test, SyncStateTakesTheAuthoritativeMasters) {
  SlowMoOptions o = LocalSgd(2);
  std::mutex mu;
  torch::Tensor root_masters;
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) {
    Fp16Model m = MakeFp16(rank);
    auto s = *SlowMo::Create(m.p16, {}, comm, 0, o);
    for (int64_t n = 0; n < 3; ++n) {
      Fp16Step(m, rank, n);
      ASSERT_TRUE(s->PerformSlowMo(*m.opt, m.p32).ok());
    }
    {
      torch::NoGradGuard no_grad;
      if (rank == 1) {
        for (auto& p : m.p32) p.add_(1.0);
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      if (rank == 0) root_masters = Cat(m.p32).clone();
    }
    ASSERT_TRUE(s->SyncState(comm, 0, /*step=*/3, *m.opt).ok());
    {
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_TRUE(torch::equal(Cat(m.p32), root_masters)) << "rank " << rank;
    }

    // A rank without masters: every rank fails, with one line.
    Fp16Model fresh = MakeFp16(rank);
    auto t = *SlowMo::Create(fresh.p16, {}, comm, 0, o);
    if (rank == 0) {
      ASSERT_TRUE(t->SetFp32Params(fresh.p32).ok());
    }
    const torch::Tensor before = Cat(fresh.p32).clone();
    absl::Status st = t->SyncState(comm, 0, /*step=*/0, *fresh.opt);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("SetFp32Params"), absl::string_view::npos);
    EXPECT_EQ(std::string(st.message()).find('\n'), std::string::npos);
    EXPECT_TRUE(torch::equal(Cat(fresh.p32), before));
  });
}

}  // namespace
}  // namespace concord::slowmo

// The worker's kernel calls (worker/tensor_ops.h, see Note [Kernels in the
// worker]) against the LibTorch ops they replace, on this machine's tensors
// (CPU: the kernels' CPU twins; built with CUDA and given CUDA tensors, the
// same calls run the CUDA kernels).
//
//   build/bin/concord-bench-tensor-ops [--benchmark_filter=Flatten]
//
// Each pair of rows is one comparison from one run: `…/libtorch` is what the
// worker did before (at::cat of reshaped tensors, copy_ per tensor, Tensor::to,
// mul_), `…/concord` the kernel call. Gradients: a ResNet-50-like list
// (161 tensors, 25.6 M floats) and 2,000 small tensors of 1,000 floats (one
// DDP bucket's worth of a model made of small layers). bytes_per_second
// counts the bytes read and written.
//
// Adam's step over the same two lists of parameters and over three large
// matrices (2): `BM_AdamStepLibTorch` is torch::optim::Adam::step (what an
// unsharded job's optimizer does), `BM_AdamStepKeepingStart` the step a
// sharded optimizer under run_elastic takes over its shard
// (OptimizerSnapshot::TakeParams + StepTaking: the same bits, the state
// from before kept, see Note [Steps that keep their start]) and
// `BM_AdamStepMirror` a mirror's (TakeParams + StepStateTaking: the moments
// alone). items_per_second counts parameters.

#include "worker/tensor_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <vector>

#include "bench/model_sizes.h"
#include "worker/checkpoint/optimizer_snapshot.h"

namespace {

std::vector<at::Tensor> Tensors(int64_t which) {
  std::vector<int64_t> sizes =
      which == 0   ? concord::bench::ResNet50Like()
      : which == 1 ? std::vector<int64_t>(2000, 1000)
                   // bench/zero_vs_ddp.py's mlp-large's weight matrices
                   : std::vector<int64_t>{1048576, 1048576, 524288};
  std::vector<at::Tensor> out;
  for (int64_t n : sizes) out.push_back(at::randn({n}));
  return out;
}

int64_t Bytes(const std::vector<at::Tensor>& ts) {
  int64_t b = 0;
  for (const auto& t : ts) b += t.nbytes();
  return b;
}

void Label(benchmark::State& state, int64_t which, int64_t bytes_moved) {
  state.SetLabel(which == 0 ? "resnet50-like" : "2000x1000");
  state.SetBytesProcessed(state.iterations() * bytes_moved);
}

void BM_FlattenLibTorch(benchmark::State& state) {
  const auto ts = Tensors(state.range(0));
  for (auto _ : state) {
    std::vector<at::Tensor> pieces;
    pieces.reserve(ts.size());
    for (const auto& t : ts) pieces.push_back(t.reshape({-1}));
    benchmark::DoNotOptimize(at::cat(pieces));
  }
  Label(state, state.range(0), 2 * Bytes(ts));
}

void BM_FlattenConcord(benchmark::State& state) {
  const auto ts = Tensors(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(concord::FlattenTensors(ts));
  Label(state, state.range(0), 2 * Bytes(ts));
}

void BM_UnflattenLibTorch(benchmark::State& state) {
  auto ts = Tensors(state.range(0));
  const at::Tensor flat = concord::FlattenTensors(ts);
  for (auto _ : state) {
    int64_t offset = 0;
    for (auto& t : ts) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
  Label(state, state.range(0), 2 * Bytes(ts));
}

void BM_UnflattenConcord(benchmark::State& state) {
  auto ts = Tensors(state.range(0));
  const at::Tensor flat = concord::FlattenTensors(ts);
  for (auto _ : state) concord::UnflattenInto(flat, ts);
  Label(state, state.range(0), 2 * Bytes(ts));
}

// A 25 MB bucket: the fp16 hook's cast out and back.
constexpr int64_t kBucket = 25 * 1024 * 1024 / 4;

void BM_CastToHalfLibTorch(benchmark::State& state) {
  const at::Tensor x = at::randn({kBucket});
  for (auto _ : state) benchmark::DoNotOptimize(x.to(at::kHalf));
  state.SetBytesProcessed(state.iterations() * kBucket * 6);
}

void BM_CastToHalfConcord(benchmark::State& state) {
  const at::Tensor x = at::randn({kBucket});
  for (auto _ : state) {
    benchmark::DoNotOptimize(concord::CastTo(x, at::kHalf));
  }
  state.SetBytesProcessed(state.iterations() * kBucket * 6);
}

void BM_CastFromHalfLibTorch(benchmark::State& state) {
  const at::Tensor h = at::randn({kBucket}).to(at::kHalf);
  at::Tensor out = at::empty({kBucket});
  for (auto _ : state) out.copy_(h);
  state.SetBytesProcessed(state.iterations() * kBucket * 6);
}

void BM_CastFromHalfConcord(benchmark::State& state) {
  const at::Tensor h = at::randn({kBucket}).to(at::kHalf);
  at::Tensor out = at::empty({kBucket});
  for (auto _ : state) concord::CastInto(h, out);
  state.SetBytesProcessed(state.iterations() * kBucket * 6);
}

// Scaling alternates 1/3 and 3 (the values stay normal numbers: repeated
// division would reach subnormals, whose arithmetic is slow).
void BM_ScaleLibTorch(benchmark::State& state) {
  at::Tensor x = at::randn({kBucket});
  bool down = true;
  for (auto _ : state) {
    x.mul_(down ? 1.0 / 3 : 3.0);
    down = !down;
  }
  state.SetBytesProcessed(state.iterations() * kBucket * 8);
}

void BM_ScaleConcord(benchmark::State& state) {
  at::Tensor x = at::randn({kBucket});
  bool down = true;
  for (auto _ : state) {
    concord::Scale(x, down ? 1.0 / 3 : 3.0);
    down = !down;
  }
  state.SetBytesProcessed(state.iterations() * kBucket * 8);
}

// Adam over the list of parameters state.range(0), its state made by a
// first step; `how` steps it once (once before the timing).
template <typename F>
void AdamStep(benchmark::State& state, F&& how) {
  std::vector<at::Tensor> params = Tensors(state.range(0));
  int64_t count = 0;
  for (auto& p : params) {
    p.mutable_grad() = at::randn_like(p);
    count += p.numel();
  }
  torch::optim::Adam adam(params, torch::optim::AdamOptions(1e-3));
  adam.step();
  concord::checkpoint::OptimizerSnapshot snapshot;
  // The steady state: a folded step's second buffers exist from its first.
  how(adam, snapshot);
  for (auto _ : state) how(adam, snapshot);
  state.SetItemsProcessed(state.iterations() * count);
}

void BM_AdamStepLibTorch(benchmark::State& state) {
  AdamStep(state, [](torch::optim::Adam& adam,
                     concord::checkpoint::OptimizerSnapshot&) { adam.step(); });
}

void BM_AdamStepKeepingStart(benchmark::State& state) {
  AdamStep(state, [](torch::optim::Adam& adam,
                     concord::checkpoint::OptimizerSnapshot& snapshot) {
    snapshot.TakeParams(adam);
    snapshot.StepTaking(adam);
  });
}

void BM_AdamStepMirror(benchmark::State& state) {
  AdamStep(state, [](torch::optim::Adam& adam,
                     concord::checkpoint::OptimizerSnapshot& snapshot) {
    snapshot.TakeParams(adam);
    snapshot.StepStateTaking(adam);
  });
}

BENCHMARK(BM_FlattenLibTorch)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlattenConcord)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_UnflattenLibTorch)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_UnflattenConcord)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CastToHalfLibTorch)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CastToHalfConcord)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CastFromHalfLibTorch)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CastFromHalfConcord)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ScaleLibTorch)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ScaleConcord)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamStepLibTorch)
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamStepKeepingStart)
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamStepMirror)
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  // One thread: the worker's training thread shares the cores with Gloo's.
  at::set_num_threads(1);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

// concord-bench-kernels-gpu: each CUDA kernel of Concord's (kernels/) timed
// on the device, its achieved bandwidth (bytes it must read and write per
// call, over the time of a call) and that bandwidth as a fraction of a
// device-to-device copy (cudaMemcpyAsync) of the largest buffer, measured in
// the same run on the same device. A memory-bound kernel near 1.0 moves its
// bytes as fast as the copy engine's path through memory allows.
//
//   concord-bench-kernels-gpu [--device N] [--batch 32 --channels 256
//       --spatial 3136] [--iters 50] [--json]
//
// Built where CUDA is (CONCORD_HAVE_CUDA); needs a GPU to run: without one
// it says so on one line and exits 2. Not a test.

#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "kernels/bucket.h"
#include "kernels/scale.h"
#include "kernels/syncbn.h"

namespace {

using concord::kernels::ActivationShape;
using concord::kernels::BucketSlice;
using concord::kernels::DType;

struct Failure {
  std::string what;
};

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw Failure{std::string(what) + ": " + cudaGetErrorString(e)};
  }
}

// Device memory freed on scope exit.
class Buffer {
 public:
  explicit Buffer(size_t bytes) {
    Check(cudaMalloc(&ptr_, bytes), "cudaMalloc");
    Check(cudaMemset(ptr_, 0, bytes), "cudaMemset");
  }
  ~Buffer() { cudaFree(ptr_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

// Seconds per call of `launch` on `stream`: a few warm-up calls, then
// `iters` calls between two events.
double TimePerCall(const std::function<cudaError_t()>& launch, int iters,
                   cudaStream_t stream) {
  for (int i = 0; i < 3; ++i) Check(launch(), "warm-up launch");
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");
  Check(cudaEventRecord(start, stream), "cudaEventRecord");
  for (int i = 0; i < iters; ++i) Check(launch(), "launch");
  Check(cudaEventRecord(stop, stream), "cudaEventRecord");
  Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  Check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / 1e3 / iters;
}

struct Row {
  std::string kernel;
  std::string shape;
  double bytes = 0;  // read + written per call
  double seconds = 0;
};

int Run(int device, int64_t batch, int64_t channels, int64_t spatial, int iters,
        bool json) {
  Check(cudaSetDevice(device), "cudaSetDevice");
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
        "cudaStreamCreate");

  const int64_t n = batch * channels * spatial;
  const double f32 = 4.0, half = 2.0;
  Buffer x(n * 4), y(n * 4), dy(n * 4), bucket(n * 4);
  Buffer low(n * 2), low_dy(n * 2), low_out(n * 2);
  Buffer stats(concord::kernels::StatsRowSize(channels) * 4);
  Buffer mean(channels * 4), invstd(channels * 4), var(channels * 4);
  Buffer weight(channels * 4), bias(channels * 4), reduced(2 * channels * 4);
  Buffer total(4);
  const float count = 1024.0f;
  Check(cudaMemcpy(total.get(), &count, 4, cudaMemcpyHostToDevice),
        "cudaMemcpy count");

  std::vector<Row> rows;
  auto add = [&](std::string kernel, std::string shape, double bytes,
                 const std::function<cudaError_t()>& launch) {
    rows.push_back({std::move(kernel), std::move(shape), bytes,
                    TimePerCall(launch, iters, stream)});
  };

  // The reference: a device-to-device copy of the largest buffer.
  add("cudaMemcpyAsync D2D", std::to_string(n) + " fp32", 2 * f32 * n, [&] {
    return cudaMemcpyAsync(y.get(), x.get(), n * 4, cudaMemcpyDeviceToDevice,
                           stream);
  });
  add("ScaleCuda", std::to_string(n) + " fp32", 2 * f32 * n, [&] {
    return concord::kernels::ScaleCuda(x.get<float>(), n, 0.5f, stream);
  });
  add("CastCuda fp32->bf16", std::to_string(n), (f32 + half) * n, [&] {
    return concord::kernels::CastCuda(x.get(), DType::kFloat32, low.get(),
                                      DType::kBFloat16, n, stream);
  });
  add("CastCuda fp16->fp32", std::to_string(n), (f32 + half) * n, [&] {
    return concord::kernels::CastCuda(low.get(), DType::kFloat16, y.get(),
                                      DType::kFloat32, n, stream);
  });

  // Flatten/unflatten: a bucket of 160 gradients of a ResNet-like spread of
  // sizes (every 16th ten times larger).
  std::vector<BucketSlice> slices;
  {
    const int count = 160;
    int64_t units = 0;
    for (int i = 0; i < count; ++i) units += i % 16 == 0 ? 10 : 1;
    const int64_t unit = n / units;
    int64_t offset = 0;
    for (int i = 0; i < count; ++i) {
      const int64_t numel = unit * (i % 16 == 0 ? 10 : 1);
      slices.push_back({y.get<float>() + offset, offset, numel});
      offset += numel;
    }
  }
  int64_t bucketed = 0, max_numel = 0;
  for (const auto& s : slices) {
    bucketed += s.numel;
    max_numel = std::max(max_numel, s.numel);
  }
  Buffer device_slices(slices.size() * sizeof(BucketSlice));
  Check(cudaMemcpy(device_slices.get(), slices.data(),
                   slices.size() * sizeof(BucketSlice), cudaMemcpyHostToDevice),
        "cudaMemcpy slices");
  const std::string bucket_shape =
      std::to_string(slices.size()) + " tensors, " + std::to_string(bucketed);
  add("FlattenCuda", bucket_shape, 2 * f32 * bucketed, [&] {
    return concord::kernels::FlattenCuda(device_slices.get<BucketSlice>(),
                                         static_cast<int64_t>(slices.size()),
                                         max_numel, 4, bucket.get(), stream);
  });
  add("UnflattenCuda", bucket_shape, 2 * f32 * bucketed, [&] {
    return concord::kernels::UnflattenCuda(device_slices.get<BucketSlice>(),
                                           static_cast<int64_t>(slices.size()),
                                           max_numel, 4, bucket.get(), stream);
  });

  // SyncBatchNorm's passes, NCHW and channels-last, fp32 and bf16.
  struct Layout {
    const char* name;
    ActivationShape shape;
  };
  const Layout layouts[] = {
      {"NCHW", {batch, channels, spatial}},
      {"NHWC", {batch * spatial, channels, 1}},
  };
  for (const Layout& layout : layouts) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      const double e = dtype == DType::kFloat32 ? f32 : half;
      const bool wide = dtype == DType::kFloat32;
      const void* in = wide ? x.get() : low.get();
      const void* grad = wide ? dy.get() : low_dy.get();
      void* out = wide ? y.get() : low_out.get();
      const std::string shape =
          std::string(layout.name) + " " + (wide ? "fp32 " : "bf16 ") +
          std::to_string(batch) + "x" + std::to_string(channels) + "x" +
          std::to_string(spatial);
      const ActivationShape& s = layout.shape;
      // The reductions' scratch (see Note [Split reductions]), allocated once,
      // outside the timed calls, as the caching allocator would hand it out.
      Buffer scratch(
          static_cast<size_t>(concord::kernels::SyncBnScratchFloats(s)) * 4);
      add("WelfordStatsCuda", shape, e * n, [&] {
        return concord::kernels::WelfordStatsCuda(
            in, dtype, s, stats.get<float>(), scratch.get<float>(), stream);
      });
      add("BatchNormForwardCuda", shape, 2 * e * n, [&] {
        return concord::kernels::BatchNormForwardCuda(
            in, dtype, s, mean.get<float>(), invstd.get<float>(),
            weight.get<float>(), bias.get<float>(), out, stream);
      });
      add("BackwardReduceCuda", shape, 2 * e * n, [&] {
        return concord::kernels::BackwardReduceCuda(
            grad, in, dtype, s, mean.get<float>(), reduced.get<float>(),
            scratch.get<float>(), stream);
      });
      add("BackwardElementwiseCuda", shape, 3 * e * n, [&] {
        return concord::kernels::BackwardElementwiseCuda(
            grad, in, dtype, s, mean.get<float>(), invstd.get<float>(),
            weight.get<float>(), reduced.get<float>(), total.get<float>(), out,
            stream);
      });
    }
  }
  Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  cudaStreamDestroy(stream);

  const double copy_bw = rows.front().bytes / rows.front().seconds;
  if (!json) {
    std::printf(
        "device %d: %s; %d calls each; bandwidth = bytes read and "
        "written per call / time per call\n",
        device, prop.name, iters);
    std::printf("%-26s %-28s %12s %10s %12s\n", "kernel", "shape", "MB/call",
                "us/call", "GB/s (x copy)");
  }
  for (const Row& r : rows) {
    const double bw = r.bytes / r.seconds;
    if (json) {
      std::printf(
          "{\"kernel\": \"%s\", \"shape\": \"%s\", \"bytes\": %.0f, "
          "\"us_per_call\": %.3f, \"gb_per_s\": %.2f, \"of_copy\": %.3f, "
          "\"device\": \"%s\"}\n",
          r.kernel.c_str(), r.shape.c_str(), r.bytes, r.seconds * 1e6, bw / 1e9,
          bw / copy_bw, prop.name);
    } else {
      std::printf("%-26s %-28s %12.1f %10.1f %7.0f (%.2f)\n", r.kernel.c_str(),
                  r.shape.c_str(), r.bytes / 1e6, r.seconds * 1e6, bw / 1e9,
                  bw / copy_bw);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Concord's CUDA kernels: bandwidth vs a device-to-device copy"};
  int device = 0, iters = 50;
  int64_t batch = 32, channels = 256, spatial = 56 * 56;
  bool json = false;
  app.add_option("--device", device, "CUDA device index")
      ->capture_default_str();
  app.add_option("--batch", batch, "activation batch (N)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--channels", channels, "activation channels (C)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--spatial", spatial, "activation H*W")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--iters", iters, "timed calls per kernel")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--json", json, "one JSON object per kernel");
  CLI11_PARSE(app, argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr,
                 "concord-bench-kernels-gpu: no CUDA device is visible\n");
    return 2;
  }
  if (device < 0 || device >= devices) {
    std::fprintf(stderr,
                 "concord-bench-kernels-gpu: --device %d: %d device(s) "
                 "visible\n",
                 device, devices);
    return 2;
  }
  try {
    return Run(device, batch, channels, spatial, iters, json);
  } catch (const Failure& f) {
    std::fprintf(stderr, "concord-bench-kernels-gpu: %s\n", f.what.c_str());
    return 1;
  }
}

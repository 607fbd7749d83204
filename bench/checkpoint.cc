// concord-bench-checkpoint: the Concord half of
// bench/checkpoint_vs_pytorch.py. For an MLP of about --params-m million
// parameters with SGD and momentum stepped once, times what a checkpoint
// costs (see Note [Checkpoints] in worker/checkpoint/checkpointer.h):
//
//   concord-bench-checkpoint --params-m 21 --dir /var/tmp/ck [--repeat 5]
//       [--keep-files]
//
//  memcpy     one std::memcpy of every tensor of the checkpoint into a
//             preallocated, pre-faulted buffer (the physical limit of a
//             memory tier); memcpy_threads_s: the same split over
//             LibTorch's intra-op threads;
//  snapshot   WriteSnapshot into an anonymous Region reused across repeats
//             (the training step's stall); the first write, which grows
//             and faults the region in, apart as snapshot_first_s;
//             capture_s: building the Content (as State::Capture does);
//  write      WriteCheckpoint of the region's snapshot to --dir (keep 2):
//             what the persister thread does (files, fsync, manifest,
//             rename); write_mb_s is its bytes over its seconds,
//             write_cpu_s the process's CPU time over it, write_queue_mb
//             the deepest its queue of blocks grew (see Note [Write queue]
//             in worker/checkpoint/file_writer.h); write_two_blocks_*: the
//             same write with a queue of two blocks (as before the queue),
//             alternating with it;
//  archive_s  the same archives serialized into a sink that drops them
//             (Concord's archive writer without the disk: the pickle and
//             the records' CRC-32), archive_libtorch_s the same with
//             LibTorch's PyTorchStreamWriter (miniz's CRC-32), which it
//             replaced; crc32_s the CRC-32 over the tensors' bytes with
//             ISA-L (worker/crc32.h), crc32_zlib_s with zlib's table code:
//             where the write's time goes besides the disk.
// The model is 1024 -> W x 6 -> 1024 (Linear + ReLU, 5 hidden W x W
// layers, bench/gpu_models.py's mlp-350m shape) with W the multiple of 64
// that comes nearest to --params-m (21: W = 1856, 21.0 M; 350: W = 8192,
// 352 M). Prints one JSON line: the widths, parameter count, bytes and
// every figure (medians of --repeat; seconds, MB = 10^6 bytes). Not a test.

#include <ATen/Parallel.h>
#include <caffe2/serialize/inline_container.h>
#include <sys/resource.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/torch.h>
#include <unistd.h>
#include <zlib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "worker/checkpoint/content.h"
#include "worker/checkpoint/disk.h"
#include "worker/checkpoint/memory.h"
#include "worker/checkpoint/region.h"
#include "worker/crc32.h"
#include "worker/state_dict_file.h"

namespace {

namespace ck = concord::checkpoint;
using Clock = std::chrono::steady_clock;

constexpr int64_t kIn = 1024, kOut = 1024, kHidden = 5;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// User and system CPU seconds of this process so far.
double CpuSeconds() {
  struct rusage u {};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

template <typename F>
double Seconds(F&& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "concord-bench-checkpoint: %s\n", what.c_str());
  std::exit(1);
}

int64_t Params(int64_t w) {
  return kIn * w + w + kHidden * (w * w + w) + w * kOut + kOut;
}

// The multiple of 64 whose MLP comes nearest to `millions` parameters.
int64_t WidthFor(double millions) {
  const double target = millions * 1e6;
  int64_t best = 64;
  for (int64_t w = 64; Params(w) < 4 * target + Params(64); w += 64) {
    if (std::abs(Params(w) - target) < std::abs(Params(best) - target)) {
      best = w;
    }
  }
  return best;
}

torch::nn::Sequential Mlp(int64_t w) {
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Linear(kIn, w));
  seq->push_back(torch::nn::ReLU());
  for (int64_t i = 0; i < kHidden; ++i) {
    seq->push_back(torch::nn::Linear(w, w));
    seq->push_back(torch::nn::ReLU());
  }
  seq->push_back(torch::nn::Linear(w, kOut));
  return seq;
}

// As State::Capture: the module's parameters and buffers by name, the
// optimizer as PyTorch's state_dict has it, the CPU generator's state.
ck::Content Capture(const torch::nn::Module& model,
                    const torch::optim::Optimizer& optimizer, int64_t step) {
  ck::Content c;
  c.counters.step = step;
  c.counters.world_size = 1;
  c.counters.generation = 1;
  concord::NamedTensors state;
  for (const auto& p : model.named_parameters()) {
    state.emplace_back(p.key(), p.value());
  }
  for (const auto& b : model.named_buffers()) {
    state.emplace_back(b.key(), b.value());
  }
  c.modules.emplace_back("model", std::move(state));
  c.optimizers.push_back(ck::CaptureOptimizer("optimizer", optimizer));
  c.extra.emplace_back("rng/cpu", ck::CpuRngState());
  return c;
}

// `value`'s archive by LibTorch's writer (PyTorchStreamWriter, miniz) into
// a sink that drops it: what Concord's writer replaced.
void LibTorchArchive(const c10::IValue& value) {
  absl::StatusOr<concord::Pickled> p = concord::Pickle(value);
  if (!p.ok()) Fail(std::string(p.status().message()));
  caffe2::serialize::PyTorchStreamWriter writer(
      [](const void*, size_t n) { return n; });
  for (size_t i = 0; i < p->storages.size(); ++i) {
    const torch::jit::WriteableTensorData data =
        torch::jit::getWriteableTensorData(p->storages[i]);
    writer.writeRecord("data/" + std::to_string(i), data.data(),
                       data.sizeInBytes());
  }
  writer.writeRecord("data.pkl", p->pickle.data(), p->pickle.size());
  writer.writeEndOfFile();
}

c10::IValue TensorDict(const concord::NamedTensors& tensors) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [k, t] : tensors) d.insert(k, t);
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  double params_m = 21;
  int repeat = 5;
  std::string dir;
  bool keep_files = false;
  CLI::App app{
      "Times a checkpoint's memory snapshot and disk write against memcpy "
      "(the Concord half of bench/checkpoint_vs_pytorch.py)"};
  app.add_option("--params-m", params_m, "parameters of the MLP, in millions")
      ->check(CLI::PositiveNumber);
  app.add_option("--repeat", repeat, "repeats of each measurement (median)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--dir", dir, "where the checkpoints are written")->required();
  app.add_flag("--keep-files", keep_files,
               "leave the checkpoints in DIR (default: removed at the end)");
  CLI11_PARSE(app, argc, argv);

  torch::manual_seed(0);
  const int64_t width = WidthFor(params_m);
  torch::nn::Sequential model = Mlp(width);
  torch::optim::SGD sgd(model->parameters(),
                        torch::optim::SGDOptions(0.01).momentum(0.9));
  {
    // One step, so that the momentum buffers exist; the gradients are
    // dropped after it (they are not part of a checkpoint).
    torch::Tensor x = torch::randn({4, kIn});
    torch::nn::functional::mse_loss(model->forward(x), torch::zeros({4, kOut}))
        .backward();
    sgd.step();
    for (torch::Tensor& p : model->parameters()) p.mutable_grad().reset();
  }
  int64_t params = 0;
  for (const torch::Tensor& p : model->parameters()) params += p.numel();

  std::vector<double> capture;
  ck::Content content;
  for (int i = 0; i < repeat; ++i) {
    capture.push_back(Seconds([&] { content = Capture(*model, sgd, 1); }));
  }
  const std::vector<at::Tensor> tensors = ck::Flatten(content).tensors;
  size_t bytes = 0;
  for (const at::Tensor& t : tensors) bytes += t.nbytes();

  // (a) memcpy into a pre-faulted buffer, tensor by tensor.
  std::vector<double> memcpy_s, memcpy_threads_s;
  {
    std::unique_ptr<char[]> buffer(new char[bytes]);
    std::memset(buffer.get(), 1, bytes);
    for (int i = 0; i < repeat; ++i) {
      memcpy_s.push_back(Seconds([&] {
        char* out = buffer.get();
        for (const at::Tensor& t : tensors) {
          std::memcpy(out, t.data_ptr(), t.nbytes());
          out += t.nbytes();
        }
      }));
    }
    for (int i = 0; i < repeat; ++i) {
      memcpy_threads_s.push_back(Seconds([&] {
        char* out = buffer.get();
        for (const at::Tensor& t : tensors) {
          const char* in = static_cast<const char*>(t.data_ptr());
          const int64_t n = static_cast<int64_t>(t.nbytes());
          at::parallel_for(0, n, 1 << 20, [&](int64_t begin, int64_t end) {
            std::memcpy(out + begin, in + begin, end - begin);
          });
          out += n;
        }
      }));
    }
  }

  // (b) the snapshot: the first write grows and faults the region in.
  auto region = ck::Region::Open("");
  if (!region.ok()) Fail(std::string(region.status().message()));
  auto snapshot = [&] {
    absl::StatusOr<ck::WriteResult> r =
        ck::WriteSnapshot(**region, content, "bench", /*persist=*/true);
    if (!r.ok()) Fail(std::string(r.status().message()));
    if (*r != ck::WriteResult::kWritten) Fail("the snapshot was skipped");
  };
  const double snapshot_first_s = Seconds(snapshot);
  std::vector<double> snapshot_s;
  for (int i = 0; i < repeat; ++i) snapshot_s.push_back(Seconds(snapshot));

  // (c) the disk tier, from the region as the persister writes it.
  absl::StatusOr<ck::Content> saved = ck::ReadSnapshot(**region);
  if (!saved.ok()) Fail(std::string(saved.status().message()));
  const std::string job = "bench-" + std::to_string(::getpid());
  std::vector<double> write_s, write_cpu_s, write_two_blocks_s;
  uint64_t file_bytes = 0;
  // As the persister: one pool kept across writes (see Note [Write queue]).
  // Each repeat also writes with two blocks (the queue before it) for the
  // comparison, the two alternating.
  auto pool = std::make_shared<ck::WriteBuffers>();
  auto two_blocks = std::make_shared<ck::WriteBuffers>(
      ck::WriteBuffers::kDefaultBlock, 2 * ck::WriteBuffers::kDefaultBlock);
  int64_t step = 0;
  auto write = [&](std::shared_ptr<ck::WriteBuffers> buffers) {
    saved->counters.step = ++step;
    ck::WriteOptions options;
    options.keep = 2;
    options.buffers = std::move(buffers);
    absl::StatusOr<ck::WriteStats> w =
        ck::WriteCheckpoint(*saved, dir, job, options);
    if (!w.ok()) Fail(std::string(w.status().message()));
    file_bytes = w->bytes;
    return w->seconds;
  };
  for (int i = 0; i < repeat; ++i) {
    // The process's CPU time over the write (its own thread and the file
    // writer's): what a write takes from training on a busy node.
    const double cpu_before = CpuSeconds();
    write_s.push_back(write(pool));
    write_cpu_s.push_back(CpuSeconds() - cpu_before);
    write_two_blocks_s.push_back(write(two_blocks));
  }
  if (!keep_files) {
    std::error_code ec;
    std::filesystem::remove_all(std::filesystem::path(dir) / job, ec);
  }

  // Where the write's time goes besides the disk: the archives into a sink
  // that drops them, with Concord's archive writer and with LibTorch's (the
  // one before it), and the CRC-32 over the bytes, ISA-L's and zlib's.
  std::vector<c10::IValue> archives;
  for (const auto& [name, t] : saved->modules)
    archives.push_back(TensorDict(t));
  for (const ck::OptimizerContent& o : saved->optimizers) {
    archives.push_back(ck::OptimizerToIValue(o));
  }
  archives.push_back(TensorDict(saved->extra));
  const double archive_s = Seconds([&] {
    auto drop = [](const void*, size_t, bool) { return true; };
    for (const c10::IValue& v : archives) {
      const absl::Status s = concord::WriteArchive(v, drop);
      if (!s.ok()) Fail(std::string(s.message()));
    }
  });
  const double archive_libtorch_s = Seconds([&] {
    for (const c10::IValue& v : archives) LibTorchArchive(v);
  });
  uint32_t crc = 0;
  const double crc32_s = Seconds([&] {
    for (const at::Tensor& t : tensors) {
      crc = concord::Crc32(crc, t.data_ptr(), t.nbytes());
    }
  });
  uint32_t crc_zlib = 0;
  const double crc32_zlib_s = Seconds([&] {
    for (const at::Tensor& t : tensors) {
      crc_zlib = static_cast<uint32_t>(crc32_z(
          crc_zlib, static_cast<const Bytef*>(t.data_ptr()), t.nbytes()));
    }
  });
  if (crc != crc_zlib) Fail("ISA-L's and zlib's CRC-32 differ");

  std::vector<int64_t> widths = {kIn};
  for (int64_t i = 0; i <= kHidden; ++i) widths.push_back(width);
  widths.push_back(kOut);
  const double write_median = Median(write_s);
  nlohmann::json out = {
      {"params_m", params_m},
      {"params", params},
      {"widths", widths},
      {"tensors", tensors.size()},
      {"bytes", bytes},
      {"file_bytes", file_bytes},
      {"repeat", repeat},
      {"threads", at::get_num_threads()},
      {"capture_s", Median(capture)},
      {"memcpy_s", Median(memcpy_s)},
      {"memcpy_threads_s", Median(memcpy_threads_s)},
      {"snapshot_s", Median(snapshot_s)},
      {"snapshot_first_s", snapshot_first_s},
      {"snapshot_all_s", snapshot_s},
      {"write_s", write_median},
      {"write_all_s", write_s},
      {"write_cpu_s", Median(write_cpu_s)},
      {"write_mb_s", write_median > 0
                         ? static_cast<double>(file_bytes) / write_median / 1e6
                         : 0.0},
      {"write_queue_mb", pool->made() * pool->block() / 1e6},
      {"write_two_blocks_s", Median(write_two_blocks_s)},
      {"write_two_blocks_mb_s",
       static_cast<double>(file_bytes) / Median(write_two_blocks_s) / 1e6},
      {"archive_s", archive_s},
      {"archive_libtorch_s", archive_libtorch_s},
      {"crc32_s", crc32_s},
      {"crc32_zlib_s", crc32_zlib_s},
  };
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

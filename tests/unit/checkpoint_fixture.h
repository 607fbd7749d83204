#pragma once
// What the checkpoint tests share (checkpoint_format_test.cc,
// checkpoint_storage_test.cc): a directory of its own per test, small
// models and optimizers, a sample content.
#include <gmock/gmock.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "worker/checkpoint/content.h"
#include "worker/checkpoint/disk.h"
#include "worker/checkpoint/memory.h"
#include "worker/checkpoint/persister.h"
#include "worker/checkpoint/region.h"
#include "worker/state_dict_file.h"

namespace concord::checkpoint::ckpt_test {

namespace fs = std::filesystem;
namespace optim = torch::optim;
using json = nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using OptimizerPtr = std::unique_ptr<optim::Optimizer>;

inline constexpr char kJob[] = "job-a";

// A fresh directory under the test's temporary directory, removed at the
// end (made writable again first).
class TempDir {
 public:
  TempDir() {
    std::string pattern =
        (fs::path(::testing::TempDir()) / "checkpoint_test.XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp " << pattern << ": " << std::strerror(errno);
    }
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path_, fs::perms::owner_all, fs::perm_options::add, ec);
    for (auto it = fs::recursive_directory_iterator(path_, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      std::error_code ignored;
      if (it->is_directory(ignored)) {
        fs::permissions(it->path(), fs::perms::owner_all, fs::perm_options::add,
                        ignored);
      }
    }
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const {
    return (fs::path(path_) / name).string();
  }

 private:
  std::string path_;
};

inline std::string JobDir(const TempDir& dir) { return dir / kJob; }
inline std::string StepDir(const TempDir& dir, int64_t step) {
  return (fs::path(JobDir(dir)) / ("step-" + std::to_string(step))).string();
}
inline std::string StagingDir(const TempDir& dir, int64_t step) {
  return (fs::path(JobDir(dir)) / (".staging-step-" + std::to_string(step) +
                                   "-" + std::to_string(::getpid())))
      .string();
}

// The names in `path`, sorted.
// A folder's entries but the writer lock (see Note [One writer per folder]
// in worker/checkpoint/writer_lock.h; writer_lock_test.cc checks it).
inline std::vector<std::string> Entries(const std::string& path) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(path, ec)) {
    if (e.path().filename() == ".writer") continue;
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

inline std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

inline torch::nn::Sequential MakeNet(uint64_t seed, int64_t hidden = 6) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(4, hidden),
                               torch::nn::BatchNorm1d(hidden),
                               torch::nn::Tanh(), torch::nn::Linear(hidden, 2));
}

// A module's parameters and buffers by name, as the checkpointer takes them.
inline NamedTensors ModuleTensors(const torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& p : module.named_parameters()) {
    out.emplace_back(p.key(), p.value());
  }
  for (const auto& b : module.named_buffers()) {
    out.emplace_back(b.key(), b.value());
  }
  return out;
}

// `steps` steps on fixed data (a closure: LBFGS needs one).
inline void Train(torch::nn::Sequential& net, optim::Optimizer& optimizer,
                  int steps) {
  const torch::Tensor x =
      torch::sin(torch::arange(32, torch::kFloat).reshape({8, 4}));
  const torch::Tensor y =
      torch::cos(torch::arange(16, torch::kFloat).reshape({8, 2}));
  for (int i = 0; i < steps; ++i) {
    optimizer.step([&] {
      optimizer.zero_grad();
      torch::Tensor loss = torch::mse_loss(net->forward(x), y);
      loss.backward();
      return loss;
    });
  }
}

inline std::vector<double> Lrs(const optim::Optimizer& optimizer) {
  std::vector<double> out;
  for (const auto& g : optimizer.param_groups()) {
    out.push_back(g.options().get_lr());
  }
  return out;
}

inline void ExpectSameTensors(const NamedTensors& actual,
                              const NamedTensors& expected,
                              const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_EQ(actual[i].first, expected[i].first) << what;
    const at::Tensor& a = actual[i].second;
    const at::Tensor& e = expected[i].second;
    EXPECT_EQ(a.scalar_type(), e.scalar_type()) << what << " " << e.toString();
    EXPECT_TRUE(a.scalar_type() == e.scalar_type() && torch::equal(a, e))
        << what << " '" << expected[i].first << "': " << a << " vs " << e;
  }
}

inline void ExpectSameOptimizer(const OptimizerContent& actual,
                                const OptimizerContent& expected) {
  EXPECT_EQ(actual.name, expected.name);
  EXPECT_EQ(actual.type, expected.type);
  EXPECT_EQ(actual.param_groups, expected.param_groups);
  ASSERT_EQ(actual.state.size(), expected.state.size()) << expected.name;
  for (size_t i = 0; i < actual.state.size(); ++i) {
    EXPECT_EQ(actual.state[i].first, expected.state[i].first);
    ExpectSameTensors(
        actual.state[i].second, expected.state[i].second,
        expected.name + " state " + std::to_string(expected.state[i].first));
  }
  ASSERT_EQ(actual.native.defined(), expected.native.defined());
  if (expected.native.defined()) {
    EXPECT_TRUE(torch::equal(actual.native, expected.native));
  }
}

inline void ExpectSameContent(const Content& actual, const Content& expected) {
  EXPECT_EQ(actual.counters.step, expected.counters.step);
  EXPECT_EQ(actual.counters.epoch, expected.counters.epoch);
  EXPECT_EQ(actual.counters.position, expected.counters.position);
  EXPECT_EQ(actual.counters.world_size, expected.counters.world_size);
  EXPECT_EQ(actual.counters.generation, expected.counters.generation);
  EXPECT_EQ(actual.counters.run, expected.counters.run);
  ASSERT_EQ(actual.modules.size(), expected.modules.size());
  for (size_t i = 0; i < actual.modules.size(); ++i) {
    EXPECT_EQ(actual.modules[i].first, expected.modules[i].first);
    ExpectSameTensors(actual.modules[i].second, expected.modules[i].second,
                      expected.modules[i].first);
  }
  ASSERT_EQ(actual.optimizers.size(), expected.optimizers.size());
  for (size_t i = 0; i < actual.optimizers.size(); ++i) {
    ExpectSameOptimizer(actual.optimizers[i], expected.optimizers[i]);
  }
  ExpectSameTensors(actual.extra, expected.extra, "extra");
}

// A copy of `o` that later steps do not change (CaptureOptimizer's tensors
// are the optimizer's own).
inline OptimizerContent Cloned(const OptimizerContent& o) {
  OptimizerContent out = o;
  for (auto& [index, tensors] : out.state) {
    for (auto& [name, t] : tensors) t = t.clone();
  }
  if (out.native.defined()) out.native = out.native.clone();
  return out;
}

inline NamedTensors Cloned(const NamedTensors& tensors) {
  NamedTensors out;
  for (const auto& [name, t] : tensors) out.emplace_back(name, t.clone());
  return out;
}

// A content of every kind of entry: a module with float, half, int64 and
// non-contiguous tensors, a PyTorch optimizer, a native one, the user's
// values and the random generator's state. `n`: the size of the large
// tensors.
inline Content SampleContent(int64_t step, int64_t n = 16) {
  Content c;
  c.counters = Counters{step, 2, 96, 4, 7, /*run=*/17};
  c.modules.emplace_back(
      "model",
      NamedTensors{
          {"w", torch::arange(n, torch::kFloat) * 0.25},
          {"half", torch::linspace(-1, 1, 6).reshape({3, 2}).to(torch::kHalf)},
          {"count", torch::tensor(int64_t{5} + step)},
          {"transposed",
           torch::arange(6, torch::kDouble).reshape({2, 3}).t()}});
  OptimizerContent adam;
  adam.name = "optimizer";
  adam.type = "Adam";
  adam.param_groups = json::array({{{"lr", 0.001},
                                    {"betas", {0.9, 0.999}},
                                    {"eps", 1e-8},
                                    {"weight_decay", 0.0},
                                    {"amsgrad", false},
                                    {"maximize", false},
                                    {"params", {0, 1}}}});
  adam.state.emplace_back(
      0, NamedTensors{{"step", torch::tensor(3.0, torch::kFloat)},
                      {"exp_avg", torch::full({n}, 0.5)},
                      {"exp_avg_sq", torch::full({n}, 0.125)}});
  c.optimizers.push_back(std::move(adam));
  OptimizerContent native;
  native.name = "lbfgs";
  native.native = torch::arange(200, torch::kUInt8);
  c.optimizers.push_back(std::move(native));
  c.extra = {{"values/scale", torch::tensor(1.5 + step, torch::kDouble)},
             {"values/flags", torch::tensor({true, false, true})},
             {"rng/cpu", CpuRngState()}};
  return c;
}

inline absl::StatusOr<WriteStats> Write(const Content& content,
                                        const TempDir& dir,
                                        WriteOptions options = {}) {
  return WriteCheckpoint(content, dir.path(), kJob, options);
}

}  // namespace concord::checkpoint::ckpt_test

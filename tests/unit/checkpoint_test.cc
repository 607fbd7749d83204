// Durable checkpoints (worker/checkpoint/): the optimizers' files, the disk
// tier's writes, crashes and checks, the memory tier's region and the
// persister, on real files in a directory of its own per test.
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

namespace concord::checkpoint {
namespace {

namespace fs = std::filesystem;
namespace optim = torch::optim;
using json = nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using OptimizerPtr = std::unique_ptr<optim::Optimizer>;

constexpr char kJob[] = "job-a";

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

std::string JobDir(const TempDir& dir) { return dir / kJob; }
std::string StepDir(const TempDir& dir, int64_t step) {
  return (fs::path(JobDir(dir)) / ("step-" + std::to_string(step))).string();
}
std::string StagingDir(const TempDir& dir, int64_t step) {
  return (fs::path(JobDir(dir)) / (".staging-step-" + std::to_string(step) +
                                   "-" + std::to_string(::getpid())))
      .string();
}

// The names in `path`, sorted.
std::vector<std::string> Entries(const std::string& path) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(path, ec)) {
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

torch::nn::Sequential MakeNet(uint64_t seed, int64_t hidden = 6) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(4, hidden),
                               torch::nn::BatchNorm1d(hidden),
                               torch::nn::Tanh(), torch::nn::Linear(hidden, 2));
}

// A module's parameters and buffers by name, as the checkpointer takes them.
NamedTensors ModuleTensors(const torch::nn::Module& module) {
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
void Train(torch::nn::Sequential& net, optim::Optimizer& optimizer, int steps) {
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

std::vector<double> Lrs(const optim::Optimizer& optimizer) {
  std::vector<double> out;
  for (const auto& g : optimizer.param_groups()) {
    out.push_back(g.options().get_lr());
  }
  return out;
}

void ExpectSameTensors(const NamedTensors& actual, const NamedTensors& expected,
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

void ExpectSameOptimizer(const OptimizerContent& actual,
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

void ExpectSameContent(const Content& actual, const Content& expected) {
  EXPECT_EQ(actual.counters.step, expected.counters.step);
  EXPECT_EQ(actual.counters.epoch, expected.counters.epoch);
  EXPECT_EQ(actual.counters.position, expected.counters.position);
  EXPECT_EQ(actual.counters.world_size, expected.counters.world_size);
  EXPECT_EQ(actual.counters.generation, expected.counters.generation);
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
OptimizerContent Cloned(const OptimizerContent& o) {
  OptimizerContent out = o;
  for (auto& [index, tensors] : out.state) {
    for (auto& [name, t] : tensors) t = t.clone();
  }
  if (out.native.defined()) out.native = out.native.clone();
  return out;
}

NamedTensors Cloned(const NamedTensors& tensors) {
  NamedTensors out;
  for (const auto& [name, t] : tensors) out.emplace_back(name, t.clone());
  return out;
}

// A content of every kind of entry: a module with float, half, int64 and
// non-contiguous tensors, a PyTorch optimizer, a native one, the user's
// values and the random generator's state. `n`: the size of the large
// tensors.
Content SampleContent(int64_t step, int64_t n = 16) {
  Content c;
  c.counters = Counters{step, 2, 96, 4, 7};
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

absl::StatusOr<WriteStats> Write(const Content& content, const TempDir& dir,
                                 WriteOptions options = {}) {
  return WriteCheckpoint(content, dir.path(), kJob, options);
}

// ---- optimizers through the disk format ----------------------------------

struct OptimizerCase {
  // CaptureOptimizer's type: empty for LibTorch's own archive.
  std::string type;
  std::function<OptimizerPtr(torch::nn::Sequential& net, double lr)> make;
};

// 3 steps, a checkpoint, a fresh model and optimizer (another init, another
// learning rate) restored from it, then 2 more steps on both: the same
// parameters to the bit.
void ExpectOptimizerRoundTrip(const OptimizerCase& c) {
  TempDir dir;
  auto net = MakeNet(1);
  OptimizerPtr optimizer = c.make(net, 0.05);
  Train(net, *optimizer, 3);

  Content content;
  content.counters.step = 3;
  content.modules.emplace_back("model", ModuleTensors(*net));
  content.optimizers.push_back(CaptureOptimizer("optimizer", *optimizer));
  EXPECT_EQ(content.optimizers[0].type, c.type);
  const OptimizerContent captured = Cloned(content.optimizers[0]);
  absl::StatusOr<WriteStats> written = Write(content, dir);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->path, StepDir(dir, 3));
  EXPECT_EQ(fs::exists(fs::path(written->path) / "optimizer.pt"),
            !c.type.empty());

  absl::StatusOr<Content> loaded = LoadCheckpoint(written->path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->modules.size(), 1u);
  ASSERT_EQ(loaded->optimizers.size(), 1u);
  ExpectSameOptimizer(loaded->optimizers[0], captured);

  auto fresh = MakeNet(2);
  OptimizerPtr fresh_optimizer = c.make(fresh, 0.5);
  ASSERT_FALSE(torch::equal(fresh->parameters()[0], net->parameters()[0]));
  ASSERT_NE(Lrs(*fresh_optimizer), Lrs(*optimizer));
  absl::Status s =
      ApplyModule("model", loaded->modules[0].second, ModuleTensors(*fresh));
  ASSERT_TRUE(s.ok()) << s;
  s = ApplyOptimizer(loaded->optimizers[0], *fresh_optimizer);
  ASSERT_TRUE(s.ok()) << s;
  ExpectSameTensors(ModuleTensors(*fresh), ModuleTensors(*net), "restored");
  EXPECT_EQ(Lrs(*fresh_optimizer), Lrs(*optimizer));
  if (!c.type.empty()) {
    ExpectSameOptimizer(CaptureOptimizer("optimizer", *fresh_optimizer),
                        captured);
  }

  Train(net, *optimizer, 2);
  Train(fresh, *fresh_optimizer, 2);
  ExpectSameTensors(ModuleTensors(*fresh), ModuleTensors(*net),
                    "after 2 more steps");
  // The steps moved the parameters: the comparison is not of a no-op.
  EXPECT_FALSE(
      torch::equal(net->parameters()[0], loaded->modules[0].second[0].second));
}

std::vector<torch::Tensor> Slice(const std::vector<torch::Tensor>& v,
                                 size_t from, size_t to) {
  return {v.begin() + static_cast<std::ptrdiff_t>(from),
          v.begin() + static_cast<std::ptrdiff_t>(to)};
}

TEST(CheckpointOptimizerTest, SgdWithMomentumRoundTrips) {
  ExpectOptimizerRoundTrip(
      {"SGD", [](torch::nn::Sequential& net, double lr) {
         return std::make_unique<optim::SGD>(
             net->parameters(),
             optim::SGDOptions(lr).momentum(0.9).weight_decay(1e-3));
       }});
}

TEST(CheckpointOptimizerTest, SgdWithNesterovInTwoGroupsRoundTrips) {
  ExpectOptimizerRoundTrip(
      {"SGD", [](torch::nn::Sequential& net, double lr) {
         const auto params = net->parameters();
         std::vector<optim::OptimizerParamGroup> groups;
         groups.emplace_back(
             Slice(params, 0, 2),
             std::make_unique<optim::SGDOptions>(
                 optim::SGDOptions(lr).momentum(0.9).nesterov(true)));
         groups.emplace_back(Slice(params, 2, params.size()),
                             std::make_unique<optim::SGDOptions>(
                                 optim::SGDOptions(lr * 2).momentum(0.5)));
         return std::make_unique<optim::SGD>(std::move(groups),
                                             optim::SGDOptions(lr));
       }});
}

TEST(CheckpointOptimizerTest, AdamRoundTrips) {
  ExpectOptimizerRoundTrip({"Adam", [](torch::nn::Sequential& net, double lr) {
                              return std::make_unique<optim::Adam>(
                                  net->parameters(),
                                  optim::AdamOptions(lr).betas({0.8, 0.99}));
                            }});
}

TEST(CheckpointOptimizerTest, AdamWithAmsgradInTwoGroupsRoundTrips) {
  ExpectOptimizerRoundTrip(
      {"Adam", [](torch::nn::Sequential& net, double lr) {
         const auto params = net->parameters();
         std::vector<optim::OptimizerParamGroup> groups;
         groups.emplace_back(Slice(params, 0, 3),
                             std::make_unique<optim::AdamOptions>(
                                 optim::AdamOptions(lr).amsgrad(true)));
         groups.emplace_back(
             Slice(params, 3, params.size()),
             std::make_unique<optim::AdamOptions>(
                 optim::AdamOptions(lr / 2).amsgrad(true).weight_decay(0.01)));
         return std::make_unique<optim::Adam>(std::move(groups),
                                              optim::AdamOptions(lr));
       }});
}

TEST(CheckpointOptimizerTest, AdamWRoundTrips) {
  ExpectOptimizerRoundTrip({"AdamW", [](torch::nn::Sequential& net, double lr) {
                              return std::make_unique<optim::AdamW>(
                                  net->parameters(),
                                  optim::AdamWOptions(lr).weight_decay(0.05));
                            }});
}

TEST(CheckpointOptimizerTest, RmspropWithMomentumRoundTrips) {
  ExpectOptimizerRoundTrip(
      {"RMSprop", [](torch::nn::Sequential& net, double lr) {
         return std::make_unique<optim::RMSprop>(
             net->parameters(), optim::RMSpropOptions(lr).momentum(0.9));
       }});
}

TEST(CheckpointOptimizerTest, CenteredRmspropRoundTrips) {
  ExpectOptimizerRoundTrip(
      {"RMSprop", [](torch::nn::Sequential& net, double lr) {
         return std::make_unique<optim::RMSprop>(
             net->parameters(),
             optim::RMSpropOptions(lr).centered(true).alpha(0.9));
       }});
}

TEST(CheckpointOptimizerTest, AdagradRoundTrips) {
  ExpectOptimizerRoundTrip(
      {"Adagrad", [](torch::nn::Sequential& net, double lr) {
         return std::make_unique<optim::Adagrad>(
             net->parameters(),
             optim::AdagradOptions(lr).lr_decay(0.01).initial_accumulator_value(
                 0.1));
       }});
}

// PyTorch has no file for LBFGS: LibTorch's own archive, in state.pt.
TEST(CheckpointOptimizerTest, LbfgsRoundTripsAsLibTorchsArchive) {
  ExpectOptimizerRoundTrip(
      {"", [](torch::nn::Sequential& net, double lr) {
         return std::make_unique<optim::LBFGS>(
             net->parameters(),
             optim::LBFGSOptions(lr).max_iter(4).history_size(3));
       }});
}

TEST(CheckpointOptimizerTest, TheOptimizerFileIsPyTorchsStateDict) {
  TempDir dir;
  auto net = MakeNet(1);
  optim::Adam adam(net->parameters(), optim::AdamOptions(0.01));
  Train(net, adam, 2);
  Content content;
  content.optimizers.push_back(CaptureOptimizer("optimizer", adam));
  absl::StatusOr<WriteStats> written = Write(content, dir);
  ASSERT_TRUE(written.ok()) << written.status();
  std::ifstream in(fs::path(written->path) / "optimizer.pt", std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  absl::StatusOr<c10::IValue> value = ReadArchive(bytes);
  ASSERT_TRUE(value.ok()) << value.status();
  ASSERT_TRUE(value->isGenericDict());
  const auto dict = value->toGenericDict();
  const auto state = dict.at("state").toGenericDict();
  EXPECT_EQ(state.size(), net->parameters().size());
  const auto first = state.at(int64_t{0}).toGenericDict();
  const at::Tensor step = first.at("step").toTensor();
  EXPECT_EQ(step.dim(), 0);
  EXPECT_EQ(step.scalar_type(), torch::kFloat);
  EXPECT_EQ(step.item<float>(), 2.0f);
  const OptimizerContent captured = CaptureOptimizer("optimizer", adam);
  ASSERT_FALSE(captured.state.empty());
  EXPECT_TRUE(torch::equal(first.at("exp_avg").toTensor(),
                           captured.state[0].second[1].second));
  EXPECT_EQ(captured.state[0].second[1].first, "exp_avg");
  const auto groups = dict.at("param_groups").toListRef();
  ASSERT_EQ(groups.size(), 1u);
  const auto group = groups[0].toGenericDict();
  EXPECT_DOUBLE_EQ(group.at("lr").toDouble(), 0.01);
  EXPECT_TRUE(group.at("betas").isTuple());
  const auto params = group.at("params").toListRef();
  ASSERT_EQ(params.size(), net->parameters().size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].toInt(), static_cast<int64_t>(i));
  }
}

// ---- the content, the manifest, `latest` -----------------------------------

TEST(CheckpointDiskTest, ContentAndManifestRoundTrip) {
  TempDir dir;
  const Content content = SampleContent(42);
  absl::StatusOr<WriteStats> written = Write(content, dir);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->path, StepDir(dir, 42));
  EXPECT_GT(written->bytes, 0u);

  absl::StatusOr<Content> loaded = LoadCheckpoint(written->path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameContent(*loaded, content);

  EXPECT_EQ(ReadText(dir / "job-a/latest"), "step-42\n");
  EXPECT_THAT(Entries(written->path), ElementsAre("manifest.json", "model.pt",
                                                  "optimizer.pt", "state.pt"));
  std::ifstream in(fs::path(written->path) / "manifest.json");
  const json m = json::parse(in);
  EXPECT_EQ(m.at("format"), "concord-checkpoint");
  EXPECT_EQ(m.at("version"), 1);
  EXPECT_EQ(m.at("job"), kJob);
  EXPECT_EQ(m.at("step"), 42);
  EXPECT_EQ(m.at("epoch"), 2);
  EXPECT_EQ(m.at("samples"), 96);
  EXPECT_EQ(m.at("world_size"), 4);
  EXPECT_EQ(m.at("generation"), 7);
  EXPECT_EQ(m.at("modules"), json::array({"model"}));
  EXPECT_EQ(m.at("optimizers"),
            json::parse(R"([{"name": "optimizer", "type": "Adam"},
                            {"name": "lbfgs", "type": ""}])"));
  uint64_t total = 0;
  for (const char* file : {"model.pt", "optimizer.pt", "state.pt"}) {
    ASSERT_TRUE(m.at("files").contains(file)) << file;
    const json& f = m.at("files").at(file);
    EXPECT_EQ(f.at("size").get<uint64_t>(),
              fs::file_size(fs::path(written->path) / file))
        << file;
    EXPECT_TRUE(f.at("crc32").is_number_unsigned()) << file;
    total += f.at("size").get<uint64_t>();
  }
  EXPECT_EQ(m.at("files").size(), 3u);
  EXPECT_EQ(m.at("files").at("model.pt").at("kind"), "module");
  EXPECT_EQ(m.at("files").at("optimizer.pt").at("type"), "Adam");
  EXPECT_EQ(m.at("files").at("state.pt").at("kind"), "state");
  EXPECT_EQ(written->bytes, total);

  const std::vector<CheckpointInfo> list = ListCheckpoints(dir.path(), kJob);
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].path, written->path);
  EXPECT_EQ(list[0].step, 42);
  EXPECT_EQ(list[0].epoch, 2);
  EXPECT_EQ(list[0].position, 96);
  EXPECT_EQ(list[0].world_size, 4);
  EXPECT_EQ(list[0].generation, 7);
  EXPECT_EQ(list[0].bytes, total);

  // model.pt is torch.save(state_dict): a dict of the module's tensors.
  std::ifstream model(fs::path(written->path) / "model.pt", std::ios::binary);
  absl::StatusOr<c10::IValue> value = ReadArchive(std::vector<char>(
      std::istreambuf_iterator<char>(model), std::istreambuf_iterator<char>()));
  ASSERT_TRUE(value.ok()) << value.status();
  ASSERT_TRUE(value->isGenericDict());
  EXPECT_TRUE(torch::equal(value->toGenericDict().at("w").toTensor(),
                           content.modules[0].second[0].second));
}

TEST(CheckpointDiskTest, TheRngStateRestores) {
  TempDir dir;
  Content content = SampleContent(1);
  torch::manual_seed(123);
  content.extra = {{"rng/cpu", CpuRngState()}};
  const at::Tensor first = torch::rand({5});
  ASSERT_TRUE(Write(content, dir).ok());
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->content.extra.size(), 1u);
  (void)torch::rand({17});
  absl::Status s = SetCpuRngState(loaded->content.extra[0].second);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(torch::equal(torch::rand({5}), first));
  EXPECT_TRUE(absl::IsInvalidArgument(SetCpuRngState(torch::ones({3}))));
}

TEST(CheckpointDiskTest, WritingTheSameStepAgainReplacesIt) {
  TempDir dir;
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  Content again = SampleContent(10);
  again.counters.epoch = 9;
  ASSERT_TRUE(Write(again, dir).ok());
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->content.counters.epoch, 9);
  EXPECT_THAT(Entries(JobDir(dir)), ElementsAre("latest", "step-10"));
}

// ---- crashes
// -----------------------------------------------------------------

// Step 10 complete, step 20 stopped at `fault` as a crash would stop it.
void WriteTenThenCrashAtTwenty(const TempDir& dir, WriteFault fault) {
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  WriteOptions options;
  options.fault = fault;
  absl::StatusOr<WriteStats> crashed = Write(SampleContent(20), dir, options);
  ASSERT_TRUE(absl::IsAborted(crashed.status())) << crashed.status();
}

// A later write of step 30 cleans up what crashed writers left for older
// steps (its own and another process's), not a newer step's staging.
void ExpectStepThirtyCleansUp(const TempDir& dir,
                              const std::vector<std::string>& step_dirs) {
  const std::string other_old = JobDir(dir) + "/.staging-step-25-1";
  const std::string other_new = JobDir(dir) + "/.staging-step-35-1";
  fs::create_directory(other_old);
  fs::create_directory(other_new);
  WriteText(JobDir(dir) + "/.latest-1", "ste");
  ASSERT_TRUE(Write(SampleContent(30), dir).ok());
  std::vector<std::string> expected = {".staging-step-35-1", "latest"};
  expected.insert(expected.end(), step_dirs.begin(), step_dirs.end());
  EXPECT_EQ(Entries(JobDir(dir)), expected);
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-30\n");
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 30);
}

TEST(CheckpointCrashTest, BeforeTheManifestLeavesTheOlderOne) {
  TempDir dir;
  WriteTenThenCrashAtTwenty(dir, WriteFault::kBeforeManifest);
  EXPECT_TRUE(fs::is_directory(StagingDir(dir, 20)));
  EXPECT_FALSE(fs::exists(fs::path(StagingDir(dir, 20)) / "manifest.json"));
  EXPECT_FALSE(fs::exists(StepDir(dir, 20)));
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-10\n");
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 10);
  ExpectSameContent(loaded->content, SampleContent(10));
  ExpectStepThirtyCleansUp(dir, {"step-10", "step-30"});
}

TEST(CheckpointCrashTest, BeforeTheRenameLeavesTheOlderOne) {
  TempDir dir;
  WriteTenThenCrashAtTwenty(dir, WriteFault::kBeforeRename);
  // Complete but staged: never loaded.
  EXPECT_TRUE(fs::exists(fs::path(StagingDir(dir, 20)) / "manifest.json"));
  EXPECT_FALSE(fs::exists(StepDir(dir, 20)));
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-10\n");
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 10);
  EXPECT_EQ(ListCheckpoints(dir.path(), kJob).size(), 1u);
  ExpectStepThirtyCleansUp(dir, {"step-10", "step-30"});
}

// Renamed into place, `latest` not replaced yet: the loader goes by the
// step-N directories (Note [Checkpoint directories]), so step 20 is what
// loads, while `latest` still names step 10.
TEST(CheckpointCrashTest, DuringLatestLosesNothing) {
  TempDir dir;
  WriteTenThenCrashAtTwenty(dir, WriteFault::kDuringLatest);
  EXPECT_FALSE(fs::exists(StagingDir(dir, 20)));
  ASSERT_TRUE(fs::is_directory(StepDir(dir, 20)));
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-10\n");
  absl::StatusOr<Content> twenty = LoadCheckpoint(StepDir(dir, 20));
  ASSERT_TRUE(twenty.ok()) << twenty.status();
  ExpectSameContent(*twenty, SampleContent(20));
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 20);
  EXPECT_TRUE(LoadCheckpoint(StepDir(dir, 10)).ok());
  ExpectStepThirtyCleansUp(dir, {"step-10", "step-20", "step-30"});
}

// ---- damaged checkpoints
// -------------------------------------------------------

// Steps 10 and 20, then `damage` to step 20: LoadCheckpoint names `file`,
// LoadNewest falls back to step 10.
void ExpectDamageFallsBack(
    const std::function<void(const std::string& step_dir)>& damage,
    const std::string& file, absl::StatusCode code) {
  TempDir dir;
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  ASSERT_TRUE(Write(SampleContent(20), dir).ok());
  ASSERT_TRUE(LoadCheckpoint(StepDir(dir, 20)).ok());
  damage(StepDir(dir, 20));
  absl::StatusOr<Content> bad = LoadCheckpoint(StepDir(dir, 20));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), code) << bad.status();
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr(file));
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 10);
  EXPECT_EQ(loaded->info.path, StepDir(dir, 10));
  ExpectSameContent(loaded->content, SampleContent(10));
}

TEST(CheckpointDamageTest, AFlippedByteInTheModelFallsBack) {
  ExpectDamageFallsBack(
      [](const std::string& step_dir) {
        const std::string path = step_dir + "/model.pt";
        std::string bytes = ReadText(path);
        ASSERT_GT(bytes.size(), 100u);
        bytes[bytes.size() / 2] ^= 0x01;
        WriteText(path, bytes);
      },
      "model.pt", absl::StatusCode::kDataLoss);
}

TEST(CheckpointDamageTest, ATruncatedManifestFallsBack) {
  ExpectDamageFallsBack(
      [](const std::string& step_dir) {
        const std::string path = step_dir + "/manifest.json";
        const std::string text = ReadText(path);
        WriteText(path, text.substr(0, text.size() / 2));
      },
      "manifest.json", absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointDamageTest, AMissingOptimizerFileFallsBack) {
  ExpectDamageFallsBack(
      [](const std::string& step_dir) {
        ASSERT_TRUE(fs::remove(step_dir + "/optimizer.pt"));
      },
      "optimizer.pt", absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointDamageTest, AManifestOfAnotherJobFallsBack) {
  ExpectDamageFallsBack(
      [](const std::string& step_dir) {
        const std::string path = step_dir + "/manifest.json";
        std::ifstream in(path);
        json m = json::parse(in);
        in.close();
        m["job"] = "job-b";
        WriteText(path, m.dump(2));
      },
      "manifest.json", absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointDamageTest, NothingLoadableIsNotFound) {
  TempDir dir;
  EXPECT_TRUE(absl::IsNotFound(LoadNewest(dir.path(), kJob).status()));
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  ASSERT_TRUE(fs::remove(StepDir(dir, 10) + "/state.pt"));
  EXPECT_TRUE(absl::IsNotFound(LoadNewest(dir.path(), kJob).status()));
}

// ---- keep
// ----------------------------------------------------------------------

TEST(CheckpointDiskTest, KeepsTheNewestThree) {
  TempDir dir;
  WriteOptions options;
  options.keep = 3;
  for (int64_t step = 10; step <= 60; step += 10) {
    absl::StatusOr<WriteStats> w = Write(SampleContent(step), dir, options);
    ASSERT_TRUE(w.ok()) << w.status();
  }
  EXPECT_THAT(Entries(JobDir(dir)),
              ElementsAre("latest", "step-40", "step-50", "step-60"));
  const std::vector<CheckpointInfo> list = ListCheckpoints(dir.path(), kJob);
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0].step, 60);
  EXPECT_EQ(list[1].step, 50);
  EXPECT_EQ(list[2].step, 40);
}

// ---- writes that fail
// ------------------------------------------------------------

bool CanCreate(const std::string& path) {
  std::ofstream probe(path);
  const bool ok = probe.good();
  probe.close();
  if (ok) fs::remove(path);
  return ok;
}

// After a failed write of step 20: no staging directory, step 10 loads.
void ExpectOnlyStepTen(const TempDir& dir) {
  EXPECT_THAT(Entries(JobDir(dir)), ElementsAre("latest", "step-10"));
  EXPECT_EQ(ReadText(JobDir(dir) + "/latest"), "step-10\n");
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 10);
}

TEST(CheckpointWriteFailureTest, AReadOnlyDirectoryIsUnavailable) {
  TempDir dir;
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  ASSERT_EQ(::chmod(JobDir(dir).c_str(), 0555), 0);
  if (CanCreate(JobDir(dir) + "/probe")) {
    ::chmod(JobDir(dir).c_str(), 0755);
    GTEST_SKIP() << "chmod does not stop this process (root)";
  }
  absl::StatusOr<WriteStats> w = Write(SampleContent(20), dir);
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  EXPECT_THAT(std::string(w.status().message()), HasSubstr(JobDir(dir)));
  ExpectOnlyStepTen(dir);
  ASSERT_EQ(::chmod(JobDir(dir).c_str(), 0755), 0);
}

// The same as another user where this runs as root (chmod does not stop
// root): the write in a child process that gave up root.
TEST(CheckpointWriteFailureTest, AReadOnlyDirectoryIsUnavailableToAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "not root: the test above covers it";
  TempDir dir;
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  ASSERT_EQ(::chmod(JobDir(dir).c_str(), 0555), 0);
  const Content twenty = SampleContent(20);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) {
    constexpr uid_t kNobody = 65534;
    if (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 ||
        ::setuid(kNobody) != 0) {
      ::_exit(10);
    }
    absl::StatusOr<WriteStats> w =
        WriteCheckpoint(twenty, dir.path(), kJob, {});
    ::_exit(w.ok() ? 1 : absl::IsUnavailable(w.status()) ? 0 : 2);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  if (WEXITSTATUS(status) == 10) {
    GTEST_SKIP() << "cannot become another user";
  }
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "1: the write succeeded, 2: another error than UNAVAILABLE";
  ExpectOnlyStepTen(dir);
}

TEST(CheckpointWriteFailureTest, ADirectoryThatIsAFileIsUnavailable) {
  TempDir dir;
  const std::string file = dir / "a-file";
  WriteText(file, "not a directory");
  absl::StatusOr<WriteStats> w =
      WriteCheckpoint(SampleContent(10), file, kJob, {});
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  EXPECT_THAT(std::string(w.status().message()), HasSubstr(file));
  EXPECT_EQ(ReadText(file), "not a directory");
  EXPECT_THAT(Entries(dir.path()), ElementsAre("a-file"));

  // The job's directory a file, next to another job's checkpoints.
  ASSERT_TRUE(WriteCheckpoint(SampleContent(10), dir.path(), "job-b", {}).ok());
  WriteText(JobDir(dir), "not a directory");
  w = Write(SampleContent(20), dir);
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  EXPECT_EQ(ReadText(JobDir(dir)), "not a directory");
  EXPECT_TRUE(LoadNewest(dir.path(), "job-b").ok());
}

TEST(CheckpointWriteFailureTest, ANameThatCannotBeAFileRemovesTheStaging) {
  TempDir dir;
  ASSERT_TRUE(Write(SampleContent(10), dir).ok());
  for (const std::string name : {"state", "../model", ""}) {
    Content content = SampleContent(20);
    content.modules.emplace_back(name, NamedTensors{{"x", torch::ones({2})}});
    absl::StatusOr<WriteStats> w = Write(content, dir);
    EXPECT_TRUE(absl::IsInvalidArgument(w.status())) << name << w.status();
    ExpectOnlyStepTen(dir);
  }
  Content twice = SampleContent(20);
  twice.optimizers[0].name = "model";  // a module's name already
  EXPECT_TRUE(absl::IsInvalidArgument(Write(twice, dir).status()));
  ExpectOnlyStepTen(dir);
}

// ---- the memory tier --------------------------------------------------------

void ExpectSnapshotRoundTrip(Region& region) {
  EXPECT_TRUE(absl::IsNotFound(ReadSnapshot(region).status()));
  const Content small = SampleContent(5);
  absl::StatusOr<WriteResult> w = WriteSnapshot(region, small, kJob, false);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, WriteResult::kWritten);
  EXPECT_EQ(region.header().state.load(), RegionHeader::kReady);
  EXPECT_EQ(region.header().step, 5);
  EXPECT_EQ(region.header().sequence.load(), 1u);
  EXPECT_STREQ(region.header().job, kJob);
  {
    absl::StatusOr<Content> read = ReadSnapshot(region);
    ASSERT_TRUE(read.ok()) << read.status();
    ExpectSameContent(*read, small);
  }
  const size_t mapped = region.mapped();

  // Larger: the region grows.
  const Content large = SampleContent(6, 1 << 18);
  w = WriteSnapshot(region, large, kJob, true);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, WriteResult::kWritten);
  EXPECT_GT(region.mapped(), mapped);
  EXPECT_EQ(region.header().sequence.load(), 2u);
  EXPECT_EQ(region.header().persist, 1u);
  {
    absl::StatusOr<Content> read = ReadSnapshot(region);
    ASSERT_TRUE(read.ok()) << read.status();
    ExpectSameContent(*read, large);
  }

  // Smaller again: the region stays, the snapshot is the new one.
  w = WriteSnapshot(region, small, kJob, false);
  ASSERT_TRUE(w.ok()) << w.status();
  {
    absl::StatusOr<Content> read = ReadSnapshot(region);
    ASSERT_TRUE(read.ok()) << read.status();
    ExpectSameContent(*read, small);
  }

  // Being persisted: the next one is skipped, the last one stays.
  region.header().state.store(RegionHeader::kPersisting);
  w = WriteSnapshot(region, SampleContent(7), kJob, false);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, WriteResult::kSkippedBusy);
  EXPECT_EQ(region.header().state.load(), RegionHeader::kPersisting);
  EXPECT_EQ(region.header().sequence.load(), 3u);
  {
    absl::StatusOr<Content> read = ReadSnapshot(region);
    ASSERT_TRUE(read.ok()) << read.status();
    ExpectSameContent(*read, small);
  }

  // Torn by a writer that died: never read.
  region.header().state.store(RegionHeader::kWriting);
  EXPECT_TRUE(absl::IsNotFound(ReadSnapshot(region).status()));
  // The next writer takes it over.
  w = WriteSnapshot(region, SampleContent(8), kJob, false);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, WriteResult::kWritten);
  absl::StatusOr<Content> read = ReadSnapshot(region);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameContent(*read, SampleContent(8));
}

TEST(CheckpointMemoryTest, AnonymousRegionRoundTrips) {
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  ExpectSnapshotRoundTrip(**region);
}

TEST(CheckpointMemoryTest, FileRegionRoundTrips) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open(dir / "shm");
  ASSERT_TRUE(region.ok()) << region.status();
  ExpectSnapshotRoundTrip(**region);
  EXPECT_GE(fs::file_size(dir / "shm"), (*region)->header().bytes);
}

// concord-run's agent opens the file the workers write.
TEST(CheckpointMemoryTest, AnotherOpeningOfTheFileSeesTheSnapshot) {
  TempDir dir;
  const std::string path = dir / "shm";
  absl::StatusOr<std::unique_ptr<Region>> writer = Region::Open(path);
  ASSERT_TRUE(writer.ok()) << writer.status();
  absl::StatusOr<std::unique_ptr<Region>> early = Region::Open(path);
  ASSERT_TRUE(early.ok()) << early.status();
  EXPECT_TRUE(absl::IsNotFound(ReadSnapshot(**early).status()));

  const Content large = SampleContent(12, 1 << 16);
  ASSERT_TRUE(WriteSnapshot(**writer, large, kJob, true).ok());
  // Opened before the region grew: it maps the rest when reading.
  EXPECT_LT((*early)->mapped(), (*writer)->mapped());
  {
    absl::StatusOr<Content> read = ReadSnapshot(**early);
    ASSERT_TRUE(read.ok()) << read.status();
    ExpectSameContent(*read, large);
  }
  absl::StatusOr<std::unique_ptr<Region>> late = Region::Open(path);
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ((*late)->header().sequence.load(), 1u);
  EXPECT_EQ((*late)->header().step, 12);
  EXPECT_EQ((*late)->header().persist, 1u);
  EXPECT_STREQ((*late)->header().job, kJob);
  absl::StatusOr<Content> read = ReadSnapshot(**late);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameContent(*read, large);

  // A state another opening sets is this one's too.
  (*late)->header().state.store(RegionHeader::kPersisting);
  absl::StatusOr<WriteResult> w =
      WriteSnapshot(**writer, SampleContent(13), kJob, true);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, WriteResult::kSkippedBusy);
}

// A region that cannot grow to the next snapshot fails that write; the
// last complete snapshot, untouched, stays readable.
TEST(CheckpointMemoryTest, ASnapshotThatCannotFitKeepsTheLastOne) {
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  const Content small = SampleContent(5);
  ASSERT_TRUE(WriteSnapshot(**region, small, kJob, false).ok());
  Content huge = SampleContent(6);
  // 4 PiB that take no memory: no region maps that much.
  huge.extra.emplace_back("values/huge",
                          torch::zeros({1}).expand({int64_t{1} << 50}));
  absl::StatusOr<WriteResult> w = WriteSnapshot(**region, huge, kJob, false);
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  absl::StatusOr<Content> read = ReadSnapshot(**region);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameContent(*read, small);
}

// ---- the persister
// ------------------------------------------------------------

TEST(CheckpointPersisterTest, FlushWritesAPersistedSnapshotOnce) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  const Content content = SampleContent(40, 1000);
  ASSERT_TRUE(WriteSnapshot(**region, content, kJob, true).ok());
  {
    Persister persister(region->get(), dir.path(), 3);
    persister.Flush();
    PersisterStats stats = persister.stats();
    EXPECT_EQ(stats.written, 1);
    EXPECT_EQ(stats.failed, 0);
    EXPECT_EQ(stats.last_step, 40);
    EXPECT_GT(stats.last_bytes, 0u);
    EXPECT_EQ((*region)->header().state.load(), RegionHeader::kReady);
    EXPECT_EQ((*region)->header().persisted.load(),
              (*region)->header().sequence.load());
    persister.Flush();
    EXPECT_FALSE(persister.PersistOnce());
    EXPECT_EQ(persister.stats().written, 1);
  }
  EXPECT_THAT(Entries(JobDir(dir)), ElementsAre("latest", "step-40"));
  absl::StatusOr<Loaded> loaded = LoadNewest(dir.path(), kJob);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.step, 40);
  ExpectSameContent(loaded->content, content);
}

TEST(CheckpointPersisterTest, ASnapshotNotForTheDiskTierIsNotWritten) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("");
  ASSERT_TRUE(region.ok()) << region.status();
  ASSERT_TRUE(WriteSnapshot(**region, SampleContent(40), kJob, false).ok());
  {
    Persister persister(region->get(), dir.path(), 3);
    persister.Flush();
    const PersisterStats stats = persister.stats();
    EXPECT_EQ(stats.written, 0);
    EXPECT_EQ(stats.failed, 0);
    EXPECT_EQ(stats.last_step, -1);
    EXPECT_EQ((*region)->header().state.load(), RegionHeader::kReady);
  }
  EXPECT_FALSE(fs::exists(JobDir(dir)));
  EXPECT_TRUE(ListCheckpoints(dir.path(), kJob).empty());
  // The snapshot stays for the memory tier.
  EXPECT_TRUE(ReadSnapshot(**region).ok());
}

// ---- mismatches change nothing
// ------------------------------------------------

TEST(CheckpointApplyTest, ModuleMismatchesChangeNothing) {
  auto saved_net = MakeNet(1);
  const NamedTensors saved = Cloned(ModuleTensors(*saved_net));
  auto net = MakeNet(2);
  const NamedTensors before = Cloned(ModuleTensors(*net));

  NamedTensors missing = saved;
  missing.erase(missing.begin() + 1);  // "0.bias"
  absl::Status s = ApplyModule("model", missing, ModuleTensors(*net));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("0.bias"));
  ExpectSameTensors(ModuleTensors(*net), before, "missing");

  NamedTensors extra = saved;
  extra.emplace_back("4.weight", torch::ones({2}));
  s = ApplyModule("model", extra, ModuleTensors(*net));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("4.weight"));
  ExpectSameTensors(ModuleTensors(*net), before, "extra");

  // The last tensor of the wrong shape: nothing before it copied either.
  const NamedTensors wider = ModuleTensors(*MakeNet(1, 7));
  NamedTensors shaped = saved;
  for (auto& [name, t] : shaped) {
    if (name == "3.weight") {
      for (const auto& [n, w] : wider) {
        if (n == name) t = w;
      }
    }
  }
  s = ApplyModule("model", shaped, ModuleTensors(*net));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("3.weight"));
  ExpectSameTensors(ModuleTensors(*net), before, "shape");

  NamedTensors typed = saved;
  typed.back().second = typed.back().second.to(torch::kDouble);
  s = ApplyModule("model", typed, ModuleTensors(*net));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  ExpectSameTensors(ModuleTensors(*net), before, "dtype");

  s = ApplyModule("model", saved, ModuleTensors(*net));
  EXPECT_TRUE(s.ok()) << s;
  ExpectSameTensors(ModuleTensors(*net), saved, "applied");
}

// `optimizer`'s options and state, copied.
OptimizerContent Snapshot(const optim::Optimizer& optimizer) {
  return Cloned(CaptureOptimizer("optimizer", optimizer));
}

std::unique_ptr<optim::SGD> TwoGroupSgd(torch::nn::Sequential& net, double lr) {
  const auto params = net->parameters();
  std::vector<optim::OptimizerParamGroup> groups;
  groups.emplace_back(
      Slice(params, 0, 2),
      std::make_unique<optim::SGDOptions>(optim::SGDOptions(lr).momentum(0.9)));
  groups.emplace_back(Slice(params, 2, params.size()),
                      std::make_unique<optim::SGDOptions>(
                          optim::SGDOptions(lr * 2).momentum(0.9)));
  return std::make_unique<optim::SGD>(std::move(groups), optim::SGDOptions(lr));
}

void ExpectOptimizerUnchanged(const optim::Optimizer& optimizer,
                              const OptimizerContent& before,
                              const std::vector<double>& lrs) {
  EXPECT_EQ(Lrs(optimizer), lrs);
  ExpectSameOptimizer(CaptureOptimizer("optimizer", optimizer), before);
}

TEST(CheckpointApplyTest, OptimizerMismatchesChangeNothing) {
  auto saved_net = MakeNet(1);
  auto saved_sgd = TwoGroupSgd(saved_net, 0.1);
  Train(saved_net, *saved_sgd, 2);
  const OptimizerContent saved = Snapshot(*saved_sgd);

  auto net = MakeNet(2);
  auto sgd = TwoGroupSgd(net, 0.3);
  Train(net, *sgd, 1);
  const OptimizerContent before = Snapshot(*sgd);
  const std::vector<double> lrs = Lrs(*sgd);
  const NamedTensors params = Cloned(ModuleTensors(*net));
  auto expect_unchanged = [&](const char* what) {
    SCOPED_TRACE(what);
    ExpectOptimizerUnchanged(*sgd, before, lrs);
    ExpectSameTensors(ModuleTensors(*net), params, what);
  };

  // Another type.
  optim::Adam adam(saved_net->parameters(), optim::AdamOptions(0.1));
  Train(saved_net, adam, 1);
  absl::Status s = ApplyOptimizer(Snapshot(adam), *sgd);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("Adam"));
  expect_unchanged("type");

  // Another number of groups.
  optim::SGD one_group(saved_net->parameters(),
                       optim::SGDOptions(0.1).momentum(0.9));
  Train(saved_net, one_group, 1);
  s = ApplyOptimizer(Snapshot(one_group), *sgd);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  expect_unchanged("groups");

  // Another number of parameters in a group.
  OptimizerContent fewer = saved;
  fewer.param_groups[1]["params"].erase(0);
  s = ApplyOptimizer(fewer, *sgd);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  expect_unchanged("parameters");

  // A state tensor of another shape (its model has a wider layer).
  auto wide_net = MakeNet(1, 7);
  auto wide_sgd = TwoGroupSgd(wide_net, 0.1);
  Train(wide_net, *wide_sgd, 1);
  s = ApplyOptimizer(Snapshot(*wide_sgd), *sgd);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  expect_unchanged("shape");

  // The last group's options malformed: the first group's stay as well.
  OptimizerContent malformed = saved;
  malformed.param_groups[1].erase("momentum");
  s = ApplyOptimizer(malformed, *sgd);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("momentum"));
  expect_unchanged("options");

  // What matches applies.
  s = ApplyOptimizer(saved, *sgd);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(Lrs(*sgd), Lrs(*saved_sgd));
  ExpectSameOptimizer(CaptureOptimizer("optimizer", *sgd), saved);
}

TEST(CheckpointApplyTest, ANativeArchiveOfAnotherOptimizerFails) {
  auto net = MakeNet(1);
  optim::LBFGS lbfgs(net->parameters(), optim::LBFGSOptions(1).max_iter(2));
  Train(net, lbfgs, 1);
  const OptimizerContent native = CaptureOptimizer("optimizer", lbfgs);
  ASSERT_TRUE(native.type.empty());
  ASSERT_TRUE(native.native.defined());
  OptimizerContent broken = native;
  broken.native = torch::arange(64, torch::kUInt8);
  optim::LBFGS other(net->parameters(), optim::LBFGSOptions(0.5));
  absl::Status s = ApplyOptimizer(broken, other);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_EQ(Lrs(other), std::vector<double>{0.5});
  OptimizerContent empty = native;
  empty.native = at::Tensor();
  EXPECT_TRUE(absl::IsFailedPrecondition(ApplyOptimizer(empty, other)));
}

}  // namespace
}  // namespace concord::checkpoint

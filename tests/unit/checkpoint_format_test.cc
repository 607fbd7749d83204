// Durable checkpoints (worker/checkpoint/): LibTorch's optimizers through
// PyTorch's files and back, the content and manifest, and what a
// checkpoint that does not fit changes (nothing).
#include <ATen/CPUGeneratorImpl.h>

#include "absl/strings/str_cat.h"
#include "checkpoint_fixture.h"

namespace concord::checkpoint {
namespace {

using namespace concord::checkpoint::ckpt_test;  // NOLINT  (fs, optim, json,
                                                 // matchers)

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

  absl::StatusOr<Content> loaded = LoadCheckpoint(written->path, kJob);
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

  absl::StatusOr<Content> loaded = LoadCheckpoint(written->path, kJob);
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

// See Note [Each rank's randomness].
TEST(RandomStateTest, ARowPutsEveryGeneratorBack) {
  RandomState random;
  at::Generator noise = at::make_generator<at::CPUGeneratorImpl>(7);
  ASSERT_TRUE(random.Add("noise", noise).ok());
  ASSERT_EQ(random.Sizes().size(), 2u);  // the CPU's default, then "noise"
  EXPECT_EQ(random.Describe(),
            absl::StrCat("cpu (", random.Sizes()[0], " B), noise (",
                         random.Sizes()[1], " B)"));
  torch::manual_seed(5);
  const at::Tensor row = random.Capture();
  EXPECT_EQ(row.scalar_type(), at::kByte);
  EXPECT_EQ(row.numel(), random.Sizes()[0] + random.Sizes()[1]);
  const at::Tensor global = torch::rand({4});
  const at::Tensor own = torch::rand({4}, noise);
  (void)torch::rand({9});
  (void)torch::rand({9}, noise);
  ASSERT_TRUE(random.Apply(row).ok());
  EXPECT_TRUE(torch::equal(torch::rand({4}), global));
  EXPECT_TRUE(torch::equal(torch::rand({4}, noise), own));
}

TEST(RandomStateTest, WhatDoesNotFitIsRefusedAndChangesNothing) {
  RandomState random;
  at::Generator noise = at::make_generator<at::CPUGeneratorImpl>(7);
  EXPECT_TRUE(absl::IsInvalidArgument(random.Add("", noise)));
  EXPECT_TRUE(absl::IsInvalidArgument(random.Add("cpu", noise)));
  EXPECT_TRUE(absl::IsInvalidArgument(random.Add("u", at::Generator())));
  ASSERT_TRUE(random.Add("noise", noise).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(random.Add("again", noise)));
  EXPECT_TRUE(absl::IsInvalidArgument(
      random.Add("global", at::detail::getDefaultCPUGenerator())));
  EXPECT_TRUE(random.Fits(random.Sizes()).ok());
  const absl::Status other = random.Fits({random.Sizes()[0]});
  EXPECT_TRUE(absl::IsFailedPrecondition(other));
  EXPECT_THAT(std::string(other.message()),
              ::testing::HasSubstr("are not this program's (cpu ("));
  torch::manual_seed(5);
  const at::Tensor global = torch::rand({4});
  torch::manual_seed(5);
  for (const at::Tensor& bad :
       {torch::zeros({3}, torch::kUInt8), random.Capture().to(torch::kLong),
        random.Capture().reshape({1, -1})}) {
    EXPECT_TRUE(absl::IsFailedPrecondition(random.Apply(bad)));
  }
  // A row of the right size whose CPU part is no CPU generator's state:
  // refused, and the generators are as they were.
  at::Tensor garbage = random.Capture();
  garbage.fill_(0xff);
  EXPECT_TRUE(absl::IsFailedPrecondition(random.Apply(garbage)));
  EXPECT_TRUE(torch::equal(torch::rand({4}), global));
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

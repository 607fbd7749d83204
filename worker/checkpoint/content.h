#pragma once
// What a checkpoint holds, independent of where it is kept (see Note
// [Checkpoints] in worker/checkpoint/checkpointer.h), and how its parts
// become PyTorch's files and back.
//
// Note [Checkpoint format]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A checkpoint is the committed training state of a job, the same on every
// rank of a data-parallel job (so it is written once, and resumes at any
// world size):
//  - each module's parameters and buffers by name, in `<module>.pt`, as
//    `torch.save(model.state_dict())` writes them ("model.pt" for the
//    one-module state: ElasticState names it "model");
//  - each optimizer of a type PyTorch has (SGD, Adam, AdamW, RMSprop,
//    Adagrad) in `<optimizer>.pt`, as `torch.save(optimizer.state_dict())`
//    writes it: {"state": {index: {...}}, "param_groups": [{options...,
//    "params": [index, ...]}]}, parameters numbered across the groups in
//    order; "step" is a 0-dimensional float tensor as in PyTorch 1.13 and
//    2.x;
//  - in `state.pt` (a dict of tensors as well): the user's values
//    ("values/<name>"), the writer's CPU random generator's state
//    ("rng/cpu") and every rank's generators' ("rng/ranks", "rng/sizes": see
//    Note [Each rank's randomness]), each
//    module's bucket layout ("layout/<module>"), the state of what is
//    attached to the elastic state ("slowmo/<module>/...", see Note
//    [Participants in checkpoints] in worker/elastic/state.h) and an
//    optimizer PyTorch has no equivalent of as LibTorch's own archive, as
//    bytes ("optimizer/<name>");
//  - the counters (step, epoch, samples of the epoch consumed, the world
//    size and generation it was taken at) in manifest.json
//    (worker/checkpoint/disk.h).
// Every file loads with torch.load(..., weights_only=True) (see Note [State
// dict files] in worker/state_dict_file.h).

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/state_dict_file.h"

namespace concord::checkpoint {

struct OptimizerContent {
  std::string name;
  // "SGD", "Adam", "AdamW", "RMSprop" or "Adagrad"; empty for an optimizer
  // PyTorch has no file for (`native` holds it).
  std::string type;
  // PyTorch's param_groups (each group's options and "params": indices).
  nlohmann::json param_groups = nlohmann::json::array();
  // Per-parameter state by the parameter's index.
  std::vector<std::pair<int64_t, NamedTensors>> state;
  // `type` empty: LibTorch's Optimizer::save archive, as uint8.
  at::Tensor native;
  // Holes in `state` (tensors on the meta device) that another rank writes
  // into the checkpoint's file itself: the CRC-32 of the bytes it will
  // write, by parameter index and key (see Note [Shards written where they
  // are] in worker/checkpoint/disk.h). The memory tier's holes have none.
  std::map<std::pair<int64_t, std::string>, uint32_t> hole_crc;
};

struct Counters {
  int64_t step = 0;
  int64_t epoch = 0;
  int64_t position = 0;  // samples of the epoch consumed (the loop's unit)
  int64_t world_size = 0;
  int64_t generation = 0;
  // See Note [Runs] in coordinator/core/core.h: the job's run that took it
  // (0: unknown, an older checkpoint's). Checkpoints are ordered by run, then
  // step (Newer).
  int64_t run = 0;
};

// Whether a checkpoint of `a` is newer than one of `b`: a later run, or the
// same run and a later step.
inline bool Newer(const Counters& a, const Counters& b) {
  return a.run != b.run ? a.run > b.run : a.step > b.step;
}

struct Content {
  Counters counters;
  // Each module's parameters and buffers by name.
  std::vector<std::pair<std::string, NamedTensors>> modules;
  std::vector<OptimizerContent> optimizers;
  // state.pt's entries besides the native optimizers: "values/<name>",
  // "rng/cpu", "layout/<module>", "<participant>/<key>".
  NamedTensors extra;
};

// "[2, 3] Float": a tensor's shape and dtype, for messages.
std::string DescribeTensor(const at::Tensor& t);

// Optimizers (optimizer_state.cc): the optimizer's state as PyTorch's
// state_dict has it. The tensors are
// the optimizer's own (no copy), except "step" counters.
OptimizerContent CaptureOptimizer(const std::string& name,
                                  const torch::optim::Optimizer& optimizer);
// Puts `saved` into `optimizer`: options of every group, per-parameter
// state (copied onto each parameter's device). FAILED_PRECONDITION naming
// what differs: another type, another number of groups or parameters, a
// state tensor whose shape is not its parameter's.
absl::Status ApplyOptimizer(const OptimizerContent& saved,
                            torch::optim::Optimizer& optimizer);
// Optimizer::load, with the saved groups' options put back on every
// LibTorch (see Note [LibTorch versions] in worker/torch_compat.h). Throws
// what Optimizer::load throws for an archive that does not fit.
void LoadNativeOptimizer(torch::serialize::InputArchive& archive,
                         torch::optim::Optimizer& optimizer);
// Copies `saved` into the module's `live` tensors by name.
// FAILED_PRECONDITION naming the first name missing on either side or whose
// shape or dtype differs (CheckModule: the same check alone); nothing is
// copied then.
absl::Status CheckModule(const std::string& module, const NamedTensors& saved,
                         const NamedTensors& live);
absl::Status ApplyModule(const std::string& module, const NamedTensors& saved,
                         const NamedTensors& live);

// A program's modules (their tensors by name) and optimizers, by the names
// a checkpoint knows them by.
struct Live {
  std::vector<std::pair<std::string, NamedTensors>> modules;
  std::vector<std::pair<std::string, torch::optim::Optimizer*>> optimizers;
};
// Puts `content`'s modules and optimizers into `live`'s, all or nothing:
// every module is checked first, an optimizer that does not fit puts the
// ones before it back. FAILED_PRECONDITION naming a module or optimizer the
// checkpoint lacks or that does not fit. Returns the user's values
// ("values/<name>", copied).
absl::StatusOr<std::map<std::string, at::Tensor>> ApplyTo(
    const Content& content, const Live& live);

// The CPU random generator's state, and putting it back (INVALID_ARGUMENT
// for a tensor that is not one).
at::Tensor CpuRngState();
absl::Status SetCpuRngState(const at::Tensor& state);

// Note [Each rank's randomness]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Dropout, noise, random augmentation draw from random generators, and each
// rank's are its own: the ranks of a job draw different masks from
// differently seeded or differently advanced streams. So that a job that
// lost everyone resumes as if it had never stopped, every rank's generators
// are part of its committed state. RandomState names them: the process's
// default CPU generator, the default generator of the rank's CUDA device
// where it has one, and each generator the program adds
// (ElasticState::add(name, generator)), in that order. A commit keeps their
// states as one uint8 row (Capture; the CPU one's 5056 bytes, a CUDA one's
// 16); a failed step puts them back with the rest of the commit, so the
// step taken again draws what it drew. A checkpoint gathers every rank's
// row (one allgather, at the checkpoint only) into state.pt's "rng/ranks"
// ([world, bytes], row r rank r's, as SlowMo's per-rank optimizer rows)
// with "rng/sizes" (each generator's bytes, in order); "rng/cpu" stays the
// writer's CPU state. At a resume the loading rank checks that the rows fit
// this program's generators (the same number, the same sizes: else
// FAILED_PRECONDITION naming both, nothing changed) and broadcasts them:
// rank r below the checkpoint's world size takes row r; a rank beyond it
// keeps its own generators as the program seeded them, as a newcomer
// admitted at a re-form does (its own stream, never a copy of another
// rank's: two ranks on one stream would draw the same masks). A re-form
// changes no survivor's generators. A checkpoint without rows (an older
// one, or ranks whose generators differed) resumes as before: the loading
// rank takes "rng/cpu", the others keep theirs.
class RandomState {
 public:
  // The default CPU generator and, for a CUDA `device`, its default one.
  explicit RandomState(c10::Device device = c10::Device(c10::kCPU));
  // One of the program's own, after the defaults and those added before.
  // INVALID_ARGUMENT for an empty or taken name, an undefined generator or
  // one already here.
  absl::Status Add(const std::string& name, at::Generator generator);
  // Every generator's state, in order, as one uint8 row.
  at::Tensor Capture() const;
  // Each generator's state's bytes, in the row's order, and their sum (a
  // row's length).
  std::vector<int64_t> Sizes() const;
  int64_t RowBytes() const;
  // "cpu (5056 B), cuda:0 (16 B), noise (5056 B)".
  std::string Describe() const;
  // Whether rows of a checkpoint with generators of `sizes` fit these:
  // FAILED_PRECONDITION naming both otherwise.
  absl::Status Fits(const std::vector<int64_t>& sizes) const;
  // Puts a row (Capture's, of generators of this state's sizes) back.
  // FAILED_PRECONDITION when it does not fit; nothing changed then.
  absl::Status Apply(const at::Tensor& row) const;

 private:
  struct Named {
    std::string name;
    at::Generator generator;
    int64_t bytes = 0;
  };
  std::vector<Named> generators_;
};

// PyTorch's optimizer state_dict as an IValue (what `<optimizer>.pt`
// pickles), and back. INVALID_ARGUMENT naming what is malformed.
c10::IValue OptimizerToIValue(const OptimizerContent& optimizer);
absl::StatusOr<OptimizerContent> OptimizerFromIValue(const std::string& name,
                                                     const std::string& type,
                                                     const c10::IValue& value);

// Every tensor of `content` in one order, and its structure with each
// tensor replaced by its number in that order: what the memory tier stores
// (worker/checkpoint/memory.h). Unflatten(Flatten(c)) is c.
struct Flat {
  nlohmann::json skeleton;
  std::vector<at::Tensor> tensors;
};
Flat Flatten(const Content& content);
// INVALID_ARGUMENT when `skeleton` does not describe a content or refers to
// a tensor `tensors` lacks.
absl::StatusOr<Content> Unflatten(const nlohmann::json& skeleton,
                                  const std::vector<at::Tensor>& tensors);

}  // namespace concord::checkpoint

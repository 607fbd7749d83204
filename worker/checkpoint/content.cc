#include "worker/checkpoint/content.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "worker/checkpoint/optimizer_snapshot.h"

namespace concord::checkpoint {

using json = nlohmann::json;

std::string DescribeTensor(const at::Tensor& t) {
  return absl::StrCat(c10::str(t.sizes()), " ", std::string(t.dtype().name()));
}

absl::Status CheckModule(const std::string& module, const NamedTensors& saved,
                         const NamedTensors& live) {
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& [name, t] : saved) by_name[name] = &t;
  for (const auto& [name, t] : live) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "module '", module, "': the checkpoint has no '", name, "'"));
    }
    const at::Tensor& s = *it->second;
    if (s.sizes() != t.sizes() || s.dtype() != t.dtype()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "module '", module, "': '", name, "' is ", DescribeTensor(s),
          " in the checkpoint, ", DescribeTensor(t), " here"));
    }
  }
  if (saved.size() != live.size()) {
    std::set<std::string> names;
    for (const auto& [name, t] : live) names.insert(name);
    for (const auto& [name, t] : saved) {
      if (!names.count(name)) {
        return absl::FailedPreconditionError(
            absl::StrCat("module '", module, "': the checkpoint's '", name,
                         "' is not in this module"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ApplyModule(const std::string& module, const NamedTensors& saved,
                         const NamedTensors& live) {
  CONCORD_RETURN_IF_ERROR(CheckModule(module, saved, live));
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& [name, t] : saved) by_name[name] = &t;
  torch::NoGradGuard no_grad;
  for (const auto& [name, t] : live) {
    at::Tensor target = t;
    target.copy_(*by_name[name]);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::map<std::string, at::Tensor>> ApplyTo(
    const Content& content, const Live& live) {
  std::map<std::string, const NamedTensors*> modules;
  std::vector<std::string> names;
  for (const auto& [name, tensors] : content.modules) {
    modules[name] = &tensors;
    names.push_back(name);
  }
  std::map<std::string, const OptimizerContent*> optimizers;
  for (const auto& o : content.optimizers) optimizers[o.name] = &o;
  for (const auto& [name, tensors] : live.modules) {
    if (!modules.count(name)) {
      return absl::FailedPreconditionError(
          absl::StrCat("the checkpoint has no module '", name,
                       "' (it has: ", absl::StrJoin(names, ", "), ")"));
    }
    CONCORD_RETURN_IF_ERROR(CheckModule(name, *modules[name], tensors));
  }
  for (const auto& [name, optimizer] : live.optimizers) {
    if (!optimizers.count(name)) {
      return absl::FailedPreconditionError(
          absl::StrCat("the checkpoint has no optimizer '", name, "'"));
    }
  }
  std::vector<checkpoint::OptimizerSnapshot> before(live.optimizers.size());
  for (size_t i = 0; i < live.optimizers.size(); ++i) {
    const auto& [name, optimizer] = live.optimizers[i];
    before[i].Take(*optimizer);
    if (absl::Status s = ApplyOptimizer(*optimizers[name], *optimizer);
        !s.ok()) {
      for (size_t j = 0; j <= i; ++j) {
        before[j].Restore(*live.optimizers[j].second);
      }
      return s;
    }
  }
  for (const auto& [name, tensors] : live.modules) {
    CONCORD_RETURN_IF_ERROR(ApplyModule(name, *modules[name], tensors));
  }
  std::map<std::string, at::Tensor> values;
  for (const auto& [key, t] : content.extra) {
    if (absl::StartsWith(key, "values/")) {
      values[key.substr(std::strlen("values/"))] = t.clone();
    }
  }
  return values;
}

at::Tensor CpuRngState() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

absl::Status SetCpuRngState(const at::Tensor& state) {
  try {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state.to(torch::kCPU).contiguous());
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a CPU random generator's state: ", e.what()));
  }
  return absl::OkStatus();
}

namespace {

// A generator's state (under its lock).
at::Tensor StateOf(at::Generator generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state().to(at::kByte).reshape({-1});
}

// Sets a generator's state; INTERNAL with what it said when it refuses.
absl::Status SetState(at::Generator generator, const at::Tensor& state) {
  try {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  } catch (const std::exception& e) {
    return absl::InternalError(e.what());
  }
  return absl::OkStatus();
}

}  // namespace

RandomState::RandomState(c10::Device device) {
  generators_.push_back({"cpu", at::detail::getDefaultCPUGenerator(), 0});
  if (device.is_cuda()) {
    generators_.push_back(
        {device.str(), at::globalContext().defaultGenerator(device), 0});
  }
  for (Named& g : generators_) g.bytes = StateOf(g.generator).numel();
}

absl::Status RandomState::Add(const std::string& name,
                              at::Generator generator) {
  if (name.empty())
    return absl::InvalidArgumentError("a generator needs a name");
  if (!generator.defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat("generator '", name, "' is undefined"));
  }
  for (const Named& g : generators_) {
    if (g.name == name) {
      return absl::InvalidArgumentError(
          absl::StrCat("a generator is named '", name, "' already"));
    }
    if (g.generator == generator) {
      return absl::InvalidArgumentError(absl::StrCat(
          "generator '", name, "' is '", g.name, "', added already"));
    }
  }
  const int64_t bytes = StateOf(generator).numel();
  generators_.push_back({name, std::move(generator), bytes});
  return absl::OkStatus();
}

at::Tensor RandomState::Capture() const {
  std::vector<at::Tensor> parts;
  parts.reserve(generators_.size());
  for (const Named& g : generators_) parts.push_back(StateOf(g.generator));
  return at::cat(parts);
}

int64_t RandomState::RowBytes() const {
  int64_t bytes = 0;
  for (const Named& g : generators_) bytes += g.bytes;
  return bytes;
}

std::vector<int64_t> RandomState::Sizes() const {
  std::vector<int64_t> sizes;
  for (const Named& g : generators_) sizes.push_back(g.bytes);
  return sizes;
}

namespace {

std::string DescribeSizes(const std::vector<std::string>& names,
                          const std::vector<int64_t>& sizes) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < sizes.size(); ++i) {
    parts.push_back(i < names.size()
                        ? absl::StrCat(names[i], " (", sizes[i], " B)")
                        : absl::StrCat(sizes[i], " B"));
  }
  return absl::StrJoin(parts, ", ");
}

}  // namespace

std::string RandomState::Describe() const {
  std::vector<std::string> names;
  for (const Named& g : generators_) names.push_back(g.name);
  return DescribeSizes(names, Sizes());
}

absl::Status RandomState::Fits(const std::vector<int64_t>& sizes) const {
  if (sizes == Sizes()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "its ranks' random generators (", DescribeSizes({}, sizes),
      ") are not this program's (", Describe(),
      "): the same generators, added in the same order, are needed"));
}

absl::Status RandomState::Apply(const at::Tensor& row) const {
  if (row.scalar_type() != at::kByte || row.dim() != 1 ||
      row.numel() != RowBytes()) {
    return absl::FailedPreconditionError(
        absl::StrCat("a row of random states of ", DescribeTensor(row),
                     " does not fit ", Describe()));
  }
  const at::Tensor cpu = row.to(at::kCPU).contiguous();
  const at::Tensor before = Capture();  // to put back if one refuses
  int64_t offset = 0;
  for (const Named& g : generators_) {
    absl::Status set =
        SetState(g.generator, cpu.narrow(0, offset, g.bytes).clone());
    offset += g.bytes;
    if (!set.ok()) {
      int64_t back = 0;
      for (const Named& h : generators_) {
        SetState(h.generator, before.narrow(0, back, h.bytes).clone())
            .IgnoreError();
        back += h.bytes;
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "generator '", g.name, "' refused its saved state: ", set.message()));
    }
  }
  return absl::OkStatus();
}

Flat Flatten(const Content& content) {
  Flat flat;
  auto add = [&flat](const at::Tensor& t) {
    flat.tensors.push_back(t);
    return static_cast<int64_t>(flat.tensors.size() - 1);
  };
  auto named = [&add](const NamedTensors& tensors) {
    json out = json::array();
    for (const auto& [name, t] : tensors) out.push_back({name, add(t)});
    return out;
  };
  const Counters& c = content.counters;
  json& s = flat.skeleton;
  s["counters"] = {{"step", c.step},
                   {"epoch", c.epoch},
                   {"position", c.position},
                   {"world_size", c.world_size},
                   {"generation", c.generation},
                   {"run", c.run}};
  s["modules"] = json::array();
  for (const auto& [name, tensors] : content.modules) {
    s["modules"].push_back({{"name", name}, {"tensors", named(tensors)}});
  }
  s["optimizers"] = json::array();
  for (const OptimizerContent& o : content.optimizers) {
    json state = json::array();
    for (const auto& [index, tensors] : o.state) {
      state.push_back({index, named(tensors)});
    }
    json j = {{"name", o.name},
              {"type", o.type},
              {"param_groups", o.param_groups},
              {"state", std::move(state)}};
    if (o.native.defined()) j["native"] = add(o.native);
    s["optimizers"].push_back(std::move(j));
  }
  s["extra"] = named(content.extra);
  return flat;
}

absl::StatusOr<Content> Unflatten(const json& s,
                                  const std::vector<at::Tensor>& tensors) {
  auto tensor = [&tensors](const json& index) -> absl::StatusOr<at::Tensor> {
    if (!index.is_number_integer() || index.get<int64_t>() < 0 ||
        index.get<size_t>() >= tensors.size()) {
      return absl::InvalidArgumentError("a tensor reference out of range");
    }
    return tensors[index.get<size_t>()];
  };
  auto named = [&tensor](const json& list) -> absl::StatusOr<NamedTensors> {
    if (!list.is_array()) return absl::InvalidArgumentError("not a list");
    NamedTensors out;
    for (const json& e : list) {
      if (!e.is_array() || e.size() != 2 || !e[0].is_string()) {
        return absl::InvalidArgumentError("not a [name, tensor] pair");
      }
      auto t = tensor(e[1]);
      if (!t.ok()) return t.status();
      out.emplace_back(e[0].get<std::string>(), *t);
    }
    return out;
  };
  try {
    Content c;
    const json& k = s.at("counters");
    c.counters.step = k.at("step").get<int64_t>();
    c.counters.epoch = k.at("epoch").get<int64_t>();
    c.counters.position = k.at("position").get<int64_t>();
    c.counters.world_size = k.at("world_size").get<int64_t>();
    c.counters.generation = k.at("generation").get<int64_t>();
    c.counters.run = k.value("run", int64_t{0});
    for (const json& m : s.at("modules")) {
      auto t = named(m.at("tensors"));
      if (!t.ok()) return t.status();
      c.modules.emplace_back(m.at("name").get<std::string>(), *std::move(t));
    }
    for (const json& o : s.at("optimizers")) {
      OptimizerContent oc;
      oc.name = o.at("name").get<std::string>();
      oc.type = o.at("type").get<std::string>();
      oc.param_groups = o.at("param_groups");
      for (const json& e : o.at("state")) {
        auto t = named(e.at(1));
        if (!t.ok()) return t.status();
        oc.state.emplace_back(e.at(0).get<int64_t>(), *std::move(t));
      }
      if (o.contains("native")) {
        auto t = tensor(o.at("native"));
        if (!t.ok()) return t.status();
        oc.native = *t;
      }
      c.optimizers.push_back(std::move(oc));
    }
    auto extra = named(s.at("extra"));
    if (!extra.ok()) return extra.status();
    c.extra = *std::move(extra);
    return c;
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a checkpoint's layout: ", e.what()));
  }
}

}  // namespace concord::checkpoint

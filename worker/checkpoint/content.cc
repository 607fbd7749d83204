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
#include "worker/elastic/optimizer_snapshot.h"

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
  std::vector<elastic::OptimizerSnapshot> before(live.optimizers.size());
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
                   {"generation", c.generation}};
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

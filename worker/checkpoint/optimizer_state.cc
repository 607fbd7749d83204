// The optimizers of a checkpoint (see Note [Checkpoint format] in
// worker/checkpoint/content.h): LibTorch's optimizers as PyTorch's
// optimizer state_dict, and back.
#include <torch/optim.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "worker/checkpoint/content.h"
#include "worker/torch_compat.h"

namespace concord::checkpoint {
namespace {

namespace optim = torch::optim;
using json = nlohmann::json;

// A 0-dimensional float tensor holding `step`, as PyTorch keeps it.
at::Tensor StepTensor(int64_t step) {
  return torch::tensor(static_cast<double>(step), torch::kFloat);
}

// The tensors of `state` by PyTorch's names; the step first where there is
// one. Empty for a type this does not know.
NamedTensors StateTensors(const optim::OptimizerParamState& s) {
  NamedTensors out;
  auto add = [&out](const char* key, const at::Tensor& t) {
    if (t.defined()) out.emplace_back(key, t);
  };
  if (const auto* a = dynamic_cast<const optim::AdamParamState*>(&s)) {
    out.emplace_back("step", StepTensor(a->step()));
    add("exp_avg", a->exp_avg());
    add("exp_avg_sq", a->exp_avg_sq());
    add("max_exp_avg_sq", a->max_exp_avg_sq());
  } else if (const auto* w = dynamic_cast<const optim::AdamWParamState*>(&s)) {
    out.emplace_back("step", StepTensor(w->step()));
    add("exp_avg", w->exp_avg());
    add("exp_avg_sq", w->exp_avg_sq());
    add("max_exp_avg_sq", w->max_exp_avg_sq());
  } else if (const auto* g = dynamic_cast<const optim::SGDParamState*>(&s)) {
    add("momentum_buffer", g->momentum_buffer());
  } else if (const auto* r =
                 dynamic_cast<const optim::RMSpropParamState*>(&s)) {
    out.emplace_back("step", StepTensor(r->step()));
    add("square_avg", r->square_avg());
    add("momentum_buffer", r->momentum_buffer());
    add("grad_avg", r->grad_avg());
  } else if (const auto* d =
                 dynamic_cast<const optim::AdagradParamState*>(&s)) {
    out.emplace_back("step", StepTensor(d->step()));
    add("sum", d->sum());
  }
  return out;
}

std::string TypeOf(const optim::Optimizer& o) {
  if (dynamic_cast<const optim::AdamW*>(&o) != nullptr) return "AdamW";
  if (dynamic_cast<const optim::Adam*>(&o) != nullptr) return "Adam";
  if (dynamic_cast<const optim::SGD*>(&o) != nullptr) return "SGD";
  if (dynamic_cast<const optim::RMSprop*>(&o) != nullptr) return "RMSprop";
  if (dynamic_cast<const optim::Adagrad*>(&o) != nullptr) return "Adagrad";
  return "";
}

// A group's options by PyTorch's names.
json GroupOptions(const std::string& type,
                  const optim::OptimizerOptions& options) {
  json g = json::object();
  if (type == "SGD") {
    const auto& o = static_cast<const optim::SGDOptions&>(options);
    g = {{"lr", o.lr()},
         {"momentum", o.momentum()},
         {"dampening", o.dampening()},
         {"weight_decay", o.weight_decay()},
         {"nesterov", o.nesterov()},
         {"maximize", false}};
  } else if (type == "Adam" || type == "AdamW") {
    auto fill = [&g](const auto& o) {
      g = {{"lr", o.lr()},
           {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}},
           {"eps", o.eps()},
           {"weight_decay", o.weight_decay()},
           {"amsgrad", o.amsgrad()},
           {"maximize", false}};
    };
    if (type == "Adam") {
      fill(static_cast<const optim::AdamOptions&>(options));
    } else {
      fill(static_cast<const optim::AdamWOptions&>(options));
    }
  } else if (type == "RMSprop") {
    const auto& o = static_cast<const optim::RMSpropOptions&>(options);
    g = {{"lr", o.lr()},
         {"alpha", o.alpha()},
         {"eps", o.eps()},
         {"weight_decay", o.weight_decay()},
         {"momentum", o.momentum()},
         {"centered", o.centered()},
         {"maximize", false}};
  } else if (type == "Adagrad") {
    const auto& o = static_cast<const optim::AdagradOptions&>(options);
    g = {{"lr", o.lr()},
         {"lr_decay", o.lr_decay()},
         {"weight_decay", o.weight_decay()},
         {"initial_accumulator_value", o.initial_accumulator_value()},
         {"eps", o.eps()},
         {"maximize", false}};
  }
  return g;
}

// A number of group `g` (INVALID_ARGUMENT naming it when missing).
absl::StatusOr<double> Number(const json& g, const char* key) {
  auto it = g.find(key);
  if (it == g.end() || !it->is_number()) {
    return absl::InvalidArgumentError(
        absl::StrCat("param_groups: '", key, "' is missing or not a number"));
  }
  return it->get<double>();
}
absl::StatusOr<bool> Bool(const json& g, const char* key) {
  auto it = g.find(key);
  if (it == g.end() || !it->is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat("param_groups: '", key, "' is missing or not a bool"));
  }
  return it->get<bool>();
}

// Sets a group's options from PyTorch's names.
absl::Status SetGroupOptions(const std::string& type, const json& g,
                             optim::OptimizerOptions& options) {
  if (auto m = g.find("maximize");
      m != g.end() && m->is_boolean() && m->get<bool>()) {
    return absl::InvalidArgumentError(
        "param_groups: maximize=True, which LibTorch's optimizers do not have");
  }
  if (type == "SGD") {
    CONCORD_ASSIGN_OR_RETURN(const auto lr, Number(g, "lr"));
    CONCORD_ASSIGN_OR_RETURN(const auto momentum, Number(g, "momentum"));
    CONCORD_ASSIGN_OR_RETURN(const auto dampening, Number(g, "dampening"));
    CONCORD_ASSIGN_OR_RETURN(const auto decay, Number(g, "weight_decay"));
    CONCORD_ASSIGN_OR_RETURN(const auto nesterov, Bool(g, "nesterov"));
    static_cast<optim::SGDOptions&>(options)
        .lr(lr)
        .momentum(momentum)
        .dampening(dampening)
        .weight_decay(decay)
        .nesterov(nesterov);
    return absl::OkStatus();
  }
  if (type == "Adam" || type == "AdamW") {
    CONCORD_ASSIGN_OR_RETURN(const auto lr, Number(g, "lr"));
    CONCORD_ASSIGN_OR_RETURN(const auto eps, Number(g, "eps"));
    CONCORD_ASSIGN_OR_RETURN(const auto decay, Number(g, "weight_decay"));
    CONCORD_ASSIGN_OR_RETURN(const auto amsgrad, Bool(g, "amsgrad"));
    auto betas = g.find("betas");
    if (betas == g.end() || !betas->is_array() || betas->size() != 2 ||
        !(*betas)[0].is_number() || !(*betas)[1].is_number()) {
      return absl::InvalidArgumentError(
          "param_groups: 'betas' is not a pair of numbers");
    }
    const auto pair =
        std::make_tuple((*betas)[0].get<double>(), (*betas)[1].get<double>());
    auto set = [&](auto& o) {
      o.lr(lr).betas(pair).eps(eps).weight_decay(decay).amsgrad(amsgrad);
    };
    if (type == "Adam") {
      set(static_cast<optim::AdamOptions&>(options));
    } else {
      set(static_cast<optim::AdamWOptions&>(options));
    }
    return absl::OkStatus();
  }
  if (type == "RMSprop") {
    CONCORD_ASSIGN_OR_RETURN(const auto lr, Number(g, "lr"));
    CONCORD_ASSIGN_OR_RETURN(const auto alpha, Number(g, "alpha"));
    CONCORD_ASSIGN_OR_RETURN(const auto eps, Number(g, "eps"));
    CONCORD_ASSIGN_OR_RETURN(const auto decay, Number(g, "weight_decay"));
    CONCORD_ASSIGN_OR_RETURN(const auto momentum, Number(g, "momentum"));
    CONCORD_ASSIGN_OR_RETURN(const auto centered, Bool(g, "centered"));
    static_cast<optim::RMSpropOptions&>(options)
        .lr(lr)
        .alpha(alpha)
        .eps(eps)
        .weight_decay(decay)
        .momentum(momentum)
        .centered(centered);
    return absl::OkStatus();
  }
  if (type == "Adagrad") {
    CONCORD_ASSIGN_OR_RETURN(const auto lr, Number(g, "lr"));
    CONCORD_ASSIGN_OR_RETURN(const auto lr_decay, Number(g, "lr_decay"));
    CONCORD_ASSIGN_OR_RETURN(const auto decay, Number(g, "weight_decay"));
    CONCORD_ASSIGN_OR_RETURN(const auto initial,
                             Number(g, "initial_accumulator_value"));
    CONCORD_ASSIGN_OR_RETURN(const auto eps, Number(g, "eps"));
    static_cast<optim::AdagradOptions&>(options)
        .lr(lr)
        .lr_decay(lr_decay)
        .weight_decay(decay)
        .initial_accumulator_value(initial)
        .eps(eps);
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer type '", type, "'"));
}

// `saved` as a tensor like `param` (its device, a copy of its own).
absl::StatusOr<at::Tensor> Like(const at::Tensor& saved,
                                const at::Tensor& param,
                                const std::string& what) {
  if (saved.sizes() != param.sizes() || saved.dtype() != param.dtype()) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " is ", DescribeTensor(saved), ", its parameter ",
                     DescribeTensor(param)));
  }
  return saved.to(param.device(), /*non_blocking=*/false, /*copy=*/true);
}

// The per-parameter state of `type` from PyTorch's names.
absl::StatusOr<std::unique_ptr<optim::OptimizerParamState>> MakeState(
    const std::string& type, const NamedTensors& entries,
    const at::Tensor& param, const std::string& what) {
  std::map<std::string, at::Tensor> by_name(entries.begin(), entries.end());
  int64_t step = 0;
  if (auto it = by_name.find("step"); it != by_name.end()) {
    if (it->second.numel() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": 'step' is not a number"));
    }
    step = static_cast<int64_t>(it->second.item<double>());
    by_name.erase(it);
  }
  std::map<std::string, at::Tensor> tensors;
  for (const auto& [key, t] : by_name) {
    auto like = Like(t, param, absl::StrCat(what, " '", key, "'"));
    if (!like.ok()) return like.status();
    tensors[key] = *like;
  }
  auto get = [&tensors](const char* key) {
    auto it = tensors.find(key);
    return it == tensors.end() ? at::Tensor() : it->second;
  };
  if (type == "SGD") {
    auto s = std::make_unique<optim::SGDParamState>();
    s->momentum_buffer(get("momentum_buffer"));
    return std::unique_ptr<optim::OptimizerParamState>(std::move(s));
  }
  if (type == "Adam" || type == "AdamW") {
    auto fill = [&](auto s) -> std::unique_ptr<optim::OptimizerParamState> {
      s->step(step);
      s->exp_avg(get("exp_avg"));
      s->exp_avg_sq(get("exp_avg_sq"));
      s->max_exp_avg_sq(get("max_exp_avg_sq"));
      return s;
    };
    if (!get("exp_avg").defined() || !get("exp_avg_sq").defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": no 'exp_avg' and 'exp_avg_sq'"));
    }
    if (type == "Adam") return fill(std::make_unique<optim::AdamParamState>());
    return fill(std::make_unique<optim::AdamWParamState>());
  }
  if (type == "RMSprop") {
    auto s = std::make_unique<optim::RMSpropParamState>();
    s->step(step);
    s->square_avg(get("square_avg"));
    s->momentum_buffer(get("momentum_buffer"));
    s->grad_avg(get("grad_avg"));
    return std::unique_ptr<optim::OptimizerParamState>(std::move(s));
  }
  if (type == "Adagrad") {
    auto s = std::make_unique<optim::AdagradParamState>();
    s->step(step);
    s->sum(get("sum"));
    return std::unique_ptr<optim::OptimizerParamState>(std::move(s));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer type '", type, "'"));
}

// A pickled value as JSON (the param_groups' options): numbers, bools,
// None, strings, lists and tuples of them.
absl::StatusOr<json> ToJson(const c10::IValue& v) {
  if (v.isDouble()) return json(v.toDouble());
  if (v.isInt()) return json(v.toInt());
  if (v.isBool()) return json(v.toBool());
  if (v.isNone()) return json(nullptr);
  if (v.isString()) return json(v.toStringRef());
  if (v.isTuple() || v.isList()) {
    json out = json::array();
    const auto elements =
        v.isTuple() ? v.toTupleRef().elements().vec() : v.toListRef().vec();
    for (const c10::IValue& e : elements) {
      auto j = ToJson(e);
      if (!j.ok()) return j.status();
      out.push_back(*std::move(j));
    }
    return out;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("param_groups: a value of type ", v.tagKind()));
}

// JSON as a pickled value: "betas" and other arrays become tuples, as
// PyTorch writes them; "params" a list of ints.
c10::IValue FromJson(const std::string& key, const json& j) {
  switch (j.type()) {
    case json::value_t::boolean:
      return j.get<bool>();
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return j.get<int64_t>();
    case json::value_t::number_float:
      return j.get<double>();
    case json::value_t::string:
      return j.get<std::string>();
    case json::value_t::array: {
      std::vector<c10::IValue> elements;
      for (const json& e : j) elements.push_back(FromJson("", e));
      if (key == "params") {
        // A plain list (a typed c10::List<int64_t> pickles as
        // torch.jit._pickle.build_intlist, which weights_only refuses).
        c10::impl::GenericList list(c10::AnyType::get());
        for (c10::IValue& e : elements) list.push_back(std::move(e));
        return list;
      }
      return c10::ivalue::Tuple::create(std::move(elements));
    }
    default:
      return c10::IValue();
  }
}

c10::impl::GenericDict TensorDict(const NamedTensors& tensors) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [k, t] : tensors) d.insert(k, t);
  return d;
}

// Each group's options as LibTorch's Optimizer::save archived them (as
// torch/optim/serialize.h lays them out), read through the options' own
// serialize; empty when the archive has none of that layout or an options
// type cannot read its own (a user's that never implemented it).
std::vector<std::unique_ptr<optim::OptimizerOptions>> SavedNativeOptions(
    torch::serialize::InputArchive& archive,
    const optim::Optimizer& optimizer) {
  std::vector<std::unique_ptr<optim::OptimizerOptions>> out;
  try {
    torch::serialize::InputArchive groups;
    if (!archive.try_read("param_groups", groups)) return {};
    for (size_t i = 0; i < optimizer.param_groups().size(); ++i) {
      const auto& group = optimizer.param_groups()[i];
      torch::serialize::InputArchive saved_group;
      torch::serialize::InputArchive saved_options;
      if (!groups.try_read("param_groups/" + std::to_string(i), saved_group) ||
          !saved_group.try_read("options", saved_options)) {
        return {};
      }
      if (!group.has_options()) {
        out.push_back(nullptr);
        continue;
      }
      std::unique_ptr<optim::OptimizerOptions> options =
          group.options().clone();
      options->serialize(saved_options);
      out.push_back(std::move(options));
    }
  } catch (const std::exception&) {
    return {};
  }
  return out;
}

}  // namespace

void LoadNativeOptimizer(torch::serialize::InputArchive& archive,
                         optim::Optimizer& optimizer) {
  auto options = SavedNativeOptions(archive, optimizer);
  optimizer.load(archive);
  // LibTorch 1.13's Optimizer::load leaves every group's options as they
  // were (2.x puts the saved ones back): put them back for both.
  auto& groups = optimizer.param_groups();
  for (size_t i = 0; i < options.size() && i < groups.size(); ++i) {
    if (options[i] != nullptr) groups[i].set_options(std::move(options[i]));
  }
}

OptimizerContent CaptureOptimizer(const std::string& name,
                                  const optim::Optimizer& optimizer) {
  OptimizerContent out;
  out.name = name;
  out.type = TypeOf(optimizer);
  const auto& state = optimizer.state();
  bool known = !out.type.empty();
  for (const auto& [key, s] : state) {
    if (StateTensors(*s).empty() &&
        dynamic_cast<const optim::SGDParamState*>(s.get()) == nullptr) {
      known = false;  // a user's state type in a known optimizer
    }
  }
  if (!known) {
    out.type.clear();
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    const std::string s = bytes.str();
    out.native = torch::empty({static_cast<int64_t>(s.size())}, torch::kUInt8);
    std::memcpy(out.native.data_ptr(), s.data(), s.size());
    return out;
  }
  int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    json g = group.has_options() ? GroupOptions(out.type, group.options())
                                 : json::object();
    json params = json::array();
    for (const at::Tensor& p : group.params()) {
      params.push_back(index);
      auto it = state.find(compat::OptimizerStateKey(p));
      if (it != state.end()) {
        NamedTensors tensors = StateTensors(*it->second);
        if (!tensors.empty()) out.state.emplace_back(index, std::move(tensors));
      }
      ++index;
    }
    g["params"] = std::move(params);
    out.param_groups.push_back(std::move(g));
  }
  return out;
}

absl::Status ApplyOptimizer(const OptimizerContent& saved,
                            optim::Optimizer& optimizer) {
  const std::string type = TypeOf(optimizer);
  const std::string what = absl::StrCat("optimizer '", saved.name, "'");
  if (saved.type.empty()) {
    if (!saved.native.defined()) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": neither a PyTorch file nor LibTorch's"));
    }
    try {
      torch::serialize::InputArchive archive;
      const at::Tensor bytes = saved.native.contiguous().to(torch::kCPU);
      archive.load_from(static_cast<const char*>(bytes.data_ptr()),
                        static_cast<size_t>(bytes.numel()));
      LoadNativeOptimizer(archive, optimizer);
    } catch (const std::exception& e) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " does not load: ", e.what()));
    }
    return absl::OkStatus();
  }
  if (saved.type != type) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " was saved as ", saved.type, ", this one is ",
                     type.empty() ? "of another type" : type));
  }
  auto& groups = optimizer.param_groups();
  if (saved.param_groups.size() != groups.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " was saved with ", saved.param_groups.size(),
                     " parameter groups, this one has ", groups.size()));
  }
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < groups.size(); ++i) {
    const json& g = saved.param_groups[i];
    const auto p = g.find("params");
    if (p == g.end() || !p->is_array() ||
        p->size() != groups[i].params().size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": group ", i, " was saved with another number of parameters"));
    }
    for (const at::Tensor& t : groups[i].params()) params.push_back(t);
  }
  // Check everything before changing anything.
  std::vector<std::unique_ptr<optim::OptimizerParamState>> made;
  for (const auto& [index, entries] : saved.state) {
    if (index < 0 || index >= static_cast<int64_t>(params.size())) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": state of parameter ", index, " of ", params.size()));
    }
    auto s = MakeState(type, entries, params[index],
                       absl::StrCat(what, ", parameter ", index));
    if (!s.ok()) return s.status();
    made.push_back(*std::move(s));
  }
  std::vector<std::unique_ptr<optim::OptimizerOptions>> options(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    if (!groups[i].has_options()) continue;
    options[i] = groups[i].options().clone();
    if (absl::Status s =
            SetGroupOptions(type, saved.param_groups[i], *options[i]);
        !s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ", group ", i, ": ", s.message()));
    }
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    if (options[i] != nullptr) groups[i].set_options(std::move(options[i]));
  }
  optimizer.state().clear();
  for (size_t i = 0; i < made.size(); ++i) {
    optimizer.state()[compat::OptimizerStateKey(params[saved.state[i].first])] =
        std::move(made[i]);
  }
  return absl::OkStatus();
}

c10::IValue OptimizerToIValue(const OptimizerContent& o) {
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  for (const auto& [index, tensors] : o.state) {
    state.insert(index, TensorDict(tensors));
  }
  c10::impl::GenericList groups(c10::AnyType::get());
  for (const json& g : o.param_groups) {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    for (auto it = g.begin(); it != g.end(); ++it) {
      d.insert(it.key(), FromJson(it.key(), it.value()));
    }
    groups.push_back(d);
  }
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("state", state);
  out.insert("param_groups", groups);
  return out;
}

absl::StatusOr<OptimizerContent> OptimizerFromIValue(const std::string& name,
                                                     const std::string& type,
                                                     const c10::IValue& value) {
  const std::string what = absl::StrCat("optimizer '", name, "'");
  if (!value.isGenericDict()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a dict"));
  }
  const auto dict = value.toGenericDict();
  if (!dict.contains("state") || !dict.contains("param_groups") ||
      !dict.at("state").isGenericDict() || !dict.at("param_groups").isList()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": no 'state' dict and 'param_groups' list"));
  }
  OptimizerContent out;
  out.name = name;
  out.type = type;
  for (const auto& entry : dict.at("state").toGenericDict()) {
    if (!entry.key().isInt() || !entry.value().isGenericDict()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": a state entry is not index -> dict"));
    }
    NamedTensors tensors;
    for (const auto& t : entry.value().toGenericDict()) {
      // PyTorch 2.x writes {"momentum_buffer": None} for SGD without
      // momentum: no tensor, nothing to keep.
      if (t.key().isString() && t.value().isNone()) continue;
      if (!t.key().isString() || !t.value().isTensor()) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": parameter ", entry.key().toInt(),
                         "'s state is not tensors"));
      }
      tensors.emplace_back(t.key().toStringRef(), t.value().toTensor());
    }
    out.state.emplace_back(entry.key().toInt(), std::move(tensors));
  }
  std::sort(out.state.begin(), out.state.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  const c10::IValue groups = dict.at("param_groups");
  for (const c10::IValue& g : groups.toListRef()) {
    if (!g.isGenericDict()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": a param group is not a dict"));
    }
    json group = json::object();
    for (const auto& option : g.toGenericDict()) {
      if (!option.key().isString()) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": a param group's key is not a string"));
      }
      auto j = ToJson(option.value());
      if (!j.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": ", j.status().message()));
      }
      group[option.key().toStringRef()] = *std::move(j);
    }
    out.param_groups.push_back(std::move(group));
  }
  return out;
}

}  // namespace concord::checkpoint

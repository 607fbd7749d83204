#include "tools/slowmo_flags.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "worker/slowmo/options.h"

namespace concord::train {
void AddSlowMoFlags(CLI::App& app, SlowMoFlags* f) {
  auto* g = app.add_option_group(
      "SlowMo", "fairscale's SlowMo: LocalSGD or SGP, with slow momentum");
  g->add_option("--algorithm", f->algorithm,
                "ddp (gradient allreduce every step); localsgd (parameter "
                "average every --localsgd-frequency steps, no gradient "
                "allreduce); slowmo-localsgd; slowmo-sgp (push-sum gossip "
                "every step, slow momentum every --slowmo-frequency)")
      ->check(
          CLI::IsMember({"ddp", "localsgd", "slowmo-localsgd", "slowmo-sgp"}));
  auto note = [f](const std::string& name) {
    return [f, name](const auto&) { f->given.push_back(name); };
  };
  // The defaults the help names are the struct's own.
  const concord::SlowMoOptions& d = f->options;
  auto yes_no = [](bool b) { return b ? "true" : "false"; };
  // CLI11 checks ranges itself; SlowMoOptionsFrom adds what depends on
  // several flags.
  g->add_option("--localsgd-frequency", f->options.localsgd_frequency(),
                absl::StrCat("LocalSGD: steps between parameter averages (",
                             d.localsgd_frequency(), ")"))
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->each(note("--localsgd-frequency"));
  g->add_option("--slowmo-frequency", f->options.slowmo_frequency(),
                absl::StrCat("steps between slow-momentum steps (",
                             d.slowmo_frequency(), ")"))
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->each(note("--slowmo-frequency"));
  g->add_option("--slowmo-momentum", f->options.slowmo_momentum(),
                absl::StrCat("slow momentum beta, in [0, 1) (",
                             d.slowmo_momentum(), ")"))
      ->check(CLI::Range(0.0, 1.0))
      ->each(note("--slowmo-momentum"));
  g->add_option("--slowmo-lr", f->options.slowmo_lr(),
                absl::StrCat("slow learning rate alpha (", d.slowmo_lr(), ")"))
      ->check(CLI::PositiveNumber)
      ->each(note("--slowmo-lr"));
  g->add_option("--slowmo-num-shards", f->options.slowmo_num_shards(),
                absl::StrCat("owners of the slow-momentum state, "
                             "memory-efficient mode (",
                             d.slowmo_num_shards(),
                             "; at most the world size are used)"))
      ->check(CLI::Range(1, 1 << 20))
      ->each(note("--slowmo-num-shards"));
  g->add_option("--slowmo-memory-efficient",
                f->options.slowmo_memory_efficient(),
                absl::StrCat("shard the slow-momentum state (true|false, "
                             "default ",
                             yes_no(d.slowmo_memory_efficient()), ")"))
      ->each(note("--slowmo-memory-efficient"));
  g->add_option("--nprocs-per-node", f->options.nprocs_per_node(),
                absl::StrCat("processes per node (", d.nprocs_per_node(),
                             "): > 1 averages gradients inside a node every "
                             "step and runs the algorithm between node "
                             "masters; nodes are the workers with one "
                             "CONCORD_NODE_ID (default: the hostname)"))
      ->check(CLI::Range(1, 1 << 10))
      ->each(note("--nprocs-per-node"));
  g->add_option("--sgp-graph", f->options.sgp_graph(),
                absl::StrCat("SGP's peer graph (", d.sgp_graph(),
                             "): npeer-directed-exponential, "
                             "directed-exponential, bipartite-exponential, "
                             "directed-linear, bipartite-linear, ring"))
      ->each(note("--sgp-graph"));
  g->add_option("--push-sum", f->options.push_sum(),
                absl::StrCat("SGP: push-sum (true) or push-pull (false); "
                             "default ",
                             yes_no(d.push_sum())))
      ->each(note("--push-sum"));
  g->add_option("--slowmo-sgp-average-params",
                f->options.slowmo_sgp_average_params(),
                absl::StrCat("SGP: average the parameters exactly at each "
                             "slow-momentum step (",
                             yes_no(d.slowmo_sgp_average_params()), ")"))
      ->each(note("--slowmo-sgp-average-params"));
}

absl::StatusOr<std::optional<concord::SlowMoOptions>> SlowMoOptionsFrom(
    const SlowMoFlags& f) {
  const bool ddp = f.algorithm == "ddp";
  const bool sgp = f.algorithm == "slowmo-sgp";
  const bool slow = f.algorithm == "slowmo-localsgd" || sgp;
  for (const std::string& name : f.given) {
    const bool sgp_only = name == "--sgp-graph" || name == "--push-sum" ||
                          name == "--slowmo-sgp-average-params";
    const bool slow_only = absl::StartsWith(name, "--slowmo-");
    if (ddp || (sgp_only && !sgp) || (slow_only && !sgp_only && !slow) ||
        (name == "--localsgd-frequency" && sgp)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " does not apply to --algorithm ", f.algorithm));
    }
  }
  if (ddp) return std::optional<concord::SlowMoOptions>();
  concord::SlowMoOptions o = f.options;
  o.base_algorithm(sgp ? concord::SlowMoBaseAlgorithm::kSgp
                       : concord::SlowMoBaseAlgorithm::kLocalSgd);
  // fairscale: slow momentum is off exactly when lr = 1 and momentum = 0.
  if (!slow) o.slowmo_momentum(0.0).slowmo_lr(1.0);
  // Checked as the library will (the graph's name, the values' ranges).
  if (absl::Status valid = slowmo::ValidateOptions(o); !valid.ok()) {
    return absl::Status(valid.code(), absl::StrCat("--algorithm ", f.algorithm,
                                                   ": ", valid.message()));
  }
  return std::optional<concord::SlowMoOptions>(o);
}

}  // namespace concord::train

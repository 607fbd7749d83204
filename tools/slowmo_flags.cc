#include "tools/slowmo_flags.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

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
  // CLI11 checks ranges itself; SlowMoOptionsFrom adds what depends on
  // several flags.
  g->add_option("--localsgd-frequency", f->localsgd_frequency,
                "LocalSGD: steps between parameter averages (3)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->each(note("--localsgd-frequency"));
  g->add_option("--slowmo-frequency", f->slowmo_frequency,
                "steps between slow-momentum steps (48)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->each(note("--slowmo-frequency"));
  g->add_option("--slowmo-momentum", f->slowmo_momentum,
                "slow momentum beta, in [0, 1) (0.5)")
      ->check(CLI::Range(0.0, 1.0))
      ->each(note("--slowmo-momentum"));
  g->add_option("--slowmo-lr", f->slowmo_lr, "slow learning rate alpha (1.0)")
      ->check(CLI::PositiveNumber)
      ->each(note("--slowmo-lr"));
  g->add_option("--slowmo-num-shards", f->slowmo_num_shards,
                "owners of the slow-momentum state, memory-efficient mode "
                "(32; at most the world size are used)")
      ->check(CLI::Range(1, 1 << 20))
      ->each(note("--slowmo-num-shards"));
  g->add_option("--slowmo-memory-efficient", f->slowmo_memory_efficient,
                "shard the slow-momentum state (true|false, default true)")
      ->each(note("--slowmo-memory-efficient"));
  g->add_option("--nprocs-per-node", f->nprocs_per_node,
                "processes per node (1): > 1 averages gradients inside a "
                "node every step and runs the algorithm between node "
                "masters; nodes are the workers with one CONCORD_NODE_ID "
                "(default: the hostname)")
      ->check(CLI::Range(1, 1 << 10))
      ->each(note("--nprocs-per-node"));
  g->add_option("--sgp-graph", f->sgp_graph,
                "SGP's peer graph: npeer-directed-exponential (default), "
                "directed-exponential, bipartite-exponential, "
                "directed-linear, bipartite-linear, ring")
      ->each(note("--sgp-graph"));
  g->add_option("--push-sum", f->push_sum,
                "SGP: push-sum (true, default) or push-pull (false)")
      ->each(note("--push-sum"));
  g->add_option("--slowmo-sgp-average-params", f->slowmo_sgp_average_params,
                "SGP: average the parameters exactly at each slow-momentum "
                "step (false)")
      ->each(note("--slowmo-sgp-average-params"));
}

absl::StatusOr<std::optional<slowmo::SlowMoOptions>> SlowMoOptionsFrom(
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
  if (ddp) return std::optional<slowmo::SlowMoOptions>();
  slowmo::SlowMoOptions o;
  o.base_algorithm =
      sgp ? slowmo::BaseAlgorithm::kSgp : slowmo::BaseAlgorithm::kLocalSgd;
  o.localsgd_frequency = f.localsgd_frequency;
  o.slowmo_frequency = f.slowmo_frequency;
  // fairscale: slow momentum is off exactly when lr = 1 and momentum = 0.
  o.slowmo_momentum = slow ? f.slowmo_momentum : 0.0;
  o.slowmo_lr = slow ? f.slowmo_lr : 1.0;
  o.slowmo_num_shards = f.slowmo_num_shards;
  o.slowmo_memory_efficient = f.slowmo_memory_efficient;
  o.nprocs_per_node = f.nprocs_per_node;
  o.push_sum = f.push_sum;
  o.slowmo_sgp_average_params = f.slowmo_sgp_average_params;
  auto graph = slowmo::ParseGraphType(f.sgp_graph);
  if (!graph.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sgp-graph: ", graph.status().message()));
  }
  o.graph = *graph;
  if (absl::Status s = slowmo::ValidateOptions(o); !s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("--algorithm ", f.algorithm, ": ", s.message()));
  }
  return std::optional<slowmo::SlowMoOptions>(o);
}

}  // namespace concord::train

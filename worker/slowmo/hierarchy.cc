#include "worker/slowmo/hierarchy.h"

#include <algorithm>
#include <map>

namespace concord::slowmo {

NodeLayout GroupNodes(const std::vector<std::string>& node_ids,
                      int nprocs_per_node) {
  const int k = nprocs_per_node < 1 ? 1 : nprocs_per_node;
  // Ranks by node id, in rank order; ids in the order of their lowest rank.
  std::map<std::string, size_t> id_index;
  std::vector<std::vector<int>> by_id;
  for (size_t r = 0; r < node_ids.size(); ++r) {
    auto [it, fresh] = id_index.emplace(node_ids[r], by_id.size());
    if (fresh) by_id.emplace_back();
    by_id[it->second].push_back(static_cast<int>(r));
  }
  NodeLayout layout;
  for (const auto& ranks : by_id) {
    for (size_t at = 0; at < ranks.size(); at += static_cast<size_t>(k)) {
      const size_t end = std::min(ranks.size(), at + static_cast<size_t>(k));
      layout.nodes.emplace_back(ranks.begin() + static_cast<long>(at),
                                ranks.begin() + static_cast<long>(end));
    }
  }
  // Order nodes by master (the first rank of each id's group is ascending,
  // but a later chunk of one id may come before another id's first).
  std::sort(layout.nodes.begin(), layout.nodes.end(),
            [](const auto& a, const auto& b) { return a[0] < b[0]; });
  layout.node_of.assign(node_ids.size(), 0);
  for (size_t n = 0; n < layout.nodes.size(); ++n) {
    layout.masters.push_back(layout.nodes[n][0]);
    for (int r : layout.nodes[n]) {
      layout.node_of[static_cast<size_t>(r)] = static_cast<int>(n);
    }
  }
  return layout;
}

}  // namespace concord::slowmo

#pragma once
// SlowMo's node hierarchy: fairscale's nprocs_per_node, made elastic.
//
// Note [Node hierarchy]
// ~~~~~~~~~~~~~~~~~~~~~
// With nprocs_per_node = k > 1 the ranks of a generation are grouped into
// nodes: the ranks whose workers report the same node id
// (WorkerOptions::node_id: the hostname unless CONCORD_NODE_ID says otherwise),
// in rank order, cut into groups of at most k (fairscale's node of k
// consecutive ranks when ids are absent is one id for everyone). A node's
// master is its lowest rank. Every step the gradients are averaged inside the
// node (one allreduce over the node's group, divided by its size); the base
// algorithm (LocalSGD averages, SGP gossip) and slow momentum run between
// masters only, over the masters' group, as if each node were one process
// (fairscale's logical ranks); the masters' result (parameters, and the
// push-sum weight) is then broadcast inside each node. The grouping is
// recomputed at every generation: a node that lost a process goes on with a
// smaller group (its average divides by what is left), a node whose master
// died gets the next-lowest rank as master, and a node id seen for the first
// time is a new node. With k = 1 every rank is its own node and master: no
// groups are made and SlowMo runs exactly as without a hierarchy.
//
// This part is torch-free: the grouping from every rank's node id.

#include <string>
#include <vector>

namespace concord::slowmo {

struct NodeLayout {
  // Ranks of each node, ascending; nodes ordered by their master.
  std::vector<std::vector<int>> nodes;
  // nodes[i][0], ascending: the masters' group.
  std::vector<int> masters;
  // For each rank, the index of its node.
  std::vector<int> node_of;
};

// `node_ids[r]`: rank r's node id. `nprocs_per_node` >= 1; with 1 every
// rank is a node of its own.
NodeLayout GroupNodes(const std::vector<std::string>& node_ids,
                      int nprocs_per_node);

}  // namespace concord::slowmo

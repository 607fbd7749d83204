#pragma once
// The anchor of concord-bench-coordinator's rendezvous: torchrun's c10d
// rendezvous pattern (torch.distributed.elastic's C10dRendezvousBackend) on
// LibTorch's own c10d::TCPStore, server and clients in one process
// (concord-bench-tcpstore; the coordinator's benchmark runs it).
//
// The pattern: the rendezvous state is one key; a node joins by reading it,
// adding itself and writing it back with compare_set, again on a conflict;
// the node that completes the set of participants marks the rendezvous
// complete; every node then reads the state once and finds its rank in it.
// (torchrun polls the state about once a second while it waits; here a
// node blocks on TCPStore's wait for the completion key instead, which can
// only make the anchor faster.)

#include <string>

namespace concord::bench {

struct TcpStoreRendezvous {
  bool ran = false;    // false: `error` says why
  double seconds = 0;  // first compare_set sent -> every node has its rank
  long long compare_sets = 0;  // including the ones that lost a race
  std::string error;
};

// `workers` nodes, each with its own TCPStore client (connection), driven by
// `threads` threads; gives up after `timeout_s` seconds.
TcpStoreRendezvous RunTcpStoreRendezvous(int workers, int threads,
                                         double timeout_s);

}  // namespace concord::bench

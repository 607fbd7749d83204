// concord-bench-tcpstore: the anchor of concord-bench-coordinator's
// rendezvous, in its own process (LibTorch stays out of the coordinator's
// benchmark, and the two share no descriptors or memory):
//
//   concord-bench-tcpstore --workers N [--threads 16] [--timeout-s 60]
//
// prints one line: "ok SECONDS COMPARE_SETS" or "error MESSAGE"; exit 0 when
// the rendezvous completed.
//
// The pattern: the rendezvous state is one key; a node joins by reading it,
// adding itself and writing it back with compare_set, again on a conflict;
// the node that completes the set of participants marks the rendezvous
// complete; every node then reads the state once and finds its rank in it.
// (torchrun polls the state about once a second while it waits; here a
// node blocks on TCPStore's wait for the completion key instead, which can
// only make the anchor faster.)

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

#include "descriptors.h"

namespace concord::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kState[] = "rdzv/state";
constexpr char kComplete[] = "rdzv/complete";

std::vector<uint8_t> Bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

struct TcpStoreRendezvous {
  bool ran = false;    // false: `error` says why
  double seconds = 0;  // first compare_set sent -> every node has its rank
  long long compare_sets = 0;  // including the ones that lost a race
  std::string error;
};

// `workers` nodes, each with its own TCPStore client (connection), driven by
// `threads` threads; gives up after `timeout_s` seconds.
TcpStoreRendezvous RunTcpStoreRendezvous(int workers, int threads,
                                         double timeout_s) {
  TcpStoreRendezvous result;
  const auto timeout =
      std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  const Clock::time_point give_up =
      Clock::now() + std::chrono::milliseconds(timeout);
  try {
    c10d::TCPStoreOptions server_options;
    server_options.port = 0;
    server_options.isServer = true;
    server_options.waitWorkers = false;
    server_options.timeout = timeout;
    auto server = std::make_unique<c10d::TCPStore>("127.0.0.1", server_options);
    // Each node's own connection, made before the clock starts (as the
    // Concord side's channels are).
    std::vector<std::unique_ptr<c10d::TCPStore>> nodes;
    nodes.reserve(static_cast<size_t>(workers));
    for (int i = 0; i < workers; ++i) {
      if (Clock::now() > give_up) {
        result.error = "timed out connecting the clients";
        return result;
      }
      c10d::TCPStoreOptions o;
      o.port = server->getPort();
      o.isServer = false;
      o.waitWorkers = false;
      o.timeout = timeout;
      nodes.push_back(std::make_unique<c10d::TCPStore>("127.0.0.1", o));
    }
    std::atomic<long long> compare_sets{0};
    std::atomic<bool> failed{false};
    std::string first_error;
    std::mutex error_mu;
    const Clock::time_point start = Clock::now();
    std::vector<std::thread> pool;
    const int t_count = std::max(1, std::min(threads, workers));
    for (int t = 0; t < t_count; ++t) {
      pool.emplace_back([&, t] {
        try {
          // Join: read-modify-compare_set until this node's write wins.
          for (int i = t; i < workers && !failed; i += t_count) {
            const std::string me = "node" + std::to_string(i) + "\n";
            std::vector<uint8_t> expected;  // empty: the key is not set yet
            for (;;) {
              if (Clock::now() > give_up) throw std::runtime_error("timed out");
              std::vector<uint8_t> desired = expected;
              desired.insert(desired.end(), me.begin(), me.end());
              ++compare_sets;
              std::vector<uint8_t> now =
                  nodes[static_cast<size_t>(i)]->compareSet(kState, expected,
                                                            desired);
              if (now == desired) {
                if (std::count(now.begin(), now.end(), '\n') == workers) {
                  nodes[static_cast<size_t>(i)]->set(kComplete, Bytes("1"));
                }
                break;
              }
              expected = std::move(now);
            }
          }
          // Wait for completion, then read the state and find the rank.
          for (int i = t; i < workers && !failed; i += t_count) {
            auto& node = *nodes[static_cast<size_t>(i)];
            node.wait({kComplete});
            const std::vector<uint8_t> state = node.get(kState);
            const std::string text(state.begin(), state.end());
            if (text.find("node" + std::to_string(i) + "\n") ==
                std::string::npos) {
              throw std::runtime_error("a node is missing from the state");
            }
          }
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(error_mu);
          if (!failed.exchange(true)) first_error = e.what();
        }
      });
    }
    for (auto& th : pool) th.join();
    result.seconds =
        std::chrono::duration<double>(Clock::now() - start).count();
    result.compare_sets = compare_sets;
    if (failed) {
      result.error = first_error.substr(0, first_error.find('\n'));
      return result;
    }
    result.ran = true;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    result.error = what.substr(0, what.find('\n'));
  }
  return result;
}

}  // namespace
}  // namespace concord::bench

int main(int argc, char** argv) {
  int workers = 1000, threads = 16;
  double timeout_s = 60;
  CLI::App app{"torchrun's c10d rendezvous on LibTorch's TCPStore",
               "concord-bench-tcpstore"};
  app.add_option("--workers", workers, "Nodes")
      ->required()
      ->check(CLI::Range(1, 100000));
  app.add_option("--threads", threads, "Threads driving the nodes")
      ->check(CLI::Range(1, 256));
  app.add_option("--timeout-s", timeout_s, "Give up after this long")
      ->check(CLI::Range(1.0, 3600.0));
  CLI11_PARSE(app, argc, argv);
  // A node's connections (LibTorch 1.13: a client and a callback client)
  // and the server's ends of them, all in this process, about 5 a node
  // (3,000 nodes pass under 20,000, 4,000 do not): past the limit
  // TCPStore's server thread dies of EMFILE (std::terminate), so say so
  // instead.
  const rlim_t descriptors = concord::bench::RaiseDescriptorLimit();
  const rlim_t needed = 6 * static_cast<rlim_t>(workers) + 256;
  concord::bench::TcpStoreRendezvous r;
  if (needed > descriptors) {
    r.error = "needs about " + std::to_string(needed) +
              " descriptors, the limit here is " + std::to_string(descriptors);
  } else {
    r = concord::bench::RunTcpStoreRendezvous(workers, threads, timeout_s);
  }
  if (r.ran) {
    std::printf("ok %.6f %lld\n", r.seconds, r.compare_sets);
  } else {
    std::printf("error %s\n", r.error.c_str());
  }
  return r.ran ? 0 : 1;
}

#pragma once
// Ranks as threads: N Gloo communicators on loopback that rendezvous through
// one in-memory store (Gloo's BaseTest::spawn).

#include <gtest/gtest.h>

#include <condition_variable>
#include <csignal>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/store.h"

namespace concord::testing {

// Connects `world` communicators (in parallel, as rendezvous requires) and
// runs `body(rank, comm)` on one thread per rank once every rank is
// connected (a rank whose body returns at once must not close its pairs
// while a peer is still connecting to it).
inline void RunRanks(
    int world,
    const std::function<void(int, std::shared_ptr<comm::Communicator>)>& body,
    absl::Duration connect_timeout = absl::Seconds(30),
    bool shared_memory = false) {
  // As Session::Start does for a worker: a peer that went away must fail
  // the write with EPIPE, not kill the test with SIGPIPE (a rank whose body
  // returns at once closes its pairs while the others may still send).
  std::signal(SIGPIPE, SIG_IGN);
  comm::InMemoryStore store;
  std::mutex mu;
  std::condition_variable cv;
  int connected = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      comm::GlooOptions options;
      options.rank = r;
      options.size = world;
      options.generation = 1;
      options.connect_timeout = connect_timeout;
      options.shared_memory = shared_memory;
      auto comm = comm::GlooCommunicator::Create(options, &store);
      {
        std::unique_lock<std::mutex> lock(mu);
        ++connected;
        cv.notify_all();
        cv.wait(lock, [&] { return connected == world; });
      }
      ASSERT_TRUE(comm.ok()) << comm.status();
      body(r, std::shared_ptr<comm::Communicator>(std::move(*comm)));
    });
  }
  for (auto& t : threads) t.join();
}

// Rank `rank` of the next generation `generation` of `size` ranks (a
// re-form's survivors, or new processes), over its own store; null (a test
// failure recorded) when it cannot connect.
inline std::shared_ptr<comm::Communicator> NextGeneration(
    comm::InMemoryStore& store, int rank, int size, int64_t generation) {
  comm::GlooOptions options;
  options.rank = rank;
  options.size = size;
  options.generation = generation;
  auto made = comm::GlooCommunicator::Create(options, &store);
  EXPECT_TRUE(made.ok()) << made.status();
  if (!made.ok()) return nullptr;
  return std::shared_ptr<comm::Communicator>(std::move(*made));
}

}  // namespace concord::testing

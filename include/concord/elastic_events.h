#pragma once
// What the elastic loop tells a program about re-forms (concord/elastic.h):
// the reset callback's ResetInfo and the re-form log's ReformRecord. The
// library's elastic state (worker/elastic/state.h) produces these very
// structs. No LibTorch here.

#include <cstdint>
#include <string>

namespace concord {

// One re-form: why, what it formed, and when (Unix microseconds).
struct ReformRecord {
  std::string reason;
  int64_t generation = 0;  // the one formed
  int world_size = 0;
  int64_t started_us = 0;     // the failure was caught / agreement reached
  int64_t rendezvous_us = 0;  // the next generation formed and connected
  int64_t synced_us = 0;      // model and state received: training resumes
};

// What a reset callback learns after a re-form.
struct ResetInfo {
  int64_t generation = 0;
  int rank = 0;
  int world_size = 0;
  int previous_world_size = 0;
  // The rank whose model and state the others received.
  int authoritative_rank = 0;
  int64_t step = 0;  // the committed step training goes on from
  std::string reason;
};

}  // namespace concord

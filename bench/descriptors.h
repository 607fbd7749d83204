#pragma once
// The benchmarks open a descriptor per simulated connection on each side.

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>

namespace concord::bench {

// Raises this process's descriptor limit as far as it may go (the hard
// limit; for root, the kernel's fs.nr_open) and returns the new soft limit.
inline rlim_t RaiseDescriptorLimit() {
  rlimit limit{};
  getrlimit(RLIMIT_NOFILE, &limit);
  rlim_t ceiling = limit.rlim_max;
  if (FILE* f = std::fopen("/proc/sys/fs/nr_open", "r")) {
    unsigned long long nr_open = 0;
    if (std::fscanf(f, "%llu", &nr_open) == 1) {
      ceiling = std::max<rlim_t>(ceiling, static_cast<rlim_t>(nr_open));
    }
    std::fclose(f);
  }
  rlimit wanted{ceiling, ceiling};
  if (setrlimit(RLIMIT_NOFILE, &wanted) != 0) {  // not root: the hard limit
    wanted = {limit.rlim_max, limit.rlim_max};
    setrlimit(RLIMIT_NOFILE, &wanted);
  }
  getrlimit(RLIMIT_NOFILE, &limit);
  return limit.rlim_cur;
}

}  // namespace concord::bench

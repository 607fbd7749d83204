#pragma once
// Gradient sizes the benchmarks share.

#include <cstdint>
#include <vector>

namespace concord::bench {

// The parameter sizes of a ResNet-50-like model: 161 tensors, 25.6 M floats.
inline std::vector<int64_t> ResNet50Like() {
  // Conv/BN shapes of ResNet-50, condensed: many small tensors, some large.
  std::vector<int64_t> sizes = {9408, 64, 64};
  const int64_t widths[] = {64, 128, 256, 512};
  const int blocks[] = {3, 4, 6, 3};
  int64_t in = 64;
  for (int stage = 0; stage < 4; ++stage) {
    const int64_t w = widths[stage];
    for (int b = 0; b < blocks[stage]; ++b) {
      for (int64_t s :
           {in * w, w, w, w * w * 9, w, w, w * 4 * w, 4 * w, 4 * w}) {
        sizes.push_back(s);
      }
      if (b == 0) {
        for (int64_t s : {in * 4 * w, 4 * w, 4 * w}) sizes.push_back(s);
      }
      in = 4 * w;
    }
  }
  sizes.push_back(2048 * 1000);
  sizes.push_back(1000);
  return sizes;
}

}  // namespace concord::bench

#include "kernels/scale.h"

namespace concord::kernels {

void ScaleCpu(float* data, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) data[i] *= factor;
}

}  // namespace concord::kernels

// libFuzzer entry point of the core's fuzz target (CONCORD_BUILD_FUZZ=ON,
// clang): concord-fuzz-core [CORPUS_DIR...] [-max_total_time=S].

#include <cstddef>
#include <cstdint>

#include "tests/coordinator/fuzz/core_fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  concord::coordinator::fuzz::RunOneInput(data, size);
  return 0;
}

#pragma once
// The coordinator core's fuzz target (see Note [Core fuzzing] in core_fuzz.cc).
// Built two ways: as a libFuzzer binary with clang (CONCORD_BUILD_FUZZ=ON,
// core_fuzz_libfuzzer.cc) and as a plain replay driver that any compiler
// builds and ctest runs (core_fuzz_replay.cc).

#include <cstddef>
#include <cstdint>

namespace concord::coordinator::fuzz {

// Runs one input through a fresh Core with a FakeClock and checks the
// invariants; a broken invariant aborts the process with a message on
// stderr (what a fuzzer reports as a crash). Returns the highest generation
// any job reached (how deep the input got).
int64_t RunOneInput(const uint8_t* data, size_t size);

}  // namespace concord::coordinator::fuzz

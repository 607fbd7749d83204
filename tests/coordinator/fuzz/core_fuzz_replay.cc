// Runs the core's fuzz target without libFuzzer, with any compiler: over
// every file named (or found in a directory named), then over random inputs.
//
//   coordinator_core_fuzz_replay [--iterations N] [--seed S] [--max-len L]
//                                [--min-generation G] [PATH...]
//
// Exits 0 when every input ran (a broken invariant aborts), 1 when no input
// reached generation G (the harness no longer gets deep), 2 for bad flags.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "tests/coordinator/fuzz/core_fuzz.h"

namespace {

int64_t RunFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  const std::vector<uint8_t> data((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
  return concord::coordinator::fuzz::RunOneInput(data.data(), data.size());
}

bool ParseInt(const char* text, int64_t* out) {
  char* end = nullptr;
  *out = std::strtoll(text, &end, 10);
  return end != text && *end == '\0' && *out >= 0;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t iterations = 1000, seed = 1, max_len = 2048, min_generation = 0;
  std::vector<std::filesystem::path> paths;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    int64_t* target = arg == "--iterations"       ? &iterations
                      : arg == "--seed"           ? &seed
                      : arg == "--max-len"        ? &max_len
                      : arg == "--min-generation" ? &min_generation
                                                  : nullptr;
    if (target != nullptr) {
      if (i + 1 >= argc || !ParseInt(argv[++i], target)) {
        std::fprintf(stderr, "core_fuzz_replay: %s needs a number >= 0\n",
                     arg.c_str());
        return 2;
      }
    } else {
      paths.emplace_back(arg);
    }
  }
  int64_t files = 0, deepest = 0;
  for (const auto& path : paths) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
      for (const auto& entry : std::filesystem::directory_iterator(path)) {
        if (!entry.is_regular_file()) continue;
        deepest = std::max(deepest, RunFile(entry.path()));
        ++files;
      }
    } else if (std::filesystem::is_regular_file(path, ec)) {
      deepest = std::max(deepest, RunFile(path));
      ++files;
    } else {
      std::fprintf(stderr, "core_fuzz_replay: no such file or directory: %s\n",
                   path.c_str());
      return 2;
    }
  }
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  std::vector<uint8_t> data;
  for (int64_t i = 0; i < iterations; ++i) {
    data.resize(rng() % static_cast<uint64_t>(max_len + 1));
    for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
    deepest = std::max(deepest, concord::coordinator::fuzz::RunOneInput(
                                    data.data(), data.size()));
  }
  std::printf(
      "core_fuzz_replay: %lld files, %lld random inputs, highest "
      "generation reached %lld\n",
      static_cast<long long>(files), static_cast<long long>(iterations),
      static_cast<long long>(deepest));
  if (deepest < min_generation) {
    std::fprintf(stderr, "core_fuzz_replay: no input reached generation %lld\n",
                 static_cast<long long>(min_generation));
    return 1;
  }
  return 0;
}

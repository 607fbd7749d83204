// Kept free of LibTorch headers: the training code lives in a library that
// shares the worker's precompiled header (executables are built -fPIE, the
// header -fPIC).
#include "common/crash_trace.h"

int ConcordTrainMain(int argc, char** argv);

int main(int argc, char** argv) {
  concord::InstallCrashTraces("concord-train", argv[0]);
  return ConcordTrainMain(argc, argv);
}

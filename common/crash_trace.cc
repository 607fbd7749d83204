#include "common/crash_trace.h"

#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "absl/debugging/symbolize.h"

namespace concord {
namespace {

const char* tool_name = "";

struct FatalSignal {
  int number;
  const char* name;
};
constexpr FatalSignal kFatalSignals[] = {{SIGSEGV, "SIGSEGV"},
                                         {SIGBUS, "SIGBUS"},
                                         {SIGILL, "SIGILL"},
                                         {SIGFPE, "SIGFPE"},
                                         {SIGABRT, "SIGABRT"}};

// What follows runs in a signal handler: write(2) and stack buffers only.
void Put(const char* text) {
  size_t left = std::strlen(text);
  while (left > 0) {
    const ssize_t n = write(STDERR_FILENO, text, left);
    if (n <= 0) return;
    text += n;
    left -= static_cast<size_t>(n);
  }
}

// `value` in base `base` (10 or 16) into `out` (at least 24 bytes).
const char* Digits(uint64_t value, unsigned base, char* out) {
  char* p = out + 23;
  *p = '\0';
  do {
    *--p = "0123456789abcdef"[value % base];
    value /= base;
  } while (value != 0);
  return p;
}

void OnFatalSignal(int number, siginfo_t*, void*) {
  // A fault inside the handler ends the process with the default action.
  signal(number, SIG_DFL);
  const char* name = "a fatal signal";
  for (const FatalSignal& s : kFatalSignals) {
    if (s.number == number) name = s.name;
  }
  char digits[24];
  Put("*** ");
  Put(tool_name);
  Put(": ");
  Put(name);
  Put(" in thread ");
  Put(Digits(static_cast<uint64_t>(syscall(SYS_gettid)), 10, digits));
  Put("; its stack:\n");
  void* frames[64];
  const int depth = backtrace(frames, 64);
  char symbol[512];
  for (int i = 0; i < depth; ++i) {
    Put("    @ 0x");
    Put(Digits(reinterpret_cast<uintptr_t>(frames[i]), 16, digits));
    Put("  ");
    // The return address is one past the call: symbolize the call.
    const char* pc = static_cast<const char*>(frames[i]) - (i > 0 ? 1 : 0);
    Put(absl::Symbolize(pc, symbol, sizeof(symbol)) ? symbol : "(unknown)");
    Put("\n");
  }
  raise(number);
}

}  // namespace

void InstallCrashTraces(const char* name, const char* argv0) {
  tool_name = name;
  absl::InitializeSymbolizer(argv0);
  // glibc's unwinder (DWARF call frames: no frame pointers needed) loads
  // libgcc_s at its first use, which a signal handler must not do.
  void* warm[1];
  backtrace(warm, 1);
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  sigemptyset(&action.sa_mask);
  action.sa_sigaction = OnFatalSignal;
  action.sa_flags = SA_SIGINFO;
  for (const FatalSignal& s : kFatalSignals) {
    sigaction(s.number, &action, nullptr);
  }
}

}  // namespace concord

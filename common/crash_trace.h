#pragma once
// A stack trace on standard error when a tool dies of a fatal signal.
//
// Note [Crash traces]
// ~~~~~~~~~~~~~~~~~~~
// concord-run, concord-train and concord-coordinator install, from main,
// handlers for SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT (an assertion in
// gRPC or LibTorch ends in abort()). The handler writes one line naming the
// tool, the signal and the thread, then the symbolized frames of that thread
// (glibc's unwinder, warmed up at install, and absl's async-signal-safe
// symbolizer), restores the
// default action and raises the signal again: the exit status (128 + N, or
// "killed by signal N" to a parent) and a core dump, where enabled, are the
// ones the signal would have given. SIGTERM and SIGINT are not touched: the
// tools handle those themselves. Libraries never install this: a training
// program owns its signal handlers.

namespace concord {

// Installs the handlers; `name` (kept, not copied) names the tool in the
// trace, `argv0` finds the symbols. Once per process, from main.
void InstallCrashTraces(const char* name, const char* argv0);

}  // namespace concord

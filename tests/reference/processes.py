"""Running Concord's tools from the tests: a command in its own process
group with a timeout (CommandResult), a process's children, the newest
checkpoint's step, and configuring an example against an installed prefix.
Standard library only (no torch), so that a test that runs tools only
imports nothing heavy."""

import os
import re
import shutil
import signal
import subprocess
import time


class CommandResult(object):
    def __init__(self, cmd, returncode, stdout, stderr, elapsed, timed_out):
        self.cmd = cmd
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.elapsed = elapsed
        self.timed_out = timed_out

    def describe(self, tail=4000):
        def cut(s):
            return s if len(s) <= tail else "...(%d chars cut)...\n%s" % (len(s) - tail, s[-tail:])
        status = "TIMED OUT after %.1fs" % self.elapsed if self.timed_out else \
            "exit status %s after %.1fs" % (self.returncode, self.elapsed)
        return "command: %s\n%s\n--- stdout ---\n%s\n--- stderr ---\n%s" % (
            " ".join(self.cmd), status, cut(self.stdout), cut(self.stderr))


def run_command(cmd, timeout, env=None, cwd=None):
    """Run cmd in its own process group; on timeout kill that whole group (so
    worker processes started by concord-run or torch.multiprocessing do not
    outlive the test). Returns a CommandResult."""
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    if env:
        full_env.update(env)
    start = time.monotonic()
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=full_env, cwd=cwd,
                            start_new_session=True, universal_newlines=True,
                            errors="replace")
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        out, err = proc.communicate()
    leftover = False
    if not timed_out:
        # Leftovers of a finished run (e.g. a worker its launcher forgot):
        # note them and end them.
        try:
            os.killpg(proc.pid, 0)
            leftover = True
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    result = CommandResult([str(c) for c in cmd], proc.returncode, out, err,
                           time.monotonic() - start, timed_out)
    result.leftover_processes = leftover
    return result


def latest_checkpoint_step(ck, job):
    """The step DIR/<job>/latest names (README "Checkpoints"); -1 when there
    is none yet."""
    try:
        with open(os.path.join(ck, job, "latest")) as f:
            m = re.match(r"step-(\d+)\n$", f.read())
        return int(m.group(1)) if m else -1
    except OSError:
        return -1


def children(pid):
    """Child pids of pid (from /proc)."""
    kids = []
    try:
        for task in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/children" % (pid, task)) as f:
                kids += [int(x) for x in f.read().split()]
        return kids
    except OSError:
        pass
    for entry in os.listdir("/proc"):  # no /proc/*/children: scan ppids
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                kids.append(int(entry))
        except (OSError, IndexError, ValueError):
            pass
    return kids


def local_worker(launcher_pid, local_rank):
    """The pid of the launcher's worker with CONCORD_LOCAL_RANK=local_rank
    (None when it has none)."""
    want = b"CONCORD_LOCAL_RANK=%d" % local_rank
    for kid in children(launcher_pid):
        try:
            with open("/proc/%d/environ" % kid, "rb") as f:
                if want in f.read().split(b"\0"):
                    return kid
        except OSError:
            pass
    return None


def cmake_cache_value(build_dir, key):
    """A value of BUILD/CMakeCache.txt ("" when absent)."""
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return ""


def example_configure(cmake, build_dir, src, out, prefix):
    """The command that configures an example project in `src` into `out`
    against the installed prefix alone, as a user would, with warnings as
    errors and the compiler Concord was built with. Clears the variables
    that could point CMake or the compiler elsewhere from this process's
    environment (run_command passes it on)."""
    for var in ["CMAKE_PREFIX_PATH", "Concord_DIR", "Concord_ROOT", "CPATH",
                "CPLUS_INCLUDE_PATH", "LIBRARY_PATH"]:
        os.environ.pop(var, None)
    configure = [cmake, "-S", src, "-B", out,
                 "-DCMAKE_PREFIX_PATH=" + prefix,
                 "-DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON",
                 "-DCMAKE_BUILD_TYPE=Release",
                 "-DCMAKE_CXX_FLAGS=-Wall -Wextra -Werror"]
    # The compiler Concord was built with, and the LibTorch (and, for a
    # CUDA LibTorch, the CUDA compiler) it was built against: a user names
    # their LibTorch the same way (-DTorch_DIR, or CMAKE_PREFIX_PATH).
    for var in ["CMAKE_CXX_COMPILER", "Torch_DIR", "CMAKE_CUDA_COMPILER",
                "CMAKE_CUDA_ARCHITECTURES"]:
        value = cmake_cache_value(build_dir, var)
        if value:
            configure.append("-D%s=%s" % (var, value))
    # The build's ccache launcher (scripts/build.sh: `env;CCACHE_...;ccache`)
    # with the example's folder as the base, so that a fresh temporary
    # folder hits what an earlier run compiled.
    launcher = cmake_cache_value(build_dir, "CMAKE_CXX_COMPILER_LAUNCHER")
    if launcher and launcher.endswith("ccache"):
        base = os.path.dirname(os.path.abspath(src))
        launcher = ";".join("CCACHE_BASEDIR=" + base
                            if w.startswith("CCACHE_BASEDIR=") else w
                            for w in launcher.split(";"))
        configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=" + launcher)
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    return configure

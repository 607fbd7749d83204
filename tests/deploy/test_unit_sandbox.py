#!/usr/bin/python3
"""Would the unit's sandbox let the coordinator run? Without systemd as PID 1
the unit cannot be started here, so the real binary runs under strace through
a session like the unit's (state directory, metrics and health ports,
NOTIFY_SOCKET with the watchdog, an operator RPC with concordctl, SIGTERM),
and what it did is checked against the unit's settings:

  - SystemCallFilter=@system-service, ~@privileged @resources: every system
    call made is in the set systemd-analyze expands those groups to;
  - MemoryDenyWriteExecute=yes: no mmap with PROT_WRITE|PROT_EXEC, no
    mprotect/pkey_mprotect adding PROT_EXEC, no shmat (systemd's filter);
  - RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX: every socket() family;
  - CapabilityBoundingSet= (empty), DynamicUser: it ran as an ordinary user
    would need (no setuid/capset/chown calls, covered by the filter above).

The filter and the families are read from deploy/systemd/concord-coordinator.service
itself, so tightening the unit beyond what the coordinator needs fails here.
Checks that the check can fail: the expanded set excludes mount, reboot,
setuid and setrlimit.

    /usr/bin/python3 tests/deploy/test_unit_sandbox.py --bin-dir build/bin
"""

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testlib import Checks, free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNIT = os.path.join(ROOT, "deploy", "systemd", "concord-coordinator.service")


def unit_values(key):
    values = []
    for line in open(UNIT):
        line = line.strip()
        if line.startswith(key + "="):
            values.append(line.split("=", 1)[1])
    return values


def expand(group, seen=None):
    """The system calls of a systemd syscall group, nested groups expanded."""
    seen = set() if seen is None else seen
    if group in seen:
        return set()
    seen.add(group)
    out = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager", group],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30,
                         universal_newlines=True, check=True).stdout
    calls = set()
    for line in out.splitlines()[1:]:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("@"):
            calls |= expand(line, seen)
        else:
            calls.add(line)
    return calls


def allowed_syscalls():
    """The set the unit's SystemCallFilter= lines allow (allow lists are
    unioned, then the ~ lists removed, as systemd does)."""
    allow, deny = set(), set()
    for value in unit_values("SystemCallFilter"):
        negate = value.startswith("~")
        for item in value.lstrip("~").split():
            calls = expand(item) if item.startswith("@") else {item}
            (deny if negate else allow).update(calls)
    return allow - deny


SYSCALL = re.compile(r"^\d+\s+(?:<\.\.\. )?([a-z0-9_]+)(?:\(| resumed>)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    args = parser.parse_args()
    c = Checks()
    for tool in ("strace", "systemd-analyze"):
        if shutil.which(tool) is None:
            c.check(False, "%s installed (scripts/install-deps.sh)" % tool)
            print("%d passed, %d failed" % (c.passed, c.failed))
            sys.exit(1)
    probe = subprocess.run(["strace", "-qq", "-o", os.devnull, "true"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=30, universal_newlines=True)
    if probe.returncode != 0:
        # A container without ptrace: say so and let ctest report a skip.
        print("SKIP: strace cannot trace here: " + probe.stdout.strip().splitlines()[-1:][0]
              if probe.stdout.strip() else "SKIP: strace cannot trace here")
        sys.exit(77)
    allowed = allowed_syscalls()
    c.check(len(allowed) > 100 and not ({"mount", "reboot", "setuid", "setrlimit"} & allowed),
            "the unit's SystemCallFilter= expands to a set without mount, reboot, setuid, setrlimit",
            "%d calls allowed" % len(allowed))

    d = tempfile.mkdtemp(prefix="concord-sandbox-")
    try:
        tokens = {}
        for role, value in (("worker", "w" * 24), ("operator", "o" * 24)):
            tokens[role] = os.path.join(d, role + ".token")
            with open(tokens[role], "w") as f:
                f.write(value + "\n")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(os.path.join(d, "notify"))
        notify.settimeout(30)
        port, metrics, health = free_port(), free_port(), free_port()
        trace = os.path.join(d, "strace.txt")
        env = dict(os.environ, NOTIFY_SOCKET=os.path.join(d, "notify"), WATCHDOG_USEC="400000")
        env.pop("WATCHDOG_PID", None)
        log = open(os.path.join(d, "coordinator.log"), "w")
        proc = subprocess.Popen(
            ["strace", "-f", "-qq", "-o", trace, "-e", "signal=none",
             os.path.join(args.bin_dir, "concord-coordinator"),
             "--listen", "127.0.0.1:%d" % port, "--state-dir", os.path.join(d, "state"),
             "--worker-token-file", tokens["worker"], "--operator-token-file", tokens["operator"],
             "--metrics-listen", "127.0.0.1:%d" % metrics,
             "--health-listen", "127.0.0.1:%d" % health],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            ready = False
            deadline = time.monotonic() + 60
            while not ready and time.monotonic() < deadline:
                try:
                    ready = b"READY=1" in notify.recv(4096)
                except socket.timeout:
                    break
            c.check(ready, "the traced coordinator sent READY=1")
            time.sleep(1.0)  # a few watchdog pings and ticks
            ctl = subprocess.run([os.path.join(args.bin_dir, "concordctl"), "--endpoint",
                                  "127.0.0.1:%d" % port, "--token-file", tokens["operator"],
                                  "-o", "json", "jobs"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, timeout=30, universal_newlines=True)
            c.check(ctl.returncode == 0 and '"jobs"' in ctl.stdout,
                    "an operator RPC (concordctl jobs) answered", ctl.stdout.strip()[:200])
            for what, p in (("health", health), ("metrics", metrics)):
                path = "/metrics" if what == "metrics" else "/"
                try:
                    body = urllib.request.urlopen("http://127.0.0.1:%d%s" % (p, path),
                                                  timeout=10).read()
                    ok = len(body) > 0
                except OSError as e:
                    ok, body = False, str(e).encode()
                c.check(ok, "the %s port answered" % what, body[:60].decode("utf-8", "replace"))
        finally:
            # SIGTERM to the coordinator itself (strace's child), not strace.
            try:
                with open("/proc/%d/task/%d/children" % (proc.pid, proc.pid)) as f:
                    children = [int(x) for x in f.read().split()]
            except OSError:
                children = []
            for child in children:
                os.kill(child, signal.SIGTERM)
            if not children:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            notify.close()
        c.check(code == 0, "the traced coordinator exited 0 on SIGTERM", str(code))

        used, wx, families = set(), [], set()
        for line in open(trace):
            m = SYSCALL.match(line)
            if m:
                used.add(m.group(1))
            if re.search(r"\b(mmap|mmap2)\(.*PROT_WRITE\|PROT_EXEC|\b(mmap|mmap2)\(.*PROT_EXEC\|"
                         r"PROT_WRITE", line) or re.search(
                             r"\b(pkey_)?mprotect\([^,]*, [^,]*, [^)]*PROT_EXEC", line) or re.search(
                             r"\bshmat\(", line):
                wx.append(line.strip())
            s = re.search(r"\bsocket\((AF_[A-Z0-9]+)", line)
            if s:
                families.add(s.group(1))
        c.check(len(used) > 20, "strace recorded the coordinator's system calls",
                "%d distinct" % len(used))
        outside = sorted(used - allowed)
        c.check(not outside, "every system call is allowed by the unit's SystemCallFilter=",
                "outside: %s" % outside)
        c.check(not wx, "no writable+executable mapping or PROT_EXEC mprotect "
                "(MemoryDenyWriteExecute=yes)", "; ".join(wx[:3]))
        permitted = set(" ".join(unit_values("RestrictAddressFamilies")).split())
        c.check(families and families <= permitted,
                "socket() families within RestrictAddressFamilies=",
                "used %s, permitted %s" % (sorted(families), sorted(permitted)))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print("%d passed, %d failed" % (c.passed, c.failed))
    sys.exit(1 if c.failed else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""The systemd units in deploy/systemd, checked offline with systemd-analyze.

    /usr/bin/python3 tests/deploy/test_systemd_units.py --bin-dir build/bin [--threshold 2.0]

For every deploy/systemd/*.service:
  - `systemd-analyze security --offline=true --threshold=N` exits 0 and the
    overall exposure it prints is at most N;
  - `systemd-analyze verify` of a copy whose ExecStart names the built
    binary (the installed path does not exist here) prints no diagnostic;
  - its ExecStart= runs: the real binary with the unit's arguments (%d
    mapped to a directory with tokens and openssl-made PEM files, %S to a
    temporary one, every address onto a free loopback port) and
    NOTIFY_SOCKET; the embedded-store unit sends READY=1 and serves, then
    STOPPING=1 and exit 0 on SIGTERM; the etcd unit gets past its flags and
    credentials to "cannot reach etcd" (exit 2: no etcd at the mapped port);
  - Type=notify, WatchdogSec=, NotifyAccess=main; every %d/NAME the command
    line reads is a LoadCredential= of the unit; DynamicUser=yes and an empty
    CapabilityBoundingSet=.
And that the checks can fail: the unit without its hardening lines is rated
above the threshold, and a copy with an unknown key and a bad value gets
verify diagnostics.

Prints one line per check and 'N passed, N failed'; exits 1 on any failure.
"""

import argparse
import glob
import os
import re
import shlex
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testlib import Checks, free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARDENING = ("DynamicUser", "CapabilityBoundingSet", "NoNewPrivileges", "Protect", "Private",
             "Restrict", "SystemCall", "MemoryDenyWriteExecute", "LockPersonality", "IPAddress",
             "UMask", "DevicePolicy", "ProcSubset", "RemoveIPC", "User=")


def run(args):
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60,
                       universal_newlines=True)
    return p.returncode, p.stdout, p.stderr


def exposure(path, threshold):
    """(exit status, overall exposure or None). --threshold counts in tenths
    of the printed exposure (0-100 for 0.0-10.0)."""
    code, out, err = run(["systemd-analyze", "security", "--offline=true",
                          "--threshold=%d" % round(threshold * 10), "--no-pager", path])
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out + err)
    return code, (float(m.group(1)) if m else None), out + err


def verify(path):
    """Diagnostics systemd-analyze verify prints about the unit (it exits 0
    for unknown keys and bad values, so its output is what counts)."""
    code, out, err = run(["systemd-analyze", "verify", "--man=no", path])
    # Lines about this unit (they name it); not the host's own units.
    name = os.path.basename(path)
    lines = [l for l in (out + err).splitlines() if name in l]
    return code, lines


def directives(text):
    """{key: [values]} of a unit, continuation lines joined."""
    text = re.sub(r"\\\n", " ", text)
    result = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;[" or "=" not in line:
            continue
        k, v = line.split("=", 1)
        result.setdefault(k.strip(), []).append(v.strip())
    return result


def run_exec_start(c, name, text, bin_dir, scratch):
    command = shlex.split(re.sub(r"\\\n", " ", directives_raw(text, "ExecStart")))
    d = tempfile.mkdtemp(prefix="run-", dir=scratch)
    creds, state = os.path.join(d, "credentials"), os.path.join(d, "state")
    os.makedirs(creds)
    ports = {}

    def mapped(arg):
        arg = arg.replace("%d", creds).replace("%S", state)
        return re.sub(r"\b\d+\.\d+\.\d+\.\d+:\d+\b",
                      lambda m: "127.0.0.1:%d" % ports.setdefault(m.group(0), free_port()), arg)

    args = [mapped(a) for a in command[1:]]
    # What systemd would provide: the StateDirectory= under %S, credentials.
    for sub in directives(text).get("StateDirectory", []):
        os.makedirs(os.path.join(state, sub), mode=0o700)
    files = set(re.findall(re.escape(creds) + r"/([A-Za-z0-9._-]+)", " ".join(args)))
    cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
    if any(not f.endswith("token") for f in files):
        # One self-signed pair serves as every certificate, CA and key.
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj", "/CN=t",
                        "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                       check=True, timeout=60, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for f in files:
        if f.endswith("token"):
            with open(os.path.join(creds, f), "w") as fh:
                fh.write(f[0] * 32 + "\n")
        else:
            shutil.copy(key if f.endswith(".key") else cert, os.path.join(creds, f))
    notify_path = os.path.join(d, "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(0.5)
    env = dict(os.environ, NOTIFY_SOCKET=notify_path)
    env.pop("WATCHDOG_USEC", None)
    binary = os.path.join(os.path.abspath(bin_dir), os.path.basename(command[0]))
    log = open(os.path.join(d, "log"), "w")
    proc = subprocess.Popen([binary] + args, stdout=log, stderr=subprocess.STDOUT, env=env)
    messages = []
    try:
        etcd = "--store" in args and args[args.index("--store") + 1] == "etcd"
        deadline = time.monotonic() + (40 if etcd else 30)
        while time.monotonic() < deadline and proc.poll() is None and not any(
                "READY=1" in m for m in messages):
            try:
                messages.append(notify.recv(4096).decode())
            except socket.timeout:
                pass
        out = open(log.name).read()
        if etcd:
            try:
                code = proc.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            out = open(log.name).read()
            c.check(code == 2 and "cannot reach etcd" in out,
                    "%s: ExecStart's flags and credentials are accepted (then: no etcd, exit 2)"
                    % name, "exit %s: %s" % (code, out.strip()[-200:]))
            return
        ready = any("READY=1" in m for m in messages)
        c.check(ready, "%s: ExecStart runs and sends READY=1" % name, out.strip()[-200:])
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        while True:
            try:
                messages.append(notify.recv(4096).decode())
            except socket.timeout:
                break
        c.check(code == 0 and any("STOPPING=1" in m for m in messages),
                "%s: STOPPING=1 and exit 0 on SIGTERM" % name, "exit %s" % code)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


def directives_raw(text, key):
    """The raw value of the first `key=` line, continuation lines included."""
    m = re.search(r"^%s=((?:.*\\\n)*.*)$" % key, text, re.M)
    return m.group(1) if m else ""


def check_unit(c, unit, bin_dir, threshold, scratch):
    name = os.path.basename(unit)
    text = open(unit).read()
    code, level, output = exposure(unit, threshold)
    c.check(code == 0 and level is not None and level <= threshold,
            "%s: systemd-analyze security exposure <= %s" % (name, threshold),
            "exit %s, exposure %s" % (code, level))

    copy = os.path.join(scratch, name)
    with open(copy, "w") as f:
        f.write(text.replace("/usr/local/bin/concord-coordinator",
                             os.path.join(os.path.abspath(bin_dir), "concord-coordinator")))
    code, lines = verify(copy)
    c.check(code == 0 and not lines, "%s: systemd-analyze verify prints nothing" % name,
            "; ".join(lines)[:500])

    run_exec_start(c, name, text, bin_dir, scratch)

    d = directives(text)
    c.check(d.get("Type") == ["notify"], "%s: Type=notify" % name, str(d.get("Type")))
    c.check(d.get("NotifyAccess") == ["main"], "%s: NotifyAccess=main" % name)
    c.check(bool(d.get("WatchdogSec")), "%s: WatchdogSec= set" % name, str(d.get("WatchdogSec")))
    c.check(d.get("DynamicUser") == ["yes"] and d.get("CapabilityBoundingSet") == [""],
            "%s: DynamicUser=yes, no capabilities" % name)
    creds = {v.split(":", 1)[0] for v in d.get("LoadCredential", [])}
    used = set(re.findall(r"%d/([A-Za-z0-9._-]+)", " ".join(d.get("ExecStart", []))))
    c.check(used and used <= creds, "%s: every %%d/FILE of ExecStart is a LoadCredential=" % name,
            "used %s, loaded %s" % (sorted(used), sorted(creds)))
    c.check(creds <= used, "%s: every LoadCredential= is used" % name,
            "unused %s" % sorted(creds - used))
    for token in ("worker-token", "operator-token"):
        c.check("--%s-file %%d/%s" % (token, token) in re.sub(r"\\\n\s*", " ", text),
                "%s: --%s-file reads the credential" % (name, token))

    # The checks can fail.
    soft = os.path.join(scratch, "soft-" + name)
    with open(soft, "w") as f:
        f.write("\n".join(l for l in text.splitlines() if not l.startswith(HARDENING)) + "\n")
    code, level, _ = exposure(soft, threshold)
    c.check(code != 0 and level is not None and level > threshold,
            "%s without hardening: rejected by the threshold" % name,
            "exit %s, exposure %s" % (code, level))
    broken = os.path.join(scratch, "broken-" + name)
    with open(broken, "w") as f:
        f.write(open(copy).read().replace("[Service]\n",
                                          "[Service]\nWatchdogSecs=5\nProtectSystem=sometimes\n"))
    _, lines = verify(broken)
    c.check(any("WatchdogSecs" in l for l in lines) and any("sometimes" in l for l in lines),
            "%s with an unknown key and a bad value: verify reports both" % name,
            "; ".join(lines)[:300])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--threshold", type=float, default=2.0)
    args = parser.parse_args()
    c = Checks()
    if shutil.which("systemd-analyze") is None:
        c.check(False, "systemd-analyze installed (Debian systemd; scripts/install-deps.sh)")
    else:
        units = sorted(glob.glob(os.path.join(ROOT, "deploy", "systemd", "*.service")))
        c.check(len(units) >= 2, "deploy/systemd has the units", str(units))
        scratch = tempfile.mkdtemp(prefix="concord-units-")
        try:
            for unit in units:
                check_unit(c, unit, args.bin_dir, args.threshold, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    print("%d passed, %d failed" % (c.passed, c.failed))
    sys.exit(1 if c.failed else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""The systemd units in deploy/systemd, checked offline with systemd-analyze.

    /usr/bin/python3 tests/deploy/test_systemd_units.py --bin-dir build/bin [--threshold 2.0]

For every deploy/systemd/*.service:
  - `systemd-analyze security --offline=true --threshold=N` exits 0 and the
    overall exposure it prints is at most N;
  - `systemd-analyze verify` of a copy whose ExecStart names the built
    binary (the installed path does not exist here) prints no diagnostic;
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
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARDENING = ("DynamicUser", "CapabilityBoundingSet", "NoNewPrivileges", "Protect", "Private",
             "Restrict", "SystemCall", "MemoryDenyWriteExecute", "LockPersonality", "IPAddress",
             "UMask", "DevicePolicy", "ProcSubset", "RemoveIPC", "User=")


class Checks(object):
    def __init__(self):
        self.passed = self.failed = 0

    def check(self, ok, what, detail=""):
        print("%s: %s%s" % ("PASS" if ok else "FAIL", what, " (%s)" % detail if detail else ""),
              flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        return ok


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
    lines = [l for l in (out + err).splitlines() if l.strip()]
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

#!/usr/bin/python3
"""concord-run as a launcher (see Note [Worker output] and see Note
[Exit status] in tools/launcher.h; see Note [Exited workers] in
coordinator/core/core.h): real
processes on loopback.

    /usr/bin/python3 tests/integration/test_launcher.py --bin-dir build/bin \\
        [--group output|exit] [--case NAME ...] [--keep]

Group output (plain Python programs as workers, no coordinator needed by
them; about 5 s):
  prefixes      2 workers write 200 lines each on stdout and stderr, every
                line in three flushed pieces, and end on a line without a
                newline: concord-run's stdout holds exactly the stdout lines,
                its stderr the stderr lines (and its own), each "[worker I] "
                + the line, whole, in each worker's order.
  log-dir       --log-dir with --console none and --max-restarts 1, worker 1
                killed on its first run: DIR/worker-I/run-R/{stdout,stderr}.log
                hold each run's bytes exactly, the console none of them, and
                the death report names the dead run's last stderr lines.
  death-report  worker 1 writes two stderr lines and SIGKILLs itself while
                worker 0 waits: the report (pid, worker id, "killed by signal
                9", not restarted, both lines) is on concord-run's stderr
                while worker 0 still runs; without a coordinator's word the
                exit status is the dead worker's (137).
  bad-input     --log-dir naming a file, a directory holding worker-0, one
                that cannot be written; --console none without --log-dir:
                exit 2, one line, no worker started.

Group exit (concord-train jobs, --standalone, through the node agent; about
25 s):
  reform        3 workers, --heartbeat-timeout-ms 30000: this script
                SIGKILLs local worker 2 while the job trains; the coordinator
                hears of it from concord-run (its history's failure event
                says "reported by its node agent") and generation 2 forms
                within a bound far under the heartbeat timeout (the measured
                time is printed); the job completes: exit 0, the death
                report, and a summary line naming the lost worker.
  below-min     2 workers, --min-workers 2, worker 1 dies: concord-run stops
                the other, says why, exits 137.
  job-failed    1 worker of a job that needs 2 (--rendezvous-timeout-ms
                2000): the job fails, concord-run says so with the
                coordinator's reason and exits non-zero.

Prints one line per check and 'N passed, N failed'; exits 1 on a failure.
"""

import argparse
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))

import testlib  # noqa: E402
from processes import local_worker  # noqa: E402

CALL_TIMEOUT = 60.0
LINES = 200

WRITER = r'''
import os, sys
i = int(os.environ["LOCAL_RANK"])
n = int(sys.argv[1])
for k in range(n):
    for stream, name in ((sys.stdout, "out"), (sys.stderr, "err")):
        line = "%s %d %d %s\n" % (name, i, k, "abcdefghij" * (1 + k % 7))
        third = len(line) // 3
        for part in (line[:third], line[third:2 * third], line[2 * third:]):
            stream.write(part)
            stream.flush()
sys.stdout.write("tail-out %d" % i)
sys.stdout.flush()
sys.stderr.write("tail-err %d" % i)
sys.stderr.flush()
if len(sys.argv) > 2 and i == int(sys.argv[2]) and os.environ["CONCORD_RESTART_COUNT"] == "0":
    os.kill(os.getpid(), 9)
'''

DIER = r'''
import os, signal, sys, time
i = int(os.environ["LOCAL_RANK"])
if i == 1:
    sys.stderr.write("line before the end\n")
    sys.stderr.write("about to die: secret-123\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
deadline = time.time() + 30
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.02)
print("worker 0 done", flush=True)
'''


def expected_writer(i, n, stream):
    """What WRITER writes on `stream` ("out" or "err") as worker i."""
    lines = ["%s %d %d %s\n" % (stream, i, k, "abcdefghij" * (1 + k % 7)) for k in range(n)]
    return "".join(lines) + "tail-%s %d" % (stream, i)


def run(cmd, timeout=CALL_TIMEOUT, env=None):
    full = dict(os.environ, OMP_NUM_THREADS="1")
    full.update(env or {})
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full,
                            universal_newlines=True, errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    return proc.returncode, out, err, timed_out, time.monotonic() - start


def describe(rc, out, err, timed_out):
    return "exit %s%s\n--- stdout (end)\n%s\n--- stderr (end)\n%s" % (
        rc, " (TIMED OUT)" if timed_out else "", out[-2000:], err[-3000:])


# --- group output ---------------------------------------------------------------

def case_prefixes(ctx):
    name = "prefixes"
    rc, out, err, timed_out, _ = run([ctx.run, "--standalone", "--nproc", "2", "--",
                                      sys.executable, ctx.writer, str(LINES)])
    detail = describe(rc, out, err, timed_out)
    ctx.checks.check(rc == 0 and not timed_out, name + ": exit 0", detail)
    for stream, text in (("out", out), ("err", err)):
        problems = []
        got = {0: [], 1: []}
        for line in text.split("\n")[:-1]:
            m = re.match(r"^\[worker (\d)\] (.*)$", line)
            if m is None:
                if stream == "out" or not line.startswith("concord-run: "):
                    problems.append("a line of neither a worker nor concord-run: %r" % line[:120])
                continue
            got[int(m.group(1))].append(m.group(2))
        for i in (0, 1):
            want = expected_writer(i, LINES, stream).split("\n")
            if got[i] != want:
                bad = next((k for k, (a, b) in enumerate(zip(got[i], want)) if a != b),
                           min(len(got[i]), len(want)))
                problems.append("worker %d: %d lines, expected %d; first difference at %d: %r"
                                % (i, len(got[i]), len(want), bad, got[i][bad:bad + 1]))
        ctx.checks.check(not problems, "%s: std%s lines whole, prefixed, in order (%d a worker)"
                         % (name, stream, LINES + 1), "; ".join(problems[:5]))


def case_log_dir(ctx):
    name = "log-dir"
    logs = os.path.join(ctx.tmp, "logs")
    rc, out, err, timed_out, _ = run([ctx.run, "--standalone", "--nproc", "2",
                                      "--max-restarts", "1", "--log-dir", logs,
                                      "--console", "none", "--",
                                      sys.executable, ctx.writer, "20", "1"])
    detail = describe(rc, out, err, timed_out)
    ctx.checks.check(rc == 0 and not timed_out,
                     name + ": exit 0 (worker 1 restarted and exited 0)", detail)
    problems = []
    for i, runs in ((0, 1), (1, 2)):
        for r in range(runs):
            for stream in ("out", "err"):
                path = os.path.join(logs, "worker-%d" % i, "run-%d" % r, "std%s.log" % stream)
                try:
                    with open(path) as f:
                        text = f.read()
                except OSError as e:
                    problems.append("%s: %s" % (path, e.strerror))
                    continue
                if text != expected_writer(i, 20, stream):
                    problems.append("%s: %d bytes, not what the run wrote" % (path, len(text)))
    extra = sorted(set(os.listdir(logs)) - {"worker-0", "worker-1"})
    if extra or os.path.exists(os.path.join(logs, "worker-0", "run-1")):
        problems.append("unexpected entries: %s" % extra)
    ctx.checks.check(not problems, name + ": DIR/worker-I/run-R/std{out,err}.log hold each "
                     "run's bytes, a restart's apart", "; ".join(problems))
    shown = [l for l in (out + err).splitlines() if l.startswith("[worker ")]
    ctx.checks.check(not shown and out == "", name + ": --console none shows no worker line",
                     "%d shown: %s" % (len(shown), shown[:3]))
    report = re.search(r"concord-run: worker 1 \(pid \d+, worker id \S+-w1\) failed after "
                       r"[\d.]+ s: killed by signal 9 \(SIGKILL\); restarting it \(restart 1 of 1\)"
                       r"; the last (\d+) line\(s\) of its stderr:\n((?:  .*\n)+)", err)
    ctx.checks.check(report is not None and "  err 1 19 " in report.group(2) and
                     "  tail-err 1" in report.group(2),
                     name + ": the death report shows the last stderr lines the console hid",
                     err[-2000:])


def case_death_report(ctx):
    name = "death-report"
    go = os.path.join(ctx.tmp, "go")
    cmd = [ctx.run, "--standalone", "--nproc", "2", "--min-workers", "1", "--",
           sys.executable, ctx.dier, go]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    err = b""
    report = None
    survivor_alive = False
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and report is None:
            ready, _, _ = select.select([proc.stderr], [], [], 0.2)
            if ready:
                chunk = os.read(proc.stderr.fileno(), 65536)
                if not chunk:
                    break
                err += chunk
            report = re.search(rb"concord-run: worker 1 \(pid \d+, worker id \S+\) failed after "
                               rb"[\d.]+ s: killed by signal 9 \(SIGKILL\); not restarting it "
                               rb"\(--max-restarts 0\); the last 2 line\(s\) of its stderr:\n"
                               rb"  line before the end\n  about to die: secret-123\n", err)
        if report is not None:
            # Worker 0 waits for `go`; on a loaded machine it may not have
            # reached its exec yet (its /proc environ is still
            # concord-run's), so it is looked for a little while.
            until = time.monotonic() + 5
            while not survivor_alive and proc.poll() is None and time.monotonic() < until:
                survivor_alive = local_worker(proc.pid, 0) is not None
                if not survivor_alive:
                    time.sleep(0.05)
        with open(go, "w"):
            pass
        out, rest = proc.communicate(timeout=CALL_TIMEOUT)
        err += rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err.decode(errors="replace")
    ctx.checks.check(report is not None, name + ": the death report, with the last stderr "
                     "lines", text[-2000:])
    ctx.checks.check(survivor_alive, name + ": ... came while the other worker still ran")
    ctx.checks.check(proc.returncode == 128 + signal.SIGKILL and b"worker 0 done" in out,
                     name + ": no word from a coordinator: the dead worker's status (137)",
                     "exit %s\n%s" % (proc.returncode, text[-1500:]))


def case_bad_input(ctx):
    marker = os.path.join(ctx.tmp, "started")
    program = ["--", "sh", "-c", "touch " + marker]
    a_file = os.path.join(ctx.tmp, "a-file")
    with open(a_file, "w"):
        pass
    used = os.path.join(ctx.tmp, "used")
    os.makedirs(os.path.join(used, "worker-0"))
    cases = [("--log-dir naming a file", ["--log-dir", a_file], "not a directory"),
             ("--log-dir holding worker-0", ["--log-dir", used], "worker-0 exists"),
             ("--console none without --log-dir", ["--console", "none"], "--log-dir"),
             ("--nnodes 0", ["--nnodes", "0"], "1 <= MIN <= MAX"),
             ("--nnodes 3:2", ["--nnodes", "3:2"], "1 <= MIN <= MAX"),
             ("--nnodes two", ["--nnodes", "two"], "not N or MIN:MAX"),
             ("--nnodes 2 with --standalone", ["--nnodes", "2"], "needs --coordinator"),
             ("--stragglers kick", ["--stragglers", "kick"], "--stragglers")]
    if os.geteuid() != 0:
        locked = os.path.join(ctx.tmp, "locked")
        os.makedirs(locked)
        os.chmod(locked, 0o500)
        cases.append(("--log-dir that cannot be written", ["--log-dir", locked + "/logs"],
                      "Permission denied"))
    elif os.path.isdir("/sys/kernel"):  # root writes anywhere but sysfs
        cases.append(("--log-dir that cannot be written", ["--log-dir", "/sys/concord-logs"],
                      "/sys/concord-logs"))
    for label, flags, says in cases:
        rc, out, err, timed_out, _ = run([ctx.run, "--standalone", "--nproc", "2"] + flags +
                                         program)
        lines = [l for l in err.splitlines() if l.strip()]
        ctx.checks.check(rc == 2 and len(lines) == 1 and says in err and
                         not os.path.exists(marker),
                         "bad-input: %s: exit 2, one line, no worker" % label,
                         describe(rc, out, err, timed_out))


# --- group exit -----------------------------------------------------------------

def train_cmd(ctx, nproc, run_flags, epochs=2):
    return ([ctx.run, "--standalone", "--nproc", str(nproc)] + run_flags +
            ["--", ctx.train, "--model", ctx.model, "--data", ctx.data, "--loss", "mse",
             "--lr", "0.01", "--batch-size", "4", "--epochs", str(epochs), "--log-interval", "5"])


def case_reform(ctx):
    name = "reform"
    history = os.path.join(ctx.tmp, "history")
    os.makedirs(history)
    # All 3 form generation 1 (--settle-ms), however slowly one starts.
    cmd = train_cmd(ctx, 3, ["--min-workers", "2", "--job-id", "launcher-reform",
                             "--settle-ms", "20000",
                             "--heartbeat-interval-ms", "3000", "--heartbeat-timeout-ms", "30000",
                             "--history", history], epochs=20)
    env = dict(os.environ, OMP_NUM_THREADS="1", CONCORD_TEST_MIN_STEP_MS="4")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)
    out, err, t0, victim = b"", b"", None, None
    deadline = time.monotonic() + 90
    try:
        streams = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err"}
        while time.monotonic() < deadline and streams:
            ready, _, _ = select.select(list(streams), [], [], 0.2)
            for fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    del streams[fd]
                elif streams[fd] == "out":
                    out += chunk
                else:
                    err += chunk
            # Kill once every worker trains (rank 0 logged step 10).
            if t0 is None and re.search(rb"\[worker \d\] epoch \d+/\d+ step (\d\d+)/", out):
                victim = local_worker(proc.pid, 2)
                if victim is not None:
                    t0 = time.time()
                    os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err.decode(errors="replace")
    detail = "exit %s\n%s" % (proc.returncode, text[-3000:])
    if not ctx.checks.check(t0 is not None, name + ": local worker 2 SIGKILLed while training",
                            detail):
        return
    ctx.checks.check(proc.returncode == 0, name + ": the job completed: exit 0", detail)
    ctx.checks.check(re.search(r"concord-run: worker 2 \(pid %d, worker id (\S+-w2)\) failed "
                               r"after [\d.]+ s: killed by signal 9 \(SIGKILL\); not restarting it"
                               % victim, text) is not None,
                     name + ": the death report", detail)
    summary = re.search(r"concord-run: job launcher-reform completed; worker run\(s\) lost on "
                        r"the way: worker 2 \((\S+-w2): killed by signal 9 \(SIGKILL\)\)", text)
    ctx.checks.check(summary is not None, name + ": a summary line names the lost worker",
                     detail)
    events = []
    try:
        with open(os.path.join(history, "coordinator.history")) as f:
            events = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        ctx.checks.fail(name + ": the coordinator's history", str(e))
    exited = [e for e in events if e.get("event") == "failure" and
              e.get("worker", "").endswith("-w2") and
              "its process exited (killed by signal 9 (SIGKILL); reported by its node agent)"
              in e.get("message", "")]
    formed = [e for e in events if e.get("event") == "generation" and e.get("generation") == 2
              and "members" in e]
    ok = len(exited) == 1 and len(formed) == 1
    ctx.checks.check(ok, name + ": the coordinator took the worker out on concord-run's report",
                     "" if ok else "failure events %s; generation 2 %s" % (
                         [e for e in events if e.get("event") == "failure"], formed))
    if ok:
        reform = formed[0]["time_us"] / 1e6 - t0
        report = exited[0]["time_us"] / 1e6 - t0
        # Far under the 30 s heartbeat timeout (and under the 1 s grace of a
        # lost watch) on an idle machine; generous for a loaded one.
        ctx.checks.check(reform < 3.0 and len(formed[0]["members"]) == 2,
                         name + ": generation 2 formed with 2 members %.0f ms after the kill "
                         "(reported after %.0f ms; heartbeat timeout 30 s)"
                         % (reform * 1e3, report * 1e3), "" if reform < 3.0 else str(formed[0]))


def case_below_min(ctx):
    name = "below-min"
    rc, out, err, timed_out, _ = run(
        train_cmd(ctx, 2, ["--job-id", "launcher-below-min", "--heartbeat-interval-ms", "200",
                           "--heartbeat-timeout-ms", "3000"], epochs=20),
        env={"CONCORD_TEST_KILL": "1:3:forward"})
    detail = describe(rc, out, err, timed_out)
    ctx.checks.check(rc == 128 + signal.SIGKILL and not timed_out,
                     name + ": exit 137 (the worker that failed for good)", detail)
    ctx.checks.check("fewer than --min-workers 2" in err and
                     "job launcher-below-min did not complete here: below --min-workers; " in err,
                     name + ": says why", detail)


def case_job_failed(ctx):
    name = "job-failed"
    rc, out, err, timed_out, _ = run(
        train_cmd(ctx, 1, ["--job-id", "launcher-failed", "--min-workers", "2",
                           "--max-workers", "2", "--settle-ms", "500",
                           "--rendezvous-timeout-ms", "2000"]))
    detail = describe(rc, out, err, timed_out)
    ctx.checks.check(rc not in (0, None) and not timed_out, name + ": exit non-zero", detail)
    ctx.checks.check("concord-run: job launcher-failed failed: rendezvous timed out" in err,
                     name + ": says the job failed, with the coordinator's reason", detail)
    # With restarts left: a worker that fails because the job failed is not
    # restarted (a new process would start the job again, see Note [Starting
    # again]); concord-run ends at once, saying why.
    rc, out, err, timed_out, elapsed = run(
        train_cmd(ctx, 1, ["--job-id", "launcher-failed-restarts", "--min-workers", "2",
                           "--max-workers", "2", "--settle-ms", "500",
                           "--rendezvous-timeout-ms", "2000", "--max-restarts", "3"]))
    detail = describe(rc, out, err, timed_out)
    ctx.checks.check(rc not in (0, None) and not timed_out and elapsed < 30 and
                     "not restarting it (the job failed)" in err and
                     "restarting it (restart" not in err,
                     name + ": with --max-restarts, no restart after the job failed (%.1f s)" %
                     elapsed, detail)


GROUPS = {
    "output": [("prefixes", case_prefixes), ("log-dir", case_log_dir),
               ("death-report", case_death_report), ("bad-input", case_bad_input)],
    "exit": [("reform", case_reform), ("below-min", case_below_min),
             ("job-failed", case_job_failed)],
}


class Ctx(object):
    pass


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--group", choices=sorted(GROUPS), action="append")
    p.add_argument("--case", action="append")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    ctx = Ctx()
    ctx.checks = testlib.Checks()
    bins = os.path.abspath(args.bin_dir)
    ctx.run = os.path.join(bins, "concord-run")
    ctx.train = os.path.join(bins, "concord-train")
    ctx.tmp = tempfile.mkdtemp(prefix="concord_launcher_")
    groups = args.group or sorted(GROUPS)
    try:
        ctx.writer = os.path.join(ctx.tmp, "writer.py")
        ctx.dier = os.path.join(ctx.tmp, "dier.py")
        with open(ctx.writer, "w") as f:
            f.write(WRITER)
        with open(ctx.dier, "w") as f:
            f.write(DIER)
        if "exit" in groups:
            import fixtures  # torch: only for the training jobs
            # No BatchNorm: an epoch's last window may give a rank one sample.
            ctx.model, ctx.data = fixtures.make_fixture(os.path.join(ctx.tmp, "mlp"),
                                                        "mlp-plain", 160, 3)
        for group in groups:
            for case, fn in GROUPS[group]:
                if args.case and case not in args.case:
                    continue
                start = time.monotonic()
                fn(ctx)
                print("-- %s: %.1f s" % (case, time.monotonic() - start), flush=True)
    finally:
        if args.keep:
            print("kept %s" % ctx.tmp)
        else:
            shutil.rmtree(ctx.tmp, ignore_errors=True)
    return ctx.checks.finish()


if __name__ == "__main__":
    sys.exit(main())

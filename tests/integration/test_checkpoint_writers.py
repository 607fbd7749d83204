#!/usr/bin/python3
"""Runs of one job and its checkpoint folder (see Note [Runs] in
coordinator/core/core.h, and see Note [One writer per folder] in
worker/checkpoint/writer_lock.h): real concord-run + concord-train jobs of 3
workers with --checkpoint-dir (tests/integration/checkpoint_runs.py's).

    /usr/bin/python3 tests/integration/test_checkpoint_writers.py \\
        --bin-dir build/bin [--case NAME ...] [--keep]

Cases:
  no-resume    run A trains to a checkpoint of step >= 120 and is killed
               whole. Run B, the same command with --no-resume, starts at
               step 0; once it has a checkpoint of step >= 40 of its own
               its workers are SIGKILLed (a total loss within the run; its
               node agent restarts them): they resume from B's own newest
               (>= 40, below A's), not from step 0 and not from A's. B is
               killed whole later; run C, the plain command with the
               default --checkpoint-keep, resumes from B's newest (not from
               A's higher steps), prunes A's, and ends bit-identical to an
               uninterrupted run.
  two-writers  the same job launched twice at once on one folder (two
               --standalone launchers: two runs): the second's writes are
               refused, each failing streak said in one line naming the
               first run, its host and its launcher's pid, and it exits 1
               saying its last checkpoint was not written; the first run
               finishes with exit 0, every checkpoint in the folder its own,
               bit-identical to an uninterrupted run.

Every subprocess has a timeout; a hang is a failure. Prints one line per
check and 'N passed, N failed'; exits 1 on any failure.
"""

import json
import os
import re
import signal
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import elastic_harness as te  # noqa: E402
import processes  # noqa: E402  (tests/reference, on the path elastic_harness sets)
from checkpoint_runs import (  # noqa: E402
    RUN_TIMEOUT, SLOW, check_history, compare_final, launch, reference, resumed_step,
    main as checkpoint_main, steps)


def manifests(ck, job):
    """{step: manifest} of every step-N folder of the job."""
    out = {}
    if not os.path.isdir(os.path.join(ck, job)):
        return out
    for step in steps(ck, job):
        try:
            with open(os.path.join(ck, job, "step-%d" % step, "manifest.json")) as f:
                out[step] = json.load(f)
        except (OSError, ValueError):
            pass
    return out


def newest_of_run(ck, job, run):
    """The newest step of `run` in the folder (-1: none)."""
    of = [s for s, m in manifests(ck, job).items() if m.get("run") == run]
    return max(of, default=-1)


def runs_in(ck, job):
    return sorted(set(m.get("run") for m in manifests(ck, job).values()))


def wait_for_run(checks, what, proc, ck, job, older_runs, step):
    """Waits for a checkpoint of step >= `step` of a run not in `older_runs`;
    returns that run (None: a failed check)."""
    found = {}

    def ready():
        for s, m in manifests(ck, job).items():
            if m.get("run") not in older_runs and s >= step:
                found["run"] = m.get("run")
                return True
        return proc.poll() is not None

    te.testlib.wait_for(ready, timeout=60)
    ok = checks.check("run" in found and proc.poll() is None,
                      "%s: a checkpoint of step >= %d of its own while it runs" % (what, step),
                      proc.describe())
    return found.get("run") if ok else None


def case_no_resume(ctx, name):
    checks = ctx.checks
    ref = reference(ctx)
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    # Run A: to step >= 120, killed whole.
    _, pa = launch(ctx, name + "-a", job, ck, env=SLOW)
    run_a = wait_for_run(checks, name + " (run A)", pa, ck, job, [], 120)
    pa.kill_group()
    pa.wait(10)
    if run_a is None:
        return
    newest_a = newest_of_run(ck, job, run_a)
    # Run B: --no-resume; its workers SIGKILLed once it has step >= 40.
    rd_b, pb = launch(ctx, name + "-b", job, ck, env=SLOW,
                      extra=["--no-resume", "--max-restarts", "1", "--min-workers", "1"])
    run_b = wait_for_run(checks, name + " (run B)", pb, ck, job, [run_a], 40)
    if run_b is None:
        pb.kill_group()
        return
    checks.check(run_b > run_a and "resuming from" not in pb.stderr(),
                 name + ": run B (%s, after A's %s) started afresh" % (run_b, run_a),
                 pb.stderr()[-3000:])
    killed_at = newest_of_run(ck, job, run_b)
    trainers = processes.children(pb.pid)
    for pid in trainers:
        os.kill(pid, signal.SIGKILL)
    checks.check(len(trainers) == 3, name + ": run B's 3 workers SIGKILLed, its agent lives",
                 "children: %s" % trainers)
    te.testlib.wait_for(lambda: resumed_step(pb.stderr(), r"\w+") is not None or
                        pb.poll() is not None, timeout=60)
    resumed = resumed_step(pb.stderr(), r"\w+")
    checks.check(resumed is not None and killed_at <= resumed < newest_a,
                 name + ": within run B, the restarted workers resumed from B's own newest "
                 "(step %s; B had %d, A %d)" % (resumed, killed_at, newest_a),
                 pb.stderr()[-3000:])
    te.testlib.wait_for(lambda: newest_of_run(ck, job, run_b) >= (resumed or 0) + 20 or
                        pb.poll() is not None, timeout=60)
    newest_b = newest_of_run(ck, job, run_b)
    checks.check(pb.poll() is None and newest_b < newest_a,
                 name + ": run B killed whole at its step %d (A's newest: %d)" % (
                     newest_b, newest_a), pb.describe())
    pb.kill_group()
    pb.wait(10)
    # Run C: the plain command, default keep.
    rd_c, pc = launch(ctx, name + "-c", job, ck, keep=None)
    rc = pc.wait(RUN_TIMEOUT)
    checks.check(rc == 0, name + ": run C exits 0", pc.describe())
    step = resumed_step(pc.stderr(), "disk")
    checks.check(step == newest_b,
                 name + ": run C resumed from run B's newest (step %s; B's %d, A's %d)" % (
                     step, newest_b, newest_a), pc.stderr()[-3000:])
    left = runs_in(ck, job)
    checks.check(len(steps(ck, job)) == 3 and len(left) == 1 and left[0] > run_b,
                 name + ": the default keep left run C's newest 3 (%s), A's higher steps "
                 "pruned" % steps(ck, job), "runs: %s" % left)
    check_history(checks, name, [rd_b, rd_c], 6)
    compare_final(checks, name, rd_c, ck, job, ref)


def case_two_writers(ctx, name):
    checks = ctx.checks
    ref = reference(ctx)
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    # The first run's steps are slower: it still runs when the second ends.
    rd_a, pa = launch(ctx, name + "-a", job, ck, env={"CONCORD_TEST_MIN_STEP_MS": "60"})
    run_a = wait_for_run(checks, name + " (first run)", pa, ck, job, [], 20)
    if run_a is None:
        pa.kill_group()
        return
    try:
        with open(os.path.join(ck, job, ".writer")) as f:
            lock = json.load(f)
    except (OSError, ValueError):
        lock = {}
    checks.check(lock.get("run") == run_a and lock.get("pid") == pa.pid and
                 lock.get("host") == socket.gethostname(),
                 name + ": the folder's writer lock names the first run and its launcher "
                 "(the node agent writes)", "%s; launcher pid %d" % (lock, pa.pid))
    _, pb = launch(ctx, name + "-b", job, ck, env=SLOW, extra=["--no-resume"])
    rc_b = pb.wait(RUN_TIMEOUT)
    first_alive = pa.poll() is None
    said = "is written by run %d (host %s, pid %d" % (run_a, socket.gethostname(), pa.pid)
    text = pb.stderr()
    streaks = [l for l in text.splitlines() if said in l and "not written (" in l]
    last = re.search(r"the job's last checkpoint, of step \d+, was not written to [^\n]*" +
                     re.escape(said), text)
    checks.check(rc_b == 1 and first_alive and len(streaks) == 1 and last is not None,
                 name + ": the second run's writes refused, said once naming the first run, "
                 "and it exits 1 saying its last checkpoint was not written (rc %s)" % rc_b,
                 text[-3000:])
    rc_a = pa.wait(RUN_TIMEOUT)
    checks.check(rc_a == 0, name + ": the first run exits 0", pa.describe())
    left = runs_in(ck, job)
    checks.check(left == [run_a] and not [d for d in os.listdir(os.path.join(ck, job))
                                          if d.startswith(".staging")],
                 name + ": every checkpoint in the folder is the first run's", "runs: %s" % left)
    compare_final(checks, name, rd_a, ck, job, ref)


CASES = {
    "no-resume": lambda ctx: case_no_resume(ctx, "no-resume"),
    "two-writers": lambda ctx: case_two_writers(ctx, "two-writers"),
}


if __name__ == "__main__":
    sys.exit(checkpoint_main(__doc__, CASES, "concord_checkpoint_writers_"))

#!/usr/bin/python3
"""Benchmark: a worker that hangs alive, found by its progress (the hang
rule, see Note [Hangs] in coordinator/core/hang_rule.h) next to the same
stall with the rule off (what Concord did before it: the collective timeout
governs); and a straggler, with --stragglers report and evict next to the
healthy workers alone (see Note [Evicting stragglers]), in one run.

Usage (Debian's python3, which has torch; build Concord first):

    /usr/bin/python3 bench/gray_failures.py --bin-dir build/bin [--repeat 3]
        [--off-repeat 1] [--collective-timeout-ms 300000] [--kind cnn]
        [--straggler-repeat 3] [--epochs 12] [--step-ms 40] [--only stall|straggler]

Each repeat: concord-run --standalone --nproc W (default 3) runs
concord-train on a fixture of tests/reference/fixtures.py (default "cnn",
a small convnet on 1x28x28 images: MNIST-size steps), with the defaults
but --max-restarts 0; CONCORD_TEST_FAULT makes local worker 1 sleep, idle,
after the agreement of step --stall-step (before its forward's first
collective), for longer than the run can wait. T0 is its log line saying it
stalls. Reported, for "rule on" (the default hang timeout: derived from the
step times, at least 5 s) and "rule off" (--hang-timeout-ms -1): detect (T0
-> a survivor's collective was aborted), re-form (-> the survivors' next
generation formed), resume (T0 -> the survivors' first step in it done).
Medians over the repeats. The goal: resume within 10 s with the rule on;
with it off the survivors wait out --collective-timeout-ms and then, in the
next rendezvous, --rendezvous-timeout-ms for the stalled member, which still
heartbeats and never joins (concord-run's defaults: 300 s each).

The straggler part: the fixture (2048 samples, batch 16) trained --epochs
to the end, every step paced to at least --step-ms (40 ms, the test hook
CONCORD_TEST_MIN_STEP_MS: the compute of a small model's step on a GPU, on
a machine whose CPUs three workers share), by W workers with local worker
1 at a fifth of the speed from when it joined the first generation on
(SIGSTOPped 160 ms of every 200: it runs a fifth of the time), under
--stragglers report and --stragglers evict (their defaults otherwise: the
60 s cool-down), and by W - 1 healthy workers alone; each job through
concord-run --coordinator against a concord-coordinator of its own, whose
history file has the straggler events. Reported: the job's wall time
(concord-run's start to its exit), and when the coordinator named the
straggler and evicted it (from the slow-down's start). The goals: evict
within 1.3x the healthy workers' time; named within 30 s.

Not a test; not registered with ctest.
"""

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import reform_latency as rl  # noqa: E402  (its command lines and log stamps)
import fixtures  # noqa: E402  (tests/reference, on the path rl sets)
import processes  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
import elastic_harness as eh  # noqa: E402  (its Coordinator)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", default="build/bin")
    p.add_argument("--kind", default="cnn", help="fixture kind (tests/reference/fixtures.py)")
    p.add_argument("--world-size", type=int, default=3)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--stall-step", type=int, default=20)
    p.add_argument("--repeat", type=int, default=3, help="repeats with the rule on")
    p.add_argument("--off-repeat", type=int, default=1, help="repeats with the rule off")
    p.add_argument("--collective-timeout-ms", type=int, default=300000,
                   help="concord-run's (its default: 300000)")
    p.add_argument("--rendezvous-timeout-ms", type=int, default=300000,
                   help="concord-run's (its default: 300000)")
    p.add_argument("--no-agent", action="store_true")
    p.add_argument("--straggler-repeat", type=int, default=3,
                   help="repeats of each straggler configuration")
    p.add_argument("--epochs", type=int, default=12, help="of the straggler part's jobs")
    p.add_argument("--straggler-samples", type=int, default=2048)
    p.add_argument("--straggler-batch-size", type=int, default=16)
    p.add_argument("--step-ms", type=int, default=40,
                   help="the straggler part's steps last at least this long "
                        "(CONCORD_TEST_MIN_STEP_MS: the compute of a GPU step)")
    p.add_argument("--only", choices=["stall", "straggler"])
    return p.parse_args()


def stall_once(args, model, data, rule_on):
    """One run; the times of the survivors' reactions to the stall (ms)."""
    # With the rule off the survivors wait out the collective timeout, then
    # the rendezvous for the stalled member, which heartbeats (alive) and
    # never joins: its timeout too.
    wait_s = (args.collective_timeout_ms + args.rendezvous_timeout_ms) / 1e3 + 60
    extra_run = ["--max-restarts", "0", "--min-workers", str(args.world_size - 1),
                 "--settle-ms", str(min(200000, args.rendezvous_timeout_ms - 1)),
                 "--collective-timeout-ms", str(args.collective_timeout_ms),
                 "--rendezvous-timeout-ms", str(args.rendezvous_timeout_ms)]
    if not rule_on:
        extra_run += ["--hang-timeout-ms", "-1"]
    cmd = rl.concord_cmd(args, model, data, extra_run, ["--epochs", "100000"], os.devnull)
    env = dict(os.environ, CONCORD_TEST_FAULT="1:%d:forward:model:1:stall=%d" % (
        args.stall_step, int(wait_s + 60)), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env=env)
    events = {}
    seen = []
    t0 = None
    deadline = time.time() + wait_s + 60
    try:
        fd = proc.stderr.fileno()
        buf = ""
        while time.time() < deadline and "resumed" not in events:
            chunk = ""
            if select.select([fd], [], [], 0.1)[0]:
                chunk = os.read(fd, 1 << 16).decode(errors="replace")
                if not chunk and proc.poll() is not None:
                    raise RuntimeError("the job ended: %s\n%s" % (events, "\n".join(seen[-30:])))
            buf += chunk
            lines = buf.split("\n")
            buf = lines.pop()
            seen.extend(lines[-200:])
            for line in lines:
                m = rl.STAMP.match(line)
                if not m:
                    continue
                when, what = rl.stamp(m.group(1)), m.group(2)
                if "CONCORD_TEST_FAULT: stalling" in what:
                    t0 = when
                elif t0 is None:
                    continue
                elif "re-forming" in what:
                    events.setdefault("detected", when)
                elif "joined job" in what and "detected" in events:
                    events.setdefault("formed", when)
                elif "the first in generation" in what and "formed" in events:
                    events.setdefault("resumed", when)
        if "resumed" not in events:
            raise RuntimeError("no resumption seen: %s; last output:\n%s"
                               % (events, "\n".join(seen[-20:])))
    finally:
        rl.kill_group(proc)
    return {"detect": (events["detected"] - t0) * 1e3,
            "re-form": (events["formed"] - events["detected"]) * 1e3,
            "resume": (events["resumed"] - t0) * 1e3}


def slow_down(pid, stop):
    """Local worker `pid` at a fifth of the speed until `stop` is set:
    SIGSTOPped 160 ms of every 200, so that it runs a fifth of the time (each
    step, paced to --step-ms, spans stops: its own work is slower, not its
    waits)."""
    while not stop.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.16)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(0.04)


def straggler_once(args, model, data, policy, workers, tmp):
    """One job to the end against a concord-coordinator of its own; its wall
    time, and when (from the slow-down's start) the coordinator named and
    evicted local worker 1 (None: it did not). policy None: no straggler."""
    coord = eh.Coordinator(eh.Bins(args.bin_dir), tempfile.mkdtemp(dir=tmp))
    if coord.address is None:
        raise RuntimeError("concord-coordinator did not start: " + coord.proc.describe())
    # Every worker in the first generation (a settle period that outlasts
    # their start), at least W - 1 after an eviction.
    extra_run = ["--coordinator", coord.address, "--token-file", coord.worker_token,
                 "--job-id", "bench", "--max-restarts", "0",
                 "--min-workers", str(max(1, workers - 1)), "--settle-ms", "20000"]
    if policy:
        extra_run += ["--stragglers", policy]
    saved = args.world_size, args.batch_size
    args.world_size, args.batch_size = workers, args.straggler_batch_size
    cmd = rl.concord_cmd(args, model, data, extra_run, ["--epochs", str(args.epochs)],
                         os.devnull)
    args.world_size, args.batch_size = saved
    cmd.remove("--standalone")
    env = dict(os.environ, OMP_NUM_THREADS="1", CONCORD_TEST_MIN_STEP_MS=str(args.step_ms))
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env=env)
    stop = threading.Event()
    slower = None
    slow_from = None
    tail = []
    rc = None
    try:
        fd = proc.stderr.fileno()
        buf = ""
        deadline = start + 3600
        joined = False  # local worker 1 is a member (the first generation formed)
        while time.time() < deadline:
            if policy and slower is None and joined:
                pid = processes.local_worker(proc.pid, 1)
                if pid is not None:
                    slow_from = time.time()
                    slower = threading.Thread(target=slow_down, args=(pid, stop), daemon=True)
                    slower.start()
            if select.select([fd], [], [], 0.05)[0]:
                chunk = os.read(fd, 1 << 16).decode(errors="replace")
                if not chunk:
                    break
                buf += chunk
                lines = buf.split("\n")
                buf = lines.pop()
                tail = (tail + lines)[-30:]
                joined = joined or any(l.startswith("[worker 1] ") and "joined job" in l
                                       for l in lines)
        rc = proc.wait(timeout=max(1, deadline - time.time()))
        job_s = time.time() - start
    finally:
        stop.set()
        rl.kill_group(proc)
        coord.stop()
    if rc != 0:
        raise RuntimeError("the job exited %s:\n%s" % (rc, "\n".join(tail)))
    out = {"job": job_s, "named": None, "evicted": None}
    with open(coord.history) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") != "straggler" or slow_from is None:
                continue
            at = e["time_us"] / 1e6 - slow_from
            if e.get("message", "").startswith("straggler:") and out["named"] is None:
                out["named"] = at
            elif "evicted as a straggler" in e.get("message", "") and out["evicted"] is None:
                out["evicted"] = at
    return out


def stragglers(args, model, data, tmp):
    w = args.world_size
    configs = [("--stragglers report, %d workers" % w, "report", w),
               ("--stragglers evict, %d workers" % w, "evict", w),
               ("healthy workers alone (%d)" % (w - 1), None, w - 1)]
    results = {}
    for label, policy, workers in configs:
        runs = []
        for i in range(args.straggler_repeat):
            r = straggler_once(args, model, data, policy, workers, tmp)
            print("%s, run %d: job %.1f s, named %s, evicted %s" % (
                label, i + 1, r["job"], fmt(r["named"]), fmt(r["evicted"])), flush=True)
            runs.append(r)
        results[label] = runs
    print("\nstraggler: local worker 1 at a fifth of the speed, %d epochs of fixture %s "
          "(%d samples), batch %d, steps of at least %d ms (%s):" % (
              args.epochs, args.kind, args.straggler_samples, args.straggler_batch_size,
              args.step_ms,
                              "--no-agent" if args.no_agent else "through the node agent"))
    print("%-42s %10s %10s %10s" % ("median over runs", "job", "named", "evicted"))
    med = {}
    for label, runs in results.items():
        med[label] = {k: median_of([r[k] for r in runs]) for k in ("job", "named", "evicted")}
        print("%-42s %10s %10s %10s   (%d runs)" % (
            label, fmt(med[label]["job"]), fmt(med[label]["named"]),
            fmt(med[label]["evicted"]), len(runs)))
    report, evict, healthy = (med[c[0]] for c in configs)
    print("evict / healthy alone: %.2fx (goal <= 1.3x: %s); report / healthy alone: %.2fx" % (
        evict["job"] / healthy["job"], "MET" if evict["job"] <= 1.3 * healthy["job"] else "MISSED",
        report["job"] / healthy["job"]))
    named = [r["named"] for c in configs[:2] for r in results[c[0]]]
    print("named within 30 s in every run: %s" % (
        "MET" if all(n is not None and n <= 30 for n in named) else "MISSED"))


def fmt(seconds):
    return "-" if seconds is None else "%.1f s" % seconds


def median_of(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main():
    args = parse_args()
    tmp = tempfile.mkdtemp(prefix="concord_gray_")
    if args.only != "stall":
        model, data = fixtures.make_fixture(os.path.join(tmp, "straggler"), args.kind,
                                            n_samples=args.straggler_samples, seed=1)
        stragglers(args, model, data, tmp)
    if args.only == "straggler":
        return 0
    model, data = fixtures.make_fixture(tmp, args.kind, n_samples=args.samples, seed=1)
    results = {}
    for label, rule_on, repeats in (("rule on (default hang timeout)", True, args.repeat),
                                    ("rule off (timeouts %d + %d ms)"
                                     % (args.collective_timeout_ms,
                                        args.rendezvous_timeout_ms), False,
                                     args.off_repeat)):
        runs = []
        for i in range(repeats):
            r = stall_once(args, model, data, rule_on)
            print("%s, run %d: %s" % (label, i + 1,
                                      ", ".join("%s %.0f ms" % kv for kv in r.items())),
                  flush=True)
            runs.append(r)
        results[label] = runs
    print("\nstall of local worker 1 at step %d, %d workers, fixture %s (%s):" % (
        args.stall_step, args.world_size, args.kind,
        "--no-agent" if args.no_agent else "through the node agent"))
    print("%-42s %10s %10s %10s" % ("median over runs", "detect", "re-form", "resume"))
    for label, runs in results.items():
        if not runs:
            continue
        print("%-42s %8.2f s %8.2f s %8.2f s   (%d runs)" % (
            label, *(statistics.median(r[k] for r in runs) / 1e3
                     for k in ("detect", "re-form", "resume")), len(runs)))
    on = [r["resume"] for r in results[next(iter(results))]]
    if on:
        print("goal: resume within 10 s with the rule on: %s (median %.2f s)" % (
            "MET" if statistics.median(on) <= 10000 else "MISSED", statistics.median(on) / 1e3))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""concord-train --model builtin:cnn --sync-bn: W ranks with batch b and
SyncBatchNorm must train exactly like one process with batch W*b and plain
BatchNorm (rank r's k-th batch holds samples r + W*(b*k + j), so the W
batches of step k together are the single process's k-th batch; the loss is
a mean over equal local batches, DDP averages gradients, SyncBN normalises
with the statistics of the whole step). Plain BatchNorm over W ranks must
not (it normalises per rank), which shows the test can fail.

    /usr/bin/python3 tests/integration/test_sync_bn_train.py --bin-dir B [--world-size W]
    /usr/bin/python3 tests/integration/test_sync_bn_train.py --bin-dir B --elastic

--elastic: the SyncBN group follows the generation. Three ranks,
one SIGKILLed (CONCORD_TEST_KILL) before its first forward: the survivors'
SyncBN allgather over three fails, they re-form as two, and the job must end
bit-identical to a fault-free two-rank SyncBN job (which the plain case shows
equals one process with twice the batch). Then one killed in the backward of
step 6, after SyncBN's forward has updated the running statistics: the two
survivors must end identical, with num_batches_tracked equal to the job's
optimizer steps (the rolled-back step's update of the running statistics
undone, the retried step's counted once).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))
import fixtures  # noqa: E402
import processes  # noqa: E402

BATCH, EPOCHS = 8, 2


ELASTIC = ["--min-workers", "2", "--heartbeat-interval-ms", "200",
           "--heartbeat-timeout-ms", "2000", "--collective-timeout-ms", "20000"]


def brief(metrics):
    return {k: metrics.get(k) for k in ("world_size", "generation", "reforms",
                                        "optimizer_steps")} | {
        "reasons": [g.get("reason") for g in metrics.get("reform_log", [])]}


def bn_counters(state):
    return {k: int(v) for k, v in state.items() if k.endswith("num_batches_tracked")}


def elastic_cases(checks, run, train, data, tmp):
    """--elastic (see the module docstring)."""
    def job(name, nproc, kill=None):
        out = os.path.join(tmp, name)
        os.makedirs(os.path.join(out, "workers"))
        cmd = [run, "--standalone", "--nproc", str(nproc), "--job-id", name] + ELASTIC + [
            "--", train, "--model", "builtin:cnn", "--data", data, "--batch-size", str(BATCH),
            "--epochs", str(EPOCHS), "--lr", "0.05", "--shuffle", "--seed", "11", "--sync-bn",
            # No buffer broadcast before each forward: SyncBN's statistics
            # allgather is the first collective a death interrupts.
            "--no-broadcast-buffers", "--output", os.path.join(out, "final.pt"),
            "--output-per-worker", os.path.join(out, "workers"),
            "--metrics-out", os.path.join(out, "metrics.json"), "--log-interval", "1000"]
        r = processes.run_command(cmd, timeout=240,
                                 env={"CONCORD_TEST_KILL": kill} if kill else None)
        want = 0  # the job completed, a worker lost or not (see Note [Exit status])
        checks.check(r.returncode == want, "%s: concord-run exits %d" % (name, want),
                     r.describe())
        workers = os.path.join(out, "workers")
        states = [fixtures.load_state(os.path.join(workers, f)) for f in sorted(os.listdir(workers))
                  if f.endswith(".pt")] if os.path.isdir(workers) else []
        metrics = None
        if os.path.isfile(os.path.join(out, "metrics.json")):
            with open(os.path.join(out, "metrics.json")) as f:
                metrics = json.load(f)
        return states, metrics, r

    ref, ref_metrics, _ = job("fault-free-w2", 2)
    pre, pre_metrics, r = job("killed-before-step-1", 3, kill="2:1:forward")
    checks.check("killing myself at step 1" in r.stderr, "the third rank died before step 1",
                 r.stderr[-2000:])
    checks.check(len(pre) == 2 and len(ref) == 2, "two finishers in both jobs",
                 "%d and %d" % (len(pre), len(ref)))
    if len(pre) == 2 and len(ref) == 2:
        diff = [k for k in ref[0] if not all(torch.equal(s[k], ref[0][k]) for s in pre)]
        checks.check(not diff, "death before step 1: bit-identical to a fault-free 2-rank "
                     "SyncBN job", "differ: %s" % diff[:5])
    if pre_metrics and ref_metrics:
        checks.check(pre_metrics.get("world_size") == 2 and
                     pre_metrics.get("optimizer_steps") == ref_metrics.get("optimizer_steps"),
                     "same world size and steps as the fault-free job",
                     "%s vs %s" % (brief(pre_metrics), brief(ref_metrics)))
        checks.check(any("SyncBatchNorm statistics allgather" in g.get("reason", "")
                         for g in pre_metrics.get("reform_log", [])),
                     "the death interrupted SyncBN's statistics allgather",
                     "%s" % brief(pre_metrics))

    mid, mid_metrics, r = job("killed-in-backward-6", 3, kill="2:6:backward")
    checks.check("killing myself at step 6" in r.stderr, "the third rank died in step 6",
                 r.stderr[-2000:])
    checks.check(len(mid) == 2, "two finishers", "%d" % len(mid))
    if len(mid) == 2:
        diff = [k for k in mid[0] if not torch.equal(mid[0][k], mid[1][k])]
        checks.check(not diff, "the survivors end identical", "differ: %s" % diff[:5])
    if mid and mid_metrics:
        steps = mid_metrics.get("optimizer_steps")
        counters = bn_counters(mid[0])
        checks.check(counters and all(c == steps for c in counters.values()),
                     "num_batches_tracked == optimizer steps (%s) after the rolled-back step"
                     % steps, "%s" % counters)
        checks.check(mid_metrics.get("world_size") == 2 and mid_metrics.get("reforms", 0) >= 1,
                     "the job re-formed to 2 ranks", "%s" % brief(mid_metrics))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--elastic", action="store_true",
                   help="the SyncBN group across a re-form (3 ranks, one killed)")
    args = p.parse_args()
    w = 3 if args.elastic else args.world_size
    checks = fixtures.Checks()
    run = os.path.join(args.bin_dir, "concord-run")
    train = os.path.join(args.bin_dir, "concord-train")
    with tempfile.TemporaryDirectory(prefix="concord-syncbn-") as tmp:
        n = 20 * BATCH * w  # equal local batches on every step
        subprocess.run([sys.executable, os.path.join(HERE, "..", "..", "examples", "make_demo.py"),
                        "--out", tmp, "--samples", str(n)], check=True, stdout=subprocess.DEVNULL)
        data = os.path.join(tmp, "data.pt")

        def concord(nproc, batch, out, extra):
            cmd = [run, "--standalone", "--nproc", str(nproc), "--", train,
                   "--model", "builtin:cnn", "--data", data, "--batch-size", str(batch),
                   "--epochs", str(EPOCHS), "--lr", "0.05", "--output", out,
                   "--log-interval", "1000"] + extra
            r = processes.run_command(cmd, timeout=240)
            checks.check(r.returncode == 0, "concord-run --nproc %d %s" % (nproc, " ".join(extra)),
                         r.describe())
            return fixtures.load_state(out) if r.returncode == 0 else None

        if args.elastic:
            elastic_cases(checks, run, train, data, tmp)
            return checks.finish()
        one = concord(1, BATCH * w, os.path.join(tmp, "one.pt"), [])
        sync = concord(w, BATCH, os.path.join(tmp, "sync.pt"), ["--sync-bn"])
        plain = concord(w, BATCH, os.path.join(tmp, "plain.pt"), [])
        if one and sync and plain:
            problems = fixtures.compare_states(sync, one, rtol=1e-4, atol=1e-5)
            checks.check(not problems, "W=%d SyncBN batch %d == one process batch %d (rtol 1e-4)"
                         % (w, BATCH, BATCH * w), "; ".join(problems[:5]))
            gap = max(fixtures.max_rel_diff(plain[k], one[k]) for k in one)
            checks.check(gap > 1e-2, "plain BatchNorm over %d ranks differs" % w,
                         "max rel diff %.3g" % gap)
            checks.check(int(sync["1.num_batches_tracked"]) == EPOCHS * 20,
                         "running statistics advanced once per step")
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""SlowMo across a membership change: real concord-run +
concord-train processes, one worker SIGKILLed after committing a step and
before SlowMo's averaging of it (CONCORD_TEST_KILL phase 'slowmo'), so the
survivors' collectives fail in the middle of the average.

    /usr/bin/python3 tests/integration/test_slowmo_elastic.py --bin-dir build/bin

Cases:
  localsgd-sharded  slowmo-localsgd, memory-efficient over 3 shards, W=3 -> 2,
                    killed at step 8, a slow-momentum step: the survivors
                    re-form, re-shard u and x_old (the dead owner's slice
                    comes from its replica on the next rank, logged by
                    every survivor; no slice restarts), finish update 8 in
                    the new generation (logged) and end with bit-identical
                    models.
  sgp-full          slowmo-sgp on a ring, slow-momentum state not sharded,
                    W=4 -> 3, killed at step 5: only the dead rank's
                    out-peer fails inside update 5 (the others' messages
                    went out), so update 5 is finished after the re-form
                    by everyone or, when the authoritative rank had
                    completed it, by no one; training ends (gossip does not
                    make models equal).
  localsgd-restart  as localsgd-sharded (but averaging every step, so that
                    the end is an average whatever the number of steps)
                    with --max-restarts 1 and 12 epochs: the killed worker
                    comes back as a newcomer, takes the state and the
                    slow-momentum shards are spread over 3 again; 3
                    bit-identical models at the end.
With --train-flag --device --train-flag cuda:0 (the gpu suite's
integration_slowmo_elastic_cuda) the workers share cuda:0 over Gloo and the
slow-momentum state, its masks and exchange buffers live on the device.
Checked for each: concord-run exits 0 (the job completed, with or without
the restart: see Note [Exit status] in tools/launcher.h) within a bounded time; the authoritative rank's metrics say
the final world size after one re-form (two with the restart) and the job
took every step of its data.
The exact arithmetic of the re-shard (the state after it equal to the
no-loss state, bit for bit) is checked in-process
(SlowMoTest.MembershipChangeReshardsSlowMomentum, ShardLostWithItsReplicaRestarts).
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))

import torch  # noqa: E402

import fixtures  # noqa: E402
import testlib  # noqa: E402

HEARTBEAT = ["--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "2000"]
TIMEOUT = 150


def run_case(args, tmp, name, world, kill, algorithm_flags, expect_identical, logs,
             restarts=0, epochs=2):
    fx = os.path.join(tmp, "fixture")
    model, data = fixtures.make_fixture(fx, "mlp-plain", 600, 3)
    rd = os.path.join(tmp, name)
    workers = os.path.join(rd, "workers")
    os.makedirs(workers)
    metrics = os.path.join(rd, "metrics.json")
    cmd = [os.path.join(args.bin_dir, "concord-run"), "--standalone", "--nproc", str(world),
           "--min-workers", str(world - 1), "--job-id", name,
           "--max-restarts", str(restarts),
           "--collective-timeout-ms", "20000", "--rendezvous-timeout-ms", "20000"] + HEARTBEAT
    cmd += ["--", os.path.join(args.bin_dir, "concord-train"), "--model", model, "--data", data,
            "--loss", "mse", "--lr", "0.05", "--momentum", "0.9", "--batch-size", "8",
            "--epochs", str(epochs), "--output-per-worker", workers, "--metrics-out", metrics,
            "--log-interval", "1000"] + algorithm_flags + args.train_flag
    env = dict(os.environ, CONCORD_TEST_KILL=kill, OMP_NUM_THREADS="1")
    problems = []
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=TIMEOUT, universal_newlines=True, start_new_session=True)
    except subprocess.TimeoutExpired:
        return ["did not finish within %d s" % TIMEOUT]
    err = proc.stderr
    expected_status = 0  # the job completed (see Note [Exit status])
    if proc.returncode != expected_status:
        problems.append("concord-run exited %d, expected %d" % (proc.returncode,
                                                               expected_status))
    if "CONCORD_TEST_KILL: killing myself" not in err:
        problems.append("no worker killed itself")
    survivors = world - 1
    finishers = world if restarts else survivors
    for text, everyone in logs:
        count = sum(1 for line in err.splitlines() if text in line)
        if everyone is None:  # must not happen
            if count:
                problems.append("%r logged by %d workers, expected none" % (text, count))
            continue
        if count != survivors and (everyone or count != 0):
            problems.append("%r logged by %d workers, expected %s%d" % (
                text, count, "" if everyone else "0 or ", survivors))
    outputs = sorted(glob.glob(os.path.join(workers, "*.pt")))
    if len(outputs) != finishers:
        problems.append("%d per-worker outputs, expected %d" % (len(outputs), finishers))
    states = [fixtures.load_state(p) for p in outputs]
    for st in states:
        for k, v in st.items():
            if not torch.isfinite(v).all():
                problems.append("%s is not finite" % k)
    if expect_identical and len(states) > 1:
        for k in states[0]:
            if not all(torch.equal(states[0][k], s[k]) for s in states[1:]):
                problems.append("survivors' %s differ" % k)
    try:
        with open(metrics) as f:
            m = json.load(f)
        reforms = 2 if restarts else 1
        if m["world_size"] != finishers or m["reforms"] != reforms:
            problems.append("metrics: world size %s, reforms %s" % (m["world_size"],
                                                                  m["reforms"]))
        # Elastic sharding: epochs of 600 samples in windows of world x 8.
        if m["optimizer_steps"] < epochs * 600 // (world * 8):
            problems.append("only %d optimizer steps" % m["optimizer_steps"])
    except (OSError, ValueError, KeyError) as e:
        problems.append("metrics: %s" % e)
    if problems:
        tail = "\n".join(err.splitlines()[-25:])
        problems.append("stderr tail:\n" + tail)
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--case", action="append", default=[],
                        help="run only these cases (repeatable; default: all)")
    parser.add_argument("--train-flag", action="append", default=[],
                        help="a concord-train flag every case adds (repeatable)")
    parser.add_argument("--require-cuda", action="store_true",
                        help="print 'CONCORD_TEST_SKIPPED: no CUDA device' and exit 0 without one")
    args = parser.parse_args()
    if args.require_cuda and testlib.no_cuda_reason():
        print(testlib.no_cuda_reason())
        return 0
    # Steps of at least 3 ms (concord-train's CONCORD_TEST_MIN_STEP_MS): the
    # restarted worker must find the job still running, whatever the
    # transport's speed (test_elastic.py does the same).
    os.environ.setdefault("CONCORD_TEST_MIN_STEP_MS", "3")
    tmp = tempfile.mkdtemp(prefix="concord-slowmo-")
    cases = [
        ("localsgd-sharded", 3, "2:8:slowmo",
         ["--algorithm", "slowmo-localsgd", "--localsgd-frequency", "2",
          "--slowmo-frequency", "4", "--slowmo-num-shards", "3"],
         True, [("taken from replicas", True), ("SlowMo: finishing update 8", True),
                ("lost with their owner", None)]),
        ("sgp-full", 4, "1:5:slowmo",
         ["--algorithm", "slowmo-sgp", "--sgp-graph", "ring", "--slowmo-frequency", "4",
          "--slowmo-memory-efficient", "false"],
         False, [("SlowMo: finishing update 5", False)]),
        # The killed worker comes back as a newcomer (--max-restarts 1): it
        # takes u, x_old (sharded over 3 again) and the update count over
        # the communicator; every model ends bit-identical.
        ("localsgd-restart", 3, "1:8:slowmo",
         ["--algorithm", "slowmo-localsgd", "--localsgd-frequency", "1",
          "--slowmo-frequency", "4", "--slowmo-num-shards", "3"],
         True, [("SlowMo: finishing update 8", True)], 1, 12),
    ]
    unknown = set(args.case) - {c[0] for c in cases}
    if unknown:
        parser.error("unknown case(s): %s" % ", ".join(sorted(unknown)))
    if args.case:
        cases = [c for c in cases if c[0] in args.case]
    failed = 0
    for case in cases:
        name = case[0]
        problems = run_case(args, tmp, *case)
        print("%s: %s" % (name, "ok" if not problems else "FAILED"))
        for p in problems:
            print("  " + p)
        failed += bool(problems)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    print("%d passed, %d failed" % (len(cases) - failed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Benchmark: a sharded job's checkpoints with the shards copied where they
are against the shards sent to the node's snapshot writer as bytes (see Note
[Shards copied where they are] in worker/elastic/state.h; issue 48).

Usage (Debian's python3, which has torch; build concord-train and
concord-run first):

    /usr/bin/python3 bench/zero_checkpoint.py --bin-dir build/bin
    /usr/bin/python3 bench/zero_checkpoint.py --bin-dir build/bin --world-size 4 \\
        --steps 60 --every 5 --repeat 3

What it does:
  1. Writes tests/reference/fixtures.py's mlp-large task (~2.6 M parameters;
     Adam's state ~21 MB), --steps full batches a rank.
  2. Trains it with `concord-run --standalone --nproc W -- concord-train
     --optimizer adam --zero --checkpoint-every K` (one node, concord-run's
     shared snapshot region) twice per repeat, interleaved:
     - in place: ranks 1..W-1 copy their shards into the node's snapshot
       themselves (the default);
     - as bytes: CONCORD_TEST_SHARDS_AS_BYTES=1, every rank sends its shard
       to rank 0 (the node's writer) as serialized bytes, which rank 0
       unpacks and copies in (what Concord did before).
  3. Prints, per side (the median over --repeat runs): rank 0's mean step
     time over the steps that take a checkpoint and over the others (ms, the
     first 2 steps left out), and rank 0's peak RSS (the writer's; it maps
     the node's snapshot region either way). Then checks that the two sides'
     last checkpoints hold the same optimizer.pt, tensor for tensor.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))

import fixtures  # noqa: E402

KIND = "mlp-large"
WARMUP = 2
MIB = 1024.0 * 1024.0
SIDES = (("in place", {}), ("as bytes", {"CONCORD_TEST_SHARDS_AS_BYTES": "1"}))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--world-size", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--every", type=int, default=5, help="--checkpoint-every")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    p.add_argument("--repeat", type=int, default=2, help="runs per side, interleaved")
    p.add_argument("--timeout", type=float, default=600)
    return p.parse_args()


def run(args, tmp, model, data, name, extra_env):
    out = os.path.join(tmp, name)
    os.makedirs(out, exist_ok=True)
    metrics = os.path.join(out, "metrics.json")
    ck = os.path.join(out, "ck")
    job = "bench-" + name
    cmd = [os.path.join(args.bin_dir, "concord-run"), "--standalone",
           "--nproc", str(args.world_size), "--job-id", job,
           "--checkpoint-dir", ck, "--checkpoint-every", str(args.every), "--",
           os.path.join(args.bin_dir, "concord-train"), "--model", model, "--data", data,
           "--loss", fixtures.default_loss(KIND), "--optimizer", "adam", "--lr", "1e-3",
           "--batch-size", str(args.batch_size), "--epochs", "1", "--seed", "1",
           "--log-interval", "1000000", "--metrics-out", metrics, "--zero"]
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra_env)
    with open(os.path.join(out, "stdout"), "w") as so, open(os.path.join(out, "stderr"), "w") as se:
        try:
            rc = subprocess.run(cmd, env=env, stdout=so, stderr=se, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            sys.exit("%s timed out after %.0f s" % (name, args.timeout))
    if rc != 0:
        with open(os.path.join(out, "stderr")) as f:
            sys.exit("%s failed (exit %d):\n%s" % (name, rc, f.read()[-3000:]))
    with open(metrics) as f:
        m = json.load(f)
    # [step, ms] pairs; step k takes a checkpoint at its commit when k %
    # every == 0.
    times = m["step_times_ms"][WARMUP:]
    ckpt = [t for step, t in times if step % args.every == 0]
    other = [t for step, t in times if step % args.every != 0]
    last = max(int(d.split("-")[1]) for d in os.listdir(os.path.join(ck, job))
               if d.startswith("step-"))
    return {"ckpt_ms": sum(ckpt) / max(len(ckpt), 1), "other_ms": sum(other) / max(len(other), 1),
            "rss": m["peak_rss_bytes"],
            "optimizer": os.path.join(ck, job, "step-%d" % last, "optimizer.pt")}


def median(values):
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def same_state(a, b):
    sa, sb = torch.load(a), torch.load(b)
    if sa["param_groups"] != sb["param_groups"] or sorted(sa["state"]) != sorted(sb["state"]):
        return False
    return all(torch.equal(sa["state"][i][k], sb["state"][i][k])
               for i in sa["state"] for k in sa["state"][i])


def main():
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="concord-zero-ckpt-") as tmp:
        model, data = fixtures.make_fixture(os.path.join(tmp, "task"), KIND,
                                            args.steps * args.world_size * args.batch_size, 1)
        got = {name: [] for name, _ in SIDES}
        for r in range(args.repeat):
            for name, extra in SIDES:
                got[name].append(run(args, tmp, model, data,
                                     "%s-%d" % (name.replace(" ", "-"), r), extra))
        print("%d ranks, one node, mlp-large, Adam, --zero, a checkpoint every %d steps, "
              "%d steps; median of %d runs" % (args.world_size, args.every, args.steps,
                                               args.repeat))
        print("%-10s %16s %16s %14s" % ("shards", "checkpoint step", "other steps",
                                        "rank 0 peak"))
        for name, _ in SIDES:
            runs = got[name]
            print("%-10s %13.2f ms %13.2f ms %10.1f MiB" % (
                name, median([x["ckpt_ms"] for x in runs]),
                median([x["other_ms"] for x in runs]),
                median([x["rss"] for x in runs]) / MIB))
        same = same_state(got["in place"][-1]["optimizer"], got["as bytes"][-1]["optimizer"])
        print("last checkpoints' optimizer.pt: %s" % ("the same" if same else "DIFFERENT"))
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

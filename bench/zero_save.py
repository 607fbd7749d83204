#!/usr/bin/python3
"""Benchmark: a loop without run_elastic saving a sharded Adam's state
(concord::save_checkpoint with a ZeroRedundancyOptimizer), the shards written
where they are against gathered on rank 0 as bytes (see Note [Shards written
where they are] in worker/checkpoint/disk.h; issue 48).

Usage (Debian's python3, which has torch; build concord-run and
concord-bench-zero-save first):

    /usr/bin/python3 bench/zero_save.py --bin-dir build/bin
    /usr/bin/python3 bench/zero_save.py --bin-dir build/bin --world-size 4 --mib 128 \\
        --saves 3 --repeat 3

What it does:
  1. Runs `concord-run --standalone --nproc W -- concord-bench-zero-save`
     twice per repeat, interleaved: every rank a ZeroRedundancyOptimizer
     over Adam and --mib MiB of parameters (4 square Linear layers), one
     step (each rank's shard of Adam's state: 2 floats a parameter it steps),
     then --saves checkpoints into a fresh directory:
     - in place: rank 0 writes the files with the other shards as holes,
       each rank writes its own into them (the default);
     - as bytes: CONCORD_TEST_SHARDS_AS_BYTES=1, every rank sends its shard
       to rank 0, which writes the whole state (what Concord did before).
  2. Prints, per side: rank 0's save time (ms, the median over every save
     of every repeat); how much rank 0's peak RSS grew over the saves
     (ru_maxrss after the last save against before the first; MiB, the
     largest over the repeats) and the largest growth on another rank; the
     shard of the state rank 0 holds, and the whole state (MiB).
  3. Checks that the two sides' last optimizer.pt hold the same tensors.
"""

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "reference"))
import processes  # noqa: E402

MIB = 1 << 20
SIDES = (("in place", {}), ("as bytes", {"CONCORD_TEST_SHARDS_AS_BYTES": "1"}))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", required=True, help="concord-run, concord-bench-zero-save")
    p.add_argument("--world-size", type=int, default=3)
    p.add_argument("--mib", type=float, default=64.0, help="MiB of parameters")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    if args.world_size < 2 or args.saves < 1 or args.repeat < 1 or args.mib <= 0:
        p.error("--world-size >= 2, --saves >= 1, --repeat >= 1 and --mib > 0")
    return args


def run(args, tmp, side, env, repeat):
    """One job: every rank's JSON line, and its checkpoint directory."""
    ckpt = os.path.join(tmp, "%s-%d" % (side.replace(" ", "-"), repeat))
    cmd = [os.path.join(args.bin_dir, "concord-run"), "--standalone",
           "--nproc", str(args.world_size), "--job-id", "zero-save", "--",
           os.path.join(args.bin_dir, "concord-bench-zero-save"), "--mib", str(args.mib),
           "--saves", str(args.saves), "--dir", ckpt]
    r = processes.run_command(cmd, timeout=600, env=env)
    if r.returncode != 0 or r.timed_out:
        sys.exit("%s: failed\n%s" % (side, r.describe()))
    ranks = {}
    for line in r.stdout.splitlines():
        # concord-run prefixes each worker's lines: "[worker N] {...}".
        brace = line.find("{")
        if brace >= 0:
            d = json.loads(line[brace:])
            ranks[d["rank"]] = d
    if sorted(ranks) != list(range(args.world_size)):
        sys.exit("%s: ranks %s reported\n%s" % (side, sorted(ranks), r.describe()))
    return ranks, ckpt


def last_optimizer(ckpt):
    found = sorted(glob.glob(os.path.join(ckpt, "*", "step-*", "optimizer.pt")))
    if not found:
        sys.exit("no optimizer.pt under %s" % ckpt)
    return torch.load(found[-1], weights_only=False)


def same(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def main():
    args = parse_args()
    results = {side: [] for side, _ in SIDES}
    last = {}
    with tempfile.TemporaryDirectory(prefix="zero_save_") as tmp:
        for repeat in range(args.repeat):
            for side, env in SIDES:
                ranks, ckpt = run(args, tmp, side, env, repeat)
                results[side].append(ranks)
                last[side] = last_optimizer(ckpt)
        identical = same(last[SIDES[0][0]], last[SIDES[1][0]])
    state = 2 * args.mib  # Adam: two floats a parameter
    print("save_checkpoint of a sharded Adam: %d ranks, %.0f MiB of parameters (state %.0f MiB), "
          "%d saves, %d run(s) of each side" % (args.world_size, args.mib, state, args.saves,
                                                 args.repeat))
    print("%-9s %16s %22s %26s %18s" % ("side", "rank 0 save ms", "rank 0 peak +MiB",
                                         "others' largest peak +MiB", "rank 0 shard MiB"))
    for side, _ in SIDES:
        runs = results[side]
        ms = statistics.median(t for r in runs for t in r[0]["save_ms"])

        def grew(d):
            return (d["peak_after_kib"] - d["peak_before_kib"]) / 1024.0

        rank0 = max(grew(r[0]) for r in runs)
        others = max(grew(d) for r in runs for k, d in r.items() if k != 0)
        shard = runs[0][0]["shard_bytes"] / MIB
        print("%-9s %16.1f %22.1f %26.1f %18.1f" % (side, ms, rank0, others, shard))
    print("(save ms: the median over every save; peak +MiB: ru_maxrss after the last save "
          "against before the first, the largest over the runs)")
    print("the two sides' last optimizer.pt: %s" % ("the same tensors" if identical
                                                     else "DIFFERENT"))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""concord-train --model builtin:cnn --sync-bn: W ranks with batch b and
SyncBatchNorm must train exactly like one process with batch W*b and plain
BatchNorm (rank r's k-th batch holds samples r + W*(b*k + j), so the W
batches of step k together are the single process's k-th batch; the loss is
a mean over equal local batches, DDP averages gradients, SyncBN normalises
with the statistics of the whole step). Plain BatchNorm over W ranks must
not (it normalises per rank), which shows the test can fail.

    /usr/bin/python3 tests/integration/test_sync_bn_train.py --bin-dir B [--world-size W]
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))
import fixtures  # noqa: E402

BATCH, EPOCHS = 8, 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args()
    w = args.world_size
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
            r = fixtures.run_command(cmd, timeout=240)
            checks.check(r.returncode == 0, "concord-run --nproc %d %s" % (nproc, " ".join(extra)),
                         r.describe())
            return torch.load(out) if r.returncode == 0 else None

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

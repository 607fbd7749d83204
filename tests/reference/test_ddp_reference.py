#!/usr/bin/python3
"""Reference test: Concord's DDP must end with the same parameters and buffers
as PyTorch's own DistributedDataParallel (gloo) on the same TorchScript model
and data.

    /usr/bin/python3 tests/reference/test_ddp_reference.py --bin-dir build/bin \
        --world-size 2 [--kind cnn|mlp] [--keep]

Steps:
  1. Write a fixture (model.pt, data.pt) in a temporary directory. The sample
     count gives every rank the same number of batches with a last partial
     batch: samples = W*B*F + W*P (B = batch size, F full batches per rank,
     P < B the partial batch), so each rank has F full batches and one of P.
     Defaults: B=8, F=2, P=5, 2 epochs (6 steps), SGD lr 0.02, momentum 0.9,
     weight decay 1e-4. (P=3 or lr 0.05 put BatchNorm1d on 3 samples into a
     regime where float summation order alone moves results by ~1e-6; the
     defaults keep the gap between two valid DDP implementations under a
     tenth of the tolerance.)
  2. Train it with PyTorch DDP (torch_ddp_train.py, W processes) and check
     that reference against a single-process simulation of DDP's semantics
     (fixtures.simulate_ddp), so a failure below is Concord's, not the
     reference's.
  3. Train it with `concord-run --standalone --nproc W -- concord-train ...`.
  4. Compare the two final state dicts: same keys, dtypes and shapes; floats
     allclose(rtol=1e-5, atol=1e-6); integers (num_batches_tracked) exactly.
     Also: every parameter changed from its initial value (training did
     something), and Concord's metrics say world_size W and the expected step
     count.
Prints one line per check and a final 'N passed, N failed'; exits 1 on any
failure.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import fixtures  # noqa: E402


class Checks(object):
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def ok(self, name, detail=""):
        self.passed += 1
        print("PASS %s%s" % (name, (": " + detail) if detail else ""), flush=True)

    def fail(self, name, detail):
        self.failed += 1
        print("FAIL %s: %s" % (name, detail), flush=True)

    def check(self, cond, name, detail=""):
        if cond:
            self.ok(name)
        else:
            self.fail(name, detail)
        return cond

    def finish(self):
        print("%d passed, %d failed" % (self.passed, self.failed), flush=True)
        return 1 if self.failed else 0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", required=True, help="directory with concord-run and concord-train")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--kind", choices=("cnn", "mlp"), default="cnn")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--full-batches", type=int, default=2, help="full batches per rank per epoch")
    p.add_argument("--partial", type=int, default=5,
                   help="size of each rank's last partial batch (3 makes BatchNorm1d ill-conditioned)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1234, help="fixture seed")
    p.add_argument("--shuffle-seed", type=int, default=None,
                   help="also pass --shuffle --seed S to both trainers (per-epoch "
                        "torch.randperm seeded with S + epoch)")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-6)
    p.add_argument("--timeout", type=float, default=180.0, help="per training run, seconds")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args()
    if not (0 < args.partial < args.batch_size):
        p.error("--partial must be in [1, batch-size)")
    return args


def hyper_flags(args, loss):
    flags = ["--loss", loss, "--optimizer", "sgd", "--lr", repr(args.lr),
             "--momentum", repr(args.momentum), "--weight-decay", repr(args.weight_decay),
             "--batch-size", str(args.batch_size), "--epochs", str(args.epochs)]
    if args.shuffle_seed is not None:
        flags += ["--shuffle", "--seed", str(args.shuffle_seed)]
    return flags


def report_mismatch(checks, name, actual, expected, rtol, atol):
    failures = fixtures.compare_states(actual, expected, rtol=rtol, atol=atol)
    if not failures:
        worst = 0.0
        for k in expected:
            if expected[k].is_floating_point():
                worst = max(worst, fixtures.max_rel_diff(actual[k], expected[k]))
        checks.ok(name, "%d tensors, max rel diff %.3e" % (len(expected), worst))
        return True
    detail = ["%d of %d tensors differ" % (len(failures), len(expected))] + ["  " + f for f in failures]
    # Per-tensor max relative difference, for diagnosis.
    detail.append("  max relative difference per tensor:")
    for k in sorted(set(actual) & set(expected)):
        a, e = actual[k], expected[k]
        if a.shape == e.shape and a.is_floating_point() and e.is_floating_point():
            detail.append("    %-28s %.3e" % (k, fixtures.max_rel_diff(a, e)))
        elif a.shape == e.shape and a.dtype == e.dtype:
            detail.append("    %-28s %s" % (k, "equal" if torch.equal(a, e) else "NOT equal"))
    checks.fail(name, "\n".join(detail))
    return False


def run(args, checks, tmp):
    W = args.world_size
    loss = fixtures.default_loss(args.kind)
    per_rank = args.batch_size * args.full_batches + args.partial
    n_samples = W * per_rank
    steps_expected = args.epochs * (args.full_batches + 1)
    print("reference test: kind=%s loss=%s world_size=%d samples=%d (per rank %d: %d x %d + %d), "
          "epochs=%d, %d steps" % (args.kind, loss, W, n_samples, per_rank, args.full_batches,
                                   args.batch_size, args.partial, args.epochs, steps_expected),
          flush=True)

    model_pt, data_pt = fixtures.make_fixture(os.path.join(tmp, "fixture"), args.kind,
                                              n_samples, args.seed)
    initial = fixtures.initial_state(model_pt)
    param_names = fixtures.parameter_names(model_pt)
    common = ["--model", model_pt, "--data", data_pt] + hyper_flags(args, loss)

    # --- PyTorch DDP reference ------------------------------------------
    ref_out = os.path.join(tmp, "torch_final.pt")
    ref = fixtures.run_command(
        [sys.executable, os.path.join(HERE, "torch_ddp_train.py")] + common +
        ["--world-size", str(W), "--output", ref_out], timeout=args.timeout)
    if not checks.check(ref.returncode == 0 and not ref.timed_out and os.path.isfile(ref_out),
                        "pytorch reference trains", ref.describe()):
        return
    reference = fixtures.load_state(ref_out)

    # The reference against a hand-written simulation of DDP semantics.
    simulated = fixtures.simulate_ddp(model_pt, data_pt, loss, W, args.batch_size,
                                      args.epochs, lr=args.lr, momentum=args.momentum,
                                      weight_decay=args.weight_decay,
                                      shuffle_seed=args.shuffle_seed)
    report_mismatch(checks, "pytorch reference matches single-process DDP simulation",
                    reference, simulated, args.rtol, args.atol)
    nbt = [k for k in reference if k.endswith("num_batches_tracked")]
    checks.check(all(int(reference[k]) == steps_expected for k in nbt),
                 "reference num_batches_tracked == %d" % steps_expected,
                 str({k: int(reference[k]) for k in nbt}))

    # --- Concord --------------------------------------------------------
    bin_dir = os.path.abspath(args.bin_dir)
    run_bin = os.path.join(bin_dir, "concord-run")
    train_bin = os.path.join(bin_dir, "concord-train")
    missing = [b for b in (run_bin, train_bin) if not os.access(b, os.X_OK)]
    if missing:
        checks.fail("concord binaries present", "not found or not executable: %s" % missing)
        return
    c_out = os.path.join(tmp, "concord_final.pt")
    c_metrics = os.path.join(tmp, "concord_metrics.json")
    conc = fixtures.run_command(
        [run_bin, "--standalone", "--nproc", str(W), "--job-id", "reference-w%d-%s" % (W, args.kind),
         "--", train_bin] + common + ["--output", c_out, "--metrics-out", c_metrics],
        timeout=args.timeout)
    if not checks.check(conc.returncode == 0 and not conc.timed_out,
                        "concord-run --nproc %d concord-train exits 0" % W, conc.describe()):
        return
    if getattr(conc, "leftover_processes", False):
        print("WARNING: processes of concord-run were still alive after it exited (killed)",
              flush=True)
    if not checks.check(os.path.isfile(c_out), "concord wrote --output", conc.describe()):
        return
    try:
        concord = fixtures.load_state(c_out)
    except Exception as e:  # noqa: BLE001
        checks.fail("torch.load reads concord's --output", "%s: %s" % (type(e).__name__, e))
        return
    checks.ok("torch.load reads concord's --output")

    # --- compare ---------------------------------------------------------
    report_mismatch(checks, "concord final state == pytorch DDP final state (W=%d, %s)"
                    % (W, args.kind), concord, reference, args.rtol, args.atol)

    for label, state in (("reference", reference), ("concord", concord)):
        unchanged = [k for k in param_names
                     if k in state and k in initial and state[k].shape == initial[k].shape
                     and torch.equal(state[k], initial[k])]
        absent = [k for k in param_names if k not in state]
        checks.check(not unchanged and not absent,
                     "%s: every parameter changed from its initial value" % label,
                     "unchanged: %s, absent: %s" % (unchanged, absent))

    # --- metrics ---------------------------------------------------------
    if checks.check(os.path.isfile(c_metrics), "concord wrote --metrics-out"):
        try:
            with open(c_metrics) as f:
                m = json.load(f)
        except ValueError as e:
            checks.fail("concord metrics are JSON", str(e))
        else:
            checks.check(m.get("world_size") == W and m.get("steps") == steps_expected,
                         "concord metrics: world_size %d, steps %d" % (W, steps_expected),
                         "got world_size=%r steps=%r" % (m.get("world_size"), m.get("steps")))


def main():
    args = parse_args()
    checks = Checks()
    tmp = tempfile.mkdtemp(prefix="concord_ref_w%d_%s_" % (args.world_size, args.kind))
    try:
        run(args, checks, tmp)
    except Exception as e:  # noqa: BLE001 - an unexpected error is a failure, with its traceback
        import traceback
        traceback.print_exc()
        checks.fail("test ran to completion", "%s: %s" % (type(e).__name__, e))
    finally:
        if args.keep:
            print("kept %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

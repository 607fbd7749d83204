#!/usr/bin/python3
"""Benchmark: Concord DDP vs PyTorch DDP (gloo, CPU) on the same model, data
and world size, in one run.

Usage (Debian's python3, which has torch; build Concord first):

    /usr/bin/python3 bench/ddp_vs_pytorch.py --bin-dir build/bin
    /usr/bin/python3 bench/ddp_vs_pytorch.py --bin-dir build/bin --kind cnn --world-size 2 \
        --samples 8192 --epochs 2 --batch-size 32 --repeat 3

What it does:
  1. Writes a fixture (tests/reference/fixtures.py): model.pt (TorchScript)
     and data.pt. Kinds:
       mlp-large (default)  4 Linear layers, width 1024, ~2.6 M parameters,
                            ~10 MB of gradients per step: bucketing and
                            overlap of allreduce with backward matter.
       cnn                  the small CNN of the reference tests (tiny
                            gradients: measures per-step overhead).
       mlp                  the small BatchNorm MLP (mse).
  2. Trains it with PyTorch's DistributedDataParallel
     (tests/reference/torch_ddp_train.py, W processes) and with
     `concord-run --standalone --nproc W -- concord-train ...`, both with
     --metrics-out, the same hyper-parameters, and one compute thread per
     worker (--threads; OMP_NUM_THREADS for concord-train, torch.set_num_threads
     for the reference). With --repeat N the two alternate N times and the
     table shows the median of each metric.
  3. Prints step time mean/median (first 2 steps excluded), samples/s
     (global, whole loop), final loss and wall time for each, and the ratio
     concord/pytorch (< 1 for step time means Concord is faster; > 1 for
     samples/s means Concord is faster), plus how far apart the two final
     models are (informational: they should agree closely).

Timings on a shared 2-core machine are noisy: use --repeat and compare
ratios, not absolute numbers. Not a test; not registered with ctest.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REF_DIR = os.path.join(os.path.dirname(HERE), "tests", "reference")
sys.path.insert(0, REF_DIR)

import fixtures  # noqa: E402

METRICS = ("step_time_ms_mean", "step_time_ms_median", "samples_per_second", "final_loss")


def parse_args():
    p = argparse.ArgumentParser(description="Concord DDP vs PyTorch DDP step time",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--bin-dir", required=True, help="directory with concord-run and concord-train")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--kind", choices=("mlp-large", "cnn", "mlp"), default="mlp-large")
    p.add_argument("--samples", type=int, default=None,
                   help="data set size (default: 64 batches per rank per epoch)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=1, help="compute threads per worker")
    p.add_argument("--repeat", type=int, default=1, help="alternate the two trainers N times")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0, help="per training run, seconds")
    p.add_argument("--json-out", help="also write the results here as JSON")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args()
    if args.samples is None:
        args.samples = args.world_size * args.batch_size * 64
    return args


def run_pytorch(args, model, data, out_dir, loss):
    metrics = os.path.join(out_dir, "torch_metrics.json")
    final = os.path.join(out_dir, "torch_final.pt")
    cmd = [sys.executable, os.path.join(REF_DIR, "torch_ddp_train.py"),
           "--model", model, "--data", data, "--loss", loss, "--lr", repr(args.lr),
           "--momentum", repr(args.momentum), "--weight-decay", repr(args.weight_decay),
           "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
           "--world-size", str(args.world_size), "--threads", str(args.threads),
           "--output", final, "--metrics-out", metrics]
    return cmd, metrics, final


def run_concord(args, model, data, out_dir, loss):
    metrics = os.path.join(out_dir, "concord_metrics.json")
    final = os.path.join(out_dir, "concord_final.pt")
    b = os.path.abspath(args.bin_dir)
    cmd = [os.path.join(b, "concord-run"), "--standalone", "--nproc", str(args.world_size),
           "--job-id", "bench-ddp-vs-pytorch", "--",
           os.path.join(b, "concord-train"),
           "--model", model, "--data", data, "--loss", loss, "--optimizer", "sgd",
           "--lr", repr(args.lr), "--momentum", repr(args.momentum),
           "--weight-decay", repr(args.weight_decay), "--batch-size", str(args.batch_size),
           "--epochs", str(args.epochs), "--log-interval", "1000000",
           "--output", final, "--metrics-out", metrics]
    return cmd, metrics, final


def one_run(name, cmd, metrics_path, args):
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    r = fixtures.run_command(cmd, timeout=args.timeout, env=env)
    if r.returncode != 0 or r.timed_out or not os.path.isfile(metrics_path):
        print("%s failed:\n%s" % (name, r.describe()), file=sys.stderr)
        return None
    with open(metrics_path) as f:
        m = json.load(f)
    m["wall_s"] = r.elapsed
    return m


def fmt(v, digits=2):
    if v is None:
        return "-"
    if isinstance(v, float):
        return "%.*f" % (digits, v)
    return str(v)


def main():
    args = parse_args()
    for tool in ("concord-run", "concord-train"):
        path = os.path.join(args.bin_dir, tool)
        if not os.access(path, os.X_OK):
            print("ddp_vs_pytorch.py: %s not found or not executable (build first)" % path,
                  file=sys.stderr)
            return 2
    tmp = tempfile.mkdtemp(prefix="concord_bench_")
    try:
        loss = fixtures.default_loss(args.kind)
        model, data = fixtures.make_fixture(os.path.join(tmp, "fixture"), args.kind,
                                            args.samples, args.seed)
        n_params = sum(v.numel() for k, v in fixtures.initial_state(model).items()
                       if k in set(fixtures.parameter_names(model)))
        steps = args.epochs * fixtures.num_batches(args.samples, 0, args.world_size,
                                                   args.batch_size)
        print("kind=%s (%s, %.2f M parameters, %.1f MB of gradients), world size %d, "
              "%d samples, batch %d per rank, %d epochs, %d steps, %d thread(s) per worker, "
              "repeat %d" % (args.kind, loss, n_params / 1e6, n_params * 4 / 2 ** 20,
                             args.world_size, args.samples, args.batch_size, args.epochs, steps,
                             args.threads, args.repeat), flush=True)

        results = {"pytorch": [], "concord": []}
        finals = {}
        for i in range(args.repeat):
            # Alternate the order so neither always runs on a warm cache.
            order = ("pytorch", "concord") if i % 2 == 0 else ("concord", "pytorch")
            for name in order:
                maker = run_pytorch if name == "pytorch" else run_concord
                cmd, metrics, final = maker(args, model, data, tmp, loss)
                m = one_run(name, cmd, metrics, args)
                if m is None:
                    return 1
                results[name].append(m)
                finals[name] = final
                print("  run %d %-8s step mean %8.2f ms  median %8.2f ms  %10.1f samples/s"
                      % (i + 1, name, m["step_time_ms_mean"], m["step_time_ms_median"],
                         m["samples_per_second"]), flush=True)

        summary = {}
        for name, runs in results.items():
            summary[name] = {k: statistics.median([r[k] for r in runs])
                             for k in METRICS + ("wall_s",)}
            summary[name]["steps"] = runs[-1].get("steps")
            summary[name]["world_size"] = runs[-1].get("world_size")

        rows = [("step time mean (ms)", "step_time_ms_mean"),
                ("step time median (ms)", "step_time_ms_median"),
                ("samples/s", "samples_per_second"),
                ("final loss", "final_loss"),
                ("wall incl. startup (s)", "wall_s"),
                ("steps", "steps")]
        print()
        print("%-24s %14s %14s %16s" % ("", "pytorch DDP", "concord", "concord/pytorch"))
        for label, key in rows:
            p, c = summary["pytorch"].get(key), summary["concord"].get(key)
            ratio = (c / p) if key != "steps" and isinstance(p, (int, float)) \
                and isinstance(c, (int, float)) and p else None
            digits = 4 if key == "final_loss" else (1 if key == "samples_per_second" else 2)
            print("%-24s %14s %14s %16s" % (label, fmt(p, digits), fmt(c, digits), fmt(ratio, 3)))

        # Informational: did both do the same training?
        try:
            a = fixtures.load_state(finals["concord"])
            b = fixtures.load_state(finals["pytorch"])
            failures = fixtures.compare_states(a, b, rtol=1e-4, atol=1e-5)
            worst = max([fixtures.max_rel_diff(a[k], b[k]) for k in b
                         if k in a and b[k].is_floating_point() and a[k].shape == b[k].shape] or [0.0])
            print("\nfinal models: %s (max rel diff %.2e)"
                  % ("agree within rtol 1e-4" if not failures else
                     "DIFFER in %d tensors" % len(failures), worst))
            summary["final_models_agree"] = not failures
        except Exception as e:  # noqa: BLE001
            print("\nfinal models: could not compare (%s)" % e)

        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"config": vars(args), "summary": summary, "runs": results}, f, indent=2)
                f.write("\n")
    finally:
        if args.keep:
            print("kept %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

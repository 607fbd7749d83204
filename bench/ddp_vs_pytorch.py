#!/usr/bin/python3
"""Benchmark: Concord DDP vs PyTorch DDP on the same model, data, devices,
backend and world size, in one run (CPU with gloo by default; GPUs with
--device cuda).

Usage (Debian's python3, which has torch; build Concord first):

    /usr/bin/python3 bench/ddp_vs_pytorch.py --bin-dir build/bin
    /usr/bin/python3 bench/ddp_vs_pytorch.py --bin-dir build/bin --kind cnn --world-size 2 \
        --samples 8192 --epochs 2 --batch-size 32 --repeat 3
    /usr/bin/python3 bench/ddp_vs_pytorch.py --bin-dir build/bin \
        --sweep-bucket-cap-mb 1,5,25,100 --overlap

On GPUs (scripts/gpu-suite.sh runs these; rank r on cuda:r with NCCL, or
several ranks sharing cuda:0 with --device cuda:0 --backend gloo):

    python3 bench/ddp_vs_pytorch.py --bin-dir build-gpu/bin --device cuda \
        --backend nccl --world-size 2 --kind resnet50 --batch-size 64
    python3 bench/ddp_vs_pytorch.py --bin-dir build-gpu/bin --device cuda \
        --backend nccl --world-size 2 --kind mlp-350m --batch-size 32

What it does:
  1. Writes a fixture (tests/reference/fixtures.py): model.pt (TorchScript)
     and data.pt. Kinds:
       mlp-large (default)  4 Linear layers, width 1024, ~2.6 M parameters,
                            ~10 MB of gradients per step: bucketing and
                            overlap of allreduce with backward matter.
       cnn                  the small CNN of the reference tests (tiny
                            gradients: measures per-step overhead).
       mlp                  the small BatchNorm MLP (mse).
       resnet50, mlp-350m   the GPU benchmarks' models (bench/gpu_models.py):
                            ResNet-50 (25.6 M parameters) on 3 x S x S images
                            (--image-size) and a 352 M-parameter MLP.
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

  4. With --sweep-bucket-cap-mb LIST and/or --overlap, the same for several
     DDP configurations, and one table with a row per configuration, PyTorch
     and Concord side by side:
       bucket_cap_mb=C   both trainers with --bucket-cap-mb C (PyTorch's
                         bucket_cap_mb; the first bucket stays at PyTorch's
                         1 MiB in both)
       overlap on        the defaults: buckets are reduced while backward
                         goes on
       overlap off       Concord with --delay-allreduce (apex's
                         delay_allreduce: one allreduce per dtype after
                         backward). PyTorch's DDP has no switch to turn the
                         overlap off, so this row's PyTorch columns repeat its
                         default run (marked *).
     Columns: step time median (ms) of each and the ratio, the number of
     buckets (after the rebuild), and the DDP logging times of the last
     sampled iteration: backward communication and its overlap with backward
     compute (us; PyTorch's are its _get_ddp_logging_data() averages).

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
import processes  # noqa: E402
import gpu_models  # noqa: E402

METRICS = ("step_time_ms_mean", "step_time_ms_median", "samples_per_second", "final_loss")


def parse_args():
    p = argparse.ArgumentParser(description="Concord DDP vs PyTorch DDP step time",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--bin-dir", required=True, help="directory with concord-run and concord-train")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--kind", choices=("mlp-large", "cnn", "mlp") + gpu_models.KINDS,
                   default="mlp-large")
    p.add_argument("--image-size", type=int, default=64, help="resnet50's image side")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda (rank r on cuda:r) or cuda:N (every rank on one device)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
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
    p.add_argument("--sweep-bucket-cap-mb", metavar="LIST",
                   help="comma-separated bucket caps in MiB (e.g. 1,5,25,100): one row each")
    p.add_argument("--overlap", action="store_true",
                   help="add overlap on (defaults) / off (concord --delay-allreduce) rows")
    p.add_argument("--json-out", help="also write the results here as JSON")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args()
    if args.samples is None:
        args.samples = args.world_size * args.batch_size * 64
    args.caps = []
    if args.sweep_bucket_cap_mb:
        try:
            args.caps = [float(c) for c in args.sweep_bucket_cap_mb.split(",") if c.strip()]
        except ValueError:
            p.error("--sweep-bucket-cap-mb: expected numbers, e.g. 1,5,25,100")
        if not args.caps or min(args.caps) <= 0:
            p.error("--sweep-bucket-cap-mb: caps must be positive")
    return args


def configurations(args):
    """[(label, pytorch flags or None (no equivalent), concord flags)]."""
    configs = []
    for cap in args.caps:
        flag = ["--bucket-cap-mb", repr(cap)]
        configs.append(("bucket_cap_mb=%g" % cap, flag, flag))
    if args.overlap:
        configs.append(("overlap on (defaults)", [], []))
        configs.append(("overlap off (delay_allreduce)", None, ["--delay-allreduce"]))
    return configs or [("defaults", [], [])]


def run_pytorch(args, model, data, out_dir, loss, extra=(), tag=""):
    metrics = os.path.join(out_dir, "torch_metrics%s.json" % tag)
    final = os.path.join(out_dir, "torch_final%s.pt" % tag)
    cmd = [sys.executable, os.path.join(REF_DIR, "torch_ddp_train.py"),
           "--model", model, "--data", data, "--loss", loss, "--lr", repr(args.lr),
           "--momentum", repr(args.momentum), "--weight-decay", repr(args.weight_decay),
           "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
           "--world-size", str(args.world_size), "--threads", str(args.threads),
           "--output", final, "--metrics-out", metrics,
           "--device", args.device, "--backend", args.backend] + list(extra)
    return cmd, metrics, final


def run_concord(args, model, data, out_dir, loss, extra=(), tag=""):
    metrics = os.path.join(out_dir, "concord_metrics%s.json" % tag)
    final = os.path.join(out_dir, "concord_final%s.pt" % tag)
    b = os.path.abspath(args.bin_dir)
    cmd = [os.path.join(b, "concord-run"), "--standalone", "--nproc", str(args.world_size),
           "--job-id", "bench-ddp-vs-pytorch", "--",
           os.path.join(b, "concord-train"),
           "--model", model, "--data", data, "--loss", loss, "--optimizer", "sgd",
           "--lr", repr(args.lr), "--momentum", repr(args.momentum),
           "--weight-decay", repr(args.weight_decay), "--batch-size", str(args.batch_size),
           "--epochs", str(args.epochs), "--log-interval", "1000000",
           "--output", final, "--metrics-out", metrics,
           # concord-run gives rank r LOCAL_RANK r: "cuda" is cuda:r.
           "--device", args.device, "--backend", args.backend] + list(extra)
    return cmd, metrics, final


def one_run(name, cmd, metrics_path, args):
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    r = processes.run_command(cmd, timeout=args.timeout, env=env)
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


def compare_finals(concord_path, pytorch_path):
    """(agree within rtol 1e-4, max rel diff) of two final models."""
    a = fixtures.load_state(concord_path)
    b = fixtures.load_state(pytorch_path)
    failures = fixtures.compare_states(a, b, rtol=1e-4, atol=1e-5)
    worst = max([fixtures.max_rel_diff(a[k], b[k]) for k in b
                 if k in a and b[k].is_floating_point() and a[k].shape == b[k].shape] or [0.0])
    return not failures, worst


def summarize(runs):
    out = {k: statistics.median([r[k] for r in runs]) for k in METRICS + ("wall_s",)}
    for k in ("bucket_bytes", "steps", "world_size"):
        out[k] = runs[-1].get(k)
    for k in ("backward_comm_us", "overlap_us"):
        vals = [r[k] for r in runs if isinstance(r.get(k), (int, float))]
        out[k] = statistics.median(vals) if vals else None
    return out


def print_single(summary):
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


def print_sweep(table):
    """table: [(label, pytorch summary, pytorch_is_stand_in, concord summary, agree)]."""
    print()
    head = ("%-30s | %9s %9s %7s | %7s %7s | %9s %9s | %9s %9s | %s"
            % ("configuration", "pt ms", "cc ms", "cc/pt", "pt bkts", "cc bkts",
               "pt comm", "cc comm", "pt ovl", "cc ovl", "models"))
    print(head)
    print("-" * len(head))
    for label, p, stand_in, c, agree in table:
        star = "*" if stand_in else ""
        pm, cm = p.get("step_time_ms_median"), c.get("step_time_ms_median")
        ratio = cm / pm if isinstance(pm, (int, float)) and isinstance(cm, (int, float)) and pm \
            else None
        nb = lambda m: len(m["bucket_bytes"]) if m.get("bucket_bytes") else None  # noqa: E731
        print("%-30s | %9s %9s %7s | %7s %7s | %9s %9s | %9s %9s | %s" % (
            label, fmt(pm, 2) + star, fmt(cm, 2), fmt(ratio, 3), fmt(nb(p)) + star, fmt(nb(c)),
            fmt(p.get("backward_comm_us"), 0) + star, fmt(c.get("backward_comm_us"), 0),
            fmt(p.get("overlap_us"), 0) + star, fmt(c.get("overlap_us"), 0), agree))
    print("pt = PyTorch DDP, cc = Concord; ms = step time median; bkts = buckets after the "
          "rebuild;\ncomm / ovl = backward communication time / its overlap with backward "
          "compute (us, last sampled iteration).")
    if any(stand_in for _, _, stand_in, _, _ in table):
        print("* PyTorch's DDP cannot turn the overlap off: its columns repeat its run with "
              "default options.")
    print("models: do the final models agree within rtol 1e-4 (max rel diff)?")


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
        fixture_dir = os.path.join(tmp, "fixture")
        if args.kind in gpu_models.KINDS:
            loss = gpu_models.LOSS[args.kind]
            model, data = gpu_models.make_fixture(fixture_dir, args.kind, args.samples,
                                                  args.seed, args.image_size)
        else:
            loss = fixtures.default_loss(args.kind)
            model, data = fixtures.make_fixture(fixture_dir, args.kind, args.samples,
                                                args.seed)
        n_params = sum(v.numel() for k, v in fixtures.initial_state(model).items()
                       if k in set(fixtures.parameter_names(model)))
        steps = args.epochs * fixtures.num_batches(args.samples, 0, args.world_size,
                                                   args.batch_size)
        configs = configurations(args)
        print("kind=%s (%s, %.2f M parameters, %.1f MB of gradients), device %s, backend %s, "
              "world size %d, "
              "%d samples, batch %d per rank, %d epochs, %d steps, %d thread(s) per worker, "
              "repeat %d, %d configuration(s)"
              % (args.kind, loss, n_params / 1e6, n_params * 4 / 2 ** 20, args.device,
                 args.backend, args.world_size,
                 args.samples, args.batch_size, args.epochs, steps, args.threads, args.repeat,
                 len(configs)), flush=True)

        # runs[(trainer, flags)] -> list of metrics; PyTorch runs are shared by
        # configurations with the same PyTorch flags.
        runs = {}
        finals = {}
        default_pt = ("pytorch", ())
        jobs = []
        for label, pt_flags, cc_flags in configs:
            pt_key = ("pytorch", tuple(pt_flags)) if pt_flags is not None else default_pt
            for key in (pt_key, ("concord", tuple(cc_flags))):
                if key not in [j[0] for j in jobs]:
                    jobs.append((key, len(jobs)))
        for i in range(args.repeat):
            # Alternate the order so that no trainer always runs on a warm cache.
            order = jobs if i % 2 == 0 else list(reversed(jobs))
            for (name, flags), tag in order:
                maker = run_pytorch if name == "pytorch" else run_concord
                cmd, metrics, final = maker(args, model, data, tmp, loss, flags, "-%d" % tag)
                m = one_run(name, cmd, metrics, args)
                if m is None:
                    return 1
                runs.setdefault((name, flags), []).append(m)
                finals[(name, flags)] = final
                print("  run %d %-8s %-28s step mean %8.2f ms  median %8.2f ms  %10.1f samples/s"
                      % (i + 1, name, " ".join(flags) or "(defaults)", m["step_time_ms_mean"],
                         m["step_time_ms_median"], m["samples_per_second"]), flush=True)

        summary = {"%s %s" % (name, " ".join(flags) or "(defaults)"): summarize(r)
                   for (name, flags), r in runs.items()}
        table = []
        for label, pt_flags, cc_flags in configs:
            pt_key = ("pytorch", tuple(pt_flags)) if pt_flags is not None else default_pt
            cc_key = ("concord", tuple(cc_flags))
            try:
                ok, worst = compare_finals(finals[cc_key], finals[pt_key])
                agree = "%s (%.1e)" % ("yes" if ok else "NO", worst)
            except Exception as e:  # noqa: BLE001
                agree = "could not compare (%s)" % e
            table.append((label, summarize(runs[pt_key]), pt_flags is None,
                          summarize(runs[cc_key]), agree))

        if len(configs) == 1 and configs[0][0] == "defaults":
            print_single({"pytorch": table[0][1], "concord": table[0][3]})
            print("\nfinal models: %s" % table[0][4])
        else:
            print_sweep(table)

        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"config": {k: v for k, v in vars(args).items()},
                           "summary": summary,
                           "table": [{"configuration": t[0], "pytorch": t[1],
                                      "pytorch_stand_in": t[2], "concord": t[3],
                                      "final_models": t[4]} for t in table],
                           "runs": {"%s %s" % (n, " ".join(f)): r for (n, f), r in runs.items()}},
                          f, indent=2)
                f.write("\n")
    finally:
        if args.keep:
            print("kept %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

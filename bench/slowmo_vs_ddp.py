#!/usr/bin/python3
"""Benchmark: DDP, LocalSGD, SlowMo-LocalSGD and SlowMo-SGP side by side:
the same model, data, world size, hyper-parameters and number of steps.

Usage (Debian's python3, which has torch; build Concord first):

    /usr/bin/python3 bench/slowmo_vs_ddp.py --bin-dir build/bin
    /usr/bin/python3 bench/slowmo_vs_ddp.py --bin-dir build/bin --world-size 4 \\
        --epochs 8 --slowmo-frequency 12 --model-kind mlp-large

What it does:
  1. Writes a learning task: --model-kind demo-cnn (default; the demo's
     classification of noisy images around 10 class prototypes,
     examples/make_demo.py: a CNN with BatchNorm, ~40 k parameters) or
     mlp-large (tests/reference/fixtures.py: ~2.6 M parameters, regression
     on synthetic data: communication dominates).
  2. Trains it four times with `concord-run --standalone --nproc W --
     concord-train --algorithm A`: ddp (gradient allreduce every step),
     localsgd (parameter average every 3 steps), slowmo-localsgd (the same
     plus slow momentum every --slowmo-frequency steps, memory-efficient)
     and slowmo-sgp (push-sum gossip on fairscale's default graph every
     step, slow momentum every --slowmo-frequency steps). One compute
     thread per worker; same seed and data order for all.
  3. Prints, per algorithm: steps, mean step time (first 2 steps excluded),
     bytes written per step by the authoritative rank's process during
     training (Linux /proc/self/io wchar: Gloo sends with writev, so this is
     its traffic to the other ranks, plus a few log lines), and the final
     model's loss (and accuracy for demo-cnn) on the whole data set,
     evaluated here in eval mode.
  With --nprocs-per-node K > 1 the non-ddp runs use SlowMo's hierarchy:
  nodes of K consecutive ranks (one host: one node id), gradients averaged
  in the node every step, the algorithm between node masters.
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
sys.path.insert(0, os.path.join(ROOT, "examples"))

import fixtures  # noqa: E402

ALGORITHMS = ["ddp", "localsgd", "slowmo-localsgd", "slowmo-sgp"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--world-size", type=int, default=3)
    p.add_argument("--model-kind", choices=["demo-cnn", "mlp-large"], default="demo-cnn")
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--localsgd-frequency", type=int, default=3)
    p.add_argument("--slowmo-frequency", type=int, default=12,
                   help="fairscale's default is 48; shorter runs need fewer")
    p.add_argument("--slowmo-momentum", type=float, default=0.5)
    p.add_argument("--nprocs-per-node", type=int, default=1,
                   help="SlowMo's hierarchy for localsgd/slowmo-*: nodes of this many "
                        "consecutive ranks (the workers share this host's node id)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900)
    return p.parse_args()


def make_task(args, d):
    if args.model_kind == "demo-cnn":
        subprocess.run([sys.executable, os.path.join(ROOT, "examples", "make_demo.py"),
                        "--out", d, "--samples", str(args.samples), "--seed", str(args.seed)],
                       check=True, stdout=subprocess.DEVNULL)
        return os.path.join(d, "model.pt"), os.path.join(d, "data.pt"), "cross_entropy"
    model, data = fixtures.make_fixture(d, "mlp-large", args.samples, args.seed)
    return model, data, fixtures.default_loss("mlp-large")


def algorithm_flags(args, algorithm):
    flags = ["--algorithm", algorithm]
    if algorithm in ("localsgd", "slowmo-localsgd"):
        flags += ["--localsgd-frequency", str(args.localsgd_frequency)]
    if algorithm.startswith("slowmo-"):
        flags += ["--slowmo-frequency", str(args.slowmo_frequency),
                  "--slowmo-momentum", str(args.slowmo_momentum)]
    if algorithm != "ddp" and args.nprocs_per_node > 1:
        flags += ["--nprocs-per-node", str(args.nprocs_per_node)]
    return flags


def evaluate(model_path, state_path, data_path, loss):
    model = torch.jit.load(model_path)
    state = fixtures.load_state(state_path)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            t.copy_(state[name])
    model.eval()
    data = torch.load(data_path)
    with torch.no_grad():
        out = model(data["inputs"])
        if loss == "cross_entropy":
            value = torch.nn.functional.cross_entropy(out, data["targets"]).item()
            accuracy = (out.argmax(1) == data["targets"]).float().mean().item()
            return value, accuracy
        return torch.nn.functional.mse_loss(out, data["targets"]).item(), None


def run(args, tmp, model, data, loss, algorithm):
    out = os.path.join(tmp, algorithm)
    os.makedirs(out, exist_ok=True)
    final = os.path.join(out, "final.pt")
    metrics = os.path.join(out, "metrics.json")
    cmd = [os.path.join(args.bin_dir, "concord-run"), "--standalone",
           "--nproc", str(args.world_size), "--job-id", "bench-" + algorithm, "--",
           os.path.join(args.bin_dir, "concord-train"), "--model", model, "--data", data,
           "--loss", loss, "--lr", str(args.lr), "--momentum", str(args.momentum),
           "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
           "--shuffle", "--seed", str(args.seed), "--log-interval", "1000000",
           "--output", final, "--metrics-out", metrics] + algorithm_flags(args, algorithm)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, timeout=args.timeout)
    if r.returncode != 0:
        sys.exit("%s failed (exit %d):\n%s" % (algorithm, r.returncode, r.stderr[-3000:]))
    with open(metrics) as f:
        m = json.load(f)
    value, accuracy = evaluate(model, final, data, loss)
    return {"algorithm": algorithm, "steps": m["optimizer_steps"],
            "step_ms": m["step_time_ms_mean"], "bytes_per_step": m["bytes_written_per_step"],
            "loss": value, "accuracy": accuracy, "last_batch_loss": m["final_loss"]}


def main():
    args = parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="concord-bench-slowmo-")
    model, data, loss = make_task(args, os.path.join(tmp, "task"))
    rows = [run(args, tmp, model, data, loss, a) for a in ALGORITHMS]
    print("%s, %d samples, world size %d, batch %d per rank, %d epochs, lr %g, momentum %g; "
          "localsgd every %d steps, slow momentum every %d steps (beta %g, alpha 1); "
          "%d process(es) per node" % (
              args.model_kind, args.samples, args.world_size, args.batch_size, args.epochs,
              args.lr, args.momentum, args.localsgd_frequency, args.slowmo_frequency,
              args.slowmo_momentum, args.nprocs_per_node))
    header = "%-16s %6s %10s %16s %12s %9s" % ("algorithm", "steps", "step ms", "bytes/step/rank",
                                              "final loss", "accuracy")
    print(header)
    print("-" * len(header))
    ddp_bytes = rows[0]["bytes_per_step"]
    for r in rows:
        acc = "%.3f" % r["accuracy"] if r["accuracy"] is not None else "-"
        ratio = r["bytes_per_step"] / ddp_bytes if ddp_bytes > 0 else float("nan")
        print("%-16s %6d %10.2f %10.0f (%.2fx) %12.5f %9s" % (
            r["algorithm"], r["steps"], r["step_ms"], r["bytes_per_step"], ratio, r["loss"],
            acc))
    print("(bytes: the authoritative rank's process, /proc/self/io wchar during training; "
          "(Nx) relative to ddp. final loss: the saved model on all %d samples, eval mode)"
          % args.samples)


if __name__ == "__main__":
    main()

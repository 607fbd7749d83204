#!/usr/bin/python3
"""Benchmark: concord::SyncBatchNorm vs PyTorch's nn.SyncBatchNorm, forward +
backward of one layer, the same shape, dtype, layout, devices, backend and
number of ranks, in one run.

    python3 bench/syncbn_vs_pytorch.py --bin-dir build/bin --device cuda \\
        --backend nccl --world-size 2
    python3 bench/syncbn_vs_pytorch.py --bin-dir build/bin --device cuda:0 \\
        --backend gloo --world-size 2 --dtype bfloat16 --channels-last
    /usr/bin/python3 bench/syncbn_vs_pytorch.py --bin-dir build/bin   # CPU, gloo

PyTorch's side runs W processes (torch.distributed, a file:// rendezvous);
Concord's too: bin/concord-bench-syncbn --session, W workers of a
`concord-run --standalone` job (ranks that share a GPU cannot be threads of
one process: LibTorch runs a device's backward in one thread).
Each timed step is forward, backward of (y * g).sum() and a device
synchronisation; the table shows rank 0's median and mean step time and the
ratio concord/pytorch (< 1: Concord is faster). nn.SyncBatchNorm accepts
only CUDA tensors in PyTorch 1.13 (and runs as plain BatchNorm with one
rank), so the CPU rows compare against BatchNorm2d with one rank and are
skipped with several. Not a test.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--bin-dir", required=True, help="directory with concord-bench-syncbn")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda (rank r on cuda:r) or cuda:N (every rank on one device)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--spatial", type=int, default=56, help="H = W")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json-out", help="also write the results here as JSON")
    return p.parse_args()


def rank_device(args, rank):
    if args.device == "cpu":
        return torch.device("cpu")
    if args.device == "cuda":
        return torch.device("cuda", rank)
    return torch.device(args.device)


def torch_rank(rank, args, init_file, results):
    device = rank_device(args, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method="file://" + init_file, rank=rank,
                            world_size=args.world_size)
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        bn = torch.nn.SyncBatchNorm(args.channels).to(device)
    else:
        bn = torch.nn.BatchNorm2d(args.channels)
    torch.manual_seed(rank)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    x = torch.randn(args.batch, args.channels, args.spatial, args.spatial, device=device,
                    dtype=dtype).contiguous(memory_format=memory_format).requires_grad_(True)
    g = torch.randn_like(x)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(args.warmup + args.iters):
        sync()
        t0 = time.perf_counter()
        (bn(x) * g).sum().backward()
        sync()
        t1 = time.perf_counter()
        if i >= args.warmup:
            times.append((t1 - t0) * 1e3)
    if rank == 0:
        results.put({"ms_per_step_median": statistics.median(times),
                     "ms_per_step_mean": statistics.mean(times)})
    dist.barrier()
    dist.destroy_process_group()


def run_pytorch(args):
    with tempfile.TemporaryDirectory(prefix="concord_bench_syncbn_") as tmp:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=torch_rank,
                             args=(r, args, os.path.join(tmp, "init"), results))
                 for r in range(args.world_size)]
        for p in procs:
            p.start()
        deadline = time.time() + args.timeout
        for p in procs:
            p.join(max(1.0, deadline - time.time()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        if alive or any(p.exitcode != 0 for p in procs):
            raise RuntimeError("PyTorch's ranks failed (exit codes %s)"
                               % [p.exitcode for p in procs])
        return results.get(timeout=10)


def run_concord(args):
    cmd = [os.path.join(args.bin_dir, "concord-run"), "--standalone",
           "--nproc", str(args.world_size), "--job-id", "syncbn-bench", "--",
           os.path.join(args.bin_dir, "concord-bench-syncbn"), "--session",
           "--device", args.device, "--backend", args.backend, "--batch", str(args.batch),
           "--channels", str(args.channels), "--spatial", str(args.spatial),
           "--dtype", args.dtype, "--iters", str(args.iters), "--warmup", str(args.warmup)]
    if args.channels_last:
        cmd.append("--channels-last")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError("concord-bench-syncbn failed: %s" % r.stderr.strip())
    # Rank 0's line; concord-run passes the workers' output through.
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError("concord-bench-syncbn printed no result: %s" % r.stdout.strip())
    return json.loads(lines[-1])


def main():
    args = parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        print("syncbn_vs_pytorch.py: --device %s: no CUDA device is visible" % args.device,
              file=sys.stderr)
        return 2
    if args.device == "cpu" and args.world_size > 1:
        print("syncbn_vs_pytorch.py: nn.SyncBatchNorm needs CUDA tensors for more than "
              "one rank; use --world-size 1 on the CPU", file=sys.stderr)
        return 2
    print("SyncBatchNorm forward + backward: %d rank(s) x (%d, %d, %d, %d) %s%s, device %s, "
          "backend %s, %d timed steps" % (
              args.world_size, args.batch, args.channels, args.spatial, args.spatial,
              args.dtype, " channels-last" if args.channels_last else "", args.device,
              args.backend, args.iters), flush=True)
    pytorch = run_pytorch(args)
    concord = run_concord(args)
    print("%-22s %14s %14s %16s" % ("", "pytorch", "concord", "concord/pytorch"))
    for label, key in (("step median (ms)", "ms_per_step_median"),
                       ("step mean (ms)", "ms_per_step_mean")):
        p, c = pytorch[key], concord[key]
        print("%-22s %14.3f %14.3f %16.3f" % (label, p, c, c / p if p else float("nan")))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"config": vars(args), "pytorch": pytorch, "concord": concord}, f,
                      indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

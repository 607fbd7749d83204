#!/usr/bin/python3
"""Reference trainer: PyTorch's own DistributedDataParallel (gloo backend).

Trains the same TorchScript model file on the same tensor data as
concord-train, with the same sharding, loss, optimizer and hyper-parameters,
and writes rank 0's final state_dict (parameters and buffers) with torch.save.

    /usr/bin/python3 tests/reference/torch_ddp_train.py \
        --model model.pt --data data.pt --loss cross_entropy \
        --lr 0.05 --momentum 0.9 --weight-decay 1e-4 --batch-size 8 --epochs 2 \
        --world-size 2 --output ref.pt [--metrics-out ref.json] [--threads 1]

Semantics (the concord-train contract):
  * W processes (torch.multiprocessing.spawn), init through a file:// store in
    a fresh temporary directory (no port to race for), gloo backend.
  * The loaded ScriptModule (torch.jit.load) is wrapped directly in DDP
    (broadcast_buffers=True, default bucket sizes), in training mode.
  * Rank r of W takes samples r, r+W, r+2W, ... in order, no padding;
    batches of --batch-size, the last partial batch included; the same order
    every epoch. With --shuffle, epoch e first permutes the samples with
    torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)) (what
    concord-train does today) and then shards that order the same way.
  * Each step: optimizer.zero_grad(); out = model(x); loss (mean reduction);
    loss.backward(); optimizer.step(). SGD is torch.optim.SGD (dampening 0,
    nesterov False).
  * If ranks would take different numbers of steps in total (uneven shards),
    the loop runs inside DDP's join() context (divide_by_initial_world_size
    True, PyTorch's defaults); otherwise join() is not used (it adds an
    allreduce per step).
  * --metrics-out (rank 0): {"world_size", "steps", "step_time_ms_mean",
    "step_time_ms_median", "samples_per_second", "final_loss"}. A step's time
    runs from batch selection to the end of optimizer.step() on rank 0; the
    first 2 steps are excluded when there are more than 2.
    samples_per_second is the global rate: samples consumed by all ranks in
    all steps divided by rank 0's wall time from the start of the first step
    to the end of the last (warm-up included), as concord-train computes it.
    final_loss is rank 0's local loss at its last step. steps is rank 0's
    number of optimizer steps.
"""

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="PyTorch DDP reference trainer (gloo)")
    p.add_argument("--model", required=True, help="TorchScript model file (torch.jit.save)")
    p.add_argument("--data", required=True, help="torch.save'd dict {'inputs', 'targets'}")
    p.add_argument("--loss", choices=("cross_entropy", "mse"), default="cross_entropy")
    p.add_argument("--optimizer", choices=("sgd",), default="sgd")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--shuffle", action="store_true", help="permute the samples every epoch")
    p.add_argument("--seed", type=int, default=0, help="--shuffle seed (epoch e uses seed + e)")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--output", help="where rank 0 writes its final state_dict")
    p.add_argument("--metrics-out", help="where rank 0 writes metrics JSON")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each worker")
    p.add_argument("--log-interval", type=int, default=0, help="print rank 0's loss every N steps")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="process-group timeout in seconds")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    return args


def load_data(path):
    data = torch.load(path, map_location="cpu")
    if not isinstance(data, dict) or "inputs" not in data or "targets" not in data:
        raise ValueError("%s: expected a dict with 'inputs' and 'targets'" % path)
    inputs, targets = data["inputs"], data["targets"]
    if inputs.size(0) != targets.size(0):
        raise ValueError("%s: %d inputs but %d targets" % (path, inputs.size(0), targets.size(0)))
    return inputs, targets


def compute_loss(kind, out, y):
    if kind == "cross_entropy":
        return F.cross_entropy(out, y)
    return F.mse_loss(out, y)


def worker(rank, args, init_file):
    torch.set_num_threads(args.threads)
    world = args.world_size
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        model = torch.jit.load(args.model, map_location="cpu")
        model.train()
        inputs, targets = load_data(args.data)
        n = inputs.size(0)
        bs = args.batch_size
        my_batches = (len(range(rank, n, world)) + bs - 1) // bs
        batches_per_rank = [(len(range(r, n, world)) + bs - 1) // bs for r in range(world)]
        uneven = len(set(batches_per_rank)) > 1

        ddp = DDP(model, broadcast_buffers=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                              weight_decay=args.weight_decay, dampening=0, nesterov=False)

        # Global samples per step (for samples_per_second on rank 0): the sum
        # of every rank's batch size at that step index.
        def global_samples(step_in_epoch):
            total = 0
            for r in range(world):
                cnt = len(range(r, n, world))
                lo = step_in_epoch * bs
                total += max(0, min(bs, cnt - lo))
            return total

        step_times = []
        step_samples = []
        last_loss = float("nan")
        steps = 0
        wall = [0.0, 0.0]

        def loop():
            nonlocal last_loss, steps
            wall[0] = time.perf_counter()
            for epoch in range(args.epochs):
                if args.shuffle:
                    g = torch.Generator().manual_seed(args.seed + epoch)
                    order = torch.randperm(n, generator=g, dtype=torch.int64)
                else:
                    order = torch.arange(n, dtype=torch.int64)
                shard = order[rank::world]
                for b in range(my_batches):
                    t0 = time.perf_counter()
                    idx = shard[b * bs:(b + 1) * bs]
                    x = inputs.index_select(0, idx)
                    y = targets.index_select(0, idx)
                    opt.zero_grad()
                    out = ddp(x)
                    loss = compute_loss(args.loss, out, y)
                    loss.backward()
                    opt.step()
                    t1 = time.perf_counter()
                    steps += 1
                    last_loss = float(loss.detach())
                    step_times.append(t1 - t0)
                    step_samples.append(global_samples(b))
                    if rank == 0 and args.log_interval > 0 and steps % args.log_interval == 0:
                        print("[torch-ddp] step %d loss %.6f" % (steps, last_loss), flush=True)
            wall[1] = time.perf_counter()

        if uneven:
            with ddp.join():
                loop()
        else:
            loop()

        dist.barrier()
        if rank == 0:
            if args.output:
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                torch.save(state, args.output)
            if args.metrics_out:
                timed = slice(2, None) if len(step_times) > 2 else slice(None)
                t = step_times[timed]
                total_t = wall[1] - wall[0]
                metrics = {
                    "world_size": world,
                    "steps": steps,
                    "step_time_ms_mean": 1000.0 * statistics.mean(t) if t else 0.0,
                    "step_time_ms_median": 1000.0 * statistics.median(t) if t else 0.0,
                    "samples_per_second": (sum(step_samples) / total_t) if total_t > 0 else 0.0,
                    "final_loss": last_loss if math.isfinite(last_loss) else None,
                }
                with open(args.metrics_out, "w") as f:
                    json.dump(metrics, f, indent=2)
                    f.write("\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    for label, path in (("--model", args.model), ("--data", args.data)):
        if not os.path.isfile(path):
            print("torch_ddp_train.py: %s %s: no such file" % (label, path), file=sys.stderr)
            return 2
    tmp = tempfile.mkdtemp(prefix="torch_ddp_init_")
    try:
        init_file = os.path.join(tmp, "store")
        mp.spawn(worker, args=(args, init_file), nprocs=args.world_size, join=True)
    except Exception as e:  # ProcessRaisedException / ProcessExitedException
        print("torch_ddp_train.py: training failed: %s" % e, file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

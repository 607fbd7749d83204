#!/usr/bin/python3
"""Benchmark: concord::ZeroRedundancyOptimizer against unsharded Concord DDP
and against PyTorch's DDP, plain and with its ZeroRedundancyOptimizer: the
same model, data, world size, Adam and number of steps (issue 48).

Usage (Debian's python3, which has torch; build concord-train and
concord-run first):

    /usr/bin/python3 bench/zero_vs_ddp.py --bin-dir build/bin
    /usr/bin/python3 bench/zero_vs_ddp.py --bin-dir build/bin --world-size 3,4,6 --steps 30 \\
        --repeat 3

On a GPU (scripts/gpu-suite.sh runs the first; --device cuda:N puts every
rank on that GPU, which only gloo allows, --device cuda rank r on cuda:r):

    python3 bench/zero_vs_ddp.py --bin-dir build-gpu/bin --device cuda:0 --backend gloo \\
        --world-size 2 --steps 20 --repeat 1
    python3 bench/zero_vs_ddp.py --bin-dir build-gpu/bin --device cuda --backend nccl \\
        --world-size 2

What it does:
  1. Writes tests/reference/fixtures.py's mlp-large task (Linear layers of
     width 1024, ~2.6 M parameters, cross_entropy): Adam's state (exp_avg,
     exp_avg_sq: 8 bytes a parameter, ~21 MB) is twice the parameters.
     The data is --steps x world size x batch samples: every rank takes --steps
     full batches (one epoch, no shuffle, rank r taking samples r, r+W, ...).
  2. Trains it seven times, Adam (lr --lr), one compute thread per worker,
     DDP's buckets capped at --bucket-cap-mb on both sides (so that the
     overlap has buckets to spread over the ranks), on --device (cpu by
     default) with --backend (gloo by default) on both sides: concord-train
     --device --backend, and PyTorch's model and batches moved to the
     device, init_process_group(backend) and, on a GPU, DDP's
     device_ids=[index]. NCCL needs a GPU per rank: --backend nccl is
     refused on the CPU and where ranks would share a GPU.
     - concord ddp:         `concord-run --standalone --nproc W --
                            concord-train --optimizer adam` (unsharded);
     - concord zero:        the same with --zero (elastic ZeRO: concord-train
                            always runs under run_elastic);
     - concord zero+bview:  --zero --zero-bucket-view;
     - concord zero+ovl:    --zero --zero-overlap step (the step inside
                            DDP's backward, see Note [ZeRO overlapped with
                            DDP] in api/zero_overlap.cc);
     - torch ddp:           PyTorch's DDP and torch.optim.Adam, W processes
                            (torch.multiprocessing, spawn), --backend;
     - torch zero:          PyTorch's DDP and
                            ZeroRedundancyOptimizer(optimizer_class=Adam);
     - torch zero+ovl:      overlap_with_ddp=True with
                            hook_with_zero_step(allreduce_hook) (PyTorch
                            refuses gloo for it, for a hang of the
                            interleaved hook; the benchmark lifts that check
                            for the non-interleaved one, which runs; with
                            nccl there is nothing to lift).
     The overlapped runs update nothing in their first two steps, which
     the means leave out anyway.
  3. Prints, per kind: rank 0's mean and median step time (ms; forward,
     backward, optimizer step, and for Concord the elastic commit; the first
     2 steps excluded), the median over --repeat runs run interleaved (on a
     GPU PyTorch's step also holds the batch's copy to the device, as
     concord-train's does, and is timed between torch.cuda.synchronize()
     calls; concord-train's ends with the loss read back, which waits for
     the GPU);
     optimizer-state bytes on rank 0 (Concord: --metrics-out's
     optimizer_state_bytes, the authoritative rank's, i.e.
     ZeroRedundancyOptimizer::state_bytes() or the LibTorch optimizer's
     state tensors; PyTorch: the nbytes of the (local) optimizer's state
     tensors, 'step' excluded, wherever they live) and that over unsharded
     state / W; peak RSS per rank (ru_maxrss, host memory only; Concord: the
     largest of concord-run and its workers, from wait4 on concord-run;
     PyTorch: the largest rank's). On a GPU also PyTorch's
     torch.cuda.max_memory_allocated() per rank, each run's.
  4. Where Concord's steps go: every Concord run is traced (concord-run
     --trace), and the mean ms per step of backward, DDP's optimizer step
     and the sharded optimizer's parts (see Note [ZeRO on the timeline] in
     api/zero.cc: zero copy, zero update, zero mirror, zero broadcast) over
     every rank's steps after the first 2 (the median over the runs; on a
     GPU these spans are host time, and a kernel launched in one may be
     waited for in a later one); and whether the overlapped run meets issue
     48's goal (a mean step no longer than unsharded Concord DDP's).
  With several --world-size values, all of it again for each, one after
  the other.
  Then the expectation for each rank (see Note [Elastic ZeRO] in api/zero.cc) of
  Concord's elastic ZeRO, from the partition (PyTorch's greedy one) and the
  mirrors (see Note [ZeRO mirrors] in worker/zero/partition.h: the largest
  shards mirrored on the ranks stepping the fewest elements): its own and
  its mirrored shards' state live, plus copies of both with their parameters;
  and the same over an even split, 2 S/W + 2 (S + P)/W (S the unsharded
  state, P the parameters' bytes; 2 S/W at W = 2, whose ranks step every
  shard and keep no copies), against "state/N plus the chosen
  redundancy".
"""

import argparse
import datetime
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))

import fixtures  # noqa: E402

KIND = "mlp-large"
WARMUP = 2  # steps left out of the mean, as concord-train does
MIB = 1024.0 * 1024.0
# Deaths of concord-run at its exit after a completed run (see run_concord).
EXIT_DEATHS = []
PARTS = ("backward", "optimizer", "zero copy", "zero update", "zero mirror", "zero broadcast")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--world-size", default="3",
                   help="world sizes, comma-separated (e.g. 3,6): a table for each")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--repeat", type=int, default=2,
                   help="runs of each, interleaved; step times: the median over them")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--bucket-cap-mb", type=float, default=2.0,
                   help="DDP's bucket_cap_mb, both sides")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda (rank r on cuda:r) or cuda:N (every rank on one device), "
                   "both sides")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="the process group's backend, both sides (nccl: a GPU per rank)")
    return p.parse_args()


def check_device(args, sizes):
    """None, or why --device and --backend cannot run these world sizes here
    (one line)."""
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        return "--device: cpu, cuda or cuda:N, not %r" % args.device
    if device.type == "cpu":
        if device.index is not None:
            return "--device: cpu, cuda or cuda:N, not %r" % args.device
        if args.backend == "nccl":
            return "--backend nccl needs CUDA tensors: give --device cuda or cuda:N"
        return None
    if device.type != "cuda":
        return "--device: cpu, cuda or cuda:N, not %r" % args.device
    if not torch.cuda.is_available():
        return "--device %s: no CUDA device is visible" % args.device
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return "--device %s: this machine has %d CUDA device(s)" % (args.device, count)
    world = max(sizes)
    if args.backend == "nccl" and (world > count or device.index is not None):
        return ("--backend nccl needs a GPU per rank (NCCL refuses two ranks on one GPU): "
                "world size %d, %d CUDA device(s), --device %s; use --device cuda with "
                "world sizes up to %d, or --backend gloo" % (world, count, args.device, count))
    if device.index is None and world > count:
        return ("--device cuda puts rank r on cuda:r: world size %d needs %d CUDA devices, "
                "this machine has %d; --device cuda:0 shares one (with --backend gloo)"
                % (world, world, count))
    return None


# --- Concord ------------------------------------------------------------------

def run_concord(args, tmp, model, data, name, flags):
    out = os.path.join(tmp, name.replace(" ", "-").replace("+", "-"))
    os.makedirs(out, exist_ok=True)
    metrics = os.path.join(out, "metrics.json")
    trace = os.path.join(out, "trace.json")
    cmd = [os.path.join(args.bin_dir, "concord-run"), "--standalone",
           "--nproc", str(args.world_size), "--job-id", "bench-" + os.path.basename(out),
           "--trace", trace, "--",
           os.path.join(args.bin_dir, "concord-train"), "--model", model, "--data", data,
           "--loss", fixtures.default_loss(KIND), "--optimizer", "adam", "--lr", str(args.lr),
           "--batch-size", str(args.batch_size), "--epochs", "1", "--seed", str(args.seed),
           "--log-interval", "1000000", "--metrics-out", metrics,
           "--bucket-cap-mb", str(args.bucket_cap_mb),
           # concord-run gives rank r LOCAL_RANK r: "cuda" is cuda:r.
           "--device", args.device, "--backend", args.backend] + flags
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(os.path.join(out, "stdout"), "w") as so, open(os.path.join(out, "stderr"), "w") as se:
        proc = subprocess.Popen(cmd, env=env, stdout=so, stderr=se)
        # wait4: ru_maxrss of concord-run and of every worker it reaped, the
        # largest of them.
        deadline = time.monotonic() + args.timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid == proc.pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                sys.exit("%s timed out after %.0f s" % (name, args.timeout))
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
    with open(os.path.join(out, "stderr")) as f:
        stderr = f.read()
    if proc.returncode < 0 and os.path.exists(metrics) and "wrote the timeline" in stderr:
        # concord-run died of a signal after the job completed and its
        # results were written: the figures stand, and the death is reported.
        EXIT_DEATHS.append("%s: concord-run killed by signal %d after writing the timeline"
                           % (name, -proc.returncode))
        print("warning: " + EXIT_DEATHS[-1], file=sys.stderr)
    elif proc.returncode != 0:
        sys.exit("%s failed (exit %d):\n%s" % (name, proc.returncode, stderr[-3000:]))
    with open(metrics) as f:
        m = json.load(f)
    return {"name": name, "steps": m["optimizer_steps"], "step_ms": m["step_time_ms_mean"],
            "median_ms": m["step_time_ms_median"],
            "state_bytes": m["optimizer_state_bytes"], "rank0_rss": m["peak_rss_bytes"],
            "max_rss": usage.ru_maxrss * 1024, "per_rank_state": None,
            "parts": step_parts(trace)}


def step_parts(path):
    """The mean ms per step of the parts the timeline names (see Note [ZeRO
    on the timeline] in api/zero.cc; DDP's optimizer step, and its backward,
    which holds the overlapped updates), over every rank's steps after the
    first WARMUP."""
    with open(path) as f:
        events = json.load(f)
    total = {name: 0.0 for name in PARTS}
    for e in events:
        if e.get("ph") == "X" and e.get("tid") == 0 and e["name"] in total and \
                e.get("args", {}).get("step", 0) > WARMUP:
            total[e["name"]] += e["dur"] / 1e3
    steps = sum(1 for e in events if e.get("ph") == "X" and e.get("tid") == 0 and
                e["name"] == "step" and e.get("args", {}).get("step", 0) > WARMUP)
    return {name: t / max(1, steps) for name, t in total.items()}


# --- PyTorch --------------------------------------------------------------------

def torch_worker(rank, world, init_file, cfg, prefix):
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if cfg["device"] == "cuda" else \
        torch.device(cfg["device"])
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(cfg["backend"], init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        data = torch.load(cfg["data"])
        model = fixtures.build_model(KIND)
        initial = fixtures.initial_state(cfg["model"])
        with torch.no_grad():
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                t.copy_(initial[name])
        model.train()
        model.to(device)
        on_device = {"device_ids": [device.index]} if cuda else {}
        ddp = torch.nn.parallel.DistributedDataParallel(model,
                                                        bucket_cap_mb=cfg["bucket_cap_mb"],
                                                        **on_device)
        if cfg["zero"] == "overlap":
            from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            optimizer = ZeroRedundancyOptimizer(ddp.parameters(),
                                                optimizer_class=torch.optim.Adam,
                                                overlap_with_ddp=True, lr=cfg["lr"])
            # PyTorch refuses gloo here (pytorch/pytorch#62300, a hang of the
            # interleaved hook); hook_with_zero_step runs on it.
            real = ddp_zero_hook.dist.get_backend
            ddp_zero_hook.dist.get_backend = lambda group=None: "nccl"
            try:
                hook = ddp_zero_hook.hook_with_zero_step(allreduce_hook, ddp, optimizer)
            finally:
                ddp_zero_hook.dist.get_backend = real
            ddp.register_comm_hook(None, hook)
            local = None
        elif cfg["zero"]:
            optimizer = ZeroRedundancyOptimizer(ddp.parameters(),
                                                optimizer_class=torch.optim.Adam, lr=cfg["lr"])
            local = optimizer.optim
        else:
            optimizer = local = torch.optim.Adam(ddp.parameters(), lr=cfg["lr"])
        shard = fixtures.shard_indices(data["inputs"].size(0), rank, world)
        batch = cfg["batch_size"]
        times = []
        for s in range(cfg["steps"]):
            index = torch.tensor(shard[s * batch:(s + 1) * batch])
            x, y = data["inputs"][index], data["targets"][index]
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            if cuda:
                x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=False)
            F.cross_entropy(ddp(x), y).backward()
            if cfg["zero"] != "overlap":
                optimizer.step()
            if cuda:
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
        if local is None:
            local = optimizer.optim  # made in the third backward
        state_bytes = sum(t.numel() * t.element_size() for st in local.state.values()
                          for k, t in st.items() if k != "step" and torch.is_tensor(t))
        timed = times[WARMUP:] if len(times) > WARMUP else times
        result = {"step_ms": sum(timed) / len(timed), "steps": len(times),
                  "median_ms": float(torch.tensor(timed).median()),
                  "state_bytes": state_bytes,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "cuda_max_allocated": torch.cuda.max_memory_allocated(device) if cuda
                  else None}
        with open("%s.rank%d.json" % (prefix, rank), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    fixtures.leave_rank()


def run_torch(args, tmp, model, data, name, zero):
    # A fresh prefix per run: gloo's FileStore must not be reused.
    prefix = tempfile.mkdtemp(prefix=name.replace(" ", "-") + ".", dir=tmp) + "/run"
    cfg = {"model": model, "data": data, "zero": zero, "lr": args.lr,
           "bucket_cap_mb": args.bucket_cap_mb, "device": args.device, "backend": args.backend,
           "batch_size": args.batch_size, "steps": args.steps}
    os.environ["OMP_NUM_THREADS"] = "1"
    error = fixtures.run_ranks(torch_worker, (args.world_size, prefix + ".store", cfg, prefix),
                               args.world_size, args.timeout, name, start_method="spawn")
    if error:
        sys.exit(error)
    ranks = []
    for r in range(args.world_size):
        with open("%s.rank%d.json" % (prefix, r)) as f:
            ranks.append(json.load(f))
    return {"name": name, "steps": ranks[0]["steps"], "step_ms": ranks[0]["step_ms"],
            "median_ms": ranks[0]["median_ms"],
            "state_bytes": ranks[0]["state_bytes"], "rank0_rss": ranks[0]["rss"],
            "max_rss": max(r["rss"] for r in ranks),
            "per_rank_state": [r["state_bytes"] for r in ranks],
            "cuda_max_allocated": [r["cuda_max_allocated"] for r in ranks]}


# --- the expected state (see Note [Elastic ZeRO]) -------------------------------------

def partition(numels, world):
    """PyTorch's ZeroRedundancyOptimizer partition (one group): largest
    parameters first, each to the rank with the fewest elements so far."""
    sizes = [0] * world
    for n in sorted(numels, reverse=True):
        r = sizes.index(min(sizes))
        sizes[r] += n
    return sizes


def mirrors_of(shard):
    """The mirrors on one host (see Note [ZeRO mirrors]): the shards largest first (the lower
    rank on a tie), each mirrored on the other rank stepping the fewest
    elements so far (the first after it cyclically on a tie)."""
    world = len(shard)
    load = list(shard)
    out = [-1] * world
    for r in sorted(range(world), key=lambda r: -shard[r]):
        if world < 2:
            break
        best = min(((r + k) % world for k in range(1, world)), key=lambda o: load[o])
        out[r] = best
        load[best] += shard[r]
    return out


def expected_elastic(numels, world, state_per_elem, elem_bytes):
    """Bytes per rank: its own shard and those it mirrors (see Note [ZeRO
    mirrors]), live state plus the copies of state and parameters taken at
    each step's start; at one or two ranks, which step every shard, no
    copies after the first step (see Note [Elastic ZeRO])."""
    shard = partition(numels, world)
    mirror = mirrors_of(shard)
    per_elem = state_per_elem if world <= 2 else 2 * state_per_elem + elem_bytes
    out = []
    for r in range(world):
        held = shard[r] + sum(shard[o] for o in range(world) if mirror[o] == r)
        out.append(held * per_elem)
    return out, shard, mirror


def median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def main():
    args = parse_args()
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        sizes = [int(w) for w in args.world_size.split(",")]
    except ValueError:
        sys.exit("--world-size: comma-separated integers, not %r" % args.world_size)
    if not sizes or min(sizes) < 2:
        sys.exit("--world-size: each at least 2, not %r" % args.world_size)
    error = check_device(args, sizes)
    if error:
        sys.exit(error)
    for i, world in enumerate(sizes):
        if i:
            print()
        bench_world(argparse.Namespace(**dict(vars(args), world_size=world)))


def bench_world(args):
    tmp = tempfile.mkdtemp(prefix="concord-bench-zero-")
    samples = args.steps * args.world_size * args.batch_size
    model, data = fixtures.make_fixture(os.path.join(tmp, "task"), KIND, samples, args.seed)
    numels = [p.numel() for p in fixtures.build_model(KIND).parameters()]
    params = sum(numels)
    runs = [lambda: run_concord(args, tmp, model, data, "concord ddp", []),
            lambda: run_concord(args, tmp, model, data, "concord zero", ["--zero"]),
            lambda: run_concord(args, tmp, model, data, "concord zero+bview",
                                ["--zero", "--zero-bucket-view"]),
            lambda: run_concord(args, tmp, model, data, "concord zero+ovl",
                                ["--zero", "--zero-overlap", "step"]),
            lambda: run_torch(args, tmp, model, data, "torch ddp", False),
            lambda: run_torch(args, tmp, model, data, "torch zero", True),
            lambda: run_torch(args, tmp, model, data, "torch zero+ovl", "overlap")]
    # Interleaved: a change in the machine's load reaches every kind alike.
    results = [[] for _ in runs]
    for _ in range(args.repeat):
        for i, run in enumerate(runs):
            results[i].append(run())
    rows = []
    for each in results:
        row = dict(each[-1])
        row["step_ms"] = median([r["step_ms"] for r in each])
        row["median_ms"] = median([r["median_ms"] for r in each])
        row["rank0_rss"] = max(r["rank0_rss"] for r in each)
        row["max_rss"] = max(r["max_rss"] for r in each)
        if "parts" in row:
            row["parts"] = {p: median([r["parts"][p] for r in each]) for p in PARTS}
        rows.append(row)
    W = args.world_size
    S = rows[0]["state_bytes"]  # unsharded Adam state
    P = params * 4
    print("%s (%d parameters, %.2f MiB; Adam state S = %.2f MiB unsharded), world size %d, "
          "device %s, backend %s, batch %d per rank, %d samples, Adam lr %g, bucket_cap_mb %g, "
          "1 compute thread per worker, %d run(s) of each" % (
              KIND, params, P / MIB, S / MIB, W, args.device, args.backend, args.batch_size,
              samples, args.lr, args.bucket_cap_mb, args.repeat))
    header = "%-19s %5s %16s %8s %13s %8s %21s" % (
        "run", "steps", "step ms mean/med", "vs ddp", "state MiB/rk0", "/(S/W)",
        "peak RSS MiB rk0/max")
    print(header)
    print("-" * len(header))
    for r in rows:
        base = rows[4] if r["name"].startswith("torch") else rows[0]
        print("%-19s %5d %8.2f/%7.2f %7.2fx %13.2f %7.2fx %10.1f/%10.1f" % (
            r["name"], r["steps"], r["step_ms"], r["median_ms"], r["step_ms"] / base["step_ms"],
            r["state_bytes"] / MIB, r["state_bytes"] / (S / W), r["rank0_rss"] / MIB,
            r["max_rss"] / MIB))
    print("(step ms: rank 0's mean and median step, first %d steps excluded, median over the "
          "runs; vs ddp: mean against the same side's unsharded DDP. state: rank 0's optimizer "
          "state (Concord: the authoritative rank's --metrics-out). peak RSS: ru_maxrss, the "
          "largest over the runs; Concord's max over concord-run and its workers, PyTorch's "
          "over its ranks)" % WARMUP)
    torch_zero = rows[5]["per_rank_state"]
    print("PyTorch ZeRO state per rank (MiB): %s" % ", ".join(
        "%.2f" % (b / MIB) for b in torch_zero))
    if rows[4]["cuda_max_allocated"][0] is not None:
        # Each run's per rank, the largest over the runs.
        print("PyTorch torch.cuda.max_memory_allocated per rank (MiB): %s" % "; ".join(
            "%s %s" % (each[0]["name"], ", ".join(
                "%.2f" % (max(r["cuda_max_allocated"][k] for r in each) / MIB)
                for k in range(W)))
            for each in results[4:]))
    expected, shard, mirror = expected_elastic(numels, W, S / params, 4)
    copies = W > 2
    even = (2 * S + (2 * (S + P) if copies else 0)) / W
    print("Expected (Elastic ZeRO): per rank, own + mirrored shard's state live%s; shards of %s "
          "parameters, mirrored on ranks %s:"
          % (" and copies of both with their parameters" if copies else
             " (every rank steps every shard: no copies)",
             "/".join(str(s) for s in shard), "/".join(str(m) for m in mirror)))
    for r, e in enumerate(expected):
        print("  rank %d: expected %.2f MiB = %.2fx S/W" % (r, e / MIB, e / (S / W)))
    measured = rows[1]["state_bytes"]
    print("  even split: %s = %.2f MiB = %.2fx S/W; concord zero's rank 0 "
          "measured %.2f MiB = %.3fx its expectation (goal <= 1.1x)" % (
              "2 S/W + 2 (S + P)/W" if copies else "2 S/W", even / MIB, even / (S / W),
              measured / MIB, measured / expected[0]))
    print("Where Concord's steps go (ms per step, the mean over every rank's steps after the "
          "first %d, from --trace, the median over the runs; the overlapped run's updates and "
          "broadcast lie inside its backward):" % WARMUP)
    print("  %-19s %s" % ("run", " ".join("%14s" % p for p in PARTS)))
    for r in rows[:4]:
        print("  %-19s %s" % (r["name"], " ".join("%14.2f" % r["parts"][p] for p in PARTS)))
    ratio = rows[3]["step_ms"] / rows[0]["step_ms"]
    print("Step-time goal (issue 48): concord zero+ovl at %.2fx concord ddp's mean step at W = %d "
          "(goal <= 1.00x): %s" % (ratio, W, "met" if ratio <= 1.0 else "not met"))
    if EXIT_DEATHS:
        print("concord-run died at its exit after completing %d run(s), results kept: %s"
              % (len(EXIT_DEATHS), "; ".join(EXIT_DEATHS)))
        del EXIT_DEATHS[:]
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Reference trainer: PyTorch's own DistributedDataParallel (gloo backend).

Trains the same TorchScript model file on the same tensor data as
concord-train, with the same sharding, loss, optimizer and hyper-parameters,
and writes the final state_dict (parameters and buffers) with torch.save.

    /usr/bin/python3 tests/reference/torch_ddp_train.py \
        --model model.pt --data data.pt --loss cross_entropy \
        --lr 0.05 --momentum 0.9 --weight-decay 1e-4 --batch-size 8 --epochs 2 \
        --world-size 2 --output ref.pt [--metrics-out ref.json] [--threads 1]
        [DDP options: --bucket-cap-mb F --find-unused-parameters --static-graph
         --grad-accum K --comm-hook allreduce|fp16 --gradient-as-bucket-view
         --no-broadcast-buffers --ignore NAME ...]
        [uneven shards: --no-divide-by-initial-world-size
         --throw-on-early-termination]

Semantics (the concord-train contract):
  * W processes (torch.multiprocessing, started with fork by default: a
    worker does not import torch again; --start-method spawn for the old way),
    init through a file:// store in a fresh temporary directory (no port to
    race for), gloo backend.
  * The loaded ScriptModule (torch.jit.load) first runs concord-train's
    validation forward (eval mode, no grad, the first min(2, N) samples: it
    advances TorchScript's profiling executor, so without it the results
    differ from concord-train's by an ulp), then is wrapped directly in DDP,
    in training mode, with concord-train's DDP flags mapped onto PyTorch 1.13's
    arguments: --bucket-cap-mb F (bucket_cap_mb, default 25),
    --find-unused-parameters, --static-graph (DDP(static_graph=True)),
    --gradient-as-bucket-view, --no-broadcast-buffers (broadcast_buffers=
    False), --ignore NAME (repeatable: DDP._set_params_and_buffers_to_ignore_
    for_model(module, names) before wrapping; ignored parameters are neither
    broadcast nor reduced but are still in the optimizer, ignored buffers are
    not broadcast), --comm-hook allreduce|fp16 (ddp.register_comm_hook(None,
    default_hooks.allreduce_hook / fp16_compress_hook)). --comm-hook bf16 is
    refused: PyTorch 1.13's bf16_compress_hook needs NCCL (Gloo has no
    bfloat16 allreduce); the tests check Concord's bf16 hook against
    fixtures.simulate instead.
  * Rank r of W takes samples r, r+W, r+2W, ... in order, no padding;
    batches of --batch-size, the last partial batch included; the same order
    every epoch. With --shuffle, epoch e first permutes the samples with
    torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)) (what
    concord-train does today) and then shards that order the same way.
  * The loop (concord-train's): for each batch b of an epoch (B batches),
    with K = --grad-accum (default 1):
      if (b + 1) % K != 0 and b + 1 != B:
          with ddp.no_sync(): out = ddp(x); loss (mean); loss.backward()
      else:
          out = ddp(x); loss (mean); loss.backward()
          optimizer.step(); optimizer.zero_grad(set_to_none=False)
    Gradients are summed over the micro-batches (no loss scaling). zero_grad
    comes after step and zeroes existing gradients in place, as LibTorch's
    Optimizer::zero_grad does (at the start every .grad is None). SGD is
    torch.optim.SGD (dampening 0, nesterov False) over all of the module's
    parameters.
  * If ranks would take different numbers of steps in total (uneven shards),
    the whole loop, every epoch, runs inside DDP's join() context: each
    rank's data stream is its epochs' batches one after another
    (fixtures.stream_lengths), and a rank whose stream ends joins while the
    others go on; joined ranks shadow the collectives with zeros (what
    concord-train --sharding fixed does by leaving the job at the step
    boundary). join(divide_by_initial_world_size=True,
    throw_on_early_termination=False) are PyTorch's defaults;
    --no-divide-by-initial-world-size divides the gradients by the number of
    ranks still active instead of W, and --throw-on-early-termination makes
    every rank raise when the first one runs out (the run then fails). At
    the end DDP gives every rank the model of the last joiner
    (fixtures.last_joiner). With even shards join() is not used (it adds an
    allreduce per step) and the two flags change nothing.
  * --output: rank 0 writes its final state_dict, or with uneven shards the
    last joiner (every rank holds its model after join(): the rank with the
    most data). A path containing {rank} makes every rank write its own,
    with {rank} replaced by the rank.
  * --metrics-out (rank 0): {"world_size", "steps", "step_time_ms_mean",
    "step_time_ms_median", "samples_per_second", "final_loss", "bucket_bytes",
    "initial_bucket_bytes", "bucket_rebuilds", "forward_compute_us",
    "backward_compute_us", "backward_comm_us", "overlap_us"}. A step is one
    micro-batch (forward + backward, and the optimizer step when it is
    due), as concord-train counts them; its time runs from batch selection to
    its end on rank 0; the first 2 steps are excluded when there are more
    than 2. The bucket and timing entries come from PyTorch's
    ddp._get_ddp_logging_data() at the end (sizes in bytes; bucket_bytes is
    the layout after the rebuild when there was one; times are PyTorch's
    sampled averages converted from ns to us; bucket_rebuilds is 0 or 1).
    Also "initial_bucket_params" and "bucket_params": the parameter names of
    each bucket, in bucket order, before the first iteration and at the end
    (ddp.reducer._get_zeros_like_grad_buckets()).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures  # noqa: E402


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
    p.add_argument("--output", help="where the final state_dict goes (rank 0's, or the last "
                   "joiner's with uneven shards; {rank} in the path: every rank's)")
    p.add_argument("--metrics-out", help="where rank 0 writes metrics JSON")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each worker")
    p.add_argument("--log-interval", type=int, default=0, help="print rank 0's loss every N steps")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="process-group timeout in seconds")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda (rank r on cuda:r) or cuda:N (every rank on one device)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--start-method", choices=("fork", "spawn"), default="fork",
                   help="how the W worker processes start")
    ddp = p.add_argument_group("DDP options (PyTorch's names in concord-train's spelling)")
    # None: not given, so PyTorch's default (2.x then keeps its 1 MiB first
    # bucket; a given cap caps the first bucket too).
    ddp.add_argument("--bucket-cap-mb", type=float, default=None)
    ddp.add_argument("--find-unused-parameters", action="store_true")
    ddp.add_argument("--static-graph", action="store_true")
    p.add_argument("--skip-steps", type=int, default=0, metavar="N",
                   help="leave out the optimizer's first N steps (the two warm-up steps of a "
                        "ZeroRedundancyOptimizer overlapped with DDP update nothing)")
    ddp.add_argument("--grad-accum", type=int, default=1,
                     help="micro-batches per optimizer step (K-1 under no_sync)")
    ddp.add_argument("--comm-hook", choices=("allreduce", "fp16", "bf16"))
    ddp.add_argument("--gradient-as-bucket-view", action="store_true")
    ddp.add_argument("--no-broadcast-buffers", action="store_true")
    ddp.add_argument("--ignore", action="append", default=[], metavar="NAME",
                     help="parameter or buffer DDP leaves alone (repeatable)")
    join = p.add_argument_group("uneven shards (the loop inside DDP.join())")
    join.add_argument("--no-divide-by-initial-world-size", action="store_true",
                      help="join(divide_by_initial_world_size=False): divide by the ranks "
                           "still active")
    join.add_argument("--throw-on-early-termination", action="store_true",
                      help="join(throw_on_early_termination=True): every rank raises when "
                           "the first runs out of data")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    if args.grad_accum < 1:
        p.error("--grad-accum must be >= 1")
    if args.bucket_cap_mb is not None and not args.bucket_cap_mb > 0:
        p.error("--bucket-cap-mb must be positive")
    if args.comm_hook == "bf16":
        p.error("--comm-hook bf16: PyTorch 1.13's bf16_compress_hook needs NCCL; Gloo has no "
                "bfloat16 allreduce (compare with fixtures.simulate instead)")
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


def _sizes(text):
    """'19008, 4096' or '19008 4096' (PyTorch's logging strings) -> [ints]."""
    if not text:
        return []
    return [int(t) for t in str(text).replace(",", " ").split()]


def ddp_metrics(ld):
    """The entries of concord-train's --metrics-out, from
    ddp._get_ddp_logging_data()."""
    initial = _sizes(ld.get("bucket_sizes"))
    rebuilt = _sizes(ld.get("rebuilt_bucket_sizes"))
    us = lambda key: int(ld.get(key, 0)) // 1000  # noqa: E731 (ns -> us)
    return {
        "initial_bucket_bytes": initial,
        "bucket_bytes": rebuilt or initial,
        "bucket_rebuilds": 1 if int(ld.get("has_rebuilt_buckets", 0)) else 0,
        "forward_compute_us": us("avg_forward_compute_time"),
        "backward_compute_us": us("avg_backward_compute_time"),
        "backward_comm_us": us("avg_backward_comm_time"),
        "overlap_us": us("avg_backward_compute_comm_overlap_time"),
    }


def worker(rank, args, init_file):
    torch.set_num_threads(args.threads)
    world = args.world_size
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method="file://" + init_file, rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        model = torch.jit.load(args.model, map_location="cpu")
        inputs, targets = load_data(args.data)
        # concord-train's check that the model fits the data: an eval-mode,
        # no-grad forward on the first 2 samples on the CPU (see
        # fixtures.validation_forward: it moves TorchScript's profiling
        # executor on by one call); then the model goes to the device, as
        # concord-train's does.
        with torch.no_grad():
            model.eval()
            model(inputs[:min(2, inputs.size(0))])
        model.train()
        model.to(device)
        n = inputs.size(0)
        bs = args.batch_size
        my_batches = fixtures.num_batches(n, rank, world, bs)
        batches_per_rank = [fixtures.num_batches(n, r, world, bs) for r in range(world)]
        uneven = len(set(batches_per_rank)) > 1

        if args.ignore:
            known = set(k for k, _ in model.named_parameters()) | \
                set(k for k, _ in model.named_buffers())
            unknown = [k for k in args.ignore if k not in known]
            if unknown:
                raise ValueError("--ignore %s: no such parameter or buffer" % unknown)
            DDP._set_params_and_buffers_to_ignore_for_model(model, list(args.ignore))
        cap = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  broadcast_buffers=not args.no_broadcast_buffers, **cap,
                  find_unused_parameters=args.find_unused_parameters,
                  gradient_as_bucket_view=args.gradient_as_bucket_view,
                  static_graph=args.static_graph)
        if args.comm_hook is not None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            hook = {"allreduce": default_hooks.allreduce_hook,
                    "fp16": default_hooks.fp16_compress_hook}[args.comm_hook]
            ddp.register_comm_hook(None, hook)
        # Over every parameter, ignored ones included (they train locally).
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                              weight_decay=args.weight_decay, dampening=0, nesterov=False)
        K = args.grad_accum
        param_name = {id(p): k for k, p in model.named_parameters()}

        def bucket_params():
            return [[param_name[id(p)] for p in b.parameters()]
                    for b in ddp.reducer._get_zeros_like_grad_buckets()]
        initial_bucket_params = bucket_params()

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
        synced = [0]  # synchronised steps so far (--skip-steps)

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
                    x = inputs.index_select(0, idx).to(device)
                    y = targets.index_select(0, idx).to(device)
                    step_now = (b + 1) % K == 0 or b + 1 == my_batches
                    if step_now:
                        out = ddp(x)
                        loss = compute_loss(args.loss, out, y)
                        loss.backward()
                        if synced[0] >= args.skip_steps:
                            opt.step()
                        synced[0] += 1
                        opt.zero_grad(set_to_none=False)
                    else:
                        with ddp.no_sync():
                            out = ddp(x)
                            loss = compute_loss(args.loss, out, y)
                            loss.backward()
                    # Reading the loss waits for the step on a GPU, inside the
                    # timed span as in concord-train.
                    last_loss = float(loss.detach())
                    t1 = time.perf_counter()
                    steps += 1
                    step_times.append(t1 - t0)
                    step_samples.append(global_samples(b))
                    if rank == 0 and args.log_interval > 0 and steps % args.log_interval == 0:
                        print("[torch-ddp] step %d loss %.6f" % (steps, last_loss), flush=True)
            wall[1] = time.perf_counter()

        if uneven:
            with ddp.join(divide_by_initial_world_size=not args.no_divide_by_initial_world_size,
                          throw_on_early_termination=args.throw_on_early_termination):
                loop()
        else:
            loop()

        logging_data = ddp._get_ddp_logging_data()
        final_bucket_params = bucket_params()
        dist.barrier()
        if args.output:
            # After join() every rank holds the last joiner's model.
            writer = fixtures.last_joiner(batches_per_rank) if uneven else 0
            if "{rank}" in args.output or rank == writer:
                state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                torch.save(state, args.output.replace("{rank}", str(rank)))
        if rank == 0:
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
                metrics.update(ddp_metrics(logging_data))
                metrics["initial_bucket_params"] = initial_bucket_params
                metrics["bucket_params"] = final_bucket_params
                with open(args.metrics_out, "w") as f:
                    json.dump(metrics, f, indent=2)
                    f.write("\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without running the destructors: PyTorch 1.13 can deadlock in
    # ProcessGroupGloo's destructor (reached from the Reducer's when the
    # worker's locals go), which joins its threads while holding the GIL when
    # one of them is freeing a tensor whose Python object needs the GIL. Seen
    # in about one join() run in 20 with 4 ranks; everything is written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None):
    args = parse_args(argv)
    for label, path in (("--model", args.model), ("--data", args.data)):
        if not os.path.isfile(path):
            print("torch_ddp_train.py: %s %s: no such file" % (label, path), file=sys.stderr)
            return 2
    return run(args)


def run(args, timeout=None):
    """Train with parsed `args` (parse_args). Returns 0 on success, 1 when a
    worker failed and 124 when `timeout` seconds passed first (the workers
    are then killed). Callable in-process: with the fork start method the
    workers share the caller's imported torch (the tests use that to save a
    second interpreter start); the caller must not have started threads that
    a fork would break (torch's intra-op pool with OMP_NUM_THREADS=1 starts
    none)."""
    tmp = tempfile.mkdtemp(prefix="torch_ddp_init_")
    context = None
    try:
        init_file = os.path.join(tmp, "store")
        context = mp.start_processes(worker, args=(args, init_file), nprocs=args.world_size,
                                     join=False, start_method=args.start_method)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not context.join(timeout=1.0):
            if deadline is not None and time.monotonic() > deadline:
                print("torch_ddp_train.py: training timed out after %.0f s" % timeout,
                      file=sys.stderr)
                return 124
    except Exception as e:  # ProcessRaisedException / ProcessExitedException
        print("torch_ddp_train.py: training failed: %s" % e, file=sys.stderr)
        return 1
    finally:
        if context is not None:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

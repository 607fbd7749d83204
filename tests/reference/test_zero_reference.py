#!/usr/bin/python3
"""concord::ZeroRedundancyOptimizer against PyTorch's ZeroRedundancyOptimizer
with PyTorch's DDP, bit for bit.

    /usr/bin/python3 tests/reference/test_zero_reference.py --bin-dir B
        [--case NAME ...] [--device cpu|cuda:N] [--list]

An MLP (Linear(12, 24), ReLU, Linear(24, 24), Tanh, Linear(24, 3)) in DDP,
S steps of zero_grad, mse_loss(ddp(x), y).backward(), optimizer.step(),
then consolidate_state_dict(0).

Overlap cases (overlap 1 or 2): ZeroRedundancyOptimizer(...,
overlap_with_ddp=True) stepping inside DDP's communication hook,
hook_with_zero_step (1) or hook_with_zero_step_interleaved (2) of
torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook wrapping
allreduce_hook, with or without shard_buckets=True. Their model is larger
(Linear(12, 512), ReLU, Linear(512, 512), Tanh, Linear(512, 512), ReLU,
Linear(512, 3)) in DDP(model, bucket_cap_mb=0.25): after its rebuild DDP has 3
buckets, [L4.b, L4.w, L3.b, L3.w], [L2.b, L2.w], [L1.b, L1.w] (in PyTorch
1.13 and 2.x alike: the first bucket's cap stays 1 MiB), which ZeRO
assigns to the ranks whole (bucket i to rank i % W) or, with shard_buckets,
in pieces. The loop calls no optimizer.step() (PyTorch's docs: not with
overlap_with_ddp) and runs STEPS_OVERLAP steps: PyTorch updates nothing in the
first two (DDP rebuilds its buckets after iteration 1, ZeRO collects them in
iteration 2) and steps from the third on. Where they depart from PyTorch as
is:

- PyTorch builds these hooks only on NCCL/HCCL ("to avoid hangs", pytorch
  issue 62300, seen with Gloo on GPUs). This test runs Gloo on the CPU, so
  dist.get_backend answers "nccl" for the hook factory's check only (put back
  right after); a hang would still end at the test's timeout.
- hook_with_zero_step_interleaved steps each bucket in a callback on its
  allreduce's future, and broadcasts the bucket's parameters from there. Over
  Gloo that callback runs on Gloo's thread when the allreduce ends, so the
  ranks issue those broadcasts and the next buckets' allreduces in different
  orders: with allreduce_hook as is, 3 ranks abort in Gloo (mismatched
  messages) and, under 1.13, 2 ranks hang. The interleaved cases therefore
  wrap allreduce_hook to wait for its allreduce before returning the (then
  complete) future: the callback runs at once on the backward's thread, as
  it does with NCCL, and every rank issues the same collectives in the same
  order. The arithmetic (divide by W, allreduce, step the bucket's
  parameters) is unchanged.
- PyTorch's consolidate_state_dict fails with overlap_with_ddp (the local
  functional optimizer has no state_dict), so the consolidated state Concord
  saves on rank 0 is compared with the union of PyTorch's ranks' own states
  (each parameter's state from its owner).

Concord: tests/reference/zero_helper.cc (the public API only), W workers of
`concord-run --standalone --nproc W` over Gloo on the CPU. PyTorch: W
processes (torch.multiprocessing, fork), gloo through a file store,
DDP(model) and ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class,
parameters_as_bucket_view=..., overlap_with_ddp=...). Both start from the same tensors: this
script writes the initial parameters and every rank's inputs and targets
into one .pt file that both read.

--device cuda:N (the gpu test reference_zero_cuda_gloo, with a Python whose
torch has CUDA: CONCORD_CUDA_PYTHON): the same on CUDA tensors, every rank
on cuda:N over Gloo on both sides (NCCL refuses two ranks on one GPU):
zero_helper --device cuda:N (JobOptions::device, backend gloo; the model
and the batches on job.device()) and, on PyTorch's side, the model and the
batches on the device, DDP(device_ids=[N]) and processes started with spawn
(CUDA cannot be forked). Everything compared is read back onto the CPU.
Without a CUDA device it prints "CONCORD_TEST_SKIPPED: no CUDA device" and
exits 0 (ctest: skipped). Checked per case:

- the partition: the rank stepping each parameter is PyTorch's
  (zero._param_to_rank);
- every rank's final parameters, bit for bit;
- every rank's own optimizer state (PyTorch's zero.optim.state), bit for bit,
  and state for its shard's parameters only;
- the consolidated state on rank 0: Concord's torch::save of the
  ZeroRedundancyOptimizer loaded into a plain LibTorch optimizer of the same
  kind, against PyTorch's zero.state_dict() after consolidate_state_dict(0)
  (overlap cases: against PyTorch's ranks' own states put together);
- overlap cases: that PyTorch's DDP has the 3 buckets above (its
  zero._overlap_info.params_per_bucket).

Adam: Python's Adam in PyTorch 1.13 runs LibTorch's arithmetic (mul_, add_,
addcmul_, addcdiv_); PyTorch 2.x's updates the first moment with lerp_,
which rounds differently. Under 2.x PyTorch's ZeroRedundancyOptimizer
therefore wraps LibTorchAdam below (torch.optim.Adam's state, LibTorch's
arithmetic): what is compared is the sharding, not Python's Adam kernels.
Overlap needs a functional optimizer (ZeRO maps optimizer_class through
torch.distributed.optim.utils.functional_optim_map): LibTorchAdam maps to
_FunctionalLibTorchAdam below, the same arithmetic with the interface of
PyTorch's _FunctionalAdam. Under 1.13, torch.optim.Adam maps to PyTorch's own
_FunctionalAdam (its single-tensor kernel, as Adam's); torch.optim.SGD maps to
_FunctionalSGD in both.

Cases (--list): see CASES.
"""

import argparse
import collections
import datetime
import glob
import math
import os
import re
import sys
import tempfile
import time
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.optim.utils import functional_optim_map

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures  # noqa: E402
import processes  # noqa: E402

STEPS, STEPS_OVERLAP, BATCH = 5, 6, 8
LR_SGD, LR_ADAM, MOMENTUM = 0.05, 0.01, 0.9
# DDP's bucket_cap_mb for the overlap cases (the big model): 3 buckets.
BUCKET_CAP_MB = 0.25
OVERLAP_HOOKS = {1: "hook_with_zero_step", 2: "hook_with_zero_step_interleaved"}


class Case(collections.namedtuple("Case", "world optimizer bucket_view groups overlap "
                                          "shard_buckets")):
    """world size, optimizer (0 SGD, 1 Adam), parameters_as_bucket_view,
    parameter groups, overlap (0 none, 1 hook_with_zero_step, 2
    hook_with_zero_step_interleaved), shard_buckets. The model follows
    overlap: the small one (0) without, the big one (1) in
    DDP(bucket_cap_mb=BUCKET_CAP_MB) with."""

    @property
    def model(self):
        return 1 if self.overlap else 0

    @property
    def bucket_cap_mb(self):
        return BUCKET_CAP_MB if self.overlap else -1.0

    @property
    def steps(self):
        return STEPS_OVERLAP if self.overlap else STEPS


CASES = {
    "w2-sgd": Case(2, 0, False, 1, 0, False),
    "w3-adam": Case(3, 1, False, 1, 0, False),
    "w2-adam-bucket-view": Case(2, 1, True, 1, 0, False),
    "w3-sgd-bucket-view-groups": Case(3, 0, True, 2, 0, False),
    "w3-adam-groups": Case(3, 1, False, 2, 0, False),
    "w2-adam-overlap": Case(2, 1, False, 1, 1, False),
    "w3-adam-overlap-shard-buckets": Case(3, 1, False, 1, 1, True),
    "w3-sgd-overlap-interleaved": Case(3, 0, False, 1, 2, False),
    "w2-sgd-overlap-interleaved-shard-buckets": Case(2, 0, False, 1, 2, True),
}


# How concord::save_checkpoint writes the sharded state (see Note [Shards
# written where they are] in worker/checkpoint/disk.h): every rank its shard
# into rank 0's file (the default), or, for these cases, the ranks taking
# rank 0's files as on another filesystem (they send their bytes, which rank
# 0 writes into the holes), or every shard gathered on rank 0 as bytes.
CHECKPOINT_WRITES = {
    "w3-adam-groups": ("ranks 1-2 not seeing rank 0's files: their bytes written by rank 0",
                       {"CONCORD_TEST_CHECKPOINT_HOLES": "1"}),
    "w2-adam-bucket-view": ("gathered on rank 0 as bytes", {"CONCORD_TEST_SHARDS_AS_BYTES": "1"}),
}
IN_PLACE = ("each rank's shard written into rank 0's file by that rank", {})


def describe(case):
    """The case's options in words (--list and the check lines)."""
    return "%s%s%s%s%s" % (
        "Adam" if case.optimizer else "SGD",
        ", parameters_as_bucket_view" if case.bucket_view else "",
        ", add_param_group" if case.groups == 2 else "",
        ", overlap_with_ddp + %s(allreduce_hook%s)" % (
            OVERLAP_HOOKS[case.overlap], ", awaited" if case.overlap == 2 else "")
        if case.overlap else "",
        ", shard_buckets" if case.shard_buckets else "")


class LibTorchAdam(torch.optim.Optimizer):
    """torch.optim.Adam's state and options with LibTorch's step (adam.cpp):
    no lerp_, bias corrections as doubles."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    libtorch_adam_update(p, p.grad, self.state[p], group)
        return None


def libtorch_adam_update(p, grad, state, group):
    """One Adam step of p in LibTorch's arithmetic (adam.cpp): no lerp_, bias
    corrections as doubles. state: the parameter's dict (filled on its first
    step); group: lr, betas, eps, weight_decay."""
    beta1, beta2 = group["betas"]
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["step"] += 1
    step = int(state["step"].item())
    bias_correction1 = 1 - math.pow(beta1, step)
    bias_correction2 = 1 - math.pow(beta2, step)
    if group["weight_decay"] != 0:
        grad = grad.add(p, alpha=group["weight_decay"])
    state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
    p.addcdiv_(state["exp_avg"], denom, value=-(group["lr"] / bias_correction1))


class _FunctionalLibTorchAdam:
    """LibTorchAdam as a functional optimizer, for overlap_with_ddp (the
    interface of torch.distributed.optim's _FunctionalAdam): one parameter
    group `param_group` (ZeRO keeps its options in sync with its own
    param_groups, so they are read at every step), `state` param -> {"step",
    "exp_avg", "exp_avg_sq"}, and step(gradients) with one gradient or None
    (not stepped) per parameter."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 _allow_empty_param_list=False):
        if len(params) == 0 and not _allow_empty_param_list:
            raise ValueError("optimizer got an empty parameter list")
        self.param_group = {"params": params, "lr": lr, "betas": betas, "eps": eps,
                            "weight_decay": weight_decay}
        self.state = {}

    @torch.no_grad()
    def step(self, gradients):
        params = self.param_group["params"]
        if len(params) != len(gradients):
            raise ValueError("%d gradients for %d parameters" % (len(gradients), len(params)))
        for p, grad in zip(params, gradients):
            if grad is not None:
                libtorch_adam_update(p, grad, self.state.setdefault(p, {}), self.param_group)


# The map ZeroRedundancyOptimizer(overlap_with_ddp=True) takes its functional
# optimizer from (the dict zero_redundancy_optimizer imported).
functional_optim_map[LibTorchAdam] = _FunctionalLibTorchAdam


def adam_class():
    return torch.optim.Adam if int(torch.__version__.split(".")[0]) < 2 else LibTorchAdam


def make_model(big=False):
    """The small MLP of the plain cases, or (big) the overlap cases' one."""
    if big:
        return nn.Sequential(nn.Linear(12, 512), nn.ReLU(), nn.Linear(512, 512), nn.Tanh(),
                             nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 3))
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 3))


def make_inputs(name, path):
    """The .pt both sides read (zero_helper.cc says what it holds)."""
    case = CASES[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    model = make_model(big=case.model == 1)
    out = {}
    for i, p in enumerate(model.parameters()):
        out["param.%d" % i] = p.detach().clone()
    out["x"] = torch.randn(case.steps, case.world, BATCH, 12)
    out["y"] = torch.randn(case.steps, case.world, BATCH, 3)
    out["optimizer"] = torch.tensor(case.optimizer)
    out["lr"] = torch.tensor(LR_ADAM if case.optimizer else LR_SGD, dtype=torch.float64)
    out["momentum"] = torch.tensor(MOMENTUM, dtype=torch.float64)
    out["bucket_view"] = torch.tensor(int(case.bucket_view))
    out["groups"] = torch.tensor(case.groups)
    out["overlap"] = torch.tensor(case.overlap)
    out["shard_buckets"] = torch.tensor(int(case.shard_buckets))
    out["model"] = torch.tensor(case.model)
    out["bucket_cap_mb"] = torch.tensor(case.bucket_cap_mb, dtype=torch.float64)
    torch.save(out, path)
    return out


def put_state(out, prefix, state):
    for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
        if key in state:
            out["%s.%s" % (prefix, key)] = state[key].clone()
    if "step" in state:
        out[prefix + ".step"] = torch.tensor(int(float(state["step"])))


def awaited_allreduce_hook(state, bucket):
    """allreduce_hook, its allreduce waited for: the future it returns is
    complete, so hook_with_zero_step_interleaved's callback on it runs at once,
    on this (the backward's) thread (see the docstring)."""
    fut = allreduce_hook(state, bucket)
    fut.wait()
    return fut


def zero_hook(overlap, ddp, zero, shard_buckets):
    """DDP's communication hook stepping `zero` (overlap 1:
    hook_with_zero_step, 2: hook_with_zero_step_interleaved) around
    allreduce_hook."""
    factory = getattr(ddp_zero_hook, OVERLAP_HOOKS[overlap])
    hook = allreduce_hook if overlap == 1 else awaited_allreduce_hook
    # The factory refuses any backend but NCCL/HCCL (pytorch issue 62300: a
    # hang seen with Gloo on GPUs). On the CPU it runs (a hang would end at
    # the timeout): its check alone is told "nccl".
    get_backend = ddp_zero_hook.dist.get_backend
    ddp_zero_hook.dist.get_backend = lambda group=None: dist.Backend.NCCL
    try:
        return factory(hook, ddp, zero, shard_buckets=shard_buckets)
    finally:
        ddp_zero_hook.dist.get_backend = get_backend


def torch_worker(rank, world, init_file, in_path, prefix, device="cpu"):
    torch.set_num_threads(1)
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        inputs = torch.load(in_path)
        overlap = int(inputs["overlap"])
        model = make_model(big=int(inputs["model"]) == 1)
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(inputs["param.%d" % i])
        model.to(device)
        bucket_cap_mb = float(inputs["bucket_cap_mb"])
        options = dict(bucket_cap_mb=bucket_cap_mb) if bucket_cap_mb >= 0 else {}
        if cuda:
            options["device_ids"] = [device.index]
        ddp = nn.parallel.DistributedDataParallel(model, **options)
        adam = int(inputs["optimizer"]) == 1
        lr = float(inputs["lr"])
        two_groups = int(inputs["groups"]) == 2
        params = list(ddp.parameters())
        first = params[:-2] if two_groups else params
        kwargs = dict(lr=lr) if adam else dict(lr=lr, momentum=float(inputs["momentum"]))
        zero = ZeroRedundancyOptimizer(
            first, optimizer_class=adam_class() if adam else torch.optim.SGD,
            parameters_as_bucket_view=bool(int(inputs["bucket_view"])),
            overlap_with_ddp=overlap != 0, **kwargs)
        if two_groups:
            group = dict(kwargs, params=params[-2:], lr=lr / 2)
            zero.add_param_group(group)
        if overlap:
            ddp.register_comm_hook(None, zero_hook(overlap, ddp, zero,
                                                   bool(int(inputs["shard_buckets"]))))
        x, y = inputs["x"].to(device), inputs["y"].to(device)
        for s in range(x.size(0)):
            zero.zero_grad(set_to_none=False)
            F.mse_loss(ddp(x[s][rank]), y[s][rank]).backward()
            if not overlap:  # with overlap DDP's hook steps (step() only warns)
                zero.step()
        result = {}
        index = {p: i for i, p in enumerate(model.parameters())}
        if overlap:
            # ZeRO's delayed initialisation happened (iteration 3): the
            # partition below follows DDP's buckets.
            for b, bucket in enumerate(zero._overlap_info.params_per_bucket):
                result["bucket.%d" % b] = torch.tensor([index[p] for p in bucket])
        owners = zero._param_to_rank
        for i, p in enumerate(model.parameters()):
            result["param.%d" % i] = p.detach().clone()
            result["owner.%d" % i] = torch.tensor(owners[p])
            if owners[p] == rank:
                put_state(result, "local.%d" % i, zero.optim.state[p])
        result["local_count"] = torch.tensor(len(zero.optim.state))
        # With overlap the local optimizer is functional, without state_dict():
        # consolidate_state_dict fails (run_case takes the ranks' own states).
        if not overlap:
            zero.consolidate_state_dict(0)
            if rank == 0:
                for i, state in zero.state_dict()["state"].items():
                    put_state(result, "state.%d" % i, state)
        torch.save(result, "%s.rank%d.pt" % (prefix, rank))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    fixtures.leave_rank()


def run_torch(tmp, name, in_path, device, timeout=120.0):
    """PyTorch's side: (every rank's results, None) or (None, why not)."""
    world = CASES[name].world
    prefix = os.path.join(tmp, name + ".torch")
    init_file = os.path.join(tmp, name + ".store")
    error = fixtures.run_ranks(torch_worker, (world, init_file, in_path, prefix, device), world,
                               timeout, "PyTorch's ZeroRedundancyOptimizer",
                               start_method="fork" if device == "cpu" else "spawn")
    if error:
        return None, error
    return [fixtures.load_state("%s.rank%d.pt" % (prefix, r)) for r in range(world)], None


def concord_command(bin_dir, tmp, name, in_path, prefix, env, device, flags=()):
    """Runs zero_helper under concord-run (with `flags`) for case `name` on
    `device`: its CommandResult."""
    world = CASES[name].world
    cmd = [os.path.join(bin_dir, "concord-run"), "--standalone", "--nproc", str(world),
           "--job-id", "zero-" + name] + list(flags) + ["--",
           os.path.join(bin_dir, "zero_helper"), "--in", in_path, "--out", prefix] + (
               [] if device == "cpu" else ["--device", device])
    return processes.run_command(cmd, timeout=120, cwd=tmp, env=env)


def run_concord(bin_dir, tmp, name, in_path, device):
    """Concord's side: (every rank's results, its output) or (None, why not)."""
    world = CASES[name].world
    prefix = os.path.join(tmp, name + ".concord")
    r = concord_command(bin_dir, tmp, name, in_path, prefix,
                        CHECKPOINT_WRITES.get(name, IN_PLACE)[1], device)
    if r.returncode != 0 or r.timed_out:
        return None, r.describe()
    return [{str(k): v for k, v in torch.load("%s.rank%d.pt" % (prefix, rank),
                                              map_location="cpu",
                                              weights_only=False).items()}
            for rank in range(world)], r.stdout + r.stderr


def differences(actual, expected, keys):
    """Lines naming what is not bit-identical among `keys` (empty: all equal)."""
    out = []
    missing = [k for k in keys if k not in actual or k not in expected]
    if missing:
        out.append("missing on one side: %s" % missing)
    for k in sorted(k for k in keys if k in actual and k in expected):
        a, e = actual[k], expected[k]
        if a.dtype != e.dtype or a.shape != e.shape:
            out.append("%s: %s %s, expected %s %s" % (k, a.dtype, tuple(a.shape), e.dtype,
                                                      tuple(e.shape)))
        elif not torch.equal(a, e):
            out.append("%s: max abs diff %.3e" % (k, float((a.double() - e.double()).abs().max())))
    return out


def union_of_local_states(want):
    """PyTorch's consolidated state as the ranks' own states put together
    (each parameter's from its owner), "state.<i>.*" like state_dict()'s;
    with the indices of the parameters that have none."""
    out = {}
    for results in want:
        for k, v in results.items():
            if k.startswith("local."):
                out["state." + k[len("local."):]] = v
    params = sorted(int(k.split(".")[1]) for k in want[0] if k.startswith("param."))
    stateless = [i for i in params if not any(k.startswith("state.%d." % i) for k in out)]
    return out, stateless


def run_case(checks, bin_dir, tmp, name, device="cpu"):
    case = CASES[name]
    world = case.world
    what = "%s, %s%s" % (name, describe(case), "" if device == "cpu" else ", on " + device)
    in_path = os.path.join(tmp, name + ".in.pt")
    inputs = make_inputs(name, in_path)
    start = time.monotonic()
    want, error = run_torch(tmp, name, in_path, device)
    if not checks.check(want is not None, "%s: PyTorch's ZeroRedundancyOptimizer and DDP, %d "
                        "ranks, %d steps" % (what, world, case.steps), error or ""):
        return
    torch_s = time.monotonic() - start
    if case.overlap:
        buckets = [want[0][k].tolist() for k in sorted(
            (k for k in want[0] if k.startswith("bucket.")), key=lambda k: int(k.split(".")[1]))]
        if not checks.check(len(buckets) == 3, "%s: PyTorch's DDP has 3 buckets (bucket_cap_mb "
                            "%g)" % (what, case.bucket_cap_mb),
                            "%d buckets (parameter indices): %s" % (len(buckets), buckets)):
            return
        consolidated, stateless = union_of_local_states(want)
        if not checks.check(not stateless, "%s: PyTorch's ranks' own states put together cover "
                            "every parameter" % what, "no state for parameters %s" % stateless):
            return
        want[0].update(consolidated)
    start = time.monotonic()
    got, output = run_concord(bin_dir, tmp, name, in_path, device)
    if not checks.check(got is not None, "%s: concord-run --standalone --nproc %d -- zero_helper"
                        % (what, world), output):
        return
    checks.ok("%s: ran (PyTorch %.1f s, Concord %.1f s)" % (what, torch_s,
                                                            time.monotonic() - start))
    params = sorted(k for k in want[0] if k.startswith("param."))
    moved = [k for k in params if not torch.equal(want[0][k], inputs[k])]
    checks.check(len(moved) == len(params), "%s: training moved every parameter" % what,
                 "unchanged: %s" % sorted(set(params) - set(moved)))
    owners = sorted(k for k in want[0] if k.startswith("owner."))
    checks.check(not differences(got[0], want[0], owners),
                 "%s: each parameter stepped by PyTorch's rank: %s" % (
                     what, [int(want[0][k]) for k in owners]),
                 "\n".join(differences(got[0], want[0], owners)))
    used = sorted(set(int(want[0][k]) for k in owners))
    checks.check(used == list(range(world)), "%s: every rank steps a shard" % what,
                 "ranks with parameters: %s" % used)
    for rank in range(world):
        problems = differences(got[rank], want[rank], params)
        checks.check(not problems, "%s: rank %d: %d parameters bit-identical to PyTorch's" %
                     (what, rank, len(params)), "\n".join(problems))
        local = sorted(k for k in want[rank] if k.startswith("local."))
        extra = sorted(k for k in got[rank] if k.startswith("local.") and k not in want[rank])
        problems = differences(got[rank], want[rank], local) + (
            ["Concord holds more: %s" % extra] if extra else [])
        checks.check(local and not problems, "%s: rank %d: its own optimizer state (%d "
                     "tensors) bit-identical to PyTorch's" % (what, rank, len(local)),
                     "\n".join(problems))
        counts = int(got[rank]["local_count"]), int(want[rank]["local_count"])
        checks.check(counts[0] == counts[1] < len(params),
                     "%s: rank %d holds optimizer state for %d of the %d parameters only, as "
                     "PyTorch's" % (what, rank, counts[1], len(params)),
                     "Concord %d, PyTorch %d" % counts)
    state = sorted(k for k in want[0] if k.startswith("state."))
    problems = differences(got[0], want[0], state)
    checks.check(state and not problems, "%s: rank 0: the consolidated state, saved and loaded "
                 "into a plain LibTorch optimizer (%d tensors), bit-identical to PyTorch's %s"
                 % (what, len(state), "ranks' own states put together" if case.overlap
                    else "state_dict()"), "\n".join(problems))
    # concord::save_checkpoint of the sharded optimizer: PyTorch's state_dict,
    # whole, in optimizer.pt.
    found = glob.glob(os.path.join(tmp, name + ".concord.ckpt", "*", "step-%d" % case.steps,
                                   "optimizer.pt"))
    problems = ["optimizer.pt: %d found" % len(found)] if len(found) != 1 else []
    if not problems:
        saved = torch.load(found[0], map_location="cpu", weights_only=False)
        flat = {}
        for i, entry in saved["state"].items():
            put_state(flat, "state.%d" % i, entry)
        problems = differences(flat, want[0], state)
        groups = [len(g["params"]) for g in saved["param_groups"]]
        if sum(groups) != len(params):
            problems.append("param_groups hold %s parameters of %d" % (groups, len(params)))
    how, env = CHECKPOINT_WRITES.get(name, IN_PLACE)
    checks.check(state and not problems, "%s: concord::save_checkpoint writes the whole state as "
                 "PyTorch's state_dict (optimizer.pt, %d tensors; %s), bit-identical to PyTorch's"
                 % (what, len(state), how), "\n".join(problems))
    # Rank 0's line says who wrote the other ranks' shards into its file.
    said = re.search(r"save_checkpoint: step \d+: (\d+) tensors of sharded optimizer state "
                     r"written into it by the ranks holding them, (\d+) by rank 0", output)
    if "CONCORD_TEST_SHARDS_AS_BYTES" in env:
        checks.check(said is None, "%s: rank 0 wrote the state it gathered itself" % what,
                     said.group(0) if said else "")
    else:
        by_ranks, from_bytes = (int(said.group(1)), int(said.group(2))) if said else (0, 0)
        unseen = "CONCORD_TEST_CHECKPOINT_HOLES" in env
        if unseen:
            right = by_ranks == 0 and from_bytes > 0
        else:
            right = by_ranks > 0 and from_bytes == 0
        checks.check(said and right,
                     "%s: the other ranks' shards went into rank 0's file %s" % (
                         what, "as bytes rank 0 wrote" if unseen else "from those ranks"),
                     said.group(0) if said else "rank 0 said nothing of it:\n" + output[-3000:])
    if name == FAILED_WRITE_CASE:
        check_failed_write(checks, bin_dir, tmp, name, in_path, device)


# The case run once more with its ranks failing to write their shards into
# rank 0's checkpoint (CONCORD_TEST_CHECKPOINT_HOLES=2).
FAILED_WRITE_CASE = "w3-adam"


def check_failed_write(checks, bin_dir, tmp, name, in_path, device):
    """A rank that cannot write its shard fails the checkpoint on every rank,
    at once (no rank waits for a collective), and leaves nothing behind."""
    what = "%s, its ranks failing to write their shards" % name
    prefix = os.path.join(tmp, name + ".failing")
    # --min-workers 1: concord-run lets the last ranks end on their own.
    r = concord_command(bin_dir, tmp, name, in_path, prefix,
                        {"CONCORD_TEST_CHECKPOINT_HOLES": "2"}, device,
                        ["--min-workers", "1"])
    said = set(re.findall(r"\[worker (\d+)\] zero_helper: UNAVAILABLE: rank \d+ could not "
                          r"write its shard into the checkpoint: test fault", r.stderr))
    world = CASES[name].world
    checks.check(r.returncode != 0 and not r.timed_out and len(said) == world,
                 "%s: every rank's save_checkpoint throws rank 0's error (%d of %d, in %.1f s)"
                 % (what, len(said), world, r.elapsed), r.describe())
    # The job's folder keeps its writer lock (.writer) alone.
    jobs = glob.glob(os.path.join(prefix + ".ckpt", "*"))
    left = sorted(e for j in jobs for e in os.listdir(j) if e != ".writer")
    checks.check(len(jobs) == 1 and not left,
                 "%s: no checkpoint and no staging directory left in %s" % (what, jobs),
                 "left: %s" % left)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--case", action="append", choices=sorted(CASES),
                        help="a case to run (repeatable; default: all)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda:N: every rank on that GPU over Gloo, both sides")
    parser.add_argument("--list", action="store_true", help="list the cases")
    args = parser.parse_args()
    if args.device != "cpu" and not re.fullmatch(r"cuda:\d+", args.device):
        parser.error("--device: cpu or cuda:N, not %r" % args.device)
    if args.list:
        for name, case in CASES.items():
            print("%s: %d ranks, %s; %d steps; overlap %d, shard_buckets %d, model %d (%s), "
                  "bucket_cap_mb %g" % (name, case.world, describe(case), case.steps,
                                        case.overlap, int(case.shard_buckets), case.model,
                                        "big" if case.model else "small", case.bucket_cap_mb))
        return 0
    if args.device != "cpu" and not torch.cuda.is_available():
        print("CONCORD_TEST_SKIPPED: no CUDA device (torch %s, built with CUDA %s)" % (
            torch.__version__, torch.version.cuda))
        return 0
    torch.set_num_threads(1)
    checks = fixtures.Checks()
    bin_dir = os.path.abspath(args.bin_dir)
    with tempfile.TemporaryDirectory(prefix="zero_") as tmp:
        for name in args.case or list(CASES):
            run_case(checks, bin_dir, tmp, name, args.device)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

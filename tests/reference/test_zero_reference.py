#!/usr/bin/python3
"""concord::ZeroRedundancyOptimizer against PyTorch's ZeroRedundancyOptimizer
with PyTorch's DDP, bit for bit.

    /usr/bin/python3 tests/reference/test_zero_reference.py --bin-dir B
        [--case NAME ...] [--list]

An MLP (Linear(12, 24), ReLU, Linear(24, 24), Tanh, Linear(24, 3)) in DDP,
S steps of zero_grad, mse_loss(ddp(x), y).backward(), optimizer.step(),
then consolidate_state_dict(0).

Concord: tests/reference/zero_helper.cc (the public API only), W workers of
`concord-run --standalone --nproc W` over Gloo on the CPU. PyTorch: W
processes (torch.multiprocessing, fork), gloo through a file store,
DDP(model) and ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class,
parameters_as_bucket_view=...). Both start from the same tensors: this
script writes the initial parameters and every rank's inputs and targets
into one .pt file that both read. Checked per case:

- the partition: the rank stepping each parameter is PyTorch's
  (zero._param_to_rank);
- every rank's final parameters, bit for bit;
- every rank's own optimizer state (PyTorch's zero.optim.state), bit for bit,
  and state for its shard's parameters only;
- the consolidated state on rank 0: Concord's torch::save of the
  ZeroRedundancyOptimizer loaded into a plain LibTorch optimizer of the same
  kind, against PyTorch's zero.state_dict() after consolidate_state_dict(0).

Adam: Python's Adam in PyTorch 1.13 runs LibTorch's arithmetic (mul_, add_,
addcmul_, addcdiv_); PyTorch 2.x's updates the first moment with lerp_,
which rounds differently. Under 2.x PyTorch's ZeroRedundancyOptimizer
therefore wraps LibTorchAdam below (torch.optim.Adam's state, LibTorch's
arithmetic): what is compared is the sharding, not Python's Adam kernels.

Cases (--list): see CASES.
"""

import argparse
import datetime
import math
import os
import sys
import tempfile
import time
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures  # noqa: E402
import processes  # noqa: E402

STEPS, BATCH = 5, 8
LR_SGD, LR_ADAM, MOMENTUM = 0.05, 0.01, 0.9
# name: (world size, optimizer (0 SGD, 1 Adam), bucket view, groups)
CASES = {
    "w2-sgd": (2, 0, False, 1),
    "w3-adam": (3, 1, False, 1),
    "w2-adam-bucket-view": (2, 1, True, 1),
    "w3-sgd-bucket-view-groups": (3, 0, True, 2),
    "w3-adam-groups": (3, 1, False, 2),
}


class LibTorchAdam(torch.optim.Optimizer):
    """torch.optim.Adam's state and options with LibTorch's step (adam.cpp):
    no lerp_, bias corrections as doubles."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
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
        return None


def adam_class():
    return torch.optim.Adam if int(torch.__version__.split(".")[0]) < 2 else LibTorchAdam


def make_model():
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 3))


def make_inputs(name, path):
    """The .pt both sides read (zero_helper.cc says what it holds)."""
    world, optimizer, bucket_view, groups = CASES[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    model = make_model()
    out = {}
    for i, p in enumerate(model.parameters()):
        out["param.%d" % i] = p.detach().clone()
    out["x"] = torch.randn(STEPS, world, BATCH, 12)
    out["y"] = torch.randn(STEPS, world, BATCH, 3)
    out["optimizer"] = torch.tensor(optimizer)
    out["lr"] = torch.tensor(LR_ADAM if optimizer else LR_SGD, dtype=torch.float64)
    out["momentum"] = torch.tensor(MOMENTUM, dtype=torch.float64)
    out["bucket_view"] = torch.tensor(int(bucket_view))
    out["groups"] = torch.tensor(groups)
    torch.save(out, path)
    return out


def put_state(out, prefix, state):
    for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
        if key in state:
            out["%s.%s" % (prefix, key)] = state[key].clone()
    if "step" in state:
        out[prefix + ".step"] = torch.tensor(int(float(state["step"])))


def torch_worker(rank, world, init_file, in_path, prefix):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        inputs = torch.load(in_path)
        model = make_model()
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(inputs["param.%d" % i])
        ddp = nn.parallel.DistributedDataParallel(model)
        adam = int(inputs["optimizer"]) == 1
        lr = float(inputs["lr"])
        two_groups = int(inputs["groups"]) == 2
        params = list(ddp.parameters())
        first = params[:-2] if two_groups else params
        kwargs = dict(lr=lr) if adam else dict(lr=lr, momentum=float(inputs["momentum"]))
        zero = ZeroRedundancyOptimizer(
            first, optimizer_class=adam_class() if adam else torch.optim.SGD,
            parameters_as_bucket_view=bool(int(inputs["bucket_view"])), **kwargs)
        if two_groups:
            group = dict(kwargs, params=params[-2:], lr=lr / 2)
            zero.add_param_group(group)
        x, y = inputs["x"], inputs["y"]
        for s in range(x.size(0)):
            zero.zero_grad(set_to_none=False)
            F.mse_loss(ddp(x[s][rank]), y[s][rank]).backward()
            zero.step()
        result = {}
        owners = zero._param_to_rank
        for i, p in enumerate(model.parameters()):
            result["param.%d" % i] = p.detach().clone()
            result["owner.%d" % i] = torch.tensor(owners[p])
            if owners[p] == rank:
                put_state(result, "local.%d" % i, zero.optim.state[p])
        result["local_count"] = torch.tensor(len(zero.optim.state))
        zero.consolidate_state_dict(0)
        if rank == 0:
            for i, state in zero.state_dict()["state"].items():
                put_state(result, "state.%d" % i, state)
        torch.save(result, "%s.rank%d.pt" % (prefix, rank))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    fixtures.leave_rank()


def run_torch(tmp, name, in_path, timeout=120.0):
    """PyTorch's side: (every rank's results, None) or (None, why not)."""
    world = CASES[name][0]
    prefix = os.path.join(tmp, name + ".torch")
    init_file = os.path.join(tmp, name + ".store")
    error = fixtures.run_ranks(torch_worker, (world, init_file, in_path, prefix), world,
                               timeout, "PyTorch's ZeroRedundancyOptimizer")
    if error:
        return None, error
    return [fixtures.load_state("%s.rank%d.pt" % (prefix, r)) for r in range(world)], None


def run_concord(bin_dir, tmp, name, in_path):
    """Concord's side: (every rank's results, None) or (None, why not)."""
    world = CASES[name][0]
    prefix = os.path.join(tmp, name + ".concord")
    cmd = [os.path.join(bin_dir, "concord-run"), "--standalone", "--nproc", str(world),
           "--job-id", "zero-" + name, "--",
           os.path.join(bin_dir, "zero_helper"), "--in", in_path, "--out", prefix]
    r = processes.run_command(cmd, timeout=120, cwd=tmp)
    if r.returncode != 0 or r.timed_out:
        return None, r.describe()
    return [{str(k): v for k, v in torch.load("%s.rank%d.pt" % (prefix, rank),
                                              weights_only=False).items()}
            for rank in range(world)], None


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


def run_case(checks, bin_dir, tmp, name):
    world, optimizer, bucket_view, groups = CASES[name]
    what = "%s, %s%s%s" % (name, "Adam" if optimizer else "SGD",
                           ", parameters_as_bucket_view" if bucket_view else "",
                           ", add_param_group" if groups == 2 else "")
    in_path = os.path.join(tmp, name + ".in.pt")
    inputs = make_inputs(name, in_path)
    start = time.monotonic()
    want, error = run_torch(tmp, name, in_path)
    if not checks.check(want is not None, "%s: PyTorch's ZeroRedundancyOptimizer and DDP, %d "
                        "ranks, %d steps" % (what, world, STEPS), error or ""):
        return
    torch_s = time.monotonic() - start
    start = time.monotonic()
    got, error = run_concord(bin_dir, tmp, name, in_path)
    if not checks.check(got is not None, "%s: concord-run --standalone --nproc %d -- zero_helper"
                        % (what, world), error or ""):
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
                 "into a plain LibTorch optimizer (%d tensors), bit-identical to PyTorch's "
                 "state_dict()" % (what, len(state)), "\n".join(problems))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--case", action="append", choices=sorted(CASES),
                        help="a case to run (repeatable; default: all)")
    parser.add_argument("--list", action="store_true", help="list the cases")
    args = parser.parse_args()
    if args.list:
        for name, (world, optimizer, bucket_view, groups) in CASES.items():
            print("%s: %d ranks, %s%s%s" % (name, world, "Adam" if optimizer else "SGD",
                                            ", bucket view" if bucket_view else "",
                                            ", two groups" if groups == 2 else ""))
        return 0
    torch.set_num_threads(1)
    checks = fixtures.Checks()
    bin_dir = os.path.abspath(args.bin_dir)
    with tempfile.TemporaryDirectory(prefix="zero_") as tmp:
        for name in args.case or list(CASES):
            run_case(checks, bin_dir, tmp, name)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

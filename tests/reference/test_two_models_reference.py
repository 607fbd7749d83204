#!/usr/bin/python3
"""Two models in one job against PyTorch's DDP with two DDP modules in one
process group, bit for bit.

    /usr/bin/python3 tests/reference/test_two_models_reference.py --bin-dir B
        [--case NAME ...] [--list]

A GAN-like step on small MLPs with BatchNorm1d (a generator G: Linear,
BatchNorm1d, ReLU, Linear, Tanh; a discriminator D: Linear, BatchNorm1d,
LeakyReLU(0.2), Linear, Sigmoid), each in its own DDP, S steps of:

    D.zero_grad(set_to_none=False)
    D(real) -> binary_cross_entropy(labels) -> backward       # D reduced
    fake = G(noise)
    D(fake.detach()) -> bce(zeros) -> backward                # D reduced
    D's optimizer steps                                       # early step
    G.zero_grad(set_to_none=False)
    D(fake) -> bce(ones) -> backward through D and G          # D, G reduced
    G's optimizer steps

with SGD (momentum 0.9) on both. Adam is not used: PyTorch 2.x's Python
Adam updates with lerp_ and is not bit-identical to LibTorch's C++ Adam.

Concord: tests/reference/two_models_helper.cc (the public API only), W
workers of `concord-run --standalone --nproc W` over Gloo on the CPU, both
DDPs and both optimizers in one ElasticState, the loop in run_elastic.
PyTorch: W processes (torch.multiprocessing, fork), gloo through a file
store, DDP(G) then DDP(D) in the default process group. Both sides start
from the same tensors: this script writes the initial parameters and
buffers, every rank's real samples, smoothed labels and noise into one .pt
file that both read. Each rank's final parameters and buffers (BatchNorm's
running statistics, which DDP broadcasts from rank 0 before every forward)
must be equal, tensor by tensor, to the same rank's on the other side.

Cases (--list):
  w3-allreduce  3 ranks, DDP's default allreduce (Gloo's order of adding
                three shares matters here).
  w2-hook       2 ranks, a communication hook with state on the
                discriminator on both sides: the bucket divided by the world
                size, allreduced, then multiplied by 0.5 on the odd calls of
                the hook state's own counter (PyTorch:
                ddp.register_comm_hook(state, hook) returning
                dist.all_reduce(t, async_op=True).get_future().then(...)).
                The hook must have been called 3 times per step on every
                rank on both sides.
  w2-plain      2 ranks, both models given to Concord's DDP as
                std::make_shared<Net>() of plain `struct Net :
                torch::nn::Module`s (no TORCH_MODULE holder).

Prints one PASS/FAIL line per check and 'N passed, N failed'; exits 1 on
any failure.
"""

import argparse
import datetime
import os
import sys
import tempfile
import time
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures  # noqa: E402
import processes  # noqa: E402

NOISE, HIDDEN, DATA = 8, 32, 16  # two_models_helper.cc's sizes
STEPS, BATCH = 4, 8  # per case; BATCH samples per rank and step
LR, MOMENTUM = 0.05, 0.9
# name: (world size, hook on the discriminator, plain modules in Concord)
CASES = {
    "w3-allreduce": (3, False, False),
    "w2-hook": (2, True, False),
    "w2-plain": (2, False, True),
}


def make_models():
    """G and D with the helper's layers in its registration order."""
    g = nn.Sequential(nn.Linear(NOISE, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(),
                      nn.Linear(HIDDEN, DATA), nn.Tanh())
    d = nn.Sequential(nn.Linear(DATA, HIDDEN), nn.BatchNorm1d(HIDDEN),
                      nn.LeakyReLU(0.2), nn.Linear(HIDDEN, 1), nn.Sigmoid())
    return g, d


def make_inputs(name, path):
    """The .pt both sides read (two_models_helper.cc says what it holds)."""
    world, hook, plain = CASES[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    g, d = make_models()
    out = {}
    for prefix, m in (("g", g), ("d", d)):
        for i, p in enumerate(m.parameters()):
            out["%s.param.%d" % (prefix, i)] = p.detach().clone()
        for i, b in enumerate(m.buffers()):
            out["%s.buffer.%d" % (prefix, i)] = b.clone()
    # Real samples from a fixed random map of Gaussian noise, so that
    # there is something to learn.
    mix = torch.randn(DATA, DATA) / DATA ** 0.5
    out["real"] = torch.tanh(torch.randn(STEPS, world, BATCH, DATA) @ mix + 0.3)
    out["real_labels"] = torch.empty(STEPS, world, BATCH).uniform_(0.8, 1.0)
    out["noise"] = torch.randn(STEPS, world, BATCH, NOISE)
    out["lr"] = torch.tensor(LR, dtype=torch.float64)
    out["momentum"] = torch.tensor(MOMENTUM, dtype=torch.float64)
    out["hook"] = torch.tensor(int(hook))
    out["plain"] = torch.tensor(int(plain))
    torch.save(out, path)
    return out


class HalvingState(object):
    """The comm hook's state: its own call counter."""

    def __init__(self):
        self.calls = 0


def halving_hook(state, bucket):
    t = bucket.buffer().div_(dist.get_world_size())
    state.calls += 1
    factor = 0.5 if state.calls % 2 else 1.0
    return dist.all_reduce(t, async_op=True).get_future().then(
        lambda fut: fut.value()[0].mul_(factor))


def torch_worker(rank, world, init_file, in_path, prefix):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        inputs = torch.load(in_path)
        g, d = make_models()
        with torch.no_grad():
            for key, m in (("g", g), ("d", d)):
                for i, p in enumerate(m.parameters()):
                    p.copy_(inputs["%s.param.%d" % (key, i)])
                for i, b in enumerate(m.buffers()):
                    b.copy_(inputs["%s.buffer.%d" % (key, i)])
        g_ddp = nn.parallel.DistributedDataParallel(g)
        d_ddp = nn.parallel.DistributedDataParallel(d)
        state = HalvingState()
        if int(inputs["hook"]):
            d_ddp.register_comm_hook(state, halving_hook)
        g_opt = torch.optim.SGD(g_ddp.parameters(), lr=LR, momentum=MOMENTUM)
        d_opt = torch.optim.SGD(d_ddp.parameters(), lr=LR, momentum=MOMENTUM)
        real, labels, noise = inputs["real"], inputs["real_labels"], inputs["noise"]
        for s in range(real.size(0)):
            d.zero_grad(set_to_none=False)
            out = d_ddp(real[s][rank]).view(-1)
            F.binary_cross_entropy(out, labels[s][rank]).backward()
            fake = g_ddp(noise[s][rank])
            out = d_ddp(fake.detach()).view(-1)
            F.binary_cross_entropy(out, torch.zeros_like(out)).backward()
            d_opt.step()
            g.zero_grad(set_to_none=False)
            out = d_ddp(fake).view(-1)
            F.binary_cross_entropy(out, torch.ones_like(out)).backward()
            g_opt.step()
        result = {"hook_calls": torch.tensor(state.calls)}
        for key, m in (("g", g), ("d", d)):
            for i, p in enumerate(m.parameters()):
                result["%s.param.%d" % (key, i)] = p.detach().clone()
            for i, b in enumerate(m.buffers()):
                result["%s.buffer.%d" % (key, i)] = b.clone()
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
                               timeout, "PyTorch's DDP")
    if error:
        return None, error
    return [fixtures.load_state("%s.rank%d.pt" % (prefix, r)) for r in range(world)], None


def load_helper_output(path):
    """A rank's results as the helper writes them (torch::pickle_save of a
    typed Dict[str, Tensor], whose type tag torch.load's weights_only mode
    refuses: this test's own file)."""
    return {str(k): v for k, v in torch.load(path, map_location="cpu",
                                             weights_only=False).items()}


def run_concord(bin_dir, tmp, name, in_path):
    """Concord's side: (every rank's results, None) or (None, why not)."""
    world = CASES[name][0]
    prefix = os.path.join(tmp, name + ".concord")
    cmd = [os.path.join(bin_dir, "concord-run"), "--standalone", "--nproc", str(world),
           "--job-id", "two-models-" + name, "--",
           os.path.join(bin_dir, "two_models_helper"), "--in", in_path, "--out", prefix]
    r = processes.run_command(cmd, timeout=120, cwd=tmp)
    if r.returncode != 0 or r.timed_out:
        return None, r.describe()
    return [load_helper_output("%s.rank%d.pt" % (prefix, rank)) for rank in range(world)], None


def differences(actual, expected):
    """Lines naming what is not bit-identical (empty: all equal)."""
    out = []
    if set(actual) != set(expected):
        out.append("keys differ: %s vs %s" % (sorted(actual), sorted(expected)))
    for k in sorted(set(actual) & set(expected)):
        a, e = actual[k], expected[k]
        if a.dtype != e.dtype or a.shape != e.shape:
            out.append("%s: %s %s, expected %s %s" % (k, a.dtype, tuple(a.shape), e.dtype,
                                                      tuple(e.shape)))
        elif not a.is_floating_point():
            if not torch.equal(a, e):
                out.append("%s: %s, expected %s" % (k, a.flatten()[:8].tolist(),
                                                     e.flatten()[:8].tolist()))
        elif not torch.equal(a, e):
            out.append("%s: max abs diff %.3e, max rel diff %.3e" % (
                k, float((a.double() - e.double()).abs().max()), fixtures.max_rel_diff(a, e)))
    return out


def run_case(checks, bin_dir, tmp, name):
    world, hook, plain = CASES[name]
    in_path = os.path.join(tmp, name + ".in.pt")
    inputs = make_inputs(name, in_path)
    start = time.monotonic()
    want, error = run_torch(tmp, name, in_path)
    if not checks.check(want is not None, "%s: PyTorch's DDP, %d ranks, two DDP modules in one "
                        "process group, %d steps" % (name, world, STEPS), error or ""):
        return
    torch_s = time.monotonic() - start
    start = time.monotonic()
    got, error = run_concord(bin_dir, tmp, name, in_path)
    if not checks.check(got is not None, "%s: concord-run --standalone --nproc %d -- "
                        "two_models_helper (%s)" % (name, world, "std::make_shared of plain "
                                                    "modules" if plain else "module holders"),
                        error or ""):
        return
    checks.ok("%s: ran (PyTorch %.1f s, Concord %.1f s)" % (name, torch_s,
                                                            time.monotonic() - start))
    # Training happened: every parameter moved, but the first Linear's
    # bias of each model (param 1), which feeds a BatchNorm in training
    # mode: its gradient is zero up to rounding.
    for key, model in (("g", "generator"), ("d", "discriminator")):
        still = [k for k in want[0] if k.startswith(key + ".param.") and
                 k != key + ".param.1" and torch.equal(want[0][k], inputs[k])]
        checks.check(not still, "%s: the %s's parameters changed in training" % (name, model),
                     "unchanged: %s" % still)
    calls = [int(r["hook_calls"]) for r in got], [int(r["hook_calls"]) for r in want]
    expected_calls = 3 * STEPS if hook else 0
    checks.check(calls == ([expected_calls] * world,) * 2,
                 "%s: the discriminator's comm hook called %d times on every rank on both "
                 "sides (3 per step)" % (name, expected_calls) if hook else
                 "%s: no comm hook called" % name,
                 "Concord %s, PyTorch %s" % calls)
    for rank in range(world):
        problems = differences(got[rank], want[rank])
        checks.check(not problems, "%s: rank %d: %d parameters and buffers of both models "
                     "bit-identical to PyTorch's" % (name, rank, len(want[rank]) - 1),
                     "\n".join(problems))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--case", action="append", choices=sorted(CASES),
                        help="a case to run (repeatable; default: all)")
    parser.add_argument("--list", action="store_true", help="list the cases")
    args = parser.parse_args()
    if args.list:
        for name, (world, hook, plain) in CASES.items():
            print("%s: %d ranks%s%s" % (name, world, ", comm hook" if hook else "",
                                        ", plain modules" if plain else ""))
        return 0
    torch.set_num_threads(1)
    checks = fixtures.Checks()
    bin_dir = os.path.abspath(args.bin_dir)
    with tempfile.TemporaryDirectory(prefix="two_models_") as tmp:
        for name in args.case or list(CASES):
            run_case(checks, bin_dir, tmp, name)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

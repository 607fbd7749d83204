"""Models, data and helpers shared by the reference tests and the benchmark.

Importable with only the standard library and torch (Debian's python3-torch):

    sys.path.insert(0, "<repo>/tests/reference")
    import fixtures
    model_pt, data_pt = fixtures.make_fixture(tmpdir, "cnn", n_samples=70, seed=1)

Kinds:
  cnn        classification, cross_entropy. Conv2d -> BatchNorm2d -> ReLU ->
             MaxPool2d -> flatten -> Linear -> BatchNorm1d -> ReLU -> Linear.
             inputs float32 (N, 3, 8, 8), targets int64 (N,) in [0, 10).
  cnn-bn2d   cnn without its BatchNorm1d (Conv2d -> BatchNorm2d -> ReLU ->
             MaxPool2d -> flatten -> Linear -> ReLU -> Linear), the data of
             `cnn`: it trains on batches of one sample, which BatchNorm1d
             refuses in training mode (with strided sharding and uneven
             shards, the extra batch of the ranks with more data holds one
             sample: the join tests need it).
  mlp        regression, mse. Linear -> BatchNorm1d -> ReLU -> Linear -> Tanh ->
             Linear. inputs float32 (N, 16), targets float32 (N, 4).
  mlp-large  classification, cross_entropy, for the benchmark: Linear layers of
             width 1024 (about 2.6 M parameters, 10 MB of gradients, so DDP's
             bucketing matters). inputs float32 (N, 512), targets int64 (N,).

Kinds for the DDP option and join tests (all regression, mse, inputs
float32 (N, 16), targets float32 (N, 4), the data of `mlp`):
  mlp-plain    `mlp` without its BatchNorm1d: Linear -> ReLU -> Linear -> Tanh
               -> Linear, no buffers, 1.7 K parameters (one bucket whatever
               the first-iteration bucket cap): trains on batches of one
               sample, for the bit-exact join tests.
  mlp-wide     5 Linear layers whose fourth is 512x512 (1.2 MB of gradients):
               more than PyTorch's 1 MiB first bucket, so a small
               bucket_cap_mb really gives several buckets.
  mlp-unused   Linear -> Tanh -> Linear, plus a Linear `unused` that forward
               never calls: its parameters never get a gradient (DDP needs
               find_unused_parameters or static_graph).
  mlp-dynamic  mlp-unused plus a Linear `gated` used only when the batch's first
               sample has x[0, 0] > 0: in a step some ranks use it and others
               do not (locally unused, globally used), or none does.
  mlp-buffer   Linear -> Tanh -> Linear on x - center, where the buffer
               `center` is updated in every training forward from the batch
               (center = (center + mean(x)) / 2) before it is used: unlike
               BatchNorm's running statistics it changes the gradients, so
               broadcast_buffers (or ignoring the buffer) changes rank 0's
               parameters.
  mlp-mixed    Linear -> Tanh -> (* gain) -> Linear where `gain` is a bfloat16
               parameter (32 values) and the rest float32: two dtypes, so two
               kinds of buckets, and apex's allreduce_always_fp32 changes how
               the bfloat16 bucket is reduced (for W >= 3; with 2 ranks one
               rounding to bfloat16 gives the same either way). No PyTorch
               DDP reference over Gloo (no bfloat16 allreduce).

Everything is deterministic from the seed: the same (kind, n_samples, seed)
always writes the same model.pt and data.pt.
"""

import math
import os
import sys

import torch
import torch.nn as nn

# TorchScript runs unfused on CPU, as concord-train runs it with every
# LibTorch (see Note [LibTorch versions] in worker/torch_compat.h): Debian 13's
# PyTorch 2.6 fuses with LLVM-generated kernels (other roundings than ATen's)
# and hangs the first time it does so; Debian 12's 1.13 never fuses on CPU.
torch._C._jit_override_can_fuse_on_cpu(False)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testlib import Checks  # noqa: E402

KINDS = ("cnn", "cnn-bn2d", "mlp", "mlp-large", "mlp-plain", "mlp-wide", "mlp-unused",
         "mlp-dynamic", "mlp-buffer", "mlp-mixed")
# Kinds whose data is that of `cnn` (classification, (3, 8, 8) -> 10 classes).
CNN_DATA_KINDS = ("cnn", "cnn-bn2d")
# Kinds whose data is that of `mlp` (regression, 16 -> 4).
MLP_DATA_KINDS = ("mlp", "mlp-plain", "mlp-wide", "mlp-unused", "mlp-dynamic", "mlp-buffer",
                  "mlp-mixed")
# Parameters that forward never uses, per kind (they must never change).
NEVER_USED = {"mlp-unused": ("unused.weight", "unused.bias"),
              "mlp-dynamic": ("unused.weight", "unused.bias")}

# Shapes per kind.
CNN_IN = (3, 8, 8)
CNN_CLASSES = 10
MLP_IN = 16
MLP_OUT = 4
LARGE_IN = 512
LARGE_WIDTH = 1024
LARGE_CLASSES = 10


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(CNN_IN[0], 8, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(8 * (CNN_IN[1] // 2) * (CNN_IN[2] // 2), 32)
        self.bn1 = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, CNN_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn(self.conv(x))))
        x = torch.flatten(x, 1)
        x = torch.relu(self.bn1(self.fc1(x)))
        return self.fc2(x)


class SmallCNNNoBN1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(CNN_IN[0], 8, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(8 * (CNN_IN[1] // 2) * (CNN_IN[2] // 2), 32)
        self.fc2 = nn.Linear(32, CNN_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn(self.conv(x))))
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        return self.fc2(x)


class SmallMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(MLP_IN, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, MLP_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.fc1(x)))
        x = torch.tanh(self.fc2(x))
        return self.fc3(x)


class PlainMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(MLP_IN, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, MLP_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        x = torch.tanh(self.fc2(x))
        return self.fc3(x)


class LargeMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(LARGE_IN, LARGE_WIDTH)
        self.fc2 = nn.Linear(LARGE_WIDTH, LARGE_WIDTH)
        self.fc3 = nn.Linear(LARGE_WIDTH, LARGE_WIDTH)
        self.fc4 = nn.Linear(LARGE_WIDTH, LARGE_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        x = torch.relu(self.fc3(x))
        return self.fc4(x)


class WideMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(MLP_IN, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 512)
        self.fc4 = nn.Linear(512, 512)
        self.fc5 = nn.Linear(512, MLP_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        x = torch.relu(self.fc3(x))
        x = torch.tanh(self.fc4(x))
        return self.fc5(x)


class UnusedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(MLP_IN, 32)
        self.fc2 = nn.Linear(32, MLP_OUT)
        self.unused = nn.Linear(32, MLP_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class DynamicMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(MLP_IN, 32)
        self.fc2 = nn.Linear(32, MLP_OUT)
        self.unused = nn.Linear(32, MLP_OUT)
        self.gated = nn.Linear(32, MLP_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        out = self.fc2(h)
        if bool(x[0, 0] > 0.0):
            out = out + self.gated(h)
        return out


def dynamic_gate(x):
    """Whether DynamicMLP uses `gated` on the batch x."""
    return bool(x[0, 0] > 0.0)


class BufferMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(MLP_IN, 32)
        self.fc2 = nn.Linear(32, MLP_OUT)
        self.register_buffer("center", torch.zeros(MLP_IN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.center.mul_(0.5).add_(x.detach().mean(0), alpha=0.5)
        return self.fc2(torch.tanh(self.fc1(x - self.center)))


class MixedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(MLP_IN, 32)
        # Small values: bfloat16's spacing (2^-8 relative) must be finer than
        # an SGD update, or the parameter never changes.
        self.gain = nn.Parameter((0.05 * torch.randn(32)).to(torch.bfloat16))
        self.fc2 = nn.Linear(32, MLP_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)) * self.gain.float())


def default_loss(kind):
    """The loss concord-train / torch_ddp_train.py should use for a kind."""
    return "mse" if kind in MLP_DATA_KINDS else "cross_entropy"


def build_model(kind):
    if kind == "cnn":
        return SmallCNN()
    if kind == "cnn-bn2d":
        return SmallCNNNoBN1d()
    if kind == "mlp":
        return SmallMLP()
    if kind == "mlp-plain":
        return PlainMLP()
    if kind == "mlp-large":
        return LargeMLP()
    if kind == "mlp-wide":
        return WideMLP()
    if kind == "mlp-unused":
        return UnusedMLP()
    if kind == "mlp-dynamic":
        return DynamicMLP()
    if kind == "mlp-buffer":
        return BufferMLP()
    if kind == "mlp-mixed":
        return MixedMLP()
    raise ValueError("unknown fixture kind %r (expected one of %s)" % (kind, ", ".join(KINDS)))


def make_data(kind, n_samples, seed):
    """Deterministic (inputs, targets) for a kind. Targets come from a fixed
    random 'teacher' so that training actually reduces the loss."""
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    if kind in CNN_DATA_KINDS:
        inputs = torch.randn((n_samples,) + CNN_IN, generator=g)
        teacher = torch.randn(CNN_IN[0] * CNN_IN[1] * CNN_IN[2], CNN_CLASSES, generator=g)
        targets = (inputs.flatten(1) @ teacher).argmax(dim=1).to(torch.int64)
    elif kind in MLP_DATA_KINDS:
        inputs = torch.randn(n_samples, MLP_IN, generator=g)
        teacher = torch.randn(MLP_IN, MLP_OUT, generator=g) / math.sqrt(MLP_IN)
        targets = torch.sin(inputs @ teacher) + 0.05 * torch.randn(n_samples, MLP_OUT, generator=g)
    elif kind == "mlp-large":
        inputs = torch.randn(n_samples, LARGE_IN, generator=g)
        teacher = torch.randn(LARGE_IN, LARGE_CLASSES, generator=g)
        targets = (inputs @ teacher).argmax(dim=1).to(torch.int64)
    else:
        raise ValueError("unknown fixture kind %r" % (kind,))
    return inputs.contiguous(), targets.contiguous()


def make_fixture(directory, kind, n_samples, seed):
    """Write <directory>/model.pt (torch.jit.save of the scripted model, in
    training mode) and <directory>/data.pt (torch.save of {'inputs', 'targets'}).
    Returns (model_path, data_path)."""
    os.makedirs(directory, exist_ok=True)
    torch.manual_seed(seed)
    model = build_model(kind)
    model.train()
    scripted = torch.jit.script(model)
    model_path = os.path.join(directory, "model.pt")
    data_path = os.path.join(directory, "data.pt")
    torch.jit.save(scripted, model_path)
    inputs, targets = make_data(kind, n_samples, seed)
    torch.save({"inputs": inputs, "targets": targets}, data_path)
    return model_path, data_path


# --- sharding: the contract shared with concord-train -----------------------

def shard_indices(n_samples, rank, world_size):
    """Rank r of W takes samples r, r+W, r+2W, ... in order."""
    return list(range(rank, n_samples, world_size))


def num_batches(n_samples, rank, world_size, batch_size):
    """Batches per epoch for a rank, the last partial batch included."""
    count = len(range(rank, n_samples, world_size))
    return (count + batch_size - 1) // batch_size


def stream_lengths(n_samples, world_size, batch_size, epochs):
    """Micro-batches per rank when each rank's data stream is all its epochs'
    batches one after another (concord-train --sharding fixed; PyTorch's DDP
    with the whole loop inside join()). Shards differ by at most one sample,
    so there are at most two distinct lengths, and the longer streams' extra
    batch of each epoch holds one sample."""
    return [epochs * num_batches(n_samples, r, world_size, batch_size)
            for r in range(world_size)]


def last_joiner(lengths):
    """The rank whose final model PyTorch's join() gives every rank
    (DDP._sync_final_model): the largest of the ranks with the longest
    stream (ties go to the larger rank)."""
    longest = max(lengths)
    return max(r for r, n in enumerate(lengths) if n == longest)


# --- state dict helpers ------------------------------------------------------

def leave_rank():
    """Ends a torch.multiprocessing rank (run_ranks') without running the
    destructors: PyTorch 1.13 can deadlock in ProcessGroupGloo's destructor,
    reached from the Reducers' when the worker's locals go. Call it once
    everything is written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker, args, world, timeout, what, start_method="fork"):
    """worker(rank, *args) in `world` processes of torch.multiprocessing;
    waits at most `timeout` seconds and kills whatever is left. Returns None,
    or why not ("<what> timed out after T s", "<what> failed: ...")."""
    import torch.multiprocessing as mp  # noqa: WPS433 (only where ranks run)
    import time
    ctx = mp.start_processes(worker, args=args, nprocs=world, join=False,
                             start_method=start_method)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                return "%s timed out after %.0f s" % (what, timeout)
    except Exception as e:  # ProcessRaisedException, ProcessExitedException
        return "%s failed: %s" % (what, e)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return None


def load_state(path):
    """Load a dict name -> tensor written by torch.save (Python) or by
    Concord (see Note [State dict files]), the way a careful Python user does:
    torch.load with weights_only=True (2.6's default; 1.13 has the flag)."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict):
        raise ValueError("%s: expected a dict of tensors, got %s" % (path, type(obj).__name__))
    out = {}
    for k, v in obj.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError("%s: entry %r is a %s, not a tensor" % (path, k, type(v).__name__))
        out[str(k)] = v.detach()
    return out


def initial_state(model_path):
    """state_dict() of the scripted module as saved (before training)."""
    m = torch.jit.load(model_path, map_location="cpu")
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def parameter_names(model_path):
    m = torch.jit.load(model_path, map_location="cpu")
    return [k for k, _ in m.named_parameters()]


def max_rel_diff(a, b):
    """max |a-b| / max(|b|, tiny), elementwise, as a float (for reports)."""
    a = a.double()
    b = b.double()
    if a.numel() == 0:
        return 0.0
    denom = b.abs().clamp_min(1e-12)
    return float(((a - b).abs() / denom).max())


def compare_states(actual, expected, rtol=1e-5, atol=1e-6, ulps=None):
    """Compare two dicts name -> tensor. Returns a list of failure strings
    (empty when they match): same key set, same dtype and shape, allclose for
    floating point, exact equality for everything else. `ulps` {dtype: n}:
    tensors of that dtype may also differ by n units of its precision
    (n * eps * |expected|) element by element."""
    failures = []
    ak, ek = set(actual), set(expected)
    if ak != ek:
        missing = sorted(ek - ak)
        extra = sorted(ak - ek)
        if missing:
            failures.append("keys missing from actual: %s" % missing)
        if extra:
            failures.append("unexpected keys in actual: %s" % extra)
    for k in sorted(ak & ek):
        a, e = actual[k], expected[k]
        if a.dtype != e.dtype:
            failures.append("%s: dtype %s, expected %s" % (k, a.dtype, e.dtype))
            continue
        if tuple(a.shape) != tuple(e.shape):
            failures.append("%s: shape %s, expected %s" % (k, tuple(a.shape), tuple(e.shape)))
            continue
        if a.is_floating_point() or a.is_complex():
            close = torch.isclose(a, e, rtol=rtol, atol=atol)
            if ulps and a.dtype in ulps:
                spacing = ulps[a.dtype] * torch.finfo(a.dtype).eps * e.double().abs()
                close |= (a.double() - e.double()).abs() <= spacing
            if not bool(close.all()):
                failures.append("%s: not allclose (rtol=%g atol=%g): max abs diff %.3e, max rel diff %.3e"
                                % (k, rtol, atol, float((a.double() - e.double()).abs().max()),
                                   max_rel_diff(a, e)))
        else:
            if not torch.equal(a, e):
                failures.append("%s: not equal: actual %s, expected %s"
                                % (k, a.flatten()[:8].tolist(), e.flatten()[:8].tolist()))
    return failures


def worst_rel_diff(actual, expected):
    """The largest max_rel_diff over the floating-point tensors both dicts
    hold with the same shape."""
    worst = 0.0
    for k in expected:
        if k in actual and expected[k].is_floating_point() and actual[k].shape == expected[k].shape:
            worst = max(worst, max_rel_diff(actual[k], expected[k]))
    return worst


def report_mismatch(checks, name, actual, expected, rtol, atol, ulps=None):
    """One check (a Checks) that compare_states(actual, expected) finds
    nothing; on failure its detail lists the differing tensors and every
    tensor's max relative difference. Returns whether it passed."""
    failures = compare_states(actual, expected, rtol=rtol, atol=atol, ulps=ulps)
    if not failures:
        checks.ok(name, "%d tensors, max rel diff %.3e (rtol %g, atol %g)"
                  % (len(expected), worst_rel_diff(actual, expected), rtol, atol))
        return True
    detail = ["%d of %d tensors differ" % (len(failures), len(expected))] + ["  " + f for f in failures]
    # Per-tensor max relative difference, for diagnosis.
    detail.append("  max relative difference per tensor:")
    for k in sorted(set(actual) & set(expected)):
        a, e = actual[k], expected[k]
        if a.shape == e.shape and a.is_floating_point() and e.is_floating_point():
            detail.append("    %-28s %.3e" % (k, max_rel_diff(a, e)))
        elif a.shape == e.shape and a.dtype == e.dtype:
            detail.append("    %-28s %s" % (k, "equal" if torch.equal(a, e) else "NOT equal"))
    checks.fail(name, "\n".join(detail))
    return False


def train_flags(loss, lr, momentum, weight_decay, batch_size, epochs, shuffle_seed=None):
    """The training flags concord-train and torch_ddp_train.py share."""
    flags = ["--loss", loss, "--optimizer", "sgd", "--lr", repr(lr),
             "--momentum", repr(momentum), "--weight-decay", repr(weight_decay),
             "--batch-size", str(batch_size), "--epochs", str(epochs)]
    if shuffle_seed is not None:
        flags += ["--shuffle", "--seed", str(shuffle_seed)]
    return flags


# --- single-process simulation of the DDP semantics ---------------------------

def validation_forward(module, inputs):
    """What concord-train does to a loaded module before training
    (CheckModelFitsData): one forward in eval mode without grad on the first
    min(2, N) samples. It matters for bit-exact comparisons: it is the
    module's first call, so TorchScript's profiling executor switches to the
    optimized graph (autodiff's backward formulas, whose float results differ
    from eager autograd's by an ulp) one training forward earlier than
    without it. torch_ddp_train.py and simulate() do the same."""
    with torch.no_grad():
        was_training = module.training
        module.eval()
        module(inputs[:min(2, inputs.size(0))])
        module.train(was_training)


# --- the order in which Gloo's allreduce adds the ranks' shares ---------------
#
# Float addition is not associative, so a bit-exact simulation of an
# allreduce(sum) needs Gloo's order. Gloo's ring allreduce (what PyTorch's
# ProcessGroupGloo and Concord's communicator run) splits the buffer into
# segments and reduces each one around the ring: with 3 ranks an element is
# (x_i + x_j) + x_k, where the rank k added last depends on the element's
# segment (the first two commute, so k says everything). With 2 ranks there is
# one add and no order. probe_gloo_ring measures k for every element of a
# buffer, with PyTorch's Gloo, instead of assuming Gloo's segmentation:
# shares of 1 on one rank and 2^-(m+1) (half an ulp of 1, m mantissa bits) on
# the others sum to 1 + 2^-m exactly when the 1 is added last, and to 1 (a tie
# rounded to even, twice) otherwise.

def _ring_probe_worker(rank, world, init_file, requests, out_path):
    import datetime
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        result = {}
        for n, dtype_name in requests:
            dtype = getattr(torch, dtype_name)
            mant = {torch.float16: 10, torch.float32: 23, torch.float64: 52}[dtype]
            last = torch.full((n,), -1, dtype=torch.int64)
            for k in range(world):
                t = torch.full((n,), 2.0 ** -(mant + 1), dtype=dtype)
                if rank == k:
                    t.fill_(1.0)
                dist.all_reduce(t)
                last[t == 1.0 + 2.0 ** -mant] = k
            result[(n, dtype_name)] = last
        if rank == 0:
            torch.save(result, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def probe_gloo_ring(requests, world_size, timeout=120.0):
    """For each (n_elements, dtype) in requests: a LongTensor of n_elements,
    the rank whose share Gloo's allreduce(sum) adds last to each element, for
    a buffer of that size and dtype (a bfloat16 buffer is split like a float16
    one: same element size; Gloo cannot sum bfloat16 in PyTorch 1.13).
    Only for world_size 3 (2 has no order; more ranks need more than the last
    one): returns {} otherwise. Forks world_size processes (call it before
    this process runs autograd). Returns {(n, dtype): tensor}."""
    import shutil
    import tempfile
    import torch.multiprocessing as mp

    if world_size != 3 or not requests:
        return {}
    names = {torch.float16: "float16", torch.bfloat16: "float16", torch.float32: "float32",
             torch.float64: "float64"}
    wanted = sorted(set((int(n), names[d]) for n, d in requests))
    tmp = tempfile.mkdtemp(prefix="gloo_ring_probe_")
    try:
        out = os.path.join(tmp, "probe.pt")
        ctx = mp.start_processes(_ring_probe_worker,
                                 args=(world_size, os.path.join(tmp, "store"), wanted, out),
                                 nprocs=world_size, join=False, start_method="fork")
        import time as _time
        deadline = _time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if _time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise RuntimeError("probe_gloo_ring timed out")
        measured = torch.load(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {}
    for n, d in requests:
        last = measured[(int(n), names[d])]
        if int(last.min()) < 0:
            raise RuntimeError("probe_gloo_ring: %d elements of %s: no rank found last for "
                               "some elements" % (n, d))
        result[(int(n), d)] = last
    return result


def ring_sum(parts, last=None, add=None):
    """Sum of the ranks' shares (equal-shaped 1-D tensors, rank order) in
    Gloo's order: rank order when `last` is None (exact for 2 ranks),
    otherwise (for 3 ranks) the two shares other than last[i] first, then
    last[i]'s. `add(a, b)` adds two partial sums (default a + b in their
    dtype)."""
    add = add or (lambda a, b: a + b)
    w = len(parts)
    if last is None or w < 3:
        acc = parts[0]
        for p in parts[1:]:
            acc = add(acc, p)
        return acc
    if w != 3:
        raise ValueError("ring_sum: a last-rank map describes 3 ranks only")
    out = torch.empty_like(parts[0])
    for k in range(3):
        a, b = [parts[r] for r in range(3) if r != k]
        s = add(add(a, b), parts[k])
        mask = last == k
        out[mask] = s[mask]
    return out


# The reductions simulate() knows. Each takes the W ranks' flattened bucket
# contents (rank order) and the bucket's last-rank map (or None: rank order)
# and returns the reduced bucket. `wire_dtype`, when set, is the dtype the
# allreduce runs in (it decides Gloo's segmentation).

def reduce_pytorch(flats, last=None):
    """PyTorch DDP's default: every rank multiplies its gradient by 1/W while
    copying it into the bucket, then allreduce(sum)."""
    w = len(flats)
    return ring_sum([g.mul(1.0 / w) for g in flats], last)


def make_reduce_apex(predivide=1.0, average=True, always_fp32=False):
    """apex.parallel.DistributedDataParallel.allreduce_bucket: (with
    allreduce_always_fp32: convert the bucket to float32,) multiply by 1/f
    when f != 1, allreduce(sum), multiply by f/W when gradient_average,
    (convert back). Every operation is in the bucket's dtype (bfloat16 adds
    round to bfloat16), or float32 with always_fp32; for float32 gradients
    always_fp32 changes nothing."""
    def reduce_apex(flats, last=None):
        w = len(flats)
        dtype = flats[0].dtype
        if always_fp32:
            flats = [g.float() for g in flats]
        pre = [g.mul(1.0 / predivide) if predivide != 1.0 else g.clone() for g in flats]
        acc = ring_sum(pre, last)
        if average:
            acc = acc.mul(predivide / w)
        return acc.to(dtype)
    if always_fp32:
        reduce_apex.wire_dtype = torch.float32
    return reduce_apex


def make_reduce_compressed(dtype):
    """PyTorch's fp16_compress_hook / bf16_compress_hook: cast the bucket to
    `dtype` and divide it by W (in `dtype`), allreduce(sum) in `dtype` (Gloo
    adds two values in float and rounds the result to `dtype`, add by add),
    cast the sum back to the gradient's dtype."""
    def reduce_compressed(flats, last=None):
        w = len(flats)
        parts = [g.to(dtype).div_(w) for g in flats]
        acc = ring_sum(parts, last, add=lambda a, b: (a.float() + b.float()).to(dtype))
        return acc.to(flats[0].dtype)
    reduce_compressed.wire_dtype = dtype
    return reduce_compressed


def bucket_elements(model_path, layouts):
    """(n_elements, dtype) of every bucket in layouts (lists of buckets of
    parameter names), for probe_gloo_ring."""
    m = torch.jit.load(model_path, map_location="cpu")
    params = dict(m.named_parameters())
    out = set()
    for layout in layouts or ():
        for bucket in layout:
            out.add((sum(params[k].numel() for k in bucket), params[bucket[0]].dtype))
    return sorted(out, key=lambda t: (t[0], str(t[1])))


def simulate(model_path, data_path, loss, world_size, batch_size, epochs,
             lr=0.01, momentum=0.0, weight_decay=0.0, shuffle_seed=None,
             grad_accum=1, broadcast_buffers=True, ignore=(), reduce=None,
             layouts=None, ring=None, first_layout_steps=1, all_ranks=False, trace=None,
             join=False, divide_by_initial_world_size=True, skip_steps=0):
    """Train W copies of the model in ONE process, applying DDP's semantics by
    hand, in the loop of concord-train and torch_ddp_train.py:

      validation_forward once; then for each batch b of an epoch (B batches):
        sync = (b + 1) % grad_accum == 0 or b + 1 == B
        forward + backward on every rank (gradients accumulate);
        if sync: reduce the gradients, optimizer.step(), optimizer.zero_grad()
        (in place: set_to_none=False, so a gradient, once it exists, stays a
        tensor; at the start every .grad is None).

    DDP's semantics applied:
      * broadcast_buffers: before a forward, rank 0's buffers are copied to
        every rank when the previous forward was a synchronised one (or this is
        the first): PyTorch's require_forward_param_sync, so under no_sync only
        the first micro-batch of an accumulation broadcasts.
      * gradients, bucket by bucket: every rank's gradients of the bucket's
        parameters, flattened (None as zeros), go through reduce(flats, last)
        (default reduce_pytorch) and the result is written into every rank's
        .grad. A parameter whose .grad is None on every rank (unused
        everywhere, never had a gradient) keeps None, as PyTorch's
        find_unused_parameters leaves globally unused gradients alone.
        layouts = (first, rebuilt): the buckets (lists of parameter names) of
        the first synchronised step and of the later ones (DDP rebuilds them
        once); default one bucket per parameter (the same numbers for
        element-wise reductions in rank order); the first layout serves the
        first `first_layout_steps` synchronised steps (PyTorch 1.13 with
        static_graph rebuilds after the second). ring: {(n, dtype): last-rank
        map} from probe_gloo_ring, to add the shares in Gloo's order.
      * ignore: names of parameters and buffers DDP leaves alone: ignored
        parameters keep their local gradient (and are still stepped by the
        local optimizer), ignored buffers are not broadcast.
      * every rank steps its own torch.optim.SGD over all of its parameters.

    With shuffle_seed, epoch e permutes the samples with torch.randperm(n,
    generator seeded with shuffle_seed + e) before sharding. Without join,
    only for even shards (every rank takes the same number of steps).

    join: the whole loop inside DDP's join() context (PyTorch's uneven
    inputs), which allows uneven shards. Each rank's stream is all its
    epochs' batches one after another (stream_lengths); step s runs on the
    ranks whose stream is longer than s (the active ones); the others have
    joined and shadow the collectives with zeros. So the reduced gradient is
    the sum over every rank of grad * (1/D) for the active ones and zeros for
    the joined ones (in Gloo's order with `ring`), where D is world_size with
    divide_by_initial_world_size (PyTorch's default) or else the number of
    active ranks; only the active ranks step. broadcast_buffers sends the
    largest active rank's buffers (DDP._find_common_rank) instead of rank
    0's. At the end every rank takes the parameters and buffers of
    last_joiner() (DDP._sync_final_model). With the default reduction and
    grad_accum 1 only.

    skip_steps: the first skip_steps synchronised steps reduce the gradients
    but leave the optimizers out (a ZeroRedundancyOptimizer overlapped with
    DDP updates nothing in its two warm-up iterations).

    Returns rank 0's final state_dict, or with all_ranks a list of every
    rank's. With trace (a list), appends per micro-batch (epoch, b, sync,
    [per-rank dynamic_gate of the batch])."""
    import torch.nn.functional as F

    if join and (reduce is not None or grad_accum != 1):
        raise ValueError("simulate: join with the default reduction and grad_accum 1 only")
    reduce = reduce or reduce_pytorch
    ignore = set(ignore)
    ring = ring or {}
    data = torch.load(data_path, map_location="cpu")
    inputs, targets = data["inputs"], data["targets"]
    n = inputs.size(0)
    counts = [num_batches(n, r, world_size, batch_size) for r in range(world_size)]
    if len(set(counts)) != 1 and not join:
        raise ValueError("simulate handles even shards only (batches per rank: %s)" % counts)
    models = []
    opts = []
    for r in range(world_size):
        m = torch.jit.load(model_path, map_location="cpu")
        validation_forward(m, inputs)
        m.train()
        models.append(m)
        opts.append(torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum,
                                    weight_decay=weight_decay))
    param_names = [k for k, _ in models[0].named_parameters()]
    unknown = ignore - set(param_names) - set(k for k, _ in models[0].named_buffers())
    if unknown:
        raise ValueError("cannot ignore %s: no such parameter or buffer" % sorted(unknown))
    reduced_names = [k for k in param_names if k not in ignore]
    if layouts is None:
        layouts = ([[k] for k in reduced_names],) * 2
    for layout in layouts:
        if sorted(k for bucket in layout for k in bucket) != sorted(reduced_names):
            raise ValueError("simulate: buckets %s do not hold exactly the parameters %s"
                             % (layout, reduced_names))
    # Every epoch's shards, and each rank's stream of (epoch, batch).
    shards = []
    for epoch in range(epochs):
        if shuffle_seed is None:
            order = torch.arange(n, dtype=torch.int64)
        else:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(shuffle_seed + epoch),
                                   dtype=torch.int64)
        shards.append([(inputs.index_select(0, order[r::world_size]),
                        targets.index_select(0, order[r::world_size])) for r in range(world_size)])
    streams = [[(e, b) for e in range(epochs) for b in range(counts[r])]
               for r in range(world_size)]
    previous_sync = True
    sync_steps = 0
    for step in range(max(len(st) for st in streams)):
        active = [r for r in range(world_size) if step < len(streams[r])]
        epoch, b = streams[active[0]][step]
        sync = (b + 1) % grad_accum == 0 or b + 1 == counts[active[0]]
        if broadcast_buffers and previous_sync:
            # With join, DDP agrees on the largest active rank; rank 0 otherwise.
            src_rank = max(active) if join else 0
            src = dict(models[src_rank].named_buffers())
            for r, m in enumerate(models):
                if r == src_rank:
                    continue
                with torch.no_grad():
                    for k, v in m.named_buffers():
                        if k not in ignore:
                            v.copy_(src[k])
        previous_sync = sync
        gates = []
        for r in active:
            e_r, b_r = streams[r][step]
            x, y = shards[e_r][r]
            lo, hi = b_r * batch_size, (b_r + 1) * batch_size
            xb, yb = x[lo:hi], y[lo:hi]
            gates.append(dynamic_gate(xb) if xb.dim() == 2 else None)
            out = models[r](xb)
            lval = F.cross_entropy(out, yb) if loss == "cross_entropy" else F.mse_loss(out, yb)
            lval.backward()
        if trace is not None:
            trace.append((epoch, b, sync, gates))
        if not sync:
            continue
        step_reduce = reduce
        if join:
            div = world_size if divide_by_initial_world_size else len(active)

            def step_reduce(flats, last=None, active=active, div=div):
                return ring_sum([g.mul(1.0 / div) if r in active else torch.zeros_like(g)
                                 for r, g in enumerate(flats)], last)
        named = [dict(m.named_parameters()) for m in models]
        layout = layouts[0] if sync_steps < first_layout_steps else layouts[1]
        sync_steps += 1
        with torch.no_grad():
            for bucket in layout:
                flats = []
                for r, nm in enumerate(named):
                    flats.append(torch.cat([
                        (nm[k].grad if nm[k].grad is not None and r in active
                         else torch.zeros_like(nm[k])).detach().reshape(-1) for k in bucket]))
                key = (flats[0].numel(), getattr(reduce, "wire_dtype", None) or flats[0].dtype)
                reduced = step_reduce(flats, ring.get(key))
                offset = 0
                for k in bucket:
                    numel = named[0][k].numel()
                    part = reduced[offset:offset + numel].view_as(named[0][k])
                    offset += numel
                    if all(named[r][k].grad is None for r in active):
                        continue
                    for r in active:
                        nm = named[r]
                        if nm[k].grad is None:
                            nm[k].grad = part.clone()
                        else:
                            nm[k].grad.copy_(part)
        for r in active:
            if sync_steps > skip_steps:
                opts[r].step()
            opts[r].zero_grad(set_to_none=False)
    if join:
        src = models[last_joiner([len(st) for st in streams])]
        with torch.no_grad():
            for m in models:
                if m is src:
                    continue
                for (_, v), (_, w) in zip(m.named_parameters(), src.named_parameters()):
                    v.copy_(w)
                for (_, v), (_, w) in zip(m.named_buffers(), src.named_buffers()):
                    v.copy_(w)
    states = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
    return states if all_ranks else states[0]


def simulate_ddp(model_path, data_path, loss, world_size, batch_size, epochs,
                 lr=0.01, momentum=0.0, weight_decay=0.0, shuffle_seed=None):
    """simulate() with PyTorch DDP's defaults (broadcast_buffers, averaging,
    no accumulation, shares added in rank order): rank 0's final state_dict.
    Used to check the reference (torch_ddp_train.py) itself."""
    return simulate(model_path, data_path, loss, world_size, batch_size, epochs, lr=lr,
                    momentum=momentum, weight_decay=weight_decay, shuffle_seed=shuffle_seed)

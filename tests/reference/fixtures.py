"""Models, data and helpers shared by the reference tests and the benchmark.

Importable with only the standard library and torch (Debian's python3-torch):

    sys.path.insert(0, "<repo>/tests/reference")
    import fixtures
    model_pt, data_pt = fixtures.make_fixture(tmpdir, "cnn", n_samples=70, seed=1)

Kinds:
  cnn        classification, cross_entropy. Conv2d -> BatchNorm2d -> ReLU ->
             MaxPool2d -> flatten -> Linear -> BatchNorm1d -> ReLU -> Linear.
             inputs float32 (N, 3, 8, 8), targets int64 (N,) in [0, 10).
  mlp        regression, mse. Linear -> BatchNorm1d -> ReLU -> Linear -> Tanh ->
             Linear. inputs float32 (N, 16), targets float32 (N, 4).
  mlp-large  classification, cross_entropy, for the benchmark: Linear layers of
             width 1024 (about 2.6 M parameters, 10 MB of gradients, so DDP's
             bucketing matters). inputs float32 (N, 512), targets int64 (N,).

Everything is deterministic from the seed: the same (kind, n_samples, seed)
always writes the same model.pt and data.pt.
"""

import math
import os

import torch
import torch.nn as nn

KINDS = ("cnn", "mlp", "mlp-large")

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


def default_loss(kind):
    """The loss concord-train / torch_ddp_train.py should use for a kind."""
    return "mse" if kind == "mlp" else "cross_entropy"


def build_model(kind):
    if kind == "cnn":
        return SmallCNN()
    if kind == "mlp":
        return SmallMLP()
    if kind == "mlp-large":
        return LargeMLP()
    raise ValueError("unknown fixture kind %r (expected one of %s)" % (kind, ", ".join(KINDS)))


def make_data(kind, n_samples, seed):
    """Deterministic (inputs, targets) for a kind. Targets come from a fixed
    random 'teacher' so that training actually reduces the loss."""
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    if kind == "cnn":
        inputs = torch.randn((n_samples,) + CNN_IN, generator=g)
        teacher = torch.randn(CNN_IN[0] * CNN_IN[1] * CNN_IN[2], CNN_CLASSES, generator=g)
        targets = (inputs.flatten(1) @ teacher).argmax(dim=1).to(torch.int64)
    elif kind == "mlp":
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


# --- state dict helpers ------------------------------------------------------

def load_state(path):
    """Load a dict name -> tensor written by torch.save (Python) or
    torch::pickle_save (C++)."""
    obj = torch.load(path, map_location="cpu")
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


def compare_states(actual, expected, rtol=1e-5, atol=1e-6):
    """Compare two dicts name -> tensor. Returns a list of failure strings
    (empty when they match): same key set, same dtype and shape, allclose for
    floating point, exact equality for everything else."""
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
            if not torch.allclose(a, e, rtol=rtol, atol=atol):
                failures.append("%s: not allclose (rtol=%g atol=%g): max abs diff %.3e, max rel diff %.3e"
                                % (k, rtol, atol, float((a.double() - e.double()).abs().max()),
                                   max_rel_diff(a, e)))
        else:
            if not torch.equal(a, e):
                failures.append("%s: not equal: actual %s, expected %s"
                                % (k, a.flatten()[:8].tolist(), e.flatten()[:8].tolist()))
    return failures


# --- single-process simulation of the DDP semantics ---------------------------

def simulate_ddp(model_path, data_path, loss, world_size, batch_size, epochs,
                 lr=0.01, momentum=0.0, weight_decay=0.0, shuffle_seed=None):
    """Train W copies of the model in ONE process, applying DDP's semantics by
    hand: rank 0's buffers are copied to every rank before each forward
    (broadcast_buffers=True), gradients are averaged over the ranks, every rank
    steps its own torch.optim.SGD. Returns rank 0's final state_dict.

    With shuffle_seed, epoch e permutes the samples with torch.randperm(n,
    generator seeded with shuffle_seed + e) before sharding.

    Used to check the reference (torch_ddp_train.py) itself. Only for even
    shards (every rank takes the same number of steps)."""
    import torch.nn.functional as F

    data = torch.load(data_path, map_location="cpu")
    inputs, targets = data["inputs"], data["targets"]
    n = inputs.size(0)
    counts = [num_batches(n, r, world_size, batch_size) for r in range(world_size)]
    if len(set(counts)) != 1:
        raise ValueError("simulate_ddp handles even shards only (batches per rank: %s)" % counts)
    models = []
    opts = []
    for r in range(world_size):
        m = torch.jit.load(model_path, map_location="cpu")
        m.train()
        models.append(m)
        opts.append(torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum,
                                    weight_decay=weight_decay))
    for epoch in range(epochs):
        if shuffle_seed is None:
            order = torch.arange(n, dtype=torch.int64)
        else:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(shuffle_seed + epoch),
                                   dtype=torch.int64)
        shards = [(inputs.index_select(0, order[r::world_size]),
                   targets.index_select(0, order[r::world_size])) for r in range(world_size)]
        for b in range(counts[0]):
            # broadcast_buffers: rank 0's buffers to everyone, before forward.
            src = dict(models[0].named_buffers())
            for m in models[1:]:
                with torch.no_grad():
                    for k, v in m.named_buffers():
                        v.copy_(src[k])
            for r, m in enumerate(models):
                opts[r].zero_grad()
                x, y = shards[r]
                xb, yb = x[b * batch_size:(b + 1) * batch_size], y[b * batch_size:(b + 1) * batch_size]
                out = m(xb)
                lval = F.cross_entropy(out, yb) if loss == "cross_entropy" else F.mse_loss(out, yb)
                lval.backward()
            named = [dict(m.named_parameters()) for m in models]
            for k in named[0]:
                grads = [nm[k].grad for nm in named]
                if grads[0] is None:
                    continue
                avg = torch.stack(grads).sum(0) / world_size
                for g in grads:
                    g.copy_(avg)
            for o in opts:
                o.step()
    return {k: v.detach().clone() for k, v in models[0].state_dict().items()}


# --- running the tools -------------------------------------------------------

class CommandResult(object):
    def __init__(self, cmd, returncode, stdout, stderr, elapsed, timed_out):
        self.cmd = cmd
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.elapsed = elapsed
        self.timed_out = timed_out

    def describe(self, tail=4000):
        def cut(s):
            return s if len(s) <= tail else "...(%d chars cut)...\n%s" % (len(s) - tail, s[-tail:])
        status = "TIMED OUT after %.1fs" % self.elapsed if self.timed_out else \
            "exit status %s after %.1fs" % (self.returncode, self.elapsed)
        return "command: %s\n%s\n--- stdout ---\n%s\n--- stderr ---\n%s" % (
            " ".join(self.cmd), status, cut(self.stdout), cut(self.stderr))


def run_command(cmd, timeout, env=None, cwd=None):
    """Run cmd in its own process group; on timeout kill that whole group (so
    worker processes started by concord-run or torch.multiprocessing do not
    outlive the test). Returns a CommandResult."""
    import signal
    import subprocess
    import time as _time

    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    if env:
        full_env.update(env)
    start = _time.monotonic()
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=full_env, cwd=cwd,
                            start_new_session=True, universal_newlines=True,
                            errors="replace")
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        out, err = proc.communicate()
    leftover = False
    if not timed_out:
        # Leftovers of a finished run (e.g. a worker its launcher forgot):
        # note them and end them.
        try:
            os.killpg(proc.pid, 0)
            leftover = True
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    result = CommandResult([str(c) for c in cmd], proc.returncode, out, err,
                           _time.monotonic() - start, timed_out)
    result.leftover_processes = leftover
    return result

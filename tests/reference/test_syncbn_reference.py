#!/usr/bin/python3
"""SyncBatchNorm: Concord's concord::SyncBatchNorm over W ranks (threads over
real Gloo, run by the syncbn_reference_helper binary) against Python
PyTorch's torch.nn.BatchNorm{1,2,3}d on the concatenated batch.

    /usr/bin/python3 tests/reference/test_syncbn_reference.py --bin-dir B

(PyTorch's own nn.SyncBatchNorm runs only on CUDA, so on CPU the reference is
BatchNorm on the whole batch, which is what SyncBatchNorm must equal.)
Compared: outputs, input gradients, weight/bias gradients summed over ranks,
running statistics after two steps. Tolerance rtol 1e-4, atol 1e-5 (float32;
the statistics are combined in a different order than BatchNorm sums).

The cases in SESSION_CASES also run with a process per rank, each a worker of
a Concord job (`concord-run --standalone -- syncbn_reference_helper
--session`, the way test_syncbn_cuda_reference.py runs it on a GPU), and must
equal the threads' results bit for bit.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures  # noqa: E402
import processes  # noqa: E402

# (name, per-rank batch sizes, (C, spatial...), channels_last, momentum)
CASES = [
    ("2d_w2", [4, 4], (3, 5, 4), False, 0.1),
    ("2d_w3_uneven", [2, 5, 3], (4, 3, 3), False, 0.1),
    ("2d_w4_empty_rank", [3, 0, 2, 4], (5, 3, 2), False, 0.1),
    ("1d_nc_w3", [5, 1, 3], (6,), False, 0.1),
    ("1d_ncl_w2", [3, 4], (3, 7), False, None),
    ("3d_w2", [2, 3], (3, 2, 3, 2), False, 0.2),
    ("2d_channels_last_w3", [3, 2, 0], (7, 3, 4), True, 0.1),
    ("3d_channels_last_w4", [1, 2, 1, 2], (3, 2, 2, 3), True, None),
]
STEPS = 2
EPS = 1e-5
# An empty rank and channels-last, through concord-run (see the docstring).
SESSION_CASES = ("2d_w4_empty_rank", "2d_channels_last_w3")


def reference(x, g, weight, bias, momentum, eps):
    dims = x.dim() - 1
    cls = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d,
           4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}[dims]
    bn = cls(x.size(2), eps=eps, momentum=momentum)
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    out = {"y": [], "dx": [], "dw": [], "db": []}
    for s in range(x.size(0)):
        bn.zero_grad()
        xs = x[s].clone().requires_grad_(True)
        y = bn(xs)
        (y * g[s]).sum().backward()
        out["y"].append(y.detach())
        out["dx"].append(xs.grad)
        out["dw"].append(bn.weight.grad.clone())
        out["db"].append(bn.bias.grad.clone())
    out = {k: torch.stack(v) for k, v in out.items()}
    out["running_mean"] = bn.running_mean
    out["running_var"] = bn.running_var
    out["num_batches_tracked"] = bn.num_batches_tracked
    return out


def case_inputs(name, sizes, tail, channels_last, momentum):
    """The helper's input dict for one case (the same seed every run)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    shape = (STEPS, sum(sizes)) + tail
    x = torch.randn(shape, generator=gen) * 2.5 + 1.0
    g = torch.randn(shape, generator=gen)
    weight = torch.rand(tail[0], generator=gen) + 0.5
    bias = torch.randn(tail[0], generator=gen)
    return {"x": x, "g": g, "sizes": torch.tensor(sizes, dtype=torch.int64),
            "weight": weight, "bias": bias,
            "momentum": torch.tensor(-1.0 if momentum is None else momentum,
                                     dtype=torch.float64),
            "eps": torch.tensor(EPS, dtype=torch.float64),
            "channels_last": torch.tensor(int(channels_last))}


def run_helper(helper, tmp, name, inputs):
    """Concord's SyncBatchNorm on the inputs: (results dict, None) or
    (None, one line saying why not)."""
    in_path = os.path.join(tmp, name + ".in.pt")
    out_path = os.path.join(tmp, name + ".out.pt")
    torch.save(inputs, in_path)
    proc = subprocess.run([helper, "--in", in_path, "--out", out_path],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return None, (f"{name}: helper failed ({proc.returncode}): "
                      f"{proc.stderr.strip()}")
    return fixtures.load_state(out_path), None


def compare(name, got, want, rtol=1e-4, atol=1e-5):
    """One line per quantity that differs."""
    failures = []
    for key, expected in want.items():
        actual = got[key]
        try:
            torch.testing.assert_close(actual, expected.to(actual.dtype),
                                       rtol=rtol, atol=atol)
        except AssertionError as e:
            failures.append(f"{name}: {key}: {str(e).splitlines()[0]}")
    return failures


def assemble(ranks, steps):
    """Per-rank results (y, dx, dw, db indexable by step) as the helper's
    whole-batch output: slices concatenated, weight/bias gradients summed,
    running statistics that every rank must agree on."""
    result = {
        "y": torch.stack([torch.cat([r["y"][s] for r in ranks])
                          for s in range(steps)]),
        "dx": torch.stack([torch.cat([r["dx"][s] for r in ranks])
                           for s in range(steps)]),
        "dw": torch.stack([sum(r["dw"][s] for r in ranks)
                           for s in range(steps)]),
        "db": torch.stack([sum(r["db"][s] for r in ranks)
                           for s in range(steps)]),
    }
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        result[key] = ranks[0][key]
        for r in ranks[1:]:
            if not torch.equal(r[key], ranks[0][key]):
                raise AssertionError(f"the ranks disagree on {key}")
    return result


def run_session_helper(bin_dir, tmp, name, inputs, device, backend):
    """Concord's SyncBatchNorm with a process per rank, workers of a
    `concord-run --standalone` job on `device` (CONCORD_DEVICE) with
    `backend`: (results, None) or (None, one line saying why not)."""
    world = inputs["sizes"].numel()
    bin_dir = os.path.abspath(bin_dir)
    in_path = os.path.join(tmp, name + ".session.in.pt")
    prefix = os.path.join(tmp, name + ".session")
    torch.save(inputs, in_path)
    cmd = [os.path.join(bin_dir, "concord-run"), "--standalone", "--nproc", str(world),
           "--job-id", "syncbn-" + name.replace("_", "-"), "--",
           os.path.join(bin_dir, "syncbn_reference_helper"), "--in", in_path,
           "--out", prefix, "--session"]
    r = processes.run_command(cmd, timeout=180, cwd=tmp,
                             env={"CONCORD_DEVICE": device, "CONCORD_BACKEND": backend})
    if r.returncode != 0:
        return None, f"{name}: concord-run ... syncbn_reference_helper --session: {r.describe()}"
    ranks = [fixtures.load_state(f"{prefix}.rank{rank}.pt") for rank in range(world)]
    return assemble(ranks, inputs["x"].size(0)), None


def run_case(bin_dir, tmp, name, sizes, tail, channels_last, momentum):
    inputs = case_inputs(name, sizes, tail, channels_last, momentum)
    helper = os.path.join(bin_dir, "syncbn_reference_helper")
    got, error = run_helper(helper, tmp, name, inputs)
    if error:
        return [error]
    want = reference(inputs["x"], inputs["g"], inputs["weight"],
                     inputs["bias"], momentum, EPS)
    failures = compare(name, got, want)
    if name in SESSION_CASES:
        processes, error = run_session_helper(bin_dir, tmp, name, inputs, "cpu", "gloo")
        if error:
            return failures + [error]
        failures += compare(name + " (a process per rank vs threads)", processes, got,
                            rtol=0, atol=0)
    return failures


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            case_failures = run_case(args.bin_dir, tmp, *case)
            print(f"{case[0]}: {'FAIL' if case_failures else 'ok'}", flush=True)
            failures += case_failures
    for f in failures:
        print(f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

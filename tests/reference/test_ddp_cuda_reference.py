#!/usr/bin/env python3
"""Concord's DDP on CUDA tensors against PyTorch's own DDP on the same GPUs.

Two modes, one ctest entry each:

  --backend gloo (label gpu): W processes share cuda:0 over Gloo, CUDA
    tensors staged through host memory on both sides (NCCL refuses two
    ranks on one GPU): `concord-run --nproc W -- concord-train --device
    cuda:0 --backend gloo` against torch_ddp_train.py --device cuda:0
    --backend gloo (DDP with device_ids=[0]), W = 2 and 3.
  --backend nccl (label multigpu): rank r on cuda:r, W = min(GPUs, 4):
    concord-train --device cuda (cuda:<local rank>, NCCL by default)
    against torch_ddp_train.py --device cuda --backend nccl.

Each on the CNN (Conv/BatchNorm/Linear, cross entropy) and the MLP (mse),
PyTorch's default DDP options, 2 epochs with an uneven last batch. The final
state dicts must agree to rtol 1e-5, atol 1e-6: the same kernels run on the
same device in the same order on both sides (the forward and backward are
LibTorch's in both), so what can differ is the reduction's rounding, as on
CPU. Every file is read with torch.load(weights_only=True).

Without a CUDA device (or with fewer than 2 for nccl) it prints
"CONCORD_TEST_SKIPPED: ..." and exits 0, which ctest reports as skipped. It needs a
Python whose torch has CUDA: -DCONCORD_CUDA_PYTHON=... (see
tests/reference/CMakeLists.txt).
"""

import argparse
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fixtures  # noqa: E402
import processes  # noqa: E402
import torch_ddp_train  # noqa: E402
from fixtures import Checks  # noqa: E402

EPOCHS = 2
BATCH = 8
SAMPLES_PER_RANK = 2 * BATCH + 5
CASES = (("cnn", "cross_entropy"), ("mlp", "mse"))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    p.add_argument("--timeout", type=float, default=240.0)
    return p.parse_args()


def skip_reason(backend):
    if not torch.cuda.is_available():
        return "CONCORD_TEST_SKIPPED: no CUDA device (torch %s, built with CUDA %s)" % (
            torch.__version__, torch.version.cuda)
    if backend == "nccl" and torch.cuda.device_count() < 2:
        return "CONCORD_TEST_SKIPPED: fewer than 2 CUDA devices (%d)" % torch.cuda.device_count()
    return None


def concord(args, world, model, data, loss, out, device, tmp):
    cmd = [os.path.join(args.bin_dir, "concord-run"), "--standalone", "--nproc", str(world),
           "--job-id", "cuda-ref", "--",
           os.path.join(args.bin_dir, "concord-train"), "--model", model, "--data", data,
           "--loss", loss, "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
           "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--sharding", "fixed",
           "--device", device, "--backend", args.backend, "--output", out]
    return processes.run_command(cmd, timeout=args.timeout, cwd=tmp)


def pytorch(args, world, model, data, loss, out, device):
    targs = torch_ddp_train.parse_args([
        "--model", model, "--data", data, "--loss", loss, "--lr", "0.05", "--momentum", "0.9",
        "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--world-size", str(world),
        "--device", device, "--backend", args.backend, "--start-method", "spawn",
        "--output", out])
    return torch_ddp_train.run(targs, timeout=args.timeout)


def main():
    args = parse_args()
    reason = skip_reason(args.backend)
    if reason:
        print(reason)
        return 0
    checks = Checks()
    if args.backend == "gloo":
        worlds, device, torch_device = (2, 3), "cuda:0", "cuda:0"
    else:
        worlds = (min(torch.cuda.device_count(), 4),)
        device, torch_device = "cuda", "cuda"
    with tempfile.TemporaryDirectory(prefix="concord_cuda_ref_") as tmp:
        for world in worlds:
            for kind, loss in CASES:
                label = "[%s %s W=%d]" % (args.backend, kind, world)
                d = os.path.join(tmp, "%s-w%d" % (kind, world))
                model, data = fixtures.make_fixture(d, kind, world * SAMPLES_PER_RANK, 7)
                ref_out = os.path.join(d, "pytorch.pt")
                conc_out = os.path.join(d, "concord.pt")
                rc = pytorch(args, world, model, data, loss, ref_out, torch_device)
                if not checks.check(rc == 0, label + " PyTorch DDP trains on CUDA",
                                    "torch_ddp_train.py exit %d" % rc):
                    continue
                r = concord(args, world, model, data, loss, conc_out, device, d)
                if not checks.check(r.returncode == 0 and os.path.isfile(conc_out),
                                    label + " concord-train --device %s trains" % device,
                                    r.describe()):
                    continue
                fixtures.report_mismatch(
                    checks, label + " concord == PyTorch DDP on CUDA",
                    fixtures.load_state(conc_out), fixtures.load_state(ref_out), 1e-5, 1e-6)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

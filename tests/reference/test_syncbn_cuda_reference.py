#!/usr/bin/python3
"""SyncBatchNorm on CUDA against PyTorch's own torch.nn.SyncBatchNorm (label
gpu).

    python3 tests/reference/test_syncbn_cuda_reference.py --bin-dir B

PyTorch's nn.SyncBatchNorm runs only on CUDA ("SyncBatchNorm expected input
tensor to be on GPU"), so this is the gpu suite's half of SyncBatchNorm's
reference comparison; test_syncbn_reference.py compares Concord's CPU path
with BatchNorm on the concatenated batch everywhere. For every case of that
test (the same inputs: 2-4 ranks, uneven and empty batches, 1d/2d/3d,
channels-last, cumulative momentum) both sides run W processes on CUDA, each
on its slice of every step: nn.SyncBatchNorm, and Concord's SyncBatchNorm
(its CUDA kernels, on the current stream) in syncbn_reference_helper
--session under `concord-run --standalone`. With W devices both use NCCL,
rank r on cuda:r; with fewer, every rank shares cuda:0 over Gloo (CUDA
tensors staged through host memory: NCCL refuses two ranks on one GPU).
Ranks must be processes: LibTorch runs every backward on one device in one
thread, so ranks as threads of one process would wait for each other there.
Compared: outputs, input gradients, weight/bias gradients summed over ranks
(nn.SyncBatchNorm leaves each rank's local part for DDP to reduce), running
statistics and num_batches_tracked.

Needs a PyTorch with CUDA and a device; prints "CONCORD_TEST_SKIPPED: no CUDA device" and
exits 0 otherwise (ctest reports the test as skipped). Debian's python3-torch
is CPU-only, so on CI machines this always skips.
"""
import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_syncbn_reference as cpu_ref  # noqa: E402

# Both sides sum in float32 on the device, each in its own order: a little
# looser than the CPU test.
RTOL, ATOL = 1e-4, 2e-5


def backend_for(world):
    """NCCL with a device per rank, else Gloo with every rank on cuda:0."""
    return "nccl" if torch.cuda.device_count() >= world else "gloo"


def rank_main(rank, world, inputs, momentum, out_dir):
    devices = torch.cuda.device_count()
    backend = backend_for(world)
    device = torch.device("cuda", rank if backend == "nccl" else 0)
    torch.cuda.set_device(device)
    # A file store, as the other reference tests: Debian's PyTorch 2.6 has no
    # libuv, which a TCPStore wants by default.
    dist.init_process_group(backend,
                            init_method="file://" + os.path.join(out_dir, "store"),
                            rank=rank, world_size=world)
    sizes = inputs["sizes"].tolist()
    start = sum(sizes[:rank])
    x_all, g_all = inputs["x"], inputs["g"]
    channels = x_all.size(2)
    # nn.SyncBatchNorm takes every (N, C, *) input itself.
    bn = torch.nn.SyncBatchNorm(channels, eps=inputs["eps"].item(),
                                momentum=momentum).to(device)
    with torch.no_grad():
        bn.weight.copy_(inputs["weight"])
        bn.bias.copy_(inputs["bias"])
    channels_last = bool(inputs["channels_last"].item())
    out = {"y": [], "dx": [], "dw": [], "db": []}
    for s in range(x_all.size(0)):
        bn.zero_grad(set_to_none=False)
        x = x_all[s, start:start + sizes[rank]].to(device)
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        elif channels_last and x.dim() == 5:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        x.requires_grad_(True)
        y = bn(x)
        g = g_all[s, start:start + sizes[rank]].to(device)
        (y * g).sum().backward()
        dx = x.grad if x.grad is not None else torch.zeros_like(x)
        out["y"].append(y.detach().cpu())
        out["dx"].append(dx.cpu())
        # A rank with an empty batch gets no weight/bias gradient (None:
        # zeros to autograd).
        for key, p in (("dw", bn.weight), ("db", bn.bias)):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            out[key].append(grad.detach().cpu().clone())
    out["running_mean"] = bn.running_mean.cpu()
    out["running_var"] = bn.running_var.cpu()
    out["num_batches_tracked"] = bn.num_batches_tracked.cpu()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def pytorch_sync_bn(inputs, momentum, tmp, name):
    """nn.SyncBatchNorm's results, assembled like the helper's output."""
    world = inputs["sizes"].numel()
    out_dir = os.path.join(tmp, name + ".torch")
    os.makedirs(out_dir)
    mp.spawn(rank_main, args=(world, inputs, momentum, out_dir),
             nprocs=world, join=True)
    ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"))
             for r in range(world)]
    return cpu_ref.assemble(ranks, inputs["x"].size(0))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print(f"CONCORD_TEST_SKIPPED: no CUDA device (torch {torch.__version__}, "
              f"built with CUDA {torch.version.cuda})")
        return 0
    torch.set_num_threads(1)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, sizes, tail, channels_last, momentum in cpu_ref.CASES:
            inputs = cpu_ref.case_inputs(name, sizes, tail, channels_last,
                                         momentum)
            backend = backend_for(inputs["sizes"].numel())
            got, error = cpu_ref.run_session_helper(
                args.bin_dir, tmp, name, inputs,
                "cuda" if backend == "nccl" else "cuda:0", backend)
            if error:
                failures.append(error)
                print(f"{name}: FAIL", flush=True)
                continue
            want = pytorch_sync_bn(inputs, momentum, tmp, name)
            # nn.SyncBatchNorm itself against BatchNorm on the whole batch:
            # a failure here is PyTorch's (or this harness's), not Concord's.
            sanity = cpu_ref.compare(
                name + " (nn.SyncBatchNorm vs BatchNorm)", want,
                cpu_ref.reference(inputs["x"], inputs["g"], inputs["weight"],
                                  inputs["bias"], momentum, cpu_ref.EPS),
                rtol=RTOL, atol=ATOL)
            case_failures = cpu_ref.compare(name, got, want, rtol=RTOL,
                                            atol=ATOL)
            print(f"{name} ({backend}): "
                  f"{'FAIL' if case_failures else 'ok'}"
                  f"{' (reference disagrees with BatchNorm)' if sanity else ''}",
                  flush=True)
            failures += case_failures + sanity
    for f in failures:
        print(f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

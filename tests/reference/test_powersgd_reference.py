#!/usr/bin/python3
"""PowerSGD: Concord's --comm-hook powersgd[:RANK[:START]] against PyTorch's
own powerSGD_hook (torch.distributed.algorithms.ddp_comm_hooks, gloo, W
processes) on the same TorchScript MLP, data and sharding.

    /usr/bin/python3 tests/reference/test_powersgd_reference.py --bin-dir B \
        --world-size W --rank R [--start-iter S]

Concord reproduces PyTorch's arithmetic, including the random projections
(numpy RandomState(0).randint seeding torch's generator), so the tolerance is
the exact-path one (rtol 1e-5). A second check makes sure compression really
happened: the result must differ from uncompressed DDP by far more than that.
"""
import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fixtures  # noqa: E402
import processes  # noqa: E402

BATCH, EPOCHS, LR = 8, 2, 0.1


def reference_worker(rank, args, init_file, model, data, out):
    torch.set_num_threads(1)
    # A file store and a barrier before tearing down, as torch_ddp_train.py
    # does: a TCP store on rank 0 that goes away while the others still use it
    # aborts them ("Resource deadlock avoided").
    dist.init_process_group("gloo", init_method="file://" + init_file,
                            rank=rank, world_size=args.world_size)
    try:
        train(rank, args, model, data, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train(rank, args, model, data, out):
    module = torch.jit.load(model)
    d = torch.load(data)
    ddp = DDP(module)
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=args.rank,
        start_powerSGD_iter=args.start_iter)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    idx = torch.arange(rank, d["inputs"].shape[0], args.world_size)
    for _ in range(EPOCHS):
        for b in range(0, len(idx), BATCH):
            i = idx[b:b + BATCH]
            loss = torch.nn.functional.cross_entropy(ddp(d["inputs"][i]), d["targets"][i])
            loss.backward()
            opt.step()
            opt.zero_grad()
    if rank == 0:
        torch.save(module.state_dict(), out)


def concord(args, model, data, out, hook):
    cmd = [os.path.join(args.bin_dir, "concord-run"), "--standalone",
           "--nproc", str(args.world_size), "--",
           os.path.join(args.bin_dir, "concord-train"), "--model", model,
           "--data", data, "--lr", str(LR), "--batch-size", str(BATCH),
           "--epochs", str(EPOCHS), "--output", out, "--log-interval", "1000"]
    if hook:
        cmd += ["--comm-hook", hook]
    r = processes.run_command(cmd, timeout=240)
    if r.returncode != 0:
        print(r.describe() if hasattr(r, "describe") else r)
    return r.returncode == 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--start-iter", type=int, default=2)
    args = p.parse_args()
    checks = fixtures.Checks()
    check = checks.check

    with tempfile.TemporaryDirectory(prefix="concord-powersgd-") as tmp:
        torch.manual_seed(0)
        # Two hidden layers wide enough that PowerSGD compresses them.
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                  torch.nn.Linear(64, 48), torch.nn.ReLU(),
                                  torch.nn.Linear(48, 10))
        model = os.path.join(tmp, "model.pt")
        data = os.path.join(tmp, "data.pt")
        torch.jit.save(torch.jit.script(net), model)
        n = args.world_size * BATCH * 4
        torch.save({"inputs": torch.randn(n, 32), "targets": torch.randint(0, 10, (n,))}, data)
        ref = os.path.join(tmp, "ref.pt")
        mp.start_processes(reference_worker, nprocs=args.world_size, join=True,
                           start_method="fork",
                           args=(args, os.path.join(tmp, "store"), model, data, ref))
        hook = "powersgd:%d:%d" % (args.rank, args.start_iter)
        out = os.path.join(tmp, "concord.pt")
        check(concord(args, model, data, out, hook), "concord-train --comm-hook " + hook)
        plain = os.path.join(tmp, "plain.pt")
        check(concord(args, model, data, plain, None), "concord-train without a hook")
        if os.path.exists(out) and os.path.exists(plain):
            a, b, c = (fixtures.load_state(p) for p in (out, ref, plain))
            problems = fixtures.compare_states(a, b, rtol=1e-5, atol=1e-6)
            check(not problems, "PowerSGD (W=%d, rank %d, start %d) equals PyTorch's powerSGD_hook"
                  % (args.world_size, args.rank, args.start_iter), "; ".join(problems[:5]))
            gap = max(fixtures.max_rel_diff(c[k], b[k]) for k in b)
            check(gap > 1e-3, "compression changed the result", "max rel diff to plain DDP %.3g" % gap)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

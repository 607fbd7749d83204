#!/usr/bin/python3
"""Integration test of a sharded optimizer's checkpoints (see Note [Elastic
ZeRO] in api/zero.cc and see Note [Shards copied where they are] in
worker/elastic/state.h): real concord-run + concord-train jobs with
--optimizer adam --zero and --checkpoint-dir, killed whole or in part,
started again (tests/integration/checkpoint_runs.py's).

    /usr/bin/python3 tests/integration/test_checkpoint_zero.py --bin-dir build/bin \\
        [--case NAME ...] [--keep]

Cases:
  zero       a job sharding its Adam state (--zero) killed whole (launcher
             and workers) once a checkpoint of step >= 60 is complete: the
             same command again resumes from it bit-identical to the
             uninterrupted sharded run (its optimizer.pt's Adam state
             included); optimizer.pt loads into torch.optim.Adam; the
             checkpoints resume across, sharded -> unsharded and unsharded
             -> sharded, both at 2 workers. Ranks 1 and 2 copy their shards
             into the node's snapshot themselves (the log says so), and with
             only the workers SIGKILLed (test_checkpoint.py's "memory" case
             with --zero) the job resumes from that snapshot bit-identical.
  zero-nodes two nodes (two concord-run launchers of 2 workers, one
             coordinator) sharding Adam: every worker dies and the node
             with rank 0 is lost whole; the job resumes from the other
             node's memory snapshot (its other rank's shard copied in place,
             the lost node's two sent as bytes), bit-identical to the two
             nodes' uninterrupted run.
  zero-overlap  the same killed-whole resume with --zero --zero-overlap step
             (the step in DDP's backward), bit-identical to its uninterrupted
             run, optimizer.pt into torch.optim.Adam.

Every subprocess has a timeout; a hang is a failure. Prints one line per
check and 'N passed, N failed'; exits 1 on any failure.
"""

import os
import re
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import elastic_harness as te  # noqa: E402
import processes  # noqa: E402  (tests/reference, on the path elastic_harness sets)
from checkpoint_runs import (  # noqa: E402
    RUN_TIMEOUT, SLOW, check_history, compare_final, launch, load_ckpt, memory_resume,
    run_again, main as checkpoint_main, steps, wait_for_checkpoint)


def case_zero(ctx, name, zero=("--zero",), across=True, in_place=True):
    """A job sharding its Adam state (--zero) killed whole resumes from its
    checkpoint bit-identical to its uninterrupted run; its optimizer.pt is
    PyTorch's Adam state_dict, whole; it resumes an unsharded job at 2
    workers, and an unsharded job's checkpoint resumes a sharded job at 2
    (`across`). With --zero-overlap the resumed job's shards come from the
    checkpoint's bucket layout (see Note [Elastic ZeRO overlapped with
    DDP] in api/zero_overlap.cc)."""
    checks = ctx.checks
    zero = list(zero)
    ref_rd, p_ref = launch(ctx, name + "-ref", name + "-ref", os.path.join(ctx.tmp, "ck-" + name + "-ref"),
                           optimizer="adam", train_extra=zero,
                           env={"CONCORD_TEST_MIN_STEP_MS": "10"})
    checks.check(p_ref.wait(RUN_TIMEOUT) == 0, name + ": the uninterrupted sharded run exits 0",
                 p_ref.describe())
    ref = (ref_rd, os.path.join(ctx.tmp, "ck-" + name + "-ref"))
    # Killed whole, the same command again.
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    rd, p = launch(ctx, name + "-1", job, ck, env=SLOW, optimizer="adam", train_extra=zero)
    if not wait_for_checkpoint(checks, name, p, ck, job, 60):
        return
    rd2, p2, step, _ = run_again(ctx, name, job, ck, p, optimizer="adam", train_extra=zero)
    check_history(checks, name, [rd, rd2], 3)
    compare_final(checks, name, rd2, ck, job, ref, ref_job=name + "-ref")
    # See Note [Shards copied where they are]: ranks 1 and 2 copied their
    # shards into the node's snapshot themselves, and only the workers
    # killed resume from that snapshot bit-identical.
    # With the overlap this model's one bucket, all of it, is rank 0's shard.
    said = re.search(r"ranks ([\d,]+) copied their optimizer shards into this node's snapshot "
                     r"themselves", p_ref.stderr())
    checks.check((said is not None and said.group(1) == "1,2") if in_place else said is None,
                 name + (": ranks 1 and 2 copied their shards into the node's snapshot "
                         "themselves" if in_place else ": nothing to copy in place: rank 0 "
                         "holds every parameter"), p_ref.stderr()[-3000:])
    memory_resume(ctx, name + "-memory", ref, ref_job=name + "-ref", optimizer="adam",
                  train_extra=zero)
    # The checkpoint in PyTorch: an ordinary Adam's state_dict.
    last = steps(ck, job)[-1]
    model, opt, _ = load_ckpt(ck, job, last)
    problems = []
    try:
        params = [torch.nn.Parameter(t.clone()) for t in model.values()]
        adam = torch.optim.Adam(params, lr=float(te.LR))
        adam.load_state_dict(opt)
        if len(adam.state) != len(params):
            problems.append("state for %d of %d parameters" % (len(adam.state), len(params)))
        for p_, s in zip(params, [opt["state"][i] for i in sorted(opt["state"])]):
            if s["exp_avg"].shape != p_.shape:
                problems.append("exp_avg of shape %s" % (tuple(s["exp_avg"].shape),))
    except Exception as e:  # noqa: BLE001
        problems.append("%s: %s" % (type(e).__name__, e))
    checks.check(not problems, name + ": step %d's optimizer.pt loads into torch.optim.Adam "
                 "with every parameter's state" % last, "; ".join(problems))
    # Across: the sharded checkpoints resume an unsharded job at 2 workers,
    # and an unsharded job's resume a sharded one at 2.
    for kind, first, second in (("sharded -> unsharded", zero, []),
                                ("unsharded -> sharded", [], zero)) if across else ():
        tag = name + ("-su" if first else "-us")
        job, ck = tag, os.path.join(ctx.tmp, "ck-" + tag)
        rd, p = launch(ctx, tag + "-1", job, ck, env=SLOW, optimizer="adam", train_extra=first)
        if not wait_for_checkpoint(checks, tag, p, ck, job, 60):
            continue
        rd2, p2, step, _ = run_again(ctx, tag, job, ck, p, nproc=2, optimizer="adam",
                                     train_extra=second)
        checks.check(re.search(r"concord-train: done: \d+ steps", p2.stdout()) is not None,
                     "%s (%s): training completed at world size 2" % (tag, kind), p2.describe())
        check_history(checks, tag, [rd, rd2], 2)


def case_zero_nodes(ctx, name):
    """Two nodes (two concord-run launchers of 2 workers on one coordinator,
    node ids a and b) sharding Adam: each node's snapshot gets its other
    rank's shard in place and the other node's two as bytes (see Note
    [Shards copied where they are]). Every worker dies and the node with
    rank 0 is lost whole: the job resumes from the other node's snapshot
    (never written to disk), bit-identical to the same two nodes'
    uninterrupted run."""
    checks = ctx.checks
    rd0 = te.RunDir(ctx.tmp, name + "-coordinator")
    coord = te.start_coordinator(ctx, name, rd0)
    if coord is None:
        return
    zero = ["--zero"]

    def two_nodes(tag, job, ck, env, restarts="0"):
        return [launch(ctx, "%s-%s" % (tag, node), job, ck, nproc=2, env=env,
                       coordinator=coord, optimizer="adam", train_extra=zero,
                       extra=["--node-id", node, "--min-workers", "4", "--max-workers", "4",
                              "--max-restarts", restarts])
                for node in ("a", "b")]

    def rank0(runs):
        return [i for i, (_, p) in enumerate(runs)
                if re.search(r"as rank 0 of 4", p.stderr())]

    try:
        ref_ck = os.path.join(ctx.tmp, "ck-" + name + "-ref")
        ref = two_nodes(name + "-ref", name + "-ref", ref_ck, {"CONCORD_TEST_MIN_STEP_MS": "10"})
        rcs = [p.wait(RUN_TIMEOUT) for _, p in ref]
        checks.check(rcs == [0, 0], name + ": the uninterrupted two-node run exits 0",
                     "\n".join(p.describe() for _, p in ref))
        saved = [i for i, (rd, _) in enumerate(ref) if os.path.exists(rd.output)]
        job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
        runs = two_nodes(name + "-1", job, ck, SLOW, restarts="1")
        if not wait_for_checkpoint(checks, name, runs[0][1], ck, job, 60):
            return
        first = rank0(runs)
        if not checks.check(len(first) == 1 and len(saved) == 1,
                            name + ": one launcher's worker is rank 0, one wrote the output",
                            "rank 0 on %s, output by %s" % (first, saved)):
            return
        lost, kept = runs[first[0]], runs[1 - first[0]]
        # The node with rank 0 lost whole, the other's workers killed (its
        # agent restarts them), then the lost node's launcher again.
        lost[1].kill_group()
        lost[1].wait(10)
        for pid in processes.children(kept[1].pid):
            os.kill(pid, signal.SIGKILL)
        node = "ab"[first[0]]
        again = launch(ctx, "%s-2-%s" % (name, node), job, ck, nproc=2, env=SLOW,
                       coordinator=coord, optimizer="adam", train_extra=zero,
                       extra=["--node-id", node, "--min-workers", "4", "--max-workers", "4"])
        rcs = [kept[1].wait(RUN_TIMEOUT), again[1].wait(RUN_TIMEOUT)]
        checks.check(rcs == [0, 0], name + ": both nodes finish (exit 0)",
                     kept[1].describe() + again[1].describe())
        text = kept[1].stderr() + again[1].stderr()
        m = re.search(r"resuming from step (\d+) of a checkpoint rank \d+ loaded \(memory\)|"
                      r"resuming from step (\d+) of the checkpoint in memory", text)
        checks.check(m is not None and int(m.group(1) or m.group(2)) >= 60 and
                     re.search(r"checkpoint in memory", kept[1].stderr()) is not None,
                     name + ": resumed from the surviving node's snapshot (step %s)" %
                     (m and (m.group(1) or m.group(2))), text[-3000:])
        wrote = [r for r, _ in (kept, again) if os.path.exists(r.output)]
        if checks.check(len(wrote) == 1, name + ": one node wrote the final output", str(wrote)):
            compare_final(checks, name, wrote[0], ck, job, (ref[saved[0]][0], ref_ck),
                          ref_job=name + "-ref")
    finally:
        coord.stop()


def case_zero_nodes_entry(ctx):
    case_zero_nodes(ctx, "zero-nodes")


CASES = {
    "zero": lambda ctx: case_zero(ctx, "zero"),
    "zero-nodes": case_zero_nodes_entry,
    "zero-overlap": lambda ctx: case_zero(ctx, "zero-overlap",
                                          zero=("--zero", "--zero-overlap", "step"),
                                          across=False, in_place=False),
}


if __name__ == "__main__":
    sys.exit(checkpoint_main(__doc__, CASES, "concord_checkpoint_zero_"))

"""The runs integration_checkpoint's cases are made of (test_checkpoint.py):
concord-run of concord-train with --checkpoint-dir over a small fixture, the
uninterrupted reference run, killing a job whole and running it again, and
the checks every case shares: the final state bit for bit against the
reference, the resume step a log line names, the history checker across the
loss; a separate coordinator and its `concordctl checkpoints`."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import elastic_harness as te  # noqa: E402
import test_status as ts  # noqa: E402
from elastic_harness import Proc  # noqa: E402
import processes  # noqa: E402  (tests/reference, on the path elastic_harness sets)

fixtures = te.fixtures

N_SAMPLES = 200
BATCH = 4
EPOCHS = 20  # 17 steps an epoch at 3 workers: 340 steps
EVERY = 10
RUN_TIMEOUT = 120.0


# Steps of at least 25 ms in the runs that are killed: the kill comes
# while the job runs.
SLOW = {"CONCORD_TEST_MIN_STEP_MS": "25"}


def launch(ctx, name, job, ck, nproc=3, extra=(), env=None, setup=None, after="",
           coordinator=None, train_extra=(), momentum=te.MOMENTUM, keep="100",
           optimizer="sgd"):
    """concord-run of the job's command in its own process group; `setup`:
    a shell script run first in a mount namespace of its own (unshare -m),
    `after` one run there after concord-run (its status is the exit's);
    `keep`: --checkpoint-keep (None: concord-run's default); `optimizer`:
    concord-train's (SGD's with `momentum`)."""
    rd = te.RunDir(ctx.tmp, name)
    train = ["--model", ctx.fx.model, "--data", ctx.fx.data, "--loss", "mse",
             "--optimizer", optimizer, "--lr", te.LR] + \
        (["--momentum", momentum] if optimizer == "sgd" else []) + [
             "--batch-size", BATCH, "--epochs", EPOCHS, "--output", rd.output,
             "--metrics-out", rd.metrics, "--sample-log", rd.samples,
             "--log-interval", "50"] + list(train_extra)
    where = (["--coordinator", coordinator.address, "--token-file", coordinator.worker_token]
             if coordinator else ["--standalone"])
    cmd = [ctx.bins.run] + where + ["--nproc", nproc, "--job-id", job,
           "--rendezvous-timeout-ms", te.RENDEZVOUS_TIMEOUT_MS,
           "--collective-timeout-ms", te.COLLECTIVE_TIMEOUT_MS, "--history", rd.history] + \
        te.HEARTBEAT + [
           "--checkpoint-dir", ck, "--checkpoint-every", EVERY] + \
        (["--checkpoint-keep", keep] if keep else []) + list(extra) + \
        ["--", ctx.bins.train] + train
    if setup:
        script = '%s && { "$@"; rc=$?; %s exit $rc; }' % (setup, after)
        cmd = ["unshare", "-m", "sh", "-c", script, "sh"] + cmd
    return rd, Proc(name, cmd, rd.logs, env=env)


def wait_for_checkpoint(checks, name, proc, ck, job, step):
    ok = te.testlib.wait_for(
        lambda: processes.latest_checkpoint_step(ck, job) >= step or proc.poll() is not None,
        timeout=60)
    return checks.check(ok and proc.poll() is None,
                        "%s: a checkpoint of step >= %d while the job runs" % (name, step),
                        proc.describe())


def steps(ck, job):
    out = []
    for d in os.listdir(os.path.join(ck, job)):
        m = re.match(r"step-(\d+)$", d)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


def load_ckpt(ck, job, step):
    d = os.path.join(ck, job, "step-%d" % step)
    model = torch.load(os.path.join(d, "model.pt"), weights_only=True)
    opt = torch.load(os.path.join(d, "optimizer.pt"),
                     weights_only=not torch.__version__.startswith("1."))
    with open(os.path.join(d, "manifest.json")) as f:
        manifest = json.load(f)
    return model, opt, manifest


def reference(ctx):
    """The uninterrupted run (made once)."""
    if ctx.ref is None:
        # Steps slow enough for most checkpoints to be written; a busy disk can
        # still make one be skipped, and no case needs any but the final one.
        rd, p = launch(ctx, "reference", "ref", os.path.join(ctx.tmp, "ck-ref"),
                       env={"CONCORD_TEST_MIN_STEP_MS": "10"})
        rc = p.wait(RUN_TIMEOUT)
        ctx.checks.check(rc == 0, "reference: the uninterrupted run exits 0", p.describe())
        # concord-train overlaps each snapshot's copy with the next step (see
        # Note [Overlapped snapshots]): fenced before the optimizer writes, none is
        # ever dropped as torn.
        dropped = re.findall(r"checkpoint of step \d+ dropped[^\n]*", p.stderr())
        ctx.checks.check(not dropped, "reference: no overlapped snapshot dropped",
                         "\n".join(dropped[:3]))
        ctx.ref = (rd, os.path.join(ctx.tmp, "ck-ref"))
    return ctx.ref


def compare_final(checks, name, rd, ck, job, ref, ref_job="ref"):
    ref_rd, ref_ck = ref
    problems = []
    a, e = fixtures.load_state(rd.output), fixtures.load_state(ref_rd.output)
    problems += fixtures.compare_states(a, e, rtol=0.0, atol=0.0)
    last, ref_last = steps(ck, job)[-1], steps(ref_ck, ref_job)[-1]
    if last != ref_last:
        problems.append("final checkpoints of steps %d and %d" % (last, ref_last))
    else:
        _, oa, ma = load_ckpt(ck, job, last)
        _, oe, me = load_ckpt(ref_ck, ref_job, ref_last)
        for i, s in oe["state"].items():
            for key, t in s.items():
                got = oa["state"].get(i, {}).get(key)
                if got is None or not torch.equal(torch.as_tensor(got), torch.as_tensor(t)):
                    problems.append("%s of parameter %d differs" % (key, i))
        if oa["param_groups"] != oe["param_groups"]:
            problems.append("param_groups differ")
        if (ma["epoch"], ma["samples"]) != (me["epoch"], me["samples"]):
            problems.append("epoch/samples differ")
    checks.check(not problems, name + ": final parameters and optimizer state bit-identical "
                 "to the uninterrupted run's", "; ".join(problems))


def resumed_step(text, source):
    m = re.search(r"resuming from step (\d+) of the checkpoint in %s \(" % source, text)
    return int(m.group(1)) if m else None


def check_history(checks, name, runs, resumes):
    """tests/history.py over the runs of the job (one after another, each
    with the coordinator concord-run embeds): every invariant, the resume
    from a checkpointed step with its digest, every sample once."""
    problems, summary = te.history.check_runs([rd.history for rd in runs], N_SAMPLES, EPOCHS)
    said = re.search(r"(\d+) resume\(s\)", summary)
    checks.check(not problems and said and int(said.group(1)) == resumes,
                 name + ": history invariants across the loss (%s; %d resumes expected)" % (
                     summary, resumes), "; ".join(problems[:20]))


def run_again(ctx, name, job, ck, p, **kw):
    """Kills the running job `p` whole (launcher and workers, SIGKILL), runs
    the same command again (`kw`: launch's) and checks that it exits 0 after
    resuming from the newest complete checkpoint on disk. Returns the second
    run's (RunDir, Proc, resumed step, newest checkpoint when killed)."""
    checks = ctx.checks
    seen = processes.latest_checkpoint_step(ck, job)
    p.kill_group()  # the launcher and every worker, SIGKILL
    p.wait(10)
    rd2, p2 = launch(ctx, name + "-2", job, ck, **kw)
    rc = p2.wait(RUN_TIMEOUT)
    checks.check(rc == 0, name + ": the same command again exits 0", p2.describe())
    step = resumed_step(p2.stderr(), "disk")
    checks.check(step is not None and step >= seen,
                 name + ": resumed from the newest complete checkpoint (%s >= %d, from disk)" % (
                     step, seen), p2.stderr()[-3000:])
    return rd2, p2, step, seen


def start_coordinator(ctx, name):
    """A concord-coordinator with its /metrics, or None (a failed check)."""
    coord = ts.Coordinator(ctx.bins, os.path.join(ctx.tmp, name + "-coordinator"))
    if not ctx.checks.check(coord.ok(), name + ": concord-coordinator started",
                            coord.proc.describe()):
        coord.stop()
        return None
    return coord


def checkpoints_json(ctx, coord, job):
    """`concordctl -o json checkpoints JOB`: (its JSON or {}, its output)."""
    ctl = os.path.join(os.path.dirname(ctx.bins.run), "concordctl")
    out = subprocess.run([ctl, "--endpoint", coord.address, "--token-file", coord.operator_token,
                          "-o", "json", "checkpoints", job], capture_output=True, text=True,
                         timeout=30)
    try:
        return json.loads(out.stdout), out.stdout + out.stderr
    except ValueError:
        return {}, out.stdout + out.stderr


class Context(object):
    def __init__(self, bins, checks, tmp, bin_dir):
        self.bins, self.checks, self.tmp, self.bin_dir = bins, checks, tmp, bin_dir
        self.fx = te.Fixture(tmp, N_SAMPLES)
        self.ref = None


def memory_resume(ctx, name, ref, ref_job="ref", **kw):
    """Only the workers SIGKILLed: they resume from the node's memory
    snapshot, bit-identical to `ref`'s run."""
    checks = ctx.checks
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    rd, p = launch(ctx, name, job, ck, extra=["--max-restarts", "1", "--min-workers", "1"],
                   env=SLOW, **kw)
    if not wait_for_checkpoint(checks, name, p, ck, job, 60):
        return
    trainers = processes.children(p.pid)
    for pid in trainers:
        os.kill(pid, signal.SIGKILL)
    checks.check(len(trainers) == 3, name + ": all 3 workers SIGKILLed, the agent lives",
                 "children: %s" % trainers)
    rc = p.wait(RUN_TIMEOUT)
    checks.check(rc == 0, name + ": concord-run restarts them and exits 0", p.describe())
    step = resumed_step(p.stderr(), "memory")
    checks.check(step is not None and step >= 60,
                 name + ": the restarted workers resumed from the node's memory (step %s)" % step,
                 p.stderr()[-3000:])
    # See Note [Resume source]: the agent reported its memory snapshots; the
    # coordinator named the one they took.
    checks.check(re.search(r"resuming from step %s of the checkpoint in memory \([^\n]*\), as "
                           r"the coordinator named" % step, p.stderr()) is not None,
                 name + ": it is the memory snapshot the coordinator named", p.stderr()[-3000:])
    check_history(checks, name, [rd], 3)
    compare_final(checks, name, rd, ck, job, ref, ref_job=ref_job)
    return p


def main(doc, cases, prefix):
    """A checkpoint test file's command line: --bin-dir, --case (repeated;
    every case without), --list (the cases' names), --keep (the temporary
    directory); runs them with run_selected."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--bin-dir")
    p.add_argument("--case", action="append", default=[], choices=list(cases))
    p.add_argument("--list", action="store_true")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    if args.list:
        print("\n".join(cases))
        return 0
    if not args.bin_dir:
        p.error("--bin-dir is required")
    return run_selected(args, cases, prefix)


def run_selected(args, cases, prefix):
    """The cases of `cases` named by args.case (all without) against
    args.bin_dir's binaries, in a temporary directory named with `prefix`:
    one line per check, 'N passed, N failed'; returns the exit status."""
    checks = te.Checks()
    bins = te.Bins(args.bin_dir)
    if bins.missing():
        checks.fail("concord binaries present", str(bins.missing()))
        return checks.finish()
    tmp = tempfile.mkdtemp(prefix=prefix)
    ctx = Context(bins, checks, tmp, args.bin_dir)
    te.run_cases(ctx, [(n, f) for n, f in cases.items() if not args.case or n in args.case],
                 args.keep)
    return checks.finish()

#!/usr/bin/python3
"""The examples as their users build and run them: against an installed
Concord, under the installed launcher, with a worker killed mid-run.

    /usr/bin/python3 tests/integration/test_examples.py --build-dir build \
        --source-dir . --example mnist|torchscript|convnet|gan [--cmake cmake] \
        [--device cpu|cuda:N] [--keep] [--bin-dir IGNORED]

1. `cmake --install BUILD --prefix P` into a fresh temporary prefix.
2. examples/EXAMPLE copied out of the source tree, configured with
   CMAKE_PREFIX_PATH=P only and built with -Wall -Wextra -Werror (through
   the build's own compiler launcher, ccache, when it has one);
   examples/mnist/prepare_data.py writes the idx files from Debian's
   dataset-fashion-mnist, or from BUILD/datasets/fashion-mnist where
   scripts/test.sh copied it for the Debian 13 root (SKIP when neither is
   there). A bad flag: one line, exit status 2.
3. P/bin/concord-run --standalone --nproc 3 --min-workers 2
   --max-restarts 1 runs it on 9000 samples. Once rank 0 is a third into
   the first epoch, this script SIGKILLs local worker 2: the survivors
   re-form and go on, concord-run restarts the worker, and it is admitted
   (in the survivors' re-form when it is quick enough, else at a step
   boundary). With --device cuda:N (CONCORD_DEVICE, and CONCORD_BACKEND=gloo,
   both passed on by concord-run) the three ranks share that GPU over Gloo
   (NCCL refuses two ranks on one device); SKIP when this python's torch
   sees no CUDA device. The run's output is echoed as it comes ("| "), so
   that a run cut short by ctest still shows how far it got.
   Checked for every example: exit status 0; three final lines
   (ranks 0-2, world 3, on the device asked for: the restarted worker
   trained to the end); the same
   step count on all; the survivors re-formed. (Before the fix it found,
   the survivors skipped the step agreement the newcomer ran and Gloo
   aborted the newcomer.) And for each:
   - mnist (pytorch/examples' cpp/mnist): bit-identical parameters on every
     rank; test accuracy above 0.3 (chance is 0.1);
   - torchscript: model.py pretrains a classifier on five of the ten
     classes in Python and saves it as TorchScript; concord-finetune loads
     it, freezes its features and fine-tunes the head on all ten; Python
     loads what rank 0 saved: features bit-identical to the exported ones,
     head changed, test accuracy up by more than 0.15 and above 0.6;
   - convnet (SyncBatchNorm and SlowMo's LocalSGD with slow momentum, no
     buffer broadcast): BatchNorm running statistics bit-identical on every
     rank (plain BatchNorm's would differ); test accuracy above 0.6 on
     every rank.
4. gan (pytorch/examples' cpp/dcgan: a generator and a discriminator, each
   in its own DistributedDataParallel, two Adam optimizers, one
   ElasticState, a DataLoader with 2 workers) runs differently: 3 ranks
   under concord-run --standalone --nproc 3 --min-workers 2 without
   restarts, so that every run has the same world sizes (3 up to the
   killed step, 2 from it on), and with --noise step (its random numbers
   a function of the step and the rank, not of which worker died), so that
   it is deterministic. In each of four runs
   CONCORD_TEST_FAULT makes local worker 2 SIGKILL itself in step
   GAN_STEP, at one point of the step each (GAN_FAULTS): (a) in the
   discriminator's backward on the fakes, (b) after the discriminator's
   optimizer stepped, at its third forward (the generator's step), (c) in
   the generator's backward, (d) at the step's first forward, before any
   collective of it. Checked for each: the worker logged the kill at that
   point and died of it; concord-run exits 0 (the job completed: see Note
   [Exit status]) with a summary line naming worker 2, SIGKILLed, as the
   only worker lost;
   two final lines (world 2, one re-form, the same step count); the
   survivors' parameters of both models bit-identical (CRC-32 of their
   bytes); both survivors went on from the commit before the killed step
   (their history's restore in generation 2); the history (concord-run
   --history, tests/history.py) holds every invariant and every sample of
   both epochs trained exactly once across the re-form, with the loader's
   2 workers prefetching. Across the runs: all four end with bit-identical
   parameters -- the killed step was taken again from the same commit in
   the same 2-rank world, so no update (the discriminator's optimizer
   step in (b) and (c) included) was applied twice or lost. Rank 0's
   checkpoint (--out) loads in Python with the parameters its final line
   names.
5. gan with durable checkpoints (concord-run --job-id gan --checkpoint-dir
   DIR --checkpoint-every 5, 4 epochs: 40 steps at 3 ranks; its random
   numbers from each rank's global generators, upstream's way), three ways:
   uninterrupted; killed whole (the launcher and every worker SIGKILLed
   once the checkpoint of step 10 is complete) and the same command run
   again; and only the workers SIGKILLed, concord-run restarting them
   (--max-restarts 1). Checked: the run after the loss exits 0, resumed
   from the newest complete checkpoint (its log line names the step, from
   disk after the whole job died, from the node's memory while
   concord-run lived), both models' parameters on all 3 ranks are
   bit-identical to the uninterrupted run's (both Adams' moments and step
   counts, the sampler's position and each rank's random generators came
   back: any difference would show in the parameters), and the history
   across the loss
   holds every invariant (the resume a restore of the checkpoint's digest,
   every sample of every epoch trained).
6. mnist with durable checkpoints (after its run of 3.): pytorch/examples'
   model has Dropout2d and dropout, drawn from each rank's CPU generator.
   concord-run --job-id mnist --checkpoint-dir DIR --checkpoint-every 5, 6
   epochs of 960 samples (60 steps at 3 ranks, 32 samples a rank a step),
   uninterrupted; then killed whole (the launcher and every worker
   SIGKILLed on the first progress line once the checkpoint of step 10 is
   complete) and the same command run again. Checked: the run again exits
   0, resumed from disk at the newest complete checkpoint, before the last
   step; steps, test accuracy and parameter sum on all 3 ranks equal to the
   uninterrupted run's; its final checkpoint's files the same to the bit
   (every tensor of model.pt, optimizer.pt and state.pt, each rank's
   generators in rng/ranks included); the history across the loss holds
   every invariant.

Prints one line per check and a final 'N passed, N failed'; exits 1 on any
failure.
"""

import argparse
import json
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))

import fixtures  # noqa: E402
import processes  # noqa: E402
import history  # noqa: E402  (tests/history.py, on the path fixtures sets)

DATASET = "/usr/share/datasets/fashion-mnist"
# Every example ends with one line per worker: "TARGET: key value ...".
# concord-run prefixes each worker's lines (see Note [Worker output]).
FINAL = r"^(?:\[worker \d+\] )?%s: ((?:\S+ \S+ ?)+)$"
PROGRESS = re.compile(r"Epoch: (\d+) \[\s*(\d+)/\s*(\d+)\]")
# Each example: its CMake target, and its flags after --data DATA.
EXAMPLES = {
    "mnist": ("concord-mnist", ["--epochs", "3", "--train-samples", "9000",
                                "--test-samples", "2000"]),
    "torchscript": ("concord-finetune", ["--epochs", "3", "--train-samples",
                                         "9000"]),
    "convnet": ("concord-convnet", ["--epochs", "2", "--train-samples",
                                    "9000", "--test-samples", "2000"]),
    "gan": ("concord-dcgan", ["--epochs", "2", "--train-samples", "480",
                              "--batch-size", "16", "--log-interval", "5"]),
}
GAN_SAMPLES, GAN_EPOCHS = 480, 2
# The step (committed + 1) in which local worker 2 kills itself, and where
# (CONCORD_TEST_FAULT's POINT:MODULE:N, N counting in that step). A step:
# D forward on real images, D backward; G forward, D forward on the fakes
# (detached), D backward; D's optimizer step; D forward on the fakes, backward
# through D and G; G's optimizer step; commit.
GAN_STEP = 4
GAN_FAULTS = [
    ("a", "in the discriminator's backward (on the fakes)",
     "backward:discriminator:2"),
    ("b", "after the discriminator's optimizer step (its 3rd forward, the "
     "generator's step)", "forward:discriminator:3"),
    ("c", "in the generator's backward", "backward:generator:1"),
    ("d", "at the start of the step (before any collective of it)",
     "forward:discriminator:1"),
]


def build(checks, args, prefix, work, name, target):
    src = os.path.join(work, name + "-src")
    out = os.path.join(work, name + "-build")
    shutil.copytree(os.path.join(args.source_dir, "examples", name), src)
    configure = processes.example_configure(args.cmake, args.build_dir, src,
                                           out, prefix)
    r = processes.run_command(configure, timeout=120)
    if not checks.check(r.returncode == 0 and not r.timed_out,
                        "%s configures against the prefix" % name,
                        r.describe()):
        return None
    r = processes.run_command([args.cmake, "--build", out, "--parallel", "1"],
                             timeout=420)
    if not checks.check(r.returncode == 0 and not r.timed_out,
                        "%s builds (-Wall -Wextra -Werror)" % name,
                        r.describe()):
        return None
    checks.ok("%s built in %.1f s" % (name, r.elapsed))
    return os.path.join(out, target)


def worker_env(device, **extra):
    """The environment of an example's run under concord-run: one thread a
    worker, a quick death verdict, `device` over Gloo."""
    return dict(os.environ, OMP_NUM_THREADS="1",
                CONCORD_HEARTBEAT_INTERVAL_MS="200",
                CONCORD_HEARTBEAT_TIMEOUT_MS="2000", CONCORD_DEVICE=device,
                CONCORD_BACKEND="gloo", **extra)


def final_lines(text, name):
    """Each worker's final line of example `name`, as a dict."""
    finals = []
    for m in re.finditer(FINAL % re.escape(EXAMPLES[name][0]), text, re.M):
        words = m.group(1).split()
        finals.append(dict(zip(words[0::2], words[1::2])))
    return finals


def run_killed(checks, prefix, name, command, device):
    """Runs `command` (an example's binary and flags) as 3 ranks under the
    installed concord-run, SIGKILLs local worker 2 a third into epoch 1,
    and checks what every example must do. Returns each worker's final line
    as a dict, or None."""
    cmd = [os.path.join(prefix, "bin", "concord-run"), "--standalone",
           "--nproc", "3", "--min-workers", "2", "--max-restarts", "1",
           "--"] + command + ["--log-interval", "5"]
    env = worker_env(device)
    killed = []  # (pid, seconds since the start)
    start = time.monotonic()

    def kill_a_third_into_epoch_1(line, launcher_pid):
        m = PROGRESS.search(line)
        if (not killed and m and m.group(1) == "1" and
                int(m.group(2)) * 3 >= int(m.group(3))):
            pid = processes.local_worker(launcher_pid, 2)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed.append((pid, time.monotonic() - start))

    rc, text, elapsed = run_streamed(cmd, env, 300,
                                     kill_a_third_into_epoch_1)
    killed = killed[0] if killed else None
    tail = text[-3000:]
    if not checks.check(killed is not None,
                        "%s: local worker 2 SIGKILLed a third into epoch 1" %
                        name, "never killed: " + tail):
        return None
    checks.ok("%s: killed pid %d at %.1f s" % ((name,) + killed))
    if not checks.check(rc == 0,
                        "%s: concord-run exits 0 (the worker restarted and "
                        "finished)" % name, "exit %s: %s" % (rc, tail)):
        return None
    checks.ok("%s: a death and an admission in %.1f s" % (name, elapsed))
    finals = final_lines(text, name)
    if not checks.check(sorted(int(f.get("rank", -1)) for f in finals) ==
                        [0, 1, 2], "%s: three final lines, ranks 0-2" % name,
                        tail):
        return None
    checks.check(all(f["world"] == "3" for f in finals),
                 "%s: world 3 at the end (the restarted worker was "
                 "admitted)" % name, str(finals))
    checks.check(all(f["device"] == device for f in finals),
                 "%s: every rank trained on %s" % (name, device), str(finals))
    checks.check(len({f["steps"] for f in finals}) == 1,
                 "%s: the same committed step count on every rank" % name,
                 str(finals))
    survivors = [f for f in finals if int(f["reforms"]) > 0]
    checks.check(len(survivors) == 2,
                 "%s: two survivors re-formed (the restarted worker joined "
                 "in their re-form or was admitted after it)" % name,
                 str(finals))
    return finals


def same_on_every_rank(checks, name, finals, key, what):
    # NaN prints the same on every rank: equal, but not a trained model.
    checks.check(all(math.isfinite(float(f[key])) for f in finals),
                 "%s: %s finite on every rank" % (name, what), str(finals))
    checks.check(len({f[key] for f in finals}) == 1,
                 "%s: %s bit-identical on every rank" % (name, what),
                 str(finals))


def check_mnist(checks, args, prefix, binary, data, work):
    finals = run_killed(checks, prefix, "mnist",
                        [binary, "--data", data] + EXAMPLES["mnist"][1],
                        args.device)
    if finals:
        same_on_every_rank(checks, "mnist", finals, "param_sum", "parameters")
        accuracy = float(finals[0]["test_accuracy"])
        checks.check(accuracy > 0.3, "mnist: test accuracy %.4f > 0.3 "
                     "(chance: 0.1)" % accuracy, str(finals))
    check_mnist_checkpoints(checks, prefix, binary, data, work, args.device)


# The mnist example's checkpointed runs (module docstring, 6.): 10 steps an
# epoch at 3 ranks (32 samples a rank a step), a checkpoint every 5 steps;
# the kill comes once the checkpoint of step MNIST_CKPT_KILL_AFTER is
# complete. Its steps take about 10 ms on 2 cores, and the node's writes
# lag: in a 30-step run the kill came at step 25 (`latest` named 15), so
# the runs are of 60 steps.
MNIST_CKPT_SAMPLES, MNIST_CKPT_BATCH, MNIST_CKPT_EPOCHS = 960, 32, 6
MNIST_CKPT_STEPS = MNIST_CKPT_EPOCHS * 10
MNIST_CKPT_EVERY, MNIST_CKPT_KILL_AFTER = 5, 10
MNIST_KEYS = ("steps", "test_accuracy", "param_sum")


def run_mnist_checkpointed(checks, prefix, binary, data, work, device, tag,
                           kill=None):
    """The mnist example as 3 ranks under concord-run --checkpoint-dir
    WORK/mnist-ck (job "mnist"), a progress line every step. Returns (exit
    status, output, the checkpoint step seen at the kill, history
    directory, the job's checkpoint folder)."""
    hist = os.path.join(work, "mnist-ck-history-" + tag)
    ck = os.path.join(work, "mnist-ck")
    rc, text, seen = run_checkpointed(
        checks, prefix, "mnist (%s)" % tag, "mnist",
        [binary, "--data", data, "--epochs", str(MNIST_CKPT_EPOCHS),
         "--train-samples", str(MNIST_CKPT_SAMPLES), "--batch-size",
         str(MNIST_CKPT_BATCH), "--test-samples", "1000", "--log-interval",
         "1"], ck, hist, MNIST_CKPT_EVERY, MNIST_CKPT_KILL_AFTER,
        MNIST_CKPT_STEPS, device, kill=kill)
    return rc, text, seen, hist, os.path.join(ck, "mnist")


def same_values(a, b, where):
    """Where the loaded contents `a` and `b` (dicts, lists, tensors,
    numbers) differ, bit for bit."""
    import torch
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and
                torch.equal(a, b))
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if sorted(map(str, a)) != sorted(map(str, b)):
            return ["%s: keys %s / %s" % (where, sorted(map(str, a)),
                                          sorted(map(str, b)))]
        return [d for k in a for d in same_values(a[k], b[k],
                                                  "%s/%s" % (where, k))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return ["%s: %d / %d items" % (where, len(a), len(b))]
        return [d for i, (x, y) in enumerate(zip(a, b))
                for d in same_values(x, y, "%s[%d]" % (where, i))]
    return [] if a == b else ["%s: %r / %r" % (where, a, b)]


def compare_final_checkpoints(checks, name, a, b):
    """The newest step-N of job folders `a` (uninterrupted) and `b`: the
    same step, and every .pt the same to the bit, each rank's random
    generators (state.pt's rng/ranks) included."""
    import torch

    def newest(job_dir):
        found = [int(d[5:]) for d in os.listdir(job_dir)
                 if re.match(r"step-\d+$", d)]
        return max(found) if found else None

    sa, sb = newest(a), newest(b)
    problems = [] if sa == sb and sa is not None else [
        "newest checkpoints: step %s / %s" % (sa, sb)]
    keys = []
    if not problems:
        da, db = (os.path.join(x, "step-%d" % sa) for x in (a, b))
        files = sorted(f for f in os.listdir(da) if f.endswith(".pt"))
        if files != sorted(f for f in os.listdir(db) if f.endswith(".pt")):
            problems.append("files %s / %s" % (files, os.listdir(db)))
        v1 = torch.__version__.startswith("1.")
        for f in files:
            weights_only = not (v1 and f.startswith("optimizer"))
            x = torch.load(os.path.join(da, f), weights_only=weights_only)
            y = torch.load(os.path.join(db, f), weights_only=weights_only)
            if isinstance(x, dict):
                keys += ["%s:%s" % (f, k) for k in x]
            problems += same_values(x, y, f)
    checks.check(not problems and any(k.endswith("rng/ranks") for k in keys),
                 "%s: the final checkpoint (step %s) the same to the bit as "
                 "the uninterrupted run's, each rank's random generators "
                 "included" % (name, sb), "; ".join(problems[:10]) +
                 "\nkeys: %s" % keys)


def check_mnist_checkpoints(checks, prefix, binary, data, work, device):
    """Module docstring, 6.: uninterrupted, then killed whole and the same
    command again."""
    rc, text, _, _, ref_dir = run_mnist_checkpointed(
        checks, prefix, binary, data, os.path.join(work, "mnist-ref"),
        device, "uninterrupted")
    reference = uninterrupted_end(checks, "mnist", MNIST_KEYS, rc, text)
    if reference is None:
        return
    lost = os.path.join(work, "mnist-lost")
    rc, text, seen, hist1, _ = run_mnist_checkpointed(
        checks, prefix, binary, data, lost, device, "killed whole",
        kill=kill_group)
    checks.check(rc is not None and rc < 0, "mnist (killed whole): the "
                 "launcher and every worker SIGKILLed", "exit %s" % rc)
    rc, text, _, hist2, job_dir = run_mnist_checkpointed(
        checks, prefix, binary, data, lost, device, "again")
    check_resumed(checks, "mnist", "killed whole, the same command again", rc,
                  text, "disk", seen, reference, MNIST_KEYS, [hist1, hist2],
                  MNIST_CKPT_SAMPLES, MNIST_CKPT_EPOCHS, MNIST_CKPT_STEPS)
    compare_final_checkpoints(checks, "mnist (killed whole, the same command "
                              "again)", ref_dir, job_dir)


def model_py(args, *argv):
    return processes.run_command(
        [sys.executable, os.path.join(args.source_dir, "examples",
                                      "torchscript", "model.py")] +
        list(argv), timeout=240)


def check_torchscript(checks, args, prefix, binary, data, work):
    """Python pretrains on five classes and saves TorchScript; the workers
    fine-tune its head on all ten with the features frozen; Python loads
    the result."""
    base = os.path.join(work, "model.pt")
    tuned = os.path.join(work, "tuned.pt")
    r = model_py(args, "export", data, base)
    if not checks.check(r.returncode == 0, "torchscript: model.py export",
                        r.describe()):
        return
    before = float(re.search(r"test accuracy (\S+)", r.stdout).group(1))
    finals = run_killed(checks, prefix, "torchscript",
                        [binary, "--model", base, "--data", data, "--out",
                         tuned] + EXAMPLES["torchscript"][1], args.device)
    if not finals:
        return
    same_on_every_rank(checks, "torchscript", finals, "param_sum",
                       "parameters")
    checks.check(all(f["frozen"] == "4" and f["trainable"] == "4"
                     for f in finals),
                 "torchscript: 4 parameters frozen, 4 trained", str(finals))
    r = model_py(args, "evaluate", data, tuned, "--base", base)
    if not checks.check(r.returncode == 0, "torchscript: Python loads the "
                        "fine-tuned model: features bit-identical to the "
                        "exported ones, head changed", r.describe()):
        return
    after = float(re.search(r"test accuracy (\S+)", r.stdout).group(1))
    checks.check(after > before + 0.15 and after > 0.6,
                 "torchscript: test accuracy over ten classes %.4f -> %.4f" %
                 (before, after), r.describe())


def check_convnet(checks, args, prefix, binary, data, work):
    finals = run_killed(checks, prefix, "convnet",
                        [binary, "--data", data] + EXAMPLES["convnet"][1],
                        args.device)
    if not finals:
        return
    # Plain BatchNorm's statistics would differ: each rank sees its own
    # batches, and buffers are not broadcast.
    same_on_every_rank(checks, "convnet", finals, "running_stats_sum",
                       "SyncBatchNorm's running statistics")
    worst = min(float(f["test_accuracy"]) for f in finals)
    checks.check(worst > 0.6, "convnet: test accuracy > 0.6 on every rank "
                 "(worst %.4f)" % worst, str(finals))


def run_streamed(cmd, env, timeout, on_line=None):
    """Runs cmd (stdout and stderr together, echoed as it comes with "| ")
    in its own session, calling on_line(line, pid) for each line; kills the
    session at `timeout`. Returns (exit status or None when it timed out,
    output, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, universal_newlines=True,
                            errors="replace")
    output = []
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = start + timeout
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=1.0):
                if proc.poll() is not None:
                    break
                continue
            line = proc.stdout.readline()
            if not line:
                break
            output.append(line)
            sys.stdout.write("| " + line)
            sys.stdout.flush()
            if on_line is not None:
                on_line(line, proc.pid)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = proc.poll() is None
        if timed_out:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rc = None if timed_out else proc.returncode
    return rc, "".join(output), time.monotonic() - start


def read_history(directory):
    """The worker records of a --history directory, by worker id."""
    records = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".history") or name == history.STANDALONE:
            continue
        with open(os.path.join(directory, name)) as f:
            lines = f.read().split("\n")[:-1]
        records[name[:-len(".history")]] = [json.loads(x) for x in lines
                                            if x.strip()]
    return records


def run_gan_fault(checks, prefix, binary, data, work, tag, where, fault,
                  device, out=None):
    """One run of the gan example with local worker 2 killed at `fault` of
    step GAN_STEP; the checks of each run (the module docstring, 4.).
    Returns the survivors' final lines, or None."""
    name = "gan (%s)" % tag
    hist = os.path.join(work, "gan-history-" + tag)
    os.makedirs(hist)
    cmd = [os.path.join(prefix, "bin", "concord-run"), "--standalone",
           "--nproc", "3", "--min-workers", "2", "--history", hist, "--",
           binary, "--data", data, "--noise", "step"] + EXAMPLES["gan"][1]
    if out:
        cmd += ["--out", out]
    env = worker_env(device,
                     CONCORD_TEST_FAULT="2:%d:%s" % (GAN_STEP, fault))
    rc, text, elapsed = run_streamed(cmd, env, timeout=120)
    tail = text[-3000:]
    point, module, n = fault.split(":")
    killed = re.search(
        r"^\[worker 2\] .*CONCORD_TEST_FAULT: killing myself at step %d, "
        r"%s %s of '%s'$" % (GAN_STEP, point, n, module), text, re.M)
    if not checks.check(killed is not None, "%s: local worker 2 killed "
                        "itself in step %d, %s (%s)" %
                        (name, GAN_STEP, where, fault), tail):
        return None
    if not checks.check(rc is not None, "%s: the job completes within 120 s"
                        % name, tail):
        return None
    checks.ok("%s: ran %.1f s" % (name, elapsed))
    # See Note [Exit status] in tools/launcher.h: the job completed, so
    # concord-run exits 0, and its summary names the lost worker -- the
    # killed one, the only one.
    lost = re.findall(r"^concord-run: job \S+ completed; worker run\(s\) lost "
                      r"on the way: (.*)$", text, re.M)
    checks.check(rc == 0 and len(lost) == 1 and
                 lost[0].startswith("worker 2 (") and "SIGKILL" in lost[0]
                 and "), worker" not in lost[0],
                 "%s: concord-run exits 0 (the job completed) and its "
                 "summary names worker 2, SIGKILLed, as the one lost" % name,
                 "exit %s, lost %s: %s" % (rc, lost, tail))
    errors = re.findall(r"^\[worker [01]\] concord-dcgan: (?!rank ).*$", text,
                        re.M)
    checks.check(not errors, "%s: the survivors report no error" % name,
                 "\n".join(errors))
    finals = final_lines(text, "gan")
    if not checks.check(sorted(int(f.get("rank", -1)) for f in finals) ==
                        [0, 1], "%s: two final lines, ranks 0 and 1" % name,
                        tail):
        return None
    checks.check(all(f["world"] == "2" and f["reforms"] == "1" and
                     f["device"] == device for f in finals),
                 "%s: world 2 on %s after one re-form" % (name, device),
                 "\n".join(map(str, finals)))
    checks.check(len({f["steps"] for f in finals}) == 1,
                 "%s: the same committed step count on both (%s)" %
                 (name, finals[0]["steps"]), "\n".join(map(str, finals)))
    for model in ("generator", "discriminator"):
        checks.check(math.isfinite(float(finals[0][model + "_sum"])) and
                     len({(f[model + "_crc"], f[model + "_sum"])
                          for f in finals}) == 1,
                     "%s: the %s's parameters bit-identical on both "
                     "survivors (crc %s)" % (name, model,
                                              finals[0][model + "_crc"]),
                     "\n".join(map(str, finals)))
    # Both survivors went on in generation 2 from the commit before the
    # killed step: the step was taken again, from its start.
    records = read_history(hist)
    restores = sorted((r["generation"], r["step"])
                      for recs in records.values() for r in recs
                      if r["event"] == "restore" and r["generation"] > 1)
    checks.check(restores == [(2, GAN_STEP - 1)] * 2,
                 "%s: both survivors went on from step %d in generation 2" %
                 (name, GAN_STEP - 1), str(restores))
    problems, summary = history.check(hist, (), GAN_SAMPLES, GAN_EPOCHS,
                                      int(finals[0]["steps"]))
    checks.check(not problems, "%s: history invariants, every sample of %d "
                 "epochs trained exactly once with 2 loader workers (%s)" %
                 (name, GAN_EPOCHS, summary), "; ".join(problems[:20]))
    return finals


# The gan example's checkpointed runs (module docstring, 5.): 10 steps an
# epoch at 3 ranks, a checkpoint every 5 steps; the kills come once the
# checkpoint of step GAN_CKPT_KILL_AFTER is complete, well before the end.
GAN_CKPT_EPOCHS, GAN_CKPT_EVERY, GAN_CKPT_KILL_AFTER = 4, 5, 10
GAN_KEYS = ("steps", "generator_crc", "generator_sum", "discriminator_crc",
            "discriminator_sum")


def run_checkpointed(checks, prefix, name, job, command, ck, hist, every,
                     kill_after, total, device, extra=(), kill=None):
    """`command` (an example's binary and flags) as 3 ranks under
    concord-run --job-id JOB --checkpoint-dir CK --checkpoint-every EVERY
    --history HIST, `kill(launcher_pid)` called once, on the first progress
    line after the checkpoint of step `kill_after` is complete (of `total`
    steps). Returns (exit status, output, the checkpoint step seen at the
    kill)."""
    os.makedirs(hist)
    cmd = [os.path.join(prefix, "bin", "concord-run"), "--standalone",
           "--nproc", "3", "--job-id", job, "--history", hist,
           "--checkpoint-dir", ck, "--checkpoint-every",
           str(every)] + list(extra) + ["--"] + command
    seen = []

    def on_line(line, launcher_pid):
        if kill and not seen and PROGRESS.search(line):
            step = processes.latest_checkpoint_step(ck, job)
            if step < kill_after:
                return
            seen.append(step)
            kill(launcher_pid)

    rc, text, _ = run_streamed(cmd, worker_env(device), 180, on_line)
    if kill:
        checks.check(seen and seen[0] < total,
                     "%s: killed mid-run (checkpoint of step %s complete)" %
                     (name, seen[0] if seen else None), text[-3000:])
    return rc, text, seen[0] if seen else None


def run_gan_checkpointed(checks, prefix, binary, data, work, device, tag,
                         extra=(), kill=None):
    """The gan example as 3 ranks under concord-run --checkpoint-dir (job
    "gan", one directory and history per `tag`), `kill(launcher_pid)`
    called once, on the first progress line after the checkpoint of step
    GAN_CKPT_KILL_AFTER is complete. Returns (exit status, output, the
    checkpoint step seen at the kill, history directory)."""
    hist = os.path.join(work, "gan-ck-history-" + tag)
    rc, text, seen = run_checkpointed(
        checks, prefix, "gan (%s)" % tag, "gan",
        [binary, "--data", data, "--epochs", str(GAN_CKPT_EPOCHS),
         "--train-samples", str(GAN_SAMPLES), "--batch-size", "16",
         "--log-interval", "5"], os.path.join(work, "gan-ck"), hist,
        GAN_CKPT_EVERY, GAN_CKPT_KILL_AFTER, GAN_CKPT_EPOCHS * 10, device,
        extra, kill)
    return rc, text, seen, hist


def uninterrupted_end(checks, example, keys, rc, text):
    """The uninterrupted checkpointed run of `example`: exit 0, three ranks
    at world size 3 ending on the same `keys`. Returns that end (None: a
    failed check)."""
    finals = final_lines(text, example)
    ends = {tuple(f[k] for k in keys) for f in finals}
    if not checks.check(rc == 0 and len(finals) == 3 and len(ends) == 1 and
                        all(f["world"] == "3" for f in finals),
                        "%s (uninterrupted, checkpointed): exits 0, three "
                        "ranks end equal" % example, text[-3000:]):
        return None
    return ends.pop()


def kill_group(launcher_pid):
    """The launcher and every worker (its process group), SIGKILL."""
    os.killpg(launcher_pid, signal.SIGKILL)


def check_resumed(checks, example, tag, rc, text, source, seen, reference,
                  keys, histories, samples, epochs, total):
    """A checkpointed run of `example` that resumed from `source` (disk or
    memory) after a loss: exit 0, the newest complete checkpoint taken
    (before the end: steps were left to train), the final lines' `keys`
    on all 3 ranks equal to the uninterrupted run's (`reference`), history
    invariants across the loss."""
    name = "%s (%s)" % (example, tag)
    m = re.search(r"resuming from step (\d+) of the checkpoint in %s \(" %
                  source, text)
    step = int(m.group(1)) if m else None
    checks.check(rc == 0 and step is not None and seen is not None and
                 seen <= step < total, "%s: exits 0 after resuming from %s "
                 "at step %s (>= %s, the newest complete checkpoint when "
                 "killed; < %d, the last)" % (name, source, step, seen,
                                              total), text[-3000:])
    finals = final_lines(text, example)
    ends = {tuple(f[k] for k in keys) for f in finals}
    checks.check(len(finals) == 3 and ends == {reference},
                 "%s: %s on all 3 ranks bit-identical to the uninterrupted "
                 "run's" % (name, ", ".join(keys)),
                 "uninterrupted: %s\n%s" % (reference, "\n".join(
                     map(str, finals))))
    problems, summary = history.check_runs(histories, samples, epochs, total)
    checks.check(not problems and "3 resume(s)" in summary,
                 "%s: history invariants across the loss, the resume "
                 "a restore of the checkpoint's digest (%s)" % (name, summary),
                 "; ".join(problems[:20]))


def check_gan_resumed(checks, tag, rc, text, source, seen, reference,
                      histories):
    """A checkpointed gan run that resumed from `source` (disk or memory)
    after a loss: exit 0, the newest complete checkpoint taken, both
    models bit-identical to the uninterrupted run, history invariants."""
    check_resumed(checks, "gan", tag, rc, text, source, seen, reference,
                  GAN_KEYS, histories, GAN_SAMPLES, GAN_CKPT_EPOCHS,
                  GAN_CKPT_EPOCHS * 10)


def check_gan_checkpoints(checks, prefix, binary, data, work, device):
    """Module docstring, 5."""
    rc, text, _, _ = run_gan_checkpointed(checks, prefix, binary, data,
                                          os.path.join(work, "ref"), device,
                                          "uninterrupted")
    reference = uninterrupted_end(checks, "gan", GAN_KEYS, rc, text)
    if reference is None:
        return
    lost = os.path.join(work, "lost")
    rc, text, seen, hist1 = run_gan_checkpointed(
        checks, prefix, binary, data, lost, device, "killed whole",
        kill=kill_group)
    checks.check(rc is not None and rc < 0, "gan (killed whole): the "
                 "launcher and every worker SIGKILLed", "exit %s" % rc)
    rc, text, _, hist2 = run_gan_checkpointed(
        checks, prefix, binary, data, lost, device, "again")
    check_gan_resumed(checks, "killed whole, the same command again", rc,
                      text, "disk", seen, reference, [hist1, hist2])

    killed = []

    def kill_workers(launcher_pid):
        killed.extend(processes.children(launcher_pid))
        for pid in killed:
            os.kill(pid, signal.SIGKILL)

    rc, text, seen, hist = run_gan_checkpointed(
        checks, prefix, binary, data, os.path.join(work, "workers"), device,
        "workers killed", extra=["--min-workers", "1", "--max-restarts", "1"],
        kill=kill_workers)
    checks.check(len(killed) == 3, "gan (workers killed): all 3 workers "
                 "SIGKILLed, concord-run lives", "children: %s" % killed)
    check_gan_resumed(checks, "workers killed, restarted by concord-run", rc,
                      text, "memory", seen, reference, [hist])


def check_gan(checks, args, prefix, binary, data, work):
    out = os.path.join(work, "gan-out")
    results = {}
    for tag, where, fault in GAN_FAULTS:
        finals = run_gan_fault(checks, prefix, binary, data, work, tag, where,
                               fault, args.device,
                               out=out if tag == "a" else None)
        if finals:
            results[tag] = finals
    ends = {tag: tuple(finals[0][k] for k in GAN_KEYS)
            for tag, finals in results.items()}
    checks.check(len(ends) == len(GAN_FAULTS) and len(set(ends.values())) == 1,
                 "gan: all %d runs end with bit-identical parameters of both "
                 "models (the killed step taken again from the same commit; "
                 "no update applied twice)" % len(GAN_FAULTS),
                 "\n".join("%s: %s" % (t, dict(zip(GAN_KEYS, e)))
                           for t, e in sorted(ends.items())))
    check_gan_checkpoints(checks, prefix, binary, data, work, args.device)
    if "a" not in results:
        return
    # Rank 0's checkpoint, as Python loads upstream's (torch.jit.load of
    # torch::save's archive).
    rank0 = next(f for f in results["a"] if f["rank"] == "0")
    import torch
    import zlib
    found = {}
    try:
        for model in ("generator", "discriminator"):
            m = torch.jit.load(os.path.join(out, model + "-checkpoint.pt"),
                               map_location="cpu")
            found[model] = "%08x" % zlib.crc32(b"".join(
                p.detach().contiguous().numpy().tobytes()
                for p in m.parameters()))
        samples = list(torch.jit.load(os.path.join(
            out, "dcgan-sample.pt"), map_location="cpu").parameters())[0]
        found["samples"] = tuple(samples.shape)
        in_range = bool(((samples >= 0) & (samples <= 1)).all())
    except (OSError, RuntimeError) as e:
        checks.fail("gan: rank 0's checkpoint loads in Python", str(e))
        return
    checks.check(found["generator"] == rank0["generator_crc"] and
                 found["discriminator"] == rank0["discriminator_crc"] and
                 found["samples"] == (10, 1, 28, 28) and in_range,
                 "gan: rank 0's --out checkpoint loads in Python with the "
                 "parameters of its final line, and 10 samples in [0, 1]",
                 "Python: %s\nrank 0: %s\nsamples in [0, 1]: %s" %
                 (found, rank0, in_range))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin-dir", help="unused: the installed tools run")
    parser.add_argument("--build-dir", required=True)
    parser.add_argument("--source-dir", required=True)
    parser.add_argument("--cmake", default="cmake")
    parser.add_argument("--example", choices=sorted(EXAMPLES),
                        default="mnist")
    parser.add_argument("--device", default="cpu",
                        help="CONCORD_DEVICE for the workers (cpu, cuda:N)")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        import torch
        index = int(args.device.partition(":")[2] or 0)
        if torch.cuda.device_count() <= index:
            print("CONCORD_TEST_SKIPPED: %s: this torch sees %d CUDA device(s)" %
                  (args.device, torch.cuda.device_count()))
            return 0
    # Debian's package, or the copy scripts/test.sh puts into the build
    # tree for the Debian 13 root (which does not install it).
    dataset = next((d for d in [DATASET, os.path.join(
        args.build_dir, "datasets", "fashion-mnist")] if os.path.isdir(d)),
        None)
    if dataset is None:
        print("CONCORD_TEST_SKIPPED: %s is missing (apt install dataset-fashion-mnist; "
              "scripts/install-deps.sh does)" % DATASET)
        return 0
    checks = fixtures.Checks()
    work = tempfile.mkdtemp(prefix="concord-examples-")
    prefix = os.path.join(work, "prefix")
    name = args.example
    try:
        r = processes.run_command([args.cmake, "--install", args.build_dir,
                                  "--prefix", prefix], timeout=120)
        if checks.check(r.returncode == 0, "cmake --install", r.describe()):
            data = os.path.join(work, "data")
            r = processes.run_command(
                [sys.executable, os.path.join(args.source_dir, "examples",
                                              "mnist", "prepare_data.py"),
                 data, "--source", dataset], timeout=120)
            ok = checks.check(r.returncode == 0, "prepare_data.py",
                              r.describe())
            binary = build(checks, args, prefix, work, name,
                           EXAMPLES[name][0]) if ok else None
            if binary:
                bad = processes.run_command([binary, "--epochs", "x"],
                                           timeout=60)
                lines = [x for x in bad.stderr.splitlines() if x.strip()]
                checks.check(bad.returncode == 2 and len(lines) == 1,
                             "%s: bad flag: one line, exit 2" % name,
                             bad.describe())
                globals()["check_" + name](checks, args, prefix, binary, data,
                                           work)
    finally:
        if args.keep:
            print("kept %s" % work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

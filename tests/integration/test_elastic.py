#!/usr/bin/python3
"""Integration test of elastic training: real multi-process runs of
concord-run + concord-train where workers die (SIGKILL), leave when their data
runs out, join mid-run or are restarted.

    /usr/bin/python3 tests/integration/test_elastic.py --bin-dir build/bin \
        [--group GROUP ...] [--case NAME ...] [--seed N] [--keep]
    /usr/bin/python3 tests/integration/test_elastic.py --list

Without --group or --case every case runs (about 2.5 minutes on 2 cores).

Every run uses a small TorchScript MLP without buffers (SmoothMLP: fixtures'
mlp-plain with tanh activations, on its data: regression, mse) and SGD with
momentum (optimizer state that joiners must receive). Workers are killed with concord-train's test hook
CONCORD_TEST_KILL="LOCAL:STEP:PHASE[,...]" (local worker LOCAL of
concord-run SIGKILLs itself when taking optimizer step STEP: before the
forward, while gradient buckets are in flight, or after optimizer.step()
before the commit), or, in the chaos group, by this script. Every step takes
at least 3 ms (CONCORD_TEST_MIN_STEP_MS), so that the job still runs when a
joiner or a restarted worker arrives.

What is checked (per case, see CASES / --list):
  * the job finishes within a bounded time (every subprocess has a timeout; on
    timeout its whole process group is killed and the case fails);
  * every worker that finished training wrote --output-per-worker
    DIR/<worker id>.pt, and all of them are bit-identical (same keys,
    torch.equal on every tensor);
  * with elastic sharding, the sample logs (--sample-log) show every sample of
    every epoch exactly once over the job's committed steps: the complete
    lines of all workers merged by STEP agree, the steps are 1..N with N the
    job's optimizer steps, and per epoch the union of the windows holds each
    index exactly once (see check_sample_logs for the one allowed exception);
  * --metrics-out (the authoritative rank's): optimizer_steps, reforms,
    world_size as the schedule implies;
  * the final model is what the committed history says it must be: a replay
    in this process (torch.optim.SGD on the same model) of every committed
    step's window over that step's world size (from the workers' logs)
    matches it to 1e-4 (check_replay: a lost or doubled step, a wrong
    divisor or optimizer state lost in a hand-over is far larger);
  * where arithmetic says so, the final model equals a fault-free run's bit
    for bit: a death before the first step (prestep), and a restart that the
    others must wait for (min_workers = W), so that every step has the
    fault-free run's window and world size (compare_to_fault_free);
  * concord-run's exit status (see Note [Exit status] in tools/launcher.h): 0
    when the job completed, also after a worker died for good (a launcher
    whose only worker died while the job went on elsewhere exits 137, that
    worker's status); the death is reported when it happens ("concord-run:
    worker I (pid P, worker id W) failed after T s: killed by signal 9
    (SIGKILL); restarting it / not restarting it").

Groups (one ctest entry each):
  kill       a rank dies in forward / backward / optimizer, no restarts,
             min_workers lower: W = 2..5.
  prestep    a rank dies at step 1 (W=3 -> 2): bit-identical to a fault-free
             run with 2 workers from the start (same data, seed, shuffle).
  fixed      --sharding fixed with uneven data (ranks leave when their data
             runs out, PyTorch's join), alone and with deaths; one case
             starts one launcher per rank against a standalone coordinator
             so that the dying, leaving and finishing ranks are chosen.
  join       a second concord-run joins a running job (standalone
             concord-coordinator): 2 -> 3 workers.
  restart    --max-restarts: the restarted worker rejoins, concord-run exits 0
             (also when it comes back only after the job finished).
  below-min  the job falls below min_workers: concord-run --standalone stops
             the survivor at once and exits non-zero, saying why.
  rendezvous-timeout
             the same against a separate coordinator: the rendezvous times
             out (3 s) and the survivor fails within a bounded time with a
             clear message. KNOWN PRODUCT BUG: the message is a bare
             DEADLINE_EXCEEDED (see case_below_min_coordinator).
  chaos      4 workers, --max-restarts 20, --min-workers 2: this script
             SIGKILLs a random live concord-train every 2-4 s (seeded) for a
             bounded time, then lets the job finish.

Prints one line per check, a summary line per case and a final
'N passed, N failed'; exits 1 on any failure.
"""

import argparse
import collections
import glob
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))

import torch  # noqa: E402

import fixtures  # noqa: E402
import history  # noqa: E402
import testlib  # noqa: E402

Checks = fixtures.Checks

# Fast failure detection: heartbeats every 200 ms, a worker silent for 2 s
# is declared failed. Collectives give up after 20 s (a hang is a failure,
# never a wait of concord-run's 5-minute default).
HEARTBEAT = ["--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "2000"]
COLLECTIVE_TIMEOUT_MS = 20000
RENDEZVOUS_TIMEOUT_MS = 20000
RUN_TIMEOUT = 100.0  # one concord-run of a schedule

SIGKILL_STATUS = 128 + signal.SIGKILL

# Every run's optimizer (check_replay repeats it).
LR = 0.05
MOMENTUM = 0.9


# --- processes ------------------------------------------------------------------

class Proc(object):
    """A subprocess in its own process group, stdout and stderr in files (so
    that they can be polled while it runs). Every Proc is killed (its whole
    group) at the end of the script whatever happens."""

    live = []
    started = []  # of the current case, for the logs of a failing one

    def __init__(self, name, cmd, log_dir, env=None, popen=subprocess.Popen):
        """`popen`: how to start it (tests/netfault: in a lab's host)."""
        self.name = name
        self.cmd = [str(c) for c in cmd]
        self.out_path = os.path.join(log_dir, name + ".stdout")
        self.err_path = os.path.join(log_dir, name + ".stderr")
        full_env = dict(os.environ)
        full_env.pop("CONCORD_TEST_KILL", None)
        full_env.setdefault("OMP_NUM_THREADS", "1")
        if env:
            full_env.update(env)
        self.env = env or {}
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = popen(self.cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                              env=full_env, start_new_session=True)
        self.pid = self.proc.pid
        self.start = time.monotonic()
        self.end = None
        self.timed_out = False
        self.leftovers = False
        Proc.live.append(self)
        Proc.started.append(self)

    def poll(self):
        rc = self.proc.poll()
        if rc is not None and self.end is None:
            self.end = time.monotonic()
        return rc

    def wait(self, timeout):
        """Waits up to timeout seconds; on timeout kills the process group
        (timed_out). Afterwards ends any leftover of the group (a worker its
        launcher left behind: noted in leftovers). Returns the exit status."""
        try:
            self.proc.wait(timeout=max(0.1, timeout))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.kill_group()
            self.proc.wait()
        if self.end is None:
            self.end = time.monotonic()
        try:
            os.killpg(self.pid, 0)
            self.leftovers = True
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self in Proc.live:
            Proc.live.remove(self)
        return self.proc.returncode

    def kill_group(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    @property
    def returncode(self):
        return self.proc.returncode

    @property
    def elapsed(self):
        return (self.end or time.monotonic()) - self.start

    def stdout(self):
        return read_text(self.out_path)

    def stderr(self):
        return read_text(self.err_path)

    def describe(self, tail=3000):
        def cut(s):
            return s if len(s) <= tail else "...(%d chars cut)...\n%s" % (len(s) - tail, s[-tail:])
        if self.timed_out:
            status = "TIMED OUT after %.1fs (process group killed)" % self.elapsed
        else:
            status = "exit status %s after %.1fs" % (self.returncode, self.elapsed)
        env = " ".join("%s=%s" % kv for kv in sorted(self.env.items()))
        return "command: %s%s\n%s\n--- stdout ---\n%s\n--- stderr ---\n%s" % (
            env + " " if env else "", " ".join(self.cmd), status, cut(self.stdout()),
            cut(self.stderr()))

    @classmethod
    def kill_all(cls):
        for p in list(cls.live):
            p.kill_group()
            try:
                p.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        cls.live = []


def read_text(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def write_token_file(path):
    token = secrets.token_hex(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path


class Coordinator(object):
    """A standalone concord-coordinator on a free loopback port."""

    def __init__(self, bins, directory):
        os.makedirs(directory, exist_ok=True)
        self.history = os.path.join(directory, "coordinator.jsonl")
        self.worker_token = write_token_file(os.path.join(directory, "worker-token"))
        self.operator_token = write_token_file(os.path.join(directory, "operator-token"))
        state = os.path.join(directory, "state")
        os.makedirs(state, exist_ok=True)
        self.proc = Proc("coordinator", [bins.coordinator, "--listen", "127.0.0.1:0",
                                         "--state-dir", state, "--history-file", self.history,
                                         "--worker-token-file", self.worker_token,
                                         "--operator-token-file", self.operator_token],
                         directory)
        self.address = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.proc.poll() is None:
            m = re.search(r"listening on (\S+)", self.proc.stderr() + self.proc.stdout())
            if m:
                self.address = m.group(1)
                break
            time.sleep(0.05)

    def stop(self):
        self.proc.kill_group()
        self.proc.wait(10)


def start_coordinator(ctx, name, rd):
    """A standalone coordinator for case `name`, or None (a failed check)."""
    coord = Coordinator(ctx.bins, os.path.join(rd.path, "coordinator"))
    rd.coordinator_history.append(coord.history)
    if not ctx.checks.check(coord.address is not None, name + ": concord-coordinator started",
                            coord.proc.describe()):
        coord.stop()
        return None
    return coord


class Bins(object):
    def __init__(self, bin_dir):
        d = os.path.abspath(bin_dir)
        self.run = os.path.join(d, "concord-run")
        self.train = os.path.join(d, "concord-train")
        self.coordinator = os.path.join(d, "concord-coordinator")

    def missing(self):
        return [b for b in (self.run, self.train, self.coordinator) if not os.access(b, os.X_OK)]


# --- one run --------------------------------------------------------------------

class SmoothMLP(torch.nn.Module):
    """fixtures' mlp-plain with tanh for its ReLU: no kinks, so that the
    rounding noise between Gloo's sums and check_replay's never flips an
    activation (with ReLU one pre-activation within ~1e-7 of zero in a few
    thousand steps, which happens in about one chaos run of five, sends the
    two apart by 1e-3)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(fixtures.MLP_IN, 32)
        self.fc2 = torch.nn.Linear(32, 32)
        self.fc3 = torch.nn.Linear(32, fixtures.MLP_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc1(x))
        x = torch.tanh(self.fc2(x))
        return self.fc3(x)


class Fixture(object):
    """A TorchScript SmoothMLP (no buffers, trains on one-sample batches) and
    the data of fixtures' mlp kinds (regression, 16 -> 4)."""

    def __init__(self, tmp, n_samples, seed=3):
        d = os.path.join(tmp, "fixture-smooth-%d-%d" % (n_samples, seed))
        self.model = os.path.join(d, "model.pt")
        self.data = os.path.join(d, "data.pt")
        self.n = n_samples
        if not os.path.isfile(self.data):
            os.makedirs(d, exist_ok=True)
            torch.manual_seed(seed)
            model = SmoothMLP()
            model.train()
            torch.jit.save(torch.jit.script(model), self.model)
            inputs, targets = fixtures.make_data("mlp-plain", n_samples, seed)
            torch.save({"inputs": inputs, "targets": targets}, self.data)


class RunDir(object):
    """Where one launch (or a job of several launchers) writes: per-worker
    outputs, sample logs, the authoritative rank's --output and metrics."""

    def __init__(self, tmp, name):
        self.path = os.path.join(tmp, name)
        self.workers = os.path.join(self.path, "workers")
        self.samples = os.path.join(self.path, "samples")
        self.logs = os.path.join(self.path, "logs")
        # concord-run --history: the workers' (and a --standalone
        # coordinator's) histories, for tests/history.py.
        self.history = os.path.join(self.path, "history")
        self.coordinator_history = []  # separate coordinators' files
        for d in (self.workers, self.samples, self.logs, self.history):
            os.makedirs(d, exist_ok=True)
        self.output = os.path.join(self.path, "final.pt")
        self.metrics = os.path.join(self.path, "metrics.json")

    def worker_outputs(self):
        return sorted(glob.glob(os.path.join(self.workers, "*.pt")))

    def finished_ids(self):
        return [os.path.basename(p)[:-3] for p in self.worker_outputs()]

    def load_metrics(self):
        try:
            with open(self.metrics) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None


# concord-train flags every case adds (--train-flag), e.g. the gpu suite's
# --device cuda:0 --backend gloo.
TRAIN_FLAGS = []


class TrainArgs(list):
    """concord-train's arguments, and the run's history directory, which
    launch_cmd gives concord-run (--history)."""

    def __init__(self, args, history_dir):
        list.__init__(self, args)
        self.history_dir = history_dir


def train_args(fx, rd, batch, epochs, sharding="elastic", shuffle_seed=None, extra=()):
    args = ["--model", fx.model, "--data", fx.data, "--loss", "mse", "--optimizer", "sgd",
            "--lr", LR, "--momentum", MOMENTUM, "--batch-size", batch, "--epochs", epochs,
            "--sharding", sharding, "--output", rd.output, "--metrics-out", rd.metrics,
            "--output-per-worker", rd.workers, "--log-interval", "5"]
    if sharding == "elastic":
        args += ["--sample-log", rd.samples]
    if shuffle_seed is not None:
        args += ["--shuffle", "--seed", shuffle_seed]
    return TrainArgs(args + list(extra) + TRAIN_FLAGS, rd.history)


def launch_cmd(bins, nproc, job, train, min_workers=None, max_workers=None, restarts=0,
               coordinator=None, token_file=None, rendezvous_ms=RENDEZVOUS_TIMEOUT_MS,
               settle_ms=None):
    cmd = [bins.run]
    if coordinator:
        cmd += ["--coordinator", coordinator, "--token-file", token_file]
    else:
        cmd += ["--standalone"]
    cmd += ["--nproc", nproc, "--job-id", job, "--max-restarts", restarts,
            "--rendezvous-timeout-ms", rendezvous_ms,
            "--collective-timeout-ms", COLLECTIVE_TIMEOUT_MS] + HEARTBEAT
    if min_workers is not None:
        cmd += ["--min-workers", min_workers]
    if max_workers is not None:
        cmd += ["--max-workers", max_workers]
    if settle_ms is not None:
        cmd += ["--settle-ms", settle_ms]
    if getattr(train, "history_dir", None):
        cmd += ["--history", train.history_dir]
    return cmd + ["--", bins.train] + [str(a) for a in train]


def kill_env(spec):
    return {"CONCORD_TEST_KILL": spec} if spec else {}


def first_ranks(stderr):
    """{local index: (rank, world)} of generation 1 from concord-run's stderr
    ('[worker I] ... joined job 'J' generation 1 as rank R of W')."""
    ranks = {}
    for m in re.finditer(r"\[worker (\d+)\] .*joined job '[^']*' generation 1 as rank (\d+) of (\d+)",
                         stderr):
        ranks[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
    return ranks


def killed_locals(stderr):
    """Local indices whose worker killed itself (CONCORD_TEST_KILL), with the step."""
    return {int(m.group(1)): int(m.group(2)) for m in re.finditer(
        r"\[worker (\d+)\] .*CONCORD_TEST_KILL: killing myself at step (\d+)", stderr)}


# --- checks ---------------------------------------------------------------------

def check_outputs_identical(checks, name, rd, expected_count=None, expected_ids=None):
    """Every --output-per-worker file is bit-identical to the others. Returns
    the first state (or None)."""
    paths = rd.worker_outputs()
    ids = rd.finished_ids()
    problems = []
    if expected_count is not None and len(paths) != expected_count:
        problems.append("%d per-worker outputs, expected %d: %s" % (len(paths), expected_count, ids))
    if expected_ids is not None:
        missing = [w for w in expected_ids if w not in ids]
        if missing:
            problems.append("no output from %s (have %s)" % (missing, ids))
    if not paths:
        checks.fail(name + ": per-worker outputs bit-identical", "no per-worker output; " +
                    "; ".join(problems))
        return None
    states = []
    for p in paths:
        try:
            states.append(fixtures.load_state(p))
        except Exception as e:  # noqa: BLE001
            problems.append("%s: torch.load failed: %s: %s" % (p, type(e).__name__, e))
    if states:
        ref = states[0]
        for p, st in zip(paths[1:], states[1:]):
            if set(st) != set(ref):
                problems.append("%s: keys %s differ from %s" % (os.path.basename(p), sorted(st),
                                                                sorted(ref)))
                continue
            for k in sorted(ref):
                if st[k].dtype != ref[k].dtype or st[k].shape != ref[k].shape \
                        or not torch.equal(st[k], ref[k]):
                    diff = float((st[k].double() - ref[k].double()).abs().max()) \
                        if st[k].shape == ref[k].shape else float("nan")
                    problems.append("%s vs %s: %s differs (max abs diff %.3e)" % (
                        os.path.basename(p), os.path.basename(paths[0]), k, diff))
    checks.check(not problems, name + ": %d per-worker outputs bit-identical" % len(paths),
                 "; ".join(problems))
    return states[0] if states else None


def parse_sample_log(path):
    """Complete lines of a sample log: [(step, epoch, (idx, ...))]. A last line
    without a newline was never committed and is ignored."""
    text = read_text(path)
    parts = text.split("\n")
    lines = []
    for raw in parts[:-1]:
        if not raw.strip():
            continue
        nums = [int(t) for t in raw.split()]
        lines.append((nums[0], nums[1], tuple(nums[2:])))
    return lines, len(parts[-1]) > 0


def check_sample_logs(checks, name, rd, n, epochs, final_step, allow_lost_commits=False):
    """Sample logs exactly-once (see the module docstring).

    A worker's complete lines are the steps it committed. Lines of the same
    step must agree, except for a 'lost commit': a worker committed a step
    that the others did not, then died, or was cut off and came back as a
    newcomer, before handing its state over, so the job took that step again
    (possibly over another world size, hence another window). Its update
    never reached the final model. A line may be one when it is the last
    line of a worker that did not finish (it may have died between its
    sample line and its history record) or when the history checker proved
    that commit lost (see Note [History checker]). Such lines are allowed only
    with allow_lost_commits (the chaos and network-fault groups) and are
    printed; the job's history is then the other lines. Returns (number of
    lost commits, the job's history {step: (epoch, window)})."""
    h_problems, h_summary, h_lost = history.check_with_lost(rd.history, rd.coordinator_history, n,
                                                            epochs, final_step)
    proven_lost = {(step, worker) for step, _, worker in h_lost}
    finished = set(rd.finished_ids())
    logs = {}
    problems = []
    for path in sorted(glob.glob(os.path.join(rd.samples, "*.samples"))):
        wid = os.path.basename(path)[:-len(".samples")]
        lines, partial = parse_sample_log(path)
        logs[wid] = lines
        steps = [s for s, _, _ in lines]
        if any(b <= a for a, b in zip(steps, steps[1:])):
            problems.append("%s: steps not increasing: %s" % (wid, steps))
        if partial and wid in finished:
            problems.append("%s finished but its sample log ends with an incomplete line" % wid)
    missing_logs = finished - set(logs)
    if missing_logs:
        problems.append("finished workers without a sample log: %s" % sorted(missing_logs))
    by_step = collections.defaultdict(list)
    for wid, lines in logs.items():
        for i, (step, epoch, idx) in enumerate(lines):
            terminal = (wid not in finished and i == len(lines) - 1) or (step, wid) in proven_lost
            by_step[step].append((wid, epoch, idx, terminal))
    canonical = {}
    lost = []
    for step in sorted(by_step):
        entries = by_step[step]
        solid = {(e, idx) for _, e, idx, t in entries if not t}
        if len(solid) > 1:
            problems.append("step %d: workers disagree on the window: %s" % (step, "; ".join(
                "%s epoch %d %d samples starting %s" % (w, e, len(idx), list(idx[:4]))
                for w, e, idx, _ in entries)))
            continue
        if solid:
            canonical[step] = next(iter(solid))
        else:
            variants = {(e, idx) for _, e, idx, _ in entries}
            if len(variants) > 1:
                problems.append("step %d: only dead workers' last lines, and they disagree: %s" % (
                    step, [w for w, _, _, _ in entries]))
                continue
            canonical[step] = next(iter(variants))
        for w, e, idx, t in entries:
            if t and (e, idx) != canonical[step]:
                lost.append((step, w))
    if lost:
        detail = "lost commit(s) (a step its worker committed alone, taken again by the job): " + \
            ", ".join("step %d of %s" % sw for sw in lost)
        if allow_lost_commits:
            print("NOTE %s: %s" % (name, detail), flush=True)
        else:
            problems.append(detail)
    steps = sorted(canonical)
    if steps != list(range(1, final_step + 1)):
        absent = sorted(set(range(1, final_step + 1)) - set(steps))
        extra = sorted(set(steps) - set(range(1, final_step + 1)))
        problems.append("committed steps are not 1..%d: missing %s%s, beyond %s" % (
            final_step, absent[:20], "..." if len(absent) > 20 else "", extra[:20]))
    problems += history.sample_problems([canonical[s] for s in steps], n, epochs)
    checks.check(not problems, name + ": sample logs exactly-once (%d logs, %d steps, %d epochs x %d)"
                 % (len(logs), len(steps), epochs, n), "; ".join(problems))
    checks.check(not h_problems, name + ": history invariants (%s)" % h_summary, "; ".join(h_problems[:20]))
    return len(lost), canonical


def check_history(checks, name, rd, n=None, epochs=None, final_step=None):
    """tests/history.py over the run's histories (see Note [History checker])."""
    problems, summary = history.check(rd.history, rd.coordinator_history, n, epochs, final_step)
    checks.check(not problems, name + ": history invariants (%s)" % summary, "; ".join(problems[:20]))


def fault_free_history(rd):
    """{step: (epoch, window)} of a fault-free run (every worker logged every
    step; the first finished worker's log)."""
    ids = rd.finished_ids()
    if not ids:
        return {}
    lines, _ = parse_sample_log(os.path.join(rd.samples, ids[0] + ".samples"))
    return {step: (epoch, idx) for step, epoch, idx in lines}


def compare_to_fault_free(checks, name, rd, history, ref, required=False):
    """When the job took exactly the steps of the fault-free run `ref` (same
    window at every step, so the same world size at every step), arithmetic
    says its final model must be the fault-free one bit for bit: rank r of W
    always takes the same samples of the window, the gradient sum runs in
    rank order over the same bucket layout, and a re-form restores the last
    commit and hands over parameters and optimizer state exactly. Otherwise
    (some step ran over fewer workers) there is nothing to compare: a note,
    or with `required` (the schedule cannot change the world size) a failure."""
    ref_history = fault_free_history(ref)
    if history != ref_history and required:
        differ = [s for s in sorted(set(history) | set(ref_history))
                  if history.get(s) != ref_history.get(s)]
        return checks.fail(name + ": every step as in the fault-free run",
                           "steps differ from step %s on" % (differ[:1],))
    if history != ref_history:
        differ = [s for s in sorted(set(history) | set(ref_history))
                  if history.get(s) != ref_history.get(s)]
        first = differ[0] if differ else None
        print("NOTE %s: the job's steps differ from the fault-free run's from step %s on "
              "(window %s vs %s samples): some steps ran over a different world size; final "
              "model not compared" % (name, first, len(history.get(first, (0, ()))[1]),
                                      len(ref_history.get(first, (0, ()))[1])), flush=True)
        return None
    problems = []
    if not os.path.isfile(ref.output):
        problems.append("the fault-free run wrote no --output")
    else:
        e = fixtures.load_state(ref.output)
        for path in ([rd.output] if os.path.isfile(rd.output) else []) + rd.worker_outputs():
            a = fixtures.load_state(path)
            bad = [k for k in e if k not in a or not torch.equal(a[k], e[k])]
            if bad or set(a) != set(e):
                problems.append("%s differs from the fault-free run in %s" % (
                    os.path.basename(path), bad or sorted(set(a) ^ set(e))))
        if not os.path.isfile(rd.output):
            problems.append("no --output")
    return checks.check(not problems, name + ": every step as in the fault-free run, so the final "
                        "model is bit-identical to it", "; ".join(problems))


def generation_worlds(texts):
    """{generation: (first step - 1, world size)} from the workers' log lines
    (concord-run's stderr): 'joined job 'J' generation 1 as rank R of W'
    starts at step 0; later generations say 'generation G: rank R of W (was
    P ranks), authoritative rank A, going on from step S' on every member
    that re-formed into them (a generation whose hand-over failed says
    nothing and took no step)."""
    gens = {}
    problems = []
    for text in texts:
        for m in re.finditer(r"joined job '[^']*' generation 1 as rank \d+ of (\d+)", text):
            gens.setdefault(1, set()).add((0, int(m.group(1))))
        for m in re.finditer(r"generation (\d+): rank \d+ of (\d+) \(was \d+ ranks\), "
                             r"authoritative rank \d+, going on from step (\d+)", text):
            gens.setdefault(int(m.group(1)), set()).add((int(m.group(3)), int(m.group(2))))
    out = {}
    for g, values in gens.items():
        if len(values) != 1:
            problems.append("generation %d: members disagree: %s" % (g, sorted(values)))
        out[g] = min(values)
    return out, problems


def replay_history(fx, history, world_at, lr=LR, momentum=MOMENTUM, start=None):
    """What the job's committed history says the final model must be: from
    the initial model, for each step in order, the window split over that
    step's W ranks as concord-train does (rank r takes the window's samples
    r, r+W, ...), each rank's mse over its samples, gradients summed over
    the ranks and divided by W (DDP's average), one SGD step (torch.optim,
    same lr and momentum). `start`: (model state_dict, optimizer
    state_dict) to go on from instead (a checkpoint's). Returns the final
    state_dict, or with `start` (state_dict, optimizer state_dict)."""
    import torch.nn.functional as F
    data = torch.load(fx.data, map_location="cpu")
    inputs, targets = data["inputs"], data["targets"]
    model = torch.jit.load(fx.model, map_location="cpu")
    model.train()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    if start is not None:
        model.load_state_dict(start[0])
        opt.load_state_dict(start[1])
    for step in sorted(history):
        window = torch.tensor(history[step][1], dtype=torch.int64)
        world = world_at(step)
        total = [torch.zeros_like(p) for p in params]
        for r in range(world):
            mine = window[r::world]
            if mine.numel() == 0:
                continue
            loss = F.mse_loss(model(inputs.index_select(0, mine)), targets.index_select(0, mine))
            for t, g in zip(total, torch.autograd.grad(loss, params)):
                t.add_(g)
        for p, t in zip(params, total):
            p.grad = t.div_(world)
        opt.step()
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return final if start is None else (final, opt.state_dict())


# The replay adds in another order than Gloo (rank order, float32): over a
# few thousand steps the models agree to ~1e-6. A step applied twice or
# lost, a wrong divisor or optimizer state lost in a hand-over moves them by
# 1e-3 and more.
REPLAY_ATOL = 1e-4


def check_replay(checks, name, rd, fx, history, texts):
    """The final model (--output and every per-worker output) equals
    replay_history of the committed history within REPLAY_ATOL, with each
    step's world size from the workers' logs (generation_worlds)."""
    gens, problems = generation_worlds(texts)
    starts = sorted((g, start, world) for g, (start, world) in gens.items())

    def world_at(step):
        # The generation that took the step: the latest one that started
        # before it (a commit lost with its worker is taken again by a later
        # generation, which then holds the job's step).
        best = None
        for g, start, world in starts:
            if start < step:
                best = world
        if best is None:
            raise ValueError("no generation before step %d in %s" % (step, starts))
        return best

    if not problems:
        try:
            expected = replay_history(fx, history, world_at)
        except ValueError as e:
            problems.append(str(e))
    worst = 0.0
    if not problems:
        for path in ([rd.output] if os.path.isfile(rd.output) else []) + rd.worker_outputs():
            actual = fixtures.load_state(path)
            for k, v in expected.items():
                if k not in actual or actual[k].shape != v.shape:
                    problems.append("%s: %s missing or of another shape" % (os.path.basename(path), k))
                    continue
                worst = max(worst, float((actual[k].double() - v.double()).abs().max()))
        if worst > REPLAY_ATOL:
            problems.append("max abs diff %.3e > %.0e (generations: %s)" % (
                worst, REPLAY_ATOL, ", ".join("g%d from step %d W=%d" % x for x in starts)))
    return checks.check(not problems, name + ": final model = replay of the committed history "
                        "(%d generations, max abs diff %.1e)" % (len(starts), worst),
                        "; ".join(problems))


def check_metrics(checks, name, rd, world_size=None, min_reforms=None, reforms=None,
                  optimizer_steps=None):
    m = rd.load_metrics()
    if not checks.check(m is not None, name + ": --metrics-out written (JSON)", rd.metrics):
        return None
    problems = []
    if world_size is not None and m.get("world_size") != world_size:
        problems.append("world_size %r, expected %d" % (m.get("world_size"), world_size))
    if reforms is not None and m.get("reforms") != reforms:
        problems.append("reforms %r, expected %d" % (m.get("reforms"), reforms))
    if min_reforms is not None and not m.get("reforms", -1) >= min_reforms:
        problems.append("reforms %r, expected >= %d" % (m.get("reforms"), min_reforms))
    if optimizer_steps is not None and m.get("optimizer_steps") != optimizer_steps:
        problems.append("optimizer_steps %r, expected %d" % (m.get("optimizer_steps"), optimizer_steps))
    checks.check(not problems, name + ": metrics (world_size %s, reforms %s, optimizer_steps %s)" % (
        m.get("world_size"), m.get("reforms"), m.get("optimizer_steps")), "; ".join(problems))
    return m


def last_step_of(rd):
    """The job's last committed step according to the finished workers' logs."""
    last = 0
    for wid in rd.finished_ids():
        lines, _ = parse_sample_log(os.path.join(rd.samples, wid + ".samples"))
        if lines:
            last = max(last, lines[-1][0])
    return last


def summary(name, proc, rd, extra=""):
    m = rd.load_metrics() or {}
    print("SUMMARY %s: exit %s in %.1fs%s, %d finished, optimizer_steps %s, reforms %s, "
          "final world %s, final loss %s%s" % (
              name, proc.returncode, proc.elapsed, " (TIMED OUT)" if proc.timed_out else "",
              len(rd.worker_outputs()), m.get("optimizer_steps"), m.get("reforms"),
              m.get("world_size"), m.get("final_loss"), (", " + extra) if extra else ""),
          flush=True)


def expect_exit(checks, name, proc, expected, timeout):
    rc = proc.wait(timeout)
    ok = not proc.timed_out and rc == expected and not proc.leftovers
    detail = "" if ok else proc.describe()
    if proc.leftovers:
        detail = "processes of its group were still running after it exited\n" + detail
    checks.check(ok, name + ": concord-run exits %d (got %s, %.1fs)" % (
        expected, "timeout" if proc.timed_out else rc, proc.elapsed), detail)
    return ok


# --- the schedules --------------------------------------------------------------

def case_kill(ctx, name, world, min_workers, kills, n=150, batch=4, epochs=3, extra=()):
    """(a) Workers die (no restarts); the others finish."""
    fx = Fixture(ctx.tmp, n)
    rd = RunDir(ctx.tmp, name)
    spec = ",".join("%d:%d:%s" % k for k in kills)
    p = Proc(name, launch_cmd(ctx.bins, world, name, train_args(fx, rd, batch, epochs, shuffle_seed=7,
                                                                 extra=extra),
                              min_workers=min_workers), rd.logs, env=kill_env(spec))
    expect_exit(ctx.checks, name, p, 0, RUN_TIMEOUT)
    died = killed_locals(p.stderr())
    ctx.checks.check(sorted(died) == sorted(k[0] for k in kills),
                     name + ": the scheduled workers died (%s)" % spec,
                     "died: %s" % died)
    survivors = world - len(kills)
    check_outputs_identical(ctx.checks, name, rd, expected_count=survivors)
    final = last_step_of(rd)
    check_metrics(ctx.checks, name, rd, world_size=survivors, min_reforms=1, optimizer_steps=final)
    _, history = check_sample_logs(ctx.checks, name, rd, n, epochs, final)
    check_replay(ctx.checks, name, rd, fx, history, [p.stderr()])
    summary(name, p, rd, "killed %s" % spec)


def case_prestep(ctx, name):
    """(b) A death before the first step: the same as 2 workers from the start."""
    n, batch, epochs = 130, 4, 3
    fx = Fixture(ctx.tmp, n)
    ref = RunDir(ctx.tmp, name + "-ref")
    rd = RunDir(ctx.tmp, name)
    p_ref = Proc(name + "-ref", launch_cmd(ctx.bins, 2, name + "-ref",
                                           train_args(fx, ref, batch, epochs, shuffle_seed=11)),
                 ref.logs)
    expect_exit(ctx.checks, name + " (fault-free W=2)", p_ref, 0, RUN_TIMEOUT)
    p = Proc(name, launch_cmd(ctx.bins, 3, name, train_args(fx, rd, batch, epochs, shuffle_seed=11),
                              min_workers=2), rd.logs, env=kill_env("2:1:forward"))
    expect_exit(ctx.checks, name + " (W=3, local 2 dies at step 1 forward)", p, 0, RUN_TIMEOUT)
    check_outputs_identical(ctx.checks, name, rd, expected_count=2)
    final = last_step_of(rd)
    m = check_metrics(ctx.checks, name, rd, world_size=2, min_reforms=1, optimizer_steps=final)
    _, history = check_sample_logs(ctx.checks, name, rd, n, epochs, final)
    check_replay(ctx.checks, name, rd, fx, history, [p.stderr()])
    m_ref = ref.load_metrics()
    problems = []
    if not (os.path.isfile(ref.output) and os.path.isfile(rd.output)):
        problems.append("--output missing: %s %s" % (os.path.isfile(ref.output),
                                                      os.path.isfile(rd.output)))
    else:
        a, e = fixtures.load_state(rd.output), fixtures.load_state(ref.output)
        problems += fixtures.compare_states(a, e, rtol=0.0, atol=0.0)
        if not problems:
            problems += ["%s not bit-identical" % k for k in e if not torch.equal(a[k], e[k])]
        # The per-worker outputs equal the reference's too.
        for path in rd.worker_outputs():
            st = fixtures.load_state(path)
            if any(not torch.equal(st[k], e[k]) for k in e):
                problems.append("%s differs from the reference" % os.path.basename(path))
    if m is None or m_ref is None:
        problems.append("metrics missing")
    else:
        for key in ("optimizer_steps", "final_loss", "world_size"):
            if m.get(key) != m_ref.get(key):
                problems.append("%s %r, fault-free W=2 %r" % (key, m.get(key), m_ref.get(key)))
    ctx.checks.check(not problems, name + ": final parameters and loss bit-identical to a "
                     "fault-free run with 2 workers", "; ".join(problems))
    summary(name + "-ref", p_ref, ref)
    summary(name, p, rd, "killed 2:1:forward")


def case_fixed(ctx, name, world, n, batch, epochs, kills=(), min_workers=None):
    """(c) --sharding fixed with uneven data: ranks whose data runs out leave;
    with kills, dead ranks' shards are dropped. The finishers (ranks with the
    longest stream among the survivors) end bit-identical."""
    fx = Fixture(ctx.tmp, n)
    rd = RunDir(ctx.tmp, name)
    spec = ",".join("%d:%d:%s" % k for k in kills)
    p = Proc(name, launch_cmd(ctx.bins, world, name,
                              train_args(fx, rd, batch, epochs, sharding="fixed"),
                              min_workers=min_workers), rd.logs, env=kill_env(spec))
    rc = p.wait(RUN_TIMEOUT)
    err = p.stderr()
    ranks = first_ranks(err)
    died = killed_locals(err)
    streams = fixtures.stream_lengths(n, world, batch, epochs)
    ok_ranks = len(ranks) == world and sorted(r for r, _ in ranks.values()) == list(range(world))
    ctx.checks.check(ok_ranks, name + ": generation 1 has ranks 0..%d" % (world - 1),
                     "ranks %s\n%s" % (ranks, p.describe()))
    if not ok_ranks:
        return
    # A scheduled death happens only if the worker still trains at that step.
    rank_of = {i: r for i, (r, _) in ranks.items()}
    expected_dead = sorted(i for i, step, _ in kills if step <= streams[rank_of[i]])
    ctx.checks.check(sorted(died) == expected_dead,
                     name + ": workers %s died as scheduled" % expected_dead,
                     "died %s; ranks %s; streams %s" % (died, rank_of, streams))
    dead_ranks = {rank_of[i] for i in died}
    alive = [r for r in range(world) if r not in dead_ranks]
    longest = max(streams[r] for r in alive)
    finishers = sorted(r for r in alive if streams[r] == longest)
    leavers = sorted(r for r in alive if streams[r] < longest)
    expected_rc = 0  # the job completed, deaths or not (see Note [Exit status])
    ok = not p.timed_out and rc == expected_rc and not p.leftovers
    ctx.checks.check(ok, name + ": concord-run exits %d (got %s, %.1fs)" % (
        expected_rc, "timeout" if p.timed_out else rc, p.elapsed), "" if ok else p.describe())
    left_msgs = len(re.findall(r"ran out of data after step \d+ and left the job", p.stdout()))
    ctx.checks.check(left_msgs == len(leavers),
                     name + ": %d rank(s) %s ran out of data and left" % (len(leavers), leavers),
                     "%d 'left the job' lines\n%s" % (left_msgs, p.describe()))
    check_outputs_identical(ctx.checks, name, rd, expected_count=len(finishers))
    check_metrics(ctx.checks, name, rd, world_size=len(finishers), optimizer_steps=longest)
    check_history(ctx.checks, name, rd)  # fixed shards: no sampler, no samples
    summary(name, p, rd, "ranks by local %s, streams %s, killed %s, finishers ranks %s" % (
        [rank_of[i] for i in range(world)], streams, spec or "none", finishers))


def case_fixed_staggered(ctx, name, world, n, batch, epochs, kills, min_workers):
    """(c) --sharding fixed with ranks chosen: W launchers (--nproc 1 each)
    against a standalone coordinator, each started once the previous one's
    worker has joined, so that launcher k's worker is rank k (ranks follow
    the first-join order). kills: {rank: (step, phase)}. Deterministic: the
    dying ranks, the leavers and the finishers are known in advance."""
    fx = Fixture(ctx.tmp, n)
    rd = RunDir(ctx.tmp, name)
    streams = fixtures.stream_lengths(n, world, batch, epochs)
    coord = start_coordinator(ctx, name, rd)
    if coord is None:
        return
    try:
        launchers = []
        for k in range(world):
            spec = "0:%d:%s" % kills[k] if k in kills else ""
            p = Proc("%s-rank%d" % (name, k), launch_cmd(
                ctx.bins, 1, name, train_args(fx, rd, batch, epochs, sharding="fixed"),
                min_workers=min_workers, max_workers=world, coordinator=coord.address,
                token_file=coord.worker_token, settle_ms=15000), rd.logs, env=kill_env(spec))
            launchers.append(p)
            needle = re.compile(r"join %s-\S*-%d-w0: joined" % (re.escape(name), p.pid))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and p.poll() is None \
                    and not needle.search(coord.proc.stderr()):
                time.sleep(0.02)
        dead = sorted(kills)
        alive = [r for r in range(world) if r not in kills]
        longest = max(streams[r] for r in alive)
        finishers = [r for r in alive if streams[r] == longest]
        leavers = [r for r in alive if streams[r] < longest]
        for k, p in enumerate(launchers):
            expected = SIGKILL_STATUS if k in kills else 0
            expect_exit(ctx.checks, "%s (rank %d)" % (name, k), p, expected, RUN_TIMEOUT)
        ranks = []
        for p in launchers:
            m = re.search(r"generation 1 as rank (\d+) of (\d+)", p.stderr())
            ranks.append(int(m.group(1)) if m else None)
        ctx.checks.check(ranks == list(range(world)), name + ": launcher k's worker is rank k",
                         "ranks %s" % ranks)
        got_leavers = [k for k, p in enumerate(launchers)
                       if re.search(r"ran out of data after step \d+ and left the job", p.stdout())]
        ctx.checks.check(got_leavers == leavers, name + ": rank(s) %s ran out of data and left"
                         % leavers, "left: %s" % got_leavers)
        got_dead = [k for k, p in enumerate(launchers) if "CONCORD_TEST_KILL: killing myself"
                    in p.stderr()]
        ctx.checks.check(got_dead == dead, name + ": rank(s) %s died as scheduled" % dead,
                         "died: %s" % got_dead)
        check_outputs_identical(ctx.checks, name, rd, expected_count=len(finishers))
        check_metrics(ctx.checks, name, rd, world_size=len(finishers), optimizer_steps=longest)
        check_history(ctx.checks, name, rd)
        print("SUMMARY %s: %.1fs, streams %s, kills %s, leavers %s, finishers %s, exits %s" % (
            name, max(p.elapsed for p in launchers), streams, kills, leavers, finishers,
            [p.returncode for p in launchers]), flush=True)
    finally:
        coord.stop()


def case_join(ctx, name):
    """(d) A second concord-run joins a running 2-worker job (max 3).

    Both launchers run with CONCORD_TEST_AGENT_LINGER_MS: their agents' node
    streams end late and slowly on gRPC's threads (see Note [Where gRPC
    objects end] in agent/node_agent_impl.h); before that note's change,
    concord-run aborted at exit under it (gRPC's "prior > 0")."""
    n, batch, epochs = 512, 4, 40
    linger = {"CONCORD_TEST_AGENT_LINGER_MS": "50"}
    fx = Fixture(ctx.tmp, n)
    rd = RunDir(ctx.tmp, name)
    coord = start_coordinator(ctx, name, rd)
    if coord is None:
        return
    try:
        common = dict(min_workers=2, max_workers=3, coordinator=coord.address,
                      token_file=coord.worker_token, settle_ms=500)
        first = Proc(name + "-first", launch_cmd(ctx.bins, 2, name,
                                                 train_args(fx, rd, batch, epochs, shuffle_seed=5),
                                                 **common), rd.logs, env=linger)
        # Wait for progress (the authoritative rank's 'step S' lines).
        started_at = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and first.poll() is None:
            steps = [int(s) for s in re.findall(r" step (\d+)(?:/\d+)? loss", first.stdout())]
            if steps and max(steps) >= 20:
                started_at = max(steps)
                break
            time.sleep(0.05)
        if not ctx.checks.check(started_at is not None, name + ": the 2-worker job makes progress",
                                first.describe()):
            first.kill_group()
            first.wait(5)
            return
        print("  %s: starting the joiner at step %d (%.1fs)" % (name, started_at, first.elapsed),
              flush=True)
        joiner = Proc(name + "-joiner", launch_cmd(ctx.bins, 1, name,
                                                   train_args(fx, rd, batch, epochs, shuffle_seed=5),
                                                   **common), rd.logs, env=linger)
        expect_exit(ctx.checks, name + " (first launcher, 2 workers)", first, 0, RUN_TIMEOUT)
        expect_exit(ctx.checks, name + " (joining launcher)", joiner, 0, 60)
        check_outputs_identical(ctx.checks, name, rd, expected_count=3)
        joined = [w for w in rd.finished_ids() if ("-%d-w0" % joiner.pid) in w]
        ctx.checks.check(len(joined) == 1, name + ": the joiner finished training",
                         "finished: %s (joiner pid %d)" % (rd.finished_ids(), joiner.pid))
        final = last_step_of(rd)
        check_metrics(ctx.checks, name, rd, world_size=3, min_reforms=1, optimizer_steps=final)
        _, history = check_sample_logs(ctx.checks, name, rd, n, epochs, final)
        check_replay(ctx.checks, name, rd, fx, history, [first.stderr(), joiner.stderr()])
        m = re.search(r"joined job '[^']*' generation (\d+) as rank (\d+) of (\d+)", joiner.stderr())
        summary(name, first, rd, "joiner exit %s in %.1fs, %s" % (
            joiner.returncode, joiner.elapsed,
            "joined generation %s as rank %s of %s" % m.groups() if m else "never joined"))
    finally:
        coord.stop()


def case_restart(ctx, name, world, min_workers, kills, restarts, n=512, batch=4, epochs=8,
                 same_history=False):
    """(e) A killed worker is restarted and rejoins; concord-run exits 0. With
    min_workers = world the others cannot go on without it: they wait in the
    rendezvous for the restarted worker, every step has the fault-free
    window, and the final model must be the fault-free one (same_history).
    Otherwise the others go on over fewer workers until it is back (the
    replay still checks the arithmetic)."""
    fx = Fixture(ctx.tmp, n)
    ref = fault_free_run(ctx, name, fx, world, batch, epochs, 9) if same_history else None
    rd = RunDir(ctx.tmp, name)
    spec = ",".join("%d:%d:%s" % k for k in kills)
    p = Proc(name, launch_cmd(ctx.bins, world, name, train_args(fx, rd, batch, epochs, shuffle_seed=9),
                              min_workers=min_workers, restarts=restarts), rd.logs,
             env=kill_env(spec))
    expect_exit(ctx.checks, name, p, 0, RUN_TIMEOUT)
    err = p.stderr()
    restarted = re.findall(r"concord-run: worker (\d+) \(pid \d+, worker id \S+\) failed after "
                           r"[\d.]+ s: (killed by signal 9 \(SIGKILL\)); restarting it", err)
    ctx.checks.check(sorted(int(i) for i, _ in restarted) == sorted(k[0] for k in kills),
                     name + ": concord-run restarted the killed worker(s) %s" % [k[0] for k in kills],
                     "restarted: %s" % restarted)
    ids = rd.finished_ids()
    rejoined = [w for w in ids if re.search(r"-w\d+-r1$", w)]
    check_outputs_identical(ctx.checks, name, rd, expected_count=world)
    ctx.checks.check(len(rejoined) == len(kills), name + ": the restarted worker(s) finished training",
                     "finished: %s" % ids)
    final = last_step_of(rd)
    check_metrics(ctx.checks, name, rd, world_size=world, min_reforms=1, optimizer_steps=final)
    _, history = check_sample_logs(ctx.checks, name, rd, n, epochs, final)
    check_replay(ctx.checks, name, rd, fx, history, [p.stderr()])
    if same_history:
        compare_to_fault_free(ctx.checks, name, rd, history, ref, required=True)
    summary(name, p, rd, "killed %s, finished %s" % (spec, [w.split("-")[-2:] for w in ids]))


def case_restart_late(ctx, name):
    """(e) A restarted worker that comes back after the job has finished: W=2,
    min 1, a short job; local 0 dies at step 6 and local 1 finishes alone
    before the restarted worker can join (on a 2-core machine it always
    does). The job succeeded, so concord-run must exit 0 (its contract: 0
    when the last run of every local worker exits 0; a restarted worker with
    nothing left to do exits 0, saying so).

    Regression test: found by this test when a dead worker began to be
    dropped as soon as its watch stream broke (c83ccd8): the restarted
    concord-train got FAILED_PRECONDITION "job ... has already succeeded"
    from Join and exited 1, so concord-run exited 1 after a successful job.
    Fixed in 77564e6."""
    fx = Fixture(ctx.tmp, 150)
    rd = RunDir(ctx.tmp, name)
    p = Proc(name, launch_cmd(ctx.bins, 2, name, train_args(fx, rd, 4, 2, shuffle_seed=9),
                              min_workers=1, restarts=1), rd.logs, env=kill_env("0:6:optimizer"))
    expect_exit(ctx.checks, name, p, 0, RUN_TIMEOUT)
    late = re.findall(r"concord-train: .*(?:nothing left to do|cannot join the job).*",
                      p.stdout() + p.stderr())
    # The path this case is for: the restarted worker came after the end.
    ctx.checks.check(bool(late) and "nothing left to do" in late[-1],
                     name + ": the restarted worker came after the job succeeded and exits 0 "
                     "saying so", late[-1][:200] if late else "it joined in time: the late "
                     "path did not run")
    check_outputs_identical(ctx.checks, name, rd)
    final = last_step_of(rd)
    _, history = check_sample_logs(ctx.checks, name, rd, 150, 2, final)
    check_replay(ctx.checks, name, rd, fx, history, [p.stderr()])
    summary(name, p, rd, "restarted worker %s" % ("came too late" if late else "joined"))


def fault_free_run(ctx, name, fx, world, batch, epochs, shuffle_seed):
    """The same job without faults (for compare_to_fault_free)."""
    ref = RunDir(ctx.tmp, name + "-fault-free")
    p = Proc(name + "-fault-free", launch_cmd(
        ctx.bins, world, name + "-fault-free",
        train_args(fx, ref, batch, epochs, shuffle_seed=shuffle_seed)), ref.logs)
    expect_exit(ctx.checks, name + " (fault-free run, W=%d)" % world, p, 0, RUN_TIMEOUT)
    return ref


def case_below_min_standalone(ctx, name):
    """(f) W=2, min 2, one dies without restarts: concord-run --standalone stops
    the survivor and exits non-zero, saying why."""
    fx = Fixture(ctx.tmp, 150)
    rd = RunDir(ctx.tmp, name)
    p = Proc(name, launch_cmd(ctx.bins, 2, name, train_args(fx, rd, 4, 50), min_workers=2,
                              rendezvous_ms=3000), rd.logs, env=kill_env("1:3:forward"))
    rc = p.wait(60)
    err = p.stderr()
    ok = not p.timed_out and rc != 0 and p.elapsed < 30 and not p.leftovers
    ctx.checks.check(ok, name + ": concord-run exits non-zero within 30 s (%s, %.1fs)" % (
        "timeout" if p.timed_out else rc, p.elapsed), p.describe())
    ctx.checks.check("fewer than --min-workers 2" in err,
                     name + ": concord-run says the job fell below --min-workers", p.describe())
    ctx.checks.check(not rd.worker_outputs() and not os.path.exists(rd.output),
                     name + ": no worker wrote a final output", "%s" % rd.finished_ids())
    summary(name, p, rd)


def case_below_min_coordinator(ctx, name):
    """(f) The same against a separate coordinator: concord-run leaves the
    decision to it, the rendezvous times out (3 s), the survivor fails with
    the coordinator's reason (rendezvous timeout, min_workers)."""
    fx = Fixture(ctx.tmp, 150)
    rd = RunDir(ctx.tmp, name)
    coord = start_coordinator(ctx, name, rd)
    if coord is None:
        return
    try:
        p = Proc(name, launch_cmd(ctx.bins, 2, name, train_args(fx, rd, 4, 50), min_workers=2,
                                  coordinator=coord.address, token_file=coord.worker_token,
                                  rendezvous_ms=3000), rd.logs, env=kill_env("1:3:forward"))
        rc = p.wait(60)
        err = p.stderr()
        ok = not p.timed_out and rc != 0 and p.elapsed < 30 and not p.leftovers
        ctx.checks.check(ok, name + ": concord-run exits non-zero within 30 s (%s, %.1fs)" % (
            "timeout" if p.timed_out else rc, p.elapsed), p.describe())
        # KNOWN PRODUCT BUG (found by this test): the survivor's Join RPC
        # has a gRPC deadline equal to the rendezvous timeout, counted from
        # its own re-join; the coordinator fails the job at the same timeout
        # but only on its next tick, so the client's deadline nearly always
        # fires first and the survivor exits with a bare
        # "concord-train: DEADLINE_EXCEEDED: Deadline Exceeded" (and the
        # coordinator then records "rendezvous timed out ... with 0
        # worker(s) waiting"). A clear message names the rendezvous timeout
        # or min_workers (the coordinator's reason), or says that no
        # generation formed within the timeout (JoinAndConnect's own
        # message).
        survivor = [line for line in err.splitlines() if line.startswith("[worker 0]")]
        said = [line for line in survivor if "concord-train:" in line and (
            "rendezvous" in line or "min_workers" in line or "formed within" in line)]
        ctx.checks.check(bool(said), name + ": the survivor fails with a clear message (rendezvous "
                         "timeout / min_workers)", p.describe())
        if said:
            print("  %s: %s" % (name, said[-1][:300]), flush=True)
        ctx.checks.check(not rd.worker_outputs(), name + ": no worker wrote a final output",
                         "%s" % rd.finished_ids())
        summary(name, p, rd)
    finally:
        coord.stop()


# --- chaos ----------------------------------------------------------------------

def live_trainers(launcher_pid):
    """{pid: worker id} of the running concord-train processes that concord-run
    started (its children, or their descendants when the program is a
    wrapper script: the processes whose executable is concord-train)."""
    out = {}
    descendants = []
    todo = fixtures.children(launcher_pid)
    while todo:
        pid = todo.pop()
        descendants.append(pid)
        todo += fixtures.children(pid)
    for kid in descendants:
        try:
            if os.path.basename(os.readlink("/proc/%d/exe" % kid)) != "concord-train":
                continue
            with open("/proc/%d/stat" % kid) as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
            with open("/proc/%d/environ" % kid, "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            out[kid] = env.get(b"CONCORD_WORKER_ID", b"?").decode()
        except OSError:
            pass
    return out


def job_progress(rd):
    """(max step, its epoch) over the sample logs' complete lines (cheap: the
    files' tails)."""
    best = (0, 0)
    for path in glob.glob(os.path.join(rd.samples, "*.samples")):
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 4096))
                tail = f.read().decode(errors="replace")
        except OSError:
            continue
        for line in tail.split("\n")[:-1][-3:]:
            parts = line.split()
            if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
                best = max(best, (int(parts[0]), int(parts[1])))
    return best


def case_chaos(ctx, name, seed):
    """4 workers, --max-restarts 20, --min-workers 2: SIGKILL a random live
    concord-train every 2-4 s for up to 18 s (stopping earlier once the job
    is past 80% of its epochs, so that no worker is killed while the job
    finishes), then let it finish. Besides the common checks, the final
    model must be the replay of the committed history (check_replay)."""
    n, batch, epochs, world = 512, 4, 100, 4
    fx = Fixture(ctx.tmp, n)
    rd = RunDir(ctx.tmp, name)
    rng = random.Random(seed)
    print("  %s: seed %d" % (name, seed), flush=True)
    p = Proc(name, launch_cmd(ctx.bins, world, name, train_args(fx, rd, batch, epochs, shuffle_seed=13),
                              min_workers=2, restarts=20), rd.logs)
    # Let the first generation form and train a little.
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and p.poll() is None and job_progress(rd)[0] < 10:
        time.sleep(0.05)
    kills = []
    chaos_start = time.monotonic()
    next_kill = chaos_start + rng.uniform(1.0, 2.0)
    while p.poll() is None and time.monotonic() - chaos_start < 18.0:
        step, epoch = job_progress(rd)
        if epoch >= 0.8 * epochs or rd.worker_outputs():
            print("  %s: stop killing at epoch %d (step %d)" % (name, epoch, step), flush=True)
            break
        now = time.monotonic()
        if now < next_kill:
            time.sleep(min(0.05, next_kill - now))
            continue
        live = live_trainers(p.pid)
        if live:
            victim = rng.choice(sorted(live))
            try:
                os.kill(victim, signal.SIGKILL)
                kills.append((now - p.start, victim, live[victim], step, epoch))
                print("  %s: t=%5.1fs SIGKILL pid %d (%s) at job step %d epoch %d, %d live" % (
                    name, now - p.start, victim, live[victim], step, epoch, len(live)), flush=True)
            except ProcessLookupError:
                pass
        next_kill = now + rng.uniform(2.0, 4.0)
    rc = p.wait(max(10.0, 200.0 - p.elapsed))
    ok = not p.timed_out and rc == 0 and not p.leftovers
    ctx.checks.check(ok, name + ": concord-run exits 0 after %d kills (got %s, %.1fs)" % (
        len(kills), "timeout" if p.timed_out else rc, p.elapsed), "" if ok else p.describe(6000))
    ctx.checks.check(len(kills) >= 3, name + ": at least 3 workers killed (%d)" % len(kills),
                     "the job ended too early or no worker was found")
    restarted = len(re.findall(r"failed after [\d.]+ s: killed by signal 9 \(SIGKILL\); "
                               r"restarting it", p.stderr()))
    ctx.checks.check(restarted == len(kills), name + ": concord-run restarted every killed worker "
                     "(%d)" % restarted, "kills %d, restarts %d" % (len(kills), restarted))
    check_outputs_identical(ctx.checks, name, rd, expected_count=world)
    final = last_step_of(rd)
    m = check_metrics(ctx.checks, name, rd, min_reforms=1, optimizer_steps=final)
    lost, history = check_sample_logs(ctx.checks, name, rd, n, epochs, final,
                                      allow_lost_commits=True)
    check_replay(ctx.checks, name, rd, fx, history, [p.stderr()])
    summary(name, p, rd, "%d kills, %d lost commits, reforms %s" % (
        len(kills), lost, m and m.get("reforms")))


# --- registry -------------------------------------------------------------------

def _cases():
    c = collections.OrderedDict()
    # (a): W 2..5, each phase, no restarts.
    c["kill-w3-forward"] = ("kill", lambda ctx: case_kill(ctx, "kill-w3-forward", 3, 2,
                                                          [(1, 4, "forward")]))
    c["kill-w4-backward"] = ("kill", lambda ctx: case_kill(
        ctx, "kill-w4-backward", 4, 2, [(2, 6, "backward")],
        # Several buckets after the first-iteration rebuild: some are in
        # flight when the worker dies.
        extra=["--bucket-cap-mb", "0.002"]))
    c["kill-w5-optimizer"] = ("kill", lambda ctx: case_kill(ctx, "kill-w5-optimizer", 5, 3,
                                                            [(0, 3, "optimizer")]))
    c["kill-w2-backward"] = ("kill", lambda ctx: case_kill(ctx, "kill-w2-backward", 2, 1,
                                                           [(0, 5, "backward")]))
    c["kill-w5-two"] = ("kill", lambda ctx: case_kill(ctx, "kill-w5-two", 5, 2,
                                                      [(1, 3, "forward"), (3, 8, "optimizer")]))
    # (b)
    c["prestep-w3"] = ("prestep", lambda ctx: case_prestep(ctx, "prestep-w3"))
    # (c): 98 = 33 + 33 + 32 samples: ranks 0, 1 take 2 batches of 32 per
    # epoch (the second of 1 sample), rank 2 one; 66 = 17+17+16+16 in batches
    # of 8; 84 = 4 x 17 + 16 in batches of 16.
    c["fixed-w3"] = ("fixed", lambda ctx: case_fixed(ctx, "fixed-w3", 3, 98, 32, 2))
    c["fixed-w4-death"] = ("fixed", lambda ctx: case_fixed(ctx, "fixed-w4-death", 4, 66, 8, 2,
                                                           kills=[(3, 2, "backward")],
                                                           min_workers=2))
    # Local 2 dies at step 2 (all ranks train); local 0 at step 5, after the
    # short rank left at its end of data (unless local 0 is that rank).
    c["fixed-w5-deaths"] = ("fixed", lambda ctx: case_fixed(
        ctx, "fixed-w5-deaths", 5, 84, 16, 3, kills=[(2, 2, "optimizer"), (0, 5, "forward")],
        min_workers=2))
    # Deterministic ranks: 84 = 4 x 17 + 16 in batches of 16 over 3 epochs,
    # streams [6, 6, 6, 6, 3]: rank 3 dies at step 2 (optimizer), rank 4
    # leaves after step 3 (its data ran out), rank 1 dies at step 5 (forward),
    # ranks 0 and 2 finish.
    c["fixed-w5-staggered"] = ("fixed", lambda ctx: case_fixed_staggered(
        ctx, "fixed-w5-staggered", 5, 84, 16, 3,
        kills={3: (2, "optimizer"), 1: (5, "forward")}, min_workers=2))
    # (d)
    c["join-w2-to-3"] = ("join", lambda ctx: case_join(ctx, "join-w2-to-3"))
    # (e)
    c["restart-w3-backward"] = ("restart", lambda ctx: case_restart(
        ctx, "restart-w3-backward", 3, 2, [(1, 10, "backward")], restarts=2, epochs=12))
    c["restart-w2-min2-optimizer"] = ("restart", lambda ctx: case_restart(
        ctx, "restart-w2-min2-optimizer", 2, 2, [(0, 6, "optimizer")], restarts=1,
        same_history=True))
    c["restart-late-w2"] = ("restart", lambda ctx: case_restart_late(ctx, "restart-late-w2"))
    # (f)
    c["below-min-standalone"] = ("below-min", lambda ctx: case_below_min_standalone(
        ctx, "below-min-standalone"))
    c["below-min-coordinator"] = ("rendezvous-timeout", lambda ctx: case_below_min_coordinator(
        ctx, "below-min-coordinator"))
    # chaos
    c["chaos-w4"] = ("chaos", lambda ctx: case_chaos(ctx, "chaos-w4", ctx.seed))
    return c


CASES = _cases()
GROUPS = sorted(set(g for g, _ in CASES.values()))


class Context(object):
    def __init__(self, bins, checks, tmp, seed):
        self.bins = bins
        self.checks = checks
        self.tmp = tmp
        self.seed = seed


def run_cases(ctx, cases, keep):
    """Runs each (name, fn(ctx)) in turn: a case that raises fails, every
    process it started is killed after it, a failing case's logs are
    printed; ctx.tmp is removed at the end unless `keep`."""
    checks = ctx.checks
    start = time.monotonic()
    try:
        for name, fn in cases:
            t0 = time.monotonic()
            failed_before = checks.failed
            Proc.started = []
            print("=== %s" % name, flush=True)
            try:
                fn(ctx)
            except Exception as e:  # noqa: BLE001 - an unexpected error is a failure
                import traceback
                traceback.print_exc()
                checks.fail(name + ": ran to completion", "%s: %s" % (type(e).__name__, e))
            finally:
                Proc.kill_all()
            if checks.failed > failed_before:
                for p in Proc.started:
                    print("--- logs of %s (case %s failed) ---\n%s" % (p.name, name, p.describe(6000)),
                          flush=True)
            print("=== %s: %.1fs" % (name, time.monotonic() - t0), flush=True)
    finally:
        Proc.kill_all()
        print("total %.1fs" % (time.monotonic() - start), flush=True)
        if keep:
            print("kept %s" % ctx.tmp)
        else:
            shutil.rmtree(ctx.tmp, ignore_errors=True)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir")
    p.add_argument("--group", action="append", default=[], choices=GROUPS)
    p.add_argument("--case", action="append", default=[], choices=list(CASES))
    p.add_argument("--seed", type=int, default=20240,
                   help="chaos: the random seed of the kill schedule")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--train-flag", action="append", default=[],
                   help="a concord-train flag every case adds (repeatable)")
    p.add_argument("--require-cuda", action="store_true",
                   help="print 'CONCORD_TEST_SKIPPED: no CUDA device' and exit 0 without one (gpu suite)")
    args = p.parse_args()
    if not args.list and not args.bin_dir:
        p.error("--bin-dir is required")
    return args


def main():
    args = parse_args()
    if args.list:
        for name, (group, _) in CASES.items():
            print("%-18s %s" % (group, name))
        return 0
    if args.require_cuda and testlib.no_cuda_reason():
        print(testlib.no_cuda_reason())
        return 0
    TRAIN_FLAGS.extend(args.train_flag)
    # Steps of at least 3 ms (concord-train's CONCORD_TEST_MIN_STEP_MS, passed
    # on by concord-run): a joiner or a restarted worker needs a job that is
    # still running when it arrives, whatever the transport's speed (these
    # models' steps take ~1 ms through shared memory on one host).
    os.environ.setdefault("CONCORD_TEST_MIN_STEP_MS", "3")
    selected = [c for c, (g, _) in CASES.items() if c in args.case or g in args.group]
    if not args.case and not args.group:
        selected = list(CASES)
    checks = Checks()
    bins = Bins(args.bin_dir)
    if bins.missing():
        checks.fail("concord binaries present", "not found or not executable: %s" % bins.missing())
        return checks.finish()
    tmp = tempfile.mkdtemp(prefix="concord_elastic_")
    ctx = Context(bins, checks, tmp, args.seed)
    run_cases(ctx, [(name, CASES[name][1]) for name in selected], args.keep)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""The harness of the elastic integration tests (test_elastic.py, and the
checkpoint, status and coordinator fail-over tests that reuse it): processes
with timeouts and logs (Proc), a standalone coordinator, the binaries, the
training fixture and its run directory, the command lines of concord-run and
concord-train, and the checks of a finished job (identical outputs, sample
logs, metrics, a replay of the committed history, a fault-free comparison);
run_cases runs a list of cases with them.
"""

import collections
import glob
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))

import torch  # noqa: E402

import fixtures  # noqa: E402
import history  # noqa: E402
import testlib  # noqa: E402,F401 - the tests importing this use te.testlib

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


# --- running cases ---------------------------------------------------------------

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

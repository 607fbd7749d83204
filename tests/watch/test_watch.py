#!/usr/bin/python3
"""Progress lines and timelines of concord-train / concord-run (label watch).

    /usr/bin/python3 tests/watch/test_watch.py --bin-dir build/bin [--case C] [--keep]

Cases (all by default), each with real processes on loopback:

  progress   `concord-run --standalone --nproc 2 -- concord-train
             --log-interval 5` with stdout a pipe: plain lines 'epoch E/N step
             S/T loss L samples/s X generation G world W' every 5 steps, T the
             job's step count (= the done line's), epoch, generation 1 and
             world 2 right; then the same job with worker 1 SIGKILLed at step
             12 (--min-workers 1): after the re-form the lines say generation
             2, world 1, and T grows to the one-worker count, which is again
             the done line's.
  tty        the killed job with stdout and stderr on a pseudo-terminal: the
             bar is redrawn in place ('\\r', fewer screen lines than frames,
             as a terminal shows it), ends at the last step, and no log line
             shares a screen line with a bar.
  trace      `concord-run --trace FILE` over a 2-worker job (several buckets,
             --message-size): FILE parses as JSON; every event has ph, ts, pid,
             tid, name; X durations are >= 0 and nest per track; exactly one
             process track per rank (pids 0 and 1, named 'rank R'); forward,
             backward, optimizer and allreduce events for every step on every
             rank; per step and rank one allreduce per bucket (the bucket count
             of --metrics-out), each starting inside that step's backward.
  hook       the same with --comm-hook fp16: one allreduce per bucket and step,
             marked as a hook's.
  kill       the trace job with worker 1 SIGKILLed in the middle of a backward
             (buckets in flight): the merged FILE still parses, holds rank
             1's steps up to the kill and none after it, a 're-form' span around a
             'generation 2' instant with world size 1, and the survivor's
             steps to the end.
  errors     bad --trace values: exit 2 with one line, no job.
  zero       --optimizer adam --zero with --trace: at 4 workers every step
             has a zero copy, update and broadcast span on every rank and a
             zero mirror on the ranks that mirror; at 2, plain and
             overlapped, a zero update and mirror in every step, a zero
             copy in the first update only and no zero broadcast.

Prints one line per check and 'N passed, N failed'; exits 1 on a failure.
"""

import argparse
import json
import math
import os
import pty
import re
import select
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

RUN_TIMEOUT = 120.0
SAMPLES, BATCH, EPOCHS, INTERVAL = 160, 4, 2, 5
KILL_STEP = 12
LINE = re.compile(r"epoch (\d+)/(\d+) step (\d+)/(\d+) loss (\S+) samples/s (\S+) "
                  r"generation (\d+) world (\d+)")
DONE = re.compile(r"concord-train: done: (\d+) steps in .* generation (\d+), world size (\d+)")


def steps_to_epoch_end(n, position, world, batch):
    """concord-train's elastic windows (no gradient accumulation)."""
    steps = 0
    while position < n:
        remaining = n - position
        take = min(world * batch, remaining)
        if remaining - take < world:
            take = remaining
        position += take
        steps += 1
    return steps


class Job(object):
    def __init__(self, args, tmp):
        self.bins = os.path.abspath(args.bin_dir)
        self.run = os.path.join(self.bins, "concord-run")
        self.train = os.path.join(self.bins, "concord-train")
        self.tmp = tmp
        self.model, self.data = fixtures.make_fixture(os.path.join(tmp, "mlp"), "mlp", SAMPLES, 3)

    def cmd(self, nproc=2, min_workers=None, run_extra=(), train_extra=()):
        c = [self.run, "--standalone", "--nproc", str(nproc),
             "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "3000"]
        if min_workers is not None:
            c += ["--min-workers", str(min_workers)]
        c += list(run_extra)
        c += ["--", self.train, "--model", self.model, "--data", self.data, "--loss", "mse",
              "--lr", "0.01", "--batch-size", str(BATCH), "--epochs", str(EPOCHS),
              "--log-interval", str(INTERVAL)]
        return c + list(train_extra)


KILL_ENV = {"CONCORD_TEST_KILL": "1:%d:forward" % KILL_STEP}


def parse_lines(text):
    return [tuple(m.groups()) for m in LINE.finditer(text)]


def check_lines(checks, name, r, killed):
    """The progress lines of a finished job (see the module doc)."""
    lines = [(int(e), int(n), int(s), int(t), float(l), float(x), int(g), int(w))
             for e, n, s, t, l, x, g, w in parse_lines(r.stdout)]
    done = DONE.search(r.stdout)
    problems = []
    if not done:
        problems.append("no done line")
    if not lines:
        problems.append("no progress line")
    if problems:
        return checks.fail(name, "; ".join(problems) + "\n" + r.describe())
    final_steps = int(done.group(1))
    steps = [s for _, _, s, _, _, _, _, _ in lines]
    per_epoch2 = steps_to_epoch_end(SAMPLES, 0, 2, BATCH)
    if steps != list(range(INTERVAL, final_steps + 1, INTERVAL)):
        problems.append("steps %s, expected every %d up to %d" % (steps, INTERVAL, final_steps))
    for e, n, s, t, loss, sps, g, w in lines:
        where = "line at step %d" % s
        if n != EPOCHS:
            problems.append("%s: %d epochs" % (where, n))
        if not (math.isfinite(loss) and sps > 0):
            problems.append("%s: loss %s samples/s %s" % (where, loss, sps))
        if not killed or s < KILL_STEP:
            if (g, w) != (1, 2):
                problems.append("%s: generation %d world %d, expected 1 and 2" % (where, g, w))
            if t != EPOCHS * per_epoch2:
                problems.append("%s: total %d, expected %d" % (where, t, EPOCHS * per_epoch2))
            want_epoch = 1 + (s - 1) // per_epoch2
            if e != want_epoch:
                problems.append("%s: epoch %d, expected %d" % (where, e, want_epoch))
        elif g >= 2:
            if w != 1:
                problems.append("%s: world %d after the re-form" % (where, w))
            if t != final_steps:
                problems.append("%s: total %d, the job took %d" % (where, t, final_steps))
    last = lines[-1]
    if killed:
        if not any(g >= 2 for *_, g, w in lines):
            problems.append("no line from a generation after the kill")
        if int(done.group(3)) != 1 or final_steps <= EPOCHS * per_epoch2:
            problems.append("done line: %s (expected world 1, more than %d steps)"
                            % (done.group(0), EPOCHS * per_epoch2))
    elif final_steps != EPOCHS * per_epoch2 or last[3] != final_steps:
        problems.append("the job took %d steps, lines said %d" % (final_steps, last[3]))
    detail = "%d lines, steps %d..%d of %d, generations %s" % (
        len(lines), steps[0], steps[-1], final_steps, sorted(set(l[6] for l in lines)))
    if problems:
        return checks.fail(name, "; ".join(problems[:8]) + "\n" + r.describe())
    return checks.ok(name, detail)


def case_progress(checks, job):
    r = processes.run_command(job.cmd(), timeout=RUN_TIMEOUT)
    if checks.check(r.returncode == 0, "progress: a 2-worker job succeeds", r.describe()):
        check_lines(checks, "progress: plain lines every --log-interval steps", r, killed=False)
    r = processes.run_command(job.cmd(min_workers=1), timeout=RUN_TIMEOUT, env=KILL_ENV)
    # The job completed without the killed worker: exit 0 (see Note
    # [Exit status] in tools/launcher.h).
    if checks.check(r.returncode == 0 and not r.timed_out,
                    "progress: the job goes on without the killed worker", r.describe()):
        check_lines(checks, "progress: generation, world size and total follow the re-form",
                    r, killed=True)


def run_on_pty(cmd, env, timeout):
    """Runs cmd with stdout and stderr on a new pseudo-terminal; returns
    (exit status, everything written to the terminal)."""
    master, slave = pty.openpty()
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            env=full_env, start_new_session=True)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            continue
    timed_out = time.monotonic() >= deadline
    if timed_out:
        os.killpg(proc.pid, signal.SIGKILL)
    status = proc.wait()
    os.close(master)
    return (None if timed_out else status), b"".join(chunks).decode("utf-8", "replace")


def screen(raw):
    """What a terminal shows for raw output: '\\r' goes back to the line's
    start, '\\n' to the next line (the pty's onlcr makes it '\\r\\n'),
    ESC[K erases to the end of the line, other escape sequences (colours)
    draw nothing."""
    lines, cur, col = [], [], 0
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\x1b":
            m = re.match(r"\x1b\[([0-9;]*)([A-Za-z])", raw[i:])
            if m:
                if m.group(2) == "K":
                    del cur[col:]
                i += len(m.group(0))
                continue
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(cur))
            cur, col = [], 0
        else:
            if col < len(cur):
                cur[col] = ch
            else:
                cur.append(ch)
            col += 1
        i += 1
    lines.append("".join(cur))
    return lines


BAR = re.compile(r"\[[#.]{24}\] +\d+% " + LINE.pattern)
# A screen line that is a bar alone, behind concord-run's prefix (see Note
# [Worker output] in tools/launcher.h).
BAR_LINE = re.compile(r"(?:\[worker \d+\] )?" + BAR.pattern)


def case_tty(checks, job):
    status, raw = run_on_pty(job.cmd(min_workers=1), KILL_ENV, RUN_TIMEOUT)
    frames = BAR.findall(raw)
    shown = screen(raw)
    bar_lines = [l for l in shown if BAR.search(l)]
    log_lines = [l for l in shown if ("[worker " in l or "concord-train:" in l)
                 and not BAR_LINE.fullmatch(l.strip())]
    detail = "exit %s, %d frames drawn, %d screen lines with a bar\n--- screen ---\n%s" % (
        status, len(frames), len(bar_lines), "\n".join(shown[-60:]))
    checks.check(status == 0, "tty: the job finishes", detail)
    # concord-run gives the worker a pseudo-terminal and redraws its bar in
    # place: back to the line's start, erase, prefix, frame.
    checks.check(len(frames) >= 6 and re.search(r"\r\x1b\[K\[worker \d+\] \[", raw),
                 "tty: a bar drawn with carriage returns", detail)
    checks.check(0 < len(bar_lines) < len(frames),
                 "tty: the bar is redrawn in place (%d frames on %d screen lines)"
                 % (len(frames), len(bar_lines)), detail)
    checks.check(frames and frames[-1][2] == frames[-1][3] and "100%" in raw,
                 "tty: the last frame shows the last step (step T/T, 100%)", detail)
    mixed = [l for l in shown if BAR.search(l) and not BAR_LINE.fullmatch(l.strip())]
    checks.check(not mixed and log_lines, "tty: log lines never share a line with the bar",
                 "mixed: %s\n%s" % (mixed[:3], detail))
    checks.check(not LINE.search("\n".join(l for l in shown if not BAR.search(l))),
                 "tty: no plain progress lines on a terminal", detail)


def load_trace(path):
    with open(path) as f:
        return json.load(f)


def check_trace_basics(checks, name, events):
    """Fields, durations and nesting per track; returns the X events."""
    problems = []
    if not isinstance(events, list):
        checks.fail(name + ": a JSON array", type(events).__name__)
        return []
    for e in events:
        missing = [k for k in ("ph", "ts", "pid", "tid", "name") if k not in e]
        if missing:
            problems.append("%s lacks %s" % (json.dumps(e)[:200], missing))
        if e.get("ph") == "X" and not (isinstance(e.get("dur"), int) and e["dur"] >= 0):
            problems.append("bad dur: %s" % json.dumps(e)[:200])
        if e.get("ph") in ("B", "E"):
            problems.append("unexpected B/E: %s" % json.dumps(e)[:200])
    spans = [e for e in events if e.get("ph") == "X" and
             all(k in e for k in ("ts", "pid", "tid", "name", "dur"))]
    tracks = {}
    for e in spans:
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for track, evs in tracks.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack and e["ts"] + e["dur"] > stack[-1]["ts"] + stack[-1]["dur"]:
                problems.append("track %s: %s [%d, +%d] overlaps %s [%d, +%d] without nesting" % (
                    track, e["name"], e["ts"], e["dur"], stack[-1]["name"], stack[-1]["ts"],
                    stack[-1]["dur"]))
                break
            stack.append(e)
    checks.check(not problems and spans,
                 name + ": valid trace events (fields, durations >= 0, nesting per track; "
                 "%d events, %d tracks)" % (len(events), len(tracks)), "; ".join(problems[:6]))
    return spans


def steps_by_rank(spans):
    """{pid: {step: {name: [events]}}}."""
    out = {}
    for e in spans:
        step = e.get("args", {}).get("step")
        out.setdefault(e["pid"], {}).setdefault(step, {}).setdefault(e["name"], []).append(e)
    return out


def case_trace(checks, job):
    trace = os.path.join(job.tmp, "trace.json")
    metrics = os.path.join(job.tmp, "metrics.json")
    r = processes.run_command(job.cmd(run_extra=["--trace", trace],
                                     train_extra=["--message-size", "600",
                                                  "--metrics-out", metrics]),
                             timeout=RUN_TIMEOUT)
    if not checks.check(r.returncode == 0 and os.path.exists(trace) and os.path.exists(metrics),
                        "trace: a 2-worker job with --trace succeeds", r.describe()):
        return
    checks.check("wrote the timeline of 2 worker run(s)" in r.stderr,
                 "trace: concord-run reports the merge", r.stderr[-2000:])
    checks.check(not [p for p in os.listdir(job.tmp) if p.startswith("trace.json.parts")],
                 "trace: the workers' part files are removed", str(os.listdir(job.tmp)))
    try:
        events = load_trace(trace)
    except ValueError as e:
        checks.fail("trace: the file parses as JSON", str(e))
        return
    spans = check_trace_basics(checks, "trace", events)
    m = json.load(open(metrics))
    steps, buckets = m["optimizer_steps"], len(m["bucket_bytes"])
    pids = sorted(set(e["pid"] for e in events if e["ph"] != "M"))
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    thread_named = set((e["pid"], e["tid"]) for e in events
                       if e["ph"] == "M" and e["name"] == "thread_name")
    unnamed = sorted(set((e["pid"], e["tid"]) for e in spans) - thread_named)
    checks.check(pids == [0, 1] and names == {0: "rank 0", 1: "rank 1"} and not unnamed,
                 "trace: exactly one process track per rank, named, threads named",
                 "pids %s names %s unnamed threads %s" % (pids, names, unnamed))
    by = steps_by_rank(spans)
    problems = []
    for pid in (0, 1):
        for step in range(1, steps + 1):
            got = by.get(pid, {}).get(step, {})
            for want in ("step", "forward", "backward", "wait for buckets", "optimizer",
                         "allreduce"):
                if not got.get(want):
                    problems.append("rank %d step %d: no %s" % (pid, step, want))
            reduces = got.get("allreduce", [])
            if reduces:
                n = reduces[0]["args"]["buckets"]
                if sorted(a["args"]["bucket"] for a in reduces) != list(range(n)):
                    problems.append("rank %d step %d: buckets %s of %d" % (
                        pid, step, sorted(a["args"]["bucket"] for a in reduces), n))
                if step == steps and n != buckets:
                    problems.append("rank %d last step: %d buckets, metrics say %d" % (
                        pid, n, buckets))
                bw = (got.get("backward") or [None])[0]
                for a in reduces:
                    if bw and not (bw["ts"] <= a["ts"] <= bw["ts"] + bw["dur"]):
                        problems.append("rank %d step %d: bucket %d launched outside backward" %
                                        (pid, step, a["args"]["bucket"]))
                    if a["tid"] != 1 + a["args"]["bucket"]:
                        problems.append("bucket %d on tid %d" % (a["args"]["bucket"], a["tid"]))
        extra = sorted(s for s in by.get(pid, {}) if s is not None and not 1 <= s <= steps)
        if extra:
            problems.append("rank %d: events of steps %s beyond the %d taken" % (pid, extra, steps))
    checks.check(not problems and buckets > 1,
                 "trace: forward/backward/optimizer and one allreduce per bucket (%d buckets) in "
                 "each of the %d steps on both ranks" % (buckets, steps), "; ".join(problems[:8]))
    gens = [e for e in events if e["ph"] == "i" and e["name"] == "generation 1"]
    checks.check(sorted(e["pid"] for e in gens) == [0, 1] and
                 all(e["args"]["world_size"] == 2 for e in gens),
                 "trace: generation 1 marked on both ranks", json.dumps(gens)[:500])


def case_hook(checks, job):
    """A communication hook's buckets are traced too (until the final
    callback's wait for them ends)."""
    trace = os.path.join(job.tmp, "hook.json")
    r = processes.run_command(job.cmd(run_extra=["--trace", trace],
                                     train_extra=["--message-size", "600",
                                                  "--comm-hook", "fp16"]),
                             timeout=RUN_TIMEOUT)
    if not checks.check(r.returncode == 0 and os.path.exists(trace),
                        "hook: a 2-worker job with --comm-hook fp16 and --trace succeeds",
                        r.describe()):
        return
    spans = check_trace_basics(checks, "hook", load_trace(trace))
    by = steps_by_rank(spans)
    done = DONE.search(r.stdout)
    steps = int(done.group(1)) if done else 0
    problems = []
    for pid in (0, 1):
        for step in range(1, steps + 1):
            reduces = by.get(pid, {}).get(step, {}).get("allreduce", [])
            n = reduces[0]["args"]["buckets"] if reduces else -1
            if sorted(a["args"]["bucket"] for a in reduces) != list(range(n)) or \
                    not all(a["args"].get("hook") == 1 for a in reduces):
                problems.append("rank %d step %d: %s" % (pid, step, [a["args"] for a in reduces]))
    checks.check(steps > 0 and not problems,
                 "hook: one allreduce per bucket (marked hook) in each of the %d steps" % steps,
                 "; ".join(problems[:6]))


ZERO_SPANS = ("zero copy", "zero update", "zero mirror", "zero broadcast")


def case_zero(checks, job):
    """A sharded optimizer's parts of a step are on the timeline (see Note
    [ZeRO on the timeline] in api/zero.cc), plain and overlapped with DDP.
    In a world of 4 each rank copies what it holds, steps its shard, steps
    the one it mirrors and waits for the broadcasts in every step. In a
    world of 2 the ranks mirror each other and so step every shard (see
    Note [Elastic ZeRO]): nobody broadcasts, and the start is kept (copied)
    in the first update only, until the State has seen the update come
    after the step's collectives."""
    overlap = ["--zero-overlap", "step", "--bucket-cap-mb", "0.0005"]
    for kind, world, extra in (("plain", 4, []), ("plain", 2, []), ("overlapped", 2, overlap)):
        name = "zero %s at %d" % (kind, world)
        trace = os.path.join(job.tmp, "zero-%s-%d.json" % (kind, world))
        r = processes.run_command(job.cmd(nproc=world, run_extra=["--trace", trace],
                                         train_extra=["--optimizer", "adam", "--zero"] + extra),
                                 timeout=RUN_TIMEOUT)
        if not checks.check(r.returncode == 0 and os.path.exists(trace),
                            name + ": a %d-worker --zero job with --trace succeeds" % world,
                            r.describe()):
            continue
        spans = check_trace_basics(checks, name, load_trace(trace))
        by = steps_by_rank(spans)
        done = DONE.search(r.stdout)
        steps = int(done.group(1)) if done else 0
        # The overlap updates nothing in its first two steps (PyTorch's warm-up).
        first = 3 if extra else 1
        problems = []
        mirroring = {}  # step: the ranks with a zero mirror span
        for pid in range(world):
            for step in range(first, steps + 1):
                got = by.get(pid, {}).get(step, {})
                within = got.get("backward" if extra else "step", [None])[0]
                if got.get("zero mirror"):
                    mirroring.setdefault(step, set()).add(pid)
                for want in ZERO_SPANS:
                    if world > 2 and want == "zero mirror":
                        # The largest shards' ranks may mirror none (see
                        # Note [ZeRO mirrors]).
                        count = min(1, len(got.get(want, [])))
                    elif world > 2 or want in ("zero update", "zero mirror"):
                        count = 1
                    elif want == "zero copy":
                        count = 1 if step == first else 0
                    else:
                        count = 0
                    found = got.get(want, [])
                    if len(found) != count:
                        problems.append("rank %d step %d: %d %s" % (pid, step, len(found), want))
                    elif found and want != "zero copy" and within and not (
                            within["ts"] <= found[0]["ts"] and found[0]["ts"] + found[0]["dur"]
                            <= within["ts"] + within["dur"]):
                        problems.append("rank %d step %d: %s outside %s" % (
                            pid, step, want, within["name"]))
        if len(set(frozenset(m) for m in mirroring.values())) != 1 or \
                len(mirroring) != steps - first + 1:
            problems.append("the ranks that mirror change or are none: %s" % mirroring)
        what = ("one zero copy, zero update and zero broadcast span, one zero mirror on the same "
                "ranks in every step" if world > 2 else
                "one zero update and zero mirror span, no zero broadcast, a zero copy in step "
                "%d only" % first)
        checks.check(steps > first + 1 and not problems,
                     name + ": each of steps %d..%d on every rank has %s (inside its %s)"
                     % (first, steps, what, "backward" if extra else "step"),
                     "; ".join(problems[:8]))


def case_kill(checks, job):
    trace = os.path.join(job.tmp, "killed.json")
    env = {"CONCORD_TEST_KILL": "1:%d:backward" % KILL_STEP}
    r = processes.run_command(job.cmd(min_workers=1, run_extra=["--trace", trace],
                                     train_extra=["--message-size", "600"]),
                             timeout=RUN_TIMEOUT, env=env)
    if not checks.check(r.returncode == 0 and os.path.exists(trace),
                        "kill: the job goes on without the killed worker and the trace "
                        "is written", r.describe()):
        return
    try:
        events = load_trace(trace)
    except ValueError as e:
        checks.fail("kill: the merged file parses as JSON", str(e))
        return
    spans = check_trace_basics(checks, "kill", events)
    done = DONE.search(r.stdout)
    final = int(done.group(1)) if done else -1
    problems = []
    gen2 = [e for e in events if e["ph"] == "i" and e["name"] == "generation 2"]
    if not (gen2 and gen2[0]["pid"] == 0 and gen2[0]["args"]["world_size"] == 1):
        problems.append("no 'generation 2' instant with world size 1 on rank 0: %s" % gen2)
    # Tracks are ranks, and ranks follow join order: the killed worker (local
    # worker 1) was rank 0 or 1 of generation 1, and the survivor the other
    # one, then rank 0 of generation 2. The generation 2 mark splits the two.
    joined = re.search(r"\[worker 1\] .*generation 1 as rank (\d) of 2", r.stderr)
    if not joined:
        checks.fail("kill: worker 1's rank in generation 1 is logged", r.describe())
        return
    dead_rank = int(joined.group(1))
    split = gen2[0]["ts"] if gen2 else float("inf")
    first = steps_by_rank([e for e in spans if e["ts"] < split])
    second = steps_by_rank([e for e in spans if e["ts"] >= split])
    dead = first.get(dead_rank, {})
    for step in range(1, KILL_STEP):
        for want in ("forward", "backward", "optimizer", "allreduce"):
            if not dead.get(step, {}).get(want):
                problems.append("killed rank %d, step %d: no %s" % (dead_rank, step, want))
    if any(s > KILL_STEP for s in dead if s is not None):
        problems.append("killed rank %d has steps after the kill: %s" %
                        (dead_rank, sorted(s for s in dead if s)))
    if second.keys() - {0}:
        problems.append("tracks other than rank 0 after generation 2: %s" % sorted(second))
    survivor = (first.get(1 - dead_rank, {}), second.get(0, {}))
    for step in range(1, final + 1):
        for want in ("forward", "backward", "optimizer"):
            if not any(part.get(step, {}).get(want) for part in survivor):
                problems.append("survivor, step %d: no %s" % (step, want))
    reform = [e for e in spans if e["name"] == "re-form"]
    if not (gen2 and len(reform) == 1 and reform[0]["pid"] == 0 and reform[0]["args"]["world_size"] == 1
            and reform[0]["ts"] <= gen2[0]["ts"] <= reform[0]["ts"] + reform[0]["dur"]):
        problems.append("no 're-form' span around the generation 2 mark on rank 0: %s" % reform)
    failed = [e for e in spans if e["name"] == "allreduce" and e["args"].get("failed")]
    checks.check(not problems and final > 0,
                 "kill: the killed rank's steps 1..%d and none after the kill, the re-form and "
                 "the survivor's %d steps are in the trace (%d failed allreduces marked)" %
                 (KILL_STEP - 1, final, len(failed)),
                 "; ".join(problems[:8]) + "\n" + r.describe())


def case_errors(checks, job):
    def rejected(name, cmd, needle, one_line=True):
        r = processes.run_command(cmd, timeout=60)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        if one_line:
            ok = len(lines) == 1 and needle in lines[0]
        else:  # the worker's line, shown by concord-run with its own
            ok = any(needle in l for l in lines)
        checks.check(r.returncode == 2 and ok, name, r.describe())
    nowhere = os.path.join(job.tmp, "no", "such", "dir", "t.json")
    rejected("errors: concord-run --trace into a missing directory",
             job.cmd(run_extra=["--trace", nowhere]), "--trace")
    rejected("errors: concord-run --trace naming a directory",
             job.cmd(run_extra=["--trace", job.tmp]), "is a directory")
    rejected("errors: concord-train --trace in a 2-worker job",
             job.cmd(train_extra=["--trace", os.path.join(job.tmp, "x.json")]),
             "give --trace to concord-run", one_line=False)
    alone = [job.train, "--model", job.model, "--data", job.data, "--loss", "mse",
             "--trace", nowhere]
    rejected("errors: concord-train --trace into a missing directory", alone, nowhere)
    # Alone (a world of one), concord-train writes the file itself.
    single = os.path.join(job.tmp, "single.json")
    r = processes.run_command(alone[:-1] + [single, "--epochs", "1", "--batch-size", "40"],
                             timeout=RUN_TIMEOUT)
    ok = r.returncode == 0
    try:
        events = load_trace(single) if ok else []
    except ValueError as e:
        ok, events = False, str(e)
    checks.check(ok and any(e.get("name") == "allreduce" for e in events),
                 "errors: concord-train --trace alone writes a complete trace",
                 str(events)[:300] + "\n" + r.describe())


CASES = {"progress": case_progress, "tty": case_tty, "trace": case_trace, "hook": case_hook,
         "kill": case_kill, "errors": case_errors, "zero": case_zero}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--case", action="append", choices=sorted(CASES))
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args()
    checks = fixtures.Checks()
    tmp = tempfile.mkdtemp(prefix="concord-watch-")
    try:
        job = Job(args, tmp)
        for name in args.case or ["errors", "progress", "tty", "trace", "hook", "zero", "kill"]:
            CASES[name](checks, job)
    finally:
        if args.keep:
            print("kept %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

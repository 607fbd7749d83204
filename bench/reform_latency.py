#!/usr/bin/python3
"""Benchmark: how long Concord's elastic re-form takes, next to what torchrun
does with its defaults (restart every worker), in one run.

Usage (Debian's python3, which has torch; build Concord first):

    /usr/bin/python3 bench/reform_latency.py --bin-dir build/bin
    /usr/bin/python3 bench/reform_latency.py --bin-dir build/bin --world-size 4 \\
        --kind mlp-large --repeat 3 --heartbeat-timeout-ms 2000,10000
    /usr/bin/python3 bench/reform_latency.py --bin-dir build/bin --scenarios kill \\
        --repeat 5 --heartbeat-timeout-ms 30000 [--no-agent]

Scenarios (concord-run --standalone, concord-train on a fixture of
tests/reference/fixtures.py):
  leave   uneven inputs (--sharding fixed): half the ranks run out of data
          after their last step; the others agree on the boundary, re-form
          and go on. Latency = from the step agreement that saw it to the
          survivors' next step done (concord-train --metrics-out
          reform_log: started -> first_step_done).
  kill    the benchmark sends SIGKILL to one concord-train worker at time
          T0 while the job trains; the survivors' collectives fail at once
          (the kernel closes the dead process's sockets), they join the
          next generation, which forms once the coordinator has dropped the
          dead member, and take the model from the authoritative rank.
          Under concord-run's node agent (the default) concord-run reaps
          the dead worker at once and tells the coordinator (see Note [Exited
          workers] in coordinator/core/core.h), which drops it then; with
          --no-agent the coordinator drops it once its watch stream has
          been lost for the grace (the heartbeat interval, clamped to
          [100 ms, 1 s]; see Note [Re-forming]), or at its heartbeat timeout.
          Reported: detect (T0 -> a survivor caught the failure), re-form
          (-> the next generation formed and connected), sync (-> model and
          state received), resume (T0 -> the first step after it done), for
          each --heartbeat-timeout-ms.
  torchrun PyTorch's own launcher (python3 -m torch.distributed.run,
          1.13 here) with its defaults and --max-restarts 1, running W
          Python workers that train the same model with DDP over Gloo; the
          benchmark SIGKILLs one at T0. torchrun's agent notices the dead
          worker (it polls every --monitor-interval, 5 s by default), stops
          the others and starts all W again, which join a new rendezvous
          and start from step 0. Reported: detect+stop (T0 -> the first
          restarted worker started), resume (T0 -> its first step done)
          and the steps done before the kill, which a torchrun job redoes
          from its last checkpoint.

Not a test; not registered with ctest. Timings on a shared 2-core machine
are noisy: use --repeat (medians are printed).
"""

import argparse
import json
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REF_DIR = os.path.join(os.path.dirname(HERE), "tests", "reference")
sys.path.insert(0, REF_DIR)

import fixtures  # noqa: E402
import torch  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", default="build/bin")
    p.add_argument("--kind", default="mlp-plain", help="fixture kind (tests/reference/fixtures.py)")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--heartbeat-timeout-ms", default="2000,10000",
                   help="comma-separated; the interval is a tenth of it")
    p.add_argument("--kill-after-s", type=float, default=2.0,
                   help="train this long before the SIGKILL")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=180)
    p.add_argument("--scenarios", default="leave,kill,torchrun",
                   help="comma-separated, of leave, kill, torchrun")
    p.add_argument("--no-agent", action="store_true",
                   help="concord-run --no-agent: every worker talks to the coordinator itself")
    return p.parse_args()


def concord_cmd(args, model, data, extra_run, extra_train, metrics):
    return ([os.path.join(args.bin_dir, "concord-run"), "--standalone",
             "--nproc", str(args.world_size)] + (["--no-agent"] if args.no_agent else []) +
            extra_run + ["--",
            os.path.join(args.bin_dir, "concord-train"), "--model", model, "--data", data,
            "--batch-size", str(args.batch_size), "--log-interval", "1000000",
            "--loss", fixtures.default_loss(args.kind), "--metrics-out", metrics] + extra_train)


def kill_group(proc):
    """SIGKILLs the process group `proc` leads (started in a new session)
    and reaps it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def children(pid):
    r = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in r.stdout.split()]


def subset(data, path, n):
    d = torch.load(data)
    torch.save({"inputs": d["inputs"][:n].clone(), "targets": d["targets"][:n].clone()}, path)
    return path


def leave_once(args, model, data, tmp):
    """Uneven inputs: half the ranks have one batch more."""
    w = args.world_size
    n = w * args.batch_size * 8 + max(1, w // 2)
    metrics = os.path.join(tmp, "leave.json")
    cmd = concord_cmd(args, model, subset(data, os.path.join(tmp, "leave.pt"), n), [],
                      ["--sharding", "fixed", "--epochs", "1"], metrics)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError("leave run failed:\n" + r.stderr[-3000:])
    with open(metrics) as f:
        m = json.load(f)
    e = m["reform_log"][0]
    return {"re-form": (e["rendezvous_unix_us"] - e["started_unix_us"]) / 1e3,
            "sync": (e["synced_unix_us"] - e["rendezvous_unix_us"]) / 1e3,
            "next step done": (e["first_step_done_unix_us"] - e["started_unix_us"]) / 1e3,
            "step (median)": m["step_time_ms_median"]}


# spdlog's "[2026-11-22 17:34:18.422] [concord-train] [info] ..." (local time).
STAMP = re.compile(r"^\[worker \d+\] \[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})\] (.*)$")


def stamp(text):
    base, ms = text.split(".")
    return time.mktime(time.strptime(base, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1e3


def kill_once(args, model, data, timeout_ms):
    """SIGKILL one worker at T0; times of the survivors' first reactions."""
    interval = max(50, timeout_ms // 10)
    cmd = concord_cmd(args, model, data,
                      ["--min-workers", str(args.world_size - 1),
                       "--max-workers", str(args.world_size),
                       # All W form the first generation, however slowly
                       # they start.
                       "--settle-ms", "200000",
                       "--heartbeat-interval-ms", str(interval),
                       "--heartbeat-timeout-ms", str(timeout_ms)],
                      ["--epochs", "100000"], os.devnull)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    events = {}
    seen = []
    t0 = None
    deadline = time.time() + args.timeout
    try:
        started = time.time()
        fd = proc.stderr.fileno()
        buf = ""
        joined = 0
        while time.time() < deadline and "resumed" not in events:
            if (t0 is None and joined == args.world_size
                    and time.time() - started > args.kill_after_s):
                workers = children(proc.pid)
                if len(workers) < args.world_size:
                    raise RuntimeError("found workers %s" % workers)
                t0 = time.time()
                os.kill(workers[-1], signal.SIGKILL)
            chunk = ""
            if select.select([fd], [], [], 0.05)[0]:
                chunk = os.read(fd, 1 << 16).decode(errors="replace")
                if not chunk and proc.poll() is not None:
                    raise RuntimeError("the job ended: %s\n%s" % (events, "\n".join(seen[-30:])))
            buf += chunk
            lines = buf.split("\n")
            buf = lines.pop()
            seen.extend(lines)
            for line in lines:
                m = STAMP.match(line)
                if t0 is None and "joined job" in line:
                    joined += 1
                    started = time.time()
                if t0 is None or not m:
                    continue
                when, what = stamp(m.group(1)), m.group(2)
                if "re-forming" in what:
                    events.setdefault("detected", when)
                elif "joined job" in what and "detected" in events:
                    events.setdefault("formed", when)
                elif "going on from step" in what and "formed" in events:
                    events.setdefault("synced", when)
                elif "the first in generation" in what and "synced" in events:
                    events.setdefault("resumed", when)
        if "resumed" not in events:
            raise RuntimeError("no resumption seen: %s; last output:\n%s"
                               % (events, "\n".join(seen[-20:])))
    finally:
        kill_group(proc)
    return {"detect": (events["detected"] - t0) * 1e3,
            "re-form": (events["formed"] - events["detected"]) * 1e3,
            "sync": (events["synced"] - events["formed"]) * 1e3,
            "resume": (events["resumed"] - t0) * 1e3}


# A torchrun worker as PyTorch users write one: the process group from
# torchrun's environment, DDP around the same model, one line per step done.
TORCHRUN_WORKER = r"""
import os, sys, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
model_path, batch, features = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.set_num_threads(1)
print("start", restart, os.getpid(), time.time(), flush=True)
dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())
model = DDP(torch.jit.load(model_path))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
while True:
    out = model(torch.randn(batch, features))
    loss = out.float().pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    print("step", restart, step, time.time(), flush=True)
"""


def torchrun_once(args, model, tmp, i):
    """torchrun itself (PyTorch 1.13's torch.distributed.run, its defaults
    but --max-restarts 1): W workers training with DDP, one SIGKILLed at
    T0; torchrun's agent sees the worker die, stops the others and starts
    every worker again (restart 1, from step 0: no checkpoint)."""
    in_features = next(torch.jit.load(model).parameters()).shape[1]
    script = os.path.join(tmp, "torchrun_worker_%d.py" % i)
    with open(script, "w") as f:
        f.write(TORCHRUN_WORKER)
    # --redirects 1 --tee 1: the workers' stdout, prefixed "[defaultR]:",
    # on torchrun's (1.13's default, "0", fails under Python 3.11: its
    # Std.from_str("0") finds no member).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(args.world_size), "--max_restarts", "1",
           "--redirects", "1", "--tee", "1",
           "--log_dir", os.path.join(tmp, "torchrun-logs-%d" % i),
           script, model, str(args.batch_size), str(in_features)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True, text=True)
    pids, t0, steps_before, first_start, resumed = [], None, 0, None, None
    started = None
    deadline = time.time() + args.timeout
    try:
        for line in proc.stdout:
            words = line.split(":", 1)[-1].split()
            if not words or time.time() > deadline:
                break
            if words[0] == "start" and words[1] == "0":
                pids.append(int(words[2]))
            elif words[0] == "start" and t0 is not None and first_start is None:
                first_start = float(words[3])
            elif words[0] == "step" and words[1] == "0":
                started = started or time.time()
                steps_before = max(steps_before, int(words[2]))
                if (t0 is None and len(pids) == args.world_size
                        and time.time() - started > args.kill_after_s):
                    t0 = time.time()
                    os.kill(pids[-1], signal.SIGKILL)
            elif words[0] == "step" and words[1] == "1":
                resumed = float(words[3])
                break
        if t0 is None or resumed is None or first_start is None:
            raise RuntimeError("torchrun: no restart seen (t0 %s, restarted %s, resumed %s)"
                               % (t0, first_start, resumed))
    finally:
        kill_group(proc)
    return {"detect+stop": (first_start - t0) * 1e3,
            "resume": (resumed - t0) * 1e3,
            "steps redone": float(steps_before)}


def median_table(title, rows):
    keys = list(rows[0].keys())
    print(title)
    print("  " + "".join("%16s" % k for k in keys))
    print("  " + "".join(("%16.0f" if k.startswith("steps") else "%14.1f ms")
                         % statistics.median(r[k] for r in rows) for k in keys))
    if len(rows) > 1:
        print("  (medians of %d runs; min..max: %s)" % (len(rows), ", ".join(
            "%s %.0f..%.0f" % (k, min(r[k] for r in rows), max(r[k] for r in rows))
            for k in keys)))
    sys.stdout.flush()


def main():
    args = parse_args()
    for tool in ("concord-run", "concord-train"):
        if not os.access(os.path.join(args.bin_dir, tool), os.X_OK):
            print("reform_latency.py: %s/%s missing (build first)" % (args.bin_dir, tool),
                  file=sys.stderr)
            return 2
    os.environ["OMP_NUM_THREADS"] = "1"
    tmp = tempfile.mkdtemp(prefix="concord_reform_")
    try:
        model, data = fixtures.make_fixture(os.path.join(tmp, "fixture"), args.kind,
                                            args.samples, args.seed)
        scenarios = args.scenarios.split(",")
        print("kind=%s, world size %d, batch %d per rank, %d run(s) each, %s\n" % (
            args.kind, args.world_size, args.batch_size, args.repeat,
            "--no-agent" if args.no_agent else "through concord-run's node agent"), flush=True)
        if "leave" in scenarios:
            median_table("Concord, a rank leaves (uneven inputs): agreement -> survivors' next "
                         "step done", [leave_once(args, model, data, tmp)
                                       for _ in range(args.repeat)])
        for timeout_ms in [int(x) for x in args.heartbeat_timeout_ms.split(",")]:
            if "kill" not in scenarios:
                break
            median_table("Concord, SIGKILL of a worker (heartbeat timeout %d ms, interval %d "
                         "ms): T0 -> training resumed" % (timeout_ms, max(50, timeout_ms // 10)),
                         [kill_once(args, model, data, timeout_ms)
                          for _ in range(args.repeat)])
        if "torchrun" not in scenarios:
            return 0
        median_table("torchrun (torch.distributed.run, defaults, --max-restarts 1), SIGKILL "
                     "of a worker: T0 -> every worker restarted -> training resumed (from "
                     "step 0: a torchrun job loads its checkpoint on top)",
                     [torchrun_once(args, model, tmp, i) for i in range(args.repeat)])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

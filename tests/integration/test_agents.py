#!/usr/bin/env python3
"""64 real worker processes through 8 node agents, one agent killed mid-run.

A standalone concord-coordinator on loopback; eight concord-run launchers
(each the node agent of its eight concord-train workers, see Note [Node agents]
in agent/node_agent.h) join one job of 64. Once the job has trained a few
steps, one launcher is SIGKILLed, only the launcher: its workers must die
with it, the other 56 re-form without them and finish the job.

Checked:
  * the killed launcher leaves no worker behind; the seven others exit 0;
  * the 56 survivors' final parameters are bit-identical, and the job ends
    in a generation of 56 (concord-train's summary line);
  * the coordinator served every worker through the agents: no Join,
    Heartbeat or WatchMembership call of a worker of its own reached it,
    only the agents' Node streams (its Prometheus counters), and the
    heartbeats on them came batched (at least 3 a message on average);
  * every process ran on loopback.
"""

import argparse
import json
import os
import subprocess
import re
import shutil
import signal
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import elastic_harness as te  # noqa: E402
import testlib  # noqa: E402

NODES = 8
PER_NODE = 8
VICTIM = 3  # the launcher killed
HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 500, 15000
KILL_AT_STEP = 8
RUN_TIMEOUT = 400.0
STEP = re.compile(r"step (\d+)/\d+ loss")
DONE = re.compile(r"concord-train: done: (\d+) steps in .* generation (\d+), world size (\d+)")


def start_coordinator(bins, directory):
    os.makedirs(directory, exist_ok=True)
    worker_token = te.write_token_file(os.path.join(directory, "worker-token"))
    operator_token = te.write_token_file(os.path.join(directory, "operator-token"))
    proc = te.Proc("coordinator", [bins.coordinator, "--listen", "127.0.0.1:0",
                                   "--metrics-listen", "127.0.0.1:0",
                                   "--worker-token-file", worker_token,
                                   "--operator-token-file", operator_token],
                   directory)
    address = metrics = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and proc.poll() is None:
        text = proc.stderr() + proc.stdout()
        a = re.search(r"listening on (\S+)", text)
        m = re.search(r"metrics on port (\d+)", text)
        if a and m:
            address, metrics = a.group(1), int(m.group(1))
            break
        time.sleep(0.05)
    return proc, address, metrics, worker_token, operator_token


def metric_sums(port, name, label):
    """{label value: sum} of the coordinator's counter `name`."""
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r'^%s\{([^}]*)\} (\S+)$' % name, text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[labels.get(label)] = out.get(labels.get(label), 0) + float(m.group(2))
    return out


def launcher_cmd(bins, address, token, job, node, fx, rd):
    train = te.train_args(fx, rd, batch=1, epochs=2)
    return [bins.run, "--coordinator", address, "--token-file", token,
            "--nproc", PER_NODE, "--job-id", job, "--node-id", "node%d" % node,
            "--min-workers", (NODES - 1) * PER_NODE, "--max-workers", NODES * PER_NODE,
            "--heartbeat-interval-ms", HEARTBEAT_MS,
            "--heartbeat-timeout-ms", HEARTBEAT_TIMEOUT_MS,
            "--rendezvous-timeout-ms", 120000, "--collective-timeout-ms", 60000,
            "--"] + [bins.train] + [str(a) for a in train]


def live_in_group(pgid):
    """Pids of processes in group `pgid` that are not zombies (/proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def max_step(procs):
    best = 0
    for p in procs:
        for m in STEP.finditer(p.stdout()):
            best = max(best, int(m.group(1)))
    return best


def run(args, checks, tmp):
    bins = te.Bins(args.bin_dir)
    if bins.missing():
        checks.fail("concord binaries present", str(bins.missing()))
        return
    name = "agents"
    coord, address, metrics_port, token, operator_token = start_coordinator(
        bins, os.path.join(tmp, "coordinator"))
    if not checks.check(address is not None and address.startswith("127.0.0.1:"),
                        "concord-coordinator listens on loopback", coord.describe()):
        return
    fx = te.Fixture(tmp, 4096)
    rd = te.RunDir(tmp, name)
    start = time.monotonic()
    launchers = [te.Proc("node%d" % i, launcher_cmd(bins, address, token, "agents", i, fx, rd),
                         rd.logs) for i in range(NODES)]
    # Kill one launcher (only the launcher) once the job is training.
    deadline = time.monotonic() + RUN_TIMEOUT / 2
    while time.monotonic() < deadline and max_step(launchers) < KILL_AT_STEP and \
            all(p.poll() is None for p in launchers):
        time.sleep(0.1)
    reached = max_step(launchers)
    if not checks.check(reached >= KILL_AT_STEP,
                        "the job of %d trains through %d agents (step %d)" %
                        (NODES * PER_NODE, NODES, reached),
                        "\n".join(p.describe(2000) for p in launchers[:2])):
        return
    victim = launchers[VICTIM]
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    victim.proc.wait(30)
    left = live_in_group(victim.pid)
    while left and time.monotonic() < killed_at + 10:
        time.sleep(0.05)
        left = live_in_group(victim.pid)
    checks.check(victim.returncode == -signal.SIGKILL and not left,
                 "the killed agent's %d workers died with it (none left in its group after "
                 "%.1fs)" % (PER_NODE, time.monotonic() - killed_at),
                 "left: %s\n%s" % (left, victim.describe(2000)))
    survivors = [p for i, p in enumerate(launchers) if i != VICTIM]
    for p in survivors:
        p.wait(max(1.0, RUN_TIMEOUT - (time.monotonic() - start)))
    elapsed = time.monotonic() - start
    bad = [p for p in survivors if p.returncode != 0]
    checks.check(not bad, "the seven other agents' workers finish the job (exit 0) in %.0fs, "
                 "%.0fs after the kill" % (elapsed, time.monotonic() - killed_at),
                 "\n".join(p.describe(4000) for p in bad[:2]))
    dones = [DONE.search(p.stdout()) for p in survivors]
    worlds = sorted(set(int(d.group(3)) for d in dones if d))
    checks.check(worlds == [(NODES - 1) * PER_NODE],
                 "the job ends in a generation of %d: %s" % ((NODES - 1) * PER_NODE, worlds))
    te.check_outputs_identical(checks, name, rd, expected_count=(NODES - 1) * PER_NODE)

    # The killed agent's workers were dropped because their node stream
    # broke (at once), not after the heartbeat timeout.
    ctl = subprocess.run([os.path.join(os.path.dirname(bins.run), "concordctl"),
                          "--endpoint", address, "--token-file", operator_token,
                          "-o", "json", "events", "agents", "--limit", "1000"],
                         capture_output=True, text=True, timeout=60)
    try:
        events = json.loads(ctl.stdout).get("events", [])
    except ValueError:
        events = []
    broke = sorted(e.get("worker_id", "") for e in events if e.get("kind") == "failure" and
                   "connection to the coordinator broke" in e.get("message", ""))
    others = [e for e in events if e.get("kind") == "failure" and
              "connection to the coordinator broke" not in e.get("message", "")]
    checks.check(len(broke) == PER_NODE and
                 all(("-%d-w" % victim.pid) in w for w in broke) and not others,
                 "the coordinator dropped the killed agent's %d workers as its node stream "
                 "broke, and no other: %s" % (PER_NODE, broke),
                 "%s\n%s" % (others, ctl.stdout[-3000:] + ctl.stderr[-1000:]))

    counts = metric_sums(metrics_port, "concord_rpc_total", "method")
    messages = metric_sums(metrics_port, "concord_node_messages_total", "kind")
    items = metric_sums(metrics_port, "concord_node_items_total", "kind")
    direct = {m: counts.get(m, 0) for m in ("Join", "Heartbeat", "WatchMembership")}
    # (A Node stream's call is counted when it ends: the seven still open
    # when the job ended were closed by their agents; the killed one broke.)
    checks.check(direct == {"Join": 0, "Heartbeat": 0, "WatchMembership": 0} and
                 counts.get("Node", 0) >= NODES,
                 "the coordinator served the workers through the agents: calls %s" %
                 {k: int(v) for k, v in sorted(counts.items())})
    beats, carrying = items.get("heartbeats", 0), messages.get("heartbeats", 0)
    checks.check(carrying > 0 and beats >= 3 * carrying,
                 "heartbeats came batched: %d in %d messages (%.1f a message; %d workers a "
                 "node)" % (beats, carrying, beats / max(carrying, 1), PER_NODE),
                 "messages %s, items %s" % (messages, items))
    coord.kill_group()
    coord.wait(10)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    checks = testlib.Checks()
    tmp = tempfile.mkdtemp(prefix="concord_agents_")
    try:
        run(args, checks, tmp)
    except Exception as e:  # noqa: BLE001 - an unexpected error is a failure
        import traceback
        traceback.print_exc()
        checks.fail("ran to completion", "%s: %s" % (type(e).__name__, e))
    finally:
        if checks.failed:
            for proc in te.Proc.started:
                if proc.name in ("coordinator", "node0", "node%d" % VICTIM):
                    print("--- %s ---\n%s" % (proc.name, proc.describe(6000)), flush=True)
        te.Proc.kill_all()
        if args.keep:
            print("kept %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

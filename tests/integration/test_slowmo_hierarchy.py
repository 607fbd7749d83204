#!/usr/bin/python3
"""SlowMo's node hierarchy (see Note [Node hierarchy] in
worker/slowmo/hierarchy.h) with real processes: a concord-coordinator and two
concord-run launchers on loopback, one per simulated node (--node-id node-a,
node-b), two concord-train workers each, --nprocs-per-node 2. One worker of
node-a is SIGKILLed at step 6 (CONCORD_TEST_KILL); the three survivors
re-form and go on with node-a as a node of one (its survivor its master,
whichever rank the dead one had) and node-b unchanged.

    /usr/bin/python3 tests/integration/test_slowmo_hierarchy.py --bin-dir build/bin

Checked: both launchers exit 0 within a bound (the job completed; launcher a
names its lost worker in a summary line: see Note [Exit status] in
tools/launcher.h); in generation 1 the 4 workers log 2 nodes over 4 ranks, two of them
as masters; after the re-form the 3 survivors log 2 nodes over 3 ranks and
exactly one is the master of a node of 1; slow momentum is re-sharded over
the two masters without losing a slice (its replica survives); the final
models of the 3 survivors are bit-identical (LocalSGD averages every step and
the masters broadcast in their node) and finite; the authoritative rank's
metrics say world size 3 after one re-form.
"""

import argparse
import glob
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))

import torch  # noqa: E402

import fixtures  # noqa: E402

TIMEOUT = 150


def write_token_file(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(24) + "\n")
    return path


def start_coordinator(bin_dir, directory):
    """(process, address, worker token file); address None if it did not
    start listening within 20 s."""
    os.makedirs(os.path.join(directory, "state"))
    worker_token = write_token_file(os.path.join(directory, "worker-token"))
    operator_token = write_token_file(os.path.join(directory, "operator-token"))
    log = open(os.path.join(directory, "coordinator.log"), "w+")
    proc = subprocess.Popen([os.path.join(bin_dir, "concord-coordinator"),
                             "--listen", "127.0.0.1:0",
                             "--state-dir", os.path.join(directory, "state"),
                             "--worker-token-file", worker_token,
                             "--operator-token-file", operator_token],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and proc.poll() is None:
        log.seek(0)
        m = re.search(r"listening on (\S+)", log.read())
        if m:
            return proc, m.group(1), worker_token
        time.sleep(0.05)
    return proc, None, worker_token


class Abandon(Exception):
    """The run cannot be checked further; the problems say why. Only this is
    caught: an error while reading the outputs (a corrupt file) fails the
    test with its traceback."""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="concord-slowmo-hier-")
    problems = []
    coord, address, token = start_coordinator(args.bin_dir, os.path.join(tmp, "coordinator"))
    launchers = {}
    try:
        if address is None:
            problems.append("the coordinator did not start")
            raise Abandon()
        model, data = fixtures.make_fixture(os.path.join(tmp, "fixture"), "mlp-plain", 600, 3)
        for node, kill in (("node-a", "0:6:forward"), ("node-b", "")):
            out = os.path.join(tmp, node)
            os.makedirs(os.path.join(out, "workers"))
            cmd = [os.path.join(args.bin_dir, "concord-run"), "--coordinator", address,
                   "--token-file", token, "--node-id", node, "--nproc", "2",
                   "--min-workers", "3", "--max-workers", "4", "--job-id", "hier",
                   # The first generation waits for all 4 (forms at once when
                   # they are there), however slowly one starts.
                   "--settle-ms", "10000",
                   "--collective-timeout-ms", "20000", "--rendezvous-timeout-ms", "20000",
                   "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "2000",
                   "--", os.path.join(args.bin_dir, "concord-train"), "--model", model,
                   "--data", data, "--loss", "mse", "--lr", "0.05", "--momentum", "0.9",
                   "--batch-size", "8", "--epochs", "2", "--log-interval", "1000",
                   "--output-per-worker", os.path.join(out, "workers"),
                   "--metrics-out", os.path.join(out, "metrics.json"),
                   "--algorithm", "slowmo-localsgd", "--nprocs-per-node", "2",
                   "--localsgd-frequency", "1", "--slowmo-frequency", "4",
                   "--slowmo-num-shards", "2"]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            if kill:
                env["CONCORD_TEST_KILL"] = kill
            err = open(os.path.join(out, "stderr.log"), "w+")
            launchers[node] = (subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                                stderr=err, start_new_session=True), err, out)
        deadline = time.monotonic() + TIMEOUT
        for node, (proc, _, _) in launchers.items():
            try:
                proc.wait(max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                problems.append("%s's concord-run did not finish within %d s" % (node, TIMEOUT))
        if problems:
            raise Abandon()
        stderr = {}
        for node, (proc, err, _) in launchers.items():
            err.seek(0)
            stderr[node] = err.read()
        expected = {"node-a": 0, "node-b": 0}
        for node, (proc, _, _) in launchers.items():
            if proc.returncode != expected[node]:
                problems.append("%s's concord-run exited %s, expected %d" % (
                    node, proc.returncode, expected[node]))
        text = stderr["node-a"] + stderr["node-b"]
        # The workers' own lines (concord-run repeats a failed worker's last
        # lines after it exits).
        worker_lines = "\n".join(line for line in text.splitlines()
                                  if re.match(r"\[worker \d+\] ", line))
        if "CONCORD_TEST_KILL: killing myself" not in stderr["node-a"]:
            problems.append("no worker of node-a killed itself")

        def count(pattern):
            return len(re.findall(pattern, worker_lines))

        first = count(r"SlowMo: generation 1: 2 node\(s\) over 4 ranks; rank \d is the master "
                      r"of a node of 2")
        members = count(r"SlowMo: generation 1: 2 node\(s\) over 4 ranks; rank \d is a member "
                        r"of a node of 2")
        if (first, members) != (2, 2):
            problems.append("generation 1: %d masters and %d members of 2-rank nodes logged, "
                            "expected 2 and 2" % (first, members))
        after = re.findall(r"SlowMo: generation (\d+): 2 node\(s\) over 3 ranks; rank \d is "
                           r"(the master|a member) of a node of (\d)", worker_lines)
        roles = sorted((role, size) for _, role, size in after)
        if roles != [("a member", "2"), ("the master", "1"), ("the master", "2")]:
            problems.append("after the re-form: %s, expected a node of 1 and a node of 2 "
                            "(master and member)" % (roles,))
        if "lost with their owner" in text:
            problems.append("a slow-momentum slice was lost (its replica should have survived)")
        outputs = sorted(glob.glob(os.path.join(tmp, "node-*", "workers", "*.pt")))
        if len(outputs) != 3:
            problems.append("%d per-worker outputs, expected 3" % len(outputs))
        states = [fixtures.load_state(p) for p in outputs]
        for st in states:
            for k, v in st.items():
                if not torch.isfinite(v).all():
                    problems.append("%s is not finite" % k)
        for k in (states[0] if states else {}):
            if not all(torch.equal(states[0][k], s[k]) for s in states[1:]):
                problems.append("survivors' %s differ" % k)
        metrics = [m for m in glob.glob(os.path.join(tmp, "node-*", "metrics.json"))]
        if len(metrics) != 1:
            problems.append("%d metrics files, expected 1 (the authoritative rank's)"
                            % len(metrics))
        else:
            with open(metrics[0]) as f:
                m = json.load(f)
            if m.get("world_size") != 3 or m.get("reforms") != 1:
                problems.append("metrics: world size %s, reforms %s" % (
                    m.get("world_size"), m.get("reforms")))
        if problems:
            problems.append("stderr tail:\n" + "\n".join(text.splitlines()[-30:]))
    except Abandon:
        pass  # the problems say why
    finally:
        for proc, err, _ in launchers.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            err.close()
        os.killpg(coord.pid, 9)
        coord.wait()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print("slowmo-hierarchy: %s" % ("ok" if not problems else "FAILED"))
    for p in problems:
        print("  " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

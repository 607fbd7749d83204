#!/usr/bin/python3
"""Coordinator failover with the etcd store: a real etcd on loopback,
two concord-coordinator replicas (--store etcd), and a real 2-worker training
job (concord-run + concord-train, Gloo) whose workers are given both replicas
as one address (--coordinator 127.0.0.1:A,127.0.0.1:B).

    /usr/bin/python3 tests/integration/test_coordinator_failover.py --bin-dir build/bin [--keep]

The schedule:
  1. replica A leads (it listens), replica B stands by (it does not);
  2. the job trains; A is SIGKILLed mid-run: B takes over after the lease TTL
     (2 s) and serves the job with the same generation, members and events,
     and the workers' heartbeats reach it (their committed steps grow there);
  3. A is restarted (it stands by); B gets SIGTERM: it resigns, A takes over
     at once (well under the TTL);
  4. the job finishes: concord-run exits 0, both workers' outputs are
     bit-identical to each other and to a fault-free run with the same flags
     (the workers never re-formed: no step lost or repeated), the metrics say
     0 re-forms, and the job is SUCCEEDED on the new leader.

Prints one line per check and 'N passed, N failed'; exits 1 on any failure.
Every process has a timeout.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))

import elastic_harness as te  # noqa: E402

import fixtures  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testlib import accepts, free_port, wait_for  # noqa: E402

LEASE_TTL = 2
JOB = "failover"
HISTORIES = []  # every replica's --history-file, for tests/history.py


class Etcd(object):
    def __init__(self, directory):
        self.client = "http://127.0.0.1:%d" % free_port()
        peer = "http://127.0.0.1:%d" % free_port()
        etcd = shutil.which("etcd")
        if etcd is None:
            raise RuntimeError("etcd not found: install Debian's etcd-server "
                               "(scripts/install-deps.sh does)")
        self.proc = te.Proc("etcd", [etcd, "--name", "t", "--data-dir",
                                     os.path.join(directory, "etcd-data"),
                                     "--listen-client-urls", self.client,
                                     "--advertise-client-urls", self.client,
                                     "--listen-peer-urls", peer,
                                     "--initial-advertise-peer-urls", peer,
                                     "--initial-cluster", "t=" + peer,
                                     "--log-level", "error"], directory)


class Replica(object):
    """A concord-coordinator with --store etcd on a fixed loopback port."""

    def __init__(self, bins, directory, name, port, etcd, worker_token, operator_token):
        self.name = name
        self.address = "127.0.0.1:%d" % port
        self.history = os.path.join(directory, name + ".history.jsonl")
        HISTORIES.append(self.history)
        self.proc = te.Proc(name, [bins.coordinator, "--listen", self.address,
                                   "--history-file", self.history,
                                   "--worker-token-file", worker_token,
                                   "--operator-token-file", operator_token,
                                   "--store", "etcd", "--etcd-endpoints", etcd.client,
                                   "--etcd-lease-ttl", LEASE_TTL], directory)

    def log(self):
        return self.proc.stderr() + self.proc.stdout()

    def serving(self):
        return "listening on " + self.address in self.log()

    def standing_by(self):
        return "standing by" in self.log()


def concordctl(bins, endpoint, token, *args):
    try:
        out = subprocess.run([os.path.join(os.path.dirname(bins.run), "concordctl"),
                              "--endpoint", endpoint, "--token-file", token, "-o", "json",
                              "--timeout-ms", "3000"] + list(args),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=10,
                             universal_newlines=True)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        return None
    try:
        return json.loads(out.stdout)
    except ValueError:
        return None


def job_status(bins, endpoint, token):
    return concordctl(bins, endpoint, token, "status", JOB)


def min_step(status):
    if not status or not status.get("members"):
        return -1
    return min(m["committed_step"] for m in status["members"])


def run(args, checks, tmp):
    bins = te.Bins(args.bin_dir)
    missing = bins.missing()
    if missing:
        checks.fail("binaries present", "missing: %s" % missing)
        return
    etcd = Etcd(tmp)
    # The coordinators wait up to 10 s for etcd; a listening port is enough.
    port = int(etcd.client.rsplit(":", 1)[1])
    checks.check(wait_for(lambda: accepts(port), 20, 0.1) and etcd.proc.poll() is None,
                 "etcd started", etcd.proc.describe())

    worker_token = te.write_token_file(os.path.join(tmp, "worker-token"))
    operator_token = te.write_token_file(os.path.join(tmp, "operator-token"))
    port_a, port_b = free_port(), free_port()

    def replica(name, port):
        return Replica(bins, tmp, name, port, etcd, worker_token, operator_token)

    a = replica("replica-a", port_a)
    if not checks.check(wait_for(a.serving, 20), "replica A leads and listens", a.proc.describe()):
        return
    b = replica("replica-b", port_b)
    checks.check(wait_for(b.standing_by, 20) and not b.serving(),
                 "replica B stands by without listening", b.proc.describe())

    fx = te.Fixture(tmp, 512)
    # Long enough to fail over twice mid-run: the two fail-overs take about
    # 5 s, the job at least 17 s (5,760 steps of at least 3 ms: concord-train's
    # CONCORD_TEST_MIN_STEP_MS; through shared memory they take ~1 ms).
    batch, epochs = 4, 90
    rd = te.RunDir(tmp, "failover")
    target = "%s,%s" % (a.address, b.address)
    train = te.train_args(fx, rd, batch, epochs)
    job = te.Proc("concord-run", te.launch_cmd(bins, 2, JOB, train, coordinator=target,
                                               token_file=worker_token), rd.logs,
                  env={"CONCORD_TEST_MIN_STEP_MS": "3"})

    # 2. Training on A; SIGKILL A.
    before = wait_for(lambda: (lambda s: s if min_step(s) >= 20 else None)(
        job_status(bins, a.address, operator_token)), 60, 0.2)
    if not checks.check(before is not None, "the job trains on replica A (step >= 20)",
                        job.describe()):
        return
    events_before = concordctl(bins, a.address, operator_token, "events", JOB) or {}
    a.proc.kill_group()
    killed = time.monotonic()
    a.proc.wait(10)
    took_over = wait_for(b.serving, 3 * LEASE_TTL + 5)
    takeover_s = time.monotonic() - killed
    checks.check(took_over and takeover_s < LEASE_TTL + 3,
                 "replica B takes over %.2fs after A's SIGKILL (lease TTL %ds)" % (
                     takeover_s, LEASE_TTL), b.proc.describe())
    after = wait_for(lambda: (lambda s: s if min_step(s) > min_step(before) + 5 else None)(
        job_status(bins, b.address, operator_token)), 30, 0.2)
    if not checks.check(after is not None and job.poll() is None,
                        "workers heartbeat to B and keep training (steps %d -> %d)" % (
                            min_step(before), min_step(after)),
                        "status %s\n%s" % (after, job.describe())):
        return
    checks.check(after["generation"] == before["generation"] and
                 sorted(m["worker_id"] for m in after["members"]) ==
                 sorted(m["worker_id"] for m in before["members"]) and
                 after["state"] == "RUNNING",
                 "B serves the same generation (%d) and members" % before["generation"],
                 "before %s\nafter %s" % (before, after))
    events_after = concordctl(bins, b.address, operator_token, "events", JOB) or {}
    seqs_before = [e["seq"] for e in events_before.get("events", [])]
    seqs_after = [e["seq"] for e in events_after.get("events", [])]
    checks.check(seqs_before and seqs_after[:len(seqs_before)] == seqs_before,
                 "B has every event A recorded (%d)" % len(seqs_before),
                 "A: %s\nB: %s" % (events_before, events_after))

    # 3. A back as a standby; SIGTERM B: A takes over at once.
    a = replica("replica-a2", port_a)
    checks.check(wait_for(a.standing_by, 20) and not a.serving(),
                 "restarted replica A stands by", a.proc.describe())
    os.kill(b.proc.pid, 15)
    resigned = time.monotonic()
    b_rc = b.proc.wait(15)
    checks.check(b_rc == 0 and "resigning" in b.log(), "replica B exits 0 on SIGTERM",
                 b.proc.describe())
    took_over = wait_for(a.serving, 10)
    handover_s = time.monotonic() - resigned
    checks.check(took_over and handover_s < LEASE_TTL,
                 "replica A takes over %.2fs after B resigned" % handover_s, a.proc.describe())

    # 4. The job finishes as if nothing happened.
    rc = job.wait(te.RUN_TIMEOUT + 60)
    checks.check(rc == 0, "concord-run exits 0 (%s, %.1fs)" % (rc, job.elapsed), job.describe())
    final = te.check_outputs_identical(checks, "failover", rd, expected_count=2)
    metrics = rd.load_metrics() or {}
    checks.check(metrics.get("reforms") == 0 and metrics.get("world_size") == 2,
                 "metrics: 0 re-forms, world size 2", json.dumps(metrics)[:2000])
    # Across the fail-overs: generations never reused, every step once.
    rd.coordinator_history = list(HISTORIES)
    te.check_history(checks, "failover", rd, 512, epochs, te.last_step_of(rd))
    # concordctl given both replicas (B, gone, first) finds the leader.
    both = "%s,%s" % (b.address, a.address)
    done = wait_for(lambda: (lambda s: s if s and s["state"] == "SUCCEEDED" else None)(
        job_status(bins, both, operator_token)), 10, 0.2)
    checks.check(done is not None, "the job is SUCCEEDED on replica A (concordctl --endpoint B,A)",
                 str(job_status(bins, a.address, operator_token)))

    # The same job without any coordinator trouble.
    ref = te.RunDir(tmp, "fault-free")
    ref_job = te.Proc("fault-free", te.launch_cmd(bins, 2, JOB, te.train_args(
        fx, ref, batch, epochs)), ref.logs)
    checks.check(ref_job.wait(te.RUN_TIMEOUT + 60) == 0, "fault-free run exits 0",
                 ref_job.describe())
    expected = te.check_outputs_identical(checks, "fault-free", ref, expected_count=2)
    if final is not None and expected is not None:
        same = set(final) == set(expected) and all(
            torch_equal(final[k], expected[k]) for k in final)
        checks.check(same, "the failed-over job's model equals the fault-free run's bit for bit")
    print("SUMMARY failover: SIGKILL takeover %.2fs, SIGTERM hand-over %.2fs, job %.1fs" % (
        takeover_s, handover_s, job.elapsed), flush=True)


def torch_equal(x, y):
    import torch
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args()
    checks = fixtures.Checks()
    tmp = tempfile.mkdtemp(prefix="concord-failover-")
    try:
        run(args, checks, tmp)
    except Exception as e:  # noqa: BLE001
        checks.fail("no exception", "%s: %s" % (type(e).__name__, e))
    finally:
        te.Proc.kill_all()
        if args.keep:
            print("kept " + tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

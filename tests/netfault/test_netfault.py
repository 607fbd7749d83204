#!/usr/bin/python3
"""Network faults: real coordinators, etcd and training workers on hosts of
an emulated network (netlab.py: network namespaces behind a userspace
switch), with links cut one way or both, delayed and lossy, and healed on a
schedule; what they did is then checked by tests/history.py.

    /usr/bin/python3 tests/netfault/test_netfault.py --bin-dir build/bin \
        [--scenario NAME ...] [--keep]
    /usr/bin/python3 tests/netfault/test_netfault.py --list

Needs root (namespaces); prints 'CONCORD_TEST_SKIPPED: ...' and exits 0 without.

Every scenario runs one job of three workers (one concord-run with one
concord-train per host, w1..w3, each its own node agent, --comm-host its
address, CONCORD_SHM=0 so that their allreduces cross the network) against
a coordinator on host `coord` (or two etcd-backed replicas and etcd), with
the fast timeouts below unless it says otherwise. Each ends on its own
(every process has a timeout) and checks, besides what it is about:
  * the launchers' exits, the finishers' outputs bit-identical;
  * the sample logs: every sample of every epoch exactly once (test_elastic);
  * the history invariants (tests/history.py, see Note [History checker]) over
    the workers' and the coordinators' histories.

Scenarios (see SCENARIOS / --list):
  heal-fast       w3 <-> coord cut for less than the heartbeat timeout:
                  no re-form.
  worker-coord    w3 <-> coord cut: the coordinator drops w3 within the
                  heartbeat timeout, w1 and w2 go on in a generation of
                  two; after the heal w3 joins again.
  worker-coord-oneway-up / -down
                  the same with only w3 -> coord (or coord -> w3) cut.
  worker-worker   w1 <-> w2 cut, both reach the coordinator: the collective
                  times out, the workers probe each other (see Note
                  [Unreachable peers] in coordinator/core/core.h), the
                  coordinator takes the younger of the two out, the job goes
                  on with the other and w3, without flapping.
  worker-worker-oneway
                  the same with only w1 -> w2 cut.
  worker-worker-restart
                  the same with --max-restarts 1: the worker taken out is
                  restarted, probes the members it is admitted to before
                  connecting, and is taken out again at once (two quick
                  re-forms, no second collective timeout).
  delay-loss      100 ms +- 20 ms and 2 % loss on every link, default
                  timeouts: the job completes, slower, with no re-form.
  leader-etcd     two coordinator replicas on etcd; the leader <-> etcd
                  cut: it stops leading before its lease can expire, the
                  standby leads, the workers move over, no generation number
                  goes back.
  leader-etcd-oneway-up / -down
                  the same with only leader -> etcd (or etcd -> leader) cut.
  leader-etcd-death
                  the cut and w3's death at once: the cut-off leader cannot
                  save the generation without w3, so tells nobody of it
                  (see Note [Asynchronous waits] in coordinator/host/host.h);
                  its successor forms it.
"""

import argparse
import glob
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(TESTS, "integration"))
sys.path.insert(0, os.path.join(TESTS, "reference"))
sys.path.insert(0, TESTS)
sys.path.insert(0, HERE)

import netlab  # noqa: E402
import elastic_harness as te  # noqa: E402
import testlib  # noqa: E402

# Fast failure detection (the scenarios' own, unless one says otherwise).
HB_INTERVAL_MS = 250
HB_TIMEOUT_MS = 2500
COLLECTIVE_TIMEOUT_MS = 8000
RENDEZVOUS_TIMEOUT_MS = 60000
COORD_PORT = 7000
RUN_TIMEOUT = 150.0  # one job, faults included
STEP_MS = 20  # CONCORD_TEST_MIN_STEP_MS: a job of ~600 steps lasts >= 12 s


class Cluster(object):
    """One scenario's lab, coordinator and workers."""

    def __init__(self, ctx, name, hosts, fast=True):
        self.ctx = ctx
        self.name = name
        self.lab = netlab.Lab(hosts, seed=7)
        self.rd = te.RunDir(ctx.tmp, name)
        self.fast = fast
        self.worker_token = te.write_token_file(os.path.join(self.rd.path, "worker-token"))
        self.operator_token = te.write_token_file(os.path.join(self.rd.path, "operator-token"))
        self.coordinators = []  # (host, Proc, history file)
        self.launchers = {}  # host -> Proc

    def close(self):
        te.Proc.kill_all()
        self.lab.close()

    def popen(self, host):
        return lambda cmd, **kw: self.lab.popen(host, cmd, **kw)

    def start_coordinator(self, host, extra=()):
        history = os.path.join(self.rd.path, "%s.coordinator.jsonl" % host)
        self.rd.coordinator_history.append(history)
        address = "%s:%d" % (self.lab.addr(host), COORD_PORT)
        proc = te.Proc("coordinator-" + host,
                       [self.ctx.bins.coordinator, "--listen", address,
                        "--worker-token-file", self.worker_token,
                        "--operator-token-file", self.operator_token,
                        "--history-file", history] + list(extra),
                       self.rd.logs, popen=self.popen(host))
        self.coordinators.append((host, proc, history))
        return address, proc

    def wait_listening(self, proc, address, timeout=20):
        return testlib.wait_for(lambda: proc.poll() is None and
                                ("listening on " + address) in proc.stderr() + proc.stdout(),
                                timeout)

    def start_workers(self, hosts, coordinator, fx, batch, epochs, env=None, restarts=0):
        for host in hosts:
            train = te.train_args(fx, self.rd, batch, epochs, shuffle_seed=7)
            cmd = [self.ctx.bins.run, "--coordinator", coordinator,
                   "--token-file", self.worker_token, "--nproc", 1, "--job-id", self.name,
                   "--comm-host", self.lab.addr(host), "--node-id", host,
                   "--min-workers", 2, "--max-workers", len(hosts),
                   "--history", self.rd.history, "--max-restarts", restarts]
            if self.fast:
                cmd += ["--heartbeat-interval-ms", HB_INTERVAL_MS,
                        "--heartbeat-timeout-ms", HB_TIMEOUT_MS,
                        "--collective-timeout-ms", COLLECTIVE_TIMEOUT_MS,
                        "--rendezvous-timeout-ms", RENDEZVOUS_TIMEOUT_MS]
            cmd += ["--", self.ctx.bins.train] + [str(a) for a in train]
            full_env = {"CONCORD_SHM": "0", "CONCORD_TEST_MIN_STEP_MS": str(STEP_MS)}
            full_env.update(env or {})
            self.launchers[host] = te.Proc("run-" + host, cmd, self.rd.logs, env=full_env,
                                           popen=self.popen(host))

    def worker_id(self, host):
        """The id concord-run gives its only worker (Note: the launcher's pid
        is concord-run's: `ip netns exec` execs it)."""
        return "%s-%s-%d-w0" % (self.name, socket.gethostname(), self.launchers[host].pid)

    def events(self):
        """Every coordinator's history records, in time order."""
        out = []
        for _, _, path in self.coordinators:
            try:
                records, _ = __import__("history").read_lines(path)
            except OSError:
                continue
            out += records
        return sorted(out, key=lambda r: r["time_us"])

    def generations(self):
        return [r for r in self.events() if r["event"] == "generation" and "members" in r]

    def step(self):
        return te.job_progress(self.rd)[0]

    def wait_step(self, step, timeout=60):
        return testlib.wait_for(lambda: self.step() >= step, timeout, 0.1)

    def finish(self, expect_exit, finishers):
        """Waits for the launchers; the common checks."""
        checks = self.ctx.checks
        deadline = time.monotonic() + RUN_TIMEOUT
        for host, proc in sorted(self.launchers.items()):
            te.expect_exit(checks, "%s: %s" % (self.name, host), proc, expect_exit.get(host, 0),
                           max(1, deadline - time.monotonic()))
        te.check_outputs_identical(checks, self.name, self.rd, expected_count=finishers)
        final = te.last_step_of(self.rd)
        # A worker cut off mid-step may commit a step its peers then give up
        # (its allreduce completed, theirs was aborted): a lost commit, which
        # the history checker allows only if that worker's state did not go
        # on into the job (see Note [History checker]).
        te.check_sample_logs(checks, self.name, self.rd, self.fx_n, self.epochs, final,
                             allow_lost_commits=True)
        return final


def fixture(ctx, n):
    return te.Fixture(ctx.tmp, n)


def start_job(ctx, name, worker_hosts=("w1", "w2", "w3"), n=240, batch=4, epochs=10,
              fast=True, extra_hosts=("coord",), restarts=0):
    """A cluster running one coordinator on `coord` and the job's workers."""
    cl = Cluster(ctx, name, list(extra_hosts) + list(worker_hosts), fast=fast)
    cl.fx_n, cl.epochs = n, epochs
    address, coord = cl.start_coordinator("coord")
    if not ctx.checks.check(cl.wait_listening(coord, address), name + ": coordinator listens",
                            coord.describe()):
        return cl, False
    cl.start_workers(worker_hosts, address, fixture(ctx, n), batch, epochs, restarts=restarts)
    started = cl.wait_step(5)
    ctx.checks.check(started, name + ": the job trains across the hosts (step 5)",
                     "\n".join(p.describe() for p in cl.launchers.values()))
    return cl, bool(started)


def cut(lab, a, b, direction):
    """Cuts a <-> b ("both"), only a -> b ("up") or only b -> a ("down")."""
    if direction == "down":
        a, b = b, a
    lab.cut(a, b, oneway=direction != "both")


def members_of(gen):
    return set(gen["members"])


# --- scenarios -------------------------------------------------------------------

def scenario_heal_fast(ctx, name):
    """A cut shorter than the heartbeat timeout changes nothing."""
    cl, ok = start_job(ctx, name)
    try:
        if not ok:
            return
        at = cl.step()
        cl.lab.cut("w3", "coord")
        time.sleep(HB_TIMEOUT_MS / 1000.0 * 0.5)
        cl.lab.heal()
        ctx.checks.check(cl.wait_step(at + 50), name + ": the job goes on after the heal")
        cl.finish({}, 3)
        gens = cl.generations()
        ctx.checks.check(len(gens) == 1, name + ": no re-form (one generation formed)",
                         json.dumps(gens)[:2000])
    finally:
        cl.close()


def cut_worker_from_coordinator(ctx, name, direction):
    """w3 cannot reach the coordinator (or it w3, or both) for twice the
    heartbeat timeout: dropped, the others go on, w3 joins again after the
    heal."""
    cl, ok = start_job(ctx, name, epochs=60)
    try:
        if not ok:
            return
        w3 = cl.worker_id("w3")
        cut(cl.lab, "w3", "coord", direction)
        cut_at = time.time()
        dropped = testlib.wait_for(lambda: [r for r in cl.events() if r["event"] == "failure"
                                            and r.get("worker") == w3], HB_TIMEOUT_MS / 1000.0 + 5)
        after = (dropped[0]["time_us"] / 1e6 - cut_at) if dropped else None
        ctx.checks.check(dropped and after <= HB_TIMEOUT_MS / 1000.0 + 1.5,
                         name + ": the coordinator drops w3 within the heartbeat timeout "
                         "(%s s after the cut; timeout %.1f s)" % (
                             "%.2f" % after if after is not None else "never", HB_TIMEOUT_MS / 1000.0),
                         json.dumps(cl.events()[-10:])[:3000])
        two = testlib.wait_for(lambda: [g for g in cl.generations()
                                        if w3 not in members_of(g) and len(g["members"]) == 2], 20)
        ctx.checks.check(two, name + ": w1 and w2 form a generation without w3",
                         json.dumps(cl.generations())[:2000])
        at = cl.step()
        ctx.checks.check(cl.wait_step(at + 30, 30), name + ": the job goes on without w3 (30 steps)")
        time.sleep(max(0.0, cut_at + 2 * HB_TIMEOUT_MS / 1000.0 - time.time()))
        cl.lab.heal()
        healed = time.time()
        back = testlib.wait_for(lambda: [g for g in cl.generations()
                                         if w3 in members_of(g) and g["generation"] > 1], 40)
        ctx.checks.check(back, name + ": w3 joins again after the heal (%s)" % (
            "%.1f s after it" % (back[0]["time_us"] / 1e6 - healed) if back else "not within 40 s"),
            "\n".join(p.describe(3000) for p in cl.launchers.values()))
        cl.finish({}, 3 if back else 2)
    finally:
        cl.close()


def scenario_delay_loss(ctx, name):
    """Slow, lossy links everywhere with the default timeouts: slower, no
    re-form."""
    cl, ok = start_job(ctx, name, n=120, epochs=3, fast=False)
    try:
        if not ok:
            return
        cl.lab.impair_all(delay_ms=100, jitter_ms=20, loss=0.02)
        at = cl.step()
        t0 = time.monotonic()
        moved = cl.wait_step(at + 10, 60)
        ctx.checks.check(moved, name + ": the job goes on over slow, lossy links (%s)" % (
            "10 steps in %.1f s" % (time.monotonic() - t0) if moved else "stuck"))
        cl.finish({}, 3)
        gens = cl.generations()
        ctx.checks.check(len(gens) == 1, name + ": no re-form (one generation formed)",
                         json.dumps(gens)[:2000])
        stats = cl.lab.stats()
        lost = sum(s["lost"] for s in stats.values())
        ctx.checks.check(lost > 0, name + ": the links lost frames (%d)" % lost)
    finally:
        cl.close()


def scenario_worker_worker(ctx, name, oneway=False, restarts=0):
    """w1 and w2 cannot reach each other (or w1 cannot reach w2), both
    reach the coordinator: the collective times out, the workers find which
    peers they cannot reach (see Note [Unreachable peers]), the coordinator
    takes one of the two out, the job goes on without flapping. With
    `restarts`, the one taken out is restarted (a newcomer), probes the
    members it is admitted to before connecting, and is taken out again at
    once rather than after another collective timeout."""
    cl, ok = start_job(ctx, name, epochs=60, restarts=restarts)
    try:
        if not ok:
            return
        ids = {h: cl.worker_id(h) for h in ("w1", "w2", "w3")}
        cl.lab.cut("w1", "w2", oneway=oneway)
        cut_at = time.time()
        limit = COLLECTIVE_TIMEOUT_MS / 1000.0 + 20

        def drained():
            return [r for r in cl.events() if r["event"] == "drain"]
        out = testlib.wait_for(drained, limit)
        out = out and out[:1]
        ctx.checks.check(out and len(out) == 1 and out[0].get("worker") in (ids["w1"], ids["w2"]) and
                         "unreachable" in out[0].get("message", ""),
                         name + ": the coordinator takes one of w1, w2 out (%s)" % (
                             "%s, %.1f s after the cut" % (
                                 [h for h, w in ids.items() if w == out[0].get("worker")],
                                 out[0]["time_us"] / 1e6 - cut_at) if out else "nobody"),
                         json.dumps(cl.events()[-12:])[:4000])
        if not out:
            return
        gone = [h for h, w in ids.items() if w == out[0].get("worker")][0]
        kept = [h for h in ("w1", "w2") if h != gone][0]
        two = testlib.wait_for(lambda: [g for g in cl.generations()
                                        if set(g["members"]) == {ids[kept], ids["w3"]}], 20)
        ctx.checks.check(two, name + ": %s and w3 go on in a generation of two" % kept,
                         json.dumps(cl.generations())[:3000])
        if restarts:
            again = ids[gone] + "-r1"
            second = testlib.wait_for(lambda: [r for r in drained() if r.get("worker") == again], 40)
            joined = [r for r in cl.events() if r["event"] == "join" and r.get("worker") == again]
            took = (second[0]["time_us"] - joined[0]["time_us"]) / 1e6 if second and joined else None
            ctx.checks.check(second and took < COLLECTIVE_TIMEOUT_MS / 1000.0,
                             name + ": restarted, %s is taken out again %s after it joined "
                             "(collective timeout %.0f s)" % (
                                 gone, "%.1f s" % took if took is not None else "never",
                                 COLLECTIVE_TIMEOUT_MS / 1000.0),
                             json.dumps(cl.events()[-12:])[:4000])
        at = cl.step()
        ctx.checks.check(cl.wait_step(at + 100, 40), name + ": the job goes on (100 steps)")
        # No flapping: the generation of two is the last one until the end.
        cl.finish({gone: 1}, 2)
        gens = cl.generations()
        ctx.checks.check(gens and set(gens[-1]["members"]) == {ids[kept], ids["w3"]} and
                         len(gens) <= 4 + 2 * restarts,
                         name + ": no flapping (generations %s)" % [len(g["members"]) for g in gens],
                         json.dumps(gens)[:3000])
        if restarts:
            committed = [p for p in glob.glob(os.path.join(cl.rd.history, ids[gone] + "-r1.history"))
                         if '"event":"commit"' in te.read_text(p)]
            ctx.checks.check(not committed, name + ": the restarted %s never trained" % gone)
        err = cl.launchers[gone].stderr()
        ctx.checks.check("taken out of job" in err,
                         name + ": %s says it was taken out" % gone, err[-2000:])
    finally:
        cl.close()


LEASE_TTL = 2  # seconds: the leader renews every TTL/4, steps down at 2/3 TTL


def log_time(text, needle):
    """The time (Unix s) of the first spdlog line of `text` holding `needle`."""
    for line in text.splitlines():
        if needle in line:
            stamp = line[line.find("[") + 1:line.find("]")]
            try:
                return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + \
                    float("0" + stamp[19:])
            except ValueError:
                return None
    return None


def leader_etcd_cut(ctx, name, direction, kill=False):
    """The leading replica loses etcd (both ways, or one): it stops leading
    before its lease can expire, the standby leads, the workers move over,
    no generation number goes back. With `kill`, w3 dies at the cut: the
    leader cannot save the generation without it, so must not tell anyone
    of it; the successor forms it."""
    workers = ("w1", "w2", "w3")
    cl = Cluster(ctx, name, ["coord1", "coord2", "etcd"] + list(workers))
    cl.fx_n, cl.epochs = 240, 60
    try:
        etcd_url = "http://%s:2379" % cl.lab.addr("etcd")
        peer = "http://%s:2380" % cl.lab.addr("etcd")
        etcd = te.Proc("etcd", [shutil.which("etcd") or "etcd", "--name", "e",
                                "--data-dir", os.path.join(cl.rd.path, "etcd-data"),
                                "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
                                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                "--initial-cluster", "e=" + peer, "--log-level", "error"],
                       cl.rd.logs, popen=cl.popen("etcd"))
        store = ["--store", "etcd", "--etcd-endpoints", etcd_url, "--etcd-lease-ttl", LEASE_TTL]
        a_addr, a = cl.start_coordinator("coord1", store)
        if not ctx.checks.check(cl.wait_listening(a, a_addr, 30), name + ": coord1 leads",
                                a.describe() + etcd.describe()):
            return
        b_addr, b = cl.start_coordinator("coord2", store)
        ctx.checks.check(testlib.wait_for(lambda: "standing by" in b.stderr(), 20),
                         name + ": coord2 stands by", b.describe())
        cl.start_workers(workers, "%s,%s" % (a_addr, b_addr), fixture(ctx, 240), 4, 60)
        if not ctx.checks.check(cl.wait_step(20), name + ": the job trains on coord1 (step 20)",
                                "\n".join(p.describe() for p in cl.launchers.values())):
            return
        cut(cl.lab, "coord1", "etcd", direction)
        cut_at = time.time()
        if kill:
            cl.launchers["w3"].kill_group()
        leads = testlib.wait_for(lambda: ("listening on " + b_addr) in b.stderr(), 6 * LEASE_TTL + 10)
        stepped = log_time(a.stderr(), "lost leadership")
        took = log_time(b.stderr(), "listening on " + b_addr)
        ctx.checks.check(leads and stepped is not None and took is not None and stepped < took,
                         name + ": coord1 stops leading (%s s after the cut) before coord2 leads "
                         "(%s s after it; lease TTL %d s)" % (
                             "%.2f" % (stepped - cut_at) if stepped else "never",
                             "%.2f" % (took - cut_at) if took else "never", LEASE_TTL),
                         a.describe() + b.describe())
        at = cl.step()
        ctx.checks.check(cl.wait_step(at + 50, 40), name + ": the workers go on with coord2 (50 steps)",
                         "\n".join(p.describe() for p in cl.launchers.values()))
        cl.lab.heal()
        cl.finish({"w3": -signal.SIGKILL} if kill else {}, 2 if kill else 3)
        gens = cl.generations()
        numbers = [g["generation"] for g in gens]
        if kill:
            ctx.checks.check(len(gens) == 2 and len(gens[1]["members"]) == 2 and
                             gens[1]["pid"] == b.pid,
                             name + ": coord2 formed generation 2 without w3",
                             json.dumps(gens)[:2000])
        ctx.checks.check(numbers == sorted(set(numbers)),
                         name + ": generation numbers never go back or repeat: %s" % numbers)
    finally:
        cl.close()


SCENARIOS = {
    "leader-etcd": lambda ctx, name: leader_etcd_cut(ctx, name, "both"),
    "leader-etcd-oneway-up": lambda ctx, name: leader_etcd_cut(ctx, name, "up"),
    "leader-etcd-oneway-down": lambda ctx, name: leader_etcd_cut(ctx, name, "down"),
    "leader-etcd-death": lambda ctx, name: leader_etcd_cut(ctx, name, "both", kill=True),
    "worker-worker": scenario_worker_worker,
    "worker-worker-oneway": lambda ctx, name: scenario_worker_worker(ctx, name, oneway=True),
    "worker-worker-restart": lambda ctx, name: scenario_worker_worker(ctx, name, restarts=1),
    "heal-fast": scenario_heal_fast,
    "worker-coord": lambda ctx, name: cut_worker_from_coordinator(ctx, name, "both"),
    "worker-coord-oneway-up": lambda ctx, name: cut_worker_from_coordinator(ctx, name, "up"),
    "worker-coord-oneway-down": lambda ctx, name: cut_worker_from_coordinator(ctx, name, "down"),
    "delay-loss": scenario_delay_loss,
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir")
    p.add_argument("--scenario", action="append", default=[], choices=list(SCENARIOS))
    p.add_argument("--list", action="store_true")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    if args.list:
        print("\n".join(SCENARIOS))
        return 0
    reason = netlab.skip_reason()  # not root, no `ip`, no /dev/net/tun
    if reason:
        print("CONCORD_TEST_SKIPPED: %s" % reason)
        return 0
    checks = testlib.Checks()
    bins = te.Bins(args.bin_dir)
    if bins.missing():
        checks.fail("concord binaries present", "missing: %s" % bins.missing())
        return checks.finish()
    tmp = tempfile.mkdtemp(prefix="concord_netfault_")
    ctx = te.Context(bins, checks, tmp, 0)
    selected = args.scenario or list(SCENARIOS)
    te.run_cases(ctx, [(name, lambda c, n=name: SCENARIOS[n](c, n)) for name in selected], args.keep)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

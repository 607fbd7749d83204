#!/usr/bin/python3
"""concord-coordinator under a Type=notify unit, without systemd: the test owns
the notification socket (a unix datagram socket, as systemd's) and starts the
real binary with NOTIFY_SOCKET and WATCHDOG_USEC, as systemd would.

    /usr/bin/python3 tests/deploy/test_systemd_notify.py --bin-dir build/bin

Checks:
  1. embedded store: READY=1 arrives, and the gRPC port accepts a connection
     the moment it does (READY is never early); STATUS= names the address;
     WATCHDOG=1 arrives repeatedly at about half of WATCHDOG_USEC;
     SIGTERM brings STOPPING=1, then a clean exit (status 0).
  2. WATCHDOG_PID naming another process: no WATCHDOG=1 (the watchdog is not
     ours), READY=1 still.
  3. without NOTIFY_SOCKET: the coordinator serves and stops as before.
  4. etcd replicas (a real etcd on loopback, when etcd is installed): a standby
     sends READY=1 with STATUS=standby... while not listening; when the leader
     gets SIGTERM it takes over and sends STATUS=leader; serving on ... once
     its port accepts; its watchdog pings continue through both phases.

Prints one line per check and 'N passed, N failed'; exits 1 on any failure.
Every process and wait has a timeout.
"""

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testlib import Checks, accepts, free_port  # noqa: E402

WATCHDOG_USEC = 1000000  # 1 s: pings expected every ~0.5 s


class NotifySocket(object):
    """systemd's end: a unix datagram socket collecting (time, message)."""

    def __init__(self, path, on_ready_port=None):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.messages = []  # (monotonic time, {key: value}, raw)
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        # Port to try the instant a READY=1 arrives: (port accepted?) per READY.
        self.on_ready_port = on_ready_port
        self.ready_port_accepted = []
        self.done = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            now = time.monotonic()
            raw = data.decode("utf-8", "replace")
            fields = {}
            for line in raw.split("\n"):
                if "=" in line:
                    k, v = line.split("=", 1)
                    fields[k] = v
            if fields.get("READY") == "1" and self.on_ready_port is not None:
                # Before anything else: the port must accept right now.
                self.ready_port_accepted.append(accepts(self.on_ready_port))
            with self.cv:
                self.messages.append((now, fields, raw))
                self.cv.notify_all()

    def wait_for(self, predicate, timeout):
        """The first message (time, fields) with predicate(fields), or None."""
        deadline = time.monotonic() + timeout
        with self.cv:
            while True:
                for t, fields, _ in self.messages:
                    if predicate(fields):
                        return t, fields
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cv.wait(left)

    def snapshot(self):
        with self.lock:
            return list(self.messages)

    def close(self):
        self.done = True
        self.thread.join(timeout=2)
        self.sock.close()


def start(bins, directory, name, args, env_extra):
    env = dict(os.environ)
    for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(k, None)
    env.update(env_extra)
    out = open(os.path.join(directory, name + ".log"), "w")
    proc = subprocess.Popen([os.path.join(bins, "concord-coordinator")] + args,
                            stdout=out, stderr=subprocess.STDOUT, env=env)
    proc.log_path = out.name
    return proc


def log_of(proc):
    with open(proc.log_path) as f:
        return f.read()


def stop(proc, sig=signal.SIGTERM, timeout=15):
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def watchdog_times(messages):
    return [t for t, f, _ in messages if f.get("WATCHDOG") == "1"]


def check_periods(c, what, times, expected):
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not c.check(len(gaps) >= 3, what + ": WATCHDOG=1 arrives repeatedly",
                   "%d pings" % len(times)):
        return
    mean = sum(gaps) / len(gaps)
    c.check(0.7 * expected <= mean <= 1.5 * expected,
            what + ": mean ping period near half of WATCHDOG_USEC",
            "mean %.3f s, expected %.3f s" % (mean, expected))
    c.check(max(gaps) < WATCHDOG_USEC / 1e6,
            what + ": no gap reaches the watchdog interval",
            "max gap %.3f s" % max(gaps))


def embedded(c, bins, d, tokens):
    port = free_port()
    sock = NotifySocket(os.path.join(d, "notify-1.sock"), on_ready_port=port)
    proc = start(bins, d, "embedded", ["--listen", "127.0.0.1:%d" % port] + tokens,
                 {"NOTIFY_SOCKET": sock.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)})
    try:
        ready = sock.wait_for(lambda f: f.get("READY") == "1", 30)
        if not c.check(ready is not None, "embedded: READY=1 received", log_of(proc)[-500:]):
            return
        c.check(sock.ready_port_accepted[:1] == [True],
                "embedded: the gRPC port accepted a connection the moment READY=1 came")
        c.check("127.0.0.1:%d" % port in ready[1].get("STATUS", ""),
                "embedded: READY's STATUS= names the address", ready[1].get("STATUS"))
        time.sleep(3.2)
        check_periods(c, "embedded", [t for t in watchdog_times(sock.snapshot())
                                      if t >= ready[0]], WATCHDOG_USEC / 2e6)
        before = time.monotonic()
        code = stop(proc)
        stopping = sock.wait_for(lambda f: f.get("STOPPING") == "1", 5)
        c.check(stopping is not None and stopping[0] >= before,
                "embedded: STOPPING=1 after SIGTERM",
                stopping[1].get("STATUS") if stopping else "none")
        c.check(code == 0, "embedded: exit status 0 after SIGTERM", str(code))
        last_ping = max(watchdog_times(sock.snapshot()) or [0])
        c.check(stopping is None or last_ping <= stopping[0] + 0.01,
                "embedded: no WATCHDOG=1 after STOPPING=1")
    finally:
        stop(proc, signal.SIGKILL)
        sock.close()


def foreign_watchdog(c, bins, d, tokens):
    port = free_port()
    sock = NotifySocket(os.path.join(d, "notify-2.sock"))
    proc = start(bins, d, "foreign", ["--listen", "127.0.0.1:%d" % port] + tokens,
                 {"NOTIFY_SOCKET": sock.path, "WATCHDOG_USEC": str(WATCHDOG_USEC),
                  "WATCHDOG_PID": str(os.getpid())})
    try:
        ready = sock.wait_for(lambda f: f.get("READY") == "1", 30)
        c.check(ready is not None, "WATCHDOG_PID of another process: READY=1 still sent")
        time.sleep(1.5)
        c.check(watchdog_times(sock.snapshot()) == [],
                "WATCHDOG_PID of another process: no WATCHDOG=1")
        c.check(stop(proc) == 0, "WATCHDOG_PID of another process: clean exit")
    finally:
        stop(proc, signal.SIGKILL)
        sock.close()


def no_socket(c, bins, d, tokens):
    port = free_port()
    proc = start(bins, d, "plain", ["--listen", "127.0.0.1:%d" % port] + tokens,
                 {"WATCHDOG_USEC": str(WATCHDOG_USEC)})
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not accepts(port) and proc.poll() is None:
            time.sleep(0.05)
        c.check(accepts(port), "without NOTIFY_SOCKET: serves as before", log_of(proc)[-300:])
        c.check(stop(proc) == 0, "without NOTIFY_SOCKET: clean exit")
    finally:
        stop(proc, signal.SIGKILL)


def etcd_replicas(c, bins, d, tokens):
    etcd_bin = shutil.which("etcd")
    if etcd_bin is None:
        c.check(False, "etcd: the etcd binary (Debian etcd-server, scripts/install-deps.sh)")
        return
    client = "http://127.0.0.1:%d" % free_port()
    peer = "http://127.0.0.1:%d" % free_port()
    etcd = subprocess.Popen([etcd_bin, "--name", "t", "--data-dir", os.path.join(d, "etcd"),
                             "--listen-client-urls", client, "--advertise-client-urls", client,
                             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                             "--initial-cluster", "t=" + peer, "--log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port_a, port_b = free_port(), free_port()
    common = tokens + ["--store", "etcd", "--etcd-endpoints", client, "--etcd-lease-ttl", "2"]
    a = b = None
    sock = NotifySocket(os.path.join(d, "notify-3.sock"), on_ready_port=port_b)
    try:
        a = start(bins, d, "replica-a", ["--listen", "127.0.0.1:%d" % port_a] + common, {})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not accepts(port_a) and a.poll() is None:
            time.sleep(0.05)
        if not c.check(accepts(port_a), "etcd: replica A leads", log_of(a)[-300:]):
            return
        b = start(bins, d, "replica-b", ["--listen", "127.0.0.1:%d" % port_b] + common,
                  {"NOTIFY_SOCKET": sock.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)})
        ready = sock.wait_for(lambda f: f.get("READY") == "1", 30)
        if not c.check(ready is not None and ready[1].get("STATUS", "").startswith("standby"),
                       "etcd: the standby sends READY=1 with STATUS=standby...",
                       ready[1].get("STATUS") if ready else log_of(b)[-300:]):
            return
        c.check(not accepts(port_b), "etcd: the standby does not listen")
        time.sleep(2.2)
        check_periods(c, "etcd standby", [t for t in watchdog_times(sock.snapshot())
                                          if t >= ready[0]], WATCHDOG_USEC / 2e6)
        took_over_from = time.monotonic()
        stop(a)
        leader = sock.wait_for(lambda f: f.get("STATUS", "").startswith("leader"), 15)
        c.check(leader is not None and "127.0.0.1:%d" % port_b in leader[1]["STATUS"],
                "etcd: on take-over STATUS= says leader and names the address",
                leader[1].get("STATUS") if leader else log_of(b)[-300:])
        c.check(len(sock.ready_port_accepted) >= 2 and sock.ready_port_accepted[1:] == [True] * (
            len(sock.ready_port_accepted) - 1) and accepts(port_b),
                "etcd: the new leader's port accepted when it said so",
                str(sock.ready_port_accepted))
        time.sleep(2.2)
        check_periods(c, "etcd leader", [t for t in watchdog_times(sock.snapshot())
                                         if t >= took_over_from], WATCHDOG_USEC / 2e6)
        code = stop(b)
        c.check(sock.wait_for(lambda f: f.get("STOPPING") == "1", 5) is not None and code == 0,
                "etcd: STOPPING=1 and exit 0 after SIGTERM", str(code))
    finally:
        for p in (a, b):
            if p is not None:
                stop(p, signal.SIGKILL)
        stop(etcd, signal.SIGKILL)
        sock.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--skip-etcd", action="store_true")
    args = parser.parse_args()
    d = tempfile.mkdtemp(prefix="concord-notify-")
    tokens = []
    for role, value in (("worker", "w" * 24), ("operator", "o" * 24)):
        path = os.path.join(d, role + ".token")
        with open(path, "w") as f:
            f.write(value + "\n")
        tokens += ["--%s-token-file" % role, path]
    c = Checks()
    try:
        embedded(c, args.bin_dir, d, tokens)
        foreign_watchdog(c, args.bin_dir, d, tokens)
        no_socket(c, args.bin_dir, d, tokens)
        if not args.skip_etcd:
            etcd_replicas(c, args.bin_dir, d, tokens)
    finally:
        if args.keep:
            print("kept " + d)
        else:
            shutil.rmtree(d, ignore_errors=True)
    print("%d passed, %d failed" % (c.passed, c.failed))
    sys.exit(1 if c.failed else 0)


if __name__ == "__main__":
    main()

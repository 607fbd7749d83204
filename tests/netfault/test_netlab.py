#!/usr/bin/python3
"""Self-test of netlab: an emulated network with faults, on this machine.

A Lab of three hosts a, b, c, each running an agent (this script with
--agent: a TCP sink, a UDP echo and a UDP counter, driven by JSON lines on
its stdin). Checked:
  1. every host reaches every other by TCP; none reaches the root
     namespace's services (loopback or the machine's own addresses);
  2. cut(a, b): TCP connects both ways time out, the switch counts cut
     frames; heal restores;
  3. cut(a, b, oneway=True): UDP a -> b lost, b -> a delivered;
  4. impair(a, b, delay 100 ms, jitter 20 ms): UDP echo RTT median about
     200 ms (under 20 ms before);
  5. impair(a, b, loss 0.2, one way): 2000 datagrams, 80% +- 4% delivered,
     the switch's counters agree;
  6. 200 MB of TCP a -> b arrive (MB/s printed);
  7. cleanup: after the `with`, no namespace, switch or process of the lab
     is left; a SIGTERMed test's Lab cleans up after itself; a SIGKILLed
     test's leftovers are swept by the next Lab;
  8. a second Lab alongside the first works on its own.
Exits 0 printing 'CONCORD_TEST_SKIPPED: ...' where namespaces cannot be made.
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import netlab  # noqa: E402
import testlib  # noqa: E402

TCP_PORT, ECHO_PORT, COUNT_PORT = 7000, 7001, 7002
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux: root's way past rmem_max
BULK_BYTES = 200 * 1000 * 1000


# ---- the agent: runs inside a host --------------------------------------

def serve_tcp_sink(listener):
    """Each connection: read to EOF, answer the byte count, close."""
    def drain(conn):
        with conn:
            buf, total = bytearray(1 << 20), 0
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                total += n
            conn.sendall(str(total).encode())
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=drain, args=(conn,), daemon=True).start()


def serve_udp_echo(sock):
    while True:
        data, peer = sock.recvfrom(65536)
        sock.sendto(data, peer)


def serve_udp_count(sock, state):
    while True:
        sock.recv(65536)
        state["count"] += 1
        state["last"] = time.monotonic()


def op_connect(state, addr, port=TCP_PORT, timeout=1.0):
    start = time.monotonic()
    try:
        socket.create_connection((addr, port), timeout=timeout).close()
    except OSError as e:
        return {"connected": False, "s": time.monotonic() - start, "error": str(e)}
    return {"connected": True, "s": time.monotonic() - start}


def op_bulk(state, addr, nbytes):
    chunk = b"x" * (1 << 20)
    start = time.monotonic()
    with socket.create_connection((addr, TCP_PORT), timeout=30) as s:
        for offset in range(0, nbytes, len(chunk)):
            s.sendall(chunk[:nbytes - offset])
        s.shutdown(socket.SHUT_WR)
        received = int(s.recv(100))
    return {"received": received, "s": time.monotonic() - start}


def op_udp_send(state, addr, n):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(n):
            s.sendto(b"d%d" % i, (addr, COUNT_PORT))
            if i % 100 == 99:
                time.sleep(0.002)
    return {}


def op_udp_count(state, settle=0.3, timeout=5.0):
    """Datagrams counted since the last call, once none came for `settle` s
    (and `settle` s passed: some may still be on their way)."""
    start = time.monotonic()
    while time.monotonic() < start + timeout and \
            time.monotonic() - max(start, state["last"]) < settle:
        time.sleep(0.05)
    count, state["count"] = state["count"], 0
    return {"count": count}


def op_rtt(state, addr, n, timeout=2.0):
    """UDP echo round trips to addr, in ms (None: no answer in time)."""
    rtts = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(n):
            start = time.monotonic()
            s.settimeout(timeout)
            s.sendto(b"%d" % i, (addr, ECHO_PORT))
            rtts.append(None)
            try:
                while s.recv(100) != b"%d" % i:
                    pass
                rtts[-1] = (time.monotonic() - start) * 1000.0
            except socket.timeout:
                pass
    return {"rtts": rtts}


AGENT_OPS = {"connect": op_connect, "bulk": op_bulk, "udp_send": op_udp_send,
             "udp_count": op_udp_count, "rtt": op_rtt}


def agent():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", TCP_PORT))
    listener.listen(64)
    echo = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    echo.bind(("0.0.0.0", ECHO_PORT))
    counter = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    counter.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
    counter.bind(("0.0.0.0", COUNT_PORT))
    state = {"count": 0, "last": 0.0}
    for target, args in ((serve_tcp_sink, (listener,)), (serve_udp_echo, (echo,)),
                         (serve_udp_count, (counter, state))):
        threading.Thread(target=target, args=args, daemon=True).start()
    print(json.dumps({"ok": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(AGENT_OPS[request.pop("op")](state, **request)), flush=True)
    return 0


class Agent(object):
    """The test's handle on the agent of one host."""

    def __init__(self, lab, host):
        self.proc = lab.popen(host, [sys.executable, os.path.abspath(__file__), "--agent"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pipe = netlab.JsonPipe(self.proc, "agent on %s" % host)
        self.pipe.read(10)

    def __call__(self, op, wait=60, **args):
        """The agent's answer to `op`, within `wait` seconds."""
        return self.pipe.request(dict(args, op=op), wait)


# ---- the checks ------------------------------------------------------------

def outcome(result):
    """An agent's connect result, in words."""
    if result["connected"]:
        return "connected in %.1f ms" % (result["s"] * 1000)
    return "%s after %.2f s" % (result["error"], result["s"])


def check_reachability(checks, lab, agents):
    failed = []
    for a in lab.hosts:
        for b in lab.hosts:
            result = agents[a]("connect", addr=lab.addr(b)) if a != b else None
            if result and not result["connected"]:
                failed.append("%s->%s: %s" % (a, b, outcome(result)))
    checks.check(not failed, "every host connects to every other by TCP", "; ".join(failed))
    rtts = agents["a"]("rtt", addr=lab.addr("b"), n=5)["rtts"]
    checks.check(None not in rtts, "UDP echo a -> b answered", "RTTs %s ms" % ", ".join(
        "%.2f" % r if r is not None else "lost" for r in rtts))


def root_addresses():
    """The machine's IPv4 addresses other than loopback."""
    out = subprocess.run([netlab.IP, "-4", "-o", "addr", "show"], capture_output=True, text=True,
                         timeout=10).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines() if " lo " not in line]


def check_isolation(checks, agents):
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen(8)
        port = server.getsockname()[1]
        reached = [addr for addr in ["127.0.0.1"] + root_addresses()
                   if agents["a"]("connect", addr=addr, port=port, timeout=1.0)["connected"]]
    checks.check(not reached, "a host cannot reach the root namespace's services",
                 "reached %s" % reached)


def check_cut(checks, lab, agents):
    before = lab.stats()
    lab.cut("a", "b")
    ab = agents["a"]("connect", addr=lab.addr("b"), timeout=0.5)
    ba = agents["b"]("connect", addr=lab.addr("a"), timeout=0.5)
    after = lab.stats()
    checks.check(not ab["connected"] and not ba["connected"]
                 and "timed out" in ab["error"] and "timed out" in ba["error"],
                 "cut(a, b): TCP connects both ways time out",
                 "a->b %s, b->a %s" % (outcome(ab), outcome(ba)))
    drops = [after[k]["cut"] - before[k]["cut"] for k in (("a", "b"), ("b", "a"))]
    checks.check(drops[0] > 0 and drops[1] > 0, "cut(a, b): the switch counts cut frames",
                 "a->b %d, b->a %d" % tuple(drops))
    lab.heal("a", "b")
    ab = agents["a"]("connect", addr=lab.addr("b"))
    ba = agents["b"]("connect", addr=lab.addr("a"))
    checks.check(ab["connected"] and ba["connected"], "heal(a, b): TCP connects again",
                 "a->b %s, b->a %s" % (outcome(ab), outcome(ba)))


def check_oneway_cut(checks, lab, agents):
    lab.cut("a", "b", oneway=True)
    agents["a"]("udp_send", addr=lab.addr("b"), n=20)
    agents["b"]("udp_send", addr=lab.addr("a"), n=20)
    at_b = agents["b"]("udp_count")["count"]
    at_a = agents["a"]("udp_count")["count"]
    lab.heal()
    checks.check(at_b == 0 and at_a == 20, "cut(a, b, oneway): a -> b lost, b -> a delivered",
                 "20 sent each way: %d arrived at b, %d at a" % (at_b, at_a))


def median_rtt(agents, lab, n):
    rtts = agents["a"]("rtt", addr=lab.addr("b"), n=n)["rtts"]
    return statistics.median(r if r is not None else float("inf") for r in rtts)


def check_delay(checks, lab, agents):
    plain = median_rtt(agents, lab, 10)
    checks.check(plain < 20, "no delay: UDP echo RTT under 20 ms", "median %.2f ms" % plain)
    lab.impair("a", "b", delay_ms=100, jitter_ms=20)
    delayed = median_rtt(agents, lab, 11)
    connect = agents["a"]("connect", addr=lab.addr("b"))
    lab.heal("a", "b")
    checks.check(160 <= delayed <= 260, "impair(a, b, delay 100 ms, jitter 20 ms): RTT ~200 ms",
                 "median %.1f ms, TCP connect %.0f ms" % (delayed, connect["s"] * 1000))


def wait_quiet(lab, seconds=0.2, timeout=5.0):
    """Waits until no frame is held and none went through for `seconds`:
    what earlier checks left in flight (a FIN under delay) is done."""
    def frames():
        stats = lab.stats()
        return sum(c["frames"] + c["cut"] + c["lost"] for c in stats.values()), \
            sum(c["queued"] for c in stats.values())
    deadline = time.monotonic() + timeout
    last = frames()
    while time.monotonic() < deadline:
        time.sleep(seconds)
        now = frames()
        if now == last and not now[1]:
            return
        last = now


def check_loss(checks, lab, agents):
    sent = 2000
    wait_quiet(lab)
    before = lab.stats()[("a", "b")]
    lab.impair("a", "b", loss=0.2, oneway=True)
    agents["a"]("udp_send", addr=lab.addr("b"), n=sent)
    got = agents["b"]("udp_count")["count"]
    lab.heal("a", "b")
    after = lab.stats()[("a", "b")]
    fraction = got / float(sent)
    checks.check(abs(fraction - 0.8) <= 0.04, "impair(a, b, loss 0.2, oneway): ~80% delivered",
                 "%d of %d (%.3f)" % (got, sent, fraction))
    lost, passed = after["lost"] - before["lost"], after["frames"] - before["frames"]
    checks.check(abs(lost - (sent - got)) <= 2 and abs(passed - got) <= 2,
                 "loss: the switch's counters agree", "lost %d, forwarded %d" % (lost, passed))


def check_throughput(checks, lab, agents):
    result = agents["a"]("bulk", addr=lab.addr("b"), nbytes=BULK_BYTES, wait=50)
    rate = result["received"] / result["s"] / 1e6
    checks.check(result["received"] == BULK_BYTES, "200 MB of TCP a -> b arrive",
                 "%.0f MB/s at MTU %d" % (rate, lab.mtu))


def check_second_lab(checks, lab, agents):
    with netlab.Lab(["a", "b"], seed=2) as other:
        others = {host: Agent(other, host) for host in other.hosts}
        lab.cut("a", "b")
        here = agents["a"]("connect", addr=lab.addr("b"), timeout=0.5)
        there = others["a"]("connect", addr=other.addr("b"))
        lab.heal()
        names_differ = other.netns("a") != lab.netns("a")
    checks.check(names_differ and there["connected"] and not here["connected"],
                 "a second Lab alongside works on its own",
                 "%s and %s: cut here, connects there" % (lab.name, other.name))


# ---- cleanup ---------------------------------------------------------------

def lab_namespaces(name):
    return [ns for ns in os.listdir(netlab.NETNS_DIR) if ns.startswith(name + "-")]


def switch_pids(name):
    """Pids of netswitch processes serving the Lab `name`."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/cmdline" % entry, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"netswitch.py") for a in argv) and name.encode() in argv:
            pids.append(int(entry))
    return pids


def check_closed(checks, name, pids):
    alive = [pid for pid in pids if netlab.pid_alive(pid)]
    left = lab_namespaces(name) + ["switch %d" % p for p in switch_pids(name)]
    checks.check(not alive and not left, "after the with block: nothing of lab %s left" % name,
                 "alive %s, left %s" % (alive, left))


CHILD = """
import json, sys, time
sys.path.insert(0, %r)
import netlab
lab = netlab.Lab(["x", "y"])
sleeper = lab.popen("x", ["sleep", "60"])
print(json.dumps({"name": lab.name, "sleeper": sleeper.pid}), flush=True)
time.sleep(60)
""" % HERE


def start_child_lab():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE)
    pipe = netlab.JsonPipe(child, "child test")
    return child, pipe.read(20)


def check_sigterm(checks):
    child, info = start_child_lab()
    child.send_signal(signal.SIGTERM)
    status = child.wait(20)
    left = lab_namespaces(info["name"]) + switch_pids(info["name"])
    checks.check(status == 128 + signal.SIGTERM and not left
                 and not netlab.pid_alive(info["sleeper"]),
                 "a SIGTERMed test closes its Lab", "exit status %s, left %s" % (status, left))


def check_sigkill_sweep(checks):
    child, info = start_child_lab()
    child.kill()
    child.wait(20)
    gone = testlib.wait_for(lambda: not switch_pids(info["name"]), 5)
    orphaned = lab_namespaces(info["name"])  # unless a concurrent test's Lab swept them
    with netlab.Lab(["z"]):
        left = lab_namespaces(info["name"])
        sleeper = netlab.pid_alive(info["sleeper"])
    checks.check(gone and not left and not sleeper,
                 "a SIGKILLed test's leftovers: its switch exits, the next Lab sweeps the rest",
                 "switch gone: %s; namespaces %s, then %s; its sleep alive: %s"
                 % (bool(gone), orphaned, left, sleeper))


def attempt(checks, name, function, *args):
    """Runs one check function; an exception in it is one FAIL line."""
    try:
        function(checks, *args)
    except Exception:
        checks.fail(name, traceback.format_exc())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin-dir", help="ignored (uniform with the other test scripts)")
    parser.add_argument("--agent", action="store_true", help="run as the agent of a host")
    if parser.parse_args().agent:
        return agent()
    checks = testlib.Checks()
    start = time.monotonic()
    try:
        lab = netlab.Lab(["a", "b", "c"], seed=1)
    except netlab.Skip as e:
        print("CONCORD_TEST_SKIPPED: %s" % e)
        return 0
    with lab:
        agents = {host: Agent(lab, host) for host in lab.hosts}
        for name, function in (("reachability", check_reachability), ("cut", check_cut),
                               ("oneway cut", check_oneway_cut), ("delay", check_delay),
                               ("loss", check_loss), ("throughput", check_throughput),
                               ("second lab", check_second_lab)):
            attempt(checks, name, function, lab, agents)
        attempt(checks, "isolation", check_isolation, agents)
        pids = [agent.proc.pid for agent in agents.values()]
    check_closed(checks, lab.name, pids)
    attempt(checks, "sigterm", check_sigterm)
    attempt(checks, "sigkill sweep", check_sigkill_sweep)
    print("self-test took %.1f s" % (time.monotonic() - start))
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""The userspace Ethernet switch of netlab: forwards frames between TAP
devices and applies per-link faults (cut, loss, delay with jitter).

Why userspace: the kernels this runs on have no netem (no delay/jitter
qdisc at all), so faults cannot be put on veth pairs with `tc`. Instead
every host's only interface is a TAP device whose other end is a file
descriptor held here; every frame a host sends passes through this loop,
which decides per directed link (source host -> destination host):

  cut       drop every frame, silently, like a blackholed link: TCP
            retransmits into the void and times out, nobody sends a RST;
  loss      drop each frame with probability p (a seeded RNG per link,
            so a link's drop pattern is repeatable for a given traffic);
  delay_ms  hold each frame for delay + uniform(-jitter, +jitter) ms,
  jitter_ms but never let it leave before the link's previous frame: one
            FIFO per link, no reordering. netem reorders frames when
            jitter exceeds the gap between them, which wrecks TCP; this
            switch does not, so under jitter and heavy traffic a frame
            may wait longer than its own draw (behind a slower one).

A frame still queued when its link gets cut is dropped at its departure
time (counted as cut): a cut takes effect on what is on the wire too.
A healed link keeps its queue: frames already held leave on schedule and
new ones queue behind them until it drains (FIFO holds across changes).

Forwarding: unicast by destination MAC (the MACs are given on the command
line, one per host, so there is no learning), broadcast and multicast to
every other host, frames to unknown MACs dropped. A write that the
destination TAP refuses (EAGAIN, ENOBUFS, interface down) drops the
frame and counts it as `overrun`; nothing here ever blocks on a host.

Usage: netswitch.py [--lab NAME] [--seed S] MAC [MAC ...]
  Opens one TAP per MAC (IFF_TAP|IFF_NO_PI, named cnfsw<n> by the kernel,
  in the caller's network namespace), prints {"ok": true, "taps": [names]}
  (or {"ok": false, "error": why}, and exits) and then serves JSON-line commands on stdin, one JSON reply line each
  on stdout, a change in effect before its reply is written:
    {"op": "set", "links": [[src, dst], ...], "rules": {...}}
        merge the given rules (cut, loss, delay_ms, jitter_ms) into each
        directed link; hosts are indexes in MAC order;
    {"op": "clear", "links": [[src, dst], ...]}   (no "links": all)
        every rule of those links back to none;
    {"op": "stats"}   -> {"ok": true, "links": [[src, dst, counters]]}
        counters: frames, bytes (delivered), cut, lost, overrun, queued;
    {"op": "exit"}.
  It exits as well when stdin reaches EOF or its parent changes (the
  test died): the TAP devices vanish with its file descriptors.
  PR_SET_PDEATHSIG is not used: it fires when the parent *thread* exits,
  and a Lab may well be made in a short-lived thread.
"""

import argparse
import fcntl
import heapq
import itertools
import json
import os
import random
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
READ_SIZE = 65536  # a frame never exceeds it: TAP MTU is at most 65521
BURST = 64  # frames read from one TAP before looking at the others again
PARENT_CHECK_S = 1.0
RULE_DEFAULTS = {"cut": False, "loss": 0.0, "delay_ms": 0.0, "jitter_ms": 0.0}
COUNTERS = ("frames", "bytes", "cut", "lost", "overrun", "queued")
TAP_PREFIX = "cnfsw"  # the kernel appends the lowest free number


class Link(object):
    """One directed link: its rules, its counters, its RNG."""

    __slots__ = ("fd", "rng", "blocked", "loss", "delay", "jitter", "last_due") + COUNTERS

    def __init__(self, fd, seed):
        self.fd = fd
        self.rng = random.Random(seed)
        self.last_due = 0.0
        self.blocked, self.loss, self.delay, self.jitter = False, 0.0, 0.0, 0.0
        for name in COUNTERS:
            setattr(self, name, 0)

    def apply(self, rules):
        """Merges `rules` (some of RULE_DEFAULTS' keys) into this link."""
        unknown = set(rules) - set(RULE_DEFAULTS)
        if unknown:
            raise ValueError("unknown rules %s" % sorted(unknown))
        loss = float(rules.get("loss", self.loss))
        if not 0.0 <= loss <= 1.0:
            raise ValueError("loss %r not in [0, 1]" % loss)
        self.blocked = bool(rules.get("cut", self.blocked))
        self.loss = loss
        self.delay = max(0.0, float(rules.get("delay_ms", self.delay * 1e3))) / 1e3
        self.jitter = max(0.0, float(rules.get("jitter_ms", self.jitter * 1e3))) / 1e3

    def counters(self):
        return {name: getattr(self, name) for name in COUNTERS}


def open_tap():
    """A non-blocking TAP file descriptor and the name the kernel gave it
    (unique: TAP_PREFIX and a number the kernel picks, atomically)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        request = struct.pack("16sH22x", (TAP_PREFIX + "%d").encode(), IFF_TAP | IFF_NO_PI)
        reply = fcntl.ioctl(fd, TUNSETIFF, request)
    except OSError:
        os.close(fd)
        raise
    return fd, reply[:16].rstrip(b"\0").decode()


def say(message):
    """One JSON line on stdout (a blocking pipe: written whole)."""
    os.write(1, (json.dumps(message) + "\n").encode())


def parse_mac(text):
    """The 6 bytes of a MAC written like 02:4e:46:00:00:01."""
    mac = bytes(int(part, 16) for part in text.split(":"))
    if len(mac) != 6:
        raise ValueError("bad MAC %r" % text)
    return mac


class Switch(object):
    """The forwarding loop over the TAPs, plus the control channel on stdin."""

    def __init__(self, fds, macs, seed):
        self.fds = fds
        self.host_by_mac = {mac: i for i, mac in enumerate(macs)}
        self.host_by_fd = {fd: i for i, fd in enumerate(fds)}
        self.links = [[Link(fds[dst], "%s:%d:%d" % (seed, src, dst))
                       for dst in range(len(fds))] for src in range(len(fds))]
        self.links_from = [[link for dst, link in enumerate(row) if dst != src]
                           for src, row in enumerate(self.links)]
        self.timers = []  # heap of (due, seq, link, frame); see hold()
        self.seq = itertools.count()
        self.control = b""
        self.parent = os.getppid()
        self.running = True

    def serve(self):
        poller = select.epoll()
        for fd in self.fds:
            poller.register(fd, select.EPOLLIN)
        poller.register(0, select.EPOLLIN)
        next_parent_check = 0.0
        while self.running:
            now = time.monotonic()
            if now >= next_parent_check:
                self.running = os.getppid() == self.parent
                next_parent_check = now + PARENT_CHECK_S
            wait = min(self.release_due(now), PARENT_CHECK_S)
            for fd, _ in poller.poll(wait):
                if fd == 0:
                    self.read_control()
                else:
                    self.pump(fd)

    def pump(self, fd):
        """Forwards up to BURST frames waiting on one TAP."""
        src = self.host_by_fd[fd]
        route = self.route
        for _ in range(BURST):
            try:
                frame = os.read(fd, READ_SIZE)
            except BlockingIOError:
                return
            route(src, frame)

    def route(self, src, frame):
        """Unicast to the owner of the destination MAC, broadcast and
        multicast to every other host, anything else nowhere."""
        dst = self.host_by_mac.get(frame[:6])
        if dst is not None:
            if dst != src:
                self.deliver(self.links[src][dst], frame)
        elif frame[0] & 1:
            for link in self.links_from[src]:
                self.deliver(link, frame)

    def deliver(self, link, frame):
        """Applies the link's rules to one frame: drop, hold or send now."""
        if link.blocked:
            link.cut += 1
        elif link.loss and link.rng.random() < link.loss:
            link.lost += 1
        elif link.delay or link.jitter or link.queued:
            self.hold(link, frame)
        else:
            self.send(link, frame)

    def hold(self, link, frame):
        """Queues a frame until its due time, never ahead of the link's
        previous frame: due times per link never decrease, and the seq
        breaks ties in arrival order, so the heap pops each link FIFO."""
        now = time.monotonic()
        draw = link.delay + link.rng.uniform(-link.jitter, link.jitter)
        due = max(now + draw, now, link.last_due)
        link.last_due = due
        link.queued += 1
        heapq.heappush(self.timers, (due, next(self.seq), link, frame))

    def release_due(self, now):
        """Sends every held frame that is due; seconds until the next one."""
        timers = self.timers
        while timers and timers[0][0] <= now:
            _, _, link, frame = heapq.heappop(timers)
            link.queued -= 1
            if link.blocked:
                link.cut += 1
            else:
                self.send(link, frame)
        return timers[0][0] - now if timers else PARENT_CHECK_S

    def send(self, link, frame):
        """Writes the frame into the destination host's TAP, now."""
        try:
            os.write(link.fd, frame)
        except OSError:  # EAGAIN, ENOBUFS, EIO (interface down): drop, never block
            link.overrun += 1
            return
        link.frames += 1
        link.bytes += len(frame)

    def read_control(self):
        """Answers every complete command line on stdin; stops at EOF."""
        data = os.read(0, 65536)
        if not data:
            self.running = False
            return
        self.control += data
        while b"\n" in self.control:
            line, self.control = self.control.split(b"\n", 1)
            if line.strip():
                say(self.command(line))

    def command(self, line):
        """The reply to one command line: {"ok": true, ...} or an error."""
        try:
            request = json.loads(line)
            return dict(self.execute(request), ok=True)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            return {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}

    def execute(self, request):
        op = request["op"]
        if op == "set":
            for link in self.select_links(request["links"]):
                link.apply(request["rules"])
        elif op == "clear":
            for link in self.select_links(request.get("links")):
                link.apply(RULE_DEFAULTS)
        elif op == "stats":
            return {"links": [[src, dst, link.counters()]
                              for src, row in enumerate(self.links)
                              for dst, link in enumerate(row) if src != dst]}
        elif op == "exit":
            self.running = False
        else:
            raise ValueError("unknown op %r" % op)
        return {}

    def select_links(self, pairs):
        """The Link objects of [[src, dst], ...]; None: every directed link."""
        if pairs is None:
            return [link for row in self.links_from for link in row]
        hosts = range(len(self.fds))
        for src, dst in pairs:
            if src not in hosts or dst not in hosts or src == dst:
                raise ValueError("no link %r -> %r" % (src, dst))
        return [self.links[src][dst] for src, dst in pairs]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lab", default="", help="the Lab's name, to tell switches apart in ps")
    parser.add_argument("--seed", default="0")
    parser.add_argument("macs", nargs="+", type=parse_mac)
    args = parser.parse_args()
    try:
        taps = [open_tap() for _ in args.macs]
    except OSError as e:
        say({"ok": False, "error": "TUNSETIFF on /dev/net/tun: %s" % e})
        return 1
    say({"ok": True, "taps": [name for _, name in taps]})
    Switch([fd for fd, _ in taps], args.macs, args.seed).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""netlab: an emulated network of hosts on one machine, with faults on a
schedule the test drives (cut, one-way cut, loss, delay with jitter, heal).

Each host is a network namespace `cnf<pid>-<host>` (`cnf<pid>x<k>-<host>`
for a process's k-th Lab) holding `lo` and one interface `eth0`: address
10.77.0.<i+1>/24 by default, MAC 02:4e:46:00:00:<i+1>, static permanent
neighbour entries for every other host, no default route. A host sees
nothing of the machine: not its interfaces, not its loopback services.

Why a userspace switch: the kernel has no netem (no delay, jitter or loss
qdisc), so there is nothing to put on veth pairs. Every `eth0` is instead a
TAP device whose file descriptor is held by netswitch.py, a small L2 switch
process (started by the Lab, stdlib only) that forwards each frame and
applies the rules of its directed link (src host -> dst host); its
docstring has the details. In short:

  cut     frames dropped silently, like a blackholed link: no RST, no ICMP,
          TCP connections stall and time out. As neighbour entries are
          static, a cut never turns into a quick "no route to host" either;
  loss    each frame dropped with probability p (seeded RNG per link);
  delay   each frame held delay +- uniform jitter, FIFO per link: unlike
          netem, jitter never reorders frames (TCP would suffer badly).

Every change is in effect when the call that made it returns (the switch
answers a command only once it applied it) and is recorded in lab.log as
(time.monotonic(), description), for test reports.

Cleanup: Lab.close() SIGKILLs every process in the lab's namespaces, stops
the switch and deletes the namespaces. It runs at the end of a `with`, at
exit (atexit), and on SIGTERM/SIGINT: a Lab made in the main thread
installs handlers that close every open Lab, then chain to the previous
handler (or raise SystemExit(128 + signum) where that was SIG_DFL). A test
that was SIGKILLed cannot clean up: its switch exits by itself (stdin EOF)
and the next Lab made on the machine sweeps the namespaces `cnf<pid>-*`
whose pid is gone, with their processes.

Speed: the switch forwards bulk TCP at about 500 MB/s at the default MTU
(9000) on a 2-core VM, 200 MB/s at 1500, 1 GB/s and more at 65521.
"""

import atexit
import ipaddress
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
IP = shutil.which("ip") or "ip"  # absolute: a caller's env may lack /usr/sbin
SWITCH = os.path.join(HERE, "netswitch.py")
NETNS_DIR = "/run/netns"
LAB_NAME = re.compile(r"^cnf(\d+)(?:x\d+)?-")
DEFAULT_MTU = 9000
TXQUEUELEN = 5000  # frames: a full TAP queue drops (1000 lost thousands at MTU 1500)
IP_TIMEOUT = 20  # seconds, any `ip` command
SWITCH_TIMEOUT = 10  # seconds, the switch's answer to one command
KILL_TIMEOUT = 10  # seconds for the processes of a namespace to be gone


class Skip(Exception):
    """Namespaces cannot be made here; the message says why, one line."""


class LabError(RuntimeError):
    """The lab failed: an `ip` command, the switch, or its teardown."""


class JsonPipe(object):
    """Requests as JSON lines to a process's stdin, each answered by one JSON
    line on its stdout within a timeout (the switch; usable for any helper
    process that speaks so). After a timeout it refuses further requests:
    a late answer would be taken for the next one's."""

    def __init__(self, proc, what):
        self.proc = proc
        self.what = what
        self.buffer = b""
        self.failed = None

    def request(self, message, timeout):
        if self.failed:
            raise LabError(self.failed)
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise LabError("%s is gone (exit status %s)" % (self.what, self.proc.poll()))
        return self.read(timeout)

    def read(self, timeout):
        """The next JSON line, within `timeout` seconds."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.failed = "%s did not answer within %g s" % (self.what, timeout)
                raise LabError(self.failed)
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise LabError("%s exited (status %s)" % (self.what, self.proc.poll()))
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


# ---- namespaces and their processes -------------------------------------

def ip_batch(lines, netns=None):
    """Runs `ip` commands (one a line) in the root namespace or in `netns`."""
    argv = [IP] + (["-n", netns] if netns else []) + ["-batch", "-"]
    done = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True,
                          text=True, timeout=IP_TIMEOUT)
    if done.returncode != 0:
        raise LabError("%s failed: %s" % (" ".join(argv), done.stderr.strip()))


def delete_namespaces(names):
    """`ip netns del` each; a name already gone is no error."""
    if names:
        subprocess.run([IP, "-force", "-batch", "-"], capture_output=True, timeout=IP_TIMEOUT,
                       input="".join("netns del %s\n" % name for name in names).encode())


def namespace_id(name):
    """(st_dev, st_ino) of a named network namespace, None if there is none."""
    try:
        st = os.stat(os.path.join(NETNS_DIR, name))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pids_in(namespace_ids):
    """Live processes whose network namespace is one of `namespace_ids`
    (what `ip netns pids` does, for many namespaces in one pass)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                st = os.stat("/proc/%s/ns/net" % entry)
            except OSError:  # gone, or a zombie (it has no namespaces left)
                continue
            if (st.st_dev, st.st_ino) in namespace_ids:
                pids.append(int(entry))
    return pids


def kill_namespace_processes(names, timeout=KILL_TIMEOUT):
    """SIGKILLs every process in the namespaces until none is left; the
    pids still there after `timeout` seconds (empty: all gone)."""
    ids = {namespace_id(name) for name in names} - {None}
    deadline = time.monotonic() + timeout
    while True:
        pids = pids_in(ids) if ids else []
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def pid_alive(pid):
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def sweep_leftovers():
    """Removes the namespaces (and their processes) of Labs whose process
    is gone: a SIGKILLed test's, or an earlier process with our pid."""
    try:
        names = os.listdir(NETNS_DIR)
    except OSError:
        return
    mine = {lab.name for lab in _open_labs}
    stale = []
    for name in names:
        match = LAB_NAME.match(name)
        if match:
            pid = int(match.group(1))
            if name.split("-", 1)[0] not in mine if pid == os.getpid() else not pid_alive(pid):
                stale.append(name)
    if stale:
        kill_namespace_processes(stale)
        delete_namespaces(stale)


def skip_reason():
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_SYS_ADMIN)"
    if not shutil.which(IP):
        return "no `ip` command (iproute2)"
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return "no /dev/net/tun"
    return None


# ---- every open Lab of this process: signals and atexit ------------------

_open_labs = []
_lab_numbers = itertools.count()
_previous_handlers = {}
_closing = 0  # Lab.close() calls in progress
_pending_signals = []  # signals that arrived during a close, handled after it


def close_all():
    """Closes every open Lab of this process."""
    for lab in list(_open_labs):
        lab.close()


def _on_signal(signum, frame):
    """Closes every Lab, then does what the previous handler would have;
    during a close() it only notes the signal, handled when that ends."""
    if _closing:
        _pending_signals.append(signum)
        return
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    close_all()
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        raise SystemExit(128 + signum)


def _install_signal_handlers():
    """_on_signal for SIGTERM and SIGINT, unless they are ignored or this is
    not the main thread (Python allows handlers only there)."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            current = signal.getsignal(signum)
            if current not in (_on_signal, signal.SIG_IGN, None):
                _previous_handlers[signum] = current
                signal.signal(signum, _on_signal)


def _restore_signal_handlers():
    """Puts back the handlers _install_signal_handlers replaced, where they
    are still ours."""
    if threading.current_thread() is threading.main_thread():
        for signum, previous in list(_previous_handlers.items()):
            if signal.getsignal(signum) is _on_signal:
                signal.signal(signum, previous)
            del _previous_handlers[signum]


def _handle_pending_signal():
    if _pending_signals and not _closing:
        signum = _pending_signals[0]
        del _pending_signals[:]
        _on_signal(signum, None)


atexit.register(close_all)


# ---- the Lab -------------------------------------------------------------

class Lab(object):
    """Hosts (network namespaces) wired through a fault-injecting switch.
    See the module docstring; use as a context manager or call close()."""

    def __init__(self, hosts, seed=0, subnet="10.77.0.0/24", mtu=DEFAULT_MTU):
        reason = skip_reason()
        if reason:
            raise Skip(reason)
        self.hosts = list(hosts)
        self._index = {host: i for i, host in enumerate(self.hosts)}
        network = ipaddress.ip_network(subnet)
        self._check_hosts(network)
        self._addrs = {host: str(network[i + 1]) for i, host in enumerate(self.hosts)}
        self._prefixlen = network.prefixlen
        self._macs = ["02:4e:46:00:%02x:%02x" % divmod(i + 1, 256) for i in range(len(self.hosts))]
        self.mtu = mtu
        self.log = []
        number = next(_lab_numbers)
        self.name = "cnf%d%s" % (os.getpid(), "x%d" % number if number else "")
        self._netns = {host: "%s-%s" % (self.name, host) for host in self.hosts}
        self._owner = os.getpid()
        self._made = []  # namespaces created so far
        self._procs = []
        self._switch = self._pipe = None
        self._lock = threading.Lock()
        self._closed = False
        sweep_leftovers()
        _open_labs.append(self)
        _install_signal_handlers()
        try:
            self._make_namespaces()
            self._start_switch(seed)
            self._wire_hosts()
        except BaseException:
            self.close()
            raise

    def _check_hosts(self, network):
        if not self.hosts or len(self._index) != len(self.hosts) or \
                not all(re.match(r"^[A-Za-z0-9_.-]+$", host) for host in self.hosts):
            raise ValueError("hosts must be distinct names of letters, digits and _.-, "
                             "at least one: %r" % self.hosts)
        if len(self.hosts) > min(network.num_addresses - 2, 65534):
            raise ValueError("%d hosts do not fit in %s" % (len(self.hosts), network))

    def _make_namespaces(self):
        for host in self.hosts:
            name = self._netns[host]
            done = subprocess.run([IP, "netns", "add", name], capture_output=True,
                                  text=True, timeout=IP_TIMEOUT)
            if done.returncode != 0:
                raise Skip("ip netns add %s failed: %s" % (name, " ".join(done.stderr.split())))
            self._made.append(name)

    def _start_switch(self, seed):
        self._switch = subprocess.Popen(
            [sys.executable or "/usr/bin/python3", SWITCH, "--lab", self.name,
             "--seed", str(seed)] + self._macs,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self._pipe = JsonPipe(self._switch, "netswitch")
        hello = self._pipe.read(SWITCH_TIMEOUT)
        if not hello["ok"]:
            raise Skip("cannot create TAP devices: %s" % hello["error"])
        self._taps = hello["taps"]

    def _wire_hosts(self):
        """Moves each TAP into its host's namespace, there named eth0, with
        the host's MAC and address and static neighbours for every host."""
        ip_batch(["link set %s netns %s" % (tap, self._netns[host])
                  for tap, host in zip(self._taps, self.hosts)])
        ipv6 = os.path.exists("/proc/sys/net/ipv6")
        for i, host in enumerate(self.hosts):
            lines = ["link set lo up",
                     "link set %s name eth0" % self._taps[i],
                     "link set eth0 address %s mtu %d txqueuelen %d"
                     % (self._macs[i], self.mtu, TXQUEUELEN)]
            if ipv6:  # no link-local address: no DAD, router or MLD chatter
                lines.append("link set eth0 addrgenmode none")
            lines += ["addr add %s/%d dev eth0" % (self._addrs[host], self._prefixlen),
                      "link set eth0 up"]
            lines += ["neigh replace %s lladdr %s dev eth0 nud permanent"
                      % (self._addrs[other], self._macs[j])
                      for j, other in enumerate(self.hosts) if j != i]
            ip_batch(lines, netns=self._netns[host])

    # ---- hosts and their processes

    def addr(self, host):
        """The host's IPv4 address, a string."""
        return self._addrs[host]

    def netns(self, host):
        """The name of the host's network namespace."""
        return self._netns[host]

    def _exec_argv(self, host, args, shell):
        self._check_open()
        if shell:
            args = ["/bin/sh", "-c", args]
        elif isinstance(args, (str, bytes)):
            args = [args]
        return [IP, "netns", "exec", self._netns[host]] + list(args)

    def popen(self, host, args, shell=False, **kwargs):
        """subprocess.Popen of `args` inside the host's namespace; killed
        at close() if still running."""
        proc = subprocess.Popen(self._exec_argv(host, args, shell), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host, args, shell=False, timeout=60, capture_output=True, text=True, **kwargs):
        """subprocess.run of `args` inside the host's namespace: output
        captured as text unless told otherwise, killed after `timeout` s."""
        return subprocess.run(self._exec_argv(host, args, shell), timeout=timeout,
                              capture_output=capture_output, text=text, **kwargs)

    # ---- faults

    def cut(self, a, b, oneway=False):
        """Drops every frame from a to b, and from b to a unless oneway."""
        self._set(self._pairs([a], [b], oneway), {"cut": True},
                  "cut %s %s %s" % (a, "->" if oneway else "<->", b))

    def impair(self, a, b, delay_ms=0, jitter_ms=0, loss=0.0, oneway=False):
        """Sets delay, jitter and loss from a to b (and b to a unless
        oneway); the ones not given go back to 0. A cut stays a cut."""
        self._impair(self._pairs([a], [b], oneway), delay_ms, jitter_ms, loss,
                     "%s %s %s" % (a, "->" if oneway else "<->", b))

    def impair_all(self, delay_ms=0, jitter_ms=0, loss=0.0):
        """impair() on every directed link between distinct hosts."""
        self._impair(self._pairs(self.hosts, self.hosts, True), delay_ms, jitter_ms, loss, "all")

    def partition(self, group_a, group_b, oneway=False):
        """Cuts every link from group_a to group_b (and back unless oneway)."""
        self._set(self._pairs(group_a, group_b, oneway), {"cut": True},
                  "partition [%s] %s [%s]" % (", ".join(group_a), "->" if oneway else "<->",
                                              ", ".join(group_b)))

    def heal(self, a=None, b=None):
        """Clears every rule (cut, loss, delay) between a and b both ways;
        heal() with no hosts clears every link."""
        if (a is None) != (b is None):
            raise TypeError("heal() takes two hosts or none")
        if a is None:
            self._command({"op": "clear"}, "heal all")
        else:
            self._command({"op": "clear", "links": self._pairs([a], [b], False)},
                          "heal %s <-> %s" % (a, b))

    def stats(self):
        """Counters of every directed link since the lab started:
        {(src, dst): {"frames", "bytes" (delivered), "cut", "lost" (frames
        dropped by those rules), "overrun" (dropped: the destination TAP
        refused it), "queued" (held by a delay now)}}."""
        reply = self._command({"op": "stats"})
        return {(self.hosts[src], self.hosts[dst]): counters
                for src, dst, counters in reply["links"]}

    def _pairs(self, sources, destinations, oneway):
        for host in list(sources) + list(destinations):
            if host not in self._index:
                raise KeyError("no host %r in this lab" % host)
        pairs = [[self._index[s], self._index[d]] for s in sources for d in destinations if s != d]
        if not oneway:
            pairs += [[d, s] for s, d in pairs]
        if not pairs:
            raise ValueError("no link between %r and %r" % (sources, destinations))
        return pairs

    def _impair(self, pairs, delay_ms, jitter_ms, loss, where):
        self._set(pairs, {"delay_ms": delay_ms, "jitter_ms": jitter_ms, "loss": loss},
                  "impair %s: delay %g ms, jitter %g ms, loss %g"
                  % (where, delay_ms, jitter_ms, loss))

    def _set(self, pairs, rules, description):
        self._command({"op": "set", "links": pairs, "rules": rules}, description)

    def _command(self, message, description=None):
        self._check_open()
        with self._lock:
            reply = self._pipe.request(message, SWITCH_TIMEOUT)
            if not reply["ok"]:
                raise LabError("netswitch refused %s: %s" % (message["op"], reply["error"]))
            if description:
                self.log.append((time.monotonic(), description))
        return reply

    def _check_open(self):
        if self._closed:
            raise LabError("lab %s is closed" % self.name)

    # ---- teardown

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Kills every process of the lab, stops the switch, deletes the
        namespaces. Idempotent; a signal arriving meanwhile is handled after."""
        global _closing
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        _closing += 1
        try:
            left = self._teardown()
        finally:
            _open_labs.remove(self)
            if not _open_labs:
                _restore_signal_handlers()
            _closing -= 1
        _handle_pending_signal()
        if left:
            raise LabError("lab %s teardown left %s" % (self.name, left))

    def _teardown(self):
        """Everything close() does; what is left behind, or ""."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        stuck = kill_namespace_processes(self._made)
        for proc in self._procs:
            try:
                proc.wait(KILL_TIMEOUT)
            except subprocess.TimeoutExpired:
                stuck.append(proc.pid)
        self._stop_switch()
        delete_namespaces(self._made)
        remaining = [name for name in self._made if namespace_id(name)]
        return ", ".join(filter(None, ["processes %s" % stuck if stuck else "",
                                       "namespaces %s" % remaining if remaining else ""]))

    def _stop_switch(self):
        if self._switch is None:
            return
        try:
            self._switch.stdin.close()  # EOF: it exits, its TAPs vanish
        except OSError:
            pass
        try:
            self._switch.wait(SWITCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._switch.kill()
            self._switch.wait(SWITCH_TIMEOUT)
        self._switch.stdout.close()

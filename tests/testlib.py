"""What every Python test script here shares (no torch: the deploy tests use it).

Checks prints one PASS/FAIL (or NOT RUN) line per check and the closing 'N
passed, N failed[, N not run]'; free_port, accepts and wait_for are the loopback helpers;
no_cuda_reason (imports torch when called) is for gpu-labelled scripts.
"""
import socket
import time


class Checks(object):
    """PASS/FAIL lines and the closing 'N passed, N failed' of a test script."""

    def __init__(self):
        self.passed = 0
        self.failed = 0
        self.not_run = 0

    def ok(self, name, detail=""):
        self.passed += 1
        print("PASS %s%s" % (name, (": " + detail) if detail else ""), flush=True)

    def not_applicable(self, name, why):
        """A check that does not apply here (counted apart, never as a pass).
        Not a ctest skip marker: the script's other checks still count."""
        self.not_run += 1
        print("NOT RUN %s: %s" % (name, why), flush=True)

    def fail(self, name, detail=""):
        self.failed += 1
        print("FAIL %s%s" % (name, (": " + detail.strip()) if detail else ""), flush=True)

    def check(self, cond, name, detail=""):
        """Counts `cond`; a passing check shows `detail` only when it is one line."""
        if cond:
            self.ok(name, detail if detail and "\n" not in detail else "")
        else:
            self.fail(name, detail)
        return cond

    def finish(self):
        print("%d passed, %d failed%s" % (
            self.passed, self.failed,
            ", %d not run" % self.not_run if self.not_run else ""), flush=True)
        return 1 if self.failed else 0


def free_port():
    """A loopback port nobody listens on now."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def accepts(port, host="127.0.0.1"):
    """Whether something accepts TCP connections on host:port."""
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def wait_for(predicate, timeout, interval=0.05):
    """predicate()'s first truthy value within `timeout` seconds, else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def no_cuda_reason():
    """None where this python's torch sees a CUDA device, else the line a
    gpu-labelled test prints before exiting 0 (ctest's SKIP_REGULAR_EXPRESSION
    matches 'CONCORD_TEST_SKIPPED: no CUDA device')."""
    import torch
    if torch.cuda.is_available():
        return None
    return "CONCORD_TEST_SKIPPED: no CUDA device (torch %s, built with CUDA %s)" % (
        torch.__version__, torch.version.cuda)

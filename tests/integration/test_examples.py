#!/usr/bin/python3
"""The examples as their users build and run them: against an installed
Concord, under the installed launcher, with a worker killed mid-run.

    /usr/bin/python3 tests/integration/test_examples.py --build-dir build \
        --source-dir . [--cmake cmake] [--keep] [--bin-dir IGNORED]

1. `cmake --install BUILD --prefix P` into a fresh temporary prefix.
2. examples/mnist (pytorch/examples' cpp/mnist, elastic) copied out of the
   source tree, configured with CMAKE_PREFIX_PATH=P only and built with
   -Wall -Wextra -Werror; examples/mnist/prepare_data.py writes the idx
   files from Debian's dataset-fashion-mnist, or from BUILD/datasets/
   fashion-mnist where scripts/test.sh copied it for the Debian 13 root
   (SKIP when neither is there).
3. P/bin/concord-run --standalone --nproc 3 --min-workers 2
   --max-restarts 1 runs it for 3 epochs of 9000 samples. Once rank 0 is a
   third into the first epoch, this script SIGKILLs local worker 2: the
   survivors re-form and go on, concord-run restarts the worker, and it is
   admitted (in the survivors' re-form when it is quick enough, else at a
   step boundary). Checked: exit status 0; three final lines (ranks 0-2,
   world 3: the restarted worker trained to the end); bit-identical
   parameters and the same step count on all; the survivors re-formed;
   test accuracy above 0.3 (chance is 0.1). A bad flag: one line, exit
   status 2. (Before the fix it found, the survivors skipped the step
   agreement the newcomer ran and Gloo aborted the newcomer.)

Prints one line per check and a final 'N passed, N failed'; exits 1 on any
failure.
"""

import argparse
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))

import fixtures  # noqa: E402

DATASET = "/usr/share/datasets/fashion-mnist"
FINAL = re.compile(
    r"concord-mnist: rank (\d+) world (\d+) generation (\d+) steps (\d+) "
    r"reforms (\d+) test_accuracy (\S+) param_sum (\S+)")
PROGRESS = re.compile(r"Train Epoch: (\d+) \[\s*(\d+)/\s*(\d+)\]")


def build(checks, args, prefix, work, name, target):
    src = os.path.join(work, name + "-src")
    out = os.path.join(work, name + "-build")
    shutil.copytree(os.path.join(args.source_dir, "examples", name), src)
    configure = fixtures.example_configure(args.cmake, args.build_dir, src,
                                           out, prefix)
    r = fixtures.run_command(configure, timeout=120)
    if not checks.check(r.returncode == 0 and not r.timed_out,
                        "%s configures against the prefix" % name,
                        r.describe()):
        return None
    r = fixtures.run_command([args.cmake, "--build", out, "--parallel", "1"],
                             timeout=420)
    if not checks.check(r.returncode == 0 and not r.timed_out,
                        "%s builds (-Wall -Wextra -Werror)" % name,
                        r.describe()):
        return None
    checks.ok("%s built in %.1f s" % (name, r.elapsed))
    return os.path.join(out, target)


def local_worker(launcher_pid, local_rank):
    """The pid of the launcher's worker with CONCORD_LOCAL_RANK=local_rank."""
    want = b"CONCORD_LOCAL_RANK=%d" % local_rank
    for kid in fixtures.children(launcher_pid):
        try:
            with open("/proc/%d/environ" % kid, "rb") as f:
                if want in f.read().split(b"\0"):
                    return kid
        except OSError:
            pass
    return None


def run_mnist(checks, prefix, example, data):
    cmd = [os.path.join(prefix, "bin", "concord-run"), "--standalone",
           "--nproc", "3", "--min-workers", "2", "--max-restarts", "1", "--",
           example, "--data", data, "--epochs", "3", "--train-samples", "9000",
           "--test-samples", "2000", "--log-interval", "5"]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               CONCORD_HEARTBEAT_INTERVAL_MS="200",
               CONCORD_HEARTBEAT_TIMEOUT_MS="2000")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, universal_newlines=True,
                            errors="replace")
    output, killed = [], None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = start + 300
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=1.0):
                if proc.poll() is not None:
                    break
                continue
            line = proc.stdout.readline()
            if not line:
                break
            output.append(line)
            m = PROGRESS.search(line)
            if (killed is None and m and m.group(1) == "1" and
                    int(m.group(2)) * 3 >= int(m.group(3))):
                pid = local_worker(proc.pid, 2)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = (pid, time.monotonic() - start)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "".join(output)
    tail = text[-3000:]
    if not checks.check(killed is not None,
                        "local worker 2 SIGKILLed a third into epoch 1",
                        "never killed: " + tail):
        return
    checks.ok("killed pid %d at %.1f s" % killed)
    if not checks.check(proc.returncode == 0,
                        "concord-run exits 0 (the worker restarted and "
                        "finished)", "exit %s: %s" % (proc.returncode, tail)):
        return
    checks.ok("3 epochs with a death and an admission in %.1f s" %
              (time.monotonic() - start))
    finals = [m.groups() for m in FINAL.finditer(text)]
    if not checks.check(sorted(int(f[0]) for f in finals) == [0, 1, 2],
                        "three final lines, ranks 0-2", tail):
        return
    checks.check(all(f[1] == "3" for f in finals),
                 "world 3 at the end (the restarted worker was admitted)",
                 str(finals))
    checks.check(len({f[6] for f in finals}) == 1,
                 "bit-identical parameters on every rank", str(finals))
    checks.check(len({f[3] for f in finals}) == 1,
                 "the same committed step count on every rank", str(finals))
    survivors = [f for f in finals if int(f[4]) > 0]
    checks.check(len(survivors) == 2,
                 "two survivors re-formed (the restarted worker joined in "
                 "their re-form or was admitted after it)", str(finals))
    accuracy = float(finals[0][5])
    checks.check(accuracy > 0.3, "test accuracy %.4f > 0.3" % accuracy,
                 str(finals))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin-dir", help="unused: the installed tools run")
    parser.add_argument("--build-dir", required=True)
    parser.add_argument("--source-dir", required=True)
    parser.add_argument("--cmake", default="cmake")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    # Debian's package, or the copy scripts/test.sh puts into the build
    # tree for the Debian 13 root (which does not install it).
    dataset = next((d for d in [DATASET, os.path.join(
        args.build_dir, "datasets", "fashion-mnist")] if os.path.isdir(d)),
        None)
    if dataset is None:
        print("SKIP: %s is missing (apt install dataset-fashion-mnist; "
              "scripts/install-deps.sh does)" % DATASET)
        return 0
    checks = fixtures.Checks()
    work = tempfile.mkdtemp(prefix="concord-examples-")
    prefix = os.path.join(work, "prefix")
    try:
        r = fixtures.run_command([args.cmake, "--install", args.build_dir,
                                  "--prefix", prefix], timeout=120)
        if checks.check(r.returncode == 0, "cmake --install", r.describe()):
            data = os.path.join(work, "data")
            r = fixtures.run_command(
                [sys.executable, os.path.join(args.source_dir, "examples",
                                              "mnist", "prepare_data.py"),
                 data, "--source", dataset], timeout=120)
            ok = checks.check(r.returncode == 0, "prepare_data.py",
                              r.describe())
            example = build(checks, args, prefix, work, "mnist",
                            "concord-mnist") if ok else None
            if example:
                bad = fixtures.run_command([example, "--epochs", "x"],
                                           timeout=60)
                lines = [x for x in bad.stderr.splitlines() if x.strip()]
                checks.check(bad.returncode == 2 and len(lines) == 1,
                             "bad flag: one line, exit 2", bad.describe())
                run_mnist(checks, prefix, example, data)
    finally:
        if args.keep:
            print("kept %s" % work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Integration test of durable checkpoints (see Note [Checkpoints] in
worker/checkpoint/checkpointer.h): real concord-run + concord-train jobs of
3 workers with --checkpoint-dir, killed whole or in part, started again.

    /usr/bin/python3 tests/integration/test_checkpoint.py --bin-dir build/bin \\
        [--case NAME ...] [--keep]

Cases (--list):
  kill-all   every worker and the launcher SIGKILLed mid-epoch once a
             checkpoint of step >= 60 is complete; the same command again
             resumes from the newest complete checkpoint (its log line names
             the step and "disk"), exits 0, and its final parameters and its
             final checkpoint's optimizer state are bit-identical to an
             uninterrupted run's with the same flags. Both runs with the
             default --checkpoint-keep (3): the newest 3 are left, the
             final one included, none of the first run's.
  memory     only the workers SIGKILLed (concord-run, the node agent, lives
             and restarts them): they resume from the node's memory snapshot
             (the log names "memory", as the coordinator named it: the agent
             reports its snapshots), bit-identical to the uninterrupted run.
  world2     a job killed whole resumes with 2 workers instead of 3: it
             completes (exit 0) from the checkpoint's step, every sample of
             the remaining epochs once.
  python     the uninterrupted run's checkpoints in Python: model.pt and
             state.pt load with weights_only=True; optimizer.pt too on
             PyTorch 2.x (1.13's weights-only unpickler has no floats at all:
             PyTorch's own optimizer files fail the same way there, checked);
             every .pt of every step-N: zipfile's CRC-32 checks (testzip),
             the size and CRC-32 its manifest lists, torch.load;
             SGD with momentum from checkpoint S continued in Python over the
             same windows (the sample log) ends within 1e-6 of Concord's
             checkpoint S' > S.
  archive    the archives the unit tests write (see Note [Archive writer]
             in worker/zip_writer.h) in Python: plain and ZIP64 forms pass
             zipfile's CRC-32 checks and load with torch.load(weights_only)
             to the values written; a sparse 4 GiB + 1 record and one past
             4 GiB read with their sizes, offset and CRC-32s.
  crash-*, full-tmpfs, read-only
             a write killed at each stage, a full tmpfs (no O_DIRECT there:
             buffered writes), a read-only directory: the job resumes from
             the previous complete checkpoint; a failing write is said once
             in the log, and (read-only) in the coordinator's totals, one
             event and /metrics.
  full-disk  a loop-mounted ext4 (the disk tier's O_DIRECT writes; root)
             filled by other files to the room of 3 checkpoints: the 4th's
             first O_DIRECT write fails with ENOSPC, said once with the
             writer's text; concord-run exits 1 naming the last checkpoint
             not written; concordctl's totals, one event and /metrics show
             the failures; the 3 were written with O_DIRECT (their whole
             blocks not in the page cache), load in Python, and a copy of
             them resumes the job bit-identical.
  disk-eio   a loop-mounted ext4 whose backing memfd is sealed against
             writes mid-run: the kernel's EIO (then EROFS, once ext4 aborts
             its journal) at every write; said once with EIO's text, exit
             1, the coordinator shows it; no staging directory left; the
             checkpoints before load in Python and resume the job
             bit-identical.
  small-shm  /dev/shm a 16 KiB tmpfs: the node's memory stage fails; rank 0
             writes each checkpoint itself, says so once and reports it
             with its credential (the coordinator's record has them all);
             the default --checkpoint-keep leaves the newest 3; the job
             completes, its last checkpoint bit-identical.
  coordinator
             against a separate coordinator: `concordctl checkpoints` lists
             the newest ones with their stall; the totals and /metrics count
             every checkpoint written.
  started-again
             against a separate coordinator, the job killed whole and
             stopped: the same command starts it again from the checkpoint
             the coordinator names, bit-identical to the uninterrupted run.
  slowmo     slowmo-localsgd over 3 shards: state.pt holds the whole slow
             momentum; killed whole, the job resumes with it (no slice
             restarts), bit-identical to its uninterrupted run; with SGD's
             momentum (each rank's own) state.pt holds all 3 ranks' and the
             resume is bit-identical too, each rank taking its own.
  powersgd   --comm-hook powersgd: a worker killed and restarted (the
             newcomer takes PowerSGD's count and Q), then the job killed
             whole and resumed: the final checkpoint's PowerSGD count is the
             job's step count, with the summed error feedback.

Every subprocess has a timeout; a hang is a failure. Prints one line per
check and 'N passed, N failed'; exits 1 on any failure.
"""

import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import signal
import sys
import zipfile
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import elastic_harness as te  # noqa: E402
import test_status as ts  # noqa: E402
import processes  # noqa: E402  (tests/reference, on the path elastic_harness sets)
from checkpoint_runs import (  # noqa: E402
    EPOCHS, EVERY, N_SAMPLES, RUN_TIMEOUT, SLOW, check_history, checkpoints_json,
    compare_final, launch, load_ckpt, memory_resume, reference, resumed_step, run_again,
    main as checkpoint_main, start_coordinator, steps, wait_for_checkpoint)

fixtures = te.fixtures


def case_kill_all(ctx, name, nproc_after=3, keep="100"):
    checks = ctx.checks
    ref = reference(ctx) if nproc_after == 3 else None
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    rd, p = launch(ctx, name + "-1", job, ck, env=SLOW, keep=keep)
    if not wait_for_checkpoint(checks, name, p, ck, job, 60):
        return
    rd2, p2, step, seen = run_again(ctx, name, job, ck, p, nproc=nproc_after, keep=keep)
    total = 17 * EPOCHS
    checks.check(seen < total, name + ": killed before the end (checkpoint %d of %d)" % (seen, total))
    if keep is None:
        # Both runs pruned to concord-run's default --checkpoint-keep (3):
        # the newest 3 of the second run, its final one included; none of
        # the first run's (the resume's step and older) left.
        kept = steps(ck, job)
        extra = [d for d in os.listdir(os.path.join(ck, job))
                 if d not in ("latest", ".writer") and not re.match(r"step-\d+$", d)]
        checks.check(len(kept) == 3 and kept[-1] == total and kept[0] > (step or 0) and
                     not extra,
                     name + ": the default --checkpoint-keep: the newest 3 on disk (%s), the "
                     "older ones of both runs pruned (resumed from %s)" % (kept, step),
                     str(extra))
    check_history(checks, name, [rd, rd2], nproc_after)
    if nproc_after == 3:
        compare_final(checks, name, rd2, ck, job, ref)
    else:
        checks.check(re.search(r"concord-train: done: \d+ steps", p2.stdout()) is not None,
                     name + ": training completed at world size %d" % nproc_after, p2.describe())
        check_samples_after(checks, name, rd2, step)


def case_started_again(ctx, name):
    """Against a separate coordinator: every worker and the launcher
    SIGKILLed, the job stopped by an operator; the command run again starts
    the job again (see Note [Starting again]) from the checkpoint the
    coordinator names (see Note [Resume source]: the newest it recorded; the log
    says so), bit-identical to the uninterrupted run, and the history
    checker follows the job across both runs. A job's checkpoints live in
    one folder (see Note [One job's checkpoints]): the command run with
    another --checkpoint-dir is refused, one line naming both, and changes
    nothing."""
    checks = ctx.checks
    ref = reference(ctx)
    rd0 = te.RunDir(ctx.tmp, name + "-coordinator")
    coord = te.start_coordinator(ctx, name, rd0)
    if coord is None:
        return
    try:
        job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
        rd, p = launch(ctx, name + "-1", job, ck, env=SLOW, coordinator=coord)
        if not wait_for_checkpoint(checks, name, p, ck, job, 60):
            return
        # `latest` is renamed before concord-run reports the write: kill once
        # the coordinator has it (the record is what this case is about).
        te.testlib.wait_for(
            lambda: (checkpoints_json(ctx, coord, job)[0].get("checkpoints") or [{}])[0]
            .get("step", 0) >= 60 or p.poll() is not None, timeout=30)
        p.kill_group()
        p.wait(10)
        listed, out = checkpoints_json(ctx, coord, job)
        newest = (listed.get("checkpoints") or [{}])[0]
        stop = ts.ctl(ctx.bins, coord, "stop", job, "--reason", "lost whole")
        checks.check(stop.returncode == 0 and newest.get("step", 0) >= 60,
                     name + ": the job stopped, its newest checkpoint recorded (step %s)" %
                     newest.get("step"), out + stop.stdout + stop.stderr)
        _, elsewhere = launch(ctx, name + "-elsewhere", job, ck + "-2", coordinator=coord)
        rc = elsewhere.wait(RUN_TIMEOUT)
        checks.check(rc != 0 and 'spec.checkpoint_dir differs from job %s: job has "%s", '
                     'request has "%s-2"' % (job, ck, ck) in elsewhere.stderr(),
                     name + ": started again with another --checkpoint-dir: refused, naming "
                     "both folders", elsewhere.describe())
        ck2 = ck
        rd2, p2 = launch(ctx, name + "-2", job, ck2, coordinator=coord)
        rc = p2.wait(RUN_TIMEOUT)
        m = re.search(r"resuming from step (\d+) of the checkpoint in disk \(([^)]*)\), as the "
                      r"coordinator named", p2.stderr())
        checks.check(rc == 0 and m is not None and int(m.group(1)) == newest.get("step") and
                     m.group(2) == newest.get("path"),
                     name + ": the same command starts the job again from the checkpoint the "
                     "coordinator named (%s)" % (m.group(1) if m else None), p2.describe())
        listing = ts.ctl(ctx.bins, coord, "-o", "json", "events", job)
        try:
            events = [e["message"] for e in json.loads(listing.stdout)["events"]]
        except (ValueError, KeyError):
            events = []
        checks.check(any("job started again" in e and "lost whole" in e for e in events),
                     name + ": an event says the job started again and why it had ended",
                     "\n".join(events))
        problems, summary = te.history.check(
            [f for r in (rd, rd2) for f in te.history.run_files(r.history)[0]],
            rd0.coordinator_history, N_SAMPLES, EPOCHS)
        checks.check(not problems and "3 resume(s)" in summary,
                     name + ": history invariants across both runs (%s)" % summary,
                     "; ".join(problems[:20]))
        compare_final(checks, name, rd2, ck2, job, ref)
    finally:
        coord.stop()


def check_samples_after(checks, name, rd, resumed):
    """Every sample of each epoch after the resume once; the resumed epoch's
    rest once."""
    lines = []
    for path in sorted(os.listdir(rd.samples)):
        got, _ = te.parse_sample_log(os.path.join(rd.samples, path))
        lines += got
    by_step = {s: (e, tuple(idx)) for s, e, idx in lines}
    epochs = {}
    for s in sorted(by_step):
        e, idx = by_step[s]
        epochs.setdefault(e, []).extend(idx)
    problems = []
    if sorted(by_step) and min(by_step) != resumed + 1:
        problems.append("first step %d, resumed at %d" % (min(by_step), resumed))
    for e, idx in sorted(epochs.items()):
        if len(idx) != len(set(idx)):
            problems.append("epoch %d: a sample twice" % e)
        if e != min(epochs) and sorted(idx) != list(range(N_SAMPLES)):
            problems.append("epoch %d: %d samples, not each once" % (e, len(idx)))
    if max(epochs, default=-1) != EPOCHS - 1:
        problems.append("last epoch %s" % max(epochs, default=None))
    checks.check(not problems, name + ": after the resume every sample of every epoch once",
                 "; ".join(problems))


def case_memory(ctx, name):
    memory_resume(ctx, name, reference(ctx))


def case_python(ctx, name):
    checks = ctx.checks
    ref_rd, ck = reference(ctx)
    have = steps(ck, "ref")
    pairs = [(a, b) for a, b in zip(have, have[1:]) if 0 < a and b - a <= 2 * EVERY]
    if not checks.check(bool(pairs), name + ": two checkpoints near each other", str(have)):
        return
    s0, s1 = pairs[len(pairs) // 2]
    d0 = os.path.join(ck, "ref", "step-%d" % s0)
    problems = []
    for f in ("model.pt", "state.pt"):
        try:
            torch.load(os.path.join(d0, f), weights_only=True)
        except Exception as e:  # noqa: BLE001
            problems.append("%s: %s" % (f, e))
    v1 = torch.__version__.startswith("1.")
    try:
        torch.load(os.path.join(d0, "optimizer.pt"), weights_only=True)
        if v1:
            problems.append("1.13 loaded optimizer.pt with weights_only=True: the README's "
                            "limit is wrong")
    except Exception as e:  # noqa: BLE001
        if not v1:
            problems.append("optimizer.pt: %s" % e)
        else:
            # PyTorch's own optimizer file fails the same way in 1.13.
            m = torch.nn.Linear(2, 2)
            o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            path = os.path.join(ctx.tmp, "pytorch-optimizer.pt")
            torch.save(o.state_dict(), path)
            try:
                torch.load(path, weights_only=True)
                problems.append("1.13 loads PyTorch's own optimizer file with weights_only")
            except Exception as e2:  # noqa: BLE001
                if str(e2)[-30:] != str(e)[-30:]:
                    problems.append("1.13 fails otherwise on PyTorch's file: %s / %s" % (e, e2))
    checks.check(not problems, name + ": the files load with weights_only=True (%s)" % (
        "model and state; optimizer as PyTorch's own: not in 1.13" if v1 else "all"),
        "; ".join(problems))
    check_files(checks, name, ck, "ref", have)
    # Continue from s0 to s1 in Python on the same windows.
    model0, opt0, _ = load_ckpt(ck, "ref", s0)
    model1, opt1, _ = load_ckpt(ck, "ref", s1)
    history = {}
    for path in os.listdir(ref_rd.samples):
        got, _ = te.parse_sample_log(os.path.join(ref_rd.samples, path))
        history.update({s: (e, idx) for s, e, idx in got if s0 < s <= s1})
    # lr and momentum come from the file (load_state_dict).
    got, state = te.replay_history(ctx.fx, history, lambda step: 3, lr=1.0, momentum=0.0,
                                   start=(model0, opt0))
    state = state["state"]
    worst = 0.0
    for k, v in model1.items():
        worst = max(worst, float((got[k] - v).abs().max()))
    for i, s in opt1["state"].items():
        worst = max(worst, float((state[i]["momentum_buffer"] - s["momentum_buffer"]).abs().max()))
    checks.check(worst <= 1e-6, name + ": Python's SGD from step %d to %d on the same windows "
                 "ends within 1e-6 of Concord's (max abs diff %.1e)" % (s0, s1, worst))


def case_archive(ctx, name):
    """See Note [Archive writer]: the archives the unit tests write
    (archive_writer_test.cc, zip_writer_test.cc) read in Python."""
    checks = ctx.checks
    tests = os.path.join(ctx.bin_dir, os.pardir, "tests")
    out = os.path.join(ctx.tmp, "archives")
    os.makedirs(out)
    env = dict(os.environ, CONCORD_TEST_ARCHIVE_DIR=out)
    for binary, only in (("worker_torch_test", "ArchiveWriterTest.*"),
                         ("worker_core_test", "ZipWriterTest.ARecordOf4GiB*")):
        r = subprocess.run([os.path.join(tests, binary), "--gtest_filter=" + only], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=120)
        if not checks.check(r.returncode == 0, name + ": %s %s" % (binary, only), r.stdout[-2000:]):
            return
    want = {"big": torch.arange(20000, dtype=torch.float32) / 7,
            "small": torch.tensor([1.5, -2.0, 3.25]),
            "ints": torch.arange(7)}
    for form in ("plain", "zip64"):
        path = os.path.join(out, form + ".pt")
        bad = zipfile.ZipFile(path).testzip()
        got = torch.load(path, weights_only=True)
        same = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
        checks.check(bad is None and same, name + ": %s: zipfile's CRC-32 checks pass, torch.load "
                     "(weights_only) gives the values written" % form, "bad %s, got %s" % (bad, got))
    # 4 GiB + 1 of zeros (a hole), then a record that starts past 4 GiB.
    z = zipfile.ZipFile(os.path.join(out, "zip64-4gib.zip"))
    info = {i.filename: i for i in z.infolist()}
    big, small = info.get("archive/data/0"), info.get("archive/small")
    ok = big is not None and small is not None and big.file_size == (1 << 32) + 1 and \
        small.header_offset > (1 << 32) and z.read("archive/small") == b"after the big one"
    if ok:
        # The big record's CRC-32 is zlib's over its zeros (computed here,
        # not read: the hole would be 4 GiB of reads).
        crc, zeros, left = 0, memoryview(bytes(64 << 20)), big.file_size
        while left:
            crc = zlib.crc32(zeros[:min(left, len(zeros))], crc)
            left -= min(left, len(zeros))
        ok = crc == big.CRC
    checks.check(ok, name + ": ZIP64 past 4 GiB: zipfile reads the sizes, the offset past 4 GiB, "
                 "both records and their CRC-32s", str(info))


def case_crash(ctx, name, stage):
    """concord-run dies (SIGKILL, its workers with it) at `stage` of the
    write of its third checkpoint; the same command again goes on from the
    newest complete one: the checkpoint before it, or (during-latest: the
    directory was renamed into place, only `latest` is old) that one."""
    checks = ctx.checks
    ref = reference(ctx)
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    env = dict(SLOW, CONCORD_TEST_CHECKPOINT_FAULT=stage + ":3")
    rd, p = launch(ctx, name + "-1", job, ck, env=env)
    rc = p.wait(RUN_TIMEOUT)
    m = re.search(r"CONCORD_TEST_CHECKPOINT_FAULT: dying while writing (\d+)", p.stderr())
    if not checks.check(rc in (te.SIGKILL_STATUS, -signal.SIGKILL) and m is not None,
                        name + ": concord-run died writing a checkpoint", p.describe()):
        return
    died = int(m.group(1))
    want = died if stage == "during-latest" else max(s for s in steps(ck, job) if s < died)
    rd2, p2 = launch(ctx, name + "-2", job, ck)
    rc = p2.wait(RUN_TIMEOUT)
    checks.check(rc == 0, name + ": the same command again exits 0", p2.describe())
    step = resumed_step(p2.stderr(), "disk")
    checks.check(step == want, name + ": resumed from step %s, the newest complete checkpoint "
                 "(%d; the write of %d died %s)" % (step, want, died, stage), p2.stderr()[-3000:])
    # (.writer, the folder's writer lock, stays: see Note [One writer per
    # folder] in worker/checkpoint/writer_lock.h)
    leftovers = [d for d in os.listdir(os.path.join(ck, job))
                 if d.startswith(".") and d != ".writer"]
    checks.check(not leftovers, name + ": no staging directory left once a newer one is written",
                 str(leftovers))
    compare_final(checks, name, rd2, ck, job, ref)


def last_not_written(stderr, why, newest):
    """concord-run's line for a last checkpoint it could not write (see Note
    [Exit status] in tools/launcher.h): `why` in it, and the newest the run
    wrote the step `newest` (None: it wrote none)."""
    m = re.search(r"the job's last checkpoint, of step (\d+), was not written to [^:]+: "
                  r"(.*); (?:the newest this run wrote is of step (\d+)|this run wrote none)",
                  stderr)
    if m is None or why not in m.group(2):
        return False
    wrote = int(m.group(3)) if m.group(3) else None
    return wrote == newest and int(m.group(1)) > (newest or 0)


ENOSPC = os.strerror(errno.ENOSPC)  # "No space left on device"
EIO = os.strerror(errno.EIO)  # "Input/output error"
EROFS = os.strerror(errno.EROFS)  # "Read-only file system"
# Steps of at least 10 ms (the reference's): the disk cases' runs.
STEADY = {"CONCORD_TEST_MIN_STEP_MS": "10"}


def case_full_tmpfs(ctx, name):
    """The checkpoint dir is a 96 KiB tmpfs, which refuses O_DIRECT (see
    Note [Direct writes] in worker/checkpoint/file_writer.h: buffered writes
    there): a few checkpoints fit, then the disk is full. Training goes on
    and completes; the failure is said once; the checkpoints there are
    complete: the job started again from a copy of them resumes from the
    newest and ends bit-identical."""
    checks = ctx.checks
    ref = reference(ctx)
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    os.makedirs(ck)
    copy = os.path.join(ctx.tmp, "ck-%s-copy" % name)
    # The tmpfs lives with the namespace: its content is copied out after.
    setup = "mount -t tmpfs -o size=96k tmpfs %s" % ck
    rd, p = launch(ctx, name + "-1", job, ck, setup=setup, env=STEADY,
                   after="cp -a %s %s;" % (ck, copy))
    rc = p.wait(RUN_TIMEOUT)
    if "mount:" in p.stderr() or "unshare:" in p.stderr():
        checks.not_applicable(name, "a tmpfs needs root and mount namespaces")
        return
    said = re.findall(r"not written \(([^)]*)\)", p.stderr())
    checks.check(len(said) == 1 and "No space left" in said[0],
                 name + ": the failure said once (%d line(s))" % len(said), p.stderr()[-3000:])
    kept = steps(copy, job)
    checks.check(rc == 1 and kept and last_not_written(p.stderr(), "No space left", kept[-1]),
                 name + ": training goes on to the end on a full disk; exits 1, saying that the "
                 "last checkpoint was not written", p.describe())
    checks.check(0 < len(kept) < 34, name + ": some checkpoints fit (%s)" % kept)
    rd2, p2 = launch(ctx, name + "-2", job, copy)
    rc = p2.wait(RUN_TIMEOUT)
    step = resumed_step(p2.stderr(), "disk")
    checks.check(rc == 0 and step == kept[-1], name + ": resumed from the newest complete one "
                 "(%s of %s)" % (step, kept), p2.describe())
    compare_final(checks, name, rd2, copy, job, ref)


def mkfs_ext4(ctx, name, image):
    """Makes an ext4 filesystem (4 KiB blocks, none reserved) in `image`, a
    file or /proc/PID/fd/N; False (a case not applicable, or a failed
    check) when it cannot."""
    mkfs = shutil.which("mkfs.ext4") or next(
        (p for p in ("/sbin/mkfs.ext4", "/usr/sbin/mkfs.ext4") if os.path.exists(p)), None)
    if mkfs is None:
        ctx.checks.not_applicable(name, "no mkfs.ext4 (Debian's e2fsprogs)")
        return False
    r = subprocess.run([mkfs, "-q", "-F", "-b", "4096", "-m", "0", image],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    return ctx.checks.check(r.returncode == 0, name + ": mkfs.ext4 of a loop image", r.stdout)


def release_loops(image):
    """Detaches any loop device still backed by `image` (mount -o loop
    detaches its own at the unmount; the namespace's end unmounts)."""
    try:
        out = subprocess.run(["losetup", "-j", image], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    for line in out.splitlines():
        dev = line.split(":", 1)[0]
        if dev.startswith("/dev/loop"):
            subprocess.run(["losetup", "-d", dev], capture_output=True, timeout=30)


# A helper run in the job's mount namespace (launch's `setup` and `after`),
# where the loop-mounted disk is:
#   disk.py fill ROOT N    fills ROOT's filesystem with files ROOT/.filler-*
#                          until exactly N blocks are free (statvfs f_bavail);
#   disk.py probe JOBDIR OUT
#                          writes to OUT the free blocks of JOBDIR's
#                          filesystem and, for each step-N/*.pt, its size and
#                          each page's residency in the page cache (mincore(2)
#                          over a mapping that touches nothing), before
#                          anything reads the files. See Note [Direct writes] in
#                          worker/checkpoint/file_writer.h: the pages a file's
#                          whole 4 KiB blocks went to with O_DIRECT are not in
#                          the page cache; its last partial page, written
#                          after O_DIRECT is turned off, is.
DISK_TOOL = r'''
import ctypes, json, mmap, os, sys
if sys.argv[1] == "fill":
    root, want, i = sys.argv[2], int(sys.argv[3]), 0
    while os.statvfs(root).f_bavail > want:
        st = os.statvfs(root)
        with open(os.path.join(root, ".filler-%d" % i), "wb") as f:
            os.posix_fallocate(f.fileno(), 0, (st.f_bavail - want) * st.f_frsize)
            os.fsync(f.fileno())
        i += 1
    free = os.statvfs(root).f_bavail
    print("disk.py: %d blocks free (%d wanted)" % (free, want), file=sys.stderr)
    sys.exit(0 if free == want else 1)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
job_dir, out = sys.argv[2], {}
for d in sorted(os.listdir(job_dir)):
    if not d.startswith("step-"):
        continue
    for f in sorted(os.listdir(os.path.join(job_dir, d))):
        path = os.path.join(job_dir, d, f)
        size = os.path.getsize(path)
        if not f.endswith(".pt") or size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        os.close(fd)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), "mmap " + path)
        vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        if libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore " + path)
        libc.munmap(addr, size)
        out[d + "/" + f] = [size, [b & 1 for b in vec.raw]]
with open(sys.argv[3], "w") as f:
    json.dump({"page": mmap.PAGESIZE, "free": os.statvfs(job_dir).f_bavail, "files": out}, f)
'''
DIRECT_ALIGN = 4096  # WriteBuffers::kAlign


def direct_write_problems(path):
    """What in `disk.py probe`'s output (`path`) says that the data files were
    not written with O_DIRECT: a page of a file's first whole 4 KiB blocks
    in the page cache, or (the probe's own check) its buffered last page
    not; and no file with a whole block at all."""
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError) as e:
        return ["no residency probe output: %s" % e], 0
    page, problems, direct = got["page"], [], 0
    for f, (size, resident) in sorted(got["files"].items()):
        whole = size // DIRECT_ALIGN * DIRECT_ALIGN
        cached = [i for i, r in enumerate(resident) if r and (i + 1) * page <= whole]
        direct += whole
        if cached:
            problems.append("%s: pages %s of its %d bytes written with O_DIRECT are cached" % (
                f, cached, whole))
        if whole < size and not resident[(size - 1) // page]:
            problems.append("%s: its buffered last page is not cached" % f)
    if not direct:
        problems.append("no data file of a whole 4 KiB block: %s" % got["files"])
    return problems, direct


def check_files(checks, name, ck, job, kept):
    """Every .pt of each checkpoint in `kept` (a real job's files): zipfile's
    CRC-32 checks pass (testzip), the file's size and CRC-32 are the
    manifest's, torch.load(weights_only=True) loads it (optimizer files on
    PyTorch 2.x: 1.13's weights-only unpickler has no floats, see the python
    case)."""
    v1 = torch.__version__.startswith("1.")
    problems, files = [], 0
    for s in kept:
        d = os.path.join(ck, job, "step-%d" % s)
        with open(os.path.join(d, "manifest.json")) as f:
            listed = json.load(f)["files"]
        pts = sorted(f for f in os.listdir(d) if f.endswith(".pt"))
        if pts != sorted(listed):
            problems.append("step-%d: files %s, the manifest lists %s" % (s, pts, sorted(listed)))
        for f in pts:
            path = os.path.join(d, f)
            files += 1
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
                if (len(data), zlib.crc32(data)) != (listed.get(f, {}).get("size"),
                                                     listed.get(f, {}).get("crc32")):
                    problems.append("step-%d/%s: size or CRC-32 not the manifest's" % (s, f))
                with zipfile.ZipFile(path) as z:
                    bad = z.testzip()
                if bad is not None:
                    problems.append("step-%d/%s: record %s fails its CRC-32" % (s, f, bad))
                torch.load(path, weights_only=not (v1 and f.startswith("optimizer")))
            except Exception as e:  # noqa: BLE001
                problems.append("step-%d/%s: %s" % (s, f, e))
    checks.check(files > 0 and not problems,
                 name + ": every file of the %d checkpoint(s) kept (%d .pt) passes zipfile's "
                 "CRC-32 checks, matches the manifest and loads with torch.load" % (
                     len(kept), files), "; ".join(problems[:10]))


def check_failing(ctx, name, coord, job, first, last, written):
    """The coordinator's view of a failing disk tier: `concordctl
    checkpoints` totals (`written` written, the latest failure with one of
    the texts `last`), one event in `concordctl status` (with `first`, the
    first failure's text), /metrics."""
    checks = ctx.checks
    listed, out = checkpoints_json(ctx, coord, job)
    totals = listed.get("totals") or {}
    failing = totals.get("failing") or {}
    checks.check(totals.get("written") == written and totals.get("failed", 0) >= 1 and
                 any(why in failing.get("error", "") for why in last),
                 name + ": concordctl checkpoints shows the failing writes with the errno's text "
                 "(%s written, %s failed: %s)" % (totals.get("written"), totals.get("failed"),
                                                  failing.get("error")), out)
    events, status = checkpoint_events(ctx, coord, job)
    failed = [e for e in events if "not written" in e]
    checks.check(len(failed) == 1 and first in failed[0],
                 name + ": one event in concordctl status, with the errno's text",
                 "%s\n%s" % (events, status[-2000:]))
    check_failing_metrics(checks, name, coord, job, totals)


def resume_from_copy(ctx, name, job, copy, kept, ref):
    """The job started again from the copy of the failed disk's folder:
    nothing staged there, it resumes from the newest complete checkpoint and
    ends bit-identical to the uninterrupted run."""
    checks = ctx.checks
    staged = [d for d in os.listdir(os.path.join(copy, job))
              if d.startswith(".") and d != ".writer"]
    checks.check(not staged, name + ": no staging directory left of the failed writes",
                 str(staged))
    rd2, p2 = launch(ctx, name + "-2", job, copy)
    rc = p2.wait(RUN_TIMEOUT)
    step = resumed_step(p2.stderr(), "disk")
    checks.check(rc == 0 and step == kept[-1], name + ": started again, resumed from the newest "
                 "complete one (%s of %s)" % (step, kept), p2.describe())
    compare_final(checks, name, rd2, copy, job, ref)


def case_full_disk(ctx, name):
    """The checkpoint dir is an ext4 on a loop device (4 KiB blocks; too
    small for a journal), where the disk tier writes with O_DIRECT (see Note
    [Direct writes] in worker/checkpoint/file_writer.h). Other files fill it
    to the room of FIT checkpoints (their blocks counted from the
    reference's), the next one's folder and a block: that one's first data
    file (model.pt) cannot take its first O_DIRECT write, and every write
    after fails there too (a failed write's staging directory is removed).
    Training goes on and completes; the failure is said once, the writer's
    ENOSPC; concord-run exits 1 naming the last checkpoint not written; the
    coordinator shows the failing writes; the FIT checkpoints there were
    written with O_DIRECT (their whole blocks not in the page cache), are
    complete and load in Python; the job started again from a copy of them
    resumes from the newest and ends bit-identical."""
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    image = os.path.join(ctx.tmp, name + ".img")
    with open(image, "wb") as f:
        f.truncate(1 << 20)
    try:
        if mkfs_ext4(ctx, name, image):
            full_disk_run(ctx, name, job, ck, image)
    finally:
        release_loops(image)
        os.remove(image)


FIT = 3  # checkpoints that fit on case full-disk's disk
BLOCK = 4096  # its filesystem's block


def full_disk_run(ctx, name, job, ck, image):
    checks = ctx.checks
    ref = reference(ctx)
    # A checkpoint's blocks: its folder's, each file's. The job's folder and
    # `latest` take one each; model.pt is written first (modules first).
    sample = os.path.join(ref[1], "ref", "step-%d" % EVERY)
    sizes = {f: os.path.getsize(os.path.join(sample, f)) for f in os.listdir(sample)}
    per = 1 + sum((n + BLOCK - 1) // BLOCK for n in sizes.values())
    first = sizes["model.pt"] // BLOCK * BLOCK
    free = 2 + FIT * per + 1 + (first // BLOCK) // 2
    os.makedirs(ck)
    copy = os.path.join(ctx.tmp, "ck-%s-copy" % name)
    tool, probe = os.path.join(ctx.tmp, "disk.py"), os.path.join(ctx.tmp, name + "-probe.json")
    with open(tool, "w") as f:
        f.write(DISK_TOOL)
    coord = start_coordinator(ctx, name)
    if coord is None:
        return
    try:
        # The mount lives with the namespace (unmounted, its loop device
        # detached, when the job ends): the files are probed, then copied out.
        setup = "mount -o loop %s %s && %s %s fill %s %d" % (image, ck, sys.executable, tool, ck,
                                                            free)
        after = "%s %s probe %s %s; mkdir %s && cp -a %s %s;" % (
            sys.executable, tool, os.path.join(ck, job), probe, copy, os.path.join(ck, job), copy)
        rd, p = launch(ctx, name + "-1", job, ck, setup=setup, env=STEADY, coordinator=coord,
                       after=after)
        rc = p.wait(RUN_TIMEOUT)
        if "mount:" in p.stderr() or "unshare:" in p.stderr():
            checks.not_applicable(name, "a loop mount needs root, loop devices and mount "
                                  "namespaces")
            return
        if not checks.check("disk.py: %d blocks free" % free in p.stderr() and
                            os.path.isdir(copy), name + ": the disk filled to %d free blocks "
                            "(%d a checkpoint)" % (free, per), p.describe()):
            return
        said = re.findall(r"not written \(([^)]*)\)", p.stderr())
        checks.check(len(said) == 1 and re.search(
            r"cannot write \S*/\.staging-step-\d+-\d+/model\.pt, an O_DIRECT write of \d+ "
            r"bytes at offset \d+: " + ENOSPC + "$", said[0]),
            name + ": the failure said once, the writer's O_DIRECT write of model.pt (%d "
            "line(s): %s)" % (
                len(said), said[:1]), p.stderr()[-3000:])
        kept = steps(copy, job)
        checks.check(rc == 1 and kept and last_not_written(p.stderr(), ENOSPC, kept[-1]),
                     name + ": training goes on to the end on a full disk; exits 1, saying that "
                     "the last checkpoint was not written", p.describe())
        checks.check(len(kept) == FIT, name + ": %d checkpoints fit (%s)" % (FIT, kept))
        problems, direct = direct_write_problems(probe)
        checks.check(not problems, name + ": the disk tier wrote with O_DIRECT (%d bytes in "
                     "whole blocks, none in the page cache)" % direct, "; ".join(problems[:10]))
        try:
            with open(probe) as f:
                left = json.load(f)["free"]
        except (OSError, ValueError, KeyError):
            left = None
        # The failed write's folder took one; model.pt's whole blocks (its
        # first write, with O_DIRECT) did not fit in the rest.
        checks.check(left is not None and 1 <= left and left - 1 < first // BLOCK,
                     name + ": the ENOSPC came from an O_DIRECT write: %s block(s) left, less "
                     "than a folder's and model.pt's %d whole blocks" % (left, first // BLOCK))
        check_failing(ctx, name, coord, job, ENOSPC, [ENOSPC], len(kept))
    finally:
        coord.stop()
    if kept:
        check_files(checks, name, copy, job, kept)
        resume_from_copy(ctx, name, job, copy, kept, ref)


def case_disk_eio(ctx, name):
    """The checkpoint dir is an 8 MiB ext4 (with its journal) on a loop
    device whose backing file is a memfd: once a checkpoint of step >= 30 is
    complete the memfd is sealed against writes (F_SEAL_WRITE), and from then
    on every write of the device fails and the kernel returns EIO, as a dying
    disk does. Training goes on and completes; the failure is said once,
    with EIO's text, naming a file of the staging directory; concord-run
    exits 1 naming the last checkpoint not written (EIO, or EROFS once ext4
    has aborted its journal over the I/O errors: its commit timer decides
    which comes first); the coordinator shows the failing writes; nothing
    half-written is left; the checkpoints written before load in Python,
    and the job started again from a copy of them resumes from the newest
    and ends bit-identical."""
    checks = ctx.checks
    if not hasattr(os, "memfd_create") or not hasattr(fcntl, "F_SEAL_WRITE"):
        checks.not_applicable(name, "no memfd seals in this Python")
        return
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING)
    backing = "/proc/%d/fd/%d" % (os.getpid(), fd)
    try:
        os.ftruncate(fd, 8 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        if mkfs_ext4(ctx, name, backing):
            disk_eio_run(ctx, name, fd, backing)
    finally:
        release_loops(backing)
        os.close(fd)


def disk_eio_run(ctx, name, fd, backing):
    checks = ctx.checks
    ref = reference(ctx)
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    os.makedirs(ck)
    copy = os.path.join(ctx.tmp, "ck-%s-copy" % name)
    coord = start_coordinator(ctx, name)
    if coord is None:
        return
    try:
        rd, p = launch(ctx, name + "-1", job, ck, setup="mount -o loop %s %s" % (backing, ck),
                       env=STEADY, coordinator=coord, after="cp -a %s %s;" % (ck, copy))
        # The job's view of the folder, in its mount namespace.
        inside = "/proc/%d/root%s" % (p.pid, ck)
        te.testlib.wait_for(lambda: processes.latest_checkpoint_step(inside, job) >= 30 or
                            p.poll() is not None, timeout=60)
        if p.poll() is not None and ("mount:" in p.stderr() or "unshare:" in p.stderr()):
            checks.not_applicable(name, "a loop mount needs root, loop devices and mount "
                                  "namespaces")
            return
        sealed = processes.latest_checkpoint_step(inside, job)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        if not checks.check(sealed >= 30 and p.poll() is None,
                            name + ": the disk fails while the job runs (after the checkpoint "
                            "of step %d)" % sealed, p.describe()):
            return
        rc = p.wait(RUN_TIMEOUT)
        said = re.findall(r"not written \(([^)]*)\)", p.stderr())
        checks.check(len(said) == 1 and re.search(
            r"cannot \w+ \S*/\.staging-step-\d+-\d+[^:]*: " + EIO, said[0]),
            name + ": the failure said once, with EIO's text, in the middle of a write (%d "
            "line(s): %s)" % (len(said), said[:1]), p.stderr()[-3000:])
        kept = steps(copy, job)
        # ext4 aborts its journal at the I/O error and refuses writes after
        # (EROFS) once it has tried to commit: when depends on its commit
        # timer, so the last failure may be either.
        last = [why for why in (EIO, EROFS) if last_not_written(p.stderr(), why, kept[-1])] \
            if kept else []
        checks.check(rc == 1 and kept and kept[-1] >= sealed and last,
                     name + ": training goes on to the end; exits 1, saying that the last "
                     "checkpoint was not written (%s; the newest of step %s)" % (
                         last[:1], kept[-1] if kept else None), p.describe())
        check_failing(ctx, name, coord, job, EIO, [EIO, EROFS], len(kept))
    finally:
        coord.stop()
    if kept:
        check_files(checks, name, copy, job, kept)
        resume_from_copy(ctx, name, job, copy, kept, ref)


def check_failing_metrics(checks, name, coord, job, totals):
    """/metrics says the job's checkpoints fail, with the coordinator's
    count of failures (`totals`, its CheckpointTotals as JSON)."""
    _, samples = coord.metrics()
    label = '{job="%s"}' % job
    checks.check(samples.get("concord_job_checkpoint_failing" + label) == 1 and
                 samples.get("concord_job_checkpoint_failures_total" + label) == totals.get("failed"),
                 name + ": /metrics says the checkpoints fail (%s failures)" % totals.get("failed"),
                 json.dumps({k: v for k, v in samples.items() if "checkpoint" in k}))


def checkpoint_events(ctx, coord, job):
    """The messages of the job's recent checkpoint events (`concordctl -o
    json status`), and that command's output."""
    status = ts.ctl(ctx.bins, coord, "-o", "json", "status", job)
    try:
        return [e["message"] for e in json.loads(status.stdout)["recent_events"]
                if e["kind"] == "checkpoint"], status.stdout
    except (ValueError, KeyError):
        return [], status.stdout


def case_small_shm(ctx, name):
    """Module docstring, small-shm (see Note [Writes from the worker] in
    worker/checkpoint/checkpointer.h)."""
    checks = ctx.checks
    ref = reference(ctx)
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    coord = start_coordinator(ctx, name)
    if coord is None:
        return
    try:
        # The default --checkpoint-keep (3): pruning on a real job.
        rd, p = launch(ctx, name, job, ck, coordinator=coord, keep=None,
                       setup="mount -t tmpfs -o size=16k tmpfs /dev/shm")
        rc = p.wait(RUN_TIMEOUT)
        if "mount:" in p.stderr() or "unshare:" in p.stderr():
            checks.not_applicable(name, "a tmpfs on /dev/shm needs root and mount namespaces")
            return
        said = re.findall(r"the memory stage failed \((.*)\): checkpoint of step \d+ written "
                          r"to .* from this worker", p.stderr())
        checks.check(rc == 0 and len(said) == 1 and "No space left" in said[0],
                     name + ": the job completes; rank 0 writes the checkpoints itself, said "
                     "once (%d line(s))" % len(said), p.describe())
        kept = steps(ck, job)
        listed, out = checkpoints_json(ctx, coord, job)
        totals = listed.get("totals") or {}
        newest = (listed.get("checkpoints") or [{}])[0]
        checks.check(len(kept) == 3 and kept == sorted(c.get("step") for c in
                                                       (listed.get("checkpoints") or [])[:3]),
                     name + ": the default --checkpoint-keep: the newest 3 on disk (%s), the "
                     "older ones pruned" % kept, out)
        checks.check(totals.get("written", 0) > len(kept) and
                     not totals.get("failed") and newest.get("step") == kept[-1],
                     name + ": the coordinator has every write (%s written, none failed; the "
                     "newest of step %s, on disk %s)" % (totals.get("written"),
                                                         newest.get("step"), kept), out)
        events, _ = checkpoint_events(ctx, coord, job)
        checks.check(any("itself" in e for e in events),
                     name + ": its events name the worker that wrote them", "\n".join(events))
        compare_final(checks, name, rd, ck, job, ref)
    finally:
        coord.stop()


def case_read_only(ctx, name):
    """The checkpoint dir holds a complete checkpoint and is mounted
    read-only: the job resumes from it, cannot write more, says so once and
    completes; the coordinator shows the failing write (concordctl, one
    event, /metrics)."""
    ref_rd, ref_ck = reference(ctx)
    job, ck = "ref", os.path.join(ctx.tmp, "ck-" + name)
    # A busy disk can make the reference skip a checkpoint (its write still
    # running when the next is due), so the one copied is whichever it wrote
    # nearest step 100.
    step = min(steps(ref_ck, job)[:-1], key=lambda s: abs(s - 100))
    os.makedirs(os.path.join(ck, job))
    shutil.copytree(os.path.join(ref_ck, job, "step-%d" % step),
                    os.path.join(ck, job, "step-%d" % step))
    setup = "mount --bind {0} {0} && mount -o remount,ro,bind {0}".format(ck)
    coord = start_coordinator(ctx, name)
    if coord is None:
        return
    try:
        read_only_run(ctx, name, job, ck, step, setup, coord, ref_rd)
    finally:
        coord.stop()


def read_only_run(ctx, name, job, ck, step, setup, coord, ref_rd):
    checks = ctx.checks
    rd, p = launch(ctx, name, job, ck, setup=setup, coordinator=coord)
    rc = p.wait(RUN_TIMEOUT)
    if "mount:" in p.stderr() or "unshare:" in p.stderr():
        checks.not_applicable(name, "a read-only bind mount needs root")
        return
    checks.check(rc == 1 and resumed_step(p.stderr(), "disk") == step and
                 last_not_written(p.stderr(), "Read-only", None),
                 name + ": resumes from the read-only dir's checkpoint and trains to the end; "
                 "exits 1, saying that the last checkpoint was not written (the newest on "
                 "disk: step %d)" % step, p.describe())
    said = re.findall(r"not written \(([^)]*)\)", p.stderr())
    checks.check(len(said) == 1 and "Read-only" in said[0],
                 name + ": the failure to write said once (%d line(s))" % len(said),
                 p.stderr()[-3000:])
    checks.check(steps(ck, job) == [step], name + ": nothing written there")
    a, e = fixtures.load_state(rd.output), fixtures.load_state(ref_rd.output)
    checks.check(not fixtures.compare_states(a, e, rtol=0.0, atol=0.0),
                 name + ": final parameters bit-identical to the uninterrupted run's")
    listed, out = checkpoints_json(ctx, coord, job)
    totals = listed.get("totals") or {}
    failing = totals.get("failing") or {}
    checks.check(totals.get("written") == 0 and totals.get("failed", 0) >= 1 and
                 "Read-only" in failing.get("error", "") and failing.get("step", 0) > step,
                 name + ": the coordinator shows the failing write (%s failed, %s written)" % (
                     totals.get("failed"), totals.get("written")), out)
    events, status = checkpoint_events(ctx, coord, job)
    checks.check(len([e for e in events if "not written" in e]) == 1,
                 name + ": one event for the failing writes", "%s\n%s" % (events, status[-2000:]))
    check_failing_metrics(checks, name, coord, job, totals)


def case_coordinator(ctx, name):
    """Against a separate coordinator: each checkpoint concord-run writes is
    reported through its node agent and kept in the job's record:
    `concordctl checkpoints` lists them, newest first, the job's final one
    included, as they are on disk."""
    coord = start_coordinator(ctx, name)
    if coord is None:
        return
    try:
        coordinator_run(ctx, name, coord)
    finally:
        coord.stop()


def coordinator_run(ctx, name, coord):
    checks = ctx.checks
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    rd, p = launch(ctx, name, job, ck, coordinator=coord, env={"CONCORD_TEST_MIN_STEP_MS": "10"})
    rc = p.wait(RUN_TIMEOUT)
    checks.check(rc == 0, name + ": the job completes", p.describe())
    j, out = checkpoints_json(ctx, coord, job)
    listed = j.get("checkpoints", [])
    on_disk = steps(ck, job)
    got = [c["step"] for c in listed]
    checks.check(got and got == sorted(got, reverse=True) and
                 got[0] == on_disk[-1] and set(got) <= set(on_disk) and len(got) == min(10, len(on_disk)),
                 name + ": concordctl checkpoints lists the newest ones, the final included "
                 "(%s; on disk %s)" % (got, on_disk), out)
    ok = all(c["path"] == os.path.join(ck, job, "step-%d" % c["step"]) and c["bytes"] > 0 and
             c["world_size"] == 3 and 0 < c["stall_seconds"] < 5 and not c["error"] for c in listed)
    checks.check(ok, name + ": each with its path, size, world size and stall", json.dumps(listed[:2]))
    totals = j.get("totals") or {}
    # Every write is reported; a due one that found the last still being
    # written is skipped and counted (how many depends on the disk). The
    # job's final state may write its last step's directory again (the due
    # checkpoint of that step was taken before the epoch moved on).
    written = totals.get("written", -1)
    checks.check(len(on_disk) <= written <= len(on_disk) + 1 and totals.get("failed") == 0 and
                 totals.get("failing") is None and totals.get("skipped", -1) >= 0,
                 name + ": the totals count every checkpoint written (%s)" % totals, out)
    _, samples = coord.metrics()
    label = '{job="%s"}' % job
    newest = listed[0] if listed else {}
    want = {"concord_job_checkpoints_written_total": totals.get("written"),
            "concord_job_checkpoints_skipped_total": totals.get("skipped"),
            "concord_job_checkpoint_failures_total": 0,
            "concord_job_checkpoint_failing": 0,
            "concord_job_checkpoint_step": newest.get("step"),
            "concord_job_checkpoint_bytes": newest.get("bytes")}
    wrong = {k: (samples.get(k + label), v) for k, v in want.items() if samples.get(k + label) != v}
    stall = samples.get("concord_job_checkpoint_stall_seconds" + label)
    checks.check(not wrong and stall is not None and abs(stall - newest.get("stall_seconds", -1)) < 1e-9,
                 name + ": /metrics has the checkpoints' totals, step, size and stall",
                 "(got, want): %s; stall %s" % (wrong, stall))


# LocalSGD averaging every 5 steps with slow momentum every 10, sharded over
# the 3 workers (the optimizer's momentum as each case says).
# See Note [Participants in checkpoints]: rank 0's line when a checkpoint's
# state differs between the ranks in a way it does not keep.
ONE_RANK = re.compile(r"[^\n]*it holds one rank's[^\n]*")
SLOWMO = ["--algorithm", "slowmo-localsgd", "--localsgd-frequency", "5",
          "--slowmo-frequency", "10", "--slowmo-num-shards", "3"]


def case_slowmo(ctx, name):
    """See Note [Participants in checkpoints]: a SlowMo job killed whole
    resumes with its slow momentum (gathered from its 3 owners into the
    checkpoint, re-sharded at the resume), bit-identical to an uninterrupted
    run: every checkpoint is taken after an average."""
    checks = ctx.checks
    ref_ck = os.path.join(ctx.tmp, "ck-slowmo-ref")
    ref_rd, p = launch(ctx, name + "-ref", "slowmo-ref", ref_ck, train_extra=SLOWMO,
                       momentum="0", env={"CONCORD_TEST_MIN_STEP_MS": "10"})
    if not checks.check(p.wait(RUN_TIMEOUT) == 0, name + ": the uninterrupted run exits 0",
                        p.describe()):
        return
    state = torch.load(os.path.join(ref_ck, "slowmo-ref", "step-%d" % EVERY, "state.pt"),
                       weights_only=True)
    keys = sorted(k for k in state if k.startswith("slowmo/"))
    u = state.get("slowmo/model/slow_momentum")
    checks.check(u is not None and u.numel() == sum(
        t.numel() for t in fixtures.load_state(ref_rd.output).values()) and
        int(state["slowmo/model/updates"]) == EVERY and u.abs().sum() > 0,
        name + ": state.pt holds the whole slow momentum, after the update of its step",
        str(keys))
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    rd, p = launch(ctx, name + "-1", job, ck, train_extra=SLOWMO, momentum="0", env=SLOW)
    if not wait_for_checkpoint(checks, name, p, ck, job, 60):
        return
    rd2, p2, _, _ = run_again(ctx, name, job, ck, p, train_extra=SLOWMO, momentum="0")
    checks.check("restart from the current parameters" not in p2.stderr(),
                 name + ": no slow-momentum slice restarted at the resume",
                 p2.stderr()[-3000:])
    # See Note [Participants in checkpoints]: every checkpoint is taken after
    # an average, with an optimizer without state: nothing to warn of.
    said = ONE_RANK.findall(p.stderr() + p2.stderr())
    checks.check(not said, name + ": no checkpoint said to differ between the ranks",
                 "\n".join(said[:2]))
    compare_final(checks, name, rd2, ck, job, (ref_rd, ref_ck), ref_job="slowmo-ref")
    slowmo_momentum(ctx, name + "-momentum")


def slowmo_momentum(ctx, name):
    """See Note [Each rank's optimizer state]: with SGD's momentum each
    rank's optimizer state is its own (gradients are not averaged); every
    checkpoint keeps all 3, and the job killed whole resumes bit-identical
    to an uninterrupted run, each rank with its own, nothing said."""
    checks = ctx.checks
    ref_job = name + "-ref"
    ref_ck = os.path.join(ctx.tmp, "ck-" + ref_job)
    ref_rd, p = launch(ctx, ref_job, ref_job, ref_ck, train_extra=SLOWMO,
                       env={"CONCORD_TEST_MIN_STEP_MS": "10"})
    if not checks.check(p.wait(RUN_TIMEOUT) == 0, name + ": the uninterrupted run exits 0",
                        p.describe()):
        return
    state = torch.load(os.path.join(ref_ck, ref_job, "step-%d" % EVERY, "state.pt"),
                       weights_only=True)
    rows = {k: t for k, t in state.items() if k.startswith("slowmo/model/rank_optimizer/")}
    checks.check(rows and all(t.shape[0] == 3 for t in rows.values()) and
                 any(not torch.equal(t[0], t[1]) for t in rows.values()),
                 name + ": state.pt holds the 3 ranks' momentum buffers, which differ",
                 str({k: list(t.shape) for k, t in rows.items()}))
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    rd, p1 = launch(ctx, name + "-1", job, ck, train_extra=SLOWMO, env=SLOW)
    if not wait_for_checkpoint(checks, name, p1, ck, job, 60):
        return
    rd2, p2, _, _ = run_again(ctx, name, job, ck, p1, train_extra=SLOWMO)
    checks.check("ranks below 3 take their own optimizer state" in p2.stderr(),
                 name + ": at the resume each rank takes its own optimizer state",
                 p2.stderr()[-3000:])
    said = ONE_RANK.findall(p.stderr() + p1.stderr() + p2.stderr())
    checks.check(not said, name + ": no checkpoint said to differ between the ranks",
                 "\n".join(said[:2]))
    compare_final(checks, name, rd2, ck, job, (ref_rd, ref_ck), ref_job=ref_job)


def case_powersgd(ctx, name):
    """See Note [PowerSGD across re-forms]: PowerSGD (rank 1, compressing from
    iteration 5) keeps its state when a worker is killed and restarted (the
    newcomer takes the count and Q: a newcomer that went back to vanilla
    allreduce would not match the survivors' collectives), and in
    checkpoints: killed whole, the job resumes with its count, so the final
    checkpoint's count is the job's step count, with the summed error
    feedback beside it."""
    checks = ctx.checks
    hook = ["--comm-hook", "powersgd:1:5"]
    job, ck = name, os.path.join(ctx.tmp, "ck-" + name)
    rd, p = launch(ctx, name + "-1", job, ck, extra=["--max-restarts", "1"], train_extra=hook,
                   env=SLOW)
    if not wait_for_checkpoint(checks, name, p, ck, job, 30):
        return
    trainers = processes.children(p.pid)
    os.kill(trainers[-1], signal.SIGKILL)
    if not wait_for_checkpoint(checks, name + " (a worker killed and restarted)", p, ck, job,
                               processes.latest_checkpoint_step(ck, job) + 2 * EVERY):
        return
    rd2, p2, _, _ = run_again(ctx, name, job, ck, p, train_extra=hook)
    last = steps(ck, job)[-1]
    state = torch.load(os.path.join(ck, job, "step-%d" % last, "state.pt"), weights_only=True)
    it = state.get("powersgd/model/iteration")
    errors = [k for k in state if k.startswith("powersgd/model/error/")]
    checks.check(it is not None and int(it) == last and errors,
                 name + ": the final checkpoint's PowerSGD count is the job's %d steps, "
                 "with its error feedback" % last,
                 "iteration %s, error entries %s" % (it, errors))
    check_history(checks, name, [rd, rd2], 3)


CASES = {
    "kill-all": lambda ctx: case_kill_all(ctx, "kill-all", keep=None),
    "memory": lambda ctx: case_memory(ctx, "memory"),
    "world2": lambda ctx: case_kill_all(ctx, "world2", nproc_after=2),
    "python": lambda ctx: case_python(ctx, "python"),
    "archive": lambda ctx: case_archive(ctx, "archive"),
    "crash-before-manifest": lambda ctx: case_crash(ctx, "crash-bm", "before-manifest"),
    "crash-before-rename": lambda ctx: case_crash(ctx, "crash-br", "before-rename"),
    "crash-during-latest": lambda ctx: case_crash(ctx, "crash-dl", "during-latest"),
    "full-disk": lambda ctx: case_full_disk(ctx, "full-disk"),
    "full-tmpfs": lambda ctx: case_full_tmpfs(ctx, "full-tmpfs"),
    "disk-eio": lambda ctx: case_disk_eio(ctx, "disk-eio"),
    "read-only": lambda ctx: case_read_only(ctx, "read-only"),
    "small-shm": lambda ctx: case_small_shm(ctx, "small-shm"),
    "coordinator": lambda ctx: case_coordinator(ctx, "coordinator"),
    "started-again": lambda ctx: case_started_again(ctx, "started-again"),
    "slowmo": lambda ctx: case_slowmo(ctx, "slowmo"),
    "powersgd": lambda ctx: case_powersgd(ctx, "powersgd"),
}


if __name__ == "__main__":
    sys.exit(checkpoint_main(__doc__, CASES, "concord_checkpoint_"))

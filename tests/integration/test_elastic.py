#!/usr/bin/python3
"""Integration test of elastic training: real multi-process runs of
concord-run + concord-train where workers die (SIGKILL), leave when their data
runs out, join mid-run or are restarted.

    /usr/bin/python3 tests/integration/test_elastic.py --bin-dir build/bin \
        [--group GROUP ...] [--case NAME ...] [--seed N] [--keep]
    /usr/bin/python3 tests/integration/test_elastic.py --list

Without --group or --case every case runs (about 2.5 minutes on 2 cores).

Every run uses a small TorchScript MLP without buffers (SmoothMLP: fixtures'
mlp-plain with tanh activations, on its data: regression, mse) and SGD with
momentum (optimizer state that joiners must receive). Workers are killed with concord-train's test hook
CONCORD_TEST_KILL="LOCAL:STEP:PHASE[,...]" (local worker LOCAL of
concord-run SIGKILLs itself when taking optimizer step STEP: before the
forward, while gradient buckets are in flight, or after optimizer.step()
before the commit), or, in the chaos group, by this script. Every step takes
at least 3 ms (CONCORD_TEST_MIN_STEP_MS), so that the job still runs when a
joiner or a restarted worker arrives.

What is checked (per case, see CASES / --list):
  * the job finishes within a bounded time (every subprocess has a timeout; on
    timeout its whole process group is killed and the case fails);
  * every worker that finished training wrote --output-per-worker
    DIR/<worker id>.pt, and all of them are bit-identical (same keys,
    torch.equal on every tensor);
  * with elastic sharding, the sample logs (--sample-log) show every sample of
    every epoch exactly once over the job's committed steps: the complete
    lines of all workers merged by STEP agree, the steps are 1..N with N the
    job's optimizer steps, and per epoch the union of the windows holds each
    index exactly once (see check_sample_logs for the one allowed exception);
  * --metrics-out (the authoritative rank's): optimizer_steps, reforms,
    world_size as the schedule implies;
  * the final model is what the committed history says it must be: a replay
    in this process (torch.optim.SGD on the same model) of every committed
    step's window over that step's world size (from the workers' logs)
    matches it to 1e-4 (check_replay: a lost or doubled step, a wrong
    divisor or optimizer state lost in a hand-over is far larger);
  * where arithmetic says so, the final model equals a fault-free run's bit
    for bit: a death before the first step (prestep), and a restart that the
    others must wait for (min_workers = W), so that every step has the
    fault-free run's window and world size (compare_to_fault_free);
  * concord-run's exit status (see Note [Exit status] in tools/launcher.h): 0
    when the job completed, also after a worker died for good (a launcher
    whose only worker died while the job went on elsewhere exits 137, that
    worker's status); the death is reported when it happens ("concord-run:
    worker I (pid P, worker id W) failed after T s: killed by signal 9
    (SIGKILL); restarting it / not restarting it").

Groups (one ctest entry each):
  kill       a rank dies in forward / backward / optimizer, no restarts,
             min_workers lower: W = 2..5.
  prestep    a rank dies at step 1 (W=3 -> 2): bit-identical to a fault-free
             run with 2 workers from the start (same data, seed, shuffle).
  fixed      --sharding fixed with uneven data (ranks leave when their data
             runs out, PyTorch's join), alone and with deaths; one case
             starts one launcher per rank against a standalone coordinator
             so that the dying, leaving and finishing ranks are chosen.
  join       a second concord-run joins a running job (standalone
             concord-coordinator): 2 -> 3 workers.
  restart    --max-restarts: the restarted worker rejoins, concord-run exits 0
             (also when it comes back only after the job finished).
  below-min  the job falls below min_workers: concord-run --standalone stops
             the survivor at once and exits non-zero, saying why.
  rendezvous-timeout
             the same against a separate coordinator: the rendezvous times
             out (3 s) and the survivor fails within a bounded time with a
             clear message. KNOWN PRODUCT BUG: the message is a bare
             DEADLINE_EXCEEDED (see case_below_min_coordinator).
  zero       --optimizer adam --zero: a worker dies after the optimizer step,
             after its local update (before the parameters' broadcast), or
             before its forward (W = 3, 4), or dies and is restarted; the survivors (and
             the newcomer) bit-identical to the unsharded job's with the same
             death.
  chaos      4 workers, --max-restarts 20, --min-workers 2: this script
             SIGKILLs a random live concord-train every 2-4 s (seeded) for a
             bounded time, then lets the job finish.

Prints one line per check, a summary line per case and a final
'N passed, N failed'; exits 1 on any failure.
"""

import argparse
import collections
import os
import random
import re
import signal
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))

import torch  # noqa: E402

import fixtures  # noqa: E402
import processes  # noqa: E402
import testlib  # noqa: E402
from elastic_harness import (  # noqa: E402
    Bins,
    Checks,
    Fixture,
    Proc,
    RUN_TIMEOUT,
    RunDir,
    SIGKILL_STATUS,
    TRAIN_FLAGS,
    TrainArgs,
    check_history,
    check_metrics,
    check_outputs_identical,
    check_replay,
    check_sample_logs,
    compare_to_fault_free,
    expect_exit,
    first_ranks,
    job_progress,
    kill_env,
    killed_locals,
    last_step_of,
    launch_cmd,
    start_coordinator,
    summary,
    train_args,
    Context,
    run_cases,
)


# --- the schedules --------------------------------------------------------------

def case_kill(ctx, name, world, min_workers, kills, n=150, batch=4, epochs=3, extra=()):
    """(a) Workers die (no restarts); the others finish."""
    fx = Fixture(ctx.tmp, n)
    rd = RunDir(ctx.tmp, name)
    spec = ",".join("%d:%d:%s" % k for k in kills)
    p = Proc(name, launch_cmd(ctx.bins, world, name, train_args(fx, rd, batch, epochs, shuffle_seed=7,
                                                                 extra=extra),
                              min_workers=min_workers), rd.logs, env=kill_env(spec))
    expect_exit(ctx.checks, name, p, 0, RUN_TIMEOUT)
    died = killed_locals(p.stderr())
    ctx.checks.check(sorted(died) == sorted(k[0] for k in kills),
                     name + ": the scheduled workers died (%s)" % spec,
                     "died: %s" % died)
    survivors = world - len(kills)
    check_outputs_identical(ctx.checks, name, rd, expected_count=survivors)
    final = last_step_of(rd)
    check_metrics(ctx.checks, name, rd, world_size=survivors, min_reforms=1, optimizer_steps=final)
    _, history = check_sample_logs(ctx.checks, name, rd, n, epochs, final)
    check_replay(ctx.checks, name, rd, fx, history, [p.stderr()])
    summary(name, p, rd, "killed %s" % spec)


def case_prestep(ctx, name):
    """(b) A death before the first step: the same as 2 workers from the start."""
    n, batch, epochs = 130, 4, 3
    fx = Fixture(ctx.tmp, n)
    ref = RunDir(ctx.tmp, name + "-ref")
    rd = RunDir(ctx.tmp, name)
    p_ref = Proc(name + "-ref", launch_cmd(ctx.bins, 2, name + "-ref",
                                           train_args(fx, ref, batch, epochs, shuffle_seed=11)),
                 ref.logs)
    expect_exit(ctx.checks, name + " (fault-free W=2)", p_ref, 0, RUN_TIMEOUT)
    p = Proc(name, launch_cmd(ctx.bins, 3, name, train_args(fx, rd, batch, epochs, shuffle_seed=11),
                              min_workers=2), rd.logs, env=kill_env("2:1:forward"))
    expect_exit(ctx.checks, name + " (W=3, local 2 dies at step 1 forward)", p, 0, RUN_TIMEOUT)
    check_outputs_identical(ctx.checks, name, rd, expected_count=2)
    final = last_step_of(rd)
    m = check_metrics(ctx.checks, name, rd, world_size=2, min_reforms=1, optimizer_steps=final)
    _, history = check_sample_logs(ctx.checks, name, rd, n, epochs, final)
    check_replay(ctx.checks, name, rd, fx, history, [p.stderr()])
    m_ref = ref.load_metrics()
    problems = []
    if not (os.path.isfile(ref.output) and os.path.isfile(rd.output)):
        problems.append("--output missing: %s %s" % (os.path.isfile(ref.output),
                                                      os.path.isfile(rd.output)))
    else:
        a, e = fixtures.load_state(rd.output), fixtures.load_state(ref.output)
        problems += fixtures.compare_states(a, e, rtol=0.0, atol=0.0)
        if not problems:
            problems += ["%s not bit-identical" % k for k in e if not torch.equal(a[k], e[k])]
        # The per-worker outputs equal the reference's too.
        for path in rd.worker_outputs():
            st = fixtures.load_state(path)
            if any(not torch.equal(st[k], e[k]) for k in e):
                problems.append("%s differs from the reference" % os.path.basename(path))
    if m is None or m_ref is None:
        problems.append("metrics missing")
    else:
        for key in ("optimizer_steps", "final_loss", "world_size"):
            if m.get(key) != m_ref.get(key):
                problems.append("%s %r, fault-free W=2 %r" % (key, m.get(key), m_ref.get(key)))
    ctx.checks.check(not problems, name + ": final parameters and loss bit-identical to a "
                     "fault-free run with 2 workers", "; ".join(problems))
    summary(name + "-ref", p_ref, ref)
    summary(name, p, rd, "killed 2:1:forward")


def adam_args(args, extra=()):
    """train_args' concord-train flags with Adam instead of SGD."""
    out = list(args)
    i = out.index("--optimizer")
    out[i + 1] = "adam"
    j = out.index("--momentum")
    del out[j:j + 2]
    return TrainArgs(out + list(extra), args.history_dir)


def case_zero(ctx, name, world, min_workers, ref_kill, kill=None, fault=None, extra=(),
              restarts=0, ref_extra=()):
    """(g) A job whose Adam state is sharded (--zero, see Note [Elastic ZeRO]
    in api/zero.cc) loses a worker mid-step: its shard lives on in its
    mirror, and the survivors end bit-identical to the unsharded job's that
    loses the same worker at the same step. `kill`: concord-train's
    CONCORD_TEST_KILL for both runs; `fault`: the library's
    CONCORD_TEST_FAULT "zero" point for the sharded run (the worker dies after
    its local update, before the parameters' broadcast, and the survivors put
    their shards' copies back), `ref_kill` the unsharded run's kill at the
    same step (before its forward: nobody commits the step either). With
    `restarts` (and min_workers = world) the dead worker comes back as a
    newcomer that the others wait for: it gets its shard, at the same step in
    both runs. `ref_extra`: flags of the reference run besides Adam's (with
    --zero-overlap it is the overlapped job killed cleanly at the step's
    start: the two warm-up steps of the overlap update nothing, which an
    unsharded job does not have)."""
    ref_what = " ".join(ref_extra) or "unsharded Adam"
    n, batch, epochs = 150, 4, 3
    fx = Fixture(ctx.tmp, n)
    ref = RunDir(ctx.tmp, name + "-unsharded")
    rd = RunDir(ctx.tmp, name)
    p_ref = Proc(name + "-unsharded",
                 launch_cmd(ctx.bins, world, name + "-unsharded",
                            adam_args(train_args(fx, ref, batch, epochs, shuffle_seed=7),
                                      list(ref_extra)),
                            min_workers=min_workers, restarts=restarts), ref.logs,
                 env=kill_env(ref_kill))
    expect_exit(ctx.checks, name + " (%s, killed %s)" % (ref_what, ref_kill), p_ref, 0,
                RUN_TIMEOUT)
    env = kill_env(kill)
    if fault:
        env["CONCORD_TEST_FAULT"] = fault
    p = Proc(name, launch_cmd(ctx.bins, world, name,
                              adam_args(train_args(fx, rd, batch, epochs, shuffle_seed=7),
                                        ["--zero"] + list(extra)),
                              min_workers=min_workers, restarts=restarts), rd.logs, env=env)
    expect_exit(ctx.checks, name + " (--zero %s, killed %s)" % (" ".join(extra), kill or fault),
                p, 0, RUN_TIMEOUT)
    died = re.findall(r"concord-run: worker (\d+) .* killed by signal 9", p.stderr())
    ctx.checks.check(len(died) == 1, name + ": one worker died", "died: %s" % died)
    survivors = world if restarts else world - 1
    state = check_outputs_identical(ctx.checks, name, rd, expected_count=survivors)
    want = check_outputs_identical(ctx.checks, name + "-unsharded", ref,
                                   expected_count=survivors)
    final = last_step_of(rd)
    check_metrics(ctx.checks, name, rd, world_size=survivors, min_reforms=1,
                  optimizer_steps=final)
    check_sample_logs(ctx.checks, name, rd, n, epochs, final)  # and the history
    problems = []
    if state is None or want is None:
        problems.append("an output is missing")
    else:
        problems += fixtures.compare_states(state, want, rtol=0.0, atol=0.0)
        problems += ["%s not bit-identical" % k for k in want
                     if k in state and not torch.equal(state[k], want[k])]
    ctx.checks.check(not problems, name + ": the survivors' parameters bit-identical to the "
                     "reference job's survivors' (%s)" % ref_what, "; ".join(problems[:10]))
    summary(name + "-unsharded", p_ref, ref)
    summary(name, p, rd, "killed %s" % (kill or fault))


def case_fixed(ctx, name, world, n, batch, epochs, kills=(), min_workers=None):
    """(c) --sharding fixed with uneven data: ranks whose data runs out leave;
    with kills, dead ranks' shards are dropped. The finishers (ranks with the
    longest stream among the survivors) end bit-identical."""
    fx = Fixture(ctx.tmp, n)
    rd = RunDir(ctx.tmp, name)
    spec = ",".join("%d:%d:%s" % k for k in kills)
    p = Proc(name, launch_cmd(ctx.bins, world, name,
                              train_args(fx, rd, batch, epochs, sharding="fixed"),
                              min_workers=min_workers), rd.logs, env=kill_env(spec))
    rc = p.wait(RUN_TIMEOUT)
    err = p.stderr()
    ranks = first_ranks(err)
    died = killed_locals(err)
    streams = fixtures.stream_lengths(n, world, batch, epochs)
    ok_ranks = len(ranks) == world and sorted(r for r, _ in ranks.values()) == list(range(world))
    ctx.checks.check(ok_ranks, name + ": generation 1 has ranks 0..%d" % (world - 1),
                     "ranks %s\n%s" % (ranks, p.describe()))
    if not ok_ranks:
        return
    # A scheduled death happens only if the worker still trains at that step.
    rank_of = {i: r for i, (r, _) in ranks.items()}
    expected_dead = sorted(i for i, step, _ in kills if step <= streams[rank_of[i]])
    ctx.checks.check(sorted(died) == expected_dead,
                     name + ": workers %s died as scheduled" % expected_dead,
                     "died %s; ranks %s; streams %s" % (died, rank_of, streams))
    dead_ranks = {rank_of[i] for i in died}
    alive = [r for r in range(world) if r not in dead_ranks]
    longest = max(streams[r] for r in alive)
    finishers = sorted(r for r in alive if streams[r] == longest)
    leavers = sorted(r for r in alive if streams[r] < longest)
    expected_rc = 0  # the job completed, deaths or not (see Note [Exit status])
    ok = not p.timed_out and rc == expected_rc and not p.leftovers
    ctx.checks.check(ok, name + ": concord-run exits %d (got %s, %.1fs)" % (
        expected_rc, "timeout" if p.timed_out else rc, p.elapsed), "" if ok else p.describe())
    left_msgs = len(re.findall(r"ran out of data after step \d+ and left the job", p.stdout()))
    ctx.checks.check(left_msgs == len(leavers),
                     name + ": %d rank(s) %s ran out of data and left" % (len(leavers), leavers),
                     "%d 'left the job' lines\n%s" % (left_msgs, p.describe()))
    check_outputs_identical(ctx.checks, name, rd, expected_count=len(finishers))
    check_metrics(ctx.checks, name, rd, world_size=len(finishers), optimizer_steps=longest)
    check_history(ctx.checks, name, rd)  # fixed shards: no sampler, no samples
    summary(name, p, rd, "ranks by local %s, streams %s, killed %s, finishers ranks %s" % (
        [rank_of[i] for i in range(world)], streams, spec or "none", finishers))


def case_fixed_staggered(ctx, name, world, n, batch, epochs, kills, min_workers):
    """(c) --sharding fixed with ranks chosen: W launchers (--nproc 1 each)
    against a standalone coordinator, each started once the previous one's
    worker has joined, so that launcher k's worker is rank k (ranks follow
    the first-join order). kills: {rank: (step, phase)}. Deterministic: the
    dying ranks, the leavers and the finishers are known in advance."""
    fx = Fixture(ctx.tmp, n)
    rd = RunDir(ctx.tmp, name)
    streams = fixtures.stream_lengths(n, world, batch, epochs)
    coord = start_coordinator(ctx, name, rd)
    if coord is None:
        return
    try:
        launchers = []
        for k in range(world):
            spec = "0:%d:%s" % kills[k] if k in kills else ""
            p = Proc("%s-rank%d" % (name, k), launch_cmd(
                ctx.bins, 1, name, train_args(fx, rd, batch, epochs, sharding="fixed"),
                min_workers=min_workers, max_workers=world, coordinator=coord.address,
                token_file=coord.worker_token, settle_ms=15000), rd.logs, env=kill_env(spec))
            launchers.append(p)
            needle = re.compile(r"join %s-\S*-%d-w0: joined" % (re.escape(name), p.pid))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and p.poll() is None \
                    and not needle.search(coord.proc.stderr()):
                time.sleep(0.02)
        dead = sorted(kills)
        alive = [r for r in range(world) if r not in kills]
        longest = max(streams[r] for r in alive)
        finishers = [r for r in alive if streams[r] == longest]
        leavers = [r for r in alive if streams[r] < longest]
        for k, p in enumerate(launchers):
            expected = SIGKILL_STATUS if k in kills else 0
            expect_exit(ctx.checks, "%s (rank %d)" % (name, k), p, expected, RUN_TIMEOUT)
        ranks = []
        for p in launchers:
            m = re.search(r"generation 1 as rank (\d+) of (\d+)", p.stderr())
            ranks.append(int(m.group(1)) if m else None)
        ctx.checks.check(ranks == list(range(world)), name + ": launcher k's worker is rank k",
                         "ranks %s" % ranks)
        got_leavers = [k for k, p in enumerate(launchers)
                       if re.search(r"ran out of data after step \d+ and left the job", p.stdout())]
        ctx.checks.check(got_leavers == leavers, name + ": rank(s) %s ran out of data and left"
                         % leavers, "left: %s" % got_leavers)
        got_dead = [k for k, p in enumerate(launchers) if "CONCORD_TEST_KILL: killing myself"
                    in p.stderr()]
        ctx.checks.check(got_dead == dead, name + ": rank(s) %s died as scheduled" % dead,
                         "died: %s" % got_dead)
        check_outputs_identical(ctx.checks, name, rd, expected_count=len(finishers))
        check_metrics(ctx.checks, name, rd, world_size=len(finishers), optimizer_steps=longest)
        check_history(ctx.checks, name, rd)
        print("SUMMARY %s: %.1fs, streams %s, kills %s, leavers %s, finishers %s, exits %s" % (
            name, max(p.elapsed for p in launchers), streams, kills, leavers, finishers,
            [p.returncode for p in launchers]), flush=True)
    finally:
        coord.stop()


def case_join(ctx, name):
    """(d) A second concord-run joins a running 2-worker job (max 3).

    Both launchers run with CONCORD_TEST_AGENT_LINGER_MS: their agents' node
    streams end late and slowly on gRPC's threads (see Note [Where gRPC
    objects end] in agent/node_agent_impl.h); before that note's change,
    concord-run aborted at exit under it (gRPC's "prior > 0")."""
    n, batch, epochs = 512, 4, 40
    linger = {"CONCORD_TEST_AGENT_LINGER_MS": "50"}
    fx = Fixture(ctx.tmp, n)
    rd = RunDir(ctx.tmp, name)
    coord = start_coordinator(ctx, name, rd)
    if coord is None:
        return
    try:
        common = dict(min_workers=2, max_workers=3, coordinator=coord.address,
                      token_file=coord.worker_token, settle_ms=500)
        first = Proc(name + "-first", launch_cmd(ctx.bins, 2, name,
                                                 train_args(fx, rd, batch, epochs, shuffle_seed=5),
                                                 **common), rd.logs, env=linger)
        # Wait for progress (the authoritative rank's 'step S' lines).
        started_at = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and first.poll() is None:
            steps = [int(s) for s in re.findall(r" step (\d+)(?:/\d+)? loss", first.stdout())]
            if steps and max(steps) >= 20:
                started_at = max(steps)
                break
            time.sleep(0.05)
        if not ctx.checks.check(started_at is not None, name + ": the 2-worker job makes progress",
                                first.describe()):
            first.kill_group()
            first.wait(5)
            return
        print("  %s: starting the joiner at step %d (%.1fs)" % (name, started_at, first.elapsed),
              flush=True)
        joiner = Proc(name + "-joiner", launch_cmd(ctx.bins, 1, name,
                                                   train_args(fx, rd, batch, epochs, shuffle_seed=5),
                                                   **common), rd.logs, env=linger)
        expect_exit(ctx.checks, name + " (first launcher, 2 workers)", first, 0, RUN_TIMEOUT)
        expect_exit(ctx.checks, name + " (joining launcher)", joiner, 0, 60)
        check_outputs_identical(ctx.checks, name, rd, expected_count=3)
        joined = [w for w in rd.finished_ids() if ("-%d-w0" % joiner.pid) in w]
        ctx.checks.check(len(joined) == 1, name + ": the joiner finished training",
                         "finished: %s (joiner pid %d)" % (rd.finished_ids(), joiner.pid))
        final = last_step_of(rd)
        check_metrics(ctx.checks, name, rd, world_size=3, min_reforms=1, optimizer_steps=final)
        _, history = check_sample_logs(ctx.checks, name, rd, n, epochs, final)
        check_replay(ctx.checks, name, rd, fx, history, [first.stderr(), joiner.stderr()])
        m = re.search(r"joined job '[^']*' generation (\d+) as rank (\d+) of (\d+)", joiner.stderr())
        summary(name, first, rd, "joiner exit %s in %.1fs, %s" % (
            joiner.returncode, joiner.elapsed,
            "joined generation %s as rank %s of %s" % m.groups() if m else "never joined"))
    finally:
        coord.stop()


def case_restart(ctx, name, world, min_workers, kills, restarts, n=512, batch=4, epochs=8,
                 same_history=False):
    """(e) A killed worker is restarted and rejoins; concord-run exits 0. With
    min_workers = world the others cannot go on without it: they wait in the
    rendezvous for the restarted worker, every step has the fault-free
    window, and the final model must be the fault-free one (same_history).
    Otherwise the others go on over fewer workers until it is back (the
    replay still checks the arithmetic)."""
    fx = Fixture(ctx.tmp, n)
    ref = fault_free_run(ctx, name, fx, world, batch, epochs, 9) if same_history else None
    rd = RunDir(ctx.tmp, name)
    spec = ",".join("%d:%d:%s" % k for k in kills)
    p = Proc(name, launch_cmd(ctx.bins, world, name, train_args(fx, rd, batch, epochs, shuffle_seed=9),
                              min_workers=min_workers, restarts=restarts), rd.logs,
             env=kill_env(spec))
    expect_exit(ctx.checks, name, p, 0, RUN_TIMEOUT)
    err = p.stderr()
    restarted = re.findall(r"concord-run: worker (\d+) \(pid \d+, worker id \S+\) failed after "
                           r"[\d.]+ s: (killed by signal 9 \(SIGKILL\)); restarting it", err)
    ctx.checks.check(sorted(int(i) for i, _ in restarted) == sorted(k[0] for k in kills),
                     name + ": concord-run restarted the killed worker(s) %s" % [k[0] for k in kills],
                     "restarted: %s" % restarted)
    ids = rd.finished_ids()
    rejoined = [w for w in ids if re.search(r"-w\d+-r1$", w)]
    check_outputs_identical(ctx.checks, name, rd, expected_count=world)
    ctx.checks.check(len(rejoined) == len(kills), name + ": the restarted worker(s) finished training",
                     "finished: %s" % ids)
    final = last_step_of(rd)
    check_metrics(ctx.checks, name, rd, world_size=world, min_reforms=1, optimizer_steps=final)
    _, history = check_sample_logs(ctx.checks, name, rd, n, epochs, final)
    check_replay(ctx.checks, name, rd, fx, history, [p.stderr()])
    if same_history:
        compare_to_fault_free(ctx.checks, name, rd, history, ref, required=True)
    summary(name, p, rd, "killed %s, finished %s" % (spec, [w.split("-")[-2:] for w in ids]))


def case_restart_late(ctx, name):
    """(e) A restarted worker that comes back after the job has finished: W=2,
    min 1, a short job; local 0 dies at step 6 and local 1 finishes alone
    before the restarted worker can join (on a 2-core machine it always
    does). The job succeeded, so concord-run must exit 0 (its contract: 0
    when the last run of every local worker exits 0; a restarted worker with
    nothing left to do exits 0, saying so).

    Regression test: found by this test when a dead worker began to be
    dropped as soon as its watch stream broke (c83ccd8): the restarted
    concord-train got FAILED_PRECONDITION "job ... has already succeeded"
    from Join and exited 1, so concord-run exited 1 after a successful job.
    Fixed in 77564e6."""
    fx = Fixture(ctx.tmp, 150)
    rd = RunDir(ctx.tmp, name)
    p = Proc(name, launch_cmd(ctx.bins, 2, name, train_args(fx, rd, 4, 2, shuffle_seed=9),
                              min_workers=1, restarts=1), rd.logs, env=kill_env("0:6:optimizer"))
    expect_exit(ctx.checks, name, p, 0, RUN_TIMEOUT)
    late = re.findall(r"concord(?:-train)?: .*(?:nothing left to do|cannot join the job).*",
                      p.stdout() + p.stderr())
    # The path this case is for: the restarted worker came after the end.
    ctx.checks.check(bool(late) and "nothing left to do" in late[-1],
                     name + ": the restarted worker came after the job succeeded and exits 0 "
                     "saying so", late[-1][:200] if late else "it joined in time: the late "
                     "path did not run")
    check_outputs_identical(ctx.checks, name, rd)
    final = last_step_of(rd)
    _, history = check_sample_logs(ctx.checks, name, rd, 150, 2, final)
    check_replay(ctx.checks, name, rd, fx, history, [p.stderr()])
    summary(name, p, rd, "restarted worker %s" % ("came too late" if late else "joined"))


def fault_free_run(ctx, name, fx, world, batch, epochs, shuffle_seed):
    """The same job without faults (for compare_to_fault_free)."""
    ref = RunDir(ctx.tmp, name + "-fault-free")
    p = Proc(name + "-fault-free", launch_cmd(
        ctx.bins, world, name + "-fault-free",
        train_args(fx, ref, batch, epochs, shuffle_seed=shuffle_seed)), ref.logs)
    expect_exit(ctx.checks, name + " (fault-free run, W=%d)" % world, p, 0, RUN_TIMEOUT)
    return ref


def case_below_min_standalone(ctx, name):
    """(f) W=2, min 2, one dies without restarts: concord-run --standalone stops
    the survivor and exits non-zero, saying why."""
    fx = Fixture(ctx.tmp, 150)
    rd = RunDir(ctx.tmp, name)
    p = Proc(name, launch_cmd(ctx.bins, 2, name, train_args(fx, rd, 4, 50), min_workers=2,
                              rendezvous_ms=3000), rd.logs, env=kill_env("1:3:forward"))
    rc = p.wait(60)
    err = p.stderr()
    ok = not p.timed_out and rc != 0 and p.elapsed < 30 and not p.leftovers
    ctx.checks.check(ok, name + ": concord-run exits non-zero within 30 s (%s, %.1fs)" % (
        "timeout" if p.timed_out else rc, p.elapsed), p.describe())
    ctx.checks.check("fewer than --min-workers 2" in err,
                     name + ": concord-run says the job fell below --min-workers", p.describe())
    ctx.checks.check(not rd.worker_outputs() and not os.path.exists(rd.output),
                     name + ": no worker wrote a final output", "%s" % rd.finished_ids())
    summary(name, p, rd)


def case_below_min_coordinator(ctx, name):
    """(f) The same against a separate coordinator: concord-run leaves the
    decision to it, the rendezvous times out (3 s), the survivor fails with
    the coordinator's reason (rendezvous timeout, min_workers)."""
    fx = Fixture(ctx.tmp, 150)
    rd = RunDir(ctx.tmp, name)
    coord = start_coordinator(ctx, name, rd)
    if coord is None:
        return
    try:
        p = Proc(name, launch_cmd(ctx.bins, 2, name, train_args(fx, rd, 4, 50), min_workers=2,
                                  coordinator=coord.address, token_file=coord.worker_token,
                                  rendezvous_ms=3000), rd.logs, env=kill_env("1:3:forward"))
        rc = p.wait(60)
        err = p.stderr()
        ok = not p.timed_out and rc != 0 and p.elapsed < 30 and not p.leftovers
        ctx.checks.check(ok, name + ": concord-run exits non-zero within 30 s (%s, %.1fs)" % (
            "timeout" if p.timed_out else rc, p.elapsed), p.describe())
        # KNOWN PRODUCT BUG (found by this test): the survivor's Join RPC
        # has a gRPC deadline equal to the rendezvous timeout, counted from
        # its own re-join; the coordinator fails the job at the same timeout
        # but only on its next tick, so the client's deadline nearly always
        # fires first and the survivor exits with a bare
        # "concord-train: DEADLINE_EXCEEDED: Deadline Exceeded" (and the
        # coordinator then records "rendezvous timed out ... with 0
        # worker(s) waiting"). A clear message names the rendezvous timeout
        # or min_workers (the coordinator's reason), or says that no
        # generation formed within the timeout (JoinAndConnect's own
        # message).
        survivor = [line for line in err.splitlines() if line.startswith("[worker 0]")]
        said = [line for line in survivor if "concord-train:" in line and (
            "rendezvous" in line or "min_workers" in line or "formed within" in line)]
        ctx.checks.check(bool(said), name + ": the survivor fails with a clear message (rendezvous "
                         "timeout / min_workers)", p.describe())
        if said:
            print("  %s: %s" % (name, said[-1][:300]), flush=True)
        ctx.checks.check(not rd.worker_outputs(), name + ": no worker wrote a final output",
                         "%s" % rd.finished_ids())
        summary(name, p, rd)
    finally:
        coord.stop()


# --- chaos ----------------------------------------------------------------------

def live_trainers(launcher_pid):
    """{pid: worker id} of the running concord-train processes that concord-run
    started (its children, or their descendants when the program is a
    wrapper script: the processes whose executable is concord-train)."""
    out = {}
    descendants = []
    todo = processes.children(launcher_pid)
    while todo:
        pid = todo.pop()
        descendants.append(pid)
        todo += processes.children(pid)
    for kid in descendants:
        try:
            if os.path.basename(os.readlink("/proc/%d/exe" % kid)) != "concord-train":
                continue
            with open("/proc/%d/stat" % kid) as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
            with open("/proc/%d/environ" % kid, "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            out[kid] = env.get(b"CONCORD_WORKER_ID", b"?").decode()
        except OSError:
            pass
    return out


def case_chaos(ctx, name, seed):
    """4 workers, --max-restarts 20, --min-workers 2: SIGKILL a random live
    concord-train every 2-4 s for up to 18 s (stopping earlier once the job
    is past 80% of its epochs, so that no worker is killed while the job
    finishes), then let it finish. Besides the common checks, the final
    model must be the replay of the committed history (check_replay)."""
    n, batch, epochs, world = 512, 4, 100, 4
    fx = Fixture(ctx.tmp, n)
    rd = RunDir(ctx.tmp, name)
    rng = random.Random(seed)
    print("  %s: seed %d" % (name, seed), flush=True)
    p = Proc(name, launch_cmd(ctx.bins, world, name, train_args(fx, rd, batch, epochs, shuffle_seed=13),
                              min_workers=2, restarts=20), rd.logs)
    # Let the first generation form and train a little.
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and p.poll() is None and job_progress(rd)[0] < 10:
        time.sleep(0.05)
    kills = []
    chaos_start = time.monotonic()
    next_kill = chaos_start + rng.uniform(1.0, 2.0)
    while p.poll() is None and time.monotonic() - chaos_start < 18.0:
        step, epoch = job_progress(rd)
        if epoch >= 0.8 * epochs or rd.worker_outputs():
            print("  %s: stop killing at epoch %d (step %d)" % (name, epoch, step), flush=True)
            break
        now = time.monotonic()
        if now < next_kill:
            time.sleep(min(0.05, next_kill - now))
            continue
        live = live_trainers(p.pid)
        if live:
            victim = rng.choice(sorted(live))
            try:
                os.kill(victim, signal.SIGKILL)
                kills.append((now - p.start, victim, live[victim], step, epoch))
                print("  %s: t=%5.1fs SIGKILL pid %d (%s) at job step %d epoch %d, %d live" % (
                    name, now - p.start, victim, live[victim], step, epoch, len(live)), flush=True)
            except ProcessLookupError:
                pass
        next_kill = now + rng.uniform(2.0, 4.0)
    rc = p.wait(max(10.0, 200.0 - p.elapsed))
    ok = not p.timed_out and rc == 0 and not p.leftovers
    ctx.checks.check(ok, name + ": concord-run exits 0 after %d kills (got %s, %.1fs)" % (
        len(kills), "timeout" if p.timed_out else rc, p.elapsed), "" if ok else p.describe(6000))
    ctx.checks.check(len(kills) >= 3, name + ": at least 3 workers killed (%d)" % len(kills),
                     "the job ended too early or no worker was found")
    restarted = len(re.findall(r"failed after [\d.]+ s: killed by signal 9 \(SIGKILL\); "
                               r"restarting it", p.stderr()))
    ctx.checks.check(restarted == len(kills), name + ": concord-run restarted every killed worker "
                     "(%d)" % restarted, "kills %d, restarts %d" % (len(kills), restarted))
    check_outputs_identical(ctx.checks, name, rd, expected_count=world)
    final = last_step_of(rd)
    m = check_metrics(ctx.checks, name, rd, min_reforms=1, optimizer_steps=final)
    lost, history = check_sample_logs(ctx.checks, name, rd, n, epochs, final,
                                      allow_lost_commits=True)
    check_replay(ctx.checks, name, rd, fx, history, [p.stderr()])
    summary(name, p, rd, "%d kills, %d lost commits, reforms %s" % (
        len(kills), lost, m and m.get("reforms")))


# --- registry -------------------------------------------------------------------

def _cases():
    c = collections.OrderedDict()
    # (a): W 2..5, each phase, no restarts.
    c["kill-w3-forward"] = ("kill", lambda ctx: case_kill(ctx, "kill-w3-forward", 3, 2,
                                                          [(1, 4, "forward")]))
    c["kill-w4-backward"] = ("kill", lambda ctx: case_kill(
        ctx, "kill-w4-backward", 4, 2, [(2, 6, "backward")],
        # Several buckets after the first-iteration rebuild: some are in
        # flight when the worker dies.
        extra=["--bucket-cap-mb", "0.002"]))
    c["kill-w5-optimizer"] = ("kill", lambda ctx: case_kill(ctx, "kill-w5-optimizer", 5, 3,
                                                            [(0, 3, "optimizer")]))
    c["kill-w2-backward"] = ("kill", lambda ctx: case_kill(ctx, "kill-w2-backward", 2, 1,
                                                           [(0, 5, "backward")]))
    c["kill-w5-two"] = ("kill", lambda ctx: case_kill(ctx, "kill-w5-two", 5, 2,
                                                      [(1, 3, "forward"), (3, 8, "optimizer")]))
    # (b)
    c["prestep-w3"] = ("prestep", lambda ctx: case_prestep(ctx, "prestep-w3"))
    # (c): 98 = 33 + 33 + 32 samples: ranks 0, 1 take 2 batches of 32 per
    # epoch (the second of 1 sample), rank 2 one; 66 = 17+17+16+16 in batches
    # of 8; 84 = 4 x 17 + 16 in batches of 16.
    c["fixed-w3"] = ("fixed", lambda ctx: case_fixed(ctx, "fixed-w3", 3, 98, 32, 2))
    c["fixed-w4-death"] = ("fixed", lambda ctx: case_fixed(ctx, "fixed-w4-death", 4, 66, 8, 2,
                                                           kills=[(3, 2, "backward")],
                                                           min_workers=2))
    # Local 2 dies at step 2 (all ranks train); local 0 at step 5, after the
    # short rank left at its end of data (unless local 0 is that rank).
    c["fixed-w5-deaths"] = ("fixed", lambda ctx: case_fixed(
        ctx, "fixed-w5-deaths", 5, 84, 16, 3, kills=[(2, 2, "optimizer"), (0, 5, "forward")],
        min_workers=2))
    # Deterministic ranks: 84 = 4 x 17 + 16 in batches of 16 over 3 epochs,
    # streams [6, 6, 6, 6, 3]: rank 3 dies at step 2 (optimizer), rank 4
    # leaves after step 3 (its data ran out), rank 1 dies at step 5 (forward),
    # ranks 0 and 2 finish.
    c["fixed-w5-staggered"] = ("fixed", lambda ctx: case_fixed_staggered(
        ctx, "fixed-w5-staggered", 5, 84, 16, 3,
        kills={3: (2, "optimizer"), 1: (5, "forward")}, min_workers=2))
    # (d)
    c["join-w2-to-3"] = ("join", lambda ctx: case_join(ctx, "join-w2-to-3"))
    # (e)
    c["restart-w3-backward"] = ("restart", lambda ctx: case_restart(
        ctx, "restart-w3-backward", 3, 2, [(1, 10, "backward")], restarts=2, epochs=12))
    c["restart-w2-min2-optimizer"] = ("restart", lambda ctx: case_restart(
        ctx, "restart-w2-min2-optimizer", 2, 2, [(0, 6, "optimizer")], restarts=1,
        same_history=True))
    c["restart-late-w2"] = ("restart", lambda ctx: case_restart_late(ctx, "restart-late-w2"))
    # (f)
    c["below-min-standalone"] = ("below-min", lambda ctx: case_below_min_standalone(
        ctx, "below-min-standalone"))
    c["below-min-coordinator"] = ("rendezvous-timeout", lambda ctx: case_below_min_coordinator(
        ctx, "below-min-coordinator"))
    # (g) sharded optimizer state
    c["zero-w3-optimizer"] = ("zero", lambda ctx: case_zero(
        ctx, "zero-w3-optimizer", 3, 2, "1:4:optimizer", kill="1:4:optimizer"))
    c["zero-w3-broadcast"] = ("zero", lambda ctx: case_zero(
        ctx, "zero-w3-broadcast", 3, 2, "1:4:forward", fault="1:4:zero:optimizer:1"))
    # Deaths whose step nobody commits, whatever the timing: before the
    # forward (a death in backward may come after its share was summed).
    c["zero-w4-bucket-view-forward"] = ("zero", lambda ctx: case_zero(
        ctx, "zero-w4-bucket-view-forward", 4, 2, "2:5:forward", kill="2:5:forward",
        extra=["--zero-bucket-view"]))
    c["zero-w3-restart"] = ("zero", lambda ctx: case_zero(
        ctx, "zero-w3-restart", 3, 3, "1:6:optimizer", kill="1:6:optimizer", restarts=1))
    # Two ranks mirror each other and step every shard, with no broadcast and,
    # from the second step, no step-start copies (see Note [Elastic ZeRO]):
    # rank 0 dies after its update and rank 1 goes on alone with rank 0's
    # shard from its mirror; or rank 1 dies and comes back for its shard.
    c["zero-w2-shrink"] = ("zero", lambda ctx: case_zero(
        ctx, "zero-w2-shrink", 2, 1, "0:4:optimizer", kill="0:4:optimizer"))
    c["zero-w2-restart"] = ("zero", lambda ctx: case_zero(
        ctx, "zero-w2-restart", 2, 2, "1:6:optimizer", kill="1:6:optimizer", restarts=1))
    # Overlapped with DDP (see Note [Elastic ZeRO overlapped with DDP]): a worker
    # dies in backward after its shards' update, before their broadcast; it
    # comes back and gets its shard. Several buckets with LibTorch 2.x; with
    # 1.13's one bucket rank 0 steps every parameter, so worker 0 is the one
    # that dies: its shard comes from its mirror.
    overlap = ["--zero-overlap", "step", "--bucket-cap-mb", "0.002"]
    c["zero-w3-overlap-restart"] = ("zero", lambda ctx: case_zero(
        ctx, "zero-w3-overlap-restart", 3, 3, "0:5:forward", fault="0:5:zero:optimizer:1",
        restarts=1, extra=overlap, ref_extra=["--zero"] + overlap))
    # chaos
    c["chaos-w4"] = ("chaos", lambda ctx: case_chaos(ctx, "chaos-w4", ctx.seed))
    return c


CASES = _cases()
GROUPS = sorted(set(g for g, _ in CASES.values()))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir")
    p.add_argument("--group", action="append", default=[], choices=GROUPS)
    p.add_argument("--case", action="append", default=[], choices=list(CASES))
    p.add_argument("--seed", type=int, default=20240,
                   help="chaos: the random seed of the kill schedule")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--train-flag", action="append", default=[],
                   help="a concord-train flag every case adds (repeatable)")
    p.add_argument("--require-cuda", action="store_true",
                   help="print 'CONCORD_TEST_SKIPPED: no CUDA device' and exit 0 without one (gpu suite)")
    args = p.parse_args()
    if not args.list and not args.bin_dir:
        p.error("--bin-dir is required")
    return args


def main():
    args = parse_args()
    if args.list:
        for name, (group, _) in CASES.items():
            print("%-18s %s" % (group, name))
        return 0
    if args.require_cuda and testlib.no_cuda_reason():
        print(testlib.no_cuda_reason())
        return 0
    TRAIN_FLAGS.extend(args.train_flag)
    # Steps of at least 3 ms (concord-train's CONCORD_TEST_MIN_STEP_MS, passed
    # on by concord-run): a joiner or a restarted worker needs a job that is
    # still running when it arrives, whatever the transport's speed (these
    # models' steps take ~1 ms through shared memory on one host).
    os.environ.setdefault("CONCORD_TEST_MIN_STEP_MS", "3")
    selected = [c for c, (g, _) in CASES.items() if c in args.case or g in args.group]
    if not args.case and not args.group:
        selected = list(CASES)
    checks = Checks()
    bins = Bins(args.bin_dir)
    if bins.missing():
        checks.fail("concord binaries present", "not found or not executable: %s" % bins.missing())
        return checks.finish()
    tmp = tempfile.mkdtemp(prefix="concord_elastic_")
    ctx = Context(bins, checks, tmp, args.seed)
    run_cases(ctx, [(name, CASES[name][1]) for name in selected], args.keep)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

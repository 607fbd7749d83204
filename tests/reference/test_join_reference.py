#!/usr/bin/python3
"""Reference test for uneven inputs: concord-train --sharding fixed
against PyTorch's DDP with the whole training loop inside ddp.join() (gloo),
on the same TorchScript model and data.

    /usr/bin/python3 tests/reference/test_join_reference.py --bin-dir build/bin \
        --case w3-initial [--case ...] [--keep]
    /usr/bin/python3 tests/reference/test_join_reference.py --list-cases

With --sharding fixed, rank r of W takes samples r, r+W, r+2W, ... of every
epoch's order, without padding, in batches of --batch-size, and its data
stream is all its epochs one after another (fixtures.stream_lengths). Shards
differ by at most one sample, so the streams have two lengths and the longer
ones' extra batch of each epoch holds one sample: 97 samples, 3 ranks, batch
32, 2 epochs give rank 0 batches [32, 1, 32, 1] and ranks 1 and 2 [32, 32];
steps 1-2 run on all three ranks, steps 3-4 on rank 0 alone, its gradients
divided by 3 (PyTorch's divide_by_initial_world_size=True) or by 1
(--no-divide-by-initial-world-size). (Three distinct stream lengths, which
one could want for W=4, cannot happen with strided sharding; the W=4 cases
have two ranks leave and two go on.) The models have no BatchNorm1d, which
refuses one-sample batches in training.

Steps for each --case:
  1. Write the case's fixture (fixtures.make_fixture).
  2. PyTorch: torch_ddp_train.py with the case's flags (W worker processes
     forked from this one, file:// store). Every rank writes its final state:
     after join() they must all hold the last joiner's model, bit for bit.
     That reference is checked against fixtures.simulate(join=True), PyTorch's
     join semantics applied by hand in one process (bit for bit with 3 ranks,
     whose order of addition fixtures.probe_gloo_ring measures; with 4 ranks
     the simulation adds in rank order, so relative 1e-5, atol 1e-6), and the
     case's divide_by_initial_world_size must change the result (the
     simulation with the other setting differs beyond that tolerance).
  3. Concord: concord-run --standalone --nproc W -- concord-train --sharding
     fixed with the case's flags.
  4. Concord's parameters must equal PyTorch's bit for bit (max rel diff
     0.0). Buffers are compared only for a report: with broadcast_buffers
     PyTorch's join() takes buffers from the largest active rank rather than
     rank 0, which Concord need not share (BatchNorm's running statistics do
     not change the training). With concord-train's --output-per-worker
     every worker with the longest stream writes its own final state, and
     each must end with those parameters too (survivors bit-identical); the
     authoritative rank's --output is compared as well. Also: every parameter changed, and
     Concord's metrics count the longest stream's steps.
  The zero-* cases run Concord with its optimizer state sharded (--zero)
  against the same PyTorch reference (an unsharded optimizer).
  The throw case (--throw-on-early-termination) instead checks that PyTorch's
  run fails with its "exhausted" RuntimeError, and that every concord-train
  worker exits with status 1 and says "early termination" on its stderr
  while concord-run exits non-zero. Each worker runs under a /bin/sh that
  records its exit status and ignores concord-run's SIGTERM to it (the
  worker itself keeps the default action), so that one worker's failure does
  not cut the others short before they report.
Prints one line per check and a final 'N passed, N failed'; exits 1 on any
failure.
"""

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# One compute thread everywhere, as ctest runs it: with more, BLAS splits the
# larger products differently and the float results move by an ulp.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import fixtures  # noqa: E402
import processes  # noqa: E402
import torch_ddp_train  # noqa: E402

BIT_EXACT = (0.0, 0.0)      # rtol, atol: equal to the last bit
EXACT = (1e-5, 1e-6)        # the other reference tests' tolerance (rounding only)
LR, MOMENTUM, WEIGHT_DECAY, EPOCHS = 0.02, 0.9, 1e-4, 2
NO_DIVIDE = "--no-divide-by-initial-world-size"
THROW = "--throw-on-early-termination"

# A case: fixture kind, samples, world size, batch size, the uneven-input
# flags (the same spelling for concord-train and torch_ddp_train.py), and
# optionally a --shuffle seed. "throw": the run must fail on every rank.
CASES = {
    "w3-initial": dict(
        doc="the join example: 97 samples, 3 ranks, batch 32, 2 epochs; rank 0 [32,1,32,1], "
            "ranks 1-2 [32,32]; steps 3-4 on rank 0 alone, gradients / 3",
        kind="mlp-plain", samples=97, world=3, batch=32, flags=[]),
    "w3-active": dict(
        doc="the same with --no-divide-by-initial-world-size: steps 3-4 divide by 1",
        kind="mlp-plain", samples=97, world=3, batch=32, flags=[NO_DIVIDE]),
    "w4-initial": dict(
        doc="66 samples, 4 ranks, batch 8, 2 epochs: ranks 0-1 [8,8,1,8,8,1], ranks 2-3 "
            "[8,8,8,8]; steps 5-6 on ranks 0 and 1 (still an allreduce), gradients / 4",
        kind="mlp-plain", samples=66, world=4, batch=8, flags=[]),
    "w4-active": dict(
        doc="the same with --no-divide-by-initial-world-size: steps 5-6 divide by 2",
        kind="mlp-plain", samples=66, world=4, batch=8, flags=[NO_DIVIDE]),
    "w3-shuffle": dict(
        doc="97 samples, 3 ranks, batch 32, --shuffle --seed 7: every epoch's permutation "
            "sharded the same way",
        kind="mlp-plain", samples=97, world=3, batch=32, flags=[], shuffle_seed=7),
    "cnn-w3": dict(
        doc="a CNN with BatchNorm2d (buffers: compared for a report only), 49 samples, 3 "
            "ranks, batch 8: rank 0 [8,8,1,8,8,1], ranks 1-2 [8,8,8,8]",
        kind="cnn-bn2d", samples=49, world=3, batch=8, flags=[]),
    # Sharded optimizer state (--zero, ZeroRedundancyOptimizer): the same
    # arithmetic as PyTorch's DDP under join with an unsharded optimizer.
    # PyTorch's own ZeroRedundancyOptimizer under Join differs from that: a
    # joined rank's ZeRO join hook steps its shard with the gradients of its
    # last step again (DDP's join hook does not set them), where Concord's
    # leaving rank hands its shard to one that stays.
    "zero-w3-initial": dict(
        doc="w3-initial with --zero: ranks 1 and 2 leave together after step 2 and hand "
            "their shards to rank 0",
        kind="mlp-plain", samples=97, world=3, batch=32, flags=[], concord=["--zero"]),
    "zero-w4-active": dict(
        doc="w4-active with --zero --zero-bucket-view: ranks 2 and 3 leave together after "
            "step 4 and hand their shards (and rank 0's, which 3 mirrors) to rank 0",
        kind="mlp-plain", samples=66, world=4, batch=8, flags=[NO_DIVIDE],
        concord=["--zero", "--zero-bucket-view"]),
    # Overlapped with DDP's backward (--zero-overlap: each bucket's share of
    # the step in its allreduce's callback): PyTorch's DDP under join whose
    # optimizer leaves out the two warm-up steps, in which the overlap
    # updates nothing. The model is one bucket (DDP's first holds 1 MiB),
    # cut into runs over the ranks (--zero-shard-buckets); ranks 2 and 3
    # leave after step 4 and hand their runs over.
    "zero-overlap-w4-active": dict(
        doc="w4-active with --zero --zero-overlap step --zero-shard-buckets: the first 2 "
            "steps update nothing; ranks 2 and 3 leave after step 4 with their runs",
        kind="mlp-plain", samples=66, world=4, batch=8, flags=[NO_DIVIDE], skip_steps=2,
        concord=["--zero", "--zero-overlap", "step", "--zero-shard-buckets"]),
    "throw-w3": dict(
        doc="--throw-on-early-termination on the join example: every rank fails when ranks "
            "1 and 2 run out after step 2",
        kind="mlp-plain", samples=97, world=3, batch=32, flags=[THROW], throw=True),
}

Checks = fixtures.Checks


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--bin-dir", help="directory with concord-run and concord-train")
    p.add_argument("--case", action="append", default=[], choices=sorted(CASES),
                   help="a case (repeatable; default: all)")
    p.add_argument("--list-cases", action="store_true", help="describe the cases and exit")
    p.add_argument("--seed", type=int, default=1234, help="fixture seed")
    p.add_argument("--timeout", type=float, default=180.0, help="per training run, seconds")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args()
    if args.list_cases:
        return args
    if not args.bin_dir:
        p.error("--bin-dir is required")
    if not args.case:
        args.case = sorted(CASES)
    return args


class Case(object):
    def __init__(self, args, name, tmp):
        self.name = name
        self.spec = CASES[name]
        self.kind = self.spec["kind"]
        self.loss = fixtures.default_loss(self.kind)
        self.world = self.spec["world"]
        self.flags = list(self.spec["flags"])
        self.throw = self.spec.get("throw", False)
        self.dir = os.path.join(tmp, name)
        os.makedirs(self.dir, exist_ok=True)
        self.model, self.data = fixtures.make_fixture(os.path.join(self.dir, "fixture"),
                                                      self.kind, self.spec["samples"], args.seed)
        self.lengths = fixtures.stream_lengths(self.spec["samples"], self.world,
                                               self.spec["batch"], EPOCHS)
        self.last_joiner = fixtures.last_joiner(self.lengths)
        self.survivors = [r for r, n in enumerate(self.lengths) if n == max(self.lengths)]
        self.divide_by_initial = NO_DIVIDE not in self.flags
        self.skip_steps = self.spec.get("skip_steps", 0)

    def common(self):
        return ["--model", self.model, "--data", self.data] + fixtures.train_flags(
            self.loss, LR, MOMENTUM, WEIGHT_DECAY, self.spec["batch"], EPOCHS,
            self.spec.get("shuffle_seed"))


def pytorch_reference(args, checks, case):
    """Train with torch_ddp_train.py; every rank writes its state. Returns
    ([state per rank], metrics), or (None, None) when it failed; for the throw
    case checks that it failed the expected way and returns (None, None)."""
    out = os.path.join(case.dir, "torch_final_{rank}.pt")
    metrics = os.path.join(case.dir, "torch_metrics.json")
    argv = case.common() + case.flags + ["--world-size", str(case.world), "--output", out,
                                         "--metrics-out", metrics,
                                         "--skip-steps", str(case.skip_steps)]
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        rc = torch_ddp_train.run(torch_ddp_train.parse_args(argv), timeout=args.timeout)
    err = captured.getvalue()
    sys.stderr.write(err)
    if case.throw:
        checks.check(rc == 1 and "exhausted" in err,
                     "[%s] pytorch: join(throw_on_early_termination=True) raises (\"... exhausted "
                     "... inputs\") and the run fails" % case.name,
                     "torch_ddp_train.py exit status %s, stderr above" % rc)
        return None, None
    paths = [out.replace("{rank}", str(r)) for r in range(case.world)]
    if not checks.check(rc == 0 and all(os.path.isfile(pth) for pth in paths),
                        "[%s] pytorch reference trains (torch_ddp_train.py %s), every rank "
                        "writes its state" % (case.name, " ".join(case.flags) or "defaults"),
                        "torch_ddp_train.py exit status %s (its output is above)" % rc):
        return None, None
    with open(metrics) as f:
        m = json.load(f)
    return [fixtures.load_state(pth) for pth in paths], m


def concord_supports(bin_dir, word):
    """Whether concord-train --help mentions `word`."""
    r = processes.run_command([os.path.join(bin_dir, "concord-train"), "--help"], timeout=30)
    return word in (r.stdout + r.stderr)


def concord(args, checks, case, per_rank):
    """Train with concord-run + concord-train --sharding fixed. Returns
    ({rank or None: state}, metrics, CommandResult), with Nones on failure."""
    bin_dir = os.path.abspath(args.bin_dir)
    run_bin = os.path.join(bin_dir, "concord-run")
    train_bin = os.path.join(bin_dir, "concord-train")
    out = os.path.join(case.dir, "concord_final.pt")
    per_worker = os.path.join(case.dir, "per_worker")
    os.makedirs(per_worker, exist_ok=True)
    metrics = os.path.join(case.dir, "concord_metrics.json")
    train = [train_bin] + case.common() + ["--sharding", "fixed"] + case.flags + \
        case.spec.get("concord", []) + [
        "--output", out, "--metrics-out", metrics] + (
            ["--output-per-worker", per_worker] if per_rank else [])
    status_dir = os.path.join(case.dir, "worker_status")
    if case.throw:
        # Each worker under a shell that records its exit status. concord-run
        # SIGTERMs the others once one fails: the shell defers its trap until
        # concord-train (default SIGTERM action, but not signalled: only the
        # shell's pid is) has exited by itself.
        os.makedirs(status_dir, exist_ok=True)
        script = ('trap ":" TERM; "$@"; rc=$?; echo "$rc" > %s/status.$$; exit "$rc"'
                  % shlex.quote(status_dir))
        train = ["/bin/sh", "-c", script, "sh"] + train
    conc = processes.run_command(
        [run_bin, "--standalone", "--nproc", str(case.world),
         "--job-id", "reference-join-%s" % case.name, "--"] + train, timeout=args.timeout)
    if getattr(conc, "leftover_processes", False):
        print("WARNING: processes of concord-run were still alive after it exited (killed)",
              flush=True)
    if case.throw:
        check_concord_throw(checks, case, conc, status_dir)
        return None, None, conc
    if not checks.check(conc.returncode == 0 and not conc.timed_out,
                        "[%s] concord-run --nproc %d concord-train --sharding fixed %s exits 0"
                        % (case.name, case.world, " ".join(case.flags)), conc.describe()):
        return None, None, conc
    states = {}
    if per_rank:
        # Every worker that trained to the end writes its own; those that
        # left at the end of their data write nothing.
        for name in sorted(os.listdir(per_worker)):
            states[name] = fixtures.load_state(os.path.join(per_worker, name))
        checks.check(len(states) == len(case.survivors),
                     "[%s] concord: each of the %d worker(s) with the longest stream wrote "
                     "--output-per-worker" % (case.name, len(case.survivors)),
                     "written: %s\n%s" % (sorted(states), conc.describe()))
    if checks.check(os.path.isfile(out), "[%s] concord wrote --output" % case.name,
                      conc.describe()):
        states[None] = fixtures.load_state(out)
    m = None
    if checks.check(os.path.isfile(metrics), "[%s] concord wrote --metrics-out" % case.name):
        with open(metrics) as f:
            m = json.load(f)
    return states, m, conc


def check_concord_throw(checks, case, conc, status_dir):
    checks.check(conc.returncode != 0 and not conc.timed_out,
                 "[%s] concord-run exits non-zero" % case.name, conc.describe())
    statuses = []
    for name in sorted(os.listdir(status_dir)):
        with open(os.path.join(status_dir, name)) as f:
            statuses.append(f.read().strip())
    checks.check(len(statuses) == case.world and all(s == "1" for s in statuses),
                 "[%s] every concord-train worker (%d) exits with status 1"
                 % (case.name, case.world),
                 "exit statuses %s\n%s" % (statuses, conc.describe()))
    said = set()
    for line in conc.stderr.splitlines():
        mt = re.match(r"\[worker (\d+)\] (.*)", line)
        if mt and re.search(r"early[ _-]termination", mt.group(2), re.IGNORECASE):
            said.add(int(mt.group(1)))
    checks.check(said == set(range(case.world)),
                 "[%s] every worker's stderr mentions early termination" % case.name,
                 "workers that did: %s\n%s" % (sorted(said), conc.describe()))


def params_of(state, names):
    return {k: v for k, v in state.items() if k in names}


def report_buffers(label, actual, expected, names):
    """Print (no check) how far actual's buffers are from expected's."""
    buffers = [k for k in expected if k not in names]
    if not buffers:
        return
    parts = []
    for k in buffers:
        a, e = actual.get(k), expected[k]
        if a is None or a.shape != e.shape:
            parts.append("%s absent or reshaped" % k)
        elif e.is_floating_point():
            parts.append("%s %.3e" % (k, float((a.double() - e.double()).abs().max())))
        else:
            parts.append("%s %s" % (k, "equal" if torch.equal(a, e) else
                                    "%s vs %s" % (a.flatten()[:4].tolist(),
                                                  e.flatten()[:4].tolist())))
    print("    %s buffers, max abs diff (not checked): %s" % (label, "; ".join(parts)), flush=True)


def compare_case(checks, case, ref, ref_m, ring, conc, conc_m):
    names = set(fixtures.parameter_names(case.model))
    initial = fixtures.initial_state(case.model)
    layouts = (ref_m["initial_bucket_params"], ref_m["bucket_params"]) if ref_m else None
    expected = None
    if ref is not None:
        expected = ref[case.last_joiner]
        for r, state in enumerate(ref):
            if r != case.last_joiner:
                fixtures.report_mismatch(
                    checks, "[%s] pytorch: rank %d ends with the last joiner's (rank %d) "
                    "model (parameters and buffers)" % (case.name, r, case.last_joiner),
                    state, expected, *BIT_EXACT)
        spec = case.spec
        simulated = {}
        for divide in (True, False):
            simulated[divide] = fixtures.simulate(
                case.model, case.data, case.loss, case.world, spec["batch"], EPOCHS, lr=LR,
                momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
                shuffle_seed=spec.get("shuffle_seed"), layouts=layouts, ring=ring, join=True,
                divide_by_initial_world_size=divide, skip_steps=case.skip_steps)
        tol = BIT_EXACT if ring or case.world < 3 else EXACT
        fixtures.report_mismatch(
            checks, "[%s] pytorch reference matches the single-process join simulation "
            "(divide_by_initial_world_size=%s)" % (case.name, case.divide_by_initial),
            expected, simulated[case.divide_by_initial], *tol)
        failures = fixtures.compare_states(simulated[True], simulated[False], *EXACT)
        checks.check(bool(failures), "[%s] divide_by_initial_world_size changes the result "
                     "(max rel diff %.3e)" % (case.name, fixtures.worst_rel_diff(
                         simulated[True], simulated[False])),
                     "the same result either way: this case cannot tell")
    conc = sorted((conc or {}).items(), key=lambda t: "" if t[0] is None else t[0])
    labelled = [("concord" if r is None else "concord worker %s" % r, state) for r, state in conc]
    for label, state in [("pytorch", expected)] + labelled:
        if state is None:
            continue
        unchanged = [k for k in names if k in state and torch.equal(state[k], initial[k])]
        checks.check(not unchanged and names <= set(state),
                     "[%s] %s: every parameter changed from its initial value"
                     % (case.name, label),
                     "unchanged: %s, absent: %s" % (unchanged, sorted(names - set(state))))
    if expected is None or not conc:
        return
    for r, state in conc:
        label = "concord" if r is None else "concord worker %s" % r
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        checks.check(not missing and not extra,
                     "[%s] %s: the same parameters and buffers as pytorch" % (case.name, label),
                     "missing %s, unexpected %s" % (missing, extra))
        fixtures.report_mismatch(
            checks, "[%s] %s: parameters == pytorch DDP join (%s), bit for bit"
            % (case.name, label, " ".join(case.flags) or "defaults"),
            params_of(state, names), params_of(expected, names), *BIT_EXACT)
        report_buffers(label, state, expected, names)
    if conc_m is not None:
        checks.check(conc_m.get("steps") == max(case.lengths),
                     "[%s] concord metrics: steps %d (the longest stream)"
                     % (case.name, max(case.lengths)),
                     "got steps=%r" % (conc_m.get("steps"),))
        print("    concord metrics: world_size %s, bucket_bytes %s; pytorch bucket_bytes %s"
              % (conc_m.get("world_size"), conc_m.get("bucket_bytes"),
                 (ref_m or {}).get("bucket_bytes")), flush=True)


def run(args, checks, tmp):
    cases = [Case(args, name, tmp) for name in args.case]
    for case in cases:
        print("case %s: %s\n    kind %s, %d samples, W=%d, batch %d, %d epochs, steps per rank "
              "%s, last joiner rank %d, concord-train --sharding fixed %s"
              % (case.name, case.spec["doc"], case.kind, case.spec["samples"], case.world,
                 case.spec["batch"], EPOCHS, case.lengths, case.last_joiner,
                 " ".join(case.flags) or "(defaults)"), flush=True)
        if len(set(case.lengths)) < 2:
            raise ValueError("case %s: even streams %s (a join case needs uneven ones)"
                             % (case.name, case.lengths))
    timings = []
    # Phase 1: the PyTorch references and Gloo's order of addition (forked
    # from this process before it runs any autograd).
    refs = {}
    for case in cases:
        t0 = time.monotonic()
        refs[case] = pytorch_reference(args, checks, case)
        timings.append(("pytorch %s" % case.name, time.monotonic() - t0))
    rings = {}
    for case in cases:
        ref_m = refs[case][1]
        if ref_m and case.world == 3:
            wanted = fixtures.bucket_elements(
                case.model, (ref_m["initial_bucket_params"], ref_m["bucket_params"]))
            rings[case] = fixtures.probe_gloo_ring(wanted, 3, timeout=args.timeout)
    # Phase 2: Concord.
    bin_dir = os.path.abspath(args.bin_dir)
    missing = [b for b in ("concord-run", "concord-train")
               if not os.access(os.path.join(bin_dir, b), os.X_OK)]
    conc = {case: (None, None) for case in cases}
    if not checks.check(not missing, "concord binaries present in %s" % bin_dir,
                        "not found or not executable: %s" % missing):
        pass
    elif not checks.check(concord_supports(bin_dir, "--sharding"),
                          "concord-train has --sharding (uneven inputs)",
                          "concord-train --help does not mention --sharding"):
        pass
    else:
        per_rank = concord_supports(bin_dir, "--output-per-worker")
        print("concord-train %s --output-per-worker: %s" % (
            "takes" if per_rank else "does not take",
            "every worker with the longest stream is compared" if per_rank else
            "only the rank concord-train writes from is compared"), flush=True)
        for case in cases:
            t0 = time.monotonic()
            states, m, _ = concord(args, checks, case, per_rank)
            conc[case] = (states, m)
            timings.append(("concord %s" % case.name, time.monotonic() - t0))
    # Phase 3: simulations and comparisons.
    for case in cases:
        if case.throw:
            continue
        print("--- %s" % case.name, flush=True)
        ref, ref_m = refs[case]
        compare_case(checks, case, ref, ref_m, rings.get(case), conc[case][0], conc[case][1])
    print("timings: " + "; ".join("%s %.1fs" % t for t in timings), flush=True)


def main():
    args = parse_args()
    if args.list_cases:
        for name in sorted(CASES):
            c = CASES[name]
            print("%-12s %s\n%12s kind %s, %d samples, W=%d, batch %d, flags %s" % (
                name, c["doc"], "", c["kind"], c["samples"], c["world"], c["batch"],
                " ".join(c["flags"]) or "-"))
        return 0
    checks = Checks()
    tmp = tempfile.mkdtemp(prefix="concord_join_")
    t0 = time.monotonic()
    try:
        run(args, checks, tmp)
    except Exception as e:  # noqa: BLE001 - an unexpected error is a failure, with its traceback
        import traceback
        traceback.print_exc()
        checks.fail("test ran to completion", "%s: %s" % (type(e).__name__, e))
    finally:
        if args.keep:
            print("kept %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print("elapsed %.1fs" % (time.monotonic() - t0))
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

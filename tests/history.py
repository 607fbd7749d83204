#!/usr/bin/python3
"""The history checker: reads what the workers and the coordinators of a
run wrote (see Note [History files] in worker/trace/history.h, see Note
[Coordinator history] in coordinator/store/history_file.h) and proves the
invariants an elastic job must keep, whatever failed during the run.

    /usr/bin/python3 tests/history.py --workers DIR [--workers DIR ...]
        [--coordinator FILE ...] [--samples N --epochs E] [--final-step S]

or, from a test, check(workers_dir, coordinator_files, ...) -> list of
problems (empty: every invariant holds) and a summary. Several --workers
directories (check_runs) are runs of one job one after another, each with
a coordinator of its own (`concord-run --standalone --history DIR`, the
job started again after it was lost whole): run k's generation g is read
as k * RUN_GENERATIONS + g, so later runs' generations come after.

Note [History checker]
~~~~~~~~~~~~~~~~~~~~~~
The invariants, each a class of problem:
  generations   the coordinators' formed generations, ordered by time, have
                increasing numbers; no number is formed twice (by one
                replica or two); every generation a worker says it joined
                was formed with that worker at that rank and world size;
                each worker process joins ever higher generations.
  membership    a worker commits a step only in the generation it joined
                last, and only one the coordinator formed with it.
  continuity    a worker process's commits follow its state: after a
                restore at step r (or a commit of r) its next commit is
                r + 1.
  agreement     the workers that committed step s in generation g agree on
                the epoch, the samples and (replicated training, i.e. plain
                DDP) the parameters' digest after s.
  restores      the state a worker goes on from after a re-form is a
                committed step of the job: at step r > 0 its digest is the
                one step r's committers had.
  lost commits  a step committed in two generations: the earlier commit is
                lost, which is allowed only when none of its committers went
                on into a later generation up to the one that took the step
                again (had one, its report of the step would have made it
                the authoritative rank and the step would not be redone),
                or when the ones they went on into were lost whole before
                it: a generation after them resumed from a checkpoint of an
                earlier step (see resumes).
  steps         the job's steps (each step's commit in its last generation)
                are 1..S without a gap (S: --final-step, else the highest).
  samples       with --samples N --epochs E: over the job's steps, every
                sample of every epoch is taken exactly once and the epochs
                never go back.
  resumes       a resume from step S (a generation none of whose members
                held a committed step took a checkpoint's state) is of a
                step some worker recorded checkpointing, with the digest the
                job's step S had (replicated training), and only after a
                total loss: no worker process that had committed a step
                after S is heard from after the resume. The steps after S
                are then committed again (lost commits above), their
                samples trained again, never skipped.
A last line without its newline (a process killed while writing) is
ignored; any other line that is not a JSON object is a problem.
"""

import argparse
import collections
import glob
import json
import os
import sys


# `concord-run --standalone --history DIR`'s coordinator history.
STANDALONE = "coordinator.history"
# check_runs: the generations of run k are k * RUN_GENERATIONS + g.
RUN_GENERATIONS = 1000000


def read_lines(path):
    """(records, problems): the file's complete JSON lines."""
    with open(path, "rb") as f:
        data = f.read().decode("utf-8", "replace")
    parts = data.split("\n")
    records, problems = [], []
    for i, raw in enumerate(parts[:-1]):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError as e:
            problems.append("%s:%d: not JSON (%s)" % (path, i + 1, e))
            continue
        if not isinstance(rec, dict) or "event" not in rec:
            problems.append("%s:%d: not a history record" % (path, i + 1))
            continue
        records.append(rec)
    return records, problems


class History(object):
    """Everything one run wrote, indexed for the checks."""

    def __init__(self, worker_files, coordinator_files, job=None, offsets=None):
        """`offsets`: {path: added to the generation numbers of its records}."""
        self.problems = []
        offsets = offsets or {}

        def read(path):
            records, problems = read_lines(path)
            self.problems += problems
            for r in records:
                if "generation" in r and offsets.get(path):
                    r["generation"] += offsets[path]
            return records

        self.incarnations = collections.OrderedDict()  # (worker, pid) -> [records]
        for path in sorted(worker_files):
            for r in read(path):
                if job is not None and r.get("job") != job:
                    continue
                self.incarnations.setdefault((r["worker"], r["pid"]), []).append(r)
        self.coordinator = []  # (file, record)
        for path in coordinator_files:
            for r in read(path):
                if job is None or r.get("job") == job:
                    self.coordinator.append((path, r))

    def formed(self):
        """{(job, generation): record} of the coordinators' formed
        generations (the first of each)."""
        out = {}
        for _, r in self.coordinator:
            if r["event"] == "generation" and "members" in r:
                out.setdefault((r["job"], r["generation"]), r)
        return out


def check_generations(h, problems):
    formed = [(p, r) for p, r in h.coordinator if r["event"] == "generation" and "members" in r]
    seen = {}
    for path, r in formed:
        key = (r["job"], r["generation"])
        if key in seen:
            problems.append("generation %d of job %s formed twice: members %s (%s pid %s) and %s (%s pid %s)" % (
                r["generation"], r["job"], seen[key][1]["members"], os.path.basename(seen[key][0]),
                seen[key][1]["pid"], r["members"], os.path.basename(path), r["pid"]))
        else:
            seen[key] = (path, r)
    by_job = collections.defaultdict(list)
    for _, r in formed:
        by_job[r["job"]].append(r)
    for job, rs in by_job.items():
        rs = sorted(rs, key=lambda r: (r["time_us"], r["seq"]))
        numbers = [r["generation"] for r in rs]
        if any(b <= a for a, b in zip(numbers, numbers[1:])):
            problems.append("job %s: generations formed out of order (by time): %s" % (job, numbers))
    by_gen = h.formed()
    for (worker, pid), records in h.incarnations.items():
        last = 0
        for r in records:
            if r["event"] != "generation":
                continue
            g = r["generation"]
            if g <= last:
                problems.append("%s (pid %s) joined generation %d after %d" % (worker, pid, g, last))
            last = g
            if not h.coordinator:
                continue
            f = by_gen.get((r["job"], g))
            if f is None:
                problems.append("%s (pid %s) joined generation %d, which no coordinator formed" % (
                    worker, pid, g))
            elif len(f["members"]) != r["world"] or not 0 <= r["rank"] < len(f["members"]) or \
                    f["members"][r["rank"]] != worker:
                problems.append("%s (pid %s) joined generation %d as rank %d of %d; the coordinator "
                                "formed it with %s" % (worker, pid, g, r["rank"], r["world"], f["members"]))


def check_commits(h, problems):
    """Membership and continuity; returns {step: {generation: [(incarnation, record)]}}."""
    by_gen = h.formed()
    commits = collections.defaultdict(lambda: collections.defaultdict(list))
    for inc, records in h.incarnations.items():
        worker, pid = inc
        current = None  # the generation joined last
        state = None    # the step this process's state is at
        for r in records:
            ev = r["event"]
            if ev == "generation":
                current = r["generation"]
            elif ev == "restore":
                if r["generation"] != current:
                    problems.append("%s (pid %s) restored in generation %d, having joined %s" % (
                        worker, pid, r["generation"], current))
                state = r["step"]
            elif ev == "commit":
                g, s = r["generation"], r["step"]
                if g != current:
                    problems.append("%s (pid %s) committed step %d in generation %d, having joined %s" % (
                        worker, pid, s, g, current))
                f = by_gen.get((r["job"], g))
                if h.coordinator and (f is None or worker not in f["members"]):
                    problems.append("%s (pid %s) committed step %d in generation %d, which the "
                                    "coordinator did not form with it" % (worker, pid, s, g))
                if state is not None and s != state + 1:
                    problems.append("%s (pid %s) committed step %d after its state was at step %d" % (
                        worker, pid, s, state))
                state = s
                commits[s][g].append((inc, r))
    return commits


def check_agreement(commits, problems):
    for s in sorted(commits):
        for g, entries in sorted(commits[s].items()):
            def differ(key):
                return len({json.dumps(r.get(key)) for _, r in entries}) > 1
            for key in ("epoch", "samples"):
                if differ(key):
                    problems.append("step %d of generation %d: the committers disagree on %s: %s" % (
                        s, g, key, ", ".join("%s: %s" % (i[0], str(r.get(key))[:60]) for i, r in entries)))
            replicated = [(i, r) for i, r in entries if r.get("replicated")]
            if len({r["digest"] for _, r in replicated}) > 1:
                problems.append("step %d of generation %d: different parameters after it: %s" % (
                    s, g, ", ".join("%s %s" % (i[0], r["digest"]) for i, r in replicated)))


def later_generations(h, inc, after, upto):
    return [r["generation"] for r in h.incarnations[inc]
            if r["event"] == "generation" and after < r["generation"] <= upto]


def resumed_before(h, step, after, upto):
    """Whether a generation in (after, upto] resumed from a checkpoint of a
    step before `step` (a total loss in between: check_resumes)."""
    return any(r["event"] == "resume" and after < r["generation"] <= upto
               and r["step"] < step
               for records in h.incarnations.values() for r in records)


def canonical_steps(h, commits, problems):
    """{step: record} of the job's steps (each step in its last generation);
    problems for lost commits that were not allowed."""
    job = {}
    lost = []
    for s in sorted(commits):
        gens = sorted(commits[s])
        final = gens[-1]
        job[s] = commits[s][final][0][1]
        for g in gens[:-1]:
            for inc, _ in commits[s][g]:
                went_on = later_generations(h, inc, g, final)
                if went_on and not (final not in went_on
                                    and resumed_before(h, s, max(went_on), final)):
                    problems.append("step %d committed by %s (pid %s) in generation %d was taken again in "
                                    "generation %d although that worker went on into generation(s) %s" % (
                                        s, inc[0], inc[1], g, final, went_on))
                else:
                    lost.append((s, g, inc[0]))
    return job, lost


def check_restores(h, job_steps, problems):
    for (worker, pid), records in h.incarnations.items():
        for r in records:
            if r["event"] != "restore" or r["step"] == 0 or not r.get("replicated"):
                continue
            c = job_steps.get(r["step"])
            if c is None:
                problems.append("%s (pid %s) went on from step %d in generation %d, a step nobody "
                                "committed" % (worker, pid, r["step"], r["generation"]))
            elif c.get("replicated") and c["digest"] != r["digest"]:
                problems.append("%s (pid %s) went on from step %d in generation %d with parameters %s; "
                                "the step's committers had %s" % (worker, pid, r["step"], r["generation"],
                                                                  r["digest"], c["digest"]))


def check_steps(job_steps, final_step, problems):
    steps = sorted(job_steps)
    top = final_step if final_step is not None else (steps[-1] if steps else 0)
    missing = sorted(set(range(1, top + 1)) - set(steps))
    extra = [s for s in steps if s > top]
    if missing or extra:
        problems.append("the job's steps are not 1..%d: missing %s, beyond %s" % (top, missing[:20], extra[:20]))


def sample_problems(windows, n, epochs):
    """Problems of the job's windows [(epoch, samples)], in step order: the
    epochs must not go back, and each of `epochs` epochs must take every
    sample of 0..n-1 exactly once (also test_elastic's sample logs)."""
    problems = []
    seen_epochs = [e for e, _ in windows]
    if any(b < a for a, b in zip(seen_epochs, seen_epochs[1:])):
        problems.append("epochs go back over the steps")
    for e in range(epochs):
        count = collections.Counter(i for we, idx in windows if we == e for i in idx)
        absent = sorted(set(range(n)) - set(count))
        twice = sorted(i for i, c in count.items() if c > 1)
        foreign = sorted(i for i in count if not 0 <= i < n)
        if absent or twice or foreign:
            problems.append("epoch %d: %d samples never taken %s, %d taken more than once %s%s" % (
                e, len(absent), absent[:10], len(twice), twice[:10],
                ", out of range %s" % foreign[:10] if foreign else ""))
    beyond = sorted(set(seen_epochs) - set(range(epochs)))
    if beyond:
        problems.append("steps of epochs %s beyond the %d epochs" % (beyond, epochs))
    return problems


def check_samples(job_steps, n, epochs, problems):
    steps = sorted(job_steps)
    if any("samples" not in job_steps[s] for s in steps):
        problems.append("steps without samples (no ElasticSampler?)")
        return
    problems += sample_problems([(job_steps[s]["epoch"], job_steps[s]["samples"]) for s in steps],
                                n, epochs)


def check_resumes(h, job_steps, problems):
    checkpointed = {r["step"] for records in h.incarnations.values()
                    for r in records if r["event"] == "checkpoint"}
    for (worker, pid), records in h.incarnations.items():
        for r in records:
            if r["event"] != "resume":
                continue
            s, t = r["step"], r["time_us"]
            what = "%s (pid %s) resumed from step %d (%s) in generation %d" % (
                worker, pid, s, r.get("source"), r["generation"])
            if s not in checkpointed:
                problems.append(what + ", which no worker recorded checkpointing")
            c = job_steps.get(s)
            if c is None:
                problems.append(what + ", a step nobody committed")
            elif r.get("replicated") and c.get("replicated") and c["digest"] != r["digest"]:
                problems.append(what + " with parameters %s; the step's committers had %s" % (
                    r["digest"], c["digest"]))
            for (w2, p2), rs in h.incarnations.items():
                ahead = [x["step"] for x in rs
                         if x["event"] == "commit" and x["step"] > s and x["time_us"] < t]
                if ahead and any(x["time_us"] > t for x in rs):
                    problems.append(what + " although %s (pid %s), which had committed step %d, "
                                    "went on" % (w2, p2, max(ahead)))


def check(workers, coordinator=(), samples=None, epochs=None, final_step=None, job=None):
    """Runs every check. `workers`: a directory of *.history files (its
    coordinator.history is a --standalone coordinator's) or a list of files;
    `coordinator`: the coordinators' history files. Returns (problems,
    summary)."""
    problems, summary, _ = check_with_lost(workers, coordinator, samples, epochs, final_step, job)
    return problems, summary


def run_files(directory):
    """(worker files, coordinator files) of a --history DIR."""
    files = sorted(glob.glob(os.path.join(directory, "*.history")))
    # A --standalone concord-run's coordinator writes there too.
    standalone = os.path.join(directory, STANDALONE)
    if standalone in files:
        files.remove(standalone)
        return files, [standalone]
    return files, []


def check_runs(directories, samples=None, epochs=None, final_step=None, job=None):
    """check() over runs of one job one after another (the module's
    docstring): (problems, summary)."""
    files, coordinator, offsets = [], [], {}
    for k, d in enumerate(directories):
        w, c = run_files(d)
        files += w
        coordinator += c
        offsets.update({path: k * RUN_GENERATIONS for path in w + c})
    problems, summary, _ = checked(History(files, coordinator, job, offsets), samples, epochs,
                                   final_step)
    return problems, summary


def check_with_lost(workers, coordinator=(), samples=None, epochs=None, final_step=None, job=None):
    """check(), and the lost commits it allowed: [(step, generation, worker)]."""
    coordinator = list(coordinator)
    if isinstance(workers, str):
        files, standalone = run_files(workers)
        coordinator += standalone
    else:
        files = list(workers)
    return checked(History(files, coordinator, job), samples, epochs, final_step)


def checked(h, samples, epochs, final_step):
    """Every check over `h`: (problems, summary, lost commits)."""
    problems = list(h.problems)
    if not h.incarnations:
        problems.append("no worker history records")
    check_generations(h, problems)
    commits = check_commits(h, problems)
    check_agreement(commits, problems)
    job_steps, lost = canonical_steps(h, commits, problems)
    check_restores(h, job_steps, problems)
    check_resumes(h, job_steps, problems)
    check_steps(job_steps, final_step, problems)
    if samples is not None and epochs is not None:
        check_samples(job_steps, samples, epochs, problems)
    formed = len(h.formed())
    resumes = sum(1 for rs in h.incarnations.values() for r in rs if r["event"] == "resume")
    summary = "%d worker processes, %d steps, %d generations formed, %d resume(s), %d lost commit(s)%s" % (
        len(h.incarnations), len(job_steps), formed, resumes, len(lost),
        "" if not lost else " (" + ", ".join("step %d of generation %d by %s" % l for l in lost[:5]) + ")")
    return problems, summary, lost


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", required=True, action="append",
                    help="directory of the workers' *.history files (again: a later run of the job)")
    ap.add_argument("--coordinator", action="append", default=[], help="a coordinator's --history-file")
    ap.add_argument("--samples", type=int)
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--final-step", type=int)
    ap.add_argument("--job")
    a = ap.parse_args()
    if len(a.workers) > 1:
        if a.coordinator:
            ap.error("--coordinator with several --workers runs: each run's is its coordinator.history")
        problems, summary = check_runs(a.workers, a.samples, a.epochs, a.final_step, a.job)
    else:
        problems, summary = check(a.workers[0], a.coordinator, a.samples, a.epochs, a.final_step,
                                  a.job)
    for p in problems:
        print("VIOLATION " + p)
    print(summary)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

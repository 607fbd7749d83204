#!/usr/bin/python3
"""The history checker (tests/history.py) on made-up histories: a correct
one passes, and each invariant's violation is named.

    /usr/bin/python3 tests/history_test.py
"""

import copy
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import history  # noqa: E402
import testlib  # noqa: E402

JOB = "j"


def rec(event, worker, pid, t, **fields):
    r = {"event": event, "worker": worker, "pid": pid, "job": JOB, "time_us": t}
    r.update(fields)
    return r


def good_run():
    """Three workers over 8 samples x 2 epochs, batch 1 per rank; c is
    killed after step 2 of generation 1 and the other two go on in
    generation 2 from step 2 (so c's lost commit of step 3 is redone)."""
    workers = {"a": [], "b": [], "c": []}
    coord = [
        {"event": "generation", "job": JOB, "seq": 1, "time_us": 10, "pid": 1, "generation": 1,
         "members": ["a", "b", "c"]},
        {"event": "generation", "job": JOB, "seq": 2, "time_us": 500, "pid": 1, "generation": 2,
         "members": ["a", "b"]},
    ]
    for rank, w in enumerate("abc"):
        workers[w].append(rec("generation", w, 100 + rank, 20, generation=1, rank=rank, world=3))
        workers[w].append(rec("restore", w, 100 + rank, 30, generation=1, step=0, epoch=0,
                              digest="d0", replicated=True))
    windows = [[0, 1, 2], [3, 4, 5], [6, 7], [0, 1], [2, 3], [4, 5], [6, 7]]
    epochs = [0, 0, 0, 1, 1, 1, 1]
    for i, (win, ep) in enumerate(zip(windows, epochs)):
        step = i + 1
        gen = 1 if step <= 2 else 2
        members = "abc" if gen == 1 else "ab"
        for rank, w in enumerate(members):
            if gen == 2 and step == 3 and not any(r["event"] == "generation" and r["generation"] == 2
                                                  for r in workers[w]):
                workers[w].append(rec("generation", w, 100 + rank, 600, generation=2, rank=rank, world=2))
                workers[w].append(rec("restore", w, 100 + rank, 610, generation=2, step=2, epoch=0,
                                      digest="d2", replicated=True))
            workers[w].append(rec("commit", w, 100 + rank, 100 * step + 700 * (gen - 1), generation=gen,
                                  rank=rank, world=len(members), step=step, epoch=ep,
                                  digest="d%d" % step, replicated=True, samples=win))
    # c's lost commit: step 3 in generation 1 with a window the job took again
    workers["c"].append(rec("commit", "c", 102, 350, generation=1, rank=2, world=3, step=3,
                            epoch=0, digest="dx", replicated=True, samples=[6, 7]))
    return workers, coord


def run_check(tmp, name, workers, coord, **kw):
    d = os.path.join(tmp, name)
    os.makedirs(d)
    for w, records in workers.items():
        with open(os.path.join(d, w + ".history"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    cfile = os.path.join(d, "coordinator.jsonl")
    with open(cfile, "w") as f:
        for r in coord:
            f.write(json.dumps(r) + "\n")
    return history.check(d, [cfile], samples=8, epochs=2, **kw)


def find(workers, w, event, **match):
    for r in workers[w]:
        if r["event"] == event and all(r.get(k) == v for k, v in match.items()):
            return r
    raise KeyError((w, event, match))


def total_loss_runs():
    """A job lost whole and started again (check_runs): run 1's a and b
    commit steps 1..5 of 8 samples x 2 epochs at world size 2, a records
    the checkpoints of steps 2 and 4, then every process dies; run 2's c
    and d (a coordinator of its own, generations from 1 again) resume from
    step 4 and commit 5..8 (step 5 again: a and b's are lost commits)."""
    windows = [[0, 1], [2, 3], [4, 5], [6, 7], [1, 0], [3, 2], [5, 4], [7, 6]]

    def commit(w, pid, t, step, rank):
        return rec("commit", w, pid, t, generation=1, rank=rank, world=2, step=step,
                   epoch=(step - 1) // 4, digest="d%d" % step, replicated=True,
                   samples=windows[step - 1])

    runs = []
    for members, pids, t0, first, last in ((("a", "b"), (100, 101), 10, 0, 5),
                                           (("c", "d"), (200, 201), 10000, 4, 8)):
        workers = {}
        for rank, (w, pid) in enumerate(zip(members, pids)):
            rs = [rec("generation", w, pid, t0 + 10, generation=1, rank=rank, world=2)]
            if first:
                rs.append(rec("resume", w, pid, t0 + 20, generation=1, step=first, source="disk",
                              digest="d%d" % first, replicated=True))
            rs.append(rec("restore", w, pid, t0 + 30, generation=1, step=first, epoch=first // 4,
                          digest="d%d" % first, replicated=True))
            for step in range(first + 1, last + 1):
                rs.append(commit(w, pid, t0 + 100 * step, step, rank))
                if w == "a" and step in (2, 4):
                    rs.append(rec("checkpoint", w, pid, t0 + 100 * step + 1, generation=1,
                                  step=step, epoch=(step - 1) // 4, disk=True))
            workers[w] = rs
        coord = [{"event": "generation", "job": JOB, "seq": 1, "time_us": t0, "pid": 1,
                  "generation": 1, "members": list(members)}]
        runs.append((workers, coord))
    return runs


def check_total_loss(checks, tmp):
    def run_runs(name, runs):
        dirs = []
        for k, (workers, coord) in enumerate(runs):
            d = os.path.join(tmp, "%s-run%d" % (name, k))
            os.makedirs(d)
            for w, records in workers.items():
                with open(os.path.join(d, w + ".history"), "w") as f:
                    f.write("".join(json.dumps(r) + "\n" for r in records))
            with open(os.path.join(d, history.STANDALONE), "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in coord))
            dirs.append(d)
        return history.check_runs(dirs, samples=8, epochs=2, final_step=8)

    base = total_loss_runs()
    problems, summary = run_runs("loss", base)
    checks.check(not problems and "2 resume(s)" in summary and "2 lost commit(s)" in summary,
                 "a job lost whole and resumed from a checkpoint passes (%s)" % summary,
                 "; ".join(problems))

    def violation(name, mutate, expect):
        runs = copy.deepcopy(base)
        mutate(runs)
        problems, _ = run_runs(name, runs)
        checks.check(any(expect in p for p in problems), "%s: named (%r)" % (name, expect),
                     "; ".join(problems) or "no problem found")

    violation("resume-digest", lambda r: find(r[1][0], "c", "resume").update(digest="zz"),
              "the step's committers had d4")
    violation("resume-unchecked",
              lambda r: r[0][0]["a"].remove(find(r[0][0], "a", "checkpoint", step=4)),
              "which no worker recorded checkpointing")
    violation("resume-alive",
              lambda r: r[0][0]["b"].append(rec("finish", "b", 101, 20000, ok=True, message="")),
              "which had committed step 5, went on")
    # Run 2 goes on from step 4 with the sampler past step 5's window (the
    # first of epoch 1): samples 0 and 1 of epoch 1 would never be trained.
    violation("resume-skips",
              lambda r: [find(r[1][0], w, "commit", step=5).update(samples=[6, 7]) for w in "cd"],
              "epoch 1: 2 samples never taken [0, 1]")


def loss_after_a_survivor_went_on():
    """One run: a and b commit steps 1..3 in generation 1 (a records the
    checkpoint of step 2); a dies, b goes on alone into generation 2 and
    commits step 4, then dies too; c and d form generation 3, resume from
    step 2 and commit 3..8. b's commits of 3 (generation 1) and 4
    (generation 2) are lost although b went on into generation 2: that
    generation was lost whole before the resume."""
    windows = [[0, 1], [2, 3], [4, 5], [6, 7], [1, 0], [3, 2], [5, 4], [7, 6]]

    def commit(w, pid, t, step, g, rank, world):
        return rec("commit", w, pid, t, generation=g, rank=rank, world=world, step=step,
                   epoch=(step - 1) // 4, digest="d%d" % step, replicated=True,
                   samples=windows[step - 1])

    workers = {w: [rec("generation", w, pid, 10, generation=1, rank=r, world=2),
                   rec("restore", w, pid, 20, generation=1, step=0, epoch=0, digest="d0",
                       replicated=True)]
               for r, (w, pid) in enumerate((("a", 100), ("b", 101)))}
    for step in (1, 2, 3):
        for r, (w, pid) in enumerate((("a", 100), ("b", 101))):
            workers[w].append(commit(w, pid, 100 * step + r, step, 1, r, 2))
        if step == 2:
            workers["a"].append(rec("checkpoint", "a", 100, 202, generation=1, step=2, epoch=0,
                                    disk=False))
    workers["b"] += [rec("generation", "b", 101, 400, generation=2, rank=0, world=1),
                     rec("restore", "b", 101, 410, generation=2, step=3, epoch=0, digest="d3",
                         replicated=True),
                     commit("b", 101, 420, 4, 2, 0, 1)]
    for r, (w, pid) in enumerate((("c", 200), ("d", 201))):
        rs = [rec("generation", w, pid, 1000, generation=3, rank=r, world=2),
              rec("resume", w, pid, 1010, generation=3, step=2, source="memory", digest="d2",
                  replicated=True),
              rec("restore", w, pid, 1020, generation=3, step=2, epoch=0, digest="d2",
                  replicated=True)]
        rs += [commit(w, pid, 1100 + 100 * step + r, step, 3, r, 2) for step in range(3, 9)]
        workers[w] = rs
    coord = [{"event": "generation", "job": JOB, "seq": 1, "time_us": 5, "pid": 1,
              "generation": 1, "members": ["a", "b"]},
             {"event": "generation", "job": JOB, "seq": 2, "time_us": 395, "pid": 1,
              "generation": 2, "members": ["b"]},
             {"event": "generation", "job": JOB, "seq": 3, "time_us": 995, "pid": 1,
              "generation": 3, "members": ["c", "d"]}]
    return workers, coord


def main():
    checks = testlib.Checks()
    tmp = tempfile.mkdtemp(prefix="concord_history_test_")
    base_w, base_c = good_run()
    problems, summary = run_check(tmp, "good", base_w, base_c, final_step=7)
    checks.check(not problems, "a correct history passes (%s)" % summary, "; ".join(problems))
    checks.check("1 lost commit" in summary, "the dead worker's commit of step 3 is a lost commit", summary)
    w, c = loss_after_a_survivor_went_on()
    problems, summary = run_check(tmp, "went-on-then-lost", w, c, final_step=8)
    checks.check(not problems and "3 lost commit(s)" in summary,
                 "a survivor's generation lost whole before a resume: its commits are lost "
                 "commits (%s)" % summary, "; ".join(problems))
    # Without the resume (c and d restored step 2 as if a member held it),
    # b's going on into generation 2 makes its redone step 3 a problem.
    for x in "cd":
        w[x] = [r for r in w[x] if r["event"] != "resume"]
    problems, _ = run_check(tmp, "went-on-no-resume", w, c, final_step=8)
    checks.check(any("although that worker went on into generation(s) [2]" in p
                     for p in problems),
                 "without a resume, a survivor's redone step is named",
                 "; ".join(problems) or "no problem found")

    def violation(name, mutate, expect, **kw):
        w, c = copy.deepcopy(base_w), copy.deepcopy(base_c)
        mutate(w, c)
        problems, _ = run_check(tmp, name, w, c, **kw)
        checks.check(any(expect in p for p in problems), "%s: named (%r)" % (name, expect),
                     "; ".join(problems) or "no problem found")

    violation("digest", lambda w, c: find(w, "b", "commit", step=4).update(digest="zz"),
              "different parameters after it")
    violation("window", lambda w, c: find(w, "b", "commit", step=4).update(samples=[9]),
              "disagree on samples")
    violation("outside", lambda w, c: find(w, "c", "commit", step=3).update(generation=2),
              "having joined 1")
    violation("not-member", lambda w, c: c[1].update(members=["a", "x"]),
              "which the coordinator did not form with it")
    violation("formed-twice", lambda w, c: c.append(dict(c[1], seq=3, time_us=900, pid=2)),
              "formed twice")
    violation("order", lambda w, c: c[1].update(time_us=5), "out of order")
    violation("gap", lambda w, c: [w[x].remove(find(w, x, "commit", step=5)) or
                                   find(w, x, "commit", step=6).update(step=6)
                                   for x in "ab"], "committed step 6 after its state was at step 4")
    violation("restore", lambda w, c: find(w, "a", "restore", generation=2).update(digest="bad"),
              "the step's committers had")
    violation("twice", lambda w, c: [find(w, x, "commit", step=7).update(samples=[0, 7]) for x in "ab"],
              "taken more than once")
    violation("final", lambda w, c: None, "the job's steps are not 1..9", final_step=9)

    def redo_by_survivor(w, c):
        # b also committed step 3 in generation 1, then went on: its step
        # should not have been taken again.
        r = copy.deepcopy(find(w, "c", "commit", step=3))
        r.update(worker="b", pid=101, rank=1)
        i = w["b"].index(find(w, "b", "generation", generation=2))
        w["b"].insert(i, r)
        find(w, "b", "restore", generation=2).update(step=3)
    violation("redo", redo_by_survivor, "although that worker went on")

    def torn(w, c):
        path = os.path.join(tmp, "torn.history")
        with open(path, "w") as f:
            f.write(json.dumps(base_w["a"][0]) + "\n" + '{"event": "com')
        records, problems = history.read_lines(path)
        checks.check(len(records) == 1 and not problems,
                     "a last line cut off by a kill is ignored", str(problems))
    torn(None, None)
    check_total_loss(checks, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

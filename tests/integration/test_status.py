#!/usr/bin/python3
"""The coordinator's per-job metrics, Grafana dashboard, `concordctl watch`
and status page against a real coordinator and a real 2-worker job
(concord-run + concord-train, Gloo, loopback).

    /usr/bin/python3 tests/integration/test_status.py --bin-dir build/bin --part watch|browser [--keep]

--part watch (label `watch`):
  * bad input: `concordctl watch` without JOB and with --interval 0 exit 2
    with one stderr line; an unknown JOB exits 1 with one line naming
    NOT_FOUND;
  * while the job trains, /metrics has the job's series (2 members, a finite
    loss, samples/s > 0), and every metric name a query of
    deploy/grafana/concord.json uses is a family /metrics declares;
  * `concordctl watch JOB --interval 0.5` (stdout a pipe: plain snapshots)
    follows the job to its end: several snapshots, both ranks listed, the
    step grows, the last snapshot says SUCCEEDED, exit 0 within 10 s of the
    job's end;
  * the status API's history of the finished job has progress points with a
    loss and generation 1.
--part browser (label `browser`): the status page in headless Chromium
  (tests/browser/status_page.mjs, playwright-core): the job list shows the
  running job, its page shows both members and the throughput plot gains
  points while steps go; no credentials: 401. Plain HTTP checks of the auth,
  404 and 405 rules. Skips (exit 77) only when /usr/bin/chromium is absent.

Prints one line per check and 'N passed, N failed'; exits 1 on any failure.
"""

import argparse
import base64
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))

import elastic_harness as te  # noqa: E402

import fixtures  # noqa: E402
import processes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testlib import wait_for  # noqa: E402

JOB = "status-job"
SKIP = 77
CHROMIUM = "/usr/bin/chromium"


class Coordinator(object):
    """concord-coordinator with metrics and the status page on free ports."""

    def __init__(self, bins, directory):
        os.makedirs(directory, exist_ok=True)
        self.worker_token = te.write_token_file(os.path.join(directory, "worker-token"))
        self.operator_token = te.write_token_file(os.path.join(directory, "operator-token"))
        with open(self.operator_token) as f:
            self.token = f.read().strip()
        self.proc = te.Proc("coordinator", [
            bins.coordinator, "--listen", "127.0.0.1:0",
            "--worker-token-file", self.worker_token,
            "--operator-token-file", self.operator_token,
            "--metrics-listen", "127.0.0.1:0", "--status-listen", "127.0.0.1:0"], directory)
        log = wait_for(lambda: (lambda t: t if "status page on port" in t else None)(
            self.proc.stderr() + self.proc.stdout()), 20, 0.05) or ""
        m = re.search(r"listening on (\S+)", log)
        self.address = m.group(1) if m else None
        m = re.search(r"metrics on port (\d+)", log)
        self.metrics_port = int(m.group(1)) if m else None
        m = re.search(r"status page on port (\d+)", log)
        self.status_port = int(m.group(1)) if m else None

    def ok(self):
        return None not in (self.address, self.metrics_port, self.status_port)

    def stop(self):
        self.proc.kill_group()
        self.proc.wait(10)

    def metrics(self):
        """parse_metrics of /metrics now ({}, {} when it does not answer)."""
        s, _, body = http("http://127.0.0.1:%d/metrics" % self.metrics_port)
        return parse_metrics(body) if s == 200 else ({}, {})


def http(url, method="GET", headers=None, timeout=10):
    """(status, headers, body) of one request."""
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def ctl(bins, coord, *args, timeout=30):
    return processes.run_command(
        [os.path.join(os.path.dirname(bins.run), "concordctl"), "--endpoint", coord.address,
         "--token-file", coord.operator_token] + list(args), timeout=timeout)


def start_job(bins, coord, tmp, epochs, min_step_ms):
    """A 2-worker job of `epochs` epochs (64 steps each) whose steps take at
    least `min_step_ms` (concord-train's CONCORD_TEST_MIN_STEP_MS): the checks
    need a job that is still running while they look, and these steps take
    ~1 ms through shared memory."""
    fx = te.Fixture(tmp, 512)
    rd = te.RunDir(tmp, "job")
    train = te.train_args(fx, rd, 4, epochs)
    job = te.Proc("concord-run", te.launch_cmd(bins, 2, JOB, train, coordinator=coord.address,
                                               token_file=coord.worker_token), rd.logs,
                  env={"CONCORD_TEST_MIN_STEP_MS": str(min_step_ms)})
    return job


def api_job(coord):
    status, _, body = http("http://127.0.0.1:%d/api/jobs/%s" % (coord.status_port, JOB),
                           headers={"Authorization": "Bearer " + coord.token})
    return json.loads(body) if status == 200 else None


def running_with_progress(coord, min_points):
    j = api_job(coord)
    if j and j["state"] == "RUNNING" and len(j["members"]) == 2 and \
            len(j["history"]["points"]) >= min_points:
        return j
    return None


def one_line(r):
    return len([x for x in r.stderr.splitlines() if x.strip()]) == 1


def metric_names(expr):
    return set(re.findall(r"\b(concord_[a-z_]+)\b", expr))


def exprs_of(dashboard):
    out = []
    for p in dashboard.get("panels", []):
        for t in p.get("targets", []):
            if t.get("expr"):
                out.append(t["expr"])
    for v in dashboard.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if v.get("type") == "query" and q:
            out.append(q)
    return out


def parse_metrics(text):
    """({family: type}, {series name with labels: value})."""
    types, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return types, samples


def part_watch(args, checks, tmp, bins, coord):
    r = ctl(bins, coord, "watch")
    checks.check(r.returncode == 2 and one_line(r), "watch without JOB: exit 2, one line",
                 r.describe())
    r = ctl(bins, coord, "watch", JOB, "--interval", "0")
    checks.check(r.returncode == 2 and one_line(r), "watch --interval 0: exit 2, one line",
                 r.describe())
    r = ctl(bins, coord, "watch", "no-such-job")
    checks.check(r.returncode == 1 and one_line(r) and "NOT_FOUND" in r.stderr,
                 "watch of an unknown job: exit 1, one line naming NOT_FOUND", r.describe())

    job = start_job(bins, coord, tmp, epochs=40, min_step_ms=5)  # ~13 s
    running = wait_for(lambda: running_with_progress(coord, 2), 60, 0.2)
    if not checks.check(running is not None, "the job runs with 2 members", job.describe()):
        return
    watch_out = os.path.join(tmp, "watch.stdout")
    with open(watch_out, "w") as out:
        watch = subprocess.Popen(
            [os.path.join(os.path.dirname(bins.run), "concordctl"), "--endpoint", coord.address,
             "--token-file", coord.operator_token, "watch", JOB, "--interval", "0.5"],
            stdout=out, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            universal_newlines=True, start_new_session=True)

    # Metrics while it trains, and the dashboard's names.
    def scrape():
        s, _, body = http("http://127.0.0.1:%d/metrics" % coord.metrics_port)
        types, samples = parse_metrics(body) if s == 200 else ({}, {})
        loss = samples.get('concord_job_loss{job="%s"}' % JOB)
        sps = samples.get('concord_job_samples_per_second{job="%s"}' % JOB, 0)
        steps = samples.get('concord_job_steps_per_second{job="%s"}' % JOB, 0)
        workers = [k for k in samples
                   if k.startswith('concord_worker_step_seconds{job="%s",' % JOB)]
        if samples.get('concord_job_members{job="%s"}' % JOB) == 2 and loss is not None \
                and sps > 0 and steps > 0 and len(workers) == 2:
            return types, samples
        return None
    # The status JSON says how the coordinator sees each member and what it
    # reported (docs/operators.md): health, and progress with its step times.
    def reported():
        j = api_job(coord)
        members = (j or {}).get("members", [])
        if len(members) == 2 and all(
                m.get("health") == "" and (m.get("progress") or {}).get("step_ms", 0) > 0
                and "own_ms" in m["progress"] and "recent" in m["progress"] for m in members) \
                and j.get("hang_timeout_ms", 0) >= 5000 and j.get("stragglers") == "report" \
                and j.get("run", 0) > 1.7e15:
            return j
        return None
    checks.check(wait_for(reported, 30, 0.5) is not None,
                 "/api/jobs/ID: each member's health (\"\") and progress (step, own, wait "
                 "times), the hang timeout in force, the straggler policy and the job's run "
                 "(its start, in microseconds since the epoch)",
                 json.dumps(api_job(coord))[:2000])
    scraped = wait_for(scrape, 30, 0.5)
    checks.check(scraped is not None,
                 "/metrics: the job's members (2), loss, samples/s > 0, steps/s > 0 and "
                 "both members' step times")
    if scraped:
        types, samples = scraped
        loss = samples['concord_job_loss{job="%s"}' % JOB]
        checks.check(math.isfinite(loss), "concord_job_loss is finite (%g)" % loss)
        for name in ("concord_job_generation", "concord_job_step", "concord_job_failures_total",
                     "concord_job_reform_seconds_count", "concord_job_running"):
            checks.check('%s{job="%s"}' % (name, JOB) in samples, "/metrics has %s{job}" % name,
                         "\n".join(k for k in samples if "concord_job" in k))
        # Per member (see Note [Stragglers]): its step time and how it splits.
        for name in ("concord_worker_step_seconds", "concord_worker_own_seconds",
                     "concord_worker_wait_seconds", "concord_worker_straggler"):
            series = [k for k in samples
                      if k.startswith('%s{job="%s",worker="' % (name, JOB))]
            checks.check(len(series) == 2 and types.get(name) == "gauge",
                         "/metrics has %s{job,worker} for both members" % name,
                         "\n".join(k for k in samples if "concord_worker" in k))
        with open(os.path.join(ROOT, "deploy", "grafana", "concord.json")) as f:
            dashboard = json.load(f)
        names = set()
        for e in exprs_of(dashboard):
            names |= metric_names(e)
        missing = []
        for n in sorted(names):
            base = re.sub(r"_(bucket|count|sum)$", "", n)
            if n not in types and not (base in types and types[base] == "histogram"):
                missing.append(n)
        checks.check(len(names) >= 10 and not missing,
                     "every metric of the Grafana dashboard (%d) is exported" % len(names),
                     "missing: %s\nexported: %s" % (missing, sorted(types)))
        ds = [v for v in dashboard["templating"]["list"] if v.get("type") == "datasource"]
        checks.check(ds and ds[0].get("query") == "prometheus" and all(
            p["datasource"]["uid"] == "${%s}" % ds[0]["name"] for p in dashboard["panels"]),
            "the dashboard's panels use the Prometheus datasource variable")

    rc = job.wait(te.RUN_TIMEOUT + 60)
    checks.check(rc == 0, "concord-run exits 0 (%.1fs)" % job.elapsed, job.describe())
    try:
        watch_rc = watch.wait(timeout=15)
    except subprocess.TimeoutExpired:
        watch.kill()
        watch_rc = None
    err = watch.stderr.read()
    text = te.read_text(watch_out)
    snapshots = [s for s in re.split(r"\n(?=job )", text) if s.startswith("job ")]
    checks.check(watch_rc == 0, "watch exits 0 when the job succeeded (rc %s)" % watch_rc,
                 "stderr: %s\nstdout tail: %s" % (err, text[-2000:]))
    checks.check("\x1b[" not in text, "watch writes no ANSI codes to a pipe")
    steps = [int(m) for m in re.findall(r"^step (\d+) ", text, re.M)]
    checks.check(len(snapshots) >= 3 and steps and steps[-1] > steps[0],
                 "watch printed %d snapshots, step %s -> %s" % (
                     len(snapshots), steps[0] if steps else None, steps[-1] if steps else None),
                 text[-3000:])
    both = [s for s in snapshots if re.search(r"^0\s+\S+", s, re.M) and
            re.search(r"^1\s+\S+", s, re.M) and "RUNNING" in s]
    checks.check(both, "a snapshot lists RUNNING with ranks 0 and 1", text[:3000])
    checks.check(snapshots and "SUCCEEDED" in snapshots[-1].splitlines()[0],
                 "the last snapshot says SUCCEEDED", snapshots[-1] if snapshots else text)

    final = api_job(coord)
    points = final["history"]["points"] if final else []
    checks.check(final and final["state"] == "SUCCEEDED" and len(points) >= 3 and
                 any(p["loss"] is not None for p in points) and
                 final["generations"] and final["generations"][0]["generation"] == 1,
                 "the status API keeps the history (%d points) and generation 1" % len(points),
                 json.dumps(final)[:3000])


def part_browser(args, checks, tmp, bins, coord):
    base = "http://127.0.0.1:%d" % coord.status_port
    basic = "Basic " + base64.b64encode(("operator:" + coord.token).encode()).decode()
    s, h, _ = http(base + "/")
    checks.check(s == 401 and h.get("WWW-Authenticate") == 'Basic realm="concord"',
                 "no token: 401 with WWW-Authenticate Basic realm=\"concord\"", "%s %s" % (s, h))
    s, _, _ = http(base + "/", headers={"Authorization": "Bearer " + "x" * 48})
    checks.check(s == 401, "a wrong bearer token: 401")
    s, _, _ = http(base + "/", headers={"Authorization": "Bearer " + coord.token})
    checks.check(s == 200, "the operator token as a bearer token: 200")
    s, _, body = http(base + "/api/jobs", headers={"Authorization": basic})
    checks.check(s == 200 and json.loads(body) == {"jobs": []},
                 "Basic with the operator token: 200, no jobs yet", body)
    s, h, _ = http(base + "/api/jobs", method="POST", headers={"Authorization": basic})
    checks.check(s == 405 and h.get("Allow") == "GET", "POST: 405, Allow: GET")
    s, _, _ = http(base + "/no/such/page", headers={"Authorization": basic})
    checks.check(s == 404, "an unknown path: 404")
    s, _, _ = http(base + "/api/jobs/nosuch", headers={"Authorization": basic})
    checks.check(s == 404, "an unknown job: 404")

    browser_dir = os.path.join(ROOT, "tests", "browser")
    if not os.path.isdir(os.path.join(browser_dir, "node_modules", "playwright-core")):
        checks.fail("playwright-core installed",
                    "run `npm ci --prefix tests/browser` (scripts/test.sh does)")
        return
    job = start_job(bins, coord, tmp, epochs=60, min_step_ms=20)  # ~77 s, killed after
    running = wait_for(lambda: running_with_progress(coord, 2), 60, 0.2)
    if not checks.check(running is not None, "the job runs with 2 members", job.describe()):
        return
    workers = sorted(m["worker_id"] for m in running["members"])
    r = processes.run_command(["node", os.path.join(browser_dir, "status_page.mjs"), base,
                              coord.token, JOB, ",".join(workers), CHROMIUM], timeout=120)
    for line in r.stdout.splitlines():
        if line.startswith("PASS "):
            checks.ok(line[5:])
        elif line.startswith("FAIL "):
            checks.fail(line[5:], "")
    checks.check(r.returncode == 0 and "FAIL" not in r.stdout,
                 "the headless-Chromium checks pass", r.describe())
    job.kill_group()
    job.wait(10)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--part", choices=("watch", "browser"), required=True)
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args()
    if args.part == "browser" and not os.access(CHROMIUM, os.X_OK):
        print("CONCORD_TEST_SKIPPED: %s is not installed (scripts/install-deps.sh installs chromium)" % CHROMIUM)
        return SKIP
    checks = fixtures.Checks()
    bins = te.Bins(args.bin_dir)
    if bins.missing():
        checks.fail("binaries present", "missing: %s" % bins.missing())
        return checks.finish()
    tmp = tempfile.mkdtemp(prefix="concord-status-")
    try:
        coord = Coordinator(bins, os.path.join(tmp, "coordinator"))
        if checks.check(coord.ok(), "concord-coordinator started with metrics and status ports",
                        coord.proc.describe()):
            (part_watch if args.part == "watch" else part_browser)(args, checks, tmp, bins, coord)
    finally:
        te.Proc.kill_all()
        if args.keep:
            print("kept %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

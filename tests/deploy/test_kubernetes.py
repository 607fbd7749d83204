#!/usr/bin/python3
"""deploy/kubernetes, checked offline.

    /usr/bin/python3 tests/deploy/test_kubernetes.py --bin-dir build/bin

1. Schemas: every object validates against the Kubernetes JSON schemas
   bundled with the npm package kubernetes-models (tests/deploy/k8s-validate,
   pinned by its package-lock.json; `npm ci` there first, scripts/test.sh
   does), and has no field the API does not know (strict, like
   `kubectl --validate=strict`).
2. Cross-references the schemas cannot see (cross_check below): selectors
   and labels, named ports against the coordinator's flags, probes on the
   health port, Secret keys and the files the flags read, NetworkPolicy
   reach, the Indexed Job's elastic range against --min/--max-workers, the
   coordinator address against the Service, the security context of every
   container, kustomization.yaml's resources and images.
3. The checks can fail: copies with a wrong field type, misspelt fields, a Service selector
   that misses the pods, a missing Secret key, a NetworkPolicy on the wrong
   port and a parallelism above --max-workers are each rejected.
4. The Deployment's args run: the real concord-coordinator starts with them
   (paths mapped into a temporary directory, 0.0.0.0 ports onto free
   loopback ports, certificates made with openssl) and the probes' httpGet
   answers 200 on the port they name.
6. replicas/coordinator-etcd.yaml (the coordinator as etcd replicas, in
   place of coordinator.yaml): schemas, the same cross-references plus
   probes fit for standbys (liveness must not be the health port's 503) and
   the PodDisruptionBudget; its replicas run against a real etcd with TLS:
   one ready, the others 503, a standby ready after SIGTERM to the leader.
5. The Job's command line runs: --min-workers copies of it (concord-run +
   concord-train, $(POD_IP) = 127.0.0.1, the Service name mapped onto that
   coordinator, a small TorchScript CNN and data in the mapped /data) train
   to the end over TLS and write the output.

Prints one line per check and 'N passed, N failed'; exits 1 on any failure.
"""

import argparse
import copy
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testlib import Checks, accepts, free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MANIFESTS = os.path.join(ROOT, "deploy", "kubernetes")
VALIDATOR = os.path.join(HERE, "k8s-validate")
# The etcd-replica coordinator, used instead of coordinator.yaml.
REPLICAS = os.path.join(MANIFESTS, "replicas", "coordinator-etcd.yaml")


def load(directory, coordinator=None):
    """[(file name, object)] of every manifest but kustomization.yaml;
    `coordinator`, when given, replaces coordinator.yaml."""
    docs = []
    for path in sorted(glob.glob(os.path.join(directory, "*.yaml"))):
        if os.path.basename(path) == "kustomization.yaml":
            continue
        if coordinator and os.path.basename(path) == "coordinator.yaml":
            path = coordinator
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc is not None:
                    docs.append((os.path.basename(path), doc))
    return docs


def schema_check(directory):
    """(ok, [result dicts], stderr) from validate.mjs."""
    files = sorted(p for p in glob.glob(os.path.join(directory, "*.yaml")) +
                   glob.glob(os.path.join(directory, "replicas", "*.yaml"))
                   if os.path.basename(p) != "kustomization.yaml")
    p = subprocess.run(["node", os.path.join(VALIDATOR, "validate.mjs")] + files,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120,
                       universal_newlines=True, cwd=VALIDATOR)
    results = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    return p.returncode == 0 and results and all(r["ok"] for r in results), results, p.stderr


# ---- cross-references -------------------------------------------------------

def flag(args, name):
    """The value after `name` in an argument list (before a lone --)."""
    for i, a in enumerate(args):
        if a == "--":
            return None
        if a == name and i + 1 < len(args):
            return str(args[i + 1])
    return None


def port_of(address):
    return int(str(address).rsplit(":", 1)[1])


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_port(container, ref):
    """containerPort for a named or numbered port reference, or None."""
    for p in container.get("ports", []):
        if ref == p.get("name") or ref == p.get("containerPort"):
            return p["containerPort"]
    return None


def cross_check(docs):
    """A list of problems (empty when everything refers to what exists)."""
    problems = []
    by_kind = {}
    for _, d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    namespaces = [d["metadata"]["name"] for d in by_kind.get("Namespace", [])]
    for _, d in docs:
        if d["kind"] != "Namespace" and d["metadata"].get("namespace") not in namespaces:
            problems.append("%s %s: namespace %r is not one of the manifests' %s" % (
                d["kind"], d["metadata"]["name"], d["metadata"].get("namespace"), namespaces))
    secrets = {s["metadata"]["name"]: set(s.get("data", {})) | set(s.get("stringData", {}))
               for s in by_kind.get("Secret", [])}
    claims = {c["metadata"]["name"] for c in by_kind.get("PersistentVolumeClaim", [])}
    deployments = [d for d in by_kind.get("Deployment", [])
                   if d["metadata"]["name"] == "concord-coordinator"]
    if len(deployments) != 1:
        return problems + ["no Deployment concord-coordinator"]
    deployment = deployments[0]
    jobs = by_kind.get("Job", [])
    if not jobs:
        return problems + ["no worker Job"]

    def pod_checks(owner, pod):
        spec = pod["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        pod_sc = spec.get("securityContext", {})
        for c in spec["containers"]:
            what = "%s container %s" % (owner, c["name"])
            sc = c.get("securityContext", {})
            if not (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True):
                problems.append(what + ": runAsNonRoot is not true")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(what + ": readOnlyRootFilesystem is not true")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(what + ": allowPrivilegeEscalation is not false")
            if "ALL" not in sc.get("capabilities", {}).get("drop", []):
                problems.append(what + ": capabilities do not drop ALL")
            res = c.get("resources", {})
            if not res.get("requests") or not res.get("limits", {}).get("memory"):
                problems.append(what + ": resources need requests and a memory limit")
            mounts = c.get("volumeMounts", [])
            for m in mounts:
                if m["name"] not in volumes:
                    problems.append("%s: volumeMount %s names no volume" % (what, m["name"]))
            # Every file a flag reads lies in a mounted secret volume that
            # projects it.
            args = [str(a) for a in c.get("args", [])]
            for i, a in enumerate(args[:-1]):
                if not (a.endswith("-file") or a.startswith("--tls-") or (
                        a.startswith("--etcd-") and args[i + 1].startswith("/"))):
                    continue
                path = args[i + 1]
                mount = next((m for m in mounts if path.startswith(m["mountPath"].rstrip("/") + "/")),
                             None)
                if mount is None:
                    problems.append("%s: %s %s is under no volumeMount" % (what, a, path))
                    continue
                volume = volumes.get(mount["name"], {})
                secret = volume.get("secret")
                if secret is None:
                    problems.append("%s: %s %s is not in a secret volume" % (what, a, path))
                    continue
                relative = path[len(mount["mountPath"].rstrip("/")) + 1:]
                items = secret.get("items")
                keys = [it["key"] for it in items if it["path"] == relative] if items else [relative]
                if not keys:
                    problems.append("%s: %s %s: secret volume %s projects no %s" % (
                        what, a, path, mount["name"], relative))
            for v in volumes.values():
                if "secret" in v:
                    name = v["secret"]["secretName"]
                    if name not in secrets:
                        problems.append("%s: volume %s names Secret %s, which is not there" % (
                            owner, v["name"], name))
                        continue
                    for it in v["secret"].get("items", []):
                        if it["key"] not in secrets[name]:
                            problems.append("%s: volume %s wants key %s of Secret %s (keys %s)" % (
                                owner, v["name"], it["key"], name, sorted(secrets[name])))
                if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] not in claims:
                    problems.append("%s: volume %s names claim %s, which is not there" % (
                        owner, v["name"], v["persistentVolumeClaim"]["claimName"]))
            for e in c.get("env", []):
                for ref in (e.get("valueFrom", {}).get("secretKeyRef"),):
                    if ref and ref.get("key") not in secrets.get(ref.get("name"), set()):
                        problems.append("%s: env %s wants key %s of Secret %s" % (
                            what, e["name"], ref.get("key"), ref.get("name")))

    # The coordinator.
    dspec = deployment["spec"]
    labels = dspec["template"]["metadata"]["labels"]
    if not matches(dspec["selector"]["matchLabels"], labels):
        problems.append("Deployment selector does not match its pod labels")
    if dspec.get("replicas", 1) > 1 and flag([str(a) for a in dspec["template"]["spec"][
            "containers"][0].get("args", [])], "--store") != "etcd":
        problems.append("Deployment: more than one replica needs --store etcd (the embedded "
                        "store's directory is locked by one process)")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        if not matches(pdb["spec"]["selector"].get("matchLabels"), labels):
            problems.append("PodDisruptionBudget %s selects no coordinator pod" %
                            pdb["metadata"]["name"])
    coord = dspec["template"]["spec"]["containers"][0]
    cargs = [str(a) for a in coord.get("args", [])]
    flag_ports = {}
    for name, f in (("grpc", "--listen"), ("metrics", "--metrics-listen"),
                    ("health", "--health-listen")):
        value = flag(cargs, f)
        if value is None:
            problems.append("coordinator: no %s flag" % f)
            continue
        flag_ports[name] = port_of(value)
        if container_port(coord, name) != flag_ports[name]:
            problems.append("coordinator: port %s is %s but %s says %s" % (
                name, container_port(coord, name), f, value))
    etcd = flag(cargs, "--store") == "etcd"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = coord.get(probe)
        if p is None:
            problems.append("coordinator: no %s" % probe)
            continue
        if etcd and probe != "readinessProbe" and "httpGet" in p:
            problems.append("coordinator: %s httpGet on the health port would restart every "
                            "etcd standby (they answer 503)" % probe)
        if probe == "readinessProbe" and "httpGet" not in p:
            problems.append("coordinator: readinessProbe must ask the health port (httpGet)")
        if "tcpSocket" in p:
            if container_port(coord, p["tcpSocket"]["port"]) != flag_ports.get("health"):
                problems.append("coordinator: %s tcpSocket port is not --health-listen's" % probe)
        elif "httpGet" in p:
            port = container_port(coord, p["httpGet"]["port"])
            if port != flag_ports.get("health"):
                problems.append("coordinator: %s httpGet port %s is not --health-listen's %s" % (
                    probe, p["httpGet"]["port"], flag_ports.get("health")))
        elif "grpc" in p:
            if p["grpc"]["port"] != flag_ports.get("grpc") or flag(cargs, "--tls-cert"):
                problems.append("coordinator: %s grpc probe needs the plaintext gRPC port" % probe)
        else:
            problems.append("coordinator: %s is neither httpGet nor grpc" % probe)
    pod_checks("Deployment concord-coordinator", dspec["template"])

    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    service = services.get("concord-coordinator")
    if service is None:
        problems.append("no Service concord-coordinator")
    else:
        if not matches(service["spec"]["selector"], labels):
            problems.append("Service concord-coordinator: selector %s does not select the "
                            "coordinator's pods %s" % (service["spec"]["selector"], labels))
        for p in service["spec"]["ports"]:
            if container_port(coord, p.get("targetPort", p["port"])) is None:
                problems.append("Service port %s: targetPort %s is no container port" % (
                    p.get("name"), p.get("targetPort")))

    # Network policies.
    policies = by_kind.get("NetworkPolicy", [])
    coord_policies = [p for p in policies if matches(p["spec"]["podSelector"].get("matchLabels"),
                                                     labels)]
    if not coord_policies:
        problems.append("no NetworkPolicy selects the coordinator's pods")
    job_labels = [j["spec"]["template"]["metadata"]["labels"] for j in jobs]
    grpc_from, metrics_from = [], []
    for pol in coord_policies:
        for rule in pol["spec"].get("ingress", []):
            ports = [container_port(coord, p.get("port")) for p in rule.get("ports", [])]
            if not rule.get("ports"):
                problems.append("NetworkPolicy %s: a rule opens every port" % pol["metadata"]["name"])
            for port in ports:
                if port is None:
                    problems.append("NetworkPolicy %s: a port is no coordinator port" %
                                    pol["metadata"]["name"])
                elif port == flag_ports.get("grpc"):
                    grpc_from += rule.get("from", [{}])
                elif port == flag_ports.get("metrics"):
                    metrics_from += rule.get("from", [{}])
    roles = set()
    for peer in grpc_from:
        sel = peer.get("podSelector", {}).get("matchLabels", {})
        if set(peer) != {"podSelector"} or set(sel) != {"concord.dev/role"}:
            problems.append("NetworkPolicy: the gRPC port is open to %s (only worker and "
                            "operator pods may reach it)" % peer)
        else:
            roles.add(sel["concord.dev/role"])
    if roles != {"worker", "operator"}:
        problems.append("NetworkPolicy: gRPC open to roles %s, want worker and operator" %
                        sorted(roles))
    for jl in job_labels:
        if not any(matches(p.get("podSelector", {}).get("matchLabels"), jl) for p in grpc_from):
            problems.append("NetworkPolicy: worker pods %s cannot reach the gRPC port" % jl)
    if not metrics_from or any(
            peer.get("namespaceSelector", {}).get("matchLabels") !=
            {"kubernetes.io/metadata.name": "monitoring"} or "podSelector" in peer
            for peer in metrics_from):
        problems.append("NetworkPolicy: the metrics port must be open to the monitoring "
                        "namespace only (%s)" % metrics_from)
    for jl in job_labels:
        if not any(matches(p["spec"]["podSelector"].get("matchLabels"), jl) and any(
                matches(peer.get("podSelector", {}).get("matchLabels"), jl)
                for rule in p["spec"].get("ingress", []) for peer in rule.get("from", []))
                   for p in policies):
            problems.append("NetworkPolicy: worker pods %s cannot reach each other" % jl)

    # Workers.
    for job in jobs:
        name = "Job %s" % job["metadata"]["name"]
        spec = job["spec"]
        if spec.get("completionMode") != "Indexed":
            problems.append(name + ": completionMode is not Indexed")
        c = spec["template"]["spec"]["containers"][0]
        args = [str(a) for a in c.get("command", []) + c.get("args", [])]
        lo, hi = flag(args, "--min-workers"), flag(args, "--max-workers")
        nproc = flag(args, "--nproc")
        if lo is None or hi is None or nproc != "1":
            problems.append(name + ": concord-run needs --nproc 1, --min-workers, --max-workers")
        else:
            lo, hi = int(lo), int(hi)
            if spec.get("completions") != hi:
                problems.append("%s: completions %s is not --max-workers %d" % (
                    name, spec.get("completions"), hi))
            if not lo <= spec.get("parallelism", 1) <= hi:
                problems.append("%s: parallelism %s is outside --min-workers..--max-workers "
                                "(%d..%d)" % (name, spec.get("parallelism"), lo, hi))
        address = flag(args, "--coordinator")
        if address is None:
            problems.append(name + ": no --coordinator")
        else:
            for one in address.split(","):
                host, port = one.rsplit(":", 1)
                parts = host.split(".")
                svc = services.get(parts[0])
                ns = parts[1] if len(parts) > 1 else job["metadata"]["namespace"]
                if svc is None or svc["metadata"]["namespace"] != ns or parts[2:] not in (
                        [], ["svc"], ["svc", "cluster", "local"]):
                    problems.append("%s: --coordinator %s names no Service of the manifests" % (
                        name, one))
                elif int(port) not in [p["port"] for p in svc["spec"]["ports"]] or int(
                        port) != next((p["port"] for p in svc["spec"]["ports"]
                                       if container_port(coord, p.get("targetPort")) ==
                                       flag_ports.get("grpc")), None):
                    problems.append("%s: --coordinator port %s is not the Service's gRPC port" % (
                        name, port))
        if flag(cargs, "--tls-cert") and not flag(args, "--tls-ca"):
            problems.append(name + ": the coordinator speaks TLS but workers get no --tls-ca")
        for ref in re.findall(r"\$\((\w+)\)", " ".join(args)):
            if ref not in [e["name"] for e in c.get("env", [])]:
                problems.append("%s: $(%s) is no env variable of the container" % (name, ref))
        pod_checks(name, spec["template"])
    return problems


def kustomization_check(directory):
    problems = []
    with open(os.path.join(directory, "kustomization.yaml")) as f:
        k = yaml.safe_load(f)
    present = {os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.yaml"))}
    present.discard("kustomization.yaml")
    listed = set(k.get("resources", []))
    if listed != present:
        problems.append("kustomization resources %s differ from the files %s" % (
            sorted(listed), sorted(present)))
    images = set()
    for _, d in load(directory):
        spec = d.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            images.add(c["image"].split(":")[0])
    named = {i["name"] for i in k.get("images", [])}
    if images != named:
        problems.append("kustomization images %s differ from the containers' %s" % (
            sorted(named), sorted(images)))
    return problems


# ---- negative copies ----------------------------------------------------------

def mutate(directory, scratch, name, fn):
    """A copy of the manifests with fn applied to each (file, object)."""
    target = os.path.join(scratch, name)
    shutil.copytree(directory, target)
    for path in glob.glob(os.path.join(target, "*.yaml")):
        if os.path.basename(path) == "kustomization.yaml":
            continue
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
        docs = [fn(os.path.basename(path), copy.deepcopy(d)) for d in docs]
        with open(path, "w") as f:
            yaml.safe_dump_all(docs, f, sort_keys=False)
    return target


def containers(d):
    return d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


def port_as_string(_, d):
    if d["kind"] == "Deployment":
        containers(d)[0]["ports"][0]["containerPort"] = "7070"
    return d


def misspelt_fields(_, d):
    if d["kind"] == "Deployment":
        c = containers(d)[0]
        c["readinesProbe"] = c.pop("readinessProbe")
    if d["kind"] == "Job":
        item = d["spec"]["template"]["spec"]["volumes"][0]["secret"]["items"][0]
        item["mod"] = 256  # for "mode"
    return d


def selector_miss(_, d):
    if d["kind"] == "Service":
        d["spec"]["selector"]["app.kubernetes.io/component"] = "coordinatr"
    return d


def secret_key_missing(_, d):
    if d["kind"] == "Secret" and d["metadata"]["name"] == "concord-tokens":
        d["stringData"].pop("worker-token")
    return d


def policy_wrong_port(_, d):
    if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "concord-coordinator":
        d["spec"]["ingress"][0]["ports"][0]["port"] = "health"
    return d


def too_parallel(_, d):
    if d["kind"] == "Job":
        d["spec"]["parallelism"] = 5
    return d


# ---- the Deployment's args, run -------------------------------------------------

OPENSSL = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
           "-nodes", "-days", "2", "-subj", "/CN=coord", "-addext", "subjectAltName=IP:127.0.0.1"]


def pod_files(coord, d):
    """The coordinator container's mounts as directories under `d` with the
    files its flags read: tokens, and one self-signed certificate (made
    with openssl) as every certificate, CA and key. Returns
    (mount path -> local directory, certificate, key)."""
    mounts = {m["mountPath"]: os.path.join(d, m["name"]) for m in coord["volumeMounts"]}
    for local in mounts.values():
        os.makedirs(local, exist_ok=True)
    cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
    subprocess.run(OPENSSL + ["-keyout", key, "-out", cert], check=True, timeout=60,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    args = [str(a) for a in coord["args"]]
    for i, a in enumerate(args[:-1]):
        value = args[i + 1]
        mount = next((m for m in mounts if value.startswith(m + "/")), None)
        if mount is None:
            continue
        local = mounts[mount] + value[len(mount):]
        if a.endswith("-token-file"):
            with open(local, "w") as f:
                f.write(("w" if "worker" in a else "o") * 32 + "\n")
        elif a.endswith("-key"):
            shutil.copy(key, local)
        else:
            shutil.copy(cert, local)
    return mounts, cert, key


def pod_args(coord, mounts, hosts):
    """The container's args with its mounts mapped, 0.0.0.0:PORT onto a free
    loopback port and every URL host in `hosts` ({name: address}) replaced.
    Returns (args, {container port: loopback port})."""
    ports, out = {}, []
    for a in [str(x) for x in coord["args"]]:
        if a.startswith("0.0.0.0:"):
            ports[int(a.split(":")[1])] = free_port()
            a = "127.0.0.1:%d" % ports[int(a.split(":")[1])]
        for name, address in hosts.items():
            a = a.replace(name, address)
        for mount in sorted(mounts, key=len, reverse=True):
            if a == mount or a.startswith(mount + "/"):
                a = mounts[mount] + a[len(mount):]
                break
        if a.startswith("/") and not a.startswith(tuple(mounts.values())):
            # Never touch this machine's own paths (e.g. /var/lib/concord).
            raise AssertionError("%s is under no volumeMount of the container" % a)
        out.append(a)
    return out, ports


def http_status(port, path):
    try:
        return urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=2).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def stop(proc):
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_deployment_args(c, bin_dir, docs):
    deployment = next(d for _, d in docs if d["kind"] == "Deployment")
    coord = deployment["spec"]["template"]["spec"]["containers"][0]
    d = tempfile.mkdtemp(prefix="concord-k8s-")
    proc = None
    try:
        mounts, cert, _ = pod_files(coord, d)
        out, ports = pod_args(coord, mounts, {})
        log = open(os.path.join(d, "coordinator.log"), "w")
        proc = subprocess.Popen([os.path.join(bin_dir, "concord-coordinator")] + out,
                                stdout=log, stderr=subprocess.STDOUT)
        probe = coord["readinessProbe"]["httpGet"]
        port = ports[container_port(coord, probe["port"])]
        status = None
        deadline = time.monotonic() + 30
        while status != 200 and time.monotonic() < deadline and proc.poll() is None:
            status = http_status(port, probe["path"])
            time.sleep(0.1)
        with open(log.name) as f:
            tail = f.read()[-300:]
        c.check(status == 200, "the coordinator runs with the Deployment's args and its "
                "readiness probe gets 200", tail if status != 200 else "")
        grpc = ports[container_port(coord, "grpc")]
        accepted = accepts(grpc)
        c.check(accepted, "the Service's gRPC targetPort is where it listens")
        if status == 200 and accepted:
            run_job(c, bin_dir, docs, d, mounts, grpc, cert)
    finally:
        stop(proc)
        shutil.rmtree(d, ignore_errors=True)


def run_replicas(c, bin_dir, docs):
    """replicas/coordinator-etcd.yaml's Deployment: `replicas` coordinators
    with its args against a real etcd (TLS, client certificates) on
    loopback. Exactly one is ready (readiness 200), the others 503 while
    their liveness port is open; SIGTERM to the leader makes another one
    ready."""
    deployment = next(d for _, d in docs if d["kind"] == "Deployment")
    coord = deployment["spec"]["template"]["spec"]["containers"][0]
    args = [str(a) for a in coord["args"]]
    endpoint = flag(args, "--etcd-endpoints")
    etcd_bin = shutil.which("etcd")
    if not c.check(etcd_bin is not None, "etcd installed (Debian etcd-server)"):
        return
    d = tempfile.mkdtemp(prefix="concord-k8s-etcd-")
    procs = []
    etcd = None
    try:
        mounts, cert, key = pod_files(coord, d)
        client = "https://127.0.0.1:%d" % free_port()
        peer = "http://127.0.0.1:%d" % free_port()
        etcd = subprocess.Popen(
            [etcd_bin, "--name", "t", "--data-dir", os.path.join(d, "etcd"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", "t=" + peer, "--cert-file", cert, "--key-file", key,
             "--trusted-ca-file", cert, "--client-cert-auth", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        host = endpoint.split("://", 1)[1].rsplit(":", 1)[0]
        ready_probe = coord["readinessProbe"]["httpGet"]
        live_probe = coord["livenessProbe"]
        replicas = []
        for r in range(deployment["spec"]["replicas"]):
            out, ports = pod_args(coord, mounts, {"https://%s:%s" % (
                host, endpoint.rsplit(":", 1)[1]): client})
            log = open(os.path.join(d, "replica-%d.log" % r), "w")
            procs.append(subprocess.Popen([os.path.join(bin_dir, "concord-coordinator")] + out,
                                          stdout=log, stderr=subprocess.STDOUT))
            replicas.append((procs[-1], ports, log.name))
            time.sleep(0.5)  # the first one leads
        ready_port = lambda ports: ports[container_port(coord, ready_probe["port"])]
        live_port = lambda ports: ports[container_port(
            coord, (live_probe.get("tcpSocket") or live_probe.get("httpGet"))["port"])]

        def statuses():
            return [http_status(ready_port(p), ready_probe["path"]) for _, p, _ in replicas]

        # One leader ready, the rest standing by; None: a port not up yet.
        settled = lambda s: None not in s and sorted(s) == [200] + [503] * (len(s) - 1)
        deadline = time.monotonic() + 30
        seen = statuses()
        while not settled(seen) and time.monotonic() < deadline:
            time.sleep(0.2)
            seen = statuses()
        logs = " | ".join(open(l).read()[-150:] for _, _, l in replicas)
        if not c.check(settled(seen),
                       "etcd replicas: one is ready (200), the others stand by (503)",
                       "%s %s" % (seen, logs if 200 not in seen else "")):
            return
        c.check(all(accepts(live_port(p)) for _, p, _ in replicas),
                "etcd replicas: the liveness probe's port is open on every replica")
        leader = seen.index(200)
        c.check(accepts(replicas[leader][1][container_port(coord, "grpc")]),
                "etcd replicas: the ready one serves gRPC")
        stop(replicas[leader][0])
        deadline = time.monotonic() + 20
        others = [i for i in range(len(replicas)) if i != leader]
        took_over = False
        while not took_over and time.monotonic() < deadline:
            took_over = any(http_status(ready_port(replicas[i][1]), ready_probe["path"]) == 200
                            for i in others)
            time.sleep(0.2)
        c.check(took_over, "etcd replicas: SIGTERM to the leader makes a standby ready")
    finally:
        for p in procs:
            stop(p)
        stop(etcd)
        shutil.rmtree(d, ignore_errors=True)


def run_job(c, bin_dir, docs, d, coordinator_mounts, grpc_port, cert):
    """The Job's command line, as Kubernetes would run it in --min-workers
    pods, against the coordinator started from the Deployment: paths of its
    mounts mapped into `d`, $(POD_IP) as 127.0.0.1, the Service's name onto
    the coordinator's loopback port; the CA is the coordinator's self-signed
    certificate. Every worker must exit 0 and the output must be written."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
    import fixtures  # torch (Debian's python3-torch)

    job = next(x for _, x in docs if x["kind"] == "Job")
    ctr = job["spec"]["template"]["spec"]["containers"][0]
    pods = int(flag([str(a) for a in ctr["args"]], "--min-workers"))
    mounts = {m["mountPath"]: os.path.join(d, "job-" + m["name"]) for m in ctr["volumeMounts"]}
    for local in mounts.values():
        os.makedirs(local)
    env_values = {"POD_IP": "127.0.0.1"}
    args = []
    for a in [str(x) for x in ctr["command"] + ctr["args"]]:
        a = re.sub(r"\$\((\w+)\)", lambda m: env_values.get(m.group(1), m.group(0)), a)
        a = re.sub(r"^concord-coordinator(\.[a-z0-9.-]+)?:\d+$", "127.0.0.1:%d" % grpc_port, a)
        for mount in sorted(mounts, key=len, reverse=True):
            if a.startswith(mount + "/"):
                a = mounts[mount] + a[len(mount):]
                break
        args.append(a)
    args[0] = os.path.join(os.path.abspath(bin_dir), args[0])
    i = args.index("--")
    args[i + 1] = os.path.join(os.path.abspath(bin_dir), args[i + 1])
    token = flag(args, "--token-file")
    with open(token, "w") as f:
        f.write("w" * 32 + "\n")  # the coordinator's worker token above
    shutil.copy(cert, flag(args, "--tls-ca"))
    model, data = flag(args[i + 1:], "--model"), flag(args[i + 1:], "--data")
    made_model, made_data = fixtures.make_fixture(os.path.join(d, "fixture"), "cnn", 192, 3)
    shutil.copy(made_model, model)
    shutil.copy(made_data, data)
    env = dict(os.environ, **{e["name"]: str(e["value"]) for e in ctr.get("env", [])
                              if "value" in e})
    env["HOME"] = d
    procs = []
    for pod in range(pods):
        log = open(os.path.join(d, "pod-%d.log" % pod), "w")
        procs.append((subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       cwd=d), log.name))
    codes = []
    for proc, _ in procs:
        try:
            codes.append(proc.wait(timeout=150))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    tails = " | ".join(open(log).read().strip()[-200:] for _, log in procs)
    output = flag(args[i + 1:], "--output")
    c.check(codes == [0] * pods and os.path.exists(output),
            "the Job's command line trains in %d pods (--min-workers) against the Deployment's "
            "coordinator and writes %s" % (pods, flag(ctr["args"][ctr["args"].index("--") + 1:],
                                                     "--output")),
            "exit %s; %s" % (codes, tails) if codes != [0] * pods or not os.path.exists(output)
            else "")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    args = parser.parse_args()
    c = Checks()
    if not os.path.isdir(os.path.join(VALIDATOR, "node_modules", "kubernetes-models")):
        c.check(False, "kubernetes-models installed: run `npm ci` in tests/deploy/k8s-validate "
                "(scripts/test.sh does)")
        print("%d passed, %d failed" % (c.passed, c.failed))
        sys.exit(1)

    ok, results, err = schema_check(MANIFESTS)
    c.check(ok and len(results) >= 8, "every object validates against the Kubernetes schemas",
            "; ".join("%s %s: %s" % (r["kind"], r["name"], r["error"]) for r in results
                      if not r["ok"]) + err.strip())
    docs = load(MANIFESTS)
    problems = cross_check(docs)
    c.check(not problems, "cross-references hold", "; ".join(problems))
    problems = kustomization_check(MANIFESTS)
    c.check(not problems, "kustomization.yaml lists every manifest and image", "; ".join(problems))

    scratch = tempfile.mkdtemp(prefix="concord-k8s-bad-")
    try:
        bad = mutate(MANIFESTS, scratch, "port-as-string", port_as_string)
        ok, results, err = schema_check(bad)
        errors = [r["error"] for r in results if not r["ok"]]
        c.check(not ok and any("containerPort must be integer" in e for e in errors),
                "a containerPort written as a string fails schema validation", "; ".join(errors))
        bad = mutate(MANIFESTS, scratch, "misspelt", misspelt_fields)
        ok, results, err = schema_check(bad)
        errors = " ".join(r["error"] for r in results if not r["ok"])
        c.check(not ok and "containers/0/readinesProbe" in errors and
                "volumes/0/secret/items/0/mod" in errors,
                "misspelt field names (readinesProbe, a volume item's mod) fail validation",
                errors[:300])
        for name, fn, expect in (("selector", selector_miss, "does not select"),
                                 ("secret-key", secret_key_missing, "wants key worker-token"),
                                 ("policy-port", policy_wrong_port, "cannot reach the gRPC port"),
                                 ("parallelism", too_parallel, "parallelism 5 is outside")):
            bad = mutate(MANIFESTS, scratch, name, fn)
            ok, _, _ = schema_check(bad)
            problems = cross_check(load(bad))
            c.check(ok and any(expect in p for p in problems),
                    "a copy with a broken %s passes the schemas and fails the cross-check" % name,
                    "; ".join(problems)[:300])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    run_deployment_args(c, args.bin_dir, docs)

    # The etcd-replica variant, in place of coordinator.yaml.
    replica_docs = load(MANIFESTS, coordinator=REPLICAS)
    problems = cross_check(replica_docs)
    c.check(not problems, "replicas/coordinator-etcd.yaml: cross-references hold",
            "; ".join(problems))
    scratch = tempfile.mkdtemp(prefix="concord-k8s-bad-")
    try:
        def http_liveness(name, d):
            if d["kind"] == "Deployment":
                probe = containers(d)[0]["livenessProbe"]
                probe["httpGet"] = {"path": "/", "port": probe.pop("tcpSocket")["port"]}
            return d
        bad = mutate(os.path.dirname(REPLICAS), scratch, "liveness", http_liveness)
        problems = cross_check(load(MANIFESTS, coordinator=os.path.join(
            bad, os.path.basename(REPLICAS))))
        c.check(any("would restart every etcd standby" in p for p in problems),
                "replicas: an httpGet liveness probe (it would restart the standbys) is rejected",
                "; ".join(problems)[:200])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    run_replicas(c, args.bin_dir, replica_docs)
    print("%d passed, %d failed" % (c.passed, c.failed))
    sys.exit(1 if c.failed else 0)


if __name__ == "__main__":
    main()

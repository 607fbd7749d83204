#!/usr/bin/python3
"""deploy/container/*.Dockerfile, checked offline (no image is built here:
there is no Docker daemon and base images cannot be pulled; docs/deploy.md).

    /usr/bin/python3 tests/deploy/test_containers.py --bin-dir build/bin

For each Dockerfile (coordinator, worker):
  - a builder stage FROM debian:bookworm and a runtime stage FROM
    debian:bookworm-slim; the builder's packages are all in
    scripts/install-deps.sh;
  - the runtime stage installs no compiler, build tool or -dev package,
    creates a user and runs as it (not root);
  - the binaries the runtime copies from the builder are targets the builder
    builds (`cmake --build --target`) and executables the project defines;
  - every shared library those binaries need (readelf NEEDED of the ones
    built here) comes from a package the runtime installs (dpkg -S), apart
    from libc6/libgcc-s1 and the CUDA runtime (the images build CPU only);
    every runtime package exists in Debian 12 (apt-cache show);
  - ENTRYPOINT names a copied binary; a .dockerignore keeps build trees out.
Coordinator: the HEALTHCHECK polls the port CMD's --health-listen names, and
the HEALTHCHECK command itself, run against the real coordinator started
with CMD's arguments (ports mapped to free loopback ports), succeeds while it
serves and fails once it stopped.
Kubernetes: the manifests run these images as built (the coordinator's
ENTRYPOINT, concord-run and concord-train in the worker image).
And the checks can fail: a copy whose runtime installs g++ and libtorch-dev,
runs as root and copies a binary the builder does not build is rejected.

Prints one line per check and 'N passed, N failed'; exits 1 on any failure.
"""

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testlib import Checks, free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CONTAINERS = os.path.join(ROOT, "deploy", "container")
EXPECTED = {"coordinator": {"concord-coordinator", "concordctl"},
            "worker": {"concord-run", "concord-train"}}
FORBIDDEN = re.compile(r"(-dev$|^build-essential$|^gcc|^g\+\+|^clang|^cpp(-|$)|^cmake|^make$|"
                       r"^ninja|^libtool$|^autoconf$|^pkg-config$|^nvidia-cuda-toolkit$)")
# Always in Debian's slim image (essential): need not be listed.
BASE = {"libc6", "libgcc-s1"}


def parse(path):
    """[stage {'from', 'name', 'instructions': [(KEYWORD, text)]}]."""
    stages = []
    text = open(path).read()
    logical, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or not stripped:
            continue  # comments and blank lines, also inside continuations
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        logical.append(current + stripped)
        current = ""
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append({"from": parts[0], "name": name, "instructions": []})
        elif stages:
            stages[-1]["instructions"].append((keyword, rest.strip()))
    return stages


def apt_packages(stage):
    packages = []
    for keyword, text in stage["instructions"]:
        if keyword != "RUN":
            continue
        for m in re.finditer(r"apt-get install (.*?)(?:&&|;|$)", text):
            packages += [t for t in m.group(1).split() if not t.startswith("-")]
    return packages


def exec_form(text):
    try:
        value = json.loads(text)
        return value if isinstance(value, list) else None
    except ValueError:
        return None


def flag(args, name):
    for i, a in enumerate(args[:-1]):
        if a == name:
            return args[i + 1]
    return None


def project_executables():
    names = set()
    for path in glob.glob(os.path.join(ROOT, "**", "CMakeLists.txt"), recursive=True):
        if "/build" in path[len(ROOT):] or "node_modules" in path:
            continue
        names |= set(re.findall(r"add_executable\(\s*([A-Za-z0-9_.-]+)", open(path).read()))
    return names


def install_deps_packages():
    text = open(os.path.join(ROOT, "scripts", "install-deps.sh")).read()
    block = re.search(r"PACKAGES=\((.*?)\n\)", text, re.S).group(1)
    return {t for line in block.splitlines() for t in line.split("#")[0].split()}


def dpkg_owners(paths):
    """{path: Debian package} for the paths dpkg knows, in one dpkg call (a
    path is tried as is, with /usr in front or taken off, and resolved)."""
    candidates = {}
    for path in paths:
        for c in (path, "/usr" + path, path[4:] if path.startswith("/usr/") else None,
                  os.path.realpath(path)):
            if c:
                candidates.setdefault(c, path)
    out = subprocess.run(["dpkg", "-S"] + sorted(candidates), stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, universal_newlines=True, timeout=120).stdout
    owners = {}
    for line in out.splitlines():
        pkg, _, found = line.partition(": ")
        if found.strip() in candidates:
            owners.setdefault(candidates[found.strip()], pkg.split(":")[0].strip())
    return owners


def needed(binary):
    """{soname: Debian package or None} of the libraries a binary names
    (NEEDED), each resolved where the dynamic linker finds it (ldd)."""
    out = subprocess.run(["readelf", "-dW", binary], stdout=subprocess.PIPE, timeout=60,
                         universal_newlines=True, check=True).stdout
    sonames = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    listed = subprocess.run(["ldd", binary], stdout=subprocess.PIPE, timeout=60,
                            universal_newlines=True).stdout
    resolved = dict(re.findall(r"^\s*(\S+) => (/\S+)", listed, re.M))
    # The dynamic loader is listed by its path alone (a binary names it when
    # it uses a symbol of it directly, e.g. __tls_get_addr).
    for path in re.findall(r"^\s*(/\S+) \(0x", listed, re.M):
        resolved.setdefault(os.path.basename(path), path)
    owners = dpkg_owners([resolved[so] for so in sonames if so in resolved])
    return {so: owners.get(resolved.get(so)) for so in sonames}


def problems_of(path, kind, bin_dir, executables, deps):
    """Everything wrong with one Dockerfile; binaries: the copied names."""
    problems = []
    stages = parse(path)
    if len(stages) < 2:
        return ["fewer than two stages"], set(), stages
    builder, runtime = stages[0], stages[-1]
    if not builder["from"].startswith("debian:bookworm"):
        problems.append("builder FROM %s is not Debian 12" % builder["from"])
    if runtime["from"] != "debian:bookworm-slim":
        problems.append("runtime FROM %s is not debian:bookworm-slim" % runtime["from"])
    build_pkgs = apt_packages(builder)
    missing = sorted(set(build_pkgs) - deps)
    if missing:
        problems.append("builder packages not in scripts/install-deps.sh: %s" % missing)
    run_pkgs = apt_packages(runtime)
    bad = sorted(p for p in run_pkgs if FORBIDDEN.search(p))
    if bad:
        problems.append("runtime installs build tools or -dev packages: %s" % bad)
    users = [t for k, t in runtime["instructions"] if k == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("runtime runs as root (USER %s)" % (users[-1] if users else "unset"))
    else:
        uid = users[-1].split(":")[0]
        created = any(k == "RUN" and re.search(r"useradd .*--uid %s\b" % re.escape(uid), t)
                      for k, t in runtime["instructions"])
        if not created:
            problems.append("runtime USER %s is not created with useradd --uid" % uid)
    targets = set()
    for k, t in builder["instructions"]:
        if k == "RUN":
            for m in re.finditer(r"cmake --build \S+ --target ((?:[A-Za-z0-9_.-]+ ?)+)", t):
                targets |= set(m.group(1).split())
    copied = set()
    for k, t in runtime["instructions"]:
        if k != "COPY" or "--from=" not in t:
            continue
        parts = t.split()
        sources = [p for p in parts[:-1] if not p.startswith("--")]
        for s in sources:
            name = os.path.basename(s)
            copied.add(name)
            if not s.startswith("/src/build/bin/"):
                problems.append("runtime copies %s, not a built binary" % s)
            if name not in targets:
                problems.append("runtime copies %s, which the builder does not build (targets %s)"
                                % (name, sorted(targets)))
            if name not in executables:
                problems.append("%s is no executable of the project" % name)
    if copied != EXPECTED[kind]:
        problems.append("copies %s, expected %s" % (sorted(copied), sorted(EXPECTED[kind])))
    for name in sorted(copied & executables):
        binary = os.path.join(bin_dir, name)
        if not os.path.exists(binary):
            problems.append("%s not built in %s" % (name, bin_dir))
            continue
        for lib, pkg in needed(binary).items():
            if re.match(r"lib(cud|nccl|cublas|nvrtc)", lib):
                continue  # a CUDA build here; the images build with CUDA off
            if pkg is None:
                problems.append("%s needs %s, which no Debian package ships" % (name, lib))
            elif pkg not in BASE and pkg not in run_pkgs:
                problems.append("%s needs %s from %s, which the runtime does not install" % (
                    name, lib, pkg))
    entry = [exec_form(t) for k, t in runtime["instructions"] if k == "ENTRYPOINT"]
    if not entry or not entry[-1] or os.path.basename(entry[-1][0]) not in copied:
        problems.append("ENTRYPOINT does not name a copied binary (%s)" % entry)
    ignore = path + ".dockerignore"
    if not os.path.exists(ignore) or "build" not in open(ignore).read():
        problems.append("no %s keeping build trees out" % os.path.basename(ignore))
    return problems, copied, stages


def healthcheck(c, bin_dir, stages):
    runtime = stages[-1]
    hc = [t for k, t in runtime["instructions"] if k == "HEALTHCHECK"]
    if not c.check(len(hc) == 1, "coordinator image: a HEALTHCHECK"):
        return
    command = exec_form(hc[0][hc[0].index("CMD") + 3:].strip())
    cmd_args = [exec_form(t) for k, t in runtime["instructions"] if k == "CMD"][-1]
    health = flag(cmd_args, "--health-listen")
    hc_port = re.search(r"/dev/tcp/127\.0\.0\.1/(\d+)", " ".join(command or []))
    if not c.check(command is not None and health is not None and hc_port is not None and
                   hc_port.group(1) == health.rsplit(":", 1)[1],
                   "coordinator image: HEALTHCHECK polls CMD's --health-listen port",
                   "%s vs %s" % (command, health)):
        return
    d = tempfile.mkdtemp(prefix="concord-hc-")
    proc = None
    try:
        ports = {}
        args = []
        for a in cmd_args:
            if a.startswith("0.0.0.0:"):
                ports[a.split(":")[1]] = str(free_port())
                a = "127.0.0.1:" + ports[a.split(":")[1]]
            elif a.startswith("/run/secrets/") or a.startswith("/var/lib/concord"):
                a = os.path.join(d, a.strip("/").replace("/", "_"))
            args.append(a)
        for f, v in ((flag(args, "--worker-token-file"), "w" * 32),
                     (flag(args, "--operator-token-file"), "o" * 32)):
            with open(f, "w") as fh:
                fh.write(v + "\n")
        probe = [p.replace("/dev/tcp/127.0.0.1/" + hc_port.group(1),
                           "/dev/tcp/127.0.0.1/" + ports[hc_port.group(1)]) for p in command]
        log = open(os.path.join(d, "log"), "w")
        proc = subprocess.Popen([os.path.join(bin_dir, "concord-coordinator")] + args,
                                stdout=log, stderr=subprocess.STDOUT)
        ok = False
        deadline = time.monotonic() + 30
        while not ok and time.monotonic() < deadline and proc.poll() is None:
            ok = subprocess.run(probe, timeout=10, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL).returncode == 0
            if not ok:
                time.sleep(0.2)
        c.check(ok, "coordinator image: the HEALTHCHECK command succeeds against the "
                "coordinator started with CMD's arguments", open(log.name).read()[-300:]
                if not ok else "")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        code = subprocess.run(probe, timeout=10, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode
        c.check(code != 0, "coordinator image: the HEALTHCHECK command fails once it stopped",
                "exit %d" % code)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def kubernetes_uses(c, copied):
    docs = []
    for path in glob.glob(os.path.join(ROOT, "deploy", "kubernetes", "*.yaml")):
        docs += [d for d in yaml.safe_load_all(open(path)) if d]
    for d in docs:
        spec = d.get("spec", {}).get("template", {}).get("spec", {})
        for ctr in spec.get("containers", []):
            image = ctr["image"].split(":")[0]
            kind = image.replace("concord-", "")
            if kind not in copied:
                c.check(False, "Kubernetes image %s is built by a Dockerfile here" % image)
                continue
            command = ctr.get("command")
            args = [str(a) for a in (command or []) + ctr.get("args", [])]
            programs = ([args[0]] if command else []) + (
                [args[args.index("--") + 1]] if "--" in args else [])
            c.check(all(os.path.basename(p) in copied[kind] for p in programs),
                    "Kubernetes %s %s runs programs of the %s image" % (
                        d["kind"], d["metadata"]["name"], kind),
                    "%s vs %s" % (programs, sorted(copied[kind])))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    args = parser.parse_args()
    c = Checks()
    daemon = subprocess.run(["docker", "info"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode == 0 if shutil.which(
                                "docker") else False
    print("NOTE: docker daemon %s; images are not built by this test" %
          ("reachable" if daemon else "not reachable"))
    executables = project_executables()
    deps = install_deps_packages()
    copied = {}
    for kind in sorted(EXPECTED):
        path = os.path.join(CONTAINERS, kind + ".Dockerfile")
        if not c.check(os.path.exists(path), "%s exists" % os.path.relpath(path, ROOT)):
            continue
        problems, copied[kind], stages = problems_of(path, kind, args.bin_dir, executables, deps)
        c.check(not problems, "%s.Dockerfile: stages, runtime packages, user, binaries and "
                "their libraries" % kind, "; ".join(problems))
        avail = subprocess.run(["apt-cache", "show", "--no-all-versions"] + apt_packages(
            stages[-1]), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60,
                               universal_newlines=True)
        c.check(avail.returncode == 0 and "E:" not in avail.stderr,
                "%s.Dockerfile: every runtime package exists in Debian 12" % kind,
                avail.stderr.strip()[:200])
        if kind == "coordinator":
            healthcheck(c, args.bin_dir, stages)
    kubernetes_uses(c, copied)

    # The checks can fail.
    d = tempfile.mkdtemp(prefix="concord-docker-bad-")
    try:
        text = open(os.path.join(CONTAINERS, "coordinator.Dockerfile")).read()
        for old, new in [("libsystemd0 ", "libsystemd0 g++ libtorch-dev "),
                         ("USER 65532:65532", "USER root"),
                         ("/src/build/bin/concordctl /usr/local/bin/",
                          "/src/build/bin/concordctl /src/build/bin/concord-run /usr/local/bin/")]:
            # Each break must land, or this check would pass on an unbroken copy.
            if old not in text:
                sys.exit("test_containers: cannot break coordinator.Dockerfile: no %r" % old)
            text = text.replace(old, new)
        bad = os.path.join(d, "coordinator.Dockerfile")
        open(bad, "w").write(text)
        shutil.copy(os.path.join(CONTAINERS, "coordinator.Dockerfile.dockerignore"), d)
        problems, _, _ = problems_of(bad, "coordinator", args.bin_dir, executables, deps)
        joined = "; ".join(problems)
        c.check("g++" in joined and "libtorch-dev" in joined and "runs as root" in joined and
                "concord-run, which the builder does not build" in joined,
                "a Dockerfile with g++/libtorch-dev in the runtime, USER root and an unbuilt "
                "binary is rejected", joined[:400])
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print("%d passed, %d failed" % (c.passed, c.failed))
    sys.exit(1 if c.failed else 0)


if __name__ == "__main__":
    main()

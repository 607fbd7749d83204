#!/usr/bin/python3
"""`cmake --install` and find_package(Concord), end to end.

    /usr/bin/python3 tests/integration/test_find_package.py --bin-dir build/bin \
        --build-dir build --source-dir . [--cmake cmake] [--keep]

1. Installs the build tree into a fresh temporary prefix
   (`cmake --install BUILD --prefix P`) and checks the layout: the four
   tools (and nothing else) in P/bin, libconcord.so in P/lib, the public
   headers (and nothing else) in P/include/concord, ConcordConfig.cmake,
   ConcordConfigVersion.cmake and the exported targets in
   P/lib/cmake/Concord; no installed header includes a gRPC, Protobuf,
   OpenSSL, Abseil or Gloo header, and no installed CMake file or header
   names the source or build tree or those packages.
2. Copies examples/find_package out of the source tree and, as root, in a
   mount namespace where gRPC's, OpenSSL's and Abseil's headers and CMake
   packages are hidden (empty directories mounted over them; Protobuf's
   too, unless LibTorch's own CMake package needs it, as Debian's LibTorch
   1.13 does — a probe project that only finds Torch decides), configures
   it with CMAKE_PREFIX_PATH=P only (package registry off,
   CMAKE_PREFIX_PATH and Concord_DIR cleared from the environment), checks
   that it found Concord in P and that no compile command names the source
   or build tree, and builds it with -Wall -Wextra -Werror. Not root: the
   build runs with everything visible and says so.
3. Runs it for real: P/bin/concord-run --standalone --nproc 2 (the
   installed launcher with its embedded coordinator) and two example
   processes, 40 steps. Both ranks must report world 2, a loss that fell
   below a fifth of the first step's, and bit-identical parameters (they
   started from different weights); one process alone with twice the batch
   must end with the same parameters (rtol 1e-5). A bad flag is one line on
   stderr and exit status 2.

Prints one line per check and a final 'N passed, N failed'; exits 1 on any
failure.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))

import fixtures  # noqa: E402
import processes  # noqa: E402

TOOLS = ["concord-coordinator", "concord-run", "concord-train", "concordctl"]
LIBS = ["libconcord.so"]
HEADERS = ["concord/concord.h", "concord/job.h", "concord/ddp.h",
           "concord/comm_hook.h", "concord/elastic.h", "concord/data.h",
           "concord/checkpoint.h",
           "concord/error.h", "concord/sync_batch_norm.h", "concord/zero.h",
           # Plain structs the library's own layers use too.
           "concord/ddp_options.h", "concord/slowmo_options.h",
           "concord/elastic_events.h", "concord/elastic_options.h",
           "concord/zero_options.h"]
# What a program built against the package must not need.
PRIVATE_INCLUDES = re.compile(
    r'#\s*include\s*[<"](grpc|grpcpp|grpc\+\+|google/protobuf|openssl|absl|'
    r'gloo|nccl|spdlog|worker/|common/|concord/v1/)')
PRIVATE_PACKAGES = ["gRPC", "Protobuf", "protobuf", "OpenSSL", "absl",
                    "Gloo", "spdlog", "NCCL"]
# Hidden from the example's build (those that exist on this machine).
HIDDEN = {
    "gRPC": ["/usr/include/grpc", "/usr/include/grpc++", "/usr/include/grpcpp",
             "/usr/lib/x86_64-linux-gnu/cmake/grpc"],
    "OpenSSL": ["/usr/include/openssl",
                "/usr/include/x86_64-linux-gnu/openssl"],
    "Abseil": ["/usr/include/absl", "/usr/lib/x86_64-linux-gnu/cmake/absl"],
    "Protobuf": ["/usr/include/google/protobuf",
                 "/usr/lib/x86_64-linux-gnu/cmake/protobuf"],
}
PACKAGE = ["ConcordConfig.cmake", "ConcordConfigVersion.cmake",
           "ConcordTargets.cmake"]
FINAL = re.compile(
    r"concord-example: rank (\d+) world (\d+) steps (\d+) first_loss (\S+) "
    r"last_loss (\S+) param_sum (\S+) param_sq_sum (\S+)")


def files_naming(root, needles):
    """Text files under root that contain one of needles."""
    hits = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            try:
                with open(path, errors="replace") as f:
                    text = f.read()
            except OSError:
                continue
            hits += ["%s names %s" % (path, n) for n in needles if n in text]
    return hits


def finals(output):
    return [m.groups() for m in FINAL.finditer(output)]


def check_install(checks, args, prefix):
    r = processes.run_command([args.cmake, "--install", args.build_dir,
                              "--prefix", prefix], timeout=120)
    if not checks.check(r.returncode == 0 and not r.timed_out,
                        "cmake --install", r.describe()):
        return False
    checks.ok("install took %.1f s" % r.elapsed)
    bins = sorted(os.listdir(os.path.join(prefix, "bin")))
    checks.check(bins == sorted(TOOLS), "bin/ holds the tools only",
                 "bin/ has %s" % bins)
    for tool in TOOLS:
        path = os.path.join(prefix, "bin", tool)
        checks.check(os.access(path, os.X_OK), "bin/%s executable" % tool,
                     "missing or not executable")
    missing = [p for p in
               ["lib/" + n for n in LIBS] +
               ["include/" + h for h in HEADERS] +
               ["lib/cmake/Concord/" + n for n in PACKAGE]
               if not os.path.isfile(os.path.join(prefix, p))]
    checks.check(not missing, "installed libraries, headers, package",
                 "missing: %s" % missing)
    needles = [os.path.realpath(args.source_dir) + "/",
               os.path.realpath(args.build_dir) + "/"]
    leaks = (files_naming(os.path.join(prefix, "lib", "cmake"), needles) +
             files_naming(os.path.join(prefix, "include"), needles))
    checks.check(not leaks, "installed package names no source/build path",
                 "; ".join(leaks[:5]))
    headers = []
    for dirpath, _, names in os.walk(os.path.join(prefix, "include")):
        headers += [os.path.relpath(os.path.join(dirpath, n),
                                    os.path.join(prefix, "include"))
                    for n in names]
    checks.check(sorted(headers) == sorted(HEADERS),
                 "include/ holds the public headers only",
                 "installed: %s" % sorted(headers))
    private = []
    for h in headers:
        with open(os.path.join(prefix, "include", h)) as f:
            private += ["%s: %s" % (h, m.group(0))
                        for m in PRIVATE_INCLUDES.finditer(f.read())]
    checks.check(not private, "public headers include only LibTorch's "
                 "and their own", "; ".join(private))
    package = files_naming(os.path.join(prefix, "lib", "cmake"),
                           ["find_dependency(%s" % p for p in PRIVATE_PACKAGES])
    checks.check(not package, "the package depends on LibTorch only",
                 "; ".join(package))
    return not missing


def hiding(dirs):
    """A command prefix that runs a command in a new mount namespace where
    `dirs` are empty; None when this process cannot make one."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return None
    propagation = "private"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private",
                            "true"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    if probe.returncode != 0:
        # In a chroot whose root is no mount point (the Debian 13 root of
        # scripts/debian13.sh) the root's propagation cannot be changed. The
        # mounts there are already private (that script's own namespace):
        # then the new namespace's mounts cannot reach the host. Where any
        # mount is shared, do not risk it.
        with open("/proc/self/mountinfo") as f:
            if "shared:" in f.read():
                return None
        propagation = "unchanged"
    mounts = " && ".join("mount -t tmpfs -o ro,size=4k concord-hidden %s" % d
                         for d in dirs)
    return ["unshare", "--mount", "--propagation", propagation, "sh", "-c",
            mounts + ' && exec "$@"', "hide"]


def hidden_dirs(checks, args, work):
    """The directories the example's build cannot see, and which packages
    they are."""
    names = ["gRPC", "OpenSSL", "Abseil", "Protobuf"]
    dirs = {n: [d for d in HIDDEN[n] if os.path.isdir(d)] for n in names}
    probe = os.path.join(work, "probe")
    os.makedirs(probe)
    with open(os.path.join(probe, "CMakeLists.txt"), "w") as f:
        f.write("cmake_minimum_required(VERSION 3.18)\n"
                "project(probe LANGUAGES CXX)\nfind_package(Torch REQUIRED)\n")
    prefix = hiding(sum(dirs.values(), []))
    if prefix is None:
        return names, []
    r = processes.run_command(prefix + [args.cmake, "-S", probe, "-B",
                                       os.path.join(probe, "build")],
                             timeout=120)
    if r.returncode != 0:
        checks.ok("LibTorch's own CMake package needs Protobuf here: "
                  "Protobuf stays visible")
        names.remove("Protobuf")
        del dirs["Protobuf"]
    return names, sum(dirs.values(), [])


def build_example(checks, args, prefix, work):
    src = os.path.join(work, "example-src")
    build = os.path.join(work, "example-build")
    shutil.copytree(os.path.join(args.source_dir, "examples", "find_package"),
                    src)
    configure = processes.example_configure(args.cmake, args.build_dir, src,
                                           build, prefix)
    configure.append("-DCMAKE_EXPORT_COMPILE_COMMANDS=ON")
    names, dirs = hidden_dirs(checks, args, work)
    prefix_cmd = hiding(dirs) or []
    what = ("with %s hidden" % ", ".join(names) if prefix_cmd else
            "with everything visible (not root: no mount namespace)")
    if prefix_cmd:
        # The hiding works: a file that includes a gRPC header does not
        # compile there.
        probe = os.path.join(work, "needs_grpc.cc")
        with open(probe, "w") as f:
            f.write("#include <grpcpp/grpcpp.h>\nint main() {}\n")
        compiler = processes.cmake_cache_value(args.build_dir,
                                              "CMAKE_CXX_COMPILER")
        r = processes.run_command(prefix_cmd + [compiler or "c++",
                                               "-fsyntax-only", probe],
                                 timeout=60)
        checks.check(r.returncode != 0 and "grpcpp" in r.stderr,
                     "hidden: #include <grpcpp/grpcpp.h> fails there",
                     r.describe())
    r = processes.run_command(prefix_cmd + configure, timeout=120)
    if not checks.check(r.returncode == 0 and not r.timed_out,
                        "example configures against the prefix " + what,
                        r.describe()):
        return None
    found = processes.cmake_cache_value(build, "Concord_DIR")
    expected = os.path.join(prefix, "lib", "cmake", "Concord")
    checks.check(os.path.realpath(found) == os.path.realpath(expected),
                 "Concord found in the prefix",
                 "Concord_DIR=%r, expected %r" % (found, expected))
    try:
        with open(os.path.join(build, "compile_commands.json")) as f:
            commands = " ".join(c["command"] for c in json.load(f))
    except (OSError, ValueError, KeyError) as e:
        checks.fail("compile commands", str(e))
        return None
    needles = [os.path.realpath(args.source_dir) + "/",
               os.path.realpath(args.build_dir) + "/"]
    leaks = [n for n in needles if n in commands]
    checks.check(not leaks, "example's compile command names no source/build "
                 "tree path", "found %s in: %s" % (leaks, commands))
    checks.check(os.path.join(prefix, "include") in commands,
                 "example includes P/include", commands)
    r = processes.run_command(prefix_cmd + [args.cmake, "--build", build,
                                           "--parallel", "1"], timeout=420)
    if not checks.check(r.returncode == 0 and not r.timed_out,
                        "example builds (-Wall -Wextra -Werror) " + what,
                        r.describe()):
        return None
    checks.ok("example built in %.1f s" % r.elapsed)
    return os.path.join(build, "concord-example")


def run_example(checks, prefix, example):
    launcher = os.path.join(prefix, "bin", "concord-run")
    r = processes.run_command([launcher, "--standalone", "--nproc", "2", "--",
                              example, "--steps", "40", "--batch-size", "16"],
                             timeout=120)
    if not checks.check(r.returncode == 0 and not r.timed_out,
                        "installed concord-run + 2 example processes",
                        r.describe()):
        return
    checks.ok("2 ranks trained in %.1f s" % r.elapsed)
    ranks = finals(r.stdout)
    if not checks.check(sorted(int(x[0]) for x in ranks) == [0, 1],
                        "both ranks finished", r.describe()):
        return
    for rank, world, steps, first, last, _, _ in ranks:
        checks.check(world == "2" and steps == "40",
                     "rank %s: world 2, 40 steps" % rank,
                     "world %s steps %s" % (world, steps))
        checks.check(float(last) < 0.2 * float(first),
                     "rank %s: loss fell (%s -> %s)" % (rank, first, last),
                     "first %s last %s" % (first, last))
    checks.check(ranks[0][5:] == ranks[1][5:],
                 "ranks end with identical parameters",
                 "rank sums %s vs %s" % (ranks[0][5:], ranks[1][5:]))
    alone = processes.run_command([example, "--steps", "40", "--batch-size",
                                  "32"], timeout=60)
    one = finals(alone.stdout)
    if not checks.check(alone.returncode == 0 and len(one) == 1 and
                        one[0][1] == "1", "one process alone, batch 32",
                        alone.describe()):
        return
    for i, name in [(5, "param_sum"), (6, "param_sq_sum")]:
        a, b = float(ranks[0][i]), float(one[0][i])
        checks.check(abs(a - b) <= 1e-5 * max(abs(a), abs(b), 1e-3),
                     "2 ranks x 16 = 1 process x 32 (%s)" % name,
                     "%r vs %r" % (a, b))
    bad = processes.run_command([example, "--steps", "zero"], timeout=60)
    lines = [x for x in bad.stderr.splitlines() if x.strip()]
    checks.check(bad.returncode == 2 and len(lines) == 1 and
                 "--steps" in lines[0], "bad flag: one line, exit 2",
                 bad.describe())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--build-dir", required=True)
    parser.add_argument("--source-dir", required=True)
    parser.add_argument("--cmake", default="cmake")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary prefix and example build")
    args = parser.parse_args()
    checks = fixtures.Checks()
    work = tempfile.mkdtemp(prefix="concord-install-")
    prefix = os.path.join(work, "prefix")
    try:
        if check_install(checks, args, prefix):
            example = build_example(checks, args, prefix, work)
            if example:
                run_example(checks, prefix, example)
    finally:
        if args.keep:
            print("kept %s" % work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())

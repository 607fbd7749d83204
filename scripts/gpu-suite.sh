#!/usr/bin/env bash
# Builds Concord on a GPU machine that has no package registry, against the
# machine's pip PyTorch (LibTorch, CUDA, NCCL), and runs its GPU suite:
# ctest -L 'gpu|multigpu', then the GPU benchmarks. Run it as root, from a
# working tree that carries .gpu-deps (made here, where Debian's registry is
# reachable, by scripts/gpu-deps.sh; docs/gpu.md, "Running the GPU suite").
#
#   ./scripts/gpu-suite.sh [--deps DIR] [--build-dir DIR] [--jobs N] [--no-bench]
#                          [--ctest-jobs N] [--time-limit S] [--bench-only RE]
#                          [--tests RE]
#                          [--unpack-only | --configure-only] [--help]
#
#   --deps DIR       the .debs and manifest.txt from gpu-deps.sh (.gpu-deps/debs)
#   --build-dir DIR  the build directory (build-gpu)
#   --jobs N         parallel build jobs (every core)
#   --ctest-jobs N   ctest -j N (1); the tests count 2 processors each, so
#                    N/2 of them share the GPU at a time
#   --time-limit S   finish within S seconds of starting (none): ctest stops
#                    starting tests and cuts their timeouts at the deadline
#                    (--stop-time), each benchmark gets what is left, and a
#                    benchmark with under 30 s left is not started. For a
#                    machine lent by the minute: what ran is reported.
#   --tests RE       run only the gpu/multigpu tests whose name matches the
#                    regular expression RE (ctest -R; all of them)
#   --no-bench       run the tests only
#   --bench-only RE  run only the benchmarks whose command line matches the
#                    extended regular expression RE (e.g. 'kernels|syncbn')
#   --unpack-only    unpack the packages into the prefix, check them, stop
#   --configure-only stop after configuring
#
# Relative paths, in options and in the environment, are taken from the
# repository root.
#
# Environment:
#   GPU_SUITE_PYTHON     the python whose torch to build against (python3)
#   GPU_SUITE_OUT        results (./gpu-suite-out): summary.txt, configure.log,
#                        build.log, ctest.log, ctest-full.log (every test's
#                        output, passed ones too), bench.log (six files, for
#                        callers that bring back only a few)
#   CONCORD_DEPS_PREFIX  where the packages are unpacked (/tmp/concord-deps)
#   CONCORD_GLOO_FROM_TORCH  ON or OFF instead of the choice in trap 1 (AUTO)
#   NCCL_ROOT            an NCCL with include/ and lib/ instead of pip's
#
# Exits non-zero, with a one-line reason (also at the end of summary.txt),
# when anything is missing or any step or test fails. A target that fails to
# build does not stop the suite (ninja -k 0): the tests that built still run,
# so that one compile error does not cost a whole lease; the suite then fails
# with "build failed".
#
# The traps of building against pip's LibTorch, and what is done about each:
#
# 1. Gloo. Concord links Gloo itself; pip's LibTorch carries its own Gloo
#    inside libtorch_cpu.so (built static, default visibility, so its gloo::
#    symbols are exported; GLOO_INSTALL OFF in PyTorch's
#    cmake/Dependencies.cmake, and its setup.py lists no gloo headers for the
#    wheel). Two Gloos in a process share symbol names, and the first loaded
#    wins for every caller. So: where the wheel has Gloo's headers
#    (torch/include/gloo/config.h) and libtorch_cpu.so exports gloo::
#    symbols, Concord uses that Gloo (-DCONCORD_GLOO_FROM_TORCH=ON: one Gloo);
#    otherwise Debian's libgloo from the prefix, which CMake links ahead of
#    LibTorch so that Concord's calls reach the Gloo its headers describe.
#    See Note [Gloo next to pip's LibTorch] in cmake/ConcordGloo.cmake.
# 2. protobuf. LibTorch builds protobuf into libtorch_cpu.so with
#    -fvisibility=hidden (PyTorch's cmake/ProtoBuf.cmake, with
#    CAFFE2_LINK_LOCAL_PROTOBUF, on by default), so Debian's libprotobuf, which
#    gRPC and Concord's messages use, never meets it. Inline functions of
#    LibTorch's protobuf headers, instantiated in its own code, may still be
#    exported: the script reports how many; Concord's executables load
#    Debian's libprotobuf ahead of LibTorch, so Debian's definitions win.
# 3. The C++ ABI. Debian's libraries use the C++11 ABI (std::__cxx11::string);
#    a LibTorch built with _GLIBCXX_USE_CXX11_ABI=0 cannot link with them.
#    pip's wheels use the C++11 ABI since PyTorch 2.7 (manylinux_2_28): the
#    script prints torch._C._GLIBCXX_USE_CXX11_ABI and stops if it is False.
# 4. Debian 12's binaries need glibc 2.34 and libstdc++ with GLIBCXX_3.4.30
#    (GCC 12): checked first.
# 5. Nothing is installed into /: each .deb is unpacked (dpkg-deb -x) into the
#    prefix; what names /usr absolutely is rewritten to the prefix (imported
#    locations in CMake packages, such as Debian's Gloo targets; pkg-config
#    files; absolute symlinks such as libz.so), and the prefix's multiarch
#    include directory (openssl/configuration.h) is a system include
#    directory of every compile. protoc and pkg-config run
#    through wrappers that set LD_LIBRARY_PATH (protoc hands it on to
#    grpc_cpp_plugin). Test programs and benchmarks run with LD_LIBRARY_PATH
#    naming the prefix, and gtest's test discovery runs at ctest time
#    (PRE_TEST), so the build itself never runs with it: the image's
#    compilers keep their own zlib and OpenSSL.
# 6. NCCL comes from pip's nvidia-nccl package (found under the python's
#    nvidia/ package), the library LibTorch loads; its lib/ has libnccl.so.2
#    only, so both paths are passed to CMake.
# 7. A test labelled gpu that skips ("CONCORD_TEST_SKIPPED: no CUDA device") fails the
#    suite: on a GPU machine a skip means the device could not be used.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

# GPU benchmarks: command lines (from the repository root; $PY, $BIN and
# $NCCL_WORLD are set when they run: the python, <build>/bin, and the ranks
# for NCCL, one per GPU, at least 1), run after the tests in this order (the
# cheapest first, then the DDP comparisons), each with 600 s at most.
# Both sides of each comparison come from one run (bench/CMakeLists.txt).
GPU_BENCHES=(
  '"$BIN/concord-bench-kernels-gpu"'
  '"$PY" bench/ddp_vs_pytorch.py --bin-dir "$BIN" --device cuda --backend nccl --world-size "$NCCL_WORLD" --kind resnet50 --batch-size 64 --samples $((NCCL_WORLD * 64 * 40))'
  '"$PY" bench/ddp_vs_pytorch.py --bin-dir "$BIN" --device cuda --backend nccl --world-size "$NCCL_WORLD" --kind mlp-350m --batch-size 32 --samples $((NCCL_WORLD * 32 * 40))'
  '"$PY" bench/syncbn_vs_pytorch.py --bin-dir "$BIN" --device cuda --backend nccl --world-size "$NCCL_WORLD"'
  '"$PY" bench/syncbn_vs_pytorch.py --bin-dir "$BIN" --device cuda --backend nccl --world-size "$NCCL_WORLD" --dtype bfloat16 --channels-last'
  '"$PY" bench/syncbn_vs_pytorch.py --bin-dir "$BIN" --device cuda:0 --backend gloo --world-size 2'
  '"$PY" bench/zero_vs_ddp.py --bin-dir "$BIN" --device cuda:0 --backend gloo --world-size 2 --steps 20 --repeat 1'
)

DEPS=.gpu-deps/debs
BUILD_DIR=build-gpu
JOBS=$(nproc)
CTEST_JOBS=1
TIME_LIMIT=""
BENCH=1
BENCH_ONLY=""
TESTS_ONLY=""
UNPACK_ONLY=0
CONFIGURE_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --deps)
      DEPS=${2:?--deps needs a directory}
      shift 2
      ;;
    --build-dir)
      BUILD_DIR=${2:?--build-dir needs a directory}
      shift 2
      ;;
    --jobs)
      JOBS=${2:?--jobs needs a number}
      shift 2
      ;;
    --ctest-jobs)
      CTEST_JOBS=${2:?--ctest-jobs needs a number}
      shift 2
      ;;
    --time-limit)
      TIME_LIMIT=${2:?--time-limit needs a number of seconds}
      shift 2
      ;;
    --no-bench)
      BENCH=0
      shift
      ;;
    --bench-only)
      BENCH_ONLY=${2:?--bench-only needs a regular expression}
      shift 2
      ;;
    --tests)
      TESTS_ONLY=${2:?--tests needs a regular expression}
      shift 2
      ;;
    --unpack-only)
      UNPACK_ONLY=1
      shift
      ;;
    --configure-only)
      CONFIGURE_ONLY=1
      shift
      ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "gpu-suite: unknown argument $1 (see --help)" >&2
      exit 2
      ;;
  esac
done
for n in "--jobs:$JOBS" "--ctest-jobs:$CTEST_JOBS" "--time-limit:${TIME_LIMIT:-0}"; do
  case "${n#*:}" in
    '' | *[!0-9]*) echo "gpu-suite: ${n%%:*} ${n#*:}: expected a number" >&2 && exit 2 ;;
  esac
done
# The deadline, in seconds since the epoch (empty: none).
DEADLINE=""
[ -z "$TIME_LIMIT" ] || DEADLINE=$(($(date +%s) + TIME_LIMIT))
seconds_left() { echo $((DEADLINE - $(date +%s))); }

PY=${GPU_SUITE_PYTHON:-python3}
OUT_DIR=${GPU_SUITE_OUT:-./gpu-suite-out}
PREFIX=${CONCORD_DEPS_PREFIX:-/tmp/concord-deps}
GLOO_MODE=${CONCORD_GLOO_FROM_TORCH:-AUTO}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
SUMMARY=$OUT_DIR/summary.txt
: >"$SUMMARY"

note() {
  echo "gpu-suite: $*"
  echo "$*" >>"$SUMMARY"
}
fail() {
  echo "gpu-suite: $*" >&2
  echo "FAILED: $*" >>"$SUMMARY"
  exit 1
}

# ---- the packages --------------------------------------------------------

case "$PREFIX" in
  /*) ;;
  *) fail "CONCORD_DEPS_PREFIX=$PREFIX: expected an absolute path" ;;
esac
case "$PREFIX" in
  *[[:space:]#]*) fail "CONCORD_DEPS_PREFIX=$PREFIX: no spaces or '#', please" ;;
esac
PREFIX=$(realpath -m "$PREFIX")
case "$PREFIX" in
  / | /usr | /usr/local | /opt | /lib | /etc) fail "refusing to unpack Debian's packages into $PREFIX" ;;
esac
LIBDIRS=$PREFIX/usr/lib/x86_64-linux-gnu:$PREFIX/lib/x86_64-linux-gnu:$PREFIX/usr/lib
PKGCONFIG_DIRS=$PREFIX/usr/lib/x86_64-linux-gnu/pkgconfig:$PREFIX/usr/lib/pkgconfig:$PREFIX/usr/share/pkgconfig

[ -f "$DEPS/manifest.txt" ] ||
  fail "no packages in $DEPS: run scripts/gpu-deps.sh where a registry is reachable, then carry .gpu-deps"
debs=()
while read -r name _ file; do
  [ -f "$DEPS/$file" ] || fail "$DEPS lacks $file ($name, in its manifest): run scripts/gpu-deps.sh again"
  debs+=("$DEPS/$file")
done < <(grep -v '^#' "$DEPS/manifest.txt")
[ ${#debs[@]} -gt 0 ] || fail "$DEPS/manifest.txt names no packages: run scripts/gpu-deps.sh again"

unpack_deb() { # DEB: its files into $PREFIX
  if command -v dpkg-deb >/dev/null 2>&1; then
    dpkg-deb -x "$1" "$PREFIX"
  else
    local tmp
    tmp=$(mktemp -d)
    (cd "$tmp" && ar x "$1" && tar -xf data.tar.* -C "$PREFIX")
    rm -rf "$tmp"
  fi
}

unpack() {
  command -v dpkg-deb >/dev/null 2>&1 || command -v ar >/dev/null 2>&1 ||
    fail "neither dpkg-deb nor ar is here to unpack .deb files"
  if [ -e "$PREFIX" ] && [ ! -f "$PREFIX/.concord-deps" ]; then
    fail "$PREFIX exists and was not made by gpu-suite.sh: set CONCORD_DEPS_PREFIX elsewhere"
  fi
  rm -rf "$PREFIX"
  mkdir -p "$PREFIX"
  touch "$PREFIX/.concord-deps"
  local deb
  for deb in "${debs[@]}"; do unpack_deb "$(realpath "$deb")"; done

  # Absolute symlinks (zlib1g-dev's libz.so -> /lib/...) into the prefix.
  local link
  while IFS= read -r link; do
    ln -sfn "$PREFIX$(readlink "$link")" "$link"
  done < <(find "$PREFIX" -type l -lname '/*')
  # pkg-config files: prefix=/usr and the like.
  find "$PREFIX" -name '*.pc' -exec sed -i -E \
    -e "s#^([A-Za-z_]+=)/usr#\1$PREFIX/usr#" \
    -e "s#([[:space:]]-[IL])/usr/#\1$PREFIX/usr/#g" {} +
  # CMake packages that import files by absolute path (Debian's Gloo).
  find "$PREFIX" -name '*.cmake' -exec sed -i -E \
    "/IMPORTED_LOCATION|_cmake_import_check_files_for_/ s#\"/usr/#\"$PREFIX/usr/#g" {} +

  # protoc and pkg-config with their libraries from the prefix.
  mkdir -p "$PREFIX/wrap"
  cat >"$PREFIX/wrap/protoc" <<EOF
#!/bin/sh
# gpu-suite.sh: Debian's protoc with its libraries from $PREFIX (plugins it
# starts, grpc_cpp_plugin, inherit them).
LD_LIBRARY_PATH="$LIBDIRS\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
exec "$PREFIX/usr/bin/protoc" "\$@"
EOF
  cat >"$PREFIX/wrap/pkg-config" <<EOF
#!/bin/sh
# gpu-suite.sh: Debian's pkgconf with its library from $PREFIX, looking there
# first.
LD_LIBRARY_PATH="$LIBDIRS\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
PKG_CONFIG_PATH="$PKGCONFIG_DIRS\${PKG_CONFIG_PATH:+:\$PKG_CONFIG_PATH}"
export LD_LIBRARY_PATH PKG_CONFIG_PATH
exec "$PREFIX/usr/bin/pkgconf" "\$@"
EOF
  chmod +x "$PREFIX/wrap/protoc" "$PREFIX/wrap/pkg-config"
}

check_prefix() {
  local arch=$PREFIX/usr/lib/x86_64-linux-gnu f
  for f in \
    "$arch/cmake/grpc/gRPCConfig.cmake" "$arch/cmake/absl/abslConfig.cmake" \
    "$arch/cmake/GTest/GTestConfig.cmake" "$arch/cmake/benchmark/benchmarkConfig.cmake" \
    "$arch/cmake/spdlog/spdlogConfig.cmake" "$arch/cmake/fmt/fmt-config.cmake" \
    "$arch/cmake/prometheus-cpp/prometheus-cpp-config.cmake" \
    "$arch/cmake/civetweb/civetweb-config.cmake" \
    "$PREFIX/usr/share/cmake/CLI11/CLI11Config.cmake" \
    "$PREFIX/usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake" \
    "$PREFIX/usr/share/cmake/Gloo/GlooConfig.cmake" "$PREFIX/usr/lib/libgloo.so.0" \
    "$arch/pkgconfig/libsystemd.pc" "$arch/libz.so" "$arch/libssl.so" \
    "$PREFIX/usr/include/google/protobuf/message.h" \
    "$PREFIX/usr/bin/protoc" "$PREFIX/usr/bin/grpc_cpp_plugin"; do
    [ -e "$f" ] || fail "the unpacked packages lack $f: run scripts/gpu-deps.sh again"
  done
  # Every library and program of the prefix must find what it links, from
  # the prefix or from this system; libcurl, and prometheus-cpp's push
  # library that links it, are never linked by Concord (scripts/gpu-deps.sh
  # carries libcurl without its dependencies).
  local missing=""
  while IFS= read -r f; do
    case "$(basename "$f")" in libcurl* | libprometheus-cpp-push*) continue ;; esac
    head -c 4 "$f" | grep -q 'ELF' || continue
    if LD_LIBRARY_PATH=$LIBDIRS ldd "$f" 2>/dev/null | grep -q 'not found'; then
      missing+=" $(basename "$f") ($(LD_LIBRARY_PATH=$LIBDIRS ldd "$f" | awk '/not found/ {print $1}' | sort -u | tr '\n' ' '))"
    fi
  done < <(find "$PREFIX/usr/bin" "$PREFIX/usr/lib" "$PREFIX/lib" -type f \( -name '*.so*' -o -perm -u+x \))
  [ -z "$missing" ] || fail "libraries missing for:$missing"
  local v
  v=$("$PREFIX/wrap/protoc" --version) || fail "Debian's protoc does not run here"
  note "protoc: $v; pkg-config: libsystemd $("$PREFIX/wrap/pkg-config" --modversion libsystemd)"
}

# The commit, and whether the tree differs from it (a copy of a working tree
# may carry a .git that is not the tree's own).
commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ "$commit" != unknown ] && [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  commit="$commit, the tree differing from it"
fi
note "Concord GPU suite, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $commit"
note "packages: ${#debs[@]} from $DEPS, unpacked into $PREFIX"
unpack
check_prefix
if [ "$UNPACK_ONLY" = 1 ]; then
  note "unpacked; to use the prefix by hand:"
  note "  CMAKE_PREFIX_PATH=$PREFIX/usr  PKG_CONFIG_PATH=$PKGCONFIG_DIRS"
  note "  -DProtobuf_PROTOC_EXECUTABLE=$PREFIX/wrap/protoc -DPKG_CONFIG_EXECUTABLE=$PREFIX/wrap/pkg-config"
  note "  LD_LIBRARY_PATH=$LIBDIRS (for running)"
  exit 0
fi

# ---- the machine ---------------------------------------------------------

version_at_least() { # HAVE WANT
  [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]
}
glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
[ -n "$glibc" ] || fail "cannot tell this system's glibc version (getconf GNU_LIBC_VERSION)"
version_at_least "$glibc" 2.34 || fail "glibc $glibc: Debian 12's libraries need 2.34 or newer"

CXX=${CXX:-$(command -v c++ || command -v g++ || true)}
[ -n "$CXX" ] || fail "no C++ compiler (c++ or g++; or set CXX)"
libstdcxx=$("$CXX" -print-file-name=libstdc++.so.6)
grep -qa GLIBCXX_3.4.30 "$libstdcxx" 2>/dev/null ||
  fail "$libstdcxx lacks GLIBCXX_3.4.30: Debian 12's libraries need GCC 12's libstdc++ or newer"

NVCC=${CUDACXX:-$(command -v nvcc || true)}
[ -n "$NVCC" ] || [ ! -x /usr/local/cuda/bin/nvcc ] || NVCC=/usr/local/cuda/bin/nvcc
[ -n "$NVCC" ] || fail "no nvcc (the CUDA toolkit): Concord's kernels need it (or set CUDACXX)"

command -v "$PY" >/dev/null 2>&1 || fail "no $PY: set GPU_SUITE_PYTHON to the python that has torch"
PY=$(command -v "$PY")
PYBIN=$(dirname "$PY")
find_tool() { # NAME: on PATH, else next to the python (pip's cmake and ninja)
  command -v "$1" 2>/dev/null || { [ -x "$PYBIN/$1" ] && echo "$PYBIN/$1"; } || true
}
CMAKE=$(find_tool cmake)
CTEST=$(find_tool ctest)
NINJA=$(find_tool ninja)
[ -n "$CMAKE" ] || fail "no cmake on PATH or next to $PY"
[ -n "$CTEST" ] || fail "no ctest on PATH or next to $PY"
[ -n "$NINJA" ] || fail "no ninja on PATH or next to $PY"
command -v nm >/dev/null 2>&1 || fail "no nm (binutils): needed to inspect libtorch_cpu.so"

torch_info=$("$PY" - <<'EOF'
import os
import sys

try:
    import torch
    import torch.utils
except Exception as e:  # noqa: BLE001 - any import failure means: no torch
    print("error=%s" % e)
    sys.exit(3)
print("version=%s" % torch.__version__)
print("cuda=%s" % torch.version.cuda)
print("abi=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI))
print("cmake_prefix=%s" % torch.utils.cmake_prefix_path)
print("torch_dir=%s" % os.path.dirname(torch.__file__))
print("devices=%d" % torch.cuda.device_count())
# pip's NCCL: nvidia/nccl/{include,lib} (the library libtorch_cuda.so loads
# through its RUNPATH), else the first nccl.h and libnccl.so.2 under nvidia/.
inc, lib = "", ""
try:
    import nvidia
    bases = sorted(nvidia.__path__)
except ImportError:
    bases = []
for base in bases:
    d = os.path.join(base, "nccl")
    if os.path.isfile(os.path.join(d, "include", "nccl.h")) and \
            os.path.isfile(os.path.join(d, "lib", "libnccl.so.2")):
        inc, lib = os.path.join(d, "include"), os.path.join(d, "lib", "libnccl.so.2")
        break
for base in bases if not lib else []:
    for top, dirs, files in os.walk(base):
        dirs.sort()
        if "nccl.h" in files and not inc:
            inc = top
        if "libnccl.so.2" in files and not lib:
            lib = os.path.join(top, "libnccl.so.2")
print("nccl_include=%s" % inc)
print("nccl_library=%s" % lib)
try:
    print("nccl_torch=%s" % ".".join(map(str, torch.cuda.nccl.version())))
except Exception:  # noqa: BLE001 - a LibTorch without NCCL says nothing
    print("nccl_torch=unknown")
EOF
) || fail "$PY cannot import torch${torch_info:+ (${torch_info#error=})}: set GPU_SUITE_PYTHON to the python that has it"
declare -A T=()
while IFS='=' read -r k v; do T[$k]=$v; done <<<"$torch_info"

note "python: $PY; torch ${T[version]}, CUDA ${T[cuda]}, ${T[devices]} device(s)"
note "torch._C._GLIBCXX_USE_CXX11_ABI: ${T[abi]}"
[ "${T[abi]}" = 1 ] ||
  fail "torch ${T[version]} uses the pre-C++11 ABI (_GLIBCXX_USE_CXX11_ABI=0); Debian's gRPC, abseil and the rest use the C++11 ABI: use a PyTorch 2.7 or newer wheel"
[ "${T[cuda]}" != None ] || fail "torch ${T[version]} at ${T[torch_dir]} has no CUDA"
[ -f "${T[cmake_prefix]}/Torch/TorchConfig.cmake" ] ||
  fail "no Torch/TorchConfig.cmake under torch.utils.cmake_prefix_path (${T[cmake_prefix]})"

NCCL_INC=${T[nccl_include]}
NCCL_LIB=${T[nccl_library]}
if [ -n "${NCCL_ROOT:-}" ]; then
  NCCL_INC=$NCCL_ROOT/include
  NCCL_LIB=""
  for f in "$NCCL_ROOT/lib/libnccl.so.2" "$NCCL_ROOT/lib/libnccl.so"; do
    if [ -z "$NCCL_LIB" ] && [ -f "$f" ]; then NCCL_LIB=$f; fi
  done
fi
if [ ! -f "$NCCL_INC/nccl.h" ] || [ -z "$NCCL_LIB" ]; then
  fail "no NCCL (nccl.h and libnccl.so.2) in pip's nvidia packages: set NCCL_ROOT to one with include/ and lib/"
fi
nccl_header=$(awk '/^#define NCCL_(MAJOR|MINOR|PATCH) / {v = v (v ? "." : "") $3} END {print v}' "$NCCL_INC/nccl.h")
note "NCCL: $NCCL_INC/nccl.h ($nccl_header), $NCCL_LIB; torch's NCCL: ${T[nccl_torch]}"
[ "$nccl_header" = "${T[nccl_torch]}" ] || [ "${T[nccl_torch]}" = unknown ] ||
  note "note: nccl.h is $nccl_header, torch reports NCCL ${T[nccl_torch]}: Concord links $NCCL_LIB"

torch_cpu=${T[torch_dir]}/lib/libtorch_cpu.so
[ -f "$torch_cpu" ] || fail "no $torch_cpu"
dynsyms=$(nm -D --defined-only "$torch_cpu") || fail "nm cannot read $torch_cpu"
gloo_syms=$(grep -c ' _ZN4gloo' <<<"$dynsyms" || true)
protobuf_syms=$(grep -c ' _ZN6google8protobuf' <<<"$dynsyms" || true)
unset dynsyms
torch_gloo_headers=no
[ -f "${T[torch_dir]}/include/gloo/config.h" ] && torch_gloo_headers=yes
note "libtorch_cpu.so exports $gloo_syms gloo:: and $protobuf_syms google::protobuf:: symbols; the wheel has Gloo headers: $torch_gloo_headers"
case "$GLOO_MODE" in
  AUTO)
    if [ "$torch_gloo_headers" = yes ] && [ "$gloo_syms" -gt 0 ]; then
      GLOO_FROM_TORCH=ON
    else
      GLOO_FROM_TORCH=OFF
    fi
    ;;
  ON | OFF) GLOO_FROM_TORCH=$GLOO_MODE ;;
  *) fail "CONCORD_GLOO_FROM_TORCH=$GLOO_MODE: expected ON, OFF or AUTO" ;;
esac
if [ "$GLOO_FROM_TORCH" = ON ]; then
  note "Gloo: LibTorch's own (CONCORD_GLOO_FROM_TORCH=ON)"
else
  note "Gloo: Debian's libgloo from the prefix, linked ahead of LibTorch (CONCORD_GLOO_FROM_TORCH=OFF)"
fi
# Inline functions of LibTorch's protobuf headers, instantiated in its own
# code, can be exported even so; Concord's executables load Debian's
# libprotobuf ahead of LibTorch, so Debian's definitions win for them.
[ "$protobuf_syms" -eq 0 ] ||
  note "note: libtorch_cpu.so exports $protobuf_syms google::protobuf symbols; Debian's libprotobuf is loaded ahead of it"

# shellcheck source=/dev/null
note "system: $(. /etc/os-release && echo "${PRETTY_NAME:-unknown}"), glibc $glibc, $("$CXX" --version | head -1)"
note "nvcc: $("$NVCC" --version | tail -1); cmake: $("$CMAKE" --version | head -1)"
if command -v nvidia-smi >/dev/null 2>&1; then
  while IFS= read -r gpu; do note "device: $gpu"; done < <(nvidia-smi -L 2>&1)
fi

# ---- configure, build ------------------------------------------------------

# CMake 4 refuses packages that declare policies older than 3.5 unless told.
export CMAKE_POLICY_VERSION_MINIMUM=3.5
# LibTorch's CMake package would otherwise probe the device for its flags.
export TORCH_CUDA_ARCH_LIST=9.0
export PKG_CONFIG_PATH=$PKGCONFIG_DIRS${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}

note "configure: $BUILD_DIR (log configure.log)"
if ! "$CMAKE" -S "$ROOT" -B "$BUILD_DIR" -G Ninja \
  -DCMAKE_MAKE_PROGRAM="$NINJA" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER="$CXX" \
  -DCMAKE_CUDA_COMPILER="$NVCC" \
  -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_LIBRARY_ARCHITECTURE=x86_64-linux-gnu \
  -DCMAKE_PREFIX_PATH="$PREFIX/usr;${T[cmake_prefix]}" \
  -DCMAKE_C_STANDARD_INCLUDE_DIRECTORIES="$PREFIX/usr/include/x86_64-linux-gnu" \
  -DCMAKE_CXX_STANDARD_INCLUDE_DIRECTORIES="$PREFIX/usr/include/x86_64-linux-gnu" \
  -DProtobuf_PROTOC_EXECUTABLE="$PREFIX/wrap/protoc" \
  -DPKG_CONFIG_EXECUTABLE="$PREFIX/wrap/pkg-config" \
  -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST \
  -DCONCORD_WITH_CUDA=ON -DCONCORD_WITH_NCCL=ON \
  -DNCCL_INCLUDE_DIR="$NCCL_INC" -DNCCL_LIBRARY="$NCCL_LIB" \
  -DCONCORD_GLOO_FROM_TORCH="$GLOO_FROM_TORCH" \
  -DCONCORD_BUILD_TESTS=ON -DCONCORD_BUILD_BENCH=ON \
  -DCONCORD_CUDA_PYTHON="$PY" -DCONCORD_TORCH_PYTHON="$PY" \
  >"$OUT_DIR/configure.log" 2>&1; then
  tail -30 "$OUT_DIR/configure.log" >&2
  fail "configure failed (configure.log)"
fi
grep 'Concord:' "$OUT_DIR/configure.log" | sed 's/^-- //' | while IFS= read -r line; do note "$line"; done
if [ "$CONFIGURE_ONLY" = 1 ]; then
  note "configured (--configure-only)"
  exit 0
fi

note "build: $JOBS jobs (log build.log)"
start=$SECONDS
build_rc=0
"$CMAKE" --build "$BUILD_DIR" -j "$JOBS" -- -k 0 >"$OUT_DIR/build.log" 2>&1 || build_rc=$?
if [ "$build_rc" -ne 0 ]; then
  grep -E 'error|Error|FAILED' "$OUT_DIR/build.log" | head -40 >&2 || true
  note "build FAILED after $((SECONDS - start)) s: $(grep -c '^FAILED: ' "$OUT_DIR/build.log" || true) target(s) (build.log); running the tests that built"
else
  note "built in $((SECONDS - start)) s"
fi

# ---- tests, benchmarks -----------------------------------------------------

# The examples' GPU tests read Fashion-MNIST from the build tree where the
# system has none (gpu-deps.sh carries a subset beside the packages).
data=$(dirname "$DEPS")/datasets/fashion-mnist
if [ ! -d /usr/share/datasets/fashion-mnist ] && [ -d "$data" ]; then
  mkdir -p "$BUILD_DIR/datasets"
  rm -rf "$BUILD_DIR/datasets/fashion-mnist"
  cp -r "$data" "$BUILD_DIR/datasets/"
  note "Fashion-MNIST: $data copied into $BUILD_DIR/datasets"
fi

export LD_LIBRARY_PATH=$LIBDIRS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
ctest_args=(-L 'gpu|multigpu' --output-on-failure --timeout 600 --no-tests=error -j "$CTEST_JOBS")
[ -z "$TESTS_ONLY" ] || ctest_args+=(-R "$TESTS_ONLY")
if [ -n "$DEADLINE" ]; then
  # ctest's --stop-time is a time of day on this machine's clock.
  ctest_args+=(--stop-time "$(date -d "@$DEADLINE" +%H:%M:%S)")
  note "ctest -L 'gpu|multigpu' -j $CTEST_JOBS, stopping at $(date -d "@$DEADLINE" +%H:%M:%S) ($(seconds_left) s left; log ctest.log)"
else
  note "ctest -L 'gpu|multigpu' -j $CTEST_JOBS (log ctest.log)"
fi
set +e
(cd "$BUILD_DIR" && "$CTEST" "${ctest_args[@]}") 2>&1 | tee "$OUT_DIR/ctest.log"
ctest_rc=${PIPESTATUS[0]}
set -e
cp "$BUILD_DIR/Testing/Temporary/LastTest.log" "$OUT_DIR/ctest-full.log" 2>/dev/null || true
grep -E 'tests passed|tests failed' "$OUT_DIR/ctest.log" | while IFS= read -r line; do note "$line"; done
skipped=$(sed -n -E 's/.*Test +#[0-9]+: ([^ ]+) .*\*\*\*Skipped.*/\1/p' "$OUT_DIR/ctest.log" | sort -u)
gpu_tests=$(cd "$BUILD_DIR" && "$CTEST" -N -L '^gpu$' | sed -n -E 's/^ *Test +#[0-9]+: (.*)$/\1/p' | sort -u)
skipped_gpu=$(comm -12 <(echo "$skipped") <(echo "$gpu_tests") | tr '\n' ' ')
[ -z "$skipped" ] || note "skipped: $(echo "$skipped" | tr '\n' ' ')"

bench_rc=0
: >"$OUT_DIR/bench.log"
if [ "$BENCH" = 0 ]; then
  note "benchmarks: not run (--no-bench)"
else
  BIN=$BUILD_DIR/bin
  NCCL_WORLD=$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))' 2>/dev/null || echo 1)
  export PY BIN NCCL_WORLD
  for b in "${GPU_BENCHES[@]}"; do
    if [ -n "$BENCH_ONLY" ] && ! grep -Eq -- "$BENCH_ONLY" <<<"$b"; then
      note "benchmark not selected by --bench-only: $b"
      continue
    fi
    limit=600
    if [ -n "$DEADLINE" ]; then
      left=$(seconds_left)
      if [ "$left" -lt 30 ]; then
        note "benchmark not run ($left s left of --time-limit): $b"
        bench_rc=1
        continue
      fi
      [ "$left" -ge "$limit" ] || limit=$left
    fi
    echo "==== $b (limit $limit s)" >>"$OUT_DIR/bench.log"
    start=$SECONDS
    if timeout "$limit" bash -c "$b" >>"$OUT_DIR/bench.log" 2>&1; then
      note "benchmark ran in $((SECONDS - start)) s: $b (bench.log)"
    else
      note "benchmark failed after $((SECONDS - start)) s: $b (bench.log)"
      bench_rc=1
    fi
  done
fi

[ "$build_rc" -eq 0 ] || fail "build failed (build.log)"
[ "$ctest_rc" -eq 0 ] || fail "ctest failed (ctest.log)"
[ -z "$skipped_gpu" ] || fail "gpu tests skipped on this machine (no usable device?): $skipped_gpu"
[ "$bench_rc" -eq 0 ] || fail "a benchmark failed (bench.log)"
note "PASSED"

#!/usr/bin/env bash
# Configures and builds Concord into ${BUILD_DIR:-build} (executables in
# build/bin). Extra arguments go to CMake's configure step; TARGETS (a
# space-separated list) builds only those targets.
#
# Compiles go through ccache when it is installed (CONCORD_CCACHE=0: never),
# with its cache outside the clone (CONCORD_CCACHE_DIR, default
# /var/cache/concord/ccache; inside the Debian 13 root that path is the
# root's own, so each platform keeps its cache). Paths are hashed relative to
# the checkout, so a fresh clone anywhere hits what an earlier one compiled:
# CI's two builds of LibTorch translation units are most of its time.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
launcher=()
if [ "${CONCORD_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null; then
  export CCACHE_DIR=${CONCORD_CCACHE_DIR:-/var/cache/concord/ccache}
  mkdir -p "$CCACHE_DIR"
  # The settings travel in the launcher, so that `cmake --build` by hand and
  # the examples the install tests build (processes.example_configure, with
  # their own base folder) use the same cache. Sloppiness: CMake's
  # precompiled headers (ccache's manual, "Precompiled headers").
  cc="env;CCACHE_DIR=$CCACHE_DIR;CCACHE_BASEDIR=$PWD;CCACHE_NOHASHDIR=1"
  cc+=";CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-8G}"
  cc+=";CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime;ccache"
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER="$cc" -DCMAKE_CXX_COMPILER_LAUNCHER="$cc"
    -DCMAKE_CUDA_COMPILER_LAUNCHER="$cc")
  ccache --zero-stats >/dev/null
else
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER= -DCMAKE_CXX_COMPILER_LAUNCHER= -DCMAKE_CUDA_COMPILER_LAUNCHER=)
fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCONCORD_WERROR=ON \
  "${launcher[@]}" "$@"
cmake --build "$BUILD_DIR" -j "$JOBS" ${TARGETS:+--target $TARGETS}
if [ -n "${CCACHE_DIR:-}" ]; then
  ccache --show-stats | grep -E "^(Cacheable calls|  Hits|  Misses)" | awk '!seen[$1]++' |
    sed "s/^/build.sh: ccache: /" || true
fi

#!/usr/bin/env bash
# Configures and builds Concord into ${BUILD_DIR:-build} (executables in
# build/bin). Extra arguments go to CMake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCONCORD_WERROR=ON "$@"
cmake --build "$BUILD_DIR" -j "$JOBS"

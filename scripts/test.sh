#!/usr/bin/env bash
# The whole test suite on both platforms CI tests: installs what is missing,
# builds, runs ctest. Every test has a timeout (a hang is a failure).
#
#   ./scripts/test.sh [--platform debian12|debian13|all] [CTEST ARGS...]
#
# debian12: this machine, Debian 12 with LibTorch 1.13 (CPU), in build/.
# debian13: Debian 13 with CUDA LibTorch 2.6, NCCL 2.22 and CUDA 12.4 in a
#   debootstrapped root (scripts/debian13.sh), CUDA and NCCL required, in
#   build-debian13/; its CPU suite without what does not depend on
#   LibTorch's version (CONCORD_TEST_VERSION_INDEPENDENT=OFF: the
#   coordinator's and the agent's suites, deploy's, which check Debian 12
#   artefacts, netfault's network namespaces; no benchmarks) and without the
#   browser label (the status page in Debian 12's chromium) and the
#   coordinator label (the agents at scale, coordinator fail-over: workers
#   whose LibTorch plays no part in what is tested).
# Extra arguments go to ctest on each platform, e.g. ./scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."

platform=all
if [ "${1:-}" = "--platform" ]; then
  platform=${2:?--platform needs debian12, debian13 or all}
  shift 2
fi
case "$platform" in
  debian12 | debian13 | all) ;;
  *)
    echo "test.sh: --platform $platform: expected debian12, debian13 or all" >&2
    exit 2
    ;;
esac

CTEST_ARGS=(--output-on-failure --timeout 600 -j 2)
failed=()

# Debian 12: install, build, the npm packages the tests drive.
prepare_debian12() {
  ./scripts/install-deps.sh
  ./scripts/build.sh
  # The browser test's driver (playwright-core, pinned by package-lock.json;
  # it uses Debian's chromium, no browser download).
  PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --prefix tests/browser --no-audit --no-fund
  # The Kubernetes schema validator's npm packages, as pinned by its lock file.
  npm ci --prefix tests/deploy/k8s-validate --no-audit --no-fund --loglevel=error
}

test_debian12() {
  echo "test.sh: debian12: ctest"
  ctest --test-dir "${BUILD_DIR:-build}" "${CTEST_ARGS[@]}" "$@" || failed+=(debian12)
}

# Debian 13: the root, then the build. What does not depend on LibTorch's
# version (the coordinator's and the agent's suites, deploy, the
# network-fault lab, the benchmarks) is built and run once, on Debian 12.
prepare_debian13() {
  ./scripts/debian13.sh root
  ./scripts/debian13.sh run env BUILD_DIR=build-debian13 ./scripts/build.sh \
    -DCONCORD_WITH_CUDA=ON -DCONCORD_WITH_NCCL=ON \
    -DCONCORD_TEST_VERSION_INDEPENDENT=OFF -DCONCORD_BUILD_BENCH=OFF
  # examples/mnist's data (Debian's dataset-fashion-mnist, installed on this
  # machine, not in the root): a copy in the build tree, which the root sees.
  if [ -d /usr/share/datasets/fashion-mnist ]; then
    mkdir -p build-debian13/datasets
    cp -r /usr/share/datasets/fashion-mnist build-debian13/datasets/
  fi
}

test_debian13() {
  echo "test.sh: debian13: ctest"
  ./scripts/debian13.sh run ctest --test-dir build-debian13 "${CTEST_ARGS[@]}" \
    --label-exclude 'coordinator|deploy|browser|netfault' "$@" || failed+=(debian13)
}

# Both platforms, the second prepared while the first builds and tests.
# Making the Debian 13 root is mostly download and unpacking, and the Debian
# 12 ctest leaves much of the two cores idle (tests waiting on timeouts and
# links, see docs/testing.md "CI time"): the Debian 13 root and build run in
# the background at the lowest CPU and I/O priority, so the tests, whose
# heartbeats and deadlines are real, keep the cores they ask for. Its output
# goes to build-debian13.log, printed when it fails.
run_all() {
  local start=$SECONDS
  ./scripts/install-deps.sh  # debootstrap among them: no two apt runs overlap
  rm -f build-debian13.log.status
  local log=build-debian13.log
  echo "test.sh: debian13: root and build in the background ($log)"
  # In a session of its own, so that whatever way this script ends, the
  # whole background tree (the chroot's compilers too) goes with it.
  export -f prepare_debian13
  setsid nice -n 19 ionice -c 2 -n 7 bash -euo pipefail -c \
    'prepare_debian13 >"$1" 2>&1; echo done >"$1.status"' bash "$log" &
  prepare=$!
  trap 'kill -- -"$prepare" 2>/dev/null || true' EXIT
  prepare_debian12
  echo "test.sh: debian12: built in $((SECONDS - start)) s"
  test_debian12 "$@"
  echo "test.sh: debian12 done at $((SECONDS - start)) s"
  wait "$prepare" || true
  trap - EXIT
  if [ "$(cat "$log.status" 2>/dev/null)" != done ]; then
    tail -n 60 "$log" >&2
    echo "test.sh: debian13: root or build failed (whole output: $log)" >&2
    failed+=(debian13)
  else
    echo "test.sh: debian13: ready at $((SECONDS - start)) s"
    test_debian13 "$@"
  fi
  echo "test.sh: both platforms took $((SECONDS - start)) s"
}

case "$platform" in
  debian12)
    start=$SECONDS
    prepare_debian12
    test_debian12 "$@"
    echo "test.sh: debian12 took $((SECONDS - start)) s"
    ;;
  debian13)
    start=$SECONDS
    prepare_debian13
    test_debian13 "$@"
    echo "test.sh: debian13 took $((SECONDS - start)) s"
    ;;
  all) run_all "$@" ;;
esac
if [ ${#failed[@]} -gt 0 ]; then
  echo "test.sh: tests failed on: ${failed[*]}" >&2
  exit 1
fi

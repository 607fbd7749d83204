#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs ctest.
# Every test has a timeout (a hang is a failure). Extra arguments go to ctest,
# e.g. ./scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh
# The browser test's driver (playwright-core, pinned by package-lock.json;
# it uses Debian's chromium, no browser download).
PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --prefix tests/browser --no-audit --no-fund
# The Kubernetes schema validator's npm packages, as pinned by its lock file.
npm ci --prefix tests/deploy/k8s-validate --no-audit --no-fund --loglevel=error
BUILD_DIR=${BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 600 -j 2 "$@"

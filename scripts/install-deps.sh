#!/usr/bin/env bash
# Installs the Debian 12 packages Concord builds, tests and runs with.
# Idempotent: does nothing when every package is already installed.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  # Compile cache kept outside the clone between CI runs (scripts/build.sh).
  ccache
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  libspdlog-dev libcli11-dev nlohmann-json3-dev libisal-dev
  libtorch-dev libgloo-dev
  # LibTorch links reference BLAS otherwise (about 7x slower matmuls).
  libopenblas0-pthread
  # The reference implementation the tests compare against (gloo backend).
  python3 python3-torch
  # The coordinator's Prometheus metrics.
  prometheus-cpp-dev
  # TLS file checks (common/tls.cc); the tests make certificates with openssl.
  libssl-dev openssl
  # The etcd store's tests start a real etcd on loopback.
  etcd-server
  # The coordinator's status page (civetweb, as prometheus-cpp's exposer).
  libcivetweb-dev
  # The status page's browser test: headless Chromium driven by
  # playwright-core (tests/browser, installed with npm ci by test.sh).
  chromium
  # sd_notify (Type=notify, watchdog) in the coordinator; systemd-analyze
  # checks the unit's hardening (tests/deploy).
  libsystemd-dev systemd
  # The unit sandbox test traces the coordinator's system calls.
  strace
  # examples/mnist trains on Fashion-MNIST's idx files (nothing can be
  # downloaded; tests/integration/test_examples.py).
  dataset-fashion-mnist
  # The Debian 13 root of the second CI platform (scripts/debian13.sh).
  debootstrap
)
# Node and npm for the browser driver and the Kubernetes manifest validator
# (tests/browser, tests/deploy/k8s-validate: `npm ci`): Debian's, unless
# there already (NodeSource's nodejs bundles npm and conflicts with Debian's
# npm package).
command -v node >/dev/null 2>&1 || PACKAGES+=(nodejs)
command -v npm >/dev/null 2>&1 || PACKAGES+=(npm)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"

#!/usr/bin/env bash
# Downloads, here (Debian 12 with its package registry), the Debian 12
# packages that scripts/gpu-suite.sh unpacks on a GPU machine that has no
# registry: what Concord needs besides LibTorch, CUDA and NCCL (pip's, on
# that machine) to build and run its `gpu` tests.
#
#   ./scripts/gpu-deps.sh [--out DIR]      (default .gpu-deps/debs)
#
# Then carry .gpu-deps to the GPU machine with the working tree and run
# scripts/gpu-suite.sh there (docs/gpu.md, "Running the GPU suite").
#
# The packages are resolved as apt would install them on an empty system
# (their dependencies included, recommends not), then the ones the GPU
# machine is expected to have already, or that nothing there needs, are
# left out (SKIP below, each group with its reason). The folder ends up
# holding exactly the resolved .debs and manifest.txt (name, version, file),
# which gpu-suite.sh checks before it unpacks anything.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=.gpu-deps/debs
while [ $# -gt 0 ]; do
  case "$1" in
    --out)
      OUT=${2:?--out needs a directory}
      shift 2
      ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "gpu-deps: unknown argument $1 (see --help)" >&2
      exit 2
      ;;
  esac
done

# What CMakeLists.txt and its subdirectories find_package, as Debian 12 names
# them (scripts/install-deps.sh has the same list for this machine), plus
# pkg-config, which the GPU image may lack (coordinator/ uses
# pkg_check_modules for libsystemd).
WANTED=(
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  libspdlog-dev libcli11-dev nlohmann-json3-dev libisal-dev
  prometheus-cpp-dev libcivetweb-dev libsystemd-dev libssl-dev
  libgloo-dev
  pkgconf
)

# Left out of the resolved set. A package not named here is downloaded, so a
# dependency Debian adds later is carried rather than missed.
SKIP=(
  # The C/C++ runtime and toolchain: the GPU image builds CUDA C++, so it
  # has them (and they must not be replaced by Debian's).
  libc6 libc6-dev libc-dev-bin linux-libc-dev libcrypt1 libcrypt-dev
  libnsl2 libnsl-dev libtirpc3 libtirpc-common libtirpc-dev rpcsvc-proto
  gcc-12-base libgcc-s1 libstdc++6
  # Base libraries of any Debian or Ubuntu system (apt itself needs them),
  # wanted at run time by the carried libsystemd0 only.
  libcap2 libgcrypt20 libgpg-error0 liblz4-1 liblzma5 libzstd1
  libselinux1 libpcre2-8-0 debconf
  # adduser and the user-management stack under it, for libibverbs1's
  # maintainer scripts: dpkg -x runs no scripts. (civetweb, the server
  # program, is carried: civetweb's CMake package checks that it exists.)
  adduser passwd libpam0g libpam-modules libpam-modules-bin
  libpam-runtime libaudit1 libaudit-common libcap-ng0 libsemanage2
  libsemanage-common libsepol2 libdb5.3 libbz2-1.0
  # Sources and test frameworks other packages depend on for their own
  # builds: libgtest-dev ships the built libraries, spdlog is header-only.
  googletest catch2
  # libcurl's own dependencies: prometheus-cpp's CMake package looks for
  # CURL (for its push library), so libcurl and its headers are carried,
  # but nothing of Concord links it (it uses prometheus-cpp core and pull).
  libbrotli1 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0
  libkeyutils1 libcom-err2 libidn2-0 libunistring2 libldap-2.5-0
  libsasl2-2 libsasl2-modules-db libnghttp2-14 libpsl5 librtmp1 libssh2-1
  libgnutls30 libgmp10 libnettle8 libhogweed6 libp11-kit0 libtasn1-6 libffi8
  # Gloo's optional transports: libgloo.so.0 links libibverbs and hiredis
  # (their run-time libraries are carried), Concord uses Gloo's TCP
  # transport and includes neither's headers; the RDMA provider plugins
  # are loaded only by RDMA programs.
  ibverbs-providers libibverbs-dev libnl-3-dev libnl-route-3-dev
  libhiredis-dev
)

fail() {
  echo "gpu-deps: $*" >&2
  exit 1
}

command -v apt-get >/dev/null 2>&1 || fail "needs apt-get (Debian 12)"
# shellcheck source=/dev/null
. /etc/os-release
[ "${VERSION_CODENAME:-}" = bookworm ] ||
  fail "run this on Debian 12 (bookworm), not ${PRETTY_NAME:-this system}: the GPU suite carries Debian 12's packages"

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT
APT_OPTS=(-o APT::Architecture=amd64 -o APT::Architectures=amd64)
if [ "$(dpkg --print-architecture)" != amd64 ]; then
  # The GPU machines are x86-64: resolve from amd64 package lists of our own.
  mkdir -p "$state/lists/partial"
  APT_OPTS+=(-o "Dir::State::Lists=$state/lists")
  apt-get "${APT_OPTS[@]}" update -qq
else
  $SUDO apt-get update -qq
fi

# Resolve as on an empty system: an empty dpkg status file.
: >"$state/status"
if ! apt-get "${APT_OPTS[@]}" -o "Dir::State::status=$state/status" \
  -s install --no-install-recommends "${WANTED[@]}" >"$state/resolve.txt" 2>&1; then
  cat "$state/resolve.txt" >&2
  fail "apt could not resolve ${WANTED[*]}"
fi
declare -A skip=()
for p in "${SKIP[@]}"; do skip[$p]=1; done
names=()
versions=()
while read -r _ name version _; do
  [ -n "${skip[$name]:-}" ] && continue
  names+=("$name")
  versions+=("${version#(}")
done < <(grep '^Inst ' "$state/resolve.txt")
[ ${#names[@]} -gt 0 ] || fail "apt resolved nothing (see apt-get -s install ${WANTED[*]})"

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
specs=()
for i in "${!names[@]}"; do specs+=("${names[$i]}=${versions[$i]}"); done
echo "gpu-deps: downloading ${#specs[@]} packages into $OUT"
rm -f "$OUT"/*.deb "$OUT/manifest.txt"
# As root, apt drops to its _apt user, which may not write here: stay root.
(cd "$OUT" && apt-get "${APT_OPTS[@]}" -o APT::Sandbox::User="$(id -un)" \
  download -qq "${specs[@]}")

{
  echo "# Debian 12 (bookworm) packages for scripts/gpu-suite.sh, $(date -u +%Y-%m-%d)"
  echo "# name version file"
  for i in "${!names[@]}"; do
    # apt-get download names files name_version_arch.deb, the epoch's colon
    # written %3a.
    file=$(cd "$OUT" && ls "${names[$i]}_"*.deb)
    echo "${names[$i]} ${versions[$i]} $file"
  done
} >"$OUT/manifest.txt"

# The examples' GPU tests (examples_*_cuda) read Fashion-MNIST, which the GPU
# machine lacks: its first 20,000 training images (the tests train on 9,000)
# and the 10,000 test images, from Debian's dataset-fashion-mnist. The idx
# headers keep MNIST's counts (LibTorch's MNIST reader insists on 60,000 and
# 10,000), the training images after the first 20,000 are zeros (labels 0):
# 9 MiB instead of 30. gpu-suite.sh copies them where the tests look.
DATASET=/usr/share/datasets/fashion-mnist
DATA_OUT=$(dirname "$OUT")/datasets/fashion-mnist
[ -d "$DATASET" ] || $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
mkdir -p "$DATA_OUT"
python3 - "$DATASET" "$DATA_OUT" <<'PY' || fail "could not write the Fashion-MNIST subset"
import gzip, os, sys
src, dst = sys.argv[1:3]
KEEP = 20000
for name in ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]:
    with gzip.open(os.path.join(src, name + ".gz"), "rb") as f:
        data = f.read()
    if name.startswith("train"):
        header = 16 if "images" in name else 8
        item = (len(data) - header) // 60000
        data = data[:header + KEEP * item] + bytes((60000 - KEEP) * item)
    with gzip.open(os.path.join(dst, name + ".gz"), "wb", 6) as f:
        f.write(data)
PY
echo "gpu-deps: Fashion-MNIST subset in $DATA_OUT ($(du -sh "$DATA_OUT" | cut -f1))"

bytes=$(du -cb "$OUT"/*.deb | tail -1 | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "gpu-deps: ${#names[@]} packages, $bytes bytes ($mib MiB) in $OUT"
# The GPU machines receive the working tree and .gpu-deps together, 64 MiB at
# most: leave room for the tree.
if [ "$bytes" -gt $((56 * 1048576)) ]; then
  echo "gpu-deps: warning: over 56 MiB; with the working tree this may exceed the 64 MiB a GPU machine receives" >&2
fi

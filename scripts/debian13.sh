#!/usr/bin/env bash
# The second CI platform: Debian 13 (trixie) with Debian's CUDA LibTorch 2.6,
# NCCL 2.22, gloo-cuda and CUDA 12.4, in a root made with debootstrap.
#
#   scripts/debian13.sh root          make the root, or reuse it when complete
#   scripts/debian13.sh run CMD...    run CMD in the root, in this checkout
#
# The root lives outside the clone (CONCORD_DEBIAN13_ROOT, default
# /var/cache/concord/debian13; ~3 GB download, ~9 GB installed) so CI runs on
# the same machine reuse it. It is complete when its stamp names the current
# package list. Without a stamp it is made from nothing (debootstrap), or,
# where debootstrap had finished, its package install is resumed (an
# interrupted run, or a changed package list). Commands run in a private
# mount namespace (unshare):
# /proc, /dev, /sys and the checkout are bind-mounted for the command only
# and vanish with it, whatever way it ends.
#
# Note [cuDNN in the CI root]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# libtorch-cuda-2.6 depends on nvidia-cudnn, whose postinst downloads cuDNN from
# NVIDIA's site — offline it fails and leaves the packages unconfigured. We
# answer its debconf licence question "I Decline" (the postinst then downloads
# nothing and succeeds) and give the root a link stub for libcudnn.so.9: a
# shared library generated from the cudnn* symbols libtorch_cuda.so imports,
# each returning CUDNN_STATUS_NOT_INITIALIZED. It exists so the CUDA LibTorch
# links and loads on a machine without a GPU, where cuDNN could not run anyway
# (the same reason CUDA ships stubs/libcuda.so). It is never used on a GPU
# machine: scripts/gpu-suite.sh builds against pip's PyTorch and its cuDNN.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$(pwd)
ROOT=${CONCORD_DEBIAN13_ROOT:-/var/cache/concord/debian13}
MIRROR=${CONCORD_DEBIAN_MIRROR:-http://deb.debian.org/debian}

PACKAGES=(
  build-essential cmake ninja-build pkg-config git ccache
  # CUDA 12.4's nvcc supports GCC up to 13; trixie's default is 14.
  g++-13
  libtorch-cuda-dev python3-torch-cuda libnccl-dev libgloo-cuda-dev
  nvidia-cuda-toolkit
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  libspdlog-dev libcli11-dev nlohmann-json3-dev libisal-dev
  libopenblas0-pthread python3
  prometheus-cpp-dev libssl-dev openssl etcd-server libcivetweb-dev
  libsystemd-dev
)
STAMP_TEXT="debootstrap trixie minbase main,contrib,non-free; cudnn stub v2; ${PACKAGES[*]}"

log() { echo "debian13: $*" >&2; }

# Runs "$@" inside the root with /proc, /dev, /sys and the checkout mounted,
# in a mount namespace of its own.
in_root() {
  unshare --mount --propagation private -- /bin/bash -euc '
    root=$1 src=$2; shift 2
    mount -t proc proc "$root/proc"
    mount --rbind /dev "$root/dev"
    mount --rbind /sys "$root/sys"
    mkdir -p "$root$src"
    mount --bind "$src" "$root$src"
    cp -L /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
    exec chroot "$root" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      HOME=/root LANG=C.UTF-8 CI="${CI:-}" /bin/bash -c "cd \"\$0\" && exec \"\$@\"" "$src" "$@"
  ' bash "$ROOT" "$SRC" "$@"
}

# The cuDNN link stub (see Note [cuDNN in the CI root]).
make_cudnn_stub() {
  local lib=/usr/lib/x86_64-linux-gnu
  in_root /bin/bash -euc '
    lib=$1
    # Every library that needs libcudnn.so.9 (libtorch_cuda, libtorch_python).
    users=$(find /usr/lib -name "*.so*" -type f -exec sh -c \
      "objdump -p \"\$1\" 2>/dev/null | grep -q \"NEEDED.*libcudnn.so.9\"" sh {} \; -print)
    # Imported as NAME@libcudnn.so.9: the stub defines that version node.
    syms=$(for f in $users; do nm -D --undefined-only "$f"; done | awk "{print \$NF}" |
      grep "^cudnn" | sed "s/@.*//" | sort -u)
    [ -n "$syms" ] || { echo "no library in the root imports cudnn symbols" >&2; exit 1; }
    work=$(mktemp -d)
    {
      echo "/* Link stub for libcudnn.so.9 (see Note [cuDNN in the CI root] in scripts/debian13.sh). */"
      echo "#include <stddef.h>"
      echo "const char* cudnnGetErrorString(int s) { (void)s; return \"cuDNN is not installed in this root\"; }"
      echo "size_t cudnnGetVersion(void) { return 90000; }"
      echo "size_t cudnnGetCudartVersion(void) { return 12040; }"
      for s in $syms; do
        case $s in cudnnGetErrorString|cudnnGetVersion|cudnnGetCudartVersion) continue ;; esac
        echo "int $s(void) { return 1; /* CUDNN_STATUS_NOT_INITIALIZED */ }"
      done
    } > "$work/cudnn_stub.c"
    echo "libcudnn.so.9 { global: *; };" > "$work/cudnn.map"
    gcc -shared -fPIC -O1 -Wl,-soname,libcudnn.so.9 -Wl,--version-script,"$work/cudnn.map" \
      -o "$lib/libcudnn.so.9.0.0" "$work/cudnn_stub.c"
    rm -rf "$work"
    ldconfig
  ' bash "$lib"
}

make_root() {
  if [ -f "$ROOT/.concord-stamp" ] && [ "$(cat "$ROOT/.concord-stamp")" = "$STAMP_TEXT" ]; then
    log "reusing $ROOT"
    return
  fi
  command -v debootstrap >/dev/null || {
    log "installing debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
  }
  local start=$SECONDS
  if [ ! -f "$ROOT/.concord-base" ]; then
    log "making $ROOT from nothing"
    rm -rf "$ROOT"
    mkdir -p "$(dirname "$ROOT")"
    debootstrap --variant=minbase --components=main,contrib,non-free trixie "$ROOT" "$MIRROR" >/dev/null
    touch "$ROOT/.concord-base"
  fi
  rm -f "$ROOT/.concord-stamp"
  in_root env DEBIAN_FRONTEND=noninteractive dpkg --configure -a
  echo "nvidia-cudnn nvidia-cudnn/question select I Decline" | in_root debconf-set-selections
  in_root apt-get update -qq
  log "installing ${#PACKAGES[@]} packages"
  in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
  make_cudnn_stub
  in_root apt-get clean
  echo "$STAMP_TEXT" > "$ROOT/.concord-stamp"
  log "root ready in $((SECONDS - start)) s"
}

case "${1:-}" in
  root) make_root ;;
  run)
    shift
    [ -f "$ROOT/.concord-stamp" ] || { log "no complete root at $ROOT: run '$0 root'"; exit 2; }
    in_root "$@"
    ;;
  *)
    echo "usage: $0 root | run CMD..." >&2
    exit 2
    ;;
esac

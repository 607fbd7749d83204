# syntax=docker/dockerfile:1
# Worker image: concord-run (launcher) and concord-train (trains a
# TorchScript model), CPU (Gloo). From the repository root:
#   docker build -f deploy/container/worker.Dockerfile -t concord-worker:0.1.0 .
# Your own LibTorch program linked with libconcord goes in an image built the
# same way (docs/deploy.md).

# ---- builder: Debian 12 with the -dev packages, a CMake build -------------
FROM debian:bookworm AS builder
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      build-essential cmake ninja-build pkg-config \
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
      libabsl-dev libspdlog-dev libcli11-dev nlohmann-json3-dev libisal-dev \
      prometheus-cpp-dev libssl-dev libsystemd-dev libcivetweb-dev \
      libtorch-dev libgloo-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# CPU only: Debian 12 has no CUDA toolkit in main (a GPU image needs NVIDIA's
# base images and CONCORD_WITH_CUDA/NCCL=ON; not provided here).
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCONCORD_WERROR=ON -DCONCORD_BUILD_TESTS=OFF -DCONCORD_BUILD_BENCH=OFF \
      -DCONCORD_WITH_CUDA=OFF -DCONCORD_WITH_NCCL=OFF \
 && cmake --build build --target concord-run concord-train \
 && strip --strip-debug build/bin/concord-run build/bin/concord-train

# ---- runtime: the shared libraries only, no compiler, not root ------------
FROM debian:bookworm-slim AS runtime
# libtorch1.13 brings its own dependencies; OpenBLAS because LibTorch is ~7x
# slower on reference BLAS.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libtorch1.13 libgloo0 libopenblas0-pthread \
      libgrpc++1.51 libgrpc29 libprotobuf32 libabsl20220623 \
      libspdlog1.10 libfmt9 libssl3 \
      libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libcivetweb1 \
      libstdc++6 zlib1g libisal2 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 65532 concord \
 && useradd --system --uid 65532 --gid 65532 --home-dir /tmp \
      --shell /usr/sbin/nologin concord
COPY --from=builder /src/build/bin/concord-run /src/build/bin/concord-train /usr/local/bin/
USER 65532:65532
WORKDIR /tmp
ENV HOME=/tmp OMP_NUM_THREADS=1
# concord-run --coordinator HOST:PORT --job-id J --nproc 1 ... -- concord-train ...
# (deploy/kubernetes/workers-job.yaml).
ENTRYPOINT ["/usr/local/bin/concord-run"]
CMD ["--help"]

# syntax=docker/dockerfile:1
# concord-coordinator (and concordctl) image. From the repository root:
#   docker build -f deploy/container/coordinator.Dockerfile -t concord-coordinator:0.1.0 .
# docs/deploy.md says how to run it (tokens as secrets, state volume).

# ---- builder: Debian 12 with the -dev packages, a CMake build -------------
FROM debian:bookworm AS builder
# LibTorch and Gloo are there only because the top-level CMakeLists finds
# them for every target; the coordinator itself never links them.
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
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCONCORD_WERROR=ON -DCONCORD_BUILD_TESTS=OFF -DCONCORD_BUILD_BENCH=OFF \
      -DCONCORD_WITH_CUDA=OFF -DCONCORD_WITH_NCCL=OFF \
 && cmake --build build --target concord-coordinator concordctl \
 && strip --strip-debug build/bin/concord-coordinator build/bin/concordctl

# ---- runtime: the shared libraries only, no compiler, not root ------------
FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51 libgrpc29 libprotobuf32 libabsl20220623 \
      libspdlog1.10 libfmt9 libssl3 \
      libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libsystemd0 libcivetweb1 \
      libstdc++6 zlib1g ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 65532 concord \
 && useradd --system --uid 65532 --gid 65532 --home-dir /var/lib/concord \
      --shell /usr/sbin/nologin concord \
 && install -d -o 65532 -g 65532 -m 0700 /var/lib/concord
COPY --from=builder /src/build/bin/concord-coordinator /src/build/bin/concordctl /usr/local/bin/
USER 65532:65532
WORKDIR /var/lib/concord
# gRPC (workers, operators), Prometheus metrics, plain HTTP health.
EXPOSE 7070 9464 8081
# The plain health port (--health-listen): 200 SERVING once the gRPC port
# accepts connections, 503 otherwise. bash's /dev/tcp: no curl in the image.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["/bin/bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/8081 && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 && head -n 1 <&3 | grep -q ' 200 '"]
ENTRYPOINT ["/usr/local/bin/concord-coordinator"]
# Tokens as files (docker run --mount or compose secrets: /run/secrets/NAME);
# state in /var/lib/concord (mount a volume there). Kubernetes replaces these
# arguments (deploy/kubernetes/coordinator.yaml).
CMD ["--listen", "0.0.0.0:7070", "--state-dir", "/var/lib/concord", \
     "--worker-token-file", "/run/secrets/worker-token", \
     "--operator-token-file", "/run/secrets/operator-token", \
     "--metrics-listen", "0.0.0.0:9464", "--health-listen", "0.0.0.0:8081"]

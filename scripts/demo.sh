#!/usr/bin/env bash
# The main job: install what is missing, build, and train a small CNN with
# BatchNorm on 3 CPU worker processes coordinated by an embedded coordinator.
#   ./scripts/demo.sh [NPROC]
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${1:-3}
./scripts/install-deps.sh
./scripts/build.sh
BUILD_DIR=${BUILD_DIR:-build}
WORK=$(mktemp -d /tmp/concord-demo.XXXXXX)
echo "demo: writing a TorchScript model and data to $WORK"
/usr/bin/python3 examples/make_demo.py --out "$WORK"
export OMP_NUM_THREADS=1
"$BUILD_DIR/bin/concord-run" --standalone --nproc "$NPROC" -- \
  "$BUILD_DIR/bin/concord-train" --model "$WORK/model.pt" --data "$WORK/data.pt" \
  --loss cross_entropy --lr 0.05 --momentum 0.9 --batch-size 32 --epochs 5 \
  --shuffle --seed 1 --log-interval 10 --output "$WORK/final.pt"
echo "demo: final parameters and buffers in $WORK/final.pt"

#!/usr/bin/env bash
# The main job: installs what is missing, builds, fetches MNIST, and trains the MLP with
# 2 servers and 2 workers over shared memory, SSP with staleness 2. Run as root on Debian
# bookworm. Extra arguments go to pskv-mnist (e.g. --epochs 1, --model cnn, --transport tcp).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${PSKV_BUILD_DIR:-$PWD/build}

source scripts/lib/deps.sh
pskv_install_deps

echo "=== building pskv-mnist (Release, -j2)"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j 2 --target pskv-mnist

echo "=== fetching MNIST"
scripts/fetch-data.sh

echo "=== training: 2 servers, 2 workers, shm, SSP s=2, MLP"
exec "$BUILD/apps/mnist/pskv-mnist" --launch --servers 2 --workers 2 --transport shm --mode ssp --staleness 2 \
  --model mlp --epochs 8 --lr 0.05 --data data/mnist "$@"

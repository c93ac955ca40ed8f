#!/usr/bin/env bash
# The cluster path for real: Open MPI's mpirun starts 4 ranks of pskv-mnist on this machine;
# ranks 0-1 serve, 2-3 train (roles from OMPI_COMM_WORLD_RANK), over TCP (ctest label `mnist`).
#   mpirun_training.sh PSKV_MNIST_BINARY DATA_DIR
set -euo pipefail
bin=$1 data=$2
floor=0.80
command -v mpirun >/dev/null || { echo "mpirun missing: apt-get install openmpi-bin" >&2; exit 1; }
port=$(( 20000 + ($$ % 20000) ))
out=$(timeout 300 mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 \
        "$bin" --servers 2 --workers 2 --transport tcp --port-base "$port" --data "$data" \
        --train-limit 12000 --test-limit 5000 --epochs 1 --quiet --json 2>&1)
echo "$out"
acc=$(echo "$out" | grep '^{' | tail -1 | sed -n 's/.*"test_accuracy":\([0-9.]*\).*/\1/p')
[ -n "$acc" ] || { echo "no summary from worker 0" >&2; exit 1; }
awk -v a="$acc" -v f="$floor" 'BEGIN { exit !(a >= f) }' || { echo "accuracy $acc below $floor" >&2; exit 1; }
echo "mpirun job: accuracy $acc >= $floor"

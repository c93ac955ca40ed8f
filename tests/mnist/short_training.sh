#!/usr/bin/env bash
# A short real training run (ctest label `mnist`): 2 servers and 2 workers over TRANSPORT
# train the MLP on a 12,000-sample subset of real MNIST for one epoch; the test accuracy must
# rise above a floor (80%) that an untrained or broken job (about 10%) cannot reach; one
# epoch of async SGD on 12K samples varies by a few points, so the floor leaves room.
#   short_training.sh PSKV_MNIST_BINARY DATA_DIR TRANSPORT MODE
set -euo pipefail
bin=$1 data=$2 transport=$3 mode=$4
floor=0.80
[ -f "$data/train-images-idx3-ubyte" ] || { echo "no MNIST in $data: run scripts/fetch-data.sh" >&2; exit 1; }
out=$("$bin" --launch --servers 2 --workers 2 --transport "$transport" --mode "$mode" --staleness 2 \
        --data "$data" --train-limit 12000 --test-limit 5000 --epochs 1 --quiet --json)
echo "$out"
json=$(echo "$out" | grep '^{' | tail -1)
acc=$(echo "$json" | sed -n 's/.*"test_accuracy":\([0-9.]*\).*/\1/p')
[ -n "$acc" ] || { echo "no summary line" >&2; exit 1; }
awk -v a="$acc" -v f="$floor" 'BEGIN { exit !(a >= f) }' || { echo "accuracy $acc below the floor $floor" >&2; exit 1; }
echo "accuracy $acc >= $floor"

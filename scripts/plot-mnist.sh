#!/usr/bin/env bash
# Time to accuracy of BSP, SSP (s=3) and ASP with a 3x straggler: trains the MLP with 2 servers
# and 2 workers over shm for each mode, logs accuracy against time (CSV), and plots
# docs/mnist-tta.png with gnuplot. Summary lines go to docs/mnist-tta.txt.
#   scripts/plot-mnist.sh [BUILD_DIR]   (default build; run scripts/demo.sh or test.sh first)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BIN=$BUILD/apps/mnist/pskv-mnist
OUT=${PSKV_PLOT_DIR:-docs}
TARGET=0.97
EPOCHS=${PSKV_PLOT_EPOCHS:-4}
[ -x "$BIN" ] || { echo "build pskv-mnist first ($BIN missing)" >&2; exit 1; }
command -v gnuplot >/dev/null || { echo "apt-get install gnuplot-nox" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
: > "$OUT/mnist-tta.txt"
for run in "bsp 0" "ssp 3" "asp 0"; do
  set -- $run
  "$BIN" --launch --servers 2 --workers 2 --transport shm --mode "$1" --staleness "$2" --model mlp \
    --epochs "$EPOCHS" --evals-per-epoch 8 --straggler 1:3 --target-accuracy $TARGET --csv "$tmp/$1.csv" \
    --quiet --json | grep '^{' | tee -a "$OUT/mnist-tta.txt"
done
gnuplot <<GP
set terminal pngcairo size 900,560 noenhanced font "DejaVu Sans,11"
set output "$OUT/mnist-tta.png"
set title "MNIST MLP, 2 servers + 2 workers over shm, worker 1 a 3x straggler"
set xlabel "wall time (s)"
set ylabel "test accuracy"
set yrange [0.90:0.985]
set key bottom right
set grid
set datafile separator ","
plot "$tmp/bsp.csv" using 1:6 every ::1 with linespoints title "BSP", \
     "$tmp/ssp.csv" using 1:6 every ::1 with linespoints title "SSP s=3", \
     "$tmp/asp.csv" using 1:6 every ::1 with linespoints title "ASP", \
     $TARGET with lines dashtype 2 lc rgb "gray" title "97%"
GP
echo "wrote $OUT/mnist-tta.png and $OUT/mnist-tta.txt"

#!/usr/bin/env bash
# The test command: installs what is missing (Debian bookworm, as root), builds with -j2 and runs
# every test group that can run here. Idempotent: re-running reuses the build directories.
#
#   scripts/test.sh                 everything below
#   PSKV_TEST_SANITIZERS=0          skip the ThreadSanitizer build
#   PSKV_BUILD_DIR=build            where the main build lives
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${PSKV_BUILD_DIR:-$ROOT/build}
JOBS=${PSKV_JOBS:-2}
SANITIZERS=${PSKV_TEST_SANITIZERS:-1}

source scripts/lib/deps.sh
pskv_install_deps

step() { printf '\n=== %s (%s)\n' "$*" "$(date +%T)"; }
T0=$(date +%s)

step "configure + build (Release)"
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPSKV_WERROR=ON >/dev/null
cmake --build "$BUILD" -j "$JOBS"

step "ctest: unit, concurrency, integration, consistency"
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" -L 'unit|concurrency|integration|consistency'

if [ "$SANITIZERS" = 1 ]; then
  step "ThreadSanitizer build: concurrency tests"
  TSAN_BUILD=$BUILD-tsan
  cmake -S "$ROOT" -B "$TSAN_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPSKV_SANITIZE=thread \
    -DPSKV_BUILD_BENCH=OFF -DPSKV_BUILD_APPS=OFF >/dev/null
  cmake --build "$TSAN_BUILD" -j "$JOBS"
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
    ctest --test-dir "$TSAN_BUILD" --output-on-failure -j "$JOBS" -L concurrency
fi

step "all tests passed in $(( $(date +%s) - T0 )) s"

#!/usr/bin/env bash
# A healthy client's latency while pskv-attack throws each attack class at a tcp:// server, next
# to the same client without an attack, and the server's peak RSS; one fresh server per class so
# each peak is that attack's own. Benchmarks, not tests: nothing here passes or fails on timing.
#   scripts/attack-bench.sh [BUILD_DIR]   (PSKV_ATTACK_SECONDS per class, default 6)
# Writes docs/bench/attacks.jsonl and regenerates docs/BENCHMARKS.md, whose "Under attack"
# section is made from it (scripts/bench.sh runs this too).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/server.sh
BUILD=${1:-build}
SECONDS_PER_ATTACK=${PSKV_ATTACK_SECONDS:-6}
BENCH=$BUILD/bench/pskv-bench
SERVER=$BUILD/apps/pskv-server
ATTACK=$BUILD/tests/adversarial/pskv-attack
for b in "$BENCH" "$SERVER" "$ATTACK"; do
  [ -x "$b" ] || { echo "$b is missing: build $BUILD with tests and benchmarks first" >&2; exit 1; }
done
OUT=docs/bench/attacks.jsonl
WORK=$(mktemp -d /tmp/pskv-attack-bench.XXXXXX)
SERVER_PID=
cleanup() {
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
# The budgets the RSS figures are judged against: what a deployment would configure.
SERVER_FLAGS=(--io-threads 2 --max-request-mb 256 --memory-budget-mb 512 --frame-timeout-ms 2000
              --handshake-timeout-ms 2000 --max-connections 1024)

start_server() {  # extra flags...
  "$SERVER" --uri tcp://127.0.0.1:0 "${SERVER_FLAGS[@]}" "$@" > "$WORK/server.out" 2> "$WORK/server.err" &
  SERVER_PID=$!
  URI=$(pskv_server_uri "$WORK/server.out") || { echo "pskv-server did not start: $(cat "$WORK/server.err")" >&2; exit 1; }
}
stop_server() {
  kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=
}
peak_rss_mib() { awk '/VmHWM/ {printf "%.0f", $2 / 1024}' "/proc/$SERVER_PID/status"; }
# The healthy client: 4 KiB pushes and pulls, one in flight, from 127.0.0.1 (the attacker uses
# 127.0.0.2, as a different host would).
healthy() {  # label [--auth-token-file FILE]
  local label=$1; shift
  "$BENCH" --server "$URI" "$@" --json --sizes 4K --ops push,pull --clients 1 --rounds 1 \
    --seconds "$(awk -v s="$SECONDS_PER_ATTACK" 'BEGIN {print s / 3}')" 2>/dev/null |
    python3 -c '
import json, sys
label = sys.argv[1]
for line in sys.stdin:
    r = json.loads(line)
    if r.get("workload") == "dense":
        print(json.dumps({"attack": label, "op": r["op"], "p50_us": r["p50_us"], "p99_us": r["p99_us"], "ops": r["ops"]}))
' "$label"
}

: > "$OUT"
ATTACKS=(huge-pull-lengths repeated-key-pull slowloris-large slowloris-small slowloris-after-hello non-reader
         idle-flood random-bytes bad-header-fields truncation second-hello connect-flood budget-flood fast-streamer
         parked-flood)
start_server
healthy none >> "$OUT"
echo "{\"attack\":\"none\",\"peak_rss_mib\":$(peak_rss_mib)}" >> "$OUT"
stop_server
for a in "${ATTACKS[@]}" unauth-large replayed-proof; do
  extra=()
  token=()
  lanes=16
  args=()
  case $a in
    # Two line-rate streamers already keep both cores busy; 16 would measure the attacker's CPU.
    fast-streamer) lanes=2; args=(--frame-mb 32) ;;
    # Parked pulls need worker clocks: the attacker is worker 1, worker 0 never comes.
    parked-flood) lanes=4; args=(--repeat 16384); extra=(--workers 2 --mode bsp --wait-timeout-ms 60000) ;;
  esac
  if [ "$a" = unauth-large ] || [ "$a" = replayed-proof ]; then
    head -c 32 /dev/urandom | base64 > "$WORK/token" && chmod 600 "$WORK/token"
    extra=(--auth-token-file "$WORK/token")
    token=(--auth-token-file "$WORK/token")
  fi
  start_server "${extra[@]}"
  "$ATTACK" --uri "$URI" --attack "$a" --connections "$lanes" --seconds "$SECONDS_PER_ATTACK" \
    --max-request-mb 256 "${token[@]}" "${args[@]}" > "$WORK/attack.json" 2> "$WORK/attack.err" &
  attacker=$!
  sleep 1
  healthy "$a" "${token[@]}" >> "$OUT"
  wait "$attacker" || true
  alive=true
  kill -0 "$SERVER_PID" 2>/dev/null || alive=false
  echo "{\"attack\":\"$a\",\"peak_rss_mib\":$(peak_rss_mib 2>/dev/null || echo null),\"server_alive\":$alive}" >> "$OUT"
  stop_server
done
python3 scripts/lib/bench_report.py docs/bench docs/BENCHMARKS.md
echo "wrote $OUT and docs/BENCHMARKS.md (\"Under attack\")"

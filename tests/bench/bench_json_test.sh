#!/usr/bin/env bash
# pskv-bench's --json lines are a contract (scripts/bench.sh and later steps read them): each
# result carries the fields the report needs, every ratio is a finite positive number, and a
# push at a bandwidth size (and a tcp pull) carries its ratio to the bound measured in the same run.
#   bench_json_test.sh PSKV_BENCH
set -euo pipefail
BENCH=${1:?usage: bench_json_test.sh PSKV_BENCH}
fail() { echo "FAIL: $*" >&2; exit 1; }

for transport in tcp shm; do
  out=$("$BENCH" --transport "$transport" --json --sizes 64,64K --clients 1 --seconds 0.05 --max-ops 300)
  echo "$out"
  results=$(grep '"workload":"dense"' <<<"$out") || fail "$transport: no results"
  [ "$(wc -l <<<"$results")" -eq 4 ] || fail "$transport: expected push and pull at 2 sizes"
  while read -r line; do
    for field in transport op value_bytes clients bytes_per_s p50_us p99_us baseline ratio allocs_per_op; do
      grep -q "\"$field\":" <<<"$line" || fail "$transport: no $field in $line"
    done
    # %.4g keeps a tiny ratio (a 64-byte push against memcpy) from printing as 0.000.
    grep -Eq '"ratio":[0-9]*\.?[0-9]+(e-?[0-9]+)?[,}]' <<<"$line" || fail "$transport: ratio is not a number in $line"
    grep -Eq '"ratio":0(\.0+)?[,}]' <<<"$line" && fail "$transport: zero ratio in $line"
  done <<<"$results"
  bound=$([ "$transport" = shm ] && echo memcpy_apply || echo tcp_rpc_apply)
  grep -q "{\"baseline\":\"$bound\",\"value_bytes\":65536,\"bytes_per_s\":[1-9]" <<<"$out" ||
    fail "$transport: no $bound baseline at 64 KiB"
  push64k=$(grep '"op":"push","value_bytes":65536,' <<<"$results")
  grep -Eq "\"bound\":\"$bound\",\"bound_value\":[1-9][0-9]*,\"ratio_to_bound\":[0-9]*\.?[0-9]*[1-9][0-9]*(e-?[0-9]+)?[,}]" <<<"$push64k" ||
    fail "$transport: 64 KiB push has no ratio to its bound: $push64k"
  pull64k=$(grep '"op":"pull","value_bytes":65536,' <<<"$results")
  if [ "$transport" = tcp ]; then
    grep -q '{"baseline":"tcp_rpc","value_bytes":65536,"bytes_per_s":[1-9]' <<<"$out" ||
      fail "tcp: no tcp_rpc baseline at 64 KiB"
    grep -Eq '"bound":"tcp_rpc","bound_value":[1-9][0-9]*,"ratio_to_bound":' <<<"$pull64k" ||
      fail "tcp: 64 KiB pull has no ratio to its bound: $pull64k"
  else
    grep -q ratio_to_bound <<<"$(grep '"op":"pull"' <<<"$results")" && fail "shm: a pull claims a bound"
  fi
  for b in tcp_stream tcp_pingpong_64B memcpy; do
    grep -q "{\"baseline\":\"$b\"" <<<"$out" || fail "$transport: no $b baseline"
  done
done
# The rows workload on a table of pskv-bench's own process: inserts, then pulls and pushes, each
# beside the memory's limit for a row per id (random_rows) measured in the same run.
out=$("$BENCH" --json --workload rows --transport table --table-keys 20000 --clients 1 --seconds 0.05) ||
  fail "the rows workload on --transport table failed"
grep -Eq '"transport":"table","workload":"rows","op":"insert",.*"inserts_per_s":[1-9].*"bytes_per_row":[1-9]' <<<"$out" ||
  fail "table: no insert result: $out"
for op in pull push; do
  line=$(grep "\"transport\":\"table\",\"workload\":\"rows\",\"dist\":\"uniform\",\"op\":\"$op\"" <<<"$out") ||
    fail "table: no $op result"
  grep -Eq '"rows_per_s":[1-9].*"baseline":"random_rows","baseline_value":[1-9][0-9]*,"ratio":[0-9]*\.?[0-9]*[1-9]' <<<"$line" ||
    fail "table: $op has no ratio to random_rows: $line"
done
grep -q '"baseline":"\(tcp_stream\|tcp_pingpong_64B\|memcpy\)"' <<<"$out" &&
  fail "table: measured a transport's limits it is not read against"
"$BENCH" --workload sparse --transport table >/dev/null 2>&1 && fail "--transport table took a workload other than rows"
# Rows through a server with two batches in flight per client: each pull and push line says so.
out=$("$BENCH" --json --workload rows --transport tcp --table-keys 20000 --clients 1 --seconds 0.05 --depth 2) ||
  fail "the rows workload with --depth 2 failed"
for op in pull push; do
  line=$(grep "\"workload\":\"rows\",\"dist\":\"uniform\",\"op\":\"$op\"" <<<"$out") || fail "depth 2: no $op: $out"
  grep -Eq '"depth":2,.*"ops":([3-9]|[1-9][0-9]+),"rows_per_s":[1-9]' <<<"$line" || fail "depth 2: $op: $line"
done
# A replicated server killed mid-run and restarted: the workers retry, so the run succeeds, and
# it reports its longest step and the restart.
out=$("$BENCH" --json --workload steps --transport tcp --servers 2 --replicas 2 --workers 2 --sizes 4K --mode ssp \
  --steps 200 --retry-timeout-ms 30000 --kill-at-step 100 2>/dev/null) || fail "the run with a kill failed"
steps=$(grep '"workload":"steps"' <<<"$out") || fail "no steps result with a kill"
grep -Eq '"max_step_us":[1-9]' <<<"$steps" || fail "no longest step: $steps"
grep -Eq '"killed_at_step":100,"restart_ms":[0-9]*\.?[0-9]*[1-9]' <<<"$steps" || fail "no restart time: $steps"
# With failover the killed server is not restarted: its successor serves its keys, and the
# workers carry on there.
out=$("$BENCH" --json --workload steps --transport tcp --servers 3 --replicas 2 --workers 2 --sizes 4K --mode ssp \
  --steps 200 --retry-timeout-ms 30000 --kill-at-step 100 --failover-ms 500 2>/dev/null) ||
  fail "the run with a kill and failover failed"
steps=$(grep '"workload":"steps"' <<<"$out") || fail "no steps result with a kill and failover"
grep -Eq '"restart_ms":-1.0,"failover_ms":500' <<<"$steps" || fail "a restart with failover: $steps"
echo "pskv-bench JSON: ok"

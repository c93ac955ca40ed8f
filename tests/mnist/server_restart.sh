#!/usr/bin/env bash
# kill -9 a server mid-training: the launcher restarts it from its last checkpoint (--restore; an
# shm server then adopts its predecessor's segment, which is newer), the workers reconnect, and
# training still reaches the accuracy floor (ctest label `mnist`).
#   server_restart.sh PSKV_MNIST_BINARY DATA_DIR TRANSPORT [REPLICAS [FAILOVER_MS [MODE]]]
# With REPLICAS (tcp), the servers keep each other's keys and the restarted one rejoins from them;
# the workers retry, so they must see no error, and the job must end within run-to-run noise of
# the same job without the kill (run first). With FAILOVER_MS, 3 servers run and the killed one
# is not restarted at all: its successor serves its keys (failover). MODE is ssp (staleness 2) by
# default; in sync mode an shm server's successor must also adopt the steps the workers' pushes
# were summed into, or the workers' next pushes are refused and the job fails.
set -euo pipefail
bin=$1 data=$2 transport=$3 replicas=${4:-1} failover_ms=${5:-0} mode=${6:-ssp}
servers=2
[ "$failover_ms" -gt 0 ] && servers=3
floor=0.85
noise=0.02
dir=$(mktemp -d /tmp/pskv-mnist-ckpt.XXXXXX)
log=$dir/log
trap 'rm -rf "$dir"' EXIT
run_job() {
  "$bin" --launch --servers "$servers" --workers 2 --transport "$transport" --mode "$mode" --staleness 2 --data "$data" \
    --train-limit 12000 --test-limit 5000 --epochs 3 --checkpoint-dir "$1" --checkpoint-every-s 1 --json \
    --replicas "$replicas" --failover-ms "$failover_ms"
}
accuracy() { grep '^{' "$1" | tail -1 | sed -n 's/.*"test_accuracy":\([0-9.]*\).*/\1/p'; }
if [ "$replicas" -gt 1 ]; then
  mkdir "$dir/clean"
  run_job "$dir/clean" >"$dir/clean.log" 2>&1 || { cat "$dir/clean.log"; echo "the unkilled job failed" >&2; exit 1; }
  clean=$(accuracy "$dir/clean.log")
  echo "unkilled: accuracy $clean"
fi
run_job "$dir" >"$log" 2>&1 &
job=$!
# The launcher prints each server's pid; kill server 1 once it has written a checkpoint that
# holds the model (over 64 KiB: the MLP's keys), so the kill lands mid-training. A checkpoint
# of the empty store is written before the workers' initial barrier, and a kill then is another
# test's business: under --straggler-policy fail the barrier fails the job by design.
ready() {
  pid=$(sed -n 's/^  server 1: pid \([0-9]*\) .*/\1/p' "$log" | head -1)
  [ -n "$pid" ] && [ -f "$dir/shard-1.ckpt" ] && [ "$(stat -c %s "$dir/shard-1.ckpt")" -gt 65536 ]
}
for _ in $(seq 1 600); do ready && break; sleep 0.1; done
ready || { cat "$log"; echo "server 1 never checkpointed the model" >&2; exit 1; }
kill -9 "$pid"
echo "killed server 1 (pid $pid) mid-training"
wait "$job" || { cat "$log"; echo "the job failed after the server kill" >&2; exit 1; }
cat "$log"
if [ "$failover_ms" -gt 0 ]; then
  grep -q "failover: server 2 serves server 1's keys" "$log" || { echo "no server took over server 1's keys" >&2; exit 1; }
  if grep -q "restarting it from" "$log"; then echo "the launcher restarted the server despite failover" >&2; exit 1; fi
else
  grep -q "restarting it from" "$log" || { echo "the launcher did not restart the server" >&2; exit 1; }
fi
# shm: the restarted server takes over its predecessor's segment (nothing since the checkpoint lost).
if [ "$replicas" -gt 1 ] && [ "$failover_ms" -eq 0 ]; then
  grep -q "replication: server 1 rejoined" "$log" || { echo "the restarted server did not rejoin from its replicas" >&2; exit 1; }
fi
if [ "$replicas" -gt 1 ] && grep -q "^worker [0-9]*: .*reconnecting" "$log"; then
  echo "a retrying worker saw an error" >&2
  exit 1
fi
if [ "$transport" = shm ]; then
  grep -q "shm.adopt: adopted [1-9][0-9]* keys" "$log" || { echo "the restarted shm server adopted nothing" >&2; exit 1; }
  if [ "$mode" = sync ]; then
    grep -q "the pending sync steps of [1-9][0-9]* keys" "$log" ||
      { echo "the restarted shm server adopted no sync steps" >&2; exit 1; }
  fi
fi
acc=$(accuracy "$log")
restarts=$(grep '^{' "$log" | tail -1 | sed -n 's/.*"server_restarts":\([0-9]*\).*/\1/p')
if [ "$failover_ms" -gt 0 ]; then
  [ "$restarts" -eq 0 ] || { echo "$restarts restarts recorded with failover" >&2; exit 1; }
else
  [ "$restarts" -ge 1 ] || { echo "no restart recorded" >&2; exit 1; }
fi
awk -v a="$acc" -v f="$floor" 'BEGIN { exit !(a >= f) }' || { echo "accuracy $acc below $floor after the restart" >&2; exit 1; }
echo "accuracy $acc >= $floor after $restarts server restart(s)"
if [ "$replicas" -gt 1 ]; then
  awk -v a="$acc" -v c="$clean" -v n="$noise" 'BEGIN { d = a - c; if (d < 0) d = -d; exit !(d <= n) }' ||
    { echo "accuracy $acc after the kill, $clean without: more than $noise apart" >&2; exit 1; }
  echo "accuracy $acc after the kill, $clean without (within $noise)"
fi

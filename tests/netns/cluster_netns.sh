#!/usr/bin/env bash
# pskv-mnist in cluster mode across network namespaces (ctest label `netns`).
#
#   cluster_netns.sh PSKV_MNIST PSKV_SERVER DATA_DIR SCENARIO
#
# Topology, all private to this test (names carry this script's pid):
#
#   pskv<pid>-br : bridge br0, ports p0..p3 (the bridge side of each host's veth)
#   pskv<pid>-r0 : eth0 10.77.0.1/24   rank 0, server 0
#   pskv<pid>-r1 : eth0 10.77.0.2/24   rank 1, server 1
#   pskv<pid>-r2 : eth0 10.77.0.3/24   rank 2, worker 0
#   pskv<pid>-r3 : eth0 10.77.0.4/24   rank 3, worker 1
#
# Every rank runs `ip netns exec NS env OMPI_COMM_WORLD_RANK=r OMPI_COMM_WORLD_SIZE=4 pskv-mnist
# --hostfile ...`, so servers bind their own namespace's address and all traffic is real TCP
# across the bridge. Nothing touches the root namespace or any address outside 10.77.0.0/24.
#
# SCENARIO
#   train      a short real training run; worker 0 must report test accuracy > 0.80 and all
#              four ranks must exit 0.
#   cut-fail   a longer run with --wait-timeout-ms 3000 and the default straggler policy (fail).
#              Once worker 0 reports training progress, the bridge port of rank 3 (worker 1) is
#              set down: worker 1 silently disappears (no FIN/RST reaches anyone). Expected:
#                - worker 0 (rank 2): its bounded reads wait for worker 1, and after the wait
#                  timeout the servers fail them with a message naming "worker 1"; it exits
#                  non-zero about 3 s after it blocks;
#                - worker 1 (rank 3): its requests go unanswered; after its io timeout
#                  (wait timeout + 10 s) it reports that the server "sent nothing ... hung or
#                  unreachable" (or "timed out") and exits non-zero;
#                - servers (ranks 0, 1): the job can no longer finish, so they must not wait for
#                  ever: they must exit by themselves (not by a signal; 0 or an error status both
#                  accepted) within CUT_BOUND_S (60 s) of the cut.
#              Every process must be gone within CUT_BOUND_S; leftovers are killed with SIGKILL
#              and the test fails. Worker statuses must be < 128 (an error exit, not a crash).
#   cut-evict  the same cut with --evict-stragglers. Expected: the servers evict worker 1 once it
#              made no progress for a whole timeout, worker 0 carries on, finishes and exits 0
#              with its JSON summary; worker 1 exits non-zero with the timeout message; the
#              servers see every worker finished or evicted and exit 0; all within CUT_BOUND_S.
#
# Skips (exit 0, "SKIPPED: ..." on stdout and stderr) only when not root or when `ip netns add`
# is refused; every other problem is a failure. Namespaces, the bridge and all processes are
# removed on every exit path (trap).
set -uo pipefail

mnist=${1:?usage: cluster_netns.sh PSKV_MNIST PSKV_SERVER DATA_DIR SCENARIO}
server=${2:?}
data=${3:?}
scenario=${4:?}
CUT_BOUND_S=${CUT_BOUND_S:-60}
TRAIN_BOUND_S=${TRAIN_BOUND_S:-240}
PORT_BASE=9100  # inside our own namespaces, so no clash with anything on the host

source "$(dirname "$0")/common.sh"
fail() {
  echo "FAILED: $*" >&2
  failed=1
}

case $scenario in train | cut-fail | cut-evict) ;; *) echo "unknown scenario '$scenario'" >&2; exit 2 ;; esac
[ "$(id -u)" = 0 ] || skip "netns tests need root (ip netns); running as uid $(id -u)"
[ -x "$mnist" ] || { echo "no pskv-mnist at $mnist" >&2; exit 1; }
[ -x "$server" ] || { echo "no pskv-server at $server" >&2; exit 1; }
[ -f "$data/train-images-idx3-ubyte" ] || { echo "no MNIST in $data: run scripts/fetch-data.sh" >&2; exit 1; }

tag=pskv$$
brns=$tag-br
hosts=("$tag-r0" "$tag-r1" "$tag-r2" "$tag-r3")
ips=(10.77.0.1 10.77.0.2 10.77.0.3 10.77.0.4)
work=$(mktemp -d "/tmp/pskv-netns-$scenario.XXXXXX")
failed=0
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- topology --------------------------------------------------------------------------------
bridge_hosts "$brns"
log "namespaces ${created[*]} up; bridge br0 in $brns"

# --- connectivity ----------------------------------------------------------------------------
# ping -c1 -W1 between every pair when ping is installed; otherwise (it is not on every image)
# a TCP connect to a throwaway pskv-server listening on each host's address.
if command -v ping >/dev/null; then
  for a in 0 1 2 3; do for b in 0 1 2 3; do
    [ "$a" = "$b" ] && continue
    ip netns exec "${hosts[$a]}" ping -c1 -W1 "${ips[$b]}" >/dev/null ||
      { fail "no ping from ${ips[$a]} to ${ips[$b]}"; exit 1; }
  done; done
  log "connectivity: ping between all 4 hosts ok"
else
  probe_pids=()
  for b in 0 1 2 3; do
    ip netns exec "${hosts[$b]}" "$server" --uri "tcp://${ips[$b]}:9099" --io-threads 1 >"$work/probe$b.out" 2>&1 &
    probe_pids+=($!)
    pids+=($!)
  done
  for b in 0 1 2 3; do
    wait_for_file_line "$work/probe$b.out" "listening on" 10 || { fail "probe server on ${ips[$b]} did not start"; exit 1; }
  done
  for a in 0 1 2 3; do for b in 0 1 2 3; do
    [ "$a" = "$b" ] && continue
    ip netns exec "${hosts[$a]}" timeout 3 bash -c "exec 3<>/dev/tcp/${ips[$b]}/9099" ||
      { fail "no TCP connection from ${ips[$a]} to ${ips[$b]}:9099"; exit 1; }
  done; done
  for p in "${probe_pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${probe_pids[@]}"; do wait "$p" 2>/dev/null; done
  pids=()
  log "connectivity: ping is not installed; TCP connects between all 4 hosts ok"
fi

printf '%s\n' "${ips[@]}" >"$work/hostfile"
# The job authenticates every connection, as a multi-host deployment should.
(umask 077 && head -c 32 /dev/urandom | base64 >"$work/token")

# --- the job ---------------------------------------------------------------------------------
rank_pid=()
rank_rc=()
rank_end=()
start_job() {  # extra pskv-mnist flags...
  local r
  rank_pid=() rank_rc=(-1 -1 -1 -1) rank_end=(0 0 0 0)
  for r in 0 1 2 3; do
    ip netns exec "${hosts[$r]}" env OMPI_COMM_WORLD_RANK=$r OMPI_COMM_WORLD_SIZE=4 \
      "$mnist" --servers 2 --workers 2 --transport tcp --hostfile "$work/hostfile" --port-base $PORT_BASE \
      --data "$data" --auth-token-file "$work/token" "$@" >"$work/rank$r.out" 2>"$work/rank$r.err" &
    rank_pid[$r]=$!
    pids+=($!)
  done
  log "started ranks 0-3 (pids ${rank_pid[*]}): pskv-mnist $*"
}
# Polls until every rank exited or the bound passed; records exit codes and exit times
# (seconds since `since`, with 0.1 s resolution). Returns the number still running.
wait_job() {  # BOUND_SECONDS SINCE_EPOCH_NS
  local bound=$1 since=$2 r left now
  local deadline=$((since + bound * 1000000000))
  while :; do
    left=0
    for r in 0 1 2 3; do
      [ "${rank_rc[$r]}" != -1 ] && continue
      if kill -0 "${rank_pid[$r]}" 2>/dev/null; then
        left=$((left + 1))
      else
        wait "${rank_pid[$r]}"
        rank_rc[$r]=$?
        now=$(date +%s%N)
        rank_end[$r]=$(awk -v a="$now" -v b="$since" 'BEGIN { printf "%.1f", (a - b) / 1e9 }')
      fi
    done
    ((left == 0)) && return 0
    (($(date +%s%N) > deadline)) && return "$left"
    sleep 0.1
  done
}
kill_leftovers() {
  local r
  for r in 0 1 2 3; do
    if [ "${rank_rc[$r]}" = -1 ]; then
      fail "rank $r (pid ${rank_pid[$r]}) still running at the bound: killed with SIGKILL"
      kill -9 "${rank_pid[$r]}" 2>/dev/null
      wait "${rank_pid[$r]}" 2>/dev/null
      rank_rc[$r]=killed rank_end[$r]=-
    fi
  done
}
show_logs() {
  local r
  for r in 0 1 2 3; do
    echo "--- rank $r: exit ${rank_rc[$r]} after ${rank_end[$r]} s; stdout:"
    tail -n 20 "$work/rank$r.out"
    echo "--- rank $r stderr:"
    tail -n 20 "$work/rank$r.err"
  done
}
# RANK exited by itself: not running, not killed by us or by any signal (status < 128).
exited() { [[ ${rank_rc[$1]} =~ ^[0-9]+$ ]] && ((rank_rc[$1] < 128)); }
role() { case $1 in 0 | 1) echo "server $1" ;; *) echo "worker $(($1 - 2))" ;; esac; }

common=(--mode ssp --staleness 2 --json)

if [ "$scenario" = train ]; then
  t0=$(date +%s%N)
  start_job "${common[@]}" --train-limit 6000 --test-limit 2000 --epochs 1 --quiet
  if ! wait_job "$TRAIN_BOUND_S" "$t0"; then kill_leftovers; fi
  show_logs
  for r in 0 1 2 3; do
    [ "${rank_rc[$r]}" = 0 ] || fail "rank $r ($(role $r)) exited ${rank_rc[$r]}, want 0"
  done
  json=$(grep '^{' "$work/rank2.out" | tail -n 1)
  acc=$(sed -n 's/.*"test_accuracy":\([0-9.]*\).*/\1/p' <<<"$json")
  if [ -z "$acc" ]; then
    fail "worker 0 (rank 2) printed no JSON summary"
  # (6000 samples, one epoch: 0.882-0.896 over 10 runs of the same job under --launch, 0.850 once
  # in a fresh-clone run, cause not found. A broken sum or a lost push ends far lower.)
  elif awk -v a="$acc" 'BEGIN { exit !(a > 0.80) }'; then
    log "worker 0 test accuracy $acc > 0.80"
  else
    fail "worker 0 test accuracy $acc is not above 0.80"
  fi
  log "training took $(awk -v a="$(date +%s%N)" -v b="$t0" 'BEGIN { printf "%.1f", (a - b) / 1e9 }') s"
  ((failed == 0)) && log "PASSED: $scenario" || log "FAILED: $scenario"
  exit "$failed"
fi

# --- cut-fail / cut-evict ----------------------------------------------------------------------
extra=(--train-limit 30000 --test-limit 1000 --epochs 3 --evals-per-epoch 20 --wait-timeout-ms 3000)
[ "$scenario" = cut-evict ] && extra+=(--evict-stragglers)
t0=$(date +%s%N)
start_job "${common[@]}" "${extra[@]}"
# Training is under way once worker 0 printed its first evaluation line (both workers passed
# the start barrier, and with SSP s=2 worker 1 is within 3 steps of worker 0).
if ! wait_for_file_line "$work/rank2.out" "test accuracy" 120; then
  fail "worker 0 did not report training progress within 120 s"
  wait_job 0 "$t0" >/dev/null
  kill_leftovers
  show_logs
  exit 1
fi
for r in 0 1 2 3; do
  kill -0 "${rank_pid[$r]}" 2>/dev/null || fail "rank $r ($(role $r)) is not running before the cut"
done
# Real cross-namespace TCP: each server's socket table shows both workers' addresses.
for r in 0 1; do
  peers=$(ip netns exec "${hosts[$r]}" ss -Htn state established "( sport = :$((PORT_BASE + r)) )" | awk '{print $4}')
  for w in 2 3; do
    grep -q "^${ips[$w]}:" <<<"$peers" || fail "server $r (${ips[$r]}) has no connection from ${ips[$w]}: $peers"
  done
done
((failed == 0)) && log "both servers have established connections from ${ips[2]} and ${ips[3]}"
sleep 1
log "training: $(grep 'test accuracy' "$work/rank2.out" | tail -n 1)"
tcut=$(date +%s%N)
ip -n "$brns" link set p3 down
log "cut: bridge port p3 of rank 3 (worker 1, ${ips[3]}) is down"

if ! wait_job "$CUT_BOUND_S" "$tcut"; then kill_leftovers; fi
show_logs
for r in 0 1 2 3; do
  [ "${rank_rc[$r]}" != killed ] && log "rank $r ($(role $r)) exited ${rank_rc[$r]} ${rank_end[$r]} s after the cut"
done

err2=$(cat "$work/rank2.err")
err3=$(cat "$work/rank3.err")
# Worker 1 (cut off) must say it lost its servers, and must exit non-zero.
exited 3 && [ "${rank_rc[3]}" != 0 ] || fail "worker 1 (rank 3, cut off) exited ${rank_rc[3]}, want non-zero"
grep -Eq 'sent nothing|timed out|did not answer|unreachable|lost the connection' <<<"$err3" ||
  fail "worker 1 (rank 3) gave no timeout/peer error naming its server: '$err3'"
if [ "$scenario" = cut-fail ]; then
  # The survivor must stop with an error naming the cut-off worker.
  exited 2 && [ "${rank_rc[2]}" != 0 ] || fail "worker 0 (rank 2) exited ${rank_rc[2]}, want non-zero"
  grep -q 'worker 1' <<<"$err2" || fail "worker 0's error does not name worker 1: '$err2'"
  grep -Eq 'waited|timed out|did not answer|sent nothing|disconnected' <<<"$err2" ||
    fail "worker 0's error is not a timeout/peer error: '$err2'"
  for r in 0 1; do
    exited $r || fail "server $r (rank $r) did not exit by itself within ${CUT_BOUND_S} s of the cut (status ${rank_rc[$r]})"
  done
else
  # The survivor carries on without worker 1 and finishes; the servers finish with it.
  [ "${rank_rc[2]}" = 0 ] || fail "worker 0 (rank 2) exited ${rank_rc[2]}, want 0 (worker 1 should be evicted)"
  grep -q '"test_accuracy"' "$work/rank2.out" || fail "worker 0 printed no JSON summary"
  for r in 0 1; do
    [ "${rank_rc[$r]}" = 0 ] || fail "server $r (rank $r) exited ${rank_rc[$r]}, want 0 (all workers finished or evicted)"
  done
fi
((failed == 0)) && log "PASSED: $scenario" || log "FAILED: $scenario"
exit "$failed"

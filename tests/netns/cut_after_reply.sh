#!/usr/bin/env bash
# A worker cut off just after the server sent it an answer must still be noticed by the server.
#
# TCP keepalive, the server's defence against peers that vanish without a FIN or RST, stays silent
# while anything sent is unacknowledged, and retransmissions then go on for some 15 minutes. This
# test makes that case happen on purpose, over real TCP between two network namespaces:
#   1. pskv-server (BSP, 2 workers, stragglers evicted) and worker 0 in namespace A; worker 1
#      in namespace B.
#   2. Worker 1 ends its step and pulls: the pull is parked until worker 0 ends its step too.
#   3. The link to B goes down: no FIN or RST reaches anyone.
#   4. Worker 0 ends its step: the server answers worker 1's parked pull into the dead link,
#      where the answer stays unacknowledged.
#   5. The server must drop worker 1's connection within BOUND_S (30 s; its keepalive bound is
#      5 s idle + 3 s of probes), and know worker 1 left: worker 0's next bounded read, which
#      needs worker 1's next step, is answered at once (a departed worker is evicted; one still
#      thought alive would hold it for the 120 s wait timeout).
# Skips (exit 0, "SKIPPED: ...") only when not root or when `ip netns add` is refused.
#   usage: cut_after_reply.sh PSKV_SERVER SCRIPTED_WORKER
set -uo pipefail

server=${1:?usage: cut_after_reply.sh PSKV_SERVER SCRIPTED_WORKER}
worker=${2:?}
BOUND_S=${BOUND_S:-30}
ip_a=10.78.0.1 ip_b=10.78.0.2 port=9200

source "$(dirname "$0")/common.sh"
fail() {
  echo "FAILED: $*" >&2
  exit 1
}

[ "$(id -u)" = 0 ] || skip "netns tests need root (ip netns); running as uid $(id -u)"
tag=pskvcut$$
ns_a=$tag-a ns_b=$tag-b
work=$(mktemp -d /tmp/pskv-netns-cut-after-reply.XXXXXX)
trap 'exec 7>&- 8>&- 2>/dev/null; cleanup' EXIT
trap 'exit 130' INT TERM
trap '' PIPE  # a worker that exited early must fail a check below, not kill this script silently

ip netns add "$ns_a" 2>"$work/netns.err" || skip "ip netns add is not permitted here: $(cat "$work/netns.err")"
created+=("$ns_a")
set -e
ip netns add "$ns_b"
created+=("$ns_b")
ip -n "$ns_a" link add eth0 type veth peer name eth0 netns "$ns_b"
ip -n "$ns_a" addr add "$ip_a/24" dev eth0
ip -n "$ns_b" addr add "$ip_b/24" dev eth0
for ns in "$ns_a" "$ns_b"; do
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
done
set +e

show_logs() {
  local f
  for f in server.out server.err w0.out w1.out; do
    echo "--- $f:"
    cat "$work/$f" 2>/dev/null
  done
}
worker1_connected() {
  ip netns exec "$ns_a" ss -Htn state established "( sport = :$port )" | grep -q " $ip_b:"
}

ip netns exec "$ns_a" "$server" --uri "tcp://$ip_a:$port" --workers 2 --mode bsp --wait-timeout-ms 120000 --straggler-policy evict \
  >"$work/server.out" 2>"$work/server.err" &
pids+=($!)
wait_for_file_line "$work/server.out" "listening on" 10 || { show_logs; fail "pskv-server did not start"; }

mkfifo "$work/w0.in" "$work/w1.in"
ip netns exec "$ns_a" "$worker" "tcp://$ip_a:$port" 0 <"$work/w0.in" >"$work/w0.out" 2>&1 &
pids+=($!)
exec 7>"$work/w0.in"
ip netns exec "$ns_b" "$worker" "tcp://$ip_a:$port" 1 <"$work/w1.in" >"$work/w1.out" 2>&1 &
pids+=($!)
exec 8>"$work/w1.in"

echo "init 7 1024" >&7
wait_for_file_line "$work/w0.out" "ok init" 10 || { show_logs; fail "worker 0 could not init the key"; }
echo "clock" >&8
wait_for_file_line "$work/w1.out" "ok clock" 10 || { show_logs; fail "worker 1 could not end its step"; }
echo "pull 7 1024" >&8
wait_for_file_line "$work/w1.out" "pulling" 10 || { show_logs; fail "worker 1 did not send its pull"; }
sleep 0.5  # the pull crosses the link and is parked
grep -q "ok pull" "$work/w1.out" && { show_logs; fail "worker 1's pull was answered before worker 0 ended its step (not BSP?)"; }
worker1_connected || { show_logs; fail "the server shows no connection from worker 1 ($ip_b)"; }

ip -n "$ns_b" link set eth0 down
tcut=$SECONDS
log "cut: worker 1's link ($ip_b) is down, its pull parked"
echo "clock" >&7
wait_for_file_line "$work/w0.out" "ok clock" 10 || { show_logs; fail "worker 0 could not end its step"; }
log "worker 0 ended its step: the server answered worker 1's pull into the cut link"

while worker1_connected; do
  if ((SECONDS - tcut > BOUND_S)); then
    ip netns exec "$ns_a" ss -tni "( sport = :$port )"
    show_logs
    fail "the server still holds worker 1's connection ${BOUND_S} s after the cut"
  fi
  sleep 0.2
done
log "the server dropped worker 1's connection $((SECONDS - tcut)) s after the cut"
# The worker runs its commands in order and exits on an error, so "ok pull" says both went.
echo "clock" >&7
echo "pull 7 1024" >&7
wait_for_file_line "$work/w0.out" "ok pull" 10 ||
  { show_logs; fail "worker 0's read that needs worker 1's next step was not answered: the server missed worker 1 leaving"; }
log "PASSED: worker 1 was evicted, and worker 0's read went ahead"

#!/usr/bin/env bash
# Replicated tcp servers (--replicas 2) across network namespaces, with links cut silently
# (blackhole routes both ways: no FIN or RST reaches anyone), and a worker that retries
# (ClientOptions::retry_timeout) pushing all along (ctest label `netns`).
#
#   replication_cut.sh PSKV_SERVER RETRYING_PUSHER SCENARIO
#
# Hosts on one bridge: s0, s1, s2 (servers 0-2, 10.79.0.1-3; server i's keys are kept by server
# i+1), w (the worker, 10.79.0.4). The worker's pushes touch every server.
#
# SCENARIO
#   cut-backup  the link between server 1 and its backup, server 2, is cut for 8 s. Documented
#               behaviour: server 1 drops server 2 as a replica once it was silent for the frame
#               timeout (2 s) and goes on acknowledging without it (the worker's pushes carry on
#               during the cut); no other server starts serving server 1's keys (these servers
#               run without --failover-ms), so there is no second primary; once the link is back, server 1 sends
#               server 2 all its keys again and it is synced.
#   cut-client  the link between the worker and server 1 is cut for 5 s: the worker's pushes stop
#               until it is back (its io timeout fails the connection, it reconnects once it can
#               and sends its unanswered pushes again), and it sees no error.
#   failover-cut-backup  as cut-backup, with failover (--failover-ms 1000): server 2, which holds
#               server 1's replica, takes server 1 for dead, and server 1 takes server 2 for dead.
#               Documented behaviour: each asks the servers for the other's certificate; server 0
#               grants only one, so exactly one of them wins and the other, refused as down, stops
#               (exit status 3): no split brain. The worker follows the keys of the stopped one to
#               the winner's side and sees no error.
#   failover-cut-client  as cut-client, with failover: the servers still reach each other, so
#               nobody is certified down (no server stops), and the worker waits for the link
#               as before.
# In all: the worker ends with every key equal to its number of pushes, all acknowledged
# (nothing lost, nothing applied twice), and (but after a failover) every replica synced.
#
# Skips (exit 0, "SKIPPED: ...") only when not root or when `ip netns add` is refused.
set -uo pipefail

server=${1:?usage: replication_cut.sh PSKV_SERVER RETRYING_PUSHER SCENARIO}
pusher=${2:?}
scenario=${3:?}
port=9300

source "$(dirname "$0")/common.sh"
fail() {
  echo "FAILED: $*" >&2
  show_logs
  exit 1
}

case $scenario in cut-backup | cut-client | failover-cut-backup | failover-cut-client) ;; *) echo "unknown scenario '$scenario'" >&2; exit 2 ;; esac
[ "$(id -u)" = 0 ] || skip "netns tests need root (ip netns); running as uid $(id -u)"
tag=pskvrep$$
brns=$tag-br
hosts=("$tag-s0" "$tag-s1" "$tag-s2" "$tag-w")
ips=(10.79.0.1 10.79.0.2 10.79.0.3 10.79.0.4)
work=$(mktemp -d "/tmp/pskv-netns-$scenario.XXXXXX")
trap cleanup EXIT
trap 'exit 130' INT TERM

show_logs() {
  local f
  for f in "$work"/*.log; do
    echo "--- $f:"
    tail -40 "$f"
  done
}

bridge_hosts "$brns"

# Silently, both ways: each side's packets to the other are dropped at its own routing table.
cut() { ip -n "${hosts[$1]}" route add blackhole "${ips[$2]}/32" && ip -n "${hosts[$2]}" route add blackhole "${ips[$1]}/32"; }
heal() { ip -n "${hosts[$1]}" route del blackhole "${ips[$2]}/32" && ip -n "${hosts[$2]}" route del blackhole "${ips[$1]}/32"; }
acknowledged() { sed -n 's/^acknowledged \([0-9]*\)$/\1/p' "$work/worker.log" | tail -1; }

peers="tcp://${ips[0]}:$port,tcp://${ips[1]}:$port,tcp://${ips[2]}:$port"
failover=()
[[ $scenario == failover-* ]] && failover=(--failover-ms 1000 --failover-dir "$work/votes")
for s in 0 1 2; do
  ip netns exec "${hosts[$s]}" "$server" --uri "tcp://${ips[$s]}:$port" --server-id $s --replicas 2 --peers "$peers" \
    --rule add --workers 1 --frame-timeout-ms 2000 "${failover[@]}" >"$work/server$s.log" 2>&1 &
  pids+=($!)
done
for s in 0 1 2; do
  wait_for_file_line "$work/server$s.log" "listening on" 10 || fail "server $s did not start"
done
keys_only=()
[ "$scenario" = failover-cut-backup ] && keys_only=(--keys-only)  # the server certified down stays down
ip netns exec "${hosts[3]}" "$pusher" "$peers" 12 "$work/stop" "${keys_only[@]}" >"$work/worker.log" 2>&1 &
worker=$!
pids+=($worker)
wait_for_file_line "$work/worker.log" "^acknowledged 200$" 60 || fail "the worker did not get going"

case $scenario in
cut-backup)
  cut 1 2 || fail "could not cut the link"
  log "cut: server 1 <-> server 2 (its backup)"
  sleep 3  # past the frame timeout: server 1 has dropped its backup
  before=$(acknowledged)
  sleep 5
  during=$(acknowledged)
  heal 1 2 || fail "could not heal the link"
  log "healed; the worker's pushes went from $before to $during during the cut's last 5 s"
  ((during > before)) || fail "server 1 stopped acknowledging while cut off from its backup ($before -> $during)"
  grep -q "replica server 2 .* dropped" "$work/server1.log" || fail "server 1 never dropped its cut-off backup"
  ;;
failover-cut-backup)
  cut 1 2 || fail "could not cut the link"
  log "cut: server 1 <-> server 2 (its backup), with failover"
  sleep 8
  heal 1 2 || fail "could not heal the link"
  stopped=()
  for s in 1 2; do
    if ! kill -0 "${pids[$s]}" 2>/dev/null; then
      wait "${pids[$s]}"
      rc=$?
      [ "$rc" = 3 ] || fail "server $s ended with status $rc, not 3 (deposed)"
      stopped+=("$s")
    fi
  done
  [ "${#stopped[@]}" = 1 ] || fail "servers ${stopped[*]:-none} stopped: exactly one of servers 1 and 2 must"
  kill -0 "${pids[0]}" 2>/dev/null || fail "server 0 stopped"
  winner=$((3 - stopped[0]))
  grep -q "failover: server $winner serves server ${stopped[0]}'s keys" "$work/server$winner.log" ||
    grep -q "failover: server 0 serves server ${stopped[0]}'s keys" "$work/server0.log" ||
    fail "nobody serves the keys of server ${stopped[0]}, which stopped"
  log "server ${stopped[0]} was certified down and stopped; server $winner carried on"
  ;;
cut-client | failover-cut-client)
  cut 3 1 || fail "could not cut the link"
  log "cut: the worker <-> server 1"
  sleep 5
  heal 3 1 || fail "could not heal the link"
  during=$(acknowledged)
  log "healed at $during pushes"
  for s in 0 1 2; do
    kill -0 "${pids[$s]}" 2>/dev/null || fail "server $s stopped, though only a worker's link was cut"
  done
  ;;
esac
# The worker carries on after the heal.
target=$(( $(acknowledged) + 200 ))
wait_for_file_line "$work/worker.log" "^acknowledged $target$" 60 || fail "the worker did not carry on after the heal"
touch "$work/stop"
wait "$worker"
rc=$?
[ "$rc" = 0 ] || fail "the worker saw an error (exit $rc): $(grep error "$work/worker.log")"
grep -q "^PASSED" "$work/worker.log" || fail "the worker did not finish its checks"
log "PASSED: $(grep '^PASSED' "$work/worker.log"); $(grep -c 'dropped' "$work/server1.log") replica drop(s) on server 1"

# Sourced by the netns test scripts. The sourcing script sets `work` (its temp dir) and fills
# `created` (namespaces it made) and `pids` (processes it started); `cleanup` undoes all of it.

skip() {
  echo "SKIPPED: $*"
  echo "SKIPPED: $*" >&2
  exit 0
}
log() { echo "[$(date +%T.%3N)] $*"; }

created=()
pids=()

# Kills whatever still runs in our namespaces (only processes this test started can be there),
# then deletes the namespaces; deleting a namespace destroys its veth ends (and any bridge).
cleanup() {
  local ns p
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  for ns in "${created[@]}"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
  done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  for ns in "${created[@]}"; do ip netns del "$ns" 2>/dev/null; done
  rm -rf "$work"
}

# Namespace $1 holding a bridge br0, and one namespace per entry of the caller's `hosts` joined to
# it (veth p<i> on the bridge, eth0 inside with ips[i]/24). Skips the test when namespaces are not
# permitted; exits on any other failure.
bridge_hosts() {
  local brns=$1 r ns
  ip netns add "$brns" 2>"$work/netns.err" || skip "ip netns add is not permitted here: $(cat "$work/netns.err")"
  created+=("$brns")
  set -e
  ip -n "$brns" link add br0 type bridge
  ip -n "$brns" link set br0 up
  ip -n "$brns" link set lo up
  for r in "${!hosts[@]}"; do
    ns=${hosts[$r]}
    ip netns add "$ns"
    created+=("$ns")
    ip -n "$brns" link add "p$r" type veth peer name eth0 netns "$ns"
    ip -n "$brns" link set "p$r" master br0
    ip -n "$brns" link set "p$r" up
    ip -n "$ns" addr add "${ips[$r]}/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
  set +e
}

wait_for_file_line() {  # FILE PATTERN SECONDS
  local deadline=$((SECONDS + $3))
  while ((SECONDS < deadline)); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.05
  done
  return 1
}

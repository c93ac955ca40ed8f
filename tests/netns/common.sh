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

wait_for_file_line() {  # FILE PATTERN SECONDS
  local deadline=$((SECONDS + $3))
  while ((SECONDS < deadline)); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.05
  done
  return 1
}

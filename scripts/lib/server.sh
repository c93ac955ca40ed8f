# Shell helpers for scripts that start pskv-server themselves. Source it.

# Prints the URI from pskv-server's "listening on URI ..." line in FILE, waiting up to
# SECONDS (10) for the line; prints nothing and fails if it never comes.
pskv_server_uri() {  # FILE [SECONDS]
  local file=$1 tenths=$(( ${2:-10} * 10 )) uri
  for _ in $(seq "$tenths"); do
    uri=$(sed -n 's/.*listening on \([^ ]*\).*/\1/p' "$file" 2>/dev/null)
    [ -n "$uri" ] && { echo "$uri"; return 0; }
    sleep 0.1
  done
  return 1
}

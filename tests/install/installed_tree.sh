#!/usr/bin/env bash
# The installed tree works on its own: `cmake --install` into a fresh prefix, then its
# pskv-server serves, and a consumer project built against the installed package (find_package,
# pskv::pskv) talks to it. Nothing from the build tree is on any path the binaries use.
#   installed_tree.sh BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/../../scripts/lib/server.sh"
BUILD=$1
WORK=$(mktemp -d /tmp/pskv-install.XXXXXX)
SERVER_PID=
cleanup() {
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
PREFIX=$WORK/prefix
cmake --install "$BUILD" --prefix "$PREFIX" >/dev/null
# Moved after installing: a RUNPATH relative to the binary still finds the library.
mv "$PREFIX" "$WORK/moved"
PREFIX=$WORK/moved
env -u LD_LIBRARY_PATH "$PREFIX/bin/pskv-server" --help >/dev/null || { echo "installed pskv-server does not run" >&2; exit 1; }

mkdir -p "$WORK/consumer"
cat > "$WORK/consumer/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.20)
project(consumer LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(pskv REQUIRED)
add_executable(consumer main.cc)
target_link_libraries(consumer PRIVATE pskv::pskv)
set_target_properties(consumer PROPERTIES BUILD_RPATH "${pskv_DIR}/../..")
CMAKE
cat > "$WORK/consumer/main.cc" <<'CC'
#include <pskv/client.h>
#include <cstdio>
#include <vector>
int main(int argc, char** argv) {
  pskv::ClientOptions o;
  o.servers = {argv[1]};
  pskv::Client c(o);
  std::vector<float> v(64, 2.0f), out(64);
  c.wait(c.init(pskv::Key(7), v));
  c.wait(c.push(pskv::Key(7), v));
  c.wait(c.pull(pskv::Key(7), out));
  std::printf("%g\n", out[0]);
  return out[63] == 4.0f ? 0 : 1;
}
CC
cmake -S "$WORK/consumer" -B "$WORK/consumer/build" -G Ninja -DCMAKE_PREFIX_PATH="$PREFIX" >/dev/null
cmake --build "$WORK/consumer/build" >/dev/null

"$PREFIX/bin/pskv-server" --uri tcp://127.0.0.1:0 > "$WORK/server.out" &
SERVER_PID=$!
URI=$(pskv_server_uri "$WORK/server.out") || { echo "installed pskv-server did not start" >&2; exit 1; }
got=$(env -u LD_LIBRARY_PATH "$WORK/consumer/build/consumer" "$URI")
[ "$got" = 4 ] || { echo "consumer read $got, expected 4" >&2; exit 1; }
echo "installed tree: pskv-server runs from a moved prefix; a find_package(pskv) consumer read $got"

# The Python package, when the build made one: imported from the moved prefix by the system
# python3, it finds libpskv and the installed pskv-server relative to itself.
site=$(ls -d "$PREFIX"/lib/python3*/dist-packages 2>/dev/null | head -1)
if [ -n "$site" ] && [ -d "$site/pskv" ]; then
  py=$(env -u LD_LIBRARY_PATH -u PSKV_SERVER_BIN PYTHONPATH="$site" /usr/bin/python3 -c '
import numpy as np, os, pskv, sys
assert pskv.__file__.startswith(sys.argv[1]), pskv.__file__
with pskv.launch(1, "tcp") as servers:
    assert os.path.realpath(servers.binary).startswith(os.path.realpath(sys.argv[2])), servers.binary
    with pskv.Client(servers.uris[0]) as c:
        a = np.full(16, 2.0, np.float32)
        c.init(5, a).wait()
        c.push(5, a).wait()
        c.pull(5, a).wait()
        print(a[0])
' "$site" "$PREFIX") || { echo "the installed pskv Python package did not work" >&2; exit 1; }
  [ "$py" = 4.0 ] || { echo "the installed Python package read $py, expected 4.0" >&2; exit 1; }
  echo "installed tree: the pskv Python package from the moved prefix launched its pskv-server and read $py"
fi

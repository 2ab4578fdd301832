#!/usr/bin/env bash
# Install the pinned Zellij once into a cache directory and print the binary's
# path. A fresh build takes about 20 minutes on 2 cores; later calls reuse the
# cached binary and return at once.
#
#   tests/install-zellij.sh            # prints e.g. ~/.cache/keystone-agent/zellij-0.45.1/bin/zellij
#
# KEYSTONE_CACHE_DIR overrides the cache directory
# (default: ${XDG_CACHE_HOME:-~/.cache}/keystone-agent).
set -euo pipefail

version=0.45.1
cache="${KEYSTONE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/keystone-agent}"
root="$cache/zellij-$version"
bin="$root/bin/zellij"

if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -qx "zellij $version"; then
  echo "$bin"
  exit 0
fi

command -v cargo >/dev/null || { echo "install-zellij: cargo is missing (https://rustup.rs)" >&2; exit 4; }
echo "install-zellij: building zellij $version into $root (about 20 minutes on 2 cores, once)" >&2
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
# Build beside the cache and move into place, so an interrupted build never
# leaves a half-written binary that a later call would trust.
CARGO_TARGET_DIR="$build/target" cargo install --locked --quiet \
  --root "$build/root" --version "$version" zellij >&2
mkdir -p "$root/bin"
mv "$build/root/bin/zellij" "$bin.tmp"
mv "$bin.tmp" "$bin"
"$bin" --version >&2
echo "$bin"

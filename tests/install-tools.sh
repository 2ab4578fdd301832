#!/usr/bin/env bash
# Install a pinned tool from crates.io once into a cache directory and print
# its binary's path. Later calls reuse the cached binary and return at once.
#
#   tests/install-tools.sh zellij              # Zellij 0.45.1 (sessions; ~20 min to build)
#   tests/install-tools.sh vhost-device-vsock  # the vm backend's vsock device (~1 min)
#   tests/install-tools.sh zellij --cached     # its path if it is cached, else exit 1
#
# KEYSTONE_CACHE_DIR overrides the cache directory
# (default: ${XDG_CACHE_HOME:-~/.cache}/keystone-agent).
set -euo pipefail

tool=${1:?usage: install-tools.sh zellij|vhost-device-vsock}
# expected: about how long a build takes on 2 cores (for progress messages).
case "$tool" in
  zellij) version=0.45.1 expected=1200 ;;
  vhost-device-vsock) version=0.3.0 expected=60 ;;
  *) echo "install-tools: unknown tool $tool (zellij, vhost-device-vsock)" >&2; exit 2 ;;
esac
cache="${KEYSTONE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/keystone-agent}"
root="$cache/$tool-$version"
bin="$root/bin/$tool"

if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -qx "$tool $version"; then
  echo "$bin"
  exit 0
fi
[ "${2:-}" != --cached ] || exit 1

command -v cargo >/dev/null || { echo "install-tools: cargo is missing (https://rustup.rs)" >&2; exit 4; }
echo "install-tools: building $tool $version into $root (once)" >&2
build=$(mktemp -d)
# While it builds, a marker says so (agentd reads it: `agentctl attach`
# tells how long is left); KEYSTONE_BUILD_LOG names where the output goes.
mkdir -p "$cache"
marker="$root.building"
printf 'started=%s\nexpected=%s\npid=%s\nlog=%s\n' "$(date +%s)" "$expected" "$$" "${KEYSTONE_BUILD_LOG:-}" >"$marker"
trap 'rm -rf "$build" "$marker"' EXIT
# Build beside the cache and move into place, so an interrupted build never
# leaves a half-written binary that a later call would trust.
CARGO_TARGET_DIR="$build/target" cargo install --locked --quiet \
  --root "$build/root" --version "$version" "$tool" >&2
mkdir -p "$root/bin"
mv "$build/root/bin/$tool" "$bin.tmp"
mv "$bin.tmp" "$bin"
"$bin" --version >&2
echo "$bin"

#!/usr/bin/env bash
# Install a pinned tool from crates.io once into a cache directory and print
# its binary's path. Later calls reuse the cached binary and return at once.
#
#   tests/install-tools.sh zellij              # Zellij 0.45.1 (sessions; 10-20 min to build)
#   tests/install-tools.sh zellij --cached     # its path if it is cached, else exit 1
#
# KEYSTONE_CACHE_DIR overrides the cache directory
# (default: ${XDG_CACHE_HOME:-~/.cache}/keystone-agent).
set -euo pipefail

tool=${1:?usage: install-tools.sh zellij}
# expected: about how long a build takes on 2 cores (for progress messages,
# until cargo has compiled its first units).
# curve: UNITS:TIME points, how far the build is in time (per mille) when
# cargo has compiled a share of its units (per mille), measured on one
# build with these options (agentd's tools::build_left reads them): the
# last units (Zellij's own crates, wasmtime, cranelift) take most of the
# time, so the share of units done alone would promise the end far too early.
# options: what cargo builds.
case "$tool" in
  zellij)
    version=0.45.1 expected=900
    curve=300:82,317:112,333:263,530:345,910:540,930:645,988:681,990:764,995:790,997:993
    # Zellij's default features minus `web_server_capability` (`zellij web`,
    # its HTTP server and a bundled SQLite: sessions never use it). Kept:
    # `vendored_curl` (a static libcurl and OpenSSL, so the binary copied
    # into vm guests and Pods needs no libcurl there) and
    # `plugins_from_target` (inert in a release build). Its release profile
    # asks for fat LTO in one codegen unit, which alone took most of a
    # 34-minute build on 2 cores; the default release profile (thin local
    # LTO, 16 units, opt-level 3) builds the same program in a fraction.
    options=(--no-default-features --features plugins_from_target,vendored_curl)
    export CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16
    ;;
  *) echo "install-tools: unknown tool $tool (zellij)" >&2; exit 2 ;;
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
# `units=DONE/TOTAL` is cargo's own progress (and `units_at=` when it got
# there), rewritten as it moves.
mkdir -p "$cache"
marker="$root.building"
started=$(date +%s)
mark() {
  printf 'started=%s\nexpected=%s\npid=%s\nlog=%s\ncurve=%s\n%s' "$started" "$expected" "$$" \
    "${KEYSTONE_BUILD_LOG:-}" "$curve" "${1:+units=$1
units_at=$(date +%s)
}" >"$marker.tmp"
  mv "$marker.tmp" "$marker"
}
mark ""
trap 'rm -rf "$build" "$marker" "$marker.tmp"' EXIT
# cargo's progress bar (`Building [===>  ] 123/456: crate…`), which it draws
# on a terminal only unless told: each new count goes to the marker, every
# twentieth of the units as a line to the output, with what is not
# routine (warnings, errors).
progress() {
  local line seen= said=-1
  while IFS= read -r line; do
    if [[ $line =~ Building\ \[[^]]*\]\ ([0-9]+)/([0-9]+) ]]; then
      local done=${BASH_REMATCH[1]} total=${BASH_REMATCH[2]}
      [ "$done/$total" != "$seen" ] || continue
      seen=$done/$total
      mark "$seen"
      if [ $((done * 20 / total)) != "$said" ]; then
        said=$((done * 20 / total))
        echo "install-tools: $seen units compiled after $(($(date +%s) - started))s" >&2
      fi
    elif [[ -n $line && ! $line =~ ^\ *(Compiling|Downloaded|Downloading|Updating|Locking|Adding)\  ]]; then
      printf '%s\n' "$line" >&2
    fi
  done
}
# Build beside the cache and move into place, so an interrupted build never
# leaves a half-written binary that a later call would trust.
{
  CARGO_TARGET_DIR="$build/target" CARGO_TERM_PROGRESS_WHEN=always CARGO_TERM_PROGRESS_WIDTH=100 \
    cargo install --locked --root "$build/root" --version "$version" "${options[@]}" "$tool" \
    2>&1 >&3 | stdbuf -oL tr '\r' '\n' | progress
} 3>&2
echo "install-tools: built $tool $version in $(($(date +%s) - started))s" >&2
mkdir -p "$root/bin"
mv "$build/root/bin/$tool" "$bin.tmp"
mv "$bin.tmp" "$bin"
"$bin" --version >&2
echo "$bin"

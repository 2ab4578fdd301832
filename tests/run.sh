#!/usr/bin/env bash
# The test suite: install the pinned Zellij once (cached; the session tests
# attach to it), then run every test of the workspace. Extra arguments go to
# `cargo test`.
#
#   tests/run.sh                 # everything
#   tests/run.sh --test session  # one test file
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for tool in cargo git dbus-daemon busctl tmux caddy; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
  echo "tests: missing: ${missing[*]}" >&2
  echo "  Debian/Ubuntu: sudo apt-get install -y dbus systemd git tmux caddy   (and Rust from https://rustup.rs)" >&2
  echo "  NixOS:         nix-shell -p cargo git dbus systemd tmux caddy" >&2
  exit 4
fi

KEYSTONE_ZELLIJ="$(tests/install-zellij.sh)"
export KEYSTONE_ZELLIJ
exec cargo test --workspace --locked "$@"

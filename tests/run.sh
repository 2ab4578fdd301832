#!/usr/bin/env bash
# The test suite: install the pinned Zellij once (cached; the session tests
# attach to it), run every test of the workspace, then (as root) the VM
# suite, tests/run-vm.sh, which boots real QEMU guests. Extra arguments go
# to `cargo test` and skip the VM suite.
#
#   tests/run.sh                 # everything
#   tests/run.sh --test session  # one test file
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for tool in cargo git dbus-daemon busctl tmux caddy make; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
  echo "tests: missing: ${missing[*]}" >&2
  echo "  Debian/Ubuntu: sudo apt-get install -y dbus systemd git tmux caddy make man-db bash-completion   (and Rust from https://rustup.rs)" >&2
  echo "  NixOS:         nix-shell -p cargo git dbus systemd tmux caddy gnumake man-db bash-completion" >&2
  exit 4
fi

KEYSTONE_ZELLIJ="$(tests/install-zellij.sh)"
export KEYSTONE_ZELLIJ
if (($#)); then
  exec cargo test --workspace --locked "$@"
fi
cargo test --workspace --locked
if [ "$(id -u)" != 0 ]; then
  if [ -n "${KEYSTONE_REQUIRE_VM:-}" ]; then
    echo "tests: the VM suite needs root" >&2
    exit 4
  fi
  echo "tests: VM suite not run: it needs root (sudo tests/run-vm.sh)" >&2
  exit 0
fi
exec tests/run-vm.sh

#!/usr/bin/env bash
# Quick start on a plain Linux machine: build agentd and agentctl, start
# agentd on your session bus (starting a private session bus if you have
# none), create a sandbox from PROJECT (default: a sample repository made
# here) and start it.
#
#   tests/quickstart.sh [PROJECT]
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for tool in cargo git dbus-daemon; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
  echo "quickstart: missing: ${missing[*]}" >&2
  echo "  Debian/Ubuntu: sudo apt-get install -y dbus git   (and Rust from https://rustup.rs)" >&2
  echo "  NixOS:         nix-shell -p cargo git dbus" >&2
  exit 4
fi

echo "==> building agentd and agentctl"
cargo build --quiet --bins
# Sessions (agentctl attach) run the pinned Zellij inside the sandbox: built
# once into a cache (about 20 minutes the first time), reused after that.
echo "==> Zellij for sessions"
KEYSTONE_ZELLIJ="$(tests/install-zellij.sh)"
export KEYSTONE_ZELLIJ
bin="$PWD/target/debug"
state="${XDG_STATE_HOME:-$HOME/.local/state}/keystone/agent"
mkdir -p "$state"

if [ -z "${DBUS_SESSION_BUS_ADDRESS:-}" ]; then
  sock="$state/session-bus.sock"
  if [ ! -S "$sock" ] || ! busctl --address="unix:path=$sock" status >/dev/null 2>&1; then
    rm -f "$sock"
    dbus-daemon --session --fork --address="unix:path=$sock" >/dev/null
    echo "==> started a session bus at unix:path=$sock"
  fi
  export DBUS_SESSION_BUS_ADDRESS="unix:path=$sock"
fi
ctl=("$bin/agentctl" --bus session)

# Dev-server links when Caddy is installed: Caddy with only its admin API on
# localhost:2019; agentd adds a server on 127.0.0.1:8080 for names under
# sandbox.localhost, which browsers resolve to this machine by themselves.
agentd_args=(--session)
if command -v caddy >/dev/null; then
  config="$state/agentd.json"
  cat >"$config" <<'JSON'
{"proxy": {"enable": true, "domain": "sandbox.localhost", "listen": ["127.0.0.1:8080"]}}
JSON
  agentd_args+=(--config "$config")
  if ! (exec 3<>/dev/tcp/127.0.0.1/2019) 2>/dev/null; then
    echo '{"admin": {"listen": "127.0.0.1:2019"}}' >"$state/caddy.json"
    echo "==> starting Caddy (admin API on 127.0.0.1:2019, log: $state/caddy.log)"
    nohup caddy run --config "$state/caddy.json" >>"$state/caddy.log" 2>&1 &
  fi
else
  echo "==> no caddy: dev-server links are off (Debian/Ubuntu: sudo apt-get install -y caddy)"
fi

if ! "${ctl[@]}" list >/dev/null 2>&1; then
  echo "==> starting agentd --session (log: $state/agentd.log)"
  nohup "$bin/agentd" "${agentd_args[@]}" >>"$state/agentd.log" 2>&1 &
  for _ in $(seq 100); do "${ctl[@]}" list >/dev/null 2>&1 && break; sleep 0.1; done
fi

project="${1:-}"
if [ -z "$project" ]; then
  project="$state/sample-project"
  if [ ! -d "$project/.git" ]; then
    mkdir -p "$project"
    git -C "$project" init -q -b main
    printf '# Sample project\n\nA repository for your first Keystone Agent sandbox.\n' >"$project/README.md"
    git -C "$project" add README.md
    git -C "$project" -c user.name=Keystone -c user.email=keystone@localhost commit -qm "Sample project"
  fi
fi
project="$(cd "$project" && pwd)"
name="$(basename "$project" | tr 'A-Z_. ' 'a-z---' | sed 's/^[^a-z]*//; s/-*$//' | cut -c1-31)"

if ! "${ctl[@]}" status "$name" >/dev/null 2>&1; then
  "${ctl[@]}" create --name "$name" "$project"
fi
if [ "$("${ctl[@]}" status "$name" --json | sed -n 's/.*"state": "\(.*\)".*/\1/p')" != running ]; then
  "${ctl[@]}" start "$name"
fi
echo "==> inside the sandbox:"
"${ctl[@]}" exec "$name" -- sh -c 'echo "host: $(hostname)  cwd: $(pwd)"; git log --oneline -3'
cat <<MSG

Sandbox '$name' is running. Try:
  export AGENTCTL_BUS=session DBUS_SESSION_BUS_ADDRESS=$DBUS_SESSION_BUS_ADDRESS
  $bin/agentctl list
  $bin/agentctl exec $name -- git status
  $bin/agentctl attach $name              # a Zellij session in /workspace; detach with Ctrl+o d
  $bin/agentctl exec $name -- sh -c 'python3 -m http.server 8000 >/dev/null 2>&1 &'
  $bin/agentctl open $name                # http://$name.sandbox.localhost:8080/ (needs caddy)
  $bin/agentctl stop $name && $bin/agentctl destroy $name
agentd keeps running in the background (log: $state/agentd.log); stop it with: pkill -f 'agentd --session'
MSG

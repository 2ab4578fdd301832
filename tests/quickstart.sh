#!/usr/bin/env bash
# Quick start on a plain Linux machine: build agentd and agentctl, start
# agentd on your session bus (starting a private session bus if you have
# none), create a sandbox from PROJECT (default: a sample repository made
# here) and start it.
#
#   tests/quickstart.sh [PROJECT]          # the local backend (namespaces)
#   sudo tests/quickstart.sh --vm [PROJECT] # a QEMU microVM (docs/guest-image.md)
#
# --vm builds the Debian guest image and vhost-device-vsock once (about 3
# minutes, cached) and needs qemu-system-x86 and debootstrap; it runs as
# root because the image build (debootstrap) and virtiofsd need it.
set -euo pipefail
cd "$(dirname "$0")/.."

vm=
if [ "${1:-}" = --vm ]; then
  vm=1
  shift
fi

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
bin="$PWD/target/debug"
state="${XDG_STATE_HOME:-$HOME/.local/state}/keystone/agent"
mkdir -p "$state"
# Sessions (agentctl attach) run the pinned Zellij inside the sandbox: built
# once into a cache (about 20 minutes the first time), reused after that.
# The first time it builds in the background: the sandbox does not wait
# for it, agentd picks it up when it is there, and `agentctl attach` says
# how long is left meanwhile.
zellij_building=
if zellij="$(tests/install-zellij.sh --cached 2>/dev/null)"; then
  export KEYSTONE_ZELLIJ="$zellij"
else
  zellij_log="$state/zellij-build.log"
  if ! pgrep -f 'install-tools.sh zellij' >/dev/null; then
    KEYSTONE_BUILD_LOG="$zellij_log" nohup tests/install-zellij.sh >"$zellij_log" 2>&1 &
  fi
  zellij_building=1
  echo "==> Zellij for sessions is building in the background (about 20 minutes, once; log: $zellij_log)"
fi
vm_config=
create_args=()
if [ -n "$vm" ]; then
  command -v qemu-system-x86_64 >/dev/null || {
    echo "quickstart: --vm needs QEMU: sudo apt-get install -y qemu-system-x86 debootstrap busybox-static cpio" >&2
    exit 4
  }
  echo "==> vhost-device-vsock (the guest's control channel)"
  vsock="$(tests/install-tools.sh vhost-device-vsock)"
  image="${KEYSTONE_VM_IMAGE:-}"
  if [ -z "$image" ]; then
    [ "$(id -u)" = 0 ] || { echo "quickstart: building the guest image needs root: sudo tests/quickstart.sh --vm" >&2; exit 4; }
    echo "==> guest image (Debian packages; about 90 s the first time)"
    image="$(guest-image/debian/build.sh | tail -n1)"
  fi
  vm_config="\"default_backend\": \"vm\", \"vm\": {\"image\": \"$image\", \"vhost_vsock\": \"$vsock\"}"
  create_args=(--backend vm --memory 2048 --vcpus 2)
fi

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
config="$state/agentd.json"
# A running agentd read its config when it started: remember what that was.
had_vm=
grep -q '"vm"' "$config" 2>/dev/null && had_vm=1
if command -v caddy >/dev/null; then
  proxy='"proxy": {"enable": true, "domain": "sandbox.localhost", "listen": ["127.0.0.1:8080"]}'
  echo "{$proxy${vm_config:+, $vm_config}}" >"$config"
  agentd_args+=(--config "$config")
  if ! (exec 3<>/dev/tcp/127.0.0.1/2019) 2>/dev/null; then
    echo '{"admin": {"listen": "127.0.0.1:2019"}}' >"$state/caddy.json"
    echo "==> starting Caddy (admin API on 127.0.0.1:2019, log: $state/caddy.log)"
    nohup caddy run --config "$state/caddy.json" >>"$state/caddy.log" 2>&1 &
  fi
else
  echo "==> no caddy: dev-server links are off (Debian/Ubuntu: sudo apt-get install -y caddy)"
  if [ -n "$vm_config" ]; then
    echo "{$vm_config}" >"$config"
    agentd_args+=(--config "$config")
  fi
fi
if [ "$(id -u)" != 0 ] && ! command -v newuidmap >/dev/null; then
  echo "==> no newuidmap: sandboxes run as you, not as uids of their own (Debian/Ubuntu: sudo apt-get install -y uidmap)"
fi

if [ -n "$vm" ] && [ -z "$had_vm" ] && "${ctl[@]}" list >/dev/null 2>&1; then
  echo "quickstart: an agentd without the vm settings is running; stop it (pkill -f 'agentd --session') and run this again" >&2
  exit 4
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
[ -z "$vm" ] || name="$(echo "$name" | cut -c1-28)-vm"

if ! "${ctl[@]}" status "$name" >/dev/null 2>&1; then
  "${ctl[@]}" create "${create_args[@]}" --name "$name" "$project"
fi
if [ "$("${ctl[@]}" status "$name" --json | sed -n 's/.*"state": "\(.*\)".*/\1/p')" != running ]; then
  "${ctl[@]}" start "$name"
fi
echo "==> inside the sandbox:"
"${ctl[@]}" exec "$name" -- sh -c 'echo "host: $(hostname)  cwd: $(pwd)"; git log --oneline -3'
server='python3 -m http.server 8000'
[ -z "$vm" ] || server='busybox httpd -f -p 8000'
cat <<MSG

Sandbox '$name' is running. Try:
  export AGENTCTL_BUS=session DBUS_SESSION_BUS_ADDRESS=$DBUS_SESSION_BUS_ADDRESS
  $bin/agentctl list
  $bin/agentctl exec $name -- git status
  $bin/agentctl attach $name              # a Zellij session in /workspace; detach with Ctrl+o d
  $bin/agentctl exec $name -- sh -c '$server >/dev/null 2>&1 &'
  $bin/agentctl open $name                # http://$name.sandbox.localhost:8080/?keystone_token=… (needs caddy; the token makes the link yours)
  $bin/agentctl stop $name && $bin/agentctl destroy $name
agentd keeps running in the background (log: $state/agentd.log); stop it with: pkill -f 'agentd --session'
MSG
echo "Agents: agentd downloads Claude Code, Codex and Gemini CLI in the background (once);"
echo "  $bin/agentctl status $name   shows their versions, and 'not installed yet' until then."
if [ -n "$zellij_building" ]; then
  echo "Zellij is still building (log: $zellij_log): until it is done, use"
  echo "  $bin/agentctl exec -t $name -- bash   for a shell; agentctl attach says how long is left."
fi

#!/usr/bin/env bash
# Quick start on a plain Linux machine: install Keystone Agent into a prefix
# under your home (`make install PREFIX=~/.local`, no root), let your
# session bus start agentd when agentctl first calls it, and create and start
# a sandbox from PROJECT (default: a sample repository made here).
#
#   tests/quickstart.sh [PROJECT]           # the local backend (namespaces)
#   sudo tests/quickstart.sh --vm [PROJECT] # a QEMU microVM (docs/guest-image.md)
#
# With a systemd user manager (a desktop, or an SSH login on most
# distributions) agentd runs as your `agentd.service`: enabled, so it comes
# back at your next login; `systemctl --user stop agentd` stops it and its
# sandboxes. Without one (a container), the quick start runs a session bus of
# its own with the installed activation file, and writes a script that stops
# agentd, its sandboxes and that bus.
#
# --vm builds the Debian guest image once (about 90 s, cached) and needs
# qemu-system-x86 and debootstrap; it runs as root because the image build
# (debootstrap) and virtiofsd need it.
set -euo pipefail
cd "$(dirname "$0")/.."

vm=
if [ "${1:-}" = --vm ]; then
  vm=1
  shift
fi

missing=()
for tool in cargo git dbus-daemon busctl make; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
  echo "quickstart: missing: ${missing[*]}" >&2
  echo "  Debian/Ubuntu: sudo apt-get install -y dbus systemd git make   (and Rust from https://rustup.rs)" >&2
  echo "  NixOS:         nix-shell -p cargo git dbus systemd gnumake" >&2
  exit 4
fi

prefix="${KEYSTONE_PREFIX:-$HOME/.local}"
data="${XDG_DATA_HOME:-$HOME/.local/share}"
# Where your service manager and your session bus look for units and
# activation files of your own.
install_vars=(PREFIX="$prefix" SYSTEMDUSERUNITDIR="$data/systemd/user" DBUSDIR="$data/dbus-1")
state="${XDG_STATE_HOME:-$HOME/.local/state}/keystone/agent"
config_dir="${XDG_CONFIG_HOME:-$HOME/.config}/keystone"
# agentd's state directory: others may pass through it (0711) to what agentd
# shows them, never list it. The quick start's own files (logs, Caddy's admin
# socket, the session bus, the stop script) are in a directory only you may
# enter.
qs="$state/quickstart"
mkdir -p "$state" "$config_dir"
chmod 0711 "$state"
mkdir -p -m 0700 "$qs"
chmod 0700 "$qs"

echo "==> building agentd and agentctl (release; about 5 minutes on 2 cores the first time)"
make --no-print-directory all >/dev/null
echo "==> installing into $prefix"
make --no-print-directory install "${install_vars[@]}" 2>"$qs/install.log" ||
  { cat "$qs/install.log" >&2; exit 3; }
bin="$prefix/bin"
ctl="$bin/agentctl"

# Sessions (agentctl attach) run the pinned Zellij inside the sandbox: built
# once into a cache (10 to 20 minutes the first time), reused after that.
# The first time it builds in the background: the sandbox does not wait
# for it, agentd picks it up when it is there, and `agentctl attach` says
# how long is left meanwhile.
zellij_building=
if ! tests/install-zellij.sh --cached >/dev/null 2>&1; then
  zellij_log="$qs/zellij-build.log"
  if ! pgrep -f 'install-tools.sh zellij' >/dev/null; then
    KEYSTONE_BUILD_LOG="$zellij_log" nohup tests/install-zellij.sh >"$zellij_log" 2>&1 &
  fi
  zellij_building=1
  echo "==> Zellij for sessions is building in the background (10 to 20 minutes, once; log: $zellij_log)"
fi

settings=()
create_args=()
if [ -n "$vm" ]; then
  command -v qemu-system-x86_64 >/dev/null || {
    echo "quickstart: --vm needs QEMU: sudo apt-get install -y qemu-system-x86 qemu-utils debootstrap busybox-static cpio" >&2
    exit 4
  }
  image="${KEYSTONE_VM_IMAGE:-}"
  if [ -z "$image" ]; then
    [ "$(id -u)" = 0 ] || { echo "quickstart: building the guest image needs root: sudo tests/quickstart.sh --vm" >&2; exit 4; }
    echo "==> guest image (Debian packages; about 90 s the first time)"
    image="$(guest-image/debian/build.sh | tail -n1)"
  fi
  settings+=("\"vm\": {\"image\": \"$image\"}")
  create_args=(--backend vm --memory 2048 --vcpus 2)
fi

# Dev-server links when Caddy is installed: agentd adds a server on
# 127.0.0.1:8080 for names under sandbox.localhost (which browsers resolve to
# this machine by themselves) to a Caddy of your own, through its admin API
# on a unix socket only you may open (on a loopback port, every local user
# could rewrite Caddy's configuration).
caddy=
caddy_admin="$qs/caddy-admin.sock"
caddy_pid="$qs/caddy.pid"
if command -v caddy >/dev/null; then
  caddy=1
  # Caddy logs only warnings: agentd asks it for its routes every 2 s.
  cat >"$qs/caddy.json" <<JSON
{"admin": {"listen": "unix/$caddy_admin"}, "logging": {"logs": {"default": {"level": "WARN"}}}}
JSON
  settings+=("\"proxy\": {\"enable\": true, \"domain\": \"sandbox.localhost\", \"listen\": [\"127.0.0.1:8080\"], \"caddy_admin\": \"unix/$caddy_admin\"}")
else
  echo "==> no caddy: dev-server links are off (Debian/Ubuntu: sudo apt-get install -y caddy)"
fi
if [ "$(id -u)" != 0 ] && ! command -v newuidmap >/dev/null; then
  echo "==> no newuidmap: sandboxes run as you, not as uids of their own (Debian/Ubuntu: sudo apt-get install -y uidmap)"
fi

# agentd's configuration, where it reads it without --config. A running
# agentd read it when it started: it is restarted below when it changed.
config="$config_dir/agentd.json"
changed=
if ((${#settings[@]})); then
  new="{$(IFS=,; echo "${settings[*]}")}"
  if [ "$(cat "$config" 2>/dev/null)" != "$new" ]; then
    echo "$new" >"$config"
    changed=1
  fi
fi

systemd_user=
if systemctl --user show-environment >/dev/null 2>&1; then
  systemd_user=1
fi

if [ -n "$systemd_user" ]; then
  systemctl --user daemon-reload
  # Enabled: it starts at your login. Without enabling, the first agentctl
  # call would start it all the same (D-Bus activation).
  systemctl --user enable --quiet agentd.service
  if [ -n "$changed" ]; then
    systemctl --user try-restart agentd.service
  fi
  if [ -n "$caddy" ] && ! systemctl --user --quiet is-active keystone-caddy.service; then
    echo "==> starting Caddy as keystone-caddy.service (admin API on $caddy_admin)"
    systemctl --user reset-failed keystone-caddy.service 2>/dev/null || true
    systemd-run --user --quiet --unit=keystone-caddy caddy run --config "$qs/caddy.json"
  fi
  stop="systemctl --user stop agentd${caddy:+ keystone-caddy}"
else
  # No user manager: a session bus of our own, with the installed
  # activation file in its service directory.
  sock="$qs/session-bus.sock"
  address="unix:path=$sock"
  xml() { sed 's/&/\&amp;/g; s/</\&lt;/g; s/>/\&gt;/g' <<<"$1"; }
  cat >"$qs/session-bus.conf" <<CONF
<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>$(xml "$address")</listen>
  <auth>EXTERNAL</auth>
  <servicedir>$(xml "$data/dbus-1/services")</servicedir>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
CONF
  # The one command that stops everything the quick start started here
  # (`stop agentd`: agentd alone).
  {
    echo '#!/usr/bin/env bash'
    echo '# Stop agentd (it stops its running sandboxes first), then what the quick'
    echo '# start started beside it: Caddy and the session bus.'
    printf 'address=%q\ncaddy_pid=%q\ncaddy_config=%q\n' "$address" "$caddy_pid" "$qs/caddy.json"
    cat <<'STOP'
pid_of() {
  busctl --address="$address" call org.freedesktop.DBus /org/freedesktop/DBus \
    org.freedesktop.DBus GetConnectionUnixProcessID s "$1" 2>/dev/null | cut -d' ' -f2
}
# SIGTERM, then wait at most $2 seconds for the process to end.
end() {
  [ -n "$1" ] && kill -TERM "$1" 2>/dev/null || return 0
  for _ in $(seq $(($2 * 5))); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.2; done
  echo "stop: process $1 did not end within $2 s" >&2
}
# agentd stops its sandboxes one after the other (5 minutes at most, as its
# unit allows).
end "$(pid_of org.keystone.Agent1)" 300
[ "${1:-}" = agentd ] && exit 0
# The Caddy the quick start started, if that pid is still that Caddy.
if pid=$(cat "$caddy_pid" 2>/dev/null) &&
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "caddy run --config $caddy_config"; then
  end "$pid" 10
fi
rm -f "$caddy_pid"
end "$(pid_of org.freedesktop.DBus)" 10
echo "stopped agentd, its sandboxes, Caddy and the session bus; the quick start starts them again"
STOP
  } >"$qs/stop"
  chmod 0700 "$qs/stop"
  # A bus left from before, without agentd's activation file, makes way.
  if busctl --address="$address" status >/dev/null 2>&1 &&
    ! busctl --address="$address" call org.freedesktop.DBus /org/freedesktop/DBus \
      org.freedesktop.DBus ListActivatableNames | grep -q org.keystone.Agent1; then
    echo "==> replacing the session bus at $address (it cannot start agentd)"
    "$qs/stop" >/dev/null
  fi
  if ! busctl --address="$address" status >/dev/null 2>&1; then
    rm -f "$sock"
    dbus-daemon --config-file="$qs/session-bus.conf" --fork
    echo "==> started a session bus at $address (no systemd user manager here)"
  elif [ -n "$changed" ]; then
    echo "==> stopping agentd: it starts again with its new configuration"
    "$qs/stop" agentd
  fi
  export DBUS_SESSION_BUS_ADDRESS="$address"
  # Caddy runs when its pid is still the Caddy started here.
  if [ -n "$caddy" ] && ! { pid=$(cat "$caddy_pid" 2>/dev/null) &&
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "caddy run --config $qs/caddy.json"; }; then
    rm -f "$caddy_admin"
    echo "==> starting Caddy (admin API on $caddy_admin, log: $qs/caddy.log)"
    nohup caddy run --config "$qs/caddy.json" >>"$qs/caddy.log" 2>&1 &
    echo $! >"$caddy_pid"
  fi
  stop="$qs/stop"
fi

# The first call starts agentd (D-Bus activation) when it is not running.
"$ctl" list >/dev/null

project="${1:-}"
if [ -z "$project" ]; then
  project="$qs/sample-project"
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

if ! "$ctl" status "$name" >/dev/null 2>&1; then
  "$ctl" create "${create_args[@]}" --name "$name" "$project"
fi
if [ "$("$ctl" status "$name" --json | sed -n 's/.*"state": "\(.*\)".*/\1/p')" != running ]; then
  "$ctl" start "$name"
fi
echo "==> inside the sandbox:"
"$ctl" exec "$name" -- sh -c 'echo "host: $(hostname)  cwd: $(pwd)"; git log --oneline -3'
server='python3 -m http.server 8000'
[ -z "$vm" ] || server='busybox httpd -f -p 8000'
path_hint=
case ":$PATH:" in *":$bin:"*) ;; *) path_hint="  export PATH=\"$bin:\$PATH\"      # agentctl, agentd (add it to your shell's profile)"$'\n' ;; esac
bus_hint=
[ -n "$systemd_user" ] || bus_hint="  export DBUS_SESSION_BUS_ADDRESS=$DBUS_SESSION_BUS_ADDRESS   # the quick start's session bus"$'\n'
cat <<MSG

Sandbox '$name' is running. Try:
$path_hint$bus_hint  agentctl list
  agentctl exec $name -- git status
  agentctl attach $name              # a Zellij session in /workspace; detach with Ctrl+o d
  agentctl exec $name -- sh -c '$server >/dev/null 2>&1 &'
  agentctl open $name                # http://$name.sandbox.localhost:8080/?keystone_token=… (needs caddy; the token makes the link yours)
  agentctl doctor    # what each backend needs, and what is missing here
  agentctl stop $name && agentctl destroy $name
Stop everything (agentd stops its sandboxes first):
  $stop
Remove the installed files (in $PWD): make uninstall ${install_vars[*]}
MSG
echo "Agents: agentd downloads Claude Code, Codex and Gemini CLI in the background (once);"
echo "  agentctl status $name   shows their versions, and 'not installed yet' until then."
if [ -n "$zellij_building" ]; then
  echo "Zellij is still building (log: $zellij_log): until it is done, use"
  echo "  agentctl exec -t $name -- bash   for a shell; agentctl attach says how long is left."
fi

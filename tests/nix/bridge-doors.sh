#!/usr/bin/env bash
# The module's nftables rules against a second local user, for
# tests/nix/check.sh (i): run as root in a network namespace of its own
# (`unshare -n tests/nix/bridge-doors.sh RULES.nft DECLARED_TAP MAC ADDRESS`).
#
# It builds the sandboxes' bridge keystone-br0 with the host at 10.231.0.1,
# loads RULES.nft, and plays the attacks:
#
#   - a port of no sandbox (named tap0, as a tap that qemu-bridge-helper
#     attaches for any user is) sends with a declared sandbox's MAC and
#     address, and tries agentd's gateway port on the host: it must get
#     nothing (the bridge's prerouting chain drops by default);
#   - a guest behind the declared tap DECLARED_TAP (MAC, ADDRESS) runs a dev
#     server: root on the host reaches it (agentd), uid 65534 does not.
#
# Prints "ok    ..." or "FAIL  ..." lines.
set -uo pipefail
rules=$1 tap=$2 mac=$3 address=$4
gateway=10.231.0.1

ok() { echo "ok    $*"; }
fail() { echo "FAIL  $*"; }

# A TCP connection from the current namespace and uid: prints "open" or
# the error.
probe() {
  python3 - "$1" "$2" <<'EOF'
import socket, sys
s = socket.socket()
s.settimeout(3)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("open")
except OSError as e:
    print(type(e).__name__)
EOF
}

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; }
trap cleanup EXIT

ip link set lo up
ip link add keystone-br0 type bridge
ip addr add "$gateway/16" dev keystone-br0
ip link set keystone-br0 up

# A namespace behind a port of the bridge; its pid in $ns.
behind() {
  local port=$1 peer=$2 nsmac=$3 nsaddr=$4 pid
  unshare -n sleep 60 &
  pid=$!
  pids+=("$pid")
  ns=$pid
  sleep 0.2
  ip link add "$port" type veth peer name "$peer"
  ip link set "$port" master keystone-br0 up
  ip link set "$peer" netns "$pid"
  nsenter -t "$pid" -n sh -c "ip link set lo up && ip link set $peer address $nsmac && ip addr add $nsaddr/16 dev $peer && ip link set $peer up && ip route add default via $gateway"
}

if ! out=$(nft -f "$rules" 2>&1); then
  fail "the rules do not load: $out"
  exit 0
fi

# agentd's gateway on the host (root's listener, as agentd's is).
python3 -c "
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('$gateway', 3128)); s.listen(16)
while True:
    c, _ = s.accept(); c.close()
" &
pids+=($!)

behind "$tap" eth-guest "$mac" "$address"
guest=$ns
# The guest's dev server on port 8000.
nsenter -t "$guest" -n python3 -c "
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', 8000)); s.listen(16)
while True:
    c, _ = s.accept(); c.close()
" &
pids+=($!)
sleep 0.5

# The declared guest reaches the gateway (the rules let the sandbox in).
got=$(nsenter -t "$guest" -n bash -c "$(declare -f probe); probe $gateway 3128")
if [[ $got == open ]]; then
  ok "the declared sandbox's tap $tap reaches the gateway"
else
  fail "the declared sandbox's tap $tap does not reach the gateway: $got"
fi

# Root on the host (agentd) reaches the guest's dev server.
got=$(probe "$address" 8000)
if [[ $got == open ]]; then
  ok "root on the host (agentd) reaches a guest's dev server"
else
  fail "root on the host does not reach the guest's dev server: $got"
fi

# Another local user does not.
got=$(setpriv --reuid 65534 --regid 65534 --clear-groups bash -c "$(declare -f probe); probe $address 8000")
if [[ $got != open ]]; then
  ok "a local user (uid 65534) cannot open a connection into the bridge to a guest's dev server ($got)"
else
  fail "a local user (uid 65534) reaches a guest's dev server at $address:8000 past the links' tokens"
fi

# A port of no sandbox, posing as the declared one (its MAC, its address).
# The real guest goes first, so that the bridge does not learn the MAC on
# the attacker's port from the guest's frames.
nsenter -t "$guest" -n ip link set eth-guest down
behind tap0 eth-attacker "$mac" "$address"
attacker=$ns
sleep 0.3
got=$(nsenter -t "$attacker" -n bash -c "$(declare -f probe); probe $gateway 3128")
if [[ $got != open ]]; then
  ok "a tap of no sandbox (tap0) posing as it gets nothing through the bridge ($got)"
else
  fail "a tap of no sandbox (tap0), with the sandbox's MAC and address, reached the gateway on $gateway:3128"
fi
exit 0

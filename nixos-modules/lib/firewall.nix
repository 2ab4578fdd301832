# The nftables rules of the keystone.agent module: a microvm sandbox's tap
# reaches agentd's egress gateway on the host's bridge address and nothing
# else (docs/network.md, "microvm: the rules of the NixOS module").
#
# Builtins only, like ./naming.nix: tests/nix/check.sh renders the rules for
# tests/fixtures/nix-config.nix and compares them with
# tests/nix/nix-config.expected.nft.
#
# Two tables, both named keystone-agent:
#
# - bridge: what each tap may send into the bridge. Frames only from its
#   guest's MAC address; IPv4 only from its guest's address; ARP only from
#   that address and MAC, about the host's address. Everything else (IPv6,
#   VLAN tags, other protocols, any frame from a tap of no sandbox) is
#   dropped, and nothing goes from one tap to another. A port of the bridge
#   that is no declared tap gets nothing in (the chain's policy is drop).
# - inet: what the host does with IP from the bridge. It accepts new TCP
#   connections to the gateway (A.B.0.1:3128) and the replies of connections
#   it opened itself (agentd's ssh to the guests), and refuses everything
#   else; the gateway's port takes connections from the bridge only. Nothing
#   is routed from the bridge or into it. Of the host's own sockets only
#   root's (agentd's) may send into the bridge.
#
# Every chain hooks in at priority -300, before NAT and the usual filter
# chains. A drop or reject in any base chain is final for the packet,
# whatever another table (networking.firewall, iptables or nftables) accepts:
# an accept ends only the chain it is in. So no firewall setting can open
# what these rules close.
let
  naming = import ./naming.nix;

  inherit (builtins) concatStringsSep map;

  indent = prefix: lines: map (l: if l == "" then "" else prefix + l) lines;

  # The lines of one table's body.
  bridgeLines =
    { gateway, taps }:
    [
      "# Frames that enter the bridge ${naming.bridgeName}: only through a declared"
      "# sandbox's tap, each tap's own chain below deciding what it may send. A"
      "# port of no sandbox (a tap that qemu-bridge-helper or anyone else"
      "# attached, whatever its name) gets nothing in, not even into the"
      "# bridge's address table. Other bridges of the host are not ours."
      "chain prerouting {"
      "  type filter hook prerouting priority -300; policy drop;"
      "  meta ibrname != \"${naming.bridgeName}\" accept"
    ]
    ++ (
      if taps == [ ] then
        [ ]
      else
        [ "  iifname vmap {" ]
        ++ map (t: "    \"${t.tapId}\" : jump ${t.tapId},") taps
        ++ [ "  }" ]
    )
    ++ [
      "}"
      ""
      "# Nothing goes from one tap to another (the ports are isolated as well)."
      "chain forward {"
      "  type filter hook forward priority -300; policy accept;"
      "  iifname \"ks*\" drop"
      "  oifname \"ks*\" drop"
      "}"
    ]
    ++ builtins.concatLists (
      map (t: [
        ""
        "# Sandbox ${t.name}: ${t.address}, ${t.mac}."
        "chain ${t.tapId} {"
        "  ether saddr != ${t.mac} drop"
        "  ip saddr ${t.address} accept"
        "  arp htype 1 arp ptype ip arp hlen 6 arp plen 4 arp operation { request, reply } arp saddr ether ${t.mac} arp saddr ip ${t.address} arp daddr ip ${gateway} accept"
        "  drop"
        "}"
      ]) taps
    );

  inetLines =
    { gateway }:
    let
      port = toString naming.gatewayPort;
      bridge = naming.bridgeName;
    in
    [
      "# IP from the bridge: only new TCP connections to agentd's egress gateway"
      "# and the replies of connections the host opened are accepted. The"
      "# gateway's port is for the bridge only."
      "chain input {"
      "  type filter hook input priority -300; policy accept;"
      "  iifname \"${bridge}\" jump from_sandboxes"
      "  ip daddr ${gateway} tcp dport ${port} reject with tcp reset"
      "}"
      ""
      "chain from_sandboxes {"
      "  ct state established,related accept"
      "  ip daddr ${gateway} tcp dport ${port} ct state new accept"
      "  meta l4proto tcp reject with tcp reset"
      "  reject with icmpx admin-prohibited"
      "}"
      ""
      "# Nothing is routed from the bridge or into it: the gateway is the"
      "# sandboxes' only way out."
      "chain forward {"
      "  type filter hook forward priority -300; policy accept;"
      "  iifname \"${bridge}\" reject with icmpx admin-prohibited"
      "  oifname \"${bridge}\" drop"
      "}"
      ""
      "# Into the bridge, only root's sockets: agentd (root) reaches the guests'"
      "# sshd and dev servers; no other local user reaches a guest past the"
      "# links' tokens. Packets of no socket (the kernel's resets and ICMP"
      "# errors) pass."
      "chain output {"
      "  type filter hook output priority -300; policy accept;"
      "  oifname \"${bridge}\" meta skuid != 0 meta l4proto tcp reject with tcp reset"
      "  oifname \"${bridge}\" meta skuid != 0 drop"
      "}"
    ];

  # The rules for a keystone.agent configuration (options as the module has
  # them, or a partial attrset as the fixtures are):
  #   bridge, inet  the bodies of the two tables (for networking.nftables.tables)
  #   ruleset       a file for `nft -f` that replaces both tables at once
  #   lines         the ruleset's lines (what tests/nix/check.sh compares)
  rules =
    cfg:
    let
      c = naming.resolve cfg;
      gateway = naming.hostAddress c.network.subnet;
      taps = map (name: naming.derive name c.network.subnet) (naming.tapSandboxes c);
      bridge = bridgeLines { inherit gateway taps; };
      inet = inetLines { inherit gateway; };
      table = family: body: [
        "table ${family} keystone-agent"
        "delete table ${family} keystone-agent"
        "table ${family} keystone-agent {"
      ]
      ++ indent "  " body
      ++ [ "}" ];
      lines = [
        "# Generated by the keystone.agent NixOS module (nixos-modules/lib/firewall.nix)."
        "# The sandboxes' taps on ${naming.bridgeName} reach ${gateway}:${toString naming.gatewayPort}, agentd's"
        "# egress gateway, and nothing else."
      ]
      ++ table "bridge" bridge
      ++ table "inet" inet;
    in
    {
      bridge = concatStringsSep "\n" bridge + "\n";
      inet = concatStringsSep "\n" inet + "\n";
      ruleset = concatStringsSep "\n" lines + "\n";
      inherit lines;
    };
in
{
  inherit rules;
}

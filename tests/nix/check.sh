#!/usr/bin/env bash
# Nix checks that run without nixpkgs: what a machine with only Debian's
# nix-bin (Nix 2.8) can verify of the flake and the NixOS modules.
#
#   (a) every .nix file parses (nix-instantiate --parse);
#   (b) nixos-modules/lib/naming.nix derives the same tap ids, MACs, addresses
#       and vsock CIDs as agentd (the vectors in tests/fixtures/naming.json);
#   (c) renderConfig turns tests/fixtures/nix-config.nix into the expected
#       JSON, which `agentd --check-config` accepts; validate reports the
#       expected problems of tests/nix/bad-config.nix, and agentd finds the
#       same ones in that configuration's JSON; the module's decisions about
#       the host (share directories taken out of microvm.nix's tmpfiles rule,
#       interfaces dhcpcd and NetworkManager must skip, whether
#       networkd-wait-online is useful, cloud-hypervisor refusals, vm.image);
#   (d) nixos-modules/lib/firewall.nix renders tests/fixtures/nix-config.nix
#       into the expected nftables rules (tests/nix/nix-config.expected.nft),
#       and `nft --check` accepts them in a network namespace of its own
#       (skipped, and said so, without nft or unshare);
#   (e) flake.lock is current for flake.nix's inputs (offline, no fetching);
#   (f) no import-from-derivation: nixos-modules/pkgs/zellij.nix reads a
#       Cargo.lock of this repository, equal to the one in the crate;
#   (g) the host's names under proxy.domain: dnsmasq with the module's
#       settings starts beside systemd-resolved's stub listener (simulated
#       with resolved's socket options, in a network namespace of its own)
#       and answers them, where its default wildcard bind fails; resolved
#       gets a routing domain for them;
#   (h) every option of another project (nixpkgs, microvm.nix) that the host
#       module, the guest module and flake.nix's nixosModules.default set is
#       listed, with where it is declared, in tests/nix/foreign-options.json,
#       and every listed option is still set (tests/nix/options-set.nix walks
#       the modules with stub lib, pkgs and config; entries marked "pending"
#       are allowed but not yet required).
#
# The module evaluation, package builds and NixOS VM tests need nixpkgs and
# KVM: `nix flake check` (docs/configuration.md, "What runs where").
#
# Usage, from the repository root: tests/nix/check.sh
# Environment: AGENTD (default target/debug/agentd), the agentd binary for (c).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

passed=0
failed=0
pass() {
  passed=$((passed + 1))
  echo "  ok    $*"
}
fail() {
  failed=$((failed + 1))
  echo "  FAIL  $*"
}

if ! command -v nix-instantiate >/dev/null; then
  echo "nix-instantiate not found: install Nix (Debian: apt-get install -y nix-bin)" >&2
  exit 1
fi

tmp=$(mktemp -d)
# (e) leaves a read-only Nix store under $tmp.
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT

# Parsing and evaluating need no Nix store at all: `--store dummy://` lets
# any user run these checks, with or without a Nix daemon.
nix_parse() {
  nix-instantiate --store dummy:// --parse "$1"
}

# Evaluate a Nix expression (relative paths are relative to the repository
# root) and print it as JSON on one line, attributes sorted.
nix_json() {
  nix-instantiate --store dummy:// --eval --strict --json --expr "$1"
}

# Print two one-line JSON values one item per line, and their diff.
show_diff() {
  local label_a=$1 a=$2 label_b=$3 b=$4
  printf '%s\n' "$a" | sed -e 's/,"/,\n"/g' -e 's/{"/{\n"/g' >"$tmp/a"
  printf '%s\n' "$b" | sed -e 's/,"/,\n"/g' -e 's/{"/{\n"/g' >"$tmp/b"
  diff -u --label "$label_a" --label "$label_b" "$tmp/a" "$tmp/b" | sed 's/^/        /' || true
}

lib=./nixos-modules/lib/naming.nix
firewall=./nixos-modules/lib/firewall.nix

# --- (a) -----------------------------------------------------------------------
echo "== (a) nix-instantiate --parse on every .nix file"
owned=(flake.nix nixos-modules guest-image tests/nixos tests/nix tests/fixtures)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t nix_files < <(
    {
      git ls-files -- '*.nix'
      git ls-files --others --exclude-standard -- "${owned[@]}" | grep '\.nix$' || true
    } | sort -u
  )
else
  mapfile -t nix_files < <(find . -name '*.nix' -not -path './target/*' | sed 's|^\./||' | sort)
fi
if ((${#nix_files[@]} == 0)); then
  fail "no .nix files found"
fi
for f in "${nix_files[@]}"; do
  [[ -f $f ]] || continue # tracked but deleted in the work tree
  if err=$(nix_parse "$f" 2>&1 >/dev/null); then
    pass "parse $f"
  else
    fail "parse $f"
    printf '%s\n' "$err" | sed 's/^/        /'
  fi
done

# --- (b) -----------------------------------------------------------------------
echo "== (b) naming.nix against agentd's vectors (tests/fixtures/naming.json)"
vectors=tests/fixtures/naming.json
subnet=10.231.0.0/16
if [[ ! -f $vectors ]]; then
  fail "$vectors does not exist: agentd's naming tests write it (KEYSTONE_BLESS=1 cargo test -p agentd naming)"
else
  count=$(nix_json "builtins.length (builtins.fromJSON (builtins.readFile ./$vectors))")
  if ((count == 0)); then
    fail "$vectors holds no vectors"
  fi
  for ((i = 0; i < count; i++)); do
    entry="builtins.elemAt (builtins.fromJSON (builtins.readFile ./$vectors)) $i"
    want=$(nix_json "$entry")
    name=$(printf '%s' "$want" | sed -n 's/.*"name":"\([^"]*\)".*/\1/p')
    if got=$(nix_json "let n = import $lib; in n.toVector (n.derive ($entry).name \"$subnet\")" 2>&1); then
      if [[ $got == "$want" ]]; then
        pass "'$name': $got"
      else
        fail "'$name': naming.nix differs from agentd"
        show_diff "agentd (naming.json)" "$want" "naming.nix" "$got"
      fi
    else
      fail "'$name': naming.nix failed"
      printf '%s\n' "$got" | sed 's/^/        /'
    fi
  done
fi

# --- (c) -----------------------------------------------------------------------
echo "== (c) renderConfig and validate on fixture configurations"
agentd=${AGENTD:-target/debug/agentd}

good=./tests/fixtures/nix-config.nix
rendered="$tmp/agentd.json"
if nix_json "(import $lib).renderConfig (import $good)" >"$rendered" 2>"$tmp/err"; then
  pass "renderConfig $good"
  expected=$(nix_json "builtins.fromJSON (builtins.readFile ./tests/nix/nix-config.expected.json)")
  got=$(cat "$rendered")
  if [[ $got == "$expected" ]]; then
    pass "rendered JSON equals tests/nix/nix-config.expected.json"
  else
    fail "rendered JSON differs from tests/nix/nix-config.expected.json"
    show_diff "expected" "$expected" "renderConfig" "$got"
  fi
  if [[ ! -x $agentd ]]; then
    fail "$agentd --check-config: no agentd binary (cargo build -p agentd, or set AGENTD)"
  elif out=$("$agentd" --check-config "$rendered" 2>&1); then
    pass "agentd --check-config accepts it: $out"
  else
    fail "agentd --check-config refuses the rendered JSON"
    printf '%s\n' "$out" | sed 's/^/        /'
    echo "        rendered: $got"
  fi
else
  fail "renderConfig $good"
  sed 's/^/        /' "$tmp/err"
fi

problems=$(nix_json "(import $lib).validate (import $good)")
if [[ $problems == "[]" ]]; then
  pass "validate $good: no problems"
else
  fail "validate $good: $problems"
fi

bad=./tests/nix/bad-config.nix
got=$(nix_json "(import $lib).validate (import $bad)")
expected=$(nix_json "builtins.fromJSON (builtins.readFile ./tests/nix/bad-config.expected.json)")
if [[ $got == "$expected" ]]; then
  pass "validate $bad: the expected $(nix_json "builtins.length (builtins.fromJSON (builtins.readFile ./tests/nix/bad-config.expected.json))") problems (bad name, relative project, address clash, ...)"
else
  fail "validate $bad differs from tests/nix/bad-config.expected.json"
  printf '%s\n' "$expected" | sed 's/","/",\n"/g' >"$tmp/a"
  printf '%s\n' "$got" | sed 's/","/",\n"/g' >"$tmp/b"
  diff -u --label expected --label validate "$tmp/a" "$tmp/b" | sed 's/^/        /' || true
fi

# agentd must find the same problems in the bad configuration's JSON (it does
# not know about addresses, so the module may report more).
if [[ -x $agentd ]]; then
  nix_json "(import $lib).renderConfig (import $bad)" >"$tmp/bad.json"
  if out=$("$agentd" --check-config "$tmp/bad.json" 2>&1); then
    fail "agentd --check-config accepts the bad configuration"
  else
    missing=0
    while IFS= read -r problem; do
      if [[ $(PROBLEM="keystone.agent.$problem" nix_json \
        "builtins.elem (builtins.getEnv \"PROBLEM\") ((import $lib).validate (import $bad))") != true ]]; then
        missing=$((missing + 1))
        echo "        agentd reports, validate does not: $problem"
      fi
    done < <(printf '%s\n' "$out" | sed -n 's/^  - //p')
    n=$(printf '%s\n' "$out" | grep -c '^  - ' || true)
    if ((n > 0 && missing == 0)); then
      pass "agentd --check-config refuses it with $n problems, each also reported by validate"
    else
      fail "agentd and validate disagree about the bad configuration"
      printf '%s\n' "$out" | sed 's/^/        /'
    fi
  fi
fi

kube=$(nix_json "(import $lib).validate { backend = \"kubernetes\"; }")
if [[ $kube == '["keystone.agent.kubernetes.image: a sandbox uses the kubernetes backend; set the image its Pods run (docs/kubernetes.md, \"The image\")"]' ]]; then
  pass "validate: backend = \"kubernetes\" without an image is refused"
else
  fail "validate: backend = \"kubernetes\" without an image: $kube"
fi

# The module's decisions about the host (nixos-modules/host/default.nix
# applies them; each was a defect of a first `nixos-rebuild switch`).
expect() {
  local what=$1 expr=$2 want=$3 got
  if got=$(nix_json "$expr" 2>&1) && [[ $got == "$want" ]]; then
    pass "$what"
  else
    fail "$what"
    echo "        want: $want"
    echo "        got:  $got"
  fi
}

kube='{ backend = "kubernetes"; kubernetes = { image = "sandbox:1"; kubeconfig = "/run/secrets/kube"; context = "prod"; storageClass = ""; allowUnenforcedNetworkPolicy = true; }; }'
expect "validate: backend = \"kubernetes\" with an image is accepted" "(import $lib).validate $kube" '[]'
expect "renderConfig: the kubernetes section in agentd's words" "((import $lib).renderConfig $kube).kubernetes" \
  '{"allow_unenforced_network_policy":true,"context":"prod","image":"sandbox:1","kubeconfig":"/run/secrets/kube","namespace":"agent-sandboxes","storage_class":"","toolbox":true}'
kube_cfg="$tmp/kube.json"
nix_json "(import $lib).renderConfig $kube" >"$kube_cfg"
if [[ -x $agentd ]] && out=$("$agentd" --check-config "$kube_cfg" 2>&1); then
  pass "agentd --check-config accepts the rendered kubernetes section"
else
  fail "agentd --check-config refuses the rendered kubernetes section: $out"
fi

ws=/var/lib/keystone-agent/sandboxes
expect "shareSources: the workspace and ssh/ of every microvm sandbox leave microvm.nix's tmpfiles rule" \
  "(import $lib).shareSources (import $good)" \
  "[\"$ws/batch/workspace\",\"$ws/batch/ssh\",\"$ws/docs/workspace\",\"$ws/docs/ssh\",\"$ws/webapp/workspace\",\"$ws/webapp/ssh\"]"
expect "sandboxInterfaces: dhcpcd and NetworkManager leave the bridge and the taps alone" \
  "(import $lib).sandboxInterfaces" '["keystone-br0","ks*"]'
expect "waitOnlineUseful: not on a host whose only networkd networks are the module's" \
  "let n = import $lib; in n.waitOnlineUseful { useNetworkd = false; networks = n.ownNetworks; }" false
expect "waitOnlineUseful: on a host with networks of its own" \
  "let n = import $lib; in n.waitOnlineUseful { useNetworkd = false; networks = n.ownNetworks ++ [ \"10-uplink\" ]; }" true
expect "waitOnlineUseful: on a host with networking.useNetworkd" \
  "let n = import $lib; in n.waitOnlineUseful { useNetworkd = true; networks = n.ownNetworks; }" true
expect "validate: cloud-hypervisor is refused for a sandbox without network and for nestedVirt, naming the sandbox" \
  "map (m: builtins.head (builtins.split \":\" m)) ((import $lib).validate ((import $good) // { microvm.hypervisor = \"cloud-hypervisor\"; }))" \
  '["keystone.agent.sandboxes.batch","keystone.agent.sandboxes.batch","keystone.agent.sandboxes.docs","keystone.agent.sandboxes.webapp"]'
expect "validate: cloud-hypervisor with nestedVirt off and a network everywhere is accepted" \
  "(import $lib).validate { microvm.hypervisor = \"cloud-hypervisor\"; defaults.nestedVirt = false; sandboxes.a = { project = \"/p\"; owner = \"u\"; }; }" '[]'
expect "validate: a vm sandbox needs vm.image" \
  "(import $lib).validate { sandboxes.a = { project = \"/p\"; owner = \"u\"; backend = \"vm\"; }; }" \
  '["keystone.agent.sandboxes.a: the vm backend needs keystone.agent.vm.image (the flake'"'"'s nixosModules.default sets it to the guest-image package)"]'
expect "renderConfig: no toolbox download on a host of microvm sandboxes only (their guests bring nixpkgs' agents)" \
  "((import $lib).renderConfig { sandboxes.a = { project = \"/p\"; owner = \"u\"; }; }).toolbox.download" false
expect "renderConfig: the toolbox downloads for a vm sandbox" \
  "((import $lib).renderConfig { sandboxes.a = { project = \"/p\"; owner = \"u\"; backend = \"vm\"; }; }).toolbox.download" true
expect "renderConfig: vm.image reaches agentd.json where a vm sandbox needs it" \
  "((import $lib).renderConfig { vm.image = \"/nix/store/x-guest-image\"; vm.accel = \"tcg\"; sandboxes.a = { project = \"/p\"; owner = \"u\"; backend = \"vm\"; }; }).vm" \
  '{"accel":"tcg","fast_start":true,"image":"/nix/store/x-guest-image","share":"auto"}'
expect "renderConfig: vm.image reaches agentd.json where vm is the default backend" \
  "((import $lib).renderConfig { vm.image = \"/nix/store/x-guest-image\"; backend = \"vm\"; }).vm.image" \
  '"/nix/store/x-guest-image"'
expect "renderConfig: no vm.image (so no guest image to build) on a host without vm sandboxes" \
  "((import $lib).renderConfig { vm.image = \"/nix/store/x-guest-image\"; sandboxes.a = { project = \"/p\"; owner = \"u\"; }; }).vm" \
  '{"accel":"auto","fast_start":true,"share":"auto"}'
expect "renderConfig: proxy.caddy_admin is Caddy's admin socket, not localhost:2019" \
  "((import $lib).renderConfig (import $good)).proxy.caddy_admin" '"unix//run/caddy/admin.sock"'
expect "validate: microvm.shareProto = \"9p\" is refused" \
  "(import $lib).validate { microvm.shareProto = \"9p\"; }" \
  '["keystone.agent.microvm.shareProto: \"9p\" cannot work: QEMU opens 9p shares as user microvm, and the guest'"'"'s SSH host key that agentd writes is root'"'"'s, mode 0600; use \"virtiofs\""]'
expect "validate: a project given as a Nix path literal is refused, naming the sandbox" \
  "map (m: builtins.match \"(keystone.agent.sandboxes.a): project [^ ]* (is a Nix path literal);.*\" m) ((import $lib).validate { sandboxes.a = { project = ./tests/nix; owner = \"u\"; }; })" \
  '[["keystone.agent.sandboxes.a","is a Nix path literal"]]'
expect "validate: a project in the Nix store is refused" \
  "(import $lib).validate { sandboxes.a = { project = \"/nix/store/0000-src\"; owner = \"u\"; }; }" \
  '["keystone.agent.sandboxes.a: project /nix/store/0000-src is in the Nix store (a read-only copy); give the live repository'"'"'s path"]'
expect "validate: a local sandbox's defaultAgent must be in toolbox.agents" \
  "(import $lib).validate { toolbox.agents = [ \"codex\" ]; sandboxes.a = { project = \"/p\"; owner = \"u\"; backend = \"local\"; defaultAgent = \"claude\"; }; }" \
  '["keystone.agent.sandboxes.a: defaultAgent \"claude\" is not in keystone.agent.toolbox.agents, so the sandbox has no such agent; add it there or choose another"]'

# --- (d) -----------------------------------------------------------------------
echo "== (d) the module's nftables rules (firewall.nix)"
expected_nft=tests/nix/nix-config.expected.nft
# The lines as a JSON list, one JSON string per line of output.
json_lines() {
  sed -e 's/^\[//' -e 's/\]$//' -e 's/","/"\n"/g'
}
if got=$(nix_json "((import $firewall).rules (import $good)).lines" 2>"$tmp/err"); then
  if [[ $(nix_json "((import $firewall).rules (import $good)).ruleset == builtins.readFile ./$expected_nft") == true ]]; then
    pass "rules for $good equal $expected_nft"
  else
    fail "rules for $good differ from $expected_nft"
    # (The file's last newline gives split a last, empty line.)
    want=$(nix_json "let l = builtins.filter builtins.isString (builtins.split \"\n\" (builtins.readFile ./$expected_nft)); in builtins.genList (builtins.elemAt l) (builtins.length l - 1)")
    printf '%s\n' "$want" | json_lines >"$tmp/a"
    printf '%s\n' "$got" | json_lines >"$tmp/b"
    diff -u --label expected --label firewall.nix "$tmp/a" "$tmp/b" | sed 's/^/        /' || true
  fi
  # Back to text: the lines are JSON strings (quotes are the only escapes
  # the rules contain; a backslash would be one too).
  printf '%s\n' "$got" | json_lines | sed -e 's/^"//' -e 's/"$//' -e 's/\\"/"/g' -e 's/\\\\/\\/g' >"$tmp/rules.nft"
  if ! command -v nft >/dev/null || ! command -v unshare >/dev/null; then
    echo "  skip  nft --check: nft or unshare is missing (Debian: apt-get install -y nftables)"
  else
    # A network namespace of our own (and, when not root, a user namespace
    # to own it): nothing is loaded into the host's rules.
    ns=(unshare -n)
    if ((EUID != 0)); then ns=(unshare -r -n); fi
    # `meta ibrname` needs the kernel's nft_meta_bridge (NixOS kernels have
    # it; some CI kernels do not). Without it, check the rest, and say so:
    # in a namespace whose only bridge is keystone-br0 the rule changes
    # nothing.
    checked=$tmp/rules.nft
    if ! printf 'table bridge probe {\n chain p {\n  type filter hook prerouting priority 0;\n  meta ibrname "x" accept\n }\n}\n' |
      "${ns[@]}" nft --check --file - >/dev/null 2>&1; then
      echo "  note  this kernel lacks nft_meta_bridge: nft --check and the attacks below run without the rule \`meta ibrname != \"keystone-br0\" accept\`"
      checked=$tmp/rules-no-ibrname.nft
      grep -v 'meta ibrname' "$tmp/rules.nft" >"$checked"
    fi
    if out=$("${ns[@]}" nft --check --file "$checked" 2>&1); then
      pass "nft --check accepts them"
    else
      fail "nft --check refuses them"
      printf '%s\n' "$out" | sed 's/^/        /'
    fi
    # A second local user's attacks on the bridge, with the rules loaded in
    # a namespace of its own (tests/nix/bridge-doors.sh).
    if ((EUID != 0)) || ! command -v python3 >/dev/null || ! command -v setpriv >/dev/null || ! command -v nsenter >/dev/null; then
      echo "  skip  tests/nix/bridge-doors.sh: needs root, python3, setpriv and nsenter"
    else
      docs="let n = import $lib; in n.derive \"docs\" \"$subnet\""
      out=$(unshare -n tests/nix/bridge-doors.sh "$checked" \
        "$(nix_json "($docs).tapId" | tr -d '"')" "$(nix_json "($docs).mac" | tr -d '"')" \
        "$(nix_json "($docs).address" | tr -d '"')" 2>&1) || true
      while IFS= read -r line; do
        case $line in
          "ok    "*) pass "${line#ok    }" ;;
          "FAIL  "*) fail "${line#FAIL  }" ;;
          *) echo "        $line" ;;
        esac
      done <<<"$out"
      grep -q 'tap of no sandbox' <<<"$out" || fail "bridge-doors.sh did not get to the attacks"
    fi
  fi
else
  fail "firewall.nix rules for $good"
  sed 's/^/        /' "$tmp/err"
fi
expect "rules: the bridge's prerouting chain drops what no declared tap's chain accepts (policy drop)" \
  "builtins.filter (l: builtins.match \".*hook prerouting.*\" l != null) ((import $firewall).rules (import $good)).lines" \
  '["    type filter hook prerouting priority -300; policy drop;"]'
expect "rules: only root's sockets open connections into the bridge (an output chain)" \
  "builtins.filter (l: builtins.match \".*(hook output|skuid).*\" l != null) ((import $firewall).rules (import $good)).lines" \
  '["    type filter hook output priority -300; policy accept;","    oifname \"keystone-br0\" meta skuid != 0 meta l4proto tcp reject with tcp reset","    oifname \"keystone-br0\" meta skuid != 0 drop"]'
if [[ $(nix_json "builtins.length (builtins.filter (l: builtins.match \".*iifname vmap.*\" l != null) ((import $firewall).rules { }).lines)") == 0 ]] &&
  out=$(nix_json "((import $firewall).rules { }).ruleset" 2>&1); then
  pass "rules without sandboxes: no tap map, only the catch-alls"
else
  fail "rules without sandboxes: $out"
fi

# --- (e) -----------------------------------------------------------------------
echo "== (e) flake.lock is current for flake.nix"
# Untracked files are invisible to a flake in a git repository: check a copy.
# The copy goes into a throw-away store of our own (no daemon, no root).
mkdir "$tmp/flake"
cp flake.nix flake.lock "$tmp/flake/"
if ! command -v nix >/dev/null; then
  fail "flake.lock: the nix command is missing"
elif out=$(nix --store "$tmp/store" --extra-experimental-features 'nix-command flakes' \
  flake metadata --offline --no-update-lock-file "path:$tmp/flake" 2>&1); then
  for pin in \
    "github:NixOS/nixpkgs/643809054d65fdd466a63e3155b8c498cb483c04" \
    "github:microvm-nix/microvm.nix/71beea0076cd46dafcee97a5a2e7d00cbba5bd2f" \
    "rev=a7762d6f54b40560dd5255ce902e6e6a5d980fe9" \
    "follows input 'nixpkgs'"; do
    if grep -qF -- "$pin" <<<"$out"; then
      pass "flake.lock: $pin"
    else
      fail "flake.lock: $pin not in nix flake metadata"
      printf '%s\n' "$out" | sed 's/^/        /'
    fi
  done
else
  fail "nix flake metadata --no-update-lock-file: flake.lock does not match flake.nix"
  printf '%s\n' "$out" | sed 's/^/        /'
fi

# --- (f) -----------------------------------------------------------------------
echo "== (f) no import-from-derivation: Zellij's Cargo.lock is a file of this repository"
zellij_nix=./nixos-modules/pkgs/zellij.nix
# zellij.nix with stand-ins for nixpkgs: what it hands buildRustPackage.
zellij_args="import $zellij_nix { lib = { licenses.mit = null; }; rustPlatform.buildRustPackage = a: a; fetchCrate = a: \"/nix/store/stand-in-src\"; pkg-config = null; curl = null; openssl = null; }"
if [[ $(nix_json "builtins.typeOf ($zellij_args).cargoLock.lockFile") == '"path"' ]]; then
  pass "zellij.nix: cargoLock.lockFile is a path in the repository, not a file of src"
else
  fail "zellij.nix: cargoLock.lockFile is not a path (import-from-derivation)"
fi
# The same Zellij as tests/install-tools.sh builds off NixOS: its features
# but nixpkgs' curl for the vendored one, and the same release profile.
nix_features=$(nix_json "builtins.concatStringsSep \",\" ($zellij_args).buildFeatures" | tr -d '"')
tools_features=$(sed -n 's/.*--no-default-features --features \([a-z_,]*\)).*/\1/p' tests/install-tools.sh | tr ',' '\n' | grep -vx vendored_curl | paste -sd, -)
nix_lto=$(nix_json "($zellij_args).env.CARGO_PROFILE_RELEASE_LTO or \"fat\"" | tr -d '"')
if [[ -n $tools_features && $nix_features == "$tools_features" && $nix_lto == false ]] &&
  grep -q 'CARGO_PROFILE_RELEASE_LTO=false' tests/install-tools.sh; then
  pass "zellij.nix builds Zellij's features as install-tools.sh does ($nix_features), without fat LTO"
else
  fail "zellij.nix's features ($nix_features, LTO $nix_lto) differ from install-tools.sh's ($tools_features)"
fi
zellij_version=$(nix_json "($zellij_args).version" | tr -d '"')
crate=$(find "${CARGO_HOME:-$HOME/.cargo}/registry/cache" -name "zellij-$zellij_version.crate" 2>/dev/null | head -n1 || true)
if [[ -z $crate ]] && command -v curl >/dev/null; then
  crate=$tmp/zellij.crate
  curl -fsSL -o "$crate" "https://static.crates.io/crates/zellij/zellij-$zellij_version.crate" || crate=
fi
if [[ -z $crate ]]; then
  fail "zellij-$zellij_version.crate: neither in cargo's cache nor downloadable (curl)"
elif tar -xzf "$crate" -C "$tmp" "zellij-$zellij_version/Cargo.lock" &&
  cmp -s "$tmp/zellij-$zellij_version/Cargo.lock" nixos-modules/pkgs/zellij.Cargo.lock; then
  pass "nixos-modules/pkgs/zellij.Cargo.lock is the Cargo.lock of zellij-$zellij_version.crate"
else
  fail "nixos-modules/pkgs/zellij.Cargo.lock differs from the Cargo.lock of zellij-$zellij_version.crate"
fi

# --- (g) -----------------------------------------------------------------------
echo "== (g) dnsmasq with the module's settings beside systemd-resolved's stub listener"
domain=sandbox.local
expect "dnsmasqSettings: the domain's names are loopback; dnsmasq listens on loopback only" \
  "(import $lib).dnsmasqSettings { domain = \"$domain\"; enableIPv6 = true; }" \
  '{"address":["/sandbox.local/127.0.0.1"],"bind-interfaces":true,"listen-address":["127.0.0.1","::1"]}'
expect "dnsmasqSettings: the console's name through Caddy is loopback too" \
  "(import $lib).dnsmasqSettings { domain = \"$domain\"; enableIPv6 = false; names = [ \"console.agents.local\" ]; }" \
  '{"address":["/sandbox.local/127.0.0.1","/console.agents.local/127.0.0.1"],"bind-interfaces":true,"listen-address":["127.0.0.1"]}'
expect "resolvedDropIn: resolved routes the domain to dnsmasq (a routing domain, or .local goes to mDNS)" \
  "(import $lib).resolvedDropIn [ \"$domain\" ]" '"[Resolve]\nDNS=127.0.0.1\nDomains=~sandbox.local\n"'
expect "resolvedDropIn: and the console's name" \
  "(import $lib).resolvedDropIn [ \"$domain\" \"console.agents.local\" ]" '"[Resolve]\nDNS=127.0.0.1\nDomains=~sandbox.local ~console.agents.local\n"'
expect "resolvedOnlyByNetworkd: warned when only nixpkgs' networkd default turned resolved on" \
  "(import $lib).resolvedOnlyByNetworkd { resolved = true; priority = 1000; useNetworkd = false; }" true
expect "resolvedOnlyByNetworkd: not when the host set services.resolved.enable itself" \
  "(import $lib).resolvedOnlyByNetworkd { resolved = true; priority = 100; useNetworkd = false; }" false
expect "resolvedOnlyByNetworkd: not on a host that uses networkd" \
  "(import $lib).resolvedOnlyByNetworkd { resolved = true; priority = 1000; useNetworkd = true; }" false
expect "resolvedOnlyByNetworkd: not when resolved is off" \
  "(import $lib).resolvedOnlyByNetworkd { resolved = false; priority = 1500; useNetworkd = false; }" false

# The real dnsmasq, in a network namespace of its own, with its
# configuration rendered as nixpkgs' dnsmasq module renders settings (true: the
# bare key; a list: the key once per item).
render_dnsmasq() {
  python3 -c 'import json, sys
for k, v in sorted(json.loads(sys.argv[1]).items()):
    for x in v if isinstance(v, list) else [v]:
        print(k if x is True else f"{k}={x}")' "$1"
}
missing=()
for tool in dnsmasq python3 unshare ip; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
  if [[ -n ${CI:-} ]]; then
    fail "dnsmasq beside resolved's stub: ${missing[*]} missing (Debian: apt-get install -y dnsmasq-base python3 util-linux iproute2)"
  else
    echo "  skip  dnsmasq beside resolved's stub: ${missing[*]} missing (Debian: apt-get install -y dnsmasq-base)"
  fi
else
  ipv6=false
  [[ -e /proc/net/if_inet6 ]] && ipv6=true
  settings=$(nix_json "(import $lib).dnsmasqSettings { domain = \"$domain\"; enableIPv6 = $ipv6; }")
  render_dnsmasq "$settings" >"$tmp/dnsmasq.conf"
  render_dnsmasq "$settings" | grep -v -e '^listen-address=' -e '^bind-interfaces$' >"$tmp/dnsmasq-wildcard.conf"
  ns=(unshare -n)
  if ((EUID != 0)); then ns=(unshare -r -n); fi
  out=$("${ns[@]}" python3 tests/nix/dnsmasq-beside-resolved.py "$tmp/dnsmasq.conf" "$tmp/dnsmasq-wildcard.conf" "$domain" 2>&1) || true
  while IFS= read -r line; do
    case $line in
      "ok    "*) pass "${line#ok    }" ;;
      "FAIL  "*) fail "${line#FAIL  }" ;;
      *) echo "        $line" ;;
    esac
  done <<<"$out"
  grep -q '^ok    the module' <<<"$out" || fail "dnsmasq-beside-resolved.py did not report the module's settings"
fi

# --- (h) -----------------------------------------------------------------------
echo "== (h) options of other projects the modules set (tests/nix/foreign-options.json)"
foreign=tests/nix/foreign-options.json
walker=./tests/nix/options-set.nix
# A JSON list of strings, one per line, back to text.
json_strings() {
  [[ $1 == "[]" ]] && return 0
  printf '%s\n' "$1" | json_lines | sed -e 's/^"//' -e 's/"$//' -e 's/\\"/"/g' -e 's/\\\\/\\/g'
}
if ! listed=$(nix_json "builtins.length (builtins.fromJSON (builtins.readFile ./$foreign)).options" 2>"$tmp/err"); then
  fail "$foreign: not JSON with an \"options\" list"
  sed 's/^/        /' "$tmp/err"
elif ! nix_json "let w = import $walker { }; in { inherit (w) malformed unlisted unset pendingSet set unlocated guests; }" >"$tmp/walk.json" 2>"$tmp/err"; then
  fail "$walker could not walk the modules"
  sed 's/^/        /' "$tmp/err"
else
  walk="builtins.fromJSON (builtins.readFile $tmp/walk.json)"
  set_count=$(nix_json "builtins.length ($walk).set")
  guests=$(nix_json "($walk).guests")
  malformed=$(nix_json "($walk).malformed")
  if [[ $malformed == "[]" ]]; then
    pass "$foreign: $listed entries, each with option, project, file, and line and rev (or a note why not)"
  else
    fail "$foreign: entries without option, project (nixpkgs or microvm.nix), file, line and a 40-digit rev (or both null with a note), or listed twice:"
    json_strings "$malformed" | sed 's/^/        /'
  fi
  unlocated=$(nix_json "($walk).unlocated")
  if [[ $unlocated != "[]" ]]; then
    echo "  note  entries whose declaration is not recorded yet (line and rev null; see their notes):"
    json_strings "$unlocated" | sed 's/^/        /'
  fi
  if ((guests == 0)); then
    fail "no microvm.vms.<name>.config was walked: the guest module went unchecked"
  fi
  unlisted=$(nix_json "($walk).unlisted")
  if [[ $unlisted == "[]" ]]; then
    pass "every foreign option the modules set is listed ($set_count listed options set; host, flake and $guests guest definitions walked)"
  else
    fail "the modules set options that $foreign does not list (add each with its declaration; see the file's \"about\"):"
    json_strings "$unlisted" | sed 's/^/        /'
  fi
  unset_=$(nix_json "($walk).unset")
  if [[ $unset_ == "[]" ]]; then
    pass "every listed option is still set by the modules (pending entries excepted)"
  else
    fail "listed in $foreign but set by no module any more (remove them, or mark them \"pending\"):"
    json_strings "$unset_" | sed 's/^/        /'
  fi
  pending_set=$(nix_json "($walk).pendingSet")
  if [[ $pending_set == "[]" ]]; then
    pass "no entry marked pending is set yet"
  else
    fail "marked \"pending\" in $foreign but set now (drop \"pending\"):"
    json_strings "$pending_set" | sed 's/^/        /'
  fi
fi

# --- (i) ------------------------------------------------------------------------
echo "== (i) the host's and the guests' settings (tests/nix/options-set.nix reads the modules' definitions)"
walk="import $walker { }"
expect "Caddy's admin API on the unix socket /run/caddy/admin.sock (services.caddy.globalConfig)" \
  "($walk).host.services.caddy.globalConfig" '"admin unix//run/caddy/admin.sock"'
expect "Caddy's runtime directory /run/caddy exists and is Caddy's alone (0700)" \
  "($walk).host.systemd.services.caddy.serviceConfig" '{"RuntimeDirectory":"caddy","RuntimeDirectoryMode":"0700"}'
# The group's block of the generated policy: its rules, introspection
# denies included, and the shipped policy's group name nowhere.
group_block='let p = (import '"$lib"').groupPolicyText "devs"; parts = builtins.split "<policy group=\"devs\">" p; block = builtins.head (builtins.split "</policy>" (builtins.elemAt parts 2)); count = s: (builtins.length (builtins.split "send_interface=\"org.freedesktop.DBus.Introspectable\"" s) - 1) / 2; in'
expect "the D-Bus policy of a custom access group keeps the shipped policy's introspection denies" \
  "$group_block [ (builtins.length parts) (count block) (builtins.match \".*keystone-agent\\\">.*\" p == null) ]" \
  '[3,5,true]'
expect "qemu-bridge-helper: /etc/qemu/bridge.conf denies the sandboxes' bridge (with microvm.nix's allow all)" \
  "($walk).host.environment.etc.\"qemu/bridge.conf\".text" '"deny keystone-br0"'
expect "qemu-bridge-helper: a host whose own bridge.conf drops the deny is refused by an assertion" \
  "(import $walker { hostOverrides.environment.etc.\"qemu/bridge.conf\".text = \"allow all\"; }).hostFailing" \
  '["keystone.agent: /etc/qemu/bridge.conf (environment.etc.\"qemu/bridge.conf\".text) must contain `deny keystone-br0`, or any local user can attach a tap to the sandboxes'"'"' bridge with qemu-bridge-helper; add that line to your definition"]'
expect "home.img: microvm@<name> of every microvm sandbox runs with UMask=0077" \
  "map (n: ($walk).host.systemd.services.\"microvm@\${n}\".serviceConfig.UMask) [ \"batch\" \"docs\" \"webapp\" ]" \
  '["0077","0077","0077"]'
expect "home.img: each guest's state directory is microvm:kvm 0700, an existing home.img 0600 (tmpfiles)" \
  "($walk).host.systemd.tmpfiles.settings.\"11-keystone-agent\".\"/var/lib/microvms/webapp\" // { img = ($walk).host.systemd.tmpfiles.settings.\"11-keystone-agent\".\"/var/lib/microvms/webapp/home.img\"; }" \
  '{"d":{"group":"kvm","mode":"0700","user":"microvm"},"img":{"z":{"group":"kvm","mode":"0600","user":"microvm"}}}'
expect "KSM: off on the host unless the host turns it on (microvm.nix turns it on)" \
  "($walk).host.hardware.ksm.enable" false
guest_with="($walk).guestWith { name = \"demo\"; interface = { id = \"ks0000000000000\"; mac = \"02:00:00:00:00:01\"; address = \"10.231.1.2\"; gateway = \"10.231.0.1\"; }; }"
expect "QEMU: keystone guests run with -machine mem-merge=off (after microvm.nix's mem-merge=on)" \
  "let a = ($guest_with).microvm.qemu.extraArgs; in builtins.elemAt a (builtins.length a - 1)" '"mem-merge=off"'
expect "the guest's proxy in networking.proxy (sessions and nix-daemon), not only in session variables" \
  "($guest_with).networking.proxy" \
  '{"allProxy":"socks5h://10.231.0.1:3128","httpProxy":"http://10.231.0.1:3128","httpsProxy":"http://10.231.0.1:3128","noProxy":"localhost,127.0.0.1,::1"}'
expect "a guest whose defaultAgent it does not have is refused, naming the sandbox" \
  "($walk).guestFailing { name = \"demo\"; defaultAgent = \"claude\"; }" \
  '["keystone.agent.sandboxes.demo: defaultAgent \"claude\" is not in this sandbox'"'"'s guest; set keystone.sandbox.agents.claude-code.enable = true in its guestConfig (or keystone.agent.guestConfig), or choose another defaultAgent"]'
expect "a guest with its defaultAgent's CLI is accepted" \
  "($walk).guestFailing { name = \"demo\"; defaultAgent = \"gemini\"; agents.gemini-cli.enable = true; }" '[]'
expect "the host passes each sandbox's defaultAgent to its guest" \
  "(import $walker { fixture = { enable = true; sandboxes.a = { project = \"/p\"; owner = \"root\"; defaultAgent = \"codex\"; }; }; }).host.microvm.vms.a.config.keystone.sandbox.defaultAgent" '"codex"'
expect "agentd's unit allows 65536 open files (agentd budgets its descriptors below it)" \
  "($walk).host.systemd.services.agentd.serviceConfig.LimitNOFILE" 65536
# D-Bus activation (issue: a non-member starting agentd with
# StartServiceByName): the bus policy cannot refuse StartServiceByName for
# one name only, so on NixOS there is nothing to activate: the package the
# module installs carries the policy, not a system-bus activation file.
if grep -q 'system-services' flake.nix; then
  fail "flake.nix installs a system-bus activation file: any local user could start agentd by StartServiceByName"
else
  pass "the NixOS package installs no system-bus activation file (StartServiceByName cannot start agentd there)"
fi

echo "nix checks: $passed passed, $failed failed"
((failed == 0))

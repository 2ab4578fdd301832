# Pure functions behind the keystone.agent NixOS module:
#
# - the deterministic names and numbers of a declared sandbox's microVM
#   (tap interface, MAC address, IPv4 address, vsock CID);
# - `renderConfig`: the module's option values -> agentd's JSON configuration
#   (the schema of agentd/src/config.rs, fixture tests/fixtures/agentd-config.json);
# - `validate`: the problems behind the module's assertions, each naming the
#   option or sandbox involved.
#
# Builtins only, no nixpkgs `lib`: tests/nix/check.sh evaluates all of this
# with a plain `nix-instantiate --eval --strict --json` on machines that have
# Nix but no nixpkgs. agentd/src/naming.rs computes the same names in Rust;
# tests/fixtures/naming.json holds the vectors both sides are tested against.
#
# Everything derives from h = sha256(name) in lowercase hex:
#
#   tap id     "ks" + h[0..13]                         (15 characters, the Linux limit)
#   MAC        "02:" + h[13..15] ":" ... h[21..23]     (locally administered, unicast)
#   address    offset = 2 + int(h[23..27]) mod 65533;  "A.B.<offset/256>.<offset%256>"
#              in the subnet "A.B.0.0/16"; A.B.0.1 is the host (never an offset)
#   vsock CID  3 + int(h[27..34])                      (0-2 are reserved)
#
# The host is A.B.0.1 on the bridge keystone-br0, where agentd's egress
# gateway listens on port 3128 for every sandbox with a network
# (./firewall.nix renders the rules that make it their only way out).
let
  inherit (builtins)
    any
    attrNames
    concatLists
    concatMap
    elem
    concatStringsSep
    elemAt
    filter
    foldl'
    genList
    hashString
    head
    isString
    length
    listToAttrs
    mapAttrs
    match
    split
    stringLength
    substring
    ;

  # --- Small helpers (what nixpkgs lib would give) ---------------------------

  chars = s: genList (i: substring i 1 s) (stringLength s);

  digitValues = {
    "0" = 0;
    "1" = 1;
    "2" = 2;
    "3" = 3;
    "4" = 4;
    "5" = 5;
    "6" = 6;
    "7" = 7;
    "8" = 8;
    "9" = 9;
    "a" = 10;
    "b" = 11;
    "c" = 12;
    "d" = 13;
    "e" = 14;
    "f" = 15;
  };

  # Lowercase hexadecimal digits -> integer (at most 15 digits fit in Nix's
  # 64-bit integers; we never take more than 7).
  hexToInt = s: foldl' (acc: c: acc * 16 + digitValues.${c}) 0 (chars s);

  # Decimal digits -> integer.
  decToInt = s: foldl' (acc: c: acc * 10 + digitValues.${c}) 0 (chars s);

  mod = a: b: a - (builtins.div a b) * b;

  hasPrefix = prefix: s: substring 0 (stringLength prefix) s == prefix;

  hasSuffix =
    suffix: s:
    let
      n = stringLength s - stringLength suffix;
    in
    n >= 0 && substring n (stringLength suffix) s == suffix;

  # The pieces of `s` between each `sep` (a single character).
  splitString = sep: s: filter isString (split "[${sep}]" s);

  optional = cond: x: if cond then [ x ] else [ ];

  optionalAttrs = cond: set: if cond then set else { };

  # --- Defaults: the one place the module's option defaults are written -------

  # agentd's state directory under the NixOS service (StateDirectory=keystone-agent).
  stateDir = "/var/lib/keystone-agent";

  defaultSubnet = "10.231.0.0/16";

  # The bridge of the sandboxes' tap interfaces. It must not match the taps'
  # pattern ("ks" + 13 hex digits).
  bridgeName = "keystone-br0";

  # Port of agentd's egress gateway on the host's bridge address (agentd's
  # GATEWAY_ADDR port, which local and vm sandboxes use inside).
  gatewayPort = 3128;

  # Caddy's admin API: a unix socket in Caddy's runtime directory (mode
  # 0700, user caddy), so that only Caddy and root (agentd) can open it. On
  # TCP, any local user and any web page in the owner's browser could
  # reconfigure Caddy. caddyAdmin is the address in Caddy's notation, as
  # Caddy's `admin` option and agentd's proxy.caddy_admin take it.
  caddyRuntimeDirName = "caddy";
  caddyRuntimeDir = "/run/${caddyRuntimeDirName}";
  caddyAdminSocket = "${caddyRuntimeDir}/admin.sock";
  caddyAdmin = "unix/${caddyAdminSocket}";

  # The agent a defaultAgent names -> the guest module's agent CLI
  # (keystone.sandbox.agents.<cli>) that provides it in a microvm guest.
  agentCLIs = {
    claude = "claude-code";
    codex = "codex";
    gemini = "gemini-cli";
  };

  # The D-Bus policy for an access group other than keystone-agent: the
  # shipped policy (agentd/dbus/org.keystone.Agent1.conf) with its group
  # rules, the introspection denies included, given to that group.
  shippedPolicy = builtins.readFile ../../agentd/dbus/org.keystone.Agent1.conf;
  groupPolicyText =
    group:
    builtins.replaceStrings [ "<policy group=\"keystone-agent\">" ] [ "<policy group=\"${group}\">" ]
      shippedPolicy;

  # Option defaults of keystone.agent; nixos-modules/host/options.nix takes
  # its defaults from here so that renderConfig on a partial fixture and the
  # module agree.
  optionDefaults = {
    group = "keystone-agent";
    backend = "microvm";
    defaults = {
      memory = 8192;
      vcpus = 4;
      disk = 10240;
      pids = 4096;
      nestedVirt = true;
      network = "nat";
      egress = "allowlist";
      egressAllow = [ ];
      egressDeny = [ ];
      syncMode = "manual";
      syncIdleSeconds = 30;
      envFiles = [ ".env*" ];
      persist = true;
      defaultAgent = null;
      agentHome = "own";
      gitIdentity = "owner";
      snapshotQuota = 20480;
      idleStopSeconds = 0;
      backupEverySeconds = 0;
      backupKeep = 5;
      protect = [
        ".git/hooks/"
        ".husky/"
        ".github/workflows/"
        ".gitlab-ci.yml"
        ".pre-commit-config.yaml"
      ];
    };
    microvm = {
      shareProto = "virtiofs";
      hypervisor = "qemu";
      homeSize = 10240;
    };
    # null: no image (the flake's module sets its guest-image package).
    vm = {
      image = null;
      accel = "auto";
      share = "auto";
      fastStart = true;
    };
    kubernetes = {
      kubeconfig = null;
      context = "";
      namespace = "agent-sandboxes";
      storageClass = "standard";
      image = null;
      allowUnenforcedNetworkPolicy = false;
      toolbox = true;
    };
    # The agent toolbox of local and vm sandboxes (docs/agents.md); versions
    # left out take agentd's pinned ones.
    toolbox = {
      agents = [
        "claude"
        "codex"
        "gemini"
      ];
      versions = { };
      download = true;
    };
    proxy = {
      enable = false;
      domain = "sandbox.local";
    };
    network = {
      subnet = defaultSubnet;
    };
    # The audit log of what people type into sandboxes' terminals
    # (docs/console.md).
    audit = {
      keepDays = 90;
      maxMib = 64;
    };
    # The web console (docs/console.md).
    console = {
      enable = true;
      listen = "127.0.0.1:0";
      host = "console.keystone.internal";
    };
    # One sandboxes.<name>; project and owner have no default. Every setting
    # of `defaults` is also a per-sandbox override, null meaning "the default".
    sandbox = {
      backend = null;
      autostart = false;
      ports = { };
      memory = null;
      vcpus = null;
      disk = null;
      pids = null;
      nestedVirt = null;
      network = null;
      egress = null;
      egressAllow = null;
      egressDeny = null;
      syncMode = null;
      syncIdleSeconds = null;
      envFiles = null;
      persist = null;
      defaultAgent = null;
      agentHome = null;
      gitIdentity = null;
      snapshotQuota = null;
      idleStopSeconds = null;
      backupEverySeconds = null;
      backupKeep = null;
      protect = null;
      secrets = { };
      forges = [ ];
    };
  };

  # Option name (camelCase, NixOS) -> field name (snake_case, agentd's JSON).
  settingFields = {
    memory = "memory";
    vcpus = "vcpus";
    disk = "disk";
    pids = "pids";
    nestedVirt = "nested_virt";
    network = "network";
    egress = "egress";
    egressAllow = "egress_allow";
    egressDeny = "egress_deny";
    syncMode = "sync_mode";
    syncIdleSeconds = "sync_idle_seconds";
    envFiles = "env_files";
    persist = "persist";
    defaultAgent = "default_agent";
    agentHome = "agent_home";
    gitIdentity = "git_identity";
    snapshotQuota = "snapshot_quota";
    idleStopSeconds = "idle_stop_seconds";
    backupEverySeconds = "backup_every_seconds";
    backupKeep = "backup_keep";
    protect = "protect";
  };

  # Fill in the defaults of a (possibly partial) keystone.agent attrset. The
  # module always passes complete values; fixtures may leave defaults out.
  resolve =
    cfg:
    let
      d = optionDefaults;
      section = key: d.${key} // (cfg.${key} or { });
    in
    d
    // cfg
    // {
      defaults = section "defaults";
      microvm = section "microvm";
      vm = section "vm";
      kubernetes = section "kubernetes";
      toolbox = section "toolbox";
      proxy = section "proxy";
      network = section "network";
      audit = section "audit";
      console = section "console";
      sandboxes = mapAttrs (_: s: d.sandbox // s) (cfg.sandboxes or { });
    };

  # --- Names and numbers ------------------------------------------------------

  # { a, b } of a subnet written "A.B.0.0/16", or null.
  parseSubnet =
    subnet:
    let
      m = if isString subnet then match "([0-9]{1,3})\\.([0-9]{1,3})\\.0\\.0/16" subnet else null;
      a = decToInt (head m);
      b = decToInt (elemAt m 1);
    in
    if m == null || a > 255 || b > 255 then null else { inherit a b; };

  subnetRule = "an IPv4 /16 written as A.B.0.0/16";

  # The derived values of sandbox `name` in `subnet` ("A.B.0.0/16").
  derive =
    name: subnet:
    let
      net = parseSubnet subnet;
      h = hashString "sha256" name;
      hex = start: end: substring start (end - start) h;
      offset = 2 + mod (hexToInt (hex 23 27)) 65533;
      prefix = "${toString net.a}.${toString net.b}";
    in
    if net == null then
      throw "keystone.agent.network.subnet: '${toString subnet}' must be ${subnetRule}"
    else
      {
        inherit name;
        tapId = "ks" + hex 0 13;
        mac = concatStringsSep ":" [
          "02"
          (hex 13 15)
          (hex 15 17)
          (hex 17 19)
          (hex 19 21)
          (hex 21 23)
        ];
        address = "${prefix}.${toString (builtins.div offset 256)}.${toString (mod offset 256)}";
        gateway = "${prefix}.0.1";
        prefixLength = 16;
        cid = 3 + hexToInt (hex 27 34);
      };

  # "A.B.0.1", the host's address on the bridge (throws for a bad subnet).
  hostAddress = subnet: (derive "keystone-agent" subnet).gateway;

  # "A.B.0.1:3128", where agentd's gateway listens for the sandboxes, or null
  # for a bad subnet (which validate reports).
  gatewayListen =
    subnet: if parseSubnet subnet == null then null else "${hostAddress subnet}:${toString gatewayPort}";

  # The shape of an entry of tests/fixtures/naming.json.
  toVector = d: {
    inherit (d)
      name
      mac
      address
      cid
      ;
    tap_id = d.tapId;
  };

  # --- Per-sandbox settings ---------------------------------------------------

  # The sandbox's settings: its non-null overrides over `defaults`.
  sandboxSettings =
    cfg: name:
    let
      c = resolve cfg;
      s = c.sandboxes.${name};
    in
    mapAttrs (key: default: if (s.${key} or null) == null then default else s.${key}) c.defaults;

  # The backend that runs sandbox `name`.
  sandboxBackend =
    cfg: name:
    let
      c = resolve cfg;
      s = c.sandboxes.${name};
    in
    if s.backend == null then c.backend else s.backend;

  # Whether sandboxes may run on the kubernetes backend: it is the default
  # one, or a declared sandbox uses it.
  usesKubernetes =
    c: c.backend == "kubernetes" || any (n: sandboxBackend c n == "kubernetes") (attrNames c.sandboxes);

  # Names of the sandboxes that become microvm.nix guests.
  microvmSandboxes =
    cfg:
    filter (name: sandboxBackend cfg name == "microvm") (attrNames (resolve cfg).sandboxes);

  # Names of the microvm sandboxes with a tap on the bridge: network "nat" or
  # "bridge" (the same since the gateway is their only way out); "none" has
  # no interface.
  tapSandboxes =
    cfg: filter (name: (sandboxSettings cfg name).network != "none") (microvmSandboxes cfg);

  # --- The host's side of the guests ------------------------------------------

  # agentd's directory of sandbox `name` on the host.
  sandboxDir = name: "${stateDir}/sandboxes/${name}";

  # The host directories that microvm.nix guests get as shares (besides the
  # store). agentd makes them, the workspace as a clone of the project and
  # ssh/ as a directory of its own; microvm.nix's host module would make
  # each one microvm:kvm 0775 at activation (a tmpfiles rule per share
  # source), before agentd could, so the module takes them out of that rule.
  shareSources =
    cfg:
    concatMap (name: [
      "${sandboxDir name}/workspace"
      "${sandboxDir name}/ssh"
    ]) (microvmSandboxes cfg);

  # Interfaces that belong to the sandboxes: the bridge and the taps
  # ("ks" + 13 hex digits). No DHCP client or network manager may touch
  # them (globs as dhcpcd's denyinterfaces and NetworkManager take them).
  sandboxInterfaces = [
    bridgeName
    "ks*"
  ];

  # The systemd-networkd networks the module defines.
  ownNetworks = [
    "40-${bridgeName}"
    "41-keystone-taps"
  ];

  # Whether systemd-networkd-wait-online has something to wait for: the
  # host's own interfaces are networkd's (networking.useNetworkd), or it
  # defines networks of its own. The module's links are all
  # RequiredForOnline=no, so on a host without either it would only time out.
  waitOnlineUseful =
    { useNetworkd, networks }: useNetworkd || any (n: !(elem n ownNetworks)) networks;

  # --- Dev-server names on the host (proxy.enable) ---------------------------

  # dnsmasq's settings: every name under the domain is the loopback address
  # (where Caddy listens). It listens on loopback only: its default, a
  # wildcard bind of port 53, collides with systemd-resolved's stub listener
  # on 127.0.0.53:53 (dnsmasq would not start) and would answer on the
  # sandboxes' bridge as well. ::1 too when the host has IPv6, as
  # networking.resolvconf.useLocalResolver lists both in /etc/resolv.conf.
  dnsmasqSettings =
    {
      domain,
      enableIPv6,
      names ? [ ],
    }:
    {
      address = map (n: "/${n}/127.0.0.1") ([ domain ] ++ names);
      listen-address = [ "127.0.0.1" ] ++ optional enableIPv6 "::1";
      bind-interfaces = true;
    };

  # A drop-in for systemd-resolved, on hosts that run it: names under the
  # domain go to dnsmasq. resolved sends a name under .local to unicast DNS
  # only when a routing domain ("~domain") matches it, and to mDNS
  # otherwise, where it would never reach dnsmasq.
  resolvedDropIn = domains: ''
    [Resolve]
    DNS=127.0.0.1
    Domains=${concatStringsSep " " (map (d: "~${d}") domains)}
  '';

  # Whether to tell the host that systemd-resolved runs only because the
  # module turned systemd-networkd on (nixpkgs' networkd module enables
  # resolved with mkDefault): resolved is on, no definition stronger than
  # mkDefault (priority 1000) asked for it, and the host does not use
  # networkd for its own interfaces.
  resolvedOnlyByNetworkd =
    {
      resolved,
      priority,
      useNetworkd,
    }:
    resolved && priority >= 1000 && !useNetworkd;

  # Whether vm sandboxes are to be expected: the default backend is vm, or a
  # declared sandbox is one. Only then does agentd get vm.image (and a host
  # build the guest image).
  vmUsed = c: c.backend == "vm" || any (n: sandboxBackend c n == "vm") (attrNames c.sandboxes);

  # Whether local or vm sandboxes are to be expected: the default backend is
  # not microvm, or a declared sandbox is not.
  toolboxUsed =
    c: c.backend != "microvm" || any (n: sandboxBackend c n != "microvm") (attrNames c.sandboxes);

  # --- agentd's JSON configuration -------------------------------------------

  # (A null default, as defaultAgent's, is left out: agentd's is none.)
  renderSettings = s: listToAttrs (map (key: {
    name = settingFields.${key};
    value = s.${key};
  }) (filter (key: s.${key} != null) (attrNames settingFields)));

  renderSandbox =
    s:
    {
      project = toString s.project;
      inherit (s) owner autostart ports;
    }
    // optionalAttrs (s.backend != null) { inherit (s) backend; }
    // optionalAttrs ((s.secrets or { }) != { }) {
      secrets = mapAttrs (
        _: x:
        {
          file = toString x.file;
          inherit (x) host;
          bearer = x.bearer or false;
        }
        // optionalAttrs ((x.header or null) != null) { inherit (x) header; }
      ) s.secrets;
    }
    // optionalAttrs ((s.forges or [ ]) != [ ]) {
      forges = map (
        f:
        {
          inherit (f) url;
          branches = f.branches or [ "agent/*" ];
          token_file = toString f.tokenFile;
          tags = f.tags or false;
        }
        // optionalAttrs ((f.user or null) != null) { inherit (f) user; }
      ) s.forges;
    }
    // listToAttrs (
      map (key: {
        name = settingFields.${key};
        value = s.${key};
      }) (filter (key: (s.${key} or null) != null) (attrNames settingFields))
    );

  # keystone.agent option values -> agentd's configuration (an attrset that
  # the module writes with pkgs.formats.json). Only fields of agentd's schema
  # appear: microvm.* and group configure the host, not agentd;
  # of network.*, agentd gets the subnet (it derives each guest's address
  # from it, as the guests' static addresses are) and where its gateway
  # listens for them. `local` is left out: agentd's defaults (its read-only
  # paths include /nix and /run/current-system) suit NixOS.
  renderConfig =
    cfg:
    let
      c = resolve cfg;
      listen = gatewayListen c.network.subnet;
    in
    {
      state_dir = stateDir;
      default_backend = c.backend;
      defaults = renderSettings c.defaults;
      proxy = {
        inherit (c.proxy) enable domain;
        # The module puts Caddy's admin API on this socket (host/default.nix).
        caddy_admin = caddyAdmin;
      };
      microvm = {
        inherit (c.network) subnet;
      }
      // optionalAttrs (listen != null) { gateway_listen = listen; };
      vm = {
        inherit (c.vm) accel share;
        fast_start = c.vm.fastStart;
      }
      // optionalAttrs (c.vm.image != null && vmUsed c) { image = toString c.vm.image; };
      kubernetes = {
        inherit (c.kubernetes) namespace;
        storage_class = c.kubernetes.storageClass;
        allow_unenforced_network_policy = c.kubernetes.allowUnenforcedNetworkPolicy;
        inherit (c.kubernetes) toolbox;
      }
      // optionalAttrs (c.kubernetes.kubeconfig != null) { inherit (c.kubernetes) kubeconfig; }
      // optionalAttrs (c.kubernetes.context != "") { inherit (c.kubernetes) context; }
      // optionalAttrs (c.kubernetes.image != null) { inherit (c.kubernetes) image; };
      # The download only where a sandbox may need the toolbox: microvm
      # guests bring nixpkgs' agents (`agentctl create --backend local` on a
      # host without declared ones: `agentd --install-agents` once).
      toolbox = {
        inherit (c.toolbox) agents;
        download = c.toolbox.download && toolboxUsed c;
      }
      // optionalAttrs (c.toolbox.versions != { }) { inherit (c.toolbox) versions; };
      audit = {
        keep_days = c.audit.keepDays;
        max_mib = c.audit.maxMib;
      };
      console = {
        inherit (c.console) enable listen host;
      };
      sandboxes = mapAttrs (_: renderSandbox) c.sandboxes;
    };

  # --- Checks -----------------------------------------------------------------

  # Same rule as agentd/src/sandbox/validate.rs (check_name, NAME_RULE).
  nameRule = "a lowercase letter followed by up to 30 lowercase letters, digits or '-', not ending in '-' (regex [a-z]([a-z0-9-]{0,29}[a-z0-9])?)";

  validName = name: isString name && match "[a-z]([a-z0-9-]{0,29}[a-z0-9])?" name != null;

  # Same rule as agentd's config.rs for proxy.domain.
  validDomain =
    domain:
    let
      labels = filter isString (split "\\." domain);
    in
    isString domain && domain != "" && builtins.all (l: match "[a-z0-9-]{1,63}" l != null) labels;

  # Same rule and wording as agentd's ConsoleConfig::problems: an IPv4
  # loopback address and a port.
  consoleProblems =
    listen:
    let
      v4 = if isString listen then match "([0-9]{1,3})\\.([0-9]{1,3})\\.([0-9]{1,3})\\.([0-9]{1,3}):([0-9]{1,5})" listen else null;
      v6 = if isString listen then match "\\[[0-9a-fA-F:.]+\\]:[0-9]{1,5}" listen else null;
      inRange = v4 != null && builtins.all (i: decToInt (elemAt v4 i) <= 255) (genList (i: i) 4) && decToInt (elemAt v4 4) <= 65535;
    in
    if inRange && head v4 == "127" then
      [ ]
    else if inRange || v6 != null then
      [ "keystone.agent.console.listen ${listen} is not an IPv4 loopback address (such as 127.0.0.1:0): the console is served there only" ]
    else
      [ "keystone.agent.console.listen \"${toString listen}\" is not an address and port such as 127.0.0.1:0" ];

  # Same rule and wording as agentd's ConsoleConfig::problems for
  # console.host: a DNS name whose last two labels are not the links'
  # (one, when the links' domain has one label): names of one site share
  # at least those.
  consoleHostProblems =
    host: links:
    let
      labels = n: filter isString (split "\\." n);
      tail =
        n: k:
        let
          l = labels n;
          from = if length l > k then length l - k else 0;
        in
        concatStringsSep "." (genList (i: elemAt l (from + i)) (length l - from));
      k = if length (labels links) < 2 then length (labels links) else 2;
    in
    if host == "" then
      [ ]
    else if !validDomain host then
      [ "keystone.agent.console.host '${toString host}' is not a lowercase DNS name" ]
    else if host == "localhost" || match ".*\\.localhost" host != null then
      [
        "keystone.agent.console.host '${host}' is under .localhost, which browsers treat as secure over plain HTTP on any port: another local user listening on a loopback port would be sent the console's cookie; pick a name outside .localhost (such as console.keystone.internal)"
      ]
    else if tail host k == tail links k then
      [
        "keystone.agent.console.host '${host}' may be the same site as the links under '${links}' (a page a sandbox serves would be same-site with the console): pick a name whose last two labels are not the links' (such as console.keystone.internal)"
      ]
    else
      [ ];

  # Same checks as agentd's check_config, same wording.
  settingsProblems =
    s:
    optional (s.memory < 256) "memory ${toString s.memory} MiB is too small: at least 256 MiB"
    ++ optional (s.vcpus < 1) "vcpus must be at least 1"
    ++ optional (s.disk < 16 || s.disk > 16777216) "disk ${toString s.disk} MiB is out of range: from 16 to 16777216 MiB"
    ++ optional (s.pids < 16 || s.pids > 4194304) "pids ${toString s.pids} is out of range: from 16 to 4194304"
    ++ map (p: "env_files pattern '${p}' must be a file-name glob at the project root (no '/')") (
      filter (p: p == "" || p == "." || p == ".." || match ".*/.*" p != null) s.envFiles
    )
    ++ optional (length s.protect > 64) "protect has ${toString (length s.protect)} patterns; at most 64"
    ++ concatMap (
      p:
      let
        why = protectProblem p;
      in
      optional (why != null) "protect pattern '${p}': ${why}"
    ) s.protect;

  # Why agentd refuses a `protect` pattern (null: it does not), in its words.
  protectProblem =
    p:
    let
      body = if hasSuffix "/" p then substring 0 (stringLength p - 1) p else p;
      comps = splitString "/" body;
    in
    if p == "" then
      "is empty"
    else if stringLength p > 256 then
      "is longer than 256 bytes"
    else if match ".*[[:cntrl:]].*" p != null then
      "has a control character"
    else if hasPrefix "/" p then
      "must be relative to the repository (no leading '/')"
    else if any (c: c == "") comps then
      "has an empty path component ('//')"
    else if any (c: c == "." || c == "..") comps then
      "may not have '.' or '..' components"
    else if any (c: c != "**" && match ".*[*][*].*" c != null) comps then
      "'**' must be a whole path component"
    else
      null;

  # Every problem of a keystone.agent configuration, as assertion messages.
  # Per-sandbox messages start with "keystone.agent.sandboxes.<name>: ".
  # (Whether each owner is a user of the host needs config.users.users; the
  # module checks that itself.)
  validate =
    cfg:
    let
      c = resolve cfg;
      names = attrNames c.sandboxes;
      net = parseSubnet c.network.subnet;
      vmNames = microvmSandboxes c;
      derived =
        if net == null then
          { }
        else
          listToAttrs (
            map (name: {
              inherit name;
              value = derive name c.network.subnet;
            }) vmNames
          );

      clashes =
        name: field: what:
        if !(derived ? ${name}) then
          [ ]
        else
          map (other: "${what} ${toString derived.${name}.${field}} clashes with sandbox '${other}'; rename one of them") (
            filter (other: other != name && derived.${other}.${field} == derived.${name}.${field}) vmNames
          );

      global =
        optional (usesKubernetes c && c.kubernetes.image == null)
          "keystone.agent.kubernetes.image: a sandbox uses the kubernetes backend; set the image its Pods run (docs/kubernetes.md, \"The image\")"
        ++ optional (net == null) "keystone.agent.network.subnet: '${toString c.network.subnet}' must be ${subnetRule}"
        ++ optional (c.microvm.shareProto == "9p")
          "keystone.agent.microvm.shareProto: \"9p\" cannot work: QEMU opens 9p shares as user microvm, and the guest's SSH host key that agentd writes is root's, mode 0600; use \"virtiofs\""
        ++ optional (!validDomain c.proxy.domain)
          "keystone.agent.proxy.domain: '${toString c.proxy.domain}' is not a lowercase DNS name"
        ++ consoleProblems c.console.listen
        ++ consoleHostProblems c.console.host c.proxy.domain
        ++ map (m: "keystone.agent.defaults: ${m}") (settingsProblems c.defaults);

      # microvm.nix passes the module's CPU flags (nestedVirt) to QEMU only,
      # and cloud-hypervisor's vsock is a unix socket on the host, which
      # agentd's `ssh vsock/<cid>` cannot reach.
      cloudHypervisorProblems =
        name:
        let
          s = sandboxSettings c name;
        in
        optional (s.network == "none")
          "network \"none\" is reached over vsock, which cloud-hypervisor offers only as a unix socket agentd cannot use; give the sandbox a network or set keystone.agent.microvm.hypervisor to \"qemu\""
        ++ optional s.nestedVirt
          "nestedVirt is passed to QEMU only; set nestedVirt = false for this sandbox (or in keystone.agent.defaults) or set keystone.agent.microvm.hypervisor to \"qemu\"";

      perSandbox =
        name:
        let
          s = c.sandboxes.${name};
          project = toString (s.project or "");
          settings = sandboxSettings c name;
          backend = sandboxBackend c name;
        in
        map (m: "keystone.agent.sandboxes.${name}: ${m}") (
          optional (!validName name) "name '${name}' is not valid: use ${nameRule}"
          # A path literal is the live repository only by accident: in a
          # flake it is a copy in the store (read-only, never the work agentd
          # is to bring back).
          ++ optional (builtins.isPath (s.project or ""))
            "project ${project} is a Nix path literal; write the repository's path as a string (\"/home/alice/src/app\"), or a flake would copy it into the Nix store"
          ++ optional (!builtins.isPath (s.project or "") && hasPrefix "/nix/store/" project)
            "project ${project} is in the Nix store (a read-only copy); give the live repository's path"
          ++ optional (!hasPrefix "/" project) "project ${project} must be an absolute path"
          ++ optional ((s.owner or "") == "") "owner must be a user name"
          ++ settingsProblems (sandboxSettings c name)
          ++ clashes name "tapId" "tap interface"
          ++ clashes name "address" "address"
          ++ clashes name "cid" "vsock CID"
          ++ concatLists (
            map (
              var:
              let
                x = s.secrets.${var};
              in
              optional (!hasPrefix "/" (toString (x.file or ""))) "secrets.${var}.file must be an absolute path"
              ++ optional (hasPrefix "/nix/store" (toString (x.file or "")))
                "secrets.${var}.file is in the Nix store, which everyone can read; use agenix or sops-nix"
              ++ optional ((x.header or null) == null && !(x.bearer or false))
                "secrets.${var}: set header (such as \"x-api-key\") or bearer = true"
              ++ optional (
                (x.bearer or false)
                && !(elem (x.header or null) [
                  null
                  "authorization"
                  "Authorization"
                ])
              ) "secrets.${var}: bearer goes with the authorization header only"
            ) (attrNames (s.secrets or { }))
          )
          ++ concatMap (
            f:
            optional (!hasPrefix "/" (toString (f.tokenFile or ""))) "forges: ${f.url}: tokenFile must be an absolute path"
            ++ optional (hasPrefix "/nix/store" (toString (f.tokenFile or "")))
              "forges: ${f.url}: tokenFile is in the Nix store, which everyone can read; use agenix or sops-nix"
            ++ optional (!hasPrefix "https://" f.url) "forges: ${f.url}: not https://"
          ) (s.forges or [ ])
          ++ optional (
            (sandboxSettings c name).agentHome == "shared"
            && builtins.elem (sandboxBackend c name) [
              "microvm"
              "kubernetes"
            ]
          ) "agent_home \"shared\" works in local and vm sandboxes for now, not on the ${sandboxBackend c name} backend; use \"own\" (log in once per sandbox)"
          # microvm guests are checked by the guest module (it knows its
          # agents); local and vm sandboxes get the toolbox's.
          ++ optional (
            settings.defaultAgent != null
            && elem backend [
              "local"
              "vm"
            ]
            && !elem settings.defaultAgent c.toolbox.agents
          ) "defaultAgent \"${settings.defaultAgent}\" is not in keystone.agent.toolbox.agents, so the sandbox has no such agent; add it there or choose another"
          ++ optional (sandboxBackend c name == "vm" && c.vm.image == null)
            "the vm backend needs keystone.agent.vm.image (the flake's nixosModules.default sets it to the guest-image package)"
          ++ concatLists (
            optional (
              c.microvm.hypervisor == "cloud-hypervisor" && elem name vmNames
            ) (cloudHypervisorProblems name)
          )
        );
    in
    global ++ concatLists (map perSandbox names);
in
{
  inherit
    stateDir
    defaultSubnet
    bridgeName
    gatewayPort
    caddyRuntimeDirName
    caddyRuntimeDir
    caddyAdminSocket
    caddyAdmin
    agentCLIs
    groupPolicyText
    vmUsed
    hostAddress
    gatewayListen
    tapSandboxes
    optionDefaults
    settingFields
    resolve
    hexToInt
    parseSubnet
    derive
    toVector
    sandboxSettings
    sandboxBackend
    microvmSandboxes
    sandboxDir
    shareSources
    sandboxInterfaces
    ownNetworks
    waitOnlineUseful
    dnsmasqSettings
    resolvedDropIn
    resolvedOnlyByNetworkd
    renderConfig
    nameRule
    validName
    validate
    ;
}

# Keystone Agent host module: what the keystone.agent options (./options.nix)
# generate.
#
# - agentd as a system service on the D-Bus system bus, with its JSON
#   configuration rendered from the options (/etc/keystone-agent/agentd.json)
#   and its bus policy (members of keystone.agent.group may call it);
# - one microvm.nix guest per declared sandbox on the microvm backend
#   (microvm.vms.<name>, booting nixos-modules/guest);
# - the sandboxes' network: the bridge keystone-br0 with the host at A.B.0.1,
#   one tap interface per sandbox attached by systemd-networkd, and nftables
#   rules (../lib/firewall.nix) that let each tap reach agentd's egress
#   gateway at A.B.0.1:3128 and nothing else;
# - Caddy in front of the sandboxes' dev servers when proxy.enable.
#
# Needs microvm.nix's host module for microvm.vms (the flake's
# nixosModules.default imports it). The names, addresses, JSON rendering and
# checks are pure functions in ../lib/naming.nix, tested by tests/nix/check.sh.
{
  config,
  options,
  lib,
  pkgs,
  ...
}:
let
  cfg = config.keystone.agent;
  pure = import ../lib/naming.nix;
  # The console's name through Caddy, which resolves like the links.
  consoleNames = lib.optional (cfg.console.enable && cfg.console.host != "") cfg.console.host;

  firewall = (import ../lib/firewall.nix).rules cfg;

  # systemd-networkd (for the bridge) brings systemd-resolved with it, by
  # nixpkgs' default: say so, rather than change the host's resolver
  # silently.
  resolvedWarnings =
    lib.optional
      (pure.resolvedOnlyByNetworkd {
        resolved = config.services.resolved.enable;
        priority = options.services.resolved.enable.highestPrio;
        inherit (config.networking) useNetworkd;
      })
      "keystone.agent turns on systemd-networkd for the sandboxes' bridge, and with it nixpkgs turns on systemd-resolved, which now answers this host's DNS queries (dnsmasq and resolved are set up to work together). Set services.resolved.enable = true to keep it, or false to keep the resolver you had; either silences this warning.";

  configPath = "/etc/keystone-agent/agentd.json";
  # Where Caddy (services.caddy, user caddy, data under /var/lib/caddy) keeps
  # its internal CA's root certificate: `agentctl ports` points people at it.
  caddyRootCert = "/var/lib/caddy/.local/share/caddy/pki/authorities/local/root.crt";
  configFile = (pkgs.formats.json { }).generate "agentd.json" (
    lib.recursiveUpdate (pure.renderConfig cfg) (
      lib.optionalAttrs cfg.proxy.enable { proxy.ca_file = caddyRootCert; }
    )
  );

  bridge = pure.bridgeName;
  tapPattern = "ks" + lib.concatStrings (lib.genList (_: "?") 13);

  # A.B.0.1 (derive throws a message naming the option for a bad subnet;
  # the assertions report it first).
  hostAddress = pure.hostAddress cfg.network.subnet;

  # Where the sandboxes' rules are loaded: with the nftables firewall
  # (networking.nftables.enable), as tables of the nftables service, which
  # replaces or flushes everything on a reload and puts its tables back;
  # otherwise by a unit of our own. The module never turns
  # networking.nftables.enable on itself: that moves networking.firewall and
  # networking.nat to their nftables implementations, which refuse
  # iptables commands in their extraCommands, and blacklists the ip_tables
  # module. nf_tables tables and iptables rules (legacy or nft) apply side
  # by side, and a drop in either is final.
  nftablesFirewall = config.networking.nftables.enable;
  rulesUnit = if nftablesFirewall then "nftables.service" else "keystone-agent-nftables.service";
  rulesFile = pkgs.writeText "keystone-agent.nft" firewall.ruleset;

  vmNames = pure.microvmSandboxes cfg;
  settingsOf = pure.sandboxSettings cfg;
  namesOf = name: pure.derive name cfg.network.subnet;
  anyNested = lib.any (name: (settingsOf name).nestedVirt) vmNames;

  # uid of the guest's user `agent`. virtiofs passes uids through unchanged,
  # and on the host a sandbox's files belong to "the sandbox's uid" (its
  # owner's, 65534 for sandboxes of root; docs/git.md): the guest's user must
  # have that uid to own /workspace. Known at evaluation time only when the
  # owner's uid is fixed in users.users; otherwise 1000, with a warning.
  guestUid =
    name:
    let
      owner = cfg.sandboxes.${name}.owner;
      uid = (config.users.users.${owner} or { }).uid or null;
    in
    if owner != "root" && uid != null && uid >= 1000 && uid <= 59999 then
      {
        inherit uid;
        matches = true;
      }
    else
      {
        uid = 1000;
        matches = false;
      };

  # microvm.vms.<name> of one declared sandbox.
  sandboxVm =
    name:
    let
      sandbox = cfg.sandboxes.${name};
      settings = settingsOf name;
      names = namesOf name;
    in
    {
      # agentd starts declared sandboxes itself (those with autostart when
      # it starts), after it has made the workspace on their first start; a
      # microvm@ unit started by systemd at boot would race it and find no
      # workspace to share.
      autostart = false;
      # A rebuild must not restart a sandbox under a working agent; a changed
      # guest takes effect at the sandbox's next start.
      restartIfChanged = false;
      config = {
        imports = [
          ../guest
          cfg.guestConfig
          sandbox.guestConfig
        ];
        keystone.sandbox = {
          inherit name;
          hostStateDir = "${pure.stateDir}/sandboxes/${name}";
          inherit (settings)
            memory
            vcpus
            nestedVirt
            persist
            defaultAgent
            ;
          inherit (cfg.microvm) hypervisor shareProto homeSize;
          vsockCid = names.cid;
          inherit (guestUid name) uid;
          interface =
            if settings.network == "none" then
              null
            else
              {
                inherit (names)
                  mac
                  address
                  gateway
                  prefixLength
                  ;
                id = names.tapId;
                inherit (pure) gatewayPort;
              };
        };
      };
    };

  uidWarnings = map (
    name:
    let
      owner = cfg.sandboxes.${name}.owner;
      uid = config.users.users.${owner}.uid;
    in
    "keystone.agent.sandboxes.${name}: the guest's user `agent` gets uid 1000, but the sandbox's files on the host belong to "
    + (
      if owner == "root" then
        "uid 65534 (sandboxes of root); give the sandbox another owner"
      else if uid == null then
        "${owner}, whose uid is not fixed here; set users.users.${owner}.uid (1000-59999)"
      else
        "${owner} (uid ${toString uid}, outside 1000-59999); give the sandbox another owner"
    )
    + " so that the agent owns /workspace"
  ) (lib.filter (name: !(guestUid name).matches && config.users.users ? ${cfg.sandboxes.${name}.owner}) vmNames);

  # Owners outside the access group cannot reach agentd at all.
  groupWarnings = lib.concatLists (
    lib.mapAttrsToList (
      name: sandbox:
      let
        user = config.users.users.${sandbox.owner} or null;
        inGroup =
          user != null
          && (
            lib.elem cfg.group user.extraGroups
            || user.group == cfg.group
            || lib.elem sandbox.owner (config.users.groups.${cfg.group}.members or [ ])
          );
      in
      lib.optional (user != null && sandbox.owner != "root" && !inGroup) "keystone.agent.sandboxes.${name}: owner '${sandbox.owner}' is not in the group '${cfg.group}', so agentctl cannot reach agentd as that user; add \"${cfg.group}\" to users.users.${sandbox.owner}.extraGroups"
    ) cfg.sandboxes
  );

  # The policy shipped with agentd names the group keystone-agent; another
  # group gets the same rules, the introspection denies included (policies
  # of all files add up; ../lib/naming.nix, groupPolicyText).
  groupPolicy = pkgs.writeTextDir "share/dbus-1/system.d/org.keystone.Agent1.local.conf" (
    pure.groupPolicyText cfg.group
  );

  # microvm.nix's state directory of the guests (home.img, sockets).
  microvmStateDir = config.microvm.stateDir;
in
{
  imports = [ ./options.nix ];

  config = lib.mkIf cfg.enable (lib.mkMerge [
  {
    assertions =
      map (message: {
        assertion = false;
        inherit message;
      }) (pure.validate cfg)
      ++ lib.mapAttrsToList (name: sandbox: {
        assertion = config.users.users ? ${sandbox.owner};
        message = "keystone.agent.sandboxes.${name}: owner '${sandbox.owner}' is not a user of this host (no users.users.${sandbox.owner})";
      }) cfg.sandboxes
      ++ [
        {
          # The nftables service loads its tables (ours among them), then
          # networking.nftables.ruleset, in one transaction.
          assertion = !(nftablesFirewall && lib.hasInfix "flush ruleset" config.networking.nftables.ruleset);
          message = "keystone.agent: networking.nftables.ruleset contains `flush ruleset`, which would remove the tables that keep the sandboxes on ${bridge} from reaching anything but agentd's egress gateway; drop it (networking.nftables.flushRuleset = true flushes before the tables are loaded)";
        }
        {
          # qemu-bridge-helper (setcap, every user may run it) attaches a tap
          # of the caller's to any bridge /etc/qemu/bridge.conf allows.
          assertion = lib.hasInfix "deny ${bridge}" (config.environment.etc."qemu/bridge.conf".text or "");
          message = "keystone.agent: /etc/qemu/bridge.conf (environment.etc.\"qemu/bridge.conf\".text) must contain `deny ${bridge}`, or any local user can attach a tap to the sandboxes' bridge with qemu-bridge-helper; add that line to your definition";
        }
      ];

    warnings = uidWarnings ++ groupWarnings ++ resolvedWarnings;

    environment.systemPackages = [ cfg.package ];

    # --- D-Bus ------------------------------------------------------------------
    users.groups.${cfg.group} = { };
    services.dbus.packages = [ cfg.package ] ++ lib.optional (cfg.group != pure.optionDefaults.group) groupPolicy;

    # --- agentd -------------------------------------------------------------------
    environment.etc."keystone-agent/agentd.json".source = configFile;

    systemd.services.agentd = {
      description = "Keystone Agent daemon: sandboxes for AI coding agents";
      documentation = [ "https://github.com/keystone-agent/keystone-agent/blob/main/docs/configuration.md" ];
      wantedBy = [ "multi-user.target" ];
      # agentd keeps Caddy's routes in step through the admin API and
      # re-applies them when Caddy restarts or reloads.
      wants = lib.optional cfg.proxy.enable "caddy.service";
      # No sandbox runs before the rules that confine its tap are loaded;
      # without them agentd does not start.
      requires = [ rulesUnit ];
      after = [
        "network.target"
        rulesUnit
      ]
      ++ lib.optional cfg.proxy.enable "caddy.service";
      # Declarations change with the config file. microVM sandboxes keep
      # running across the restart (agentd adopts them again); local ones run
      # in agentd's cgroup and stop with it.
      restartTriggers = [ configFile ];
      environment.AGENTD_LOG = lib.mkDefault "info";
      # ssh and ssh-keygen reach and provision the guests (socat carries ssh
      # over vsock to microVM guests without a network); git for helpers
      # that shell out; QEMU and virtiofsd for the guests of the vm backend,
      # which agentd boots itself (found on PATH: agentd.json names neither;
      # agentd itself carries ssh to them over their virtio-serial ports);
      # curl, tar and gzip download and unpack the agent toolbox of local
      # sandboxes (docs/agents.md).
      path = [
        pkgs.openssh
        pkgs.socat
        pkgs.git
        pkgs.qemu_kvm
        pkgs.virtiofsd
        pkgs.curl
        pkgs.gnutar
        pkgs.gzip
      ];

      serviceConfig = {
        Type = "dbus";
        BusName = "org.keystone.Agent1";
        ExecStart = "${lib.getExe' cfg.package "agentd"} --system --config ${configPath}";
        Restart = "on-failure";
        RestartSec = "2s";
        # SIGTERM to agentd alone: it stops its local sandboxes one after the
        # other; what is left once it has exited gets SIGKILL.
        KillMode = "mixed";
        # Each local sandbox takes up to its grace period plus about 17 s:
        # systemd's default of 90 s could cut several short.
        TimeoutStopSec = "5min";
        # Open files: agentd budgets its descriptors (tunnels, forwarders,
        # sessions, a reserve for D-Bus and exec) below this limit, so that
        # one sandbox cannot use up what every other needs.
        LimitNOFILE = 65536;

        # /var/lib/keystone-agent: registry, sandboxes/<name>/{workspace,ssh}.
        # 0711: other users may not list it; agentd sets each sandbox's own
        # modes (virtiofsd runs as root; with 9p QEMU runs as user microvm).
        StateDirectory = "keystone-agent";
        StateDirectoryMode = "0711";
        # /var/cache/keystone-agent/agents: the agent toolbox's packages
        # ($CACHE_DIRECTORY), shown read-only in local sandboxes.
        CacheDirectory = "keystone-agent";

        # Resource limits of local sandboxes: agentd creates their cgroups in
        # its delegated subtree (cgroup v2).
        Delegate = "yes";

        # --- Hardening ------------------------------------------------------------
        # Local sandboxes are agentd's children: they inherit its seccomp
        # filters, capability bounding set and no_new_privs. The relaxations
        # below are each what agentd or its sandboxes need.

        # agentd runs as root: it acts for several owners (it drops to the
        # owner's uid in helpers) and builds namespaces and mounts. These are
        # the only capabilities it keeps:
        CapabilityBoundingSet = [
          "CAP_SYS_ADMIN" # unshare user/mount/pid/uts/ipc/net namespaces, mount, pivot_root
          "CAP_SYS_CHROOT" # enter a sandbox's root
          "CAP_SETUID" # helpers become the sandbox owner (setresuid); uid_map of sandboxes
          "CAP_SETGID" # same for groups (setgroups, setresgid); gid_map
          "CAP_SETPCAP" # drop capabilities from sandbox processes
          "CAP_CHOWN" # give workspace files to their owner / the guest's agent uid
          "CAP_FOWNER" # set modes and times on files of other users in workspaces
          "CAP_FSETID" # keep modes when changing owners of workspace files
          "CAP_DAC_OVERRIDE" # write sandbox state and host repositories of other users
          "CAP_DAC_READ_SEARCH" # read host repositories of other users
          "CAP_KILL" # signal sandbox processes that run as other uids
          "CAP_SYS_PTRACE" # read /proc/<pid> of sandbox processes (ports, namespaces)
          "CAP_NET_ADMIN" # bring up loopback in a sandbox's network namespace
          "CAP_SYS_RESOURCE" # resource limits of sandbox processes
        ];
        # Setuid binaries gain nothing under agentd or in local sandboxes
        # (agentd drops privileges with setresuid itself, which this allows).
        NoNewPrivileges = true;
        RestrictSUIDSGID = true;
        # /usr, /boot and /etc read-only. Not "strict": agentd writes into host
        # repositories wherever their owners keep them.
        ProtectSystem = "full";
        # Relaxed: host repositories live in /home; agentd reads them to make
        # workspaces and writes the sandboxes' branches back into them.
        ProtectHome = false;
        PrivateTmp = true;
        ProtectKernelModules = true;
        # Relaxed: these put read-only mounts over parts of /proc (/proc/sys,
        # /proc/kmsg, ...), and the kernel refuses to mount a new procfs in a
        # user namespace while /proc has such overmounts: local sandboxes
        # could not get their own /proc.
        ProtectKernelTunables = false;
        ProtectKernelLogs = false;
        # Relaxed: with Delegate=yes agentd writes its own cgroup subtree.
        ProtectControlGroups = false;
        # Relaxed: its seccomp filter would forbid sethostname in the
        # sandboxes' own UTS namespaces.
        ProtectHostname = false;
        # Relaxed: agentd creates user, mount, pid, uts, ipc, net and cgroup
        # namespaces for every local sandbox and confined helper.
        RestrictNamespaces = false;
        # Relaxed: JIT runtimes in local sandboxes (node, the JVM) need W+X memory.
        MemoryDenyWriteExecute = false;
        # No device restrictions (PrivateDevices, DevicePolicy): they apply to
        # agentd's delegated cgroups too, and sandboxes need /dev/fuse, ttys and
        # pseudo-terminals of their own.
        PrivateDevices = false;
        # D-Bus and helpers (unix), Caddy's admin API (inet), netlink for
        # sandbox network namespaces, vsock for microVM guests.
        RestrictAddressFamilies = [
          "AF_UNIX"
          "AF_INET"
          "AF_INET6"
          "AF_NETLINK"
          "AF_VSOCK"
        ];
        LockPersonality = true;
        RestrictRealtime = true;
        SystemCallArchitectures = "native";
        # No SystemCallFilter: sandboxes run arbitrary programs under it.
      };
    };

    # --- Sandboxes as microVMs ---------------------------------------------------
    microvm.vms = lib.genAttrs vmNames sandboxVm;

    # microvm.nix's host module makes every share source microvm:kvm 0775 at
    # activation (its tmpfiles rule "10-microvm"). The workspace and the key
    # directory are agentd's to make: the workspace as a clone of the project
    # at the first start, ssh/ as a directory only agentd writes. Made by the
    # rule, the first start would find an empty workspace it must not clone
    # over and a key directory that members of kvm can write and the guest's
    # sshd refuses (agentd copes with both, but nobody else should get them).
    systemd.tmpfiles.settings."10-microvm" = lib.genAttrs (pure.shareSources cfg) (_: lib.mkForce { });

    # The guests' own files in microvm.nix's state directory: the agent's
    # home (home.img, its logins) and QEMU's sockets. microvm.nix makes the
    # directory with mkdir as root (0755) and the image with touch under
    # microvm@<name> (umask 022): every local user could read the home.
    # The directory is microvm:kvm 0700 (QEMU runs as microvm; virtiofsd
    # and agentd as root), an image made before is made 0600, and
    # microvm@<name> makes new files 0600.
    systemd.tmpfiles.settings."11-keystone-agent" = builtins.listToAttrs (
      lib.concatMap (name: [
        (lib.nameValuePair "${microvmStateDir}/${name}" {
          d = {
            user = "microvm";
            group = "kvm";
            mode = "0700";
          };
        })
        (lib.nameValuePair "${microvmStateDir}/${name}/home.img" {
          z = {
            user = "microvm";
            group = "kvm";
            mode = "0600";
          };
        })
      ]) vmNames
    );

    # Kernel same-page merging, which microvm.nix turns on, lets one
    # sandbox learn by timing which pages another holds. Off, unless the
    # host turns it on itself; keystone guests are not offered to it either
    # way (QEMU's mem-merge=off, nixos-modules/guest).
    hardware.ksm.enable = lib.mkOverride 900 false;

    # qemu-bridge-helper must not attach anyone's tap to the sandboxes'
    # bridge (a deny wins over any allow in the file). At microvm.nix's
    # priority, so that its `allow all` for other bridges stays unless the
    # host writes the file itself; the assertion above checks that the
    # line is there whatever the host writes.
    environment.etc."qemu/bridge.conf".text = lib.mkDefault "deny ${bridge}";

    # vhost-vsock: agentd reaches microVM guests over vsock (QEMU's
    # vhost-vsock). The vm backend's guests need no vsock.
    boot.kernelModules = [ "vhost_vsock" ];

    # Nested virtualisation for sandboxes with nestedVirt (the default on most
    # kernels already; the guest's -cpu flags decide per sandbox).
    boot.extraModprobeConfig = lib.mkIf anyNested ''
      options kvm_intel nested=1
      options kvm_amd nested=1
    '';

    # --- Network -------------------------------------------------------------------
    # A bridge with the host at A.B.0.1; every tap interface that microvm.nix
    # creates for a sandbox ("ks" + 13 hex digits) joins it as an isolated
    # port. The bridge has no IPv6 address at all: nothing on the host
    # answers a sandbox over IPv6 (the rules drop its IPv6 frames anyway).
    systemd.network = {
      enable = true;
      netdevs."40-${bridge}".netdevConfig = {
        Kind = "bridge";
        Name = bridge;
      };
      networks."40-${bridge}" = {
        matchConfig.Name = bridge;
        address = [ "${hostAddress}/16" ];
        networkConfig = {
          ConfigureWithoutCarrier = true;
          LinkLocalAddressing = "no";
          IPv6AcceptRA = false;
        };
        linkConfig.RequiredForOnline = "no";
      };
      networks."41-keystone-taps" = {
        matchConfig.Name = tapPattern;
        networkConfig = {
          Bridge = bridge;
          LinkLocalAddressing = "no";
        };
        bridgeConfig.Isolated = true;
        linkConfig.RequiredForOnline = "no";
      };
    };

    # The sandboxes' only way out is agentd's egress gateway on A.B.0.1:3128
    # (agentd.json's microvm.gateway_listen): nothing is routed or
    # masqueraded for them. The rules (../lib/firewall.nix, docs/network.md)
    # let each tap send only its own guest's MAC and address, accept from the
    # bridge only new connections to the gateway and replies to the host's
    # own connections (agentd's ssh), and route nothing from or into the
    # bridge; a sandbox-to-sandbox frame is dropped too. They hook in before
    # everything else, and a drop in them is final whatever the firewall
    # accepts, so networking.firewall cannot open anything for the sandboxes.
    networking.nftables.tables = lib.mkIf nftablesFirewall {
      keystone-agent = {
        family = "inet";
        content = firewall.inet;
      };
      keystone-agent-bridge = {
        name = "keystone-agent";
        family = "bridge";
        content = firewall.bridge;
      };
    };
    systemd.services.keystone-agent-nftables = lib.mkIf (!nftablesFirewall) {
      description = "Keystone Agent: nftables rules of the sandboxes' bridge";
      documentation = [ "https://github.com/keystone-agent/keystone-agent/blob/main/docs/network.md" ];
      # In place before any interface is configured; ordered as nixpkgs'
      # nftables.service is.
      wantedBy = [ "multi-user.target" ];
      after = [ "sysinit.target" ];
      before = [
        "network-pre.target"
        "shutdown.target"
      ];
      wants = [
        "network-pre.target"
        "sysinit.target"
      ];
      conflicts = [ "shutdown.target" ];
      unitConfig.DefaultDependencies = false;
      # The file replaces both tables in one transaction, so a reload never
      # leaves the taps without rules. Stopping the unit leaves them loaded:
      # they fail closed, and they do nothing once the bridge is gone.
      reloadIfChanged = true;
      serviceConfig = {
        Type = "oneshot";
        RemainAfterExit = true;
        ExecStart = "${lib.getExe' pkgs.nftables "nft"} -f ${rulesFile}";
        ExecReload = "${lib.getExe' pkgs.nftables "nft"} -f ${rulesFile}";
      };
    };

    # The firewall (iptables or nftables) must let the gateway's connections
    # in; the rules above allow nothing else from the bridge whatever it
    # allows.
    networking.firewall.interfaces.${bridge}.allowedTCPPorts = [ pure.gatewayPort ];

    # systemd-networkd configures only the two networks above. On a host
    # whose own interfaces are not networkd's, systemd-networkd-wait-online
    # would have nothing to wait for (both are RequiredForOnline=no) and
    # fail after its timeout at every boot.
    systemd.network.wait-online.enable = lib.mkIf (
      !pure.waitOnlineUseful {
        inherit (config.networking) useNetworkd;
        networks = builtins.attrNames config.systemd.network.networks;
      }
    ) (lib.mkDefault false);

    # NetworkManager and dhcpcd, where they run, must leave the bridge and
    # taps alone (dhcpcd would ask for addresses on them).
    networking.networkmanager.unmanaged = map (i: "interface-name:${i}") pure.sandboxInterfaces;
    networking.dhcpcd.denyInterfaces = pure.sandboxInterfaces;

    # --- Dev-server links ------------------------------------------------------------
    # agentd owns a server of its own in Caddy (`keystone-agent`, on :443),
    # made through the admin API on ${pure.caddyAdmin}: its routes
    # (`<branch>.<sandbox>.<domain>`, `<sandbox>.<domain>`) lead to agentd's
    # forwarders on loopback, and a catch-all leads to agentd's pages (503 for
    # a stopped sandbox, 404 for unknown names). A reload of the Caddyfile
    # (what a rebuild that changes it does) replaces Caddy's whole
    # configuration and drops that server: agentd checks every two seconds
    # and puts it back. No virtual host is declared here, so nothing else in
    # Caddy claims :443 for the domain.
    #
    # Names no public CA would certify (sandbox.local, the default) get
    # certificates from Caddy's own CA; its root certificate is
    # ${caddyRootCert}.
    services.caddy = lib.mkIf cfg.proxy.enable {
      enable = true;
      # The admin API on a unix socket in a directory only Caddy (and root:
      # agentd) can open; on localhost:2019 any local user, and any web page
      # in the owner's browser, could reconfigure Caddy. agentd.json's
      # proxy.caddy_admin names the same socket; `caddy reload` finds it in
      # the configuration.
      globalConfig = "admin ${pure.caddyAdmin}";
    };
    systemd.services.caddy.serviceConfig = lib.mkIf cfg.proxy.enable {
      RuntimeDirectory = pure.caddyRuntimeDirName;
      RuntimeDirectoryMode = "0700";
    };

    # Browsers on this machine resolve `*.<domain>` (and the console's name,
    # which Caddy serves too) through dnsmasq, which answers every name
    # under the domain with the loopback address (where Caddy listens) and
    # forwards everything else. It listens on loopback
    # only, beside systemd-resolved's stub listener where resolved runs.
    services.dnsmasq = lib.mkIf cfg.proxy.enable {
      enable = true;
      resolveLocalQueries = true;
      settings = pure.dnsmasqSettings {
        inherit (cfg.proxy) domain;
        inherit (config.networking) enableIPv6;
        names = consoleNames;
      };
    };

    # Where systemd-resolved answers the host's queries, it sends the names
    # under the domain to dnsmasq (a routing domain: without one, resolved
    # asks mDNS for names under .local). A drop-in, whichever way the host
    # configures resolved itself.
    environment.etc."systemd/resolved.conf.d/keystone-agent.conf" =
      lib.mkIf (cfg.proxy.enable && config.services.resolved.enable)
        { text = pure.resolvedDropIn ([ cfg.proxy.domain ] ++ consoleNames); };
    systemd.services.systemd-resolved.restartTriggers =
      lib.mkIf (cfg.proxy.enable && config.services.resolved.enable)
        [ (pure.resolvedDropIn ([ cfg.proxy.domain ] ++ consoleNames)) ];
  }
  {
    # microvm@<name> of each keystone guest makes new files 0600 (home.img
    # above). A drop-in: microvm.nix defines the instances as drop-ins of
    # its microvm@ template.
    systemd.services = lib.genAttrs (map (name: "microvm@${name}") vmNames) (_: {
      serviceConfig.UMask = "0077";
    });
  }
  ]);
}

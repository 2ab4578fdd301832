# The NixOS guest every Keystone Agent sandbox boots (one microvm.nix microVM
# per sandbox). Needs microvm.nix's guest module (microvm.vms.<name>.config
# adds it; guest-image/default.nix imports it itself).
#
# What the guest gets:
# - user `agent` (stable uid, default 1000: agentd gives the workspace files
#   to that uid on the host, and virtiofs passes uids through unchanged);
# - /workspace: the sandbox's workspace directory on the host (virtiofs or
#   9p, tag "workspace"); the host repository itself is never shared;
# - the host's /nix/store read-only, with a writable overlay so that nix
#   works inside; the agent's home on a disk image when `persist`;
# - git, Zellij, direnv (loads /workspace/.envrc and .env), optional agent CLIs;
# - sshd for the host only: host key and authorized key come from a
#   read-only share that agentd fills per sandbox; no passwords; it listens on
#   vsock and on the sandbox's address, and the firewall accepts only the
#   host's address;
# - with a network, the proxy variables (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY,
#   NO_PROXY, both cases) in every login's environment and nix-daemon's
#   (networking.proxy), pointing at agentd's
#   egress gateway on the host's bridge address: the host's rules let the
#   guest reach nothing else, and it has no DNS server (the gateway resolves
#   names);
# - /etc/keystone-agent-sandbox, a marker holding the sandbox's name.
#
# Options live under keystone.sandbox.* (the host module sets them from
# keystone.agent.sandboxes.<name>).
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib) types;

  cfg = config.keystone.sandbox;
  pure = import ../lib/naming.nix;
  d = pure.optionDefaults;

  # Where the read-only share with the SSH keys is mounted in the guest.
  sshDir = "/var/lib/keystone-agent/ssh";
  # agentd's own script (also run by agentd in `vm` guests).
  protectScript = pkgs.writeShellScriptBin "keystone-protect" (
    builtins.readFile ../../agentd/share/keystone-protect
  );

  # The agent CLIs this module can install, by nixpkgs attribute name.
  agentCLIs = {
    claude-code = "Claude Code (unfree: allow it in the host's nixpkgs config)";
    codex = "OpenAI Codex CLI";
    gemini-cli = "Gemini CLI";
  };

  # The sandboxes use the host's package set (microvm.vms.<name>.pkgs), so its
  # nixpkgs config decides whether unfree packages are allowed.
  unfreeAllowed =
    pkg: (pkgs.config.allowUnfree or false) || ((pkgs.config.allowUnfreePredicate or (_: false)) pkg);

  enabledCLIs = lib.filter (agent: cfg.agents.${agent}.enable) (builtins.attrNames agentCLIs);

  interfaceModule = {
    options = {
      id = lib.mkOption {
        type = types.str;
        description = "Name of the tap interface on the host (at most 15 characters).";
      };
      mac = lib.mkOption {
        type = types.str;
        description = "MAC address of the guest's interface.";
      };
      address = lib.mkOption {
        type = types.str;
        description = "IPv4 address of the guest.";
      };
      prefixLength = lib.mkOption {
        type = types.ints.between 1 32;
        default = 16;
        description = "Prefix length of the sandboxes' subnet.";
      };
      gateway = lib.mkOption {
        type = types.str;
        description = "The host's address on the sandboxes' bridge: default route, agentd's egress gateway, and the only source sshd and dev servers accept.";
      };
      gatewayPort = lib.mkOption {
        type = types.port;
        default = pure.gatewayPort;
        description = "Port of agentd's egress gateway on {option}`gateway`: where the proxy variables point.";
      };
    };
  };

  # The variables that point the usual clients (curl, git, npm, pip, cargo,
  # the agents' CLIs) at the gateway, in both cases as each reads one or the
  # other; the same values agentd gives local and vm sandboxes, at the
  # bridge address instead of loopback.
  proxyVariables =
    let
      gateway = "${cfg.interface.gateway}:${toString cfg.interface.gatewayPort}";
      lower = {
        http_proxy = "http://${gateway}";
        https_proxy = "http://${gateway}";
        all_proxy = "socks5h://${gateway}";
        no_proxy = "localhost,127.0.0.1,::1";
      };
    in
    {
      inherit lower;
      upper = lib.mapAttrs' (name: value: lib.nameValuePair (lib.toUpper name) value) lower;
    };
in
{
  options.keystone.sandbox = {
    name = lib.mkOption {
      type = types.str;
      description = "Name of the sandbox (also the guest's host name).";
    };

    zellij = lib.mkOption {
      type = types.package;
      default = pkgs.callPackage ../pkgs/zellij.nix { };
      defaultText = lib.literalMD "Zellij 0.45.1 built from crates.io";
      description = "Zellij for the sandbox's sessions; must be a 0.45.x release.";
    };

    hostStateDir = lib.mkOption {
      type = types.str;
      default = "/var/lib/keystone-agent/sandboxes/${cfg.name}";
      defaultText = lib.literalExpression ''"/var/lib/keystone-agent/sandboxes/''${name}"'';
      description = ''
        The sandbox's directory on the host. Its `workspace/` is shared as
        /workspace, its `ssh/` (ssh_host_ed25519_key, authorized_keys; written
        by agentd before it starts the sandbox) read-only as ${sshDir}.
      '';
    };

    memory = lib.mkOption {
      type = types.ints.positive;
      default = d.defaults.memory;
      description = "RAM in MiB.";
    };
    vcpus = lib.mkOption {
      type = types.ints.positive;
      default = d.defaults.vcpus;
      description = "Virtual CPUs.";
    };
    nestedVirt = lib.mkOption {
      type = types.bool;
      default = d.defaults.nestedVirt;
      description = "Expose VT-x/AMD-V to the guest (QEMU on x86_64).";
    };
    persist = lib.mkOption {
      type = types.bool;
      default = d.defaults.persist;
      description = "Keep /home/agent on a disk image (`home.img` in the microVM's state directory).";
    };
    homeSize = lib.mkOption {
      type = types.ints.positive;
      default = d.microvm.homeSize;
      description = "Size of the home disk image in MiB.";
    };
    hypervisor = lib.mkOption {
      type = types.enum [
        "qemu"
        "cloud-hypervisor"
      ];
      default = d.microvm.hypervisor;
      description = "microvm.nix hypervisor.";
    };
    shareProto = lib.mkOption {
      type = types.enum [
        "virtiofs"
        "9p"
      ];
      default = d.microvm.shareProto;
      description = "Protocol of the shared directories.";
    };

    interface = lib.mkOption {
      type = types.nullOr (types.submodule interfaceModule);
      default = null;
      description = "The tap interface on the host's bridge; null: no network (vsock only).";
    };
    vsockCid = lib.mkOption {
      type = types.nullOr (types.ints.between 3 4294967294);
      default = null;
      description = "vsock CID of the guest; sshd listens on vsock port 22 when set.";
    };

    uid = lib.mkOption {
      type = types.ints.between 1000 59999;
      default = 1000;
      description = ''
        uid of the user `agent`. agentd gives the workspace to this uid on the
        host; change both together.
      '';
    };
    sudo = lib.mkOption {
      type = types.bool;
      default = true;
      description = ''
        Let `agent` use sudo without a password. The microVM is the boundary;
        inside it the agent may be root.
      '';
    };

    agents = lib.mapAttrs (_: what: {
      enable = lib.mkEnableOption what;
    }) agentCLIs;

    defaultAgent = lib.mkOption {
      type = types.nullOr (types.enum (builtins.attrNames pure.agentCLIs));
      default = null;
      description = ''
        The agent a new session starts (agentd's `default_agent` of the
        sandbox); the guest must have its CLI ({option}`keystone.sandbox.agents`).
      '';
    };
  };

  config = {
    assertions = map (agent: {
      assertion = !(pkgs.${agent}.meta.unfree or false) || unfreeAllowed pkgs.${agent};
      message = "keystone.sandbox.agents.${agent}: ${agent} has an unfree license; allow it in the host's nixpkgs config (nixpkgs.config.allowUnfree, or allowUnfreePredicate naming \"${agent}\"): the sandboxes use the host's package set";
    }) enabledCLIs
    ++ [
      {
        # A Zellij client and server must be the same release; agentd's
        # sessions are made for 0.45.
        assertion = lib.versions.majorMinor cfg.zellij.version == "0.45";
        message = "keystone.sandbox.zellij: sessions need Zellij 0.45.x, but the package is ${cfg.zellij.version}";
      }
      {
        # A session would start an agent the guest does not have.
        assertion = cfg.defaultAgent == null || cfg.agents.${pure.agentCLIs.${cfg.defaultAgent}}.enable;
        message =
          let
            cli = pure.agentCLIs.${cfg.defaultAgent};
          in
          "keystone.agent.sandboxes.${cfg.name}: defaultAgent \"${cfg.defaultAgent}\" is not in this sandbox's guest; set keystone.sandbox.agents.${cli}.enable = true in its guestConfig (or keystone.agent.guestConfig), or choose another defaultAgent";
      }
    ];

    # The guest's root is a tmpfs recreated at every boot; nothing stateful
    # depends on this.
    system.stateVersion = lib.mkDefault lib.trivial.release;
    networking.hostName = cfg.name;

    microvm = {
      inherit (cfg) hypervisor;
      mem = cfg.memory;
      vcpu = cfg.vcpus;

      shares = [
        {
          # The host's store, read-only; /nix/store is an overlay of it and
          # writableStoreOverlay (see below).
          tag = "ro-store";
          source = "/nix/store";
          mountPoint = "/nix/.ro-store";
          proto = cfg.shareProto;
          readOnly = true;
        }
        {
          tag = "workspace";
          source = "${cfg.hostStateDir}/workspace";
          mountPoint = "/workspace";
          proto = cfg.shareProto;
        }
        {
          tag = "keystone-ssh";
          source = "${cfg.hostStateDir}/ssh";
          mountPoint = sshDir;
          proto = cfg.shareProto;
          readOnly = true;
        }
      ];

      # nix works inside: builds land in this overlay (on the guest's tmpfs,
      # so they are gone after a restart; the workspace is what persists).
      writableStoreOverlay = "/nix/.rw-store";

      volumes = lib.optional cfg.persist {
        # Relative to the microVM's state directory on the host
        # (/var/lib/microvms/<name>/home.img); created on first start.
        image = "home.img";
        mountPoint = "/home/agent";
        size = cfg.homeSize;
        fsType = "ext4";
      };

      interfaces = lib.optional (cfg.interface != null) {
        type = "tap";
        inherit (cfg.interface) id mac;
      };

      vsock.cid = cfg.vsockCid;
      # systemd's ssh-generator puts sshd on vsock port 22: the host reaches
      # the guest without any network (`ssh vsock/<cid>`).
      vsock.ssh.enable = cfg.vsockCid != null;

      # microvm.nix runs QEMU with `-cpu host,+x2apic,-sgx`, which passes VT-x
      # or AMD-V through whenever the host's KVM allows nesting (the host
      # module turns that on when a sandbox asks for it). A later -cpu wins:
      # repeat microvm.nix's model so the flags do not depend on its default,
      # and take the extensions away when nesting is not wanted.
      qemu.extraArgs =
        lib.optionals (cfg.hypervisor == "qemu" && pkgs.stdenv.hostPlatform.isx86_64) [
          "-cpu"
          (if cfg.nestedVirt then "host,+x2apic,-sgx" else "host,+x2apic,-sgx,-vmx,-svm")
        ]
        # microvm.nix asks QEMU for mem-merge=on: the guest's RAM would be
        # offered to KSM, whose merged pages let one sandbox learn by timing
        # what another holds in memory. A later -machine wins (QEMU merges
        # the options; the memory backend takes the machine's setting).
        ++ lib.optionals (cfg.hypervisor == "qemu") [
          "-machine"
          "mem-merge=off"
        ];
    };

    # A fresh ext4 volume's root belongs to root: give the home to the agent.
    # /run/keystone is the sandbox contract every backend keeps (see
    # docs/architecture.md, "Sessions"): agentd runs bin/zellij with the
    # configuration and default layout in share/zellij.
    systemd.tmpfiles.rules = [
      "d /home/agent 0700 agent users -"
      "d /run/keystone 0755 root root -"
      "d /run/keystone/bin 0755 root root -"
      "d /run/keystone/share 0755 root root -"
      "L+ /run/keystone/bin/zellij - - - - ${cfg.zellij}/bin/zellij"
      "L+ /run/keystone/share/zellij - - - - ${../../agentd/share/zellij}"
    ];

    users.users.agent = {
      isNormalUser = true;
      inherit (cfg) uid;
      group = "users";
      home = "/home/agent";
      createHome = true;
      description = "AI coding agent";
      extraGroups = lib.optional cfg.sudo "wheel";
      # No password at all: the only way in is the host's key over SSH (or
      # agentd's own control channel).
    };
    security.sudo.wheelNeedsPassword = lib.mkIf cfg.sudo false;

    # --- Network: a static address on the tap interface, matched by MAC -----
    # No DHCP, no IPv6, no DNS server: the host's rules drop or refuse all of
    # it. The way out is the egress gateway, which resolves names itself.
    networking.useNetworkd = true;
    networking.useDHCP = false;
    networking.nameservers = lib.mkDefault [ ];
    systemd.network.networks."10-keystone" = lib.mkIf (cfg.interface != null) {
      matchConfig.MACAddress = cfg.interface.mac;
      address = [ "${cfg.interface.address}/${toString cfg.interface.prefixLength}" ];
      gateway = [ cfg.interface.gateway ];
      networkConfig = {
        LinkLocalAddressing = "no";
        IPv6AcceptRA = false;
      };
    };
    # The lower-case variables through networking.proxy: nixpkgs puts them
    # into every session (PAM: agentd's commands and terminals over ssh, a
    # person's own ssh, the console) and into nix-daemon's environment, so
    # that `nix build` inside fetches through the gateway too. The upper-case
    # ones, which networking.proxy does not set, as session variables.
    networking.proxy = lib.mkIf (cfg.interface != null) {
      httpProxy = proxyVariables.lower.http_proxy;
      httpsProxy = proxyVariables.lower.https_proxy;
      allProxy = proxyVariables.lower.all_proxy;
      noProxy = proxyVariables.lower.no_proxy;
    };
    environment.sessionVariables = lib.mkIf (cfg.interface != null) proxyVariables.upper;
    # sshd binds the sandbox's address even before networkd has put it on the
    # interface.
    boot.kernel.sysctl."net.ipv4.ip_nonlocal_bind" = 1;

    # Only the host may reach the guest (sshd, dev servers); the host's bridge
    # also keeps sandboxes from reaching each other.
    networking.firewall = lib.mkIf (cfg.interface != null) (
      lib.mkMerge [
        (lib.mkIf config.networking.nftables.enable {
          extraInputRules = "ip saddr ${cfg.interface.gateway} accept";
        })
        (lib.mkIf (!config.networking.nftables.enable) {
          extraCommands = "iptables -w -I nixos-fw -s ${cfg.interface.gateway} -j nixos-fw-accept";
        })
      ]
    );

    # --- sshd: the host's way in ---------------------------------------------
    services.openssh = {
      enable = true;
      openFirewall = false;
      listenAddresses = lib.optional (cfg.interface != null) {
        addr = cfg.interface.address;
        port = 22;
      };
      # Both files come from the read-only share agentd fills; the agent
      # cannot add keys of its own.
      hostKeys = [
        {
          path = "${sshDir}/ssh_host_ed25519_key";
          type = "ed25519";
        }
      ];
      authorizedKeysFiles = lib.mkForce [ "${sshDir}/authorized_keys" ];
      settings = {
        PasswordAuthentication = false;
        KbdInteractiveAuthentication = false;
        PermitRootLogin = "no";
        AllowUsers = [ "agent" ];
      };
    };

    # The sandbox's protected paths that name one path, read-only before
    # anyone logs in: agentd writes them to ${sshDir}/protect at each start
    # (one per line). The guest is the agent's (and `sudo` may be on): a
    # warning sign for the agent, not the guard; the sync to the host holds
    # changes of them (docs/git.md, "Protected paths").
    systemd.services.keystone-protect = {
      description = "Make the sandbox's protected paths read-only";
      wantedBy = [ "multi-user.target" ];
      # Early (no default dependencies): before either sshd, the one on the
      # network and the socket systemd's ssh-generator puts on vsock.
      before = [
        "sshd.service"
        "sshd-vsock.socket"
      ];
      conflicts = [ "shutdown.target" ];
      unitConfig = {
        DefaultDependencies = false;
        RequiresMountsFor = [
          "/workspace"
          sshDir
        ];
      };
      path = [ pkgs.util-linux ];
      serviceConfig = {
        Type = "oneshot";
        RemainAfterExit = true;
      };
      script = ''
        paths=()
        if [ -r ${sshDir}/protect ]; then
          while IFS= read -r p; do [ -z "$p" ] || paths+=("$p"); done < ${sshDir}/protect
        fi
        exec ${protectScript}/bin/keystone-protect /workspace "''${paths[@]}"
      '';
    };

    # --- Tools -------------------------------------------------------------------
    environment.systemPackages = [
      pkgs.git
      cfg.zellij
      # What the agents' hooks run to tell agentd they wait for their
      # person (agentd configures the hooks; docs/console.md).
      (pkgs.writeShellScriptBin "keystone-notify" (builtins.readFile ../../agentd/share/keystone-notify))
    ]
    ++ map (agent: pkgs.${agent}) enabledCLIs;

    programs.git = {
      enable = true;
      # The workspace belongs to `agent`; commands that agentd runs as another
      # user must not trip over git's ownership check.
      config.safe.directory = [
        "/workspace"
        "/workspace/.worktrees/*"
      ];
    };

    # System-wide Zellij config (the one agentd's sessions use): without one,
    # a Zellij started by hand opens a setup wizard.
    environment.etc."zellij/config.kdl".source = ../../agentd/share/zellij/config.kdl;

    programs.direnv = {
      enable = true;
      settings = {
        # .env files load like .envrc; anything under /workspace is trusted
        # (the agent wrote it or the person's project did).
        global.load_dotenv = true;
        whitelist.prefix = [ "/workspace" ];
      };
    };

    nix.settings.experimental-features = [
      "nix-command"
      "flakes"
    ];

    environment.etc."keystone-agent-sandbox".text = "${cfg.name}\n";
  };
}

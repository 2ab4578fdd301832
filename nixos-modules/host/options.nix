# Options of the Keystone Agent host module (keystone.agent.*). Options only:
# what they generate is in ./default.nix. Defaults are taken from
# ../lib/naming.nix so that the pure renderer and the module agree.
# Reference with examples: docs/configuration.md.
{ lib, ... }:
let
  inherit (lib) types;

  pure = import ../lib/naming.nix;
  d = pure.optionDefaults;

  # The settings every sandbox has (agentd's SandboxConfig). `defaults.<key>`
  # holds the value for all sandboxes, `sandboxes.<name>.<key>` an override.
  settings = {
    memory = {
      type = types.ints.positive;
      example = 4096;
      description = ''
        RAM of the sandbox in MiB (at least 256). For the local backend it also
        bounds the sandbox's tmpfs file systems (`/tmp`, `/dev/shm`, ...).
        agentd: `memory`; microvm.nix: `microvm.mem`.
      '';
    };
    vcpus = {
      type = types.ints.positive;
      example = 2;
      description = "Virtual CPUs of the sandbox. agentd: `vcpus`; microvm.nix: `microvm.vcpu`.";
    };
    disk = {
      type = types.ints.between 16 16777216;
      example = 20480;
      description = ''
        Disk space in MiB for the sandbox's workspace and home (local and vm
        backends): agentd keeps them on a sparse ext4 image of this size, so a
        write past it fails with ENOSPC inside the sandbox instead of filling
        the host. Fixed when the image is made (first start). Not read by the
        microvm backend. agentd: `disk`.
      '';
    };
    pids = {
      type = types.ints.between 16 4194304;
      example = 1024;
      description = ''
        Most processes and threads the sandbox may run at once (cgroup `pids`
        controller, v1 or v2; local backend). agentd: `pids`.
      '';
    };
    nestedVirt = {
      type = types.bool;
      example = false;
      description = ''
        Expose the CPU's virtualisation extensions (VT-x/AMD-V) to the sandbox,
        so that it can run VMs itself. The host's KVM module gets nested
        virtualisation enabled when any sandbox asks for it. agentd: `nested_virt`.
      '';
    };
    network = {
      type = types.enum [
        "nat"
        "none"
        "bridge"
      ];
      example = "none";
      description = ''
        Network of the sandbox. `nat`: a tap interface on the host's bridge
        with its address from {option}`keystone.agent.network.subnet`, whose
        only way out is agentd's egress gateway on the host's bridge address
        (the module's nftables rules drop everything else; nothing is routed
        or masqueraded). `bridge`: the same; it once meant a routed subnet
        without masquerading, and is kept so that configurations naming it
        still work. `none`: no network interface; the host reaches the
        sandbox over vsock only, and dev-server links do not work. agentd:
        `network`.
      '';
    };
    egress = {
      type = types.enum [
        "allowlist"
        "open"
        "none"
        "ask"
      ];
      example = "ask";
      description = ''
        What the sandbox's outbound connections may reach through agentd's
        egress gateway (docs/network.md): `allowlist` (the preset and
        {option}`egressAllow`), `open` (any public destination), `none`, or
        `ask` (like `allowlist`, but a connection to an unlisted destination
        waits for its person to allow it).
        Never the host or a private range unless an address-range entry names
        it. Changeable at runtime with `agentctl egress`. agentd: `egress`.
      '';
    };
    egressAllow = {
      type = types.listOf types.str;
      example = [
        "api.example.com"
        "*.example.org"
        "10.1.2.0/24:5432"
      ];
      description = ''
        Entries admitted beyond the preset: `example.com`, `*.example.com`,
        `host:port`, or an address range (`10.0.0.0/8`, `192.0.2.1/32:443`),
        the only way to a private address. At most 256. agentd: `egress_allow`.
      '';
    };
    egressDeny = {
      type = types.listOf types.str;
      example = [ "registry.npmjs.org" ];
      description = ''
        Entries refused even when allowed (the preset's included). At most
        256. agentd: `egress_deny`.
      '';
    };
    syncMode = {
      type = types.enum [
        "manual"
        "auto-commit"
        "auto-idle"
      ];
      example = "auto-commit";
      description = ''
        When agentd brings the sandbox's work back to the host repository:
        `manual` (on `agentctl sync`), `auto-commit` (every new commit at once),
        `auto-idle` (a WIP snapshot after {option}`syncIdleSeconds` without
        file changes). agentd: `sync_mode`.
      '';
    };
    syncIdleSeconds = {
      type = types.ints.unsigned;
      example = 60;
      description = "Quiet time before an `auto-idle` snapshot, in seconds. agentd: `sync_idle_seconds`.";
    };
    envFiles = {
      type = types.listOf types.str;
      example = [
        ".env"
        ".env.local"
      ];
      description = ''
        File-name globs of ignored files at the project root that agentd copies
        into the workspace (they are not in git, so a clone would miss them).
        agentd: `env_files`.
      '';
    };
    persist = {
      type = types.bool;
      example = false;
      description = ''
        Keep the agent's home between starts: a disk image
        (`/var/lib/microvms/<name>/home.img`, {option}`keystone.agent.microvm.homeSize`
        MiB) mounted at `/home/agent`. Without it the home is on the guest's
        tmpfs. The workspace is kept either way. agentd: `persist`.
      '';
    };
    agentHome = {
      type = types.enum [
        "own"
        "shared"
      ];
      example = "shared";
      description = ''
        Where the agents keep their logins and settings: `own`, the sandbox's
        home (no other sandbox sees them); `shared`, one directory of the
        owner's that all the owner's sandboxes saying `shared` use (log in
        once; but any of them can change what the others read: a hijacked
        agent in one can tamper with the logins of all). `local` and `vm`
        sandboxes only for now. agentd: `agent_home`.
      '';
    };
    defaultAgent = {
      type = types.nullOr (
        types.enum [
          "claude"
          "codex"
          "gemini"
        ]
      );
      example = "claude";
      description = ''
        The agent a new Zellij session starts in its first pane, beside a
        shell (`agentctl attach` without `--agent`); `null`: a shell only.
        agentd: `default_agent`.
      '';
    };
    gitIdentity = {
      type = types.str;
      example = "Ada Lovelace <ada@example.com>";
      description = ''
        Who commits in the sandbox (its workspace's `user.name` and
        `user.email`): `owner`, the owner's own git identity (the project's
        git configuration, else the owner's `~/.gitconfig`), read when the
        workspace is made; `none`, none (the agent's first commit asks for
        one); or `Name <email>`. agentd: `git_identity`.
      '';
    };
    snapshotQuota = {
      type = types.ints.between 0 16777216;
      example = 4096;
      description = ''
        Disk space in MiB the sandbox's snapshots (`agentctl snapshot`) may
        take under agentd's state directory; 0: no snapshots. agentd:
        `snapshot_quota`.
      '';
    };
    idleStopSeconds = {
      type = types.ints.between 0 2592000;
      example = 1800;
      description = ''
        Stop the running sandbox once it has been idle this many seconds
        (no terminal open in it, no command running, no egress traffic, CPU
        under 5%); the next `agentctl exec`, `attach` or `cp` starts it
        again. 0: never. agentd: `idle_stop_seconds`.
      '';
    };
    backupEverySeconds = {
      type = types.ints.between 0 2592000;
      example = 21600;
      description = ''
        Take a backup (a snapshot of kind `backup`) of the running or
        paused sandbox every this many seconds, keeping the newest
        `backupKeep`; counted against `snapshotQuota`. 0: never. agentd:
        `backup_every_seconds`.
      '';
    };
    backupKeep = {
      type = types.ints.between 1 1000;
      example = 3;
      description = ''
        How many backups to keep: before each new one, the oldest go (a
        snapshot taken with `agentctl snapshot` is never removed). agentd:
        `backup_keep`.
      '';
    };
    protect = {
      type = types.listOf types.str;
      example = [
        ".github/"
        "Makefile"
        "**/*.nix"
      ];
      description = ''
        Paths (relative to the repository; `*`, `?` and `**` globs; each
        covers everything beneath it) that the agent's commits may not
        change without the person's say: a sync to the host holds a branch
        whose new commits change one until `agentctl sync NAME
        --allow-protected BRANCH`. `[ ]` protects nothing. agentd:
        `protect`.
      '';
    };
  };

  defaultOption =
    key:
    lib.mkOption {
      inherit (settings.${key}) type example description;
      default = d.defaults.${key};
    };

  overrideOption =
    key:
    lib.mkOption {
      type = types.nullOr settings.${key}.type;
      default = null;
      inherit (settings.${key}) example;
      description = "Override of {option}`keystone.agent.defaults.${key}` for this sandbox; `null` takes the default.";
    };

  sandboxModule =
    { name, ... }:
    {
      options = {
        project = lib.mkOption {
          # A string. A path literal is accepted by the type only so that the
          # module's assertion can refuse it by name: in a flake it is a
          # copy in the Nix store, not the live repository agentd needs.
          type = types.either types.str types.path;
          example = "/home/alice/src/myproject";
          description = ''
            Absolute path of the host git repository, as a string (a Nix
            path literal is refused: a flake would copy it into the store). It
            is never mounted into
            the sandbox: agentd clones it into
            `/var/lib/keystone-agent/sandboxes/${name}/workspace` at the
            sandbox's first start and brings the agent's commits back as
            `sandbox/${name}/<branch>`.
          '';
        };
        owner = lib.mkOption {
          type = types.str;
          example = "alice";
          description = ''
            User who owns the sandbox: only this user and root may drive it
            through agentctl. Must be a user of this host and, to reach agentd,
            a member of {option}`keystone.agent.group`.
          '';
        };
        backend = lib.mkOption {
          type = types.nullOr (
            types.enum [
              "microvm"
              "vm"
              "local"
            ]
          );
          default = d.sandbox.backend;
          example = "local";
          description = ''
            Backend of this sandbox; `null` takes {option}`keystone.agent.backend`.
            `vm` is a QEMU microVM that agentd boots itself from
            {option}`keystone.agent.vm.image` (no `microvm.vms` entry, no tap:
            its only way out is the egress gateway, through agentd's ssh
            connection to the guest). `local` runs it in Linux namespaces on
            the host (no VM, no `microvm.vms` entry; not a security boundary
            against a hostile agent).
          '';
        };
        autostart = lib.mkOption {
          type = types.bool;
          default = d.sandbox.autostart;
          example = true;
          description = ''
            Start the sandbox when agentd starts. agentd does it (after making
            the workspace on the first start), not microvm.nix.
          '';
        };
        ports = lib.mkOption {
          type = types.attrsOf types.port;
          default = d.sandbox.ports;
          example = {
            web = 3000;
          };
          description = ''
            Named ports of services in the sandbox (dev servers). agentd
            publishes them through the proxy in addition to the ports it
            discovers.
          '';
        };
        secrets = lib.mkOption {
          type = types.attrsOf (
            types.submodule {
              options = {
                file = lib.mkOption {
                  type = types.str;
                  example = "/run/agenix/anthropic-key";
                  description = ''
                    Absolute path of the file that holds the value (one line),
                    read by agentd at each start of the sandbox: an agenix or
                    sops-nix secret readable by root. Never copied into the
                    Nix store, the sandbox or agentd's configuration.
                  '';
                };
                host = lib.mkOption {
                  type = types.str;
                  example = "api.anthropic.com";
                  description = "The host whose HTTPS requests get the value.";
                };
                header = lib.mkOption {
                  type = types.nullOr types.str;
                  default = null;
                  example = "x-api-key";
                  description = "The header that carries the value; `null` with {option}`bearer` (`authorization`).";
                };
                bearer = lib.mkOption {
                  type = types.bool;
                  default = false;
                  description = "Send `Authorization: Bearer <value>`.";
                };
              };
            }
          );
          default = { };
          example = lib.literalExpression ''
            {
              ANTHROPIC_API_KEY = {
                file = config.age.secrets.anthropic.path;
                host = "api.anthropic.com";
                header = "x-api-key";
              };
            }
          '';
          description = ''
            Secrets the sandbox's agent can use but not read (docs/agents.md),
            by environment variable: inside, the variable holds a placeholder,
            and agentd's egress gateway puts the value in the header of
            requests to the host. A new value in the file takes effect at the
            sandbox's next start.
            agentd: `sandboxes.<name>.secrets`.
          '';
        };
        forges = lib.mkOption {
          type = types.listOf (
            types.submodule {
              options = {
                url = lib.mkOption {
                  type = types.str;
                  example = "https://github.com/acme/app";
                  description = "The repository: `https://HOST/OWNER/REPO`.";
                };
                tokenFile = lib.mkOption {
                  type = types.str;
                  example = "/run/agenix/acme-push-token";
                  description = ''
                    Absolute path of the file that holds the token (one line),
                    read by agentd at each start of the sandbox: an agenix or
                    sops-nix secret readable by root. Never in the Nix store,
                    the sandbox or agentd's configuration.
                  '';
                };
                branches = lib.mkOption {
                  type = types.listOf types.str;
                  default = [ "agent/*" ];
                  description = "Branches a push may update (`*` matches anything, `/` included).";
                };
                tags = lib.mkOption {
                  type = types.bool;
                  default = false;
                  description = "Also let the agent push new tags (never delete one).";
                };
                user = lib.mkOption {
                  type = types.nullOr types.str;
                  default = null;
                  description = "The user name sent with the token; `null`: `x-access-token` (GitHub's; GitLab, Gitea and Forgejo take any).";
                };
              };
            }
          );
          default = [ ];
          example = lib.literalExpression ''
            [
              {
                url = "https://github.com/acme/app";
                tokenFile = config.age.secrets.acme-push.path;
                branches = [ "agent/*" ];
              }
            ]
          '';
          description = ''
            Repositories the sandbox may push to without holding their token
            (docs/forges.md): inside, git's password for the URL is a
            placeholder; agentd's egress gateway swaps the token in for that
            repository's git requests only, and refuses a push of a ref
            outside {option}`branches`, a deletion, or a tag unless
            {option}`tags`.
          '';
        };
        guestConfig = lib.mkOption {
          type = types.deferredModule;
          default = { };
          example = lib.literalExpression ''
            { pkgs, ... }: {
              keystone.sandbox.agents.codex.enable = true;
              environment.systemPackages = [ pkgs.nodejs ];
            }
          '';
          description = ''
            NixOS configuration added to this sandbox's guest, after
            {option}`keystone.agent.guestConfig`. See nixos-modules/guest for
            the `keystone.sandbox.*` options of the guest.
          '';
        };
      }
      // lib.genAttrs (builtins.attrNames settings) overrideOption;
    };
in
{
  imports = [
    (lib.mkRemovedOptionModule [ "keystone" "agent" "network" "nameservers" ] ''
      A sandbox's only way out is agentd's egress gateway, which resolves
      names itself (socks5h, HTTP CONNECT by name) with the host's resolver;
      the guests have no DNS server.
    '')
  ];

  options.keystone.agent = {
    enable = lib.mkEnableOption "Keystone Agent: the agentd service, its D-Bus policy and the declared sandboxes (one microVM each)";

    package = lib.mkOption {
      type = types.package;
      defaultText = lib.literalExpression "keystone-agent.packages.\${system}.default";
      description = ''
        Package with `bin/agentd`, `bin/agentctl` and
        `share/dbus-1/system.d/org.keystone.Agent1.conf`. The flake's
        `nixosModules.default` sets it (with `lib.mkDefault`).
      '';
    };

    group = lib.mkOption {
      type = types.str;
      default = d.group;
      description = ''
        Group whose members may talk to agentd on the system bus (agentd then
        checks, per sandbox, that the caller is its owner or root).
      '';
    };

    defaults = lib.genAttrs (builtins.attrNames settings) defaultOption;

    backend = lib.mkOption {
      type = types.enum [
        "microvm"
        "vm"
        "kubernetes"
      ];
      default = d.backend;
      description = ''
        Backend of declared sandboxes and of sandboxes created without
        `--backend`. `kubernetes` needs `kubernetes.image` (docs/kubernetes.md).
        agentd: `default_backend`.
      '';
    };

    vm = {
      image = lib.mkOption {
        type = types.nullOr types.path;
        default = d.vm.image;
        defaultText = lib.literalExpression "keystone-agent.packages.\${system}.guest-image (with the flake's nixosModules.default)";
        description = ''
          Directory of the `vm` backend's guest image (vmlinux, initrd,
          rootfs.img, image.json; docs/guest-image.md). `null`: the `vm`
          backend refuses to start sandboxes. agentd: `vm.image`.
        '';
      };
      accel = lib.mkOption {
        type = types.enum [
          "auto"
          "kvm"
          "tcg"
        ];
        default = d.vm.accel;
        description = ''
          How `vm` guests run: `auto` uses KVM when it can run a guest here
          and TCG (emulation, slow) otherwise; `kvm` refuses to start without
          it. agentd: `vm.accel`.
        '';
      };
      share = lib.mkOption {
        type = types.enum [
          "auto"
          "virtiofs"
          "9p"
          "disk"
        ];
        default = d.vm.share;
        description = ''
          How the workspace reaches `vm` guests: `auto` is 9p with
          {option}`keystone.agent.vm.fastStart` (QEMU cannot restore a
          guest with virtiofs), else virtiofs (agentd runs virtiofsd, as
          root) where it can and 9p otherwise. `disk` shares nothing: each
          new sandbox's workspace is an ext4 disk of its own, which agentd
          reaches through the guest (docs/state.md). agentd: `vm.share`.
        '';
      };
      fastStart = lib.mkOption {
        type = types.bool;
        default = d.vm.fastStart;
        description = ''
          Start `vm` sandboxes from a boot snapshot: agentd boots the image
          once per memory size, vCPUs and accelerator, saves it, and starts
          each sandbox by restoring it and giving the guest its own identity
          (random state, clock, machine id, name, uid, keys, disks, shares;
          docs/state.md). A sandbox that cannot (virtiofs, an image without
          `"fast_start": true`) boots cold, and `agentctl status` says why.
          agentd: `vm.fast_start`.
        '';
      };
    };

    audit = {
      keepDays = lib.mkOption {
        type = types.ints.between 0 36500;
        default = d.audit.keepDays;
        description = ''
          Days agentd keeps the lines people typed into sandboxes' terminals
          (`agentctl audit`, docs/console.md); 0 keeps them until
          {option}`keystone.agent.audit.maxMib` moves them aside. agentd:
          `audit.keep_days`.
        '';
      };
      maxMib = lib.mkOption {
        type = types.ints.between 1 4096;
        default = d.audit.maxMib;
        description = ''
          MiB of one sandbox's audit log before agentd moves it aside
          (replacing the one moved before), so it takes at most twice this.
          agentd: `audit.max_mib`.
        '';
      };
    };

    console = {
      enable = lib.mkOption {
        type = types.bool;
        default = d.console.enable;
        description = ''
          Serve the web console (docs/console.md): each user's sandboxes,
          terminals on their sessions and the agents waiting for them, in
          the browser; `agentctl console` opens it logged in. agentd:
          `console.enable`.
        '';
      };
      listen = lib.mkOption {
        type = types.str;
        default = d.console.listen;
        example = "127.0.0.1:7681";
        description = ''
          Where agentd serves it: an IPv4 loopback address and a port
          (port 0: a free one, which `agentctl console` asks agentd for).
          It is reached from this host only; every connection's user is
          read from the kernel and must be the session's. agentd:
          `console.listen`.
        '';
      };
      host = lib.mkOption {
        type = types.str;
        default = d.console.host;
        example = "console.agents.example";
        description = ''
          The console's name through Caddy, served over HTTPS like the
          links when `proxy.enable` is on (`https://<host>`); the loopback
          address of `listen` is then only where `agentctl console` logs
          in. It must be on a registrable domain of its own, never the
          links' (its last two labels are not the links' domain's): a page
          a sandbox serves must not be same-site with the console. The
          module makes the name resolve to this host's loopback address.
          "" serves the console at its loopback address only. agentd:
          `console.host`.
        '';
      };
    };

    toolbox = {
      agents = lib.mkOption {
        type = types.listOf (
          types.enum [
            "claude"
            "codex"
            "gemini"
          ]
        );
        default = d.toolbox.agents;
        description = ''
          The agent CLIs that `local` and `vm` sandboxes get from agentd's
          agent toolbox (docs/agents.md): Claude Code, Codex and Gemini CLI
          from the npm registry at pinned versions, read-only at
          `/run/keystone/agents` with launchers on `PATH`. `microvm`
          sandboxes use nixpkgs' packages instead
          ({option}`keystone.sandbox.agents` in the guest). agentd:
          `toolbox.agents`.
        '';
      };
      versions = lib.mkOption {
        type = types.attrsOf types.str;
        default = d.toolbox.versions;
        example = {
          claude = "2.1.331";
        };
        description = ''
          npm versions of `claude`, `codex`, `gemini` and `node` (which runs
          Gemini CLI); those left out take the versions agentd pins. A
          change takes effect when agentd restarts. agentd:
          `toolbox.versions`.
        '';
      };
      download = lib.mkOption {
        type = types.bool;
        default = d.toolbox.download;
        description = ''
          Download what the cache (/var/cache/keystone-agent/agents) lacks
          when agentd starts; `false`: only what `agentd --install-agents`
          put there. agentd: `toolbox.download`.
        '';
      };
    };

    microvm = {
      shareProto = lib.mkOption {
        type = types.enum [
          "virtiofs"
          "9p"
        ];
        default = d.microvm.shareProto;
        description = ''
          How the workspace, the SSH keys and the host's /nix/store reach the
          guest: virtiofs (virtiofsd runs as root on the host). `9p` is
          refused: QEMU itself, as user `microvm`, would open the shared
          directories, and cannot read the guest's SSH host key (root's,
          mode 0600).
        '';
      };
      hypervisor = lib.mkOption {
        type = types.enum [
          "qemu"
          "cloud-hypervisor"
        ];
        default = d.microvm.hypervisor;
        description = ''
          microvm.nix hypervisor of the sandboxes (both support tap networking,
          vsock and virtiofs; cloud-hypervisor has no 9p).
        '';
      };
      homeSize = lib.mkOption {
        type = types.ints.positive;
        default = d.microvm.homeSize;
        description = "Size in MiB of the disk image holding the agent's home of persistent sandboxes.";
      };
    };

    kubernetes = {
      kubeconfig = lib.mkOption {
        type = types.nullOr types.str;
        default = d.kubernetes.kubeconfig;
        example = "/run/agenix/agentd-kubeconfig";
        description = ''
          Kubeconfig file of the cluster that runs `kubernetes` sandboxes, read
          by agentd (root) at its first use. `null`: `$KUBECONFIG`,
          `~/.kube/config`, or the service account of a Pod agentd runs in.
          A string, not a path, so that the credentials stay out of the Nix
          store. agentd: `kubernetes.kubeconfig`.
        '';
      };
      context = lib.mkOption {
        type = types.str;
        default = d.kubernetes.context;
        example = "prod-cluster";
        description = "Context of that kubeconfig (`\"\"`: its current context). agentd: `kubernetes.context`.";
      };
      namespace = lib.mkOption {
        type = types.str;
        default = d.kubernetes.namespace;
        description = "Namespace of the sandboxes' Pods, claims and NetworkPolicies (it must exist; docs/kubernetes.md gives the Role agentd needs there). agentd: `kubernetes.namespace`.";
      };
      storageClass = lib.mkOption {
        type = types.str;
        default = d.kubernetes.storageClass;
        example = "fast-ssd";
        description = "Storage class of each sandbox's PersistentVolumeClaim (`\"\"`: the cluster's default class). agentd: `kubernetes.storage_class`.";
      };
      image = lib.mkOption {
        type = types.nullOr types.str;
        default = d.kubernetes.image;
        example = "registry.example.org/keystone-sandbox:1";
        description = ''
          Image of the sandboxes' Pods: bash, git, GNU tar and coreutils, and a
          user `agent` (uid 1000) with a home at /home/agent (docs/kubernetes.md,
          "The image"). Required when a sandbox uses the kubernetes backend.
          agentd: `kubernetes.image`.
        '';
      };
      allowUnenforcedNetworkPolicy = lib.mkOption {
        type = types.bool;
        default = d.kubernetes.allowUnenforcedNetworkPolicy;
        description = ''
          Start kubernetes sandboxes even where the cluster's network plugin
          does not enforce NetworkPolicies (agentd finds out at each start);
          their Pods then reach whatever the cluster's network reaches.
          agentd: `kubernetes.allow_unenforced_network_policy`.
        '';
      };
      toolbox = lib.mkOption {
        type = types.bool;
        default = d.kubernetes.toolbox;
        description = ''
          Copy the agent toolbox (`toolbox.agents`) onto each kubernetes
          sandbox's claim at its first start and when the versions change
          (about 1.1 GB for all three agents); `false`: the Pods get no agents
          of agentd's. agentd: `kubernetes.toolbox`.
        '';
      };
    };

    proxy = {
      enable = lib.mkEnableOption "dev-server links through Caddy (`<branch>.<sandbox>.<domain>`)";
      domain = lib.mkOption {
        type = types.str;
        default = d.proxy.domain;
        example = "sandbox.example.org";
        description = ''
          Domain under which sandboxes get names: `<sandbox>.<domain>` for the
          main worktree, `<branch>.<sandbox>.<domain>` for the others.
        '';
      };
    };

    network = {
      subnet = lib.mkOption {
        type = types.str;
        default = d.network.subnet;
        example = "10.77.0.0/16";
        description = ''
          IPv4 /16 (written `A.B.0.0/16`) of the sandboxes' network. The host
          is `A.B.0.1` on the bridge `keystone-br0`, where agentd's egress
          gateway listens on port 3128; each sandbox gets an address derived
          from its name.
        '';
      };
    };

    guestConfig = lib.mkOption {
      type = types.deferredModule;
      default = { };
      example = lib.literalExpression ''
        {
          keystone.sandbox.agents.claude-code.enable = true; # unfree: allow it on the host
          keystone.sandbox.agents.gemini-cli.enable = true;
        }
      '';
      description = "NixOS configuration added to every sandbox's guest.";
    };

    sandboxes = lib.mkOption {
      type = types.attrsOf (types.submodule sandboxModule);
      default = { };
      example = lib.literalExpression ''
        {
          webapp = {
            project = "/home/alice/src/webapp";
            owner = "alice";
            ports.web = 3000;
          };
        }
      '';
      description = ''
        Sandboxes declared on this host. Names follow ${pure.nameRule}.
      '';
    };
  };
}

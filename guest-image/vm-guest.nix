# The NixOS configuration of the `vm` backend's guest image
# (docs/guest-image.md, "The contract"). guest-image/vm-image.nix composes it
# with nixos-modules/guest, which brings what every sandbox has: the user
# `agent`, git, Zellij and its config at /run/keystone, direnv and nix. This
# module adds what a guest that agentd boots itself needs: the NixOS
# counterpart of guest-image/debian's init and overlay/.
#
# - Boot: QEMU's `-machine microvm` loads the kernel and the NixOS initrd
#   (systemd stage 1) directly. The root is /dev/vda, a raw ext4 image that
#   agentd attaches copy-on-write, so every boot starts from the same image.
# - agentd's kernel command line is fixed (console=ttyS0 quiet panic=-1
#   keystone.name= keystone.share= keystone.uid= keystone.gid=). It has no
#   `init=`, and systemd stage 1 only finds the system to boot through
#   `init=` (initrd-find-nixos-closure). The image therefore links the
#   system at /nix/var/nix/profiles/system, and that one unit reads a
#   command line of the initrd's own that names it (below).
# - Stage 1 (keystone-guest.service in the initrd, after /sysroot is
#   mounted and before NixOS activates the system): mounts the workspace
#   (tag `workspace`, virtiofs or 9p by keystone.share), copies the ssh keys
#   from fw_cfg to /etc/ssh/keystone, and writes the host name.
# - Users exist only once NixOS has activated the system, so `agent` takes
#   keystone.uid and keystone.gid in stage 2 (keystone-agent-ids.service),
#   before sysinit.target: before any socket listens or any login is
#   possible.
# - The control channel: `sshd -i` on the virtio-serial ports
#   keystone.root and keystone.agent (keystone-control@root.service,
#   keystone-control@agent.service), one connection at a time per port;
#   nothing listens on the guest's network. Host key and authorized keys
#   are the fw_cfg ones; no password works for anybody.
# - No NIC: the only way out is 127.0.0.1:3128, relayed to the socket that
#   root's ssh connection forwards to agentd's egress gateway
#   (docs/network.md). No serial getty: the console is a log.
# - `keystone: ready` on the console once multi-user.target is reached.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  # Where the initrd copies the sandbox's ssh keys (as the Debian image does).
  keyDir = "/etc/ssh/keystone";

  # The image links the system here (guest-image/vm-image.nix).
  systemProfile = "/nix/var/nix/profiles/system";

  # The users agentd logs in as, each over a virtio-serial port of its own:
  # /dev/virtio-ports/keystone.<user>, served by QEMU on
  # run/vm/control-<user>.sock on the host.
  controlUsers = [
    "root"
    "agent"
  ];
  controlUnits = map (user: "keystone-control@${user}.service") controlUsers;

  # Where the egress relay connects: root's ssh master connection forwards
  # this socket to agentd's egress gateway (sshd binds it as root).
  egressSocket = "/run/keystone-egress.sock";

  # keystone-control USER: `sshd -i` on the port keystone.USER, one
  # connection at a time, again after each. agentd's side says
  # KEYSTONE-CONTROL (again every second) until this side answers
  # KEYSTONE-CONTROL-READY, then KEYSTONE-CONTROL-GO: only then does sshd
  # start, so its greeting never goes out while nobody listens, and a hello
  # that the sshd of a connection just gone swallowed is said again. A port
  # the host is not connected to reads end-of-file at once, hence the pause
  # (until udev has named the port, it is not there at all). bash reads a
  # port (neither seekable nor a terminal) a byte at a time, so sshd gets
  # everything after the GO line.
  controlScript = pkgs.writeShellScript "keystone-control" ''
    port=/dev/virtio-ports/keystone.$1
    while :; do
      if [ -c "$port" ] && exec 3<>"$port"; then
        ready=
        while IFS= read -r line <&3; do
          case "$line" in
            KEYSTONE-CONTROL)
              printf 'KEYSTONE-CONTROL-READY\n' >&3
              ready=1
              ;;
            KEYSTONE-CONTROL-GO)
              [ -z "$ready" ] ||
                ${config.services.openssh.package}/bin/sshd -i -f /etc/ssh/sshd_config <&3 >&3
              break
              ;;
          esac
        done
        exec 3>&-
      fi
      ${pkgs.coreutils}/bin/sleep 0.2
    done
  '';

  # Drivers the initrd loads: the virtio-mmio bus (QEMU adds its devices to
  # the kernel command line), the root disk, both share protocols,
  # virtio-serial (the control channel), the NIC and fw_cfg (the keys). A
  # kernel without one of them fails the initrd's build.
  modules = [
    "virtio_mmio"
    "virtio_blk"
    "ext4"
    "virtiofs"
    "9p"
    "9pnet_virtio"
    "virtio_console"
    "virtio_net"
    "qemu_fw_cfg"
  ];
in
{
  # nixos-modules/guest also configures microvm.nix (shares, volumes, vsock,
  # QEMU arguments) for the microvm backend. This image is not a microvm.nix
  # VM: the option only takes those settings, and nothing reads them.
  options.microvm = lib.mkOption {
    type = lib.types.lazyAttrsOf lib.types.anything;
    default = { };
    internal = true;
    description = "microvm.nix settings of nixos-modules/guest, unused by the vm backend's image.";
  };

  config = {
    # The name only feeds what this module replaces below (host name and
    # marker come from keystone.name at boot).
    keystone.sandbox.name = "keystone-guest";
    system.name = "keystone-guest";

    # --- Boot ------------------------------------------------------------------
    boot.loader.grub.enable = false;
    boot.initrd.systemd.enable = true;
    # Only the drivers above: a small initrd unpacks fast under TCG.
    boot.initrd.includeDefaultModules = false;
    boot.initrd.kernelModules = modules;

    fileSystems."/" = {
      device = "/dev/vda";
      fsType = "ext4";
      # A fresh copy of a clean image at every boot.
      noCheck = true;
    };
    # The sandbox's home disk (agentd attaches it as the second disk), which
    # outlives the VM.
    fileSystems."/home/agent" = {
      device = "/dev/vdb";
      fsType = "ext4";
      options = [
        "nosuid"
        "nodev"
        "nofail"
        # No background zeroing of a new disk's inode tables.
        "noinit_itable"
      ];
    };

    # initrd-find-nixos-closure reads `init=` from /proc/cmdline and fails
    # without it. That unit alone (in its own mount namespace) sees a
    # command line naming the system the image links; every other unit sees
    # the real one.
    boot.initrd.systemd.contents."/etc/keystone/cmdline".text = "init=${systemProfile}/init\n";
    boot.initrd.systemd.services.initrd-find-nixos-closure.serviceConfig.BindReadOnlyPaths = [
      "/etc/keystone/cmdline:/proc/cmdline"
    ];

    # Workspace, keys and host name, in the initrd: the equivalent of
    # guest-image/debian/init. A failure powers the guest off (and QEMU,
    # started with -no-reboot, exits), so the start fails at once with the
    # reason in boot.log.
    boot.initrd.systemd.services.keystone-guest = {
      description = "Keystone Agent guest setup (workspace, ssh keys, host name)";
      requiredBy = [ "initrd.target" ];
      requires = [ "sysroot.mount" ];
      after = [ "sysroot.mount" ];
      before = [
        "initrd.target"
        "initrd-nixos-activation.service"
      ];
      unitConfig.FailureAction = "poweroff-force";
      serviceConfig = {
        Type = "oneshot";
        RemainAfterExit = true;
      };
      script = ''
        say() { echo "keystone-init: $*" > /dev/console; }
        die() { say "FATAL: $*"; exit 1; }

        share=virtiofs name=sandbox
        for word in $(< /proc/cmdline); do
          case "$word" in
            keystone.share=*) share=''${word#*=} ;;
            keystone.name=*) name=''${word#*=} ;;
          esac
        done

        case "$share" in
          virtiofs) set -- -t virtiofs ;;
          9p) set -- -t 9p -o trans=virtio,version=9p2000.L,msize=524288,cache=none ;;
          *) die "keystone.share=$share: expected virtiofs or 9p" ;;
        esac
        mkdir -p /sysroot/workspace
        # The share's device may still be probing: allow it a few seconds.
        tries=0
        until mount "$@" workspace /sysroot/workspace; do
          tries=$((tries + 1))
          [ "$tries" -lt 50 ] || die "cannot mount the workspace share (tag workspace, $share)"
          sleep 0.1
        done

        # The sandbox's ssh keys arrive through fw_cfg; they never touch the
        # shares.
        keys=/sys/firmware/qemu_fw_cfg/by_name/opt/keystone
        [ -r "$keys/host_key/raw" ] && [ -r "$keys/authorized_keys/raw" ] ||
          die "no ssh keys in fw_cfg (opt/keystone/host_key, opt/keystone/authorized_keys)"
        mkdir -p /sysroot${keyDir}
        (umask 077 && cat "$keys/host_key/raw" > /sysroot${keyDir}/ssh_host_ed25519_key)
        cat "$keys/authorized_keys/raw" > /sysroot${keyDir}/authorized_keys
        chmod 0600 /sysroot${keyDir}/ssh_host_ed25519_key
        chmod 0644 /sysroot${keyDir}/authorized_keys

        # systemd reads /etc/hostname again after switching root.
        printf '%s\n' "$name" > /sysroot/etc/hostname
        printf '%s\n' "$name" > /sysroot/etc/keystone-agent-sandbox

        say "root mounted, workspace on $share"
      '';
    };

    # Written at boot from keystone.name (above), not at build time.
    networking.hostName = lib.mkForce "";
    environment.etc."keystone-agent-sandbox".enable = false;

    # --- User agent takes the workspace owner's ids ------------------------------
    # NixOS creates `agent` (uid 1000) when it activates the system. This
    # unit renumbers it before sysinit.target, hence before the control
    # channel and any login, and after tmpfiles has set up /home/agent. Its
    # primary group is its own, so that it can take keystone.gid.
    users.groups.agent.gid = 1000;
    users.users.agent.group = lib.mkForce "agent";

    systemd.services.keystone-agent-ids = {
      description = "Give user agent the uid and gid that own the workspace";
      wantedBy = [ "sysinit.target" ];
      before = [
        "sysinit.target"
        "shutdown.target"
      ];
      after = [
        "local-fs.target"
        "systemd-sysusers.service"
        "userborn.service"
        "systemd-tmpfiles-setup.service"
      ];
      conflicts = [ "shutdown.target" ];
      unitConfig = {
        DefaultDependencies = false;
        FailureAction = "poweroff-force";
      };
      serviceConfig = {
        Type = "oneshot";
        RemainAfterExit = true;
      };
      path = [
        pkgs.shadow
        pkgs.coreutils
      ];
      script = ''
        uid=1000 gid=1000
        for word in $(< /proc/cmdline); do
          case "$word" in
            keystone.uid=*) uid=''${word#*=} ;;
            keystone.gid=*) gid=''${word#*=} ;;
          esac
        done
        for id in "$uid" "$gid"; do
          case "$id" in
            "" | *[!0-9]*)
              echo "keystone: FATAL: bad keystone.uid/keystone.gid ($uid/$gid)" > /dev/console
              exit 1
              ;;
          esac
        done
        # --non-unique: the host's ids may already name a user or group of
        # the guest (gid 100 is `users`).
        groupmod --non-unique --gid "$gid" agent
        usermod --non-unique --uid "$uid" --gid "$gid" agent
        # agentd makes the home disk with the right owner: walk it only
        # when it is not.
        if [ "$(stat -c %u:%g /home/agent)" != "$uid:$gid" ]; then
          chown -R "$uid:$gid" /home/agent
        fi
      '';
    };

    # No passwords anywhere; `*` (not `!`) so key logins are not "locked".
    users.users.agent.hashedPassword = "*";
    users.users.root.hashedPassword = "*";
    users.users.root.initialHashedPassword = lib.mkForce null;

    # --- sshd on the virtio-serial ports: agentd's control channel ---------------------
    services.openssh = {
      # NixOS's own sshd units stay off (below): sshd runs only on the
      # control ports.
      startWhenNeeded = true;
      # The keys the initrd copied from fw_cfg, and nothing else: not the
      # guest module's share (microvm backend), not ~/.ssh/authorized_keys.
      hostKeys = lib.mkForce [
        {
          path = "${keyDir}/ssh_host_ed25519_key";
          type = "ed25519";
        }
      ];
      authorizedKeysFiles = lib.mkOverride 10 [ "${keyDir}/authorized_keys" ];
      settings = {
        # agentd logs in as root to power the guest off, to read the
        # socket table for port discovery and to forward the egress relay's
        # socket.
        PermitRootLogin = lib.mkForce "prohibit-password";
        AllowUsers = lib.mkForce null;
        # Dev-server links use `ssh -W`.
        AllowTcpForwarding = true;
        # root's master connection binds the egress relay's socket again
        # each time agentd opens it.
        StreamLocalBindUnlink = true;
      };
    };
    # sshd.socket would listen on TCP port 22.
    systemd.sockets.sshd.enable = false;
    # systemd's ssh generator would put another sshd on vsock and on a
    # local unix socket.
    systemd.generators.systemd-ssh-generator = "/dev/null";

    # One instance per port. agentd keeps one ssh master connection per user
    # open, which every command, terminal and link connection shares, and
    # opens it again when it ends.
    systemd.services."keystone-control@" = {
      description = "Keystone Agent control channel for %i (sshd on virtio-serial port keystone.%i)";
      # Never given up on: it is the only way in.
      startLimitIntervalSec = 0;
      serviceConfig = {
        ExecStart = "${controlScript} %i";
        Restart = "always";
        RestartSec = 1;
      };
    };
    systemd.targets.multi-user.wants = controlUnits;

    # --- Egress (docs/network.md) ------------------------------------------------------
    # No NIC: a guest's only way out is agentd's egress gateway. 127.0.0.1:3128
    # (what HTTP_PROXY, HTTPS_PROXY and ALL_PROXY name) is relayed to
    # /run/keystone-egress.sock (egressSocket), which root's master
    # connection forwards to the gateway on the host; only sandboxes with a
    # network get it.
    systemd.sockets.keystone-egress = {
      description = "Keystone Agent egress relay (127.0.0.1:3128 to the host's gateway)";
      wantedBy = [ "sockets.target" ];
      unitConfig.ConditionKernelCommandLine = "keystone.egress=1";
      socketConfig = {
        ListenStream = "127.0.0.1:3128";
        Accept = true;
      };
    };
    systemd.services."keystone-egress@" = {
      description = "Keystone Agent egress relay connection";
      serviceConfig = {
        ExecStart = "${pkgs.socat}/bin/socat STDIO UNIX-CONNECT:${egressSocket}";
        StandardInput = "socket";
        StandardError = "journal";
      };
    };
    systemd.network.wait-online.enable = false;
    # Nothing reaches the guest from outside (it has no NIC, and sshd is on
    # the virtio-serial ports): a firewall would only slow the boot down.
    networking.firewall.enable = false;

    # --- Console -------------------------------------------------------------------
    # The console is a log, not a way in.
    systemd.services."serial-getty@ttyS0".enable = false;
    systemd.services."getty@tty1".enable = false;
    systemd.services."autovt@tty1".enable = false;

    systemd.services.keystone-ready = {
      description = "Keystone Agent readiness line";
      wantedBy = [ "multi-user.target" ];
      after = [ "multi-user.target" ] ++ controlUnits;
      serviceConfig.Type = "oneshot";
      script = ''echo "keystone: ready" > /dev/console'';
    };

    # The root disk is thrown away at stop: keep the journal in memory.
    services.journald.storage = "volatile";
    # Slow under TCG, and nothing a sandbox needs.
    systemd.services.mount-pstore.enable = false;

    # --- Nix -------------------------------------------------------------------------
    # The image carries its closure's registration (make-ext4-fs); the
    # database is loaded when the daemon first starts, not on every boot.
    systemd.services.keystone-nix-db = lib.mkIf config.nix.enable {
      description = "Register the image's store paths in the Nix database";
      requiredBy = [ "nix-daemon.service" ];
      before = [ "nix-daemon.service" ];
      unitConfig.ConditionPathExists = "/nix-path-registration";
      serviceConfig.Type = "oneshot";
      script = ''
        ${config.nix.package}/bin/nix-store --load-db < /nix-path-registration
        rm /nix-path-registration
      '';
    };

    documentation.enable = lib.mkDefault false;
  };
}

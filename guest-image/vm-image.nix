# The guest image of the `vm` backend, from NixOS (docs/guest-image.md):
# the directory that agentd's `vm.image` names.
#
#   nix build .#guest-image
#   ls result/                   # vmlinux  initrd  rootfs.img  image.json
#
# The system is nixos-modules/guest plus ./vm-guest.nix (what the contract
# asks of a guest that agentd boots itself); extraModules adds to it, for
# example packages for the agent's dev servers:
#
#   import ./guest-image/vm-image.nix {
#     inherit nixpkgs;
#     extraModules = [ ({ pkgs, ... }: { environment.systemPackages = [ pkgs.python3 ]; }) ];
#   }
#
# - vmlinux: the NixOS kernel's uncompressed image (its `dev` output keeps
#   it), booted directly by QEMU's -machine microvm.
# - initrd: the system's own initrd (systemd stage 1).
# - rootfs.img: a raw ext4 filesystem, no partition table (the guest mounts
#   /dev/vda), holding the system's closure, the link
#   /nix/var/nix/profiles/system to it, and rootfsFreeMiB of free space.
#   It is a link to the store path that holds it: agentd opens it read-only
#   and writes to a temporary overlay (snapshot=on).
# - image.json: recipe, NixOS version, kernel and system; agentd does not
#   read it.
{
  nixpkgs,
  system ? "x86_64-linux",
  # Free space of the root filesystem in MiB: what a guest can write (logs,
  # caches, builds) before its disk is full. The grown part of the file is
  # sparse, and guest writes never reach the image: they go to the
  # sandbox's temporary overlay.
  rootfsFreeMiB ? 2048,
  extraModules ? [ ],
}:
let
  nixos = nixpkgs.lib.nixosSystem {
    modules = [
      ../nixos-modules/guest
      ./vm-guest.nix
      { nixpkgs.hostPlatform = system; }
    ]
    ++ extraModules;
  };
  inherit (nixos) config pkgs;

  toplevel = config.system.build.toplevel;
  kernel = config.boot.kernelPackages.kernel;

  rootfs =
    (pkgs.callPackage "${nixpkgs}/nixos/lib/make-ext4-fs.nix" {
      storePaths = [ toplevel ];
      volumeLabel = "keystone-root";
      # The closure is all make-ext4-fs copies: add the mount points, the
      # system link that stage 1 boots (see ./vm-guest.nix) and /workspace.
      populateImageCommands = ''
        mkdir -p ./files/nix/var/nix/profiles ./files/etc ./files/var ./files/home \
          ./files/root ./files/tmp ./files/dev ./files/proc ./files/sys ./files/run \
          ./files/workspace
        chmod 0700 ./files/root
        chmod 1777 ./files/tmp
        ln -s ${toplevel} ./files/nix/var/nix/profiles/system
      '';
    }).overrideAttrs
      (old: {
        # make-ext4-fs fits the filesystem to its contents (plus 16 MiB).
        buildCommand = old.buildCommand + ''
          export EXT2FS_NO_MTAB_OK=yes
          truncate -s +${toString rootfsFreeMiB}M $out
          resize2fs -f $out
          fsck.ext4 -n -f $out
        '';
      });

  imageJson = pkgs.writeText "image.json" (
    builtins.toJSON {
      recipe = "nix";
      nixos = config.system.nixos.label;
      kernel = "linux ${kernel.version}";
      system = "${toplevel}";
    }
  );
in
pkgs.runCommand "keystone-guest-image-${config.system.nixos.label}"
  {
    passthru = { inherit nixos rootfs; };
    meta = {
      description = "Keystone Agent guest image for the vm backend (vmlinux, initrd, rootfs.img)";
      platforms = [ system ];
    };
  }
  ''
    mkdir $out
    cp ${kernel.dev}/vmlinux $out/vmlinux
    if [ "$(head -c 4 $out/vmlinux | od -An -tx1 | tr -d ' \n')" != 7f454c46 ]; then
      echo "guest-image: ${kernel.dev}/vmlinux is not an ELF kernel" >&2
      exit 1
    fi
    cp ${config.system.build.initialRamdisk}/${config.system.boot.loader.initrdFile} $out/initrd
    ln -s ${rootfs} $out/rootfs.img
    cp ${imageJson} $out/image.json
  ''

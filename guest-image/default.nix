# The guest of the microvm backend: the NixOS system every declared sandbox
# boots, composed from microvm.nix's guest module and nixos-modules/guest.
# (The vm backend's guest image is ./vm-image.nix.)
#
# On a host, the keystone.agent module composes it once per declared sandbox
# (microvm.vms.<name>.config imports nixos-modules/guest with that sandbox's
# name, address, MAC, CID and shares). This file composes it stand-alone for
# an example sandbox, so that the guest can be built and booted by hand:
#
#   nix build .#guest-runner       # the microVM runner (bin/microvm-run)
#   sudo mkdir -p /tmp/keystone-agent-example/{workspace,ssh}
#   sudo ./result/bin/microvm-run  # serial console, logged in as `agent`
#
# The example differs from a real sandbox only where a hand-run VM needs it:
# 9p shares (no virtiofsd service), no network and no vsock (no tap interface,
# no agentd), no home image, and an auto-login on the console (a real sandbox
# has no way in but the host's SSH key). Without keys in
# /tmp/keystone-agent-example/ssh, sshd does not start; that is expected.
{
  nixpkgs,
  microvm,
  system ? "x86_64-linux",
  name ? "example",
  hostStateDir ? "/tmp/keystone-agent-${name}",
  extraModules ? [ ],
}:
nixpkgs.lib.nixosSystem {
  modules = [
    microvm.nixosModules.microvm
    ../nixos-modules/guest
    {
      nixpkgs.hostPlatform = system;
      keystone.sandbox = {
        inherit name hostStateDir;
        shareProto = "9p";
        persist = false;
        memory = 1536;
        vcpus = 2;
      };
      services.getty.autologinUser = "agent";
    }
  ]
  ++ extraModules;
}

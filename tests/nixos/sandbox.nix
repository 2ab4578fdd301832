# NixOS VM test: a host with the keystone.agent module and one declared
# sandbox, driven the way a person drives it (agentctl as the sandbox's owner).
#
# Needs a machine with Nix and KVM, with nested virtualisation (the sandbox is
# a microVM inside the test VM; without nested KVM QEMU falls back to TCG and
# the test gets slow). Run it with `nix flake check` or
# `nix build .#checks.x86_64-linux.nixos-sandbox`. It cannot run on the CI
# machines that only have Nix 2.8 and no nixpkgs (tests/nix/check.sh runs
# there instead).
#
# agentd's microvm backend starts and stops microvm@<name>.service through
# systemd's D-Bus API and reaches the guest's sshd at its tap address with the
# keys it provisioned (the host key pinned). This is the real path of what
# agentd/tests/microvm.rs checks against a test double of systemd.
{ pkgs, self }:
pkgs.testers.runNixOSTest {
  name = "keystone-agent-sandbox";

  nodes.host =
    { pkgs, ... }:
    {
      imports = [ self.nixosModules.default ];

      virtualisation = {
        memorySize = 4096;
        cores = 4;
        diskSize = 8192;
        # Pass VT-x/AMD-V to the test VM so that the sandbox's QEMU gets KVM.
        qemu.options = [
          "-cpu"
          "kvm64,+svm,+vmx"
        ];
      };

      users.users.alice = {
        isNormalUser = true;
        # Fixed, so that the guest's user `agent` gets the same uid and owns
        # the workspace (virtiofs passes uids through).
        uid = 1000;
        extraGroups = [ "keystone-agent" ];
      };

      keystone.agent = {
        enable = true;
        defaults = {
          memory = 1024;
          vcpus = 1;
          # Keep the test's disk small: no home image.
          persist = false;
        };
        proxy.enable = true;
        sandboxes.demo = {
          project = "/home/alice/demo";
          owner = "alice";
          ports.web = 8000;
          # The dev server the test starts inside the sandbox.
          guestConfig =
            { pkgs, ... }:
            {
              environment.systemPackages = [ pkgs.python3 ];
            };
        };
      };

      environment.systemPackages = [
        pkgs.git
        pkgs.curl
      ];
    };

  testScript = ''
    import shlex


    def alice(cmd):
        """cmd as alice, the sandbox's owner, in her home directory."""
        return f"su - alice -c {shlex.quote(cmd)}"


    host.start()
    host.wait_for_unit("multi-user.target")

    with subtest("agentd runs and its configuration is valid"):
        host.wait_for_unit("agentd.service")
        host.succeed("agentd --check-config /etc/keystone-agent/agentd.json")
        host.wait_until_succeeds("ip -4 addr show keystone-br0 | grep -q 10.231.0.1/16", timeout=60)

    with subtest("the project: a repository of alice's"):
        host.succeed(alice(
            "git init -q -b main demo && cd demo"
            " && git -c user.name=Alice -c user.email=alice@example.org commit -q --allow-empty -m init"
        ))

    with subtest("agentctl list shows the declared sandbox"):
        out = host.succeed(alice("agentctl --bus system list"))
        assert "demo" in out, out
        out = host.succeed(alice("agentctl --bus system list --json"))
        assert '"demo"' in out, out

    with subtest("Caddy answers for the sandbox's hostname"):
        host.wait_for_unit("caddy.service")
        host.wait_for_open_port(443)
        # Until agentd adds a route, the site's catch-all answers (with a
        # certificate from Caddy's own CA, issued on the first request).
        host.wait_until_succeeds(
            "curl -s --cacert /var/lib/caddy/.local/share/caddy/pki/authorities/local/root.crt"
            " https://demo.sandbox.local/ | grep -q 'agentctl start demo'",
            timeout=60,
        )

    # ---- From here on: agentd's microvm backend (not written yet). ----

    with subtest("agentctl start boots the microVM"):
        host.succeed(alice("agentctl --bus system start demo"))
        host.wait_for_unit("microvm@demo.service")
        out = host.succeed(alice("agentctl --bus system status demo"))
        assert "running" in out, out
        host.succeed("ip link show master keystone-br0 | grep -q ': ks'")

    with subtest("agentctl exec runs git in /workspace"):
        out = host.succeed(alice("agentctl --bus system exec demo -- git status"))
        assert "On branch main" in out, out
        out = host.succeed(alice("agentctl --bus system exec demo -- cat /etc/keystone-agent-sandbox"))
        assert out.strip() == "demo", out

    with subtest("a commit made in the sandbox comes back with agentctl sync"):
        host.succeed(alice(
            "agentctl --bus system exec demo -- sh -c"
            " 'echo hello > hello.txt && git add hello.txt"
            " && git -c user.name=Agent -c user.email=agent@example.org commit -q -m from-the-sandbox'"
        ))
        host.succeed(alice("agentctl --bus system sync demo"))
        out = host.succeed(alice("git -C demo log --format=%s sandbox/demo/main"))
        assert "from-the-sandbox" in out, out

    with subtest("the dev-server link reaches the sandbox"):
        host.succeed(alice(
            "agentctl --bus system exec demo -- sh -c"
            " 'nohup python3 -m http.server 8000 >/dev/null 2>&1 &'"
        ))
        host.wait_until_succeeds(
            "curl -sfL --cacert /var/lib/caddy/.local/share/caddy/pki/authorities/local/root.crt"
            " https://demo.sandbox.local/ | grep -q hello.txt",
            timeout=120,
        )

    with subtest("agentctl stop stops the microVM"):
        host.succeed(alice("agentctl --bus system stop demo"))
        host.wait_until_fails("systemctl is-active microvm@demo.service", timeout=120)
  '';

  meta.timeout = 3600;
}

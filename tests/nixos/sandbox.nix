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
#
# The network: the guest's only way out is agentd's egress gateway on the
# host's bridge address (the module's nftables rules, nixos-modules/lib/
# firewall.nix). The host trusts the bridge in its own firewall, so that
# what holds below holds whatever networking.firewall says; a second machine,
# `origin`, serves HTTP on ports 80 (allowed to the sandbox by an
# address-range entry) and 8080 (not allowed).
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

      # networking.firewall opens everything on the bridge; the module's
      # rules must still let the sandbox reach only the gateway.
      networking.firewall.trustedInterfaces = [ "keystone-br0" ];

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
        # A sandbox of agentd's own QEMU guests: the flake's guest image
        # (keystone.agent.vm.image's default), QEMU and virtiofsd on
        # agentd's PATH.
        sandboxes.vmdemo = {
          project = "/home/alice/vmdemo";
          owner = "alice";
          backend = "vm";
          network = "none";
        };
        sandboxes.demo = {
          project = "/home/alice/demo";
          owner = "alice";
          ports.web = 8000;
          # `origin` (on the test network, 192.168.1.0/24) on port 80 only.
          egressAllow = [ "192.168.1.0/24:80" ];
          # The dev server the test starts inside the sandbox, and curl.
          guestConfig =
            { pkgs, ... }:
            {
              environment.systemPackages = [
                pkgs.python3
                pkgs.curl
                pkgs.iproute2
              ];
            };
        };
      };

      environment.systemPackages = [
        pkgs.git
        pkgs.curl
        pkgs.nftables
      ];
    };

  nodes.origin = {
    services.nginx = {
      enable = true;
      virtualHosts.origin = {
        listen = [
          {
            addr = "0.0.0.0";
            port = 80;
          }
          {
            addr = "0.0.0.0";
            port = 8080;
          }
        ];
        locations."/".return = "200 'origin-says-hello'";
      };
    };
    networking.firewall.allowedTCPPorts = [
      80
      8080
    ];
  };

  testScript = ''
    import json
    import shlex


    def alice(cmd):
        """cmd as alice, the sandbox's owner, in her home directory."""
        return f"su - alice -c {shlex.quote(cmd)}"


    start_all()
    host.wait_for_unit("multi-user.target")
    origin.wait_for_unit("nginx.service")
    origin.wait_for_open_port(8080)

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

    with subtest("switching to the configuration again succeeds"):
        # What `nixos-rebuild switch` runs last; it exits 4 when a unit
        # fails to start (dnsmasq beside resolved's stub, networkd-wait-online).
        host.succeed("/run/current-system/bin/switch-to-configuration test")

    with subtest("the first switch left no failed unit, and both resolvers work together"):
        # systemd-networkd (the bridge) brought systemd-resolved along; its
        # stub listener and dnsmasq (loopback only) both run, and resolved
        # routes the domain to dnsmasq. networkd-wait-online, with nothing
        # to wait for on this host, is not there to fail.
        host.wait_for_unit("dnsmasq.service")
        host.wait_for_unit("systemd-resolved.service")
        out = host.succeed("systemctl list-units --failed --no-legend --plain")
        assert out.strip() == "", out
        host.fail("systemctl is-enabled systemd-networkd-wait-online.service")
        out = host.succeed("getent ahostsv4 main.demo.sandbox.local")
        assert out.startswith("127.0.0.1 "), out
        out = host.succeed("resolvectl query main.demo.sandbox.local")
        assert "127.0.0.1" in out, out
        # dnsmasq answers on loopback only, not on the sandboxes' bridge.
        out = host.succeed("ss -Hlnu 'sport = :53'")
        assert "10.231.0.1" not in out and "0.0.0.0:53" not in out, out

    with subtest("a vm-backend sandbox starts, runs git and stops"):
        host.succeed(alice(
            "git init -q -b main vmdemo && cd vmdemo"
            " && git -c user.name=Alice -c user.email=alice@example.org commit -q --allow-empty -m init"
        ))
        host.succeed(alice("agentctl --bus system start vmdemo"), timeout=900)
        out = host.succeed(alice("agentctl --bus system status vmdemo"))
        assert "running" in out, out
        out = host.succeed(alice("agentctl --bus system exec vmdemo -- git status"))
        assert "On branch main" in out, out
        host.succeed(alice("agentctl --bus system stop vmdemo"), timeout=300)

    with subtest("agentctl start boots the microVM"):
        host.succeed(alice("agentctl --bus system start demo"))
        host.wait_for_unit("microvm@demo.service")
        out = host.succeed(alice("agentctl --bus system status demo"))
        assert "running" in out, out
        host.succeed("ip link show master keystone-br0 | grep -q ': ks'")

    with subtest("agentctl exec runs git in /workspace"):
        # The first start cloned the project over the empty directory that
        # microvm.nix's activation would have made, and agentd logged in
        # with the key it provisioned.
        out = host.succeed(alice("agentctl --bus system exec demo -- git status"))
        assert "On branch main" in out, out
        out = host.succeed("stat -c '%U %a' /var/lib/keystone-agent/sandboxes/demo/ssh")
        assert out.split()[0] != "microvm", out
        out = host.succeed(alice("agentctl --bus system exec demo -- cat /etc/keystone-agent-sandbox"))
        assert out.strip() == "demo", out

    with subtest("the guest makes its protected paths read-only (advisory)"):
        out = host.succeed(alice("agentctl --bus system exec demo -- grep -c ' /workspace/.git/hooks ' /proc/self/mountinfo"))
        assert out.strip() != "0", out
        host.fail(alice("agentctl --bus system exec demo -- touch /workspace/.git/hooks/pre-commit"))

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

    def inside(cmd):
        """cmd run by sh in the sandbox (as its user `agent`), through agentctl."""
        return alice(f"agentctl --bus system exec demo -- sh -c {shlex.quote(cmd)}")

    # A service on every address of the host, which the firewall lets the
    # bridge reach (trustedInterfaces): only the module's rules stand
    # between it and the sandbox.
    host.succeed("systemd-run --unit=host-service ${pkgs.python3.interpreter} -m http.server --bind 0.0.0.0 8081")
    host.wait_for_open_port(8081)
    host_lan = host.succeed("ip -4 -o addr show dev eth1 | awk '{print $4}' | cut -d/ -f1").strip()
    origin_lan = origin.succeed("ip -4 -o addr show dev eth1 | awk '{print $4}' | cut -d/ -f1").strip()

    with subtest("the host loads the sandbox's rules"):
        out = host.succeed("nft list table bridge keystone-agent")
        assert "chain ks" in out, out
        host.succeed("nft list table inet keystone-agent | grep -q 'tcp dport 3128'")
        # The bridge has no IPv6 address for a sandbox to talk to.
        out = host.succeed("ip -6 addr show dev keystone-br0")
        assert "inet6" not in out, out

    with subtest("the guest's logins point at the gateway on the bridge"):
        out = host.succeed(inside("echo $HTTPS_PROXY $http_proxy $ALL_PROXY $no_proxy"))
        assert out.split() == [
            "http://10.231.0.1:3128",
            "http://10.231.0.1:3128",
            "socks5h://10.231.0.1:3128",
            "localhost,127.0.0.1,::1",
        ], out

    with subtest("directly, the sandbox reaches nothing: not the host, not the network"):
        for url in [
            "http://10.231.0.1:8081/",
            f"http://{host_lan}:8081/",
            "http://10.231.0.1:22/",
            "http://10.231.0.1:2019/config/",
            f"http://{origin_lan}/",
        ]:
            host.fail(inside(f"curl -sS --noproxy '*' --max-time 5 {url}"))
        # Refused at once, not left to time out.
        host.succeed(inside(
            "start=$(date +%s); curl -s --noproxy '*' --max-time 20 http://10.231.0.1:8081/;"
            " test $(( $(date +%s) - start )) -lt 5"
        ))

    with subtest("through the gateway: the allowed origin answers, the other is refused"):
        out = host.succeed(inside(f"curl -sS --max-time 20 http://{origin_lan}/"))
        assert "origin-says-hello" in out, out
        out = host.succeed(inside(f"curl -sS --max-time 20 http://{origin_lan}:8080/"))
        assert "agentctl egress demo allow" in out and "origin-says-hello" not in out, out
        # The host's own addresses are refused by the gateway too.
        out = host.succeed(inside(f"curl -sS --max-time 20 http://{host_lan}:8081/"))
        assert "refused" in out and "Directory listing" not in out, out
        entries = json.loads(host.succeed(alice("agentctl --bus system egress demo log --json -n 50")))
        assert any(e["decision"] == "allow" and e["port"] == 80 for e in entries), entries
        assert any(e["decision"] == "deny" and e["port"] == 8080 for e in entries), entries

    with subtest("another source address, even the sandbox's root's, gets nothing"):
        # agent may use sudo in the guest; a second address on its interface
        # is not the sandbox's, and the bridge drops what it sends: the
        # connection is never made (curl: 28, timed out, or 7, no answer to
        # its ARP), so agentd never even sees it (that would be 52, an
        # empty reply).
        dev = "$(ip -o -4 addr show | awk '/10\\.231\\./ {print $2; exit}')"
        host.succeed(inside(f"sudo ip addr add 10.231.0.99/16 dev {dev}"))
        host.succeed(inside(
            f"curl -s --connect-timeout 5 --interface 10.231.0.99 --proxy http://10.231.0.1:3128 http://{origin_lan}/;"
            " rc=$?; test $rc = 28 || test $rc = 7"
        ))
        host.succeed(inside(f"sudo ip addr del 10.231.0.99/16 dev {dev}"))
        host.succeed(inside(f"curl -sS --max-time 20 http://{origin_lan}/ | grep -q origin-says-hello"))

    with subtest("the gateway takes no connection from the host itself"):
        # Refused by the rules (7), not accepted and closed by agentd (52).
        host.succeed("curl -s --max-time 5 --proxy http://10.231.0.1:3128 http://origin/; test $? = 7")

    with subtest("a second local user: no tap on the bridge, no connection into it, no home image"):
        host.succeed("useradd -m mallory")
        # qemu-bridge-helper (setcap, runnable by everyone) refuses the bridge.
        out = host.fail("su - mallory -c '/run/wrappers/bin/qemu-bridge-helper --br=keystone-br0 --fd=3 3>/dev/null' 2>&1")
        assert "denied" in out, out
        # A tap attached as root, posing as the sandbox, gets nothing in.
        host.succeed(
            "ip tuntap add tap0 mode tap && ip link set tap0 master keystone-br0 up"
            " && nft list chain bridge keystone-agent prerouting | grep -q 'policy drop'"
        )
        host.succeed("ip link del tap0")
        # The guest's dev server: root (agentd) reaches it, mallory does not.
        demo_ip = host.succeed(inside("ip -4 -o addr show | awk '/10\\.231\\./ {print $4}' | cut -d/ -f1")).strip()
        host.succeed(f"curl -sf --max-time 10 http://{demo_ip}:8000/ >/dev/null")
        host.fail(f"su - mallory -c 'curl -sf --max-time 10 http://{demo_ip}:8000/'")
        # The home image and its directory are closed to other users.
        out = host.succeed("stat -c '%a %U' /var/lib/microvms/demo")
        assert out.split() == ["700", "microvm"], out
        host.fail("su - mallory -c 'ls /var/lib/microvms/demo'")
        # Caddy's admin API: a unix socket in a 0700 directory, nothing on 2019.
        host.fail("su - mallory -c 'curl -s --max-time 5 --unix-socket /run/caddy/admin.sock http://localhost/config/'")
        host.fail("curl -s --max-time 5 http://127.0.0.1:2019/config/")
        out = host.succeed("stat -c '%a %U' /run/caddy")
        assert out.split() == ["700", "caddy"], out
        # KSM is off, and QEMU does not offer the guest's memory to it.
        assert host.succeed("cat /sys/kernel/mm/ksm/run").strip() == "0"
        host.succeed("grep -q 'mem-merge=off' /var/lib/microvms/demo/current/bin/microvm-run")
        # nix-daemon in the guest fetches through the gateway.
        out = host.succeed(inside("systemctl show nix-daemon -p Environment"))
        assert "https_proxy=http://10.231.0.1:3128" in out, out

    with subtest("agentctl stop stops the microVM"):
        host.succeed(alice("agentctl --bus system stop demo"))
        host.wait_until_fails("systemctl is-active microvm@demo.service", timeout=120)
  '';

  meta.timeout = 3600;
}

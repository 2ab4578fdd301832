{
  description = "Keystone Agent: sandboxes for AI coding agents (agentd, agentctl, NixOS modules)";

  inputs = {
    # nixos-unstable at the revision microvm.nix itself was tested with (see flake.lock).
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";
    # main: the last release (v0.5.0, 2024) lacks options the modules use
    # (vsock.ssh, restartIfChanged, ...).
    microvm = {
      url = "github:microvm-nix/microvm.nix";
      inputs.nixpkgs.follows = "nixpkgs";
    };
  };

  outputs =
    {
      self,
      nixpkgs,
      microvm,
    }:
    let
      inherit (nixpkgs) lib;

      # The VM tests need x86_64 KVM; the packages would build elsewhere, but
      # only this system is built and tested.
      system = "x86_64-linux";
      pkgs = nixpkgs.legacyPackages.${system};

      version = (builtins.fromTOML (builtins.readFile ./Cargo.toml)).workspace.package.version;

      # What cargo sees: the workspace, plus the fixtures and the
      # introspection XML that the tests read.
      src = lib.fileset.toSource {
        root = ./.;
        fileset = lib.fileset.unions [
          ./Cargo.toml
          ./Cargo.lock
          ./agentd
          ./agentctl
          ./docs
          ./tests/fixtures
        ];
      };

      # Common arguments of everything cargo builds. git2 builds its bundled
      # libgit2 (no system one of the pinned version) and links zlib.
      cargoArgs = pkgs: {
        inherit version src;
        cargoLock.lockFile = ./Cargo.lock;
        nativeBuildInputs = [ pkgs.pkg-config ];
        buildInputs = [ pkgs.zlib ];
      };

      mkPackages =
        pkgs:
        let
          crate =
            {
              pname,
              description,
              postInstall ? "",
            }:
            pkgs.rustPlatform.buildRustPackage (
              cargoArgs pkgs
              // {
                inherit pname postInstall;
                cargoBuildFlags = [
                  "-p"
                  pname
                ];
                # The test suites run once for the whole workspace, in
                # checks.cargo-test.
                doCheck = false;
                meta = {
                  inherit description;
                  homepage = "https://github.com/keystone-agent/keystone-agent";
                  license = lib.licenses.mit;
                  mainProgram = pname;
                  platforms = lib.platforms.linux;
                };
              }
            );

          agentd = crate {
            pname = "agentd";
            description = "Keystone Agent daemon: owns sandbox lifecycle and brings agents' commits home";
            postInstall = ''
              install -Dm644 agentd/dbus/org.keystone.Agent1.conf \
                $out/share/dbus-1/system.d/org.keystone.Agent1.conf
            '';
          };

          agentctl = crate {
            pname = "agentctl";
            description = "Command-line client for Keystone Agent";
          };
        in
        {
          inherit agentd agentctl;
          # Both binaries and the D-Bus policy: what the NixOS module installs.
          default = pkgs.symlinkJoin {
            name = "keystone-agent-${version}";
            paths = [
              agentd
              agentctl
            ];
            meta = {
              description = "Keystone Agent: agentd, agentctl and the D-Bus system policy";
              license = lib.licenses.mit;
              mainProgram = "agentctl";
              platforms = lib.platforms.linux;
            };
          };
        };

      # A cargo command over the workspace as a check (output: an empty file).
      cargoCheck =
        name:
        {
          extraInputs ? [ ],
          script,
        }:
        pkgs.rustPlatform.buildRustPackage (
          cargoArgs pkgs
          // {
            pname = "keystone-agent-${name}";
            nativeBuildInputs = (cargoArgs pkgs).nativeBuildInputs ++ extraInputs;
            buildPhase = ''
              runHook preBuild
              export HOME=$TMPDIR
              ${script}
              runHook postBuild
            '';
            doCheck = false;
            installPhase = ''
              runHook preInstall
              touch $out
              runHook postInstall
            '';
          }
        );

      packages = mkPackages pkgs;
    in
    {
      packages.${system} = packages // {
        # The guest image of the vm backend: vmlinux, initrd, rootfs.img and
        # image.json (docs/guest-image.md, guest-image/vm-image.nix).
        guest-image = import ./guest-image/vm-image.nix { inherit nixpkgs system; };
        # The guest of the microvm backend, as a runnable microVM of an
        # example sandbox (see guest-image/default.nix for how to boot it).
        guest-runner =
          (import ./guest-image {
            inherit nixpkgs microvm system;
          }).config.microvm.declaredRunner;
      };

      overlays.default = final: _prev: {
        keystone-agent = (mkPackages final).default;
      };

      nixosModules = {
        # The host module with microvm.nix's host module and this flake's
        # package: all a configuration needs.
        # microvm.host.enable keeps microvm.nix's own default (on): a host
        # that runs other microVMs with Keystone Agent off keeps them.
        default =
          { lib, pkgs, ... }:
          let
            packages = self.packages.${pkgs.stdenv.hostPlatform.system};
          in
          {
            imports = [
              microvm.nixosModules.host
              ./nixos-modules/host
            ];
            keystone.agent.package = lib.mkDefault packages.default;
            keystone.agent.vm.image = lib.mkDefault packages.guest-image;
          };
        # The bare host module: bring microvm.nix's host module and
        # keystone.agent.package yourself.
        host = ./nixos-modules/host;
        # The guest module (needs microvm.nix's guest module).
        guest = ./nixos-modules/guest;
      };

      # The pure functions behind the module (names, addresses, JSON, checks).
      lib = import ./nixos-modules/lib/naming.nix;

      checks.${system} = {
        package = packages.default;

        clippy = cargoCheck "clippy" {
          extraInputs = [ pkgs.clippy ];
          script = "cargo clippy --workspace --all-targets --frozen -- -D warnings";
        };

        fmt = cargoCheck "fmt" {
          extraInputs = [ pkgs.rustfmt ];
          script = "cargo fmt --all --check";
        };

        # The workspace's tests against a private dbus-daemon, real git
        # repositories and the real binaries. Tests that need root or systemd
        # as PID 1 say so and skip themselves in the build sandbox.
        cargo-test = cargoCheck "cargo-test" {
          extraInputs = [
            pkgs.git
            pkgs.dbus
            pkgs.systemd
            pkgs.util-linux
            pkgs.tmux
          ];
          # The session tests attach to the same Zellij the guests run.
          script = ''
            export KEYSTONE_ZELLIJ=${pkgs.callPackage ./nixos-modules/pkgs/zellij.nix { }}/bin/zellij
            cargo test --workspace --frozen
          '';
        };

        guest-image = self.packages.${system}.guest-image;

        # Host with the module, one declared sandbox, booted with nested KVM.
        nixos-sandbox = import ./tests/nixos/sandbox.nix { inherit pkgs self; };
      };

      devShells.${system}.default = pkgs.mkShell {
        inputsFrom = [ packages.agentd ];
        packages = [
          pkgs.cargo
          pkgs.rustc
          pkgs.clippy
          pkgs.rustfmt
          pkgs.rust-analyzer
          pkgs.git
          pkgs.dbus
          pkgs.tmux
          (pkgs.callPackage ./nixos-modules/pkgs/zellij.nix { })
          pkgs.nixfmt
        ];
      };

      formatter.${system} = pkgs.nixfmt;
    };
}

# Zellij 0.45.1 from crates.io. A Zellij client and server must be the same
# release, and agentd's sessions are made for 0.45 (tests/install-zellij.sh
# installs this same release off NixOS).
{
  lib,
  rustPlatform,
  fetchCrate,
  pkg-config,
  curl,
  openssl,
}:

rustPlatform.buildRustPackage rec {
  pname = "zellij";
  version = "0.45.1";

  src = fetchCrate {
    inherit pname version;
    hash = "sha256-WKwI493DjSig9f+nRJu0YHNVKb9dwr0lIvVAvWawa8k=";
  };

  # A copy of the Cargo.lock the crate ships (every dependency comes from
  # crates.io). Reading "${src}/Cargo.lock" instead would be
  # import-from-derivation: evaluation would have to build src first, which
  # fails wherever that is off (Hydra, `nix flake show`). tests/nix/check.sh
  # checks that the copy equals the crate's.
  cargoLock.lockFile = ./zellij.Cargo.lock;

  # The default features minus `vendored_curl` (link nixpkgs' curl) and
  # `web_server_capability` (`zellij web`: sessions never use it), as
  # tests/install-tools.sh builds it.
  buildNoDefaultFeatures = true;
  buildFeatures = [ "plugins_from_target" ];
  nativeBuildInputs = [ pkg-config ];
  buildInputs = [
    curl
    openssl
  ];
  env = {
    OPENSSL_NO_VENDOR = 1;
    # Zellij's release profile asks for fat LTO in one codegen unit, most
    # of a long build for little gain: the default release profile instead.
    CARGO_PROFILE_RELEASE_LTO = "false";
    CARGO_PROFILE_RELEASE_CODEGEN_UNITS = "16";
  };

  # Its tests want a terminal and the network.
  doCheck = false;

  meta = {
    description = "Terminal workspace (the release Keystone Agent sessions use)";
    homepage = "https://zellij.dev/";
    license = lib.licenses.mit;
    mainProgram = "zellij";
  };
}

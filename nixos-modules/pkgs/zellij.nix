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

  # The crate ships its Cargo.lock; every dependency comes from crates.io.
  cargoLock.lockFile = "${src}/Cargo.lock";

  # The default features minus `vendored_curl`: link nixpkgs' curl.
  buildNoDefaultFeatures = true;
  buildFeatures = [
    "plugins_from_target"
    "web_server_capability"
  ];
  nativeBuildInputs = [ pkg-config ];
  buildInputs = [
    curl
    openssl
  ];
  env.OPENSSL_NO_VENDOR = 1;

  # Its tests want a terminal and the network.
  doCheck = false;

  meta = {
    description = "Terminal workspace (the release Keystone Agent sessions use)";
    homepage = "https://zellij.dev/";
    license = lib.licenses.mit;
    mainProgram = "zellij";
  };
}

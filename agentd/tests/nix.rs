//! The Nix side, as far as it runs without nixpkgs: every .nix file parses,
//! the pure naming functions agree with the Rust ones
//! (tests/fixtures/naming.json), and the module's rendering of agentd's
//! config passes `agentd --check-config`. Runs tests/nix/check.sh; skipped
//! (and says so) where `nix-instantiate` is missing — CI installs it.

use std::path::Path;
use std::process::Command;

#[test]
fn nix_checks_pass() {
    if Command::new("nix-instantiate")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: nix-instantiate is not installed (apt-get install nix-bin)");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash")
        .arg(root.join("tests/nix/check.sh"))
        .current_dir(&root)
        .env("AGENTD", env!("CARGO_BIN_EXE_agentd"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "tests/nix/check.sh failed:\n{text}");
    assert!(
        text.contains("nix checks:") && text.contains(", 0 failed"),
        "{text}"
    );
}

//! agentctl on its own: help that teaches, and a clear error (exit 4) when
//! agentd cannot be reached.

use std::process::Command;

const AGENTCTL: &str = env!("CARGO_BIN_EXE_agentctl");

#[test]
fn help_lists_every_verb_and_the_exit_codes() {
    let out = Command::new(AGENTCTL).arg("--help").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for verb in [
        "create", "start", "stop", "destroy", "list", "status", "exec",
    ] {
        assert!(text.contains(verb), "{verb} missing from:\n{text}");
    }
    assert!(text.contains("4 requirements not met"), "{text}");
}

#[test]
fn unreachable_agentd_is_explained() {
    let dir = tempfile::tempdir().unwrap();
    let addr = format!("unix:path={}", dir.path().join("nothing.sock").display());
    let out = Command::new(AGENTCTL)
        .args(["--bus", &addr, "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Is agentd running?") && err.contains("agentd --session"),
        "{err}"
    );
}

#[test]
fn usage_errors_exit_4_before_any_call() {
    let out = Command::new(AGENTCTL).args(["exec", "x"]).output().unwrap();
    assert_eq!(out.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&out.stderr).contains("CMD"));
}

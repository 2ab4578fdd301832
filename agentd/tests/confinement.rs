//! What a local sandbox is shown read-only stays read-only, whatever root
//! inside tries: the mounts are locked by the kernel and commands run
//! without capabilities.

mod common;

use common::Env;

#[test]
fn read_only_mounts_cannot_be_made_writable_or_covered() {
    let env = Env::running("lock", &[]);
    let sh = |script: &str| {
        let out = env.ctl(&["exec", "lock", "--", "sh", "-c", script]);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for dir in ["/usr", "/etc", "/run/keystone"] {
        if sh(&format!("test -d {dir}")).0 != Some(0) {
            continue;
        }
        // Made writable again, directly or from a namespace of its own.
        for attempt in [
            format!("mount -o remount,bind,rw {dir}"),
            format!("unshare -Urm sh -c 'mount -o remount,bind,rw {dir} && touch {dir}/.w'"),
            format!("umount -l {dir}"),
            format!("mount -t tmpfs none {dir}"),
        ] {
            let (code, err) = sh(&attempt);
            assert_ne!(code, Some(0), "{attempt} succeeded: {err}");
        }
        let (code, _) = sh(&format!("touch {dir}/.w"));
        assert_ne!(code, Some(0), "{dir} is writable");
    }
    // Nor can it put a loader, a library or a device of its own where every
    // program looks for one: the root and /dev are read-only too.
    for attempt in [
        "mkdir -p /workspace/fl && ln -s /workspace/fl /lib64.new && mv -Tf /lib64.new /lib64",
        "rm -f /lib64 && mkdir /lib64",
        "touch /planted",
        "ln -sf /workspace/x /dev/ptmx",
        "rm /dev/stdin",
    ] {
        let (code, err) = sh(attempt);
        assert_ne!(code, Some(0), "{attempt} succeeded: {err}");
    }
    // Still read-only in the mount table, and the tools are still agentd's.
    let mounts = env.ok(&["exec", "lock", "--", "cat", "/proc/self/mountinfo"]);
    let usr = mounts
        .lines()
        .find(|l| l.split_whitespace().nth(4) == Some("/usr"))
        .expect("/usr is mounted");
    assert!(
        usr.split_whitespace()
            .nth(5)
            .unwrap()
            .split(',')
            .any(|f| f == "ro"),
        "{usr}"
    );
    // Commands run with no capability at all, and cannot gain any.
    let status = env.ok(&["exec", "lock", "--", "cat", "/proc/self/status"]);
    for field in ["CapEff", "CapPrm", "CapBnd", "CapAmb"] {
        let line = status
            .lines()
            .find(|l| l.starts_with(field))
            .unwrap_or_else(|| panic!("{field} missing: {status}"));
        assert!(line.ends_with("0000000000000000"), "{line}");
    }
    assert!(status.lines().any(|l| l == "NoNewPrivs:\t1"), "{status}");
}

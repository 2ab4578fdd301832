//! Fast starts of `vm` sandboxes from the boot snapshot (docs/state.md):
//! agentd boots the image once, saves it, and starts each sandbox by
//! restoring that state and giving the guest its identity. Two sandboxes
//! started from one snapshot share nothing that makes a sandbox: random
//! state, host key, hostname, machine id, clock, workspace, home; the
//! snapshot's own key no longer logs in; a damaged snapshot gives a cold
//! boot that says so, and the next start makes the snapshot again;
//! `vm.fast_start = false` boots cold.
//!
//! These boot VMs, so they are `#[ignore]`d in the fast suite;
//! `tests/run-vm.sh` runs them.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::vm::{create_vm, env_with, identity, image};
use common::{Env, wait_for};

/// The boot snapshots agentd made: `vm-boot/<key>/`.
fn boot_snapshots(env: &Env) -> Vec<PathBuf> {
    std::fs::read_dir(env.state_dir.join("vm-boot"))
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
                .collect()
        })
        .unwrap_or_default()
}

/// The agent leaves, in its home disk, links where the skeleton's files
/// were (and no `.profile`, so the guest copies the skeleton at the next
/// start): a file of root's must not be written through them.
fn plant_links(env: &Env, name: &str) -> String {
    env.sh(
        name,
        "rm -f ~/.profile ~/.bashrc && ln -s /etc/issue ~/.bashrc && sha256sum < /etc/issue",
    )
}

/// After a start: `/etc/issue` is as it was, the link is left, and the
/// missing `.profile` is back, the agent's.
fn links_were_not_followed(env: &Env, name: &str, issue: &str) {
    let out = env.sh(
        name,
        "sha256sum < /etc/issue; readlink ~/.bashrc; test -O ~/.profile && test -w ~/.profile && echo profile",
    );
    assert_eq!(out, format!("{issue}/etc/issue\nprofile\n"), "{name}");
}

fn limits(env: &Env, name: &str) -> String {
    env.status(name)["limits"].as_str().unwrap().to_owned()
}

#[test]
#[ignore = "boots real VMs: run tests/run-vm.sh"]
fn sandboxes_start_from_one_boot_snapshot_each_with_an_identity_of_its_own() {
    let env = env_with(&image(), serde_json::json!({}));
    create_vm(&env, "fa", "none");
    create_vm(&env, "fb", "none");
    env.ok(&["start", "fa"]);
    let snaps = boot_snapshots(&env);
    assert_eq!(snaps.len(), 1, "{snaps:?}\n{}", env.log());
    let state = snaps[0].join("state");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&state).unwrap().permissions());
    assert_eq!(mode & 0o077, 0, "the snapshot is agentd's alone");
    env.ok(&["start", "fb"]);
    for name in ["fa", "fb"] {
        let l = limits(&env, name);
        assert!(
            l.contains("started from the boot snapshot"),
            "{name}: {l}\n{}",
            env.log()
        );
    }

    // Each has its own identity: random bytes, hostname, machine id, the
    // keys agentd made for it (its host key is the one agentd pinned for
    // it, or agentd would not have reached it).
    let (a, b) = (identity(&env, "fa"), identity(&env, "fb"));
    assert_eq!(a.len(), 4, "{a:?}");
    assert_eq!((a[1].as_str(), b[1].as_str()), ("fa", "fb"));
    for i in [0, 2, 3] {
        assert_ne!(a[i], b[i], "line {i} is shared: {a:?} {b:?}");
    }
    for (name, id) in [("fa", &a), ("fb", &b)] {
        let authorized = std::fs::read_to_string(
            env.state_dir
                .join("sandboxes")
                .join(name)
                .join("ssh/authorized_keys"),
        )
        .unwrap();
        assert_eq!(id[3], authorized.trim(), "{name}");
    }

    // Its clock is the host's, not the snapshot's.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        .cast_signed();
    let guest: i64 = env.sh("fa", "date +%s").trim().parse().unwrap();
    assert!(
        (now - 5..=now + 5).contains(&guest),
        "guest {guest}, host {now}"
    );

    // Its workspace, home and uid are its own.
    env.sh("fa", "echo from-a > /workspace/a.txt; echo home-a > ~/h");
    let ws = |n: &str| env.state_dir.join("sandboxes").join(n).join("workspace");
    assert_eq!(
        std::fs::read_to_string(ws("fa").join("a.txt")).unwrap(),
        "from-a\n"
    );
    assert!(!ws("fb").join("a.txt").exists());
    let out = env.sh("fb", "cat ~/h 2>/dev/null; id -u; stat -c %u /workspace; mountpoint -q /home/agent && echo home-mounted");
    let uid = std::fs::metadata(ws("fb"))
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
        .unwrap();
    assert_eq!(out, format!("{uid}\n{uid}\nhome-mounted\n"));

    // The snapshot's key no longer logs in: the guest allows the
    // sandbox's key alone (the control ports are its masters', so no
    // second client can try).
    let boot_key = std::fs::read_to_string(snaps[0].join("client/id_ed25519.pub")).unwrap();
    let boot_key = boot_key.split_whitespace().nth(1).unwrap();
    assert!(!a[3].contains(boot_key) && !b[3].contains(boot_key));

    // Stopped and started again: from the snapshot again, files kept,
    // and the links the agent left in its home not written through.
    let issue = plant_links(&env, "fa");
    env.ok(&["stop", "fa"]);
    env.ok(&["start", "fa"]);
    assert!(limits(&env, "fa").contains("started from the boot snapshot"));
    assert_eq!(env.sh("fa", "cat /workspace/a.txt"), "from-a\n");
    links_were_not_followed(&env, "fa", &issue);

    // A damaged snapshot: the next start boots cold and says why, and the
    // one after makes the snapshot again.
    env.ok(&["stop", "fb"]);
    std::fs::write(&state, b"QEVM garbage").unwrap();
    env.ok(&["start", "fb"]);
    let l = limits(&env, "fb");
    assert!(
        l.contains("cold boot (the boot snapshot did not restore"),
        "{l}"
    );
    assert_eq!(env.sh("fb", "hostname"), "fb\n");
    env.ok(&["stop", "fb"]);
    env.ok(&["start", "fb"]);
    assert!(limits(&env, "fb").contains("started from the boot snapshot"));
    assert!(std::fs::metadata(&state).unwrap().len() > 1 << 20);
    for name in ["fa", "fb"] {
        env.ok(&["stop", name]);
        env.ok(&["destroy", name, "--force"]);
    }
    wait_for("no VM left", Duration::from_secs(30), || {
        env.vm_processes().is_empty()
    });
}

#[test]
#[ignore = "boots real VMs: run tests/run-vm.sh"]
fn with_fast_start_off_a_sandbox_boots_cold_and_says_so() {
    let env = env_with(&image(), serde_json::json!({"vm": {"fast_start": false}}));
    create_vm(&env, "cold", "none");
    env.ok(&["start", "cold"]);
    let l = limits(&env, "cold");
    assert!(l.contains("cold boot (vm.fast_start is off)"), "{l}");
    assert!(boot_snapshots(&env).is_empty());
    assert_eq!(env.sh("cold", "hostname"), "cold\n");
    // The initramfs copies the skeleton as carefully.
    let issue = plant_links(&env, "cold");
    env.ok(&["stop", "cold"]);
    env.ok(&["start", "cold"]);
    links_were_not_followed(&env, "cold", &issue);
    env.ok(&["stop", "cold"]);
    env.ok(&["destroy", "cold", "--force"]);
}

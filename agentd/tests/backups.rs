//! Periodic backups of a real `local` sandbox: taken every
//! `backup_every_seconds` while it runs or is paused, pruned to its
//! `backup_keep` newest (the oldest go; a snapshot its owner took stays),
//! shown by `agentctl status`, and no more once the setting is 0.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{Env, json};

/// The ids of sandbox `name`'s snapshots of `kind`, oldest first.
fn ids(env: &Env, name: &str, kind: &str) -> Vec<String> {
    json(&env.ok(&["snapshots", name, "--json"]))
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["kind"] == kind)
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn backups_are_taken_pruned_to_the_newest_and_stop_when_turned_off() {
    let env = Env::running("bk", &["--backup-every", "2s", "--backup-keep", "2"]);
    let config = &env.status("bk")["config"];
    assert_eq!(config["backup_every_seconds"], 2, "{config}");
    assert_eq!(config["backup_keep"], 2, "{config}");
    env.sh("bk", "echo one > /workspace/a.txt");
    env.ok(&["snapshot", "bk", "--label", "mine"]);
    let mine = ids(&env, "bk", "snapshot");
    assert_eq!(mine.len(), 1, "{mine:?}");

    // Watch backups come and go: never more than 2 at once, until 4 have
    // been seen.
    let mut seen: Vec<String> = Vec::new();
    common::wait_for("four backups", Duration::from_secs(25), || {
        let now = ids(&env, "bk", "backup");
        assert!(now.len() <= 2, "more backups than kept: {now:?}");
        for id in now {
            if !seen.contains(&id) {
                seen.push(id);
            }
        }
        seen.len() >= 4
    });
    common::wait_for("two backups", Duration::from_secs(10), || {
        ids(&env, "bk", "backup").len() == 2
    });
    let kept = ids(&env, "bk", "backup");
    let first = &seen[0];
    assert!(!kept.contains(first), "the oldest backup {first} was kept");
    assert!(
        !env.state_dir.join("snapshots/bk").join(first).exists(),
        "the oldest backup's files are left"
    );
    // The owner's snapshot is never pruned.
    assert_eq!(ids(&env, "bk", "snapshot"), mine);

    // `status` tells the newest backup.
    let snaps = &env.status("bk")["snapshots"];
    assert!(snaps["last_backup_at"].is_string(), "{snaps}");
    assert!(snaps["last_backup_size"].as_u64().unwrap() > 0, "{snaps}");
    let text = env.ok(&["status", "bk"]);
    assert!(text.contains("Backup:     last at"), "{text}");

    // A paused sandbox is backed up too.
    env.ok(&["pause", "bk"]);
    let before: BTreeSet<String> = ids(&env, "bk", "backup").into_iter().collect();
    common::wait_for("a backup while paused", Duration::from_secs(10), || {
        ids(&env, "bk", "backup")
            .iter()
            .any(|id| !before.contains(id))
    });
    env.ok(&["resume", "bk"]);

    // Turned off, no more are taken (one under way may still land).
    env.ok(&["set", "bk", "--backup-every", "0"]);
    assert_eq!(env.status("bk")["config"]["backup_every_seconds"], 0);
    std::thread::sleep(Duration::from_millis(1500));
    let after_off = ids(&env, "bk", "backup");
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(ids(&env, "bk", "backup"), after_off, "a backup while off");
    assert_eq!(ids(&env, "bk", "snapshot"), mine);

    // At least one backup is kept when backups are on.
    let bad = env.fails(4, &["set", "bk", "--backup-keep", "0"]);
    assert!(bad.contains("backup-keep"), "{bad}");
}

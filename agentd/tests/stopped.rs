//! What a stopped sandbox holds on the host: its directory and registry
//! entry, and its disk image, not mounted. Whatever reads its directory
//! (a sync, its history, a snapshot) mounts the image while it runs;
//! once nothing does, the image is unmounted again and its loop device
//! freed. What it names of the held files stays known across agentd's
//! restarts while it is not mounted.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Env, json, wait_for};

/// The loop devices bound to `image` now (or to the file it named, once
/// deleted).
fn loop_devices_of(image: &Path) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let deleted = format!("{} (deleted)", image.display());
    dir.flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("loop/backing_file")).is_ok_and(|b| {
                let b = b.trim_end_matches('\n');
                Path::new(b) == image || b == deleted
            })
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

fn mounted(dir: &Path) -> bool {
    agentd::disk::is_mount_point(dir)
}

/// Wait until `dir` is not a mount point any more (the grace after the
/// last use is 2 s).
fn wait_unmounted(dir: &Path) {
    wait_for("the image unmounted", Duration::from_secs(20), || {
        !mounted(dir)
    });
}

/// Wait until sandbox `name` holds no mount and no loop device, then
/// check that nothing of it is on the host's file system outside its
/// image (`dir` is empty) and that what it names of the held files is
/// written beside the image.
fn wait_holding_nothing(env: &Env, name: &str) {
    let dir = env.state_dir.join("sandboxes").join(name);
    let image = env.state_dir.join(format!("disks/{name}.img"));
    wait_unmounted(&dir);
    wait_for("the loop device freed", Duration::from_secs(10), || {
        loop_devices_of(&image).is_empty()
    });
    let shown: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert!(shown.is_empty(), "{shown:?}");
    assert!(env.state_dir.join(format!("disks/{name}.held")).is_file());
}

#[test]
fn a_stopped_sandbox_holds_no_mount_and_what_reads_it_mounts_it_for_the_time() {
    if !common::is_root() {
        eprintln!("skipped: disk images need root");
        return;
    }
    let mut env = Env::running("cold", &[]);
    let dir = env.state_dir.join("sandboxes/cold");
    let image = env.state_dir.join("disks/cold.img");
    assert!(mounted(&dir), "a running sandbox's image is mounted");
    assert_eq!(loop_devices_of(&image).len(), 1);
    env.sh(
        "cold",
        "cd /workspace && echo cold > cold.txt && git add cold.txt && \
         git -c user.name=A -c user.email=a@b commit -qm cold",
    );

    env.ok(&["stop", "cold"]);
    wait_holding_nothing(&env, "cold");
    // (`status` reads Holds first; its egress log part mounts the image.)
    assert_eq!(
        env.status("cold")["holds"],
        "its directory and registry entry; its disk image, not mounted; no process, no listener"
    );

    // What reads a stopped sandbox's directory finds it as it was.
    env.ok(&["sync", "cold"]);
    let repo = env.repo("cold");
    assert_eq!(
        common::git(&repo, &["show", "refs/remotes/sandbox/cold/main:cold.txt"]),
        "cold\n"
    );
    let history = env.ok(&["history", "cold"]);
    assert!(history.contains("echo cold > cold.txt"), "{history}");
    let snap = json(&env.ok(&["snapshot", "cold", "--json"]));
    assert!(snap["size"].as_u64().unwrap() > 0, "{snap}");
    env.ok(&["egress", "cold", "log"]);
    env.ok(&["set", "cold", "--sync-idle-seconds", "45"]);
    // ... and lets go of it once nothing reads it, with nothing written
    // outside the image meanwhile.
    wait_holding_nothing(&env, "cold");

    // An agentd killed and started again leaves it unmounted; its start
    // mounts it, with what was written on it while it was stopped.
    env.kill_agentd();
    env.start_agentd();
    assert!(!mounted(&dir));
    env.ok(&["start", "cold"]);
    assert!(mounted(&dir));
    assert!(!env.state_dir.join("disks/cold.held").exists());
    assert_eq!(env.sh("cold", "cat /workspace/cold.txt"), "cold\n");
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    assert!(config.contains("\"sync_idle_seconds\": 45"), "{config}");

    // A restore of a stopped sandbox puts back what the snapshot holds.
    env.sh("cold", "rm /workspace/cold.txt");
    env.ok(&["stop", "cold"]);
    wait_unmounted(&dir);
    env.ok(&["restore", "cold", snap["id"].as_str().unwrap()]);
    env.ok(&["start", "cold"]);
    assert_eq!(env.sh("cold", "cat /workspace/cold.txt"), "cold\n");

    // Destroyed, and made again under the same name: the new one has an
    // image of its own, mounted while it runs.
    env.ok(&["stop", "cold"]);
    env.ok(&["destroy", "--force", "cold"]);
    assert!(!image.exists() && !dir.exists());
    // Its file system ends after the destroy has answered; then its loop
    // device is freed.
    wait_for(
        "the destroyed image's loop device freed",
        Duration::from_secs(10),
        || loop_devices_of(&image).is_empty(),
    );
    let repo = env.repo("cold");
    env.ok(&["create", "--name", "cold", repo.to_str().unwrap()]);
    env.ok(&["start", "cold"]);
    assert!(mounted(&dir) && image.is_file());
    let limits = env.status("cold")["limits"].as_str().unwrap().to_owned();
    assert!(limits.contains("(ext4 image)"), "{limits}");
}

/// An `auto-commit` sandbox's workspace is watched while it runs only
/// (the watch holds its image open): its stop ends the watch and syncs
/// once, so a commit the watch had not synced yet reaches the host, and
/// its next start watches again.
#[test]
fn an_auto_commit_sandbox_is_watched_while_it_runs_and_synced_at_its_stop() {
    let env = Env::running("auto", &["--sync-mode", "auto-commit"]);
    let pid = env.agentd_pid();
    wait_for("the workspace watched", Duration::from_secs(10), || {
        common::inotify_watches(pid) > 0
    });
    let synced_before = env.status("auto")["last_sync_at"].clone();
    env.ok(&["stop", "auto"]);
    wait_for("the sync after the stop", Duration::from_secs(10), || {
        env.status("auto")["last_sync_at"] != synced_before
    });
    wait_for("the watch ended", Duration::from_secs(10), || {
        common::inotify_watches(pid) == 0
    });
    if common::is_root() {
        wait_unmounted(&env.state_dir.join("sandboxes/auto"));
    }

    env.ok(&["start", "auto"]);
    let repo = env.repo("auto");
    let head = env.ok(&[
        "exec",
        "auto",
        "--",
        "sh",
        "-c",
        "git -c user.name=A -c user.email=a@b commit -q --allow-empty -m again && git rev-parse HEAD",
    ]);
    let head = head.trim().to_owned();
    wait_for("the commit on the host", Duration::from_secs(20), || {
        common::host_ref(&repo, "refs/remotes/sandbox/auto/main").as_deref() == Some(head.as_str())
    });
}

/// An `auto-idle` sandbox stopped before its quiet time is over: the
/// snapshot of its uncommitted work that was due is taken at the stop
/// (its watch asks for what was due as it ends), and reaches the host.
#[test]
fn an_auto_idle_sandbox_stopped_early_keeps_its_uncommitted_work() {
    let env = Env::new();
    let repo = env.repo("idle");
    env.ok(&["create", "--sync-mode", "auto-idle", repo.to_str().unwrap()]);
    env.ok(&["set", "idle", "--sync-idle-seconds", "600"]);
    env.ok(&["start", "idle"]);
    // Watched (its start applied the mode) before the edit.
    let pid = env.agentd_pid();
    wait_for("the workspace watched", Duration::from_secs(10), || {
        common::inotify_watches(pid) > 0
    });
    env.sh("idle", "echo draft > /workspace/draft.txt");
    std::thread::sleep(Duration::from_millis(300));
    assert!(common::host_ref(&repo, "refs/remotes/sandbox/idle/wip/main").is_none());
    env.ok(&["stop", "idle"]);
    wait_for("the snapshot on the host", Duration::from_secs(20), || {
        common::host_ref(&repo, "refs/remotes/sandbox/idle/wip/main").is_some()
    });
    assert_eq!(
        common::git(&repo, &["show", "sandbox/idle/wip/main:draft.txt"]),
        "draft\n"
    );
}

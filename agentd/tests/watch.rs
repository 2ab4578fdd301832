//! The workspace watcher against a hostile sandbox: symlinks the sandbox
//! plants are never followed into the host, and one sandbox gets a bounded
//! number of inotify watches. Each test runs the attack inside a real
//! sandbox and then looks at agentd from the host (its inotify watches in
//! `/proc/<pid>/fdinfo`, its sync status).

mod common;

use std::fs;
use std::path::Path;
use std::time::Duration;

use common::{Env, host_ref, inotify_watches, wait_for};

/// A host-only tree of `n` × 2 directories the sandbox cannot see.
fn host_tree(env: &Env, n: usize) -> std::path::PathBuf {
    let host = env.tmp.path().join("host-only");
    for i in 0..n {
        fs::create_dir_all(host.join(format!("d{i}/sub"))).unwrap();
    }
    host
}

/// Real directories (symlinks not followed) under and including `dir`.
fn real_dirs(dir: &Path) -> usize {
    let Ok(meta) = fs::symlink_metadata(dir) else {
        return 0;
    };
    if !meta.is_dir() {
        return 0;
    }
    1 + fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| real_dirs(&e.path())).sum())
        .unwrap_or(0)
}

#[test]
fn a_refs_symlink_planted_by_the_sandbox_is_not_followed() {
    let env = Env::running("wr", &[]);
    let repo = env.tmp.path().join("wr");
    let host = host_tree(&env, 300);
    let head = env.ok(&["exec", "wr", "--", "git", "rev-parse", "HEAD"]);
    // The attack: .git/refs becomes a symlink whose target names a host
    // directory (the sandbox cannot see it; agentd on the host would).
    env.ok(&[
        "exec",
        "wr",
        "--",
        "sh",
        "-c",
        &format!(
            "rm -rf /workspace/.git/refs && ln -s {} /workspace/.git/refs",
            host.display()
        ),
    ]);
    // The owner turns automatic sync on: agentd arms its watcher now.
    env.ok(&["set", "wr", "--sync-mode", "auto-commit"]);
    let watches = inotify_watches(env.agentd_pid());
    eprintln!("watches held by agentd after the planted symlink: {watches}");
    assert!(
        watches <= 4,
        "agentd holds {watches} inotify watches: it followed .git/refs into the host ({} directories there)",
        real_dirs(&host)
    );
    // Changes in the host tree start no sync.
    fs::create_dir(host.join("d0/new")).unwrap();
    fs::write(host.join("d1/sub/file"), "x").unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let st = env.status("wr");
    assert!(st["last_sync_at"].is_null(), "a host change synced: {st}");
    assert!(
        env.log()
            .contains("not a directory of the workspace; not watched"),
        "no warning about the symlink:\n{}",
        env.log()
    );
    // A real .git/refs again is watched again: the next commit syncs.
    let new_head = env.ok(&[
        "exec",
        "wr",
        "--",
        "sh",
        "-c",
        &format!(
            "rm /workspace/.git/refs && mkdir -p /workspace/.git/refs/heads /workspace/.git/refs/tags \
             && git update-ref refs/heads/main {} \
             && git -c user.name=A -c user.email=a@example.com commit -q --allow-empty -m back \
             && git rev-parse HEAD",
            head.trim()
        ),
    ]);
    wait_for("the commit on the host", Duration::from_secs(20), || {
        host_ref(&repo, "refs/remotes/sandbox/wr/main").as_deref() == Some(new_head.trim())
    });
    // Turning automatic sync off gives every watch back.
    env.ok(&["set", "wr", "--sync-mode", "manual"]);
    wait_for("the watches to be released", Duration::from_secs(5), || {
        inotify_watches(env.agentd_pid()) == 0
    });
}

#[test]
fn a_directory_swapped_for_a_symlink_is_not_followed() {
    let env = Env::running("ws", &["--sync-mode", "auto-idle"]);
    let host = host_tree(&env, 300);
    // The attack: directories appear (agentd is told, and goes to watch
    // them) and are swapped for symlinks to the host before it gets there.
    env.ok(&[
        "exec",
        "ws",
        "--",
        "perl",
        "-e",
        "my $t = shift; for my $i (1..200) { mkdir \"/workspace/d$i\"; rmdir \"/workspace/d$i\"; \
         symlink $t, \"/workspace/d$i\" }",
        host.to_str().unwrap(),
    ]);
    std::thread::sleep(Duration::from_millis(500));
    let watches = inotify_watches(env.agentd_pid());
    let workspace = env.state_dir.join("sandboxes/ws/workspace");
    let real = real_dirs(&workspace);
    eprintln!(
        "watches held by agentd after the swapped directories: {watches} ({real} real directories in the workspace)"
    );
    assert!(
        watches <= real,
        "agentd holds {watches} inotify watches for a workspace of {real} directories: it followed a symlink"
    );
}

#[test]
fn one_sandbox_gets_a_bounded_number_of_watches() {
    let env = Env::running("wc", &["--sync-mode", "auto-idle"]);
    env.ok(&[
        "exec",
        "wc",
        "--",
        "sh",
        "-c",
        "mkdir /workspace/many && cd /workspace/many && seq 1 9000 | xargs mkdir",
    ]);
    wait_for(
        "the watch limit in the sync status",
        Duration::from_secs(20),
        || {
            env.status("wc")["last_sync_result"]
                .as_str()
                .is_some_and(|s| s.contains("watch limit"))
        },
    );
    let watches = inotify_watches(env.agentd_pid());
    eprintln!("watches held by agentd after 9000 directories: {watches}");
    assert!(watches <= 8192, "{watches} watches");
    assert_eq!(
        env.log().matches("watch limit reached").count(),
        1,
        "one warning"
    );
}

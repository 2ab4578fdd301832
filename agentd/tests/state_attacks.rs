//! Pause, snapshots, restore and fork under attack: a sandbox that plants
//! symlinks, setuid files, FIFOs and sockets and floods its refs; another
//! user and hostile D-Bus arguments; agentd killed while a sandbox is
//! frozen for a copy. Each test asserts the host's state: files outside the
//! sandbox, what another uid sees, the quota, agentd alive and bounded.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{Env, json};

const NOBODY: u32 = 65534;

/// A commit id nobody's repository has.
const FOREIGN_OID: &str = "1234567890abcdef1234567890abcdef12345678";

fn lchown_tree(root: &Path, uid: u32) {
    let mut stack = vec![root.to_owned()];
    while let Some(p) = stack.pop() {
        std::os::unix::fs::lchown(&p, Some(uid), Some(uid)).unwrap();
        if p.is_dir() && !p.is_symlink() {
            stack.extend(std::fs::read_dir(&p).unwrap().flatten().map(|e| e.path()));
        }
    }
}

/// agentctl as `uid`: (success, stdout + stderr).
fn ctl(env: &Env, uid: Option<u32>, args: &[&str]) -> (bool, String) {
    let out = env.ctl_as(uid, args);
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn ok_as(env: &Env, uid: Option<u32>, args: &[&str]) -> String {
    let (ok, out) = ctl(env, uid, args);
    assert!(
        ok,
        "{args:?} failed: {out}\n--- agentd log ---\n{}",
        env.log()
    );
    out
}

/// A repository of another person's on the host, root's alone (0700):
/// `<tmp>/victim` with a branch in `packed-refs`, a loose branch and a file.
fn victim(env: &Env) -> PathBuf {
    let dir = env.tmp.path().join("victim");
    let git = dir.join(".git");
    std::fs::create_dir_all(git.join("refs/heads")).unwrap();
    std::fs::write(
        git.join("packed-refs"),
        format!("{FOREIGN_OID} refs/heads/victim-packed-secret\n"),
    )
    .unwrap();
    std::fs::write(
        git.join("refs/heads/victim-loose-secret"),
        format!("{FOREIGN_OID}\n"),
    )
    .unwrap();
    std::fs::write(dir.join("host.txt"), "the host's\n").unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    dir
}

fn fd_count(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(Iterator::count)
        .unwrap_or(0)
}

fn rss_kib(pid: i32) -> u64 {
    common::proc_status(pid, "VmRSS")
        .trim_end_matches(" kB")
        .trim()
        .parse()
        .unwrap_or(0)
}

/// Bytes the files under `dir` take on disk, each inode once.
fn disk_bytes(dir: &Path) -> u64 {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0;
    let mut stack = vec![dir.to_owned()];
    while let Some(p) = stack.pop() {
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if seen.insert(m.ino()) {
            total += m.blocks() * 512;
        }
        if m.is_dir() {
            stack.extend(std::fs::read_dir(&p).unwrap().flatten().map(|e| e.path()));
        }
    }
    total
}

/// Another user's sandbox plants links to a repository and a file of the
/// host's (root's alone) where agentd, as root, reads the snapshot's
/// branches and prepares a fork; and setuid files, a FIFO and a socket.
/// The snapshot names no branch of the host's, the host's file is
/// unchanged, and the fork's copy is its own (no setuid bit, its uid).
#[test]
fn a_snapshot_and_a_fork_read_and_write_nothing_outside_the_sandbox() {
    if !common::is_root() {
        eprintln!("skipped: needs root to act as another uid");
        return;
    }
    let env = Env::new();
    let victim = victim(&env);
    let host_file = victim.join("host.txt");
    let before = std::fs::metadata(&host_file).unwrap();
    let repo = env.repo("theirs");
    lchown_tree(&repo, NOBODY);
    ok_as(&env, Some(NOBODY), &["create", repo.to_str().unwrap()]);
    ok_as(&env, Some(NOBODY), &["start", "theirs"]);
    let git = victim.join(".git");
    let plant = format!(
        "cd /workspace && echo mine > mine.txt && \
         cp /bin/sh suid && chmod 6755 suid && mkfifo fifo && \
         (python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"sock\")' 2>/dev/null || true) && \
         for f in .gitconfig .bashrc .profile .config; do rm -rf ~/$f; ln -s {h} ~/$f; done && \
         ln -s {h} host-link && mv .git .git.real && ln -s {g} .git",
        h = host_file.display(),
        g = git.display(),
    );
    ok_as(
        &env,
        Some(NOBODY),
        &["exec", "theirs", "--", "sh", "-c", &plant],
    );

    // `.git` a link to the host's repository.
    let out = ok_as(&env, Some(NOBODY), &["snapshot", "theirs", "--json"]);
    assert!(!out.contains("victim"), "a host's branch leaked: {out}");
    // `.git` real, its `refs` a link to the host's.
    ok_as(
        &env,
        Some(NOBODY),
        &[
            "exec",
            "theirs",
            "--",
            "sh",
            "-c",
            &format!(
                "cd /workspace && rm .git && mv .git.real .git && rm -rf .git/refs && \
                 ln -s {} .git/refs",
                git.join("refs").display()
            ),
        ],
    );
    let snap = ok_as(&env, Some(NOBODY), &["snapshot", "theirs", "--json"]);
    assert!(!snap.contains("victim"), "a host's branch leaked: {snap}");
    let listed = ok_as(&env, Some(NOBODY), &["snapshots", "theirs", "--json"]);
    assert!(!listed.contains("victim"), "{listed}");
    let id = json(&snap)["id"].as_str().unwrap().to_owned();

    // Restored, and forked from the snapshot and from its files now; the
    // fork started (its home prepared by root).
    ok_as(&env, Some(NOBODY), &["restore", "theirs", &id]);
    ok_as(&env, Some(NOBODY), &["fork", "theirs", "f1", "--from", &id]);
    ok_as(&env, Some(NOBODY), &["fork", "theirs", "f2"]);
    for fork in ["f1", "f2"] {
        let (started, out) = ctl(&env, Some(NOBODY), &["start", fork]);
        assert!(
            started || !out.contains("panicked"),
            "{fork} failed oddly: {out}"
        );
        let ws = env.state_dir.join("sandboxes").join(fork).join("workspace");
        let suid = std::fs::symlink_metadata(ws.join("suid")).unwrap();
        let mine = std::fs::symlink_metadata(ws.join("mine.txt")).unwrap();
        assert_eq!(suid.mode() & 0o6000, 0, "{fork} kept a setuid bit");
        assert_eq!(suid.uid(), mine.uid());
        assert_ne!(mine.uid(), 0, "{fork}'s files are root's");
        assert!(
            std::fs::symlink_metadata(ws.join("host-link"))
                .unwrap()
                .is_symlink()
        );
    }
    // The host's file: as it was.
    let after = std::fs::metadata(&host_file).unwrap();
    assert_eq!(std::fs::read_to_string(&host_file).unwrap(), "the host's\n");
    assert_eq!(
        (after.uid(), after.gid(), after.mode()),
        (before.uid(), before.gid(), before.mode())
    );
    // The snapshots are agentd's alone.
    let mode = std::fs::metadata(env.state_dir.join("snapshots/theirs"))
        .unwrap()
        .mode();
    assert_eq!(mode & 0o077, 0, "{mode:o}");
}

/// A sandbox floods its refs (thousands of branches of 230 characters) so that a snapshot's description would be too large to
/// read back: unlisted, such snapshots would count nothing against the
/// quota. Every snapshot on disk is listed and counted, the quota holds,
/// and agentd's descriptors and memory stay bounded through refusals.
#[test]
fn a_flood_of_branches_hides_no_snapshot_from_the_quota() {
    let env = Env::with_config(&serde_json::json!({"defaults": {"snapshot_quota": 48}}));
    env.create_running("fl", &[]);
    env.sh(
        "fl",
        "cd /workspace && oid=$(git rev-parse HEAD) && long=$(printf 'b%.0s' $(seq 1 230)) && \
         echo \"$oid refs/heads/a-packed\" >> .git/packed-refs && \
         i=0; while [ $i -lt 4500 ]; do echo $oid > .git/refs/heads/$long$i; i=$((i+1)); done && \
         head -c 10000000 /dev/urandom > big",
    );
    let pid = env.agentd_pid();
    let mut taken = 0;
    let mut refused = 0;
    let (mut fds, mut rss) = (0, 0);
    let mut named = serde_json::Map::new();
    for round in 0..12 {
        let (ok, out) = ctl(&env, None, &["snapshot", "fl", "--json"]);
        if ok {
            taken += 1;
            named = json(&out)["branches"].as_object().unwrap().clone();
        } else {
            refused += 1;
            assert!(out.contains("quota"), "{out}");
        }
        if round == 2 {
            (fds, rss) = (fd_count(pid), rss_kib(pid));
        }
    }
    assert!(
        taken >= 1 && refused >= 1,
        "{taken} taken, {refused} refused"
    );
    let dir = env.state_dir.join("snapshots/fl");
    let on_disk = std::fs::read_dir(&dir).unwrap().count();
    let listed = json(&env.ok(&["snapshots", "fl", "--json"]))
        .as_array()
        .unwrap()
        .len();
    assert_eq!(on_disk, listed, "snapshots on disk that are not listed");
    let used = disk_bytes(&dir);
    assert!(
        used <= 49 << 20,
        "{used} bytes of snapshots for a quota of 48 MiB"
    );
    // The description names a bounded number of branches, packed ones too.
    assert!(named.len() <= 1000, "{} branches named", named.len());
    assert!(named.contains_key("a-packed"), "a packed branch is missing");
    // agentd alive, its descriptors and memory not growing with refusals.
    assert!(env.state("fl") == "running");
    assert!(fd_count(pid) <= fds + 4, "{fds} -> {} fds", fd_count(pid));
    assert!(
        rss_kib(pid) < rss + 64 * 1024,
        "{rss} -> {} KiB",
        rss_kib(pid)
    );
}

/// The v1 freezer state file of sandbox `name`'s group, found from the
/// cgroup of one of its processes.
fn freezer_state(env: &Env, name: &str) -> Option<PathBuf> {
    let group = format!("/sandbox-{name}");
    env.sandbox_pids().into_iter().find_map(|pid| {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        let path = text.lines().find_map(|l| {
            let (_, rest) = l.split_once(':')?;
            let (ctl, path) = rest.split_once(':')?;
            (ctl == "freezer" && path.ends_with(&group)).then(|| path.to_owned())
        })?;
        Some(PathBuf::from(format!(
            "/sys/fs/cgroup/freezer{path}/freezer.state"
        )))
    })
}

/// Thaws the group when dropped, so that a failed test leaves no frozen
/// processes the environment cannot kill.
struct Thaw(PathBuf);

impl Drop for Thaw {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, "THAWED");
    }
}

/// agentd dies (kill -9) while a running sandbox is frozen for a
/// snapshot's copy, and starts again: the sandbox must not be left frozen
/// while it says it runs (its agents hung, every exec timing out). It is
/// either thawed or shown paused, and the half-made snapshot is gone.
#[test]
fn agentd_killed_during_a_snapshot_leaves_no_sandbox_frozen_and_running() {
    let freezer = Path::new("/sys/fs/cgroup/freezer/cgroup.procs");
    if !common::is_root() || !freezer.exists() {
        eprintln!("skipped: needs root and a cgroup v1 freezer");
        return;
    }
    let mut env = Env::running("fz", &[]);
    let Some(state) = freezer_state(&env, "fz") else {
        panic!("no freezer group for fz: {:?}", env.sandbox_pids());
    };
    let _thaw = Thaw(state.clone());
    // Enough to copy for a few seconds, and a process that counts.
    env.sh("fz", "head -c 800000000 /dev/urandom > /workspace/big");
    env.sh(
        "fz",
        "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /workspace/.n; sleep 0.05; done' \
         </dev/null >/dev/null 2>&1 &",
    );
    let n = env.state_dir.join("sandboxes/fz/workspace/.n");
    let count = || -> u64 {
        std::fs::read_to_string(&n)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    common::wait_for("the counter to start", Duration::from_secs(10), || {
        count() > 0
    });
    let mut snap = env
        .ctl_cmd(&["snapshot", "fz"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    common::wait_for("the copy to freeze fz", Duration::from_secs(20), || {
        std::fs::read_to_string(&state).is_ok_and(|s| s.trim() == "FROZEN")
    });
    env.kill_agentd();
    let _ = snap.kill();
    let _ = snap.wait();
    env.start_agentd();

    let shown = env.state("fz");
    if shown != "paused" {
        let at = count();
        common::wait_for(
            "fz, shown running, to run again",
            Duration::from_secs(10),
            || count() > at,
        );
    }
    let dir = env.state_dir.join("snapshots/fz");
    let left: Vec<_> = std::fs::read_dir(&dir)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left after the crash: {left:?}");
}

/// Another user, with a sandbox of their own, aims hostile ids and names
/// at root's sandbox and its snapshots: paths (`../rs/ID`), huge strings,
/// control characters, the other sandbox's name for a fork. Nothing of
/// root's is read, restored, removed or overwritten, and agentd lives.
#[test]
fn hostile_ids_and_another_users_calls_touch_no_other_snapshot() {
    if !common::is_root() {
        eprintln!("skipped: needs root to act as another uid");
        return;
    }
    let env = Env::running("rs", &[]);
    env.sh("rs", "echo root-secret > /workspace/secret");
    let id = json(&env.ok(&["snapshot", "rs", "--json"]))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let repo = env.repo("ns");
    lchown_tree(&repo, NOBODY);
    ok_as(&env, Some(NOBODY), &["create", repo.to_str().unwrap()]);
    let cross = format!("../rs/{id}");
    let huge = "x".repeat(100_000);
    let attempts: Vec<Vec<&str>> = vec![
        vec!["restore", "ns", &cross],
        vec!["restore", "ns", ".."],
        vec!["restore", "ns", &huge],
        vec!["fork", "ns", "stolen", "--from", &cross],
        vec!["fork", "ns", "../rs"],
        vec!["fork", "ns", "rs"],
        vec!["fork", "ns", "b1", "--branch", "../../x"],
        vec!["snapshot", "rm", "ns", &cross],
        vec!["snapshot", "rm", "ns", "."],
        vec!["snapshot", "ns", "--label", &huge],
        vec!["snapshots", "rs"],
        vec!["restore", "rs", &id],
        vec!["snapshot", "rm", "rs", &id],
        vec!["fork", "rs", "mine"],
        vec!["fork", "rs", "mine2", "--from", &id],
        vec!["pause", "rs"],
    ];
    for args in &attempts {
        let (ok, out) = ctl(&env, Some(NOBODY), args);
        let shown: Vec<_> = args.iter().map(|a| &a[..a.len().min(40)]).collect();
        assert!(!ok, "{shown:?} as nobody succeeded: {out}");
        assert!(!out.contains("root-secret"), "{shown:?}: {out}");
    }
    // A label's control characters are dropped; the snapshot is theirs.
    let theirs = ok_as(
        &env,
        Some(NOBODY),
        &["snapshot", "ns", "--label", "a\u{1b}[2Jb\nc", "--json"],
    );
    assert_eq!(json(&theirs)["label"], "a[2Jbc", "{theirs}");
    // Root's sandbox and snapshot: as they were, and restorable.
    let names: Vec<String> = env
        .list()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert_eq!(env.state("rs"), "running");
    let snap = env.state_dir.join("snapshots/rs").join(&id);
    assert_eq!(
        std::fs::read_to_string(snap.join("workspace/secret")).unwrap(),
        "root-secret\n"
    );
    env.sh("rs", "echo changed > /workspace/secret");
    env.ok(&["restore", "rs", &id]);
    assert_eq!(env.sh("rs", "cat /workspace/secret"), "root-secret\n");
    assert!(
        !env.state_dir
            .join("snapshots/ns")
            .join("..")
            .join("stolen")
            .exists()
    );
}

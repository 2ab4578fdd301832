//! A `vm` sandbox whose workspace is a disk of its own (`vm.share =
//! "disk"`): nothing of the host's directory is shared with the guest, and
//! agentd reaches the workspace through the guest — the git directory home
//! at sync, the host's branches in, worktrees made inside — as it reaches a
//! Pod's. The disk goes with snapshots, restores and forks; a fork's guest
//! takes the copied files as its own.
//!
//! Boots VMs: `#[ignore]`d in the fast suite, run by `tests/run-vm.sh`.

mod common;

use common::vm::{create_vm, env_with, identity, image};
use common::{Env, git, json};

fn snapshot(env: &Env, name: &str) -> String {
    json(&env.ok(&["snapshot", name, "--json"]))["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[test]
#[ignore = "boots real VMs: run tests/run-vm.sh"]
fn a_vm_workspace_on_a_disk_of_its_own_is_reached_through_the_guest() {
    let env = env_with(&image(), serde_json::json!({"vm": {"share": "disk"}}));
    create_vm(&env, "vd", "none");
    env.ok(&["start", "vd"]);
    let limits = env.status("vd")["limits"].as_str().unwrap().to_owned();
    assert!(limits.contains("workspace over disk"), "{limits}");
    assert!(
        limits.contains("started from the boot snapshot"),
        "a workspace disk keeps the fast start: {limits}"
    );
    let dir = env.state_dir.join("sandboxes/vd");
    let qemu: Vec<String> = env
        .vm_processes()
        .into_iter()
        .map(|(_, c)| c)
        .filter(|c| c.contains("qemu-system"))
        .collect();
    assert_eq!(qemu.len(), 1, "{qemu:#?}");
    assert!(
        !qemu[0].contains("mount_tag=workspace") && qemu[0].contains("drive=workspace"),
        "the workspace is a disk, not a share: {}",
        qemu[0]
    );

    // Inside: an ext4 disk with the project, the agent's own.
    let out = env.sh(
        "vd",
        "findmnt -n -o SOURCE,FSTYPE /workspace; stat -c %u README.md; id -u; git status --short --branch",
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "/dev/vdc ext4", "{out}");
    assert_eq!(lines[1], lines[2], "the files are the agent's: {out}");
    assert!(lines[3].starts_with("## main"), "{out}");
    assert_eq!(lines.len(), 4, "a clean checkout: {out}");

    // No share at all: the toolbox is a read-only disk, agentd's tools
    // were copied in; the pinned agents run.
    let v = agentd::toolbox::Versions::default();
    let out = env.sh(
        "vd",
        "grep -c ' 9p ' /proc/mounts; findmnt -n -o SOURCE,OPTIONS /opt/keystone/agents | cut -d, -f1; \
         command -v claude; claude --version",
    );
    assert_eq!(
        out,
        format!(
            "0\n/dev/vdd ro\n/run/keystone/bin/claude\n{} (Claude Code)\n",
            v.claude
        ),
        "(the toolbox comes from the cache: agentd --install-agents)"
    );
    // A secret's CA reaches the running guest (copied in, not shared).
    env.set_secret("vd", "API_KEY", "api.example.com", "x-api-key", b"sk-disk");
    common::wait_for(
        "the CA in the guest",
        std::time::Duration::from_secs(60),
        || {
            env.inside("vd", "grep -q 'BEGIN CERTIFICATE' \"$NODE_EXTRA_CA_CERTS\"")
                .0
                == 0
        },
    );

    // What the guest writes stays in the guest; a commit comes home with
    // sync (the git directory copied out through the guest).
    env.sh(
        "vd",
        "echo inside > inside.txt && git add inside.txt && \
         git -c user.name=Agent -c user.email=agent@example.com commit -qm 'on the disk'",
    );
    assert!(!dir.join("workspace/inside.txt").exists());
    env.ok(&["sync", "vd"]);
    let repo = env.tmp.path().join("vd");
    assert_eq!(
        git(&repo, &["log", "-1", "--format=%s", "sandbox/vd/main"]).trim(),
        "on the disk"
    );

    // The host's branches go in with `sync --from-host`.
    std::fs::write(repo.join("host.txt"), "h\n").unwrap();
    git(&repo, &["add", "host.txt"]);
    common::commit(&repo, "host work");
    env.ok(&["sync", "vd", "--from-host"]);
    assert_eq!(
        env.sh("vd", "git show -s --format=%s host/main"),
        "host work\n"
    );

    // A worktree, made by git in the guest.
    env.ok(&["worktree", "add", "vd", "feat"]);
    let listed = json(&env.ok(&["worktree", "list", "vd", "--json"]));
    assert!(
        listed
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["branch"] == "feat" && w["path"] == "/workspace/.worktrees/feat"),
        "{listed}"
    );
    assert_eq!(
        env.sh("vd", "git -C .worktrees/feat rev-parse --abbrev-ref HEAD"),
        "feat\n"
    );

    // A snapshot holds the disk: a file written after it is gone after
    // the restore, one written before is there.
    let id = snapshot(&env, "vd");
    assert!(
        env.state_dir
            .join("snapshots/vd")
            .join(&id)
            .join("workspace.img")
            .is_file()
    );
    env.sh("vd", "echo later > later.txt && sync");
    env.ok(&["restore", "vd", &id]);
    assert_eq!(env.state("vd"), "running");
    assert_eq!(
        env.sh(
            "vd",
            "cat inside.txt; test -e later.txt && echo later; true"
        ),
        "inside\n"
    );

    // A fork: a disk of its own, its files its own uid's inside, its work
    // synced to its own namespace.
    env.ok(&["fork", "vd", "vf"]);
    env.ok(&["start", "vf"]);
    let out = env.sh(
        "vf",
        "cat inside.txt; [ \"$(stat -c %u inside.txt)\" = \"$(id -u)\" ] && echo mine; \
         echo fork > fork.txt && git add fork.txt && \
         git -c user.name=Agent -c user.email=agent@example.com commit -qm 'in the fork' && echo committed",
    );
    assert_eq!(out, "inside\nmine\ncommitted\n");
    env.ok(&["sync", "vf"]);
    assert_eq!(
        git(&repo, &["log", "-1", "--format=%s", "sandbox/vf/main"]).trim(),
        "in the fork"
    );
    assert_eq!(
        env.sh("vd", "test -e fork.txt && echo shared; true"),
        "",
        "the fork wrote into its source's disk"
    );

    // Stopped, its branches are inside: a sync from the host is refused.
    env.ok(&["stop", "vd"]);
    let refused = env.fails(2, &["sync", "vd", "--from-host"]);
    assert!(refused.contains("start it first"), "{refused}");
    env.ok(&["stop", "vf"]);
    for name in ["vf", "vd"] {
        env.ok(&["destroy", name]);
    }
}

/// The saved states agentd holds for sandboxes that share them with a
/// snapshot.
fn held(env: &Env) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(env.state_dir.join("held"))
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default()
}

/// A file's device and inode.
fn inode(path: &std::path::Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).unwrap();
    (m.dev(), m.ino())
}

/// The counter's value in the guest (a process that counts in memory and
/// writes each value to /tmp, which is memory too).
fn count(env: &Env, name: &str) -> u64 {
    env.sh(name, "cat /tmp/count").trim().parse().unwrap()
}

#[test]
#[ignore = "boots real VMs: run tests/run-vm.sh"]
fn a_snapshot_keeps_a_disk_guest_s_memory_and_its_restore_brings_the_processes_back() {
    let env = env_with(&image(), serde_json::json!({"vm": {"share": "disk"}}));
    create_vm(&env, "vm1", "none");
    env.ok(&["start", "vm1"]);
    env.sh(
        "vm1",
        "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done' \
         </dev/null >/dev/null 2>&1 & echo $! > /tmp/counter.pid",
    );
    common::wait_for("the counter", std::time::Duration::from_secs(30), || {
        env.inside("vm1", "test \"$(cat /tmp/count)\" -ge 5").0 == 0
    });
    let pid = env.sh("vm1", "cat /tmp/counter.pid");
    let before = count(&env, "vm1");
    let snap = json(&env.ok(&["snapshot", "vm1", "--json"]));
    assert_eq!(snap["memory"], true, "{snap}");
    let id = snap["id"].as_str().unwrap().to_owned();
    let dir = env.state_dir.join("snapshots/vm1").join(&id);
    let state = std::fs::metadata(dir.join("memory/state")).unwrap();
    assert!(
        state.len() > 1 << 20,
        "a saved state of {} bytes",
        state.len()
    );
    {
        use std::os::unix::fs::MetadataExt;
        assert_eq!(state.mode() & 0o777, 0o600);
        assert_eq!(state.uid(), nix::unistd::Uid::effective().as_raw());
    }
    // The guest went on after the save.
    let after = count(&env, "vm1");
    assert!(after >= before, "{after} < {before}");
    env.sh("vm1", "echo later > later.txt && sync");

    env.ok(&["restore", "vm1", &id]);
    let limits = env.status("vm1")["limits"].as_str().unwrap().to_owned();
    assert!(limits.contains("restored with its memory"), "{limits}");
    // The same process, counting on from where it was: not started anew.
    let out = env.sh(
        "vm1",
        "p=$(cat /tmp/counter.pid); kill -0 $p && echo $p; test -e later.txt && echo later; true",
    );
    assert_eq!(out, pid, "the counter's process is not the one saved");
    let restored = count(&env, "vm1");
    assert!(restored >= before, "counted anew: {restored} < {before}");
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert!(count(&env, "vm1") > restored, "the counter stopped");
    // The saved memory was loaded once: the sandbox's directory has none.
    assert!(!env.state_dir.join("sandboxes/vm1/memory").exists());
    // Its disks are overlays on the snapshot's, not copies of them.
    for disk in ["home.img", "workspace.img"] {
        let img = env.state_dir.join("sandboxes/vm1").join(disk);
        assert_eq!(&std::fs::read(img).unwrap()[..4], b"QFI\xfb", "{disk}");
    }

    // An idle stop keeps the memory too: the next exec brings the same
    // process back, counting on.
    env.ok(&["set", "vm1", "--idle-stop", "5s"]);
    common::wait_for("the idle stop", std::time::Duration::from_secs(120), || {
        env.state("vm1") == "stopped"
    });
    let why = env.status("vm1")["state_reason"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(why.contains("5 s idle; its memory is kept"), "{why}");
    let saved = std::fs::metadata(env.state_dir.join("sandboxes/vm1/memory/state")).unwrap();
    {
        use std::os::unix::fs::MetadataExt;
        assert_eq!(saved.mode() & 0o777, 0o600);
    }
    let stopped_at = restored;
    let out = env.ctl(&[
        "exec",
        "vm1",
        "--",
        "sh",
        "-c",
        "kill -0 $(cat /tmp/counter.pid) && cat /tmp/counter.pid",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        pid,
        "the counter's process is not the one saved"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("stopped when idle; starting it again where it was"),
        "{out:?}"
    );
    env.ok(&["set", "vm1", "--idle-stop", "0"]);
    let limits = env.status("vm1")["limits"].as_str().unwrap().to_owned();
    assert!(limits.contains("restored with its memory"), "{limits}");
    let woken = count(&env, "vm1");
    assert!(woken >= stopped_at, "counted anew: {woken} < {stopped_at}");
    assert!(!env.state_dir.join("sandboxes/vm1/memory").exists());

    // A fork of the snapshot takes its processes too, with an identity of
    // its own: names, machine id, keys and random state. Its saved state
    // and its disks are the snapshot's, shared, not copies: its disks are
    // overlays on the snapshot's.
    // (vm1's own disks are overlays on it since its restore.)
    let before_fork = held(&env).len();
    env.ok(&["fork", "vm1", "vf", "--from", &id]);
    let shared: Vec<_> = held(&env).iter().map(|p| inode(p)).collect();
    assert_eq!(shared.len(), before_fork + 3, "{shared:?}");
    for f in ["memory/state", "home.img", "workspace.img"] {
        assert!(shared.contains(&inode(&dir.join(f))), "{f} was copied");
    }
    let vf = env.state_dir.join("sandboxes/vf");
    assert!(!vf.join("memory/state").exists());
    for disk in ["home.img", "workspace.img"] {
        assert_eq!(
            &std::fs::read(vf.join(disk)).unwrap()[..4],
            b"QFI\xfb",
            "{disk}"
        );
        let len = std::fs::metadata(vf.join(disk)).unwrap().len();
        assert!(len < 4 << 20, "{disk}: {len} bytes");
    }
    let base_time = std::fs::metadata(dir.join("workspace.img"))
        .unwrap()
        .modified()
        .unwrap();
    env.ok(&["start", "vf"]);
    assert_eq!(
        held(&env).len(),
        before_fork + 2,
        "the state is held after the start"
    );
    let limits = env.status("vf")["limits"].as_str().unwrap().to_owned();
    assert!(
        limits.contains("forked with its parent's memory"),
        "{limits}"
    );
    assert_eq!(env.sh("vf", "cat /tmp/counter.pid"), pid);
    let forked = count(&env, "vf");
    assert!(forked >= before, "counted anew: {forked} < {before}");
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert!(count(&env, "vf") > forked, "the fork's counter stopped");
    let (a, b) = (identity(&env, "vm1"), identity(&env, "vf"));
    assert_eq!((a[1].as_str(), b[1].as_str()), ("vm1", "vf"));
    for i in [0, 2, 3] {
        assert_ne!(a[i], b[i], "line {i} is shared: {a:?} {b:?}");
    }
    // Its host key is the one agentd made and pinned for the fork, or
    // agentd would not have reached it.
    let pinned = |name: &str| {
        std::fs::read_to_string(
            env.state_dir
                .join("sandboxes")
                .join(name)
                .join("client/known_hosts"),
        )
        .unwrap()
    };
    assert_ne!(pinned("vm1"), pinned("vf"));
    // What the fork writes is its own: the snapshot's disk is as it was.
    env.sh("vf", "echo mine > fork.txt && sync");
    assert_eq!(
        std::fs::metadata(dir.join("workspace.img"))
            .unwrap()
            .modified()
            .unwrap(),
        base_time
    );
    // A snapshot of the fork holds whole disks (its overlays flattened by
    // the fork's own uid), and a fork of that has the fork's work.
    let of_fork = json(&env.ok(&["snapshot", "vf", "--json"]));
    let of_fork = of_fork["id"].as_str().unwrap().to_owned();
    let flat = env.state_dir.join("snapshots/vf").join(&of_fork);
    for disk in ["home.img", "workspace.img"] {
        let m = std::fs::metadata(flat.join(disk)).unwrap();
        assert_ne!(
            &std::fs::read(flat.join(disk)).unwrap()[..4],
            b"QFI\xfb",
            "{disk}"
        );
        {
            use std::os::unix::fs::MetadataExt;
            assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o600), "{disk}");
        }
    }
    env.ok(&["fork", "vf", "vk", "--from", &of_fork]);
    env.ok(&["start", "vk"]);
    assert_eq!(env.sh("vk", "cat fork.txt").trim(), "mine");
    env.ok(&["stop", "vk"]);
    env.ok(&["destroy", "vk"]);

    // And a fork of the running guest, at once.
    env.ok(&["fork", "vf", "vg"]);
    env.ok(&["start", "vg"]);
    let limits = env.status("vg")["limits"].as_str().unwrap().to_owned();
    assert!(
        limits.contains("forked with its parent's memory"),
        "{limits}"
    );
    assert_eq!(
        env.sh("vg", "hostname; cat /tmp/counter.pid"),
        format!("vg\n{pid}")
    );
    for name in ["vf", "vg"] {
        env.ok(&["stop", name]);
        env.ok(&["destroy", name]);
    }

    // A snapshot removed before its fork first starts leaves the fork its
    // state; a fork destroyed before its first start lets its share go.
    let second = json(&env.ok(&["snapshot", "vm1", "--json"]));
    let second = second["id"].as_str().unwrap().to_owned();
    assert_eq!(held(&env).len(), before_fork, "{:?}", held(&env));
    env.ok(&["fork", "vm1", "vh", "--from", &second]);
    env.ok(&["fork", "vm1", "vi", "--from", &second]);
    env.ok(&["snapshot", "rm", "vm1", &second]);
    assert_eq!(held(&env).len(), before_fork + 6);
    env.ok(&["destroy", "vi"]);
    assert_eq!(held(&env).len(), before_fork + 3);
    env.ok(&["start", "vh"]);
    let limits = env.status("vh")["limits"].as_str().unwrap().to_owned();
    assert!(
        limits.contains("forked with its parent's memory"),
        "{limits}"
    );
    assert_eq!(env.sh("vh", "cat /tmp/counter.pid"), pid);
    assert_eq!(held(&env).len(), before_fork + 2, "its disks' bases");
    env.ok(&["stop", "vh"]);
    env.ok(&["destroy", "vh"]);
    assert_eq!(held(&env).len(), before_fork, "{:?}", held(&env));

    // A damaged state is not loaded: the guest starts anew from the
    // snapshot's files, and `status` says why.
    std::fs::write(dir.join("memory/state"), b"not a machine").unwrap();
    env.ok(&["restore", "vm1", &id]);
    let limits = env.status("vm1")["limits"].as_str().unwrap().to_owned();
    assert!(
        limits.contains("its saved memory was not restored"),
        "{limits}"
    );
    let (code, _) = env.inside("vm1", "test -e /tmp/counter.pid");
    assert_ne!(code, 0, "a started guest has the old one's memory");
    env.ok(&["stop", "vm1"]);
    env.ok(&["destroy", "vm1"]);
}

//! The sandbox lifecycle through the real agentctl and agentd.

mod common;

use std::fs;
use std::time::Duration;

use common::{Env, wait_for};

#[test]
fn full_lifecycle() {
    let env = Env::new();
    let repo = env.repo("My_Project");
    let out = env.ok(&["create", repo.to_str().unwrap()]);
    assert!(out.contains("Created sandbox 'my-project'"), "{out}");

    let list = env.list();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["name"], "my-project");
    assert_eq!(list[0]["state"], "created");
    assert_eq!(
        list[0]["project_path"],
        fs::canonicalize(&repo).unwrap().to_str().unwrap()
    );
    let table = env.ok(&["list"]);
    assert!(table.starts_with("NAME"), "{table}");
    assert!(table.contains("my-project  created"), "{table}");

    env.ok(&["start", "my-project"]);
    let st = env.status("my-project");
    assert_eq!(st["state"], "running");
    assert!(st["started_at"].is_string());
    assert_eq!(st["config"]["memory"], 8192);

    // Inside: hostname, cwd, the clone, git, stdout and stderr kept apart.
    let out = env.ok(&[
        "exec",
        "my-project",
        "--",
        "sh",
        "-c",
        "hostname; pwd; cat README.md; echo oops >&2",
    ]);
    assert_eq!(out, "my-project\n/workspace\n# My_Project\n");
    let out = env.ctl(&[
        "exec",
        "my-project",
        "--",
        "git",
        "status",
        "--short",
        "--branch",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("## main"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // The command's exit code is agentctl's; env and workdir pass through.
    let out = env.ctl(&[
        "exec",
        "my-project",
        "-e",
        "X=42",
        "-w",
        "/tmp",
        "--",
        "sh",
        "-c",
        "echo $X $PWD; exit 7",
    ]);
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "42 /tmp\n");
    // A timeout is its own error (exit 3) and kills the command.
    let err = env.fails(
        3,
        &["exec", "my-project", "--timeout", "1", "--", "sleep", "30"],
    );
    assert!(err.contains("did not finish within 1s"), "{err}");
    // A missing program is a clear failure, not a hang.
    let err = env.fails(3, &["exec", "my-project", "--", "no-such-program"]);
    assert!(err.contains("not found"), "{err}");

    // Stop ends every process, including background ones.
    env.ok(&[
        "exec",
        "my-project",
        "--",
        "sh",
        "-c",
        "sleep 1000 >/dev/null 2>&1 &",
    ]);
    let ns = env.registry()["sandboxes"][0]["runtime"]["pid_ns"]
        .as_u64()
        .unwrap();
    assert!(
        agentd::procfs::pids_in_ns(ns).len() >= 3,
        "init, control server and sleep"
    );
    env.ok(&["stop", "my-project"]);
    assert_eq!(env.state("my-project"), "stopped");
    assert!(agentd::procfs::pids_in_ns(ns).is_empty());
    assert!(env.sandbox_pids().is_empty());

    // Restart keeps the workspace.
    env.ok(&["start", "my-project"]);
    env.ok(&[
        "exec",
        "my-project",
        "--",
        "sh",
        "-c",
        "echo kept > note.txt",
    ]);
    env.ok(&["stop", "my-project", "--force"]);
    env.ok(&["start", "my-project"]);
    assert_eq!(
        env.ok(&["exec", "my-project", "--", "cat", "note.txt"]),
        "kept\n"
    );
    env.ok(&["stop", "my-project"]);

    env.ok(&["destroy", "my-project"]);
    assert!(env.list().is_empty());
    assert!(!env.state_dir.join("sandboxes/my-project").exists());
    assert!(env.sandbox_pids().is_empty());
    // The host repository was never touched.
    assert!(!repo.join("note.txt").exists());
}

#[test]
fn invalid_transitions_change_nothing() {
    let env = Env::new();
    let repo = env.repo("p");
    env.ok(&["create", "--name", "t1", repo.to_str().unwrap()]);
    let before = env.registry();
    for args in [&["stop", "t1"][..], &["exec", "t1", "--", "true"]] {
        let err = env.fails(2, args);
        assert!(err.contains("it is created"), "{err}");
    }
    assert_eq!(env.registry(), before);

    env.ok(&["start", "t1"]);
    let running = env.registry();
    let err = env.fails(2, &["start", "t1"]);
    assert!(
        err.contains("Cannot start sandbox 't1': it is running"),
        "{err}"
    );
    let err = env.fails(2, &["destroy", "--force", "t1"]);
    assert!(err.contains("stop it first"), "{err}");
    assert_eq!(env.registry(), running);
    assert_eq!(env.state("t1"), "running");

    env.ok(&["stop", "t1"]);
    env.fails(2, &["stop", "t1"]);
    assert_eq!(env.state("t1"), "stopped");
    // (start, stop and destroy call the object the name gives directly;
    // where none is, the answer is still GetSandbox's.)
    for args in [
        &["start", "no-such-sandbox"][..],
        &["stop", "no-such-sandbox"],
        &["destroy", "--force", "no-such-sandbox"],
        &["status", "no-such-sandbox"],
    ] {
        let err = env.fails(1, args);
        assert!(
            err.contains("No sandbox named 'no-such-sandbox'; `agentctl list` shows yours"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn validation_reports_every_problem_and_creates_nothing() {
    let env = Env::new();
    let not_git = env.tmp.path().join("plain");
    fs::create_dir_all(&not_git).unwrap();
    let err = env.fails(
        4,
        &[
            "create",
            "--name",
            "Bad_Name",
            "--memory",
            "100",
            "--vcpus",
            "0",
            "--disk",
            "1",
            "--pids",
            "3",
            not_git.to_str().unwrap(),
        ],
    );
    for needle in [
        "6 problems",
        "is not a git repository",
        "name 'Bad_Name'",
        "memory 100",
        "vcpus",
        "disk 1 MiB",
        "pids 3",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in {err}");
    }
    let err = env.fails(4, &["create", "/nonexistent/project"]);
    assert!(err.contains("does not exist"), "{err}");
    assert!(env.list().is_empty());
    assert!(
        fs::read_dir(env.state_dir.join("sandboxes"))
            .unwrap()
            .next()
            .is_none()
    );

    let repo = env.repo("dup");
    env.ok(&["create", repo.to_str().unwrap()]);
    let err = env.fails(4, &["create", repo.to_str().unwrap()]);
    assert!(err.contains("already exists"), "{err}");
    assert_eq!(env.list().len(), 1);
}

#[test]
fn network_none_has_only_loopback() {
    let env = Env::new();
    let repo = env.repo("net");
    env.ok(&["create", "--network", "none", repo.to_str().unwrap()]);
    env.ok(&["start", "net"]);
    let dev = env.ok(&["exec", "net", "--", "cat", "/proc/net/dev"]);
    let ifaces: Vec<&str> = dev
        .lines()
        .skip(2)
        .map(|l| l.split(':').next().unwrap().trim())
        .collect();
    assert_eq!(ifaces, ["lo"]);
    let nat = env.ok(&["exec", "net", "--", "cat", "/proc/sys/kernel/hostname"]);
    assert_eq!(nat, "net\n");
}

#[test]
fn sandbox_sees_neither_host_home_nor_writes_host_system() {
    let env = Env::new();
    let repo = env.repo("iso");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "iso"]);
    // The host's temp dir (where the project lives) is not visible.
    let out = env.ctl(&["exec", "iso", "--", "ls", repo.to_str().unwrap()]);
    assert_ne!(out.status.code(), Some(0));
    // System directories are read-only.
    let out = env.ctl(&["exec", "iso", "--", "sh", "-c", "touch /usr/keystone-test"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(!std::path::Path::new("/usr/keystone-test").exists());
    // Host root is never used: root inside maps to an unprivileged host uid.
    env.ok(&[
        "exec",
        "iso",
        "--",
        "sh",
        "-c",
        "sleep 100 >/dev/null 2>&1 &",
    ]);
    let ns = env.registry()["sandboxes"][0]["runtime"]["pid_ns"]
        .as_u64()
        .unwrap();
    wait_for("the sleep", Duration::from_secs(5), || {
        agentd::procfs::pids_in_ns(ns).len() >= 3
    });
    for pid in agentd::procfs::pids_in_ns(ns) {
        let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
        assert!(
            !uid_line.split_whitespace().skip(1).any(|u| u == "0"),
            "pid {pid}: {uid_line}"
        );
    }
}

#[test]
fn descriptors_agentd_inherits_reach_no_sandbox() {
    // A pipe that is not close-on-exec, open while agentd starts.
    let (r, w) = nix::unistd::pipe().unwrap();
    let pipe = format!("pipe:[{}]", nix::sys::stat::fstat(&r).unwrap().st_ino);
    let env = Env::running("fds", &[]);
    drop((r, w));
    let holds = |pid: i32| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .flatten()
            .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy() == pipe))
    };
    assert!(holds(env.agentd_pid()), "agentd did not inherit the pipe");
    let pids = env.sandbox_pids();
    assert!(!pids.is_empty());
    for pid in pids {
        assert!(
            !holds(pid),
            "sandbox process {pid} holds agentd's inherited {pipe}"
        );
    }
}

/// The settings of remote `remote` in `repo`'s own config.
fn remote_settings(repo: &std::path::Path, remote: &str) -> String {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["config", "--local", "--get-regexp"])
        .arg(format!("^remote\\.{}\\.", remote.replace('/', "\\/")))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_forgotten_sandbox_leaves_no_remote_behind() {
    let mut env = Env::new();
    let repo = env.repo("proj");
    let git = |args: &[&str]| common::git(&repo, args);
    for name in ["gone", "kept", "lost"] {
        env.ok(&["create", "--name", name, repo.to_str().unwrap()]);
        env.ok(&["start", name]);
        env.ok(&["exec", name, "--", "git", "branch", "work", "HEAD"]);
        env.ok(&["sync", name]);
        env.ok(&["stop", name]);
        assert!(
            remote_settings(&repo, &format!("sandbox/{name}")).contains("/workspace"),
            "{name}"
        );
    }
    // The person points one remote elsewhere: it is theirs now.
    git(&["remote", "set-url", "sandbox/kept", repo.to_str().unwrap()]);
    let head = git(&["rev-parse", "main"]);

    env.ok(&["destroy", "--force", "gone"]);
    assert_eq!(remote_settings(&repo, "sandbox/gone"), "");
    // Its refs stay, as documented.
    assert_eq!(git(&["rev-parse", "refs/remotes/sandbox/gone/work"]), head);
    env.ok(&["destroy", "--force", "kept"]);
    let kept = remote_settings(&repo, "sandbox/kept");
    assert!(
        kept.contains(&format!("url {}", repo.display())) && kept.contains("fetch "),
        "{kept}"
    );

    // A sandbox whose registry entry is gone (agentd killed, the entry
    // lost): its directory is removed at the next start, and its remote
    // with it.
    env.kill_agentd();
    let mut registry = env.registry();
    registry["sandboxes"]
        .as_array_mut()
        .unwrap()
        .retain(|s| s["name"] != "lost");
    env.write_registry(&registry);
    env.start_agentd();
    assert!(!env.state_dir.join("sandboxes/lost").exists());
    assert_eq!(remote_settings(&repo, "sandbox/lost"), "");
    assert_eq!(git(&["rev-parse", "refs/remotes/sandbox/lost/work"]), head);

    // Every remote left works.
    git(&["fetch", "--all", "-q"]);
}

#[test]
fn destroy_says_which_commits_it_would_lose() {
    let env = Env::new();
    let repo = env.repo("lose");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "lose"]);
    env.sh(
        "lose",
        "set -e; git config --global user.email a@example.com; git config --global user.name A; \
         git commit -q --allow-empty -m m1; git switch -qc feature/x; \
         git commit -q --allow-empty -m x1; git commit -q --allow-empty -m x2; \
         git branch same main~1",
    );
    env.ok(&["stop", "lose"]);
    let t = common::term::Terminal::new(env.tmp.path(), 400, 20, &[]);
    let destroy = format!(
        "{} --bus {} destroy lose; echo code=$?",
        common::agentctl().display(),
        env.address
    );
    t.line(&destroy);
    let screen = t.wait_screen("the prompt", Duration::from_secs(30), |s| {
        s.contains("[y/N]")
    });
    assert!(
        screen.contains(&format!(
            "Sandbox 'lose' has commits that {} does not have: 3 on feature/x, 1 on main.",
            fs::canonicalize(&repo).unwrap().display()
        )) && screen.contains("bring them home first with: agentctl sync lose"),
        "{screen}"
    );
    t.line("n");
    t.wait_screen("the answer", Duration::from_secs(30), |s| {
        s.contains("code=")
    });
    assert_eq!(env.state("lose"), "stopped");
    // The prompt's dry run wrote nothing.
    assert_eq!(
        common::host_ref(&repo, "refs/remotes/sandbox/lose/main"),
        None
    );

    env.ok(&["sync", "lose"]);
    t.line("clear");
    t.line(&destroy);
    let screen = t.wait_screen("the prompt", Duration::from_secs(30), |s| {
        s.contains("[y/N]")
    });
    assert!(
        screen.contains("Every commit of sandbox 'lose' is in") && !screen.contains("commits that"),
        "{screen}"
    );
    t.line("y");
    t.wait_screen("the destroy", Duration::from_secs(30), |s| {
        s.contains("Sandbox 'lose' destroyed.") && s.contains("code=0")
    });
    assert!(env.list().is_empty());
}

/// A sandbox that stalls the count of its commits (a FIFO in place of its
/// tip's object, which blocks whoever opens it) does not keep destroy from
/// asking: the prompt says the count failed, within the call timeout.
#[test]
fn destroy_asks_even_when_the_sandbox_stalls_the_count() {
    let env = Env::new();
    let repo = env.repo("stall");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "stall"]);
    env.sh(
        "stall",
        "set -e; git config --global user.email a@example.com; git config --global user.name A; \
         git commit -q --allow-empty -m m1; o=$(git rev-parse HEAD); \
         p=.git/objects/$(echo $o | cut -c1-2)/$(echo $o | cut -c3-); rm -f $p; mkfifo $p",
    );
    env.ok(&["stop", "stall"]);
    let t = common::term::Terminal::new(env.tmp.path(), 400, 20, &[]);
    t.line(&format!(
        "{} --bus {} --call-timeout 3 destroy stall; echo code=$?",
        common::agentctl().display(),
        env.address
    ));
    let screen = t.wait_screen("the prompt", Duration::from_secs(20), |s| {
        s.contains("[y/N]")
    });
    assert!(
        screen.contains("Cannot tell which commits") && screen.contains("took over 3s"),
        "{screen}"
    );
    t.line("y");
    t.wait_screen("the destroy", Duration::from_secs(30), |s| {
        s.contains("Sandbox 'stall' destroyed.") && s.contains("code=0")
    });
    assert!(env.list().is_empty());
}

/// Sentences that name a sandbox read as written: `sandbox 'NAME'`, never
/// `sandbox 'NAME''s`.
#[test]
fn messages_name_the_sandbox_without_a_doubled_apostrophe() {
    let env = Env::new();
    let repo = env.repo("words");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["egress", "words", "allow", "example.com"]);
    let out = env.ok(&["egress", "words", "remove", "example.com"]);
    assert_eq!(
        out,
        "Took example.com off the allow and deny entries of sandbox 'words'.\n"
    );
    let out = env.ok(&["egress", "words", "log"]);
    assert_eq!(
        out,
        "No connection went through the gateway of sandbox 'words' yet.\n"
    );
}

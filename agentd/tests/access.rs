//! Authorization: a caller only sees and touches their own sandboxes, and
//! only creates sandboxes from repositories they can read.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;

use common::Env;

const NOBODY: u32 = 65534;

#[test]
fn another_uid_is_refused() {
    if !common::is_root() {
        eprintln!("skipped: needs root to run agentctl as another uid");
        return;
    }
    let env = Env::new();
    let repo = env.repo("mine");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "mine"]);

    // nobody sees nothing...
    let out = env.ctl_as(Some(NOBODY), &["list", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "[]");
    // ...and may do nothing to root's sandbox.
    for args in [
        &["status", "mine"][..],
        &["stop", "mine"],
        &["exec", "mine", "--", "true"],
        &["destroy", "--force", "mine"],
    ] {
        let out = env.ctl_as(Some(NOBODY), args);
        assert_eq!(out.status.code(), Some(4), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("belongs to another user"), "{args:?}: {err}");
    }
    // Property reads are checked too.
    let props = std::process::Command::new("busctl")
        .args([
            &format!("--address={}", env.address),
            "get-property",
            "org.keystone.Agent1",
        ])
        .args([
            "/org/keystone/Agent1/sandbox/mine",
            "org.keystone.Agent1.Sandbox",
            "ProjectPath",
        ])
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    assert!(!props.status.success());
    // Nor may it follow the sandbox's egress log, asked as a client would.
    let follow = |uid: Option<u32>| {
        let mut c = std::process::Command::new("busctl");
        c.args([
            &format!("--address={}", env.address),
            "call",
            "org.keystone.Agent1",
            "/org/keystone/Agent1/sandbox/mine",
            "org.keystone.Agent1.Sandbox",
            "FollowEgress",
        ]);
        if let Some(u) = uid {
            c.uid(u).gid(u);
        }
        c.output().unwrap()
    };
    let root = follow(None);
    assert!(
        root.status.success(),
        "the owner's follow: {}",
        String::from_utf8_lossy(&root.stderr)
    );
    let theirs = follow(Some(NOBODY));
    let err = String::from_utf8_lossy(&theirs.stderr);
    assert!(
        !theirs.status.success() && err.contains("belongs to another user"),
        "another user's follow: {err}"
    );
    assert_eq!(env.state("mine"), "running");

    // A repository nobody cannot read is refused, even though agentd could.
    fs::set_permissions(&repo, fs::Permissions::from_mode(0o700)).unwrap();
    let out = env.ctl_as(
        Some(NOBODY),
        &["create", "--name", "stolen", repo.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(4));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not readable by you"), "{err}");

    // A repository nobody can read works, and root sees both sandboxes.
    let public = env.repo("public");
    let out = env.ctl_as(Some(NOBODY), &["create", public.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let names: Vec<String> = env
        .list()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["mine", "public"]);
    let out = env.ctl_as(Some(NOBODY), &["list", "--json"]);
    let theirs: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(theirs.len(), 1);
    assert_eq!(theirs[0]["owner"], NOBODY);
}

use std::os::unix::process::CommandExt;

/// A bus configured like the system bus, with agentd's policy file included.
fn system_like_bus(
    dir: &std::path::Path,
    policy: &std::path::Path,
) -> (std::process::Child, String) {
    let body = format!(
        r#"<policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
  </policy>
  <include>{}</include>"#,
        policy.display()
    );
    let (child, sock) = common::spawn_bus(dir, "system", "system", &body);
    (child, format!("unix:path={}", sock.display()))
}

/// agentd's shipped system-bus policy file.
fn shipped_policy() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("dbus/org.keystone.Agent1.conf")
}

/// The shipped policy with nobody's group (gid 65534) as the access group,
/// written into `dir`.
fn policy_for_nogroup(dir: &std::path::Path) -> std::path::PathBuf {
    let nogroup = nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(NOBODY))
        .unwrap()
        .unwrap()
        .name;
    let path = dir.join("group.conf");
    fs::write(
        &path,
        fs::read_to_string(shipped_policy())
            .unwrap()
            .replace("group=\"keystone-agent\"", &format!("group=\"{nogroup}\"")),
    )
    .unwrap();
    path
}

#[test]
fn system_bus_policy_admits_only_root_and_the_group() {
    if !common::is_root() {
        eprintln!("skipped: needs root to own a name under the system policy");
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("ks-pol-")
        .tempdir_in("/tmp")
        .unwrap();
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let shipped = shipped_policy();
    // The same file with the access group replaced by one that exists here
    // (gid 65534), to check that group members get in.
    let with_group = policy_for_nogroup(tmp.path());
    for (policy, nobody_allowed) in [(&shipped, false), (&with_group, true)] {
        let dir = tempfile::Builder::new()
            .prefix("bus-")
            .tempdir_in(tmp.path())
            .unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let (mut bus, addr) = system_like_bus(dir.path(), policy);
        let mut agentd = std::process::Command::new(common::AGENTD)
            .args(["--address", &addr, "--state-dir"])
            .arg(dir.path().join("state"))
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let ctl = |uid: Option<u32>| {
            let mut c = std::process::Command::new(common::agentctl());
            c.args(["--bus", &addr, "list", "--json"]);
            if let Some(u) = uid {
                c.uid(u).gid(u);
            }
            c.output().unwrap()
        };
        common::wait_for(
            "agentd on the system-like bus",
            std::time::Duration::from_secs(20),
            || ctl(None).status.success(),
        );
        let out = ctl(Some(NOBODY));
        if nobody_allowed {
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        } else {
            assert_eq!(out.status.code(), Some(4));
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains("keystone-agent"), "{err}");
        }
        let _ = agentd.kill();
        let _ = agentd.wait();
        let _ = bus.kill();
        let _ = bus.wait();
    }
}

#[test]
fn a_non_root_owners_sync_writes_as_them_and_the_workspace_stays_the_sandboxs() {
    if !common::is_root() {
        eprintln!("skipped: needs root to act as another uid");
        return;
    }
    let env = Env::new();
    let repo = env.repo("theirs");
    // The repository belongs to the person (uid 65534 here).
    for entry in walk(&repo) {
        std::os::unix::fs::lchown(&entry, Some(NOBODY), Some(NOBODY)).unwrap();
    }
    let as_nobody = |args: &[&str]| {
        let out = env.ctl_as(Some(NOBODY), args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    as_nobody(&["create", repo.to_str().unwrap()]);
    as_nobody(&["start", "theirs"]);
    as_nobody(&[
        "exec",
        "theirs",
        "--",
        "sh",
        "-c",
        "echo w > w.txt && git add w.txt && git -c user.name=A -c user.email=a@example.com commit -qm work",
    ]);
    as_nobody(&["sync", "theirs"]);
    // agentd wrote into the person's repository as the person, not as root.
    let meta = fs::metadata(repo.join(".git/refs/remotes/sandbox/theirs/main")).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), NOBODY);
    let git_as_nobody = |args: &[&str]| common::git_as(Some(NOBODY), &repo, args);
    assert_eq!(
        git_as_nobody(&["log", "-1", "--format=%s", "sandbox/theirs/main"]),
        "work\n"
    );
    // The workspace is the sandbox's own: its owner reaches it only through
    // agentd, which checks what comes over.
    let ws = env.state_dir.join("sandboxes/theirs/workspace");
    let meta = fs::metadata(&ws).unwrap();
    let uid = std::os::unix::fs::MetadataExt::uid(&meta);
    assert!(
        agentd::auth::SANDBOX_IDS.contains(&uid),
        "workspace uid {uid}"
    );
    let fetch = std::process::Command::new("git")
        .args(["fetch", "-q", "sandbox/theirs"])
        .current_dir(&repo)
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    assert!(
        !fetch.status.success(),
        "the owner read the workspace directly"
    );
}

fn walk(p: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![p.to_owned()];
    if fs::symlink_metadata(p).unwrap().is_dir() {
        for e in fs::read_dir(p).unwrap().flatten() {
            out.extend(walk(&e.path()));
        }
    }
    out
}

#[test]
fn another_user_hears_no_signal_of_a_sandbox_it_does_not_own() {
    if !common::is_root() {
        eprintln!("skipped: needs root to run a bus with the system policy");
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("ks-sig-")
        .tempdir_in("/tmp")
        .unwrap();
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    // The shipped policy, with nobody's group as the access group: the
    // eavesdropper is a member, as a curious colleague would be.
    let policy = policy_for_nogroup(tmp.path());
    let (mut bus, addr) = system_like_bus(tmp.path(), &policy);
    let state = tmp.path().join("state");
    let mut agentd = std::process::Command::new(common::AGENTD)
        .args(["--address", &addr, "--state-dir"])
        .arg(&state)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let ctl = |uid: Option<u32>, args: &[&str]| {
        let mut c = std::process::Command::new(common::agentctl());
        c.args(["--bus", &addr]).args(args);
        if let Some(u) = uid {
            c.uid(u).gid(u);
        }
        c.output().unwrap()
    };
    common::wait_for("agentd", std::time::Duration::from_secs(20), || {
        ctl(None, &["list"]).status.success()
    });
    // The eavesdropper listens to everything it is let hear.
    let log = tmp.path().join("heard");
    let mut monitor = std::process::Command::new("dbus-monitor")
        .args(["--address", &addr])
        .stdout(fs::File::create(&log).unwrap())
        .stderr(std::process::Stdio::null())
        .uid(NOBODY)
        .gid(NOBODY)
        .spawn()
        .unwrap();
    // It also makes itself known to agentd, as a client would.
    assert!(ctl(Some(NOBODY), &["list"]).status.success());
    std::thread::sleep(std::time::Duration::from_millis(300));
    // Root's sandbox goes through its life.
    let repo = tmp.path().join("secretproj");
    fs::create_dir(&repo).unwrap();
    common::git(&repo, &["init", "-q", "-b", "main"]);
    common::commit(&repo, "x");
    let out = ctl(None, &["create", repo.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Walking agentd's objects shows root the sandbox and the other user
    // nothing of it.
    let tree = |uid: Option<u32>| {
        let mut c = std::process::Command::new("busctl");
        c.args([
            &format!("--address={addr}"),
            "tree",
            "--list",
            "org.keystone.Agent1",
        ]);
        if let Some(u) = uid {
            c.uid(u).gid(u);
        }
        let out = c.output().unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    assert!(
        tree(None).contains("/org/keystone/Agent1/sandbox/secretproj"),
        "root's tree: {}",
        tree(None)
    );
    let theirs = tree(Some(NOBODY));
    assert!(
        theirs.contains("Access denied") && !theirs.contains("secretproj"),
        "another user's tree: {theirs}"
    );
    for args in [
        &["start", "secretproj"][..],
        &["sync", "secretproj"],
        &["stop", "secretproj"],
        &["destroy", "secretproj"],
    ] {
        let out = ctl(None, args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let _ = monitor.kill();
    let _ = monitor.wait();
    let heard = fs::read_to_string(&log).unwrap();
    let _ = agentd.kill();
    let _ = agentd.wait();
    let _ = bus.kill();
    let _ = bus.wait();
    assert!(
        !heard.contains("secretproj"),
        "another user heard about root's sandbox:\n{}",
        heard
            .lines()
            .filter(|l| l.contains("secretproj"))
            .take(5)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn a_declared_name_never_takes_over_another_users_sandbox() {
    if !common::is_root() {
        eprintln!("skipped: a second user's sandbox needs root");
        return;
    }
    let mut env = Env::bus_only();
    env.start_agentd();
    // nobody makes `web` over the bus first...
    let public = env.repo("web");
    let out = env.ctl_as(Some(NOBODY), &["create", public.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // ...then the administrator declares `web` for root, with a secret.
    let key = env.tmp.path().join("key");
    fs::write(&key, "sk-admin\n").unwrap();
    let config = env.tmp.path().join("agentd.json");
    fs::write(
        &config,
        serde_json::json!({"sandboxes": {"web": {
            "project": env.repo("declared"), "owner": common::user_name(), "backend": "local",
            "secrets": {"KEY": {"file": key, "host": "api.example.com", "header": "x-api-key"}}
        }}})
        .to_string(),
    )
    .unwrap();
    env.kill_agentd();
    env.config = Some(config);
    env.start_agentd();
    // nobody's sandbox stays nobody's and undeclared; the declaration waits.
    let st = env.status("web");
    assert_eq!(st["owner"], NOBODY, "{st}");
    assert_eq!(st["declared"], false, "{st}");
    assert!(
        env.log().contains("belongs to another user"),
        "{}",
        env.log()
    );
    // Its start gets nothing of the declared secrets.
    let out = env.ctl_as(Some(NOBODY), &["start", "web"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!env.state_dir.join("secrets/web.json").exists());
}

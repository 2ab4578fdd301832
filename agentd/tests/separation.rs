//! Users are separated: every sandbox runs as a host uid of its own, and
//! another local user can neither signal its processes nor touch its files.
//! Needs root (agentd allocates uids only as root; the attacker is `nobody`).

mod common;

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

use common::Env;

const NOBODY: u32 = 65534;

/// Pid and host uid of sandbox `name`'s init.
fn init_of(env: &Env, name: &str) -> (i64, u32) {
    let reg = env.registry();
    let pid = reg["sandboxes"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["name"] == name))
        .and_then(|s| s["runtime"]["init_pid"].as_i64())
        .expect("init pid");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    (pid, uid)
}

fn as_nobody(script: &str) -> std::process::Output {
    Command::new("sh")
        .args(["-c", script])
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap()
}

#[test]
fn each_sandbox_has_its_own_uid_that_no_other_user_can_reach() {
    if !common::is_root() {
        eprintln!("skipped: needs root (agentd allocates sandbox uids as root)");
        return;
    }
    let env = Env::new();
    for name in ["one", "two"] {
        let repo = env.repo(name);
        env.ok(&["create", repo.to_str().unwrap()]);
        env.ok(&["start", name]);
    }
    let ((pid, one), (_, two)) = (init_of(&env, "one"), init_of(&env, "two"));
    assert!(agentd::auth::SANDBOX_IDS.contains(&one), "uid {one}");
    assert!(agentd::auth::SANDBOX_IDS.contains(&two), "uid {two}");
    assert_ne!(one, two, "two sandboxes share a uid");
    // Their files are theirs too.
    let ws = env.state_dir.join("sandboxes/one/workspace");
    assert_eq!(std::fs::metadata(&ws).unwrap().uid(), one);
    env.sh("one", "echo x > /workspace/mine");
    assert_eq!(std::fs::metadata(ws.join("mine")).unwrap().uid(), one);

    // Another user can neither signal the sandbox nor touch its files.
    let kill = as_nobody(&format!("kill -9 {pid}"));
    assert!(!kill.status.success(), "nobody signalled a sandbox");
    assert_eq!(env.state("one"), "running");
    let plant = as_nobody(&format!(
        "echo pwned > {0}/planted || ls {0} || cat {0}/README.md",
        ws.display()
    ));
    assert!(!plant.status.success(), "nobody reached the workspace");
    assert!(!ws.join("planted").exists());
    let state = env.state_dir.join("sandboxes");
    assert!(
        !as_nobody(&format!("ls {}", state.display()))
            .status
            .success()
    );

    // A stopped sandbox keeps its uid; a new one never gets a taken one.
    env.ok(&["stop", "one"]);
    env.ok(&["start", "one"]);
    assert_eq!(init_of(&env, "one").1, one);
}

/// The account whose unprivileged agentd the subordinate-id test runs:
/// `KEYSTONE_SUBID_USER`, or `keystone-test`; it needs ranges in
/// `/etc/subuid` and `/etc/subgid` (`useradd` gives a new account some) and
/// `newuidmap`/`newgidmap` (Debian: `uidmap`). `.ci/run` sets both up.
fn subid_user() -> Option<(nix::unistd::User, agentd::subid::Pool)> {
    let name = std::env::var("KEYSTONE_SUBID_USER").unwrap_or_else(|_| "keystone-test".into());
    let user = nix::unistd::User::from_name(&name).ok().flatten()?;
    let range = |file: &str| {
        let text = std::fs::read_to_string(file).ok()?;
        agentd::subid::parse_range(&text, &user.name, user.uid.as_raw())
    };
    let ((uid_start, uids), (gid_start, gids)) = (range("/etc/subuid")?, range("/etc/subgid")?);
    let tools = ["/usr/bin/newuidmap", "/usr/bin/newgidmap"];
    if !tools.iter().all(|t| std::path::Path::new(t).exists()) {
        return None;
    }
    Some((
        user,
        agentd::subid::Pool {
            uid_start,
            gid_start,
            count: uids.min(gids).min(65_536),
        },
    ))
}

/// Run `script` with sh on the host as `uid`:`gid`, as a process of the
/// sandbox that got out of its namespaces would be.
fn as_ids(uid: u32, gid: u32, script: &str) -> std::process::Output {
    Command::new("sh")
        .args(["-c", script])
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap()
}

#[test]
fn an_unprivileged_agentd_gives_each_sandbox_a_subordinate_id() {
    let required = std::env::var_os("KEYSTONE_REQUIRE_SUBID").is_some();
    let found = if common::is_root() {
        subid_user()
    } else {
        None
    };
    let Some((user, pool)) = found else {
        assert!(
            !required,
            "KEYSTONE_REQUIRE_SUBID is set but there is no test account with subordinate ids \
             (useradd --create-home keystone-test; apt-get install uidmap)"
        );
        eprintln!("skipped: needs root and an account with subordinate ids (see subid_user)");
        return;
    };
    let me = user.uid.as_raw();
    let tmp = tempfile::tempdir().unwrap();
    let caddy = common::caddy::Caddy::start(tmp.path());
    let config: serde_json::Value =
        serde_json::from_str(&caddy.agentd_config_auth(false, "none")).unwrap();
    let env = Env::as_user(me, &config);
    let mut repos = Vec::new();
    for name in ["one", "two"] {
        let repo = env.repo(name);
        Command::new("chown")
            .args(["-R", &format!("{me}:{}", user.gid)])
            .arg(&repo)
            .status()
            .unwrap();
        env.ok(&["create", repo.to_str().unwrap()]);
        env.ok(&["start", name]);
        repos.push(repo);
    }
    let ((pid, one), (_, two)) = (init_of(&env, "one"), init_of(&env, "two"));
    for id in [one, two] {
        assert!(pool.uids().contains(&id), "uid {id} is not {}'s", user.name);
    }
    assert_ne!(one, two, "two sandboxes share a uid");
    let gid_one = pool.gid_for(one).unwrap();
    let limits = env.status("one")["limits"].as_str().unwrap().to_owned();
    assert!(
        limits.contains(&format!("uid {one} of its own")),
        "{limits}"
    );

    // Inside: the sandbox's files and processes are its id's, and it has
    // none of the user's groups.
    let ws = env.state_dir.join("sandboxes/one/workspace");
    assert_eq!(std::fs::metadata(&ws).unwrap().uid(), one);
    env.sh("one", "echo x > /workspace/mine");
    let mine = std::fs::metadata(ws.join("mine")).unwrap();
    assert_eq!((mine.uid(), mine.gid()), (one, gid_one));
    let groups = env.sh("one", "grep ^Groups: /proc/self/status");
    assert_eq!(groups.trim(), "Groups:", "the sandbox kept groups");

    // A process of the sandbox on the host is not the user: it can write
    // none of the user's files (the project included) and signal none of
    // the user's processes; nor can another sandbox's reach this one's
    // files, nor can another user list the sandbox's directory.
    let readme = repos[0].join("README.md");
    let before = std::fs::read(&readme).unwrap();
    let out = as_ids(one, gid_one, &format!("echo pwned >> {}", readme.display()));
    assert!(!out.status.success(), "the sandbox's uid wrote the project");
    assert_eq!(std::fs::read(&readme).unwrap(), before);
    let out = as_ids(one, gid_one, &format!("kill -0 {}", env.agentd_pid()));
    assert!(!out.status.success(), "the sandbox's uid may signal agentd");
    let gid_two = pool.gid_for(two).unwrap();
    let out = as_ids(
        two,
        gid_two,
        &format!("echo pwned > {0}/planted || ls {0}", ws.display()),
    );
    assert!(!out.status.success(), "sandbox two reached sandbox one");
    assert!(!ws.join("planted").exists());
    let out = as_nobody(&format!(
        "ls {}",
        env.state_dir.join("sandboxes/one").display()
    ));
    assert!(!out.status.success(), "another user listed the sandbox");

    // Everything else works as with the user's own uid: sync, worktrees,
    // stop and start with the same id, an agentd killed and restarted.
    env.sh(
        "one",
        "cd /workspace && git add mine && git -c user.name=A -c user.email=a@a commit -qm agent",
    );
    env.ok(&["sync", "one"]);
    let host = common::git_as(
        Some(me),
        &repos[0],
        &["log", "-1", "--format=%s", "refs/remotes/sandbox/one/main"],
    );
    assert_eq!(host.trim(), "agent");
    // A dev server's link: agentd finds its port although it may not look
    // into the sandbox's processes' descriptors.
    env.sh(
        "one",
        "echo served > who.txt; python3 -m http.server 8731 --bind 127.0.0.1 >/dev/null 2>&1 &",
    );
    common::wait_for(
        "the link to answer",
        std::time::Duration::from_secs(20),
        || caddy.get("one.sandbox.local", "/who.txt") == (200, "served\n".to_owned()),
    );
    env.ok(&["worktree", "add", "one", "feat"]);
    let wt = std::fs::metadata(ws.join(".worktrees/feat")).unwrap();
    assert_eq!(wt.uid(), one);
    env.ok(&["stop", "one"]);
    env.ok(&["start", "one"]);
    assert_eq!(init_of(&env, "one").1, one);
    assert_ne!(pid, init_of(&env, "one").0);
    let mut env = env;
    env.kill_agentd();
    env.start_agentd();
    common::wait_for(
        "agentd to adopt both",
        std::time::Duration::from_secs(20),
        || env.state("one") == "running" && env.state("two") == "running",
    );
    env.ok(&["exec", "two", "--", "true"]);

    // The sync's reader, which parses what the sandbox wrote, runs as the
    // sandbox's id without a capability (none to change back to the user's
    // id with) and off the host's network; here a FIFO holds it up.
    env.sh("one", "cd /workspace && echo y > y && git add y && git -c user.name=A -c user.email=a@a commit -qm y \
         && h=$(git rev-parse HEAD) && o=.git/objects/$(echo $h | cut -c1-2)/$(echo $h | cut -c3-) \
         && rm -f $o && mkfifo $o");
    let sync = env.ctl_cmd(&["sync", "one"]).spawn().unwrap();
    let reader = env.wait_for_helper("__sync-read");
    common::assert_helper_confined(reader);
    assert_eq!(
        common::proc_status(reader, "Uid").split_whitespace().next(),
        Some(one.to_string().as_str())
    );

    // A sandbox that locks its files away from agentd's user, nests
    // directories deeper than agentd may hold open, and holds up its sync,
    // still goes whole with destroy.
    env.sh("one", "cd /workspace && i=0 && while [ $i -lt 1500 ]; do mkdir d && cd d && i=$((i+1)); done \
         && mkdir -p /workspace/locked/deep && chmod 000 /workspace/locked /workspace/.git /workspace \
         && chmod 000 /root");
    env.ok(&["stop", "one"]);
    env.ok(&["destroy", "one"]);
    let _ = sync.wait_with_output();
    assert!(!env.state_dir.join("sandboxes/one").exists());
    assert_eq!(env.state("two"), "running");
}

/// The host's ledger of sandbox uids (as root).
fn ledger() -> serde_json::Value {
    let path = std::path::Path::new(agentd::sandbox::ids::ROOT_DIR)
        .join(agentd::sandbox::ids::LEDGER_FILE);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The ids the ledger gives the agentd of `state_dir`.
fn claims_of(state_dir: &std::path::Path) -> Vec<u64> {
    let dir = std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_owned());
    ledger()["claims"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["state_dir"].as_str() == dir.to_str())
        .map(|c| c["id"].as_u64().unwrap())
        .collect()
}

#[test]
fn two_agentds_of_one_host_never_give_their_sandboxes_the_same_uid() {
    if !common::is_root() {
        eprintln!("skipped: needs root (agentd allocates sandbox uids as root)");
        return;
    }
    // Two root agentds with state directories of their own, at once (a
    // quick start beside the system service).
    let mut a = Env::new();
    let b = Env::new();
    let repo = a.repo("one");
    a.ok(&["create", repo.to_str().unwrap()]);
    a.ok(&["start", "one"]);
    let repo = b.repo("two");
    b.ok(&["create", repo.to_str().unwrap()]);
    b.ok(&["start", "two"]);
    let ((pid_one, one), (_, two)) = (init_of(&a, "one"), init_of(&b, "two"));
    assert_ne!(one, two, "two agentds gave their sandboxes the same uid");
    // B's sandbox cannot signal A's.
    let kill = as_ids(two, two, &format!("kill -9 {pid_one}"));
    assert!(
        !kill.status.success(),
        "one agentd's sandbox signalled another's"
    );
    assert_eq!(claims_of(&a.state_dir), vec![u64::from(one)]);
    assert_eq!(claims_of(&b.state_dir), vec![u64::from(two)]);

    // A dies without giving anything back: its id stays reserved for its
    // state directory, so B's next sandbox gets another and A, started
    // again, finds its sandbox's id its own.
    a.kill_agentd();
    let repo = b.repo("three");
    b.ok(&["create", repo.to_str().unwrap()]);
    b.ok(&["start", "three"]);
    let three = init_of(&b, "three").1;
    assert!(![one, two].contains(&three), "uid {three} given twice");
    a.start_agentd();
    a.ok(&["stop", "one"]);
    a.ok(&["start", "one"]);
    assert_eq!(init_of(&a, "one").1, one);

    // Destroyed, a sandbox's id goes back; killed with its state directory
    // gone, an agentd leaks nothing: the next claim drops what it held.
    b.ok(&["stop", "three"]);
    b.ok(&["destroy", "--force", "three"]);
    assert_eq!(claims_of(&b.state_dir), vec![u64::from(two)]);
    a.ok(&["stop", "one"]);
    a.kill_agentd();
    // (Moved away: its sandbox's disk is still mounted in it.)
    let moved = a.tmp.path().join("state-moved");
    std::fs::rename(&a.state_dir, &moved).unwrap();
    let repo = b.repo("four");
    b.ok(&["create", repo.to_str().unwrap()]);
    assert!(claims_of(&a.state_dir).is_empty(), "{}", ledger());
    assert_eq!(claims_of(&b.state_dir).len(), 2);
    std::fs::rename(&moved, &a.state_dir).unwrap();
}

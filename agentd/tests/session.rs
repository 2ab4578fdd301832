//! Terminals handed over D-Bus, driven in a real terminal (tmux): `agentctl
//! exec --tty` and `agentctl attach` into the real Zellij inside a sandbox.

mod common;

use std::fs;
use std::time::Duration;

use common::term::{Terminal, is_cooked};
use common::{Env, agentctl, git, wait_for};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const LONG: Duration = Duration::from_secs(60);

fn running(name: &str) -> (Env, std::path::PathBuf) {
    let env = Env::new();
    let repo = env.repo(name);
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", name]);
    (env, repo)
}

/// The shell line that runs agentctl with `args` on this test's bus.
fn ctl_line(env: &Env, args: &str) -> String {
    format!("{} --bus {} {args}", agentctl().display(), env.address)
}

/// SIGTERM every agentctl on this test's bus running `verb`.
fn term_agentctl(env: &Env, verb: &str) {
    let pids = agentd::procfs::pids_with_args(&["--bus", &env.address, verb]);
    assert!(!pids.is_empty(), "no agentctl {verb} runs");
    for (pid, _) in pids {
        kill(Pid::from_raw(pid), Signal::SIGTERM).unwrap();
    }
}

fn history(env: &Env, name: &str) -> Vec<serde_json::Value> {
    serde_json::from_str(&env.ok(&["history", name, "--json"])).unwrap()
}

#[test]
fn exec_tty_hands_over_a_terminal_of_our_size_and_gives_ours_back() {
    let (env, _) = running("tty");
    let t = Terminal::new(env.tmp.path(), 100, 30, &[]);
    t.line(&format!(
        "{}; echo code=$?",
        ctl_line(&env, "exec --tty tty -- bash --norc --noprofile")
    ));
    t.line("echo inside-$(tty)-$(stty size | tr ' ' x)");
    t.wait_screen("the sandbox's terminal", LONG, |s| {
        s.contains("inside-/dev/pts/") && s.contains("-30x100")
    });
    // A resize reaches the program inside.
    t.resize(120, 40);
    t.line("echo now-$(stty size | tr ' ' x)");
    t.wait_screen("the new size inside", LONG, |s| s.contains("now-40x120"));
    // Typing reaches it; its exit code is agentctl's.
    t.line("exit 7");
    t.wait_screen("agentctl to exit", LONG, |s| s.contains("code=7"));
    let stty = t.stty("after-exit");
    assert!(is_cooked(&stty), "terminal left raw:\n{stty}");
    let h = history(&env, "tty");
    let last = h.last().unwrap();
    assert_eq!(last["kind"], "exec");
    assert_eq!(last["exit_code"], 7);
}

#[test]
fn a_killed_agentctl_gives_the_terminal_back_and_ends_the_command() {
    let (env, _) = running("killed");
    let t = Terminal::new(env.tmp.path(), 80, 24, &[]);
    t.line(&format!(
        "{}; echo ended=$?",
        ctl_line(&env, "exec -t killed -- sleep 7777")
    ));
    wait_for("sleep in the sandbox", LONG, || {
        !agentd::procfs::pids_with_args(&["7777"]).is_empty()
    });
    term_agentctl(&env, "exec");
    t.wait_screen("agentctl to exit", LONG, |s| s.contains("ended=143"));
    let stty = t.stty("after-kill");
    assert!(is_cooked(&stty), "terminal left raw:\n{stty}");
    // The terminal's hang-up ended the command inside.
    wait_for("sleep to end", LONG, || {
        agentd::procfs::pids_with_args(&["7777"]).is_empty()
    });
    wait_for("the history entry", LONG, || {
        history(&env, "killed")
            .last()
            .is_some_and(|e| e["detail"] == "sleep 7777" && e["exit_code"] == 129)
    });
}

#[test]
fn tty_without_a_terminal_is_refused() {
    let (env, _) = running("notty");
    let err = env.fails(4, &["exec", "--tty", "notty", "--", "true"]);
    assert!(err.contains("needs a terminal"), "{err}");
    let err = env.fails(4, &["attach", "notty"]);
    assert!(err.contains("needs a terminal"), "{err}");
}

/// A running agentd that found Zellij (tests/install-zellij.sh).
fn with_zellij(env: &Env) {
    assert!(
        env.log().contains("sessions enabled"),
        "agentd found no Zellij 0.45: run tests/install-zellij.sh (or tests/run.sh) first\n{}",
        env.log()
    );
}

#[test]
fn attach_creates_the_worktree_and_session_and_detach_keeps_it() {
    let env = Env::new();
    with_zellij(&env);
    let repo = env.repo("att");
    // The project's own layout is used for new sessions.
    fs::create_dir_all(repo.join(".keystone")).unwrap();
    fs::write(
        repo.join(".keystone/layout.kdl"),
        "layout {\n    pane focus=true\n    pane size=4 command=\"echo\" {\n        args \"project-layout-pane\"\n    }\n}\n",
    )
    .unwrap();
    git(&repo, &["add", "."]);
    common::commit(&repo, "layout");
    env.ok(&["create", repo.to_str().unwrap()]);
    assert_eq!(env.state("att"), "created");

    let t = Terminal::new(env.tmp.path(), 100, 30, &[]);
    t.line(&format!(
        "{}; echo attach-exit=$?",
        ctl_line(&env, "attach att feature")
    ));
    // Zellij's screen: the project's layout, a shell in the new worktree.
    t.wait_screen("the project's layout", LONG, |s| {
        s.contains("project-layout-pane")
    });
    t.line("echo at-$(pwd)");
    t.wait_screen("the worktree's path", LONG, |s| {
        s.contains("at-/workspace/.worktrees/feature")
    });
    t.line("echo typed-$((6*7))");
    t.wait_screen("typing to reach the shell", LONG, |s| {
        s.contains("typed-42")
    });
    // A resize reaches the pane by the same amount.
    let size = |t: &Terminal, tag: &str| -> (u32, u32) {
        t.line(&format!("echo {tag}-$(stty size | tr ' ' x)-end"));
        let s = t.wait_screen("stty size", LONG, |s| {
            s.lines().any(|l| {
                l.contains(&format!("{tag}-"))
                    && l.contains("x")
                    && l.contains("-end")
                    && !l.contains("$(")
            })
        });
        let line = s
            .lines()
            .find(|l| l.contains(&format!("{tag}-")) && !l.contains("$("))
            .unwrap();
        let v = line.split(&format!("{tag}-")).nth(1).unwrap();
        let v = v.split("-end").next().unwrap();
        let (r, c) = v.split_once('x').unwrap();
        (r.trim().parse().unwrap(), c.trim().parse().unwrap())
    };
    let (r1, c1) = size(&t, "before");
    t.resize(120, 40);
    t.wait_screen("zellij to redraw", LONG, |s| s.lines().count() >= 40);
    let (r2, c2) = size(&t, "after");
    assert_eq!(
        (r2 - r1, c2 - c1),
        (10, 20),
        "pane {r1}x{c1} became {r2}x{c2}"
    );

    // Detach (Ctrl+o d): agentctl exits 0 and the terminal is sane.
    t.keys(&["C-o"]);
    t.keys(&["d"]);
    let s = t.wait_screen("agentctl to exit", LONG, |s| s.contains("attach-exit=0"));
    assert!(s.contains("Sandbox 'att' was created; started it"), "{s}");
    assert!(s.contains("Created the worktree of 'feature'"), "{s}");
    assert!(is_cooked(&t.stty("after-detach")));
    assert_eq!(env.state("att"), "running");

    // The session survives, with no client now.
    let sessions: Vec<serde_json::Value> =
        serde_json::from_str(&env.ok(&["sessions", "att", "--json"])).unwrap();
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    assert_eq!(sessions[0]["name"], "att-feature");
    assert_eq!(sessions[0]["branch"], "feature");
    assert_eq!(sessions[0]["clients"], 0);
    assert!(sessions[0]["created_at"].is_string());
    let worktrees: Vec<serde_json::Value> =
        serde_json::from_str(&env.ok(&["worktree", "list", "att", "--json"])).unwrap();
    let feature = worktrees.iter().find(|w| w["branch"] == "feature").unwrap();
    assert_eq!(feature["session"], "att-feature");
    assert!(
        worktrees
            .iter()
            .any(|w| w["branch"] == "main" && w["session"].is_null())
    );

    // Re-attaching shows the same screen.
    t.line("clear");
    t.line(&format!(
        "{}; echo again-exit=$?",
        ctl_line(&env, "attach att feature")
    ));
    t.wait_screen("the same screen", LONG, |s| s.contains("typed-42"));
    // (The client detached before may take a moment to be gone.)
    common::wait_for("one client", LONG, || {
        let sessions: Vec<serde_json::Value> =
            serde_json::from_str(&env.ok(&["sessions", "att", "--json"])).unwrap();
        sessions[0]["clients"] == 1
    });

    // agentctl killed while attached: the terminal comes back sane, the
    // session stays.
    term_agentctl(&env, "attach");
    t.wait_screen("agentctl to exit", LONG, |s| s.contains("again-exit=143"));
    assert!(is_cooked(&t.stty("after-kill")));
    wait_for("the client to leave", LONG, || {
        let s: Vec<serde_json::Value> =
            serde_json::from_str(&env.ok(&["sessions", "att", "--json"])).unwrap();
        s.len() == 1 && s[0]["clients"] == 0
    });

    // Every attach is in the history.
    let attaches: Vec<_> = history(&env, "att")
        .into_iter()
        .filter(|e| e["kind"] == "attach")
        .collect();
    assert_eq!(attaches.len(), 2, "{attaches:?}");
    assert!(attaches.iter().all(|e| e["detail"] == "feature"));
    assert_eq!(attaches[0]["exit_code"], 0);

    // kill-session ends it; a second time there is nothing to end.
    let out = env.ok(&["kill-session", "att", "feature"]);
    assert!(out.contains("att-feature"), "{out}");
    assert_eq!(env.ok(&["sessions", "att", "--json"]).trim(), "[]");
    let err = env.fails(1, &["kill-session", "att", "feature"]);
    assert!(err.contains("no session for branch 'feature'"), "{err}");
}

#[test]
fn attach_defaults_to_the_main_branch_and_rejects_bad_branches() {
    let (env, _) = running("main-att");
    with_zellij(&env);
    let err = env.fails(4, &["kill-session", "main-att", "bad..name"]);
    assert!(err.contains("not a valid git branch name"), "{err}");
    let t = Terminal::new(env.tmp.path(), 90, 25, &[]);
    t.line(&ctl_line(
        &env,
        "attach main-att 'bad..name'; echo bad-exit=$?",
    ));
    let s = t.wait_screen("the refusal", LONG, |s| {
        s.lines().any(|l| l.starts_with("bad-exit="))
    });
    assert!(
        s.contains("bad-exit=4") && s.contains("not a valid git branch name"),
        "{s}"
    );
    t.line("clear");
    t.line(&format!(
        "{}; echo main-exit=$?",
        ctl_line(&env, "attach main-att")
    ));
    // agentd's default layout: the compact bar names the session.
    t.wait_screen("the default layout", LONG, |s| s.contains("main-att-main"));
    t.line("echo at-$(pwd)");
    t.wait_screen("the main worktree", LONG, |s| {
        s.contains("at-/workspace\n") || s.contains("at-/workspace ")
    });
    t.keys(&["C-o"]);
    t.keys(&["d"]);
    t.wait_screen("agentctl to exit", LONG, |s| s.contains("main-exit=0"));
    let out = env.ok(&["sessions", "main-att"]);
    assert!(
        out.contains("main-att-main") && out.contains("main"),
        "{out}"
    );
}

#[test]
fn attach_with_an_agent_runs_it_in_the_first_pane_and_attaching_again_rejoins_it() {
    // A stand-in for Claude Code in a toolbox cache of our own: the real one
    // would need a login before its first screen.
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("agents");
    let stub = cache.join("claude-0.0.1");
    fs::create_dir_all(&stub).unwrap();
    fs::write(
        stub.join("claude"),
        "#!/bin/sh\necho \"STUB-AGENT-FIRST-SCREEN in $(pwd)\"\nexec cat\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(stub.join("claude"), fs::Permissions::from_mode(0o755)).unwrap();
    let env = Env::with_config(&serde_json::json!({"toolbox": {
        "agents": ["claude"],
        "versions": {"claude": "0.0.1"},
        "cache_dir": cache,
        "download": false,
    }}));
    with_zellij(&env);
    let repo = env.repo("agt");
    env.ok(&["create", repo.to_str().unwrap()]);

    let t = Terminal::new(env.tmp.path(), 120, 30, &[]);
    t.line(&format!(
        "{}; echo attach-exit=$?",
        ctl_line(&env, "attach agt --agent claude")
    ));
    t.wait_screen("the agent's first screen", LONG, |s| {
        s.contains("STUB-AGENT-FIRST-SCREEN in /workspace")
    });
    // The agent has the focus: typing goes to it.
    t.line("typed-to-the-agent");
    t.wait_screen("the agent to echo", LONG, |s| {
        s.matches("typed-to-the-agent").count() >= 2
    });
    t.keys(&["C-o"]);
    t.keys(&["d"]);
    t.wait_screen("agentctl to exit", LONG, |s| s.contains("attach-exit=0"));

    // Attaching again (with or without --agent) rejoins the same session:
    // the agent is still there, and no second one started.
    t.line("clear");
    t.line(&format!(
        "{}; echo again-exit=$?",
        ctl_line(&env, "attach agt")
    ));
    t.wait_screen("the same agent", LONG, |s| {
        s.contains("STUB-AGENT-FIRST-SCREEN") && s.contains("typed-to-the-agent")
    });
    // The stand-in ends as `cat`: count those.
    let launched = env.ok(&[
        "exec",
        "agt",
        "--",
        "sh",
        "-c",
        "for p in /proc/[0-9]*; do \
           [ \"$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\" = 'cat ' ] && echo agent; done | wc -l",
    ]);
    assert_eq!(launched.trim(), "1", "one agent runs");
    term_agentctl(&env, "attach");
    t.wait_screen("agentctl to exit", LONG, |s| s.contains("again-exit=143"));

    // An agent that is not one of the toolbox's is refused, by agentctl
    // and, on a raw D-Bus call, by agentd, naming the known ones.
    let err = env.fails(4, &["attach", "agt", "--agent", "vim"]);
    assert!(err.contains("claude") && err.contains("codex"), "{err}");
    let out = std::process::Command::new("busctl")
        .args([
            &format!("--address={}", env.address),
            "call",
            "org.keystone.Agent1",
            "/org/keystone/Agent1/sandbox/agt",
            "org.keystone.Agent1.Sandbox",
            "Attach",
            "sa{sv}",
            "main",
            "1",
            "agent",
            "s",
            "sh -c id",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("agent 'sh -c id' is not one of: claude, codex, gemini"),
        "{err}"
    );

    // A sandbox that names a default agent: a new session starts it
    // without --agent.
    let err = env.fails(4, &["set", "agt", "--default-agent", "sh"]);
    assert!(err.contains("claude, codex, gemini"), "{err}");
    env.ok(&["set", "agt", "--default-agent", "claude"]);
    let status = env.ok(&["status", "agt"]);
    assert!(status.contains("start claude beside a shell"), "{status}");
    t.line("clear");
    t.line(&format!(
        "{}; echo default-exit=$?",
        ctl_line(&env, "attach agt feature")
    ));
    t.wait_screen("the default agent's first screen", LONG, |s| {
        s.contains("STUB-AGENT-FIRST-SCREEN in /workspace/.worktrees/feature")
    });
    t.keys(&["C-o"]);
    t.keys(&["d"]);
    t.wait_screen("agentctl to exit", LONG, |s| s.contains("default-exit=0"));
    // And `none` takes it away again.
    env.ok(&["set", "agt", "--default-agent", "none"]);
    let status = env.ok(&["status", "agt", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(v["config"]["default_agent"], serde_json::Value::Null, "{v}");
}

#[test]
fn attach_says_how_long_a_zellij_build_has_left_and_works_once_it_is_there() {
    // A machine whose Zellij is still building: an empty cache with the
    // build's marker, naming a process that runs.
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    fs::create_dir_all(&cache).unwrap();
    let mut build = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - 120;
    fs::write(
        cache.join("zellij-0.45.1.building"),
        format!(
            "started={started}\nexpected=1200\npid={}\nlog=/var/tmp/zellij-build.log\n",
            build.id()
        ),
    )
    .unwrap();
    let mut env = Env::bus_only();
    env.agentd_env = vec![
        (
            "KEYSTONE_CACHE_DIR".into(),
            Some(cache.display().to_string()),
        ),
        ("KEYSTONE_ZELLIJ".into(), None),
        ("PATH".into(), Some("/usr/sbin:/usr/bin:/sbin:/bin".into())),
    ];
    env.start_agentd();
    assert!(env.log().contains("still being built"), "{}", env.log());
    let repo = env.repo("late");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "late"]);

    let attach = || {
        std::process::Command::new("busctl")
            .args([
                &format!("--address={}", env.address),
                "call",
                "org.keystone.Agent1",
                "/org/keystone/Agent1/sandbox/late",
                "org.keystone.Agent1.Sandbox",
                "Attach",
                "sa{sv}",
                "main",
                "0",
            ])
            .output()
            .unwrap()
    };
    let out = attach();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("still being built (started 2 minutes ago, about 18 minutes left; log: /var/tmp/zellij-build.log)")
            && err.contains("agentctl exec -t"),
        "{err}"
    );
    // A build that ended without a binary: Zellij is just missing.
    build.kill().unwrap();
    build.wait().unwrap();
    let err = String::from_utf8_lossy(&attach().stderr).into_owned();
    assert!(err.contains("no zellij found"), "{err}");

    // The build's result arrives: the next attach finds it, with no
    // restart of agentd or of the sandbox.
    let real = agentd::tools::find_zellij(
        std::env::var_os("KEYSTONE_ZELLIJ")
            .as_deref()
            .map(std::path::Path::new),
    )
    .expect("the pinned Zellij: run tests/install-zellij.sh (or tests/run.sh) first");
    let bin = cache.join("zellij-0.45.1/bin");
    fs::create_dir_all(&bin).unwrap();
    fs::copy(&real, bin.join("zellij")).unwrap();
    fs::remove_file(cache.join("zellij-0.45.1.building")).unwrap();
    let t = Terminal::new(env.tmp.path(), 100, 30, &[]);
    t.line(&format!(
        "{}; echo attach-exit=$?",
        ctl_line(&env, "attach late")
    ));
    t.wait_screen("a session in the running sandbox", LONG, |s| {
        s.contains("late-main") && s.contains("@late:/workspace")
    });
    t.keys(&["C-o"]);
    t.keys(&["d"]);
    t.wait_screen("agentctl to exit", LONG, |s| s.contains("attach-exit=0"));
    assert!(env.log().contains("sessions enabled"));
    let sessions: Vec<serde_json::Value> =
        serde_json::from_str(&env.ok(&["sessions", "late", "--json"])).unwrap();
    assert_eq!(sessions[0]["name"], "late-main", "{sessions:?}");
}

//! The agent toolbox (agentd/src/toolbox.rs): Claude Code, Codex and
//! Gemini CLI from the npm registry at pinned versions, in a cache keyed by
//! version, read-only inside local sandboxes with launchers on PATH.
//!
//! `the_pinned_agent_clis_run_inside_a_local_sandbox` uses the real
//! packages from registry.npmjs.org (`.ci/run` fills the cache first with
//! `agentd --install-agents`). The others serve a registry of their own on
//! loopback: a package whose tarball does not match the registry's sha512
//! is never installed.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{Env, wait_for};

fn sh(env: &Env, name: &str, script: &str) -> String {
    env.ok(&["exec", name, "--", "sh", "-c", script])
}

#[test]
fn the_pinned_agent_clis_run_inside_a_local_sandbox() {
    let versions = agentd::toolbox::Versions::default();
    let env = Env::with_config(&serde_json::json!({"toolbox": {"download": true}}));
    // Downloads (about 420 MB) happen only where the cache lacks them.
    wait_for("the agent toolbox", Duration::from_secs(1800), || {
        let log = env.log();
        assert!(
            !log.contains("agent toolbox incomplete"),
            "the toolbox could not be installed:\n{log}"
        );
        log.contains("agent toolbox ready")
    });
    env.create_running("agents", &[]);

    let out = env.ok(&["exec", "agents", "--", "claude", "--version"]);
    assert_eq!(out.trim(), format!("{} (Claude Code)", versions.claude));
    let out = env.ok(&["exec", "agents", "--", "codex", "--version"]);
    assert_eq!(out.trim(), format!("codex-cli {}", versions.codex));
    let out = env.ok(&["exec", "agents", "--", "gemini", "--version"]);
    assert_eq!(out.trim(), versions.gemini);

    // On PATH from agentd's tools, and read-only for the sandbox, root
    // included.
    let out = sh(
        &env,
        "agents",
        "for c in claude codex gemini; do command -v $c; done",
    );
    assert_eq!(
        out,
        "/run/keystone/bin/claude\n/run/keystone/bin/codex\n/run/keystone/bin/gemini\n"
    );
    // As a hostile agent would: remount read-write, then write and delete.
    let out = sh(
        &env,
        "agents",
        "for m in /run/keystone/agents /run/keystone; do \
           mount -o remount,bind,rw $m 2>/dev/null && echo remounted $m; done; \
         for f in /run/keystone/agents/x /run/keystone/bin/claude; do \
           if (echo hostile > $f) 2>/dev/null; then echo wrote $f; fi; done; \
         rm -rf /run/keystone/agents/claude-* 2>/dev/null; ls /run/keystone/agents",
    );
    assert!(!out.contains("wrote"), "{out}");
    assert!(
        out.contains(&format!("claude-{}", versions.claude)),
        "{out}"
    );
    let cache = agentd::tools::cache_dir().unwrap().join("agents");
    assert!(!cache.join("x").exists());
    assert!(
        cache
            .join(format!("claude-{}/claude", versions.claude))
            .is_file()
    );
    let launcher = std::fs::read_to_string(env.state_dir.join("guest/bin/claude")).unwrap();
    assert!(!launcher.contains("hostile"), "{launcher}");

    let status: serde_json::Value =
        serde_json::from_str(&env.ok(&["status", "agents", "--json"])).unwrap();
    assert_eq!(
        status["agents"],
        format!(
            "claude {}, codex {}, gemini {}, node {}",
            versions.claude, versions.codex, versions.gemini, versions.node
        ),
        "{status}"
    );
    let human = env.ok(&["status", "agents"]);
    assert!(human.contains("Agents:     claude "), "{human}");
}

/// `agentd --install-agents --config CONFIG`, run to its end.
fn install_agents(config: &Path) -> std::process::Output {
    Command::new(common::AGENTD)
        .arg("--install-agents")
        .arg("--config")
        .arg(config)
        .output()
        .unwrap()
}

/// An npm tarball (`package/…`) holding a `claude` that prints `says`.
fn fake_claude_tgz(dir: &Path, says: &str) -> Vec<u8> {
    let pkg = dir.join("package");
    std::fs::create_dir_all(&pkg).unwrap();
    std::fs::write(pkg.join("claude"), format!("#!/bin/sh\necho '{says}'\n")).unwrap();
    std::fs::set_permissions(
        pkg.join("claude"),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    std::fs::write(pkg.join("package.json"), "{}").unwrap();
    let tgz = dir.join("p.tgz");
    let ok = Command::new("tar")
        .arg("-czf")
        .arg(&tgz)
        .arg("-C")
        .arg(dir)
        .arg("package")
        .status()
        .unwrap();
    assert!(ok.success());
    std::fs::read(&tgz).unwrap()
}

fn sha512_base64(data: &[u8]) -> String {
    use base64::Engine;
    use sha2::Digest;
    base64::engine::general_purpose::STANDARD.encode(sha2::Sha512::digest(data))
}

/// agentd's config for a toolbox of Claude `version` from `registry`, cached
/// in `cache`.
fn fake_config(registry: &str, cache: &Path, version: &str) -> serde_json::Value {
    // (The console's packages are pinned to npm's own tarballs, which
    // this registry does not serve.)
    serde_json::json!({"toolbox": {
        "agents": ["claude"],
        "versions": {"claude": version},
        "registry": registry,
        "cache_dir": cache,
    }, "console": {"enable": false}})
}

fn packument(base: &str, version: &str, integrity: &str) -> (String, Vec<u8>) {
    let arch = if std::env::consts::ARCH == "aarch64" {
        "arm64"
    } else {
        "x64"
    };
    (
        format!("/@anthropic-ai%2fclaude-code-linux-{arch}/{version}"),
        serde_json::json!({"dist": {
            "tarball": format!("{base}/t/claude-{version}.tgz"),
            "integrity": format!("sha512-{integrity}"),
        }})
        .to_string()
        .into_bytes(),
    )
}

#[test]
fn a_package_from_the_registry_runs_in_the_sandbox_and_a_tampered_one_is_never_installed() {
    let tmp = tempfile::tempdir().unwrap();
    let good = fake_claude_tgz(&tmp.path().join("good"), "9.9.9 (stand-in Claude)");
    let evil = fake_claude_tgz(&tmp.path().join("evil"), "pwned");
    // 9.9.9 as the registry vouches for it; 6.6.6's tarball is not the one
    // its metadata names (a mirror or a proxy swapped it).
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let served = format!("http://{}", listener.local_addr().unwrap());
    serve(
        listener,
        vec![
            packument(&served, "9.9.9", &sha512_base64(&good)),
            ("/t/claude-9.9.9.tgz".into(), good.clone()),
            packument(&served, "6.6.6", &sha512_base64(&good)),
            ("/t/claude-6.6.6.tgz".into(), evil),
            packument(&served, "9.9.8", &sha512_base64(&good)),
            ("/t/claude-9.9.8.tgz".into(), good.clone()),
        ],
    );
    let cache = tmp.path().join("cache");

    // The tampered one: refused, and nothing of it in the cache.
    let config = tmp.path().join("evil.json");
    std::fs::write(&config, fake_config(&served, &cache, "6.6.6").to_string()).unwrap();
    let out = install_agents(&config);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the tarball's sha512 is") && err.contains("nothing was installed"),
        "{err}"
    );
    let left: Vec<PathBuf> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.ends_with(".lock"))
        .collect();
    assert!(left.is_empty(), "{left:?}");

    // A sandbox of an agentd configured for it: the launcher says it is not
    // there, and nothing of the tampered package runs.
    let env = Env::with_config(&fake_config(&served, &cache, "6.6.6"));
    wait_for("the failed install", Duration::from_secs(60), || {
        env.log().contains("agent toolbox incomplete")
    });
    env.create_running("tampered", &[]);
    let out = env.ctl(&["exec", "tampered", "--", "claude", "--version"]);
    assert_eq!(out.status.code(), Some(127));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("claude: version 6.6.6 is not installed yet"),
        "{err}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("pwned"));
    drop(env);

    // The good one: installed in the background at startup, and run.
    let env = Env::with_config(&fake_config(&served, &cache, "9.9.9"));
    wait_for("the toolbox", Duration::from_secs(60), || {
        env.log().contains("agent toolbox ready")
    });
    env.create_running("good", &[]);
    let out = env.ok(&["exec", "good", "--", "claude", "--version"]);
    assert_eq!(out, "9.9.9 (stand-in Claude)\n");
    let installed = cache.join("claude-9.9.9");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(installed.join("claude"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o7777, 0o755);
    assert!(!cache.join("claude-6.6.6").exists());
    drop(env);

    // Installed while a sandbox runs (`agentd --install-agents` beside an
    // agentd that does not download): the sandbox runs it at once, and its
    // status says so, without a restart.
    let mut cfg = fake_config(&served, &cache, "9.9.8");
    cfg["toolbox"]["download"] = false.into();
    let env = Env::with_config(&cfg);
    env.create_running("later", &[]);
    assert_eq!(
        env.status("later")["agents"],
        "claude 9.9.8 (not installed yet)"
    );
    let config = tmp.path().join("later.json");
    std::fs::write(&config, cfg.to_string()).unwrap();
    let out = install_agents(&config);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(env.status("later")["agents"], "claude 9.9.8");
    let out = env.ok(&["exec", "later", "--", "claude", "--version"]);
    assert_eq!(out, "9.9.9 (stand-in Claude)\n");
}

#[test]
fn the_consoles_terminal_code_is_installed_only_as_the_project_pins_it() {
    let tmp = tempfile::tempdir().unwrap();
    // A registry (a mirror, a proxy) that vouches for a tarball of its
    // own: its digest matches its metadata, not agentd's pin.
    let evil = fake_claude_tgz(&tmp.path().join("evil"), "pwned");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let served = format!("http://{}", listener.local_addr().unwrap());
    let meta = serde_json::json!({"dist": {
        "tarball": format!("{served}/t/xterm-6.0.0.tgz"),
        "integrity": format!("sha512-{}", sha512_base64(&evil)),
    }});
    serve(
        listener,
        vec![
            (
                "/@xterm%2fxterm/6.0.0".into(),
                meta.to_string().into_bytes(),
            ),
            ("/t/xterm-6.0.0.tgz".into(), evil),
        ],
    );
    let cache = tmp.path().join("cache");
    let config = tmp.path().join("agentd.json");
    let cfg = serde_json::json!({"toolbox": {
        "agents": [],
        "registry": served,
        "cache_dir": cache,
    }});
    std::fs::write(&config, cfg.to_string()).unwrap();
    let out = install_agents(&config);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("@xterm/xterm@6.0.0: the tarball's sha512 is")
            && err.contains("agentd pins TQwDdQGtwwDt")
            && err.contains("nothing was installed"),
        "{err}"
    );
    assert!(!cache.join("xterm-6.0.0").exists());
}

/// Serve `files` (URL path → body) over HTTP/1.1 on `listener`: a
/// registry on loopback.
fn serve(listener: TcpListener, files: Vec<(String, Vec<u8>)>) {
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut line = String::new();
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            let mut h = String::new();
            while reader.read_line(&mut h).is_ok_and(|n| n > 2) {
                h.clear();
            }
            let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
            let reply = match files.iter().find(|(p, _)| *p == path) {
                Some((_, body)) => {
                    let mut r = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    )
                    .into_bytes();
                    r.extend_from_slice(body);
                    r
                }
                None => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    .to_vec(),
            };
            let _ = conn.write_all(&reply);
        }
    });
}

#[test]
fn the_agents_logins_stay_with_their_sandbox_across_restarts_and_go_with_it() {
    let mut env = Env::new();
    env.create_running("login", &[]);
    env.create_running("other", &[]);
    // What `claude login`, `codex login` and `gemini` leave in the home.
    sh(
        &env,
        "login",
        "mkdir -p ~/.claude ~/.codex ~/.gemini && echo token > ~/.claude/.credentials.json \
         && echo '{}' > ~/.claude.json && echo token > ~/.codex/auth.json \
         && echo token > ~/.gemini/oauth_creds.json",
    );
    let read = "cat ~/.claude/.credentials.json ~/.claude.json ~/.codex/auth.json ~/.gemini/oauth_creds.json";
    env.ok(&["stop", "login"]);
    env.ok(&["start", "login"]);
    assert_eq!(sh(&env, "login", read), "token\n{}\ntoken\ntoken\n");
    // agentd killed and started again: the running sandbox is adopted
    // with its home.
    env.kill_agentd();
    env.start_agentd();
    assert_eq!(sh(&env, "login", read), "token\n{}\ntoken\ntoken\n");
    // Another sandbox of the same owner sees none of it.
    let out = sh(
        &env,
        "other",
        "ls -A ~; cat ~/.claude/.credentials.json 2>&1 || true",
    );
    assert!(!out.contains("token"), "{out}");
    // Destroyed with the sandbox: nothing of the home is left on the host.
    env.ok(&["stop", "login"]);
    env.ok(&["destroy", "--force", "login"]);
    assert!(!env.state_dir.join("sandboxes/login").exists());
    assert!(!env.state_dir.join("disks/login.img").exists());
    let mut leftovers = Vec::new();
    for entry in walk(&env.state_dir) {
        // (Disk images are large and sparse: a 6-byte file is all we look for.)
        let small = std::fs::metadata(&entry).is_ok_and(|m| m.len() < 64);
        if small && std::fs::read(&entry).is_ok_and(|b| b == b"token\n") {
            leftovers.push(entry);
        }
    }
    // The other sandbox holds no such file either.
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Every regular file under `dir` (not following links).
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let p = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => out.extend(walk(&p)),
            Ok(t) if t.is_file() => out.push(p),
            _ => {}
        }
    }
    out
}

#[test]
fn a_shared_agent_home_is_one_owner_s_across_sandboxes_and_outlives_them() {
    let env = Env::new();
    // (The first to use it sets its size: 64 MiB.)
    env.create_running("one", &["--agent-home", "shared", "--disk", "64"]);
    env.create_running("two", &["--agent-home", "shared"]);
    env.create_running("mine", &[]);
    // A login in one sandbox (what `claude login`, `codex login` and
    // `gemini` leave, where the variables point them)...
    sh(
        &env,
        "one",
        "echo token > $CLAUDE_CONFIG_DIR/.credentials.json && echo '{}' > $CLAUDE_CONFIG_DIR/.claude.json \
         && echo token > $CODEX_HOME/auth.json && mkdir -p $GEMINI_CLI_HOME/.gemini \
         && echo token > $GEMINI_CLI_HOME/.gemini/oauth_creds.json",
    );
    // ...is the other's at once, its own to change (files of the sandbox's
    // root, whichever host uid each sandbox runs as).
    let read = "cat $CLAUDE_CONFIG_DIR/.credentials.json $CLAUDE_CONFIG_DIR/.claude.json \
                $CODEX_HOME/auth.json $GEMINI_CLI_HOME/.gemini/oauth_creds.json";
    assert_eq!(sh(&env, "two", read), "token\n{}\ntoken\ntoken\n");
    assert_eq!(
        sh(
            &env,
            "two",
            "stat -c %u $CODEX_HOME/auth.json; echo refreshed > $CODEX_HOME/auth.json"
        ),
        "0\n"
    );
    assert_eq!(sh(&env, "one", "cat $CODEX_HOME/auth.json"), "refreshed\n");
    // What a sandbox stores there is root's on the host: no set-id bit of
    // it works through the mount.
    let mount = sh(&env, "one", "grep ' /run/agent-home ' /proc/mounts");
    assert!(
        mount.contains("nosuid") && mount.contains("nodev"),
        "{mount}"
    );
    // A sandbox of its own home sees none of it.
    let out = sh(
        &env,
        "mine",
        "echo \"${CLAUDE_CONFIG_DIR:-unset}\"; ls /run/agent-home 2>&1 || true",
    );
    assert!(out.starts_with("unset\n"), "{out}");
    assert!(!out.contains("claude"), "{out}");
    // On the host: the owner's directory, agentd's alone.
    let uid = nix::unistd::Uid::effective().as_raw();
    let store = env.state_dir.join(format!("agent-homes/{uid}"));
    let meta = std::fs::metadata(&store).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
        0o700
    );
    // Its own image (as root): a sandbox cannot fill the host through it.
    if common::is_root() {
        assert!(agentd::disk::is_mount_point(&store), "{}", store.display());
        let out = env.ctl(&[
            "exec",
            "two",
            "--",
            "sh",
            "-c",
            "dd if=/dev/zero of=$CODEX_HOME/fill bs=1M count=100 2>&1; rm -f $CODEX_HOME/fill",
        ]);
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(said.contains("No space left on device"), "{said}");
    }
    let creds = store.join("codex/auth.json");
    assert_eq!(std::fs::read_to_string(&creds).unwrap(), "refreshed\n");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&creds).unwrap()),
        uid
    );
    // The logins outlive the sandboxes: a new one finds them.
    for name in ["one", "two"] {
        env.ok(&["stop", name]);
        env.ok(&["destroy", "--force", name]);
    }
    env.create_running("three", &["--agent-home", "shared"]);
    assert_eq!(
        sh(&env, "three", "cat $CODEX_HOME/auth.json"),
        "refreshed\n"
    );
    // Only where it works: a microvm sandbox is refused, naming the choice.
    let repo = env.repo("vmhome");
    let err = env.fails(
        4,
        &[
            "create",
            "--backend",
            "microvm",
            "--agent-home",
            "shared",
            repo.to_str().unwrap(),
        ],
    );
    assert!(
        err.contains("agent_home \"shared\" works in local and vm sandboxes"),
        "{err}"
    );
}

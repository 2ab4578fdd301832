//! Pushes to a forge without a token in the sandbox (agentd/src/forges.rs,
//! the gateway's egress/forge.rs): a git smart-HTTP forge over HTTPS on the
//! host (`git http-backend` behind Basic authentication) stands in for
//! GitHub; git inside a real `local` sandbox pushes and fetches through the
//! gateway, which swaps the token in and checks every push's refs first.

mod common;

use common::Env;
use common::tls::{Origin, tls};

const HOST: &str = "forge.test";

fn sh(env: &Env, name: &str, script: &str) -> (i32, String) {
    env.inside(name, script)
}

/// The refs of the forge's repository.
fn forge_refs(root: &std::path::Path) -> String {
    common::git(
        &root.join("acme/app.git"),
        &["for-each-ref", "--format=%(refname) %(objectname)"],
    )
}

#[test]
fn an_agent_pushes_its_branches_with_a_token_it_never_holds() {
    let mut env = Env::bus_only();
    let certs = tls(env.tmp.path(), &[HOST]);
    // The forge: a bare repository with a `main`, and its token.
    let root = env.tmp.path().join("forge");
    let seed = common::repo_in(env.tmp.path(), "seed");
    std::fs::create_dir_all(root.join("acme")).unwrap();
    common::git(
        env.tmp.path(),
        &[
            "clone",
            "-q",
            "--bare",
            seed.to_str().unwrap(),
            root.join("acme/app.git").to_str().unwrap(),
        ],
    );
    let token = format!("ghp_{}", uuid::Uuid::new_v4().simple());
    std::fs::write(
        env.tmp.path().join("forge.json"),
        serde_json::json!({"root": root, "user": "x-access-token", "token": token}).to_string(),
    )
    .unwrap();
    let origin = Origin::for_secrets(
        &mut env,
        &certs,
        &[HOST],
        ("origin.py", include_str!("forge/origin.py")),
    );
    let url = format!("https://{HOST}:{}/acme/app", origin.port);
    let token_file = env.tmp.path().join("token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let out = env.ok(&[
        "forge",
        "allow",
        "sec",
        &url,
        "--token-file",
        token_file.to_str().unwrap(),
        "--branches",
        "agent/*",
    ]);
    assert!(out.contains("may push to"), "{out}");
    let listed: serde_json::Value =
        serde_json::from_str(&env.ok(&["forge", "list", "sec", "--json"])).unwrap();
    assert_eq!(
        listed,
        serde_json::json!([{"url": url, "user": "x-access-token", "branches": ["agent/*"], "tags": false}])
    );

    // A clone and a push of an agent's branch: the forge gets the token.
    let (code, out) = sh(
        &env,
        "sec",
        &format!(
            "set -e; cd /tmp; git clone -q {url}.git app; cd app; \
             git -c user.name=A -c user.email=a@example.com commit -q --allow-empty -m work; \
             git push -q origin HEAD:refs/heads/agent/x 2>&1; git rev-parse HEAD"
        ),
    );
    assert_eq!(code, 0, "{out}");
    let pushed = out.lines().last().unwrap().to_owned();
    assert!(forge_refs(&root).contains(&format!("refs/heads/agent/x {pushed}")));
    let requests = origin.requests();
    let expected = format!(
        "Basic {}",
        base64::Engine::encode(
            &base64::engine::general_purpose::STANDARD,
            format!("x-access-token:{token}")
        )
    );
    let receive: Vec<_> = requests
        .iter()
        .filter(|r| {
            r["method"] == "POST" && r["path"].as_str().unwrap().ends_with("/git-receive-pack")
        })
        .collect();
    assert_eq!(receive.len(), 1, "{requests:?}");
    assert_eq!(receive[0]["authorization"], expected.as_str());

    // What the rules do not allow never reaches the forge: a push to main,
    // a deletion, a tag.
    let before = forge_refs(&root);
    for (what, push) in [
        ("main", "git push origin HEAD:refs/heads/main"),
        ("a deletion", "git push origin :refs/heads/agent/x"),
        ("a tag", "git tag v1 && git push origin v1"),
        ("a note", "git push origin HEAD:refs/notes/x"),
    ] {
        let (code, out) = sh(&env, "sec", &format!("cd /tmp/app && {push} 2>&1"));
        assert_ne!(code, 0, "{what} was pushed: {out}");
        assert!(out.contains("keystone: push to"), "{what}: {out}");
        assert!(out.contains("[remote rejected]"), "{what}: {out}");
    }
    assert_eq!(forge_refs(&root), before);
    let receive_posts = origin
        .requests()
        .iter()
        .filter(|r| {
            r["method"] == "POST" && r["path"].as_str().unwrap().ends_with("/git-receive-pack")
        })
        .count();
    assert_eq!(receive_posts, 1, "a refused push reached the forge");

    // A fetch works.
    let (code, out) = sh(
        &env,
        "sec",
        "cd /tmp/app && git fetch -q origin 2>&1 && git branch -r",
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("origin/agent/x"), "{out}");

    // Every push is logged with its refs and what was decided.
    let log = env.ok(&["egress", "sec", "log", "--json"]);
    assert!(log.contains("git-push"), "{log}");
    assert!(
        log.contains("refs/heads/agent/x") && log.contains("allowed"),
        "{log}"
    );
    assert!(
        log.contains("refs/heads/main") && log.contains("not an allowed branch"),
        "{log}"
    );

    // The token is nowhere inside: no environment, no file of its own, no
    // answer (all printed here and looked at on the host).
    let (_, seen) = sh(
        &env,
        "sec",
        "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; git -C /tmp/app config -l; \
         find /workspace /root /tmp /run /var/tmp -path /run/keystone -prune -o \
           -type f -size -1M -print0 2>/dev/null | xargs -0 cat 2>/dev/null; true",
    );
    assert!(
        seen.contains("keystone-placeholder-"),
        "the environments were read"
    );
    assert!(!seen.contains(&token), "the token is inside the sandbox");
    let store = env.state_dir.join("secrets");
    let leaks = common::files_with(&env.state_dir, token.as_bytes(), &store);
    assert!(leaks.is_empty(), "{leaks:?}");
    assert!(!env.log().contains(&token));
    assert!(!log.contains(&token));

    // Another sandbox, with the first one's placeholder: the forge sees the
    // placeholder, never the token.
    let placeholder = seen
        .lines()
        .find_map(|l| {
            l.split("keystone-placeholder-")
                .nth(1)
                .map(|r| r[..32].to_owned())
        })
        .unwrap();
    env.create_running("other", &[]);
    env.ok(&[
        "egress",
        "other",
        "allow",
        &format!("127.0.0.1/32:{}", origin.port),
    ]);
    env.ok(&["cp", certs.ca.to_str().unwrap(), "other:/tmp/test-ca.pem"]);
    let n = origin.requests().len();
    let (code, out) = sh(
        &env,
        "other",
        &format!(
            "GIT_SSL_CAINFO=/tmp/test-ca.pem git ls-remote \
             https://x-access-token:keystone-placeholder-{placeholder}@{HOST}:{}/acme/app.git 2>&1",
            origin.port
        ),
    );
    assert_ne!(code, 0, "{out}");
    let later = origin.requests();
    assert!(
        later.len() > n,
        "the other sandbox reached the forge: {out}"
    );
    assert!(
        later[n..]
            .iter()
            .all(|r| r["authorization"] != expected.as_str())
    );

    // Removed: git inside no longer gets the placeholder, and the forge no
    // longer the token.
    env.ok(&["forge", "rm", "sec", &url]);
    let (code, _) = sh(
        &env,
        "sec",
        "cd /tmp/app && GIT_TERMINAL_PROMPT=0 git fetch -q origin 2>&1",
    );
    assert_ne!(code, 0);
}

#[test]
fn bad_forges_are_refused_with_every_problem() {
    let env = Env::running("bad", &[]);
    let token = env.tmp.path().join("t");
    std::fs::write(&token, "two words\n").unwrap();
    let out = env.ctl(&[
        "forge",
        "allow",
        "bad",
        "http://localhost/x",
        "--token-file",
        token.to_str().unwrap(),
        "--branches",
        "a b",
        "--user",
        "me you",
    ]);
    assert_eq!(out.status.code(), Some(4));
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "is not a repository URL",
        "branch pattern 'a b'",
        "user 'me you'",
        "printable text without spaces",
    ] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
    assert_eq!(env.ok(&["forge", "list", "bad", "--json"]).trim(), "[]");
    assert_eq!(
        env.ctl(&["forge", "rm", "bad", "https://github.com/a/b"])
            .status
            .code(),
        Some(1)
    );
}

/// Another local user can neither list, add nor remove a sandbox's
/// forges: each call is refused as another user's, and nothing changes.
#[test]
fn another_user_can_neither_see_nor_change_a_sandbox_s_forges() {
    if !common::is_root() {
        eprintln!("skipped: needs root to run as another uid");
        return;
    }
    let env = Env::running("theirs", &[]);
    let token = std::env::temp_dir().join(format!("ks-forge-token-{}", std::process::id()));
    std::fs::write(&token, "tok-0123456789abcdef\n").unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let t = token.to_str().unwrap();
    let url = format!("https://{HOST}/acme/app");
    env.ok(&[
        "forge",
        "allow",
        "theirs",
        &url,
        "--token-file",
        t,
        "--branches",
        "agent/*",
    ]);
    let before = env.ok(&["forge", "list", "theirs", "--json"]);
    let other = format!("https://{HOST}/acme/other");
    for args in [
        vec!["forge", "list", "theirs", "--json"],
        vec![
            "forge",
            "allow",
            "theirs",
            &other,
            "--token-file",
            t,
            "--branches",
            "*",
        ],
        vec!["forge", "rm", "theirs", &url],
    ] {
        let out = env.ctl_as(Some(65534), &args);
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(out.status.code(), Some(4), "{args:?}: {stdout} {stderr}");
        assert!(stderr.contains("another user"), "{args:?}: {stderr}");
        assert!(!stdout.contains("acme"), "{args:?}: {stdout}");
    }
    // The methods themselves refuse, not only agentctl's lookup.
    for (member, args) in [
        ("Forges", vec![]),
        ("RemoveForge", vec!["s", url.as_str()]),
        (
            "AllowForge",
            vec![
                "ssasbay",
                other.as_str(),
                "",
                "1",
                "*",
                "false",
                "3",
                "97",
                "98",
                "99",
            ],
        ),
    ] {
        let out = env.busctl_as(Some(65534), "call", ("theirs", "Secrets", member), &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{member}: {out:?}");
        assert!(stderr.contains("another user"), "{member}: {stderr}");
    }
    std::fs::remove_file(&token).unwrap();
    assert_eq!(env.ok(&["forge", "list", "theirs", "--json"]), before);
    assert!(
        before.contains("acme/app") && !before.contains("acme/other"),
        "{before}"
    );
}

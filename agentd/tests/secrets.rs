//! Secrets the agent can use but not read (agentd/src/secrets.rs, the
//! gateway's egress/intercept.rs): an HTTPS origin on the host stands in
//! for an agent's API; a request from inside a real `local` sandbox that
//! carries the placeholder reaches it with the real value in the named
//! header only, while the value appears nowhere the sandbox can look.

mod common;

use std::io::Write;
use std::process::Stdio;

use common::Env;
use common::tls::{Origin, tls};

fn sh(env: &Env, script: &str) -> String {
    env.ok(&["exec", "sec", "--", "sh", "-c", script])
}

#[test]
fn a_secret_reaches_its_host_in_its_header_only_and_never_the_sandbox() {
    let mut env = Env::bus_only();
    let certs = tls(env.tmp.path(), &["api.secret.test", "other.secret.test"]);
    // agentd checks the origin's certificate as it would a real API's: the
    // test CA is its trusted store.
    let origin = Origin::for_secrets(
        &mut env,
        &certs,
        &["api.secret.test", "other.secret.test"],
        ("origin.py", include_str!("secrets/origin.py")),
    );
    let port = origin.port;

    // Set from standard input: the value is in no process's command line
    // while agentctl holds it.
    let value = format!("sk-test-{}", uuid::Uuid::new_v4().simple());
    let mut set = env
        .ctl_cmd(&[
            "secret",
            "set",
            "sec",
            "ANTHROPIC_API_KEY",
            "--host",
            "api.secret.test",
            "--header",
            "x-api-key",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = set.stdin.take().unwrap();
    stdin.write_all(format!("{value}\n").as_bytes()).unwrap();
    let in_argv: Vec<_> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .filter(|c| c.windows(value.len()).any(|w| w == value.as_bytes()))
        .collect();
    assert!(in_argv.is_empty(), "the value is in a command line");
    drop(stdin);
    let out = set.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Inside: a placeholder, and the sandbox's CA trusted by the clients.
    let placeholder = sh(&env, "printf %s \"$ANTHROPIC_API_KEY\"");
    assert!(
        placeholder.starts_with("keystone-placeholder-"),
        "{placeholder}"
    );
    // (Named by the sandbox's id: a listing of the directory, which every
    // sandbox sees, tells nothing of whose sandboxes have secrets.)
    let id = env.status("sec")["id"].as_str().unwrap().to_owned();
    let ca_env = sh(&env, "echo $NODE_EXTRA_CA_CERTS $SSL_CERT_FILE");
    assert_eq!(
        ca_env.trim(),
        format!("/run/keystone/ca/{id}.ca.pem /run/keystone/ca/{id}.pem")
    );

    // The request carries the placeholder twice: the host gets the value
    // in x-api-key only. Its answer echoes what it got: the sandbox sees
    // the value masked.
    let answer = sh(
        &env,
        &format!(
            "curl -sS --max-time 20 -H \"x-api-key: $ANTHROPIC_API_KEY\" \
             -H \"x-other: $ANTHROPIC_API_KEY\" https://api.secret.test:{port}/v1/messages"
        ),
    );
    let got = origin.requests();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["x-api-key"], value.as_str());
    assert_eq!(got[0]["x-other"], placeholder.as_str());
    assert_eq!(answer, format!("echo {}", "*".repeat(value.len())));

    // The placeholder sent to a host without a secret arrives unchanged
    // (no interception there: the origin's own certificate, checked
    // against the test CA inside).
    sh(
        &env,
        &format!(
            "curl -sS --max-time 20 --cacert /tmp/test-ca.pem -H \"x-api-key: $ANTHROPIC_API_KEY\" \
             https://other.secret.test:{port}/"
        ),
    );
    let got = origin.requests();
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[1]["x-api-key"], placeholder.as_str());

    // The value is nowhere inside: no process's environment, no file the
    // sandbox can write or read of its own (all of them printed here, and
    // looked at on the host, so that no command carries the value).
    let seen = sh(
        &env,
        "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; \
         find /workspace /root /tmp /run /var/tmp -path /run/keystone -prune -o \
           -type f -size -1M -print0 2>/dev/null | xargs -0 cat 2>/dev/null; true",
    );
    assert!(seen.contains(&placeholder), "the environments were read");
    assert!(!seen.contains(&value), "the value is inside the sandbox");

    // Listed without its value; kept out of the registry, the history and
    // every log (only agentd's secret store holds it).
    let list: serde_json::Value =
        serde_json::from_str(&env.ok(&["secret", "list", "sec", "--json"])).unwrap();
    assert_eq!(
        list,
        serde_json::json!([{"var": "ANTHROPIC_API_KEY", "host": "api.secret.test",
                             "header": "x-api-key", "bearer": false}])
    );
    let store = env.state_dir.join("secrets");
    let leaks = common::files_with(&env.state_dir, value.as_bytes(), &store);
    assert!(leaks.is_empty(), "{leaks:?}");
    assert!(!env.log().contains(&value));
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&store).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o700);
    assert!(!env.ok(&["history", "sec", "--json"]).contains(&value));

    // Another uid sees nothing of them.
    if common::is_root() {
        let out = env.ctl_as(Some(65534), &["secret", "list", "sec"]);
        assert!(!out.status.success());
    }

    // Removed: the next request is not intercepted, and destroy leaves
    // nothing of the sandbox's secrets or CA.
    env.ok(&["secret", "rm", "sec", "ANTHROPIC_API_KEY"]);
    assert!(
        sh(&env, "printf %s \"${ANTHROPIC_API_KEY:-unset}\"") == "unset",
        "a removed secret's variable is gone from new commands"
    );
    env.ok(&["stop", "sec"]);
    env.ok(&["destroy", "--force", "sec"]);
    let left: Vec<_> = std::fs::read_dir(&store)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn bad_secrets_are_refused_with_every_problem_and_change_nothing() {
    let env = Env::running("bad", &[]);
    let mut c = env
        .ctl_cmd(&[
            "secret",
            "set",
            "bad",
            "lower case",
            "--host",
            "localhost",
            "--header",
            "x api",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(b"a\nb\n").unwrap();
    let out = c.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(4));
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "'lower case' is not a variable name",
        "host 'localhost' is not a DNS name",
        "header 'x api' is not a header name",
        "printable text on one line",
    ] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
    assert_eq!(env.ok(&["secret", "list", "bad", "--json"]).trim(), "[]");
    let err = env.fails(1, &["secret", "rm", "bad", "NOPE"]);
    assert!(err.contains("has no secret named NOPE"), "{err}");
}

#[test]
fn a_declared_secret_is_read_from_its_file_at_each_start_and_changed_only_there() {
    // agentd's configuration names the file (NixOS: an agenix or sops-nix
    // path); the value never passes through agentctl.
    let mut env = Env::bus_only();
    let certs = tls(env.tmp.path(), &["api.secret.test"]);
    env.agentd_env
        .push(("SSL_CERT_FILE".into(), Some(certs.ca.display().to_string())));
    let repo = env.repo("decl");
    let user = common::user_name();
    let key = env.tmp.path().join("anthropic.key");
    let first = format!("sk-first-{}", uuid::Uuid::new_v4().simple());
    std::fs::write(&key, format!("{first}\n")).unwrap();
    let origin = Origin::start(
        env.tmp.path(),
        "origin.py",
        include_str!("secrets/origin.py"),
        &certs,
    );
    // (Its settings are the configuration's, the origin's port admitted
    // there: a declared sandbox's are set anew at each agentd start.)
    let config = env.tmp.path().join("agentd.json");
    let secret = serde_json::json!({"file": key, "host": "api.secret.test", "header": "x-api-key"});
    std::fs::write(
        &config,
        serde_json::json!({
            "egress": {"hosts": {"api.secret.test": "127.0.0.1"}},
            "sandboxes": {"decl": {"project": repo, "owner": user, "backend": "local",
                                   "egress_allow": [format!("127.0.0.1/32:{}", origin.port)],
                                   "secrets": {"ANTHROPIC_API_KEY": secret}}}
        })
        .to_string(),
    )
    .unwrap();
    env.config = Some(config);
    env.start_agentd();
    env.ok(&["start", "decl"]);
    let call = format!(
        "curl -sS --max-time 20 -H \"x-api-key: $ANTHROPIC_API_KEY\" \
         https://api.secret.test:{}/v1/messages",
        origin.port
    );
    let run = |script: &str| env.ok(&["exec", "decl", "--", "sh", "-c", script]);
    let placeholder = run("printf %s \"$ANTHROPIC_API_KEY\"");
    assert!(
        placeholder.starts_with("keystone-placeholder-"),
        "{placeholder}"
    );
    assert_eq!(run(&call), format!("echo {}", "*".repeat(first.len())));
    assert_eq!(origin.requests()[0]["x-api-key"], first.as_str());

    // Changed over the bus: refused, naming where it is changed.
    let err = env.fails(4, &["secret", "rm", "decl", "ANTHROPIC_API_KEY"]);
    assert!(
        err.contains("keystone.agent.sandboxes.decl.secrets.ANTHROPIC_API_KEY"),
        "{err}"
    );

    // A new value in the file (a rotated key) takes effect at the next
    // start; the placeholder stays what running agents hold.
    let second = format!("sk-second-{}", uuid::Uuid::new_v4().simple());
    std::fs::write(&key, format!("{second}\n")).unwrap();
    env.ok(&["stop", "decl"]);
    env.ok(&["start", "decl"]);
    assert_eq!(run("printf %s \"$ANTHROPIC_API_KEY\""), placeholder);
    run(&call);
    assert_eq!(origin.requests()[1]["x-api-key"], second.as_str());
    // Rotated while agentd was down: the running sandbox's requests carry
    // the new value once agentd is back, without a restart of the sandbox.
    let third = format!("sk-third-{}", uuid::Uuid::new_v4().simple());
    env.kill_agentd();
    std::fs::write(&key, format!("{third}\n")).unwrap();
    env.start_agentd();
    assert_eq!(env.state("decl"), "running");
    let run = |script: &str| env.ok(&["exec", "decl", "--", "sh", "-c", script]);
    run(&call);
    assert_eq!(origin.requests()[2]["x-api-key"], third.as_str());
    let store = env.state_dir.join("secrets");
    for v in [&first, &second, &third] {
        let leaks = common::files_with(&env.state_dir, v.as_bytes(), &store);
        assert!(leaks.is_empty(), "{leaks:?}");
        assert!(!env.log().contains(v.as_str()));
    }

    // A file that is gone fails the start, naming the variable's file, and
    // leaves the sandbox in error with that reason.
    std::fs::remove_file(&key).unwrap();
    env.ok(&["stop", "decl"]);
    let err = env.fails(3, &["start", "decl"]);
    assert!(
        err.contains(&format!(
            "cannot read {}, the file of secret ANTHROPIC_API_KEY",
            key.display()
        )),
        "{err}"
    );
    assert_eq!(env.state("decl"), "error");
}

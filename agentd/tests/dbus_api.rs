//! The D-Bus interface itself: introspection matches the committed XML,
//! properties announce their changes, declared sandboxes, --check-config.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{AGENTD, Env};

fn doc_xml() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/org.keystone.Agent1.xml")
}

/// The `<interface name="org.keystone.Agent1.*">` blocks of an introspection
/// document (each once), without comments and blank lines.
fn our_interfaces(xml: &str) -> Vec<String> {
    let mut text = String::new();
    let mut rest = xml;
    while let Some(start) = rest.find("<!--") {
        text.push_str(&rest[..start]);
        let end = rest[start..].find("-->").unwrap() + start + 3;
        rest = &rest[end..];
    }
    text.push_str(rest);
    let mut out: Vec<String> = Vec::new();
    let mut rest = text.as_str();
    while let Some(start) = rest.find("<interface name=\"org.keystone.Agent1.") {
        let end = rest[start..].find("</interface>").unwrap() + start + "</interface>".len();
        let block: Vec<&str> = rest[start..end]
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let block = block.join("\n");
        if !out.contains(&block) {
            out.push(block);
        }
        rest = &rest[end..];
    }
    out
}

fn introspect(env: &Env, path: &str) -> String {
    let out = Command::new("busctl")
        .args([
            &format!("--address={}", env.address),
            "introspect",
            "--xml-interface",
            "org.keystone.Agent1",
            path,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn live_interfaces_match_the_committed_xml() {
    let env = Env::new();
    let repo = env.repo("xml");
    env.ok(&["create", repo.to_str().unwrap()]);
    let both = introspect(&env, "/org/keystone/Agent1")
        + &introspect(&env, "/org/keystone/Agent1/sandbox/xml");
    let live = our_interfaces(&both);
    // Manager, Records, Sandbox, Secrets, Ssh and State.
    assert_eq!(live.len(), 6);
    if std::env::var_os("KEYSTONE_BLESS").is_some() {
        let doc = format!(
            "<!DOCTYPE node PUBLIC \"-//freedesktop//DTD D-BUS Object Introspection 1.0//EN\"\n \
             \"http://www.freedesktop.org/standards/dbus/1.0/introspect.dtd\">\n\
             <!-- org.keystone.Agent1: the manager at /org/keystone/Agent1 and one sandbox object\n     \
             per sandbox at /org/keystone/Agent1/sandbox/<name> ('-' becomes '_').\n     \
             See docs/dbus-api.md. -->\n<node>\n{}\n</node>\n",
            live.join("\n")
        );
        fs::write(doc_xml(), doc).unwrap();
    }
    let committed = our_interfaces(&fs::read_to_string(doc_xml()).unwrap());
    assert_eq!(
        live, committed,
        "the live interface differs from docs/org.keystone.Agent1.xml; if the change is intended, \
         update the docs and run this test with KEYSTONE_BLESS=1"
    );
}

#[test]
fn state_changes_are_announced() {
    let env = Env::new();
    let repo = env.repo("sig");
    env.ok(&["create", repo.to_str().unwrap()]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let seen = rt.block_on(async {
        use futures_lite::StreamExt as _;
        let conn = zbus::connection::Builder::address(env.address.as_str())
            .unwrap()
            .build()
            .await
            .unwrap();
        let props = zbus::fdo::PropertiesProxy::builder(&conn)
            .destination("org.keystone.Agent1")
            .unwrap()
            .path("/org/keystone/Agent1/sandbox/sig")
            .unwrap()
            .build()
            .await
            .unwrap();
        // Every signal, in order (a property stream would coalesce values).
        let mut changes = props.receive_properties_changed().await.unwrap();
        // Signals go to connections agentd knows, never to the whole bus: a
        // client reads the state first, as any client would.
        let first = props
            .get_all(zbus::names::InterfaceName::from_static_str_unchecked(
                "org.keystone.Agent1.Sandbox",
            ))
            .await
            .unwrap();
        assert!(first.contains_key("State"));
        let mut seen = vec![String::from("created")];
        let mut start = env.ctl_cmd(&["start", "sig"]);
        let mut stop = env.ctl_cmd(&["stop", "sig"]);
        let drive = tokio::task::spawn_blocking(move || {
            assert!(start.status().unwrap().success());
            assert!(stop.status().unwrap().success());
        });
        while seen.last().map(String::as_str) != Some("stopped") {
            let signal = tokio::time::timeout(Duration::from_secs(20), changes.next())
                .await
                .unwrap()
                .unwrap();
            let args = signal.args().unwrap();
            if let Some(state) = args.changed_properties().get("State") {
                seen.push(String::try_from(state.try_clone().unwrap()).unwrap());
            }
        }
        drive.await.unwrap();
        seen
    });
    assert_eq!(
        seen,
        ["created", "starting", "running", "stopping", "stopped"]
    );
}

#[test]
fn declared_sandboxes_come_from_the_config_and_cannot_be_destroyed() {
    let mut env = Env::bus_only();
    let repo = env.repo("declared");
    let user = common::user_name();
    let config = env.tmp.path().join("agentd.json");
    fs::write(
        &config,
        serde_json::json!({
            "defaults": {"memory": 2048},
            "sandboxes": {"web": {"project": repo, "owner": user, "vcpus": 2, "ports": {"web": 3000}}}
        })
        .to_string(),
    )
    .unwrap();
    env.config = Some(config);
    env.start_agentd();
    let st = env.status("web");
    assert_eq!(st["declared"], true);
    assert_eq!(st["config"]["memory"], 2048);
    assert_eq!(st["config"]["vcpus"], 2);
    assert_eq!(st["ports"]["web"], 3000);
    env.ok(&["start", "web"]);
    assert_eq!(
        env.ok(&["exec", "web", "--", "cat", "README.md"]),
        "# declared\n"
    );
    env.ok(&["stop", "web"]);
    let err = env.fails(4, &["destroy", "--force", "web"]);
    assert!(err.contains("declared in agentd's configuration"), "{err}");
    assert_eq!(env.state("web"), "stopped");
}

#[test]
fn check_config_accepts_the_fixture_and_lists_every_problem() {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/agentd-config.json");
    let out = Command::new(AGENTD)
        .arg("--check-config")
        .arg(&fixture)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("2 declared sandbox(es): api, webapp"));

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    fs::write(
        &bad,
        r#"{"defaults": {"vcpus": 0}, "sandboxes": {"-x": {"project": "rel", "owner": ""}}}"#,
    )
    .unwrap();
    let out = Command::new(AGENTD)
        .arg("--check-config")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("problem(s)"), "{err}");
    for needle in [
        "defaults: vcpus",
        "sandboxes.-x: name",
        "sandboxes.-x: project",
        "sandboxes.-x: owner",
    ] {
        assert!(err.contains(needle), "missing {needle:?}: {err}");
    }
    fs::write(&bad, r#"{"sandbox": {}}"#).unwrap();
    let out = Command::new(AGENTD)
        .arg("--check-config")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `sandbox`"));
}

#[test]
fn exec_over_the_bus_returns_output_exit_code_and_named_timeout() {
    let env = Env::running("busexec", &[]);
    env.with_sandbox("busexec", async |sb| {
        let env_vars = std::collections::HashMap::from([("GREETING", "hi")]);
        let r = sb
            .exec(
                &["sh", "-c", "echo $GREETING; pwd; echo oops >&2; exit 5"],
                env_vars,
                "/tmp",
                0,
            )
            .await
            .unwrap();
        assert_eq!(r.exit_code, 5);
        assert_eq!(r.stdout, b"hi\n/tmp\n");
        assert_eq!(r.stderr, b"oops\n");
        match sb
            .exec(&["sleep", "30"], std::collections::HashMap::new(), "", 1)
            .await
        {
            Err(keystone_agent_api::Error::Timeout(m)) => assert!(m.contains("within 1s"), "{m}"),
            other => panic!("expected a Timeout error, got {other:?}"),
        }
        match sb.exec(&[], std::collections::HashMap::new(), "", 0).await {
            Err(keystone_agent_api::Error::InvalidArgument(m)) => {
                assert!(m.contains("no command"), "{m}")
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    });
}

#[test]
fn bad_options_are_refused_with_every_problem_and_change_nothing() {
    let env = Env::new();
    let repo = env.repo("opts");
    let call = |args: &[&str]| {
        Command::new("busctl")
            .arg(format!("--address={}", env.address))
            .args(["--", "call", "org.keystone.Agent1"])
            .args(args)
            .output()
            .unwrap()
    };
    // A string where a number belongs, a mode that does not exist, an
    // unknown key: all three named in one InvalidArgument.
    let out = call(&[
        "/org/keystone/Agent1",
        "org.keystone.Agent1.Manager",
        "CreateSandbox",
        "sa{sv}",
        repo.to_str().unwrap(),
        "3",
        "memory",
        "s",
        "lots",
        "network",
        "s",
        "wifi",
        "colour",
        "s",
        "red",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    for want in [
        "'memory' must be a uint32",
        "'wifi' is not one of",
        "unknown option 'colour'",
    ] {
        assert!(err.contains(want), "{want} missing from: {err}");
    }
    assert!(env.list().is_empty(), "a refused create made a sandbox");

    // The same reader serves the sandbox's methods.
    env.ok(&["create", repo.to_str().unwrap()]);
    let out = call(&[
        "/org/keystone/Agent1/sandbox/opts",
        "org.keystone.Agent1.Sandbox",
        "Configure",
        "a{sv}",
        "2",
        "sync_mode",
        "s",
        "sometimes",
        "sync_idle_seconds",
        "s",
        "9",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("'sometimes' is not one of"), "{err}");
    assert!(
        err.contains("'sync_idle_seconds' must be a uint32"),
        "{err}"
    );
    assert_eq!(env.status("opts")["config"]["sync_mode"], "manual");
}

/// A socket that accepts and then says nothing (no D-Bus handshake) does
/// not hold agentctl: it gives up within its connection timeout, exits 4
/// and names the bus and what to check.
#[test]
fn agentctl_gives_up_on_a_bus_that_never_answers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("silent.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().flatten() {
            held.push(conn);
        }
    });
    let bus = format!("unix:path={}", path.display());
    let started = std::time::Instant::now();
    let mut child = Command::new(common::agentctl())
        .args(["--bus", &bus, "list"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // (Bounded here too: a hang fails the test instead of holding it.)
    let deadline = started + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("agentctl still waits on a silent bus after 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("gave up after {:?}", started.elapsed());
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains(&bus) && err.contains("handshake"), "{err}");
}

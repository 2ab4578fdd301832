//! The `microvm` backend against a test double of systemd's D-Bus API (the
//! real path is covered by tests/nixos/): start and stop through
//! StartUnit/StopUnit with the unit's state followed by PropertiesChanged,
//! `running` only once the guest's sshd answers with the pinned host key,
//! commands over ssh, a failed unit reported with its result; the egress
//! gateway the guests share, each connection attributed to a sandbox by
//! its source address.

mod common;

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::AsRawFd as _;
use std::time::Duration;

use common::caddy::free_port;
use common::systemd::FakeSystemd;
use common::{Env, is_root, origin, wait_for};

/// The subnet of the tests' guests: their derived addresses are on
/// loopback, so a test can connect from them.
const SUBNET: &str = "127.0.0.0/16";

/// agentd with the double; every guest's sshd on 127.0.0.1 (`ssh_host`),
/// the gateway on a loopback port (returned).
fn setup() -> Option<(Env, FakeSystemd, SocketAddrV4)> {
    setup_with(|_| serde_json::json!({}))
}

/// [`setup`] with more of agentd's configuration (`extra`'s top-level
/// fields) and its environment.
fn setup_extra(
    extra: serde_json::Value,
    agentd_env: &[(&str, &str)],
) -> Option<(Env, FakeSystemd, SocketAddrV4)> {
    setup_full(|_| serde_json::json!({}), extra, agentd_env)
}

/// [`setup`] with `sandboxes` (given the test's environment) declared in
/// agentd's configuration.
fn setup_with(
    sandboxes: impl FnOnce(&Env) -> serde_json::Value,
) -> Option<(Env, FakeSystemd, SocketAddrV4)> {
    setup_full(sandboxes, serde_json::json!({}), &[])
}

fn setup_full(
    sandboxes: impl FnOnce(&Env) -> serde_json::Value,
    extra: serde_json::Value,
    agentd_env: &[(&str, &str)],
) -> Option<(Env, FakeSystemd, SocketAddrV4)> {
    if !is_root() {
        eprintln!("skipped: the stand-in guest (sshd in a mount namespace) needs root");
        return None;
    }
    let mut env = Env::bus_only();
    let port = free_port();
    let gateway = SocketAddrV4::new(Ipv4Addr::LOCALHOST, free_port());
    let fake = FakeSystemd::start(&env.address, env.state_dir.clone(), port);
    let config = env.tmp.path().join("agentd.json");
    for (k, v) in agentd_env {
        env.agentd_env.push(((*k).into(), Some((*v).into())));
    }
    let mut cfg = serde_json::json!({
        "sandboxes": sandboxes(&env),
        "microvm": {
            "systemd_bus": env.address,
            "ssh_user": "root",
            "ssh_port": port,
            "ssh_host": "127.0.0.1",
            "subnet": SUBNET,
            "gateway_listen": gateway.to_string(),
            "start_timeout_seconds": 30
        }
    });
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    std::fs::write(&config, cfg.to_string()).unwrap();
    env.config = Some(config);
    env.start_agentd();
    Some((env, fake, gateway))
}

#[test]
fn a_microvm_sandbox_runs_as_a_systemd_unit_reached_over_pinned_ssh() {
    let Some((env, fake, _)) = setup() else {
        return;
    };
    let repo = env.repo("vm");
    env.ok(&["create", "--backend", "microvm", repo.to_str().unwrap()]);
    env.ok(&["start", "vm"]);
    assert_eq!(env.state("vm"), "running");
    let calls = fake.calls.lock().unwrap().clone();
    for c in [
        "Subscribe",
        "LoadUnit microvm@vm.service",
        "StartUnit microvm@vm.service replace",
    ] {
        assert!(calls.iter().any(|x| x == c), "{c} missing from {calls:?}");
    }

    // Commands run in the guest's /workspace, over ssh; exit codes pass.
    let out = env.ok(&[
        "exec",
        "vm",
        "--",
        "sh",
        "-c",
        "pwd; cat README.md; echo \"$X\"",
    ]);
    assert_eq!(out, "/workspace\n# vm\n\n");
    let out = env.ok(&[
        "exec",
        "vm",
        "-e",
        "X=it's set",
        "--",
        "sh",
        "-c",
        "echo \"$X\"",
    ]);
    assert_eq!(out, "it's set\n");
    let code = env
        .ctl(&["exec", "vm", "--", "sh", "-c", "exit 3"])
        .status
        .code();
    assert_eq!(code, Some(3));

    // The keys: agentd's private key stays on the host side, the guest
    // gets only its host key and authorized_keys; and the protected paths
    // its `keystone-protect` unit makes read-only.
    let dir = env.state_dir.join("sandboxes/vm");
    let pin = std::fs::read_to_string(dir.join("client/known_hosts")).unwrap();
    assert!(pin.starts_with("keystone-vm ssh-ed25519 "), "{pin}");
    let mut shared: Vec<String> = std::fs::read_dir(dir.join("ssh"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    shared.sort();
    assert_eq!(
        shared,
        [
            "authorized_keys",
            "protect",
            "ssh_host_ed25519_key",
            "ssh_host_ed25519_key.pub"
        ]
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("ssh/protect")).unwrap(),
        ".git/hooks\n.husky\n.github/workflows\n.gitlab-ci.yml\n.pre-commit-config.yaml\n"
    );

    env.ok(&["stop", "vm"]);
    assert_eq!(env.state("vm"), "stopped");
    assert!(
        fake.calls
            .lock()
            .unwrap()
            .iter()
            .any(|x| x == "StopUnit microvm@vm.service replace")
    );

    // A guest with another host key is refused, whatever it answers.
    let host_key = dir.join("ssh/ssh_host_ed25519_key");
    std::fs::remove_file(&host_key).unwrap();
    std::fs::remove_file(dir.join("ssh/ssh_host_ed25519_key.pub")).unwrap();
    let status = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&host_key)
        .status()
        .unwrap();
    assert!(status.success());
    // provision() keeps existing keys, so the pin stays the old one.
    let err = env.fails(3, &["start", "vm"]);
    assert!(
        err.contains("host key other than the one agentd provisioned"),
        "{err}"
    );
    assert_eq!(env.state("vm"), "error");
}

#[test]
fn the_first_start_of_a_declared_sandbox_takes_over_the_share_directories_made_at_activation() {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    // What microvm.nix's host module does at activation, before agentd ever
    // starts the sandbox: a tmpfiles `d` rule for every share source, made
    // microvm:kvm 0775 (uid 65534 stands in for microvm here). A member of
    // kvm has planted a key of its own in the guest's key directory.
    let Some((env, _fake, _)) = setup_with(|env| {
        let repo = env.repo("declared");
        let dir = env.state_dir.join("sandboxes/declared");
        for share in ["workspace", "ssh"] {
            let d = dir.join(share);
            std::fs::create_dir_all(&d).unwrap();
            std::os::unix::fs::chown(&d, Some(65534), Some(65534)).unwrap();
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o775)).unwrap();
        }
        std::fs::write(
            dir.join("ssh/authorized_keys"),
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB7hY3k2b2Wb2cI4vYqT7m3nJ6x1i5r3n0m6c8Yc6P2Q intruder
",
        )
        .unwrap();
        serde_json::json!({"declared": {"project": repo, "owner": "root", "backend": "microvm"}})
    }) else {
        return;
    };
    env.ok(&["start", "declared"]);
    assert_eq!(env.state("declared"), "running");
    // The workspace is the project's clone, not the empty directory.
    assert_eq!(
        env.ok(&["exec", "declared", "--", "cat", "README.md"]),
        "# declared\n"
    );
    // The key directory is agentd's, 0755, and holds agentd's key only.
    let dir = env.state_dir.join("sandboxes/declared");
    let m = std::fs::metadata(dir.join("ssh")).unwrap();
    assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (0, 0, 0o755));
    let authorized = std::fs::read_to_string(dir.join("ssh/authorized_keys")).unwrap();
    let ours = std::fs::read_to_string(dir.join("client/id_ed25519.pub")).unwrap();
    assert_eq!(authorized, ours);
    assert!(!authorized.contains("intruder"));
}

#[test]
fn a_unit_that_fails_to_start_is_reported_with_its_result() {
    let Some((env, _fake, _)) = setup() else {
        return;
    };
    let repo = env.repo("broken");
    env.ok(&["create", "--backend", "microvm", repo.to_str().unwrap()]);
    let err = env.fails(3, &["start", "broken"]);
    assert!(
        err.contains("microvm@broken.service failed (result: exit-code)"),
        "{err}"
    );
    let st = env.status("broken");
    assert_eq!(st["state"], "error");
    assert!(
        st["state_reason"].as_str().unwrap().contains("exit-code"),
        "{st}"
    );
    // A unit that fails at once (agentd's first look finds it failed, and
    // the changes that led there come after): the same, not a timeout.
    let repo = env.repo("quickfail");
    env.ok(&["create", "--backend", "microvm", repo.to_str().unwrap()]);
    let err = env.fails(3, &["start", "quickfail"]);
    assert!(
        err.contains("microvm@quickfail.service failed (result: exit-code)"),
        "{err}"
    );
}

#[test]
fn a_stop_that_fails_ends_in_error_with_the_reason() {
    let Some((env, _fake, _)) = setup() else {
        return;
    };
    let repo = env.repo("stuck");
    env.ok(&["create", "--backend", "microvm", repo.to_str().unwrap()]);
    env.ok(&["start", "stuck"]);
    let err = env.fails(3, &["stop", "stuck"]);
    assert!(err.contains("systemd refused to stop"), "{err}");
    // Not left `stopping` until agentd restarts: `error`, with the reason,
    // from where it can be started again or destroyed.
    let st = env.status("stuck");
    assert_eq!(st["state"], "error", "{st}");
    assert!(
        st["state_reason"].as_str().unwrap().contains("canceled"),
        "{st}"
    );
    env.ok(&["destroy", "stuck"]);
    assert!(env.list().is_empty());
}

#[test]
fn a_running_guest_outlives_agentd_and_is_adopted_with_its_terminal() {
    let Some((mut env, fake, gateway)) = setup() else {
        return;
    };
    let repo = env.repo("keep");
    env.ok(&["create", "--backend", "microvm", repo.to_str().unwrap()]);
    env.ok(&["start", "keep"]);
    // The guest's way out: its gateway answers (here, refusing the host's
    // loopback, an address, so nothing is resolved).
    let source = address_of("keep", SUBNET);
    let answers = || {
        request_from(source, gateway, "http://127.0.0.1:9/")
            .unwrap_or_default()
            .contains("Keystone Agent refused this connection: 127.0.0.1:9")
    };
    wait_for(
        "the gateway to serve sandbox keep",
        Duration::from_secs(20),
        answers,
    );

    // agentd stops (SIGTERM, as a restart does): the unit keeps running.
    let status = env.term_agentd();
    assert!(status.success(), "{status:?}");
    assert!(
        !fake
            .calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.starts_with("StopUnit")),
        "agentd stopped the guest on its way out"
    );
    // The next agentd asks systemd and adopts it, and its gateway.
    env.start_agentd();
    assert_eq!(env.state("keep"), "running");
    assert_eq!(env.ok(&["exec", "keep", "--", "pwd"]), "/workspace\n");
    wait_for(
        "the gateway to serve the adopted sandbox",
        Duration::from_secs(20),
        answers,
    );

    // A terminal over ssh: our size inside, typing reaches the shell, the
    // exit code comes back, our terminal is sane after.
    let t = common::term::Terminal::new(env.tmp.path(), 100, 30, &[]);
    t.line(&format!(
        "{} --bus {} exec --tty keep -- sh; echo code=$?",
        common::agentctl().display(),
        env.address
    ));
    t.line("echo size-$(stty size | tr ' ' x)");
    t.wait_screen(
        "the guest's terminal",
        std::time::Duration::from_secs(60),
        |s| s.contains("size-30x100"),
    );
    t.line("exit 5");
    t.wait_screen(
        "agentctl to exit",
        std::time::Duration::from_secs(60),
        |s| s.contains("code=5"),
    );
    assert!(common::term::is_cooked(&t.stty("after")));
}

/// Send a plain HTTP proxy request for `url` to the gateway at `gateway`
/// from the address `source` (the socket bound to it before it connects,
/// as a guest's connections come from its own address); the whole answer,
/// empty when the gateway closes the connection without one, `None` when
/// nothing listens there.
fn request_from(source: Ipv4Addr, gateway: SocketAddrV4, url: &str) -> Option<String> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, socket};
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    bind(
        fd.as_raw_fd(),
        &SockaddrIn::from(SocketAddrV4::new(source, 0)),
    )
    .unwrap();
    connect(fd.as_raw_fd(), &SockaddrIn::from(gateway)).ok()?;
    let mut s = std::net::TcpStream::from(fd);
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    // The gateway may close an unknown peer before this is written.
    let _ = write!(s, "GET {url} HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    Some(String::from_utf8_lossy(&out).into_owned())
}

/// The address the naming functions give sandbox `name` in `subnet`.
fn address_of(name: &str, subnet: &str) -> Ipv4Addr {
    agentd::naming::derive(name, subnet)
        .unwrap()
        .address
        .parse()
        .unwrap()
}

fn egress_log(env: &Env, name: &str) -> Vec<serde_json::Value> {
    serde_json::from_str(&env.ok(&["egress", name, "log", "--json", "-n", "100"])).unwrap()
}

#[test]
fn guests_share_the_gateway_and_each_connection_is_their_sandbox_s_by_its_source_address() {
    if !is_root() {
        eprintln!("skipped: the stand-in guest (sshd in a mount namespace) needs root");
        return;
    }
    // The bridge of a NixOS host, on loopback: guests at their derived
    // addresses in 127.0.0.0/16 (sshd of each stand-in guest there), the
    // gateway on 127.0.0.1 (as on A.B.0.1).
    let subnet = SUBNET;
    let mut env = Env::bus_only();
    let ssh_port = free_port();
    let gateway = SocketAddrV4::new(Ipv4Addr::LOCALHOST, free_port());
    let fake = FakeSystemd::start_in(&env.address, env.state_dir.clone(), ssh_port, Some(subnet));
    let config = env.tmp.path().join("agentd.json");
    let cfg = serde_json::json!({
        "microvm": {
            "systemd_bus": env.address,
            "ssh_user": "root",
            "ssh_port": ssh_port,
            "subnet": subnet,
            "gateway_listen": gateway.to_string(),
            "start_timeout_seconds": 30
        },
        "egress": { "hosts": { "origin.test": "127.0.0.1" } }
    });
    std::fs::write(&config, cfg.to_string()).unwrap();
    env.config = Some(config);
    env.start_agentd();
    let port = origin(Ipv4Addr::LOCALHOST.into(), "origin-body");
    let url = format!("http://origin.test:{port}/");

    // Two guests: one may reach the origin (an address-range entry), the
    // other may not.
    let (a, b) = ("mva", "mvb");
    let (addr_a, addr_b) = (address_of(a, subnet), address_of(b, subnet));
    assert_ne!(addr_a, addr_b);
    let repo_a = env.repo(a);
    let repo_b = env.repo(b);
    env.ok(&[
        "create",
        "--backend",
        "microvm",
        "--allow",
        "127.0.0.1/32",
        repo_a.to_str().unwrap(),
    ]);
    env.ok(&["create", "--backend", "microvm", repo_b.to_str().unwrap()]);
    env.ok(&["start", a]);
    env.ok(&["start", b]);
    // Both guests run, each at its own address.
    let out = env.ok(&["exec", b, "--", "sh", "-c", "echo $SSH_CONNECTION"]);
    assert!(out.contains(&format!(" {addr_b} {ssh_port}")), "{out}");

    // The gateway serves a guest once its sandbox runs.
    let mut answer = String::new();
    wait_for(
        "the gateway to serve sandbox mva",
        Duration::from_secs(20),
        || {
            answer = request_from(addr_a, gateway, &url).unwrap_or_default();
            !answer.is_empty()
        },
    );
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("origin-body"),
        "{answer}"
    );
    // The same request from the other guest's address is decided by that
    // guest's policy, and its refusal names that sandbox.
    let answer = request_from(addr_b, gateway, &url).unwrap();
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(
        answer.contains(&format!("agentctl egress mvb allow 127.0.0.1/32:{port}")),
        "{answer}"
    );
    assert!(!answer.contains("origin-body"), "{answer}");

    // From an address that is no running sandbox's: closed unanswered, and
    // logged by agentd, in no sandbox's log.
    for stranger in [Ipv4Addr::LOCALHOST, Ipv4Addr::new(127, 0, 255, 255)] {
        assert_eq!(
            request_from(stranger, gateway, &url).as_deref(),
            Some(""),
            "{stranger}"
        );
        let line =
            format!("refused a connection from {stranger}: no running sandbox has that address");
        wait_for(
            "the refusal in agentd's log",
            Duration::from_secs(10),
            || env.log().contains(&line),
        );
    }

    // Each sandbox's log holds its own connections, and only those.
    let log_a = egress_log(&env, a);
    let log_b = egress_log(&env, b);
    assert!(
        log_a.iter().any(|e| e["decision"] == "allow"
            && e["host"] == "origin.test"
            && e["addr"] == "127.0.0.1"),
        "{log_a:?}"
    );
    assert!(log_a.iter().all(|e| e["decision"] == "allow"), "{log_a:?}");
    assert!(
        log_b.iter().any(|e| e["decision"] == "deny"
            && e["host"] == "origin.test"
            && e["rule"] == "default"),
        "{log_b:?}"
    );
    assert!(log_b.iter().all(|e| e["decision"] == "deny"), "{log_b:?}");

    // A change of policy applies to that sandbox's next connection.
    env.ok(&["egress", b, "allow", "127.0.0.1/32"]);
    let answer = request_from(addr_b, gateway, &url).unwrap();
    assert!(answer.ends_with("origin-body"), "{answer}");

    // A stopped sandbox's address is a stranger's again; the other's
    // still works.
    env.ok(&["stop", a]);
    assert_eq!(request_from(addr_a, gateway, &url).as_deref(), Some(""));
    let line = format!("refused a connection from {addr_a}: no running sandbox has that address");
    wait_for(
        "the refusal in agentd's log",
        Duration::from_secs(10),
        || env.log().contains(&line),
    );
    assert!(
        request_from(addr_b, gateway, &url)
            .unwrap()
            .ends_with("origin-body")
    );
    drop(fake);
}

#[test]
fn a_microvm_guest_uses_a_secret_through_the_shared_gateway_without_reading_it() {
    let dir = tempfile::tempdir().unwrap();
    let certs = common::tls::tls(dir.path(), &["api.secret.test"]);
    let ca = certs.ca.display().to_string();
    let Some((env, _fake, gateway)) = setup_extra(
        serde_json::json!({"egress": {"hosts": {"api.secret.test": "127.0.0.1"}}}),
        &[("SSL_CERT_FILE", ca.as_str())],
    ) else {
        return;
    };
    let origin = common::tls::Origin::start(
        dir.path(),
        "origin.py",
        include_str!("secrets/origin.py"),
        &certs,
    );
    let repo = env.repo("mvs");
    env.ok(&["create", "--backend", "microvm", repo.to_str().unwrap()]);
    // Set before the first start: the guest's share does not exist yet,
    // and the start puts the CA there.
    let value = format!("sk-microvm-{}", uuid::Uuid::new_v4().simple());
    env.set_secret(
        "mvs",
        "ANTHROPIC_API_KEY",
        "api.secret.test",
        "x-api-key",
        value.as_bytes(),
    );
    env.ok(&["start", "mvs"]);
    let allow = format!("127.0.0.1/32:{}", origin.port);
    env.ok(&["egress", "mvs", "allow", &allow]);
    let sh = |script: &str| env.ok(&["exec", "mvs", "--", "sh", "-c", script]);
    let placeholder = sh("printf %s \"$ANTHROPIC_API_KEY\"");
    assert!(
        placeholder.starts_with("keystone-placeholder-"),
        "{placeholder}"
    );
    assert_eq!(
        sh("echo $NODE_EXTRA_CA_CERTS $CURL_CA_BUNDLE").trim(),
        "/var/lib/keystone-agent/ssh/keystone-ca.pem /var/lib/keystone-agent/ssh/keystone-ca-bundle.pem"
    );
    // The guest's connection, from its own address, through the gateway
    // the guests share: the host gets the value, the guest sees it masked.
    let guest = address_of("mvs", SUBNET);
    let answer = sh(&format!(
        "curl -sS --max-time 20 --interface {guest} --proxy http://{gateway} \
         -H \"x-api-key: $ANTHROPIC_API_KEY\" https://api.secret.test:{}/v1/messages",
        origin.port
    ));
    let got = origin.requests();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["x-api-key"], value.as_str());
    assert_eq!(answer, format!("echo {}", "*".repeat(value.len())));
    // The share holds the certificate, never the CA's key or the value.
    let share = env.state_dir.join("sandboxes/mvs/ssh");
    let leaks = common::files_with(&share, value.as_bytes(), &env.state_dir.join("secrets"));
    assert!(leaks.is_empty(), "{leaks:?}");
    let cert = std::fs::read_to_string(share.join("keystone-ca.pem")).unwrap();
    assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"), "{cert}");
    assert!(
        !std::fs::read_to_string(share.join("keystone-ca-bundle.pem"))
            .unwrap()
            .contains("PRIVATE KEY")
    );
    env.ok(&["stop", "mvs"]);
}

/// The `ssh` processes agentd `pid` runs now (zombies, already dead and
/// waiting to be reaped, left out).
fn ssh_children(pid: i32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // pid (comm) state ppid …
            let Some((comm, rest)) = stat.split_once(") ") else {
                return false;
            };
            let mut f = rest.split(' ');
            let (state, ppid) = (f.next(), f.next().and_then(|s| s.parse::<i32>().ok()));
            // (Not the one that hears the agents' hooks, which lasts.)
            let listener = std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.windows(16).any(|w| w == b"keystone-waiting"));
            comm.ends_with("(ssh") && state != Some("Z") && ppid == Some(pid) && !listener
        })
        .collect()
}

/// agentd's resident memory, in KiB.
fn rss_kib(pid: i32) -> u64 {
    common::proc_status(pid, "VmRSS")
        .trim_end_matches(" kB")
        .parse()
        .unwrap()
}

#[test]
fn a_guest_root_that_answers_the_port_lookup_for_ever_costs_agentd_bounded_memory_and_time() {
    let caddy_dir = tempfile::tempdir().unwrap();
    let caddy = common::caddy::Caddy::start(caddy_dir.path());
    let proxy: serde_json::Value = serde_json::from_str(&caddy.agentd_config(false)).unwrap();
    let Some((env, _fake, _)) = setup_extra(proxy, &[]) else {
        return;
    };
    let repo = env.repo("evil");
    env.ok(&["create", "--backend", "microvm", repo.to_str().unwrap()]);
    env.ok(&["start", "evil"]);
    let pid = env.agentd_pid();

    // Root in the guest puts its own `find` where the port lookup runs
    // one: first one that answers for ever (about 10 MB/s, a guest's pace
    // under emulation), then one that never answers.
    let ws = env.state_dir.join("sandboxes/evil/workspace");
    std::fs::write(
        ws.join(".flood"),
        "#!/bin/sh\nwhile head -c 1048576 /dev/zero; do sleep 0.1; done\n",
    )
    .unwrap();
    std::fs::write(ws.join(".sleep"), "#!/bin/sh\nexec sleep 60\n").unwrap();
    for f in [".flood", ".sleep"] {
        std::fs::set_permissions(
            ws.join(f),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
    }
    let finds = |script: &str| {
        env.ok(&[
            "exec",
            "evil",
            "--",
            "sh",
            "-c",
            &format!(
                "umount /usr/bin/find 2>/dev/null; mount --bind /workspace/{script} /usr/bin/find"
            ),
        ]);
    };
    let limit = agentd::backend::ssh::LISTENERS_TIMEOUT + Duration::from_secs(15);
    // One lookup, on a thread of its own: without bounds it never returns.
    let lookup = || {
        let mut cmd = env.ctl_cmd(&["--call-timeout", "120", "ports", "evil", "--json"]);
        let (tx, rx) = std::sync::mpsc::channel();
        let started = std::time::Instant::now();
        std::thread::spawn(move || {
            let _ = tx.send(cmd.output());
        });
        let out = rx.recv_timeout(limit);
        (out, started.elapsed())
    };

    finds(".flood");
    let before = rss_kib(pid);
    let (out, took) = lookup();
    let after = rss_kib(pid);
    eprintln!(
        "endless answer: agentd's RSS {before} KiB before, {after} KiB after; the lookup took {took:?}"
    );
    let out = out
        .expect("the port lookup of a flooding guest never ended")
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        after < before + 64 * 1024,
        "agentd grew from {before} KiB to {after} KiB"
    );
    wait_for("agentd's ssh to be gone", Duration::from_secs(10), || {
        ssh_children(pid).is_empty()
    });

    finds(".sleep");
    let (out, took) = lookup();
    eprintln!("silent guest: the lookup took {took:?}");
    let out = out
        .expect("the port lookup of a silent guest never ended")
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(took >= agentd::backend::ssh::LISTENERS_TIMEOUT - Duration::from_secs(1));
    wait_for("agentd's ssh to be gone", Duration::from_secs(10), || {
        ssh_children(pid).is_empty()
    });
    // agentd still serves the sandbox.
    env.ok(&["exec", "evil", "--", "umount", "/usr/bin/find"]);
    assert_eq!(env.ok(&["exec", "evil", "--", "pwd"]), "/workspace\n");
}

//! SSH into a sandbox with the real OpenSSH client (ssh, scp, sftp,
//! rsync) through `agentctl ssh-config`'s `ProxyCommand`: commands and a
//! terminal session (recorded like any terminal), files both ways, a
//! local port forward to a server on the sandbox's loopback, and what is
//! refused: a forward to any other address (the host's loopback
//! included), a changed host key, another uid. No port is opened on the
//! host for any of it.

mod common;

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::Env;
use common::caddy::free_port;
use common::ssh::{config as ssh_config, run};

const NOBODY: u32 = 65534;

/// Whether the OpenSSH client tools are here; in CI they must be.
fn available() -> bool {
    let found = ["ssh", "scp", "sftp", "rsync"].iter().all(|t| {
        Command::new(t)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    });
    assert!(
        found || std::env::var("CI").as_deref() != Ok("true"),
        "the OpenSSH client or rsync is missing (apt-get install openssh-client openssh-sftp-server rsync); .ci/run installs them"
    );
    if !found {
        eprintln!("skipped: the OpenSSH client or rsync is missing");
    }
    found
}

fn ok(tool: &str, args: &[&str]) -> String {
    let out = run(tool, args, b"");
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The TCP ports listening on the host (every namespace agentd's own
/// processes are in is the host's).
fn listening() -> Vec<String> {
    let mut ports: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|t| {
            t.lines()
                .skip(1)
                .filter(|l| l.split_whitespace().nth(3) == Some("0A"))
                .filter_map(|l| l.split_whitespace().nth(1).map(str::to_owned))
                .collect::<Vec<_>>()
        })
        .collect();
    ports.sort();
    ports
}

#[test]
fn openssh_reaches_the_sandbox_through_agentd_and_nothing_else() {
    if !available() {
        return;
    }
    let env = Env::running("box", &[]);
    let state = env.tmp.path().join("state");
    let before = listening();
    let config = ssh_config(&env, "box", &state);
    let conf = config.to_str().unwrap();
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.contains("Host keystone-box\n"), "{text}");
    assert!(text.contains("ssh-proxy 'box'"), "{text}");
    let hosts = state.join("keystone-agent/ssh/known_hosts");
    let pinned = std::fs::read_to_string(&hosts).unwrap();
    assert!(pinned.starts_with("keystone-box ssh-ed25519 "), "{pinned}");

    // A command, its output, its exit code, in the sandbox.
    let out = ok(
        "ssh",
        &["-F", conf, "keystone-box", "git -C /workspace status"],
    );
    assert!(out.contains("On branch"), "{out}");
    let out = run(
        "ssh",
        &["-F", conf, "keystone-box", "pwd; echo oops >&2; exit 7"],
        b"",
    );
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "/workspace");
    assert!(String::from_utf8_lossy(&out.stderr).contains("oops"));
    // Its stdin reaches the command, its end the command's.
    let out = run(
        "ssh",
        &["-F", conf, "keystone-box", "wc -c"],
        &[b'x'; 100_000],
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "100000");

    // A terminal session: a pty of the requested size, recorded.
    let out = ok(
        "ssh",
        &[
            "-F",
            conf,
            "-tt",
            "keystone-box",
            "tty; stty size; echo typed-in-ssh",
        ],
    );
    assert!(out.contains("/dev/pts/"), "{out}");
    assert!(out.contains("typed-in-ssh"), "{out}");
    let records = env.ok(&["sessions", "log", "box", "--json"]);
    assert!(records.contains("typed-in-ssh"), "not recorded: {records}");

    // Files both ways: scp (SFTP underneath, and the old protocol), sftp,
    // rsync.
    let up = env.tmp.path().join("up.txt");
    std::fs::write(&up, "from the host\n").unwrap();
    let up = up.to_str().unwrap();
    ok("scp", &["-F", conf, up, "keystone-box:/workspace/up.txt"]);
    ok(
        "scp",
        &[
            "-O",
            "-F",
            conf,
            up,
            "keystone-box:/workspace/up-legacy.txt",
        ],
    );
    env.ok(&[
        "exec",
        "box",
        "--",
        "sh",
        "-c",
        "echo from the sandbox > down.txt",
    ]);
    let down = env.tmp.path().join("down.txt");
    ok(
        "scp",
        &[
            "-F",
            conf,
            "keystone-box:/workspace/down.txt",
            down.to_str().unwrap(),
        ],
    );
    assert_eq!(
        std::fs::read_to_string(&down).unwrap(),
        "from the sandbox\n"
    );
    let out = env.ok(&["exec", "box", "--", "cat", "up.txt", "up-legacy.txt"]);
    assert_eq!(out, "from the host\nfrom the host\n");
    let got = env.tmp.path().join("sftp.txt");
    let batch = format!("ls /workspace\nget /workspace/down.txt {}\n", got.display());
    let out = run(
        "sftp",
        &["-F", conf, "-b", "-", "keystone-box"],
        batch.as_bytes(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("up.txt"));
    assert_eq!(std::fs::read_to_string(&got).unwrap(), "from the sandbox\n");
    let tree = env.tmp.path().join("tree");
    std::fs::create_dir_all(tree.join("sub")).unwrap();
    std::fs::write(tree.join("sub/a.txt"), "rsynced\n").unwrap();
    let rsh = format!("ssh -F {conf}");
    ok(
        "rsync",
        &[
            "-a",
            "-e",
            &rsh,
            &format!("{}/", tree.display()),
            "keystone-box:/workspace/tree/",
        ],
    );
    let out = env.ok(&["exec", "box", "--", "cat", "tree/sub/a.txt"]);
    assert_eq!(out, "rsynced\n");

    // A local forward to a server on the sandbox's loopback.
    let inside = free_port();
    env.ok(&[
        "exec",
        "box",
        "--",
        "sh",
        "-c",
        &format!("echo served-inside > served.txt; python3 -m http.server {inside} --bind 127.0.0.1 >/dev/null 2>&1 &"),
    ]);
    let local = free_port();
    let mut tunnel = Command::new("ssh")
        .args(["-F", conf, "-N", "-o", "ExitOnForwardFailure=yes", "-L"])
        .arg(format!("127.0.0.1:{local}:127.0.0.1:{inside}"))
        .arg("keystone-box")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let body = loop {
        let got = std::net::TcpStream::connect(("127.0.0.1", local))
            .ok()
            .and_then(|mut s| {
                s.write_all(b"GET /served.txt HTTP/1.0\r\n\r\n").ok()?;
                let mut out = String::new();
                s.read_to_string(&mut out).ok()?;
                Some(out)
            });
        if let Some(b) = got.filter(|b| b.contains("served-inside")) {
            break b;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the forward never answered"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(body.starts_with("HTTP/1.0 200"), "{body}");
    let _ = tunnel.kill();
    let _ = tunnel.wait();

    // Forwards anywhere else are refused: another address, and the
    // host's own loopback (a server there is not the sandbox's).
    let host_server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let host_port = host_server.local_addr().unwrap().port();
    for to in [
        "10.0.0.1:80".to_owned(),
        "192.168.1.1:22".to_owned(),
        format!("[::ffff:127.0.0.1]:{host_port}"),
    ] {
        let out = run("ssh", &["-F", conf, "-W", &to, "keystone-box"], b"");
        assert!(!out.status.success(), "{to}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("administratively prohibited"),
            "{to}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = run(
        "ssh",
        &[
            "-F",
            conf,
            "-W",
            &format!("127.0.0.1:{host_port}"),
            "keystone-box",
        ],
        b"",
    );
    assert!(
        !out.status.success(),
        "the host's loopback server was reached"
    );
    host_server.set_nonblocking(true).unwrap();
    assert!(
        host_server.accept().is_err(),
        "the host's server got a connection"
    );
    drop(host_server);
    // Nor agent or X11 forwarding, nor a remote forward.
    let out = run(
        "ssh",
        &[
            "-F",
            conf,
            "-o",
            "ExitOnForwardFailure=yes",
            "-R",
            "127.0.0.1:0:127.0.0.1:22",
            "keystone-box",
            "true",
        ],
        b"",
    );
    assert!(!out.status.success(), "a remote forward was set up");

    // The host key is pinned: another key under the alias is refused.
    let other = env.tmp.path().join("other_key");
    ok(
        "ssh-keygen",
        &[
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-f",
            other.to_str().unwrap(),
        ],
    );
    let other_pub = std::fs::read_to_string(other.with_extension("pub")).unwrap();
    let key: Vec<&str> = other_pub.split_whitespace().take(2).collect();
    std::fs::write(&hosts, format!("keystone-box {}\n", key.join(" "))).unwrap();
    let out = run("ssh", &["-F", conf, "keystone-box", "true"], b"");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("HOST IDENTIFICATION HAS CHANGED")
            || String::from_utf8_lossy(&out.stderr).contains("Host key verification failed"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(&hosts, &pinned).unwrap();

    // Another uid gets no connection, and no host key.
    for args in [["ssh-proxy", "box"], ["ssh-config", "box"]] {
        let out = env.ctl_as(Some(NOBODY), &args);
        assert!(!out.status.success(), "{args:?} as another uid");
        assert!(
            out.stdout.is_empty(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }

    // No port was opened on the host for any of it.
    assert_eq!(listening(), before, "a port was opened on the host");
    // The host key is agentd's: in its state, 0600, out of the
    // sandbox's sight.
    let key = env.state_dir.join("sandboxes/box/ssh_host_ed25519_key");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&key).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    let (code, _) = env.inside("box", &format!("test -e '{}'", key.display()));
    assert_ne!(code, 0, "the host key is visible inside the sandbox");
}

#[test]
fn a_hostile_sandbox_cannot_write_ssh_configuration_nor_hold_a_connection() {
    if !available() {
        return;
    }
    let env = Env::running("hb", &[]);
    env.ok(&["worktree", "add", "hb", "feature/x"]);
    env.ok(&["worktree", "add", "hb", "evil"]);
    // The sandbox rewrites a worktree's HEAD with a line break and ssh
    // configuration of its own (`Match exec` runs as the user when ssh
    // reads the file).
    let marker = env.tmp.path().join("pwned");
    env.sh(
        "hb",
        &format!(
            "printf 'ref: refs/heads/x\\nMatch exec \"touch {}\"\\nHostKeyAlias z\\n' > /workspace/.git/worktrees/evil/HEAD",
            marker.display()
        ),
    );
    let state = env.tmp.path().join("state");
    let config = ssh_config(&env, "hb", &state);
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(
        !text.lines().any(|l| l.trim_start().starts_with("Match")),
        "{text}"
    );
    assert!(text.contains("Host keystone-hb.feature-x\n"), "{text}");
    // ssh reads the whole file: nothing of the sandbox's runs.
    let conf = config.to_str().unwrap();
    let out = ok("ssh", &["-F", conf, "keystone-hb.feature-x", "pwd"]);
    assert_eq!(out.trim(), "/workspace/.worktrees/feature/x");
    assert!(!marker.exists(), "the sandbox's configuration ran");

    // A command that never reads its input: the client's data cannot
    // hold the connection; the channel ends, and agentd serves the next.
    let started = Instant::now();
    let out = run(
        "ssh",
        &["-F", conf, "keystone-hb", "sleep 600"],
        &vec![b'x'; 8 << 20],
    );
    assert!(!out.status.success());
    assert!(
        started.elapsed() < Duration::from_secs(58),
        "the connection was held"
    );
    let out = ok("ssh", &["-F", conf, "keystone-hb", "echo still-served"]);
    assert_eq!(out.trim(), "still-served");
    let (code, _) = env.inside("hb", "pgrep -f 'slee[p] 600'");
    assert_ne!(code, 0, "the command outlived its channel");
}

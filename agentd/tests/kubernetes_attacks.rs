//! Attacks on the `kubernetes` backend from inside a Pod (the agent is
//! hostile: it owns every file of `/workspace`, every process of the Pod and
//! so what the Pod's commands print and how long they take), against the
//! fake API server of `tests/fake-kube`. Each test asserts the host's state
//! (files, the host repository's refs, agentd's memory, descriptors and
//! threads) and a time bound on agentd's operations.
//!
//! In the fake, a Pod's root is root of a user namespace that maps this
//! host's root, and its `/usr` is this host's: a test never writes below
//! `/usr` in a Pod, it binds its own program over `/usr/bin/tar` inside the
//! Pod's mount namespace instead.

#[path = "common/kube.rs"]
mod cluster;
mod common;

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use cluster::{Cluster, agentd, skip, tail, usage};
use common::{Env, git};

/// A running sandbox `name` of a fresh repository (`--disk 256`); the
/// repository.
fn sandbox(env: &Env, name: &str, extra: &[&str]) -> std::path::PathBuf {
    let mut args = vec!["--disk", "256"];
    args.extend_from_slice(extra);
    cluster::sandbox(env, name, &args)
}

/// Run agentctl `args`; its output, or `None` if it had not ended by
/// `limit` (then it is killed).
fn ctl_within(env: &Env, args: &[&str], limit: Duration) -> Option<Output> {
    let mut child = env
        .ctl_cmd(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().unwrap().is_some() {
            return Some(child.wait_with_output().unwrap());
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// [`ctl_within`] that must end by `limit`, with `what` in the message.
fn ctl_ends(env: &Env, what: &str, args: &[&str], limit: Duration) -> Output {
    let start = Instant::now();
    let out = ctl_within(env, args, limit);
    assert!(
        out.is_some(),
        "{what}: `agentctl {}` had not ended after {:?}\n--- agentd log (end) ---\n{}",
        args.join(" "),
        start.elapsed(),
        tail(&env.log(), 40)
    );
    out.unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Replace `tar` inside sandbox `name`'s Pod with `script` (a shell
/// script): bound over `/usr/bin/tar` in the Pod's own mount namespace.
fn replace_tar(env: &Env, name: &str, script: &str) {
    env.ok(&[
        "exec",
        name,
        "--",
        "sh",
        "-c",
        &format!(
            "cat > /tmp/evil-tar <<'EOF'\n#!/bin/bash\n{script}\nEOF\n\
             chmod 755 /tmp/evil-tar && mount --bind /tmp/evil-tar /usr/bin/tar"
        ),
    ]);
}

/// A Pod's `tar -c` whose archive is refused at its first large file, and
/// that then has gigabytes more to send (a sparse file, so it costs the
/// Pod nothing): agentd stops reading, the command blocks on its output
/// and its exit status never comes. Neither the sync nor the stop may wait
/// for it, and the stop must not hold the sandbox (force stop, destroy).
#[test]
fn a_refused_git_directory_with_gigabytes_left_cannot_hang_sync_or_stop() {
    if skip() {
        return;
    }
    let cluster = Cluster::fake_only(true);
    let env = agentd(&cluster, serde_json::json!({}));
    let repo = sandbox(&env, "sparse", &[]);
    let refs = git(&repo, &["for-each-ref"]);
    env.sh(
        "sparse",
        "truncate -s 64G /workspace/.git/zz-huge && truncate -s 64G /workspace/.git/aa-huge",
    );
    let pid = env.agentd_pid();
    let before = usage(pid);

    let out = ctl_ends(
        &env,
        "a refused sync",
        &["sync", "sparse"],
        Duration::from_secs(20),
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("larger than"), "{}", stderr(&out));
    assert_eq!(
        git(&repo, &["for-each-ref"]),
        refs,
        "the host's refs changed"
    );

    // A second sync is not queued behind the first.
    let out = ctl_ends(
        &env,
        "a second sync",
        &["sync", "sparse"],
        Duration::from_secs(20),
    );
    assert!(!out.status.success());

    // The stop copies the git directory first: it must end all the same.
    ctl_ends(
        &env,
        "the stop",
        &["stop", "sparse"],
        Duration::from_secs(30),
    );
    assert_eq!(env.state("sparse"), "stopped");
    common::wait_for("the Pod to go", Duration::from_secs(10), || {
        cluster.object("pods", "ks-sparse").is_none()
    });
    let after = usage(pid);
    assert!(
        after.1 <= before.1 + 4,
        "agentd's descriptors grew: {before:?} -> {after:?}"
    );
    assert!(
        after.2 <= before.2 + 8,
        "agentd's threads grew: {before:?} -> {after:?}"
    );
    let mirror = env.state_dir.join("sandboxes/sparse/workspace");
    for left in [".git.incoming", ".git/zz-huge", ".git/aa-huge"] {
        assert!(
            std::fs::symlink_metadata(mirror.join(left)).is_err(),
            "{left} on the host"
        );
    }
}

/// A `tar` that never sends anything and never ends, or sends the whole
/// git directory and then never ends: the sync and the stop end all the
/// same, by the configured time, and the sandbox is not held.
#[test]
fn a_tar_that_never_ends_cannot_hold_a_sync_or_a_stop() {
    if skip() {
        return;
    }
    let cluster = Cluster::fake_only(true);
    let env = agentd(&cluster, serde_json::json!({"transfer_timeout_seconds": 3}));
    let repo = sandbox(&env, "silent", &[]);
    let refs = git(&repo, &["for-each-ref"]);
    let pid = env.agentd_pid();
    let before = usage(pid);

    // Nothing at all. Meanwhile the host's unpacker waits: confined, as
    // the sandbox's uid, seeing nothing of the host but the workspace.
    replace_tar(&env, "silent", "exec sleep 3600");
    let sync = env
        .ctl_cmd(&["sync", "silent"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let helper = env.wait_for_helper("__mirror-unpack");
    common::assert_helper_confined(helper);
    assert_ne!(
        common::proc_status(helper, "Uid").split_whitespace().next(),
        Some("0")
    );
    let root: Vec<_> = std::fs::read_dir(format!("/proc/{helper}/root"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        !root
            .iter()
            .any(|n| n == "etc" || n == "root" || n == "home"),
        "the unpacker sees the host: {root:?}"
    );
    let (_, out) = helper_peak(&env, "__mirror-unpack", sync, Duration::from_secs(15));
    let out = out.expect("a sync from a silent tar ends");
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("did not finish within 3s"),
        "{}",
        stderr(&out)
    );
    assert_eq!(git(&repo, &["for-each-ref"]), refs);

    // All of it, then silence: the real tar, then a sleep.
    env.sh(
        "silent",
        "umount /usr/bin/tar && touch /tmp/real-tar && mount --bind /usr/bin/tar /tmp/real-tar",
    );
    replace_tar(&env, "silent", "/tmp/real-tar \"$@\"; exec sleep 3600");
    let out = ctl_ends(
        &env,
        "a sync from a tar that lingers",
        &["sync", "silent"],
        Duration::from_secs(15),
    );
    assert!(!out.status.success(), "{}", stderr(&out));

    ctl_ends(
        &env,
        "the stop",
        &["stop", "silent"],
        Duration::from_secs(20),
    );
    assert_eq!(env.state("silent"), "stopped");
    let after = usage(pid);
    assert!(
        after.1 <= before.1 + 4,
        "descriptors: {before:?} -> {after:?}"
    );
    assert!(after.2 <= before.2 + 8, "threads: {before:?} -> {after:?}");
}

/// The archive writer of the hostile `tar`s below: a Python script that
/// writes a GNU tar header of its own making, then streams zeros.
const MAKE_ARCHIVE: &str = r#"
import sys
def hdr(name, typ, size):
    h = bytearray(512)
    h[0:len(name)] = name
    h[100:108] = b'0000755\0'
    h[108:116] = b'0000000\0'
    h[116:124] = b'0000000\0'
    h[124:136] = b'%011o\0' % size
    h[136:148] = b'00000000000\0'
    h[156:157] = typ
    h[257:265] = b'ustar  \0'
    h[148:156] = b'        '
    h[148:156] = b'%06o\0 ' % sum(h)
    return bytes(h)
out = sys.stdout.buffer
name, typ, size = sys.argv[1].encode(), sys.argv[2].encode(), int(sys.argv[3])
out.write(hdr(name, typ, size))
zeros = bytes(1 << 20)
sent = 0
while sent < size:
    n = min(len(zeros), size - sent)
    out.write(zeros[:n])
    sent += n
out.write(bytes(-size % 512))
out.write(hdr(b'.git/HEAD', b'0', 0))
out.write(bytes(1024))
"#;

/// Make the Pod's `tar` write one entry `name` of type `typ` announcing
/// `size` bytes (and sending them).
fn hostile_archive(env: &Env, sandbox: &str, name: &str, typ: &str, size: u64) {
    env.sh(
        sandbox,
        &format!("cat > /tmp/make-archive.py <<'EOF'\n{MAKE_ARCHIVE}\nEOF"),
    );
    replace_tar(
        env,
        sandbox,
        &format!("exec python3 /tmp/make-archive.py '{name}' '{typ}' {size}"),
    );
}

/// The largest resident size (KiB) any helper `arg` of agentd reached
/// while `child` (agentctl) ran, for at most `limit`; `child`'s output.
fn helper_peak(
    env: &Env,
    arg: &str,
    mut child: std::process::Child,
    limit: Duration,
) -> (u64, Option<Output>) {
    let agentd = env.agentd_pid();
    let deadline = Instant::now() + limit;
    let mut peak = 0;
    while Instant::now() < deadline {
        for p in agentd::procfs::pids() {
            let ours = agentd::procfs::ppid(p) == Some(agentd)
                && agentd::procfs::cmdline(p).is_some_and(|c| c.get(1).is_some_and(|a| a == arg));
            if ours {
                let hwm = common::proc_status(p, "VmHWM");
                if let Ok(kb) = hwm.trim_end_matches(" kB").trim().parse::<u64>() {
                    peak = peak.max(kb);
                }
            }
        }
        if child.try_wait().unwrap().is_some() {
            return (peak, Some(child.wait_with_output().unwrap()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    (peak, None)
}

/// A GNU long name of 512 MiB: the tar crate reads a long name (or a PAX
/// header) whole into memory before the unpacker sees its entry, outside
/// the limit on file bytes. The host's unpacker must refuse it without
/// growing by its size.
#[test]
fn a_long_name_of_half_a_gigabyte_is_refused_without_being_held_in_memory() {
    if skip() {
        return;
    }
    let cluster = Cluster::fake_only(true);
    let env = agentd(&cluster, serde_json::json!({}));
    let repo = sandbox(&env, "longname", &[]);
    let refs = git(&repo, &["for-each-ref"]);
    hostile_archive(&env, "longname", "././@LongLink", "L", 512 << 20);
    let sync = env
        .ctl_cmd(&["sync", "longname"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (peak, out) = helper_peak(&env, "__mirror-unpack", sync, Duration::from_secs(40));
    let out = out.expect("the sync ends");
    assert!(!out.status.success());
    assert!(
        peak < 128 << 10,
        "the unpacker held {peak} KiB for a long name: {}\n{}",
        stderr(&out),
        {
            let _ = std::fs::write("/tmp/attack-longname.log", env.log());
            tail(&env.log(), 5)
        }
    );
    assert_eq!(git(&repo, &["for-each-ref"]), refs);
}

/// A directory entry that announces 8 GiB of content: the tar crate skips
/// (reads) an entry's content the unpacker does not read, so without a
/// bound on the archive's own bytes the unpacker reads whatever the Pod
/// sends, for as long as it sends it.
#[test]
fn a_directory_entry_with_gigabytes_of_content_is_refused_at_once() {
    if skip() {
        return;
    }
    let cluster = Cluster::fake_only(true);
    let env = agentd(&cluster, serde_json::json!({}));
    let repo = sandbox(&env, "dirsize", &[]);
    let refs = git(&repo, &["for-each-ref"]);
    hostile_archive(&env, "dirsize", ".git/objects/", "5", (8 << 30) - 1);
    let out = ctl_ends(
        &env,
        "a sync of a directory with content",
        &["sync", "dirsize"],
        Duration::from_secs(15),
    );
    assert!(!out.status.success());
    assert_eq!(git(&repo, &["for-each-ref"]), refs);
}

/// A name with NUL bytes (a GNU long name holds any bytes): the refusal
/// names the entry, and a D-Bus string may hold no NUL, so an error that
/// carries it as it is makes the bus daemon drop agentd's connection, and
/// agentd exits: one sandbox would take agentd down for everyone.
#[test]
fn a_nul_byte_in_a_name_of_the_archive_does_not_take_agentd_off_the_bus() {
    if skip() {
        return;
    }
    let cluster = Cluster::fake_only(true);
    let env = agentd(&cluster, serde_json::json!({}));
    let repo = sandbox(&env, "nul", &[]);
    let refs = git(&repo, &["for-each-ref"]);
    hostile_archive(&env, "nul", "././@LongLink", "L", 16);
    let out = ctl_ends(
        &env,
        "a sync of a name with NULs",
        &["sync", "nul"],
        Duration::from_secs(20),
    );
    assert!(!out.status.success());
    assert!(
        !stderr(&out).contains("NoReply") && !stderr(&out).contains("disconnected"),
        "agentd left the bus: {}\n{}",
        stderr(&out),
        tail(&env.log(), 5)
    );
    assert!(
        std::fs::metadata(format!("/proc/{}", env.agentd_pid())).is_ok()
            && !common::proc_status(env.agentd_pid(), "State").starts_with('Z'),
        "agentd exited:\n{}",
        tail(&env.log(), 5)
    );
    assert_eq!(env.state("nul"), "running");
    assert_eq!(git(&repo, &["for-each-ref"]), refs);
}

/// NUL bytes in the files of the git directory (legitimate names, hostile
/// contents) that the sync's readers quote in their errors, which agentd
/// keeps as the last sync's result, a property every listing reads.
#[test]
fn nul_bytes_in_git_files_do_not_reach_the_bus() {
    if skip() {
        return;
    }
    let cluster = Cluster::fake_only(true);
    let env = agentd(&cluster, serde_json::json!({}));
    let _repo = sandbox(&env, "nulref", &[]);
    for script in [
        r"printf 'ref: refs/heads/ma\000in\n' > /workspace/.git/HEAD",
        r"printf '0123456789012345678901234567890123456789 refs/heads/x\000y\n' > /workspace/.git/packed-refs",
        r"git -C /workspace update-ref refs/heads/ok HEAD; printf 'ab\000cd\n' > /workspace/.git/refs/heads/ok",
    ] {
        env.sh("nulref", script);
        let out = ctl_ends(&env, "a sync", &["sync", "nulref"], Duration::from_secs(20));
        assert!(!stderr(&out).contains('\0'), "{script}: {:?}", stderr(&out));
        let out = ctl_ends(
            &env,
            "a listing",
            &["list", "--json"],
            Duration::from_secs(20),
        );
        assert!(
            out.status.success()
                && !common::proc_status(env.agentd_pid(), "State").starts_with('Z'),
            "{script}: {}\n{}",
            stderr(&out),
            tail(&env.log(), 5)
        );
    }
}

/// `exec --timeout` is `timeout` inside the Pod, which ends the command but
/// not a process of the Pod's that keeps the command's output open (and
/// the exec with it): the caller's time must hold all the same, and so
/// must agentd's own commands (Zellij, which the agent may replace: the
/// Pod's tools directory is the Pod's).
#[test]
fn a_process_holding_the_output_does_not_outlast_the_timeout() {
    if skip() {
        return;
    }
    let cluster = Cluster::fake_only(true);
    let env = agentd(&cluster, serde_json::json!({}));
    sandbox(&env, "hold", &[]);
    let pid = env.agentd_pid();
    let before = usage(pid);
    let started = Instant::now();
    let out = ctl_ends(
        &env,
        "exec --timeout 2",
        &[
            "exec",
            "hold",
            "--timeout",
            "2",
            "--",
            "sh",
            "-c",
            "setsid sleep 300 & sleep 100",
        ],
        Duration::from_secs(25),
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("did not finish within 2s"),
        "{}",
        stderr(&out)
    );
    assert!(started.elapsed() < Duration::from_secs(25));

    if env.log().contains("sessions enabled") {
        env.sh(
            "hold",
            "printf '#!/bin/sh\\nsetsid sleep 300 &\\nsleep 100\\n' > /run/keystone/bin/zellij",
        );
        let out = ctl_ends(
            &env,
            "agentctl sessions",
            &["sessions", "hold"],
            Duration::from_secs(30),
        );
        assert!(!out.status.success(), "{}", stderr(&out));
    }
    let after = usage(pid);
    assert!(after.2 <= before.2 + 8, "threads: {before:?} -> {after:?}");
}

/// `auto-idle` watches the host's copy of the workspace, whose files a
/// kubernetes sandbox never changes (they are as they were at the first
/// start): the copy of the git directory that each sync brings must not be
/// taken for the agent's uncommitted work, snapshotted as `wip/<branch>`
/// (the old files over the agent's new commits) and synced again and again.
#[test]
fn auto_idle_does_not_snapshot_the_stale_host_copy_as_work() {
    if skip() {
        return;
    }
    let cluster = Cluster::fake_only(true);
    let env = agentd(&cluster, serde_json::json!({}));
    let repo = sandbox(&env, "idle", &["--sync-mode", "auto-idle"]);
    env.ok(&["set", "idle", "--sync-idle-seconds", "1"]);
    env.sh(
        "idle",
        "echo 'the agent was here' > README.md && git add README.md && \
         git -c user.name=A -c user.email=a@b commit -qm 'agent work'",
    );
    env.ok(&["sync", "idle"]);
    assert_eq!(
        git(&repo, &["show", "sandbox/idle/main:README.md"]),
        "the agent was here\n"
    );
    // Two idle periods and more.
    std::thread::sleep(Duration::from_secs(4));
    if let Some(wip) = common::host_ref(&repo, "refs/remotes/sandbox/idle/wip/main") {
        panic!(
            "a snapshot of the host's stale copy came home as work ({wip}): README.md is {:?}",
            git(&repo, &["show", "sandbox/idle/wip/main:README.md"])
        );
    }
    assert!(
        !env.log().contains("snapshot of uncommitted work"),
        "the host's stale copy was snapshotted as the agent's work"
    );
    let syncs = env.log().matches("synced").count();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        env.log().matches("synced").count(),
        syncs,
        "syncs (each a copy of the whole git directory from the Pod) go on by themselves"
    );
}

/// The Pod's `tar -x` of the first start ends before it has read the whole
/// workspace (killed here, as an OOM kill or an eviction would): the start
/// fails, it does not wait for ever on the host's packer blocked on a pipe
/// nobody reads (holding the sandbox: no stop, no destroy).
#[test]
fn a_seed_that_ends_early_fails_the_start_instead_of_hanging() {
    if skip() {
        return;
    }
    let cluster = Cluster::fake_only(true);
    let env = agentd(&cluster, serde_json::json!({}));
    let repo = env.repo("seed");
    std::fs::write(repo.join("big.bin"), vec![7u8; 64 << 20]).unwrap();
    git(&repo, &["add", "big.bin"]);
    common::commit(&repo, "big");
    env.ok(&["create", "--disk", "512", repo.to_str().unwrap()]);
    let start = env
        .ctl_cmd(&["start", "seed"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The Pod's `tar -x` into /workspace, a process of this test's fake.
    let me = i32::try_from(std::process::id()).unwrap();
    let ours = |mut p: i32| {
        for _ in 0..6 {
            match agentd::procfs::ppid(p) {
                Some(pp) if pp == me => return true,
                Some(pp) if pp > 1 => p = pp,
                _ => return false,
            }
        }
        false
    };
    let mut killed = false;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !killed && Instant::now() < deadline {
        for p in agentd::procfs::pids() {
            let is_seed = agentd::procfs::cmdline(p).is_some_and(|c| {
                c.first().is_some_and(|a| a == "tar")
                    && c.iter().any(|a| a == "-x")
                    && c.iter().any(|a| a == "/workspace")
            });
            if is_seed && ours(p) {
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                )
                .unwrap();
                killed = true;
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(killed, "the Pod's tar -x was not seen");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut start = start;
    let out = loop {
        if start.try_wait().unwrap().is_some() {
            break Some(start.wait_with_output().unwrap());
        }
        if Instant::now() >= deadline {
            let _ = start.kill();
            let _ = start.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = out.unwrap_or_else(|| {
        let _ = std::fs::write("/tmp/attack-seed.log", env.log());
        panic!(
            "the start still waits 30s after the Pod's tar ended\n{}",
            tail(&env.log(), 5)
        )
    });
    assert!(!out.status.success(), "{}", stderr(&out));
    // The sandbox is not held: it can go.
    ctl_ends(
        &env,
        "the destroy",
        &["destroy", "seed"],
        Duration::from_secs(30),
    );
    assert!(env.list().is_empty());
}

/// A TCP relay in front of the fake API server that can refuse every
/// connection for a while (an API server being restarted).
struct Relay {
    port: u16,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    fn start(cluster: &Cluster) -> Self {
        use std::sync::atomic::Ordering;
        let open = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let target = cluster
            .fake()
            .url()
            .trim_start_matches("http://")
            .to_owned();
        let listener = cluster
            .rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let gate = std::sync::Arc::clone(&open);
        cluster.rt.spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                if !gate.load(Ordering::SeqCst) {
                    drop(conn);
                    continue;
                }
                let target = target.clone();
                let gate = std::sync::Arc::clone(&gate);
                tokio::spawn(async move {
                    let Ok(mut up) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    // A closed gate also cuts the connections already made.
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut conn, &mut up) => {}
                        () = async {
                            while gate.load(Ordering::SeqCst) {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                        } => {}
                    }
                });
            }
        });
        Self { port, open }
    }

    fn set_open(&self, open: bool) {
        self.open.store(open, std::sync::atomic::Ordering::SeqCst);
    }
}

/// agentd restarts while the API server does not answer (for a few
/// seconds): its Pods' watch has nothing yet, which must not read as "the
/// Pod is gone" (the sandbox recorded as stopped while its Pod, unknown to
/// everyone, runs on, or the Pod deleted as a stray).
#[test]
fn a_restart_while_the_api_server_is_away_neither_orphans_nor_kills_the_pod() {
    if skip() {
        return;
    }
    let cluster = Cluster::fake_only(true);
    let relay = Relay::start(&cluster);
    let mut env = agentd(&cluster, serde_json::json!({}));
    let kubeconfig = env.tmp.path().join("kubeconfig");
    let text = std::fs::read_to_string(&kubeconfig).unwrap().replace(
        &cluster.fake().url(),
        &format!("http://127.0.0.1:{}", relay.port),
    );
    std::fs::write(&kubeconfig, text).unwrap();
    env.kill_agentd();
    env.start_agentd();
    sandbox(&env, "away", &[]);
    let uid = cluster.object("pods", "ks-away").unwrap()["metadata"]["uid"].clone();

    env.kill_agentd();
    relay.set_open(false);
    env.start_agentd();
    std::thread::sleep(Duration::from_secs(2));
    relay.set_open(true);
    // Once the API server answers again (an exec goes through), agentd
    // knows its Pod as running, and keeps it so once its watch has listed.
    common::wait_for(
        "the API server through the relay",
        Duration::from_secs(20),
        || {
            env.state("away") != "running"
                || env.ctl(&["exec", "away", "--", "true"]).status.success()
        },
    );
    let watched = Instant::now() + Duration::from_secs(3);
    while Instant::now() < watched {
        let state = env.state("away");
        let pod = cluster.object("pods", "ks-away");
        assert!(
            state == "running" && pod.as_ref().is_some_and(|p| p["metadata"]["uid"] == uid),
            "after the API server came back: the sandbox is {state}, its Pod {}",
            if pod.is_some() {
                "still runs (orphaned)"
            } else {
                "is gone"
            }
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        env.ok(&["exec", "away", "--", "git", "log", "-1", "--format=%s"]),
        "first\n"
    );
}

/// The Pod floods the way out: hundreds of connections to the relay that
/// say nothing, and newlines written straight into the relay's output
/// (agentd's exec), each of which asks agentd for a port-forward. agentd
/// opens a bounded number at once, holds a bounded number of descriptors,
/// gives them all back once the flood ends, and the gateway still serves.
#[test]
fn a_flood_through_the_relay_is_bounded_and_leaves_agentd_as_it_was() {
    if skip() {
        return;
    }
    let cluster = Cluster::fake_only(true);
    let env = agentd(&cluster, serde_json::json!({}));
    sandbox(&env, "flood", &[]);
    let pid = env.agentd_pid();
    common::wait_for("the gateway", Duration::from_secs(10), || {
        env.ok(&["egress", "flood", "show", "--json"])
            .contains("\"serving\": true")
    });
    let asked = |env: &Env| {
        let out = env.ctl(&[
            "exec",
            "flood",
            "--",
            "sh",
            "-c",
            "curl -sS --max-time 20 http://example.test/ 2>&1",
        ]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(asked(&env).contains("Keystone Agent refused this connection"));
    let before = usage(pid);
    env.ok(&[
        "exec",
        "flood",
        "--",
        "sh",
        "-c",
        r#"python3 -c '
import os, socket, time
held = []
for i in range(600):
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect(("127.0.0.1", 3128))
    except BlockingIOError:
        pass
    held.append(s)
relay = [p for p in os.listdir("/proc") if p.isdigit()
         and b"keystone-relay" in open("/proc/%s/cmdline" % p, "rb").read()]
out = os.open("/proc/%s/fd/1" % relay[0], os.O_WRONLY | os.O_NONBLOCK)
end = time.time() + 4
while time.time() < end:
    try:
        os.write(out, b"\n" * 4096)
    except BlockingIOError:
        time.sleep(0.01)
' >/dev/null 2>&1 &"#,
    ]);
    let mut peak = before;
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        let now = usage(pid);
        peak = (peak.0.max(now.0), peak.1.max(now.1), peak.2.max(now.2));
        std::thread::sleep(Duration::from_millis(100));
    }
    // Each connection costs agentd a socket pair and a connection to the
    // API server; the gateway serves CONNECTIONS_MAX, a few more wait.
    let bound = before.1 + 3 * (agentd::egress::gateway::CONNECTIONS_MAX + 48) + 16;
    eprintln!("before {before:?}, peak {peak:?}, descriptor bound {bound}");
    assert!(
        peak.1 <= bound,
        "agentd held {} descriptors (before: {})",
        peak.1,
        before.1
    );
    assert!(
        peak.0 < before.0 + 100 * 1024,
        "agentd grew from {} to {} KiB",
        before.0,
        peak.0
    );
    // Once it ends, so does everything agentd held for it.
    let mut now = usage(pid);
    common::wait_for(
        "agentd's descriptors after the flood",
        Duration::from_secs(40),
        || {
            now = usage(pid);
            now.1 <= before.1 + 8
        },
    );
    eprintln!("after {now:?}");
    assert!(asked(&env).contains("Keystone Agent refused this connection"));
}

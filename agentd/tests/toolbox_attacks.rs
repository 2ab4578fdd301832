//! The agent toolbox against hostile input: packages whose sha512 matches
//! the registry's metadata but whose members reach outside (a compromised
//! registry), registries that answer without end or send agentd elsewhere,
//! settings that would inject, a sandbox that would hold installs back, and
//! agentds that install at once or die halfway.
//!
//! Everything runs against a registry of the test's own on loopback and a
//! cache in a temporary directory; the host's state is checked afterwards.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Env, wait_for};

// ---------------------------------------------------------------------------
// Tarballs, member by member.

#[derive(Clone)]
enum Kind {
    File(Vec<u8>),
    Dir,
    Symlink(String),
    Hardlink(String),
    Char,
    Block,
    Fifo,
}

#[derive(Clone)]
struct Member {
    name: String,
    mode: u32,
    kind: Kind,
}

fn file(name: &str, mode: u32, data: &str) -> Member {
    Member {
        name: name.into(),
        mode,
        kind: Kind::File(data.as_bytes().to_vec()),
    }
}

fn member(name: &str, mode: u32, kind: Kind) -> Member {
    Member {
        name: name.into(),
        mode,
        kind,
    }
}

fn octal(field: &mut [u8], v: u64) {
    let s = format!("{v:0w$o}\0", w = field.len() - 1);
    field.copy_from_slice(s.as_bytes());
}

fn header(name: &[u8], mode: u32, size: u64, flag: u8, link: &[u8]) -> [u8; 512] {
    let mut h = [0u8; 512];
    let n = name.len().min(100);
    h[..n].copy_from_slice(&name[..n]);
    octal(&mut h[100..108], u64::from(mode));
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], 0);
    h[156] = flag;
    let l = link.len().min(100);
    h[157..157 + l].copy_from_slice(&link[..l]);
    h[257..263].copy_from_slice(b"ustar ");
    h[263..265].copy_from_slice(b" \0");
    octal(&mut h[329..337], 0);
    octal(&mut h[337..345], 0);
    h[148..156].fill(b' ');
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    h
}

fn push_data(out: &mut Vec<u8>, data: &[u8]) {
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
}

/// A GNU tar stream of `members` (long names as GNU long-name entries).
fn tar_stream(members: &[Member]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in members {
        let (flag, data, link): (u8, &[u8], &[u8]) = match &m.kind {
            Kind::File(d) => (b'0', d, b""),
            Kind::Dir => (b'5', b"", b""),
            Kind::Symlink(t) => (b'2', b"", t.as_bytes()),
            Kind::Hardlink(t) => (b'1', b"", t.as_bytes()),
            Kind::Char => (b'3', b"", b""),
            Kind::Block => (b'4', b"", b""),
            Kind::Fifo => (b'6', b"", b""),
        };
        for (long, flag) in [(m.name.as_bytes(), b'L'), (link, b'K')] {
            if long.len() > 99 {
                let mut name = long.to_vec();
                name.push(0);
                out.extend_from_slice(&header(b"././@LongLink", 0, name.len() as u64, flag, b""));
                push_data(&mut out, &name);
            }
        }
        out.extend_from_slice(&header(
            m.name.as_bytes(),
            m.mode,
            data.len() as u64,
            flag,
            link,
        ));
        push_data(&mut out, data);
    }
    out.extend_from_slice(&[0u8; 1024]);
    out
}

/// `members` as a gzipped tarball.
fn tgz(dir: &Path, members: &[Member]) -> Vec<u8> {
    std::fs::create_dir_all(dir).unwrap();
    let raw = dir.join("stream.tar");
    std::fs::write(&raw, tar_stream(members)).unwrap();
    let out = Command::new("gzip")
        .args(["-9", "-n", "-c"])
        .arg(&raw)
        .output()
        .unwrap();
    assert!(out.status.success());
    std::fs::remove_file(&raw).unwrap();
    out.stdout
}

/// A Claude stand-in that prints `says`, as an npm tarball would hold it.
fn claude(says: &str) -> Vec<Member> {
    vec![
        member("package/", 0o755, Kind::Dir),
        file(
            "package/claude",
            0o755,
            &format!("#!/bin/sh\necho '{says}'\n"),
        ),
        file("package/package.json", 0o644, "{}"),
    ]
}

fn sha512_base64(data: &[u8]) -> String {
    use base64::Engine;
    use sha2::Digest;
    base64::engine::general_purpose::STANDARD.encode(sha2::Sha512::digest(data))
}

// ---------------------------------------------------------------------------
// A registry on loopback.

enum Reply {
    Body(Vec<u8>),
    /// A 302 to this URL.
    Redirect(String),
    /// A chunked answer of this many bytes, as long as the client reads.
    Endless(u64),
    /// The first half of the body at once, the rest once the flag is set
    /// (or after 20 s).
    Held(Vec<u8>, Arc<AtomicBool>),
    /// The body after a delay.
    Slow(Vec<u8>, Duration),
    NotFound,
}

struct Registry {
    base: String,
    /// Paths asked for, in order.
    requests: Arc<Mutex<Vec<String>>>,
    /// Body bytes the client took (written without error).
    sent: Arc<AtomicU64>,
}

impl Registry {
    fn asked(&self, prefix: &str) -> usize {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|p| p.starts_with(prefix))
            .count()
    }
}

/// Serve on a loopback port: `route(base, path)` answers each request.
fn registry(route: impl Fn(&str, &str) -> Reply + Send + Sync + 'static) -> Registry {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let requests = Arc::new(Mutex::new(Vec::new()));
    let sent = Arc::new(AtomicU64::new(0));
    let route = Arc::new(route);
    let (b, r, s) = (base.clone(), Arc::clone(&requests), Arc::clone(&sent));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let (b, r, s, route) = (
                b.clone(),
                Arc::clone(&r),
                Arc::clone(&s),
                Arc::clone(&route),
            );
            std::thread::spawn(move || answer(conn, &b, &r, &s, &*route));
        }
    });
    Registry {
        base,
        requests,
        sent,
    }
}

fn answer(
    mut conn: TcpStream,
    base: &str,
    requests: &Mutex<Vec<String>>,
    sent: &AtomicU64,
    route: &(dyn Fn(&str, &str) -> Reply + Send + Sync),
) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut h = String::new();
    while reader.read_line(&mut h).is_ok_and(|n| n > 2) {
        h.clear();
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
    requests.lock().unwrap().push(path.clone());
    let head = |len: usize| {
        format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n")
            .into_bytes()
    };
    let mut send = |data: &[u8], body: bool| {
        let ok = conn.write_all(data).is_ok();
        if ok && body {
            sent.fetch_add(data.len() as u64, Ordering::SeqCst);
        }
        ok
    };
    match route(base, &path) {
        Reply::Body(body) => {
            let _ = send(&head(body.len()), false) && send(&body, true);
        }
        Reply::Slow(body, delay) => {
            std::thread::sleep(delay);
            let _ = send(&head(body.len()), false) && send(&body, true);
        }
        Reply::Redirect(to) => {
            let _ = send(
                format!("HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
                false,
            );
        }
        Reply::Endless(total) => {
            if !send(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
                false,
            ) {
                return;
            }
            let chunk = vec![b' '; 1 << 16];
            let mut framed = format!("{:x}\r\n", chunk.len()).into_bytes();
            framed.extend_from_slice(&chunk);
            framed.extend_from_slice(b"\r\n");
            let mut n = 0;
            while n < total {
                if conn.write_all(&framed).is_err() {
                    return;
                }
                sent.fetch_add(chunk.len() as u64, Ordering::SeqCst);
                n += chunk.len() as u64;
            }
            let _ = conn.write_all(b"0\r\n\r\n");
        }
        Reply::Held(body, release) => {
            let half = body.len() / 2;
            if !(send(&head(body.len()), false) && send(&body[..half], true)) {
                return;
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            while !release.load(Ordering::SeqCst) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = send(&body[half..], true);
        }
        Reply::NotFound => {
            let _ = send(
                b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                false,
            );
        }
    }
}

fn arch() -> &'static str {
    if std::env::consts::ARCH == "aarch64" {
        "arm64"
    } else {
        "x64"
    }
}

/// The metadata path of Claude `version`, or `None` for another path.
fn meta_version(path: &str) -> Option<&str> {
    path.strip_prefix(&format!("/@anthropic-ai%2fclaude-code-linux-{}/", arch()))
}

fn meta(tarball: &str, integrity: &str) -> Reply {
    Reply::Body(
        serde_json::json!({"dist": {"tarball": tarball, "integrity": integrity}})
            .to_string()
            .into_bytes(),
    )
}

/// A registry of Claude packages: `version → tarball`, each with its true
/// sha512 and at `<base>/t/claude-<version>.tgz`.
fn honest_registry(packages: Vec<(String, Vec<u8>)>) -> Registry {
    registry(move |base, path| {
        if let Some(v) = meta_version(path) {
            return match packages.iter().find(|(pv, _)| pv == v) {
                Some((_, t)) => meta(
                    &format!("{base}/t/claude-{v}.tgz"),
                    &format!("sha512-{}", sha512_base64(t)),
                ),
                None => Reply::NotFound,
            };
        }
        let v = path
            .strip_prefix("/t/claude-")
            .and_then(|p| p.strip_suffix(".tgz"));
        match packages.iter().find(|(pv, _)| Some(pv.as_str()) == v) {
            Some((_, t)) => Reply::Body(t.clone()),
            None => Reply::NotFound,
        }
    })
}

// ---------------------------------------------------------------------------
// agentd --install-agents.

/// A temporary directory every uid may traverse (the tests run agentd as
/// `nobody` too).
fn scratch() -> tempfile::TempDir {
    let tmp = tempfile::Builder::new()
        .prefix("ks-toolbox-")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    tmp
}

fn config_json(registry: &str, cache: &Path, version: &str) -> serde_json::Value {
    // (The console's packages are pinned to npm's own tarballs, which
    // these registries do not serve.)
    serde_json::json!({"toolbox": {
        "agents": ["claude"],
        "versions": {"claude": version},
        "registry": registry,
        "cache_dir": cache,
        "download": false,
    }, "console": {"enable": false}})
}

fn write_config(dir: &Path, registry: &str, cache: &Path, version: &str) -> PathBuf {
    let path = dir.join(format!("agentd-{version}.json"));
    std::fs::write(&path, config_json(registry, cache, version).to_string()).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    path
}

struct Run {
    code: Option<i32>,
    stderr: String,
    timed_out: bool,
}

#[derive(Default)]
struct How {
    /// Run as this uid (and gid).
    uid: Option<u32>,
    /// With this soft limit of open files (systemd's default is 1024).
    nofile: Option<u32>,
    env: Vec<(&'static str, String)>,
}

fn spawn_install(config: &Path, how: &How, stderr: &Path) -> Child {
    let mut cmd = if let Some(n) = how.nofile {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
            .arg(common::AGENTD);
        c
    } else {
        Command::new(common::AGENTD)
    };
    cmd.arg("--install-agents")
        .arg("--config")
        .arg(config)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(stderr).unwrap());
    for (k, v) in &how.env {
        cmd.env(k, v);
    }
    if let Some(uid) = how.uid {
        cmd.uid(uid).gid(uid).env("HOME", "/nonexistent");
    }
    cmd.spawn().unwrap()
}

fn finish(mut child: Child, stderr: &Path, timeout: Duration) -> Run {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Run {
                code: status.code(),
                stderr: std::fs::read_to_string(stderr).unwrap_or_default(),
                timed_out: false,
            };
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Run {
                code: None,
                stderr: std::fs::read_to_string(stderr).unwrap_or_default(),
                timed_out: true,
            };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn install(config: &Path, how: &How, timeout: Duration) -> Run {
    let stderr = config.with_extension("stderr");
    let child = spawn_install(config, how, &stderr);
    finish(child, &stderr, timeout)
}

/// What an install left in the cache besides packages: `.install-*`.
fn leftovers(cache: &Path) -> Vec<String> {
    std::fs::read_dir(cache)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".install-"))
                .collect()
        })
        .unwrap_or_default()
}

/// Every entry under `dir`, not following links.
fn walk(dir: &Path, out: &mut Vec<(PathBuf, std::fs::Metadata)>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        let m = std::fs::symlink_metadata(&p).unwrap();
        let is_dir = m.is_dir();
        out.push((p.clone(), m));
        if is_dir {
            walk(&p, out);
        }
    }
}

/// An installed package holds only directories (0755) and regular files
/// (0755 or 0644), none of them `avoid`'s inode.
fn assert_sane_package(dir: &Path, avoid: &std::fs::Metadata) {
    let mut all = Vec::new();
    walk(dir, &mut all);
    for (p, m) in all {
        let mode = m.mode() & 0o7777;
        let t = m.file_type();
        assert!(
            (t.is_dir() && mode == 0o755) || (t.is_file() && (mode == 0o755 || mode == 0o644)),
            "{}: type {t:?} mode {mode:o}",
            p.display()
        );
        assert!(
            !(m.dev() == avoid.dev() && m.ino() == avoid.ino()),
            "{} is the host's file",
            p.display()
        );
    }
}

// ---------------------------------------------------------------------------
// 1. Packages that match their sha512 but reach outside.

#[test]
fn hostile_members_of_a_vouched_for_package_touch_nothing_outside_its_directory() {
    let tmp = scratch();
    let victim = tmp.path().join("victim");
    std::fs::create_dir(&victim).unwrap();
    let secret = victim.join("secret");
    std::fs::write(&secret, "host secret\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let before = std::fs::metadata(&secret).unwrap();
    let v = victim.to_string_lossy().into_owned();
    // The package is unpacked in <tmp>/cache/.install-*/package: three
    // levels up is <tmp>.
    let up = "../../..";
    let cases: Vec<(&str, Vec<Member>)> = vec![
        (
            "absolute path",
            vec![file(&format!("{v}/abs-pwned"), 0o644, "x")],
        ),
        (
            "dot-dot path",
            vec![file(&format!("package/{up}/victim/dd-pwned"), 0o644, "x")],
        ),
        (
            "dot-dot path to the temporary directory's tarball",
            vec![file("package/../package.tgz", 0o644, "x")],
        ),
        (
            "symlink to a host directory, then a file through it",
            vec![
                member("package/a", 0o777, Kind::Symlink(v.clone())),
                file("package/a/sym-pwned", 0o644, "x"),
            ],
        ),
        (
            "relative symlink out, then a file through it",
            vec![
                member("package/r", 0o777, Kind::Symlink(format!("{up}/victim"))),
                file("package/r/symrel-pwned", 0o644, "x"),
            ],
        ),
        (
            "chain of symlinks, then a file through it",
            vec![
                member("package/b", 0o777, Kind::Symlink(v.clone())),
                member("package/c", 0o777, Kind::Symlink("b".into())),
                file("package/c/chain-pwned", 0o644, "x"),
            ],
        ),
        (
            "symlink, then a hard link through it",
            vec![
                member("package/s", 0o777, Kind::Symlink(v.clone())),
                member(
                    "package/h",
                    0o644,
                    Kind::Hardlink("package/s/secret".into()),
                ),
            ],
        ),
        (
            "symlink to a host file, then a write to it",
            vec![
                member(
                    "package/f",
                    0o777,
                    Kind::Symlink(secret.to_string_lossy().into_owned()),
                ),
                file("package/f", 0o644, "overwritten\n"),
            ],
        ),
        (
            "hard link to a host file (absolute)",
            vec![member(
                "package/h",
                0o644,
                Kind::Hardlink(secret.to_string_lossy().into_owned()),
            )],
        ),
        (
            "hard link to a host file (dot-dot)",
            vec![member(
                "package/h",
                0o644,
                Kind::Hardlink(format!("{up}/victim/secret")),
            )],
        ),
        (
            "hard link to a host file (dot-dot after the package)",
            vec![member(
                "package/h",
                0o644,
                Kind::Hardlink(format!("package/{up}/victim/secret")),
            )],
        ),
        (
            "hard link, then a write through it",
            vec![
                file("package/x", 0o644, "original\n"),
                member("package/h", 0o644, Kind::Hardlink("package/x".into())),
                file("package/h", 0o644, "through the link\n"),
            ],
        ),
        (
            "setuid, setgid, sticky and world-writable modes",
            vec![
                file("package/suid", 0o4755, "#!/bin/sh\n"),
                file("package/sgid", 0o2755, "#!/bin/sh\n"),
                file("package/ww", 0o666, "x"),
                member("package/sgid-dir/", 0o2777, Kind::Dir),
                member("package/sticky/", 0o1777, Kind::Dir),
                file("package/sticky/f", 0o4777, "x"),
            ],
        ),
        (
            "devices and a fifo",
            vec![
                member("package/blk", 0o666, Kind::Block),
                member("package/chr", 0o666, Kind::Char),
                member("package/fifo", 0o666, Kind::Fifo),
            ],
        ),
        (
            "members named like the cache's own entries",
            vec![
                file(
                    "package/../../claude-1.0.99/claude",
                    0o755,
                    "#!/bin/sh\necho pwned\n",
                ),
                file("package/../../.lock", 0o644, "x"),
            ],
        ),
        (
            "a top-level symlink and its members",
            vec![
                member("package", 0o777, Kind::Symlink(v.clone())),
                file("package/top-pwned", 0o644, "x"),
            ],
        ),
        (
            "a directory of mode 000",
            vec![
                member("package/d/", 0o000, Kind::Dir),
                file("package/d/f", 0o000, "x"),
            ],
        ),
    ];
    let mut packages = Vec::new();
    for (i, (_, members)) in cases.iter().enumerate() {
        let mut all = claude(&format!("case {i}"));
        all.extend(members.iter().cloned());
        packages.push((
            format!("1.0.{i}"),
            tgz(&tmp.path().join(format!("t{i}")), &all),
        ));
    }
    let reg = honest_registry(packages);
    let cache = tmp.path().join("cache");
    let mut report = Vec::new();
    for (i, (what, _)) in cases.iter().enumerate() {
        let version = format!("1.0.{i}");
        let config = write_config(tmp.path(), &reg.base, &cache, &version);
        let run = install(&config, &How::default(), Duration::from_secs(60));
        assert!(!run.timed_out, "{what}: {}", run.stderr);
        // Outside: the victim directory and its file as they were.
        let mut names: Vec<String> = std::fs::read_dir(&victim)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["secret"],
            "{what}: written into the host's directory"
        );
        let now = std::fs::symlink_metadata(&secret).unwrap();
        assert_eq!(
            std::fs::read_to_string(&secret).unwrap(),
            "host secret\n",
            "{what}"
        );
        assert_eq!(now.nlink(), 1, "{what}: the host's file was hard-linked");
        assert_eq!(now.mode(), before.mode(), "{what}");
        assert_eq!(now.ino(), before.ino(), "{what}");
        let tmp_names: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("pwned"))
            .collect();
        assert!(tmp_names.is_empty(), "{what}: {tmp_names:?}");
        // Inside: a sane package or none, and no temporary directory.
        let installed = cache.join(format!("claude-{version}"));
        if installed.exists() {
            assert_sane_package(&installed, &before);
            assert_eq!(
                std::fs::read_to_string(installed.join("claude")).unwrap(),
                format!("#!/bin/sh\necho 'case {i}'\n"),
                "{what}"
            );
        }
        assert!(
            leftovers(&cache).is_empty(),
            "{what}: {:?}",
            leftovers(&cache)
        );
        report.push(format!(
            "{what}: {}",
            if run.code == Some(0) {
                "installed, sanitized".to_owned()
            } else {
                format!(
                    "refused ({})",
                    run.stderr
                        .lines()
                        .find(|l| l.contains("tar: ") && !l.contains("Exiting with failure"))
                        .or(run.stderr.lines().last())
                        .unwrap_or("")
                        .trim()
                )
            }
        ));
    }
    // Nothing but the packages and the lock in the cache.
    for e in std::fs::read_dir(&cache).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        assert!(n == ".lock" || n.starts_with("claude-1.0."), "{n}");
    }
    eprintln!("{}", report.join("\n"));
}

/// A package whose paths nest 1100 directories deep: agentd runs with
/// systemd's default of 1024 open files. It is refused, and nothing of it
/// stays in the cache.
#[test]
fn a_package_nested_too_deep_is_refused_and_leaves_nothing_behind() {
    let tmp = scratch();
    let mut members = claude("deep");
    members.push(file(&format!("package/{}f", "a/".repeat(1100)), 0o644, "x"));
    let reg = honest_registry(vec![
        ("1.0.0".into(), tgz(&tmp.path().join("t"), &members)),
        ("2.0.0".into(), tgz(&tmp.path().join("g"), &claude("good"))),
    ]);
    let cache = tmp.path().join("cache");
    let how = How {
        nofile: Some(1024),
        ..How::default()
    };
    let run = install(
        &write_config(tmp.path(), &reg.base, &cache, "1.0.0"),
        &how,
        Duration::from_secs(60),
    );
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert!(!cache.join("claude-1.0.0").exists());
    assert!(
        leftovers(&cache).is_empty(),
        "{:?} stays in the cache; agentd said: {}",
        leftovers(&cache),
        run.stderr
    );
    assert!(run.stderr.contains("deeper than"), "{}", run.stderr);
    // And the next package installs.
    let run = install(
        &write_config(tmp.path(), &reg.base, &cache, "2.0.0"),
        &how,
        Duration::from_secs(60),
    );
    assert_eq!(run.code, Some(0), "{}", run.stderr);
}

/// A small tarball of very many entries: each costs an inode (a directory
/// a block too) whatever the bytes of the tar stream, so the 4 GiB bound
/// alone would let 8 million of them through. It is refused before
/// anything is written.
#[test]
fn a_package_of_very_many_entries_is_refused_before_it_is_unpacked() {
    let tmp = scratch();
    let mut members = claude("many");
    for i in 0..120_000 {
        members.push(file(&format!("package/d{}/f{i}", i / 1000), 0o644, ""));
    }
    let t = tgz(&tmp.path().join("t"), &members);
    assert!(t.len() < 8 << 20, "a small tarball: {} bytes", t.len());
    let reg = honest_registry(vec![("1.0.0".into(), t)]);
    let cache = tmp.path().join("cache");
    let started = Instant::now();
    let run = install(
        &write_config(tmp.path(), &reg.base, &cache, "1.0.0"),
        &How::default(),
        Duration::from_secs(120),
    );
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert!(run.stderr.contains("entries"), "{}", run.stderr);
    assert!(!cache.join("claude-1.0.0").exists());
    assert!(leftovers(&cache).is_empty());
    eprintln!("refused in {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------
// 2. Registries.

#[test]
fn metadata_that_is_not_json_names_no_sha512_or_another_host_installs_nothing() {
    let tmp = scratch();
    let good = tgz(&tmp.path().join("g"), &claude("good"));
    let sum = format!("sha512-{}", sha512_base64(&good));
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let (g, s) = (good.clone(), sum.clone());
    let reg = registry(move |base, path| {
        let here = base.trim_start_matches("http://");
        match meta_version(path) {
            Some("1.0.1") => Reply::Body(b"<html>not json</html>".to_vec()),
            Some("1.0.2") => meta(&format!("{base}/t/x.tgz"), "sha1-AAAA"),
            Some("1.0.3") => meta(&format!("{base}/t/x.tgz"), "sha512-"),
            Some("1.0.4") => meta(&format!("http://localhost:{port}/t/x.tgz"), &s),
            Some("1.0.5") => meta(&format!("https://{here}/t/x.tgz"), &s),
            Some("1.0.6") => meta(&format!("http://{here}@127.0.0.2:{port}/t/x.tgz"), &s),
            Some("1.0.7") => meta(&format!("file:///etc/passwd#{base}"), &s),
            Some("1.0.8") => meta(&format!("{base}/t/x.tgz"), &format!("sha512-AAAA {s}")),
            Some("1.0.9") => Reply::Body(vec![b'['; 1 << 20]),
            _ if path == "/t/x.tgz" => Reply::Body(g.clone()),
            _ => Reply::NotFound,
        }
    });
    let cache = tmp.path().join("cache");
    for i in 1..=9 {
        let version = format!("1.0.{i}");
        let run = install(
            &write_config(tmp.path(), &reg.base, &cache, &version),
            &How::default(),
            Duration::from_secs(30),
        );
        assert_eq!(run.code, Some(1), "{version}: {}", run.stderr);
        assert!(!cache.join(format!("claude-{version}")).exists());
    }
    // Only 1.0.3 (an empty sha512) and 1.0.8 (several, the first wrong) get
    // as far as the tarball, and neither sha512 is the tarball's.
    assert_eq!(reg.asked("/t/"), 2, "{:?}", reg.requests.lock().unwrap());
    assert!(leftovers(&cache).is_empty());
}

/// A registry that answers metadata without end (chunked, so without a
/// length curl could check first): agentd stops reading at its bound.
#[test]
fn endless_metadata_is_cut_off_at_its_bound() {
    let tmp = scratch();
    let reg = registry(|_, path| {
        if meta_version(path).is_some() {
            Reply::Endless(128 << 20)
        } else {
            Reply::NotFound
        }
    });
    let cache = tmp.path().join("cache");
    let run = install(
        &write_config(tmp.path(), &reg.base, &cache, "1.0.0"),
        &How::default(),
        Duration::from_secs(60),
    );
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    let sent = reg.sent.load(Ordering::SeqCst);
    assert!(
        sent < 48 << 20,
        "agentd took {} MiB of metadata (the bound is 4 MiB)",
        sent >> 20
    );
    assert!(leftovers(&cache).is_empty());
}

/// A tarball URL with curl's glob syntax in its path: one request, not one
/// per expansion.
#[test]
fn a_tarball_url_is_fetched_as_it_is_not_expanded() {
    let tmp = scratch();
    let good = tgz(&tmp.path().join("g"), &claude("good"));
    let sum = format!("sha512-{}", sha512_base64(&good));
    let reg = registry(move |base, path| {
        if meta_version(path).is_some() {
            meta(&format!("{base}/t/claude-[1-40].tgz"), &sum)
        } else if path == "/t/claude-1.tgz" {
            Reply::Body(good.clone())
        } else {
            Reply::NotFound
        }
    });
    let cache = tmp.path().join("cache");
    let _ = install(
        &write_config(tmp.path(), &reg.base, &cache, "1.0.0"),
        &How::default(),
        Duration::from_secs(60),
    );
    let asked = reg.asked("/t/");
    assert!(
        asked <= 1,
        "{asked} requests for one tarball: {:?}",
        reg.requests.lock().unwrap()
    );
}

/// The registry redirects the tarball to another host (with a tarball
/// whose sha512 matches): agentd follows no redirect, so the package never
/// comes from elsewhere.
#[test]
fn a_tarball_redirected_to_another_host_is_not_installed() {
    let tmp = scratch();
    let www = tmp.path().join("www");
    std::fs::create_dir_all(&www).unwrap();
    let evil = tgz(&tmp.path().join("e"), &claude("from another host"));
    std::fs::write(www.join("evil.tgz"), &evil).unwrap();
    let ok = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
        ])
        .arg(tmp.path().join("key.pem"))
        .arg("-out")
        .arg(tmp.path().join("cert.pem"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(ok.success());
    let port = common::caddy::free_port();
    let mut server = Command::new("openssl")
        .args([
            "s_server",
            "-quiet",
            "-WWW",
            "-accept",
            &port.to_string(),
            "-cert",
        ])
        .arg(tmp.path().join("cert.pem"))
        .arg("-key")
        .arg(tmp.path().join("key.pem"))
        .current_dir(&www)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("the other host", Duration::from_secs(10), || {
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let sum = format!("sha512-{}", sha512_base64(&evil));
    let reg = registry(move |base, path| {
        if meta_version(path).is_some() {
            meta(&format!("{base}/t/claude-1.0.0.tgz"), &sum)
        } else {
            Reply::Redirect(format!("https://localhost:{port}/evil.tgz"))
        }
    });
    let cache = tmp.path().join("cache");
    let how = How {
        env: vec![(
            "CURL_CA_BUNDLE",
            tmp.path().join("cert.pem").to_string_lossy().into_owned(),
        )],
        ..How::default()
    };
    let run = install(
        &write_config(tmp.path(), &reg.base, &cache, "1.0.0"),
        &how,
        Duration::from_secs(60),
    );
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        !cache.join("claude-1.0.0").exists(),
        "installed from https://localhost:{port}, not the registry's host: {}",
        run.stderr
    );
    assert!(
        run.stderr.contains("the registry answered with a redirect"),
        "{}",
        run.stderr
    );
}

// ---------------------------------------------------------------------------
// 4. Inside a sandbox.

/// A cache with Claude 1.0.0 installed from `reg`, and an agentd using it.
fn sandbox_env(tmp: &Path, reg: &Registry) -> (PathBuf, Env) {
    let cache = tmp.join("cache");
    let run = install(
        &write_config(tmp, &reg.base, &cache, "1.0.0"),
        &How::default(),
        Duration::from_secs(60),
    );
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let env = Env::with_config(&config_json(&reg.base, &cache, "1.0.0"));
    (cache, env)
}

/// Whether someone holds a flock on `path` (tried for up to `within`).
fn someone_locks(path: &Path, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(_) => {}
            Err(_) => return true,
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The toolbox's lock file is in the directory every sandbox sees: a
/// sandbox that could open it could flock it and hold every install of
/// every agentd using the cache back for as long as it likes.
#[test]
fn a_sandbox_cannot_hold_the_toolbox_lock() {
    let tmp = scratch();
    let reg = honest_registry(vec![
        ("1.0.0".into(), tgz(&tmp.path().join("a"), &claude("one"))),
        ("2.0.0".into(), tgz(&tmp.path().join("b"), &claude("two"))),
    ]);
    let (cache, env) = sandbox_env(tmp.path(), &reg);
    env.create_running("holder", &[]);
    let out = env.sh(
        "holder",
        "( flock -s 9 && echo locked >&2 && exec sleep 60 ) 9</run/keystone/agents/.lock \
           >/dev/null 2>&1 & \
         ( flock -x 9 && exec sleep 60 ) 9>>/run/keystone/agents/.lock >/dev/null 2>&1 & \
         sleep 1; ls -l /run/keystone/agents/.lock",
    );
    eprintln!("{out}");
    let held = someone_locks(&cache.join(".lock"), Duration::from_secs(2));
    let run = install(
        &write_config(tmp.path(), &reg.base, &cache, "2.0.0"),
        &How::default(),
        Duration::from_secs(20),
    );
    assert!(
        !run.timed_out && run.code == Some(0),
        "the sandbox holds the toolbox lock ({held}): agentd --install-agents waited {}; {}",
        if run.timed_out {
            "for good"
        } else {
            "and failed"
        },
        run.stderr
    );
    assert!(!held);
    assert!(cache.join("claude-2.0.0/claude").is_file());
}

/// A hostile agent tries to put a `claude` of its own before the toolbox's,
/// for later commands of its sandbox or for another sandbox.
#[test]
fn a_sandbox_cannot_replace_the_launchers_or_packages_of_later_commands() {
    let tmp = scratch();
    let reg = honest_registry(vec![(
        "1.0.0".into(),
        tgz(&tmp.path().join("a"), &claude("1.0.0 (stand-in Claude)")),
    )]);
    let (cache, env) = sandbox_env(tmp.path(), &reg);
    env.create_running("hostile", &[]);
    env.create_running("other", &[]);
    let launcher = std::fs::read_to_string(env.state_dir.join("guest/bin/claude")).unwrap();
    let out = env.sh(
        "hostile",
        r#"mkdir -p /tmp/evil/claude-1.0.0 && printf '#!/bin/sh\necho evil\n' > /tmp/evil/claude \
           && chmod +x /tmp/evil/claude && cp /tmp/evil/claude /tmp/evil/claude-1.0.0/claude
         echo "PATH=$PATH"
         for d in $(echo "$PATH" | tr : ' ') /run/keystone/agents /run/keystone/agents/claude-1.0.0; do
           (: > "$d/.hostile") 2>/dev/null && echo "writable $d"
         done
         mount --bind /tmp/evil /run/keystone/bin 2>/dev/null && echo "mounted bin"
         mount --bind /tmp/evil /run/keystone/agents 2>/dev/null && echo "mounted agents"
         mount -o remount,rw /run/keystone 2>/dev/null && echo "remounted"
         unshare -Urm sh -c 'mount --bind /tmp/evil /run/keystone/bin && mount --bind /tmp/evil /run/keystone/agents && echo nested-ns: $(claude)' 2>&1
         rm -rf /run/keystone/bin/claude /run/keystone/agents/claude-1.0.0 2>/dev/null
         mv /run/keystone/agents/claude-1.0.0 /run/keystone/agents/x 2>/dev/null && echo moved
         true"#,
    );
    eprintln!("{out}");
    assert!(out.starts_with("PATH=/run/keystone/bin:"), "{out}");
    for bad in [
        "writable ",
        "mounted bin",
        "mounted agents",
        "remounted",
        "moved",
    ] {
        assert!(!out.contains(bad), "{out}");
    }
    // Later commands, here and in the other sandbox, run agentd's launcher
    // and the package as installed.
    for sb in ["hostile", "other"] {
        let out = env.sh(
            sb,
            "command -v claude; claude; cat /run/keystone/bin/claude",
        );
        assert_eq!(
            out,
            format!("/run/keystone/bin/claude\n1.0.0 (stand-in Claude)\n{launcher}"),
            "{sb}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(env.state_dir.join("guest/bin/claude")).unwrap(),
        launcher
    );
    let mut names: Vec<String> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, [".lock", "claude-1.0.0"]);
    assert_eq!(
        std::fs::read_to_string(cache.join("claude-1.0.0/claude")).unwrap(),
        "#!/bin/sh\necho '1.0.0 (stand-in Claude)'\n"
    );
}

// ---------------------------------------------------------------------------
// 5. Several agentds, and one that dies.

#[test]
fn two_agentds_installing_at_once_download_once_and_both_succeed() {
    let tmp = scratch();
    let t = tgz(&tmp.path().join("a"), &claude("once"));
    let sum = format!("sha512-{}", sha512_base64(&t));
    let reg = registry(move |base, path| {
        if meta_version(path).is_some() {
            meta(&format!("{base}/t/claude-1.0.0.tgz"), &sum)
        } else if path == "/t/claude-1.0.0.tgz" {
            Reply::Slow(t.clone(), Duration::from_millis(1500))
        } else {
            Reply::NotFound
        }
    });
    let cache = tmp.path().join("cache");
    let config = write_config(tmp.path(), &reg.base, &cache, "1.0.0");
    let (e1, e2) = (tmp.path().join("one.stderr"), tmp.path().join("two.stderr"));
    let a = spawn_install(&config, &How::default(), &e1);
    let b = spawn_install(&config, &How::default(), &e2);
    let (ra, rb) = (
        finish(a, &e1, Duration::from_secs(60)),
        finish(b, &e2, Duration::from_secs(60)),
    );
    assert_eq!(ra.code, Some(0), "{}", ra.stderr);
    assert_eq!(rb.code, Some(0), "{}", rb.stderr);
    assert_eq!(reg.asked("/t/"), 1);
    assert!(cache.join("claude-1.0.0/claude").is_file());
    assert!(leftovers(&cache).is_empty());
}

/// agentd killed (SIGKILL) in the middle of a download leaves its
/// temporary directory; the next install removes it.
#[test]
fn a_killed_install_leaves_nothing_once_the_next_one_ran() {
    let tmp = scratch();
    let big: Vec<u8> = (0..4 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut members = claude("killed");
    members.push(Member {
        name: "package/blob".into(),
        mode: 0o644,
        kind: Kind::File(big),
    });
    let slow = tgz(&tmp.path().join("a"), &members);
    let good = tgz(&tmp.path().join("b"), &claude("next"));
    let release = Arc::new(AtomicBool::new(false));
    let (s1, s2) = (
        format!("sha512-{}", sha512_base64(&slow)),
        format!("sha512-{}", sha512_base64(&good)),
    );
    let r = Arc::clone(&release);
    let reg = registry(move |base, path| match meta_version(path) {
        Some("1.0.0") => meta(&format!("{base}/t/slow.tgz"), &s1),
        Some("2.0.0") => meta(&format!("{base}/t/good.tgz"), &s2),
        _ if path == "/t/slow.tgz" => Reply::Held(slow.clone(), Arc::clone(&r)),
        _ if path == "/t/good.tgz" => Reply::Body(good.clone()),
        _ => Reply::NotFound,
    });
    let cache = tmp.path().join("cache");
    let stderr = tmp.path().join("killed.stderr");
    let mut child = spawn_install(
        &write_config(tmp.path(), &reg.base, &cache, "1.0.0"),
        &How::default(),
        &stderr,
    );
    wait_for("the download to start", Duration::from_secs(20), || {
        leftovers(&cache).iter().any(|d| {
            std::fs::metadata(cache.join(d).join("package.tgz")).is_ok_and(|m| m.len() > 0)
        })
    });
    child.kill().unwrap();
    child.wait().unwrap();
    release.store(true, Ordering::SeqCst);
    let stale = leftovers(&cache);
    assert_eq!(stale.len(), 1, "{stale:?}");
    let run = install(
        &write_config(tmp.path(), &reg.base, &cache, "2.0.0"),
        &How::default(),
        Duration::from_secs(60),
    );
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(cache.join("claude-2.0.0/claude").is_file());
    assert!(!cache.join("claude-1.0.0").exists());
    // curl, orphaned by the kill, may still be writing into it for a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !leftovers(&cache).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        leftovers(&cache).is_empty(),
        "{:?} stays in the cache for good",
        leftovers(&cache)
    );
}

/// An unprivileged agentd whose install fails after tar made a directory
/// of mode 000 (which `remove_dir_all` cannot enter without privilege).
#[test]
fn a_failed_install_of_an_unprivileged_agentd_leaves_nothing() {
    if !common::is_root() {
        eprintln!("skipped: needs root to run agentd as nobody");
        return;
    }
    const NOBODY: u32 = 65534;
    let tmp = scratch();
    let mut members = claude("locked dir");
    members.extend([
        member("package/d/", 0o000, Kind::Dir),
        file("package/d/f", 0o644, "x"),
        // tar cannot make this one and fails.
        member("package/z", 0o644, Kind::Hardlink("package/missing".into())),
    ]);
    let reg = honest_registry(vec![
        ("1.0.0".into(), tgz(&tmp.path().join("a"), &members)),
        ("2.0.0".into(), tgz(&tmp.path().join("b"), &claude("next"))),
    ]);
    let cache = tmp.path().join("cache");
    std::fs::create_dir(&cache).unwrap();
    std::os::unix::fs::chown(&cache, Some(NOBODY), Some(NOBODY)).unwrap();
    let how = How {
        uid: Some(NOBODY),
        ..How::default()
    };
    let run = install(
        &write_config(tmp.path(), &reg.base, &cache, "1.0.0"),
        &how,
        Duration::from_secs(60),
    );
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    let first = leftovers(&cache);
    let run = install(
        &write_config(tmp.path(), &reg.base, &cache, "2.0.0"),
        &how,
        Duration::from_secs(60),
    );
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(
        first.is_empty() && leftovers(&cache).is_empty(),
        "after the failure {first:?}, after the next install {:?}",
        leftovers(&cache)
    );
}

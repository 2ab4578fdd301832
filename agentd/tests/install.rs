//! The install layout: `make install` and `make uninstall` from the
//! repository's Makefile, the installed systemd units, D-Bus activation of
//! the installed agentd on a private session bus, shell completions and man
//! pages.
//!
//! The tests install the debug binaries the test run built
//! (`PROFILE=debug`, this run's target directory), so make runs no cargo
//! build. Tools they need (make, systemd-analyze, man, bash-completion) fail
//! the test in CI (`CI=true`) and skip it elsewhere when missing.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::io::Read as _;
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{AGENTD, agentctl, wait_for};

/// make writes the generated files of one profile into one directory:
/// one make at a time.
static MAKE: Mutex<()> = Mutex::new(());

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The target directory of this test run (`…/target` of `…/target/debug/agentd`).
fn target_dir() -> PathBuf {
    Path::new(AGENTD)
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_owned()
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Whether `what` (from Debian's `package`) is there: in CI its absence
/// fails the test; elsewhere the test is skipped with a line saying why.
fn have(what: &str, present: bool, package: &str) -> bool {
    if present {
        return true;
    }
    assert!(
        !in_ci(),
        "{what} is missing (apt-get install {package}); .ci/run installs it"
    );
    eprintln!("skipped: {what} is missing (apt-get install {package})");
    false
}

/// Whether `tool` is an executable file in a directory of PATH.
fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| {
        std::env::split_paths(&p).any(|d| {
            fs::metadata(d.join(tool))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

fn have_tool(tool: &str, package: &str) -> bool {
    have(tool, on_path(tool), package)
}

/// Run `cmd` with its output captured; it is killed (its whole process
/// group) and the test fails when it takes longer than `limit`.
fn run(cmd: &mut Command, limit: Duration) -> Output {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let reader = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let out = reader(Box::new(child.stdout.take().unwrap()));
    let err = reader(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let pgid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
            let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
            let _ = child.wait();
            panic!("{what} took longer than {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// Run `cmd`, which must succeed within `limit`; its stdout.
fn ok(cmd: &mut Command, limit: Duration) -> String {
    let what = format!("{cmd:?}");
    let out = run(cmd, limit);
    assert!(
        out.status.success(),
        "{what} failed ({:?}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `make TARGET` in the repository with `vars`, for this run's debug
/// binaries; must succeed. Its stdout.
fn make(target: &str, vars: &[(&str, &Path)]) -> String {
    // Built by this test run (or make would build them, and another time).
    for bin in [
        Path::new(AGENTD),
        &agentctl(),
        &target_dir().join("debug/keystone-relay"),
    ] {
        assert!(
            bin.exists(),
            "{} is missing: cargo build --workspace",
            bin.display()
        );
    }
    let _one = MAKE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut cmd = Command::new("make");
    cmd.arg("-C")
        .arg(repo_root())
        .arg("--no-print-directory")
        .arg(target)
        .arg("PROFILE=debug")
        .env("CARGO_TARGET_DIR", target_dir())
        // Not the make (and jobserver) that may run cargo test.
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .env_remove("MAKELEVEL");
    for (k, v) in vars {
        cmd.arg(format!("{k}={}", v.display()));
    }
    ok(&mut cmd, Duration::from_secs(120))
}

/// Every file (and symlink) under `root`, as paths relative to it, sorted.
fn files_under(root: &Path) -> BTreeSet<String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        for e in fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                walk(root, &p, out);
            } else {
                out.insert(p.strip_prefix(root).unwrap().to_str().unwrap().to_owned());
            }
        }
    }
    let mut out = BTreeSet::new();
    if root.exists() {
        walk(root, root, &mut out);
    }
    out
}

/// agentctl's subcommands as `agentctl --help` lists them, nested ones
/// joined with `-` (`secret-set`), `help` left out.
fn subcommands(path: &[String]) -> Vec<String> {
    let help = ok(
        Command::new(agentctl()).args(path).arg("--help"),
        Duration::from_secs(10),
    );
    let mut out = Vec::new();
    let mut in_commands = false;
    for line in help.lines() {
        if line == "Commands:" {
            in_commands = true;
            continue;
        }
        if in_commands {
            // "  name   description": a new entry; deeper indentation
            // continues a description.
            let Some(entry) = line.strip_prefix("  ") else {
                break;
            };
            if entry.starts_with(' ') {
                continue;
            }
            let name = entry.split_whitespace().next().unwrap().to_owned();
            if name == "help" {
                continue;
            }
            let mut sub = path.to_vec();
            sub.push(name);
            out.push(sub.join("-"));
            out.extend(subcommands(&sub));
        }
    }
    out
}

/// The files `make install PREFIX=/usr` must write, relative to DESTDIR.
fn expected_layout() -> BTreeSet<String> {
    let mut want: BTreeSet<String> = [
        "usr/bin/agentd",
        "usr/bin/agentctl",
        "usr/bin/keystone-relay",
        "usr/share/dbus-1/system.d/org.keystone.Agent1.conf",
        "usr/share/dbus-1/services/org.keystone.Agent1.service",
        "usr/share/dbus-1/system-services/org.keystone.Agent1.service",
        "usr/lib/systemd/system/agentd.service",
        "usr/lib/systemd/user/agentd.service",
        "usr/lib/sysusers.d/keystone-agent.conf",
        "usr/share/bash-completion/completions/agentctl",
        "usr/share/zsh/site-functions/_agentctl",
        "usr/share/fish/vendor_completions.d/agentctl.fish",
        "usr/share/man/man1/agentctl.1",
        "usr/share/man/man8/agentd.8",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    let subs = subcommands(&[]);
    // The verbs every release has; the rest come from --help.
    for verb in ["create", "list", "exec", "secret-set", "worktree-add"] {
        assert!(subs.iter().any(|s| s == verb), "{verb} in {subs:?}");
    }
    for sub in subs {
        want.insert(format!("usr/share/man/man1/agentctl-{sub}.1"));
    }
    want
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn lines_of(text: &str) -> Vec<&str> {
    text.lines().map(str::trim).collect()
}

#[test]
fn install_writes_exactly_the_layout_and_uninstall_removes_it() {
    if !have_tool("make", "make") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("root");
    // Files that were there before: uninstall must leave them.
    let unrelated = [
        "usr/bin/unrelated",
        "usr/share/man/man1/unrelated.1",
        "usr/share/dbus-1/services/org.example.Other.service",
        "usr/lib/systemd/system/other.service",
    ];
    for f in unrelated {
        let p = dest.join(f);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, "not ours\n").unwrap();
        // A directory of another mode, which install must leave so.
        fs::set_permissions(p.parent().unwrap(), fs::Permissions::from_mode(0o2775)).unwrap();
    }
    let vars: &[(&str, &Path)] = &[("PREFIX", Path::new("/usr")), ("DESTDIR", &dest)];

    let t = Instant::now();
    make("install", vars);
    eprintln!("make install: {:?}", t.elapsed());

    let mut installed = files_under(&dest);
    for f in unrelated {
        assert!(installed.remove(f), "{f} is gone after install");
    }
    let want = expected_layout();
    let missing: Vec<_> = want.difference(&installed).collect();
    let extra: Vec<_> = installed.difference(&want).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "make install: missing {missing:?}, not expected {extra:?}"
    );
    // The Makefile's own list says the same.
    let listed: BTreeSet<String> = make("installed-files", vars)
        .lines()
        .map(|l| {
            Path::new(l)
                .strip_prefix(&dest)
                .unwrap_or_else(|_| panic!("{l} is outside DESTDIR"))
                .to_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(listed, want, "make installed-files");

    // Modes: binaries executable, the rest plain files.
    for f in &installed {
        let meta = fs::symlink_metadata(dest.join(f)).unwrap();
        assert!(meta.is_file(), "{f} is not a regular file");
        let mode = meta.permissions().mode() & 0o7777;
        let want = if f.starts_with("usr/bin/") {
            0o755
        } else {
            0o644
        };
        assert_eq!(mode, want, "mode of {f}: {mode:o}");
    }
    let dir_mode = |d: &str| fs::metadata(dest.join(d)).unwrap().permissions().mode() & 0o7777;
    for f in unrelated {
        let d = Path::new(f).parent().unwrap().to_str().unwrap();
        assert_eq!(dir_mode(d), 0o2775, "mode of the existing {d}");
    }
    for d in [
        "usr/share/zsh",
        "usr/share/zsh/site-functions",
        "usr/share/man/man8",
    ] {
        assert_eq!(dir_mode(d), 0o755, "mode of {d}, made by install");
    }
    // The binaries are the ones built.
    let built = target_dir().join("debug");
    for b in ["agentd", "agentctl", "keystone-relay"] {
        assert!(
            fs::read(dest.join("usr/bin").join(b)).unwrap() == fs::read(built.join(b)).unwrap(),
            "usr/bin/{b} is not {}",
            built.join(b).display()
        );
    }
    assert_eq!(
        read(&dest.join("usr/share/dbus-1/system.d/org.keystone.Agent1.conf")),
        read(&repo_root().join("agentd/dbus/org.keystone.Agent1.conf"))
    );

    // Templates filled in: the installed paths, nothing left to substitute.
    let unit = read(&dest.join("usr/lib/systemd/system/agentd.service"));
    let unit = lines_of(&unit);
    for line in [
        "Type=dbus",
        "BusName=org.keystone.Agent1",
        "ExecStart=/usr/bin/agentd --system",
        "Restart=on-failure",
        "StateDirectory=keystone-agent",
        "StateDirectoryMode=0711",
        "CacheDirectory=keystone-agent",
        "Delegate=yes",
        "NoNewPrivileges=yes",
        "ProtectSystem=full",
        "WantedBy=multi-user.target",
        "Alias=dbus-org.keystone.Agent1.service",
    ] {
        assert!(unit.contains(&line), "system unit lacks {line}");
    }
    // The bounding set is the NixOS module's.
    let module = read(&repo_root().join("nixos-modules/host/default.nix"));
    let nix_caps: BTreeSet<&str> = module
        .lines()
        .filter_map(|l| l.trim().strip_prefix('"')?.split('"').next())
        .filter(|c| c.starts_with("CAP_"))
        .collect();
    let unit_caps: BTreeSet<&str> = unit
        .iter()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("CapabilityBoundingSet")
        .split_whitespace()
        .collect();
    assert!(nix_caps.len() > 10, "{nix_caps:?}");
    assert_eq!(unit_caps, nix_caps, "bounding set (unit, NixOS module)");

    let user = read(&dest.join("usr/lib/systemd/user/agentd.service"));
    let user = lines_of(&user);
    for line in [
        "Type=dbus",
        "BusName=org.keystone.Agent1",
        "ExecStart=/usr/bin/agentd --session",
        "Delegate=yes",
        "Restart=on-failure",
        "WantedBy=default.target",
    ] {
        assert!(user.contains(&line), "user unit lacks {line}");
    }
    let session = read(&dest.join("usr/share/dbus-1/services/org.keystone.Agent1.service"));
    let session = lines_of(&session);
    for line in [
        "[D-BUS Service]",
        "Name=org.keystone.Agent1",
        "Exec=/usr/bin/agentd --session",
        "SystemdService=agentd.service",
    ] {
        assert!(
            session.contains(&line),
            "session activation file lacks {line}"
        );
    }
    let system = read(&dest.join("usr/share/dbus-1/system-services/org.keystone.Agent1.service"));
    let system = lines_of(&system);
    for line in [
        "[D-BUS Service]",
        "Name=org.keystone.Agent1",
        "Exec=/usr/bin/agentd --system",
        "User=root",
        "SystemdService=dbus-org.keystone.Agent1.service",
    ] {
        assert!(
            system.contains(&line),
            "system activation file lacks {line}"
        );
    }
    for f in &installed {
        if !f.starts_with("usr/bin/") {
            assert!(
                !read(&dest.join(f)).contains("@bindir@"),
                "@bindir@ left in {f}"
            );
        }
    }

    // Installing again over it changes nothing in the list.
    make("install", vars);
    let mut again = files_under(&dest);
    for f in unrelated {
        again.remove(f);
    }
    assert_eq!(again, want, "a second install");

    let t = Instant::now();
    make("uninstall", vars);
    eprintln!("make uninstall: {:?}", t.elapsed());
    let left = files_under(&dest);
    let unrelated: BTreeSet<String> = unrelated.into_iter().map(String::from).collect();
    let stayed: Vec<_> = left.difference(&unrelated).collect();
    let lost: Vec<_> = unrelated.difference(&left).collect();
    assert!(
        stayed.is_empty() && lost.is_empty(),
        "make uninstall: left {stayed:?}, removed files that were not its own {lost:?}"
    );
    for f in &unrelated {
        assert_eq!(read(&dest.join(f)), "not ours\n");
    }
    // Uninstalling what is not there is no error.
    make("uninstall", vars);
}

/// An install with a real prefix (no DESTDIR) in a temporary directory, so
/// that the paths the units and activation files name exist.
struct Installed {
    tmp: tempfile::TempDir,
    prefix: PathBuf,
}

impl Installed {
    fn new() -> Self {
        let tmp = tempfile::Builder::new()
            .prefix("ks-install-")
            .tempdir_in("/tmp")
            .unwrap();
        // The bus daemon and agentd reach into it.
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let prefix = tmp.path().join("prefix");
        make("install", &[("PREFIX", &prefix)]);
        Self { tmp, prefix }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.prefix.join(rel)
    }
}

#[test]
fn installed_units_pass_systemd_analyze_verify() {
    if !have_tool("make", "make") || !have_tool("systemd-analyze", "systemd") {
        return;
    }
    let inst = Installed::new();
    let runtime = inst.tmp.path().join("runtime");
    fs::create_dir(&runtime).unwrap();
    fs::set_permissions(&runtime, fs::Permissions::from_mode(0o700)).unwrap();
    // With the installed man pages on MANPATH, --man=yes checks that the
    // units' Documentation=man: pages exist, where man is there.
    let man = if on_path("man") {
        "--man=yes"
    } else {
        "--man=no"
    };
    for (unit, user) in [
        ("lib/systemd/system/agentd.service", false),
        ("lib/systemd/user/agentd.service", true),
    ] {
        // The units the verified one pulls in (Type=dbus needs dbus.socket)
        // come from systemd's own unit directories: a build sandbox with
        // the tool and none of them cannot verify anything.
        let mut paths = Command::new("systemd-analyze");
        if user {
            paths.arg("--user");
        }
        paths.arg("unit-paths").env("XDG_RUNTIME_DIR", &runtime);
        let dirs = ok(&mut paths, Duration::from_secs(30));
        let found = |name: &str| dirs.lines().any(|d| Path::new(d).join(name).exists());
        if !have(
            &format!("dbus.socket and basic.target on systemd's unit path (user: {user})"),
            found("dbus.socket") && found("basic.target"),
            "systemd dbus dbus-user-session",
        ) {
            continue;
        }
        let mut cmd = Command::new("systemd-analyze");
        if user {
            cmd.arg("--user");
        }
        cmd.args(["verify", man])
            .arg(inst.path(unit))
            .env("XDG_RUNTIME_DIR", &runtime)
            .env("MANPATH", inst.path("share/man"))
            .env("SYSTEMD_LOG_LEVEL", "notice")
            .env("SYSTEMD_PAGER", "");
        let out = run(&mut cmd, Duration::from_secs(60));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stderr.trim().is_empty(),
            "systemd-analyze verify {unit} ({:?}):\n{stderr}",
            out.status
        );
    }
}

/// A private session bus whose service directory is the install's, and
/// whose environment (handed to what it activates) points HOME and the XDG
/// directories into the temporary directory. Kills what is left on drop.
struct Bus {
    address: String,
    daemon: std::process::Child,
    state_dir: PathBuf,
    home: PathBuf,
}

impl Bus {
    fn new(inst: &Installed) -> Self {
        let dir = inst.tmp.path();
        let home = dir.join("home");
        let config = dir.join("config");
        let state = dir.join("state");
        let cache = dir.join("cache");
        let runtime = dir.join("runtime");
        for d in [&home, &config, &state, &cache, &runtime] {
            fs::create_dir_all(d).unwrap();
        }
        fs::set_permissions(&runtime, fs::Permissions::from_mode(0o700)).unwrap();
        // agentd reads $XDG_CONFIG_HOME/keystone/agentd.json on its own: no
        // toolbox downloads in a test.
        fs::create_dir_all(config.join("keystone")).unwrap();
        fs::write(
            config.join("keystone/agentd.json"),
            r#"{"toolbox": {"download": false}}"#,
        )
        .unwrap();
        let (conf, sock) = common::bus_config(
            dir,
            "bus",
            "session",
            &format!(
                "<servicedir>{}</servicedir>\n  {}",
                inst.path("share/dbus-1/services").display(),
                common::OPEN_POLICY
            ),
        );
        let daemon = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", conf.display()))
            .arg("--nofork")
            .env_clear()
            .env(
                "PATH",
                std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()),
            )
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", &config)
            .env("XDG_STATE_HOME", &state)
            .env("XDG_CACHE_HOME", &cache)
            .env("XDG_RUNTIME_DIR", &runtime)
            .env("AGENTD_LOG", "debug,hyper_util=info,hyper=info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(
                fs::File::create(dir.join("bus.log"))
                    .map(Stdio::from)
                    .unwrap(),
            )
            .process_group(0)
            .spawn()
            .expect("dbus-daemon must be installed (apt-get install dbus)");
        wait_for("the bus socket", Duration::from_secs(10), || {
            std::os::unix::net::UnixStream::connect(&sock).is_ok()
        });
        Self {
            address: format!("unix:path={}", sock.display()),
            daemon,
            state_dir: state.join("keystone/agent"),
            home,
        }
    }

    /// The bus daemon's log, with what the services it started wrote.
    fn log(&self) -> String {
        let dir = self.home.parent().unwrap();
        fs::read_to_string(dir.join("bus.log")).unwrap_or_default()
    }

    fn ctl(&self, args: &[&str]) -> String {
        let mut cmd = Command::new(agentctl());
        cmd.arg("--bus").arg(&self.address).args(args);
        let what = format!("agentctl {args:?}");
        let out = run(&mut cmd, Duration::from_secs(90));
        assert!(
            out.status.success(),
            "--- bus and agentd log ---\n{}\n---\n{what} failed ({:?}):\n{}",
            self.log(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Ask the bus daemon: `busctl call org.freedesktop.DBus … METHOD s NAME`.
    fn driver(&self, method: &str) -> String {
        ok(
            Command::new("busctl")
                .arg(format!("--address={}", self.address))
                .args([
                    "call",
                    "org.freedesktop.DBus",
                    "/org/freedesktop/DBus",
                    "org.freedesktop.DBus",
                    method,
                    "s",
                    "org.keystone.Agent1",
                ]),
            Duration::from_secs(10),
        )
    }

    /// Live processes that belong to this bus's agentd: its state directory
    /// or the install's prefix on their command line.
    fn agentd_processes(&self, prefix: &Path) -> Vec<(i32, String)> {
        let marks = [
            self.state_dir.to_string_lossy().into_owned(),
            prefix.to_string_lossy().into_owned(),
        ];
        agentd::procfs::pids()
            .into_iter()
            .filter(|&p| agentd::procfs::state(p).is_some_and(|s| s != 'Z'))
            .filter_map(|p| Some((p, agentd::procfs::cmdline(p)?.join(" "))))
            .filter(|(_, c)| marks.iter().any(|m| c.contains(m.as_str())))
            .collect()
    }
}

impl Drop for Bus {
    fn drop(&mut self) {
        let prefix = self.home.parent().unwrap().join("prefix");
        for (pid, _) in self.agentd_processes(&prefix) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let pgid = nix::unistd::Pid::from_raw(i32::try_from(self.daemon.id()).unwrap());
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.daemon.wait();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !agentd::cgroup::Cgroups::remove_all(&self.state_dir) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let root = self.home.parent().unwrap().to_owned();
        let mut mounts: Vec<PathBuf> = fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4).map(PathBuf::from))
            .filter(|p| p.starts_with(&root))
            .collect();
        mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for m in mounts {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

#[test]
fn the_first_agentctl_call_starts_the_installed_agentd_by_activation() {
    if !have_tool("make", "make") || !have_tool("busctl", "systemd") {
        return;
    }
    let inst = Installed::new();
    let bus = Bus::new(&inst);
    let nobody = |what: &str| assert_eq!(bus.driver("NameHasOwner").trim(), "b false", "{what}");
    nobody("agentd runs before any call");

    // No agentd runs: the call starts it.
    let t = Instant::now();
    let table = bus.ctl(&["list"]);
    eprintln!("first call, agentd activated: {:?}", t.elapsed());
    assert!(table.starts_with("No sandboxes."), "{table}");
    let pid: i32 = bus
        .driver("GetConnectionUnixProcessID")
        .trim()
        .strip_prefix("u ")
        .unwrap()
        .parse()
        .unwrap();
    // The installed binary, as the installed activation file says.
    assert_eq!(
        agentd::procfs::cmdline(pid).unwrap(),
        vec![
            inst.path("bin/agentd").to_string_lossy().into_owned(),
            "--session".to_owned()
        ]
    );

    // Its state went where the bus's environment says.
    let repo = common::repo_in(inst.tmp.path(), "demo");
    bus.ctl(&["create", repo.to_str().unwrap()]);
    bus.ctl(&["start", "demo"]);
    let list: serde_json::Value = serde_json::from_str(&bus.ctl(&["list", "--json"])).unwrap();
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["demo"]);
    assert_eq!(list[0]["state"], "running");
    assert!(bus.state_dir.join("registry.json").exists());

    // SIGTERM, as `systemctl --user stop agentd` sends: agentd stops the
    // sandbox and exits, and nothing it started is left.
    let started = bus.agentd_processes(&inst.prefix);
    assert!(
        started.iter().any(|(p, _)| *p != pid),
        "the running sandbox's processes: {started:?}"
    );
    eprintln!("agentd and what it started: {started:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let t = Instant::now();
    wait_for(
        "agentd and its sandbox to end",
        Duration::from_secs(60),
        || bus.agentd_processes(&inst.prefix).is_empty(),
    );
    eprintln!("agentd stopped after SIGTERM: {:?}", t.elapsed());
    for (p, cmd) in &started {
        assert!(
            agentd::procfs::state(*p).is_none_or(|s| s == 'Z'),
            "{p} ({cmd}) still runs"
        );
    }
    nobody("the name is still owned after agentd ended");
    let record: serde_json::Value =
        serde_json::from_str(&read(&bus.state_dir.join("registry/demo.json"))).unwrap();
    assert_eq!(record["sandbox"]["state"], "stopped", "{record}");
}

/// `make install PREFIX=/usr DESTDIR=<temp>/root`: the temp dir and DESTDIR.
fn install_into_tempdir() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("root");
    make(
        "install",
        &[("PREFIX", Path::new("/usr")), ("DESTDIR", &dest)],
    );
    (tmp, dest)
}

#[test]
fn installed_bash_completion_loads() {
    if !have_tool("make", "make") || !have_tool("bash", "bash") {
        return;
    }
    let (tmp, dest) = install_into_tempdir();
    let share = dest.join("usr/share");
    let file = share.join("bash-completion/completions/agentctl");
    let home = tmp.path().join("home");
    fs::create_dir(&home).unwrap();
    // Completing `agentctl cre` offers create, and `agentctl secret s` set.
    let complete = r#"
        spec=$(complete -p agentctl) || exit 1
        echo "$spec"
        func=$(sed -n 's/.* -F \([^ ]*\) .*/\1/p' <<<"$spec")
        COMP_WORDS=(agentctl cre); COMP_CWORD=1; COMP_LINE="agentctl cre"; COMP_POINT=${#COMP_LINE}
        "$func" agentctl cre agentctl
        echo "1: ${COMPREPLY[*]}"
        COMP_WORDS=(agentctl secret s); COMP_CWORD=2; COMP_LINE="agentctl secret s"; COMP_POINT=${#COMP_LINE}
        "$func" agentctl s secret
        echo "2: ${COMPREPLY[*]}"
    "#;
    let bash = |script: String| {
        ok(
            Command::new("bash")
                .args(["--norc", "--noprofile", "-c", &script])
                .env_clear()
                .env("PATH", "/usr/bin:/bin")
                .env("HOME", &home)
                .env("XDG_DATA_DIRS", &share),
            Duration::from_secs(30),
        )
    };
    let check = |out: &str, how: &str| {
        let spec = out.lines().next().unwrap_or_default();
        assert!(
            spec.starts_with("complete ") && spec.ends_with(" agentctl") && spec.contains(" -F "),
            "{how}: {out}"
        );
        assert!(
            out.lines().any(|l| l
                .strip_prefix("1: ")
                .is_some_and(|w| w.split(' ').any(|w| w == "create"))),
            "{how}: {out}"
        );
        assert!(
            out.lines().any(|l| l
                .strip_prefix("2: ")
                .is_some_and(|w| w.split(' ').any(|w| w == "set"))),
            "{how}: {out}"
        );
    };
    let out = bash(format!("source '{}'\n{complete}", file.display()));
    check(&out, "sourced");

    // Through bash-completion's loader, which finds it in XDG_DATA_DIRS.
    let loader = Path::new("/usr/share/bash-completion/bash_completion");
    if have("bash-completion", loader.exists(), "bash-completion") {
        let out = bash(format!(
            "source {}\n__load_completion agentctl || exit 1\n{complete}",
            loader.display()
        ));
        check(&out, "through bash-completion's loader");
    }

    for (f, shell) in [
        ("zsh/site-functions/_agentctl", "zsh"),
        ("fish/vendor_completions.d/agentctl.fish", "fish"),
    ] {
        let text = read(&share.join(f));
        assert!(
            text.contains("agentctl") && text.len() > 1000,
            "{f}: {text}"
        );
        if on_path(shell) {
            ok(
                Command::new(shell).arg("-n").arg(share.join(f)),
                Duration::from_secs(30),
            );
        } else {
            eprintln!("{shell} is not installed: {f} not parsed");
        }
    }
}

#[test]
fn installed_man_pages_render() {
    if !have_tool("make", "make") || !have_tool("man", "man-db") {
        return;
    }
    let (_tmp, dest) = install_into_tempdir();
    let man = dest.join("usr/share/man");
    for (page, needles) in [
        ("man1/agentctl.1", &["agentctl", "--bus", "create"][..]),
        (
            "man1/agentctl-create.1",
            &["agentctl-create", "--bus", "--name"][..],
        ),
        (
            "man1/agentctl-secret-set.1",
            &["agentctl-secret-set", "--host"][..],
        ),
        ("man8/agentd.8", &["agentd", "--session", "--system"][..]),
    ] {
        let out = run(
            Command::new("man")
                .args(["--warnings", "-l"])
                .arg(man.join(page))
                .env("MANWIDTH", "80")
                .env("MANPAGER", "cat")
                .env("PAGER", "cat")
                .env("LC_ALL", "C.UTF-8"),
            Duration::from_secs(30),
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stderr.trim().is_empty(),
            "man -l {page} ({:?}):\n{stderr}",
            out.status
        );
        assert!(text.lines().any(|l| l == "NAME"), "{page}:\n{text}");
        assert!(text.lines().any(|l| l == "OPTIONS"), "{page}:\n{text}");
        for n in needles {
            assert!(text.contains(n), "{page} lacks {n}:\n{text}");
        }
    }
}

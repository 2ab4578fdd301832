//! Test harness: a private dbus-daemon, the real agentd binary, the real
//! agentctl binary, real git repositories in a temporary directory.

#![allow(dead_code, reason = "each test file uses a different part")]

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub mod caddy;
pub mod cdp;
pub mod dns;
pub mod ssh;
pub mod systemd;
pub mod term;
pub mod tls;
pub mod vm;

/// `text` as JSON (agentctl's `--json` output), or a panic that shows it.
pub fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

pub const AGENTD: &str = env!("CARGO_BIN_EXE_agentd");

/// agentctl is built next to agentd (its own package's tests make cargo
/// build it for `cargo test --workspace`).
pub fn agentctl() -> PathBuf {
    let p = Path::new(AGENTD).with_file_name("agentctl");
    assert!(
        p.exists(),
        "{} is missing: run the tests with `cargo test --workspace`",
        p.display()
    );
    p
}

pub fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

/// The name of the user the tests run as (a declared sandbox's owner).
pub fn user_name() -> String {
    nix::unistd::User::from_uid(nix::unistd::Uid::effective())
        .unwrap()
        .unwrap()
        .name
}

/// Wait for `cond` with a deadline.
pub fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub struct Env {
    pub tmp: tempfile::TempDir,
    pub address: String,
    pub state_dir: PathBuf,
    dbus: Child,
    agentd: Option<Child>,
    pub config: Option<PathBuf>,
    /// The uid agentd and agentctl run as (root's tests only); agentd's own
    /// otherwise.
    pub user: Option<u32>,
    /// Environment for agentd: set (`Some`) or removed (`None`).
    pub agentd_env: Vec<(String, Option<String>)>,
    /// The soft descriptor limit agentd starts with (the test's own when
    /// `None`).
    pub soft_nofile: Option<u64>,
}

impl Env {
    /// A bus and a running agentd.
    pub fn new() -> Self {
        let mut env = Self::bus_only();
        env.start_agentd();
        env
    }

    /// A bus, no agentd yet.
    pub fn bus_only() -> Self {
        let tmp = tempfile::Builder::new()
            .prefix("ks-")
            .tempdir_in("/tmp")
            .unwrap();
        // Other uids (the permission tests) must reach the bus socket.
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let (dbus, sock) = spawn_bus(tmp.path(), "bus", "session", OPEN_POLICY);
        let address = format!("unix:path={}", sock.display());
        let state_dir = tmp.path().join("state");
        Self {
            tmp,
            address,
            state_dir,
            dbus,
            agentd: None,
            config: None,
            user: None,
            agentd_env: Vec::new(),
            soft_nofile: None,
        }
    }

    /// A bus, a Caddy of the test's own and an agentd whose links go
    /// through it (plain HTTP, no link token).
    pub fn with_caddy() -> (Self, caddy::Caddy) {
        let mut env = Self::bus_only();
        let caddy = caddy::Caddy::start(env.tmp.path());
        let config = env.tmp.path().join("agentd.json");
        fs::write(&config, caddy.agentd_config(false)).unwrap();
        env.config = Some(config);
        env.start_agentd();
        (env, caddy)
    }

    /// A bus and an agentd running as the unprivileged `uid` (as
    /// `agentd --session` would) with `config` as its configuration file,
    /// and agentctl as that uid too. Root only.
    pub fn as_user(uid: u32, config: &serde_json::Value) -> Self {
        let mut env = Self::bus_only();
        fs::create_dir(&env.state_dir).unwrap();
        std::os::unix::fs::chown(&env.state_dir, Some(uid), Some(uid)).unwrap();
        let path = env.tmp.path().join("agentd.json");
        fs::write(&path, config.to_string()).unwrap();
        env.config = Some(path);
        env.user = Some(uid);
        env.start_agentd();
        env
    }

    /// A bus, agentd, and a running sandbox `name` made from a fresh
    /// repository of that name with `create`'s `extra` options.
    pub fn running(name: &str, extra: &[&str]) -> Self {
        let env = Self::new();
        env.create_running(name, extra);
        env
    }

    /// A bus and agentd started with `config` as its configuration file.
    pub fn with_config(config: &serde_json::Value) -> Self {
        let mut env = Self::bus_only();
        let path = env.tmp.path().join("agentd.json");
        fs::write(&path, config.to_string()).unwrap();
        env.config = Some(path);
        env.start_agentd();
        env
    }

    /// Create sandbox `name` from a fresh repository of that name with
    /// `create`'s `extra` options, and start it.
    pub fn create_running(&self, name: &str, extra: &[&str]) {
        let repo = self.repo(name);
        let mut args = vec!["create"];
        args.extend_from_slice(extra);
        args.push(repo.to_str().unwrap());
        self.ok(&args);
        self.ok(&["start", name]);
        // Settled: what agentd keeps running in it is there.
        self.wait_listening(name);
    }

    /// Run `f` with a proxy of sandbox `name`'s object, on a connection of
    /// its own.
    pub fn with_sandbox(
        &self,
        name: &str,
        f: impl AsyncFnOnce(keystone_agent_api::SandboxProxy<'_>),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let conn = zbus::connection::Builder::address(self.address.as_str())
                .unwrap()
                .build()
                .await
                .unwrap();
            let sb = keystone_agent_api::SandboxProxy::builder(&conn)
                .path(format!("/org/keystone/Agent1/sandbox/{name}"))
                .unwrap()
                .build()
                .await
                .unwrap();
            f(sb).await;
        });
    }

    /// The pid of the running agentd.
    pub fn agentd_pid(&self) -> i32 {
        i32::try_from(self.agentd.as_ref().expect("agentd runs").id()).unwrap()
    }

    pub fn log_path(&self) -> PathBuf {
        self.tmp.path().join("agentd.log")
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Start agentd and wait until it answers.
    pub fn start_agentd(&mut self) {
        let child = self.spawn_agentd();
        let pid = child.id();
        self.agentd = Some(child);
        let addr = self.address.clone();
        // Owned by this agentd: after a kill -9 the bus may still name the
        // killed one for a moment.
        wait_for("agentd to own its name", Duration::from_secs(20), || {
            Command::new("busctl")
                .args([
                    &format!("--address={addr}"),
                    "call",
                    "org.freedesktop.DBus",
                    "/org/freedesktop/DBus",
                    "org.freedesktop.DBus",
                    "GetConnectionUnixProcessID",
                    "s",
                    "org.keystone.Agent1",
                ])
                .stderr(Stdio::null())
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == format!("u {pid}"))
        });
    }

    pub fn spawn_agentd(&self) -> Child {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        let mut cmd = match self.soft_nofile {
            Some(n) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("ulimit -Sn {n} && exec \"$0\" \"$@\""))
                    .arg(AGENTD);
                c
            }
            None => Command::new(AGENTD),
        };
        cmd.args(["--address", &self.address, "--state-dir"])
            .arg(&self.state_dir)
            .env("AGENTD_LOG", "debug,hyper_util=info,hyper=info")
            .stdout(Stdio::null())
            .stderr(log);
        cmd.arg("--config").arg(self.effective_config());
        for (k, v) in &self.agentd_env {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        if let Some(uid) = self.user {
            let user = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
                .unwrap()
                .expect("the test user has an account");
            cmd.uid(uid).gid(user.gid.as_raw()).env("HOME", user.dir);
        }
        cmd.spawn().unwrap()
    }

    /// The configuration file agentd gets: the test's, with the agent
    /// toolbox's downloads off unless the test configures the toolbox (so
    /// that no test but those of the toolbox fetches packages). A file
    /// that is not a JSON object goes through as it is.
    fn effective_config(&self) -> PathBuf {
        let mut config = match &self.config {
            Some(c) => match fs::read_to_string(c)
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            {
                Some(v) if v.is_object() => v,
                _ => return c.clone(),
            },
            None => serde_json::json!({}),
        };
        if config.get("toolbox").is_none() {
            config["toolbox"] = serde_json::json!({"download": false});
        }
        let path = self.tmp.path().join("agentd.effective.json");
        fs::write(&path, config.to_string()).unwrap();
        path
    }

    /// SIGKILL agentd, as a crash would.
    pub fn kill_agentd(&mut self) {
        if let Some(mut c) = self.agentd.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM agentd and wait for it to exit.
    pub fn term_agentd(&mut self) -> std::process::ExitStatus {
        let mut c = self.agentd.take().expect("agentd runs");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(c.id()).unwrap()),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        c.wait().unwrap()
    }

    /// An agentctl command for this bus, not yet run.
    pub fn ctl_cmd(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(agentctl());
        cmd.arg("--bus")
            .arg(&self.address)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        cmd
    }

    pub fn ctl(&self, args: &[&str]) -> Output {
        self.ctl_as(None, args)
    }

    /// Run agentctl with `input` on its standard input (a secret's value,
    /// which must never be an argument).
    pub fn ctl_with_stdin(&self, args: &[&str], input: &[u8]) -> Output {
        use std::io::Write as _;
        let mut c = self
            .ctl_cmd(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(input).unwrap();
        c.wait_with_output().unwrap()
    }

    /// Give sandbox `name` secret `var` for `host`, put in its `header`,
    /// the value on agentctl's standard input; must succeed.
    pub fn set_secret(&self, name: &str, var: &str, host: &str, header: &str, value: &[u8]) {
        let out = self.ctl_with_stdin(
            &[
                "secret", "set", name, var, "--host", host, "--header", header,
            ],
            value,
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Run agentctl, as `uid` when given (root only), else as the
    /// environment's user.
    pub fn ctl_as(&self, uid: Option<u32>, args: &[&str]) -> Output {
        let uid = uid.or(self.user);
        let mut cmd = Command::new(agentctl());
        cmd.arg("--bus")
            .arg(&self.address)
            .args(args)
            .stdin(Stdio::null());
        if let Some(uid) = uid {
            // std drops supplementary groups when root sets a uid.
            cmd.uid(uid).gid(uid);
        }
        cmd.output().unwrap()
    }

    /// `busctl VERB` (`call`, `get-property`) of `member` of interface
    /// `org.keystone.Agent1.IFACE` on sandbox `name`'s object, with
    /// `args`, as `uid` when given (root only).
    pub fn busctl_as(
        &self,
        uid: Option<u32>,
        verb: &str,
        (name, iface, member): (&str, &str, &str),
        args: &[&str],
    ) -> Output {
        let mut cmd = Command::new("busctl");
        cmd.arg(format!("--address={}", self.address))
            .args([
                verb,
                "org.keystone.Agent1",
                &format!("/org/keystone/Agent1/sandbox/{name}"),
                &format!("org.keystone.Agent1.{iface}"),
                member,
            ])
            .args(args)
            .stdin(Stdio::null());
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        cmd.output().unwrap()
    }

    /// agentctl that must succeed; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        // The log first and the failure last: CI shows the end of it.
        assert!(
            out.status.success(),
            "--- agentd log ---\n{}\n--- end of agentd log ---\nagentctl {args:?} failed ({:?}):\n{}",
            self.log(),
            out.status.code(),
            String::from_utf8_lossy(&out.stderr),
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// agentctl that must fail with `code`; returns stderr.
    pub fn fails(&self, code: i32, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert_eq!(
            out.status.code(),
            Some(code),
            "agentctl {args:?}: stdout {} stderr {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stderr).unwrap()
    }

    pub fn status(&self, name: &str) -> serde_json::Value {
        serde_json::from_str(&self.ok(&["status", name, "--json"])).unwrap()
    }

    pub fn state(&self, name: &str) -> String {
        self.status(name)["state"].as_str().unwrap().to_owned()
    }

    pub fn list(&self) -> Vec<serde_json::Value> {
        serde_json::from_str(&self.ok(&["list", "--json"])).unwrap()
    }

    /// Every sandbox's registry record, by name, as `{"sandboxes": [...]}`.
    pub fn registry(&self) -> serde_json::Value {
        let mut records: Vec<serde_json::Value> = fs::read_dir(self.state_dir.join("registry"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                let name = p.file_name().unwrap().to_string_lossy();
                name.ends_with(".json") && !name.starts_with('.')
            })
            .map(|p| {
                let mut v: serde_json::Value =
                    serde_json::from_slice(&fs::read(p).unwrap()).unwrap();
                v["sandbox"].take()
            })
            .collect();
        records.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
        serde_json::json!({ "sandboxes": records })
    }

    /// Put `registry` (as [`Env::registry`] gives it) on disk in its place,
    /// with agentd not running: each sandbox's record, and no other.
    pub fn write_registry(&self, registry: &serde_json::Value) {
        let dir = self.state_dir.join("registry");
        for e in fs::read_dir(&dir).unwrap() {
            fs::remove_file(e.unwrap().path()).unwrap();
        }
        for sb in registry["sandboxes"].as_array().unwrap() {
            let record = serde_json::json!({ "schema_version": 2, "sandbox": sb });
            fs::write(
                dir.join(format!("{}.json", sb["name"].as_str().unwrap())),
                serde_json::to_vec_pretty(&record).unwrap(),
            )
            .unwrap();
        }
    }

    /// A git repository with one commit, in the temp dir.
    pub fn repo(&self, name: &str) -> PathBuf {
        let dir = repo_in(self.tmp.path(), name);
        fs::set_permissions(self.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }

    /// Run `script` with sh inside sandbox `name`, killed after 60 s;
    /// (exit code, stdout+stderr).
    pub fn inside(&self, name: &str, script: &str) -> (i32, String) {
        let out = self.ctl(&["exec", name, "--timeout", "60", "--", "sh", "-c", script]);
        (
            out.status.code().unwrap_or(-1),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    }

    /// Wait until agentd's listener of the agents' hooks runs in sandbox
    /// `name` (a process agentd keeps there while it runs: count it in
    /// before measuring).
    ///
    /// A `local` sandbox's processes are looked for on the host (nothing
    /// runs in it for the look, nor goes into its history); elsewhere a
    /// command inside looks.
    pub fn wait_listening(&self, name: &str) {
        let registry = self.registry();
        let sb = registry["sandboxes"]
            .as_array()
            .and_then(|a| a.iter().find(|s| s["name"] == name).cloned())
            .unwrap_or_default();
        let init = sb["runtime"]["init_pid"]
            .as_i64()
            .filter(|_| sb["backend"] == "local");
        wait_for("the agents' listener", Duration::from_secs(60), || {
            match init {
            Some(init) => {
                let ns = |p: &str| fs::read_link(format!("/proc/{p}/ns/pid")).ok();
                let theirs = ns(&init.to_string());
                fs::read_dir("/proc").unwrap().flatten().any(|e| {
                    let p = e.file_name().to_string_lossy().into_owned();
                    fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c == b"cat\0-u\0")
                        && theirs.is_some()
                        && ns(&p) == theirs
                })
            }
            None => {
                self.inside(
                    name,
                    "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done | grep -qx 'cat -u '",
                )
                .0 == 0
            }
        }
        });
    }

    /// Run `script` with sh inside sandbox `name`; its output (it must
    /// succeed).
    pub fn sh(&self, name: &str, script: &str) -> String {
        self.ok(&["exec", name, "--", "sh", "-c", script])
    }

    /// The URL (with its token) of sandbox `name`'s first dev-server link,
    /// once it has one (30 s at most).
    pub fn link_url(&self, name: &str) -> String {
        let mut url = String::new();
        wait_for("a link with a token", Duration::from_secs(30), || {
            let routes: serde_json::Value =
                serde_json::from_str(&self.ok(&["ports", name, "--json"])).unwrap();
            url = routes["routes"][0]["url"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            url.contains("?keystone_token=")
        });
        url
    }

    /// The pid of this agentd's helper `arg` (e.g. `__sync-read`), waiting
    /// up to 30 s for one to run.
    pub fn wait_for_helper(&self, arg: &str) -> i32 {
        wait_for(arg, Duration::from_secs(30), || {
            !self.helpers(arg, false).is_empty()
        });
        self.helpers(arg, false)[0]
    }

    /// Whether any helper `arg` of this agentd still runs.
    pub fn helper_runs(&self, arg: &str) -> bool {
        !self.helpers(arg, true).is_empty()
    }

    /// The pids of this agentd's helpers `arg` (`agentd ARG`, started by
    /// this agentd, or by a helper of it), without zombies if `live`.
    fn helpers(&self, arg: &str, live: bool) -> Vec<i32> {
        let agentd = self.agentd.as_ref().map(|c| c.id() as i32);
        let ours = |pid: i32| {
            let mut p = pid;
            for _ in 0..4 {
                match agentd::procfs::ppid(p) {
                    Some(pp) if Some(pp) == agentd => return true,
                    Some(pp) if pp > 1 => p = pp,
                    _ => return false,
                }
            }
            false
        };
        agentd::procfs::pids()
            .into_iter()
            .filter(|&p| {
                (!live || agentd::procfs::state(p).is_some_and(|s| s != 'Z'))
                    && agentd::procfs::cmdline(p)
                        .is_some_and(|c| c.get(1).is_some_and(|a| a == arg))
                    && ours(p)
            })
            .collect()
    }

    /// Live pids of this agentd's sandbox supervisors and inits.
    pub fn sandbox_pids(&self) -> Vec<i32> {
        let marker = self.state_dir.to_string_lossy().into_owned();
        agentd::procfs::pids_with_args(&["__sandbox-init", &marker])
            .into_iter()
            .map(|(p, _)| p)
            .collect()
    }
}

impl Env {
    /// Live processes (pid, command line) that work for this agentd's VM
    /// sandboxes: supervisors, QEMU, virtiofsd, ssh.
    pub fn vm_processes(&self) -> Vec<(i32, String)> {
        let marker = self.state_dir.join("sandboxes");
        let marker = marker.to_string_lossy();
        agentd::procfs::pids()
            .into_iter()
            .filter(|&p| agentd::procfs::state(p).is_some_and(|s| s != 'Z'))
            .filter_map(|p| Some((p, agentd::procfs::cmdline(p)?.join(" "))))
            .filter(|(_, c)| c.contains(marker.as_ref()))
            .collect()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        self.kill_agentd();
        for (pid, _) in self.vm_processes() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        for pid in self.sandbox_pids() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = self.dbus.kill();
        let _ = self.dbus.wait();
        // The cgroups of sandboxes killed above, once their processes are
        // gone.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !agentd::cgroup::Cgroups::remove_all(&self.state_dir) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        // Sandboxes' disk images mounted under the temporary directory, or
        // it could not be removed (and the loop devices would stay).
        let mut mounts: Vec<PathBuf> = fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4).map(PathBuf::from))
            .filter(|p| p.starts_with(self.tmp.path()))
            .collect();
        mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for m in mounts {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// A test bus's rules: anyone may connect, call anything and own any name.
pub const OPEN_POLICY: &str = r#"<policy context="default">
    <allow user="*"/>
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>"#;

/// Write the configuration of a dbus-daemon of `kind` (`session` or
/// `system`) listening on `<dir>/<name>.sock`, with `body` (policies,
/// includes, service directories) as its rules: (the file, the socket).
pub fn bus_config(dir: &Path, name: &str, kind: &str, body: &str) -> (PathBuf, PathBuf) {
    let sock = dir.join(format!("{name}.sock"));
    let conf = dir.join(format!("{name}.conf"));
    fs::write(
        &conf,
        format!(
            r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>{kind}</type>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
  {body}
</busconfig>
"#,
            sock.display()
        ),
    )
    .unwrap();
    (conf, sock)
}

/// Start a dbus-daemon of `kind` (`session` or `system`) listening on
/// `<dir>/<name>.sock`, with `body` (policies, includes) as its rules.
pub fn spawn_bus(dir: &Path, name: &str, kind: &str, body: &str) -> (Child, PathBuf) {
    let (conf, sock) = bus_config(dir, name, kind, body);
    let child = Command::new("dbus-daemon")
        .arg(format!("--config-file={}", conf.display()))
        .arg("--nofork")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("dbus-daemon must be installed (apt-get install dbus)");
    // The socket file appears at bind(), before the daemon listens on it.
    wait_for("the bus socket", Duration::from_secs(10), || {
        std::os::unix::net::UnixStream::connect(&sock).is_ok()
    });
    (child, sock)
}

/// A git repository `parent/name` with one commit (a README).
pub fn repo_in(parent: &Path, name: &str) -> PathBuf {
    let dir = parent.join(name);
    // Made before (a test that adds to it first): as it is.
    if dir.join(".git").is_dir() {
        return dir;
    }
    fs::create_dir_all(&dir).unwrap();
    git(&dir, &["init", "-q", "-b", "main"]);
    fs::write(dir.join("README.md"), format!("# {name}\n")).unwrap();
    git(&dir, &["add", "."]);
    git(
        &dir,
        &[
            "-c",
            "user.name=Test",
            "-c",
            "user.email=test@example.com",
            "commit",
            "-qm",
            "first",
        ],
    );
    dir
}

pub fn git(dir: &Path, args: &[&str]) -> String {
    git_as(None, dir, args)
}

/// Run git in `dir` (as `uid` when given, root only); must succeed.
pub fn git_as(uid: Option<u32>, dir: &Path, args: &[&str]) -> String {
    let mut cmd = Command::new("git");
    cmd.arg("-C").arg(dir).args(args);
    if let Some(uid) = uid {
        cmd.env("HOME", "/nonexistent").uid(uid).gid(uid);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// inotify watches `pid` holds: the `inotify wd:` lines of the fdinfo of
/// each of its inotify descriptors.
pub fn inotify_watches(pid: i32) -> usize {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    fds.flatten()
        .filter(|e| fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == "anon_inode:inotify"))
        .map(|e| {
            fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                e.file_name().to_string_lossy()
            ))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("inotify wd:"))
            .count()
        })
        .sum()
}

/// The commit `r` names in `repo`, if it names one.
pub fn host_ref(repo: &Path, r: &str) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["rev-parse", "--verify", "-q", r])
        .output()
        .unwrap();
    out.status
        .success()
        .then(|| String::from_utf8(out.stdout).unwrap().trim().to_owned())
}

/// Commit what is staged in `dir` (or nothing) as `message`.
pub fn commit(dir: &Path, message: &str) {
    git(
        dir,
        &[
            "-c",
            "user.name=Test",
            "-c",
            "user.email=test@example.com",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            message,
        ],
    );
}

/// A tiny HTTP origin on the host: answers every request with `body`.
pub fn origin(bind: std::net::IpAddr, body: &'static str) -> u16 {
    let listener = std::net::TcpListener::bind((bind, 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match std::io::Read::read(&mut conn, &mut chunk) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let _ = std::io::Write::write_fmt(
                    &mut conn,
                    format_args!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    ),
                );
            });
        }
    });
    port
}

/// The value of field `key` (e.g. `CapEff`) in `/proc/<pid>/status`.
pub fn proc_status(pid: i32, key: &str) -> String {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default()
}

/// Assert that helper process `pid` holds no capability, may gain none,
/// and is not in the host's network namespace, once it has settled (it
/// confines itself first thing, and then blocks where the test holds it).
pub fn assert_helper_confined(pid: i32) {
    // An unprivileged agentd's helper holds no capability from its start
    // (CapPrm is empty before it confines itself): settled is when it has
    // set all it sets.
    const KEYS: [&str; 5] = ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"];
    let settled = || {
        KEYS.iter()
            .all(|k| proc_status(pid, k) == "0000000000000000")
            && proc_status(pid, "NoNewPrivs") == "1"
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !settled() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    for key in KEYS {
        assert_eq!(
            proc_status(pid, key),
            "0000000000000000",
            "{key} of helper {pid}"
        );
    }
    assert_eq!(proc_status(pid, "NoNewPrivs"), "1");
    let net = |p: &str| fs::read_link(format!("/proc/{p}/ns/net")).unwrap();
    assert_ne!(
        net(&pid.to_string()),
        net("self"),
        "the helper shares the host's network"
    );
}

/// Every file under `dir` (not `skip`, links not followed) smaller than
/// 4 MiB whose bytes contain `needle`: where a secret must never be.
pub fn files_with(dir: &Path, needle: &[u8], skip: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        match e.file_type() {
            _ if p == skip => {}
            Ok(t) if t.is_dir() => out.extend(files_with(&p, needle, skip)),
            Ok(t) if t.is_file() => {
                let small = fs::metadata(&p).is_ok_and(|m| m.len() < (4 << 20));
                if small && fs::read(&p).is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle))
                {
                    out.push(p);
                }
            }
            _ => {}
        }
    }
    out
}

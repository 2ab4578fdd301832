//! The SSH side of guests that run their own sshd (the `microvm` and `vm`
//! backends).
//!
//! agentd provisions, per sandbox, a host key for the guest and a client
//! key for itself. The guest reads `ssh/` (its host key and
//! `authorized_keys`) through a read-only share; `client/` (agentd's private
//! key and the pinned host key) never leaves the host. Every connection
//! checks the guest's host key against that pin (`StrictHostKeyChecking=yes`
//! with agentd's own known-hosts file) and logs in with the key only.

use std::collections::HashMap;
use std::fs;
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use keystone_agent_api::ExecResult;

use super::{BackendError, ExecRequest, Listener, TtyProcess};

mod master;
pub mod shell;

/// How long a guest may take to list its listeners (the `find` takes a
/// second or two in an emulated guest).
pub const LISTENERS_TIMEOUT: Duration = Duration::from_secs(20);

/// Why ssh did not reach a guest, or why its keys could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SshError {
    /// `ssh` itself hung past its limit.
    #[error("ssh did not finish within {secs}s")]
    Hung {
        /// The limit, in seconds.
        secs: u64,
    },
    /// `ssh` could not be run.
    #[error("cannot run ssh (install openssh-client): {0}")]
    Missing(#[source] std::io::Error),
    /// `ssh` ran and failed; what it printed on stderr.
    #[error("{0}")]
    Said(String),
    /// `ssh-keygen` ran and failed; what it printed on stderr.
    #[error("ssh-keygen failed: {0}")]
    Keygen(String),
    /// The guest's public host key file does not hold a key.
    #[error("the guest's host key is malformed")]
    MalformedHostKey,
}

impl SshError {
    /// Whether ssh refused the guest for a host key other than the pinned
    /// one (see [`host_key_refused`]).
    #[must_use]
    pub fn host_key_refused(&self) -> bool {
        matches!(self, Self::Said(stderr) if host_key_refused(stderr))
    }
}

/// How agentd reaches one guest's sshd.
#[derive(Debug, Clone)]
pub struct SshTarget {
    /// User to log in as.
    pub user: String,
    /// Address of the guest.
    pub host: String,
    /// Port of its sshd.
    pub port: u16,
    /// agentd's private key for this sandbox.
    pub key: PathBuf,
    /// Known-hosts file with the guest's pinned host key.
    pub known_hosts: PathBuf,
    /// Name the pin is recorded under (independent of address and port).
    pub alias: String,
    /// How to reach the guest instead of TCP (e.g. over a serial port).
    pub proxy_command: Option<String>,
    /// Socket of the shared master connection ([`SshTarget::open_master`])
    /// that commands go through instead of a handshake each. They never
    /// become a master themselves: without one they connect on their own.
    pub control_path: Option<PathBuf>,
}

impl SshTarget {
    /// `ssh` with every option set and no remote command yet.
    #[must_use]
    pub fn command(&self) -> tokio::process::Command {
        tokio::process::Command::from(self.std_command())
    }

    /// [`SshTarget::command`] for blocking use.
    #[must_use]
    pub fn std_command(&self) -> std::process::Command {
        self.base_command("no")
    }

    /// `ssh` with every option set, `ControlMaster` as `master`.
    fn base_command(&self, master: &str) -> std::process::Command {
        let mut c = std::process::Command::new("ssh");
        // The master connection ([`SshTarget::open_master`]) leaves this
        // process at once and lives as long as its guest, for the next
        // agentd too; this client ends with agentd.
        crate::child::end_with_us(&mut c)
            .arg("-F")
            .arg("/dev/null")
            .arg("-i")
            .arg(&self.key)
            .arg("-o")
            .arg(format!("UserKnownHostsFile={}", self.known_hosts.display()))
            .args([
                "-o",
                "GlobalKnownHostsFile=/dev/null",
                "-o",
                "StrictHostKeyChecking=yes",
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                "BatchMode=yes",
                "-o",
                "PasswordAuthentication=no",
                "-o",
                "LogLevel=ERROR",
                // The guest is not to be trusted with anything of the
                // host's: no escapes (`~C` would open forwards from a
                // terminal session's keystrokes), no agent or X11, no
                // local commands, no host keys it offers, no agent socket
                // of agentd's environment.
                "-o",
                "EscapeChar=none",
                "-o",
                "ForwardAgent=no",
                "-o",
                "ForwardX11=no",
                "-o",
                "PermitLocalCommand=no",
                "-o",
                "UpdateHostKeys=no",
                "-o",
                "IdentityAgent=none",
            ])
            // Through a ProxyCommand (a guest's control port) the wait is
            // for the guest's sshd to greet, which an emulated guest on a
            // busy host may take seconds to do; over TCP, for the network.
            .arg("-o")
            .arg(format!(
                "ConnectTimeout={}",
                if self.proxy_command.is_some() { 30 } else { 5 }
            ))
            // Through a ProxyCommand the connection never leaves the host
            // (a virtio-serial port, vsock): plain X25519, whose exchange
            // an emulated guest does in a fraction of the time of the
            // default post-quantum hybrid (sntrup761x25519), which guards
            // traffic recorded on a network.
            .args(
                self.proxy_command
                    .iter()
                    .flat_map(|_| ["-o", "KexAlgorithms=curve25519-sha256"]),
            )
            .arg("-o")
            .arg(format!("HostKeyAlias={}", self.alias))
            .args(
                self.proxy_command
                    .iter()
                    .flat_map(|p| ["-o".to_owned(), format!("ProxyCommand={p}")]),
            )
            .args(self.control_path.iter().flat_map(|p| {
                [
                    "-o".to_owned(),
                    format!("ControlMaster={master}"),
                    "-o".to_owned(),
                    format!("ControlPath={}", p.display()),
                ]
            }))
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-l")
            .arg(&self.user)
            .stdin(Stdio::null());
        c
    }

    /// `ssh … true`: `Ok` once the guest answers, else what ssh said.
    pub async fn answers(&self) -> Result<(), SshError> {
        const LIMIT: Duration = Duration::from_secs(20);
        match self.capture(&["true"], LIMIT).await {
            Ok(o) if o.exit_code == 0 => Ok(()),
            Ok(o) => Err(SshError::Said(
                crate::text::clamp_text(String::from_utf8_lossy(&o.stderr).trim()).into_owned(),
            )),
            Err(BackendError::CommandTimeout { .. }) => Err(SshError::Hung {
                secs: LIMIT.as_secs(),
            }),
            Err(BackendError::Spawn { error, .. }) => Err(SshError::Missing(error)),
            Err(other) => Err(SshError::Said(other.to_string())),
        }
    }

    /// Run `argv` in the guest (in `/`) and collect its answer through
    /// [`super::capture_with`]: at most [`super::EXEC_OUTPUT_CAP`] bytes of
    /// each stream, and ssh killed after `timeout`, however the guest
    /// answers.
    ///
    /// # Errors
    /// When ssh cannot be run, or ran past `timeout`.
    pub async fn capture(
        &self,
        argv: &[&str],
        timeout: Duration,
    ) -> Result<ExecResult, BackendError> {
        let req = ExecRequest {
            argv: argv.iter().map(|a| (*a).to_owned()).collect(),
            env: std::collections::BTreeMap::new(),
            cwd: "/".to_owned(),
            timeout: Some(timeout),
        };
        super::capture_with(|stdio| self.exec(req, stdio)).await
    }

    /// Run a command in the guest with `stdio` as its standard streams.
    pub async fn exec(
        &self,
        req: ExecRequest,
        [stdin, stdout, stderr]: [OwnedFd; 3],
    ) -> Result<i32, BackendError> {
        let mut child = self
            .command()
            .arg(&self.host)
            .arg(remote_command(&req.argv, &req.env, &req.cwd))
            .stdin(Stdio::from(stdin))
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true)
            .spawn()
            .map_err(spawn_ssh)?;
        let wait = child.wait();
        let status =
            match req.timeout {
                Some(t) => tokio::time::timeout(t, wait).await.map_err(|_| {
                    BackendError::CommandTimeout {
                        command: req.argv.join(" "),
                        secs: t.as_secs(),
                    }
                })?,
                None => wait.await,
            }
            .map_err(BackendError::Descriptor)?;
        Ok(exit_code(status))
    }

    /// Run a command in the guest on a pseudo-terminal of `size` (rows,
    /// columns): a host pty with `ssh -tt`, which gives the guest one too.
    pub fn exec_tty(
        &self,
        req: ExecRequest,
        (rows, cols): (u16, u16),
    ) -> Result<TtyProcess, BackendError> {
        let (master, slave) = crate::pty::open_pty((rows, cols)).map_err(BackendError::Sys)?;
        let mut cmd = self.command();
        cmd.arg("-tt")
            .arg(&self.host)
            .arg(remote_command(&req.argv, &req.env, &req.cwd))
            .stdin(Stdio::from(
                slave.try_clone().map_err(BackendError::Descriptor)?,
            ))
            .stdout(Stdio::from(
                slave.try_clone().map_err(BackendError::Descriptor)?,
            ))
            .stderr(Stdio::from(slave))
            .kill_on_drop(true);
        // SAFETY: take_terminal only makes async-signal-safe calls.
        unsafe {
            cmd.pre_exec(crate::pty::take_terminal);
        }
        let mut child = cmd.spawn().map_err(spawn_ssh)?;
        drop(cmd);
        Ok(TtyProcess {
            terminal: master,
            exit: Box::pin(async move {
                child
                    .wait()
                    .await
                    .map(exit_code)
                    .map_err(BackendError::Descriptor)
            }),
        })
    }

    /// A TCP connection to `addr:port` inside the guest (`ssh -W`).
    pub fn connect(&self, addr: std::net::IpAddr, port: u16) -> Result<OwnedFd, BackendError> {
        let (ours, theirs) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::Stream,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        )
        .map_err(BackendError::Sys)?;
        let stdin = theirs.try_clone().map_err(BackendError::Descriptor)?;
        let mut child = self
            .command()
            .arg("-W")
            .arg(forward_spec(addr, port))
            .arg(&self.host)
            .stdin(Stdio::from(stdin))
            .stdout(Stdio::from(theirs))
            .spawn()
            .map_err(spawn_ssh)?;
        // Reap it when the connection ends.
        tokio::spawn(async move {
            let _ = child.wait().await;
        });
        Ok(ours)
    }

    /// The guest's TCP listeners with their processes' working directories
    /// (blocking: one ssh round trip of at most [`LISTENERS_TIMEOUT`], on a
    /// blocking thread of agentd's runtime).
    #[must_use]
    pub fn listeners(&self) -> Vec<Listener> {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return Vec::new();
        };
        let script = ["sh", "-c", LISTENERS_SCRIPT];
        match handle.block_on(self.capture(&script, LISTENERS_TIMEOUT)) {
            Ok(out) => parse_guest_listeners(&String::from_utf8_lossy(&out.stdout)),
            Err(e) => {
                tracing::debug!(guest = %self.alias, error = %e, "the guest did not list its listeners");
                Vec::new()
            }
        }
    }
}

/// `ssh -W`'s `host:port`, with IPv6 addresses in brackets.
fn forward_spec(addr: std::net::IpAddr, port: u16) -> String {
    std::net::SocketAddr::new(addr, port).to_string()
}

/// Whether ssh's complaint means the guest showed a host key other than
/// the pinned one.
#[must_use]
pub fn host_key_refused(stderr: &str) -> bool {
    stderr.contains("Host key verification failed")
        || stderr.contains("REMOTE HOST IDENTIFICATION HAS CHANGED")
}

fn spawn_ssh(error: std::io::Error) -> BackendError {
    BackendError::Spawn {
        program: "ssh".to_owned(),
        hint: "",
        error,
    }
}

/// The remote command line that runs `argv` in `cwd` with `env` added.
#[must_use]
pub fn remote_command(
    argv: &[String],
    env: &std::collections::BTreeMap<String, String>,
    cwd: &str,
) -> String {
    let mut s = format!("cd {} && exec env", quote(cwd));
    for (k, v) in env {
        s.push(' ');
        s.push_str(&quote(&format!("{k}={v}")));
    }
    for a in argv {
        s.push(' ');
        s.push_str(&quote(a));
    }
    s
}

/// `s` as one POSIX shell word.
#[must_use]
pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Write the paths a `microvm` guest makes read-only when it boots:
/// `ssh/protect` under the sandbox's `dir` (shared read-only with the
/// guest; its `keystone-protect` unit reads it), the literal paths of
/// `patterns`, one per line (a pattern has no control character).
///
/// # Errors
/// When the file cannot be written.
pub fn write_protect_list(dir: &Path, patterns: &[String]) -> Result<(), BackendError> {
    let mut text = String::new();
    for p in crate::git::guard::literal_paths(patterns) {
        text.push_str(&p.to_string_lossy());
        text.push('\n');
    }
    let at = dir.join("ssh").join("protect");
    Ok(crate::fsutil::atomic_write_mode(
        &at,
        text.as_bytes(),
        0o644,
    )?)
}

/// Make the keys of a sandbox under `dir` unless they exist: `ssh/`
/// (`ssh_host_ed25519_key`, `.pub`, `authorized_keys`; for the guest) and
/// `client/` (`id_ed25519`, `known_hosts` pinning the host key as `alias`).
///
/// # Errors
/// When a directory or key file cannot be made, read or written, or
/// `ssh-keygen` fails.
pub fn provision(dir: &Path, alias: &str) -> Result<(), BackendError> {
    let guest = dir.join("ssh");
    let client = dir.join("client");
    for (d, mode) in [(&guest, 0o755), (&client, 0o700)] {
        if own_dir(d, mode)? {
            tracing::warn!(
                path = %d.display(),
                "a key directory agentd did not make was emptied; the guest's keys are made anew"
            );
        }
    }
    let host_key = guest.join("ssh_host_ed25519_key");
    let client_key = client.join("id_ed25519");
    let pin = client.join("known_hosts");
    if pin.exists() && host_key.exists() && client_key.exists() {
        // Provisioned before: the pin is never taken again from the key
        // files, so a host key that changed since is refused.
        return Ok(());
    }
    for (key, comment) in [
        (&host_key, format!("{alias} host")),
        (&client_key, "agentd".into()),
    ] {
        if key.exists() {
            let _ = fs::remove_file(key);
            let _ = fs::remove_file(key.with_extension("pub"));
        }
        let out = crate::child::end_with_us(&mut std::process::Command::new("ssh-keygen"))
            .args(["-q", "-t", "ed25519", "-N", "", "-C", &comment, "-f"])
            .arg(key)
            .stdin(Stdio::null())
            .output()
            .map_err(|error| BackendError::Spawn {
                program: "ssh-keygen".to_owned(),
                hint: " (install openssh-client)",
                error,
            })?;
        if !out.status.success() {
            return Err(
                SshError::Keygen(String::from_utf8_lossy(&out.stderr).trim().to_owned()).into(),
            );
        }
    }
    let read = |p: PathBuf| fs::read_to_string(&p).map_err(BackendError::file("cannot read", &p));
    let host_pub = read(guest.join("ssh_host_ed25519_key.pub"))?;
    let client_pub = read(client.join("id_ed25519.pub"))?;
    let write = |p: PathBuf, text: String, mode: u32| {
        crate::fsutil::atomic_write(&p, text.as_bytes())?;
        fs::set_permissions(&p, fs::Permissions::from_mode(mode))
            .map_err(BackendError::file("cannot set the mode of", &p))
    };
    write(guest.join("authorized_keys"), client_pub, 0o644)?;
    let mut parts = host_pub.split_whitespace();
    let (Some(kind), Some(key)) = (parts.next(), parts.next()) else {
        return Err(SshError::MalformedHostKey.into());
    };
    write(
        client.join("known_hosts"),
        format!("{alias} {kind} {key}\n"),
        0o600,
    )?;
    // sshd refuses a host key others can read.
    fs::set_permissions(&host_key, fs::Permissions::from_mode(0o600))
        .map_err(BackendError::file("cannot set the mode of", &host_key))
}

/// Make directory `path` agentd's own, with `mode`, whoever made it; true
/// when it was someone else's. Such a directory (microvm.nix's tmpfiles rule
/// makes every share source `microvm:kvm` 0775 at activation) may hold
/// files others planted there, such as an `authorized_keys` of their own:
/// it is emptied first. Never follows a symlink.
fn own_dir(path: &Path, mode: u32) -> Result<bool, BackendError> {
    use nix::fcntl::{OFlag, open};
    use nix::sys::stat::{Mode, fchmod, fstat};
    let io = |what: &'static str| {
        move |e: nix::Error| BackendError::file(what, path)(std::io::Error::from(e))
    };
    match nix::unistd::mkdir(path, Mode::from_bits_truncate(mode)) {
        Ok(()) | Err(nix::Error::EEXIST) => {}
        Err(e) => return Err(io("cannot create")(e)),
    }
    let dir = open(
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io("cannot open"))?;
    let st = fstat(&dir).map_err(io("cannot read"))?;
    let (uid, gid) = (nix::unistd::geteuid(), nix::unistd::getegid());
    let foreign = st.st_uid != uid.as_raw() || st.st_gid != gid.as_raw() || st.st_mode & 0o022 != 0;
    if foreign {
        // Nobody else may add files while it is being emptied.
        fchmod(&dir, Mode::S_IRWXU).map_err(io("cannot set the mode of"))?;
        nix::unistd::fchown(&dir, Some(uid), Some(gid)).map_err(io("cannot take over"))?;
        crate::fsutil::empty_dir(&dir).map_err(io("cannot empty"))?;
    }
    fchmod(&dir, Mode::from_bits_truncate(mode)).map_err(io("cannot set the mode of"))?;
    Ok(foreign)
}

/// What a guest (or a Pod) runs to tell its TCP listeners: its socket
/// tables, then every process's working directory and socket descriptors,
/// from one `find` (a shell loop forks per descriptor, which takes seconds
/// in an emulated guest). [`parse_guest_listeners`] reads the output.
pub const LISTENERS_SCRIPT: &str = "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null; echo --; \
    find /proc/[0-9]*/cwd /proc/[0-9]*/fd -maxdepth 1 \\( -name cwd -o -lname 'socket:*' \\) \
    -printf '%p %l\\n' 2>/dev/null";

/// Parse what the listener script prints: `/proc/net/tcp{,6}` lines, `--`,
/// then `/proc/PID/cwd CWD` and `/proc/PID/fd/N socket:[INODE]` lines.
pub fn parse_guest_listeners(text: &str) -> Vec<Listener> {
    let (table, links) = text.split_once("\n--\n").unwrap_or((text, ""));
    let listening: HashMap<u64, (std::net::IpAddr, u16)> = table
        .lines()
        .filter_map(crate::procfs::parse_tcp_line)
        .collect();
    let mut cwds: HashMap<i32, &str> = HashMap::new();
    let mut sockets: Vec<(i32, u64)> = Vec::new();
    for line in links.lines() {
        let Some((path, target)) = line.split_once(' ') else {
            continue;
        };
        let mut parts = path.trim_start_matches("/proc/").splitn(2, '/');
        let (Some(Ok(pid)), Some(what)) = (parts.next().map(str::parse::<i32>), parts.next())
        else {
            continue;
        };
        if what == "cwd" {
            cwds.insert(pid, target);
        } else if let Some(inode) = target
            .strip_prefix("socket:[")
            .and_then(|s| s.strip_suffix(']'))
            .and_then(|s| s.parse::<u64>().ok())
        {
            sockets.push((pid, inode));
        }
    }
    let mut out: Vec<Listener> = sockets
        .into_iter()
        .filter_map(|(pid, inode)| {
            let &(addr, port) = listening.get(&inode)?;
            Some(Listener {
                addr,
                port,
                pid,
                cwd: (*cwds.get(&pid)?).to_owned(),
            })
        })
        .collect();
    out.sort_by_key(|l| (l.port, l.pid));
    out.dedup_by_key(|l| l.port);
    out
}

/// The exit code of a finished process as a shell reports it (128 + signal
/// for a killed one).
pub fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_gets_no_escape_no_agent_and_no_forward_it_did_not_ask_for() {
        let dir = tempfile::tempdir().unwrap();
        let target = SshTarget {
            user: "agent".into(),
            host: "keystone-demo".into(),
            port: 22,
            key: dir.path().join("id_ed25519"),
            known_hosts: dir.path().join("known_hosts"),
            alias: "keystone-demo".into(),
            proxy_command: Some("agentd keystone-serial /x 1".into()),
            control_path: Some(dir.path().join("agent.mux")),
        };
        // What ssh makes of agentd's options (`-G` connects to nothing).
        let out = target
            .std_command()
            .arg("-G")
            .arg(&target.host)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let config = String::from_utf8_lossy(&out.stdout).to_lowercase();
        for line in [
            "escapechar none",
            "forwardagent no",
            "forwardx11 no",
            "permitlocalcommand no",
            "updatehostkeys false",
            "identityagent none",
            "stricthostkeychecking true",
            "controlmaster false",
            "connecttimeout 30",
        ] {
            assert!(config.lines().any(|l| l == line), "{line}:\n{config}");
        }
    }

    #[test]
    fn a_key_directory_made_by_others_is_emptied_and_taken_over() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("ssh");
        // As microvm.nix's tmpfiles rule leaves it: writable by a group,
        // and (as root) another user's; with a key planted in it.
        fs::create_dir(&d).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(0o775)).unwrap();
        fs::write(d.join("authorized_keys"), "ssh-ed25519 AAAA intruder\n").unwrap();
        fs::create_dir(d.join("sub")).unwrap();
        fs::write(d.join("sub/file"), "x").unwrap();
        let root = nix::unistd::geteuid().is_root();
        if root {
            std::os::unix::fs::chown(&d, Some(65534), Some(65534)).unwrap();
        }
        assert!(own_dir(&d, 0o755).unwrap());
        assert_eq!(fs::read_dir(&d).unwrap().count(), 0);
        let m = fs::metadata(&d).unwrap();
        assert_eq!(m.permissions().mode() & 0o7777, 0o755);
        use std::os::unix::fs::MetadataExt;
        assert_eq!(m.uid(), nix::unistd::geteuid().as_raw());
        assert_eq!(m.gid(), nix::unistd::getegid().as_raw());

        // Its own directory keeps what is in it.
        fs::write(d.join("authorized_keys"), "ssh-ed25519 AAAA agentd\n").unwrap();
        assert!(!own_dir(&d, 0o755).unwrap());
        assert!(d.join("authorized_keys").exists());

        // A symlink in its place is refused, not followed.
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&d, &link).unwrap();
        let err = own_dir(&link, 0o755).unwrap_err().to_string();
        assert!(err.contains("cannot open") && err.contains("link"), "{err}");
        assert!(d.join("authorized_keys").exists());
    }

    #[test]
    fn forwarding_specs_bracket_ipv6() {
        assert_eq!(
            forward_spec(std::net::Ipv6Addr::LOCALHOST.into(), 8000),
            "[::1]:8000"
        );
        assert_eq!(
            forward_spec(std::net::Ipv4Addr::LOCALHOST.into(), 80),
            "127.0.0.1:80"
        );
    }

    #[test]
    fn remote_commands_quote_every_word() {
        let env = std::collections::BTreeMap::from([("A".to_owned(), "it's".to_owned())]);
        let cmd = remote_command(
            &["echo".into(), "a b".into(), "$(x)".into()],
            &env,
            "/workspace",
        );
        assert_eq!(
            cmd,
            "cd '/workspace' && exec env 'A=it'\\''s' 'echo' 'a b' '$(x)'"
        );
        let out = std::process::Command::new("sh")
            .args(["-c", &cmd.replace("/workspace", "/")])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "a b $(x)\n");
    }

    #[test]
    fn provisioning_pins_the_host_key_and_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        provision(dir.path(), "keystone-x").unwrap();
        let pin = fs::read_to_string(dir.path().join("client/known_hosts")).unwrap();
        let host = fs::read_to_string(dir.path().join("ssh/ssh_host_ed25519_key.pub")).unwrap();
        assert!(pin.starts_with("keystone-x ssh-ed25519 "), "{pin}");
        assert!(host.contains(pin.split_whitespace().nth(2).unwrap()));
        let auth = fs::read_to_string(dir.path().join("ssh/authorized_keys")).unwrap();
        let client = fs::read_to_string(dir.path().join("client/id_ed25519.pub")).unwrap();
        assert_eq!(auth, client);
        // A second start keeps the same keys and the pin, even when the
        // host key file changed meanwhile.
        fs::write(
            dir.path().join("ssh/ssh_host_ed25519_key.pub"),
            "ssh-ed25519 AAAAother x",
        )
        .unwrap();
        provision(dir.path(), "keystone-x").unwrap();
        assert_eq!(
            fs::read_to_string(dir.path().join("client/known_hosts")).unwrap(),
            pin
        );
    }

    #[test]
    fn guest_listeners_are_joined_to_their_processes() {
        let text = "  sl  local_address rem_address   st\n\
   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 111 1 0 100 0 0 10 0\n\
   1: 0100007F:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 222 1 0 100 0 0 10 0\n\
   2: 0100007F:9C40 0100007F:1F40 01 00000000:00000000 00:00000000 00000000  1000        0 333 1 0 100 0 0 10 0\n\
--\n\
/proc/812/cwd /workspace/.worktrees/feature x\n\
/proc/812/fd/3 socket:[111]\n\
/proc/812/fd/4 socket:[333]\n\
/proc/900/cwd /home/agent\n\
/proc/900/fd/5 socket:[444]\n\
/proc/901/fd/5 socket:[222]\n";
        let got = parse_guest_listeners(text);
        assert_eq!(
            got,
            vec![Listener {
                addr: std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                port: 8000,
                pid: 812,
                cwd: "/workspace/.worktrees/feature x".into(),
            }]
        );
    }
}

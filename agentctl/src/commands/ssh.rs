//! `agentctl ssh`, `ssh-config` and `ssh-proxy`: SSH into a sandbox with
//! the system's own OpenSSH client, its connection carried over D-Bus.
//!
//! agentd is the SSH server (docs/ssh.md); `ssh-proxy` asks it for a
//! connection (`org.keystone.Agent1.Ssh.Connect`, checked like every call)
//! and copies it to and from stdin/stdout, which is what an `ssh`
//! `ProxyCommand` wants. Nothing listens on a port. The sandbox's host key
//! comes from agentd over the same bus and is pinned in agentctl's own
//! known_hosts file (`$XDG_STATE_HOME/keystone-agent/ssh/known_hosts`).

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;

use keystone_agent_api::SshProxy;

use super::*;

/// The `Host` alias of sandbox `name`.
fn alias(name: &str) -> String {
    format!("keystone-{name}")
}

/// A branch as part of a `Host` alias: lowercase letters, digits and `-`.
fn branch_label(branch: &str) -> String {
    let mut out = String::new();
    for c in branch.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_alphanumeric() {
            out.push(c);
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_matches('-').to_owned()
}

/// `arg` for a command line ssh hands to a shell (`ProxyCommand`):
/// single-quoted, and `%` doubled (ssh's own token character). (Never
/// given a control character: [`plain_text`] is checked first, or a line
/// break would start a line of ssh's configuration of its own.)
fn quoted(arg: &str) -> String {
    format!("'{}'", arg.replace('\'', r"'\''").replace('%', "%%"))
}

/// Whether `text` may go into ssh's configuration: no control
/// characters (a sandbox chooses its branches' names).
fn plain_text(text: &str) -> bool {
    !text.chars().any(char::is_control)
}

/// A path as an ssh configuration value: as it is when plain, else in
/// double quotes (which every OpenSSH reads; single ones only 8.7 on).
fn config_path(path: &std::path::Path) -> String {
    let p = path.display().to_string();
    if p.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"/._-+@".contains(&b))
    {
        p
    } else {
        format!("\"{}\"", p.replace('"', ""))
    }
}

/// agentctl's known_hosts file.
fn known_hosts() -> Result<PathBuf> {
    let base = std::env::var_os("XDG_STATE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))
        .ok_or_else(|| {
            Failure::new(
                ExitCode::Requirements,
                "neither XDG_STATE_HOME nor HOME is set: agentctl keeps the sandboxes' host keys there",
            )
        })?;
    Ok(base.join("keystone-agent/ssh/known_hosts"))
}

/// Pin `keys` (alias → `known_hosts` key text) in agentctl's known_hosts
/// file, keeping the lines of other aliases; the file's path.
fn pin(keys: &BTreeMap<String, String>) -> Result<PathBuf> {
    let path = known_hosts()?;
    let failed = |e: std::io::Error| {
        Failure::new(
            ExitCode::Failed,
            format!("cannot write {}: {e}", path.display()),
        )
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(failed)?;
    }
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    let mut text: String = old
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_none_or(|a| !keys.contains_key(a))
        })
        .map(|l| format!("{l}\n"))
        .collect();
    for (a, key) in keys {
        text.push_str(&format!("{a} {key}\n"));
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(failed)?;
    Ok(path)
}

/// The options every connection gets: through agentd, the pinned host
/// key, nothing of the client's forwarded.
fn options(
    bus: Option<&str>,
    name: &str,
    branch: Option<&str>,
    hosts: &std::path::Path,
) -> Vec<(String, String)> {
    let exe = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "agentctl".to_owned());
    let mut proxy = quoted(&exe);
    if let Some(bus) = bus {
        proxy.push_str(&format!(" --bus {}", quoted(bus)));
    }
    proxy.push_str(&format!(" ssh-proxy {}", quoted(name)));
    if let Some(b) = branch {
        proxy.push_str(&format!(" --branch {}", quoted(b)));
    }
    [
        ("ProxyCommand", proxy),
        ("HostKeyAlias", alias(name)),
        ("UserKnownHostsFile", config_path(hosts)),
        ("StrictHostKeyChecking", "yes".to_owned()),
        ("ForwardAgent", "no".to_owned()),
        ("ForwardX11", "no".to_owned()),
        ("IdentityAgent", "none".to_owned()),
        ("PasswordAuthentication", "no".to_owned()),
        ("KbdInteractiveAuthentication", "no".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

async fn ssh_object<'a>(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    name: &str,
) -> Result<SshProxy<'a>> {
    let path = manager.get_sandbox(name).await?;
    super::uncached(conn, path).await
}

/// Run `agentctl ssh`, `ssh-config` or `ssh-proxy` on `bus`.
pub async fn run(bus: Option<&str>, command: Command) -> Result<i32> {
    let conn = crate::bus::connect(bus).await?;
    let manager = ManagerProxy::new(&conn).await.map_err(api::Error::ZBus)?;
    match command {
        Command::SshProxy { name, branch } => {
            let ssh = ssh_object(&conn, &manager, &name).await?;
            let fd: OwnedFd = ssh.connect(branch.as_deref().unwrap_or("")).await?.into();
            carry(fd).await
        }
        Command::Ssh {
            name,
            branch,
            command,
        } => {
            if !branch.as_deref().is_none_or(plain_text) {
                return Err(Failure::new(
                    ExitCode::Requirements,
                    "a branch name has no control characters",
                ));
            }
            let ssh = ssh_object(&conn, &manager, &name).await?;
            let key = ssh.host_key().await?;
            let hosts = pin(&BTreeMap::from([(alias(&name), key)]))?;
            let mut cmd = std::process::Command::new("ssh");
            for (k, v) in options(bus, &name, branch.as_deref(), &hosts) {
                cmd.arg("-o").arg(format!("{k}={v}"));
            }
            cmd.arg(alias(&name));
            if !command.is_empty() {
                cmd.arg("--").args(&command);
            }
            use std::os::unix::process::CommandExt;
            let e = cmd.exec();
            Err(Failure::new(
                ExitCode::Requirements,
                format!(
                    "cannot run ssh: {e} (install OpenSSH's client: apt-get install openssh-client)"
                ),
            ))
        }
        Command::SshConfig { names } => {
            let names = if names.is_empty() {
                manager
                    .list_sandboxes()
                    .await?
                    .into_iter()
                    .map(|s| s.name)
                    .collect()
            } else {
                names
            };
            let mut keys = BTreeMap::new();
            let mut blocks = Vec::new();
            for name in &names {
                let ssh = ssh_object(&conn, &manager, name).await?;
                keys.insert(alias(name), ssh.host_key().await?);
                let sb = lookup(&conn, &manager, name).await?;
                // A stopped sandbox has no worktrees to list: its main one.
                let worktrees = sb.list_worktrees().await.unwrap_or_default();
                blocks.push((alias(name), name.clone(), None));
                // A worktree's alias is `keystone-NAME.BRANCH`: no sandbox
                // name has a dot, so no branch can take another sandbox's
                // alias.
                let mut taken = std::collections::BTreeSet::new();
                for b in worktrees.into_iter().skip(1).map(|w| w.branch) {
                    if b.is_empty() || branch_label(&b).is_empty() {
                        continue;
                    }
                    if !plain_text(&b) {
                        crate::errln!(
                            "agentctl: sandbox '{name}' has a branch with control characters in its name ({}): left out",
                            crate::output::escape_controls(&b)
                        );
                        continue;
                    }
                    let mut host = format!("{}.{}", alias(name), branch_label(&b));
                    let mut n = 2;
                    while !taken.insert(host.clone()) {
                        host = format!("{}.{}-{n}", alias(name), branch_label(&b));
                        n += 1;
                    }
                    blocks.push((host, name.clone(), Some(b)));
                }
            }
            let hosts = pin(&keys)?;
            let mut out = String::from(
                "# Keystone Agent sandboxes (`agentctl ssh-config`): save this file and\n\
                 # `Include` it at the top of ~/.ssh/config. Connections go through agentd\n\
                 # over D-Bus; no port is opened.\n",
            );
            for (host, name, branch) in blocks {
                out.push_str(&format!("\nHost {host}\n    HostName {name}\n"));
                for (k, v) in options(bus, &name, branch.as_deref(), &hosts) {
                    out.push_str(&format!("    {k} {v}\n"));
                }
            }
            print!("{out}");
            Ok(0)
        }
        _ => unreachable!("only the ssh commands come here"),
    }
}

/// Copy stdin to the connection and the connection to stdout until agentd
/// ends it.
async fn carry(fd: OwnedFd) -> Result<i32> {
    let sock = std::os::unix::net::UnixStream::from(fd);
    let failed = |e: std::io::Error| {
        Failure::new(ExitCode::Failed, format!("the SSH connection failed: {e}"))
    };
    let mut to = sock.try_clone().map_err(failed)?;
    // Unbuffered both ways (Rust's stdout waits for a newline): the
    // descriptors themselves.
    let raw = |fd: std::os::fd::BorrowedFd<'_>| fd.try_clone_to_owned().map(std::fs::File::from);
    let mut stdin = raw(std::io::stdin().as_fd()).map_err(failed)?;
    let mut stdout = raw(std::io::stdout().as_fd()).map_err(failed)?;
    std::thread::spawn(move || {
        let _ = pump(&mut stdin, &mut to);
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
    let copied = tokio::task::spawn_blocking(move || {
        let mut sock = sock;
        pump(&mut sock, &mut stdout)
    })
    .await
    .map_err(|e| Failure::new(ExitCode::Failed, format!("the SSH connection failed: {e}")))?;
    match copied {
        // (ssh closed its end: the connection is over.)
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(failed(e)),
        _ => Ok(0),
    }
}

/// Copy `from` to `to` one read at a time (no splice: each piece goes on
/// as it arrives) until `from` ends.
fn pump(from: &mut impl std::io::Read, to: &mut impl std::io::Write) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        to.write_all(&buf[..n])?;
    }
}

//! The SSH side of guests that run their own sshd (the `microvm` backend).
//!
//! agentd provisions, per sandbox, a host key for the guest and a client
//! key for itself. The guest reads `ssh/` (its host key and
//! `authorized_keys`) through a read-only share; `client/` (agentd's private
//! key and the pinned host key) never leaves the host. Every connection
//! checks the guest's host key against that pin (`StrictHostKeyChecking=yes`
//! with agentd's own known-hosts file) and logs in with the key only.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

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
    /// How to reach the guest instead of TCP (e.g. over vsock).
    pub proxy_command: Option<String>,
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
        let mut c = std::process::Command::new("ssh");
        c.arg("-F")
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
                "ConnectTimeout=5",
                "-o",
                "LogLevel=ERROR",
            ])
            .arg("-o")
            .arg(format!("HostKeyAlias={}", self.alias))
            .args(
                self.proxy_command
                    .iter()
                    .flat_map(|p| ["-o".to_owned(), format!("ProxyCommand={p}")]),
            )
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-l")
            .arg(&self.user)
            .stdin(Stdio::null());
        c
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

/// Make the keys of a sandbox under `dir` unless they exist: `ssh/`
/// (`ssh_host_ed25519_key`, `.pub`, `authorized_keys`; for the guest) and
/// `client/` (`id_ed25519`, `known_hosts` pinning the host key as `alias`).
pub fn provision(dir: &Path, alias: &str) -> Result<(), String> {
    let guest = dir.join("ssh");
    let client = dir.join("client");
    for (d, mode) in [(&guest, 0o755), (&client, 0o700)] {
        fs::create_dir_all(d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
        fs::set_permissions(d, fs::Permissions::from_mode(mode))
            .map_err(|e| format!("cannot set the mode of {}: {e}", d.display()))?;
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
        let out = std::process::Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", &comment, "-f"])
            .arg(key)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run ssh-keygen (install openssh-client): {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "ssh-keygen failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    let read = |p: PathBuf| {
        fs::read_to_string(&p).map_err(|e| format!("cannot read {}: {e}", p.display()))
    };
    let host_pub = read(guest.join("ssh_host_ed25519_key.pub"))?;
    let client_pub = read(client.join("id_ed25519.pub"))?;
    let write = |p: PathBuf, text: String, mode: u32| {
        crate::registry::atomic_write(&p, text.as_bytes()).map_err(|e| e.to_string())?;
        fs::set_permissions(&p, fs::Permissions::from_mode(mode))
            .map_err(|e| format!("cannot set the mode of {}: {e}", p.display()))
    };
    write(guest.join("authorized_keys"), client_pub, 0o644)?;
    let mut parts = host_pub.split_whitespace();
    let (Some(kind), Some(key)) = (parts.next(), parts.next()) else {
        return Err("the guest's host key is malformed".to_owned());
    };
    write(
        client.join("known_hosts"),
        format!("{alias} {kind} {key}\n"),
        0o600,
    )?;
    // sshd refuses a host key others can read.
    fs::set_permissions(&host_key, fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("cannot set the mode of {}: {e}", host_key.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

//! Secrets that a sandbox's agent can use but not read (docs/agents.md).
//!
//! A secret is a value (an API key) bound to one sandbox, one environment
//! variable, one host and one header. Inside the sandbox the variable holds
//! a random placeholder; the egress gateway terminates TLS for the hosts
//! that carry a secret (a certificate from the sandbox's own CA, which the
//! sandbox trusts) and puts the value in place of the placeholder in the
//! named header only, on the way out ([`crate::egress::intercept`]).
//!
//! Kept by agentd in `<state>/secrets/`, a directory only agentd may enter:
//! `<sandbox>.json` (the secrets, mode 0600), `<sandbox>.ca.key` (the CA's
//! key, 0600) and `<sandbox>.ca.pem` (its certificate, public). Never in the
//! registry, the workspace, a log or the history.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Largest secret value (bytes).
pub const VALUE_MAX: usize = 16 * 1024;
/// Most secrets per sandbox.
pub const PER_SANDBOX_MAX: usize = 32;

/// One secret.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Secret {
    /// The environment variable that holds the placeholder inside.
    pub var: String,
    /// The host whose requests get the value (a DNS name, lowercase).
    pub host: String,
    /// The header that carries it (lowercase).
    pub header: String,
    /// `Authorization: Bearer <value>` rather than the bare value.
    pub bearer: bool,
    /// The placeholder: what the sandbox sees.
    pub placeholder: String,
    /// The value.
    pub value: String,
    /// Read from a file that agentd's configuration names
    /// ([`crate::config::DeclaredSecret`]), not set over the bus.
    #[serde(default)]
    pub declared: bool,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secret")
            .field("var", &self.var)
            .field("host", &self.host)
            .field("header", &self.header)
            .field("bearer", &self.bearer)
            .field("declared", &self.declared)
            .finish_non_exhaustive()
    }
}

/// Why a secret is refused.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// Bad input: every problem.
    #[error("{}", .0.join("; "))]
    Invalid(Vec<String>),
    /// A file operation failed.
    #[error("cannot {what} {}: {source}", path.display())]
    File {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// The file of a secret that agentd's configuration declares could not
    /// be read.
    #[error(
        "cannot read {}, the file of secret {var} in agentd's configuration: {source}; \
         check that it exists and that agentd's user can read it (agenix, sops-nix: is the secret deployed?)",
        path.display()
    )]
    DeclaredFile {
        /// The variable.
        var: String,
        /// The file.
        path: PathBuf,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// The CA could not be made or read.
    #[error("the sandbox's certificate authority: {0}")]
    Ca(String),
}

fn file_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SecretError {
    let path = path.to_owned();
    move |source| SecretError::File { what, path, source }
}

/// `value` without one trailing line end (`\n` or `\r\n`), as a value
/// read from a file or a terminal ends.
#[must_use]
pub fn one_line(value: &[u8]) -> &[u8] {
    let value = value.strip_suffix(b"\n").unwrap_or(value);
    value.strip_suffix(b"\r").unwrap_or(value)
}

/// Whether `host` is a DNS name with a dot (`api.anthropic.com`): labels
/// of letters, digits and `-`, none empty, none starting or ending with `-`.
#[must_use]
pub fn is_dns_name(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host.contains('.')
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
}

/// Check a new secret's fields; every problem, named.
#[must_use]
pub fn problems(var: &str, host: &str, header: &str, value: &[u8]) -> Vec<String> {
    let mut p = Vec::new();
    let var_ok = !var.is_empty()
        && var.len() <= 64
        && !var.starts_with(|c: char| c.is_ascii_digit())
        && var
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
    if !var_ok {
        p.push(format!(
            "'{}' is not a variable name (A-Z, 0-9 and _, not starting with a digit, at most 64)",
            crate::text::clamp_text(var)
        ));
    }
    if !is_dns_name(host) {
        p.push(format!(
            "host '{}' is not a DNS name (such as api.anthropic.com)",
            crate::text::clamp_text(host)
        ));
    }
    let header_ok = !header.is_empty()
        && header.len() <= 64
        && header
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !header_ok {
        p.push(format!(
            "header '{}' is not a header name",
            crate::text::clamp_text(header)
        ));
    }
    if value.is_empty() || value.len() > VALUE_MAX {
        p.push(format!(
            "the value must be 1 to {VALUE_MAX} bytes (it was {})",
            value.len()
        ));
    } else if std::str::from_utf8(value).is_err() || value.iter().any(|&b| b < 0x20 || b == 0x7f) {
        p.push(
            "the value must be printable text on one line (a trailing newline is dropped)".into(),
        );
    }
    p
}

/// The contents of `path`, a secret's file that agentd's configuration
/// names (agenix and sops-nix place links to it, so links are followed: the
/// administrator chose the path, no sandbox can write there). Only a
/// regular file, of at most [`VALUE_MAX`] bytes and a line end.
pub fn read_value_file(var: &str, path: &Path) -> Result<Vec<u8>, SecretError> {
    use std::io::Read;
    let err = |source| SecretError::DeclaredFile {
        var: var.to_owned(),
        path: path.to_owned(),
        source,
    };
    // (Non-blocking: a FIFO put there would otherwise hold the start.)
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(err)?;
    if !f.metadata().map_err(err)?.is_file() {
        return Err(err(std::io::Error::other("not a regular file")));
    }
    let mut value = Vec::new();
    f.take(VALUE_MAX as u64 + 3)
        .read_to_end(&mut value)
        .map_err(err)?;
    if value.len() > VALUE_MAX + 2 {
        return Err(err(std::io::Error::other(format!(
            "larger than {VALUE_MAX} bytes"
        ))));
    }
    Ok(value)
}

/// A fresh placeholder: what the variable holds inside the sandbox.
#[must_use]
pub fn placeholder() -> String {
    format!("keystone-placeholder-{}", uuid::Uuid::new_v4().simple())
}

/// The secrets of the sandboxes of one agentd.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
}

impl Store {
    /// The store in `<state>/secrets`.
    #[must_use]
    pub fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.join("secrets"),
        }
    }

    pub(crate) fn ensure_dir(&self) -> Result<(), SecretError> {
        match fs::create_dir(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(file_err("create", &self.dir)(e)),
        }
        fs::set_permissions(&self.dir, fs::Permissions::from_mode(0o700))
            .map_err(file_err("set the mode of", &self.dir))
    }

    fn path(&self, sandbox: &str, ext: &str) -> PathBuf {
        self.dir.join(format!("{sandbox}.{ext}"))
    }

    /// The secrets of `sandbox` (none when it has no file).
    pub fn load(&self, sandbox: &str) -> Result<Vec<Secret>, SecretError> {
        let path = self.path(sandbox, "json");
        match fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| file_err("read", &path)(std::io::Error::other(e))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(file_err("read", &path)(e)),
        }
    }

    fn save(&self, sandbox: &str, list: &[Secret]) -> Result<(), SecretError> {
        self.ensure_dir()?;
        let path = self.path(sandbox, "json");
        write_private(&path, &serde_json::to_vec(list).unwrap_or_default())
    }

    /// Add or replace the secret of `secret.var`; returns it as stored
    /// (a placeholder kept from the one it replaces, so running agents
    /// keep working).
    pub fn set(&self, sandbox: &str, mut secret: Secret) -> Result<Secret, SecretError> {
        let mut list = self.load(sandbox)?;
        if let Some(old) = list.iter().find(|s| s.var == secret.var) {
            secret.placeholder.clone_from(&old.placeholder);
        } else if list.len() >= PER_SANDBOX_MAX {
            return Err(SecretError::Invalid(vec![format!(
                "a sandbox holds at most {PER_SANDBOX_MAX} secrets"
            )]));
        }
        list.retain(|s| s.var != secret.var);
        list.push(secret.clone());
        list.sort_by(|a, b| a.var.cmp(&b.var));
        self.save(sandbox, &list)?;
        Ok(secret)
    }

    /// Remove the secret of `var`; whether there was one.
    pub fn remove(&self, sandbox: &str, var: &str) -> Result<bool, SecretError> {
        let mut list = self.load(sandbox)?;
        let before = list.len();
        list.retain(|s| s.var != var);
        if list.len() == before {
            return Ok(false);
        }
        self.save(sandbox, &list)?;
        Ok(true)
    }

    /// Forget everything of `sandbox` (it is destroyed).
    pub fn remove_all(&self, sandbox: &str) {
        for ext in ["json", "ca.key", "ca.pem"] {
            let _ = fs::remove_file(self.path(sandbox, ext));
        }
    }

    /// The CA of `sandbox`, made on first use.
    pub fn ca(&self, sandbox: &str) -> Result<Ca, SecretError> {
        self.ensure_dir()?;
        let key_path = self.path(sandbox, "ca.key");
        let cert_path = self.path(sandbox, "ca.pem");
        if let (Ok(key), Ok(cert)) = (
            fs::read_to_string(&key_path),
            fs::read_to_string(&cert_path),
        ) {
            return Ca::from_pem(sandbox, &key, &cert);
        }
        let ca = Ca::new(sandbox)?;
        write_private(&key_path, ca.key_pem.as_bytes())?;
        write_private(&cert_path, ca.cert_pem.as_bytes())?;
        fs::set_permissions(&cert_path, fs::Permissions::from_mode(0o644))
            .map_err(file_err("set the mode of", &cert_path))?;
        Ok(ca)
    }
}

/// Write `data` to `path` through a temporary file of mode 0600.
pub(crate) fn write_private(path: &Path, data: &[u8]) -> Result<(), SecretError> {
    let tmp = path.with_extension("tmp");
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(file_err("create", &tmp))?;
    f.write_all(data)
        .and_then(|()| f.sync_all())
        .map_err(file_err("write", &tmp))?;
    fs::rename(&tmp, path).map_err(file_err("rename", path))
}

/// A sandbox's certificate authority: signs a certificate for each host
/// that carries one of its secrets.
pub struct Ca {
    key_pem: String,
    /// The CA's certificate (PEM), which the sandbox trusts.
    pub cert_pem: String,
    key: rcgen::KeyPair,
    /// The same subject and key as `cert_pem`: what leaves are signed with.
    issuer: rcgen::Certificate,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

impl Ca {
    fn params(sandbox: &str) -> rcgen::CertificateParams {
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name.push(
            rcgen::DnType::CommonName,
            format!("Keystone Agent sandbox {sandbox}"),
        );
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        p
    }

    fn new(sandbox: &str) -> Result<Self, SecretError> {
        let key = rcgen::KeyPair::generate().map_err(|e| SecretError::Ca(e.to_string()))?;
        let cert = Self::params(sandbox)
            .self_signed(&key)
            .map_err(|e| SecretError::Ca(e.to_string()))?;
        Self::from_pem(sandbox, &key.serialize_pem(), &cert.pem())
    }

    fn from_pem(sandbox: &str, key_pem: &str, cert_pem: &str) -> Result<Self, SecretError> {
        let key = rcgen::KeyPair::from_pem(key_pem).map_err(|e| SecretError::Ca(e.to_string()))?;
        let issuer = Self::params(sandbox)
            .self_signed(&key)
            .map_err(|e| SecretError::Ca(e.to_string()))?;
        Ok(Self {
            key_pem: key_pem.to_owned(),
            cert_pem: cert_pem.to_owned(),
            key,
            issuer,
        })
    }

    /// A certificate for `host` (and its key) signed by this CA.
    pub fn leaf(
        &self,
        host: &str,
    ) -> Result<
        (
            Vec<rustls::pki_types::CertificateDer<'static>>,
            rustls::pki_types::PrivateKeyDer<'static>,
        ),
        SecretError,
    > {
        let key = rcgen::KeyPair::generate().map_err(|e| SecretError::Ca(e.to_string()))?;
        let mut p = rcgen::CertificateParams::new(vec![host.to_owned()])
            .map_err(|e| SecretError::Ca(e.to_string()))?;
        p.distinguished_name.push(rcgen::DnType::CommonName, host);
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let cert = p
            .signed_by(&key, &self.issuer, &self.key)
            .map_err(|e| SecretError::Ca(e.to_string()))?;
        let der = rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
        Ok((vec![cert.der().clone()], der))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_checked_kept_private_and_replaced_in_place() {
        assert!(
            problems(
                "ANTHROPIC_API_KEY",
                "api.anthropic.com",
                "x-api-key",
                b"sk-1"
            )
            .is_empty()
        );
        let p = problems("1bad var", "localhost", "x api", b"a\nb");
        assert_eq!(p.len(), 4, "{p:#?}");
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path());
        let s = Secret {
            var: "ANTHROPIC_API_KEY".into(),
            host: "api.anthropic.com".into(),
            header: "x-api-key".into(),
            bearer: false,
            placeholder: placeholder(),
            value: "sk-real".into(),
            declared: false,
        };
        let first = store.set("demo", s.clone()).unwrap();
        // A new value keeps the placeholder the sandbox already has.
        let second = store
            .set(
                "demo",
                Secret {
                    value: "sk-new".into(),
                    placeholder: placeholder(),
                    ..s
                },
            )
            .unwrap();
        assert_eq!(first.placeholder, second.placeholder);
        let list = store.load("demo").unwrap();
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].value, "sk-new");
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir.path().join("secrets")), 0o700);
        assert_eq!(mode(&dir.path().join("secrets/demo.json")), 0o600);
        assert!(
            !format!("{:?}", list[0]).contains("sk-new"),
            "Debug hides the value"
        );
        let ca = store.ca("demo").unwrap();
        assert_eq!(mode(&dir.path().join("secrets/demo.ca.key")), 0o600);
        let again = store.ca("demo").unwrap();
        assert_eq!(ca.cert_pem, again.cert_pem, "the CA is kept");
        assert!(ca.leaf("api.anthropic.com").is_ok());
        assert!(store.remove("demo", "ANTHROPIC_API_KEY").unwrap());
        assert!(!store.remove("demo", "ANTHROPIC_API_KEY").unwrap());
        store.remove_all("demo");
        assert!(!dir.path().join("secrets/demo.ca.key").exists());
    }

    #[test]
    fn a_secret_file_is_read_through_links_but_never_a_fifo_or_a_large_file() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::write(d.join("key"), "sk-file\n").unwrap();
        // agenix and sops-nix give a link to the file.
        std::os::unix::fs::symlink(d.join("key"), d.join("link")).unwrap();
        assert_eq!(
            read_value_file("KEY", &d.join("link")).unwrap(),
            b"sk-file\n"
        );
        // A FIFO would hold the start until someone writes: refused at once.
        nix::unistd::mkfifo(
            &d.join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let err = read_value_file("KEY", &d.join("fifo"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a regular file"), "{err}");
        fs::write(d.join("big"), vec![b'a'; VALUE_MAX + 3]).unwrap();
        let err = read_value_file("KEY", &d.join("big"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("larger than"), "{err}");
        let err = read_value_file("KEY", &d.join("missing"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(&format!(
                "cannot read {}, the file of secret KEY in agentd's configuration: ",
                d.join("missing").display()
            )),
            "{err}"
        );
    }
}

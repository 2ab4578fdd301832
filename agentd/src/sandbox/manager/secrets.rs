//! Secrets a sandbox's agent can use but not read ([`crate::secrets`]):
//! setting, listing and removing them, the placeholders and CA trust in
//! every command's environment, and the gateway's plan for a CONNECT to a
//! host that carries one.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use keystone_agent_api::{BackendKind, SandboxState};

use super::{Manager, Sandbox};
use crate::auth::Caller;
use crate::error::{Error, Result};
use crate::secrets::{Secret, SecretError, Store};

/// A secret as `agentctl secret list` shows it (never its value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretInfo {
    /// The variable.
    pub var: String,
    /// The host.
    pub host: String,
    /// The header.
    pub header: String,
    /// `Authorization: Bearer`.
    pub bearer: bool,
}

/// Where the system's CA bundle usually is (Debian, Fedora, Arch, NixOS).
const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

/// A guest's CA certificate and bundle, where they are its own: a
/// `microvm` guest's `ssh/` share (the guest module mounts it at
/// [`MICROVM_SHARE`]), a `kubernetes` Pod's `ca/` (copied in from the
/// sandbox's `ca/` directory, [`crate::backend::CA_DIR`]).
const GUEST_CA: &str = "keystone-ca.pem";
const GUEST_BUNDLE: &str = "keystone-ca-bundle.pem";
/// Where a `microvm` guest sees its `ssh/` share (nixos-modules/guest).
const MICROVM_SHARE: &str = "/var/lib/keystone-agent/ssh";

/// Whether `dir` is a directory (not a link) of agentd's that no one else
/// may write in: only then are a guest's CA files written there.
fn agentds_own_dir(dir: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(dir).is_ok_and(|m| {
        m.is_dir() && m.uid() == nix::unistd::geteuid().as_raw() && m.mode() & 0o022 == 0
    })
}

/// Where sandbox `sb` reads its CA certificate and the bundle of the
/// system's roots with it: the files are named by the sandbox's random id
/// where every sandbox sees the directory (so a listing tells no one which
/// sandboxes have secrets), and by their role in a guest's own share.
fn ca_paths(sb: &Sandbox) -> (String, String) {
    let id = &sb.id;
    match sb.backend {
        BackendKind::Local => (
            format!("/run/keystone/ca/{id}.ca.pem"),
            format!("/run/keystone/ca/{id}.pem"),
        ),
        // agentd's tools directory is shared with the guest there.
        BackendKind::Vm => (
            format!("/run/keystone/host/ca/{id}.ca.pem"),
            format!("/run/keystone/host/ca/{id}.pem"),
        ),
        BackendKind::Microvm => (
            format!("{MICROVM_SHARE}/{GUEST_CA}"),
            format!("{MICROVM_SHARE}/{GUEST_BUNDLE}"),
        ),
        // Where agentd copies its tools into the Pod.
        BackendKind::Kubernetes => {
            let dir = format!(
                "{}/{}",
                crate::backend::kubernetes::TOOLS,
                crate::backend::CA_DIR
            );
            (format!("{dir}/{GUEST_CA}"), format!("{dir}/{GUEST_BUNDLE}"))
        }
    }
}

/// Held while the secret store and the CA files change (or a CA is made):
/// each change reads, changes and writes whole files, and two at once
/// would lose one or mix two CAs.
static CHANGING: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub(super) fn changing() -> std::sync::MutexGuard<'static, ()> {
    CHANGING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(super) fn secret_error(name: &str, e: SecretError) -> Error {
    match e {
        SecretError::Invalid(p) => Error::Invalid(
            p.into_iter()
                .map(|m| format!("sandbox '{name}': {m}"))
                .collect(),
        ),
        source => Error::Secrets {
            name: name.to_owned(),
            source,
        },
    }
}

impl Manager {
    pub(super) fn secret_store(&self) -> Store {
        Store::new(self.store.registry().dir())
    }

    /// `<state>/guest/ca/`: each sandbox's CA certificate, and a bundle of
    /// the system's roots with it (seen inside at `/run/keystone/ca/`).
    fn ca_dir(&self) -> PathBuf {
        self.store.registry().dir().join("guest/ca")
    }

    /// Give sandbox `name` a secret: its `var` holds a placeholder inside
    /// from the next command on, and the gateway puts `value` in `header`
    /// (as `Bearer <value>` with `bearer`) of its requests to `host`.
    #[allow(clippy::too_many_arguments)]
    pub fn set_secret(
        &self,
        caller: Caller,
        name: &str,
        var: &str,
        host: &str,
        header: &str,
        bearer: bool,
        value: &[u8],
    ) -> Result<()> {
        let sb = self.get(caller, name)?;
        self.refuse_declared(name, var)?;
        let value = crate::secrets::one_line(value);
        let host = host.to_ascii_lowercase();
        let header = header.to_ascii_lowercase();
        let problems = crate::secrets::problems(var, &host, &header, value);
        if !problems.is_empty() {
            return Err(secret_error(name, SecretError::Invalid(problems)));
        }
        let store = self.secret_store();
        let _changing = changing();
        let secret = Secret {
            var: var.to_owned(),
            host: host.clone(),
            header,
            bearer,
            placeholder: crate::secrets::placeholder(),
            value: String::from_utf8_lossy(value).into_owned(),
            declared: false,
        };
        store.set(name, secret).map_err(|e| secret_error(name, e))?;
        let ca = store.ca(name).map_err(|e| secret_error(name, e))?;
        self.write_ca_files(&sb, &ca.cert_pem)?;
        tracing::info!(sandbox = %name, var, %host, "secret set");
        Ok(())
    }

    /// Write sandbox `sb`'s CA certificate, and a bundle of the system's
    /// roots with it, where the sandbox reads them ([`ca_paths`]): in
    /// `<state>/guest/ca/` (local and vm sandboxes), and for a `microvm`
    /// guest in its `ssh/` share too (once the share exists; every start
    /// writes them again).
    pub(super) fn write_ca_files(&self, sb: &Sandbox, cert_pem: &str) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let (name, id) = (sb.name.as_str(), sb.id.as_str());
        let _mounted = self.mounted_now(sb)?;
        let dir = self.ca_dir();
        let io = |what: &'static str, path: &std::path::Path| {
            let path = path.to_owned();
            move |source: std::io::Error| {
                secret_error(name, SecretError::File { what, path, source })
            }
        };
        std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
        // Every sandbox sees this directory (a `vm` guest through 9p, which
        // must read it to walk into it): its files are named by each
        // sandbox's random id, so a listing tells no one which sandboxes,
        // of whom, have secrets.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
            .map_err(io("set the mode of", &dir))?;
        let system = SYSTEM_BUNDLES
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default();
        let bundle = format!("{system}\n{cert_pem}");
        let mut files = vec![
            (dir.join(format!("{id}.ca.pem")), cert_pem),
            (dir.join(format!("{id}.pem")), bundle.as_str()),
        ];
        // (The share is read-only to the guest and agentd's own: its files
        // are replaced by rename, never written through a link.)
        let share = self.store.registry().sandbox_dir(name).join("ssh");
        if sb.backend == BackendKind::Microvm && agentds_own_dir(&share) {
            files.push((share.join(GUEST_CA), cert_pem));
            files.push((share.join(GUEST_BUNDLE), bundle.as_str()));
        }
        // A Pod sees no directory of the host's: its backend copies this
        // one in at each start, and again below while it runs.
        // (Copied in again only when they change: the copy in the Pod is
        // rewritten in place, under the feet of a client reading it.)
        let mut copy_in = false;
        if sb.backend == BackendKind::Kubernetes {
            let own = self
                .store
                .registry()
                .sandbox_dir(name)
                .join(crate::backend::CA_DIR);
            std::fs::create_dir_all(&own).map_err(io("create", &own))?;
            copy_in = std::fs::read_to_string(own.join(GUEST_BUNDLE))
                .ok()
                .as_deref()
                != Some(bundle.as_str());
            files.push((own.join(GUEST_CA), cert_pem));
            files.push((own.join(GUEST_BUNDLE), bundle.as_str()));
        }
        // A `vm` guest whose workspace is a disk has its own copy too.
        if sb.backend == BackendKind::Vm
            && self
                .backend(sb.backend)
                .is_ok_and(|b| b.workspace_inside(&self.spec(sb)))
        {
            copy_in = std::fs::read_to_string(dir.join(format!("{id}.pem")))
                .ok()
                .as_deref()
                != Some(bundle.as_str());
        }
        for (path, text) in files {
            crate::fsutil::atomic_write_mode(&path, text.as_bytes(), 0o644)
                .map_err(|e| io("write", &path)(std::io::Error::other(e)))?;
        }
        if copy_in && sb.state == SandboxState::Running {
            self.copy_ca_in(sb);
        }
        Ok(())
    }

    /// Copy running sandbox `sb`'s CA files into it (they are new), in the
    /// background: until they are there, TLS to its secrets' hosts fails
    /// as for a host it has no secret for.
    fn copy_ca_in(&self, sb: &Sandbox) {
        let (Ok(backend), Ok(rt)) = (
            self.backend(sb.backend).cloned(),
            tokio::runtime::Handle::try_current(),
        ) else {
            return;
        };
        let spec = self.spec(sb);
        rt.spawn(async move {
            if let Err(e) = backend.ca_changed(&spec).await {
                tracing::warn!(sandbox = %spec.name, error = %e, "cannot copy the CA files into the sandbox");
            }
        });
    }

    /// The secrets of sandbox `name`, without their values.
    pub fn list_secrets(&self, caller: Caller, name: &str) -> Result<Vec<SecretInfo>> {
        self.get(caller, name)?;
        Ok(self
            .secret_store()
            .load(name)
            .map_err(|e| secret_error(name, e))?
            .into_iter()
            .map(|s| SecretInfo {
                var: s.var,
                host: s.host,
                header: s.header,
                bearer: s.bearer,
            })
            .collect())
    }

    /// Remove the secret of `var` from sandbox `name`; whether it had one.
    pub fn remove_secret(&self, caller: Caller, name: &str, var: &str) -> Result<bool> {
        self.get(caller, name)?;
        self.refuse_declared(name, var)?;
        let _changing = changing();
        let gone = self
            .secret_store()
            .remove(name, var)
            .map_err(|e| secret_error(name, e))?;
        if gone {
            tracing::info!(sandbox = %name, var, "secret removed");
        }
        Ok(gone)
    }

    /// A secret that agentd's configuration declares is changed there only.
    fn refuse_declared(&self, name: &str, var: &str) -> Result<()> {
        let declared = self.settings.declared_secrets.get(name);
        if declared.is_some_and(|d| d.contains_key(var)) {
            return Err(Error::Invalid(vec![format!(
                "sandbox '{name}': {var} is declared in agentd's configuration \
                 (NixOS: keystone.agent.sandboxes.{name}.secrets.{var}); change it there"
            )]));
        }
        Ok(())
    }

    /// Read the secrets (and repositories, [`Manager::read_declared_forges`])
    /// that agentd's configuration declares for `sb` from
    /// their files into the store (a changed file takes effect at this
    /// start; the placeholder stays), and drop declared ones that are no
    /// longer declared. A file that cannot be read, or holds no usable
    /// value, fails the start with the variable and the file named.
    pub(super) fn read_declared_secrets(&self, sb: &Sandbox) -> Result<()> {
        let name = sb.name.as_str();
        let declared = self
            .settings
            .declared_secrets
            .get(name)
            .filter(|_| sb.declared);
        let store = self.secret_store();
        let _changing = changing();
        let err = |e| secret_error(name, e);
        for s in store.load(name).map_err(err)? {
            if s.declared && declared.is_none_or(|d| !d.contains_key(&s.var)) {
                store.remove(name, &s.var).map_err(err)?;
                tracing::info!(sandbox = %name, var = %s.var, "declared secret removed");
            }
        }
        drop(_changing);
        self.read_declared_forges(sb)?;
        let _changing = changing();
        let Some(declared) = declared.filter(|d| !d.is_empty()) else {
            return Ok(());
        };
        for (var, d) in declared {
            let raw = crate::secrets::read_value_file(var, &d.file).map_err(err)?;
            let value = crate::secrets::one_line(&raw);
            let host = d.host.to_ascii_lowercase();
            let header = d.header();
            let problems = crate::secrets::problems(var, &host, &header, value);
            if !problems.is_empty() {
                return Err(Error::Invalid(
                    problems
                        .into_iter()
                        .map(|m| {
                            format!(
                                "sandbox '{name}': secret {var} from {}: {m}",
                                d.file.display()
                            )
                        })
                        .collect(),
                ));
            }
            let secret = Secret {
                var: var.clone(),
                host,
                header,
                bearer: d.bearer,
                placeholder: crate::secrets::placeholder(),
                value: String::from_utf8_lossy(value).into_owned(),
                declared: true,
            };
            store.set(name, secret).map_err(err)?;
        }
        let ca = store.ca(name).map_err(err)?;
        self.write_ca_files(sb, &ca.cert_pem)?;
        tracing::info!(sandbox = %name, secrets = declared.len(), "declared secrets read");
        Ok(())
    }

    /// After a start: the CA files of a sandbox with secrets (or forges),
    /// where its guest reads them (a `microvm` guest's share is made by
    /// its start).
    pub(super) fn place_ca_files(&self, sb: &Sandbox) {
        let store = self.secret_store();
        let _changing = changing();
        if store.load(&sb.name).map_or(true, |l| l.is_empty())
            && self.forges_of(&sb.name).is_empty()
        {
            return;
        }
        if let Err(e) = store
            .ca(&sb.name)
            .map_err(|e| secret_error(&sb.name, e))
            .and_then(|ca| self.write_ca_files(sb, &ca.cert_pem))
        {
            tracing::warn!(sandbox = %sb.name, error = %e, "cannot place the CA files");
        }
    }

    /// Forget the secrets and CA of a destroyed sandbox.
    pub(super) fn forget_secrets(&self, sb: &Sandbox) {
        let _changing = changing();
        self.secret_store().remove_all(&sb.name);
        crate::forges::remove_all(self.store.registry().dir(), &sb.name);
        for f in [format!("{}.ca.pem", sb.id), format!("{}.pem", sb.id)] {
            let _ = std::fs::remove_file(self.ca_dir().join(f));
        }
    }

    /// Add what a command in `sb` gets from agentd to `env` (what the
    /// caller set explicitly stays): the variables of its shared agent home
    /// (`agent_home = "shared"`), each secret's placeholder, and the
    /// sandbox's CA for Node, OpenSSL and Python clients.
    pub(super) fn add_sandbox_env(&self, sb: &Sandbox, env: &mut BTreeMap<String, String>) {
        if sb.config.agent_home == keystone_agent_api::AgentHome::Shared {
            let base = match sb.backend {
                BackendKind::Vm => crate::toolbox::SHARED_HOME_VM,
                _ => crate::toolbox::SHARED_HOME,
            };
            for (k, v) in crate::toolbox::shared_home_env(base) {
                env.entry(k.to_owned()).or_insert(v);
            }
        }
        let list = self.secret_store().load(&sb.name).unwrap_or_default();
        let forges = self.forges_of(&sb.name);
        if list.is_empty() && forges.is_empty() {
            return;
        }
        let mut add = |k: &str, v: String| {
            env.entry(k.to_owned()).or_insert(v);
        };
        for s in list {
            add(&s.var, s.placeholder);
        }
        // git's own configuration through its environment: all of it, or
        // none (the caller's count would not name ours).
        if !forges.is_empty() && !env.contains_key("GIT_CONFIG_COUNT") {
            for (k, v) in crate::forges::git_env(&forges) {
                env.insert(k, v);
            }
        }
        let mut add = |k: &str, v: String| {
            env.entry(k.to_owned()).or_insert(v);
        };
        let (ca, bundle) = ca_paths(sb);
        add("NODE_EXTRA_CA_CERTS", ca);
        for var in [
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
            "CURL_CA_BUNDLE",
            "GIT_SSL_CAINFO",
        ] {
            add(var, bundle.clone());
        }
    }

    /// The gateway's plan for sandbox `name`'s CONNECT to `host`: its
    /// secrets for that host, a certificate for it from the sandbox's CA.
    pub(super) fn intercept_plan(
        self: &Arc<Self>,
        name: &str,
        host: &str,
        port: u16,
    ) -> Option<crate::egress::intercept::Plan> {
        let store = self.secret_store();
        let swaps: Vec<_> = store
            .load(name)
            .ok()?
            .into_iter()
            .filter(|s| s.host.eq_ignore_ascii_case(host))
            .map(|s| crate::egress::intercept::Swap {
                header: s.header,
                placeholder: s.placeholder,
                // (With `bearer`, "Bearer <placeholder>" becomes
                // "Bearer <value>": the placeholder is what is replaced.)
                value: s.value,
            })
            .collect();
        let forges = self.forge_rules(name, host, port);
        if swaps.is_empty() && forges.is_empty() {
            return None;
        }
        let ca = {
            let _changing = changing();
            store.ca(name)
        };
        let leaf = match ca.and_then(|ca| ca.leaf(&host.to_ascii_lowercase())) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(sandbox = %name, %host, error = %e, "no certificate for a secret's host");
                return None;
            }
        };
        let roots = Arc::clone(
            self.secret_roots
                .get_or_init(crate::egress::intercept::system_roots),
        );
        let pushed = (!forges.is_empty()).then(|| self.push_logger(name, host, port));
        Some(crate::egress::intercept::Plan {
            host: host.to_ascii_lowercase(),
            swaps,
            forges,
            pushed,
            leaf,
            roots,
        })
    }
}

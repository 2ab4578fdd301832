//! The agent toolbox: Claude Code, Codex and Gemini CLI (with the Node it
//! runs on) from the npm registry at pinned versions.
//!
//! Each package is downloaded once into a cache keyed by name and version
//! (`<cache>/agents/<agent>-<version>/`), checked against the registry's
//! sha512 integrity before it is unpacked, and moved into place whole, so a
//! directory in the cache is always complete. Every local sandbox sees the
//! cache read-only at `/run/keystone/agents`, and a launcher per agent in
//! `/run/keystone/bin` (first on `PATH`) runs the pinned version; an agent
//! that is not installed yet gets a launcher that says so, until it is.
//!
//! Only each agent's native package is needed (Claude Code and Codex ship
//! native binaries); Gemini CLI is a single bundled script run by the Node
//! binary that npm publishes as `node-linux-<arch>`. Nothing of the
//! packages runs on the host: no install scripts, no `npm`.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};

use crate::fsutil::atomic_write;

mod fetch;
#[cfg(test)]
mod tests;
mod unpack;

use fetch::{curl, read_metadata, sha512_base64};
pub use unpack::UnpackError;
use unpack::{check_members, normalize, remove_tree, unpacked_size};

pub use keystone_agent_api::Agent;

/// Where a sandbox with `agent_home = "shared"` sees its owner's shared
/// agent home: a `local` sandbox at [`SHARED_HOME`], a `vm` guest at
/// [`SHARED_HOME_VM`]. Each agent's directory below it is named by the
/// variable that moves the agent's own (see [`shared_home_env`]).
pub const SHARED_HOME: &str = "/run/agent-home";
/// See [`SHARED_HOME`] (the guest's /run is systemd's).
pub const SHARED_HOME_VM: &str = "/opt/keystone/agent-home";

/// The variables that point each agent at its directory in the shared
/// agent home at `base` (Claude Code keeps `.claude.json` in its config
/// directory then; Gemini CLI takes the variable as its home and keeps
/// `.gemini/` below it).
#[must_use]
pub fn shared_home_env(base: &str) -> [(&'static str, String); 3] {
    [
        ("CLAUDE_CONFIG_DIR", format!("{base}/claude")),
        ("CODEX_HOME", format!("{base}/codex")),
        ("GEMINI_CLI_HOME", format!("{base}/gemini")),
    ]
}

/// The pinned versions (npm versions of each agent's package, and of Node).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Versions {
    /// `@anthropic-ai/claude-code`.
    pub claude: String,
    /// `@openai/codex`.
    pub codex: String,
    /// `@google/gemini-cli`.
    pub gemini: String,
    /// `node-linux-<arch>`, which runs Gemini CLI (it needs Node >= 20).
    pub node: String,
}

impl Default for Versions {
    fn default() -> Self {
        Self {
            claude: "2.1.331".into(),
            codex: "0.169.0".into(),
            gemini: "0.61.0".into(),
            node: "22.23.3".into(),
        }
    }
}

/// The `toolbox` section of agentd's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolboxConfig {
    /// The agents every sandbox gets.
    pub agents: Vec<Agent>,
    /// Their versions.
    pub versions: Versions,
    /// The npm registry: `https://…`, or `http://` on a loopback address.
    pub registry: String,
    /// Download what the cache lacks (in the background at startup);
    /// `false`: only what is already there is used (`agentd
    /// --install-agents` fills the cache).
    pub download: bool,
    /// Where the packages are kept; default: the cache directory
    /// (`$KEYSTONE_CACHE_DIR`, else `$XDG_CACHE_HOME/keystone-agent`, else
    /// `~/.cache/keystone-agent`), `agents/` in it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
}

impl Default for ToolboxConfig {
    fn default() -> Self {
        Self {
            agents: Agent::ALL.to_vec(),
            versions: Versions::default(),
            registry: "https://registry.npmjs.org".into(),
            download: true,
            cache_dir: None,
        }
    }
}

impl ToolboxConfig {
    /// What is wrong with these settings, one line each.
    #[must_use]
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let v = &self.versions;
        for (key, value) in [
            ("claude", &v.claude),
            ("codex", &v.codex),
            ("gemini", &v.gemini),
            ("node", &v.node),
        ] {
            if !valid_version(value) {
                out.push(format!(
                    "toolbox.versions.{key}: '{value}' is not an npm version (1 to 64 of A-Z a-z 0-9 . + -, starting with a digit)"
                ));
            }
        }
        if !registry_allowed(&self.registry) {
            out.push(format!(
                "toolbox.registry: '{}' must be an https:// URL (or http:// on 127.0.0.1 or [::1]), without a trailing /",
                self.registry
            ));
        }
        if let Some(d) = &self.cache_dir
            && (!d.is_absolute() || d.parent().is_none())
        {
            out.push(format!(
                "toolbox.cache_dir: '{}' must be an absolute path below /",
                d.display()
            ));
        }
        out
    }
}

fn valid_version(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 64
        && v.starts_with(|c: char| c.is_ascii_digit())
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '+' | '-'))
}

fn registry_allowed(r: &str) -> bool {
    let rest = if let Some(rest) = r.strip_prefix("https://") {
        rest
    } else if let Some(rest) = r.strip_prefix("http://") {
        // The loopback address itself, not a name that starts like it
        // (`http://127.0.0.1.example.com`).
        let after = rest
            .strip_prefix("127.0.0.1")
            .or_else(|| rest.strip_prefix("[::1]"));
        let port_then_path = |a: &str| match a.strip_prefix(':') {
            Some(p) => {
                let port = p.split('/').next().unwrap_or("");
                !port.is_empty() && port.chars().all(|c| c.is_ascii_digit())
            }
            None => a.is_empty() || a.starts_with('/'),
        };
        if !after.is_some_and(port_then_path) {
            return false;
        }
        rest
    } else {
        return false;
    };
    !rest.is_empty()
        && !r.ends_with('/')
        && rest
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || ".-:[]/_".contains(c))
}

/// One npm package of the toolbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Package {
    /// npm name.
    pub name: String,
    /// npm version.
    pub version: String,
    /// Directory in the cache (and under `/run/keystone/agents`).
    pub dir: String,
    /// The tarball's sha512 (base64) as the project pins it; `None`: as
    /// the registry vouches for it.
    pub pinned: Option<&'static str>,
}

/// The web console's terminal, which agentd serves to the browser:
/// xterm.js and its fit add-on at the versions and digests the project
/// pins (the registry's word is not taken for code a browser runs).
pub const CONSOLE_PACKAGES: [(&str, &str, &str, &str); 2] = [
    (
        "@xterm/xterm",
        "6.0.0",
        "xterm-6.0.0",
        "TQwDdQGtwwDt+2cgKDLn0IRaSxYu1tSUjgKarSDkUM0ZNiSRXFpjxEsvc/Zgc5kq5omJ+V0a8/kIM2WD3sMOYg==",
    ),
    (
        "@xterm/addon-fit",
        "0.11.0",
        "xterm-addon-fit-0.11.0",
        "jYcgT6xtVYhnhgxh3QgYDnnNMYTcf8ElbxxFzX0IZo+vabQqSPAjC3c1wJrKB5E19VwQei89QCiZZP86DCPF7g==",
    ),
];

/// The console's files in the cache, by the name the console serves them
/// under: (package directory, path in it).
const CONSOLE_FILES: [(&str, &str, &str); 3] = [
    ("xterm.js", "xterm-6.0.0", "lib/xterm.js"),
    ("xterm.css", "xterm-6.0.0", "css/xterm.css"),
    ("addon-fit.js", "xterm-addon-fit-0.11.0", "lib/addon-fit.js"),
];

/// The packages of [`CONSOLE_PACKAGES`].
#[must_use]
pub fn console_packages() -> Vec<Package> {
    CONSOLE_PACKAGES
        .iter()
        .map(|&(name, version, dir, pin)| Package {
            name: name.to_owned(),
            version: version.to_owned(),
            dir: dir.to_owned(),
            pinned: Some(pin),
        })
        .collect()
}

/// The npm platform suffix of this machine (`linux-x64`, `linux-arm64`).
fn platform() -> &'static str {
    match std::env::consts::ARCH {
        "aarch64" => "linux-arm64",
        _ => "linux-x64",
    }
}

/// Codex's target triple inside its platform package.
fn codex_triple() -> &'static str {
    match std::env::consts::ARCH {
        "aarch64" => "aarch64-unknown-linux-musl",
        _ => "x86_64-unknown-linux-musl",
    }
}

/// The packages `agent` needs at `versions`.
#[must_use]
pub fn packages(agent: Agent, versions: &Versions) -> Vec<Package> {
    let p = platform();
    match agent {
        Agent::Claude => vec![Package {
            name: format!("@anthropic-ai/claude-code-{p}"),
            version: versions.claude.clone(),
            dir: format!("claude-{}", versions.claude),
            pinned: None,
        }],
        // The platform builds are versions of @openai/codex itself.
        Agent::Codex => vec![Package {
            name: "@openai/codex".into(),
            version: format!("{}-{p}", versions.codex),
            dir: format!("codex-{}", versions.codex),
            pinned: None,
        }],
        Agent::Gemini => vec![
            Package {
                name: "@google/gemini-cli".into(),
                version: versions.gemini.clone(),
                dir: format!("gemini-{}", versions.gemini),
                pinned: None,
            },
            Package {
                name: format!("node-{p}"),
                version: versions.node.clone(),
                dir: format!("node-{}", versions.node),
                pinned: None,
            },
        ],
    }
}

/// Where the toolbox is seen inside a sandbox.
pub const INSIDE: &str = "/run/keystone/agents";

/// The launcher of `agent`: runs the pinned version from [`INSIDE`].
#[must_use]
pub fn launcher(agent: Agent, versions: &Versions) -> String {
    let head = "#!/bin/sh\n# Written by agentd: the toolbox's pinned version.\n";
    let pkg = packages(agent, versions).remove(0);
    let at = format!("{INSIDE}/{}", pkg.dir);
    // What must be there: checked at each run, so that a package installed
    // while the sandbox runs is used at once.
    let (needs, run) = match agent {
        Agent::Claude => (format!("{at}/claude"), format!("exec {at}/claude \"$@\"")),
        Agent::Codex => {
            let t = codex_triple();
            (
                format!("{at}/vendor/{t}/bin/codex"),
                format!(
                    "PATH=\"{at}/vendor/{t}/codex-path:$PATH\" exec {at}/vendor/{t}/bin/codex \"$@\""
                ),
            )
        }
        Agent::Gemini => {
            let node = format!("{INSIDE}/node-{}/bin/node", versions.node);
            (
                format!("{node} ] && [ -e {at}/bundle/gemini.js"),
                format!("exec {node} {at}/bundle/gemini.js \"$@\""),
            )
        }
    };
    format!(
        "{head}[ -x {needs} ] || {{ echo \"{agent}: version {} is not installed yet: agentd is downloading it (agentctl status shows when it is ready)\" >&2; exit 127; }}\n{run}\n",
        version_of(agent, versions)
    )
}

fn version_of(agent: Agent, v: &Versions) -> &str {
    match agent {
        Agent::Claude => &v.claude,
        Agent::Codex => &v.codex,
        Agent::Gemini => &v.gemini,
    }
}

/// Why a package could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// curl failed or is missing.
    #[error("cannot download {what}: {why}")]
    Download {
        /// The URL.
        what: String,
        /// curl's message.
        why: String,
    },
    /// The registry's answer is not what npm's registry sends.
    #[error("the registry's metadata of {package} is unusable: {why}")]
    Metadata {
        /// `name@version`.
        package: String,
        /// What is wrong.
        why: String,
    },
    /// The tarball is not the one the registry vouches for.
    #[error("{package}: the tarball's sha512 is {got}, {by} {want}; nothing was installed")]
    Integrity {
        /// `name@version`.
        package: String,
        /// The digest wanted (base64).
        want: String,
        /// Who wants it: the registry, or agentd's own pin.
        by: &'static str,
        /// The download's digest (base64).
        got: String,
    },
    /// Unpacking failed.
    #[error("cannot unpack {package}: {source}")]
    Unpack {
        /// `name@version`.
        package: String,
        /// Why.
        #[source]
        source: UnpackError,
    },
    /// A file operation in the cache failed.
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
}

fn file_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> InstallError {
    let path = path.to_owned();
    move |source| InstallError::File { what, path, source }
}

/// Largest package metadata document accepted (bytes).
const MAX_METADATA: u64 = 4 << 20;
/// Largest tarball accepted (bytes).
const MAX_TARBALL: u64 = 1 << 30;
/// Largest unpacked package accepted (bytes of the tar stream): a small
/// tarball must not fill the host's disk.
const MAX_UNPACKED: u64 = 4 << 30;
/// Most members a package may have: each costs an inode (a directory a
/// block too) however few bytes of the tar stream it takes, so the bound
/// on bytes alone would let 8 million through. Node, the largest, has
/// about 3,300.
const MAX_ENTRIES: u64 = 100_000;
/// Deepest path in a package (components; Node's deepest has 12): deeper
/// ones take a descriptor per level to walk and remove.
const MAX_DEPTH: usize = 64;
/// Longest path in a package (bytes; Node's longest has about 110).
const MAX_NAME: usize = 1024;

/// The toolbox of one agentd: its settings and where things are.
#[derive(Debug, Clone)]
pub struct Toolbox {
    /// The settings.
    pub config: ToolboxConfig,
    /// `<cache>/agents`, shown at [`INSIDE`].
    pub dir: PathBuf,
    /// Whether the web console's packages are wanted too (it is on).
    pub console: bool,
}

impl Toolbox {
    /// The toolbox of `config`, in its cache directory (or `default_cache`'s
    /// `agents/`).
    #[must_use]
    pub fn new(config: ToolboxConfig, default_cache: Option<PathBuf>) -> Option<Self> {
        let dir = match &config.cache_dir {
            Some(d) => d.clone(),
            None => default_cache?.join("agents"),
        };
        Some(Self {
            config,
            dir,
            console: true,
        })
    }

    /// Whether `pkg` is in the cache (its directory only appears complete).
    #[must_use]
    pub fn has(&self, pkg: &Package) -> bool {
        self.dir.join(&pkg.dir).is_dir()
    }

    /// Whether every package of `agent` is in the cache.
    #[must_use]
    pub fn installed(&self, agent: Agent) -> bool {
        packages(agent, &self.config.versions)
            .iter()
            .all(|p| self.has(p))
    }

    /// What `agentctl status` shows of a sandbox started with `started`
    /// (this toolbox's [`Toolbox::describe`] then): the same agents at the
    /// same versions, with what was not installed yet at its start marked
    /// as the cache is now (the sandbox sees the cache as it is: what was
    /// installed since runs there); `started` itself when the versions
    /// differ (an agentd of another configuration started it).
    #[must_use]
    pub fn describe_since(&self, started: &str) -> String {
        let bare = |s: &str| s.replace(" (not installed yet)", "");
        let now = self.describe();
        if bare(&now) == bare(started) {
            now
        } else {
            started.to_owned()
        }
    }

    /// The agents and their versions, as `agentctl status` shows them.
    #[must_use]
    pub fn describe(&self) -> String {
        let v = &self.config.versions;
        let mut parts: Vec<String> = self
            .config
            .agents
            .iter()
            .map(|&a| {
                let mut s = format!("{a} {}", version_of(a, v));
                if !self.installed(a) {
                    s.push_str(" (not installed yet)");
                }
                s
            })
            .collect();
        if self.config.agents.contains(&Agent::Gemini) {
            parts.push(format!("node {}", v.node));
        }
        parts.join(", ")
    }

    /// Write the launchers into `bin` (agentd's `/run/keystone/bin`): one
    /// per configured agent, and none for the others.
    pub fn write_launchers(&self, bin: &Path) -> Result<(), InstallError> {
        for &agent in Agent::ALL {
            let path = bin.join(agent.as_str());
            if !self.config.agents.contains(&agent) {
                match fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(file_err("remove", &path)(e)),
                }
                continue;
            }
            let text = launcher(agent, &self.config.versions);
            if fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                atomic_write(&path, text.as_bytes()).map_err(|e| InstallError::File {
                    what: "write",
                    path: path.clone(),
                    source: std::io::Error::other(e),
                })?;
            }
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755))
                .map_err(file_err("set the mode of", &path))?;
        }
        Ok(())
    }

    /// Make the lock file of an older agentd write-only (see
    /// [`Self::install_missing`]), at startup: before the next install,
    /// which may be far off.
    pub fn restrict_lock(&self) {
        if let Ok(f) = fs::OpenOptions::new()
            .write(true)
            .open(self.dir.join(".lock"))
        {
            restrict(&f);
        }
    }

    /// The file the web console serves as `name` (`xterm.js`,
    /// `xterm.css`, `addon-fit.js`), if it is one of its files.
    #[must_use]
    pub fn console_file(&self, name: &str) -> Option<PathBuf> {
        CONSOLE_FILES
            .iter()
            .find(|(n, ..)| *n == name)
            .map(|(_, dir, path)| self.dir.join(dir).join(path))
    }

    /// Every package the configured agents and the web console need, once
    /// each.
    #[must_use]
    pub fn wanted(&self) -> Vec<Package> {
        let mut out: Vec<Package> = Vec::new();
        for &a in &self.config.agents {
            for p in packages(a, &self.config.versions) {
                if !out.contains(&p) {
                    out.push(p);
                }
            }
        }
        if self.console {
            out.extend(console_packages());
        }
        out
    }

    /// Every package the configured agents need that the cache lacks.
    #[must_use]
    pub fn missing(&self) -> Vec<Package> {
        let mut out = self.wanted();
        out.retain(|p| !self.has(p));
        out
    }

    /// Install every missing package, one agentd at a time (a lock file in
    /// the cache), calling `progress` before each and after each with its
    /// outcome. Stops at the first failure.
    pub fn install_missing(
        &self,
        mut progress: impl FnMut(&Package, Option<&Result<(), InstallError>>),
    ) -> Result<(), InstallError> {
        use std::os::unix::fs::OpenOptionsExt;
        make_dir(&self.dir)?;
        let lock_path = self.dir.join(".lock");
        // Write-only, and for agentd alone: every sandbox sees this
        // directory (read-only), and one that could open the file could
        // flock it and hold every install back for as long as it likes. A
        // read-only mount refuses it the write, the mode the read (and a
        // descriptor opened with O_PATH cannot be locked).
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o200)
            .open(&lock_path)
            .map_err(file_err("open", &lock_path))?;
        restrict(&lock);
        // Another agentd may be downloading the same packages: wait for it,
        // then take what it installed.
        let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| file_err("lock", &lock_path)(e.into()))?;
        // What an agentd that died while installing left (only the holder of
        // the lock installs, so none of these is in use).
        if let Ok(entries) = fs::read_dir(&self.dir) {
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().starts_with(".install-") {
                    let path = entry.path();
                    if let Err(e) = remove_tree(&path) {
                        tracing::warn!(path = %path.display(), "cannot remove an unfinished install: {e}");
                    }
                }
            }
        }
        for pkg in self.missing() {
            progress(&pkg, None);
            let r = self.install(&pkg);
            progress(&pkg, Some(&r));
            r?;
        }
        Ok(())
    }

    /// Download, check and unpack `pkg` into the cache (with the lock of
    /// [`Self::install_missing`] held).
    fn install(&self, pkg: &Package) -> Result<(), InstallError> {
        make_dir(&self.dir)?;
        let work = tempfile::Builder::new()
            .prefix(".install-")
            .tempdir_in(&self.dir)
            .map_err(file_err("make a directory in", &self.dir))?;
        let r = self.install_in(pkg, work.path());
        // Whatever tar left, even a directory of mode 000 (which the
        // TempDir's own removal cannot enter without privilege).
        if let Err(e) = remove_tree(work.path()) {
            tracing::warn!(path = %work.path().display(), "cannot remove an unfinished install: {e}");
        }
        r
    }

    /// [`Self::install`] in the temporary directory `work`.
    fn install_in(&self, pkg: &Package, work: &Path) -> Result<(), InstallError> {
        let id = format!("{}@{}", pkg.name, pkg.version);
        // npm's registry takes the scope's slash encoded.
        let meta_url = format!(
            "{}/{}/{}",
            self.config.registry,
            pkg.name.replace('/', "%2f"),
            pkg.version
        );
        let meta_file = work.join("meta.json");
        curl(&meta_url, &meta_file, MAX_METADATA)?;
        let (tarball, mut want) = read_metadata(&meta_file, &id, &self.config.registry)?;
        let mut by = "the registry says";
        if let Some(pin) = pkg.pinned {
            (want, by) = (pin.to_owned(), "agentd pins");
        }
        let tgz = work.join("package.tgz");
        curl(&tarball, &tgz, MAX_TARBALL)?;
        let got = sha512_base64(&tgz)?;
        if got != want {
            return Err(InstallError::Integrity {
                package: id,
                want,
                by,
                got,
            });
        }
        let unpack_err = |source| InstallError::Unpack {
            package: id.clone(),
            source,
        };
        let size = unpacked_size(&tgz, MAX_UNPACKED).map_err(unpack_err)?;
        let entries = check_members(&tgz, MAX_ENTRIES, MAX_DEPTH, MAX_NAME).map_err(unpack_err)?;
        tracing::debug!(package = %id, bytes = size, entries, "unpacking");
        let unpacked = work.join("package");
        make_dir(&unpacked)?;
        let out = crate::child::end_with_us(&mut Command::new("tar"))
            .args(["-xzf"])
            .arg(&tgz)
            .arg("-C")
            .arg(&unpacked)
            .args([
                "--strip-components=1",
                "--no-same-owner",
                "--no-same-permissions",
                "--no-overwrite-dir",
            ])
            .stdin(Stdio::null())
            .output()
            .map_err(|source| {
                unpack_err(UnpackError::Spawn {
                    tool: "tar",
                    source,
                })
            })?;
        if !out.status.success() {
            return Err(unpack_err(UnpackError::Extract {
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            }));
        }
        normalize(&unpacked)?;
        let target = self.dir.join(&pkg.dir);
        fs::rename(&unpacked, &target).map_err(file_err("move into place", &target))?;
        Ok(())
    }
}

/// Make lock file `f` write-only for its owner, unless it is already (or
/// another user's, which is left as it is).
fn restrict(f: &fs::File) {
    if f.metadata()
        .is_ok_and(|m| m.permissions().mode() & 0o7777 != 0o200)
    {
        let _ = f.set_permissions(fs::Permissions::from_mode(0o200));
    }
}

/// Make directory `d` (and its parents) readable by every sandbox uid; a
/// directory that exists keeps its mode (`cache_dir` may name one of the
/// administrator's).
fn make_dir(d: &Path) -> Result<(), InstallError> {
    if d.is_dir() {
        return Ok(());
    }
    fs::create_dir_all(d).map_err(file_err("create", d))?;
    fs::set_permissions(d, fs::Permissions::from_mode(0o755))
        .map_err(file_err("set the mode of", d))
}

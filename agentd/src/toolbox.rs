//! The agent toolbox: Claude Code, Codex and Gemini CLI (with the Node it
//! runs on) from the npm registry at pinned versions.
//!
//! Each package is downloaded once into a cache keyed by name and version
//! (`<cache>/agents/<agent>-<version>/`), checked against the registry's
//! sha512 integrity before it is unpacked, and moved into place whole, so a
//! directory in the cache is always complete. Every local sandbox sees the
//! cache read-only at `/run/keystone/agents`, and a launcher per agent in
//! `/run/keystone/bin` (first on `PATH`) runs the pinned version; an agent
//! that is not installed yet gets a launcher that says so.
//!
//! Only each agent's native package is needed (Claude Code and Codex ship
//! native binaries); Gemini CLI is a single bundled script run by the Node
//! binary that npm publishes as `node-linux-<arch>`. Nothing of the
//! packages runs on the host: no install scripts, no `npm`.

use std::fmt;
use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};

use crate::fsutil::atomic_write;

/// An agent CLI of the toolbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Agent {
    /// Claude Code (`claude`).
    Claude,
    /// Codex (`codex`).
    Codex,
    /// Gemini CLI (`gemini`).
    Gemini,
}

impl Agent {
    /// Every agent, in the order they are shown.
    pub const ALL: [Self; 3] = [Self::Claude, Self::Codex, Self::Gemini];

    /// The command's name.
    #[must_use]
    pub fn command(self) -> &'static str {
        match self {
            Self::Claude => "claude",
            Self::Codex => "codex",
            Self::Gemini => "gemini",
        }
    }
}

impl fmt::Display for Agent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.command())
    }
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
        }],
        // The platform builds are versions of @openai/codex itself.
        Agent::Codex => vec![Package {
            name: "@openai/codex".into(),
            version: format!("{}-{p}", versions.codex),
            dir: format!("codex-{}", versions.codex),
        }],
        Agent::Gemini => vec![
            Package {
                name: "@google/gemini-cli".into(),
                version: versions.gemini.clone(),
                dir: format!("gemini-{}", versions.gemini),
            },
            Package {
                name: format!("node-{p}"),
                version: versions.node.clone(),
                dir: format!("node-{}", versions.node),
            },
        ],
    }
}

/// Where the toolbox is seen inside a sandbox.
pub const INSIDE: &str = "/run/keystone/agents";

/// The launcher of `agent`: runs the pinned version from [`INSIDE`].
#[must_use]
pub fn launcher(agent: Agent, versions: &Versions, installed: bool) -> String {
    let head = "#!/bin/sh\n# Written by agentd: the toolbox's pinned version.\n";
    if !installed {
        return format!(
            "{head}echo \"{agent}: version {} is not installed yet: agentd is downloading it (agentctl status shows when it is ready)\" >&2\nexit 127\n",
            version_of(agent, versions)
        );
    }
    let pkg = packages(agent, versions).remove(0);
    let at = format!("{INSIDE}/{}", pkg.dir);
    match agent {
        Agent::Claude => format!("{head}exec {at}/claude \"$@\"\n"),
        Agent::Codex => {
            let t = codex_triple();
            format!(
                "{head}PATH=\"{at}/vendor/{t}/codex-path:$PATH\" exec {at}/vendor/{t}/bin/codex \"$@\"\n"
            )
        }
        Agent::Gemini => format!(
            "{head}exec {INSIDE}/node-{}/bin/node {at}/bundle/gemini.js \"$@\"\n",
            versions.node
        ),
    }
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
    #[error(
        "{package}: the tarball's sha512 is {got}, the registry says {want}; nothing was installed"
    )]
    Integrity {
        /// `name@version`.
        package: String,
        /// The registry's digest (base64).
        want: String,
        /// The download's digest (base64).
        got: String,
    },
    /// Unpacking failed.
    #[error("cannot unpack {package}: {why}")]
    Unpack {
        /// `name@version`.
        package: String,
        /// tar's message.
        why: String,
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
        Some(Self { config, dir })
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
        for agent in Agent::ALL {
            let path = bin.join(agent.command());
            if !self.config.agents.contains(&agent) {
                match fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(file_err("remove", &path)(e)),
                }
                continue;
            }
            let text = launcher(agent, &self.config.versions, self.installed(agent));
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

    /// Every package the configured agents need that the cache lacks.
    #[must_use]
    pub fn missing(&self) -> Vec<Package> {
        let mut out: Vec<Package> = Vec::new();
        for &a in &self.config.agents {
            for p in packages(a, &self.config.versions) {
                if !self.has(&p) && !out.contains(&p) {
                    out.push(p);
                }
            }
        }
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
        let (tarball, want) = read_metadata(&meta_file, &id, &self.config.registry)?;
        let tgz = work.join("package.tgz");
        curl(&tarball, &tgz, MAX_TARBALL)?;
        let got = sha512_base64(&tgz)?;
        if got != want {
            return Err(InstallError::Integrity {
                package: id,
                want,
                got,
            });
        }
        let size = unpacked_size(&tgz, MAX_UNPACKED).map_err(|why| InstallError::Unpack {
            package: id.clone(),
            why,
        })?;
        let entries = check_members(&tgz, MAX_ENTRIES, MAX_DEPTH, MAX_NAME).map_err(|why| {
            InstallError::Unpack {
                package: id.clone(),
                why,
            }
        })?;
        tracing::debug!(package = %id, bytes = size, entries, "unpacking");
        let unpacked = work.join("package");
        make_dir(&unpacked)?;
        let out = Command::new("tar")
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
            .map_err(|e| InstallError::Unpack {
                package: id.clone(),
                why: format!("cannot run tar: {e}"),
            })?;
        if !out.status.success() {
            return Err(InstallError::Unpack {
                package: id,
                why: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
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

/// Fetch `url` into `to` with curl: HTTPS (or loopback HTTP) only, no
/// redirect, at most `max` bytes. The bytes come through
/// agentd, which counts them: curl's `--max-filesize` only checks a length
/// the server announces (before curl 8.4), and a chunked answer has none.
fn curl(url: &str, to: &Path, max: u64) -> Result<(), InstallError> {
    let fail = |why: String| InstallError::Download {
        what: url.to_owned(),
        why,
    };
    let mut child = Command::new("curl")
        .args([
            "--silent",
            "--show-error",
            "--fail",
            // A URL is fetched as it is: `[1-1000]` or `{a,b}` in a path
            // would otherwise be one request per expansion.
            "--globoff",
            // No redirect is followed: everything comes from the registry's
            // own host (a redirect is curl's error 47, reported below).
            "--location",
            "--max-redirs",
            "0",
            "--proto",
            "=https,http",
            "--connect-timeout",
            "30",
            "--max-time",
            "1800",
            "--max-filesize",
        ])
        .arg(max.to_string())
        .args(["--output", "-", "--", url])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("cannot run curl ({e}); install curl")))?;
    let copied = copy_at_most(child.stdout.take().expect("piped"), to, max);
    if copied.is_err() {
        let _ = child.kill();
    }
    let done = child
        .wait_with_output()
        .map_err(|e| fail(format!("curl: {e}")))?;
    match copied {
        Err(CopyError::TooLarge) => {
            Err(fail(format!("the answer is larger than {} MiB", max >> 20)))
        }
        Err(CopyError::Write(e)) => Err(file_err("write", to)(e)),
        Err(CopyError::Read(e)) => Err(fail(format!("cannot read curl's output: {e}"))),
        Ok(()) if done.status.success() => Ok(()),
        Ok(()) if done.status.code() == Some(47) => Err(fail(
            "the registry answered with a redirect, which agentd does not follow: \
             toolbox.registry must serve the metadata and the tarballs itself"
                .to_owned(),
        )),
        Ok(()) => Err(fail(
            String::from_utf8_lossy(&done.stderr).trim().to_owned(),
        )),
    }
}

enum CopyError {
    TooLarge,
    Read(std::io::Error),
    Write(std::io::Error),
}

/// Copy `from` into a new file `to`, refusing more than `max` bytes.
fn copy_at_most(mut from: impl Read, to: &Path, max: u64) -> Result<(), CopyError> {
    use std::io::Write;
    let mut file = fs::File::create(to).map_err(CopyError::Write)?;
    let mut buf = vec![0u8; 1 << 16];
    let mut total: u64 = 0;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(CopyError::Read(e)),
        };
        total += n as u64;
        if total > max {
            return Err(CopyError::TooLarge);
        }
        file.write_all(&buf[..n]).map_err(CopyError::Write)?;
    }
}

/// The tarball URL and sha512 (base64) that the metadata of `id` names.
fn read_metadata(path: &Path, id: &str, registry: &str) -> Result<(String, String), InstallError> {
    let bad = |why: String| InstallError::Metadata {
        package: id.to_owned(),
        why,
    };
    let text = fs::read(path).map_err(file_err("read", path))?;
    let v: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let dist = &v["dist"];
    let tarball = dist["tarball"]
        .as_str()
        .ok_or_else(|| bad("no dist.tarball".into()))?;
    // The tarball comes from the registry itself, over the same scheme.
    let scheme_host =
        |u: &str| -> String { u.splitn(4, '/').take(3).collect::<Vec<_>>().join("/") };
    if scheme_host(tarball) != scheme_host(registry) {
        return Err(bad(format!("dist.tarball {tarball} is not on {registry}")));
    }
    let integrity = dist["integrity"]
        .as_str()
        .ok_or_else(|| bad("no dist.integrity".into()))?;
    let want = integrity
        .split_whitespace()
        .find_map(|h| h.strip_prefix("sha512-"))
        .ok_or_else(|| bad(format!("dist.integrity '{integrity}' has no sha512")))?;
    Ok((tarball.to_owned(), want.to_owned()))
}

/// The size of the tar stream in gzip file `tgz` (`gzip -dc`, counted as
/// it comes), or why it is refused: more than `max` bytes, or not gzip.
fn unpacked_size(tgz: &Path, max: u64) -> Result<u64, String> {
    let mut child = Command::new("gzip")
        .arg("-dc")
        .arg(tgz)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run gzip: {e}"))?;
    let mut out = child.stdout.take().expect("piped");
    let mut buf = vec![0u8; 1 << 16];
    let mut total: u64 = 0;
    loop {
        let n = match out.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("cannot read gzip's output: {e}"));
            }
        };
        total += n as u64;
        if total > max {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("it unpacks to more than {} MiB", max >> 20));
        }
    }
    let done = child.wait_with_output().map_err(|e| format!("gzip: {e}"))?;
    if done.status.success() {
        Ok(total)
    } else {
        Err(format!(
            "not a gzip file: {}",
            String::from_utf8_lossy(&done.stderr).trim()
        ))
    }
}

/// The number of members of gzipped tarball `tgz` as `tar` lists them, or
/// why it is refused: more than `max_entries`, a path of more than
/// `max_depth` components or `max_name` bytes, or not a tarball.
fn check_members(
    tgz: &Path,
    max_entries: u64,
    max_depth: usize,
    max_name: usize,
) -> Result<u64, String> {
    let mut child = Command::new("tar")
        // One line per member: a newline in a name is written `\n`.
        .args(["--quoting-style=escape", "-tzf"])
        .arg(tgz)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run tar: {e}"))?;
    let mut out = child.stdout.take().expect("piped");
    let mut buf = vec![0u8; 1 << 16];
    let (mut entries, mut len, mut depth, mut at_start) = (0u64, 0usize, 0usize, true);
    let refused = 'read: loop {
        let n = match out.read(&mut buf) {
            Ok(0) => break None,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => break Some(format!("cannot read tar's listing: {e}")),
        };
        for &b in &buf[..n] {
            if b == b'\n' {
                entries += 1;
                if entries > max_entries {
                    break 'read Some(format!("it has more than {max_entries} entries"));
                }
                (len, depth, at_start) = (0, 0, true);
                continue;
            }
            len += 1;
            if b == b'/' {
                at_start = true;
            } else if at_start {
                depth += 1;
                at_start = false;
            }
            if len > max_name {
                break 'read Some(format!("it has a path longer than {max_name} bytes"));
            }
            if depth > max_depth {
                break 'read Some(format!("it has a path deeper than {max_depth} directories"));
            }
        }
    };
    drop(out);
    if refused.is_some() {
        let _ = child.kill();
    }
    let done = child.wait_with_output().map_err(|e| format!("tar: {e}"))?;
    match refused {
        Some(why) => Err(why),
        None if done.status.success() => Ok(entries),
        None => Err(format!(
            "not a tarball: {}",
            String::from_utf8_lossy(&done.stderr).trim()
        )),
    }
}

/// Remove `path` and everything under it, not following links; directories
/// are made accessible first (a package may hold one of mode 000, which an
/// unprivileged agentd could not enter). Holds no descriptor per level.
fn remove_tree(path: &Path) -> std::io::Result<()> {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.is_dir() {
        return fs::remove_file(path);
    }
    if meta.permissions().mode() & 0o700 != 0o700 {
        fs::set_permissions(path, fs::Permissions::from_mode(0o700))?;
    }
    let children = fs::read_dir(path)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut first_error = None;
    for child in children {
        if let Err(e) = remove_tree(&child) {
            first_error.get_or_insert(e);
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => fs::remove_dir(path),
    }
}

fn sha512_base64(path: &Path) -> Result<String, InstallError> {
    use base64::Engine;
    use sha2::Digest;
    let mut f = fs::File::open(path).map_err(file_err("read", path))?;
    let mut h = sha2::Sha512::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf).map_err(file_err("read", path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(base64::engine::general_purpose::STANDARD.encode(h.finalize()))
}

/// Make an unpacked package safe to show to every sandbox: directories
/// 0755, files 0755 or 0644 (by their execute bit), and nothing else (no
/// symlink, device or fifo stays).
fn normalize(dir: &Path) -> Result<(), InstallError> {
    // Read before descending: no descriptor stays open per level.
    let children = fs::read_dir(dir)
        .and_then(|rd| {
            rd.map(|e| e.map(|e| e.path()))
                .collect::<Result<Vec<_>, _>>()
        })
        .map_err(file_err("read", dir))?;
    for path in children {
        let meta = fs::symlink_metadata(&path).map_err(file_err("read", &path))?;
        let ft = meta.file_type();
        if ft.is_dir() {
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755))
                .map_err(file_err("set the mode of", &path))?;
            normalize(&path)?;
        } else if ft.is_file() {
            let mode = if meta.permissions().mode() & 0o111 != 0 {
                0o755
            } else {
                0o644
            };
            fs::set_permissions(&path, fs::Permissions::from_mode(mode))
                .map_err(file_err("set the mode of", &path))?;
        } else {
            fs::remove_file(&path).map_err(file_err("remove", &path))?;
        }
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755))
        .map_err(file_err("set the mode of", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packages_and_launchers_follow_the_versions() {
        let v = Versions::default();
        let claude = packages(Agent::Claude, &v);
        assert_eq!(claude[0].dir, format!("claude-{}", v.claude));
        assert!(
            claude[0]
                .name
                .starts_with("@anthropic-ai/claude-code-linux-")
        );
        let codex = packages(Agent::Codex, &v);
        assert_eq!(codex[0].name, "@openai/codex");
        assert!(codex[0].version.starts_with(&format!("{}-linux-", v.codex)));
        let gemini = packages(Agent::Gemini, &v);
        assert_eq!(gemini.len(), 2, "Gemini CLI and Node");
        let l = launcher(Agent::Gemini, &v, true);
        assert!(
            l.contains(&format!("/run/keystone/agents/node-{}/bin/node", v.node))
                && l.contains(&format!(
                    "/run/keystone/agents/gemini-{}/bundle/gemini.js",
                    v.gemini
                )),
            "{l}"
        );
        let l = launcher(Agent::Claude, &v, false);
        assert!(
            l.contains("not installed yet") && l.contains("exit 127"),
            "{l}"
        );
    }

    #[test]
    fn bad_settings_are_named() {
        let mut c = ToolboxConfig::default();
        assert!(c.problems().is_empty());
        c.versions.claude = "../../etc".into();
        c.versions.node = String::new();
        c.registry = "http://registry.example.org".into();
        c.cache_dir = Some("relative".into());
        let p = c.problems();
        assert_eq!(p.len(), 4, "{p:#?}");
        assert!(
            p[0].starts_with("toolbox.versions.claude: '../../etc'"),
            "{p:#?}"
        );
        c.registry = "http://127.0.0.1:4873".into();
        assert_eq!(c.problems().len(), 3);
    }

    #[test]
    fn a_tarball_from_elsewhere_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let meta = dir.path().join("m.json");
        fs::write(
            &meta,
            r#"{"dist":{"tarball":"https://evil.example.com/x.tgz","integrity":"sha512-AAAA"}}"#,
        )
        .unwrap();
        let err = read_metadata(&meta, "x@1", "https://registry.npmjs.org")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("is not on https://registry.npmjs.org"),
            "{err}"
        );
        fs::write(
            &meta,
            r#"{"dist":{"tarball":"https://registry.npmjs.org/x/-/x-1.tgz","integrity":"sha1-AAAA"}}"#,
        )
        .unwrap();
        let err = read_metadata(&meta, "x@1", "https://registry.npmjs.org")
            .unwrap_err()
            .to_string();
        assert!(err.contains("has no sha512"), "{err}");
    }

    #[test]
    fn a_package_that_unpacks_too_large_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("zeros");
        fs::write(&raw, vec![0u8; 3 << 20]).unwrap();
        let ok = Command::new("gzip").arg("-k").arg(&raw).status().unwrap();
        assert!(ok.success());
        let tgz = dir.path().join("zeros.gz");
        assert!(fs::metadata(&tgz).unwrap().len() < 64 << 10, "a small file");
        let err = unpacked_size(&tgz, 1 << 20).unwrap_err();
        assert!(err.contains("more than 1 MiB"), "{err}");
        assert_eq!(unpacked_size(&tgz, 4 << 20).unwrap(), 3 << 20);
        fs::write(&tgz, b"not gzip").unwrap();
        assert!(
            unpacked_size(&tgz, 1 << 20)
                .unwrap_err()
                .contains("not a gzip file")
        );
    }

    #[test]
    fn normalize_keeps_files_and_drops_links() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        fs::create_dir(p.join("bin")).unwrap();
        fs::write(p.join("bin/tool"), "x").unwrap();
        fs::set_permissions(p.join("bin/tool"), fs::Permissions::from_mode(0o700)).unwrap();
        fs::write(p.join("README"), "x").unwrap();
        fs::set_permissions(p.join("README"), fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink("/etc/shadow", p.join("link")).unwrap();
        normalize(p).unwrap();
        let mode = |f: &str| fs::metadata(p.join(f)).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode("bin/tool"), 0o755);
        assert_eq!(mode("README"), 0o644);
        assert_eq!(mode("bin"), 0o755);
        assert!(fs::symlink_metadata(p.join("link")).is_err());
    }
}

#[cfg(test)]
mod attacks {
    use super::*;

    #[test]
    fn settings_that_would_inject_into_urls_paths_or_launchers_are_refused() {
        for version in [
            "1.0.0$(id)",
            "1.0.0`id`",
            "1.0.0\"; id; \"",
            "1.0.0'",
            "1.0.0\nexec sh",
            "1.0.0 x",
            "1.0.0;id",
            "1.0.0/../../x",
            "../1.0.0",
            "..",
            "1.0.0%2f..",
            "1.0.0?x",
            "1.0.0#x",
            "1.0.0\\x",
            "1.0.0*",
            "-1.0.0",
            "",
            &"9".repeat(65),
        ] {
            let mut c = ToolboxConfig::default();
            c.versions.codex = version.to_owned();
            assert_eq!(c.problems().len(), 1, "{version:?} is accepted");
        }
        // What passes is plain in the launcher: no quote, no expansion.
        let v = Versions {
            claude: "1.0.0-rc.1+build.5".into(),
            ..Versions::default()
        };
        let l = launcher(Agent::Claude, &v, true);
        assert_eq!(
            l.lines().last().unwrap(),
            "exec /run/keystone/agents/claude-1.0.0-rc.1+build.5/claude \"$@\""
        );
        for registry in [
            // Plain HTTP to a name that merely starts like loopback.
            "http://127.0.0.1.example.com",
            "http://127.0.0.1.nip.io:4873",
            "http://127.0.0.10",
            "http://[::1].example.com",
            "http://127.0.0.1:4873.example.com",
            "http://127.0.0.1:",
            "http://localhost:4873",
            "https://registry.npmjs.org/",
            "https://user@registry.npmjs.org",
            "https://registry.npmjs.org/$(id)",
            "https://registry.npmjs.org/ x",
            "https://registry.npmjs.org\n",
            "https://registry.npmjs.org?x",
            "https://registry.npmjs.org#x",
            "ftp://registry.npmjs.org",
            "file:///etc",
            "https://",
        ] {
            assert!(
                !registry_allowed(registry),
                "{registry:?} is accepted as a registry"
            );
        }
        for registry in [
            "https://registry.npmjs.org",
            "https://npm.example.com:8443/api/npm",
            "http://127.0.0.1",
            "http://127.0.0.1:4873",
            "http://127.0.0.1:4873/npm",
            "http://[::1]:4873",
            "http://[::1]/npm",
        ] {
            assert!(registry_allowed(registry), "{registry:?} is refused");
        }
        let c = ToolboxConfig {
            cache_dir: Some("cache/../agents".into()),
            ..ToolboxConfig::default()
        };
        assert_eq!(c.problems().len(), 1);
    }

    #[test]
    fn tarballs_off_the_registry_and_unusable_integrity_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let meta = dir.path().join("m.json");
        let registry = "https://registry.npmjs.org";
        for tarball in [
            "https://registry.npmjs.org@evil.example.com/x.tgz",
            "https://registry.npmjs.org.evil.example.com/x.tgz",
            "https://registry.npmjs.org:8443/x.tgz",
            "https://registry.npmjs.org\\@evil.example.com/x.tgz",
            "https://registry.npmjs.org#@evil.example.com/x.tgz",
            "http://registry.npmjs.org/x.tgz",
            "HTTPS://evil.example.com/x.tgz",
            "//evil.example.com/x.tgz",
            "/x.tgz",
            "file:///etc/passwd",
        ] {
            let doc = serde_json::json!({"dist": {"tarball": tarball, "integrity": "sha512-AAAA"}});
            fs::write(&meta, doc.to_string()).unwrap();
            assert!(
                read_metadata(&meta, "x@1", registry).is_err(),
                "{tarball} is accepted"
            );
        }
        // Several hashes: the first sha512 is the one that must match (a
        // second, right one does not rescue a wrong first one).
        let doc = serde_json::json!({"dist": {
            "tarball": "https://registry.npmjs.org/x/-/x-1.tgz",
            "integrity": "sha1-AAAA sha512-FIRST sha512-SECOND",
        }});
        fs::write(&meta, doc.to_string()).unwrap();
        assert_eq!(read_metadata(&meta, "x@1", registry).unwrap().1, "FIRST");
        for bad in [
            serde_json::json!({"dist": {"tarball": "https://registry.npmjs.org/x.tgz"}}),
            serde_json::json!({"dist": {"tarball": "https://registry.npmjs.org/x.tgz", "integrity": 5}}),
            serde_json::json!({"dist": {"tarball": ["https://registry.npmjs.org/x.tgz"], "integrity": "sha512-A"}}),
            serde_json::json!([]),
        ] {
            fs::write(&meta, bad.to_string()).unwrap();
            assert!(read_metadata(&meta, "x@1", registry).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_download_is_cut_off_at_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let to = dir.path().join("out");
        let endless = std::io::repeat(b'x');
        assert!(matches!(
            copy_at_most(endless, &to, 1 << 20),
            Err(CopyError::TooLarge)
        ));
        assert!(fs::metadata(&to).unwrap().len() <= 1 << 20);
        copy_at_most(&b"just enough"[..], &to, 11).ok().unwrap();
        assert_eq!(fs::read(&to).unwrap(), b"just enough");
    }

    /// A gzipped tarball of `names` (directories end in `/`), made by tar.
    fn tarball(dir: &Path, names: &[String]) -> PathBuf {
        let root = dir.join("root");
        for n in names {
            let p = root.join(n);
            if n.ends_with('/') {
                fs::create_dir_all(&p).unwrap();
            } else {
                fs::create_dir_all(p.parent().unwrap()).unwrap();
                fs::write(&p, "").unwrap();
            }
        }
        let tgz = dir.join("t.tgz");
        let ok = Command::new("tar")
            .arg("-czf")
            .arg(&tgz)
            .arg("-C")
            .arg(&root)
            .arg("--no-recursion")
            .args(names)
            .status()
            .unwrap();
        assert!(ok.success());
        tgz
    }

    #[test]
    fn packages_of_too_many_too_deep_or_too_long_members_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let names: Vec<String> = ["package/", "package/a", "package/b/", "package/b/c"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let tgz = tarball(dir.path(), &names);
        assert_eq!(check_members(&tgz, 4, 3, 100), Ok(4));
        assert!(
            check_members(&tgz, 3, 3, 100)
                .unwrap_err()
                .contains("more than 3 entries")
        );
        assert!(
            check_members(&tgz, 4, 2, 100)
                .unwrap_err()
                .contains("deeper than 2")
        );
        assert!(
            check_members(&tgz, 4, 3, 10)
                .unwrap_err()
                .contains("longer than 10")
        );
        // A newline in a name does not split it into two short ones.
        let dir = tempfile::tempdir().unwrap();
        let tgz = tarball(dir.path(), &["package/a\nb".to_owned()]);
        assert_eq!(check_members(&tgz, 1, 3, 100), Ok(1));
        fs::write(&tgz, b"not a tarball").unwrap();
        assert!(
            check_members(&tgz, 4, 3, 100)
                .unwrap_err()
                .contains("not a tarball")
        );
    }

    #[test]
    fn removing_an_unfinished_install_follows_no_link_and_enters_locked_directories() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("keep"), "host").unwrap();
        fs::set_permissions(&outside, fs::Permissions::from_mode(0o555)).unwrap();
        let work = dir.path().join(".install-x");
        fs::create_dir_all(work.join("package/locked/inner")).unwrap();
        fs::write(work.join("package/locked/inner/f"), "x").unwrap();
        std::os::unix::fs::symlink(&outside, work.join("package/to-dir")).unwrap();
        std::os::unix::fs::symlink(outside.join("keep"), work.join("package/to-file")).unwrap();
        fs::set_permissions(
            work.join("package/locked/inner"),
            fs::Permissions::from_mode(0o000),
        )
        .unwrap();
        fs::set_permissions(
            work.join("package/locked"),
            fs::Permissions::from_mode(0o000),
        )
        .unwrap();
        remove_tree(&work).unwrap();
        assert!(!work.exists());
        assert_eq!(fs::read_to_string(outside.join("keep")).unwrap(), "host");
        let mode = fs::metadata(&outside).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o555, "the link's target was changed");
        remove_tree(&work).unwrap();
    }

    #[test]
    fn the_lock_file_is_write_only() {
        let dir = tempfile::tempdir().unwrap();
        let c = ToolboxConfig {
            agents: Vec::new(),
            cache_dir: Some(dir.path().join("agents")),
            ..ToolboxConfig::default()
        };
        let tb = Toolbox::new(c, None).unwrap();
        fs::create_dir_all(&tb.dir).unwrap();
        fs::write(tb.dir.join(".lock"), "").unwrap();
        fs::set_permissions(tb.dir.join(".lock"), fs::Permissions::from_mode(0o644)).unwrap();
        fs::create_dir_all(tb.dir.join(".install-stale/package/d")).unwrap();
        tb.restrict_lock();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&tb.dir.join(".lock")), 0o200);
        fs::remove_file(tb.dir.join(".lock")).unwrap();
        tb.install_missing(|_, _| {}).unwrap();
        assert_eq!(mode(&tb.dir.join(".lock")), 0o200);
        assert!(!tb.dir.join(".install-stale").exists());
    }
}

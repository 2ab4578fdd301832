//! The registry: one JSON file with a schema version, written atomically,
//! plus one directory per sandbox.
//!
//! ```text
//! <state>/registry.json
//! <state>/sandboxes/<name>/config.json   copy of the sandbox's settings
//! <state>/sandboxes/<name>/workspace/    seen as /workspace inside
//! <state>/sandboxes/<name>/home/         the sandbox user's home
//! <state>/sandboxes/<name>/logs/         sandbox.log
//! <state>/sandboxes/<name>/run/          control socket
//! ```

use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use std::time::SystemTime;

use keystone_agent_api::types::Ports;
use keystone_agent_api::{BackendKind, SandboxConfig, SandboxState, SandboxSummary};
use serde::{Deserialize, Serialize};

use crate::fsutil::atomic_write;

use crate::backend::Runtime;
use crate::text::micros;

/// The registry format this agentd reads and writes.
pub const SCHEMA_VERSION: u32 = 1;

/// File name of the registry inside the state directory.
pub const REGISTRY_FILE: &str = "registry.json";

/// Registry failures. None of them ever overwrites the file.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The file exists but is not a registry agentd can read.
    #[error(
        "Registry {path} is corrupt: {source}. agentd will not overwrite it; move it aside \
         (sandboxes in it will be forgotten, their directories kept) or restore a backup"
    )]
    Corrupt {
        /// The registry file.
        path: PathBuf,
        /// What the parser said.
        #[source]
        source: serde_json::Error,
    },
    /// The file was written by a newer (or unknown) agentd.
    #[error(
        "Registry {path} has schema version {found}, this agentd understands {SCHEMA_VERSION}; \
         run the agentd that wrote it, or upgrade"
    )]
    UnknownVersion {
        /// The registry file.
        path: PathBuf,
        /// The version found.
        found: u64,
    },
    /// A file system operation failed.
    #[error("Cannot {what} {path}: {source}")]
    Io {
        /// What was attempted.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl From<crate::fsutil::WriteError> for RegistryError {
    fn from(e: crate::fsutil::WriteError) -> Self {
        Self::Io {
            what: e.what,
            path: e.path,
            source: e.source,
        }
    }
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> RegistryError + 'a {
    move |source| RegistryError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RegistryFile {
    schema_version: u32,
    sandboxes: Vec<Sandbox>,
}

/// The on-disk state of agentd.
#[derive(Debug, Clone)]
pub struct Registry {
    dir: PathBuf,
}

impl Registry {
    /// Open (creating if needed, mode 0700) the state directory and load the
    /// registry in it.
    pub fn open(dir: &Path) -> Result<(Self, Vec<Sandbox>), RegistryError> {
        // 0711: sandbox helpers running as a sandbox's or owner's uid (and
        // people running `git fetch sandbox/<name>`) may pass through to the
        // directories they own; nobody may list or read the rest.
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o711)
            .create(dir.join("sandboxes"))
            .map_err(io("create", dir))?;
        {
            use std::os::unix::fs::{MetadataExt, PermissionsExt};
            // Helpers running as an owner's or a sandbox's uid must pass
            // through the state directory to the directories they own.
            let meta = fs::metadata(dir).map_err(io("read", dir))?;
            if meta.mode() & 0o011 != 0o011 && meta.uid() == nix::unistd::Uid::effective().as_raw()
            {
                let mode = (meta.mode() & 0o7777) | 0o011;
                fs::set_permissions(dir, fs::Permissions::from_mode(mode))
                    .map_err(io("set permissions of", dir))?;
            }
            let d = dir.join("sandboxes");
            fs::set_permissions(&d, fs::Permissions::from_mode(0o711))
                .map_err(io("set permissions of", &d))?;
        }
        let reg = Self {
            dir: dir.to_owned(),
        };
        let path = reg.file();
        let sandboxes = match fs::read(&path) {
            Ok(bytes) => parse(&path, &bytes)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io("read", &path)(e)),
        };
        Ok((reg, sandboxes))
    }

    /// The state directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The registry file.
    #[must_use]
    pub fn file(&self) -> PathBuf {
        self.dir.join(REGISTRY_FILE)
    }

    /// The directory of sandbox `name`.
    #[must_use]
    pub fn sandbox_dir(&self, name: &str) -> PathBuf {
        self.dir.join("sandboxes").join(name)
    }

    /// Names of the directories under `sandboxes/`.
    pub fn sandbox_dirs(&self) -> Vec<String> {
        fs::read_dir(self.dir.join("sandboxes"))
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Write the registry atomically.
    pub fn save<'a>(
        &self,
        sandboxes: impl IntoIterator<Item = &'a Sandbox>,
    ) -> Result<(), RegistryError> {
        /// [`RegistryFile`] as written: the records borrowed, not copied.
        #[derive(Serialize)]
        struct Written<'a> {
            schema_version: u32,
            sandboxes: Vec<&'a Sandbox>,
        }
        let file = Written {
            schema_version: SCHEMA_VERSION,
            sandboxes: sandboxes.into_iter().collect(),
        };
        let mut body = serde_json::to_vec_pretty(&file).expect("registry serializes");
        body.push(b'\n');
        Ok(atomic_write(&self.file(), &body)?)
    }

    /// Write `sandboxes/<name>/config.json` atomically, unless it holds
    /// that already (every start saves it).
    pub fn save_config(&self, sandbox: &Sandbox) -> Result<(), RegistryError> {
        let mut body = serde_json::to_vec_pretty(&sandbox.config).expect("config serializes");
        body.push(b'\n');
        let path = self.sandbox_dir(&sandbox.name).join("config.json");
        if holds(&path, &body) {
            return Ok(());
        }
        Ok(atomic_write(&path, &body)?)
    }
}

/// Whether the file at `path` (a regular file, not a link) holds exactly
/// `bytes`. Anything else there (a FIFO, which would not answer) does not.
fn holds(path: &Path, bytes: &[u8]) -> bool {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(f) = fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
    else {
        return false;
    };
    if !f.metadata().is_ok_and(|m| m.is_file()) {
        return false;
    }
    let mut held = Vec::with_capacity(bytes.len());
    f.take(bytes.len() as u64 + 1)
        .read_to_end(&mut held)
        .is_ok_and(|_| held == bytes)
}

fn parse(path: &Path, bytes: &[u8]) -> Result<Vec<Sandbox>, RegistryError> {
    // Look at the version first, so a newer format is reported as such and
    // not as corruption.
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|source| RegistryError::Corrupt {
            path: path.to_owned(),
            source,
        })?;
    let version = value
        .get("schema_version")
        .and_then(serde_json::Value::as_u64);
    match version {
        Some(v) if v == u64::from(SCHEMA_VERSION) => {}
        Some(found) => {
            return Err(RegistryError::UnknownVersion {
                path: path.to_owned(),
                found,
            });
        }
        None => {}
    }
    let file: RegistryFile =
        serde_json::from_value(value).map_err(|source| RegistryError::Corrupt {
            path: path.to_owned(),
            source,
        })?;
    Ok(file.sandboxes)
}

/// A sandbox as agentd records it in the registry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sandbox {
    /// Stable unique id (UUID v4).
    pub id: String,
    /// Unique name (see [`validate::NAME_RULE`]).
    pub name: String,
    /// Absolute path of the host repository.
    pub project_path: PathBuf,
    /// Lifecycle state.
    pub state: SandboxState,
    /// Why the sandbox is in its state; empty when there is nothing to say.
    #[serde(default)]
    pub state_reason: String,
    /// Backend running it.
    pub backend: BackendKind,
    /// Creation time.
    #[serde(with = "timestamp")]
    pub created_at: SystemTime,
    /// Last start time.
    #[serde(default, with = "timestamp::option")]
    pub started_at: Option<SystemTime>,
    /// Settings.
    pub config: SandboxConfig,
    /// Named ports.
    #[serde(default)]
    pub ports: Ports,
    /// Owner's uid.
    pub owner: u32,
    /// The host uid (and gid) its processes and files have, allocated from
    /// [`crate::auth::SANDBOX_IDS`] when agentd runs as root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Declared in agentd's configuration (cannot be destroyed over D-Bus).
    #[serde(default)]
    pub declared: bool,
    /// Creation has not finished: on restart the sandbox is rolled back.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub creating: bool,
    /// agentd stopped it because it was idle (`idle_stop_seconds`): the
    /// next exec, attach, cp or link request starts it again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub idle_stopped: bool,
    /// Time of the last sync (either direction).
    #[serde(
        default,
        with = "timestamp::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub last_sync_at: Option<SystemTime>,
    /// One line on the last sync's result.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub last_sync_result: String,
    /// What the last sync to the host held back (see
    /// [`crate::git::guard`]): `--allow-protected` brings a branch up to
    /// the tip recorded here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<keystone_agent_api::HeldBranch>,
    /// What the backend recorded while the sandbox runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<Runtime>,
}

impl Sandbox {
    /// A new record: a fresh unique id, state `created`, marked `creating`
    /// until its directories are made; no uid yet (the store gives it one).
    #[must_use]
    pub fn new(
        name: &str,
        project_path: PathBuf,
        backend: BackendKind,
        config: SandboxConfig,
        owner: u32,
    ) -> Self {
        Self {
            id: uuid::Uuid::new_v4().to_string(),
            name: name.to_owned(),
            project_path,
            state: SandboxState::Created,
            state_reason: String::new(),
            backend,
            created_at: SystemTime::now(),
            started_at: None,
            config,
            ports: Ports::new(),
            owner,
            uid: None,
            declared: false,
            creating: true,
            idle_stopped: false,
            last_sync_at: None,
            last_sync_result: String::new(),
            held: Vec::new(),
            runtime: None,
        }
    }

    /// The row `ListSandboxes` returns.
    #[must_use]
    pub fn summary(&self) -> SandboxSummary {
        SandboxSummary {
            name: self.name.clone(),
            id: self.id.clone(),
            state: self.state,
            backend: self.backend,
            project_path: self.project_path.to_string_lossy().into_owned(),
            owner: self.owner,
            created_at: micros(Some(self.created_at)),
            started_at: micros(self.started_at),
            state_reason: self.state_reason.clone(),
            declared: self.declared,
            // Not kept in the registry: the manager fills it in.
            waiting: 0,
        }
    }
}

/// RFC 3339 timestamps in JSON.
pub mod timestamp {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Serialize as RFC 3339 with microseconds.
    pub fn serialize<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_rfc3339_micros(*t))
    }

    /// Parse RFC 3339.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_rfc3339(&s).map_err(serde::de::Error::custom)
    }

    /// The same for optional timestamps (`null` = never).
    pub mod option {
        use std::time::SystemTime;

        use serde::{Deserialize, Deserializer, Serializer};

        /// Serialize as RFC 3339 or `null`.
        #[allow(clippy::ref_option, reason = "serde's `with` passes a reference")]
        pub fn serialize<S: Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
            match t {
                Some(t) => s.collect_str(&humantime::format_rfc3339_micros(*t)),
                None => s.serialize_none(),
            }
        }

        /// Parse RFC 3339 or `null`.
        pub fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<SystemTime>, D::Error> {
            Option::<String>::deserialize(d)?
                .map(|s| humantime::parse_rfc3339(&s).map_err(serde::de::Error::custom))
                .transpose()
        }
    }
}

/// What changed, for the D-Bus layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A sandbox appeared.
    Added(String),
    /// A sandbox's record changed.
    Updated(String),
    /// A sandbox is gone.
    Removed(String),
    /// Progress of a long operation (creating the workspace).
    Progress {
        /// Sandbox name.
        name: String,
        /// What is happening.
        stage: String,
        /// Units done.
        done: u64,
        /// Units in all (0 = unknown).
        total: u64,
    },
    /// A sync to the host held a branch back (newly).
    Held {
        /// Sandbox name.
        name: String,
        /// The branch and why.
        held: keystone_agent_api::HeldBranch,
    },
    /// A sync finished.
    Synced {
        /// Sandbox name.
        name: String,
        /// `to-host` or `from-host`.
        direction: &'static str,
        /// Branches that moved.
        branches: u32,
        /// Commits that came over.
        commits: u32,
    },
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use keystone_agent_api::{BackendKind, SandboxConfig, SandboxState};
    use std::time::{Duration, UNIX_EPOCH};

    /// A stopped sandbox record for tests.
    pub(crate) fn sample() -> Sandbox {
        Sandbox {
            id: "7f1c9a56-4a1e-4d5e-9d7c-2f8b1c0e3a11".into(),
            name: "demo".into(),
            project_path: "/home/alice/src/demo".into(),
            state: SandboxState::Stopped,
            state_reason: String::new(),
            backend: BackendKind::Local,
            created_at: UNIX_EPOCH + Duration::from_micros(1_780_000_000_123_456),
            started_at: None,
            config: SandboxConfig::default(),
            ports: [("web".to_owned(), 3000)].into(),
            owner: 1000,
            uid: Some(0x7000_0001),
            declared: false,
            creating: false,
            idle_stopped: false,
            last_sync_at: None,
            last_sync_result: String::new(),
            held: Vec::new(),
            runtime: None,
        }
    }

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let (reg, empty) = Registry::open(dir.path()).unwrap();
        assert!(empty.is_empty());
        reg.save([&sample()]).unwrap();
        let (_, loaded) = Registry::open(dir.path()).unwrap();
        assert_eq!(loaded, vec![sample()]);
        // No temp file is left behind.
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn checked_in_fixture_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/registry-v1.json");
        let sandboxes = parse(&path, &fs::read(&path).unwrap()).unwrap();
        assert_eq!(sandboxes.len(), 2);
        assert_eq!(sandboxes[0].name, "webapp");
        assert_eq!(sandboxes[1].state, SandboxState::Running);
        // Settings added since (disk, pids) take their defaults.
        let d = SandboxConfig::default();
        assert_eq!(
            (sandboxes[0].config.disk, sandboxes[0].config.pids),
            (d.disk, d.pids)
        );
        // Writing it back gives the same document, plus those settings.
        let again = RegistryFile {
            schema_version: SCHEMA_VERSION,
            sandboxes,
        };
        let mut v1: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        let defaults = serde_json::to_value(&d).unwrap();
        for sb in v1["sandboxes"].as_array_mut().unwrap() {
            assert!(sb["config"].get("disk").is_none(), "the fixture is older");
            let config = sb["config"].as_object_mut().unwrap();
            for (k, v) in defaults.as_object().unwrap() {
                config.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        assert_eq!(serde_json::to_value(&again).unwrap(), v1);
    }

    #[test]
    fn a_config_is_written_over_whatever_else_is_at_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let (reg, _) = Registry::open(dir.path()).unwrap();
        let sb = sample();
        let path = reg.sandbox_dir(&sb.name).join("config.json");
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let writer = reg.clone();
        std::thread::spawn(move || tx.send(writer.save_config(&sb).is_ok()));
        let saved = rx.recv_timeout(std::time::Duration::from_secs(10));
        assert_eq!(saved, Ok(true), "the save waited on a FIFO");
        assert!(fs::symlink_metadata(&path).unwrap().is_file());
        // Saved again unchanged: the file that holds it is kept.
        let ino = std::os::unix::fs::MetadataExt::ino(&fs::metadata(&path).unwrap());
        reg.save_config(&sample()).unwrap();
        assert_eq!(
            std::os::unix::fs::MetadataExt::ino(&fs::metadata(&path).unwrap()),
            ino
        );
    }

    #[test]
    fn corrupt_file_is_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(REGISTRY_FILE);
        fs::write(&path, b"{\"schema_version\": 1, \"sandboxes\": [").unwrap();
        let err = Registry::open(dir.path()).unwrap_err();
        assert!(matches!(err, RegistryError::Corrupt { .. }));
        assert!(err.to_string().contains("will not overwrite"));
        assert_eq!(
            fs::read(&path).unwrap(),
            b"{\"schema_version\": 1, \"sandboxes\": ["
        );
    }

    #[test]
    fn unknown_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join(REGISTRY_FILE),
            br#"{"schema_version": 9, "sandboxes": [], "new": 1}"#,
        )
        .unwrap();
        let err = Registry::open(dir.path()).unwrap_err();
        assert!(
            matches!(err, RegistryError::UnknownVersion { found: 9, .. }),
            "{err}"
        );
    }
}

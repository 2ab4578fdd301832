//! The registry: one JSON file per sandbox, each written atomically, plus
//! one directory per sandbox. A change of one sandbox writes its file only,
//! whatever the number of sandboxes.
//!
//! ```text
//! <state>/registry.json                  the format's version (an older agentd refuses it)
//! <state>/registry/<name>.json           the sandbox's record
//! <state>/sandboxes/<name>/config.json   copy of the sandbox's settings
//! <state>/sandboxes/<name>/workspace/    seen as /workspace inside
//! <state>/sandboxes/<name>/home/         the sandbox user's home
//! <state>/sandboxes/<name>/logs/         sandbox.log
//! <state>/sandboxes/<name>/run/          control socket
//! ```
//!
//! Format 1 kept every record in `registry.json`; such a file is split
//! into the records at the first start (see [`Registry::open`]).

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
pub const SCHEMA_VERSION: u32 = 2;

/// The format that kept every record in [`REGISTRY_FILE`]: read, split
/// into the records, never written.
const SCHEMA_V1: u32 = 1;

/// File name of the registry inside the state directory: the format's
/// version.
pub const REGISTRY_FILE: &str = "registry.json";

/// The directory of the records inside the state directory: one file per
/// sandbox, `<name>.json`.
pub const RECORDS_DIR: &str = "registry";

/// Registry failures. None of them ever overwrites the file.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The file exists but is not a registry agentd can read.
    #[error(
        "Registry {path} is corrupt: {source}. agentd will not overwrite it: restore it from \
         a backup, or move it aside (the next start then forgets the sandboxes whose records \
         it holds, and removes their directories, disk images and snapshots)"
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
    /// The version file cannot be read, and records are there.
    #[error(
        "Registry version file {path} is corrupt: {source}. The sandboxes' records are in \
         registry/ beside it: remove the file, and agentd writes it again. (If it was of \
         format 1, one file with every record, those records may be incomplete: restore it \
         from a backup instead.)"
    )]
    CorruptVersion {
        /// The version file.
        path: PathBuf,
        /// What the parser said.
        #[source]
        source: serde_json::Error,
    },
    /// The version file says the records are in a directory that is not
    /// there.
    #[error(
        "Registry {path} says the sandboxes' records are in {records}, which is missing: \
         restore that directory. (Removing {path} starts with no sandboxes: the next start \
         then removes the directories, disk images and snapshots of every sandbox.)"
    )]
    RecordsMissing {
        /// The version file.
        path: PathBuf,
        /// The directory of the records.
        records: PathBuf,
    },
    /// A registry of format 1 where a record of format 2 names a sandbox
    /// it does not, whose directory is there: an older file restored over
    /// a newer registry.
    #[error(
        "Registry {path} is of format 1 and does not have sandbox '{name}', whose record \
         {record} and directory are there: was an older registry.json put back? agentd will \
         not split it over newer records: move it out of the state directory to keep the \
         records, or move {record} out of registry/ to go back to it"
    )]
    Older {
        /// The format-1 file.
        path: PathBuf,
        /// The sandbox it does not have.
        name: String,
        /// That sandbox's record.
        record: PathBuf,
    },
    /// A record is not in the file of its sandbox's name.
    #[error(
        "Registry record {path} holds sandbox '{name}'; agentd will not overwrite it. If \
         registry/{name}.json is not there, rename it to that; otherwise move it out of \
         registry/ (the next start then forgets what it held)"
    )]
    Misplaced {
        /// The record's file.
        path: PathBuf,
        /// The name in it.
        name: String,
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

/// [`REGISTRY_FILE`] in format 1: every record.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RegistryFile {
    schema_version: u32,
    sandboxes: Vec<Sandbox>,
}

/// [`REGISTRY_FILE`] now: the version, and where the records are.
#[derive(Debug, Serialize)]
struct Marker {
    schema_version: u32,
    records: &'static str,
}

/// A record as written: the record borrowed, not copied.
#[derive(Debug, Serialize)]
struct RecordOut<'a> {
    schema_version: u32,
    sandbox: &'a Sandbox,
}

/// A record as read (its version checked before).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordIn {
    #[serde(rename = "schema_version")]
    _version: u32,
    sandbox: Sandbox,
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
        let records = reg.records_dir();
        let path = reg.file();
        let sandboxes = match fs::read(&path) {
            Ok(bytes) => match version(&path, &bytes) {
                Ok(SCHEMA_V1) => {
                    let sandboxes = parse(&path, &bytes)?;
                    reg.records_dir_made()?;
                    reg.split(&path, &sandboxes)?;
                    sandboxes
                }
                // Never made here: an empty one would read as no sandboxes
                // at the next start, and that start would remove them all.
                Ok(_) if fs::symlink_metadata(&records).is_err() => {
                    return Err(RegistryError::RecordsMissing { path, records });
                }
                Ok(_) => {
                    reg.records_dir_made()?;
                    reg.load_records()?
                }
                Err(RegistryError::Corrupt { source, .. }) if reg.has_records() => {
                    return Err(RegistryError::CorruptVersion { path, source });
                }
                Err(e) => return Err(e),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                reg.records_dir_made()?;
                let sandboxes = reg.load_records()?;
                reg.write_marker()?;
                sandboxes
            }
            Err(e) => return Err(io("read", &path)(e)),
        };
        Ok((reg, sandboxes))
    }

    /// Make [`RECORDS_DIR`] (mode 0700) unless it is there; refuse one
    /// that is not a directory of agentd's user.
    fn records_dir_made(&self) -> Result<(), RegistryError> {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let records = self.records_dir();
        match fs::DirBuilder::new().mode(0o700).create(&records) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(io("create", &records)(e));
            }
            _ => {}
        }
        let meta = fs::symlink_metadata(&records).map_err(io("read", &records))?;
        if !meta.is_dir() || meta.uid() != nix::unistd::Uid::effective().as_raw() {
            return Err(io("use", &records)(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "not a directory of agentd's user",
            )));
        }
        fs::set_permissions(&records, fs::Permissions::from_mode(0o700))
            .map_err(io("set permissions of", &records))
    }

    /// Format 1 to this one: every record into its own file (those of an
    /// earlier split that did not finish are replaced, any other removed),
    /// then the version. Until the version is written, the old file is
    /// what a start reads.
    fn split(&self, path: &Path, sandboxes: &[Sandbox]) -> Result<(), RegistryError> {
        // A record it does not have, of a sandbox whose directory is there,
        // is newer than the file: never removed for it.
        for (name, record) in self.record_files()? {
            if !sandboxes.iter().any(|s| s.name == name) && self.sandbox_dir(&name).exists() {
                return Err(RegistryError::Older {
                    path: path.to_owned(),
                    name,
                    record,
                });
            }
        }
        self.save_all(sandboxes)?;
        self.write_marker()?;
        tracing::info!(
            sandboxes = sandboxes.len(),
            "the registry now keeps one file per sandbox, in {}",
            self.records_dir().display()
        );
        Ok(())
    }

    fn write_marker(&self) -> Result<(), RegistryError> {
        let marker = Marker {
            schema_version: SCHEMA_VERSION,
            records: "one file per sandbox in registry/",
        };
        let mut body = serde_json::to_vec_pretty(&marker).expect("the marker serializes");
        body.push(b'\n');
        Ok(atomic_write(&self.file(), &body)?)
    }

    /// Whether [`RECORDS_DIR`] can be read and has a record file.
    fn has_records(&self) -> bool {
        self.record_files().is_ok_and(|f| !f.is_empty())
    }

    /// The record files in [`RECORDS_DIR`] (`*.json`, not dot files), with
    /// the sandbox name each is the file of; any other file there is not
    /// agentd's. Temporary files that a write of a process no longer
    /// running left half-made are removed.
    fn record_files(&self) -> Result<Vec<(String, PathBuf)>, RegistryError> {
        let dir = self.records_dir();
        let mut files = Vec::new();
        for entry in fs::read_dir(&dir).map_err(io("read", &dir))? {
            let entry = entry.map_err(io("read", &dir))?;
            let path = entry.path();
            let file = entry.file_name();
            let file = file.to_string_lossy();
            if file.starts_with('.') {
                // `.<name>.tmp.<pid>.<n>` (`fsutil::atomic_write`).
                let writer = file.rsplit('.').nth(1).and_then(|p| p.parse::<i32>().ok());
                let gone = |pid: i32| {
                    u32::try_from(pid).ok() != Some(std::process::id())
                        && nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
                            == Err(nix::errno::Errno::ESRCH)
                };
                if file.contains(".tmp.") && writer.is_some_and(|pid| pid > 0 && gone(pid)) {
                    let _ = fs::remove_file(&path);
                }
            } else if let Some(name) = file.strip_suffix(".json") {
                files.push((name.to_owned(), path));
            }
        }
        Ok(files)
    }

    /// Every record in [`RECORDS_DIR`], by name. A record that cannot be
    /// read stops everything, and stays as it is.
    fn load_records(&self) -> Result<Vec<Sandbox>, RegistryError> {
        let mut sandboxes = Vec::new();
        for (name, path) in self.record_files()? {
            let sb = parse_record(&path, &read_record(&path)?)?;
            if sb.name != name {
                return Err(RegistryError::Misplaced {
                    path,
                    name: sb.name,
                });
            }
            sandboxes.push(sb);
        }
        sandboxes.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(sandboxes)
    }

    /// The state directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The registry file (the format's version).
    #[must_use]
    pub fn file(&self) -> PathBuf {
        self.dir.join(REGISTRY_FILE)
    }

    /// The directory of the records.
    #[must_use]
    pub fn records_dir(&self) -> PathBuf {
        self.dir.join(RECORDS_DIR)
    }

    /// The record file of sandbox `name`.
    #[must_use]
    pub fn record(&self, name: &str) -> PathBuf {
        self.records_dir().join(format!("{name}.json"))
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

    /// Write `sandbox`'s record atomically and durably.
    ///
    /// # Errors
    /// The write failed; the record on disk is the one before.
    pub fn save(&self, sandbox: &Sandbox) -> Result<(), RegistryError> {
        let record = RecordOut {
            schema_version: SCHEMA_VERSION,
            sandbox,
        };
        let mut body = serde_json::to_vec_pretty(&record).expect("a record serializes");
        body.push(b'\n');
        Ok(atomic_write(&self.record(&sandbox.name), &body)?)
    }

    /// Write every record of `sandboxes` and remove any other.
    ///
    /// # Errors
    /// The first write or removal that failed.
    pub fn save_all<'a>(
        &self,
        sandboxes: impl IntoIterator<Item = &'a Sandbox>,
    ) -> Result<(), RegistryError> {
        let mut kept = std::collections::BTreeSet::new();
        for sb in sandboxes {
            self.save(sb)?;
            kept.insert(sb.name.as_str());
        }
        let mut removed = false;
        for (name, path) in self.record_files()? {
            if !kept.contains(name.as_str()) {
                fs::remove_file(&path).map_err(io("remove", &path))?;
                removed = true;
            }
        }
        if removed {
            crate::fsutil::sync_dir(&self.records_dir())?;
        }
        Ok(())
    }

    /// Remove sandbox `name`'s record, durably.
    ///
    /// # Errors
    /// The removal failed.
    pub fn remove(&self, name: &str) -> Result<(), RegistryError> {
        let path = self.record(name);
        match fs::remove_file(&path) {
            Ok(()) => Ok(crate::fsutil::sync_dir(&self.records_dir())?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("remove", &path)(e)),
        }
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
    let Ok(f) = crate::fsutil::open_regular(path) else {
        return false;
    };
    let mut held = Vec::with_capacity(bytes.len());
    f.take(bytes.len() as u64 + 1)
        .read_to_end(&mut held)
        .is_ok_and(|_| held == bytes)
}

fn corrupt(path: &Path) -> impl FnOnce(serde_json::Error) -> RegistryError + '_ {
    move |source| RegistryError::Corrupt {
        path: path.to_owned(),
        source,
    }
}

/// The format of the registry file or record at `path`, looked at first
/// so that a newer one is reported as such and not as corruption: 1 or
/// [`SCHEMA_VERSION`] (1 when it says none: parsing it as format 1 then
/// says what is missing).
fn version(path: &Path, bytes: &[u8]) -> Result<u32, RegistryError> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(corrupt(path))?;
    match value
        .get("schema_version")
        .and_then(serde_json::Value::as_u64)
    {
        None => Ok(SCHEMA_V1),
        Some(v) if v == u64::from(SCHEMA_V1) => Ok(SCHEMA_V1),
        Some(v) if v == u64::from(SCHEMA_VERSION) => Ok(SCHEMA_VERSION),
        Some(found) => Err(RegistryError::UnknownVersion {
            path: path.to_owned(),
            found,
        }),
    }
}

/// A registry file of format 1: every record.
fn parse(path: &Path, bytes: &[u8]) -> Result<Vec<Sandbox>, RegistryError> {
    let file: RegistryFile = serde_json::from_slice(bytes).map_err(corrupt(path))?;
    Ok(file.sandboxes)
}

/// Largest record file read: a record's texts are cut short, so one is a
/// few KiB.
const RECORD_MAX: u64 = 1 << 20;

/// The bytes of the record file at `path`: a regular file (never through a
/// link, never waiting on a FIFO), at most [`RECORD_MAX`].
fn read_record(path: &Path) -> Result<Vec<u8>, RegistryError> {
    use std::io::Read;
    let f = crate::fsutil::open_regular(path).map_err(io("read", path))?;
    if f.metadata().map_err(io("read", path))?.len() > RECORD_MAX {
        return Err(io("read", path)(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a record is at most {} KiB", RECORD_MAX >> 10),
        )));
    }
    let mut bytes = Vec::new();
    f.take(RECORD_MAX)
        .read_to_end(&mut bytes)
        .map_err(io("read", path))?;
    Ok(bytes)
}

/// One record file (only of this format: records came with it).
fn parse_record(path: &Path, bytes: &[u8]) -> Result<Sandbox, RegistryError> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(corrupt(path))?;
    match value
        .get("schema_version")
        .and_then(serde_json::Value::as_u64)
    {
        Some(v) if v == u64::from(SCHEMA_VERSION) => {}
        Some(found) if found > u64::from(SCHEMA_VERSION) => {
            return Err(RegistryError::UnknownVersion {
                path: path.to_owned(),
                found,
            });
        }
        _ => {
            use serde::de::Error as _;
            return Err(corrupt(path)(serde_json::Error::custom(format!(
                "a record has \"schema_version\": {SCHEMA_VERSION}"
            ))));
        }
    }
    let record: RecordIn = serde_json::from_value(value).map_err(corrupt(path))?;
    Ok(record.sandbox)
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

pub mod timestamp;

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
pub(crate) mod tests;

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

use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::sandbox::Sandbox;

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
        let file = RegistryFile {
            schema_version: SCHEMA_VERSION,
            sandboxes: sandboxes.into_iter().cloned().collect(),
        };
        let mut body = serde_json::to_vec_pretty(&file).expect("registry serializes");
        body.push(b'\n');
        atomic_write(&self.file(), &body)
    }

    /// Write `sandboxes/<name>/config.json` atomically.
    pub fn save_config(&self, sandbox: &Sandbox) -> Result<(), RegistryError> {
        let mut body = serde_json::to_vec_pretty(&sandbox.config).expect("config serializes");
        body.push(b'\n');
        atomic_write(&self.sandbox_dir(&sandbox.name).join("config.json"), &body)
    }
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

/// Append `value` as one JSON line to the append-only log at `path` (made
/// 0600, never through a symlink).
pub fn append_json_line(path: &Path, value: &impl Serialize) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(value).expect("a log entry serializes");
    line.push(b'\n');
    fs::OpenOptions::new()
        .create(true)
        .append(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .mode(0o600)
        .open(path)?
        .write_all(&line)
}

/// The JSON lines of the log at `path` that parse as `T` (none when it
/// does not exist).
pub fn read_json_lines<T: serde::de::DeserializeOwned>(path: &Path) -> std::io::Result<Vec<T>> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// Replace `path` with `bytes` so that a crash at any point leaves either the
/// old or the new content: temp file, fsync, rename, fsync the directory.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> Result<(), RegistryError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(io("create", &tmp))?;
    f.write_all(bytes).map_err(io("write", &tmp))?;
    f.sync_all().map_err(io("fsync", &tmp))?;
    drop(f);
    fs::rename(&tmp, path).map_err(io("rename onto", path))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("fsync", dir))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use keystone_agent_api::{BackendKind, SandboxConfig, SandboxState};
    use std::time::{Duration, UNIX_EPOCH};

    fn sample() -> Sandbox {
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
            last_sync_at: None,
            last_sync_result: String::new(),
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
        for sb in v1["sandboxes"].as_array_mut().unwrap() {
            assert!(sb["config"].get("disk").is_none(), "the fixture is older");
            sb["config"]["disk"] = d.disk.into();
            sb["config"]["pids"] = d.pids.into();
            sb["config"]["egress"] = d.egress.as_str().into();
            sb["config"]["egress_allow"] = serde_json::json!([]);
            sb["config"]["egress_deny"] = serde_json::json!([]);
        }
        assert_eq!(serde_json::to_value(&again).unwrap(), v1);
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

//! Pausing a sandbox: its freezer group frozen and thawed (v1
//! `freezer.state`, v2 `cgroup.freeze`).

use std::fs;
use std::path::PathBuf;

use super::{Cgroups, Place};

/// Why a sandbox could not be frozen or thawed.
#[derive(Debug, thiserror::Error)]
pub enum FreezeError {
    /// agentd has no group to freeze the sandbox with.
    #[error("local sandboxes cannot be paused here: {0}")]
    Unavailable(String),
    /// The sandbox's group could not be written or read.
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        /// `write`, `read`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// The kernel had not settled the group within the limit.
    #[error("the group {} was still {state} after {limit:?}", path.display())]
    Unsettled {
        /// The group.
        path: PathBuf,
        /// What its state file said last.
        state: String,
        /// How long agentd waited.
        limit: std::time::Duration,
    },
}

impl Cgroups {
    /// Freeze (`frozen`) or thaw every process of sandbox `name`, and wait
    /// up to `limit` for the kernel to have done it.
    ///
    /// # Errors
    /// No freezer here, the group cannot be written, or it did not settle.
    pub fn freeze(
        &self,
        name: &str,
        frozen: bool,
        limit: std::time::Duration,
    ) -> Result<(), FreezeError> {
        let place = self
            .freezer
            .as_ref()
            .map_err(|e| FreezeError::Unavailable(e.clone()))?;
        let dir = self.group(place, name);
        let (file, value, state_file, settled) = match (place, frozen) {
            (Place::V1(_), true) => ("freezer.state", "FROZEN", "freezer.state", "FROZEN"),
            (Place::V1(_), false) => ("freezer.state", "THAWED", "freezer.state", "THAWED"),
            (Place::V2(_), true) => ("cgroup.freeze", "1", "cgroup.events", "frozen 1"),
            (Place::V2(_), false) => ("cgroup.freeze", "0", "cgroup.events", "frozen 0"),
        };
        let path = dir.join(file);
        fs::write(&path, value).map_err(|source| FreezeError::Io {
            what: "write",
            path,
            source,
        })?;
        let state_path = dir.join(state_file);
        let deadline = std::time::Instant::now() + limit;
        let mut tries = 0u32;
        loop {
            let state = fs::read_to_string(&state_path).map_err(|source| FreezeError::Io {
                what: "read",
                path: state_path.clone(),
                source,
            })?;
            if state.lines().any(|l| l.trim() == settled) {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                return Err(FreezeError::Unsettled {
                    path: dir,
                    state: state.trim().replace('\n', ", "),
                    limit,
                });
            }
            // A task in an uninterruptible sleep (disk I/O under load) can
            // hold a v1 group in FREEZING; asking again every 100 ms freezes
            // what has woken since.
            tries += 1;
            if tries % 50 == 0 {
                let _ = fs::write(dir.join(file), value);
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
}

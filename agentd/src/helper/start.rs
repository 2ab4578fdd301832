//! What a process of agentd's own binary (a helper, a sandbox's
//! supervisor) does to itself first, before anything else runs in it:
//! take its ids, lower its descriptor limit, end with agentd.
//!
//! A `pre_exec` hook would do the same between fork and exec, but a hook
//! makes the standard library fork agentd: the kernel copies agentd's page
//! tables, then throws the copy away at exec, and agentd's threads fault on
//! every page they write meanwhile (0.7 to 1 ms a process, measured). With
//! no hook the process is made by `posix_spawn` (a `vfork`), and it applies
//! [`Start`], passed in [`START_ENV`], from `agentd::run_helper`.
//!
//! Until then the process runs only the loader and the runtime's start-up,
//! with agentd's ids and the environment agentd gave it; nothing it reads
//! comes from the sandbox or the user it acts for.

use serde::{Deserialize, Serialize};

/// The environment variable that carries a process's [`Start`] (taken out
/// of the environment once applied).
pub const START_ENV: &str = "KEYSTONE_AGENTD_START";

/// What a process started from agentd's binary applies to itself first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Start {
    /// The ids to take (agentd as root): uid, gid and supplementary groups,
    /// all of them, real, effective and saved.
    #[serde(default)]
    pub ids: Option<Ids>,
    /// The soft descriptor limit agentd started with, to lower to (0:
    /// keep the one inherited).
    #[serde(default)]
    pub nofile: u64,
    /// agentd's pid: be killed when it ends, and do not run at all when it
    /// already has. None: outlive agentd (a sandbox's supervisor).
    #[serde(default)]
    pub parent: Option<u32>,
}

/// A uid, a gid and supplementary groups.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ids {
    /// The uid.
    pub uid: u32,
    /// The gid.
    pub gid: u32,
    /// The supplementary groups.
    pub groups: Vec<u32>,
}

impl Start {
    /// For a process that ends with this agentd (`parent`), or outlives it
    /// (`None`), with the descriptor limit agentd started with.
    #[must_use]
    pub fn new(parent: Option<u32>) -> Self {
        Self {
            ids: None,
            nofile: crate::budget::inherited_nofile(),
            parent,
        }
    }

    /// Have the process `cmd` starts apply this first.
    pub fn pass(&self, cmd: &mut tokio::process::Command) {
        let json = serde_json::to_string(self).expect("a start serializes");
        cmd.env(START_ENV, json);
    }

    /// Apply what [`START_ENV`] says, if it is set, and take it out of the
    /// environment. Call first in `main`, while the process has one thread.
    ///
    /// # Errors
    /// What cannot be applied (the process must not go on).
    pub fn apply_passed() -> Result<(), String> {
        let Some(raw) = std::env::var_os(START_ENV) else {
            return Ok(());
        };
        // SAFETY: called first in main, before any other thread exists, so
        // nothing reads the environment meanwhile.
        unsafe { std::env::remove_var(START_ENV) };
        let start: Self = serde_json::from_str(&raw.to_string_lossy())
            .map_err(|e| format!("{START_ENV} is not a start: {e}"))?;
        start.apply()
    }

    /// Apply this start to the calling process: the limit, then the ids
    /// (groups, gid, uid), then the end with agentd (a change of ids
    /// clears the parent-death signal, so it comes last).
    ///
    /// # Errors
    /// What cannot be applied.
    pub fn apply(&self) -> Result<(), String> {
        crate::budget::lower_nofile(self.nofile)
            .map_err(|e| format!("cannot lower the descriptor limit: {e}"))?;
        if let Some(ids) = &self.ids {
            crate::caps::take_ids(ids.uid, ids.gid, &ids.groups)
                .map_err(|(what, e)| format!("{what}: {e}"))?;
        }
        if let Some(parent) = self.parent {
            crate::caps::end_with_parent(parent).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_reads_back_as_written_and_an_empty_one_changes_nothing() {
        let s = Start {
            ids: Some(Ids {
                uid: 1000,
                gid: 100,
                groups: vec![100, 27],
            }),
            nofile: 1024,
            parent: Some(42),
        };
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<Start>(&json).unwrap(), s);
        assert_eq!(
            serde_json::from_str::<Start>("{}").unwrap(),
            Start::default()
        );
        let before = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE);
        Start::default().apply().unwrap();
        assert_eq!(
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE),
            before
        );
    }
}

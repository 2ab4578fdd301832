//! Resource limits through cgroup v2.
//!
//! agentd needs a delegated cgroup v2 subtree (systemd `Delegate=yes`, which
//! the NixOS module sets). It moves itself into a `agentd` leaf, enables the
//! `memory` and `cpu` controllers for its subtree and gives each local
//! sandbox a `sandbox-<name>` child with `memory.max` and `cpu.max`. Where
//! that is impossible (cgroup v1 or hybrid hosts, no delegation, missing
//! controllers) sandboxes run without limits and every start says so in the
//! log and in `agentctl status`.

use std::fs;
use std::path::{Path, PathBuf};

/// What agentd can do with cgroups on this host.
#[derive(Debug, Clone)]
pub enum Cgroups {
    /// Limits are enforced under this directory.
    Enforced(PathBuf),
    /// Limits are not enforced, for this reason.
    Unavailable(String),
}

impl Cgroups {
    /// Probe the host and prepare agentd's subtree.
    #[must_use]
    pub fn detect() -> Self {
        match Self::prepare(Path::new("/sys/fs/cgroup")) {
            Ok(base) => Self::Enforced(base),
            Err(reason) => Self::Unavailable(reason),
        }
    }

    fn prepare(mount: &Path) -> Result<PathBuf, String> {
        if !mount.join("cgroup.controllers").exists() {
            return Err(format!(
                "{} is not a cgroup v2 hierarchy (cgroup v1 or hybrid host)",
                mount.display()
            ));
        }
        let own = fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
        let rel = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .ok_or("agentd is not in a cgroup v2 group")?;
        let base = mount.join(rel.trim_start_matches('/'));
        let available = fs::read_to_string(base.join("cgroup.controllers")).unwrap_or_default();
        for ctl in ["memory", "cpu"] {
            if !available.split_whitespace().any(|c| c == ctl) {
                return Err(format!(
                    "the {ctl} controller is not delegated to {} (run agentd with Delegate=yes)",
                    base.display()
                ));
            }
        }
        // A cgroup with processes cannot hand controllers to children: move
        // agentd into a leaf of its own first.
        let leaf = base.join("agentd");
        fs::create_dir_all(&leaf).map_err(|e| format!("cannot create {}: {e}", leaf.display()))?;
        fs::write(leaf.join("cgroup.procs"), std::process::id().to_string())
            .map_err(|e| format!("cannot move agentd into {}: {e}", leaf.display()))?;
        fs::write(base.join("cgroup.subtree_control"), "+memory +cpu")
            .map_err(|e| format!("cannot enable memory and cpu in {}: {e}", base.display()))?;
        Ok(base)
    }

    /// Create the cgroup of sandbox `name` with its limits. Returns the
    /// directory (for the sandbox to join) and a description of the limits.
    #[must_use]
    pub fn create(&self, name: &str, memory_mib: u32, vcpus: u32) -> (Option<PathBuf>, String) {
        match self {
            Self::Unavailable(reason) => (None, format!("not enforced: {reason}")),
            Self::Enforced(base) => {
                let dir = base.join(format!("sandbox-{name}"));
                let setup = || -> std::io::Result<()> {
                    fs::create_dir_all(&dir)?;
                    fs::write(
                        dir.join("memory.max"),
                        (u64::from(memory_mib) << 20).to_string(),
                    )?;
                    fs::write(
                        dir.join("cpu.max"),
                        format!("{} 100000", u64::from(vcpus) * 100_000),
                    )
                };
                match setup() {
                    Ok(()) => (
                        Some(dir),
                        format!("memory {memory_mib} MiB, {vcpus} CPUs (cgroup v2)"),
                    ),
                    Err(e) => (
                        None,
                        format!("not enforced: cannot set up {}: {e}", dir.display()),
                    ),
                }
            }
        }
    }

    /// Remove the (empty) cgroup of sandbox `name`.
    pub fn remove(&self, name: &str) {
        if let Self::Enforced(base) = self {
            let _ = fs::remove_dir(base.join(format!("sandbox-{name}")));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_non_v2_mount_is_reported_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = Cgroups::prepare(dir.path()).unwrap_err();
        assert!(err.contains("not a cgroup v2 hierarchy"), "{err}");
        let (cg, limits) = Cgroups::Unavailable(err).create("x", 1024, 1);
        assert!(cg.is_none());
        assert!(limits.starts_with("not enforced"));
    }
}

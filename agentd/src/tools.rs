//! The tools agentd gives every local sandbox, read-only at `/run/keystone`:
//! the Zellij binary (`bin/zellij`), agentd's Zellij configuration and
//! default layout (`share/zellij/`), and the agent toolbox's launchers
//! (`bin/claude`, …; the packages are mounted at `agents/`, see
//! [`crate::toolbox`]). agentd assembles them in its state directory
//! (`guest/`) at startup.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::fsutil::{WriteError, atomic_write};

/// The Zellij release agentd's sessions are made for (client and server
/// must be the same version).
pub const ZELLIJ_VERSION: &str = "0.45";

/// Zellij release that `tests/install-zellij.sh` builds.
pub const ZELLIJ_PINNED: &str = "0.45.1";

const CONFIG_KDL: &str = include_str!("../share/zellij/config.kdl");
const LAYOUT_KDL: &str = include_str!("../share/zellij/layout.kdl");

/// The cache of `tests/install-tools.sh`, the guest image and the agent
/// toolbox: `$KEYSTONE_CACHE_DIR`, else `$CACHE_DIRECTORY` (systemd's
/// `CacheDirectory=`, the first one), else `$XDG_CACHE_HOME/keystone-agent`,
/// else `~/.cache/keystone-agent`.
#[must_use]
pub fn cache_dir() -> Option<PathBuf> {
    std::env::var_os("KEYSTONE_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var("CACHE_DIRECTORY")
                .ok()
                .and_then(|d| d.split(':').next().map(PathBuf::from))
                .filter(|d| d.is_absolute())
        })
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("keystone-agent"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/keystone-agent"))
        })
}

/// Where `tests/install-zellij.sh` caches its build.
fn cached_zellij() -> Option<PathBuf> {
    let cache = cache_dir()?;
    Some(cache.join(format!("zellij-{ZELLIJ_PINNED}/bin/zellij")))
}

/// Why sessions are not available: no usable Zellij.
#[derive(Debug, thiserror::Error)]
pub enum ZellijError {
    /// None configured, on `PATH` or in the cache.
    #[error(
        "no zellij found on PATH or in the cache; install Zellij {ZELLIJ_PINNED} with \
         `tests/install-zellij.sh` and restart agentd (or pass --zellij PATH)"
    )]
    NotFound,
    /// The binary does not run.
    #[error("cannot run {} --version: {source}", path.display())]
    Run {
        /// The binary.
        path: PathBuf,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// None yet, but `tests/install-zellij.sh` is building it.
    #[error(
        "Zellij {ZELLIJ_PINNED} is still being built (started {} ago, about {} left; log: {log}); \
         `agentctl attach` works once it is done, and `agentctl exec -t SANDBOX -- bash` gives a shell meanwhile",
        minutes(*elapsed_secs / 60),
        minutes(expected_secs.saturating_sub(*elapsed_secs).max(60).div_ceil(60))
    )]
    Building {
        /// Seconds since the build started.
        elapsed_secs: u64,
        /// How long such a build takes.
        expected_secs: u64,
        /// Where its output goes.
        log: String,
    },
    /// The binary is another release.
    #[error(
        "{} is '{version}', but sessions need Zellij {ZELLIJ_VERSION}.x; install it with \
         `tests/install-zellij.sh` and pass --zellij PATH",
        path.display()
    )]
    Version {
        /// The binary.
        path: PathBuf,
        /// What `--version` printed.
        version: String,
    },
}

fn minutes(m: u64) -> String {
    if m == 1 {
        "1 minute".into()
    } else {
        format!("{m} minutes")
    }
}

/// The build of `tests/install-tools.sh` for `tool-version` in progress:
/// its marker (`<cache>/<tool>-<version>.building`: `started=`, `expected=`,
/// `pid=`, `log=` lines) names a process that still runs.
#[must_use]
pub fn build_in_progress(tool_version: &str) -> Option<ZellijError> {
    let marker = cache_dir()?.join(format!("{tool_version}.building"));
    let text = std::fs::read_to_string(marker).ok()?;
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix('='))
            .map(str::to_owned)
    };
    let pid: i32 = field("pid")?.parse().ok()?;
    if pid <= 0 || nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err() {
        return None;
    }
    let started: u64 = field("started")?.parse().ok()?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Some(ZellijError::Building {
        elapsed_secs: now.saturating_sub(started),
        expected_secs: field("expected")
            .and_then(|e| e.parse().ok())
            .unwrap_or(1200),
        log: field("log")
            .filter(|l| !l.is_empty())
            .unwrap_or_else(|| "-".into()),
    })
}

/// [`find_zellij`], or, when there is none yet, the build in progress.
pub fn find_zellij_or_build(configured: Option<&Path>) -> Result<PathBuf, ZellijError> {
    match find_zellij(configured) {
        Err(ZellijError::NotFound) => {
            Err(build_in_progress(&format!("zellij-{ZELLIJ_PINNED}"))
                .unwrap_or(ZellijError::NotFound))
        }
        other => other,
    }
}

/// The Zellij binary to give sandboxes: `configured`, else `zellij` on
/// `PATH`, else the cached build of `tests/install-zellij.sh`. Checks that
/// it runs and is the right release.
pub fn find_zellij(configured: Option<&Path>) -> Result<PathBuf, ZellijError> {
    let path = match configured {
        Some(p) => p.to_owned(),
        None => std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .map(|d| d.join("zellij"))
            .chain(cached_zellij())
            .find(|p| p.is_file())
            .ok_or(ZellijError::NotFound)?,
    };
    let mut version = std::process::Command::new(&path);
    let out = match crate::child::end_with_us(&mut version)
        .arg("--version")
        .output()
    {
        Ok(out) => out,
        Err(source) => return Err(ZellijError::Run { path, source }),
    };
    let version = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !version.starts_with(&format!("zellij {ZELLIJ_VERSION}.")) {
        return Err(ZellijError::Version { path, version });
    }
    Ok(path)
}

/// Assemble `<state>/guest` (shown at `/run/keystone` in sandboxes):
/// `share/zellij/{config.kdl,layout.kdl}` always, `bin/zellij` from
/// `zellij` when there is one. Returns the directory.
pub fn install(state_dir: &Path, zellij: Option<&Path>) -> Result<PathBuf, WriteError> {
    let dir = state_dir.join("guest");
    let share = dir.join("share/zellij");
    let bin = dir.join("bin");
    // `agents/`: where the agent toolbox is mounted (crate::toolbox).
    for d in [&dir, &dir.join("share"), &share, &bin, &dir.join("agents")] {
        fs::create_dir_all(d).map_err(WriteError::of("create", d))?;
        // Readable by every sandbox uid (root's sandboxes run as nobody).
        fs::set_permissions(d, fs::Permissions::from_mode(0o755))
            .map_err(WriteError::of("set the mode of", d))?;
    }
    for (name, text) in [("config.kdl", CONFIG_KDL), ("layout.kdl", LAYOUT_KDL)] {
        let path = share.join(name);
        if fs::read_to_string(&path).ok().as_deref() != Some(text) {
            atomic_write(&path, text.as_bytes())?;
        }
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644))
            .map_err(WriteError::of("set the mode of", &path))?;
    }
    let target = bin.join("zellij");
    match zellij {
        Some(src) => {
            if !same_file(src, &target) {
                // A copy, not a link: the sandbox's binary must not change
                // under a running session, whatever happens to the source.
                let tmp = bin.join(".zellij.tmp");
                fs::copy(src, &tmp)
                    .and_then(|_| fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755)))
                    .and_then(|()| fs::rename(&tmp, &target))
                    .map_err(WriteError::of("copy Zellij to", &target))?;
            }
        }
        None => {
            let _ = fs::remove_file(&target);
        }
    }
    Ok(dir)
}

/// Whether `a` and `b` have the same size and contents.
fn same_file(a: &Path, b: &Path) -> bool {
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(ma), Ok(mb)) if ma.len() == mb.len() => {
            matches!((fs::read(a), fs::read(b)), (Ok(x), Ok(y)) if x == y)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn install_writes_the_share_and_copies_the_binary_once() {
        let state = tempfile::tempdir().unwrap();
        let src = state.path().join("zellij-src");
        fs::write(&src, b"#!/bin/sh\necho zellij 0.45.1\n").unwrap();
        let dir = install(state.path(), Some(&src)).unwrap();
        assert_eq!(
            fs::read_to_string(dir.join("share/zellij/config.kdl")).unwrap(),
            CONFIG_KDL
        );
        let bin = dir.join("bin/zellij");
        assert_eq!(fs::read(&bin).unwrap(), fs::read(&src).unwrap());
        assert_eq!(
            fs::metadata(&bin).unwrap().permissions().mode() & 0o777,
            0o755
        );
        // Unchanged source: the copy stays (same inode).
        let ino = std::os::unix::fs::MetadataExt::ino(&fs::metadata(&bin).unwrap());
        install(state.path(), Some(&src)).unwrap();
        assert_eq!(
            std::os::unix::fs::MetadataExt::ino(&fs::metadata(&bin).unwrap()),
            ino
        );
        // No zellij: no binary inside.
        install(state.path(), None).unwrap();
        assert!(!bin.exists());
    }

    #[test]
    fn a_zellij_of_another_release_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("zellij");
        fs::write(&fake, "#!/bin/sh\necho zellij 0.44.0\n").unwrap();
        fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).unwrap();
        let err = find_zellij(Some(&fake)).unwrap_err().to_string();
        assert!(err.contains("0.44.0") && err.contains("0.45"), "{err}");
        fs::write(&fake, "#!/bin/sh\necho zellij 0.45.1\n").unwrap();
        assert_eq!(find_zellij(Some(&fake)).unwrap(), fake);
    }
}

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
        "Zellij {ZELLIJ_PINNED} is still being built (started {} ago, {}about {} left; log: {log}); \
         `agentctl attach` works once it is done, and `agentctl exec -t SANDBOX -- bash` gives a shell meanwhile",
        minutes(*elapsed_secs / 60),
        units.map_or_else(String::new, |(done, total)| format!("{done} of {total} units compiled, ")),
        minutes((*left_secs).max(60).div_ceil(60))
    )]
    Building {
        /// Seconds since the build started.
        elapsed_secs: u64,
        /// About how many seconds it has left ([`build_left`]).
        left_secs: u64,
        /// cargo's units compiled, out of all, once it said.
        units: Option<(u64, u64)>,
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

/// How far a build of `tests/install-tools.sh` is, from its marker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BuildProgress {
    /// cargo's units compiled.
    pub done: u64,
    /// All units of the build.
    pub total: u64,
    /// Seconds after the start when `done` was reached.
    pub reached_secs: u64,
}

/// About how many seconds a build has left, `elapsed` seconds after it
/// started: from cargo's own progress when there is some, else from how
/// long such a build takes (`expected`).
///
/// Units differ in cost (the last few, the largest crates, take most of
/// the time), so the share of units done goes through `curve`: points
/// (per mille of units done, per mille of the time) measured on one such
/// build, joined by straight lines; without one, time follows units. The
/// whole build is taken to last what reaching `done` took divided by its
/// share of the time, and, while no unit ends, at least until the next
/// unit's share: the estimate grows instead of sitting at "a minute left".
#[must_use]
pub fn build_left(
    elapsed: u64,
    expected: u64,
    progress: Option<BuildProgress>,
    curve: &[(u64, u64)],
) -> u64 {
    let Some(p) = progress.filter(|p| p.done > 0 && p.total > 0) else {
        return expected.saturating_sub(elapsed);
    };
    let share = |done: u64| {
        let units = done.min(p.total) * 1000 / p.total;
        let mut points = vec![(0, 0)];
        points.extend(
            curve
                .iter()
                .copied()
                .filter(|&(u, t)| u <= 1000 && t <= 1000),
        );
        points.push((1000, 1000));
        points.sort_unstable();
        points
            .windows(2)
            .find(|w| units <= w[1].0)
            .map_or(1000, |w| {
                let ((u0, t0), (u1, t1)) = (w[0], w[1]);
                if u1 == u0 {
                    t1
                } else {
                    t0 + (t1.max(t0) - t0) * (units - u0) / (u1 - u0)
                }
            })
    };
    let now = share(p.done).max(1);
    let next = share(p.done + 1).max(1);
    let total = p.reached_secs * 1000 / now;
    let at_least = elapsed * 1000 / next;
    total.max(at_least).saturating_sub(elapsed)
}

/// A marker's `curve=` (`UNITS:TIME,…`, per mille): the points that parse.
fn parse_curve(text: &str) -> Vec<(u64, u64)> {
    text.split(',')
        .filter_map(|p| {
            let (u, t) = p.split_once(':')?;
            Some((u.trim().parse().ok()?, t.trim().parse().ok()?))
        })
        .collect()
}

/// The build of `tests/install-tools.sh` for `tool-version` in progress:
/// its marker (`<cache>/<tool>-<version>.building`: `started=`, `expected=`,
/// `pid=`, `log=` lines, and once cargo has said how far it is `units=`
/// DONE/TOTAL, `units_at=` when, and `curve=` for [`build_left`]) names a
/// process that still runs.
#[must_use]
pub fn build_in_progress(tool_version: &str) -> Option<ZellijError> {
    let marker = cache_dir()?.join(format!("{tool_version}.building"));
    let text = std::fs::read_to_string(marker).ok()?;
    let pid: i32 = marker_field(&text, "pid")?.parse().ok()?;
    if pid <= 0 || nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err() {
        return None;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    building(&text, now)
}

fn marker_field(text: &str, key: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .map(str::to_owned)
}

/// What a build's marker `text` says at `now` (seconds since the epoch).
fn building(text: &str, now: u64) -> Option<ZellijError> {
    let field = |k: &str| marker_field(text, k);
    let started: u64 = field("started")?.parse().ok()?;
    let elapsed = now.saturating_sub(started);
    let progress = field("units").and_then(|u| {
        let (done, total) = u.split_once('/')?;
        Some(BuildProgress {
            done: done.parse().ok()?,
            total: total.parse().ok()?,
            reached_secs: field("units_at")
                .and_then(|t| t.parse::<u64>().ok())
                .map_or(elapsed, |t| t.saturating_sub(started).min(elapsed)),
        })
    });
    let expected = field("expected")
        .and_then(|e| e.parse().ok())
        .unwrap_or(1200);
    let curve = parse_curve(&field("curve").unwrap_or_default());
    Some(ZellijError::Building {
        elapsed_secs: elapsed,
        left_secs: build_left(elapsed, expected, progress, &curve),
        units: progress.map(|p| (p.done, p.total)),
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
/// `share/zellij/{config.kdl,layout.kdl}` and `bin/keystone-notify` always,
/// `bin/zellij` from `zellij` when there is one. Returns the directory.
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
    // What the agents' hooks run to say they wait (crate::waiting).
    let notify = bin.join(crate::waiting::PROGRAM);
    if fs::read_to_string(&notify).ok().as_deref() != Some(crate::waiting::NOTIFY) {
        atomic_write(&notify, crate::waiting::NOTIFY.as_bytes())?;
    }
    fs::set_permissions(&notify, fs::Permissions::from_mode(0o755))
        .map_err(WriteError::of("set the mode of", &notify))?;
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
    fn a_build_s_time_left_follows_cargo_s_units_through_the_curve() {
        // Zellij's: a third of the units in the first tenth of the time,
        // the last two units a fifth of it.
        let curve = parse_curve("300:100,995:800,997:990,junk,2000:5");
        assert_eq!(curve, [(300, 100), (995, 800), (997, 990), (2000, 5)]);
        let at = |done, reached_secs| {
            Some(BuildProgress {
                done,
                total: 1000,
                reached_secs,
            })
        };
        // No units yet: what such a build takes.
        assert_eq!(build_left(100, 600, None, &curve), 500);
        assert_eq!(build_left(700, 600, None, &curve), 0);
        // 300 units after 60 s: a tenth of the time, 540 s to go.
        assert_eq!(build_left(60, 600, at(300, 60), &curve), 540);
        // Half the units after 300 s: only 30% of the time (on the line
        // from 300 to 995), so 700 s to go, not 300.
        assert_eq!(build_left(300, 600, at(500, 300), &curve), 696);
        // At 995 units (80%) after 800 s: 200 s to go, less as it waits,
        // but while the next unit (89.5%) has not come, never less than
        // its share allows: the estimate grows again.
        assert_eq!(build_left(800, 600, at(995, 800), &curve), 200);
        assert_eq!(build_left(900, 600, at(995, 800), &curve), 105);
        assert_eq!(build_left(1200, 600, at(995, 800), &curve), 140);
        // A linear curve when the marker has none.
        assert_eq!(build_left(100, 600, at(250, 100), &[]), 300);
        // A marker as tests/install-tools.sh writes it, in the message.
        let marker = "started=1000\nexpected=600\npid=1\nlog=\n\
                      curve=300:100,995:800,997:990\nunits=500/1000\nunits_at=1300\n";
        let e = building(marker, 1300).unwrap();
        assert!(
            e.to_string().contains(
                "(started 5 minutes ago, 500 of 1000 units compiled, about 12 minutes left; log: -)"
            ),
            "{e}"
        );
        // Before cargo's first count: what such a build takes.
        let e = building("started=1000\nexpected=600\npid=1\n", 1120).unwrap();
        assert!(
            e.to_string()
                .contains("(started 2 minutes ago, about 8 minutes left; log: -)"),
            "{e}"
        );
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

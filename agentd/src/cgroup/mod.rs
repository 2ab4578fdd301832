//! Resource limits of local sandboxes through cgroups, v2 or v1.
//!
//! Each controller agentd uses (`memory`, `pids`, `cpu`) is looked up on its
//! own, because hybrid hosts mount some controllers as cgroup v1 hierarchies
//! (`/sys/fs/cgroup/memory`, ...) next to an empty v2 one:
//!
//! - **v1**: the controller's hierarchy is mounted; the sandbox's group is
//!   `<agentd's group>/keystone-agent-<tag>/sandbox-<name>` in it, where
//!   `<tag>` is derived from agentd's state directory so that several agentds
//!   in one group never share a sandbox's group. Limits: `memory.limit_in_bytes`
//!   (and `memory.memsw.limit_in_bytes`, so swap does not extend it),
//!   `pids.max`, `cpu.cfs_quota_us`. A `cpuacct` hierarchy mounted apart
//!   from `cpu` gets the sandbox's group too, only to count its CPU time
//!   (`agentctl stats`, [`crate::stats`]). A `freezer` hierarchy gets one
//!   too, to pause the sandbox (`freezer.state`, [`Cgroups::freeze`]).
//! - **v2**: agentd needs a delegated subtree (systemd `Delegate=yes`, which
//!   the NixOS module sets). It moves itself into an `agentd` leaf, enables
//!   the controllers for its subtree and gives each sandbox a
//!   `sandbox-<name>` child with `memory.max` (and `memory.swap.max` 0),
//!   `pids.max` and `cpu.max`; `cgroup.freeze` pauses it.
//!
//! A controller agentd cannot use (not mounted, not delegated, a group it
//! may not write, as for an unprivileged agentd without delegation) leaves
//! that limit unenforced; every start says which and why, in the log and in
//! `agentctl status`.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

mod freeze;
pub use freeze::FreezeError;

/// A controller agentd sets limits with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Controller {
    /// RAM (tmpfs pages included).
    Memory,
    /// Number of processes and threads.
    Pids,
    /// CPU time.
    Cpu,
}

impl Controller {
    const ALL: [Self; 3] = [Self::Memory, Self::Pids, Self::Cpu];

    fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Pids => "pids",
            Self::Cpu => "cpu",
        }
    }
}

/// Where the groups of one controller go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// Under this directory of a cgroup v1 hierarchy (agentd's own group;
    /// `keystone-agent-<tag>` is made below it on demand).
    V1(PathBuf),
    /// Under this directory of the cgroup v2 hierarchy (agentd's delegated
    /// group, agentd itself moved into its `agentd` leaf).
    V2(PathBuf),
}

/// The limits of one sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// RAM in MiB.
    pub memory_mib: u32,
    /// Most processes and threads.
    pub pids: u32,
    /// CPUs' worth of CPU time.
    pub vcpus: u32,
}

/// The cgroups of a started sandbox: directories for its supervisor to
/// join, and what is enforced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Created {
    /// Directories to join (one per v1 hierarchy, or the one v2 group).
    pub dirs: Vec<PathBuf>,
    /// Limits in force, as shown: `memory 4096 MiB (cgroup v1)`.
    pub enforced: Vec<String>,
    /// Limits not in force, and why: `pids not enforced: ...`.
    pub missing: Vec<String>,
}

impl fmt::Display for Created {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let all: Vec<&str> = self
            .enforced
            .iter()
            .chain(&self.missing)
            .map(String::as_str)
            .collect();
        f.write_str(&all.join("; "))
    }
}

/// Why agentd cannot use a controller.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Unavailable {
    /// agentd's v1 group is outside the mounted hierarchy.
    #[error("agentd's {controller} group (cgroup v1) is not below {}", mount.display())]
    V1Outside {
        /// The controller.
        controller: &'static str,
        /// The hierarchy's mount point.
        mount: PathBuf,
    },
    /// agentd may not write its v1 group.
    #[error(
        "agentd may not create groups in {} (cgroup v1): {source}{}",
        dir.display(),
        if *root { "" } else { "; agentd is not root and has no delegated group there" }
    )]
    V1Denied {
        /// agentd's group.
        dir: PathBuf,
        /// What `access(W_OK)` said.
        #[source]
        source: nix::Error,
        /// Whether agentd runs as root.
        root: bool,
    },
    /// agentd's v2 group has other controllers, not this one.
    #[error(
        "the {controller} controller is not delegated to {} (cgroup v2; run agentd with \
         Delegate=yes)",
        base.display()
    )]
    NotDelegated {
        /// The controller.
        controller: &'static str,
        /// agentd's v2 group.
        base: PathBuf,
    },
    /// No hierarchy at all.
    #[error("no cgroup hierarchy (v1 or v2) has the controller")]
    NoHierarchy,
    /// agentd has no v2 group.
    #[error("agentd is not in a cgroup v2 group")]
    NotInV2,
    /// agentd's v2 group is outside the mounted hierarchy.
    #[error("agentd's cgroup v2 group is not mounted")]
    V2Outside,
    /// agentd's v2 group has none of the controllers it lacks in v1.
    #[error(
        "no cgroup v1 hierarchy has the controller, and it is not delegated to {} \
         (cgroup v2; run agentd with Delegate=yes)",
        .0.display()
    )]
    NoneDelegated(PathBuf),
    /// Preparing agentd's v2 leaf failed.
    #[error("cannot {what} {}: {source}", path.display())]
    Leaf {
        /// `create`, `move agentd into`.
        what: &'static str,
        /// The leaf's path (or its `cgroup.procs`).
        path: PathBuf,
        /// Why not.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// No controller could be enabled for agentd's v2 subtree.
    #[error("{} ({})", enable_failures(.errors), base.display())]
    CannotEnable {
        /// agentd's v2 group.
        base: PathBuf,
        /// Each controller and why it could not be enabled.
        errors: Vec<(Controller, Arc<std::io::Error>)>,
    },
}

fn enable_failures(errors: &[(Controller, Arc<std::io::Error>)]) -> String {
    errors
        .iter()
        .map(|(c, e)| format!("cannot enable {}: {e}", c.name()))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Unavailable {
    fn leaf<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Self + 'a {
        move |e| Self::Leaf {
            what,
            path: path.to_owned(),
            source: Arc::new(e),
        }
    }
}

/// What agentd can do with cgroups on this host, controller by controller.
#[derive(Debug, Clone)]
pub struct Cgroups {
    tag: String,
    memory: Result<Place, Unavailable>,
    pids: Result<Place, Unavailable>,
    cpu: Result<Place, Unavailable>,
    /// The v1 `cpuacct` hierarchy, where CPU time is counted (the `cpu`
    /// one's when they are mounted together); only for `agentctl stats`.
    cpuacct: Option<Place>,
    /// Where the sandbox's processes are frozen: the v1 `freezer`
    /// hierarchy, or a v2 group (every v2 group has `cgroup.freeze`).
    freezer: Result<Place, String>,
}

/// Where the figures of one sandbox's groups are read: each directory and
/// whether it is cgroup v2, or why there is none.
#[derive(Debug, Clone)]
pub struct Groups {
    /// `memory.*` files.
    pub memory: Result<(PathBuf, bool), String>,
    /// `pids.*` files.
    pub pids: Result<(PathBuf, bool), String>,
    /// `cpuacct.usage` (v1) or `cpu.stat` (v2).
    pub cpu: Result<(PathBuf, bool), String>,
}

/// One line of `/proc/self/mountinfo` that mounts a cgroup file system.
#[derive(Debug, Clone)]
struct CgroupMount {
    /// Root of the mount inside its hierarchy.
    root: String,
    /// Mount point.
    point: PathBuf,
    /// `cgroup2`, or the v1 hierarchy's controllers.
    v1_controllers: Option<Vec<String>>,
}

fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let mut right = right.split(' ');
            let fstype = right.next()?;
            let _source = right.next()?;
            let options = right.next().unwrap_or("");
            let root = unescape(left.get(3)?);
            let point = PathBuf::from(unescape(left.get(4)?));
            match fstype {
                "cgroup2" => Some(CgroupMount {
                    root,
                    point,
                    v1_controllers: None,
                }),
                "cgroup" => Some(CgroupMount {
                    root,
                    point,
                    v1_controllers: Some(options.split(',').map(str::to_owned).collect()),
                }),
                _ => None,
            }
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..=i + 3].iter().all(u8::is_ascii_digit) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The directory of the group `path` (as in /proc/self/cgroup) under
/// `mount`, whose root inside the hierarchy is `root`.
fn group_dir(mount: &CgroupMount, path: &str) -> Option<PathBuf> {
    let rel = if mount.root == "/" {
        path
    } else {
        path.strip_prefix(mount.root.as_str())?
    };
    Some(mount.point.join(rel.trim_start_matches('/')))
}

impl Cgroups {
    /// Probe the host (and prepare agentd's v2 subtree when it uses one).
    /// `state_dir` tells this agentd's v1 groups from other agentds'.
    #[must_use]
    pub fn detect(state_dir: &Path) -> Self {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        Self::probe(state_dir, &parse_mountinfo(&mountinfo), &own, true)
    }

    /// What [`Cgroups::detect`] would find, changing nothing: for each
    /// controller, its name and whether agentd could use it.
    #[must_use]
    pub fn inspect(state_dir: &Path) -> Vec<(&'static str, Result<(), Unavailable>)> {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let found = Self::probe(state_dir, &parse_mountinfo(&mountinfo), &own, false);
        [
            (Controller::Memory, found.memory),
            (Controller::Pids, found.pids),
            (Controller::Cpu, found.cpu),
        ]
        .into_iter()
        .map(|(c, p)| (c.name(), p.map(|_| ())))
        .collect()
    }

    fn probe(state_dir: &Path, mounts: &[CgroupMount], own: &str, prepare_v2: bool) -> Self {
        let tag: String = Sha256::digest(state_dir.as_os_str().as_encoded_bytes())
            .iter()
            .take(4)
            .map(|b| format!("{b:02x}"))
            .collect();
        let root = nix::unistd::Uid::effective().is_root();
        // v2 only matters for controllers no v1 hierarchy has.
        let v1_named = |name: &'static str| -> Option<Result<Place, Unavailable>> {
            let mount = mounts.iter().find(|m| {
                m.v1_controllers
                    .as_ref()
                    .is_some_and(|c| c.iter().any(|o| o == name))
            })?;
            let path = own.lines().find_map(|l| {
                let mut f = l.splitn(3, ':');
                let (_, ctls, path) = (f.next()?, f.next()?, f.next()?);
                ctls.split(',').any(|c| c == name).then_some(path)
            });
            let Some(dir) = path.and_then(|p| group_dir(mount, p)) else {
                return Some(Err(Unavailable::V1Outside {
                    controller: name,
                    mount: mount.point.clone(),
                }));
            };
            Some(
                match nix::unistd::access(&dir, nix::unistd::AccessFlags::W_OK) {
                    Ok(()) => Ok(Place::V1(dir)),
                    Err(source) => Err(Unavailable::V1Denied { dir, source, root }),
                },
            )
        };
        let v1 = |ctl: Controller| v1_named(ctl.name());
        let wanted_v2: Vec<Controller> = Controller::ALL
            .into_iter()
            .filter(|c| v1(*c).is_none())
            .collect();
        let v2 = if wanted_v2.is_empty() {
            // Never read: every controller has its v1 hierarchy.
            Err(Unavailable::NoHierarchy)
        } else {
            Self::prepare_v2(mounts, own, &wanted_v2, prepare_v2)
        };
        let place = |ctl: Controller| match v1(ctl) {
            Some(p) => p,
            None => match &v2 {
                Ok((base, enabled)) if enabled.contains(&ctl) => Ok(Place::V2(base.clone())),
                Ok((base, _)) => Err(Unavailable::NotDelegated {
                    controller: ctl.name(),
                    base: base.clone(),
                }),
                Err(e) => Err(e.clone()),
            },
        };
        let (memory, pids, cpu) = (
            place(Controller::Memory),
            place(Controller::Pids),
            place(Controller::Cpu),
        );
        let freezer = match v1_named("freezer") {
            Some(found) => found.map_err(|e| e.to_string()),
            None => [&memory, &pids, &cpu]
                .into_iter()
                .find_map(|p| p.as_ref().ok().filter(|p| matches!(p, Place::V2(_))))
                .cloned()
                .ok_or_else(|| {
                    "no cgroup v1 freezer hierarchy, and no cgroup v2 group of agentd's".to_owned()
                }),
        };
        Self {
            tag,
            memory,
            pids,
            cpu,
            cpuacct: v1_named("cpuacct").and_then(Result::ok),
            freezer,
        }
    }

    /// agentd's v2 group with the controllers of `wanted` it could enable.
    fn prepare_v2(
        mounts: &[CgroupMount],
        own: &str,
        wanted: &[Controller],
        prepare: bool,
    ) -> Result<(PathBuf, Vec<Controller>), Unavailable> {
        let mount = mounts
            .iter()
            .find(|m| m.v1_controllers.is_none())
            .ok_or(Unavailable::NoHierarchy)?;
        let rel = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .ok_or(Unavailable::NotInV2)?;
        let base = group_dir(mount, rel).ok_or(Unavailable::V2Outside)?;
        let available = fs::read_to_string(base.join("cgroup.controllers")).unwrap_or_default();
        let available: Vec<Controller> = wanted
            .iter()
            .copied()
            .filter(|c| available.split_whitespace().any(|a| a == c.name()))
            .collect();
        if available.is_empty() {
            return Err(Unavailable::NoneDelegated(base));
        }
        if !prepare {
            return Ok((base, available));
        }
        // A cgroup with processes cannot hand controllers to children: move
        // agentd into a leaf of its own first.
        let leaf = base.join("agentd");
        fs::create_dir_all(&leaf).map_err(Unavailable::leaf("create", &leaf))?;
        fs::write(leaf.join("cgroup.procs"), std::process::id().to_string())
            .map_err(Unavailable::leaf("move agentd into", &leaf))?;
        let mut enabled = Vec::new();
        let mut errors = Vec::new();
        for ctl in available {
            match fs::write(
                base.join("cgroup.subtree_control"),
                format!("+{}", ctl.name()),
            ) {
                Ok(()) => enabled.push(ctl),
                Err(e) => errors.push((ctl, Arc::new(e))),
            }
        }
        if enabled.is_empty() {
            return Err(Unavailable::CannotEnable { base, errors });
        }
        Ok((base, enabled))
    }

    fn place(&self, ctl: Controller) -> &Result<Place, Unavailable> {
        match ctl {
            Controller::Memory => &self.memory,
            Controller::Pids => &self.pids,
            Controller::Cpu => &self.cpu,
        }
    }

    /// Why nothing at all is enforced, or `None` when something is.
    #[must_use]
    pub fn unavailable(&self) -> Option<String> {
        let why: Vec<String> = Controller::ALL
            .into_iter()
            .filter_map(|c| {
                self.place(c)
                    .as_ref()
                    .err()
                    .map(|e| format!("{}: {e}", c.name()))
            })
            .collect();
        (why.len() == Controller::ALL.len()).then(|| why.join("; "))
    }

    fn group(&self, place: &Place, name: &str) -> PathBuf {
        match place {
            Place::V1(dir) => dir
                .join(format!("keystone-agent-{}", self.tag))
                .join(format!("sandbox-{name}")),
            Place::V2(dir) => dir.join(format!("sandbox-{name}")),
        }
    }

    /// Create the groups of sandbox `name` with `limits`.
    #[must_use]
    pub fn create(&self, name: &str, limits: Limits) -> Created {
        let mut out = Created::default();
        for ctl in Controller::ALL {
            let what = match ctl {
                Controller::Memory => format!("memory {} MiB", limits.memory_mib),
                Controller::Pids => format!("pids {}", limits.pids),
                Controller::Cpu => format!("{} CPUs", limits.vcpus),
            };
            let place = match self.place(ctl) {
                Ok(p) => p,
                Err(e) => {
                    out.missing
                        .push(format!("{} not enforced: {e}", ctl.name()));
                    continue;
                }
            };
            let dir = self.group(place, name);
            match Self::apply(place, &dir, ctl, limits) {
                Ok(note) => {
                    let version = match place {
                        Place::V1(_) => "v1",
                        Place::V2(_) => "v2",
                    };
                    out.enforced
                        .push(format!("{what}{note} (cgroup {version})"));
                    if !out.dirs.contains(&dir) {
                        out.dirs.push(dir);
                    }
                }
                Err(e) => out.missing.push(format!(
                    "{} not enforced: cannot set up {}: {e}",
                    ctl.name(),
                    dir.display()
                )),
            }
        }
        // Only counts (CPU time for `agentctl stats`), so a failure is no
        // limit missing.
        // Counting and pausing only, so a failure is no limit missing
        // (pausing the sandbox says why it cannot).
        for place in self.cpuacct.iter().chain(self.freezer.as_ref().ok()) {
            let dir = self.group(place, name);
            if !out.dirs.contains(&dir) && fs::create_dir_all(&dir).is_ok() {
                out.dirs.push(dir);
            }
        }
        out
    }

    /// Where the figures of sandbox `name`'s groups are read.
    #[must_use]
    pub fn groups(&self, name: &str) -> Groups {
        let at = |place: &Result<Place, Unavailable>| match place {
            Ok(p) => Ok((self.group(p, name), matches!(p, Place::V2(_)))),
            Err(e) => Err(e.to_string()),
        };
        let cpu = match (&self.cpu, &self.cpuacct) {
            // Every v2 group counts its CPU time in cpu.stat.
            (Ok(p @ Place::V2(_)), _) => Ok((self.group(p, name), true)),
            (_, Some(p)) => Ok((self.group(p, name), false)),
            (_, None) => {
                Err("agentd has no cpuacct hierarchy (cgroup v1) to count it in".to_owned())
            }
        };
        Groups {
            memory: at(&self.memory),
            pids: at(&self.pids),
            cpu,
        }
    }

    /// Write `ctl`'s limit into group `dir`; returns a note for the person.
    fn apply(
        place: &Place,
        dir: &Path,
        ctl: Controller,
        limits: Limits,
    ) -> std::io::Result<String> {
        fs::create_dir_all(dir)?;
        let bytes = u64::from(limits.memory_mib) << 20;
        let mut note = String::new();
        match (place, ctl) {
            (Place::V1(_), Controller::Memory) => {
                fs::write(dir.join("memory.limit_in_bytes"), bytes.to_string())?;
                // Without this, swap would extend the limit (where swap is
                // accounted at all).
                let memsw = dir.join("memory.memsw.limit_in_bytes");
                if memsw.exists() {
                    fs::write(memsw, bytes.to_string())?;
                }
            }
            (Place::V2(_), Controller::Memory) => {
                fs::write(dir.join("memory.max"), bytes.to_string())?;
                let swap = dir.join("memory.swap.max");
                if swap.exists() {
                    fs::write(swap, "0")?;
                }
            }
            (_, Controller::Pids) => {
                fs::write(dir.join("pids.max"), limits.pids.to_string())?;
                if let Some(max) = fs::read_to_string("/proc/sys/kernel/pid_max")
                    .ok()
                    .and_then(|s| s.trim().parse::<u32>().ok())
                    .filter(|m| *m < limits.pids)
                {
                    note = format!(" (above the host's pid_max {max}, which is what counts)");
                }
            }
            (Place::V1(_), Controller::Cpu) => {
                fs::write(dir.join("cpu.cfs_period_us"), "100000")?;
                fs::write(
                    dir.join("cpu.cfs_quota_us"),
                    (u64::from(limits.vcpus) * 100_000).to_string(),
                )?;
            }
            (Place::V2(_), Controller::Cpu) => {
                fs::write(
                    dir.join("cpu.max"),
                    format!("{} 100000", u64::from(limits.vcpus) * 100_000),
                )?;
            }
        }
        Ok(note)
    }

    /// Remove every group this agentd (`state_dir`) made in v1 hierarchies
    /// that is empty: groups of sandboxes whose processes are gone. Returns
    /// whether none is left.
    pub fn remove_all(state_dir: &Path) -> bool {
        let c = Self::detect_v1_only(state_dir);
        let mut clean = true;
        let places = Controller::ALL
            .into_iter()
            .filter_map(|ctl| c.place(ctl).as_ref().ok())
            .chain(&c.cpuacct)
            .chain(c.freezer.as_ref().ok());
        for place in places {
            if let Place::V1(dir) = place {
                let mine = dir.join(format!("keystone-agent-{}", c.tag));
                if let Ok(entries) = fs::read_dir(&mine) {
                    for e in entries.flatten().filter(|e| e.path().is_dir()) {
                        let _ = fs::remove_dir(e.path());
                    }
                }
                if fs::remove_dir(&mine).is_err() && mine.exists() {
                    clean = false;
                }
            }
        }
        clean
    }

    /// [`Cgroups::detect`] without touching a v2 hierarchy.
    fn detect_v1_only(state_dir: &Path) -> Self {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        Self::probe(state_dir, &parse_mountinfo(&mountinfo), &own, false)
    }

    /// Remove the (empty) groups of sandbox `name`.
    pub fn remove(&self, name: &str) {
        let places = Controller::ALL
            .into_iter()
            .filter_map(|ctl| self.place(ctl).as_ref().ok())
            .chain(&self.cpuacct)
            .chain(self.freezer.as_ref().ok());
        for place in places {
            {
                let dir = self.group(place, name);
                let _ = fs::remove_dir(&dir);
                // This agentd's v1 parent goes with its last sandbox.
                if matches!(place, Place::V1(_)) {
                    if let Some(parent) = dir.parent() {
                        let _ = fs::remove_dir(parent);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hybrid_hosts_use_the_v1_hierarchies() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path().display();
        let mountinfo = format!(
            "31 23 0:28 / {t} rw,relatime - tmpfs tmpfs rw,mode=755\n\
             32 31 0:29 / {t}/cpu rw,relatime - cgroup cgroup rw,cpu\n\
             35 31 0:32 / {t}/memory rw,relatime - cgroup cgroup rw,memory\n\
             39 31 0:36 / {t}/pids rw,relatime - cgroup cgroup rw,pids\n\
             41 31 0:38 / {t}/unified rw,relatime - cgroup2 cgroup2 rw\n"
        );
        for d in ["cpu", "memory/ci/job", "pids", "unified"] {
            fs::create_dir_all(tmp.path().join(d)).unwrap();
        }
        let own = "8:pids:/\n4:memory:/ci/job\n1:cpu:/\n0::/\n";
        let c = Cgroups::probe(Path::new("/s"), &parse_mountinfo(&mountinfo), own, false);
        assert_eq!(
            c.memory.as_ref().ok(),
            Some(&Place::V1(tmp.path().join("memory/ci/job")))
        );
        assert_eq!(
            c.pids.as_ref().ok(),
            Some(&Place::V1(tmp.path().join("pids")))
        );
        assert!(c.unavailable().is_none());
        let made = c.create(
            "demo",
            Limits {
                memory_mib: 256,
                pids: 64,
                vcpus: 2,
            },
        );
        assert_eq!(made.dirs.len(), 3, "{made:?}");
        let g = &made.dirs[0];
        assert!(g.starts_with(tmp.path().join("memory/ci/job")), "{g:?}");
        assert!(
            g.parent()
                .unwrap()
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("keystone-agent-")
        );
        assert_eq!(
            fs::read_to_string(g.join("memory.limit_in_bytes")).unwrap(),
            (256u64 << 20).to_string()
        );
        assert_eq!(
            fs::read_to_string(made.dirs[1].join("pids.max")).unwrap(),
            "64"
        );
        assert_eq!(
            fs::read_to_string(made.dirs[2].join("cpu.cfs_quota_us")).unwrap(),
            "200000"
        );
        assert!(made.missing.is_empty(), "{made}");
        assert!(
            made.to_string().contains("memory 256 MiB (cgroup v1)"),
            "{made}"
        );
        assert!(made.to_string().contains("pids 64"), "{made}");
    }

    #[test]
    fn a_host_without_cgroups_says_why_for_each_limit() {
        let c = Cgroups::probe(Path::new("/s"), &[], "", false);
        let why = c.unavailable().unwrap();
        assert!(why.contains("memory: no cgroup hierarchy"), "{why}");
        let made = c.create(
            "x",
            Limits {
                memory_mib: 1024,
                pids: 64,
                vcpus: 1,
            },
        );
        assert!(made.dirs.is_empty());
        assert!(made.enforced.is_empty());
        assert_eq!(made.missing.len(), 3);
        assert!(
            made.to_string().starts_with("memory not enforced"),
            "{made}"
        );
    }

    #[test]
    fn a_group_agentd_may_not_write_is_named_with_the_reason() {
        let mountinfo = "35 31 0:32 / /nonexistent/memory rw,relatime - cgroup cgroup rw,memory\n";
        let c = Cgroups::probe(
            Path::new("/s"),
            &parse_mountinfo(mountinfo),
            "4:memory:/user.slice\n",
            false,
        );
        let made = c.create(
            "x",
            Limits {
                memory_mib: 256,
                pids: 64,
                vcpus: 1,
            },
        );
        let text = made.to_string();
        assert!(
            text.starts_with(
                "memory not enforced: agentd may not create groups in \
                 /nonexistent/memory/user.slice (cgroup v1)"
            ),
            "{text}"
        );
        assert!(text.contains("pids not enforced: "), "{text}");
    }

    #[test]
    fn mount_points_with_escapes_are_read() {
        let m = parse_mountinfo(
            "40 31 0:37 /a\\040b /sys/fs/cgroup/my\\040pids rw - cgroup cgroup rw,pids\n",
        );
        assert_eq!(m[0].point, PathBuf::from("/sys/fs/cgroup/my pids"));
        assert_eq!(
            group_dir(&m[0], "/a b/c"),
            Some(PathBuf::from("/sys/fs/cgroup/my pids/c"))
        );
    }
}

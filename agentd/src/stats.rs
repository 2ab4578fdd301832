//! What a running sandbox uses (`GetStats`, `agentctl stats`): figures read
//! when asked, from its cgroups, its disk image and its egress gateway.
//! Nothing is sampled in the background and no figure is estimated: one
//! that cannot be read is left out, and `info` says why.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use crate::cgroup::Groups;

/// The figures of one sandbox at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Figure name → value (µs, bytes or counts; see docs/dbus-api.md).
    pub figures: BTreeMap<String, u64>,
    /// `state` when the sandbox is not running; otherwise, for each group
    /// of figures left out (`cpu`, `memory`, `pids`, `disk`, `gateway`),
    /// why.
    pub info: BTreeMap<String, String>,
}

impl Stats {
    fn set(&mut self, key: &str, value: u64) {
        self.figures.insert(key.to_owned(), value);
    }

    /// Say that the figures of `group` are unavailable, and why.
    pub fn unavailable(&mut self, group: &str, why: impl Into<String>) {
        self.info.insert(group.to_owned(), why.into());
    }
}

/// A number from a cgroup file; `None` for `max` (no limit).
fn read_num(path: &Path) -> Result<Option<u64>, String> {
    let text =
        fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let text = text.trim();
    if text == "max" {
        return Ok(None);
    }
    text.parse()
        .map(Some)
        .map_err(|_| format!("{} holds '{text}', not a number", path.display()))
}

/// v1 reports "no limit" as a huge number (a page-rounded `i64::MAX`).
fn limit(value: Option<u64>) -> Option<u64> {
    value.filter(|v| *v < (1 << 62))
}

/// Read the CPU, memory and process figures of a sandbox's `groups`.
pub fn read_cgroups(groups: &Groups, out: &mut Stats) {
    match cpu_usec(groups) {
        Ok(v) => out.set("cpu_usec", v),
        Err(e) => out.unavailable("cpu", e),
    }
    if let Err(e) = memory(groups, out) {
        out.unavailable("memory", e);
    }
    let pids = groups.pids.clone().and_then(|(dir, _)| {
        let current = read_num(&dir.join("pids.current"))?.unwrap_or(0);
        Ok((current, read_num(&dir.join("pids.max"))?))
    });
    match pids {
        Ok((current, max)) => {
            out.set("pids_current", current);
            if let Some(m) = max {
                out.set("pids_limit", m);
            }
        }
        Err(e) => out.unavailable("pids", e),
    }
}

fn cpu_usec(groups: &Groups) -> Result<u64, String> {
    let (dir, v2) = groups.cpu.clone()?;
    if !v2 {
        return Ok(read_num(&dir.join("cpuacct.usage"))?.unwrap_or(0) / 1000);
    }
    let path = dir.join("cpu.stat");
    let text =
        fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    text.lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("{} has no usage_usec", path.display()))
}

fn memory(groups: &Groups, out: &mut Stats) -> Result<(), String> {
    let (dir, v2) = groups.memory.clone()?;
    let (current, peak, max) = if v2 {
        ("memory.current", "memory.peak", "memory.max")
    } else {
        (
            "memory.usage_in_bytes",
            "memory.max_usage_in_bytes",
            "memory.limit_in_bytes",
        )
    };
    out.set("memory_current", read_num(&dir.join(current))?.unwrap_or(0));
    // memory.peak is new in Linux 5.19: without it there is no peak.
    if let Ok(Some(p)) = read_num(&dir.join(peak)) {
        out.set("memory_peak", p);
    }
    if let Some(m) = limit(read_num(&dir.join(max))?) {
        out.set("memory_limit", m);
    }
    Ok(())
}

/// Bytes used and the size of the file system mounted at `dir` (the
/// sandbox's disk image).
pub fn disk_usage(dir: &Path) -> Result<(u64, u64), String> {
    let st = nix::sys::statvfs::statvfs(dir)
        .map_err(|e| format!("cannot statvfs {}: {e}", dir.display()))?;
    let frsize = st.fragment_size();
    let used = (st.blocks() - st.blocks_free()) * frsize;
    Ok((used, st.blocks() * frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_figures_and_a_missing_peak_and_no_limit() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        fs::write(d.join("cpuacct.usage"), "2500000\n").unwrap();
        fs::write(d.join("memory.usage_in_bytes"), "4096\n").unwrap();
        fs::write(d.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        fs::write(d.join("pids.current"), "3\n").unwrap();
        fs::write(d.join("pids.max"), "max\n").unwrap();
        let at = Ok((d.to_owned(), false));
        let groups = Groups {
            memory: at.clone(),
            pids: at.clone(),
            cpu: at,
        };
        let mut s = Stats::default();
        read_cgroups(&groups, &mut s);
        let want: BTreeMap<String, u64> = [
            ("cpu_usec", 2500),
            ("memory_current", 4096),
            ("pids_current", 3),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        assert_eq!(s.figures, want);
        assert!(s.info.is_empty(), "{:?}", s.info);
    }

    #[test]
    fn a_group_that_cannot_be_read_is_said_not_guessed() {
        let groups = Groups {
            memory: Err("no memory hierarchy".to_owned()),
            pids: Ok(("/nonexistent".into(), false)),
            cpu: Ok(("/nonexistent".into(), true)),
        };
        let mut s = Stats::default();
        read_cgroups(&groups, &mut s);
        assert!(s.figures.is_empty(), "{:?}", s.figures);
        assert_eq!(s.info["memory"], "no memory hierarchy");
        assert!(s.info["pids"].contains("/nonexistent/pids.current"));
        assert!(s.info["cpu"].contains("cpu.stat"));
    }
}

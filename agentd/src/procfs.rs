//! Small readers of `/proc`, used to recognise a sandbox's processes across
//! agentd restarts without trusting pids alone (pids are reused).

use std::fs;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Start time of `pid` in clock ticks since boot (field 22 of `stat`), the
/// part of a process's identity that a reused pid does not share.
#[must_use]
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: fields start
    // after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(19)?.parse().ok()
}

/// Process state letter (`R`, `S`, `Z`, …) of `pid`.
#[must_use]
pub fn state(pid: i32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].chars().next()
}

/// Inode of `pid`'s PID namespace.
#[must_use]
pub fn pid_ns(pid: i32) -> Option<u64> {
    fs::metadata(format!("/proc/{pid}/ns/pid"))
        .ok()
        .map(|m| m.ino())
}

/// `pid`'s command line, split at NULs.
#[must_use]
pub fn cmdline(pid: i32) -> Option<Vec<String>> {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect(),
    )
}

/// Every live (non-zombie) pid on the host.
#[must_use]
pub fn pids() -> Vec<i32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|pid| state(*pid).is_some_and(|s| s != 'Z'))
        .collect()
}

/// Live processes whose PID namespace is `ns`.
#[must_use]
pub fn pids_in_ns(ns: u64) -> Vec<i32> {
    pids()
        .into_iter()
        .filter(|p| pid_ns(*p) == Some(ns))
        .collect()
}

/// Live processes whose command line is `<anything> <arg1> <arg2> …` with
/// the given leading arguments (argv[0] is ignored).
#[must_use]
pub fn pids_with_args(args: &[&str]) -> Vec<(i32, Vec<String>)> {
    pids()
        .into_iter()
        .filter_map(|p| {
            let cl = cmdline(p)?;
            (cl.len() > args.len() && cl[1..=args.len()].iter().zip(args).all(|(a, b)| a == b))
                .then_some((p, cl))
        })
        .collect()
}

/// A pidfd for `pid`: becomes readable when the process exits, whoever its
/// parent is.
pub fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor.
    let fd = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a fresh descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(i32::try_from(fd).map_err(std::io::Error::other)?) })
}

/// Whether `path` exists as a directory (without following a final symlink).
#[must_use]
pub fn is_real_dir(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_our_own_process() {
        let me = i32::try_from(std::process::id()).unwrap();
        assert!(start_time(me).unwrap() > 0);
        assert!(pid_ns(me).is_some());
        assert!(matches!(state(me), Some('R' | 'S')));
        assert!(pids().contains(&me));
        assert!(pids_in_ns(pid_ns(me).unwrap()).contains(&me));
        assert!(cmdline(me).unwrap()[0].contains("agentd"));
        assert!(pidfd_open(me).is_ok());
    }
}

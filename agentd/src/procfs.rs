//! Small readers of `/proc`, used to recognise a sandbox's processes across
//! agentd restarts without trusting pids alone (pids are reused).

use std::collections::HashMap;
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

/// Parent pid of `pid` (field 4 of `stat`).
#[must_use]
pub fn ppid(pid: i32) -> Option<i32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].split(' ').nth(1)?.parse().ok()
}

/// Whether `ancestor` is `pid`'s parent, grandparent, … (looking at most
/// `depth` generations up).
#[must_use]
pub fn descends_from(pid: i32, ancestor: i32, depth: usize) -> bool {
    let mut p = pid;
    for _ in 0..depth {
        match ppid(p) {
            Some(q) if q == ancestor => return true,
            Some(q) if q > 1 => p = q,
            _ => return false,
        }
    }
    false
}

/// Inode of `pid`'s PID namespace (readable only where agentd may trace
/// `pid`: not the init of a sandbox with a subordinate id, which is not
/// dumpable; its supervisor reports it instead).
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
    every_pid().filter(|pid| is_live(*pid)).collect()
}

/// Every pid on the host, zombies included.
fn every_pid() -> impl Iterator<Item = i32> {
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
}

/// Whether `pid` is there and not a zombie. (Reading `stat` costs the
/// kernel more than the other files here: the scans below look at it last,
/// for the few pids that matched.)
fn is_live(pid: i32) -> bool {
    state(pid).is_some_and(|s| s != 'Z')
}

/// Live processes whose PID namespace is `ns`.
#[must_use]
pub fn pids_in_ns(ns: u64) -> Vec<i32> {
    every_pid()
        .filter(|p| pid_ns(*p) == Some(ns) && is_live(*p))
        .collect()
}

/// Live processes whose command line is `<anything> <arg1> <arg2> …` with
/// the given leading arguments (argv[0] is ignored).
#[must_use]
pub fn pids_with_args(args: &[&str]) -> Vec<(i32, Vec<String>)> {
    every_pid()
        .filter_map(|p| {
            let cl = cmdline(p)?;
            (cl.len() > args.len()
                && cl[1..=args.len()].iter().zip(args).all(|(a, b)| a == b)
                && is_live(p))
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

/// At most this much of a `/proc` table is read ([`read_table`]): about
/// 100,000 sockets, which a sandbox could pass in its own network
/// namespace to make agentd hold them all.
pub const TABLE_MAX: usize = 16 << 20;

/// A `/proc` table such as `/proc/net/tcp`, read in large pieces, up to
/// [`TABLE_MAX`] bytes (cut at a line's end): each `read` of it walks the
/// kernel's socket tables again (about 2 ms here), and
/// `fs::read_to_string` begins with 32-byte reads, as a `/proc` file says
/// it is empty.
///
/// # Errors
/// When the file cannot be opened or read, or is not UTF-8.
pub fn read_table(path: impl AsRef<Path>) -> std::io::Result<String> {
    use std::io::Read as _;
    let mut f = fs::File::open(path)?;
    let (mut all, mut chunk) = (Vec::new(), vec![0u8; 64 * 1024]);
    loop {
        let n = f.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        all.extend_from_slice(&chunk[..n]);
        if all.len() >= TABLE_MAX {
            all.truncate(TABLE_MAX);
            let end = all.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
            all.truncate(end);
            break;
        }
    }
    String::from_utf8(all).map_err(std::io::Error::other)
}

/// TCP sockets in state LISTEN in the network namespace of `pid`, by inode.
#[must_use]
pub fn tcp_listeners(pid: i32) -> HashMap<u64, (std::net::IpAddr, u16)> {
    let mut out = HashMap::new();
    for file in ["tcp", "tcp6"] {
        let Ok(text) = read_table(format!("/proc/{pid}/net/{file}")) else {
            continue;
        };
        out.extend(text.lines().skip(1).filter_map(parse_tcp_line));
    }
    out
}

/// One line of `/proc/net/tcp{,6}` if it is a listening socket:
/// (inode, (address, port)).
pub fn parse_tcp_line(line: &str) -> Option<(u64, (std::net::IpAddr, u16))> {
    const LISTEN: &str = "0A";
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.get(3) != Some(&LISTEN) {
        return None;
    }
    let (addr, port) = f.get(1)?.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    // The kernel prints each 32-bit word of the address in host order.
    let mut bytes = Vec::with_capacity(16);
    for chunk in addr.as_bytes().chunks(8) {
        let word = u32::from_str_radix(std::str::from_utf8(chunk).ok()?, 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    let ip = match bytes.len() {
        4 => std::net::IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => std::net::IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
        _ => return None,
    };
    let inode = f.get(9)?.parse().ok()?;
    Some((inode, (ip, port)))
}

/// Inodes of the sockets process `pid` has open.
///
/// Only the owner of a process (or a holder of `CAP_DAC_READ_SEARCH`) may
/// look into its `fd` directory; a sandbox with a subordinate id is not
/// agentd's user's, so then the `ino:` lines of `fdinfo` (which only needs
/// the right to trace it) stand in: the inodes of all its open files,
/// sockets among them.
#[must_use]
pub fn socket_inodes(pid: i32) -> Vec<u64> {
    match std::fs::read_dir(format!("/proc/{pid}/fd")) {
        Ok(dir) => dir
            .filter_map(|e| {
                let link = std::fs::read_link(e.ok()?.path()).ok()?;
                let s = link.to_str()?;
                s.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
            })
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
                return Vec::new();
            };
            dir.filter_map(|e| {
                let text = std::fs::read_to_string(e.ok()?.path()).ok()?;
                fdinfo_inode(&text)
            })
            .collect()
        }
        Err(_) => Vec::new(),
    }
}

/// The `ino:` of an fdinfo file.
fn fdinfo_inode(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("ino:"))?
        .trim()
        .parse()
        .ok()
}

/// Working directory of `pid`, as that process sees it.
#[must_use]
pub fn cwd(pid: i32) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/cwd"))
        .ok()
        .and_then(|p| p.to_str().map(str::to_owned))
}

#[cfg(test)]
mod tcp_tests {
    use super::*;

    #[test]
    fn listening_sockets_are_parsed_from_proc_net_tcp() {
        let v4 = "   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000000000000000 100 0 0 10 0";
        let (inode, (ip, port)) = parse_tcp_line(v4).unwrap();
        assert_eq!(
            (inode, ip.to_string(), port),
            (4242, "127.0.0.1".into(), 8000)
        );
        let v6 = "   1: 00000000000000000000000001000000:0BB8 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 77 1 0000000000000000 100 0 0 10 0";
        let (_, (ip, port)) = parse_tcp_line(v6).unwrap();
        assert_eq!((ip.to_string(), port), ("::1".into(), 3000));
        let established = v4.replacen(" 0A ", " 01 ", 1);
        assert!(parse_tcp_line(&established).is_none());
    }

    #[test]
    fn our_own_listener_is_found() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let me = i32::try_from(std::process::id()).unwrap();
        let listeners = tcp_listeners(me);
        let ours = socket_inodes(me);
        assert!(
            ours.iter()
                .any(|i| listeners.get(i).is_some_and(|(_, p)| *p == port)),
            "port {port} not found"
        );
    }
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

    #[test]
    fn finds_its_parents() {
        let me = i32::try_from(std::process::id()).unwrap();
        let parent = ppid(me).unwrap();
        assert!(descends_from(me, parent, 1));
        assert!(!descends_from(parent, me, 3));
    }

    #[test]
    fn reads_the_inode_of_an_fdinfo() {
        let text = "pos:\t0\nflags:\t02000002\nmnt_id:\t10\nino:\t156755\n";
        assert_eq!(fdinfo_inode(text), Some(156_755));
        assert_eq!(fdinfo_inode("pos:\t0\n"), None);
    }
}

//! Giving up capabilities for good: for the processes a sandbox runs and
//! for the helpers that open its files. A leaf: it uses nothing else of
//! agentd. Every function is async-signal-safe (only `prctl` and `capset`),
//! so it may run between `fork` and `execve`.

use nix::libc;

fn check(r: libc::c_long) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Give up every capability for good: [`drop_bounding`], then
/// [`clear_own`].
pub fn drop_all() -> std::io::Result<()> {
    drop_bounding()?;
    clear_own()
}

/// Set no-new-privileges and empty the ambient and bounding sets, so that
/// no `execve` (not even of a setuid program, nor as uid 0) brings a
/// capability back. Needs `CAP_SETPCAP`; leaves the process's own sets as
/// they are, so that it may still change its ids afterwards.
pub fn drop_bounding() -> std::io::Result<()> {
    // SAFETY: prctl with plain integer arguments.
    unsafe {
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0).into())?;
        check(
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL,
                0,
                0,
                0,
            )
            .into(),
        )?;
        let mut cap = 0;
        // Until the first capability this kernel does not know.
        while libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) >= 0 {
            check(libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0).into())?;
            cap += 1;
        }
    }
    Ok(())
}

#[repr(C)]
struct Header {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Data {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const VERSION_3: u32 = 0x2008_0522;

const HEADER: Header = Header {
    version: VERSION_3,
    pid: 0,
};

/// Empty the process's effective, permitted and inheritable sets. A
/// process that changed its uid inside a user namespace where uid 0 is not
/// mapped keeps its capabilities there (the kernel clears them only on a
/// change away from uid 0): this is what takes them.
pub fn clear_own() -> std::io::Result<()> {
    let data = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    let header = HEADER;
    // SAFETY: capset with a pointer to a correctly laid out header and two
    // zeroed capability structs, as version 3 expects.
    check(unsafe { libc::syscall(libc::SYS_capset, &raw const header, data.as_ptr()) })
}

/// Keep the process's permitted capabilities (those the bounding set
/// allows) through the next `execve`, although its uid is not root: they
/// become inheritable and ambient too. For a helper that runs as a
/// sandbox's uid inside a user namespace of its own where uid 0 is not
/// mapped, so that those capabilities reach only what the namespace maps
/// (see [`clear_own`] for why it still has them). Async-signal-safe: only
/// `capget`, `capset` and `prctl`.
pub fn keep_across_exec() -> std::io::Result<()> {
    let mut data = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    let mut read = HEADER;
    // SAFETY: capget fills two capability structs of version 3's layout.
    check(unsafe { libc::syscall(libc::SYS_capget, &raw mut read, data.as_mut_ptr()) })?;
    let mut keep = [0u32; 2];
    let mut cap: u32 = 0;
    // SAFETY: prctl with plain integer arguments; until the first
    // capability this kernel does not know.
    while let r @ 0.. = unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) } {
        let (word, bit) = ((cap / 32) as usize, 1 << (cap % 32));
        if r == 1 && word < 2 && data[word].permitted & bit != 0 {
            keep[word] |= bit;
        }
        cap += 1;
    }
    for (d, k) in data.iter_mut().zip(keep) {
        d.inheritable = k;
    }
    let header = HEADER;
    // SAFETY: as in clear_own, with the sets just read.
    check(unsafe { libc::syscall(libc::SYS_capset, &raw const header, data.as_ptr()) })?;
    for c in (0..cap.min(64)).filter(|c| keep[(c / 32) as usize] & (1 << (c % 32)) != 0) {
        // SAFETY: prctl with plain integer arguments.
        let r = unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_RAISE, c, 0, 0) };
        check(r.into())?;
    }
    Ok(())
}

/// Make `uid`, `gid` and `groups` the calling process's ids, all of them
/// (real, effective, saved): groups first (while it may), then the gid,
/// then the uid. The error names the call that failed.
///
/// # Errors
/// The failed call and its error.
pub fn take_ids(uid: u32, gid: u32, groups: &[u32]) -> Result<(), (&'static str, nix::Error)> {
    use nix::unistd::{Gid, Uid};
    let groups: Vec<Gid> = groups.iter().map(|g| Gid::from_raw(*g)).collect();
    nix::unistd::setgroups(&groups).map_err(|e| ("setgroups", e))?;
    let gid = Gid::from_raw(gid);
    nix::unistd::setresgid(gid, gid, gid).map_err(|e| ("setresgid", e))?;
    let uid = Uid::from_raw(uid);
    nix::unistd::setresuid(uid, uid, uid).map_err(|e| ("setresuid", e))
}

/// Be killed (SIGKILL) when the process that started this one, `parent`,
/// ends; an error when it already has (the signal would never come).
/// Called again after every change of ids, which clears it.
/// Async-signal-safe: only `prctl` and `getppid`.
pub fn end_with_parent(parent: u32) -> std::io::Result<()> {
    // SAFETY: PR_SET_PDEATHSIG takes a signal number and touches no memory.
    if unsafe { nix::libc::prctl(nix::libc::PR_SET_PDEATHSIG, nix::libc::SIGKILL) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if u32::try_from(nix::unistd::getppid().as_raw()).ok() != Some(parent) {
        return Err(std::io::Error::other(
            "agentd ended before its helper started",
        ));
    }
    Ok(())
}

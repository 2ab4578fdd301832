//! Pseudo-terminals: made for a command agentd runs with a terminal (inside
//! a local sandbox, or for `ssh -t` to a VM), and taken as the controlling
//! terminal of that command. A leaf: it uses nothing else of agentd.

use std::os::fd::{AsRawFd, OwnedFd};

/// A new pseudo-terminal pair (master, slave) of `size`, both close-on-exec.
pub fn open_pty((rows, cols): (u16, u16)) -> nix::Result<(OwnedFd, OwnedFd)> {
    use nix::fcntl::OFlag;
    let master = nix::pty::posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)?;
    nix::pty::grantpt(&master)?;
    nix::pty::unlockpt(&master)?;
    let path = nix::pty::ptsname_r(&master)?;
    let slave = nix::fcntl::open(
        path.as_str(),
        OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )?;
    let master = OwnedFd::from(master);
    set_size(&master, (rows, cols))?;
    Ok((master, slave))
}

/// The size (rows, columns) of the terminal `fd`, if it has one.
#[must_use]
pub fn size(fd: &OwnedFd) -> Option<(u16, u16)> {
    let mut ws = nix::libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one winsize through the valid pointer.
    let r = unsafe { nix::libc::ioctl(fd.as_raw_fd(), nix::libc::TIOCGWINSZ, &raw mut ws) };
    (r == 0 && ws.ws_row > 0).then_some((ws.ws_row, ws.ws_col))
}

/// Set the size (rows, columns) of the terminal `fd`.
///
/// # Errors
/// `fd` is not a terminal.
pub fn set_size(fd: &OwnedFd, (rows, cols): (u16, u16)) -> nix::Result<()> {
    let ws = nix::libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one winsize from the valid pointer.
    if unsafe { nix::libc::ioctl(fd.as_raw_fd(), nix::libc::TIOCSWINSZ, &ws) } < 0 {
        return Err(nix::Error::last());
    }
    Ok(())
}

/// Make the calling process the leader of a new session with its stdin (a
/// terminal's slave side) as the controlling terminal. Meant for
/// `pre_exec`: it makes only async-signal-safe calls.
pub fn take_terminal() -> std::io::Result<()> {
    nix::unistd::setsid()?;
    // SAFETY: TIOCSCTTY takes an int argument and touches no memory.
    if unsafe { nix::libc::ioctl(0, nix::libc::TIOCSCTTY, 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

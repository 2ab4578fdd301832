//! The terminal hand-over of `agentctl attach` and `agentctl exec --tty`.
//!
//! agentd gives us the master side of a pseudo-terminal that lives inside
//! the sandbox. We put our own terminal in raw mode, copy bytes both ways,
//! pass window-size changes on, and put the terminal back as it was on
//! every way out: the command ends, a signal (SIGINT, SIGTERM, SIGHUP), an
//! error, or a panic.

use keystone_agent_api::options::TtyOptions;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Mutex;
use std::time::Duration;

use keystone_agent_api::{self as api, ExitCode};
use nix::sys::termios::{self, SetArg, Termios};
use tokio::signal::unix::{SignalKind, signal};

use crate::{Failure, Result};

/// The terminal settings to restore: set while raw mode is on.
static SAVED: Mutex<Option<(RawFd, Termios)>> = Mutex::new(None);

/// Put the saved settings back, if any (idempotent).
fn restore() {
    let saved = SAVED.lock().map(|mut s| s.take()).unwrap_or(None);
    if let Some((fd, t)) = saved {
        // SAFETY: fd 0 stays open for the life of the process.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let _ = termios::tcsetattr(fd, SetArg::TCSANOW, &t);
    }
}

/// Raw mode on stdin for as long as it lives.
struct RawMode;

impl RawMode {
    fn enter(stdin: BorrowedFd<'_>) -> Result<Self> {
        let fail = |e: nix::Error| {
            Failure::new(ExitCode::Failed, format!("cannot set up the terminal: {e}"))
        };
        let orig = termios::tcgetattr(stdin).map_err(fail)?;
        static HOOK: std::sync::Once = std::sync::Once::new();
        HOOK.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                restore();
                previous(info);
            }));
        });
        *SAVED.lock().unwrap() = Some((stdin.as_raw_fd(), orig.clone()));
        let mut raw = orig;
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin, SetArg::TCSANOW, &raw).map_err(|e| {
            restore();
            fail(e)
        })?;
        Ok(Self)
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        restore();
    }
}

/// Rows and columns of the terminal on `fd`.
fn size_of(fd: BorrowedFd<'_>) -> Option<(u16, u16)> {
    let mut ws = nix::libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one winsize to the valid pointer.
    let r = unsafe { nix::libc::ioctl(fd.as_raw_fd(), nix::libc::TIOCGWINSZ, &mut ws) };
    (r == 0 && ws.ws_row > 0 && ws.ws_col > 0).then_some((ws.ws_row, ws.ws_col))
}

fn set_size(fd: BorrowedFd<'_>, (rows, cols): (u16, u16)) {
    let ws = nix::libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one winsize from the valid pointer.
    unsafe { nix::libc::ioctl(fd.as_raw_fd(), nix::libc::TIOCSWINSZ, &ws) };
}

/// The options that describe our terminal to agentd (`rows`, `cols`,
/// `term`), or an error when stdin is not a terminal.
pub fn terminal_options(what: &str) -> Result<TtyOptions> {
    let stdin = std::io::stdin();
    let Some((rows, cols)) = size_of(stdin.as_fd()) else {
        return Err(Failure::new(
            ExitCode::Requirements,
            format!(
                "{what} needs a terminal, and stdin is not one; run it from a terminal \
                 (or use `agentctl exec` without --tty in scripts)"
            ),
        ));
    };
    Ok(TtyOptions {
        rows: Some(rows),
        cols: Some(cols),
        term: std::env::var("TERM").ok().filter(|t| !t.is_empty()),
    })
}

/// Bridge our terminal to `master` until `wait` (the command's exit code)
/// resolves or a signal ends agentctl; returns the exit code.
pub async fn bridge(
    master: OwnedFd,
    wait: impl std::future::Future<Output = std::result::Result<i32, api::Error>>,
) -> Result<i32> {
    let fail = |e: std::io::Error| Failure::new(ExitCode::Failed, format!("terminal: {e}"));
    let stdin = std::io::stdin();
    let raw = RawMode::enter(stdin.as_fd())?;

    // The sandbox's output: a thread, since the master is a blocking
    // descriptor; it ends when the last holder of the other side closes it.
    let mut from = std::fs::File::from(master.try_clone().map_err(fail)?);
    let (out_done_tx, out_done) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 32 * 1024];
        let mut stdout = std::io::stdout().lock();
        while let Ok(n) = from.read(&mut buf) {
            if n == 0
                || stdout
                    .write_all(&buf[..n])
                    .and_then(|()| stdout.flush())
                    .is_err()
            {
                break;
            }
        }
        let _ = out_done_tx.send(());
    });
    // Our keystrokes: a plain thread too, so a blocked terminal read never
    // holds up exit.
    let mut to = std::fs::File::from(master.try_clone().map_err(fail)?);
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        let mut stdin = std::io::stdin().lock();
        while let Ok(n) = stdin.read(&mut buf) {
            if n == 0 || to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
    });

    let mut winch = signal(SignalKind::window_change()).map_err(fail)?;
    let mut int = signal(SignalKind::interrupt()).map_err(fail)?;
    let mut term = signal(SignalKind::terminate()).map_err(fail)?;
    let mut hup = signal(SignalKind::hangup()).map_err(fail)?;
    tokio::pin!(wait);
    let outcome = loop {
        tokio::select! {
            r = &mut wait => break r.map_err(Failure::from),
            _ = winch.recv() => {
                if let Some(size) = size_of(stdin.as_fd()) {
                    set_size(master.as_fd(), size);
                }
            }
            _ = int.recv() => break Ok(130),
            _ = term.recv() => break Ok(143),
            _ = hup.recv() => break Ok(129),
        }
    };
    if outcome.is_ok() {
        // Let the last output (the client's goodbye, its terminal resets)
        // through before the terminal goes back.
        let _ = tokio::time::timeout(Duration::from_millis(500), out_done).await;
    }
    drop(raw);
    outcome
}

//! The processes agentd starts end with it: each is killed (SIGKILL) when
//! agentd ends, however it ends, so nothing it started runs on unowned (a
//! KVM probe's QEMU, a download, an `ssh` session, `mke2fs`). The few
//! meant to outlive agentd say so where they are started: a sandbox's
//! supervisor (adopted by the next agentd, docs/architecture.md) and the
//! `ssh` connection a `vm` or `microvm` guest's sessions share (it ends
//! with its guest).
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that started the child ends,
//! so a child is started on one of tokio's workers (which live as long as
//! agentd) or waited for on the thread that started it (`output()` in
//! `spawn_blocking`). A set-user-ID program (`newuidmap`) drops the signal
//! at its exec; those are waited for at once.

use std::os::unix::process::CommandExt;

/// Make the process `cmd` starts be killed when this process ends, and
/// not start at all when it already has; it also gets the descriptor limit
/// agentd started with ([`crate::budget::restore_inherited_nofile`]).
pub fn end_with_us(cmd: &mut std::process::Command) -> &mut std::process::Command {
    let parent = std::process::id();
    // SAFETY: only async-signal-safe calls (getrlimit, setrlimit, prctl,
    // getppid) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            crate::budget::restore_inherited_nofile()?;
            crate::caps::end_with_parent(parent)
        })
    }
}

//! Starting agentd's helper processes (its own binary in a helper mode) as
//! the uid they act for: a caller, a sandbox's owner, or a sandbox, the
//! last confined to the directories it may see (see [`crate::confine`]).
//! Nothing of agentd's own environment goes along.

use std::ffi::CString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use nix::unistd::{Gid, Uid, User};

/// A command running agentd's own binary (`exe`) as `uid`, with that user's
/// groups. When agentd already runs as `uid`, nothing changes; an
/// unprivileged agentd cannot act for anyone else.
pub fn command_as(exe: &Path, uid: u32) -> Result<tokio::process::Command, String> {
    let mut cmd = tokio::process::Command::new(exe);
    // Only what a helper needs; never agentd's own environment.
    cmd.env_clear()
        .env("PATH", "/run/current-system/sw/bin:/usr/bin:/bin")
        .env("LANG", "C.UTF-8");
    if Uid::effective().as_raw() == uid {
        if let Some(home) = std::env::var_os("HOME") {
            cmd.env("HOME", home);
        }
        return Ok(cmd);
    }
    if !Uid::effective().is_root() {
        return Err(format!(
            "agentd runs as uid {} and cannot act for uid {uid}",
            Uid::effective()
        ));
    }
    let user = User::from_uid(Uid::from_raw(uid)).ok().flatten();
    let gid = user.as_ref().map_or(Gid::from_raw(uid), |u| u.gid);
    let groups: Vec<Gid> = match &user {
        Some(u) => {
            let name = CString::new(u.name.clone()).map_err(|e| e.to_string())?;
            nix::unistd::getgrouplist(&name, gid).unwrap_or_else(|_| vec![gid])
        }
        None => vec![gid],
    };
    if let Some(u) = &user {
        cmd.env("HOME", &u.dir).env("USER", &u.name);
    }
    // Groups first, while still root; then gid, then uid.
    // SAFETY: only async-signal-safe calls (setgroups, setresgid, setresuid)
    // between fork and exec.
    unsafe {
        cmd.as_std_mut().pre_exec(move || {
            nix::unistd::setgroups(&groups)?;
            nix::unistd::setresgid(gid, gid, gid)?;
            nix::unistd::setresuid(Uid::from_raw(uid), Uid::from_raw(uid), Uid::from_raw(uid))?;
            Ok(())
        });
    }
    Ok(cmd)
}

/// A helper command that runs as `uid` but sees only the directories in
/// `keep` (see [`crate::confine`]): for helpers that open a workspace.
/// `uid` is agentd's own, any as root, or (unprivileged) one of agentd's
/// subordinate ids.
pub fn command_confined(
    exe: &Path,
    uid: u32,
    keep: &[PathBuf],
) -> Result<tokio::process::Command, String> {
    let me = Uid::effective();
    let (gid, groups) = if !me.is_root() && me.as_raw() != uid {
        let gid = crate::subid::pool()
            .ok()
            .and_then(|p| p.gid_for(uid))
            .ok_or_else(|| format!("agentd runs as uid {me} and cannot act for uid {uid}"))?;
        (gid, vec![gid])
    } else {
        let user = User::from_uid(Uid::from_raw(uid)).ok().flatten();
        let gid = user.as_ref().map_or(uid, |u| u.gid.as_raw());
        let groups = match &user {
            Some(u) => {
                let name = CString::new(u.name.clone()).map_err(|e| e.to_string())?;
                nix::unistd::getgrouplist(&name, Gid::from_raw(gid))
                    .unwrap_or_else(|_| vec![Gid::from_raw(gid)])
                    .into_iter()
                    .map(Gid::as_raw)
                    .collect()
            }
            None => vec![gid],
        };
        (gid, groups)
    };
    confined(
        exe,
        &crate::confine::Confinement {
            uid,
            gid,
            groups,
            keep: keep.to_vec(),
            also_map: None,
        },
    )
    .map(tokio::process::Command::from)
}

/// A helper command of an unprivileged agentd that stays itself, sees only
/// `keep`, and may hand files to (or remove files of) the sandbox ids
/// `sandbox` (see [`crate::subid`]).
pub fn command_with_ids(
    exe: &Path,
    sandbox: (u32, u32),
    keep: &[PathBuf],
) -> Result<std::process::Command, String> {
    let (uid, gid) = (Uid::effective().as_raw(), Gid::effective().as_raw());
    confined(
        exe,
        &crate::confine::Confinement {
            uid,
            gid,
            groups: vec![gid],
            keep: keep.to_vec(),
            also_map: Some(sandbox),
        },
    )
}

fn confined(exe: &Path, c: &crate::confine::Confinement) -> Result<std::process::Command, String> {
    let mut cmd = std::process::Command::new(exe);
    cmd.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LANG", "C.UTF-8")
        .env("HOME", "/")
        .env(
            crate::confine::CONFINE_ENV,
            serde_json::to_string(c).map_err(|e| e.to_string())?,
        );
    Ok(cmd)
}

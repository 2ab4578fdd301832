//! Who is calling, and what they may read.
//!
//! agentd asks the bus daemon for the caller's uid (never trusting anything
//! the caller says about itself), and checks a project path by opening it in
//! a helper process that runs with the caller's uid and groups.

use std::path::PathBuf;

use nix::unistd::{Gid, Uid, User};

use crate::helper::HelperError;

/// The identity of whoever made a D-Bus call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// The caller's uid as the bus daemon reports it.
    pub uid: u32,
}

impl Caller {
    /// Whether the caller is root.
    #[must_use]
    pub fn is_root(self) -> bool {
        self.uid == 0
    }

    /// Whether the caller may see and act on a sandbox owned by `owner`.
    #[must_use]
    pub fn may_access(self, owner: u32) -> bool {
        self.is_root() || self.uid == owner
    }
}

/// The helper that checks a project as the caller (`agentd __check-project`):
/// the path in, its canonical form out, or what is wrong with it.
#[derive(Debug)]
pub struct CheckProject;

impl crate::helper::Helper for CheckProject {
    const ARG: &'static str = "__check-project";
    const WHAT: &'static str = "project check";
    type Request = PathBuf;
    type Reply = PathBuf;

    fn serve(path: PathBuf, _: &mut crate::helper::Io<'_>) -> Result<PathBuf, HelperError> {
        Ok(crate::git::workspace::check_project(&path)?)
    }
}

/// How long checking a project may take.
pub const CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The host uids (and gids) agentd gives sandboxes when it runs as root:
/// 65,536 ids from `0x70000000`, above the ranges systemd hands to
/// containers (`0x00080000`–`0x6FFFFFFF`) and below the foreign range
/// (`0x7FFE0000`). No account and no other program uses them, so a sandbox's
/// processes and files are nobody else's: not `nobody`'s, not the owner's,
/// not another sandbox's, not another agentd's sandbox's (every agentd of
/// the host claims its ids in one ledger, see [`crate::sandbox::ids`]).
pub const SANDBOX_IDS: std::ops::Range<u32> = 0x7000_0000..0x7001_0000;

/// How a sandbox running as host `uid` is separated, for `agentctl status`:
/// an id of its own, or agentd's own ids and why.
#[must_use]
pub fn describe_ids(uid: u32) -> String {
    let me = Uid::effective();
    if me.is_root() {
        return if SANDBOX_IDS.contains(&uid) {
            format!("uid {uid} of its own")
        } else {
            format!("uid {uid}, not of its own (every sandbox id is in use)")
        };
    }
    if uid != me.as_raw() {
        return format!("uid {uid} of its own");
    }
    let why = crate::subid::pool().err().map_or_else(
        || "every subordinate id is in use, or it was started before ids were granted".to_owned(),
        ToString::to_string,
    );
    format!("uid {uid}, agentd's own (no id of its own: {why})")
}

/// The lowest id of [`SANDBOX_IDS`] that is not in `taken`.
#[must_use]
pub fn free_sandbox_id(taken: &std::collections::HashSet<u32>) -> Option<u32> {
    SANDBOX_IDS.clone().find(|id| !taken.contains(id))
}

/// Host uid and gid that a sandbox of `owner` runs as: the id agentd
/// allocated to it (see [`SANDBOX_IDS`]); without one (a `microvm` guest,
/// whose uid the NixOS module fixes at evaluation time) the owner's ids, but
/// never host root (`nobody` then). An unprivileged agentd uses the
/// subordinate id it allocated (see [`crate::subid`]), else its own ids.
#[must_use]
pub fn sandbox_ids(owner: u32, allocated: Option<u32>) -> (u32, u32) {
    const NOBODY: u32 = 65534;
    if !Uid::effective().is_root() {
        // One of this user's subordinate ids, while they are granted.
        let sub = allocated.and_then(|id| Some((id, crate::subid::pool().ok()?.gid_for(id)?)));
        return sub.unwrap_or((Uid::effective().as_raw(), Gid::effective().as_raw()));
    }
    if let Some(id) = allocated {
        return (id, id);
    }
    if owner == 0 {
        return (NOBODY, NOBODY);
    }
    let gid = User::from_uid(Uid::from_raw(owner))
        .ok()
        .flatten()
        .map_or(owner, |u| u.gid.as_raw());
    (owner, gid)
}

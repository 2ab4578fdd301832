//! What other parts of agentd (SSH) get of a sandbox beside the
//! manager's own verbs: its directory in agentd's state, and a hold that
//! counts as activity for idle stop.

use super::*;

/// Sandbox activity for idle stop while it lives.
pub struct InUse(#[allow(dead_code, reason = "held for its Drop")] idle::Busy);

impl std::fmt::Debug for InUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InUse")
    }
}

impl Manager {
    /// The directory of sandbox `name` in agentd's state (agentd's own
    /// files of it, never the sandbox's), for `caller`, mounted while the
    /// answer lives.
    pub fn private_dir(&self, caller: Caller, name: &str) -> Result<Mounted> {
        self.mounted_now(&self.get(caller, name)?)
    }

    /// Sandbox `name` counts as active (not idle) while the guard lives.
    #[must_use]
    pub fn in_use(&self, name: &str) -> InUse {
        InUse(self.busy(name))
    }
}

//! What each command is, for messages and for the call timeout.

use super::{Command, EgressCommand, WorktreeCommand};

impl Command {
    /// The verb, for messages.
    #[must_use]
    pub fn verb(&self) -> &'static str {
        match self {
            Self::Create { .. } => "create",
            Self::Start { .. } => "start",
            Self::Stop { .. } => "stop",
            Self::Pause { .. } => "pause",
            Self::Snapshot { .. } => "snapshot",
            Self::Snapshots { .. } => "snapshots",
            Self::Restore { .. } => "restore",
            Self::Fork { .. } => "fork",
            Self::Resume { .. } => "resume",
            Self::Destroy { .. } => "destroy",
            Self::List { .. } => "list",
            Self::Status { .. } => "status",
            Self::Sync { .. } => "sync",
            Self::Cp { .. } => "cp",
            Self::History { .. } => "history",
            Self::Worktree(_) => "worktree",
            Self::Set { .. } => "set",
            Self::Egress { .. } => "egress",
            Self::Secret { .. } => "secret",
            Self::Forge { .. } => "forge",
            Self::Attach { .. } => "attach",
            Self::Sessions { .. } => "sessions",
            Self::Replay { .. } => "replay",
            Self::Audit { .. } => "audit",
            Self::Watch { .. } => "watch",
            Self::Ports { .. } => "ports",
            Self::Stats { .. } => "stats",
            Self::Open { .. } => "open",
            Self::Console { .. } => "console",
            Self::KillSession { .. } => "kill-session",
            Self::Doctor { .. } => "doctor",
            Self::Completions { .. } => "completions",
            Self::Manpages { .. } => "manpages",
            Self::Exec { .. } => "exec",
            Self::Ssh { .. } => "ssh",
            Self::SshConfig { .. } => "ssh-config",
            Self::SshProxy { .. } => "ssh-proxy",
        }
    }

    /// Whether the command takes as long as the work it asks for (or waits
    /// for the user), rather than only asking agentd something.
    #[must_use]
    pub fn waits(&self) -> bool {
        match self {
            Self::Create { .. }
            | Self::Start { .. }
            | Self::Stop { .. }
            | Self::Pause { .. }
            | Self::Resume { .. }
            | Self::Snapshot { .. }
            | Self::Restore { .. }
            | Self::Fork { .. }
            | Self::Destroy { .. }
            | Self::Sync { .. }
            | Self::Cp { .. }
            | Self::Secret { .. }
            | Self::Forge { .. }
            | Self::Attach { .. }
            | Self::Exec { .. }
            | Self::Replay { .. }
            | Self::Watch { .. }
            | Self::Stats { follow: true, .. } => true,
            Self::Worktree(w) => !matches!(w, WorktreeCommand::List { .. }),
            Self::Egress { command, .. } => {
                matches!(command, EgressCommand::Log { follow: true, .. })
            }
            _ => false,
        }
    }
}

//! The sandbox state machine: exactly the transitions of the data model.
//!
//! ```text
//! created ─start→ starting ─ok→ running ─stop→ stopping ─done→ stopped
//!                    │            pause↓↑resume ↗stop   │         │
//!                    │              paused              │         │
//!                    └─fail→ error ←──────────fail──────┘         │
//!                            └─start (retry)→ starting ←─start────┘
//! destroy: from created, stopped or error
//! ```
//!
//! `paused` is not in the data model's diagram: it is a running sandbox
//! whose processes are frozen (`agentctl pause`), told apart so that
//! nothing waits on a sandbox that cannot answer.

use keystone_agent_api::SandboxState;

/// Something that moves a sandbox from one state to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A caller asked to start (or retry) the sandbox.
    Start,
    /// The backend reports the sandbox answers on its control channel.
    Started,
    /// The backend failed to bring the sandbox up.
    StartFailed,
    /// A caller asked to stop the sandbox (or its processes ended by
    /// themselves, which agentd treats as a stop that already happened).
    Stop,
    /// No process of the sandbox remains.
    Stopped,
    /// The backend failed to stop the sandbox (its processes may remain;
    /// a retried start or a destroy deals with them).
    StopFailed,
    /// A caller asked to destroy the sandbox.
    Destroy,
    /// A caller asked to freeze the sandbox's processes.
    Pause,
    /// A caller asked to thaw them.
    Resume,
}

impl Event {
    /// The verb a person would use, for error messages.
    #[must_use]
    pub fn verb(self) -> &'static str {
        match self {
            Self::Start => "start",
            Self::Started => "mark as running",
            Self::StartFailed => "mark as failed",
            Self::Stop => "stop",
            Self::Stopped => "mark as stopped",
            Self::StopFailed => "mark as failed to stop",
            Self::Destroy => "destroy",
            Self::Pause => "pause",
            Self::Resume => "resume",
        }
    }
}

/// The outcome of a valid transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// The sandbox moves to this state.
    State(SandboxState),
    /// The sandbox is removed.
    Removed,
}

/// Apply `event` to `state`; `None` when the data model does not allow it.
#[must_use]
pub fn next(state: SandboxState, event: Event) -> Option<Next> {
    use Event as E;
    use SandboxState as S;
    Some(match (state, event) {
        (S::Created | S::Stopped | S::Error, E::Start) => Next::State(S::Starting),
        (S::Starting, E::Started) => Next::State(S::Running),
        (S::Starting, E::StartFailed) => Next::State(S::Error),
        (S::Running | S::Paused, E::Stop) => Next::State(S::Stopping),
        (S::Running, E::Pause) => Next::State(S::Paused),
        (S::Paused, E::Resume) => Next::State(S::Running),
        (S::Stopping, E::Stopped) => Next::State(S::Stopped),
        (S::Stopping, E::StopFailed) => Next::State(S::Error),
        (S::Created | S::Stopped | S::Error, E::Destroy) => Next::Removed,
        _ => return None,
    })
}

/// What a person can do from `state`, for the hint in an InvalidState error.
#[must_use]
pub fn hint(state: SandboxState) -> &'static str {
    match state {
        SandboxState::Created | SandboxState::Stopped => "it can be started or destroyed",
        SandboxState::Error => "it can be started again or destroyed",
        SandboxState::Running => "stop it first",
        SandboxState::Paused => "it is paused: resume it first (agentctl resume)",
        SandboxState::Starting | SandboxState::Stopping => "wait until it settles",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SandboxState as S;

    const EVENTS: [Event; 9] = [
        Event::Start,
        Event::Started,
        Event::StartFailed,
        Event::Stop,
        Event::Stopped,
        Event::StopFailed,
        Event::Destroy,
        Event::Pause,
        Event::Resume,
    ];

    /// The complete table: every (state, event) pair not listed is refused.
    #[test]
    fn exactly_the_data_model_transitions() {
        let allowed = [
            (S::Created, Event::Start, Next::State(S::Starting)),
            (S::Starting, Event::Started, Next::State(S::Running)),
            (S::Starting, Event::StartFailed, Next::State(S::Error)),
            (S::Running, Event::Stop, Next::State(S::Stopping)),
            (S::Running, Event::Pause, Next::State(S::Paused)),
            (S::Paused, Event::Resume, Next::State(S::Running)),
            (S::Paused, Event::Stop, Next::State(S::Stopping)),
            (S::Stopping, Event::Stopped, Next::State(S::Stopped)),
            (S::Stopping, Event::StopFailed, Next::State(S::Error)),
            (S::Stopped, Event::Start, Next::State(S::Starting)),
            (S::Error, Event::Start, Next::State(S::Starting)),
            (S::Created, Event::Destroy, Next::Removed),
            (S::Stopped, Event::Destroy, Next::Removed),
            (S::Error, Event::Destroy, Next::Removed),
        ];
        let mut valid = 0;
        for state in S::ALL {
            for event in EVENTS {
                let expected = allowed
                    .iter()
                    .find(|(s, e, _)| *s == state && *e == event)
                    .map(|(_, _, n)| *n);
                assert_eq!(next(state, event), expected, "{state:?} + {event:?}");
                valid += usize::from(expected.is_some());
            }
        }
        assert_eq!(valid, allowed.len());
    }

    #[test]
    fn running_cannot_be_destroyed_or_started() {
        assert_eq!(next(S::Running, Event::Destroy), None);
        assert_eq!(next(S::Running, Event::Start), None);
        assert_eq!(next(S::Stopped, Event::Stop), None);
    }
}

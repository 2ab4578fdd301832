//! Named D-Bus errors and the exit codes `agentctl` maps them to.

use zbus::DBusError;

/// Every error agentd answers a method call with, named
/// `org.keystone.Agent1.Error.<Variant>` on the bus.
///
/// The description is a complete sentence meant for a person: it names the
/// sandbox, path or ref involved and, where there is one, the fix.
#[derive(DBusError, Debug)]
#[zbus(prefix = "org.keystone.Agent1.Error")]
pub enum Error {
    /// A transport-level failure (the bus, not agentd, answered).
    #[zbus(error)]
    ZBus(zbus::Error),
    /// No sandbox of that name is visible to the caller.
    NotFound(String),
    /// A sandbox of that name already exists.
    AlreadyExists(String),
    /// The operation is not valid in the sandbox's current state.
    InvalidState(String),
    /// The arguments were refused; the description lists every problem.
    InvalidArgument(String),
    /// The caller may not do this to this sandbox.
    PermissionDenied(String),
    /// The backend failed to carry out the operation.
    Backend(String),
    /// The operation did not finish within its time limit.
    Timeout(String),
    /// The operation would lose or overwrite work (diverged branches, a
    /// dirty work tree); the description says how to proceed by hand.
    Conflict(String),
}

/// Process exit codes of `agentctl`, stable for scripts.
///
/// `agentctl exec` exits with the command's own exit code when the command
/// ran; these codes are for agentctl's own failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ExitCode {
    /// Success.
    Ok = 0,
    /// The sandbox (or another named thing) does not exist.
    NotFound = 1,
    /// The sandbox is in a state that does not allow the operation.
    InvalidState = 2,
    /// The operation was attempted and failed (backend error, timeout).
    Failed = 3,
    /// A requirement was not met: invalid arguments, permission denied,
    /// agentd not reachable, name already taken.
    Requirements = 4,
    /// The person declined a confirmation.
    Cancelled = 5,
}

impl Error {
    /// The exit code `agentctl` uses for this error.
    #[must_use]
    pub fn exit_code(&self) -> ExitCode {
        match self {
            Self::NotFound(_) => ExitCode::NotFound,
            Self::InvalidState(_) => ExitCode::InvalidState,
            Self::Backend(_) | Self::Timeout(_) | Self::Conflict(_) => ExitCode::Failed,
            Self::AlreadyExists(_) | Self::InvalidArgument(_) | Self::PermissionDenied(_) => {
                ExitCode::Requirements
            }
            Self::ZBus(e) => match e {
                zbus::Error::MethodError(name, ..)
                    if name.as_str() == "org.freedesktop.DBus.Error.AccessDenied" =>
                {
                    ExitCode::Requirements
                }
                _ => ExitCode::Failed,
            },
        }
    }

    /// The human-readable part of the error, without the D-Bus error name.
    #[must_use]
    pub fn message(&self) -> String {
        match self {
            Self::ZBus(zbus::Error::MethodError(name, Some(desc), _)) => {
                format!("{desc} ({name})")
            }
            Self::ZBus(e) => e.to_string(),
            Self::NotFound(m)
            | Self::AlreadyExists(m)
            | Self::InvalidState(m)
            | Self::InvalidArgument(m)
            | Self::PermissionDenied(m)
            | Self::Backend(m)
            | Self::Timeout(m)
            | Self::Conflict(m) => m.clone(),
        }
    }
}

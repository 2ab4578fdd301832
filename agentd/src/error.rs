//! Errors of agentd's domain. The D-Bus layer maps each to a named error.

use std::path::PathBuf;

use crate::backend::BackendError;
use crate::helper::HelperError;
use crate::registry::RegistryError;

/// Why an operation on a sandbox failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No such sandbox (for this caller).
    #[error("No sandbox named '{0}'; `agentctl list` shows yours")]
    NotFound(String),
    /// Something other than a sandbox does not exist; the text names it.
    #[error("{0}")]
    Missing(String),
    /// The name is taken.
    #[error("A sandbox named '{0}' already exists; choose another name with --name")]
    AlreadyExists(String),
    /// The state machine does not allow the operation now.
    #[error("Cannot {verb} sandbox '{name}': it is {state}; {hint}")]
    InvalidState {
        /// Sandbox name.
        name: String,
        /// What was attempted.
        verb: &'static str,
        /// Its current state.
        state: keystone_agent_api::SandboxState,
        /// What is possible instead.
        hint: &'static str,
    },
    /// The request was refused; every problem is listed.
    #[error("{}", if .0.len() == 1 { .0[0].clone() } else { format!("{} problems:\n  - {}", .0.len(), .0.join("\n  - ")) })]
    Invalid(Vec<String>),
    /// The caller may not do this.
    #[error("{0}")]
    PermissionDenied(String),
    /// The backend failed.
    #[error("Sandbox '{name}': {source}")]
    Backend {
        /// Sandbox name.
        name: String,
        /// What the backend said.
        #[source]
        source: BackendError,
    },
    /// The dev-server proxy (Caddy) failed.
    #[error("Sandbox '{name}': {source}")]
    Proxy {
        /// Sandbox name.
        name: String,
        /// What the proxy said.
        #[source]
        source: crate::proxy::ProxyError,
    },
    /// Preparing, reading or changing the sandbox's directories failed.
    #[error("Cannot prepare the workspace of sandbox '{name}': {source}")]
    Workspace {
        /// Sandbox name.
        name: String,
        /// What went wrong.
        #[source]
        source: WorkspaceError,
    },
    /// A sync failed.
    #[error("Sync of sandbox '{name}' failed: {source}")]
    Sync {
        /// Sandbox name.
        name: String,
        /// What went wrong.
        #[source]
        source: HelperError,
    },
    /// A destroy stopped before it forgot the sandbox: run it again.
    #[error(
        "Destroy of sandbox '{name}' stopped: {reason}. The sandbox is still registered, \
         and may not work until it is destroyed: run `agentctl destroy {name}` again"
    )]
    DestroyStopped {
        /// Sandbox name.
        name: String,
        /// Why.
        reason: String,
    },
    /// A sync would lose or overwrite work; the message says what to do.
    #[error("{0}")]
    Conflict(String),
    /// The registry could not be written.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// A snapshot could not be taken, found, restored or removed.
    #[error("{source}")]
    Snapshot {
        /// Sandbox name.
        name: String,
        /// What went wrong (its text names the sandbox).
        #[source]
        source: crate::snapshots::SnapshotError,
    },
    /// A sandbox's secrets could not be kept (never shows a value).
    #[error("Sandbox '{name}': {source}")]
    Secrets {
        /// Sandbox name.
        name: String,
        /// What went wrong.
        #[source]
        source: crate::secrets::SecretError,
    },
}

/// Why something with a sandbox's directories failed (below
/// [`Error::Workspace`]).
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    /// A directory could not be made.
    #[error("cannot create {}: {source}", path.display())]
    Create {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A mode or owner could not be set.
    #[error("cannot set the owner or permissions of {}: {source}", path.display())]
    Permissions {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The finished workspace could not be moved into place.
    #[error("cannot move {} into place: {source}", path.display())]
    Rename {
        /// The workspace being made.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file agentd keeps about the sandbox could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An empty workspace directory that agentd did not make cannot be
    /// removed to clone into its place.
    #[error(
        "{} is an empty directory agentd did not make, and it cannot be removed ({source}); \
         remove it and start the sandbox again",
        path.display()
    )]
    Foreign {
        /// The directory.
        path: PathBuf,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// What an earlier sandbox of the same name left cannot be removed.
    #[error(
        "{} is left from an earlier sandbox of this name and cannot be removed{}; \
         remove it (as root if need be) and create the sandbox again",
        path.display(),
        source.as_ref().map(|e| format!(" ({e})")).unwrap_or_default()
    )]
    Leftover {
        /// The directory.
        path: PathBuf,
        /// Why, when removing it failed.
        #[source]
        source: Option<std::io::Error>,
    },
    /// A helper failed.
    #[error(transparent)]
    Helper(#[from] HelperError),
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

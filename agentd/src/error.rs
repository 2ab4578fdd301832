//! Errors of agentd's domain. The D-Bus layer maps each to a named error.

use crate::backend::BackendError;
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
    /// Preparing the workspace failed.
    #[error("Cannot prepare the workspace of sandbox '{name}': {message}")]
    Workspace {
        /// Sandbox name.
        name: String,
        /// What went wrong.
        message: String,
    },
    /// A sync failed.
    #[error("Sync of sandbox '{name}' failed: {message}")]
    Sync {
        /// Sandbox name.
        name: String,
        /// What went wrong.
        message: String,
    },
    /// A sync would lose or overwrite work; the message says what to do.
    #[error("{0}")]
    Conflict(String),
    /// The registry could not be written.
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

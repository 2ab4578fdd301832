//! Git: checking a project and preparing a sandbox's workspace from it.

mod into;
pub mod refs;
pub mod snapshot;
pub mod sync;
pub mod transfer;
pub mod tree;
pub mod workspace;
pub mod worktree;

/// Parse a helper's JSON request, reporting a bad one on stderr. Helpers
/// return exit code 1 on `None`.
pub(crate) fn parse_request<T: serde::de::DeserializeOwned>(json: &str) -> Option<T> {
    serde_json::from_str(json)
        .map_err(|e| eprintln!("bad request: {e}"))
        .ok()
}

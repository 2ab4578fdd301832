//! Git: checking a project and preparing a sandbox's workspace from it.

pub mod refs;
pub mod snapshot;
pub mod sync;
pub mod transfer;
pub mod workspace;
pub mod worktree;

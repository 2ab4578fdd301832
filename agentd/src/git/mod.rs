//! Git: checking a project and preparing a sandbox's workspace from it.

pub mod guard;
pub mod identity;
mod into;
pub mod mirror;
pub mod refs;
pub mod remote;
pub mod snapshot;
pub mod sync;
pub mod transfer;
pub mod tree;
pub mod workspace;
pub mod worktree;

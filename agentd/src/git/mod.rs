//! Git: checking a project and preparing a sandbox's workspace from it.

pub mod workspace;

//! Code that runs inside a sandbox, and the protocol agentd speaks with it.
//!
//! agentd re-executes its own binary as `agentd __sandbox-init <state-dir>
//! <name>` to build a local sandbox. That process (the *supervisor*) creates
//! the sandbox's namespaces with `clone`, writes the user-namespace id maps
//! from outside, and reports the init's host pid to agentd. The init (PID 1
//! inside) assembles the sandbox's root file system, forks the *control
//! server*, and then only reaps children and forwards stop signals. The
//! control server answers agentd on a unix socket ([`proto`]).

pub mod init;
mod init_error;
pub mod proto;
mod readonly;
pub mod server;
mod tmpfs;

pub use tmpfs::tmpfs_sizes;

/// argv[1] that makes the agentd binary act as a sandbox supervisor.
pub const INIT_ARG: &str = "__sandbox-init";

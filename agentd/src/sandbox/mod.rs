//! Sandboxes: the record agentd keeps of each, its state machine, the rules
//! for names and settings, and the manager that carries out operations.

pub mod helpers;
pub mod ids;
pub mod manager;
pub mod state;
pub mod store;
pub mod watch;

pub use crate::registry::{Change, Sandbox, timestamp};

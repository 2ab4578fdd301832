//! Sandboxes: the record agentd keeps of each, its state machine, the rules
//! for names and settings, and the manager that carries out operations.

pub mod manager;
pub mod state;
pub mod watch;

use std::path::PathBuf;
use std::time::SystemTime;

use keystone_agent_api::types::Ports;
use keystone_agent_api::{BackendKind, SandboxConfig, SandboxState, SandboxSummary};
use serde::{Deserialize, Serialize};

use crate::backend::Runtime;
use crate::text::micros;

/// A sandbox as agentd records it in the registry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sandbox {
    /// Stable unique id (UUID v4).
    pub id: String,
    /// Unique name (see [`validate::NAME_RULE`]).
    pub name: String,
    /// Absolute path of the host repository.
    pub project_path: PathBuf,
    /// Lifecycle state.
    pub state: SandboxState,
    /// Why the sandbox is in its state; empty when there is nothing to say.
    #[serde(default)]
    pub state_reason: String,
    /// Backend running it.
    pub backend: BackendKind,
    /// Creation time.
    #[serde(with = "timestamp")]
    pub created_at: SystemTime,
    /// Last start time.
    #[serde(default, with = "timestamp::option")]
    pub started_at: Option<SystemTime>,
    /// Settings.
    pub config: SandboxConfig,
    /// Named ports.
    #[serde(default)]
    pub ports: Ports,
    /// Owner's uid.
    pub owner: u32,
    /// The host uid (and gid) its processes and files have, allocated from
    /// [`crate::auth::SANDBOX_IDS`] when agentd runs as root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Declared in agentd's configuration (cannot be destroyed over D-Bus).
    #[serde(default)]
    pub declared: bool,
    /// Creation has not finished: on restart the sandbox is rolled back.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub creating: bool,
    /// Time of the last sync (either direction).
    #[serde(
        default,
        with = "timestamp::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub last_sync_at: Option<SystemTime>,
    /// One line on the last sync's result.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub last_sync_result: String,
    /// What the backend recorded while the sandbox runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<Runtime>,
}

impl Sandbox {
    /// The row `ListSandboxes` returns.
    #[must_use]
    pub fn summary(&self) -> SandboxSummary {
        SandboxSummary {
            name: self.name.clone(),
            id: self.id.clone(),
            state: self.state,
            backend: self.backend,
            project_path: self.project_path.to_string_lossy().into_owned(),
            owner: self.owner,
            created_at: micros(Some(self.created_at)),
            started_at: micros(self.started_at),
            state_reason: self.state_reason.clone(),
            declared: self.declared,
        }
    }
}

/// RFC 3339 timestamps in JSON.
pub mod timestamp {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Serialize as RFC 3339 with microseconds.
    pub fn serialize<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_rfc3339_micros(*t))
    }

    /// Parse RFC 3339.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_rfc3339(&s).map_err(serde::de::Error::custom)
    }

    /// The same for optional timestamps (`null` = never).
    pub mod option {
        use std::time::SystemTime;

        use serde::{Deserialize, Deserializer, Serializer};

        /// Serialize as RFC 3339 or `null`.
        #[allow(clippy::ref_option, reason = "serde's `with` passes a reference")]
        pub fn serialize<S: Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
            match t {
                Some(t) => s.collect_str(&humantime::format_rfc3339_micros(*t)),
                None => s.serialize_none(),
            }
        }

        /// Parse RFC 3339 or `null`.
        pub fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<SystemTime>, D::Error> {
            Option::<String>::deserialize(d)?
                .map(|s| humantime::parse_rfc3339(&s).map_err(serde::de::Error::custom))
                .transpose()
        }
    }
}

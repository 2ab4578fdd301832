//! RFC 3339 timestamps in JSON.

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
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SystemTime>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|s| humantime::parse_rfc3339(&s).map_err(serde::de::Error::custom))
            .transpose()
    }
}

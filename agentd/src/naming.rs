//! Deterministic names and numbers of a declared sandbox's microVM: tap
//! interface, MAC address, IPv4 address and vsock CID.
//!
//! The NixOS module computes the same values in pure Nix
//! (`nixos-modules/lib/naming.nix`); `tests/fixtures/naming.json` holds
//! vectors that both sides are tested against. Everything derives from
//! `h = sha256(name)` in lowercase hex:
//!
//! | value | rule |
//! |---|---|
//! | tap id | `"ks"` + `h[0..13]` (15 characters, the Linux limit) |
//! | MAC | `02:` + `h[13..15]` `:` … `h[21..23]` (locally administered, unicast) |
//! | address | in subnet `A.B.0.0/16`: offset `2 + int(h[23..27]) mod 65533`, `A.B.(offset/256).(offset%256)`; `A.B.0.1` is the host |
//! | vsock CID | `3 + int(h[27..34])` (fits 28 bits; 0–2 are reserved) |

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The subnet the NixOS module uses unless configured otherwise.
pub const DEFAULT_SUBNET: &str = "10.231.0.0/16";

/// The derived values of one sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Names {
    /// Sandbox name.
    pub name: String,
    /// Host tap interface.
    pub tap_id: String,
    /// Guest MAC address.
    pub mac: String,
    /// Guest IPv4 address.
    pub address: String,
    /// Guest vsock CID.
    pub cid: u64,
}

/// A subnet that is not an IPv4 /16 written as `A.B.0.0/16`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("subnet '{subnet}' must be an IPv4 /16 written as A.B.0.0/16")]
pub struct SubnetError {
    /// The subnet as given.
    pub subnet: String,
}

fn hex(s: &str) -> u64 {
    u64::from_str_radix(s, 16).unwrap_or(0)
}

/// The values for sandbox `name` in `subnet` (`A.B.0.0/16`).
///
/// # Errors
/// When `subnet` is not an IPv4 /16 written as `A.B.0.0/16`.
pub fn derive(name: &str, subnet: &str) -> Result<Names, SubnetError> {
    let (a, b) = parse_subnet(subnet)?;
    let h: String = Sha256::digest(name.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let offset = 2 + hex(&h[23..27]) % 65533;
    Ok(Names {
        name: name.to_owned(),
        tap_id: format!("ks{}", &h[0..13]),
        mac: format!(
            "02:{}:{}:{}:{}:{}",
            &h[13..15],
            &h[15..17],
            &h[17..19],
            &h[19..21],
            &h[21..23]
        ),
        address: format!("{a}.{b}.{}.{}", offset / 256, offset % 256),
        cid: 3 + hex(&h[27..34]),
    })
}

/// The host's address in `subnet` (`A.B.0.1`, on the sandboxes' bridge).
///
/// # Errors
/// When `subnet` is not an IPv4 /16 written as `A.B.0.0/16`.
pub fn host_address(subnet: &str) -> Result<std::net::Ipv4Addr, SubnetError> {
    let (a, b) = parse_subnet(subnet)?;
    Ok(std::net::Ipv4Addr::new(a, b, 0, 1))
}

fn parse_subnet(subnet: &str) -> Result<(u8, u8), SubnetError> {
    let bad = || SubnetError {
        subnet: subnet.to_owned(),
    };
    let (addr, len) = subnet.split_once('/').ok_or_else(bad)?;
    let parts: Vec<u8> = addr
        .split('.')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|_| bad())?;
    match (parts.as_slice(), len) {
        ([a, b, 0, 0], "16") => Ok((*a, *b)),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/naming.json")
    }

    const NAMES: &[&str] = &[
        "myproject",
        "api",
        "web-frontend",
        "a",
        "a234567890123456789012345678901",
        "x1-y2",
    ];

    #[test]
    fn values_have_the_documented_shape() {
        for n in NAMES {
            let v = derive(n, DEFAULT_SUBNET).unwrap();
            assert_eq!(v.tap_id.len(), 15);
            assert!(v.mac.starts_with("02:") && v.mac.len() == 17);
            assert!(v.address.starts_with("10.231."));
            assert_ne!(v.address, "10.231.0.1");
            assert!(v.cid >= 3 && v.cid < (1 << 31));
        }
        assert_eq!(
            host_address(DEFAULT_SUBNET).unwrap(),
            std::net::Ipv4Addr::new(10, 231, 0, 1)
        );
        assert!(derive("x", "10.231.0.0/24").is_err());
        assert!(derive("x", "300.1.0.0/16").is_err());
    }

    /// The vectors shared with the Nix side. `KEYSTONE_BLESS=1` rewrites them.
    #[test]
    fn shared_vectors_match() {
        let now: Vec<Names> = NAMES
            .iter()
            .map(|n| derive(n, DEFAULT_SUBNET).unwrap())
            .collect();
        if std::env::var_os("KEYSTONE_BLESS").is_some() {
            let mut text = serde_json::to_string_pretty(&now).unwrap();
            text.push('\n');
            std::fs::write(fixture(), text).unwrap();
        }
        let committed: Vec<Names> =
            serde_json::from_slice(&std::fs::read(fixture()).unwrap()).unwrap();
        assert_eq!(committed, now);
    }
}

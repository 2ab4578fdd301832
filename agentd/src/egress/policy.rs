//! Egress rules and decisions: which destinations a sandbox's connections
//! may reach. Pure functions; the gateway feeds them a name, a port and the
//! addresses it resolved.
//!
//! A decision is made twice: on the name the sandbox asked for (deny rules,
//! then name rules) and again on every resolved address. An address on the
//! host or in a private, loopback, link-local, shared or multicast range is
//! only ever reached through a CIDR entry that contains it, never through a
//! name rule (so a name that resolves, or is rebound, into such a range is
//! refused). An IPv6 address that embeds an IPv4 address (mapped,
//! compatible, translated, NAT64, 6to4) is judged by the IPv4 address it
//! embeds, in both: a translator or a dual-stack socket takes it there.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use keystone_agent_api::Egress;

/// Most entries in one list (allow or deny) of a sandbox.
pub const ENTRIES_MAX: usize = 256;

/// The built-in allowlist: what the agents and the usual tooling need.
/// Replaced by `egress.preset` in agentd's configuration, extended by
/// `egress.extra` and each sandbox's `egress_allow`.
pub const PRESET: &[&str] = &[
    // Agents: Anthropic (Claude Code), OpenAI (Codex), Google (Gemini CLI),
    // with their login endpoints.
    "api.anthropic.com",
    "console.anthropic.com",
    "claude.ai",
    "statsig.anthropic.com",
    "api.openai.com",
    "auth.openai.com",
    "chatgpt.com",
    "generativelanguage.googleapis.com",
    "cloudcode-pa.googleapis.com",
    "oauth2.googleapis.com",
    "accounts.google.com",
    "www.googleapis.com",
    // Package registries.
    "registry.npmjs.org",
    "registry.yarnpkg.com",
    "pypi.org",
    "files.pythonhosted.org",
    "crates.io",
    "index.crates.io",
    "static.crates.io",
    "static.rust-lang.org",
    "proxy.golang.org",
    "sum.golang.org",
    // Distribution mirrors.
    "deb.debian.org",
    "security.debian.org",
    "archive.ubuntu.com",
    "security.ubuntu.com",
    "cache.nixos.org",
    // Forges, over HTTPS and ssh.
    "github.com",
    "*.github.com",
    "*.githubusercontent.com",
    "gitlab.com",
    "*.gitlab.com",
];

/// One allow or deny entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    /// `example.com` (that name) or `*.example.com` (names below it), on
    /// any port or on `port`.
    Name {
        /// Lowercase name without the `*.`.
        name: String,
        /// Whether names below `name` match (and not `name` itself).
        wildcard: bool,
        /// The only port it admits, if any.
        port: Option<u16>,
    },
    /// `10.0.0.0/8` or `192.0.2.1/32:443`: addresses in a range.
    Cidr {
        /// Network address.
        net: IpAddr,
        /// Prefix length.
        prefix: u8,
        /// The only port it admits, if any.
        port: Option<u16>,
    },
}

/// An egress entry that does not parse, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "egress entry '{}' {why} (examples: example.com, *.example.com, example.com:22, 10.0.0.0/8, 192.0.2.1/32:443, [fd00::]/8:443)",
    entry.escape_debug()
)]
pub struct BadRule {
    /// The entry as given.
    pub entry: String,
    /// What is wrong with it: `is not an address range`, ...
    pub why: &'static str,
}

impl Rule {
    /// Parse an entry; the error says what is wrong with it.
    pub fn parse(entry: &str) -> Result<Self, BadRule> {
        let bad = |why: &'static str| {
            Err(BadRule {
                entry: entry.to_owned(),
                why,
            })
        };
        if entry.is_empty() || entry.len() > 260 {
            return bad("must be 1 to 260 characters");
        }
        // Split off a port: `host:port`, `cidr:port`, `[v6]/len:port`.
        let (body, port) = match entry.rsplit_once(':') {
            Some((b, p))
                if !b.is_empty()
                    && p.bytes().all(|c| c.is_ascii_digit())
                    && (!b.contains(':') || b.ends_with(']') || b.contains("]/")) =>
            {
                match p.parse::<u16>() {
                    Ok(0) | Err(_) => return bad("has a port that is not 1 to 65535"),
                    Ok(p) => (b, Some(p)),
                }
            }
            _ => (entry, None),
        };
        if let Some((addr, len)) = body.split_once('/') {
            let addr = addr.trim_start_matches('[').trim_end_matches(']');
            let Ok(net) = addr.parse::<IpAddr>() else {
                return bad("is not an address range");
            };
            let max = if net.is_ipv4() { 32 } else { 128 };
            let prefix = match len.parse::<u8>() {
                Ok(l) if l <= max => l,
                _ => return bad("has a prefix length out of range"),
            };
            return Ok(Self::Cidr {
                net: mask(net, prefix),
                prefix,
                port,
            });
        }
        let body = body.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = body.parse::<IpAddr>() {
            let prefix = if ip.is_ipv4() { 32 } else { 128 };
            return Ok(Self::Cidr {
                net: ip,
                prefix,
                port,
            });
        }
        let (wildcard, name) = match body.strip_prefix("*.") {
            Some(n) => (true, n),
            None => (false, body),
        };
        let name = name.to_ascii_lowercase();
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if name.len() > 253 || !name.split('.').all(label_ok) {
            return bad("is not a host name, a host:port or an address range");
        }
        Ok(Self::Name {
            name,
            wildcard,
            port,
        })
    }

    fn port_ok(port: Option<u16>, asked: u16) -> bool {
        port.is_none_or(|p| p == asked)
    }

    /// Whether this (name) rule admits `host:port`.
    fn matches_name(&self, host: &str, asked: u16) -> bool {
        match self {
            Self::Name {
                name,
                wildcard,
                port,
            } => {
                Self::port_ok(*port, asked)
                    && if *wildcard {
                        host.strip_suffix(name.as_str())
                            .is_some_and(|rest| rest.len() > 1 && rest.ends_with('.'))
                    } else {
                        host == name
                    }
            }
            Self::Cidr { .. } => false,
        }
    }

    /// Whether this (CIDR) rule contains `addr` on `port`, by the IPv4
    /// address it embeds if any ([`canonical`]).
    fn matches_addr(&self, addr: IpAddr, asked: u16) -> bool {
        match self {
            Self::Cidr { net, prefix, port } => {
                Self::port_ok(*port, asked) && in_range(canonical(addr), *net, *prefix)
            }
            Self::Name { .. } => false,
        }
    }

    /// Whether this (CIDR) rule contains `addr` on `port` as it is or by
    /// the IPv4 address it embeds (what a deny entry refuses).
    fn matches_either(&self, addr: IpAddr, asked: u16) -> bool {
        match self {
            Self::Cidr { net, prefix, port } => {
                Self::port_ok(*port, asked)
                    && (in_range(addr, *net, *prefix) || in_range(canonical(addr), *net, *prefix))
            }
            Self::Name { .. } => false,
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Name {
                name,
                wildcard,
                port,
            } => {
                if *wildcard {
                    f.write_str("*.")?;
                }
                f.write_str(name)?;
                if let Some(p) = port {
                    write!(f, ":{p}")?;
                }
                Ok(())
            }
            Self::Cidr { net, prefix, port } => {
                match (net, port) {
                    (IpAddr::V6(a), Some(_)) => write!(f, "[{a}]/{prefix}")?,
                    _ => write!(f, "{net}/{prefix}")?,
                }
                if let Some(p) = port {
                    write!(f, ":{p}")?;
                }
                Ok(())
            }
        }
    }
}

/// `addr` with the bits past `prefix` cleared.
fn mask(addr: IpAddr, prefix: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => {
            let m = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(u32::from(a) & m))
        }
        IpAddr::V6(a) => {
            let m = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(u128::from(a) & m))
        }
    }
}

fn in_range(addr: IpAddr, net: IpAddr, prefix: u8) -> bool {
    addr.is_ipv4() == net.is_ipv4() && mask(addr, prefix) == net
}

/// The IPv4 address an IPv6 address embeds, where its prefix says it
/// carries one: IPv4-mapped (`::ffff:0:0/96`), IPv4-compatible (`::/96`,
/// but for `::` and `::1`), IPv4-translated (`::ffff:0:0:0/96`), NAT64
/// (`64:ff9b::/96`, and the local-use `64:ff9b:1::/48` by its last 32
/// bits, as in a /96 under it) and 6to4 (`2002::/16`, bits 16 to 48).
fn embedded_v4(a: Ipv6Addr) -> Option<Ipv4Addr> {
    let o = a.octets();
    let low = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
    match a.segments() {
        [0, 0, 0, 0, 0, 0xffff, _, _]
        | [0, 0, 0, 0, 0xffff, 0, _, _]
        | [0x64, 0xff9b, 0, 0, 0, 0, _, _]
        | [0x64, 0xff9b, 1, ..] => Some(low),
        [0, 0, 0, 0, 0, 0, _, _] if !a.is_unspecified() && !a.is_loopback() => Some(low),
        [0x2002, ..] => Some(Ipv4Addr::new(o[2], o[3], o[4], o[5])),
        _ => None,
    }
}

/// An address as policy judges it: an IPv6 address that embeds an IPv4
/// address ([`embedded_v4`]) as that IPv4 address.
fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(a) => embedded_v4(a).map_or(addr, IpAddr::V4),
        v4 => v4,
    }
}

/// Ranges no name rule reaches: the host's loopback, private, shared,
/// link-local (cloud metadata included), multicast, reserved,
/// documentation, IPv4-compatible and translation (NAT64, 6to4, Teredo)
/// ranges.
const NEVER_BY_NAME: &[(&str, u8)] = &[
    ("0.0.0.0", 8),
    ("10.0.0.0", 8),
    ("100.64.0.0", 10),
    ("127.0.0.0", 8),
    ("169.254.0.0", 16),
    ("172.16.0.0", 12),
    ("192.0.0.0", 24),
    ("192.168.0.0", 16),
    ("198.18.0.0", 15),
    ("224.0.0.0", 4),
    ("240.0.0.0", 4),
    ("192.0.2.0", 24),
    ("198.51.100.0", 24),
    ("203.0.113.0", 24),
    ("::", 96),
    ("100::", 64),
    ("2001::", 32),
    ("2001:db8::", 32),
    ("64:ff9b::", 96),
    ("64:ff9b:1::", 48),
    ("2002::", 16),
    ("fc00::", 7),
    ("fe80::", 10),
    ("fec0::", 10),
    ("ff00::", 8),
];

/// Whether `addr`, as it is or by the IPv4 address it embeds, is in a
/// range that only a CIDR entry may open.
#[must_use]
pub fn is_internal(addr: IpAddr) -> bool {
    NEVER_BY_NAME.iter().any(|(net, prefix)| {
        let net: IpAddr = net.parse().expect("a valid built-in range");
        in_range(addr, net, *prefix) || in_range(canonical(addr), net, *prefix)
    })
}

/// Whether `addr` is this host itself: one of `own` (its addresses), or a
/// loopback, unspecified (`0.0.0.0/8`, `::`) or link-local address (the
/// host's, or its cloud's metadata service), as it is or by the IPv4
/// address it embeds.
#[must_use]
pub fn is_this_host(addr: IpAddr, own: &[IpAddr]) -> bool {
    let a = canonical(addr);
    own.iter().any(|&h| canonical(h) == a)
        || a.is_loopback()
        || match a {
            IpAddr::V4(v4) => v4.octets()[0] == 0 || v4.is_link_local(),
            IpAddr::V6(v6) => v6.is_unspecified() || v6.segments()[0] & 0xffc0 == 0xfe80,
        }
}

/// The entries of `list` that parse.
#[must_use]
pub fn parse_all(list: &[String]) -> Vec<Rule> {
    list.iter().filter_map(|e| Rule::parse(e).ok()).collect()
}

/// A name as rules match it: lowercase, without the root's trailing dot
/// (`Example.COM.` is `example.com`).
fn normal_name(host: &str) -> String {
    host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase()
}

/// A sandbox's policy as the gateway applies it.
#[derive(Debug, Clone)]
pub struct Policy {
    /// The mode.
    pub mode: Egress,
    /// Allow entries: the preset (for `allowlist`), the configuration's
    /// extras and the sandbox's own.
    pub allow: Vec<Rule>,
    /// Deny entries (checked first).
    pub deny: Vec<Rule>,
}

/// The outcome for one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Admitted or not.
    pub allowed: bool,
    /// The rule that decided, as written (`mode:open`, `default`, ...).
    pub rule: String,
    /// Why, for a refusal.
    pub reason: String,
    /// The entry that would allow it, when it is not the name and port
    /// asked for (an address range for an internal address).
    pub suggest: Option<String>,
}

impl Decision {
    fn allow(rule: impl Into<String>) -> Self {
        Self {
            allowed: true,
            rule: rule.into(),
            reason: String::new(),
            suggest: None,
        }
    }

    fn deny(rule: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            allowed: false,
            rule: rule.into(),
            reason: reason.into(),
            suggest: None,
        }
    }
}

impl Policy {
    /// Build the policy from the parsed `preset` and a sandbox's entries;
    /// entries that do not parse are skipped (they were checked when they
    /// were set).
    #[must_use]
    pub fn new(mode: Egress, preset: &[Rule], allow: &[String], deny: &[String]) -> Self {
        let mut rules = if matches!(mode, Egress::Allowlist | Egress::Ask) {
            preset.to_vec()
        } else {
            Vec::new()
        };
        rules.extend(parse_all(allow));
        Self {
            mode,
            allow: rules,
            deny: parse_all(deny),
        }
    }

    /// This policy with `rule` allowed too (an `allow --once`).
    #[must_use]
    pub fn with(&self, rule: Rule) -> Self {
        let mut p = self.clone();
        p.allow.push(rule);
        p
    }

    /// Whether a refusal by `d` may wait for the person instead (mode
    /// `ask`, and only for destinations that are simply not listed).
    #[must_use]
    pub fn may_ask(&self, d: &Decision) -> bool {
        self.mode == Egress::Ask && !d.allowed && d.rule == "default"
    }

    /// First look, on the name (or literal address) asked for: `Some` when
    /// that alone decides (a refusal), `None` to go on and resolve.
    #[must_use]
    pub fn precheck(&self, host: &str, port: u16) -> Option<Decision> {
        if self.mode == Egress::None {
            return Some(Decision::deny(
                "mode:none",
                "this sandbox's egress is 'none'",
            ));
        }
        let host = normal_name(host);
        if let Some(r) = self.deny.iter().find(|r| r.matches_name(&host, port)) {
            return Some(Decision::deny(
                format!("deny {r}"),
                format!("{host} is on the deny list"),
            ));
        }
        None
    }

    /// The decision for `host:port` now resolved to `addrs`, and the
    /// addresses that may be dialled (in the resolver's order).
    #[must_use]
    pub fn decide(
        &self,
        host: &str,
        port: u16,
        addrs: &[IpAddr],
        host_own: &[IpAddr],
    ) -> (Decision, Vec<IpAddr>) {
        if let Some(d) = self.precheck(host, port) {
            return (d, Vec::new());
        }
        let host = normal_name(host);
        let by_name = self.allow.iter().find(|r| r.matches_name(&host, port));
        let mut ok = Vec::new();
        let mut first_rule: Option<String> = None;
        let mut refused: Option<Decision> = None;
        for &a in addrs {
            if let Some(r) = self.deny.iter().find(|r| r.matches_either(a, port)) {
                refused.get_or_insert(Decision::deny(
                    format!("deny {r}"),
                    format!("{host} resolves to {a}, which is on the deny list"),
                ));
                continue;
            }
            if let Some(r) = self.allow.iter().find(|r| r.matches_addr(a, port)) {
                first_rule.get_or_insert_with(|| r.to_string());
                ok.push(a);
                continue;
            }
            if by_name.is_none() && self.mode != Egress::Open {
                refused.get_or_insert(Decision::deny(
                    "default",
                    format!("{host}:{port} is not on this sandbox's allowlist"),
                ));
                continue;
            }
            let own = host_own
                .iter()
                .any(|&h| h == a || canonical(h) == canonical(a));
            if is_internal(a) || own {
                let bits = if canonical(a).is_ipv4() { 32 } else { 128 };
                let mut d = Decision::deny(
                    "internal",
                    format!(
                        "{host} resolves to {a}, an address of this host or a private range; only an address-range entry may allow it"
                    ),
                );
                d.suggest = Some(match canonical(a) {
                    IpAddr::V6(v6) => format!("[{v6}]/{bits}:{port}"),
                    v4 => format!("{v4}/{bits}:{port}"),
                });
                refused.get_or_insert(d);
                continue;
            }
            first_rule.get_or_insert_with(|| {
                by_name.map_or_else(|| "mode:open".to_owned(), ToString::to_string)
            });
            ok.push(a);
        }
        if let Some(rule) = first_rule {
            (Decision::allow(rule), ok)
        } else if let Some(d) = refused {
            (d, Vec::new())
        } else {
            (
                Decision::deny("unresolved", format!("{host} has no address")),
                Vec::new(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn policy(mode: Egress, allow: &[&str], deny: &[&str]) -> Policy {
        let v = |l: &[&str]| l.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        Policy::new(
            mode,
            &parse_all(&v(&["github.com", "*.npmjs.org"])),
            &v(allow),
            &v(deny),
        )
    }

    #[test]
    fn entries_parse_and_print_back() {
        for e in [
            "example.com",
            "*.example.com",
            "example.com:22",
            "10.0.0.0/8",
            "192.0.2.1/32:443",
            "[fd00::]/8:443",
            "fd00::/8",
        ] {
            let r = Rule::parse(e).unwrap();
            assert_eq!(Rule::parse(&r.to_string()).unwrap(), r, "{e}");
        }
        assert_eq!(Rule::parse("10.1.2.3/8").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(
            Rule::parse("127.0.0.1").unwrap().to_string(),
            "127.0.0.1/32"
        );
        for bad in [
            "",
            "exa mple.com",
            "example.com:0",
            "example.com:70000",
            "10.0.0.0/33",
            "-x.com",
            "a/b",
            "*.",
            "http://example.com",
        ] {
            assert!(Rule::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_match_exactly_or_below_a_wildcard() {
        let p = policy(Egress::Allowlist, &["example.com:22"], &[]);
        let public = [ip("140.82.112.3")];
        assert!(p.decide("github.com", 443, &public, &[]).0.allowed);
        assert!(p.decide("GitHub.com", 22, &public, &[]).0.allowed);
        assert!(!p.decide("evilgithub.com", 443, &public, &[]).0.allowed);
        assert!(p.decide("registry.npmjs.org", 443, &public, &[]).0.allowed);
        assert!(!p.decide("npmjs.org", 443, &public, &[]).0.allowed);
        assert!(
            !p.decide("x.npmjs.org.evil.com", 443, &public, &[])
                .0
                .allowed
        );
        assert!(p.decide("example.com", 22, &public, &[]).0.allowed);
        let (d, _) = p.decide("example.com", 443, &public, &[]);
        assert_eq!((d.allowed, d.rule.as_str()), (false, "default"));
    }

    #[test]
    fn a_name_never_reaches_the_host_or_a_private_range() {
        let p = policy(Egress::Open, &[], &[]);
        for a in [
            "127.0.0.1",
            "10.1.2.3",
            "172.20.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "fd12::1",
            "::ffff:127.0.0.1",
            "::127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2001::1",
        ] {
            let (d, ok) = p.decide("github.com", 443, &[ip(a)], &[]);
            assert!(!d.allowed && ok.is_empty(), "{a}: {d:?}");
            assert_eq!(d.rule, "internal");
        }
        // The host's own public address too.
        let (d, _) = p.decide(
            "me.example",
            443,
            &[ip("203.0.113.7")],
            &[ip("203.0.113.7")],
        );
        assert!(!d.allowed);
        // A mix keeps only the public address.
        let (d, ok) = p.decide(
            "github.com",
            443,
            &[ip("10.0.0.1"), ip("140.82.112.3")],
            &[],
        );
        assert!(d.allowed);
        assert_eq!(ok, [ip("140.82.112.3")]);
    }

    #[test]
    fn only_a_cidr_entry_opens_an_internal_address() {
        let p = policy(Egress::Allowlist, &["127.0.0.1/32:8443"], &[]);
        let (d, ok) = p.decide("origin.test", 8443, &[ip("127.0.0.1")], &[ip("127.0.0.1")]);
        assert!(d.allowed, "{d:?}");
        assert_eq!(d.rule, "127.0.0.1/32:8443");
        assert_eq!(ok, [ip("127.0.0.1")]);
        assert!(
            !p.decide("origin.test", 8444, &[ip("127.0.0.1")], &[])
                .0
                .allowed
        );
        assert!(
            !p.decide("origin.test", 8443, &[ip("127.0.0.2")], &[])
                .0
                .allowed
        );
    }

    #[test]
    fn deny_wins_and_none_refuses_everything() {
        let p = policy(Egress::Allowlist, &[], &["github.com", "140.82.0.0/16"]);
        let d = p.precheck("github.com", 443).unwrap();
        assert_eq!(d.rule, "deny github.com");
        // The root's trailing dot changes nothing.
        let d = p.precheck("GitHub.com.", 443).unwrap();
        assert_eq!(d.rule, "deny github.com");
        let (d, _) = p.decide("api.github.com", 443, &[ip("140.82.1.1")], &[]);
        assert_eq!(d.rule, "deny 140.82.0.0/16");
        let none = policy(Egress::None, &["*.com"], &[]);
        assert_eq!(none.precheck("x.com", 443).unwrap().rule, "mode:none");
        // `open` does not need the preset; `allowlist` starts from it.
        assert!(policy(Egress::Open, &[], &[]).allow.is_empty());
    }

    /// Every way an IPv6 address embeds an IPv4 one, around the host's
    /// loopback, a private range and cloud metadata: refused by name (in
    /// `open` mode too), opened by the IPv4 range that holds what they
    /// embed, and refused by an IPv4 deny entry that holds it.
    #[test]
    fn an_ipv4_address_inside_ipv6_is_judged_as_that_ipv4_address() {
        let forms = |v4: &str| {
            let o = v4.parse::<Ipv4Addr>().unwrap().octets();
            let (hi, lo) = (
                u16::from_be_bytes([o[0], o[1]]),
                u16::from_be_bytes([o[2], o[3]]),
            );
            [
                format!("::ffff:{hi:x}:{lo:x}"),
                format!("::{hi:x}:{lo:x}"),
                format!("::ffff:0:{hi:x}:{lo:x}"),
                format!("64:ff9b::{hi:x}:{lo:x}"),
                format!("64:ff9b:1::{hi:x}:{lo:x}"),
                format!("64:ff9b:1:ab::{hi:x}:{lo:x}"),
                format!("2002:{hi:x}:{lo:x}::1"),
                format!("2002:{hi:x}:{lo:x}:ab::"),
            ]
        };
        let open = policy(Egress::Open, &[], &[]);
        // The host's loopback in the translated form, by name in `open`.
        let (d, ok) = open.decide("evil.example", 80, &[ip("::ffff:0:7f00:1")], &[]);
        assert!(!d.allowed && ok.is_empty(), "{d:?}");
        for v4 in ["127.0.0.1", "10.1.2.3", "169.254.169.254", "192.168.0.7"] {
            for a in forms(v4) {
                assert_eq!(embedded_v4(a.parse().unwrap()), v4.parse().ok(), "{a}");
                let (d, ok) = open.decide("github.com", 443, &[ip(&a)], &[]);
                assert!(!d.allowed && ok.is_empty(), "{a}: {d:?}");
                assert_eq!(d.rule, "internal", "{a}");
                assert_eq!(d.suggest, Some(format!("{v4}/32:443")), "{a}");
                // The suggested entry opens it.
                let cidr = policy(Egress::Allowlist, &[&format!("{v4}/32:443")], &[]);
                let (d, ok) = cidr.decide("origin.test", 443, &[ip(&a)], &[]);
                assert!(d.allowed && ok == [ip(&a)], "{a}: {d:?}");
                // An IPv4 deny entry refuses it, even where a name allows.
                let deny = policy(Egress::Open, &["*.test"], &[&format!("{v4}/32")]);
                let (d, _) = deny.decide("x.test", 443, &[ip(&a)], &[]);
                assert_eq!(d.rule, format!("deny {v4}/32"), "{a}");
            }
        }
        // The host's own address, embedded.
        for a in forms("140.82.112.9") {
            let (d, _) = open.decide("me.example", 443, &[ip(&a)], &[ip("140.82.112.9")]);
            assert!(!d.allowed, "{a}: {d:?}");
        }
        // A public address in a mapped or translated form goes by name as
        // the public address would; the translation ranges never do.
        for a in ["::ffff:140.82.112.3", "::ffff:0:8c52:7003"] {
            assert!(
                open.decide("github.com", 443, &[ip(a)], &[]).0.allowed,
                "{a}"
            );
        }
        for a in ["64:ff9b::8c52:7003", "2002:8c52:7003::1", "::8c52:7003"] {
            assert!(
                !open.decide("github.com", 443, &[ip(a)], &[]).0.allowed,
                "{a}"
            );
        }
        // `::` and `::1` are IPv6's own, not embeddings.
        assert_eq!(embedded_v4(Ipv6Addr::LOCALHOST), None);
        assert_eq!(embedded_v4(Ipv6Addr::UNSPECIFIED), None);
        assert_eq!(embedded_v4("2001:db8::7f00:1".parse().unwrap()), None);
    }
}

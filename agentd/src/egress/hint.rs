//! The command that admits a refused or waiting connection, with the real
//! sandbox and entry filled in: the gateway puts it in the refusal's
//! `403` body and in the log entry (`command`), so `agentctl egress NAME
//! log` and `agentctl status` can show it where an HTTPS client shows only
//! `403`.

use std::net::IpAddr;

use super::policy::{self, Decision, Policy, Rule};

/// The entry that names `host:port`: the bare name for the web's ports (80
/// and 443), `host:port` otherwise (an IPv6 address in brackets).
#[must_use]
pub fn entry_for(host: &str, port: u16) -> String {
    if port == 80 || port == 443 {
        return host.to_owned();
    }
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.parse::<std::net::Ipv6Addr>().is_ok() {
        format!("[{bare}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The one entry that, allowed as `ChangeEgress("allow", …)` allows it
/// (taken off the deny entries, put on the allow entries), admits
/// `host:port` refused by `refusal` under `policy`: the deny entry that
/// refused it, its name, or the address range an internal address needs.
/// `found` is what the name resolved to (`None` when it was refused before
/// resolving, by its name); `vouched`: the owner gave those addresses (the
/// name is in agentd's `egress.hosts`), not DNS or the sandbox. `None` when
/// no entry would do (mode `none`, a name without an address), and never
/// one that admits more than the destination asked for or opens this host
/// to a name the sandbox chose:
/// - a deny entry is offered only when it names just this destination (a
///   name without `*.`, one address): a wider one (`*.example.com`,
///   `10.0.0.0/8`, `0.0.0.0/0`) would let in all it covers;
/// - an address of this host ([`policy::is_this_host`]: its own, loopback,
///   link-local such as cloud metadata) only for a vouched name: a DNS
///   name of the sandbox's choosing may point anywhere, and the command
///   would show an address the person cannot tell from any other.
#[must_use]
pub fn remedy(
    policy: &Policy,
    refusal: &Decision,
    host: &str,
    port: u16,
    found: Option<&[IpAddr]>,
    own: &[IpAddr],
    vouched: bool,
) -> Option<String> {
    let mut candidates: Vec<String> = Vec::new();
    if let Some(denied) = refusal.rule.strip_prefix("deny ") {
        // The deny entry stays unless it is the one allowed: without it,
        // no entry admits the destination.
        match Rule::parse(denied) {
            Ok(rule) if names_one(&rule) => candidates.push(denied.to_owned()),
            _ => return None,
        }
    }
    candidates.push(entry_for(host, port));
    candidates.extend(refusal.suggest.clone());
    let mut i = 0;
    // A name entry may lead to an address-range suggestion, once.
    while i < candidates.len().min(4) {
        let candidate = candidates[i].clone();
        i += 1;
        let Ok(rule) = Rule::parse(&candidate) else {
            continue;
        };
        let mut allowing = policy.clone();
        allowing.deny.retain(|d| *d != rule);
        let allowing = allowing.with(rule);
        let Some(found) = found else {
            if allowing.precheck(host, port).is_none() {
                return Some(candidate);
            }
            continue;
        };
        let (d, admitted) = allowing.decide(host, port, found, own);
        if d.allowed {
            if !vouched && admitted.iter().any(|&a| policy::is_this_host(a, own)) {
                continue;
            }
            return Some(candidate);
        }
        if let Some(s) = d.suggest.filter(|s| !candidates.contains(s)) {
            candidates.push(s);
        }
    }
    None
}

/// Whether `rule` covers one destination only: a name without `*.`, or a
/// single address.
fn names_one(rule: &Rule) -> bool {
    match rule {
        Rule::Name { wildcard, .. } => !wildcard,
        Rule::Cidr { net, prefix, .. } => *prefix == if net.is_ipv4() { 32 } else { 128 },
    }
}

/// `agentctl egress SANDBOX allow [--once] ENTRY`, ready to paste into a
/// POSIX shell (an entry with a `*` or brackets is quoted).
#[must_use]
pub fn command(sandbox: &str, entry: &str, once: bool) -> String {
    let once = if once { " --once" } else { "" };
    format!(
        "agentctl egress {} allow{once} {}",
        quoted(sandbox),
        quoted(entry)
    )
}

/// `word` as one shell word.
fn quoted(word: &str) -> String {
    let plain = |b: u8| b.is_ascii_alphanumeric() || b"._:/@-".contains(&b);
    if !word.is_empty() && word.bytes().all(plain) {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keystone_agent_api::Egress;

    fn policy(mode: Egress, allow: &[&str], deny: &[&str]) -> Policy {
        let list = |l: &[&str]| l.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let preset = super::super::policy::parse_all(&list(&["github.com"]));
        Policy::new(mode, &preset, &list(allow), &list(deny))
    }

    /// What the gateway would decide, and the entry that fixes it.
    fn fix(p: &Policy, host: &str, port: u16, found: &[IpAddr]) -> Option<String> {
        fix_on(p, host, port, found, &[], false)
    }

    /// [`fix`] on a host with addresses `own`, for a name `vouched` for.
    fn fix_on(
        p: &Policy,
        host: &str,
        port: u16,
        found: &[IpAddr],
        own: &[IpAddr],
        vouched: bool,
    ) -> Option<String> {
        let d = match p.precheck(host, port) {
            Some(d) => return remedy(p, &d, host, port, None, own, vouched),
            None => p.decide(host, port, found, own).0,
        };
        assert!(!d.allowed, "{host}:{port} is allowed already");
        let entry = remedy(p, &d, host, port, Some(found), own, vouched)?;
        // The entry does admit it.
        let mut fixed = p.clone();
        let rule = Rule::parse(&entry).unwrap();
        fixed.deny.retain(|r| *r != rule);
        assert!(fixed.with(rule).decide(host, port, found, own).0.allowed);
        Some(entry)
    }

    #[test]
    fn the_entry_is_the_one_that_admits_the_connection() {
        let public: IpAddr = [93, 184, 215, 14].into();
        let private: IpAddr = [10, 1, 2, 3].into();
        let p = policy(Egress::Allowlist, &[], &[]);
        assert_eq!(
            fix(&p, "example.com", 443, &[public]).as_deref(),
            Some("example.com")
        );
        assert_eq!(
            fix(&p, "example.com", 8080, &[public]).as_deref(),
            Some("example.com:8080")
        );
        // A name of a private address needs its range, not its name.
        assert_eq!(
            fix(&p, "git.internal", 443, &[private]).as_deref(),
            Some("10.1.2.3/32:443")
        );
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(
            fix(&p, "2001:db8::1", 8443, &[v6]).as_deref(),
            Some("[2001:db8::1]:8443")
        );
        // A deny entry of just this destination is moved to the allow
        // entries.
        let p = policy(Egress::Allowlist, &[], &["a.example.com"]);
        assert_eq!(
            fix(&p, "a.example.com", 443, &[public]).as_deref(),
            Some("a.example.com")
        );
        let p = policy(Egress::Ask, &[], &["93.184.215.14/32:443"]);
        assert_eq!(
            fix(&p, "github.com", 443, &[public]).as_deref(),
            Some("93.184.215.14/32:443")
        );
        // Nothing admits a connection in mode none, or a name without an
        // address.
        let p = policy(Egress::None, &[], &[]);
        assert_eq!(fix(&p, "example.com", 443, &[public]), None);
        let p = policy(Egress::Allowlist, &[], &[]);
        assert_eq!(fix(&p, "example.com", 443, &[]), None);
    }

    /// The sandbox picks a destination that a wide deny entry refuses:
    /// moving that entry would let in all it covers (every name below a
    /// wildcard; with a range, every address in it on every port, the
    /// host's own and private ones included), so no command is offered.
    #[test]
    fn a_wide_deny_entry_is_never_offered() {
        let public: IpAddr = [93, 184, 215, 14].into();
        let private: IpAddr = [10, 1, 2, 3].into();
        for (deny, host, found) in [
            ("*.example.com", "a.example.com", public),
            ("93.184.215.0/24", "github.com", public),
            ("10.0.0.0/8", "10.1.2.3", private),
            ("0.0.0.0/0", "git.internal", private),
            ("[::]/0", "2001:db8::1", "2001:db8::1".parse().unwrap()),
        ] {
            for mode in [Egress::Allowlist, Egress::Ask, Egress::Open] {
                let p = policy(mode, &["*.internal"], &[deny]);
                assert_eq!(fix(&p, host, 443, &[found]), None, "{deny} {host}");
            }
        }
    }

    /// A name the sandbox had DNS point at this host (loopback, the host's
    /// own public address, link-local cloud metadata, in any IPv6 form):
    /// the command would open the host to it while showing only an
    /// address. Only the owner's own name for it (`egress.hosts`) gets
    /// one; a private range elsewhere keeps its command.
    #[test]
    fn a_name_pointed_at_this_host_gets_no_command_unless_the_owner_named_it() {
        let own: IpAddr = [203, 0, 113, 7].into();
        let v6_own: IpAddr = "2a01:4f8::7".parse().unwrap();
        for found in [
            "127.0.0.1",
            "127.0.1.1",
            "::1",
            "::ffff:127.0.0.1",
            "0.0.0.0",
            "169.254.169.254",
            "fe80::1",
            "203.0.113.7",
            "::ffff:203.0.113.7",
            "2a01:4f8::7",
        ] {
            let found: IpAddr = found.parse().unwrap();
            for mode in [Egress::Allowlist, Egress::Ask, Egress::Open] {
                let p = policy(mode, &[], &[]);
                let got = fix_on(
                    &p,
                    "cdn.pkg-mirror.io",
                    2019,
                    &[found],
                    &[own, v6_own],
                    false,
                );
                assert_eq!(got, None, "{found} in {mode:?}");
                let got = fix_on(&p, "origin.test", 2019, &[found], &[own, v6_own], true);
                assert!(got.is_some_and(|e| e.ends_with(":2019")), "{found}");
            }
        }
        // A name of a private address elsewhere.
        let p = policy(Egress::Ask, &[], &[]);
        let private: IpAddr = [10, 1, 2, 3].into();
        assert_eq!(
            fix_on(&p, "git.internal", 22, &[private], &[own], false).as_deref(),
            Some("10.1.2.3/32:22")
        );
    }

    #[test]
    fn the_command_names_the_sandbox_and_is_one_shell_word_per_argument() {
        assert_eq!(
            command("web", "example.com:8080", false),
            "agentctl egress web allow example.com:8080"
        );
        assert_eq!(
            command("web", "*.example.com", true),
            "agentctl egress web allow --once '*.example.com'"
        );
        assert_eq!(
            command("web", "[fd00::1]/128:443", false),
            "agentctl egress web allow '[fd00::1]/128:443'"
        );
        assert_eq!(quoted("it's"), r"'it'\''s'");
    }
}

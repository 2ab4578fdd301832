//! Host names of dev-server links.
//!
//! For sandbox `S` under domain `D`, a worktree of branch `B` with label `L`
//! (see [`label`]) gets:
//!
//! - `L.S.D`: the worktree's dev server (its lowest listening port, or a
//!   declared port it listens on);
//! - `S.D`: the same for the main worktree;
//! - `P-L.S.D`: port `P` of the worktree, for every port it listens on;
//! - `N.S.D`: declared port `N` (the sandbox's `ports` map), whichever
//!   worktree listens on it. Declared names win over branch labels.

use sha2::{Digest, Sha256};

/// Longest DNS label.
const MAX_LABEL: usize = 63;

/// The DNS label of a branch: lowercase, every run of characters other
/// than `a-z`, `0-9` turned into one `-`, no `-` at either end. When that
/// changed the branch name at all, or the label would start like a port
/// name (`<digits>-`), or it is longer than 63 characters, `-` and six hex
/// digits of the branch's SHA-256 are appended (after cutting to fit), so
/// two branches never share a label.
#[must_use]
pub fn label(branch: &str) -> String {
    let mut out = String::with_capacity(branch.len());
    for c in branch.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            out.push(c);
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    let out = out.trim_matches('-').to_owned();
    let looks_like_port = out
        .split_once('-')
        .is_some_and(|(head, _)| !head.is_empty() && head.bytes().all(|b| b.is_ascii_digit()));
    if out == branch && !looks_like_port && !out.is_empty() && out.len() <= MAX_LABEL {
        return out;
    }
    let hash = Sha256::digest(branch.as_bytes());
    let suffix = format!("{:02x}{:02x}{:02x}", hash[0], hash[1], hash[2]);
    let mut base = out;
    base.truncate(MAX_LABEL - suffix.len() - 1);
    let base = base.trim_end_matches('-');
    if base.is_empty() {
        format!("b-{suffix}")
    } else {
        format!("{base}-{suffix}")
    }
}

/// The sandbox and the first label(s) of a host under `domain`:
/// `S.D` → (`S`, None), `X.S.D` → (`S`, Some(`X`)). `None` when the host is
/// not a sandbox name under `domain`.
#[must_use]
pub fn split_host<'a>(host: &'a str, domain: &str) -> Option<(&'a str, Option<&'a str>)> {
    let rest = host.strip_suffix(domain)?.strip_suffix('.')?;
    match rest.rsplit_once('.') {
        None if !rest.is_empty() => Some((rest, None)),
        Some((first, sandbox)) if !first.is_empty() && !first.contains('.') => {
            Some((sandbox, Some(first)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_branches_are_their_own_label() {
        assert_eq!(label("main"), "main");
        assert_eq!(label("fix-42"), "fix-42");
    }

    #[test]
    fn changed_branches_get_a_hash_and_never_collide() {
        let a = label("feature/login");
        let b = label("feature-login");
        let c = label("Feature-Login");
        assert!(
            a.starts_with("feature-login-") && a.len() == "feature-login-".len() + 6,
            "{a}"
        );
        assert_eq!(b, "feature-login");
        assert_ne!(a, b);
        assert_ne!(c, b);
        assert_ne!(a, c);
        // Deterministic.
        assert_eq!(a, label("feature/login"));
    }

    #[test]
    fn labels_are_dns_labels() {
        for b in [
            "a".repeat(100),
            "x//y".into(),
            "_".into(),
            "8080-main".into(),
            "ünï".into(),
        ] {
            let l = label(&b);
            assert!(l.len() <= 63, "{l}");
            assert!(!l.starts_with('-') && !l.ends_with('-'), "{l}");
            assert!(
                l.bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-'),
                "{l}"
            );
        }
        // Never mistaken for a port name.
        assert_ne!(label("8080-main"), "8080-main");
    }

    #[test]
    fn hosts_split_into_sandbox_and_first_label() {
        let d = "sandbox.local";
        assert_eq!(split_host("p.sandbox.local", d), Some(("p", None)));
        assert_eq!(
            split_host("main.p.sandbox.local", d),
            Some(("p", Some("main")))
        );
        assert_eq!(
            split_host("3000-main.p.sandbox.local", d),
            Some(("p", Some("3000-main")))
        );
        assert_eq!(split_host("a.b.p.sandbox.local", d), None);
        assert_eq!(split_host("sandbox.local", d), None);
        assert_eq!(split_host("evil.com", d), None);
        assert_eq!(split_host("xsandbox.local", d), None);
    }
}

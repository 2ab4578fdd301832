//! Repositories on a forge (GitHub, GitLab, Gitea/Forgejo, any git
//! smart-HTTP server) that a sandbox may push to without holding a token
//! (docs/forges.md).
//!
//! Inside, git gets a credential whose password is a random placeholder;
//! the egress gateway ends TLS for the forge's host (as for secrets,
//! [`crate::secrets`]) and swaps the token in for requests to that
//! repository's smart-HTTP endpoints only, checking every push's refs
//! first ([`crate::egress::forge`]).
//!
//! Kept beside the secrets, in `<state>/secrets/<sandbox>.forges.json`
//! (mode 0600, a directory only agentd may enter).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::secrets::SecretError;

/// Most repositories per sandbox.
pub const PER_SANDBOX_MAX: usize = 16;

/// Most branch patterns per repository.
pub const PATTERNS_MAX: usize = 32;

/// The user name sent with the token unless told otherwise (GitHub's
/// for tokens; GitLab, Gitea and Forgejo take any name with a token).
pub const DEFAULT_USER: &str = "x-access-token";

/// One repository a sandbox may push to.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Forge {
    /// `https://host[:port]/owner/repo`, as normalized by [`parse_url`].
    pub url: String,
    /// The host (lowercase).
    pub host: String,
    /// The port (443 unless the URL says).
    pub port: u16,
    /// The repository's path: `/owner/repo`.
    pub path: String,
    /// The user name sent with the token.
    pub user: String,
    /// Branches a push may update (`*` matches anything, `/` included).
    pub branches: Vec<String>,
    /// Tags may be pushed (never deleted).
    pub tags: bool,
    /// What git inside sends as the password.
    pub placeholder: String,
    /// The token.
    pub token: String,
    /// Read from a file agentd's configuration names.
    #[serde(default)]
    pub declared: bool,
}

impl std::fmt::Debug for Forge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forge")
            .field("url", &self.url)
            .field("branches", &self.branches)
            .field("tags", &self.tags)
            .finish_non_exhaustive()
    }
}

/// A repository a declared sandbox may push to ([`crate::forges`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Declared {
    /// `https://host/owner/repo`.
    pub url: String,
    /// Absolute path of the file that holds the token (one line).
    pub token_file: PathBuf,
    /// Branch patterns a push may update.
    pub branches: Vec<String>,
    /// Tags may be pushed.
    #[serde(default)]
    pub tags: bool,
    /// The user name sent with the token (default `x-access-token`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

impl Declared {
    /// What is wrong with it (the token aside).
    #[must_use]
    pub fn problems(&self) -> Vec<String> {
        let user = self.user.as_deref().unwrap_or(DEFAULT_USER);
        let mut p: Vec<String> = problems(&self.branches, user, b"tokentok")
            .into_iter()
            .map(|m| format!("forges: {}: {m}", self.url))
            .collect();
        if let Err(e) = parse_url(&self.url) {
            p.push(format!("forges: {e}"));
        }
        if !self.token_file.is_absolute() {
            p.push(format!(
                "forges: {}: tokenFile must be an absolute path",
                self.url
            ));
        } else if self.token_file.starts_with("/nix/store") {
            p.push(format!(
                "forges: {}: tokenFile is in the Nix store, which everyone can read; use agenix or sops-nix",
                self.url
            ));
        }
        p
    }
}

/// `url` as (normalized URL, host, port, path): `https://` only, a DNS
/// host (and port), a path of at least two plain segments (letters,
/// digits, `.`, `_`, `-`, `~`; no `.` or `..`), without `.git` or a
/// trailing `/`.
///
/// # Errors
/// Why the URL is refused.
pub fn parse_url(url: &str) -> Result<(String, String, u16, String), String> {
    let bad = |why: &str| {
        format!(
            "'{}' is not a repository URL ({why}); use https://HOST/OWNER/REPO",
            crate::text::clamp_text(url)
        )
    };
    let rest = url
        .strip_prefix("https://")
        .ok_or_else(|| bad("not https://"))?;
    let (authority, path) = rest.split_once('/').ok_or_else(|| bad("no path"))?;
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (
            h,
            p.parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| bad("a bad port"))?,
        ),
        None => (authority, 443),
    };
    let host = host.to_ascii_lowercase();
    if !crate::secrets::is_dns_name(&host) {
        return Err(bad("the host is not a DNS name"));
    }
    let path = path.trim_end_matches('/');
    let path = path.strip_suffix(".git").unwrap_or(path);
    let segments: Vec<&str> = path.split('/').collect();
    let segment_ok = |s: &&str| {
        !s.is_empty()
            && *s != "."
            && *s != ".."
            && s.len() <= 100
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-~".contains(c))
    };
    if segments.len() < 2 || segments.len() > 20 || !segments.iter().all(segment_ok) {
        return Err(bad("the path must be OWNER/REPO, plain names only"));
    }
    let port_part = if port == 443 {
        String::new()
    } else {
        format!(":{port}")
    };
    let path = format!("/{path}");
    Ok((format!("https://{host}{port_part}{path}"), host, port, path))
}

/// A repository's URL parsed (as [`parse_url`]) and its other settings
/// checked: every problem.
///
/// # Errors
/// Every problem found.
pub fn check(
    url: &str,
    branches: &[String],
    user: &str,
    token: &[u8],
) -> Result<(String, String, u16, String), Vec<String>> {
    let mut found = problems(branches, user, token);
    match parse_url(url) {
        Ok(parsed) if found.is_empty() => Ok(parsed),
        Ok(_) => Err(found),
        Err(e) => {
            found.push(e);
            Err(found)
        }
    }
}

/// The problems of a repository's other settings (branch patterns, user,
/// token).
#[must_use]
pub fn problems(branches: &[String], user: &str, token: &[u8]) -> Vec<String> {
    let mut p = Vec::new();
    if branches.is_empty() || branches.len() > PATTERNS_MAX {
        p.push(format!(
            "give 1 to {PATTERNS_MAX} branch patterns (--branches)"
        ));
    }
    for b in branches {
        let ok = !b.is_empty()
            && b.len() <= 200
            && !b.starts_with('-')
            && !b.chars().any(|c| c.is_control() || c == ' ');
        if !ok {
            p.push(format!(
                "branch pattern '{}' is not a branch name with `*`",
                crate::text::clamp_text(b)
            ));
        }
    }
    if user.is_empty()
        || user.len() > 64
        || !user
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
    {
        p.push(format!(
            "user '{}' must be 1 to 64 letters, digits, '.', '_' or '-'",
            crate::text::clamp_text(user)
        ));
    }
    if token.len() < 8 || token.len() > crate::secrets::VALUE_MAX {
        p.push(format!(
            "the token must be 8 to {} bytes (it was {})",
            crate::secrets::VALUE_MAX,
            token.len()
        ));
    } else if std::str::from_utf8(token).is_err() || token.iter().any(|&b| b <= 0x20 || b == 0x7f) {
        p.push("the token must be printable text without spaces on one line".into());
    }
    p
}

fn path(state_dir: &Path, sandbox: &str) -> std::path::PathBuf {
    state_dir
        .join("secrets")
        .join(format!("{sandbox}.forges.json"))
}

/// The repositories sandbox `sandbox` may push to.
///
/// # Errors
/// The file cannot be read.
pub fn load(state_dir: &Path, sandbox: &str) -> Result<Vec<Forge>, SecretError> {
    let p = path(state_dir, sandbox);
    match std::fs::read(&p) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| SecretError::File {
            what: "read",
            path: p,
            source: std::io::Error::other(e),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(source) => Err(SecretError::File {
            what: "read",
            path: p,
            source,
        }),
    }
}

/// Keep `list` as sandbox `sandbox`'s repositories.
///
/// # Errors
/// The file cannot be written.
pub fn save(state_dir: &Path, sandbox: &str, list: &[Forge]) -> Result<(), SecretError> {
    crate::secrets::Store::new(state_dir).ensure_dir()?;
    crate::secrets::write_private(
        &path(state_dir, sandbox),
        &serde_json::to_vec(list).unwrap_or_default(),
    )
}

/// Forget sandbox `sandbox`'s repositories (it is destroyed).
pub fn remove_all(state_dir: &Path, sandbox: &str) {
    let _ = std::fs::remove_file(path(state_dir, sandbox));
}

/// The git configuration (`GIT_CONFIG_COUNT`, `GIT_CONFIG_KEY_<n>`,
/// `GIT_CONFIG_VALUE_<n>`) that gives git inside the placeholder of each
/// of `list` as the credential for its URL.
#[must_use]
pub fn git_env(list: &[Forge]) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    for f in list {
        let helper = format!(
            "!f() {{ test \"$1\" = get && printf 'username=%s\\npassword=%s\\n' '{}' '{}'; }}; f",
            f.user, f.placeholder
        );
        for url in [f.url.clone(), format!("{}.git", f.url)] {
            pairs.push((format!("credential.{url}.helper"), String::new()));
            pairs.push((format!("credential.{url}.helper"), helper.clone()));
        }
    }
    let mut env = vec![("GIT_CONFIG_COUNT".to_owned(), pairs.len().to_string())];
    for (i, (k, v)) in pairs.into_iter().enumerate() {
        env.push((format!("GIT_CONFIG_KEY_{i}"), k));
        env.push((format!("GIT_CONFIG_VALUE_{i}"), v));
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_normalized_or_refused_with_why() {
        assert_eq!(
            parse_url("https://GitHub.com/acme/app.git/").unwrap(),
            (
                "https://github.com/acme/app".to_owned(),
                "github.com".to_owned(),
                443,
                "/acme/app".to_owned()
            )
        );
        assert_eq!(
            parse_url("https://git.example.org:8443/group/sub/app")
                .unwrap()
                .0,
            "https://git.example.org:8443/group/sub/app"
        );
        for bad in [
            "http://github.com/acme/app",
            "https://github.com/acme",
            "https://github.com/acme/../app",
            "https://github.com/acme/a%2fb",
            "https://localhost/acme/app",
            "https://github.com:0/acme/app",
            "https://user@github.com/acme/app",
            "https://github.com/acme/app?x=1",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn settings_are_checked() {
        assert!(problems(&["agent/*".into()], DEFAULT_USER, b"ghp_x123456").is_empty());
        assert_eq!(problems(&[], DEFAULT_USER, b"tokentok").len(), 1);
        assert_eq!(problems(&["a b".into()], "me", b"tokentok").len(), 1);
        assert_eq!(problems(&["a".into()], "m e", b"tokentok").len(), 1);
        assert_eq!(problems(&["a".into()], "me", b"two words").len(), 1);
        assert_eq!(problems(&["a".into()], "me", b"").len(), 1);
    }

    #[test]
    fn git_gets_the_placeholder_for_the_url_only() {
        let f = Forge {
            url: "https://forge.example/acme/app".into(),
            host: "forge.example".into(),
            port: 443,
            path: "/acme/app".into(),
            user: DEFAULT_USER.into(),
            branches: vec!["agent/*".into()],
            tags: false,
            placeholder: "keystone-placeholder-x".into(),
            token: "secret-token".into(),
            declared: false,
        };
        let env = git_env(&[f]);
        assert_eq!(env[0], ("GIT_CONFIG_COUNT".into(), "4".into()));
        let text = format!("{env:?}");
        assert!(text.contains("credential.https://forge.example/acme/app.helper"));
        assert!(text.contains("keystone-placeholder-x"));
        assert!(!text.contains("secret-token"));
    }
}

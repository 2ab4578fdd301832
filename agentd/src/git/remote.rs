//! The remote `sandbox/<name>` that a sync to the host adds to the project's
//! config, and its removal when the sandbox is gone: a helper
//! (`agentd __remote-remove`) that runs as the project's owner and edits
//! only the repository's own config file, and only while the remote still
//! points at the sandbox's workspace (a remote the person changed is
//! theirs). The refs under `refs/remotes/sandbox/<name>/` stay.

use std::path::{Path, PathBuf};

use git2::Repository;
use serde::{Deserialize, Serialize};

use crate::helper::{Helper, HelperError, Io};

/// What to remove: remote `name` of the repository at `repo`, if its URL is
/// still `url`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// The project (work tree or git directory).
    pub repo: PathBuf,
    /// The remote, `sandbox/<name>`.
    pub name: String,
    /// The URL agentd gave it: the sandbox's workspace.
    pub url: String,
}

/// What the helper found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// The remote's settings are gone (its refs stay).
    Removed,
    /// There was no such remote.
    Absent,
    /// The remote points elsewhere now: left as the person set it.
    Kept {
        /// Its URL.
        url: String,
    },
}

/// Why the remote could not be looked at or removed.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The project cannot be opened.
    #[error("cannot open {}: {}", path.display(), source.message())]
    Open {
        /// The project.
        path: PathBuf,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// Its config cannot be read or written.
    #[error("remote '{remote}' in {}: {}", path.display(), source.message())]
    Config {
        /// The remote.
        remote: String,
        /// The project.
        path: PathBuf,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
}

impl From<RemoteError> for HelperError {
    fn from(e: RemoteError) -> Self {
        Self::Failed(e.to_string())
    }
}

/// The helper that removes a sandbox's remote, run as the project's owner.
#[derive(Debug)]
pub struct RemoveRemote;

impl Helper for RemoveRemote {
    const ARG: &'static str = "__remote-remove";
    const WHAT: &'static str = "remote removal";
    type Request = Request;
    type Reply = Outcome;

    fn serve(req: Request, _io: &mut Io<'_>) -> Result<Outcome, HelperError> {
        super::workspace::ignore_global_config();
        super::workspace::allow_foreign_owners();
        Ok(remove(&req)?)
    }
}

/// Remove every setting of remote `req.name` from the repository's own
/// config file (not the global one, not an included one), if its URL is
/// `req.url`.
pub fn remove(req: &Request) -> Result<Outcome, RemoteError> {
    let repo = Repository::open_ext(
        &req.repo,
        git2::RepositoryOpenFlags::NO_SEARCH,
        std::iter::empty::<&str>(),
    )
    .map_err(|source| RemoteError::Open {
        path: req.repo.clone(),
        source,
    })?;
    let err = |source| RemoteError::Config {
        remote: req.name.clone(),
        path: req.repo.clone(),
        source,
    };
    let mut config = repo
        .config()
        .and_then(|c| c.open_level(git2::ConfigLevel::Local))
        .map_err(err)?;
    let url = match config.get_string(&format!("remote.{}.url", req.name)) {
        Ok(u) => u,
        Err(e) if e.code() == git2::ErrorCode::NotFound => return Ok(Outcome::Absent),
        Err(e) => return Err(err(e)),
    };
    if url != req.url {
        return Ok(Outcome::Kept { url });
    }
    for key in keys_of(&config, &req.name).map_err(err)? {
        config.remove_multivar(&key, ".*").map_err(err)?;
    }
    Ok(Outcome::Removed)
}

/// The names of remote `remote`'s settings in `config` (each once).
fn keys_of(config: &git2::Config, remote: &str) -> Result<Vec<String>, git2::Error> {
    // libgit2 gives names with the section and key in lower case and the
    // subsection (the remote's name) as written.
    let prefix = format!("remote.{remote}.");
    let mut keys = Vec::new();
    let mut entries = config.entries(None)?;
    while let Some(e) = entries.next() {
        let e = e?;
        if let Some(name) = e.name() {
            if name.starts_with(&prefix) && !name[prefix.len()..].contains('.') {
                keys.push(name.to_owned());
            }
        }
    }
    keys.sort();
    keys.dedup();
    Ok(keys)
}

/// What agentd keeps in a sandbox's directory about the remote it may have
/// added, so that the remote can be removed even when the sandbox's entry in
/// the registry is gone (a destroy cut short, a lost registry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// The request that removes it.
    pub remote: Request,
    /// Whom the removal runs as: the project's owner.
    pub owner: u32,
}

/// The record's file in sandbox directory `dir`.
#[must_use]
pub fn record_path(dir: &Path) -> PathBuf {
    dir.join("host-remote.json")
}

/// Read the record in sandbox directory `dir`, never through a symlink;
/// `None` if there is none (or it is not one).
#[must_use]
pub fn read_record(dir: &Path) -> Option<Record> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(record_path(dir))
        .ok()?;
    let mut text = String::new();
    f.by_ref().take(64 << 10).read_to_string(&mut text).ok()?;
    serde_json::from_str(&text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo_with(config: &str) -> (tempfile::TempDir, Request) {
        let tmp = tempfile::tempdir().unwrap();
        Repository::init(tmp.path()).unwrap();
        let path = tmp.path().join(".git/config");
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str(config);
        std::fs::write(&path, text).unwrap();
        let req = Request {
            repo: tmp.path().to_owned(),
            name: "sandbox/demo".to_owned(),
            url: "/state/sandboxes/demo/workspace".to_owned(),
        };
        (tmp, req)
    }

    fn config_of(tmp: &tempfile::TempDir) -> String {
        std::fs::read_to_string(tmp.path().join(".git/config")).unwrap()
    }

    #[test]
    fn only_the_remote_agentd_added_is_removed() {
        let (tmp, req) = repo_with(
            "[remote \"sandbox/demo\"]\n\turl = /state/sandboxes/demo/workspace\n\t\
             fetch = +refs/heads/*:refs/remotes/sandbox/demo/*\n\
             [remote \"origin\"]\n\turl = https://example.com/r.git\n\
             [remote \"sandbox/demo2\"]\n\turl = /state/sandboxes/demo2/workspace\n",
        );
        assert_eq!(remove(&req).unwrap(), Outcome::Removed);
        let after = config_of(&tmp);
        assert!(!after.contains("/demo/workspace"), "{after}");
        assert!(!after.contains("sandbox/demo/*"), "{after}");
        assert!(after.contains("https://example.com/r.git"), "{after}");
        assert!(after.contains("/demo2/workspace"), "{after}");
        assert_eq!(remove(&req).unwrap(), Outcome::Absent);
    }

    #[test]
    fn a_remote_the_person_changed_is_kept() {
        let (tmp, req) = repo_with("[remote \"sandbox/demo\"]\n\turl = /elsewhere\n");
        let before = config_of(&tmp);
        assert_eq!(
            remove(&req).unwrap(),
            Outcome::Kept {
                url: "/elsewhere".to_owned()
            }
        );
        assert_eq!(config_of(&tmp), before);
    }
}

//! Why a sync step failed, or why one branch was skipped: [`SyncError`]
//! (in a file of its own so that `sync.rs` stays under 800 lines).

use std::path::PathBuf;

use git2::Oid;

use super::IntoError;
use crate::git::refs;
use crate::helper::HelperError;

/// Why a sync step failed, or why one branch was skipped (the notices in
/// [`super::ReadReport::skipped`] are these errors' text). The text is what the
/// person reads: the host gets it back as [`HelperError::Failed`].
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// The source's `.git` or object store cannot be looked at.
    #[error("cannot read {what} at {}: {source}", path.display())]
    CannotRead {
        /// `.git` or `the object store`.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The source's `.git` or object store is not a directory.
    #[error("{what} at {} is not a directory (a symlink?); nothing was synced", path.display())]
    NotADirectory {
        /// `.git` or `the object store`.
        what: &'static str,
        /// Where.
        path: PathBuf,
    },
    /// The one branch asked for is not in the source.
    #[error("there is no branch '{branch}' to sync")]
    NoSuchBranch {
        /// The branch asked for.
        branch: String,
    },
    /// `--into` names a branch the source does not have.
    #[error(
        "--into '{branch}' moves your '{branch}' to the sandbox's branch of the same name, and the \
         sandbox has no branch '{branch}' (it has: {have}); nothing was synced{}",
        suggest.as_ref().map(|s| format!(". Did you mean: --into {s}")).unwrap_or_default()
    )]
    NoIntoBranch {
        /// The branch `--into` named, as notices show it.
        branch: String,
        /// The source's branches, as notices show them.
        have: String,
        /// The branch probably meant (the source's current one).
        suggest: Option<String>,
    },
    /// libgit2 failed on the object store, a walk or a pack (its message
    /// only).
    #[error("{}", source.message())]
    Git {
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// A report or the haves could not be encoded.
    #[error("{source}")]
    Encode {
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// Writing to stdout (a line or the pack) failed.
    #[error("{source}")]
    Output {
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Reading the reader's report line from stdin failed.
    #[error("{source}")]
    Input {
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The destination repository cannot be opened.
    #[error("cannot open {}: {}", path.display(), source.message())]
    Open {
        /// The destination.
        path: PathBuf,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// The reader's report line is not a report.
    #[error("bad report from the reader: {source}")]
    BadReport {
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The pack could not be received.
    #[error("receiving objects: {source}")]
    Receive {
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The received pack could not be indexed.
    #[error("indexing the received objects: {}", source.message())]
    IndexPack {
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// `--into` failed.
    #[error(transparent)]
    Into(#[from] IntoError),
    /// Skipped: a branch's tip is not a commit.
    #[error("branch '{branch}' points to {tip}, which is not a commit; skipped")]
    NotACommit {
        /// The branch, as notices show it.
        branch: String,
        /// Its tip.
        tip: Oid,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// Skipped: libgit2 failed on one branch's commits or trees.
    #[error("branch '{branch}': {}; skipped", source.message())]
    Branch {
        /// The branch, as notices show it.
        branch: String,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// Skipped: a branch's history cannot be walked.
    #[error("branch '{branch}': broken history ({}); skipped", source.message())]
    BrokenHistory {
        /// The branch, as notices show it.
        branch: String,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// Skipped: an object a new commit brings is not in the object store.
    #[error(
        "branch '{branch}': {what} ({id}) is missing or unreadable: {}; skipped",
        source.message()
    )]
    Unreadable {
        /// The branch, as notices show it.
        branch: String,
        /// The object, for the person (a commit, a directory listing, a
        /// file's path).
        what: String,
        /// The object.
        id: Oid,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// Skipped: an object a new commit brings is over the size cap.
    #[error(
        "branch '{branch}' adds {what} of {} MiB, over the {} MiB limit; skipped",
        size >> 20,
        max >> 20
    )]
    TooBig {
        /// The branch, as notices show it.
        branch: String,
        /// The object, for the person.
        what: String,
        /// Its size in bytes.
        size: u64,
        /// The cap in bytes.
        max: u64,
    },
    /// Skipped: a branch name the destination refuses.
    #[error("branch name '{branch}' is refused; skipped")]
    RefusedName {
        /// The branch, as notices show it.
        branch: String,
    },
    /// Kept: a destination ref whose branch is gone cannot be deleted.
    #[error(
        "branch '{branch}': cannot delete {reference}: {}; kept",
        refs::shown(source.message())
    )]
    Delete {
        /// The branch, as notices show it.
        branch: String,
        /// The destination ref, as notices show it.
        reference: String,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
    /// Skipped: the reader sent a tip that is not an object id.
    #[error("branch '{branch}': bad object id '{oid}': {source}; skipped")]
    BadOid {
        /// The branch, as notices show it.
        branch: String,
        /// What the reader sent.
        oid: String,
        /// Why it is not one.
        #[source]
        source: git2::Error,
    },
    /// Skipped: a tip the pack should have brought is not a commit here.
    #[error("branch '{branch}': its objects did not arrive; skipped")]
    NotArrived {
        /// The branch, as notices show it.
        branch: String,
    },
    /// Skipped: the destination ref cannot be written.
    #[error(
        "branch '{branch}': cannot update {reference}: {}; skipped",
        refs::shown(source.message())
    )]
    Update {
        /// The branch, as notices show it.
        branch: String,
        /// The destination ref, as notices show it.
        reference: String,
        /// What libgit2 said.
        #[source]
        source: git2::Error,
    },
}

impl From<git2::Error> for SyncError {
    fn from(source: git2::Error) -> Self {
        Self::Git { source }
    }
}

impl From<SyncError> for HelperError {
    fn from(e: SyncError) -> Self {
        match e {
            // A request that names what is not there: the caller's to fix.
            SyncError::NoIntoBranch { .. } => Self::Invalid(e.to_string()),
            e => Self::Failed(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A libgit2 error whose `Display` says more than its message.
    fn git(message: &str) -> git2::Error {
        git2::Error::new(git2::ErrorCode::NotFound, git2::ErrorClass::Odb, message)
    }

    fn io() -> std::io::Error {
        std::io::Error::other("disk on fire")
    }

    /// Each sentence as the helpers wrote it before the errors had types.
    #[test]
    fn the_sentences_are_unchanged() {
        let id = Oid::from_str("1111111111111111111111111111111111111111").unwrap();
        let json = || serde_json::from_str::<u32>("nope").unwrap_err();
        let p = PathBuf::from("/p/.git");
        let cases = [
            (
                SyncError::CannotRead {
                    what: ".git",
                    path: p.clone(),
                    source: io(),
                },
                "cannot read .git at /p/.git: disk on fire".to_owned(),
            ),
            (
                SyncError::NotADirectory {
                    what: "the object store",
                    path: p.clone(),
                },
                "the object store at /p/.git is not a directory (a symlink?); nothing was synced"
                    .to_owned(),
            ),
            (
                SyncError::NoSuchBranch { branch: "b".into() },
                "there is no branch 'b' to sync".to_owned(),
            ),
            (git("odb").into(), "odb".to_owned()),
            (SyncError::Encode { source: json() }, json().to_string()),
            (
                SyncError::Output { source: io() },
                "disk on fire".to_owned(),
            ),
            (SyncError::Input { source: io() }, "disk on fire".to_owned()),
            (
                SyncError::Open {
                    path: p,
                    source: git("gone"),
                },
                "cannot open /p/.git: gone".to_owned(),
            ),
            (
                SyncError::BadReport { source: json() },
                format!("bad report from the reader: {}", json()),
            ),
            (
                SyncError::Receive { source: io() },
                "receiving objects: disk on fire".to_owned(),
            ),
            (
                SyncError::IndexPack {
                    source: git("bad pack"),
                },
                "indexing the received objects: bad pack".to_owned(),
            ),
            (
                SyncError::NotACommit {
                    branch: "b".into(),
                    tip: id,
                    source: git("tag"),
                },
                format!("branch 'b' points to {id}, which is not a commit; skipped"),
            ),
            (
                SyncError::Branch {
                    branch: "b".into(),
                    source: git("no tree"),
                },
                "branch 'b': no tree; skipped".to_owned(),
            ),
            (
                SyncError::BrokenHistory {
                    branch: "b".into(),
                    source: git("no parent"),
                },
                "branch 'b': broken history (no parent); skipped".to_owned(),
            ),
            (
                SyncError::Unreadable {
                    branch: "b".into(),
                    what: "a.txt".into(),
                    id,
                    source: git("missing"),
                },
                format!("branch 'b': a.txt ({id}) is missing or unreadable: missing; skipped"),
            ),
            (
                SyncError::TooBig {
                    branch: "b".into(),
                    what: "a.txt".into(),
                    size: 150 << 20,
                    max: 100 << 20,
                },
                "branch 'b' adds a.txt of 150 MiB, over the 100 MiB limit; skipped".to_owned(),
            ),
            (
                SyncError::RefusedName { branch: "b".into() },
                "branch name 'b' is refused; skipped".to_owned(),
            ),
            (
                SyncError::Delete {
                    branch: "b".into(),
                    reference: "refs/remotes/host/b".into(),
                    source: git("locked\u{7}"),
                },
                format!(
                    "branch 'b': cannot delete refs/remotes/host/b: {}; kept",
                    refs::shown("locked\u{7}")
                ),
            ),
            (
                SyncError::BadOid {
                    branch: "b".into(),
                    oid: "xyz".into(),
                    source: git("not hex"),
                },
                format!(
                    "branch 'b': bad object id 'xyz': {}; skipped",
                    git("not hex")
                ),
            ),
            (
                SyncError::NotArrived { branch: "b".into() },
                "branch 'b': its objects did not arrive; skipped".to_owned(),
            ),
            (
                SyncError::Update {
                    branch: "b".into(),
                    reference: "refs/remotes/host/b".into(),
                    source: git("locked\u{7}"),
                },
                format!(
                    "branch 'b': cannot update refs/remotes/host/b: {}; skipped",
                    refs::shown("locked\u{7}")
                ),
            ),
        ];
        for (e, said) in cases {
            assert_eq!(e.to_string(), said, "{e:?}");
        }
        assert!(matches!(
            HelperError::from(SyncError::NoSuchBranch { branch: "b".into() }),
            HelperError::Failed(m) if m == "there is no branch 'b' to sync"
        ));
    }
}

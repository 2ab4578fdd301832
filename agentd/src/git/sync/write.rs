//! The writer of a sync (`agentd __sync-write`), on the destination's side.

use std::collections::HashSet;
use std::io::{BufRead, Write};

use git2::{Oid, Repository};

use super::{
    HAVES_HISTORY, HOST_PREFIX, Haves, ReadReport, SyncError, Update, WriteReport, WriteSpec, refs,
};
use crate::helper::{Helper, HelperError, Io};

/// The writing helper (`agentd __sync-write`), run as the destination's
/// owner: prints its [`Haves`] as one JSON line, reads the reader's report
/// line and pack on stdin (always to its end, needed or not), and answers
/// with its [`WriteReport`].
#[derive(Debug)]
pub struct SyncWrite;

impl Helper for SyncWrite {
    const ARG: &'static str = "__sync-write";
    const WHAT: &'static str = "sync writer";
    type Request = WriteSpec;
    type Reply = WriteReport;

    fn serve(spec: WriteSpec, io: &mut Io<'_>) -> Result<WriteReport, HelperError> {
        crate::git::workspace::ignore_global_config();
        Ok(write(&spec, &mut io.input, &mut io.output)?)
    }
}

/// The writer: print the haves, then apply what the reader sends.
pub fn write(
    spec: &WriteSpec,
    mut input: impl BufRead,
    out: &mut impl Write,
) -> Result<WriteReport, SyncError> {
    crate::git::workspace::allow_foreign_owners();
    let repo = Repository::open_ext(
        &spec.repo,
        git2::RepositoryOpenFlags::NO_SEARCH,
        std::iter::empty::<&str>(),
    )
    .map_err(|source| SyncError::Open {
        path: spec.repo.clone(),
        source,
    })?;
    let (previous, _) = refs::read_branches(repo.path(), spec.prefix.trim_end_matches('/'));
    let mut haves: Vec<String> = previous.values().map(Oid::to_string).collect();
    let (heads, _) = refs::read_branches(repo.path(), "refs/heads");
    haves.extend(heads.values().map(Oid::to_string));
    if spec.prefix != HOST_PREFIX {
        let (host, _) = refs::read_branches(repo.path(), "refs/remotes/host");
        haves.extend(host.values().map(Oid::to_string));
    }
    // What a guard held back is here already (unreferenced): not sent again.
    if let (Some(guard), Ok(odb)) = (&spec.guard, repo.odb()) {
        haves.extend(
            guard
                .held
                .iter()
                .filter(|t| Oid::from_str(t).is_ok_and(|o| odb.exists(o)))
                .cloned(),
        );
    }
    // The reader can only leave out history it shares with us; tips it does
    // not have hide nothing, so offer recent ancestors too.
    if let Ok(mut walk) = repo.revwalk() {
        for h in &haves {
            if let Ok(o) = Oid::from_str(h) {
                let _ = walk.push(o);
            }
        }
        let ancestors: Vec<String> = walk
            .flatten()
            .take(HAVES_HISTORY)
            .map(|o| o.to_string())
            .collect();
        haves.extend(ancestors);
    }
    haves.sort();
    haves.dedup();
    let h = Haves {
        haves,
        previous: previous
            .iter()
            .map(|(k, v)| (k.clone(), v.to_string()))
            .collect(),
    };
    serde_json::to_writer(&mut *out, &h).map_err(|source| SyncError::Encode { source })?;
    out.write_all(b"\n")
        .and_then(|()| out.flush())
        .map_err(|source| SyncError::Output { source })?;

    let mut line = String::new();
    if std::io::Read::take(&mut input, REPORT_MAX)
        .read_line(&mut line)
        .map_err(|source| SyncError::Input { source })?
        == 0
    {
        return Ok(WriteReport::default()); // dry run: the reader's report went elsewhere
    }
    let mut read: ReadReport =
        serde_json::from_str(&line).map_err(|source| SyncError::BadReport { source })?;
    tidy(&mut read, &previous, spec.guard.is_some());
    let odb = repo.odb()?;
    if read
        .updates
        .iter()
        .any(|u| !u.new.is_empty() && !odb.exists(Oid::from_str(&u.new).unwrap_or(Oid::zero())))
    {
        let mut w = odb.packwriter()?;
        std::io::copy(&mut input, &mut w).map_err(|source| SyncError::Receive { source })?;
        w.commit()
            .map_err(|source| SyncError::IndexPack { source })?;
    } else {
        // Every tip is here already, yet the reader may still send a pack
        // (an empty one, or objects this side has only unreachable): read
        // it to its end all the same, so agentd never writes into a pipe
        // nobody reads any more and calls a sync that worked a failure.
        std::io::copy(&mut input, &mut std::io::sink())
            .map_err(|source| SyncError::Receive { source })?;
    }
    let mut report = WriteReport {
        read,
        ..WriteReport::default()
    };
    let mut keep = Vec::new();
    if let Some(guard) = &spec.guard {
        let d = crate::git::guard::hold(
            &repo,
            guard,
            &previous,
            &heads.values().copied().collect::<Vec<_>>(),
            &mut report.read.updates,
        )?;
        report.held = d.held;
        report.read.skipped.extend(d.notices);
        keep = d.keep;
    }
    if spec.dry_run {
        if !spec.prune {
            report.read.updates.retain(|u| !u.new.is_empty());
        }
        return Ok(report);
    }
    for (name, tip) in keep {
        if let Err(e) = repo.reference(&name, tip, true, "keystone-agent sync: rewritten") {
            report.read.skipped.push(format!(
                "cannot keep the rewritten tip {tip} as {name}: {}",
                e.message()
            ));
        }
    }
    // Deletions first: a removed `a` may make room for a new `a/b`. A
    // branch that cannot be written is skipped; the others still move.
    let mut order: Vec<usize> = (0..report.read.updates.len()).collect();
    order.sort_by_key(|&i| !report.read.updates[i].new.is_empty());
    let mut failed = HashSet::new();
    for i in order {
        if let Err(why) = apply(&repo, spec, &report.read.updates[i]) {
            report.read.skipped.push(why.to_string());
            failed.insert(i);
        }
    }
    let mut i = 0;
    report.read.updates.retain(|_| {
        i += 1;
        !failed.contains(&(i - 1))
    });
    if !spec.prune {
        report.read.updates.retain(|u| !u.new.is_empty());
    }
    if let Some((name, url)) = &spec.remote {
        ensure_remote(&repo, name, url, &spec.prefix)?;
    }
    if let Some(held) = spec
        .into
        .as_ref()
        .and_then(|b| report.held.iter().find(|h| &h.branch == b))
    {
        report.diverged = Some(format!(
            "'{}' was held back ({}), so your '{}' was not moved; see the sync's report",
            refs::shown(&held.branch),
            held.reason,
            refs::shown(&held.branch)
        ));
    } else if let Some(branch) = &spec.into {
        crate::git::into::fast_forward(
            &repo,
            branch,
            &format!("{}{branch}", spec.prefix),
            &mut report,
        )?;
    }
    Ok(report)
}

/// Largest report line the reader may send.
const REPORT_MAX: u64 = 64 << 20;

/// Most notices kept of the reader's report.
const SKIPPED_MAX: usize = 200;

/// The reader's report made safe to act on and to show: one update per
/// branch (the first), notices and file names without control characters
/// (a line break could forge a line of the person's output), and, to the
/// host (`guarded`), each update's `old` what the host has.
fn tidy(read: &mut ReadReport, previous: &std::collections::BTreeMap<String, Oid>, guarded: bool) {
    let mut seen = HashSet::new();
    read.updates.retain(|u| seen.insert(u.branch.clone()));
    for u in &mut read.updates {
        for f in &mut u.files {
            *f = refs::shown(f);
        }
        if guarded {
            u.old = previous
                .get(&u.branch)
                .map(Oid::to_string)
                .unwrap_or_default();
        }
    }
    read.skipped.truncate(SKIPPED_MAX);
    for s in &mut read.skipped {
        *s = refs::shown(s);
    }
}

/// Move (or, when pruning, delete) the destination's ref for one update.
fn apply(repo: &Repository, spec: &WriteSpec, u: &Update) -> Result<(), SyncError> {
    let b = refs::shown(&u.branch);
    if !refs::valid_branch(&u.branch) {
        return Err(SyncError::RefusedName { branch: b });
    }
    let name = format!("{}{}", spec.prefix, u.branch);
    let shown_ref = format!("{}{b}", spec.prefix);
    if u.new.is_empty() {
        if spec.prune {
            if let Ok(mut r) = repo.find_reference(&name) {
                r.delete().map_err(|source| SyncError::Delete {
                    branch: b,
                    reference: shown_ref,
                    source,
                })?;
            }
        }
        return Ok(());
    }
    let new = Oid::from_str(&u.new).map_err(|source| SyncError::BadOid {
        branch: b.clone(),
        oid: u.new.clone(),
        source,
    })?;
    if repo.find_commit(new).is_err() {
        return Err(SyncError::NotArrived { branch: b });
    }
    repo.reference(&name, new, true, "keystone-agent sync")
        .map(|_| ())
        .map_err(|source| SyncError::Update {
            branch: b,
            reference: shown_ref,
            source,
        })
}

fn ensure_remote(repo: &Repository, name: &str, url: &str, prefix: &str) -> Result<(), SyncError> {
    let refspec = format!("+refs/heads/*:{prefix}*");
    match repo.find_remote(name) {
        Ok(r) if r.url() == Some(url) => {}
        Ok(_) => repo.remote_set_url(name, url)?,
        Err(_) => {
            repo.remote_with_fetch(name, url, &refspec)?;
        }
    }
    // `git fetch --all` (and an editor's fetch in the background) would
    // bring the branches past the guards: only a fetch that names the
    // remote goes there.
    let key = format!("remote.{name}.skipFetchAll");
    let mut config = repo.config()?;
    if config.get_bool(&key).ok() != Some(true) {
        config.set_bool(&key, true)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// A repository with one commit on `main`, and that commit.
    fn repo_with_a_commit(dir: &Path) -> Oid {
        let repo = Repository::init(dir).unwrap();
        let sig = git2::Signature::now("T", "t@example.com").unwrap();
        let tree = repo.treebuilder(None).unwrap().write().unwrap();
        let tree = repo.find_tree(tree).unwrap();
        repo.commit(Some("refs/heads/main"), &sig, &sig, "first", &tree, &[])
            .unwrap()
    }

    #[test]
    fn the_writer_reads_a_pack_it_does_not_need_to_its_end() {
        let tmp = tempfile::tempdir().unwrap();
        let head = repo_with_a_commit(tmp.path());
        let spec = WriteSpec {
            repo: tmp.path().to_owned(),
            prefix: "refs/remotes/sandbox/t/".to_owned(),
            remote: None,
            prune: false,
            into: None,
            guard: None,
            dry_run: false,
        };
        let report = ReadReport {
            updates: vec![Update {
                branch: "x".to_owned(),
                old: String::new(),
                new: head.to_string(),
                commits: 0,
                files_changed: 0,
                files: Vec::new(),
            }],
            skipped: Vec::new(),
        };
        let mut input = serde_json::to_vec(&report).unwrap();
        input.push(b'\n');
        // What follows the report: a pack of nothing new, here longer than
        // a pipe holds.
        input.extend(std::iter::repeat_n(b'P', 1 << 20));
        let mut rest = input.as_slice();
        let mut out = Vec::new();
        let done = write(&spec, &mut rest, &mut out).unwrap();
        assert!(rest.is_empty(), "{} bytes left unread", rest.len());
        assert_eq!(done.read.updates.len(), 1);
        let repo = Repository::open(tmp.path()).unwrap();
        assert_eq!(
            repo.refname_to_id("refs/remotes/sandbox/t/x").unwrap(),
            head
        );
    }
}

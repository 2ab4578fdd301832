//! The guard's rules, on repositories made here.
use super::*;

fn covered(patterns: &[&str], path: &str) -> Option<String> {
    let p = Patterns::new(&patterns.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
    let comps: Vec<&[u8]> = path.split('/').map(str::as_bytes).collect();
    p.covering(&comps).map(str::to_owned)
}

#[test]
fn a_pattern_covers_its_path_and_what_is_beneath() {
    assert!(covered(&[".github/workflows/"], ".github/workflows/ci.yml").is_some());
    assert!(covered(&[".github/workflows/"], ".github/workflows").is_some());
    assert!(covered(&[".github/workflows/"], ".github/dependabot.yml").is_none());
    assert!(covered(&[".github/workflows/"], "a/.github/workflows/ci.yml").is_none());
    assert!(covered(&[".gitlab-ci.yml"], ".gitlab-ci.yml").is_some());
    assert!(covered(&[".gitlab-ci.yml"], "x/.gitlab-ci.yml").is_none());
    assert!(covered(&["**/Makefile"], "Makefile").is_some());
    assert!(covered(&["**/Makefile"], "a/b/Makefile").is_some());
    assert!(covered(&["**/Makefile"], "a/b/Makefile.in").is_none());
    assert!(covered(&["ci/*.yml"], "ci/x.yml").is_some());
    assert!(covered(&["ci/*.yml"], "ci/sub/x.yml").is_none());
    assert!(covered(&["a/**/z"], "a/z").is_some());
    assert!(covered(&["a/**/z"], "a/b/c/z/y").is_some());
    assert!(covered(&["?.sh"], "x.sh").is_some());
    assert!(covered(&["?.sh"], "xy.sh").is_none());
}

#[test]
fn a_link_in_place_of_a_protected_directory_is_seen() {
    let p = Patterns::new(&[".github/workflows/".to_owned()]);
    assert!(p.shadowed(&[b".github"]).is_some());
    assert!(p.shadowed(&[b".github", b"workflows"]).is_none());
    assert!(p.shadowed(&[b"src"]).is_none());
    assert!(p.could_contain(&[b".github"]));
    assert!(!p.could_contain(&[b"src"]));
}

#[test]
fn globs_take_linear_time_on_hostile_names() {
    let name = vec![b'a'; 10_000];
    let mut pattern = b"*a".repeat(20);
    pattern.push(b'b');
    let start = std::time::Instant::now();
    assert!(!glob(&pattern, &name));
    assert!(glob(b"*a*a*", &name));
    assert!(glob(b"a*", b"a"));
    assert!(!glob(b"a?", b"a"));
    // Well within what one sync may take, on any machine.
    assert!(start.elapsed() < std::time::Duration::from_secs(5));
}

#[test]
fn bad_patterns_are_named() {
    let bad = [
        "",
        "/etc",
        "a//b",
        "../x",
        "a/./b",
        "a**/b",
        "x\ny",
        &"a".repeat(300),
    ];
    for b in bad {
        assert_eq!(problems(&[b.to_owned()]).len(), 1, "{b:?}");
    }
    assert!(
        problems(
            &keystone_agent_api::DEFAULT_PROTECT
                .iter()
                .map(|s| (*s).to_owned())
                .collect::<Vec<_>>()
        )
        .is_empty()
    );
    assert_eq!(problems(&vec!["a".to_owned(); 65]).len(), 1);
}

/// A commit of `files` (path, content) with `parents`.
fn commit(repo: &Repository, files: &[(&str, &str)], parents: &[Oid]) -> Oid {
    let mut index = git2::Index::new().unwrap();
    for (path, content) in files {
        let blob = repo.blob(content.as_bytes()).unwrap();
        let mut e = git2::IndexEntry {
            ctime: git2::IndexTime::new(0, 0),
            mtime: git2::IndexTime::new(0, 0),
            dev: 0,
            ino: 0,
            mode: 0o100_644,
            uid: 0,
            gid: 0,
            file_size: 0,
            id: blob,
            flags: 0,
            flags_extended: 0,
            path: path.as_bytes().to_vec(),
        };
        if *content == "LINK" {
            e.mode = 0o120_000;
        }
        index.add(&e).unwrap();
    }
    let tree = index.write_tree_to(repo).unwrap();
    let tree = repo.find_tree(tree).unwrap();
    let sig = git2::Signature::now("T", "t@example.com").unwrap();
    let parents: Vec<_> = parents
        .iter()
        .map(|p| repo.find_commit(*p).unwrap())
        .collect();
    let refs: Vec<&git2::Commit<'_>> = parents.iter().collect();
    repo.commit(None, &sig, &sig, "c", &tree, &refs).unwrap()
}

#[test]
fn only_new_commits_that_change_a_protected_path_count() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::init_bare(tmp.path()).unwrap();
    let protect = vec![".github/workflows/".to_owned()];
    let base = commit(
        &repo,
        &[("a", "1"), (".github/workflows/ci.yml", "ok")],
        &[],
    );
    // A root commit brings every path.
    let c = first_change(&repo, base, &[], &protect).unwrap().unwrap();
    assert_eq!(c.commit, base);
    assert_eq!(c.path, ".github/workflows/ci.yml");
    // Known to the host: nothing.
    assert!(
        first_change(&repo, base, &[base], &protect)
            .unwrap()
            .is_none()
    );
    let plain = commit(
        &repo,
        &[("a", "2"), (".github/workflows/ci.yml", "ok")],
        &[base],
    );
    assert!(
        first_change(&repo, plain, &[base], &protect)
            .unwrap()
            .is_none()
    );
    let evil = commit(
        &repo,
        &[("a", "2"), (".github/workflows/ci.yml", "evil")],
        &[plain],
    );
    let undo = commit(
        &repo,
        &[("a", "3"), (".github/workflows/ci.yml", "ok")],
        &[evil],
    );
    let c = first_change(&repo, undo, &[base], &protect)
        .unwrap()
        .unwrap();
    assert_eq!(c.commit, evil, "an undone change still counts");
    // Deleting counts; so does a link standing in for the directory.
    let gone = commit(&repo, &[("a", "2")], &[plain]);
    assert!(
        first_change(&repo, gone, &[plain], &protect)
            .unwrap()
            .is_some()
    );
    let link = commit(&repo, &[("a", "2"), (".github", "LINK")], &[gone]);
    let c = first_change(&repo, link, &[gone], &protect)
        .unwrap()
        .unwrap();
    assert_eq!((c.commit, c.path.as_str()), (link, ".github"));
    // A merge that takes the host's version changes nothing there.
    let host = commit(
        &repo,
        &[("a", "1"), (".github/workflows/ci.yml", "host")],
        &[base],
    );
    let merge = commit(
        &repo,
        &[("a", "2"), (".github/workflows/ci.yml", "host")],
        &[plain, host],
    );
    assert!(
        first_change(&repo, merge, &[base, host, plain], &protect)
            .unwrap()
            .is_none()
    );
    // One that takes neither does.
    let merge = commit(
        &repo,
        &[("a", "2"), (".github/workflows/ci.yml", "mine")],
        &[plain, host],
    );
    assert_eq!(
        first_change(&repo, merge, &[host, plain], &protect)
            .unwrap()
            .unwrap()
            .commit,
        merge
    );
    // An allowed tip hides what it brought.
    assert!(
        first_change(&repo, undo, &[base, undo], &protect)
            .unwrap()
            .is_none()
    );
    // A merge that takes an old version the host has since changed.
    let newer = commit(
        &repo,
        &[("a", "1"), (".github/workflows/ci.yml", "v2")],
        &[base],
    );
    let rollback = commit(
        &repo,
        &[("a", "9"), (".github/workflows/ci.yml", "ok")],
        &[newer, base],
    );
    let c = first_change(&repo, rollback, &[base, newer], &protect)
        .unwrap()
        .unwrap();
    assert_eq!(c.commit, rollback);
}

/// A commit over `base` whose tree has entry `name` (at the top) point
/// at object `id` of `mode`.
fn commit_entry(repo: &Repository, base: Oid, name: &str, id: Oid, mode: i32) -> Oid {
    let parent = repo.find_commit(base).unwrap();
    let mut tb = repo.treebuilder(Some(&parent.tree().unwrap())).unwrap();
    tb.insert(name, id, mode).unwrap();
    let tree = repo.find_tree(tb.write().unwrap()).unwrap();
    let sig = git2::Signature::now("T", "t@example.com").unwrap();
    repo.commit(None, &sig, &sig, "c", &tree, &[&parent])
        .unwrap()
}

#[test]
fn an_empty_tree_on_the_way_hides_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::init_bare(tmp.path()).unwrap();
    let protect = vec![".gitlab-ci.yml".to_owned()];
    let base = commit(&repo, &[("a", "1"), (".gitlab-ci.yml", "ok")], &[]);
    let empty = repo.treebuilder(None).unwrap().write().unwrap();
    let c1 = commit_entry(&repo, base, ".gitlab-ci.yml", empty, 0o040_000);
    let evil = repo.blob(b"evil").unwrap();
    let c2 = commit_entry(&repo, c1, ".gitlab-ci.yml", evil, 0o100_644);
    let c = first_change(&repo, c2, &[base], &protect).unwrap().unwrap();
    assert_eq!(c.commit, c1);
}

#[test]
fn a_tree_git_would_not_write_is_held() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::init_bare(tmp.path()).unwrap();
    let protect = vec![".husky/".to_owned()];
    let base = commit(&repo, &[("a", "1")], &[]);
    // Entries out of git's order, written by hand: `b` before `a`.
    let blob = repo.blob(b"x").unwrap();
    let mut raw = Vec::new();
    for name in ["b", "a"] {
        raw.extend_from_slice(format!("100644 {name}\0").as_bytes());
        raw.extend_from_slice(blob.as_bytes());
    }
    let tree = repo.odb().unwrap().write(ObjectType::Tree, &raw).unwrap();
    let sig = git2::Signature::now("T", "t@example.com").unwrap();
    let parent = repo.find_commit(base).unwrap();
    let bad = repo
        .commit(
            None,
            &sig,
            &sig,
            "c",
            &repo.find_tree(tree).unwrap(),
            &[&parent],
        )
        .unwrap();
    let c = first_change(&repo, bad, &[base], &protect)
        .unwrap()
        .unwrap();
    assert_eq!(c.pattern, "(a tree git would not write)");
}

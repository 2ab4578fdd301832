//! Sync between the host repository and a sandbox, through the real agentctl
//! and agentd, with real repositories.

mod common;

use std::fs;

use common::{Env, git};

/// Run a shell script inside the sandbox (as its agent), returning stdout.
fn sh(env: &Env, name: &str, script: &str) -> String {
    let full = format!(
        "set -e; git config --global user.email agent@example.com; git config --global user.name Agent; {script}"
    );
    env.ok(&["exec", name, "--", "sh", "-c", &full])
}

fn host_state(repo: &std::path::Path) -> (String, String, String) {
    (
        git(repo, &["rev-parse", "HEAD"]),
        git(repo, &["status", "--porcelain=v1", "--untracked-files=all"]),
        fs::read_to_string(repo.join("README.md")).unwrap(),
    )
}

/// Commit what is staged in the host repository, as the person would.
fn host_commit(repo: &std::path::Path, message: &str) {
    git(
        repo,
        &[
            "-c",
            "user.name=H",
            "-c",
            "user.email=h@example.com",
            "commit",
            "-qm",
            message,
        ],
    );
}

fn setup(env: &Env, name: &str) -> std::path::PathBuf {
    let repo = env.repo(name);
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", name]);
    repo
}

#[test]
fn to_host_brings_branches_and_leaves_the_work_tree_alone() {
    let env = Env::new();
    let repo = setup(&env, "proj");
    // Uncommitted host work that must survive untouched.
    fs::write(repo.join("README.md"), "# edited on the host\n").unwrap();
    fs::write(repo.join("notes.txt"), "untracked\n").unwrap();
    let before = host_state(&repo);

    sh(
        &env,
        "proj",
        "echo one > one.txt; git add one.txt; git commit -qm one; \
                      git switch -qc feature/x; echo two > two.txt; git add two.txt; git commit -qm two; git switch -q main",
    );
    let main = sh(&env, "proj", "git rev-parse main");
    let feature = sh(&env, "proj", "git rev-parse feature/x");

    let dry = env.ok(&["sync", "proj", "--dry-run"]);
    assert!(dry.contains("Would bring 2 branch(es)"), "{dry}");
    assert!(
        dry.contains("main") && dry.contains("1 commit(s), 1 file(s): one.txt"),
        "{dry}"
    );
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(&repo)
        .args(["rev-parse", "--verify", "-q", "sandbox/proj/main"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "a dry run wrote a ref");

    let out = env.ok(&["sync", "proj"]);
    assert!(out.contains("Brought 2 branch(es)"), "{out}");
    assert_eq!(
        git(&repo, &["rev-parse", "refs/remotes/sandbox/proj/main"]),
        main
    );
    assert_eq!(
        git(&repo, &["rev-parse", "refs/remotes/sandbox/proj/feature/x"]),
        feature
    );
    assert_eq!(
        git(&repo, &["log", "--format=%s", "sandbox/proj/main"]),
        "one\nfirst\n"
    );
    assert_eq!(
        host_state(&repo),
        before,
        "the host's HEAD, index or files changed"
    );
    // A real remote, so `git fetch sandbox/proj` knows where to go.
    // (Not fetched by `git fetch --all`, past the guards.)
    assert_eq!(
        git(&repo, &["config", "remote.sandbox/proj.skipFetchAll"]).trim(),
        "true"
    );
    let url = git(&repo, &["config", "remote.sandbox/proj.url"]);
    assert!(url.trim().ends_with("sandboxes/proj/workspace"), "{url}");

    // Nothing new: exit 2.
    let out = env.ctl(&["sync", "proj"]);
    assert_eq!(out.status.code(), Some(2));
    // JSON for scripts.
    sh(&env, "proj", "echo three >> one.txt; git commit -qam three");
    let json: serde_json::Value =
        serde_json::from_str(&env.ok(&["sync", "proj", "--json", "--branch", "main"])).unwrap();
    assert_eq!(json["branches"][0]["branch"], "main");
    assert_eq!(json["branches"][0]["commits"], 1);
    assert_eq!(json["branches"][0]["old"], main.trim());
    let st = env.status("proj");
    assert!(st["state"] == "running");
    // Works on a stopped sandbox too: the workspace is on the host's disk.
    env.ok(&["stop", "proj"]);
    assert_eq!(env.ctl(&["sync", "proj"]).status.code(), Some(2));
}

#[test]
fn into_fast_forwards_only() {
    let env = Env::new();
    let repo = setup(&env, "ff");
    sh(
        &env,
        "ff",
        "echo a > a.txt; git add a.txt; git commit -qm a",
    );
    let out = env.ok(&["sync", "ff", "--into", "main"]);
    assert!(
        out.contains("'main' fast-forwarded") && out.contains("(files updated)"),
        "{out}"
    );
    assert_eq!(fs::read_to_string(repo.join("a.txt")).unwrap(), "a\n");
    assert_eq!(git(&repo, &["status", "--porcelain"]), "");

    // A dirty checkout is never overwritten.
    sh(
        &env,
        "ff",
        "echo b > b.txt; git add b.txt; git commit -qm b",
    );
    fs::write(repo.join("a.txt"), "host edit\n").unwrap();
    let head = git(&repo, &["rev-parse", "HEAD"]);
    let err = env.fails(3, &["sync", "ff", "--into", "main"]);
    assert!(err.contains("uncommitted change"), "{err}");
    assert_eq!(git(&repo, &["rev-parse", "HEAD"]), head);
    assert_eq!(
        fs::read_to_string(repo.join("a.txt")).unwrap(),
        "host edit\n"
    );
    git(&repo, &["checkout", "--", "a.txt"]);

    // Diverged: exit 3 with the commands to merge by hand; nothing moves.
    fs::write(repo.join("host.txt"), "h\n").unwrap();
    git(&repo, &["add", "host.txt"]);
    host_commit(&repo, "host");
    let head = git(&repo, &["rev-parse", "HEAD"]);
    let err = env.fails(3, &["sync", "ff", "--into", "main"]);
    assert!(
        err.contains("diverged") && err.contains("git merge sandbox/ff/main"),
        "{err}"
    );
    assert_eq!(git(&repo, &["rev-parse", "HEAD"]), head);

    // A branch that is not checked out moves without touching files.
    sh(
        &env,
        "ff",
        "git switch -qc topic; echo t > t.txt; git add t.txt; git commit -qm t",
    );
    env.ok(&["sync", "ff", "--into", "topic", "--branch", "topic"]);
    assert_eq!(
        git(&repo, &["rev-parse", "topic"]),
        sh(&env, "ff", "git rev-parse topic")
    );
    assert!(!repo.join("t.txt").exists());
}

#[test]
fn a_dry_run_counts_only_what_the_host_lacks() {
    let env = Env::new();
    let repo = setup(&env, "dry");
    for i in 0..5 {
        fs::write(repo.join(format!("f{i}.txt")), "f\n").unwrap();
    }
    git(&repo, &["add", "."]);
    host_commit(&repo, "files");
    env.ok(&["sync", "dry", "--from-host"]);
    // A branch at a commit the host has, and one with one commit more.
    sh(
        &env,
        "dry",
        "git reset -q --hard host/main; git branch same HEAD; \
         git switch -qc more; echo m > m.txt; git add m.txt; git commit -qm m",
    );
    let short = &git(&repo, &["rev-parse", "main"])[..12];
    let dry = env.ok(&["sync", "dry", "--dry-run"]);
    for b in ["main", "same"] {
        assert!(
            dry.contains(&format!("  {b}  new at {short}  new ref, no new commits\n")),
            "{dry}"
        );
    }
    assert!(
        dry.contains("  more  new at ") && dry.contains("1 commit(s), 1 file(s): m.txt\n"),
        "{dry}"
    );
    assert!(
        !dry.contains("f0.txt") && !dry.contains("README.md"),
        "{dry}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&env.ok(&["sync", "dry", "--dry-run", "--json", "-b", "same"]))
            .unwrap();
    assert_eq!(json["branches"][0]["commits"], 0, "{json}");
    assert_eq!(json["branches"][0]["files_changed"], 0, "{json}");
    assert_eq!(
        json["branches"][0]["files"],
        serde_json::json!([]),
        "{json}"
    );
}

#[test]
fn into_names_the_branch_on_both_sides_and_refuses_a_mismatch() {
    let env = Env::new();
    let repo = env.repo("mst");
    git(&repo, &["branch", "-m", "main", "master"]);
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "mst"]);
    sh(
        &env,
        "mst",
        "echo a > a.txt; git add a.txt; git commit -qm a; \
         git switch -qc feature/x; echo x > x.txt; git add x.txt; git commit -qm x; git switch -q master",
    );
    let nothing_synced = || {
        assert_eq!(sandbox_refs(&repo, "mst"), Vec::<String>::new());
        assert_eq!(git(&repo, &["branch", "--list"]), "* master\n");
    };
    // The docs' `--into main` on a repository whose branch is master.
    let err = env.fails(4, &["sync", "mst", "--into", "main"]);
    assert!(
        err.contains("Sandbox 'mst'")
            && err.contains("no branch 'main' (it has: feature/x, master)")
            && err.contains("Did you mean: --into master"),
        "{err}"
    );
    nothing_synced();
    // -b names one branch, --into another: refused, with what to type.
    let err = env.fails(4, &["sync", "mst", "-b", "feature/x", "--into", "master"]);
    assert!(
        err.contains("agentctl sync mst -b feature/x --into feature/x")
            && err.contains("git merge sandbox/mst/feature/x"),
        "{err}"
    );
    nothing_synced();
    let dry = env.fails(4, &["sync", "mst", "--dry-run", "--into", "main"]);
    assert!(dry.contains("--into master"), "{dry}");
    // The same name on both sides works.
    let out = env.ok(&["sync", "mst", "-b", "feature/x", "--into", "feature/x"]);
    assert!(out.contains("'feature/x' fast-forwarded"), "{out}");
    let out = env.ok(&["sync", "mst", "--into", "master"]);
    assert!(out.contains("'master' fast-forwarded"), "{out}");
    assert_eq!(fs::read_to_string(repo.join("a.txt")).unwrap(), "a\n");
}

#[test]
fn from_host_updates_only_host_refs() {
    let env = Env::new();
    let repo = setup(&env, "fh");
    sh(&env, "fh", "echo wip > wip.txt; echo local >> README.md");
    let before = sh(
        &env,
        "fh",
        "git rev-parse HEAD; git status --porcelain; git branch --list",
    );
    fs::write(repo.join("new.txt"), "n\n").unwrap();
    git(&repo, &["add", "new.txt"]);
    host_commit(&repo, "host work");
    git(&repo, &["branch", "release"]);
    let out = env.ok(&["sync", "fh", "--from-host"]);
    assert!(out.contains("into sandbox 'fh'"), "{out}");
    assert_eq!(
        sh(&env, "fh", "git rev-parse host/main"),
        git(&repo, &["rev-parse", "main"])
    );
    assert_eq!(
        sh(&env, "fh", "git rev-parse host/release"),
        git(&repo, &["rev-parse", "release"])
    );
    assert_eq!(
        sh(
            &env,
            "fh",
            "git rev-parse HEAD; git status --porcelain; git branch --list"
        ),
        before
    );
    assert_eq!(
        env.ctl(&["sync", "fh", "--from-host"]).status.code(),
        Some(2)
    );
}

#[test]
fn a_hostile_workspace_cannot_hurt_the_host() {
    let env = Env::new();
    let repo = setup(&env, "evil");
    let marker = env.tmp.path().join("hook-ran");
    // Hooks and fsmonitor set by the sandbox must never run on the host.
    let hook = format!("#!/bin/sh\ntouch {}\n", marker.display());
    sh(
        &env,
        "evil",
        &format!(
            "mkdir -p /workspace/.hooks; printf '{}' > /workspace/.hooks/post-merge; chmod +x /workspace/.hooks/*; \
         git config core.hooksPath /workspace/.hooks; git config core.fsmonitor /workspace/.hooks/post-merge; \
         echo ok > ok.txt; git add ok.txt; git commit -qm ok",
            hook.replace('\n', "\\n")
        ),
    );
    // A hook in `.git/hooks` too (read-only inside, a protected path: put
    // there as by an agent with the protection off).
    let hooks = env.state_dir.join("sandboxes/evil/workspace/.git/hooks");
    fs::write(hooks.join("reference-transaction"), &hook).unwrap();
    fs::set_permissions(
        hooks.join("reference-transaction"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    // Refs the sandbox planted: a symlink, garbage, names git forbids.
    let refs_dir = env
        .state_dir
        .join("sandboxes/evil/workspace/.git/refs/heads");
    let main = fs::read_to_string(refs_dir.join("main")).unwrap();
    std::os::unix::fs::symlink(repo.join(".git/refs/heads/main"), refs_dir.join("link")).unwrap();
    fs::write(refs_dir.join("garbage"), "this is not a hash\n").unwrap();
    fs::write(refs_dir.join("a..b"), &main).unwrap();
    fs::write(refs_dir.join("bell\u{7}"), &main).unwrap();
    // And a 120 MiB file on its own branch.
    sh(
        &env,
        "evil",
        "git switch -qc big; truncate -s 120M big.bin; git add big.bin; git commit -qm big; git switch -q main",
    );

    let before = git(&repo, &["for-each-ref"]);
    let out = env.ctl(&["sync", "evil"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "'link' is a symlink",
        "'garbage' has a malformed ref",
        "'a..b' is not a valid git ref",
        "over the 100 MiB limit",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in {err}");
    }
    assert!(String::from_utf8_lossy(&out.stdout).contains("main"));
    let after = git(&repo, &["for-each-ref", "--format=%(refname)"]);
    assert_eq!(
        after
            .lines()
            .filter(|r| r.starts_with("refs/remotes/sandbox/evil/"))
            .collect::<Vec<_>>(),
        ["refs/remotes/sandbox/evil/main"]
    );
    assert!(!marker.exists(), "a sandbox hook ran on the host");
    assert!(
        before
            .lines()
            .all(|l| git(&repo, &["for-each-ref"]).contains(l))
    );

    // .git swapped for a symlink to the host's own repository: refused.
    let ws = env.state_dir.join("sandboxes/evil/workspace");
    fs::rename(ws.join(".git"), ws.join("git.real")).unwrap();
    std::os::unix::fs::symlink(repo.join(".git"), ws.join(".git")).unwrap();
    let refs_before = git(&repo, &["for-each-ref"]);
    let objects_before = count_files(&repo.join(".git/objects"));
    let err = env.fails(3, &["sync", "evil"]);
    assert!(err.contains("not a directory (a symlink?)"), "{err}");
    // The helpers that write into the workspace never reach the host
    // project through it: they see nothing but the workspace.
    assert_ne!(
        env.ctl(&["sync", "evil", "--from-host"]).status.code(),
        Some(0)
    );
    assert_ne!(
        env.ctl(&["worktree", "add", "evil", "intruder"])
            .status
            .code(),
        Some(0)
    );
    assert_eq!(git(&repo, &["for-each-ref"]), refs_before);
    assert!(!repo.join(".git/worktrees").exists());
    assert!(!repo.join(".worktrees").exists());
    // The same with only .git/refs pointing at the host's refs.
    fs::remove_file(ws.join(".git")).unwrap();
    fs::rename(ws.join("git.real"), ws.join(".git")).unwrap();
    fs::rename(ws.join(".git/refs"), ws.join(".git/refs.real")).unwrap();
    std::os::unix::fs::symlink(repo.join(".git/refs"), ws.join(".git/refs")).unwrap();
    git(&repo, &["branch", "lure"]);
    let heads_before = git(&repo, &["for-each-ref", "refs/heads", "refs/remotes/host"]);
    let _ = env.ctl(&["sync", "evil", "--from-host"]);
    let _ = env.ctl(&["sync", "evil"]);
    // (The sandbox's own mirror, refs/remotes/sandbox/evil/*, is its to prune.)
    assert_eq!(
        git(&repo, &["for-each-ref", "refs/heads", "refs/remotes/host"]),
        heads_before
    );
    assert!(!git(&repo, &["for-each-ref", "--format=%(refname)"]).contains("refs/remotes/host/"));
    assert_eq!(count_files(&repo.join(".git/objects")), objects_before);
    assert!(!marker.exists());
    // agentd is fine.
    assert_eq!(env.state("evil"), "running");
}

fn count_files(dir: &std::path::Path) -> usize {
    fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            if e.path().is_dir() {
                count_files(&e.path())
            } else {
                1
            }
        })
        .sum()
}

/// Every `refs/remotes/sandbox/<name>/*` ref on the host, by short name.
fn sandbox_refs(repo: &std::path::Path, name: &str) -> Vec<String> {
    let prefix = format!("refs/remotes/sandbox/{name}/");
    git(repo, &["for-each-ref", "--format=%(refname)"])
        .lines()
        .filter_map(|r| r.strip_prefix(&prefix).map(str::to_owned))
        .collect()
}

#[test]
fn the_size_cap_counts_commits_too() {
    let env = Env::new();
    let repo = setup(&env, "cap");
    // A 101 MiB commit message (it compresses to almost nothing on disk).
    sh(
        &env,
        "cap",
        "echo ok > ok.txt; git add ok.txt; git commit -qm ok; \
         git switch -qc novel; \
         head -c 105906176 /dev/zero | tr '\\0' x | git commit -q --allow-empty --cleanup=verbatim -F -; \
         git switch -q main",
    );
    let novel = sh(&env, "cap", "git rev-parse novel");
    let main = sh(&env, "cap", "git rev-parse main");
    let out = env.ctl(&["sync", "cap"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("branch 'novel'") && err.contains("over the 100 MiB limit"),
        "{err}"
    );
    assert_eq!(sandbox_refs(&repo, "cap"), ["main"]);
    assert_eq!(
        git(&repo, &["rev-parse", "refs/remotes/sandbox/cap/main"]),
        main
    );
    // The commit never reached the host's object store.
    let has = std::process::Command::new("git")
        .arg("-C")
        .arg(&repo)
        .args(["cat-file", "-e", novel.trim()])
        .output()
        .unwrap();
    assert!(!has.status.success(), "the oversized commit was stored");
}

#[test]
fn one_bad_ref_name_skips_only_that_branch() {
    let env = Env::new();
    let repo = setup(&env, "names");
    sh(
        &env,
        "names",
        "echo one > one.txt; git add one.txt; git commit -qm one; git branch feature",
    );
    let main = sh(&env, "names", "git rev-parse main");
    let main = main.trim();
    // Names only a hand-written packed-refs can hold: 3 KB long, with a
    // control character, and both `x` and `x/y` (git cannot store both).
    let long = "a".repeat(3000);
    let packed = env
        .state_dir
        .join("sandboxes/names/workspace/.git/packed-refs");
    fs::write(
        &packed,
        format!(
            "# pack-refs with: peeled fully-peeled sorted \n{main} refs/heads/{long}\n\
             {main} refs/heads/esc\u{1b}[31m\n{main} refs/heads/x\n{main} refs/heads/x/y\n"
        ),
    )
    .unwrap();
    let out = env.ctl(&["sync", "names"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(sandbox_refs(&repo, "names"), ["feature", "main", "x"]);
    // Each bad name is named, escaped and shortened.
    let notice = |needle: &str| {
        err.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no notice naming {needle:?} in {err}"))
            .to_owned()
    };
    let long_notice = notice("aaaaaaaaaa");
    assert!(long_notice.starts_with("skipped: "), "{long_notice}");
    assert!(long_notice.len() < 400, "{long_notice}");
    assert!(notice("x/y").starts_with("skipped: "), "{err}");
    assert!(notice("esc\\u{1b}[31m").starts_with("skipped: "), "{err}");
    assert!(!err.contains('\u{1b}'), "{err}");
    assert!(err.len() < 2000, "{err}");
}

#[test]
fn into_changes_nothing_when_the_tree_is_refused() {
    let env = Env::new();
    let repo = setup(&env, "dup");
    // (With protected paths, the default, such a tree is held back before
    // `--into` looks at it: tests/guard.rs. Here, what `--into` does.)
    env.ok(&["set", "dup", "--no-protect"]);
    // A commit whose tree git would refuse: one name twice.
    sh(
        &env,
        "dup",
        "one=$(echo one | git hash-object -w --stdin); two=$(echo two | git hash-object -w --stdin); \
         readme=$(git rev-parse HEAD:README.md); \
         sub=$(printf '100644 blob %s\\tinner.txt\\n' $two | git mktree); \
         tree=$(printf '100644 blob %s\\tREADME.md\\n100644 blob %s\\tdup.txt\\n040000 tree %s\\tdup.txt\\n' \
                $readme $one $sub | git mktree --missing); \
         git reset -q $(git commit-tree -p HEAD -m dup $tree)",
    );
    let index = fs::read(repo.join(".git/index")).unwrap();
    let heads = git(&repo, &["for-each-ref", "refs/heads"]);
    let before = host_state(&repo);
    let err = env.fails(3, &["sync", "dup", "--into", "main"]);
    assert!(
        err.contains("dup.txt") && err.contains("nothing was changed"),
        "{err}"
    );
    assert!(err.contains("'dup'"), "{err}");
    assert_eq!(host_state(&repo), before);
    assert!(!repo.join("dup.txt").exists());
    assert_eq!(git(&repo, &["for-each-ref", "refs/heads"]), heads);
    assert_eq!(fs::read(repo.join(".git/index")).unwrap(), index);
    // The sync itself took place: the sandbox ref is there to inspect.
    assert_eq!(
        git(&repo, &["rev-parse", "refs/remotes/sandbox/dup/main"]),
        sh(&env, "dup", "git rev-parse main")
    );
    // Nor is a branch that is not checked out moved to such a tree (here a
    // plain duplicate and a `.git` directory), where `git switch` would
    // stumble later.
    for (n, entries) in [
        "'100644 blob %s\\tsame.txt\\n100644 blob %s\\tsame.txt\\n' $one $two",
        "'040000 tree %s\\t.git\\n' $(git rev-parse HEAD^{tree})",
    ]
    .iter()
    .enumerate()
    {
        sh(
            &env,
            "dup",
            &format!(
                "one=$(echo one | git hash-object -w --stdin); two=$(echo two | git hash-object -w --stdin); \
                 tree=$(printf {entries} | git mktree); \
                 git branch -f topic{n} $(git commit-tree -p HEAD -m bad $tree)"
            ),
        );
        let err = env.fails(3, &["sync", "dup", "--into", &format!("topic{n}")]);
        assert!(err.contains("nothing was changed"), "{err}");
        assert_eq!(git(&repo, &["for-each-ref", "refs/heads"]), heads);
    }
    assert_eq!(host_state(&repo), before);
}

/// A new commit in sandbox `name` whose object becomes a FIFO: a sync's
/// reader blocks opening it, for as long as the sandbox likes.
fn plant_fifo_object(env: &Env, name: &str) {
    sh(
        env,
        name,
        "echo x > x; git add x; git commit -qm x; h=$(git rev-parse HEAD); \
         o=.git/objects/$(echo $h | cut -c1-2)/$(echo $h | cut -c3-); rm -f $o; mkfifo $o",
    );
}

#[test]
fn destroy_cuts_short_a_sync_the_sandbox_holds_up() {
    let env = Env::new();
    setup(&env, "held");
    plant_fifo_object(&env, "held");
    env.ok(&["stop", "held"]);
    let sync = env
        .ctl_cmd(&["sync", "held"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let reader = env.wait_for_helper("__sync-read");
    // What reads the sandbox's files can do nothing else on the host.
    common::assert_helper_confined(reader);
    // Destroy does not wait for ever: it cuts the sync short.
    env.ok(&["destroy", "held"]);
    let out = sync.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("the sandbox is being destroyed"), "{err}");
    common::wait_for(
        "the sync's helpers to end",
        std::time::Duration::from_secs(10),
        || !env.helper_runs("__sync-read") && !env.helper_runs("__sync-write"),
    );
    assert!(env.list().is_empty());
    assert!(!env.state_dir.join("sandboxes/held").exists());
}

#[test]
fn a_helper_the_sandbox_holds_up_ends_with_a_killed_agentd() {
    let mut env = Env::new();
    setup(&env, "orphan");
    plant_fifo_object(&env, "orphan");
    let sync = env
        .ctl_cmd(&["sync", "orphan"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let reader = env.wait_for_helper("__sync-read");
    let writer = env.wait_for_helper("__sync-write");
    // A crash of agentd: the helpers it started, one blocked on the FIFO
    // for as long as the sandbox likes, end with it instead of staying
    // behind as orphans.
    env.kill_agentd();
    let alive = |pid: i32| agentd::procfs::state(pid).is_some_and(|s| s != 'Z');
    common::wait_for(
        "the helpers of the killed agentd to end",
        std::time::Duration::from_secs(10),
        || !alive(reader) && !alive(writer),
    );
    let _ = sync.wait_with_output();
}

/// The soft descriptor limit of process `pid`.
fn soft_nofile(pid: i32) -> u64 {
    let limits = fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    line.split_whitespace().nth(3).unwrap().parse().unwrap()
}

#[test]
fn what_agentd_starts_has_the_descriptor_limit_agentd_started_with() {
    // agentd raises its own limit; its helpers and a sandbox's processes,
    // which apply what they are given themselves after exec, go back to
    // the limit agentd started with; what runs in the sandbox is not told
    // how it was passed.
    let mut env = Env::bus_only();
    env.soft_nofile = Some(1000);
    env.start_agentd();
    assert!(soft_nofile(env.agentd_pid()) > 1000);
    setup(&env, "limited");
    assert_eq!(sh(&env, "limited", "ulimit -Sn").trim(), "1000");
    assert!(!sh(&env, "limited", "env").contains("AGENTD_START"));
    plant_fifo_object(&env, "limited");
    let sync = env
        .ctl_cmd(&["sync", "limited"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    for helper in [
        env.wait_for_helper("__sync-read"),
        env.wait_for_helper("__sync-write"),
    ] {
        assert_eq!(soft_nofile(helper), 1000, "helper {helper}");
    }
    env.kill_agentd();
    let _ = sync.wait_with_output();
}

/// One sync of a new branch that points at a commit the destination already
/// has: what went wrong, if anything.
fn sync_of_a_known_commit(env: &Env, args: &[&str], branch: &str) -> Option<String> {
    let out = env.ctl(args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let fine = out.status.success()
        && stdout.contains("Brought ")
        && stdout.contains(&format!("  {branch}  new at "))
        && stdout.contains("new ref, no new commits");
    (!fine).then(|| {
        format!(
            "{args:?} ({:?}): {}{}",
            out.status.code(),
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })
}

#[test]
fn a_branch_at_a_commit_the_destination_has_syncs_without_a_broken_pipe() {
    // The writer needs no pack for such a branch and may be done before
    // agentd has passed on the (empty) pack: 50 times each way, every sync
    // must succeed, say what it brought, and move the ref.
    const ROUNDS: usize = 50;
    let env = Env::new();
    let repo = setup(&env, "known");
    let head = git(&repo, &["rev-parse", "main"]);
    let mut failures = Vec::new();
    for i in 0..ROUNDS {
        let branch = format!("x{i}");
        sh(&env, "known", &format!("git branch {branch} HEAD"));
        failures.extend(sync_of_a_known_commit(&env, &["sync", "known"], &branch));
        assert_eq!(
            common::host_ref(&repo, &format!("refs/remotes/sandbox/known/{branch}")).as_deref(),
            Some(head.trim()),
            "{branch} did not arrive on the host"
        );
    }
    for i in 0..ROUNDS {
        let branch = format!("h{i}");
        git(&repo, &["branch", &branch, "main"]);
        failures.extend(sync_of_a_known_commit(
            &env,
            &["sync", "known", "--from-host"],
            &branch,
        ));
        assert_eq!(
            sh(&env, "known", &format!("git rev-parse host/{branch}")),
            head,
            "{branch} did not arrive in the sandbox"
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {} syncs failed:\n{}",
        failures.len(),
        2 * ROUNDS,
        failures.join("\n")
    );
}

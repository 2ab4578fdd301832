//! Worktrees: one per branch at /workspace/.worktrees/<branch>, usable
//! inside the sandbox and inspected from the host.

mod common;

use common::{Env, git};

fn list(env: &Env, name: &str) -> Vec<serde_json::Value> {
    serde_json::from_str(&env.ok(&["worktree", "list", name, "--json"])).unwrap()
}

#[test]
fn add_list_remove_and_git_works_inside_every_worktree() {
    let env = Env::new();
    let repo = env.repo("wt");
    git(&repo, &["branch", "release"]);
    env.ok(&["create", repo.to_str().unwrap()]);
    // Worktrees can be made while the sandbox is stopped...
    let out = env.ok(&["worktree", "add", "wt", "feature/login"]);
    assert!(out.contains("/workspace/.worktrees/feature/login"), "{out}");
    env.ok(&["start", "wt"]);
    // ...and while it runs; a host branch is checked out tracking the host.
    env.ok(&["worktree", "add", "wt", "release"]);
    env.ok(&["worktree", "add", "wt", "spike", "--from", "host/main"]);

    for (dir, branch) in [
        ("/workspace", "## main...host/main"),
        ("/workspace/.worktrees/feature/login", "## feature/login"),
        ("/workspace/.worktrees/release", "## release...host/release"),
        ("/workspace/.worktrees/spike", "## spike"),
    ] {
        let st = env.ok(&["exec", "wt", "-w", dir, "--", "git", "status", "-sb"]);
        assert_eq!(st, format!("{branch}\n"), "in {dir}");
    }
    let wl = env.ok(&["exec", "wt", "--", "git", "worktree", "list", "--porcelain"]);
    assert!(
        wl.contains("worktree /workspace/.worktrees/feature/login\n"),
        "{wl}"
    );

    // Work in a worktree shows up in the listing.
    env.ok(&["exec", "wt", "-w", "/workspace/.worktrees/release", "--", "sh", "-c",
        "echo r > r.txt && git add r.txt && git -c user.name=A -c user.email=a@example.com commit -qm r && echo dirty > d.txt"]);
    let l = list(&env, "wt");
    let names: Vec<&str> = l.iter().map(|w| w["branch"].as_str().unwrap()).collect();
    assert_eq!(names, ["main", "feature/login", "release", "spike"]);
    assert_eq!(l[0]["main"], true);
    let release = &l[2];
    assert_eq!(release["path"], "/workspace/.worktrees/release");
    assert_eq!(release["dirty"], true);
    assert_eq!(release["ahead"], 1);
    assert_eq!(release["behind"], 0);
    assert_eq!(
        l[1]["ahead"],
        serde_json::Value::Null,
        "no host branch to compare with"
    );
    // The main worktree does not see .worktrees/ as untracked.
    assert_eq!(
        env.ok(&["exec", "wt", "--", "git", "status", "--porcelain"]),
        ""
    );

    // Uncommitted work is not dropped without --force.
    let err = env.fails(3, &["worktree", "remove", "wt", "release"]);
    assert!(err.contains("uncommitted changes"), "{err}");
    env.ok(&["worktree", "remove", "wt", "release", "--force"]);
    env.ok(&["worktree", "remove", "wt", "feature/login"]);
    let l = list(&env, "wt");
    assert_eq!(l.len(), 2);
    // Branches stay; their work comes back with a sync.
    env.ok(&["sync", "wt"]);
    assert_eq!(
        git(&repo, &["log", "-1", "--format=%s", "sandbox/wt/release"]),
        "r\n"
    );
    // And a removed worktree can be added again.
    env.ok(&["worktree", "add", "wt", "feature/login"]);
}

#[test]
fn bad_requests_are_refused_and_change_nothing() {
    let env = Env::new();
    let repo = env.repo("wtbad");
    env.ok(&["create", repo.to_str().unwrap()]);
    for (args, needle) in [
        (
            &["worktree", "add", "wtbad", "a..b"][..],
            "not a valid git branch name",
        ),
        (&["worktree", "add", "wtbad", "-x"], "unexpected argument"),
        (
            &["worktree", "add", "wtbad", "main"],
            "main worktree's branch",
        ),
        (
            &["worktree", "add", "wtbad", "new", "--from", "no-such-ref"],
            "is not a commit",
        ),
        (
            &["worktree", "remove", "wtbad", "nothing"],
            "has no worktree",
        ),
    ] {
        let err = env.fails(4, args);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    env.ok(&["worktree", "add", "wtbad", "topic"]);
    let err = env.fails(4, &["worktree", "add", "wtbad", "topic"]);
    assert!(err.contains("already has a worktree"), "{err}");
    env.ok(&["worktree", "remove", "wtbad", "topic"]);
    let err = env.fails(4, &["worktree", "add", "wtbad", "topic", "--from", "main"]);
    assert!(
        err.contains("exists already; --from only applies to a new branch"),
        "{err}"
    );
    assert_eq!(list(&env, "wtbad").len(), 1);
    env.fails(1, &["worktree", "list", "nosuch"]);
}

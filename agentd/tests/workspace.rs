//! Creating a workspace: a clone with copied objects, the host's branches,
//! env files, and the cases people run into.

mod common;

use std::collections::HashSet;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use common::{Env, git};

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p))
        } else {
            out.push(p)
        }
    }
    out
}

fn commit(repo: &Path, msg: &str) {
    git(repo, &["add", "-A"]);
    git(
        repo,
        &[
            "-c",
            "user.name=T",
            "-c",
            "user.email=t@example.com",
            "commit",
            "-qm",
            msg,
        ],
    );
}

fn create(env: &Env, repo: &Path, name: &str) -> String {
    let out = env.ctl(&["create", "--name", name, repo.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stderr).unwrap()
}

#[test]
fn clone_copies_objects_and_brings_every_host_branch() {
    let env = Env::new();
    let repo = env.repo("proj");
    git(&repo, &["branch", "feature/a"]);
    git(&repo, &["branch", "release"]);
    create(&env, &repo, "proj");
    let ws = env.state_dir.join("sandboxes/proj/workspace");
    let host: HashSet<u64> = files(&repo.join(".git/objects"))
        .iter()
        .map(|p| fs::metadata(p).unwrap().ino())
        .collect();
    for f in files(&ws.join(".git/objects")) {
        assert!(
            !host.contains(&fs::metadata(&f).unwrap().ino()),
            "{} shares an inode with the host",
            f.display()
        );
    }
    env.ok(&["start", "proj"]);
    let refs = env.ok(&[
        "exec",
        "proj",
        "--",
        "git",
        "for-each-ref",
        "--format=%(refname)",
        "refs/remotes/host",
    ]);
    assert_eq!(
        refs,
        "refs/remotes/host/HEAD\nrefs/remotes/host/feature/a\nrefs/remotes/host/main\nrefs/remotes/host/release\n"
    );
    let st = env.ok(&["exec", "proj", "--", "git", "status", "-sb"]);
    assert_eq!(st, "## main...host/main\n");
}

#[test]
fn env_files_are_copied_safely_and_skips_are_explained() {
    let env = Env::new();
    let repo = env.repo("envs");
    fs::write(repo.join(".gitignore"), ".env*\n!.envrc\n").unwrap();
    fs::write(repo.join(".envrc"), "use nix\n").unwrap();
    commit(&repo, "ignore env files");
    fs::write(repo.join(".env"), "SECRET=1\n").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", repo.join(".env.link")).unwrap();
    fs::write(repo.join(".env.big"), vec![b'x'; 2 << 20]).unwrap();
    fs::create_dir(repo.join(".env.d")).unwrap();
    let notes = create(&env, &repo, "envs");
    assert!(notes.contains("copied env file .env\n"), "{notes}");
    assert!(
        notes.contains("env file .env.link was not copied: it is a symlink"),
        "{notes}"
    );
    assert!(
        notes.contains("env file .env.big was not copied: it is 2048 KiB, over the 1024 KiB limit"),
        "{notes}"
    );
    assert!(
        notes.contains("env file .env.d was not copied: it is not a regular file"),
        "{notes}"
    );
    env.ok(&["start", "envs"]);
    assert_eq!(env.ok(&["exec", "envs", "--", "cat", ".env"]), "SECRET=1\n");
    assert_eq!(
        env.ok(&["exec", "envs", "--", "cat", ".envrc"]),
        "use nix\n"
    );
    assert_ne!(
        env.ctl(&["exec", "envs", "--", "test", "-e", ".env.link"])
            .status
            .code(),
        Some(0)
    );
    assert_ne!(
        env.ctl(&["exec", "envs", "--", "test", "-e", ".env.big"])
            .status
            .code(),
        Some(0)
    );
}

#[test]
fn dirty_host_detached_head_submodules_and_lfs_are_reported_or_kept() {
    let env = Env::new();
    let sub = env.repo("sub");
    let repo = env.repo("odd");
    git(
        &repo,
        &[
            "-c",
            "protocol.file.allow=always",
            "submodule",
            "add",
            "-q",
            sub.to_str().unwrap(),
            "vendor/sub",
        ],
    );
    let pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 12345\n";
    fs::write(
        repo.join(".gitattributes"),
        "*.bin filter=lfs diff=lfs merge=lfs -text\n",
    )
    .unwrap();
    fs::write(repo.join("asset.bin"), pointer).unwrap();
    commit(&repo, "submodule and lfs");
    let head = git(&repo, &["rev-parse", "HEAD"]);
    git(&repo, &["checkout", "-q", "--detach"]);
    fs::write(repo.join("README.md"), "dirty\n").unwrap();
    let notes = create(&env, &repo, "odd");
    assert!(
        notes.contains("uncommitted change(s)") && notes.contains("not carried into the sandbox"),
        "{notes}"
    );
    assert!(notes.contains("detached HEAD"), "{notes}");
    assert!(
        notes.contains("submodules are not cloned into the sandbox (vendor/sub)"),
        "{notes}"
    );
    env.ok(&["start", "odd"]);
    assert_eq!(
        env.ok(&["exec", "odd", "--", "git", "rev-parse", "HEAD"]),
        head
    );
    assert_eq!(env.ok(&["exec", "odd", "--", "cat", "asset.bin"]), pointer);
    assert_eq!(
        env.ok(&["exec", "odd", "--", "cat", "README.md"]),
        "# odd\n"
    );
}

#[test]
fn empty_repository_works() {
    let env = Env::new();
    let repo = env.tmp.path().join("empty");
    fs::create_dir(&repo).unwrap();
    git(&repo, &["init", "-q", "-b", "main"]);
    create(&env, &repo, "empty");
    env.ok(&["start", "empty"]);
    assert_eq!(env.ctl(&["sync", "empty"]).status.code(), Some(2));
    env.ok(&[
        "exec",
        "empty",
        "--",
        "sh",
        "-c",
        "git -c user.name=A -c user.email=a@example.com commit -q --allow-empty -m first",
    ]);
    env.ok(&["sync", "empty"]);
    assert_eq!(
        git(&repo, &["log", "--format=%s", "sandbox/empty/main"]),
        "first\n"
    );
}

#[test]
fn host_branch_deleted_while_the_sandbox_works_on_it() {
    let env = Env::new();
    let repo = env.repo("del");
    git(&repo, &["branch", "topic"]);
    create(&env, &repo, "del");
    env.ok(&["start", "del"]);
    env.ok(&["exec", "del", "--", "sh", "-c",
        "git switch -q topic && echo w > w.txt && git add w.txt && git -c user.name=A -c user.email=a@example.com commit -qm work"]);
    git(&repo, &["branch", "-D", "topic"]);
    let out = env.ok(&["sync", "del", "--from-host"]);
    assert!(out.contains("topic  removed"), "{out}");
    // The sandbox's own branch and work are untouched...
    assert_eq!(
        env.ok(&[
            "exec",
            "del",
            "--",
            "git",
            "log",
            "-1",
            "--format=%s",
            "topic"
        ]),
        "work\n"
    );
    // ...and still come back to the host.
    env.ok(&["sync", "del"]);
    assert_eq!(
        git(&repo, &["log", "-1", "--format=%s", "sandbox/del/topic"]),
        "work\n"
    );
}

#[test]
fn a_new_sandbox_never_adopts_what_an_earlier_one_left() {
    let env = Env::new();
    // What a destroy that could not finish would leave: a workspace of
    // someone else's files.
    let left = env.state_dir.join("sandboxes/ghost/workspace");
    std::fs::create_dir_all(left.join(".git")).unwrap();
    std::fs::write(left.join("planted.txt"), "from an earlier sandbox").unwrap();
    let repo = env.repo("ghost");
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", "ghost"]);
    let out = env.ok(&[
        "exec",
        "ghost",
        "--",
        "sh",
        "-c",
        "ls -A /workspace; git log --format=%s",
    ]);
    assert!(!out.contains("planted.txt"), "{out}");
    assert!(out.contains("README.md") && out.contains("first"), "{out}");
}

/// `git config -f FILE KEY` of a sandbox's workspace on the host, or
/// `None` when it is not set.
fn ws_config(env: &Env, name: &str, key: &str) -> Option<String> {
    let file = env
        .state_dir
        .join("sandboxes")
        .join(name)
        .join("workspace/.git/config");
    assert!(file.is_file(), "{}", file.display());
    let out = std::process::Command::new("git")
        .arg("config")
        .arg("-f")
        .arg(&file)
        .arg(key)
        .output()
        .unwrap();
    out.status
        .success()
        .then(|| String::from_utf8(out.stdout).unwrap().trim().to_owned())
}

/// A new sandbox commits as its owner: `user.name` and `user.email` from
/// the project's git configuration, else from the owner's own, written into
/// the workspace's; `--git-identity` gives another or none, and an identity
/// that could break the configuration is refused.
#[test]
fn a_new_sandbox_commits_as_its_owner_unless_told_otherwise() {
    let mut env = Env::bus_only();
    let home = env.tmp.path().join("home");
    fs::create_dir_all(home.join(".config/git")).unwrap();
    fs::write(
        home.join(".gitconfig"),
        "[user]\n\tname = Home Person\n\temail = home@example.com\n[include]\n\tpath = elsewhere\n",
    )
    .unwrap();
    env.agentd_env
        .push(("HOME".into(), Some(home.display().to_string())));
    env.start_agentd();
    let create = |args: &[&str]| {
        let out = env.ctl(&[&["create"][..], args].concat());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stderr).unwrap()
    };

    // The owner's: the first commit inside just works.
    let repo = env.repo("idown");
    let notes = create(&[repo.to_str().unwrap()]);
    env.ok(&["start", "idown"]);
    env.ok(&[
        "exec",
        "idown",
        "--",
        "git",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "first",
    ]);
    assert_eq!(
        env.ok(&[
            "exec",
            "idown",
            "--",
            "git",
            "log",
            "-1",
            "--format=%an <%ae>|%cn <%ce>"
        ])
        .trim(),
        "Home Person <home@example.com>|Home Person <home@example.com>"
    );
    assert!(
        notes.contains("commits in the sandbox are by Home Person <home@example.com>"),
        "{notes}"
    );

    // The project's own configuration comes first, key by key.
    let repo = env.repo("idproj");
    git(&repo, &["config", "user.email", "project@example.com"]);
    let notes = create(&[repo.to_str().unwrap()]);
    assert!(
        notes.contains("Home Person <project@example.com>"),
        "{notes}"
    );
    assert_eq!(
        ws_config(&env, "idproj", "user.name").as_deref(),
        Some("Home Person")
    );
    assert_eq!(
        ws_config(&env, "idproj", "user.email").as_deref(),
        Some("project@example.com")
    );

    // Given, or none.
    let repo = env.repo("idgiven");
    create(&[
        "--git-identity",
        "Ada Lovelace <ada@example.com>",
        repo.to_str().unwrap(),
    ]);
    assert_eq!(
        ws_config(&env, "idgiven", "user.name").as_deref(),
        Some("Ada Lovelace")
    );
    assert_eq!(
        ws_config(&env, "idgiven", "user.email").as_deref(),
        Some("ada@example.com")
    );
    let repo = env.repo("idnone");
    let notes = create(&["--git-identity", "none", repo.to_str().unwrap()]);
    assert!(!notes.contains("commits in the sandbox are by"), "{notes}");
    assert_eq!(ws_config(&env, "idnone", "user.name"), None);
    assert_eq!(ws_config(&env, "idnone", "user.email"), None);

    // Nothing to be found: said, with what to do.
    fs::remove_file(home.join(".gitconfig")).unwrap();
    let repo = env.repo("idlost");
    let notes = create(&[repo.to_str().unwrap()]);
    assert!(notes.contains("no git identity found"), "{notes}");
    assert!(notes.contains("--git-identity"), "{notes}");
    assert_eq!(ws_config(&env, "idlost", "user.name"), None);

    // Refused before anything is made: by agentctl, and by agentd.
    let repo = env.repo("idbad");
    let err = env.fails(
        4,
        &[
            "create",
            "--git-identity",
            "Ada\n[core]\n\thooksPath = /tmp <a@b>",
            repo.to_str().unwrap(),
        ],
    );
    assert!(err.contains("Your Name <you@example.com>"), "{err}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let conn = rt.block_on(async {
        zbus::connection::Builder::address(env.address.as_str())
            .unwrap()
            .build()
            .await
            .unwrap()
    });
    let m = rt
        .block_on(keystone_agent_api::ManagerProxy::new(&conn))
        .unwrap();
    for bad in [
        "Ada\n[core]\n\thooksPath = /tmp <a@b>",
        "Ada",
        "Ada <a b@c>",
    ] {
        rt.block_on(async {
            let opts = keystone_agent_api::options::CreateOptions {
                name: Some("idbad".into()),
                ..Default::default()
            };
            let mut dict = opts.to_dict();
            dict.insert("git_identity", zvariant::Value::from(bad));
            match m.create_sandbox(repo.to_str().unwrap(), dict).await {
                Err(keystone_agent_api::Error::InvalidArgument(msg)) => {
                    assert!(msg.contains("git identity") && !msg.contains('\n'), "{msg}");
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        });
    }
    assert!(
        env.list().iter().all(|s| s["name"] != "idbad"),
        "{:?}",
        env.list()
    );
    assert!(!env.state_dir.join("sandboxes/idbad").exists());
}

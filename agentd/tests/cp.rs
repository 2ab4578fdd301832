//! `agentctl cp`: round trips keep bytes and modes; copying out never lets
//! the sandbox write outside the destination.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;

use common::Env;

#[test]
fn round_trip_of_binary_data_and_a_tree_keeps_bytes_and_modes() {
    let env = Env::running("cpr", &[]);
    let src = env.tmp.path().join("tree");
    fs::create_dir_all(src.join("sub/deeper")).unwrap();
    let data: Vec<u8> = (0..(1 << 20))
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    fs::write(src.join("blob.bin"), &data).unwrap();
    fs::write(src.join("sub/run.sh"), "#!/bin/sh\necho ran\n").unwrap();
    fs::set_permissions(src.join("sub/run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::write(src.join("sub/deeper/secret"), "s\n").unwrap();
    fs::set_permissions(
        src.join("sub/deeper/secret"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();

    // Into an existing directory: lands inside it.
    env.ok(&["cp", src.to_str().unwrap(), "cpr:/workspace"]);
    assert_eq!(
        env.ok(&["exec", "cpr", "--", "/workspace/tree/sub/run.sh"]),
        "ran\n"
    );
    assert_eq!(
        env.ok(&[
            "exec",
            "cpr",
            "--",
            "stat",
            "-c",
            "%a",
            "/workspace/tree/sub/deeper/secret"
        ]),
        "600\n"
    );
    // To a new name: renamed.
    env.ok(&[
        "cp",
        src.join("blob.bin").to_str().unwrap(),
        "cpr:/tmp/copy.bin",
    ]);
    let inside = env.ok(&["exec", "cpr", "--", "sha256sum", "/tmp/copy.bin"]);
    let host = std::process::Command::new("sha256sum")
        .arg(src.join("blob.bin"))
        .output()
        .unwrap();
    assert_eq!(
        inside.split_whitespace().next(),
        String::from_utf8_lossy(&host.stdout)
            .split_whitespace()
            .next()
    );

    // And back out.
    let back = env.tmp.path().join("back");
    env.ok(&["cp", "cpr:/workspace/tree", back.to_str().unwrap()]);
    assert_eq!(fs::read(back.join("blob.bin")).unwrap(), data);
    assert_eq!(
        fs::metadata(back.join("sub/run.sh"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o755
    );
    assert_eq!(
        fs::metadata(back.join("sub/deeper/secret"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    let into = env.tmp.path().join("into");
    fs::create_dir(&into).unwrap();
    env.ok(&["cp", "cpr:/tmp/copy.bin", into.to_str().unwrap()]);
    assert_eq!(fs::read(into.join("copy.bin")).unwrap(), data);

    let h: Vec<serde_json::Value> =
        serde_json::from_str(&env.ok(&["history", "cpr", "--json"])).unwrap();
    assert!(
        h.iter()
            .any(|e| e["kind"] == "cp"
                && e["detail"].as_str().unwrap().contains("-> cpr:/workspace")),
        "{h:?}"
    );
    // Bad requests.
    env.fails(4, &["cp", "a", "b"]);
    env.fails(1, &["cp", "/no/such/file", "cpr:/tmp"]);
    env.fails(
        3,
        &[
            "cp",
            "cpr:/no/such/file",
            env.tmp.path().join("x").to_str().unwrap(),
        ],
    );
}

/// `agentctl cp …` that must be refused: exit 3, the refused entry named,
/// and the destination as it was.
fn refused(env: &Env, args: &[&str], entry: &str) {
    let r = env.ctl(args);
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(3), "{args:?}: {err}");
    assert!(
        err.contains(entry) && err.contains("nothing was copied"),
        "{args:?}: {err}"
    );
}

#[test]
fn copying_out_gives_the_sandbox_no_write_on_the_host() {
    use std::os::unix::fs::MetadataExt;
    let env = Env::running("cpx", &[]);
    let t = env.tmp.path();
    let victim = t.join("victim");
    fs::create_dir(&victim).unwrap();
    let sh = |script: &str| env.ok(&["exec", "cpx", "--", "sh", "-c", script]);
    sh(&format!(
        "mkdir -p /workspace/d/sub && echo x > /workspace/d/f && echo y > /workspace/d/sub/g \
         && ln -s {v} /workspace/d/out && ln -s {v}/shadow /workspace/copied.md \
         && cp /bin/true /workspace/suid && chmod 6755 /workspace/suid && mkfifo /workspace/p",
        v = victim.display()
    ));

    // Links are refused unless asked for, and then only inside the copy.
    let out = t.join("out");
    refused(
        &env,
        &["cp", "cpx:/workspace/d", out.to_str().unwrap()],
        "d/out",
    );
    refused(
        &env,
        &["cp", "--links", "cpx:/workspace/d", out.to_str().unwrap()],
        "outside the copy",
    );
    assert!(!out.exists(), "a refused copy leaves nothing behind");
    // A link as the copied file itself, to a file name on the host.
    refused(
        &env,
        &[
            "cp",
            "cpx:/workspace/copied.md",
            t.join("copied.md").to_str().unwrap(),
        ],
        "copied.md",
    );
    assert!(fs::symlink_metadata(t.join("copied.md")).is_err());
    refused(
        &env,
        &["cp", "cpx:/workspace/p", t.join("p").to_str().unwrap()],
        "fifo",
    );
    // A name that carries a terminal escape (OSC 52: write the clipboard)
    // reaches the person's terminal escaped.
    sh("mkdir /workspace/e && mkfifo \"/workspace/e/$(printf 'x\\033]52;c;cHduZWQ=\\007')\"");
    let r = env.ctl(&["cp", "cpx:/workspace/e", t.join("e").to_str().unwrap()]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(3), "{err}");
    assert!(
        !err.contains('\u{1b}') && !err.contains('\u{7}'),
        "raw escape: {err:?}"
    );
    assert!(err.contains("\\u{1b}]52"), "{err}");
    sh("rm /workspace/d/out && ln -s sub/g /workspace/d/in");
    env.ok(&["cp", "--links", "cpx:/workspace/d", out.to_str().unwrap()]);
    assert_eq!(
        fs::read_link(out.join("in")).unwrap(),
        std::path::Path::new("sub/g")
    );
    assert_eq!(fs::read_to_string(out.join("sub/g")).unwrap(), "y\n");

    // No setuid or setgid bit survives; the file is the caller's.
    env.ok(&[
        "cp",
        "cpx:/workspace/suid",
        t.join("suid").to_str().unwrap(),
    ]);
    let m = fs::metadata(t.join("suid")).unwrap();
    assert_eq!(m.mode() & 0o7777, 0o755);
    assert_eq!(m.uid(), nix::unistd::Uid::effective().as_raw());

    // A symlink already in the destination is neither followed nor replaced.
    let dest = t.join("dest");
    fs::create_dir_all(dest.join("d")).unwrap();
    std::os::unix::fs::symlink(victim.join("f"), dest.join("d/f")).unwrap();
    refused(
        &env,
        &["cp", "cpx:/workspace/d", dest.to_str().unwrap()],
        "symbolic link",
    );
    assert!(
        fs::read_dir(&victim).unwrap().next().is_none(),
        "written through a link"
    );
    assert!(
        fs::symlink_metadata(dest.join("d/f"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(
        !dest.join("d/sub").exists(),
        "a refused copy changed the destination"
    );
}

#[test]
fn a_tar_planted_in_the_sandbox_is_never_what_a_copy_runs() {
    let env = Env::running("cpt", &[]);
    let repo = env.tmp.path().join("cpt");
    // The sandbox puts a `tar` of its own in every directory it can write
    // that could come first on PATH, one that sends a git hook.
    let fake = r#"#!/bin/sh
printf '#!/bin/sh\necho pwned\n' > /tmp/hook && chmod 755 /tmp/hook
mkdir -p /tmp/t/.git/hooks && cp /tmp/hook /tmp/t/.git/hooks/post-checkout
exec /usr/bin/tar -c -C /tmp/t .git
"#;
    let plant = format!(
        "for d in /run/current-system/sw/bin /run/keystone/bin /root/bin /tmp/bin; do \
           mkdir -p $d 2>/dev/null && cat > $d/tar <<'EOF'\n{fake}EOF\nchmod +x $d/tar 2>/dev/null; done; true"
    );
    env.ok(&["exec", "cpt", "--", "sh", "-c", &plant]);
    let path = env.ok(&["exec", "cpt", "--", "sh", "-c", "echo $PATH"]);
    // The only directory under /run on PATH is agentd's read-only tools
    // (the agents' launchers), where the plant failed.
    let without_tools = path.replace("/run/keystone/bin:", "");
    assert!(
        !without_tools.contains("/run") && !path.contains("/tmp") && !path.contains("/root"),
        "{path}"
    );
    let planted = env.ok(&["exec", "cpt", "--", "sh", "-c", "ls /run/keystone/bin"]);
    assert!(!planted.contains("tar"), "{planted}");
    env.ok(&["cp", "cpt:/workspace/README.md", repo.to_str().unwrap()]);
    assert!(!repo.join(".git/hooks/post-checkout").exists());
    assert!(repo.join("README.md").is_file());
}

fn kinds(env: &Env, args: &[&str]) -> Vec<(String, String)> {
    let h: Vec<serde_json::Value> = serde_json::from_str(&env.ok(args)).unwrap();
    h.iter()
        .map(|e| {
            (
                e["kind"].as_str().unwrap().to_owned(),
                e["detail"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// `agentctl history` shows the person's commands: a copy is one `cp`
/// entry, and the check cp makes of its destination is left out (kept, as
/// `cp-check`, for `--all`); nobody can record another command as a copy
/// or a check to keep it out of sight.
#[test]
fn the_history_shows_a_copy_as_one_entry_and_hides_nothing_else() {
    let env = Env::running("cph", &[]);
    let file = env.tmp.path().join("notes.txt");
    fs::write(&file, "n\n").unwrap();
    env.ok(&["exec", "cph", "--", "echo", "one"]);
    env.ok(&["cp", file.to_str().unwrap(), "cph:/workspace/"]);

    let shown = kinds(&env, &["history", "cph", "--json"]);
    assert!(shown.iter().all(|(k, _)| k != "cp-check"), "{shown:?}");
    assert!(
        shown.iter().all(|(_, d)| !d.contains("test -d")),
        "{shown:?}"
    );
    assert_eq!(
        shown.last().unwrap(),
        &(
            "cp".to_owned(),
            format!("{} -> cph:/workspace/notes.txt", file.display())
        )
    );
    // The last two of the person's: the echo and the copy.
    let two = kinds(&env, &["history", "cph", "--json", "-n", "2"]);
    assert_eq!(two.len(), 2, "{two:?}");
    assert_eq!(two[0], ("exec".to_owned(), "echo one".to_owned()));
    assert_eq!(two[1].0, "cp");
    let table = env.ok(&["history", "cph"]);
    assert!(!table.contains("test -d"), "{table}");
    // Everything, for an audit.
    let all = kinds(&env, &["history", "cph", "--json", "--all"]);
    assert!(
        all.contains(&("cp-check".to_owned(), "test -d /workspace/".to_owned())),
        "{all:?}"
    );

    // Another command under cp's names is refused, and does not run.
    let marker = "/workspace/hidden";
    let attempts: [(&[&str], &str); 4] = [
        (&["touch", marker], "cp ./x -> cph:/workspace"),
        (&["sh", "-c", "touch /workspace/hidden"], "cp-check"),
        (
            &["tar", "-x", "-p", "--no-same-owner", "-C", "/etc"],
            "cp ./x -> cph:/workspace",
        ),
        (&["test", "-d", "/workspace", "-o", "x"], "cp-check"),
    ];
    let devnull = fs::File::open("/dev/null").unwrap();
    for (argv, record) in attempts {
        env.with_sandbox("cph", async |sb| {
            use std::os::fd::AsFd;
            let opts = keystone_agent_api::options::ExecOptions {
                record_as: Some(record.to_owned()),
                ..Default::default()
            };
            let fd = || zvariant::Fd::from(devnull.as_fd());
            let r = sb
                .exec_stdio(argv, Default::default(), opts.to_dict(), fd(), fd(), fd())
                .await;
            match r {
                Err(keystone_agent_api::Error::InvalidArgument(m)) => {
                    assert!(m.contains("only for the commands of `agentctl cp`"), "{m}");
                }
                other => panic!("{argv:?} as {record}: {other:?}"),
            }
        });
    }
    let all_after = kinds(&env, &["history", "cph", "--json", "--all", "-n", "0"]);
    assert_eq!(all_after.len(), all.len(), "{all_after:?}");
    let (code, _) = env.inside("cph", &format!("test -e {marker}"));
    assert_ne!(code, 0, "a refused command ran");
}

/// A copy's history entry says where the copy went: a description that
/// only mentions the directory the tar command writes to, while claiming
/// another path, is refused and nothing runs; and what a command line
/// holds (a newline) cannot add a line of its own to `agentctl history`.
#[test]
fn a_copy_cannot_claim_another_path_nor_a_command_forge_a_history_line() {
    let env = Env::running("cpc", &[]);
    let archive = env.tmp.path().join("a.tar");
    {
        let mut b = tar::Builder::new(fs::File::create(&archive).unwrap());
        let mut h = tar::Header::new_gnu();
        h.set_size(2);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, "planted", &b"p\n"[..]).unwrap();
        b.finish().unwrap();
    }
    let before = kinds(&env, &["history", "cpc", "--json", "--all", "-n", "0"]);
    let into = ["tar", "-x", "-p", "--no-same-owner", "-C", "/workspace"];
    for record in [
        "cp ./notes.txt -> cpc:/tmp/notes.txt (:/workspace)",
        "cp ./notes.txt -> cpc:/tmp/notes.txt cpc:/workspace",
        "cp ./planted -> other:/workspace/planted",
    ] {
        let input = fs::File::open(&archive).unwrap();
        env.with_sandbox("cpc", async |sb| {
            use std::os::fd::AsFd;
            let opts = keystone_agent_api::options::ExecOptions {
                record_as: Some(record.to_owned()),
                ..Default::default()
            };
            let devnull = fs::File::create("/dev/null").unwrap();
            let r = sb
                .exec_stdio(
                    &into,
                    Default::default(),
                    opts.to_dict(),
                    zvariant::Fd::from(input.as_fd()),
                    zvariant::Fd::from(devnull.as_fd()),
                    zvariant::Fd::from(devnull.as_fd()),
                )
                .await;
            match r {
                Err(keystone_agent_api::Error::InvalidArgument(m)) => {
                    assert!(m.contains("cpc:DIR/NAME"), "{m}");
                }
                other => panic!("{record}: {other:?}"),
            }
        });
    }
    let after = kinds(&env, &["history", "cpc", "--json", "--all", "-n", "0"]);
    assert_eq!(after.len(), before.len(), "{after:?}");
    let (code, _) = env.inside("cpc", "test -e /workspace/planted");
    assert_ne!(code, 0, "a refused copy ran");

    let forged = "2000-01-01T00:00:00Z  0    cp    0     0.0s  ./harmless -> cpc:/tmp/harmless";
    env.ok(&["exec", "cpc", "--", "echo", &format!("x\n{forged}")]);
    let table = env.ok(&["history", "cpc"]);
    assert!(
        table.lines().all(|l| !l.starts_with("2000-01-01")),
        "{table}"
    );
    assert!(table.contains("echo 'x\\n2000-01-01"), "{table}");
}

//! `agentctl cp`: round trips keep bytes and modes; copying out never lets
//! the sandbox write outside the destination.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;

use common::Env;

fn running(name: &str) -> Env {
    let env = Env::new();
    let repo = env.repo(name);
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", name]);
    env
}

#[test]
fn round_trip_of_binary_data_and_a_tree_keeps_bytes_and_modes() {
    let env = running("cpr");
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

#[test]
fn copying_out_never_follows_what_the_sandbox_planted() {
    let env = running("cpx");
    let victim = env.tmp.path().join("victim");
    fs::create_dir(&victim).unwrap();
    // A symlink in the copied tree stays a symlink on the host.
    env.ok(&[
        "exec",
        "cpx",
        "--",
        "sh",
        "-c",
        &format!(
            "mkdir -p /workspace/d && ln -s {} /workspace/d/link && echo x > /workspace/d/f",
            victim.display()
        ),
    ]);
    let out = env.tmp.path().join("out");
    env.ok(&["cp", "cpx:/workspace/d", out.to_str().unwrap()]);
    assert!(
        fs::symlink_metadata(out.join("link"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(fs::read_dir(&victim).unwrap().next().is_none());

    // A sandbox that fakes `tar` to send `x/link -> victim` then `x/link/pwned`.
    let fake = format!(
        r#"mkdir -p /run/current-system/sw/bin && cat > /run/current-system/sw/bin/tar <<'PYEOF'
#!/usr/bin/env python3
import io, sys, tarfile
t = tarfile.open(fileobj=sys.stdout.buffer, mode="w|")
l = tarfile.TarInfo("x/link"); l.type = tarfile.SYMTYPE; l.linkname = "{}"; t.addfile(l)
data = b"pwned\n"; f = tarfile.TarInfo("x/link/pwned"); f.size = len(data); t.addfile(f, io.BytesIO(data))
e = tarfile.TarInfo("../escaped"); e.size = len(data); t.addfile(e, io.BytesIO(data))
t.close()
PYEOF
chmod +x /run/current-system/sw/bin/tar"#,
        victim.display()
    );
    let planted = env.ctl(&["exec", "cpx", "--", "sh", "-c", &fake]);
    if planted.status.success() {
        let out2 = env.tmp.path().join("out2");
        let r = env.ctl(&["cp", "cpx:/workspace/x", out2.to_str().unwrap()]);
        assert_eq!(
            r.status.code(),
            Some(3),
            "{}",
            String::from_utf8_lossy(&r.stderr)
        );
        assert!(
            String::from_utf8_lossy(&r.stderr).contains("unpacking"),
            "{}",
            String::from_utf8_lossy(&r.stderr)
        );
        assert!(
            fs::read_dir(&victim).unwrap().next().is_none(),
            "the sandbox wrote through its symlink"
        );
        assert!(!env.tmp.path().join("escaped").exists());
        assert!(!out2.exists(), "a refused copy leaves nothing behind");
    } else {
        eprintln!("skipped the fake-tar part: /run/current-system is read-only here");
    }
}

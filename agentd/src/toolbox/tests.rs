//! Unit tests of the toolbox: packages, launchers and settings, and what a
//! hostile registry or package could try.

use super::fetch::*;
use super::unpack::*;
use super::*;

#[test]
fn packages_and_launchers_follow_the_versions() {
    let v = Versions::default();
    let claude = packages(Agent::Claude, &v);
    assert_eq!(claude[0].dir, format!("claude-{}", v.claude));
    assert!(
        claude[0]
            .name
            .starts_with("@anthropic-ai/claude-code-linux-")
    );
    let codex = packages(Agent::Codex, &v);
    assert_eq!(codex[0].name, "@openai/codex");
    assert!(codex[0].version.starts_with(&format!("{}-linux-", v.codex)));
    let gemini = packages(Agent::Gemini, &v);
    assert_eq!(gemini.len(), 2, "Gemini CLI and Node");
    let l = launcher(Agent::Gemini, &v);
    assert!(
        l.contains(&format!("/run/keystone/agents/node-{}/bin/node", v.node))
            && l.contains(&format!(
                "/run/keystone/agents/gemini-{}/bundle/gemini.js",
                v.gemini
            )),
        "{l}"
    );
    let l = launcher(Agent::Claude, &v);
    assert!(
        l.contains(&format!(
            "[ -x /run/keystone/agents/claude-{}/claude ] ||",
            v.claude
        )) && l.contains("not installed yet")
            && l.contains("exit 127"),
        "{l}"
    );
}

#[test]
fn bad_settings_are_named() {
    let mut c = ToolboxConfig::default();
    assert!(c.problems().is_empty());
    c.versions.claude = "../../etc".into();
    c.versions.node = String::new();
    c.registry = "http://registry.example.org".into();
    c.cache_dir = Some("relative".into());
    let p = c.problems();
    assert_eq!(p.len(), 4, "{p:#?}");
    assert!(
        p[0].starts_with("toolbox.versions.claude: '../../etc'"),
        "{p:#?}"
    );
    c.registry = "http://127.0.0.1:4873".into();
    assert_eq!(c.problems().len(), 3);
}

#[test]
fn a_tarball_from_elsewhere_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let meta = dir.path().join("m.json");
    fs::write(
        &meta,
        r#"{"dist":{"tarball":"https://evil.example.com/x.tgz","integrity":"sha512-AAAA"}}"#,
    )
    .unwrap();
    let err = read_metadata(&meta, "x@1", "https://registry.npmjs.org")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("is not on https://registry.npmjs.org"),
        "{err}"
    );
    fs::write(
        &meta,
        r#"{"dist":{"tarball":"https://registry.npmjs.org/x/-/x-1.tgz","integrity":"sha1-AAAA"}}"#,
    )
    .unwrap();
    let err = read_metadata(&meta, "x@1", "https://registry.npmjs.org")
        .unwrap_err()
        .to_string();
    assert!(err.contains("has no sha512"), "{err}");
}

#[test]
fn a_package_that_unpacks_too_large_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("zeros");
    fs::write(&raw, vec![0u8; 3 << 20]).unwrap();
    let ok = Command::new("gzip").arg("-k").arg(&raw).status().unwrap();
    assert!(ok.success());
    let tgz = dir.path().join("zeros.gz");
    assert!(fs::metadata(&tgz).unwrap().len() < 64 << 10, "a small file");
    let err = unpacked_size(&tgz, 1 << 20).unwrap_err();
    assert!(matches!(err, UnpackError::TooLarge { .. }), "{err:?}");
    assert!(err.to_string().contains("more than 1 MiB"), "{err}");
    assert_eq!(unpacked_size(&tgz, 4 << 20).unwrap(), 3 << 20);
    fs::write(&tgz, b"not gzip").unwrap();
    let err = unpacked_size(&tgz, 1 << 20).unwrap_err();
    assert!(matches!(err, UnpackError::NotGzip { .. }), "{err:?}");
}

#[test]
fn normalize_keeps_files_and_drops_links() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    fs::create_dir(p.join("bin")).unwrap();
    fs::write(p.join("bin/tool"), "x").unwrap();
    fs::set_permissions(p.join("bin/tool"), fs::Permissions::from_mode(0o700)).unwrap();
    fs::write(p.join("README"), "x").unwrap();
    fs::set_permissions(p.join("README"), fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink("/etc/shadow", p.join("link")).unwrap();
    normalize(p).unwrap();
    let mode = |f: &str| fs::metadata(p.join(f)).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode("bin/tool"), 0o755);
    assert_eq!(mode("README"), 0o644);
    assert_eq!(mode("bin"), 0o755);
    assert!(fs::symlink_metadata(p.join("link")).is_err());
}

mod attacks {
    use super::*;

    #[test]
    fn settings_that_would_inject_into_urls_paths_or_launchers_are_refused() {
        for version in [
            "1.0.0$(id)",
            "1.0.0`id`",
            "1.0.0\"; id; \"",
            "1.0.0'",
            "1.0.0\nexec sh",
            "1.0.0 x",
            "1.0.0;id",
            "1.0.0/../../x",
            "../1.0.0",
            "..",
            "1.0.0%2f..",
            "1.0.0?x",
            "1.0.0#x",
            "1.0.0\\x",
            "1.0.0*",
            "-1.0.0",
            "",
            &"9".repeat(65),
        ] {
            let mut c = ToolboxConfig::default();
            c.versions.codex = version.to_owned();
            assert_eq!(c.problems().len(), 1, "{version:?} is accepted");
        }
        // What passes is plain in the launcher: no quote, no expansion.
        let v = Versions {
            claude: "1.0.0-rc.1+build.5".into(),
            ..Versions::default()
        };
        let l = launcher(Agent::Claude, &v);
        assert_eq!(
            l.lines().last().unwrap(),
            "exec /run/keystone/agents/claude-1.0.0-rc.1+build.5/claude \"$@\""
        );
        for registry in [
            // Plain HTTP to a name that merely starts like loopback.
            "http://127.0.0.1.example.com",
            "http://127.0.0.1.nip.io:4873",
            "http://127.0.0.10",
            "http://[::1].example.com",
            "http://127.0.0.1:4873.example.com",
            "http://127.0.0.1:",
            "http://localhost:4873",
            "https://registry.npmjs.org/",
            "https://user@registry.npmjs.org",
            "https://registry.npmjs.org/$(id)",
            "https://registry.npmjs.org/ x",
            "https://registry.npmjs.org\n",
            "https://registry.npmjs.org?x",
            "https://registry.npmjs.org#x",
            "ftp://registry.npmjs.org",
            "file:///etc",
            "https://",
        ] {
            assert!(
                !registry_allowed(registry),
                "{registry:?} is accepted as a registry"
            );
        }
        for registry in [
            "https://registry.npmjs.org",
            "https://npm.example.com:8443/api/npm",
            "http://127.0.0.1",
            "http://127.0.0.1:4873",
            "http://127.0.0.1:4873/npm",
            "http://[::1]:4873",
            "http://[::1]/npm",
        ] {
            assert!(registry_allowed(registry), "{registry:?} is refused");
        }
        let c = ToolboxConfig {
            cache_dir: Some("cache/../agents".into()),
            ..ToolboxConfig::default()
        };
        assert_eq!(c.problems().len(), 1);
    }

    #[test]
    fn tarballs_off_the_registry_and_unusable_integrity_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let meta = dir.path().join("m.json");
        let registry = "https://registry.npmjs.org";
        for tarball in [
            "https://registry.npmjs.org@evil.example.com/x.tgz",
            "https://registry.npmjs.org.evil.example.com/x.tgz",
            "https://registry.npmjs.org:8443/x.tgz",
            "https://registry.npmjs.org\\@evil.example.com/x.tgz",
            "https://registry.npmjs.org#@evil.example.com/x.tgz",
            "http://registry.npmjs.org/x.tgz",
            "HTTPS://evil.example.com/x.tgz",
            "//evil.example.com/x.tgz",
            "/x.tgz",
            "file:///etc/passwd",
        ] {
            let doc = serde_json::json!({"dist": {"tarball": tarball, "integrity": "sha512-AAAA"}});
            fs::write(&meta, doc.to_string()).unwrap();
            assert!(
                read_metadata(&meta, "x@1", registry).is_err(),
                "{tarball} is accepted"
            );
        }
        // Several hashes: the first sha512 is the one that must match (a
        // second, right one does not rescue a wrong first one).
        let doc = serde_json::json!({"dist": {
            "tarball": "https://registry.npmjs.org/x/-/x-1.tgz",
            "integrity": "sha1-AAAA sha512-FIRST sha512-SECOND",
        }});
        fs::write(&meta, doc.to_string()).unwrap();
        assert_eq!(read_metadata(&meta, "x@1", registry).unwrap().1, "FIRST");
        for bad in [
            serde_json::json!({"dist": {"tarball": "https://registry.npmjs.org/x.tgz"}}),
            serde_json::json!({"dist": {"tarball": "https://registry.npmjs.org/x.tgz", "integrity": 5}}),
            serde_json::json!({"dist": {"tarball": ["https://registry.npmjs.org/x.tgz"], "integrity": "sha512-A"}}),
            serde_json::json!([]),
        ] {
            fs::write(&meta, bad.to_string()).unwrap();
            assert!(read_metadata(&meta, "x@1", registry).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_download_is_cut_off_at_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let to = dir.path().join("out");
        let endless = std::io::repeat(b'x');
        assert!(matches!(
            copy_at_most(endless, &to, 1 << 20),
            Err(CopyError::TooLarge)
        ));
        assert!(fs::metadata(&to).unwrap().len() <= 1 << 20);
        copy_at_most(&b"just enough"[..], &to, 11).ok().unwrap();
        assert_eq!(fs::read(&to).unwrap(), b"just enough");
    }

    /// A gzipped tarball of `names` (directories end in `/`), made by tar.
    fn tarball(dir: &Path, names: &[String]) -> PathBuf {
        let root = dir.join("root");
        for n in names {
            let p = root.join(n);
            if n.ends_with('/') {
                fs::create_dir_all(&p).unwrap();
            } else {
                fs::create_dir_all(p.parent().unwrap()).unwrap();
                fs::write(&p, "").unwrap();
            }
        }
        let tgz = dir.join("t.tgz");
        let ok = Command::new("tar")
            .arg("-czf")
            .arg(&tgz)
            .arg("-C")
            .arg(&root)
            .arg("--no-recursion")
            .args(names)
            .status()
            .unwrap();
        assert!(ok.success());
        tgz
    }

    #[test]
    fn packages_of_too_many_too_deep_or_too_long_members_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let names: Vec<String> = ["package/", "package/a", "package/b/", "package/b/c"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let tgz = tarball(dir.path(), &names);
        assert_eq!(check_members(&tgz, 4, 3, 100).unwrap(), 4);
        let refused = |entries, depth, name| {
            let e = check_members(&tgz, entries, depth, name).unwrap_err();
            (e.to_string(), e)
        };
        let (msg, e) = refused(3, 3, 100);
        assert!(matches!(e, UnpackError::TooManyEntries { max: 3 }), "{msg}");
        assert!(msg.contains("more than 3 entries"), "{msg}");
        let (msg, e) = refused(4, 2, 100);
        assert!(matches!(e, UnpackError::TooDeep { max: 2 }), "{msg}");
        let (msg, e) = refused(4, 3, 10);
        assert!(matches!(e, UnpackError::NameTooLong { max: 10 }), "{msg}");
        // A newline in a name does not split it into two short ones.
        let dir = tempfile::tempdir().unwrap();
        let tgz = tarball(dir.path(), &["package/a\nb".to_owned()]);
        assert_eq!(check_members(&tgz, 1, 3, 100).unwrap(), 1);
        fs::write(&tgz, b"not a tarball").unwrap();
        let err = check_members(&tgz, 4, 3, 100).unwrap_err();
        assert!(matches!(err, UnpackError::NotTar { .. }), "{err:?}");
    }

    #[test]
    fn removing_an_unfinished_install_follows_no_link_and_enters_locked_directories() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("keep"), "host").unwrap();
        fs::set_permissions(&outside, fs::Permissions::from_mode(0o555)).unwrap();
        let work = dir.path().join(".install-x");
        fs::create_dir_all(work.join("package/locked/inner")).unwrap();
        fs::write(work.join("package/locked/inner/f"), "x").unwrap();
        std::os::unix::fs::symlink(&outside, work.join("package/to-dir")).unwrap();
        std::os::unix::fs::symlink(outside.join("keep"), work.join("package/to-file")).unwrap();
        fs::set_permissions(
            work.join("package/locked/inner"),
            fs::Permissions::from_mode(0o000),
        )
        .unwrap();
        fs::set_permissions(
            work.join("package/locked"),
            fs::Permissions::from_mode(0o000),
        )
        .unwrap();
        remove_tree(&work).unwrap();
        assert!(!work.exists());
        assert_eq!(fs::read_to_string(outside.join("keep")).unwrap(), "host");
        let mode = fs::metadata(&outside).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o555, "the link's target was changed");
        remove_tree(&work).unwrap();
    }

    #[test]
    fn the_lock_file_is_write_only() {
        let dir = tempfile::tempdir().unwrap();
        let c = ToolboxConfig {
            agents: Vec::new(),
            cache_dir: Some(dir.path().join("agents")),
            ..ToolboxConfig::default()
        };
        let mut tb = Toolbox::new(c, None).unwrap();
        tb.console = false;
        fs::create_dir_all(&tb.dir).unwrap();
        fs::write(tb.dir.join(".lock"), "").unwrap();
        fs::set_permissions(tb.dir.join(".lock"), fs::Permissions::from_mode(0o644)).unwrap();
        fs::create_dir_all(tb.dir.join(".install-stale/package/d")).unwrap();
        tb.restrict_lock();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&tb.dir.join(".lock")), 0o200);
        fs::remove_file(tb.dir.join(".lock")).unwrap();
        tb.install_missing(|_, _| {}).unwrap();
        assert_eq!(mode(&tb.dir.join(".lock")), 0o200);
        assert!(!tb.dir.join(".install-stale").exists());
    }
}

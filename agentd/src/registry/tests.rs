//! The registry's files: one record each, written whole or not at all,
//! format 1 split, and what agentd refuses to overwrite.

use super::*;
use keystone_agent_api::{BackendKind, SandboxConfig, SandboxState};
use std::time::{Duration, UNIX_EPOCH};

/// A stopped sandbox record for tests.
pub(crate) fn sample() -> Sandbox {
    Sandbox {
        id: "7f1c9a56-4a1e-4d5e-9d7c-2f8b1c0e3a11".into(),
        name: "demo".into(),
        project_path: "/home/alice/src/demo".into(),
        state: SandboxState::Stopped,
        state_reason: String::new(),
        backend: BackendKind::Local,
        created_at: UNIX_EPOCH + Duration::from_micros(1_780_000_000_123_456),
        started_at: None,
        config: SandboxConfig::default(),
        ports: [("web".to_owned(), 3000)].into(),
        owner: 1000,
        uid: Some(0x7000_0001),
        declared: false,
        creating: false,
        idle_stopped: false,
        last_sync_at: None,
        last_sync_result: String::new(),
        held: Vec::new(),
        runtime: None,
    }
}

/// The files under `dir`, relative, sorted.
fn files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        if e.file_type().unwrap().is_dir() {
            out.extend(files(&e.path()).into_iter().map(|f| format!("{name}/{f}")));
            if name != "sandboxes" {
                out.push(format!("{name}/"));
            }
        } else {
            out.push(name);
        }
    }
    out.sort();
    out
}

/// `sample()` named `name`.
fn named(name: &str) -> Sandbox {
    Sandbox {
        name: name.to_owned(),
        ..sample()
    }
}

#[test]
fn round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let (reg, empty) = Registry::open(dir.path()).unwrap();
    assert!(empty.is_empty());
    reg.save(&sample()).unwrap();
    let (_, loaded) = Registry::open(dir.path()).unwrap();
    assert_eq!(loaded, vec![sample()]);
    // One file per sandbox, no temp file left behind, and a version that
    // an agentd of format 1 refuses rather than reading it as empty.
    assert_eq!(
        files(dir.path()),
        ["registry.json", "registry/", "registry/demo.json"]
    );
    let marker: serde_json::Value = serde_json::from_slice(&fs::read(reg.file()).unwrap()).unwrap();
    assert_eq!(marker["schema_version"], 2);
    assert!(parse(&reg.file(), &fs::read(reg.file()).unwrap()).is_err());
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &fs::metadata(reg.record("demo")).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn a_record_is_saved_and_removed_alone() {
    let dir = tempfile::tempdir().unwrap();
    let (reg, _) = Registry::open(dir.path()).unwrap();
    reg.save_all([&named("a"), &named("b")]).unwrap();
    let mut a = named("a");
    a.state = SandboxState::Running;
    reg.save(&a).unwrap();
    reg.remove("b").unwrap();
    reg.remove("b").unwrap(); // gone already: nothing to do
    let (_, loaded) = Registry::open(dir.path()).unwrap();
    assert_eq!(loaded, vec![a]);
}

#[test]
fn format_1_is_split_into_records_and_a_split_cut_short_is_done_again() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/registry-v1.json");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(REGISTRY_FILE);
    fs::copy(&fixture, &path).unwrap();
    // What a split cut short leaves: some records, and one of a sandbox
    // that the old file does not have.
    fs::create_dir(dir.path().join(RECORDS_DIR)).unwrap();
    fs::write(dir.path().join("registry/webapp.json"), b"{\"half").unwrap();
    fs::write(dir.path().join("registry/other.json"), b"{}").unwrap();
    let (reg, loaded) = Registry::open(dir.path()).unwrap();
    let names: Vec<&str> = loaded.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["webapp", "api"]);
    let mut on_disk = files(dir.path());
    on_disk.retain(|f| f.starts_with("registry/"));
    assert_eq!(
        on_disk,
        ["registry/", "registry/api.json", "registry/webapp.json"]
    );
    // The next start reads the records, the same sandboxes.
    let (_, again) = Registry::open(dir.path()).unwrap();
    let mut sorted = loaded.clone();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(again, sorted);
    assert_eq!(
        version(&reg.file(), &fs::read(reg.file()).unwrap()).unwrap(),
        SCHEMA_VERSION
    );
}

#[test]
fn a_record_that_cannot_be_read_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (reg, _) = Registry::open(dir.path()).unwrap();
    reg.save_all([&named("a"), &named("b")]).unwrap();
    let path = reg.record("b");
    fs::write(&path, b"{\"schema_version\": 2, \"sandbox\": ").unwrap();
    let err = Registry::open(dir.path()).unwrap_err();
    assert!(matches!(err, RegistryError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("b.json"), "{err}");
    assert_eq!(
        fs::read(&path).unwrap(),
        b"{\"schema_version\": 2, \"sandbox\": "
    );
    // A record under another sandbox's name.
    fs::write(&path, fs::read(reg.record("a")).unwrap()).unwrap();
    let err = Registry::open(dir.path()).unwrap_err();
    assert!(
        matches!(&err, RegistryError::Misplaced { name, .. } if name == "a"),
        "{err}"
    );
    // A record of a newer format.
    let mut v: serde_json::Value =
        serde_json::from_slice(&fs::read(reg.record("a")).unwrap()).unwrap();
    v["schema_version"] = 3.into();
    fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let err = Registry::open(dir.path()).unwrap_err();
    assert!(
        matches!(err, RegistryError::UnknownVersion { found: 3, .. }),
        "{err}"
    );
}

#[test]
fn what_a_write_left_half_made_is_removed_and_other_files_are_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let (reg, _) = Registry::open(dir.path()).unwrap();
    reg.save(&sample()).unwrap();
    // Of a process that cannot be running (beyond the largest pid).
    let half = reg.records_dir().join(".demo.json.tmp.4194305.0");
    fs::write(&half, b"{").unwrap();
    // Of this one, as another agentd's write in progress would be.
    let writing = reg
        .records_dir()
        .join(format!(".demo.json.tmp.{}.7", std::process::id()));
    fs::write(&writing, b"{").unwrap();
    let note = reg.records_dir().join("README");
    fs::write(&note, b"mine").unwrap();
    let aside = reg.records_dir().join("demo.json.bad");
    fs::write(&aside, b"{").unwrap();
    let sub = reg.records_dir().join("old");
    fs::create_dir(&sub).unwrap();
    let (_, loaded) = Registry::open(dir.path()).unwrap();
    assert_eq!(loaded, vec![sample()]);
    // Writing them all (as a start's reconciliation does) removes none of
    // them either.
    reg.save_all([&sample()]).unwrap();
    assert!(!half.exists());
    assert!(writing.exists() && note.exists() && aside.exists() && sub.exists());
}

#[test]
fn a_record_file_that_is_no_file_or_too_large_is_refused_without_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let (reg, _) = Registry::open(dir.path()).unwrap();
    let path = reg.record("demo");
    nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let at = dir.path().to_owned();
    std::thread::spawn(move || tx.send(Registry::open(&at).map(|_| ()).map_err(|e| e.to_string())));
    let got = rx.recv_timeout(std::time::Duration::from_secs(10));
    assert!(
        matches!(&got, Ok(Err(e)) if e.contains("not a regular file")),
        "{got:?}"
    );
    fs::remove_file(&path).unwrap();
    fs::write(&path, vec![b' '; 2 << 20]).unwrap();
    let err = Registry::open(dir.path()).unwrap_err();
    assert!(err.to_string().contains("at most 1024 KiB"), "{err}");
    // A link to a record is not followed.
    fs::remove_file(&path).unwrap();
    reg.save(&named("other")).unwrap();
    std::os::unix::fs::symlink(reg.record("other"), &path).unwrap();
    let err = Registry::open(dir.path()).unwrap_err();
    assert!(
        matches!(&err, RegistryError::Io { source, .. } if source.raw_os_error() == Some(nix::libc::ELOOP)),
        "{err}"
    );
}

#[test]
fn a_corrupt_or_lost_version_file_beside_records_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let (reg, _) = Registry::open(dir.path()).unwrap();
    reg.save(&sample()).unwrap();
    fs::write(reg.file(), b"{ not json").unwrap();
    let err = Registry::open(dir.path()).unwrap_err();
    assert!(matches!(err, RegistryError::CorruptVersion { .. }), "{err}");
    assert!(err.to_string().contains("remove the file"), "{err}");
    // Removed as it says: the records are read, the version written again.
    fs::remove_file(reg.file()).unwrap();
    assert_eq!(Registry::open(dir.path()).unwrap().1, vec![sample()]);
    // The records' directory gone: refused, not read as no sandboxes.
    fs::rename(reg.records_dir(), dir.path().join("elsewhere")).unwrap();
    for _ in 0..2 {
        // Again at the next start: the refusal made nothing in its place.
        let err = Registry::open(dir.path()).unwrap_err();
        assert!(matches!(err, RegistryError::RecordsMissing { .. }), "{err}");
        assert!(!reg.records_dir().exists());
    }
    // A record that says it is of format 1 (records came with format 2).
    fs::rename(dir.path().join("elsewhere"), reg.records_dir()).unwrap();
    let mut v: serde_json::Value =
        serde_json::from_slice(&fs::read(reg.record("demo")).unwrap()).unwrap();
    v["schema_version"] = 1.into();
    fs::write(reg.record("demo"), serde_json::to_vec(&v).unwrap()).unwrap();
    let err = Registry::open(dir.path()).unwrap_err();
    assert!(matches!(err, RegistryError::Corrupt { .. }), "{err}");
}

#[test]
fn an_older_registry_json_put_back_over_newer_records_is_not_split_over_them() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/registry-v1.json");
    let dir = tempfile::tempdir().unwrap();
    let (reg, _) = Registry::open(dir.path()).unwrap();
    // A sandbox made since: its record and its directory.
    reg.save(&sample()).unwrap();
    fs::create_dir_all(reg.sandbox_dir("demo")).unwrap();
    fs::copy(&fixture, reg.file()).unwrap();
    let err = Registry::open(dir.path()).unwrap_err();
    assert!(
        matches!(&err, RegistryError::Older { name, .. } if name == "demo"),
        "{err}"
    );
    assert!(reg.record("demo").exists());
}

#[test]
fn records_without_a_version_file_are_read_and_the_version_written() {
    let dir = tempfile::tempdir().unwrap();
    let (reg, _) = Registry::open(dir.path()).unwrap();
    reg.save(&sample()).unwrap();
    fs::remove_file(reg.file()).unwrap();
    let (_, loaded) = Registry::open(dir.path()).unwrap();
    assert_eq!(loaded, vec![sample()]);
    assert!(reg.file().exists());
}

#[test]
fn checked_in_fixture_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/registry-v1.json");
    let sandboxes = parse(&path, &fs::read(&path).unwrap()).unwrap();
    assert_eq!(sandboxes.len(), 2);
    assert_eq!(sandboxes[0].name, "webapp");
    assert_eq!(sandboxes[1].state, SandboxState::Running);
    // Settings added since (disk, pids) take their defaults.
    let d = SandboxConfig::default();
    assert_eq!(
        (sandboxes[0].config.disk, sandboxes[0].config.pids),
        (d.disk, d.pids)
    );
    // Writing it back gives the same document, plus those settings.
    let again = RegistryFile {
        schema_version: SCHEMA_V1,
        sandboxes,
    };
    let mut v1: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    let defaults = serde_json::to_value(&d).unwrap();
    for sb in v1["sandboxes"].as_array_mut().unwrap() {
        assert!(sb["config"].get("disk").is_none(), "the fixture is older");
        let config = sb["config"].as_object_mut().unwrap();
        for (k, v) in defaults.as_object().unwrap() {
            config.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    assert_eq!(serde_json::to_value(&again).unwrap(), v1);
}

#[test]
fn a_config_is_written_over_whatever_else_is_at_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let (reg, _) = Registry::open(dir.path()).unwrap();
    let sb = sample();
    let path = reg.sandbox_dir(&sb.name).join("config.json");
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let writer = reg.clone();
    std::thread::spawn(move || tx.send(writer.save_config(&sb).is_ok()));
    let saved = rx.recv_timeout(std::time::Duration::from_secs(10));
    assert_eq!(saved, Ok(true), "the save waited on a FIFO");
    assert!(fs::symlink_metadata(&path).unwrap().is_file());
    // Saved again unchanged: the file that holds it is kept.
    let ino = std::os::unix::fs::MetadataExt::ino(&fs::metadata(&path).unwrap());
    reg.save_config(&sample()).unwrap();
    assert_eq!(
        std::os::unix::fs::MetadataExt::ino(&fs::metadata(&path).unwrap()),
        ino
    );
}

#[test]
fn a_corrupt_version_file_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(REGISTRY_FILE);
    fs::write(&path, b"{\"schema_version\": 1, \"sandboxes\": [").unwrap();
    let err = Registry::open(dir.path()).unwrap_err();
    assert!(matches!(err, RegistryError::Corrupt { .. }));
    assert!(err.to_string().contains("will not overwrite"));
    assert_eq!(
        fs::read(&path).unwrap(),
        b"{\"schema_version\": 1, \"sandboxes\": ["
    );
}

#[test]
fn unknown_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join(REGISTRY_FILE),
        br#"{"schema_version": 9, "records": "elsewhere"}"#,
    )
    .unwrap();
    let err = Registry::open(dir.path()).unwrap_err();
    assert!(
        matches!(err, RegistryError::UnknownVersion { found: 9, .. }),
        "{err}"
    );
}

#[test]
fn checked_in_record_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/registry-v2/api.json");
    let sb = parse_record(&path, &fs::read(&path).unwrap()).unwrap();
    assert_eq!((sb.name.as_str(), sb.state), ("api", SandboxState::Running));
    assert_eq!(sb.uid, Some(0x7000_0001));
    assert_eq!(sb.runtime.as_ref().map(|r| r.pid_ns), Some(4_026_532_999));
    // As this agentd writes it: the same record.
    let dir = tempfile::tempdir().unwrap();
    let (reg, _) = Registry::open(dir.path()).unwrap();
    reg.save(&sb).unwrap();
    let written: serde_json::Value =
        serde_json::from_slice(&fs::read(reg.record("api")).unwrap()).unwrap();
    let mut pinned: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    // Settings added since the fixture (disk, pids…) take their defaults.
    let defaults = serde_json::to_value(SandboxConfig::default()).unwrap();
    let config = pinned["sandbox"]["config"].as_object_mut().unwrap();
    for (k, v) in defaults.as_object().unwrap() {
        config.entry(k.clone()).or_insert_with(|| v.clone());
    }
    assert_eq!(written, pinned);
}

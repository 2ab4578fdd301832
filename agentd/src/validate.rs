//! Validation of sandbox names and settings. Every function reports all the
//! problems it finds, so a person fixes them in one go.

use keystone_agent_api::SandboxConfig;

use crate::text::shown;

/// Longest sandbox name. With the 4-character prefixes agentd and the NixOS
/// module put in front of it (`ks-`, `vm-`, `tap`), a name still fits a
/// Linux network interface name (15 bytes) once hashed suffixes are added,
/// and it is always a valid DNS label (≤ 63).
pub const NAME_MAX: usize = 31;

/// The rule, in words, for error messages and docs.
pub const NAME_RULE: &str = "a lowercase letter followed by up to 30 lowercase letters, digits or \
     '-', not ending in '-' (regex [a-z]([a-z0-9-]{0,29}[a-z0-9])?)";

/// Largest D-Bus request agentd reads any further (its whole body).
pub const REQUEST_MAX: usize = 2 << 20;

/// Longest string argument that is a path, a branch, a name or an option.
pub const STRING_MAX: usize = 4096;

/// Most arguments of a command run in a sandbox, and their total size.
pub const ARGV_MAX: usize = 4096;
/// Total bytes of a command's arguments and environment (Linux's own
/// `ARG_MAX` is 2 MiB).
pub const ARGS_BYTES_MAX: usize = 1 << 20;
/// Most environment variables passed to a command.
pub const ENV_MAX: usize = 1024;

/// Check that string argument `what` is at most [`STRING_MAX`] bytes long.
pub fn check_len(what: &str, value: &str, problems: &mut Vec<String>) {
    if value.len() > STRING_MAX {
        problems.push(format!(
            "{what} is {} bytes long; at most {STRING_MAX} are accepted",
            value.len()
        ));
    }
}

/// Check a command's arguments and environment against the limits.
pub fn check_command<'a>(
    argv: &[String],
    env: impl ExactSizeIterator<Item = (&'a String, &'a String)>,
    problems: &mut Vec<String>,
) {
    if argv.len() > ARGV_MAX {
        problems.push(format!(
            "the command has {} arguments; at most {ARGV_MAX} are accepted",
            argv.len()
        ));
    }
    if env.len() > ENV_MAX {
        problems.push(format!(
            "{} environment variables given; at most {ENV_MAX} are accepted",
            env.len()
        ));
    }
    let bytes: usize = argv.iter().map(String::len).sum::<usize>()
        + env.map(|(k, v)| k.len() + v.len() + 2).sum::<usize>();
    if bytes > ARGS_BYTES_MAX {
        problems.push(format!(
            "the command's arguments and environment are {bytes} bytes; at most {ARGS_BYTES_MAX} are accepted"
        ));
    }
}

/// Lowest accepted memory size, in MiB.
pub const MEMORY_MIN: u32 = 256;

/// Lowest accepted disk size, in MiB.
pub const DISK_MIN: u32 = 16;

/// Highest accepted disk size, in MiB (16 TiB, ext4's limit with 4 KiB
/// blocks).
pub const DISK_MAX: u32 = 16 << 20;

/// Lowest accepted process limit: the init, the control server, a shell
/// and a few commands.
pub const PIDS_MIN: u32 = 16;

/// Highest accepted process limit: the kernel's own ceiling for `pid_max`
/// (`PID_MAX_LIMIT`).
pub const PIDS_MAX: u32 = 1 << 22;

/// Check a sandbox name: usable as a DNS label, in a network interface name,
/// a D-Bus object path and a file name.
pub fn check_name(name: &str, problems: &mut Vec<String>) {
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= NAME_MAX
        && b[0].is_ascii_lowercase()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[b.len() - 1] != b'-';
    if !ok {
        problems.push(format!(
            "name '{}' is not valid: use {NAME_RULE}",
            shown(name)
        ));
    }
}

/// Largest `idle_stop_seconds` (30 days).
pub const IDLE_STOP_MAX: u32 = 30 * 24 * 3600;

/// Largest `backup_every_seconds` (30 days).
pub const BACKUP_EVERY_MAX: u32 = 30 * 24 * 3600;

/// Largest `backup_keep`.
pub const BACKUP_KEEP_MAX: u32 = 1000;

/// Largest `snapshot_quota`, in MiB (16 TiB).
pub const SNAPSHOT_QUOTA_MAX: u32 = 16 << 20;

/// Check a sandbox's settings; every problem found goes to `problems`.
pub fn check_config(config: &SandboxConfig, problems: &mut Vec<String>) {
    if config.memory < MEMORY_MIN {
        problems.push(format!(
            "memory {} MiB is too small: at least {MEMORY_MIN} MiB",
            config.memory
        ));
    }
    if config.vcpus < 1 {
        problems.push("vcpus must be at least 1".to_owned());
    }
    if !(DISK_MIN..=DISK_MAX).contains(&config.disk) {
        problems.push(format!(
            "disk {} MiB is out of range: from {DISK_MIN} to {DISK_MAX} MiB",
            config.disk
        ));
    }
    if !(PIDS_MIN..=PIDS_MAX).contains(&config.pids) {
        problems.push(format!(
            "pids {} is out of range: from {PIDS_MIN} to {PIDS_MAX}",
            config.pids
        ));
    }
    if config.snapshot_quota > SNAPSHOT_QUOTA_MAX {
        problems.push(format!(
            "snapshot_quota {} MiB is out of range: from 0 (no snapshots) to {SNAPSHOT_QUOTA_MAX} MiB",
            config.snapshot_quota
        ));
    }
    if config.idle_stop_seconds > IDLE_STOP_MAX {
        problems.push(format!(
            "idle_stop_seconds {} is out of range: from 0 (never) to {IDLE_STOP_MAX} (30 days)",
            config.idle_stop_seconds
        ));
    }
    if config.backup_every_seconds > BACKUP_EVERY_MAX {
        problems.push(format!(
            "backup_every_seconds {} is out of range: from 0 (never) to {BACKUP_EVERY_MAX} (30 days)",
            config.backup_every_seconds
        ));
    }
    if config.backup_keep > BACKUP_KEEP_MAX
        || (config.backup_keep == 0 && config.backup_every_seconds > 0)
    {
        problems.push(format!(
            "backup_keep {} is out of range: from 1 to {BACKUP_KEEP_MAX} when backups are on",
            config.backup_keep
        ));
    }
    check_egress_entries("egress_allow", &config.egress_allow, problems);
    check_egress_entries("egress_deny", &config.egress_deny, problems);
    problems.extend(crate::git::guard::problems(&config.protect));
    for pattern in &config.env_files {
        if pattern.is_empty() || pattern.contains('/') || pattern == "." || pattern == ".." {
            problems.push(format!(
                "env_files pattern '{}' must be a file-name glob at the project root (no '/')",
                pattern.escape_debug()
            ));
        }
    }
}

/// Check a list of egress entries: each parses, and there are not too many.
pub fn check_egress_entries(what: &str, entries: &[String], problems: &mut Vec<String>) {
    use crate::egress::policy::{ENTRIES_MAX, Rule};
    if entries.len() > ENTRIES_MAX {
        problems.push(format!(
            "{what} has {} entries; at most {ENTRIES_MAX} are accepted",
            entries.len()
        ));
        return;
    }
    for e in entries {
        if let Err(m) = Rule::parse(e) {
            problems.push(format!("{what}: {m}"));
        }
    }
}

/// Derive a sandbox name from a project directory's name: lowercase, runs of
/// other characters become one '-', trimmed to the rule. `None` when nothing
/// usable is left (then the caller must pass `--name`).
#[must_use]
pub fn name_from_dir(dir: &str) -> Option<String> {
    let mut out = String::new();
    for c in dir.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            out.push(c);
        } else if !out.is_empty() && !out.ends_with('-') {
            out.push('-');
        }
    }
    let start = out.find(|c: char| c.is_ascii_lowercase())?;
    let mut name: String = out[start..].chars().take(NAME_MAX).collect();
    while name.ends_with('-') {
        name.pop();
    }
    let mut problems = Vec::new();
    check_name(&name, &mut problems);
    problems.is_empty().then_some(name)
}

/// Why `agent_home` cannot be what it is on `backend`, if it cannot (in
/// the words of the NixOS module's `validate`).
#[must_use]
pub fn agent_home_problem(
    home: keystone_agent_api::AgentHome,
    backend: keystone_agent_api::BackendKind,
) -> Option<String> {
    (home == keystone_agent_api::AgentHome::Shared
        && matches!(
            backend,
            keystone_agent_api::BackendKind::Microvm | keystone_agent_api::BackendKind::Kubernetes
        ))
        .then(|| {
            format!(
                "agent_home \"shared\" works in local and vm sandboxes for now, not on the {backend} backend; \
                 use \"own\" (log in once per sandbox)"
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name_ok(n: &str) -> bool {
        let mut p = Vec::new();
        check_name(n, &mut p);
        p.is_empty()
    }

    #[test]
    fn names() {
        for good in [
            "a",
            "myproject",
            "my-project-2",
            "a234567890123456789012345678901",
        ] {
            assert!(name_ok(good), "{good}");
        }
        for bad in [
            "",
            "1abc",
            "-abc",
            "abc-",
            "ABC",
            "my_project",
            "my.project",
            "a2345678901234567890123456789012",
            "naïve",
            "a b",
            "../x",
        ] {
            assert!(!name_ok(bad), "{bad}");
        }
    }

    #[test]
    fn every_config_problem_is_reported() {
        let c = SandboxConfig {
            memory: 128,
            vcpus: 0,
            disk: 1,
            pids: 5_000_000,
            env_files: vec!["../.env".into()],
            ..SandboxConfig::default()
        };
        let mut p = Vec::new();
        check_config(&c, &mut p);
        assert_eq!(p.len(), 5, "{p:?}");
        assert!(p[0].contains("128"));
        assert!(p[2].contains("disk 1 MiB"), "{p:?}");
        assert!(p[3].contains("pids 5000000"), "{p:?}");
    }

    #[test]
    fn backups_need_one_kept_and_a_bounded_interval() {
        let check = |every, keep| {
            let mut p = Vec::new();
            let c = SandboxConfig {
                backup_every_seconds: every,
                backup_keep: keep,
                ..SandboxConfig::default()
            };
            check_config(&c, &mut p);
            p
        };
        assert!(check(0, 0).is_empty());
        assert!(check(1, 1).is_empty());
        assert!(check(BACKUP_EVERY_MAX, BACKUP_KEEP_MAX).is_empty());
        assert!(check(60, 0)[0].contains("backup_keep 0"));
        assert!(check(BACKUP_EVERY_MAX + 1, 5)[0].contains("backup_every_seconds"));
        assert!(check(60, BACKUP_KEEP_MAX + 1)[0].contains("backup_keep"));
    }

    #[test]
    fn names_from_directories() {
        assert_eq!(name_from_dir("MyProject").as_deref(), Some("myproject"));
        assert_eq!(
            name_from_dir("my_cool.repo").as_deref(),
            Some("my-cool-repo")
        );
        assert_eq!(name_from_dir("2048-game").as_deref(), Some("game"));
        assert_eq!(name_from_dir("___"), None);
        assert_eq!(name_from_dir(&"x".repeat(80)).unwrap().len(), NAME_MAX);
    }
}

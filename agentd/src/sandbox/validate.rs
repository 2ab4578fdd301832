//! Validation of sandbox names and settings. Every function reports all the
//! problems it finds, so a person fixes them in one go.

use keystone_agent_api::SandboxConfig;

/// Longest sandbox name. With the 4-character prefixes agentd and the NixOS
/// module put in front of it (`ks-`, `vm-`, `tap`), a name still fits a
/// Linux network interface name (15 bytes) once hashed suffixes are added,
/// and it is always a valid DNS label (≤ 63).
pub const NAME_MAX: usize = 31;

/// The rule, in words, for error messages and docs.
pub const NAME_RULE: &str = "a lowercase letter followed by up to 30 lowercase letters, digits or \
     '-', not ending in '-' (regex [a-z]([a-z0-9-]{0,29}[a-z0-9])?)";

/// Lowest accepted memory size, in MiB.
pub const MEMORY_MIN: u32 = 1024;

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
            name.escape_debug()
        ));
    }
}

/// Check a sandbox configuration.
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
    for pattern in &config.env_files {
        if pattern.is_empty() || pattern.contains('/') || pattern == "." || pattern == ".." {
            problems.push(format!(
                "env_files pattern '{}' must be a file-name glob at the project root (no '/')",
                pattern.escape_debug()
            ));
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
            memory: 512,
            vcpus: 0,
            env_files: vec!["../.env".into()],
            ..SandboxConfig::default()
        };
        let mut p = Vec::new();
        check_config(&c, &mut p);
        assert_eq!(p.len(), 3, "{p:?}");
        assert!(p[0].contains("512"));
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

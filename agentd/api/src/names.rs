//! Well-known names and object paths.

use zvariant::OwnedObjectPath;

/// The bus name agentd owns, on the system bus, a session bus or a private bus.
pub const BUS_NAME: &str = "org.keystone.Agent1";

/// The manager object: create, list and look up sandboxes.
pub const MANAGER_PATH: &str = "/org/keystone/Agent1";

/// Interface of the manager object.
pub const MANAGER_INTERFACE: &str = "org.keystone.Agent1.Manager";

/// Interface of every sandbox object.
pub const SANDBOX_INTERFACE: &str = "org.keystone.Agent1.Sandbox";

/// Parent of every sandbox object path.
pub const SANDBOX_PATH_PREFIX: &str = "/org/keystone/Agent1/sandbox";

/// Prefix of every named error agentd returns.
pub const ERROR_PREFIX: &str = "org.keystone.Agent1.Error";

/// The object path of the sandbox called `name`.
///
/// Sandbox names match `[a-z][a-z0-9-]{0,30}`, and D-Bus path elements may not
/// contain `-`, so every `-` becomes `_` (a character names never contain, so
/// the mapping is reversible). Returns `None` for a name that would not give a
/// valid path, so a caller can answer "not found" instead of panicking.
#[must_use]
pub fn sandbox_path(name: &str) -> Option<OwnedObjectPath> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        return None;
    }
    OwnedObjectPath::try_from(format!("{SANDBOX_PATH_PREFIX}/{}", name.replace('-', "_"))).ok()
}

/// The name of the sandbox at object path `path` (the inverse of
/// [`sandbox_path`]), or `None` for a path that is not a sandbox's.
#[must_use]
pub fn sandbox_name(path: &str) -> Option<String> {
    let rest = path.strip_prefix(SANDBOX_PATH_PREFIX)?.strip_prefix('/')?;
    let name = rest.replace('_', "-");
    sandbox_path(&name)
        .is_some_and(|p| p.as_str() == path)
        .then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dashes_become_underscores() {
        assert_eq!(
            sandbox_path("my-project").unwrap().as_str(),
            "/org/keystone/Agent1/sandbox/my_project"
        );
        assert_eq!(
            sandbox_name("/org/keystone/Agent1/sandbox/my_project").as_deref(),
            Some("my-project")
        );
    }

    #[test]
    fn refuses_names_that_are_not_path_elements() {
        assert!(sandbox_path("").is_none());
        assert!(sandbox_path("a/b").is_none());
        assert!(sandbox_path("a.b").is_none());
        assert_eq!(sandbox_name("/org/keystone/Agent1/sandbox/a/b"), None);
        assert_eq!(sandbox_name("/org/keystone/Agent1/sandbox"), None);
        assert_eq!(sandbox_name("/org/keystone/Agent1/sandboxes/a"), None);
    }
}

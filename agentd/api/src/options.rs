//! The `a{sv}` option dictionaries of the interface, typed once for both
//! sides: agentctl writes them with `to_dict`, agentd reads them with
//! `from_dict`, which lists every problem it finds (a value of the wrong
//! type, a value out of its set, an unknown key), not just the first.

use std::collections::HashMap;
use std::fmt::Display;
use std::str::FromStr;

use zvariant::{OwnedValue, Value};

use crate::identity::GitIdentity;
use crate::types::{Agent, AgentHome, BackendKind, Egress, Network, SyncMode};

/// An options dictionary as agentd receives it.
pub type Dict = HashMap<String, OwnedValue>;

/// An options dictionary as agentctl sends it.
pub type OutDict<'a> = HashMap<&'static str, Value<'a>>;

/// Reads typed values out of a dictionary, collecting problems.
#[derive(Debug)]
pub struct Reader<'a> {
    dict: &'a Dict,
    problems: Vec<String>,
}

impl<'a> Reader<'a> {
    /// A reader of `dict`.
    #[must_use]
    pub fn new(dict: &'a Dict) -> Self {
        Self {
            dict,
            problems: Vec::new(),
        }
    }

    fn get<T>(
        &mut self,
        key: &str,
        want: &str,
        conv: impl FnOnce(&OwnedValue) -> Option<T>,
    ) -> Option<T> {
        let value = self.dict.get(key)?;
        let got = conv(value);
        if got.is_none() {
            self.problems.push(format!(
                "option '{key}' must be {want} (got signature {})",
                value.value_signature()
            ));
        }
        got
    }

    /// `key` as a string.
    pub fn string(&mut self, key: &str) -> Option<String> {
        self.get(key, "a string", |v| {
            String::try_from(v.try_clone().ok()?).ok()
        })
    }

    /// `key` as a list of strings.
    pub fn strings(&mut self, key: &str) -> Option<Vec<String>> {
        self.get(key, "an array of strings", |v| {
            Vec::<String>::try_from(v.try_clone().ok()?).ok()
        })
    }

    /// `key` as a boolean.
    pub fn bool(&mut self, key: &str) -> Option<bool> {
        self.get(key, "a boolean", |v| bool::try_from(v).ok())
    }

    /// `key` as a uint32.
    pub fn u32(&mut self, key: &str) -> Option<u32> {
        self.get(key, "a uint32", |v| u32::try_from(v).ok())
    }

    /// `key` as a uint16.
    pub fn u16(&mut self, key: &str) -> Option<u16> {
        self.get(key, "a uint16", |v| u16::try_from(v).ok())
    }

    /// `key` as a string that names one of `T`'s values.
    pub fn parsed<T: FromStr<Err = E>, E: Display>(&mut self, key: &str) -> Option<T> {
        let text = self.string(key)?;
        text.parse()
            .map_err(|e| self.problems.push(format!("option '{key}': {e}")))
            .ok()
    }

    /// `key` as an agent, or `""` for none.
    pub fn agent_or_none(&mut self, key: &str) -> Option<Option<Agent>> {
        match self.string(key)?.as_str() {
            "" => Some(None),
            _ => self.parsed(key).map(Some),
        }
    }

    /// Done: `value`, or every problem, unknown keys (any not in `known`)
    /// among them.
    ///
    /// # Errors
    /// The problems found, in key order.
    pub fn finish<T>(mut self, known: &[&str], value: T) -> Result<T, Vec<String>> {
        let mut unknown: Vec<&String> = self
            .dict
            .keys()
            .filter(|k| !known.contains(&k.as_str()))
            .collect();
        unknown.sort();
        for key in unknown {
            self.problems.push(format!(
                "unknown option '{key}' (known: {})",
                known.join(", ")
            ));
        }
        if self.problems.is_empty() {
            Ok(value)
        } else {
            Err(self.problems)
        }
    }
}

/// Insert `key` when `value` is there.
fn put<'a, T: Into<Value<'a>>>(d: &mut OutDict<'a>, key: &'static str, value: Option<T>) {
    if let Some(v) = value {
        d.insert(key, v.into());
    }
}

/// `CreateSandbox`'s options; `None` means the default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CreateOptions {
    /// Sandbox name; default: derived from the project directory's name.
    pub name: Option<String>,
    /// RAM in MiB.
    pub memory: Option<u32>,
    /// Virtual CPUs.
    pub vcpus: Option<u32>,
    /// Disk space for the workspace and home, in MiB.
    pub disk: Option<u32>,
    /// Most processes at once.
    pub pids: Option<u32>,
    /// Network mode.
    pub network: Option<Network>,
    /// Egress mode.
    pub egress: Option<Egress>,
    /// Egress allow entries beyond the preset.
    pub egress_allow: Option<Vec<String>>,
    /// Sync mode.
    pub sync_mode: Option<SyncMode>,
    /// Backend.
    pub backend: Option<BackendKind>,
    /// The agent a new session starts beside its shell.
    pub default_agent: Option<Agent>,
    /// Where the agents keep their logins.
    pub agent_home: Option<AgentHome>,
    /// The workspace's git identity: `owner`, `none` or `Name <email>`.
    pub git_identity: Option<GitIdentity>,
    /// Stop the sandbox after this many idle seconds (0: never).
    pub idle_stop_seconds: Option<u32>,
    /// Take a backup every this many seconds (0: never).
    pub backup_every_seconds: Option<u32>,
    /// How many backups to keep.
    pub backup_keep: Option<u32>,
    /// Protected paths (replacing the defaults; empty: none).
    pub protect: Option<Vec<String>>,
}

impl CreateOptions {
    /// The keys it knows.
    pub const KEYS: &'static [&'static str] = &[
        "name",
        "memory",
        "vcpus",
        "disk",
        "pids",
        "network",
        "egress",
        "egress_allow",
        "sync_mode",
        "backend",
        "default_agent",
        "agent_home",
        "git_identity",
        "idle_stop_seconds",
        "backup_every_seconds",
        "backup_keep",
        "protect",
    ];

    /// Read `dict`.
    ///
    /// # Errors
    /// Every problem found.
    pub fn from_dict(dict: &Dict) -> Result<Self, Vec<String>> {
        let mut r = Reader::new(dict);
        let o = Self {
            name: r.string("name"),
            memory: r.u32("memory"),
            vcpus: r.u32("vcpus"),
            disk: r.u32("disk"),
            pids: r.u32("pids"),
            network: r.parsed("network"),
            egress: r.parsed("egress"),
            egress_allow: r.strings("egress_allow"),
            sync_mode: r.parsed("sync_mode"),
            backend: r.parsed("backend"),
            default_agent: r.parsed("default_agent"),
            agent_home: r.parsed("agent_home"),
            git_identity: r.parsed("git_identity"),
            idle_stop_seconds: r.u32("idle_stop_seconds"),
            backup_every_seconds: r.u32("backup_every_seconds"),
            backup_keep: r.u32("backup_keep"),
            protect: r.strings("protect"),
        };
        r.finish(Self::KEYS, o)
    }

    /// The dictionary to send.
    #[must_use]
    pub fn to_dict(&self) -> OutDict<'_> {
        let mut d = OutDict::new();
        put(&mut d, "name", self.name.as_deref());
        put(&mut d, "memory", self.memory);
        put(&mut d, "vcpus", self.vcpus);
        put(&mut d, "disk", self.disk);
        put(&mut d, "pids", self.pids);
        put(&mut d, "network", self.network.map(|v| v.as_str()));
        put(&mut d, "egress", self.egress.map(|v| v.as_str()));
        put(&mut d, "egress_allow", self.egress_allow.clone());
        put(&mut d, "sync_mode", self.sync_mode.map(|v| v.as_str()));
        put(&mut d, "backend", self.backend.map(|v| v.as_str()));
        put(
            &mut d,
            "default_agent",
            self.default_agent.map(|v| v.as_str()),
        );
        put(&mut d, "agent_home", self.agent_home.map(|v| v.as_str()));
        put(
            &mut d,
            "git_identity",
            self.git_identity.as_ref().map(ToString::to_string),
        );
        put(&mut d, "idle_stop_seconds", self.idle_stop_seconds);
        put(&mut d, "backup_every_seconds", self.backup_every_seconds);
        put(&mut d, "backup_keep", self.backup_keep);
        put(&mut d, "protect", self.protect.clone());
        d
    }
}

/// `Sync`'s options.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncOptions {
    /// Only this branch.
    pub branch: Option<String>,
    /// Also fast-forward this host branch.
    pub into: Option<String>,
    /// Report only.
    pub dry_run: bool,
    /// The other direction: host branches into the workspace.
    pub from_host: bool,
    /// Bring these held branches' protected changes (up to the tip last
    /// held).
    pub allow_protected: Vec<String>,
    /// Move these branches' host refs though the sandbox rewrote (or
    /// deleted) them.
    pub accept_rewrite: Vec<String>,
}

impl SyncOptions {
    /// The keys it knows.
    pub const KEYS: &'static [&'static str] = &[
        "branch",
        "into",
        "dry_run",
        "from_host",
        "allow_protected",
        "accept_rewrite",
    ];

    /// Read `dict`.
    ///
    /// # Errors
    /// Every problem found.
    pub fn from_dict(dict: &Dict) -> Result<Self, Vec<String>> {
        let mut r = Reader::new(dict);
        let o = Self {
            branch: r.string("branch"),
            into: r.string("into"),
            dry_run: r.bool("dry_run").unwrap_or_default(),
            from_host: r.bool("from_host").unwrap_or_default(),
            allow_protected: r.strings("allow_protected").unwrap_or_default(),
            accept_rewrite: r.strings("accept_rewrite").unwrap_or_default(),
        };
        r.finish(Self::KEYS, o)
    }

    /// The dictionary to send.
    #[must_use]
    pub fn to_dict(&self) -> OutDict<'_> {
        let mut d = OutDict::new();
        put(&mut d, "branch", self.branch.as_deref());
        put(&mut d, "into", self.into.as_deref());
        d.insert("dry_run", self.dry_run.into());
        d.insert("from_host", self.from_host.into());
        if !self.allow_protected.is_empty() {
            put(
                &mut d,
                "allow_protected",
                Some(self.allow_protected.clone()),
            );
        }
        if !self.accept_rewrite.is_empty() {
            put(&mut d, "accept_rewrite", Some(self.accept_rewrite.clone()));
        }
        d
    }
}

/// `ExecStdio`'s options (and, with [`TtyOptions`], `OpenTerminal`'s).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOptions {
    /// Working directory inside the sandbox.
    pub cwd: Option<String>,
    /// Run in the worktree of this branch.
    pub worktree: Option<String>,
    /// Kill the command after this many seconds (0: never).
    pub timeout_secs: Option<u32>,
    /// Record the command in the history as `cp <description>`.
    pub record_as: Option<String>,
}

impl ExecOptions {
    /// The keys it knows.
    pub const KEYS: &'static [&'static str] = &["cwd", "worktree", "timeout_secs", "record_as"];

    fn read(r: &mut Reader<'_>) -> Self {
        Self {
            cwd: r.string("cwd"),
            worktree: r.string("worktree"),
            timeout_secs: r.u32("timeout_secs"),
            record_as: r.string("record_as"),
        }
    }

    /// Read `dict`.
    ///
    /// # Errors
    /// Every problem found.
    pub fn from_dict(dict: &Dict) -> Result<Self, Vec<String>> {
        let mut r = Reader::new(dict);
        let o = Self::read(&mut r);
        r.finish(Self::KEYS, o)
    }

    /// Read `dict` as a command on a terminal: these keys and
    /// [`TtyOptions`]'.
    ///
    /// # Errors
    /// Every problem found.
    pub fn with_tty_from_dict(dict: &Dict) -> Result<(Self, TtyOptions), Vec<String>> {
        let mut r = Reader::new(dict);
        let o = (Self::read(&mut r), TtyOptions::read(&mut r));
        let known: Vec<&str> = Self::KEYS.iter().chain(TtyOptions::KEYS).copied().collect();
        r.finish(&known, o)
    }

    /// The dictionary to send.
    #[must_use]
    pub fn to_dict(&self) -> OutDict<'_> {
        let mut d = OutDict::new();
        put(&mut d, "cwd", self.cwd.as_deref());
        put(&mut d, "worktree", self.worktree.as_deref());
        put(&mut d, "timeout_secs", self.timeout_secs);
        put(&mut d, "record_as", self.record_as.as_deref());
        d
    }
}

/// The caller's terminal: `Attach`'s options, and part of `OpenTerminal`'s.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TtyOptions {
    /// Rows.
    pub rows: Option<u16>,
    /// Columns.
    pub cols: Option<u16>,
    /// `TERM` inside.
    pub term: Option<String>,
}

impl TtyOptions {
    /// The keys it knows.
    pub const KEYS: &'static [&'static str] = &["rows", "cols", "term"];

    fn read(r: &mut Reader<'_>) -> Self {
        Self {
            rows: r.u16("rows"),
            cols: r.u16("cols"),
            term: r.string("term"),
        }
    }

    /// Read `dict`.
    ///
    /// # Errors
    /// Every problem found.
    pub fn from_dict(dict: &Dict) -> Result<Self, Vec<String>> {
        let mut r = Reader::new(dict);
        let o = Self::read(&mut r);
        r.finish(Self::KEYS, o)
    }

    /// The dictionary to send.
    #[must_use]
    pub fn to_dict(&self) -> OutDict<'_> {
        let mut d = OutDict::new();
        put(&mut d, "rows", self.rows);
        put(&mut d, "cols", self.cols);
        put(&mut d, "term", self.term.as_deref());
        d
    }
}

/// `Attach`'s options: the caller's terminal, and the agent to run in a new
/// session's first pane.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttachOptions {
    /// The caller's terminal.
    pub tty: TtyOptions,
    /// `claude`, `codex` or `gemini`.
    pub agent: Option<String>,
}

impl AttachOptions {
    /// The keys it knows besides [`TtyOptions`]'.
    pub const KEYS: &'static [&'static str] = &["agent"];

    /// Read `dict`.
    ///
    /// # Errors
    /// Every problem found.
    pub fn from_dict(dict: &Dict) -> Result<Self, Vec<String>> {
        let mut r = Reader::new(dict);
        let o = Self {
            tty: TtyOptions::read(&mut r),
            agent: r.string("agent"),
        };
        let known: Vec<&str> = TtyOptions::KEYS.iter().chain(Self::KEYS).copied().collect();
        r.finish(&known, o)
    }

    /// The dictionary to send.
    #[must_use]
    pub fn to_dict(&self) -> OutDict<'_> {
        let mut d = self.tty.to_dict();
        put(&mut d, "agent", self.agent.as_deref());
        d
    }
}

/// `Configure`'s settings: what may change on an existing sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigureOptions {
    /// Sync mode.
    pub sync_mode: Option<SyncMode>,
    /// Quiet seconds before an `auto-idle` snapshot.
    pub sync_idle_seconds: Option<u32>,
    /// The agent a new session starts beside its shell; `Some(None)` (`""`
    /// on the bus) for none.
    pub default_agent: Option<Option<Agent>>,
    /// Stop the sandbox after this many idle seconds (0: never).
    pub idle_stop_seconds: Option<u32>,
    /// Take a backup every this many seconds (0: never).
    pub backup_every_seconds: Option<u32>,
    /// How many backups to keep.
    pub backup_keep: Option<u32>,
    /// Protected paths (the whole list; empty: none).
    pub protect: Option<Vec<String>>,
}

impl ConfigureOptions {
    /// The keys it knows.
    pub const KEYS: &'static [&'static str] = &[
        "sync_mode",
        "sync_idle_seconds",
        "default_agent",
        "idle_stop_seconds",
        "backup_every_seconds",
        "backup_keep",
        "protect",
    ];

    /// Read `dict`.
    ///
    /// # Errors
    /// Every problem found.
    pub fn from_dict(dict: &Dict) -> Result<Self, Vec<String>> {
        let mut r = Reader::new(dict);
        let o = Self {
            sync_mode: r.parsed("sync_mode"),
            sync_idle_seconds: r.u32("sync_idle_seconds"),
            default_agent: r.agent_or_none("default_agent"),
            idle_stop_seconds: r.u32("idle_stop_seconds"),
            backup_every_seconds: r.u32("backup_every_seconds"),
            backup_keep: r.u32("backup_keep"),
            protect: r.strings("protect"),
        };
        r.finish(Self::KEYS, o)
    }

    /// The dictionary to send.
    #[must_use]
    pub fn to_dict(&self) -> OutDict<'_> {
        let mut d = OutDict::new();
        put(&mut d, "sync_mode", self.sync_mode.map(|v| v.as_str()));
        put(&mut d, "sync_idle_seconds", self.sync_idle_seconds);
        put(
            &mut d,
            "default_agent",
            self.default_agent.map(|a| a.map_or("", Agent::as_str)),
        );
        put(&mut d, "idle_stop_seconds", self.idle_stop_seconds);
        put(&mut d, "backup_every_seconds", self.backup_every_seconds);
        put(&mut d, "backup_keep", self.backup_keep);
        put(&mut d, "protect", self.protect.clone());
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What agentctl sends, as agentd receives it.
    fn wire(d: &OutDict<'_>) -> Dict {
        d.iter()
            .map(|(k, v)| {
                (
                    (*k).to_owned(),
                    OwnedValue::try_from(v.try_clone().unwrap()).unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn every_options_type_comes_back_as_it_was_sent() {
        let create = CreateOptions {
            name: Some("web".into()),
            memory: Some(2048),
            vcpus: Some(2),
            disk: Some(4096),
            pids: Some(100),
            network: Some(Network::None),
            egress: Some(Egress::Open),
            egress_allow: Some(vec!["example.com".into()]),
            sync_mode: Some(SyncMode::AutoCommit),
            backend: Some(BackendKind::Vm),
            default_agent: Some(Agent::Codex),
            agent_home: Some(AgentHome::Shared),
            git_identity: Some("Ada <ada@example.com>".parse().unwrap()),
            idle_stop_seconds: Some(1800),
            backup_every_seconds: Some(3600),
            backup_keep: Some(3),
            protect: Some(vec![".github/".into(), "**/Makefile".into()]),
        };
        assert_eq!(
            CreateOptions::from_dict(&wire(&create.to_dict())),
            Ok(create)
        );
        let sync = SyncOptions {
            branch: Some("main".into()),
            into: None,
            dry_run: true,
            from_host: false,
            allow_protected: vec!["ci".into()],
            accept_rewrite: vec!["main".into(), "topic".into()],
        };
        assert_eq!(SyncOptions::from_dict(&wire(&sync.to_dict())), Ok(sync));
        let exec = ExecOptions {
            cwd: Some("/workspace".into()),
            timeout_secs: Some(5),
            ..ExecOptions::default()
        };
        let tty = TtyOptions {
            rows: Some(40),
            cols: Some(120),
            term: Some("xterm".into()),
        };
        let mut both = exec.to_dict();
        both.extend(tty.to_dict());
        let both = wire(&both);
        assert_eq!(
            ExecOptions::with_tty_from_dict(&both),
            Ok((exec.clone(), tty))
        );
        assert!(
            ExecOptions::from_dict(&both).is_err(),
            "rows is no exec option"
        );
        for default_agent in [None, Some(None), Some(Some(Agent::Gemini))] {
            let conf = ConfigureOptions {
                sync_mode: Some(SyncMode::Manual),
                sync_idle_seconds: Some(9),
                default_agent,
                idle_stop_seconds: Some(0),
                backup_every_seconds: Some(0),
                backup_keep: Some(1),
                // `--no-protect`: an empty list is a value, not a default.
                protect: Some(Vec::new()),
            };
            assert_eq!(
                ConfigureOptions::from_dict(&wire(&conf.to_dict())),
                Ok(conf)
            );
        }
    }

    #[test]
    fn every_problem_is_listed() {
        let mut d = OutDict::new();
        d.insert("memory", "lots".into());
        d.insert("network", "wifi".into());
        d.insert("colour", "red".into());
        d.insert("vcpus", 2u32.into());
        let problems = CreateOptions::from_dict(&wire(&d)).unwrap_err();
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(
            problems[0].contains("'memory' must be a uint32"),
            "{problems:?}"
        );
        assert!(
            problems[1].contains("'network': 'wifi' is not one of"),
            "{problems:?}"
        );
        assert!(
            problems[2].starts_with("unknown option 'colour' (known: name,"),
            "{problems:?}"
        );
    }
}

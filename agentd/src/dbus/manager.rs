//! `org.keystone.Agent1.Manager` at `/org/keystone/Agent1`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use keystone_agent_api as api;
use zbus::message::Header;
use zbus::object_server::SignalEmitter;
use zbus::{Connection, interface};
use zvariant::{OwnedObjectPath, OwnedValue};

use super::{Callers, sandbox, to_dbus};
use crate::sandbox::manager::{CreateOptions, Manager};

/// The manager object.
#[derive(Debug)]
pub struct ManagerObject {
    manager: Arc<Manager>,
    callers: Arc<Callers>,
    /// The web console's way in, when agentd serves it.
    console: Option<Arc<crate::console::Door>>,
}

impl ManagerObject {
    /// A manager object over `manager` (and the web console's `console`).
    #[must_use]
    pub fn new(
        manager: Arc<Manager>,
        callers: Arc<Callers>,
        console: Option<Arc<crate::console::Door>>,
    ) -> Self {
        Self {
            manager,
            callers,
            console,
        }
    }
}

fn path_of(name: &str) -> Result<OwnedObjectPath, api::Error> {
    api::sandbox_path(name)
        .ok_or_else(|| api::Error::NotFound(format!("No sandbox named '{name}'")))
}

fn parse_options(options: &HashMap<String, OwnedValue>) -> Result<CreateOptions, api::Error> {
    CreateOptions::from_dict(options).map_err(|p| to_dbus(crate::error::Error::Invalid(p)))
}

#[interface(name = "org.keystone.Agent1.Manager")]
impl ManagerObject {
    /// Create a sandbox from the git repository at `project_path` (absolute).
    /// `options`: name (s), memory (u), vcpus (u), disk (u), pids (u),
    /// network (s), egress (s), egress_allow (as), sync_mode (s), backend (s), default_agent (s). Returns the new sandbox's object path and notices for
    /// the person (uncommitted changes not carried in, env files copied or
    /// skipped, submodules not cloned).
    #[zbus(out_args("path", "notices"))]
    async fn create_sandbox(
        &self,
        project_path: String,
        options: HashMap<String, OwnedValue>,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(OwnedObjectPath, Vec<String>), api::Error> {
        let caller = self.callers.caller(conn, &header).await?;
        super::check_strings(&[("project path", &project_path)])?;
        super::check_options(&options)?;
        let opts = parse_options(&options)?;
        let (sb, notices) = self
            .manager
            .create(caller, Path::new(&project_path), opts)
            .await
            .map_err(to_dbus)?;
        super::export_sandbox(conn, &self.manager, &self.callers, &sb.name)
            .await
            .map_err(api::Error::ZBus)?;
        Ok((path_of(&sb.name)?, notices))
    }

    /// The caller's sandboxes (root: all of them), one row each.
    async fn list_sandboxes(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Vec<api::SandboxSummary>, api::Error> {
        let caller = self.callers.caller(conn, &header).await?;
        Ok(self.manager.list(caller))
    }

    /// The object path of the sandbox `name`.
    async fn get_sandbox(
        &self,
        name: String,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<OwnedObjectPath, api::Error> {
        let caller = self.callers.caller(conn, &header).await?;
        super::check_strings(&[("sandbox name", &name)])?;
        self.manager.get(caller, &name).map_err(to_dbus)?;
        path_of(&name)
    }

    /// agentd's version.
    #[zbus(property(emits_changed_signal = "const"))]
    fn version(&self) -> String {
        env!("CARGO_PKG_VERSION").to_owned()
    }

    /// A sandbox was created (or declared in the configuration).
    #[zbus(signal)]
    async fn sandbox_added(
        emitter: &SignalEmitter<'_>,
        name: &str,
        path: OwnedObjectPath,
    ) -> zbus::Result<()>;

    /// Progress of creating sandbox `name`'s workspace: `stage` says what
    /// happens, `done` of `total` units (0 = unknown).
    #[zbus(signal)]
    async fn create_progress(
        emitter: &SignalEmitter<'_>,
        name: &str,
        stage: &str,
        done: u64,
        total: u64,
    ) -> zbus::Result<()>;

    /// A sandbox was destroyed.
    #[zbus(signal)]
    async fn sandbox_removed(
        emitter: &SignalEmitter<'_>,
        name: &str,
        path: OwnedObjectPath,
    ) -> zbus::Result<()>;

    /// The agents waiting for input in the caller's sandboxes (`name`:
    /// only that one's; empty: all), oldest first. Everything but the
    /// sandbox's name comes from inside it (escaped and cut by agentd).
    async fn agents_waiting(
        &self,
        name: String,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Vec<api::WaitingAgent>, api::Error> {
        let caller = self.callers.caller(conn, &header).await?;
        super::check_strings(&[("sandbox name", &name)])?;
        let only = (!name.is_empty()).then_some(name.as_str());
        let found = self.manager.waiting(caller, only).map_err(to_dbus)?;
        Ok(found
            .into_iter()
            .map(|(sandbox, w)| waiting_agent(sandbox, w))
            .collect())
    }

    /// A one-time link that logs the caller in to the web console (valid
    /// once, for 60 s), opening sandbox `name` when it is not empty.
    async fn console_login(
        &self,
        name: String,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<String, api::Error> {
        let caller = self.callers.caller(conn, &header).await?;
        super::check_strings(&[("sandbox name", &name)])?;
        let only = (!name.is_empty()).then_some(name.as_str());
        if let Some(n) = only {
            self.manager.get(caller, n).map_err(to_dbus)?;
        }
        let door = self.console.as_ref().ok_or_else(|| {
            to_dbus(crate::error::Error::Missing(
                "agentd does not serve the web console (its console.enable is false, or console.listen could not be bound: agentd's log says why)".to_owned(),
            ))
        })?;
        Ok(door.login_url(caller.uid, only))
    }

    /// An agent in sandbox `name` waits for input: it said `message`
    /// (from inside the sandbox: escaped, at most 200 characters) at
    /// `time` (µs since the epoch), in Zellij session `session` (empty:
    /// outside one). Sent to the sandbox's owner and root.
    #[zbus(signal)]
    async fn agent_waiting(
        emitter: &SignalEmitter<'_>,
        name: &str,
        session: &str,
        agent: &str,
        message: &str,
        time: u64,
    ) -> zbus::Result<()>;

    /// Nobody waits any more in `session` of sandbox `name`: someone typed
    /// there, or the sandbox stopped.
    #[zbus(signal)]
    async fn agent_answered(
        emitter: &SignalEmitter<'_>,
        name: &str,
        session: &str,
    ) -> zbus::Result<()>;
}

/// `w`, waiting in `sandbox`, as the bus carries it.
fn waiting_agent(sandbox: String, w: crate::waiting::Waiting) -> api::WaitingAgent {
    api::WaitingAgent {
        sandbox,
        session: w.session,
        agent: w.agent,
        message: w.message,
        time: crate::text::micros(Some(w.time)),
    }
}

/// Tell the owner of the sandbox (and root) that an agent there waits, or
/// no longer does.
pub async fn waiting_event(
    conn: &Connection,
    callers: &Arc<Callers>,
    event: &crate::sandbox::manager::WaitingEvent,
) -> zbus::Result<()> {
    use crate::sandbox::manager::WaitingEvent;
    // The owner it had when it happened.
    let (name, owner) = match event {
        WaitingEvent::Waiting(n, o, _) | WaitingEvent::Answered(n, o, _) => (n, *o),
    };
    let emitters = callers.emitters(conn, owner, &api::MANAGER_PATH.try_into()?);
    match event {
        WaitingEvent::Waiting(_, _, w) => {
            let w = waiting_agent(name.clone(), w.clone());
            for e in &emitters {
                ManagerObject::agent_waiting(e, name, &w.session, &w.agent, &w.message, w.time)
                    .await?;
            }
        }
        WaitingEvent::Answered(_, _, session) => {
            for e in &emitters {
                ManagerObject::agent_answered(e, name, session).await?;
            }
        }
    }
    Ok(())
}

/// Export a new sandbox and announce it to its owner and root.
pub async fn added(
    conn: &Connection,
    manager: &Arc<Manager>,
    callers: &Arc<Callers>,
    name: &str,
) -> zbus::Result<()> {
    super::export_sandbox(conn, manager, callers, name).await?;
    let (Some(path), Some(sb)) = (api::sandbox_path(name), manager.snapshot(name)) else {
        return Ok(());
    };
    for e in callers.emitters(conn, sb.owner, &api::MANAGER_PATH.try_into()?) {
        ManagerObject::sandbox_added(&e, name, path.clone()).await?;
    }
    Ok(())
}

/// The id of the sandbox the object of `name` last announced, if there is
/// one on the bus.
pub async fn shown_id(conn: &Connection, name: &str) -> Option<String> {
    let path = api::sandbox_path(name)?;
    let iface = conn
        .object_server()
        .interface::<_, sandbox::SandboxObject>(&path)
        .await
        .ok()?;
    iface.get().await.announced_as().map(|(_, id)| id)
}

/// Withdraw a destroyed sandbox's object and announce it to those who saw it.
pub async fn removed(conn: &Connection, callers: &Arc<Callers>, name: &str) -> zbus::Result<()> {
    let Some(path) = api::sandbox_path(name) else {
        return Ok(());
    };
    let owner = match conn
        .object_server()
        .interface::<_, sandbox::SandboxObject>(&path)
        .await
    {
        Ok(iface) => iface.get().await.announced_as().map(|(owner, _)| owner),
        Err(_) => None,
    };
    conn.object_server()
        .remove::<sandbox::SandboxObject, _>(&path)
        .await?;
    super::ssh::remove_parts(conn.object_server(), &path).await;
    // Unknown owner: only root hears of it.
    let owner = owner.unwrap_or(0);
    for e in callers.emitters(conn, owner, &api::MANAGER_PATH.try_into()?) {
        ManagerObject::sandbox_removed(&e, name, path.clone()).await?;
    }
    Ok(())
}

/// Announce progress of a create to the sandbox's owner and root.
pub async fn progress(
    conn: &Connection,
    manager: &Arc<Manager>,
    callers: &Arc<Callers>,
    name: &str,
    stage: &str,
    done: u64,
    total: u64,
) -> zbus::Result<()> {
    let Some(owner) = manager.snapshot(name).map(|s| s.owner) else {
        return Ok(());
    };
    for e in callers.emitters(conn, owner, &api::MANAGER_PATH.try_into()?) {
        ManagerObject::create_progress(&e, name, stage, done, total).await?;
    }
    Ok(())
}

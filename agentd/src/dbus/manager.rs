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
}

impl ManagerObject {
    /// A manager object over `manager`.
    #[must_use]
    pub fn new(manager: Arc<Manager>, callers: Arc<Callers>) -> Self {
        Self { manager, callers }
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
        sandbox::export(conn, &self.manager, &self.callers, &sb.name)
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
}

/// Export a new sandbox and announce it to its owner and root.
pub async fn added(
    conn: &Connection,
    manager: &Arc<Manager>,
    callers: &Arc<Callers>,
    name: &str,
) -> zbus::Result<()> {
    sandbox::export(conn, manager, callers, name).await?;
    let (Some(path), Some(sb)) = (api::sandbox_path(name), manager.snapshot(name)) else {
        return Ok(());
    };
    for e in callers.emitters(conn, sb.owner, &api::MANAGER_PATH.try_into()?) {
        ManagerObject::sandbox_added(&e, name, path.clone()).await?;
    }
    Ok(())
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
        Ok(iface) => iface.get().await.announced_owner(),
        Err(_) => None,
    };
    conn.object_server()
        .remove::<sandbox::SandboxObject, _>(&path)
        .await?;
    let server = conn.object_server();
    let _ = server
        .remove::<super::secrets::SecretsObject, _>(&path)
        .await;
    let _ = server.remove::<super::state::StateObject, _>(&path).await;
    let _ = server
        .remove::<super::records::RecordsObject, _>(&path)
        .await;
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

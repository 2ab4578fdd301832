//! `org.keystone.Agent1.State`: a sandbox's state kept and put back
//! (pause, snapshots, restore, fork; docs/state.md), on the sandbox's
//! object. Only the sandbox's owner and root may call it.

use std::sync::Arc;

use keystone_agent_api as api;
use zbus::message::Header;
use zbus::{Connection, interface};

use super::{Callers, check_strings, to_dbus};
use crate::auth::Caller;
use crate::sandbox::manager::{ForkOptions, Manager, SnapshotKind};

/// The state interface of `/org/keystone/Agent1/sandbox/<name>`.
#[derive(Debug)]
pub struct StateObject {
    pub(super) name: String,
    pub(super) manager: Arc<Manager>,
    pub(super) callers: Arc<Callers>,
}

impl StateObject {
    /// The caller, once it is known to be allowed the sandbox.
    async fn caller(&self, conn: &Connection, header: &Header<'_>) -> Result<Caller, api::Error> {
        let caller = self.callers.caller(conn, header).await?;
        self.manager.get(caller, &self.name).map_err(to_dbus)?;
        Ok(caller)
    }
}

#[interface(name = "org.keystone.Agent1.State")]
impl StateObject {
    /// Freeze every process of the running sandbox (state `paused`): they
    /// use no CPU and keep their memory.
    async fn pause(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(), api::Error> {
        let caller = self.caller(conn, &header).await?;
        self.manager
            .pause(caller, &self.name)
            .await
            .map(|_| ())
            .map_err(to_dbus)
    }

    /// Thaw the processes of the paused sandbox (state `running`).
    async fn resume(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(), api::Error> {
        let caller = self.caller(conn, &header).await?;
        self.manager
            .resume(caller, &self.name)
            .await
            .map(|_| ())
            .map_err(to_dbus)
    }

    /// Take a snapshot of the sandbox's files (workspace and home), its
    /// processes frozen while they are copied; `label` may be empty.
    async fn snapshot(
        &self,
        label: String,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<api::SnapshotInfo, api::Error> {
        let caller = self.caller(conn, &header).await?;
        check_strings(&[("label", &label)])?;
        self.manager
            .make_snapshot(caller, &self.name, &label, SnapshotKind::Asked)
            .await
            .map_err(to_dbus)
    }

    /// The sandbox's snapshots, oldest first.
    async fn snapshots(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Vec<api::SnapshotInfo>, api::Error> {
        let caller = self.caller(conn, &header).await?;
        self.manager.snapshots(caller, &self.name).map_err(to_dbus)
    }

    /// Remove snapshot `id`.
    async fn remove_snapshot(
        &self,
        id: String,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(), api::Error> {
        let caller = self.caller(conn, &header).await?;
        check_strings(&[("snapshot id", &id)])?;
        self.manager
            .remove_snapshot(caller, &self.name, &id)
            .await
            .map_err(to_dbus)
    }

    /// Put the sandbox's files back as snapshot `id` holds them; a running
    /// sandbox is stopped first and started again after.
    async fn restore(
        &self,
        id: String,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(), api::Error> {
        let caller = self.caller(conn, &header).await?;
        check_strings(&[("snapshot id", &id)])?;
        self.manager
            .restore(caller, &self.name, &id)
            .await
            .map(|_| ())
            .map_err(to_dbus)
    }

    /// A new sandbox `name` with this one's files (now, or as snapshot
    /// `from` holds them when not empty) and settings, a sandbox of its own
    /// in every other respect; with `branch` not empty, a worktree of it
    /// opened. Returns its object path and notices for the person.
    #[zbus(out_args("path", "notices"))]
    async fn fork(
        &self,
        name: String,
        from: String,
        branch: String,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<(zvariant::OwnedObjectPath, Vec<String>), api::Error> {
        let caller = self.caller(conn, &header).await?;
        check_strings(&[("name", &name), ("snapshot id", &from), ("branch", &branch)])?;
        let opts = ForkOptions {
            from: (!from.is_empty()).then_some(from),
            branch: (!branch.is_empty()).then_some(branch),
        };
        let (sb, notices) = self
            .manager
            .fork(caller, &self.name, &name, opts)
            .await
            .map_err(to_dbus)?;
        super::export_sandbox(conn, &self.manager, &self.callers, &sb.name)
            .await
            .map_err(api::Error::ZBus)?;
        let path = api::sandbox_path(&sb.name)
            .ok_or_else(|| api::Error::NotFound(format!("No sandbox named '{}'", sb.name)))?;
        Ok((path, notices))
    }
}

//! `org.keystone.Agent1.Records`: the records of a sandbox's terminal
//! sessions ([`crate::record`]), on the sandbox's object. Only the
//! sandbox's owner and root may call it.

use std::sync::Arc;

use keystone_agent_api as api;
use zbus::message::Header;
use zbus::{Connection, interface};

use super::{Callers, check_strings, to_dbus};
use crate::sandbox::manager::Manager;

/// The records interface of `/org/keystone/Agent1/sandbox/<name>`.
#[derive(Debug)]
pub struct RecordsObject {
    pub(super) name: String,
    pub(super) manager: Arc<Manager>,
    pub(super) callers: Arc<Callers>,
}

#[interface(name = "org.keystone.Agent1.Records")]
impl RecordsObject {
    /// The records of the sandbox's sessions (every `attach` and `exec
    /// --tty`), oldest first.
    async fn records(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Vec<api::RecordInfo>, api::Error> {
        let caller = self.callers.caller(conn, &header).await?;
        self.manager.records(caller, &self.name).map_err(to_dbus)
    }

    /// The last `limit` lines (0: all) typed into the sandbox's terminals,
    /// oldest first: who, when, in which session, what.
    async fn audit(
        &self,
        limit: u32,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<Vec<api::AuditEntry>, api::Error> {
        let caller = self.callers.caller(conn, &header).await?;
        let entries = self
            .manager
            .audit(caller, &self.name, limit as usize)
            .map_err(to_dbus)?;
        Ok(entries
            .into_iter()
            .map(|e| api::AuditEntry {
                time: e.time,
                uid: e.uid,
                session: e.session,
                kind: e.kind,
                typed: e.typed,
            })
            .collect())
    }

    /// Record `id`, opened for reading: an asciicast v2 file (its first
    /// line the header, then one event per line).
    async fn open_record(
        &self,
        id: String,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<zbus::zvariant::OwnedFd, api::Error> {
        let caller = self.callers.caller(conn, &header).await?;
        check_strings(&[("record id", &id)])?;
        self.manager
            .open_record(caller, &self.name, &id)
            .map(zbus::zvariant::OwnedFd::from)
            .map_err(to_dbus)
    }
}

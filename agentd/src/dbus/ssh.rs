//! `org.keystone.Agent1.Ssh`: SSH into a sandbox ([`crate::ssh`]), on the
//! sandbox's object. Only the sandbox's owner and root may call it; the
//! other interfaces of a sandbox's object are exported and withdrawn
//! here too.

use std::sync::Arc;

use keystone_agent_api as api;
use zbus::message::Header;
use zbus::object_server::ObjectServer;
use zbus::zvariant::{self, OwnedObjectPath};
use zbus::{Connection, interface};

use super::{Callers, check_strings, to_dbus};
use crate::sandbox::manager::Manager;

/// The SSH interface of `/org/keystone/Agent1/sandbox/<name>`.
#[derive(Debug)]
pub struct SshObject {
    pub(super) name: String,
    pub(super) manager: Arc<Manager>,
    pub(super) callers: Arc<Callers>,
}

#[interface(name = "org.keystone.Agent1.Ssh")]
impl SshObject {
    /// The host key SSH connections to the sandbox show, as a
    /// `known_hosts` line has it (`ssh-ed25519 AAAA…`): pin it.
    async fn host_key(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<String, api::Error> {
        let caller = self.callers.caller(conn, &header).await?;
        crate::ssh::host_key_line(&self.manager, caller, &self.name).map_err(to_dbus)
    }

    /// A new SSH connection into the sandbox: a socket whose other end is
    /// agentd's SSH server for it (what `ssh`'s `ProxyCommand` copies to
    /// and from). Sessions start in `branch`'s worktree (empty: the main
    /// one).
    async fn connect(
        &self,
        branch: String,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] header: Header<'_>,
    ) -> Result<zvariant::OwnedFd, api::Error> {
        let caller = self.callers.caller(conn, &header).await?;
        check_strings(&[("branch", &branch)])?;
        let branch = (!branch.is_empty()).then_some(branch);
        crate::ssh::connect(&self.manager, caller, &self.name, branch)
            .map(Into::into)
            .map_err(to_dbus)
    }
}

/// Export the interfaces of sandbox `name`'s object beside its
/// `Sandbox` one: state, records, secrets and SSH.
pub(super) async fn export_parts(
    server: &ObjectServer,
    path: &OwnedObjectPath,
    name: &str,
    manager: &Arc<Manager>,
    callers: &Arc<Callers>,
) -> zbus::Result<()> {
    let (n, m, c) = (
        || name.to_owned(),
        || Arc::clone(manager),
        || Arc::clone(callers),
    );
    server
        .at(
            path,
            super::state::StateObject {
                name: n(),
                manager: m(),
                callers: c(),
            },
        )
        .await?;
    server
        .at(
            path,
            super::records::RecordsObject {
                name: n(),
                manager: m(),
                callers: c(),
            },
        )
        .await?;
    server
        .at(
            path,
            super::secrets::SecretsObject {
                name: n(),
                manager: m(),
                callers: c(),
            },
        )
        .await?;
    server
        .at(
            path,
            SshObject {
                name: n(),
                manager: m(),
                callers: c(),
            },
        )
        .await
        .map(|_| ())
}

/// Withdraw what [`export_parts`] exported.
pub(super) async fn remove_parts(server: &ObjectServer, path: &OwnedObjectPath) {
    let _ = server
        .remove::<super::secrets::SecretsObject, _>(path)
        .await;
    let _ = server.remove::<super::state::StateObject, _>(path).await;
    let _ = server
        .remove::<super::records::RecordsObject, _>(path)
        .await;
    let _ = server.remove::<SshObject, _>(path).await;
}

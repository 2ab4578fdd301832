//! `org.keystone.Agent1.Secrets`: a sandbox's secrets, on the sandbox's
//! object (docs/agents.md). Only the sandbox's owner and root may call it;
//! nothing of it ever returns a value.

use std::sync::Arc;

use keystone_agent_api as api;
use zbus::message::Header;
use zbus::{Connection, interface};

use super::{Callers, check_strings, to_dbus};
use crate::sandbox::manager::Manager;

/// The secrets interface of `/org/keystone/Agent1/sandbox/<name>`.
#[derive(Debug)]
pub struct SecretsObject {
    pub(super) name: String,
    pub(super) manager: Arc<Manager>,
    pub(super) callers: Arc<Callers>,
}

#[interface(name = "org.keystone.Agent1.Secrets")]
impl SecretsObject {
    /// Give the sandbox a secret: from its next command on, `var` holds a
    /// placeholder inside, and the egress gateway puts `value` in place of
    /// it in `header` of the sandbox's HTTPS requests to `host` (`bearer`:
    /// the header is `Authorization: Bearer …`). Replaces the secret of
    /// `var` (keeping its placeholder). `value`: 1 to 16384 bytes of text
    /// on one line (a trailing newline is dropped).
    // Five arguments on the wire, with the connection and the header.
    #[allow(clippy::too_many_arguments)]
    async fn set(
        &self,
        var: String,
        host: String,
        header: String,
        bearer: bool,
        value: Vec<u8>,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] msg: Header<'_>,
    ) -> Result<(), api::Error> {
        let caller = self.callers.caller(conn, &msg).await?;
        check_strings(&[("var", &var), ("host", &host), ("header", &header)])?;
        if value.len() > crate::secrets::VALUE_MAX {
            return Err(api::Error::InvalidArgument(format!(
                "the value is larger than {} bytes",
                crate::secrets::VALUE_MAX
            )));
        }
        self.manager
            .set_secret(caller, &self.name, &var, &host, &header, bearer, &value)
            .map_err(to_dbus)
    }

    /// The sandbox's secrets: (variable, host, header, bearer) each, never
    /// a value.
    async fn list(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] msg: Header<'_>,
    ) -> Result<Vec<(String, String, String, bool)>, api::Error> {
        let caller = self.callers.caller(conn, &msg).await?;
        Ok(self
            .manager
            .list_secrets(caller, &self.name)
            .map_err(to_dbus)?
            .into_iter()
            .map(|s| (s.var, s.host, s.header, s.bearer))
            .collect())
    }

    /// Remove the secret of `var`; whether there was one.
    async fn remove(
        &self,
        var: String,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] msg: Header<'_>,
    ) -> Result<bool, api::Error> {
        let caller = self.callers.caller(conn, &msg).await?;
        check_strings(&[("var", &var)])?;
        self.manager
            .remove_secret(caller, &self.name, &var)
            .map_err(to_dbus)
    }
}

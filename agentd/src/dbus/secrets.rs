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

    /// Let the sandbox push to the repository at `url`
    /// (`https://host/owner/repo`) without holding `token`: from its next
    /// command on, git's credential for the URL inside is a placeholder,
    /// and the egress gateway swaps `token` in (sent as `user`'s, empty for
    /// `x-access-token`) for that repository's git requests only, refusing
    /// any push of a ref that is not a branch of `branches` (`*` matches
    /// anything), a deletion, or a tag unless `tags`. Replaces the
    /// repository's earlier settings (keeping its placeholder). `token`: 8
    /// to 16384 bytes of text on one line.
    #[allow(clippy::too_many_arguments)]
    async fn allow_forge(
        &self,
        url: String,
        user: String,
        branches: Vec<String>,
        tags: bool,
        token: Vec<u8>,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] msg: Header<'_>,
    ) -> Result<(), api::Error> {
        let caller = self.callers.caller(conn, &msg).await?;
        check_strings(&[("url", &url), ("user", &user)])?;
        if token.len() > crate::secrets::VALUE_MAX || branches.len() > crate::forges::PATTERNS_MAX {
            return Err(api::Error::InvalidArgument(format!(
                "the token is larger than {} bytes, or more than {} branch patterns were given",
                crate::secrets::VALUE_MAX,
                crate::forges::PATTERNS_MAX
            )));
        }
        for b in &branches {
            check_strings(&[("branch pattern", b)])?;
        }
        self.manager
            .allow_forge(caller, &self.name, &url, &user, &branches, tags, &token)
            .map(|_| ())
            .map_err(to_dbus)
    }

    /// The repositories the sandbox may push to: (url, user, branch
    /// patterns, tags) each, never a token.
    async fn forges(
        &self,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] msg: Header<'_>,
    ) -> Result<Vec<(String, String, Vec<String>, bool)>, api::Error> {
        let caller = self.callers.caller(conn, &msg).await?;
        Ok(self
            .manager
            .list_forges(caller, &self.name)
            .map_err(to_dbus)?
            .into_iter()
            .map(|f| (f.url, f.user, f.branches, f.tags))
            .collect())
    }

    /// Stop letting the sandbox push to `url`; whether it could.
    async fn remove_forge(
        &self,
        url: String,
        #[zbus(connection)] conn: &Connection,
        #[zbus(header)] msg: Header<'_>,
    ) -> Result<bool, api::Error> {
        let caller = self.callers.caller(conn, &msg).await?;
        check_strings(&[("url", &url)])?;
        self.manager
            .remove_forge(caller, &self.name, &url)
            .map_err(to_dbus)
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

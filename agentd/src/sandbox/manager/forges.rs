//! The repositories a sandbox may push to without a token
//! ([`crate::forges`]): allowing, listing and removing them, their rules
//! for the gateway, and the log of every push.

use std::sync::Arc;

use super::secrets::{changing, secret_error};
use super::{Manager, Sandbox};
use crate::auth::Caller;
use crate::error::{Error, Result};
use crate::forges::Forge;
use crate::secrets::SecretError;

/// A repository as `agentctl forge list` shows it (never its token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForgeInfo {
    /// `https://host/owner/repo`.
    pub url: String,
    /// The user name sent with the token.
    pub user: String,
    /// Branch patterns a push may update.
    pub branches: Vec<String>,
    /// Tags may be pushed.
    pub tags: bool,
}

impl Manager {
    /// The repositories sandbox `name` may push to (none when unreadable).
    pub(super) fn forges_of(&self, name: &str) -> Vec<Forge> {
        crate::forges::load(self.store.registry().dir(), name).unwrap_or_default()
    }

    /// Let sandbox `name` push to the repository at `url` (the branches of
    /// `branches`, tags with `tags`) with `token`, which stays here: inside,
    /// git's credential for the URL is a placeholder. Replaces the
    /// repository's earlier settings (keeping its placeholder).
    #[allow(clippy::too_many_arguments)]
    pub fn allow_forge(
        &self,
        caller: Caller,
        name: &str,
        url: &str,
        user: &str,
        branches: &[String],
        tags: bool,
        token: &[u8],
    ) -> Result<ForgeInfo> {
        let sb = self.get(caller, name)?;
        let token = crate::secrets::one_line(token);
        let user = if user.is_empty() {
            crate::forges::DEFAULT_USER
        } else {
            user
        };
        let (url, host, port, path) = crate::forges::check(url, branches, user, token)
            .map_err(|p| secret_error(name, SecretError::Invalid(p)))?;
        let dir = self.store.registry().dir();
        let _changing = changing();
        let mut list = crate::forges::load(dir, name).map_err(|e| secret_error(name, e))?;
        let old = list.iter().find(|f| f.url == url);
        if old.is_some_and(|f| f.declared) {
            return Err(Error::Invalid(vec![format!(
                "sandbox '{name}': {url} is declared in agentd's configuration \
                 (NixOS: keystone.agent.sandboxes.{name}.forges); change it there"
            )]));
        }
        if old.is_none() && list.len() >= crate::forges::PER_SANDBOX_MAX {
            return Err(Error::Invalid(vec![format!(
                "sandbox '{name}': a sandbox may push to at most {} repositories",
                crate::forges::PER_SANDBOX_MAX
            )]));
        }
        let forge = Forge {
            placeholder: old.map_or_else(crate::secrets::placeholder, |f| f.placeholder.clone()),
            url: url.clone(),
            host,
            port,
            path,
            user: user.to_owned(),
            branches: branches.to_vec(),
            tags,
            token: String::from_utf8_lossy(token).into_owned(),
            declared: false,
        };
        list.retain(|f| f.url != url);
        list.push(forge.clone());
        list.sort_by(|a, b| a.url.cmp(&b.url));
        crate::forges::save(dir, name, &list).map_err(|e| secret_error(name, e))?;
        let ca = self
            .secret_store()
            .ca(name)
            .map_err(|e| secret_error(name, e))?;
        self.write_ca_files(&sb, &ca.cert_pem)?;
        tracing::info!(sandbox = %name, %url, branches = ?branches, tags, "forge allowed");
        Ok(info(&forge))
    }

    /// The repositories sandbox `name` may push to, without their tokens.
    pub fn list_forges(&self, caller: Caller, name: &str) -> Result<Vec<ForgeInfo>> {
        self.get(caller, name)?;
        Ok(crate::forges::load(self.store.registry().dir(), name)
            .map_err(|e| secret_error(name, e))?
            .iter()
            .map(info)
            .collect())
    }

    /// Stop letting sandbox `name` push to `url`; whether it could.
    pub fn remove_forge(&self, caller: Caller, name: &str, url: &str) -> Result<bool> {
        self.get(caller, name)?;
        let url = crate::forges::parse_url(url).map_or_else(|_| url.to_owned(), |p| p.0);
        let dir = self.store.registry().dir();
        let _changing = changing();
        let mut list = crate::forges::load(dir, name).map_err(|e| secret_error(name, e))?;
        if list.iter().any(|f| f.url == url && f.declared) {
            return Err(Error::Invalid(vec![format!(
                "sandbox '{name}': {url} is declared in agentd's configuration; remove it there"
            )]));
        }
        let before = list.len();
        list.retain(|f| f.url != url);
        if list.len() == before {
            return Ok(false);
        }
        crate::forges::save(dir, name, &list).map_err(|e| secret_error(name, e))?;
        tracing::info!(sandbox = %name, %url, "forge removed");
        Ok(true)
    }

    /// The gateway's rules for sandbox `name`'s repositories on `host`
    /// (at `port`).
    pub(super) fn forge_rules(
        &self,
        name: &str,
        host: &str,
        port: u16,
    ) -> Vec<crate::egress::forge::Rule> {
        self.forges_of(name)
            .into_iter()
            .filter(|f| f.host.eq_ignore_ascii_case(host) && f.port == port)
            .map(|f| crate::egress::forge::Rule {
                url: f.url,
                path: f.path,
                user: f.user,
                placeholder: f.placeholder,
                token: f.token,
                branches: f.branches,
                tags: f.tags,
            })
            .collect()
    }

    /// What logs each push of sandbox `name` through its connection to
    /// `host`:`port`, in its egress log.
    pub(super) fn push_logger(
        self: &Arc<Self>,
        name: &str,
        host: &str,
        port: u16,
    ) -> crate::egress::intercept::Pushed {
        let weak = Arc::downgrade(self);
        let (name, host) = (name.to_owned(), host.to_ascii_lowercase());
        Box::new(move |rule, allowed, what| {
            let Some(m) = weak.upgrade() else {
                return;
            };
            tracing::info!(sandbox = %name, url = %rule.url, allowed, %what, "git push");
            m.log_egress(
                &name,
                crate::egress::log::Entry {
                    at: crate::text::micros(Some(std::time::SystemTime::now())),
                    sandbox: name.clone(),
                    protocol: "git-push".to_owned(),
                    host: host.clone(),
                    port,
                    decision: if allowed { "allow" } else { "deny" }.to_owned(),
                    rule: format!("forge {}", rule.url),
                    reason: what,
                    ..Default::default()
                },
            );
        })
    }

    /// Read the repositories agentd's configuration declares for `sb`
    /// (their tokens from their files; a changed file takes effect at this
    /// start), and drop declared ones no longer declared.
    pub(super) fn read_declared_forges(&self, sb: &Sandbox) -> Result<()> {
        let name = sb.name.as_str();
        let declared = self
            .settings
            .declared_forges
            .get(name)
            .filter(|_| sb.declared);
        let dir = self.store.registry().dir();
        let _changing = changing();
        let err = |e| secret_error(name, e);
        let mut list = crate::forges::load(dir, name).map_err(err)?;
        let before = list.clone();
        list.retain(|f| !f.declared || declared.is_some_and(|d| d.iter().any(|x| x.url == f.url)));
        for d in declared.into_iter().flatten() {
            let raw = crate::secrets::read_value_file(&d.url, &d.token_file).map_err(err)?;
            let token = crate::secrets::one_line(&raw);
            let user = d.user.as_deref().unwrap_or(crate::forges::DEFAULT_USER);
            let (url, host, port, path) = crate::forges::check(&d.url, &d.branches, user, token)
                .map_err(|problems| {
                    Error::Invalid(
                        problems
                            .into_iter()
                            .map(|m| format!("sandbox '{name}': forge {}: {m}", d.url))
                            .collect(),
                    )
                })?;
            let placeholder = list
                .iter()
                .find(|f| f.url == url)
                .map_or_else(crate::secrets::placeholder, |f| f.placeholder.clone());
            list.retain(|f| f.url != url);
            list.push(Forge {
                url,
                host,
                port,
                path,
                user: user.to_owned(),
                branches: d.branches.clone(),
                tags: d.tags,
                placeholder,
                token: String::from_utf8_lossy(token).into_owned(),
                declared: true,
            });
        }
        if list != before {
            list.sort_by(|a, b| a.url.cmp(&b.url));
            crate::forges::save(dir, name, &list).map_err(err)?;
        }
        if !list.is_empty() {
            let ca = self.secret_store().ca(name).map_err(err)?;
            self.write_ca_files(sb, &ca.cert_pem)?;
        }
        Ok(())
    }
}

fn info(f: &Forge) -> ForgeInfo {
    ForgeInfo {
        url: f.url.clone(),
        user: f.user.clone(),
        branches: f.branches.clone(),
        tags: f.tags,
    }
}

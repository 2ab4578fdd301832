//! agentd's look at Caddy every few seconds: its admin API checks the
//! Origin of requests when it listens on TCP, no route that agentd did not
//! make takes requests for the names it serves, and agentd's server is
//! there (rebuilt after a restart or reload of Caddy).

use serde_json::Value;

use super::Proxy;
use super::caddy::{self, CaddyError};

impl Proxy {
    /// One look at Caddy; see the module's documentation.
    pub(super) async fn check_caddy(&self) -> Result<(), CaddyError> {
        if self.caddy.enforce_origin(&self.cfg.domain).await? {
            tracing::warn!(
                admin = %self.cfg.caddy_admin,
                "Caddy's admin API on TCP did not check where requests come from, so a web page could \
                 reconfigure it: agentd turned its origin check on. Every local user can still reach \
                 it; put it on a unix socket (Caddy: `admin unix//run/caddy/admin.sock`, agentd: \
                 proxy.caddy_admin = \"unix//run/caddy/admin.sock\")"
            );
        }
        let servers = self.caddy.servers().await?;
        // What no route of another server may send requests to: Caddy's
        // admin API, agentd's pages and forwarders.
        let mut ours = vec![self.links_dir.display().to_string(), self.pages.to_string()];
        if let Some(host_port) = self.cfg.caddy_admin.strip_prefix("http://") {
            let host_port = host_port.trim_end_matches('/');
            ours.push(host_port.to_owned());
            if let Some((_, port)) = host_port.rsplit_once(':') {
                ours.extend(["localhost", "127.0.0.1", "[::1]", ""].map(|h| format!("{h}:{port}")));
            }
        }
        let mut names = vec![self.cfg.domain.clone()];
        names.extend(self.site_host());
        for path in foreign_routes(&servers, &self.cfg.server, &names, &ours) {
            tracing::warn!(%path, "removing a route in Caddy that agentd did not make from the names it serves");
            self.caddy.delete(&path).await?;
        }
        let present = servers[&self.cfg.server]["routes"]
            .as_array()
            .is_some_and(|rs| rs.iter().any(|r| r["@id"] == caddy::FALLBACK_ID));
        if !present || self.stale.load(std::sync::atomic::Ordering::SeqCst) {
            self.apply_all().await?;
        }
        Ok(())
    }
}

/// The config paths of routes in Caddy's `servers` that agentd did not
/// make and that take requests for names it serves, or send requests to
/// agentd or Caddy's admin API: every route without agentd's `@id` in its
/// own server `own`; every route of another server whose host matcher names
/// one of `names` or a name below one, or that names an upstream `dial` in
/// `reaching` (or a path below one). Within a server the last comes first,
/// so deleting them in order keeps the others' indices.
#[must_use]
pub fn foreign_routes(
    servers: &Value,
    own: &str,
    names: &[String],
    reaching: &[String],
) -> Vec<String> {
    let Some(servers) = servers.as_object() else {
        return Vec::new();
    };
    let ours = |host: &str| {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        names.iter().any(|n| {
            let n = n.to_ascii_lowercase();
            host == n || host.ends_with(&format!(".{n}"))
        })
    };
    let mut out = Vec::new();
    for (name, server) in servers {
        let Some(routes) = server["routes"].as_array() else {
            continue;
        };
        for (i, route) in routes.iter().enumerate().rev() {
            let foreign = if name == own {
                !route["@id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with(caddy::ID_PREFIX))
            } else {
                route["match"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|set| set["host"].as_array())
                    .flatten()
                    .filter_map(Value::as_str)
                    .any(ours)
                    || dials(route).iter().any(|d| {
                        reaching.iter().any(|r| {
                            let d = d.strip_prefix("unix/").unwrap_or(d);
                            d == r || d.starts_with(&format!("{r}/"))
                        })
                    })
            };
            if foreign {
                out.push(format!("/config/apps/http/servers/{name}/routes/{i}"));
            }
        }
    }
    out
}

/// Every upstream `dial` anywhere in `v` (handlers nest in subroutes).
fn dials(v: &Value) -> Vec<&str> {
    match v {
        Value::Object(o) => o
            .iter()
            .flat_map(|(k, v)| match (k.as_str(), v) {
                ("dial", Value::String(d)) => vec![d.as_str()],
                _ => dials(v),
            })
            .collect(),
        Value::Array(a) => a.iter().flat_map(dials).collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn routes_agentd_did_not_make_on_its_names_are_foreign() {
        let servers = json!({
            "keystone-agent": { "routes": [
                { "@id": "keystone-agent.a.3000", "match": [{ "host": ["a.sandbox.local"] }] },
                { "match": [{ "path": ["/x"] }], "handle": [] },
                { "@id": "other.thing" },
                { "@id": "keystone-agent.fallback" },
            ]},
            "x": { "routes": [
                { "match": [{ "host": ["example.org"] }] },
                { "match": [{ "path": ["/"] }, { "host": ["*.B.Sandbox.Local"] }] },
                { "match": [{ "host": ["sandbox.local."] }] },
                { "match": [{ "host": ["notsandbox.local"] }] },
                { "match": [{ "host": ["console.keystone.internal"] }] },
            ]},
            "empty": {},
            "relay": { "routes": [
                { "handle": [{ "handler": "subroute", "routes": [{ "handle": [
                    { "handler": "reverse_proxy", "upstreams": [{ "dial": "localhost:2019" }] }
                ]}]}]},
                { "handle": [{ "handler": "reverse_proxy", "upstreams": [{ "dial": "unix//var/lib/ka/links/0123.sock" }] }] },
                { "handle": [{ "handler": "reverse_proxy", "upstreams": [{ "dial": "localhost:20190" }] }] },
            ]},
        });
        let reaching = ["localhost:2019".to_owned(), "/var/lib/ka/links".to_owned()];
        let names = [
            "sandbox.local".to_owned(),
            "console.keystone.internal".to_owned(),
        ];
        assert_eq!(
            foreign_routes(&servers, "keystone-agent", &names, &reaching),
            vec![
                "/config/apps/http/servers/keystone-agent/routes/2",
                "/config/apps/http/servers/keystone-agent/routes/1",
                "/config/apps/http/servers/relay/routes/1",
                "/config/apps/http/servers/relay/routes/0",
                "/config/apps/http/servers/x/routes/4",
                "/config/apps/http/servers/x/routes/2",
                "/config/apps/http/servers/x/routes/1",
            ]
        );
        assert!(
            foreign_routes(
                &Value::Null,
                "keystone-agent",
                &["sandbox.local".to_owned()],
                &[]
            )
            .is_empty()
        );
    }
}

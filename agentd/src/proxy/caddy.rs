//! A small client of Caddy's admin API (JSON over HTTP, hyper).
//!
//! agentd owns one Caddy server (`ProxyConfig::server`): it creates it when
//! it is missing, keeps a catch-all route last in it (to agentd's own pages),
//! and adds its routes in front of that, each tagged with an `@id` that
//! starts with [`ID_PREFIX`].

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

/// Every `@id` agentd gives a route starts with this.
pub const ID_PREFIX: &str = "keystone-agent.";

/// `@id` of the catch-all route.
pub const FALLBACK_ID: &str = "keystone-agent.fallback";

/// `@id` of the TLS automation policy (certificates on demand).
pub const TLS_ID: &str = "keystone-agent.tls";

/// The `@id` of the route of agentd's own site (the console).
pub const SITE_ID: &str = "keystone-agent.site";

/// A failed call to Caddy's admin API.
#[derive(Debug, thiserror::Error)]
pub enum CaddyError {
    /// The request could not be built.
    #[error(transparent)]
    Request(#[from] hyper::http::Error),
    /// Nothing answers at the admin address.
    #[error("Caddy's admin API at {base} is not reachable: {error}")]
    Unreachable {
        /// The admin API's address.
        base: String,
        /// Why not.
        #[source]
        error: hyper_util::client::legacy::Error,
    },
    /// The answer could not be read, or was too large.
    #[error("Caddy's answer to {method} {path} was unreadable or over {REPLY_MAX} bytes: {error}")]
    Unreadable {
        /// The request's method.
        method: Method,
        /// The request's path.
        path: String,
        /// Why not.
        #[source]
        error: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Caddy took too long.
    #[error("Caddy did not answer {method} {path} within 10 s")]
    Timeout {
        /// The request's method.
        method: Method,
        /// The request's path.
        path: String,
    },
    /// Caddy refused a request; what it answered.
    #[error("Caddy refused {method} {path} ({status}): {body}")]
    Refused {
        /// The request's method.
        method: Method,
        /// The request's path.
        path: String,
        /// Caddy's status.
        status: StatusCode,
        /// Caddy's answer.
        body: String,
    },
    /// Caddy answered a lookup by id with an error.
    #[error("Caddy answered {status} for /id/{id}: {body}")]
    Lookup {
        /// The `@id` looked up.
        id: String,
        /// Caddy's status.
        status: StatusCode,
        /// Caddy's answer.
        body: String,
    },
    /// Caddy's answer is not JSON.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// A route to put has no `@id`.
    #[error("a route without @id")]
    NoId,
    /// What answers at the admin address is not the Caddy agentd found
    /// there first (another uid listens there now).
    #[error(
        "Caddy's admin API at {base} belongs to uid {found} now, not to uid {expected} as when agentd found it: \
         agentd sends it nothing (restart agentd if Caddy now runs as another user)"
    )]
    Impostor {
        /// The admin API's address.
        base: String,
        /// Caddy's uid when agentd first reached it.
        expected: u32,
        /// The uid of what listens there now.
        found: u32,
    },
}

/// Caddy's admin API at one address.
#[derive(Debug, Clone)]
pub struct Caddy {
    base: String,
    client: Transport,
    /// The admin address as configured (`proxy.caddy_admin`).
    admin: String,
    /// Caddy's uid, pinned when agentd first finds it (`u32::MAX` until
    /// then): the owner of the admin socket, or of the socket listening on
    /// the admin port.
    uid: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

/// How the admin API is reached: TCP (`http://HOST:PORT`) or a unix
/// socket (`unix//PATH`, Caddy's own notation), which only those who may
/// open the socket reach, unlike a port on loopback that every local user
/// can.
#[derive(Debug, Clone)]
enum Transport {
    Tcp(Client<HttpConnector, Full<Bytes>>),
    Unix(Client<UnixConnector, Full<Bytes>>),
}

/// Connects every request to one unix socket, whatever its URI says.
#[derive(Debug, Clone)]
struct UnixConnector(std::sync::Arc<std::path::Path>);

impl tower::Service<hyper::Uri> for UnixConnector {
    type Response = hyper_util::rt::TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = std::io::Result<Self::Response>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: hyper::Uri) -> Self::Future {
        let path = std::sync::Arc::clone(&self.0);
        Box::pin(async move {
            let stream = tokio::time::timeout(
                Duration::from_secs(2),
                tokio::net::UnixStream::connect(&*path),
            )
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
            Ok(hyper_util::rt::TokioIo::new(stream))
        })
    }
}

/// Largest answer read from the admin API.
const REPLY_MAX: usize = 8 << 20;

impl Caddy {
    /// A client of the admin API at `base`: `http://127.0.0.1:2019`, or
    /// `unix//run/caddy/admin.sock`.
    #[must_use]
    pub fn new(base: &str) -> Self {
        let client = if let Some(path) = crate::config::caddy_admin_socket(base) {
            Transport::Unix(Client::builder(TokioExecutor::new()).build(UnixConnector(path.into())))
        } else {
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            connector.set_connect_timeout(Some(Duration::from_secs(2)));
            Transport::Tcp(Client::builder(TokioExecutor::new()).build(connector))
        };
        Self {
            base: base.trim_end_matches('/').to_owned(),
            client,
            admin: base.to_owned(),
            uid: std::sync::Arc::new(std::sync::atomic::AtomicU32::new(u32::MAX)),
        }
    }

    /// Caddy's uid as first found (`u32::MAX` while unknown).
    #[must_use]
    pub fn uid(&self) -> u32 {
        self.uid.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Check who owns the admin address now: the first uid found is
    /// pinned; another later is an impostor (whoever listens on the admin
    /// port while Caddy is down), which gets no request, and whose
    /// connections the forwarders never take.
    fn check_owner(&self) -> Result<(), CaddyError> {
        let Some(found) = super::peer::caddy_uid(&self.admin) else {
            return Ok(());
        };
        match self.uid.compare_exchange(
            u32::MAX,
            found,
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
        ) {
            Ok(_) => Ok(()),
            Err(expected) if expected == found => Ok(()),
            Err(expected) => Err(CaddyError::Impostor {
                base: self.base.clone(),
                expected,
                found,
            }),
        }
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(StatusCode, Bytes), CaddyError> {
        self.check_owner()?;
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let req = Request::builder()
            .method(method.clone())
            .header("content-type", "application/json");
        // Over its unix socket, Caddy's admin API takes only an empty Host.
        // Over TCP it is asked to check the Origin of every request
        // ([`Caddy::enforce_origin`]): agentd's is the admin address itself.
        let req = match &self.client {
            Transport::Tcp(_) => req
                .uri(format!("{}{path}", self.base))
                .header("origin", &self.base),
            Transport::Unix(_) => req
                .uri(format!("http://localhost{path}"))
                .header("host", ""),
        }
        .body(Full::new(Bytes::from(body)))?;
        let send = async {
            let resp = match &self.client {
                Transport::Tcp(c) => c.request(req).await,
                Transport::Unix(c) => c.request(req).await,
            }
            .map_err(|error| CaddyError::Unreachable {
                base: self.base.clone(),
                error,
            })?;
            let status = resp.status();
            // Whatever listens on the admin address answers within a size.
            let bytes = http_body_util::Limited::new(resp.into_body(), REPLY_MAX)
                .collect()
                .await
                .map_err(|error| CaddyError::Unreadable {
                    method: method.clone(),
                    path: path.to_owned(),
                    error,
                })?
                .to_bytes();
            Ok((status, bytes))
        };
        tokio::time::timeout(Duration::from_secs(10), send)
            .await
            .map_err(|_| CaddyError::Timeout {
                method,
                path: path.to_owned(),
            })?
    }

    /// `method path` that must succeed (2xx).
    async fn ok(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Bytes, CaddyError> {
        let (status, bytes) = self.call(method.clone(), path, body).await?;
        if status.is_success() {
            Ok(bytes)
        } else {
            Err(CaddyError::Refused {
                method,
                path: path.to_owned(),
                status,
                body: String::from_utf8_lossy(&bytes).trim().to_owned(),
            })
        }
    }

    /// Whether a config object with `@id` `id` exists.
    pub async fn exists(&self, id: &str) -> Result<bool, CaddyError> {
        let (status, body) = self.call(Method::GET, &format!("/id/{id}"), None).await?;
        match status {
            s if s.is_success() => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            status => Err(CaddyError::Lookup {
                id: id.to_owned(),
                status,
                body: String::from_utf8_lossy(&body).trim().to_owned(),
            }),
        }
    }

    /// The config value at `path`; `Null` when it (or a parent) is missing.
    async fn get(&self, path: &str) -> Result<Value, CaddyError> {
        let (status, bytes) = self.call(Method::GET, path, None).await?;
        let text = String::from_utf8_lossy(&bytes);
        if status.is_success() {
            Ok(serde_json::from_slice(&bytes)?)
        } else if status == StatusCode::BAD_REQUEST && text.contains("invalid traversal path") {
            // 2.6's answer when a parent object does not exist.
            Ok(Value::Null)
        } else {
            Err(CaddyError::Refused {
                method: Method::GET,
                path: path.to_owned(),
                status,
                body: text.trim().to_owned(),
            })
        }
    }

    /// Over TCP, make sure Caddy's admin API refuses requests whose
    /// `Origin` is not the admin address itself: a page in a browser sends
    /// its own origin with every request that could change something, and
    /// can send a "simple" `POST` to any port on loopback without asking
    /// first. Origins under `domain` (the links') are dropped from the
    /// allowed ones. Returns whether Caddy's setting had to change; nothing
    /// to do over a unix socket, which no page can reach.
    pub async fn enforce_origin(&self, domain: &str) -> Result<bool, CaddyError> {
        let Transport::Tcp(_) = self.client else {
            return Ok(false);
        };
        let host = self
            .base
            .strip_prefix("http://")
            .unwrap_or(&self.base)
            .to_owned();
        let admin = self.get("/config/admin").await?;
        let wanted = origin_setting(&admin, &host, domain);
        if wanted == admin {
            return Ok(false);
        }
        // Caddy restarts its admin endpoint with the new setting: wait
        // (at most 2 s) until it answers again.
        self.ok(Method::POST, "/config/admin", Some(&wanted))
            .await?;
        for _ in 0..20 {
            if self.get("/config/admin").await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(true)
    }

    /// Every server of Caddy's HTTP app (`Null` when there is none).
    pub async fn servers(&self) -> Result<Value, CaddyError> {
        self.get("/config/apps/http/servers").await
    }

    /// Delete the config value at `path` (`/config/…`).
    pub async fn delete(&self, path: &str) -> Result<(), CaddyError> {
        self.ok(Method::DELETE, path, None).await?;
        Ok(())
    }

    /// The routes of `server` (empty when it has none or does not exist).
    pub async fn routes(&self, server: &str) -> Result<Vec<Value>, CaddyError> {
        Ok(
            match self
                .get(&format!("/config/apps/http/servers/{server}/routes"))
                .await?
            {
                Value::Array(a) => a,
                _ => Vec::new(),
            },
        )
    }

    /// Make sure `server` exists, listening on `listen`, with `fallback` as
    /// its last route; HTTPS (certificates by Caddy's automatic HTTPS)
    /// only when `https`. Returns whether anything had to be created.
    pub async fn ensure_server(
        &self,
        server: &str,
        listen: &[String],
        https: bool,
        fallback: &Value,
    ) -> Result<bool, CaddyError> {
        let path = format!("/config/apps/http/servers/{server}");
        if self.get(&path).await?.is_null() {
            let mut body = json!({
                "listen": listen,
                "automatic_https": { "disable": !https },
                "routes": [fallback],
            });
            if https {
                // TLS for every name, with certificates on demand (the
                // policy of `ensure_tls`), not only for names with a route:
                // the catch-all must answer over HTTPS too.
                body["tls_connection_policies"] = json!([{}]);
            }
            self.ok(Method::PUT, &path, Some(&body)).await?;
            return Ok(true);
        }
        if self.exists(FALLBACK_ID).await? {
            return Ok(false);
        }
        self.ok(Method::POST, &format!("{path}/routes"), Some(fallback))
            .await?;
        Ok(true)
    }

    /// Make sure Caddy issues certificates on demand, from its internal CA,
    /// for `domain` and the one and two labels below it, and for the names
    /// in `also`, asking `ask` (agentd's pages) before each.
    pub async fn ensure_tls(
        &self,
        domain: &str,
        also: &[&str],
        ask: &str,
    ) -> Result<(), CaddyError> {
        let mut subjects = vec![
            domain.to_owned(),
            format!("*.{domain}"),
            format!("*.*.{domain}"),
        ];
        subjects.extend(also.iter().map(|n| (*n).to_owned()));
        let policy = json!({
            "@id": TLS_ID,
            "subjects": subjects,
            "issuers": [{ "module": "internal" }],
            "on_demand": true,
        });
        let on_demand = json!({ "ask": ask });
        if self.exists(TLS_ID).await? {
            self.ok(Method::PATCH, &format!("/id/{TLS_ID}"), Some(&policy))
                .await?;
        } else if self.get("/config/apps/tls/automation").await?.is_null() {
            let automation = json!({ "policies": [policy], "on_demand": on_demand });
            self.ok(
                Method::PUT,
                "/config/apps/tls/automation",
                Some(&automation),
            )
            .await?;
            return Ok(());
        } else if self
            .get("/config/apps/tls/automation/policies")
            .await?
            .is_null()
        {
            self.ok(
                Method::PUT,
                "/config/apps/tls/automation/policies",
                Some(&json!([policy])),
            )
            .await?;
        } else {
            // Before the others: the first policy that matches a name wins.
            self.ok(
                Method::PUT,
                "/config/apps/tls/automation/policies/0",
                Some(&policy),
            )
            .await?;
        }
        self.ok(
            Method::POST,
            "/config/apps/tls/automation/on_demand",
            Some(&on_demand),
        )
        .await?;
        Ok(())
    }

    /// Put `route` (with its `@id`) into `server`: replaced in place when
    /// its id exists (Caddy 2.6 would accept a duplicate), else inserted
    /// just before the catch-all.
    pub async fn put_route(&self, server: &str, route: &Value) -> Result<(), CaddyError> {
        let id = route["@id"].as_str().ok_or(CaddyError::NoId)?;
        if self.exists(id).await? {
            self.ok(Method::PATCH, &format!("/id/{id}"), Some(route))
                .await?;
            return Ok(());
        }
        let routes = self.routes(server).await?;
        let at = routes
            .iter()
            .position(|r| r["@id"] == FALLBACK_ID)
            .unwrap_or(routes.len());
        self.ok(
            Method::PUT,
            &format!("/config/apps/http/servers/{server}/routes/{at}"),
            Some(route),
        )
        .await?;
        Ok(())
    }

    /// Remove the config object `id` (nothing if it is gone already).
    pub async fn remove(&self, id: &str) -> Result<(), CaddyError> {
        if self.exists(id).await? {
            self.ok(Method::DELETE, &format!("/id/{id}"), None).await?;
        }
        Ok(())
    }
}

/// Caddy's `admin` object `admin` with origin enforcement on: `host` (the
/// admin address agentd uses) allowed, origins under `domain` not.
fn origin_setting(admin: &Value, host: &str, domain: &str) -> Value {
    let mut wanted = match admin {
        Value::Object(_) => admin.clone(),
        _ => json!({}),
    };
    if wanted.get("listen").is_none_or(Value::is_null) {
        wanted["listen"] = json!(host);
    }
    wanted["enforce_origin"] = json!(true);
    let under_domain = |o: &str| {
        let name = o.split("://").last().unwrap_or(o);
        let name = name.rsplit_once(':').map_or(name, |(n, _)| n);
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        name == domain || name.ends_with(&format!(".{domain}"))
    };
    let mut origins: Vec<Value> = wanted["origins"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|o| o.as_str().is_some_and(|o| !under_domain(o)))
        .cloned()
        .collect();
    if !origins.iter().any(|o| o == host) {
        origins.push(json!(host));
    }
    wanted["origins"] = json!(origins);
    wanted
}

/// The query parameter that carries a link's token.
pub const TOKEN_PARAM: &str = "keystone_token";

/// The cookie a browser keeps a link's token in (one per host).
pub const TOKEN_COOKIE: &str = "keystone_link";

/// Who must show what for a route to answer.
#[derive(Debug, Clone, Copy)]
pub struct Gate<'a> {
    /// The sandbox's link token.
    pub token: &'a str,
    /// agentd's pages, which answer a request without it.
    pub pages: &'a str,
    /// The sandbox's name.
    pub sandbox: &'a str,
    /// The links' domain.
    pub domain: &'a str,
}

/// A regular expression for the origins of sandbox `sandbox`'s links
/// (`SANDBOX.DOMAIN` and `LABEL.SANDBOX.DOMAIN`, any scheme and port).
#[must_use]
pub fn own_origins(sandbox: &str, domain: &str) -> String {
    let esc = |s: &str| s.replace('.', "\\.");
    format!(
        "^https?://([a-z0-9-]+\\.)?{}\\.{}(:[0-9]+)?$",
        esc(sandbox),
        esc(domain)
    )
}

/// The fetch-metadata values of a request a page of another site (or of
/// another sandbox, which is the same site) sends.
const FOREIGN_SITES: [&str; 2] = ["same-site", "cross-site"];

/// A route sending `hosts` to `dial` (`host:port`), tagged `id`. With a
/// `gate`, only requests that carry its token get there: `?keystone_token=`
/// turns into a cookie of that host (and a redirect to the same path without
/// it), the cookie lets requests through, and anything else goes to
/// agentd's pages, which say how to open the link.
#[must_use]
pub fn route(id: &str, hosts: &[String], dial: &str, gate: Option<Gate<'_>>) -> Value {
    let proxy = json!({
        "handler": "reverse_proxy",
        "upstreams": [{ "dial": dial }],
    });
    let handle = match gate {
        None => proxy,
        Some(Gate {
            token,
            pages,
            sandbox,
            domain,
        }) => json!({
            "handler": "subroute",
            "routes": [
                {
                    "match": [{ "query": { TOKEN_PARAM: [token] } }],
                    "handle": [{
                        "handler": "static_response",
                        "status_code": 303,
                        "headers": {
                            "Location": ["{http.request.uri.path}"],
                            "Set-Cookie": [format!(
                                "{TOKEN_COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax"
                            )],
                            "Cache-Control": ["no-store"],
                        },
                    }],
                    "terminal": true,
                },
                {
                    // The cookie lets a request through only when it does
                    // not come from a page of another sandbox (all links
                    // are one site, so the browser sends the cookie along
                    // with such a page's requests): no Origin and no
                    // same-site or cross-site fetch metadata; or an Origin
                    // of this sandbox's links; or a top-level navigation.
                    "match": [
                        {
                            "header": { "Cookie": [format!("*{TOKEN_COOKIE}={token}*")], "Origin": null },
                            "not": [{ "header": { "Sec-Fetch-Site": FOREIGN_SITES } }],
                        },
                        {
                            "header": { "Cookie": [format!("*{TOKEN_COOKIE}={token}*")] },
                            "header_regexp": { "Origin": { "pattern": own_origins(sandbox, domain) } },
                        },
                        {
                            "header": {
                                "Cookie": [format!("*{TOKEN_COOKIE}={token}*")],
                                "Origin": null,
                                "Sec-Fetch-Mode": ["navigate"],
                                "Sec-Fetch-Dest": ["document"],
                            },
                            "method": ["GET", "HEAD"],
                        },
                    ],
                    "handle": [proxy],
                    "terminal": true,
                },
                {
                    "handle": [{
                        "handler": "reverse_proxy",
                        "upstreams": [{ "dial": pages }],
                    }],
                    "terminal": true,
                },
            ],
        }),
    };
    json!({
        "@id": id,
        "match": [{ "host": hosts }],
        "handle": [handle],
        "terminal": true,
    })
}

/// The catch-all route: everything else goes to agentd's pages at `dial`.
#[must_use]
pub fn fallback(dial: &str) -> Value {
    json!({
        "@id": FALLBACK_ID,
        "handle": [{
            "handler": "reverse_proxy",
            "upstreams": [{ "dial": dial }],
        }],
        "terminal": true,
    })
}

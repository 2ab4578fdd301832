//! agentd's own small HTTP server behind Caddy's catch-all: it answers
//! every request that no route took. For a host of a running sandbox it
//! looks for the dev server and, once routed, sends the browser back to the
//! same address; otherwise it explains: 503 for a sandbox that is not
//! running, 404 for a name nobody serves.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use keystone_agent_api::SandboxState;
use tokio::net::{TcpListener, UnixListener, UnixStream};

use super::{Proxy, names};
use crate::backend::BoxFut;

/// Most connections the pages hold at once; past it a new one is closed
/// at once.
pub(super) const CONNECTIONS_MAX: usize = 256;

/// Most connections the `/ask` port holds at once (anyone on the machine,
/// or a page in a browser, can open them; Caddy asks one at a time).
const ASK_CONNECTIONS_MAX: usize = 16;

/// How long a request waits for a sandbox that is starting.
const START_WAIT: Duration = Duration::from_secs(120);

/// How long a request's head may take to arrive, on a new or an idle
/// kept-alive connection.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one connection may last in all.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(300);

/// Serve Caddy on `listener` (a unix socket in the links directory) for
/// ever: connections from any other uid are closed at once.
pub(super) async fn serve(listener: UnixListener, proxy: Arc<Proxy>) {
    let mut full = false;
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        if !super::forward::from_caddy(&proxy, &stream, "agentd's pages") {
            continue;
        }
        let Ok(slot) = Arc::clone(&proxy.page_slots).try_acquire_owned() else {
            if !full {
                tracing::warn!(
                    "agentd's pages hold {CONNECTIONS_MAX} connections; closing new ones until some end"
                );
                full = true;
            }
            continue;
        };
        full = false;
        tokio::spawn(connection(stream, Arc::clone(&proxy), slot, Serve::Pages));
    }
}

/// Answer Caddy's connection `stream`, which a forwarder accepted, as the
/// pages would have (within their connections' limit). (Boxed: the pages
/// make routes, whose forwarders call this.)
pub(super) fn take_over(stream: UnixStream, proxy: Arc<Proxy>) -> BoxFut<'static, ()> {
    Box::pin(async move {
        if let Ok(slot) = Arc::clone(&proxy.page_slots).try_acquire_owned() {
            connection(stream, proxy, slot, Serve::Once).await;
        }
    })
}

/// Answer Caddy's `/ask` (whether to make a certificate for a name) on
/// `listener`, a loopback port, for ever; nothing else is answered there.
pub(super) async fn serve_ask(listener: TcpListener, proxy: Arc<Proxy>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(ASK_CONNECTIONS_MAX));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            continue;
        };
        tokio::spawn(connection(stream, Arc::clone(&proxy), slot, Serve::AskOnly));
    }
}

/// What one connection to the pages is answered.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Serve {
    /// Every request, as long as Caddy keeps it.
    Pages,
    /// `/ask` only.
    AskOnly,
    /// One request, then closed: a connection Caddy made to a forwarder
    /// (which it would send that route's later requests on).
    Once,
}

/// One connection to the pages, as `serve` says, bounded in time, holding
/// `slot` while it lasts.
async fn connection<S>(
    stream: S,
    proxy: Arc<Proxy>,
    slot: tokio::sync::OwnedSemaphorePermit,
    serve: Serve,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let _slot = slot;
    let service = hyper::service::service_fn(move |req| {
        let proxy = Arc::clone(&proxy);
        async move {
            Ok::<_, Infallible>(if serve == Serve::AskOnly && req.uri().path() != "/ask" {
                page(StatusCode::NOT_FOUND, "Not here", "")
            } else {
                answer(&proxy, &req).await
            })
        }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .keep_alive(serve != Serve::Once)
        .serve_connection(TokioIo::new(stream), service);
    let _ = tokio::time::timeout(CONNECTION_TIMEOUT, connection).await;
}

async fn answer(proxy: &Arc<Proxy>, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let host = req
        .headers()
        .get(hyper::header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| req.uri().host())
        .unwrap_or_default();
    let host = host
        .rsplit_once(':')
        .filter(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
        .map_or(host, |(h, _)| h)
        .trim_end_matches('.')
        .to_ascii_lowercase();
    let domain = proxy.domain().to_owned();
    // Caddy asks before it makes a certificate on demand: only for names
    // under the domain.
    if req.uri().path() == "/ask"
        && host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
    {
        let asked = req
            .uri()
            .query()
            .unwrap_or_default()
            .split('&')
            .find_map(|kv| kv.strip_prefix("domain="))
            .unwrap_or_default()
            .to_ascii_lowercase();
        let ok = names::split_host(&asked, &domain).is_some()
            || proxy.site_host().is_some_and(|h| h == asked);
        return Response::builder()
            .status(if ok {
                StatusCode::OK
            } else {
                StatusCode::FORBIDDEN
            })
            .body(Full::new(Bytes::new()))
            .expect("a valid response");
    }
    let Some((sandbox, _)) = names::split_host(&host, &domain) else {
        return page(
            StatusCode::NOT_FOUND,
            "Not a sandbox address",
            &format!(
                "<p><code>{}</code> is not a sandbox name under <code>{}</code>.</p>\
                 <p>Dev-server links look like <code>BRANCH.SANDBOX.{}</code> and \
                 <code>SANDBOX.{}</code> (the main worktree).</p>",
                esc(&host),
                esc(&domain),
                esc(&domain),
                esc(&domain)
            ),
        );
    };
    // A link answers its owner only: without the sandbox's token (in the
    // query, or as the cookie it turns into) nothing here says whether the
    // sandbox exists, runs or serves anything.
    let token = proxy.token(sandbox);
    if proxy.gated() && !from_its_own_pages(req, sandbox, &domain) {
        // The route's matchers sent it here (docs/architecture.md, "Links and
        // the browser"): say nothing more.
        return page(
            StatusCode::FORBIDDEN,
            "Request from another site refused",
            "<p>A link answers requests from its own pages and navigations, not requests \
             that pages of other sites or other sandboxes make.</p>",
        );
    }
    if proxy.gated() && !token.as_deref().is_some_and(|t| carries_token(req, t)) {
        return page(
            StatusCode::FORBIDDEN,
            "Private link",
            &format!(
                "<p>Dev-server links answer only their owner. Open this one with \
                 <code>agentctl open SANDBOX [BRANCH]</code>, or use a URL that \
                 <code>agentctl ports SANDBOX</code> prints: it carries a token that \
                 this browser then keeps for <code>{}</code>.</p>",
                esc(&host)
            ),
        );
    }
    let Some(mut sb) = proxy.sandboxes.snapshot(sandbox).filter(|s| !s.creating) else {
        return page(
            StatusCode::NOT_FOUND,
            "No such sandbox",
            &format!(
                "<p>There is no sandbox named <code>{}</code> under <code>{}</code>.</p>\
                 <p><code>agentctl list</code> shows the sandboxes.</p>",
                esc(sandbox),
                esc(&domain)
            ),
        );
    };
    // Stopped when idle: its owner's request (the token says so) starts
    // it again, as an exec would; not one that a page of another site (or
    // of another sandbox) sent the browser on, which carries the cookie too.
    let mut notice = String::new();
    if proxy.gated()
        && sb.state == SandboxState::Stopped
        && sb.idle_stopped
        && !from_another_site(req)
    {
        if let Some(woken) = Arc::clone(&proxy.sandboxes).wake(sb.name.clone()).await {
            if woken.state == SandboxState::Running {
                // A guest whose memory was kept goes on where it was.
                let kept = woken
                    .runtime
                    .as_ref()
                    .is_some_and(|rt| rt.limits.contains("restored with its memory"));
                notice = format!(
                    "<p>Sandbox <code>{}</code> had been stopped when idle; agentd started it \
                     again. {}</p>",
                    esc(&woken.name),
                    if kept {
                        "Its memory was kept: its processes went on where they were."
                    } else {
                        "Its processes started anew."
                    }
                );
            }
            sb = woken;
        }
    }
    // Starting (another request of the owner's woke it a moment ago): its
    // answer once it has started, not a page that says it does not run.
    let settle = Instant::now() + START_WAIT;
    while sb.state == SandboxState::Starting && Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(100)).await;
        match proxy.sandboxes.snapshot(sandbox).filter(|s| s.id == sb.id) {
            Some(now) => sb = now,
            None => break,
        }
    }
    if sb.state != SandboxState::Running {
        let reason = if sb.state_reason.is_empty() {
            String::new()
        } else {
            format!("<p>Reason: {}</p>", esc(&sb.state_reason))
        };
        let (verb, cmd) = if sb.state == SandboxState::Paused {
            ("Resume", "resume")
        } else {
            ("Start", "start")
        };
        return page(
            StatusCode::SERVICE_UNAVAILABLE,
            "Sandbox not running",
            &format!(
                "<p>Sandbox <code>{name}</code> is <strong>{state}</strong>.</p>{reason}\
                 <p>{verb} it with <code>agentctl {cmd} {name}</code>, then reload this page.</p>",
                name = esc(&sb.name),
                state = sb.state,
            ),
        );
    }
    // Routed already: Caddy lost the route (restart, reload). Otherwise:
    // look for the dev server now.
    let mut found = None;
    let routed = if proxy.routed(&host).await {
        proxy.stale.store(true, std::sync::atomic::Ordering::SeqCst);
        proxy.apply_all().await.is_ok()
    } else {
        let routes = match found {
            Some(r) => r,
            None => proxy.sync(&sb.name).await.unwrap_or_default(),
        };
        let routed = routes.iter().any(|r| r.host == host);
        found = Some(routes);
        routed
    };
    if routed && !proxy.may_redirect(&host) {
        return page(
            StatusCode::BAD_GATEWAY,
            "Route not taken",
            &format!(
                "<p>agentd gave Caddy a route for <code>{}</code>, but requests still arrive \
                 here. agentd's log says why.</p>",
                esc(&host)
            ),
        );
    }
    if routed {
        let target = req
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        return Response::builder()
            .status(StatusCode::TEMPORARY_REDIRECT)
            .header(hyper::header::LOCATION, target)
            .header(hyper::header::CACHE_CONTROL, "no-store")
            .body(Full::new(Bytes::new()))
            .expect("a valid response");
    }
    let routes = match found {
        Some(r) => r,
        None => proxy.sync(&sb.name).await.unwrap_or_default(),
    };
    let list = if routes.is_empty() {
        "<p>Nothing in it listens on a TCP port now.</p>".to_owned()
    } else {
        let items: String = routes
            .iter()
            .map(|r| {
                format!(
                    "<li><a href=\"{u}\">{h}</a> — port {p}, branch {b}</li>",
                    u = esc(&r.url),
                    h = esc(&r.host),
                    p = r.port,
                    b = esc(&r.branch)
                )
            })
            .collect();
        format!("<p>Its dev servers:</p><ul>{items}</ul>")
    };
    page(
        StatusCode::NOT_FOUND,
        "No dev server here",
        &format!(
            "{notice}<p>No dev server of sandbox <code>{name}</code> answers to <code>{host}</code>. \
             Start one in the worktree (<code>agentctl attach {name} BRANCH</code>, then e.g. \
             <code>npm run dev</code>) and reload.</p>{list}\
             <p><code>agentctl ports {name}</code> lists its links.</p>",
            name = esc(&sb.name),
            host = esc(&host),
        ),
    )
}

/// Whether `req` may use a link of sandbox `sandbox`'s token: the same
/// rule as the cookie's matchers in Caddy's route ([`super::caddy::route`]).
/// A page of another sandbox is the same site to the browser, which sends
/// the link's cookie with its requests; such a request says where it comes
/// from in `Origin` (any that may change something) or `Sec-Fetch-Site`.
fn from_its_own_pages(req: &Request<Incoming>, sandbox: &str, domain: &str) -> bool {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .map(|v| v.to_str().unwrap_or("\u{fffd}").to_ascii_lowercase())
    };
    let origin = header("origin");
    if let Some(origin) = &origin {
        return own_origin(origin, sandbox, domain);
    }
    let foreign_site =
        header("sec-fetch-site").is_some_and(|s| s == "same-site" || s == "cross-site");
    let navigation = header("sec-fetch-mode").as_deref() == Some("navigate")
        && header("sec-fetch-dest").as_deref() == Some("document")
        && matches!(*req.method(), hyper::Method::GET | hyper::Method::HEAD);
    !foreign_site || navigation
}

/// Whether the browser says `req` comes from a page of another site
/// (`Sec-Fetch-Site: same-site` or `cross-site`: every sandbox's links are
/// the same site to it).
fn from_another_site(req: &Request<Incoming>) -> bool {
    req.headers()
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes() != b"none" && v.as_bytes() != b"same-origin")
}

/// Whether `origin` is one of sandbox `sandbox`'s links (as
/// [`super::caddy::own_origins`] matches it).
fn own_origin(origin: &str, sandbox: &str, domain: &str) -> bool {
    let Some(rest) = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"))
    else {
        return false;
    };
    let host = rest
        .rsplit_once(':')
        .filter(|(_, p)| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        .map_or(rest, |(h, _)| h);
    let Some(below) = host.strip_suffix(&format!(".{domain}")) else {
        return false;
    };
    below == sandbox
        || below
            .strip_suffix(&format!(".{sandbox}"))
            .is_some_and(|label| {
                !label.is_empty()
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            })
}

/// Whether `req` carries `token`, in the query or in the link's cookie.
fn carries_token(req: &Request<Incoming>, token: &str) -> bool {
    use super::caddy::{TOKEN_COOKIE, TOKEN_PARAM};
    let in_query = req.uri().query().is_some_and(|q| {
        q.split('&')
            .any(|kv| kv.split_once('=') == Some((TOKEN_PARAM, token)))
    });
    let in_cookie = req
        .headers()
        .get_all(hyper::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .any(|c| c.trim().split_once('=') == Some((TOKEN_COOKIE, token)));
    in_query || in_cookie
}

fn page(status: StatusCode, title: &str, body: &str) -> Response<Full<Bytes>> {
    let html = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title>\
         <style>body{{font-family:sans-serif;max-width:40em;margin:4em auto;line-height:1.5}}\
         code{{background:#eee;padding:0 .2em}}</style></head>\
         <body><h1>{title}</h1>{body}<hr><small>keystone-agent</small></body></html>\n"
    );
    Response::builder()
        .status(status)
        .header(hyper::header::CONTENT_TYPE, "text/html; charset=utf-8")
        .header(hyper::header::CACHE_CONTROL, "no-store")
        .body(Full::new(Bytes::from(html)))
        .expect("a valid response")
}

/// HTML-escape `s`.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_sandboxs_own_links_are_its_origins() {
        let own = |o| own_origin(o, "a", "sandbox.local");
        assert!(own("https://a.sandbox.local"));
        assert!(own("https://main.a.sandbox.local"));
        assert!(own("http://3000-main.a.sandbox.local:8080"));
        assert!(!own("https://main.b.sandbox.local"));
        assert!(!own("https://b.sandbox.local"));
        assert!(!own("https://x.y.a.sandbox.local"));
        assert!(!own("https://main.a.sandbox.local.evil.test"));
        assert!(!own("https://evila.sandbox.local"));
        assert!(!own("null"));
        assert!(!own("ftp://a.sandbox.local"));
        // The same rule as Caddy's matcher.
        let re = super::super::caddy::own_origins("a", "sandbox.local");
        assert_eq!(re, r"^https?://([a-z0-9-]+\.)?a\.sandbox\.local(:[0-9]+)?$");
    }
}

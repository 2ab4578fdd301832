//! The console's HTTP side: the login, the page and its code, the events
//! WebSocket, each behind the checks of [`super`]'s description.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use super::auth::{self, Session};
use super::{Door, Via};
use crate::sandbox::manager::Manager;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

/// How long a client may take to send a request's head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one connection (its requests and answers, not a WebSocket it
/// became) may last: a client that stops reading an answer frees its slot
/// by then.
const CONNECTION_MAX: Duration = Duration::from_secs(120);

/// The page and its code: the project's own, compiled into agentd.
const INDEX_HTML: &str = include_str!("../../share/console/index.html");
const CONSOLE_JS: &str = include_str!("../../share/console/console.js");
const CONSOLE_CSS: &str = include_str!("../../share/console/console.css");

/// What every answer says about itself: no script but the console's own
/// files, no framing, no sniffing, nothing cached, no referrer. (Styles
/// may be inline: xterm.js sizes its rows with `<style>` elements it
/// makes. Nothing from a sandbox is ever markup, so no one else's style
/// can get into the page.)
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
                   connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

/// Largest file of the terminal's code agentd serves.
const FILE_MAX: u64 = 2 << 20;

/// Serve one connection that came `via` the loopback door or Caddy.
pub(super) async fn connection<S>(stream: S, via: Via, door: Arc<Door>, manager: Arc<Manager>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let (door, manager) = (Arc::clone(&door), Arc::clone(&manager));
        async move { Ok::<_, Infallible>(answer(req, via, &door, &manager).await) }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    // (A WebSocket goes its own way once upgraded, with its own bounds.)
    let _ = tokio::time::timeout(CONNECTION_MAX, connection).await;
}

/// The answer to `req`, which came `via` the loopback door or Caddy.
async fn answer(
    req: Request<Incoming>,
    via: Via,
    door: &Arc<Door>,
    manager: &Arc<Manager>,
) -> Response<Full<Bytes>> {
    // The browser must have asked for the console itself: a page of
    // another name that resolves to loopback gets nothing (DNS rebinding).
    if !own_host(&req, via, door) {
        return page(
            StatusCode::MISDIRECTED_REQUEST,
            "This is not the console's address.",
        );
    }
    let path = req.uri().path().to_owned();
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/login") => login(&req, via, door),
        (Method::GET, "/begin") if via == Via::Site => begin(&req, door),
        (Method::GET, "/console.js") => asset("text/javascript; charset=utf-8", CONSOLE_JS),
        (Method::GET, "/console.css") => asset("text/css; charset=utf-8", CONSOLE_CSS),
        // (For the console's own pages: reading the cache is agentd's
        // work, not anyone's to ask for.)
        (Method::GET, p) if p.starts_with("/xterm/") => match session(&req, via, door) {
            Some(_) => terminal_code(&p["/xterm/".len()..], door),
            None => page(StatusCode::UNAUTHORIZED, "Not logged in."),
        },
        (Method::GET, "/") => match session(&req, via, door).map(|(s, _)| s) {
            Some(_) => asset("text/html; charset=utf-8", INDEX_HTML),
            None => page(
                StatusCode::UNAUTHORIZED,
                "Not logged in. Open the console with `agentctl console`: it logs you in.",
            ),
        },
        (Method::GET, "/api/session") => match session(&req, via, door).map(|(s, _)| s) {
            Some(s) => json(&serde_json::json!({"uid": s.uid, "csrf": s.csrf})),
            None => page(StatusCode::UNAUTHORIZED, "Not logged in."),
        },
        (Method::GET, "/api/events") => match socket_session(&req, via, door, "a WebSocket") {
            Ok(s) => super::events::upgrade(req, s, Arc::clone(door), Arc::clone(manager)),
            Err(refused) => *refused,
        },
        (Method::GET, "/api/terminal") => {
            let (s, cookie) = match socket_session(&req, via, door, "a terminal") {
                Ok(s) => s,
                Err(refused) => return *refused,
            };
            let Some(target) = super::terminal::Target::parse(req.uri().query().unwrap_or(""))
            else {
                return page(
                    StatusCode::BAD_REQUEST,
                    "Name a sandbox: /api/terminal?sandbox=NAME[&branch=BRANCH][&shell=1]",
                );
            };
            super::terminal::upgrade(
                req,
                (s, cookie),
                target,
                Arc::clone(door),
                Arc::clone(manager),
            )
        }
        (Method::GET, "/api/sandbox" | "/api/record") | (Method::POST, "/api/egress") => {
            let Some((s, _)) = session(&req, via, door) else {
                return page(StatusCode::UNAUTHORIZED, "Not logged in.");
            };
            // The page's token in a header of its own: a page of another
            // origin cannot send one without asking first (CORS), and is
            // never told yes.
            let posted = req.method() == Method::POST;
            if !carries_csrf(&req, &s) || (posted && !own_origin(&req, via, door)) {
                tracing::warn!(origin = ?req.headers().get(header::ORIGIN), "web console: refused a request without the page's origin and token");
                return page(StatusCode::FORBIDDEN, "Not from the console's own page.");
            }
            sandbox_api(&path, req.uri().query().unwrap_or(""), s.uid, manager).await
        }
        (Method::POST, "/api/logout") => {
            let Some((s, cookie)) = session(&req, via, door) else {
                return page(StatusCode::UNAUTHORIZED, "Not logged in.");
            };
            if !own_origin(&req, via, door) || !carries_csrf(&req, &s) {
                tracing::warn!(origin = ?req.headers().get(header::ORIGIN), "web console: refused a request without the page's origin and token");
                return page(StatusCode::FORBIDDEN, "Not from the console's own page.");
            }
            door.auth.close(&cookie);
            let mut r = page(StatusCode::OK, "Logged out.");
            r.headers_mut().insert(
                header::SET_COOKIE,
                HeaderValue::from_str(&session_cookie(via, "", 0)).expect("a plain cookie"),
            );
            r
        }
        _ => page(StatusCode::NOT_FOUND, "Not here."),
    }
}

/// Largest record the page plays (a longer one: `agentctl replay`).
const RECORD_MAX: u64 = 8 << 20;

/// `/api/sandbox`, `/api/record` and `/api/egress` for `uid`, each about
/// one of its sandboxes.
async fn sandbox_api(
    path: &str,
    query: &str,
    uid: u32,
    manager: &Manager,
) -> Response<Full<Bytes>> {
    use super::api::param;
    let caller = crate::auth::Caller { uid };
    let name = param(query, "name")
        .or_else(|| param(query, "sandbox"))
        .unwrap_or_default();
    let result = match path {
        "/api/sandbox" => super::api::details(manager, caller, &name)
            .await
            .map(|v| json(&v)),
        "/api/record" => {
            // Four records read at once at most (the body is held until
            // the page has it), off the async workers.
            static READING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(4);
            let Ok(_reading) = READING.try_acquire() else {
                return json_status(
                    StatusCode::TOO_MANY_REQUESTS,
                    &serde_json::json!({"error": "Other records are being played: try again in a moment"}),
                );
            };
            let id = param(query, "id").unwrap_or_default();
            match manager.open_record(caller, &name, &id) {
                Ok(fd) => {
                    let read = tokio::task::spawn_blocking(move || {
                        use std::io::Read;
                        let mut text = Vec::new();
                        std::fs::File::from(fd)
                            .take(RECORD_MAX + 1)
                            .read_to_end(&mut text)
                            .ok()
                            .filter(|_| text.len() as u64 <= RECORD_MAX)
                            .map(|_| text)
                    })
                    .await
                    .ok()
                    .flatten();
                    Ok(match read {
                        Some(text) => respond(
                            StatusCode::OK,
                            "text/plain; charset=utf-8",
                            Bytes::from(text),
                        ),
                        None => json_status(
                            StatusCode::PAYLOAD_TOO_LARGE,
                            &serde_json::json!({"error": format!(
                                "This record is larger than the console plays ({} MiB): `agentctl replay {name} {id}`",
                                RECORD_MAX >> 20
                            )}),
                        ),
                    })
                }
                Err(e) => Err(e),
            }
        }
        _ => {
            let id = param(query, "id").and_then(|i| i.parse().ok()).unwrap_or(0);
            let decision = param(query, "decision").unwrap_or_default();
            let admits = param(query, "admits").unwrap_or_default();
            let d = super::api::Decision {
                sandbox: &name,
                id,
                admits: &admits,
                decision: &decision,
            };
            super::api::decide(manager, caller, &d)
                .map(|done| json(&serde_json::json!({"done": done})))
        }
    };
    result.unwrap_or_else(|e| {
        use crate::error::Error;
        let status = match e {
            Error::NotFound(_) | Error::Missing(_) => StatusCode::NOT_FOUND,
            Error::Invalid(_) => StatusCode::BAD_REQUEST,
            _ => StatusCode::CONFLICT,
        };
        json_status(status, &serde_json::json!({"error": e.to_string()}))
    })
}

fn json_status(status: StatusCode, v: &serde_json::Value) -> Response<Full<Bytes>> {
    respond(status, "application/json", Bytes::from(v.to_string()))
}

/// `GET /xterm/NAME`: a file of the terminal's code, from the toolbox's
/// cache (agentd downloads it with the agents, at the version and digest
/// the project pins).
fn terminal_code(name: &str, door: &Door) -> Response<Full<Bytes>> {
    use std::io::Read;
    let kind = if name.ends_with(".css") {
        "text/css; charset=utf-8"
    } else {
        "text/javascript; charset=utf-8"
    };
    let Some(path) = door.toolbox.as_ref().and_then(|t| t.console_file(name)) else {
        return page(StatusCode::NOT_FOUND, "Not here.");
    };
    let mut bytes = Vec::new();
    let read =
        std::fs::File::open(&path).and_then(|f| f.take(FILE_MAX + 1).read_to_end(&mut bytes));
    if read.is_err() || bytes.len() as u64 > FILE_MAX {
        return page(
            StatusCode::NOT_FOUND,
            "The terminal's code (xterm.js) is not installed yet: agentd downloads it when it starts, or run `agentd --install-agents`.",
        );
    }
    respond(StatusCode::OK, kind, Bytes::from(bytes))
}

/// `GET /login`: at the loopback door, `?token=…` (valid, unused and the
/// connecting process's own) becomes a session cookie, or, when the
/// console is served through Caddy, a ticket to its HTTPS name; there,
/// `?ticket=…` becomes a session cookie of that name.
fn login(req: &Request<Incoming>, via: Via, door: &Door) -> Response<Full<Bytes>> {
    let query = req.uri().query().unwrap_or("");
    let param = |name: &str| super::api::param(query, name);
    // The nonce of the login under way: at the door, as `/begin` passed
    // it on; on the HTTPS name, in the browser's cookie.
    let nonce = match via {
        Via::Loopback(_) => param("nonce").unwrap_or_default().to_owned(),
        Via::Site => auth::cookies(
            req.headers()
                .get_all(header::COOKIE)
                .iter()
                .filter_map(|v| v.to_str().ok()),
            auth::NONCE_COOKIE,
        )
        .next()
        .unwrap_or_default()
        .to_owned(),
    };
    let nonce_ok = nonce.len() == 64 && nonce.bytes().all(|b| b.is_ascii_hexdigit());
    let uid = match via {
        // Through Caddy, the way in starts on the HTTPS name.
        Via::Loopback(_) if door.site.is_some() && !nonce_ok => None,
        Via::Loopback(uid) => param("token")
            .is_some_and(|t| door.auth.redeem(&t, uid))
            .then_some(uid),
        Via::Site if !nonce_ok => None,
        Via::Site => param("ticket").and_then(|t| door.auth.redeem_ticket(&t, &nonce)),
    };
    let Some(uid) = uid else {
        tracing::warn!(
            ?via,
            "web console: refused a login link (expired, used already, or another user's)"
        );
        return page(
            StatusCode::FORBIDDEN,
            "This console link has expired, was used already, or is not yours. Run `agentctl console` again.",
        );
    };
    // A sandbox name is [a-z0-9-]; anything else is dropped.
    let sandbox = param("sandbox").filter(|n| {
        !n.is_empty()
            && n.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    });
    if let (Via::Loopback(_), Some(site)) = (via, &door.site) {
        // On to the HTTPS name, with a ticket only this browser has: it
        // is in no command line, only in this answer.
        let mut to = format!("{site}/login?ticket={}", door.auth.ticket(uid, &nonce));
        if let Some(n) = sandbox {
            to.push_str("&sandbox=");
            to.push_str(&n);
        }
        let mut r = page(StatusCode::SEE_OTHER, "On to the console.");
        r.headers_mut().insert(
            header::LOCATION,
            HeaderValue::from_str(&to).expect("a plain URL"),
        );
        return r;
    }
    let cookie = door.auth.open(uid, via == Via::Site);
    let target = sandbox.map_or_else(|| "/".to_owned(), |n| format!("/#{n}"));
    tracing::info!(uid, ?via, "web console: logged in");
    let mut r = match via {
        Via::Loopback(_) => {
            let mut r = page(StatusCode::SEE_OTHER, "Logged in.");
            r.headers_mut().insert(
                header::LOCATION,
                HeaderValue::from_str(&target).expect("a plain path"),
            );
            r
        }
        // The browser came here from another site (the loopback door): a
        // redirect would still be part of that cross-site navigation, which
        // a `SameSite=Strict` cookie is not sent with. A page of the
        // console's own that moves on is not.
        Via::Site => respond(
            StatusCode::OK,
            "text/html; charset=utf-8",
            Bytes::from(format!(
                "<!doctype html><meta http-equiv=\"refresh\" content=\"0;url={target}\"><title>Keystone Agent</title><p>Logged in.</p>"
            )),
        ),
    };
    r.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_str(&session_cookie(via, &cookie, auth::SESSION_IDLE.as_secs()))
            .expect("a plain cookie"),
    );
    if via == Via::Site {
        r.headers_mut().append(
            header::SET_COOKIE,
            HeaderValue::from_str(&nonce_cookie("", 0)).expect("a plain cookie"),
        );
    }
    r
}

/// `GET /begin?token=…` on the HTTPS name: a login starts here. The
/// browser gets a nonce cookie of this name and goes on to the loopback
/// door with the token and the nonce; the door's ticket comes back bound
/// to that nonce. (The token is checked at the door, where agentd knows
/// who connected.)
fn begin(req: &Request<Incoming>, door: &Door) -> Response<Full<Bytes>> {
    let query = req.uri().query().unwrap_or("");
    // A token is hex; a sandbox name is [a-z0-9-]: only they go on.
    let plain = |v: &&str| {
        !v.is_empty()
            && v.len() <= 64
            && v.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    };
    let param = |name: &str| super::api::param(query, name).filter(|v| plain(&v.as_str()));
    let Some(token) = param("token") else {
        return page(
            StatusCode::BAD_REQUEST,
            "Open the console with `agentctl console`: it logs you in.",
        );
    };
    let nonce = auth::Auth::nonce();
    let mut to = format!(
        "{}/login?token={token}&nonce={nonce}",
        door.origin_of(Via::Loopback(0))
    );
    if let Some(n) = param("sandbox") {
        to.push_str("&sandbox=");
        to.push_str(&n);
    }
    let mut r = page(StatusCode::SEE_OTHER, "On to agentd's door.");
    let h = r.headers_mut();
    h.insert(
        header::LOCATION,
        HeaderValue::from_str(&to).expect("a plain URL"),
    );
    h.insert(
        header::SET_COOKIE,
        HeaderValue::from_str(&nonce_cookie(&nonce, auth::TOKEN_TTL.as_secs()))
            .expect("a plain cookie"),
    );
    r
}

/// The `Set-Cookie` value of a login's `nonce` for `max_age` seconds (0:
/// gone). `Lax`: the browser comes back to the HTTPS name from the door,
/// another site, and must bring it along.
fn nonce_cookie(nonce: &str, max_age: u64) -> String {
    format!(
        "{}={nonce}; Secure; HttpOnly; SameSite=Lax; Path=/; Max-Age={max_age}",
        auth::NONCE_COOKIE
    )
}

/// The `Set-Cookie` value of session `cookie` for `max_age` seconds (0:
/// gone), on the loopback door or on the HTTPS name (`Secure`, and a
/// `__Host-` name the browser keeps to that host).
fn session_cookie(via: Via, cookie: &str, max_age: u64) -> String {
    match via {
        Via::Loopback(_) => format!(
            "{}={cookie}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age}",
            auth::COOKIE
        ),
        Via::Site => format!(
            "{}={cookie}; Secure; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age}",
            auth::HTTPS_COOKIE
        ),
    }
}

/// The session of `req`'s cookie and the cookie, if it is one of the way
/// it came: at the loopback door, a session opened there and of the
/// process at the other end (someone else's cookie is no one's); through
/// Caddy, one opened on the HTTPS name. (Each cookie of the name is
/// tried: another service of the host may have set one too.)
fn session(req: &Request<Incoming>, via: Via, door: &Door) -> Option<(Session, String)> {
    let name = match via {
        Via::Loopback(_) => auth::COOKIE,
        Via::Site => auth::HTTPS_COOKIE,
    };
    let values = auth::cookies(
        req.headers()
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok()),
        name,
    );
    for value in values {
        let Some(s) = door.auth.session(value) else {
            continue;
        };
        let good = match via {
            Via::Loopback(uid) => s.uid == uid && !s.https,
            Via::Site => s.https,
        };
        if good {
            return Some((s, value.to_owned()));
        }
        tracing::debug!(
            ?via,
            owner = s.uid,
            "web console: refused a session cookie used by another uid, or another way in"
        );
    }
    None
}

/// The session of a WebSocket upgrade (`what` it opens, for the log):
/// the cookie's, from the console's own page; else the refusal.
fn socket_session(
    req: &Request<Incoming>,
    via: Via,
    door: &Door,
    what: &str,
) -> Result<(Session, String), Box<Response<Full<Bytes>>>> {
    let Some(s) = session(req, via, door) else {
        return Err(Box::new(page(StatusCode::UNAUTHORIZED, "Not logged in.")));
    };
    if !own_origin(req, via, door) {
        tracing::warn!(origin = ?req.headers().get(header::ORIGIN), "web console: refused {what} from another origin");
        return Err(Box::new(page(
            StatusCode::FORBIDDEN,
            "Not from the console's own page.",
        )));
    }
    Ok(s)
}

/// Whether `req` names the console as it came (`Host`): its loopback
/// address (`127.0.0.1:PORT`; not `localhost`, which another uid may
/// serve at that port over IPv6), or its HTTPS name.
fn own_host(req: &Request<Incoming>, via: Via, door: &Door) -> bool {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok());
    host.is_some_and(|h| {
        let origin = door.origin_of(via);
        origin.split_once("://").is_some_and(|(_, own)| own == h)
    })
}

/// Whether `req` comes from one of the console's own pages (`Origin`) of
/// the way it came.
fn own_origin(req: &Request<Incoming>, via: Via, door: &Door) -> bool {
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|h| h.to_str().ok());
    origin.is_some_and(|o| o == door.origin_of(via))
}

/// Whether `req` carries the session's CSRF token.
fn carries_csrf(req: &Request<Incoming>, s: &Session) -> bool {
    req.headers()
        .get("x-keystone-csrf")
        .and_then(|h| h.to_str().ok())
        .is_some_and(|t| t == s.csrf)
}

/// An answer with the console's headers.
pub(super) fn respond(
    status: StatusCode,
    kind: &'static str,
    body: Bytes,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
    h.insert(
        "cross-origin-resource-policy",
        HeaderValue::from_static("same-origin"),
    );
    r
}

fn asset(kind: &'static str, text: &'static str) -> Response<Full<Bytes>> {
    respond(StatusCode::OK, kind, Bytes::from_static(text.as_bytes()))
}

fn json(v: &serde_json::Value) -> Response<Full<Bytes>> {
    json_status(StatusCode::OK, v)
}

/// A page of plain text (never markup: nothing in it is rendered).
/// A refusal also ends the connection: a client that is refused holds no
/// slot by asking again on it.
fn page(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut r = respond(
        status,
        "text/plain; charset=utf-8",
        Bytes::from_static(text.as_bytes()),
    );
    if status.is_client_error() {
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    r
}

//! The console's WebSockets: the upgrade of a request (after the checks
//! of [`super::http`]), each socket holding a slot of its own, of
//! [`super::SOCKETS_MAX`] and of its uid's [`super::SOCKETS_PER_UID`].

use std::future::Future;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::upgrade::Upgraded;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};

/// A WebSocket of the console.
pub(super) type Socket = WebSocketStream<TokioIo<Upgraded>>;

/// Whom a socket serves: the session's owner and token, for as long as
/// the session lives.
pub(super) struct Who {
    /// The session's owner.
    pub caller: crate::auth::Caller,
    /// The session's CSRF token, which the page shows and is shown.
    pub proof: String,
    door: Arc<super::Door>,
    cookie: String,
}

impl Who {
    /// Whether the session still lives (not logged out, not ended).
    pub(super) fn alive(&self) -> bool {
        self.door
            .auth
            .session(&self.cookie)
            .is_some_and(|s| s.uid == self.caller.uid)
    }
}

/// Largest message or frame agentd reads from a page.
pub(super) const READ_MAX: usize = 16 << 10;

/// Answer `req` (of the session of `cookie`) with a WebSocket upgrade
/// whose socket `serve` serves; a refusal when it is not one, or when too
/// many are open.
pub(super) fn upgrade<F, Fut>(
    mut req: Request<Incoming>,
    (session, cookie): (super::auth::Session, String),
    door: Arc<super::Door>,
    serve: F,
) -> Response<Full<Bytes>>
where
    F: FnOnce(Socket, Who) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let uid = session.uid;
    let h = req.headers();
    let is = |name: header::HeaderName, want: &str| {
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.split(',').any(|p| p.trim().eq_ignore_ascii_case(want)))
    };
    let (Some(key), true, true, true) = (
        h.get(header::SEC_WEBSOCKET_KEY).cloned(),
        is(header::UPGRADE, "websocket"),
        is(header::CONNECTION, "upgrade"),
        is(header::SEC_WEBSOCKET_VERSION, "13"),
    ) else {
        return super::http::respond(
            StatusCode::BAD_REQUEST,
            "text/plain; charset=utf-8",
            Bytes::from_static(b"A WebSocket upgrade is expected here."),
        );
    };
    // A slot of its own: the socket outlives the connection's.
    let (all, by_uid) = &door.sockets;
    let (Ok(slot), Some(mine)) = (
        Arc::clone(all).try_acquire_owned(),
        by_uid.take(uid, super::SOCKETS_PER_UID),
    ) else {
        return super::http::respond(
            StatusCode::TOO_MANY_REQUESTS,
            "text/plain; charset=utf-8",
            Bytes::from_static(b"Too many console pages and terminals are open."),
        );
    };
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    let upgraded = hyper::upgrade::on(&mut req);
    let who = Who {
        caller: crate::auth::Caller { uid },
        proof: session.csrf,
        door,
        cookie,
    };
    tokio::spawn(async move {
        let _held = (slot, mine);
        let Ok(io) = upgraded.await else { return };
        let config = WebSocketConfig::default()
            .read_buffer_size(4096)
            .max_message_size(Some(READ_MAX))
            .max_frame_size(Some(READ_MAX));
        let ws =
            WebSocketStream::from_raw_socket(TokioIo::new(io), Role::Server, Some(config)).await;
        serve(ws, who).await;
    });
    let mut r = super::http::respond(StatusCode::SWITCHING_PROTOCOLS, "text/plain", Bytes::new());
    let h = r.headers_mut();
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(
        header::SEC_WEBSOCKET_ACCEPT,
        HeaderValue::from_str(&accept).expect("base64"),
    );
    r
}

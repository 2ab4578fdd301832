//! The secret-swapping path of the gateway ([`crate::secrets`]): for a
//! CONNECT to a host that carries a secret of the sandbox, the gateway ends
//! the sandbox's TLS with a certificate from the sandbox's own CA, opens its
//! own TLS to the host (its certificate checked against the host's trusted
//! roots, as any client would), and relays HTTP/1.1 in both directions:
//!
//! - requests: in the secret's header only, the placeholder becomes the
//!   value; each must be for the host (its `Host`, an origin-form target)
//!   and framed without ambiguity ([`framing`]), or the connection ends;
//! - responses: every occurrence of a value, and of the forms a host may
//!   echo it in ([`mask_forms`]), is masked (`*` for each byte) before the
//!   sandbox sees it; a chunked body is masked as the data it carries and
//!   re-chunked; requests go without `Accept-Encoding` (nor WebSocket
//!   compression), so that answers come uncompressed, and a compressed
//!   body ends the connection unseen.
//!
//! Only HTTP/1.1 is offered (ALPN). A request that asks for an `Upgrade`
//! (WebSocket) and is answered `101 Switching Protocols` continues as raw
//! bytes, masked the same way towards the sandbox; answered otherwise, the
//! connection stays HTTP and every request on it is checked as before. A
//! 101 to a request that asked for no upgrade ends the connection.

use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use super::gateway::HEAD_MAX;
use super::mask::{Masked, mask_forms};
use super::strict::{Body, Refusal, check_target, framing};

/// Why an intercepted connection ended early.
#[derive(Debug, thiserror::Error)]
pub enum InterceptError {
    /// The TLS configurations could not be made.
    #[error("TLS setup: {0}")]
    Setup(#[source] rustls::Error),
    /// The sandbox's TLS handshake failed.
    #[error("the sandbox's TLS: {0}")]
    SandboxTls(#[source] std::io::Error),
    /// The host is not a name a certificate can be checked for.
    #[error("'{0}' is not a TLS server name")]
    ServerName(String),
    /// The TLS handshake with the host failed (its certificate included).
    #[error("TLS to {host}: {source}")]
    HostTls {
        /// The host.
        host: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A message broke the rules of [`super::strict`].
    #[error(transparent)]
    Refused(#[from] Refusal),
}

/// What the gateway calls with the host and port of a CONNECT: the secrets
/// to swap in it, if any.
pub type Intercept = Box<dyn Fn(&str, u16) -> Option<Plan> + Send + Sync>;

/// One secret as the gateway applies it.
#[derive(Clone)]
pub struct Swap {
    /// The header (lowercase).
    pub header: String,
    /// What the sandbox sends.
    pub placeholder: String,
    /// What the host gets.
    pub value: String,
}

impl std::fmt::Debug for Swap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Swap")
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

/// What the gateway calls with each push to a forge's repository: the
/// repository, whether it went on, and the refs with what was decided.
pub type Pushed = Box<dyn Fn(&super::forge::Rule, bool, String) + Send + Sync>;

/// How to intercept one connection.
pub struct Plan {
    /// The host (the certificate's name, and the one checked upstream).
    pub host: String,
    /// The secrets for it.
    pub swaps: Vec<Swap>,
    /// The repositories on it the sandbox may push to
    /// ([`super::forge`]).
    pub forges: Vec<super::forge::Rule>,
    /// Told of every push to one of them.
    pub pushed: Option<Pushed>,
    /// The certificate chain and key shown to the sandbox.
    pub leaf: (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>),
    /// Roots the host's certificate is checked against.
    pub roots: Arc<rustls::RootCertStore>,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan")
            .field("host", &self.host)
            .field("swaps", &self.swaps)
            .field("forges", &self.forges)
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The roots agentd trusts for hosts: the system's store (`SSL_CERT_FILE`
/// and `SSL_CERT_DIR` are honoured, as by OpenSSL).
#[must_use]
pub fn system_roots() -> Arc<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for e in &found.errors {
        tracing::warn!(error = %e, "egress gateway: a trusted root could not be read");
    }
    let (added, _) = roots.add_parsable_certificates(found.certs);
    tracing::debug!(roots = added, "egress gateway: trusted roots loaded");
    Arc::new(roots)
}

/// Relay `client` (after its CONNECT was answered) and `upstream` through
/// TLS on both sides with the secrets of `plan`; (bytes from the client,
/// bytes to the client, why it ended early).
pub async fn intercept<C, U>(
    client: C,
    upstream: U,
    plan: Plan,
) -> (u64, u64, Option<InterceptError>)
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
    U: AsyncRead + AsyncWrite + Unpin + Send,
{
    let (certs, key) = plan.leaf;
    let server = match rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(certs, key))
    {
        Ok(mut c) => {
            c.alpn_protocols = vec![b"http/1.1".to_vec()];
            c
        }
        Err(e) => return (0, 0, Some(InterceptError::Setup(e))),
    };
    let client_cfg = match rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map(|b| {
            b.with_root_certificates(Arc::clone(&plan.roots))
                .with_no_client_auth()
        }) {
        Ok(mut c) => {
            c.alpn_protocols = vec![b"http/1.1".to_vec()];
            c
        }
        Err(e) => return (0, 0, Some(InterceptError::Setup(e))),
    };
    let inside = match tokio_rustls::TlsAcceptor::from(Arc::new(server))
        .accept(client)
        .await
    {
        Ok(s) => s,
        Err(e) => return (0, 0, Some(InterceptError::SandboxTls(e))),
    };
    let Ok(name) = ServerName::try_from(plan.host.clone()) else {
        return (0, 0, Some(InterceptError::ServerName(plan.host)));
    };
    let outside = match tokio_rustls::TlsConnector::from(Arc::new(client_cfg))
        .connect(name, upstream)
        .await
    {
        Ok(s) => s,
        Err(source) => {
            let host = plan.host;
            return (0, 0, Some(InterceptError::HostTls { host, source }));
        }
    };
    let (cr, mut cw) = tokio::io::split(inside);
    let (ur, mut uw) = tokio::io::split(outside);
    let (sent_tx, sent_rx) = tokio::sync::mpsc::unbounded_channel();
    let swaps = plan.swaps;
    let mut masks: Vec<Vec<u8>> = swaps
        .iter()
        .flat_map(|s| mask_forms(s.value.as_bytes()))
        .collect();
    // A forge's token whole only: its `Authorization` form starts with
    // what everyone knows, and the sandbox chooses what a forge echoes
    // (ref names), so masking runs of it would answer guesses.
    for f in &plan.forges {
        for form in super::forge::secret_forms(f) {
            masks.extend(super::mask::whole_forms(&form));
        }
    }
    let forges = Forges {
        rules: plan.forges,
        pushed: plan.pushed,
    };
    let up = async {
        let r = requests(
            BufReader::new(cr),
            &mut uw,
            &plan.host,
            &swaps,
            &forges,
            sent_tx,
        )
        .await;
        let _ = uw.shutdown().await;
        r
    };
    let down = async {
        let r = responses(BufReader::new(ur), &mut cw, &masks, sent_rx).await;
        let _ = cw.shutdown().await;
        r
    };
    let (up, down) = tokio::join!(up, down);
    let error = up.1.or(down.1);
    (up.0, down.0, error)
}

/// Read one head (up to and with the empty line) into `head`; false at a
/// clean end before any byte.
async fn read_head<R: AsyncBufReadExt + Unpin>(
    r: &mut R,
    head: &mut Vec<u8>,
) -> std::io::Result<bool> {
    head.clear();
    loop {
        let before = head.len();
        let n = (&mut *r)
            .take((HEAD_MAX + 1 - before) as u64)
            .read_until(b'\n', head)
            .await?;
        if n == 0 {
            if head.is_empty() {
                return Ok(false);
            }
            return Err(std::io::Error::other("the connection ended inside a head"));
        }
        if head.len() > HEAD_MAX {
            return Err(std::io::Error::other(format!(
                "a head is larger than {HEAD_MAX} bytes"
            )));
        }
        if head.ends_with(b"\r\n\r\n") || head == b"\r\n" || head.ends_with(b"\n\n") {
            return Ok(true);
        }
    }
}

/// What the responses' side needs of a request sent to the host: its
/// method, and for one that asked for an upgrade, where to tell whether
/// the host switched protocols (answered 101); or, for a request the
/// gateway answered itself (a refused push), that answer, after which the
/// connection ends.
struct Sent {
    method: String,
    upgrade: Option<tokio::sync::oneshot::Sender<bool>>,
    answer: Option<Vec<u8>>,
}

/// The forge rules of a connection, and whom to tell of pushes.
struct Forges {
    rules: Vec<super::forge::Rule>,
    pushed: Option<Pushed>,
}

/// The sandbox's requests to the host, the placeholders swapped; (bytes
/// read, why it ended early).
async fn requests<R, W>(
    mut r: BufReader<R>,
    w: &mut W,
    host: &str,
    swaps: &[Swap],
    forges: &Forges,
    sent: tokio::sync::mpsc::UnboundedSender<Sent>,
) -> (u64, Option<InterceptError>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut total = 0u64;
    let mut head = Vec::new();
    loop {
        match read_head(&mut r, &mut head).await {
            Ok(false) => return (total, None),
            Ok(true) => {}
            Err(e) => return (total, Some(e.into())),
        }
        total += head.len() as u64;
        let mut headers = [httparse::EMPTY_HEADER; 96];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&head) {
            Ok(httparse::Status::Complete(_)) => {}
            _ => return (total, Some(Refusal::NotRequest.into())),
        }
        if let Err(e) = check_target(&req, host) {
            return (total, Some(e.into()));
        }
        let method = req.method.unwrap_or("GET").to_owned();
        let upgrade = req
            .headers
            .iter()
            .any(|h| h.name.eq_ignore_ascii_case("upgrade"));
        let body = match framing(req.headers) {
            Ok(b) => b.unwrap_or(Body::None),
            Err(e) => return (total, Some(e.into())),
        };
        let target = req.path.unwrap_or("/");
        let forge = forges
            .rules
            .iter()
            .find_map(|f| super::forge::endpoint(&method, target, f).map(|e| (f, e)));
        let out = rewrite_request(&req, swaps, forge.map(|(f, _)| f));
        if let Some((rule, super::forge::Endpoint::ReceivePack)) = forge {
            // Its commands are read as they are sent: a compressed body
            // would be read one way here and another by the forge.
            let encoded = req.headers.iter().any(|h| {
                h.name.eq_ignore_ascii_case("content-encoding")
                    && !h.value.trim_ascii().eq_ignore_ascii_case(b"identity")
            });
            let push = push::Push {
                head: &out,
                body,
                rule,
                encoded,
                pushed: forges.pushed.as_ref(),
            };
            let answer = match push::inspect(&mut r, w, push).await {
                Ok((n, answer)) => {
                    total += n;
                    answer
                }
                Err(e) => return (total, Some(e.into())),
            };
            let _ = sent.send(Sent {
                method,
                upgrade: None,
                answer,
            });
            // (One request per connection that carries a token: see
            // `rewrite_request`.)
            return (total, None);
        }
        let (switched_tx, switched) = if upgrade {
            let (tx, rx) = tokio::sync::oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let _ = sent.send(Sent {
            method,
            upgrade: switched_tx,
            answer: None,
        });
        if let Err(e) = w.write_all(&out).await {
            return (total, Some(e.into()));
        }
        match copy_body(&mut r, w, body, &[]).await {
            Ok(n) => total += n,
            Err(e) => return (total, Some(e.into())),
        }
        if forge.is_some() {
            return (total, None);
        }
        // Only once the host has switched protocols is what follows not
        // ours to parse; until its answer, nothing more is read.
        if let Some(switched) = switched {
            match switched.await {
                Ok(true) => {
                    return match tokio::io::copy(&mut r, w).await {
                        Ok(n) => (total + n, None),
                        Err(e) => (total, Some(e.into())),
                    };
                }
                Ok(false) => {}
                // The responses' side ended: so does this one.
                Err(_) => return (total, None),
            }
        }
    }
}

/// The request head again, with the placeholder of each secret replaced by
/// its value in that secret's header only, and for a request of a forge's
/// repository (`forge`), its token in `Authorization: Basic`.
fn rewrite_request(
    req: &httparse::Request<'_, '_>,
    swaps: &[Swap],
    forge: Option<&super::forge::Rule>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(req.method.unwrap_or("GET").as_bytes());
    out.push(b' ');
    out.extend_from_slice(req.path.unwrap_or("/").as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for h in req.headers.iter() {
        // Answers come uncompressed, so that masking sees every byte (a
        // WebSocket's too: no permessage-deflate).
        if h.name.eq_ignore_ascii_case("accept-encoding")
            || h.name.eq_ignore_ascii_case("sec-websocket-extensions")
        {
            continue;
        }
        // A request with a forge's token is the last on its connection
        // (`Connection: close`, below): nothing the sandbox sends after it
        // can share its framing, and a change of the rules applies from
        // the next connection. What would keep it open goes.
        if forge.is_some()
            && [
                "connection",
                "keep-alive",
                "te",
                "trailer",
                "upgrade",
                "proxy-connection",
            ]
            .iter()
            .any(|n| h.name.eq_ignore_ascii_case(n))
        {
            continue;
        }
        out.extend_from_slice(h.name.as_bytes());
        out.extend_from_slice(b": ");
        let mut value = h.value.to_vec();
        for s in swaps {
            if h.name.eq_ignore_ascii_case(&s.header) {
                value = swapped(&value, s);
            }
        }
        if let Some(f) = forge.filter(|_| h.name.eq_ignore_ascii_case("authorization")) {
            if let Some(v) = super::forge::swap_basic(&value, f) {
                value = v;
            }
        }
        out.extend_from_slice(&value);
        out.extend_from_slice(b"\r\n");
    }
    if forge.is_some() {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// Header value `value` with the placeholder of `s` become its value: only
/// when it is exactly the placeholder, or one word and the placeholder
/// (`Bearer <placeholder>`). Anything else goes unchanged, so that no
/// padding can move the value into what a host shows of a header.
fn swapped(value: &[u8], s: &Swap) -> Vec<u8> {
    let ph = s.placeholder.as_bytes();
    let scheme = value
        .strip_suffix(ph)
        .and_then(|rest| rest.strip_suffix(b" "))
        .filter(|w| w.iter().all(u8::is_ascii_alphanumeric));
    match scheme {
        Some(word) => [
            word,
            if word.is_empty() { b"" } else { b" " },
            s.value.as_bytes(),
        ]
        .concat(),
        None if value == ph => s.value.as_bytes().to_vec(),
        None => value.to_vec(),
    }
}

pub(super) fn replace_all(hay: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    if from.is_empty() {
        return hay.to_vec();
    }
    let mut out = Vec::with_capacity(hay.len());
    let mut i = 0;
    while i < hay.len() {
        if hay[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(hay[i]);
            i += 1;
        }
    }
    out
}

/// The host's responses to the sandbox, masked; (bytes written, why it
/// ended early).
async fn responses<R, W>(
    mut r: BufReader<R>,
    w: &mut W,
    masks: &[Vec<u8>],
    mut sent: tokio::sync::mpsc::UnboundedReceiver<Sent>,
) -> (u64, Option<InterceptError>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut total = 0u64;
    let mut head = Vec::new();
    let mut out = Masked::new(w, masks);
    // The next request's, once known: an answer of the gateway's own is
    // given in its turn, without waiting for the host.
    let mut next: Option<Sent> = None;
    let mut requests_done = false;
    loop {
        if next.is_none() && !requests_done {
            tokio::select! {
                biased;
                s = sent.recv() => match s {
                    Some(s) => next = Some(s),
                    None => requests_done = true,
                },
                _ = r.fill_buf() => {}
            }
        }
        if let Some(answer) = next.as_mut().and_then(|s| s.answer.take()) {
            let wrote = match out.write(&answer).await {
                Ok(()) => out.flush().await,
                Err(e) => Err(e),
            };
            return (total + answer.len() as u64, wrote.err().map(Into::into));
        }
        match read_head(&mut r, &mut head).await {
            Ok(false) => {
                let _ = out.flush().await;
                return (total, None);
            }
            Ok(true) => {}
            Err(e) => {
                let _ = out.flush().await;
                return (total, Some(e.into()));
            }
        }
        let mut headers = [httparse::EMPTY_HEADER; 96];
        let mut resp = httparse::Response::new(&mut headers);
        let code = match resp.parse(&head) {
            Ok(httparse::Status::Complete(_)) => resp.code.unwrap_or(0),
            _ => return (total, Some(Refusal::NotResponse.into())),
        };
        total += head.len() as u64;
        // The request a final answer (or a 101) is for.
        let mut request = if code == 101 || code >= 200 {
            match next.take() {
                Some(s) => Some(s),
                None => sent.recv().await,
            }
        } else {
            None
        };
        let switched = request.as_mut().and_then(|s| s.upgrade.take());
        let switched = match (code, switched) {
            (101, Some(tx)) => Some(tx),
            (101, None) => return (total, Some(Refusal::UnaskedSwitch.into())),
            (_, Some(tx)) => {
                // Not switched: the requests' side goes on with HTTP.
                let _ = tx.send(false);
                None
            }
            (_, None) => None,
        };
        let body = if (100..200).contains(&code) {
            // Interim, or the end of HTTP (101): no body of its own.
            Body::None
        } else {
            let method = request.map(|s| s.method).unwrap_or_default();
            match framing(resp.headers) {
                _ if method == "HEAD" || code == 204 || code == 304 => Body::None,
                Ok(Some(b)) => b,
                Ok(None) => Body::UntilEnd,
                Err(e) => return (total, Some(e.into())),
            }
        };
        // A compressed body hides the value from the masking: not passed
        // on, asked for or not.
        let coded = resp.headers.iter().find(|h| {
            h.name.eq_ignore_ascii_case("content-encoding")
                && !h.value.trim_ascii().eq_ignore_ascii_case(b"identity")
        });
        if coded.is_some() && !matches!(body, Body::None) {
            return (total, Some(Refusal::Compressed.into()));
        }
        // The whole head, before anything of a body or another message.
        let wrote = match out.write(&head).await {
            Ok(()) => out.flush().await,
            Err(e) => Err(e),
        };
        if let Err(e) = wrote {
            return (total, Some(e.into()));
        }
        if let Some(tx) = switched {
            let _ = tx.send(true);
            let r = copy_body(&mut r, out.w, Body::UntilEnd, masks).await;
            return match r {
                Ok(n) => (total + n, None),
                Err(e) => (total, Some(e.into())),
            };
        }
        if (100..200).contains(&code) {
            continue;
        }
        let until_end = matches!(body, Body::UntilEnd);
        match copy_body(&mut r, out.w, body, masks).await {
            Ok(n) => total += n,
            Err(e) => return (total, Some(e.into())),
        }
        if until_end {
            return (total, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn swap() -> Swap {
        Swap {
            header: "x-api-key".into(),
            placeholder: "keystone-placeholder-abc".into(),
            value: "sk-real-value-123".into(),
        }
    }

    #[test]
    fn only_a_bare_or_schemed_placeholder_is_swapped() {
        let s = swap();
        let ph = s.placeholder.clone();
        assert_eq!(swapped(ph.as_bytes(), &s), s.value.as_bytes());
        assert_eq!(
            swapped(format!("Bearer {ph}").as_bytes(), &s),
            format!("Bearer {}", s.value).as_bytes()
        );
        // Padding, which could move the value where a host shows it: left
        // alone.
        for padded in [
            format!("AAAA{ph}"),
            format!("{ph} x"),
            format!("a b {ph}"),
            format!("{ph}{ph}"),
        ] {
            assert_eq!(
                swapped(padded.as_bytes(), &s),
                padded.as_bytes(),
                "{padded}"
            );
        }
    }

    #[test]
    fn only_the_named_header_gets_the_value() {
        let head = b"POST /v1/messages HTTP/1.1\r\nHost: api.example.com\r\nx-api-key: keystone-placeholder-abc\r\nAccept-Encoding: gzip, br\r\nx-other: keystone-placeholder-abc\r\n\r\n";
        let mut headers = [httparse::EMPTY_HEADER; 16];
        let mut req = httparse::Request::new(&mut headers);
        req.parse(head).unwrap();
        let out = String::from_utf8(rewrite_request(&req, &[swap()], None)).unwrap();
        assert!(out.contains("x-api-key: sk-real-value-123\r\n"), "{out}");
        assert!(
            out.contains("x-other: keystone-placeholder-abc\r\n"),
            "{out}"
        );
        assert!(
            !out.to_ascii_lowercase().contains("accept-encoding"),
            "{out}"
        );
    }

    #[tokio::test]
    async fn a_value_is_masked_even_across_reads() {
        let masks = vec![b"sk-real-value-123".to_vec()];
        let mut sink = Vec::new();
        {
            let mut m = Masked::new(&mut sink, &masks);
            m.write(b"echo: sk-real-va").await.unwrap();
            m.write(b"lue-123 and sk-real-value-123!").await.unwrap();
            m.flush().await.unwrap();
        }
        let s = String::from_utf8(sink).unwrap();
        assert!(!s.contains("sk-real"), "{s}");
        assert_eq!(
            s.len(),
            "echo: sk-real-value-123 and sk-real-value-123!".len()
        );
    }
}

#[cfg(test)]
mod attacks;
mod body;
mod push;

use body::copy_body;

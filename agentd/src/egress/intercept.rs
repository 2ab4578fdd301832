//! The secret-swapping path of the gateway ([`crate::secrets`]): for a
//! CONNECT to a host that carries a secret of the sandbox, the gateway ends
//! the sandbox's TLS with a certificate from the sandbox's own CA, opens its
//! own TLS to the host (its certificate checked against the host's trusted
//! roots, as any client would), and relays HTTP/1.1 in both directions:
//!
//! - requests: in the secret's header only, the placeholder becomes the
//!   value; nothing else of a request changes;
//! - responses: every occurrence of a value is masked (`*` for each byte,
//!   so lengths and framing stay as they are) before the sandbox sees it;
//!   requests go without `Accept-Encoding`, so that answers come
//!   uncompressed and the masking sees every byte.
//!
//! Only HTTP/1.1 is offered (ALPN). An `Upgrade` (WebSocket) continues as
//! raw bytes, masked the same way towards the sandbox.

use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use super::gateway::HEAD_MAX;

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

/// How to intercept one connection.
#[derive(Debug)]
pub struct Plan {
    /// The host (the certificate's name, and the one checked upstream).
    pub host: String,
    /// The secrets for it.
    pub swaps: Vec<Swap>,
    /// The certificate chain and key shown to the sandbox.
    pub leaf: (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>),
    /// Roots the host's certificate is checked against.
    pub roots: Arc<rustls::RootCertStore>,
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
pub async fn intercept<C, U>(client: C, upstream: U, plan: Plan) -> (u64, u64, Option<String>)
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
        Err(e) => return (0, 0, Some(format!("TLS setup: {e}"))),
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
        Err(e) => return (0, 0, Some(format!("TLS setup: {e}"))),
    };
    let inside = match tokio_rustls::TlsAcceptor::from(Arc::new(server))
        .accept(client)
        .await
    {
        Ok(s) => s,
        Err(e) => return (0, 0, Some(format!("the sandbox's TLS: {e}"))),
    };
    let Ok(name) = ServerName::try_from(plan.host.clone()) else {
        return (
            0,
            0,
            Some(format!("'{}' is not a TLS server name", plan.host)),
        );
    };
    let outside = match tokio_rustls::TlsConnector::from(Arc::new(client_cfg))
        .connect(name, upstream)
        .await
    {
        Ok(s) => s,
        Err(e) => return (0, 0, Some(format!("TLS to {}: {e}", plan.host))),
    };
    let (cr, mut cw) = tokio::io::split(inside);
    let (ur, mut uw) = tokio::io::split(outside);
    let (methods_tx, methods_rx) = tokio::sync::mpsc::unbounded_channel();
    let swaps = plan.swaps;
    let masks: Vec<Vec<u8>> = swaps.iter().map(|s| s.value.as_bytes().to_vec()).collect();
    let up = async {
        let r = requests(BufReader::new(cr), &mut uw, &swaps, methods_tx).await;
        let _ = uw.shutdown().await;
        r
    };
    let down = async {
        let r = responses(BufReader::new(ur), &mut cw, &masks, methods_rx).await;
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

/// How a message's body is framed.
enum Body {
    None,
    Length(u64),
    Chunked,
    /// Until the connection ends (a response without a length).
    UntilEnd,
}

fn framing(headers: &[httparse::Header<'_>]) -> Result<Option<Body>, String> {
    let mut length = None;
    for h in headers {
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            let v = String::from_utf8_lossy(h.value).to_ascii_lowercase();
            if v.trim().ends_with("chunked") {
                return Ok(Some(Body::Chunked));
            }
            return Err(format!("transfer-encoding '{v}' is not supported"));
        }
        if h.name.eq_ignore_ascii_case("content-length") {
            let n: u64 = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .ok_or("the Content-Length is not a number")?;
            if length.is_some_and(|l| l != n) {
                return Err("two different Content-Lengths".into());
            }
            length = Some(n);
        }
    }
    Ok(length.map(Body::Length))
}

/// The sandbox's requests to the host, the placeholders swapped; (bytes
/// read, why it ended early).
async fn requests<R, W>(
    mut r: BufReader<R>,
    w: &mut W,
    swaps: &[Swap],
    methods: tokio::sync::mpsc::UnboundedSender<String>,
) -> (u64, Option<String>)
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
            Err(e) => return (total, Some(e.to_string())),
        }
        total += head.len() as u64;
        let mut headers = [httparse::EMPTY_HEADER; 96];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&head) {
            Ok(httparse::Status::Complete(_)) => {}
            _ => return (total, Some("a request that is not HTTP/1.1".into())),
        }
        let method = req.method.unwrap_or("GET").to_owned();
        let upgrade = req
            .headers
            .iter()
            .any(|h| h.name.eq_ignore_ascii_case("upgrade"));
        let body = match framing(req.headers) {
            Ok(b) => b.unwrap_or(Body::None),
            Err(e) => return (total, Some(e)),
        };
        let out = rewrite_request(&req, swaps);
        let _ = methods.send(method);
        if let Err(e) = w.write_all(&out).await {
            return (total, Some(e.to_string()));
        }
        if upgrade {
            // Whatever the answer, what follows is not ours to parse.
            return match tokio::io::copy(&mut r, w).await {
                Ok(n) => (total + n, None),
                Err(e) => (total, Some(e.to_string())),
            };
        }
        match copy_body(&mut r, w, body, &[]).await {
            Ok(n) => total += n,
            Err(e) => return (total, Some(e.to_string())),
        }
    }
}

/// The request head again, with the placeholder of each secret replaced by
/// its value in that secret's header only.
fn rewrite_request(req: &httparse::Request<'_, '_>, swaps: &[Swap]) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(req.method.unwrap_or("GET").as_bytes());
    out.push(b' ');
    out.extend_from_slice(req.path.unwrap_or("/").as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for h in req.headers.iter() {
        // Answers come uncompressed, so that masking sees every byte.
        if h.name.eq_ignore_ascii_case("accept-encoding") {
            continue;
        }
        out.extend_from_slice(h.name.as_bytes());
        out.extend_from_slice(b": ");
        let mut value = h.value.to_vec();
        for s in swaps {
            if h.name.eq_ignore_ascii_case(&s.header) {
                value = replace_all(&value, s.placeholder.as_bytes(), s.value.as_bytes());
            }
        }
        out.extend_from_slice(&value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

fn replace_all(hay: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
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

/// Mask every occurrence of each of `masks` in `buf` with `*`s.
fn mask(buf: &mut [u8], masks: &[Vec<u8>]) {
    for m in masks {
        if m.is_empty() || m.len() > buf.len() {
            continue;
        }
        let mut i = 0;
        while i + m.len() <= buf.len() {
            if buf[i..i + m.len()] == m[..] {
                buf[i..i + m.len()].fill(b'*');
                i += m.len();
            } else {
                i += 1;
            }
        }
    }
}

/// Bytes towards the sandbox, masked: a value split across two reads is
/// still found, as the last bytes of each read wait for the next.
struct Masked<'a, W> {
    w: &'a mut W,
    masks: &'a [Vec<u8>],
    held: Vec<u8>,
    keep: usize,
}

impl<'a, W: AsyncWrite + Unpin> Masked<'a, W> {
    fn new(w: &'a mut W, masks: &'a [Vec<u8>]) -> Self {
        let keep = masks
            .iter()
            .map(Vec::len)
            .max()
            .unwrap_or(1)
            .saturating_sub(1);
        Self {
            w,
            masks,
            held: Vec::new(),
            keep,
        }
    }

    async fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.held.extend_from_slice(data);
        mask(&mut self.held, self.masks);
        if self.held.len() > self.keep {
            let n = self.held.len() - self.keep;
            self.w.write_all(&self.held[..n]).await?;
            self.held.drain(..n);
        }
        Ok(())
    }

    async fn flush(&mut self) -> std::io::Result<()> {
        mask(&mut self.held, self.masks);
        self.w.write_all(&self.held).await?;
        self.held.clear();
        self.w.flush().await
    }
}

/// The host's responses to the sandbox, masked; (bytes written, why it
/// ended early).
async fn responses<R, W>(
    mut r: BufReader<R>,
    w: &mut W,
    masks: &[Vec<u8>],
    mut methods: tokio::sync::mpsc::UnboundedReceiver<String>,
) -> (u64, Option<String>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut total = 0u64;
    let mut head = Vec::new();
    let mut out = Masked::new(w, masks);
    loop {
        match read_head(&mut r, &mut head).await {
            Ok(false) => {
                let _ = out.flush().await;
                return (total, None);
            }
            Ok(true) => {}
            Err(e) => {
                let _ = out.flush().await;
                return (total, Some(e.to_string()));
            }
        }
        let mut headers = [httparse::EMPTY_HEADER; 96];
        let mut resp = httparse::Response::new(&mut headers);
        let code = match resp.parse(&head) {
            Ok(httparse::Status::Complete(_)) => resp.code.unwrap_or(0),
            _ => return (total, Some("a response that is not HTTP/1.1".into())),
        };
        let framed = framing(resp.headers);
        total += head.len() as u64;
        if let Err(e) = out.write(&head).await {
            return (total, Some(e.to_string()));
        }
        if code == 101 {
            let r = copy_body(&mut r, out.w, Body::UntilEnd, masks).await;
            return match r {
                Ok(n) => (total + n, None),
                Err(e) => (total, Some(e.to_string())),
            };
        }
        if (100..200).contains(&code) {
            let _ = out.flush().await;
            continue;
        }
        let method = methods.recv().await.unwrap_or_default();
        let body = if method == "HEAD" || code == 204 || code == 304 {
            Body::None
        } else {
            match framed {
                Ok(Some(b)) => b,
                Ok(None) => Body::UntilEnd,
                Err(e) => return (total, Some(e)),
            }
        };
        if let Err(e) = out.flush().await {
            return (total, Some(e.to_string()));
        }
        let until_end = matches!(body, Body::UntilEnd);
        match copy_body(&mut r, out.w, body, masks).await {
            Ok(n) => total += n,
            Err(e) => return (total, Some(e.to_string())),
        }
        if until_end {
            return (total, None);
        }
    }
}

/// Copy one body of `framing` from `r` to `w`, masking `masks`; its bytes.
async fn copy_body<R, W>(
    r: &mut BufReader<R>,
    w: &mut W,
    framing: Body,
    masks: &[Vec<u8>],
) -> std::io::Result<u64>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut out = Masked::new(w, masks);
    let mut buf = vec![0u8; 16 * 1024];
    let mut total = 0u64;
    match framing {
        Body::None => {}
        Body::Length(mut left) => {
            while left > 0 {
                let want = usize::try_from(left.min(buf.len() as u64)).unwrap_or(buf.len());
                let n = r.read(&mut buf[..want]).await?;
                if n == 0 {
                    return Err(std::io::Error::other("the body ended early"));
                }
                out.write(&buf[..n]).await?;
                left -= n as u64;
                total += n as u64;
            }
        }
        Body::UntilEnd => loop {
            let n = r.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            out.write(&buf[..n]).await?;
            total += n as u64;
        },
        Body::Chunked => loop {
            let mut line = Vec::new();
            let n = (&mut *r).take(1024).read_until(b'\n', &mut line).await?;
            if n == 0 || !line.ends_with(b"\n") {
                return Err(std::io::Error::other("a chunk size line is broken"));
            }
            out.write(&line).await?;
            total += n as u64;
            let text = String::from_utf8_lossy(&line);
            let size = u64::from_str_radix(text.trim().split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| std::io::Error::other("a chunk size is not hex"))?;
            if size == 0 {
                // Trailers, up to the empty line.
                loop {
                    let mut t = Vec::new();
                    let n = (&mut *r)
                        .take(HEAD_MAX as u64)
                        .read_until(b'\n', &mut t)
                        .await?;
                    if n == 0 {
                        return Err(std::io::Error::other("the trailers ended early"));
                    }
                    out.write(&t).await?;
                    total += n as u64;
                    if t == b"\r\n" || t == b"\n" {
                        break;
                    }
                }
                break;
            }
            let mut left = size + 2;
            while left > 0 {
                let want = usize::try_from(left.min(buf.len() as u64)).unwrap_or(buf.len());
                let n = r.read(&mut buf[..want]).await?;
                if n == 0 {
                    return Err(std::io::Error::other("a chunk ended early"));
                }
                out.write(&buf[..n]).await?;
                left -= n as u64;
                total += n as u64;
            }
        },
    }
    out.flush().await?;
    Ok(total)
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
    fn only_the_named_header_gets_the_value() {
        let head = b"POST /v1/messages HTTP/1.1\r\nHost: api.example.com\r\nx-api-key: keystone-placeholder-abc\r\nAccept-Encoding: gzip, br\r\nx-other: keystone-placeholder-abc\r\n\r\n";
        let mut headers = [httparse::EMPTY_HEADER; 16];
        let mut req = httparse::Request::new(&mut headers);
        req.parse(head).unwrap();
        let out = String::from_utf8(rewrite_request(&req, &[swap()])).unwrap();
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

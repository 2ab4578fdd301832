//! The strict HTTP/1.1 rules of an intercepted connection
//! ([`super::intercept`]): a request must be for the host the secret is
//! for, and every message framed one way only; what breaks a rule ends the
//! connection, for the reason a [`Refusal`] names.

/// Why an intercepted connection was ended. No header's value is quoted:
/// the host's could reflect a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The sandbox sent something that is not an HTTP/1.1 request.
    #[error("a request that is not HTTP/1.1")]
    NotRequest,
    /// The host sent something that is not an HTTP/1.1 response.
    #[error("a response that is not HTTP/1.1")]
    NotResponse,
    /// A `Transfer-Encoding` other than `chunked`.
    #[error("a Transfer-Encoding other than chunked is not supported")]
    TransferEncoding,
    /// A `Content-Length` of something other than digits.
    #[error("the Content-Length is not a number")]
    ContentLength,
    /// Two `Content-Length`s that differ.
    #[error("two different Content-Lengths")]
    TwoContentLengths,
    /// Both framings at once.
    #[error("both a Content-Length and a Transfer-Encoding")]
    LengthAndChunked,
    /// `Transfer-Encoding` twice.
    #[error("two Transfer-Encodings")]
    TwoTransferEncodings,
    /// An absolute or authority-form request target.
    #[error("a request target that is not a path")]
    Target,
    /// No `Host`.
    #[error("a request without Host")]
    NoHost,
    /// `Host` twice.
    #[error("a request with two Hosts")]
    TwoHosts,
    /// A `Host` of another name.
    #[error("a request for '{named}' on the connection to {host}")]
    OtherHost {
        /// The name it gave (clamped).
        named: String,
        /// The secret's host.
        host: String,
    },
    /// A `101 Switching Protocols` to a request that asked for no upgrade.
    #[error("a switch of protocols that the request did not ask for")]
    UnaskedSwitch,
    /// A compressed response body, which masking cannot see into.
    #[error("a compressed body (Content-Encoding) cannot be masked")]
    Compressed,
}

/// How a message's body is framed.
pub(super) enum Body {
    /// No body.
    None,
    /// This many bytes.
    Length(u64),
    /// Chunked.
    Chunked,
    /// Until the connection ends (a response without a length).
    UntilEnd,
}

/// The framing of a message, strictly: one `Transfer-Encoding`, exactly
/// `chunked`, or `Content-Length`s of digits that agree, never both (what
/// is ambiguous could be framed otherwise by the host, and a request that
/// the gateway swapped the value into read by the host as another's body).
pub(super) fn framing(headers: &[httparse::Header<'_>]) -> Result<Option<Body>, Refusal> {
    let mut length = None;
    let mut chunked = 0;
    for h in headers {
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            // (Neither this header nor another is quoted in an error: the
            // host's could reflect the value.)
            if !h.value.trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Err(Refusal::TransferEncoding);
            }
            chunked += 1;
        }
        if h.name.eq_ignore_ascii_case("content-length") {
            let v = std::str::from_utf8(h.value).unwrap_or("").trim();
            let n: u64 = v
                .bytes()
                .all(|b| b.is_ascii_digit())
                .then(|| v.parse().ok())
                .flatten()
                .ok_or(Refusal::ContentLength)?;
            if length.is_some_and(|l| l != n) {
                return Err(Refusal::TwoContentLengths);
            }
            length = Some(n);
        }
    }
    match (chunked, length) {
        (0, l) => Ok(l.map(Body::Length)),
        (1, None) => Ok(Some(Body::Chunked)),
        (1, Some(_)) => Err(Refusal::LengthAndChunked),
        _ => Err(Refusal::TwoTransferEncodings),
    }
}

/// A request on the connection to `host` must be for `host`: one `Host`
/// of that name (any port), an origin-form target (a shared front end
/// would route the value to whichever site Host or an absolute target
/// names).
pub(super) fn check_target(req: &httparse::Request<'_, '_>, host: &str) -> Result<(), Refusal> {
    let path = req.path.unwrap_or("");
    if !path.starts_with('/') && path != "*" {
        return Err(Refusal::Target);
    }
    let mut hosts = req
        .headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("host"));
    let named = match (hosts.next(), hosts.next()) {
        (Some(h), None) => String::from_utf8_lossy(h.value).trim().to_owned(),
        (None, _) => return Err(Refusal::NoHost),
        (Some(_), Some(_)) => return Err(Refusal::TwoHosts),
    };
    let name = match named.rsplit_once(':') {
        Some((n, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => n,
        _ => named.as_str(),
    };
    if !name.eq_ignore_ascii_case(host) {
        return Err(Refusal::OtherHost {
            named: crate::text::clamp_text(name).into_owned(),
            host: host.to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod attacks {
    use super::*;

    fn parse<T>(head: &[u8], f: impl FnOnce(&httparse::Request<'_, '_>) -> T) -> T {
        let mut headers = [httparse::EMPTY_HEADER; 16];
        let mut req = httparse::Request::new(&mut headers);
        req.parse(head).unwrap();
        f(&req)
    }

    #[test]
    fn ambiguous_framing_and_other_hosts_are_refused() {
        for (bad, why) in [
            (
                "Content-Length: 5\r\nTransfer-Encoding: chunked",
                Refusal::LengthAndChunked,
            ),
            ("Transfer-Encoding: xchunked", Refusal::TransferEncoding),
            (
                "Transfer-Encoding: gzip, chunked",
                Refusal::TransferEncoding,
            ),
            (
                "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
                Refusal::TwoTransferEncodings,
            ),
            ("Content-Length: +5", Refusal::ContentLength),
            (
                "Content-Length: 5\r\nContent-Length: 6",
                Refusal::TwoContentLengths,
            ),
        ] {
            let head = format!("POST / HTTP/1.1\r\nHost: h.test\r\n{bad}\r\n\r\n");
            let got = parse(head.as_bytes(), |r| framing(r.headers).map(|_| ()));
            assert_eq!(got, Err(why), "{bad}");
        }
        let other = |named: &str| {
            Err(Refusal::OtherHost {
                named: named.to_owned(),
                host: "h.test".to_owned(),
            })
        };
        for (target, host, want) in [
            ("/", "Host: H.TEST:8443", Ok(())),
            ("*", "Host: h.test", Ok(())),
            ("/", "Host: evil.test", other("evil.test")),
            ("/", "Host: h.test.evil.test", other("h.test.evil.test")),
            ("https://evil.test/", "Host: h.test", Err(Refusal::Target)),
            ("/", "X: y", Err(Refusal::NoHost)),
            (
                "/",
                "Host: h.test\r\nHost: evil.test",
                Err(Refusal::TwoHosts),
            ),
        ] {
            let head = format!("GET {target} HTTP/1.1\r\n{host}\r\n\r\n");
            let got = parse(head.as_bytes(), |r| check_target(r, "h.test"));
            assert_eq!(got, want, "{target} {host}");
        }
    }
}

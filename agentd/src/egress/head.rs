//! The request heads the gateway reads ([`super::gateway`]): an HTTP
//! proxy request (CONNECT, or plain HTTP with an absolute URL, rewritten
//! for the origin and framed by [`super::strict`]'s rules) and a SOCKS5
//! greeting and CONNECT, each bounded by [`HEAD_MAX`] bytes.

use std::net::IpAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::gateway::{Ask, GatewayError, HEAD_MAX};
use super::splice::Socket;

/// Read an HTTP request head; for plain HTTP, return the head rewritten
/// for the origin (origin-form target, no proxy headers, one request per
/// connection) and any body bytes already read.
pub(super) async fn http_head(
    client: &mut impl Socket,
    first: u8,
) -> Result<(Ask, Vec<u8>), GatewayError> {
    let mut buf = Vec::with_capacity(1024);
    buf.push(first);
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() >= HEAD_MAX {
            return Err(GatewayError::HeadTooLarge);
        }
        let mut chunk = [0u8; 4096];
        let n = client
            .read(&mut chunk)
            .await
            .map_err(GatewayError::Client)?;
        if n == 0 {
            return Err(GatewayError::EndedEarly);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let mut headers = [httparse::EMPTY_HEADER; 128];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(&buf[..end]) {
        Ok(httparse::Status::Complete(_)) => {}
        _ => return Err(GatewayError::NotProxyRequest),
    }
    let method = req.method.unwrap_or_default();
    let target = req.path.unwrap_or_default();
    if method.eq_ignore_ascii_case("CONNECT") {
        let (host, port) = split_authority(target, None)?;
        // Bytes sent after the head belong to the tunnel.
        let rest = buf[end..].to_vec();
        return Ok((
            Ask {
                protocol: "connect",
                host,
                port,
                body_left: None,
            },
            rest,
        ));
    }
    let Some(after) = target.strip_prefix("http://") else {
        return Err(GatewayError::NotAbsolute(crate::text::shown(target)));
    };
    let (authority, path) = match after.find('/') {
        Some(i) => (&after[..i], &after[i..]),
        None => (after, "/"),
    };
    let (host, port) = split_authority(authority, Some(80))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\n").into_bytes();
    // The Host the destination sees is the one that was decided on.
    head.extend_from_slice(format!("Host: {authority}\r\n").as_bytes());
    // Framed by the same strict rules as an intercepted request (one
    // length, of digits only, and no Transfer-Encoding beside it), and
    // sent on with that one length only, as a number.
    let length = match super::strict::framing(req.headers) {
        Ok(None) => None,
        Ok(Some(super::strict::Body::Length(n))) => Some(n),
        Ok(Some(_)) => return Err(GatewayError::Chunked),
        Err(e) => return Err(GatewayError::Framing(e)),
    };
    if let Some(n) = length {
        head.extend_from_slice(format!("Content-Length: {n}\r\n").as_bytes());
    }
    let body = length.unwrap_or(0);
    for h in req.headers.iter() {
        let n = h.name.to_ascii_lowercase();
        if n.starts_with("proxy-")
            || n == "connection"
            || n == "keep-alive"
            || n == "host"
            || n == "content-length"
        {
            continue;
        }
        head.extend_from_slice(h.name.as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(h.value);
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"Connection: close\r\n\r\n");
    // Of what came after the head, only this request's body goes on: a
    // second, pipelined request never reaches the destination.
    let early = &buf[end..];
    let taken = early.len().min(usize::try_from(body).unwrap_or(usize::MAX));
    head.extend_from_slice(&early[..taken]);
    Ok((
        Ask {
            protocol: "http",
            host,
            port,
            body_left: Some(body - taken as u64),
        },
        head,
    ))
}

/// `host:port` or `[v6]:port` (the port may default).
pub(super) fn split_authority(
    a: &str,
    default: Option<u16>,
) -> Result<(String, u16), GatewayError> {
    let bad = || GatewayError::NotHostPort(crate::text::shown(a));
    let (host, port) = if let Some(rest) = a.strip_prefix('[') {
        let (h, p) = rest.split_once(']').ok_or_else(bad)?;
        (h, p.strip_prefix(':'))
    } else {
        match a.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (a, None),
        }
    };
    let port = match (port, default) {
        (Some(p), _) => p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(bad)?,
        (None, Some(d)) => d,
        (None, None) => return Err(bad()),
    };
    if !valid_host(host) {
        return Err(bad());
    }
    Ok((host.to_owned(), port))
}

/// Whether `host` is a host name (letters, digits, `-`, `_`, `.`) or an IP
/// address, at most 253 bytes: nothing else is decided, resolved, logged or
/// put on the bus.
fn valid_host(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && (host.parse::<IpAddr>().is_ok()
            || host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.'))
}

/// Read a SOCKS5 greeting (its version byte already read) and CONNECT
/// request (RFC 1928, no authentication).
pub(super) async fn socks_head(client: &mut impl Socket) -> Result<(Ask, Vec<u8>), GatewayError> {
    let mut count = [0u8; 1];
    client
        .read_exact(&mut count)
        .await
        .map_err(GatewayError::Client)?;
    let mut methods = vec![0u8; usize::from(count[0])];
    client
        .read_exact(&mut methods)
        .await
        .map_err(GatewayError::Client)?;
    if !methods.contains(&0) {
        let _ = client.write_all(&[5, 0xff]).await;
        return Err(GatewayError::SocksMethod);
    }
    client
        .write_all(&[5, 0])
        .await
        .map_err(GatewayError::Client)?;
    let mut req = [0u8; 4];
    client
        .read_exact(&mut req)
        .await
        .map_err(GatewayError::Client)?;
    if req[0] != 5 || req[1] != 1 {
        let _ = client.write_all(&socks_reply(7)).await;
        return Err(GatewayError::SocksCommand);
    }
    let host = match req[3] {
        1 => {
            let mut a = [0u8; 4];
            client
                .read_exact(&mut a)
                .await
                .map_err(GatewayError::Client)?;
            std::net::Ipv4Addr::from(a).to_string()
        }
        3 => {
            let mut len = [0u8; 1];
            client
                .read_exact(&mut len)
                .await
                .map_err(GatewayError::Client)?;
            let mut name = vec![0u8; usize::from(len[0])];
            client
                .read_exact(&mut name)
                .await
                .map_err(GatewayError::Client)?;
            match String::from_utf8(name) {
                Ok(n) if valid_host(&n) => n,
                _ => {
                    let _ = client.write_all(&socks_reply(8)).await;
                    return Err(GatewayError::SocksHostName);
                }
            }
        }
        4 => {
            let mut a = [0u8; 16];
            client
                .read_exact(&mut a)
                .await
                .map_err(GatewayError::Client)?;
            std::net::Ipv6Addr::from(a).to_string()
        }
        _ => {
            let _ = client.write_all(&socks_reply(8)).await;
            return Err(GatewayError::SocksAddressType);
        }
    };
    let mut port = [0u8; 2];
    client
        .read_exact(&mut port)
        .await
        .map_err(GatewayError::Client)?;
    Ok((
        Ask {
            protocol: "socks5",
            host,
            port: u16::from_be_bytes(port),
            body_left: None,
        },
        Vec::new(),
    ))
}

/// A SOCKS5 reply with status `rep` and an unspecified bound address.
pub(super) fn socks_reply(rep: u8) -> [u8; 10] {
    [5, rep, 0, 1, 0, 0, 0, 0, 0, 0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities_split_with_and_without_ports() {
        assert_eq!(
            split_authority("example.com:443", None).unwrap(),
            ("example.com".to_owned(), 443)
        );
        assert_eq!(
            split_authority("[::1]:8080", None).unwrap(),
            ("::1".to_owned(), 8080)
        );
        assert_eq!(
            split_authority("example.com", Some(80)).unwrap(),
            ("example.com".to_owned(), 80)
        );
        assert!(split_authority("example.com", None).is_err());
        assert!(split_authority("example.com:0", None).is_err());
        assert!(split_authority(":443", None).is_err());
    }

    /// `head` as a client sends it to the gateway: what `http_head` makes
    /// of it.
    async fn head_of(head: &str) -> Result<(Ask, Vec<u8>), GatewayError> {
        let (mut gateway, mut client) = tokio::net::UnixStream::pair().unwrap();
        client.write_all(&head.as_bytes()[1..]).await.unwrap();
        http_head(&mut gateway, head.as_bytes()[0]).await
    }

    #[tokio::test]
    async fn a_plain_request_framed_two_ways_is_refused() {
        let second = "GET /smuggled HTTP/1.1\r\nHost: evil.example\r\n\r\n";
        let n = second.len();
        for framing in [
            format!("Content-Length: 0\r\nContent-Length: {n}"),
            format!("Content-Length: {n}\r\nContent-Length: 0"),
            format!("Content-Length: +{n}"),
            format!("Content-Length: {n}\r\nTransfer-Encoding: chunked"),
            format!("Transfer-Encoding: chunked\r\nContent-Length: {n}"),
        ] {
            let got = head_of(&format!(
                "POST http://origin.test/ HTTP/1.1\r\nHost: x\r\n{framing}\r\n\r\n{second}"
            ))
            .await;
            assert!(
                matches!(got, Err(GatewayError::Framing(_))),
                "{framing}: {:?}",
                got.map(|(_, h)| String::from_utf8_lossy(&h).into_owned())
            );
        }
        // One length, the same twice or padded: sent on once, as digits.
        let (ask, head) = head_of(
            "POST http://origin.test/ HTTP/1.1\r\nContent-Length:  4 \r\ncontent-length: 4\r\n\r\nbodyGET",
        )
        .await
        .unwrap();
        assert_eq!(ask.body_left, Some(0));
        assert_eq!(
            String::from_utf8(head).unwrap(),
            "POST / HTTP/1.1\r\nHost: origin.test\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbody"
        );
    }
}

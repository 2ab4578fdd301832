//! Attacks on the secret-swapping path: what a hostile sandbox or host
//! sends it, and what must never pass.

use super::*;

/// One intercepted connection for `h.test` without its TLS: the
/// sandbox sends `sends`, the host answers `answers` and closes; (what
/// the host got, what the sandbox got, why the requests' side ended,
/// why the responses' side ended).
async fn exchange(
    sends: &[u8],
    answers: &[u8],
) -> (
    String,
    String,
    Option<InterceptError>,
    Option<InterceptError>,
) {
    let (mut sandbox, gw_in) = tokio::io::duplex(1 << 16);
    let (gw_out, mut host) = tokio::io::duplex(1 << 16);
    let (cr, mut cw) = tokio::io::split(gw_in);
    let (ur, mut uw) = tokio::io::split(gw_out);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let swaps = [Swap {
        header: "x-api-key".into(),
        placeholder: "ph".into(),
        value: "sk-real-value-123".into(),
    }];
    let masks = mask_forms(b"sk-real-value-123");
    let up = async {
        let forges = Forges {
            rules: Vec::new(),
            pushed: None,
        };
        let r = requests(BufReader::new(cr), &mut uw, "h.test", &swaps, &forges, tx).await;
        let _ = uw.shutdown().await;
        r
    };
    let down = async {
        let r = responses(BufReader::new(ur), &mut cw, &masks, rx).await;
        let _ = cw.shutdown().await;
        r
    };
    let origin = async {
        host.write_all(answers).await.unwrap();
        host.shutdown().await.unwrap();
        let mut got = Vec::new();
        let _ = host.read_to_end(&mut got).await;
        drop(host);
        got
    };
    let client = async {
        sandbox.write_all(sends).await.unwrap();
        sandbox.shutdown().await.unwrap();
        let mut got = Vec::new();
        let _ = sandbox.read_to_end(&mut got).await;
        got
    };
    let all = async { tokio::join!(up, down, origin, client) };
    let ((_, up), (_, down), got, back) =
        tokio::time::timeout(std::time::Duration::from_secs(5), all)
            .await
            .expect("the connection ends");
    (
        String::from_utf8_lossy(&got).into_owned(),
        String::from_utf8_lossy(&back).into_owned(),
        up,
        down,
    )
}

const UPGRADE: &str = "GET /ws HTTP/1.1\r\nHost: h.test\r\nx-api-key: ph\r\n\
                       Upgrade: websocket\r\nConnection: Upgrade\r\n\r\n";

#[tokio::test]
async fn an_upgrade_answered_200_leaves_every_later_request_checked() {
    // The host does not switch; the sandbox's next request, meant to
    // pass unchecked as raw bytes, names another host.
    let evil = "GET /x HTTP/1.1\r\nHost: evil.test\r\nx-api-key: ph\r\n\r\n";
    let (got, back, up, _) = exchange(
        format!("{UPGRADE}{evil}").as_bytes(),
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    )
    .await;
    assert!(!got.contains("evil.test"), "it reached the host: {got}");
    assert_eq!(got.matches("HTTP/1.1").count(), 1, "{got}");
    assert!(back.starts_with("HTTP/1.1 200 OK"), "{back}");
    assert!(
        matches!(up, Some(InterceptError::Refused(Refusal::OtherHost { .. }))),
        "{up:?}"
    );
    // A later request for the host itself still gets the value.
    let next = "GET /y HTTP/1.1\r\nHost: h.test\r\nx-api-key: ph\r\n\r\n";
    let (got, _, up, _) = exchange(
        format!("{UPGRADE}{next}").as_bytes(),
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    )
    .await;
    assert!(up.is_none(), "{up:?}");
    assert_eq!(
        got.matches("x-api-key: sk-real-value-123").count(),
        2,
        "{got}"
    );
}

#[tokio::test]
async fn only_a_101_to_an_upgrade_switches_to_raw_bytes() {
    // Switched: what follows goes as it is, both ways, masked back.
    let frames = "\u{81}\u{2}hi GET / HTTP/1.1\r\nHost: anything\r\n\r\n";
    let (got, back, up, down) = exchange(
        format!("{UPGRADE}{frames}").as_bytes(),
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n\x81\x11sk-real-value-123",
    )
    .await;
    assert!(up.is_none() && down.is_none(), "{up:?} {down:?}");
    assert!(got.ends_with(frames), "{got}");
    assert!(back.ends_with(&"*".repeat(17)), "{back}");
    // A 101 the request did not ask for ends the connection.
    let plain = "GET / HTTP/1.1\r\nHost: h.test\r\n\r\n";
    let (_, back, _, down) = exchange(
        plain.as_bytes(),
        b"HTTP/1.1 101 Switching Protocols\r\n\r\nraw",
    )
    .await;
    assert!(
        matches!(down, Some(InterceptError::Refused(Refusal::UnaskedSwitch))),
        "{down:?}"
    );
    assert!(!back.contains("raw"), "{back}");
}

#[tokio::test]
async fn a_value_across_chunks_and_in_other_forms_is_masked() {
    let masks = mask_forms(b"sk-a/b+c\"d");
    let third = " sk-a\\/b+c\\\"d sk-a%2fb%2bc%22d";
    let body = format!(
        "4\r\nsk-a\r\n6;x=1\r\n/b+c\"d\r\n{:x}\r\n{third}\r\n0\r\nT: 1\r\n\r\nNEXT",
        third.len()
    );
    let mut r = BufReader::new(body.as_bytes());
    let mut out = Vec::new();
    copy_body(&mut r, &mut out, Body::Chunked, &masks)
        .await
        .unwrap();
    let out = String::from_utf8(out).unwrap();
    assert!(!out.contains("sk-"), "{out}");
    assert!(out.ends_with("0\r\nT: 1\r\n\r\n"), "{out}");
    // The chunks the sandbox gets join to as many bytes.
    let mut rest = out.as_str();
    let mut data = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size, 16).unwrap();
        if n == 0 {
            break;
        }
        data.push_str(&after[..n]);
        rest = &after[n + 2..];
    }
    assert_eq!(data.len(), 4 + 6 + third.len());
    let mut next = String::new();
    r.read_to_string(&mut next).await.unwrap();
    assert_eq!(next, "NEXT");
}

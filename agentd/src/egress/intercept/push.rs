//! A push to a forge's repository ([`super::super::forge`]): its commands
//! are read and checked before anything of it reaches the forge.

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use super::super::forge::{self, COMMANDS_MAX, Rule};
use super::super::strict::Body;
use super::{Pushed, copy_body};

/// Most bytes read ahead for a push's commands (the first chunks may
/// carry the start of its pack).
const AHEAD_MAX: usize = 4 * COMMANDS_MAX;

/// Read buffer.
const STEP: usize = 64 * 1024;

/// Most chunks the commands may come in.
const CHUNKS_MAX: usize = 65_536;

/// Most refs a log entry names (the others are counted).
const LOGGED_REFS: usize = 20;

/// A push request, its head read.
pub(super) struct Push<'a> {
    /// The head to send (rewritten, the token in).
    pub head: &'a [u8],
    /// How its body is framed.
    pub body: Body,
    /// The repository's rules.
    pub rule: &'a Rule,
    /// It has a `Content-Encoding`.
    pub encoded: bool,
    /// Told of the push.
    pub pushed: Option<&'a Pushed>,
}

/// Pass on the push whose request head (rewritten, the token in) is
/// `head` and whose body of `body` follows in `r`, if `rule` allows every
/// ref it updates: then (bytes read, `None`). Otherwise nothing of it is
/// sent, the rest of its body is read, and the answer that tells git why
/// is returned: (bytes read, `Some(answer)`).
pub(super) async fn inspect<R, W>(
    r: &mut BufReader<R>,
    w: &mut W,
    push: Push<'_>,
) -> std::io::Result<(u64, Option<Vec<u8>>)>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let Push {
        head,
        body,
        rule,
        encoded,
        pushed,
    } = push;
    if encoded {
        let why = "a compressed push (Content-Encoding) is not passed on";
        if let Some(p) = pushed {
            p(rule, false, format!("push refused: {why}"));
        }
        let n = copy_body(r, &mut tokio::io::sink(), body, &[]).await?;
        let message = format!("push to {} refused: {why}", rule.url);
        let caps = ["side-band-64k".to_owned()];
        return Ok((n, Some(forge::refused_answer(&message, &[], &caps))));
    }
    let (data, raw, rest, chunked) = read_ahead(r, body).await?;
    let verdict = match forge::commands(&data) {
        Ok(Some((cmds, caps))) => {
            let mut refs: Vec<String> = cmds
                .iter()
                .take(LOGGED_REFS)
                .map(|c| {
                    format!(
                        "{} {}..{}",
                        crate::git::refs::shown(&c.name),
                        &c.old[..12],
                        &c.new[..12]
                    )
                })
                .collect();
            if cmds.len() > LOGGED_REFS {
                refs.push(format!("… and {} more", cmds.len() - LOGGED_REFS));
            }
            let refused: Vec<(String, String)> = cmds
                .iter()
                .filter_map(|c| forge::refusal(c, rule).map(|why| (c.name.clone(), why)))
                .collect();
            Ok((refs.join(", "), refused, caps))
        }
        Ok(None) => Err(format!(
            "a push whose commands do not end within its first {} MiB",
            AHEAD_MAX >> 20
        )),
        Err(why) => Err(why),
    };
    let tell = |allowed: bool, what: String| {
        if let Some(p) = pushed {
            p(
                rule,
                allowed,
                crate::text::clamp_to(&what, 4096).into_owned(),
            );
        }
    };
    match verdict {
        Ok((refs, refused, _)) if refused.is_empty() => {
            tell(true, format!("push of {refs}: allowed"));
            w.write_all(head).await?;
            if chunked {
                if !data.is_empty() {
                    w.write_all(format!("{:x}\r\n", data.len()).as_bytes())
                        .await?;
                    w.write_all(&data).await?;
                    w.write_all(b"\r\n").await?;
                }
            } else {
                w.write_all(&data).await?;
            }
            let n = copy_body(r, w, rest, &[]).await?;
            Ok((raw + n, None))
        }
        Ok((refs, refused, caps)) => {
            let mut why: Vec<String> = refused
                .iter()
                .take(LOGGED_REFS)
                .map(|(name, why)| format!("{}: {why}", crate::git::refs::shown(name)))
                .collect();
            if refused.len() > LOGGED_REFS {
                why.push(format!("… and {} more", refused.len() - LOGGED_REFS));
            }
            tell(
                false,
                format!("push of {refs}: refused ({})", why.join("; ")),
            );
            let n = copy_body(r, &mut tokio::io::sink(), rest, &[]).await?;
            let message = format!(
                "push to {} refused by the sandbox's forge rules: {}",
                rule.url,
                why.join("; ")
            );
            Ok((
                raw + n,
                Some(forge::refused_answer(&message, &refused, &caps)),
            ))
        }
        Err(why) => {
            tell(false, format!("push refused: {why}"));
            let n = copy_body(r, &mut tokio::io::sink(), rest, &[]).await?;
            let message = format!("push to {} refused: {why}", rule.url);
            let caps = ["side-band-64k".to_owned()];
            Ok((raw + n, Some(forge::refused_answer(&message, &[], &caps))))
        }
    }
}

/// Read the body's first bytes until the push's commands are complete (or
/// wrong), at most [`AHEAD_MAX`]; (their data, bytes read, what of the
/// body is left, whether it is chunked).
async fn read_ahead<R>(
    r: &mut BufReader<R>,
    body: Body,
) -> std::io::Result<(Vec<u8>, u64, Body, bool)>
where
    R: AsyncRead + Unpin,
{
    let mut data = Vec::new();
    // Where the pkt-lines were read to: each byte is looked at once, however
    // small the pieces it comes in.
    let mut at = 0;
    let mut done = |d: &[u8]| !matches!(forge::commands_end(d, &mut at), Ok(None));
    match body {
        Body::Length(mut left) => {
            let mut buf = vec![0u8; STEP];
            while left > 0 && data.len() < AHEAD_MAX && !done(&data) {
                let want = usize::try_from(left)
                    .unwrap_or(usize::MAX)
                    .min(STEP)
                    .min(AHEAD_MAX - data.len());
                let n = r.read(&mut buf[..want]).await?;
                if n == 0 {
                    return Err(std::io::Error::other("the push ended early"));
                }
                data.extend_from_slice(&buf[..n]);
                left -= n as u64;
            }
            let raw = data.len() as u64;
            Ok((data, raw, Body::Length(left), false))
        }
        Body::Chunked => {
            let mut raw = 0u64;
            let mut chunks = 0usize;
            while !done(&data) {
                chunks += 1;
                if chunks > CHUNKS_MAX {
                    return Err(std::io::Error::other(format!(
                        "a push whose commands come in more than {CHUNKS_MAX} chunks"
                    )));
                }
                let mut line = Vec::new();
                let n = (&mut *r).take(1024).read_until(b'\n', &mut line).await?;
                if n == 0 || !line.ends_with(b"\n") {
                    return Err(std::io::Error::other("a chunk size line is broken"));
                }
                raw += n as u64;
                let text = String::from_utf8_lossy(&line);
                let hex = text.trim().split(';').next().unwrap_or("").trim();
                let size = (!hex.is_empty()
                    && hex.len() <= 8
                    && hex.bytes().all(|b| b.is_ascii_hexdigit()))
                .then(|| usize::from_str_radix(hex, 16).ok())
                .flatten()
                .ok_or_else(|| std::io::Error::other("a chunk size is not hex"))?;
                if size == 0 {
                    return Err(std::io::Error::other(
                        "the push ended before its commands did",
                    ));
                }
                if data.len().saturating_add(size) > AHEAD_MAX {
                    return Err(std::io::Error::other(format!(
                        "a push whose commands do not end within its first {} MiB",
                        AHEAD_MAX >> 20
                    )));
                }
                let at = data.len();
                data.resize(at + size, 0);
                r.read_exact(&mut data[at..]).await?;
                let mut end = Vec::new();
                (&mut *r).take(2).read_until(b'\n', &mut end).await?;
                if end != b"\r\n" && end != b"\n" {
                    return Err(std::io::Error::other("a chunk does not end with CRLF"));
                }
                raw += (size + end.len()) as u64;
            }
            Ok((data, raw, Body::Chunked, true))
        }
        Body::None | Body::UntilEnd => Ok((data, 0, Body::None, false)),
    }
}

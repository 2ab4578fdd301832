//! Copying a message's body from one side of an intercepted connection
//! to the other, as it is framed, masking what must not pass.

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use super::super::gateway::HEAD_MAX;
use super::super::mask::Masked;
use super::super::strict::Body;

/// Copy exactly `left` bytes from `r` through `out`, with `buf`; an
/// early end is an error saying `early`.
async fn copy_exact<R, W>(
    r: &mut BufReader<R>,
    buf: &mut [u8],
    mut left: u64,
    out: &mut Masked<'_, W>,
    early: &str,
) -> std::io::Result<u64>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let total = left;
    while left > 0 {
        let want = usize::try_from(left.min(buf.len() as u64)).unwrap_or(buf.len());
        let n = r.read(&mut buf[..want]).await?;
        if n == 0 {
            return Err(std::io::Error::other(early.to_owned()));
        }
        out.write(&buf[..n]).await?;
        left -= n as u64;
    }
    Ok(total)
}

/// Copy one body of `framing` from `r` to `w`, masking `masks`; its bytes.
pub(super) async fn copy_body<R, W>(
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
        Body::Length(left) => {
            total += copy_exact(r, &mut buf, left, &mut out, "the body ended early").await?;
        }
        Body::UntilEnd => loop {
            let n = match r.read(&mut buf).await {
                Ok(n) => n,
                // Many hosts close without TLS's close_notify: that ends
                // this body as well.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => 0,
                Err(e) => return Err(e),
            };
            if n == 0 {
                break;
            }
            out.write(&buf[..n]).await?;
            total += n as u64;
        },
        Body::Chunked => {
            // The data of the chunks, masked as one, in chunks of its own.
            let mut data = Masked::new(&mut *out.w, masks);
            data.chunked = true;
            loop {
                let mut line = Vec::new();
                let n = (&mut *r).take(1024).read_until(b'\n', &mut line).await?;
                if n == 0 || !line.ends_with(b"\n") {
                    return Err(std::io::Error::other("a chunk size line is broken"));
                }
                total += n as u64;
                let text = String::from_utf8_lossy(&line);
                let size =
                    u64::from_str_radix(text.trim().split(';').next().unwrap_or("").trim(), 16)
                        .map_err(|_| std::io::Error::other("a chunk size is not hex"))?;
                if size == 0 {
                    break;
                }
                total += copy_exact(r, &mut buf, size, &mut data, "a chunk ended early").await?;
                let mut end = Vec::new();
                (&mut *r).take(2).read_until(b'\n', &mut end).await?;
                if end != b"\r\n" && end != b"\n" {
                    return Err(std::io::Error::other("a chunk does not end with CRLF"));
                }
                total += end.len() as u64;
            }
            data.flush().await?;
            out.w.write_all(b"0\r\n").await?;
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
        }
    }
    out.flush().await?;
    Ok(total)
}

//! What the secret-swapping gateway masks in everything it sends back to
//! the sandbox ([`super::intercept`]): each value, the forms a host may
//! reflect it in, and every run of [`PARTIAL`] of its bytes; streaming, so
//! that a value split across reads or chunks is still found.

use tokio::io::{AsyncWrite, AsyncWriteExt};

/// The shortest run of a value's bytes that is masked on its own.
pub(super) const PARTIAL: usize = 12;

/// Mask every occurrence of each of `masks` in `buf` with `*`s.
pub(super) fn mask(buf: &mut [u8], masks: &[Vec<u8>]) {
    // Runs of PARTIAL bytes of a value, wherever they are: one look-up per
    // position rather than a scan per run.
    let partial: std::collections::HashSet<&[u8]> = masks
        .iter()
        .filter(|m| m.len() == PARTIAL)
        .map(Vec::as_slice)
        .collect();
    if !partial.is_empty() && buf.len() >= PARTIAL {
        let found: Vec<usize> = (0..=buf.len() - PARTIAL)
            .filter(|&i| partial.contains(&buf[i..i + PARTIAL]))
            .collect();
        for i in found {
            buf[i..i + PARTIAL].fill(b'*');
        }
    }
    for m in masks.iter().filter(|m| m.len() != PARTIAL) {
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
/// still found, as the last bytes of each read wait for the next. With
/// `chunked`, what goes on is framed as chunks of its own (the host's
/// chunks are undone first, so that a value split across them is found).
pub(super) struct Masked<'a, W> {
    pub(super) w: &'a mut W,
    masks: &'a [Vec<u8>],
    held: Vec<u8>,
    keep: usize,
    pub(super) chunked: bool,
}

impl<'a, W: AsyncWrite + Unpin> Masked<'a, W> {
    pub(super) fn new(w: &'a mut W, masks: &'a [Vec<u8>]) -> Self {
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
            chunked: false,
        }
    }

    pub(super) async fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.held.extend_from_slice(data);
        mask(&mut self.held, self.masks);
        // Only the end that could begin a value waits for the next bytes:
        // the rest of a streamed event goes on now.
        let wait = unfinished(&self.held, self.masks).min(self.keep);
        self.emit(self.held.len() - wait).await
    }

    /// Send the first `n` bytes held.
    async fn emit(&mut self, n: usize) -> std::io::Result<()> {
        if n == 0 {
            return Ok(());
        }
        if self.chunked {
            self.w.write_all(format!("{n:x}\r\n").as_bytes()).await?;
        }
        self.w.write_all(&self.held[..n]).await?;
        if self.chunked {
            self.w.write_all(b"\r\n").await?;
        }
        self.held.drain(..n);
        Ok(())
    }

    pub(super) async fn flush(&mut self) -> std::io::Result<()> {
        mask(&mut self.held, self.masks);
        self.emit(self.held.len()).await?;
        self.w.flush().await
    }
}

/// What is masked of `value`: its bytes, and the forms a host may reflect
/// them in (JSON-escaped, with `/` escaped as PHP does, percent-encoded).
pub(super) fn mask_forms(value: &[u8]) -> Vec<Vec<u8>> {
    let (mut json, mut upper, mut lower) = (Vec::new(), Vec::new(), Vec::new());
    for &b in value {
        match b {
            b'"' | b'\\' => json.extend_from_slice(&[b'\\', b]),
            _ => json.push(b),
        }
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            upper.push(b);
            lower.push(b);
        } else {
            upper.extend_from_slice(format!("%{b:02X}").as_bytes());
            lower.extend_from_slice(format!("%{b:02x}").as_bytes());
        }
    }
    let slashes = super::intercept::replace_all(&json, b"/", b"\\/");
    let mut forms = vec![value.to_vec()];
    for f in [json, slashes, upper, lower] {
        if !forms.contains(&f) {
            forms.push(f);
        }
    }
    // A host may show part of a key (an error message that shortens it):
    // every run of PARTIAL of its bytes is masked too.
    if value.len() > PARTIAL {
        for w in value.windows(PARTIAL) {
            if !forms.iter().any(|f| f.as_slice() == w) {
                forms.push(w.to_vec());
            }
        }
    }
    forms
}

/// How many of the last bytes of `buf` are the start of one of `masks`
/// (the longest such end, shorter than the mask itself).
fn unfinished(buf: &[u8], masks: &[Vec<u8>]) -> usize {
    masks
        .iter()
        .map(|m| {
            let most = m.len().saturating_sub(1).min(buf.len());
            (1..=most)
                .rev()
                .find(|&l| buf[buf.len() - l..] == m[..l])
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_streamed_event_is_not_held_back_unless_it_may_end_in_a_value() {
        let masks = mask_forms(b"sk-real-value-0123456789");
        let mut sink = Vec::new();
        let mut m = Masked::new(&mut sink, &masks);
        m.write(b"data: {\"text\":\"hello\"}\n\n").await.unwrap();
        assert_eq!(
            m.w.as_slice(),
            b"data: {\"text\":\"hello\"}\n\n",
            "sent at once"
        );
        // The start of a value waits, and is masked with the rest of it.
        m.write(b"echo sk-real-").await.unwrap();
        assert_eq!(m.w.len(), 29, "'echo ' goes, 'sk-real-' waits");
        m.write(b"value-0123456789!").await.unwrap();
        m.flush().await.unwrap();
        let s = String::from_utf8(sink).unwrap();
        assert!(s.ends_with(&format!("echo {}!", "*".repeat(24))), "{s}");
    }
}

//! What the secret-swapping gateway masks in everything it sends back to
//! the sandbox ([`super::intercept`]): each value, the forms a host may
//! reflect it in, and every run of [`PARTIAL`] of its bytes; streaming, so
//! that a value split across reads or chunks is still found.

use std::collections::HashSet;

use tokio::io::{AsyncWrite, AsyncWriteExt};

/// The shortest run of a value's bytes that is masked on its own.
pub(super) const PARTIAL: usize = 12;

/// The forms to mask, ready for a search over a stream: whole forms, and
/// runs of [`PARTIAL`] bytes (looked up by hash, with every start of one,
/// to know what may still become one).
struct Needles<'a> {
    whole: Vec<&'a [u8]>,
    runs: HashSet<&'a [u8]>,
    run_starts: HashSet<&'a [u8]>,
    /// The length of the longest.
    longest: usize,
}

impl<'a> Needles<'a> {
    fn new(masks: &'a [Vec<u8>]) -> Self {
        let mut n = Self {
            whole: Vec::new(),
            runs: HashSet::new(),
            run_starts: HashSet::new(),
            longest: 0,
        };
        for m in masks.iter().filter(|m| !m.is_empty()) {
            n.longest = n.longest.max(m.len());
            if m.len() == PARTIAL {
                n.runs.insert(m);
                n.run_starts.extend((1..PARTIAL).map(|l| &m[..l]));
            } else {
                n.whole.push(m);
            }
        }
        n
    }

    /// Which bytes of `buf` are in an occurrence of a form (occurrences
    /// may overlap).
    fn covered(&self, buf: &[u8]) -> Vec<bool> {
        let mut cover = vec![false; buf.len()];
        let mut mark = |i: usize, n: usize| cover[i..i + n].fill(true);
        if !self.runs.is_empty() {
            for (i, w) in buf.windows(PARTIAL).enumerate() {
                if self.runs.contains(w) {
                    mark(i, PARTIAL);
                }
            }
        }
        for m in &self.whole {
            for (i, w) in buf.windows(m.len()).enumerate() {
                if w == *m {
                    mark(i, m.len());
                }
            }
        }
        cover
    }

    /// Where the earliest end of `buf` starts that is the start of a form,
    /// not yet all of it (what comes next may complete it); `buf.len()`
    /// when there is none.
    fn unfinished(&self, buf: &[u8]) -> usize {
        let from = buf.len().saturating_sub(self.longest.saturating_sub(1));
        (from..buf.len())
            .find(|&s| {
                let end = &buf[s..];
                (end.len() < PARTIAL && self.run_starts.contains(end))
                    || self
                        .whole
                        .iter()
                        .any(|m| m.len() > end.len() && m.starts_with(end))
            })
            .unwrap_or(buf.len())
    }
}

/// Bytes towards the sandbox, masked: a value split across two reads is
/// still found, as the bytes that may begin one wait for the next. Each
/// search runs over the bytes as the host sent them (those already sent
/// are kept, unmasked, as far back as a value could reach), so that what
/// was masked earlier never hides the start of a value. With `chunked`,
/// what goes on is framed as chunks of its own (the host's chunks are
/// undone first, so that a value split across them is found).
pub(super) struct Masked<'a, W> {
    pub(super) w: &'a mut W,
    needles: Needles<'a>,
    /// The host's bytes: the last ones sent, then those held.
    seen: Vec<u8>,
    /// How many of `seen` were sent.
    sent: usize,
    pub(super) chunked: bool,
}

impl<'a, W: AsyncWrite + Unpin> Masked<'a, W> {
    pub(super) fn new(w: &'a mut W, masks: &'a [Vec<u8>]) -> Self {
        Self {
            w,
            needles: Needles::new(masks),
            seen: Vec::new(),
            sent: 0,
            chunked: false,
        }
    }

    pub(super) async fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.seen.extend_from_slice(data);
        // Only the end that could begin a value waits for the next bytes:
        // the rest of a streamed event goes on now.
        let upto = self.needles.unfinished(&self.seen);
        self.emit(upto).await
    }

    /// Send what is held up to `upto` in `seen`, masked.
    async fn emit(&mut self, upto: usize) -> std::io::Result<()> {
        if upto <= self.sent {
            return Ok(());
        }
        let cover = self.needles.covered(&self.seen);
        let out: Vec<u8> = (self.sent..upto)
            .map(|i| if cover[i] { b'*' } else { self.seen[i] })
            .collect();
        if self.chunked {
            self.w
                .write_all(format!("{:x}\r\n", out.len()).as_bytes())
                .await?;
        }
        self.w.write_all(&out).await?;
        if self.chunked {
            self.w.write_all(b"\r\n").await?;
        }
        self.sent = upto;
        // A value that covers a held byte starts at most this far back.
        let forget = self
            .sent
            .saturating_sub(self.needles.longest.saturating_sub(1));
        self.seen.drain(..forget);
        self.sent -= forget;
        Ok(())
    }

    pub(super) async fn flush(&mut self) -> std::io::Result<()> {
        self.emit(self.seen.len()).await?;
        self.w.flush().await
    }
}

/// `value` and the forms a host may reflect it in whole (JSON-escaped,
/// with `/` escaped as PHP does, percent-encoded), without the runs of
/// [`mask_forms`]: a mask hit on a run the sandbox can guess the rest of
/// would tell it one byte at a time.
pub(super) fn whole_forms(value: &[u8]) -> Vec<Vec<u8>> {
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
    forms
}

/// What is masked of `value`: its whole forms ([`whole_forms`]), and,
/// since a host may show part of a key (an error message that shortens
/// it), every run of PARTIAL of its bytes.
pub(super) fn mask_forms(value: &[u8]) -> Vec<Vec<u8>> {
    let mut forms = whole_forms(value);
    if value.len() > PARTIAL {
        for w in value.windows(PARTIAL) {
            if !forms.iter().any(|f| f.as_slice() == w) {
                forms.push(w.to_vec());
            }
        }
    }
    forms
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

#[cfg(test)]
mod attacks {
    use super::*;

    /// A value shaped like a real key (a '/' and a '+', as base64 has).
    const VALUE: &[u8] = b"sk-test/0123456789abcdef0123456789e40cd72436+x";

    /// `text` through a masker in writes of `sizes` (cycled), chunked or
    /// not; what the sandbox gets, de-chunked.
    async fn through(text: &[u8], sizes: &[usize], chunked: bool) -> Vec<u8> {
        let masks = mask_forms(VALUE);
        let mut sink = Vec::new();
        {
            let mut m = Masked::new(&mut sink, &masks);
            m.chunked = chunked;
            let mut rest = text;
            for &n in sizes.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (now, later) = rest.split_at(n.min(rest.len()));
                m.write(now).await.unwrap();
                rest = later;
            }
            m.flush().await.unwrap();
        }
        if chunked { dechunk(&sink) } else { sink }
    }

    fn dechunk(mut s: &[u8]) -> Vec<u8> {
        let mut data = Vec::new();
        while !s.is_empty() {
            let i = s.windows(2).position(|w| w == b"\r\n").unwrap();
            let n = usize::from_str_radix(std::str::from_utf8(&s[..i]).unwrap(), 16).unwrap();
            data.extend_from_slice(&s[i + 2..i + 2 + n]);
            assert_eq!(&s[i + 2 + n..i + 4 + n], b"\r\n");
            s = &s[i + 4 + n..];
        }
        data
    }

    fn stars(n: usize) -> Vec<u8> {
        vec![b'*'; n]
    }

    /// Each form a host may reflect the value in, in writes of every size
    /// from one byte to one more than the form, as the data of a chunked
    /// body or not: not one byte of it comes back.
    #[tokio::test]
    async fn a_value_in_writes_of_every_size_comes_back_all_masked() {
        for form in mask_forms(VALUE).iter().filter(|f| f.len() > PARTIAL) {
            let text = [b"echo ".as_slice(), form, b" done"].concat();
            let want = [b"echo ".as_slice(), &stars(form.len()), b" done"].concat();
            for size in 1..=form.len() + 1 {
                for chunked in [false, true] {
                    let got = through(&text, &[size], chunked).await;
                    assert_eq!(
                        String::from_utf8_lossy(&got),
                        String::from_utf8_lossy(&want),
                        "writes of {size} bytes, chunked: {chunked}"
                    );
                }
            }
        }
    }

    /// The value split in three at every pair of places (two boundaries
    /// anywhere, inside it or around it).
    #[tokio::test]
    async fn a_value_split_at_every_boundary_comes_back_all_masked() {
        let text = [b"echo ".as_slice(), VALUE, b"!"].concat();
        let want = [b"echo ".as_slice(), &stars(VALUE.len()), b"!"].concat();
        for i in 0..=text.len() {
            for j in i..=text.len() {
                let got = through(&text, &[i, j - i, text.len()], false).await;
                assert_eq!(got, want, "split at {i} and {j}");
            }
        }
    }

    /// What a host shows of part of a value (its first 24 bytes, its last
    /// 14), in writes of every size: masked all the same.
    #[tokio::test]
    async fn a_part_of_a_value_in_writes_of_every_size_is_masked() {
        let tail = &VALUE[VALUE.len() - 14..];
        for part in [&VALUE[..24], tail] {
            let text = [b"unknown key ".as_slice(), part, b"."].concat();
            let want = [b"unknown key ".as_slice(), &stars(part.len()), b"."].concat();
            for size in 1..=text.len() + 1 {
                let got = through(&text, &[size], true).await;
                assert_eq!(
                    String::from_utf8_lossy(&got),
                    String::from_utf8_lossy(&want),
                    "writes of {size} bytes"
                );
            }
        }
    }
}

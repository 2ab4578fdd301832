//! Small helpers for text that agentd keeps or quotes (cut to a bound,
//! control characters escaped) and for timestamps as D-Bus carries them.
//! A leaf: it uses nothing else of agentd.

use std::time::{SystemTime, UNIX_EPOCH};

/// Longest text agentd keeps about something that failed (a state reason,
/// the last sync's result, a history entry's error): it is stored in the
/// registry and shown in properties, so a sandbox that makes an error
/// message huge must not make them huge too.
pub const TEXT_MAX: usize = 2048;

/// `text` cut to at most [`TEXT_MAX`] bytes (on a character boundary),
/// saying how much was left out.
#[must_use]
pub fn clamp_text(text: &str) -> std::borrow::Cow<'_, str> {
    clamp_to(text, TEXT_MAX)
}

/// `text` cut to at most `max` bytes, saying how much was left out.
#[must_use]
pub fn clamp_to(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max.saturating_sub(40);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes left out)", &text[..end], text.len() - end).into()
}

/// A value from a request or a sandbox, fit to quote in a message: control
/// characters escaped and at most 200 characters.
#[must_use]
pub fn shown(value: &str) -> String {
    let escaped: String = value.escape_debug().take(200).collect();
    if value.escape_debug().nth(200).is_some() {
        format!("{escaped}… ({} bytes)", value.len())
    } else {
        escaped
    }
}

/// Microseconds since the epoch (0 for `None`), as timestamps go on D-Bus.
#[must_use]
pub fn micros(t: Option<SystemTime>) -> u64 {
    t.and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

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

/// `secs` since the epoch as UTC `YYYYMMDD-HHMMSS` (names that sort by
/// time).
#[must_use]
pub fn utc_compact(secs: u64) -> String {
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rest = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

/// Microseconds since the epoch (0 for `None`), as timestamps go on D-Bus.
#[must_use]
pub fn micros(t: Option<SystemTime>) -> u64 {
    t.and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_names_sort_by_time() {
        assert_eq!(utc_compact(0), "19700101-000000");
        assert_eq!(utc_compact(1_795_714_501), "20261126-173501");
        assert_eq!(utc_compact(951_782_400), "20000229-000000");
    }
}

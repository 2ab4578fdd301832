//! Durations on the command line.

/// A duration with its unit (`90s`, `30m`, `2h`, `1d`), or `0`, in
/// seconds.
pub(super) fn duration_secs(s: &str) -> Result<u32, String> {
    if s == "0" {
        return Ok(0);
    }
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let per = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => {
            return Err(format!(
                "'{s}': give a number with a unit: 90s, 30m, 2h, 1d (or 0)"
            ));
        }
    };
    n.parse::<u32>()
        .ok()
        .and_then(|n| n.checked_mul(per))
        .ok_or_else(|| format!("'{s}' is not a duration agentctl can take"))
}

//! `agentctl stats`: what a sandbox uses, once or every few seconds.
//!
//! agentd keeps no history: CPU % is worked out here from two samples, the
//! sandbox's start and now for one look, the previous sample and now with
//! `--follow`.

use std::collections::BTreeMap;
use std::time::Duration;

use super::*;

/// One answer of `GetStats`.
struct Sample {
    figures: BTreeMap<String, u64>,
    info: BTreeMap<String, String>,
}

impl Sample {
    fn get(&self, k: &str) -> Option<u64> {
        self.figures.get(k).copied()
    }
}

pub(super) async fn run(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    name: &str,
    json: bool,
    follow: Option<u32>,
) -> Result<i32> {
    let sb = lookup(conn, manager, name).await?;
    let mut previous: Option<Sample> = None;
    loop {
        let (figures, info) = crate::bus::quick("GetStats", crate::bus::limit(), async {
            Ok(sb.get_stats().await?)
        })
        .await?;
        let now = Sample {
            figures: figures.into_iter().collect(),
            info: info.into_iter().collect(),
        };
        let v = to_json(name, &now, previous.as_ref());
        if json && follow.is_some() {
            println!("{}", output::json_line(&v));
        } else if json {
            println!("{}", output::json(&v));
        } else {
            print_human(name, &v, &now);
        }
        let Some(every) = follow else { return Ok(0) };
        if now.info.contains_key("state") {
            return Ok(0);
        }
        previous = Some(now);
        let _ = std::io::stdout().flush();
        tokio::time::sleep(Duration::from_secs(u64::from(every))).await;
    }
}

/// CPU % between two samples (100 = one CPU busy all the time), and the
/// µs it covers.
fn cpu_percent(now: &Sample, previous: Option<&Sample>) -> Option<(f64, u64)> {
    let cpu = now.get("cpu_usec")?;
    let (cpu0, wall) = match previous {
        Some(p) => (
            p.get("cpu_usec")?,
            now.get("sampled_at")?.checked_sub(p.get("sampled_at")?)?,
        ),
        None => (0, now.get("uptime_usec")?),
    };
    if wall == 0 {
        return None;
    }
    #[allow(clippy::cast_precision_loss)]
    let pct = cpu.saturating_sub(cpu0) as f64 * 100.0 / wall as f64;
    Some(((pct * 10.0).round() / 10.0, wall))
}

/// The JSON form (documented in docs/dbus-api.md): every figure agentd
/// gave, `cpu_percent` and the µs it covers, and `unavailable`.
fn to_json(name: &str, now: &Sample, previous: Option<&Sample>) -> serde_json::Value {
    let mut v = serde_json::Map::new();
    v.insert("name".into(), name.into());
    let state = now.info.get("state").map_or("running", String::as_str);
    v.insert("state".into(), state.into());
    for (k, n) in &now.figures {
        v.insert(k.clone(), (*n).into());
    }
    if let Some((pct, over)) = cpu_percent(now, previous) {
        v.insert("cpu_percent".into(), pct.into());
        v.insert("cpu_percent_over_usec".into(), over.into());
    }
    let unavailable: serde_json::Map<String, serde_json::Value> = now
        .info
        .iter()
        .filter(|(k, _)| *k != "state")
        .map(|(k, why)| (k.clone(), why.clone().into()))
        .collect();
    v.insert("unavailable".into(), unavailable.into());
    v.into()
}

/// `bytes` in MiB with one decimal.
pub(super) fn mib(bytes: u64) -> String {
    #[allow(clippy::cast_precision_loss)]
    let m = bytes as f64 / f64::from(1 << 20);
    format!("{m:.1} MiB")
}

fn print_human(name: &str, v: &serde_json::Value, s: &Sample) {
    if let Some(state) = s.info.get("state") {
        crate::outln!(
            "Sandbox '{name}' is {state}: it uses nothing (`agentctl start {name}` starts it)."
        );
        return;
    }
    let why = |group: &str| {
        s.info
            .get(group)
            .map_or_else(|| "unavailable".to_owned(), |w| format!("unavailable: {w}"))
    };
    let of = |limit: Option<u64>, fmt: &dyn Fn(u64) -> String| {
        limit.map(|l| format!(" of {}", fmt(l))).unwrap_or_default()
    };
    let up = s.get("uptime_usec").unwrap_or(0) / 1_000_000;
    crate::outln!(
        "Sandbox '{name}', up {}",
        humantime::format_duration(Duration::from_secs(up))
    );
    let cpu = match (s.get("cpu_usec"), v["cpu_percent"].as_f64()) {
        (Some(us), Some(pct)) => {
            let over = v["cpu_percent_over_usec"].as_u64().unwrap_or(0);
            let window = if s.figures.contains_key("uptime_usec")
                && over == s.get("uptime_usec").unwrap_or(0)
            {
                "since start".to_owned()
            } else {
                #[allow(clippy::cast_precision_loss)]
                let secs = over as f64 / 1e6;
                format!("over the last {secs:.1} s")
            };
            #[allow(clippy::cast_precision_loss)]
            let secs = us as f64 / 1e6;
            format!("{secs:.2} s, {pct}% {window}")
        }
        (Some(us), None) => format!("{us} µs"),
        _ => why("cpu"),
    };
    crate::outln!("CPU:        {cpu}");
    let memory = match s.get("memory_current") {
        Some(cur) => format!(
            "{}{}{}",
            mib(cur),
            s.get("memory_peak")
                .map(|p| format!(" (peak {})", mib(p)))
                .unwrap_or_default(),
            of(s.get("memory_limit"), &mib)
        ),
        None => why("memory"),
    };
    crate::outln!("Memory:     {memory}");
    let disk = match s.get("disk_used") {
        Some(used) => format!("{}{}", mib(used), of(s.get("disk_limit"), &mib)),
        None => why("disk"),
    };
    crate::outln!("Disk:       {disk}");
    let pids = match s.get("pids_current") {
        Some(n) => format!("{n}{}", of(s.get("pids_limit"), &|l| l.to_string())),
        None => why("pids"),
    };
    crate::outln!("Processes:  {pids}");
    let gateway = match s.get("gateway_connections") {
        Some(n) => format!(
            "{n} connections, {} refused; {} out, {} in; last {}",
            s.get("gateway_refused").unwrap_or(0),
            mib(s.get("gateway_sent").unwrap_or(0)),
            mib(s.get("gateway_received").unwrap_or(0)),
            output::ago(s.get("last_activity").unwrap_or(0))
        ),
        None => why("gateway"),
    };
    crate::outln!("Gateway:    {gateway}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(pairs: &[(&str, u64)]) -> Sample {
        Sample {
            figures: pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect(),
            info: BTreeMap::new(),
        }
    }

    #[test]
    fn cpu_percent_is_over_the_interval_when_following_else_since_start() {
        let first = sample(&[
            ("cpu_usec", 1_000_000),
            ("sampled_at", 10_000_000),
            ("uptime_usec", 4_000_000),
        ]);
        let second = sample(&[
            ("cpu_usec", 1_500_000),
            ("sampled_at", 12_000_000),
            ("uptime_usec", 6_000_000),
        ]);
        assert_eq!(cpu_percent(&first, None), Some((25.0, 4_000_000)));
        assert_eq!(cpu_percent(&second, Some(&first)), Some((25.0, 2_000_000)));
        assert_eq!(cpu_percent(&sample(&[("uptime_usec", 1)]), None), None);
    }
}

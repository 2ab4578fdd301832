//! `agentctl doctor`: the bus as agentctl sees it, then what `agentd
//! --doctor` finds of what each backend needs, each missing piece with the
//! command that fixes it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use keystone_agent_api::ExitCode;
use serde::{Deserialize, Serialize};
use zbus::fdo::DBusProxy;

use crate::Result;
use crate::bus::{self, Which};

/// One check, as `agentd --doctor` prints it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Check {
    area: String,
    check: String,
    status: String,
    detail: String,
    #[serde(default)]
    fix: String,
}

impl Check {
    fn new(check: &str, status: &str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            area: "bus".to_owned(),
            check: check.to_owned(),
            status: status.to_owned(),
            detail: detail.into(),
            fix: fix.into(),
        }
    }
}

const START_USER: &str = "systemctl --user enable --now agentd (the unit `make install` puts in \
     place), or agentd --session";
const START_SYSTEM: &str = "sudo systemctl enable --now agentd";

/// The bus agentctl would use and whether agentd is on it.
async fn bus_checks(bus: Option<&str>, limit: Duration) -> (Vec<Check>, bool) {
    let mut checks = Vec::new();
    let root = nix::unistd::Uid::effective().is_root();
    if !root || bus == Some("session") {
        checks.push(match bus::session_address() {
            Some(a) => Check::new("session bus", "ok", a, ""),
            None => Check::new(
                "session bus",
                if bus == Some("session") {
                    "missing"
                } else {
                    "warn"
                },
                "DBUS_SESSION_BUS_ADDRESS is not set and there is no $XDG_RUNTIME_DIR/bus",
                "log in through a systemd session, or sudo loginctl enable-linger \"$USER\" for \
                 a user nobody logs in as; or use agentd on the system bus",
            ),
        });
    }
    let conn = match bus::connect(bus).await {
        Ok(c) => c,
        Err(f) => {
            let start = if bus == Some("system") || (bus.is_none() && root) {
                START_SYSTEM
            } else {
                START_USER
            };
            checks.push(Check::new("agentd", "missing", f.message, start));
            return (checks, false);
        }
    };
    let which = bus::current().cloned().unwrap_or(Which::System);
    let start = if which == Which::System {
        START_SYSTEM
    } else {
        START_USER
    };
    let asking = async {
        let (owner, activatable) = bus::agentd_state(&conn).await?;
        let pid = match owner {
            Some(owner) => Some(
                DBusProxy::new(&conn)
                    .await?
                    .get_connection_unix_process_id(owner.into())
                    .await
                    .unwrap_or(0),
            ),
            None => None,
        };
        zbus::Result::Ok((pid, activatable))
    };
    let agentd = match tokio::time::timeout(limit, asking).await {
        Err(_) => Check::new(
            "agentd",
            "missing",
            format!(
                "{} did not answer within {}s",
                which.describe(),
                limit.as_secs()
            ),
            "check the bus daemon (busctl status)",
        ),
        Ok(Err(e)) => Check::new(
            "agentd",
            "missing",
            format!("cannot ask {}: {e}", which.describe()),
            start,
        ),
        Ok(Ok((Some(pid), _))) => Check::new(
            "agentd",
            "ok",
            format!("running on {} (pid {pid})", which.describe()),
            "",
        ),
        Ok(Ok((None, true))) => Check::new(
            "agentd",
            "ok",
            format!(
                "not running; {} starts it on the first call (D-Bus activation)",
                which.describe()
            ),
            "",
        ),
        Ok(Ok((None, false))) => Check::new(
            "agentd",
            "missing",
            format!(
                "not running on {}, and the bus cannot start it",
                which.describe()
            ),
            start,
        ),
    };
    checks.push(agentd);
    (checks, which == Which::System)
}

/// agentd's binary: beside agentctl's, else on PATH.
fn agentd_binary() -> Option<PathBuf> {
    let beside = std::env::current_exe()
        .ok()
        .map(|e| e.with_file_name("agentd"));
    beside.filter(|p| p.is_file()).or_else(|| {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join("agentd"))
                .find(|p| p.is_file())
        })
    })
}

/// What `agentd --doctor` finds.
async fn agentd_checks(config: Option<&Path>, system: bool) -> Vec<Check> {
    let Some(agentd) = agentd_binary() else {
        return vec![Check {
            area: "agentd".to_owned(),
            check: "agentd binary".to_owned(),
            status: "missing".to_owned(),
            detail: "no agentd beside agentctl or on PATH".to_owned(),
            fix: "make install (from the source tree; docs/install.md)".to_owned(),
        }];
    };
    let mut cmd = tokio::process::Command::new(&agentd);
    cmd.arg("--doctor")
        .arg(if system { "--system" } else { "--session" })
        .kill_on_drop(true)
        .stdin(std::process::Stdio::null());
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    let failed = |detail: String| {
        vec![Check {
            area: "agentd".to_owned(),
            check: "agentd --doctor".to_owned(),
            status: "missing".to_owned(),
            detail,
            fix: format!("run {} --doctor to see why", agentd.display()),
        }]
    };
    match tokio::time::timeout(Duration::from_secs(60), cmd.output()).await {
        Err(_) => failed("did not finish within 60s".to_owned()),
        Ok(Err(e)) => failed(format!("cannot run {}: {e}", agentd.display())),
        Ok(Ok(out)) => match serde_json::from_slice::<Vec<Check>>(&out.stdout) {
            Ok(checks) => checks,
            Err(e) => failed(format!(
                "{} printed no checks ({e}): {}",
                agentd.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )),
        },
    }
}

/// Run the checks, print them, and exit 4 when something needed is missing.
pub async fn run(
    bus: Option<&str>,
    config: Option<&Path>,
    json: bool,
    limit: Duration,
) -> Result<i32> {
    let (mut checks, system) = bus_checks(bus, limit).await;
    checks.extend(agentd_checks(config, system).await);
    let missing = checks.iter().filter(|c| c.status == "missing").count();
    if json {
        println!("{}", crate::output::json(&checks));
    } else {
        let mut area = "";
        for c in &checks {
            if c.area != area {
                area = &c.area;
                crate::outln!("{area}:");
            }
            crate::outln!(
                "  {:<8} {:<24} {}",
                c.status,
                c.check,
                crate::output::escape_controls(&c.detail)
            );
            if !c.fix.is_empty() {
                crate::outln!("           fix: {}", crate::output::escape_controls(&c.fix));
            }
        }
        if system && !nix::unistd::Uid::effective().is_root() {
            crate::outln!(
                "agentd serves the system bus as root: `sudo agentctl doctor` checks the \
                 machine as it sees it."
            );
        }
        if missing == 0 {
            crate::outln!("Nothing needed is missing.");
        } else {
            crate::outln!("{missing} needed piece(s) missing: run the fix shown for each.");
        }
    }
    Ok(if missing == 0 {
        0
    } else {
        ExitCode::Requirements as i32
    })
}

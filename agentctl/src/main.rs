//! `agentctl`: the command-line client of Keystone Agent.

mod cli;
mod commands;
mod output;
mod tty;
mod unpack;

use clap::Parser;
use keystone_agent_api::{self as api, ExitCode};

/// A failure to report: a message and an exit code.
#[derive(Debug)]
pub struct Failure {
    code: ExitCode,
    message: String,
}

impl Failure {
    /// A failure with this code and message.
    pub fn new(code: ExitCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl From<api::Error> for Failure {
    fn from(e: api::Error) -> Self {
        if let api::Error::ZBus(zbus::Error::MethodError(name, desc, _)) = &e {
            let hint = "Is agentd running? Start it with `agentd --session` (your own sandboxes) \
                        or enable the NixOS service (keystone.agent.enable = true).";
            match name.as_str() {
                "org.freedesktop.DBus.Error.ServiceUnknown"
                | "org.freedesktop.DBus.Error.NameHasNoOwner" => {
                    return Self::new(
                        ExitCode::Requirements,
                        format!("agentd is not running on this bus. {hint}"),
                    );
                }
                "org.freedesktop.DBus.Error.AccessDenied" => {
                    return Self::new(
                        ExitCode::Requirements,
                        format!(
                            "The bus refused the call: {}. On the system bus, only members of the \
                             'keystone-agent' group may talk to agentd.",
                            desc.as_deref().unwrap_or("access denied")
                        ),
                    );
                }
                "org.freedesktop.DBus.Error.UnknownObject"
                | "org.freedesktop.DBus.Error.UnknownMethod" => {
                    return Self::new(
                        ExitCode::NotFound,
                        desc.clone().unwrap_or_else(|| name.to_string()),
                    );
                }
                _ => {}
            }
        }
        Self {
            code: e.exit_code(),
            message: e.message(),
        }
    }
}

/// Result of a command.
pub type Result<T> = std::result::Result<T, Failure>;

/// How long connecting to the bus may take, the D-Bus handshake included:
/// a socket that accepts and never answers must not hold agentctl.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

async fn connect(bus: Option<&str>) -> Result<zbus::Connection> {
    let session_default = !nix::unistd::Uid::effective().is_root()
        && std::env::var_os("DBUS_SESSION_BUS_ADDRESS").is_some();
    let which = bus.unwrap_or(if session_default { "session" } else { "system" });
    let connecting = async {
        match which {
            "system" => zbus::Connection::system().await,
            "session" => zbus::Connection::session().await,
            addr => match zbus::connection::Builder::address(addr) {
                Ok(b) => b.build().await,
                Err(e) => Err(e),
            },
        }
    };
    let Ok(conn) = tokio::time::timeout(CONNECT_TIMEOUT, connecting).await else {
        let (bus, check) = match which {
            "system" => (
                "the system bus".to_owned(),
                "busctl --system status".to_owned(),
            ),
            "session" => (
                "the session bus".to_owned(),
                "busctl --user status".to_owned(),
            ),
            addr => (
                format!("the bus at {addr}"),
                format!("busctl --address={addr} status"),
            ),
        };
        return Err(Failure::new(
            ExitCode::Requirements,
            format!(
                "Connecting to {bus} did not complete the D-Bus handshake within {}s: is it a \
                 D-Bus socket, and is its bus daemon healthy? Check with `{check}`, or pick \
                 another bus with --bus system|session|ADDRESS.",
                CONNECT_TIMEOUT.as_secs()
            ),
        ));
    };
    conn.map_err(|e| {
        Failure::new(
            ExitCode::Requirements,
            format!(
                "Cannot connect to the {which} bus: {e}. Is agentd running? Start it with \
                 `agentd --session`, or pick the bus with --bus system|session|ADDRESS."
            ),
        )
    })
}

fn main() -> std::process::ExitCode {
    // Usage errors exit 4 ("requirements not met"), not clap's 2, which
    // means "invalid state" here.
    let cli = match cli::Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return std::process::ExitCode::from(if e.use_stderr() {
                ExitCode::Requirements as u8
            } else {
                0
            });
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            crate::errln!("agentctl: cannot start: {e}");
            return std::process::ExitCode::from(ExitCode::Failed as u8);
        }
    };
    let result = runtime.block_on(async {
        let conn = connect(cli.bus.as_deref()).await?;
        commands::run(&conn, cli.command).await
    });
    // Do not wait for a stdin reader that is blocked on a terminal.
    runtime.shutdown_background();
    match result {
        Ok(code) => std::process::ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(f) => {
            crate::errln!("agentctl: {}", f.message);
            std::process::ExitCode::from(f.code as u8)
        }
    }
}

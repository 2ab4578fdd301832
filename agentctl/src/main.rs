//! `agentctl`: the command-line client of Keystone Agent.

mod bus;
mod cli;
mod commands;
mod doctor;
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
            match name.as_str() {
                "org.freedesktop.DBus.Error.ServiceUnknown"
                | "org.freedesktop.DBus.Error.NameHasNoOwner" => {
                    return Self::new(ExitCode::Requirements, bus::not_running_hint());
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
    let limit = std::time::Duration::from_secs(cli.call_timeout.max(1));
    bus::set_limit(limit);
    let result = runtime.block_on(async {
        match cli.command {
            cli::Command::Completions { shell } => {
                let mut cmd = <cli::Cli as clap::CommandFactory>::command();
                let mut script = Vec::new();
                clap_complete::generate(shell, &mut cmd, "agentctl", &mut script);
                return std::io::Write::write_all(&mut std::io::stdout(), &script)
                    .map(|()| 0)
                    .map_err(|e| Failure::new(ExitCode::Failed, format!("cannot print: {e}")));
            }
            cli::Command::Manpages { dir } => {
                let cmd = <cli::Cli as clap::CommandFactory>::command();
                return clap_mangen::generate_to(cmd, &dir)
                    .map(|()| 0)
                    .map_err(|e| {
                        Failure::new(
                            ExitCode::Failed,
                            format!("cannot write the man pages into {}: {e}", dir.display()),
                        )
                    });
            }
            cli::Command::Doctor { json, config } => {
                return doctor::run(cli.bus.as_deref(), config.as_deref(), json, limit).await;
            }
            c @ (cli::Command::Ssh { .. }
            | cli::Command::SshConfig { .. }
            | cli::Command::SshProxy { .. }) => {
                return commands::ssh::run(cli.bus.as_deref(), c).await;
            }
            _ => {}
        }
        let conn = bus::connect(cli.bus.as_deref()).await?;
        let what = cli.command.verb();
        if cli.command.waits() {
            bus::watched(&conn, what, limit, commands::run(&conn, cli.command)).await
        } else {
            bus::quick(what, limit, commands::run(&conn, cli.command)).await
        }
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

//! `agentd`: parse arguments, set up logging, run the library.

use std::path::PathBuf;
use std::process::ExitCode;

use agentd::dbus::Bus;
use clap::{ArgGroup, Parser};

/// Keystone Agent daemon: runs sandboxes for AI coding agents and serves
/// org.keystone.Agent1 on D-Bus for agentctl.
#[derive(Debug, Parser)]
#[command(version, group(ArgGroup::new("bus").args(["system", "session", "address"])))]
#[command(
    after_help = "Examples:\n  agentd --session                  serve your own sandboxes on your session bus\n  agentd --system --config /etc/keystone-agent/agentd.json\n  agentd --check-config agentd.json  validate a configuration and exit\n  agentd --install-agents            download Claude Code, Codex and Gemini CLI into the cache"
)]
struct Args {
    /// Serve on the system bus (default when run as root).
    #[arg(long)]
    system: bool,
    /// Serve on the session bus (default otherwise).
    #[arg(long)]
    session: bool,
    /// Serve on the bus daemon at this D-Bus address (tests, containers).
    #[arg(long, value_name = "ADDR")]
    address: Option<String>,
    /// Configuration file (JSON, as the NixOS module renders it). Default:
    /// /etc/keystone-agent/agentd.json on the system bus,
    /// $XDG_CONFIG_HOME/keystone/agentd.json on the session bus, when it
    /// exists.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Zellij 0.45.x binary for the sessions of local sandboxes (default:
    /// `zellij` on PATH, else the build cached by tests/install-zellij.sh).
    #[arg(long, value_name = "FILE", env = "KEYSTONE_ZELLIJ")]
    zellij: Option<PathBuf>,
    /// State directory (registry, workspaces, logs).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Validate a configuration file and exit (0 valid, 1 invalid).
    #[arg(long, value_name = "FILE")]
    check_config: Option<PathBuf>,
    /// Download the agent toolbox (Claude Code, Codex, Gemini CLI at the
    /// versions of --config's `toolbox`) into its cache and exit.
    #[arg(long)]
    install_agents: bool,
    /// Print, as JSON, what this machine has of what each backend needs,
    /// and exit (`agentctl doctor` shows it).
    #[arg(long, hide = true)]
    doctor: bool,
    /// Write agentd's man page (agentd.8) into DIR and exit.
    #[arg(long, hide = true, value_name = "DIR")]
    manpages: Option<PathBuf>,
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    // Hidden helper modes: agentd re-executes itself for these.
    if let Some(c) = agentd::run_helper(&argv) {
        return code(c);
    }
    // Descriptors inherited from whoever started agentd go to none of the
    // processes it starts (its helpers, a sandbox's supervisor).
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only marks descriptors;
    // nothing is closed under anyone's feet.
    unsafe {
        nix::libc::syscall(
            nix::libc::SYS_close_range,
            3u32,
            u32::MAX,
            nix::libc::CLOSE_RANGE_CLOEXEC,
        );
    }
    let mut args = Args::parse();
    if let Some(dir) = &args.manpages {
        let page = clap_mangen::Man::new(<Args as clap::CommandFactory>::command()).section("8");
        return match page.generate_to(dir) {
            Ok(_) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!(
                    "agentd: cannot write the man page into {}: {e}",
                    dir.display()
                );
                ExitCode::FAILURE
            }
        };
    }
    let bus = match (args.system, args.session, args.address.clone()) {
        (true, _, _) => Bus::System,
        (_, true, _) => Bus::Session,
        (_, _, Some(a)) => Bus::Address(a),
        _ if nix::unistd::Uid::effective().is_root() => Bus::System,
        _ => Bus::Session,
    };
    if args.config.is_none() {
        args.config = agentd::default_config(matches!(bus, Bus::System));
    }
    if args.doctor {
        if matches!(bus, Bus::System) {
            // What the system service sees: systemd's PATH and its
            // CacheDirectory, not the caller's (`sudo agentctl doctor` must
            // not run programs from the caller's PATH or cache as root).
            // SAFETY: no other thread runs yet (no runtime has started).
            unsafe {
                std::env::set_var("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin");
                std::env::set_var("KEYSTONE_CACHE_DIR", "/var/cache/keystone-agent");
                std::env::remove_var("KEYSTONE_ZELLIJ");
            }
        }
        let checks = agentd::doctor::run(args.config.as_deref(), matches!(bus, Bus::System));
        println!(
            "{}",
            serde_json::to_string_pretty(&checks).unwrap_or_default()
        );
        return ExitCode::SUCCESS;
    }
    if let Some(path) = &args.check_config {
        return match agentd::check_config(path) {
            Ok(summary) => {
                println!("{summary}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("agentd: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    if args.install_agents {
        return match agentd::install_agents(args.config.as_deref()) {
            Ok(summary) => {
                println!("{summary}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("agentd: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AGENTD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let opts = agentd::Options {
        bus,
        config: args.config,
        state_dir: args.state_dir,
        zellij: args.zellij,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("agentd: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(agentd::run(opts)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agentd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn code(c: i32) -> ExitCode {
    ExitCode::from(u8::try_from(c).unwrap_or(1))
}

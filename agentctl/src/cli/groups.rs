//! The verbs of `agentctl secret` and `agentctl egress NAME`.

use clap::Subcommand;
use keystone_agent_api::Egress;

/// `agentctl secret …` verbs.
#[derive(Debug, Subcommand)]
pub enum SecretCommand {
    /// Set (or replace) the secret of VAR in sandbox NAME.
    Set {
        /// Sandbox name.
        name: String,
        /// The environment variable inside (its placeholder), such as
        /// ANTHROPIC_API_KEY.
        var: String,
        /// The host whose HTTPS requests get the value.
        #[arg(long)]
        host: String,
        /// The header that carries it (e.g. x-api-key).
        #[arg(long, conflicts_with = "bearer", required_unless_present = "bearer")]
        header: Option<String>,
        /// `Authorization: Bearer <value>`.
        #[arg(long)]
        bearer: bool,
        /// Read the value from this file instead of standard input.
        #[arg(long, value_name = "FILE")]
        file: Option<std::path::PathBuf>,
    },
    /// List the sandbox's secrets (variables, hosts and headers; never a value).
    #[command(visible_alias = "ls")]
    List {
        /// Sandbox name.
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove the secret of VAR.
    #[command(visible_alias = "rm")]
    Remove {
        /// Sandbox name.
        name: String,
        /// The variable.
        var: String,
    },
}

/// `agentctl egress NAME …`.
#[derive(Debug, Subcommand)]
pub enum EgressCommand {
    /// Show the mode, the preset and the sandbox's own allow and deny entries.
    Show {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Admit ENTRY from the next connection on (kept across restarts):
    /// `example.com`, `*.example.com` (names below it), `host:port`, or an
    /// address range such as `10.0.0.0/8` or `192.0.2.1/32:443`. Only an
    /// address range opens the host or a private range.
    Allow {
        /// What to admit.
        entry: String,
        /// Only for the connections waiting now (mode ask); nothing is kept.
        #[arg(long)]
        once: bool,
    },
    /// Refuse ENTRY, even when the preset admits it.
    Deny {
        /// What to refuse.
        entry: String,
    },
    /// Take ENTRY off the sandbox's allow and deny lists (an entry of the
    /// preset stays allowed: deny it instead).
    #[command(visible_alias = "rm")]
    Remove {
        /// The entry, as `show` lists it.
        entry: String,
    },
    /// Set the mode: allowlist (the preset and your entries), open (any
    /// public destination), none (nothing) or ask (like allowlist, but a
    /// connection to an unlisted destination waits for you to allow it).
    Mode {
        /// The mode.
        #[arg(value_parser = str::parse::<Egress>)]
        mode: Egress,
    },
    /// The connections waiting for you to allow them (mode ask).
    Pending {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The connections through the gateway: allowed and refused (refused
    /// ones marked DENIED, ones still open marked open, ones waiting for
    /// you in mode ask marked WAITING), with the rule that decided, bytes
    /// and duration; under a refused or waiting one, why, and the command
    /// that admits it (`allow it: agentctl egress NAME allow …`).
    Log {
        /// Print JSON (with --follow: one object per line).
        #[arg(long)]
        json: bool,
        /// Only the last N entries.
        #[arg(long, short = 'n', value_name = "N", default_value_t = 50)]
        limit: u32,
        /// Keep printing connections as they happen (Ctrl-C ends).
        #[arg(long, short)]
        follow: bool,
    },
}

/// `agentctl forge …`: repositories a sandbox may push to without a token.
#[derive(Debug, Subcommand)]
pub enum ForgeCommand {
    /// Let sandbox NAME push to the repository at URL. The token stays on
    /// this host: inside, git's password for URL is a placeholder that
    /// agentd's gateway swaps for the token in that repository's requests
    /// only, after checking every ref a push updates.
    Allow {
        /// Sandbox name.
        name: String,
        /// The repository: https://HOST/OWNER/REPO.
        url: String,
        /// The file that holds the token (one line); standard input
        /// without it (a terminal does not echo it).
        #[arg(long, value_name = "FILE")]
        token_file: Option<std::path::PathBuf>,
        /// A branch the agent may push to (repeatable; `*` matches
        /// anything, `/` included).
        #[arg(long = "branches", value_name = "PATTERN", default_value = "agent/*")]
        branches: Vec<String>,
        /// Also let it push new tags (never delete one).
        #[arg(long)]
        tags: bool,
        /// The user name sent with the token (GitLab, Gitea and Forgejo
        /// take any; GitHub x-access-token).
        #[arg(long, default_value = "x-access-token")]
        user: String,
    },
    /// List the repositories sandbox NAME may push to (never a token).
    #[command(visible_alias = "ls")]
    List {
        /// Sandbox name.
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Stop letting sandbox NAME push to URL.
    #[command(visible_alias = "rm")]
    Remove {
        /// Sandbox name.
        name: String,
        /// The repository.
        url: String,
    },
}

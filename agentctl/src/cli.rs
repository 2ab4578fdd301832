//! Command-line arguments of agentctl.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use keystone_agent_api::{Agent, AgentHome, BackendKind, Egress, GitIdentity, Network, SyncMode};

mod duration;
mod groups;
mod verbs;
use duration::duration_secs;
pub use groups::{EgressCommand, ForgeCommand, SecretCommand};

/// Drive Keystone Agent sandboxes: isolated places where AI coding agents
/// work on a clone of your repository.
///
/// agentctl talks to agentd over D-Bus. Installed with `make install`, your
/// session bus starts agentd on the first call (your user's agentd.service);
/// the system service is `systemctl enable --now agentd`, on NixOS
/// `keystone.agent.enable`. `agentctl doctor` says what is missing.
#[derive(Debug, Parser)]
#[command(name = "agentctl", version, propagate_version = true)]
#[command(
    after_help = "Exit codes: 0 ok, 1 not found, 2 invalid state, 3 operation failed, \
4 requirements not met (bad arguments, permission, agentd unreachable), 5 cancelled.\n\
`agentctl exec` exits with the command's own exit code."
)]
pub struct Cli {
    /// Which bus agentd is on: `system`, `session`, or a D-Bus address such
    /// as `unix:path=/run/agentd.sock`. Default: your session bus
    /// (`DBUS_SESSION_BUS_ADDRESS`, else `$XDG_RUNTIME_DIR/bus`) when agentd
    /// runs there, else the system bus when agentd runs there, else the bus
    /// that can start it (the session bus first, for root the system bus).
    #[arg(long, global = true, env = "AGENTCTL_BUS", value_name = "BUS")]
    pub bus: Option<String>,

    /// Seconds agentd has to answer: a command that only asks (list,
    /// status, …) must be done by then; during one that works or runs
    /// something (create, start, exec, attach, sync, …) agentd must answer
    /// a ping every 5 s within it. Past it agentctl exits 4.
    #[arg(
        long,
        global = true,
        env = "AGENTCTL_CALL_TIMEOUT",
        value_name = "SECONDS",
        default_value_t = 30
    )]
    pub call_timeout: u64,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// `agentctl snapshot rm …`.
#[derive(Debug, Subcommand)]
pub enum SnapshotCommand {
    /// Remove a snapshot.
    #[command(visible_alias = "remove")]
    Rm {
        /// Sandbox name.
        name: String,
        /// Snapshot id.
        snapshot: String,
    },
}

/// `agentctl sessions log …`.
#[derive(Debug, Subcommand)]
pub enum SessionsCommand {
    /// List the records of a sandbox's terminal sessions: id, when, who,
    /// what ran, how long, size.
    Log {
        /// Sandbox name.
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `agentctl worktree …`.
#[derive(Debug, Subcommand)]
pub enum WorktreeCommand {
    /// Create the worktree of BRANCH at /workspace/.worktrees/BRANCH; a
    /// missing branch starts at --from when given, else at the host's branch
    /// of that name (and tracks it), else at the main worktree's HEAD.
    #[command(
        after_help = "Examples:\n  agentctl worktree add myproject feature/login\n  \
agentctl worktree add myproject spike --from host/main"
    )]
    Add {
        /// Sandbox name.
        name: String,
        /// Branch (a valid git branch name; its directory mirrors it).
        branch: String,
        /// Where a new branch starts (a branch, tag or commit in the workspace).
        #[arg(long, value_name = "REF")]
        from: Option<String>,
    },
    /// List the worktrees: branch, path inside the sandbox, head, dirty,
    /// ahead/behind the host's branch.
    #[command(visible_alias = "ls")]
    List {
        /// Sandbox name.
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove a worktree (its branch stays). Refuses to drop uncommitted
    /// work without --force.
    #[command(visible_alias = "rm")]
    Remove {
        /// Sandbox name.
        name: String,
        /// Branch of the worktree.
        branch: String,
        /// Throw away uncommitted changes.
        #[arg(long, short)]
        force: bool,
    },
}

/// The verbs.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create a sandbox from a git repository (cloned; your repository is
    /// never mounted into the sandbox).
    #[command(
        after_help = "Examples:\n  agentctl create ~/src/myproject\n  agentctl create --name api --memory 4096 --disk 20480 --network none .\n  agentctl create --git-identity \"Ada Lovelace <ada@example.com>\" ."
    )]
    Create {
        /// Sandbox name: a lowercase letter, then up to 30 lowercase
        /// letters, digits or '-'. Default: from the directory's name.
        #[arg(long, short)]
        name: Option<String>,
        /// RAM in MiB (at least 256), tmpfs (/tmp, /dev/shm, ...) included.
        /// Default: 8192.
        #[arg(long, value_name = "MB")]
        memory: Option<u32>,
        /// Virtual CPUs. Default: 4.
        #[arg(long, value_name = "N")]
        vcpus: Option<u32>,
        /// Disk space in MiB for the workspace and the home (at least 16);
        /// writes past it fail with ENOSPC. Default: 10240.
        #[arg(long, value_name = "MB")]
        disk: Option<u32>,
        /// Most processes and threads at once (at least 16). Default: 4096.
        #[arg(long, value_name = "N")]
        pids: Option<u32>,
        /// Network mode: nat (outbound through agentd's egress gateway),
        /// none (loopback only) or bridge (the same as nat). Default: nat.
        #[arg(long, value_parser = str::parse::<Network>)]
        network: Option<Network>,
        /// Egress policy: allowlist (the preset plus --allow), open (any
        /// public destination), none, or ask (unlisted destinations wait
        /// for you). Default: allowlist.
        #[arg(long, value_parser = str::parse::<Egress>)]
        egress: Option<Egress>,
        /// Also admit this destination (repeatable): example.com,
        /// *.example.com, host:port, 10.0.0.0/8, 192.0.2.1/32:443.
        #[arg(long = "allow", value_name = "ENTRY")]
        allow: Vec<String>,
        /// When work comes back to your repository: manual, auto-commit or
        /// auto-idle. Default: manual.
        #[arg(long, value_parser = str::parse::<SyncMode>)]
        sync_mode: Option<SyncMode>,
        /// Backend: local (namespaces), vm (a QEMU microVM agentd boots) or microvm (a NixOS microvm.nix unit). Default: agentd's configured default.
        #[arg(long, value_parser = str::parse::<BackendKind>)]
        backend: Option<BackendKind>,
        /// The agent a new session starts in its first pane, beside a shell
        /// (`agentctl attach` without --agent): claude, codex or gemini.
        /// Default: agentd's configured default (none: a shell only).
        #[arg(long, value_name = "AGENT", value_parser = str::parse::<Agent>)]
        default_agent: Option<Agent>,
        /// Where the agents keep their logins: own (this sandbox's home) or
        /// shared (one directory for all your sandboxes that say shared:
        /// log in once; but one of them can change what the others read).
        /// local and vm sandboxes. Default: own.
        #[arg(long, value_name = "WHERE", value_parser = str::parse::<AgentHome>)]
        agent_home: Option<AgentHome>,
        /// Who the commits made inside are by: "NAME <EMAIL>", none (set
        /// one inside later), or owner. Default: owner, the user.name and
        /// user.email of the project's git configuration, else of your
        /// ~/.gitconfig or ~/.config/git/config.
        #[arg(long, value_name = "IDENTITY", value_parser = str::parse::<GitIdentity>)]
        git_identity: Option<GitIdentity>,
        /// Stop the sandbox once it has been idle this long (no terminal,
        /// no command, no network, under 5% CPU): 30m, 2h, 90s; 0 never.
        /// The next exec, attach, cp or link request starts it again. Default: never.
        #[arg(long, value_name = "DURATION", value_parser = duration_secs)]
        idle_stop: Option<u32>,
        /// Take a backup of the running or paused sandbox this often: 6h,
        /// 1d, 90s; 0 never (the default).
        #[arg(long, value_name = "DURATION", value_parser = duration_secs)]
        backup_every: Option<u32>,
        /// How many backups to keep (the oldest go first). Default: 5.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        backup_keep: Option<u32>,
        /// A path the agent's commits may not change without your say
        /// (repeatable; replaces the default list): a sync holds a branch
        /// whose new commits change it. Relative to the repository; `*`,
        /// `?` and `**` globs; it covers everything beneath it. Default:
        /// .git/hooks/ .husky/ .github/workflows/ .gitlab-ci.yml
        /// .pre-commit-config.yaml.
        #[arg(long, value_name = "PATH", conflicts_with = "no_protect")]
        protect: Vec<String>,
        /// Protect no path.
        #[arg(long)]
        no_protect: bool,
        /// The git repository (its top-level directory).
        project_path: PathBuf,
    },
    /// Start a sandbox and wait until it answers.
    Start {
        /// Sandbox name.
        name: String,
    },
    /// Stop a sandbox: SIGTERM to its processes, SIGKILL after a grace period.
    Stop {
        /// Sandbox name.
        name: String,
        /// Kill at once, without the grace period.
        #[arg(long, short)]
        force: bool,
    },
    /// Freeze every process of a running sandbox: they use no CPU and keep
    /// their memory, open files and terminals until `agentctl resume`. A
    /// paused sandbox runs no commands and serves no links; `attach` resumes
    /// it. Local sandboxes (the cgroup freezer) and vm sandboxes (QEMU
    /// stops the guest's CPUs). A kubernetes sandbox is parked instead: its
    /// Pod is deleted and its claim kept, and resume starts a new Pod (its
    /// processes start anew).
    Pause {
        /// Sandbox name.
        name: String,
    },
    /// Thaw a paused sandbox: its processes go on where they were (a parked
    /// kubernetes sandbox gets a new Pod).
    Resume {
        /// Sandbox name.
        name: String,
    },
    /// Keep a sandbox's files as they are now: its workspace (every branch
    /// and worktree, uncommitted work included) and its home, with its
    /// settings. A running sandbox is frozen for the moment of the copy
    /// (local and vm). Snapshots count against the sandbox's snapshot_quota and go
    /// with destroy. `agentctl snapshot rm NAME ID` removes one.
    #[command(
        args_conflicts_with_subcommands = true,
        subcommand_negates_reqs = true,
        after_help = "Examples:\n  agentctl snapshot myproject --label before-refactor\n  \
agentctl snapshots myproject\n  agentctl restore myproject 20261126-173501\n  \
agentctl snapshot rm myproject 20261126-173501"
    )]
    Snapshot {
        #[command(subcommand)]
        command: Option<SnapshotCommand>,
        /// Sandbox name.
        #[arg(required = true)]
        name: Option<String>,
        /// A few words to tell it by.
        #[arg(long)]
        label: Option<String>,
        /// Print the new snapshot as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List a sandbox's snapshots: id, when, size, label, what it holds.
    Snapshots {
        /// Sandbox name.
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Put a sandbox's files back as a snapshot holds them. A running
    /// sandbox is stopped and started again (its processes start anew).
    /// Your repository is not touched; the next sync reports what moved.
    Restore {
        /// Sandbox name.
        name: String,
        /// Snapshot id (agentctl snapshots NAME lists them).
        snapshot: String,
    },
    /// Make a new sandbox from NAME's files (now, or as --from holds them)
    /// and settings, to try another approach from the same point. It is a
    /// sandbox of its own in every other respect: its own uid, network,
    /// gateway, CA and sync remote sandbox/NEW; no secrets. Stopped until
    /// started.
    #[command(
        after_help = "Examples:\n  agentctl fork myproject myproject-b --branch try-b\n  \
agentctl fork myproject retry --from 20261126-173501"
    )]
    Fork {
        /// The sandbox to fork.
        name: String,
        /// The new sandbox's name.
        new: String,
        /// Start from this snapshot of NAME instead of its files now.
        #[arg(long, value_name = "SNAPSHOT")]
        from: Option<String>,
        /// Open a worktree of this branch in the new sandbox.
        #[arg(long)]
        branch: Option<String>,
    },
    /// Destroy a stopped sandbox and its workspace (asks first on a terminal,
    /// saying how many commits on which branches your repository lacks).
    /// Removes the remote sandbox/NAME from your repository's config; the
    /// refs refs/remotes/sandbox/NAME/* stay.
    Destroy {
        /// Sandbox name.
        name: String,
        /// Do not ask.
        #[arg(long, short)]
        force: bool,
    },
    /// List your sandboxes (root: everyone's).
    #[command(visible_alias = "ls")]
    List {
        /// Print JSON (an array of objects; see docs/dbus-api.md).
        #[arg(long)]
        json: bool,
        /// Only sandboxes in this state.
        #[arg(long, value_name = "STATE")]
        state: Option<String>,
    },
    /// Show one sandbox in detail: its settings, links and ports, and its
    /// egress (the connections waiting for you, and the destinations
    /// refused in the last 24 hours, each with the command that admits
    /// it).
    Status {
        /// Sandbox name.
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Bring the sandbox's commits to your repository (as
    /// refs/remotes/sandbox/NAME/BRANCH), or refresh the host's branches in
    /// the sandbox with --from-host. Exits 2 when there was nothing new.
    #[command(
        after_help = "Examples:\n  agentctl sync myproject                 fetch every sandbox branch\n  \
agentctl sync myproject --dry-run       show what would come over\n  \
agentctl sync myproject --into main     also fast-forward your main to the sandbox's main\n  \
agentctl sync myproject --into master   the same where the branch is called master\n  \
agentctl sync myproject -b feature/x --into feature/x   only feature/x, and your feature/x\n  \
agentctl sync myproject --from-host     update refs/remotes/host/* in the sandbox\n\n\
Afterwards, in your repository: git log sandbox/myproject/main\n\
Never runs a hook, never reads the sandbox's git config; your work tree and index are only \
touched by --into, and only as a fast-forward of a clean checkout."
    )]
    Sync {
        /// Sandbox name.
        name: String,
        /// Only this branch.
        #[arg(long, short)]
        branch: Option<String>,
        /// Show what would come over; change nothing.
        #[arg(long, short = 'n')]
        dry_run: bool,
        /// Also fast-forward this local branch of your repository to the
        /// sandbox's branch of the same name (never a forced update; exits 3
        /// with merge instructions when it diverged). With --branch B, only
        /// --into B; a branch the sandbox lacks is refused (exit 4).
        #[arg(long, value_name = "BRANCH")]
        into: Option<String>,
        /// The other direction: your branches into the sandbox, as
        /// refs/remotes/host/* (no sandbox branch, index or file changes).
        #[arg(long, conflicts_with_all = ["into", "allow_protected", "accept_rewrite"])]
        from_host: bool,
        /// Bring this branch although its new commits change a protected
        /// path (repeatable): up to the tip the last sync held back, after
        /// you looked (`git show COMMIT` in your repository).
        #[arg(long, value_name = "BRANCH")]
        allow_protected: Vec<String>,
        /// Move this branch's ref in your repository although the sandbox
        /// rewrote its history or deleted it (repeatable).
        #[arg(long, value_name = "BRANCH")]
        accept_rewrite: Vec<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Copy files or directories into or out of a sandbox. Copying out
    /// creates only plain files and directories, owned by you, with modes
    /// kept less your umask and setuid, setgid and sticky bits dropped; a symlink already in
    /// the destination is never followed or replaced, and a copy that is
    /// refused changes nothing.
    #[command(
        after_help = "Examples:\n  agentctl cp ./data myproject:/workspace/data\n  \
agentctl cp myproject:/workspace/build/report.html .\n  \
agentctl cp --links myproject:/workspace/site ./site   # keep links that stay inside"
    )]
    Cp {
        /// Source: a local path, or NAME:/path in a sandbox.
        src: String,
        /// Destination: a local path, or NAME:/path in a sandbox.
        dest: String,
        /// Copying out: also create symbolic and hard links, when they stay
        /// inside the copied tree (a link out of it refuses the copy).
        #[arg(long)]
        links: bool,
    },
    /// What was run in a sandbox: every exec, attach and cp with its
    /// caller, exit code and duration (an append-only log kept by agentd).
    History {
        /// Sandbox name.
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Only the last N entries.
        #[arg(long, short = 'n', value_name = "N", default_value_t = 20)]
        limit: u32,
        /// Also list the checks `agentctl cp` makes before copying in
        /// (`cp-check`: whether the destination is a directory), which
        /// are left out otherwise.
        #[arg(long)]
        all: bool,
    },
    /// Change a sandbox's settings: the sync mode and the protected paths
    /// at once, the default agent for the next new session.
    #[command(
        after_help = "Examples:\n  agentctl set myproject --sync-mode auto-commit\n  \
agentctl set myproject --sync-mode auto-idle --sync-idle-seconds 60\n  \
agentctl set myproject --default-agent claude   # new sessions start Claude Code\n  \
agentctl set myproject --default-agent none\n  \
agentctl set myproject --protect .github/ --protect Makefile   # the whole list\n  \
agentctl set myproject --no-protect"
    )]
    Set {
        /// Sandbox name.
        name: String,
        /// manual, auto-commit (every commit comes to the host at once) or
        /// auto-idle (also snapshots uncommitted work after a quiet period).
        #[arg(long, value_parser = str::parse::<SyncMode>)]
        sync_mode: Option<SyncMode>,
        /// Quiet seconds before an auto-idle snapshot.
        #[arg(long, value_name = "S")]
        sync_idle_seconds: Option<u32>,
        /// The agent a new session starts beside its shell: claude, codex,
        /// gemini, or none.
        #[arg(long, value_name = "AGENT", value_parser = agent_or_none)]
        default_agent: Option<AgentOrNone>,
        /// Stop the sandbox once it has been idle this long: 30m, 2h, 90s;
        /// 0 never.
        #[arg(long, value_name = "DURATION", value_parser = duration_secs)]
        idle_stop: Option<u32>,
        /// Take a backup this often: 6h, 1d; 0 never.
        #[arg(long, value_name = "DURATION", value_parser = duration_secs)]
        backup_every: Option<u32>,
        /// How many backups to keep.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        backup_keep: Option<u32>,
        /// The protected paths (repeatable; the whole list, replacing the
        /// current one): a sync holds a branch whose new commits change
        /// one. `agentctl status` shows the list.
        #[arg(long, value_name = "PATH", conflicts_with = "no_protect")]
        protect: Vec<String>,
        /// Protect no path.
        #[arg(long)]
        no_protect: bool,
    },
    /// Worktrees: one per branch at /workspace/.worktrees/BRANCH, so several
    /// agents can work on one repository side by side.
    #[command(subcommand)]
    Worktree(WorktreeCommand),
    /// See and change where a sandbox's outbound connections may go. Every
    /// connection goes through agentd's gateway, which decides it by the
    /// sandbox's policy and logs it.
    #[command(after_help = "Examples:\n  agentctl egress myproject show\n  \
agentctl egress myproject allow api.example.com\n  \
agentctl egress myproject allow 10.1.2.0/24:5432\n  \
agentctl egress myproject deny registry.npmjs.org\n  \
agentctl egress myproject log --follow\n  \
agentctl egress myproject mode ask && agentctl egress myproject pending\n  \
agentctl egress myproject allow --once api.example.com")]
    Egress {
        /// Sandbox name.
        name: String,
        /// What to do.
        #[command(subcommand)]
        command: EgressCommand,
    },
    /// Secrets the sandbox's agent can use but not read: inside, the
    /// variable holds a placeholder; agentd's egress gateway puts the real
    /// value in the named header of the sandbox's HTTPS requests to the
    /// host, and nowhere else (docs/agents.md).
    #[command(after_help = "Examples:\n  \
agentctl secret set myproject ANTHROPIC_API_KEY --host api.anthropic.com --header x-api-key < key.txt\n  \
agentctl secret set myproject OPENAI_API_KEY --host api.openai.com --bearer --file ~/.openai-key\n  \
agentctl secret list myproject\n  \
agentctl secret rm myproject OPENAI_API_KEY\n\n\
The value is read from --file or standard input (never the command line); a\n\
terminal does not echo it. Running commands keep their environment: the\n\
variable appears in the next exec, terminal or session.")]
    Secret {
        /// What to do.
        #[command(subcommand)]
        command: SecretCommand,
    },
    /// Pushes to a forge (GitHub, GitLab, Gitea, any git smart-HTTP
    /// server) without the agent ever holding a token (docs/forges.md).
    #[command(after_help = "Examples:\n  \
agentctl forge allow myproject https://github.com/acme/app --token-file ~/.acme-token --branches 'agent/*'\n  \
agentctl forge list myproject\n  agentctl forge rm myproject https://github.com/acme/app\n  \
agentctl egress myproject log   # every push, its refs and what was decided")]
    Forge {
        /// What to do.
        #[command(subcommand)]
        command: ForgeCommand,
    },
    /// Attach your terminal to the Zellij session of a worktree
    /// (`<name>-<branch>`). Starts the sandbox if it is stopped, creates the
    /// worktree and the session if they are missing. Detach with Ctrl+o d:
    /// the session keeps running, and attaching again shows the same screen.
    #[command(
        after_help = "Examples:\n  agentctl attach myproject            # the main worktree's branch\n  \
agentctl attach myproject feature-x  # /workspace/.worktrees/feature-x\n  \
agentctl attach myproject --agent claude  # Claude Code in the first pane\n\n\
A project can bring its own layout in .keystone/layout.kdl (in the worktree).\n\
--agent applies when the session is created; an existing session keeps its\n\
panes (agentctl kill-session NAME BRANCH, then attach again)."
    )]
    Attach {
        /// Sandbox name.
        name: String,
        /// Branch of the worktree. Default: the main worktree's branch.
        branch: Option<String>,
        /// Run this agent (the sandbox's pinned version) in the first pane of
        /// a new session, beside a shell.
        #[arg(long, value_parser = ["claude", "codex", "gemini"])]
        agent: Option<String>,
    },
    /// List the Zellij sessions of a sandbox: name, branch, attached
    /// clients, age. `agentctl sessions log NAME` lists the records of its
    /// terminal sessions instead.
    #[command(
        args_conflicts_with_subcommands = true,
        subcommand_negates_reqs = true,
        after_help = "Examples:\n  agentctl sessions myproject\n  \
agentctl sessions log myproject\n  agentctl replay myproject 20261127-201501-1a2b3c4d"
    )]
    Sessions {
        #[command(subcommand)]
        command: Option<SessionsCommand>,
        /// Sandbox name.
        #[arg(required = true)]
        name: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// What people typed into a sandbox's terminals (`attach`, `exec
    /// --tty`): when, who, in which session, what. Kept by agentd outside
    /// the sandbox, for `audit.keep_days` (agentd's configuration).
    #[command(after_help = "Example:\n  agentctl audit myproject --limit 20")]
    Audit {
        /// Sandbox name.
        name: String,
        /// Show the last N lines (0: all).
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print what needs you as it happens, one line each: an agent waiting
    /// for input (its own hook told agentd), a connection waiting for your
    /// decision (egress mode ask), a sandbox changing state. Starts with
    /// the agents waiting now; Ctrl-C ends.
    #[command(
        after_help = "Examples:\n  agentctl watch                  every sandbox of yours\n  \
agentctl watch myproject --json  one JSON object per line\n  \
agentctl watch --notify          also as desktop notifications"
    )]
    Watch {
        /// Only this sandbox.
        name: Option<String>,
        /// Print JSON, one object per line (`event`: agent-waiting,
        /// agent-answered, egress-waiting, state, added, removed).
        #[arg(long)]
        json: bool,
        /// Also show each waiting agent and connection as a desktop
        /// notification (org.freedesktop.Notifications on your session
        /// bus).
        #[arg(long)]
        notify: bool,
    },
    /// Play the record of a terminal session of a sandbox (`agentctl
    /// sessions log NAME` lists them): what it printed, at the pace it was
    /// printed. Every `attach` and `exec --tty` is recorded by agentd, from
    /// outside the sandbox, as an asciicast v2 file (`--raw` prints it, for
    /// `asciinema play -`).
    Replay {
        /// Sandbox name.
        name: String,
        /// Record id.
        id: String,
        /// Play this many times faster (0: at once).
        #[arg(long, default_value_t = 1.0)]
        speed: f64,
        /// Print the asciicast file itself.
        #[arg(long)]
        raw: bool,
    },
    /// Dev-server links of a sandbox: every TCP port its worktrees listen
    /// on gets a name through Caddy (`BRANCH.NAME.DOMAIN`, `NAME.DOMAIN` for
    /// the main worktree, `PORT-BRANCH.NAME.DOMAIN` for each port).
    #[command(after_help = "Example:\n  agentctl ports myproject\n  \
LINK                                      BRANCH  PORT\n  \
https://main.myproject.sandbox.local/      main    5173")]
    Ports {
        /// Sandbox name.
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// What a running sandbox uses: CPU time and %, memory (current, peak,
    /// limit), disk used and its size, processes and their limit, the
    /// egress gateway's connections and bytes, uptime and last gateway
    /// activity. A figure the sandbox's backend cannot tell is shown as
    /// unavailable, with the reason. A stopped sandbox is said to be so
    /// (exit 0).
    #[command(after_help = "Examples:\n  agentctl stats myproject\n  \
agentctl stats myproject --follow --interval 5\n  \
agentctl stats myproject --json   # figures in µs, bytes and counts")]
    Stats {
        /// Sandbox name.
        name: String,
        /// Print JSON (with --follow, one object per line).
        #[arg(long)]
        json: bool,
        /// Print again every --interval seconds until interrupted or the
        /// sandbox stops; CPU % is then over each interval.
        #[arg(long, short = 'f')]
        follow: bool,
        /// Seconds between samples with --follow (at least 1).
        #[arg(long, value_name = "S", default_value_t = 2,
              value_parser = clap::value_parser!(u32).range(1..=3600))]
        interval: u32,
    },
    /// Print the dev-server link of a worktree (default: the main one) and
    /// open it in your browser when there is a display.
    Open {
        /// Sandbox name.
        name: String,
        /// Branch of the worktree.
        branch: Option<String>,
    },
    /// Open the web console in your browser (or print its link): your
    /// sandboxes live, and the agents waiting for you. The link logs you in
    /// once, within 60 s; it is yours alone (agentd checks the uid of the
    /// browser's connection).
    Console {
        /// Open at this sandbox.
        name: Option<String>,
        /// Only print the link.
        #[arg(long)]
        print: bool,
    },
    /// End the Zellij session of a worktree (its shells and programs end;
    /// the worktree stays).
    KillSession {
        /// Sandbox name.
        name: String,
        /// Branch of the worktree.
        branch: String,
    },
    /// Check what agentd and each backend need on this machine (the bus,
    /// Zellij, Caddy, user namespaces, cgroup controllers, QEMU, the guest
    /// image, the agent toolbox) and print the command that fixes each
    /// missing piece. Exits 0 when everything the local backend needs is
    /// there, else 4.
    #[command(after_help = "Examples:\n  agentctl doctor\n  agentctl doctor --json")]
    Doctor {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// agentd's configuration file, as its service uses it (default:
        /// the one agentd reads on its own).
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Print the completion script of agentctl for a shell (what `make
    /// install` installs; for an install by `cargo install`).
    #[command(
        after_help = "Examples:\n  agentctl completions bash > ~/.local/share/bash-completion/completions/agentctl\n  \
agentctl completions zsh > ~/.zfunc/_agentctl\n  \
agentctl completions fish > ~/.config/fish/completions/agentctl.fish"
    )]
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Write agentctl's man pages (agentctl.1, agentctl-VERB.1) into DIR.
    #[command(hide = true)]
    Manpages {
        /// Directory to write into (it must exist).
        dir: PathBuf,
    },
    /// Run a command inside a running sandbox; its output streams as it runs,
    /// your stdin reaches it, and agentctl exits with its exit code.
    #[command(
        after_help = "Examples:\n  agentctl exec myproject -- git status\n  agentctl exec myproject --timeout 60 -- make test\n  \
agentctl exec -t myproject -b feature-x -- bash   # an interactive shell in a worktree"
    )]
    Exec {
        /// Sandbox name.
        name: String,
        /// Give the command a terminal (interactive programs, shells):
        /// yours is handed over as `agentctl attach` does.
        #[arg(long, short = 't')]
        tty: bool,
        /// Kill the command after this many seconds (0 = never).
        #[arg(long, value_name = "S", default_value_t = 0)]
        timeout: u32,
        /// Working directory inside the sandbox. Default: /workspace.
        #[arg(long, short = 'w', value_name = "DIR", conflicts_with = "worktree")]
        workdir: Option<String>,
        /// Run in the worktree of this branch (/workspace/.worktrees/BRANCH,
        /// or /workspace for the main worktree's branch).
        #[arg(long, short = 'b', value_name = "BRANCH")]
        worktree: Option<String>,
        /// Set an environment variable (repeatable).
        #[arg(long, short, value_name = "KEY=VALUE")]
        env: Vec<String>,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true, value_name = "CMD")]
        command: Vec<String>,
    },
    /// Open an SSH session into a sandbox with your own `ssh`: a shell (or
    /// COMMAND) as the sandbox's user, in a branch's worktree. The
    /// connection goes through agentd over D-Bus (`agentctl ssh-proxy`):
    /// no port is opened, and agentd checks who you are as for any call.
    #[command(after_help = "Examples:
  agentctl ssh myproject
  agentctl ssh myproject feature-x
  agentctl ssh myproject -- git -C /workspace status

Editors: `agentctl ssh-config >> ~/.ssh/keystone.conf` (see its --help).")]
    Ssh {
        /// Sandbox name.
        name: String,
        /// Branch whose worktree the session starts in (default: the main
        /// worktree).
        branch: Option<String>,
        /// A command to run instead of a shell (after `--`).
        #[arg(last = true, value_name = "CMD")]
        command: Vec<String>,
    },
    /// Print `Host` blocks for your sandboxes (`keystone-NAME`, and
    /// `keystone-NAME.BRANCH` for each worktree) that ssh, scp, rsync, VS
    /// Code Remote-SSH and other editors use, and pin each sandbox's host
    /// key in agentctl's own known_hosts file.
    #[command(after_help = "Examples:
  agentctl ssh-config > ~/.ssh/keystone.conf   # then add `Include keystone.conf` at the top of ~/.ssh/config
  ssh -F <(agentctl ssh-config myproject) keystone-myproject git -C /workspace status")]
    SshConfig {
        /// Sandboxes to include (default: all of yours).
        names: Vec<String>,
    },
    /// Carry one SSH connection into a sandbox between stdin/stdout and
    /// agentd: what the `ProxyCommand` of `agentctl ssh-config` runs.
    SshProxy {
        /// Sandbox name.
        name: String,
        /// Branch whose worktree sessions start in.
        #[arg(long, short = 'b', value_name = "BRANCH")]
        branch: Option<String>,
    },
}

/// `agentctl set --default-agent`: an agent, or none.
#[derive(Debug, Clone, Copy)]
pub struct AgentOrNone(pub Option<Agent>);

/// `none` or an agent's name.
fn agent_or_none(s: &str) -> Result<AgentOrNone, String> {
    match s {
        "none" => Ok(AgentOrNone(None)),
        _ => s.parse().map(|a| AgentOrNone(Some(a))),
    }
}

//! Agents waiting for their person ([`crate::waiting`]): the listener
//! agentd runs in each running sandbox, the agents' hooks it configures at
//! start, and the board of who waits where, which the bus announces to
//! the sandbox's owner and typing into the session clears.

use std::os::fd::OwnedFd;
use std::sync::Weak;
use std::time::Instant;

use super::*;
use crate::backend::Runtime;
use crate::toolbox::Agent;
use crate::waiting::{Lines, Rate, Waiting, hooks};

/// Most agents waiting at once in one sandbox (one per session); past it
/// the oldest is forgotten.
pub const WAITING_MAX: usize = 16;

/// The time between two runs of a sandbox's listener (when it ended while
/// the sandbox still runs: the sandbox's processes may kill it).
const RELISTEN: Duration = Duration::from_secs(5);

/// What changed on the [`Board`].
#[derive(Debug, Clone)]
pub enum WaitingEvent {
    /// An agent in sandbox `.0` (owned by uid `.1`) waits.
    Waiting(String, u32, Waiting),
    /// Nobody waits any more in session `.2` of sandbox `.0` (owned by uid
    /// `.1`): someone typed there, or the sandbox stopped.
    Answered(String, u32, String),
}

/// The agents waiting in one sandbox, while agentd listens to it.
#[derive(Debug)]
struct Listening {
    owner: u32,
    waiting: Vec<Waiting>,
}

/// Who waits where, by sandbox: only sandboxes agentd listens to now.
#[derive(Debug)]
pub struct Board {
    map: Mutex<HashMap<String, Listening>>,
    events: broadcast::Sender<WaitingEvent>,
}

impl Default for Board {
    fn default() -> Self {
        Self {
            map: Mutex::default(),
            events: broadcast::channel(256).0,
        }
    }
}

impl Board {
    /// agentd listens to sandbox `name` of `owner` (from now until
    /// [`Board::clear`]).
    fn listen(&self, name: &str, owner: u32) {
        self.map.lock().unwrap().insert(
            name.to_owned(),
            Listening {
                owner,
                waiting: Vec::new(),
            },
        );
    }

    /// An agent of sandbox `name` waits (in place of what waited in its
    /// session); nothing when agentd no longer listens to it.
    fn set(&self, name: &str, w: Waiting) {
        let owner = {
            let mut map = self.map.lock().unwrap();
            let Some(l) = map.get_mut(name) else {
                return;
            };
            l.waiting.retain(|o| o.session != w.session);
            if l.waiting.len() >= WAITING_MAX {
                l.waiting.remove(0);
            }
            l.waiting.push(w.clone());
            l.owner
        };
        let _ = self
            .events
            .send(WaitingEvent::Waiting(name.to_owned(), owner, w));
    }

    /// Someone typed into `session` of sandbox `name`.
    pub fn answered(&self, name: &str, session: &str) {
        let owner = {
            let mut map = self.map.lock().unwrap();
            let Some(l) = map.get_mut(name) else {
                return;
            };
            let before = l.waiting.len();
            l.waiting.retain(|o| o.session != session);
            if before == l.waiting.len() {
                return;
            }
            l.owner
        };
        let _ = self.events.send(WaitingEvent::Answered(
            name.to_owned(),
            owner,
            session.to_owned(),
        ));
    }

    /// Sandbox `name` stopped (or goes): nothing in it waits, and nothing
    /// heard from it any more counts.
    fn clear(&self, name: &str) {
        let Some(gone) = self.map.lock().unwrap().remove(name) else {
            return;
        };
        for w in gone.waiting {
            let _ = self.events.send(WaitingEvent::Answered(
                name.to_owned(),
                gone.owner,
                w.session,
            ));
        }
    }

    /// How many wait in sandbox `name`.
    #[must_use]
    pub fn count(&self, name: &str) -> usize {
        self.map
            .lock()
            .unwrap()
            .get(name)
            .map_or(0, |l| l.waiting.len())
    }

    /// What waits in sandbox `name`, oldest first.
    #[must_use]
    pub fn of(&self, name: &str) -> Vec<Waiting> {
        self.map
            .lock()
            .unwrap()
            .get(name)
            .map(|l| l.waiting.clone())
            .unwrap_or_default()
    }
}

impl Manager {
    /// What changes on the board of waiting agents, as it happens.
    pub fn subscribe_waiting(&self) -> broadcast::Receiver<WaitingEvent> {
        self.board.events.subscribe()
    }

    /// The agents waiting in the caller's sandboxes (`name`: only that
    /// one), by sandbox.
    ///
    /// # Errors
    /// As [`Manager::get`], for a `name` the caller may not see.
    pub fn waiting(&self, caller: Caller, name: Option<&str>) -> Result<Vec<(String, Waiting)>> {
        let names = match name {
            Some(n) => vec![self.get(caller, n)?.name],
            None => self.list(caller).into_iter().map(|s| s.name).collect(),
        };
        Ok(names
            .into_iter()
            .flat_map(|n| self.board.of(&n).into_iter().map(move |w| (n.clone(), w)))
            .collect())
    }

    /// How many agents wait in sandbox `name`.
    pub(super) fn waiting_count(&self, name: &str) -> u32 {
        u32::try_from(self.board.count(name)).unwrap_or(u32::MAX)
    }

    /// The board, for a session's tap (typing clears its session).
    pub(super) fn board(&self) -> Arc<Board> {
        Arc::clone(&self.board)
    }

    /// Listen in running sandbox `name` for its agents' hooks, after
    /// configuring them; ends with the run.
    pub(super) fn listen_for_agents(self: &Arc<Self>, name: &str) {
        let Some(sb) = self.snapshot(name) else {
            return;
        };
        let Some(runtime) = sb.runtime else {
            return;
        };
        self.board.listen(name, sb.owner);
        let task = tokio::spawn(listen(Arc::downgrade(self), name.to_owned(), runtime));
        self.listeners
            .lock()
            .unwrap()
            .insert(name.to_owned(), watch::Handle::of_task(task));
    }

    /// Stop listening in sandbox `name` (it stops or goes): nothing in it
    /// waits any more.
    pub(super) fn stop_listening(&self, name: &str) {
        self.listeners.lock().unwrap().remove(name);
        self.board.clear(name);
    }

    /// The backend, spec and exec request of sandbox `name` while it still
    /// runs as `runtime`, for a command of agentd's own.
    fn own_command(
        &self,
        name: &str,
        runtime: &Runtime,
        script: &str,
        args: &[&str],
    ) -> Option<(Arc<dyn Backend>, SandboxSpec, ExecRequest)> {
        let sb = self.snapshot(name)?;
        if sb.state != SandboxState::Running || sb.runtime.as_ref() != Some(runtime) {
            return None;
        }
        self.command_in(&sb, script, args)
    }

    /// Whether sandbox `name` is paused in its run `runtime` (it may go on).
    fn paused_in(&self, name: &str, runtime: &Runtime) -> bool {
        self.snapshot(name).is_some_and(|sb| {
            sb.state == SandboxState::Paused && sb.runtime.as_ref() == Some(runtime)
        })
    }

    /// A command of agentd's own in sandbox `sb`.
    fn command_in(
        &self,
        sb: &Sandbox,
        script: &str,
        args: &[&str],
    ) -> Option<(Arc<dyn Backend>, SandboxSpec, ExecRequest)> {
        let backend = Arc::clone(self.backend(sb.backend).ok()?);
        let mut env = BTreeMap::new();
        self.add_sandbox_env(sb, &mut env);
        let mut argv = vec!["/bin/sh".to_owned(), "-c".to_owned(), script.to_owned()];
        argv.push("keystone-waiting".to_owned());
        argv.extend(args.iter().map(|a| (*a).to_owned()));
        let req = ExecRequest {
            argv,
            env,
            cwd: "/".to_owned(),
            timeout: None,
        };
        Some((backend, self.spec(sb), req))
    }

    /// Add agentd's hooks to the agents' settings in sandbox `name`
    /// (merged with the person's; see [`hooks`]), unless the sandbox has
    /// `~/.keystone/no-hooks`.
    async fn configure_hooks(&self, name: &str, runtime: &Runtime) {
        let Some((backend, spec, mut req)) = self.own_command(name, runtime, &read_script(), &[])
        else {
            return;
        };
        req.timeout = Some(HOOKS_TIMEOUT);
        let out = match crate::backend::capture(&*backend, &spec, req).await {
            Ok(r) if r.exit_code == 0 => r.stdout,
            Ok(r) if r.exit_code == OPTED_OUT => {
                tracing::info!(sandbox = %name, "~/.keystone/no-hooks: the agents' hooks are left alone");
                return;
            }
            Ok(r) => {
                tracing::warn!(sandbox = %name, code = r.exit_code, "cannot read the agents' settings; their hooks are not configured");
                return;
            }
            Err(e) => {
                tracing::warn!(sandbox = %name, error = %e, "cannot read the agents' settings; their hooks are not configured");
                return;
            }
        };
        for file in split_files(&out) {
            let agent = file.agent;
            let merged = match hooks::merge(agent, file.text) {
                Ok(Some(m)) => m,
                Ok(None) => continue,
                Err(why) => {
                    tracing::warn!(sandbox = %name, agent = agent.as_str(), reason = %why, "the agent's settings are left as they are: it will not say when it waits");
                    continue;
                }
            };
            let write = write_script(agent);
            let size = merged.len().to_string();
            let Some((backend, spec, mut req)) =
                self.own_command(name, runtime, &write, &[&file.sum, &size])
            else {
                return;
            };
            req.timeout = Some(HOOKS_TIMEOUT);
            let wrote = tokio::time::timeout(
                HOOKS_TIMEOUT,
                exec_with_input(&*backend, &spec, req, merged),
            )
            .await;
            match wrote {
                Ok(Ok(0)) => {
                    tracing::info!(sandbox = %name, agent = agent.as_str(), "configured the agent's hooks");
                }
                Ok(Ok(CHANGED)) => {
                    tracing::info!(sandbox = %name, agent = agent.as_str(), "the agent's settings changed meanwhile; its hooks wait for the next start");
                }
                Ok(Ok(code)) => {
                    tracing::warn!(sandbox = %name, agent = agent.as_str(), code, "cannot write the agent's settings");
                }
                Ok(Err(e)) => {
                    tracing::warn!(sandbox = %name, agent = agent.as_str(), error = %e, "cannot write the agent's settings");
                }
                Err(_) => {
                    tracing::warn!(sandbox = %name, agent = agent.as_str(), "writing the agent's settings took too long");
                }
            }
        }
    }

    /// Take a line from sandbox `name`'s listener (every line costs from
    /// `rate` before it is even read, a notice or not).
    fn heard(&self, name: &str, line: &[u8], rate: &mut Rate) {
        if !rate.allow(Instant::now()) {
            if rate.dropped.is_power_of_two() {
                tracing::warn!(sandbox = %name, dropped = rate.dropped, "the sandbox says its agents wait too often; dropping what it says");
            }
            return;
        }
        let Some(w) = crate::waiting::parse(line, name) else {
            return;
        };
        tracing::info!(sandbox = %name, agent = %w.agent, session = %w.session, message = %w.message, "an agent waits");
        self.board.set(name, w);
    }
}

/// How long agentd's commands that read and write the agents' settings
/// may take.
const HOOKS_TIMEOUT: Duration = Duration::from_secs(30);

/// The reading script's exit code when the sandbox has
/// `~/.keystone/no-hooks`.
const OPTED_OUT: i32 = 3;

/// The writing script's exit code when the file changed since it was
/// read (left alone: the next start merges again).
const CHANGED: i32 = 4;

/// The script that prints each agent's settings file: `AGENT SIZE SUM`
/// and its bytes (read once, into a file of its own, made at the first
/// file there is: each program started in the sandbox costs about a
/// millisecond of CPU), or `AGENT - -`.
fn read_script() -> String {
    format!(
        r#"[ -e "$HOME/.keystone/no-hooks" ] && exit {OPTED_OUT}
t=
trap '[ -z "$t" ] || rm -f "$t"' EXIT
for a in claude codex gemini; do
  case $a in claude) f={claude};; codex) f={codex};; gemini) f={gemini};; esac
  if [ -f "$f" ] && [ -z "$t" ]; then t=$(mktemp) || exit 1; fi
  if [ -f "$f" ] && head -c {max} "$f" > "$t"; then
    printf '%s %s %s\n' $a "$(wc -c < "$t")" "$(cksum < "$t" | cut -d' ' -f1)"
    cat "$t"
  else
    printf '%s - -\n' $a
  fi
done"#,
        claude = hooks::path_snippet(Agent::Claude),
        codex = hooks::path_snippet(Agent::Codex),
        gemini = hooks::path_snippet(Agent::Gemini),
        max = hooks::FILE_MAX + 1,
    )
}

/// The script that writes `agent`'s settings from its standard input:
/// `$1` the sum the file had when read (`-`: none), `$2` the new size.
/// Through a symlink to where it points, keeping the file's mode, whole or
/// not at all, and only if the file is still as it was read.
fn write_script(agent: Agent) -> String {
    format!(
        r#"f={path}
if [ -L "$f" ]; then f=$(readlink -f "$f") || exit 1; fi
[ -d "${{f%/*}}" ] || mkdir -p "${{f%/*}}" || exit 1
if [ -f "$f" ]; then now=$(head -c {max} "$f" | cksum | cut -d' ' -f1); else now=-; fi
[ "$now" = "$1" ] || exit {CHANGED}
t="$f.keystone-new.$$"
(umask 077 && cat > "$t") && [ "$(wc -c < "$t")" -eq "$2" ] || {{ rm -f "$t"; exit 1; }}
if [ -f "$f" ]; then chmod "$(stat -c %a "$f")" "$t"; fi
mv -f "$t" "$f""#,
        path = hooks::path_snippet(agent),
        max = hooks::FILE_MAX + 1,
    )
}

/// The body of [`Manager::listen_for_agents`]: configure the hooks, then
/// run the listener (again after [`RELISTEN`] when it ends) as long as the
/// sandbox runs as `runtime` (or is paused in that run).
async fn listen(this: Weak<Manager>, name: String, runtime: Runtime) {
    if let Some(m) = this.upgrade() {
        m.configure_hooks(&name, &runtime).await;
    }
    let mut rate = Rate::default();
    loop {
        let command = {
            let Some(m) = this.upgrade() else { return };
            match m.own_command(&name, &runtime, crate::waiting::LISTENER, &[]) {
                Some(c) => Some(c),
                None if m.paused_in(&name, &runtime) => None,
                None => return,
            }
        };
        if let Some((backend, spec, req)) = command {
            let Ok((read, write)) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) else {
                return;
            };
            let (Ok(null_in), Ok(null_err)) = (
                std::fs::File::open("/dev/null"),
                std::fs::OpenOptions::new().write(true).open("/dev/null"),
            ) else {
                return;
            };
            let run = backend.exec(&spec, req, [null_in.into(), write, null_err.into()]);
            let hear = hear(&this, &name, read, &mut rate);
            let (result, ()) = tokio::join!(run, hear);
            if let Err(e) = result {
                tracing::debug!(sandbox = %name, error = %e, "the agents' listener ended");
            }
        }
        tokio::time::sleep(RELISTEN).await;
    }
}

/// Read `fd` (the listener's output) to its end, line by line, at most
/// [`crate::waiting::READ_BURST`] reads at once: past that agentd waits,
/// and so does the writer inside.
async fn hear(this: &Weak<Manager>, name: &str, fd: OwnedFd, rate: &mut Rate) {
    use tokio::io::AsyncReadExt;
    let Ok(mut rx) = tokio::net::unix::pipe::Receiver::from_owned_fd(fd) else {
        return;
    };
    let mut reads = Rate::new(crate::waiting::READ_BURST, crate::waiting::READ_REFILL);
    let mut lines = Lines::default();
    let mut buf = vec![0u8; 4096];
    loop {
        if let Some(at) = reads.next_at() {
            tokio::time::sleep_until(at.into()).await;
        }
        reads.allow(Instant::now());
        match rx.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let Some(m) = this.upgrade() else { return };
                lines.feed(&buf[..n], |line| m.heard(name, line, rate));
            }
        }
    }
}

/// One agent's settings file as the reading script printed it.
#[derive(Debug, PartialEq, Eq)]
struct File<'a> {
    agent: Agent,
    /// Its bytes; `None` when there is none.
    text: Option<&'a [u8]>,
    /// Its `cksum` (`-`: none), for the writing script to see it unchanged.
    sum: String,
}

/// The files in the output of [`read_script`]: `AGENT SIZE SUM\n` and that
/// many bytes, or `AGENT - -\n` for none. Stops at anything else.
fn split_files(mut out: &[u8]) -> Vec<File<'_>> {
    let mut files = Vec::new();
    while let Some(nl) = out.iter().position(|&b| b == b'\n') {
        let head = String::from_utf8_lossy(&out[..nl]).into_owned();
        out = &out[nl + 1..];
        let mut f = head.split(' ');
        let (Some(agent), Some(size), Some(sum), None) = (f.next(), f.next(), f.next(), f.next())
        else {
            break;
        };
        let Some(&agent) = Agent::ALL.iter().find(|a| a.as_str() == agent) else {
            break;
        };
        if !(sum == "-" || (!sum.is_empty() && sum.bytes().all(|b| b.is_ascii_digit()))) {
            break;
        }
        let sum = sum.to_owned();
        if size == "-" {
            files.push(File {
                agent,
                text: None,
                sum,
            });
            continue;
        }
        let Ok(size) = size.parse::<usize>() else {
            break;
        };
        if size > hooks::FILE_MAX + 1 || out.len() < size {
            break;
        }
        files.push(File {
            agent,
            text: Some(&out[..size]),
            sum,
        });
        out = &out[size..];
    }
    files
}

/// Run `req` in the sandbox with `input` as its standard input; its exit
/// code.
async fn exec_with_input(
    backend: &dyn Backend,
    spec: &SandboxSpec,
    req: ExecRequest,
    input: Vec<u8>,
) -> std::result::Result<i32, crate::backend::BackendError> {
    use tokio::io::AsyncWriteExt;
    let fail = |e: nix::Error| crate::backend::BackendError::Descriptor(e.into());
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(fail)?;
    let null = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .map(OwnedFd::from)
            .map_err(crate::backend::BackendError::Descriptor)
    };
    let (out, err) = (null()?, null()?);
    let feed = async move {
        if let Ok(mut tx) = tokio::net::unix::pipe::Sender::from_owned_fd(write) {
            let _ = tx.write_all(&input).await;
        }
    };
    let (code, ()) = tokio::join!(backend.exec(spec, req, [read, out, err]), feed);
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(session: &str) -> Waiting {
        Waiting {
            session: session.to_owned(),
            agent: "claude".to_owned(),
            message: "m".to_owned(),
            time: SystemTime::now(),
        }
    }

    #[test]
    fn the_board_keeps_one_per_session_and_a_bounded_number() {
        let b = Board::default();
        let mut rx = b.events.subscribe();
        // Nothing counts from a sandbox agentd does not listen to.
        b.set("demo", waiting("demo-main"));
        assert!(b.of("demo").is_empty());
        b.listen("demo", 1000);
        b.set("demo", waiting("demo-main"));
        b.set("demo", waiting("demo-main"));
        assert_eq!(b.of("demo").len(), 1);
        for i in 0..100 {
            b.set("demo", waiting(&format!("demo-{i}")));
        }
        assert_eq!(b.of("demo").len(), WAITING_MAX);
        b.answered("demo", "demo-99");
        assert_eq!(b.of("demo").len(), WAITING_MAX - 1);
        // Answering where nobody waits says nothing.
        b.answered("demo", "demo-main");
        b.clear("demo");
        assert!(b.of("demo").is_empty());
        b.set("demo", waiting("demo-late"));
        assert!(
            b.of("demo").is_empty(),
            "a late notice after the stop counted"
        );
        let mut answered = 0;
        while let Ok(e) = rx.try_recv() {
            if matches!(e, WaitingEvent::Answered(..)) {
                answered += 1;
            }
        }
        assert_eq!(answered, WAITING_MAX);
    }

    #[test]
    fn settings_files_are_split() {
        let out = b"claude 2 123\n{}codex - -\ngemini 3 456\nabc";
        let files = split_files(out);
        let file = |agent, text: Option<&'static [u8]>, sum: &str| File {
            agent,
            text,
            sum: sum.to_owned(),
        };
        assert_eq!(
            files,
            vec![
                file(Agent::Claude, Some(b"{}"), "123"),
                file(Agent::Codex, None, "-"),
                file(Agent::Gemini, Some(b"abc"), "456"),
            ]
        );
        // A short file, an unknown agent, a sum that is not one: the list
        // ends there.
        assert!(split_files(b"claude 10 1\n{}").is_empty());
        assert!(split_files(b"evil 1 1\nx").is_empty());
        assert!(split_files(b"claude 1 $(x)\nx").is_empty());
    }
}

//! Commands run in a sandbox, and the history of what ran there.

use super::*;

impl Manager {
    /// Run a command in running sandbox `name`: with `call.stdio`, on those
    /// descriptors (output streams as it runs); without, collecting output.
    pub async fn exec(&self, caller: Caller, name: &str, call: ExecCall) -> Result<ExecResult> {
        let started = SystemTime::now();
        let (kind, detail) = call
            .record_as
            .clone()
            .unwrap_or_else(|| ("exec".to_owned(), shell_words(&call.argv)));
        // Only callers who may use the sandbox get a history entry.
        let sb = self.get(caller, name)?;
        let result = self.exec_inner(&sb, call).await;
        self.record_run(
            name,
            caller.uid,
            (kind, detail),
            started,
            result.as_ref().map(|r| r.exit_code),
        );
        result
    }

    /// Record in `name`'s history a command run for `uid` since `started`:
    /// its exit code, or -1 and why it failed.
    pub(super) fn record_run(
        &self,
        name: &str,
        uid: u32,
        (kind, detail): (String, String),
        started: SystemTime,
        outcome: std::result::Result<i32, impl std::fmt::Display>,
    ) {
        let (exit_code, error) = match outcome {
            Ok(c) => (c, String::new()),
            Err(e) => (-1, crate::text::clamp_text(&e.to_string()).into_owned()),
        };
        let detail = crate::text::clamp_text(&detail).into_owned();
        self.record(
            name,
            HistoryEntry {
                time: crate::text::micros(Some(started)),
                uid,
                kind,
                detail,
                exit_code,
                duration_ms: u64::try_from(started.elapsed().unwrap_or_default().as_millis())
                    .unwrap_or(u64::MAX),
                error,
            },
        );
    }

    /// Append `entry` to sandbox `name`'s history (`logs/history.jsonl`,
    /// append-only, one JSON object per line).
    pub(super) fn record(&self, name: &str, entry: HistoryEntry) {
        let path = self
            .store
            .registry()
            .sandbox_dir(name)
            .join("logs/history.jsonl");
        if let Err(e) = crate::fsutil::append_json_line(&path, &entry) {
            tracing::warn!(sandbox = %name, error = %e, "cannot record history");
        }
    }

    /// The last `limit` entries (0 = all) of sandbox `name`'s history.
    pub fn history(&self, caller: Caller, name: &str, limit: usize) -> Result<Vec<HistoryEntry>> {
        self.get(caller, name)?;
        let path = self
            .store
            .registry()
            .sandbox_dir(name)
            .join("logs/history.jsonl");
        let all: Vec<HistoryEntry> =
            crate::fsutil::read_json_lines(&path).map_err(|source| Error::Workspace {
                name: name.to_owned(),
                source: WorkspaceError::Read {
                    path: path.clone(),
                    source,
                },
            })?;
        let skip = if limit == 0 {
            0
        } else {
            all.len().saturating_sub(limit)
        };
        Ok(all.into_iter().skip(skip).collect())
    }

    pub(super) async fn exec_inner(&self, sb: &Sandbox, mut call: ExecCall) -> Result<ExecResult> {
        let stdio = call.stdio.take();
        let backend = Arc::clone(self.backend(sb.backend)?);
        let req = self.exec_request(sb, call).await?;
        let spec = self.spec(sb);
        let result = match stdio {
            Some(fds) => backend
                .exec(&spec, req, fds)
                .await
                .map(|exit_code| ExecResult {
                    exit_code,
                    stdout: Vec::new(),
                    stderr: Vec::new(),
                }),
            None => crate::backend::capture(backend.as_ref(), &spec, req).await,
        };
        result.map_err(|source| Error::Backend {
            name: sb.name.clone(),
            source,
        })
    }

    /// Check `call` against running sandbox `sb` and resolve its working
    /// directory.
    pub(super) async fn exec_request(&self, sb: &Sandbox, call: ExecCall) -> Result<ExecRequest> {
        let name = sb.name.as_str();
        let ExecCall {
            argv,
            env,
            cwd,
            timeout,
            worktree,
            ..
        } = call;
        let mut problems = Vec::new();
        if argv.is_empty() {
            problems.push("no command given".to_owned());
        }
        validate::check_command(&argv, env.iter(), &mut problems);
        validate::check_len("the working directory", &cwd, &mut problems);
        if let Some(w) = &worktree {
            validate::check_len("the worktree", w, &mut problems);
        }
        for k in env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                problems.push(format!(
                    "environment variable name '{}' is not valid",
                    crate::text::shown(k)
                ));
            }
        }
        if !cwd.is_empty() && !cwd.starts_with('/') {
            problems.push(format!(
                "working directory '{}' must be an absolute path inside the sandbox",
                crate::text::shown(&cwd)
            ));
        }
        if !problems.is_empty() {
            return Err(Error::Invalid(problems));
        }
        if sb.state != SandboxState::Running {
            return Err(Error::InvalidState {
                name: name.to_owned(),
                verb: "run a command in",
                state: sb.state,
                hint: "start it with `agentctl start`",
            });
        }
        let cwd = match (worktree, cwd.is_empty()) {
            (Some(_), false) => {
                return Err(Error::Invalid(vec![
                    "give either a worktree or a working directory, not both".into(),
                ]));
            }
            (Some(branch), true) => self.worktree_dir(sb, &branch).await?,
            (None, true) => worktree::SANDBOX_ROOT.to_owned(),
            (None, false) => cwd,
        };
        let mut env = env;
        self.add_sandbox_env(sb, &mut env);
        Ok(ExecRequest {
            argv,
            env,
            cwd,
            timeout,
        })
    }
}

/// A command line as a person would type it (arguments with spaces or
/// quotes are single-quoted).
pub(super) fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

//! Commands run in a sandbox, and the history of what ran there.

use super::*;

impl Manager {
    /// Run a command in running sandbox `name`: with `call.stdio`, on those
    /// descriptors (output streams as it runs); without, collecting output.
    pub async fn exec(&self, caller: Caller, name: &str, call: ExecCall) -> Result<ExecResult> {
        let started = SystemTime::now();
        // Only callers who may use the sandbox get a history entry.
        let sb = self.get(caller, name)?;
        let (kind, detail) = call.recorded_as()?;
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

impl ExecCall {
    /// The kind and detail of this call's history entry: the command line
    /// (`exec`), or what `agentctl cp` asked for with `record_as`.
    ///
    /// The history is an audit record, so `record_as` is taken only for
    /// the exact commands cp runs, without environment, directory or
    /// worktree (`TAR_OPTIONS` or a planted directory could make them do
    /// more): its two `tar` commands, recorded as `cp` with a description
    /// that must name the sandbox path they touch, and its check of the
    /// destination (`test -d PATH`), recorded as `cp-check` with the command
    /// line (which `agentctl history` leaves out unless asked).
    ///
    /// # Errors
    /// [`Error::Invalid`] when `record_as` does not fit the command.
    pub fn recorded_as(&self) -> Result<(String, String)> {
        let Some(record) = &self.record_as else {
            return Ok(("exec".to_owned(), shell_words(&self.argv)));
        };
        let argv: Vec<&str> = self.argv.iter().map(String::as_str).collect();
        let plain = self.env.is_empty() && self.cwd.is_empty() && self.worktree.is_none();
        let abs = |p: &str| p.starts_with('/') && !p.contains('\0');
        let fits = plain
            && match (record.split_once(' '), argv.as_slice()) {
                (None, ["test", "-d", path]) if record == "cp-check" => abs(path),
                (Some(("cp", what)), ["tar", "-x", "-p", "--no-same-owner", "-C", dir]) => {
                    abs(dir) && what.contains(&format!(":{dir}"))
                }
                (Some(("cp", what)), ["tar", "-c", "-C", dir, "--", base]) => {
                    let path = format!("{}/{base}", dir.trim_end_matches('/'));
                    abs(dir)
                        && !base.is_empty()
                        && !base.contains('/')
                        && what.contains(&format!(":{path}"))
                }
                _ => false,
            };
        if !fits {
            return Err(Error::Invalid(vec![format!(
                "record_as '{}' does not fit this command: it is only for the commands of \
                 `agentctl cp` (its tar commands, with a description that names the sandbox \
                 path, and `test -d PATH` as 'cp-check'), with no environment, directory or \
                 worktree; run other commands without record_as",
                crate::text::clamp_to(record, 200)
            )]));
        }
        Ok(match record.split_once(' ') {
            Some((kind, what)) => (kind.to_owned(), what.to_owned()),
            None => (record.clone(), shell_words(&self.argv)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(argv: &[&str], record: &str) -> ExecCall {
        ExecCall {
            argv: argv.iter().map(|a| (*a).to_owned()).collect(),
            record_as: (!record.is_empty()).then(|| record.to_owned()),
            ..ExecCall::default()
        }
    }

    #[test]
    fn cp_records_its_own_commands_and_nothing_else() {
        let ok = |argv: &[&str], record: &str| call(argv, record).recorded_as().unwrap();
        assert_eq!(
            ok(&["test", "-d", "/workspace/"], "cp-check"),
            ("cp-check".into(), "test -d /workspace/".into())
        );
        let into = ["tar", "-x", "-p", "--no-same-owner", "-C", "/workspace"];
        assert_eq!(
            ok(&into, "cp ./a -> s:/workspace"),
            ("cp".into(), "./a -> s:/workspace".into())
        );
        let out = ["tar", "-c", "-C", "/workspace", "--", "tree"];
        assert_eq!(
            ok(&out, "cp s:/workspace/tree -> ./back").1,
            "s:/workspace/tree -> ./back"
        );
        assert_eq!(
            ok(&["tar", "-c", "-C", "/", "--", "a"], "cp s:/a -> b").1,
            "s:/a -> b"
        );
        assert_eq!(ok(&["rm", "-rf", "/"], "").0, "exec");

        for (argv, record) in [
            // Any other command, even with the right description.
            (&["rm", "-rf", "/workspace"][..], "cp ./a -> s:/workspace"),
            (&["sh", "-c", "test -d /x"], "cp-check"),
            (&["test", "-d", "/x", "-o", "x"], "cp-check"),
            (&["test", "-d", "relative"], "cp-check"),
            // A description that hides where the copy went.
            (&into, "cp ./a -> s:/tmp"),
            (&out, "cp s:/workspace/other -> ./back"),
            // No such kind.
            (&into, "exec ./a -> s:/workspace"),
            (&["test", "-d", "/x"], "cp-check /x"),
            (&["test", "-d", "/x"], "cp"),
        ] {
            let e = call(argv, record).recorded_as().unwrap_err().to_string();
            assert!(
                e.contains("only for the commands of `agentctl cp`"),
                "{argv:?} {e}"
            );
        }
        // Its commands with an environment, a directory or a worktree.
        let mut c = call(&into, "cp ./a -> s:/workspace");
        c.env.insert("TAR_OPTIONS".into(), "--to-command=sh".into());
        assert!(c.recorded_as().is_err());
        let mut c = call(&["test", "-d", "/x"], "cp-check");
        c.cwd = "/tmp".into();
        assert!(c.recorded_as().is_err());
        let mut c = call(&["test", "-d", "/x"], "cp-check");
        c.worktree = Some("main".into());
        assert!(c.recorded_as().is_err());
    }
}

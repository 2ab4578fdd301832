//! Commands run in a sandbox, and the history of what ran there.

use super::*;

impl Manager {
    /// Run a command in running sandbox `name`: with `call.stdio`, on those
    /// descriptors (output streams as it runs); without, collecting output.
    pub async fn exec(
        self: &Arc<Self>,
        caller: Caller,
        name: &str,
        call: ExecCall,
    ) -> Result<ExecResult> {
        let started = SystemTime::now();
        // Only callers who may use the sandbox get a history entry.
        let sb = self.get(caller, name)?;
        let (kind, detail) = call.recorded_as(name)?;
        let sb = self.wake(caller, sb).await?;
        let _busy = self.busy(name);
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
        let dir = match self.mounted_by_name(name) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(sandbox = %name, error = %e, "cannot record history");
                return;
            }
        };
        let path = dir.dir().join("logs/history.jsonl");
        if let Err(e) = crate::fsutil::append_json_line(&path, &entry) {
            tracing::warn!(sandbox = %name, error = %e, "cannot record history");
        }
    }

    /// The last `limit` entries (0 = all) of sandbox `name`'s history.
    pub fn history(&self, caller: Caller, name: &str, limit: usize) -> Result<Vec<HistoryEntry>> {
        let dir = self.mounted_now(&self.get(caller, name)?)?;
        let path = dir.dir().join("logs/history.jsonl");
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
                hint: if sb.state == SandboxState::Paused {
                    "resume it with `agentctl resume`"
                } else {
                    "start it with `agentctl start`"
                },
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
    /// the exact commands cp runs in sandbox `sandbox`, without
    /// environment, directory or worktree (`TAR_OPTIONS` or a planted
    /// directory could make them do more): its two `tar` commands, recorded
    /// as `cp` with the description cp gives them, which must end with
    /// ` -> SANDBOX:DIR/NAME` (into `DIR`) or start with `SANDBOX:DIR/BASE ->`
    /// (out of `DIR/BASE`), the very directory the command touches, so that
    /// no other path can be claimed; and its check of the destination
    /// (`test -d PATH`), recorded as `cp-check` with the command line (which
    /// `agentctl history` leaves out unless asked). The description's
    /// local side is shortened to fit the entry, never its sandbox side.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `record_as` does not fit the command.
    pub fn recorded_as(&self, sandbox: &str) -> Result<(String, String)> {
        let Some(record) = &self.record_as else {
            return Ok(("exec".to_owned(), shell_words(&self.argv)));
        };
        let argv: Vec<&str> = self.argv.iter().map(String::as_str).collect();
        let plain = self.env.is_empty() && self.cwd.is_empty() && self.worktree.is_none();
        let abs = |p: &str| p.starts_with('/') && !p.contains('\0');
        // The local side, cut so that the entry keeps all of `sandbox_side`.
        let local = |l: &str, sandbox_side: &str| {
            let room = crate::text::TEXT_MAX.saturating_sub(sandbox_side.len());
            crate::text::clamp_to(l, room.max(256)).into_owned()
        };
        let detail = match (record.split_once(' '), argv.as_slice()) {
            _ if !plain => None,
            (None, ["test", "-d", path]) if record == "cp-check" && abs(path) => {
                Some(shell_words(&self.argv))
            }
            (Some(("cp", what)), ["tar", "-x", "-p", "--no-same-owner", "-C", dir]) if abs(dir) => {
                let side = format!(" -> {sandbox}:{}/", dir.trim_end_matches('/'));
                what.rfind(&side).and_then(|at| {
                    let (from, to) = what.split_at(at);
                    let name = &to[side.len()..];
                    (!name.is_empty() && !name.contains('/')).then(|| local(from, to) + to)
                })
            }
            (Some(("cp", what)), ["tar", "-c", "-C", dir, "--", base])
                if abs(dir) && !base.is_empty() && !base.contains('/') =>
            {
                let side = format!("{sandbox}:{}/{base} -> ", dir.trim_end_matches('/'));
                what.strip_prefix(&side)
                    .map(|to| format!("{side}{}", local(to, &side)))
            }
            _ => None,
        };
        let Some(detail) = detail else {
            return Err(Error::Invalid(vec![format!(
                "record_as '{}' does not fit this command: it is only for the commands of \
                 `agentctl cp` (its tar commands, described as `LOCAL -> {sandbox}:DIR/NAME` or \
                 `{sandbox}:DIR/BASE -> LOCAL` with the directory the command touches, and \
                 `test -d PATH` as 'cp-check'), with no environment, directory or worktree; run \
                 other commands without record_as",
                crate::text::shown(record)
            )]));
        };
        let kind = record.split_once(' ').map_or(record.as_str(), |(k, _)| k);
        Ok((kind.to_owned(), detail))
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
        let ok = |argv: &[&str], record: &str| call(argv, record).recorded_as("s").unwrap();
        assert_eq!(
            ok(&["test", "-d", "/workspace/"], "cp-check"),
            ("cp-check".into(), "test -d /workspace/".into())
        );
        let into = ["tar", "-x", "-p", "--no-same-owner", "-C", "/workspace"];
        assert_eq!(
            ok(&into, "cp ./a -> s:/workspace/a"),
            ("cp".into(), "./a -> s:/workspace/a".into())
        );
        let slash = ["tar", "-x", "-p", "--no-same-owner", "-C", "/workspace/"];
        assert_eq!(
            ok(&slash, "cp a b -> s:/workspace/a b").1,
            "a b -> s:/workspace/a b"
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
            (&["rm", "-rf", "/workspace"][..], "cp ./a -> s:/workspace/a"),
            (&["sh", "-c", "test -d /x"], "cp-check"),
            (&["test", "-d", "/x", "-o", "x"], "cp-check"),
            (&["test", "-d", "relative"], "cp-check"),
            // A description that hides where the copy went.
            (&into, "cp ./a -> s:/tmp"),
            (&out, "cp s:/workspace/other -> ./back"),
            // No such kind.
            (&into, "exec ./a -> s:/workspace/a"),
            (&["test", "-d", "/x"], "cp-check /x"),
            (&["test", "-d", "/x"], "cp"),
        ] {
            let e = call(argv, record).recorded_as("s").unwrap_err().to_string();
            assert!(
                e.contains("only for the commands of `agentctl cp`"),
                "{argv:?} {e}"
            );
        }
        // Its commands with an environment, a directory or a worktree.
        let mut c = call(&into, "cp ./a -> s:/workspace/a");
        c.env.insert("TAR_OPTIONS".into(), "--to-command=sh".into());
        assert!(c.recorded_as("s").is_err());
        let mut c = call(&["test", "-d", "/x"], "cp-check");
        c.cwd = "/tmp".into();
        assert!(c.recorded_as("s").is_err());
        let mut c = call(&["test", "-d", "/x"], "cp-check");
        c.worktree = Some("main".into());
        assert!(c.recorded_as("s").is_err());
    }

    /// A copy's description names where the copy really went: the path the
    /// tar command touches, in this sandbox, where cp puts it, and still
    /// there once the entry is cut to size; a mention of the path anywhere
    /// else in it does not do.
    #[test]
    fn a_copy_cannot_claim_another_path() {
        let into = ["tar", "-x", "-p", "--no-same-owner", "-C", "/workspace"];
        let out = ["tar", "-c", "-C", "/workspace", "--", "tree"];
        for (argv, record) in [
            // The path is mentioned, but the copy claims to go elsewhere.
            (&into[..], "cp ./a -> s:/tmp/elsewhere (:/workspace)"),
            (&into, "cp ./a -> s:/tmp/elsewhere s:/workspace"),
            (&out, "cp s:/tmp/elsewhere -> ./b s:/workspace/tree"),
            // Another sandbox.
            (&into, "cp ./a -> other:/workspace/a"),
            (&out, "cp other:/workspace/tree -> ./b"),
            // A deeper path than the directory the archive goes into.
            (&into, "cp ./a -> s:/workspace/sub/a"),
        ] {
            let e = call(argv, record).recorded_as("s");
            assert!(e.is_err(), "{record} was taken as {e:?}");
        }
        // What the history keeps of a long description is its sandbox side.
        let long = format!("cp ./{} -> s:/workspace/a", "x".repeat(3000));
        let (_, detail) = call(&into, &long).recorded_as("s").unwrap();
        assert!(detail.len() <= crate::text::TEXT_MAX, "{}", detail.len());
        assert!(detail.ends_with(" -> s:/workspace/a"), "{detail}");
        assert!(detail.contains("bytes left out"), "{detail}");
        let long = format!("cp s:/workspace/tree -> ./{}", "x".repeat(3000));
        let (_, detail) = call(&out, &long).recorded_as("s").unwrap();
        assert!(detail.len() <= crate::text::TEXT_MAX, "{}", detail.len());
        assert!(detail.starts_with("s:/workspace/tree -> ./xxx"), "{detail}");
    }
}

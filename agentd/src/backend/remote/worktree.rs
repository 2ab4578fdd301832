//! Worktrees of a workspace inside: git run there, one worktree per branch
//! at `/workspace/.worktrees/<branch>` as in every backend. Branch names
//! are checked on agentd's side and passed as arguments, never as shell
//! text; what comes back is the sandbox's and is read as untrusted lines
//! of bounded length.

use crate::git::worktree::{Info, Reply, Request};

use super::{RemoteError, Shell, WORKSPACE, run};

/// Creates the worktree of `$1`: the branch if it exists, else a new one
/// from `$2`, the host's branch of that name, or HEAD.
const ADD: &str = r#"set -e
cd /workspace
b=$1; from=$2; dir=.worktrees/$b
if git show-ref --verify --quiet "refs/heads/$b"; then git worktree add -q "$dir" "$b"
elif [ -n "$from" ]; then git worktree add -q -b "$b" "$dir" "$from"
elif git show-ref --verify --quiet "refs/remotes/host/$b"; then git worktree add -q -b "$b" "$dir" "refs/remotes/host/$b"
else git worktree add -q -b "$b" "$dir" HEAD; fi"#;

/// Lists the worktrees as tab-separated records: `W path`, `H head`,
/// `B branch`, `R ahead behind` (against the host's branch), `D 0|1`.
const LIST: &str = r#"cd /workspace || exit 1
git worktree list --porcelain | while IFS= read -r line; do
  case "$line" in
    "worktree "*) p=${line#worktree }; printf 'W\t%s\n' "$p"
      printf 'D\t%s\n' "$(git --no-optional-locks -C "$p" status --porcelain 2>/dev/null | head -c1 | wc -c)";;
    "HEAD "*) printf 'H\t%s\n' "${line#HEAD }";;
    "branch refs/heads/"*) b=${line#branch refs/heads/}; printf 'B\t%s\n' "$b"
      if git show-ref --verify --quiet "refs/remotes/host/$b"; then
        printf 'R\t%s\n' "$(git rev-list --left-right --count "refs/heads/$b...refs/remotes/host/$b")"
      fi;;
  esac
done"#;

/// Parse [`LIST`]'s output: the main worktree first, as git lists it.
fn parse_list(text: &str) -> Vec<Info> {
    let mut out: Vec<Info> = Vec::new();
    for line in text.lines().take(10_000) {
        let Some((tag, value)) = line.split_once('\t') else {
            continue;
        };
        if tag == "W" {
            out.push(Info {
                branch: String::new(),
                path: value.to_owned(),
                head: String::new(),
                dirty: false,
                has_host_branch: false,
                ahead: 0,
                behind: 0,
                main: out.is_empty(),
                session: String::new(),
            });
            continue;
        }
        let Some(w) = out.last_mut() else {
            continue;
        };
        match tag {
            "H" => value.clone_into(&mut w.head),
            "B" => value.clone_into(&mut w.branch),
            "D" => w.dirty = value.trim() != "0",
            "R" => {
                let mut n = value.split_whitespace().map(|v| v.parse().unwrap_or(0));
                w.has_host_branch = true;
                w.ahead = n.next().unwrap_or(0);
                w.behind = n.next().unwrap_or(0);
            }
            _ => {}
        }
    }
    out
}

/// Carry out `req` on the worktrees inside.
///
/// # Errors
/// A command inside that fails (its exit code and output in the message).
pub async fn worktree(shell: &dyn Shell, req: Request) -> Result<Reply, RemoteError> {
    let script = |script: &'static str, args: Vec<String>| async move {
        let mut argv = vec![
            "sh".to_owned(),
            "-c".to_owned(),
            script.to_owned(),
            "sh".to_owned(),
        ];
        argv.extend(args);
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        run(shell, &argv, None).await
    };
    let failed = |what: &str, code: i32, out: &str| {
        RemoteError::Exec(format!(
            "{what} failed in {} (exit {code}): {out}",
            shell.place()
        ))
    };
    match req {
        Request::Add { branch, from, .. } => {
            let (code, out) = script(ADD, vec![branch.clone(), from.unwrap_or_default()]).await?;
            if code != 0 {
                return Err(failed(
                    &format!("creating the worktree of '{branch}'"),
                    code,
                    &out,
                ));
            }
            let (_, listed) = script(LIST, Vec::new()).await?;
            parse_list(&listed)
                .into_iter()
                .find(|w| w.branch == branch && !w.main)
                .map(Reply::Added)
                .ok_or_else(|| {
                    RemoteError::Exec(format!(
                        "the worktree of '{branch}' is not listed after its creation"
                    ))
                })
        }
        Request::List { .. } => {
            let (code, out) = script(LIST, Vec::new()).await?;
            if code != 0 {
                return Err(failed("listing the worktrees", code, &out));
            }
            Ok(Reply::Listed {
                worktrees: parse_list(&out),
            })
        }
        Request::Remove { branch, force, .. } => {
            let dir = format!(".worktrees/{branch}");
            let mut argv = vec!["git", "-C", WORKSPACE, "worktree", "remove"];
            if force {
                argv.push("--force");
            }
            argv.push(&dir);
            let (code, out) = run(shell, &argv, None).await?;
            if code != 0 {
                return Err(failed(
                    &format!("removing the worktree of '{branch}'"),
                    code,
                    &out,
                ));
            }
            Ok(Reply::Removed)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listing_is_read_as_untrusted_records() {
        let text = "W\t/workspace\nD\t0\nH\tabc\nB\tmain\nR\t2\t1\n\
                    W\t/workspace/.worktrees/feat\nD\t1\nH\tdef\nB\tfeat\n\
                    garbage line\nX\tunknown\nR\tnot numbers\n";
        let l = parse_list(text);
        assert_eq!(l.len(), 2);
        assert!(l[0].main && !l[1].main);
        assert_eq!((l[0].branch.as_str(), l[0].head.as_str()), ("main", "abc"));
        assert_eq!(
            (l[0].has_host_branch, l[0].ahead, l[0].behind),
            (true, 2, 1)
        );
        assert!(!l[0].dirty && l[1].dirty);
        assert_eq!(l[1].path, "/workspace/.worktrees/feat");
        // A malformed `R` counts as none, and nothing else breaks.
        assert!(l[1].has_host_branch);
        assert_eq!((l[1].ahead, l[1].behind), (0, 0));
    }
}

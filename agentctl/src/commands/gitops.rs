//! Git between host and sandbox: sync and worktrees.

use super::*;

pub(super) async fn run(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    command: Command,
) -> Result<i32> {
    match command {
        Command::Sync {
            name,
            branch,
            dry_run,
            into,
            from_host,
            allow_protected,
            accept_rewrite,
            json,
        } => {
            let sb = lookup(conn, manager, &name).await?;
            let opts = SyncOptions {
                branch,
                into,
                dry_run,
                from_host,
                allow_protected,
                accept_rewrite,
            };
            let r = sb.sync(opts.to_dict()).await?;
            if json {
                println!("{}", output::json(&output::sync_json(&r)));
            } else {
                output::print_sync(&name, &r);
            }
            // Scripts tell "something waits for you" and "nothing new"
            // apart from success.
            Ok(if !r.held.is_empty() {
                3
            } else if r.branches.is_empty() && r.into.is_empty() {
                2
            } else {
                0
            })
        }
        Command::Worktree(WorktreeCommand::Add { name, branch, from }) => {
            let sb = lookup(conn, manager, &name).await?;
            let w = sb
                .add_worktree(&branch, from.as_deref().unwrap_or(""))
                .await?;
            crate::outln!(
                "Worktree of '{}' ready at {} ({}).",
                w.branch,
                w.path,
                output::short(&w.head)
            );
            crate::outln!(
                "Run in it: agentctl exec {name} -w {} -- git status",
                w.path
            );
            Ok(0)
        }
        Command::Worktree(WorktreeCommand::List { name, json }) => {
            let sb = lookup(conn, manager, &name).await?;
            let list = sb.list_worktrees().await?;
            if json {
                let v: Vec<_> = list.iter().map(output::worktree_json).collect();
                println!("{}", crate::output::json(&v));
            } else {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|w| {
                        vec![
                            if w.branch.is_empty() {
                                "(detached)".to_owned()
                            } else {
                                w.branch.clone()
                            },
                            output::short(&w.head),
                            if w.dirty {
                                "yes".to_owned()
                            } else {
                                "no".to_owned()
                            },
                            if w.has_host_branch {
                                format!("+{} -{}", w.ahead, w.behind)
                            } else {
                                "-".to_owned()
                            },
                            w.path.clone(),
                            if w.session.is_empty() {
                                "-".to_owned()
                            } else {
                                w.session.clone()
                            },
                        ]
                    })
                    .collect();
                output::table(
                    &["BRANCH", "HEAD", "DIRTY", "VS HOST", "PATH", "SESSION"],
                    &rows,
                );
            }
            Ok(0)
        }
        Command::Worktree(WorktreeCommand::Remove {
            name,
            branch,
            force,
        }) => {
            let sb = lookup(conn, manager, &name).await?;
            sb.remove_worktree(&branch, force).await?;
            crate::outln!("Worktree of '{branch}' removed (the branch is kept).");
            Ok(0)
        }
        _ => unreachable!("dispatched by commands::run"),
    }
}

/// What destroying sandbox `name` would lose, for its prompt: the commits
/// that `project` does not have yet (a dry-run sync counts them), branch by
/// branch, and how to bring them home first.
pub(super) async fn at_stake(sb: &SandboxProxy<'_>, name: &str, project: &str) -> String {
    let dry = SyncOptions {
        dry_run: true,
        ..SyncOptions::default()
    };
    // The sandbox's repository may be made to stall a reader (a FIFO in
    // place of an object): the question waits no longer than any quick call.
    let limit = crate::bus::limit();
    let report = match tokio::time::timeout(limit, sb.sync(dry.to_dict())).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            return format!(
                "Cannot tell which commits {project} lacks ({e}); whatever was not synced is lost.\n"
            );
        }
        Err(_) => {
            return format!(
                "Cannot tell which commits {project} lacks (counting them took over {}s; \
                 --call-timeout SECONDS gives it longer); whatever was not synced is lost.\n",
                limit.as_secs()
            );
        }
    };
    let mut lost: Vec<(&str, u32)> = report
        .branches
        .iter()
        .filter(|b| !b.new.is_empty() && b.commits > 0)
        .map(|b| (b.branch.as_str(), b.commits))
        .collect();
    if lost.is_empty() {
        return format!(
            "Every commit of sandbox '{name}' is in {project} already (uncommitted changes are not \
             counted).\n"
        );
    }
    // Each branch counts the commits it has that the project lacks; one
    // commit on two branches counts on each, so there is no total.
    lost.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let branches: Vec<String> = lost.iter().map(|(b, n)| format!("{n} on {b}")).collect();
    format!(
        "Sandbox '{name}' has commits that {project} does not have: {}. Destroying it loses \
         them; bring them home first with: agentctl sync {name}\n",
        branches.join(", ")
    )
}

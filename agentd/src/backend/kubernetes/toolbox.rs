//! The agent toolbox in a Pod: each package the configured agents need is
//! copied once onto the sandbox's claim (its `agents/`, which the Pod sees
//! at [`crate::toolbox::INSIDE`] as every sandbox does), into a directory
//! named by its version, and marked complete only once whole; what other
//! versions left there is removed. The launchers come with the tools.
//!
//! Like the tools, it comes over exec: no registry, no image of ours, and
//! the very packages agentd checked when it downloaded them. A claim, not
//! the Pod's own volume, so that the copy (about 1.1 GB for all three
//! agents) is made once per sandbox and version, not at every start.

use std::collections::HashSet;

use super::workspace::Part;
use super::{Connected, KubeBackend, KubeError};
use crate::toolbox::{INSIDE, Toolbox};

/// The complete package directories, one per line.
const LIST: &str = r#"cd "$1" || exit 1
for d in */; do [ -f "$d.keystone-complete" ] && printf '%s\n' "${d%/}"; done
exit 0"#;

/// Unpack one package from stdin into `$1/$2`, replacing what an
/// interrupted copy left, and mark it complete.
const UNPACK: &str =
    r#"rm -rf "$1/$2" && tar -x --no-same-owner -C "$1" -f - && : > "$1/$2/.keystone-complete""#;

/// Remove every entry of `$1` not named in `$2` (names separated by
/// spaces).
const PRUNE: &str = r#"cd "$1" || exit 1
for d in * .[!.]*; do
  [ -e "$d" ] || continue
  case " $2 " in *" $d "*) ;; *) rm -rf "./$d" ;; esac
done
exit 0"#;

impl KubeBackend {
    /// Bring the toolbox into Pod `pod`; what `agentctl status` shows of
    /// its agents (with why they are missing when the copy failed: the
    /// sandbox runs without them rather than not at all).
    pub(super) async fn bring_agents(&self, c: &Connected, pod: &str) -> String {
        let Some(tb) = self.settings.toolbox.as_deref() else {
            return String::new();
        };
        match self.copy_agents(c, pod, tb).await {
            Ok(()) => tb.describe(),
            Err(e) => {
                tracing::warn!(pod, error = %e, "the agent toolbox is not in the Pod");
                format!("{} (not copied into the Pod: {e})", tb.describe())
            }
        }
    }

    async fn copy_agents(&self, c: &Connected, pod: &str, tb: &Toolbox) -> Result<(), KubeError> {
        let (code, out) = self
            .run(c, pod, &["sh", "-c", LIST, "sh", INSIDE], None)
            .await?;
        if code != 0 {
            return Err(KubeError::Exec(format!("cannot list {INSIDE}: {out}")));
        }
        // Only compared with agentd's own names: whatever the Pod printed.
        let present: HashSet<&str> = out.lines().collect();
        let wanted = tb.wanted();
        for pkg in &wanted {
            if present.contains(pkg.dir.as_str()) || !tb.has(pkg) {
                continue;
            }
            tracing::info!(pod, package = %pkg.dir, "copying an agent onto the Pod's claim");
            let argv = ["sh", "-c", UNPACK, "sh", INSIDE, pkg.dir.as_str()];
            let part = Part::Dir(tb.dir.join(&pkg.dir), pkg.dir.clone());
            self.send_archive(c, pod, &argv, vec![part], &pkg.dir)
                .await?;
        }
        let keep: Vec<&str> = wanted.iter().map(|p| p.dir.as_str()).collect();
        let (code, out) = self
            .run(
                c,
                pod,
                &["sh", "-c", PRUNE, "sh", INSIDE, &keep.join(" ")],
                None,
            )
            .await?;
        if code != 0 {
            return Err(KubeError::Exec(format!("cannot prune {INSIDE}: {out}")));
        }
        Ok(())
    }
}

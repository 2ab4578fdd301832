//! The agents' own hook settings that run [`super::PROGRAM`], merged with
//! what the person has there: agentd adds its entries when they are
//! missing and changes nothing else. A file agentd cannot read as its
//! format is left alone (and the reason logged): the person's settings
//! come first.
//!
//! | agent | file | what agentd adds |
//! |---|---|---|
//! | Claude Code | `$CLAUDE_CONFIG_DIR/settings.json` (`~/.claude/`) | `hooks.Notification` and `hooks.Stop` entries |
//! | Codex | `$CODEX_HOME/config.toml` (`~/.codex/`) | `notify`, when the file has none |
//! | Gemini CLI | `$GEMINI_CLI_HOME/.gemini/settings.json` (`~/.gemini/`) | `hooks.Notification` and `hooks.AfterAgent` entries |

use serde_json::{Value, json};

use super::PROGRAM;
use crate::toolbox::Agent;

/// Largest settings file agentd reads (and so merges); a larger one is
/// left alone.
pub const FILE_MAX: usize = 1 << 20;

/// The shell snippet that prints the path of `agent`'s settings file
/// inside the sandbox (with the agents' own variables, as they read it).
#[must_use]
pub fn path_snippet(agent: Agent) -> &'static str {
    match agent {
        Agent::Claude => r#""${CLAUDE_CONFIG_DIR:-$HOME/.claude}/settings.json""#,
        Agent::Codex => r#""${CODEX_HOME:-$HOME/.codex}/config.toml""#,
        Agent::Gemini => r#""${GEMINI_CLI_HOME:-$HOME}/.gemini/settings.json""#,
    }
}

/// The events of `agent` that mean it waits for its person.
fn events(agent: Agent) -> &'static [&'static str] {
    match agent {
        Agent::Claude => &["Notification", "Stop"],
        Agent::Codex => &["agent-turn-complete"],
        Agent::Gemini => &["Notification", "AfterAgent"],
    }
}

/// The command a hook of `agent` runs for `event`.
fn command(agent: Agent, event: &str) -> String {
    format!("{PROGRAM} {} {event}", agent.as_str())
}

/// `agent`'s settings file (`existing`, `None` when there is none) with
/// agentd's hooks in it: `Ok(None)` when it has them already, `Err` (why)
/// when it cannot be merged and is left alone.
///
/// # Errors
/// A file that is not the agent's format, or too large.
pub fn merge(agent: Agent, existing: Option<&[u8]>) -> Result<Option<Vec<u8>>, String> {
    if existing.is_some_and(|e| e.len() > FILE_MAX) {
        return Err(format!("larger than {} KiB", FILE_MAX >> 10));
    }
    let text = match existing.map(std::str::from_utf8) {
        None => None,
        Some(Ok(t)) => Some(t),
        Some(Err(_)) => return Err("not UTF-8".to_owned()),
    };
    match agent {
        Agent::Codex => Ok(merge_codex(text)?.map(String::into_bytes)),
        Agent::Claude | Agent::Gemini => Ok(merge_json(agent, text)?.map(String::into_bytes)),
    }
}

/// Claude Code's and Gemini CLI's `settings.json`: one hook group per
/// event, added unless a group there already runs the command.
fn merge_json(agent: Agent, text: Option<&str>) -> Result<Option<String>, String> {
    let mut root: Value = match text {
        Some(t) if !t.trim().is_empty() => {
            serde_json::from_str(t).map_err(|e| format!("not JSON: {e}"))?
        }
        _ => json!({}),
    };
    let obj = root.as_object_mut().ok_or("not a JSON object")?;
    let hooks = obj.entry("hooks").or_insert_with(|| json!({}));
    let hooks = hooks
        .as_object_mut()
        .ok_or("its \"hooks\" is not an object")?;
    let mut changed = false;
    for event in events(agent) {
        let cmd = command(agent, event);
        let groups = hooks.entry(*event).or_insert_with(|| json!([]));
        let groups = groups
            .as_array_mut()
            .ok_or_else(|| format!("its \"hooks.{event}\" is not a list"))?;
        let present = groups.iter().any(|g| {
            g.get("hooks")
                .and_then(Value::as_array)
                .is_some_and(|hs| hs.iter().any(|h| h.get("command") == Some(&json!(cmd))))
        });
        if present {
            continue;
        }
        let group = match agent {
            Agent::Gemini => json!({
                "matcher": "*",
                "hooks": [{"name": PROGRAM, "type": "command", "command": cmd}],
            }),
            _ => json!({"hooks": [{"type": "command", "command": cmd}]}),
        };
        groups.push(group);
        changed = true;
    }
    if !changed {
        return Ok(None);
    }
    let mut out = serde_json::to_string_pretty(&root).map_err(|e| e.to_string())?;
    out.push('\n');
    Ok(Some(out))
}

/// Codex's `config.toml`: a top-level `notify` (a program and its
/// arguments; Codex adds the JSON) at the top, unless the file has one.
/// A person's own `notify` stays (Codex runs only one).
fn merge_codex(text: Option<&str>) -> Result<Option<String>, String> {
    let text = text.unwrap_or("");
    let body = text.strip_prefix('\u{feff}').unwrap_or(text);
    if has_top_level(body, "notify") {
        return Ok(None);
    }
    let line = format!(
        "# Added by agentd: tells it when Codex waits for you (to opt out: touch ~/.keystone/no-hooks).\nnotify = [\"{PROGRAM}\", \"codex\", \"{}\"]\n",
        events(Agent::Codex)[0]
    );
    Ok(Some(if text.is_empty() {
        line
    } else {
        format!("{line}\n{text}")
    }))
}

/// Whether the TOML document `text` may have the top-level key `key`
/// (bare or quoted), looked for up to its first table header. When in
/// doubt, yes: agentd then adds nothing (a second key would make the file
/// Codex's error).
fn has_top_level(text: &str, key: &str) -> bool {
    for line in text.lines().map(str::trim) {
        // A table header: `[name]` or `[[name]]`, then a comment at most.
        // (A line of a multi-line array starts with `[` too, but has a
        // `,` or no `]`.)
        if line.starts_with('[') {
            let head = line.split('#').next().unwrap_or("").trim_end();
            if head.ends_with(']') && !head.contains(',') && !head.contains('=') {
                return false;
            }
            continue;
        }
        let Some((name, _)) = line.split_once('=') else {
            continue;
        };
        let name = name.trim().trim_matches(|c| c == '"' || c == '\'');
        if name == key {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn merged(agent: Agent, existing: Option<&str>) -> Option<String> {
        merge(agent, existing.map(str::as_bytes))
            .unwrap()
            .map(|b| String::from_utf8(b).unwrap())
    }

    #[test]
    fn claude_hooks_are_added_once_beside_the_persons() {
        let mine = r#"{"model":"opus","hooks":{"Stop":[{"hooks":[{"type":"command","command":"say done"}]}]}}"#;
        let out = merged(Agent::Claude, Some(mine)).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["model"], "opus");
        let stop = v["hooks"]["Stop"].as_array().unwrap();
        assert_eq!(stop.len(), 2);
        assert_eq!(stop[0]["hooks"][0]["command"], "say done");
        assert_eq!(
            stop[1]["hooks"][0]["command"],
            "keystone-notify claude Stop"
        );
        assert_eq!(
            v["hooks"]["Notification"][0]["hooks"][0]["command"],
            "keystone-notify claude Notification"
        );
        // Again: nothing to do.
        assert_eq!(merged(Agent::Claude, Some(&out)), None);
    }

    #[test]
    fn gemini_hooks_have_a_matcher_and_a_name() {
        let out = merged(Agent::Gemini, None).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        let after = &v["hooks"]["AfterAgent"][0];
        assert_eq!(after["matcher"], "*");
        assert_eq!(after["hooks"][0]["name"], PROGRAM);
        assert_eq!(
            after["hooks"][0]["command"],
            "keystone-notify gemini AfterAgent"
        );
    }

    #[test]
    fn codex_gets_notify_unless_it_has_one() {
        let out = merged(
            Agent::Codex,
            Some("model = \"o3\"\n\n[tui]\nnotify = true\n"),
        )
        .unwrap();
        assert!(out.starts_with("# Added by agentd"), "{out}");
        assert!(
            out.contains("notify = [\"keystone-notify\", \"codex\", \"agent-turn-complete\"]\n")
        );
        assert!(out.ends_with("[tui]\nnotify = true\n"));
        assert_eq!(merged(Agent::Codex, Some(&out)), None);
        // The person's own notify stays, however it is written.
        for mine in [
            "notify = [\"mine\"]\n",
            "\"notify\" = [\"mine\"]\n",
            "\u{feff}notify=[\"mine\"]\n",
            "list = [\n  [1, 2],\n  [3],\n]\nnotify = [\"mine\"]\n",
        ] {
            assert_eq!(merged(Agent::Codex, Some(mine)), None, "{mine}");
        }
        // One in a table is not Codex's notify.
        assert!(merged(Agent::Codex, Some("[tui]\nnotify = true\n")).is_some());
        assert!(merged(Agent::Codex, None).unwrap().contains("notify ="));
    }

    #[test]
    fn files_agentd_cannot_read_are_left_alone() {
        for bad in [
            "not json",
            "[1,2]",
            r#"{"hooks":[]}"#,
            r#"{"hooks":{"Stop":{}}}"#,
        ] {
            assert!(merge(Agent::Claude, Some(bad.as_bytes())).is_err(), "{bad}");
        }
        assert!(merge(Agent::Claude, Some(&[0xff, 0xfe])).is_err());
        assert!(merge(Agent::Gemini, Some(&vec![b' '; FILE_MAX + 1])).is_err());
        // An empty file is an empty object.
        assert!(merged(Agent::Claude, Some("  \n")).is_some());
    }
}

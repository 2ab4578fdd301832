//! `agentctl watch`: what needs the person, as it happens. agentd sends
//! its signals only to the connections of the sandbox's owner (and
//! root), so this reads every message that comes to its connection
//! rather than subscribing to a broadcast; and since any peer on the bus
//! may send a signal to it, it believes only those whose sender is
//! agentd's connection (the bus daemon vouches for the sender), following
//! agentd across a restart.

use std::collections::HashMap;

use futures_lite::StreamExt;
use keystone_agent_api::{self as api, ManagerProxy};
use serde_json::{Value, json};
use zbus::Connection;
use zbus::message::Type as MessageType;

use crate::output;
use crate::{Failure, Result};

/// `agentctl watch [NAME] [--json] [--notify]`.
pub async fn run(
    conn: &Connection,
    manager: &ManagerProxy<'_>,
    name: Option<String>,
    json: bool,
    notify: bool,
) -> Result<i32> {
    // Listen first, then ask: nothing between the two is lost. The first
    // call also makes this connection one agentd sends to.
    let mut stream = zbus::MessageStream::from(conn);
    let dbus = zbus::fdo::DBusProxy::new(conn)
        .await
        .map_err(api::Error::ZBus)?;
    let rule = zbus::MatchRule::builder()
        .msg_type(MessageType::Signal)
        .sender("org.freedesktop.DBus")
        .and_then(|r| r.interface("org.freedesktop.DBus"))
        .and_then(|r| r.member("NameOwnerChanged"))
        .and_then(|r| r.arg(0, api::BUS_NAME))
        .map_err(api::Error::ZBus)?
        .build();
    dbus.add_match_rule(rule)
        .await
        .map_err(|e| api::Error::ZBus(e.into()))?;
    let mut agentd = agentd_name(&dbus).await?;
    let only = name.clone().unwrap_or_default();
    let now = manager.agents_waiting(&only).await?;
    let mut desktop = if notify {
        Some(Desktop::connect().await?)
    } else {
        None
    };
    let mut printer = Printer { json, only: name };
    for w in &now {
        let event = waiting_event(w);
        printer.print(&event);
        if let Some(d) = desktop.as_mut() {
            d.show(&event).await;
        }
    }
    while let Some(msg) = stream.next().await {
        let Ok(msg) = msg else { continue };
        if msg.message_type() != MessageType::Signal {
            continue;
        }
        let header = msg.header();
        let sender = header.sender().map(|s| s.as_str().to_owned());
        if sender.as_deref() == Some("org.freedesktop.DBus") {
            // agentd restarted (or went): follow its new connection, and
            // be known to it.
            let owner_changed = header
                .member()
                .is_some_and(|m| m.as_str() == "NameOwnerChanged");
            if let (true, Ok((owned, _, new))) = (
                owner_changed,
                msg.body().deserialize::<(String, String, String)>(),
            ) {
                if owned == api::BUS_NAME {
                    agentd = new;
                    if !agentd.is_empty() {
                        let _ = manager.agents_waiting(&only).await;
                    }
                }
            }
            continue;
        }
        if agentd.is_empty() || sender.as_deref() != Some(agentd.as_str()) {
            continue;
        }
        let Some(event) = event_of(&msg) else {
            continue;
        };
        if !printer.wanted(&event) {
            continue;
        }
        printer.print(&event);
        if let Some(d) = desktop.as_mut() {
            d.show(&event).await;
        }
    }
    Ok(0)
}

/// agentd's unique name on the bus now.
async fn agentd_name(dbus: &zbus::fdo::DBusProxy<'_>) -> Result<String> {
    let name =
        zbus::names::BusName::try_from(api::BUS_NAME).map_err(|e| api::Error::ZBus(e.into()))?;
    Ok(dbus
        .get_name_owner(name)
        .await
        .map_err(|e| api::Error::ZBus(e.into()))?
        .to_string())
}

/// An agent waiting, as `watch` prints it.
fn waiting_event(w: &api::WaitingAgent) -> Value {
    json!({
        "event": "agent-waiting",
        "sandbox": w.sandbox,
        "session": w.session,
        "agent": w.agent,
        "message": w.message,
        "time": output::rfc3339(w.time),
    })
}

/// `word` as one shell word (quoted unless plain).
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && !word.starts_with('-')
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':'));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// What a signal from agentd says, as `watch` prints it; `None` for one
/// it does not show.
fn event_of(msg: &zbus::Message) -> Option<Value> {
    let header = msg.header();
    let member = header.member()?.as_str().to_owned();
    let iface = header.interface()?.as_str().to_owned();
    let path = header.path()?.as_str().to_owned();
    let from_manager = path == api::MANAGER_PATH;
    let body = msg.body();
    let now = || output::rfc3339(output::now_micros());
    match (iface.as_str(), member.as_str()) {
        ("org.keystone.Agent1.Manager", _) if !from_manager => None,
        ("org.keystone.Agent1.Manager", "AgentWaiting") => {
            let (sandbox, session, agent, message, time): (String, String, String, String, u64) =
                body.deserialize().ok()?;
            Some(waiting_event(&api::WaitingAgent {
                sandbox,
                session,
                agent,
                message,
                time,
            }))
        }
        ("org.keystone.Agent1.Manager", "AgentAnswered") => {
            let (sandbox, session): (String, String) = body.deserialize().ok()?;
            Some(
                json!({"event": "agent-answered", "sandbox": sandbox, "session": session, "time": now()}),
            )
        }
        ("org.keystone.Agent1.Manager", "SandboxAdded" | "SandboxRemoved") => {
            let (sandbox, _): (String, zvariant::OwnedObjectPath) = body.deserialize().ok()?;
            let event = if member == "SandboxAdded" {
                "added"
            } else {
                "removed"
            };
            Some(json!({"event": event, "sandbox": sandbox, "time": now()}))
        }
        ("org.keystone.Agent1.Sandbox", "EgressAsked") => {
            let (host, port): (String, u16) = body.deserialize().ok()?;
            Some(
                json!({"event": "egress-waiting", "sandbox": api::sandbox_name(&path)?, "host": host, "port": port, "time": now()}),
            )
        }
        ("org.freedesktop.DBus.Properties", "PropertiesChanged") => {
            let (iface, changed, _): (String, HashMap<String, zvariant::OwnedValue>, Vec<String>) =
                body.deserialize().ok()?;
            if iface != "org.keystone.Agent1.Sandbox" {
                return None;
            }
            let state: String = changed.get("State")?.try_clone().ok()?.try_into().ok()?;
            Some(
                json!({"event": "state", "sandbox": api::sandbox_name(&path)?, "state": state, "time": now()}),
            )
        }
        _ => None,
    }
}

/// Prints events, as text or JSON lines.
struct Printer {
    json: bool,
    only: Option<String>,
}

impl Printer {
    fn wanted(&self, event: &Value) -> bool {
        self.only
            .as_deref()
            .is_none_or(|n| event["sandbox"].as_str() == Some(n))
    }

    fn print(&mut self, event: &Value) {
        if self.json {
            // One object per line (control characters escaped by serde).
            println!("{}", serde_json::to_string(event).expect("json"));
            return;
        }
        crate::outln!("{}", line(event));
    }
}

/// `event` as one line of text, what came from a sandbox escaped.
fn line(event: &Value) -> String {
    let s = |k: &str| output::escape_controls(event[k].as_str().unwrap_or("")).into_owned();
    let time = s("time");
    let clock = time.get(11..19).unwrap_or(&time).to_owned();
    let sandbox = s("sandbox");
    let in_session = |session: String| {
        if session.is_empty() {
            String::new()
        } else {
            format!(" (session {session})")
        }
    };
    match event["event"].as_str().unwrap_or("") {
        "agent-waiting" => format!(
            "{clock}  {sandbox}  {} waits for input{}: {}\n          agentctl attach {sandbox}",
            s("agent"),
            in_session(s("session")),
            s("message"),
        ),
        "agent-answered" => format!("{clock}  {sandbox}  answered{}", in_session(s("session"))),
        "egress-waiting" => format!(
            "{clock}  {sandbox}  a connection to {}:{} waits for you\n          agentctl egress {sandbox} allow {} --once",
            s("host"),
            event["port"],
            shell_word(&s("host")),
        ),
        "state" => format!("{clock}  {sandbox}  {}", s("state")),
        "added" => format!("{clock}  {sandbox}  created"),
        "removed" => format!("{clock}  {sandbox}  destroyed"),
        _ => String::new(),
    }
}

/// Desktop notifications on the user's session bus.
struct Desktop {
    proxy: zbus::Proxy<'static>,
}

impl Desktop {
    async fn connect() -> Result<Self> {
        let fail = |e: zbus::Error| {
            Failure::new(
                api::ExitCode::Requirements,
                format!("--notify: no desktop notifications on your session bus: {e}"),
            )
        };
        let address = crate::bus::session_address().ok_or_else(|| {
            Failure::new(
                api::ExitCode::Requirements,
                "--notify: you have no session bus (DBUS_SESSION_BUS_ADDRESS is not set)",
            )
        })?;
        let conn = zbus::connection::Builder::address(address.as_str())
            .map_err(fail)?
            .build()
            .await
            .map_err(fail)?;
        let proxy = zbus::Proxy::new(
            &conn,
            "org.freedesktop.Notifications",
            "/org/freedesktop/Notifications",
            "org.freedesktop.Notifications",
        )
        .await
        .map_err(fail)?;
        Ok(Self { proxy })
    }

    /// Show `event` if it needs the person. The body may be read as
    /// markup by the notification server: what came from a sandbox is
    /// escaped for it.
    async fn show(&mut self, event: &Value) {
        let s = |k: &str| markup_escaped(event[k].as_str().unwrap_or(""));
        let (summary, body) = match event["event"].as_str() {
            Some("agent-waiting") => (
                format!("{} waits in {}", s("agent"), s("sandbox")),
                s("message"),
            ),
            Some("egress-waiting") => (
                format!("{} asks to connect", s("sandbox")),
                format!("{}:{}", s("host"), event["port"]),
            ),
            _ => return,
        };
        let hints: HashMap<&str, zvariant::Value<'_>> = HashMap::new();
        let r: zbus::Result<u32> = self
            .proxy
            .call(
                "Notify",
                &(
                    "Keystone Agent",
                    0u32,
                    "",
                    summary.as_str(),
                    body.as_str(),
                    Vec::<&str>::new(),
                    hints,
                    -1i32,
                ),
            )
            .await;
        if let Err(e) = r {
            eprintln!("agentctl: cannot show a desktop notification: {e}");
        }
    }
}

/// `text` with what notification servers read as markup escaped, and
/// control characters too.
fn markup_escaped(text: &str) -> String {
    output::escape_controls(text)
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_escape_what_a_sandbox_said() {
        let e = json!({"event": "agent-waiting", "sandbox": "demo", "session": "demo-main",
            "agent": "claude", "message": "a\u{1b}]0;x\u{7}b", "time": "2026-11-27T10:11:12.000000Z"});
        let l = line(&e);
        assert!(!l.contains('\u{1b}'), "{l}");
        assert!(l.starts_with("10:11:12  demo  claude waits for input (session demo-main): "));
        assert_eq!(markup_escaped("<b>&</b>"), "&lt;b&gt;&amp;&lt;/b&gt;");
        assert_eq!(shell_word("pypi.org"), "pypi.org");
        assert_eq!(shell_word("a;rm -rf ~"), "'a;rm -rf ~'");
        assert_eq!(shell_word("it's"), "'it'\\''s'");
    }
}

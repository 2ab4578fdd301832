//! Signals of the sandbox objects: `PropertiesChanged` for what changed,
//! `Synced` and the egress signals, each sent only to the sandbox's owner
//! and root.

use std::sync::Arc;

use keystone_agent_api as api;
use zbus::Connection;
use zbus::object_server::SignalEmitter;

use super::Callers;
use super::sandbox::SandboxObject;
use crate::sandbox::Sandbox;
use crate::sandbox::manager::{EgressEvent, Manager};

/// Emit PropertiesChanged for every property of `name` that changed since
/// the last announcement, to the sandbox's owner and root.
pub async fn announce(
    conn: &Connection,
    manager: &Arc<Manager>,
    callers: &Arc<Callers>,
    name: &str,
) {
    let (Some(path), Some(now)) = (api::sandbox_path(name), manager.snapshot(name)) else {
        return;
    };
    let Ok(iface) = conn
        .object_server()
        .interface::<_, SandboxObject>(&path)
        .await
    else {
        return;
    };
    let before = iface
        .get()
        .await
        .announced
        .lock()
        .unwrap()
        .replace(now.clone());
    let Some(before) = before else { return };
    let obj = iface.get().await;
    // Whoever could see the sandbox before or now (an owner may change);
    // never the owner of another sandbox that had the name (a missed
    // removal left its object).
    let mut emitters = callers.emitters(conn, now.owner, &path);
    if before.owner != now.owner && before.id == now.id {
        emitters.extend(callers.emitters(conn, before.owner, &path));
    }
    for emitter in &emitters {
        announce_to(emitter, &obj, &before, &now).await;
    }
}

/// Emit to one connection the PropertiesChanged of `before` → `now`.
pub(super) async fn announce_to(
    emitter: &SignalEmitter<'_>,
    obj: &SandboxObject,
    before: &Sandbox,
    now: &Sandbox,
) {
    let name = &now.name;
    let r: zbus::Result<()> = async {
        if before.state != now.state {
            obj.state_changed(emitter).await?;
        }
        if before.state_reason != now.state_reason {
            obj.state_reason_changed(emitter).await?;
        }
        if before.started_at != now.started_at {
            obj.started_at_changed(emitter).await?;
        }
        if before.config != now.config {
            obj.config_changed(emitter).await?;
        }
        if before.owner != now.owner {
            obj.owner_changed(emitter).await?;
        }
        if before.project_path != now.project_path {
            obj.project_path_changed(emitter).await?;
        }
        if before.backend != now.backend {
            obj.backend_changed(emitter).await?;
        }
        if before.declared != now.declared {
            obj.declared_changed(emitter).await?;
        }
        if before.last_sync_at != now.last_sync_at {
            obj.last_sync_at_changed(emitter).await?;
        }
        if before.last_sync_result != now.last_sync_result {
            obj.last_sync_result_changed(emitter).await?;
        }
        if before.ports != now.ports {
            obj.ports_changed(emitter).await?;
        }
        if before.runtime.as_ref().map(|r| &r.limits) != now.runtime.as_ref().map(|r| &r.limits) {
            obj.limits_changed(emitter).await?;
        }
        if before.runtime.as_ref().map(|r| &r.agents) != now.runtime.as_ref().map(|r| &r.agents) {
            obj.agents_changed(emitter).await?;
        }
        Ok(())
    }
    .await;
    if let Err(e) = r {
        tracing::warn!(sandbox = %name, error = %e, "cannot emit PropertiesChanged");
    }
}

/// Emit `Synced` on the sandbox's object, to its owner and root.
pub async fn synced(
    conn: &Connection,
    manager: &Arc<Manager>,
    callers: &Arc<Callers>,
    name: &str,
    direction: &str,
    branches: u32,
    commits: u32,
) -> zbus::Result<()> {
    let (Some(path), Some(sb)) = (api::sandbox_path(name), manager.snapshot(name)) else {
        return Ok(());
    };
    for e in callers.emitters(conn, sb.owner, &path) {
        SandboxObject::synced(&e, direction, branches, commits).await?;
    }
    Ok(())
}

/// Emit `SyncHeld` on the sandbox's object, to its owner and root.
pub async fn held(
    conn: &Connection,
    manager: &Arc<Manager>,
    callers: &Arc<Callers>,
    name: &str,
    held: &api::HeldBranch,
) -> zbus::Result<()> {
    let (Some(path), Some(sb)) = (api::sandbox_path(name), manager.snapshot(name)) else {
        return Ok(());
    };
    for e in callers.emitters(conn, sb.owner, &path) {
        SandboxObject::sync_held(&e, held.clone()).await?;
    }
    Ok(())
}

/// Tell a sandbox's owner (and root) what its gateway reports:
/// `EgressDenied` (when `announce`) and `EgressAsked` to every connection
/// of theirs agentd knows, `EgressLogged` (one for every connection) only
/// to those that follow the sandbox's egress log.
pub async fn egress_event(
    conn: &Connection,
    manager: &Arc<Manager>,
    callers: &Arc<Callers>,
    event: &EgressEvent,
    announce: bool,
) -> zbus::Result<()> {
    let (EgressEvent::Logged(entry) | EgressEvent::Asked(entry)) = event;
    let name = &entry.sandbox;
    let denied = announce && matches!(event, EgressEvent::Logged(e) if e.decision != "allow");
    let asked = matches!(event, EgressEvent::Asked(_));
    // An admission or an end nobody follows: nothing to send.
    if !denied && !asked && !callers.followed(name) {
        return Ok(());
    }
    let (Some(path), Some(sb)) = (api::sandbox_path(name), manager.snapshot(name)) else {
        return Ok(());
    };
    // A D-Bus string may not hold NUL (the bus would drop agentd); the
    // gateway never lets one through, and this makes sure.
    let clean = |s: &str| s.replace('\0', "\\0");
    if denied || asked {
        for e in callers.emitters(conn, sb.owner, &path) {
            if asked {
                SandboxObject::egress_asked(&e, &clean(&entry.host), entry.port).await?;
            } else {
                SandboxObject::egress_denied(
                    &e,
                    &clean(&entry.host),
                    entry.port,
                    &clean(&entry.rule),
                    &clean(&entry.reason),
                )
                .await?;
            }
        }
    }
    // `agentctl egress NAME log --follow` shows it (a waiting one too).
    let followers = callers.follower_emitters(conn, sb.owner, name, &path);
    if !followers.is_empty() {
        let json = serde_json::to_string(&**entry).expect("an entry serializes");
        for e in followers {
            SandboxObject::egress_logged(&e, &json).await?;
        }
    }
    Ok(())
}

//! The D-Bus adapters: convert arguments, find the caller, call the
//! [`Manager`], map errors. No rules live here.

mod manager;
mod options;
mod records;
mod sandbox;
mod secrets;
mod signals;
mod ssh;
mod state;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use keystone_agent_api as api;
use zbus::Connection;
use zbus::message::Header;

use crate::auth::Caller;
use crate::error::Error;
use crate::sandbox::Change;
use crate::sandbox::manager::Manager;
use crate::validate;

pub use manager::ManagerObject;
pub use sandbox::SandboxObject;

/// Where agentd serves.
#[derive(Debug, Clone)]
pub enum Bus {
    /// The system bus.
    System,
    /// The caller's session bus.
    Session,
    /// A bus daemon at this address.
    Address(String),
}

/// Resolves callers' uids through the bus daemon, caching per unique name
/// (unique names are never reused while the bus runs). The connections it
/// knows are also where agentd's signals go: each signal about a sandbox is
/// sent to its owner's connections and root's, one copy each, never
/// broadcast (see [`Callers::emitters`]). A connection is known once it has
/// called agentd (a method, or reading a property); it is forgotten when it
/// leaves the bus. `EgressLogged`, one for every connection through a
/// gateway, goes only to the known connections that asked for it with
/// `FollowEgress` ([`Callers::follow`]).
#[derive(Debug, Default)]
pub struct Callers {
    cache: Mutex<HashMap<String, Known>>,
    /// The last connections that left the bus unknown (locked after
    /// `cache`).
    departed: Mutex<std::collections::VecDeque<String>>,
}

/// Most departed connections remembered.
const DEPARTED_MAX: usize = 1024;

/// A connection agentd knows.
#[derive(Debug)]
struct Known {
    uid: u32,
    /// The sandboxes whose egress log it follows.
    follows: std::collections::BTreeSet<String>,
}

/// Most connections remembered at once; past it new callers still get
/// answers, but no signals until others leave.
const CALLERS_MAX: usize = 16_384;

/// Most sandboxes one connection follows the egress log of.
pub const FOLLOWS_MAX: usize = 64;

impl Callers {
    /// The uid of whoever sent the message with `header`.
    pub async fn caller(
        &self,
        conn: &Connection,
        header: &Header<'_>,
    ) -> Result<Caller, api::Error> {
        check_request_size(header)?;
        let sender = header
            .sender()
            .ok_or_else(|| {
                api::Error::PermissionDenied(
                    "The call has no sender; cannot tell who you are".into(),
                )
            })?
            .to_owned();
        if let Some(known) = self.cache.lock().unwrap().get(sender.as_str()) {
            return Ok(Caller { uid: known.uid });
        }
        let dbus = zbus::fdo::DBusProxy::new(conn)
            .await
            .map_err(api::Error::ZBus)?;
        let uid = dbus
            .get_connection_unix_user(sender.clone().into())
            .await
            .map_err(|e| {
                api::Error::PermissionDenied(format!("The bus does not say who you are: {e}"))
            })?;
        self.remember(sender.as_str(), uid);
        Ok(Caller { uid })
    }

    /// Remember connection `unique_name` of `uid`, unless it left the bus
    /// meanwhile (unique names never come back) or too many are known.
    fn remember(&self, unique_name: &str, uid: u32) {
        let mut cache = self.cache.lock().unwrap();
        let gone = self
            .departed
            .lock()
            .unwrap()
            .iter()
            .any(|d| d == unique_name);
        if cache.len() < CALLERS_MAX && !gone {
            let follows = std::collections::BTreeSet::new();
            cache.insert(unique_name.to_owned(), Known { uid, follows });
        }
    }

    /// Forget a connection that left the bus (also one whose first call
    /// is still being answered: it is not remembered after).
    pub fn forget(&self, unique_name: &str) {
        let mut cache = self.cache.lock().unwrap();
        if cache.remove(unique_name).is_none() {
            let mut departed = self.departed.lock().unwrap();
            if departed.len() >= DEPARTED_MAX {
                departed.pop_front();
            }
            departed.push_back(unique_name.to_owned());
        }
    }

    /// Follow sandbox `name`'s egress log no more (it was destroyed).
    pub fn unfollow(&self, name: &str) {
        for known in self.cache.lock().unwrap().values_mut() {
            known.follows.remove(name);
        }
    }

    /// Send `EgressLogged` of sandbox `name` to connection `unique_name`
    /// from now until it leaves the bus (its caller may see the sandbox:
    /// checked before). Refused past [`FOLLOWS_MAX`] sandboxes, and for a
    /// connection agentd could not remember.
    pub fn follow(&self, unique_name: &str, name: &str) -> Result<(), api::Error> {
        let mut cache = self.cache.lock().unwrap();
        let Some(known) = cache.get_mut(unique_name) else {
            return Err(api::Error::Backend(format!(
                "agentd already sends signals to {CALLERS_MAX} connections; \
                 follow sandbox '{name}' again once some of them have left the bus"
            )));
        };
        if known.follows.len() >= FOLLOWS_MAX && !known.follows.contains(name) {
            return Err(api::Error::InvalidArgument(format!(
                "This connection already follows the egress of {FOLLOWS_MAX} sandboxes; \
                 follow sandbox '{name}' from another connection"
            )));
        }
        known.follows.insert(name.to_owned());
        Ok(())
    }

    /// The known connections that may see a sandbox of `owner`.
    #[must_use]
    pub fn recipients(&self, owner: u32) -> Vec<String> {
        self.matching(|known| Caller { uid: known.uid }.may_access(owner))
    }

    /// The known connections that may see sandbox `name` of `owner` and
    /// follow its egress log.
    #[must_use]
    pub fn followers(&self, owner: u32, name: &str) -> Vec<String> {
        self.matching(|known| {
            known.follows.contains(name) && Caller { uid: known.uid }.may_access(owner)
        })
    }

    /// The known connections that `keep`, sorted.
    fn matching(&self, keep: impl Fn(&Known) -> bool) -> Vec<String> {
        let mut names: Vec<String> = self
            .cache
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, known)| keep(known))
            .map(|(name, _)| name.clone())
            .collect();
        names.sort();
        names
    }

    /// One emitter at `path` for each known connection that may see a
    /// sandbox of `owner` (its own and root's).
    pub fn emitters(
        &self,
        conn: &Connection,
        owner: u32,
        path: &zvariant::ObjectPath<'_>,
    ) -> Vec<zbus::object_server::SignalEmitter<'static>> {
        emitters_to(conn, path, self.recipients(owner))
    }

    /// One emitter at `path` for each connection that follows sandbox
    /// `name`'s egress log and may see it (a sandbox of `owner`).
    pub fn follower_emitters(
        &self,
        conn: &Connection,
        owner: u32,
        name: &str,
        path: &zvariant::ObjectPath<'_>,
    ) -> Vec<zbus::object_server::SignalEmitter<'static>> {
        emitters_to(conn, path, self.followers(owner, name))
    }

    /// Whether any connection follows sandbox `name`'s egress log.
    #[must_use]
    pub fn followed(&self, name: &str) -> bool {
        self.cache
            .lock()
            .unwrap()
            .values()
            .any(|known| known.follows.contains(name))
    }
}

/// One emitter at `path` for each connection of `names`.
fn emitters_to(
    conn: &Connection,
    path: &zvariant::ObjectPath<'_>,
    names: Vec<String>,
) -> Vec<zbus::object_server::SignalEmitter<'static>> {
    names
        .into_iter()
        .filter_map(|name| {
            let dest = zbus::names::UniqueName::try_from(name).ok()?;
            let emitter = zbus::object_server::SignalEmitter::new(conn, path.to_owned()).ok()?;
            Some(emitter.set_destination(zbus::names::BusName::Unique(dest)))
        })
        .collect()
}

/// Export the object of sandbox `name` unless it is already there.
pub(super) async fn export_sandbox(
    conn: &Connection,
    manager: &Arc<Manager>,
    callers: &Arc<Callers>,
    name: &str,
) -> zbus::Result<()> {
    let Some(path) = api::sandbox_path(name) else {
        return Ok(());
    };
    let server = conn.object_server();
    if server.interface::<_, SandboxObject>(&path).await.is_ok() {
        return Ok(());
    }
    server
        .at(&path, SandboxObject::new(name, manager, callers))
        .await?;
    ssh::export_parts(server, &path, name, manager, callers).await
}

/// Forget connections as they leave the bus, so signals stop going to them.
async fn follow_departures(conn: Connection, callers: Arc<Callers>) {
    use futures_lite::StreamExt;
    let Ok(dbus) = zbus::fdo::DBusProxy::new(&conn).await else {
        return;
    };
    let Ok(mut gone) = dbus.receive_name_owner_changed().await else {
        tracing::warn!("cannot follow connections leaving the bus; signals may go to stale names");
        return;
    };
    while let Some(signal) = gone.next().await {
        if let Ok(args) = signal.args() {
            if args.new_owner().is_none() && args.name().starts_with(':') {
                callers.forget(args.name());
            }
        }
    }
    // The stream ends only with the connection: agentd can no longer be
    // reached. Its sandboxes outlive it and a restarted agentd adopts them,
    // so end now and let the service manager start it again.
    tracing::error!("lost the connection to the bus; exiting");
    std::process::exit(1);
}

/// Refuse a request whose body is larger than any valid one.
fn check_request_size(header: &Header<'_>) -> Result<(), api::Error> {
    let len = usize::try_from(header.primary().body_len()).unwrap_or(usize::MAX);
    if len > validate::REQUEST_MAX {
        return Err(api::Error::InvalidArgument(format!(
            "The request is {len} bytes; at most {} are accepted",
            validate::REQUEST_MAX
        )));
    }
    Ok(())
}

/// Check string arguments (`(what, value)`) against the length limit.
pub(crate) fn check_strings(args: &[(&str, &str)]) -> Result<(), api::Error> {
    let mut problems = Vec::new();
    for (what, value) in args {
        validate::check_len(what, value, &mut problems);
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(to_dbus(Error::Invalid(problems)))
    }
}

/// Check an `a{sv}` of options: a few short keys, strings within the limit.
pub(crate) fn check_options(
    options: &HashMap<String, zvariant::OwnedValue>,
) -> Result<(), api::Error> {
    let mut problems = Vec::new();
    if options.len() > 64 {
        problems.push(format!(
            "{} options given; at most 64 are accepted",
            options.len()
        ));
    }
    for (key, value) in options {
        if key.len() > 64 {
            problems.push(format!(
                "option name '{}' is too long",
                crate::text::shown(key)
            ));
        } else if let zvariant::Value::Str(s) = &**value {
            validate::check_len(&format!("option '{key}'"), s.as_str(), &mut problems);
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(to_dbus(Error::Invalid(problems)))
    }
}

/// Map a domain error to its named D-Bus error.
#[must_use]
pub fn to_dbus(e: Error) -> api::Error {
    // A D-Bus string holds no NUL: the bus daemon drops the connection of
    // a peer that sends one (and agentd exits), so none that a sandbox
    // slipped into a message goes out as it is.
    let msg = e.to_string().replace('\0', "\\0");
    match e {
        Error::NotFound(_) | Error::Missing(_) => api::Error::NotFound(msg),
        Error::AlreadyExists(_) => api::Error::AlreadyExists(msg),
        Error::InvalidState { .. } => api::Error::InvalidState(msg),
        Error::Invalid(_) => api::Error::InvalidArgument(msg),
        Error::PermissionDenied(_) => api::Error::PermissionDenied(msg),
        Error::Backend { source, .. } if source.is_timeout() => api::Error::Timeout(msg),
        Error::Conflict(_) => api::Error::Conflict(msg),
        Error::Snapshot { source, .. } => {
            use crate::snapshots::SnapshotError as S;
            match source {
                S::NotFound { .. } => api::Error::NotFound(msg),
                S::Damaged { .. } | S::Foreign { .. } | S::Quota { .. } => {
                    api::Error::InvalidArgument(msg)
                }
                S::Io { .. } | S::Copy { .. } | S::Write(_) => api::Error::Backend(msg),
            }
        }
        Error::Backend { .. }
        | Error::Proxy { .. }
        | Error::Workspace { .. }
        | Error::Sync { .. }
        | Error::DestroyStopped { .. }
        | Error::Secrets { .. }
        | Error::Registry(_) => api::Error::Backend(msg),
    }
}

/// Connect to `bus`, export every object, own the name and keep the objects
/// in step with the manager until the connection drops.
pub async fn serve(
    bus: &Bus,
    manager: Arc<Manager>,
    console: Option<Arc<crate::console::Door>>,
) -> zbus::Result<Connection> {
    let callers = Arc::new(Callers::default());
    let builder = match bus {
        Bus::System => zbus::connection::Builder::system()?,
        Bus::Session => zbus::connection::Builder::session()?,
        Bus::Address(a) => zbus::connection::Builder::address(a.as_str())?,
    };
    // Subscribe before exporting so no change is missed.
    let changes = manager.subscribe();
    let conn = builder
        .serve_at(
            api::MANAGER_PATH,
            ManagerObject::new(Arc::clone(&manager), Arc::clone(&callers), console),
        )?
        .build()
        .await?;
    for name in manager.names() {
        export_sandbox(&conn, &manager, &callers, &name).await?;
    }
    tokio::spawn(follow_departures(conn.clone(), Arc::clone(&callers)));
    tokio::spawn(follow_egress(
        conn.clone(),
        Arc::clone(&manager),
        Arc::clone(&callers),
        manager.subscribe_egress(),
    ));
    tokio::spawn(follow_waiting(
        conn.clone(),
        Arc::clone(&callers),
        manager.subscribe_waiting(),
    ));
    tokio::spawn(follow_changes(conn.clone(), manager, callers, changes));
    conn.request_name(api::BUS_NAME).await?;
    Ok(conn)
}

/// Signal every connection through a gateway to its sandbox's owner. Under
/// a flood some are skipped (the log keeps them all), and a sandbox's
/// refusals are announced with `EgressDenied` at most
/// [`DENIALS_PER_SECOND`] a second: each goes to every client of its owner.
async fn follow_egress(
    conn: Connection,
    manager: Arc<Manager>,
    callers: Arc<Callers>,
    mut events: tokio::sync::broadcast::Receiver<crate::sandbox::manager::EgressEvent>,
) {
    use tokio::sync::broadcast::error::RecvError;
    let mut denials = Denials::default();
    loop {
        match events.recv().await {
            Ok(event) => {
                use crate::sandbox::manager::EgressEvent;
                let announce = match &event {
                    EgressEvent::Logged(entry) => {
                        entry.decision != "allow"
                            && denials.admit(&entry.sandbox, std::time::Instant::now())
                    }
                    EgressEvent::Asked(_) => true,
                };
                let r = signals::egress_event(&conn, &manager, &callers, &event, announce).await;
                if let Err(e) = r {
                    tracing::debug!(error = %e, "cannot signal a connection");
                }
            }
            Err(RecvError::Lagged(_)) => {}
            Err(RecvError::Closed) => return,
        }
    }
}

/// Most `EgressDenied` signals of one sandbox in a second.
pub const DENIALS_PER_SECOND: u32 = 20;

/// How many refusals of each sandbox were announced in its current second.
#[derive(Debug, Default)]
struct Denials {
    seconds: HashMap<String, (std::time::Instant, u32)>,
}

impl Denials {
    /// Whether a refusal of sandbox `name` at `now` may be announced.
    fn admit(&mut self, name: &str, now: std::time::Instant) -> bool {
        let second = std::time::Duration::from_secs(1);
        // Past seconds are forgotten before the map could grow large.
        if self.seconds.len() >= 1024 {
            self.seconds
                .retain(|_, (start, _)| now.duration_since(*start) < second);
        }
        let (start, count) = self.seconds.entry(name.to_owned()).or_insert((now, 0));
        if now.duration_since(*start) >= second {
            (*start, *count) = (now, 0);
        }
        *count += 1;
        *count <= DENIALS_PER_SECOND
    }
}

/// Signal agents waiting (and answered) to their sandbox's owner.
async fn follow_waiting(
    conn: Connection,
    callers: Arc<Callers>,
    mut events: tokio::sync::broadcast::Receiver<crate::sandbox::manager::WaitingEvent>,
) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        match events.recv().await {
            Ok(event) => {
                if let Err(e) = manager::waiting_event(&conn, &callers, &event).await {
                    tracing::debug!(error = %e, "cannot signal a connection");
                }
            }
            Err(RecvError::Lagged(_)) => {}
            Err(RecvError::Closed) => return,
        }
    }
}

async fn follow_changes(
    conn: Connection,
    manager: Arc<Manager>,
    callers: Arc<Callers>,
    mut changes: tokio::sync::broadcast::Receiver<Change>,
) {
    use tokio::sync::broadcast::error::RecvError;
    // The sandboxes whose objects are on the bus, as far as this task has
    // heard (all of them at first: `serve` exported them).
    let mut shown: std::collections::BTreeSet<String> = manager.names().into_iter().collect();
    loop {
        let change = match changes.recv().await {
            Ok(c) => c,
            Err(RecvError::Lagged(n)) => {
                tracing::warn!(missed = n, "missed sandbox changes; catching up");
                catch_up(&conn, &manager, &callers, &mut shown).await;
                continue;
            }
            Err(RecvError::Closed) => return,
        };
        match &change {
            Change::Added(name) | Change::Updated(name) => {
                shown.insert(name.clone());
            }
            Change::Removed(name) => {
                shown.remove(name);
                callers.unfollow(name);
            }
            _ => {}
        }
        let result = match &change {
            Change::Added(name) => manager::added(&conn, &manager, &callers, name).await,
            Change::Updated(name) => match export_sandbox(&conn, &manager, &callers, name).await {
                Ok(()) => {
                    signals::announce(&conn, &manager, &callers, name).await;
                    Ok(())
                }
                Err(e) => Err(e),
            },
            Change::Removed(name) => manager::removed(&conn, &callers, name).await,
            Change::Progress {
                name,
                stage,
                done,
                total,
            } => manager::progress(&conn, &manager, &callers, name, stage, *done, *total).await,
            Change::Held { name, held } => {
                signals::held(&conn, &manager, &callers, name, held).await
            }
            Change::Synced {
                name,
                direction,
                branches,
                commits,
            } => {
                signals::synced(
                    &conn, &manager, &callers, name, direction, *branches, *commits,
                )
                .await
            }
        };
        if let Err(e) = result {
            tracing::warn!(?change, error = %e, "cannot publish a sandbox change on the bus");
        }
    }
}

/// After missed changes: withdraw the objects of sandboxes gone since (or
/// whose name another sandbox took), export and announce those added, and
/// announce the others; `shown` becomes what is on the bus.
async fn catch_up(
    conn: &Connection,
    manager: &Arc<Manager>,
    callers: &Arc<Callers>,
    shown: &mut std::collections::BTreeSet<String>,
) {
    let now: std::collections::BTreeSet<String> = manager.names().into_iter().collect();
    let mut taken = std::collections::BTreeSet::new();
    for name in shown.intersection(&now) {
        let id = manager.snapshot(name).map(|s| s.id);
        if manager::shown_id(conn, name)
            .await
            .is_some_and(|shown| Some(shown) != id)
        {
            taken.insert(name.clone());
        }
    }
    let plan = CatchUp::plan(shown, &now, &taken);
    for gone in &plan.withdraw {
        callers.unfollow(gone);
        if let Err(e) = manager::removed(conn, callers, gone).await {
            tracing::warn!(sandbox = %gone, error = %e, "cannot withdraw a sandbox's object");
        }
    }
    for name in &plan.add {
        if let Err(e) = manager::added(conn, manager, callers, name).await {
            tracing::warn!(sandbox = %name, error = %e, "cannot export a sandbox's object");
        }
    }
    for name in &plan.announce {
        signals::announce(conn, manager, callers, name).await;
    }
    *shown = now;
}

/// What catching up after missed changes does, by sandbox name.
#[derive(Debug, Default, PartialEq, Eq)]
struct CatchUp {
    /// Objects withdrawn (`SandboxRemoved`): their sandboxes are gone, or
    /// another sandbox took the name.
    withdraw: Vec<String>,
    /// Objects exported (`SandboxAdded`): sandboxes new since, and those
    /// that took a name.
    add: Vec<String>,
    /// Objects kept, their properties announced again.
    announce: Vec<String>,
}

impl CatchUp {
    /// From `shown` (on the bus, as far as the task has heard), `now` (the
    /// sandboxes now) and `taken` (names in both whose object is of
    /// another sandbox than the one of that name now).
    fn plan(
        shown: &std::collections::BTreeSet<String>,
        now: &std::collections::BTreeSet<String>,
        taken: &std::collections::BTreeSet<String>,
    ) -> Self {
        let mut withdraw: Vec<String> = shown.difference(now).cloned().collect();
        withdraw.extend(
            shown
                .intersection(now)
                .filter(|n| taken.contains(*n))
                .cloned(),
        );
        let (announce, add) = now
            .iter()
            .cloned()
            .partition(|n| shown.contains(n) && !taken.contains(n));
        Self {
            withdraw,
            add,
            announce,
        }
    }
}

/// Resolves when the sender of `header` leaves the bus (never, if that
/// cannot be watched).
pub(super) async fn caller_gone(conn: &Connection, header: &Header<'_>) {
    use futures_lite::StreamExt as _;
    let Some(sender) = header.sender().map(|s| s.to_owned()) else {
        return std::future::pending().await;
    };
    let Ok(dbus) = zbus::fdo::DBusProxy::new(conn).await else {
        return std::future::pending().await;
    };
    let Ok(mut changes) = dbus
        .receive_name_owner_changed_with_args(&[(0, sender.as_str())])
        .await
    else {
        return std::future::pending().await;
    };
    while let Some(c) = changes.next().await {
        if c.args().is_ok_and(|a| a.new_owner().is_none()) {
            return;
        }
    }
    std::future::pending().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catching_up_withdraws_the_gone_and_the_taken_and_adds_the_new() {
        let set = |names: &[&str]| -> std::collections::BTreeSet<String> {
            names.iter().map(|n| (*n).to_owned()).collect()
        };
        let v = |names: &[&str]| -> Vec<String> { names.iter().map(|n| (*n).to_owned()).collect() };
        // a went, c is another sandbox of the same name, d is new, b stayed.
        let plan = CatchUp::plan(&set(&["a", "b", "c"]), &set(&["b", "c", "d"]), &set(&["c"]));
        assert_eq!(
            plan,
            CatchUp {
                withdraw: v(&["a", "c"]),
                add: v(&["c", "d"]),
                announce: v(&["b"]),
            }
        );
        // Nothing missed that matters: everything announced again.
        let same = set(&["a", "b"]);
        assert_eq!(
            CatchUp::plan(&same, &same, &set(&[])),
            CatchUp {
                announce: v(&["a", "b"]),
                ..CatchUp::default()
            }
        );
    }

    /// Callers that know :1.1 and :1.4 (uid 1000), :1.2 (1001) and :1.3
    /// (root).
    fn four_callers() -> Callers {
        let callers = Callers::default();
        for (name, uid) in [(":1.1", 1000), (":1.2", 1001), (":1.3", 0), (":1.4", 1000)] {
            callers.remember(name, uid);
        }
        callers
    }

    #[test]
    fn a_connection_gone_before_its_first_answer_is_not_remembered() {
        let callers = four_callers();
        // It left while agentd asked the bus for its uid.
        callers.forget(":1.9");
        callers.remember(":1.9", 1000);
        assert_eq!(callers.recipients(1000), [":1.1", ":1.3", ":1.4"]);
        // Only so many departures are kept.
        for i in 0..2 * DEPARTED_MAX {
            callers.forget(&format!(":2.{i}"));
        }
        assert_eq!(callers.departed.lock().unwrap().len(), DEPARTED_MAX);
    }

    #[test]
    fn signals_go_to_the_owner_and_root_only() {
        let callers = four_callers();
        assert_eq!(callers.recipients(1000), [":1.1", ":1.3", ":1.4"]);
        assert_eq!(callers.recipients(1001), [":1.2", ":1.3"]);
        callers.forget(":1.3");
        assert_eq!(callers.recipients(0), Vec::<String>::new());
    }

    #[test]
    fn a_sandbox_s_refusals_are_announced_at_most_so_many_a_second() {
        let mut denials = Denials::default();
        let t0 = std::time::Instant::now();
        let ms = std::time::Duration::from_millis;
        let admitted =
            |d: &mut Denials, name: &str, at| (0..100).filter(|_| d.admit(name, at)).count();
        assert_eq!(
            admitted(&mut denials, "loud", t0),
            DENIALS_PER_SECOND as usize
        );
        // Another sandbox has its own count; the next second a new one.
        assert_eq!(admitted(&mut denials, "quiet", t0 + ms(10)), 20);
        assert_eq!(admitted(&mut denials, "loud", t0 + ms(999)), 0);
        assert_eq!(admitted(&mut denials, "loud", t0 + ms(1000)), 20);
        // Many sandboxes: the past seconds are let go.
        for i in 0..2000 {
            denials.admit(&format!("s{i}"), t0 + ms(3000 + i));
        }
        assert!(denials.seconds.len() <= 1025, "{}", denials.seconds.len());
    }

    #[test]
    fn egress_entries_go_only_to_followers_who_may_see_the_sandbox() {
        let callers = four_callers();
        assert!(!callers.followed("web"));
        assert_eq!(callers.followers(1000, "web"), Vec::<String>::new());
        // A follower of another uid (a name reused by another owner after
        // a destroy) hears nothing; root does.
        for who in [":1.2", ":1.3", ":1.4"] {
            callers.follow(who, "web").unwrap();
        }
        assert!(callers.followed("web"));
        assert_eq!(callers.followers(1000, "web"), [":1.3", ":1.4"]);
        assert_eq!(callers.followers(1000, "api"), Vec::<String>::new());
        // An unknown connection cannot follow.
        assert!(callers.follow(":1.9", "web").is_err());
        // At most FOLLOWS_MAX sandboxes per connection; again is no more.
        for i in 1..FOLLOWS_MAX {
            callers.follow(":1.1", &format!("s{i}")).unwrap();
        }
        callers.follow(":1.1", "web").unwrap();
        callers.follow(":1.1", "web").unwrap();
        let err = callers.follow(":1.1", "one-more").unwrap_err();
        assert!(err.to_string().contains("64 sandboxes"), "{err}");
        // Gone from the bus: followed no more.
        callers.forget(":1.4");
        assert_eq!(callers.followers(1000, "web"), [":1.1", ":1.3"]);
        // Destroyed: followed by nobody.
        callers.unfollow("web");
        assert!(!callers.followed("web"));
    }
}

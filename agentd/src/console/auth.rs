//! The console's one-time tokens and tickets, and its sessions. All are
//! random (244 bits, from two v4 UUIDs), kept in agentd's memory only (a
//! restart logs everyone out), bounded in number, and tied to a uid.
//!
//! A token (from D-Bus) is spent at the loopback door, by a process of
//! its uid. When the console is served through Caddy, the way in starts
//! on its HTTPS name (`/begin`), which gives the browser a nonce cookie
//! and sends it to the door; the door's login hands it a ticket bound to
//! that nonce instead of a session: spent once on the HTTPS name, where
//! agentd cannot tell who connected, by the browser that holds the nonce
//! (another user's ticket is worth nothing in the owner's browser: no
//! login CSRF), it opens the session there.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a login link is valid (and it is valid once).
pub const TOKEN_TTL: Duration = Duration::from_secs(60);

/// How long a ticket from the loopback door to the console's HTTPS name
/// is valid (and it is valid once): the browser follows it at once.
pub const TICKET_TTL: Duration = Duration::from_secs(30);

/// How long a session lives without a request.
pub const SESSION_IDLE: Duration = Duration::from_secs(12 * 3600);

/// The session cookie's name at the loopback door.
pub const COOKIE: &str = "keystone_console";

/// The session cookie's name on the console's HTTPS name: the browser
/// keeps a `__Host-` cookie only when it is `Secure`, set by that host
/// itself for all its paths, and sends it to that host alone.
pub const HTTPS_COOKIE: &str = "__Host-keystone_console";

/// The cookie of a login under way on the HTTPS name: its nonce.
pub const NONCE_COOKIE: &str = "__Host-keystone_login";

/// Most tokens not yet used, and sessions, at once (the oldest go first).
const TOKENS_MAX: usize = 256;
const SESSIONS_MAX: usize = 1024;

/// Most tokens of one uid not yet used (its oldest goes first): one user
/// asking for many cannot push out another's.
const TOKENS_PER_UID: usize = 8;

/// Most sessions of one uid (its oldest goes first).
const SESSIONS_PER_UID: usize = 32;

/// A logged-in browser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// Whose it is.
    pub uid: u32,
    /// What a request that changes something must carry in
    /// `X-Keystone-CSRF`.
    pub csrf: String,
    /// Whether it was opened on the console's HTTPS name (through Caddy),
    /// where alone it is good; else at the loopback door, where alone it
    /// is good, and only for a process of its uid.
    pub https: bool,
}

#[derive(Debug)]
struct Kept {
    session: Session,
    last: Instant,
}

/// One-time secrets of uids, each valid for a while.
#[derive(Debug, Default)]
struct OneTime(Mutex<HashMap<String, (u32, Instant)>>);

impl OneTime {
    /// A new one for `uid`, valid for `ttl` from `now`, kept with `tail`
    /// after it (and found only with it).
    fn issue_at(&self, uid: u32, tail: &str, ttl: Duration, now: Instant) -> String {
        let mut map = self.0.lock().unwrap();
        map.retain(|_, (_, at)| now.saturating_duration_since(*at) < ttl);
        make_room(&mut map, uid, (TOKENS_PER_UID, TOKENS_MAX), |(u, at)| {
            (*u, *at)
        });
        let t = secret();
        map.insert(format!("{t}{tail}"), (uid, now));
        t
    }

    /// Spend `secret` when its owner is one `may` spend: the owner, when
    /// it was still valid. Another's is left as it was.
    fn redeem_at(
        &self,
        secret: &str,
        may: impl Fn(u32) -> bool,
        ttl: Duration,
        now: Instant,
    ) -> Option<u32> {
        let mut map = self.0.lock().unwrap();
        match map.get(secret) {
            Some((owner, _)) if may(*owner) => {}
            _ => return None,
        }
        let (owner, at) = map.remove(secret).expect("just seen");
        (now.saturating_duration_since(at) < ttl).then_some(owner)
    }
}

/// The tokens, tickets and sessions.
#[derive(Debug, Default)]
pub struct Auth {
    tokens: OneTime,
    tickets: OneTime,
    sessions: Mutex<HashMap<String, Kept>>,
}

/// Make room in `map` for one more entry of `uid`: its oldest goes when it
/// has `per_uid`, then the oldest of all when there are `max`. `of` says
/// whose an entry is and when it was made (or last used).
fn make_room<V>(
    map: &mut HashMap<String, V>,
    uid: u32,
    (per_uid, max): (usize, usize),
    of: impl Fn(&V) -> (u32, Instant),
) {
    let oldest = |map: &HashMap<String, V>, only: Option<u32>| {
        map.iter()
            .filter(|(_, v)| only.is_none_or(|u| of(v).0 == u))
            .min_by_key(|(_, v)| of(v).1)
            .map(|(k, _)| k.clone())
    };
    if map.values().filter(|v| of(v).0 == uid).count() >= per_uid {
        if let Some(k) = oldest(map, Some(uid)) {
            map.remove(&k);
        }
    }
    if map.len() >= max {
        if let Some(k) = oldest(map, None) {
            map.remove(&k);
        }
    }
}

/// A new random secret (244 bits, hex).
fn secret() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

impl Auth {
    /// A new one-time token for `uid`.
    pub fn issue(&self, uid: u32) -> String {
        self.issue_at(uid, Instant::now())
    }

    fn issue_at(&self, uid: u32, now: Instant) -> String {
        self.tokens.issue_at(uid, "", TOKEN_TTL, now)
    }

    /// Use `token` as `uid`: whether it is that uid's and still valid.
    /// It is gone afterwards, unless it was another uid's (who may not
    /// spend it for its owner).
    pub fn redeem(&self, token: &str, uid: u32) -> bool {
        self.redeem_at(token, uid, Instant::now())
    }

    fn redeem_at(&self, token: &str, uid: u32, now: Instant) -> bool {
        self.tokens
            .redeem_at(token, |owner| owner == uid, TOKEN_TTL, now)
            .is_some()
    }

    /// A new ticket for `uid`, from the loopback door to the HTTPS name,
    /// for the browser that holds `nonce`.
    pub fn ticket(&self, uid: u32, nonce: &str) -> String {
        self.tickets
            .issue_at(uid, &format!("/{nonce}"), TICKET_TTL, Instant::now())
    }

    /// Spend `ticket`, brought by a browser that holds `nonce`: its
    /// owner, when it was one for that nonce and still valid.
    pub fn redeem_ticket(&self, ticket: &str, nonce: &str) -> Option<u32> {
        self.tickets.redeem_at(
            &format!("{ticket}/{nonce}"),
            |_| true,
            TICKET_TTL,
            Instant::now(),
        )
    }

    /// A new nonce for a login under way.
    #[must_use]
    pub fn nonce() -> String {
        secret()
    }

    /// A new session for `uid`, good on the HTTPS name or at the loopback
    /// door (`https`): its cookie value.
    pub fn open(&self, uid: u32, https: bool) -> String {
        let now = Instant::now();
        let mut sessions = self.sessions.lock().unwrap();
        sessions.retain(|_, k| now.saturating_duration_since(k.last) < SESSION_IDLE);
        make_room(&mut sessions, uid, (SESSIONS_PER_UID, SESSIONS_MAX), |k| {
            (k.session.uid, k.last)
        });
        let cookie = secret();
        sessions.insert(
            cookie.clone(),
            Kept {
                session: Session {
                    uid,
                    csrf: secret(),
                    https,
                },
                last: now,
            },
        );
        cookie
    }

    /// The session of `cookie`, if it is one and still alive (it lives
    /// on from now).
    pub fn session(&self, cookie: &str) -> Option<Session> {
        let now = Instant::now();
        let mut sessions = self.sessions.lock().unwrap();
        let kept = sessions.get_mut(cookie)?;
        if now.saturating_duration_since(kept.last) >= SESSION_IDLE {
            sessions.remove(cookie);
            return None;
        }
        kept.last = now;
        Some(kept.session.clone())
    }

    /// End the session of `cookie`.
    pub fn close(&self, cookie: &str) {
        self.sessions.lock().unwrap().remove(cookie);
    }
}

/// The values of cookie `name` in `Cookie` headers (another service of
/// the host may have set one of that name too: each is tried).
pub fn cookies<'a>(
    headers: impl Iterator<Item = &'a str>,
    name: &str,
) -> impl Iterator<Item = &'a str> {
    headers
        .flat_map(|h| h.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .filter(move |(k, _)| *k == name)
        .map(|(_, v)| v.trim())
        .take(16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_valid_once_and_not_for_long() {
        let auth = Auth::default();
        let t = auth.issue(1000);
        assert_eq!(t.len(), 64);
        // Another uid cannot use it, nor spend it.
        assert!(!auth.redeem(&t, 1001));
        assert!(auth.redeem(&t, 1000));
        assert!(!auth.redeem(&t, 1000), "a token went twice");
        let now = Instant::now();
        let old = auth.issue_at(1000, now);
        assert!(
            !auth.redeem_at(&old, 1000, now + TOKEN_TTL),
            "an expired token"
        );
        assert!(!auth.redeem("not-a-token", 1000));
        assert_ne!(auth.issue(1000), auth.issue(1000));
    }

    #[test]
    fn a_ticket_is_valid_once_for_whoever_brings_it() {
        let auth = Auth::default();
        let t = auth.ticket(1000, "n1");
        // A login token is not a ticket, nor the other way round.
        assert!(!auth.redeem(&t, 1000));
        let token = auth.issue(1000);
        assert_eq!(auth.redeem_ticket(&token, "n1"), None);
        // Only the browser with the nonce spends it.
        assert_eq!(auth.redeem_ticket(&t, "n2"), None);
        assert_eq!(auth.redeem_ticket(&t, ""), None);
        assert_eq!(auth.redeem_ticket(&t, "n1"), Some(1000));
        assert_eq!(auth.redeem_ticket(&t, "n1"), None, "a ticket went twice");
        let now = Instant::now();
        let old = auth.tickets.issue_at(1000, "/n", TICKET_TTL, now);
        assert_eq!(
            auth.tickets
                .redeem_at(&format!("{old}/n"), |_| true, TICKET_TTL, now + TICKET_TTL),
            None,
            "an expired ticket"
        );
    }

    #[test]
    fn tokens_and_sessions_are_bounded() {
        let auth = Auth::default();
        let kept = auth.issue(2);
        for _ in 0..(TOKENS_MAX * 2) {
            auth.issue(1);
        }
        assert!(auth.tokens.0.lock().unwrap().len() <= TOKENS_PER_UID + 1);
        assert!(auth.redeem(&kept, 2), "one uid pushed out another's token");
        let first = auth.open(7, false);
        for _ in 0..SESSIONS_PER_UID {
            auth.open(7, false);
        }
        assert_eq!(auth.session(&first), None, "the oldest session stayed");
        let other = auth.open(8, true);
        assert_eq!(auth.session(&other).map(|s| s.uid), Some(8));
        assert!(auth.sessions.lock().unwrap().len() <= SESSIONS_PER_UID + 1);
        auth.close(&other);
        assert_eq!(auth.session(&other), None);
    }

    #[test]
    fn every_cookie_of_the_name_is_found() {
        let headers = ["a=1; keystone_console=planted", "b=2; keystone_console=abc"];
        let all: Vec<_> = cookies(headers.iter().copied(), COOKIE).collect();
        assert_eq!(all, ["planted", "abc"]);
        assert_eq!(
            cookies(["x_keystone_console=no"].into_iter(), COOKIE).count(),
            0
        );
    }
}

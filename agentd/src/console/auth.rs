//! The console's one-time tokens and sessions. Both are random (244 bits,
//! from two v4 UUIDs), kept in agentd's memory only (a restart logs
//! everyone out), bounded in number, and tied to a uid.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a login link is valid (and it is valid once).
pub const TOKEN_TTL: Duration = Duration::from_secs(60);

/// How long a session lives without a request.
pub const SESSION_IDLE: Duration = Duration::from_secs(12 * 3600);

/// The session cookie's name.
pub const COOKIE: &str = "keystone_console";

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
}

#[derive(Debug)]
struct Kept {
    session: Session,
    last: Instant,
}

/// The tokens and sessions.
#[derive(Debug, Default)]
pub struct Auth {
    tokens: Mutex<HashMap<String, (u32, Instant)>>,
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
        let mut tokens = self.tokens.lock().unwrap();
        tokens.retain(|_, (_, at)| now.saturating_duration_since(*at) < TOKEN_TTL);
        make_room(&mut tokens, uid, (TOKENS_PER_UID, TOKENS_MAX), |(u, at)| {
            (*u, *at)
        });
        let t = secret();
        tokens.insert(t.clone(), (uid, now));
        t
    }

    /// Use `token` as `uid`: whether it is that uid's and still valid.
    /// It is gone afterwards, unless it was another uid's (who may not
    /// spend it for its owner).
    pub fn redeem(&self, token: &str, uid: u32) -> bool {
        self.redeem_at(token, uid, Instant::now())
    }

    fn redeem_at(&self, token: &str, uid: u32, now: Instant) -> bool {
        let mut tokens = self.tokens.lock().unwrap();
        match tokens.get(token) {
            Some((owner, _)) if *owner == uid => {}
            _ => return false,
        }
        let (_, at) = tokens.remove(token).expect("just seen");
        now.saturating_duration_since(at) < TOKEN_TTL
    }

    /// A new session for `uid`: its cookie value.
    pub fn open(&self, uid: u32) -> String {
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
    fn tokens_and_sessions_are_bounded() {
        let auth = Auth::default();
        let kept = auth.issue(2);
        for _ in 0..(TOKENS_MAX * 2) {
            auth.issue(1);
        }
        assert!(auth.tokens.lock().unwrap().len() <= TOKENS_PER_UID + 1);
        assert!(auth.redeem(&kept, 2), "one uid pushed out another's token");
        let first = auth.open(7);
        for _ in 0..SESSIONS_PER_UID {
            auth.open(7);
        }
        assert_eq!(auth.session(&first), None, "the oldest session stayed");
        let other = auth.open(8);
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

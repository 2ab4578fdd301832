//! Per-host budgets: what agentd may hold for all sandboxes together and
//! for each one, so that one sandbox (or one user's sandboxes) cannot use
//! up what everyone shares. Every consumer asks here; nothing keeps a
//! counter of its own.
//!
//! Descriptors: at start agentd raises its soft `RLIMIT_NOFILE` to the hard
//! limit (at most [`RAISE_MAX`]) and keeps a reserve of it for its own work
//! (the bus, `exec`, sessions, the registry, Caddy's admin API, helpers).
//! What is left is the cap of descriptors held for sandboxes (a gateway
//! tunnel, a forwarder); each sandbox may hold at most its share of it. A
//! [`Lease`] gives its descriptors back when dropped, so every descriptor
//! a request takes ends with the request. See `docs/network.md`.
//!
//! This module is a leaf: it knows sandboxes by name only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use serde::{Deserialize, Serialize};

/// The highest soft limit agentd raises itself to: a larger descriptor
/// table costs memory, and no budget below needs more.
pub const RAISE_MAX: u64 = 1 << 20;
/// Descriptors kept for agentd's own work at least; a quarter of the limit
/// when that is more.
pub const RESERVE_MIN: u64 = 512;
/// A sandbox's share by default: this part of the cap (so that at least
/// this many sandboxes at their share fit in it) ...
pub const SHARES: usize = 8;
/// ... but never fewer descriptors than this.
pub const SHARE_MIN: usize = 64;

/// The `limits` section of agentd's configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Most descriptors agentd holds for one sandbox (its gateway's
    /// connections, its dev-server forwarders); default: an eighth of what
    /// is left for sandboxes after agentd's reserve, at least 64.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub descriptors_per_sandbox: Option<u32>,
}

impl LimitsConfig {
    /// What is wrong with these settings.
    #[must_use]
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.descriptors_per_sandbox == Some(0) {
            p.push("limits.descriptors_per_sandbox must be at least 1".to_owned());
        }
        p
    }
}

/// Why descriptors were not given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The sandbox holds its whole share.
    #[error(
        "Sandbox '{sandbox}' holds its whole share of agentd's descriptors ({share}); close some of its connections and try again"
    )]
    Share {
        /// The sandbox.
        sandbox: String,
        /// Its share.
        share: usize,
    },
    /// All sandboxes together hold the whole cap.
    #[error(
        "agentd's descriptors for sandboxes are all in use ({cap}); try again when some connections have ended"
    )]
    Cap {
        /// The cap.
        cap: usize,
    },
}

/// What sandboxes hold now.
#[derive(Debug, Default)]
struct Held {
    total: usize,
    /// By sandbox; a sandbox that holds nothing has no entry.
    by: HashMap<String, Holder>,
}

#[derive(Debug, Default)]
struct Holder {
    count: usize,
    /// Requests refused since the sandbox last went over its share
    /// (logged once when it starts and once when it ends).
    refused: u64,
}

/// The descriptor budget of this agentd.
#[derive(Debug)]
pub struct Descriptors {
    limit: u64,
    cap: usize,
    share: usize,
    held: Mutex<Held>,
}

impl Descriptors {
    /// The budget of a process whose soft limit is `limit`, with each
    /// sandbox's share `share` (else the default).
    #[must_use]
    pub fn new(limit: u64, share: Option<usize>) -> Self {
        let reserve = RESERVE_MIN.max(limit / 4);
        let cap = usize::try_from(limit.saturating_sub(reserve)).unwrap_or(usize::MAX);
        let share = share
            .unwrap_or_else(|| (cap / SHARES).max(SHARE_MIN))
            .min(cap);
        Self {
            limit,
            cap,
            share,
            held: Mutex::new(Held::default()),
        }
    }

    /// The soft limit the budget was made for.
    #[must_use]
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Most descriptors held for all sandboxes together.
    #[must_use]
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Most descriptors held for one sandbox.
    #[must_use]
    pub fn share(&self) -> usize {
        self.share
    }

    /// Descriptors held for `sandbox` now.
    #[must_use]
    pub fn held(&self, sandbox: &str) -> usize {
        self.held
            .lock()
            .unwrap()
            .by
            .get(sandbox)
            .map_or(0, |h| h.count)
    }

    /// Descriptors held for all sandboxes now.
    #[must_use]
    pub fn total(&self) -> usize {
        self.held.lock().unwrap().total
    }

    /// Take `n` descriptors for `sandbox`, given back when the lease is
    /// dropped.
    ///
    /// # Errors
    /// When the sandbox's share or the cap would be passed. The first
    /// refusal of a sandbox after it was within its share is logged; the
    /// rest are counted and logged once it is back under it.
    pub fn take(&self, sandbox: &str, n: usize) -> Result<Lease<'_>, Refused> {
        self.add(sandbox, n)?;
        Ok(Lease {
            of: self,
            sandbox: sandbox.to_owned(),
            n,
        })
    }

    fn add(&self, sandbox: &str, n: usize) -> Result<(), Refused> {
        let mut held = self.held.lock().unwrap();
        let total = held.total;
        let holder = held.by.entry(sandbox.to_owned()).or_default();
        let refused = if holder.count + n > self.share {
            Some(Refused::Share {
                sandbox: sandbox.to_owned(),
                share: self.share,
            })
        } else if total + n > self.cap {
            Some(Refused::Cap { cap: self.cap })
        } else {
            None
        };
        if let Some(r) = refused {
            if holder.refused == 0 {
                tracing::warn!(sandbox = %sandbox, held = holder.count, "refusing the sandbox's requests: {r}");
            }
            holder.refused += 1;
            return Err(r);
        }
        holder.count += n;
        held.total += n;
        Ok(())
    }

    fn give_back(&self, sandbox: &str, n: usize) {
        let mut held = self.held.lock().unwrap();
        held.total -= n;
        let Some(holder) = held.by.get_mut(sandbox) else {
            return;
        };
        holder.count -= n;
        // Back to three quarters of the share: the episode is over.
        if holder.refused > 0 && holder.count <= self.share / 4 * 3 {
            tracing::info!(
                sandbox = %sandbox,
                held = holder.count,
                refused = holder.refused,
                "the sandbox is back under its share of agentd's descriptors"
            );
            holder.refused = 0;
        }
        if holder.count == 0 && holder.refused == 0 {
            held.by.remove(sandbox);
        }
    }
}

/// Descriptors held for one sandbox's request; given back on drop.
#[derive(Debug)]
pub struct Lease<'a> {
    of: &'a Descriptors,
    sandbox: String,
    n: usize,
}

impl Lease<'_> {
    /// Take `n` more for the same request.
    ///
    /// # Errors
    /// As [`Descriptors::take`]; the lease keeps what it had.
    pub fn grow(&mut self, n: usize) -> Result<(), Refused> {
        self.of.add(&self.sandbox, n)?;
        self.n += n;
        Ok(())
    }

    /// How many descriptors it holds.
    #[must_use]
    pub fn count(&self) -> usize {
        self.n
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.of.give_back(&self.sandbox, self.n);
    }
}

/// What an accept loop does when `accept` fails (out of descriptors, most
/// likely): wait longer after each failure in a row, up to
/// [`AcceptErrors::PAUSE_MAX`], and log the first failure and the
/// recovery, not every one.
#[derive(Debug, Default)]
pub struct AcceptErrors {
    in_a_row: u32,
}

impl AcceptErrors {
    /// The first pause.
    pub const PAUSE_MIN: std::time::Duration = std::time::Duration::from_millis(50);
    /// The longest pause.
    pub const PAUSE_MAX: std::time::Duration = std::time::Duration::from_secs(2);

    /// `accept` on `what` failed with `error`: how long to wait before the
    /// next one.
    pub fn failed(&mut self, what: &str, error: &std::io::Error) -> std::time::Duration {
        if self.in_a_row == 0 {
            tracing::warn!(
                listener = %what,
                error = %error,
                "accept failed; pausing, and logging again once it works"
            );
        }
        self.in_a_row = self.in_a_row.saturating_add(1);
        let pause = Self::PAUSE_MIN.saturating_mul(1 << self.in_a_row.min(8).saturating_sub(1));
        pause.min(Self::PAUSE_MAX)
    }

    /// `accept` on `what` worked.
    pub fn accepted(&mut self, what: &str) {
        if self.in_a_row > 0 {
            tracing::info!(listener = %what, failures = self.in_a_row, "accepting again");
            self.in_a_row = 0;
        }
    }
}

static DESCRIPTORS: OnceLock<Descriptors> = OnceLock::new();

/// Raise the soft descriptor limit to the hard one (at most [`RAISE_MAX`])
/// and set this agentd's budget by `config`; once, at start. Returns the
/// budget (the first one set, if called again).
pub fn init(config: &LimitsConfig) -> &'static Descriptors {
    let limit = raise_nofile();
    let share = config
        .descriptors_per_sandbox
        .and_then(|s| usize::try_from(s).ok());
    let d = DESCRIPTORS.get_or_init(|| Descriptors::new(limit, share));
    tracing::info!(
        limit = d.limit(),
        cap = d.cap(),
        per_sandbox = d.share(),
        "descriptor budget"
    );
    d
}

/// This agentd's descriptor budget (from the current soft limit and the
/// default share when [`init`] was not called, as in unit tests).
pub fn descriptors() -> &'static Descriptors {
    DESCRIPTORS.get_or_init(|| Descriptors::new(soft_nofile(), None))
}

fn soft_nofile() -> u64 {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(1024, |(soft, _)| soft)
}

/// The soft `RLIMIT_NOFILE` agentd started with (0 until [`init`]).
static INHERITED_SOFT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Give a child the soft descriptor limit agentd started with, not the one
/// it raised itself to: helpers, sandboxes and QEMU live with the usual
/// limit (programs that use `select(2)` break past 1024), and a sandbox's
/// processes hold no more than before. For `pre_exec`: async-signal-safe
/// (one `getrlimit`, one `setrlimit`).
///
/// # Errors
/// When the limit cannot be set.
pub fn restore_inherited_nofile() -> std::io::Result<()> {
    lower_nofile(inherited_nofile())
}

/// The soft `RLIMIT_NOFILE` agentd started with (0 before [`init`]), for a
/// process of agentd's own binary to lower its limit to after exec
/// ([`crate::helper::Start`]).
pub fn inherited_nofile() -> u64 {
    INHERITED_SOFT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Lower the soft `RLIMIT_NOFILE` to `soft` (0, or a limit already lower:
/// nothing changes). Async-signal-safe (one `getrlimit`, one `setrlimit`).
///
/// # Errors
/// When the limit cannot be set.
pub fn lower_nofile(soft: u64) -> std::io::Result<()> {
    if soft == 0 {
        return Ok(());
    }
    let mut limit = nix::libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write one rlimit struct we
    // own; both are async-signal-safe system calls.
    unsafe {
        if nix::libc::getrlimit(nix::libc::RLIMIT_NOFILE, &raw mut limit) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if limit.rlim_cur > soft {
            limit.rlim_cur = soft;
            if nix::libc::setrlimit(nix::libc::RLIMIT_NOFILE, &raw const limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// Raise the soft `RLIMIT_NOFILE` to the hard one (at most
/// [`RAISE_MAX`]); the soft limit in force afterwards.
fn raise_nofile() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return 1024;
    };
    INHERITED_SOFT.store(soft, std::sync::atomic::Ordering::Relaxed);
    let want = hard.min(RAISE_MAX).max(soft);
    if want > soft {
        if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, want, hard) {
            tracing::warn!(soft, hard, "cannot raise the descriptor limit: {e}");
            return soft;
        }
    }
    want
}

/// Counts of something per uid (connections, sockets), each taken with
/// a guard that gives it back.
#[derive(Debug, Default)]
pub struct PerUid(Mutex<HashMap<u32, usize>>);

/// One of a uid's count, given back when dropped.
#[derive(Debug)]
pub struct Taken(Arc<PerUid>, u32);

impl PerUid {
    /// One more for `uid`, if it has fewer than `max`.
    pub fn take(self: &Arc<Self>, uid: u32, max: usize) -> Option<Taken> {
        let mut map = self.0.lock().unwrap();
        let n = map.entry(uid).or_default();
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Taken(Arc::clone(self), uid))
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        let mut map = self.0.0.lock().unwrap();
        if let Some(n) = map.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_and_shares_follow_the_limit() {
        let d = Descriptors::new(1024, None);
        assert_eq!((d.cap(), d.share()), (512, 64));
        let d = Descriptors::new(65536, None);
        assert_eq!((d.cap(), d.share()), (49152, 6144));
        // A configured share never passes the cap.
        let d = Descriptors::new(1024, Some(100_000));
        assert_eq!(d.share(), 512);
        // Below the reserve nothing is left for sandboxes.
        let d = Descriptors::new(256, None);
        assert_eq!((d.cap(), d.share()), (0, 0));
        assert!(d.take("a", 1).is_err());
    }

    #[test]
    fn a_sandbox_cannot_pass_its_share_and_leases_give_back() {
        let d = Descriptors::new(1024, Some(10));
        let a = d.take("a", 6).unwrap();
        let mut b = d.take("a", 1).unwrap();
        assert!(matches!(b.grow(5), Err(Refused::Share { share: 10, .. })));
        assert_eq!(b.count(), 1);
        b.grow(3).unwrap();
        assert_eq!(d.held("a"), 10);
        assert!(d.take("a", 1).is_err());
        // Another sandbox has its own share.
        let c = d.take("b", 10).unwrap();
        assert_eq!(d.total(), 20);
        drop((a, b, c));
        assert_eq!((d.held("a"), d.held("b"), d.total()), (0, 0, 0));
        d.take("a", 10).unwrap();
    }

    #[test]
    fn accept_failures_back_off() {
        let mut a = AcceptErrors::default();
        let e = std::io::Error::from_raw_os_error(24);
        let pauses: Vec<u128> = (0..10).map(|_| a.failed("x", &e).as_millis()).collect();
        assert_eq!(
            pauses,
            [50, 100, 200, 400, 800, 1600, 2000, 2000, 2000, 2000]
        );
        a.accepted("x");
        assert_eq!(a.failed("x", &e).as_millis(), 50);
    }

    #[test]
    fn all_sandboxes_together_cannot_pass_the_cap() {
        let d = Descriptors::new(1024, Some(300));
        let _a = d.take("a", 300).unwrap();
        let _b = d.take("b", 200).unwrap();
        assert_eq!(d.take("c", 13).unwrap_err(), Refused::Cap { cap: 512 });
        let _c = d.take("c", 12).unwrap();
    }
}

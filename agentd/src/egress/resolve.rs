//! The egress gateway's name lookups: asynchronous (hickory-resolver over
//! tokio) and cached per sandbox, so that a burst of connections to the
//! same few names (`npm install`'s parallel requests) costs a few DNS
//! queries, not one thread and one query each.
//!
//! A name is looked up in this order: a literal address; agentd's
//! `egress.hosts`; `/etc/hosts` (as getaddrinfo's `files`: a name found
//! there is not asked of DNS); DNS, the servers of `/etc/resolv.conf` (or
//! `egress.nameservers`) with its search domains, A and AAAA together.
//! Both files are read again when they change.
//!
//! Bounds, so that a sandbox can neither grow agentd nor starve another
//! sandbox: a sandbox keeps at most [`CACHE_MAX`] names (an answer for its
//! records' TTL, "no such name" for its SOA's but at most [`NEGATIVE_MAX`],
//! a failure not at all), each with at most [`ADDRESSES_MAX`] addresses;
//! one query is out per name (the others wait for its answer); at most
//! [`LOOKUPS_PER_SANDBOX`] names of one sandbox, and [`LOOKUPS_ALL`] of all
//! sandboxes, are asked at once, handed out in order of asking. A lookup
//! ends within [`RESOLVE_TIMEOUT`], and unlike getaddrinfo's thread, an
//! abandoned one gives its permits back at once.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use hickory_resolver::config::{
    LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts,
};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::op::Query;
use hickory_resolver::proto::rr::{Name, RecordType};
use hickory_resolver::proto::xfer::Protocol;
use hickory_resolver::{Hosts, TokioResolver};
use tokio::sync::{OnceCell, Semaphore};

/// Time to resolve a name.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);
/// Most names one sandbox's cache keeps.
pub const CACHE_MAX: usize = 512;
/// Most addresses kept of one name.
pub const ADDRESSES_MAX: usize = 32;
/// Longest a "no such name" answer is kept.
pub const NEGATIVE_MAX: Duration = Duration::from_secs(60);
/// Most names of one sandbox asked of DNS at once.
pub const LOOKUPS_PER_SANDBOX: usize = 8;
/// Most names of all sandboxes asked of DNS at once.
pub const LOOKUPS_ALL: usize = 64;

static ALL: Semaphore = Semaphore::const_new(LOOKUPS_ALL);

const RESOLV_CONF: &str = "/etc/resolv.conf";
const HOSTS: &str = "/etc/hosts";

/// Why a name has no address.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ResolveError {
    /// DNS says the name does not exist or has no address.
    #[error("cannot resolve {host}: no such name")]
    NoSuchName {
        /// The name.
        host: String,
    },
    /// The lookup failed (no answer, a server failure, a name that is not
    /// one, or a resolver configuration that cannot be read).
    #[error("cannot resolve {host}: {error}")]
    Failed {
        /// The name.
        host: String,
        /// The resolver's answer.
        #[source]
        error: hickory_resolver::ResolveError,
    },
    /// The lookup took longer than [`RESOLVE_TIMEOUT`].
    #[error("resolving {host} timed out")]
    Timeout {
        /// The name.
        host: String,
    },
}

/// Set the DNS servers every gateway asks (`egress.nameservers`); empty:
/// those of `/etc/resolv.conf`. Takes effect only before the first lookup.
pub fn init(nameservers: &[SocketAddr]) {
    let _ = SYSTEM.set(Arc::new(System::new(nameservers.to_vec())));
}

static SYSTEM: OnceLock<Arc<System>> = OnceLock::new();

/// One sandbox's resolver: its cache and its share of lookups.
#[derive(Debug)]
pub struct Resolver {
    system: Arc<System>,
    cache: Mutex<HashMap<String, Arc<OnceCell<Answer>>>>,
    lookups: Semaphore,
}

impl Default for Resolver {
    fn default() -> Self {
        Self::new()
    }
}

impl Resolver {
    /// A resolver with an empty cache, asking the servers set by [`init`].
    pub fn new() -> Self {
        let system = SYSTEM.get_or_init(|| Arc::new(System::new(Vec::new())));
        Self::with_system(Arc::clone(system))
    }

    fn with_system(system: Arc<System>) -> Self {
        Self {
            system,
            cache: Mutex::new(HashMap::new()),
            lookups: Semaphore::new(LOOKUPS_PER_SANDBOX),
        }
    }

    /// The addresses of `host` (a literal address, a name in `statics`, in
    /// /etc/hosts, or in DNS), within [`RESOLVE_TIMEOUT`].
    pub async fn resolve(
        &self,
        host: &str,
        statics: &BTreeMap<String, IpAddr>,
    ) -> Result<Vec<IpAddr>, ResolveError> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return Ok(vec![ip]);
        }
        let name = host.to_ascii_lowercase();
        if let Some(ip) = statics.get(&name) {
            return Ok(vec![*ip]);
        }
        let cell = self.cell(&name);
        let answer = tokio::time::timeout(RESOLVE_TIMEOUT, cell.get_or_init(|| self.ask(&name)))
            .await
            .map_err(|_| ResolveError::Timeout {
                host: host.to_owned(),
            })?;
        match &answer.found {
            Ok(found) => Ok(found.to_vec()),
            Err(e) => Err(e.clone()),
        }
    }

    /// The cache's entry for `name`: answered and still valid, being
    /// answered, or new. When the cache is full, the expired and abandoned
    /// entries go, then the one that expires first; a new entry that still
    /// finds no room is not kept.
    fn cell(&self, name: &str) -> Arc<OnceCell<Answer>> {
        let now = Instant::now();
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = cache.get(name) {
            if c.get().is_none_or(|a| a.until > now) {
                return Arc::clone(c);
            }
            cache.remove(name);
        }
        if cache.len() >= CACHE_MAX {
            cache.retain(|_, c| match c.get() {
                Some(a) => a.until > now,
                None => Arc::strong_count(c) > 1,
            });
        }
        if cache.len() >= CACHE_MAX {
            let first = cache
                .iter()
                .filter_map(|(k, c)| Some((c.get()?.until, k)))
                .min()
                .map(|(_, k)| k.clone());
            if let Some(k) = first {
                cache.remove(&k);
            }
        }
        let cell = Arc::new(OnceCell::new());
        if cache.len() < CACHE_MAX {
            cache.insert(name.to_owned(), Arc::clone(&cell));
        }
        cell
    }

    /// Ask /etc/hosts, then DNS, for `name` (holding a permit of this
    /// sandbox and one of all sandboxes while DNS is asked).
    async fn ask(&self, name: &str) -> Answer {
        let failed = |error: hickory_resolver::ResolveError| Answer {
            found: Err(ResolveError::Failed {
                host: name.to_owned(),
                error,
            }),
            until: Instant::now(),
        };
        let (hosts, resolver) = match self.system.current() {
            Ok(v) => v,
            Err(e) => return failed(e),
        };
        if let Some(found) = from_hosts(&hosts, name) {
            return Answer {
                found: Ok(found.into()),
                until: Instant::now(),
            };
        }
        // Closed never: these semaphores live as long as their owners.
        let Ok(_mine) = self.lookups.acquire().await else {
            return failed("lookups closed".into());
        };
        let Ok(_all) = ALL.acquire().await else {
            return failed("lookups closed".into());
        };
        match resolver.lookup_ip(name).await {
            Ok(found) => {
                let mut addrs: Vec<IpAddr> = Vec::new();
                for ip in found.iter() {
                    if !addrs.contains(&ip) && addrs.len() < ADDRESSES_MAX {
                        addrs.push(ip);
                    }
                }
                Answer {
                    found: Ok(addrs.into()),
                    until: found.valid_until(),
                }
            }
            Err(e) if e.is_no_records_found() || e.is_nx_domain() => {
                let ttl = e.proto().and_then(|p| match p.kind() {
                    hickory_resolver::proto::ProtoErrorKind::NoRecordsFound {
                        negative_ttl,
                        ..
                    } => *negative_ttl,
                    _ => None,
                });
                let keep = ttl.map_or(Duration::ZERO, |s| {
                    Duration::from_secs(u64::from(s)).min(NEGATIVE_MAX)
                });
                Answer {
                    found: Err(ResolveError::NoSuchName {
                        host: name.to_owned(),
                    }),
                    until: Instant::now() + keep,
                }
            }
            Err(e) => failed(e),
        }
    }
}

/// A lookup's outcome and how long it holds.
#[derive(Debug, Clone)]
struct Answer {
    found: Result<Arc<[IpAddr]>, ResolveError>,
    until: Instant,
}

/// `name`'s addresses in /etc/hosts (v4 and v6), if it is there.
fn from_hosts(hosts: &Hosts, name: &str) -> Option<Vec<IpAddr>> {
    let name = Name::from_utf8(name).ok()?;
    let mut found = Vec::new();
    for kind in [RecordType::A, RecordType::AAAA] {
        if let Some(l) = hosts.lookup_static_host(&Query::query(name.clone(), kind)) {
            found.extend(
                l.iter()
                    .filter_map(hickory_resolver::proto::rr::RData::ip_addr),
            );
        }
    }
    found.truncate(ADDRESSES_MAX);
    (!found.is_empty()).then_some(found)
}

/// What identifies a version of a file: its inode, size and change time.
type Stamp = Option<(u64, u64, i64, i64)>;

fn stamp(path: &str) -> Stamp {
    let m = std::fs::metadata(path).ok()?;
    Some((m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}

/// The host's resolver configuration, shared by every sandbox: built from
/// /etc/resolv.conf and /etc/hosts, again whenever either changes.
struct System {
    nameservers: Vec<SocketAddr>,
    current: Mutex<Option<Current>>,
}

struct Current {
    stamps: [Stamp; 2],
    hosts: Arc<Hosts>,
    resolver: TokioResolver,
}

impl std::fmt::Debug for System {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("System")
            .field("nameservers", &self.nameservers)
            .finish_non_exhaustive()
    }
}

impl System {
    fn new(nameservers: Vec<SocketAddr>) -> Self {
        Self {
            nameservers,
            current: Mutex::new(None),
        }
    }

    /// The hosts file and the resolver for the files as they are now.
    fn current(&self) -> Result<(Arc<Hosts>, TokioResolver), hickory_resolver::ResolveError> {
        let stamps = [stamp(RESOLV_CONF), stamp(HOSTS)];
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = current.as_ref().filter(|c| c.stamps == stamps) {
            return Ok((Arc::clone(&c.hosts), c.resolver.clone()));
        }
        let (config, options) = self.config()?;
        let resolver =
            TokioResolver::builder_with_config(config, TokioConnectionProvider::default())
                .with_options(options)
                .build();
        // A missing or unreadable /etc/hosts is an empty one, as for libc.
        let hosts = Arc::new(Hosts::from_system().unwrap_or_default());
        *current = Some(Current {
            stamps,
            hosts: Arc::clone(&hosts),
            resolver: resolver.clone(),
        });
        Ok((hosts, resolver))
    }

    fn config(&self) -> Result<(ResolverConfig, ResolverOpts), hickory_resolver::ResolveError> {
        let system = hickory_resolver::system_conf::read_system_conf();
        let (mut config, mut options) = match system {
            Ok(v) => v,
            Err(e) if self.nameservers.is_empty() => return Err(e),
            // Configured servers need no resolv.conf (its search domains
            // and options are taken when there is one).
            Err(_) => (ResolverConfig::new(), ResolverOpts::default()),
        };
        if !self.nameservers.is_empty() {
            let servers: Vec<NameServerConfig> = self
                .nameservers
                .iter()
                .flat_map(|&a| {
                    [Protocol::Udp, Protocol::Tcp].map(|p| {
                        let mut s = NameServerConfig::new(a, p);
                        s.trust_negative_responses = false;
                        s
                    })
                })
                .collect();
            config = ResolverConfig::from_parts(
                config.domain().cloned(),
                config.search().to_vec(),
                servers,
            );
        }
        // Both families, as getaddrinfo; the cache is the sandbox's
        // (hickory's own would be shared by all sandboxes); /etc/hosts is
        // read here first, so that its names never wait for DNS.
        options.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        options.cache_size = 0;
        options.use_hosts_file = ResolveHosts::Never;
        Ok((config, options))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::net::Ipv4Addr;

    use hickory_resolver::proto::op::{Message, MessageType, ResponseCode};
    use hickory_resolver::proto::rr::{RData, Record, rdata::A};

    use super::*;

    /// The questions a test DNS server was asked, as (name, type).
    type Asked = Arc<Mutex<Vec<(String, RecordType)>>>;

    /// A DNS server on 127.0.0.1 (UDP) that answers `<n>.<anything>` with
    /// 192.0.2.<n> (TTL 1 s for names starting `short`, else 300 s),
    /// `none.…` with NXDOMAIN (negative TTL 300 s), AAAA with no records,
    /// and never answers names that start with `silent`.
    async fn dns_server() -> (SocketAddr, Asked) {
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let asked = Asked::default();
        let log = Arc::clone(&asked);
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            loop {
                let (n, from) = socket.recv_from(&mut buf).await.unwrap();
                let Ok(query) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let q = query.queries()[0].clone();
                let name = q.name().to_ascii().to_ascii_lowercase();
                log.lock().unwrap().push((name.clone(), q.query_type()));
                if name.starts_with("silent") {
                    continue;
                }
                let mut reply = Message::new();
                reply
                    .set_id(query.id())
                    .set_message_type(MessageType::Response)
                    .set_recursion_desired(true)
                    .set_recursion_available(true)
                    .add_query(q.clone());
                let first = name.split('.').next().unwrap_or_default();
                if first == "none" {
                    let soa = hickory_resolver::proto::rr::rdata::SOA::new(
                        Name::from_ascii("test.").unwrap(),
                        Name::from_ascii("x.test.").unwrap(),
                        1,
                        300,
                        300,
                        300,
                        300,
                    );
                    reply
                        .set_response_code(ResponseCode::NXDomain)
                        .add_name_server(Record::from_rdata(
                            Name::from_ascii("test.").unwrap(),
                            300,
                            RData::SOA(soa),
                        ));
                } else if q.query_type() == RecordType::A {
                    let digits: String = first.chars().filter(char::is_ascii_digit).collect();
                    let n: u8 = digits.parse().unwrap_or(1);
                    let ttl = if first.starts_with("short") { 1 } else { 300 };
                    let ip = Ipv4Addr::new(192, 0, 2, n);
                    reply.add_answer(Record::from_rdata(q.name().clone(), ttl, RData::A(A(ip))));
                }
                let _ = socket.send_to(&reply.to_vec().unwrap(), from).await;
            }
        });
        (addr, asked)
    }

    fn resolver(server: SocketAddr) -> Arc<Resolver> {
        Arc::new(Resolver::with_system(Arc::new(System::new(vec![server]))))
    }

    fn asked_for(asked: &Asked, prefix: &str) -> Vec<String> {
        asked
            .lock()
            .unwrap()
            .iter()
            .filter(|(n, _)| n.starts_with(prefix))
            .map(|(n, _)| n.clone())
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_for_a_few_names_asks_dns_once_per_name_and_type() {
        let (server, asked) = dns_server().await;
        let r = resolver(server);
        let mut burst = tokio::task::JoinSet::new();
        for i in 0..300u32 {
            let r = Arc::clone(&r);
            burst.spawn(async move {
                let n = i % 3 + 1;
                let found = r
                    .resolve(&format!("{n}.burst.test"), &BTreeMap::new())
                    .await;
                (n, found)
            });
        }
        while let Some(done) = burst.join_next().await {
            let (n, found) = done.unwrap();
            let want = IpAddr::V4(Ipv4Addr::new(192, 0, 2, u8::try_from(n).unwrap()));
            assert_eq!(found.unwrap(), [want]);
        }
        // Three names, A and AAAA each, asked once.
        assert_eq!(asked_for(&asked, "").len(), 6);
    }

    #[tokio::test]
    async fn an_answer_is_kept_for_its_ttl_and_no_longer() {
        let (server, asked) = dns_server().await;
        let r = resolver(server);
        let none = BTreeMap::new();
        r.resolve("short7.test", &none).await.unwrap();
        r.resolve("short7.test", &none).await.unwrap();
        assert_eq!(asked_for(&asked, "short7").len(), 2);
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let again = r.resolve("short7.test", &none).await.unwrap();
        assert_eq!(again, [IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7))]);
        assert_eq!(asked_for(&asked, "short7").len(), 4);
        // "No such name" is kept for its SOA's TTL too.
        for _ in 0..3 {
            let e = r.resolve("none.test", &none).await.unwrap_err();
            assert_eq!(e.to_string(), "cannot resolve none.test: no such name");
        }
        assert_eq!(asked_for(&asked, "none").len(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_distinct_names_keep_the_cache_bounded() {
        let (server, asked) = dns_server().await;
        let r = resolver(server);
        let none = BTreeMap::new();
        for i in 0..CACHE_MAX + 100 {
            r.resolve(&format!("{}.n{i}.test", i % 250 + 1), &none)
                .await
                .unwrap();
        }
        assert!(r.cache.lock().unwrap().len() <= CACHE_MAX);
        // The newest names are still kept.
        let before = asked.lock().unwrap().len();
        let last = CACHE_MAX + 99;
        r.resolve(&format!("{}.n{last}.test", last % 250 + 1), &none)
            .await
            .unwrap();
        assert_eq!(asked.lock().unwrap().len(), before);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sandbox_asking_for_names_nobody_answers_holds_only_its_share() {
        let (server, asked) = dns_server().await;
        let hostile = resolver(server);
        let other = resolver(server);
        let mut stuck = tokio::task::JoinSet::new();
        for i in 0..40 {
            let r = Arc::clone(&hostile);
            stuck.spawn(async move {
                r.resolve(&format!("silent{i}.test"), &BTreeMap::new())
                    .await
            });
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        let distinct = || {
            asked_for(&asked, "silent")
                .into_iter()
                .collect::<HashSet<_>>()
                .len()
        };
        while distinct() < LOOKUPS_PER_SANDBOX && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Another sandbox's lookup is answered meanwhile, at once.
        let t = Instant::now();
        let found = other
            .resolve("9.other.test", &BTreeMap::new())
            .await
            .unwrap();
        assert_eq!(found, [IpAddr::V4(Ipv4Addr::new(192, 0, 2, 9))]);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(distinct(), LOOKUPS_PER_SANDBOX);
        // Abandoned lookups give their permits back.
        stuck.abort_all();
        while stuck.join_next().await.is_some() {}
        assert_eq!(hostile.lookups.available_permits(), LOOKUPS_PER_SANDBOX);
    }

    #[tokio::test]
    async fn names_in_etc_hosts_resolve_as_getaddrinfo_has_them_without_dns() {
        let (server, asked) = dns_server().await;
        let r = resolver(server);
        let hosts = std::fs::read_to_string(HOSTS).unwrap_or_default();
        let names: Vec<&str> = hosts
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .flat_map(|l| l.split_whitespace().skip(1))
            .take(5)
            .collect();
        assert!(names.contains(&"localhost"), "{hosts}");
        for name in names {
            let mut found = r.resolve(name, &BTreeMap::new()).await.unwrap();
            let mut libc: Vec<IpAddr> = std::net::ToSocketAddrs::to_socket_addrs(&(name, 0))
                .unwrap()
                .map(|a| a.ip())
                .collect();
            found.sort();
            libc.sort();
            libc.dedup();
            assert_eq!(found, libc, "{name}");
        }
        assert_eq!(asked_for(&asked, "").len(), 0);
    }

    #[tokio::test]
    async fn literal_addresses_and_configured_names_ask_nobody() {
        let (server, asked) = dns_server().await;
        let r = resolver(server);
        let statics = BTreeMap::from([("origin.test".to_owned(), IpAddr::from([10, 0, 0, 1]))]);
        assert_eq!(
            r.resolve("Origin.Test", &statics).await.unwrap(),
            [IpAddr::from([10, 0, 0, 1])]
        );
        assert_eq!(
            r.resolve("[::1]", &statics).await.unwrap(),
            [IpAddr::from(std::net::Ipv6Addr::LOCALHOST)]
        );
        assert_eq!(asked_for(&asked, "").len(), 0);
    }
}

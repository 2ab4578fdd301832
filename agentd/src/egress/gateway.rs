//! The gateway's protocols: an HTTP proxy (CONNECT, and plain HTTP with an
//! absolute URL) and SOCKS5 (CONNECT) on one listener, told apart by the
//! first byte. Each connection is decided by [`super::policy`], dialled by
//! agentd on the host, logged when it ends, and bounded: a request head of
//! at most [`HEAD_MAX`] bytes read within [`HEAD_TIMEOUT`], at most
//! [`CONNECTIONS_MAX`] at once per sandbox, each connection's descriptors
//! taken from the sandbox's share of agentd's ([`crate::budget`]): a
//! connection beyond it is answered `503` (SOCKS: general failure). A
//! tunnel ends when it has been quiet too long ([`super::splice`]).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

use super::head::{http_head, socks_head, socks_reply};
use super::hint;
use super::log::Entry;
use super::policy::{Decision, Policy};
use super::splice::{Activity, Socket, Watched, relay};

/// Largest request head (request line and headers, or a SOCKS5 greeting).
pub const HEAD_MAX: usize = 16 * 1024;
/// Time a client has to send its request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Time to connect to one destination address.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections of one sandbox at once; more wait to be accepted.
pub const CONNECTIONS_MAX: usize = 256;
/// Descriptors of a tunnel (CONNECT, SOCKS): the client's socket, the
/// destination's, and a pipe each way ([`super::splice`]).
pub const TUNNEL_DESCRIPTORS: usize = 6;
/// Descriptors of a plain HTTP request: the client's and the
/// destination's sockets.
pub const REQUEST_DESCRIPTORS: usize = 2;
/// Connections beyond a sandbox's share answered at once: more are closed
/// without an answer. Their descriptors come out of agentd's reserve.
const REFUSING_MAX: usize = 8;
/// Time a connection beyond the share has to send its request head.
const REFUSING_TIMEOUT: Duration = Duration::from_secs(2);

/// What the gateway of one sandbox needs from agentd.
pub struct Context {
    /// The sandbox.
    pub name: String,
    /// Its current policy (read for every connection, so a change applies
    /// to the next one); `None` once the sandbox is gone.
    pub policy: Box<dyn Fn() -> Option<Policy> + Send + Sync>,
    /// Names resolved without DNS.
    pub hosts: std::collections::BTreeMap<String, IpAddr>,
    /// Called with every finished connection (allowed or not).
    pub record: Box<dyn Fn(Entry) + Send + Sync>,
    /// Connections waiting for their person (mode `ask`).
    pub pending: Arc<super::ask::Pending>,
    /// How long such a connection waits.
    pub ask_timeout: Duration,
    /// Called when a connection starts waiting.
    pub asked: Asked,
    /// For a CONNECT to (host, port): how to swap the sandbox's secrets in
    /// it, when the host carries one ([`super::intercept`]).
    pub intercept: super::intercept::Intercept,
}

/// What the gateway calls with a connection that starts waiting for its
/// person.
pub type Asked = Box<dyn Fn(&super::ask::Waiting) + Send + Sync>;

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Where a gateway accepts: a TCP socket in a `local` sandbox's network
/// namespace, the unix socket a `vm` guest's connections arrive on (forwarded by agentd's ssh),
/// or the connections a shared listener attributed to the sandbox (a
/// `microvm` guest's, by their source address).
#[derive(Debug)]
pub enum Listener {
    /// A listening TCP socket.
    Tcp(tokio::net::TcpListener),
    /// A listening unix socket.
    Unix(tokio::net::UnixListener),
    /// Connections accepted by a [`super::shared::Shared`] listener.
    Routed(tokio::sync::mpsc::Receiver<TcpStream>),
    /// Connections a backend hands over.
    Handed(tokio::sync::mpsc::Receiver<tokio::net::UnixStream>),
}

/// A client connection of either kind.
enum Client {
    Tcp(TcpStream),
    Unix(tokio::net::UnixStream),
}

impl Listener {
    async fn accept(&mut self) -> std::io::Result<Client> {
        Ok(match self {
            Self::Tcp(l) => {
                let (s, _) = l.accept().await?;
                let _ = s.set_nodelay(true);
                Client::Tcp(s)
            }
            Self::Unix(l) => Client::Unix(l.accept().await?.0),
            Self::Routed(rx) => match rx.recv().await {
                Some(s) => {
                    let _ = s.set_nodelay(true);
                    Client::Tcp(s)
                }
                // The route is gone, and this task is being ended with it.
                None => std::future::pending().await,
            },
            Self::Handed(rx) => match rx.recv().await {
                Some(s) => Client::Unix(s),
                // The backend has stopped handing; the task ends with it.
                None => std::future::pending().await,
            },
        })
    }
}

/// Accept connections on `listener` until the task is aborted; aborting it
/// ends every connection it started.
pub async fn serve(mut listener: Listener, ctx: Arc<Context>) {
    let budget = crate::budget::descriptors();
    let mut conns = JoinSet::new();
    let dns = Arc::new(super::resolve::Resolver::new());
    let refusing = Arc::new(tokio::sync::Semaphore::new(REFUSING_MAX));
    let mut errors = crate::budget::AcceptErrors::default();
    let what = format!("egress gateway of sandbox '{}'", ctx.name);
    loop {
        while conns.len() >= CONNECTIONS_MAX {
            let _ = conns.join_next().await;
        }
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(client) => {
                    errors.accepted(&what);
                    let ctx = Arc::clone(&ctx);
                    match budget.take(&ctx.name, 1) {
                        Ok(lease) => {
                            let dns = Arc::clone(&dns);
                            conns.spawn(async move {
                                match client {
                                    Client::Tcp(s) => handle(s, lease, &ctx, &dns).await,
                                    Client::Unix(s) => handle(s, lease, &ctx, &dns).await,
                                }
                            });
                        }
                        // Answered by a few tasks of their own; past them,
                        // closed at once.
                        Err(refused) => {
                            if let Ok(permit) = Arc::clone(&refusing).try_acquire_owned() {
                                conns.spawn(async move {
                                    let _permit = permit;
                                    match client {
                                        Client::Tcp(s) => refuse_spent(s, &refused).await,
                                        Client::Unix(s) => refuse_spent(s, &refused).await,
                                    }
                                });
                            }
                        }
                    }
                }
                Err(e) => {
                    let pause = errors.failed(&what, &e);
                    tokio::time::sleep(pause).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// What the client asked for.
pub(super) struct Ask {
    pub(super) protocol: &'static str,
    pub(super) host: String,
    pub(super) port: u16,
    /// Plain HTTP: the request body's bytes still to come from the client
    /// after the head (one request per connection); `None` for a tunnel.
    pub(super) body_left: Option<u64>,
}

/// Why the gateway did not take a request or could not reach its
/// destination. The text goes to the client and into the egress log.
#[derive(Debug, thiserror::Error)]
pub(super) enum GatewayError {
    /// Reading from or writing to the client failed.
    #[error(transparent)]
    Client(std::io::Error),
    /// The request head is larger than [`HEAD_MAX`].
    #[error("request head is larger than {HEAD_MAX} bytes")]
    HeadTooLarge,
    /// The client hung up before its head ended.
    #[error("the request ended early")]
    EndedEarly,
    /// The head does not parse as HTTP.
    #[error("not an HTTP proxy request")]
    NotProxyRequest,
    /// A plain HTTP request's target is not an absolute URL (shown safely).
    #[error("'{0}' is not an absolute http:// URL; this is a proxy (use CONNECT for HTTPS)")]
    NotAbsolute(String),
    /// A plain HTTP request has a chunked body.
    #[error("a plain HTTP request with a chunked body is not forwarded; use https:// (CONNECT)")]
    Chunked,
    /// A plain HTTP request's framing is ambiguous or malformed
    /// ([`super::strict::framing`]): an origin could read another request
    /// in its body.
    #[error("{0}; the request is not forwarded")]
    Framing(#[source] super::strict::Refusal),
    /// An authority is not `host:port` (shown safely).
    #[error("'{0}' is not host:port")]
    NotHostPort(String),
    /// The SOCKS client wants authentication.
    #[error("the SOCKS client offers no method without authentication")]
    SocksMethod,
    /// The SOCKS request is not CONNECT.
    #[error("only SOCKS5 CONNECT is supported")]
    SocksCommand,
    /// The SOCKS host name is not a host name.
    #[error("the SOCKS host name is not a host name")]
    SocksHostName,
    /// The SOCKS address type is unknown.
    #[error("unknown SOCKS address type")]
    SocksAddressType,
    /// There is no address to connect to.
    #[error("no address to connect to")]
    NoAddress,
    /// Connecting to the destination failed.
    #[error("cannot connect to {to}: {error}")]
    Connect {
        /// The destination.
        to: SocketAddr,
        /// Why not.
        #[source]
        error: std::io::Error,
    },
    /// Connecting to the destination took too long.
    #[error("connecting to {to} timed out")]
    ConnectTimeout {
        /// The destination.
        to: SocketAddr,
    },
}

/// Answer a connection that came when the sandbox's share of descriptors
/// (or agentd's cap) was spent: `503` with why, or a SOCKS general
/// failure. (Logged by the budget, once for each time the share is spent.)
async fn refuse_spent(mut client: impl Socket, refused: &crate::budget::Refused) {
    let answer = async {
        let mut first = [0u8; 1];
        if client.read(&mut first).await.ok()? != 1 {
            return None;
        }
        let socks = first[0] == 5;
        if socks {
            socks_head(&mut client).await.ok()?;
        } else {
            http_head(&mut client, first[0]).await.ok()?;
        }
        answer_spent(&mut client, socks, refused).await;
        Some(())
    };
    let _ = tokio::time::timeout(REFUSING_TIMEOUT, answer).await;
}

/// Tell the client that its sandbox's descriptors are spent.
async fn answer_spent(client: &mut impl Socket, socks: bool, refused: &crate::budget::Refused) {
    if socks {
        let _ = client.write_all(&socks_reply(1)).await;
    } else {
        let body = format!("{refused}\n");
        let _ = respond(client, "503 Service Unavailable", &body).await;
    }
}

async fn handle(
    mut client: impl Socket,
    mut lease: crate::budget::Lease<'static>,
    ctx: &Context,
    dns: &super::resolve::Resolver,
) {
    let started = Instant::now();
    let at = SystemTime::now();
    let mut first = [0u8; 1];
    let Ok(Ok(1)) = tokio::time::timeout(HEAD_TIMEOUT, client.read(&mut first)).await else {
        return;
    };
    let socks = first[0] == 5;
    let parsed = if socks {
        tokio::time::timeout(HEAD_TIMEOUT, socks_head(&mut client)).await
    } else {
        tokio::time::timeout(HEAD_TIMEOUT, http_head(&mut client, first[0])).await
    };
    let (ask, head) = match parsed {
        Ok(Ok(v)) => v,
        Ok(Err(msg)) => {
            if !socks {
                let _ = respond(&mut client, "400 Bad Request", &format!("{msg}\n")).await;
            }
            return;
        }
        Err(_) => return,
    };
    let mut entry = Entry {
        at: crate::text::micros(Some(at)),
        sandbox: ctx.name.clone(),
        protocol: ask.protocol.to_owned(),
        host: crate::text::clamp_text(&ask.host).into_owned(),
        port: ask.port,
        addr: String::new(),
        decision: "deny".to_owned(),
        rule: String::new(),
        reason: String::new(),
        command: String::new(),
        sent: 0,
        received: 0,
        duration_ms: 0,
        error: String::new(),
        open: false,
    };
    let finish = |mut entry: Entry| {
        entry.duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        (ctx.record)(entry);
    };
    let Some(policy) = (ctx.policy)() else {
        return;
    };
    // What the name resolved to and this host's addresses, for the command
    // that admits a refusal (`None`: refused by its name alone).
    let mut seen: Option<(Vec<IpAddr>, Vec<IpAddr>)> = None;
    // The owner's own name for an address (`egress.hosts`), which a
    // command may open even where it is this host's.
    let vouched = ctx.hosts.contains_key(&ask.host.to_ascii_lowercase());
    let (decision, addrs) = match policy.precheck(&ask.host, ask.port) {
        Some(d) => (d, Vec::new()),
        None => match dns.resolve(&ask.host, &ctx.hosts).await {
            Ok(found) => {
                let own = super::own::host_addresses();
                let (d, a) = policy.decide(&ask.host, ask.port, &found, &own);
                let outcome = if policy.may_ask(&d) {
                    let once = hint::remedy(
                        &policy,
                        &d,
                        &ask.host,
                        ask.port,
                        Some(&found),
                        &own,
                        vouched,
                    );
                    wait_for_person(ctx, &ask, &found, &own, once).await
                } else {
                    (d, a)
                };
                seen = Some((found, own));
                outcome
            }
            Err(e) => {
                // No address: no entry admits it.
                seen = Some((Vec::new(), Vec::new()));
                (
                    Decision {
                        allowed: false,
                        rule: "unresolved".to_owned(),
                        reason: e.to_string(),
                        suggest: None,
                    },
                    Vec::new(),
                )
            }
        },
    };
    entry.rule.clone_from(&decision.rule);
    entry.reason.clone_from(&decision.reason);
    if !decision.allowed {
        // The policy as it is now (a wait may have seen it change).
        let policy = (ctx.policy)().unwrap_or(policy);
        let (found, own) = match &seen {
            Some((found, own)) => (Some(found.as_slice()), own.as_slice()),
            None => (None, &[][..]),
        };
        entry.command = hint::remedy(&policy, &decision, &ask.host, ask.port, found, own, vouched)
            .map(|e| hint::command(&ctx.name, &e, false))
            .unwrap_or_default();
        refuse(&mut client, &decision, &entry.command, socks).await;
        finish(entry);
        return;
    }
    entry.decision = "allow".to_owned();
    // The rest of its descriptors, before any is opened.
    let more = if ask.body_left.is_some() {
        REQUEST_DESCRIPTORS
    } else {
        TUNNEL_DESCRIPTORS
    } - lease.count();
    if let Err(refused) = lease.grow(more) {
        entry.error = refused.to_string();
        answer_spent(&mut client, socks, &refused).await;
        finish(entry);
        return;
    }
    let (mut upstream, addr) = match dial(&addrs, ask.port).await {
        Ok(v) => v,
        Err(e) => {
            entry.error = e.to_string();
            if socks {
                let _ = client.write_all(&socks_reply(5)).await;
            } else {
                let _ = respond(&mut client, "502 Bad Gateway", &format!("{e}\n")).await;
            }
            finish(entry);
            return;
        }
    };
    entry.addr = addr.ip().to_string();
    let _ = upstream.set_nodelay(true);
    let ready = if socks {
        client.write_all(&socks_reply(0)).await
    } else if ask.protocol == "connect" {
        client
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
    } else {
        Ok(())
    };
    // Logged before any byte goes either way, so a connection cut off by a
    // stop or a crash is still on record; its end follows. (After the
    // answer: the client's next bytes wait in its socket meanwhile.)
    (ctx.record)(Entry {
        open: true,
        ..entry.clone()
    });
    let mut sent = 0u64;
    if ready.is_ok() && !head.is_empty() && upstream.write_all(&head).await.is_ok() {
        sent = head.len() as u64;
    }
    // A CONNECT to a host that carries a secret: swapped in on the way.
    let plan = ready.is_ok() && ask.protocol == "connect";
    if let Some(plan) = plan.then(|| (ctx.intercept)(&ask.host, ask.port)).flatten() {
        let reason = format!("; the sandbox's secrets for {} swapped in", ask.host);
        entry.reason.push_str(&reason);
        // Ended when it has been quiet too long, as a tunnel is.
        let activity = Activity::default();
        let (client, upstream) = (
            Watched::new(client, &activity),
            Watched::new(upstream, &activity),
        );
        match activity
            .bounded(super::intercept::intercept(client, upstream, plan))
            .await
        {
            Ok((sent, received, error)) => {
                (entry.sent, entry.received) = (sent, received);
                entry.error = error.map(|e| e.to_string()).unwrap_or_default();
            }
            Err(e) => entry.error = e.to_string(),
        }
        return finish(entry);
    }
    match (ready.is_ok(), ask.body_left) {
        (false, _) => {}
        (true, None) => {
            let (up, down, error) = relay(&client, &upstream).await;
            entry.sent = sent + up;
            entry.received = down;
            if let Some(e) = error {
                entry.error = e.to_string();
            }
        }
        // Plain HTTP: the rest of the body, then the answer; nothing more
        // of the client's is read.
        // Ended when it has been quiet too long, as a tunnel is.
        (true, Some(left)) => {
            let activity = Activity::default();
            let mut client = Watched::new(&mut client, &activity);
            let mut upstream = Watched::new(&mut upstream, &activity);
            let (mut body, mut answer) = (0, 0);
            let copied = activity
                .bounded(async {
                    body = tokio::io::copy(&mut (&mut client).take(left), &mut upstream).await?;
                    answer = tokio::io::copy(&mut upstream, &mut client).await?;
                    Ok::<_, std::io::Error>(())
                })
                .await;
            entry.sent = sent + body;
            entry.received = answer;
            if let Some(e) = copied.and_then(|r| r).err() {
                entry.error = e.to_string();
            }
        }
    }
    finish(entry);
}

/// Hold a connection to an unlisted destination (mode `ask`) until the
/// policy admits it (a change, or an `allow --once` for the connections
/// waiting then), refuses it for another reason, or the time is up.
async fn wait_for_person(
    ctx: &Context,
    ask: &Ask,
    found: &[IpAddr],
    own: &[IpAddr],
    once: Option<String>,
) -> (Decision, Vec<IpAddr>) {
    let refused = |rule: &str, reason: String| {
        (
            Decision {
                allowed: false,
                rule: rule.to_owned(),
                reason,
                suggest: None,
            },
            Vec::new(),
        )
    };
    let admits = once.unwrap_or_default();
    let command = if admits.is_empty() {
        String::new()
    } else {
        hint::command(&ctx.name, &admits, true)
    };
    let Some(waiting) = ctx
        .pending
        .add((ask.protocol, &ask.host, ask.port), (admits, command))
    else {
        return refused(
            "ask",
            format!(
                "{} connections already wait for an answer",
                super::ask::WAITING_MAX
            ),
        );
    };
    (ctx.asked)(&waiting);
    let id = waiting.id;
    let deadline = tokio::time::Instant::now() + ctx.ask_timeout;
    let outcome = loop {
        let changed = ctx.pending.changed();
        let Some(policy) = (ctx.policy)() else {
            break refused("ask", "the sandbox stopped".to_owned());
        };
        let policy = ctx
            .pending
            .once_rules(id)
            .into_iter()
            .fold(policy, |p, r| p.with(r));
        let (d, a) = policy.decide(&ask.host, ask.port, found, own);
        if !policy.may_ask(&d) {
            break (d, a);
        }
        tokio::select! {
            () = changed => {}
            () = tokio::time::sleep_until(deadline) => break refused(
                "ask",
                format!(
                    "nobody allowed {}:{} within {} s",
                    ask.host,
                    ask.port,
                    ctx.ask_timeout.as_secs()
                ),
            ),
        }
    };
    ctx.pending.remove(id);
    outcome
}

async fn dial(addrs: &[IpAddr], port: u16) -> Result<(TcpStream, SocketAddr), GatewayError> {
    let mut last = GatewayError::NoAddress;
    for ip in addrs {
        let to = SocketAddr::new(*ip, port);
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(to)).await {
            Ok(Ok(s)) => return Ok((s, to)),
            Ok(Err(error)) => last = GatewayError::Connect { to, error },
            Err(_) => last = GatewayError::ConnectTimeout { to },
        }
    }
    Err(last)
}

/// Refuse the client: a `403` whose body says why and gives `command`, the
/// one that admits the connection (if any); SOCKS has no room for either.
async fn refuse(client: &mut impl Socket, d: &Decision, command: &str, socks: bool) {
    if socks {
        let _ = client.write_all(&socks_reply(2)).await;
        return;
    }
    let mut body = format!(
        "Keystone Agent refused this connection: {} (rule: {}).\n",
        d.reason, d.rule,
    );
    // The command holds only what an entry may (hint::command).
    if !command.is_empty() {
        body.push_str(&format!("To allow it, run on the host:\n\n    {command}\n"));
    }
    let _ = respond(client, "403 Forbidden", &body).await;
}

async fn respond(client: &mut impl Socket, status: &str, body: &str) -> std::io::Result<()> {
    let msg = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    client.write_all(msg.as_bytes()).await?;
    client.shutdown().await
}

//! How a Pod's connections reach agentd's egress gateway.
//!
//! The Pod's NetworkPolicy lets nothing out, and a cluster gives a Pod no
//! way to call agentd, which may not even have an address the Pod could
//! route to. agentd can only come in, through the API server's
//! port-forward, so each connection is turned around: the relay
//! (`keystone-relay`, copied in with the tools) listens on the gateway's
//! address in the Pod, [`crate::egress::GATEWAY_ADDR`], and prints a
//! newline for each client; agentd answers each newline with a
//! port-forward to the relay's [`BACK_PORT`], which the relay joins to
//! its oldest waiting client, and hands its end to the sandbox's gateway
//! as one more client ([`crate::egress::Socket::Handed`]).
//!
//! Nothing the Pod says is trusted: only newlines count, at most
//! [`OPENING_MAX`] port-forwards are being opened at once and
//! [`OPEN_RATE`] a second (the gateway's
//! own bound, [`crate::egress::gateway::CONNECTIONS_MAX`], holds for the
//! ones it serves), and whatever comes through a port-forward is one more
//! client of this sandbox, decided by its policy. Which sandbox a
//! connection belongs to is never in question: it came out of its Pod.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, AttachedProcess};
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;

use super::{KubeBackend, KubeError, TOOLS, exec, manifest};
use crate::backend::SandboxSpec;

/// The relay's port for agentd's port-forwards, on the Pod's loopback.
pub const BACK_PORT: u16 = 3129;

/// Whether `port` on the Pod's loopback is the relay's.
#[must_use]
pub fn is_relay_port(port: u16) -> bool {
    port == BACK_PORT || port == crate::egress::GATEWAY_ADDR.port()
}

/// The relay inside the Pod.
pub const RELAY: &str = "bin/keystone-relay";

/// Port-forwards being opened at once for one sandbox.
const OPENING_MAX: usize = 32;

/// Newlines kept to answer: as many clients as the relay keeps waiting.
const OWED_MAX: usize = 256;

/// Port-forwards opened per second for one sandbox, and the burst: each is
/// a WebSocket upgrade at the API server (and the kubelet) with agentd's
/// credentials, which every sandbox shares.
const OPEN_RATE: f64 = 50.0;
const OPEN_BURST: f64 = 50.0;

/// How long the relay may take to say it is ready.
const READY: Duration = Duration::from_secs(20);

/// The longest pause before a relay that ended is started again.
const RESTART_MAX: Duration = Duration::from_secs(30);

/// The relay's shell: it ends a relay an earlier agentd left running (an
/// exec's process outlives its connection on some runtimes), whose pid it
/// wrote, and becomes the new one.
const RELAY_SCRIPT: &str = r#"p=
read -r p < "$1/relay.pid" 2>/dev/null
case $p in ''|*[!0-9]*) ;; *) kill "$p" 2>/dev/null ;; esac
echo $$ > "$1/relay.pid"
exec "$1/$2" "$3" "$4""#;

/// A relay running in a Pod: its exec and what it prints.
pub(super) struct Relay {
    _exec: AttachedProcess,
    out: Box<dyn tokio::io::AsyncRead + Unpin + Send>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").finish_non_exhaustive()
    }
}

/// Where a sandbox's relay runs.
#[derive(Clone)]
struct Target {
    client: kube::Client,
    namespace: String,
    pod: String,
}

impl Target {
    /// Start the relay and wait for its `ready`.
    async fn relay(&self) -> Result<Relay, KubeError> {
        let port = crate::egress::GATEWAY_ADDR.port().to_string();
        let argv = [
            "sh",
            "-c",
            RELAY_SCRIPT,
            "relay",
            TOOLS,
            RELAY,
            &port,
            &BACK_PORT.to_string(),
        ]
        .map(str::to_owned)
        .to_vec();
        let api = Api::<Pod>::namespaced(self.client.clone(), &self.namespace);
        let mut p = exec::attach(&api, &self.namespace, &self.pod, argv, false, false).await?;
        let (_status, mut out) = exec::status_and_stdout(&mut p)?;
        let mut err = p
            .stderr()
            .ok_or_else(|| KubeError::Exec("no stderr".to_owned()))?;
        // Byte by byte, so that no newline after it is taken for a
        // connection twice or lost.
        let ready = async {
            let mut line = Vec::new();
            let mut b = [0u8; 1];
            while line.len() < 64 {
                match out.read(&mut b).await {
                    Ok(1) if b[0] == b'\n' => return line == b"ready",
                    Ok(1) => line.push(b[0]),
                    _ => return false,
                }
            }
            false
        };
        match tokio::time::timeout(READY, ready).await {
            Ok(true) => {
                exec::discard(err);
                Ok(Relay {
                    _exec: p,
                    out: Box::new(out),
                })
            }
            Ok(false) => {
                let said = tokio::time::timeout(Duration::from_secs(2), exec::kept(&mut err))
                    .await
                    .unwrap_or_default();
                Err(KubeError::Relay(
                    crate::text::clamp_text(String::from_utf8_lossy(&said).trim()).into_owned(),
                ))
            }
            Err(_) => Err(KubeError::Relay(format!(
                "not ready within {}s",
                READY.as_secs()
            ))),
        }
    }
}

impl KubeBackend {
    /// The relay copied into each Pod with a network: beside agentd.
    pub(super) fn relay_binary(&self) -> std::path::PathBuf {
        self.settings.exe.with_file_name("keystone-relay")
    }

    /// Start `spec`'s relay, before anything of the sandbox runs, so that
    /// its first command finds the gateway; [`Self::gateway_socket`]
    /// takes it over.
    pub(super) async fn start_relay(&self, spec: &SandboxSpec) -> Result<(), KubeError> {
        if spec.config.network == keystone_agent_api::Network::None {
            return Ok(());
        }
        let relay = self.target(spec).await?.relay().await?;
        self.relays.lock().unwrap().insert(spec.name.clone(), relay);
        Ok(())
    }

    /// Forget a relay that no gateway took (the sandbox stopped first).
    pub(super) fn drop_relay(&self, spec: &SandboxSpec) {
        self.relays.lock().unwrap().remove(&spec.name);
    }

    async fn target(&self, spec: &SandboxSpec) -> Result<Target, KubeError> {
        let c = self.connected().await?;
        Ok(Target {
            client: c.client.clone(),
            namespace: self.ns().to_owned(),
            pod: manifest::object_name(&spec.name),
        })
    }

    /// The connections of `spec`'s Pod to its gateway, for as long as the
    /// gateway takes them (the receiver kept); `None` without a network.
    pub(super) async fn gateway_socket(
        &self,
        spec: &SandboxSpec,
    ) -> Result<Option<crate::egress::Socket>, KubeError> {
        if spec.config.network == keystone_agent_api::Network::None {
            return Ok(None);
        }
        let target = self.target(spec).await?;
        // The relay of this start, or after agentd's restart a new one.
        let taken = self.relays.lock().unwrap().remove(&spec.name);
        let relay = match taken {
            Some(r) => r,
            None => target.relay().await?,
        };
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(tunnel(target, relay, tx, spec.name.clone()));
        Ok(Some(crate::egress::Socket::Handed(rx)))
    }
}

/// One connection back from the relay, handed to the gateway.
async fn connect(
    target: Target,
    tx: mpsc::Sender<tokio::net::UnixStream>,
    _permit: tokio::sync::OwnedSemaphorePermit,
) {
    let opened =
        super::portforward::forward(&target.client, &target.namespace, &target.pod, BACK_PORT)
            .await;

    let stream = opened.and_then(|fd| {
        let s = std::os::unix::net::UnixStream::from(fd);
        s.set_nonblocking(true)
            .and_then(|()| tokio::net::UnixStream::from_std(s))
            .map_err(KubeError::Io)
    });
    match stream {
        Ok(s) => {
            let _ = tx.send(s).await;
        }
        Err(e) => {
            tracing::debug!(pod = %target.pod, error = %e, "egress: no connection back from the relay");
        }
    }
}

/// Port-forwards to open, as a token bucket: [`OPEN_RATE`] a second,
/// [`OPEN_BURST`] at most at once.
struct Rate {
    tokens: f64,
    at: tokio::time::Instant,
}

impl Rate {
    fn new() -> Self {
        Self {
            tokens: OPEN_BURST,
            at: tokio::time::Instant::now(),
        }
    }

    /// Refill for the time gone by; how long until the next token when
    /// there is none.
    fn refill(&mut self) -> Option<Duration> {
        let now = tokio::time::Instant::now();
        self.tokens = (self.tokens + (now - self.at).as_secs_f64() * OPEN_RATE).min(OPEN_BURST);
        self.at = now;
        (self.tokens < 1.0).then(|| Duration::from_secs_f64((1.0 - self.tokens) / OPEN_RATE))
    }
}

/// Answer `relay`'s newlines with connections for the gateway behind
/// `tx`, starting the relay again if it ends, until the gateway is gone.
async fn tunnel(
    target: Target,
    relay: Relay,
    tx: mpsc::Sender<tokio::net::UnixStream>,
    sandbox: String,
) {
    let opening = std::sync::Arc::new(tokio::sync::Semaphore::new(OPENING_MAX));
    let mut relay = Some(relay);
    let mut pause = Duration::from_secs(1);
    loop {
        let current = match relay.take() {
            Some(r) => Ok(r),
            None => target.relay().await,
        };
        let started = tokio::time::Instant::now();
        match current {
            Ok(mut r) => {
                if answer(&mut r, &target, &tx, &opening).await.is_none() {
                    return;
                }
                tracing::info!(sandbox = %sandbox, "egress: the relay in the Pod ended");
            }
            Err(e) => {
                tracing::warn!(sandbox = %sandbox, error = %e, "egress: cannot start the relay in the Pod");
            }
        }
        if started.elapsed() > RESTART_MAX {
            pause = Duration::from_secs(1);
        }
        tokio::select! {
            () = tx.closed() => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(RESTART_MAX);
    }
}

/// Answer relay `r`'s newlines until it ends (`Some`) or the gateway is
/// gone (`None`).
async fn answer(
    r: &mut Relay,
    target: &Target,
    tx: &mpsc::Sender<tokio::net::UnixStream>,
    opening: &std::sync::Arc<tokio::sync::Semaphore>,
) -> Option<()> {
    let mut buf = [0u8; 4096];
    // Newlines not answered yet (no more than the relay keeps clients
    // waiting).
    let mut owed = 0usize;
    let mut rate = Rate::new();
    loop {
        let empty = rate.refill();
        tokio::select! {
            () = tx.closed() => return None,
            n = r.out.read(&mut buf) => match n {
                Ok(n) if n > 0 => {
                    let asked = buf[..n].iter().filter(|b| **b == b'\n').count();
                    owed = (owed + asked).min(OWED_MAX);
                }
                _ => return Some(()),
            },
            Ok(permit) = std::sync::Arc::clone(opening).acquire_owned(), if owed > 0 && empty.is_none() => {
                owed -= 1;
                rate.tokens -= 1.0;
                tokio::spawn(connect(target.clone(), tx.clone(), permit));
            }
            () = tokio::time::sleep(empty.unwrap_or_default()), if owed > 0 && empty.is_some() => {}
        }
    }
}

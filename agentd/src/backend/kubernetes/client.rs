//! The client of the API server: kube's own stack, but with `TCP_NODELAY`
//! on its connections.
//!
//! Everything a sandbox exchanges with agentd (terminal keystrokes, the
//! egress gateway's answers, streamed API responses) crosses a WebSocket to
//! the API server as small writes. kube's connector leaves Nagle's
//! algorithm on, so a small write that follows one not yet acknowledged
//! waits for the peer's delayed ACK: 40 ms on Linux, on every HTTP
//! response written in two parts (`tests/bench/kubernetes.py` showed it).
//! Through a proxy (the kubeconfig's `proxy-url`) kube's stack is used as
//! it is.

use hyper_util::client::legacy::connect::HttpConnector;
use kube::client::ConfigExt;
use tower::{BoxError, ServiceBuilder};

/// A client for `config`.
pub(super) fn client(config: kube::Config) -> Result<kube::Client, kube::Error> {
    if config.proxy_url.is_some() {
        return kube::Client::try_from(config);
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(config.connect_timeout);
    let https = config.rustls_https_connector_with_connector(http)?;
    let mut connector = hyper_timeout::TimeoutConnector::new(https);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    let hyper = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(hyper);
    Ok(kube::Client::new(service, config.default_namespace))
}

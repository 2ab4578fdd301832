//! The fake API server on its own, for benchmarks and by-hand runs:
//! `fake-kube KUBECONFIG-DIR [NAMESPACE]` writes `KUBECONFIG-DIR/kubeconfig`,
//! prints `ready <url>` and serves until killed.

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next() else {
        eprintln!("usage: fake-kube KUBECONFIG-DIR [NAMESPACE]");
        std::process::exit(2);
    };
    let namespace = args.next().unwrap_or_else(|| "agent-sandboxes".to_owned());
    let fake = fake_kube::FakeKube::start().await;
    let path = fake.kubeconfig(std::path::Path::new(&dir), &namespace);
    println!("ready {} {}", fake.url(), path.display());
    // SIGINT or SIGTERM: the Pods' containers end with it.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    drop(fake);
}

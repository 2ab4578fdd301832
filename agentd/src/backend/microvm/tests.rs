use super::*;

fn spec(name: &str, network: keystone_agent_api::Network) -> SandboxSpec {
    SandboxSpec {
        name: name.into(),
        uid: 0,
        gid: 0,
        workspace: PathBuf::from("/state/sandboxes")
            .join(name)
            .join("workspace"),
        home: PathBuf::new(),
        run_dir: PathBuf::new(),
        log_dir: PathBuf::new(),
        config: keystone_agent_api::SandboxConfig {
            network,
            ..Default::default()
        },
        agent_home: None,
        owner: 0,
        id: String::new(),
    }
}

#[test]
fn guests_are_reached_at_their_address_or_over_vsock() {
    let b = MicrovmBackend::new(MicrovmSettings {
        systemd_bus: "system".into(),
        ssh_user: "agent".into(),
        ssh_port: 22,
        ssh_host: None,
        subnet: crate::naming::DEFAULT_SUBNET.into(),
        start_timeout: Duration::from_secs(1),
        state_dir: PathBuf::from("/state"),
        gateway: "10.231.0.1:3128".parse().unwrap(),
    });
    let names = crate::naming::derive("demo", crate::naming::DEFAULT_SUBNET).unwrap();
    let nat = b
        .target(&spec("demo", keystone_agent_api::Network::Nat))
        .unwrap();
    assert_eq!(nat.host, names.address);
    assert_eq!(nat.proxy_command, None);
    assert_eq!(
        nat.key,
        PathBuf::from("/state/sandboxes/demo/client/id_ed25519")
    );
    let none = b
        .target(&spec("demo", keystone_agent_api::Network::None))
        .unwrap();
    assert_eq!(
        none.proxy_command.as_deref(),
        Some(format!("socat - VSOCK-CONNECT:{}:22", names.cid).as_str())
    );
    let args: Vec<String> = none
        .std_command()
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    assert!(
        args.contains(&"StrictHostKeyChecking=yes".to_owned()),
        "{args:?}"
    );
    assert!(
        args.iter().any(|a| a.starts_with("ProxyCommand=socat")),
        "{args:?}"
    );

    // The gateway: shared at the bridge address, this guest's
    // connections told by its address; none without a network.
    for network in [
        keystone_agent_api::Network::Nat,
        keystone_agent_api::Network::Bridge,
    ] {
        match b.gateway_socket(&spec("demo", network)).unwrap() {
            Some(crate::egress::Socket::Shared { listen, source }) => {
                assert_eq!(listen.to_string(), "10.231.0.1:3128");
                assert_eq!(source.to_string(), names.address);
            }
            other => panic!("{network}: {other:?}"),
        }
    }
    assert!(
        b.gateway_socket(&spec("demo", keystone_agent_api::Network::None))
            .unwrap()
            .is_none()
    );
}

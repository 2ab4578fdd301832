//! Tests of agentd's configuration: parsing, defaults, validation.

use super::*;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/agentd-config.json")
}

#[test]
fn fixture_loads_and_round_trips() {
    let c = DaemonConfig::load(&fixture()).unwrap();
    assert_eq!(c.sandboxes.len(), 2);
    let web = &c.sandboxes["webapp"];
    assert_eq!(web.config(&c.defaults).memory, 4096);
    assert_eq!(web.ports["web"], 3000);
    let again: DaemonConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
    assert_eq!(again, c);
}

/// What the NixOS module renders for its fixture (tests/nix/check.sh
/// holds the module to this file) is a configuration agentd takes,
/// every field of it: the module and agentd name the same settings.
#[test]
fn the_nixos_modules_rendering_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/nix/nix-config.expected.json");
    let c = DaemonConfig::load(&path).unwrap();
    let api = c.sandboxes["api"].config(&c.defaults);
    assert_eq!(
        api.git_identity.to_string(),
        "Agent of api <agent@api.example.com>"
    );
    assert!(c.defaults.git_identity.is_owner());
}

#[test]
fn caddy_admin_is_http_or_an_absolute_unix_socket() {
    let admin = |a: &str| {
        let c: DaemonConfig =
            serde_json::from_value(serde_json::json!({"proxy": {"caddy_admin": a}})).unwrap();
        c.validate()
    };
    assert!(admin("http://127.0.0.1:2019").is_empty());
    assert!(admin("unix//run/caddy/admin.sock").is_empty());
    for bad in ["unix/run/admin.sock", "127.0.0.1:2019", "https://x"] {
        let p = admin(bad);
        assert!(
            p.iter().any(|m| m.contains("unix//ABSOLUTE/PATH")),
            "{bad}: {p:?}"
        );
    }
}

#[test]
fn empty_config_is_valid() {
    let c: DaemonConfig = serde_json::from_str("{}").unwrap();
    assert!(c.validate().is_empty(), "{:?}", c.validate());
    assert_eq!(c.defaults, SandboxConfig::default());
}

#[test]
fn unknown_fields_are_refused_with_their_name() {
    let e = serde_json::from_str::<DaemonConfig>(
        r#"{"sandboxes": {"a": {"project": "/x", "owner": "root", "memroy": 1}}}"#,
    )
    .unwrap_err();
    assert!(e.to_string().contains("memroy"), "{e}");
}

#[test]
fn the_microvm_gateway_defaults_to_the_bridge_address() {
    let mut m = MicrovmConfig::default();
    assert_eq!(m.gateway().unwrap().to_string(), "10.231.0.1:3128");
    m.subnet = "10.77.0.0/16".into();
    assert_eq!(m.gateway().unwrap().to_string(), "10.77.0.1:3128");
    m.gateway_listen = Some("127.0.0.1:4128".into());
    assert_eq!(m.gateway().unwrap().to_string(), "127.0.0.1:4128");
    for bad in [
        "[::1]:3128",
        "10.77.0.1",
        "10.77.0.1:0",
        "0.0.0.0:3128",
        "bridge:3128",
    ] {
        let c = DaemonConfig {
            microvm: MicrovmConfig {
                gateway_listen: Some(bad.into()),
                ..MicrovmConfig::default()
            },
            ..DaemonConfig::default()
        };
        assert_eq!(
            c.validate(),
            [format!(
                "microvm.gateway_listen '{bad}' must be an IPv4 address and a port other \
                 than 0, like 10.231.0.1:3128"
            )],
        );
    }
}

#[test]
fn every_problem_is_listed() {
    let c: DaemonConfig = serde_json::from_str(
        r#"{"state_dir": "rel", "defaults": {"memory": 10},
            "vm": {"image": "images/debian", "home_size_mib": 16},
            "sandboxes": {"Bad_Name": {"project": "rel", "owner": "no-such-user-xyz", "vcpus": 0}}}"#,
    )
    .unwrap();
    let p = c.validate();
    assert_eq!(p.len(), 9, "{p:#?}");
    assert!(p.contains(&"vm.image must be an absolute path".to_owned()));
    assert!(
        p.iter()
            .any(|m| m.starts_with("vm.home_size_mib 16 is too small"))
    );
    assert!(
        p.iter()
            .any(|m| m.starts_with("sandboxes.Bad_Name: owner 'no-such-user-xyz'"))
    );
}

#[test]
fn the_console_listens_only_on_an_ipv4_loopback_address() {
    let problems = |listen: &str| {
        ConsoleConfig {
            enable: true,
            listen: listen.to_owned(),
            host: String::new(),
        }
        .problems("sandbox.local")
    };
    assert!(problems("127.0.0.1:0").is_empty());
    assert!(problems("127.0.0.1:8443").is_empty());
    assert!(problems("127.5.6.7:0").is_empty());
    for (listen, says) in [
        ("0.0.0.0:8080", "is not an IPv4 loopback address"),
        ("192.168.1.5:80", "is not an IPv4 loopback address"),
        ("[::1]:0", "is not an IPv4 loopback address"),
        ("localhost:0", "is not an address and port"),
        ("127.0.0.1", "is not an address and port"),
        ("", "is not an address and port"),
    ] {
        let p = problems(listen);
        assert!(p.len() == 1 && p[0].contains(says), "{listen}: {p:?}");
    }
    // Through the whole configuration, as --check-config shows it.
    let c: DaemonConfig = serde_json::from_str(r#"{"console": {"listen": "0.0.0.0:9"}}"#).unwrap();
    assert!(
        c.validate()
            .iter()
            .any(|m| m.starts_with("console.listen 0.0.0.0:9")),
        "{:?}",
        c.validate()
    );
}

#[test]
fn the_console_is_never_named_on_the_links_site() {
    let problems = |host: &str, links: &str| {
        ConsoleConfig {
            host: host.to_owned(),
            ..ConsoleConfig::default()
        }
        .problems(links)
    };
    for (host, links) in [
        ("console.keystone.internal", "sandbox.local"),
        ("console.keystone.internal", "sandbox.localhost"),
        ("console.example.com", "sandbox.example.org"),
        ("", "localhost"),
    ] {
        assert!(problems(host, links).is_empty(), "{host} beside {links}");
    }
    for (host, links, says) in [
        // Under the links' domain, or the domain itself.
        (
            "console.sandbox.local",
            "sandbox.local",
            "may be the same site",
        ),
        ("sandbox.local", "sandbox.local", "may be the same site"),
        // Beside it on one site: `x.sandbox.local` and `console.local`
        // share nothing of `sandbox.local`, but `a.b.example.com` links
        // and `console.example.com` share `example.com`.
        (
            "console.example.com",
            "links.example.com",
            "may be the same site",
        ),
        // A one-label domain: every sandbox is a site of its own, so a
        // console under that label may share one with a sandbox
        // named like its second label.
        (
            "console.keystone.internal",
            "internal",
            "may be the same site",
        ),
        // Secure cookies reach http://NAME:ANY-PORT under .localhost.
        (
            "console.keystone.localhost",
            "sandbox.local",
            "is under .localhost",
        ),
        ("localhost", "sandbox.local", "is under .localhost"),
        (
            "Console.Example",
            "sandbox.local",
            "not a lowercase DNS name",
        ),
        (
            "con sole.example",
            "sandbox.local",
            "not a lowercase DNS name",
        ),
    ] {
        let p = problems(host, links);
        assert!(
            p.len() == 1 && p[0].contains(says),
            "{host} beside {links}: {p:?}"
        );
    }
    // The default is of a site of its own beside the default links.
    assert!(DaemonConfig::default().validate().is_empty());
}

//! `agentd --doctor`: what this machine has of what agentd and each backend
//! need, and the command that fixes each missing piece. It changes nothing
//! (no cgroup is made, nothing is downloaded); `agentctl doctor` runs it
//! and adds what it sees of the bus.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::config::DaemonConfig;
use keystone_agent_api::BackendKind;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// There and usable.
    Ok,
    /// Missing or degraded, but nothing configured needs it (another
    /// backend's piece), or agentd copes without it (it runs sandboxes
    /// without limits, it downloads the toolbox itself).
    Warn,
    /// Missing, and what agentd is configured to do needs it.
    Missing,
}

/// One check.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What needs it: `agentd`, `local`, `sessions`, `links`, `vm`,
    /// `kubernetes`, `agents`.
    pub area: &'static str,
    /// What was checked.
    pub check: String,
    /// How it came out.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// The command (or setting) that fixes it; empty when it is ok.
    pub fix: String,
}

impl Check {
    fn new(area: &'static str, check: &str, status: Status, detail: impl Into<String>) -> Self {
        Self {
            area,
            check: check.to_owned(),
            status,
            detail: detail.into(),
            fix: String::new(),
        }
    }

    fn fix(mut self, fix: impl Into<String>) -> Self {
        if self.status != Status::Ok {
            self.fix = fix.into();
        }
        self
    }
}

/// `Missing` when the piece is needed, else `Warn`.
fn needed(yes: bool) -> Status {
    if yes { Status::Missing } else { Status::Warn }
}

/// Run every check. `config` is the configuration file agentd would read
/// (None: the defaults); `system` whether agentd serves the system bus.
#[must_use]
pub fn run(config: Option<&Path>, system: bool) -> Vec<Check> {
    let mut checks = Vec::new();
    let config = match config {
        None => {
            checks.push(Check::new(
                "agentd",
                "configuration",
                Status::Ok,
                "no file: the defaults",
            ));
            DaemonConfig::default()
        }
        Some(p) => match DaemonConfig::load(p) {
            Ok(c) => {
                checks.push(Check::new(
                    "agentd",
                    "configuration",
                    Status::Ok,
                    p.display().to_string(),
                ));
                c
            }
            Err(e) => {
                checks.push(
                    Check::new("agentd", "configuration", Status::Missing, format!("{e:#}"))
                        .fix(format!("agentd --check-config {}", p.display())),
                );
                DaemonConfig::default()
            }
        },
    };
    let root = nix::unistd::Uid::effective().is_root();
    checks.extend(local(&config, root, system));
    checks.push(zellij(&config));
    checks.push(caddy(&config));
    checks.extend(vm(&config));
    checks.extend(kubernetes(&config));
    checks.push(agents(&config));
    checks
}

/// Whether this process may make a user namespace: a child tries.
fn user_namespaces() -> Result<(), String> {
    use nix::sys::wait::{WaitStatus, waitpid};
    use nix::unistd::{ForkResult, fork};
    // SAFETY: agentd --doctor is single-threaded when it gets here (no
    // runtime has started); the child only calls unshare and _exit.
    match unsafe { fork() } {
        Ok(ForkResult::Child) => {
            let code = match nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER) {
                Ok(()) => 0,
                Err(e) => e as i32,
            };
            // SAFETY: _exit is async-signal-safe and ends the child at once.
            unsafe { nix::libc::_exit(code) }
        }
        Ok(ForkResult::Parent { child }) => match waitpid(child, None) {
            Ok(WaitStatus::Exited(_, 0)) => Ok(()),
            Ok(WaitStatus::Exited(_, errno)) => Err(nix::Error::from_raw(errno).desc().to_owned()),
            other => Err(format!("the probe ended oddly: {other:?}")),
        },
        Err(e) => Err(format!("cannot fork: {e}")),
    }
}

fn sysctl(path: &str) -> Option<i64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn local(config: &DaemonConfig, root: bool, system: bool) -> Vec<Check> {
    let mut checks = Vec::new();
    let userns = match user_namespaces() {
        Ok(()) => Check::new("local", "user namespaces", Status::Ok, "available"),
        Err(e) => {
            let fix = if sysctl("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == Some(1)
            {
                "sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 (AppArmor forbids \
                 them; or run agentd as the system service)"
            } else if sysctl("/proc/sys/kernel/unprivileged_userns_clone") == Some(0) {
                "sudo sysctl -w kernel.unprivileged_userns_clone=1"
            } else if sysctl("/proc/sys/user/max_user_namespaces") == Some(0) {
                "sudo sysctl -w user.max_user_namespaces=15000"
            } else {
                "run agentd as root (the system service: sudo systemctl enable --now agentd)"
            };
            Check::new("local", "user namespaces", Status::Missing, e).fix(fix)
        }
    };
    checks.push(userns);
    if !root {
        let ids = match crate::subid::pool() {
            Ok(p) => Check::new(
                "local",
                "subordinate ids",
                Status::Ok,
                format!(
                    "uids {}-{} for sandboxes",
                    p.uid_start,
                    p.uid_start + p.count - 1
                ),
            ),
            Err(e) => Check::new(
                "local",
                "subordinate ids",
                Status::Warn,
                format!("{e}: sandboxes run as you, not as uids of their own"),
            )
            .fix(
                "sudo apt-get install -y uidmap && sudo usermod --add-subuids 100000-165535 \
                 --add-subgids 100000-165535 \"$USER\"",
            ),
        };
        checks.push(ids);
    }
    let state = crate::state_dir(
        &crate::Options {
            bus: if system {
                crate::dbus::Bus::System
            } else {
                crate::dbus::Bus::Session
            },
            config: None,
            state_dir: None,
            zellij: None,
        },
        config,
    );
    for (name, found) in crate::cgroup::Cgroups::inspect(&state) {
        let check = format!("cgroup {name} controller");
        checks.push(match found {
            Ok(()) => Check::new("local", &check, Status::Ok, "usable"),
            Err(e) => Check::new(
                "local",
                &check,
                Status::Warn,
                format!("{e}: sandboxes get no {name} limit"),
            )
            .fix(if system {
                "run agentd as the system service (its unit has Delegate=yes): sudo systemctl \
                 enable --now agentd"
            } else {
                "run agentd as the user service (its unit has Delegate=yes): systemctl --user \
                 enable --now agentd"
            }),
        });
    }
    checks
}

fn zellij(config: &DaemonConfig) -> Check {
    let configured = std::env::var_os("KEYSTONE_ZELLIJ")
        .map(PathBuf::from)
        .or_else(|| config.local.zellij.clone());
    match crate::tools::find_zellij_or_build(configured.as_deref()) {
        Ok(p) => Check::new("sessions", "Zellij", Status::Ok, p.display().to_string()),
        Err(e @ crate::tools::ZellijError::Building { .. }) => {
            Check::new("sessions", "Zellij", Status::Warn, e.to_string())
        }
        Err(e) => {
            let root = crate::tools::cache_dir().map_or_else(
                || "~/.cache/keystone-agent".to_owned(),
                |c| c.display().to_string(),
            );
            Check::new(
                "sessions",
                "Zellij",
                Status::Missing,
                format!("{e} (agentctl attach needs it)"),
            )
            .fix(format!(
                "cargo install --locked --no-default-features --features \
                 plugins_from_target,vendored_curl --config profile.release.lto=false \
                 --config profile.release.codegen-units=16 --root {root}/zellij-{v} zellij@{v} \
                 (10 to 20 minutes), then restart agentd",
                v = crate::tools::ZELLIJ_PINNED
            ))
        }
    }
}

fn caddy(config: &DaemonConfig) -> Check {
    let on_path = crate::backend::vm::qemu::find_program(&["caddy".into()]);
    if !config.proxy.enable {
        return match on_path {
            Some(p) => Check::new(
                "links",
                "Caddy",
                Status::Ok,
                format!("{} (links are off: set proxy.enable)", p.display()),
            ),
            None => Check::new(
                "links",
                "Caddy",
                Status::Warn,
                "not installed; dev-server links are off",
            )
            .fix("sudo apt-get install -y caddy, then set \"proxy\": {\"enable\": true}"),
        };
    }
    let admin = config
        .proxy
        .caddy_admin
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    let reachable = match crate::config::caddy_admin_socket(&config.proxy.caddy_admin) {
        Some(socket) => std::os::unix::net::UnixStream::connect(socket).is_ok(),
        None => std::net::ToSocketAddrs::to_socket_addrs(&admin)
            .ok()
            .and_then(|mut a| a.next())
            .is_some_and(|a| {
                std::net::TcpStream::connect_timeout(&a, std::time::Duration::from_secs(2)).is_ok()
            }),
    };
    let on_tcp = crate::config::caddy_admin_socket(&config.proxy.caddy_admin).is_none();
    if reachable && on_tcp {
        // agentd keeps web pages out (Caddy's Origin check), not local users.
        Check::new(
            "links",
            "Caddy",
            Status::Warn,
            format!("admin API on TCP {admin}: every local user can read the links' tokens and reconfigure Caddy"),
        )
        .fix("give Caddy `admin unix//run/caddy/admin.sock` (in a 0700 directory) and set proxy.caddy_admin to \"unix//run/caddy/admin.sock\"")
    } else if reachable {
        Check::new(
            "links",
            "Caddy",
            Status::Ok,
            format!("admin API on {admin}"),
        )
    } else {
        Check::new(
            "links",
            "Caddy",
            Status::Missing,
            format!("nothing answers on Caddy's admin API ({admin}); proxy.enable is set"),
        )
        .fix(if !on_tcp {
            "give Caddy the same admin address (Caddyfile global option `admin unix//run/caddy/admin.sock`, or `\"admin\": {\"listen\": \"unix//run/caddy/admin.sock\"}` in JSON) and start it: sudo systemctl enable --now caddy"
        } else if on_path.is_some() {
            "sudo systemctl enable --now caddy"
        } else {
            "sudo apt-get install -y caddy && sudo systemctl enable --now caddy"
        })
    }
}

fn vm(config: &DaemonConfig) -> Vec<Check> {
    use crate::backend::vm::qemu::find_program;
    let wanted = config.default_backend == Some(BackendKind::Vm) || config.vm.image.is_some();
    let mut checks = Vec::new();
    checks.push(
        match find_program(std::slice::from_ref(&config.vm.qemu)) {
            Some(p) => Check::new("vm", "QEMU", Status::Ok, p.display().to_string()),
            None => Check::new(
                "vm",
                "QEMU",
                needed(wanted),
                format!(
                    "no {} (the vm backend boots guests with it)",
                    config.vm.qemu.display()
                ),
            ),
        }
        .fix("sudo apt-get install -y qemu-system-x86"),
    );
    checks.push(
        match find_program(&["qemu-img".into()]) {
            Some(p) => Check::new("vm", "qemu-img", Status::Ok, p.display().to_string()),
            None => Check::new(
                "vm",
                "qemu-img",
                Status::Warn,
                "no qemu-img: forks and restores of a snapshot copy its disks instead of \
                 sharing them (overlays)",
            ),
        }
        .fix("sudo apt-get install -y qemu-utils"),
    );
    let kvm = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm");
    checks.push(match kvm {
        Ok(_) => Check::new(
            "vm",
            "KVM",
            Status::Ok,
            "/dev/kvm opens (with accel auto, a test boot at the first vm start decides; TCG otherwise)",
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Check::new(
            "vm",
            "KVM",
            Status::Warn,
            "no /dev/kvm: guests run under TCG (emulated, several times slower)",
        )
        .fix("enable virtualization in the firmware, or nested virtualization in the host VM, then sudo modprobe kvm_intel (or kvm_amd)"),
        Err(e) => Check::new(
            "vm",
            "KVM",
            Status::Warn,
            format!("/dev/kvm: {e}: guests run under TCG (emulated, several times slower)"),
        )
        .fix("sudo usermod -aG kvm \"$USER\" (then log in again)"),
    });
    checks.push(
        match &config.vm.image {
            Some(dir) => {
                let absent: Vec<&str> = ["vmlinux", "initrd", "rootfs.img"]
                    .into_iter()
                    .filter(|f| !dir.join(f).is_file())
                    .collect();
                if absent.is_empty() {
                    Check::new("vm", "guest image", Status::Ok, dir.display().to_string())
                } else {
                    Check::new(
                        "vm",
                        "guest image",
                        Status::Missing,
                        format!("{} lacks {}", dir.display(), absent.join(", ")),
                    )
                }
            }
            None => Check::new("vm", "guest image", needed(wanted), "vm.image is not set"),
        }
        .fix(
            "build it from the source tree with sudo guest-image/debian/build.sh and set \
         \"vm\": {\"image\": DIR} in agentd's configuration (docs/guest-image.md)",
        ),
    );
    checks
}

fn kubernetes(config: &DaemonConfig) -> Vec<Check> {
    let k = &config.kubernetes;
    let wanted = config.default_backend == Some(BackendKind::Kubernetes) || k.kubeconfig.is_some();
    if !wanted {
        return Vec::new();
    }
    let kubeconfig = k
        .kubeconfig
        .clone()
        .or_else(|| std::env::var_os("KUBECONFIG").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".kube/config")));
    let mut checks = vec![
        match &kubeconfig {
            Some(p) if std::fs::File::open(p).is_ok() => {
                Check::new("kubernetes", "kubeconfig", Status::Ok, p.display().to_string())
            }
            Some(p) => Check::new(
                "kubernetes",
                "kubeconfig",
                Status::Missing,
                format!("cannot read {}", p.display()),
            ),
            None => Check::new("kubernetes", "kubeconfig", Status::Missing, "none set"),
        }
        .fix("set \"kubernetes\": {\"kubeconfig\": FILE} in agentd's configuration (docs/kubernetes.md)"),
    ];
    checks.push(
        match &k.image {
            Some(i) => Check::new("kubernetes", "sandbox image", Status::Ok, i.clone()),
            None => Check::new(
                "kubernetes",
                "sandbox image",
                Status::Missing,
                "kubernetes.image is not set",
            ),
        }
        .fix("set \"kubernetes\": {\"image\": IMAGE} (docs/kubernetes.md)"),
    );
    checks
}

fn agents(config: &DaemonConfig) -> Check {
    match crate::toolbox::Toolbox::new(config.toolbox.clone(), crate::tools::cache_dir()) {
        None => Check::new(
            "agents",
            "agent toolbox",
            Status::Warn,
            "no cache directory (set HOME or KEYSTONE_CACHE_DIR)",
        ),
        Some(mut tb) => {
            tb.console = config.console.enable;
            let missing = tb.missing();
            if missing.is_empty() {
                Check::new("agents", "agent toolbox", Status::Ok, tb.describe())
            } else {
                Check::new(
                    "agents",
                    "agent toolbox",
                    Status::Warn,
                    format!(
                        "not downloaded yet: {} (agentd downloads them in the background when it starts)",
                        missing
                            .iter()
                            .map(|p| format!("{}@{}", p.name, p.version))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
                .fix("agentd --install-agents (about 420 MB, once)")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn links(admin: &str) -> DaemonConfig {
        let mut config = DaemonConfig::default();
        config.proxy.enable = true;
        config.proxy.caddy_admin = admin.to_owned();
        config
    }

    #[test]
    fn caddys_admin_api_on_a_port_is_a_warning_with_the_socket_as_fix() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let check = caddy(&links(&format!("http://127.0.0.1:{port}")));
        assert!(matches!(check.status, Status::Warn), "{check:?}");
        assert!(check.detail.contains("every local user"), "{check:?}");
        assert!(
            check.fix.contains("unix//run/caddy/admin.sock"),
            "{check:?}"
        );

        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("admin.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let check = caddy(&links(&format!("unix/{}", socket.display())));
        assert!(matches!(check.status, Status::Ok), "{check:?}");
        drop(_listener);
        std::fs::remove_file(&socket).unwrap();
        let check = caddy(&links(&format!("unix/{}", socket.display())));
        assert!(matches!(check.status, Status::Missing), "{check:?}");
        assert!(
            check.fix.contains("admin unix//run/caddy/admin.sock"),
            "{check:?}"
        );
    }
}

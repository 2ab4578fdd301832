//! A test double of systemd's D-Bus API: exactly what agentd's `microvm`
//! backend uses (docs/architecture.md, "The systemd contract"), on the
//! test's private bus.
//!
//! `StartUnit("microvm@NAME.service")` runs a stand-in guest: sshd on a
//! loopback port with the host key and `authorized_keys` agentd provisioned
//! for the sandbox, in a private mount namespace where the sandbox's
//! workspace is at `/workspace` and its `ssh/` share, read-only, at
//! `/var/lib/keystone-agent/ssh` (as the guest module mounts them). It listens on 127.0.0.1, or, given a
//! loopback subnet (`127.0.0.0/16`), on the guest's own address derived
//! from it, as a real guest does on the bridge. `microvm@quickfail.service`
//! fails before StartUnit returns; `microvm@broken.service`
//! fails to start; `microvm@stuck.service` refuses to stop.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use zbus::zvariant::{ObjectPath, OwnedObjectPath};
use zbus::{Connection, interface};

struct Unit {
    active: String,
    sub: String,
}

#[interface(name = "org.freedesktop.systemd1.Unit")]
impl Unit {
    #[zbus(property)]
    fn active_state(&self) -> String {
        self.active.clone()
    }
    #[zbus(property)]
    fn sub_state(&self) -> String {
        self.sub.clone()
    }
}

struct Service {
    result: String,
}

#[interface(name = "org.freedesktop.systemd1.Service")]
impl Service {
    #[zbus(property)]
    fn result(&self) -> String {
        self.result.clone()
    }
}

struct Manager {
    state_dir: PathBuf,
    ssh_port: u16,
    /// Guests listen on their derived address in this subnet.
    subnet: Option<String>,
    guests: Arc<Mutex<HashMap<String, std::process::Child>>>,
    /// Every call, in order, for the test to check.
    pub calls: Arc<Mutex<Vec<String>>>,
}

fn unit_path(name: &str) -> OwnedObjectPath {
    let escaped: String = name
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("_{b:02x}")
            }
        })
        .collect();
    ObjectPath::try_from(format!("/org/freedesktop/systemd1/unit/{escaped}"))
        .unwrap()
        .into()
}

async fn set_state(conn: &Connection, name: &str, active: &str, sub: &str, result: &str) {
    let path = unit_path(name);
    let server = conn.object_server();
    if let Ok(iface) = server.interface::<_, Service>(&path).await {
        iface.get_mut().await.result = result.to_owned();
        let _ = iface
            .get()
            .await
            .result_changed(iface.signal_emitter())
            .await;
    }
    if let Ok(iface) = server.interface::<_, Unit>(&path).await {
        {
            let mut u = iface.get_mut().await;
            u.active = active.to_owned();
            u.sub = sub.to_owned();
        }
        let u = iface.get().await;
        let _ = u.active_state_changed(iface.signal_emitter()).await;
        let _ = u.sub_state_changed(iface.signal_emitter()).await;
    }
}

#[interface(name = "org.freedesktop.systemd1.Manager")]
impl Manager {
    fn subscribe(&self) {
        self.calls.lock().unwrap().push("Subscribe".into());
    }

    async fn load_unit(
        &self,
        name: String,
        #[zbus(connection)] conn: &Connection,
    ) -> zbus::fdo::Result<OwnedObjectPath> {
        self.calls.lock().unwrap().push(format!("LoadUnit {name}"));
        let path = unit_path(&name);
        let server = conn.object_server();
        if server.interface::<_, Unit>(&path).await.is_err() {
            server
                .at(
                    &path,
                    Unit {
                        active: "inactive".into(),
                        sub: "dead".into(),
                    },
                )
                .await?;
            server
                .at(
                    &path,
                    Service {
                        result: "success".into(),
                    },
                )
                .await?;
        }
        Ok(path)
    }

    async fn start_unit(
        &self,
        name: String,
        mode: String,
        #[zbus(connection)] conn: &Connection,
    ) -> zbus::fdo::Result<OwnedObjectPath> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("StartUnit {name} {mode}"));
        let sandbox = name
            .strip_prefix("microvm@")
            .and_then(|s| s.strip_suffix(".service"))
            .ok_or_else(|| zbus::fdo::Error::InvalidArgs(format!("unknown unit {name}")))?
            .to_owned();
        set_state(conn, &name, "activating", "start", "success").await;
        if sandbox == "quickfail" {
            // Failed before StartUnit even returns: agentd reads `failed`
            // first, with both changes still to come on its stream.
            set_state(conn, &name, "failed", "failed", "exit-code").await;
            return Ok(ObjectPath::try_from("/org/freedesktop/systemd1/job/1")
                .unwrap()
                .into());
        }
        let conn = conn.clone();
        let dir = self.state_dir.join("sandboxes").join(&sandbox);
        let port = self.ssh_port;
        let listen = match &self.subnet {
            Some(net) => {
                agentd::naming::derive(&sandbox, net)
                    .map_err(|e| zbus::fdo::Error::InvalidArgs(e.to_string()))?
                    .address
            }
            None => "127.0.0.1".to_owned(),
        };
        let guests = Arc::clone(&self.guests);
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            if sandbox == "broken" {
                set_state(&conn, &name, "failed", "failed", "exit-code").await;
                return;
            }
            let ws = dir.join("workspace");
            // (The guest module's read-only `keystone-ssh` share, at its
            // place, over a tmpfs of this namespace: nothing is made in the
            // host's /var/lib.)
            let script = r#"mkdir -p /workspace /run/sshd && mount --bind "$1" /workspace \
 && mount -t tmpfs -o mode=0755 guest-var-lib /var/lib && mkdir -p /var/lib/keystone-agent/ssh \
 && mount --bind "$3/ssh" /var/lib/keystone-agent/ssh && mount -o remount,bind,ro /var/lib/keystone-agent/ssh \
 && exec /usr/sbin/sshd -D -e -f /dev/null \
 -o ListenAddress="$4" -p "$2" -h "$3/ssh/ssh_host_ed25519_key" \
 -o AuthorizedKeysFile="$3/ssh/authorized_keys" -o StrictModes=no -o PidFile=none \
 -o UsePAM=no -o PermitRootLogin=prohibit-password"#;
            let log = std::fs::File::create(dir.join("logs/guest.log")).unwrap();
            let child = std::process::Command::new("unshare")
                .args([
                    "--mount",
                    "--propagation",
                    "private",
                    "--",
                    "sh",
                    "-c",
                    script,
                    "guest",
                ])
                .arg(&ws)
                .arg(port.to_string())
                .arg(&dir)
                .arg(&listen)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(log)
                .spawn()
                .expect("unshare and sshd (openssh-server) must be installed");
            guests.lock().unwrap().insert(name.clone(), child);
            set_state(&conn, &name, "active", "running", "success").await;
        });
        Ok(ObjectPath::try_from("/org/freedesktop/systemd1/job/1")
            .unwrap()
            .into())
    }

    async fn stop_unit(
        &self,
        name: String,
        mode: String,
        #[zbus(connection)] conn: &Connection,
    ) -> zbus::fdo::Result<OwnedObjectPath> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("StopUnit {name} {mode}"));
        if name == "microvm@stuck.service" {
            return Err(zbus::fdo::Error::Failed(
                "Job for microvm@stuck.service canceled".into(),
            ));
        }
        set_state(conn, &name, "deactivating", "stop", "success").await;
        if let Some(mut c) = self.guests.lock().unwrap().remove(&name) {
            let _ = c.kill();
            let _ = c.wait();
        }
        set_state(conn, &name, "inactive", "dead", "success").await;
        Ok(ObjectPath::try_from("/org/freedesktop/systemd1/job/2")
            .unwrap()
            .into())
    }
}

/// The double, serving on a bus until dropped.
pub struct FakeSystemd {
    pub calls: Arc<Mutex<Vec<String>>>,
    guests: Arc<Mutex<HashMap<String, std::process::Child>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeSystemd {
    /// Serve `org.freedesktop.systemd1` on the bus at `address`; guests'
    /// sshd listens on 127.0.0.1:`ssh_port`; agentd's state is in `state_dir`.
    pub fn start(address: &str, state_dir: PathBuf, ssh_port: u16) -> Self {
        Self::start_in(address, state_dir, ssh_port, None)
    }

    /// Like [`FakeSystemd::start`], each guest's sshd on its own address in
    /// `subnet` (a loopback one, `127.0.0.0/16`) when given.
    pub fn start_in(
        address: &str,
        state_dir: PathBuf,
        ssh_port: u16,
        subnet: Option<&str>,
    ) -> Self {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let guests = Arc::new(Mutex::new(HashMap::new()));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let manager = Manager {
            state_dir,
            ssh_port,
            subnet: subnet.map(str::to_owned),
            guests: Arc::clone(&guests),
            calls: Arc::clone(&calls),
        };
        let address = address.to_owned();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let conn = zbus::connection::Builder::address(address.as_str())
                    .unwrap()
                    .name("org.freedesktop.systemd1")
                    .unwrap()
                    .serve_at("/org/freedesktop/systemd1", manager)
                    .unwrap()
                    .build()
                    .await
                    .unwrap();
                ready_tx.send(()).unwrap();
                let _ = stop_rx.await;
                drop(conn);
            });
        });
        ready_rx.recv().unwrap();
        Self {
            calls,
            guests,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }
}

impl Drop for FakeSystemd {
    fn drop(&mut self) {
        for (_, mut c) in self.guests.lock().unwrap().drain() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

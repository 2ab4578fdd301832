//! A running Pod's container: its own user, mount, PID, UTS and network
//! namespaces, held by a pause process, with a root made of this host's
//! `/usr` and `/etc`, a `/tmp` of its own, and the Pod's volumes mounted
//! where its `volumeMounts` say. Every exec enters those namespaces, so
//! tar, git and Zellij see one container's files, processes and loopback,
//! as they would in a real one; killing the pause (PID 1 of the container)
//! ends every process the execs left behind.
//!
//! Volumes: an `emptyDir` is a directory of the Pod's, a
//! `persistentVolumeClaim` one of the claim's (it outlives the Pod), each
//! with its `subPath`. The image is not used: every container runs this
//! host's programs, as root of its user namespace.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

/// One Pod's namespaces.
#[derive(Debug)]
pub(crate) struct Container {
    /// `unshare`, whose child is the pause.
    holder: Child,
    /// The pause's pid on this host.
    pause: i32,
    /// The container's environment (`env` of the spec, and the service's).
    env: Vec<(String, String)>,
    /// Its working directory.
    workdir: String,
    /// Whether it has a network of its own.
    isolated: bool,
}

impl Drop for Container {
    fn drop(&mut self) {
        // SIGKILL to PID 1 of the namespace ends everything in it.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pause),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// Where each volume of the Pod lives on this host.
fn volume_dirs(
    root: &Path,
    namespace: &str,
    pod_dir: &Path,
    spec: &Value,
) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    for v in spec["volumes"].as_array().into_iter().flatten() {
        let Some(name) = v["name"].as_str() else {
            continue;
        };
        let dir = if let Some(claim) = v["persistentVolumeClaim"]["claimName"].as_str() {
            root.join(namespace).join("pvc").join(claim)
        } else {
            pod_dir.join("volumes").join(name)
        };
        out.push((name.to_owned(), dir));
    }
    out
}

/// `sub` under the volume's `dir`, as the kubelet takes a `subPath`: a
/// path that leaves the volume, or a file on its way, is refused (the
/// container does not start, `CreateContainerError`). Stricter than the
/// kubelet, which follows a symlink that stays in the volume: this double
/// refuses every symlink on the way.
fn sub_path(dir: &Path, sub: &str) -> std::io::Result<PathBuf> {
    let mut at = dir.to_path_buf();
    let parts: Vec<&str> = sub.split('/').filter(|p| !p.is_empty()).collect();
    for (i, part) in parts.iter().enumerate() {
        if *part == ".." || *part == "." {
            return Err(std::io::Error::other(format!(
                "subPath {sub} leaves the volume"
            )));
        }
        at.push(part);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(std::io::Error::other(format!(
                    "subPath {sub}: {} is a symlink",
                    at.display()
                )));
            }
            Ok(m) if !m.is_dir() && i + 1 < parts.len() => {
                return Err(std::io::Error::other(format!(
                    "subPath {sub}: {} is not a directory",
                    at.display()
                )));
            }
            _ => {}
        }
    }
    Ok(at)
}

/// Shell-quote `s`.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The script that makes the container's root and becomes its pause.
const ROOT: &str = "set -e
mount -t tmpfs -o mode=755 rootfs \"$ROOTFS\"
cd \"$ROOTFS\"
mkdir -p usr etc dev proc tmp run
mount --rbind /usr usr
mount --rbind /etc etc
mount --rbind /dev dev
mount -t tmpfs -o mode=1777 tmp tmp
mount -t tmpfs run run
for d in bin sbin lib lib32 lib64 libx32; do
  if [ -L /$d ]; then ln -s \"$(readlink /$d)\" $d; elif [ -d /$d ]; then mkdir $d && mount --rbind /$d $d; fi
done
";

impl Container {
    /// Start the container of Pod `name`, whose directory is `pod_dir`,
    /// from its `spec`; `service` is the API server's address as Pods see
    /// it (`KUBERNETES_SERVICE_HOST`/`PORT`), `isolated` whether it gets a
    /// network of its own (a cluster that enforces NetworkPolicies; the
    /// backend's Pods are selected by a deny-all one) or this host's.
    pub(crate) fn start(
        root: &Path,
        namespace: &str,
        name: &str,
        pod_dir: &Path,
        spec: &Value,
        service: std::net::SocketAddr,
        isolated: bool,
    ) -> std::io::Result<Self> {
        let c = &spec["containers"][0];
        let vols = volume_dirs(root, namespace, pod_dir, spec);
        let rootfs = pod_dir.join("root");
        std::fs::create_dir_all(&rootfs)?;
        let mut script = ROOT.to_owned();
        if isolated {
            script.push_str("ip link set lo up\n");
        }
        // The Pod's `hostname`, else its name.
        let host = spec["hostname"].as_str().unwrap_or(name);
        script.push_str(&format!("hostname {}\n", quote(host)));
        for m in c["volumeMounts"].as_array().into_iter().flatten() {
            let (Some(vol), Some(at)) = (m["name"].as_str(), m["mountPath"].as_str()) else {
                continue;
            };
            let Some((_, dir)) = vols.iter().find(|(n, _)| n == vol) else {
                continue;
            };
            let src = match m["subPath"].as_str() {
                Some(sub) if !sub.is_empty() => sub_path(dir, sub)?,
                _ => dir.clone(),
            };
            if !src.exists() {
                std::fs::create_dir_all(&src)?;
            }
            let at = quote(at.trim_start_matches('/'));
            let make = if src.is_dir() { "mkdir -p" } else { "touch" };
            script.push_str(&format!(
                "{make} {at}\nmount --bind {} {at}\n",
                quote(&src.to_string_lossy())
            ));
            if m["readOnly"].as_bool() == Some(true) {
                script.push_str(&format!("mount -o remount,bind,ro {at}\n"));
            }
        }
        // /proc of the new PID namespace, then the pause.
        script.push_str(
            "mount -t proc proc proc\necho ready\nexec chroot . /bin/sh -c 'exec sleep infinity'\n",
        );
        let mut flags = vec![
            "--user",
            "--map-root-user",
            "--mount",
            "--pid",
            "--uts",
            "--fork",
            "--kill-child",
        ];
        if isolated {
            flags.push("--net");
        }
        let mut holder = Command::new("unshare")
            .args(&flags)
            .args(["sh", "-c", &script])
            .env("ROOTFS", &rootfs)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        let out = holder.stdout.take().expect("piped");
        std::io::BufReader::new(out).read_line(&mut line)?;
        if line.trim() != "ready" {
            let mut err = String::new();
            if let Some(mut e) = holder.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            let _ = holder.kill();
            let _ = holder.wait();
            return Err(std::io::Error::other(format!(
                "the container did not start: {}",
                err.trim()
            )));
        }
        let children =
            std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", holder.id()))?;
        let pause = children
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| std::io::Error::other("the container's pause is not there"))?;
        let mut env = vec![
            (
                "PATH".to_owned(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_owned(),
            ),
            ("HOSTNAME".to_owned(), name.to_owned()),
            (
                "KUBERNETES_SERVICE_HOST".to_owned(),
                service.ip().to_string(),
            ),
            (
                "KUBERNETES_SERVICE_PORT".to_owned(),
                service.port().to_string(),
            ),
        ];
        for e in c["env"].as_array().into_iter().flatten() {
            if let (Some(k), Some(v)) = (e["name"].as_str(), e["value"].as_str()) {
                env.push((k.to_owned(), v.to_owned()));
            }
        }
        let workdir = c["workingDir"].as_str().unwrap_or("/").to_owned();
        Ok(Self {
            holder,
            pause,
            env,
            workdir,
            isolated,
        })
    }

    /// Its network namespace, when it has one of its own.
    pub(crate) fn netns(&self) -> Option<std::path::PathBuf> {
        self.isolated
            .then(|| std::path::PathBuf::from(format!("/proc/{}/ns/net", self.pause)))
    }

    /// A command that runs `argv` inside the container.
    pub(crate) fn command(&self, argv: &[String]) -> tokio::process::Command {
        let mut c = tokio::process::Command::new("nsenter");
        c.arg("--target")
            .arg(self.pause.to_string())
            .args(["--user", "--mount", "--pid", "--uts"])
            .args(self.isolated.then_some("--net"))
            .arg("--root")
            .arg(format!("--wdns={}", self.workdir))
            .arg("--")
            .args(argv)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }
}

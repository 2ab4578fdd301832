//! Helpers of the tests that boot `vm` sandboxes from the guest image.

use std::path::{Path, PathBuf};

use super::Env;

/// The guest image built by guest-image/debian/build.sh.
pub fn image() -> PathBuf {
    let dir = std::env::var_os("KEYSTONE_VM_IMAGE")
        .map(PathBuf::from)
        .expect("KEYSTONE_VM_IMAGE names the guest image directory (tests/run-vm.sh sets it)");
    for f in ["vmlinux", "initrd", "rootfs.img"] {
        assert!(dir.join(f).is_file(), "{} has no {f}", dir.display());
    }
    dir
}

/// agentd with the vm backend on `image` (plus `extra` config, merged one
/// level deep).
pub fn env_with(image: &Path, extra: serde_json::Value) -> Env {
    let mut config = serde_json::json!({
        "vm": {"image": image, "start_timeout_seconds": 300, "stop_grace_seconds": 60},
    });
    if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            match (c.get_mut(k).and_then(|x| x.as_object_mut()), v.as_object()) {
                (Some(ours), Some(theirs)) => ours.extend(theirs.clone()),
                _ => {
                    c.insert(k.clone(), v.clone());
                }
            }
        }
    }
    Env::with_config(&config)
}

pub fn create_vm(env: &Env, name: &str, network: &str) {
    create_vm_with(env, name, network, &[]);
}

pub fn create_vm_with(env: &Env, name: &str, network: &str, extra: &[&str]) {
    let repo = env.repo(name);
    let mut args = vec![
        "create",
        "--backend",
        "vm",
        "--memory",
        "1024",
        "--vcpus",
        "2",
        "--network",
        network,
    ];
    args.extend_from_slice(extra);
    args.push(repo.to_str().unwrap());
    env.ok(&args);
}

/// What makes a guest itself, as it says: random bytes, hostname,
/// machine id, the keys allowed to log in.
pub fn identity(env: &Env, name: &str) -> Vec<String> {
    env.sh(
        name,
        "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; hostname; cat /etc/machine-id; \
         cat /etc/ssh/keystone/authorized_keys",
    )
    .lines()
    .map(str::to_owned)
    .collect()
}

//! Forks of a `local` snapshot share its files instead of copying them
//! (overlayfs on the snapshot's tree, see `agentd/src/layers.rs`): each
//! fork writes only what it changes, under its own uid, and keeps its
//! files after the snapshot goes and across agentd's restarts; a source
//! uid on the host cannot reach the files its forks share.

mod common;

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use common::{Env, json};

/// The size of the file the forks share.
const BIG_MIB: u64 = 32;

/// What the host's file system holds for sandbox `name`: its disk image's
/// allocated bytes (its writes, its upper layers).
fn image_bytes(env: &Env, name: &str) -> u64 {
    let image = env.state_dir.join("disks").join(format!("{name}.img"));
    std::fs::metadata(&image).unwrap().blocks() * 512
}

fn workspace(env: &Env, name: &str) -> PathBuf {
    env.state_dir.join("sandboxes").join(name).join("workspace")
}

fn held(env: &Env) -> Vec<PathBuf> {
    std::fs::read_dir(env.state_dir.join("held"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

fn is_mount_point(path: &Path) -> bool {
    agentd::disk::is_mount_point(path)
}

#[test]
fn forks_of_a_local_snapshot_share_its_files_and_write_only_their_own() {
    if !common::is_root() || !agentd::layers::possible() {
        eprintln!("skipped: needs root and overlayfs");
        return;
    }
    let mut env = Env::running("la", &[]);
    env.sh(
        "la",
        &format!(
            "head -c {} /dev/urandom > /workspace/big && echo base > /workspace/f.txt && \
             echo h > ~/.h && git -C /workspace add f.txt && git -C /workspace commit -qm base",
            BIG_MIB << 20
        ),
    );
    let sum = env.sh("la", "sha256sum < /workspace/big");
    let snap = json(&env.ok(&["snapshot", "la", "--json"]));
    let id = snap["id"].as_str().unwrap().to_owned();

    for fork in ["lb", "lc", "ld"] {
        env.ok(&["fork", "la", fork, "--from", &id]);
        env.ok(&["start", fork]);
        assert_eq!(env.sh(fork, "sha256sum < /workspace/big"), sum);
        assert_eq!(env.sh(fork, "cat ~/.h"), "h\n");
        // Its own uid owns its files, and it may write them.
        assert_eq!(
            env.sh(fork, "stat -c %u /workspace/big"),
            env.sh(fork, "id -u")
        );
        let used = image_bytes(&env, fork);
        assert!(
            used < (BIG_MIB << 20) / 2,
            "fork {fork}'s disk holds {used} bytes: the {BIG_MIB} MiB file was copied"
        );
    }
    // Writes stay the fork's own: not in the snapshot, not in another fork.
    env.sh(
        "lb",
        "echo changed > /workspace/f.txt && printf x | dd of=/workspace/big conv=notrunc 2>/dev/null",
    );
    assert_ne!(env.sh("lb", "sha256sum < /workspace/big"), sum);
    assert_eq!(env.sh("lc", "sha256sum < /workspace/big"), sum);
    assert_eq!(env.sh("lc", "cat /workspace/f.txt"), "base\n");
    let snap_dir = env.state_dir.join("snapshots/la").join(&id);
    assert_eq!(
        std::fs::read_to_string(snap_dir.join("workspace/f.txt")).unwrap(),
        "base\n"
    );

    // The source's uid, on the host, cannot reach the files it shares
    // with its forks (it would write into every fork).
    let la_uid = std::fs::metadata(workspace(&env, "la").join("f.txt"))
        .unwrap()
        .uid();
    let shared = held(&env)
        .into_iter()
        .map(|h| h.join("big"))
        .find(|p| p.is_file())
        .expect("a held tree with the shared file");
    assert_eq!(std::fs::metadata(&shared).unwrap().uid(), la_uid);
    let planted = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("echo planted >> '{}'", shared.display()))
        .uid(la_uid)
        .gid(la_uid)
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!planted.success(), "uid {la_uid} wrote into a shared file");
    // Nor can a fork set overlayfs' own attributes through its tree.
    let (code, _) = env.inside(
        "lc",
        "python3 -c \"import os; os.setxattr('/workspace/f.txt', 'trusted.overlay.redirect', b'/x')\"",
    );
    assert_ne!(code, 0, "a fork set an overlayfs attribute");

    // The snapshot goes; its forks keep their files, also once agentd
    // starts anew on a host that lost its mounts (a reboot).
    env.ok(&["snapshot", "rm", "la", &id]);
    env.ok(&["stop", "lc"]);
    env.kill_agentd();
    let lc = workspace(&env, "lc");
    assert!(is_mount_point(&lc));
    nix::mount::umount2(&lc, nix::mount::MntFlags::MNT_DETACH).unwrap();
    env.start_agentd();
    // Stopped, it holds no mount; its start mounts its image and layers.
    let lc_dir = env.state_dir.join("sandboxes/lc");
    assert!(!is_mount_point(&lc_dir) && !is_mount_point(&lc));
    env.ok(&["start", "lc"]);
    assert!(
        is_mount_point(&lc),
        "agentd did not mount lc's layers again"
    );
    assert_eq!(std::fs::read_to_string(lc.join("f.txt")).unwrap(), "base\n");
    assert_eq!(env.sh("lc", "sha256sum < /workspace/big"), sum);

    // A snapshot of a fork holds its merged files; restoring it puts them
    // back as a plain tree, and lets go of the layers.
    let of_lb = json(&env.ok(&["snapshot", "lb", "--json"]));
    let of_lb = of_lb["id"].as_str().unwrap().to_owned();
    env.sh("lb", "echo later > /workspace/f.txt");
    env.ok(&["restore", "lb", &of_lb]);
    assert_eq!(env.sh("lb", "cat /workspace/f.txt"), "changed\n");
    assert!(!is_mount_point(&workspace(&env, "lb")));
    let lb = env.state_dir.join("sandboxes/lb");
    assert!(
        !lb.join("workspace.base").exists(),
        "the restore kept lb's layers"
    );
    assert_eq!(
        std::fs::read_dir(lb.join(".layers")).map_or(0, |d| d.count()),
        0
    );
    // The forks of one snapshot share one held tree per tree.
    assert_eq!(held(&env).len(), 2);

    // An image that does not mount at agentd's start hides the token
    // files on it: what its sandbox holds is kept, not pruned (ld is the
    // last fork that names its held trees).
    env.ok(&["stop", "lc"]);
    env.ok(&["destroy", "--force", "lc"]);
    assert_eq!(held(&env).len(), 2, "lc's destroy took what ld uses");
    env.ok(&["stop", "ld"]);
    env.kill_agentd();
    let ld = env.state_dir.join("sandboxes/ld");
    for m in [ld.join("workspace"), ld.join("home"), ld.clone()] {
        nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH).unwrap();
    }
    let image = env.state_dir.join("disks/ld.img");
    let aside = env.state_dir.join("ld.img.aside");
    std::fs::rename(&image, &aside).unwrap();
    std::fs::write(&image, b"").unwrap();
    env.start_agentd();
    assert_eq!(
        held(&env).len(),
        2,
        "agentd pruned what an unmounted sandbox holds"
    );
    env.kill_agentd();
    std::fs::rename(&aside, &image).unwrap();
    env.start_agentd();
    env.ok(&["start", "ld"]);
    assert_eq!(env.sh("ld", "sha256sum < /workspace/big"), sum);

    // The last fork's destroy lets go of the held trees.
    env.ok(&["stop", "ld"]);
    env.ok(&["destroy", "--force", "ld"]);
    assert_eq!(held(&env), Vec::<PathBuf>::new());
}

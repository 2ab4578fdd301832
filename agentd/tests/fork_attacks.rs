//! A `vm` sandbox's home disk (`home.img`) copied by a fork: the source's
//! uid (its QEMU) must never hold the fork's disk.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;

use common::Env;

/// A fork's home disk is handed to the fork when it is copied: the
/// source's uid cannot open it (and keep it open past the fork's start).
#[test]
fn a_forks_home_disk_is_never_the_sources_uids() {
    if !common::is_root() {
        return;
    }
    let env = Env::running("ha", &[]);
    let src = env.state_dir.join("sandboxes/ha");
    let home = std::fs::metadata(src.join("home")).unwrap();
    let (s_uid, s_gid) = (home.uid(), home.gid());
    assert_ne!(s_uid, 0);
    // The home disk a vm sandbox has there: its uid's, 0600.
    let img = src.join("home.img");
    std::fs::write(&img, b"the source's disk\n").unwrap();
    std::os::unix::fs::lchown(&img, Some(s_uid), Some(s_gid)).unwrap();
    std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o600)).unwrap();

    env.ok(&["fork", "ha", "hb"]);
    let dst = env.state_dir.join("sandboxes/hb");
    let f_uid = std::fs::metadata(dst.join("home")).unwrap().uid();
    assert_ne!(f_uid, s_uid, "the fork has a uid of its own");
    let forked = dst.join("home.img");
    assert!(forked.is_file());
    let planted = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("echo planted >> '{}'", forked.display()))
        .uid(s_uid)
        .gid(s_gid)
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    let owner = std::fs::metadata(&forked).unwrap().uid();
    assert!(
        !planted.success(),
        "the source's uid {s_uid} wrote into the fork's home disk (owner {owner}, fork uid {f_uid})"
    );
    assert_ne!(owner, s_uid, "the fork's home disk is the source's uid's");
}

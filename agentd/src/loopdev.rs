//! Loop devices without util-linux: a free one from `/dev/loop-control`,
//! bound to an image with `LOOP_CONFIGURE` (`LOOP_SET_FD` and
//! `LOOP_SET_STATUS64` before Linux 5.8), and autoclear, so the image's
//! last unmount frees it. `mount -o loop` first looks at every loop device
//! of the host (to reuse one bound to the same file): with a thousand
//! sandboxes that was most of what a create cost.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::libc;

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_SET_FD: libc::c_ulong = 0x4C00;
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_SET_STATUS64: libc::c_ulong = 0x4C04;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;

/// `struct loop_info64` of `<linux/loop.h>`.
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    device: u64,
    inode: u64,
    rdevice: u64,
    offset: u64,
    sizelimit: u64,
    number: u32,
    encrypt_type: u32,
    encrypt_key_size: u32,
    flags: u32,
    file_name: [u8; 64],
    crypt_name: [u8; 64],
    encrypt_key: [u8; 32],
    init: [u64; 2],
}

/// `struct loop_config` of `<linux/loop.h>`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// A loop device bound to an image; the binding ends (autoclear) when
/// this and every mount of it are gone.
#[derive(Debug)]
pub struct Attached {
    /// `/dev/loopN`.
    pub path: PathBuf,
    /// The open device, which keeps the binding until it is mounted.
    _device: OwnedFd,
}

fn check(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Bind a free loop device to `image` (a regular file, opened without
/// following a symlink), read-write.
///
/// # Errors
/// When there is no loop-control device, no free loop device after a few
/// tries (others taking them meanwhile), or the kernel refuses the image.
pub fn attach(image: &Path) -> io::Result<Attached> {
    let ctl: OwnedFd = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/loop-control")?
        .into();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(image)?;
    // SAFETY: zeroes are a valid loop_info64 (plain integers and arrays).
    let mut info: LoopInfo64 = unsafe { std::mem::zeroed() };
    info.flags = LO_FLAGS_AUTOCLEAR;
    let fd = u32::try_from(file.as_raw_fd()).map_err(io::Error::other)?;
    for _ in 0..16 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument.
        let n = check(unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) })?;
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let device: OwnedFd = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(d) => d.into(),
            Err(e) => return Err(e),
        };
        let config = LoopConfig {
            fd,
            block_size: 0,
            info,
            reserved: [0; 8],
        };
        // SAFETY: LOOP_CONFIGURE reads a loop_config, which `config` is.
        let r = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CONFIGURE, &raw const config) };
        if r == 0 {
            return Ok(Attached {
                path,
                _device: device,
            });
        }
        match io::Error::last_os_error().raw_os_error() {
            // Taken by someone else between the two calls.
            Some(libc::EBUSY) => continue,
            // Before Linux 5.8: the two older calls.
            Some(libc::EINVAL | libc::ENOTTY) => {}
            _ => return Err(io::Error::last_os_error()),
        }
        // SAFETY: LOOP_SET_FD takes the image's descriptor.
        let r = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_SET_FD, file.as_raw_fd()) };
        if r < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::EBUSY) {
                continue;
            }
            return Err(io::Error::last_os_error());
        }
        // SAFETY: LOOP_SET_STATUS64 reads a loop_info64, which `info` is.
        let r = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_SET_STATUS64, &raw const info) };
        if r < 0 {
            let e = io::Error::last_os_error();
            // SAFETY: LOOP_CLR_FD takes no argument.
            unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CLR_FD) };
            return Err(e);
        }
        return Ok(Attached {
            path,
            _device: device,
        });
    }
    Err(io::Error::other("no free loop device after 16 tries"))
}

/// Whether `path` itself (a last symlink not followed: a symlink is never
/// a mount point) is the root of a mount: `statx`'s
/// `STATX_ATTR_MOUNT_ROOT`; `None` where the kernel does not say (before
/// Linux 5.8) or `path` cannot be looked at.
#[must_use]
pub fn is_mount_point(path: &Path) -> Option<bool> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: zeroes are a valid statx buffer.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a statx buffer of the right size.
    let r = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_BASIC_STATS,
            &raw mut st,
        )
    };
    let root = u64::try_from(libc::STATX_ATTR_MOUNT_ROOT).ok()?;
    (r == 0 && st.stx_attributes_mask & root != 0).then_some(st.stx_attributes & root != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sysfs directory of loop device `path`.
    fn sys(path: &Path) -> PathBuf {
        Path::new("/sys/block").join(path.file_name().unwrap())
    }

    #[test]
    fn an_image_is_bound_mounted_and_freed_by_its_unmount() {
        if !nix::unistd::Uid::effective().is_root() {
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let image = t.path().join("d.img");
        std::fs::File::create(&image)
            .unwrap()
            .set_len(8 << 20)
            .unwrap();
        let made = std::process::Command::new("mke2fs")
            .args(["-q", "-F", "-t", "ext4"])
            .arg(&image)
            .status()
            .unwrap();
        assert!(made.success());
        let dir = t.path().join("mnt");
        std::fs::create_dir(&dir).unwrap();
        assert_eq!(is_mount_point(&dir), Some(false));
        let dev = attach(&image).unwrap();
        let loop_dir = sys(&dev.path).join("loop");
        assert_eq!(
            std::fs::read_to_string(loop_dir.join("backing_file")).unwrap(),
            format!("{}\n", image.display())
        );
        assert_eq!(
            std::fs::read_to_string(loop_dir.join("autoclear")).unwrap(),
            "1\n"
        );
        nix::mount::mount(
            Some(&dev.path),
            &dir,
            Some("ext4"),
            nix::mount::MsFlags::MS_NOSUID,
            None::<&str>,
        )
        .unwrap();
        let path = dev.path.clone();
        drop(dev);
        assert_eq!(is_mount_point(&dir), Some(true));
        std::fs::write(dir.join("f"), "x").unwrap();
        nix::mount::umount(&dir).unwrap();
        assert_eq!(is_mount_point(&dir), Some(false));
        // Autoclear: the device is unbound with its last user.
        let bound = || sys(&path).join("loop/backing_file").exists();
        for _ in 0..100 {
            if !bound() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(!bound(), "{} still bound after the unmount", path.display());
        // `/` is a mount point; a symlink to one is not.
        assert_eq!(is_mount_point(Path::new("/")), Some(true));
        std::os::unix::fs::symlink("/proc", t.path().join("to-proc")).unwrap();
        assert_eq!(is_mount_point(Path::new("/proc")), Some(true));
        assert_eq!(is_mount_point(&t.path().join("to-proc")), Some(false));
        // A symlink is not followed to an image.
        std::os::unix::fs::symlink(&image, t.path().join("link.img")).unwrap();
        assert!(attach(&t.path().join("link.img")).is_err());
    }
}

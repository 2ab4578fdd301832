//! The tmpfs file systems of a local sandbox, sized from its RAM.

/// The tmpfs file systems of a local sandbox and their sizes in MiB for
/// `memory_mib` of RAM: together less than the RAM, so that they cannot
/// take more than the sandbox has even where no memory cgroup holds it
/// (where one does, their pages count against it too).
#[must_use]
pub fn tmpfs_sizes(memory_mib: u32) -> [(&'static str, u32); 6] {
    let share = |div: u32| (memory_mib / div).max(1);
    [
        ("/tmp", share(2)),
        ("/dev/shm", share(4)),
        ("/var/tmp", share(8)),
        ("/run", share(16)),
        ("/", share(32)),
        ("/dev", 1),
    ]
}

/// Mount options of tmpfs `path` of a sandbox with `memory_mib` of RAM:
/// `mode` and a size; inodes are bounded as well (one per 4 KiB), as each
/// costs kernel memory even when empty.
pub(super) fn tmpfs_options(path: &str, mode: &str, memory_mib: u32) -> String {
    let size = tmpfs_sizes(memory_mib)
        .iter()
        .find(|(p, _)| *p == path)
        .map_or(1, |(_, s)| *s);
    let inodes = (u64::from(size) * 256).max(1024);
    format!("mode={mode},size={size}m,nr_inodes={inodes}")
}

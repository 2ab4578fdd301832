//! A stopped sandbox holds no mount and no loop device: its disk image
//! ([`crate::disk`]) and its layered trees ([`crate::layers`]) are
//! mounted while something uses its directory, and unmounted [`GRACE`]
//! after the last use ends. A start keeps its use for as long as the
//! sandbox runs; a sync, a snapshot or a log read of a stopped sandbox
//! for as long as it lasts. Whatever reads or writes a sandbox's
//! directory holds a [`Mounted`] first: without one, the directory is
//! only the empty place of the image.
//!
//! Uses are counted per sandbox id, and each remembers which image file
//! it mounted: a use that outlives its sandbox (destroyed meanwhile) never
//! unmounts the image of a new sandbox of the same name.
//!
//! The held files a stopped sandbox names ([`crate::held`]: its trees'
//! lower layers, its disks' bases, its saved memory's state) are in token
//! files on its image. Before each unmount, their tokens are written
//! beside the image (`disks/<name>.held`, agentd's alone), and that list
//! goes once the image is mounted again: agentd knows what a stopped
//! sandbox names without mounting it, and a sandbox with no list (one
//! whose mount an agentd lost while it ran) counts as naming every held
//! file until it is mounted.

use std::os::unix::fs::MetadataExt;

use super::*;
use crate::disk::Disk;

/// How long a sandbox's directory stays mounted after its last use: a
/// burst of requests (a create, then a start; a stop, then a sync) mounts
/// it once.
pub(super) const GRACE: Duration = Duration::from_secs(2);

/// How many uses a sandbox's directory has now; `epoch` tells an
/// unmount that waited [`GRACE`] whether a use came and went meanwhile;
/// `mounted`, which image file the uses mounted (none: its directory is
/// a plain one, or its image is not made yet); `retired`, that the
/// sandbox was destroyed (no use is taken, nothing is unmounted).
#[derive(Debug, Default)]
pub(super) struct Uses {
    count: usize,
    epoch: u64,
    mounted: Option<Identity>,
    retired: bool,
}

/// The device, inode and birth time of an image file: a file made later
/// in its place (a new sandbox of the same name) is another.
type Identity = (u64, u64, Option<std::time::SystemTime>);

/// The uses of one sandbox, locked (a panic elsewhere under the lock
/// does not make every later use panic too).
fn lock(uses: &Mutex<Uses>) -> std::sync::MutexGuard<'_, Uses> {
    uses.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A sandbox's directory, mounted while this lives.
#[derive(Debug)]
pub struct Mounted {
    dir: PathBuf,
    _use: Option<Use>,
}

impl Mounted {
    /// The sandbox's directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// One use of a sandbox's image (`image`: the file it mounted): its end
/// may unmount it.
#[derive(Debug)]
struct Use {
    uses: Arc<Mutex<Uses>>,
    disk: Disk,
    image: Option<Identity>,
}

impl Drop for Use {
    fn drop(&mut self) {
        let (uses, disk, image) = (Arc::clone(&self.uses), self.disk.clone(), self.image);
        let epoch = {
            let mut u = lock(&uses);
            u.count -= 1;
            if u.count > 0 || u.retired {
                return;
            }
            u.epoch += 1;
            u.epoch
        };
        if image.is_none() || identity(&disk) != image {
            return; // it had none, or it is gone: nothing of it to unmount
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    tokio::time::sleep(GRACE).await;
                    let _ = tokio::task::spawn_blocking(move || {
                        unmount_unused(&uses, &disk, epoch, image);
                    })
                    .await;
                });
            }
            Err(_) => unmount_unused(&uses, &disk, epoch, image),
        }
    }
}

/// Unmount `disk` if nothing used it since the use that ended at `epoch`,
/// and it is still the `image` that use mounted.
fn unmount_unused(uses: &Mutex<Uses>, disk: &Disk, epoch: u64, image: Option<Identity>) {
    let mut u = lock(uses);
    if u.count == 0 && u.epoch == epoch && !u.retired && identity(disk) == image {
        unmount(disk);
        u.mounted = None;
    }
}

/// The identity of `disk`'s image file, if it has one.
fn identity(disk: &Disk) -> Option<Identity> {
    std::fs::symlink_metadata(&disk.image)
        .ok()
        .filter(std::fs::Metadata::is_file)
        .map(|m| (m.dev(), m.ino(), m.created().ok()))
}

/// The token files in sandbox directory `dir` that name held files: its
/// saved memory's state, its disks' bases and its trees' lower layers.
fn token_files(dir: &Path) -> Vec<PathBuf> {
    let mut named = vec![dir.join(crate::snapshots::MEMORY).join(crate::memory::HELD)];
    named.extend(
        crate::snapshots::DISKS
            .iter()
            .map(|d| crate::overlay::token_file(&dir.join(d))),
    );
    named.extend(
        crate::snapshots::TREES
            .iter()
            .map(|t| crate::layers::token_file(&dir.join(t))),
    );
    named
}

/// Unmount sandbox `disk`'s image, its layered trees with it, once what
/// it names is written beside it (it stays mounted where that cannot be).
/// The caller holds the sandbox's uses, with none taken.
fn unmount(disk: &Disk) {
    if !disk.image.is_file() || !crate::disk::is_mount_point(&disk.dir) {
        return;
    }
    // What a restore that an agentd's end cut short left is finished
    // first: the tokens read below are then the ones it names.
    crate::snapshots::finish_restore(&disk.dir);
    let tokens: Vec<String> = token_files(&disk.dir)
        .iter()
        .filter_map(|f| crate::held::token(f))
        .collect();
    let list = disk.held_list();
    if let Err(e) = crate::fsutil::atomic_write_mode(&list, tokens.join("\n").as_bytes(), 0o600) {
        tracing::warn!(dir = %disk.dir.display(), error = %e, "cannot write what the sandbox holds; its image stays mounted");
        return;
    }
    if disk.unmount() {
        tracing::debug!(dir = %disk.dir.display(), "disk image unmounted");
    }
}

/// The tokens sandbox `disk` names: read on its image while it is
/// mounted (or where it has none), else from the list its last unmount
/// wrote; `None` when they cannot be known. The caller holds its uses.
fn named_tokens(disk: &Disk) -> Option<Vec<String>> {
    if !disk.image.is_file() || crate::disk::is_mount_point(&disk.dir) {
        return Some(
            token_files(&disk.dir)
                .iter()
                .filter_map(|f| crate::held::token(f))
                .collect(),
        );
    }
    let text = std::fs::read_to_string(disk.held_list()).ok()?;
    Some(text.lines().map(str::to_owned).collect())
}

/// Run `f`, which blocks (a mount), on an async worker: other tasks move
/// to the other workers meanwhile where the runtime has them.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

impl Manager {
    /// The uses of the directory of sandbox `sb`, while it is the sandbox
    /// of its name (checked under the map's lock, which `forget_uses`
    /// takes too: a sandbox destroyed meanwhile gets none).
    fn uses(&self, sb: &Sandbox) -> Result<Arc<Mutex<Uses>>> {
        let mut mounts = self.mounts.lock().unwrap();
        if !self.store.is_current(&sb.name, &sb.id) {
            return Err(Error::NotFound(sb.name.clone()));
        }
        Ok(Arc::clone(mounts.entry(sb.id.clone()).or_default()))
    }

    /// Forget the uses of destroyed sandbox `sb` (after it left the
    /// store): a use still held ends without unmounting anything.
    pub(super) fn forget_uses(&self, sb: &Sandbox) {
        self.let_go(&sb.name);
        let mut mounts = self.mounts.lock().unwrap();
        if let Some(uses) = mounts.remove(&sb.id) {
            lock(&uses).retired = true;
        }
    }

    /// Sandbox `sb`'s directory, mounted for as long as the answer lives.
    ///
    /// # Errors
    /// Its image or its layered trees cannot be mounted; it is gone.
    pub(super) async fn mounted(&self, sb: &Sandbox) -> Result<Mounted> {
        self.mount_use(sb, false).await
    }

    /// [`Manager::mounted`] for a sandbox that may have no image yet (a
    /// new one, a declared one's first start): it is made first.
    pub(super) async fn mounted_new(&self, sb: &Sandbox) -> Result<Mounted> {
        self.mount_use(sb, true).await
    }

    async fn mount_use(&self, sb: &Sandbox, new: bool) -> Result<Mounted> {
        if !Self::has_disk_image(sb.backend) {
            return self.still_there(sb, None);
        }
        let (uses, disk, held) = (self.uses(sb)?, self.disk(&sb.name), self.held());
        let size = new.then_some(sb.config.disk);
        let used = tokio::task::spawn_blocking(move || take_use(&uses, &disk, size, &held))
            .await
            .map_err(|e| snapshots::panicked_snapshot(&sb.name, &e))?;
        self.still_there(
            sb,
            Some(used.map_err(|e| e.error(&sb.name, &self.disk(&sb.name)))?),
        )
    }

    /// [`Manager::mounted`] where the caller cannot wait (a quick answer
    /// of a sandbox that may be stopped): it blocks its worker while the
    /// image mounts.
    pub(super) fn mounted_now(&self, sb: &Sandbox) -> Result<Mounted> {
        if !Self::has_disk_image(sb.backend) {
            return self.still_there(sb, None);
        }
        let (uses, disk) = (self.uses(sb)?, self.disk(&sb.name));
        // Mounted already (it runs): no need to leave the async worker.
        let used = match one_more(&uses, &disk) {
            Some(used) => used,
            None => blocking(|| take_use(&uses, &disk, None, &self.held()))
                .map_err(|e| e.error(&sb.name, &disk))?,
        };
        self.still_there(sb, Some(used))
    }

    /// `used` as [`Mounted`] while sandbox `sb` is still the one of its
    /// name (a destroy may have come meanwhile: its use then ends here).
    fn still_there(&self, sb: &Sandbox, used: Option<Use>) -> Result<Mounted> {
        if !self.store.is_current(&sb.name, &sb.id) {
            return Err(Error::NotFound(sb.name.clone()));
        }
        Ok(Mounted {
            dir: self.store.registry().sandbox_dir(&sb.name),
            _use: used,
        })
    }

    /// [`Manager::mounted_now`] of sandbox `name`.
    pub(super) fn mounted_by_name(&self, name: &str) -> Result<Mounted> {
        let sb = self
            .snapshot(name)
            .ok_or_else(|| Error::NotFound(name.to_owned()))?;
        self.mounted_now(&sb)
    }

    /// Mount the image a sandbox `name` that is gone left, if it left one,
    /// so that what its directory names (a remote, held files) is let go
    /// of before it goes.
    pub(super) async fn mount_leftover(&self, name: &str) {
        let disk = self.disk(name);
        if !disk.image.is_file() {
            return;
        }
        let done = tokio::task::spawn_blocking(move || disk.ensure(0)).await;
        if let Ok(Err(e)) = done {
            tracing::warn!(sandbox = %name, error = %e, "cannot mount the disk image it left");
        }
    }

    /// Keep running sandbox `name`'s directory mounted until
    /// [`Manager::let_go`].
    pub(super) fn keep_mounted(&self, name: &str, mounted: Mounted) {
        self.running
            .lock()
            .unwrap()
            .insert(name.to_owned(), mounted);
    }

    /// Sandbox `name` no longer runs: its directory may be unmounted once
    /// nothing else uses it.
    pub(super) fn let_go(&self, name: &str) {
        let gone = self.running.lock().unwrap().remove(name);
        drop(gone);
    }

    /// The tokens of the held files sandbox `name` names (see
    /// [`named_tokens`]), read while nothing mounts or unmounts it.
    pub(super) fn named_tokens(&self, name: &str) -> Option<Vec<String>> {
        let sb = self.snapshot(name)?;
        let uses = self.uses(&sb).ok()?;
        let _u = lock(&uses);
        named_tokens(&self.disk(name))
    }

    /// Mount, for the time of `f`, the images of the sandboxes that do not
    /// run and whose list of held files is missing (their mount was lost
    /// while they ran), so that what they name is known.
    pub(super) async fn with_tokens_known<T>(&self, f: impl AsyncFnOnce() -> T) -> T {
        let mut mounted = Vec::new();
        for name in self.names() {
            let Some(sb) = self.snapshot(&name) else {
                continue;
            };
            if Self::has_disk_image(sb.backend) && self.named_tokens(&name).is_none() {
                match self.mounted(&sb).await {
                    Ok(m) => mounted.push(m),
                    Err(e) => {
                        tracing::warn!(sandbox = %name, error = %e, "cannot mount the disk image to read what it holds");
                    }
                }
            }
        }
        let done = f().await;
        drop(mounted);
        done
    }

    /// Unmount the images of sandboxes that do not run and that nothing
    /// uses: at agentd's start (an earlier agentd's mounts) and at its
    /// end (its pending unmounts end with it).
    pub(super) fn unmount_stopped(&self) {
        for name in self.names() {
            let Some(sb) = self.snapshot(&name) else {
                continue;
            };
            if sb.runtime.is_some() || !Self::has_disk_image(sb.backend) {
                continue;
            }
            let Ok(uses) = self.uses(&sb) else {
                continue;
            };
            let mut u = lock(&uses);
            if u.count == 0 {
                unmount(&self.disk(&name));
                u.mounted = None;
            }
        }
    }
}

/// Why a use could not be taken.
enum Taken {
    Disk(crate::disk::DiskError),
    Layers(crate::snapshots::SnapshotError),
    Gone,
}

impl Taken {
    /// The error of sandbox `name` (image `disk`).
    fn error(self, name: &str, disk: &Disk) -> Error {
        match self {
            Self::Disk(e) => Error::Conflict(format!(
                "Sandbox '{name}': cannot mount its disk image {}: {e}",
                disk.image.display()
            )),
            Self::Layers(source) => Error::Snapshot {
                name: name.to_owned(),
                source,
            },
            Self::Gone => Error::NotFound(name.to_owned()),
        }
    }
}

/// Another use of `disk` where its image is mounted for the uses it has
/// (without waiting for one being mounted now).
fn one_more(uses: &Arc<Mutex<Uses>>, disk: &Disk) -> Option<Use> {
    let mut u = uses.try_lock().ok()?;
    (u.count > 0 && u.mounted.is_some() && !u.retired).then(|| {
        u.count += 1;
        Use {
            uses: Arc::clone(uses),
            disk: disk.clone(),
            image: u.mounted,
        }
    })
}

/// Take a use of `disk`: the first one mounts the image (made first,
/// where it has none, when `new` gives its size) and the layered trees,
/// and finishes what an interrupted restore or fork left.
fn take_use(
    uses: &Arc<Mutex<Uses>>,
    disk: &Disk,
    new: Option<u32>,
    held: &Path,
) -> std::result::Result<Use, Taken> {
    let mut u = lock(uses);
    if u.retired {
        return Err(Taken::Gone);
    }
    // The image is mounted by the first use, or by the first that comes
    // once there is one (a use taken while a new sandbox's image was not
    // made yet mounted nothing).
    if u.mounted.is_none() || !crate::disk::is_mount_point(&disk.dir) {
        if disk.image.is_file() {
            // (An image that exists keeps its size.)
            disk.ensure(0).map_err(Taken::Disk)?;
        } else if let Some(size) = new {
            // Only the limit is missing where this fails (the limits text
            // says why); an image made but not mounted goes, or a later
            // mount would hide what is written here meanwhile.
            if let Err(e) = disk.ensure(size) {
                tracing::warn!(dir = %disk.dir.display(), error = %e, "disk limit not enforced");
                if !crate::disk::is_mount_point(&disk.dir) {
                    let _ = std::fs::remove_file(&disk.image);
                }
            }
        }
        if crate::disk::is_mount_point(&disk.dir) {
            u.mounted = identity(disk);
            // Known from the image itself from now on (see the module's
            // text).
            let _ = std::fs::remove_file(disk.held_list());
        }
    }
    // What an interrupted restore or fork left is finished, and the
    // layered trees mounted, while nothing else uses the directory.
    if u.count == 0 {
        let dir = &disk.dir;
        crate::snapshots::finish_restore(dir);
        crate::layers::prune(dir, &crate::snapshots::TREES);
        for tree in crate::snapshots::TREES {
            if let Err(e) = crate::layers::mount(&dir.join(tree), held) {
                unmount(disk);
                u.mounted = None;
                return Err(Taken::Layers(e));
            }
        }
    }
    u.count += 1;
    Ok(Use {
        uses: Arc::clone(uses),
        disk: disk.clone(),
        image: u.mounted,
    })
}

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
/// unmount that waited [`GRACE`] whether a use came and went meanwhile.
#[derive(Debug, Default)]
pub(super) struct Uses {
    count: usize,
    epoch: u64,
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

/// One use of a sandbox's image (`image`: the device and inode of the
/// file it mounted): its end may unmount it.
#[derive(Debug)]
struct Use {
    uses: Arc<Mutex<Uses>>,
    disk: Disk,
    image: Option<(u64, u64)>,
}

impl Drop for Use {
    fn drop(&mut self) {
        let (uses, disk, image) = (Arc::clone(&self.uses), self.disk.clone(), self.image);
        let epoch = {
            let mut u = uses.lock().unwrap();
            u.count -= 1;
            if u.count > 0 {
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
                        let u = uses.lock().unwrap();
                        if u.count == 0 && u.epoch == epoch && identity(&disk) == image {
                            unmount(&disk);
                        }
                    })
                    .await;
                });
            }
            Err(_) => {
                let u = uses.lock().unwrap();
                if u.count == 0 && u.epoch == epoch && identity(&disk) == image {
                    unmount(&disk);
                }
            }
        }
    }
}

/// The device and inode of `disk`'s image file, if it has one.
fn identity(disk: &Disk) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(&disk.image)
        .ok()
        .filter(std::fs::Metadata::is_file)
        .map(|m| (m.dev(), m.ino()))
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
    /// The uses of the directory of the sandbox with id `id`.
    fn uses(&self, id: &str) -> Arc<Mutex<Uses>> {
        Arc::clone(
            self.mounts
                .lock()
                .unwrap()
                .entry(id.to_owned())
                .or_default(),
        )
    }

    /// Forget the uses of destroyed sandbox `sb` (kept while one is still
    /// held; its end finds the image gone).
    pub(super) fn forget_uses(&self, sb: &Sandbox) {
        self.let_go(&sb.name);
        let mut mounts = self.mounts.lock().unwrap();
        if mounts
            .get(&sb.id)
            .is_some_and(|u| Arc::strong_count(u) == 1)
        {
            mounts.remove(&sb.id);
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
        let (uses, disk, held) = (self.uses(&sb.id), self.disk(&sb.name), self.held());
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
        let (uses, disk) = (self.uses(&sb.id), self.disk(&sb.name));
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
        if self.snapshot(&sb.name).is_none_or(|now| now.id != sb.id) {
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
        let uses = self.uses(&sb.id);
        let _u = uses.lock().unwrap();
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
            let uses = self.uses(&sb.id);
            let u = uses.lock().unwrap();
            if u.count == 0 {
                unmount(&self.disk(&name));
            }
        }
    }
}

/// Why a use could not be taken.
enum Taken {
    Disk(crate::disk::DiskError),
    Layers(crate::snapshots::SnapshotError),
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
        }
    }
}

/// Another use of `disk` where it has one already.
fn one_more(uses: &Arc<Mutex<Uses>>, disk: &Disk) -> Option<Use> {
    let mut u = uses.lock().unwrap();
    (u.count > 0).then(|| {
        u.count += 1;
        Use {
            uses: Arc::clone(uses),
            disk: disk.clone(),
            image: identity(disk),
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
    let mut u = uses.lock().unwrap();
    if u.count == 0 {
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
        // Known from the image itself from now on (see the module's text).
        if crate::disk::is_mount_point(&disk.dir) {
            let _ = std::fs::remove_file(disk.held_list());
        }
        let dir = &disk.dir;
        crate::snapshots::finish_restore(dir);
        crate::layers::prune(dir, &crate::snapshots::TREES);
        for tree in crate::snapshots::TREES {
            if let Err(e) = crate::layers::mount(&dir.join(tree), held) {
                unmount(disk);
                return Err(Taken::Layers(e));
            }
        }
    }
    u.count += 1;
    Ok(Use {
        uses: Arc::clone(uses),
        disk: disk.clone(),
        image: identity(disk),
    })
}

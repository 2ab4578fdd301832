//! A sandbox's directories on the host: made (the workspace cloned from
//! the project), handed to the sandbox's ids, and removed, also where they
//! belong to a subordinate id (see [`crate::subid`]); its disk image.

use super::*;

impl Manager {
    /// The disk image of sandbox `name` (see [`crate::disk`]).
    pub(super) fn disk(&self, name: &str) -> crate::disk::Disk {
        crate::disk::Disk::new(self.store.registry().dir(), name)
    }

    /// Whether `backend` keeps a sandbox's data in its host directory, so
    /// that the disk image bounds it (microvm guests are NixOS's; a
    /// kubernetes sandbox's directory holds the copy of its git directory
    /// that syncs read).
    pub(super) fn has_disk_image(backend: BackendKind) -> bool {
        matches!(
            backend,
            BackendKind::Local | BackendKind::Vm | BackendKind::Kubernetes
        )
    }

    /// Mount sandbox `name`'s layered trees ([`crate::layers`]) where
    /// they are not: a sandbox whose trees cannot be does not start (its
    /// directory would show an empty place instead of its files).
    pub(super) async fn mount_layers(&self, name: &str) -> Result<()> {
        let (dir, held) = (self.store.registry().sandbox_dir(name), self.held());
        tokio::task::spawn_blocking(move || {
            crate::snapshots::TREES
                .iter()
                .try_for_each(|t| crate::layers::mount(&dir.join(t), &held))
        })
        .await
        .map_err(|e| snapshots::panicked_snapshot(name, &e))?
        .map_err(|source| Error::Snapshot {
            name: name.to_owned(),
            source,
        })
    }

    /// Unmount and delete sandbox `name`'s disk image. Its file system
    /// ends off the caller's path, at most [`super::ENDINGS_MAX`] at once:
    /// past that, on it.
    pub(super) async fn release_disk(&self, name: &str) {
        let disk = self.disk(name);
        end_off_path(&self.endings, move || disk.release_ending()).await;
    }

    /// Have a formatted image ready for the next create of `size_mib`
    /// ([`crate::disk::make_spare`]), made off the caller's path.
    pub(super) fn keep_spare(&self, size_mib: u32) {
        let state = self.store.registry().dir().to_owned();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = crate::disk::make_spare(&state, size_mib) {
                tracing::debug!(error = %e, "no spare disk image");
            }
        });
    }

    /// Check, as `uid`, that `path` is a readable git repository; its
    /// canonical path.
    pub(super) async fn check_project(
        &self,
        uid: u32,
        path: &Path,
    ) -> std::result::Result<PathBuf, HelperError> {
        if nix::unistd::Uid::effective().as_raw() == uid {
            let path = path.to_owned();
            return tokio::task::spawn_blocking(move || workspace::check_project(&path))
                .await
                .map_err(HelperError::failed)?
                .map_err(HelperError::from);
        }
        helpers::call::<auth::CheckProject>(
            &*self.helpers,
            RunAs::User(uid),
            &path.to_owned(),
            auth::CHECK_TIMEOUT,
        )
        .await
    }

    /// Make the sandbox's directories and, when it has none yet, its
    /// workspace: cloned by a helper running as the project's owner (so the
    /// owner's read access is what counts), then handed to the sandbox's uid.
    /// Returns notices for the person.
    /// The caller holds its directory [`Mounted`].
    pub(super) async fn prepare_dirs(&self, sb: &Sandbox) -> Result<Vec<String>> {
        self.mount_layers(&sb.name).await?;
        let spec = self.spec(sb);
        let dir = self.store.registry().sandbox_dir(&sb.name);
        let name = sb.name.clone();
        let wsfail = |source: WorkspaceError| Error::Workspace {
            name: name.clone(),
            source,
        };
        let owner = sb.owner;
        let (uid, gid) = (spec.uid, spec.gid);
        let root = nix::unistd::Uid::effective().is_root();
        let subordinate = subordinate(&spec);
        let partial = dir.join("workspace.partial");
        let blocking = |f: Box<dyn FnOnce() -> std::result::Result<(), WorkspaceError> + Send>| async {
            tokio::task::spawn_blocking(f)
                .await
                .map_err(|e| wsfail(HelperError::failed(e).into()))?
                .map_err(wsfail)
        };
        {
            let (dir, spec) = (dir.clone(), spec.clone());
            blocking(Box::new(move || {
                use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
                let mut b = std::fs::DirBuilder::new();
                b.recursive(true).mode(0o700);
                for d in [&dir, &spec.log_dir, &spec.run_dir, &spec.home] {
                    b.create(d).map_err(|source| WorkspaceError::Create {
                        path: d.clone(),
                        source,
                    })?;
                }
                // As root, the owner's and the sandbox's helpers pass through
                // to their own directories; everything else here stays
                // agentd's. Unprivileged, everything here is agentd's user's
                // alone: a sandbox with a subordinate id reaches its
                // directories only through namespaces that map that user.
                let mode = if root { 0o711 } else { 0o700 };
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).map_err(
                    |source| WorkspaceError::Permissions {
                        path: dir.clone(),
                        source,
                    },
                )
            }))
            .await?;
        }
        self.remove_tree(&partial).await.map_err(|source| {
            wsfail(WorkspaceError::Leftover {
                path: partial.clone(),
                source: Some(source),
            })
        })?;
        // An empty workspace directory is not a workspace (one always has
        // `.git`) but somebody else's: microvm.nix's tmpfiles rule makes
        // every share source at activation, before the first start. The
        // clone takes its place.
        // (A layered workspace, emptied by its sandbox, is its own.)
        if procfs::is_real_dir(&spec.workspace)
            && !crate::layers::token_file(&spec.workspace).exists()
            && std::fs::read_dir(&spec.workspace).is_ok_and(|mut d| d.next().is_none())
        {
            tracing::info!(sandbox = %sb.name, "the workspace directory is empty: cloning into its place");
            std::fs::remove_dir(&spec.workspace).map_err(|source| {
                wsfail(WorkspaceError::Foreign {
                    path: spec.workspace.clone(),
                    source,
                })
            })?;
        }
        // Files of a sandbox that ran under other ids (before each had its
        // own) follow it to its own.
        if root || subordinate {
            for d in [&spec.home, &spec.workspace] {
                use std::os::unix::fs::MetadataExt;
                let Ok(m) = std::fs::symlink_metadata(d) else {
                    continue;
                };
                if m.is_dir()
                    && (m.uid(), m.gid()) != (uid, gid)
                    && (d == &spec.home || uid != owner)
                {
                    self.hand_over(&spec, d, d == &spec.workspace)
                        .await
                        .map_err(wsfail)?;
                }
            }
        }
        let notices = Mutex::new(Vec::new());
        if !procfs::is_real_dir(&spec.workspace) {
            {
                let partial = partial.clone();
                blocking(Box::new(move || {
                    use std::os::unix::fs::DirBuilderExt;
                    std::fs::DirBuilder::new()
                        .mode(0o700)
                        .create(&partial)
                        .map_err(|source| WorkspaceError::Create {
                            path: partial.clone(),
                            source,
                        })?;
                    if root {
                        let ogid = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(owner))
                            .ok()
                            .flatten()
                            .map_or(owner, |u| u.gid.as_raw());
                        std::os::unix::fs::lchown(&partial, Some(owner), Some(ogid)).map_err(
                            |source| WorkspaceError::Permissions {
                                path: partial.clone(),
                                source,
                            },
                        )?;
                    }
                    Ok(())
                }))
                .await?;
            }
            let prep = workspace::PrepareSpec {
                project: sb.project_path.clone(),
                dest: partial.clone(),
                env_files: sb.config.env_files.clone(),
                git_identity: sb.config.git_identity.clone(),
            };
            let events = |e: workspace::PrepareEvent| match e {
                workspace::PrepareEvent::Progress { stage, done, total } => {
                    self.store.announce(Change::Progress {
                        name: name.clone(),
                        stage,
                        done,
                        total,
                    });
                }
                workspace::PrepareEvent::Notice { message } => {
                    tracing::info!(sandbox = %name, %message, "workspace");
                    notices.lock().unwrap().push(message);
                }
            };
            // Its settings are written while the clone runs (the save
            // below then finds them there).
            let config = {
                let (registry, sb) = (self.store.registry().clone(), sb.clone());
                tokio::task::spawn_blocking(move || registry.save_config(&sb))
            };
            let prepared = self.helpers.prepare(owner, &prep, &events).await;
            let _ = config.await;
            prepared.map_err(|e| wsfail(e.into()))?;
            {
                let partial = partial.clone();
                blocking(Box::new(move || {
                    use std::os::unix::fs::PermissionsExt;
                    // Unprivileged, agentd reads the workspace of a sandbox
                    // with a subordinate id as "others" (see
                    // TreeOp::HandOver); its directory above is agentd's.
                    let mode = if subordinate { 0o755 } else { 0o700 };
                    std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(mode))
                        .map_err(|source| WorkspaceError::Permissions {
                            path: partial.clone(),
                            source,
                        })
                }))
                .await?;
            }
            if (root || subordinate) && uid != owner {
                self.hand_over(&spec, &partial, true)
                    .await
                    .map_err(wsfail)?;
            }
            let (partial, ws) = (partial.clone(), spec.workspace.clone());
            blocking(Box::new(move || {
                std::fs::rename(&partial, &ws).map_err(|source| WorkspaceError::Rename {
                    path: partial.clone(),
                    source,
                })
            }))
            .await?;
        }
        self.store.registry().save_config(sb)?;
        Ok(notices.into_inner().unwrap())
    }

    /// Give the tree at `path` to the ids of `spec`'s sandbox: directly as
    /// root, through the tree helper for a subordinate id (`workspace` then
    /// stays readable to agentd's user, see [`workspace::TreeOp`]).
    pub(super) async fn hand_over(
        &self,
        spec: &SandboxSpec,
        path: &Path,
        workspace: bool,
    ) -> std::result::Result<(), WorkspaceError> {
        let (uid, gid, path) = (spec.uid, spec.gid, path.to_owned());
        if nix::unistd::Uid::effective().is_root() {
            return tokio::task::spawn_blocking(move || {
                crate::fsutil::chown_tree(&path, uid, gid)
                    .map_err(|source| WorkspaceError::Permissions { path, source })
            })
            .await
            .map_err(|e| WorkspaceError::Helper(HelperError::failed(e)))?;
        }
        let op = workspace::TreeOp::HandOver {
            path: path.clone(),
            uid,
            gid,
            readable: workspace,
        };
        Ok(self.tree_helper((uid, gid), &path, &op).await?)
    }

    /// Run the tree helper ([`workspace::Tree`]) with the sandbox ids `ids`
    /// mapped, seeing only `path`.
    async fn tree_helper(
        &self,
        ids: (u32, u32),
        path: &Path,
        op: &workspace::TreeOp,
    ) -> std::result::Result<(), HelperError> {
        let run_as = RunAs::WithIds {
            ids,
            keep: vec![path.to_owned()],
        };
        helpers::call::<workspace::Tree>(&*self.helpers, run_as, op, TREE_TIMEOUT).await
    }

    /// Remove the tree at `path` (a sandbox's directory, or a workspace
    /// being made). An unprivileged agentd first empties, with the tree
    /// helper, the directories there that belong to one of its subordinate
    /// ids: `path` itself or those right below it (the workspace, the home).
    pub(super) async fn remove_tree(&self, path: &Path) -> std::io::Result<()> {
        use std::os::unix::fs::MetadataExt;
        if let (false, Ok(pool)) = (
            nix::unistd::Uid::effective().is_root(),
            crate::subid::pool(),
        ) {
            let below = std::fs::read_dir(path)
                .into_iter()
                .flatten()
                .filter_map(|e| Some(e.ok()?.path()));
            let dirs: Vec<PathBuf> = std::iter::once(path.to_owned()).chain(below).collect();
            for dir in dirs {
                let Ok(m) = std::fs::symlink_metadata(&dir) else {
                    continue;
                };
                let Some(gid) = pool.gid_for(m.uid()).filter(|_| m.is_dir()) else {
                    continue;
                };
                let op = workspace::TreeOp::Empty { path: dir.clone() };
                if let Err(e) = self.tree_helper((m.uid(), gid), &dir, &op).await {
                    tracing::warn!(path = %dir.display(), error = %e, "cannot empty a sandbox's directory");
                }
            }
        }
        let path = path.to_owned();
        tokio::task::spawn_blocking(move || crate::fsutil::remove_tree(&path))
            .await
            .map_err(std::io::Error::other)?
    }
}

/// Longest the tree helper may take.
const TREE_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// Whether `spec`'s sandbox runs as a subordinate id of an unprivileged
/// agentd's user (see [`crate::subid`]).
pub(super) fn subordinate(spec: &SandboxSpec) -> bool {
    let me = nix::unistd::Uid::effective();
    !me.is_root() && spec.uid != me.as_raw()
}

impl Manager {
    /// Make sandbox `sb`'s shared agent home ready for its start (blocking):
    /// the owner's directory (agentd's own, 0700; as root, the mount point
    /// of its own ext4 image, `<uid>.img` beside it) and each agent's
    /// directory in it. Every sandbox that shares it can change what is inside, so
    /// nothing below the owner's directory is ever followed or changed
    /// here: a directory is only made where nothing is.
    pub(super) fn prepare_shared_home(&self, spec: &crate::backend::SandboxSpec) -> Result<()> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let Some(dir) = &spec.agent_home else {
            return Ok(());
        };
        let me = nix::unistd::geteuid();
        if !me.is_root() && spec.uid != me.as_raw() {
            return Err(Error::Invalid(vec![format!(
                "sandbox '{}': agent_home \"shared\" needs agentd as root, or sandboxes that run as \
                 agentd's user (this one runs as uid {}, from subordinate ids); use \"own\"",
                spec.name, spec.uid
            )]));
        }
        let name = spec.name.clone();
        let fail = |source: WorkspaceError| Error::Workspace {
            name: name.clone(),
            source,
        };
        let create = |d: &Path| match std::fs::DirBuilder::new().mode(0o700).create(d) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                Err(fail(WorkspaceError::Create {
                    path: d.to_owned(),
                    source: e,
                }))
            }
            _ => Ok(()),
        };
        let parent = dir.parent().expect("agent-homes/<uid>");
        create(parent)?;
        // Its own ext4 image (as a sandbox's directory has), so that no
        // sandbox can fill the host's file system through it: the first
        // sandbox of the owner to use it sets its size (its `disk`).
        if me.is_root() {
            let disk = crate::disk::Disk {
                image: dir.with_extension("img"),
                dir: dir.clone(),
            };
            if let Err(e) = disk.ensure(spec.config.disk) {
                tracing::warn!(sandbox = %spec.name, dir = %dir.display(), error = %e, "the shared agent home is not size-limited");
            }
        }
        for d in [parent, dir.as_path()] {
            create(d)?;
            // These two are agentd's alone (no sandbox sees the parent, and
            // none can replace the shared directory itself).
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).map_err(
                |source| {
                    fail(WorkspaceError::Permissions {
                        path: d.to_owned(),
                        source,
                    })
                },
            )?;
        }
        for agent in ["claude", "codex", "gemini"] {
            create(&dir.join(agent))?;
        }
        Ok(())
    }
}

/// Run `release` (blocking) and drop what it returns: off the caller's
/// path while one of `endings`' permits is free, held until the drop is
/// over; on it when none is (nobody waits for another's ending).
pub(super) async fn end_off_path<T: Send + 'static>(
    endings: &Arc<tokio::sync::Semaphore>,
    release: impl FnOnce() -> Option<T> + Send + 'static,
) {
    let Ok(Some(ending)) = tokio::task::spawn_blocking(release).await else {
        return;
    };
    match Arc::clone(endings).try_acquire_owned() {
        Ok(permit) => drop(tokio::task::spawn_blocking(move || {
            drop(ending);
            drop(permit);
        })),
        Err(_) => drop(tokio::task::spawn_blocking(move || drop(ending)).await),
    }
}

//! The manager's rules, with a fake backend and fake helpers: what it asks
//! of them, in which order, and what it records when they fail.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::*;
use crate::backend::{BackendError, Listener, Runtime, TtyProcess};
use crate::git::sync::{ReadReport, WriteReport};
use crate::git::workspace::{PrepareEvent, PrepareSpec};
use crate::sandbox::helpers::Call;

/// A backend that starts nothing: `start` answers a made-up runtime,
/// `stop` fails when told to.
#[derive(Debug, Default)]
struct FakeBackend {
    stop_fails: Mutex<Option<String>>,
    stops: AtomicUsize,
    /// `kill_strays` panics (a scan that went wrong).
    strays_panic: std::sync::atomic::AtomicBool,
}

impl Backend for FakeBackend {
    fn kind(&self) -> BackendKind {
        // A backend without a disk image, so no loop device is made.
        BackendKind::Microvm
    }

    fn start<'a>(
        &'a self,
        _: &'a SandboxSpec,
    ) -> BoxFut<'a, std::result::Result<Runtime, BackendError>> {
        Box::pin(async {
            Ok(Runtime {
                supervisor_pid: 0,
                init_pid: 0,
                init_start_time: 0,
                pid_ns: 0,
                limits: String::new(),
                unit: String::new(),
                agents: String::new(),
                pod: None,
            })
        })
    }

    fn stop<'a>(
        &'a self,
        _: &'a SandboxSpec,
        _: &'a Runtime,
        _: bool,
    ) -> BoxFut<'a, std::result::Result<(), BackendError>> {
        self.stops.fetch_add(1, Ordering::SeqCst);
        let fails = self.stop_fails.lock().unwrap().clone();
        Box::pin(async move {
            fails.map_or(Ok(()), |m| {
                Err(BackendError::Descriptor(std::io::Error::other(m)))
            })
        })
    }

    fn exec<'a>(
        &'a self,
        _: &'a SandboxSpec,
        _: ExecRequest,
        _: [std::os::fd::OwnedFd; 3],
    ) -> BoxFut<'a, std::result::Result<i32, BackendError>> {
        Box::pin(async { Ok(0) })
    }

    fn exec_tty<'a>(
        &'a self,
        _: &'a SandboxSpec,
        _: ExecRequest,
        _: (u16, u16),
    ) -> BoxFut<'a, std::result::Result<TtyProcess, BackendError>> {
        Box::pin(async {
            Err(BackendError::SessionsUnavailable(Arc::new(
                crate::tools::ZellijError::NotFound,
            )))
        })
    }

    fn listeners(&self, _: &Runtime) -> Vec<Listener> {
        Vec::new()
    }

    fn connect<'a>(
        &'a self,
        _: &'a SandboxSpec,
        _: std::net::IpAddr,
        _: u16,
    ) -> BoxFut<'a, std::result::Result<std::os::fd::OwnedFd, BackendError>> {
        Box::pin(async {
            Err(BackendError::Descriptor(std::io::Error::other(
                "no connections here",
            )))
        })
    }

    fn is_alive(&self, _: &Runtime) -> bool {
        true
    }

    fn wait_exit<'a>(&'a self, _: &'a Runtime) -> BoxFut<'a, ()> {
        Box::pin(std::future::pending())
    }

    fn kill_strays(&self, _: &[(String, Runtime)]) -> Vec<String> {
        assert!(
            !self.strays_panic.load(Ordering::SeqCst),
            "the stray scan went wrong"
        );
        Vec::new()
    }
}

/// Helpers that record what they are asked. `prepare` makes an empty
/// repository; `call` answers from `replies`; `transfer` answers a report,
/// or, with `hold`, runs until it is dropped.
#[derive(Debug, Default)]
struct FakeHelpers {
    calls: Mutex<Vec<Call>>,
    replies: Mutex<VecDeque<std::result::Result<String, HelperError>>>,
    transfers: Mutex<Vec<Transfer>>,
    transfer_fails: Mutex<Option<String>>,
    hold: AtomicBool,
    entered: tokio::sync::Notify,
    running: AtomicUsize,
    most_at_once: AtomicUsize,
    /// For each held operation that was dropped: whether the workspace was
    /// still there when it was.
    dropped: Mutex<Vec<bool>>,
}

/// Counts a running operation and, once dropped, notes whether `path`
/// still existed.
struct Running<'a>(&'a FakeHelpers, PathBuf);

impl<'a> Running<'a> {
    fn new(h: &'a FakeHelpers, path: PathBuf) -> Self {
        let now = h.running.fetch_add(1, Ordering::SeqCst) + 1;
        h.most_at_once.fetch_max(now, Ordering::SeqCst);
        h.entered.notify_one();
        Self(h, path)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
        self.0.dropped.lock().unwrap().push(self.1.exists());
    }
}

impl FakeHelpers {
    async fn hold_or_pass(&self, path: PathBuf) {
        let _running = Running::new(self, path);
        if self.hold.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        tokio::task::yield_now().await;
    }
}

impl Helpers for FakeHelpers {
    fn call(&self, call: Call) -> BoxFut<'_, std::result::Result<String, HelperError>> {
        // Only a helper in the sandbox's reach can be held up by it; one
        // that runs as the owner on the host (the remote's removal) cannot.
        let keep = match &call.run_as {
            RunAs::Confined { keep, .. } | RunAs::WithIds { keep, .. } => Some(keep[0].clone()),
            RunAs::User(_) => None,
        };
        self.calls.lock().unwrap().push(call);
        Box::pin(async move {
            if let Some(keep) = keep {
                self.hold_or_pass(keep).await;
            }
            self.replies
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or_else(|| Ok("null".to_owned()))
        })
    }

    fn prepare<'a>(
        &'a self,
        _: u32,
        spec: &'a PrepareSpec,
        events: &'a (dyn Fn(PrepareEvent) + Send + Sync),
    ) -> BoxFut<'a, std::result::Result<(), HelperError>> {
        Box::pin(async move {
            git2::Repository::init(&spec.dest).map_err(HelperError::failed)?;
            events(PrepareEvent::Notice {
                message: "made by the fake".to_owned(),
            });
            Ok(())
        })
    }

    fn transfer(&self, t: Transfer) -> BoxFut<'_, std::result::Result<WriteReport, HelperError>> {
        let workspace = match &t.from.run_as {
            RunAs::Confined { keep, .. } => keep[0].clone(),
            _ => t.to.path.clone(),
        };
        self.transfers.lock().unwrap().push(t);
        Box::pin(async move {
            self.hold_or_pass(workspace).await;
            match self.transfer_fails.lock().unwrap().clone() {
                Some(m) => Err(HelperError::Failed(m)),
                None => Ok(WriteReport {
                    read: ReadReport::default(),
                    ..WriteReport::default()
                }),
            }
        })
    }
}

struct Fixture {
    manager: Arc<Manager>,
    backend: Arc<FakeBackend>,
    helpers: Arc<FakeHelpers>,
    me: Caller,
    project: PathBuf,
    _tmp: tempfile::TempDir,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let project = tmp.path().join("demo");
    let repo = git2::Repository::init(&project).unwrap();
    let sig = git2::Signature::now("t", "t@example.com").unwrap();
    let tree = repo.treebuilder(None).unwrap().write().unwrap();
    let tree = repo.find_tree(tree).unwrap();
    repo.commit(Some("HEAD"), &sig, &sig, "first", &tree, &[])
        .unwrap();
    let (registry, sandboxes) = Registry::open(&tmp.path().join("state")).unwrap();
    let backend = Arc::new(FakeBackend::default());
    let helpers = Arc::new(FakeHelpers::default());
    let manager = Manager::new(
        registry,
        sandboxes,
        ManagerSettings {
            default_backend: BackendKind::Microvm,
            defaults: SandboxConfig::default(),
            egress: crate::config::EgressConfig::default(),
            declared_secrets: std::collections::BTreeMap::new(),
            declared_forges: std::collections::BTreeMap::new(),
            audit: crate::audit::AuditConfig::default(),
        },
        vec![Arc::clone(&backend) as Arc<dyn Backend>],
        Arc::clone(&helpers) as Arc<dyn Helpers>,
    );
    Fixture {
        manager,
        backend,
        helpers,
        me: Caller {
            uid: nix::unistd::Uid::effective().as_raw(),
        },
        project: std::fs::canonicalize(project).unwrap(),
        _tmp: tmp,
    }
}

impl Fixture {
    async fn create(&self) -> Sandbox {
        let (sb, notices) = self
            .manager
            .create(self.me, &self.project, CreateOptions::default())
            .await
            .unwrap();
        assert_eq!(notices, ["made by the fake"]);
        sb
    }

    fn workspace(&self, name: &str) -> PathBuf {
        self.manager
            .store
            .registry()
            .sandbox_dir(name)
            .join("workspace")
    }
}

#[tokio::test]
async fn a_sandbox_is_created_stopped_started_and_refuses_a_second_start() {
    let f = fixture();
    let sb = f.create().await;
    assert_eq!(sb.name, "demo");
    assert_eq!(sb.state, SandboxState::Created);
    assert!(f.workspace("demo").join(".git").is_dir());
    let sb = f.manager.start(f.me, "demo").await.unwrap();
    assert_eq!(sb.state, SandboxState::Running);
    let err = f.manager.start(f.me, "demo").await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidState {
                state: SandboxState::Running,
                ..
            }
        ),
        "{err:?}"
    );
    let sb = f.manager.stop(f.me, "demo", false).await.unwrap();
    assert_eq!(sb.state, SandboxState::Stopped);
    assert!(sb.runtime.is_none());
}

#[tokio::test]
async fn a_failed_stop_ends_in_error_with_the_reason() {
    let f = fixture();
    f.create().await;
    f.manager.start(f.me, "demo").await.unwrap();
    *f.backend.stop_fails.lock().unwrap() = Some("the unit would not stop".into());
    let err = f.manager.stop(f.me, "demo", false).await.unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    let sb = f.manager.snapshot("demo").unwrap();
    assert_eq!(sb.state, SandboxState::Error);
    assert!(
        sb.state_reason.contains("the unit would not stop"),
        "{}",
        sb.state_reason
    );
    assert_eq!(f.backend.stops.load(Ordering::SeqCst), 1);
    // From error, it can be started again or destroyed.
    let err = f.manager.stop(f.me, "demo", false).await.unwrap_err();
    assert!(
        err.to_string().contains("started again or destroyed"),
        "{err}"
    );
    f.manager.destroy(f.me, "demo").await.unwrap();
    assert!(f.manager.snapshot("demo").is_none());
}

#[tokio::test]
async fn a_sync_reads_as_the_sandbox_confined_and_writes_as_the_owner() {
    let f = fixture();
    f.create().await;
    let ws = f.workspace("demo");
    let uid = f.manager.spec(&f.manager.snapshot("demo").unwrap()).uid;
    f.manager
        .sync(f.me, "demo", SyncOptions::default())
        .await
        .unwrap();
    f.manager
        .sync(
            f.me,
            "demo",
            SyncOptions {
                from_host: true,
                ..SyncOptions::default()
            },
        )
        .await
        .unwrap();
    let t = f.helpers.transfers.lock().unwrap().clone();
    assert_eq!(t.len(), 2);
    // To the host: the sandbox's side reads, seeing only its workspace.
    assert_eq!(t[0].from.run_as, RunAs::confined(uid, &ws));
    assert_eq!(t[0].from.path, ws.join(".git"));
    assert_eq!(t[0].to.run_as, RunAs::User(f.me.uid));
    assert_eq!(t[0].spec.repo, f.project);
    assert_eq!(t[0].spec.prefix, "refs/remotes/sandbox/demo/");
    // From the host: the other way round, into refs/remotes/host/.
    assert_eq!(t[1].from.run_as, RunAs::User(f.me.uid));
    assert_eq!(t[1].to.run_as, RunAs::confined(uid, &ws));
    assert_eq!(t[1].spec.prefix, "refs/remotes/host/");
    assert_eq!(t[1].spec.into, None);
    let sb = f.manager.snapshot("demo").unwrap();
    assert!(
        sb.last_sync_result.starts_with("from-host: 0 branch(es)"),
        "{}",
        sb.last_sync_result
    );
}

#[tokio::test]
async fn bad_sync_options_are_all_listed_and_nothing_runs() {
    let f = fixture();
    f.create().await;
    let err = f
        .manager
        .sync(
            f.me,
            "demo",
            SyncOptions {
                from_host: true,
                into: Some("..bad".into()),
                ..SyncOptions::default()
            },
        )
        .await
        .unwrap_err();
    let Error::Invalid(problems) = err else {
        panic!("{err:?}");
    };
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(f.helpers.transfers.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_failed_sync_is_recorded_with_its_reason() {
    let f = fixture();
    f.create().await;
    *f.helpers.transfer_fails.lock().unwrap() = Some("object too large".into());
    let err = f
        .manager
        .sync(f.me, "demo", SyncOptions::default())
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "Sync of sandbox 'demo' failed: object too large"
    );
    let sb = f.manager.snapshot("demo").unwrap();
    assert_eq!(sb.last_sync_result, "to-host: failed: object too large");
}

#[tokio::test]
async fn two_syncs_of_one_sandbox_never_overlap() {
    let f = fixture();
    f.create().await;
    let runs = (0..4).map(|_| {
        let m = Arc::clone(&f.manager);
        let me = f.me;
        tokio::spawn(async move { m.sync(me, "demo", SyncOptions::default()).await })
    });
    for r in runs.collect::<Vec<_>>() {
        r.await.unwrap().unwrap();
    }
    assert_eq!(f.helpers.transfers.lock().unwrap().len(), 4);
    assert_eq!(f.helpers.most_at_once.load(Ordering::SeqCst), 1);
}

/// Run `op` on sandbox `demo` with the helpers holding it, destroy the
/// sandbox meanwhile, and check that the operation was cut short while the
/// workspace was still there, and that the destroy finished.
async fn destroy_while_held<T: std::fmt::Debug + Send + 'static>(
    op: impl FnOnce(Arc<Manager>, Caller) -> BoxFut<'static, Result<T>>,
) {
    let f = fixture();
    f.create().await;
    f.helpers.hold.store(true, Ordering::SeqCst);
    let running = tokio::spawn(op(Arc::clone(&f.manager), f.me));
    f.helpers.entered.notified().await;
    // Bounded: a destroy that waited for the held operation would hang.
    tokio::time::timeout(Duration::from_secs(20), f.manager.destroy(f.me, "demo"))
        .await
        .expect("destroy waits for nothing the sandbox holds")
        .unwrap();
    let err = running.await.unwrap().unwrap_err();
    assert!(err.to_string().contains("cut short"), "{err}");
    // The helper ended while the workspace was still there.
    assert_eq!(*f.helpers.dropped.lock().unwrap(), [true]);
    assert!(!f.workspace("demo").exists());
    assert!(f.manager.snapshot("demo").is_none());
}

#[tokio::test]
async fn destroy_cuts_a_running_sync_short_before_it_removes_the_workspace() {
    destroy_while_held(|m, me| {
        Box::pin(async move { m.sync(me, "demo", SyncOptions::default()).await })
    })
    .await;
}

#[tokio::test]
async fn destroy_cuts_a_running_worktree_operation_short_too() {
    destroy_while_held(|m, me| {
        Box::pin(async move { m.add_worktree(me, "demo", "feat", None).await })
    })
    .await;
}

#[tokio::test]
async fn worktree_operations_run_as_the_sandbox_and_keep_the_helpers_kind_of_failure() {
    let f = fixture();
    f.create().await;
    let ws = f.workspace("demo");
    let uid = f.manager.spec(&f.manager.snapshot("demo").unwrap()).uid;
    let info = keystone_agent_api::WorktreeInfo {
        branch: "feat".into(),
        path: "/workspace/.worktrees/feat".into(),
        head: String::new(),
        dirty: false,
        has_host_branch: false,
        ahead: 0,
        behind: 0,
        main: false,
        session: String::new(),
    };
    let reply = serde_json::to_string(&worktree::Reply::Added(info.clone())).unwrap();
    f.helpers.replies.lock().unwrap().extend([
        Ok(reply),
        Err(HelperError::Conflict("feat has uncommitted changes".into())),
        Err(HelperError::Invalid("'x' is not a branch".into())),
        Ok("{\"op\":\"removed\"}".into()),
    ]);
    let got = f
        .manager
        .add_worktree(f.me, "demo", "feat", None)
        .await
        .unwrap();
    assert_eq!(got, info);
    let err = f
        .manager
        .remove_worktree(f.me, "demo", "feat", false)
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "Sandbox 'demo': feat has uncommitted changes"
    );
    assert!(matches!(err, Error::Conflict(_)));
    let err = f
        .manager
        .remove_worktree(f.me, "demo", "x", false)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Invalid(_)), "{err:?}");
    // A reply of the wrong kind is an error, not a success.
    let err = f
        .manager
        .list_worktrees_raw(f.me, "demo")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("unexpected answer"), "{err}");
    let calls = f.helpers.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 4);
    for c in &calls {
        assert_eq!(c.arg, "__worktree");
        assert_eq!(c.run_as, RunAs::confined(uid, &ws));
    }
    let first: worktree::Request = serde_json::from_str(&calls[0].request).unwrap();
    assert!(
        matches!(&first, worktree::Request::Add { workspace, branch, from: None } if *workspace == ws && branch == "feat"),
        "{first:?}"
    );
}

#[tokio::test]
async fn another_user_can_neither_see_nor_touch_a_sandbox() {
    let f = fixture();
    f.create().await;
    let other = Caller {
        uid: f.me.uid.wrapping_add(4242),
    };
    if other.is_root() {
        return;
    }
    assert!(f.manager.list(other).is_empty());
    for err in [
        f.manager.start(other, "demo").await.unwrap_err(),
        f.manager.destroy(other, "demo").await.unwrap_err(),
        f.manager
            .sync(other, "demo", SyncOptions::default())
            .await
            .unwrap_err(),
        f.manager
            .add_worktree(other, "demo", "feat", None)
            .await
            .unwrap_err(),
    ] {
        assert!(matches!(err, Error::PermissionDenied(_)), "{err:?}");
    }
    assert!(f.helpers.transfers.lock().unwrap().is_empty());
    assert!(f.helpers.calls.lock().unwrap().is_empty());
    assert!(f.manager.snapshot("demo").is_some());
}

#[tokio::test]
async fn destroy_removes_the_remote_a_sync_added_as_the_projects_owner() {
    let f = fixture();
    f.create().await;
    f.manager
        .sync(f.me, "demo", SyncOptions::default())
        .await
        .unwrap();
    f.manager.destroy(f.me, "demo").await.unwrap();
    let calls = f.helpers.calls.lock().unwrap();
    let removals: Vec<&Call> = calls
        .iter()
        .filter(|c| c.arg == <crate::git::remote::RemoveRemote as crate::helper::Helper>::ARG)
        .collect();
    // Once, although both the registry and the sandbox's record name it.
    assert_eq!(removals.len(), 1, "{calls:?}");
    assert_eq!(removals[0].run_as, RunAs::User(f.me.uid));
    let req: crate::git::remote::Request = serde_json::from_str(&removals[0].request).unwrap();
    assert_eq!(req.repo, f.project);
    assert_eq!(req.name, "sandbox/demo");
    assert_eq!(req.url, f.workspace("demo").to_string_lossy());
}

#[tokio::test]
async fn a_destroy_whose_stray_scan_fails_forgets_nothing() {
    let f = fixture();
    f.create().await;
    f.backend.strays_panic.store(true, Ordering::SeqCst);
    let err = f.manager.destroy(f.me, "demo").await.unwrap_err();
    assert!(
        err.to_string()
            .contains("The sandbox is still registered, and may not work until it is destroyed: run `agentctl destroy demo` again"),
        "{err}"
    );
    // Still registered (its processes may still run), its syncs not cut
    // short, and it can be destroyed again.
    assert!(f.manager.snapshot("demo").is_some());
    f.manager
        .sync(f.me, "demo", SyncOptions::default())
        .await
        .unwrap();
    f.backend.strays_panic.store(false, Ordering::SeqCst);
    f.manager.destroy(f.me, "demo").await.unwrap();
    assert!(f.manager.snapshot("demo").is_none());
}

#[tokio::test]
async fn a_destroy_whose_record_cannot_be_removed_keeps_the_sandbox() {
    let f = fixture();
    f.create().await;
    // Where the record is, something it cannot be removed as.
    let record = f.manager.store.registry().record("demo");
    std::fs::remove_file(&record).unwrap();
    std::fs::create_dir_all(record.join("in-the-way")).unwrap();
    let err = f.manager.destroy(f.me, "demo").await.unwrap_err();
    assert!(
        err.to_string()
            .contains("its registry record could not be removed"),
        "{err}"
    );
    // Still known, its directory kept (a start would otherwise load a
    // record whose directory is gone), and it can be destroyed again.
    assert!(f.manager.snapshot("demo").is_some());
    assert!(f.manager.store.registry().sandbox_dir("demo").exists());
    std::fs::remove_dir_all(&record).unwrap();
    f.manager.destroy(f.me, "demo").await.unwrap();
    assert!(f.manager.snapshot("demo").is_none());
}

#[tokio::test]
async fn a_sync_that_cannot_note_its_remote_adds_none() {
    let f = fixture();
    f.create().await;
    // Where the note goes, something it cannot be written over.
    let note = f
        .manager
        .store
        .registry()
        .sandbox_dir("demo")
        .join("host-remote.json");
    std::fs::create_dir_all(note.join("in-the-way")).unwrap();
    let err = f
        .manager
        .sync(f.me, "demo", SyncOptions::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("cannot note the remote"), "{err}");
    assert!(f.helpers.transfers.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_so_many_file_systems_end_off_the_callers_path_and_the_rest_on_it() {
    use std::sync::atomic::AtomicUsize;
    /// An ending that lasts until the test lets it go.
    struct Ending(Arc<(AtomicUsize, Mutex<bool>, std::sync::Condvar)>);
    impl Drop for Ending {
        fn drop(&mut self) {
            let (now, gone, cv) = &*self.0;
            now.fetch_add(1, Ordering::SeqCst);
            // Bounded, so that a failing test ends.
            let wait = Duration::from_secs(10);
            drop(cv.wait_timeout_while(gone.lock().unwrap(), wait, |g| !*g));
            now.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let endings = Arc::new(tokio::sync::Semaphore::new(super::ENDINGS_MAX));
    let state = Arc::new((
        AtomicUsize::new(0),
        Mutex::new(false),
        std::sync::Condvar::new(),
    ));
    let returned = Arc::new(AtomicUsize::new(0));
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..10 {
        let (endings, state, returned) = (
            Arc::clone(&endings),
            Arc::clone(&state),
            Arc::clone(&returned),
        );
        calls.spawn(async move {
            super::dirs::end_off_path(&endings, move || Some(Ending(state))).await;
            returned.fetch_add(1, Ordering::SeqCst);
        });
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let wait = |what: &'static str, done: &dyn Fn() -> bool| {
        assert!(std::time::Instant::now() < deadline, "{what}");
        !done()
    };
    while wait("the endings never began", &|| {
        state.0.load(Ordering::SeqCst) == 10
    }) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    while wait("four callers never went on", &|| {
        returned.load(Ordering::SeqCst) >= 4
    }) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Four went on while theirs end; the six others wait for their own.
    assert_eq!(returned.load(Ordering::SeqCst), super::ENDINGS_MAX);
    // Nothing to end takes no permit and waits for nothing.
    super::dirs::end_off_path(&endings, || None::<Ending>).await;
    *state.1.lock().unwrap() = true;
    state.2.notify_all();
    while calls.join_next().await.is_some() {}
    while wait("the endings never ended", &|| {
        state.0.load(Ordering::SeqCst) == 0
    }) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(returned.load(Ordering::SeqCst), 10);
    assert_eq!(endings.available_permits(), super::ENDINGS_MAX);
}

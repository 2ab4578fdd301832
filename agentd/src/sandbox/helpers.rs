//! What the manager needs of agentd's helper processes, as one trait
//! ([`Helpers`]) so that the manager's rules can be tested with a fake: the
//! real one ([`Processes`]) starts the helpers of [`crate::helper`].

use std::fmt::Debug;
use std::path::PathBuf;
use std::time::Duration;

use crate::backend::BoxFut;
use crate::git::sync::WriteReport;
use crate::git::transfer::{self, Transfer};
use crate::git::workspace::{Prepare, PrepareEvent, PrepareSpec};
use crate::helper::{self, Helper, HelperError, RunAs};

/// One request to a request/reply helper, untyped (see [`call`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// [`Helper::ARG`].
    pub arg: &'static str,
    /// [`Helper::WHAT`].
    pub what: &'static str,
    /// Whom it acts as.
    pub run_as: RunAs,
    /// The request, as JSON.
    pub request: String,
    /// Its time.
    pub timeout: Duration,
}

/// Runs agentd's helpers for the manager.
pub trait Helpers: Send + Sync + Debug {
    /// Run a request/reply helper; its reply, as JSON.
    fn call(&self, call: Call) -> BoxFut<'_, Result<String, HelperError>>;

    /// Clone a project into a workspace as `owner` ([`Prepare`]), passing
    /// on its events.
    fn prepare<'a>(
        &'a self,
        owner: u32,
        spec: &'a PrepareSpec,
        events: &'a (dyn Fn(PrepareEvent) + Send + Sync),
    ) -> BoxFut<'a, Result<(), HelperError>>;

    /// Move branches from one repository to another (the two sync helpers).
    fn transfer(&self, t: Transfer) -> BoxFut<'_, Result<WriteReport, HelperError>>;
}

/// Run helper `H` through `helpers`, typed.
pub async fn call<H: Helper>(
    helpers: &dyn Helpers,
    run_as: RunAs,
    req: &H::Request,
    timeout: Duration,
) -> Result<H::Reply, HelperError> {
    let request = serde_json::to_string(req).map_err(HelperError::failed)?;
    let reply = helpers
        .call(Call {
            arg: H::ARG,
            what: H::WHAT,
            run_as,
            request,
            timeout,
        })
        .await?;
    helper::spawn::parse_reply(H::WHAT, &reply)
}

/// The real helpers: agentd's binary `exe` started again.
#[derive(Debug)]
pub struct Processes {
    exe: PathBuf,
}

impl Processes {
    /// Helpers of the agentd binary `exe`.
    #[must_use]
    pub fn new(exe: PathBuf) -> Self {
        Self { exe }
    }
}

/// Longest a workspace may take to clone.
const PREPARE_TIMEOUT: Duration = Duration::from_secs(60 * 60);

impl Helpers for Processes {
    fn call(&self, call: Call) -> BoxFut<'_, Result<String, HelperError>> {
        Box::pin(async move {
            helper::spawn::run_raw(
                &self.exe,
                (call.arg, call.what),
                &call.run_as,
                &call.request,
                call.timeout,
            )
            .await
        })
    }

    fn prepare<'a>(
        &'a self,
        owner: u32,
        spec: &'a PrepareSpec,
        events: &'a (dyn Fn(PrepareEvent) + Send + Sync),
    ) -> BoxFut<'a, Result<(), HelperError>> {
        Box::pin(async move {
            let run = async {
                let mut running =
                    helper::start::<Prepare>(&self.exe, &RunAs::User(owner), spec).await?;
                running.close_input();
                while let Some(line) = running.next_line().await? {
                    if let Ok(e) = serde_json::from_str::<PrepareEvent>(&line) {
                        events(e);
                    }
                }
                running.finish().await
            };
            tokio::time::timeout(PREPARE_TIMEOUT, run)
                .await
                .map_err(|_| HelperError::TimedOut {
                    what: "workspace preparation",
                    after: PREPARE_TIMEOUT,
                })?
        })
    }

    fn transfer(&self, t: Transfer) -> BoxFut<'_, Result<WriteReport, HelperError>> {
        Box::pin(transfer::run(&self.exe, t))
    }
}

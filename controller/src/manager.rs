//! Run several controllers on one shutdown token.
//!
//! ```ignore
//! let mut m = Manager::new(leader.token());
//! m.add("vm", Controller::<Vm>::new(store.clone()).run(vm::reconcile, vm::error_policy, ctx.clone(), m.token()));
//! m.add("image", Controller::<Image>::new(store.clone()).run(image::reconcile, default_error_policy, ctx, m.token()));
//! m.run().await?;
//! ```
//!
//! # Guarantees
//! - [`Manager::run`] returns once every controller has returned. It cancels the token as soon
//!   as one controller stops on its own (returns or panics) before shutdown, so that the rest
//!   stop too: a half-running control plane is worse than none.

use std::collections::HashMap;
use std::future::Future;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// A controller of a [`Manager`] stopped on its own.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// A controller returned before shutdown was requested.
    #[error("controller {name} stopped before shutdown was requested; the others were stopped too")]
    Stopped {
        /// The controller's name.
        name: String,
    },
    /// A controller panicked.
    #[error("controller {name} panicked; the others were stopped")]
    Panicked {
        /// The controller's name.
        name: String,
        /// The task's error.
        #[source]
        source: tokio::task::JoinError,
    },
}

/// Several controllers (any futures) run together on one token.
#[derive(Debug)]
pub struct Manager {
    token: CancellationToken,
    tasks: JoinSet<()>,
    names: HashMap<tokio::task::Id, String>,
}

impl Manager {
    /// A manager whose controllers stop when `shutdown` is cancelled.
    pub fn new(shutdown: CancellationToken) -> Self {
        Manager {
            token: shutdown,
            tasks: JoinSet::new(),
            names: HashMap::new(),
        }
    }

    /// The token to give each controller's `run`.
    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    /// Start a controller (spawned at once on the current runtime).
    pub fn add(
        &mut self,
        name: &str,
        controller: impl Future<Output = ()> + Send + 'static,
    ) -> &mut Self {
        let handle = self.tasks.spawn(controller);
        self.names.insert(handle.id(), name.to_string());
        self
    }

    /// Wait for every controller; the first that stopped on its own is the error.
    pub async fn run(mut self) -> Result<(), ManagerError> {
        let mut first = None;
        while let Some(done) = self.tasks.join_next_with_id().await {
            let err = match done {
                Ok((id, ())) if !self.token.is_cancelled() => Some(ManagerError::Stopped {
                    name: self.names.remove(&id).unwrap_or_default(),
                }),
                Ok(_) => None,
                Err(e) if e.is_panic() => Some(ManagerError::Panicked {
                    name: self.names.remove(&e.id()).unwrap_or_default(),
                    source: e,
                }),
                Err(_) => None,
            };
            if let Some(err) = err {
                tracing::error!(error = %crate::controller::error_chain(&err), "stopping every controller");
                self.token.cancel();
                first.get_or_insert(err);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_stopping_early_stops_all() {
        let mut m = Manager::new(CancellationToken::new());
        let t = m.token();
        m.add("forever", async move { t.cancelled().await });
        m.add("quitter", async {
            tokio::time::sleep(Duration::from_secs(1)).await
        });
        let err = m.run().await.unwrap_err();
        assert!(
            matches!(err, ManagerError::Stopped { ref name } if name == "quitter"),
            "{err}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_is_clean() {
        let token = CancellationToken::new();
        let mut m = Manager::new(token.clone());
        for name in ["a", "b"] {
            let t = m.token();
            m.add(name, async move { t.cancelled().await });
        }
        let stop = token.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            stop.cancel();
        });
        m.run().await.unwrap();
    }
}

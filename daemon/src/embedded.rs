//! Embedded mode: the controllers inside a CLI command (its `--wait`) or `boxery mcp`, while
//! nothing else leads the store.

use std::sync::Arc;
use std::time::Duration;

use boxery_backends::{Backend, BackendError};
use boxery_controller::CancellationToken;
use boxery_controller::leader::{LeaderElector, Leading, this_process};
use boxery_reconcilers::{Ctx, Settings};
use boxery_store::{Leadership, ObjectStore};
use boxery_verbs::control::{ControlPlane, LOCK, Running, Started};
use boxery_verbs::{Env, Result, VerbError};

/// The controllers' shared context, for the home `home` whose store is `store`.
pub fn context(
    store: &Arc<dyn ObjectStore>,
    home: &std::path::Path,
    backend: Arc<dyn Backend>,
    settings: Settings,
    holder: &str,
) -> Arc<Ctx> {
    Arc::new(Ctx::new(
        store.clone(),
        home.to_path_buf(),
        backend,
        holder.to_string(),
        settings,
    ))
}

/// The verbs' way to run the controllers in this process: give it to
/// [`Env::with_control`](boxery_verbs::Env::with_control).
#[derive(Debug, Clone, Copy, Default)]
pub struct Embedder;

#[async_trait::async_trait]
impl ControlPlane for Embedder {
    async fn start_if_needed(&self, env: &Env, store: &Arc<dyn ObjectStore>) -> Result<Started> {
        start_if_needed(env, store).await
    }
}

/// Controllers running inside a command.
struct Embedded {
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    leading: Leading,
}

#[async_trait::async_trait]
impl Running for Embedded {
    async fn stop(self: Box<Self>) {
        self.shutdown.cancel();
        let _ = self.task.await;
        if let Err(e) = self.leading.resign().await {
            tracing::warn!(error = %e, "resigning leadership failed");
        }
    }
}

/// Start the controllers here if nothing leads the store.
async fn start_if_needed(env: &Env, store: &Arc<dyn ObjectStore>) -> Result<Started> {
    // Read before leading: an error after it would leave the leadership to time out.
    let config = boxery_verbs::env::read_config(&env.home)?;
    let me = this_process();
    let ttl = Duration::from_secs(4);
    match store.try_lead(LOCK, &me, ttl).await? {
        Leadership::Follower { .. } => return Ok(Started::Elsewhere),
        Leadership::Leader { .. } => {}
    }
    let elector = LeaderElector::new(store.clone(), LOCK, me.clone(), ttl);
    let leading = elector
        .acquire()
        .await
        .map_err(|e| VerbError::failed(format!("leader election failed: {e}")))?;
    let backend = match env.backend_for(&**store).await {
        Ok(b) => b,
        Err(e) => {
            let _ = leading.resign().await;
            return Err(e);
        }
    };
    let settings = Settings {
        inventory_every: Duration::from_secs(5),
        import_roots: config.import_roots.clone(),
        memory_quota: config.memory.quota.map(|q| q.bytes()),
        prices: config.proxy.prices.clone(),
        ..Settings::default()
    };
    let ctx = context(store, &env.home, backend.clone(), settings, &me.id);
    match backend.init().await {
        Ok(()) => {}
        Err(e @ BackendError::Unreachable { .. }) => {
            // What an inventory pass would record; then leave the store to whoever can
            // reach the backend (a `serve` retries until it answers).
            let marked = boxery_reconcilers::inventory::unreachable(&ctx, &e).await;
            let _ = leading.resign().await;
            marked.map_err(|m| VerbError::failed(m.to_string()))?;
            return Ok(Started::Unreachable(format!(
                "the {} backend is unreachable ({e}); no controller runs in this command",
                env.backend_name
            )));
        }
        Err(e) => {
            let _ = leading.resign().await;
            return Err(VerbError::failed(format!(
                "the {} backend could not initialise: {}",
                env.backend_name,
                e.chain()
            )));
        }
    }
    let shutdown = CancellationToken::new();
    // The guests' side of the credential proxy runs wherever the controllers do.
    match boxery_proxy::Proxy::new(&env.home, config.proxy) {
        Ok(p) => {
            tokio::spawn(boxery_proxy::channels::keep(
                p,
                backend.clone(),
                shutdown.clone(),
            ));
        }
        Err(e) => tracing::warn!(error = %e, "no credential proxy for the guests"),
    }
    let task = tokio::spawn(boxery_reconcilers::runtime::run(ctx, shutdown.clone()));
    Ok(Started::Here(Box::new(Embedded {
        shutdown,
        task,
        leading,
    })))
}

//! Running the controllers: `serve` (a long-lived control plane with leader election) and
//! embedded mode (a CLI command with `--wait` runs them in-process while nothing else leads).

use std::sync::Arc;
use std::time::Duration;

use boxery_backends::{Backend, BackendError};
use boxery_controller::CancellationToken;
use boxery_controller::leader::{LeaderElector, this_process};
use boxery_reconcilers::{Ctx, Settings};
use boxery_store::{Leadership, Store};

use crate::env::Env;
use crate::error::{Result, VerbError};

/// The store lock the controllers lead under.
pub const LOCK: &str = "boxery-controllers";

/// `serve --inventory-every`: 1 s (a zero period would make tokio's interval panic) to 24 h.
pub const INVENTORY_EVERY: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(24 * 3600));

/// `serve --lease`, the leader lease: 1 s to 5 min. It is renewed every third of itself, and
/// a standby takes over within 4/3 of it after the leader dies: longer leaves the store
/// unled too long after a crash, and a huge one would overflow the renewal arithmetic.
pub const LEASE: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(300));

/// The value parser of `serve --inventory-every`.
pub fn inventory_every_arg(s: &str) -> Result<Duration, String> {
    crate::wait::duration_in(s, INVENTORY_EVERY.0, INVENTORY_EVERY.1)
}

/// The value parser of `serve --lease`.
pub fn lease_arg(s: &str) -> Result<Duration, String> {
    crate::wait::duration_in(s, LEASE.0, LEASE.1)
}

/// What to say after a write that does not wait, when nothing leads the store: the change is
/// stored, and nothing will act on it until a control plane runs. `None` while one leads.
pub async fn unreconciled_note(v: &crate::Verbs) -> Result<Option<String>> {
    if v.store().leader(LOCK).await?.is_some() {
        return Ok(None);
    }
    Ok(Some(match v.voice {
        boxery_hands::Voice::Cli => "boxery: stored, but nothing reconciles this home now (no \
            `boxery serve` runs): start one with `boxery serve` (or keep one running with \
            `boxery service install`), or add --wait to run the controllers in this command"
            .to_string(),
        boxery_hands::Voice::Tool => "note: stored, but nothing reconciles this home now (no \
            control plane runs): call again with wait: true, or ask the user to run \
            `boxery serve` (or `boxery service install`)"
            .to_string(),
    }))
}

/// The controllers' shared context, for the home `home` whose store is `store`.
pub fn context(
    store: &Store,
    home: &std::path::Path,
    backend: Arc<dyn Backend>,
    settings: Settings,
    holder: &str,
) -> Arc<Ctx> {
    Arc::new(Ctx::new(
        Arc::new(store.clone()),
        home.to_path_buf(),
        backend,
        holder.to_string(),
        settings,
    ))
}

/// `serve`: wait to lead, run the controllers, exit when interrupted or when leadership is lost.
/// `inventory_every` and `lease` must lie in [`INVENTORY_EVERY`] and [`LEASE`] (their value
/// parsers check that; this refuses anything else too).
/// `proxy`: the credential proxy, served where each guest reaches it while this process leads
/// (`None`: `--proxy-listen off`).
pub async fn serve(
    env: &Env,
    inventory_every: Duration,
    lease: Duration,
    proxy: Option<boxery_proxy::Proxy>,
) -> Result {
    for (what, d, (min, max)) in [
        ("--inventory-every", inventory_every, INVENTORY_EVERY),
        ("--lease", lease, LEASE),
    ] {
        if d < min || d > max {
            return Err(VerbError::invalid(format!(
                "{what} {} is out of range: use {} to {}",
                humantime::format_duration(d),
                humantime::format_duration(min),
                humantime::format_duration(max)
            )));
        }
    }
    let store = env.store()?;
    let backend = env.backend_for(&store).await?;
    // Read before leading: an error after it would leave the leadership to time out.
    let import_roots = crate::env::read_config(&env.home)?.import_roots;
    let me = this_process();
    let elector = LeaderElector::new(Arc::new(store.clone()), LOCK, me.clone(), lease);
    let shutdown = CancellationToken::new();
    {
        let s = shutdown.clone();
        tokio::spawn(async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
            }
            s.cancel();
        });
    }
    // A backend that is not up yet (libvirtd starting after boxery at boot) is waited for;
    // one that is broken (a missing tool, a bad setting) is an error.
    let mut said = false;
    loop {
        let ready = match backend.check().await {
            Ok(()) => backend.init().await,
            Err(e) => Err(e),
        };
        match ready {
            Ok(()) => break,
            Err(e @ BackendError::Unreachable { .. }) => {
                if !said {
                    eprintln!("boxery serve: {e}; retrying every 2 s");
                    said = true;
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                    _ = shutdown.cancelled() => return Ok(()),
                }
            }
            Err(e) => {
                return Err(VerbError::failed(format!(
                    "the {} backend is not usable: {}",
                    env.backend_name,
                    e.chain()
                )));
            }
        }
    }
    eprintln!(
        "boxery serve: waiting to lead the store at {} (backend {})",
        env.home.display(),
        env.backend_name
    );
    let leading = tokio::select! {
        l = elector.acquire() => l.map_err(|e| VerbError::failed(format!("leader election failed: {e}")))?,
        _ = shutdown.cancelled() => return Ok(()),
    };
    eprintln!(
        "boxery serve: leading (pid {}); controllers running",
        std::process::id()
    );
    let settings = Settings {
        inventory_every,
        import_roots,
        ..Settings::default()
    };
    let ctx = context(&store, &env.home, backend.clone(), settings, &me.id);
    if let Some(p) = proxy {
        tokio::spawn(boxery_proxy::channels::keep(
            p,
            backend.clone(),
            shutdown.child_token(),
        ));
    }
    let run = boxery_reconcilers::runtime::run(ctx, shutdown.child_token());
    tokio::select! {
        _ = run => {}
        _ = leading.lost() => {
            shutdown.cancel();
            return Err(VerbError::failed("lost leadership of the store (another control plane took over): exiting"));
        }
        _ = shutdown.cancelled() => {}
    }
    if let Err(e) = leading.resign().await {
        tracing::warn!(error = %e, "resigning leadership failed; a standby takes over when the lease expires");
    }
    Ok(())
}

/// Controllers running inside a CLI command.
pub struct Embedded {
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    leading: boxery_controller::leader::Leading,
}

/// What [`Embedded::start_if_needed`] found.
pub enum Started {
    /// The controllers run in this process until [`Embedded::stop`].
    Here(Embedded),
    /// Another process (`serve`) leads the store.
    Elsewhere,
    /// Nothing led, but the backend does not answer: its VMs were marked
    /// `BackendReachable=False` and no controller runs here (the message says why).
    Unreachable(String),
}

impl Embedded {
    /// Start the controllers here if nothing leads the store.
    pub async fn start_if_needed(env: &Env, store: &Store) -> Result<Started> {
        // Read before leading: an error after it would leave the leadership to time out.
        let config = crate::env::read_config(&env.home)?;
        let me = this_process();
        let ttl = Duration::from_secs(4);
        match store.try_lead(LOCK, &me, ttl)? {
            Leadership::Follower { .. } => return Ok(Started::Elsewhere),
            Leadership::Leader { .. } => {}
        }
        let elector = LeaderElector::new(Arc::new(store.clone()), LOCK, me.clone(), ttl);
        let leading = elector
            .acquire()
            .await
            .map_err(|e| VerbError::failed(format!("leader election failed: {e}")))?;
        let backend = match env.backend_for(store).await {
            Ok(b) => b,
            Err(e) => {
                let _ = leading.resign().await;
                return Err(e);
            }
        };
        let settings = Settings {
            inventory_every: Duration::from_secs(5),
            import_roots: config.import_roots.clone(),
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
        Ok(Started::Here(Embedded {
            shutdown,
            task,
            leading,
        }))
    }

    /// Stop the controllers and give up leadership.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
        if let Err(e) = self.leading.resign().await {
            tracing::warn!(error = %e, "resigning leadership failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_durations_are_bounded() {
        assert_eq!(inventory_every_arg("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(lease_arg("4s"), Ok(Duration::from_secs(4)));
        assert!(
            inventory_every_arg("0s")
                .unwrap_err()
                .contains("use 1s to 1day")
        );
        assert!(inventory_every_arg("18446744073709551615s").is_err());
        assert!(lease_arg("0s").unwrap_err().contains("use 1s to 5m"));
        assert!(lease_arg("500ms").is_err());
        assert!(lease_arg("1h").is_err());
    }
}

//! `boxery serve`: the listeners bound first (a taken port or a bad token file fails at
//! once), then wait to lead the store and run the controllers until interrupted. Leadership
//! lost (another process took the store while this one's renewal lagged) stops the
//! controllers and stands by again; the listeners stay up.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use boxery_backends::BackendError;
use boxery_controller::CancellationToken;
use boxery_controller::leader::{LeaderElector, this_process};
use boxery_reconcilers::Settings;
use boxery_verbs::control::LOCK;
use boxery_verbs::{Env, Result, VerbError, Verbs, Voice};

use crate::embedded::{Embedder, context};

/// `serve --inventory-every`: 1 s (a zero period would make tokio's interval panic) to 24 h.
pub const INVENTORY_EVERY: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(24 * 3600));

/// `serve --lease`, the leader lease: 1 s to 5 min. It is renewed every third of itself, and
/// a standby takes over within 4/3 of it after the leader dies: longer leaves the store
/// unled too long after a crash, and a huge one would overflow the renewal arithmetic.
pub const LEASE: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(300));

/// The value parser of `serve --inventory-every`.
pub fn inventory_every_arg(s: &str) -> std::result::Result<Duration, String> {
    boxery_verbs::wait::duration_in(s, INVENTORY_EVERY.0, INVENTORY_EVERY.1)
}

/// The value parser of `serve --lease`.
pub fn lease_arg(s: &str) -> std::result::Result<Duration, String> {
    boxery_verbs::wait::duration_in(s, LEASE.0, LEASE.1)
}

/// `--proxy-listen`: an address, or `off`.
#[derive(Debug, Clone, Copy)]
pub enum ProxyListen {
    /// No credential proxy.
    Off,
    /// The proxy's address.
    At(SocketAddr),
}

/// The value parser of `serve --proxy-listen`.
pub fn proxy_listen_arg(s: &str) -> std::result::Result<ProxyListen, String> {
    if s == "off" {
        return Ok(ProxyListen::Off);
    }
    s.parse()
        .map(ProxyListen::At)
        .map_err(|_| format!("`{s}` is not ADDR:PORT (e.g. 127.0.0.1:7390) or `off`"))
}

/// `serve --mcp-listen` and its options.
#[derive(Debug, Clone)]
pub struct McpListen {
    /// Where.
    pub addr: SocketAddr,
    /// `--mcp-allow-origin`: the browser origins allowed besides loopback ones.
    pub origins: Vec<String>,
    /// `--mcp-allow-remote`: a non-loopback address is allowed.
    pub allow_remote: bool,
}

/// `serve --metrics-listen` and its option.
#[derive(Debug, Clone, Copy)]
pub struct MetricsListen {
    /// Where (plain HTTP, no token: loopback unless `allow_remote`).
    pub addr: SocketAddr,
    /// `--metrics-allow-remote`: a non-loopback address is allowed.
    pub allow_remote: bool,
}

/// What `serve` runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// How often the inventory compares the backend's world with the store (in
    /// [`INVENTORY_EVERY`]).
    pub inventory_every: Duration,
    /// The leader lease (in [`LEASE`]).
    pub lease: Duration,
    /// The MCP endpoint, if any.
    pub mcp_listen: Option<McpListen>,
    /// The credential proxy.
    pub proxy_listen: ProxyListen,
    /// The Kubernetes-compatible API, if any.
    pub api_listen: Option<SocketAddr>,
    /// `/metrics` on a listener of its own, if any (the API serves it too).
    pub metrics_listen: Option<MetricsListen>,
}

/// How often a running `serve` gives its heap's free pages back ([`crate::malloc::trim`]): a
/// few hundred microseconds each time, on a blocking thread.
const TRIM_EVERY: Duration = Duration::from_secs(5);

/// `serve`: bind the listeners `options` asks for, wait to lead the store, run the
/// controllers; exit when interrupted (SIGINT, SIGTERM). Leadership lost stops the
/// controllers, and this process stands by to lead again. What it does is said on stderr
/// (`boxery serve: …`): it is a daemon, its lines are its report.
pub async fn serve(env: &Env, options: Options) -> Result {
    check_ranges(&options)?;
    // A fresh home: made (0700) before the listeners write their address files into it.
    env.ensure_home()?;
    let env = &env.clone().with_control(Arc::new(Embedder));
    let stop = CancellationToken::new();
    // What /metrics serves: the instruments, and what the controllers observe once they run.
    let observed = boxery_reconcilers::metrics::Observed::default();
    let exposition = boxery_metrics::Exposition::new(observed.collectors());
    let metrics = match options.metrics_listen {
        Some(m) => Some(crate::metrics::bind(env, m, exposition.clone(), stop.clone()).await?),
        None => None,
    };
    // The credential proxy, bound before the controllers start (a taken port fails at once).
    let (proxy, guest_proxy, proxy_bound) = match options.proxy_listen {
        ProxyListen::Off => (None, None, None),
        ProxyListen::At(addr) => {
            let config = boxery_verbs::env::read_config(&env.home)?.proxy;
            let proxy = boxery_proxy::Proxy::new(&env.home, config).map_err(VerbError::failed)?;
            let listener = boxery_proxy::Proxy::bind(addr)
                .await
                .map_err(VerbError::failed)?;
            let bound = listener
                .local_addr()
                .map_err(|e| VerbError::invalid(format!("the proxy's listener: {e}")))?;
            write_addr(&boxery_proxy::addr_file(&env.home), bound)?;
            tracing::info!(addr = %bound, "credential proxy listening");
            let guests = proxy.clone();
            (
                Some(tokio::spawn(proxy.serve(listener, stop.clone()))),
                Some(guests),
                Some(bound),
            )
        }
    };
    // Bound (or refused) before the controllers start, so a bad address or token file fails
    // `serve` at once.
    let http = match options.mcp_listen {
        Some(m) => {
            let server =
                boxery_mcp::server::HttpServer::bind(env, m.addr, m.origins, m.allow_remote)
                    .await?;
            Some(tokio::spawn(server.run(stop.clone())))
        }
        None => None,
    };
    // The API, bound (and its certificate made) before the controllers start.
    let api = match options.api_listen {
        Some(addr) => {
            let verbs = Verbs::open(env.clone(), Voice::Cli)?;
            let server = boxery_apiserver::ApiServer::bind(verbs, addr, Default::default())
                .await
                .map_err(VerbError::failed)?
                .with_metrics(exposition.clone());
            let bound = server.local_addr();
            let file = boxery_apiserver::tls::dir(&env.home).join("addr");
            write_addr(&file, bound)?;
            eprintln!("boxery serve: API at https://{bound} (a kubeconfig: boxery kubeconfig)");
            Some((tokio::spawn(server.run(stop.clone())), file, bound))
        }
        None => None,
    };
    let trim = tokio::spawn(trim_every(TRIM_EVERY, stop.clone()));
    let r = lead_and_run(
        env,
        options.inventory_every,
        options.lease,
        guest_proxy,
        observed,
    )
    .await;
    stop.cancel();
    let _ = trim.await;
    if let Some(m) = metrics {
        m.stopped().await;
    }
    if let Some((task, file, bound)) = api {
        let _ = task.await;
        remove_addr_if_ours(&file, bound);
    }
    if let Some(h) = http
        && let Ok(Err(e)) = h.await
    {
        eprintln!("error: {}", boxery_verbs::render::safe(&e.chain()));
    }
    if let Some(h) = proxy {
        if let Ok(Err(e)) = h.await {
            eprintln!(
                "error: {}",
                boxery_verbs::render::safe(&boxery_verbs::error::chain(&e))
            );
        }
        if let Some(b) = proxy_bound {
            remove_addr_if_ours(&boxery_proxy::addr_file(&env.home), b);
        }
    }
    r
}

/// `--inventory-every` and `--lease` within their ranges (their value parsers check that;
/// this refuses anything else too).
fn check_ranges(options: &Options) -> Result {
    for (what, d, (min, max)) in [
        (
            "--inventory-every",
            options.inventory_every,
            INVENTORY_EVERY,
        ),
        ("--lease", options.lease, LEASE),
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
    Ok(())
}

/// Give the heap's free pages back every `period` until `stop`.
async fn trim_every(period: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {
                let _ = tokio::task::spawn_blocking(crate::malloc::trim).await;
            }
        }
    }
}

/// Cancelled on SIGINT or SIGTERM.
fn on_signal() -> CancellationToken {
    let shutdown = CancellationToken::new();
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
    shutdown
}

/// Wait to lead, run the controllers (and the guests' side of `proxy`, the credential proxy
/// served where each guest reaches it while this process leads; `None`: `--proxy-listen off`),
/// until interrupted. Leadership lost (a renewal that lagged past the lease while a command's
/// `--wait` found the store unled and took it) ends this term: the controllers stop, and this
/// process stands by to lead again, as a second `serve` would.
async fn lead_and_run(
    env: &Env,
    inventory_every: Duration,
    lease: Duration,
    proxy: Option<boxery_proxy::Proxy>,
    observed: boxery_reconcilers::metrics::Observed,
) -> Result {
    let store = env.store()?;
    let backend = env.backend_for(&*store).await?;
    // Read before leading: an error after it would leave the leadership to time out.
    let config = boxery_verbs::env::read_config(&env.home)?;
    let me = this_process();
    let elector = LeaderElector::new(store.clone(), LOCK, me.clone(), lease);
    let shutdown = on_signal();
    if !backend_ready(env, backend.as_ref(), &shutdown).await? {
        return Ok(());
    }
    let settings = Settings {
        inventory_every,
        import_roots: config.import_roots,
        memory_quota: config.memory.quota.map(|q| q.bytes()),
        prices: config.proxy.prices.clone(),
        ..Settings::default()
    };
    loop {
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
        // One term's work, stopped with it.
        let term = shutdown.child_token();
        let ctx = context(&store, &env.home, backend.clone(), settings.clone(), &me.id);
        ctx.keep_observed(observed.clone());
        let guests = proxy.clone().map(|p| {
            tokio::spawn(boxery_proxy::channels::keep(
                p,
                backend.clone(),
                term.clone(),
            ))
        });
        let run = boxery_reconcilers::runtime::run(ctx, term.clone());
        tokio::pin!(run);
        // (whether the controllers ended on their own, whether the lead was lost)
        let (ended, lost) = tokio::select! {
            _ = &mut run => (true, false),
            _ = leading.lost() => (false, true),
            _ = shutdown.cancelled() => (false, false),
        };
        term.cancel();
        if !ended {
            run.await;
        }
        if let Some(g) = guests {
            let _ = g.await;
        }
        if lost {
            eprintln!(
                "boxery serve: lost the lead of the store (its renewal was late and another process took it); controllers stopped, standing by"
            );
            continue;
        }
        if let Err(e) = leading.resign().await {
            tracing::warn!(error = %e, "resigning leadership failed; a standby takes over when the lease expires");
        }
        return Ok(());
    }
}

/// Wait for the backend: one that is not up yet (libvirtd starting after boxery at boot) is
/// waited for; one that is broken (a missing tool, a bad setting) is an error. `false` when
/// `shutdown` came first.
async fn backend_ready(
    env: &Env,
    backend: &dyn boxery_backends::Backend,
    shutdown: &CancellationToken,
) -> Result<bool> {
    let mut said = false;
    loop {
        let ready = match backend.check().await {
            Ok(()) => backend.init().await,
            Err(e) => Err(e),
        };
        match ready {
            Ok(()) => return Ok(true),
            Err(e @ BackendError::Unreachable { .. }) => {
                if !said {
                    eprintln!("boxery serve: {e}; retrying every 2 s");
                    said = true;
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                    _ = shutdown.cancelled() => return Ok(false),
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
}

/// Record the address a listener took (`proxy.addr`, `api/addr`), whole or not at all.
pub(crate) fn write_addr(file: &Path, bound: SocketAddr) -> Result {
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, format!("{bound}\n"))
        .and_then(|()| std::fs::rename(&tmp, file))
        .map_err(|e| VerbError::invalid(format!("cannot write {}: {e}", file.display())))
}

/// Remove an address file when it still holds our address: another `serve` on this home (a
/// standby) may have written its own since, and its listener answers alike.
pub(crate) fn remove_addr_if_ours(file: &Path, bound: SocketAddr) {
    if std::fs::read_to_string(file).ok() == Some(format!("{bound}\n")) {
        let _ = std::fs::remove_file(file);
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

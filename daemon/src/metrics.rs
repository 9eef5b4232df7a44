//! `serve --metrics-listen`: `/metrics` in plain HTTP on a listener of its own, for a
//! Prometheus on this machine (docs/observability.md). No token: a loopback address only,
//! unless `--metrics-allow-remote` says otherwise. The API listener serves the same
//! exposition behind its tokens.

use std::net::SocketAddr;

use axum::Router;
use axum::http::{HeaderMap, header};
use axum::response::IntoResponse;
use axum::routing::get;
use boxery_controller::CancellationToken;
use boxery_verbs::{Env, Result, VerbError};

use crate::serve::{MetricsListen, remove_addr_if_ours, write_addr};

/// A bound metrics listener, serving until the token it was given is cancelled.
pub(crate) struct Metrics {
    task: tokio::task::JoinHandle<()>,
    file: std::path::PathBuf,
    bound: SocketAddr,
}

/// Bind `m.addr` (a taken port or a refused address fails `serve` at once), write its
/// address to `$BOXERY_HOME/metrics.addr`, and serve `exposition` there until `stop`.
pub(crate) async fn bind(
    env: &Env,
    m: MetricsListen,
    exposition: boxery_metrics::Exposition,
    stop: CancellationToken,
) -> Result<Metrics> {
    if !m.addr.ip().is_loopback() && !m.allow_remote {
        return Err(VerbError::invalid(format!(
            "--metrics-listen {} is not a loopback address, and /metrics has no token: add --metrics-allow-remote to serve it there anyway, or scrape it through the API (--api-listen, a read token)",
            m.addr
        )));
    }
    let listener = tokio::net::TcpListener::bind(m.addr).await.map_err(|e| {
        VerbError::invalid(format!("cannot listen on {} for /metrics: {e}", m.addr))
    })?;
    let bound = listener
        .local_addr()
        .map_err(|e| VerbError::invalid(format!("the metrics listener: {e}")))?;
    let file = boxery_home::layout::metrics_addr(&env.home);
    write_addr(&file, bound)?;
    eprintln!("boxery serve: metrics at http://{bound}/metrics");
    let app = Router::new()
        .route(
            "/metrics",
            get(move |headers: HeaderMap| {
                let e = exposition.clone();
                async move {
                    let accept = headers.get(header::ACCEPT).and_then(|h| h.to_str().ok());
                    let (content_type, body) = e.respond(accept).await;
                    ([(header::CONTENT_TYPE, content_type)], body).into_response()
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }));
    let task = tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "the metrics listener stopped");
        }
    });
    Ok(Metrics { task, file, bound })
}

impl Metrics {
    /// Wait for it to stop (after its token was cancelled); its address file goes with it.
    pub(crate) async fn stopped(self) {
        let _ = self.task.await;
        remove_addr_if_ours(&self.file, self.bound);
    }
}

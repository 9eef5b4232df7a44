//! boxery's Prometheus metrics (docs/observability.md): the instruments the store, the
//! controllers and the credential proxy record into, in one place ([`METRICS`]: every name,
//! label and help text of an instrumented metric is here), and the [`Exposition`] that
//! `/metrics` serves, with the collectors the composition root adds (the objects, kube-state-
//! metrics' way, and the VMs' runtime samples).
//!
//! # Guarantees
//! - Label values are bounded: kinds, operations, routes, status codes, results; the only
//!   label whose values grow with use is `vm`, and a VM's series are dropped when the VM is
//!   gone ([`ProxyStats::retain_vms`]).
//! - A scrape costs at most one render a second however many scrapers there are
//!   ([`Exposition::render`]): a flood of scrapes cannot slow the control plane.
//!
//! # Assumptions
//! - One process, one control plane: the instruments are process-wide, as Prometheus' own
//!   clients' default registries are. A process that runs several (tests) sums them.

use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

pub use prometheus_client;

mod proxy;
pub use proxy::{ProxyStats, Transfer};

/// Every instrument boxery records into.
pub static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::default);

/// A histogram family's constructor.
type NewHistogram = fn() -> Histogram;

/// A label set of one kind.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// The kind (`Vm`, `Image`, …).
    pub kind: String,
}

/// A reconcile's kind and how it ended.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReconcileLabels {
    /// The kind.
    pub kind: String,
    /// `success`, `error` or `panic`.
    pub result: &'static str,
}

/// A store write's operation.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabel {
    /// `create`, `update`, `update_status`, `delete`, `apply`, `adopt`.
    pub operation: &'static str,
}

/// The controllers' instruments (controller-runtime's names, under `boxery_`).
#[derive(Debug)]
pub struct Controllers {
    /// Seconds per reconcile, by kind.
    pub reconcile_duration: Family<KindLabel, Histogram, NewHistogram>,
    /// Reconciles by kind and result.
    pub reconciles: Family<ReconcileLabels, Counter>,
    /// Keys queued (waiting for their deadline or a free slot), by kind.
    pub queue_depth: Family<KindLabel, Gauge>,
    /// Reconciles running now, by kind.
    pub in_flight: Family<KindLabel, Gauge>,
}

/// The store's instruments.
#[derive(Debug)]
pub struct StoreInstruments {
    /// Seconds per write as its caller waits for it (queueing for the writer included), by
    /// operation.
    pub write_duration: Family<OperationLabel, Histogram, NewHistogram>,
    /// Seconds from a revision being published in this process (committed here, or noticed
    /// by the poller when another process committed it) to a watcher holding its rows.
    pub watch_lag: Histogram,
}

/// Every instrument: see the field types for the names.
#[derive(Debug)]
pub struct Metrics {
    /// The controllers'.
    pub controllers: Controllers,
    /// The store's.
    pub store: StoreInstruments,
    /// The credential and egress proxy's.
    pub proxy: ProxyStats,
}

/// Buckets for durations: 0.5 ms to about 65 s, doubling.
fn seconds() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            controllers: Controllers {
                reconcile_duration: Family::new_with_constructor(seconds),
                reconciles: Family::default(),
                queue_depth: Family::default(),
                in_flight: Family::default(),
            },
            store: StoreInstruments {
                write_duration: Family::new_with_constructor(seconds),
                watch_lag: seconds(),
            },
            proxy: ProxyStats::default(),
        }
    }
}

impl Metrics {
    /// Register every instrument in `registry` (prefixed `boxery_` by [`Exposition::new`]).
    fn register(&self, r: &mut Registry) {
        let c = &self.controllers;
        r.register_with_unit(
            "reconcile_duration",
            "Time per reconcile, by kind",
            Unit::Seconds,
            c.reconcile_duration.clone(),
        );
        r.register(
            "reconcile",
            "Reconciles by kind and result (success, error, panic)",
            c.reconciles.clone(),
        );
        r.register(
            "workqueue_depth",
            "Keys queued for a reconcile (waiting for their time or a free slot), by kind",
            c.queue_depth.clone(),
        );
        r.register(
            "workqueue_in_flight",
            "Reconciles running now, by kind",
            c.in_flight.clone(),
        );
        let s = &self.store;
        r.register_with_unit(
            "store_write_duration",
            "Time per store write as its caller waits for it, by operation",
            Unit::Seconds,
            s.write_duration.clone(),
        );
        r.register_with_unit(
            "watch_lag",
            "Time from a store revision being published in this process to a watcher holding its rows",
            Unit::Seconds,
            s.watch_lag.clone(),
        );
        self.proxy.register(r);
    }
}

/// Time a piece of work into a histogram when dropped (so an early return or a cancelled
/// future is timed too).
#[derive(Debug)]
pub struct Timer<'a> {
    histogram: &'a Histogram,
    start: Instant,
}

impl<'a> Timer<'a> {
    /// Start timing into `histogram`.
    pub fn start(histogram: &'a Histogram) -> Self {
        Timer {
            histogram,
            start: Instant::now(),
        }
    }
}

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
    }
}

/// The text formats `/metrics` speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Prometheus' text format 0.0.4 (`promtool check metrics` reads it): the default.
    Prometheus,
    /// OpenMetrics 1.0, for a client whose `Accept` asks for it (Prometheus does).
    OpenMetrics,
}

impl Format {
    /// The format an `Accept` header asks for.
    pub fn from_accept(accept: Option<&str>) -> Format {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::Prometheus,
        }
    }

    /// Its `Content-Type`.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// How long a render is served again rather than made anew.
pub const RENDER_MAX_AGE: Duration = Duration::from_secs(1);

/// What `/metrics` serves: [`METRICS`] and the collectors added, rendered at most once per
/// [`RENDER_MAX_AGE`] and format. Cheap to clone.
#[derive(Clone)]
pub struct Exposition {
    inner: Arc<ExpositionInner>,
}

struct ExpositionInner {
    registry: Registry,
    /// The last render of each format: when, and the text. Held while rendering, so
    /// concurrent scrapes wait for one render instead of making their own.
    last: Mutex<[Option<Rendered>; 2]>,
}

impl std::fmt::Debug for Exposition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exposition").finish_non_exhaustive()
    }
}

impl Exposition {
    /// [`METRICS`] and `collectors`, every name prefixed `boxery_`.
    pub fn new(collectors: Vec<Box<dyn prometheus_client::collector::Collector>>) -> Self {
        let mut registry = Registry::with_prefix("boxery");
        METRICS.register(&mut registry);
        for c in collectors {
            registry.register_collector(c);
        }
        Exposition {
            inner: Arc::new(ExpositionInner {
                registry,
                last: Mutex::new([None, None]),
            }),
        }
    }

    /// What `/metrics` answers a client whose `Accept` header is `accept`: the
    /// `Content-Type` and the text, rendered on the blocking pool.
    pub async fn respond(&self, accept: Option<&str>) -> (&'static str, bytes::Bytes) {
        let format = Format::from_accept(accept);
        let me = self.clone();
        let text = tokio::task::spawn_blocking(move || me.render(format))
            .await
            .unwrap_or_else(|e| Arc::new(format!("# boxery: the render failed: {e}\n")));
        // Kept for the scrapes of the next second only: not between scrapes (a render of
        // 1,000 VMs is most of a MiB).
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(RENDER_MAX_AGE).await;
            me.forget_old();
        });
        (format.content_type(), bytes::Bytes::from_owner(Text(text)))
    }

    /// Drop the renders older than [`RENDER_MAX_AGE`].
    pub fn forget_old(&self) {
        let mut last = self.inner.last.lock().unwrap_or_else(|e| e.into_inner());
        for slot in last.iter_mut() {
            if slot
                .as_ref()
                .is_some_and(|(at, _)| at.elapsed() >= RENDER_MAX_AGE)
            {
                *slot = None;
            }
        }
    }

    /// The exposition in `format`: the last render when it is younger than
    /// [`RENDER_MAX_AGE`], else a new one. Blocking (a render of 1,000 VMs takes
    /// milliseconds): call it off the async workers.
    pub fn render(&self, format: Format) -> Arc<String> {
        let mut last = self.inner.last.lock().unwrap_or_else(|e| e.into_inner());
        let slot = &mut last[format as usize];
        if let Some((at, text)) = slot
            && at.elapsed() < RENDER_MAX_AGE
        {
            return text.clone();
        }
        let mut text = String::new();
        let encoded = match format {
            Format::Prometheus => prometheus_client::encoding::prometheus_text::encode(
                &mut text,
                &self.inner.registry,
            ),
            Format::OpenMetrics => {
                prometheus_client::encoding::text::encode(&mut text, &self.inner.registry)
            }
        };
        if let Err(e) = encoded {
            // Only a collector's own error reaches here (writing to a String cannot fail).
            text.push_str(&format!("# boxery: the exposition is incomplete: {e}\n"));
        }
        text.shrink_to_fit();
        let text = Arc::new(text);
        *slot = Some((Instant::now(), text.clone()));
        text
    }
}

/// A render: when it was made, and its text.
type Rendered = (Instant, Arc<String>);

/// A render, owned by the response body that sends it (no copy).
struct Text(Arc<String>);

impl AsRef<[u8]> for Text {
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instruments_render_in_both_formats_under_the_prefix() {
        METRICS
            .controllers
            .reconciles
            .get_or_create(&ReconcileLabels {
                kind: "Vm".into(),
                result: "success",
            })
            .inc();
        METRICS.store.watch_lag.observe(0.002);
        let e = Exposition::new(Vec::new());
        let text = e.render(Format::Prometheus);
        assert!(
            text.contains("# TYPE boxery_reconcile_total counter"),
            "{text}"
        );
        assert!(text.contains("boxery_reconcile_total{kind=\"Vm\",result=\"success\"}"));
        assert!(text.contains("# TYPE boxery_watch_lag_seconds histogram"));
        assert!(!text.contains("# EOF"));
        let om = e.render(Format::OpenMetrics);
        assert!(om.ends_with("# EOF\n"), "{om}");
        // Served again within a second: the same text, not a new render.
        assert!(Arc::ptr_eq(&text, &e.render(Format::Prometheus)));
    }

    #[test]
    fn accept_headers_choose_the_format() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(Format::from_accept(Some(prometheus)), Format::OpenMetrics);
        assert_eq!(Format::from_accept(Some("text/plain")), Format::Prometheus);
        assert_eq!(Format::from_accept(None), Format::Prometheus);
    }
}

//! `boxery usage`: what VMs, leases, holders, pools and grants used, from this home's usage
//! ledger (`boxery_home::usage`), priced at the owner's `proxy: {prices: …}`.

use boxery_home::usage::{By, Ledger, hour_of, now};

use crate::{Result, VerbError, Verbs};

/// One line of the report.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageLine {
    /// The group's use.
    #[serde(flatten)]
    pub line: boxery_home::usage::Line,
    /// Dollars at the configured prices (a model with no price at the dearest, as a grant's
    /// `dollarsPerMonth` counts it); `None` when no price is configured.
    pub dollars: Option<f64>,
    /// Models it used that have no price (counted at the dearest).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unpriced: Vec<String>,
}

/// What `by` names, parsed: `vm`, `lease`, `holder`, `grant`, `pool`.
pub fn by(s: &str) -> std::result::Result<By, String> {
    Ok(match s {
        "vm" => By::Vm,
        "lease" => By::Lease,
        "holder" => By::Holder,
        "grant" => By::Grant,
        "pool" => By::Pool,
        _ => return Err(format!("`{s}` is not vm, lease, holder, grant or pool")),
    })
}

/// The use of the last `since` (from the start of the hour it began in), grouped `by`.
pub fn report(v: &Verbs, by: By, since: std::time::Duration) -> Result<Vec<UsageLine>> {
    let Some(ledger) = Ledger::open_existing(v.home()).map_err(VerbError::failed)? else {
        return Ok(Vec::new());
    };
    let prices = crate::env::read_config(v.home())?.proxy.prices;
    let from = hour_of(now() - since.as_secs().min(i64::MAX as u64 / 2) as i64);
    let lines = ledger.report(by, from).map_err(VerbError::failed)?;
    Ok(lines
        .into_iter()
        .map(|line| {
            let mut unpriced: Vec<String> = line
                .by_model
                .iter()
                .filter(|(m, i, o)| {
                    i + o > 0 && boxery_api::config::price_for(&prices, m).is_none()
                })
                .map(|(m, _, _)| {
                    if m.is_empty() {
                        "(no model named)".to_string()
                    } else {
                        m.clone()
                    }
                })
                .collect();
            let dollars = (!prices.is_empty()).then(|| {
                boxery_api::config::spent(
                    &prices,
                    line.by_model.iter().map(|(m, i, o)| (m.as_str(), *i, *o)),
                )
            });
            unpriced.sort();
            unpriced.dedup();
            UsageLine {
                line,
                dollars,
                unpriced,
            }
        })
        .collect())
}

/// One running VM in `boxery top`: what it uses of the host now.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TopRow {
    /// The VM.
    pub vm: String,
    /// Host CPU it used over the sampling interval, in cores (1.0: one core busy).
    pub cpu_cores: f64,
    /// The vCPUs it has.
    pub cpus: u32,
    /// Host memory its hypervisor holds.
    pub rss_bytes: u64,
    /// Guest memory it was given.
    pub memory_bytes: u64,
    /// Network bytes a second received and sent over the interval, when the backend counts
    /// them.
    pub rx_per_second: Option<f64>,
    /// See `rx_per_second`.
    pub tx_per_second: Option<f64>,
}

/// What each running VM of this home uses now: two samples of the backend `interval` apart
/// (CPU and network as rates over it), sorted by CPU.
pub async fn top(v: &Verbs, interval: std::time::Duration) -> Result<Vec<TopRow>> {
    let backend = v.env.backend_for(v.store()).await?;
    if !backend.capabilities().usage {
        return Err(VerbError::invalid(format!(
            "the {} backend does not tell what its VMs use (`boxery backends`: usage samples)",
            backend.name()
        )));
    }
    let before = backend
        .usage()
        .await
        .map_err(|e| VerbError::failed(e.chain()))?;
    let t = std::time::Instant::now();
    tokio::time::sleep(interval).await;
    let after = backend
        .usage()
        .await
        .map_err(|e| VerbError::failed(e.chain()))?;
    let secs = t.elapsed().as_secs_f64().max(1e-3);
    let sizes: std::collections::HashMap<String, (u32, u64)> = backend
        .list()
        .await
        .map_err(|e| VerbError::failed(e.chain()))?
        .into_iter()
        .map(|i| (i.name, (i.size.cpus, i.size.memory_mib << 20)))
        .collect();
    let mut rows: Vec<TopRow> = after
        .iter()
        .map(|a| {
            let b = before.iter().find(|b| b.name == a.name);
            let rate = |now: Option<u64>, then: Option<u64>| match (now, then) {
                (Some(n), Some(t)) if n >= t => Some((n - t) as f64 / secs),
                _ => None,
            };
            let (cpus, memory_bytes) = sizes.get(&a.name).copied().unwrap_or_default();
            TopRow {
                vm: a.name.clone(),
                cpu_cores: b.map_or(0.0, |b| (a.cpu_seconds - b.cpu_seconds).max(0.0) / secs),
                cpus,
                rss_bytes: a.rss_bytes,
                memory_bytes,
                rx_per_second: rate(a.network_rx_bytes, b.and_then(|b| b.network_rx_bytes)),
                tx_per_second: rate(a.network_tx_bytes, b.and_then(|b| b.network_tx_bytes)),
            }
        })
        .collect();
    rows.sort_by(|x, y| {
        y.cpu_cores
            .partial_cmp(&x.cpu_cores)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then_with(|| x.vm.cmp(&y.vm))
    });
    Ok(rows)
}

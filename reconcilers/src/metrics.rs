//! What `/metrics` reads of a running control plane (docs/observability.md): the objects, the
//! kube-state-metrics way, from the controllers' caches (never the store: a scrape costs no
//! store read), and each VM's runtime from the backend, sampled every [`SAMPLE_EVERY`] by
//! [`sample`] and served from the last sample.
//!
//! # Guarantees
//! - A scrape reads memory only: the caches' texts, parsed into the few fields the series
//!   need, and the last sample. Its work grows with the number of objects, not with time.
//! - Per-object series carry the VM's name and nothing else that grows with use: Leases,
//!   Grants and Images are counted by phase (and pool, type), not listed by name.
//! - A VM's series leave with the VM: its samples at the next sample, its proxy series too
//!   ([`boxery_metrics::ProxyStats::retain_vms`]).
//!
//! # Caveats
//! - Nothing is served while this process does not lead the store (a standby): only
//!   `boxery_leader 0`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, LazyLock, RwLock};
use std::time::Duration;

use boxery_api::grant::GrantPhase;
use boxery_api::image::ImagePhase;
use boxery_api::lease::LeasePhase;
use boxery_api::vm::VmPhase;
use boxery_backends::VmUsage;
use boxery_controller::{Cache, CancellationToken};
use boxery_metrics::prometheus_client::collector::Collector;
use boxery_metrics::prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeMetric,
};
use boxery_metrics::prometheus_client::metrics::MetricType;
use boxery_metrics::prometheus_client::metrics::counter::ConstCounter;
use boxery_metrics::prometheus_client::metrics::gauge::ConstGauge;
use boxery_metrics::prometheus_client::registry::Unit;
use serde::Deserialize;

use crate::context::Ctx;

/// How often each VM's runtime is sampled from the backend.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// What `/metrics` reads of the controllers running in this process: nothing until
/// [`crate::runtime::run`] attaches its caches, and nothing again after it ends. Cheap to
/// clone; give [`Observed::collectors`] to the exposition and the same `Observed` to the
/// controllers' [`Ctx::keep_observed`].
#[derive(Debug, Clone, Default)]
pub struct Observed(Arc<RwLock<Option<Attached>>>);

#[derive(Debug, Clone)]
pub(crate) struct Attached {
    pub(crate) vms: Cache,
    pub(crate) images: Cache,
    pub(crate) pools: Cache,
    pub(crate) leases: Cache,
    pub(crate) grants: Cache,
    pub(crate) samples: Arc<RwLock<Samples>>,
}

/// The last sample: each VM's runtime, and its disk.
#[derive(Debug, Default)]
pub(crate) struct Samples {
    usage: Vec<VmUsage>,
    disk: HashMap<String, u64>,
}

impl Observed {
    /// The collectors that serve what is observed.
    pub fn collectors(
        &self,
    ) -> Vec<Box<dyn boxery_metrics::prometheus_client::collector::Collector>> {
        vec![Box::new(Objects(self.clone()))]
    }

    pub(crate) fn attach(&self, a: Attached) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Some(a);
    }

    pub(crate) fn detach(&self) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn attached(&self) -> Option<Attached> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Sample every VM's runtime every [`SAMPLE_EVERY`] until `shutdown`: into the usage ledger
/// (each running VM's vCPU- and GiB-seconds since the last sample, and the CPU seconds its
/// hypervisor used, charged to the lease holding it or to the VM), and, with `samples` (where
/// `/metrics` is served), for `/metrics`, dropping the proxy's series of VMs that are gone.
pub(crate) async fn sample(
    ctx: Arc<Ctx>,
    vms: Cache,
    leases: Cache,
    samples: Option<Arc<RwLock<Samples>>>,
    shutdown: CancellationToken,
) {
    let mut charged = Charged::default();
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        // A sample waits on the backend and on the Vm cache: the controllers stop without
        // waiting for it (a command's `--wait` may end before the cache is first filled).
        tokio::select! {
            _ = shutdown.cancelled() => return,
            () = sample_once(&ctx, &mut charged, &vms, &leases, samples.as_deref()) => {}
        }
    }
}

/// One sample: the backend's usage into the ledger; with `samples`, also each VM's disk (a
/// listing of the backend's VMs) and the proxy's series of VMs that are gone dropped.
async fn sample_once(
    ctx: &Ctx,
    charged: &mut Charged,
    vms: &Cache,
    leases: &Cache,
    samples: Option<&RwLock<Samples>>,
) {
    let usage = match ctx.backend.usage().await {
        Ok(u) => u,
        Err(e) => {
            tracing::debug!(error = %e.chain(), "sampling the VMs' usage failed");
            return;
        }
    };
    if let Some(l) = ctx.ledger() {
        let (rows, owners) = charged.next(&usage, vms, leases);
        let uids: Vec<String> = owners.iter().map(|o| o.uid.clone()).collect();
        let wrote = tokio::task::spawn_blocking(move || {
            l.note_owners(&owners)?;
            l.add_compute(&rows)
        })
        .await;
        match wrote {
            // noted once written: a failed write names them again next time
            Ok(Ok(())) => charged.noted.extend(uids),
            Ok(Err(e)) => tracing::warn!(error = %e, "recording compute use failed"),
            Err(e) => tracing::warn!(error = %e, "recording compute use failed"),
        }
    }
    // what only `/metrics` reads: not worth a listing of the backend's VMs elsewhere
    let Some(samples) = samples else { return };
    let disk = match ctx.backend.list().await {
        Ok(list) => list
            .into_iter()
            .filter_map(|i| Some((i.name, i.disk_used_bytes?)))
            .collect(),
        Err(_) => HashMap::new(),
    };
    *samples.write().unwrap_or_else(|e| e.into_inner()) = Samples { usage, disk };
    vms.wait_ready().await;
    let live: std::collections::HashSet<String> = vms.names().into_iter().collect();
    boxery_metrics::METRICS
        .proxy
        .retain_vms(|vm| live.contains(vm));
}

/// What the last sample saw of each VM, for the next one's differences.
#[derive(Debug, Default)]
struct Charged {
    last: Option<std::time::Instant>,
    /// VM → its hypervisor's CPU seconds at the last sample.
    cpu: HashMap<String, f64>,
    /// Owners already noted in the ledger.
    noted: std::collections::HashSet<String>,
}

/// A lease's fields the charge needs.
#[derive(Debug, Deserialize)]
struct LeaseRow {
    metadata: Meta,
    #[serde(default)]
    spec: LeaseSpecRow,
    #[serde(default)]
    status: LeaseStatusRow,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeaseSpecRow {
    #[serde(default)]
    pool: String,
    #[serde(default)]
    holder_identity: String,
}

#[derive(Debug, Default, Deserialize)]
struct LeaseStatusRow {
    #[serde(default)]
    phase: Option<String>,
    #[serde(default)]
    vm: Option<String>,
}

impl Charged {
    /// The compute rows since the last sample (none at the first, or after a gap of more than
    /// two periods: a pause of `serve` is not charged), and the owners not noted yet.
    fn next(
        &mut self,
        usage: &[VmUsage],
        vms: &Cache,
        leases: &Cache,
    ) -> (
        Vec<boxery_home::usage::ComputeUse>,
        Vec<boxery_home::usage::Owner>,
    ) {
        use boxery_home::usage::{ComputeUse, Owner, this_hour};
        let now = std::time::Instant::now();
        let since = self.last.replace(now).map(|t| now.duration_since(t));
        let mut owners = Vec::new();
        // The lease holding each VM.
        let mut held: HashMap<String, String> = HashMap::new();
        for l in leases.list_as::<LeaseRow>() {
            if l.status.phase.as_deref() != Some("Bound") {
                continue;
            }
            let Some(vm) = l.status.vm else { continue };
            if !self.noted.contains(&l.metadata.uid) {
                owners.push(Owner {
                    uid: l.metadata.uid.clone(),
                    kind: "Lease".into(),
                    name: l.metadata.name.clone(),
                    holder: l.spec.holder_identity.clone(),
                    pool: l.spec.pool.clone(),
                });
            }
            held.insert(vm, l.metadata.uid);
        }
        let specs: HashMap<String, VmRow> = vms
            .list_as::<VmRow>()
            .into_iter()
            .map(|v| (v.metadata.name.clone(), v))
            .collect();
        let mut rows = Vec::new();
        let mut cpu_now = HashMap::new();
        for u in usage {
            let before = self.cpu.get(&u.name).copied();
            cpu_now.insert(u.name.clone(), u.cpu_seconds);
            let (Some(dt), Some(v)) = (since, specs.get(&u.name)) else {
                continue;
            };
            if dt > SAMPLE_EVERY * 2 {
                continue;
            }
            if !self.noted.contains(&v.metadata.uid)
                && !owners.iter().any(|o| o.uid == *v.metadata.uid)
            {
                owners.push(Owner {
                    uid: v.metadata.uid.clone(),
                    kind: "Vm".into(),
                    name: v.metadata.name.clone(),
                    holder: String::new(),
                    pool: String::new(),
                });
            }
            let secs = dt.as_secs_f64();
            let cpus = f64::from(v.spec.resources.cpus.unwrap_or(1));
            let gib = v
                .spec
                .resources
                .memory
                .map_or(0.0, |m| m.bytes() as f64 / (1u64 << 30) as f64);
            // A counter that went back is a hypervisor that started again: all of it is new.
            let used = match before {
                Some(b) if u.cpu_seconds >= b => u.cpu_seconds - b,
                _ => u.cpu_seconds.min(secs * cpus),
            };
            rows.push(ComputeUse {
                hour: this_hour(),
                vm: u.name.clone(),
                owner: held
                    .get(&u.name)
                    .cloned()
                    .unwrap_or_else(|| v.metadata.uid.clone()),
                vcpu_seconds: cpus * secs,
                gib_seconds: gib * secs,
                cpu_seconds: used,
            });
        }
        self.cpu = cpu_now;
        (rows, owners)
    }
}

/// The values a phase enum can take, from its schema (the one list of its variants).
fn phases<T: schemars::JsonSchema>() -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(serde_json::Value::String(s)) = m.get("const") {
                    out.push(s.clone());
                }
                if let Some(serde_json::Value::Array(a)) = m.get("enum") {
                    out.extend(a.iter().filter_map(|x| x.as_str().map(String::from)));
                }
                m.values().for_each(|x| walk(x, out));
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    let schema = serde_json::to_value(schemars::schema_for!(T)).unwrap_or_default();
    let mut out = Vec::new();
    walk(&schema, &mut out);
    out.dedup();
    out
}

static VM_PHASES: LazyLock<Vec<String>> = LazyLock::new(phases::<VmPhase>);
static IMAGE_PHASES: LazyLock<Vec<String>> = LazyLock::new(phases::<ImagePhase>);
static LEASE_PHASES: LazyLock<Vec<String>> = LazyLock::new(phases::<LeasePhase>);
static GRANT_PHASES: LazyLock<Vec<String>> = LazyLock::new(phases::<GrantPhase>);

/// The fields of a Vm the series need (the rest of the cached text is skipped).
#[derive(Debug, Deserialize)]
struct VmRow {
    metadata: Meta,
    #[serde(default)]
    spec: VmSpecRow,
    #[serde(default)]
    status: PhaseRow,
}

#[derive(Debug, Deserialize)]
struct Meta {
    name: String,
    #[serde(default)]
    uid: String,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct VmSpecRow {
    #[serde(default)]
    source: BTreeMap<String, String>,
    #[serde(default)]
    resources: ResourcesRow,
    #[serde(default)]
    run_strategy: String,
}

#[derive(Debug, Default, Deserialize)]
struct ResourcesRow {
    cpus: Option<u32>,
    memory: Option<boxery_api::Quantity>,
    disk: Option<boxery_api::Quantity>,
}

#[derive(Debug, Default, Deserialize)]
struct PhaseRow {
    #[serde(default)]
    phase: Option<String>,
}

/// An object of which only the phase counts (Image, Lease, Grant), and the spec fields its
/// series are grouped by.
#[derive(Debug, Deserialize)]
struct Phased {
    #[serde(default)]
    spec: GroupRow,
    #[serde(default)]
    status: PhaseRow,
}

#[derive(Debug, Default, Deserialize)]
struct GroupRow {
    #[serde(default)]
    pool: Option<String>,
    #[serde(default, rename = "type")]
    type_: Option<String>,
}

#[derive(Debug, Deserialize)]
struct PoolRow {
    metadata: Meta,
    #[serde(default)]
    spec: PoolSpecRow,
    #[serde(default)]
    status: PoolStatusRow,
}

#[derive(Debug, Default, Deserialize)]
struct PoolSpecRow {
    #[serde(default)]
    replicas: u32,
}

#[derive(Debug, Default, Deserialize)]
struct PoolStatusRow {
    #[serde(default)]
    ready: u32,
    #[serde(default)]
    free: u32,
    #[serde(default)]
    leased: u32,
    #[serde(default)]
    resetting: u32,
    #[serde(default)]
    broken: u32,
}

/// The objects' and the VMs' runtime series.
#[derive(Debug)]
struct Objects(Observed);

/// One gauge family: its descriptor, then a sample per row.
fn gauges<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    rows: impl IntoIterator<Item = (L, f64)>,
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, unit, MetricType::Gauge)?;
    for (labels, v) in rows {
        ConstGauge::new(v).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// One counter family.
fn counters<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    rows: impl IntoIterator<Item = (L, f64)>,
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, unit, MetricType::Counter)?;
    for (labels, v) in rows {
        ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// The spec field a count is grouped by.
type GroupBy = fn(&GroupRow) -> Option<&str>;

/// Count objects by phase (every phase the kind has, zero included) and a grouping label.
fn by_phase(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    cache: &Cache,
    phases: &[String],
    group: Option<(&str, GroupBy)>,
) -> Result<(), std::fmt::Error> {
    let mut counts: BTreeMap<(String, String), u64> = BTreeMap::new();
    let rows: Vec<Phased> = cache.list_as();
    let mut groups: Vec<String> = rows
        .iter()
        .map(|r| {
            group
                .and_then(|(_, f)| f(&r.spec))
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    for (r, g) in rows.iter().zip(&groups) {
        let phase = r.status.phase.clone().unwrap_or_else(|| phases[0].clone());
        *counts.entry((g.clone(), phase)).or_default() += 1;
    }
    groups.sort();
    groups.dedup();
    if groups.is_empty() && group.is_none() {
        groups.push(String::new());
    }
    let mut out = Vec::new();
    for g in &groups {
        for p in phases {
            let n = counts.get(&(g.clone(), p.clone())).copied().unwrap_or(0);
            let labels: Vec<(&str, &str)> = match group {
                Some((key, _)) => vec![(key, g.as_str()), ("phase", p.as_str())],
                None => vec![("phase", p.as_str())],
            };
            out.push((labels, n as f64));
        }
    }
    gauges(enc, name, help, None, out)
}

impl Collector for Objects {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let attached = self.0.attached();
        gauges(
            &mut enc,
            "leader",
            "1 when this process leads the store and runs the controllers, else 0",
            None,
            [(Vec::<(&str, &str)>::new(), f64::from(attached.is_some()))],
        )?;
        let Some(a) = attached else {
            return Ok(());
        };
        let mut vms: Vec<VmRow> = a.vms.list_as();
        vms.sort_unstable_by(|x, y| x.metadata.name.cmp(&y.metadata.name));
        gauges(
            &mut enc,
            "vm_info",
            "One per Vm: its uid, where its disk came from, its run strategy and its pool",
            None,
            vms.iter().map(|v| {
                let (kind, source) = v
                    .spec
                    .source
                    .iter()
                    .next()
                    .map_or(("", ""), |(k, n)| (k.as_str(), n.as_str()));
                (
                    [
                        ("vm", v.metadata.name.as_str()),
                        ("uid", v.metadata.uid.as_str()),
                        ("source_kind", kind),
                        ("source", source),
                        ("run_strategy", v.spec.run_strategy.as_str()),
                        (
                            "pool",
                            v.metadata
                                .labels
                                .get(boxery_api::pool::POOL_LABEL)
                                .map_or("", String::as_str),
                        ),
                    ],
                    1.0,
                )
            }),
        )?;
        gauges(
            &mut enc,
            "vm_status_phase",
            "The Vm's phase: 1 for the phase it is in, 0 for the others",
            None,
            vms.iter().flat_map(|v| {
                let now = v.status.phase.as_deref().unwrap_or("Pending");
                VM_PHASES.iter().map(move |p| {
                    (
                        [("vm", v.metadata.name.as_str()), ("phase", p.as_str())],
                        f64::from(p == now),
                    )
                })
            }),
        )?;
        gauges(
            &mut enc,
            "vm_spec_cpus",
            "Virtual CPUs the Vm asks for",
            None,
            vms.iter().filter_map(|v| {
                Some((
                    [("vm", v.metadata.name.as_str())],
                    f64::from(v.spec.resources.cpus?),
                ))
            }),
        )?;
        for (name, help, pick) in [
            (
                "vm_spec_memory",
                "Guest memory the Vm asks for",
                (|r: &ResourcesRow| r.memory) as fn(&ResourcesRow) -> Option<boxery_api::Quantity>,
            ),
            ("vm_spec_disk", "Disk size the Vm asks for", |r| r.disk),
        ] {
            gauges(
                &mut enc,
                name,
                help,
                Some(&Unit::Bytes),
                vms.iter().filter_map(|v| {
                    Some((
                        [("vm", v.metadata.name.as_str())],
                        pick(&v.spec.resources)?.bytes() as f64,
                    ))
                }),
            )?;
        }

        let mut pools: Vec<PoolRow> = a.pools.list_as();
        pools.sort_unstable_by(|x, y| x.metadata.name.cmp(&y.metadata.name));
        type Pick = fn(&PoolRow) -> u32;
        for (name, help, pick) in [
            (
                "pool_spec_replicas",
                "Members the Pool asks for",
                (|p: &PoolRow| p.spec.replicas) as Pick,
            ),
            ("pool_status_ready", "Pool members Ready", |p| {
                p.status.ready
            }),
            (
                "pool_status_free",
                "Pool members Ready and not leased",
                |p| p.status.free,
            ),
            ("pool_status_leased", "Pool members held by a lease", |p| {
                p.status.leased
            }),
            (
                "pool_status_resetting",
                "Pool members being reset to a clean image",
                |p| p.status.resetting,
            ),
            ("pool_status_broken", "Pool members that failed", |p| {
                p.status.broken
            }),
        ] {
            gauges(
                &mut enc,
                name,
                help,
                None,
                pools
                    .iter()
                    .map(|p| ([("pool", p.metadata.name.as_str())], f64::from(pick(p)))),
            )?;
        }
        by_phase(
            &mut enc,
            "lease_status_phase",
            "Leases by pool and phase",
            &a.leases,
            &LEASE_PHASES,
            Some(("pool", |g| g.pool.as_deref())),
        )?;
        by_phase(
            &mut enc,
            "grant_status_phase",
            "Grants by type and phase",
            &a.grants,
            &GRANT_PHASES,
            Some(("type", |g| g.type_.as_deref())),
        )?;
        by_phase(
            &mut enc,
            "image_status_phase",
            "Images by phase",
            &a.images,
            &IMAGE_PHASES,
            None,
        )?;

        let samples = a.samples.read().unwrap_or_else(|e| e.into_inner());
        let mut usage: Vec<&VmUsage> = samples.usage.iter().collect();
        usage.sort_unstable_by(|x, y| x.name.cmp(&y.name));
        counters(
            &mut enc,
            "vm_cpu",
            "CPU time the VM's hypervisor process used since it started (every vCPU and thread)",
            Some(&Unit::Seconds),
            usage
                .iter()
                .map(|u| ([("vm", u.name.as_str())], u.cpu_seconds)),
        )?;
        gauges(
            &mut enc,
            "vm_memory_rss",
            "Host memory the VM's hypervisor process holds (resident set)",
            Some(&Unit::Bytes),
            usage
                .iter()
                .map(|u| ([("vm", u.name.as_str())], u.rss_bytes as f64)),
        )?;
        let mut disk: Vec<(&String, &u64)> = samples.disk.iter().collect();
        disk.sort_unstable();
        gauges(
            &mut enc,
            "vm_disk_used",
            "Host disk the VM's own disk takes (its shared base not counted)",
            Some(&Unit::Bytes),
            disk.iter().map(|(n, b)| ([("vm", n.as_str())], **b as f64)),
        )?;
        type Bytes = fn(&VmUsage) -> Option<u64>;
        for (name, help, pick) in [
            (
                "vm_network_receive",
                "Bytes the guest received on its network since its hypervisor started",
                (|u: &VmUsage| u.network_rx_bytes) as Bytes,
            ),
            (
                "vm_network_transmit",
                "Bytes the guest sent on its network since its hypervisor started",
                |u| u.network_tx_bytes,
            ),
        ] {
            counters(
                &mut enc,
                name,
                help,
                Some(&Unit::Bytes),
                usage
                    .iter()
                    .filter_map(|u| Some(([("vm", u.name.as_str())], pick(u)? as f64))),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_come_from_the_schemas() {
        assert_eq!(VM_PHASES.first().map(String::as_str), Some("Pending"));
        assert!(VM_PHASES.iter().any(|p| p == "Suspended"), "{VM_PHASES:?}");
        assert!(LEASE_PHASES.iter().any(|p| p == "Bound"));
        assert!(GRANT_PHASES.iter().any(|p| p == "PendingApproval"));
        assert!(IMAGE_PHASES.iter().any(|p| p == "Ready"));
        assert_eq!(
            VM_PHASES.len(),
            VM_PHASES
                .iter()
                .collect::<std::collections::BTreeSet<_>>()
                .len()
        );
    }
}

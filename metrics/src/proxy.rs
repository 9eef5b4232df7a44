//! The credential and egress proxy's instruments: requests, bytes and latency by route and
//! status, per VM. Kept in a map of our own rather than a `Family`, so that a VM's series
//! can be dropped when the VM is gone ([`ProxyStats::retain_vms`]).

use std::collections::HashMap;
use std::sync::Mutex;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::{METRICS, NewHistogram, seconds};

/// A route and a status code.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteCode {
    /// `llm`, `edge`, `egress`, or `none` (the path was no route).
    pub route: &'static str,
    /// The HTTP status returned to the VM.
    pub code: u16,
}

/// One request that ended, as the proxy saw it.
#[derive(Debug, Clone, Copy)]
pub struct Transfer<'a> {
    /// The VM whose token it carried; `None` when no token was accepted.
    pub vm: Option<&'a str>,
    /// Its route (see [`RouteCode::route`]).
    pub route: &'static str,
    /// The status returned.
    pub code: u16,
    /// Request body bytes forwarded upstream.
    pub bytes_in: u64,
    /// Response body bytes returned to the VM.
    pub bytes_out: u64,
    /// Seconds from arrival to the end of the response.
    pub seconds: f64,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    requests: u64,
    bytes_in: u64,
    bytes_out: u64,
}

/// The proxy's instruments.
#[derive(Debug)]
pub struct ProxyStats {
    /// (vm, route, code) → counts; the VM is `""` when no token was accepted.
    by_vm: Mutex<HashMap<(String, &'static str, u16), Counts>>,
    /// Seconds per request, by route and code (no VM: buckets per VM would multiply).
    duration: Family<RouteCode, Histogram, NewHistogram>,
}

impl Default for ProxyStats {
    fn default() -> Self {
        ProxyStats {
            by_vm: Mutex::default(),
            duration: Family::new_with_constructor(seconds),
        }
    }
}

impl ProxyStats {
    /// Count a request that ended.
    pub fn record(&self, t: Transfer<'_>) {
        {
            let mut m = self.by_vm.lock().unwrap_or_else(|e| e.into_inner());
            let c = m
                .entry((t.vm.unwrap_or("").to_string(), t.route, t.code))
                .or_default();
            c.requests += 1;
            c.bytes_in += t.bytes_in;
            c.bytes_out += t.bytes_out;
        }
        self.duration
            .get_or_create(&RouteCode {
                route: t.route,
                code: t.code,
            })
            .observe(t.seconds);
    }

    /// Keep the series of the VMs `keep` says yes to (and those of requests with no VM);
    /// drop the rest, the VMs that are gone.
    pub fn retain_vms(&self, keep: impl Fn(&str) -> bool) {
        let mut m = self.by_vm.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|(vm, _, _), _| vm.is_empty() || keep(vm));
    }

    /// Requests counted for `vm` so far (all routes and codes).
    #[cfg(test)]
    pub(crate) fn requests_of(&self, vm: &str) -> u64 {
        let m = self.by_vm.lock().unwrap_or_else(|e| e.into_inner());
        m.iter()
            .filter(|((v, _, _), _)| v == vm)
            .map(|(_, c)| c.requests)
            .sum()
    }

    pub(crate) fn register(&self, r: &mut Registry) {
        r.register_with_unit(
            "proxy_request_duration",
            "Time from a request's arrival at the proxy to the end of its response, by route and status code",
            Unit::Seconds,
            self.duration.clone(),
        );
        r.register_collector(Box::new(ByVm));
    }
}

/// The per-VM series of [`METRICS`]' proxy, encoded at each scrape.
#[derive(Debug)]
struct ByVm;

impl Collector for ByVm {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let mut rows: Vec<((String, &'static str, u16), Counts)> = {
            let m = METRICS
                .proxy
                .by_vm
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            m.iter().map(|(k, v)| (k.clone(), *v)).collect()
        };
        rows.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let mut requests = encoder.encode_descriptor(
            "proxy_requests",
            "Requests through the credential and egress proxy, by VM, route and status code",
            None,
            MetricType::Counter,
        )?;
        for ((vm, route, code), c) in &rows {
            let code = code.to_string();
            let labels = [
                ("vm", vm.as_str()),
                ("route", route),
                ("code", code.as_str()),
            ];
            ConstCounter::new(c.requests).encode(requests.encode_family(&labels)?)?;
        }
        // Bytes by VM and route: the codes summed.
        // (vm, route) → (received, sent)
        type Bytes<'a> = ((&'a str, &'a str), (u64, u64));
        let mut bytes: Vec<Bytes<'_>> = Vec::new();
        for ((vm, route, _), c) in &rows {
            match bytes.last_mut() {
                Some((k, v)) if *k == (vm.as_str(), *route) => {
                    v.0 += c.bytes_in;
                    v.1 += c.bytes_out;
                }
                _ => bytes.push(((vm.as_str(), route), (c.bytes_in, c.bytes_out))),
            }
        }
        for (name, help, pick) in [
            (
                "proxy_received",
                "Request body bytes the proxy forwarded upstream, by VM and route",
                0,
            ),
            (
                "proxy_sent",
                "Response body bytes the proxy returned to the VM, by VM and route",
                1,
            ),
        ] {
            let mut m =
                encoder.encode_descriptor(name, help, Some(&Unit::Bytes), MetricType::Counter)?;
            for ((vm, route), (i, o)) in &bytes {
                let labels = [("vm", *vm), ("route", *route)];
                let v = if pick == 0 { *i } else { *o };
                ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Exposition, Format};

    #[test]
    fn requests_are_counted_per_vm_and_dropped_with_their_vm() {
        let t = |vm, code| Transfer {
            vm,
            route: "llm",
            code,
            bytes_in: 10,
            bytes_out: 100,
            seconds: 0.01,
        };
        let stats = &METRICS.proxy;
        stats.record(t(Some("pm-a"), 200));
        stats.record(t(Some("pm-a"), 200));
        stats.record(t(Some("pm-a"), 403));
        stats.record(t(Some("pm-b"), 200));
        stats.record(t(None, 401));
        let text = Exposition::new(Vec::new()).render(Format::Prometheus);
        assert!(
            text.contains("boxery_proxy_requests_total{vm=\"pm-a\",route=\"llm\",code=\"200\"} 2"),
            "{text}"
        );
        assert!(text.contains("boxery_proxy_sent_bytes_total{vm=\"pm-a\",route=\"llm\"} 300"));
        assert!(text.contains("boxery_proxy_received_bytes_total{vm=\"pm-b\",route=\"llm\"} 10"));
        assert!(
            text.contains(
                "boxery_proxy_request_duration_seconds_count{route=\"llm\",code=\"403\"}"
            )
        );
        stats.retain_vms(|vm| vm != "pm-a");
        assert_eq!(stats.requests_of("pm-a"), 0);
        assert_eq!(stats.requests_of("pm-b"), 1);
        assert!(stats.requests_of("") >= 1, "requests with no VM are kept");
    }
}

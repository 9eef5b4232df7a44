//! What the control-plane benches share: a fleet of Vm objects, a lease on a pool, a
//! process's RSS, and a `serve` child killed when dropped.
#![allow(dead_code)]

use std::process::Child;

use boxery_api::lease::LeaseSpec;
use boxery_api::vm::{Resources, VmSpec};
use boxery_api::{DynObject, Lease, RunStrategy, Vm, VmSource};

/// The public key the benches' leases carry.
const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb0uMmDhD7Z3hSR6rW9q2x5Zk2kq3w5b5dB8kKTtJxk bench";

/// Lease `name` on `pool`, for 30 minutes, held by `bench`.
pub fn lease(pool: &str, name: &str) -> Lease {
    Lease::new(
        name,
        LeaseSpec {
            pool: pool.into(),
            holder_identity: "bench".into(),
            lease_duration_seconds: 1800,
            renew_time: None,
            public_key: KEY.into(),
            budget: None,
        },
    )
}

/// `n` Vms (`vm-0000`…) of the stock image, running.
pub fn vms(n: usize) -> Vec<DynObject> {
    (0..n)
        .map(|i| {
            let spec = VmSpec {
                source: VmSource::Image("debian-12".into()),
                instance_type: None,
                resources: Resources::default(),
                headless: true,
                layers: vec![],
                run_strategy: RunStrategy::Running,
                restore: None,
                network: Default::default(),
                idle: None,
                display: None,
            };
            DynObject::from_typed(&Vm::new(format!("vm-{i:04}"), spec)).unwrap()
        })
        .collect()
}

/// A process's resident set, KiB.
pub fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A child `serve`, killed and reaped when dropped.
pub struct Serve(pub Child);
impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

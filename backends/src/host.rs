//! Facts about this host every VM driver needs: which accelerator works, how many CPUs and
//! how much memory a VM may ask for, and what a hypervisor process uses.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{BackendError, Result};

/// The accelerator a VM runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualization.
    Kvm,
    /// QEMU's emulator (slow, works everywhere).
    Tcg,
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

/// The accelerator chosen for this host, and why, in words fit for a status or an event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccelChoice {
    /// The accelerator.
    pub accel: Accel,
    /// Why.
    pub reason: String,
}

/// Choose the accelerator: `requested` (`kvm`, `tcg` or `auto`, from `BOXERY_QEMU_ACCEL`)
/// or, for `auto`, KVM only when `/dev/kvm` opens read-write and the host's KVM is not
/// `kvm_pvm` (which runs only PVM-built guest kernels: `/dev/kvm` opens, guests hang).
pub fn detect_accel(requested: Option<&str>) -> AccelChoice {
    match requested.map(str::trim) {
        Some("tcg") => {
            return AccelChoice {
                accel: Accel::Tcg,
                reason: "TCG (emulation) because BOXERY_QEMU_ACCEL=tcg".into(),
            };
        }
        Some("kvm") => {
            return AccelChoice {
                accel: Accel::Kvm,
                reason: "KVM because BOXERY_QEMU_ACCEL=kvm".into(),
            };
        }
        _ => {}
    }
    let kvm = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm");
    match kvm {
        Err(e) => AccelChoice { accel: Accel::Tcg, reason: format!("TCG (emulation, slow): /dev/kvm cannot be opened ({e})") },
        Ok(_) if Path::new("/sys/module/kvm_pvm").exists() => AccelChoice {
            accel: Accel::Tcg,
            reason: "TCG (emulation, slow): the host's KVM is kvm_pvm, which runs only PVM guest kernels".into(),
        },
        Ok(_) => AccelChoice { accel: Accel::Kvm, reason: "KVM: /dev/kvm opens and the host KVM is standard".into() },
    }
}

/// The host's CPU count and memory in MiB.
pub fn host_capacity() -> (u32, u64) {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb / 1024)
        .unwrap_or(0);
    (cpus, mem)
}

/// Refuse a size this host cannot give (`Invalid`: retrying will not help).
pub(crate) fn check_size(cpus: u32, memory_mib: u64) -> Result<()> {
    let (host_cpus, host_mem) = host_capacity();
    if cpus == 0 || cpus > host_cpus {
        return Err(BackendError::Invalid(format!(
            "{cpus} CPUs asked, but this host has {host_cpus}: ask for 1 to {host_cpus}"
        )));
    }
    if memory_mib < 64 || (host_mem > 0 && memory_mib > host_mem) {
        return Err(BackendError::Invalid(format!(
            "{memory_mib} MiB of memory asked, but this host has {host_mem} MiB: ask for 64 MiB to {host_mem} MiB"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accel_override() {
        assert_eq!(detect_accel(Some("tcg")).accel, Accel::Tcg);
        assert_eq!(detect_accel(Some("kvm")).accel, Accel::Kvm);
        if Path::new("/sys/module/kvm_pvm").exists() {
            assert_eq!(detect_accel(None).accel, Accel::Tcg);
        }
    }
}

/// What a process uses of the host now: its CPU seconds (user and system, all threads) and
/// its resident memory in bytes, from `/proc/PID/stat` and `/proc/PID/statm`; `None` when
/// it is gone.
pub fn process_usage(pid: i32) -> Option<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let ticks = parse_cpu_ticks(&stat)?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    let hz = rustix::param::clock_ticks_per_second().max(1) as f64;
    Some((
        ticks as f64 / hz,
        pages.saturating_mul(rustix::param::page_size() as u64),
    ))
}

/// `utime + stime` of a `/proc/PID/stat` line, in clock ticks. The command name, in
/// parentheses, may hold spaces and parentheses itself: the fields are counted after its
/// last `)`.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // after the name: state (field 3) … utime (14), stime (15)
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod usage_tests {
    use super::*;

    #[test]
    fn cpu_ticks_are_read_past_a_name_with_spaces_and_parentheses() {
        let line = "4242 (qemu (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 730 270 0 0 20 0 3 0 100 1000 200 18446744073709551615";
        assert_eq!(parse_cpu_ticks(line), Some(1000));
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    #[test]
    fn this_process_has_usage_and_a_gone_one_has_none() {
        let (cpu, rss) = process_usage(std::process::id() as i32).unwrap();
        assert!(cpu >= 0.0 && rss > 1 << 20, "{cpu} {rss}");
        assert_eq!(process_usage(i32::MAX), None);
    }
}

//! Leader election through a row per lock.
//!
//! # Guarantees
//! - At most one holder per lock at a time, as long as clocks of the processes sharing the
//!   file agree (they share a host, or a file system with synchronized clocks).
//! - `epoch` grows by one every time the holder changes (never when a holder renews), so a
//!   former leader's work can be fenced by comparing epochs.
//!
//! # Takeover
//! A candidate takes the lock when nobody holds it, when the lease expired, when it already
//! holds it, or when the holder ran on this same boot (same `boot_id`) and its process is gone:
//! `/proc/PID` is missing, is a zombie, or belongs to a newer process (its start time, field 22
//! of `/proc/PID/stat`, differs from the one recorded). A restarted control plane thus takes
//! over at once from a SIGKILLed one on the same host; a holder on another boot (or host)
//! is waited out for one TTL.
//!
//! # Caveats
//! Where `/proc` does not exist, liveness cannot be checked and only the TTL frees a lock.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use crate::{Candidate, Leadership, Result};

struct Row {
    holder: String,
    pid: u32,
    boot_id: String,
    start_time: Option<u64>,
    epoch: u64,
    expires_ms: i64,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Take or renew `lock` for `me`, or report who holds it.
pub(crate) fn try_lead(
    conn: &mut Connection,
    lock: &str,
    me: &Candidate,
    ttl: Duration,
) -> Result<Leadership> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let row = tx
        .prepare_cached(
            "SELECT holder, pid, boot_id, start_time, epoch, expires_ms FROM leaders WHERE lock = ?1",
        )?
        .query_row([lock], |r| {
            Ok(Row {
                holder: r.get(0)?,
                pid: r.get::<_, i64>(1)?.clamp(0, u32::MAX as i64) as u32,
                boot_id: r.get(2)?,
                start_time: r.get::<_, Option<i64>>(3)?.map(|v| v.max(0) as u64),
                epoch: r.get::<_, i64>(4)?.max(0) as u64,
                expires_ms: r.get(5)?,
            })
        })
        .optional()?;
    let now = now_ms();
    let epoch = match &row {
        None => 1,
        Some(r) if r.holder == me.id => r.epoch,
        Some(r) if r.expires_ms <= now => r.epoch + 1,
        Some(r) if r.boot_id == me.boot_id && !process_alive(r.pid, r.start_time) => r.epoch + 1,
        Some(r) => {
            let expires_in = Duration::from_millis((r.expires_ms - now).max(0) as u64);
            return Ok(Leadership::Follower {
                holder: r.holder.clone(),
                expires_in,
            });
        }
    };
    let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX / 2);
    tx.prepare_cached(
        "INSERT INTO leaders (lock, holder, pid, boot_id, start_time, epoch, expires_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
         ON CONFLICT (lock) DO UPDATE SET holder = excluded.holder, pid = excluded.pid, \
         boot_id = excluded.boot_id, start_time = excluded.start_time, epoch = excluded.epoch, \
         expires_ms = excluded.expires_ms",
    )?
    .execute(params![
        lock,
        me.id,
        me.pid as i64,
        me.boot_id,
        process_start_time(me.pid).map(|v| v as i64),
        epoch as i64,
        now.saturating_add(ttl_ms),
    ])?;
    tx.commit()?;
    Ok(Leadership::Leader { epoch })
}

/// Who holds `lock` now, if anyone: `None` when it was never taken, was given up, expired, or
/// its holder ran on this boot and its process is gone (exactly when [`try_lead`] would take
/// it). Reads only.
pub(crate) fn holder(conn: &Connection, lock: &str) -> Result<Option<String>> {
    let row = conn
        .prepare_cached(
            "SELECT holder, pid, boot_id, start_time, expires_ms FROM leaders WHERE lock = ?1",
        )?
        .query_row([lock], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)?.clamp(0, u32::MAX as i64) as u32,
                r.get::<_, String>(2)?,
                r.get::<_, Option<i64>>(3)?.map(|v| v.max(0) as u64),
                r.get::<_, i64>(4)?,
            ))
        })
        .optional()?;
    Ok(row.and_then(|(holder, pid, boot, start, expires_ms)| {
        let gone = expires_ms <= now_ms() || (boot == boot_id() && !process_alive(pid, start));
        (!gone).then_some(holder)
    }))
}

/// Give up `lock` if `me` holds it: the lease expires now (the row stays, so the next
/// holder's epoch is still higher).
pub(crate) fn resign(conn: &mut Connection, lock: &str, me: &Candidate) -> Result<()> {
    conn.prepare_cached("UPDATE leaders SET expires_ms = 0 WHERE lock = ?1 AND holder = ?2")?
        .execute(params![lock, me.id])?;
    Ok(())
}

/// The fields of `/proc/PID/stat` after the command name (which may hold spaces and
/// parentheses): index 0 is field 3 (state).
fn stat_fields(pid: u32) -> std::io::Result<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = s.rfind(')').map(|i| &s[i + 1..]).unwrap_or("");
    Ok(rest.split_whitespace().map(str::to_string).collect())
}

/// A process's start time (clock ticks after boot, field 22 of `/proc/PID/stat`).
pub(crate) fn process_start_time(pid: u32) -> Option<u64> {
    stat_fields(pid).ok()?.get(22 - 3)?.parse().ok()
}

/// Whether the process `pid` still runs (and is the one that started at `start_time`, when
/// known). Without `/proc`, every process counts as alive.
pub(crate) fn process_alive(pid: u32, start_time: Option<u64>) -> bool {
    if !std::path::Path::new("/proc/self/stat").exists() {
        return true;
    }
    match stat_fields(pid) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(_) => true,
        Ok(f) => {
            let state = f.first().map(String::as_str).unwrap_or("");
            if state == "Z" || state == "X" || state == "x" {
                return false;
            }
            match (
                start_time,
                f.get(22 - 3).and_then(|s| s.parse::<u64>().ok()),
            ) {
                (Some(recorded), Some(now)) => recorded == now,
                _ => true,
            }
        }
    }
}

/// This machine's boot id (`/proc/sys/kernel/random/boot_id`), or `""` where there is none.
/// `BOXERY_BOOT_ID` overrides it: how tests show boxery a host reboot.
pub fn boot_id() -> String {
    std::env::var("BOXERY_BOOT_ID")
        .ok()
        .filter(|b| !b.is_empty())
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_has_a_start_time() {
        let me = std::process::id();
        let start = process_start_time(me);
        assert!(start.is_some());
        assert!(process_alive(me, start));
        assert!(
            !process_alive(me, start.map(|s| s + 1)),
            "a different start time means PID reuse"
        );
        assert!(!process_alive(u32::MAX - 1, None));
        assert!(!boot_id().is_empty());
    }
}

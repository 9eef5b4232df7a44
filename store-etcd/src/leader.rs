//! Leader locks on etcd: one key per lock (`P/leader/LOCK`) holding its holder, epoch and
//! expiry (wall clock, milliseconds), taken and renewed by compare-and-swap on the key's
//! `mod_revision`. The same rules as the SQLite store's rows, but for one: a holder on another
//! host cannot be seen to have died, so a lock is free only once it expired (or was given up).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use boxery_store::{Candidate, Leadership, Result};
use etcd_client::{Compare, CompareOp, KvClient, Txn, TxnOp};

use crate::etcd_error;

#[derive(serde::Serialize, serde::Deserialize)]
struct Row {
    holder: String,
    epoch: u64,
    expires_ms: i64,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The lock's row and its key's `mod_revision` (0: no row).
async fn read(kv: &mut KvClient, key: &str) -> Result<(Option<Row>, i64)> {
    let r = kv.get(key, None).await.map_err(etcd_error)?;
    match r.kvs().first() {
        Some(kv) => Ok((serde_json::from_slice(kv.value()).ok(), kv.mod_revision())),
        None => Ok((None, 0)),
    }
}

/// The condition that the key is as read.
fn unchanged(key: &str, mod_revision: i64) -> Compare {
    if mod_revision == 0 {
        Compare::version(key, CompareOp::Equal, 0)
    } else {
        Compare::mod_revision(key, CompareOp::Equal, mod_revision)
    }
}

pub(crate) async fn try_lead(
    mut kv: KvClient,
    key: String,
    me: Candidate,
    ttl: Duration,
) -> Result<Leadership> {
    loop {
        let (row, at) = read(&mut kv, &key).await?;
        let now = now_ms();
        let epoch = match &row {
            None => 1,
            Some(r) if r.holder == me.id => r.epoch,
            Some(r) if r.expires_ms <= now => r.epoch + 1,
            Some(r) => {
                return Ok(Leadership::Follower {
                    holder: r.holder.clone(),
                    expires_in: Duration::from_millis((r.expires_ms - now).max(0) as u64),
                });
            }
        };
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX / 2);
        let new = Row {
            holder: me.id.clone(),
            epoch,
            expires_ms: now.saturating_add(ttl_ms),
        };
        let put = TxnOp::put(key.as_str(), serde_json::to_vec(&new)?, None);
        let r = kv
            .txn(Txn::new().when([unchanged(&key, at)]).and_then([put]))
            .await
            .map_err(etcd_error)?;
        if r.succeeded() {
            return Ok(Leadership::Leader { epoch });
        }
        // another candidate wrote the row since it was read: decide again on what it wrote
    }
}

pub(crate) async fn holder(mut kv: KvClient, key: String) -> Result<Option<String>> {
    let (row, _) = read(&mut kv, &key).await?;
    Ok(row.filter(|r| r.expires_ms > now_ms()).map(|r| r.holder))
}

/// Give the lock up: its row stays, expired, so the next holder's epoch is still higher.
pub(crate) async fn resign(mut kv: KvClient, key: String, me: Candidate) -> Result<()> {
    let (row, at) = read(&mut kv, &key).await?;
    if let Some(mut r) = row.filter(|r| r.holder == me.id) {
        r.expires_ms = 0;
        // a row another candidate took meanwhile is left alone
        kv.txn(Txn::new().when([unchanged(&key, at)]).and_then([TxnOp::put(
            key.as_str(),
            serde_json::to_vec(&r)?,
            None,
        )]))
        .await
        .map_err(etcd_error)?;
    }
    Ok(())
}

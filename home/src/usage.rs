//! The usage ledger, `$BOXERY_HOME/usage.db` ([`layout::usage_db`], 0600): what each VM used,
//! by the hour, kept across restarts of `serve` (docs/observability.md, "Usage").
//!
//! - `llm`: requests and LLM tokens (input, output) per hour, VM, token owner (the lease that
//!   held the VM, or the VM itself), grant, provider and model; written by the credential
//!   proxy when a response ends, read back for the grants' limits.
//! - `compute`: vCPU-seconds and GiB-seconds allocated and CPU seconds used per hour, VM and
//!   owner; written by `serve`'s sampler.
//! - `owners`: what each owner uid was (a Vm, or a Lease with its pool and holder), so a report
//!   by lease or holder still names a lease deleted long ago.
//!
//! # Guarantees
//! - Every write is one transaction; a crash loses at most the rows not yet written (the
//!   proxy's writer batches for a few milliseconds), never a half row.
//! - Counts only grow: rows are added to, never rewritten.
//!
//! # Assumptions
//! - One writer process (`serve`); readers (`boxery usage`, a standby) see committed rows.

use std::path::Path;
use std::sync::Mutex;

use rusqlite::{Connection, OptionalExtension, params};

use crate::layout;

/// Seconds in an hour: the ledger's granularity.
pub const HOUR: i64 = 3600;

/// The hour `unix_seconds` falls in.
pub fn hour_of(unix_seconds: i64) -> i64 {
    unix_seconds.div_euclid(HOUR)
}

/// The hour it is now.
pub fn this_hour() -> i64 {
    hour_of(now())
}

/// Seconds since the epoch, now.
pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// The first hour of the UTC day and of the UTC month `unix` falls in: the periods of a
/// grant's `tokensPerDay` and `dollarsPerMonth`.
pub fn periods(unix: i64) -> (i64, i64) {
    use chrono::{Datelike, TimeZone, Utc};
    let hour = hour_of(unix);
    let day = hour - hour.rem_euclid(24);
    let t = Utc.timestamp_opt(unix, 0).single().unwrap_or_default();
    let month = Utc
        .with_ymd_and_hms(t.year(), t.month(), 1, 0, 0, 0)
        .single()
        .map_or(day, |m| hour_of(m.timestamp()));
    (day, month)
}

/// When the UTC month after the one starting at hour `month` starts.
pub fn next_month(month: i64) -> chrono::DateTime<chrono::Utc> {
    use chrono::{Datelike, TimeZone, Utc};
    let t = Utc
        .timestamp_opt(month * HOUR, 0)
        .single()
        .unwrap_or_default();
    let (y, m) = if t.month() == 12 {
        (t.year() + 1, 1)
    } else {
        (t.year(), t.month() + 1)
    };
    Utc.with_ymd_and_hms(y, m, 1, 0, 0, 0)
        .single()
        .unwrap_or_default()
}

/// LLM use of one request (or the sum of several with the same key).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LlmUse {
    /// The hour ([`hour_of`]).
    pub hour: i64,
    /// The VM.
    pub vm: String,
    /// The token owner's uid: the lease holding the VM, or the VM.
    pub owner: String,
    /// The grant's uid.
    pub grant_uid: String,
    /// The grant's name.
    pub grant: String,
    /// The provider (`anthropic`, `openai`, …).
    pub provider: String,
    /// The model the provider said it used (`""` when it said none).
    pub model: String,
    /// Requests.
    pub requests: u64,
    /// Input tokens (cache reads and writes included).
    pub input: u64,
    /// Output tokens.
    pub output: u64,
}

/// Compute one VM was given and used over part of an hour.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ComputeUse {
    /// The hour.
    pub hour: i64,
    /// The VM.
    pub vm: String,
    /// Its owner's uid (see [`LlmUse::owner`]).
    pub owner: String,
    /// vCPUs × seconds it ran.
    pub vcpu_seconds: f64,
    /// GiB of memory × seconds it ran.
    pub gib_seconds: f64,
    /// CPU seconds its hypervisor used.
    pub cpu_seconds: f64,
}

/// What an owner uid was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The uid.
    pub uid: String,
    /// `Vm` or `Lease`.
    pub kind: String,
    /// The object's name.
    pub name: String,
    /// A lease's holder (`""` for a VM).
    pub holder: String,
    /// A lease's pool (`""` for a VM).
    pub pool: String,
}

/// What a report is grouped by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    /// Per VM.
    Vm,
    /// Per lease (VMs outside a lease: `-`).
    Lease,
    /// Per lease holder.
    Holder,
    /// Per grant (compute has no grant: not in this report).
    Grant,
    /// Per pool.
    Pool,
}

/// One line of a report: a group and its sums.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Line {
    /// The group (a VM, a lease, a holder, a grant or a pool; `-` for none).
    pub name: String,
    /// LLM requests.
    pub requests: u64,
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Input and output tokens per model, for pricing.
    #[serde(skip)]
    pub by_model: Vec<(String, u64, u64)>,
    /// vCPU-hours allocated.
    pub vcpu_hours: f64,
    /// GiB-hours of memory allocated.
    pub gib_hours: f64,
    /// CPU seconds used.
    pub cpu_seconds: f64,
}

/// Tokens and requests of one grant since an hour, per model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GrantUse {
    /// Requests.
    pub requests: u64,
    /// (model, input, output).
    pub by_model: Vec<(String, u64, u64)>,
}

impl GrantUse {
    /// Input and output tokens, all models.
    pub fn tokens(&self) -> u64 {
        self.by_model.iter().map(|(_, i, o)| i + o).sum()
    }
}

/// Whose use [`Ledger::totals`] sums.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// One owner uid's (a lease's, or a VM's outside any lease).
    Owner(String),
    /// One VM's, whoever owned it.
    Vm(String),
    /// The leases' of one pool.
    Pool(String),
}

/// The sums of one scope: compute, and LLM use per provider.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Totals {
    /// vCPU-seconds.
    pub vcpu_seconds: f64,
    /// GiB-seconds.
    pub gib_seconds: f64,
    /// CPU seconds.
    pub cpu_seconds: f64,
    /// (provider, requests, input, output), sorted by provider.
    pub llm: Vec<(String, u64, u64, u64)>,
}

/// How long a ledger's connection waits for another's lock.
const BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The ledger: one SQLite connection.
#[derive(Debug)]
pub struct Ledger {
    conn: Mutex<Connection>,
}

/// The tables, made in one `BEGIN IMMEDIATE` transaction (see [`Ledger::open`]).
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS llm (
  hour INTEGER NOT NULL, vm TEXT NOT NULL, owner TEXT NOT NULL, grant_uid TEXT NOT NULL,
  grant_name TEXT NOT NULL, provider TEXT NOT NULL, model TEXT NOT NULL,
  requests INTEGER NOT NULL DEFAULT 0, input INTEGER NOT NULL DEFAULT 0,
  output INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (hour, vm, owner, grant_uid, provider, model)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS llm_grant ON llm (grant_uid, hour);
CREATE INDEX IF NOT EXISTS llm_owner_sums
  ON llm (owner, hour, provider, requests, input, output);
CREATE INDEX IF NOT EXISTS llm_vm_sums ON llm (vm, hour, provider, requests, input, output);
CREATE TABLE IF NOT EXISTS compute (
  hour INTEGER NOT NULL, vm TEXT NOT NULL, owner TEXT NOT NULL,
  vcpu_seconds REAL NOT NULL DEFAULT 0, gib_seconds REAL NOT NULL DEFAULT 0,
  cpu_seconds REAL NOT NULL DEFAULT 0,
  PRIMARY KEY (hour, vm, owner)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS compute_owner_sums
  ON compute (owner, hour, vcpu_seconds, gib_seconds, cpu_seconds);
CREATE INDEX IF NOT EXISTS compute_vm_sums
  ON compute (vm, hour, vcpu_seconds, gib_seconds, cpu_seconds);
CREATE TABLE IF NOT EXISTS owners (
  uid TEXT PRIMARY KEY, kind TEXT NOT NULL, name TEXT NOT NULL,
  holder TEXT NOT NULL DEFAULT '', pool TEXT NOT NULL DEFAULT '');
";

fn sql(e: rusqlite::Error) -> std::io::Error {
    std::io::Error::other(format!("the usage ledger: {e}"))
}

impl Ledger {
    /// Open (and make, 0600 in a 0700 home) the ledger of `home`.
    pub fn open(home: &Path) -> std::io::Result<Ledger> {
        crate::private::dir(home)?;
        let path = layout::usage_db(home);
        if !path.exists() {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .open(&path)?;
        }
        // Several openers at once is the ordinary case (`serve`'s sampler and its credential
        // proxy open it together at start, `boxery usage` any time). SQLite answers BUSY at
        // once, without its busy handler, to a switch to WAL while another connection opens
        // the same new file (the store's way of opening tries it again), and to a plain
        // `CREATE … IF NOT EXISTS` that would have to upgrade a read lock another writer
        // waits on: the tables are made in a transaction that takes the write lock first (so
        // the busy handler waits for it).
        let conn = boxery_store::connect_sqlite(&path, BUSY_TIMEOUT)
            .map_err(|e| std::io::Error::other(format!("the usage ledger: {e}")))?;
        conn.execute_batch(&format!("BEGIN IMMEDIATE;{SCHEMA}COMMIT;"))
            .map_err(sql)?;
        Ok(Ledger {
            conn: Mutex::new(conn),
        })
    }

    /// Open the ledger of `home` to read it, `None` when there is none yet.
    pub fn open_existing(home: &Path) -> std::io::Result<Option<Ledger>> {
        if !layout::usage_db(home).exists() {
            return Ok(None);
        }
        Self::open(home).map(Some)
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Add LLM use (summed into the rows of the same key), in one transaction.
    pub fn add_llm(&self, rows: &[LlmUse]) -> std::io::Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(sql)?;
        {
            let mut st = tx
                .prepare_cached(
                    "INSERT INTO llm (hour, vm, owner, grant_uid, grant_name, provider, model, requests, input, output)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
                     ON CONFLICT (hour, vm, owner, grant_uid, provider, model) DO UPDATE SET
                       requests = requests + excluded.requests, input = input + excluded.input,
                       output = output + excluded.output, grant_name = excluded.grant_name",
                )
                .map_err(sql)?;
            for r in rows {
                st.execute(params![
                    r.hour,
                    r.vm,
                    r.owner,
                    r.grant_uid,
                    r.grant,
                    r.provider,
                    r.model,
                    r.requests as i64,
                    r.input as i64,
                    r.output as i64
                ])
                .map_err(sql)?;
            }
        }
        tx.commit().map_err(sql)
    }

    /// Add compute use, in one transaction.
    pub fn add_compute(&self, rows: &[ComputeUse]) -> std::io::Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(sql)?;
        {
            let mut st = tx
                .prepare_cached(
                    "INSERT INTO compute (hour, vm, owner, vcpu_seconds, gib_seconds, cpu_seconds)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                     ON CONFLICT (hour, vm, owner) DO UPDATE SET
                       vcpu_seconds = vcpu_seconds + excluded.vcpu_seconds,
                       gib_seconds = gib_seconds + excluded.gib_seconds,
                       cpu_seconds = cpu_seconds + excluded.cpu_seconds",
                )
                .map_err(sql)?;
            for r in rows {
                st.execute(params![
                    r.hour,
                    r.vm,
                    r.owner,
                    r.vcpu_seconds,
                    r.gib_seconds,
                    r.cpu_seconds
                ])
                .map_err(sql)?;
            }
        }
        tx.commit().map_err(sql)
    }

    /// Record what owner uids are (replacing what was known of them).
    pub fn note_owners(&self, owners: &[Owner]) -> std::io::Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(sql)?;
        {
            let mut st = tx
                .prepare_cached(
                    "INSERT INTO owners (uid, kind, name, holder, pool) VALUES (?1, ?2, ?3, ?4, ?5)
                     ON CONFLICT (uid) DO UPDATE SET kind = excluded.kind, name = excluded.name,
                       holder = excluded.holder, pool = excluded.pool",
                )
                .map_err(sql)?;
            for o in owners {
                st.execute(params![o.uid, o.kind, o.name, o.holder, o.pool])
                    .map_err(sql)?;
            }
        }
        tx.commit().map_err(sql)
    }

    /// A grant's use from hour `since` on.
    pub fn grant_use(&self, grant_uid: &str, since: i64) -> std::io::Result<GrantUse> {
        let conn = self.conn();
        let mut st = conn
            .prepare_cached(
                "SELECT model, SUM(requests), SUM(input), SUM(output) FROM llm
                 WHERE grant_uid = ?1 AND hour >= ?2 GROUP BY model",
            )
            .map_err(sql)?;
        let mut out = GrantUse::default();
        let rows = st
            .query_map(params![grant_uid, since], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, i64>(3)?,
                ))
            })
            .map_err(sql)?;
        for row in rows {
            let (model, requests, input, output) = row.map_err(sql)?;
            out.requests += requests.max(0) as u64;
            out.by_model
                .push((model, input.max(0) as u64, output.max(0) as u64));
        }
        Ok(out)
    }

    /// The sums of `scope` from hour `since` on.
    pub fn totals(&self, scope: &Scope, since: i64) -> std::io::Result<Totals> {
        let (filter, key) = match scope {
            Scope::Owner(uid) => ("owner = ?1", uid),
            Scope::Vm(vm) => ("vm = ?1", vm),
            Scope::Pool(pool) => (
                "owner IN (SELECT uid FROM owners WHERE kind = 'Lease' AND pool = ?1)",
                pool,
            ),
        };
        let conn = self.conn();
        let mut out = Totals::default();
        let mut st = conn
            .prepare_cached(&format!(
                "SELECT COALESCE(SUM(vcpu_seconds), 0), COALESCE(SUM(gib_seconds), 0),
                   COALESCE(SUM(cpu_seconds), 0) FROM compute WHERE {filter} AND hour >= ?2"
            ))
            .map_err(sql)?;
        (out.vcpu_seconds, out.gib_seconds, out.cpu_seconds) = st
            .query_row(params![key, since], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .map_err(sql)?;
        let mut st = conn
            .prepare_cached(&format!(
                "SELECT provider, SUM(requests), SUM(input), SUM(output) FROM llm
                 WHERE {filter} AND hour >= ?2 GROUP BY provider ORDER BY provider"
            ))
            .map_err(sql)?;
        let rows = st
            .query_map(params![key, since], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, i64>(1)?.max(0) as u64,
                    r.get::<_, i64>(2)?.max(0) as u64,
                    r.get::<_, i64>(3)?.max(0) as u64,
                ))
            })
            .map_err(sql)?;
        for row in rows {
            out.llm.push(row.map_err(sql)?);
        }
        Ok(out)
    }

    /// What an owner uid was, if known.
    pub fn owner(&self, uid: &str) -> std::io::Result<Option<Owner>> {
        self.conn()
            .query_row(
                "SELECT uid, kind, name, holder, pool FROM owners WHERE uid = ?1",
                params![uid],
                |r| {
                    Ok(Owner {
                        uid: r.get(0)?,
                        kind: r.get(1)?,
                        name: r.get(2)?,
                        holder: r.get(3)?,
                        pool: r.get(4)?,
                    })
                },
            )
            .optional()
            .map_err(sql)
    }

    /// The use from hour `since` on, grouped `by`, sorted by group.
    pub fn report(&self, by: By, since: i64) -> std::io::Result<Vec<Line>> {
        // The group of a row: its VM, its owner as a lease (or `-`), the lease's holder or
        // pool, or its grant.
        let group = |table: &str| match by {
            By::Vm => format!("{table}.vm"),
            By::Lease => "COALESCE(CASE WHEN o.kind = 'Lease' THEN o.name END, '-')".into(),
            By::Holder => "COALESCE(NULLIF(o.holder, ''), '-')".into(),
            By::Pool => "COALESCE(NULLIF(o.pool, ''), '-')".into(),
            By::Grant => format!("{table}.grant_name"),
        };
        let conn = self.conn();
        let mut lines: std::collections::BTreeMap<String, Line> = Default::default();
        let llm = format!(
            "SELECT {g}, model, SUM(requests), SUM(input), SUM(output) FROM llm
             LEFT JOIN owners o ON o.uid = llm.owner
             WHERE hour >= ?1 GROUP BY 1, 2",
            g = group("llm")
        );
        let mut st = conn.prepare(&llm).map_err(sql)?;
        let rows = st
            .query_map(params![since], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, i64>(4)?,
                ))
            })
            .map_err(sql)?;
        for row in rows {
            let (name, model, requests, input, output) = row.map_err(sql)?;
            let l = lines.entry(name.clone()).or_insert_with(|| Line {
                name,
                ..Line::default()
            });
            let (input, output) = (input.max(0) as u64, output.max(0) as u64);
            l.requests += requests.max(0) as u64;
            l.input_tokens += input;
            l.output_tokens += output;
            l.by_model.push((model, input, output));
        }
        if by != By::Grant {
            let compute = format!(
                "SELECT {g}, SUM(vcpu_seconds), SUM(gib_seconds), SUM(cpu_seconds) FROM compute
                 LEFT JOIN owners o ON o.uid = compute.owner
                 WHERE hour >= ?1 GROUP BY 1",
                g = group("compute")
            );
            let mut st = conn.prepare(&compute).map_err(sql)?;
            let rows = st
                .query_map(params![since], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, f64>(1)?,
                        r.get::<_, f64>(2)?,
                        r.get::<_, f64>(3)?,
                    ))
                })
                .map_err(sql)?;
            for row in rows {
                let (name, vcpu, gib, cpu) = row.map_err(sql)?;
                let l = lines.entry(name.clone()).or_insert_with(|| Line {
                    name,
                    ..Line::default()
                });
                l.vcpu_hours += vcpu / HOUR as f64;
                l.gib_hours += gib / HOUR as f64;
                l.cpu_seconds += cpu;
            }
        }
        Ok(lines.into_values().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llm(vm: &str, owner: &str, grant: &str, model: &str, i: u64, o: u64) -> LlmUse {
        LlmUse {
            hour: this_hour(),
            vm: vm.into(),
            owner: owner.into(),
            grant_uid: format!("uid-{grant}"),
            grant: grant.into(),
            provider: "anthropic".into(),
            model: model.into(),
            requests: 1,
            input: i,
            output: o,
        }
    }

    /// `serve`'s sampler and its credential proxy open a new ledger at the same moment: a
    /// plain open lost that race about one time in five ("database is locked"), and the
    /// loser recorded nothing for the life of the process (CI: a lease's budget never ran
    /// out).
    #[test]
    fn many_opening_a_new_ledger_at_once_all_open_it() {
        for _ in 0..50 {
            let home = tempfile::tempdir().unwrap();
            let start = std::sync::Arc::new(std::sync::Barrier::new(6));
            let opened: Vec<_> = (0..6)
                .map(|_| {
                    let (start, home) = (start.clone(), home.path().to_path_buf());
                    std::thread::spawn(move || {
                        start.wait();
                        Ledger::open(&home).map(|l| l.totals(&Scope::Vm("a".into()), 0))
                    })
                })
                .collect();
            for o in opened {
                let t = o.join().unwrap().unwrap().unwrap();
                assert_eq!(t, Totals::default());
            }
        }
    }

    #[test]
    fn sums_by_vm_lease_holder_and_grant_and_keeps_them_across_opens() {
        let home = tempfile::tempdir().unwrap();
        let l = Ledger::open(home.path()).unwrap();
        l.add_llm(&[
            llm("a", "vm-a", "g1", "m1", 10, 5),
            llm("a", "vm-a", "g1", "m1", 1, 2),
            llm("b", "lease-x", "g2", "m2", 100, 50),
        ])
        .unwrap();
        l.add_compute(&[ComputeUse {
            hour: this_hour(),
            vm: "b".into(),
            owner: "lease-x".into(),
            vcpu_seconds: 7200.0,
            gib_seconds: 3600.0,
            cpu_seconds: 12.5,
        }])
        .unwrap();
        l.note_owners(&[Owner {
            uid: "lease-x".into(),
            kind: "Lease".into(),
            name: "x".into(),
            holder: "agent-7".into(),
            pool: "p".into(),
        }])
        .unwrap();
        drop(l);
        let l = Ledger::open_existing(home.path()).unwrap().unwrap();
        let by_vm = l.report(By::Vm, this_hour() - 24).unwrap();
        assert_eq!(by_vm.len(), 2);
        assert_eq!(
            (
                by_vm[0].name.as_str(),
                by_vm[0].requests,
                by_vm[0].input_tokens,
                by_vm[0].output_tokens
            ),
            ("a", 2, 11, 7)
        );
        assert_eq!(by_vm[1].vcpu_hours, 2.0);
        assert_eq!(by_vm[1].cpu_seconds, 12.5);
        let by_holder = l.report(By::Holder, this_hour() - 24).unwrap();
        let names: Vec<&str> = by_holder.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["-", "agent-7"]);
        let by_lease = l.report(By::Lease, this_hour() - 24).unwrap();
        assert_eq!(by_lease[1].name, "x");
        assert_eq!(by_lease[1].input_tokens, 100);
        let t = l.totals(&Scope::Owner("lease-x".into()), 0).unwrap();
        assert_eq!((t.vcpu_seconds, t.cpu_seconds), (7200.0, 12.5));
        assert_eq!(t.llm, [("anthropic".to_string(), 1, 100, 50)]);
        assert_eq!(l.totals(&Scope::Pool("p".into()), 0).unwrap(), t);
        assert_eq!(
            l.totals(&Scope::Pool("q".into()), 0).unwrap(),
            Totals::default()
        );
        let a = l.totals(&Scope::Vm("a".into()), this_hour()).unwrap();
        assert_eq!((a.vcpu_seconds, a.llm[0].1, a.llm[0].2), (0.0, 2, 11));
        assert!(
            l.totals(&Scope::Vm("a".into()), this_hour() + 1)
                .unwrap()
                .llm
                .is_empty()
        );
        let g = l.grant_use("uid-g1", this_hour()).unwrap();
        assert_eq!((g.requests, g.tokens()), (2, 18));
        assert_eq!(l.grant_use("uid-g1", this_hour() + 1).unwrap().tokens(), 0);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(layout::usage_db(home.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}

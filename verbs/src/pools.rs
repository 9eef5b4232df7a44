//! `boxery pool …` and `boxery lease …`: sugar over Pool and Lease specs.

use std::time::Duration;

use boxery_api::lease::{LeasePhase, LeaseSpec};
use boxery_api::meta::LocalObjectReference;
use boxery_api::pool::{MemberState, PoolSpec};
use boxery_api::{Lease, Name, Pool};
use boxery_backends::confined;
use boxery_store::{Store, StoreError};

use crate::env::Env;
use crate::exit::{CliError, CliResult, Code};
use crate::wait::{self, Until};

/// `pool` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum PoolCmd {
    /// Add an existing VM to a pool (made if missing): it turns from a pet into a pool VM.
    Add {
        /// The pool.
        #[arg(value_parser = crate::args::label)]
        pool: String,
        /// The VM.
        #[arg(value_parser = crate::args::label)]
        vm: String,
    },
    /// Take a VM out of a pool (refused while it is leased).
    Rm {
        /// The pool.
        #[arg(value_parser = crate::args::label)]
        pool: String,
        /// The VM.
        #[arg(value_parser = crate::args::label)]
        vm: String,
    },
    /// List pools and their members.
    Ls,
}

/// `lease` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum LeaseCmd {
    /// Lease a free VM of a pool: makes a key pair here (the private key never leaves this
    /// host), writes a Lease, and (with --wait) prints the VM and how to reach it.
    Acquire {
        /// The pool.
        #[arg(value_parser = crate::args::label)]
        pool: String,
        /// How long until it expires unless renewed (60s..8h).
        #[arg(long, default_value = "30m", value_parser = ttl_arg)]
        ttl: Duration,
        /// Who holds it (default: $USER@hostname).
        #[arg(long)]
        holder: Option<String>,
        /// The lease's name (default: generated).
        #[arg(long, value_parser = crate::args::label)]
        name: Option<String>,
        /// Wait until bound.
        #[arg(long)]
        wait: bool,
        /// How long --wait waits.
        #[arg(long, default_value = "5m", value_parser = crate::wait::timeout_arg)]
        timeout: Duration,
    },
    /// Renew a lease (refused once it expired, or for someone else's lease).
    Renew {
        /// The lease.
        #[arg(value_parser = crate::args::label)]
        name: String,
        /// Your holder name (must match the lease's).
        #[arg(long)]
        holder: Option<String>,
    },
    /// Release a lease: the VM is reset to its clean image and goes back to the pool.
    Release {
        /// The lease.
        #[arg(value_parser = crate::args::label)]
        name: String,
        /// Wait until the lease is gone.
        #[arg(long)]
        wait: bool,
    },
    /// List leases.
    Ls,
}

/// `lease acquire --ttl`: what a Lease's `leaseDurationSeconds` allows, 60 s to 8 h.
fn ttl_arg(s: &str) -> Result<Duration, String> {
    crate::wait::duration_in(s, Duration::from_secs(60), Duration::from_secs(8 * 3600))
}

/// The default holder name: `$USER@hostname`.
pub fn default_holder() -> String {
    let user = std::env::var("USER").unwrap_or_else(|_| "someone".into());
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    format!("{user}@{host}")
}

fn edit_pool(
    store: &Store,
    name: &str,
    create: bool,
    f: impl Fn(&mut Pool) -> CliResult,
) -> CliResult {
    for _ in 0..10 {
        let (mut pool, exists) = match store.get_as::<Pool>(name)? {
            Some(p) => (p, true),
            None if create => (
                Pool::new(
                    name,
                    PoolSpec {
                        template: None,
                        replicas: 0,
                        members: vec![],
                        lease: Default::default(),
                        update_strategy: Default::default(),
                    },
                ),
                false,
            ),
            None => {
                return Err(CliError::not_found(format!(
                    "pool {name} not found: `boxery pool ls` lists pools"
                )));
            }
        };
        f(&mut pool)?;
        let r = if exists {
            store.update_as(&pool).map(|_| ())
        } else {
            store.create_as(&pool).map(|_| ())
        };
        match r {
            Ok(()) => return Ok(()),
            Err(StoreError::Conflict { .. }) | Err(StoreError::AlreadyExists { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(crate::commands::conflict(format!(
        "pool {name} kept changing: try again"
    )))
}

/// `pool …`.
pub fn pool(env: &Env, cmd: PoolCmd) -> CliResult {
    let store = env.store()?;
    match cmd {
        PoolCmd::Add { pool, vm } => {
            let Some(v) = store.get_as::<boxery_api::Vm>(&vm)? else {
                return Err(CliError::not_found(format!(
                    "VM {vm} not found: `boxery get vms` lists them"
                )));
            };
            // A VM is in one pool at a time: two pools would lease it to two holders.
            let label = boxery_reconcilers::pool::POOL_LABEL;
            let elsewhere = v
                .metadata
                .labels
                .get(label)
                .filter(|p| **p != pool)
                .cloned()
                .or_else(|| {
                    store
                        .list_as::<Pool>(&Default::default())
                        .ok()?
                        .into_iter()
                        .find(|p| {
                            p.metadata.name != pool
                                && boxery_reconcilers::pool::wanted(p)
                                    .iter()
                                    .any(|(n, _)| *n == vm)
                        })
                        .map(|p| p.metadata.name)
                });
            if let Some(other) = elsewhere {
                return Err(CliError::new(
                    Code::Conflict,
                    anyhow::anyhow!(
                        "VM {vm} belongs to pool {other}: a VM is in one pool at a time (`boxery pool rm {other} {vm}` first)"
                    ),
                ));
            }
            edit_pool(&store, &pool, true, |p| {
                if !p.spec.members.iter().any(|m| m.name == vm) {
                    p.spec
                        .members
                        .push(LocalObjectReference { name: vm.clone() });
                }
                Ok(())
            })?;
            println!("pool/{pool}: {vm} added (its clean image is captured once it is Ready)");
        }
        PoolCmd::Rm { pool, vm } => {
            edit_pool(&store, &pool, false, |p| {
                if let Some(m) = p.status.members.iter().find(|m| m.name == vm)
                    && matches!(m.state, MemberState::Acquiring | MemberState::Leased)
                {
                    return Err(CliError::new(
                        Code::Conflict,
                        anyhow::anyhow!(
                            "{vm} is leased by {}: it leaves the pool only when free (`boxery lease release {}`)",
                            m.lease.clone().unwrap_or_default(),
                            m.lease.clone().unwrap_or_default()
                        ),
                    ));
                }
                if !p.spec.members.iter().any(|m| m.name == vm) {
                    return Err(CliError::not_found(format!(
                        "{vm} is not an adopted member of pool {pool} (members made from the template go with `replicas`)"
                    )));
                }
                p.spec.members.retain(|m| m.name != vm);
                Ok(())
            })?;
            println!("pool/{pool}: {vm} removed");
        }
        PoolCmd::Ls => {
            let pools = store.list_as::<Pool>(&Default::default())?;
            if pools.is_empty() {
                eprintln!("No pools found.");
            }
            for p in pools {
                let s = &p.status;
                let safe = crate::output::safe;
                println!(
                    "{}: {} members, {} free, {} leased, {} resetting, {} broken",
                    safe(&p.metadata.name),
                    s.replicas,
                    s.free,
                    s.leased,
                    s.resetting,
                    s.broken
                );
                for m in &s.members {
                    let lease = m
                        .lease
                        .as_deref()
                        .map(|l| format!(" lease={}", safe(l)))
                        .unwrap_or_default();
                    let msg = if m.message.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", safe(&m.message))
                    };
                    println!(
                        "  {:<24} {:<10}{lease}{msg}",
                        safe(&m.name),
                        format!("{:?}", m.state)
                    );
                }
            }
        }
    }
    Ok(())
}

/// The directory holding the key pairs of the leases this host holds.
fn leases_root(env: &Env) -> std::path::PathBuf {
    env.home.join("leases")
}

/// Where a lease's key pair lives on this host.
pub fn lease_dir(env: &Env, lease: &Name) -> std::path::PathBuf {
    confined::child(&leases_root(env), lease)
}

/// Remove the key pair made here for a lease (never anything outside
/// `$BOXERY_HOME/leases`).
pub fn forget_key(env: &Env, lease: &Name) {
    let root = leases_root(env);
    if let Err(e) = confined::remove_within(&root, &lease_dir(env, lease)) {
        tracing::warn!(lease = %lease, error = %e, "cannot remove the lease's key pair");
    }
}

/// The private key of a lease this host holds on `vm`, if any.
pub fn held_key(env: &Env, store: &Store, vm: &str) -> Option<std::path::PathBuf> {
    let leases = store.list_as::<Lease>(&Default::default()).ok()?;
    leases
        .iter()
        .filter(|l| l.status.phase == LeasePhase::Bound && l.status.vm.as_deref() == Some(vm))
        .find_map(|l| {
            let name = Name::label(&l.metadata.name).ok()?;
            let k = lease_dir(env, &name).join("id_ed25519");
            k.exists().then_some(k)
        })
}

/// A lease written by [`acquire`] (not yet bound: wait for `status.phase` Bound).
#[derive(Debug, Clone)]
pub struct Acquired {
    /// The lease's name.
    pub name: String,
    /// Who holds it.
    pub holder: String,
    /// The private key made for it on this host (`$BOXERY_HOME/leases/NAME/id_ed25519`).
    pub key: std::path::PathBuf,
}

/// `lease acquire`: make an ed25519 key pair on this host (the private key never leaves it)
/// and write a Lease on `pool` with its public half. Returns at once; the lease binds when
/// the lease controller finds a free member.
pub fn acquire(
    env: &Env,
    store: &Store,
    pool: &Name,
    ttl: Duration,
    holder: Option<String>,
    name: Option<Name>,
) -> CliResult<Acquired> {
    // Everything is checked before anything is made.
    let secs = ttl.as_secs();
    if !(60..=28800).contains(&secs) {
        return Err(CliError::invalid(format!(
            "the lease duration {} is out of range: use 60s to 8h",
            humantime::format_duration(ttl)
        )));
    }
    let pool = Name::label(pool).map_err(|e| CliError::invalid(format!("pool: {e}")))?;
    let holder = holder.unwrap_or_else(default_holder);
    boxery_api::name::check_text(&holder, 128)
        .map_err(|e| CliError::invalid(format!("holder: {e}")))?;
    let name = match name {
        Some(n) => Name::label(&n).map_err(|e| CliError::invalid(format!("lease name: {e}")))?,
        None => {
            let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
            // A pool name near the limit leaves no room for the suffix: cut it.
            let stem: String = pool.chars().take(63 - 9).collect();
            Name::label(&format!("{}-{suffix}", stem.trim_end_matches('-')))
                .map_err(|e| CliError::invalid(format!("lease name: {e}")))?
        }
    };
    if store.get_as::<Lease>(&name)?.is_some() {
        return Err(StoreError::AlreadyExists {
            kind: "Lease".into(),
            name: name.to_string(),
        }
        .into());
    }
    let dir = lease_dir(env, &name);
    // A key pair left by an acquire that died before writing its Lease is stale.
    forget_key(env, &name);
    std::fs::create_dir_all(leases_root(env))?;
    std::fs::create_dir(&dir)?;
    let key = dir.join("id_ed25519");
    let out = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C"])
        .arg(format!("boxery-lease-{name}"))
        .arg("-f")
        .arg(&key)
        .output()
        .map_err(|e| CliError::failed(format!("cannot run ssh-keygen: {e}")))?;
    if !out.status.success() {
        return Err(CliError::failed(format!(
            "ssh-keygen failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let public = std::fs::read_to_string(dir.join("id_ed25519.pub"))?
        .trim()
        .to_string();
    let spec = LeaseSpec {
        pool: pool.to_string(),
        holder_identity: holder.clone(),
        lease_duration_seconds: secs as u32,
        renew_time: None,
        public_key: public,
    };
    if let Err(e) = store.create_as(&Lease::new(&name, spec)) {
        if !matches!(e, StoreError::AlreadyExists { .. }) {
            forget_key(env, &name);
        }
        return Err(e.into());
    }
    Ok(Acquired {
        name: name.into_string(),
        holder,
        key,
    })
}

/// `lease renew`: refused for someone else's lease (`holder`, default `$USER@hostname`) and
/// for one that expired.
pub fn renew(store: &Store, name: &str, holder: Option<String>) -> CliResult<Lease> {
    let l: Lease = store
        .get_as(name)?
        .ok_or_else(|| CliError::not_found(format!("lease {name} not found: `boxery lease ls`")))?;
    let me = holder.unwrap_or_else(default_holder);
    if l.spec.holder_identity != me {
        return Err(CliError::new(
            Code::Conflict,
            anyhow::anyhow!(
                "lease {name} is held by {}, not {me}: only its holder renews it",
                l.spec.holder_identity
            ),
        ));
    }
    if matches!(l.status.phase, LeasePhase::Expired | LeasePhase::Released) {
        return Err(CliError::new(
            Code::Conflict,
            anyhow::anyhow!(
                "lease {name} has expired and cannot be renewed: release it and acquire a new one"
            ),
        ));
    }
    Ok(boxery_reconcilers::lease::renew(store, name)?)
}

/// `lease release`: delete the Lease (its VM is reset and goes back to the pool) and the key
/// pair made for it here.
pub fn release(env: &Env, store: &Store, name: &Name) -> CliResult {
    match store.delete("Lease", name) {
        Ok(_) => {
            forget_key(env, name);
            Ok(())
        }
        Err(StoreError::NotFound { .. }) => Err(CliError::not_found(format!(
            "lease {name} not found: `boxery lease ls` lists leases"
        ))),
        Err(e) => Err(e.into()),
    }
}

/// `lease …`.
pub async fn lease(env: &Env, cmd: LeaseCmd) -> CliResult {
    let store = env.store()?;
    match cmd {
        LeaseCmd::Acquire {
            pool,
            ttl,
            holder,
            name,
            wait: w,
            timeout,
        } => {
            let pool = Name::label(&pool).map_err(|e| CliError::invalid(e.0))?;
            let name = name
                .map(|n| Name::label(&n))
                .transpose()
                .map_err(|e| CliError::invalid(e.0))?;
            let a = acquire(env, &store, &pool, ttl, holder, name)?;
            let (name, key) = (a.name, a.key);
            println!("lease/{name} created");
            if w {
                wait::wait_all(
                    env,
                    &[("Lease".into(), name.clone())],
                    &Until::JsonPath("{.status.phase}".into(), "Bound".into()),
                    timeout,
                    true,
                )
                .await?;
                let l: Lease = store.get_as(&name)?.expect("just bound");
                let vm = l.status.vm.unwrap_or_default();
                println!(
                    "lease/{name} bound: {vm} until {}",
                    l.status
                        .expire_time
                        .map(|t| t.to_string())
                        .unwrap_or_default()
                );
                println!(
                    "  boxery ssh {vm}        (uses this lease's key: {})",
                    key.display()
                );
                println!("  boxery lease renew {name}; boxery lease release {name}");
            }
        }
        LeaseCmd::Renew { name, holder } => {
            renew(&store, &name, holder)?;
            println!("lease/{name} renewed");
        }
        LeaseCmd::Release { name, wait: w } => {
            let lease = Name::label(&name).map_err(|e| CliError::invalid(e.0))?;
            release(env, &store, &lease)?;
            println!("lease/{name} released");
            if w {
                wait::wait_all(
                    env,
                    &[("Lease".into(), name.clone())],
                    &Until::Deleted,
                    Duration::from_secs(300),
                    true,
                )
                .await?;
            }
        }
        LeaseCmd::Ls => {
            let info = boxery_api::lookup_kind("lease").expect("a kind");
            let (objs, _) = store.list("Lease", &Default::default())?;
            crate::output::print(
                info,
                &objs,
                &crate::output::Format::Table,
                &mut std::io::stdout().lock(),
            )?;
        }
    }
    Ok(())
}

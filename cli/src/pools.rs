//! `boxery pool …` and `boxery lease …`: the pool and lease verbs (`boxery_verbs::pools`),
//! rendered.

use crate::out::outln;
use std::time::Duration;

use boxery_api::{Lease, Name, Pool};
use boxery_verbs::ObjectRef;
use boxery_verbs::Verbs;
use boxery_verbs::pools::{self, AcquireInput};
use boxery_verbs::wait::Until;

use crate::exit::{CliError, CliResult};
use crate::wait;

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
        /// How long until it expires unless renewed (60s..8h; default: the pool's
        /// spec.lease.defaultTtlSeconds, 30m unless the pool sets it).
        #[arg(long, value_parser = ttl_arg)]
        ttl: Option<Duration>,
        /// Who holds it (default: $USER@hostname).
        #[arg(long)]
        holder: Option<String>,
        /// The lease's name (default: generated).
        #[arg(long, value_parser = crate::args::label)]
        name: Option<String>,
        /// Its budget of vCPU-hours (vCPUs × hours running): past it, its VM is suspended. It
        /// can lower the pool's spec.lease.budget, not raise it.
        #[arg(long, value_parser = vcpu_hours_arg)]
        vcpu_hours: Option<f64>,
        /// Its budget of LLM tokens through the proxy (input and output): past it, its VM is
        /// suspended. It can lower the pool's spec.lease.budget, not raise it.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        tokens: Option<u64>,
        /// Wait until bound.
        #[arg(long)]
        wait: bool,
        /// How long --wait waits.
        #[arg(long, default_value = "5m", value_parser = boxery_verbs::wait::timeout_arg)]
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
    boxery_verbs::wait::duration_in(s, Duration::from_secs(60), Duration::from_secs(8 * 3600))
}

/// `pool …`.
pub async fn pool(v: &Verbs, cmd: PoolCmd) -> CliResult {
    match cmd {
        PoolCmd::Add { pool, vm } => {
            pools::add(v, &pool, &vm).await?;
            outln!("pool/{pool}: {vm} added (its clean image is captured once it is Ready)");
        }
        PoolCmd::Rm { pool, vm } => {
            pools::remove(v, &pool, &vm).await?;
            outln!("pool/{pool}: {vm} removed");
        }
        PoolCmd::Ls => {
            let pools = v.list_as::<Pool>(&Default::default()).await?;
            if pools.is_empty() {
                eprintln!("No pools found.");
            }
            for p in pools {
                let s = &p.status;
                let safe = boxery_verbs::render::safe;
                outln!(
                    "{}: {} members, {} free, {} leased, {} resetting, {} broken{}",
                    safe(&p.metadata.name),
                    s.replicas,
                    s.free,
                    s.leased,
                    s.resetting,
                    s.broken,
                    if s.removing > 0 {
                        format!(", {} leaving", s.removing)
                    } else {
                        String::new()
                    }
                );
                let members = pools::members(v, &p).await?;
                for m in &members {
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
                    outln!(
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

/// `lease …`.
pub async fn lease(v: &Verbs, cmd: LeaseCmd) -> CliResult {
    match cmd {
        LeaseCmd::Acquire {
            pool,
            ttl,
            holder,
            name,
            vcpu_hours,
            tokens,
            wait: w,
            timeout,
        } => {
            let pool = Name::label(&pool).map_err(|e| CliError::invalid(e.0))?;
            let name = name
                .map(|n| Name::label(&n))
                .transpose()
                .map_err(|e| CliError::invalid(e.0))?;
            let budget = (vcpu_hours.is_some() || tokens.is_some())
                .then_some(boxery_api::usage::LeaseBudget { vcpu_hours, tokens });
            let input = AcquireInput {
                pool,
                ttl,
                holder,
                name,
                budget,
            };
            let a = pools::acquire(v, input).await?;
            let (name, key) = (a.name, a.key);
            outln!("lease/{name} created");
            if w {
                wait::quiet(
                    v,
                    &[ObjectRef::new("Lease", name.clone())],
                    &Until::JsonPath("{.status.phase}".into(), "Bound".into()),
                    timeout,
                )
                .await?;
                let l: Lease = v.get_as(&name).await?.expect("just bound");
                let vm = l.status.vm.unwrap_or_default();
                outln!(
                    "lease/{name} bound: {vm} until {}",
                    l.status
                        .expire_time
                        .map(|t| t.to_string())
                        .unwrap_or_default()
                );
                outln!(
                    "  boxery ssh {vm}        (uses this lease's key: {})",
                    key.display()
                );
                outln!("  boxery lease renew {name}; boxery lease release {name}");
            }
        }
        LeaseCmd::Renew { name, holder } => {
            pools::renew(v, &name, holder).await?;
            outln!("lease/{name} renewed");
        }
        LeaseCmd::Release { name, wait: w } => {
            let lease = Name::label(&name).map_err(|e| CliError::invalid(e.0))?;
            pools::release(v, &lease).await?;
            outln!("lease/{name} released");
            if w {
                wait::quiet(
                    v,
                    &[ObjectRef::new("Lease", name.clone())],
                    &Until::Deleted,
                    Duration::from_secs(300),
                )
                .await?;
            }
        }
        LeaseCmd::Ls => crate::commands::ls(v, "lease", None).await?,
    }
    Ok(())
}

/// A number of vCPU-hours (`--vcpu-hours`): finite, from 0 to 1e9.
fn vcpu_hours_arg(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(h) if h.is_finite() && (0.0..=1e9).contains(&h) => Ok(h),
        _ => Err(format!(
            "`{s}` is not a number of hours from 0 to 1e9 (e.g. 0.5)"
        )),
    }
}

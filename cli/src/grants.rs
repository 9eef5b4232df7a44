//! `boxery grant …`: ask for a grant (`grant VM TYPE:TARGET --from-…`, which then asks you to
//! approve it), approve or deny one, list, revoke. Approval is a person's: it reads a typed
//! `yes` from the terminal itself (`/dev/tty`, never stdin, so nothing piped in can answer),
//! unless the owner turned confirmation off in `$BOXERY_HOME/config.yaml`
//! (`grants: {confirm: false}`); with no terminal it exits 2 saying how to approve.

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::time::Duration;

use boxery_api::Grant;
use boxery_api::grant::GrantPhase;
use boxery_verbs::Verbs;
use boxery_verbs::grants;
use boxery_verbs::objects::Deleted;
use boxery_verbs::wait::Until;

use crate::exit::{CliError, CliResult, Code};
use crate::out::outln;
use crate::wait;

/// `boxery grant`: either a subcommand, or the request form `grant [VM] TYPE:TARGET --from-…`.
#[derive(Debug, clap::Args)]
#[command(
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = "Request form: boxery grant VM TYPE:TARGET --from-env NAME|--from-file PATH|--from-command CMD\n  \
                  (or --lease LEASE TYPE:TARGET …). TYPE:TARGET is llm:PROVIDER, http:HOST (with --header NAME),\n  \
                  github:OWNER/REPO, env:NAME, file:PATH, or ssh-agent:all (ssh-agent:SHA256:…,… for some keys; the\n  \
                  agent is this shell's $SSH_AUTH_SOCK unless --from-file SOCKET). The grant is written PendingApproval and you are asked\n  \
                  to approve it, as `boxery grant approve NAME` asks. A VM named like a subcommand (approve, deny,\n  \
                  ls, revoke) is granted with `boxery apply` of a Grant instead."
)]
pub struct GrantArgs {
    #[command(subcommand)]
    cmd: Option<GrantCmd>,
    /// The VM the grant is for (absent with --lease), then what to grant: TYPE:TARGET.
    #[arg(value_name = "VM|TYPE:TARGET")]
    first: Option<String>,
    /// What to grant, when the VM came first: TYPE:TARGET.
    #[arg(value_name = "TYPE:TARGET")]
    second: Option<String>,
    /// Grant it to a lease's VM instead (revoked when the lease ends).
    #[arg(long, value_name = "LEASE", value_parser = crate::args::label)]
    lease: Option<String>,
    /// http grants: the header the proxy adds (e.g. Authorization).
    #[arg(long, value_name = "NAME")]
    header: Option<String>,
    /// The value is this environment variable of the control plane.
    #[arg(long, value_name = "NAME")]
    from_env: Option<String>,
    /// The value is this file's content (an absolute path on the control plane).
    #[arg(long, value_name = "PATH")]
    from_file: Option<String>,
    /// The value is this command's output (words split on spaces; run on the control plane).
    #[arg(long, value_name = "CMD")]
    from_command: Option<String>,
    /// The grant's name (default: VM-TYPE-TARGET).
    #[arg(long, value_parser = crate::args::label)]
    name: Option<String>,
    /// llm grants: at most N input and output tokens a UTC day; past it the proxy answers
    /// 429 until midnight UTC.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    tokens_per_day: Option<u64>,
    /// llm grants: at most N requests in any minute.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=100000))]
    requests_per_minute: Option<u32>,
    /// llm grants: at most this many dollars a UTC month, at the prices under `proxy:
    /// prices:` in config.yaml.
    #[arg(long, value_name = "DOLLARS")]
    dollars_per_month: Option<f64>,
    /// After approving, wait until the grant is in force (Applied), running the controllers
    /// here if no `boxery serve` runs.
    #[arg(long)]
    wait: bool,
}

/// Whether `a` decides a grant (approve or deny): a person's act at the VM host's terminal.
pub fn decides(a: &GrantArgs) -> bool {
    matches!(
        a.cmd,
        Some(GrantCmd::Approve { .. } | GrantCmd::Deny { .. })
    )
}

/// `grant` subcommands.
#[derive(Debug, clap::Subcommand)]
enum GrantCmd {
    /// Approve a grant: shows exactly what is granted to which VM and asks for a typed `yes`
    /// on the terminal (exit 2 with no terminal; exit 1 if you type anything else).
    Approve {
        /// The grant.
        #[arg(value_parser = crate::args::label)]
        name: String,
        /// Wait until it is in force (Applied).
        #[arg(long)]
        wait: bool,
    },
    /// Deny a grant (for its current spec: a changed spec asks again), after a typed `yes`.
    Deny {
        /// The grant.
        #[arg(value_parser = crate::args::label)]
        name: String,
    },
    /// List grants: phase, VM or lease, type, target, age.
    Ls,
    /// Revoke a grant: it is deleted, and out of force before it goes.
    Revoke {
        /// The grant.
        #[arg(value_parser = crate::args::label)]
        name: String,
    },
}

/// `grant …`.
pub async fn grant(v: &Verbs, a: GrantArgs) -> CliResult<ExitCode> {
    match a.cmd {
        Some(GrantCmd::Approve { name, wait }) => decide(v, &name, true, wait).await,
        Some(GrantCmd::Deny { name }) => decide(v, &name, false, false).await,
        Some(GrantCmd::Ls) => {
            crate::commands::ls(v, "grant", Some("No grants found.")).await?;
            Ok(ExitCode::SUCCESS)
        }
        Some(GrantCmd::Revoke { name }) => {
            match grants::revoke(v, &name).await? {
                Deleted::Removed(n) => outln!("grant/{n} revoked"),
                Deleted::Deleting(n) => {
                    outln!("grant/{n} revoked (it leaves the grant state, then goes)")
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        None => request(v, a).await,
    }
}

/// `grant [VM] TYPE:TARGET --from-…`: write the grant, then ask to approve it.
async fn request(v: &Verbs, a: GrantArgs) -> CliResult<ExitCode> {
    let usage = || {
        CliError::invalid(
            "write `boxery grant VM TYPE:TARGET --from-env NAME` (or --lease LEASE TYPE:TARGET …); `boxery grant --help` says more",
        )
    };
    let (vm, what) = match (&a.lease, a.first, a.second) {
        (Some(_), Some(what), None) => (None, what),
        (None, Some(vm), Some(what)) => (
            Some(crate::args::label(&vm).map_err(CliError::invalid)?),
            what,
        ),
        _ => return Err(usage()),
    };
    // An agent is the one this shell uses, unless told: its socket path, as approved.
    let agent = what.starts_with("ssh-agent:");
    let from_file = match a.from_file {
        None if agent && a.from_env.is_none() && a.from_command.is_none() => Some(
            std::env::var("SSH_AUTH_SOCK")
                .ok()
                .filter(|s| !s.is_empty())
                .ok_or_else(|| {
                    CliError::invalid(
                        "SSH_AUTH_SOCK is not set in this shell: start an ssh-agent, or name its socket with --from-file PATH",
                    )
                })?,
        ),
        f => f,
    };
    let asked = grants::Asked {
        what: Some(what),
        vm,
        lease: a.lease,
        header: a.header,
        from_env: a.from_env,
        from_file,
        from_command: (a.from_command).map(|c| c.split_whitespace().map(str::to_string).collect()),
        name: a.name,
        tokens_per_day: a.tokens_per_day,
        requests_per_minute: a.requests_per_minute,
        dollars_per_month: a.dollars_per_month,
    };
    let (g, created) = grants::ask(v, asked).await?;
    let name = g.metadata.name.clone();
    if created {
        outln!("grant/{name} created (PendingApproval)");
    } else if g.status.phase == GrantPhase::Applied
        && g.status.approved_for(g.metadata.generation)
        && g.status.observed_generation == g.metadata.generation
    {
        outln!("grant/{name} is already in force");
        return Ok(ExitCode::SUCCESS);
    }
    decide(v, &name, true, a.wait).await
}

/// Approve (or deny) grant `name` after showing it and reading a typed `yes` from the
/// terminal (unless the owner's config turned confirmation off).
async fn decide(v: &Verbs, name: &str, approve: bool, wait_for: bool) -> CliResult<ExitCode> {
    let g = grants::for_decision(v, name).await?;
    let generation = g.metadata.generation;
    if approve && g.status.approved_for(generation) {
        outln!(
            "grant/{name} is already approved (generation {})",
            generation.unwrap_or_default()
        );
        return finish(v, name, wait_for).await;
    }
    if !approve && g.status.denied_for(generation) {
        outln!("grant/{name} is already denied");
        return Ok(ExitCode::SUCCESS);
    }
    let verb = if approve { "approve" } else { "deny" };
    let by = grants::os_user();
    let how = if grants::confirmation_required(v)? {
        if !confirmed(&g, verb)? {
            eprintln!("grant/{name}: not {verb}d (you did not type yes); nothing changed");
            return Ok(ExitCode::from(Code::Failed as u8));
        }
        "typed yes on a terminal"
    } else {
        eprint!("{}", grants::summary(&g));
        eprintln!("(confirmation is off: grants.confirm is false in $BOXERY_HOME/config.yaml)");
        "confirmation off in config.yaml"
    };
    if approve {
        grants::approve(v, &g, &by, how).await?;
        outln!("grant/{name} approved by {by}");
        finish(v, name, wait_for).await
    } else {
        grants::deny(v, &g, &by, how).await?;
        outln!("grant/{name} denied by {by}");
        Ok(ExitCode::SUCCESS)
    }
}

/// With `--wait`: until the grant is in force. Without: say when nothing will apply it.
async fn finish(v: &Verbs, name: &str, wait_for: bool) -> CliResult<ExitCode> {
    if wait_for {
        boxery_verbs::objects::check_backend(v).await?;
        wait::all(
            v,
            &[grants::object_ref(name)],
            // Ready=True computed for the current generation, not `phase: Applied`, which
            // may still be the status of an older spec (approved before it changed): "in force"
            // only once the controller has applied the generation just approved.
            &Until::Condition(
                boxery_api::conditions::READY.into(),
                boxery_api::ConditionStatus::True,
            ),
            Duration::from_secs(120),
        )
        .await?;
        outln!("grant/{name} is in force");
    } else if let Some(line) = boxery_verbs::control::unreconciled_note(v).await? {
        eprintln!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Show the grant on the terminal and read the answer from it: true only for `yes`.
fn confirmed(g: &Grant, verb: &str) -> CliResult<bool> {
    let name = g.metadata.name.as_str();
    let tty = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/tty")
        .map_err(|e| {
            CliError::invalid(format!(
                "grant {name} needs a person to {verb} it at a terminal, and this command has none (/dev/tty: {e}). \
                 Run `boxery grant {verb} {name}` yourself in a terminal; an agent cannot {verb} a grant"
            ))
        })?;
    let mut w = &tty;
    write!(
        w,
        "{}\nType yes to {verb} grant {} (anything else cancels): ",
        grants::summary(g),
        boxery_verbs::render::safe(name)
    )?;
    w.flush()?;
    let mut line = String::new();
    std::io::BufReader::new(&tty).read_line(&mut line)?;
    Ok(line.trim() == "yes")
}

/// How long `ssh -A` waits for the control plane's agent forward to be up in the guest.
const AGENT_FORWARD_WAIT: u32 = 20;

/// `ssh -A`, a grant in force: wait (up to [`AGENT_FORWARD_WAIT`] s) until the guest's
/// `SSH_AUTH_SOCK` socket is there, or say why it is not.
pub fn agent_forward_up(reach: &boxery_hands::Reach) -> CliResult<()> {
    let sock = boxery_api::grant::AGENT_GUEST_SOCK;
    let line = format!(
        "i=0; while [ ! -S {sock} ]; do i=$((i+1)); [ $i -gt {AGENT_FORWARD_WAIT} ] && exit 3; sleep 1; done"
    );
    match reach.run_line(&line)? {
        0 => Ok(()),
        3 => Err(CliError::new(
            Code::Failed,
            anyhow::anyhow!(
                "the ssh-agent grant on {} is in force, but the control plane's forward is not up in the guest after {AGENT_FORWARD_WAIT} s: \
                 the control plane (`boxery serve`: is it running?) holds it, and the guest's sshd must be \
                 OpenSSH (serve's log says why it failed)",
                reach.vm()
            ),
        )),
        c => Err(CliError::new(
            Code::Failed,
            anyhow::anyhow!(
                "cannot check the ssh-agent forward in {} (ssh exit {c})",
                reach.vm()
            ),
        )),
    }
}

//! `boxery`: VMs as hands for coding agents, declaratively.
//!
//! The binary is the composition root: it parses the command line ([`args`]), gives the verbs
//! their way to run the controllers here (`boxery_daemon::Embedder`) and their notes' sink
//! (stderr), and runs the command ([`dispatch`], reading each command's facts from [`table`]).

#[cfg(test)]
mod architecture;
mod args;
mod audit;
mod changes;
mod commands;
mod completion;
mod contexts;
mod desktop;
mod dispatch;
mod drill;
mod exit;
mod explain;
mod git;
mod grants;
mod guest;
mod incus;
mod kubeconfig;
mod manifests;
mod orphans;
mod out;
#[cfg(test)]
mod parity;
mod pools;
mod service;
mod sync;
mod table;
mod top;
mod usage;
mod vms;
mod wait;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

pub(crate) use crate::args::{Cli, Command, FileCmd, FileRead, FileWrite, JobsCmd};
pub(crate) use crate::out::outln;

/// Log to stderr: errors only for commands, warnings for `serve`, more with `-v`/`BOXERY_LOG`.
fn init_logging(verbose: u8, serve: bool) {
    // Commands report progress themselves; their embedded controllers log only errors unless
    // asked. `serve` is a daemon: its warnings are its report.
    let default = match verbose {
        0 if serve => "warn",
        0 => "error",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("BOXERY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

fn main() -> ExitCode {
    boxery_daemon::malloc::tune();
    boxery_verbs::notes::set_sink(|line| eprintln!("{line}"));
    let cli = Cli::parse();
    init_logging(cli.verbose, matches!(cli.command, Command::Serve { .. }));
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // The store's calls and the hands' blocking work run on this pool: at most 8 threads
        // (their stacks, and before `boxery_daemon::malloc::tune` their malloc arenas, measured in
        // docs/benchmarks.md).
        .max_blocking_threads(8)
        // An idle blocking thread exits after 2 s (tokio's default is 10 s): after a burst, an
        // idle `serve` gives back their stacks and allocator caches (up to 2 MiB at 1,000 Vms).
        .thread_keep_alive(Duration::from_secs(2))
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(dispatch::dispatch(cli)) {
        Ok(code) => code,
        Err(e) if out::is_closed_pipe(&e) => ExitCode::from(exit::Code::PipeClosed as u8),
        Err(e) => {
            eprintln!(
                "error: {}",
                boxery_verbs::render::safe(&format!("{:#}", e.error))
            );
            ExitCode::from(e.code as u8)
        }
    }
}

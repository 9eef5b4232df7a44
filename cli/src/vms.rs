//! The seed's verbs on the command line: `new`, `snap`, `revert`, `fork`, `start`, `stop`,
//! `resize` (`rm` is `delete vm`). Each calls its verb (`boxery_verbs::vm`), says what it
//! wrote, and with `--wait` waits on the verb's plan.

use crate::out::outln;
use std::time::Duration;

use boxery_api::{Quantity, RunStrategy};
use boxery_verbs::Verbs;
use boxery_verbs::vm::{self, NewVm, Size};

use crate::exit::CliResult;
use crate::wait;

/// Size flags shared by `new`, `fork` and `resize`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SizeArgs {
    /// Virtual CPUs (1..64).
    #[arg(long)]
    pub cpus: Option<u32>,
    /// Memory, e.g. 512Mi, 4Gi.
    #[arg(long)]
    pub memory: Option<Quantity>,
    /// Disk size, e.g. 20Gi (disks only grow).
    #[arg(long)]
    pub disk: Option<Quantity>,
}

impl SizeArgs {
    fn size(&self) -> Size {
        Size {
            cpus: self.cpus,
            memory: self.memory,
            disk: self.disk,
        }
    }
}

/// `new NAME [--from IMAGE | --fork VM]`.
pub async fn new(
    v: &Verbs,
    name: &str,
    from: Option<String>,
    fork: Option<String>,
    size: &SizeArgs,
    stopped: bool,
    wait_for: Option<Duration>,
) -> CliResult {
    let input = NewVm {
        name: name.to_string(),
        from,
        fork,
        size: size.size(),
        stopped,
    };
    let plan = vm::new(v, input).await?;
    outln!("vm/{name} created");
    wait::plan(v, &plan, wait_for).await
}

/// `snap VM LABEL [--memory]`.
pub async fn snap(
    v: &Verbs,
    name: &str,
    label: &str,
    memory: bool,
    wait_for: Option<Duration>,
) -> CliResult {
    let (image, plan) = vm::snap(v, name, label, memory).await?;
    outln!("image/{image} created");
    wait::plan(v, &plan, wait_for).await
}

/// `revert VM LABEL [--memory]`.
pub async fn revert(
    v: &Verbs,
    name: &str,
    label: &str,
    memory: bool,
    wait_for: Option<Duration>,
) -> CliResult {
    let (image, plan) = vm::revert(v, name, label, memory).await?;
    outln!("vm/{name} reverting to {image}");
    wait::plan(v, &plan, wait_for).await
}

/// `fork SRC NEW…`.
pub async fn fork(
    v: &Verbs,
    src: &str,
    names: &[String],
    size: &SizeArgs,
    memory: bool,
    wait_for: Option<Duration>,
) -> CliResult {
    let plan = vm::fork(v, src, names, &size.size(), memory).await?;
    let how = if memory { " with its memory" } else { "" };
    for n in names {
        outln!("vm/{n} created (fork of {src}{how})");
    }
    wait::plan(v, &plan, wait_for).await
}

/// `start` / `stop` / `suspend` / `resume`.
pub async fn power(
    v: &Verbs,
    names: &[String],
    run: RunStrategy,
    wait_for: Option<Duration>,
) -> CliResult {
    let plan = vm::power(v, names, run).await?;
    let word = vm::power_word(run);
    for n in names {
        outln!("vm/{n} {word}");
    }
    wait::plan(v, &plan, wait_for).await
}

/// `resize VM`.
pub async fn resize(
    v: &Verbs,
    name: &str,
    size: &SizeArgs,
    wait_for: Option<Duration>,
) -> CliResult {
    let plan = vm::resize(v, name, &size.size()).await?;
    outln!("vm/{name} resizing");
    wait::plan(v, &plan, wait_for).await
}

//! What each command is, in one table: where it runs (this machine only, the store of the
//! selected context, or on this machine whatever the context) and whether it writes and waits.
//! The dispatcher ([`crate::dispatch`]) reads these facts here and nowhere else; the match is
//! exhaustive, so a new command does not build until its row is written.

use crate::args::{Command, WaitArgs};
use crate::grants;

/// Where a command runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runs {
    /// On this machine whatever the context: it reads no store.
    Here,
    /// On the store of the selected context: this home's, or another machine's through its
    /// API.
    OnStore,
    /// On this machine's home only; with a context selected it is refused, saying
    /// `boxery NAME` and why (`why`).
    HomeOnly {
        /// The command as the refusal names it.
        name: &'static str,
        /// What it does that cannot go through a context.
        why: &'static str,
    },
    /// Only through a context (`connect`).
    ContextOnly,
}

/// The facts of one command.
#[derive(Debug, Clone, Copy)]
pub struct Row<'a> {
    /// Where it runs.
    pub runs: Runs,
    /// A write that can wait (`--wait`): its wait arguments, when this invocation writes
    /// (`apply --dry-run` does not).
    pub wait: Option<&'a WaitArgs>,
    /// It deletes (a delete that does not wait needs no "nothing reconciles" note).
    pub deletes: bool,
}

impl<'a> Row<'a> {
    const fn runs(runs: Runs) -> Row<'a> {
        Row {
            runs,
            wait: None,
            deletes: false,
        }
    }
    const fn writes(wait: &'a WaitArgs) -> Row<'a> {
        Row {
            runs: Runs::OnStore,
            wait: Some(wait),
            deletes: false,
        }
    }
}

const fn home_only<'a>(name: &'static str, why: &'static str) -> Row<'a> {
    Row::runs(Runs::HomeOnly { name, why })
}

/// The row of `command`.
pub fn row(command: &Command) -> Row<'_> {
    use Runs::{Here, OnStore};
    match command {
        Command::Backends
        | Command::Images(_)
        | Command::ApiResources
        | Command::Version
        | Command::Completion { .. }
        | Command::Explain { .. }
        | Command::Schema { .. }
        | Command::Exec { .. }
        | Command::Config { .. } => Row::runs(Here),
        Command::Mcp {
            tools_markdown: true,
            ..
        } => Row::runs(Here),
        Command::Serve { .. } => home_only("serve", "runs a control plane on this machine"),
        Command::Kubeconfig(_) => home_only("kubeconfig", "mints the tokens of this home's API"),
        Command::Service { .. } => home_only("service", "installs a unit on this machine"),
        Command::Orphans { .. } => home_only("orphans", "reads the VM host's backends"),
        Command::Usage { .. } => home_only("usage", "reads the VM host's usage ledger"),
        Command::Audit { .. } => home_only("audit", "reads the VM host's audit log"),
        Command::Top { .. } => home_only("top", "reads the VM host's backend"),
        Command::Drill { .. } => home_only("drill", "makes interfaces on the VM host"),
        Command::Incus { .. } => home_only("incus", "runs the VM host's incus client"),
        Command::Grant(a) if grants::decides(a) => home_only(
            "grant approve/deny",
            "is a person's decision at the VM host's terminal (the API refuses it to any token)",
        ),
        Command::Connect { .. } => Row::runs(Runs::ContextOnly),
        Command::Apply { wait, written, .. } => Row {
            wait: (!written.dry().is_dry()).then_some(wait),
            ..Row::runs(OnStore)
        },
        Command::Delete { wait, .. } | Command::Rm { wait, .. } => Row {
            deletes: true,
            ..Row::writes(wait)
        },
        Command::New { wait, .. }
        | Command::Snap { wait, .. }
        | Command::Revert { wait, .. }
        | Command::Fork { wait, .. }
        | Command::Start { wait, .. }
        | Command::Stop { wait, .. }
        | Command::Suspend { wait, .. }
        | Command::Resume { wait, .. }
        | Command::Resize { wait, .. } => Row::writes(wait),
        Command::Get { .. }
        | Command::Describe { .. }
        | Command::Sync(_)
        | Command::Diff { .. }
        | Command::Wait { .. }
        | Command::Events { .. }
        | Command::CompleteNames { .. }
        | Command::Pool(_)
        | Command::Lease(_)
        | Command::Grant(_)
        | Command::Ssh { .. }
        | Command::Forward { .. }
        | Command::Prompt { .. }
        | Command::Attach { .. }
        | Command::Screenshot { .. }
        | Command::Desktop { .. }
        | Command::Browser { .. }
        | Command::Computer { .. }
        | Command::Run { .. }
        | Command::Cp { .. }
        | Command::Mcp { .. }
        | Command::Jobs { .. }
        | Command::File { .. }
        | Command::Read { .. }
        | Command::Write { .. }
        | Command::Edit { .. }
        | Command::Patch { .. }
        | Command::Label { .. }
        | Command::Annotate { .. }
        | Command::Scale { .. } => Row::runs(OnStore),
    }
}

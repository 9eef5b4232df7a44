//! `boxery`: VMs as hands for coding agents, declaratively.

mod args;
mod changes;
mod commands;
mod completion;
mod contexts;
mod drill;
mod exit;
mod explain;
mod git;
mod grants;
mod kubeconfig;
mod manifests;
mod orphans;
mod out;
#[cfg(test)]
mod parity;
mod pools;
mod service;
mod sync;
mod vms;
mod wait;

use crate::out::{out, outln};
use boxery_api::error_chain;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use boxery_api::RunStrategy;
use boxery_hands::{Place, Voice};
use boxery_mcp::server as mcp;
use boxery_verbs::runtime;
use boxery_verbs::wait::timeout_arg;
use boxery_verbs::{Env, Verbs};
use clap::{Parser, Subcommand};
use serde_json::json;

use crate::exit::{CliError, CliResult};

/// boxery gives coding agents VMs as their hands. You write desired state (Vm, Image, Pool,
/// Lease, Grant objects) and boxery's controllers make the world match.
///
/// Exit codes: 0 success; 1 failure (diff: differences found); 2 invalid input; 3 not found;
/// 4 timed out waiting; 5 conflict.
#[derive(Debug, Parser)]
#[command(
    name = "boxery",
    version,
    propagate_version = true,
    max_term_width = 100
)]
struct Cli {
    /// Where boxery keeps its state (the store, backend files). Default: $XDG_DATA_HOME/boxery
    /// or ~/.local/share/boxery.
    #[arg(long, global = true, env = "BOXERY_HOME", value_name = "DIR")]
    home: Option<PathBuf>,
    /// The backend that runs VMs (`fake`, …). Default: `backend:` in $BOXERY_HOME/config.yaml,
    /// else the platform's default.
    #[arg(long, global = true, env = "BOXERY_BACKEND", value_name = "NAME")]
    backend: Option<String>,
    /// Work on the control plane of another machine: a context of `boxery config` (`local`:
    /// this home's own store). Default: the current context, else this home. See docs/api.md.
    #[arg(long, global = true, env = "BOXERY_CONTEXT", value_name = "NAME")]
    context: Option<String>,
    /// Log more (repeat for even more); logs go to stderr.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

/// `get`'s table flags, as kubectl's.
#[derive(Debug, Clone, clap::Args)]
struct TableArgs {
    /// Print the table without its header row.
    #[arg(long)]
    no_headers: bool,
    /// Add a LABELS column with every label.
    #[arg(long)]
    show_labels: bool,
    /// Add a column for each of these label keys (repeat, or KEY1,KEY2).
    #[arg(
        short = 'L',
        long = "label-columns",
        value_delimiter = ',',
        value_name = "KEY"
    )]
    label_columns: Vec<String>,
    /// Sort by the value at this JSONPath (e.g. {.metadata.creationTimestamp}).
    #[arg(long, value_name = "JSONPATH")]
    sort_by: Option<String>,
}

/// Where manifests come from: `-f` and `-k`, as kubectl's.
#[derive(Debug, Clone, clap::Args)]
struct Sources {
    /// A manifest file, a directory (read recursively), or - for stdin. Repeatable.
    #[arg(short = 'f', long = "filename", required_unless_present = "kustomize")]
    files: Vec<String>,
    /// A directory with a kustomization, built by `kubectl kustomize DIR`. Repeatable.
    #[arg(short = 'k', long = "kustomize", value_name = "DIR")]
    kustomize: Vec<String>,
}

/// Field ownership options of `apply` and `diff`, as kubectl's server-side apply.
#[derive(Debug, Clone, clap::Args)]
struct Ownership {
    /// The applier these manifests are applied as: fields it set before and the manifests no
    /// longer name are removed; fields other managers set are left alone.
    #[arg(long, value_name = "NAME", default_value = boxery_store::APPLY_MANAGER)]
    field_manager: String,
    /// Take over fields another manager (boxery-stop, boxery-scale, another applier) set to
    /// other values, instead of refusing the apply with a conflict.
    #[arg(long)]
    force_conflicts: bool,
}

impl Ownership {
    fn options(&self, prune: Option<boxery_api::Selector>) -> boxery_store::ApplyOptions {
        boxery_store::ApplyOptions {
            prune,
            field_manager: Some(self.field_manager.clone()),
            force_conflicts: self.force_conflicts,
            ..Default::default()
        }
    }
}

/// `--wait` and `--timeout`, shared.
#[derive(Debug, Clone, clap::Args)]
struct WaitArgs {
    /// Wait until the objects are ready (or deleted), running the controllers in this process if
    /// no `boxery serve` is running.
    #[arg(long)]
    wait: bool,
    /// How long --wait waits (e.g. 90s, 5m; at most 7days).
    #[arg(long, default_value = "5m", value_parser = timeout_arg)]
    timeout: Duration,
}

impl WaitArgs {
    fn wait_for(&self) -> Option<Duration> {
        self.wait.then_some(self.timeout)
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or update objects from YAML/JSON manifests (files, directories, or - for stdin)
    /// or a kustomization (-k DIR). One apply is all or nothing: a bad document changes
    /// nothing, and every bad document is reported.
    Apply {
        #[command(flatten)]
        sources: Sources,
        #[command(flatten)]
        written: changes::Written,
        #[command(flatten)]
        ownership: Ownership,
        /// Delete objects matching -l that an earlier apply created and this one no longer names.
        #[arg(long, requires = "selector")]
        prune: bool,
        /// Label selector for --prune.
        #[arg(short = 'l', long = "selector")]
        selector: Option<String>,
        /// With --prune: take objects of the same name that exist outside the pruned set
        /// (made by hand, or by an apply outside -l) into it; without it, such an object fails
        /// the apply (exit 5), since a later `apply --prune` would delete what no apply made.
        #[arg(long, requires = "prune")]
        adopt: bool,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// List objects of a kind (vm, vms, image, img, pool, lease, grant, source, event).
    Get {
        /// The kind.
        kind: String,
        /// Names (all when none).
        names: Vec<String>,
        /// Output: wide, yaml, json, name, jsonpath=EXPR, custom-columns=HEADER:JSONPATH,….
        #[arg(short, long, default_value = "")]
        output: String,
        /// Label selector (team=web,tier!=db).
        #[arg(short = 'l', long = "selector")]
        selector: Option<String>,
        /// Keep watching and print changes.
        #[arg(short, long)]
        watch: bool,
        /// With -w: print the changes only, not the objects as they are first.
        #[arg(long, requires = "watch")]
        watch_only: bool,
        #[command(flatten)]
        table: TableArgs,
    },
    /// Show objects in detail: spec, status, conditions, recent events. With no name, every
    /// object of the kind (or those matching -l), as kubectl's.
    Describe {
        /// The kind, or KIND/NAME.
        kind: String,
        /// Names (unless given as KIND/NAME).
        names: Vec<String>,
        /// Describe the objects of the kind matching this label selector.
        #[arg(short = 'l', long = "selector")]
        selector: Option<String>,
    },
    /// Delete objects: by name (`vm dev1`, `vm/dev1`), by label (`vm -l team=web`), every one
    /// of a kind (`vm --all`), or those in manifests (`-f FILE|DIR`, `-k DIR`). Their
    /// controllers clean up first (the VM is removed from the backend).
    Delete {
        /// The kind, or KIND/NAME (none with -f/-k).
        kind: Option<String>,
        /// Names.
        names: Vec<String>,
        /// Delete the objects these manifests name (files, directories, or -).
        #[arg(short = 'f', long = "filename", conflicts_with_all = ["kind", "selector", "all"])]
        files: Vec<String>,
        /// Delete the objects this kustomization builds (`kubectl kustomize DIR`).
        #[arg(short = 'k', long = "kustomize", value_name = "DIR", conflicts_with_all = ["kind", "selector", "all"])]
        kustomize: Vec<String>,
        /// Delete every object of the kind matching this label selector.
        #[arg(short = 'l', long = "selector", conflicts_with = "all")]
        selector: Option<String>,
        /// Delete every object of the kind.
        #[arg(long)]
        all: bool,
        /// An object that does not exist is not an error.
        #[arg(long)]
        ignore_not_found: bool,
        /// Drop boxery's finalizer once the backend confirms the VM or image is gone (for a
        /// delete stuck on a broken backend).
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Apply a directory or git repository of manifests as one set, once or following it
    /// (--watch); what it applied and no longer holds is pruned. `boxery get sources` shows
    /// each source's revision and last error (docs/gitops.md).
    Sync(sync::SyncArgs),
    /// Show what `apply` would change. Exit 0: no difference; 1: differences; 2+: error.
    Diff {
        #[command(flatten)]
        sources: Sources,
        #[command(flatten)]
        ownership: Ownership,
        /// Also show what `apply --prune -l SEL` would delete.
        #[arg(long, requires = "selector")]
        prune: bool,
        /// Label selector for --prune.
        #[arg(short = 'l', long = "selector")]
        selector: Option<String>,
    },
    /// Wait for a condition on objects: named, matching -l, or --all of a kind.
    Wait {
        /// The kind, or KIND/NAME.
        kind: String,
        /// Names (unless given as KIND/NAME).
        names: Vec<String>,
        /// Wait for every object of the kind matching this label selector (as it is now).
        #[arg(short = 'l', long = "selector")]
        selector: Option<String>,
        /// Wait for every object of the kind (as it is now).
        #[arg(long)]
        all: bool,
        /// condition=Ready[=True|False] (any case), delete, jsonpath={.status.phase}=Stopped, or
        /// jsonpath={.status.vm} (the path has a value).
        #[arg(long = "for")]
        until: String,
        /// How long to wait (at most 7days).
        #[arg(long, default_value = "60s", value_parser = timeout_arg)]
        timeout: Duration,
    },
    /// Describe a kind or field from its schema (e.g. vm.spec.resources), as kubectl's.
    Explain {
        /// KIND[.field[.field…]].
        path: String,
        /// Show every field below, at every level (names and types).
        #[arg(long)]
        recursive: bool,
    },
    /// List events, or the events of one object.
    Events {
        /// The kind.
        kind: Option<String>,
        /// The name.
        name: Option<String>,
    },
    /// The backends this build has and what each offers (from their own declarations).
    Backends,
    /// The kinds boxery serves: names, short names, API version and verbs (as kubectl's).
    ApiResources,
    /// This build's version, the store's schema, the backend, and the control plane leading
    /// the store (if any).
    Version,
    /// Print a shell completion script: `source <(boxery completion bash)`. In bash and fish it
    /// completes object names too (`boxery get vm <TAB>`, `describe vm/<TAB>`).
    Completion {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// (For the completion scripts: the names of a kind's objects, one per line.)
    #[command(name = "__complete-names", hide = true)]
    CompleteNames {
        /// The kind.
        kind: String,
    },
    /// (kubectl's `exec`: boxery's is `run VM -- CMD`.)
    #[command(hide = true)]
    Exec {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Print the JSON Schema of a kind (or of all kinds).
    Schema {
        /// The kind.
        kind: Option<String>,
    },
    /// Make a VM (writes a Vm object). Default source: the stock image debian-12.
    New {
        /// The VM's name.
        #[arg(value_parser = args::label)]
        name: String,
        /// Make it from this image.
        #[arg(long, value_name = "IMAGE", value_parser = args::any_name)]
        from: Option<String>,
        /// Make it from another VM's disk as it is now.
        #[arg(long, value_name = "VM", value_parser = args::label)]
        fork: Option<String>,
        #[command(flatten)]
        size: vms::SizeArgs,
        /// Create it stopped.
        #[arg(long)]
        stopped: bool,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Snapshot a VM's disk into the image VM.LABEL (works while it runs).
    Snap {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// The label.
        #[arg(value_parser = args::label)]
        label: String,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Replace a VM's disk with its image VM.LABEL (sets spec.restore).
    Revert {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// The label (or a full image name).
        #[arg(value_parser = args::any_name)]
        label: String,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Make new VMs from a VM's disk as it is now.
    Fork {
        /// The source VM.
        #[arg(value_parser = args::label)]
        src: String,
        /// New VM names.
        #[arg(required = true, value_parser = args::label)]
        names: Vec<String>,
        #[command(flatten)]
        size: vms::SizeArgs,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Start VMs (runStrategy: Running).
    Start {
        /// VM names.
        #[arg(required = true, value_parser = args::label)]
        names: Vec<String>,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Stop VMs (runStrategy: Stopped).
    Stop {
        /// VM names.
        #[arg(required = true, value_parser = args::label)]
        names: Vec<String>,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Change a VM's CPUs, memory or disk.
    Resize {
        /// The VM.
        #[arg(value_parser = args::label)]
        name: String,
        #[command(flatten)]
        size: vms::SizeArgs,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Delete VMs (and the images they own).
    Rm {
        /// VM names.
        #[arg(required = true, value_parser = args::label)]
        names: Vec<String>,
        /// See `delete --force`.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// VMs and images in the backend that no object here owns (after a store was emptied,
    /// replaced or restored from an older backup): list them, adopt them, or delete them.
    /// boxery never deletes them by itself.
    Orphans {
        #[command(subcommand)]
        cmd: Option<orphans::OrphansCmd>,
    },
    /// Pools of VMs that agents lease: add, remove, list members.
    #[command(subcommand)]
    Pool(pools::PoolCmd),
    /// Leases on pool VMs: acquire (makes a key pair here), renew, release, list.
    #[command(subcommand)]
    Lease(pools::LeaseCmd),
    /// Give a VM (or a lease's VM) a credential, approved by a person: `grant VM TYPE:TARGET
    /// --from-env NAME` writes a Grant and asks you to approve it; approve, deny, ls, revoke.
    Grant(grants::GrantArgs),
    /// Open a shell in a VM (or run a command with a terminal), with its pinned host key.
    Ssh {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// A command instead of a shell.
        #[arg(last = true)]
        cmd: Vec<String>,
    },
    /// Run a command in a VM: output is streamed, and boxery exits with the command's code.
    Run {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// The command and its arguments (after `--`). One word is run by the shell as is
        /// (`boxery run dev1 -- 'cd /tmp && ls'`); several are quoted one by one.
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// Probe a running VM's isolation live (docs/egress.md): from inside it, connections to
    /// listeners the drill opens on the host's loopback and other address, another VM's sshd,
    /// stand-ins for a LAN, a metadata service and the internet (in a network namespace it
    /// makes: run as root), IPv6, names through the egress policy, and the credential proxy
    /// with and without a token. Each blocked probe has a control that shows the probe works.
    /// Exit 0 only when every probe matched.
    Drill {
        /// The VM (running).
        #[arg(value_parser = args::label)]
        vm: String,
        /// The other VM whose sshd and name are probed (default: another ready VM on the same
        /// backend).
        #[arg(long, value_parser = args::label)]
        sibling: Option<String>,
    },
    /// Copy files or directories between this host and a VM (`VM:PATH` names the VM side),
    /// streamed through tar over ssh.
    Cp {
        /// Source: a local path or VM:PATH.
        src: String,
        /// Destination: a local path or VM:PATH.
        dst: String,
    },
    /// Run the control plane: the controllers, until interrupted. A second `serve` on the same
    /// store stands by and takes over when the first dies.
    Serve {
        /// Time between inventory comparisons with the backend (1s to 1day).
        #[arg(long, default_value = "10s", value_parser = runtime::inventory_every_arg)]
        inventory_every: Duration,
        /// Leader lease duration (1s to 5m): a standby takes over this long (and a third)
        /// after the leader dies.
        #[arg(long, default_value = "4s", value_parser = runtime::lease_arg)]
        lease: Duration,
        /// Also serve MCP (streamable HTTP) at http://ADDR/mcp, e.g. 127.0.0.1:7380. Clients
        /// need the bearer token in $BOXERY_HOME/mcp-token. A non-loopback ADDR is refused
        /// unless --mcp-allow-remote is given. See docs/mcp.md.
        #[arg(long, value_name = "ADDR")]
        mcp_listen: Option<std::net::SocketAddr>,
        /// An extra browser Origin allowed to call /mcp (repeatable).
        #[arg(long, value_name = "ORIGIN", requires = "mcp_listen")]
        mcp_allow_origin: Vec<String>,
        /// Allow --mcp-listen on an address other machines (and the VMs' networks) can
        /// reach; the bearer token is then the endpoint's only protection.
        #[arg(long, requires = "mcp_listen")]
        mcp_allow_remote: bool,
        /// Where the credential proxy listens (docs/grants.md): ADDR, or `off`. The default
        /// picks a free loopback port; the address taken is written to $BOXERY_HOME/proxy.addr.
        #[arg(long, value_name = "ADDR|off", default_value = boxery_proxy::DEFAULT_LISTEN, value_parser = proxy_listen_arg)]
        proxy_listen: ProxyListen,
        /// Also serve the Kubernetes-compatible API at https://ADDR (e.g. 127.0.0.1:6443, or
        /// 0.0.0.0:6443 for other machines): kubectl and the Kubernetes clients work against
        /// it with a kubeconfig from `boxery kubeconfig`. Always TLS, always a token. See
        /// docs/api.md.
        #[arg(long, value_name = "ADDR")]
        api_listen: Option<std::net::SocketAddr>,
    },
    /// The contexts: control planes on other machines this one works on (add-context,
    /// use-context, get-contexts, current-context, delete-context). See docs/api.md.
    Config {
        #[command(subcommand)]
        cmd: contexts::ConfigCmd,
    },
    /// Carry stdin and stdout to a VM's sshd through a context's API: the `ProxyCommand` of
    /// the ssh files boxery writes for a context's VMs (`ssh`, `run`, `cp` use it).
    Connect {
        /// The VM (or its ssh alias, NAME.boxery).
        vm: String,
    },
    /// Print a kubeconfig for the API `serve --api-listen` serves, with a new token of a
    /// scope (read, full, lease:NAME); --list and --revoke manage the tokens. See docs/api.md.
    Kubeconfig(kubeconfig::KubeconfigArgs),
    /// Keep a control plane running (a systemd unit running `serve` for this home): install,
    /// uninstall, status. See docs/cli.md.
    Service {
        #[command(subcommand)]
        cmd: service::ServiceCmd,
    },
    /// Serve the vm_* tools over MCP on stdin/stdout, for Claude Code, Codex, Cursor… Runs
    /// the controllers while no `boxery serve` does. See docs/mcp.md.
    Mcp {
        /// The session's default VM.
        #[arg(long)]
        vm: Option<String>,
        /// Print the tool table as markdown and exit.
        #[arg(long)]
        tools_markdown: bool,
    },
    /// Background jobs in a VM that outlive the command (start, list, logs, wait, kill).
    Jobs {
        #[command(subcommand)]
        action: JobsCmd,
    },
    /// Files in a VM: read, write, and replace text in them (the vm_read, vm_write and
    /// vm_edit tools).
    File {
        #[command(subcommand)]
        cmd: FileCmd,
    },
    /// (`file read`, kept for scripts that call it by its old name.)
    #[command(hide = true)]
    Read {
        #[command(flatten)]
        args: FileRead,
    },
    /// (`file write`, kept for scripts that call it by its old name.)
    #[command(hide = true)]
    Write {
        #[command(flatten)]
        args: FileWrite,
    },
    /// Edit an object in your editor ($KUBE_EDITOR, $EDITOR or vi) as YAML; saving applies what
    /// you changed, and a refused change reopens the file with the reason. (Text in a file in a
    /// VM: `boxery file edit`.)
    Edit {
        /// The kind, or KIND/NAME.
        kind: String,
        /// The name (unless given as KIND/NAME).
        name: Option<String>,
        /// Print the edited object as stored.
        #[arg(short, long, value_name = "FORMAT", value_parser = changes::WRITTEN_FORMATS)]
        output: Option<String>,
    },
    /// Change an object with a JSON merge patch (`--type merge`, the default; `strategic` is
    /// taken as merge) or a JSON patch (`--type json`), e.g. `patch vm dev1 -p
    /// '{"spec":{"resources":{"cpus":2}}}'`.
    Patch {
        /// The kind, or KIND/NAME.
        kind: String,
        /// The name (unless given as KIND/NAME).
        name: Option<String>,
        /// merge (RFC 7386) or json (RFC 6902).
        #[arg(long = "type", default_value = "merge", value_parser = patch_type_arg)]
        patch_type: boxery_verbs::edit::PatchType,
        /// The patch, JSON or YAML.
        #[arg(short = 'p', long = "patch", conflicts_with = "patch_file")]
        patch: Option<String>,
        /// A file holding the patch.
        #[arg(long, value_name = "FILE")]
        patch_file: Option<PathBuf>,
        #[command(flatten)]
        written: changes::Written,
    },
    /// Set (KEY=VALUE) or remove (KEY-) labels: `label vm dev1 team=web tier-`.
    Label {
        #[command(flatten)]
        args: MetaArgs,
    },
    /// Set (KEY=VALUE) or remove (KEY-) annotations: `annotate vm dev1 owner=ana`.
    Annotate {
        #[command(flatten)]
        args: MetaArgs,
    },
    /// Set a pool's replicas: `scale pool web --replicas 5`.
    Scale {
        /// The kind (pool), or pool/NAME.
        kind: String,
        /// Pool names (unless given as pool/NAME).
        names: Vec<String>,
        /// The number of members wanted.
        #[arg(long)]
        replicas: u32,
        /// Only if the pool has this many now.
        #[arg(long, value_name = "N")]
        current_replicas: Option<u32>,
        #[command(flatten)]
        written: changes::Written,
    },
}

/// `label`/`annotate`'s arguments, as kubectl's.
#[derive(Debug, Clone, clap::Args)]
struct MetaArgs {
    /// The kind, or KIND/NAME.
    kind: String,
    /// Names (unless given as KIND/NAME), then the changes: KEY=VALUE sets, KEY- removes.
    #[arg(required = true, value_name = "NAME… KEY=VALUE… KEY-")]
    args: Vec<String>,
    /// Replace a key that already has another value.
    #[arg(long)]
    overwrite: bool,
    /// Change every object of the kind matching this label selector.
    #[arg(short = 'l', long = "selector")]
    selector: Option<String>,
    /// Change every object of the kind.
    #[arg(long)]
    all: bool,
    #[command(flatten)]
    written: changes::Written,
}

/// `file read`.
#[derive(Debug, Clone, clap::Args)]
struct FileRead {
    /// The VM.
    #[arg(value_parser = args::label)]
    vm: String,
    /// The file.
    path: String,
    /// First line (from 1).
    #[arg(long)]
    offset: Option<u64>,
    /// How many lines.
    #[arg(long)]
    limit: Option<u64>,
}

/// `file write`.
#[derive(Debug, Clone, clap::Args)]
struct FileWrite {
    /// The VM.
    #[arg(value_parser = args::label)]
    vm: String,
    /// The file.
    path: String,
    /// Only if the file is still at this version (from `file read`), or `absent`.
    #[arg(long = "if-version", id = "if_version")]
    version: Option<String>,
}

/// `boxery file …`.
#[derive(Debug, Subcommand)]
enum FileCmd {
    /// Print a text file in a VM (or a line range of it); its version goes to stderr.
    Read(FileRead),
    /// Write stdin to a file in a VM, atomically (temp file + rename).
    Write(FileWrite),
    /// Replace text in a file in a VM: OLD must occur exactly COUNT times; atomic.
    Edit {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// The file.
        path: String,
        /// The exact text to replace.
        #[arg(long)]
        old: String,
        /// The replacement.
        #[arg(long)]
        new: String,
        /// How many times OLD must occur.
        #[arg(long)]
        count: Option<usize>,
        /// Only if the file is still at this version.
        #[arg(long = "if-version", id = "if_version")]
        version: Option<String>,
    },
}

fn patch_type_arg(s: &str) -> Result<boxery_verbs::edit::PatchType, String> {
    s.parse()
}

/// `boxery jobs …`.
#[derive(Debug, Subcommand)]
enum JobsCmd {
    /// Start a command in the background (its own process group); prints the job id.
    Start {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// Working directory.
        #[arg(long)]
        cwd: Option<String>,
        /// The command (after `--`).
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// List the VM's jobs.
    List {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
    },
    /// Print a job's output.
    Logs {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// The job.
        id: String,
        /// From this byte on (default: the last 64 KiB).
        #[arg(long)]
        offset: Option<u64>,
    },
    /// Wait until a job ends; exits with its exit code (4 if still running at the timeout).
    Wait {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// The job.
        id: String,
        /// How long to wait (0s to 30m).
        #[arg(long, default_value = "60s", value_parser = boxery_verbs::wait::tool_timeout_arg)]
        timeout: Duration,
    },
    /// Kill a job's process group.
    Kill {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// The job.
        id: String,
    },
}

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

/// Run one command: each group of commands has a function of its own.
async fn dispatch(cli: Cli) -> CliResult<ExitCode> {
    let selected = cli.backend.clone();
    let env = Env::resolve(cli.home, cli.backend)?;
    match cli.command {
        Command::Config { cmd } => {
            contexts::config(&env.home, cmd)?;
            Ok(ExitCode::SUCCESS)
        }
        command => {
            if let Some(ctx) = boxery_remote::context::resolve(&env.home, cli.context.as_deref())?
                && !works_here(&command)
            {
                return remote_command(&env, &ctx, command).await;
            }
            dispatch_here(env, selected, command).await
        }
    }
}

/// Whether a command works on this machine whatever the context: it reads no store.
fn works_here(command: &Command) -> bool {
    matches!(
        command,
        Command::Backends
            | Command::ApiResources
            | Command::Version
            | Command::Completion { .. }
            | Command::Explain { .. }
            | Command::Schema { .. }
            | Command::Exec { .. }
            | Command::Mcp {
                tools_markdown: true,
                ..
            }
    )
}

/// A command on the control plane of context `ctx` (another machine's `serve --api-listen`).
async fn remote_command(
    env: &Env,
    ctx: &boxery_remote::Context,
    command: Command,
) -> CliResult<ExitCode> {
    let name = &ctx.name;
    let here_only = |what: &str, why: &str| {
        Err(CliError::invalid(format!(
            "`boxery {what}` {why}: it does not work through context {name}; run it on the VM host (or with `--context local` here)"
        )))
    };
    match &command {
        Command::Serve { .. } => return here_only("serve", "runs a control plane on this machine"),
        Command::Kubeconfig(_) => {
            return here_only("kubeconfig", "mints the tokens of this home's API");
        }
        Command::Service { .. } => return here_only("service", "installs a unit on this machine"),
        Command::Orphans { .. } => return here_only("orphans", "reads the VM host's backends"),
        Command::Drill { .. } => return here_only("drill", "makes interfaces on the VM host"),
        Command::Grant(a) if grants::decides(a) => {
            return here_only(
                "grant approve/deny",
                "is a person's decision at the VM host's terminal (the API refuses it to any token)",
            );
        }
        // completion of names reads no remote store: nothing to offer
        Command::CompleteNames { .. } => return Ok(ExitCode::SUCCESS),
        _ => {}
    }
    let backend = env.backend_name.clone();
    if let Command::Connect { vm } = &command {
        let code = match boxery_remote::connect::tunnel(ctx, vm).await {
            Ok(()) => 0,
            Err(e) => {
                let e = CliError::from(e);
                eprintln!(
                    "error: {}",
                    boxery_verbs::render::safe(&format!("{:#}", e.error))
                );
                e.code as i32
            }
        };
        // Leave now: tokio's stdin reader is a blocking thread the runtime would wait on, and
        // ssh (and its ControlMaster) wait for this process to end.
        std::process::exit(code);
    }
    let v = boxery_remote::verbs(ctx, backend, Voice::Cli).await?;
    match command {
        Command::Mcp { vm, .. } => {
            mcp::stdio(&v.env, vm, Some(&v)).await?;
            Ok(ExitCode::SUCCESS)
        }
        command @ (Command::Read { .. }
        | Command::Write { .. }
        | Command::File { .. }
        | Command::Jobs { .. }) => tool_command(&v, command).await,
        command => verb_command(&v, command).await,
    }
}

/// A command on this home's own store (no context).
async fn dispatch_here(
    env: Env,
    selected: Option<String>,
    command: Command,
) -> CliResult<ExitCode> {
    match command {
        Command::Config { .. } => unreachable!("handled in dispatch"),
        Command::Connect { .. } => {
            return Err(CliError::invalid(
                "`boxery connect` carries ssh to a VM of another machine's control plane: name a context (`--context NAME`; `boxery config get-contexts` lists them)",
            ));
        }
        Command::Service { cmd } => service::service(&env, selected.as_deref(), cmd).await?,
        Command::Backends => out!("{}", commands::backends_table(&env.home)),
        Command::ApiResources => out!("{}", commands::api_resources()),
        Command::Version => commands::version(&env)?,
        Command::Completion { shell } => {
            use clap::CommandFactory;
            out!("{}", completion::script(shell, &mut Cli::command()));
        }
        Command::CompleteNames { kind } => completion::names(env, &kind).await?,
        Command::Exec { args } => {
            let vm = args.first().map_or("VM", String::as_str);
            return Err(CliError::invalid(format!(
                "boxery has no `exec`: `boxery run {vm} -- CMD` runs a command in a VM, `boxery ssh {vm}` opens a shell"
            )));
        }
        Command::Explain { path, recursive } => explain::explain(&path, recursive)?,
        Command::Schema { kind } => commands::schema(kind.as_deref())?,
        Command::Serve {
            inventory_every,
            lease,
            mcp_listen,
            mcp_allow_origin,
            mcp_allow_remote,
            proxy_listen,
            api_listen,
        } => {
            let listen = mcp_listen.map(|a| (a, mcp_allow_origin, mcp_allow_remote));
            serve(
                &env,
                inventory_every,
                lease,
                listen,
                proxy_listen,
                api_listen,
            )
            .await?
        }
        Command::Kubeconfig(args) => out!("{}", kubeconfig::run(&env.home, args)?),
        Command::Mcp {
            tools_markdown: true,
            ..
        } => out!("{}", boxery_mcp::markdown()),
        Command::Mcp { vm, .. } => mcp::stdio(&env, vm, None).await?,
        command @ (Command::Read { .. }
        | Command::Write { .. }
        | Command::File { .. }
        | Command::Jobs { .. }) => {
            let v = Verbs::open(env, Voice::Cli)?;
            return tool_command(&v, command).await;
        }
        command => {
            let v = Verbs::open(env, Voice::Cli)?;
            return verb_command(&v, command).await;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The `--wait` of a command that writes, if it has one.
fn write_wait(command: &Command) -> Option<&WaitArgs> {
    match command {
        Command::Apply { wait, written, .. } => (!written.dry().is_dry()).then_some(wait),
        Command::Delete { wait, .. }
        | Command::New { wait, .. }
        | Command::Snap { wait, .. }
        | Command::Revert { wait, .. }
        | Command::Fork { wait, .. }
        | Command::Start { wait, .. }
        | Command::Stop { wait, .. }
        | Command::Resize { wait, .. }
        | Command::Rm { wait, .. } => Some(wait),
        _ => None,
    }
}

/// The commands that call the verbs (and the hands) on the store.
async fn verb_command(v: &Verbs, command: Command) -> CliResult<ExitCode> {
    // A write that waits may run the controllers here, which needs the home's backend: check
    // it before writing, so a refusal leaves the store as it was (not a spec changed with
    // nothing to reconcile it).
    let waits = write_wait(&command).map(|w| w.wait);
    if waits == Some(true) {
        boxery_verbs::objects::check_backend(v).await?;
    }
    // A write that does not wait, with nothing reconciling: say why it will stay Pending.
    let deletes = matches!(command, Command::Delete { .. } | Command::Rm { .. });
    let note = waits == Some(false) && !deletes;
    let code = verb_command_inner(v, command).await?;
    if note && let Some(line) = runtime::unreconciled_note(v).await? {
        eprintln!("{line}");
    }
    Ok(code)
}

async fn verb_command_inner(v: &Verbs, command: Command) -> CliResult<ExitCode> {
    match command {
        command @ (Command::Apply { .. }
        | Command::Get { .. }
        | Command::Describe { .. }
        | Command::Delete { .. }
        | Command::Diff { .. }
        | Command::Wait { .. }
        | Command::Events { .. }) => return object_command(v, command).await,
        Command::Edit { kind, name, output } => {
            let format = output.as_deref().map(changes::written_format);
            changes::edit(v, &kind, name, format.as_ref()).await?
        }
        Command::Patch {
            kind,
            name,
            patch_type,
            patch,
            patch_file,
            written,
        } => {
            let p = changes::PatchArgs {
                ty: patch_type,
                patch,
                patch_file,
            };
            changes::patch(v, &kind, name, p, &written).await?
        }
        command @ (Command::Label { .. } | Command::Annotate { .. }) => {
            use boxery_verbs::edit::MetaMap;
            let (map, a) = match command {
                Command::Label { args } => (MetaMap::Labels, args),
                Command::Annotate { args } => (MetaMap::Annotations, args),
                _ => unreachable!("matched above"),
            };
            let sel = changes::Selection {
                selector: a.selector.as_deref(),
                all: a.all,
            };
            changes::set_meta(v, map, &a.kind, &a.args, a.overwrite, sel, &a.written).await?
        }
        Command::Scale {
            kind,
            names,
            replicas,
            current_replicas,
            written,
        } => {
            let to = (replicas, current_replicas);
            changes::scale(v, &kind, &names, to, &written).await?
        }
        Command::Pool(cmd) => pools::pool(v, cmd).await?,
        Command::Lease(cmd) => pools::lease(v, cmd).await?,
        Command::Grant(a) => return grants::grant(v, a).await,
        Command::Orphans { cmd } => orphans::orphans(v, cmd).await?,
        Command::Sync(args) => sync::sync(v, args).await?,
        Command::Ssh { vm, cmd } => return Ok(boxery_hands::ssh(&v.reach(&vm).await?, &cmd)?),
        Command::Run { vm, cmd } => return Ok(boxery_hands::run(&v.reach(&vm).await?, &cmd)?),
        Command::Drill { vm, sibling } => return drill_command(v, &vm, sibling.as_deref()),
        Command::Cp { src, dst } => return cp(v, &src, &dst).await,
        command => vm_command(v, command).await?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `drill VM`: the table, and exit 0 only when every probe matched.
fn drill_command(v: &Verbs, vm: &str, sibling: Option<&str>) -> CliResult<ExitCode> {
    let started = std::time::Instant::now();
    let rows = drill::run(v.home(), v.local()?, vm, sibling)?;
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    t.set_header(["", "PROBE", "EXPECTED", "RESULT", "CONTROL"]);
    for r in &rows {
        t.add_row([
            if r.ok { "ok" } else { "FAIL" }.to_string(),
            r.probe.clone(),
            r.expected.clone(),
            r.result.clone(),
            r.control.clone(),
        ]);
    }
    outln!("{}", t.trim_fmt());
    let failed = rows.iter().filter(|r| !r.ok).count();
    let secs = started.elapsed().as_secs_f64();
    if failed == 0 {
        outln!(
            "drill of VM {vm}: all {} probes matched ({secs:.1} s)",
            rows.len()
        );
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "boxery: drill of VM {vm}: {failed} of {} rows did not match ({secs:.1} s)",
            rows.len()
        );
        Ok(ExitCode::FAILURE)
    }
}

/// apply, get, describe, delete, diff, wait, events.
async fn object_command(v: &Verbs, command: Command) -> CliResult<ExitCode> {
    match command {
        Command::Apply {
            sources,
            written,
            ownership,
            prune,
            selector,
            adopt,
            wait,
        } => {
            let prune = if prune { selector.as_deref() } else { None };
            let prune = prune
                .map(|p| boxery_verbs::objects::selector(Some(p)))
                .transpose()?;
            let (dry, output) = (written.dry(), written.format());
            let manifests = manifests::read_sources(&sources.files, &sources.kustomize)?;
            let opts = ownership.options(prune);
            commands::apply(v, manifests, dry, output, opts, adopt, wait.wait_for()).await?;
        }
        Command::Get {
            kind,
            names,
            output,
            selector,
            watch,
            watch_only,
            table,
        } => {
            let format = output.parse()?;
            let opts = commands::GetOptions {
                headers: !table.no_headers,
                show_labels: table.show_labels,
                label_columns: table.label_columns,
                sort_by: table.sort_by,
                watch_only,
            };
            let (kind, names) = commands::kind_and_names(&kind, &names)?;
            let kinds = commands::kinds(&kind)?;
            if kinds.len() == 1 {
                let kind = kinds[0].plural;
                commands::get(v, kind, &names, format, selector.as_deref(), watch, &opts).await?;
            } else {
                commands::get_kinds(v, &kinds, &names, format, selector.as_deref(), watch, &opts)
                    .await?;
            }
        }
        Command::Describe {
            kind,
            names,
            selector,
        } => {
            let all = names.is_empty() && selector.is_none() && !kind.contains('/');
            let (info, names) =
                changes::targets(v, &kind, &names, selector.as_deref(), all).await?;
            if names.is_empty() {
                eprintln!("No {} found.", info.plural);
            }
            for (i, n) in names.iter().enumerate() {
                if i > 0 {
                    outln!("");
                }
                commands::describe(v, info.singular, n).await?;
            }
        }
        Command::Delete {
            kind,
            names,
            files,
            kustomize,
            selector,
            all,
            ignore_not_found,
            force,
            wait,
        } => {
            let how = commands::DeleteOptions {
                wait_for: wait.wait_for(),
                force,
                ignore_not_found,
            };
            if !files.is_empty() || !kustomize.is_empty() {
                let manifests = manifests::read_sources(&files, &kustomize)?;
                commands::delete_manifests(v, &manifests, &how).await?
            } else {
                let Some(kind) = kind else {
                    return Err(CliError::invalid(
                        "what to delete: KIND NAME, KIND/NAME, KIND -l SELECTOR, KIND --all, or -f FILE",
                    ));
                };
                let (info, names) =
                    changes::targets(v, &kind, &names, selector.as_deref(), all).await?;
                commands::delete(v, info.singular, &names, &how).await?
            }
        }
        Command::Diff {
            sources,
            ownership,
            prune,
            selector,
        } => {
            let manifests = manifests::read_sources(&sources.files, &sources.kustomize)?;
            let prune = if prune { selector.as_deref() } else { None };
            let prune = prune
                .map(|p| boxery_verbs::objects::selector(Some(p)))
                .transpose()?;
            return match commands::diff(v, manifests, ownership.options(prune)).await {
                Ok(true) => Ok(ExitCode::from(1)),
                Ok(false) => Ok(ExitCode::SUCCESS),
                Err(e) if e.code == exit::Code::Failed => {
                    Err(CliError::new(exit::Code::Invalid, e.error))
                }
                Err(e) => Err(e),
            };
        }
        Command::Wait {
            kind,
            names,
            selector,
            all,
            until,
            timeout,
        } => {
            let until = until.parse()?;
            let (info, names) =
                changes::targets(v, &kind, &names, selector.as_deref(), all).await?;
            if names.is_empty() {
                return Err(CliError::not_found(format!(
                    "no {} to wait for",
                    info.plural
                )));
            }
            let targets: Vec<_> = names
                .into_iter()
                .map(|n| boxery_store::ObjectRef::new(info.kind, n))
                .collect();
            wait::all(v, &targets, &until, timeout).await?;
        }
        Command::Events { kind, name } => {
            commands::events(v, kind.as_deref(), name.as_deref()).await?
        }
        _ => unreachable!("object_command is called for object commands only"),
    }
    Ok(ExitCode::SUCCESS)
}

/// new, snap, revert, fork, start, stop, resize, rm.
async fn vm_command(v: &Verbs, command: Command) -> CliResult {
    match command {
        Command::New {
            name,
            from,
            fork,
            size,
            stopped,
            wait,
        } => vms::new(v, &name, from, fork, &size, stopped, wait.wait_for()).await,
        Command::Snap { vm, label, wait } => vms::snap(v, &vm, &label, wait.wait_for()).await,
        Command::Revert { vm, label, wait } => vms::revert(v, &vm, &label, wait.wait_for()).await,
        Command::Fork {
            src,
            names,
            size,
            wait,
        } => vms::fork(v, &src, &names, &size, wait.wait_for()).await,
        Command::Start { names, wait } => {
            vms::power(v, &names, RunStrategy::Running, wait.wait_for()).await
        }
        Command::Stop { names, wait } => {
            vms::power(v, &names, RunStrategy::Stopped, wait.wait_for()).await
        }
        Command::Resize { name, size, wait } => vms::resize(v, &name, &size, wait.wait_for()).await,
        Command::Rm { names, force, wait } => {
            let how = commands::DeleteOptions {
                wait_for: wait.wait_for(),
                force,
                ignore_not_found: false,
            };
            commands::delete(v, "vm", &names, &how).await
        }
        _ => unreachable!("vm_command is called for VM commands only"),
    }
}

/// `cp`: local ⇄ VM through the hands; VM ⇄ VM through the `vm_copy` tool.
async fn cp(v: &Verbs, src: &str, dst: &str) -> CliResult<ExitCode> {
    if let (Place::Vm(..), Place::Vm(..)) = (Place::parse(src), Place::parse(dst)) {
        boxery_mcp::run_cli(v, "vm_copy", json!({"src": src, "dst": dst})).await?;
        return Ok(ExitCode::SUCCESS);
    }
    let vm = match (Place::parse(src), Place::parse(dst)) {
        (Place::Vm(vm, _), _) | (_, Place::Vm(vm, _)) => Some(vm),
        _ => None,
    };
    let reach = match vm {
        Some(vm) => Some(v.reach(&vm).await?),
        None => None,
    };
    let given = move |_: &str| {
        reach.ok_or_else(|| {
            boxery_hands::HandsError::Invalid(
                "name a VM on one side: boxery cp LOCAL VM:PATH, or VM:PATH LOCAL".into(),
            )
        })
    };
    Ok(boxery_hands::cp(given, src, dst)?)
}

/// `serve`, with the MCP endpoint when `--mcp-listen` is given.
async fn serve(
    env: &Env,
    inventory_every: Duration,
    lease: Duration,
    mcp_listen: Option<(std::net::SocketAddr, Vec<String>, bool)>,
    proxy_listen: ProxyListen,
    api_listen: Option<std::net::SocketAddr>,
) -> CliResult {
    // A fresh home: made (0700) before the listeners write their address files into it.
    env.ensure_home()?;
    let stop = tokio_util::sync::CancellationToken::new();
    // The credential proxy, bound before the controllers start (a taken port fails at once).
    let (proxy, guest_proxy, bound) = match proxy_listen {
        ProxyListen::Off => (None, None, None),
        ProxyListen::At(addr) => {
            let config = boxery_verbs::env::read_config(&env.home)?.proxy;
            let proxy = boxery_proxy::Proxy::new(&env.home, config)
                .map_err(|e| CliError::new(exit::Code::Failed, e))?;
            let listener = boxery_proxy::Proxy::bind(addr)
                .await
                .map_err(|e| CliError::new(exit::Code::Failed, e))?;
            let bound = listener
                .local_addr()
                .map_err(|e| CliError::invalid(format!("the proxy's listener: {e}")))?;
            write_addr(&boxery_proxy::addr_file(&env.home), bound)?;
            tracing::info!(addr = %bound, "credential proxy listening");
            let guests = proxy.clone();
            (
                Some(tokio::spawn(proxy.serve(listener, stop.clone()))),
                Some(guests),
                Some(bound),
            )
        }
    };
    // Bound (or refused) before the controllers start, so a bad address or token file fails
    // `serve` at once.
    let http = match mcp_listen {
        Some((addr, origins, remote)) => {
            let server = mcp::HttpServer::bind(env, addr, origins, remote).await?;
            Some(tokio::spawn(server.run(stop.clone())))
        }
        None => None,
    };
    // The API, bound (and its certificate made) before the controllers start.
    let api = match api_listen {
        Some(addr) => {
            let verbs = Verbs::open(env.clone(), Voice::Cli)?;
            let server = boxery_apiserver::ApiServer::bind(verbs, addr, Default::default())
                .await
                .map_err(|e| CliError::new(exit::Code::Failed, e))?;
            let bound = server.local_addr();
            let file = boxery_apiserver::tls::dir(&env.home).join("addr");
            write_addr(&file, bound)?;
            eprintln!("boxery serve: API at https://{bound} (a kubeconfig: boxery kubeconfig)");
            Some((tokio::spawn(server.run(stop.clone())), file, bound))
        }
        None => None,
    };
    let trim = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut tick = tokio::time::interval(TRIM_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = tick.tick() => {
                        let _ = tokio::task::spawn_blocking(trim_heap).await;
                    }
                }
            }
        }
    });
    let r = runtime::serve(env, inventory_every, lease, guest_proxy).await;
    stop.cancel();
    let _ = trim.await;
    if let Some((task, file, bound)) = api {
        let _ = task.await;
        remove_addr_if_ours(&file, bound);
    }
    if let Some(h) = http
        && let Ok(Err(e)) = h.await
    {
        eprintln!("error: {}", boxery_verbs::render::safe(&e.chain()));
    }
    if let Some(h) = proxy {
        if let Ok(Err(e)) = h.await {
            eprintln!("error: {}", boxery_verbs::render::safe(&error_chain(&e)));
        }
        if let Some(b) = bound {
            remove_addr_if_ours(&boxery_proxy::addr_file(&env.home), b);
        }
    }
    Ok(r?)
}

/// Record the address a listener took (`proxy.addr`, `api/addr`), whole or not at all.
fn write_addr(file: &std::path::Path, bound: std::net::SocketAddr) -> CliResult {
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, format!("{bound}\n"))
        .and_then(|()| std::fs::rename(&tmp, file))
        .map_err(|e| CliError::invalid(format!("cannot write {}: {e}", file.display())))
}

/// Remove an address file when it still holds our address: another `serve` on this home (a
/// standby) may have written its own since, and its listener answers alike.
fn remove_addr_if_ours(file: &std::path::Path, bound: std::net::SocketAddr) {
    if std::fs::read_to_string(file).ok() == Some(format!("{bound}\n")) {
        let _ = std::fs::remove_file(file);
    }
}

/// `--proxy-listen`: an address, or `off`.
#[derive(Debug, Clone, Copy)]
enum ProxyListen {
    Off,
    At(std::net::SocketAddr),
}

fn proxy_listen_arg(s: &str) -> Result<ProxyListen, String> {
    if s == "off" {
        return Ok(ProxyListen::Off);
    }
    s.parse()
        .map(ProxyListen::At)
        .map_err(|_| format!("`{s}` is not ADDR:PORT (e.g. 127.0.0.1:7390) or `off`"))
}

/// file read|write|edit, jobs: the tools' runners, their results rendered for the terminal.
async fn tool_command(env: &Verbs, command: Command) -> CliResult<ExitCode> {
    match command {
        Command::Jobs { action } => jobs_cmd(env, action).await,
        Command::Read { args } => file_cmd(env, FileCmd::Read(args)).await,
        Command::Write { args } => file_cmd(env, FileCmd::Write(args)).await,
        Command::File { cmd } => file_cmd(env, cmd).await,
        _ => unreachable!("tool_command is called for tool commands only"),
    }
}

/// `file read|write|edit`: the vm_read, vm_write and vm_edit tools.
async fn file_cmd(env: &Verbs, cmd: FileCmd) -> CliResult<ExitCode> {
    match cmd {
        FileCmd::Read(FileRead {
            vm,
            path,
            offset,
            limit,
        }) => {
            let args = json!({"vm": vm, "path": path, "offset": offset, "limit": limit});
            let out = boxery_mcp::run_cli(env, "vm_read", args).await?;
            let data = out.data.unwrap_or_default();
            eprintln!("{}", out.text.lines().next().unwrap_or(""));
            out!("{}", data["content"].as_str().unwrap_or(""));
        }
        FileCmd::Write(FileWrite { vm, path, version }) => {
            let mut content = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut content)
                .map_err(|e| CliError::invalid(format!("stdin is not UTF-8 text: {e}")))?;
            let args = json!({"vm": vm, "path": path, "content": content, "version": version});
            let out = boxery_mcp::run_cli(env, "vm_write", args).await?;
            outln!("{}", out.text);
        }
        FileCmd::Edit {
            vm,
            path,
            old,
            new,
            count,
            version,
        } => {
            let args = json!({"vm": vm, "path": path, "old": old, "new": new, "count": count, "version": version});
            let out = boxery_mcp::run_cli(env, "vm_edit", args).await?;
            outln!("{}", out.text);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `jobs …`: the `vm_jobs` tool; `jobs wait` exits with the job's code.
async fn jobs_cmd(env: &Verbs, action: JobsCmd) -> CliResult<ExitCode> {
    let args = match &action {
        JobsCmd::Start { vm, cwd, cmd } => {
            let line = if cmd.len() == 1 {
                cmd[0].clone()
            } else {
                cmd.iter()
                    .map(|w| boxery_hands::shell_quote(w))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            serde_json::json!({"action": "start", "vm": vm, "cwd": cwd, "command": line})
        }
        JobsCmd::List { vm } => serde_json::json!({"action": "list", "vm": vm}),
        JobsCmd::Logs { vm, id, offset } => {
            serde_json::json!({"action": "logs", "vm": vm, "id": id, "offset": offset})
        }
        JobsCmd::Wait { vm, id, timeout } => serde_json::json!({
            "action": "wait", "vm": vm, "id": id, "timeout_seconds": timeout.as_secs().max(1)
        }),
        JobsCmd::Kill { vm, id } => serde_json::json!({"action": "kill", "vm": vm, "id": id}),
    };
    let out = boxery_mcp::run_cli(env, "vm_jobs", args).await?;
    let data = out.data.unwrap_or_default();
    match action {
        JobsCmd::Start { .. } => outln!("{}", data["id"].as_str().unwrap_or("")),
        JobsCmd::Logs { .. } => out!("{}", data["output"].as_str().unwrap_or("")),
        JobsCmd::Wait { .. } => {
            eprintln!("{}", out.text.lines().next().unwrap_or(""));
            return Ok(match (data["state"].as_str(), data["exit_code"].as_i64()) {
                (Some("exited"), Some(c)) => ExitCode::from(c.clamp(0, 255) as u8),
                (Some("running"), _) => ExitCode::from(exit::Code::Timeout as u8),
                _ => ExitCode::from(1),
            });
        }
        _ => out!("{}", out.text),
    }
    Ok(ExitCode::SUCCESS)
}

/// Tune glibc's allocator for a long-lived control plane; called before any thread starts.
///
/// glibc gives threads that allocate at once malloc arenas of their own (up to 8 per core)
/// and returns an arena's free memory to the system only from its top, above a threshold
/// that grows with every large block freed. `serve` allocates on the async workers and the
/// blocking pool, so after a burst (1,000 Vms converging) it kept 35 MiB of heap for 10 MiB
/// in use. One arena, and fixed thresholds (blocks of 64 KiB and more mapped on their own,
/// free space above 128 KiB at the top returned), with [`trim_heap`] for the free pages below
/// the top, keep it near what is in use (docs/benchmarks.md, issue 12: idle `serve` with 1,000
/// Vms at 28.6–31.5 MiB). The threads then share one arena lock; the per-thread caches of small
/// blocks (tcache) still avoid it for most calls.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn tune_malloc() {
    // SAFETY: mallopt only sets allocator parameters; it is called before any other thread
    // exists, with parameters and values glibc documents (mallopt(3)).
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 128 * 1024);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_malloc() {}

/// Give the free pages inside the heap back to the system (glibc's `malloc_trim`). The trim
/// threshold of [`tune_malloc`] returns only free space at the heap's top; what a burst of work
/// frees below live blocks stays resident until this runs (about 3 MiB of an idle `serve` after
/// 1,000 Vms converged, docs/benchmarks.md).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim_heap() {
    // SAFETY: malloc_trim takes the allocator's locks itself and only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_heap() {}

/// How often a running `serve` gives its heap's free pages back ([`trim_heap`]): a few
/// hundred microseconds each time, on a blocking thread.
const TRIM_EVERY: Duration = Duration::from_secs(5);

fn main() -> ExitCode {
    tune_malloc();
    let cli = Cli::parse();
    init_logging(cli.verbose, matches!(cli.command, Command::Serve { .. }));
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // The store's calls and the hands' blocking work run on this pool: at most 8 threads
        // (their stacks, and before `tune_malloc` their malloc arenas, measured in
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
    match rt.block_on(dispatch(cli)) {
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

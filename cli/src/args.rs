//! The command line, declared: `Cli`, every command and its arguments (clap derive), and the
//! value parsers for names given on it. What each command is (where it runs, whether it writes
//! and waits) is [`crate::table`]; what it does is [`crate::dispatch`].
//!
//! Value parsers for names: every name is checked here, before a command does anything, so
//! `boxery fork v1 ok1 Bad_Name` fails before `ok1` is made and `boxery lease release ..`
//! never reaches the filesystem.

use std::path::PathBuf;
use std::time::Duration;

use boxery_api::Name;
use boxery_verbs::wait::timeout_arg;
use clap::{Parser, Subcommand};

use crate::args;
use crate::{changes, contexts, grants, kubeconfig, orphans, pools, service, sync, vms};

/// A Vm, Pool, Lease or Grant name (a DNS-1123 label).
pub fn label(s: &str) -> Result<String, String> {
    Name::label(s).map(Name::into_string).map_err(|e| e.0)
}

/// An Image name (dot-separated labels), or any object name when the kind is not known yet.
pub fn any_name(s: &str) -> Result<String, String> {
    Name::new(s).map(Name::into_string).map_err(|e| e.0)
}

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
pub(crate) struct Cli {
    /// Where boxery keeps its state (the store, backend files). Default: $XDG_DATA_HOME/boxery
    /// or ~/.local/share/boxery.
    #[arg(long, global = true, env = "BOXERY_HOME", value_name = "DIR")]
    pub(crate) home: Option<PathBuf>,
    /// The backend that runs VMs (`fake`, …). Default: `backend:` in $BOXERY_HOME/config.yaml,
    /// else the platform's default.
    #[arg(long, global = true, env = "BOXERY_BACKEND", value_name = "NAME")]
    pub(crate) backend: Option<String>,
    /// Work on the control plane of another machine: a context of `boxery config` (`local`:
    /// this home's own store). Default: the current context, else this home. See docs/api.md.
    #[arg(long, global = true, env = "BOXERY_CONTEXT", value_name = "NAME")]
    pub(crate) context: Option<String>,
    /// Log more (repeat for even more); logs go to stderr.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub(crate) verbose: u8,
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// `get`'s table flags, as kubectl's.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct TableArgs {
    /// Print the table without its header row.
    #[arg(long)]
    pub(crate) no_headers: bool,
    /// Add a LABELS column with every label.
    #[arg(long)]
    pub(crate) show_labels: bool,
    /// Add a column for each of these label keys (repeat, or KEY1,KEY2).
    #[arg(
        short = 'L',
        long = "label-columns",
        value_delimiter = ',',
        value_name = "KEY"
    )]
    pub(crate) label_columns: Vec<String>,
    /// Sort by the value at this JSONPath (e.g. {.metadata.creationTimestamp}).
    #[arg(long, value_name = "JSONPATH")]
    pub(crate) sort_by: Option<String>,
}

/// Where manifests come from: `-f` and `-k`, as kubectl's.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Sources {
    /// A manifest file, a directory (read recursively), or - for stdin. Repeatable.
    #[arg(short = 'f', long = "filename", required_unless_present = "kustomize")]
    pub(crate) files: Vec<String>,
    /// A directory with a kustomization, built by `kubectl kustomize DIR`. Repeatable.
    #[arg(short = 'k', long = "kustomize", value_name = "DIR")]
    pub(crate) kustomize: Vec<String>,
}

/// Field ownership options of `apply` and `diff`, as kubectl's server-side apply.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Ownership {
    /// The applier these manifests are applied as: fields it set before and the manifests no
    /// longer name are removed; fields other managers set are left alone.
    #[arg(long, value_name = "NAME", default_value = boxery_verbs::APPLY_MANAGER)]
    pub(crate) field_manager: String,
    /// Take over fields another manager (boxery-stop, boxery-scale, another applier) set to
    /// other values, instead of refusing the apply with a conflict.
    #[arg(long)]
    pub(crate) force_conflicts: bool,
}

impl Ownership {
    pub(crate) fn options(
        &self,
        prune: Option<boxery_api::Selector>,
    ) -> boxery_verbs::ApplyOptions {
        boxery_verbs::ApplyOptions {
            prune,
            field_manager: Some(self.field_manager.clone()),
            force_conflicts: self.force_conflicts,
            ..Default::default()
        }
    }
}

/// `--wait` and `--timeout`, shared.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct WaitArgs {
    /// Wait until the objects are ready (or deleted), running the controllers in this process if
    /// no `boxery serve` is running.
    #[arg(long)]
    pub(crate) wait: bool,
    /// How long --wait waits (e.g. 90s, 5m; at most 7days).
    #[arg(long, default_value = "5m", value_parser = timeout_arg)]
    pub(crate) timeout: Duration,
}

impl WaitArgs {
    pub(crate) fn wait_for(&self) -> Option<Duration> {
        self.wait.then_some(self.timeout)
    }
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
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
    /// What VMs, leases, holders, pools and grants used: LLM requests and tokens (and dollars
    /// at the prices in config.yaml) through the proxy, and vCPU-hours, GiB-hours and CPU
    /// seconds of running VMs, from this home's usage ledger. See docs/observability.md.
    Usage {
        /// Group by vm, lease, holder, grant or pool.
        #[arg(long, default_value = "vm", value_parser = ["vm", "lease", "holder", "grant", "pool"])]
        by: String,
        /// From the start of the hour this long ago (1h to 400d).
        #[arg(long, default_value = "24h", value_parser = usage_since)]
        since: Duration,
        /// table, json or csv.
        #[arg(short, long, value_enum, default_value = "table")]
        output: crate::usage::UsageOutput,
    },
    /// What people and agents did on this home's VMs: commands run (`run`, vm_bash, jobs,
    /// prompts), shell sessions, copies, file reads and writes, MCP tool calls and writes
    /// through the API: who, through what, the command as given, the VM, when, the result.
    /// See docs/observability.md.
    Audit {
        /// Only actions on this VM.
        #[arg(long, value_parser = args::label)]
        vm: Option<String>,
        /// Only actions by this one: `user:NAME`, `mcp:NAME`, `token:NAME`, or the NAME alone.
        #[arg(long, value_name = "WHO")]
        holder: Option<String>,
        /// Only actions that ended this long ago or since (e.g. 30m, 24h).
        #[arg(long, value_parser = audit_since)]
        since: Option<Duration>,
        /// table or json (one object per line, as the log holds them).
        #[arg(short, long, value_enum, default_value = "table")]
        output: crate::audit::AuditOutput,
    },
    /// What each running VM uses of the host now, as kubectl top does: its hypervisor's CPU
    /// (cores, over one second), host memory, and network bytes a second. See
    /// docs/observability.md.
    Top {
        /// Again every two seconds, until interrupted.
        #[arg(short, long)]
        watch: bool,
        /// One JSON list per sample.
        #[arg(long)]
        json: bool,
    },
    /// The backends this build has and what each offers (from their own declarations).
    Backends,
    /// Facts about images: `images layers` lists the guest layers and what each installs.
    #[command(subcommand)]
    Images(ImagesCmd),
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
        /// Capture the running VM's memory too, at the same instant as its disk (the guest
        /// pauses for the copy): `revert --memory` brings it back running where it was.
        #[arg(long, visible_alias = "with-memory")]
        memory: bool,
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
        /// Restore the memory the image carries too (taken with `snap --memory` of this VM):
        /// the VM comes back running where it was, its processes intact.
        #[arg(long, visible_alias = "with-memory")]
        memory: bool,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Make new VMs from a VM's disk as it is now (with --with-memory: from the running VM's
    /// memory too).
    Fork {
        /// The source VM.
        #[arg(value_parser = args::label)]
        src: String,
        /// New VM names.
        #[arg(required = true, value_parser = args::label)]
        names: Vec<String>,
        #[command(flatten)]
        size: vms::SizeArgs,
        /// Fork the running VM's memory too: the new VMs continue from this instant (its
        /// processes, open files and shells), each given its own hostname, machine-id, host
        /// key, MAC and token before it is Ready. The source pauses for the copy and runs on.
        /// (`--memory SIZE` is the new VMs' memory size.)
        #[arg(long)]
        with_memory: bool,
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
    /// Stop VMs (runStrategy: Stopped). A suspended VM's saved memory is discarded.
    Stop {
        /// VM names.
        #[arg(required = true, value_parser = args::label)]
        names: Vec<String>,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Suspend running VMs (runStrategy: Suspended): memory to disk, hypervisor ended, host
    /// RAM free. `resume` brings the same processes back (docs/live-memory.md).
    Suspend {
        /// VM names.
        #[arg(required = true, value_parser = args::label)]
        names: Vec<String>,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Resume suspended VMs from their saved memory (runStrategy: Running; same as `start`).
    Resume {
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
        /// Use your ssh-agent in the VM: needs an ssh-agent grant in force on it (`boxery grant
        /// VM ssh-agent:all`, approved by a person), and waits until the control plane's
        /// forward is up. Without the grant, refused.
        #[arg(short = 'A', long = "forward-agent")]
        agent: bool,
        /// A command instead of a shell.
        #[arg(last = true)]
        cmd: Vec<String>,
    },
    /// Forward ports between this machine and a VM until interrupted: `forward dev1 8080`
    /// makes the guest's port 8080 (on its loopback or any address) reachable at
    /// 127.0.0.1:8080 here; `-R` the other way.
    #[command(after_help = "Examples:\n  \
        boxery forward dev1 8080            # http://127.0.0.1:8080 here reaches port 8080 in dev1\n  \
        boxery forward dev1 18080:8080      # port 18080 here\n  \
        boxery forward dev1 :8080 :5432     # any free ports here (printed)\n  \
        boxery forward dev1 -R 3000         # dev1's 127.0.0.1:3000 reaches port 3000 here")]
    Forward {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// `REMOTE` (the same port here), `LOCAL:REMOTE`, or `:REMOTE` (any free port here).
        #[arg(required = true, value_name = "[LOCAL:]REMOTE")]
        ports: Vec<String>,
        /// The other way: the guest's 127.0.0.1:REMOTE reaches LOCAL on --address here.
        #[arg(short = 'R', long)]
        reverse: bool,
        /// The address here to listen on (or, with -R, to connect to).
        #[arg(long, default_value = "127.0.0.1")]
        address: std::net::IpAddr,
    },
    /// Watch a VM's desktop live in a browser: prints a link to a page (noVNC) served on
    /// this machine's loopback, and serves it until interrupted. The link works once, in one
    /// browser; the stream is carried over the VM's ssh connection (no VNC port is opened). A
    /// VM without a desktop shows its console (the hypervisor's screen of it: boot messages,
    /// a text login), from its hypervisor on the VM's host (through the API under a
    /// context). View only unless --control.
    #[command(after_help = "Examples:\n  \
        boxery desktop desk1              # prints http://127.0.0.1:PORT/?token=…\n  \
        boxery desktop desk1 --open       # and opens it ($BROWSER, else xdg-open)\n  \
        boxery desktop desk1 --control    # keys and the pointer reach the VM\n  \
        boxery desktop dev1               # a VM without a desktop: its console\n\n\
        Needs Debian's novnc package (scripts/install-deps.sh installs it). docs/desktop.md.")]
    Desktop {
        /// The VM (its desktop, `headless: false`; else its console).
        #[arg(value_parser = args::label)]
        vm: String,
        /// Let the browser send keys and the pointer to the VM (default: view only).
        #[arg(long)]
        control: bool,
        /// Open the link in a browser ($BROWSER, else xdg-open).
        #[arg(long)]
        open: bool,
        /// The port on 127.0.0.1 to serve on (0: any free one, printed).
        #[arg(long, default_value_t = 0)]
        port: u16,
    },
    /// Save a picture of a VM's screen as PNG: its desktop (a VM made with the desktop layer)
    /// or its console (any other VM, or --console), at the screen's own size.
    #[command(after_help = "Examples:\n  \
        boxery screenshot dev1 dev1.png\n  \
        boxery screenshot dev1 --console - > console.png   (the hypervisor's screen)")]
    Screenshot {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// Where to write the PNG (`-`: standard output).
        #[arg(value_name = "FILE")]
        file: std::path::PathBuf,
        /// The hypervisor's screen (the VM's console) even when the VM has a desktop.
        #[arg(long)]
        console: bool,
    },
    /// Drive a VM's screen with one computer-use action, as `vm_computer` does: the
    /// coordinates are the screen's pixels (as `boxery screenshot` saves it).
    #[command(after_help = "Actions and their arguments:\n  \
        screenshot -o FILE              a PNG of the screen (-o -: standard output)\n  \
        left_click [X Y]                also right_click, middle_click, double_click, triple_click\n                                  (no X Y: where the pointer is; --hold shift: keys held)\n  \
        mouse_move X Y\n  \
        left_click_drag X0 Y0 X1 Y1\n  \
        type TEXT...                    the words joined by spaces (newline is Return)\n  \
        key KEYS...                     ctrl+s, Return, Page_Down: pressed in turn\n  \
        scroll up|down|left|right [N]   N notches (default 3); --at X,Y to move there first\n  \
        cursor_position\n  \
        wait [SECONDS]                  then a screenshot to FILE with -o\n\n\
        Examples:\n  \
        boxery computer dev1 left_click 640 400\n  \
        boxery computer dev1 type 'hello, world'\n  \
        boxery computer dev1 key ctrl+s\n  \
        boxery computer dev1 scroll down 5 --at 640,400")]
    Computer {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// The action (screenshot, left_click, right_click, middle_click, double_click,
        /// triple_click, mouse_move, left_click_drag, type, key, scroll, cursor_position, wait).
        action: String,
        /// The action's arguments (see below); options may come before or after them, and
        /// text that starts with `-` goes after `--` (`type -- -x`).
        #[arg(allow_negative_numbers = true, value_name = "ARG")]
        args: Vec<String>,
        /// Keys held during a click (shift, ctrl+alt).
        #[arg(long, value_name = "KEYS")]
        hold: Option<String>,
        /// Where to scroll: X,Y.
        #[arg(long, value_name = "X,Y")]
        at: Option<String>,
        /// Where a screenshot or wait writes its PNG (`-`: standard output).
        #[arg(short = 'o', long, value_name = "FILE")]
        output: Option<std::path::PathBuf>,
        /// The hypervisor's screen (the VM's console) even when the VM has a desktop.
        #[arg(long)]
        console: bool,
    },
    /// Drive the browser of a VM made with the browser layer, as `vm_browser` does: open a
    /// page, read it, click or fill an element (CSS selectors), evaluate JavaScript, or save a
    /// screenshot. The browser goes out through the VM's egress policy.
    #[command(after_help = "Actions:\n  \
        open URL                 go there and wait for it; its text on stdout\n  \
        read                     the current page's text\n  \
        click SELECTOR           click the first element it matches\n  \
        fill SELECTOR [TEXT]     replace the field's text (none: clear it)\n  \
        evaluate EXPRESSION      run JavaScript; its value as JSON\n  \
        screenshot -o FILE       the page's viewport as PNG (-: stdout)\n\n\
        Examples:\n  \
        boxery browser web1 open http://127.0.0.1:8000/\n  \
        boxery browser web1 fill '#name' 'Ada'\n  \
        boxery browser web1 click 'button[type=submit]'\n  \
        boxery browser web1 evaluate 'document.title'\n\n\
        The line about the page (address, HTTP status, title) goes to stderr. docs/desktop.md.")]
    Browser {
        /// The VM (one made with `layers: [browser]`).
        #[arg(value_parser = args::label)]
        vm: String,
        /// The action: open, read, click, fill, evaluate, screenshot.
        action: String,
        /// The action's arguments (above); text that starts with `-` goes after `--`.
        #[arg(value_name = "ARG")]
        args: Vec<String>,
        /// Where a screenshot writes its PNG (`-`: standard output).
        #[arg(short = 'o', long, value_name = "FILE")]
        output: Option<std::path::PathBuf>,
        /// Seconds the action may take (default 180, at most 300; the first action starts the
        /// browser: a minute or two under emulation).
        #[arg(long, value_name = "SECONDS")]
        timeout: Option<u64>,
    },
    /// Run a coding agent in a VM on a prompt, headless (`claude -p`, `codex exec`, `opencode
    /// run`): its output is streamed and boxery exits with its exit code. The VM needs the
    /// agents layer, and an `llm` grant for the agent's provider (docs/agents.md).
    #[command(after_help = "Examples:\n  \
        boxery prompt dev1 \"fix the failing test in ~/src and commit\"\n  \
        boxery prompt dev1 --agent codex \"explain ~/src/main.rs\"\n  \
        cat brief.md | boxery prompt dev1 -")]
    Prompt {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// The agent.
        #[arg(long, default_value = "claude", value_parser = ["claude", "codex", "opencode"])]
        agent: String,
        /// The prompt (several words are joined with spaces); `-`: read it from stdin.
        #[arg(required = true, value_name = "TEXT")]
        text: Vec<String>,
    },
    /// Open the agent's terminal session in a VM (tmux session `agent`, made or rejoined):
    /// detach with Ctrl-b d, and the agent runs on.
    Attach {
        /// The VM.
        #[arg(value_parser = args::label)]
        vm: String,
        /// The agent the session starts with when it is made.
        #[arg(long, default_value = "claude", value_parser = ["claude", "codex", "opencode"])]
        agent: String,
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
    /// Hand a command to Incus for an incus backend's VM, verbatim: `boxery incus dev1 -- info
    /// dev1` runs `incus --project <home's project> info <dev1's instance>` (the VM's name, as
    /// a word or before `/PATH`, becomes its instance's). Only an instance boxery made for this
    /// VM; a command that can take it off boxery's isolation stack (its devices, profiles,
    /// network, `security.*`, `raw.*`) is run after a warning. Exits with Incus's code.
    Incus {
        /// The VM (an incus backend's).
        #[arg(value_parser = args::label)]
        vm: String,
        /// The incus command and its arguments (after `--`).
        #[arg(last = true, required = true)]
        args: Vec<String>,
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
        #[arg(long, default_value = "10s", value_parser = boxery_daemon::inventory_every_arg)]
        inventory_every: Duration,
        /// Leader lease duration (1s to 5m): a standby takes over this long (and a third)
        /// after the leader dies.
        #[arg(long, default_value = "4s", value_parser = boxery_daemon::lease_arg)]
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
        #[arg(long, value_name = "ADDR|off", default_value = boxery_proxy::DEFAULT_LISTEN, value_parser = boxery_daemon::proxy_listen_arg)]
        proxy_listen: boxery_daemon::ProxyListen,
        /// Also serve the Kubernetes-compatible API at https://ADDR (e.g. 127.0.0.1:6443, or
        /// 0.0.0.0:6443 for other machines): kubectl and the Kubernetes clients work against
        /// it with a kubeconfig from `boxery kubeconfig`. Always TLS, always a token. See
        /// docs/api.md.
        #[arg(long, value_name = "ADDR")]
        api_listen: Option<std::net::SocketAddr>,
        /// Also serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9390), plain
        /// HTTP with no token; a non-loopback ADDR is refused unless --metrics-allow-remote is
        /// given. The API serves them too, to a read token. See docs/observability.md.
        #[arg(long, value_name = "ADDR")]
        metrics_listen: Option<std::net::SocketAddr>,
        /// Allow --metrics-listen on an address other machines can reach: anyone who reaches
        /// it then reads every VM's name and usage.
        #[arg(long, requires = "metrics_listen")]
        metrics_allow_remote: bool,
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
pub(crate) struct MetaArgs {
    /// The kind, or KIND/NAME.
    pub(crate) kind: String,
    /// Names (unless given as KIND/NAME), then the changes: KEY=VALUE sets, KEY- removes.
    #[arg(required = true, value_name = "NAME… KEY=VALUE… KEY-")]
    pub(crate) args: Vec<String>,
    /// Replace a key that already has another value.
    #[arg(long)]
    pub(crate) overwrite: bool,
    /// Change every object of the kind matching this label selector.
    #[arg(short = 'l', long = "selector")]
    pub(crate) selector: Option<String>,
    /// Change every object of the kind.
    #[arg(long)]
    pub(crate) all: bool,
    #[command(flatten)]
    pub(crate) written: changes::Written,
}

/// `file read`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct FileRead {
    /// The VM.
    #[arg(value_parser = args::label)]
    pub(crate) vm: String,
    /// The file.
    pub(crate) path: String,
    /// First line (from 1).
    #[arg(long)]
    pub(crate) offset: Option<u64>,
    /// How many lines.
    #[arg(long)]
    pub(crate) limit: Option<u64>,
}

/// `file write`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct FileWrite {
    /// The VM.
    #[arg(value_parser = args::label)]
    pub(crate) vm: String,
    /// The file.
    pub(crate) path: String,
    /// Only if the file is still at this version (from `file read`), or `absent`.
    #[arg(long = "if-version", id = "if_version")]
    pub(crate) version: Option<String>,
}

/// `boxery file …`.
#[derive(Debug, Subcommand)]
pub(crate) enum FileCmd {
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

pub(crate) fn patch_type_arg(s: &str) -> Result<boxery_verbs::edit::PatchType, String> {
    s.parse()
}

/// `boxery jobs …`.
#[derive(Debug, Subcommand)]
pub(crate) enum JobsCmd {
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

/// `boxery images …`.
#[derive(Debug, clap::Subcommand)]
pub enum ImagesCmd {
    /// The guest layers: those every debian-12 has, and those an Image can ask for in
    /// `spec.source.build.layers` (e.g. `agents`), with what each installs.
    Layers,
}

/// `usage --since`: 1 hour to 400 days.
fn usage_since(s: &str) -> Result<Duration, String> {
    boxery_verbs::wait::duration_in(
        s,
        Duration::from_secs(3600),
        Duration::from_secs(400 * 86400),
    )
}

/// `audit --since`: 1 second to 400 days.
fn audit_since(s: &str) -> Result<Duration, String> {
    boxery_verbs::wait::duration_in(s, Duration::from_secs(1), Duration::from_secs(400 * 86400))
}

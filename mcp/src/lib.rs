//! boxery's MCP server and its `vm_*` tool table: every tool's name, description, input JSON
//! Schema (generated from the Rust argument type by schemars), annotations and runner, in one
//! place. The server ([`server`]: stdio and streamable HTTP) lists and runs tools from it; the
//! CLI's `file read|write|edit`, `jobs` and VM-to-VM `cp` commands run the same runners
//! ([`run_cli`]); the CLI's parity test maps every tool to its CLI command and back. The
//! tools call the verbs (`boxery-verbs`) and the hands (`boxery-hands`) and render their
//! results as tool results.
//!
//! Guarantees: a runner never prints to stdout (stdout is the MCP stdio transport), never
//! waits without a bound, and turns every failure into a [`ToolError`] a model can act on.

pub mod conns;
pub mod exec;
pub mod files;
pub mod grant;
pub mod jobs;
pub mod lease;
pub mod lifecycle;
pub mod server;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};

use boxery_api::Vm;
use boxery_hands::{Reach, Voice};
use boxery_verbs::{Env, ErrorKind, VerbError, Verbs};
use futures::future::BoxFuture;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// The cap on text a tool returns (command output, file contents, job logs): 1 MiB.
pub const OUTPUT_CAP: usize = 1 << 20;
/// The cap on a tool call's arguments, serialized (a `vm_write` content included): 8 MiB.
pub const ARGS_CAP: usize = 8 << 20;
/// The cap on any one string argument other than file content and manifests: 64 KiB.
pub const STRING_CAP: usize = 64 << 10;
/// The longest a tool may wait (`timeout_seconds` is clamped to this): 30 minutes.
pub const MAX_WAIT_SECS: u64 = boxery_verbs::wait::TOOL_MAX_WAIT_SECS;

/// A tool failed; the message says what to do next.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// The arguments are wrong.
    #[error("{0}")]
    Invalid(String),
    /// A VM, object, file or job does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The VM exists but cannot be reached now.
    #[error("{0}")]
    NotReady(String),
    /// Something changed under the call (a file edited since it was read, an object updated).
    #[error("{0}")]
    Conflict(String),
    /// A bounded wait ran out.
    #[error("{0}")]
    Timeout(String),
    /// The call was cancelled by the client.
    #[error("cancelled")]
    Cancelled,
    /// Anything else.
    #[error("{0}")]
    Failed(String),
}

impl ToolError {
    /// The kind of failure (the CLI maps it to its exit code).
    pub fn kind(&self) -> ErrorKind {
        match self {
            ToolError::Invalid(_) => ErrorKind::Invalid,
            ToolError::NotFound(_) => ErrorKind::NotFound,
            ToolError::NotReady(_) => ErrorKind::NotReady,
            ToolError::Conflict(_) => ErrorKind::Conflict,
            ToolError::Timeout(_) => ErrorKind::Timeout,
            ToolError::Cancelled => ErrorKind::Cancelled,
            ToolError::Failed(_) => ErrorKind::Failed,
        }
    }
}

impl From<VerbError> for ToolError {
    fn from(e: VerbError) -> Self {
        let msg = e.chain();
        match e.kind() {
            ErrorKind::Invalid => ToolError::Invalid(msg),
            ErrorKind::NotFound => ToolError::NotFound(msg),
            ErrorKind::NotReady => ToolError::NotReady(msg),
            ErrorKind::Timeout => ToolError::Timeout(msg),
            ErrorKind::Conflict => ToolError::Conflict(msg),
            ErrorKind::Cancelled => ToolError::Cancelled,
            ErrorKind::Failed => ToolError::Failed(msg),
        }
    }
}

impl From<boxery_store::StoreError> for ToolError {
    fn from(e: boxery_store::StoreError) -> Self {
        VerbError::from(e).into()
    }
}

impl From<boxery_hands::HandsError> for ToolError {
    fn from(e: boxery_hands::HandsError) -> Self {
        VerbError::from(e).into()
    }
}

/// What a tool returns: text for the model, and the same facts as JSON.
#[derive(Debug, Clone, Default)]
pub struct Output {
    /// Human- and model-readable text.
    pub text: String,
    /// Structured result (`structuredContent` in MCP), when there is one.
    pub data: Option<Value>,
}

impl Output {
    /// Text and data.
    pub fn with_data(text: impl Into<String>, data: Value) -> Self {
        Output {
            text: text.into(),
            data: Some(data),
        }
    }
}

/// The result of a runner.
pub type ToolResult = Result<Output, ToolError>;

/// The CLI side of a tool.
#[derive(Debug, Clone, Copy)]
pub enum CliSide {
    /// These `boxery` commands do what the tool does.
    Commands(&'static [&'static str]),
    /// No command, and why.
    None(&'static str),
}

type Runner = Box<
    dyn Fn(Arc<Session>, Value, CancellationToken) -> BoxFuture<'static, ToolResult> + Send + Sync,
>;

/// One tool of the table.
pub struct Tool {
    /// Its name (`vm_bash`).
    pub name: &'static str,
    /// What it does, for the model.
    pub description: &'static str,
    /// It changes nothing.
    pub read_only: bool,
    /// It may destroy data (delete, overwrite, kill).
    pub destructive: bool,
    /// Its CLI command(s).
    pub cli: CliSide,
    /// Its input JSON Schema.
    pub schema: Value,
    run: Runner,
}

impl std::fmt::Debug for Tool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tool").field("name", &self.name).finish()
    }
}

impl Tool {
    /// Run the tool with JSON arguments (validated by deserializing into its argument type).
    pub fn run(
        &self,
        session: Arc<Session>,
        args: Value,
        ct: CancellationToken,
    ) -> BoxFuture<'static, ToolResult> {
        (self.run)(session, args, ct)
    }
}

fn schema_of<A: JsonSchema>() -> Value {
    let mut v = serde_json::to_value(schemars::schema_for!(A)).expect("schemas serialize");
    if let Some(m) = v.as_object_mut() {
        // MCP wants an object schema; the draft is implied by the protocol.
        m.remove("$schema");
        m.remove("title");
        if !m.contains_key("properties") {
            m.insert("properties".into(), Value::Object(Default::default()));
        }
    }
    v
}

fn tool<A, F, Fut>(
    name: &'static str,
    description: &'static str,
    (read_only, destructive): (bool, bool),
    cli: CliSide,
    f: F,
) -> Tool
where
    A: DeserializeOwned + JsonSchema + Send + 'static,
    F: Fn(Arc<Session>, A, CancellationToken) -> Fut + Send + Sync + Copy + 'static,
    Fut: Future<Output = ToolResult> + Send + 'static,
{
    Tool {
        name,
        description,
        read_only,
        destructive,
        cli,
        schema: schema_of::<A>(),
        run: Box::new(move |s, args, ct| {
            let parsed = check_args(&args).and_then(|()| {
                serde_json::from_value::<A>(args).map_err(|e| {
                    ToolError::Invalid(format!(
                        "invalid arguments for {name}: {e}; the tool's input schema lists the fields"
                    ))
                })
            });
            match parsed {
                Ok(a) => Box::pin(f(s, a, ct)),
                Err(e) => Box::pin(async move { Err(e) }),
            }
        }),
    }
}

/// Refuse arguments over the size bounds.
fn check_args(args: &Value) -> Result<(), ToolError> {
    let size = serde_json::to_vec(args)
        .map(|v| v.len())
        .unwrap_or(usize::MAX);
    if size > ARGS_CAP {
        return Err(ToolError::Invalid(format!(
            "arguments too large: {size} bytes (the limit is {ARGS_CAP}); write big files with vm_copy"
        )));
    }
    if let Some(m) = args.as_object() {
        for (k, v) in m {
            if matches!(k.as_str(), "content" | "manifest" | "old" | "new") {
                continue;
            }
            if let Some(s) = v.as_str()
                && s.len() > STRING_CAP
            {
                return Err(ToolError::Invalid(format!(
                    "argument `{k}` is too large: {} bytes (the limit is {STRING_CAP})",
                    s.len()
                )));
            }
        }
        for (k, v) in m {
            refuse_blank(k, v)?;
        }
    }
    Ok(())
}

/// The arguments whose empty value means something: a file written empty, a replacement that
/// deletes the text, an argument of a command line.
const MAY_BE_EMPTY: &[&str] = &["content", "new", "from_command"];

/// Refuse an argument given as an empty or blank string (or a list holding one): an explicit
/// `""` is never read as "not given" (`vm_manage {action: rm, vm: ""}` would otherwise mean
/// the default or only VM). Every tool's arguments pass here, whatever the tool.
fn refuse_blank(k: &str, v: &Value) -> Result<(), ToolError> {
    if MAY_BE_EMPTY.contains(&k) {
        return Ok(());
    }
    let blank = |v: &Value| v.as_str().is_some_and(|s| s.trim().is_empty());
    let in_list = v.as_array().is_some_and(|items| items.iter().any(blank));
    if !blank(v) && !in_list {
        return Ok(());
    }
    let what = if in_list {
        format!("`{k}` holds an empty or blank name")
    } else {
        format!("`{k}` is empty or blank")
    };
    let instead = match k {
        "vm" => "name the VM, or leave `vm` out to mean this session's default VM (vm_use)",
        _ => "give a value, or leave the argument out",
    };
    Err(ToolError::Invalid(format!(
        "{what}: an empty argument is never taken as one not given; {instead}"
    )))
}

/// The table, built once.
pub fn tools() -> &'static [Tool] {
    static TOOLS: OnceLock<Vec<Tool>> = OnceLock::new();
    TOOLS.get_or_init(|| {
        let ro = (true, false);
        let rw = (false, false);
        let destructive = (false, true);
        vec![
            tool(
                "vm_apply",
                "Create or update objects (Vm, Image, Pool, Lease, Grant) from a YAML or JSON manifest, validated exactly as `boxery apply` validates it; all or nothing. Sets the fields the manifest names and leaves the rest: a field someone else set (a person's `boxery stop`, a sync source) to another value is a conflict naming them, unless force_conflicts. Waits (bounded) until what it applied has settled (Vms and Images Ready, Pools with every member made, Leases Bound, Grants seen by their controller) and returns their state; with wait: false it says when no control plane runs. A manifest's status is ignored: a Grant stays PendingApproval until a person approves it (`boxery grant approve NAME` in a terminal). A Vm needs at least: apiVersion: boxery.dev/v1alpha1, kind: Vm, metadata.name, spec.source.image (e.g. debian-12 or tiny).",
                rw,
                CliSide::Commands(&["apply"]),
                lifecycle::apply,
            ),
            tool(
                "vm_get",
                "List objects of a kind (vm, image, pool, lease, grant, source, event) with their status, or show named ones as YAML.",
                ro,
                CliSide::Commands(&["get"]),
                lifecycle::get,
            ),
            tool(
                "vm_patch",
                "Change fields of one stored object without rewriting it: labels and annotations, a Pool's replicas, a Vm's resources or runStrategy. A JSON merge patch (default; {\"spec\": {\"replicas\": 3}}, null removes a field) or a JSON patch (type: json). Validated as vm_apply validates; status and the controllers' metadata cannot be changed. dry_run returns the result and writes nothing. Returns once the controller has acted on the change (at most 5 s), with where the object stands then: a status still from an older generation says so, and a Grant whose changed spec no person approved is PendingApproval and NOT in force until `boxery grant approve`. Follow it further with vm_wait.",
                rw,
                CliSide::Commands(&["patch", "label", "annotate", "scale"]),
                lifecycle::patch,
            ),
            tool(
                "vm_describe",
                "Show one object in detail: spec, status, conditions and recent events (a pool: also its members and who leases them). Use it to see why a VM is not Ready.",
                ro,
                CliSide::Commands(&["describe", "events"]),
                lifecycle::describe,
            ),
            tool(
                "vm_delete",
                "Delete objects (a Vm's controller removes it from the backend first). Waits (bounded) until they are gone.",
                destructive,
                CliSide::Commands(&["delete"]),
                lifecycle::delete,
            ),
            tool(
                "vm_wait",
                "Wait (bounded) for a condition on an object: condition=Ready, delete, or jsonpath={.status.phase}=Stopped. On timeout says where the object stands.",
                ro,
                CliSide::Commands(&["wait"]),
                lifecycle::wait,
            ),
            tool(
                "vm_manage",
                "VM verbs that write specs and wait (bounded) for the result: new (make a VM from an image), snap (snapshot the disk into image VM.LABEL), revert (back to a snapshot), fork (new VMs from this VM's disk), start, stop, resize, rm. Returns the current state even when the wait runs out.",
                destructive,
                CliSide::Commands(&["new", "snap", "revert", "fork", "start", "stop", "resize", "rm"]),
                lifecycle::manage,
            ),
            tool(
                "vm_lease",
                "Take a VM from a warm pool: acquire (waits, bounded, for a free member; the VM becomes this session's default VM and is reached with a key made for the lease), renew, release (the VM is reset to its clean image and goes back to the pool), list. The session renews its leases by itself and releases them when it ends.",
                rw,
                CliSide::Commands(&["lease"]),
                lease::lease,
            ),
            tool(
                "vm_grant",
                "Ask for a credential for a VM (default: this session's VM) or a lease's VM: request (grant: llm:PROVIDER, http:HOST with header, github:OWNER/REPO, env:NAME or file:PATH; and where the control plane reads the value: from_env, from_file or from_command — never the value itself), list, revoke. A request is PendingApproval and NOT in force until a person approves it: in this MCP client when it supports elicitation (the person is asked; this call waits for the answer, at most 10 minutes), else by running `boxery grant approve NAME` in a terminal. No tool argument can approve. Once Applied, the control plane's credential proxy adds the real value to the VM's llm, http and github calls (the value never enters the VM), and env and file grants are pushed into the VM's tmpfs (/run/boxery).",
                destructive,
                CliSide::Commands(&["grant"]),
                grant::grant,
            ),
            tool(
                "vm_use",
                "Set (or show) this session's default VM, so other tools need no `vm` argument. Every tool still accepts an explicit `vm`.",
                ro,
                CliSide::None("the CLI has no session: every command names its VM"),
                lifecycle::use_vm,
            ),
            tool(
                "vm_bash",
                "Run a shell command in the VM (as user agent, in its home unless `cwd` is given) and return stdout, stderr and the exit code. Bounded by `timeout_seconds`; on timeout or cancel the command's whole process group is killed. Output is capped at 1 MiB. For long-running work use vm_jobs.",
                destructive,
                CliSide::Commands(&["run"]),
                exec::bash,
            ),
            tool(
                "vm_read",
                "Read a text file in the VM, optionally a line range. Returns the lines and the file's version (a hash); pass it to vm_edit to make sure nobody changed the file in between. Binary files are refused.",
                ro,
                CliSide::Commands(&["file read"]),
                files::read,
            ),
            tool(
                "vm_write",
                "Write a whole file in the VM atomically (temp file + rename; parent directories are made). Returns the new version.",
                destructive,
                CliSide::Commands(&["file write"]),
                files::write,
            ),
            tool(
                "vm_edit",
                "Replace text in a file in the VM: `old` must occur exactly `count` times (default 1). Atomic, and refused when the file changed since this session last read or wrote it (or since `version`).",
                destructive,
                CliSide::Commands(&["file edit"]),
                files::edit,
            ),
            tool(
                "vm_copy",
                "Copy files or directories, streamed as tar: local⇄VM or VM⇄VM. Write VM paths as VM:PATH and local paths as local:PATH (local paths are on the machine running the MCP server; refused over HTTP).",
                destructive,
                CliSide::Commands(&["cp"]),
                files::copy,
            ),
            tool(
                "vm_jobs",
                "Background jobs in the VM that outlive this call and the MCP server: start (runs `command` in its own process group), list, logs (output so far), wait (bounded), kill. Jobs record their real exit code.",
                destructive,
                CliSide::Commands(&["jobs"]),
                jobs::jobs,
            ),
        ]
    })
}

/// Look a tool up by name.
pub fn find(name: &str) -> Option<&'static Tool> {
    tools().iter().find(|t| t.name == name)
}

/// One agent's session: the environment, its default VM, and the versions of files it read.
#[derive(Debug)]
pub struct Session {
    /// The boxery environment.
    pub env: Env,
    /// Whether tools may touch the local file system (false over HTTP: "local" would be the
    /// server's disk, not the agent's).
    pub allow_local: bool,
    /// Whose words errors use: the tools' (`vm_wait {…}`), or the CLI's when a command runs a
    /// tool (`boxery read`: `boxery wait vm …`).
    voice: Voice,
    default_vm: Mutex<Option<String>>,
    versions: Mutex<HashMap<(String, String), String>>,
    verbs: OnceLock<Verbs>,
    /// Leases this session keeps alive; dropping one (or the session) releases it.
    leases: Mutex<BTreeMap<String, lease::Kept>>,
    /// The MCP client of the session (set by each tool call), for asking its person
    /// (elicitation: `vm_grant`'s approval).
    peer: Mutex<Option<rmcp::Peer<rmcp::RoleServer>>>,
}

impl Session {
    /// A new session.
    pub fn new(env: Env, default_vm: Option<String>, allow_local: bool) -> Self {
        Session {
            env,
            allow_local,
            voice: Voice::Tool,
            default_vm: Mutex::new(default_vm),
            versions: Mutex::new(HashMap::new()),
            verbs: OnceLock::new(),
            leases: Mutex::new(BTreeMap::new()),
            peer: Mutex::new(None),
        }
    }

    /// Remember the MCP client this session talks to (each tool call does).
    pub fn set_peer(&self, peer: rmcp::Peer<rmcp::RoleServer>) {
        *self.peer.lock().expect("poisoned") = Some(peer);
    }

    /// The MCP client, when it can ask its person a question (it advertised elicitation).
    pub(crate) fn asker(&self) -> Option<rmcp::Peer<rmcp::RoleServer>> {
        self.peer.lock().expect("poisoned").clone().filter(|p| {
            p.peer_info()
                .is_some_and(|i| i.capabilities.elicitation.is_some())
        })
    }

    /// A session for one CLI command that runs a tool (`boxery file read|write|edit`, `jobs`):
    /// local files allowed, errors in the CLI's words.
    pub fn for_cli(env: Env) -> Self {
        let mut s = Session::new(env, None, true);
        s.voice = Voice::Cli;
        s
    }

    /// The session, working on `verbs`' store (another machine's, through a context) instead of
    /// opening its home's.
    pub fn with_verbs(self, verbs: &Verbs) -> Self {
        let _ = self.verbs.set(verbs.in_voice(self.voice));
        self
    }

    /// The verbs, in the session's voice, over the store (opened once per session).
    pub fn verbs(&self) -> Result<&Verbs, ToolError> {
        if let Some(v) = self.verbs.get() {
            return Ok(v);
        }
        let v = Verbs::open(self.env.clone(), self.voice)?;
        Ok(self.verbs.get_or_init(|| v))
    }

    /// The default VM.
    pub fn default_vm(&self) -> Option<String> {
        self.default_vm.lock().expect("poisoned").clone()
    }

    /// Set the default VM.
    pub fn set_default_vm(&self, vm: Option<String>) {
        *self.default_vm.lock().expect("poisoned") = vm;
    }

    /// Keep a lease alive for as long as this session lives (or until [`Session::let_go`]).
    pub(crate) fn keep(&self, name: &str, kept: lease::Kept) {
        let old = self
            .leases
            .lock()
            .expect("poisoned")
            .insert(name.to_string(), kept);
        drop(old);
    }

    /// Stop keeping a lease and release it (and its key pair here); false when this session
    /// did not hold it.
    pub fn let_go(&self, name: &str) -> bool {
        let k = self.leases.lock().expect("poisoned").remove(name);
        match k {
            Some(k) => {
                k.release();
                if let Ok(n) = boxery_api::Name::label(name) {
                    boxery_hands::keys::forget_key(&self.env.home, &n);
                }
                true
            }
            None => false,
        }
    }

    /// The leases this session keeps alive.
    pub fn held_leases(&self) -> Vec<String> {
        self.leases
            .lock()
            .expect("poisoned")
            .keys()
            .cloned()
            .collect()
    }

    /// The holder a lease of this session was acquired as.
    pub fn holder_of(&self, name: &str) -> Option<String> {
        self.leases
            .lock()
            .expect("poisoned")
            .get(name)
            .map(|k| k.holder.clone())
    }

    /// Release every lease this session holds (the session is ending); returns their names.
    /// Also happens when the session is dropped.
    pub fn release_leases(&self) -> Vec<String> {
        let all = std::mem::take(&mut *self.leases.lock().expect("poisoned"));
        let mut names = Vec::new();
        for (name, k) in all {
            tracing::info!(lease = %name, "the session ended: releasing its lease");
            k.release();
            if let Ok(n) = boxery_api::Name::label(&name) {
                boxery_hands::keys::forget_key(&self.env.home, &n);
            }
            names.push(name);
        }
        names
    }

    /// Release every lease this session holds and give the controllers (in this process, or a
    /// `serve`) up to `grace` to let them go, so their VMs head back to their pools now rather
    /// than when a control plane next runs.
    pub async fn end(&self, grace: std::time::Duration) {
        let names = self.release_leases();
        // A session that holds no lease has nothing to wait for; and one that never opened
        // the store holds none. Opening it here would create the home again after it was
        // removed (a test's temporary home, a user's `rm -rf`).
        if names.is_empty() {
            return;
        }
        let Some(verbs) = self.verbs.get() else {
            return;
        };
        let deadline = tokio::time::Instant::now() + grace;
        while tokio::time::Instant::now() < deadline {
            let mut left = false;
            for n in &names {
                let key = boxery_store::ObjectRef::new("Lease", n.clone());
                left |= matches!(verbs.store().get(&key).await, Ok(Some(_)));
            }
            if !left {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// The version of a file this session last saw.
    pub fn seen(&self, vm: &str, path: &str) -> Option<String> {
        self.versions
            .lock()
            .expect("poisoned")
            .get(&(vm.to_string(), path.to_string()))
            .cloned()
    }

    /// Remember the version of a file.
    pub fn saw(&self, vm: &str, path: &str, version: &str) {
        self.versions
            .lock()
            .expect("poisoned")
            .insert((vm.to_string(), path.to_string()), version.to_string());
    }

    /// The VMs there are (none when the store cannot be read: this only words an error).
    async fn vm_names(&self) -> Vec<String> {
        let Ok(v) = self.verbs() else {
            return Vec::new();
        };
        v.store()
            .list(<Vm as boxery_api::Resource>::INFO.kind, &Default::default())
            .await
            .map(|(objs, _)| objs.into_iter().map(|o| o.metadata.name).collect())
            .unwrap_or_default()
    }

    /// Which VM a call means: the explicit one, else the default, else the only VM.
    pub async fn resolve_vm(&self, vm: Option<String>) -> Result<String, ToolError> {
        if let Some(v) = vm {
            // an empty name is refused (check_args, and Name here), never the default VM
            return boxery_api::Name::label(&v)
                .map(boxery_api::Name::into_string)
                .map_err(|e| ToolError::Invalid(format!("vm: {e}")));
        }
        if let Some(v) = self.default_vm() {
            return Ok(v);
        }
        let mut names = self.vm_names().await;
        names.truncate(30);
        match names.as_slice() {
            [one] => Ok(one.clone()),
            [] => Err(ToolError::NotFound(
                "no VM named and there are no VMs: make one with vm_manage {action: new, vm: NAME} or vm_apply".into(),
            )),
            many => Err(ToolError::Invalid(format!(
                "which VM? name one with `vm`, or set a default with vm_use; known VMs: {}",
                many.join(", ")
            ))),
        }
    }

    /// A not-found error that lists the known VMs.
    pub async fn unknown_vm(&self, vm: &str) -> ToolError {
        boxery_hands::vm_not_found(vm, &self.vm_names().await, self.voice).into()
    }

    /// Check the VM can be reached over ssh and write the ssh files; returns how to reach it
    /// (with the key of a lease this host holds on it, like `boxery run`).
    pub(crate) async fn ssh_to(&self, vm: &str) -> Result<Reach, ToolError> {
        Ok(self.verbs()?.reach(vm).await?)
    }
}

impl Drop for Session {
    /// A session that goes away (an HTTP session deleted or idled out) releases its leases.
    fn drop(&mut self) {
        self.release_leases();
    }
}

/// Run a tool from the CLI on `verbs`' store: print its text (stdout) and map its error to an
/// exit code.
pub async fn run_cli(verbs: &Verbs, name: &str, args: Value) -> Result<Output, ToolError> {
    let t = find(name).expect("the CLI only runs tools of the table");
    let session = Arc::new(Session::for_cli(verbs.env.clone()).with_verbs(verbs));
    t.run(session, args, CancellationToken::new()).await
}

/// The tool list as markdown (the table in docs/mcp.md is this text).
pub fn markdown() -> String {
    let mut s = String::from("| tool | annotations | CLI | what it does |\n|---|---|---|---|\n");
    for t in tools() {
        let ann = match (t.read_only, t.destructive) {
            (true, _) => "read-only",
            (false, true) => "destructive",
            (false, false) => "writes",
        };
        let cli = match t.cli {
            CliSide::Commands(c) => c
                .iter()
                .map(|c| format!("`boxery {c}`"))
                .collect::<Vec<_>>()
                .join(", "),
            CliSide::None(why) => format!("none: {why}"),
        };
        s.push_str(&format!(
            "| `{}` | {ann} | {cli} | {} |\n",
            t.name,
            t.description.replace('|', "\\|")
        ));
    }
    s
}

/// Clamp a user-given timeout.
pub fn clamp_timeout(secs: Option<u64>, default: u64) -> std::time::Duration {
    std::time::Duration::from_secs(secs.unwrap_or(default).clamp(1, MAX_WAIT_SECS))
}

/// Whether a process group has live (non-zombie) members, polling for up to 2 s.
#[cfg(test)]
pub fn group_alive(pgid: u32) -> bool {
    for _ in 0..40 {
        let live = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
            .any(|st| {
                let rest = st.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
                let f: Vec<&str> = rest.split_whitespace().collect();
                f.len() > 3 && f[0] != "Z" && f[2] == pgid.to_string()
            });
        if !live {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemas_are_objects_and_names_unique() {
        let mut names = std::collections::BTreeSet::new();
        for t in tools() {
            assert!(names.insert(t.name), "{} twice", t.name);
            assert_eq!(t.schema["type"], "object", "{}: {}", t.name, t.schema);
            assert!(t.name.starts_with("vm_"));
            assert!(!(t.read_only && t.destructive), "{}", t.name);
        }
    }

    #[test]
    fn oversized_arguments_are_refused() {
        let big = "x".repeat(STRING_CAP + 1);
        let e = check_args(&serde_json::json!({"command": big})).unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
        assert!(check_args(&serde_json::json!({"content": "x".repeat(STRING_CAP + 1)})).is_ok());
    }

    #[test]
    fn empty_and_blank_arguments_are_refused_for_every_tool() {
        for blank in ["", "  ", "\t\n"] {
            for args in [
                serde_json::json!({"vm": blank}),
                serde_json::json!({"name": blank, "kind": "vm"}),
                serde_json::json!({"names": ["ok", blank]}),
                serde_json::json!({"action": "release", "lease": blank}),
            ] {
                let e = check_args(&args).unwrap_err();
                assert!(matches!(e, ToolError::Invalid(_)), "{args}: {e}");
                assert!(e.to_string().contains("empty or blank"), "{args}: {e}");
            }
        }
        // What may be empty: a file's content, a replacement, an argument of a command.
        assert!(check_args(&serde_json::json!({"vm": "a", "path": "/x", "content": ""})).is_ok());
        assert!(check_args(&serde_json::json!({"old": "x", "new": ""})).is_ok());
        assert!(check_args(&serde_json::json!({"from_command": ["printf", ""]})).is_ok());
    }

    #[test]
    fn docs_list_every_tool() {
        let doc = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/mcp.md"),
        )
        .unwrap();
        assert!(
            doc.contains(&markdown()),
            "docs/mcp.md's tool table is out of date: paste the output of `boxery mcp --tools-markdown`"
        );
    }
}

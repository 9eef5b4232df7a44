//! boxery's MCP server and its `vm_*` tool table: every tool's name, description, input JSON
//! Schema (generated from the Rust argument type by schemars), annotations and runner, in one
//! place. The server ([`server`]: stdio and streamable HTTP) lists and runs tools from it; the
//! CLI's parity test maps every tool to its CLI command and back. A runner is a thin adapter:
//! it parses its arguments, chooses the VM (the session's default), calls one verb
//! (`boxery-verbs`: the guest actions are `boxery_verbs::guest`, the same calls the CLI makes)
//! and renders its typed result as a tool result.
//!
//! Guarantees: a runner never prints to stdout (stdout is the MCP stdio transport), never
//! waits without a bound, and fails with the verbs' [`VerbError`], whose message a model can
//! act on.

pub mod browser;
pub mod computer;
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
use boxery_hands::Voice;
use boxery_verbs::{Env, VerbError, Verbs};
use futures::future::BoxFuture;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// The cap on text a tool returns (command output, file contents, job logs): 1 MiB.
pub use boxery_verbs::guest::OUTPUT_CAP;
/// The cap on a tool call's arguments, serialized (a `vm_write` content included): 8 MiB.
pub const ARGS_CAP: usize = 8 << 20;
/// The cap on any one string argument other than file content and manifests: 64 KiB.
pub const STRING_CAP: usize = 64 << 10;
/// The longest a tool may wait (`timeout_seconds` is clamped to this): 30 minutes.
pub use boxery_verbs::guest::MAX_WAIT_SECS;
/// Clamp a user-given timeout.
pub use boxery_verbs::guest::clamp_timeout;

/// What a tool returns: text for the model, and the same facts as JSON.
#[derive(Debug, Clone, Default)]
pub struct Output {
    /// Human- and model-readable text.
    pub text: String,
    /// Structured result (`structuredContent` in MCP), when there is one.
    pub data: Option<Value>,
    /// A PNG picture after the text (`vm_computer`'s screenshots), sent as image content.
    pub png: Option<Vec<u8>>,
}

impl Output {
    /// Text and data.
    pub fn with_data(text: impl Into<String>, data: Value) -> Self {
        Output {
            text: text.into(),
            data: Some(data),
            png: None,
        }
    }

    /// Text, and a verb's typed result as the data.
    pub fn of(text: impl Into<String>, result: &impl serde::Serialize) -> Self {
        // the verbs' results are plain data: they always serialize
        Output::with_data(text, serde_json::to_value(result).unwrap_or_default())
    }
}

/// The result of a runner: its failure is the verbs' error, shown to the model whole
/// ([`VerbError::chain`]); its kind is what the CLI's exit code would be.
pub type ToolResult = Result<Output, VerbError>;

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
        // Unknown arguments are refused (`Tool::run`), flattened argument types included.
        m.insert("additionalProperties".into(), Value::Bool(false));
    }
    v
}

/// The argument names a schema lists, for serde's "unknown field" message.
fn fields_of(schema: &Value) -> &'static [&'static str] {
    let names = schema["properties"].as_object().into_iter().flatten();
    let names: Vec<&'static str> = names.map(|(k, _)| &*k.clone().leak()).collect();
    names.leak()
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
    let schema = schema_of::<A>();
    let fields = fields_of(&schema);
    Tool {
        name,
        description,
        read_only,
        destructive,
        cli,
        schema,
        run: Box::new(move |s, args, ct| match parse::<A>(name, fields, args) {
            Ok(a) => Box::pin(f(s, a, ct)),
            Err(e) => Box::pin(async move { Err(e) }),
        }),
    }
}

/// Tool `name`'s arguments, checked (sizes, blanks) and parsed; an argument not among
/// `fields` is refused.
fn parse<A: DeserializeOwned>(
    name: &str,
    fields: &'static [&'static str],
    args: Value,
) -> Result<A, VerbError> {
    check_args(&args)?;
    let unknown = args
        .as_object()
        .and_then(|m| m.keys().find(|k| !fields.contains(&k.as_str())).cloned());
    let parsed = serde_json::from_value::<A>(args).and_then(|a| match unknown {
        // serde refuses these itself, but not beside a flattened struct
        Some(k) => Err(serde::de::Error::unknown_field(&k, fields)),
        None => Ok(a),
    });
    parsed.map_err(|e| {
        VerbError::invalid(format!(
            "invalid arguments for {name}: {e}; the tool's input schema lists the fields"
        ))
    })
}

/// Refuse arguments over the size bounds.
fn check_args(args: &Value) -> Result<(), VerbError> {
    let size = serde_json::to_vec(args)
        .map(|v| v.len())
        .unwrap_or(usize::MAX);
    if size > ARGS_CAP {
        return Err(VerbError::invalid(format!(
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
                return Err(VerbError::invalid(format!(
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
fn refuse_blank(k: &str, v: &Value) -> Result<(), VerbError> {
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
    Err(VerbError::invalid(format!(
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
                "VM verbs that write specs and wait (bounded) for the result: new (make a VM from an image), snap (snapshot the disk into image VM.LABEL; with_memory: true also its memory, of a running VM), revert (back to a snapshot; with_memory: true comes back running where the snapshot was taken), fork (new VMs from this VM's disk; with_memory: true they continue from this instant of the running VM, processes and all, each with its own identity), start, stop, suspend (memory to disk, host RAM freed), resume (the same processes back in about a second), resize, rm. Returns the current state even when the wait runs out.",
                destructive,
                CliSide::Commands(&[
                    "new", "snap", "revert", "fork", "start", "stop", "suspend", "resume", "resize",
                    "rm",
                ]),
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
                "Ask for a credential for a VM (default: this session's VM) or a lease's VM: request (grant: llm:PROVIDER, http:HOST with header, github:OWNER/REPO, env:NAME, file:PATH, or ssh-agent:all (or ssh-agent:SHA256:… key fingerprints) with from_file naming the owner's agent socket; and where the control plane reads the value: from_env, from_file or from_command — never the value itself), list, revoke. A request is PendingApproval and NOT in force until a person approves it: in this MCP client when it supports elicitation (the person is asked; this call waits for the answer, at most 10 minutes), else by running `boxery grant approve NAME` in a terminal. No tool argument can approve. Once Applied, the control plane's credential proxy adds the real value to the VM's llm, http and github calls (the value never enters the VM), env and file grants are pushed into the VM's tmpfs (/run/boxery), and an ssh-agent grant's agent is forwarded to $SSH_AUTH_SOCK (the VM can sign with its keys, never read them).",
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
                "vm_prompt",
                "Delegate a task to a coding agent inside the VM: run it headless on a prompt (claude -p by default; agent: codex or opencode) as user agent in its home, and return its output and exit code. The VM needs the agents layer (an Image built with layers: [agents]) and an llm grant for the agent's provider (vm_grant llm:anthropic or llm:openai): the agent reaches its model through boxery's credential proxy, never holding the key. The VM is its sandbox: the agent's own approval prompts are off. Bounded by timeout_seconds (default 600); on timeout or cancel everything it started is killed.",
                destructive,
                CliSide::Commands(&["prompt"]),
                exec::prompt,
            ),
            tool(
                "vm_computer",
                "See and drive the VM's screen, with the computer-use actions: screenshot (returned as an image), left_click, right_click, middle_click, double_click, triple_click (at coordinate [x, y], or where the pointer is; text: modifiers held, e.g. shift), mouse_move, left_click_drag (start_coordinate to coordinate), type (text; newline is Return), key (text: xdotool key names, e.g. ctrl+s, Return, or several separated by spaces), scroll (scroll_direction, scroll_amount, at coordinate), cursor_position, wait (duration seconds, then a screenshot). Coordinates are pixels of the last screenshot (scaled for you: at most 1280×800 or 1366×768). A VM made with the desktop layer shows its desktop (X display :0: windows, a terminal, any app started there with DISPLAY=:0); any other VM shows its text console (keys only, ASCII text). console: true shows the hypervisor's screen even for a desktop VM (a guest stuck at boot). A bad action (off-screen coordinate, unknown key, control characters in text) is refused and sends nothing.",
                destructive,
                CliSide::Commands(&["computer", "screenshot"]),
                computer::computer,
            ),
            tool(
                "vm_browser",
                "Drive the VM's web browser (Chromium, on its desktop; the VM needs the browser layer: layers: [browser]): open (url: http, https or about:blank; waits for the page to load and returns its address, HTTP status, title and text), read (the current page), click (selector: a CSS selector; the first element it matches is clicked as a mouse would), fill (selector and text: the field's text replaced, as typed; no text clears it), evaluate (expression: JavaScript run in the page, its value returned as JSON; a promise is awaited), screenshot (the viewport, returned as an image). The browser goes out through the VM's egress policy: an http site the policy refuses comes back as HTTP 403 from boxery's proxy with the reason, an https one as net::ERR_TUNNEL_CONNECTION_FAILED followed by the proxy's reason. Every action acts on the same tab; a script still running at the action's time is stopped. A page served inside the VM is at http://127.0.0.1:PORT/. Bounded by timeout_seconds (default 180, at most 300): the first action starts the browser, which takes a minute or two under emulation; a call that runs out of time leaves it starting, so the next one finds it.",
                destructive,
                CliSide::Commands(&["browser"]),
                browser::browser,
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

    /// The session, working on `verbs`' store (another machine's, through a context) instead of
    /// opening its home's.
    pub fn with_verbs(self, verbs: &Verbs) -> Self {
        let _ = self.verbs.set(verbs.in_voice(Voice::Tool));
        self
    }

    /// The verbs, in the tools' voice, over the store (opened once per session).
    pub fn verbs(&self) -> Result<&Verbs, VerbError> {
        if let Some(v) = self.verbs.get() {
            return Ok(v);
        }
        let v = Verbs::open(self.env.clone(), Voice::Tool)?;
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
                left |= matches!(verbs.exists(&key).await, Ok(true));
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
        v.names(<Vm as boxery_api::Resource>::INFO.kind)
            .await
            .unwrap_or_default()
    }

    /// Which VM a call means: the explicit one, else the default, else the only VM.
    pub async fn resolve_vm(&self, vm: Option<String>) -> Result<String, VerbError> {
        if let Some(v) = vm {
            // an empty name is refused (check_args, and Name here), never the default VM
            return boxery_api::Name::label(&v)
                .map(boxery_api::Name::into_string)
                .map_err(|e| VerbError::invalid(format!("vm: {e}")));
        }
        if let Some(v) = self.default_vm() {
            return Ok(v);
        }
        let mut names = self.vm_names().await;
        names.truncate(30);
        match names.as_slice() {
            [one] => Ok(one.clone()),
            [] => Err(VerbError::not_found(
                "no VM named and there are no VMs: make one with vm_manage {action: new, vm: NAME} or vm_apply",
            )),
            many => Err(VerbError::invalid(format!(
                "which VM? name one with `vm`, or set a default with vm_use; known VMs: {}",
                many.join(", ")
            ))),
        }
    }

    /// A not-found error that lists the known VMs.
    pub async fn unknown_vm(&self, vm: &str) -> VerbError {
        boxery_hands::vm_not_found(vm, &self.vm_names().await, Voice::Tool).into()
    }
}

impl Drop for Session {
    /// A session that goes away (an HTTP session deleted or idled out) releases its leases.
    fn drop(&mut self) {
        self.release_leases();
    }
}

/// Objects of a kind as `boxery get`'s table, or `none` when there are none: a list's text.
pub(crate) fn table(
    kind: &str,
    objs: &[boxery_api::DynObject],
    none: &str,
) -> Result<String, VerbError> {
    if objs.is_empty() {
        return Ok(none.to_string());
    }
    let info = boxery_verbs::objects::kind(kind)?;
    let mut out = Vec::new();
    let table = boxery_verbs::render::Format::Table;
    // Never a table of none (said above, in the tool's words), so there is no note to add.
    let _written = boxery_verbs::render::print(info, objs, &table, &mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
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
    fn unknown_arguments_are_refused_beside_flattened_ones_too() {
        for t in ["vm_wait", "vm_describe", "vm_patch", "vm_read"] {
            let schema = &find(t).unwrap().schema;
            assert_eq!(schema["additionalProperties"], false, "{t}: {schema}");
            assert!(
                schema["properties"]["kind"].is_object() || t == "vm_read",
                "{t}"
            );
        }
        let fields = fields_of(&find("vm_wait").unwrap().schema);
        let args = serde_json::json!({"name": "a", "timeout_seconds": 1, "nope": 1});
        let e = parse::<lifecycle::WaitArgs>("vm_wait", fields, args).unwrap_err();
        assert_eq!(e.kind(), boxery_verbs::ErrorKind::Invalid, "{e}");
        assert!(e.to_string().contains("unknown field `nope`"), "{e}");
        let ok = serde_json::json!({"name": "a", "for": "delete"});
        let a = parse::<lifecycle::WaitArgs>("vm_wait", fields, ok).unwrap();
        assert_eq!(a.object.name.as_deref(), Some("a"));
    }

    /// A value `schema` accepts (of a required argument), `$ref`s resolved in `root`.
    fn sample(root: &Value, schema: &Value) -> Value {
        if let Some(r) = schema["$ref"].as_str() {
            let def = r.rsplit('/').next().unwrap();
            return sample(root, &root["$defs"][def]);
        }
        if let Some(e) = schema["enum"].as_array() {
            return e[0].clone();
        }
        if let Some(c) = schema["const"].as_str() {
            return Value::from(c);
        }
        if let Some(one) = schema["oneOf"].as_array().or(schema["anyOf"].as_array()) {
            return sample(root, &one[0]);
        }
        match &schema["type"] {
            Value::String(t) if t == "string" => Value::from("a"),
            Value::String(t) if t == "integer" => Value::from(1),
            Value::String(t) if t == "boolean" => Value::from(true),
            Value::String(t) if t == "array" => serde_json::json!(["a"]),
            t => panic!("no sample for {t}: {schema}"),
        }
    }

    /// `vm_manage`'s `with_memory` is refused, before anything is done, by an action that does
    /// not take it (it is not dropped silently), and taken by snap (and revert and fork).
    #[tokio::test]
    async fn with_memory_is_refused_where_it_means_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let env = boxery_verbs::Env::new(dir.path().join("home"), "fake");
        let session = Arc::new(Session::new(env, None, false));
        let manage = tools().iter().find(|t| t.name == "vm_manage").unwrap();
        for action in ["start", "stop", "suspend", "rm"] {
            let e = manage
                .run(
                    session.clone(),
                    serde_json::json!({"action": action, "vm": "a", "with_memory": true}),
                    CancellationToken::new(),
                )
                .await
                .err()
                .unwrap_or_else(|| panic!("{action}: ran"));
            assert_eq!(e.kind(), boxery_verbs::ErrorKind::Invalid, "{action}: {e}");
            assert!(e.to_string().contains("with_memory"), "{action}: {e}");
        }
        // snap takes it: what stops it here is the VM that is not there
        let e = manage
            .run(
                session.clone(),
                serde_json::json!({"action": "snap", "vm": "a", "label": "s", "with_memory": true}),
                CancellationToken::new(),
            )
            .await
            .err()
            .unwrap();
        assert!(!e.to_string().contains("with_memory"), "{e}");
    }

    /// Every tool refuses an argument its schema does not list, before it runs, whether its
    /// argument type flattens another (serde does not refuse those) or not.
    #[tokio::test]
    async fn every_tool_refuses_unknown_arguments() {
        let dir = tempfile::tempdir().unwrap();
        let env = boxery_verbs::Env::new(dir.path().join("home"), "fake");
        let session = Arc::new(Session::new(env, None, false));
        for t in tools() {
            let mut args = serde_json::Map::new();
            for r in t.schema["required"].as_array().into_iter().flatten() {
                let r = r.as_str().unwrap();
                let value = sample(&t.schema, &t.schema["properties"][r]);
                args.insert(r.to_string(), value);
            }
            let known = args.clone();
            args.insert("zz_unknown".into(), Value::from(1));
            let r = t.run(
                session.clone(),
                Value::Object(args),
                CancellationToken::new(),
            );
            let e = r.await.err().unwrap_or_else(|| panic!("{}: ran", t.name));
            assert_eq!(
                e.kind(),
                boxery_verbs::ErrorKind::Invalid,
                "{}: {e}",
                t.name
            );
            assert!(
                e.to_string().contains("unknown field `zz_unknown`"),
                "{}: {e}",
                t.name
            );
            // the control: without it, the same arguments parse (whatever the tool then says)
            let r = t.run(
                session.clone(),
                Value::Object(known),
                CancellationToken::new(),
            );
            if let Err(e) = r.await {
                assert!(
                    !e.to_string().contains("invalid arguments for"),
                    "{}: {e}",
                    t.name
                );
            }
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
                assert_eq!(e.kind(), boxery_verbs::ErrorKind::Invalid, "{args}: {e}");
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

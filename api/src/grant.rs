//! `Grant`: a human-approved credential route for a VM (or a lease's VM). The Grant reconciler
//! (`reconcilers/src/grant.rs`) applies it once a person approved its current generation;
//! the value itself never enters the store (`valueFrom` names where it comes from).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::columns::{self, Cell, Column};
use crate::meta::{Condition, Time};
use crate::resource::{ForceDelete, KindInfo, Settled, Typed, impl_resource, resource};

resource!(
    /// A credential a VM may use, approved by a person; the value never enters the store.
    Grant, GrantSpec, GrantStatus
);
impl_resource!(
    Grant,
    KindInfo {
        kind: "Grant",
        plural: "grants",
        singular: "grant",
        short_names: &["grant"],
        dotted_names: false,
        description: "A credential route for one VM or lease (llm, http, env, file, github, ssh-agent), applied only after a person approves it (`boxery grant approve NAME`, in a terminal); a spec change needs approval again. The value never enters the store: valueFrom names where the control plane reads it.",
        controllers_only: None,
        columns: &[
            columns::NAME,
            Column::new("STATUS", Cell::FieldOr("/status/phase", "PendingApproval")),
            Column::new(
                "VM",
                Cell::Computed(&["/status/vm", "/spec/vm"], |v| {
                    columns::text(if v[0].is_null() { v[1] } else { v[0] })
                }),
            ),
            Column::new("LEASE", Cell::Field("/spec/lease")),
            Column::new("TYPE", Cell::Field("/spec/type")),
            Column::new("TARGET", Cell::Field("/spec/target")),
            Column::wide(
                "VALUE FROM",
                Cell::Computed(&["/spec/valueFrom"], |v| match v[0].as_object() {
                    Some(m) => m
                        .iter()
                        .map(|(k, v)| match v.as_array() {
                            Some(a) => {
                                let words: Vec<String> = a.iter().map(columns::text).collect();
                                format!("{k}:{}", words.join(" "))
                            }
                            None => format!("{k}:{}", columns::text(v)),
                        })
                        .collect::<Vec<_>>()
                        .join(","),
                    None => "<none>".into(),
                }),
            ),
            Column::wide("APPROVED BY", Cell::Field("/status/approvedBy")),
            columns::AGE,
        ],
        settled: |_| &[Settled::Observed],
        force_delete: ForceDelete::GrantState,
        immutable: &[],
        typed: Typed::of::<Grant>(),
    },
    normalize = normalize_grant
);

/// Check what the schema cannot: exactly one of `vm` and `lease`, names, the target's form for
/// its type, the header (`http` only), and `valueFrom`'s form.
fn normalize_grant(grant: &mut Grant) -> Result<(), Vec<crate::validate::FieldError>> {
    use crate::validate::FieldError;
    let mut errs = Vec::new();
    let spec = &grant.spec;
    match (&spec.vm, &spec.lease) {
        (Some(_), Some(_)) => errs.push(FieldError::new(
            "spec",
            "name either `vm` or `lease`, not both".into(),
        )),
        (None, None) => errs.push(FieldError::new(
            "spec",
            "name the VM (`vm`) or the lease (`lease`) the grant is for".into(),
        )),
        _ => {}
    }
    for (field, v) in [("spec.vm", &spec.vm), ("spec.lease", &spec.lease)] {
        if let Some(n) = v
            && let Err(e) = crate::name::check_label_name(n)
        {
            errs.push(FieldError::new(field, e));
        }
    }
    if let Err(e) = check_target(spec.type_, &spec.target) {
        errs.push(FieldError::new("spec.target", e));
    }
    match (&spec.header, spec.type_) {
        (None, GrantType::Http) => errs.push(FieldError::new(
            "spec.header",
            "an http grant names the header it adds (e.g. Authorization)".into(),
        )),
        (Some(h), GrantType::Http) => {
            if let Err(e) = check_header(h) {
                errs.push(FieldError::new("spec.header", e));
            }
        }
        (Some(_), _) => errs.push(FieldError::new(
            "spec.header",
            "only http grants name a header".into(),
        )),
        (None, _) => {}
    }
    if let Some(l) = &spec.limits {
        if spec.type_ != GrantType::Llm {
            errs.push(FieldError::new(
                "spec.limits",
                "only llm grants have limits (tokens, requests and dollars of a provider)".into(),
            ));
        }
        if l.dollars_per_month
            .is_some_and(|d| !d.is_finite() || d < 0.0)
        {
            errs.push(FieldError::new(
                "spec.limits.dollarsPerMonth",
                "a number of dollars, 0 or more".into(),
            ));
        }
    }
    if let Err(e) = check_value_from(&spec.value_from) {
        errs.push(FieldError::new("spec.valueFrom", e));
    } else if spec.type_ == GrantType::SshAgent
        && let Err(e) = check_agent_socket(&spec.value_from)
    {
        errs.push(FieldError::new("spec.valueFrom", e));
    }
    if errs.is_empty() { Ok(()) } else { Err(errs) }
}

/// Whether `name` is an environment variable name (`[A-Za-z_][A-Za-z0-9_]*`, at most 255).
pub fn check_env_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let ok = name.len() <= 255
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{}` is not an environment variable name: letters, digits and _, not starting with a digit",
            crate::name::shown(name)
        ))
    }
}

/// Whether `h` is an HTTP header name (RFC 9110 token characters, at most 128).
pub fn check_header(h: &str) -> Result<(), String> {
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if h.is_empty() || h.len() > 128 || !h.chars().all(token) {
        return Err(format!(
            "`{}` is not an HTTP header name",
            crate::name::shown(h)
        ));
    }
    Ok(())
}

/// Where an `ssh-agent` grant's agent is in the guest (`SSH_AUTH_SOCK`).
pub const AGENT_GUEST_SOCK: &str = "/run/boxery/ssh-agent.sock";

/// The most keys an `ssh-agent` grant names by fingerprint.
pub const MAX_AGENT_KEYS: usize = 16;

/// An `ssh-agent` grant's target that lets the guest use every key the agent holds.
pub const ALL_KEYS: &str = "all";

/// Which keys of the agent an `ssh-agent` grant's target lets the guest use: `None` for
/// [`ALL_KEYS`], else the fingerprints (`SHA256:` and 43 characters of unpadded base64, as
/// `ssh-add -l` prints them). `Err` when the target is neither.
pub fn agent_keys(target: &str) -> Result<Option<Vec<String>>, String> {
    if target == ALL_KEYS {
        return Ok(None);
    }
    let b64 = |c: char| c.is_ascii_alphanumeric() || c == '+' || c == '/';
    let mut keys = Vec::new();
    for fp in target.split(',') {
        let ok = fp
            .strip_prefix("SHA256:")
            .is_some_and(|h| h.len() == 43 && h.chars().all(b64));
        if !ok {
            return Err(format!(
                "`{}` is not `all` or a comma-separated list of key fingerprints as `ssh-add -l` prints them (SHA256:…, 43 characters after the colon)",
                crate::name::shown(target)
            ));
        }
        if !keys.iter().any(|k| k == fp) {
            keys.push(fp.to_string());
        }
    }
    if keys.len() > MAX_AGENT_KEYS {
        return Err(format!(
            "an ssh-agent grant names at most {MAX_AGENT_KEYS} keys"
        ));
    }
    Ok(Some(keys))
}

/// Where an `ssh-agent` grant's agent is: its socket on the control plane, named by a
/// variable of the control plane's environment (`{env: SSH_AUTH_SOCK}`) or as an absolute
/// path of plain components (`{file: /run/user/1000/ssh-agent.socket}`: no `.`, `..` or empty
/// component, so the path shown at approval is the one used). Never a command: an agent is a
/// socket, not a value.
pub fn check_agent_socket(v: &ValueFrom) -> Result<(), String> {
    match v {
        ValueFrom::Env(_) => Ok(()),
        ValueFrom::File(path) => {
            let plain = path.len() <= 4096
                && path.starts_with('/')
                && path[1..]
                    .split('/')
                    .all(|c| !c.is_empty() && c != "." && c != "..");
            plain.then_some(()).ok_or_else(|| {
                format!(
                    "`{}` is not an absolute path of plain names (no `.`, `..` or `//`): name the agent's socket as `ssh-add -l` finds it in $SSH_AUTH_SOCK",
                    crate::name::shown(path)
                )
            })
        }
        ValueFrom::Command(_) => Err(
            "an ssh-agent grant names the agent's socket (file: PATH, or env: SSH_AUTH_SOCK), not a command"
                .into(),
        ),
    }
}

/// The form of a target for its type: a provider name (`llm`), a host name with an optional
/// port (`http`), a variable name (`env`), a relative path of plain components (`file`: where
/// the file goes under the guest's grant directory), `OWNER/REPO` (`github`), `all` or key
/// fingerprints (`ssh-agent`: [`agent_keys`]).
pub fn check_target(type_: GrantType, target: &str) -> Result<(), String> {
    crate::name::check_text(target, 2048)?;
    let shown = crate::name::shown(target);
    let host_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    match type_ {
        GrantType::Llm => crate::name::check_label_name(target)
            .map_err(|_| format!("`{shown}` is not a provider name (e.g. anthropic, openai)")),
        GrantType::Http => {
            let (host, port) = target.split_once(':').unwrap_or((target, "1"));
            let ok = !host.is_empty()
                && host.len() <= 253
                && host.chars().all(host_char)
                && !host.starts_with(['-', '.'])
                && !host.ends_with(['-', '.'])
                && !host.contains("..")
                && port.parse::<u16>().is_ok_and(|p| p > 0);
            if ok {
                Ok(())
            } else {
                Err(format!(
                    "`{shown}` is not a host name (lowercase, e.g. api.example.com or registry.example.com:8443)"
                ))
            }
        }
        GrantType::Env => check_env_name(target),
        GrantType::File => {
            let ok = !target.is_empty()
                && !target.starts_with('/')
                && target
                    .split('/')
                    .all(|c| !c.is_empty() && c != "." && c != ".." && !c.starts_with('-'))
                && target.len() <= 1024;
            if ok {
                Ok(())
            } else {
                Err(format!(
                    "`{shown}` is not a relative path of plain names (e.g. npmrc or aws/credentials): it names where the file goes under the guest's grant directory"
                ))
            }
        }
        GrantType::Github => {
            let part = |s: &str, dots: bool| {
                !s.is_empty()
                    && s.len() <= 100
                    && !s.starts_with('.')
                    && s.chars().all(|c| {
                        c.is_ascii_alphanumeric() || c == '-' || c == '_' || (dots && c == '.')
                    })
            };
            match target.split_once('/') {
                Some((owner, repo)) if part(owner, false) && part(repo, true) => Ok(()),
                _ => Err(format!("`{shown}` is not a repository: write OWNER/REPO")),
            }
        }
        GrantType::SshAgent => agent_keys(target).map(drop),
    }
}

/// The form of `valueFrom`: an environment variable name, an absolute file path, or a command
/// whose first word is a program (an absolute path, or a name looked up in `PATH`).
pub fn check_value_from(v: &ValueFrom) -> Result<(), String> {
    match v {
        ValueFrom::Env(name) => check_env_name(name),
        ValueFrom::File(path) => {
            crate::name::check_text(path, 4096)?;
            if !path.starts_with('/') {
                return Err(format!(
                    "file `{}` is not an absolute path",
                    crate::name::shown(path)
                ));
            }
            Ok(())
        }
        ValueFrom::Command(argv) => {
            let Some(program) = argv.first() else {
                return Err("command is empty: give the program and its arguments".into());
            };
            if program.is_empty() || program.starts_with('-') {
                return Err(format!(
                    "`{}` is not a program",
                    crate::name::shown(program)
                ));
            }
            if argv.len() > 64 {
                return Err("command has more than 64 words".into());
            }
            for a in argv {
                crate::name::check_text(a, 4096)?;
            }
            Ok(())
        }
    }
}

/// The desired state of a grant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrantSpec {
    /// The VM it is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<String>,
    /// Or the lease it is for (revoked when the lease ends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<String>,
    /// What kind of credential.
    #[serde(rename = "type")]
    pub type_: GrantType,
    /// What it grants: a provider (`llm`), a host (`http`), a variable name (`env`), a path
    /// (`file`), a repository (`github`), the keys of an agent (`ssh-agent`: `all`, or
    /// fingerprints `SHA256:…` separated by commas).
    pub target: String,
    /// `http` only: the header the proxy adds to requests to that host (e.g. `Authorization`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Where the value comes from on the control plane (never the value itself); for
    /// `ssh-agent`, the agent's socket there.
    pub value_from: ValueFrom,
    /// `llm` only: what the grant may use; past a limit the proxy answers 429 and the
    /// provider sees nothing. Part of what a person approves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<GrantLimits>,
}

/// The limits of an `llm` grant (docs/grants.md, "Limits"). Days and months are UTC.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrantLimits {
    /// Input and output tokens per UTC day.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub tokens_per_day: Option<u64>,
    /// Requests in any 60 seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub requests_per_minute: Option<u32>,
    /// Dollars per UTC month, at the prices of `proxy: {prices: …}` in config.yaml (a model
    /// with no price counts nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0))]
    pub dollars_per_month: Option<f64>,
}

/// Kinds of grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum GrantType {
    /// An LLM provider through the proxy.
    #[serde(rename = "llm")]
    Llm,
    /// Headers added to HTTP requests to one host.
    #[serde(rename = "http")]
    Http,
    /// An environment variable pushed to tmpfs.
    #[serde(rename = "env")]
    Env,
    /// A file pushed to tmpfs.
    #[serde(rename = "file")]
    File,
    /// A GitHub repository token.
    #[serde(rename = "github")]
    Github,
    /// The owner's ssh-agent (some or all of its keys), forwarded into the guest: the guest
    /// can sign with those keys while the grant is in force, never read them.
    #[serde(rename = "ssh-agent")]
    SshAgent,
}

/// Where a secret's value comes from: exactly one of `env`, `file`, `command`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum ValueFrom {
    /// The control plane's environment variable.
    Env(String),
    /// A file on the control plane.
    File(String),
    /// A command whose stdout is the value.
    Command(Vec<String>),
}

/// A grant's phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum GrantPhase {
    /// Waiting for a person's approval of the current generation (or, approved, for its value
    /// to be readable by the control plane: see the `Ready` condition).
    #[default]
    PendingApproval,
    /// Approved for the current generation and in force.
    Applied,
    /// Refused by a person (for the current generation; a spec change asks again).
    Denied,
    /// Its VM or lease is gone (or ended): final. Make a new grant for a new VM or lease.
    Revoked,
}

/// The observed state of a grant. Written only by the Grant reconciler and by the approval
/// path (`boxery grant approve|deny`): `apply` never writes status.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrantStatus {
    /// Phase.
    #[serde(default)]
    pub phase: GrantPhase,
    /// The OS user who approved it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_by: Option<String>,
    /// When it was approved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_at: Option<Time>,
    /// The generation (spec) that was approved: the grant is in force only while it is the
    /// current one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_generation: Option<i64>,
    /// The OS user who denied it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denied_by: Option<String>,
    /// When it was denied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denied_at: Option<Time>,
    /// The generation that was denied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denied_generation: Option<i64>,
    /// The VM the grant is for (a lease's grant: the lease's VM), once known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<String>,
    /// That VM's uid: the grant never passes to another VM that takes the name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_uid: Option<String>,
    /// A lease's grant: the lease's uid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_uid: Option<String>,
    /// The generation last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Observations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

impl GrantStatus {
    /// Whether a person approved generation `generation`.
    pub fn approved_for(&self, generation: Option<i64>) -> bool {
        self.approved_by.is_some()
            && self.approved_generation.is_some()
            && self.approved_generation == generation
    }
    /// Whether a person denied generation `generation`.
    pub fn denied_for(&self, generation: Option<i64>) -> bool {
        self.denied_generation.is_some() && self.denied_generation == generation
    }
}

impl std::fmt::Display for GrantType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GrantType::Llm => "llm",
            GrantType::Http => "http",
            GrantType::Env => "env",
            GrantType::File => "file",
            GrantType::Github => "github",
            GrantType::SshAgent => "ssh-agent",
        })
    }
}

impl std::str::FromStr for GrantType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "llm" => GrantType::Llm,
            "http" => GrantType::Http,
            "env" => GrantType::Env,
            "file" => GrantType::File,
            "github" => GrantType::Github,
            "ssh-agent" => GrantType::SshAgent,
            _ => {
                return Err(format!(
                    "unknown grant type `{}`: use llm, http, github, env, file or ssh-agent",
                    crate::name::shown(s)
                ));
            }
        })
    }
}

impl ValueFrom {
    /// Where the value comes from, in words (never the value).
    pub fn describe(&self) -> String {
        match self {
            ValueFrom::Env(n) => format!("the control plane's environment variable {n}"),
            ValueFrom::File(p) => format!("the file {p} on the control plane"),
            ValueFrom::Command(argv) => format!(
                "the output of the command `{}` run on the control plane",
                argv.join(" ")
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FP: &str = "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s";

    fn grant(target: &str, value_from: ValueFrom) -> Grant {
        Grant::new(
            "dev1-ssh-agent-all",
            GrantSpec {
                limits: None,
                vm: Some("dev1".into()),
                lease: None,
                type_: GrantType::SshAgent,
                target: target.into(),
                header: None,
                value_from,
            },
        )
    }

    fn errors(g: &mut Grant) -> String {
        match normalize_grant(g) {
            Ok(()) => String::new(),
            Err(es) => es
                .iter()
                .map(|e| format!("{e:?}"))
                .collect::<Vec<_>>()
                .join("; "),
        }
    }

    #[test]
    fn an_agent_grant_names_all_keys_or_fingerprints() {
        assert_eq!(agent_keys("all").unwrap(), None);
        assert_eq!(agent_keys(FP).unwrap(), Some(vec![FP.to_string()]));
        let two = format!("{FP},SHA256:{}", "A".repeat(43));
        assert_eq!(agent_keys(&two).unwrap().unwrap().len(), 2);
        // a repeat counts once
        assert_eq!(agent_keys(&format!("{FP},{FP}")).unwrap().unwrap().len(), 1);
        let too_many: Vec<String> = (0..=MAX_AGENT_KEYS)
            .map(|i| format!("SHA256:{}{:02}", "A".repeat(41), i))
            .collect();
        assert!(agent_keys(&too_many.join(",")).is_err());
        for bad in [
            "",
            "ALL",
            "*",
            "MD5:aa:bb",
            "SHA256:short",
            &format!("{FP},"),
            &format!("{FP} "),
            &format!("SHA256:{}", "-".repeat(43)),
            "/home/me/.ssh/id_ed25519",
        ] {
            let e = check_target(GrantType::SshAgent, bad).unwrap_err();
            assert!(
                e.contains("fingerprints") || e.contains("bytes of text"),
                "{bad}: {e}"
            );
        }
        assert_eq!("ssh-agent".parse::<GrantType>(), Ok(GrantType::SshAgent));
        assert_eq!(GrantType::SshAgent.to_string(), "ssh-agent");
    }

    #[test]
    fn an_agent_grant_names_a_socket_by_a_plain_absolute_path_or_a_variable() {
        for ok in [
            ValueFrom::File("/run/user/1000/ssh-agent.socket".into()),
            ValueFrom::File("/tmp/ssh-XXXX/agent.123".into()),
            ValueFrom::Env("SSH_AUTH_SOCK".into()),
        ] {
            assert_eq!(errors(&mut grant("all", ok.clone())), "", "{ok:?}");
        }
        for bad in [
            "/run/user/1000/../0/ssh-agent.socket",
            "/run/./agent.sock",
            "/run//agent.sock",
            "/run/agent.sock/",
            "/",
            "relative/agent.sock",
        ] {
            let e = errors(&mut grant("all", ValueFrom::File(bad.into())));
            assert!(e.contains("spec.valueFrom"), "{bad}: {e}");
        }
        let e = errors(&mut grant(
            "all",
            ValueFrom::Command(vec!["ssh-agent".into()]),
        ));
        assert!(e.contains("not a command"), "{e}");
        let e = errors(&mut grant("keys", ValueFrom::Env("SSH_AUTH_SOCK".into())));
        assert!(e.contains("spec.target"), "{e}");
        // only http grants name a header
        let mut g = grant("all", ValueFrom::Env("SSH_AUTH_SOCK".into()));
        g.spec.header = Some("Authorization".into());
        assert!(errors(&mut g).contains("spec.header"));
    }
}

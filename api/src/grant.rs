//! `Grant`: a human-approved credential route for a VM. Types and schema only.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::meta::{Condition, Time};
use crate::resource::{KindInfo, impl_resource, resource};

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
        description: "A credential route for one VM or lease (llm, http, env, file, github), applied after a person approves it. Not implemented yet: the store refuses Grants until the credential proxy lands (issue 13).",
        controllers_only: None,
    },
    normalize = normalize_grant
);

/// Check what the schema cannot: the VM and lease it names are object names.
fn normalize_grant(grant: &mut Grant) -> Result<(), Vec<crate::validate::FieldError>> {
    let mut errs = Vec::new();
    for (field, v) in [
        ("spec.vm", &grant.spec.vm),
        ("spec.lease", &grant.spec.lease),
    ] {
        if let Some(n) = v
            && let Err(e) = crate::name::check_label_name(n)
        {
            errs.push(crate::validate::FieldError::new(field, e));
        }
    }
    if let Err(e) = crate::name::check_text(&grant.spec.target, 2048) {
        errs.push(crate::validate::FieldError::new("spec.target", e));
    }
    if errs.is_empty() { Ok(()) } else { Err(errs) }
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
    /// (`file`), a repository (`github`).
    pub target: String,
    /// Where the value comes from on the control plane (never the value itself).
    pub value_from: ValueFrom,
}

/// Kinds of grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
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
    /// Waiting for a person's approval.
    #[default]
    PendingApproval,
    /// Approved and in force.
    Applied,
    /// Refused.
    Denied,
    /// Revoked.
    Revoked,
}

/// The observed state of a grant.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrantStatus {
    /// Phase.
    #[serde(default)]
    pub phase: GrantPhase,
    /// Who approved it, and when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_by: Option<String>,
    /// When it was approved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_at: Option<Time>,
    /// The generation last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Observations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

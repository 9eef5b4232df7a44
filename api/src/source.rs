//! `Source`: a directory or git repository of manifests that `boxery sync` follows, and what
//! its last sync did (revision, changes, error). The objects it applied carry its name in
//! [`APPLY_SET_LABEL`]: its apply set, the only objects its prune may delete.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::columns::{self, Cell, Column};
use crate::meta::{Condition, Time};
use crate::resource::{ForceDelete, KindInfo, NOT_AWAITED, Typed, impl_resource, resource};

/// The label naming the Source an object was applied from (its apply set).
pub const APPLY_SET_LABEL: &str = "boxery.dev/applyset";

resource!(
    /// A directory or git repository of manifests that `boxery sync` applies, and what its
    /// last sync did.
    Source, SourceSpec, SourceStatus
);
impl_resource!(
    Source,
    KindInfo {
        kind: "Source",
        plural: "sources",
        singular: "source",
        short_names: &["src"],
        dotted_names: false,
        description: "A directory or git repository of manifests that `boxery sync` follows: its revision, what the last sync changed, and any error.",
        controllers_only: None,
        columns: &[
            columns::NAME,
            Column::new("STATUS", Cell::Field("/status/phase")),
            Column::new(
                "REVISION",
                Cell::Computed(&["/status/revision"], |v| {
                    columns::text(v[0]).chars().take(12).collect()
                }),
            ),
            Column::new("OBJECTS", Cell::Field("/status/objects")),
            Column::new("URL", Cell::Field("/spec/url")),
            Column::wide("REF", Cell::Field("/spec/ref")),
            Column::wide("PATH", Cell::Field("/spec/path")),
            Column::wide("ERROR", Cell::Field("/status/error")),
            columns::AGE,
        ],
        settled: NOT_AWAITED,
        force_delete: ForceDelete::Finalizers,
        immutable: &[],
        typed: Typed::of::<Source>(),
    },
    normalize = normalize_source
);

fn normalize_source(s: &mut Source) -> Result<(), Vec<crate::validate::FieldError>> {
    let mut errs = Vec::new();
    if let Err(e) = crate::name::check_text(&s.spec.url, 4096) {
        errs.push(crate::validate::FieldError::new("spec.url", e));
    } else if s.spec.url.is_empty() {
        errs.push(crate::validate::FieldError::new(
            "spec.url",
            "give a directory, or a git repository's URL or path".into(),
        ));
    }
    for (field, v) in [("spec.ref", &s.spec.git_ref), ("spec.path", &s.spec.path)] {
        if let Some(v) = v
            && let Err(e) = crate::name::check_text(v, 1024)
        {
            errs.push(crate::validate::FieldError::new(field, e));
        }
    }
    if s.spec
        .path
        .as_deref()
        .is_some_and(|p| p.starts_with('/') || p.split('/').any(|c| c == ".."))
    {
        errs.push(crate::validate::FieldError::new(
            "spec.path",
            "a directory inside the repository, relative, without `..`".into(),
        ));
    }
    if errs.is_empty() { Ok(()) } else { Err(errs) }
}

/// How a source is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum SourceType {
    /// A git repository (a URL, or a path to a repository), read with the `git` CLI.
    #[default]
    Git,
    /// A directory of manifest files, read as it is.
    Directory,
}

/// What to follow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SourceSpec {
    /// `Git` or `Directory`.
    #[serde(default, rename = "type")]
    pub type_: SourceType,
    /// The repository's URL or path, or the directory's path.
    pub url: String,
    /// Git only: a branch, tag or commit (default: the repository's HEAD).
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    pub git_ref: Option<String>,
    /// Git only: the directory inside the repository that holds the manifests (default: all of
    /// it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Delete what this source applied before and no longer holds (default true).
    #[serde(default = "yes")]
    pub prune: bool,
}

fn yes() -> bool {
    true
}

/// How the last sync went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum SourcePhase {
    /// Never synced.
    #[default]
    Pending,
    /// The last sync applied the revision (or found nothing to do).
    Synced,
    /// The last sync failed: nothing of its revision was applied; `revision` is still in force.
    Failed,
}

/// What the syncs did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SourceStatus {
    /// How the last sync went.
    #[serde(default)]
    pub phase: SourcePhase,
    /// The revision in force: the last one applied (a git commit, or a digest of a
    /// directory's files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// When it was applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_applied_time: Option<Time>,
    /// The revision the last sync tried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_attempted_revision: Option<String>,
    /// When the last sync ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_sync_time: Option<Time>,
    /// How many objects the revision in force holds.
    #[serde(default)]
    pub objects: u32,
    /// What the last sync that changed something changed (`vm/dev1 configured`), at most 100.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<String>,
    /// Why the last sync failed: the file, document and field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// `Ready`: the last sync applied its revision.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

//! `sync`: apply one revision of a [`Source`] as its apply set, and record what happened.
//!
//! The front end reads the source (a directory, a git commit) into manifests and a revision;
//! [`apply_revision`] applies them all in one transaction, as the source's own applier
//! (`boxery-sync.NAME`), each labelled with the source's name ([`APPLY_SET_LABEL`]), and
//! prunes the members of that set the revision no longer holds, among every kind (never an
//! object outside the set). A revision that cannot be applied (a bad manifest, a field
//! conflict) applies nothing; [`record_failure`] says why on the Source, whose `revision`
//! stays the last one applied. An object of the same name outside the set (made by hand, by
//! `boxery apply`, by another source) fails the sync unless [`Force::adopt`]: otherwise
//! removing its file would prune what the source never made. A sync that changes nothing writes nothing, not even the
//! Source's status.

use boxery_api::source::APPLY_SET_LABEL;
use boxery_api::{ConditionStatus, Conditions, DynObject, Source, SourcePhase, SourceSpec, now};
use boxery_store::{ApplyAction, ApplyOptions, ObjectStoreExt, StoreError};

use crate::Verbs;
use crate::error::{Result, VerbError};
use crate::objects::Applied;

/// The most change lines a Source's status keeps.
const MAX_CHANGES: usize = 100;

/// The field manager a source applies as.
pub fn manager(source: &str) -> String {
    format!("boxery-sync.{source}")
}

/// The Source `name` following `spec`: created when absent; refused when it follows another
/// URL or path (a second source with the same name would prune the first one's objects).
pub async fn declare(v: &Verbs, name: &str, spec: SourceSpec) -> Result<Source> {
    for _ in 0..10 {
        match v.store().get_as::<Source>(name).await? {
            None => {
                let s = Source::new(name, spec.clone());
                match v.store().create_as_by(&s, &v.manager("sync")).await {
                    Ok(s) => return Ok(s),
                    Err(StoreError::AlreadyExists { .. }) => continue,
                    Err(StoreError::Invalid(e)) => return Err(VerbError::invalid(e)),
                    Err(e) => return Err(e.into()),
                }
            }
            Some(cur) if cur.spec.url != spec.url || cur.spec.path != spec.path => {
                return Err(VerbError::conflict(format!(
                    "source {name} follows {}{} already: give this one another --name, or `boxery delete source {name}` first (the objects it applied stay)",
                    cur.spec.url,
                    cur.spec
                        .path
                        .as_deref()
                        .map(|p| format!(" (path {p})"))
                        .unwrap_or_default()
                )));
            }
            Some(cur) if cur.spec == spec => return Ok(cur),
            Some(mut cur) => {
                cur.spec = spec.clone();
                match v.store().update_as_by(&cur, &v.manager("sync")).await {
                    Ok(s) => return Ok(s),
                    Err(StoreError::Conflict { .. }) => continue,
                    Err(StoreError::Invalid(e)) => return Err(VerbError::invalid(e)),
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    Err(VerbError::conflict(format!(
        "source {name} kept changing under this command: try again"
    )))
}

/// What one sync did.
#[derive(Debug, Clone)]
pub struct Synced {
    /// The revision applied.
    pub revision: String,
    /// What apply did, object by object.
    pub applied: Applied,
}

impl Synced {
    /// One line per object the sync changed (`vm/dev1 configured`, `pool/p pruned`).
    pub fn changes(&self) -> Vec<String> {
        self.applied
            .lines()
            .into_iter()
            .zip(&self.applied.results)
            .filter(|(_, (a, _))| *a != ApplyAction::Unchanged)
            .map(|(l, _)| l)
            .collect()
    }
}

/// How a sync treats what others hold.
#[derive(Debug, Clone, Copy, Default)]
pub struct Force {
    /// Take over fields other managers set to other values.
    pub conflicts: bool,
    /// A pruned Pool or Vm that a lease holds goes at once: the lease ends (`Lost`,
    /// `ForceDeleted`) instead of the object waiting for it.
    pub leases: bool,
    /// Take into the apply set objects of the same name that exist outside it (made by hand,
    /// by `boxery apply`, by another source). Without it such an object fails the sync: the
    /// source's prune would later delete what it never made.
    pub adopt: bool,
}

/// Apply `objs` (the manifests of `revision`, as written) as `source`'s apply set, then record
/// the outcome on the Source. A failure is recorded too, and returned.
pub async fn apply_revision(
    v: &Verbs,
    source: &Source,
    revision: &str,
    mut objs: Vec<DynObject>,
    force: Force,
) -> Result<Synced> {
    let name = source.metadata.name.clone();
    for o in &mut objs {
        o.metadata
            .labels
            .insert(APPLY_SET_LABEL.into(), name.clone());
    }
    let selector = selector_of(&name)?;
    let opts = ApplyOptions {
        prune: source.spec.prune.then_some(selector),
        prune_all_kinds: true,
        field_manager: Some(manager(&name)),
        force_conflicts: force.conflicts,
        ..Default::default()
    };
    let count = objs.len();
    let applied = async {
        if !force.adopt {
            let set = selector_of(&name)?;
            let outsiders = crate::objects::outsiders(v, &objs, &set, &opts).await?;
            crate::objects::refuse_outsiders(
                "sync",
                &format!("source {name}'s apply set ({APPLY_SET_LABEL}={name})"),
                &outsiders,
                &format!("`boxery sync --name {name} --adopt` (once)"),
            )?;
        }
        crate::objects::apply(v, objs, opts).await
    };
    match applied.await {
        Ok(applied) => {
            if force.leases {
                for (action, o) in &applied.results {
                    if *action == ApplyAction::Pruned {
                        crate::pools::end_leases_for(v, &o.kind, &o.metadata.name).await?;
                    }
                }
            }
            let synced = Synced {
                revision: revision.to_string(),
                applied,
            };
            record_success(v, &name, &synced, count).await?;
            Ok(synced)
        }
        Err(e) => {
            record_failure(v, &name, Some(revision), &e.chain()).await?;
            Err(e)
        }
    }
}

/// The selector of source `name`'s apply set.
fn selector_of(name: &str) -> Result<boxery_api::Selector> {
    format!("{APPLY_SET_LABEL}={name}")
        .parse()
        .map_err(|e| VerbError::invalid(format!("source name {name}: {e}")))
}

/// Record a sync that applied `synced`: written only when something differs from what the
/// Source says already (a no-op sync writes nothing).
async fn record_success(v: &Verbs, name: &str, synced: &Synced, count: usize) -> Result {
    let mut changes = synced.changes();
    changes.truncate(MAX_CHANGES);
    let message = if changes.is_empty() {
        format!(
            "revision {} applied: nothing to change",
            short(&synced.revision)
        )
    } else {
        format!(
            "revision {} applied: {} changed ({})",
            short(&synced.revision),
            changes.len(),
            changes.join(", ")
        )
    };
    let updated = update_status(v, name, |s| {
        let st = &mut s.status;
        let same = st.phase == SourcePhase::Synced
            && st.revision.as_deref() == Some(&synced.revision)
            && st.error.is_none()
            && st.objects as usize == count
            && changes.is_empty();
        if same {
            return false;
        }
        let at = now();
        st.phase = SourcePhase::Synced;
        st.revision = Some(synced.revision.clone());
        st.last_attempted_revision = Some(synced.revision.clone());
        st.last_applied_time = Some(at);
        st.last_sync_time = Some(at);
        st.objects = u32::try_from(count).unwrap_or(u32::MAX);
        if !changes.is_empty() {
            st.changes = changes.clone();
        }
        st.error = None;
        let g = s.metadata.generation;
        s.status
            .conditions
            .set_condition("Ready", ConditionStatus::True, "Synced", &message, g);
        true
    })
    .await?;
    if let Some(s) = updated {
        recorder(v).normal(&s, "Synced", &message).await;
    }
    Ok(())
}

/// Record a sync that applied nothing: the Source is `Failed` with `error` (the revision in
/// force stays), and a warning Event says why.
pub async fn record_failure(v: &Verbs, name: &str, revision: Option<&str>, error: &str) -> Result {
    let updated = update_status(v, name, |s| {
        let st = &mut s.status;
        if st.phase == SourcePhase::Failed
            && st.error.as_deref() == Some(error)
            && st.last_attempted_revision.as_deref() == revision
        {
            return false;
        }
        st.phase = SourcePhase::Failed;
        st.last_attempted_revision = revision.map(str::to_string);
        st.last_sync_time = Some(now());
        st.error = Some(error.to_string());
        let g = s.metadata.generation;
        s.status
            .conditions
            .set_condition("Ready", ConditionStatus::False, "SyncFailed", error, g);
        true
    })
    .await?;
    if let Some(s) = updated {
        let what = revision
            .map(|r| format!("revision {}: ", short(r)))
            .unwrap_or_default();
        recorder(v)
            .warning(&s, "SyncFailed", &format!("{what}{error}"))
            .await;
    }
    Ok(())
}

fn recorder(v: &Verbs) -> boxery_controller::Recorder {
    boxery_controller::Recorder::new(v.store_arc(), "boxery-sync")
}

/// A revision as people read it: a commit's first 12 characters.
pub fn short(revision: &str) -> &str {
    revision.get(..12).unwrap_or(revision)
}

/// Read-modify-write the Source's status; `f` returns whether it changed anything. Returns the
/// Source as written, or `None` when nothing needed writing.
async fn update_status(
    v: &Verbs,
    name: &str,
    f: impl Fn(&mut Source) -> bool,
) -> Result<Option<Source>> {
    for _ in 0..10 {
        let Some(mut s) = v.store().get_as::<Source>(name).await? else {
            return Err(VerbError::not_found(format!(
                "source {name} was deleted while it synced"
            )));
        };
        if !f(&mut s) {
            return Ok(None);
        }
        match v.store().update_status_as(&s).await {
            Ok(s) => return Ok(Some(s)),
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(VerbError::conflict(format!(
        "source {name} kept changing while its status was written: try again"
    )))
}

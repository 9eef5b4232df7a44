//! What an agent may not do to a VM's egress policy (docs/egress.md): loosen it. Through the
//! tools (`Voice::Tool`), an existing Vm's `spec.network.egress`, or a Pool template's, may
//! only stay or tighten (Public → Allowlist → Deny, fewer names); a person loosens it with the
//! CLI. A new VM is the owner's decision to let agents make VMs at all; a fork keeps its
//! source's policy (`vm::fork`).

use crate::{Result, VerbError};
use boxery_api::DynObject;
use boxery_api::network::Egress;

/// The egress policy an object sets: a Vm's, a Pool template's; `None` for other kinds.
pub fn of(o: &DynObject) -> Option<Egress> {
    let spec = o.rest.get("spec")?;
    let spec = match o.kind.as_str() {
        "Vm" => spec,
        "Pool" => spec.get("template")?.get("spec")?,
        _ => return None,
    };
    Some(
        spec.get("network")
            .and_then(|n| n.get("egress"))
            .and_then(|e| serde_json::from_value(e.clone()).ok())
            .unwrap_or_default(),
    )
}

/// Refuse a change from `cur` to `new` that lets the guest reach more (asked by
/// [`crate::loosen::check`], in the tool voice).
pub(crate) fn check(cur: &DynObject, new: &DynObject) -> Result<()> {
    // a Pool whose template is removed sets none: what a template added later would be
    // compared with is the default, Public
    let Some(before) = of(cur) else {
        return Ok(());
    };
    let after = of(new).unwrap_or_default();
    match after.looser_than(&before) {
        None => Ok(()),
        Some(how) => {
            let (kind, name) = (new.kind.to_ascii_lowercase(), &new.metadata.name);
            Err(VerbError::forbidden(format!(
                "an agent cannot loosen {} {name}'s egress policy ({how}): a person does, with \
                 `boxery patch {kind} {name} …` or `boxery edit {kind} {name}`; tightening it is \
                 allowed",
                new.kind
            )))
        }
    }
}

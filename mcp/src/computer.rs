//! `vm_computer`: [`boxery_verbs::guest::computer::act`] with the session's VM; a screenshot
//! comes back as image content beside the text.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::{Output, Session, ToolResult};
use boxery_verbs::guest::computer;

/// `vm_computer` arguments: one computer-use action.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ComputerArgs {
    /// The VM (default: the session's VM).
    pub vm: Option<String>,
    /// The action and its fields.
    #[serde(flatten)]
    pub action: computer::Action,
    /// Use the hypervisor's screen (the VM's console) even when the VM has a desktop: the
    /// screen of a VM whose guest cannot be reached.
    #[serde(default)]
    pub console: bool,
}

/// `vm_computer`.
pub async fn computer(session: Arc<Session>, a: ComputerArgs, ct: CancellationToken) -> ToolResult {
    let vm = session.resolve_vm(a.vm).await?;
    let mut done = computer::act(session.verbs()?, &vm, &a.action, a.console, true, &ct).await?;
    let png = done.shot.as_mut().map(|s| std::mem::take(&mut s.png));
    let text = match &done.shot {
        Some(s) => format!(
            "{} (coordinates are pixels of this {}×{} picture)",
            done.said, s.width, s.height
        ),
        None => done.said.clone(),
    };
    Ok(Output {
        png,
        ..Output::of(text, &done)
    })
}

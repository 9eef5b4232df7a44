//! `vm_browser`: [`boxery_verbs::guest::browser::browse`] with the session's VM; a screenshot
//! comes back as image content beside the text.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::{Output, Session, ToolResult};
use boxery_verbs::guest::browser;

/// `vm_browser` arguments: one browser action.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BrowserArgs {
    /// The VM (default: the session's VM).
    pub vm: Option<String>,
    /// The action and its fields.
    #[serde(flatten)]
    pub action: browser::Browse,
}

/// `vm_browser`.
pub async fn browser(session: Arc<Session>, a: BrowserArgs, ct: CancellationToken) -> ToolResult {
    let vm = session.resolve_vm(a.vm).await?;
    let mut done = browser::browse(session.verbs()?, &vm, &a.action, &ct).await?;
    let png = done.png.take();
    let mut text = done.said();
    // (the page's text once: in the text, not again in the structured result)
    if let Some(t) = done.text.take() {
        text.push_str("\n\n");
        text.push_str(&t);
        if done.truncated {
            text.push_str(&format!("\n[… cut at {} bytes]", browser::TEXT_CAP));
        }
    }
    if let Some(v) = &done.value {
        text.push_str(&format!("\n\n{v}"));
    }
    Ok(Output {
        png,
        ..Output::of(text, &done)
    })
}

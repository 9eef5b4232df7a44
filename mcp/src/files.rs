//! `vm_read`, `vm_write`, `vm_edit` and `vm_copy`: [`boxery_verbs::guest::files`] and
//! [`boxery_verbs::guest::copy`] with the session's VM and the versions of the files it read
//! (an edit is based on the one this session last saw), rendered as tool results.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::{Output, Session, ToolResult};
use boxery_api::name::safe;
use boxery_hands::Place;
use boxery_verbs::VerbError;
use boxery_verbs::guest::{copy, files};

/// `vm_read` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadArgs {
    /// The VM (default: the session's VM).
    pub vm: Option<String>,
    /// The file (absolute, `~/…`, or relative to the home).
    pub path: String,
    /// First line to return, from 1 (default 1).
    pub offset: Option<u64>,
    /// How many lines (default 2000).
    pub limit: Option<u64>,
}

/// `vm_read`.
pub async fn read(session: Arc<Session>, a: ReadArgs, ct: CancellationToken) -> ToolResult {
    let input = files::ReadFile {
        vm: session.resolve_vm(a.vm).await?,
        path: a.path,
        from: a.offset.unwrap_or(1),
        limit: a.limit.unwrap_or(2000),
    };
    let f = files::read(session.verbs()?, &input, &ct).await?;
    session.saw(&f.vm, &f.path, &f.version);
    Ok(Output::of(format!("{}\n{}", f.header(), f.content), &f))
}

/// `vm_write` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteArgs {
    /// The VM (default: the session's VM).
    pub vm: Option<String>,
    /// The file (absolute, `~/…`, or relative to the home). Parent directories are made.
    pub path: String,
    /// The whole new content.
    pub content: String,
    /// Only write if the file is still at this version (the 64 hex characters vm_read returned), or `absent` (the file must not exist).
    pub version: Option<String>,
}

/// `vm_write`.
pub async fn write(session: Arc<Session>, a: WriteArgs, ct: CancellationToken) -> ToolResult {
    let input = files::WriteFile {
        vm: session.resolve_vm(a.vm).await?,
        path: a.path,
        content: a.content,
        version: a.version,
    };
    let w = files::write(session.verbs()?, input, &ct).await?;
    session.saw(&w.vm, &w.path, &w.version);
    Ok(Output::of(w.summary(), &w))
}

/// `vm_edit` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EditArgs {
    /// The VM (default: the session's VM).
    pub vm: Option<String>,
    /// The file.
    pub path: String,
    /// The exact text to replace (whitespace and newlines included).
    pub old: String,
    /// What to put instead.
    pub new: String,
    /// How many times `old` must occur (default 1); all of them are replaced.
    pub count: Option<usize>,
    /// The version the edit is based on, 64 hex characters (default: the one this session last read or wrote).
    pub version: Option<String>,
}

/// `vm_edit`.
pub async fn edit(session: Arc<Session>, a: EditArgs, ct: CancellationToken) -> ToolResult {
    let vm = session.resolve_vm(a.vm).await?;
    let base = a.version.or_else(|| session.seen(&vm, &a.path));
    let input = files::EditFile {
        vm,
        path: a.path,
        old: a.old,
        new: a.new,
        count: a.count.unwrap_or(1),
        base,
    };
    let e = files::edit(session.verbs()?, input, &ct).await?;
    session.saw(&e.vm, &e.path, &e.version);
    Ok(Output::of(e.summary(), &e))
}

/// `vm_copy` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CopyArgs {
    /// Source: VM:PATH, or local:PATH (a path on the machine running boxery).
    pub src: String,
    /// Destination: VM:PATH, or local:PATH.
    pub dst: String,
}

/// `vm_copy`: local paths only where the session may touch this machine's files (not over
/// HTTP).
pub async fn copy(session: Arc<Session>, a: CopyArgs, _ct: CancellationToken) -> ToolResult {
    let local = |s: &str| matches!(Place::parse(s), Place::Local(_));
    if !session.allow_local && (local(&a.src) || local(&a.dst)) {
        return Err(VerbError::invalid(
            "local paths are refused over HTTP (they would be the server's files): copy between VMs, or run `boxery mcp` (stdio) on your machine",
        ));
    }
    copy::copy(session.verbs()?, &a.src, &a.dst).await?;
    Ok(Output::with_data(
        format!("copied {} to {}", safe(&a.src), safe(&a.dst)),
        serde_json::json!({"src": a.src, "dst": a.dst}),
    ))
}

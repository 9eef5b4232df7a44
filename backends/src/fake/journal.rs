//! The fake backend's append-only journal (`journal.log`): one JSON line per completed
//! operation that made, removed or changed something, so tests can assert what happened
//! across processes ("no VM was created twice").
//!
//! Each line is appended with one `write` on a file opened with `O_APPEND`, so lines from
//! concurrent processes never interleave.

use std::io::{ErrorKind, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{BackendError, Result};

/// The journal file in the fake's state dir.
pub const JOURNAL_FILE: &str = "journal.log";

/// What a journal line records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JournalOp {
    /// A VM was created (committed).
    Create,
    /// A stopped VM was started.
    Start,
    /// A running VM was stopped.
    Stop,
    /// A degraded running VM was repaired.
    Repair,
    /// A running VM was suspended (its memory saved).
    Suspend,
    /// A VM's size changed.
    Resize,
    /// A VM (complete or partial) was removed by `remove`.
    Remove,
    /// A VM's disk was captured into a new image.
    Capture,
    /// A stock image was built.
    Build,
    /// A disk file was imported as an image.
    Import,
    /// An image was removed by `remove_image`.
    RemoveImage,
    /// A VM's disk was replaced by an image's.
    Reimage,
    /// `cleanup_new` removed a partial VM.
    CleanupNew,
    /// `cleanup_image` removed an image or its staging.
    CleanupImage,
    /// `recover_capture` removed a partial image.
    RecoverCapture,
}

/// One journal line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalEntry {
    /// What happened.
    pub op: JournalOp,
    /// The VM or image it happened to.
    pub name: String,
    /// The mark (uid) of what was made or removed, when known.
    pub uid: Option<String>,
    /// The other object involved: the source image of a create or reimage, the source VM of
    /// a capture, the stock image of a build, the file of an import.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The process that did it.
    pub pid: u32,
    /// When.
    pub time: boxery_api::Time,
}

impl JournalEntry {
    /// An entry for this process, now.
    pub fn new(op: JournalOp, name: &str, uid: Option<&str>, source: Option<&str>) -> Self {
        JournalEntry {
            op,
            name: name.to_string(),
            uid: uid.map(str::to_string),
            source: source.map(str::to_string),
            pid: std::process::id(),
            time: boxery_api::now(),
        }
    }
}

/// Append one entry to `path` in a single write.
pub(crate) fn append(path: &Path, entry: &JournalEntry) -> Result<()> {
    let mut line = serde_json::to_vec(entry).expect("journal entries serialize");
    line.push(b'\n');
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| BackendError::io(format!("cannot open {}", path.display()), e))?;
    let written = file
        .write(&line)
        .map_err(|e| BackendError::io(format!("cannot append to {}", path.display()), e))?;
    if written != line.len() {
        return Err(BackendError::io(
            format!("cannot append to {}", path.display()),
            std::io::Error::new(
                ErrorKind::WriteZero,
                format!("short write: {written} of {} bytes", line.len()),
            ),
        ));
    }
    Ok(())
}

/// Every entry in `path`, oldest first (none when the file does not exist).
pub(crate) fn read(path: &Path) -> Result<Vec<JournalEntry>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(BackendError::io(
                format!("cannot read {}", path.display()),
                e,
            ));
        }
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| {
                BackendError::io(
                    format!("line {} of {} is corrupt", i + 1, path.display()),
                    std::io::Error::new(ErrorKind::InvalidData, e),
                )
            })
        })
        .collect()
}

//! The control plane's private files (`tokens/`, `grants/`, `egress/`, the API's keys and
//! tokens): written whole or not at all (a temporary file `.NAME.tmp` beside it, renamed into
//! place), 0600 in a 0700 directory.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

/// Create `dir` 0700 (and its parents); one that exists is left as it is.
pub fn dir(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Replace `file` with `bytes`; `sync`: flush it to disk before it is renamed into place.
pub fn write(file: &Path, bytes: &[u8], sync: bool) -> std::io::Result<()> {
    let dir = file
        .parent()
        .ok_or_else(|| std::io::Error::other("a state file has a directory"))?;
    self::dir(dir)?;
    let name = file
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut w = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    w.write_all(bytes)?;
    if sync {
        w.sync_all()?;
    }
    std::fs::rename(tmp, file)
}

/// Remove `file`; one that is not there is no error. Returns whether it removed one.
pub fn remove(file: &Path) -> std::io::Result<bool> {
    match std::fs::remove_file(file) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

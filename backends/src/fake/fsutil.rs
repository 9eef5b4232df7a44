//! Small file helpers: atomic writes and copies (temp file + rename in the same directory).
//!
//! Nothing here calls `fsync`: the fake guards against a killed process, whose writes the
//! kernel keeps, not against power loss.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{BackendError, Result};

/// A unique temp path beside `path`, hidden (starts with a dot).
pub(crate) fn temp_beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ))
}

/// Remove the temp files in `dir` ([`temp_beside`]'s `.NAME.tmp-PID-…`) whose writer is
/// dead: a process killed between writing one and renaming it into place. Another live
/// process's temp is left alone.
pub(crate) fn sweep_dead_temps(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix('.')
            .and_then(|n| n.split_once(".tmp-"))
            .and_then(|(_, rest)| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Write `bytes` to `path` atomically.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_beside(path);
    std::fs::write(&tmp, bytes)
        .map_err(|e| BackendError::io(format!("cannot write {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        BackendError::io(
            format!("cannot rename {} to {}", tmp.display(), path.display()),
            e,
        )
    })
}

/// Write `value` as pretty JSON to `path` atomically.
pub(crate) fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let mut bytes = serde_json::to_vec_pretty(value).expect("records serialize");
    bytes.push(b'\n');
    write_atomic(path, &bytes)
}

/// Read JSON from `path`; `None` when it does not exist.
pub(crate) fn read_json<T: DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            BackendError::io(
                format!("{} is corrupt", path.display()),
                std::io::Error::new(ErrorKind::InvalidData, e),
            )
        }),
        Err(e) if e.kind() == ErrorKind::NotFound || e.kind() == ErrorKind::NotADirectory => {
            Ok(None)
        }
        Err(e) => Err(BackendError::io(
            format!("cannot read {}", path.display()),
            e,
        )),
    }
}

/// Copy `src` to `dst` atomically (`dst` appears complete or not at all).
pub(crate) fn copy_atomic(src: &Path, dst: &Path) -> Result<()> {
    let tmp = temp_beside(dst);
    std::fs::copy(src, &tmp).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        BackendError::io(
            format!("cannot copy {} to {}", src.display(), tmp.display()),
            e,
        )
    })?;
    std::fs::rename(&tmp, dst).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        BackendError::io(
            format!("cannot rename {} to {}", tmp.display(), dst.display()),
            e,
        )
    })
}

/// Create `dir` and its parents.
pub(crate) fn mkdirs(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| BackendError::io(format!("cannot create {}", dir.display()), e))
}

/// Remove a directory tree; succeeds when it is already gone.
pub(crate) fn remove_tree(dir: &Path) -> Result<bool> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(BackendError::io(
            format!("cannot remove {}", dir.display()),
            e,
        )),
    }
}

/// Remove a file; succeeds when it is already gone.
pub(crate) fn remove_file(path: &Path) -> Result<bool> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(BackendError::io(
            format!("cannot remove {}", path.display()),
            e,
        )),
    }
}

/// Whether `path` exists (errors read as "no").
pub(crate) fn exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temps_of_dead_writers_go_and_live_ones_stay() {
        let d = tempfile::tempdir().unwrap();
        // a pid above the kernel's maximum is never alive
        let dead = d.path().join(".vm.json.tmp-4194305-abc");
        let mine = temp_beside(&d.path().join("vm.json"));
        let other = d.path().join(".notes");
        for f in [&dead, &mine, &other] {
            std::fs::write(f, b"x").unwrap();
        }
        std::fs::write(d.path().join("vm.json"), b"{}").unwrap();
        sweep_dead_temps(d.path());
        assert!(!dead.exists());
        assert!(mine.exists() && other.exists() && d.path().join("vm.json").exists());
    }
}

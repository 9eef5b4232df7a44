//! The file primitives every storage step uses: names safe as file names, atomic writes
//! (temporary name, fsync, rename, fsync the directory), JSON records, removals that succeed
//! when the file is already gone, and flocks.
//!
//! Guarantees: a file written with [`write_atomic`] is seen whole or not at all (a reader sees
//! the old file or the new one); a process killed mid-write leaves only a `.FILE.tmp-PID`
//! sibling, which [`remove_temps`] sweeps.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Whether `name` is safe as a file name and a VM/image name: 1–63 characters of `a-z 0-9 - .`,
/// starting and ending with a letter or digit, no `..`.
pub fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'.')
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && !name.contains("..")
}

/// The temporary sibling a file is written to before its rename.
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Remove the temp files ([`temp_path`]: `.FILE.tmp-PID`) that a process killed while writing
/// a file of `dir` left behind, for every `FILE` that `of` picks. Exact names only: image
/// `c1`'s temps are not image `c1.s1`'s.
pub fn remove_temps(dir: &Path, of: impl Fn(&str) -> bool) -> std::io::Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let temp_of = name
            .strip_prefix('.')
            .and_then(|r| r.rsplit_once(".tmp-"))
            .filter(|(_, pid)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
            .map(|(file, _)| file);
        if temp_of.is_some_and(&of) {
            remove_file_if_exists(&e.path())?;
        }
    }
    Ok(())
}

/// Write `data` to `path` atomically (temp file, fsync, rename, fsync the directory), with
/// permissions `mode`.
pub fn write_atomic(path: &Path, data: &[u8], mode: u32) -> std::io::Result<()> {
    let tmp = temp_path(path);
    let res = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.write_all(data)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        sync_dir(path)
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

/// Write `value` as pretty JSON, atomically.
pub fn write_json<T: serde::Serialize>(path: &Path, value: &T, mode: u32) -> std::io::Result<()> {
    let mut data = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
    data.push(b'\n');
    write_atomic(path, &data, mode)
}

/// Read JSON from `path`; `Ok(None)` when the file does not exist.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> std::io::Result<Option<T>> {
    match fs::read(path) {
        Ok(data) => serde_json::from_slice(&data).map(Some).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: {e}", path.display()),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Copy `from` to the new file `to` (mode 0600, synced), holes left as holes: only the runs
/// of data are read and written (`SEEK_DATA`/`SEEK_HOLE`). Returns the bytes copied.
pub fn copy_sparse(from: &Path, to: &Path) -> std::io::Result<u64> {
    use rustix::fs::{SeekFrom, seek};
    use std::os::unix::fs::FileExt;
    let src = std::fs::File::open(from)?;
    let len = src.metadata()?.len();
    let dst = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(to)?;
    dst.set_len(len)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    let mut copied = 0u64;
    while at < len {
        // the next run of data, or none left (ENXIO past the last one)
        let start = match seek(&src, SeekFrom::Data(at)) {
            Ok(o) => o,
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let end = seek(&src, SeekFrom::Hole(start))?.min(len);
        let mut off = start;
        while off < end {
            let want = ((end - off) as usize).min(buf.len());
            let n = src.read_at(&mut buf[..want], off)?;
            if n == 0 {
                break;
            }
            dst.write_all_at(&buf[..n], off)?;
            off += n as u64;
            copied += n as u64;
        }
        at = end;
    }
    dst.sync_all()?;
    Ok(copied)
}

/// fsync the directory holding `path`, so a rename in it survives a crash.
pub fn sync_dir(path: &Path) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Remove a file; succeed when it is already gone.
pub fn remove_file_if_exists(path: &Path) -> std::io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Remove a directory tree; succeed when it is already gone.
pub fn remove_dir_if_exists(path: &Path) -> std::io::Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Make a file read-only for everyone (0444).
pub fn make_read_only(path: &Path) -> std::io::Result<()> {
    set_mode(path, 0o444)
}

/// The last `lines` lines of a file (blank lines skipped; empty when unreadable).
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The most of a console log [`console`] reads.
pub const CONSOLE_MAX: u64 = 1 << 20;

/// A console log's text (lossy UTF-8), at most [`CONSOLE_MAX`] bytes: the whole file, or its
/// first and last halves when it is longer. `None` when there is no log.
pub fn console(path: &Path) -> std::io::Result<Option<String>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    let mut buf = Vec::new();
    if len <= CONSOLE_MAX {
        f.read_to_end(&mut buf)?;
    } else {
        let half = CONSOLE_MAX / 2;
        (&mut f).take(half).read_to_end(&mut buf)?;
        buf.push(b'\n');
        f.seek(SeekFrom::End(-(half as i64)))?;
        f.take(half).read_to_end(&mut buf)?;
    }
    Ok(Some(String::from_utf8_lossy(&buf).into_owned()))
}

/// Set a file's permission bits.
pub fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
}

/// An exclusive advisory lock (flock) on a lock file, held until dropped. It excludes other
/// processes and other operations in this process alike (each lock opens the file anew).
#[derive(Debug)]
pub struct FileLock {
    _file: File,
}

impl FileLock {
    /// Take the lock, waiting for it without blocking the async runtime.
    pub async fn acquire(path: PathBuf) -> std::io::Result<FileLock> {
        tokio::task::spawn_blocking(move || {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(&path)?;
            file.lock()?;
            Ok(FileLock { _file: file })
        })
        .await
        .map_err(std::io::Error::other)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remove_temps_takes_exactly_the_named_files_temps() {
        let d = tempfile::tempdir().unwrap();
        let names = [
            ".c1.json.tmp-12",    // c1's record, mid-write: goes
            ".c1.s1.json.tmp-13", // image c1.s1's: stays
            ".c1.json.tmp-x",     // not a PID: stays
            ".c1.json.tmp-",      // no PID: stays
            "c1.json",            // the record itself: stays
        ];
        for n in names {
            fs::write(d.path().join(n), "x").unwrap();
        }
        remove_temps(d.path(), |f| f == "c1.json").unwrap();
        let mut left: Vec<String> = fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                ".c1.json.tmp-",
                ".c1.json.tmp-x",
                ".c1.s1.json.tmp-13",
                "c1.json"
            ]
        );
        remove_temps(&d.path().join("missing"), |_| true).unwrap();
    }

    #[test]
    fn names() {
        for ok in ["dev1", "a", "dev1.before-upgrade", "x-1.2"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            ".a",
            "a..b",
            "A",
            "a/b",
            "a b",
            &"a".repeat(64),
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn atomic_write_and_read() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.json");
        assert_eq!(read_json::<serde_json::Value>(&p).unwrap(), None);
        write_json(&p, &serde_json::json!({"a": 1}), 0o600).unwrap();
        assert_eq!(
            read_json::<serde_json::Value>(&p).unwrap(),
            Some(serde_json::json!({"a": 1}))
        );
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            fs::read_dir(d.path()).unwrap().count(),
            1,
            "no temp file left"
        );
    }

    #[tokio::test]
    async fn locks_exclude_each_other() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.lock");
        let l1 = FileLock::acquire(p.clone()).await.unwrap();
        let p2 = p.clone();
        let waiter = tokio::spawn(async move { FileLock::acquire(p2).await.unwrap() });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!waiter.is_finished());
        drop(l1);
        let _l2 = tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
    }

    #[test]
    fn copy_sparse_keeps_holes_and_data() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let f = std::fs::File::create(&a).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(&[7u8; 5000], 3 << 20).unwrap();
        f.write_all_at(b"end", (64 << 20) - 3).unwrap();
        drop(f);
        let copied = copy_sparse(&a, &b).unwrap();
        assert!(copied < 1 << 20, "only the runs of data: {copied}");
        assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        let allocated = crate::storage::disk::allocated_bytes(&b);
        assert!(allocated < 4 << 20, "holes stay holes: {allocated}");
        assert!(copy_sparse(&a, &b).is_err(), "never over an existing file");
    }
}

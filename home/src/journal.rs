//! An append-only log of JSON lines under the home (`audit/proxy.log`, `audit/actions.log`):
//! one `write` per line on an `O_APPEND` file (0600 in a 0700 directory), rotated by size and
//! by age. Several processes may append to one journal (the CLI's commands and `serve`).
//!
//! # Guarantees
//! - A line is serialised by serde_json, so a field cannot hold a raw newline or control
//!   character: what a guest or an agent puts in a command or a path cannot start a line of
//!   its own or forge another record.
//! - Rotation renames the file to `NAME.1` (after moving `NAME.1` to `NAME.2` and so on, the
//!   oldest of the files it keeps dropped) when a line would take it past its size limit, or
//!   when its first line is older than its age limit: a journal keeping `k` rotated files takes
//!   at most `k + 1` times its size limit. Rotation holds an exclusive `flock` on the file,
//!   and an append a shared one on the file it checked is still the journal's, so a line is
//!   never written into a file being renamed away.
//! - A failure to write is logged (`tracing`), never an error of the action it records.

use std::io::{BufRead, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// The open file: its size, and when its first line was written (its modification time at
/// open when it was not empty: close enough for an age limit measured in days).
#[derive(Debug)]
struct Open {
    file: std::fs::File,
    size: u64,
    since: SystemTime,
}

/// A journal at a path.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    max_bytes: u64,
    max_age: Duration,
    /// Rotated files kept: `NAME.1` (the newest) … `NAME.keep`.
    keep: u32,
    file: Mutex<Option<Open>>,
}

impl Journal {
    /// A journal at `path`, rotated at `max_bytes` or when older than `max_age` (opened on
    /// first use, so a removed file is made again).
    pub fn new(path: PathBuf, max_bytes: u64, max_age: Duration) -> Self {
        Self::keeping(path, max_bytes, max_age, 1)
    }

    /// [`Journal::new`], keeping `keep` rotated files (at least one).
    pub fn keeping(path: PathBuf, max_bytes: u64, max_age: Duration, keep: u32) -> Self {
        Journal {
            path,
            max_bytes,
            max_age,
            keep: keep.max(1),
            file: Mutex::new(None),
        }
    }

    /// The `n`th rotated file (`NAME.n`).
    fn rotated(&self, n: u32) -> PathBuf {
        let ext = match self.path.extension().and_then(|e| e.to_str()) {
            Some(e) => format!("{e}.{n}"),
            None => n.to_string(),
        };
        self.path.with_extension(ext)
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append `record` as one line.
    pub fn append<T: serde::Serialize>(&self, record: &T) {
        let mut line = match serde_json::to_vec(record) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(path = %self.path.display(), error = %e, "a journal record does not serialise");
                return;
            }
        };
        line.push(b'\n');
        let mut f = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = self.append_locked(&mut f, &line) {
            tracing::error!(path = %self.path.display(), error = %e, "cannot append to the journal");
            *f = None;
        }
    }

    fn append_locked(&self, f: &mut Option<Open>, line: &[u8]) -> std::io::Result<()> {
        // Another process may have rotated the file since it was opened here.
        if let Some(o) = f.as_ref() {
            let here = std::fs::metadata(&self.path).ok();
            let same = here.is_some_and(|m| {
                use std::os::unix::fs::MetadataExt;
                o.file
                    .metadata()
                    .is_ok_and(|n| n.ino() == m.ino() && n.dev() == m.dev())
            });
            if !same {
                *f = None;
            }
        }
        if f.is_none() {
            *f = Some(self.open()?);
        }
        let o = f.as_mut().expect("opened");
        let old = o.since.elapsed().unwrap_or_default() >= self.max_age;
        if o.size > 0 && (o.size + line.len() as u64 > self.max_bytes || old) {
            rustix::fs::flock(&o.file, rustix::fs::FlockOperation::LockExclusive)?;
            // Still ours and still due once the lock is held (another process may have
            // rotated it while this one waited).
            let due = std::fs::metadata(&self.path).is_ok_and(|m| {
                use std::os::unix::fs::MetadataExt;
                o.file.metadata().is_ok_and(|n| n.ino() == m.ino())
                    && (m.len() + line.len() as u64 > self.max_bytes || old)
            });
            if due {
                for n in (1..self.keep).rev() {
                    let _ = std::fs::rename(self.rotated(n), self.rotated(n + 1));
                }
                std::fs::rename(&self.path, self.rotated(1))?;
            }
            let _ = rustix::fs::flock(&o.file, rustix::fs::FlockOperation::Unlock);
            *f = Some(self.open()?);
        }
        let mut o = f.as_mut().expect("opened");
        rustix::fs::flock(&o.file, rustix::fs::FlockOperation::LockShared)?;
        // Rotated by another process between the check above and the lock: the line goes
        // into the new file, not the one renamed away.
        if !self.is_current(&o.file) {
            let _ = rustix::fs::flock(&o.file, rustix::fs::FlockOperation::Unlock);
            *f = Some(self.open()?);
            o = f.as_mut().expect("opened");
            rustix::fs::flock(&o.file, rustix::fs::FlockOperation::LockShared)?;
        }
        let wrote = o.file.write_all(line);
        let _ = rustix::fs::flock(&o.file, rustix::fs::FlockOperation::Unlock);
        wrote?;
        o.size += line.len() as u64;
        Ok(())
    }

    /// Whether `file` is the one at the journal's path now.
    fn is_current(&self, file: &std::fs::File) -> bool {
        use std::os::unix::fs::MetadataExt;
        match (std::fs::metadata(&self.path), file.metadata()) {
            (Ok(p), Ok(f)) => p.ino() == f.ino() && p.dev() == f.dev(),
            _ => false,
        }
    }

    fn open(&self) -> std::io::Result<Open> {
        crate::private::dir(self.path.parent().expect("a journal has a parent"))?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&self.path)?;
        let m = file.metadata()?;
        let since = if m.len() == 0 {
            SystemTime::now()
        } else {
            first_line_time(&self.path).unwrap_or_else(|| m.modified().unwrap_or(SystemTime::now()))
        };
        Ok(Open {
            file,
            size: m.len(),
            since,
        })
    }

    /// Every line, the oldest rotated file's first, then the current file's.
    pub fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        let files = (1..=self.keep)
            .rev()
            .map(|n| self.rotated(n))
            .chain(std::iter::once(self.path.clone()));
        for p in files {
            if let Ok(f) = std::fs::File::open(&p) {
                out.extend(std::io::BufReader::new(f).lines().map_while(Result::ok));
            }
        }
        out
    }
}

/// The `time` of a journal's first line (RFC 3339), as a system time.
fn first_line_time(path: &Path) -> Option<SystemTime> {
    let f = std::fs::File::open(path).ok()?;
    let mut first = String::new();
    std::io::BufReader::new(f).read_line(&mut first).ok()?;
    let v: serde_json::Value = serde_json::from_str(&first).ok()?;
    let t: boxery_api::Time = serde_json::from_value(v["time"].clone()).ok()?;
    let secs = u64::try_from(t.timestamp()).ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize)]
    struct Rec<'a> {
        time: &'a str,
        what: &'a str,
    }

    #[test]
    fn rotates_by_size_keeps_one_old_file_and_escapes_what_it_is_given() {
        let home = tempfile::tempdir().unwrap();
        let j = Journal::new(
            home.path().join("audit/x.log"),
            1000,
            Duration::from_secs(3600),
        );
        let now = chrono::Utc::now().to_rfc3339();
        for _ in 0..40 {
            j.append(&Rec {
                time: &now,
                what: "echo hi\n{\"forged\":true}\r\x1b[2J",
            });
        }
        let cur = std::fs::metadata(j.path()).unwrap().len();
        let old = std::fs::metadata(j.path().with_extension("log.1"))
            .unwrap()
            .len();
        assert!(
            cur <= 1000 && old <= 1000 && cur > 0 && old > 0,
            "{cur} {old}"
        );
        let lines = j.lines();
        assert!(lines.len() > 10);
        for l in &lines {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["what"], "echo hi\n{\"forged\":true}\r\x1b[2J");
            assert!(!l.contains('\x1b') && !l.contains('\r'));
        }
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(j.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn rotates_a_file_whose_first_line_is_too_old() {
        let home = tempfile::tempdir().unwrap();
        let path = home.path().join("audit/y.log");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(
            &path,
            "{\"time\":\"2020-01-01T00:00:00Z\",\"what\":\"old\"}\n",
        )
        .unwrap();
        let j = Journal::new(path.clone(), 1 << 20, Duration::from_secs(7 * 86400));
        j.append(&Rec {
            time: &chrono::Utc::now().to_rfc3339(),
            what: "new",
        });
        let old = std::fs::read_to_string(path.with_extension("log.1")).unwrap();
        assert!(old.contains("\"old\""));
        let cur = std::fs::read_to_string(&path).unwrap();
        assert!(cur.contains("\"new\"") && !cur.contains("\"old\""));
    }
}

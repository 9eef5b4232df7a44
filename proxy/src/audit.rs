//! The audit log: `$BOXERY_HOME/audit/proxy.log` (directory 0700, file 0600), one JSON line
//! per request, appended: time, VM, grant(s), route, method, host, path (no query string),
//! status, request and response bytes, milliseconds, and for a refusal its reason. Never a
//! body, a header, a token or a value.
//!
//! Rotated by size: a line that would take the file past [`MAX_BYTES`] first renames it to
//! `proxy.log.1` (replacing the previous one), so the log never takes more than twice that.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Serialize;

/// One request, as the audit log records it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Record {
    /// When the request arrived (RFC 3339, UTC).
    pub time: String,
    /// The VM its token belongs to (none when the token was not accepted).
    pub vm: Option<String>,
    /// The grant(s) it used.
    pub grant: Option<String>,
    /// `llm` or `edge` (none when the path is no route).
    pub route: Option<String>,
    /// The HTTP method.
    pub method: String,
    /// The upstream host (the provider's or the edge host).
    pub host: Option<String>,
    /// The path at the upstream, without its query string.
    pub path: String,
    /// The status returned to the VM.
    pub status: u16,
    /// Request body bytes forwarded.
    pub bytes_in: u64,
    /// Response body bytes returned.
    pub bytes_out: u64,
    /// Milliseconds from arrival to the end of the response.
    pub ms: u64,
    /// Why the proxy refused or failed it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Record {
    /// A record of a request with `method` arriving now.
    pub fn begin(method: &axum::http::Method) -> Self {
        Record {
            time: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            method: method.to_string(),
            ..Default::default()
        }
    }
}

/// The size at which the audit log is rotated: 64 MiB.
pub const MAX_BYTES: u64 = 64 * 1024 * 1024;

/// The audit log writer: one `write` per line on an `O_APPEND` file.
#[derive(Debug)]
pub struct Audit {
    path: PathBuf,
    max: u64,
    /// The open file and its size.
    file: Mutex<Option<(std::fs::File, u64)>>,
}

impl Audit {
    /// The audit log under `home` (opened on first use, so a removed file is made again on
    /// the next start).
    pub fn new(home: &Path) -> Self {
        Self::with_limit(home, MAX_BYTES)
    }

    /// [`Audit::new`], rotated at `max` bytes.
    pub fn with_limit(home: &Path, max: u64) -> Self {
        Audit {
            path: boxery_home::layout::audit_log(home),
            max,
            file: Mutex::new(None),
        }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append `r` (a failure to write is logged, once per failure, and the request goes on).
    pub fn write(&self, r: &Record) {
        let mut line = serde_json::to_vec(r).expect("a record serialises");
        line.push(b'\n');
        let mut f = self.file.lock().expect("not poisoned");
        if let Some((_, size)) = f.as_ref()
            && *size > 0
            && size + line.len() as u64 > self.max
        {
            let old = self.path.with_extension("log.1");
            if let Err(e) = std::fs::rename(&self.path, &old) {
                tracing::error!(path = %self.path.display(), error = %e, "cannot rotate the proxy's audit log");
            }
            *f = None;
        }
        if f.is_none() {
            let opened =
                boxery_home::private::dir(self.path.parent().expect("a parent")).and_then(|()| {
                    std::fs::OpenOptions::new()
                        .append(true)
                        .create(true)
                        .mode(0o600)
                        .open(&self.path)
                });
            match opened.and_then(|file| Ok((file.metadata()?.len(), file))) {
                Ok((size, file)) => *f = Some((file, size)),
                Err(e) => {
                    tracing::error!(path = %self.path.display(), error = %e, "cannot open the proxy's audit log");
                    return;
                }
            }
        }
        if let Some((file, size)) = f.as_mut() {
            match file.write_all(&line) {
                Ok(()) => *size += line.len() as u64,
                Err(e) => {
                    tracing::error!(path = %self.path.display(), error = %e, "cannot append to the proxy's audit log");
                    *f = None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_at_its_limit_and_keeps_one_old_file() {
        let home = tempfile::tempdir().unwrap();
        let a = Audit::with_limit(home.path(), 1000);
        let r = Record {
            method: "POST".into(),
            path: "/v1/messages".into(),
            status: 200,
            ..Record::default()
        };
        for _ in 0..40 {
            a.write(&r);
        }
        let cur = std::fs::metadata(a.path()).unwrap().len();
        let old = a.path().with_extension("log.1");
        let old_len = std::fs::metadata(&old).unwrap().len();
        assert!(cur <= 1000 && old_len <= 1000, "{cur} {old_len}");
        assert!(cur > 0 && old_len > 0);
        let lines = std::fs::read_to_string(&old).unwrap();
        assert!(
            lines
                .lines()
                .all(|l| l.starts_with('{') && l.ends_with('}'))
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(a.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}

//! The audit log: `$BOXERY_HOME/audit/proxy.log` (directory 0700, file 0600), one JSON line
//! per request, appended: time, VM, grant(s), route, method, host, path (no query string),
//! status, request and response bytes, milliseconds, and for a refusal its reason. Never a
//! body, a header, a token or a value.
//!
//! Rotated by size and age ([`boxery_home::journal`]): a line that would take the file past
//! [`MAX_BYTES`], or a file whose first line is older than [`MAX_AGE`], first renames it to
//! `proxy.log.1` (replacing the previous one), so the log never takes more than twice that.

use std::path::Path;

use boxery_home::journal::Journal;
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

/// The age at which the audit log is rotated: 30 days.
pub const MAX_AGE: std::time::Duration = std::time::Duration::from_secs(30 * 86400);

/// The audit log writer: a [`Journal`] at `audit/proxy.log`.
#[derive(Debug)]
pub struct Audit {
    journal: Journal,
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
            journal: Journal::new(boxery_home::layout::audit_log(home), max, MAX_AGE),
        }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        self.journal.path()
    }

    /// Append `r` (a failure to write is logged, and the request goes on).
    pub fn write(&self, r: &Record) {
        self.journal.append(r);
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

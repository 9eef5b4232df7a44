//! The audit log: `$BOXERY_HOME/audit/proxy.log` (directory 0700, file 0600), one JSON line
//! per request, appended: time, VM, grant(s), route, method, host, path (no query string),
//! status, request and response bytes, milliseconds, and for a refusal its reason. Never a
//! body, a header, a token or a value.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
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

/// The audit log writer: one `write` per line on an `O_APPEND` file.
#[derive(Debug)]
pub struct Audit {
    path: PathBuf,
    file: Mutex<Option<std::fs::File>>,
}

impl Audit {
    /// The audit log under `home` (opened on first use, so a removed file is made again on
    /// the next start).
    pub fn new(home: &Path) -> Self {
        Audit {
            path: home.join("audit").join("proxy.log"),
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
        if f.is_none() {
            let opened = std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(self.path.parent().expect("a parent"))
                .and_then(|()| {
                    std::fs::OpenOptions::new()
                        .append(true)
                        .create(true)
                        .mode(0o600)
                        .open(&self.path)
                });
            match opened {
                Ok(file) => *f = Some(file),
                Err(e) => {
                    tracing::error!(path = %self.path.display(), error = %e, "cannot open the proxy's audit log");
                    return;
                }
            }
        }
        if let Some(file) = f.as_mut()
            && let Err(e) = file.write_all(&line)
        {
            tracing::error!(path = %self.path.display(), error = %e, "cannot append to the proxy's audit log");
            *f = None;
        }
    }
}

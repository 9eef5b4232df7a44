//! A small typed QMP client over a unix socket, one method per command (as incus does).
//!
//! QMP is line-delimited JSON: a greeting, `qmp_capabilities`, then one reply per command,
//! with asynchronous events interleaved (kept until asked for). The client sends one command
//! at a time and every wait is bounded. The same framing serves the guest agent (`Qga`).
//!
//! Caveat: a QMP chardev serves one client at a time; connect, do the work, drop.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// A failed QMP exchange.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket could not be reached (QEMU not running, or another client holds it).
    #[error("could not connect to the QMP socket {path}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing the socket failed, or QEMU closed it.
    #[error("QMP I/O failed during {command}")]
    Io {
        /// The command under way.
        command: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// No answer in time.
    #[error("QMP {command} got no answer within {timeout:?}")]
    Timeout {
        /// The command or event waited for.
        command: String,
        /// How long we waited.
        timeout: Duration,
    },
    /// QEMU answered with an error.
    #[error("QMP {command} failed: {class}: {desc}")]
    Command {
        /// The command.
        command: String,
        /// QEMU's error class.
        class: String,
        /// QEMU's description.
        desc: String,
    },
    /// The answer was not what the command returns.
    #[error("QMP {command} returned an unexpected answer")]
    Decode {
        /// The command.
        command: String,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
}

/// One connection to a JSON-lines monitor (QMP or the guest agent).
#[derive(Debug)]
struct Lines {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    timeout: Duration,
}

impl Lines {
    async fn connect(path: &Path, timeout: Duration) -> Result<Lines, QmpError> {
        let stream = tokio::time::timeout(timeout, UnixStream::connect(path))
            .await
            .map_err(|_| QmpError::Connect {
                path: path.into(),
                source: std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
            })?
            .map_err(|source| QmpError::Connect {
                path: path.into(),
                source,
            })?;
        let (r, w) = stream.into_split();
        Ok(Lines {
            reader: BufReader::new(r),
            writer: w,
            timeout,
        })
    }

    async fn send(&mut self, command: &str, msg: &Value) -> Result<(), QmpError> {
        let mut line = serde_json::to_vec(msg).expect("JSON values serialize");
        line.push(b'\n');
        self.writer
            .write_all(&line)
            .await
            .map_err(|source| QmpError::Io {
                command: command.into(),
                source,
            })
    }

    /// One JSON line (bytes outside JSON, such as the agent's 0xFF sync marker, are skipped).
    async fn read(
        &mut self,
        command: &str,
        deadline: tokio::time::Instant,
    ) -> Result<Value, QmpError> {
        loop {
            let mut buf = Vec::new();
            let n = tokio::time::timeout_at(deadline, self.reader.read_until(b'\n', &mut buf))
                .await
                .map_err(|_| QmpError::Timeout {
                    command: command.into(),
                    timeout: self.timeout,
                })?
                .map_err(|source| QmpError::Io {
                    command: command.into(),
                    source,
                })?;
            if n == 0 {
                return Err(QmpError::Io {
                    command: command.into(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the monitor closed the connection",
                    ),
                });
            }
            let start = buf.iter().position(|b| *b == b'{').unwrap_or(buf.len());
            if start == buf.len() {
                continue;
            }
            if let Ok(v) = serde_json::from_slice::<Value>(&buf[start..]) {
                return Ok(v);
            }
        }
    }
}

/// The message that runs `command` (with `arguments`), as QMP and the guest agent take it.
fn request(command: &str, arguments: Option<Value>) -> Value {
    let mut msg = json!({ "execute": command });
    if let Some(a) = arguments {
        msg["arguments"] = a;
    }
    msg
}

/// A reply's `return` value, or its error.
fn returned(command: &str, reply: &Value) -> Result<Value, QmpError> {
    match error_of(command, reply) {
        Some(e) => Err(e),
        None => Ok(reply.get("return").cloned().unwrap_or(Value::Null)),
    }
}

fn error_of(command: &str, reply: &Value) -> Option<QmpError> {
    let err = reply.get("error")?;
    Some(QmpError::Command {
        command: command.into(),
        class: err
            .get("class")
            .and_then(Value::as_str)
            .unwrap_or("Error")
            .into(),
        desc: err.get("desc").and_then(Value::as_str).unwrap_or("").into(),
    })
}

/// A QMP connection.
#[derive(Debug)]
pub struct Qmp {
    lines: Lines,
    events: Vec<Value>,
}

/// `query-status`.
#[derive(Debug, Clone, Deserialize)]
pub struct StatusInfo {
    /// `running`, `paused`, `shutdown`, …
    pub status: String,
    /// Whether the vCPUs run.
    pub running: bool,
}

/// `query-migrate`: the last migration's state (QEMU keeps it after the migration ends, so a
/// control plane that restarts mid-suspend can read how it went).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct MigrationInfo {
    /// `none`, `setup`, `active`, `device`, `completed`, `failed`, `cancelled`, …; missing
    /// when no migration ran.
    #[serde(default)]
    pub status: Option<String>,
    /// Why it failed.
    #[serde(default, rename = "error-desc")]
    pub error_desc: Option<String>,
}

impl MigrationInfo {
    /// Still under way.
    pub fn in_progress(&self) -> bool {
        matches!(
            self.status.as_deref(),
            Some(
                "setup"
                    | "active"
                    | "device"
                    | "pre-switchover"
                    | "wait-unplug"
                    | "cancelling"
                    | "postcopy-active"
            )
        )
    }
}

/// One entry of `query-block-jobs`.
#[derive(Debug, Clone, Deserialize)]
pub struct BlockJobInfo {
    /// The job's id (or its device when it has none).
    pub device: String,
    /// `stream`, `commit`, `backup`, `mirror`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Work done.
    pub offset: u64,
    /// Work in all.
    pub len: u64,
    /// `running`, `ready`, `concluded`, …
    pub status: String,
}

/// One image in a chain as `query-block` reports it.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ImageChain {
    /// Its filename (as opened).
    pub filename: String,
    /// Its backing image, if any.
    #[serde(default)]
    pub backing_image: Option<Box<ImageChain>>,
}

impl ImageChain {
    /// The filenames from the top down.
    pub fn files(&self) -> Vec<String> {
        let mut v = vec![self.filename.clone()];
        let mut cur = self.backing_image.as_deref();
        while let Some(c) = cur {
            v.push(c.filename.clone());
            cur = c.backing_image.as_deref();
        }
        v
    }
}

/// The medium of a block device.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Inserted {
    /// The top node's name.
    pub node_name: String,
    /// The top image's filename.
    pub file: String,
    /// The chain.
    pub image: ImageChain,
}

/// One entry of `query-block`.
#[derive(Debug, Clone, Deserialize)]
pub struct BlockInfo {
    /// The legacy device name (empty with `-blockdev`).
    #[serde(default)]
    pub device: String,
    /// The guest device's qdev path/id.
    #[serde(default)]
    pub qdev: String,
    /// The medium.
    #[serde(default)]
    pub inserted: Option<Inserted>,
}

/// One entry of `query-chardev`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ChardevInfo {
    /// The chardev's id.
    pub label: String,
    /// Whether the guest side has it open (for the agent's port: the agent runs).
    #[serde(default)]
    pub frontend_open: bool,
}

impl Qmp {
    /// Connect to `path`, read the greeting and negotiate capabilities.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        let mut lines = Lines::connect(path, timeout).await?;
        let deadline = tokio::time::Instant::now() + timeout;
        let greeting = lines.read("greeting", deadline).await?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Io {
                command: "greeting".into(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, "not a QMP greeting"),
            });
        }
        let mut q = Qmp {
            lines,
            events: Vec::new(),
        };
        q.execute("qmp_capabilities", None).await?;
        Ok(q)
    }

    /// Run `command` and return its `return` value.
    pub async fn execute(
        &mut self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        self.lines
            .send(command, &request(command, arguments))
            .await?;
        let deadline = tokio::time::Instant::now() + self.lines.timeout;
        loop {
            let reply = self.lines.read(command, deadline).await?;
            if reply.get("event").is_some() {
                self.events.push(reply);
                continue;
            }
            return returned(command, &reply);
        }
    }

    async fn typed<T: serde::de::DeserializeOwned>(
        &mut self,
        command: &str,
        args: Option<Value>,
    ) -> Result<T, QmpError> {
        let v = self.execute(command, args).await?;
        serde_json::from_value(v).map_err(|source| QmpError::Decode {
            command: command.into(),
            source,
        })
    }

    /// Wait for one of the events `names` (events that arrived earlier count).
    pub async fn wait_event(
        &mut self,
        names: &[&str],
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        if let Some(i) = self
            .events
            .iter()
            .position(|e| names.contains(&e["event"].as_str().unwrap_or("")))
        {
            return Ok(self.events.remove(i));
        }
        let label = names.join("|");
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let v = self
                .lines
                .read(&label, deadline)
                .await
                .map_err(|e| match e {
                    QmpError::Timeout { command, .. } => QmpError::Timeout { command, timeout },
                    e => e,
                })?;
            if names.contains(&v["event"].as_str().unwrap_or("")) {
                return Ok(v);
            }
            if v.get("event").is_some() {
                self.events.push(v);
            }
        }
    }

    /// `query-migrate`.
    pub async fn query_migrate(&mut self) -> Result<MigrationInfo, QmpError> {
        self.typed("query-migrate", None).await
    }

    /// Set migration capabilities (`mapped-ram`, `multifd`) on or off.
    pub async fn migrate_set_capabilities(
        &mut self,
        caps: &[(&str, bool)],
    ) -> Result<(), QmpError> {
        let capabilities: Vec<Value> = caps
            .iter()
            .map(|(c, on)| json!({ "capability": c, "state": on }))
            .collect();
        self.execute(
            "migrate-set-capabilities",
            Some(json!({ "capabilities": capabilities })),
        )
        .await
        .map(drop)
    }

    /// Set migration parameters (`{"multifd-channels": 2}`).
    pub async fn migrate_set_parameters(&mut self, params: Value) -> Result<(), QmpError> {
        self.execute("migrate-set-parameters", Some(params))
            .await
            .map(drop)
    }

    /// Start an outgoing migration to `uri` (`file:/path`); it runs in QEMU, see
    /// [`Qmp::query_migrate`].
    pub async fn migrate(&mut self, uri: &str) -> Result<(), QmpError> {
        self.execute("migrate", Some(json!({ "uri": uri })))
            .await
            .map(drop)
    }

    /// Start loading an incoming migration from `uri` (QEMU started with `-incoming defer`).
    pub async fn migrate_incoming(&mut self, uri: &str) -> Result<(), QmpError> {
        self.execute("migrate-incoming", Some(json!({ "uri": uri })))
            .await
            .map(drop)
    }

    /// `query-status`.
    pub async fn query_status(&mut self) -> Result<StatusInfo, QmpError> {
        self.typed("query-status", None).await
    }
    /// `system_powerdown`: press the ACPI power button.
    pub async fn system_powerdown(&mut self) -> Result<(), QmpError> {
        self.execute("system_powerdown", None).await.map(drop)
    }
    /// `quit`: QEMU flushes its caches and exits. A closed connection counts as success.
    pub async fn quit(&mut self) -> Result<(), QmpError> {
        match self.execute("quit", None).await {
            Err(QmpError::Io { .. }) | Ok(_) => Ok(()),
            Err(e) => Err(e),
        }
    }
    /// `stop`: pause the vCPUs.
    pub async fn stop(&mut self) -> Result<(), QmpError> {
        self.execute("stop", None).await.map(drop)
    }
    /// `cont`: resume the vCPUs.
    pub async fn cont(&mut self) -> Result<(), QmpError> {
        self.execute("cont", None).await.map(drop)
    }
    /// `query-block`.
    pub async fn query_block(&mut self) -> Result<Vec<BlockInfo>, QmpError> {
        self.typed("query-block", None).await
    }
    /// `query-block-jobs`.
    pub async fn query_block_jobs(&mut self) -> Result<Vec<BlockJobInfo>, QmpError> {
        self.typed("query-block-jobs", None).await
    }
    /// `query-chardev`.
    pub async fn query_chardev(&mut self) -> Result<Vec<ChardevInfo>, QmpError> {
        self.typed("query-chardev", None).await
    }
    /// `blockdev-snapshot-sync`: freeze node `node` and put a new qcow2 overlay `file` (node
    /// `new_node`) on top of it, which the guest writes from now on.
    pub async fn blockdev_snapshot_sync(
        &mut self,
        node: &str,
        file: &Path,
        new_node: &str,
    ) -> Result<(), QmpError> {
        self.execute(
            "blockdev-snapshot-sync",
            Some(json!({
                "node-name": node,
                "snapshot-file": file,
                "snapshot-node-name": new_node,
                "format": "qcow2",
                "mode": "absolute-paths",
            })),
        )
        .await
        .map(drop)
    }
    /// `block-stream`: copy into `node` everything between it and `base_node` (always named:
    /// a stream or commit without a base reaches the shared base), as job `job_id`.
    pub async fn block_stream(
        &mut self,
        job_id: &str,
        node: &str,
        base_node: &str,
    ) -> Result<(), QmpError> {
        self.execute(
            "block-stream",
            Some(json!({ "job-id": job_id, "device": node, "base-node": base_node, "auto-dismiss": true })),
        )
        .await
        .map(drop)
    }
    /// `blockdev-backup` of `node` into the already added node `target`.
    pub async fn blockdev_backup(
        &mut self,
        job_id: &str,
        node: &str,
        target: &str,
        sync: &str,
    ) -> Result<(), QmpError> {
        self.execute(
            "blockdev-backup",
            Some(json!({ "job-id": job_id, "device": node, "target": target, "sync": sync, "auto-dismiss": true })),
        )
        .await
        .map(drop)
    }
    /// `block-job-cancel`.
    pub async fn block_job_cancel(&mut self, job_id: &str, force: bool) -> Result<(), QmpError> {
        self.execute(
            "block-job-cancel",
            Some(json!({ "device": job_id, "force": force })),
        )
        .await
        .map(drop)
    }
    /// `block-job-complete`.
    pub async fn block_job_complete(&mut self, job_id: &str) -> Result<(), QmpError> {
        self.execute("block-job-complete", Some(json!({ "device": job_id })))
            .await
            .map(drop)
    }
    /// `block-job-dismiss` (a concluded job that was not auto-dismissed).
    pub async fn block_job_dismiss(&mut self, job_id: &str) -> Result<(), QmpError> {
        self.execute("block-job-dismiss", Some(json!({ "id": job_id })))
            .await
            .map(drop)
    }
    /// `blockdev-add`.
    pub async fn blockdev_add(&mut self, options: Value) -> Result<(), QmpError> {
        self.execute("blockdev-add", Some(options)).await.map(drop)
    }
    /// `blockdev-del`.
    pub async fn blockdev_del(&mut self, node: &str) -> Result<(), QmpError> {
        self.execute("blockdev-del", Some(json!({ "node-name": node })))
            .await
            .map(drop)
    }
    /// `screendump` of the VM's screen (its first graphic console) into `file`, as `format`
    /// (`png`, `ppm`). QEMU writes the file itself, so it must be a path QEMU can write.
    pub async fn screendump(&mut self, file: &Path, format: &str) -> Result<(), QmpError> {
        self.execute(
            "screendump",
            Some(json!({ "filename": file, "format": format })),
        )
        .await
        .map(drop)
    }
    /// `input-send-event`: `events` (QMP `InputEvent` objects: `key`, `btn`, `abs`) to the
    /// VM's keyboard and pointer, in order, in one command (QEMU refuses the whole command
    /// when one event is malformed).
    pub async fn input_send_event(&mut self, events: &[Value]) -> Result<(), QmpError> {
        self.execute("input-send-event", Some(json!({ "events": events })))
            .await
            .map(drop)
    }
    /// `block_resize` of node `node` to `bytes` (the guest sees a capacity change).
    pub async fn block_resize(&mut self, node: &str, bytes: u64) -> Result<(), QmpError> {
        self.execute(
            "block_resize",
            Some(json!({ "node-name": node, "size": bytes })),
        )
        .await
        .map(drop)
    }
}

/// A guest-agent (qemu-guest-agent) connection over its virtio-serial chardev.
#[derive(Debug)]
pub struct Qga {
    lines: Lines,
}

/// What `guest-fsfreeze-status` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreezeStatus {
    /// Filesystems are frozen.
    Frozen,
    /// They are not.
    Thawed,
}

impl Qga {
    /// Connect and synchronise (`guest-sync` with a random id, so stale replies are skipped).
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Qga, QmpError> {
        let lines = Lines::connect(path, timeout).await?;
        let mut q = Qga { lines };
        let id: u32 = rand::random::<u32>() & 0x7fff_ffff;
        q.lines
            .send(
                "guest-sync",
                &json!({ "execute": "guest-sync", "arguments": { "id": id } }),
            )
            .await?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let v = q.lines.read("guest-sync", deadline).await?;
            if v.get("return").and_then(Value::as_u64) == Some(u64::from(id)) {
                return Ok(q);
            }
        }
    }

    async fn execute(
        &mut self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        self.lines
            .send(command, &request(command, arguments))
            .await?;
        let deadline = tokio::time::Instant::now() + self.lines.timeout;
        let reply = self.lines.read(command, deadline).await?;
        returned(command, &reply)
    }

    /// `guest-set-time`: set the guest's clock to `nanos` since the epoch (and its RTC).
    pub async fn set_time(&mut self, nanos: i64) -> Result<(), QmpError> {
        self.execute("guest-set-time", Some(json!({ "time": nanos })))
            .await
            .map(drop)
    }

    /// `guest-fsfreeze-freeze`: flush and freeze every guest filesystem; returns how many.
    pub async fn fsfreeze_freeze(&mut self) -> Result<u64, QmpError> {
        Ok(self
            .execute("guest-fsfreeze-freeze", None)
            .await?
            .as_u64()
            .unwrap_or(0))
    }
    /// `guest-fsfreeze-thaw`.
    pub async fn fsfreeze_thaw(&mut self) -> Result<u64, QmpError> {
        Ok(self
            .execute("guest-fsfreeze-thaw", None)
            .await?
            .as_u64()
            .unwrap_or(0))
    }
    /// `guest-fsfreeze-status`.
    pub async fn fsfreeze_status(&mut self) -> Result<FreezeStatus, QmpError> {
        let v = self.execute("guest-fsfreeze-status", None).await?;
        Ok(if v.as_str() == Some("frozen") {
            FreezeStatus::Frozen
        } else {
            FreezeStatus::Thawed
        })
    }
    /// Read a small guest file (up to 64 KiB) with `guest-file-open`/`read`/`close`.
    pub async fn read_file(&mut self, path: &str) -> Result<String, QmpError> {
        self.lines
            .send("guest-file-open", &json!({ "execute": "guest-file-open", "arguments": { "path": path, "mode": "r" } }))
            .await?;
        let deadline = tokio::time::Instant::now() + self.lines.timeout;
        let reply = self.lines.read("guest-file-open", deadline).await?;
        if let Some(e) = error_of("guest-file-open", &reply) {
            return Err(e);
        }
        let handle = reply["return"].as_i64().unwrap_or(-1);
        self.lines
            .send(
                "guest-file-read",
                &json!({ "execute": "guest-file-read", "arguments": { "handle": handle, "count": 65536 } }),
            )
            .await?;
        let reply = self.lines.read("guest-file-read", deadline).await?;
        let _ = self
            .lines
            .send(
                "guest-file-close",
                &json!({ "execute": "guest-file-close", "arguments": { "handle": handle } }),
            )
            .await;
        let _ = self.lines.read("guest-file-close", deadline).await;
        if let Some(e) = error_of("guest-file-read", &reply) {
            return Err(e);
        }
        let b64 = reply["return"]["buf-b64"].as_str().unwrap_or("");
        Ok(String::from_utf8_lossy(&decode_base64(b64)).into_owned())
    }
}

/// Standard base64 (with padding) to bytes; invalid characters are skipped.
fn decode_base64(s: &str) -> Vec<u8> {
    let val = |c: u8| -> Option<u32> {
        match c {
            b'A'..=b'Z' => Some(u32::from(c - b'A')),
            b'a'..=b'z' => Some(u32::from(c - b'a') + 26),
            b'0'..=b'9' => Some(u32::from(c - b'0') + 52),
            b'+' => Some(62),
            b'/' => Some(63),
            _ => None,
        }
    };
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.bytes().filter_map(val) {
        acc = (acc << 6) | c;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    #[test]
    fn base64() {
        assert_eq!(decode_base64("aGVsbG8="), b"hello");
        assert_eq!(
            decode_base64("c3NoLWVkMjU1MTkgQUFBQQ=="),
            b"ssh-ed25519 AAAA"
        );
    }

    /// The screen's two commands, as QEMU receives them.
    #[tokio::test]
    async fn screendump_and_input_send_event_on_the_wire() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("qmp.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        let server = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let (r, mut w) = s.into_split();
            let mut r = BufReader::new(r);
            w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
                .await
                .unwrap();
            let mut seen = Vec::new();
            for _ in 0..3 {
                let mut line = String::new();
                r.read_line(&mut line).await.unwrap();
                seen.push(serde_json::from_str::<Value>(&line).unwrap());
                w.write_all(b"{\"return\": {}}\n").await.unwrap();
            }
            seen
        });
        let mut q = Qmp::connect(&sock, Duration::from_secs(5)).await.unwrap();
        q.screendump(Path::new("/vms/a/.screen-1-2.png"), "png")
            .await
            .unwrap();
        let events = [
            json!({"type": "key", "data": {"down": true, "key": {"type": "qcode", "data": "a"}}}),
            json!({"type": "abs", "data": {"axis": "x", "value": 0}}),
        ];
        q.input_send_event(&events).await.unwrap();
        let seen = server.await.unwrap();
        assert_eq!(
            seen[1],
            json!({"execute": "screendump", "arguments": {"filename": "/vms/a/.screen-1-2.png", "format": "png"}})
        );
        assert_eq!(
            seen[2],
            json!({"execute": "input-send-event", "arguments": {"events": events}})
        );
    }

    /// A scripted QMP server: greeting, then answers each command from `replies`, with an
    /// event sent before the second reply.
    #[tokio::test]
    async fn talks_qmp() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("qmp.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        let server = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let (r, mut w) = s.into_split();
            let mut r = BufReader::new(r);
            w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
                .await
                .unwrap();
            let mut seen = Vec::new();
            let mut line = String::new();
            // qmp_capabilities
            r.read_line(&mut line).await.unwrap();
            seen.push(line.clone());
            w.write_all(b"{\"return\": {}}\n").await.unwrap();
            // query-status, with an event first
            line.clear();
            r.read_line(&mut line).await.unwrap();
            seen.push(line.clone());
            w.write_all(b"{\"event\": \"BLOCK_JOB_COMPLETED\", \"data\": {\"device\": \"s\"}}\n")
                .await
                .unwrap();
            w.write_all(b"{\"return\": {\"status\": \"running\", \"running\": true}}\n")
                .await
                .unwrap();
            // block-stream fails
            line.clear();
            r.read_line(&mut line).await.unwrap();
            seen.push(line.clone());
            w.write_all(
                b"{\"error\": {\"class\": \"GenericError\", \"desc\": \"no such node\"}}\n",
            )
            .await
            .unwrap();
            seen
        });
        let mut q = Qmp::connect(&sock, Duration::from_secs(5)).await.unwrap();
        let st = q.query_status().await.unwrap();
        assert!(st.running);
        assert_eq!(st.status, "running");
        let err = q.block_stream("s", "ov2", "base").await.unwrap_err();
        assert!(err.to_string().contains("no such node"), "{err}");
        let ev = q
            .wait_event(&["BLOCK_JOB_COMPLETED"], Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(ev["data"]["device"], "s");
        let seen = server.await.unwrap();
        assert!(seen[0].contains("qmp_capabilities"));
        assert!(seen[2].contains("\"base-node\":\"base\""), "{}", seen[2]);
        let t = q
            .wait_event(&["NEVER"], Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(
            matches!(t, QmpError::Timeout { .. } | QmpError::Io { .. }),
            "{t}"
        );
    }
}

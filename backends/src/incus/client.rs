//! A small client for the Incus REST API over its unix socket (hyper's HTTP/1 client, one
//! connection per request: a unix socket costs nothing to open).
//!
//! Incus answers every request with an envelope: `sync` (the result is in `metadata`),
//! `async` (an operation was started: [`Client::call`] waits for it, through
//! `/1.0/operations/ID/wait`, and reads its outcome) or `error` (`error_code`, `error`).
//! Objects that can be updated carry an ETag; [`Client::get_etag`] returns it and
//! [`Client::put_if_match`] sends it back, so an update never overwrites a change it did not
//! see.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// How long one request (not an operation) may take before it is given up.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// How long an upload (an image tarball) may take.
const UPLOAD_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// How long one `wait` on an operation asks Incus to hold the request (it is asked again
/// until the operation ends).
const WAIT_SECONDS: u64 = 30;
/// How long an operation may run before it is given up (copying a large tree on a slow
/// disk takes minutes; nothing boxery asks of Incus takes half an hour).
const OPERATION_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// What a request to Incus can end in.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The daemon's socket could not be reached (no daemon, no socket, no permission).
    #[error("cannot reach incusd at {socket}: {source}")]
    Connect {
        /// The socket.
        socket: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The connection broke or the answer was not HTTP/JSON.
    #[error("talking to incusd: {0}")]
    Transport(String),
    /// Incus answered with an error (or an operation ended in one).
    #[error("incus: {message} (HTTP {status})")]
    Status {
        /// The HTTP status (`error_code`).
        status: u16,
        /// Incus's message.
        message: String,
    },
    /// An ETag did not match: the object changed since it was read.
    #[error("incus: the object changed while it was being updated")]
    Changed,
}

impl ApiError {
    /// Whether Incus said the object does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, ApiError::Status { status: 404, .. })
    }
    /// Whether Incus refused because the object already exists.
    pub fn is_conflict(&self) -> bool {
        matches!(self, ApiError::Status { status: 409, .. })
            || matches!(self, ApiError::Status { message, .. } if message.contains("already exists"))
    }
}

/// A request body: JSON, bytes of a file, or nothing.
type Body = BoxBody<Bytes, std::io::Error>;

fn empty() -> Body {
    Full::new(Bytes::new()).map_err(|e| match e {}).boxed()
}

fn json_body(v: &Value) -> Body {
    Full::new(Bytes::from(v.to_string()))
        .map_err(|e| match e {})
        .boxed()
}

/// The Incus API at one unix socket.
#[derive(Debug, Clone)]
pub struct Client {
    socket: PathBuf,
}

/// A raw answer: status, ETag, body.
struct Answer {
    status: StatusCode,
    etag: Option<String>,
    body: Bytes,
}

impl Client {
    /// The API at `socket` (`/var/lib/incus/unix.socket`).
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Client {
            socket: socket.into(),
        }
    }

    /// The socket it talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Body,
        headers: &[(&str, String)],
        limit: Duration,
    ) -> Result<Answer, ApiError> {
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|source| ApiError::Connect {
                socket: self.socket.clone(),
                source,
            })?;
        let t = |e: &dyn std::fmt::Display| ApiError::Transport(e.to_string());
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| t(&e))?;
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, "incus");
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        let req = req.body(body).map_err(|e| t(&e))?;
        let work = async {
            let resp = sender.send_request(req).await.map_err(|e| t(&e))?;
            let status = resp.status();
            let etag = resp
                .headers()
                .get(hyper::header::ETAG)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| t(&e))?
                .to_bytes();
            Ok(Answer { status, etag, body })
        };
        let out = tokio::time::timeout(limit, work).await.unwrap_or_else(|_| {
            Err(ApiError::Transport(format!(
                "no answer to {path} within {limit:?}"
            )))
        });
        conn.abort();
        out
    }

    /// Send and read the envelope, giving up after `limit` (`REQUEST_TIMEOUT` but for an
    /// upload): `Ok((envelope, etag))` for sync and async answers.
    async fn envelope(
        &self,
        method: Method,
        path: &str,
        body: Body,
        headers: &[(&str, String)],
        limit: Duration,
    ) -> Result<(Value, Option<String>), ApiError> {
        let a = self.send(method, path, body, headers, limit).await?;
        if a.status == StatusCode::PRECONDITION_FAILED {
            return Err(ApiError::Changed);
        }
        let v: Value = serde_json::from_slice(&a.body).map_err(|e| {
            ApiError::Transport(format!(
                "{path}: HTTP {} with a body that is not JSON ({e}): {}",
                a.status,
                String::from_utf8_lossy(&a.body[..a.body.len().min(200)])
            ))
        })?;
        if v["type"] == "error" || !a.status.is_success() {
            return Err(ApiError::Status {
                status: v["error_code"]
                    .as_u64()
                    .map(|c| c as u16)
                    .unwrap_or(a.status.as_u16()),
                message: v["error"].as_str().unwrap_or("").to_string(),
            });
        }
        Ok((v, a.etag))
    }

    /// Wait for the operation an async answer started; its metadata when it succeeded.
    async fn wait(&self, envelope: Value) -> Result<Value, ApiError> {
        if envelope["type"] != "async" {
            return Ok(envelope["metadata"].clone());
        }
        let op = envelope["operation"]
            .as_str()
            .ok_or_else(|| ApiError::Transport("an async answer without its operation".into()))?
            .to_string();
        let started = std::time::Instant::now();
        loop {
            if started.elapsed() > OPERATION_TIMEOUT {
                return Err(ApiError::Transport(format!(
                    "operation {op} still running after {OPERATION_TIMEOUT:?}: given up"
                )));
            }
            let (v, _) = self
                .envelope(
                    Method::GET,
                    &format!("{op}/wait?timeout={WAIT_SECONDS}"),
                    empty(),
                    &[],
                    REQUEST_TIMEOUT,
                )
                .await?;
            let m = &v["metadata"];
            match m["status_code"].as_u64() {
                Some(200) => return Ok(m["metadata"].clone()),
                // still running (103) or about to (100, 105): ask again
                Some(100..=199) => continue,
                Some(code) => {
                    return Err(ApiError::Status {
                        status: code as u16,
                        message: m["err"].as_str().unwrap_or("the operation failed").into(),
                    });
                }
                None => {
                    return Err(ApiError::Transport(format!(
                        "operation {op}: an answer without a status: {m}"
                    )));
                }
            }
        }
    }

    /// `GET path`: its `metadata`.
    pub async fn get(&self, path: &str) -> Result<Value, ApiError> {
        Ok(self.get_etag(path).await?.0)
    }

    /// `GET path`: its `metadata` and ETag.
    pub async fn get_etag(&self, path: &str) -> Result<(Value, Option<String>), ApiError> {
        let (v, etag) = self
            .envelope(Method::GET, path, empty(), &[], REQUEST_TIMEOUT)
            .await?;
        Ok((v["metadata"].clone(), etag))
    }

    /// `GET path`, `None` for a 404.
    pub async fn get_opt(&self, path: &str) -> Result<Option<Value>, ApiError> {
        match self.get(path).await {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `METHOD path` with a JSON body (`Value::Null`: none), waiting for the operation it
    /// starts; the operation's (or the answer's) metadata.
    pub async fn call(&self, method: Method, path: &str, body: Value) -> Result<Value, ApiError> {
        let (body, headers) = if body.is_null() {
            (empty(), vec![])
        } else {
            (
                json_body(&body),
                vec![("content-type", "application/json".to_string())],
            )
        };
        let (v, _) = self
            .envelope(method, path, body, &headers, REQUEST_TIMEOUT)
            .await?;
        self.wait(v).await
    }

    /// `PUT path` with `body`, only if the object still has ETag `etag`
    /// ([`ApiError::Changed`] otherwise).
    pub async fn put_if_match(
        &self,
        path: &str,
        body: Value,
        etag: Option<&str>,
    ) -> Result<Value, ApiError> {
        let mut headers = vec![("content-type", "application/json".to_string())];
        if let Some(e) = etag {
            headers.push(("if-match", e.to_string()));
        }
        let (v, _) = self
            .envelope(
                Method::PUT,
                path,
                json_body(&body),
                &headers,
                REQUEST_TIMEOUT,
            )
            .await?;
        self.wait(v).await
    }

    /// `POST path` with the bytes of `file` as the body and `headers`, waiting for the
    /// operation (an image upload).
    pub async fn upload(
        &self,
        path: &str,
        file: &Path,
        headers: &[(&str, String)],
    ) -> Result<Value, ApiError> {
        use futures::TryStreamExt;
        let f = tokio::fs::File::open(file)
            .await
            .map_err(|e| ApiError::Transport(format!("opening {}: {e}", file.display())))?;
        let len = f
            .metadata()
            .await
            .map_err(|e| ApiError::Transport(format!("reading {}: {e}", file.display())))?
            .len();
        let stream = tokio_util::io::ReaderStream::with_capacity(f, 1 << 20).map_ok(Frame::data);
        let body = StreamBody::new(stream).boxed();
        let mut h = headers.to_vec();
        h.push(("content-type", "application/octet-stream".into()));
        h.push(("content-length", len.to_string()));
        let (v, _) = self
            .envelope(Method::POST, path, body, &h, UPLOAD_TIMEOUT)
            .await?;
        self.wait(v).await
    }

    /// Write `data` to `path` inside instance `instance` of project `project` (mode `mode`,
    /// owned by root), through the files API: works on a stopped instance too.
    pub async fn push_file(
        &self,
        project: &str,
        instance: &str,
        path: &str,
        data: &[u8],
        mode: u32,
    ) -> Result<(), ApiError> {
        let body = Full::new(Bytes::copy_from_slice(data))
            .map_err(|e| match e {})
            .boxed();
        let headers = [
            ("content-type", "application/octet-stream".to_string()),
            ("x-incus-type", "file".to_string()),
            ("x-incus-mode", format!("{mode:04o}")),
            ("x-incus-uid", "0".to_string()),
            ("x-incus-gid", "0".to_string()),
            ("x-incus-write", "overwrite".to_string()),
        ];
        self.envelope(
            Method::POST,
            &format!(
                "/1.0/instances/{instance}/files?project={project}&path={}",
                encode(path)
            ),
            body,
            &headers,
            REQUEST_TIMEOUT,
        )
        .await?;
        Ok(())
    }

    /// Make directory `path` inside instance `instance` (its parent must exist); a directory
    /// already there is kept.
    pub async fn mkdir(
        &self,
        project: &str,
        instance: &str,
        path: &str,
        mode: u32,
    ) -> Result<(), ApiError> {
        let headers = [
            ("x-incus-type", "directory".to_string()),
            ("x-incus-mode", format!("{mode:04o}")),
            ("x-incus-uid", "0".to_string()),
            ("x-incus-gid", "0".to_string()),
        ];
        match self
            .envelope(
                Method::POST,
                &format!(
                    "/1.0/instances/{instance}/files?project={project}&path={}",
                    encode(path)
                ),
                empty(),
                &headers,
                REQUEST_TIMEOUT,
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.is_conflict() => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// `s` percent-encoded for a query value (all but unreserved characters and `/`).
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_encoded() {
        assert_eq!(encode("/etc/ssh/key"), "/etc/ssh/key");
        assert_eq!(encode("a b&c=d"), "a%20b%26c%3Dd");
    }
}

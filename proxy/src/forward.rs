//! Forwarding an admitted credential-proxy request, one step each: the VM's concurrency
//! permit, the body (within the limit), the headers (the client's credentials and hop-by-hop
//! headers out, the grants' in), the upstream call, and the response streamed back with its
//! audit record written when the stream ends ([`Finish`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use tokio::sync::OwnedSemaphorePermit;

use crate::admit::{Plan, admit};
use crate::audit::Record;
use crate::usage::{Charge, Meter};
use crate::{Inner, Refusal, Served, egress, refuse};

/// Hop-by-hop headers: never passed on, in either direction.
pub(crate) const HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Request headers never forwarded besides [`HOP`]: credentials the client sent, and what
/// describes the client's side of the hop.
const CLIENT: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "x-goog-api-key",
    "x-boxery-token",
    "cookie",
    "host",
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
];

/// Every request: admit, limit, forward, stream back, audit.
pub(crate) async fn handle(State(s): State<Served>, mut req: Request) -> Response {
    if egress::is_own(&s, &req) {
        if req.method() == axum::http::Method::CONNECT {
            return egress::tunnel_to_own(s, req);
        }
        egress::to_origin_form(&mut req);
    }
    if egress::is_egress(&req) {
        return egress::handle(s, req).await;
    }
    let mut at = Arrival::new(Record {
        path: req.uri().path().to_string(),
        ..Record::begin(req.method())
    });
    match forward(&s, req, &mut at).await {
        Ok(r) => r,
        Err(r) => {
            at.ended(&s.proxy.inner, r.status, Some(r.message.clone()));
            r.into_response()
        }
    }
}

/// Admit `req`, send it upstream and stream the answer back. `Err`: refused (or failed)
/// before any response, and not audited yet; `Ok`: audited when the response ends.
async fn forward(s: &Served, req: Request, at: &mut Arrival) -> Result<Response, Refusal> {
    let p = &s.proxy.inner;
    let (parts, body) = req.into_parts();
    let plan = admit(s, &parts, &mut at.rec).await?;
    let Some(permit) = p.permit(&plan.vm, p.limits.concurrency) else {
        return Err(refuse(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "VM {} already has {} requests in flight through the proxy",
                plan.vm, p.limits.concurrency
            ),
        ));
    };
    let (body, bytes_in) = read_body(&parts.headers, body, p.limits.max_body).await?;
    at.rec.bytes_in = bytes_in;
    let up = send(p, &parts, &plan, body, &at.rec).await?;
    let status = up.status();
    let mut resp = Response::builder().status(status);
    for (n, v) in up.headers() {
        if !HOP.contains(&n.as_str()) {
            resp = resp.header(n, v);
        }
    }
    at.rec.status = status.as_u16();
    let mut fin = at.finish(p, None, permit);
    if let Some(charge) = plan.charge {
        // what a successful answer says it used; any other answer uses nothing
        let meter = status.is_success().then(|| {
            let ct = up
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            Meter::new(ct, fin.rec.bytes_in, charge.generates)
        });
        fin.meter = Some(std::sync::Mutex::new((charge, meter)));
    }
    Ok(resp.body(fin.body(up.bytes_stream())).unwrap_or_else(|_| {
        refuse(
            StatusCode::BAD_GATEWAY,
            "the upstream's response headers are invalid",
        )
        .into_response()
    }))
}

/// The request body and its length: streamed when its length is declared (hyper holds the
/// client to it) and within `max`; without a length, read up to `max` first, so an oversized
/// body reaches no one.
async fn read_body(
    headers: &HeaderMap,
    body: Body,
    max: u64,
) -> Result<(reqwest::Body, u64), Refusal> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_big = || {
        refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than the proxy's limit of {max} bytes"),
        )
    };
    match declared {
        Some(n) if n > max => Err(too_big()),
        Some(n) => Ok((reqwest::Body::wrap_stream(body.into_data_stream()), n)),
        None => {
            match http_body_util::BodyExt::collect(http_body_util::Limited::new(body, max as usize))
                .await
            {
                Ok(c) => {
                    let b: Bytes = c.to_bytes();
                    let n = b.len() as u64;
                    Ok((reqwest::Body::from(b), n))
                }
                Err(e)
                    if e.downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some() =>
                {
                    Err(too_big())
                }
                Err(_) => Err(refuse(
                    StatusCode::BAD_REQUEST,
                    "the request body could not be read",
                )),
            }
        }
    }
}

/// The headers sent upstream: the client's, but for [`CLIENT`] and [`HOP`], and the grants'.
/// A metered request asks for its answer uncompressed (`identity`), so that its usage can be
/// read as it passes.
fn upstream_headers(
    sent: &HeaderMap,
    inject: &[(HeaderName, HeaderValue)],
    metered: bool,
) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (n, v) in sent {
        let dropped = CLIENT.contains(&n.as_str())
            || HOP.contains(&n.as_str())
            || (metered && n == header::ACCEPT_ENCODING);
        if !dropped {
            headers.append(n.clone(), v.clone());
        }
    }
    if metered {
        headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
    }
    for (n, v) in inject {
        headers.insert(n.clone(), v.clone());
    }
    headers
}

/// Send the request upstream; a failure is 504 (no answer in time) or 502.
async fn send(
    p: &Inner,
    parts: &Parts,
    plan: &Plan,
    body: reqwest::Body,
    rec: &Record,
) -> Result<reqwest::Response, Refusal> {
    let sent = p
        .client
        .request(parts.method.clone(), &plan.url)
        .headers(upstream_headers(
            &parts.headers,
            &plan.inject,
            plan.charge.is_some(),
        ))
        .body(body)
        .timeout(p.limits.timeout)
        .send()
        .await;
    sent.map_err(|e| {
        let (status, what) = if e.is_timeout() {
            (StatusCode::GATEWAY_TIMEOUT, "did not answer in time")
        } else {
            (StatusCode::BAD_GATEWAY, "could not be reached")
        };
        let host = rec.host.clone().unwrap_or_default();
        tracing::warn!(vm = %plan.vm, grant = %plan.grants, host = %host, error = %e.without_url(), "proxy upstream failed");
        refuse(status, format!("the upstream {host} {what}"))
    })
}

/// `s`, adding the length of each chunk to `counter` as it passes.
pub(crate) fn counted<S, B, E>(s: S, counter: Arc<AtomicU64>) -> impl Stream<Item = Result<B, E>>
where
    S: Stream<Item = Result<B, E>>,
    B: AsRef<[u8]>,
{
    s.map(move |chunk| {
        if let Ok(b) = &chunk {
            counter.fetch_add(b.as_ref().len() as u64, Ordering::Relaxed);
        }
        chunk
    })
}

/// Writes a forwarded request's audit record when its response stream is dropped, and holds
/// its VM's concurrency permit until then.
pub(crate) struct Finish {
    audit: Arc<Inner>,
    pub(crate) rec: Record,
    started: Instant,
    pub(crate) bytes: Arc<AtomicU64>,
    /// Request body bytes, when they are counted as they stream (the egress proxy's).
    bytes_in: Option<Arc<AtomicU64>>,
    /// An LLM request's charge and the meter reading its answer (none for a failed answer).
    pub(crate) meter: Option<std::sync::Mutex<(Charge, Option<Meter>)>>,
    _permit: OwnedSemaphorePermit,
}

/// A request being served: its audit record so far, and when it arrived.
pub(crate) struct Arrival {
    pub(crate) rec: Record,
    started: Instant,
}

impl Arrival {
    /// A request arriving now, recorded as `rec`.
    pub(crate) fn new(rec: Record) -> Self {
        Arrival {
            rec,
            started: Instant::now(),
        }
    }

    /// The record, handed to a response that writes it when it ends, holding `permit` until
    /// then (`bytes_in`: the request body's bytes, when they are counted as they stream).
    pub(crate) fn finish(
        &mut self,
        p: &Arc<Inner>,
        bytes_in: Option<Arc<AtomicU64>>,
        permit: OwnedSemaphorePermit,
    ) -> Finish {
        Finish {
            audit: p.clone(),
            rec: std::mem::take(&mut self.rec),
            started: self.started,
            bytes: Arc::new(AtomicU64::new(0)),
            bytes_in,
            meter: None,
            _permit: permit,
        }
    }

    /// Audit a request that ends here: refused, or failed before any response (`reason`,
    /// unless the record has one).
    pub(crate) fn ended(mut self, p: &Inner, status: StatusCode, reason: Option<String>) {
        self.rec.status = status.as_u16();
        self.rec.ms = self.started.elapsed().as_millis() as u64;
        if self.rec.reason.is_none() {
            self.rec.reason = reason;
        }
        ended(&p.audit, &self.rec, self.started);
    }
}

impl Finish {
    /// The response body of `s`, counted; the record is written when it is dropped.
    pub(crate) fn body<S, E>(self, s: S) -> Body
    where
        S: Stream<Item = Result<Bytes, E>> + Send + 'static,
        E: Into<axum::BoxError> + 'static,
    {
        let counter = self.bytes.clone();
        Body::from_stream(counted(s, counter).map(move |chunk| {
            if let (Ok(b), Some(m)) = (&chunk, &self.meter) {
                let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(meter) = m.1.as_mut() {
                    meter.feed(b);
                }
            }
            chunk
        }))
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        self.rec.bytes_out = self.bytes.load(Ordering::Relaxed);
        if let Some(b) = &self.bytes_in {
            self.rec.bytes_in = b.load(Ordering::Relaxed);
        }
        self.rec.ms = self.started.elapsed().as_millis() as u64;
        ended(&self.audit.audit, &self.rec, self.started);
        if let Some(m) = self.meter.take() {
            let (charge, meter) = m.into_inner().unwrap_or_else(|e| e.into_inner());
            let used = meter.map(Meter::finish).unwrap_or_default();
            self.audit.accounting.record(&charge, used);
        }
    }
}

/// A request that ended: appended to the audit log and counted in the proxy's metrics.
fn ended(audit: &crate::audit::Audit, rec: &Record, started: Instant) {
    audit.write(rec);
    let route = match rec.route.as_deref() {
        Some("llm") => "llm",
        Some("edge") => "edge",
        Some("egress") => "egress",
        _ => "none",
    };
    boxery_metrics::METRICS
        .proxy
        .record(boxery_metrics::Transfer {
            vm: rec.vm.as_deref(),
            route,
            code: rec.status,
            bytes_in: rec.bytes_in,
            bytes_out: rec.bytes_out,
            seconds: started.elapsed().as_secs_f64(),
        });
}

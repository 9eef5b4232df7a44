//! The guests' name lookups (docs/egress.md, "Name lookups"): a VM's network helper sends
//! each DNS query its guest makes (tagged with where the answer goes, `boxery_net::dns`) to
//! the VM's own datagram socket, and this answers it by the VM's egress policy, as the egress
//! proxy decides a connection. Lookups over TCP (RFC 7766: each message after its 2-byte
//! length) arrive on the VM's own stream socket, each connection one of its guest's, and are
//! answered the same way.
//!
//! # Guarantees
//! - The VM is the socket's; its policy is read per query (`$BOXERY_HOME/egress/<vm>`).
//! - A name the policy refuses is never looked up: the answer is NXDOMAIN with an Extended
//!   DNS Error "Blocked" (RFC 8914, when the query has EDNS) that says why in the words of
//!   the egress proxy's refusal.
//! - An allowed name is resolved as the egress proxy resolves it (config
//!   `proxy.egress.resolve`, then the host's resolver) and only addresses a guest may reach
//!   are given (no private, loopback, link-local, metadata or host address: a name that has
//!   only those is NXDOMAIN, with why). IPv4 only, at most [`MAX_ADDRS`], [`TTL`] seconds.
//! - Only one question of class IN and opcode QUERY is answered; other types of an allowed
//!   name (AAAA: the guest has no IPv6; MX, TXT, …) get an empty answer; malformed queries,
//!   responses and names that are not host names get nothing looked up.
//! - At most [`IN_FLIGHT`] lookups of one VM at a time, and [`PER_SECOND`] a second after a
//!   burst of [`BURST`], over UDP and TCP together; more are dropped unanswered (the guest's
//!   resolver asks again; over TCP the connection is closed). Over TCP: at most
//!   [`TCP_CONNECTIONS`] connections of one VM (more are closed at once), each closed after
//!   [`TCP_IDLE`] without a whole query, or at a length outside a DNS query's. Every
//!   answered lookup is audited (`DNS`, the name, the type, the status: 200 answered, 403
//!   refused, 404 not found, 502 the host's resolver did not answer: SERVFAIL).
//!
//! # Caveats
//! - An allowed name's answer says where it is; a guest still reaches it only through the
//!   egress proxy, which resolves and checks again.

use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::{Edns, Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::opt::EdnsOption;
use hickory_proto::rr::{DNSClass, RData, Record, RecordType, rdata::A};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixDatagram, UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

use crate::audit;
use crate::egress::{Unreachable, lookup, policy_refusal};
use crate::{Inner, Proxy, clear_socket};

/// The tag before each query and its answer (`boxery_net::dns::TAG`): echoed unchanged.
pub const TAG: usize = 12;
/// The longest query taken (a DNS message over UDP with EDNS's common limit).
pub const MAX_QUERY: usize = 1232;
/// The most addresses in one answer (fewer when the answer would pass the client's size:
/// 512 bytes without EDNS).
pub const MAX_ADDRS: usize = 16;
/// Seconds an answer may be cached.
pub const TTL: u32 = 30;
/// Lookups of one VM at a time.
pub const IN_FLIGHT: usize = 32;
/// Lookups one VM may make in a burst, and each second after it ([`Bucket`]): more are
/// dropped unanswered and unaudited, so a guest cannot flood the audit log (a guest's
/// resolver caches answers: far fewer in use).
pub const BURST: f64 = 100.0;
/// See [`BURST`].
pub const PER_SECOND: f64 = 20.0;
/// A VM's lookup connections over TCP at once.
pub const TCP_CONNECTIONS: usize = 8;
/// How long a TCP connection may wait for its next whole query (or take an answer).
pub const TCP_IDLE: Duration = Duration::from_secs(10);
/// The shortest DNS message (its header).
const DNS_HEADER: usize = 12;

/// A token bucket of [`BURST`] tokens refilled at [`PER_SECOND`].
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new() -> Self {
        Bucket {
            tokens: BURST,
            at: Instant::now(),
        }
    }

    /// Take a token if there is one.
    fn take(&mut self) -> bool {
        let now = Instant::now();
        self.tokens =
            (self.tokens + now.duration_since(self.at).as_secs_f64() * PER_SECOND).min(BURST);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}
/// The Extended DNS Error option (RFC 8914) and its "Blocked" code.
const EDE_OPTION: u16 = 15;
const EDE_BLOCKED: u16 = 15;
/// The longest reason carried in an Extended DNS Error.
const EDE_TEXT: usize = 200;

/// One VM's lookup rate ([`Bucket`]), over UDP and TCP together, and how many were dropped.
#[derive(Debug)]
struct Rate {
    bucket: Bucket,
    dropped: u64,
}

impl Rate {
    /// Whether one more lookup of `vm` may be answered now (a warning at each power of two
    /// dropped).
    fn take(rate: &Mutex<Rate>, vm: &str) -> bool {
        let mut r = rate.lock().unwrap_or_else(|e| e.into_inner());
        if r.bucket.take() {
            return true;
        }
        r.dropped += 1;
        if r.dropped.is_power_of_two() {
            tracing::warn!(vm = %vm, dropped = r.dropped, "a guest's name lookups past {PER_SECOND}/s are dropped");
        }
        false
    }
}

/// Answer VM `vm`'s lookups arriving on `sock` until `stop`.
async fn serve(
    proxy: Proxy,
    vm: String,
    sock: UnixDatagram,
    rate: Arc<Mutex<Rate>>,
    stop: CancellationToken,
) {
    let sock = Arc::new(sock);
    let mut buf = vec![0u8; TAG + MAX_QUERY + 1];
    loop {
        let got = tokio::select! {
            _ = stop.cancelled() => return,
            got = sock.recv_from(&mut buf) => got,
        };
        let Ok((n, from)) = got else {
            // (not a hot loop on a socket that keeps failing)
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let Some(to) = from.as_pathname().map(Path::to_path_buf) else {
            continue; // an unnamed sender cannot be answered
        };
        if !(TAG..=TAG + MAX_QUERY).contains(&n) {
            continue;
        }
        if !Rate::take(&rate, &vm) {
            continue;
        }
        let Some(permit) = proxy.inner.permit(&format!("dns {vm}"), IN_FLIGHT) else {
            continue;
        };
        let (tag, query) = (buf[..TAG].to_vec(), buf[TAG..n].to_vec());
        let (proxy, vm, sock) = (proxy.clone(), vm.clone(), sock.clone());
        tokio::spawn(async move {
            if let Some(answer) = answer(&proxy.inner, &vm, &query, Transport::Udp).await {
                let _ = sock.send_to(&[&tag[..], &answer].concat(), &to).await;
            }
            drop(permit);
        });
    }
}

/// Answer VM `vm`'s lookups over TCP arriving on `listener` until `stop`.
async fn serve_tcp(
    proxy: Proxy,
    vm: String,
    listener: UnixListener,
    rate: Arc<Mutex<Rate>>,
    stop: CancellationToken,
) {
    let open = Arc::new(tokio::sync::Semaphore::new(TCP_CONNECTIONS));
    loop {
        let got = tokio::select! {
            _ = stop.cancelled() => return,
            got = listener.accept() => got,
        };
        let Ok((conn, _)) = got else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Ok(slot) = open.clone().try_acquire_owned() else {
            continue; // closed at once: the guest's resolver asks again
        };
        let (proxy, vm, rate, stop) = (proxy.clone(), vm.clone(), rate.clone(), stop.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = connection(&proxy, &vm, conn, &rate) => {}
            }
            drop(slot);
        });
    }
}

/// One TCP connection's queries, answered in order, until it closes, idles past
/// [`TCP_IDLE`], sends a length no query has, or passes the VM's rate.
async fn connection(proxy: &Proxy, vm: &str, mut conn: UnixStream, rate: &Mutex<Rate>) {
    use tokio::time::timeout;
    loop {
        let mut len = [0u8; 2];
        if !matches!(
            timeout(TCP_IDLE, conn.read_exact(&mut len)).await,
            Ok(Ok(_))
        ) {
            return;
        }
        let n = usize::from(u16::from_be_bytes(len));
        if !(DNS_HEADER..=MAX_QUERY).contains(&n) {
            return;
        }
        let mut query = vec![0u8; n];
        if !matches!(
            timeout(TCP_IDLE, conn.read_exact(&mut query)).await,
            Ok(Ok(_))
        ) {
            return;
        }
        if !Rate::take(rate, vm) {
            return;
        }
        let Some(permit) = proxy.inner.permit(&format!("dns {vm}"), IN_FLIGHT) else {
            return;
        };
        let Some(answer) = answer(&proxy.inner, vm, &query, Transport::Tcp).await else {
            return; // not a query: nothing more is read from this connection
        };
        drop(permit);
        let Ok(len) = u16::try_from(answer.len()) else {
            return;
        };
        let framed = [&len.to_be_bytes()[..], &answer].concat();
        if !matches!(timeout(TCP_IDLE, conn.write_all(&framed)).await, Ok(Ok(()))) {
            return;
        }
    }
}

/// How a query came, which bounds its answer's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transport {
    /// A datagram: within the client's size (512 bytes without EDNS).
    Udp,
    /// A stream: a message's 2-byte length is the only bound.
    Tcp,
}

/// Whether `name` (without its final dot) is a host name: labels of letters, digits, `-` and
/// `_`, 1 to 63 bytes, 253 in all.
fn host_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            (1..=63).contains(&l.len())
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// The answer to one query of VM `vm`, `None` when it gets none.
pub(crate) async fn answer(
    p: &Inner,
    vm: &str,
    query: &[u8],
    transport: Transport,
) -> Option<Vec<u8>> {
    let started = Instant::now();
    let q = Message::from_vec(query).ok()?;
    if q.metadata.message_type != MessageType::Query {
        return None;
    }
    let mut r = Message::response(q.metadata.id, q.metadata.op_code);
    r.metadata.recursion_desired = q.metadata.recursion_desired;
    r.metadata.recursion_available = true;
    let edns = q.edns.is_some();
    if edns {
        let mut e = Edns::new();
        e.set_max_payload(MAX_QUERY as u16);
        r.set_edns(e);
    }
    let answered = |mut r: Message, code: ResponseCode| {
        r.metadata.response_code = code;
        r.to_vec().ok()
    };
    if q.metadata.op_code != OpCode::Query {
        return answered(r, ResponseCode::NotImp);
    }
    let [question] = &q.queries[..] else {
        return answered(r, ResponseCode::FormErr);
    };
    r.add_query(question.clone());
    if question.query_class() != DNSClass::IN {
        return answered(r, ResponseCode::Refused);
    }
    let name = question
        .name()
        .to_ascii()
        .trim_end_matches('.')
        .to_ascii_lowercase();
    let kind = question.query_type();
    let mut rec = audit::Record {
        time: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        vm: Some(vm.to_string()),
        route: Some("dns".into()),
        method: "DNS".into(),
        host: Some(name.clone()),
        path: kind.to_string(),
        ..Default::default()
    };
    let policy = boxery_home::egress::read(&p.home, vm);
    let refusal = if !host_name(&name) {
        Some((404, None))
    } else if let Some(why) = policy_refusal(vm, &policy, &name) {
        Some((403, Some(why)))
    } else if kind == RecordType::A {
        match lookup(p, &name, 0).await {
            Ok(addrs) => {
                let v4 = addrs.iter().filter_map(|a| match a.ip() {
                    IpAddr::V4(ip) => Some(ip),
                    IpAddr::V6(_) => None,
                });
                for ip in v4.take(MAX_ADDRS) {
                    r.add_answer(Record::from_rdata(
                        question.name().clone(),
                        TTL,
                        RData::A(A(ip)),
                    ));
                }
                None
            }
            Err(Unreachable::Unresolved) => Some((404, None)),
            Err(Unreachable::Unanswered) => Some((502, None)),
            Err(Unreachable::Forbidden(why)) => Some((403, Some(why))),
        }
    } else {
        None // an allowed name's other types: no records
    };
    let code = match &refusal {
        None => ResponseCode::NoError,
        // the host's resolver did not answer: the guest may ask again
        Some((502, _)) => ResponseCode::ServFail,
        Some(_) => ResponseCode::NXDomain,
    };
    if let Some((_, Some(why))) = &refusal
        && edns
        && let Some(e) = r.edns.as_mut()
    {
        let text: String = why.chars().take(EDE_TEXT).collect();
        let data = [&EDE_BLOCKED.to_be_bytes()[..], text.as_bytes()].concat();
        e.options_mut()
            .insert(EdnsOption::Unknown(EDE_OPTION, data));
    }
    let (status, reason) = refusal.unwrap_or((200, None));
    rec.status = status;
    rec.reason = reason;
    rec.ms = started.elapsed().as_millis() as u64;
    p.audit.write(&rec);
    // within what the client takes (512 bytes without EDNS): addresses left out, not cut
    let limit = match (transport, &q.edns) {
        (Transport::Tcp, _) => usize::from(u16::MAX),
        (Transport::Udp, Some(e)) => usize::from(e.max_payload()).clamp(512, MAX_QUERY),
        (Transport::Udp, None) => 512,
    };
    r.metadata.response_code = code;
    loop {
        let bytes = r.to_vec().ok()?;
        if bytes.len() <= limit || r.answers.is_empty() {
            return Some(bytes);
        }
        r.answers.pop();
    }
}

/// Bind VM `vm`'s datagram socket at `path`, and its stream socket at `tcp` when given (each
/// mode 0600, a socket left there replaced), and answer its lookups until `stop`.
pub fn start(
    proxy: &Proxy,
    vm: &str,
    path: &Path,
    tcp: Option<&Path>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    clear_socket(path)?;
    let sock = UnixDatagram::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    let listener = match tcp {
        Some(tcp) => {
            clear_socket(tcp)?;
            let listener = UnixListener::bind(tcp)?;
            std::fs::set_permissions(tcp, std::fs::Permissions::from_mode(0o600))?;
            Some(listener)
        }
        None => None,
    };
    let rate = Arc::new(Mutex::new(Rate {
        bucket: Bucket::new(),
        dropped: 0,
    }));
    if let Some(listener) = listener {
        let (proxy, vm, rate, stop) = (proxy.clone(), vm.to_string(), rate.clone(), stop.clone());
        tokio::spawn(serve_tcp(proxy, vm, listener, rate, stop));
    }
    tokio::spawn(serve(proxy.clone(), vm.to_string(), sock, rate, stop));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_a_steady_rate() {
        let mut b = Bucket::new();
        let took = (0..1000).filter(|_| b.take()).count();
        assert_eq!(took, BURST as usize, "a burst, then nothing at once");
        // a second later: the rate's worth again
        b.at -= std::time::Duration::from_secs(1);
        let took = (0..1000).filter(|_| b.take()).count();
        assert_eq!(took, PER_SECOND as usize);
        // never more than a burst, however long it rested
        b.at -= std::time::Duration::from_secs(3600);
        assert_eq!((0..1000).filter(|_| b.take()).count(), BURST as usize);
    }
}

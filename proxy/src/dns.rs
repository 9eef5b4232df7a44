//! The guests' name lookups (docs/egress.md, "Name lookups"): a VM's network helper sends
//! each DNS query its guest makes (tagged with where the answer goes, `boxery_net::dns`) to
//! the VM's own datagram socket, and this answers it by the VM's egress policy, as the egress
//! proxy decides a connection.
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
//!   burst of [`BURST`]; more are dropped unanswered (the guest's resolver asks again). Every
//!   answered lookup is audited (`DNS`, the name, the type, the status: 200 answered, 403
//!   refused, 404 not found, 502 the host's resolver did not answer: SERVFAIL).
//!
//! # Caveats
//! - An allowed name's answer says where it is; a guest still reaches it only through the
//!   egress proxy, which resolves and checks again.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::opt::EdnsOption;
use hickory_proto::rr::{DNSClass, RData, Record, RecordType, rdata::A};
use tokio::net::UnixDatagram;
use tokio_util::sync::CancellationToken;

use crate::audit;
use crate::egress::{Unreachable, lookup, policy_refusal};
use crate::{Inner, Proxy};

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

/// Answer VM `vm`'s lookups arriving on `sock` until `stop`.
pub(crate) async fn serve(proxy: Proxy, vm: String, sock: UnixDatagram, stop: CancellationToken) {
    let sock = Arc::new(sock);
    let mut buf = vec![0u8; TAG + MAX_QUERY + 1];
    let mut bucket = Bucket::new();
    let mut dropped = 0u64;
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
        if !bucket.take() {
            dropped += 1;
            if dropped.is_power_of_two() {
                tracing::warn!(vm = %vm, dropped, "a guest's name lookups past {PER_SECOND}/s are dropped");
            }
            continue;
        }
        let Some(permit) = proxy.inner.permit(&format!("dns {vm}"), IN_FLIGHT) else {
            continue;
        };
        let (tag, query) = (buf[..TAG].to_vec(), buf[TAG..n].to_vec());
        let (proxy, vm, sock) = (proxy.clone(), vm.clone(), sock.clone());
        tokio::spawn(async move {
            if let Some(answer) = answer(&proxy.inner, &vm, &query).await {
                let _ = sock.send_to(&[&tag[..], &answer].concat(), &to).await;
            }
            drop(permit);
        });
    }
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
pub(crate) async fn answer(p: &Inner, vm: &str, query: &[u8]) -> Option<Vec<u8>> {
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
    let limit = match &q.edns {
        Some(e) => usize::from(e.max_payload()).clamp(512, MAX_QUERY),
        None => 512,
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

/// Bind VM `vm`'s socket at `path` (mode 0600, a socket left there replaced) and answer its
/// lookups until `stop`.
pub fn start(proxy: &Proxy, vm: &str, path: &Path, stop: CancellationToken) -> std::io::Result<()> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        std::fs::remove_file(path)?;
    }
    let sock = UnixDatagram::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    let (proxy, vm) = (proxy.clone(), vm.to_string());
    tokio::spawn(serve(proxy, vm, sock, stop));
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

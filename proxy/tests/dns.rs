//! The guests' name lookups over the real datagram socket, as a VM's network helper sends
//! them (tagged): answered by the VM's egress policy, refusals saying why, nothing looked up
//! that the policy refuses, malformed queries unanswered; and over the VM's stream socket
//! (DNS over TCP: several queries a connection, the same answers). The helper's side (frames to and
//! from a real guest) is `net/tests/guest.rs`.

mod support;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use boxery_api::network::{Egress, EgressPolicy};
use hickory_proto::op::{Edns, Message, OpCode, ResponseCode};
use hickory_proto::rr::{DNSClass, Name, RData, RecordType};
use support::Fixture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixDatagram, UnixStream};

const VM: &str = "d1";
const TAG: [u8; 12] = *b"tag-echoed!!";

/// The fixture's proxy answering VM d1's lookups on a socket, and a client bound beside it.
struct Dns {
    f: Fixture,
    client: UnixDatagram,
    server: PathBuf,
    /// The stream socket (lookups over TCP).
    tcp: PathBuf,
    _dir: tempfile::TempDir,
}

impl Dns {
    async fn start() -> Dns {
        let f = Fixture::start_with(|c| {
            for (name, ip) in [
                ("mirror.test", "203.0.113.7"),
                ("other.test", "203.0.113.8"),
                ("inside.test", "10.1.2.3"),
            ] {
                c.egress.resolve.insert(name.into(), ip.parse().unwrap());
            }
        })
        .await;
        let dir = tempfile::tempdir().unwrap();
        let server = dir.path().join("dns.sock");
        let tcp = dir.path().join("dns-tcp.sock");
        boxery_proxy::dns::start(&f.server, VM, &server, Some(&tcp), f.stop.child_token()).unwrap();
        let client = UnixDatagram::bind(dir.path().join("net.dns.sock")).unwrap();
        Dns {
            f,
            client,
            server,
            tcp,
            _dir: dir,
        }
    }

    fn policy(&self, p: EgressPolicy, allow: &[&str]) {
        boxery_home::egress::write(
            self.f.home(),
            VM,
            &Egress {
                policy: p,
                allow: allow.iter().map(|s| s.to_string()).collect(),
            },
        )
        .unwrap();
    }

    /// Send raw bytes after the tag; the answer without its tag, `None` after 500 ms.
    async fn raw(&self, query: &[u8]) -> Option<Vec<u8>> {
        send(&self.client, &self.server, &[&TAG[..], query].concat()).await;
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_millis(500), self.client.recv(&mut buf))
            .await
            .ok()?
            .unwrap();
        assert_eq!(&buf[..12], &TAG, "the tag comes back unchanged");
        Some(buf[12..n].to_vec())
    }

    async fn ask(&self, q: &Message) -> Message {
        let answer = self.raw(&q.to_vec().unwrap()).await.expect("an answer");
        let m = Message::from_vec(&answer).unwrap();
        assert_eq!(m.metadata.id, q.metadata.id);
        m
    }
}

/// One query over a stream (its 2-byte length first); the answer, `None` when the connection
/// closes (or nothing comes in 2 s).
async fn over_tcp(c: &mut UnixStream, query: &[u8]) -> Option<Vec<u8>> {
    let framed = [&(query.len() as u16).to_be_bytes()[..], query].concat();
    c.write_all(&framed).await.ok()?;
    let read = async {
        let mut len = [0u8; 2];
        c.read_exact(&mut len).await.ok()?;
        let mut answer = vec![0u8; usize::from(u16::from_be_bytes(len))];
        c.read_exact(&mut answer).await.ok()?;
        Some(answer)
    };
    tokio::time::timeout(Duration::from_secs(2), read)
        .await
        .ok()
        .flatten()
}

async fn send(c: &UnixDatagram, to: &Path, msg: &[u8]) {
    c.send_to(msg, to).await.unwrap();
}

fn query(name: &str, kind: RecordType, edns: bool) -> Message {
    let mut m = Message::query();
    m.metadata.recursion_desired = true;
    m.add_query(hickory_proto::op::Query::query(
        Name::from_ascii(name).unwrap(),
        kind,
    ));
    if edns {
        m.set_edns(Edns::new());
    }
    m
}

fn addrs(m: &Message) -> Vec<Ipv4Addr> {
    m.answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}

/// The Extended DNS Error's text (RFC 8914: option 15, a 2-byte code, then text).
fn ede(m: &Message) -> Option<(u16, String)> {
    let e = m.edns.as_ref()?;
    let opt = e.option(hickory_proto::rr::rdata::opt::EdnsCode::Unknown(15))?;
    let hickory_proto::rr::rdata::opt::EdnsOption::Unknown(15, data) = opt else {
        return None;
    };
    Some((
        u16::from_be_bytes([data[0], data[1]]),
        String::from_utf8_lossy(&data[2..]).into_owned(),
    ))
}

#[tokio::test]
async fn lookups_follow_the_vms_egress_policy() {
    let d = Dns::start().await;

    // Public: a name answers with its address, for a short while
    d.policy(EgressPolicy::Public, &[]);
    let m = d.ask(&query("mirror.test.", RecordType::A, true)).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    assert_eq!(addrs(&m), vec![Ipv4Addr::new(203, 0, 113, 7)]);
    assert_eq!(m.answers[0].ttl, boxery_proxy::dns::TTL);
    assert!(m.edns.is_some(), "EDNS answered with EDNS");
    // a name that only has a private address is not given, and says why
    let m = d.ask(&query("inside.test.", RecordType::A, true)).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
    let (code, why) = ede(&m).expect("an extended error");
    assert_eq!(code, 15, "Blocked");
    assert!(why.contains("10.1.2.3") && why.contains("private"), "{why}");
    // AAAA of a name allowed: an empty answer (the guest has no IPv6)
    let m = d.ask(&query("mirror.test.", RecordType::AAAA, false)).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    assert!(m.answers.is_empty());
    // names are compared without case
    let m = d.ask(&query("MIRROR.Test.", RecordType::A, false)).await;
    assert_eq!(addrs(&m), vec![Ipv4Addr::new(203, 0, 113, 7)]);

    // Allowlist: the listed name answers, another (which would resolve) is refused, with why
    d.policy(EgressPolicy::Allowlist, &["mirror.test"]);
    let m = d.ask(&query("mirror.test.", RecordType::A, true)).await;
    assert_eq!(addrs(&m), vec![Ipv4Addr::new(203, 0, 113, 7)]);
    let m = d.ask(&query("other.test.", RecordType::A, true)).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
    assert!(m.answers.is_empty());
    let (_, why) = ede(&m).unwrap();
    assert!(
        why.contains("other.test is not in VM d1's egress allow list"),
        "{why}"
    );
    // without EDNS: the same refusal, no option to carry why
    let m = d.ask(&query("other.test.", RecordType::A, false)).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
    assert!(m.edns.is_none());
    // another type of a refused name is refused as well
    let m = d.ask(&query("other.test.", RecordType::TXT, false)).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);

    // Deny: nothing answers
    d.policy(EgressPolicy::Deny, &["mirror.test"]);
    let m = d.ask(&query("mirror.test.", RecordType::A, true)).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
    assert!(ede(&m).unwrap().1.contains("egress policy is Deny"));

    // every lookup is audited, with its VM, name, type and status
    let log = d.f.audit();
    let line = log
        .lines()
        .find(|l| l.contains("other.test") && l.contains("\"status\":403"))
        .unwrap_or_else(|| panic!("no refused lookup in the audit log: {log}"));
    assert!(
        line.contains("\"method\":\"DNS\"") && line.contains("\"vm\":\"d1\""),
        "{line}"
    );
    assert!(log.contains("\"host\":\"mirror.test\"") && log.contains("\"status\":200"));
}

#[tokio::test]
async fn malformed_and_odd_queries_get_nothing_looked_up() {
    let d = Dns::start().await;
    d.policy(EgressPolicy::Public, &[]);
    // not a DNS message, a message cut short, a response: no answer
    assert_eq!(d.raw(b"hello").await, None);
    let q = query("mirror.test.", RecordType::A, false)
        .to_vec()
        .unwrap();
    assert_eq!(d.raw(&q[..q.len() - 3]).await, None);
    let mut resp = query("mirror.test.", RecordType::A, false);
    resp.metadata.message_type = hickory_proto::op::MessageType::Response;
    assert_eq!(d.raw(&resp.to_vec().unwrap()).await, None);
    // shorter than a tag: nothing
    send(&d.client, &d.server, b"short").await;
    // two questions: FORMERR; another class: REFUSED; another opcode: NOTIMP
    let mut two = query("mirror.test.", RecordType::A, false);
    two.add_query(hickory_proto::op::Query::query(
        Name::from_ascii("other.test.").unwrap(),
        RecordType::A,
    ));
    assert_eq!(
        d.ask(&two).await.metadata.response_code,
        ResponseCode::FormErr
    );
    let mut chaos = query("version.bind.", RecordType::TXT, false);
    chaos.queries[0].query_class = DNSClass::CH;
    assert_eq!(
        d.ask(&chaos).await.metadata.response_code,
        ResponseCode::Refused
    );
    let mut status = query("mirror.test.", RecordType::A, false);
    status.metadata.op_code = OpCode::Status;
    assert_eq!(
        d.ask(&status).await.metadata.response_code,
        ResponseCode::NotImp
    );
    // a name that is no host name (a space in a label) is not looked up
    let odd = Name::from_labels(vec![&b"mir ror"[..], &b"test"[..]]).unwrap();
    let mut q = Message::query();
    q.add_query(hickory_proto::op::Query::query(odd, RecordType::A));
    let m = d.ask(&q).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
    // and the socket still answers
    let m = d.ask(&query("mirror.test.", RecordType::A, false)).await;
    assert_eq!(addrs(&m), vec![Ipv4Addr::new(203, 0, 113, 7)]);
}

#[tokio::test]
async fn lookups_over_tcp_are_answered_the_same_and_bounded() {
    use std::os::unix::fs::PermissionsExt;
    let d = Dns::start().await;
    let mode = std::fs::metadata(&d.tcp).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the stream socket is private");
    d.policy(EgressPolicy::Allowlist, &["mirror.test"]);

    // several queries on one connection, answered in order, as over UDP
    let mut c = UnixStream::connect(&d.tcp).await.unwrap();
    let q = query("mirror.test.", RecordType::A, false);
    let m = Message::from_vec(&over_tcp(&mut c, &q.to_vec().unwrap()).await.unwrap()).unwrap();
    assert_eq!(m.metadata.id, q.metadata.id);
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    assert_eq!(addrs(&m), vec![Ipv4Addr::new(203, 0, 113, 7)]);
    let q = query("other.test.", RecordType::A, true);
    let m = Message::from_vec(&over_tcp(&mut c, &q.to_vec().unwrap()).await.unwrap()).unwrap();
    assert_eq!(
        m.metadata.response_code,
        ResponseCode::NXDomain,
        "refused by the policy over TCP too"
    );
    let (code, why) = ede(&m).expect("an extended error");
    assert_eq!(code, 15);
    assert!(why.contains("other.test"), "{why}");
    let audit = d.f.audit();
    assert!(
        audit.contains(r#""host":"other.test""#),
        "audited as a UDP lookup is: {audit}"
    );

    drop(c);

    // a length no query has (shorter than a header, longer than a query): closed
    for bad in [&[0u8, 3, 1, 2, 3][..], &[0xff, 0xff]] {
        let mut c = UnixStream::connect(&d.tcp).await.unwrap();
        c.write_all(bad).await.unwrap();
        let mut buf = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(2), c.read(&mut buf))
            .await
            .expect("closed at once, not left waiting")
            .unwrap_or(0);
        assert_eq!(n, 0, "nothing answered to {bad:?}");
    }
    // not a query (a response): closed, nothing looked up
    let mut r = query("mirror.test.", RecordType::A, false);
    r.metadata.message_type = hickory_proto::op::MessageType::Response;
    let mut c = UnixStream::connect(&d.tcp).await.unwrap();
    assert_eq!(over_tcp(&mut c, &r.to_vec().unwrap()).await, None);

    // more connections than a VM may hold: the extra ones are closed, the others still answer
    // (a closed connection's slot comes back once the server has read its end: waited for)
    drop(c);
    let q = query("mirror.test.", RecordType::A, false);
    let held = async || {
        let t = std::time::Instant::now();
        loop {
            let mut c = UnixStream::connect(&d.tcp).await.unwrap();
            if over_tcp(&mut c, &q.to_vec().unwrap()).await.is_some() {
                return c;
            }
            assert!(t.elapsed() < Duration::from_secs(5), "no slot came back");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let mut open = Vec::new();
    for _ in 0..boxery_proxy::dns::TCP_CONNECTIONS {
        open.push(held().await);
    }
    let mut extra = UnixStream::connect(&d.tcp).await.unwrap();
    assert_eq!(
        over_tcp(&mut extra, &q.to_vec().unwrap()).await,
        None,
        "past {} connections",
        boxery_proxy::dns::TCP_CONNECTIONS
    );
    assert!(
        over_tcp(&mut open[0], &q.to_vec().unwrap()).await.is_some(),
        "a held connection still answers"
    );
    drop(open);
    // their slots come back once they close
    held().await;
}

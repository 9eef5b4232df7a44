//! A real etcd cluster for tests: `n` members (the Debian package's `etcd`, 3.4) on loopback
//! ports, each data directory in one temp dir. Each member runs under `setpriv --pdeathsig
//! KILL`, so it dies with the thread that started it even when the test process is killed;
//! dropping the cluster kills every member (by its PID) and removes the data.
#![allow(dead_code)] // each test binary uses what it needs

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One member.
struct Member {
    name: String,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

/// A running cluster.
pub struct Cluster {
    members: Vec<Member>,
    dir: tempfile::TempDir,
    token: String,
    max_txn_ops: u32,
    /// Clients speak TLS to it, with a certificate of their own.
    tls: Option<Tls>,
}

/// The PEM files of a cluster whose clients speak TLS (`--client-cert-auth`): its CA, the
/// members' certificate (for 127.0.0.1), and a client certificate.
pub struct Tls {
    /// The CA that signed both certificates.
    pub ca: PathBuf,
    /// A client's certificate.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
}

/// A CA, and a certificate for 127.0.0.1 and one for a client, signed by it; written into `dir`.
pub fn make_tls(dir: &std::path::Path) -> Tls {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let write = |name: &str, pem: String| {
        let p = dir.join(name);
        std::fs::write(&p, pem).expect("a PEM file");
        p
    };
    let ca_key = KeyPair::generate().expect("a key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "boxery test etcd CA");
    let ca_cert = ca.self_signed(&ca_key).expect("the CA");
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let signed = |names: Vec<String>| {
        let key = KeyPair::generate().expect("a key");
        let cert = CertificateParams::new(names)
            .expect("params")
            .signed_by(&key, &issuer)
            .expect("signed");
        (cert.pem(), key.serialize_pem())
    };
    let (server, server_key) = signed(vec!["127.0.0.1".into(), "localhost".into()]);
    let (client, client_key) = signed(vec!["boxery-client".into()]);
    Tls {
        ca: write("ca.pem", ca_cert.pem()),
        cert: write("client.pem", client),
        key: write("client-key.pem", client_key),
        server_cert: write("server.pem", server),
        server_key: write("server-key.pem", server_key),
    }
}

/// Fails the test with what to do when etcd is not installed.
fn etcd_binary() -> &'static str {
    let ok = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "etcd is not installed: `apt-get install etcd-server` (scripts/test.sh installs it)"
    );
    "etcd"
}

/// A free loopback port, and its listener (held until the member is about to bind it).
fn free_port() -> (u16, TcpListener) {
    let l = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    (l.local_addr().expect("its address").port(), l)
}

impl Cluster {
    /// Start `n` members and wait until the cluster answers.
    pub fn start(n: usize) -> Cluster {
        Cluster::start_with(n, 4096)
    }

    /// [`Cluster::start`] with `--max-txn-ops` set to `max_txn_ops`.
    pub fn start_with(n: usize, max_txn_ops: u32) -> Cluster {
        Cluster::start_all(n, max_txn_ops, false)
    }

    /// [`Cluster::start`] whose clients speak TLS and show a certificate signed by its CA
    /// ([`Cluster::tls`]).
    pub fn start_tls(n: usize) -> Cluster {
        Cluster::start_all(n, 4096, true)
    }

    /// The cluster's certificates, when its clients speak TLS.
    pub fn tls(&self) -> Option<&Tls> {
        self.tls.as_ref()
    }

    fn start_all(n: usize, max_txn_ops: u32, tls: bool) -> Cluster {
        etcd_binary();
        let dir = tempfile::tempdir().expect("temp dir");
        let tls = tls.then(|| make_tls(dir.path()));
        let mut held = Vec::new();
        let members: Vec<Member> = (0..n)
            .map(|i| {
                let (client, a) = free_port();
                let (peer, b) = free_port();
                held.push(a);
                held.push(b);
                Member {
                    name: format!("m{i}"),
                    client,
                    peer,
                    child: None,
                }
            })
            .collect();
        drop(held);
        let mut c = Cluster {
            members,
            dir,
            token: format!("boxery-test-{}", std::process::id()),
            max_txn_ops,
            tls,
        };
        for i in 0..n {
            c.spawn(i, "new");
        }
        c.wait_healthy(Duration::from_secs(60));
        c
    }

    fn data(&self, i: usize) -> PathBuf {
        self.dir.path().join(&self.members[i].name)
    }

    fn log(&self, i: usize) -> PathBuf {
        self.dir
            .path()
            .join(format!("{}.log", self.members[i].name))
    }

    fn spawn(&mut self, i: usize, state: &str) {
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect();
        let m = &self.members[i];
        let client = format!("{}://127.0.0.1:{}", self.scheme(), m.client);
        let peer = format!("http://127.0.0.1:{}", m.peer);
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.log(i))
            .expect("member log");
        let mut etcd = Command::new("setpriv");
        etcd.args(["--pdeathsig", "KILL", "--", "etcd"]);
        if let Some(t) = &self.tls {
            etcd.arg("--cert-file")
                .arg(&t.server_cert)
                .arg("--key-file")
                .arg(&t.server_key)
                .arg("--trusted-ca-file")
                .arg(&t.ca)
                .arg("--client-cert-auth");
        }
        let child = etcd
            .args(["--name", &m.name])
            .arg("--data-dir")
            .arg(self.data(i))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial.join(",")])
            .args(["--initial-cluster-state", state])
            .args(["--initial-cluster-token", &self.token])
            // a changed object is two to five operations of a transaction
            .args(["--max-txn-ops", &self.max_txn_ops.to_string()])
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("setpriv and etcd start");
        self.members[i].child = Some(child);
    }

    fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }

    /// `etcdctl` (API 3) on the running members, with this cluster's client certificate when
    /// it speaks TLS.
    fn etcdctl(&self) -> Command {
        let endpoints: Vec<String> = self
            .members
            .iter()
            .filter(|m| m.child.is_some())
            .map(|m| format!("{}://127.0.0.1:{}", self.scheme(), m.client))
            .collect();
        let mut c = Command::new("etcdctl");
        c.env("ETCDCTL_API", "3").args([
            "--endpoints",
            &endpoints.join(","),
            "--command-timeout=2s",
        ]);
        if let Some(t) = &self.tls {
            c.arg("--cacert")
                .arg(&t.ca)
                .arg("--cert")
                .arg(&t.cert)
                .arg("--key")
                .arg(&t.key);
        }
        c
    }

    /// `host:port` of every member's client URL, comma separated.
    pub fn hosts(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Wait until every running member says it is healthy (`etcdctl endpoint health`).
    pub fn wait_healthy(&mut self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            for (i, m) in self.members.iter_mut().enumerate() {
                if let Some(c) = m.child.as_mut()
                    && let Ok(Some(status)) = c.try_wait()
                {
                    let log =
                        std::fs::read_to_string(self.dir.path().join(format!("{}.log", m.name)))
                            .unwrap_or_default();
                    panic!("etcd member {i} exited ({status}):\n{log}");
                }
            }
            let ok = self
                .etcdctl()
                .args(["endpoint", "health"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the etcd cluster was not healthy within {within:?}; its logs are in {}",
                self.dir.path().display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The member etcd elected leader, as its members say (`etcdctl endpoint status`); `None`
    /// while there is none.
    pub fn leader(&self) -> Option<usize> {
        let running: Vec<usize> = (0..self.members.len())
            .filter(|&i| self.members[i].child.is_some())
            .collect();
        let out = self
            .etcdctl()
            .args(["endpoint", "status", "-w", "json"])
            .stderr(Stdio::null())
            .output()
            .ok()?;
        let all: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        let says_leader = all.as_array()?.iter().find(|e| {
            let s = &e["Status"];
            s["header"]["member_id"].as_u64().is_some() && s["header"]["member_id"] == s["leader"]
        })?;
        let client = says_leader["Endpoint"].as_str()?;
        running
            .into_iter()
            .find(|&i| client.ends_with(&format!(":{}", self.members[i].client)))
    }

    /// Kill member `i` (SIGKILL), as a crash.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start member `i` again on its data.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i, "existing");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

//! The API's cost against the store's own, in the same run (docs/benchmarks.md, issue 16).
//!
//! `cargo bench -p boxery-apiserver --bench api` (`BOXERY_BENCH_ONLY=get`: the GETs alone,
//! for a profiler). One process: a store in a temporary home holding `BOXERY_BENCH_OBJECTS`
//! Vms (default 1,000), the API on loopback over TLS (no controllers, so nothing else moves).
//! - the floor of any request here: a 64-byte TCP ping-pong between two tasks on loopback;
//! - GET of one object over one kept-alive TLS connection driven by the measuring task (no
//!   client pool), interleaved with `ObjectStore::get` of the same object and `GET /version`;
//! - the same GET through reqwest (a pooled client, as most programs use);
//! - LIST of every Vm (JSON, then a Table), against `ObjectStore::list`;
//! - watch delivery: 100 watchers of `vms`; each of 50 PATCHes over the API (one every
//!   100 ms) is timed from before the PATCH is sent to each watcher's receipt of its event.

use std::sync::Arc;
use std::time::{Duration, Instant};

use boxery_api::{DynObject, Selector};
use boxery_store::{ObjectRef, ObjectStore, Store};
use boxery_verbs::{Env, Verbs, Voice};
use futures::StreamExt;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// The thinnest HTTP/1.1 client: one kept-alive TLS connection, driven in the caller's task
/// (no pool, no connection task), so a timing holds the server's cost and little else.
struct Raw {
    tls: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    buf: Vec<u8>,
}

impl Raw {
    async fn connect(addr: std::net::SocketAddr, ca_pem: &[u8]) -> Raw {
        let mut roots = rustls::RootCertStore::empty();
        let der = <rustls::pki_types::CertificateDer as rustls::pki_types::pem::PemObject>::from_pem_slice(ca_pem).unwrap();
        roots.add(der).unwrap();
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        tcp.set_nodelay(true).unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(name, tcp)
            .await
            .unwrap();
        Raw {
            tls,
            buf: Vec::with_capacity(16 << 10),
        }
    }

    /// GET `path`; the status and the body.
    async fn get(&mut self, path: &str, auth: &str) -> (u16, Vec<u8>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let req =
            format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nauthorization: {auth}\r\n\r\n");
        self.tls.write_all(req.as_bytes()).await.unwrap();
        self.tls.flush().await.unwrap();
        self.buf.clear();
        let mut chunk = [0u8; 16 << 10];
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut resp = httparse::Response::new(&mut headers);
            if let httparse::Status::Complete(at) = resp.parse(&self.buf).unwrap() {
                let len: usize = resp
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                    .map(|h| std::str::from_utf8(h.value).unwrap().parse().unwrap())
                    .expect("a content-length");
                let code = resp.code.unwrap();
                while self.buf.len() < at + len {
                    let n = self.tls.read(&mut chunk).await.unwrap();
                    assert!(n > 0, "the server closed the connection");
                    self.buf.extend_from_slice(&chunk[..n]);
                }
                return (code, self.buf[at..at + len].to_vec());
            }
            let n = self.tls.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the server closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

fn vm(i: usize) -> DynObject {
    let v = serde_json::json!({
        "apiVersion": "boxery.dev/v1alpha1", "kind": "Vm",
        "metadata": {"name": format!("vm{i:04}"), "labels": {"bench": "yes"}},
        "spec": {"resources": {"cpus": 1, "memory": "512Mi", "disk": "1Gi"}, "source": {"image": "tiny"}},
    });
    boxery_api::normalize(v).expect("valid")
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::var("BOXERY_BENCH_OBJECTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let store = Store::open(&home.join("store.db")).unwrap();
    let objs: Vec<DynObject> = (0..n).map(vm).collect();
    store
        .apply_all(objs, &boxery_store::ApplyOptions::default())
        .unwrap();
    let env = Env::resolve(Some(home.clone()), Some("fake".into())).unwrap();
    let verbs = Verbs::with_store(env, Voice::Cli, Arc::new(store.clone()), true);
    let server = boxery_apiserver::ApiServer::bind(
        verbs,
        "127.0.0.1:0".parse().unwrap(),
        boxery_apiserver::Limits {
            rate_per_token: 1e9,
            burst_per_token: 1e9,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let server_addr = server.local_addr();
    let base = format!("https://{server_addr}");
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(server.run(stop.clone()));
    let token =
        boxery_apiserver::tokens::mint(&home, "bench", &boxery_apiserver::tokens::Scope::Full)
            .unwrap();
    let ca = std::fs::read(boxery_apiserver::tls::ca_file(&home)).unwrap();
    let client = reqwest::Client::builder()
        .use_rustls_tls()
        .add_root_certificate(reqwest::Certificate::from_pem(&ca).unwrap())
        .build()
        .unwrap();
    let auth = format!("Bearer {token}");
    let gv = format!("{base}/apis/boxery.dev/v1alpha1");
    let os: &dyn ObjectStore = &store;

    // The machine's floor for any request over loopback: a 64-byte TCP ping-pong between two
    // tasks of this runtime (no TLS, no HTTP, no store).
    let tcp_floor = {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            s.set_nodelay(true).unwrap();
            let mut b = [0u8; 64];
            while s.read_exact(&mut b).await.is_ok() {
                if s.write_all(&b).await.is_err() {
                    break;
                }
            }
        });
        let mut c = tokio::net::TcpStream::connect(at).await.unwrap();
        c.set_nodelay(true).unwrap();
        let mut b = [7u8; 64];
        let mut v = Vec::new();
        for i in 0..2200 {
            let t = Instant::now();
            c.write_all(&b).await.unwrap();
            c.read_exact(&mut b).await.unwrap();
            if i >= 200 {
                v.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        pct(&mut v, 0.5)
    };
    println!(
        "loopback TCP round trip between two tasks (the floor of any request): p50 {tcp_floor:.3} ms"
    );

    // GET, through the thinnest client, interleaved with the direct store read
    let key = ObjectRef::new("Vm", "vm0500");
    let path = "/apis/boxery.dev/v1alpha1/vms/vm0500";
    let mut raw = Raw::connect(server_addr, &ca).await;
    let (mut raw_get, mut raw_store, mut raw_floor) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..2200 {
        let t = Instant::now();
        let (code, body) = raw.get(path, &auth).await;
        let a = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
        let t = Instant::now();
        let o = os.get(&key).await.unwrap();
        let s = t.elapsed().as_secs_f64() * 1e3;
        assert!(o.is_some());
        let t = Instant::now();
        let (code, _) = raw.get("/version", &auth).await;
        let f = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(code, 200);
        if i >= 200 {
            raw_get.push(a);
            raw_store.push(s);
            raw_floor.push(f);
        }
    }
    let (ag, sg) = (pct(&mut raw_get, 0.5), pct(&mut raw_store, 0.5));
    println!(
        "GET one Vm, one kept-alive TLS connection: API p50 {ag:.3} ms (p99 {:.3} ms); store get p50 {sg:.3} ms; ratio {:.1}x",
        pct(&mut raw_get, 0.99),
        ag / sg,
    );
    println!(
        "  the API's own cost above the loopback round trip: {:.3} ms ({:.1}x a store get); GET against round trip + store get: {:.2}x; GET /version p50 {:.3} ms",
        ag - tcp_floor,
        (ag - tcp_floor) / sg,
        ag / (tcp_floor + sg),
        pct(&mut raw_floor, 0.5),
    );

    // GET through reqwest (a pooled client: its connection task adds a hop each way)
    let (mut api_get, mut store_get) = (Vec::new(), Vec::new());
    for i in 0..1200 {
        let t = Instant::now();
        let r = client
            .get(format!("{gv}/vms/vm0500"))
            .header("authorization", &auth)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
        let _ = r.bytes().await.unwrap();
        let a = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let o = os.get(&key).await.unwrap();
        assert!(o.is_some());
        let s = t.elapsed().as_secs_f64() * 1e3;
        if i >= 200 {
            api_get.push(a);
            store_get.push(s);
        }
    }
    // the floor: a request that reads nothing (TLS, HTTP, the token check)
    let mut floor = Vec::new();
    for i in 0..1200 {
        let t = Instant::now();
        let r = client
            .get(format!("{base}/version"))
            .header("authorization", &auth)
            .send()
            .await
            .unwrap();
        let _ = r.bytes().await.unwrap();
        if i >= 200 {
            floor.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    println!(
        "GET /version (TLS, HTTP and the token, no store): p50 {:.3} ms",
        pct(&mut floor, 0.5)
    );
    let (ag, sg) = (pct(&mut api_get, 0.5), pct(&mut store_get, 0.5));
    println!(
        "GET one Vm through reqwest: API p50 {ag:.3} ms (p99 {:.3} ms); store get p50 {sg:.3} ms; ratio {:.1}x",
        pct(&mut api_get, 0.99),
        ag / sg
    );

    if std::env::var("BOXERY_BENCH_ONLY").as_deref() == Ok("get") {
        // (for profiling the GET path alone: `perf record … target/release/deps/api-…`)
        stop.cancel();
        return;
    }

    // LIST
    let (mut api_list, mut table_list, mut store_list) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..25 {
        let t = Instant::now();
        let r = client
            .get(format!("{gv}/vms"))
            .header("authorization", &auth)
            .send()
            .await
            .unwrap();
        let b = r.bytes().await.unwrap();
        let a = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let r = client
            .get(format!("{gv}/vms"))
            .header("authorization", &auth)
            .header(
                "accept",
                "application/json;as=Table;v=v1;g=meta.k8s.io,application/json",
            )
            .send()
            .await
            .unwrap();
        let _ = r.bytes().await.unwrap();
        let tb = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let (all, _) = os.list("Vm", &Selector::default()).await.unwrap();
        let s = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(all.len(), n);
        if i == 0 {
            let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
            assert_eq!(v["items"].as_array().unwrap().len(), n);
        } else {
            api_list.push(a);
            table_list.push(tb);
            store_list.push(s);
        }
    }
    println!(
        "LIST {n} Vms: API JSON p50 {:.1} ms, Table p50 {:.1} ms; store list p50 {:.1} ms",
        pct(&mut api_list, 0.5),
        pct(&mut table_list, 0.5),
        pct(&mut store_list, 0.5)
    );

    // watch delivery with 100 watchers
    let watchers = 100;
    let updates = 50;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u64, Instant)>();
    let rev = store.revision().unwrap();
    let mut ready = Vec::new();
    for _ in 0..watchers {
        let r = client
            .get(format!(
                "{gv}/vms?watch=1&resourceVersion={rev}&fieldSelector=metadata.name=vm0001"
            ))
            .header("authorization", &auth)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
        let tx = tx.clone();
        let (up_tx, up_rx) = tokio::sync::oneshot::channel::<()>();
        ready.push(up_rx);
        tokio::spawn(async move {
            let mut s = r.bytes_stream();
            let mut buf = Vec::new();
            let _ = up_tx.send(());
            while let Some(Ok(chunk)) = s.next().await {
                let now = Instant::now();
                buf.extend_from_slice(&chunk);
                while let Some(p) = buf.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=p).collect();
                    let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
                    if let Some(seq) = v["object"]["metadata"]["labels"]["seq"].as_str() {
                        let _ = tx.send((seq.parse().unwrap(), now));
                    }
                }
            }
        });
    }
    for r in ready {
        let _ = r.await;
    }
    drop(tx);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut sent = Vec::new();
    for seq in 0..updates {
        let t = Instant::now();
        let r = client
            .patch(format!("{gv}/vms/vm0001"))
            .header("authorization", &auth)
            .header("content-type", "application/merge-patch+json")
            .body(format!(r#"{{"metadata":{{"labels":{{"seq":"{seq}"}}}}}}"#))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.text().await.unwrap());
        sent.push(t);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut lat = Vec::new();
    while let Ok((seq, at)) = rx.try_recv() {
        lat.push(at.duration_since(sent[seq as usize]).as_secs_f64() * 1e3);
    }
    let got = lat.len();
    println!(
        "watch: {watchers} watchers, {updates} PATCHes: {got} of {} deliveries; from before the PATCH to receipt p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        watchers * updates as usize,
        pct(&mut lat, 0.5),
        pct(&mut lat, 0.99),
        pct(&mut lat, 1.0)
    );
    stop.cancel();
}

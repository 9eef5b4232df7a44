//! Developer traffic under egress (issue 33, docs/egress.md "Developer traffic"): in a real
//! guest whose egress is an Allowlist, `git clone` over ssh, `pip install`, `npm install`,
//! `cargo fetch` (the `rust` layer), `apt-get install` and `docker pull` (the `docker` layer's
//! daemon) reach stand-in servers
//! with nothing set by the user but where to find the stand-in (the proxy settings are
//! boxery's), and a host not on the list is refused with the proxy's reason in each tool's own
//! error.
//!
//! The stand-ins run in a network namespace the test makes (`boxery-devtraffic`, an
//! "internet" address [`STANDIN`] routed from the host through a veth pair, as the drill's),
//! bound only there: OpenSSH's sshd serving a bare git repository through `git-shell`, and
//! one HTTPS server (a test CA the guest is given) for a PyPI simple index, an npm registry, a
//! sparse cargo registry and a Docker registry (API v2, read-only), one plain-HTTP server for
//! an apt repository. The egress proxy reaches them by the names
//! `config.yaml`'s `proxy.egress.resolve` gives them. The servers are killed by PID and the
//! namespace removed on drop, also when the test fails. Needs root (`ip netns`), OpenSSH's
//! server (`openssh-server`), `openssl`, `python3`, `git`, `dpkg-deb` and a static `busybox`
//! (`busybox-static`) on the host.

use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Kind, RealHome, common};

/// The stand-ins' network namespace and the host's end of its veth pair.
const NETNS: &str = "boxery-devtraffic";
const VETH: &str = "bxdevtr0";
/// The host's side of the pair (TEST-NET-2), and the stand-ins' "internet" address
/// (TEST-NET-3: public by the proxy's rules, not the drill's 203.0.113.10).
const HOST_SIDE: &str = "198.51.100.33";
const STANDIN: &str = "203.0.113.33";
/// The names the egress proxy resolves to [`STANDIN`]; the VM's allow list has all but the
/// last.
const GIT: &str = "git.standin.test";
const PYPI: &str = "pypi.standin.test";
const NPM: &str = "registry.standin.test";
const APT: &str = "apt.standin.test";
const DOCKER: &str = "docker.standin.test";
const CRATES: &str = "crates.standin.test";
const UNLISTED: &str = "unlisted.standin.test";

/// `ip ARGS`, failing the test with its stderr.
fn ip(args: &[&str]) {
    let o = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("ip (iproute2) is installed");
    assert!(
        o.status.success(),
        "ip {} failed (the stand-ins' network namespace needs root): {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr).trim()
    );
}

/// `PROGRAM ARGS` on the host, failing the test with its output.
fn host(program: &str, args: &[&str]) -> String {
    let o = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} on the host ({e}): install it"));
    assert!(
        o.status.success(),
        "{program} {args:?} failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The namespace, its servers and their files; on drop the servers are killed by PID and the
/// namespace and veth pair deleted.
struct Standins {
    dir: tempfile::TempDir,
    servers: Vec<(&'static str, Child)>,
}

impl Standins {
    /// The namespace with [`STANDIN`] in it, routed from the host. One left by a killed run
    /// is ours by name and removed first.
    fn make() -> Standins {
        let _ = Command::new("ip").args(["link", "del", VETH]).output();
        let _ = Command::new("ip").args(["netns", "del", NETNS]).output();
        ip(&["netns", "add", NETNS]);
        let s = Standins {
            dir: tempfile::Builder::new()
                .prefix("boxery-devtraffic-")
                .tempdir()
                .unwrap(),
            servers: Vec::new(),
        };
        let peer = format!("{VETH}p");
        ip(&[
            "link", "add", VETH, "type", "veth", "peer", "name", &peer, "netns", NETNS,
        ]);
        ip(&["-n", NETNS, "link", "set", "lo", "up"]);
        ip(&["-n", NETNS, "link", "set", &peer, "up"]);
        ip(&["link", "set", VETH, "up"]);
        ip(&["addr", "add", &format!("{HOST_SIDE}/32"), "dev", VETH]);
        ip(&[
            "-n",
            NETNS,
            "addr",
            "add",
            &format!("{STANDIN}/32"),
            "dev",
            &peer,
        ]);
        ip(&["route", "add", &format!("{STANDIN}/32"), "dev", VETH]);
        ip(&["-n", NETNS, "route", "add", "default", "dev", &peer]);
        s
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// Start `program args` inside the namespace (`ip netns exec` execs it: the child's PID is
    /// the server's), its stderr to `NAME.log`, and wait until `port` answers from the host.
    fn start(&mut self, name: &'static str, port: u16, program: &str, args: &[&str]) {
        let log = std::fs::File::create(self.path(&format!("{name}.log"))).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", NETNS, program])
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        self.servers.push((name, child));
        let addr = format!("{STANDIN}:{port}").parse().unwrap();
        common::eventually(Duration::from_secs(20), || {
            TcpStream::connect_timeout(&addr, Duration::from_millis(300))
                .ok()
                .map(|_| ())
        })
        .unwrap_or_else(|| {
            panic!(
                "the {name} stand-in does not answer at {addr} from the host: {}",
                self.log(name)
            )
        });
    }

    /// Kill the server `name` by its PID and wait for it.
    fn stop(&mut self, name: &str) {
        if let Some(i) = self.servers.iter().position(|(n, _)| *n == name) {
            let (_, mut c) = self.servers.remove(i);
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.path(&format!("{name}.log"))).unwrap_or_default()
    }
}

impl Drop for Standins {
    fn drop(&mut self) {
        for (_, c) in &mut self.servers {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip").args(["link", "del", VETH]).output();
        let _ = Command::new("ip").args(["netns", "del", NETNS]).output();
    }
}

/// The fixtures, made by Python's standard library in `DIR`: a wheel and its simple index, an
/// npm package's metadata and tarball, a `.deb` and a flat apt repository (Packages, Release).
/// Each package's content is `NONCE`.
const FIXTURES: &str = r#"
import base64, gzip, hashlib, io, json, os, subprocess, sys, tarfile, zipfile
d, nonce = sys.argv[1], sys.argv[2]
def put(p, b):
    p = os.path.join(d, p); os.makedirs(os.path.dirname(p), exist_ok=True)
    open(p, "wb").write(b if isinstance(b, bytes) else b.encode())
    return p
# PyPI: hello-standin 1.0, a pure wheel, and /simple/hello-standin/
files = {"hello_standin/__init__.py": "GREETING = %r\n" % nonce,
         "hello_standin-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: hello-standin\nVersion: 1.0\n",
         "hello_standin-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: boxery-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
rec = ""
for n, t in files.items():
    h = base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b"=").decode()
    rec += "%s,sha256=%s,%d\n" % (n, h, len(t.encode()))
files["hello_standin-1.0.dist-info/RECORD"] = rec + "hello_standin-1.0.dist-info/RECORD,,\n"
buf = io.BytesIO()
with zipfile.ZipFile(buf, "w") as z:
    for n, t in files.items(): z.writestr(n, t)
whl = buf.getvalue()
put("https/files/hello_standin-1.0-py3-none-any.whl", whl)
put("https/simple/hello-standin/index.html",
    '<html><body><a href="../../files/hello_standin-1.0-py3-none-any.whl#sha256=%s">hello_standin-1.0-py3-none-any.whl</a></body></html>\n'
    % hashlib.sha256(whl).hexdigest())
# npm: standin-hello 1.0.0, its metadata at /standin-hello and its tarball
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w:gz") as t:
    for n, c in {"package/package.json": json.dumps({"name": "standin-hello", "version": "1.0.0", "main": "index.js"}),
                 "package/index.js": "module.exports = %s;\n" % json.dumps(nonce)}.items():
        i = tarfile.TarInfo(n); b = c.encode(); i.size = len(b); i.mode = 0o644; t.addfile(i, io.BytesIO(b))
tgz = buf.getvalue()
put("https/tarballs/standin-hello-1.0.0.tgz", tgz)
put("https/standin-hello", json.dumps({"name": "standin-hello", "dist-tags": {"latest": "1.0.0"},
    "versions": {"1.0.0": {"name": "standin-hello", "version": "1.0.0", "main": "index.js",
        "dist": {"tarball": "https://registry.standin.test/tarballs/standin-hello-1.0.0.tgz",
                 "shasum": hashlib.sha1(tgz).hexdigest(),
                 "integrity": "sha512-" + base64.b64encode(hashlib.sha512(tgz).digest()).decode()}}}}))
# apt: standin-hello 1.0 (all), a flat repository at /debian/
pkg = os.path.join(d, "deb/standin-hello")
put("deb/standin-hello/DEBIAN/control", "Package: standin-hello\nVersion: 1.0\nArchitecture: all\nMaintainer: boxery tests <tests@boxery.invalid>\nDescription: boxery's apt stand-in\n")
put("deb/standin-hello/usr/share/standin-hello/nonce", nonce + "\n")
deb = os.path.join(d, "http/debian/standin-hello_1.0_all.deb"); os.makedirs(os.path.dirname(deb), exist_ok=True)
subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", pkg, deb], check=True, stdout=subprocess.DEVNULL)
b = open(deb, "rb").read()
packages = open(os.path.join(pkg, "DEBIAN/control")).read().rstrip("\n") + "\nFilename: ./standin-hello_1.0_all.deb\nSize: %d\nSHA256: %s\n\n" % (len(b), hashlib.sha256(b).hexdigest())
put("http/debian/Packages", packages)
release = "Origin: boxery-standin\nLabel: boxery-standin\nSuite: standin\nCodename: standin\nArchitectures: all amd64\nSHA256:\n"
for n in ["Packages"]:
    c = packages.encode(); release += " %s %d %s\n" % (hashlib.sha256(c).hexdigest(), len(c), n)
put("http/debian/Release", release)
# docker: standin/hello:1.0, one layer holding /nonce and a static busybox (the host's, to run
# in a container), as a registry serves it (API v2)
import shutil
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w") as t:
    b = (nonce + "\n").encode(); i = tarfile.TarInfo("nonce"); i.size = len(b); i.mode = 0o644; t.addfile(i, io.BytesIO(b))
    b = open(shutil.which("busybox"), "rb").read(); i = tarfile.TarInfo("busybox"); i.size = len(b); i.mode = 0o755; t.addfile(i, io.BytesIO(b))
layer_tar = buf.getvalue()
layer = gzip.compress(layer_tar, mtime=0)
config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": ["/nonce"]},
    "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer_tar).hexdigest()]}}).encode()
sha = lambda b: "sha256:" + hashlib.sha256(b).hexdigest()
manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
    "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": len(config), "digest": sha(config)},
    "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip", "size": len(layer), "digest": sha(layer)}]}).encode()
r = "https/v2/standin/hello/"
put(r + "blobs/" + sha(config), config)
put(r + "blobs/" + sha(layer), layer)
put(r + "manifests/1.0", manifest)
put(r + "manifests/" + sha(manifest), manifest)
put("docker-image-id", sha(config))
# cargo: hello-standin 1.0.0 in a sparse registry (config.json and the crate's index file), its
# .crate where config.json's dl says
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w:gz") as t:
    for n, c in {"hello-standin-1.0.0/Cargo.toml": '[package]\nname = "hello-standin"\nversion = "1.0.0"\nedition = "2021"\n',
                 "hello-standin-1.0.0/src/lib.rs": "pub const GREETING: &str = %s;\n" % json.dumps(nonce)}.items():
        i = tarfile.TarInfo(n); b = c.encode(); i.size = len(b); i.mode = 0o644; t.addfile(i, io.BytesIO(b))
crate = buf.getvalue()
put("https/crates/dl/hello-standin/1.0.0/download", crate)
put("https/crates/index/config.json", json.dumps({"dl": "https://crates.standin.test/crates/dl/{crate}/{version}/download"}))
put("https/crates/index/he/ll/hello-standin", json.dumps({"name": "hello-standin", "vers": "1.0.0", "deps": [],
    "cksum": hashlib.sha256(crate).hexdigest(), "features": {}, "yanked": False}) + "\n")
"#;

/// An HTTPS (`CERT KEY` given) or plain HTTP file server over `DIR` at `ADDR:PORT`, logging
/// each request's Host and line to stderr. A manifest under `/v2/` is served as a Docker
/// registry serves it (its media type, and its digest in `Docker-Content-Digest`).
const SERVER: &str = r#"
import hashlib, http.server, os, ssl, sys
d, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.chdir(d)
class H(http.server.SimpleHTTPRequestHandler):
    def log_message(self, fmt, *a):
        sys.stderr.write("%s %s\n" % (self.headers.get("Host"), fmt % a)); sys.stderr.flush()
    def guess_type(self, path):
        if "/v2/" in path and "/manifests/" in path:
            return "application/vnd.docker.distribution.manifest.v2+json"
        return super().guess_type(path)
    def end_headers(self):
        p = self.translate_path(self.path)
        if "/v2/" in self.path and "/manifests/" in self.path and os.path.isfile(p):
            self.send_header("Docker-Content-Digest", "sha256:" + hashlib.sha256(open(p, "rb").read()).hexdigest())
        super().end_headers()
srv = http.server.ThreadingHTTPServer((addr, port), H)
if len(sys.argv) > 4:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(sys.argv[4], sys.argv[5])
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
"#;

/// The test CA and a certificate for the HTTPS stand-ins' names, made by `openssl`.
fn certificates(s: &Standins) {
    let p = |n: &str| s.path(n).display().to_string();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let mut a = vec!["req", "-x509"];
    a.extend(ec);
    let (ca_key, ca, key, csr, cert, ext) = (
        p("ca.key"),
        p("ca.pem"),
        p("server.key"),
        p("server.csr"),
        p("server.pem"),
        p("server.ext"),
    );
    a.extend([
        "-keyout",
        &ca_key,
        "-out",
        &ca,
        "-days",
        "2",
        "-subj",
        "/CN=boxery dev-traffic test CA",
    ]);
    host("openssl", &a);
    let mut a = vec!["req"];
    a.extend(ec);
    a.extend(["-keyout", &key, "-out", &csr, "-subj", "/CN=standin"]);
    host("openssl", &a);
    std::fs::write(
        &ext,
        format!(
            "subjectAltName=DNS:{PYPI},DNS:{NPM},DNS:{DOCKER},DNS:{CRATES}\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n\
             subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
        ),
    )
    .unwrap();
    host(
        "openssl",
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
}

/// sshd's configuration in the namespace: only the test's key, only `git-shell` (a forced
/// command), as the user the test runs as.
fn sshd_config(s: &Standins, host_key: &str, user: &str, git_shell: &str) -> PathBuf {
    let keys = s.path("authorized_keys");
    let public = std::fs::read_to_string(s.path("client_key.pub")).unwrap();
    std::fs::write(
        &keys,
        format!(
            "command=\"{git_shell} -c \\\"$SSH_ORIGINAL_COMMAND\\\"\",no-port-forwarding,no-X11-forwarding,no-agent-forwarding,no-pty {public}"
        ),
    )
    .unwrap();
    let cfg = s.path(&format!("sshd_config.{host_key}"));
    std::fs::write(
        &cfg,
        format!(
            "ListenAddress {STANDIN}:22\nHostKey {}\nAuthorizedKeysFile {}\nPidFile none\n\
             UsePAM no\nStrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n\
             PermitRootLogin forced-commands-only\nAllowUsers {user}\nLogLevel VERBOSE\n",
            s.path(host_key).display(),
            keys.display()
        ),
    )
    .unwrap();
    cfg
}

/// `ssh-keygen` a new ed25519 key at `NAME` in the stand-ins' directory.
fn keygen(s: &Standins, name: &str) {
    host(
        "ssh-keygen",
        &[
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-C",
            "boxery-dev-traffic",
            "-f",
            &s.path(name).display().to_string(),
        ],
    );
}

/// Start sshd in the namespace with the host key `host_key`.
fn start_sshd(s: &mut Standins, host_key: &str, user: &str, git_shell: &str) {
    let cfg = sshd_config(s, host_key, user, git_shell);
    let cfg = cfg.display().to_string();
    host("/usr/sbin/sshd", &["-t", "-f", &cfg]);
    s.start("sshd", 22, "/usr/sbin/sshd", &["-D", "-e", "-f", &cfg]);
}

/// `boxery run d1 -- CMD`, which must fail: its stdout and stderr together, printed as `what`
/// says (what the user sees).
fn refused(h: &RealHome, what: &str, cmd: &str) -> String {
    let o = h.cmd(&["run", "d1", "--", cmd]);
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!o.status.success(), "{cmd:?} should have failed: {all}");
    eprintln!("{what} says:\n{all}");
    all
}

/// `boxery run d1 -- CMD`, timed as `what`; it must print `want` (the stand-in's nonce).
fn fetched(h: &RealHome, what: &str, cmd: &str, want: &str) {
    let out = timed(what, || h.run("d1", cmd));
    assert!(out.contains(want), "{what}: {out}");
}

/// The line that makes the cargo project `~/NAME` depending on `hello-standin` from a sparse
/// registry at `https://HOST/crates/index/` (the test CA given) and runs `cargo fetch` (no
/// retries).
fn cargo_fetch(name: &str, host: &str) -> String {
    format!(
        "mkdir -p ~/{name} && cd ~/{name} && cargo init -q --lib --name {name} \
         && echo 'hello-standin = {{ version = \"1\", registry = \"standin\" }}' >> Cargo.toml \
         && mkdir -p .cargo && printf '[registries.standin]\\nindex = \"sparse+https://{host}/crates/index/\"\\n' > .cargo/config.toml \
         && CARGO_HTTP_CAINFO=~/standin-ca.pem CARGO_NET_RETRY=0 cargo fetch -q"
    )
}

/// A step's duration, printed for docs/benchmarks.md.
/// A guest command that looks `name` up over TCP at the guest's DNS address (Python, as the
/// image has no `dig`) and prints `rcode=N answers=N ADDRESS-or--`.
fn tcp_lookup(name: &str) -> String {
    format!(
        r#"python3 - <<'PY'
import socket, struct
q = struct.pack(">6H", 0x4242, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(l)]) + l.encode() for l in "{name}".split(".")) + b"\0"
q += struct.pack(">2H", 1, 1)
s = socket.create_connection(("10.0.2.3", 53), timeout=20)
s.sendall(struct.pack(">H", len(q)) + q)
def exact(n):
    b = b""
    while len(b) < n:
        m = s.recv(n - len(b))
        if not m:
            raise SystemExit("closed after " + repr(b))
        b += m
    return b
a = exact(struct.unpack(">H", exact(2))[0])
n = struct.unpack(">H", a[6:8])[0]
print("rcode=%d answers=%d %s" % (a[3] & 15, n, ".".join(map(str, a[-4:])) if n else "-"))
PY"#
    )
}

fn timed<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    eprintln!(
        "dev-traffic timing: {what}: {:.1} s",
        t.elapsed().as_secs_f64()
    );
    r
}

pub(super) fn developer_traffic_through_egress() {
    assert!(
        Path::new("/usr/sbin/sshd").exists(),
        "OpenSSH's server is not installed (/usr/sbin/sshd): scripts/install-deps.sh installs openssh-server; the git-over-ssh stand-in needs it"
    );
    let git_shell = host("sh", &["-c", "command -v git-shell"])
        .trim()
        .to_string();
    // The interpreter itself (not a shim that may fork), so the PID killed is the server's.
    let python = host("python3", &["-c", "import sys; print(sys.executable)"])
        .trim()
        .to_string();
    let user = host("id", &["-un"]).trim().to_string();
    let nonce = format!("devtraffic-{}-{}", std::process::id(), {
        use std::time::UNIX_EPOCH;
        std::time::SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    });
    let mut s = Standins::make();
    // sshd wants its privilege separation directory; made here only when missing.
    std::fs::create_dir_all("/run/sshd").unwrap();

    // The fixtures and the servers, bound only inside the namespace.
    host(
        "python3",
        &["-c", FIXTURES, &s.dir.path().display().to_string(), &nonce],
    );
    certificates(&s);
    keygen(&s, "host_key");
    keygen(&s, "client_key");
    let repo = s.path("repo.git").display().to_string();
    let work = s.path("work").display().to_string();
    host("git", &["init", "-q", "--bare", "-b", "main", &repo]);
    host("git", &["init", "-q", "-b", "main", &work]);
    std::fs::write(s.path("work/README"), format!("{nonce}\n")).unwrap();
    host("git", &["-C", &work, "add", "README"]);
    host(
        "git",
        &[
            "-C",
            &work,
            "-c",
            "user.name=boxery tests",
            "-c",
            "user.email=tests@boxery.invalid",
            "commit",
            "-q",
            "-m",
            "stand-in",
        ],
    );
    host("git", &["-C", &work, "push", "-q", &repo, "main"]);
    start_sshd(&mut s, "host_key", &user, &git_shell);
    let (https, http) = (
        s.path("https").display().to_string(),
        s.path("http").display().to_string(),
    );
    let (cert, key) = (
        s.path("server.pem").display().to_string(),
        s.path("server.key").display().to_string(),
    );
    s.start(
        "https",
        443,
        &python,
        &["-c", SERVER, &https, STANDIN, "443", &cert, &key],
    );
    s.start("http", 80, &python, &["-c", SERVER, &http, STANDIN, "80"]);

    // The control plane, with the stand-ins' names, and a VM of the agents, docker and rust
    // layers (git, python3 with venv, node and npm, Docker, cargo) allowed only the stand-ins.
    let h = RealHome::new(Kind::Qemu);
    h.home.write(
        "config.yaml",
        &format!(
            "proxy: {{egress: {{resolve: {{{GIT}: {STANDIN}, {PYPI}: {STANDIN}, {NPM}: {STANDIN}, {APT}: {STANDIN}, {DOCKER}: {STANDIN}, {CRATES}: {STANDIN}, {UNLISTED}: {STANDIN}}}}}}}\n"
        ),
    );
    let serve = h.serve();
    serve.wait_leading();
    let f = h.home.write(
        "dev.yaml",
        &format!(
            "apiVersion: boxery.dev/v1alpha1\nkind: Image\nmetadata: {{name: agents}}\n\
             spec: {{source: {{build: {{base: debian-12, layers: [agents, docker, rust]}}}}}}\n---\n\
             apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {{name: d1}}\n\
             spec:\n  source: {{image: agents}}\n  resources: {{cpus: 2, memory: 1Gi}}\n  \
             network:\n    egress: {{policy: Allowlist, allow: [{GIT}, {PYPI}, {NPM}, {APT}, {DOCKER}, {CRATES}]}}\n"
        ),
    );
    timed(
        "apply the agents+docker+rust image (cached build) and a VM on it, Ready",
        || h.apply_file(&f, "30m"),
    );
    // The push: the proxy variables and ssh's include file.
    common::eventually(Duration::from_secs(120), || {
        let o = h.cmd(&[
            "run",
            "d1",
            "--",
            "test -r /run/boxery/ssh_config && test -r /etc/ssh/ssh_config.d/90-boxery.conf && echo \"${https_proxy:-}\"",
        ]);
        String::from_utf8_lossy(&o.stdout)
            .contains("10.0.2.100")
            .then_some(())
    })
    .expect("the egress proxy settings reach the guest");
    let p = |n: &str| s.path(n).display().to_string();
    h.run("d1", "mkdir -p -m 0700 ~/.ssh");
    h.ok(&["cp", &p("client_key"), "d1:.ssh/id_ed25519"]);
    h.ok(&["cp", &p("ca.pem"), "d1:standin-ca.pem"]);
    h.run("d1", "chmod 0600 ~/.ssh/id_ed25519");

    // git over ssh: the first connection to the host accepts its key (no one to answer ssh's
    // question) and records it.
    let url = format!("{user}@{GIT}:{repo}");
    fetched(
        &h,
        "git clone over ssh through CONNECT",
        &format!("git clone -q {url} ~/repo 2>&1 && cat ~/repo/README"),
        &nonce,
    );
    let known = h.run("d1", &format!("ssh-keygen -F {GIT} -f ~/.ssh/known_hosts"));
    let host_pub = std::fs::read_to_string(s.path("host_key.pub")).unwrap();
    let host_pub = host_pub.split_whitespace().nth(1).unwrap();
    assert!(
        known.contains(host_pub),
        "the stand-in's host key is recorded: {known}"
    );
    fetched(
        &h,
        "git pull over ssh (host key known)",
        "cd ~/repo && git pull -q 2>&1 && cat README",
        &nonce,
    );

    // pip, in a venv (the image has python3-venv; Debian's pip is python3-pip), over HTTPS:
    // only the index and the test CA are the stand-in's.
    fetched(
        &h,
        "python3 -m venv (pip from the image, no network)",
        "python3 -m venv ~/venv && echo made",
        "made",
    );
    fetched(
        &h,
        "pip install from the stand-in index (HTTPS, CONNECT)",
        &format!(
            "~/venv/bin/pip install -q --disable-pip-version-check --no-cache-dir \
             --index-url https://{PYPI}/simple/ --cert ~/standin-ca.pem hello-standin 2>&1 \
             && ~/venv/bin/python -c 'import hello_standin; print(hello_standin.GREETING)'"
        ),
        &nonce,
    );

    // npm over HTTPS: the registry and the CA are the stand-in's; the proxy is boxery's.
    fetched(
        &h,
        "npm install from the stand-in registry (HTTPS, CONNECT)",
        &format!(
            "mkdir -p ~/np && cd ~/np && npm install --no-audit --no-fund --loglevel=error \
             --registry https://{NPM}/ --cafile ~/standin-ca.pem standin-hello 2>&1 \
             && node -e 'console.log(require(\"standin-hello\"))'"
        ),
        &nonce,
    );

    // apt over plain HTTP (absolute-form requests), as Debian's own mirrors are reached: the
    // source line is the stand-in's; the proxy is apt's 90boxery-proxy.
    fetched(
        &h,
        "apt-get update + install from the stand-in mirror (HTTP)",
        &format!(
            "echo 'deb [trusted=yes] http://{APT}/debian/ ./' \
               | sudo tee /etc/apt/sources.list.d/standin.list >/dev/null \
             && sudo apt-get update -q -o Dir::Etc::sourcelist=/etc/apt/sources.list.d/standin.list \
                -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0 >/dev/null 2>&1 \
             && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q standin-hello >/dev/null 2>&1 \
             && cat /usr/share/standin-hello/nonce"
        ),
        &nonce,
    );

    // cargo, from a sparse registry over HTTPS: the registry (a project's .cargo/config.toml)
    // and the CA are the stand-in's; the proxy is the variables'.
    fetched(
        &h,
        "cargo fetch from the stand-in sparse registry (HTTPS, CONNECT)",
        &format!(
            "{} 2>&1 && cat ~/.cargo/registry/src/*/hello-standin-1.0.0/src/lib.rs",
            cargo_fetch("rs", CRATES)
        ),
        &nonce,
    );

    // docker pull: the daemon (not a login shell) pulls, with the proxy settings boxery wrote
    // for it; the registry's certificate is the test CA's, given to Docker for that host only.
    let env = h.run("d1", "systemctl show docker.service -p Environment");
    assert!(
        env.contains("HTTPS_PROXY=http://10.0.2.100:80"),
        "the daemon's proxy drop-in is in force: {env}"
    );
    let image_id = std::fs::read_to_string(s.path("docker-image-id")).unwrap();
    fetched(
        &h,
        "docker pull from the stand-in registry (HTTPS, CONNECT, by the daemon)",
        &format!(
            "sudo install -D -m 0644 ~/standin-ca.pem /etc/docker/certs.d/{DOCKER}/ca.crt \
             && docker pull -q {DOCKER}/standin/hello:1.0 >/dev/null \
             && docker image inspect --format '{{{{.Id}}}}' {DOCKER}/standin/hello:1.0"
        ),
        image_id.trim(),
    );
    // and it runs: a container of it prints its file (the runtime, cgroups and AppArmor work)
    fetched(
        &h,
        "docker run of the pulled image",
        &format!("docker run --rm {DOCKER}/standin/hello:1.0 /busybox cat /nonce"),
        &nonce,
    );

    // what runs in a container goes out the same way: Docker's client gives it the proxy
    // (~/.docker/config.json, written by boxery), and the stand-in's name resolves only there
    let said = h.run(
        "d1",
        &format!(
            "docker run --rm {DOCKER}/standin/hello:1.0 /busybox sh -c 'echo \"$http_proxy\"; /busybox wget -q -O /dev/null http://{APT}/from-a-container-{nonce} || true'"
        ),
    );
    assert!(
        said.contains("http://10.0.2.100:80"),
        "a container has the egress proxy: {said}"
    );

    // The stand-ins saw each tool arrive by its name, through the proxy.
    let seen = s.log("https");
    for want in [
        format!("{PYPI} \"GET /simple/hello-standin/"),
        format!("{PYPI} \"GET /files/hello_standin-1.0-py3-none-any.whl"),
        format!("{NPM} \"GET /standin-hello"),
        format!("{NPM} \"GET /tarballs/standin-hello-1.0.0.tgz"),
        // (the tag is looked up with HEAD or GET, as the daemon's version does it)
        "/v2/standin/hello/manifests/1.0 HTTP/1.1\" 200".to_string(),
        format!("{DOCKER} \"GET /v2/standin/hello/blobs/sha256:"),
        format!("{CRATES} \"GET /crates/index/he/ll/hello-standin"),
        format!("{CRATES} \"GET /crates/dl/hello-standin/1.0.0/download"),
    ] {
        assert!(
            seen.contains(&want),
            "the HTTPS stand-in saw {want}: {seen}"
        );
    }
    let seen = s.log("http");
    assert!(
        seen.lines()
            .any(|l| l.starts_with(&format!("{APT} \"GET /debian/"))
                && l.contains("standin-hello_1.0_all.deb")),
        "{seen}"
    );
    assert!(
        seen.contains(&format!("{APT} \"GET /from-a-container-{nonce}")),
        "a container's request reached the stand-in through the proxy: {seen}"
    );
    let audit = std::fs::read_to_string(h.home.path().join("audit/proxy.log")).unwrap_or_default();
    for want in [
        format!("{GIT}:22"),
        format!("{PYPI}:443"),
        format!("{NPM}:443"),
        format!("{APT}:80"),
        format!("{DOCKER}:443"),
        format!("{CRATES}:443"),
    ] {
        assert!(audit.contains(&want), "audited: {want}: {audit}");
    }

    // A host not on the list: each tool fails, and says why (the proxy's reason in the
    // refused CONNECT's status line).
    let why = format!("{UNLISTED} is not in VM d1's egress allow list");
    let out = timed("git over ssh to an unlisted host (refused)", || {
        refused(
            &h,
            "git to an unlisted host",
            &format!("git ls-remote {user}@{UNLISTED}:{repo}"),
        )
    });
    assert!(out.contains(&why), "git to an unlisted host: {out}");
    // pip says why in its retry warning (one retry: its last error is logged at debug level)
    let out = refused(
        &h,
        "pip to an unlisted host",
        &format!(
            "~/venv/bin/pip download --disable-pip-version-check --no-cache-dir --retries 1 \
             --index-url https://{UNLISTED}/simple/ --cert ~/standin-ca.pem -d ~/dl hello-standin"
        ),
    );
    assert!(out.contains(&why), "pip from an unlisted host: {out}");
    let out = refused(
        &h,
        "npm to an unlisted host",
        &format!(
            "mkdir -p ~/np2 && cd ~/np2 && npm install --no-audit --no-fund --fetch-retries=0 \
             --registry https://{UNLISTED}/ --cafile ~/standin-ca.pem standin-hello"
        ),
    );
    assert!(out.contains(&why), "npm from an unlisted host: {out}");
    // curl shows only the code ("CONNECT tunnel failed, response 403"); `curl -v` the line
    let out = refused(
        &h,
        "curl to an unlisted host",
        &format!("curl -sS https://{UNLISTED}/"),
    );
    assert!(out.contains("403"), "curl to an unlisted host: {out}");
    let out = refused(
        &h,
        "docker pull from an unlisted host",
        &format!("docker pull {UNLISTED}/standin/hello:1.0"),
    );
    assert!(
        out.contains(&why),
        "docker pull from an unlisted host: {out}"
    );
    // cargo (libcurl) shows only the code, as curl does
    let out = refused(
        &h,
        "cargo to an unlisted host",
        &cargo_fetch("rs2", UNLISTED),
    );
    assert!(out.contains("403"), "cargo from an unlisted host: {out}");

    // Name lookups (docs/egress.md, "Name lookups"): the control plane answers the guest's
    // resolver by the policy: a listed name resolves to where the egress proxy would go, an
    // unlisted one (which the proxy could resolve) is not found at once rather than hanging
    // (`timeout`'s 124), timed for docs/benchmarks.md
    let out = timed("a name lookup in the guest (allowed)", || {
        h.run(
            "d1",
            &format!("timeout 20 getent hosts {PYPI}; echo \"exit=$?\""),
        )
    });
    assert_eq!(
        out.split_whitespace().collect::<Vec<_>>(),
        [STANDIN, PYPI, "exit=0"],
        "a listed name's lookup: {out}"
    );
    let out = timed("a name lookup in the guest (refused)", || {
        h.run(
            "d1",
            &format!("timeout 20 getent hosts {UNLISTED}; echo \"exit=$?\""),
        )
    });
    assert_eq!(out.trim(), "exit=2", "an unlisted name's lookup: {out}");
    // the same over TCP (a resolver's retry after a truncated answer, `dig +tcp`): answered
    // by the same policy, the answer from 10.0.2.3
    let out = timed("a name lookup over TCP in the guest", || {
        h.run("d1", &tcp_lookup(PYPI))
    });
    assert_eq!(
        out.trim(),
        format!("rcode=0 answers=1 {STANDIN}"),
        "a listed name over TCP"
    );
    let out = h.run("d1", &tcp_lookup(UNLISTED));
    assert_eq!(
        out.trim(),
        "rcode=3 answers=0 -",
        "an unlisted name over TCP"
    );

    // accept-new is not accept-all: the same host with another key is refused.
    s.stop("sshd");
    keygen(&s, "host_key2");
    start_sshd(&mut s, "host_key2", &user, &git_shell);
    let out = refused(
        &h,
        "git to the host with a changed key",
        "cd ~/repo && git pull -q",
    );
    assert!(
        out.contains("REMOTE HOST IDENTIFICATION HAS CHANGED")
            || out.contains("Host key verification failed"),
        "a changed host key: {out}"
    );

    h.ok(&["rm", "d1", "--wait", "--timeout", "5m"]);
    h.ok(&["delete", "image", "agents", "--wait", "--timeout", "2m"]);
    drop(serve);
    drop(s);
    let _ = std::io::stderr().flush();
}

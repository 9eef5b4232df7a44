//! boxery-net with a real QEMU: the tiny guest (image/build-tiny.sh, cached) booted under
//! TCG as image/boot-test.sh does, but on `-netdev stream` to a boxery-net started first.
//!
//! One test, in order: (a) DHCP lease and ssh through the hostfwd with the seed's pinned host
//! key; (a2) a name lookup reaches the DNS socket tagged with its asker, and the answer the
//! guest, and with nothing at the socket it is answered SERVFAIL at once; (b) the guest's 10.0.2.100:80 reaches a unix-socket listener of the test, data both
//! ways, then a 32 MiB download through it; (c) restricted: the guest cannot reach a host
//! loopback listener the host itself reaches; (d) boxery-net killed (SIGKILL, its socket left
//! behind) and started again on the same socket: QEMU reconnects and ssh works again within
//! seconds; then SIGTERM stops it
//! cleanly (exit 0, socket and pidfile removed), and so does the exit of its QEMU. With the
//! proxy's socket gone, the guest gets a 503 saying what to run; back, it is reached again.
//!
//! Needs qemu-system-x86_64, qemu-img, ssh, ssh-keygen, genisoimage and what build-tiny.sh
//! needs (scripts/install-deps.sh): a missing one fails the test with its name, never skips.
//! Every process it starts is killed and its temp dir removed, also on failure (guards).
//! `BOXERY_IMAGE_CACHE` (default /var/cache/boxery/images): where the tiny image is built.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

const BOOT_TIMEOUT: Duration = Duration::from_secs(150);

/// A process of the test's: killed (SIGKILL) and reaped when dropped.
struct Proc {
    name: &'static str,
    child: Child,
}

impl Proc {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status, once it exits within `timeout` (else a panic saying `when`).
    fn exit_within(&mut self, timeout: Duration, when: impl Fn() -> String) -> ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                t.elapsed() < timeout,
                "{} still runs {timeout:?} {}",
                self.name,
                when()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }
    /// Whether it still runs (reaps it if not).
    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.running() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

fn need(tool: &str) {
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()));
    assert!(
        found,
        "{tool} is not installed: this test boots a real guest on boxery-net. Run scripts/install-deps.sh"
    );
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A top-level string of the image manifest (`"key": "value"`).
fn manifest(json: &str, key: &str) -> String {
    let pat = format!("\"{key}\": \"");
    let start = json
        .find(&pat)
        .unwrap_or_else(|| panic!("no {key} in the manifest"))
        + pat.len();
    json[start..][..json[start..].find('"').unwrap()].to_string()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The tiny image (built if needed; cached by the script).
struct Image {
    kernel: PathBuf,
    initrd: PathBuf,
    disk: PathBuf,
    cmdline: String,
}

fn tiny_image() -> Image {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let out: PathBuf = std::env::var_os("BOXERY_IMAGE_CACHE")
        .map_or_else(|| "/var/cache/boxery/images".into(), Into::into);
    run(Command::new("bash")
        .arg(repo.join("image/build-tiny.sh"))
        .arg(&out)
        .stdin(Stdio::null()));
    let json = std::fs::read_to_string(out.join("tiny.json")).unwrap();
    Image {
        kernel: out.join(manifest(&json, "kernel")),
        initrd: out.join(manifest(&json, "initrd")),
        disk: out.join(manifest(&json, "disk")),
        cmdline: manifest(&json, "cmdline"),
    }
}

/// The test's world: temp dir, the guest's identity, the processes.
struct World {
    dir: tempfile::TempDir,
    hostname: String,
    ssh_port: u16,
    /// Killed in `Drop for World`, before the temp dir goes.
    qemu: Option<Proc>,
    net: Option<Proc>,
}

impl Drop for World {
    fn drop(&mut self) {
        self.qemu.take();
        self.net.take();
        if std::thread::panicking() {
            eprintln!("{}", self.diag());
        }
    }
}

impl World {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn diag(&self) -> String {
        format!(
            "--- boxery-net log:\n{}\n--- qemu log:\n{}\n--- serial tail:\n{}",
            tail(&self.path("net.log"), 30),
            tail(&self.path("qemu.log"), 10),
            tail(&self.path("serial.log"), 25)
        )
    }

    /// Keys, token and the NoCloud seed ISO (image/make-seed.sh).
    fn make_identity(&self) {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        for key in ["host_key", "client_key"] {
            run(Command::new("ssh-keygen")
                .args([
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-C",
                    "boxery-net-test",
                    "-f",
                ])
                .arg(self.path(key)));
        }
        std::fs::write(self.path("token"), "boxery-net-test-token").unwrap();
        let host_pub = std::fs::read_to_string(self.path("host_key.pub")).unwrap();
        let host_pub: Vec<&str> = host_pub.split_whitespace().take(2).collect();
        std::fs::write(
            self.path("known_hosts"),
            format!("{}.boxery {}\n", self.hostname, host_pub.join(" ")),
        )
        .unwrap();
        run(Command::new("bash")
            .arg(repo.join("image/make-seed.sh"))
            .args(["--instance-id", &format!("iid-{}", self.hostname)])
            .args(["--hostname", &self.hostname])
            .arg("--host-key")
            .arg(self.path("host_key"))
            .arg("--authorized-keys")
            .arg(self.path("client_key.pub"))
            .arg("--token")
            .arg(self.path("token"))
            .arg(self.path("seed"))
            .arg(self.path("seed.iso")));
    }

    /// Start boxery-net and wait for its pidfile (it writes it once ready).
    fn start_net(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path("net.log"))
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_boxery-net"))
            .arg("--net-sock")
            .arg(self.path("net.sock"))
            .args(["--ssh-port", &self.ssh_port.to_string()])
            .arg("--proxy-sock")
            .arg(self.path("proxy.sock"))
            .arg("--dns-sock")
            .arg(self.path("dns.sock"))
            .arg("--dns-tcp-sock")
            .arg(self.path("dns-tcp.sock"))
            .arg("--pidfile")
            .arg(self.path("net.pid"))
            .arg("--qemu-pidfile")
            .arg(self.path("qemu.pid"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting boxery-net");
        let mut net = Proc {
            name: "boxery-net",
            child,
        };
        let pid = net.pid().to_string();
        let t = Instant::now();
        while !std::fs::read_to_string(self.path("net.pid")).is_ok_and(|s| s.trim() == pid) {
            assert!(
                net.running(),
                "boxery-net exited at start: {}",
                tail(&self.path("net.log"), 10)
            );
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "boxery-net not ready in 10 s"
            );
            thread::sleep(Duration::from_millis(20));
        }
        self.net = Some(net);
    }

    fn start_qemu(&mut self, image: &Image) {
        run(Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-b"])
            .arg(&image.disk)
            .args(["-F", "qcow2"])
            .arg(self.path("disk.qcow2")));
        let log = std::fs::File::create(self.path("qemu.log")).unwrap();
        let p = |n: &str| self.path(n).display().to_string();
        let child = Command::new("qemu-system-x86_64")
            .args([
                "-name",
                "boxery-net-test",
                "-machine",
                "q35",
                "-accel",
                "tcg",
            ])
            .args(["-cpu", "max", "-smp", "1", "-m", "256", "-nodefaults"])
            .args(["-no-user-config", "-display", "none", "-no-reboot"])
            .arg("-kernel")
            .arg(&image.kernel)
            .arg("-initrd")
            .arg(&image.initrd)
            .args(["-append", &image.cmdline])
            .args(["-serial", &format!("file:{}", p("serial.log"))])
            .args([
                "-netdev",
                &format!(
                    "stream,id=n0,server=off,addr.type=unix,addr.path={},reconnect-ms=200",
                    p("net.sock")
                ),
            ])
            .args(["-device", "virtio-net-pci,netdev=n0,romfile="])
            .args([
                "-drive",
                &format!(
                    "file={},if=none,id=disk0,format=qcow2,cache=writeback,discard=unmap",
                    p("disk.qcow2")
                ),
            ])
            .args(["-device", "virtio-blk-pci,drive=disk0"])
            .args([
                "-drive",
                &format!(
                    "file={},if=none,id=seed0,format=raw,readonly=on",
                    p("seed.iso")
                ),
            ])
            .args(["-device", "virtio-blk-pci,drive=seed0"])
            .args(["-device", "virtio-rng-pci"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting qemu-system-x86_64");
        std::fs::write(self.path("qemu.pid"), format!("{}\n", child.id())).unwrap();
        self.qemu = Some(Proc {
            name: "qemu",
            child,
        });
    }

    /// `ssh agent@127.0.0.1 -p PORT CMD`, pinned to the seed's host key only.
    fn ssh(&self, cmd: &str) -> Output {
        Command::new("ssh")
            .arg("-i")
            .arg(self.path("client_key"))
            .args(["-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes"])
            .args(["-o", "ConnectTimeout=10", "-o", "StrictHostKeyChecking=yes"])
            .arg("-o")
            .arg(format!(
                "UserKnownHostsFile={}",
                self.path("known_hosts").display()
            ))
            .args(["-o", "GlobalKnownHostsFile=/dev/null"])
            .args(["-o", &format!("HostKeyAlias={}.boxery", self.hostname)])
            .args(["-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"])
            .args(["-o", "LogLevel=ERROR", "-p", &self.ssh_port.to_string()])
            .arg("agent@127.0.0.1")
            .arg(cmd)
            .stdin(Stdio::null())
            .output()
            .expect("running ssh")
    }

    /// Run CMD in the guest: its stdout; panics with stderr on failure.
    fn guest(&self, cmd: &str) -> String {
        let out = self.ssh(cmd);
        assert!(
            out.status.success(),
            "ssh `{cmd}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Retry `hostname` over ssh until it answers; how long it took.
    fn wait_ssh(&mut self, timeout: Duration) -> Duration {
        let t = Instant::now();
        loop {
            let out = self.ssh("hostname");
            if out.status.success() {
                let got = String::from_utf8_lossy(&out.stdout).trim().to_string();
                assert_eq!(got, self.hostname, "the seed's hostname");
                return t.elapsed();
            }
            for p in [&mut self.qemu, &mut self.net].into_iter().flatten() {
                assert!(p.running(), "{} ended while waiting for ssh", p.name);
            }
            assert!(
                t.elapsed() < timeout,
                "no ssh after {timeout:?}; last error: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            thread::sleep(Duration::from_millis(500));
        }
    }
}

/// Accept one connection on the unix listener within `timeout`.
fn accept_within(listener: &UnixListener, timeout: Duration) -> io::Result<UnixStream> {
    listener.set_nonblocking(true)?;
    let t = Instant::now();
    let conn = loop {
        match listener.accept() {
            Ok((c, _)) => break c,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && t.elapsed() < timeout => {
                thread::sleep(Duration::from_millis(50))
            }
            Err(e) => return Err(e),
        }
    };
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(timeout))?;
    conn.set_write_timeout(Some(timeout))?;
    Ok(conn)
}

/// The proxy side of (b): the first connection is read to EOF and sent back (returns how
/// many bytes came); the second gets [`BULK`] bytes and is closed.
fn proxy_side(listener: UnixListener, timeout: Duration) -> io::Result<usize> {
    let mut conn = accept_within(&listener, timeout)?;
    let mut got = Vec::new();
    conn.read_to_end(&mut got)?;
    conn.write_all(&got)?;
    drop(conn);
    let mut conn = accept_within(&listener, timeout)?;
    let chunk: Vec<u8> = (0..=255u8).cycle().take(1 << 16).collect();
    for _ in 0..BULK / chunk.len() {
        conn.write_all(&chunk)?;
    }
    Ok(got.len())
}

/// CPU seconds (user + system) process `pid` has used.
/// Answer the tagged queries on `sock` with `203.0.113.9` (an A record after the question, the
/// header copied, made a response; other types answered empty) until an A query was answered
/// and nothing more comes for 3 s; the A query's tag.
fn answer_one(sock: &UnixDatagram, timeout: Duration) -> io::Result<Vec<u8>> {
    sock.set_read_timeout(Some(timeout))?;
    let mut buf = [0u8; 2048];
    let mut tag_of_a = None;
    loop {
        let (n, from) = match sock.recv_from(&mut buf) {
            Ok(got) => got,
            Err(e) if tag_of_a.is_some() && e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        };
        let (tag, q) = buf[..n].split_at(12);
        // busybox asks A and AAAA (type 1 and 28)
        let qtype = u16::from_be_bytes([q[q.len() - 4], q[q.len() - 3]]);
        let mut a = q.to_vec();
        a[2] = 0x81; // QR, RD
        a[3] = 0x80; // RA, NOERROR
        if qtype == 1 {
            a[7] = 1; // one answer
            a.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4, 203, 0, 113, 9]);
            tag_of_a = Some(tag.to_vec());
            sock.set_read_timeout(Some(Duration::from_secs(3)))?;
        }
        let to = from.as_pathname().expect("the helper's socket has a name");
        sock.send_to(&[tag, &a].concat(), to)?;
    }
    Ok(tag_of_a.expect("an A query"))
}

fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or_default();
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|&i| f.get(i)?.parse::<f64>().ok())
        .sum();
    ticks / 100.0
}

/// Bytes of the bulk download through the proxy forward.
const BULK: usize = 32 << 20;

#[test]
fn a_guest_behind_boxery_net() {
    for tool in [
        "qemu-system-x86_64",
        "qemu-img",
        "ssh",
        "ssh-keygen",
        "genisoimage",
        "bash",
        "kill",
    ] {
        need(tool);
    }
    let t0 = Instant::now();
    let image = tiny_image();
    let dir = tempfile::Builder::new()
        .prefix("bxnet")
        .tempdir_in("/tmp")
        .unwrap();
    let suffix: String = dir.path().file_name().unwrap().to_string_lossy()[5..]
        .to_lowercase()
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect();
    let mut w = World {
        dir,
        hostname: format!("bn-{suffix}"),
        ssh_port: free_port(),
        qemu: None,
        net: None,
    };
    w.make_identity();
    let proxy = UnixListener::bind(w.path("proxy.sock")).unwrap();
    let dns = UnixDatagram::bind(w.path("dns.sock")).unwrap();

    w.start_net();
    let mode = std::fs::metadata(w.path("net.sock"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the socket is private");
    w.start_qemu(&image);

    // (a) DHCP lease, and ssh through the hostfwd with the pinned host key
    let boot = w.wait_ssh(BOOT_TIMEOUT);
    eprintln!("boot to ssh through boxery-net: {boot:.1?}");
    let addr = w.guest("ip -4 -o addr show dev eth0");
    assert!(addr.contains(" 10.0.2.15/24 "), "the DHCP lease: {addr}");

    // (a2) a name lookup (busybox's own UDP resolver, to slirp's DNS address) comes to
    // the control plane's socket tagged with the asker, and the answer goes back to it
    let mac = w.guest("cat /sys/class/net/eth0/address");
    let answered = thread::spawn(move || answer_one(&dns, Duration::from_secs(60)));
    let out = w.guest("timeout 30 nslookup probe.test 10.0.2.3; echo rc=$?");
    eprintln!("guest name lookup through boxery-net: {out:?}");
    let tag = answered.join().unwrap().expect("a query on the DNS socket");
    let hex: Vec<String> = tag[..6].iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex.join(":"), mac.trim(), "tagged with the guest's MAC");
    assert_eq!(&tag[6..10], &[10, 0, 2, 15], "and its address");
    assert!(
        out.contains("203.0.113.9") && out.ends_with("rc=0"),
        "the guest got the answer: {out}"
    );
    // (a3) nothing answers at the DNS socket (no control plane): the helper answers SERVFAIL
    // at once, rather than leaving the guest's resolver to time out
    let t = Instant::now();
    let out = w.guest("timeout 30 nslookup probe.test 10.0.2.3; echo rc=$?");
    let took = t.elapsed();
    assert!(
        out.contains("SERVFAIL") && out.ends_with("rc=1"),
        "no control plane: {out}"
    );
    assert!(took < Duration::from_secs(10), "SERVFAIL at once: {took:?}");

    // (a4) a lookup over TCP to slirp's DNS address reaches the control plane's stream
    // socket, and its answer comes back as from 10.0.2.3 (the helper carries bytes; what
    // they mean is the control plane's: proxy/tests/dns.rs)
    let dns_tcp = UnixListener::bind(w.path("dns-tcp.sock")).unwrap();
    let tcp_side = thread::spawn(move || -> io::Result<Vec<u8>> {
        let mut c = accept_within(&dns_tcp, Duration::from_secs(60))?;
        c.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut asked = [0u8; 6];
        c.read_exact(&mut asked)?;
        c.write_all(b"\x00\x06answer")?;
        Ok(asked.to_vec())
    });
    let out = w.guest(
        "printf '\\000\\004ping' | timeout 30 nc -w 10 10.0.2.3 53 | od -An -c | tr -s ' '; echo rc=$?",
    );
    eprintln!("guest TCP 10.0.2.3:53 through boxery-net: {out:?}");
    assert_eq!(
        tcp_side
            .join()
            .unwrap()
            .expect("a connection on the DNS stream socket"),
        b"\x00\x04ping",
        "the guest's bytes reached the stream socket"
    );
    assert!(
        out.contains("a n s w e r") && out.ends_with("rc=0"),
        "the guest got the answer back from 10.0.2.3: {out}"
    );

    // (b) the guest's 10.0.2.100:80 reaches the unix socket; data both ways (echoed after
    // the guest's half-close)
    let server = thread::spawn(move || proxy_side(proxy, Duration::from_secs(60)));
    let out = w.guest(
        "head -c 300000 /dev/urandom > /tmp/up && timeout 60 nc -w 10 10.0.2.100 80 < /tmp/up > /tmp/down; \
         echo rc=$?; wc -c < /tmp/down; cmp /tmp/up /tmp/down && echo same",
    );
    eprintln!("guest -> 10.0.2.100:80 -> unix socket: {out:?}");
    assert_eq!(
        out.split_whitespace().collect::<Vec<_>>(),
        ["rc=0", "300000", "same"],
        "the guest got its bytes back: {out}"
    );
    let cpu0 = w.net.as_ref().map(|p| cpu_secs(p.pid())).unwrap();
    let t = Instant::now();
    let bulk = w.guest("timeout 60 nc 10.0.2.100 80 </dev/null | wc -c");
    let secs = t.elapsed().as_secs_f64();
    eprintln!(
        "bulk download of {} MiB through the proxy forward: {secs:.2} s with ssh ({:.0} MiB/s)",
        BULK >> 20,
        (BULK >> 20) as f64 / secs
    );
    let cpu = w.net.as_ref().map(|p| cpu_secs(p.pid())).unwrap() - cpu0;
    eprintln!("boxery-net CPU during it: {cpu:.2} s");
    assert_eq!(bulk, BULK.to_string(), "the whole download arrived");
    let received = server.join().unwrap().expect("the proxy listener");
    assert_eq!(received, 300_000, "the listener got all the guest sent");

    // (b2) no control plane (its socket left behind with no listener, as a crashed `serve`
    // leaves it): the guest gets the 503 that says what to run; a listener back, the guest
    // reaches it again
    assert!(
        w.path("proxy.sock").exists(),
        "the file stays: nothing listens on it"
    );
    let routed = |to: &str| {
        let t = Instant::now();
        while !std::fs::read_to_string(w.path("net.log"))
            .is_ok_and(|l| l.lines().last().is_some_and(|last| last.contains(to)))
        {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "not routed to {to}: {}",
                tail(&w.path("net.log"), 5)
            );
            thread::sleep(Duration::from_millis(20));
        }
    };
    routed("503");
    let out = w.guest("timeout 20 nc -w 5 10.0.2.100 80 </dev/null");
    assert!(
        out.contains("503 Service Unavailable") && out.contains("run `boxery serve`"),
        "no control plane: {out}"
    );
    std::fs::remove_file(w.path("proxy.sock")).unwrap();
    let proxy = UnixListener::bind(w.path("proxy.sock")).unwrap();
    routed("the control plane's proxy");
    let server = thread::spawn(move || {
        let mut c = accept_within(&proxy, Duration::from_secs(30))?;
        c.write_all(b"back\n")
    });
    let out = w.guest("timeout 20 nc -w 5 10.0.2.100 80 </dev/null");
    server.join().unwrap().expect("the proxy listener again");
    assert_eq!(out.trim(), "back", "the proxy's socket is reached again");

    // (c) restricted: a host loopback listener the host reaches, the guest does not
    let host = TcpListener::bind("127.0.0.1:0").unwrap();
    let hport = host.local_addr().unwrap().port();
    let mut control = TcpStream::connect(("127.0.0.1", hport)).unwrap();
    let (mut accepted, _) = host.accept().unwrap();
    control.write_all(b"x").unwrap();
    let mut b = [0u8; 1];
    accepted.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"x", "control: the listener is reachable from the host");
    let out = w.guest(&format!(
        "echo hi | timeout 20 nc -w 5 10.0.2.2 {hport}; echo rc=$?"
    ));
    eprintln!("guest -> 10.0.2.2:{hport} (host loopback): {out:?}");
    // busybox nc exits 1 when it cannot connect (a connection that opened would hang on
    // the silent listener until `timeout` ends it: 143)
    assert!(
        out.ends_with("rc=1"),
        "the guest's connection to 10.0.2.2:{hport} must fail: {out}"
    );
    host.set_nonblocking(true).unwrap();
    let err = host.accept().expect_err("no connection from the guest");
    assert_eq!(err.kind(), io::ErrorKind::WouldBlock, "{err}");

    // (d) boxery-net dies (SIGKILL: its socket stays behind); a new one on the same socket
    let mut old = w.net.take().unwrap();
    old.child.kill().unwrap();
    old.child.wait().unwrap();
    drop(old);
    assert!(
        w.path("net.sock").exists(),
        "a killed helper leaves its socket"
    );
    let t = Instant::now();
    w.start_net();
    let back = w.wait_ssh(Duration::from_secs(30));
    let back_total = t.elapsed();
    eprintln!(
        "helper restart -> ssh again: {back_total:.2?} (first ssh attempt answered after {back:.2?})"
    );
    assert!(
        back_total < Duration::from_secs(10),
        "ssh back after {back_total:?}"
    );
    assert!(
        w.qemu.as_mut().unwrap().running(),
        "QEMU outlived its helper"
    );
    let addr = w.guest("ip -4 -o addr show dev eth0");
    assert!(
        addr.contains(" 10.0.2.15/24 "),
        "the guest kept its lease: {addr}"
    );

    // SIGTERM: a clean stop, socket and pidfile removed
    let mut net = w.net.take().unwrap();
    run(Command::new("kill").args(["-TERM", &net.pid().to_string()]));
    let status = net.exit_within(Duration::from_secs(5), || "after SIGTERM".into());
    assert!(status.success(), "exit status after SIGTERM: {status}");
    assert!(!w.path("net.sock").exists(), "the socket is removed");
    assert!(!w.path("net.pid").exists(), "the pidfile is removed");

    // the QEMU named in --qemu-pidfile exits: so does its helper (the VM's network never
    // outlives it), cleanly
    w.start_net();
    let t = Instant::now();
    while !std::fs::read_to_string(w.path("net.log")).is_ok_and(|l| {
        l.rsplit("listening on")
            .next()
            .is_some_and(|last| last.contains("serving QEMU pid"))
    }) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "boxery-net did not name its QEMU: {}",
            tail(&w.path("net.log"), 5)
        );
        thread::sleep(Duration::from_millis(20));
    }
    let mut net = w.net.take().unwrap();
    let mut qemu = w.qemu.take().unwrap();
    qemu.child.kill().unwrap();
    qemu.child.wait().unwrap();
    let status = net.exit_within(Duration::from_secs(5), || {
        format!("after its QEMU exited: {}", tail(&w.path("net.log"), 5))
    });
    assert!(status.success(), "exit status after QEMU's exit: {status}");
    assert!(
        tail(&w.path("net.log"), 3).contains("has exited"),
        "{}",
        tail(&w.path("net.log"), 5)
    );
    assert!(!w.path("net.sock").exists(), "the socket is removed");
    eprintln!("whole test: {:.1?}", t0.elapsed());
}

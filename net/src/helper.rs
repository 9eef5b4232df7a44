//! The helper's life: set up slirp and the socket QEMU connects to, then one single-threaded
//! `poll(2)` loop until SIGTERM or SIGINT.
//!
//! Each round of the loop (as the C prototype `docs/research/slirpd/slirpd-batch.c`):
//! 1. [`Slirp::wait`]: `slirp_pollfds_fill` adds slirp's sockets after ours (the signalfd, and
//!    QEMU's connection, or the listening socket while no QEMU is attached) and lowers the
//!    timeout (TCP timers, slirp's own timers); then one `poll`.
//! 2. A stop signal ends the loop. The listener: accept QEMU. QEMU's connection: one read,
//!    every whole frame in the buffer to `slirp_input` (frames: a 4-byte big-endian length,
//!    then the ethernet frame).
//! 3. [`Slirp::dispatch`]: `slirp_pollfds_poll` (host sockets: hostfwd, unix forward, guest
//!    connections) then the expired timers.
//! 4. The frames slirp produced during the round, already length-prefixed in one buffer, go
//!    to QEMU in one `write` (batching: measured ~95 % of QEMU's in-process slirp bulk
//!    throughput, against ~89 % with a write per frame).
//!
//! # Guarantees
//! - The socket is created mode 0600 (umask), a stale one (nothing listening) is replaced, a
//!   live one or a non-socket at the path is an error. On a stop signal, and on an error once
//!   the socket exists, the socket and the pidfile are removed if they are still this
//!   process's (same inode; the pidfile holds our pid).
//! - The pidfile is written (atomically) only once everything listens: its presence means
//!   ready.
//! - QEMU going away is not an end: slirp's state (leases, forwards) is kept and the next
//!   connection (QEMU's `reconnect-ms`) is accepted. Guest TCP connections open through slirp
//!   stay open if QEMU comes back before they time out.
//! - The connection to QEMU is non-blocking: a guest that stops taking frames (paused VM)
//!   never blocks the loop; past [`OUTBOX_MAX`] pending bytes new frames are dropped (TCP
//!   retransmits), as QEMU's own queue does.
//!
//! - Given QEMU's pidfile, the helper ends (exit 0, socket and pidfile removed) within a
//!   second of that QEMU's exit, or when no live QEMU is named there within a minute: a VM's
//!   network never outlives its QEMU, whoever ended it.
//!
//! # Caveats
//! - While QEMU is away, frames for the guest are dropped.
//! - A probe of a live socket at the path (to tell it from a stale one) is one connection the
//!   live helper accepts and sees close at once.

use std::io::{self, Read, Write};
use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::dns;
use crate::slirp::{Guest, Network, Slirp, SlirpError};
use crate::sys::{StopSignals, with_umask};

/// The guest address whose port [`PROXY_PORT`] reaches the proxy's unix socket.
pub const PROXY_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 100);
/// The guest port of the proxy.
pub const PROXY_PORT: u16 = 80;
/// The guest's sshd port the host forward reaches.
pub const GUEST_SSH_PORT: u16 = 22;
/// The largest frame QEMU's stream netdev sends or takes (its `NET_BUFSIZE`).
pub const MAX_FRAME: usize = 4096 + 65536;
/// Bytes of frames for QEMU kept while it does not read; beyond, frames are dropped.
pub const OUTBOX_MAX: usize = 4 << 20;
/// Longest unix socket path (`sun_path` less its NUL).
const MAX_SOCK_PATH: usize = 107;
/// The loop's longest sleep (slirp lowers it when it has timers to run).
const MAX_SLEEP_MS: u32 = 1000;

/// What the helper is asked to do.
#[derive(Debug, Clone)]
pub struct Options {
    /// The unix socket QEMU's `-netdev stream` connects to.
    pub net_sock: PathBuf,
    /// The host loopback port forwarded to the guest's sshd.
    pub ssh_port: u16,
    /// The unix socket guest connections to 10.0.2.100:80 are connected to.
    pub proxy_sock: PathBuf,
    /// The control plane's datagram socket that answers the guest's name lookups
    /// ([`crate::dns`]); `None`: lookups go to slirp, which drops them.
    pub dns_sock: Option<PathBuf>,
    /// The control plane's stream socket the guest's DNS-over-TCP connections (to
    /// `10.0.2.3:53`) are connected to ([`crate::dns`]); `None`: they are refused.
    pub dns_tcp_sock: Option<PathBuf>,
    /// Where to write the helper's pid once it is ready.
    pub pidfile: Option<PathBuf>,
    /// QEMU's pidfile: the helper ends when the QEMU it names has exited (or when none has
    /// started within [`QEMU_START_TIMEOUT`]), so a VM's network never outlives its QEMU.
    pub qemu_pidfile: Option<PathBuf>,
    /// Where to write the guest's network byte counts ([`Counts`]), every
    /// [`STATS_EVERY`] while they change.
    pub stats: Option<PathBuf>,
}

/// How often the stats file is rewritten while the counts change.
pub const STATS_EVERY: Duration = Duration::from_secs(2);

/// The guest's network bytes since the helper started, as the stats file holds them: one
/// line, what the guest received and what it sent (`rx 1234 tx 567\n`), Ethernet frames
/// counted whole. `backends::qemu::net` reads it (`boxery_vm_network_*_bytes_total`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Bytes of frames the guest received.
    pub rx: u64,
    /// Bytes of frames the guest sent.
    pub tx: u64,
}

/// The stats file's writer: whole or not at all (a rename), at most every [`STATS_EVERY`],
/// and only when the counts changed.
#[derive(Debug)]
struct StatsFile {
    path: PathBuf,
    written: Option<Counts>,
    last: Instant,
}

impl StatsFile {
    fn new(path: PathBuf) -> Self {
        StatsFile {
            path,
            written: None,
            last: Instant::now() - STATS_EVERY,
        }
    }

    fn update(&mut self, now: Counts) {
        if self.written == Some(now) || self.last.elapsed() < STATS_EVERY {
            return;
        }
        self.last = Instant::now();
        let tmp = self.path.with_extension("tmp");
        let wrote = std::fs::write(&tmp, format!("rx {} tx {}\n", now.rx, now.tx))
            .and_then(|()| std::fs::rename(&tmp, &self.path));
        match wrote {
            Ok(()) => self.written = Some(now),
            Err(e) => eprintln!("boxery-net: cannot write {}: {e}", self.path.display()),
        }
    }
}

impl Drop for StatsFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// How long a helper given `qemu_pidfile` waits for a live QEMU to be named in it.
pub const QEMU_START_TIMEOUT: Duration = Duration::from_secs(60);
/// How often QEMU's life is checked.
const QEMU_CHECK_EVERY: Duration = Duration::from_millis(500);

/// Whether the QEMU that the helper serves is still there.
#[derive(Debug)]
struct QemuWatch {
    pidfile: PathBuf,
    started: Instant,
    last_check: Instant,
    /// The last live pid read from the pidfile.
    seen: Option<i32>,
}

impl QemuWatch {
    fn new(pidfile: PathBuf) -> Self {
        let now = Instant::now();
        QemuWatch {
            pidfile,
            started: now,
            // the first round checks
            last_check: now.checked_sub(QEMU_CHECK_EVERY).unwrap_or(now),
            seen: None,
        }
    }

    /// `Some(why)` when the helper has no QEMU to serve any more (checked every
    /// [`QEMU_CHECK_EVERY`]): the pidfile names no live process after one did, or none did
    /// within [`QEMU_START_TIMEOUT`].
    fn ended(&mut self) -> Option<String> {
        if self.last_check.elapsed() < QEMU_CHECK_EVERY {
            return None;
        }
        self.last_check = Instant::now();
        let pid = std::fs::read_to_string(&self.pidfile)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .filter(|p| *p > 0);
        match (pid.filter(|p| alive(*p)), self.seen) {
            (Some(p), seen) => {
                if seen != Some(p) {
                    eprintln!("boxery-net: serving QEMU pid {p}");
                }
                self.seen = Some(p);
                None
            }
            (None, Some(p)) => Some(format!("QEMU (pid {p}) has exited")),
            (None, None) if self.started.elapsed() > QEMU_START_TIMEOUT => Some(format!(
                "no QEMU named in {} within {} s",
                self.pidfile.display(),
                QEMU_START_TIMEOUT.as_secs()
            )),
            (None, None) => None,
        }
    }
}

/// Whether `pid` is a process that has not exited (a zombie has).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        // the state follows the command name's closing parenthesis
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X')
    })
}

/// Why the helper could not start or stopped early.
#[derive(Debug, thiserror::Error)]
pub enum HelperError {
    /// The stop signals could not be set up.
    #[error("cannot set up SIGTERM/SIGINT handling")]
    Signals(#[source] io::Error),
    /// A socket path longer than `sun_path` takes.
    #[error("{path} is {len} bytes long: a unix socket path takes at most {MAX_SOCK_PATH}")]
    PathTooLong {
        /// The path.
        path: PathBuf,
        /// Its length.
        len: usize,
    },
    /// The socket's directory is missing.
    #[error("cannot listen on {path}: its directory {dir} does not exist")]
    NoDirectory {
        /// The socket path.
        path: PathBuf,
        /// Its directory.
        dir: PathBuf,
    },
    /// Something listens on the socket path already.
    #[error(
        "{path} is in use: another process (a running boxery-net?) listens on it; stop it first"
    )]
    InUse {
        /// The socket path.
        path: PathBuf,
    },
    /// The socket path is taken by something that is not a socket.
    #[error("{path} exists and is not a socket: not replacing it")]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// Binding or listening failed.
    #[error("cannot listen on {path}")]
    Listen {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Setting up slirp or a forward failed.
    #[error(transparent)]
    Slirp(#[from] SlirpError),
    /// The pidfile could not be written.
    #[error("cannot write the pidfile {path}")]
    Pidfile {
        /// The pidfile.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// `poll` failed.
    #[error("poll failed")]
    Poll(#[source] io::Error),
}

/// The frames for QEMU: slirp appends during a round, the loop writes them at its end.
#[derive(Debug, Default)]
struct Outbox {
    /// Length-prefixed frames; `buf[sent..]` is still to write.
    buf: Vec<u8>,
    sent: usize,
    /// QEMU is connected (else frames are dropped).
    attached: bool,
    /// Frames dropped because the outbox was full.
    dropped: u64,
    /// Bytes of the frames taken for the guest (its received bytes), since the start.
    to_guest: u64,
    /// DNS over TCP is carried: slirp's segments from its forward are given back from
    /// slirp's DNS address ([`dns::tcp_from_forward`]).
    dns_tcp: bool,
}

impl Guest for Outbox {
    fn send(&mut self, frame: &[u8]) {
        if !self.attached {
            return; // no guest: TCP retransmits, ARP and DHCP ask again
        }
        if self.buf.len() - self.sent + 4 + frame.len() > OUTBOX_MAX {
            self.dropped += 1;
            return;
        }
        self.buf
            .extend_from_slice(&(frame.len() as u32).to_be_bytes());
        let at = self.buf.len();
        self.buf.extend_from_slice(frame);
        if self.dns_tcp {
            dns::tcp_from_forward(&mut self.buf[at..]);
        }
        self.to_guest += frame.len() as u64;
    }
}

impl Outbox {
    fn pending(&self) -> bool {
        self.sent < self.buf.len()
    }

    /// Start or end a connection: a frame half-written to the last one is not continued.
    fn reset(&mut self, attached: bool) {
        self.buf.clear();
        self.sent = 0;
        self.attached = attached;
    }

    /// Write what is pending (one write, unless the socket takes only part of it).
    fn flush(&mut self, to: &mut impl Write) -> io::Result<()> {
        while self.pending() {
            match to.write(&self.buf[self.sent..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if !self.pending() {
            self.buf.clear();
            self.sent = 0;
        } else if self.sent > self.buf.len() / 2 {
            self.buf.drain(..self.sent);
            self.sent = 0;
        }
        Ok(())
    }
}

/// What starts a stream buffer: a whole frame, a part of one, or a length QEMU never sends.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    /// A whole frame of this many bytes follows the 4-byte length.
    Whole(usize),
    /// More bytes are needed.
    Partial,
    /// A length over [`MAX_FRAME`]: the stream is out of step.
    Bad(u32),
}

/// Parse the frame at the start of `buf` (4-byte big-endian length, then the frame).
pub fn frame_at(buf: &[u8]) -> Frame {
    let Some(len) = buf.get(..4) else {
        return Frame::Partial;
    };
    let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]);
    if len as usize > MAX_FRAME {
        return Frame::Bad(len);
    }
    if buf.len() - 4 < len as usize {
        Frame::Partial
    } else {
        Frame::Whole(len as usize)
    }
}

/// Removes the sockets and the pidfile when dropped, if they are still this process's.
struct Cleanup {
    sockets: Vec<(PathBuf, u64, u64)>,
    pidfile: Option<PathBuf>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for (path, dev, ino) in &self.sockets {
            if std::fs::symlink_metadata(path).is_ok_and(|m| m.dev() == *dev && m.ino() == *ino) {
                let _ = std::fs::remove_file(path);
            }
        }
        if let Some(path) = &self.pidfile
            && std::fs::read_to_string(path)
                .is_ok_and(|s| s.trim() == std::process::id().to_string())
        {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn check_sock_path(path: &Path) -> Result<(), HelperError> {
    let len = path.as_os_str().len();
    if len > MAX_SOCK_PATH {
        return Err(HelperError::PathTooLong {
            path: path.into(),
            len,
        });
    }
    Ok(())
}

/// Make way for the socket: nothing there, or a stale socket (removed). A live socket or any
/// other file is an error.
fn clear_stale(path: &Path) -> Result<(), HelperError> {
    let listen_err = |source| HelperError::Listen {
        path: path.into(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if d.as_os_str().is_empty() => Path::new("."),
        Some(d) => d,
        None => Path::new("/"),
    };
    if !dir.is_dir() {
        return Err(HelperError::NoDirectory {
            path: path.into(),
            dir: dir.into(),
        });
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(listen_err(e)),
        Ok(m) if !m.file_type().is_socket() => Err(HelperError::NotASocket { path: path.into() }),
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => Err(HelperError::InUse { path: path.into() }),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                std::fs::remove_file(path).map_err(listen_err)
            }
            Err(e) => Err(listen_err(e)),
        },
    }
}

/// Listen on the unix socket `path` (mode 0600, a stale one replaced, non-blocking); removed
/// by `cleanup`.
fn listen(path: &Path, cleanup: &mut Cleanup) -> Result<UnixListener, HelperError> {
    clear_stale(path)?;
    let listen_err = |source| HelperError::Listen {
        path: path.into(),
        source,
    };
    let listener = with_umask(0o177, || UnixListener::bind(path)).map_err(listen_err)?;
    let meta = std::fs::symlink_metadata(path).map_err(listen_err)?;
    cleanup.sockets.push((path.into(), meta.dev(), meta.ino()));
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(listen_err)?;
    listener.set_nonblocking(true).map_err(listen_err)?;
    Ok(listener)
}

/// The helper's own socket that answers the guest when no control plane serves the proxy:
/// beside the net socket, `NAME.503.sock` for `NAME.sock`.
pub fn refusal_path(net_sock: &Path) -> PathBuf {
    net_sock.with_extension("503.sock")
}

/// The helper's own datagram socket that the control plane answers name lookups to: beside
/// the net socket, `NAME.dns.sock` for `NAME.sock`.
pub fn dns_reply_path(net_sock: &Path) -> PathBuf {
    net_sock.with_extension("dns.sock")
}

/// The guest's name lookups on their way to the control plane and back ([`crate::dns`]).
#[derive(Debug)]
struct DnsRelay {
    /// Bound at [`dns_reply_path`]: the control plane's answers arrive here.
    sock: UnixDatagram,
    /// The control plane's socket.
    to: PathBuf,
    /// Queries that could not be sent (no control plane, its queue full).
    unsent: u64,
}

impl DnsRelay {
    /// Bind the reply socket at `path` (mode 0600, non-blocking); a socket left there by an
    /// earlier helper is replaced (the net socket, checked first, is this helper's).
    fn bind(path: &Path, to: PathBuf, cleanup: &mut Cleanup) -> Result<Self, HelperError> {
        check_sock_path(path)?;
        let listen_err = |source| HelperError::Listen {
            path: path.into(),
            source,
        };
        match std::fs::symlink_metadata(path) {
            Ok(m) if !m.file_type().is_socket() => {
                return Err(HelperError::NotASocket { path: path.into() });
            }
            Ok(_) => std::fs::remove_file(path).map_err(listen_err)?,
            Err(_) => {}
        }
        let sock = with_umask(0o177, || UnixDatagram::bind(path)).map_err(listen_err)?;
        let meta = std::fs::symlink_metadata(path).map_err(listen_err)?;
        cleanup.sockets.push((path.into(), meta.dev(), meta.ino()));
        sock.set_nonblocking(true).map_err(listen_err)?;
        Ok(DnsRelay {
            sock,
            to,
            unsent: 0,
        })
    }

    /// Send a guest's query on, tagged; when it cannot go (no control plane), answer it
    /// SERVFAIL at once.
    fn send(&mut self, tag: &[u8; dns::TAG], query: &[u8], guest: &mut Outbox) {
        let msg = [&tag[..], query].concat();
        if self.sock.send_to(&msg, &self.to).is_err() {
            if let Some(frame) =
                dns::servfail(query).and_then(|a| dns::answer_frame(&[&tag[..], &a].concat()))
            {
                guest.send(&frame);
            }
            self.unsent += 1;
            if self.unsent.is_power_of_two() {
                eprintln!(
                    "boxery-net: {} name lookups not sent: nothing answers at {}",
                    self.unsent,
                    self.to.display()
                );
            }
        }
    }

    /// Every answer waiting, as frames for the guest.
    fn receive(&mut self, guest: &mut Outbox) {
        let mut buf = [0u8; dns::TAG + dns::MAX_ANSWER + 1];
        loop {
            match self.sock.recv(&mut buf) {
                Ok(n) => {
                    if let Some(frame) = dns::answer_frame(&buf[..n]) {
                        guest.send(&frame);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return, // WouldBlock: all read
            }
        }
    }
}

/// What a guest connection to the proxy gets while no control plane serves it (the same
/// words `boxery-relay` writes): its client (curl, apt, pip through `http_proxy`) shows it
/// instead of a bare reset, and its person learns what to run.
pub const NO_CONTROL_PLANE: &str = "boxery: no control plane serves this VM's proxy and egress: run `boxery serve` on the host (or `boxery service install`)\n";

/// How often the proxy's socket is looked for.
const PROXY_CHECK_EVERY: Duration = Duration::from_millis(500);

/// Where guest connections to the proxy's address go: the proxy's socket while a process
/// listens on it, else the helper's refusal socket ([`NO_CONTROL_PLANE`]). The control plane
/// removes its socket when it stops and makes it when it starts; one left behind by a control
/// plane that crashed has no listener, which [`listening`] tells without connecting.
#[derive(Debug)]
struct ProxyRoute {
    proxy: PathBuf,
    refusal: PathBuf,
    /// The refusal socket's listener (answered by [`refuse`]).
    refusals: UnixListener,
    /// The route in place: `Some(true)` to the proxy.
    to_proxy: Option<bool>,
    last_check: Instant,
}

impl ProxyRoute {
    fn new(proxy: PathBuf, refusal: PathBuf, refusals: UnixListener) -> Self {
        ProxyRoute {
            proxy,
            refusal,
            refusals,
            to_proxy: None,
            last_check: Instant::now(),
        }
    }

    /// Route to the proxy's socket if it is there, else to the refusal (a change only).
    fn route(&mut self, slirp: &mut Slirp<Outbox>) -> Result<(), SlirpError> {
        self.last_check = Instant::now();
        let there = std::fs::symlink_metadata(&self.proxy).is_ok_and(|m| m.file_type().is_socket())
            && listening(&self.proxy);
        if self.to_proxy == Some(there) {
            return Ok(());
        }
        if self.to_proxy.is_some() {
            slirp.remove_unix(PROXY_ADDR, PROXY_PORT);
        }
        let to = if there { &self.proxy } else { &self.refusal };
        slirp.add_unix(to, PROXY_ADDR, PROXY_PORT)?;
        if self.to_proxy.is_some() || !there {
            eprintln!(
                "boxery-net: guest {PROXY_ADDR}:{PROXY_PORT} -> {}",
                if there {
                    "the control plane's proxy"
                } else {
                    "503 (no control plane serves the proxy)"
                }
            );
        }
        self.to_proxy = Some(there);
        Ok(())
    }

    fn due(&self) -> bool {
        self.last_check.elapsed() >= PROXY_CHECK_EVERY
    }
}

/// Whether a process listens on the unix socket `path` (in this network namespace), read from
/// `/proc/net/unix` (`Num RefCount Protocol Flags Type St Inode Path`; a listener's flags are
/// `00010000`): no connection is made to find out. When that table cannot be read, a socket
/// file counts as listened on.
pub fn listening(path: &Path) -> bool {
    let Ok(table) = std::fs::read(PROC_NET_UNIX) else {
        return true;
    };
    let want = path.as_os_str().as_bytes();
    table.split(|b| *b == b'\n').skip(1).any(|line| {
        let mut f = line.splitn(8, |b| *b == b' ');
        let flags = f.nth(3);
        flags == Some(b"00010000".as_slice()) && f.nth(3) == Some(want)
    })
}

const PROC_NET_UNIX: &str = "/proc/net/unix";

/// Answer every pending connection on the refusal socket with [`NO_CONTROL_PLANE`].
fn refuse(refusal: &UnixListener) {
    loop {
        match refusal.accept() {
            Ok((mut c, _)) => {
                // a few hundred bytes into a new socket's empty buffer: never blocks
                let _ = write!(
                    c,
                    "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n\
                     x-boxery-egress: failed\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{NO_CONTROL_PLANE}",
                    NO_CONTROL_PLANE.len()
                );
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

fn write_pidfile(path: &Path) -> io::Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, format!("{}\n", std::process::id()))?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Why the helper stopped without an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// SIGTERM or SIGINT (the number).
    Signal(i32),
    /// The QEMU it served has gone for good (why).
    QemuGone(String),
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stopped::Signal(s) => write!(f, "stopped by signal {s}"),
            Stopped::QemuGone(why) => write!(f, "stopped: {why}"),
        }
    }
}

/// Run the helper until SIGTERM or SIGINT, or until its QEMU has gone (`qemu_pidfile`).
pub fn run(opts: &Options) -> Result<Stopped, HelperError> {
    // first, while this is the only thread: the blocked mask is per thread
    let signals = StopSignals::new().map_err(HelperError::Signals)?;
    check_sock_path(&opts.net_sock)?;
    check_sock_path(&opts.proxy_sock)?;

    let refusal_sock = refusal_path(&opts.net_sock);
    check_sock_path(&refusal_sock)?;

    let mut slirp = Slirp::new(&Network::default(), Outbox::default())?;
    slirp.add_hostfwd(Ipv4Addr::LOCALHOST, opts.ssh_port, GUEST_SSH_PORT)?;
    if let Some(path) = &opts.dns_tcp_sock {
        check_sock_path(path)?;
        // (slirp connects at each guest connection: the socket may come later)
        slirp.add_unix(path, dns::DNS_TCP_ADDR, dns::DNS_PORT)?;
        slirp.guest().dns_tcp = true;
    }

    let mut cleanup = Cleanup {
        sockets: Vec::new(),
        pidfile: None,
    };
    let listener = listen(&opts.net_sock, &mut cleanup)?;
    let refusal = listen(&refusal_sock, &mut cleanup)?;
    let mut proxy = ProxyRoute::new(opts.proxy_sock.clone(), refusal_sock, refusal);
    proxy.route(&mut slirp)?;
    let mut dns = match &opts.dns_sock {
        Some(to) => {
            check_sock_path(to)?;
            let at = dns_reply_path(&opts.net_sock);
            Some(DnsRelay::bind(&at, to.clone(), &mut cleanup)?)
        }
        None => None,
    };
    if let Some(path) = &opts.pidfile {
        write_pidfile(path).map_err(|source| HelperError::Pidfile {
            path: path.clone(),
            source,
        })?;
        cleanup.pidfile = Some(path.clone());
    }
    eprintln!(
        "boxery-net: libslirp {}, listening on {} for QEMU; host 127.0.0.1:{} -> guest :{GUEST_SSH_PORT}; guest {PROXY_ADDR}:{PROXY_PORT} -> {}",
        crate::slirp::version(),
        opts.net_sock.display(),
        opts.ssh_port,
        opts.proxy_sock.display()
    );
    let mut watch = opts.qemu_pidfile.clone().map(QemuWatch::new);
    let mut stats = opts.stats.clone().map(StatsFile::new);
    let stopped = serve(
        &mut slirp,
        &listener,
        &mut proxy,
        dns.as_mut(),
        &signals,
        watch.as_mut(),
        stats.as_mut(),
    )?;
    drop(cleanup);
    Ok(stopped)
}

/// The poll loop (see the module docs).
fn serve(
    slirp: &mut Slirp<Outbox>,
    listener: &UnixListener,
    proxy: &mut ProxyRoute,
    mut dns: Option<&mut DnsRelay>,
    signals: &StopSignals,
    mut watch: Option<&mut QemuWatch>,
    mut stats: Option<&mut StatsFile>,
) -> Result<Stopped, HelperError> {
    let mut qemu: Option<UnixStream> = None;
    let mut inbuf = vec![0u8; 2 * (4 + MAX_FRAME)];
    let mut have = 0;
    let mut from_guest = 0u64;
    loop {
        if let Some(s) = stats.as_deref_mut() {
            s.update(Counts {
                rx: slirp.guest().to_guest,
                tx: from_guest,
            });
        }
        let pending = slirp.guest().pending();
        let link = match &qemu {
            Some(c) => (
                c.as_fd(),
                libc::POLLIN | if pending { libc::POLLOUT } else { 0 },
            ),
            None => (listener.as_fd(), libc::POLLIN),
        };
        // without a relay, the refusal socket stands in (polled twice, harmless)
        let refusal = &proxy.refusals;
        let answers = dns.as_deref().map_or(refusal.as_fd(), |d| d.sock.as_fd());
        let own = [
            (signals.as_fd(), libc::POLLIN),
            link,
            (refusal.as_fd(), libc::POLLIN),
            (answers, libc::POLLIN),
        ];
        let [sig, q, r, a] = match slirp.wait(own, MAX_SLEEP_MS) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => [0, 0, 0, 0],
            Err(e) => return Err(HelperError::Poll(e)),
        };
        if r != 0 {
            refuse(refusal);
        }
        if a != 0
            && let Some(d) = dns.as_deref_mut()
        {
            d.receive(slirp.guest());
        }
        if proxy.due()
            && let Err(e) = proxy.route(slirp)
        {
            eprintln!("boxery-net: cannot route the proxy's address: {e}");
        }
        if sig != 0
            && let Some(signal) = signals.take()
        {
            return Ok(Stopped::Signal(signal));
        }
        if let Some(w) = watch.as_deref_mut()
            && let Some(why) = w.ended()
        {
            return Ok(Stopped::QemuGone(why));
        }
        let mut gone: Option<String> = None;
        if q != 0 {
            match &mut qemu {
                None => match listener.accept() {
                    Ok((c, _)) => match c.set_nonblocking(true) {
                        Ok(()) => {
                            eprintln!("boxery-net: QEMU connected");
                            qemu = Some(c);
                            have = 0;
                            slirp.guest().reset(true);
                        }
                        Err(e) => eprintln!("boxery-net: QEMU's connection refused: {e}"),
                    },
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => eprintln!("boxery-net: accepting QEMU's connection failed: {e}"),
                },
                Some(c) if q & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 => {
                    match c.read(&mut inbuf[have..]) {
                        Ok(0) => gone = Some("closed the connection".into()),
                        Ok(n) => {
                            have += n;
                            let (bad, bytes) =
                                feed(slirp, dns.as_deref_mut(), &mut inbuf, &mut have);
                            from_guest += bytes;
                            gone = bad;
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                            ) => {}
                        Err(e) => gone = Some(format!("read failed: {e}")),
                    }
                }
                Some(_) => {}
            }
        }
        slirp.dispatch();
        if gone.is_none()
            && let Some(c) = &mut qemu
            && let Err(e) = slirp.guest().flush(c)
        {
            gone = Some(format!("write failed: {e}"));
        }
        if let Some(why) = gone {
            let dropped = std::mem::take(&mut slirp.guest().dropped);
            eprintln!(
                "boxery-net: QEMU disconnected ({why}){}; waiting for it to reconnect",
                if dropped > 0 {
                    format!(", {dropped} frames dropped while it did not read")
                } else {
                    String::new()
                }
            );
            qemu = None;
            have = 0;
            slirp.guest().reset(false);
        }
    }
}

/// Give slirp every whole frame at the start of `buf[..have]` (a name lookup to `dns`
/// instead) and keep the rest; `Some(why)` when the stream is out of step, and the bytes of
/// the frames given.
fn feed(
    slirp: &mut Slirp<Outbox>,
    mut dns: Option<&mut DnsRelay>,
    buf: &mut [u8],
    have: &mut usize,
) -> (Option<String>, u64) {
    let mut off = 0;
    let mut bytes = 0;
    let bad = loop {
        match frame_at(&buf[off..*have]) {
            Frame::Whole(len) => {
                let frame = &mut buf[off + 4..off + 4 + len];
                match (dns.as_deref_mut(), dns::query(frame)) {
                    (Some(d), Some((tag, q))) => d.send(&tag, q, slirp.guest()),
                    _ if len > 0 => {
                        if slirp.guest().dns_tcp {
                            dns::tcp_to_forward(frame);
                        }
                        slirp.input(frame)
                    }
                    _ => {}
                }
                bytes += len as u64;
                off += 4 + len;
            }
            Frame::Partial => break None,
            Frame::Bad(len) => break Some(format!("a frame length of {len} bytes")),
        }
    };
    buf.copy_within(off..*have, 0);
    *have -= off;
    (bad, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_qemu_watch_ends_when_the_named_process_has_exited() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("qemu.pid");
        let mut w = QemuWatch::new(pidfile.clone());
        w.last_check -= QEMU_CHECK_EVERY;
        assert_eq!(w.ended(), None, "not started yet, within the start timeout");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        std::fs::write(&pidfile, format!("{}\n", child.id())).unwrap();
        w.last_check -= QEMU_CHECK_EVERY;
        assert_eq!(w.ended(), None, "alive");
        assert_eq!(w.seen, Some(child.id() as i32));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(w.ended(), None, "checked at most every QEMU_CHECK_EVERY");
        w.last_check -= QEMU_CHECK_EVERY;
        let why = w.ended().expect("gone");
        assert!(why.contains("has exited"), "{why}");
        // never started
        let mut w = QemuWatch::new(dir.path().join("never.pid"));
        w.started -= QEMU_START_TIMEOUT + Duration::from_secs(1);
        w.last_check -= QEMU_CHECK_EVERY;
        assert!(w.ended().expect("timed out").contains("within 60 s"));
    }

    #[test]
    fn a_listener_is_told_from_a_socket_file_left_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("proxy with space.sock");
        assert!(!listening(&path));
        let l = UnixListener::bind(&path).unwrap();
        assert!(listening(&path));
        assert!(
            !listening(&dir.path().join("proxy")),
            "a prefix is not the path"
        );
        drop(l);
        assert!(path.exists(), "the file stays");
        assert!(!listening(&path), "no listener: left behind");
    }

    #[test]
    fn frames_are_parsed_from_a_stream() {
        assert_eq!(frame_at(&[]), Frame::Partial);
        assert_eq!(frame_at(&[0, 0, 0]), Frame::Partial);
        assert_eq!(frame_at(&[0, 0, 0, 3, 1, 2]), Frame::Partial);
        assert_eq!(frame_at(&[0, 0, 0, 3, 1, 2, 3, 9]), Frame::Whole(3));
        assert_eq!(frame_at(&[0, 0, 0, 0]), Frame::Whole(0));
        let too_long = (MAX_FRAME as u32 + 1).to_be_bytes();
        assert_eq!(frame_at(&too_long), Frame::Bad(MAX_FRAME as u32 + 1));
    }

    /// A writer that takes at most `room` bytes, then would block.
    struct Slow {
        got: Vec<u8>,
        room: usize,
    }
    impl Write for Slow {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            if self.room == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = b.len().min(self.room);
            self.room -= n;
            self.got.extend_from_slice(&b[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_outbox_batches_keeps_what_qemu_did_not_take_and_drops_when_detached() {
        let mut out = Outbox::default();
        out.send(b"lost");
        assert!(!out.pending(), "no QEMU: dropped");
        out.reset(true);
        out.send(b"abc");
        out.send(b"de");
        let mut w = Slow {
            got: vec![],
            room: 5,
        };
        out.flush(&mut w).unwrap();
        assert!(out.pending());
        w.room = 100;
        out.flush(&mut w).unwrap();
        assert!(!out.pending());
        assert_eq!(w.got, b"\0\0\0\x03abc\0\0\0\x02de");
        // full: new frames are dropped and counted
        out.send(&vec![0; OUTBOX_MAX - 4]);
        out.send(b"x");
        assert_eq!(out.dropped, 1);
        out.reset(false);
        assert!(!out.pending());
    }

    #[test]
    fn a_missing_directory_and_a_live_socket_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let e = clear_stale(&dir.path().join("nope/net.sock")).unwrap_err();
        assert!(matches!(e, HelperError::NoDirectory { .. }), "{e}");
        let path = dir.path().join("net.sock");
        let live = UnixListener::bind(&path).unwrap();
        let e = clear_stale(&path).unwrap_err();
        assert!(matches!(e, HelperError::InUse { .. }), "{e}");
        drop(live); // the file stays: stale now
        clear_stale(&path).unwrap();
        assert!(!path.exists(), "a stale socket is removed");
        std::fs::write(&path, "x").unwrap();
        let e = clear_stale(&path).unwrap_err();
        assert!(matches!(e, HelperError::NotASocket { .. }), "{e}");
    }
}

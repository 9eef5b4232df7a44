//! A client of OpenSSH's ControlMaster multiplexing protocol, passenger mode only: run one
//! command, or open one forwarding channel (`ssh -W`), over a live master by talking to its
//! unix socket, the way `ssh` itself does when it finds a master, without starting an `ssh`
//! process (whose start is a good part of a warm command's cost, and most of a forwarded
//! connection's; docs/benchmarks.md).
//!
//! The wire format is OpenSSH's (`PROTOCOL.mux`, and `mux.c` where it differs: the flags of
//! `MUX_C_NEW_SESSION` are u32, not bool): packets of `u32 length, u32 type, body`, big endian,
//! strings as `u32 length, bytes`. A session is: both sides send `MUX_MSG_HELLO` (version 4),
//! the client sends `MUX_C_NEW_SESSION` and then its stdin, stdout and stderr, one
//! `SCM_RIGHTS` message each with a one-byte payload; the master answers
//! `MUX_S_SESSION_OPENED` (or `MUX_S_PERMISSION_DENIED` / `MUX_S_FAILURE`), later
//! `MUX_S_EXIT_MESSAGE` with the remote status, and closes the socket once the session's
//! output is written. A forward is `MUX_C_NEW_STDIO_FWD` and two descriptors (what to send,
//! where to write what comes back), answered `MUX_S_SESSION_OPENED` or `MUX_S_FAILURE` once
//! the server has opened or refused the channel; the master closes the socket when the channel
//! closes.
//!
//! # Guarantees
//! - Nothing ran in the VM when [`open`] or [`Session::run`] return [`Error::NoSession`]: the
//!   caller may run the command another way (`ssh`, which also starts a master). That is what
//!   `ssh` does too when its master refuses a session.
//! - Once a session is opened, its outcome is the remote exit status, or [`Outcome::Lost`] when
//!   the master closed the socket without one (the command was killed by a signal, or the
//!   connection dropped): `ssh` exits 255 then.
//! - The command's stdio are this process's own descriptors, passed to the master: it reads
//!   and writes them directly. When the reader of a stdout pipe goes away early (`| head -1`),
//!   the session is closed ([`Outcome::ReaderGone`]) rather than left running: the master
//!   only asks the server to stop the output (`eow@openssh.com`), which dropbear ignores.
//!
//! # Assumptions
//! - The master is OpenSSH's, speaking version 4 (every release since 5.6).
//! - No tty is wanted (the caller keeps `ssh -t` for that), so no escape character and no
//!   terminal modes; no environment is sent (boxery's ssh configs set no `SendEnv`/`SetEnv`).
//!
//! # Caveats
//! - Signals are not relayed: on Ctrl-C this process dies, the master sees its control socket
//!   close and stops the session's input and output (the remote command gets EOF on stdin and
//!   its writes fail), as it does for `ssh`'s own mux client, which also just leaves.
//! - Waiting for the master's hello is bounded (10 s, `ConnectTimeout` in the ssh configs);
//!   waiting for the session to open is not, as in `ssh`.

use std::io::{IoSlice, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

const MUX_MSG_HELLO: u32 = 0x0000_0001;
const MUX_C_NEW_SESSION: u32 = 0x1000_0002;
const MUX_C_NEW_STDIO_FWD: u32 = 0x1000_0008;
const MUX_S_PERMISSION_DENIED: u32 = 0x8000_0002;
const MUX_S_FAILURE: u32 = 0x8000_0003;
const MUX_S_EXIT_MESSAGE: u32 = 0x8000_0004;
const MUX_S_SESSION_OPENED: u32 = 0x8000_0006;
const MUX_S_TTY_ALLOC_FAIL: u32 = 0x8000_0008;
/// `SSHMUX_VER`.
const VERSION: u32 = 4;
/// The request id of the one request a connection makes.
const RID: u32 = 1;
/// No escape character (`0xffffffff` in `PROTOCOL.mux`).
const NO_ESCAPE: u32 = 0xffff_ffff;
/// Larger packets are not the master's: a mux reply is a few words and a message.
const MAX_PACKET: usize = 256 * 1024;
/// How long the master may take to say hello (`ConnectTimeout` of boxery's ssh configs).
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// What went wrong talking to a master.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No session was opened, so the command did not run: no master listens, it would not
    /// say hello, or it refused the session.
    #[error("no session over the ControlMaster: {0}")]
    NoSession(String),
    /// The session was opened, then the protocol broke (an unexpected message).
    #[error("the ControlMaster broke the session: {0}")]
    Broken(String),
}

/// How a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The remote command exited with this status.
    Exit(u32),
    /// The master closed the session without an exit status (`ssh` exits 255).
    Lost,
    /// This process's stdout is a pipe whose reader left: the session was closed (its
    /// command's input and output shut) without waiting for its status.
    ReaderGone,
}

/// A connection to a master that has said hello.
#[derive(Debug)]
pub struct Session {
    sock: UnixStream,
}

/// Connect to the master listening on `path` and exchange hellos. [`Error::NoSession`] when
/// none answers (no socket, a stale one, a master that hangs or speaks another version).
pub fn open(path: &Path) -> Result<Session, Error> {
    let no = |what: &str, e: std::io::Error| Error::NoSession(format!("{what}: {e}"));
    let sock = UnixStream::connect(path).map_err(|e| no("connect", e))?;
    let mut s = Session { sock };
    s.sock
        .set_read_timeout(Some(HELLO_TIMEOUT))
        .map_err(|e| no("socket", e))?;
    s.send(&Packet::new(MUX_MSG_HELLO).u32(VERSION).0)
        .map_err(|e| no("send hello", e))?;
    let hello = s.recv().map_err(|e| no("read hello", e))?;
    let mut r = Reader(&hello);
    match (r.u32(), r.u32()) {
        (Some(MUX_MSG_HELLO), Some(VERSION)) => {} // extensions follow; none is used
        (t, v) => {
            return Err(Error::NoSession(format!(
                "unexpected hello (type {t:?}, version {v:?}; version {VERSION} is spoken)"
            )));
        }
    }
    s.sock.set_read_timeout(None).map_err(|e| no("socket", e))?;
    Ok(s)
}

impl Session {
    /// Run `command` (one line for the remote shell) with this process's stdin, stdout and
    /// stderr, no tty; `term` is sent as `TERM`. Returns when the master closes the session.
    pub fn run(mut self, command: &str, term: &str) -> Result<Outcome, Error> {
        let request = Packet::new(MUX_C_NEW_SESSION)
            .u32(RID)
            .string(b"") // reserved
            .u32(0) // want tty
            .u32(0) // want X11 forwarding
            .u32(0) // want agent forwarding
            .u32(0) // subsystem
            .u32(NO_ESCAPE)
            .string(term.as_bytes())
            .string(command.as_bytes())
            .0;
        self.request(
            &request,
            &[
                std::io::stdin().as_fd(),
                std::io::stdout().as_fd(),
                std::io::stderr().as_fd(),
            ],
        )?;
        let reply = self
            .recv()
            .map_err(|e| Error::NoSession(format!("read the reply: {e}")))?;
        let (kind, reply) = reply_to(&reply)?;
        let mut r = Reader(reply);
        let sid = match kind {
            Some(MUX_S_SESSION_OPENED) => r
                .u32()
                .ok_or_else(|| Error::NoSession("a short session-opened reply".into()))?,
            Some(MUX_S_PERMISSION_DENIED) => {
                return Err(Error::NoSession(format!("refused: {}", r.text())));
            }
            Some(MUX_S_FAILURE) => {
                return Err(Error::NoSession(format!("failed: {}", r.text())));
            }
            other => {
                return Err(Error::NoSession(format!("unexpected reply {other:?}")));
            }
        };
        // The command runs. The master sends its status, then closes the socket once the
        // output is written: read to the end, so that nothing is cut off.
        let mut exit = None;
        loop {
            if !self.wait() {
                return Ok(Outcome::ReaderGone);
            }
            let msg = match self.recv() {
                Ok(m) => m,
                Err(_) => break, // closed (or broken): the session is over
            };
            let mut r = Reader(&msg);
            match (r.u32(), r.u32()) {
                (Some(MUX_S_TTY_ALLOC_FAIL), Some(s)) if s == sid => {}
                (Some(MUX_S_EXIT_MESSAGE), Some(s)) if s == sid && exit.is_none() => {
                    exit = r.u32();
                }
                (kind, s) => {
                    return Err(Error::Broken(format!(
                        "unexpected message {kind:?} for session {s:?} (ours is {sid})"
                    )));
                }
            }
        }
        Ok(exit.map_or(Outcome::Lost, Outcome::Exit))
    }

    /// Ask for a channel from the server to `host:port`, what `ssh -W host:port` does over a
    /// master: the master is to read what to send from `input` and write what comes back to
    /// `output` (it closes its copy of `output` at the far side's end of file), until both
    /// sides have ended. Only the request is sent: the master answers once the server has
    /// opened or refused the channel, a round trip to the guest that the caller awaits as it
    /// likes ([`Session::into_socket`], [`read_reply`], then [`forward_answer`]).
    /// [`Error::NoSession`]: the request could not be made; nothing was opened.
    pub fn ask_forward(
        &mut self,
        host: &str,
        port: u16,
        input: BorrowedFd<'_>,
        output: BorrowedFd<'_>,
    ) -> Result<(), Error> {
        let request = Packet::new(MUX_C_NEW_STDIO_FWD)
            .u32(RID)
            .string(b"") // reserved
            .string(host.as_bytes())
            .u32(u32::from(port))
            .0;
        self.request(&request, &[input, output])
    }

    /// The connection to the master. After [`Session::ask_forward`] and an open channel, keep it
    /// open while the channel is used: the master closes it once the channel has closed, and
    /// closing it first closes the channel.
    pub fn into_socket(self) -> UnixStream {
        self.sock
    }

    /// Send `request` and the descriptors it names. [`Error::NoSession`] on failure: nothing
    /// was opened.
    fn request(&mut self, request: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), Error> {
        let no = |what: &str, e: std::io::Error| Error::NoSession(format!("{what}: {e}"));
        self.send(request).map_err(|e| no("send the request", e))?;
        for fd in fds {
            send_fd(&self.sock, *fd).map_err(|e| no("pass the descriptors", e))?;
        }
        Ok(())
    }

    /// Wait until the master says something (`true`), or until this process's stdout is a
    /// pipe whose reader left (`false`): then nobody reads the command's output, and leaving
    /// closes the session, as the end of a local pipeline's reader stops its writer. (The
    /// master alone would not stop it: it tells the server with `eow@openssh.com`, which
    /// dropbear ignores, and keeps discarding the output.)
    fn wait(&self) -> bool {
        use rustix::event::{PollFd, PollFlags, poll};
        let out = std::io::stdout();
        let mut watch_out = true;
        loop {
            let mut fds = [
                PollFd::new(&self.sock, PollFlags::IN),
                PollFd::new(&out, PollFlags::empty()),
            ];
            let n = if watch_out { 2 } else { 1 };
            match poll(&mut fds[..n], None) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => return true, // the read says what is wrong
            }
            if !fds[0].revents().is_empty() {
                return true;
            }
            if fds[1].revents().contains(PollFlags::ERR) {
                return false;
            }
            // Hung up or not open: nothing to watch there.
            watch_out = fds[1].revents().is_empty();
        }
    }

    fn send(&mut self, body: &[u8]) -> std::io::Result<()> {
        let len = u32::try_from(body.len()).map_err(std::io::Error::other)?;
        let mut packet = Vec::with_capacity(4 + body.len());
        packet.extend_from_slice(&len.to_be_bytes());
        packet.extend_from_slice(body);
        self.sock.write_all(&packet)
    }

    fn recv(&mut self) -> std::io::Result<Vec<u8>> {
        let mut len = [0u8; 4];
        self.sock.read_exact(&mut len)?;
        let mut body = vec![0u8; body_len(len)?];
        self.sock.read_exact(&mut body)?;
        Ok(body)
    }
}

/// A packet's body length from its length field, refusing more than a master's reply holds
/// before anything is allocated for it.
fn body_len(field: [u8; 4]) -> std::io::Result<usize> {
    let len = u32::from_be_bytes(field) as usize;
    if len > MAX_PACKET {
        return Err(std::io::Error::other(format!("a {len}-byte packet")));
    }
    Ok(len)
}

/// The type of a reply to this connection's request, and what follows the request id.
fn reply_to(body: &[u8]) -> Result<(Option<u32>, &[u8]), Error> {
    let mut r = Reader(body);
    let (kind, rid) = (r.u32(), r.u32());
    if rid != Some(RID) {
        return Err(Error::NoSession(format!(
            "reply {kind:?} to request {rid:?}, not {RID}"
        )));
    }
    Ok((kind, r.0))
}

/// The master's answer to [`Session::ask_forward`] (a packet's body): `Ok(Ok(()))` the channel
/// is open; `Ok(Err(why))` the server refused it (nothing listens at the port, or it allows no
/// forwarding: what the master said); [`Error::NoSession`] the master did not take it.
pub fn forward_answer(body: &[u8]) -> Result<Result<(), String>, Error> {
    let (kind, rest) = reply_to(body)?;
    let mut r = Reader(rest);
    match kind {
        Some(MUX_S_SESSION_OPENED) => Ok(Ok(())),
        Some(MUX_S_FAILURE) => Ok(Err(r.text())),
        Some(MUX_S_PERMISSION_DENIED) => Err(Error::NoSession(format!("refused: {}", r.text()))),
        other => Err(Error::NoSession(format!("unexpected reply {other:?}"))),
    }
}

/// Read the master's reply (one packet's body) on a socket the runtime awaits, as
/// [`Session`] reads its own blocking.
pub async fn read_reply(
    sock: &mut (impl tokio::io::AsyncRead + Unpin),
) -> std::io::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut len = [0u8; 4];
    sock.read_exact(&mut len).await?;
    let mut body = vec![0u8; body_len(len)?];
    sock.read_exact(&mut body).await?;
    Ok(body)
}

/// Pass one descriptor as `mm_send_fd` does: one `SCM_RIGHTS` message, one zero byte.
fn send_fd(sock: &UnixStream, fd: BorrowedFd<'_>) -> std::io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("no room for the descriptor"));
    }
    loop {
        match rustix::net::sendmsg(
            sock,
            &[IoSlice::new(&[0])],
            &mut control,
            SendFlags::empty(),
        ) {
            Ok(1) => return Ok(()),
            Ok(n) => return Err(std::io::Error::other(format!("sent {n} bytes, not 1"))),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// A packet body being built.
struct Packet(Vec<u8>);

impl Packet {
    fn new(kind: u32) -> Packet {
        Packet(kind.to_be_bytes().to_vec())
    }
    fn u32(mut self, v: u32) -> Packet {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn string(mut self, s: &[u8]) -> Packet {
        // Callers' strings are a command line and $TERM, far below 4 GiB.
        self.0
            .extend_from_slice(&(s.len().min(u32::MAX as usize) as u32).to_be_bytes());
        self.0.extend_from_slice(s);
        self
    }
}

/// A packet body being read.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u32(&mut self) -> Option<u32> {
        let (head, rest) = self.0.split_first_chunk::<4>()?;
        self.0 = rest;
        Some(u32::from_be_bytes(*head))
    }
    /// A string, shown safely (it is the master's message).
    fn text(&mut self) -> String {
        let Some(len) = self.u32() else {
            return String::new();
        };
        let s = &self.0[..(len as usize).min(self.0.len())];
        self.0 = &self.0[s.len()..];
        boxery_api::name::safe(&String::from_utf8_lossy(s)).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn packet(body: &[u8]) -> Vec<u8> {
        let mut p = (body.len() as u32).to_be_bytes().to_vec();
        p.extend_from_slice(body);
        p
    }

    fn read_packet(s: &mut UnixStream) -> Vec<u8> {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut b = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut b).unwrap();
        b
    }

    /// Bytes as mux.c's client writes them: hello, then the session request with u32 flags.
    #[test]
    fn wire_format_is_openssh_s() {
        assert_eq!(
            Packet::new(MUX_MSG_HELLO).u32(VERSION).0,
            [0, 0, 0, 1, 0, 0, 0, 4]
        );
        let req = Packet::new(MUX_C_NEW_SESSION)
            .u32(7)
            .string(b"")
            .u32(0)
            .u32(NO_ESCAPE)
            .string(b"ab")
            .0;
        assert_eq!(
            req,
            [
                0x10, 0, 0, 2, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0, 0,
                2, b'a', b'b'
            ]
        );
    }

    /// A forward's request as mux.c reads it (`host`, then the port as u32, two descriptors);
    /// a refused channel is the master's message, an opened one the socket to hold.
    #[test]
    fn a_forward_is_asked_for_as_ssh_w_asks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cm");
        let serve = |reply: Vec<u8>| {
            let _ = std::fs::remove_file(&path);
            let l = UnixListener::bind(&path).unwrap();
            std::thread::spawn(move || {
                let (mut s, _) = l.accept().unwrap();
                s.write_all(&packet(&Packet::new(MUX_MSG_HELLO).u32(VERSION).0))
                    .unwrap();
                let _ = read_packet(&mut s);
                let req = read_packet(&mut s);
                let mut want = vec![0x10, 0, 0, 8, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9];
                want.extend_from_slice(b"127.0.0.1");
                want.extend_from_slice(&8080u32.to_be_bytes());
                assert_eq!(req, want);
                let mut byte = [0u8; 2];
                s.read_exact(&mut byte).unwrap(); // the two fds' payloads
                s.write_all(&packet(&reply)).unwrap();
                s // the channel lasts as long as the master keeps it
            })
        };
        let (r, w) = std::io::pipe().unwrap();
        let forward = || -> Result<Result<UnixStream, String>, Error> {
            let mut s = open(&path)?;
            s.ask_forward("127.0.0.1", 8080, r.as_fd(), w.as_fd())?;
            let mut sock = s.into_socket();
            let answer = forward_answer(&read_packet(&mut sock))?;
            Ok(answer.map(|()| sock))
        };

        let refused = Packet::new(MUX_S_FAILURE)
            .u32(RID)
            .string(b"Session open refused by peer")
            .0;
        let t = serve(refused);
        assert_eq!(
            forward().unwrap().unwrap_err(),
            "Session open refused by peer"
        );
        t.join().unwrap();

        let t = serve(Packet::new(MUX_S_SESSION_OPENED).u32(RID).u32(3).0);
        let mut held = forward().unwrap().unwrap();
        drop(t.join().unwrap()); // the master closes it: the channel is over
        assert_eq!(held.read(&mut [0u8; 8]).unwrap(), 0);

        let denied = Packet::new(MUX_S_PERMISSION_DENIED)
            .u32(RID)
            .string(b"no")
            .0;
        let t = serve(denied);
        assert!(matches!(forward(), Err(Error::NoSession(_))));
        t.join().unwrap();
    }

    /// A fake master: no socket and a wrong version are `NoSession` (the caller falls back);
    /// a refusal too; after an opened session, no exit message is `Lost`.
    #[test]
    fn no_master_or_a_refusal_is_no_session() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cm");
        assert!(matches!(open(&path), Err(Error::NoSession(_))));

        let serve = |hello_version: u32, reply: Vec<u8>, after: Vec<Vec<u8>>| {
            let _ = std::fs::remove_file(&path);
            let l = UnixListener::bind(&path).unwrap();
            std::thread::spawn(move || {
                let (mut s, _) = l.accept().unwrap();
                s.write_all(&packet(
                    &Packet::new(MUX_MSG_HELLO)
                        .u32(hello_version)
                        .string(b"info")
                        .string(b"0")
                        .0,
                ))
                .unwrap();
                let _ = read_packet(&mut s);
                if hello_version != VERSION {
                    return;
                }
                let req = read_packet(&mut s);
                assert_eq!(&req[..8], &[0x10, 0, 0, 2, 0, 0, 0, 1]);
                let mut byte = [0u8; 3];
                s.read_exact(&mut byte).unwrap(); // the three fds' payloads
                s.write_all(&packet(&reply)).unwrap();
                for m in after {
                    s.write_all(&packet(&m)).unwrap();
                }
            })
        };
        let t = serve(3, vec![], vec![]);
        assert!(matches!(open(&path), Err(Error::NoSession(_))));
        t.join().unwrap();

        let denied = Packet::new(MUX_S_PERMISSION_DENIED)
            .u32(RID)
            .string(b"Permission denied")
            .0;
        let t = serve(VERSION, denied, vec![]);
        let e = open(&path).unwrap().run("true", "").unwrap_err();
        assert!(e.to_string().contains("Permission denied"), "{e}");
        t.join().unwrap();

        let opened = Packet::new(MUX_S_SESSION_OPENED).u32(RID).u32(5).0;
        let t = serve(VERSION, opened.clone(), vec![]);
        assert_eq!(open(&path).unwrap().run("true", "").unwrap(), Outcome::Lost);
        t.join().unwrap();

        let t = serve(
            VERSION,
            opened,
            vec![
                Packet::new(MUX_S_TTY_ALLOC_FAIL).u32(5).0,
                Packet::new(MUX_S_EXIT_MESSAGE).u32(5).u32(7).0,
            ],
        );
        assert_eq!(
            open(&path).unwrap().run("true", "").unwrap(),
            Outcome::Exit(7)
        );
        t.join().unwrap();
    }
}

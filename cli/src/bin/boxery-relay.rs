//! `boxery-relay SOCKET`: carries one guest connection between stdin/stdout and a unix
//! socket. QEMU's slirp runs it for each connection a guest opens to the control plane's proxy
//! (`guestfwd=…-cmd:boxery-relay $BOXERY_HOME/qemu/vms/NAME/proxy.sock`), so it starts once per
//! connection: it uses the standard library only and does nothing else, to start in about a
//! millisecond where `socat` takes three to four (docs/benchmarks.md, "Egress").
//!
//! Guest → socket until the guest's side ends (then the socket's write side is shut, so the
//! proxy sees the end of the request), socket → guest until the proxy closes: a response is
//! never cut short after the guest half-closes. Exit 1 when the socket cannot be reached.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

fn main() {
    let Some(path) = std::env::args_os().nth(1) else {
        eprintln!("usage: boxery-relay SOCKET (run by QEMU for each guest connection)");
        std::process::exit(2);
    };
    let sock = match UnixStream::connect(&path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("boxery-relay: {}: {e}", path.to_string_lossy());
            std::process::exit(1);
        }
    };
    let Ok(mut from) = sock.try_clone() else {
        std::process::exit(1);
    };
    let back = std::thread::spawn(move || {
        let mut out = std::io::stdout().lock();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if out.write_all(&buf[..n]).and_then(|()| out.flush()).is_err() {
                        break;
                    }
                }
            }
        }
    });
    let mut to = sock;
    let mut input = std::io::stdin().lock();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match input.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
    let _ = back.join();
}

//! `boxery-relay SOCKET`: carries one guest connection between stdin/stdout and a unix
//! socket. QEMU's slirp runs it for each connection a guest opens to the control plane's proxy
//! (`guestfwd=…-cmd:boxery-relay $BOXERY_HOME/qemu/vms/NAME/proxy.sock`), so it starts once per
//! connection: it uses the standard library only and does nothing else, to start in about a
//! millisecond where `socat` takes three to four (docs/benchmarks.md, "Egress").
//!
//! Guest → socket until the guest's side ends (then the socket's write side is shut, so the
//! proxy sees the end of the request), socket → guest until the proxy closes: a response is
//! never cut short after the guest half-closes. When the socket cannot be reached (no control
//! plane leads), the guest gets a `503` saying to run `boxery serve`, and the relay exits 1.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

fn main() {
    let Some(path) = std::env::args_os().nth(1) else {
        eprintln!("usage: boxery-relay SOCKET (run by QEMU for each guest connection)");
        std::process::exit(2);
    };
    let sock = match UnixStream::connect(&path) {
        Ok(s) => s,
        Err(_) => {
            // The guest's client (curl, apt, pip: through http_proxy) shows this, instead of
            // a bare reset, and its person learns what to run.
            let body = "boxery: no control plane serves this VM's proxy and egress: run `boxery serve` on the host (or `boxery service install`)\n";
            let _ = write!(
                std::io::stdout(),
                "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n\
                 x-boxery-egress: failed\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            // Nothing on stderr: slirp hands the relay the guest's connection as stderr too,
            // and the guest is not told the host's paths.
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

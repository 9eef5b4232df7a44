//! `boxery-net`: one VM's network, slirp outside QEMU.
//!
//! ```text
//! boxery-net --net-sock PATH --ssh-port PORT --proxy-sock PATH [--dns-sock PATH] [--pidfile PATH] [--qemu-pidfile PATH]
//! ```
//! Listens on the unix socket `--net-sock` (mode 0600; a stale socket there is replaced) for
//! QEMU started with
//! `-netdev stream,id=n0,server=off,addr.type=unix,addr.path=PATH,reconnect-ms=200`.
//! The guest's network is QEMU's restricted user network: 10.0.2.0/24, host 10.0.2.2, DHCP
//! from 10.0.2.15, DNS 10.0.2.3, IPv6 off, no way out but the two forwards:
//! - host `127.0.0.1:PORT` → the guest's sshd (port 22);
//! - guest `10.0.2.100:80` → a `connect()` to the unix socket `--proxy-sock`, per connection;
//! - with `--dns-sock`, the guest's name lookups (UDP to 10.0.2.3:53) → datagrams to that
//!   socket, answered by the control plane (`boxery_net::dns`).
//!
//! When QEMU disconnects the helper waits for it to reconnect. SIGTERM or SIGINT stop it, and
//! so does the exit of the QEMU named in `--qemu-pidfile`: the socket and the pidfile are
//! removed, exit status 0. Errors go to stderr, exit status 1.

use std::path::PathBuf;
use std::process::ExitCode;

use boxery_net::helper::{self, Options};
use clap::Parser;

/// One VM's network: libslirp outside QEMU, behind QEMU's `-netdev stream` on a unix socket.
///
/// The guest gets QEMU's restricted user network (10.0.2.0/24, host 10.0.2.2, DHCP from
/// 10.0.2.15, DNS 10.0.2.3, IPv6 off) with two forwards only: host 127.0.0.1:SSH_PORT to the
/// guest's port 22, and the guest's 10.0.2.100:80 to the unix socket PROXY_SOCK; with
/// --dns-sock, its name lookups go to the control plane, which answers them by its policy. Start QEMU
/// with `-netdev stream,id=n0,server=off,addr.type=unix,addr.path=NET_SOCK,reconnect-ms=200`.
/// When QEMU disconnects, boxery-net waits for it to reconnect. SIGTERM or SIGINT stop it, as
/// does the exit of the QEMU named in --qemu-pidfile; NET_SOCK and the pidfile are removed.
#[derive(Debug, Parser)]
#[command(name = "boxery-net", version)]
struct Args {
    /// The unix socket to listen on for QEMU (created mode 0600; a stale socket is replaced)
    #[arg(long, value_name = "PATH")]
    net_sock: PathBuf,
    /// The host loopback port forwarded to the guest's sshd (127.0.0.1:PORT -> guest:22)
    #[arg(long, value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    ssh_port: u16,
    /// The unix socket that guest connections to 10.0.2.100:80 are connected to (it may appear
    /// later: slirp connects at each guest connection)
    #[arg(long, value_name = "PATH")]
    proxy_sock: PathBuf,
    /// The unix datagram socket the guest's name lookups (UDP to 10.0.2.3:53) are sent to,
    /// tagged; its answers come back on NET_SOCK's `.dns.sock` sibling. Without it, lookups
    /// get no answer
    #[arg(long, value_name = "PATH")]
    dns_sock: Option<PathBuf>,
    /// The unix stream socket the guest's name lookups over TCP (to 10.0.2.3:53) are
    /// connected to (it may appear later). Without it, they are refused
    #[arg(long, value_name = "PATH")]
    dns_tcp_sock: Option<PathBuf>,
    /// Write the pid here once ready (everything listening); removed on exit
    #[arg(long, value_name = "PATH")]
    pidfile: Option<PathBuf>,
    /// QEMU's pidfile: exit (status 0) once the QEMU named there has exited, or when no live
    /// QEMU is named there within 60 s
    #[arg(long, value_name = "PATH")]
    qemu_pidfile: Option<PathBuf>,
    /// Keep the guest's network byte counts here (`rx BYTES tx BYTES`, rewritten every 2 s
    /// while they change); removed on exit
    #[arg(long, value_name = "PATH")]
    stats: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let opts = Options {
        net_sock: args.net_sock,
        ssh_port: args.ssh_port,
        proxy_sock: args.proxy_sock,
        dns_sock: args.dns_sock,
        dns_tcp_sock: args.dns_tcp_sock,
        pidfile: args.pidfile,
        qemu_pidfile: args.qemu_pidfile,
        stats: args.stats,
    };
    match helper::run(&opts) {
        Ok(stopped) => {
            eprintln!("boxery-net: {stopped}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            let mut msg = format!("boxery-net: error: {e}");
            let mut cause = std::error::Error::source(&e);
            while let Some(c) = cause {
                msg.push_str(&format!(": {c}"));
                cause = c.source();
            }
            eprintln!("{msg}");
            ExitCode::FAILURE
        }
    }
}

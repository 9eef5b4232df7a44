//! boxery-net's command line without QEMU: what a caller sees when it cannot start, and a
//! clean stop.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn net(dir: &Path, port: u16) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_boxery-net"));
    c.arg("--net-sock")
        .arg(dir.join("net.sock"))
        .args(["--ssh-port", &port.to_string()])
        .arg("--proxy-sock")
        .arg(dir.join("proxy.sock"))
        .arg("--pidfile")
        .arg(dir.join("net.pid"))
        .stdin(Stdio::null());
    c
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn failed(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(1), "exit status 1");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Killed when dropped.
struct Running(Child);
impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_ready(dir: &Path, child: &mut Child) {
    let t = Instant::now();
    let pid = child.id().to_string();
    while !std::fs::read_to_string(dir.join("net.pid")).is_ok_and(|s| s.trim() == pid) {
        assert!(child.try_wait().unwrap().is_none(), "boxery-net exited");
        assert!(t.elapsed() < Duration::from_secs(10), "not ready in 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_missing_socket_directory_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = net(&dir.path().join("gone"), free_port()).output().unwrap();
    let err = failed(&out);
    assert!(
        err.contains("its directory") && err.contains("does not exist"),
        "{err}"
    );
}

#[test]
fn a_taken_port_is_named_and_leaves_no_socket() {
    let dir = tempfile::tempdir().unwrap();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let out = net(dir.path(), port).output().unwrap();
    let err = failed(&out);
    assert!(
        err.contains(&format!("127.0.0.1:{port}")) && err.contains("in use"),
        "{err}"
    );
    assert!(!dir.path().join("net.sock").exists());
    assert!(!dir.path().join("net.pid").exists());
}

#[test]
fn a_live_helper_is_not_displaced_and_sigterm_stops_it_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = Running(net(dir.path(), free_port()).spawn().unwrap());
    wait_ready(dir.path(), &mut first.0);

    let out = net(dir.path(), free_port()).output().unwrap();
    let err = failed(&out);
    assert!(err.contains("is in use"), "{err}");
    assert!(
        dir.path().join("net.sock").exists(),
        "the first one's socket stays"
    );

    let pid = first.0.id().to_string();
    let kill = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(kill.success());
    let t = Instant::now();
    let status = loop {
        if let Some(s) = first.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
    assert!(!dir.path().join("net.sock").exists(), "socket removed");
    assert!(!dir.path().join("net.pid").exists(), "pidfile removed");
}

#[test]
fn a_bad_port_is_refused_by_the_parser() {
    let dir = tempfile::tempdir().unwrap();
    let out = net(dir.path(), 0).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "clap's usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--ssh-port"));
}

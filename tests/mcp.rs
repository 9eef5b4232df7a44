//! The MCP server driven by a client we did not write: the official Python MCP SDK
//! (`pip install mcp jsonschema`; scripts/test.sh installs both into target/mcp-venv).
//! tests/mcp/client.py holds the checks; these tests run it against `boxery mcp` (stdio) and
//! `boxery serve --mcp-listen` (HTTP), with the fake backend, and once with a real QEMU VM.
//! They fail (never skip) when python3 or the SDK is missing, saying how to install them.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::Home;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The python with the SDK: $BOXERY_TEST_PYTHON, else target/mcp-venv, else python3.
fn python() -> PathBuf {
    let candidates: Vec<PathBuf> = std::env::var_os("BOXERY_TEST_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain([root().join("target/mcp-venv/bin/python"), "python3".into()])
        .collect();
    for p in &candidates {
        let ok = Command::new(p)
            .args(["-c", "import mcp, jsonschema"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return p.clone();
        }
    }
    panic!(
        "no python with the MCP SDK: run `python3 -m venv target/mcp-venv && target/mcp-venv/bin/pip install mcp jsonschema` (scripts/test.sh does this), or set BOXERY_TEST_PYTHON"
    );
}

fn client(home: &Home, backend: &str, args: &[&str], timeout: Duration) {
    let mut child = Command::new(python())
        .arg(root().join("tests/mcp/client.py"))
        .args(args)
        .env("BOXERY_HOME", home.path())
        .env("BOXERY_BACKEND", backend)
        .env("BOXERY_LOG", "warn")
        // ssh's own debug log, shown when the client fails (an ssh exit 255 without a word)
        .env("BOXERY_SSH_LOG", home.path().join("ssh-debug.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python");
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(_st) = child.try_wait().unwrap() {
            break;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "client.py {args:?} timed out:\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    if !out.status.success() {
        let log = std::fs::read_to_string(home.path().join("ssh-debug.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(60).collect();
        panic!(
            "client.py {args:?} failed:\nstdout: {}\nstderr: {}\nssh log (last lines, newest first): {tail:#?}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn stdio_tools_schemas_and_bad_calls() {
    let h = Home::new();
    client(
        &h,
        "fake",
        &["tools", common::bin()],
        Duration::from_secs(180),
    );
}

/// vm_grant through a client with elicitation: its person's yes approves (and the grant is
/// applied), a no denies, a dismissal leaves it pending; without elicitation the result says
/// to run `boxery grant approve`.
#[test]
fn stdio_grants_with_elicitation() {
    let h = Home::new();
    client(
        &h,
        "fake",
        &["grants", common::bin()],
        Duration::from_secs(180),
    );
}

/// vm_lease on a fake pool of 2: acquire binds a member that becomes the session's default VM,
/// the session renews it, release resets it to Free; closing stdin or SIGTERM releases too.
#[test]
fn stdio_lease_on_a_pool() {
    let h = Home::new();
    client(
        &h,
        "fake",
        &["lease", common::bin()],
        Duration::from_secs(300),
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn http_needs_the_token_and_a_good_origin() {
    let h = Home::new();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let serve = h.serve(&["--mcp-listen", &addr]);
    let token = h.path().join("mcp-token");
    let up = common::eventually(Duration::from_secs(30), || {
        (token.exists() && std::net::TcpStream::connect(&addr).is_ok()).then_some(())
    });
    assert!(
        up.is_some(),
        "serve --mcp-listen did not come up: {}",
        std::fs::read_to_string(&serve.log).unwrap_or_default()
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&token).unwrap().permissions().mode() & 0o777,
        0o600
    );
    client(
        &h,
        "fake",
        &[
            "http",
            &format!("http://{addr}/mcp"),
            token.to_str().unwrap(),
        ],
        Duration::from_secs(120),
    );
    drop(serve);
}

/// Kill the QEMU processes a home started (by their pidfiles).
struct QemuGuard<'a>(&'a Home);

impl Drop for QemuGuard<'_> {
    fn drop(&mut self) {
        let Ok(vms) = std::fs::read_dir(self.0.path().join("qemu/vms")) else {
            return;
        };
        for vm in vms.flatten() {
            if let Some(pid) = std::fs::read_to_string(vm.path().join("qemu.pid"))
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
            {
                let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            }
        }
    }
}

#[test]
fn real_vm_through_the_python_sdk() {
    let ok = Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "qemu-system-x86_64 is not installed: run scripts/install-deps.sh (as root)"
    );
    let h = Home::new();
    let _guard = QemuGuard(&h);
    let out = tempfile::tempdir().unwrap();
    client(
        &h,
        "qemu",
        &["vm", common::bin(), out.path().to_str().unwrap()],
        Duration::from_secs(1500),
    );
}

/// `vm_patch` of an approved grant's spec answers with the state after the controller's
/// reaction: the changed grant is PendingApproval and NOT in force until a person approves it
/// again, never "Applied" from the status of the generation that was approved (issue 30,
/// class 5). Driven over stdio JSON-RPC with `boxery mcp`, a `serve` leading.
#[test]
fn patching_an_approved_grant_says_it_needs_approval_again() {
    use std::io::{BufRead, BufReader, Write};
    let home = Home::new();
    let serve = home.serve_env(&[], &[("GRANT_TEST_KEY", "v1"), ("GRANT_TEST_KEY2", "v2")]);
    serve.wait_leading();
    home.ok(&["new", "dev1", "--from", "tiny", "--wait"]);
    let g = home.write(
        "g1.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Grant\nmetadata: {name: g1}\nspec:\n  vm: dev1\n  type: llm\n  target: anthropic\n  valueFrom: {env: GRANT_TEST_KEY}\n",
    );
    home.ok(&["apply", "-f", g.to_str().unwrap()]);
    // A person's approval of generation 1, as `grant approve` writes it.
    let store = home.store();
    common::eventually(Duration::from_secs(20), || {
        let mut obj = store.get("Grant", "g1").unwrap().unwrap();
        let generation = obj.metadata.generation.unwrap();
        obj.rest.insert(
            "status".into(),
            serde_json::json!({"phase": "PendingApproval", "approvedBy": "root",
                "approvedGeneration": generation, "approvedAt": "2026-01-01T00:00:00Z"}),
        );
        // The controller writes the status too: again on a conflict.
        store.update_status(obj).ok()
    })
    .expect("the approval written");
    common::eventually(Duration::from_secs(20), || {
        let g: boxery_api::Grant = home.store().get_as("g1").unwrap()?;
        (g.status.phase == boxery_api::grant::GrantPhase::Applied).then_some(())
    })
    .expect("the approved grant is Applied");

    let mut child = home
        .cmd()
        .arg("mcp")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut stdin = child.stdin.take().unwrap();
    let mut request = |id: u64, method: &str, params: serde_json::Value| {
        let msg =
            serde_json::json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        writeln!(stdin, "{msg}").unwrap();
        if method == "initialize" {
            writeln!(
                stdin,
                "{}",
                serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"})
            )
            .unwrap();
        }
        stdin.flush().unwrap();
        loop {
            let mut line = String::new();
            assert!(out.read_line(&mut line).unwrap() > 0, "mcp closed");
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            if v["id"] == serde_json::json!(id) {
                return v;
            }
        }
    };
    request(
        1,
        "initialize",
        serde_json::json!({"protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "class5", "version": "0"}}),
    );
    let r = request(
        2,
        "tools/call",
        serde_json::json!({"name": "vm_patch", "arguments": {"kind": "grant", "name": "g1",
            "patch": "{\"spec\": {\"valueFrom\": {\"env\": \"GRANT_TEST_KEY2\"}}}"}}),
    );
    let _ = child.kill();
    let _ = child.wait();
    let text = r["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    eprintln!("vm_patch answered:\n{text}");
    assert_ne!(r["result"]["isError"], serde_json::json!(true), "{r}");
    assert!(
        !text.contains("it is Applied"),
        "vm_patch said the changed grant is Applied:\n{text}"
    );
    assert!(
        text.contains("it is PendingApproval") && text.contains("NOT in force"),
        "vm_patch did not say the change awaits approval:\n{text}"
    );
    let g: boxery_api::Grant = home.store().get_as("g1").unwrap().unwrap();
    assert_eq!(
        g.status.phase,
        boxery_api::grant::GrantPhase::PendingApproval
    );
}

//! The audit of actions (issue 36, docs/observability.md "Audit") on the fake backend: a
//! command through `run` (the fake VM has no sshd: it fails, and the failure is recorded), an
//! agent's MCP tool calls over stdio, a write through the API with a token, in order, with
//! who, through what and the result; `--vm`, `--holder` and `--since` filter; a command whose
//! text holds a newline, JSON and a terminal escape is one line, kept as given, and shown
//! escaped. The real VMs' commands (exit codes, vm_bash) are checked in
//! tests/real_vms/usage.rs.

mod common;

use std::time::Duration;

use common::Home;
use common::mcp_stdio::Mcp;
use serde_json::{Value, json};

fn audit(home: &Home, args: &[&str]) -> Vec<Value> {
    let mut all = vec!["audit", "-o", "json"];
    all.extend_from_slice(args);
    home.ok(&all)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn commands_tool_calls_and_api_writes_are_audited_in_order() {
    let api = common::api::Api::start();
    let home = &api.home;
    home.ok(&["new", "a1", "--from", "tiny", "--wait"]);
    home.ok(&["new", "a2", "--from", "tiny", "--wait"]);

    // A command as given, hostile text included: not run (no sshd on the fake), recorded.
    let hostile = "echo hi\n{\"time\":\"x\",\"who\":\"forged\"}\u{1b}[2J";
    let o = home.run(&["run", "a1", "--", hostile]);
    assert!(!o.status.success());

    // An agent's tool calls.
    let mut mcp = Mcp::start(home);
    let (err, text) = mcp.call("vm_get", json!({"kind": "vm", "name": "a2"}));
    assert!(!err, "{text}");
    let (err, _) = mcp.call("vm_bash", json!({"vm": "a2", "command": "uname -a"}));
    assert!(err, "the fake VM has no shell");
    drop(mcp);

    // A write through the API, with a token.
    let out = api.k(&[
        "patch",
        "vms.boxery.dev",
        "a2",
        "--type",
        "merge",
        "-p",
        r#"{"metadata":{"labels":{"team":"audit"}}}"#,
    ]);
    assert!(out.contains("patched"), "{out}");

    let all = common::eventually(Duration::from_secs(10), || {
        let a = audit(home, &[]);
        a.iter().any(|x| x["via"] == "api").then_some(a)
    })
    .expect("the API's write is audited");
    let seen: Vec<(String, String, String, String)> = all
        .iter()
        .map(|a| {
            (
                a["via"].as_str().unwrap().to_string(),
                a["action"].as_str().unwrap().to_string(),
                a["what"].as_str().unwrap().to_string(),
                a["result"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    // The line that says how an action ended (a command's start is a line of its own).
    let at = |via: &str, action: &str, what: &str, started: bool| {
        seen.iter()
            .position(|(v, a, w, r)| {
                v == via && a == action && w.contains(what) && (r == "started") == started
            })
            .unwrap_or_else(|| panic!("no {via} {action} {what} in {seen:#?}"))
    };
    let pos = |via: &str, action: &str, what: &str| at(via, action, what, false);
    assert!(at("cli", "run", "echo hi", true) < pos("cli", "run", "echo hi"));
    let run = pos("cli", "run", "echo hi");
    let get = pos("mcp", "tool", "vm_get");
    let bash = pos("mcp", "bash", "uname -a");
    let patch = pos("api", "patch", "/vms/a2");
    assert!(run < get && get < bash && bash < patch, "{seen:#?}");
    // The command is kept as given, in one line of its own.
    assert_eq!(all[run]["what"], hostile);
    assert_eq!(all[run]["vm"], "a1");
    assert!(all[run]["result"].as_str().unwrap().starts_with("error: "));
    assert!(all[run]["who"].as_str().unwrap().starts_with("user:"));
    assert!(all[bash]["result"].as_str().unwrap().starts_with("error: "));
    assert!(all[get]["who"].as_str().unwrap().starts_with("mcp:"));
    assert_eq!(all[patch]["who"], "token:test");
    assert_eq!(all[patch]["result"], "HTTP 200");
    let raw = std::fs::read_to_string(home.path().join("audit/actions.log")).unwrap();
    assert_eq!(raw.lines().count(), all.len(), "one line per action");
    assert!(!raw.contains('\u{1b}'));

    // Filters.
    let a1 = audit(home, &["--vm", "a1"]);
    assert!(!a1.is_empty() && a1.iter().all(|a| a["vm"] == "a1"));
    let by_token = audit(home, &["--holder", "test"]);
    assert!(!by_token.is_empty() && by_token.iter().all(|a| a["who"] == "token:test"));
    std::thread::sleep(Duration::from_millis(2100));
    let _ = home.run(&["run", "a2", "--", "true"]);
    let recent = audit(home, &["--since", "2s"]);
    assert_eq!(recent.len(), 2, "its start and its end: {recent:#?}");
    assert_eq!(
        (recent[1]["vm"].as_str(), recent[1]["what"].as_str()),
        (Some("a2"), Some("true"))
    );

    // A huge command is cut to a bounded line that still says what it was.
    let huge = format!("echo {}", "z".repeat(100_000));
    let _ = home.run(&["run", "a2", "--", &huge]);
    let last = audit(home, &["--vm", "a2"]).pop().unwrap();
    let what = last["what"].as_str().unwrap().to_string();
    assert!(
        what.len() < 5000 && what.contains("100005 bytes in all, sha256 "),
        "{}",
        &what[what.len().saturating_sub(80)..]
    );
    // The table shows the escape, not the terminal's reaction to it.
    let table = home.ok(&["audit", "--vm", "a1"]);
    assert!(
        table.contains("ACTION") && !table.contains('\u{1b}'),
        "{table}"
    );
}

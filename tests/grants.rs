//! Grants end to end on the fake backend: approval needs a person at a terminal (no terminal:
//! exit 2; a pseudo-terminal typing `yes` applies, anything else does not), only the owner's
//! config turns confirmation off, `apply` cannot approve, the request form writes and asks,
//! revoking takes the grant out of the state file, and no value reaches the store, the events
//! or `describe`.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use boxery_api::Grant;
use boxery_api::grant::GrantPhase;
use common::Home;

const CANARY: &str = "canary-value-7f3a-never-stored";

/// Run `boxery ARGS` on a pseudo-terminal, typing `answer` at the prompt.
fn on_a_terminal(home: &Home, answer: &str, args: &[&str]) -> Output {
    common::on_a_terminal(home, answer, args, &[("GRANT_TEST_KEY", CANARY)])
}

/// Run `boxery ARGS` with no controlling terminal (a new session), `yes` on stdin.
fn without_a_terminal(home: &Home, args: &[&str]) -> Output {
    let mut c = Command::new("setsid");
    c.arg("-w")
        .arg(common::bin())
        .args(args)
        .env("BOXERY_HOME", home.path())
        .env("BOXERY_BACKEND", "fake")
        .env("GRANT_TEST_KEY", CANARY)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("setsid");
    use std::io::Write;
    let _ = child.stdin.take().unwrap().write_all(b"yes\nyes\n");
    child.wait_with_output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn grant(home: &Home, name: &str) -> Grant {
    home.store().get_as(name).unwrap().expect("the grant")
}

fn grant_yaml(name: &str, status: &str) -> String {
    format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Grant\nmetadata: {{name: {name}}}\nspec:\n  vm: dev1\n  type: llm\n  target: anthropic\n  valueFrom: {{env: GRANT_TEST_KEY}}\n{status}"
    )
}

fn vm_home() -> Home {
    let home = Home::new();
    home.ok(&["new", "dev1", "--from", "tiny", "--wait"]);
    home
}

/// Nothing of the value in the store's files, the grant state, or what the CLI shows.
fn assert_no_value(home: &Home) {
    for f in ["store.db", "store.db-wal", "grants/dev1.json"] {
        // Read by another process: closing a descriptor of store.db here would drop the
        // SQLite locks this process's store connections hold on it (docs/store.md).
        let bytes = Command::new("cat")
            .arg(home.path().join(f))
            .output()
            .map(|o| o.stdout)
            .unwrap_or_default();
        assert!(
            !bytes.windows(CANARY.len()).any(|w| w == CANARY.as_bytes()),
            "the value is in {f}"
        );
    }
    for args in [
        &["describe", "grant", "g1"][..],
        &["get", "grant", "-o", "yaml"],
        &["get", "grants", "-o", "wide"],
        &["events"],
        &["grant", "ls"],
    ] {
        let o = home.run(args);
        assert!(
            !text(&o).contains(CANARY),
            "boxery {args:?} shows the value"
        );
    }
}

#[test]
fn approval_needs_a_terminal_and_a_typed_yes() {
    let home = vm_home();
    let f = home.write("g1.yaml", &grant_yaml("g1", ""));
    home.ok(&["apply", "-f", f.to_str().unwrap()]);

    // No terminal: exit 2, saying how to approve; `yes` on stdin is not read.
    let o = without_a_terminal(&home, &["grant", "approve", "g1"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("`boxery grant approve g1`") && text(&o).contains("terminal"),
        "{}",
        text(&o)
    );
    assert!(grant(&home, "g1").status.approved_by.is_none());
    let o = without_a_terminal(&home, &["grant", "deny", "g1"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));

    // A terminal, and anything but `yes`: nothing changes (exit 1).
    for answer in ["no", "y", "YES please", ""] {
        let o = on_a_terminal(&home, answer, &["grant", "approve", "g1"]);
        assert_eq!(o.status.code(), Some(1), "{answer:?}: {}", text(&o));
        assert!(
            grant(&home, "g1").status.approved_by.is_none(),
            "{answer:?}"
        );
    }

    // `yes`: approved by this OS user for generation 1, and (with --wait) in force.
    let o = on_a_terminal(&home, "yes", &["-vv", "grant", "approve", "g1", "--wait"]);
    let shown = text(&o);
    assert_eq!(o.status.code(), Some(0), "{shown}");
    for what in ["dev1", "llm", "anthropic", "GRANT_TEST_KEY", "never shown"] {
        assert!(
            shown.contains(what),
            "the prompt does not show {what}: {shown}"
        );
    }
    assert!(!shown.contains(CANARY), "the value was shown: {shown}");
    let g = grant(&home, "g1");
    assert_eq!(g.status.phase, GrantPhase::Applied);
    assert_eq!(g.status.approved_generation, Some(1));
    assert!(
        g.status
            .approved_by
            .as_deref()
            .is_some_and(|u| !u.is_empty())
    );
    let state = std::fs::read_to_string(home.path().join("grants/dev1.json")).unwrap();
    assert!(
        state.contains("\"g1\"") && state.contains("GRANT_TEST_KEY"),
        "{state}"
    );
    assert_no_value(&home);

    // A changed spec needs approval again.
    let changed = grant_yaml("g1", "").replace("anthropic", "openai");
    let f = home.write("g1.yaml", &changed);
    home.ok(&["apply", "-f", f.to_str().unwrap(), "--wait"]);
    let g = grant(&home, "g1");
    assert_eq!(g.status.phase, GrantPhase::PendingApproval);
    assert_eq!(g.metadata.generation, Some(2));
    assert!(
        !std::fs::read_to_string(home.path().join("grants/dev1.json"))
            .unwrap_or_default()
            .contains("\"g1\""),
        "a re-pended grant left the state"
    );
    let o = on_a_terminal(&home, "yes", &["grant", "deny", "g1"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(grant(&home, "g1").status.denied_generation, Some(2));
}

#[test]
fn apply_cannot_approve() {
    let home = vm_home();
    let forged = grant_yaml(
        "g1",
        "status: {phase: Applied, approvedBy: root, approvedGeneration: 1, approvedAt: '2026-01-01T00:00:00Z'}\n",
    );
    let f = home.write("forged.yaml", &forged);
    // Created with a forged approval, then applied again over it: never approved; and the
    // wait returns once the controller saw it (it does not wait for a person).
    for _ in 0..2 {
        let o = home
            .cmd()
            .args([
                "apply",
                "-f",
                f.to_str().unwrap(),
                "--wait",
                "--timeout",
                "60s",
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        let g = grant(&home, "g1");
        assert!(g.status.approved_by.is_none() && g.status.approved_generation.is_none());
        assert_eq!(g.status.phase, GrantPhase::PendingApproval);
        assert_eq!(
            g.status.observed_generation,
            Some(1),
            "the controller saw it"
        );
        assert!(
            g.status
                .conditions
                .iter()
                .any(|c| c.reason == "PendingApproval")
        );
    }
    assert!(!home.path().join("grants/dev1.json").exists());
    // No flag and no variable turns confirmation off.
    let o = home
        .cmd()
        .args(["grant", "approve", "g1", "--yes"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let mut c = Command::new("setsid");
    c.arg("-w")
        .arg(common::bin())
        .args(["grant", "approve", "g1"])
        .env("BOXERY_HOME", home.path())
        .env("BOXERY_BACKEND", "fake")
        .env("BOXERY_GRANTS_CONFIRM", "false")
        .env("GRANTS_CONFIRM", "off")
        .stdin(Stdio::null());
    let o = c.output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(grant(&home, "g1").status.approved_by.is_none());
}

#[test]
fn the_owner_may_turn_confirmation_off_in_config() {
    let home = vm_home();
    home.write("config.yaml", "grants: {confirm: false}\n");
    let o = without_a_terminal(
        &home,
        &[
            "grant",
            "dev1",
            "llm:anthropic",
            "--from-env",
            "GRANT_TEST_KEY",
            "--wait",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("confirmation is off"), "{}", text(&o));
    let g = grant(&home, "dev1-llm-anthropic");
    assert_eq!(g.status.phase, GrantPhase::Applied);
    let events = home.ok(&["events", "grant", "dev1-llm-anthropic"]);
    assert!(events.contains("confirmation off"), "{events}");
}

#[test]
fn the_request_form_writes_asks_and_revoke_takes_it_back() {
    let home = vm_home();
    // The control plane reads the value from its own environment.
    let serve = home.serve_env(&[], &[("GRANT_TEST_KEY", CANARY)]);
    serve.wait_leading();
    // Refused before anything is written: a VM that does not exist, a bad type, no source.
    for bad in [
        &["grant", "nope", "llm:anthropic", "--from-env", "K"][..],
        &["grant", "dev1", "ssh:anything", "--from-env", "K"],
        &["grant", "dev1", "llm:anthropic"],
        &["grant", "dev1", "http:api.example.com", "--from-env", "K"],
    ] {
        let o = home.run(bad);
        assert!(!o.status.success(), "{bad:?}");
    }
    assert!(home.ok(&["get", "grants", "-o", "name"]).trim().is_empty());

    let o = on_a_terminal(
        &home,
        "yes",
        &[
            "grant",
            "dev1",
            "github:me/repo",
            "--from-env",
            "GRANT_TEST_KEY",
            "--wait",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let name = "dev1-github-me-repo-";
    let ls = home.ok(&["grant", "ls"]);
    let line = ls
        .lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("{ls}"));
    for col in ["Applied", "dev1", "github", "me/repo"] {
        assert!(line.contains(col), "{ls}");
    }
    let full = line.split_whitespace().next().unwrap().to_string();
    assert!(
        std::fs::read_to_string(home.path().join("grants/dev1.json"))
            .unwrap()
            .contains(&full)
    );
    home.ok(&["grant", "revoke", &full]);
    common::eventually(Duration::from_secs(20), || {
        (!home.path().join("grants/dev1.json").exists()
            && home.store().get("Grant", &full).unwrap().is_none())
        .then_some(())
    })
    .expect("the revoked grant leaves the state, then the store");
    assert_no_value(&home);
}

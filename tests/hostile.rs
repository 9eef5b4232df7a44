//! A hostile caller against the fake backend: one test per class of defect the hostile review
//! found (see docs/security.md, "What a hostile caller cannot do"), each with its variants.
//! - names that would become paths or options: on every verb and MCP tool that takes a name;
//! - an emptied, truncated, corrupted, replaced or rolled-back store: nothing is deleted;
//! - finalizers nobody removes, and `--force` that reports what did not happen;
//! - pools and leases that would hand one VM to two holders or take a person's VM.

mod common;

use std::time::Duration;

use common::Home;
use common::mcp_stdio::Mcp;
use serde_json::{Value, json};

/// Names that must never reach the filesystem, a command line or the store.
const HOSTILE: &[&str] = &[
    "..",
    ".",
    "../..",
    "/",
    "/tmp",
    "a/b",
    "../x",
    "-rf",
    "--help-me",
    "Bad_Name",
    "a..b",
    "\u{1b}[2J\u{1b}]52;c;aGk=\u{7}",
    "a\nb",
    "nul\0x",
    "éééééééééééééééééééééééééééééééééééééééééééééééééééé",
];

/// A directory outside the home, and a file in the home, that must survive every attack.
struct Sentinels {
    outside: tempfile::TempDir,
}

impl Sentinels {
    fn new(home: &Home) -> Sentinels {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), "keep").unwrap();
        std::fs::create_dir_all(home.path().join("leases")).unwrap();
        std::fs::write(home.path().join("keep"), "keep").unwrap();
        Sentinels { outside }
    }
    fn check(&self, home: &Home, what: &str) {
        assert!(
            self.outside.path().join("keep").exists(),
            "{what}: a directory outside the home was touched"
        );
        assert!(
            home.path().join("keep").exists() && home.path().join("store.db").exists(),
            "{what}: the home was touched"
        );
    }
}

fn code(o: &std::process::Output) -> Option<i32> {
    o.status.code()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Every CLI verb that takes a name refuses a hostile one with exit 2, before any side effect,
/// and never prints a control character back.
#[test]
fn hostile_names_on_every_verb_touch_nothing() {
    let home = Home::new();
    home.ok(&["new", "v1"]);
    let s = Sentinels::new(&home);
    let outside = s.outside.path().display().to_string();
    let mut names: Vec<String> = HOSTILE.iter().map(|n| n.to_string()).collect();
    names.push(outside.clone());
    names.push(format!("{}/../..", home.path().display()));
    for n in &names {
        let n = n.as_str();
        if n.contains('\0') {
            continue; // no process takes a NUL in an argument
        }
        let verbs: Vec<Vec<&str>> = vec![
            vec!["lease", "release", n],
            vec!["lease", "renew", n],
            vec!["lease", "acquire", n],
            vec!["lease", "acquire", "p", "--name", n],
            vec!["pool", "add", n, "v1"],
            vec!["pool", "add", "p", n],
            vec!["pool", "rm", "p", n],
            vec!["new", n],
            vec!["new", "ok1", "--from", n],
            vec!["new", "ok1", "--fork", n],
            vec!["snap", "v1", n],
            vec!["snap", "v1", "k0.before"],
            vec!["snap", n, "x"],
            vec!["revert", "v1", n],
            vec!["fork", "v1", "ok1", n],
            vec!["start", "ok1", n],
            vec!["stop", n],
            vec!["rm", "v1", n],
            vec!["resize", n, "--cpus", "2"],
            vec!["run", n, "--", "true"],
            vec!["ssh", n],
            vec!["delete", "vm", "v1", n],
            vec!["delete", "lease", n],
            vec!["orphans", "delete", "vm", n, "--yes"],
        ];
        for args in verbs {
            let o = home.run(&args);
            assert!(
                matches!(code(&o), Some(2) | Some(3)),
                "boxery {args:?}: exit {:?}\n{}",
                code(&o),
                stderr(&o)
            );
            assert!(
                !stderr(&o).contains('\u{1b}'),
                "boxery {args:?} printed a raw escape: {:?}",
                stderr(&o)
            );
            s.check(&home, &format!("{args:?}"));
        }
    }
    // Validated all first: nothing was made, deleted or stopped along the way.
    assert!(
        home.run(&["get", "vm", "ok1"]).status.code() == Some(3),
        "a verb with one bad name made the good ones"
    );
    let v1 = home.ok(&["get", "vm", "v1", "-o", "json"]);
    assert!(
        !v1.contains("deletionTimestamp"),
        "a delete with one bad name deleted v1"
    );
}

/// The same names through the MCP tools an agent reaches.
#[test]
fn hostile_names_through_mcp_touch_nothing() {
    let home = Home::new();
    home.ok(&["new", "v1"]);
    let s = Sentinels::new(&home);
    let outside = s.outside.path().display().to_string();
    home.ok(&["new", "ok2"]);
    let mut mcp = Mcp::start(&home);
    let mut names: Vec<String> = HOSTILE.iter().map(|n| n.to_string()).collect();
    names.push(outside);
    // empty and blank: never "not given" (the default or only VM)
    names.push(String::new());
    names.push("  ".into());
    for n in &names {
        let n = n.as_str();
        let calls = [
            ("vm_lease", json!({"action": "release", "lease": n})),
            ("vm_lease", json!({"action": "renew", "lease": n})),
            ("vm_lease", json!({"action": "acquire", "pool": n})),
            ("vm_manage", json!({"action": "rm", "vm": n})),
            (
                "vm_manage",
                json!({"action": "snap", "vm": "v1", "label": n}),
            ),
            (
                "vm_manage",
                json!({"action": "fork", "vm": "v1", "names": ["ok1", n]}),
            ),
            ("vm_bash", json!({"vm": n, "command": "true"})),
            ("vm_get", json!({"kind": "vm", "name": n})),
            ("vm_describe", json!({"kind": "vm", "name": n})),
            ("vm_delete", json!({"kind": "vm", "names": ["ok2", n]})),
            ("vm_delete", json!({"kind": "lease", "names": [n]})),
            (
                "vm_wait",
                json!({"kind": "vm", "name": n, "timeout_seconds": 1}),
            ),
            ("vm_use", json!({"vm": n})),
            ("vm_read", json!({"vm": n, "path": "/etc/hostname"})),
            (
                "vm_write",
                json!({"vm": n, "path": "/tmp/x", "content": "x"}),
            ),
            ("vm_jobs", json!({"action": "list", "vm": n})),
        ];
        for (tool, args) in calls {
            let (err, text) = mcp.call(tool, args.clone());
            assert!(err, "{tool} {args} succeeded: {text}");
            assert!(
                !text.contains('\u{1b}'),
                "{tool} echoed a raw escape: {text:?}"
            );
            s.check(&home, &format!("{tool} {args}"));
        }
    }
    assert_eq!(home.run(&["get", "vm", "ok1"]).status.code(), Some(3));
    assert!(
        home.ok(&[
            "get",
            "vm",
            "ok2",
            "-o",
            "jsonpath={.metadata.deletionTimestamp}"
        ])
        .trim()
        .is_empty(),
        "a delete with one bad name deleted the good one"
    );
}

/// Every tool refuses every argument given as an empty or blank string (or a list holding
/// one), the name arguments first: the repro was `vm_manage {"action":"rm","vm":""}`
/// deleting the only VM. Each tool's schema is walked (so a tool or argument added later is
/// covered), each action of a tool with actions, and the VM is untouched after it all.
#[test]
fn empty_names_through_mcp_touch_nothing() {
    let home = Home::new();
    home.ok(&["new", "only"]);
    // what a write would change (the controllers may fill in its status meanwhile)
    let written = || {
        let vm: boxery_api::Vm = home.store().get_as("only").unwrap().expect("the VM exists");
        (
            vm.metadata.uid.clone(),
            vm.metadata.generation,
            vm.metadata.deletion_timestamp.is_some(),
            serde_json::to_value(&vm.spec).unwrap(),
        )
    };
    let before = written();
    let mut mcp = Mcp::start(&home);
    let (err, text) = mcp.call("vm_use", json!({"vm": "only"}));
    assert!(!err, "{text}");
    // Text whose emptiness means something (a file written empty, a replacement that
    // deletes, an argument of a command line); everything else must be refused blank.
    let may_be_empty = ["content", "new", "from_command"];
    let tools = mcp.request("tools/list", json!({}));
    let tools = tools["result"]["tools"].as_array().unwrap().clone();
    assert!(tools.len() >= 16, "{tools:?}");
    let mut refused = 0;
    for t in &tools {
        let tool = t["name"].as_str().unwrap();
        let props = t["inputSchema"]["properties"].as_object().unwrap();
        let actions: Vec<Value> = ["action"]
            .iter()
            .filter_map(|_| props.get("action"))
            .flat_map(|a| enum_values(a, &t["inputSchema"]))
            .collect();
        let actions = if actions.is_empty() {
            vec![Value::Null]
        } else {
            actions
        };
        for (prop, schema) in props {
            if may_be_empty.contains(&prop.as_str()) {
                continue;
            }
            let texty = |s: &Value| {
                let ty = &s["type"];
                ty == "string"
                    || ty.as_array().is_some_and(|a| a.contains(&json!("string")))
                    || s["items"]["type"] == "string"
                    || s.get("$ref").is_some()
                    || s.get("anyOf").is_some()
                    || s.get("oneOf").is_some()
            };
            if !texty(schema) {
                continue;
            }
            let list = schema["type"] == "array"
                || schema["type"]
                    .as_array()
                    .is_some_and(|a| a.contains(&json!("array")));
            for blank in ["", "  "] {
                let value = if list { json!([blank]) } else { json!(blank) };
                for action in &actions {
                    let mut args = json!({prop.as_str(): value});
                    if !action.is_null() && prop != "action" {
                        args["action"] = action.clone();
                    }
                    let (err, text) = mcp.call(tool, args.clone());
                    assert!(err, "{tool} {args} succeeded: {text}");
                    assert!(
                        text.contains(&format!("`{prop}`")) && text.contains("empty or blank"),
                        "{tool} {args}: not refused as blank: {text}"
                    );
                    refused += 1;
                }
            }
        }
    }
    assert!(refused > 100, "only {refused} calls were tried");
    // The repro, and its kin that destroy or take: none touched the only VM.
    for args in [
        json!({"action": "rm", "vm": ""}),
        json!({"action": "rm", "vm": "  "}),
        json!({"action": "stop", "vm": ""}),
        json!({"action": "revert", "vm": "", "label": "x"}),
    ] {
        let (err, text) = mcp.call("vm_manage", args.clone());
        assert!(err, "vm_manage {args} succeeded: {text}");
    }
    let (err, text) = mcp.call("vm_delete", json!({"kind": "vm", "names": [""]}));
    assert!(err, "{text}");
    assert_eq!(written(), before, "an empty name touched the only VM");
}

/// The values of an enum property (inline, or behind a `$ref` into `$defs`).
fn enum_values(prop: &Value, schema: &Value) -> Vec<Value> {
    let resolved = match prop["$ref"].as_str() {
        Some(r) => {
            let name = r.rsplit('/').next().unwrap();
            schema["$defs"][name].clone()
        }
        None => prop.clone(),
    };
    if let Some(e) = resolved["enum"].as_array() {
        return e.clone();
    }
    resolved["oneOf"]
        .as_array()
        .map(|alts| {
            alts.iter()
                .filter_map(|a| a.get("const").or_else(|| a["enum"].get(0)).cloned())
                .collect()
        })
        .unwrap_or_default()
}

/// A lease is released only by its holder session, and releasing one that does not exist
/// touches nothing.
#[test]
fn a_session_cannot_release_another_ones_lease() {
    let home = Home::new();
    std::fs::create_dir_all(home.path().join("leases/someone-else")).unwrap();
    std::fs::write(home.path().join("leases/someone-else/id_ed25519"), "k").unwrap();
    let mut mcp = Mcp::start(&home);
    let (err, text) = mcp.call(
        "vm_lease",
        json!({"action": "release", "lease": "someone-else"}),
    );
    assert!(err, "{text}");
    assert!(text.contains("not held by this session"), "{text}");
    let (err, _) = mcp.call(
        "vm_lease",
        json!({"action": "renew", "lease": "someone-else"}),
    );
    assert!(err);
    assert!(home.path().join("leases/someone-else/id_ed25519").exists());
    // The CLI: a lease that does not exist is not found, and its directory is left alone.
    let o = home.run(&["lease", "release", "someone-else"]);
    assert_eq!(code(&o), Some(3), "{}", stderr(&o));
    assert!(home.path().join("leases/someone-else/id_ed25519").exists());
}

/// Start `serve` and wait until its inventory pass has judged each of `names`: an `Orphaned`
/// event names each one it leaves alone (one it removed would have none).
fn serve_until_judged(home: &Home, names: &[&str]) -> common::Serve {
    let serve = home.serve(&[]);
    serve.wait_leading();
    let mut last = String::new();
    common::eventually(Duration::from_secs(30), || {
        last = home.ok(&["events"]);
        names
            .iter()
            .all(|n| {
                last.lines().any(|l| {
                    l.contains("Orphaned")
                        && l.split_whitespace().any(|w| w.ends_with(&format!("/{n}")))
                })
            })
            .then_some(())
    })
    .unwrap_or_else(|| panic!("the inventory never reported {names:?}:\n{last}"));
    serve
}

fn store_files(home: &Home) -> Vec<std::path::PathBuf> {
    ["store.db", "store.db-wal", "store.db-shm"]
        .iter()
        .map(|f| home.path().join(f))
        .collect()
}

/// Truncated, corrupted, replaced: every command refuses the file; a new store (the file moved
/// away) deletes nothing and lists everything under `boxery orphans`.
#[test]
fn an_emptied_or_replaced_store_deletes_nothing() {
    let home = Home::new();
    let fake = home.fake();
    let mut serve = home.serve(&[]);
    home.ok(&["new", "v1", "--wait", "--timeout", "30s"]);
    home.ok(&["new", "v2", "--wait", "--timeout", "30s"]);
    home.ok(&["snap", "v1", "s1", "--wait", "--timeout", "30s"]);
    serve.kill();
    let backend_before = (fake.vm_record("v1").unwrap(), fake.vm_record("v2").unwrap());
    assert!(backend_before.0.is_some() && backend_before.1.is_some());

    // Truncated: an error for reads and writes alike, and nothing is written.
    std::fs::write(home.path().join("store.db"), b"").unwrap();
    for args in [
        vec!["get", "vms"],
        vec!["describe", "vm", "v1"],
        vec!["new", "v3"],
        vec!["orphans"],
        vec!["lease", "ls"],
    ] {
        let o = home.run(&args);
        assert_eq!(code(&o), Some(1), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("is not a boxery store"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
    let o = home
        .cmd()
        .args(["serve", "--inventory-every", "1s"])
        .output()
        .unwrap();
    assert_eq!(code(&o), Some(1), "serve refuses it too: {}", stderr(&o));
    // Corrupted.
    std::fs::write(home.path().join("store.db"), vec![0x42; 4096]).unwrap();
    assert_eq!(code(&home.run(&["get", "vms"])), Some(1));
    assert!(fake.vm_record("v1").unwrap().is_some());

    // Moved away: a new, empty store. Its inventory quarantines everything.
    std::fs::rename(
        home.path().join("store.db"),
        home.path().join("store.db.broken"),
    )
    .unwrap();
    let _serve = serve_until_judged(&home, &["v1", "v2", "v1.s1", "debian-12"]);
    for vm in ["v1", "v2"] {
        assert!(fake.vm_record(vm).unwrap().is_some(), "{vm} was deleted");
    }
    assert!(
        fake.image_record("v1.s1").unwrap().is_some(),
        "the snapshot was deleted"
    );
    assert!(
        fake.image_record("debian-12").unwrap().is_some(),
        "the stock image was deleted"
    );
    let table = home.ok(&["orphans"]);
    for name in ["v1", "v2", "v1.s1", "debian-12"] {
        assert!(
            table
                .lines()
                .any(|l| l.split_whitespace().nth(1) == Some(name) && l.contains("Quarantined")),
            "{name} not quarantined:\n{table}"
        );
    }
    assert!(table.contains("another store"), "{table}");
}

/// A store restored from an older backup deletes nothing made after the backup: those things
/// are quarantined and can be adopted back.
#[test]
fn a_store_rolled_back_to_a_backup_deletes_nothing() {
    let home = Home::new();
    let fake = home.fake();
    let mut serve = home.serve(&[]);
    home.ok(&["new", "v1", "--wait", "--timeout", "30s"]);
    serve.kill();
    // A consistent backup (SQLite's own backup API, as `sqlite3 store.db .backup` does).
    let backup = home.path().join("backup.db");
    {
        let src = rusqlite::Connection::open(home.path().join("store.db")).unwrap();
        src.execute("VACUUM INTO ?1", [backup.display().to_string()])
            .unwrap();
    }
    let mut serve = home.serve(&[]);
    home.ok(&["new", "v2", "--wait", "--timeout", "30s"]);
    home.ok(&["snap", "v1", "after", "--wait", "--timeout", "30s"]);
    serve.kill();
    for f in store_files(&home) {
        let _ = std::fs::remove_file(f);
    }
    std::fs::copy(&backup, home.path().join("store.db")).unwrap();

    let _serve = serve_until_judged(&home, &["v2", "v1.after"]);
    assert!(fake.vm_record("v2").unwrap().is_some(), "v2 was deleted");
    assert!(
        fake.image_record("v1.after").unwrap().is_some(),
        "the snapshot was deleted"
    );
    let table = home.ok(&["orphans"]);
    assert!(table.contains("restored from an older backup"), "{table}");
    home.ok(&["orphans", "adopt", "vm", "v2"]);
    home.ok(&["orphans", "adopt", "image", "v1.after"]);
    home.ok(&["wait", "vm", "v2", "--for=condition=Ready", "--timeout=30s"]);
    let table = home.run(&["orphans"]);
    assert!(
        !String::from_utf8_lossy(&table.stdout).contains("v1.after"),
        "adopted things are no longer orphans"
    );
}

/// A finalizer nothing removes cannot be applied, and `--force` removes what is there and says
/// so; a forced delete never reports what did not happen.
#[test]
fn finalizers_cannot_pin_an_object_and_force_tells_the_truth() {
    let home = Home::new();
    let f = home.write(
        "evil.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata:\n  name: e1\n  finalizers: [evil.example/never]\nspec:\n  source: {image: debian-12}\n",
    );
    let o = home.run(&["apply", "-f", f.to_str().unwrap()]);
    assert_eq!(code(&o), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("evil.example/never"), "{}", stderr(&o));
    // One written behind boxery's back (an older store, a direct write): --force removes it.
    home.ok(&["new", "e2"]);
    let store = home.store();
    let mut obj = store.get("Vm", "e2").unwrap().unwrap();
    obj.metadata.finalizers.push("evil.example/never".into());
    store.update(obj).unwrap();
    let o = home.run(&["delete", "vm", "e2", "--force", "--wait"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("evil.example/never"),
        "names what it dropped: {}",
        stderr(&o)
    );
    assert!(
        store.get("Vm", "e2").unwrap().is_none(),
        "forced means gone"
    );
    // Events are the controllers' to write; an empty prune selector prunes nothing.
    let ev = home.write(
        "ev.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Event\nmetadata: {name: x}\ninvolvedObject: {kind: Vm, name: v1}\ntype: Normal\nreason: Forged\nmessage: hi\ncount: 1\nfirstTimestamp: '2026-01-01T00:00:00Z'\nlastTimestamp: '2026-01-01T00:00:00Z'\nreportingController: me\n",
    );
    assert_eq!(
        code(&home.run(&["apply", "-f", ev.to_str().unwrap()])),
        Some(2)
    );
    // So are PoolMember records (a claim's fence): an agent writing or deleting one could
    // hand a leased VM to a second holder. Refused, whoever asks, saying what to do instead.
    let pm = home.write(
        "pm.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: PoolMember\nmetadata: {name: v9}\nspec: {pool: agents}\n",
    );
    let o = home.run(&["apply", "-f", pm.to_str().unwrap()]);
    assert_eq!(code(&o), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("boxery pool rm"), "{}", stderr(&o));
    assert!(store.get("PoolMember", "v9").unwrap().is_none());
    let o = home.run(&["delete", "poolmember", "v9"]);
    assert_eq!(code(&o), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("controllers only"), "{}", stderr(&o));
    let v = home.write("v.yaml", &common::vm_yaml("p1"));
    home.ok(&["apply", "-f", v.to_str().unwrap()]);
    let o = home.run(&["apply", "-f", f.to_str().unwrap(), "--prune", "-l", ""]);
    assert_eq!(code(&o), Some(2), "{}", stderr(&o));
    assert!(store.get("Vm", "p1").unwrap().is_some());
    // Applying an object being deleted is a conflict (exit 5), as documented.
    home.ok(&["new", "d1"]);
    let mut obj = store.get("Vm", "d1").unwrap().unwrap();
    obj.metadata.finalizers.push("boxery.dev/vm".into());
    store.update(obj).unwrap();
    home.ok(&["delete", "vm", "d1"]);
    let d = home.write("d.yaml", &common::vm_yaml("d1"));
    assert_eq!(
        code(&home.run(&["apply", "-f", d.to_str().unwrap()])),
        Some(5)
    );
}

fn pool_status(home: &Home, pool: &str) -> boxery_api::Pool {
    home.store()
        .get_as::<boxery_api::Pool>(pool)
        .unwrap()
        .unwrap_or_else(|| panic!("pool {pool} missing"))
}

/// A VM is in one pool at a time, and a template member never takes over a person's VM that
/// happens to have its name.
#[test]
fn pools_never_share_a_vm_or_take_a_persons_vm() {
    let home = Home::new();
    let _serve = home.serve(&[]);
    home.ok(&["new", "v1", "--wait", "--timeout", "30s"]);
    home.ok(&["pool", "add", "pa", "v1"]);
    common::eventually(Duration::from_secs(30), || {
        (pool_status(&home, "pa").status.free == 1).then_some(())
    })
    .expect("pa's member is free");
    // The CLI refuses a second pool.
    let o = home.run(&["pool", "add", "pb", "v1"]);
    assert_eq!(code(&o), Some(5), "{}", stderr(&o));
    assert!(stderr(&o).contains("belongs to pool pa"), "{}", stderr(&o));
    // A manifest naming it in another pool: the member waits, never free, never leased.
    let pb = home.write(
        "pb.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: pb}\nspec:\n  members: [{name: v1}]\n",
    );
    home.ok(&["apply", "-f", pb.to_str().unwrap()]);
    common::eventually(Duration::from_secs(30), || {
        let p = pool_status(&home, "pb");
        p.status
            .conditions
            .iter()
            .any(|c| c.type_ == "MembersBlocked" && c.status == boxery_api::ConditionStatus::True)
            .then_some(())
    })
    .expect("pb says its member is blocked");
    home.ok(&[
        "lease",
        "acquire",
        "pa",
        "--holder",
        "alice",
        "--wait",
        "--timeout",
        "30s",
    ]);
    home.ok(&[
        "lease", "acquire", "pb", "--holder", "bob", "--name", "bob1",
    ]);
    // The lease controller has looked for a member of pb and found none free.
    common::eventually(Duration::from_secs(30), || {
        let d = home.ok(&["describe", "lease", "bob1"]);
        d.contains("NoFreeMember").then_some(())
    })
    .expect("bob's lease is told there is no free member");
    let bob = home.ok(&["get", "lease", "bob1", "-o", "jsonpath={.status.phase}"]);
    assert_ne!(bob.trim(), "Bound", "one VM leased to two holders");
    assert_eq!(pool_status(&home, "pb").status.free, 0);

    // A person's VM named like a template member is never adopted, captured or leased.
    home.ok(&["new", "pc-0", "--wait", "--timeout", "30s"]);
    let pc = home.write(
        "pc.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: pc}\nspec:\n  replicas: 1\n  template:\n    spec:\n      source: {image: debian-12}\n",
    );
    home.ok(&["apply", "-f", pc.to_str().unwrap()]);
    let msg = common::eventually(Duration::from_secs(30), || {
        // Each member's record (a PoolMember named after its VM) carries its message.
        home.store()
            .get_as::<boxery_api::pool::PoolMember>("pc-0")
            .unwrap()
            .filter(|m| m.spec.pool == "pc" && m.status.message.contains("did not make"))
            .map(|m| m.status.message)
    })
    .expect("pc's member waits with a reason");
    assert!(msg.contains("never taken over"), "{msg}");
    // The member's message is written by the same reconcile that would have adopted it.
    let vm = home
        .store()
        .get_as::<boxery_api::Vm>("pc-0")
        .unwrap()
        .unwrap();
    assert!(
        !vm.metadata.labels.contains_key("boxery.dev/pool"),
        "adopted: {vm:?}"
    );
    assert!(
        home.store()
            .get_as::<boxery_api::Image>("pc-0.boxery-clean")
            .unwrap()
            .is_none(),
        "the person's VM was captured as a clean image"
    );
    assert_eq!(pool_status(&home, "pc").status.free, 0);
}

/// An Image's `source.file` reads only from the owner's import roots, whichever surface wrote
/// it, and its errors do not tell whether a file outside exists.
#[test]
fn image_imports_read_only_the_owners_import_roots() {
    let home = Home::new();
    let fake = home.fake();
    let _serve = home.serve(&[]);
    let image = |name: &str, file: &str| {
        let f = home.write(
            &format!("{name}.yaml"),
            &format!(
                "apiVersion: boxery.dev/v1alpha1\nkind: Image\nmetadata: {{name: {name}}}\nspec:\n  source: {{file: '{file}'}}\n"
            ),
        );
        home.ok(&["apply", "-f", f.to_str().unwrap()]);
    };
    let failure = |name: &str| {
        common::eventually(Duration::from_secs(30), || {
            let y = home.ok(&["get", "image", name, "-o", "yaml"]);
            y.contains("import root").then_some(y)
        })
        .unwrap_or_else(|| panic!("image {name} never failed"))
    };
    image("shadow", "/etc/shadow");
    image("nothing", "/etc/no-such-file-here");
    let a = failure("shadow");
    let b = failure("nothing");
    assert!(a.contains("not inside an import root"), "{a}");
    assert!(b.contains("not inside an import root"), "{b}");
    assert!(fake.image_record("shadow").unwrap().is_none());
    // A symlink under the root that leads out is refused the same way.
    let imports = home.path().join("imports");
    std::fs::create_dir_all(&imports).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", imports.join("link.qcow2")).unwrap();
    image("link", imports.join("link.qcow2").to_str().unwrap());
    assert!(failure("link").contains("not inside an import root"));
    // Inside the root, it imports.
    std::fs::write(imports.join("ok.qcow2"), "disk").unwrap();
    image("ok", imports.join("ok.qcow2").to_str().unwrap());
    home.ok(&[
        "wait",
        "image",
        "ok",
        "--for=condition=Ready",
        "--timeout=30s",
    ]);
    assert!(fake.image_record("ok").unwrap().is_some());
}

/// VMs that fork from each other in a cycle say so instead of waiting in silence.
#[test]
fn fork_cycles_say_so() {
    let home = Home::new();
    let _serve = home.serve(&[]);
    let f = home.write(
        "cycle.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: ca}\nspec:\n  source: {vm: cb}\n---\napiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: cb}\nspec:\n  source: {vm: ca}\n",
    );
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    let d = common::eventually(Duration::from_secs(30), || {
        let d = home.ok(&["describe", "vm", "ca"]);
        d.contains("ForkCycle").then_some(d)
    })
    .expect("the cycle is reported");
    assert!(d.contains("ca → cb → ca"), "{d}");
}

/// A JSON patch of a few KB whose `copy` operations double the object each time (the
/// reported 3 KB patch that made `boxery mcp` abort with "memory allocation failed").
fn doubling_patch() -> String {
    let ops: Vec<Value> = std::iter::once(
        json!({"op": "add", "path": "/metadata/labels", "value": {}}),
    )
    .chain((0..48).map(
        |i| json!({"op": "copy", "from": "/metadata", "path": format!("/metadata/labels/x{i}")}),
    ))
    .collect();
    Value::Array(ops).to_string()
}

/// Small input, unbounded work: the doubling patch through MCP `vm_patch` is refused while it
/// is applied, at the object limit, and the same `boxery mcp` answers the next call; the VM
/// is unchanged.
#[test]
fn a_self_copying_patch_through_mcp_is_refused_and_mcp_lives() {
    let home = Home::new();
    home.ok(&["new", "v1"]);
    let mut mcp = Mcp::start(&home);
    let patch = doubling_patch();
    assert!(patch.len() < 4096, "{} bytes", patch.len());
    let (err, text) = mcp.call(
        "vm_patch",
        json!({"name": "v1", "type": "json", "patch": patch}),
    );
    assert!(err, "the patch applied: {text}");
    assert!(text.contains("at most 1024 KiB"), "{text}");
    let (err, text) = mcp.call("vm_get", json!({"kind": "vm", "name": "v1"}));
    assert!(
        !err && text.contains("v1"),
        "mcp did not answer after: {text}"
    );
    let labels = home.ok(&["get", "vm", "v1", "-o", "jsonpath={.metadata.labels}"]);
    assert_eq!(labels.trim(), "", "the refused patch changed the VM");
}

/// boxery's own labels (`boxery.dev/pool`, `boxery.dev/applyset`) are the controllers' and
/// apply's, whoever patches: an agent's MCP `vm_patch` (merge or JSON patch) and a person's
/// `boxery patch`/`edit` path cannot remove or change them, as `boxery label` cannot; the
/// refusal names the field, and other labels still change.
#[test]
fn patches_keep_boxerys_own_labels() {
    let home = Home::new();
    home.ok(&["new", "v1"]);
    let store = home.store();
    let mut vm = store.get("Vm", "v1").unwrap().unwrap();
    vm.metadata
        .labels
        .insert("boxery.dev/pool".into(), "pa".into());
    store.update(vm).unwrap();
    let label = || home.ok(&["get", "vm", "v1", "-o", "jsonpath={.metadata.labels}"]);
    let before = label();
    let mut mcp = Mcp::start(&home);
    for (ty, patch) in [
        (
            "merge",
            r#"{"metadata":{"labels":{"boxery.dev/pool":null}}}"#,
        ),
        (
            "merge",
            r#"{"metadata":{"labels":{"boxery.dev/pool":"pb"}}}"#,
        ),
        (
            "merge",
            r#"{"metadata":{"labels":{"boxery.dev/applyset":"x"}}}"#,
        ),
        (
            "json",
            r#"[{"op":"remove","path":"/metadata/labels/boxery.dev~1pool"}]"#,
        ),
    ] {
        let (err, text) = mcp.call(
            "vm_patch",
            json!({"name": "v1", "type": ty, "patch": patch}),
        );
        assert!(err, "MCP {patch} applied: {text}");
        assert!(text.contains("metadata.labels"), "{patch}: {text}");
        let o = home.run(&["patch", "vm", "v1", "--type", ty, "-p", patch]);
        assert_eq!(code(&o), Some(2), "CLI {patch}: {}", stderr(&o));
        assert!(stderr(&o).contains("metadata.labels"), "{}", stderr(&o));
        assert_eq!(label(), before, "{patch} changed the labels");
    }
    let (err, text) = mcp.call(
        "vm_patch",
        json!({"name": "v1", "type": "merge", "patch": r#"{"metadata":{"labels":{"team":"web"}}}"#}),
    );
    assert!(!err, "{text}");
    assert!(label().contains("\"team\":\"web\"") && label().contains("boxery.dev/pool"));
    // a fork takes the labels, not boxery's own: it is no member of the source's pool
    let (err, text) = mcp.call(
        "vm_manage",
        json!({"action": "fork", "vm": "v1", "names": ["f1"]}),
    );
    assert!(!err, "{text}");
    let forked = home.ok(&["get", "vm", "f1", "-o", "jsonpath={.metadata.labels}"]);
    assert!(
        forked.contains("\"team\":\"web\"") && !forked.contains("boxery.dev/"),
        "{forked}"
    );
}

/// An agent (the MCP tools) may lower a pool's budgets, never raise or remove them, by a patch
/// or by applying the pool again: the budgets are a person's limit on agents, like egress.
#[test]
fn an_agent_cannot_raise_or_remove_a_budget() {
    let home = Home::new();
    let pool = |lease_hours: &str, month_tokens: &str| {
        format!(
            "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {{name: bp}}\nspec:\n  replicas: 0\n  lease: {{defaultTtlSeconds: 1800, maxTtlSeconds: 28800, budget: {{vcpuHours: {lease_hours}}}}}\n  budget: {{tokensPerMonth: {month_tokens}}}\n"
        )
    };
    let f = home.write("bp.yaml", &pool("1", "1000"));
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    let mut mcp = Mcp::start(&home);
    let patch = |mcp: &mut Mcp, p: &str| {
        mcp.call(
            "vm_patch",
            json!({"kind": "pool", "name": "bp", "patch": p}),
        )
    };
    let budgets = || {
        let p: boxery_api::Pool = home.store().get_as("bp").unwrap().unwrap();
        (
            p.spec.lease.budget.and_then(|b| b.vcpu_hours),
            p.spec.budget.and_then(|b| b.tokens_per_month),
        )
    };
    for p in [
        r#"{"spec": {"lease": {"budget": {"vcpuHours": 5}}}}"#,
        r#"{"spec": {"lease": {"budget": null}}}"#,
        r#"{"spec": {"budget": {"tokensPerMonth": 5000}}}"#,
        r#"{"spec": {"budget": null}}"#,
    ] {
        let (err, text) = patch(&mut mcp, p);
        assert!(
            err && text.contains("an agent cannot raise or remove"),
            "{p}: {text}"
        );
        assert_eq!(budgets(), (Some(1.0), Some(1000)), "{p}");
    }
    // (taking the field over from the person's apply: the limit still holds)
    let (err, text) = mcp.call(
        "vm_apply",
        json!({"manifest": pool("9", "1000"), "force_conflicts": true}),
    );
    assert!(err && text.contains("vcpuHours 1 → 9"), "{text}");
    assert_eq!(budgets(), (Some(1.0), Some(1000)));
    // lowering is allowed
    let (err, text) = patch(
        &mut mcp,
        r#"{"spec": {"lease": {"budget": {"vcpuHours": 0.5}}}}"#,
    );
    assert!(!err, "{text}");
    assert_eq!(budgets(), (Some(0.5), Some(1000)));
    // a person raises it
    home.ok(&[
        "patch",
        "pool",
        "bp",
        "--type=merge",
        "-p",
        r#"{"spec": {"budget": {"tokensPerMonth": 5000}}}"#,
    ]);
    assert_eq!(budgets(), (Some(0.5), Some(5000)));
    // nor delete the budgeted pool (to make it again without one)
    let (err, text) = mcp.call("vm_delete", json!({"kind": "pool", "names": ["bp"]}));
    assert!(
        err && text.contains("an agent cannot delete pool bp"),
        "{text}"
    );
    assert!(
        home.store()
            .get_as::<boxery_api::Pool>("bp")
            .unwrap()
            .is_some()
    );
    // nor loosen a pool template's egress by removing the template first
    let strict = home.write(
        "sp.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: sp}\nspec:\n  replicas: 0\n  template: {spec: {source: {image: tiny}, network: {egress: {policy: Deny}}}}\n",
    );
    home.ok(&["apply", "-f", strict.to_str().unwrap()]);
    let (err, text) = mcp.call(
        "vm_patch",
        json!({"kind": "pool", "name": "sp", "patch": r#"{"spec": {"template": null}}"#}),
    );
    assert!(err && text.contains("an agent cannot loosen"), "{text}");
    // nor take over boxery's own labels with an apply (a pool's membership holds a budget)
    let (err, text) = mcp.call(
        "vm_apply",
        json!({"manifest": "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: sp, labels: {boxery.dev/pool: other}}\nspec:\n  replicas: 0\n  template: {spec: {source: {image: tiny}, network: {egress: {policy: Deny}}}}\n",
               "force_conflicts": true}),
    );
    assert!(err && text.contains("keys under boxery.dev/"), "{text}");
    // nor the controllers' annotations (a wake-up, a start from memory)
    let (err, text) = mcp.call(
        "vm_apply",
        json!({"manifest": "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: sp, annotations: {boxery.dev/start-from-memory: x}}\nspec:\n  replicas: 0\n  template: {spec: {source: {image: tiny}, network: {egress: {policy: Deny}}}}\n",
               "force_conflicts": true}),
    );
    assert!(err && text.contains("metadata.annotations"), "{text}");
    // nor move a lease out of the budgeted pool (a person may)
    home.ok(&["lease", "acquire", "bp", "--name", "l1"]);
    let (err, text) = mcp.call(
        "vm_patch",
        json!({"kind": "lease", "name": "l1", "patch": r#"{"spec": {"pool": "sp"}}"#}),
    );
    assert!(err && text.contains("cannot move lease l1"), "{text}");
    let pool_of = || {
        let l: boxery_api::Lease = home.store().get_as("l1").unwrap().unwrap();
        l.spec.pool
    };
    assert_eq!(pool_of(), "bp");
}

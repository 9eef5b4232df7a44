//! What an agent writes into objects never reaches a person's terminal as escape sequences:
//! `get` (tables, `-o name`), `describe`, `events` and `lease ls` escape control characters;
//! `-o json`, `-o yaml` and a piped `-o jsonpath` stay exact (they are for programs).

mod common;

use common::Home;
use serde_json::json;

/// OSC 52 (write the clipboard), a screen clear, CSI in its C1 form, DEL, a bidi override,
/// and a newline that would fake a table row.
const HOSTILE: &str =
    "x\u{1b}]52;c;Y3VybCBldmlsfHNo\u{7}\u{1b}[2J\u{9b}31m\u{7f}\u{202e}y\nvm/fake   Running";

fn controls(bytes: &[u8]) -> Vec<char> {
    String::from_utf8_lossy(bytes)
        .chars()
        .filter(|c| (c.is_control() && *c != '\n') || *c == '\u{202e}')
        .collect()
}

fn hostile_home() -> Home {
    let home = Home::new();
    let store = home.store();
    let obj = |v: serde_json::Value| serde_json::from_value(v).unwrap();
    store
        .create(obj(json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Image",
            "metadata": {"name": "img1", "labels": {"a": "b"}, "annotations": {"note": HOSTILE},
                         "finalizers": [HOSTILE]},
            "spec": {"source": {"file": format!("/srv/{HOSTILE}")}},
        })))
        .unwrap();
    let mut img = store.get("Image", "img1").unwrap().unwrap();
    img.rest.insert(
        "status".into(),
        json!({"phase": "Failed", "printableStatus": HOSTILE, "conditions": [
            {"type": "Ready", "status": "False", "reason": HOSTILE, "message": HOSTILE,
             "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
    );
    store.update_status(img).unwrap();
    store
        .create(obj(json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Event",
            "metadata": {"name": "img1.e1"},
            "involvedObject": {"kind": "Image", "name": "img1"},
            "type": "Warning", "reason": HOSTILE, "message": HOSTILE, "count": 1,
            "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:00:00Z",
            "reportingController": "x",
        })))
        .unwrap();
    store
        .create(obj(json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Lease",
            "metadata": {"name": "l1"},
            "spec": {"pool": "p1", "holderIdentity": "me@host",
                     "publicKey": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIC3dGVzdHRlc3R0ZXN0dGVzdHRlc3R0ZXN0dGVzdA me"},
        })))
        .unwrap();
    let mut lease = store.get("Lease", "l1").unwrap().unwrap();
    lease
        .rest
        .insert("status".into(), json!({"phase": "Bound", "vm": HOSTILE}));
    store.update_status(lease).unwrap();
    home
}

#[test]
fn human_output_escapes_control_characters() {
    let home = hostile_home();
    for args in [
        &["get", "image"][..],
        &["get", "image", "-o", "wide"],
        &["get", "image", "-o", "name"],
        &["describe", "image", "img1"],
        &["events"],
        &["events", "image", "img1"],
        &["lease", "ls"],
    ] {
        let o = home.run(args);
        assert!(o.status.success(), "{args:?}: {o:?}");
        assert_eq!(
            controls(&o.stdout),
            Vec::<char>::new(),
            "{args:?}:\n{}",
            String::from_utf8_lossy(&o.stdout)
        );
        assert!(
            !String::from_utf8_lossy(&o.stdout).contains("\nvm/fake"),
            "{args:?}: a faked row"
        );
    }
    let describe = home.ok(&["describe", "image", "img1"]);
    assert!(describe.contains("\\u{1b}]52;c;"), "{describe}");
    let leases = home.ok(&["lease", "ls"]);
    assert!(
        leases.contains("l1") && leases.contains("\\u{1b}]52"),
        "{leases}"
    );
    let table = home.ok(&["get", "image"]);
    assert_eq!(table.lines().count(), 2, "{table}");
}

#[test]
fn machine_output_stays_exact() {
    let home = hostile_home();
    let json: serde_json::Value =
        serde_json::from_str(&home.ok(&["get", "image", "img1", "-o", "json"])).unwrap();
    assert_eq!(json["spec"]["source"]["file"], format!("/srv/{HOSTILE}"));
    let yaml = home.ok(&["get", "image", "img1", "-o", "yaml"]);
    assert!(!yaml.contains('\u{1b}'), "{yaml:?}");
    let v: serde_json::Value = serde_saphyr::from_str(&yaml).unwrap();
    assert_eq!(v["spec"]["source"]["file"], format!("/srv/{HOSTILE}"));
    // piped: the exact value, for scripts
    assert_eq!(
        home.ok(&["get", "image", "img1", "-o", "jsonpath={.spec.source.file}"]),
        format!("/srv/{HOSTILE}\n")
    );
}

#[test]
fn errors_escape_what_they_echo() {
    let home = hostile_home();
    for args in [
        &["get", "vm\u{1b}[2J"][..],
        &["describe", "image", "no\u{1b}]52;c;eA==\u{7}"],
        &["get", "image", "-o", "x\u{1b}[2J"],
        &["explain", "Vm.spec.\u{1b}[2J"],
    ] {
        let o = home.run(args);
        assert!(!o.status.success(), "{args:?}");
        assert_eq!(
            controls(&o.stderr),
            Vec::<char>::new(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

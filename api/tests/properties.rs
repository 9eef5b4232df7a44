//! Property tests for every parser that takes open-ended input: names, quantities, label
//! selectors and manifests. Each never panics, accepts only what its grammar allows, and
//! refuses the rest with a message that is safe to print (not empty, no control characters).
//!
//! Case counts are proptest's default (256) unless a block says otherwise; the whole file
//! runs in a few seconds in a debug build.

use std::collections::BTreeMap;
use std::path::{Component, Path};
use std::sync::LazyLock;

use boxery_api::codec::{ManifestError, parse_manifests};
use boxery_api::name::{check_label_name, check_subdomain_name, check_text, shown};
use boxery_api::quantity::QUANTITY_PATTERN;
use boxery_api::selector::Requirement;
use boxery_api::{API_VERSION, KINDS, Name, Quantity, Selector, normalize};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

// ---------------------------------------------------------------------------------------
// Shared checks and strategies.

/// A message shown to a person: not empty, no control characters (no newline, escape or
/// NUL that could rewrite a terminal), and at most `max` bytes.
fn check_message(msg: &str, max: usize) -> Result<(), TestCaseError> {
    prop_assert!(!msg.trim().is_empty(), "empty message");
    prop_assert!(
        !msg.chars().any(char::is_control),
        "control character in message {:?}",
        msg
    );
    prop_assert!(
        msg.len() <= max,
        "message of {} bytes: {:?}",
        msg.len(),
        msg
    );
    Ok(())
}

/// Strings built from pieces that break path, option and terminal handling, mixed with valid
/// name characters so that some of them come close to passing.
fn hostile_string() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        6 => "[a-z0-9]{1,8}",
        1 => prop_oneof![
            Just("-"), Just("."), Just(".."), Just("/"), Just("\\"), Just("\0"), Just("\n"),
            Just("\r"), Just("\t"), Just(" "), Just("\u{1b}[31m"), Just("\u{7f}"),
            Just("\u{85}"), Just("\u{202e}"), Just("\u{200b}"), Just("\u{feff}"), Just("é"),
            Just("É"), Just("名"), Just("🦀"), Just("e\u{301}"), Just("A"), Just("_"),
            Just("~"), Just("$HOME"), Just("-oProxyCommand="), Just("%2e%2e"), Just(":"),
        ]
        .prop_map(str::to_string),
    ];
    prop::collection::vec(piece, 0..16).prop_map(|v| v.concat())
}

/// Any string: arbitrary unicode, hostile pieces, and long runs of name characters that
/// cross the 63- and 253-byte limits.
fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        hostile_string(),
        "[a-z0-9.-]{0,300}",
        "[a-zé]{55,70}",
        prop::collection::vec(any::<char>(), 0..400).prop_map(|v| v.into_iter().collect()),
    ]
}

/// A DNS-1123 label, from its grammar.
fn dns_label() -> impl Strategy<Value = String> {
    "[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
}

// ---------------------------------------------------------------------------------------
// Names.

/// What every accepted name guarantees.
fn check_accepted_name(s: &str, name: &Name, max: usize) -> Result<(), TestCaseError> {
    prop_assert_eq!(name.as_str(), s);
    prop_assert!(!s.is_empty() && s.len() <= max, "length {}", s.len());
    prop_assert!(s.is_ascii());
    prop_assert!(!s.starts_with('-'));
    prop_assert!(!s.contains('/') && !s.contains('\0') && !s.chars().any(char::is_whitespace));
    let parts: Vec<Component<'_>> = Path::new(s).components().collect();
    prop_assert_eq!(parts, vec![Component::Normal(s.as_ref())]);
    prop_assert_eq!(name.as_path(), Path::new(s));
    let json = serde_json::to_string(name).unwrap();
    prop_assert_eq!(&serde_json::from_str::<Name>(&json).unwrap(), name);
    Ok(())
}

fn check_name(s: &str) -> Result<(), TestCaseError> {
    let sub = Name::new(s);
    let label = Name::label(s);
    prop_assert_eq!(sub.is_ok(), check_subdomain_name(s).is_ok());
    prop_assert_eq!(label.is_ok(), check_label_name(s).is_ok());
    prop_assert_eq!(&s.parse::<Name>(), &sub);
    // Every label is a subdomain.
    prop_assert!(label.is_err() || sub.is_ok());
    match &sub {
        Ok(n) => check_accepted_name(s, n, 253)?,
        Err(e) => check_message(&e.to_string(), 400)?,
    }
    match &label {
        Ok(n) => {
            check_accepted_name(s, n, 63)?;
            prop_assert!(!s.contains('.'));
        }
        Err(e) => check_message(&e.to_string(), 400)?,
    }
    for kind in &KINDS {
        let n = Name::for_kind(kind, s);
        prop_assert_eq!(
            &n,
            if kind.dotted_names { &sub } else { &label },
            "{}",
            kind.kind
        );
    }
    // serde refuses what `Name::new` refuses.
    let json = serde_json::to_string(s).unwrap();
    prop_assert_eq!(serde_json::from_str::<Name>(&json).is_ok(), sub.is_ok());
    Ok(())
}

proptest! {
    #[test]
    fn names_never_panic_and_accept_only_safe_names(s in any_text()) {
        check_name(&s)?;
    }

    #[test]
    fn every_dns_label_is_accepted(s in dns_label()) {
        prop_assert!(Name::label(&s).is_ok(), "{:?}", s);
        prop_assert!(Name::new(&s).is_ok(), "{:?}", s);
        check_name(&s)?;
    }

    #[test]
    fn every_dns_subdomain_up_to_253_bytes_is_accepted(
        labels in prop::collection::vec(dns_label(), 1..7)
    ) {
        let s = labels.join(".");
        prop_assert_eq!(Name::new(&s).is_ok(), s.len() <= 253, "{:?}", s);
        prop_assert_eq!(Name::label(&s).is_ok(), labels.len() == 1);
        check_name(&s)?;
    }

    #[test]
    fn shown_is_short_and_printable(s in any_text()) {
        let out = shown(&s);
        prop_assert!(!out.chars().any(char::is_control), "{:?}", out);
        prop_assert!(out.chars().count() <= 41, "{} chars: {:?}", out.chars().count(), out);
        // Plain short text is shown as it is; longer text is cut with a mark.
        if s.chars().count() <= 40 && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            prop_assert_eq!(&out, &s);
        }
        if s.chars().count() > 40 {
            prop_assert!(out.ends_with('…'), "{:?}", out);
        }
    }

    #[test]
    fn check_text_accepts_only_printable_bounded_text(s in any_text(), max in 0usize..300) {
        match check_text(&s, max) {
            Ok(()) => {
                prop_assert!(!s.trim().is_empty() && s.len() <= max);
                prop_assert!(!s.chars().any(char::is_control));
            }
            Err(e) => check_message(&e, 400)?,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Quantities.

const SUFFIXES: [(&str, u128); 11] = [
    ("", 1),
    ("k", 1000),
    ("M", 1000u128.pow(2)),
    ("G", 1000u128.pow(3)),
    ("T", 1000u128.pow(4)),
    ("P", 1000u128.pow(5)),
    ("Ki", 1 << 10),
    ("Mi", 1 << 20),
    ("Gi", 1 << 30),
    ("Ti", 1 << 40),
    ("Pi", 1 << 50),
];

/// What a quantity is worth, computed without overflow: `None` when it is not a quantity
/// or does not fit in a u64.
fn quantity_oracle(num: &str, suffix: &str) -> Option<u64> {
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let mult = SUFFIXES.iter().find(|(s, _)| *s == suffix)?.1;
    let n: u128 = num.parse().ok()?;
    u64::try_from(n.checked_mul(mult)?).ok()
}

/// Whether `s` matches the schema's pattern (checked by the JSON Schema validator itself).
fn matches_pattern(s: &str) -> bool {
    static V: LazyLock<jsonschema::Validator> = LazyLock::new(|| {
        jsonschema::validator_for(&json!({"type": "string", "pattern": QUANTITY_PATTERN})).unwrap()
    });
    V.is_valid(&json!(s))
}

fn suffix() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(SUFFIXES.map(|(s, _)| s).to_vec()).prop_map(str::to_string),
        1 => prop::sample::select(vec![
            "Ei", "E", "e999", "e", "K", "ki", "gb", "GB", "i", " Gi", "Gi ", "m", ".5", "Gi\n",
            "\u{1b}", "Ｇｉ",
        ])
        .prop_map(str::to_string),
    ]
}

proptest! {
    #[test]
    fn quantities_never_panic(s in any_text()) {
        match s.parse::<Quantity>() {
            Ok(q) => prop_assert_eq!(q.to_string().parse::<Quantity>().unwrap(), q),
            Err(e) => check_message(&e.to_string(), 400)?,
        }
    }

    #[test]
    fn quantities_parse_to_their_exact_value_or_are_refused(
        num in "[0-9]{0,25}", suffix in suffix()
    ) {
        let s = format!("{num}{suffix}");
        let want = quantity_oracle(&num, &suffix);
        match s.parse::<Quantity>() {
            Ok(q) => prop_assert_eq!(Some(q.bytes()), want, "{:?}", s),
            Err(e) => {
                prop_assert_eq!(None, want, "{:?}", s);
                check_message(&e.to_string(), 400)?;
            }
        }
        // The schema's pattern describes the same grammar (it caps the digits at 19).
        let grammatical = (1..=19).contains(&num.len())
            && SUFFIXES.iter().any(|(x, _)| *x == suffix);
        prop_assert_eq!(matches_pattern(&s), grammatical, "{:?}", s);
    }

    #[test]
    fn quantities_round_trip_through_display_and_serde(bytes in any::<u64>(), shift in 0u32..60) {
        for q in [Quantity::from_bytes(bytes), Quantity::from_bytes(bytes >> shift << shift)] {
            let shown = q.to_string();
            prop_assert_eq!(shown.parse::<Quantity>().unwrap(), q, "{}", shown);
            let json = serde_json::to_value(q).unwrap();
            prop_assert_eq!(serde_json::from_value::<Quantity>(json).unwrap(), q);
            // What is displayed also satisfies the schema, for every value the schema can
            // express (below 10^19 bytes, or a whole number of KiB).
            if q.bytes() < 10u64.pow(19) || q.bytes().is_multiple_of(1024) {
                prop_assert!(matches_pattern(&shown), "{}", shown);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Label selectors. `Selector` has no `Display`; `render` writes one the way a person would,
// and parsing it must give the selector back.

fn selector_key() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9]([a-zA-Z0-9._/-]{0,20}[a-zA-Z0-9])?"
}

fn selector_value() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9]([a-zA-Z0-9._-]{0,20}[a-zA-Z0-9])?"
}

fn requirement() -> impl Strategy<Value = Requirement> {
    let values = || prop::collection::vec(selector_value(), 1..4);
    prop_oneof![
        (
            selector_key(),
            prop_oneof![Just(String::new()), selector_value()]
        )
            .prop_map(|(k, v)| Requirement::Eq(k, v)),
        (
            selector_key(),
            prop_oneof![Just(String::new()), selector_value()]
        )
            .prop_map(|(k, v)| Requirement::NotEq(k, v)),
        (selector_key(), values()).prop_map(|(k, v)| Requirement::In(k, v)),
        (selector_key(), values()).prop_map(|(k, v)| Requirement::NotIn(k, v)),
        selector_key().prop_map(Requirement::Exists),
        selector_key().prop_map(Requirement::NotExists),
    ]
}

fn render(sel: &Selector, spaced: bool, double_eq: bool) -> String {
    let (sep, eq) = (
        if spaced { " , " } else { "," },
        if double_eq { "==" } else { "=" },
    );
    sel.0
        .iter()
        .map(|r| match r {
            Requirement::Eq(k, v) => format!("{k}{eq}{v}"),
            Requirement::NotEq(k, v) => format!("{k}!={v}"),
            Requirement::In(k, vs) => format!("{k} in ({})", vs.join(sep)),
            Requirement::NotIn(k, vs) => format!("{k} notin ({})", vs.join(sep)),
            Requirement::Exists(k) => k.clone(),
            Requirement::NotExists(k) => format!("!{k}"),
        })
        .collect::<Vec<_>>()
        .join(sep)
}

/// The requirement that holds exactly when `r` does not.
fn complement(r: &Requirement) -> Requirement {
    match r.clone() {
        Requirement::Eq(k, v) => Requirement::NotEq(k, v),
        Requirement::NotEq(k, v) => Requirement::Eq(k, v),
        Requirement::In(k, v) => Requirement::NotIn(k, v),
        Requirement::NotIn(k, v) => Requirement::In(k, v),
        Requirement::Exists(k) => Requirement::NotExists(k),
        Requirement::NotExists(k) => Requirement::Exists(k),
    }
}

fn key_of(r: &Requirement) -> &str {
    match r {
        Requirement::Eq(k, _)
        | Requirement::NotEq(k, _)
        | Requirement::In(k, _)
        | Requirement::NotIn(k, _)
        | Requirement::Exists(k)
        | Requirement::NotExists(k) => k,
    }
}

/// Label maps whose keys and values sometimes collide with the generated selectors.
fn labels() -> impl Strategy<Value = BTreeMap<String, String>> {
    let key = prop_oneof!["[a-c]", selector_key(), any::<String>()];
    let value = prop_oneof![
        Just(String::new()),
        "[a-c]",
        selector_value(),
        any::<String>()
    ];
    prop::collection::btree_map(key, value, 0..8)
}

proptest! {
    #[test]
    fn selectors_never_panic(s in prop_oneof![any_text(), "[a-z!=,() ]{0,40}", "[a-z]{1,3}( (not)?in )?[(),a-z ]{0,20}"]) {
        match s.parse::<Selector>() {
            Ok(sel) => {
                for r in &sel.0 {
                    let k = key_of(r);
                    prop_assert!(!k.is_empty() && k.len() <= 253 && k.is_ascii(), "{:?}", k);
                    prop_assert!(!k.chars().any(|c| c.is_whitespace() || c.is_control()));
                }
            }
            Err(e) => check_message(&e.to_string(), 600)?,
        }
    }

    #[test]
    fn selectors_round_trip(
        reqs in prop::collection::vec(requirement(), 0..6),
        spaced in any::<bool>(),
        double_eq in any::<bool>(),
    ) {
        let sel = Selector(reqs);
        let text = render(&sel, spaced, double_eq);
        let parsed = text.parse::<Selector>();
        prop_assert_eq!(parsed, Ok(sel), "{:?}", text);
    }

    #[test]
    fn matching_never_panics_and_is_a_conjunction(
        reqs in prop::collection::vec(requirement(), 0..6),
        labels in labels(),
    ) {
        let sel = Selector(reqs);
        let each: Vec<bool> = sel
            .0
            .iter()
            .map(|r| Selector(vec![r.clone()]).matches(&labels))
            .collect();
        prop_assert_eq!(sel.matches(&labels), each.iter().all(|m| *m));
        for (r, m) in sel.0.iter().zip(&each) {
            prop_assert_eq!(Selector(vec![complement(r)]).matches(&labels), !m, "{:?}", r);
        }
        prop_assert!(Selector::default().matches(&labels));
    }
}

// ---------------------------------------------------------------------------------------
// Manifests.

const SOURCE: &str = "m.yaml";

/// What every refused manifest guarantees: it names the source and says what is wrong.
fn check_manifest_error(e: &ManifestError) -> Result<(), TestCaseError> {
    prop_assert_eq!(&e.source_name, SOURCE);
    prop_assert!(!e.errors.is_empty(), "{:?}", e);
    for fe in &e.errors {
        prop_assert!(!fe.message.trim().is_empty(), "{:?}", e);
    }
    let text = e.to_string();
    prop_assert!(text.starts_with(SOURCE), "{}", text);
    check_message(&text, usize::MAX)?;
    Ok(())
}

/// What every accepted manifest guarantees: its object validates again to itself (the store
/// re-validates every object it writes), under a valid name.
fn check_manifests(bytes: &[u8]) -> Result<(), TestCaseError> {
    match parse_manifests(SOURCE, bytes) {
        Ok(ms) => {
            prop_assert!(!ms.is_empty());
            for m in ms {
                let again = normalize(serde_json::to_value(&m.object).unwrap());
                prop_assert_eq!(again.as_ref(), Ok(&m.object));
                let info = KINDS.iter().find(|k| k.kind == m.object.kind).unwrap();
                prop_assert!(Name::for_kind(info, &m.object.metadata.name).is_ok());
            }
        }
        Err(e) => check_manifest_error(&e)?,
    }
    Ok(())
}

/// Pieces of YAML that stress a parser: document markers, anchors and aliases, merge keys,
/// tags, deep flow nesting, odd scalars, and the real fields of a manifest.
fn yaml_fragment() -> impl Strategy<Value = String> {
    let fixed = prop::sample::select(vec![
        "---",
        "...",
        "apiVersion: boxery.dev/v1alpha1",
        "apiVersion: v1",
        "kind: Vm",
        "kind: Pool",
        "kind: Image",
        "kind: Lease",
        "kind: Grant",
        "kind: Event",
        "metadata: {name: a}",
        "metadata:",
        "  name: dev1",
        "  name: ../x",
        "  labels: {a: b}",
        "  labels:",
        "    &l team: web",
        "spec:",
        "  source: {image: debian-12}",
        "  source:",
        "    image: *a",
        "  resources: {cpus: 2, memory: 1Gi, disk: 20Gi}",
        "  replicas: 3",
        "  template:",
        "    spec: {source: {image: x}}",
        "&a",
        "*a",
        "&a [1, 2]",
        "&b {x: *a}",
        "<<: *a",
        "<<: [*a, *b]",
        "!!binary aGVsbG8=",
        "!!str",
        "!!int",
        "!!map",
        "!!seq",
        "!!float",
        "!custom",
        "!<tag:yaml.org,2002:str>",
        "? complex",
        ": value",
        "[[[[[[[[",
        "]]]]",
        "{{{{",
        "}}",
        "- item",
        "  - nested",
        "key: |",
        "  literal",
        "key: >-",
        "%YAML 1.2",
        "%TAG ! tag:x,2000:",
        "'it''s'",
        "\"esc \\u0000 \\x1b \\e\"",
        "# c",
        "\t",
        "1e999",
        "-.inf",
        ".nan",
        "0x1F",
        "0o17",
        "~",
        "null",
        "yes",
        "18446744073709551616",
        "-9223372036854775809",
        "\u{feff}",
        "\r",
        "\u{85}",
        "\u{2028}",
        "\u{1b}[2J",
        "memory: 99999999999999999999Ei",
        "cpus: 1e999",
        "name: \"\u{202e}x\"",
    ])
    .prop_map(str::to_string);
    prop_oneof![
        8 => fixed,
        1 => "[a-z]{1,5}: [a-z0-9]{0,5}",
        1 => (1usize..3000).prop_map(|n| format!("{}: v", "k".repeat(n))),
        1 => (1usize..300).prop_map(|n| "[".repeat(n)),
        1 => (1usize..100).prop_map(|n| format!("{}x", "- ".repeat(n))),
        1 => any::<String>(),
    ]
}

fn yaml_document() -> impl Strategy<Value = String> {
    let sep = prop::sample::select(vec!["\n", "\n", "\n  ", " ", "", ": ", ", "]);
    prop::collection::vec((yaml_fragment(), sep), 0..24).prop_map(|parts| {
        parts
            .into_iter()
            .flat_map(|(f, s)| [f, s.to_string()])
            .collect()
    })
}

/// A JSON value of any shape, whose object keys are often the real field names so that
/// validation gets past its first checks.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        field_value().prop_map(Value::from),
    ];
    leaf.prop_recursive(5, 96, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::vec((field_name(), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// The fields of every kind, and a few that belong to none.
fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec![
            "apiVersion", "kind", "metadata", "name", "namespace", "labels", "annotations",
            "finalizers", "ownerReferences", "uid", "resourceVersion", "generation",
            "creationTimestamp", "deletionTimestamp", "spec", "status", "source", "image",
            "build", "base", "url", "resources", "cpus", "memory", "disk", "shape",
            "runStrategy", "replicas", "template", "pool", "holderIdentity", "publicKey",
            "leaseDurationSeconds", "renewTime", "vm", "lease", "type", "target", "valueFrom",
            "env", "file", "command", "involvedObject", "reason", "message", "count",
            "firstTimestamp", "lastTimestamp", "reportingController", "conditions", "phase",
            "<<", "",
        ])
        .prop_map(str::to_string),
        1 => any::<String>(),
    ]
}

/// String values: the ones the kinds expect, and hostile ones.
fn field_value() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            API_VERSION,
            "Vm",
            "Image",
            "Pool",
            "Lease",
            "Grant",
            "Event",
            "dev1",
            "debian-12",
            "1Gi",
            "512Mi",
            "20G",
            "99999999999999999999Ei",
            "16384Pi",
            "Running",
            "Halted",
            "Normal",
            "Warning",
            "llm",
            "env",
            "2026-01-01T00:00:00Z",
            "not a time",
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDc1 me",
        ])
        .prop_map(str::to_string),
        any_text(),
    ]
}

/// One valid object of each kind; `normalize` accepts each (checked below).
fn seeds() -> Vec<Value> {
    let m = |kind: &str, name: &str, spec: Value| json!({"apiVersion": API_VERSION, "kind": kind, "metadata": {"name": name, "labels": {"a": "b"}}, "spec": spec});
    vec![
        m(
            "Vm",
            "dev1",
            json!({"source": {"image": "debian-12"}, "resources": {"cpus": 2, "memory": "1Gi", "disk": "20Gi"}}),
        ),
        m(
            "Image",
            "debian-12.v1",
            json!({"source": {"build": {"base": "tiny"}}}),
        ),
        m(
            "Pool",
            "p",
            json!({"replicas": 1, "template": {"spec": {"source": {"image": "tiny"}}}}),
        ),
        json!({"apiVersion": API_VERSION, "kind": "Event", "metadata": {"name": "dev1.1"},
            "involvedObject": {"kind": "Vm", "name": "dev1"}, "type": "Normal",
            "reason": "Started", "message": "started", "firstTimestamp": "2026-01-01T00:00:00Z",
            "lastTimestamp": "2026-01-01T00:00:00Z"}),
    ]
}

/// Set `value` at `path` in `obj`, making objects along the way (a path into a non-object
/// replaces it).
fn set_path(obj: &mut Value, path: &[String], value: Value) {
    let Some((first, rest)) = path.split_first() else {
        *obj = value;
        return;
    };
    if !obj.is_object() {
        *obj = Value::Object(Map::new());
    }
    let child = obj
        .as_object_mut()
        .unwrap()
        .entry(first.clone())
        .or_insert(Value::Null);
    set_path(child, rest, value);
}

/// `normalize` never panics; what it accepts validates again to itself; what it refuses
/// has at least one error, each with a message. With `printable`, the whole message must be
/// safe to print as well.
/// Edits a person might make to a valid object: labels, annotations, the name, sizes, counts,
/// free text. Many keep the object valid, so the accepting paths are exercised too.
fn gentle_edit() -> impl Strategy<Value = (Vec<String>, Value)> {
    fn at(parts: &[&str], last: Option<String>) -> Vec<String> {
        parts.iter().map(|s| s.to_string()).chain(last).collect()
    }
    prop_oneof![
        (
            prop_oneof![selector_key(), any_text()],
            prop_oneof![selector_value(), any_text()]
        )
            .prop_map(|(k, v)| (at(&["metadata", "labels"], Some(k)), Value::from(v))),
        (any_text(), any_text())
            .prop_map(|(k, v)| (at(&["metadata", "annotations"], Some(k)), Value::from(v))),
        prop_oneof![3 => dns_label(), 1 => any_text()]
            .prop_map(|n| (at(&["metadata", "name"], None), Value::from(n))),
        (-2i64..100).prop_map(|n| (at(&["spec", "resources", "cpus"], None), Value::from(n))),
        (
            prop::sample::select(vec!["memory", "disk"]),
            "[0-9]{1,6}",
            suffix()
        )
            .prop_map(|(f, n, s)| {
                (
                    at(&["spec", "resources", f], None),
                    Value::from(format!("{n}{s}")),
                )
            }),
        (-2i64..20).prop_map(|n| (at(&["spec", "replicas"], None), Value::from(n))),
        prop::sample::select(vec!["Running", "Halted", "Always", "Manual", "bogus"])
            .prop_map(|v| (at(&["spec", "runStrategy"], None), Value::from(v))),
        prop_oneof![dns_label(), any_text()]
            .prop_map(|v| (at(&["spec", "source", "image"], None), Value::from(v))),
        (prop::sample::select(vec!["message", "reason"]), any_text())
            .prop_map(|(f, v)| (at(&[f], None), Value::from(v))),
    ]
}

/// A valid object of some kind, with a few gentle edits.
fn edited_seed() -> impl Strategy<Value = Value> {
    (0..seeds().len(), prop::collection::vec(gentle_edit(), 0..4)).prop_map(|(i, edits)| {
        let mut value = seeds().swap_remove(i);
        for (path, v) in edits {
            set_path(&mut value, &path, v);
        }
        value
    })
}

fn check_normalize(value: Value, printable: bool) -> Result<(), TestCaseError> {
    match normalize(value) {
        Ok(obj) => {
            let again = normalize(serde_json::to_value(&obj).unwrap());
            prop_assert_eq!(again.as_ref(), Ok(&obj));
        }
        Err(e) => {
            prop_assert!(!e.errors.is_empty(), "{:?}", e);
            for fe in &e.errors {
                prop_assert!(!fe.message.trim().is_empty(), "{:?}", e);
            }
            if printable {
                check_message(&e.to_string(), usize::MAX)?;
            }
        }
    }
    Ok(())
}

#[test]
fn seeds_are_valid() {
    for s in seeds() {
        if let Err(e) = normalize(s.clone()) {
            panic!("{s}: {e}");
        }
    }
}

proptest! {
    #[test]
    fn manifests_of_arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        check_manifests(&bytes)?;
    }

    #[test]
    fn manifests_of_arbitrary_text_never_panic(text in any_text()) {
        check_manifests(text.as_bytes())?;
    }

    #[test]
    fn yaml_ish_manifests_never_panic(text in yaml_document()) {
        check_manifests(text.as_bytes())?;
    }

    #[test]
    fn normalize_of_arbitrary_json_never_panics(value in any_json()) {
        check_normalize(value, false)?;
    }

    /// `ValidationError` messages quote values as JSON, which leaves DEL and C1 controls
    /// (U+007F to U+009F) raw, and `unknown apiVersion` quotes the value unescaped. The codec
    /// escapes them (checked above through `parse_manifests`); `validate.rs` does not yet.
    #[test]
    fn normalize_messages_are_printable(value in any_json()) {
        check_normalize(value, true)?;
    }

    /// The YAML codec and `normalize` agree: an object `normalize` accepts, written as YAML
    /// (one or several documents) or as JSON, parses to the same objects.
    #[test]
    fn manifests_of_edited_objects_agree_with_normalize(
        values in prop::collection::vec(edited_seed(), 1..4),
    ) {
        let yaml: String = values
            .iter()
            .map(|v| format!("---\n{}", serde_saphyr::to_string(v).unwrap()))
            .collect();
        let json = Value::Array(values.clone()).to_string();
        let want: Result<Vec<_>, _> = values.iter().cloned().map(normalize).collect();
        for text in [&yaml, &json] {
            check_manifests(text.as_bytes())?;
            let got = parse_manifests(SOURCE, text.as_bytes());
            match &want {
                Ok(want) => {
                    let got: Vec<_> = got.map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?
                        .into_iter()
                        .map(|m| m.object)
                        .collect();
                    prop_assert_eq!(&got, want, "{}", text);
                }
                Err(_) => prop_assert!(got.is_err(), "{}", text),
            }
        }
    }

    /// Valid manifests with one hostile fragment spliced in at some line.
    #[test]
    fn edited_manifests_with_a_hostile_line_never_panic(
        values in prop::collection::vec(edited_seed(), 1..3),
        at in any::<prop::sample::Index>(),
        fragment in yaml_fragment(),
    ) {
        let yaml: String = values
            .iter()
            .map(|v| format!("---\n{}", serde_saphyr::to_string(v).unwrap()))
            .collect();
        let mut lines: Vec<&str> = yaml.lines().collect();
        lines.insert(at.index(lines.len() + 1), &fragment);
        check_manifests(lines.join("\n").as_bytes())?;
    }

    #[test]
    fn normalize_of_edited_valid_objects_never_panics(value in edited_seed()) {
        check_normalize(value, false)?;
    }

    #[test]
    fn normalize_of_mutated_valid_objects_never_panics(
        seed in 0usize..4,
        edits in prop::collection::vec((prop::collection::vec(field_name(), 0..4), any_json()), 1..4),
    ) {
        let mut value = seeds().swap_remove(seed);
        for (path, v) in edits {
            set_path(&mut value, &path, v);
        }
        check_normalize(value.clone(), false)?;
        // The same object as a YAML or JSON manifest.
        check_manifests(value.to_string().as_bytes())?;
    }
}

//! The hostile inputs a review found or tried, one by one: path tricks and odd bytes in
//! names, overflowing quantities, terminal escapes in selectors and manifests, and YAML alias
//! bombs. Each is refused quickly, without a panic, with a message safe to print.

use std::time::{Duration, Instant};

use boxery_api::codec::parse_manifests;
use boxery_api::name::{check_label_name, check_subdomain_name, check_text, shown};
use boxery_api::{KINDS, Name, Quantity, Selector};

/// No control character (a terminal acts on those) in a message meant for a person.
fn assert_printable(msg: &str) {
    assert!(!msg.trim().is_empty(), "empty message");
    assert!(
        !msg.chars().any(char::is_control),
        "control character in {msg:?}"
    );
}

#[test]
fn path_tricks_are_not_names() {
    for bad in [
        "",
        ".",
        "..",
        "...",
        "/",
        "//",
        "/etc/passwd",
        "/tmp",
        "../etc",
        "a/../../b",
        "a/b",
        "./a",
        "a\\b",
        "..\\..\\x",
        "~",
        "~root",
        "-",
        "-rf",
        "--help",
        "-oProxyCommand=sh",
    ] {
        for result in [Name::new(bad), Name::label(bad)] {
            let e = result.expect_err(bad);
            assert_printable(&e.to_string());
        }
        assert!(check_label_name(bad).is_err(), "{bad:?}");
        assert!(check_subdomain_name(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn empty_name_says_a_name_is_required() {
    assert_eq!(Name::new("").unwrap_err().to_string(), "a name is required");
    assert_eq!(
        Name::label("").unwrap_err().to_string(),
        "a name is required"
    );
}

#[test]
fn unicode_and_control_characters_are_not_names() {
    for bad in [
        "dév",
        "名前",
        "🦀",
        "ａｂｃ", // fullwidth letters
        "e\u{301}",
        "a\u{200b}b",  // zero-width space
        "\u{202e}abc", // right-to-left override
        "\u{feff}abc", // byte-order mark
        "a\0b",
        "a\nb",
        "a\rb",
        "a\tb",
        "a\u{7f}",
        "a\u{85}",
        "\u{1b}[31mred",
        "\u{1b}]0;title\u{7}",
        "a b",
        "Dev1",
    ] {
        for result in [Name::new(bad), Name::label(bad)] {
            let e = result.expect_err(bad).to_string();
            assert_printable(&e);
        }
    }
    let e = Name::new("\u{1b}[2J").unwrap_err().to_string();
    assert!(e.contains("\\u{1b}[2J"), "{e}");
}

/// `&name[..20]` used to cut a long name for its error message; a multi-byte character across
/// byte 20 panicked. Every cut point and every length around the limits must be safe.
#[test]
fn long_non_ascii_names_do_not_panic() {
    let names = [
        "é".repeat(32),                                   // 64 bytes, 32 characters
        format!("{}é{}", "a".repeat(19), "a".repeat(43)), // é across byte 20
        format!("{}é{}", "a".repeat(39), "a".repeat(23)), // é across byte 40
        format!("{}é", "a".repeat(62)),                   // é across byte 63
        format!("{}🦀", "a".repeat(61)),                  // a 4-byte character across byte 63
        "名".repeat(85),                                  // 255 bytes
        "a".repeat(64),
        "a".repeat(254),
        format!("{}.{}", "a".repeat(63), "b".repeat(64)),
    ];
    for n in &names {
        assert!(n.len() >= 64, "{n}");
        for e in [
            Name::new(n).map(|_| ()).map_err(|e| e.to_string()),
            Name::label(n).map(|_| ()).map_err(|e| e.to_string()),
            check_label_name(n),
        ] {
            let e = e.expect_err(n);
            assert_printable(&e);
            assert!(e.chars().count() < 200, "{e}");
        }
    }
    let e = Name::label(&"é".repeat(32)).unwrap_err().to_string();
    assert!(e.contains("64 bytes long; the limit is 63"), "{e}");
}

#[test]
fn the_longest_names_are_accepted_and_one_more_byte_is_not() {
    let label = "a".repeat(63);
    assert!(Name::label(&label).is_ok());
    assert!(Name::label(&"a".repeat(64)).is_err());
    let sub = format!("{0}.{0}.{0}.{1}", "a".repeat(63), "b".repeat(61)); // 253 bytes
    assert_eq!(sub.len(), 253);
    assert!(Name::new(&sub).is_ok());
    assert!(Name::label(&sub).is_err());
    assert!(Name::new(&format!("{sub}b")).is_err());
    for kind in &KINDS {
        assert_eq!(
            Name::for_kind(kind, &sub).is_ok(),
            kind.dotted_names,
            "{}",
            kind.kind
        );
    }
}

#[test]
fn shown_is_bounded_and_printable() {
    assert_eq!(shown("dev1"), "dev1");
    assert_eq!(shown(""), "");
    for s in [
        "\0".repeat(1000),
        "\u{1b}".repeat(41),
        "é".repeat(10_000),
        "\u{10ffff}".repeat(50),
    ] {
        let out = shown(&s);
        assert!(out.chars().count() <= 41, "{out}");
        assert!(out.ends_with('…'), "{out}");
        assert!(!out.chars().any(char::is_control), "{out}");
    }
}

#[test]
fn text_fields_refuse_control_characters_and_blank_text() {
    for bad in ["", " ", "\t", "me\nyou", "a\u{1b}[2J", "a\u{7f}", "a\u{85}"] {
        let e = check_text(bad, 128).unwrap_err();
        assert_printable(&e);
    }
    assert!(check_text(&"é".repeat(65), 128).is_err());
    assert!(check_text("alice@laptop (agent 2)", 128).is_ok());
}

#[test]
fn overflowing_quantities_are_refused() {
    for bad in [
        "99999999999999999999Ei",
        "99999999999999999999",
        "18446744073709551616",
        "18446744073709551615Ki",
        "16384Pi",
        "18446744073709552k",
        "18447P",
        "1e999",
        "1e19",
        "9.9e99Gi",
        "1Ei",
        "0x10",
        "+1",
        "-1",
        " 1",
        "1 ",
        "١",
        "1Ｇｉ",
        "",
        "Gi",
    ] {
        let e = bad.parse::<Quantity>().expect_err(bad).to_string();
        assert_printable(&e);
    }
    assert_eq!(
        "18446744073709551615".parse::<Quantity>().unwrap().bytes(),
        u64::MAX
    );
    assert_eq!("16383Pi".parse::<Quantity>().unwrap().bytes(), 16383 << 50);
    assert_eq!(
        "18446744073709551k".parse::<Quantity>().unwrap().bytes(),
        18_446_744_073_709_551_000
    );
}

#[test]
fn quantity_and_selector_errors_escape_and_cut_their_input() {
    let e = "4Gi\n\u{1b}[2J"
        .parse::<Quantity>()
        .unwrap_err()
        .to_string();
    assert_printable(&e);
    assert!(e.contains("4Gi\\n\\u{1b}[2J"), "{e}");
    let e = "9"
        .repeat(100_000)
        .parse::<Quantity>()
        .unwrap_err()
        .to_string();
    assert!(e.len() < 200, "{} bytes", e.len());

    let e = "a=b,\u{1b}]0;pwned\u{7}"
        .parse::<Selector>()
        .unwrap_err()
        .to_string();
    assert_printable(&e);
    let e = format!("a=b,{}", "x y".repeat(100_000))
        .parse::<Selector>()
        .unwrap_err()
        .to_string();
    assert!(e.len() < 300, "{} bytes", e.len());
}

/// Parse `text` as a manifest and expect a refusal within `limit`; the message is returned.
fn refused_within(text: &str, limit: Duration) -> String {
    let start = Instant::now();
    let e = parse_manifests("bomb.yaml", text.as_bytes()).expect_err("refused");
    let took = start.elapsed();
    assert!(took < limit, "took {took:?}: {e}");
    let msg = e.to_string();
    assert!(msg.starts_with("bomb.yaml"), "{msg}");
    assert_printable(&msg);
    msg
}

/// The classic "billion laughs": nine levels of nine aliases each, 9^9 (387 million) strings
/// if expanded. Refused by the alias replay budget codec.rs sets, in milliseconds (it was
/// half a second and 250,000 nodes under serde-saphyr's defaults).
#[test]
fn billion_laughs_is_refused_quickly() {
    let mut bomb = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..10 {
        let p = format!("*a{}", i - 1);
        bomb += &format!("a{i}: &a{i} [{}]\n", [p.as_str(); 9].join(", "));
    }
    let msg = refused_within(&bomb, Duration::from_secs(5));
    assert!(msg.contains("alias replay limit"), "{msg}");
}

/// Forty levels of doubling: 2^40 leaves from 40 lines.
#[test]
fn doubling_alias_bomb_is_refused_quickly() {
    let mut bomb = String::from("a0: &a0 [lol]\n");
    for i in 1..40 {
        bomb += &format!("a{i}: &a{i} [*a{p}, *a{p}]\n", p = i - 1);
    }
    let msg = refused_within(&bomb, Duration::from_secs(5));
    assert!(msg.contains("alias replay limit"), "{msg}");
}

/// One 100 kB scalar replayed 2,500 times would be 250 MB of strings.
#[test]
fn scalar_alias_bomb_is_refused_quickly() {
    let mut bomb = format!("a: &a {}\n", "x".repeat(100_000));
    bomb += &format!("b: &b [{}]\n", ["*a"; 50].join(","));
    bomb += &format!("c: [{}]\n", ["*b"; 50].join(","));
    let msg = refused_within(&bomb, Duration::from_secs(5));
    assert!(msg.contains("budget"), "{msg}");
}

/// Aliases that nest anchors inside anchors to build depth no single line has.
#[test]
fn alias_nesting_depth_is_bounded() {
    let d = 60;
    let mut deep = format!("x0: &x0 {}0{}\n", "[".repeat(d), "]".repeat(d));
    for i in 1..40 {
        deep += &format!(
            "x{i}: &x{i} {}*x{}{}\n",
            "[".repeat(d),
            i - 1,
            "]".repeat(d)
        );
    }
    let msg = refused_within(&deep, Duration::from_secs(5));
    assert!(msg.contains("Depth"), "{msg}");
}

#[test]
fn deep_nesting_is_refused() {
    refused_within(&"[".repeat(100_000), Duration::from_secs(5));
    refused_within(
        &format!("a: {}", "[".repeat(100_000)),
        Duration::from_secs(5),
    );
    refused_within(
        &format!("a: {}", "{a: ".repeat(100_000)),
        Duration::from_secs(5),
    );
    let block: String = (0..2_000)
        .map(|i| format!("{}- \n", " ".repeat(i * 2)))
        .collect();
    refused_within(&block, Duration::from_secs(5));
    let json = format!("{}1{}", "[".repeat(10_000), "]".repeat(10_000));
    refused_within(&json, Duration::from_secs(5));
}

#[test]
fn document_storms_huge_keys_and_tags_are_refused() {
    refused_within(&"---\na: 1\n".repeat(5_000), Duration::from_secs(5));
    refused_within(
        &format!("{}: 1\n", "k".repeat(100_000)),
        Duration::from_secs(5),
    );
    let msg = refused_within(
        "apiVersion: !!binary aGVsbG8=\nkind: Vm\n",
        Duration::from_secs(5),
    );
    assert!(msg.contains("unknown apiVersion"), "{msg}");
    refused_within(
        "base: &b {apiVersion: boxery.dev/v1alpha1}\n<<: *b\nkind: Vm\n",
        Duration::from_secs(5),
    );
    refused_within("a: !!int x\n", Duration::from_secs(5));
    refused_within("%YAML 9.9\n--- a\n", Duration::from_secs(5));
}

/// Terminal escapes in a manifest's values, keys and file name come back escaped: from YAML
/// escapes, from JSON, and as DEL and C1 controls that JSON leaves raw.
#[test]
fn escapes_in_manifests_are_escaped_in_errors() {
    for text in [
        "apiVersion: \"\\e[31mred\"\nkind: Vm\n",
        "{\"apiVersion\": \"\\u001b[31m\", \"kind\": \"Vm\"}",
        "{\"apiVersion\": \"boxery.dev/v1alpha1\", \"kind\": \"\\u001b[2J\"}",
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: \"a\\x7fb\"}\nspec: {source: {image: x}}\n",
        "apiVersion: boxery.dev/v1alpha1\nkind: Event\nmetadata: {name: a}\nreason: {\"\\x85\": 1}\n",
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: a, labels: {\"\\e]0;x\\a\": [1]}}\nspec: {source: {image: x}}\n",
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: a}\nspec: {source: {image: x}, \"\\e[2J\": 1}\n",
        "a: \u{1b}\n",
    ] {
        refused_within(text, Duration::from_secs(5));
    }
    let e = parse_manifests("evil\u{1b}[2J.yaml", b"a: [").unwrap_err();
    assert_printable(&e.to_string());
    assert!(e.to_string().starts_with("evil\\u{1b}[2J.yaml"), "{e}");
}

#[test]
fn hostile_names_in_manifests_are_refused_at_metadata_name() {
    for name in [
        "..",
        ".",
        "/etc",
        "../../x",
        "-oProxyCommand=x",
        &"é".repeat(32),
        "a\u{7f}",
    ] {
        let text = serde_json::json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Vm",
            "metadata": {"name": name}, "spec": {"source": {"image": "x"}}
        })
        .to_string();
        let e = parse_manifests("m.json", text.as_bytes()).unwrap_err();
        assert_printable(&e.to_string());
        assert!(
            e.errors.iter().any(|f| f.path.starts_with("metadata.name")),
            "{name:?}: {e}"
        );
    }
}

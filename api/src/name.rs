//! Object names: the one validated type every user- or agent-supplied name passes through
//! before it reaches the store, the filesystem, a command line, an ssh config or a hypervisor.
//!
//! # Guarantees
//! - A [`Name`] is a DNS-1123 subdomain: 1–253 bytes of `a-z`, `0-9`, `-` and `.`, made of
//!   dot-separated labels of 1–63 bytes that start and end with a letter or digit. So it is
//!   never empty, `.` or `..`, holds no `/`, NUL, space, control character or non-ASCII
//!   byte, and never starts with `-`: it is one plain path component and never an option.
//! - A [`Name`] made with [`Name::label`] (or [`Name::for_kind`] of a kind whose names have no
//!   dots) is a DNS-1123 label (1–63 bytes, no dot).
//! - The checks never panic, whatever the input (property-tested).

use std::borrow::Cow;
use std::fmt;
use std::ops::Deref;
use std::path::Path;
use std::str::FromStr;

use crate::resource::KindInfo;

/// How long a name shown in an error may be before it is cut (in characters, escapes
/// included).
const SHOWN: usize = 40;

/// A name shown in a message: control and other unprintable characters escaped (`\n`,
/// `\u{1b}`), then cut at 40 characters with `…` after. At most 41 characters whatever the
/// input, and safe to print to a terminal.
pub fn shown(name: &str) -> String {
    let mut out = String::new();
    let mut len = 0;
    for c in name.chars() {
        let escaped = c.escape_debug();
        if len + escaped.len() > SHOWN {
            out.push('…');
            break;
        }
        len += escaped.len();
        out.extend(escaped);
    }
    out
}

/// Text made safe to print whole (an error message that quotes its input): control and
/// other unprintable characters escaped as in [`shown`], nothing cut.
pub fn printable(text: &str) -> String {
    let unprintable = |c: char| !matches!(c, '\\' | '\'' | '"') && c.escape_debug().len() > 1;
    if !text.chars().any(unprintable) {
        return text.to_string();
    }
    text.chars()
        .map(|c| {
            if unprintable(c) {
                c.escape_debug().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// A character that must not reach a terminal as is: the C0 and C1 control characters and DEL
/// (escape sequences, screen clears, OSC 52 clipboard writes, bells), and the bidirectional
/// formatting characters that make text read differently from what it holds.
pub fn unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

/// Text safe to print to a terminal: control characters, DEL and bidirectional formatting
/// characters escaped (`\n`, `\r`, `\t`, else `\u{1b}` as Rust writes them); everything else,
/// other unicode included, kept. Borrows when there is nothing to escape. Display only: the
/// result is ambiguous when the text itself holds such backslash sequences.
pub fn safe(text: &str) -> Cow<'_, str> {
    if !text.chars().any(unsafe_char) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if unsafe_char(c) => {
                out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Check a free-form text field (a holder name, a comment): 1 to `max` bytes with no control
/// characters (no newline, escape or NUL), so it is safe in a terminal, a log line and a
/// one-line file format.
pub fn check_text(text: &str, max: usize) -> Result<(), String> {
    if text.trim().is_empty() || text.len() > max {
        return Err(format!("give 1 to {max} bytes of text"));
    }
    if text.chars().any(char::is_control) {
        return Err(format!(
            "`{}` holds control characters (newlines, escapes): use printable text",
            shown(text)
        ));
    }
    Ok(())
}

/// Check a label or annotation key: an optional DNS-subdomain prefix and `/`, then a name of
/// 1–63 letters, digits, `-`, `_` and `.` that starts and ends with a letter or digit
/// (Kubernetes' qualified names: `team`, `boxery.dev/pool`).
pub fn check_key(key: &str) -> Result<(), String> {
    let bad = || {
        format!(
            "`{}` is not a valid key: use `name` or `prefix.example/name`, where the name is 1–63 letters, digits, `-`, `_` or `.` (starting and ending with a letter or digit)",
            shown(key)
        )
    };
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix {
        check_subdomain_name(p).map_err(|_| bad())?;
    }
    if name.len() > 63 || !plain_label_value(name) {
        return Err(bad());
    }
    Ok(())
}

/// Check a label's value: empty, or up to 253 letters, digits, `-`, `_` and `.` that start
/// and end with a letter or digit (Kubernetes allows 63; an Event's label holds an Image's
/// name, which may be longer).
pub fn check_label_value(value: &str) -> Result<(), String> {
    if value.is_empty() || (value.len() <= 253 && plain_label_value(value)) {
        Ok(())
    } else {
        Err(format!(
            "`{}` is not a valid label value: use up to 253 letters, digits, `-`, `_` or `.`, starting and ending with a letter or digit",
            shown(value)
        ))
    }
}

fn plain_label_value(v: &str) -> bool {
    let b = v.as_bytes();
    v.len() <= 253
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
}

/// Check that a name is a DNS-1123 label: 1–63 of `a-z`, `0-9`, `-`, starting and ending with
/// a letter or digit.
pub fn check_label_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("a name is required".into());
    }
    if name.len() > 63 {
        return Err(format!(
            "`{}` is {} bytes long; the limit is 63",
            shown(name),
            name.len()
        ));
    }
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    let ok_ends = name
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphanumeric())
        && name
            .bytes()
            .last()
            .is_some_and(|b| b.is_ascii_alphanumeric());
    if !ok_chars || !ok_ends {
        return Err(format!(
            "`{}` is not a valid name: use lowercase letters, digits and `-`, starting and ending with a letter or digit",
            shown(name)
        ));
    }
    Ok(())
}

/// Check that a name is a DNS-1123 subdomain: dot-separated labels, at most 253 bytes.
pub fn check_subdomain_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("a name is required".into());
    }
    if name.len() > 253 {
        return Err(format!(
            "`{}` is {} bytes long; the limit is 253",
            shown(name),
            name.len()
        ));
    }
    for part in name.split('.') {
        check_label_name(part).map_err(|_| {
            format!(
                "`{}` is not a valid name: use dot-separated parts of lowercase letters, digits and `-`",
                shown(name)
            )
        })?;
    }
    Ok(())
}

/// A validated object name (see the module's guarantees). The only way to get one is to
/// check a string, so a function that takes a `Name` cannot be handed `..`, `/etc` or
/// `-oProxyCommand=…`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Name(String);

/// A string that is not a valid name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidName(pub String);

impl Name {
    /// A DNS-1123 subdomain (dots allowed: Image and Event names).
    pub fn new(s: &str) -> Result<Name, InvalidName> {
        check_subdomain_name(s).map_err(InvalidName)?;
        Ok(Name(s.to_string()))
    }

    /// A DNS-1123 label (no dots: Vm, Pool, Lease and Grant names).
    pub fn label(s: &str) -> Result<Name, InvalidName> {
        check_label_name(s).map_err(InvalidName)?;
        Ok(Name(s.to_string()))
    }

    /// A name valid for objects of `kind`.
    pub fn for_kind(kind: &KindInfo, s: &str) -> Result<Name, InvalidName> {
        if kind.dotted_names {
            Name::new(s)
        } else {
            Name::label(s)
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name as one path component (never `..`, never absolute, no separator).
    pub fn as_path(&self) -> &Path {
        Path::new(&self.0)
    }

    /// The name, owned.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl Deref for Name {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl AsRef<Path> for Name {
    fn as_ref(&self) -> &Path {
        self.as_path()
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Name {
    type Err = InvalidName;
    /// A subdomain name (what `clap` and serde parse arguments with); a kind whose names are
    /// labels is checked again by [`Name::for_kind`] or by the store.
    fn from_str(s: &str) -> Result<Name, InvalidName> {
        Name::new(s)
    }
}

impl From<&Name> for String {
    fn from(n: &Name) -> String {
        n.0.clone()
    }
}

impl From<Name> for String {
    fn from(n: Name) -> String {
        n.0
    }
}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for Name {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl PartialEq<String> for Name {
    fn eq(&self, other: &String) -> bool {
        &self.0 == other
    }
}

impl serde::Serialize for Name {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Name {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Name, D::Error> {
        let s = String::deserialize(d)?;
        Name::new(&s).map_err(serde::de::Error::custom)
    }
}

impl schemars::JsonSchema for Name {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Name".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "minLength": 1,
            "maxLength": 253,
            "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
            "description": "An object name: lowercase letters, digits and `-` (Image names may also hold dots)."
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_names_are_refused() {
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "/etc",
            "a/b",
            "-oProxyCommand=x",
            "a\0b",
            "a\nb",
            "a b",
            "\u{1b}[31mred",
            "Dev1",
            "dév",
            "a..b",
            ".a",
            "a.",
            &"a".repeat(254),
            &"é".repeat(40),
        ] {
            assert!(Name::new(bad).is_err(), "{bad:?}");
            assert!(Name::label(bad).is_err(), "{bad:?}");
        }
        assert!(Name::label("a.b").is_err());
        assert_eq!(Name::new("a.b").unwrap().as_str(), "a.b");
        let long = Name::label(&"é".repeat(40)).unwrap_err().to_string();
        assert!(long.contains("80 bytes long"), "{long}");
    }

    #[test]
    fn label_keys_and_values() {
        for ok in ["team", "boxery.dev/pool", "a.b-c_d", "x.example/Tier.1"] {
            assert!(check_key(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "/x",
            "a/",
            "-a",
            "a b",
            "a\u{1b}",
            "Bad_Prefix/x",
            "a/b/c",
            &"a".repeat(64),
        ] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
        assert!(check_label_value("").is_ok());
        assert!(check_label_value("web.1").is_ok());
        for bad in ["-x", "a b", "\u{1b}[2J", "é", &"a".repeat(254)] {
            assert!(check_label_value(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn shown_escapes_and_cuts() {
        assert_eq!(shown("a\u{1b}[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(shown(&"é".repeat(50)).chars().count(), SHOWN + 1);
        assert_eq!(shown(&"é".repeat(40)), "é".repeat(40));
        // Escapes count: 40 control characters used to come out as 40 escapes (200 chars).
        let cut = shown(&"\u{1}".repeat(40));
        assert_eq!(cut, format!("{}…", "\\u{1}".repeat(8)));
        assert_eq!(shown("\u{202e}evil"), "\\u{202e}evil");
    }

    #[test]
    fn printable_escapes_only_what_a_terminal_would_act_on() {
        assert_eq!(printable("it's \"ok\" é 名 \\"), "it's \"ok\" é 名 \\");
        assert_eq!(
            printable("a\nb\u{7f}\u{85}\u{202e}"),
            "a\\nb\\u{7f}\\u{85}\\u{202e}"
        );
    }

    #[test]
    fn serde_refuses_bad_names() {
        assert!(serde_json::from_str::<Name>("\"../x\"").is_err());
        assert_eq!(serde_json::from_str::<Name>("\"ok-1\"").unwrap(), "ok-1");
    }
}

//! The keys `key` and `type` may press: one table of names, each with the X keysym `xdotool`
//! presses on a desktop and the QEMU key (`qcode`) the console path sends. A name outside it is
//! refused before anything is sent.
//!
//! Names are the ones agents already use (xdotool's keysyms, as Anthropic's computer-use tool
//! takes them: `Return`, `ctrl+s`, `Page_Down`) and their common spellings (`enter`, `esc`,
//! `cmd`), matched without regard to case except for single letters, where `A` is `shift+a`.

/// One key: its X keysym and its QEMU qcode, with shift held for the qcode where the keysym is
/// a shifted character on a US keyboard (`A`, `!`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    /// The X keysym `xdotool` presses.
    pub keysym: &'static str,
    /// QEMU's name for the key (`input-send-event`'s `qcode`).
    pub qcode: &'static str,
    /// Shift is held for it on the console (a US keyboard's shifted character).
    pub shifted: bool,
    /// It is a modifier (held while the keys after it in a combination are pressed).
    pub modifier: bool,
}

const fn key(keysym: &'static str, qcode: &'static str) -> Key {
    Key {
        keysym,
        qcode,
        shifted: false,
        modifier: false,
    }
}

const fn shifted(keysym: &'static str, qcode: &'static str) -> Key {
    Key {
        keysym,
        qcode,
        shifted: true,
        modifier: false,
    }
}

const fn modifier(keysym: &'static str, qcode: &'static str) -> Key {
    Key {
        keysym,
        qcode,
        shifted: false,
        modifier: true,
    }
}

/// Named keys: (the names accepted, lower case; the key).
const NAMED: &[(&[&str], Key)] = &[
    (
        &["ctrl", "control", "control_l", "ctrl_l"],
        modifier("Control_L", "ctrl"),
    ),
    (&["control_r", "ctrl_r"], modifier("Control_R", "ctrl_r")),
    (&["alt", "alt_l", "option"], modifier("Alt_L", "alt")),
    (&["alt_r", "altgr"], modifier("Alt_R", "alt_r")),
    (&["shift", "shift_l"], modifier("Shift_L", "shift")),
    (&["shift_r"], modifier("Shift_R", "shift_r")),
    (
        &[
            "super", "super_l", "cmd", "command", "meta", "win", "windows",
        ],
        modifier("Super_L", "meta_l"),
    ),
    (
        &["return", "enter", "ret", "kp_enter"],
        key("Return", "ret"),
    ),
    (&["tab"], key("Tab", "tab")),
    (&["escape", "esc"], key("Escape", "esc")),
    (&["backspace"], key("BackSpace", "backspace")),
    (&["delete", "del"], key("Delete", "delete")),
    (&["insert", "ins"], key("Insert", "insert")),
    (&["home"], key("Home", "home")),
    (&["end"], key("End", "end")),
    (
        &["page_up", "pageup", "prior", "pgup"],
        key("Prior", "pgup"),
    ),
    (
        &["page_down", "pagedown", "next", "pgdn"],
        key("Next", "pgdn"),
    ),
    (&["up", "arrowup"], key("Up", "up")),
    (&["down", "arrowdown"], key("Down", "down")),
    (&["left", "arrowleft"], key("Left", "left")),
    (&["right", "arrowright"], key("Right", "right")),
    (&["space", " "], key("space", "spc")),
    (&["menu"], key("Menu", "menu")),
    (&["print", "printscreen"], key("Print", "print")),
    (&["caps_lock", "capslock"], key("Caps_Lock", "caps_lock")),
    (&["f1"], key("F1", "f1")),
    (&["f2"], key("F2", "f2")),
    (&["f3"], key("F3", "f3")),
    (&["f4"], key("F4", "f4")),
    (&["f5"], key("F5", "f5")),
    (&["f6"], key("F6", "f6")),
    (&["f7"], key("F7", "f7")),
    (&["f8"], key("F8", "f8")),
    (&["f9"], key("F9", "f9")),
    (&["f10"], key("F10", "f10")),
    (&["f11"], key("F11", "f11")),
    (&["f12"], key("F12", "f12")),
    // punctuation by its keysym name and as itself, unshifted then shifted (a US keyboard)
    (&["minus", "-"], key("minus", "minus")),
    (&["equal", "="], key("equal", "equal")),
    (&["bracketleft", "["], key("bracketleft", "bracket_left")),
    (&["bracketright", "]"], key("bracketright", "bracket_right")),
    (&["backslash", "\\"], key("backslash", "backslash")),
    (&["semicolon", ";"], key("semicolon", "semicolon")),
    (&["apostrophe", "'"], key("apostrophe", "apostrophe")),
    (&["grave", "`"], key("grave", "grave_accent")),
    (&["comma", ","], key("comma", "comma")),
    (&["period", "."], key("period", "dot")),
    (&["slash", "/"], key("slash", "slash")),
    (&["exclam", "!"], shifted("exclam", "1")),
    (&["at", "@"], shifted("at", "2")),
    (&["numbersign", "#"], shifted("numbersign", "3")),
    (&["dollar", "$"], shifted("dollar", "4")),
    (&["percent", "%"], shifted("percent", "5")),
    (&["asciicircum", "^"], shifted("asciicircum", "6")),
    (&["ampersand", "&"], shifted("ampersand", "7")),
    (&["asterisk", "*"], shifted("asterisk", "8")),
    (&["parenleft", "("], shifted("parenleft", "9")),
    (&["parenright", ")"], shifted("parenright", "0")),
    (&["underscore", "_"], shifted("underscore", "minus")),
    (&["plus"], shifted("plus", "equal")),
    (&["braceleft", "{"], shifted("braceleft", "bracket_left")),
    (&["braceright", "}"], shifted("braceright", "bracket_right")),
    (&["bar", "|"], shifted("bar", "backslash")),
    (&["colon", ":"], shifted("colon", "semicolon")),
    (&["quotedbl", "\""], shifted("quotedbl", "apostrophe")),
    (&["asciitilde", "~"], shifted("asciitilde", "grave_accent")),
    (&["less", "<"], shifted("less", "comma")),
    (&["greater", ">"], shifted("greater", "dot")),
    (&["question", "?"], shifted("question", "slash")),
];

const LOWER: [&str; 26] = [
    "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q", "r", "s",
    "t", "u", "v", "w", "x", "y", "z",
];
const UPPER: [&str; 26] = [
    "A", "B", "C", "D", "E", "F", "G", "H", "I", "J", "K", "L", "M", "N", "O", "P", "Q", "R", "S",
    "T", "U", "V", "W", "X", "Y", "Z",
];
const DIGITS: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];

/// The key named `name`, if there is one.
pub fn lookup(name: &str) -> Option<Key> {
    if let [c] = name.as_bytes() {
        let c = *c;
        if c.is_ascii_lowercase() {
            let l = LOWER[(c - b'a') as usize];
            return Some(key(l, l));
        }
        if c.is_ascii_uppercase() {
            let i = (c - b'A') as usize;
            return Some(shifted(UPPER[i], LOWER[i]));
        }
        if c.is_ascii_digit() {
            let d = DIGITS[(c - b'0') as usize];
            return Some(key(d, d));
        }
    }
    let lower = name.to_ascii_lowercase();
    NAMED
        .iter()
        .find(|(names, _)| names.contains(&lower.as_str()))
        .map(|(_, k)| *k)
}

/// The key a character of typed text is on the console's US keyboard (`\n` is Return, `\t`
/// Tab); `None` for a character it has no key for.
pub fn of_char(c: char) -> Option<Key> {
    match c {
        '\n' => lookup("Return"),
        '\t' => lookup("Tab"),
        ' ' => lookup("space"),
        '+' => lookup("plus"),
        c if c.is_ascii_graphic() => lookup(c.encode_utf8(&mut [0; 4])),
        _ => None,
    }
}

/// Some names, for messages.
pub const EXAMPLES: &str = "Return, Tab, Escape, BackSpace, Delete, Home, End, Page_Up, Page_Down, Up, Down, Left, Right, space, F1…F12, a letter, a digit, a punctuation character or its keysym name (minus, slash), and modifiers ctrl, alt, shift, super joined with + (ctrl+s, ctrl+shift+t)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_found_and_lowercase_in_the_table() {
        for (names, k) in NAMED {
            for n in *names {
                assert_eq!(*n, n.to_ascii_lowercase(), "{n}");
                assert_eq!(lookup(n), Some(*k), "{n}");
            }
        }
        assert_eq!(lookup("Return").unwrap().qcode, "ret");
        assert_eq!(lookup("ENTER").unwrap().keysym, "Return");
        assert!(lookup("ctrl").unwrap().modifier);
    }

    #[test]
    fn letters_keep_their_case_and_unknown_names_are_none() {
        assert_eq!(lookup("a"), Some(key("a", "a")));
        assert_eq!(lookup("A"), Some(shifted("A", "a")));
        assert_eq!(lookup("7").unwrap().qcode, "7");
        for bad in ["", "Foo", "ctrl+s", "é", "F13", "a b", "\u{1b}"] {
            assert_eq!(lookup(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn every_printable_ascii_character_has_a_console_key() {
        for c in (0x20u8..0x7f).map(char::from).chain(['\n', '\t']) {
            assert!(of_char(c).is_some(), "{c:?}");
        }
        assert_eq!(of_char('é'), None);
        assert_eq!(of_char('\u{7}'), None);
        let plus = of_char('+').unwrap();
        assert!(plus.shifted && plus.qcode == "equal");
    }
}

//! A VM's screen as both QEMU drivers reach it ([`crate::Backend::screendump`],
//! [`crate::Backend::send_input`]): the picture read back as PNG (and its size from the PNG's
//! header), and input events in the shape of QMP's `input-send-event`, which the qemu backend
//! sends on its own QMP socket and the libvirt backend through libvirt's monitor passthrough.
//!
//! # Guarantees
//! - A pointer position is scaled as QEMU's own display front ends scale it (VNC, GTK:
//!   `qemu_input_scale_axis`): pixel `p` of an axis `len` pixels long is `p * 0x7fff / len`,
//!   so the last pixel (`len - 1`) stays below `0x7fff` and the guest's tablet driver maps it
//!   back to the same pixel.
//! - A batch with a position outside the screen, or a key name that cannot be one, is
//!   refused whole (`Invalid`) before anything reaches the guest.
//!
//! # Caveats
//! - A long batch goes to QEMU in several commands ([`CHUNK`]); QEMU refuses a command with a
//!   key name it does not know, after the commands before it were sent (the error says how
//!   many events were).
//!
//! # Assumptions
//! - The size a pointer position is scaled by is the screen's as the last screendump showed it
//!   ([`Sizes`]): the position is a pixel of a picture the caller saw. No QMP command reports a
//!   console's size, so a batch with a position and no screendump yet in this process (for
//!   this run of the VM) takes one first, to learn it.

use std::collections::HashMap;
use std::io::Cursor;
use std::sync::Mutex;

use serde_json::{Value, json};

use crate::{BackendError, InputEvent, PointerButton, Result, Screen};

/// QEMU's largest absolute axis value (`INPUT_EVENT_ABS_MAX`); an axis runs from 0 to it.
pub const ABS_MAX: u32 = 0x7fff;

/// At most this many events go to QEMU in one `input-send-event` ([`chunks`]).
pub const CHUNK: usize = 32;

/// At most this many key events go to QEMU in one `input-send-event`. QEMU hands a command's
/// events to its devices at once, while the guest cannot run; its PS/2 keyboard queues 16
/// bytes of scancodes and drops what does not fit, and a key takes 1 to 3 bytes a press or a
/// release (a press and release of `a`: 3; of an arrow key: 5). Six key events fit; a batch
/// typed as one command loses its keys after the first five or so.
pub const KEYS_PER_COMMAND: usize = 6;

/// The pause between two commands of one batch ([`chunks`]), for the guest to read its
/// keyboard.
pub const CHUNK_PAUSE: std::time::Duration = std::time::Duration::from_millis(20);

/// QEMU's absolute axis value for pixel `p` of an axis `len` pixels long (QEMU's own scaling:
/// `p * 0x7fff / len`, rounded down).
pub fn abs_axis(p: u32, len: u32) -> u32 {
    (u64::from(p) * u64::from(ABS_MAX) / u64::from(len.max(1))) as u32
}

/// Whether `events` move the pointer, so need the screen's size.
pub fn needs_size(events: &[InputEvent]) -> bool {
    events.iter().any(|e| matches!(e, InputEvent::Move { .. }))
}

/// Whether `qcode` can be a QEMU key name (`a`, `ret`, `shift_r`, `kp_add`): 1–32 of
/// `a-z 0-9 _`. QEMU itself refuses a name it does not know.
fn plausible_qcode(qcode: &str) -> bool {
    (1..=32).contains(&qcode.len())
        && qcode
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

fn button_name(b: PointerButton) -> &'static str {
    match b {
        PointerButton::Left => "left",
        PointerButton::Middle => "middle",
        PointerButton::Right => "right",
        PointerButton::WheelUp => "wheel-up",
        PointerButton::WheelDown => "wheel-down",
        PointerButton::WheelLeft => "wheel-left",
        PointerButton::WheelRight => "wheel-right",
    }
}

/// `events` as QMP's `InputEvent` objects for VM `vm`, on a screen of `size` (width, height;
/// needed when a pointer moves, [`needs_size`]). A move is two `abs` events (x, then y).
/// `Invalid` when a position lies outside the screen or a key name cannot be one.
pub fn qmp_events(vm: &str, events: &[InputEvent], size: Option<(u32, u32)>) -> Result<Vec<Value>> {
    let mut out = Vec::with_capacity(events.len() + 1);
    for e in events {
        match e {
            InputEvent::Key { qcode, down } => {
                if !plausible_qcode(qcode) {
                    return Err(BackendError::Invalid(format!(
                        "`{qcode}` is not a QEMU key name (qcode: `a`, `ret`, `shift`, `f1`, …); nothing was sent to VM {vm}"
                    )));
                }
                out.push(json!({
                    "type": "key",
                    "data": {"down": down, "key": {"type": "qcode", "data": qcode}},
                }));
            }
            InputEvent::Move { x, y } => {
                let Some((w, h)) = size.filter(|(w, h)| *w > 0 && *h > 0) else {
                    return Err(BackendError::Invalid(format!(
                        "the size of VM {vm}'s screen is not known, so a pointer position cannot be placed on it; nothing was sent"
                    )));
                };
                if *x >= w || *y >= h {
                    return Err(BackendError::Invalid(format!(
                        "pointer position ({x}, {y}) is outside VM {vm}'s screen of {w}x{h} pixels (0..{} and 0..{}); nothing was sent",
                        w - 1,
                        h - 1
                    )));
                }
                out.push(json!({"type": "abs", "data": {"axis": "x", "value": abs_axis(*x, w)}}));
                out.push(json!({"type": "abs", "data": {"axis": "y", "value": abs_axis(*y, h)}}));
            }
            InputEvent::Button { button, down } => {
                out.push(json!({
                    "type": "btn",
                    "data": {"down": down, "button": button_name(*button)},
                }));
            }
        }
    }
    Ok(out)
}

/// What QEMU's refusal `desc` of one of `total` events' commands means, `sent` events having
/// gone before: the guest paused (a snapshot, a suspend under way: `Failed`, retry), else a
/// batch it can never take (a key name it does not know: `Invalid`).
pub fn refused(vm: &str, desc: &str, sent: usize, total: usize) -> BackendError {
    if desc == "VM not running" {
        return BackendError::failed(
            format!("send input to VM {vm}"),
            format!(
                "its guest is paused (a snapshot or a suspend under way): retry ({sent} of {total} QEMU events were sent)"
            ),
        );
    }
    BackendError::Invalid(format!(
        "QEMU refused the input for VM {vm}: {desc} ({sent} of its {total} QEMU events were sent before)"
    ))
}

/// `events` (QMP's, [`qmp_events`]) cut into the commands that carry them: at most [`CHUNK`]
/// events and [`KEYS_PER_COMMAND`] key events each; a move's two halves stay in one command.
pub fn chunks(events: &[Value]) -> Vec<&[Value]> {
    let mut out = Vec::new();
    let (mut start, mut keys) = (0, 0);
    for (i, e) in events.iter().enumerate() {
        let key = e["type"] == "key";
        let y_of_move = e["type"] == "abs" && e["data"]["axis"] == "y";
        let full = i - start >= CHUNK || (key && keys >= KEYS_PER_COMMAND);
        if full && !y_of_move {
            out.push(&events[start..i]);
            (start, keys) = (i, 0);
        }
        keys += usize::from(key);
    }
    if start < events.len() {
        out.push(&events[start..]);
    }
    out
}

/// A screen from PNG bytes: its size from the PNG's header. `Failed` (`step`) when they are
/// not a PNG.
pub fn from_png(png: Vec<u8>, step: &str) -> Result<Screen> {
    let (width, height) =
        image::ImageReader::with_format(Cursor::new(&png), image::ImageFormat::Png)
            .into_dimensions()
            .map_err(|e| BackendError::failed(step, e))?;
    Ok(Screen { png, width, height })
}

/// A screen from a picture in `mime` (`image/png`, or the PPM `image/x-portable-pixmap`
/// libvirt gives where QEMU or libvirt predates PNG screendumps), as PNG.
pub fn from_picture(bytes: Vec<u8>, mime: &str, step: &str) -> Result<Screen> {
    if mime == "image/png" || bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        return from_png(bytes, step);
    }
    let picture = image::load_from_memory_with_format(&bytes, image::ImageFormat::Pnm)
        .map_err(|e| BackendError::failed(step, format!("a {mime} picture: {e}")))?;
    let mut png = Vec::new();
    picture
        .write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
        .map_err(|e| BackendError::failed(step, e))?;
    Ok(Screen {
        png,
        width: picture.width(),
        height: picture.height(),
    })
}

/// The size of each VM's screen as its last screendump in this process showed it, by VM and
/// by run of it (a QEMU's PID, a domain's id: a VM started again may show another size).
#[derive(Debug, Default)]
pub struct Sizes(Mutex<HashMap<String, (u64, u32, u32)>>);

impl Sizes {
    /// VM `vm`'s screen size in its run `run`, when a screendump of that run showed it.
    pub fn get(&self, vm: &str, run: u64) -> Option<(u32, u32)> {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.get(vm)
            .filter(|(r, _, _)| *r == run)
            .map(|(_, w, h)| (*w, *h))
    }

    /// Remember what a screendump of VM `vm`'s run `run` showed.
    pub fn set(&self, vm: &str, run: u64, screen: &Screen) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.insert(vm.to_string(), (run, screen.width, screen.height));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(q: &str, down: bool) -> InputEvent {
        InputEvent::Key {
            qcode: q.into(),
            down,
        }
    }

    #[test]
    fn keys_are_qcodes_with_down_and_up() {
        let v = qmp_events("dev1", &[key("a", true), key("a", false)], None).unwrap();
        assert_eq!(
            Value::Array(v),
            json!([
                {"type": "key", "data": {"down": true, "key": {"type": "qcode", "data": "a"}}},
                {"type": "key", "data": {"down": false, "key": {"type": "qcode", "data": "a"}}},
            ])
        );
        for bad in ["", "A", "a b", "\"}", &"x".repeat(33)] {
            let e = qmp_events("dev1", &[key("b", true), key(bad, true)], None).unwrap_err();
            assert!(
                matches!(&e, BackendError::Invalid(m) if m.contains("nothing was sent")),
                "{e}"
            );
        }
    }

    #[test]
    fn buttons_and_the_wheel_are_btn_events() {
        let ev = |button, down| InputEvent::Button { button, down };
        let v = qmp_events(
            "dev1",
            &[
                ev(PointerButton::Left, true),
                ev(PointerButton::Left, false),
                ev(PointerButton::Middle, true),
                ev(PointerButton::Right, false),
                ev(PointerButton::WheelUp, true),
                ev(PointerButton::WheelDown, false),
                ev(PointerButton::WheelLeft, true),
                ev(PointerButton::WheelRight, true),
            ],
            None,
        )
        .unwrap();
        let names: Vec<(&str, bool)> = v
            .iter()
            .map(|e| {
                assert_eq!(e["type"], "btn");
                (
                    e["data"]["button"].as_str().unwrap(),
                    e["data"]["down"].as_bool().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            names,
            [
                ("left", true),
                ("left", false),
                ("middle", true),
                ("right", false),
                ("wheel-up", true),
                ("wheel-down", false),
                ("wheel-left", true),
                ("wheel-right", true)
            ]
        );
    }

    #[test]
    fn positions_scale_to_qemus_axis_and_stay_inside_it() {
        let mv = |x, y| InputEvent::Move { x, y };
        let v = qmp_events(
            "dev1",
            &[mv(0, 0), mv(719, 399), mv(360, 200)],
            Some((720, 400)),
        )
        .unwrap();
        assert_eq!(
            v[0],
            json!({"type": "abs", "data": {"axis": "x", "value": 0}})
        );
        assert_eq!(
            v[1],
            json!({"type": "abs", "data": {"axis": "y", "value": 0}})
        );
        let (x, y) = (
            v[2]["data"]["value"].as_u64().unwrap(),
            v[3]["data"]["value"].as_u64().unwrap(),
        );
        assert!(x <= u64::from(ABS_MAX) && y <= u64::from(ABS_MAX));
        assert_eq!((x, y), (719 * 0x7fff / 720, 399 * 0x7fff / 400));
        // the middle pixel is the middle of the axis
        assert_eq!(v[4]["data"]["value"], 0x7fff / 2);
        // every last pixel of any size stays inside the axis, and the guest's inverse
        // (value * len / 0x7fff) gives the pixel back
        for len in [
            1u32,
            2,
            3,
            400,
            720,
            1024,
            1080,
            4096,
            32767,
            32768,
            65535,
            u32::MAX,
        ] {
            for p in [0, len / 2, len - 1] {
                let a = abs_axis(p, len);
                assert!(a <= ABS_MAX, "{p} of {len}: {a}");
                if len <= ABS_MAX + 1 {
                    let back = (u64::from(a) * u64::from(len)).div_ceil(u64::from(ABS_MAX));
                    assert!(
                        back.abs_diff(u64::from(p)) <= 1,
                        "{p} of {len}: {a} → {back}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_position_off_the_screen_or_without_a_size_is_refused_whole() {
        let mv = |x, y| InputEvent::Move { x, y };
        for e in [mv(720, 0), mv(0, 400), mv(u32::MAX, u32::MAX)] {
            let err = qmp_events("dev1", &[key("a", true), e], Some((720, 400))).unwrap_err();
            assert!(
                matches!(&err, BackendError::Invalid(m) if m.contains("720x400")),
                "{err}"
            );
        }
        let err = qmp_events("dev1", &[mv(1, 1)], None).unwrap_err();
        assert!(matches!(err, BackendError::Invalid(_)), "{err}");
        assert!(qmp_events("dev1", &[mv(1, 1)], Some((0, 0))).is_err());
        assert!(needs_size(&[key("a", true), mv(1, 1)]));
        assert!(!needs_size(&[key("a", true)]));
    }

    #[test]
    fn long_batches_are_cut_but_never_inside_a_move() {
        let mv = InputEvent::Move { x: 1, y: 1 };
        let click = InputEvent::Button {
            button: PointerButton::Left,
            down: true,
        };
        // pointer events only: CHUNK a command, the move's y kept with its x
        let mut events = vec![click.clone(); CHUNK - 1];
        events.push(mv.clone());
        events.extend(vec![click.clone(); 2 * CHUNK]);
        let v = qmp_events("dev1", &events, Some((10, 10))).unwrap();
        let cut = chunks(&v);
        assert_eq!(cut.concat(), v);
        assert_eq!(cut[0].len(), CHUNK + 1, "the move's y stays with its x");
        assert_eq!(cut[0].last().unwrap()["data"]["axis"], "y");
        assert!(cut.iter().all(|c| !c.is_empty() && c.len() <= CHUNK + 1));
        // keys: KEYS_PER_COMMAND a command, whatever else is between them
        let mut events = Vec::new();
        for _ in 0..20 {
            events.extend([key("a", true), click.clone(), key("a", false)]);
        }
        let v = qmp_events("dev1", &events, None).unwrap();
        let cut = chunks(&v);
        assert_eq!(cut.concat(), v);
        for c in &cut {
            let keys = c.iter().filter(|e| e["type"] == "key").count();
            assert!((1..=KEYS_PER_COMMAND).contains(&keys), "{c:?}");
        }
        assert_eq!(cut.len(), 40usize.div_ceil(KEYS_PER_COMMAND));
        assert!(chunks(&[]).is_empty());
        let one = qmp_events("dev1", &[key("a", true)], None).unwrap();
        assert_eq!(chunks(&one), [&one[..]]);
    }

    #[test]
    fn a_paused_guest_is_retried_an_unknown_key_is_not() {
        assert!(!refused("a", "VM not running", 0, 2).is_terminal());
        let e = refused(
            "a",
            "Parameter 'data' does not accept value 'nosuchkey'",
            6,
            8,
        );
        assert!(
            matches!(&e, BackendError::Invalid(m) if m.contains("nosuchkey") && m.contains("6 of its 8")),
            "{e}"
        );
    }

    #[test]
    fn pictures_become_png_with_their_size() {
        // a 3x2 PPM (P6), as libvirt hands one over
        let mut ppm = b"P6\n3 2\n255\n".to_vec();
        ppm.extend((0..18).map(|i| (i * 13) as u8));
        let s = from_picture(ppm, "image/x-portable-pixmap", "read").unwrap();
        assert_eq!((s.width, s.height), (3, 2));
        assert!(s.png.starts_with(b"\x89PNG"));
        let again = from_png(s.png.clone(), "read").unwrap();
        assert_eq!(again, s);
        let e = from_png(b"P6\n1 1\n255\nabc".to_vec(), "read the screendump").unwrap_err();
        assert!(matches!(&e, BackendError::Failed { step, .. } if step == "read the screendump"));
        assert!(from_picture(b"nonsense".to_vec(), "image/x-portable-pixmap", "read").is_err());
    }

    #[test]
    fn sizes_belong_to_one_run() {
        let s = Sizes::default();
        let screen = Screen {
            png: vec![],
            width: 720,
            height: 400,
        };
        assert_eq!(s.get("a", 7), None);
        s.set("a", 7, &screen);
        assert_eq!(s.get("a", 7), Some((720, 400)));
        assert_eq!(s.get("a", 8), None, "another run of the VM");
        assert_eq!(s.get("b", 7), None);
    }
}

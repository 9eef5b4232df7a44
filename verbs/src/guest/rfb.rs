//! A VNC viewer that may only watch: the client's half of an RFB stream (RFC 6143, and the
//! extensions noVNC and QEMU speak) read message by message, passing on what asks for
//! pictures and dropping what would reach the machine (keys, the pointer, the clipboard, a
//! new screen size, power actions). For a VNC server that has no view-only mode of its own
//! (QEMU's); the guest desktop's x11vnc is started `-viewonly` instead.
//!
//! # Guarantees
//! - Nothing is passed on before its whole message is known; a message of a type not listed
//!   here, a version or security type not expected, or a length past the limits is an error,
//!   and the connection is to be closed (never passed on to stay in step).
//! - The client is made to ask for a shared session, so a watcher cannot disconnect others.

/// What a viewer's stream is at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// The client's `RFB 003.00x\n`.
    Version,
    /// Its choice of security type (RFB 3.7 and 3.8).
    Security,
    /// Its ClientInit (the shared flag).
    Init,
    /// Client messages.
    Messages,
}

/// The longest clipboard text a client may send (dropped, but read through).
pub const MAX_CUT_TEXT: usize = 16 << 20;
/// The most bytes kept waiting for the rest of a message.
const MAX_PENDING: usize = 64 << 10;

/// What the next bytes are.
#[derive(Debug, PartialEq, Eq)]
enum Unit {
    /// Not all there yet.
    Need,
    /// A whole message (or handshake step) of this many bytes, passed on as it is.
    Pass(usize),
    /// A whole message of this many bytes, passed on as these bytes instead.
    Replace(usize, Vec<u8>),
    /// A message dropped: this many bytes at hand, and this many more to come.
    Drop(usize, usize),
}

/// The filter of one viewer's stream.
#[derive(Debug)]
pub struct ViewOnly {
    stage: Stage,
    pending: Vec<u8>,
    /// Bytes of a dropped message still to come.
    skip: usize,
}

impl Default for ViewOnly {
    fn default() -> Self {
        ViewOnly {
            stage: Stage::Version,
            pending: Vec::new(),
            skip: 0,
        }
    }
}

fn be16(b: &[u8], at: usize) -> usize {
    usize::from(u16::from_be_bytes([b[at], b[at + 1]]))
}

/// What of `input` (a viewer's next bytes) goes on to the server: all of it without a
/// filter (a viewer with control, or a server that filters for itself), else what `filter`
/// passes. An error: close the connection ([`ViewOnly::feed`]).
pub fn pass<'a>(
    filter: &mut Option<ViewOnly>,
    input: &'a [u8],
) -> Result<std::borrow::Cow<'a, [u8]>, String> {
    match filter {
        None => Ok(std::borrow::Cow::Borrowed(input)),
        Some(f) => f.feed(input).map(std::borrow::Cow::Owned),
    }
}

impl ViewOnly {
    /// The part of `input` (what the client sent next) to pass on to the server. An error:
    /// the stream is not one a watcher may send; close the connection.
    pub fn feed(&mut self, input: &[u8]) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        let skipped = self.skip.min(input.len());
        self.skip -= skipped;
        self.pending.extend_from_slice(&input[skipped..]);
        let mut at = 0;
        while self.skip == 0 {
            match next(&mut self.stage, &self.pending[at..])? {
                Unit::Need => break,
                Unit::Pass(n) => {
                    out.extend_from_slice(&self.pending[at..at + n]);
                    at += n;
                }
                Unit::Replace(n, with) => {
                    out.extend_from_slice(&with);
                    at += n;
                }
                Unit::Drop(here, more) => {
                    at += here;
                    self.skip = more;
                }
            }
        }
        self.pending.drain(..at);
        if self.pending.len() > MAX_PENDING {
            return Err("a viewer's message is too long".into());
        }
        Ok(out)
    }
}

/// The next unit of `b` (the bytes at hand), advancing the handshake's `stage`.
fn next(stage: &mut Stage, b: &[u8]) -> Result<Unit, String> {
    let whole = |n: usize| if b.len() >= n { Some(n) } else { None };
    match *stage {
        Stage::Version => {
            let Some(n) = whole(12) else {
                return Ok(Unit::Need);
            };
            *stage = match &b[..n] {
                b"RFB 003.008\n" | b"RFB 003.007\n" => Stage::Security,
                b"RFB 003.003\n" => Stage::Init,
                other => {
                    return Err(format!(
                        "a viewer asked for RFB version {:?}",
                        String::from_utf8_lossy(other).trim_end()
                    ));
                }
            };
            Ok(Unit::Pass(n))
        }
        Stage::Security => {
            let Some(&t) = b.first() else {
                return Ok(Unit::Need);
            };
            if t != 1 {
                return Err(format!("a viewer chose security type {t}, not None (1)"));
            }
            *stage = Stage::Init;
            Ok(Unit::Pass(1))
        }
        Stage::Init => {
            if b.is_empty() {
                return Ok(Unit::Need);
            }
            *stage = Stage::Messages;
            Ok(Unit::Replace(1, vec![1])) // shared
        }
        Stage::Messages => message(b),
    }
}

/// The next client message of `b`: passed when it asks for pictures, dropped when it would
/// reach the machine.
fn message(b: &[u8]) -> Result<Unit, String> {
    let Some(&kind) = b.first() else {
        return Ok(Unit::Need);
    };
    // (the length of a message whose header of `head` bytes says it, once that is at hand)
    let sized = |head: usize, len: fn(&[u8]) -> usize| (b.len() >= head).then(|| len(b));
    let (len, pass) = match kind {
        0 => (Some(20), true),                                    // SetPixelFormat
        2 => (sized(4, |b| 4 + 4 * be16(b, 2)), true),            // SetEncodings
        3 => (Some(10), true),                                    // FramebufferUpdateRequest
        4 => (Some(8), false),                                    // KeyEvent
        5 => (Some(6), false),                                    // PointerEvent
        150 => (Some(10), true),                                  // EnableContinuousUpdates
        248 => (sized(9, |b| 9 + usize::from(b[8])), true),       // ClientFence
        250 => (Some(4), false),                                  // xvp (shutdown, reboot, reset)
        251 => (sized(8, |b| 8 + 16 * usize::from(b[6])), false), // SetDesktopSize
        6 => {
            // ClientCutText (a negative length: the extended clipboard's)
            if b.len() < 8 {
                return Ok(Unit::Need);
            }
            let n = i32::from_be_bytes([b[4], b[5], b[6], b[7]]).unsigned_abs() as usize;
            if n > MAX_CUT_TEXT {
                return Err(format!("a viewer sent {n} bytes of clipboard text"));
            }
            let total = 8 + n;
            return Ok(Unit::Drop(
                total.min(b.len()),
                total.saturating_sub(b.len()),
            ));
        }
        255 => {
            // QEMU's: an extended key event, or audio
            let Some(&sub) = b.get(1) else {
                return Ok(Unit::Need);
            };
            let len = match sub {
                0 => Some(12),
                1 => match b.get(2..4) {
                    None => None,
                    Some(_) if be16(b, 2) <= 1 => Some(4),
                    Some(_) if be16(b, 2) == 2 => Some(10),
                    Some(_) => return Err("a viewer sent an unknown QEMU audio message".into()),
                },
                other => return Err(format!("a viewer sent QEMU message {other}")),
            };
            (len, false)
        }
        other => return Err(format!("a viewer sent RFB message type {other}")),
    };
    Ok(match len {
        Some(n) if b.len() >= n => {
            if pass {
                Unit::Pass(n)
            } else {
                Unit::Drop(n, 0)
            }
        }
        _ => Unit::Need,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client's handshake (RFB 3.8, security None, not shared) and then `msgs`.
    fn stream(msgs: &[&[u8]]) -> Vec<u8> {
        let mut s = b"RFB 003.008\n\x01\x00".to_vec();
        for m in msgs {
            s.extend_from_slice(m);
        }
        s
    }

    const PIXEL_FORMAT: &[u8] = &[
        0, 0, 0, 0, 32, 24, 0, 1, 0, 255, 0, 255, 0, 255, 16, 8, 0, 0, 0, 0,
    ];
    const ENCODINGS: &[u8] = &[2, 0, 0, 2, 0, 0, 0, 7, 0xff, 0xff, 0xfe, 0xfe];
    const UPDATE: &[u8] = &[3, 0, 0, 0, 0, 0, 2, 208, 1, 144];
    const KEY: &[u8] = &[4, 1, 0, 0, 0, 0, 0, 0x61];
    const POINTER: &[u8] = &[5, 1, 0, 10, 0, 20];
    const QEMU_KEY: &[u8] = &[255, 0, 0, 1, 0, 0, 0, 0x61, 0, 0, 0, 0x1e];
    const FENCE: &[u8] = &[248, 0, 0, 0, 0, 0, 0, 3, 2, 9, 9];

    #[test]
    fn without_a_filter_everything_passes_and_with_one_input_is_dropped() {
        let input = stream(&[KEY]);
        assert_eq!(&*pass(&mut None, &input).unwrap(), &input[..]);
        let mut f = Some(ViewOnly::default());
        // the handshake passes (a shared session asked for), the key does not
        assert_eq!(&*pass(&mut f, &input).unwrap(), b"RFB 003.008\n\x01\x01");
    }

    #[test]
    fn pictures_pass_and_input_is_dropped() {
        let mut f = ViewOnly::default();
        let out = f
            .feed(&stream(&[
                PIXEL_FORMAT,
                KEY,
                ENCODINGS,
                POINTER,
                UPDATE,
                QEMU_KEY,
                FENCE,
                &[250, 0, 1, 2], // xvp: a shutdown
                &[
                    251, 0, 4, 0, 3, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 3, 0, 0, 0, 0, 0,
                ],
                &[255, 1, 0, 0], // QEMU audio: enable
                UPDATE,
            ]))
            .unwrap();
        // the handshake (shared asked for), then only what asks for pictures
        let want = [
            &b"RFB 003.008\n\x01\x01"[..],
            PIXEL_FORMAT,
            ENCODINGS,
            UPDATE,
            FENCE,
            UPDATE,
        ]
        .concat();
        assert_eq!(out, want);
    }

    #[test]
    fn a_stream_cut_anywhere_gives_the_same() {
        let all = stream(&[
            KEY,
            PIXEL_FORMAT,
            POINTER,
            ENCODINGS,
            UPDATE,
            QEMU_KEY,
            FENCE,
        ]);
        let whole = ViewOnly::default().feed(&all).unwrap();
        for chunk in 1..all.len() {
            let mut f = ViewOnly::default();
            let mut out = Vec::new();
            for c in all.chunks(chunk) {
                out.extend(f.feed(c).unwrap());
            }
            assert_eq!(out, whole, "in chunks of {chunk}");
        }
    }

    #[test]
    fn clipboard_text_is_read_through_and_dropped() {
        let mut cut = vec![6, 0, 0, 0, 0, 0, 0x10, 0]; // 4096 bytes
        cut.extend(std::iter::repeat_n(b'x', 4096));
        let mut f = ViewOnly::default();
        let all = stream(&[&cut, UPDATE]);
        let mut out = Vec::new();
        for c in all.chunks(100) {
            out.extend(f.feed(c).unwrap());
        }
        assert_eq!(out, [&b"RFB 003.008\n\x01\x01"[..], UPDATE].concat());
        // the extended clipboard's negative length
        let mut f = ViewOnly::default();
        let ext = [6, 0, 0, 0, 0xff, 0xff, 0xff, 0xfc, 1, 2, 3, 4];
        let out = f.feed(&stream(&[&ext, UPDATE])).unwrap();
        assert!(out.ends_with(UPDATE) && out.len() == 14 + UPDATE.len());
        // past the limit
        let huge = [6, 0, 0, 0, 0x7f, 0xff, 0xff, 0xff];
        assert!(ViewOnly::default().feed(&stream(&[&huge])).is_err());
    }

    #[test]
    fn anything_else_ends_the_stream() {
        for bad in [
            &b"RFB 004.000\n"[..],
            &b"RFB 003.008\n\x02"[..],       // VNC authentication
            &stream(&[&[7, 0, 0, 0]])[..],   // an unknown type
            &stream(&[&[255, 9, 0, 0]])[..], // an unknown QEMU message
            &stream(&[&[255, 1, 0, 7]])[..], // an unknown audio message
        ] {
            assert!(ViewOnly::default().feed(bad).is_err(), "{bad:?}");
        }
        // RFB 3.3: no security choice from the client
        let mut f = ViewOnly::default();
        let out = f.feed(b"RFB 003.003\n\x00").unwrap();
        assert_eq!(out, b"RFB 003.003\n\x01");
        // a message whose rest never comes is held, up to a limit
        let mut f = ViewOnly::default();
        let mut encodings = vec![2, 0, 0xff, 0xff];
        encodings.extend(std::iter::repeat_n(0, 60_000));
        assert_eq!(f.feed(&stream(&[&encodings])).unwrap().len(), 14);
        assert!(f.feed(&[0; 10_000]).is_err(), "held past the limit");
    }
}

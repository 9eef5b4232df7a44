//! The desktop's screen as the guest's X server keeps it: Xvfb's `-fbdir` framebuffer, an
//! XWD file (X Window Dump: a header of 32-bit fields, the window's name, a colour map, then
//! the pixels). Read here on the host, so the guest runs no screenshot tool: it only `cat`s
//! the file.
//!
//! Guarantees: the guest writes these bytes, so every field is checked before it is used (the
//! format, a true-colour visual, sizes within [`MAX_SIDE`], rows that fit the data); a file
//! that fails a check is an error that says so, never a panic or a read out of bounds.

use crate::{Result, VerbError};

/// The largest width or height read.
pub const MAX_SIDE: u32 = 8192;

/// A picture: `width × height` pixels of 8-bit RGB, row by row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rgb {
    /// Pixels across.
    pub width: u32,
    /// Pixels down.
    pub height: u32,
    /// `width * height * 3` bytes.
    pub pixels: Vec<u8>,
}

fn bad(why: impl std::fmt::Display) -> VerbError {
    VerbError::failed(format!(
        "the guest's screen is not a picture boxery can read ({why}): is its desktop the one the desktop layer installs?"
    ))
}

/// The header's 25 fields, in file order.
const FIELDS: usize = 25;
const HEADER_SIZE: usize = 0;
const VERSION: usize = 1;
const FORMAT: usize = 2;
const WIDTH: usize = 4;
const HEIGHT: usize = 5;
const BYTE_ORDER: usize = 7;
const BITS_PER_PIXEL: usize = 11;
const BYTES_PER_LINE: usize = 12;
const VISUAL_CLASS: usize = 13;
const RED_MASK: usize = 14;
const GREEN_MASK: usize = 15;
const BLUE_MASK: usize = 16;
const NCOLORS: usize = 19;
/// XWD's version 7, `ZPixmap`, `TrueColor`/`DirectColor`.
const XWD_VERSION: u32 = 7;
const ZPIXMAP: u32 = 2;
const TRUE_COLOR: u32 = 4;
const DIRECT_COLOR: u32 = 5;
/// One colour map entry's bytes (what follows the header and is skipped: true colour).
const COLOR_ENTRY: usize = 12;

/// `data` gunzipped, at most `cap` bytes of it (a guest's bomb is cut there, and then is not
/// a whole picture).
pub fn gunzip(data: &[u8], cap: usize) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data)
        .take(cap as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| bad(format!("not gzip: {e}")))?;
    if out.len() > cap {
        return Err(bad(format!("over {cap} bytes")));
    }
    Ok(out)
}

/// At most the first `n` bytes of gzipped `data` (fewer, and no error, when it is shorter or
/// broken): enough to tell an [`unwritten`] file without inflating the rest.
pub fn gunzip_head(data: &[u8], n: usize) -> Vec<u8> {
    use std::io::Read;
    let mut out = Vec::with_capacity(n);
    let _ = flate2::read::GzDecoder::new(data)
        .take(n as u64)
        .read_to_end(&mut out);
    out
}

/// The bytes of the header's fields: what [`size`] reads.
pub const HEADER: usize = FIELDS * 4;

/// Whether `data` is a framebuffer file Xvfb has made but not yet finished its header in:
/// worth another read. Xvfb fills a new file with zeros, writes the header's fields in the
/// host's byte order, then swaps them one by one to big-endian, all in the mapped file, and
/// its display's socket is up before that ends (at start, and at each restart for a new
/// `spec.display`). So a read may see zeros, or a header part swapped ([`in_one_order`]).
pub fn unwritten(data: &[u8]) -> bool {
    if data.len() < HEADER || data[..8].iter().all(|b| *b == 0) {
        return true;
    }
    let xwd = [true, false]
        .into_iter()
        .any(|big| read_field(data, VERSION, big) == XWD_VERSION);
    xwd && !in_one_order(data)
}

/// Whether a header's fields (at least [`HEADER`] bytes) all read in the byte order its
/// version reads in. Every field but the colour masks is under 2^16 in an Xvfb header (sizes
/// within [`MAX_SIDE`], small enums, offsets of 0), and a nonzero value under 2^16 read in
/// the other order is at least 2^16: a field still in the other order shows.
fn in_one_order(data: &[u8]) -> bool {
    let big = read_field(data, VERSION, true) == XWD_VERSION;
    (0..FIELDS)
        .filter(|i| ![RED_MASK, GREEN_MASK, BLUE_MASK].contains(i))
        .all(|i| read_field(data, i, big) < 1 << 16)
}

/// Field `i` of a header (at least [`HEADER`] bytes), big- or little-endian.
fn read_field(data: &[u8], i: usize, big: bool) -> u32 {
    let b: [u8; 4] = data[i * 4..i * 4 + 4].try_into().expect("four bytes");
    if big {
        u32::from_be_bytes(b)
    } else {
        u32::from_le_bytes(b)
    }
}

/// The screen's size from the start of its XWD file (at least [`HEADER`] bytes).
pub fn size(data: &[u8]) -> Result<(u32, u32)> {
    let (f, _) = fields(data)?;
    Ok((f[WIDTH], f[HEIGHT]))
}

/// The header's fields in the right byte order, checked to be an XWD file's of a size read
/// here; and whether it was big-endian.
fn fields(data: &[u8]) -> Result<([u32; FIELDS], bool)> {
    if data.len() < HEADER {
        return Err(bad(format!("{} bytes, shorter than a header", data.len())));
    }
    // The header is written big-endian by Xvfb; read it the other way if that gives nonsense.
    let big = read_field(data, VERSION, true) == XWD_VERSION;
    let f: [u32; FIELDS] = std::array::from_fn(|i| read_field(data, i, big));
    if f[VERSION] != XWD_VERSION {
        return Err(bad("not XWD version 7"));
    }
    if !in_one_order(data) {
        return Err(bad("a header in two byte orders, as while Xvfb writes it"));
    }
    let (width, height) = (f[WIDTH], f[HEIGHT]);
    if width == 0 || height == 0 || width > MAX_SIDE || height > MAX_SIDE {
        return Err(bad(format!("{width}×{height} pixels")));
    }
    Ok((f, big))
}

/// Decode an XWD file of 24 or 32 bits per pixel, true colour.
pub fn decode(data: &[u8]) -> Result<Rgb> {
    let (fields, _) = fields(data)?;
    let f = |i: usize| fields[i];
    if data.len() < FIELDS * 4 {
        return Err(bad(format!("{} bytes, shorter than a header", data.len())));
    }
    if f(FORMAT) != ZPIXMAP {
        return Err(bad(format!("pixmap format {}, not ZPixmap", f(FORMAT))));
    }
    if !matches!(f(VISUAL_CLASS), TRUE_COLOR | DIRECT_COLOR) {
        return Err(bad(format!(
            "visual class {}, not true colour",
            f(VISUAL_CLASS)
        )));
    }
    let (width, height) = (f(WIDTH), f(HEIGHT));
    let bpp = f(BITS_PER_PIXEL);
    let step = match bpp {
        24 => 3,
        32 => 4,
        _ => return Err(bad(format!("{bpp} bits per pixel"))),
    };
    let line = f(BYTES_PER_LINE) as usize;
    if line < width as usize * step {
        return Err(bad(format!("{line} bytes per line for {width} pixels")));
    }
    let start = (f(HEADER_SIZE) as usize)
        .checked_add((f(NCOLORS) as usize).saturating_mul(COLOR_ENTRY))
        .ok_or_else(|| bad("a header past the file's end"))?;
    let need = line
        .checked_mul(height as usize)
        .and_then(|n| n.checked_add(start))
        .ok_or_else(|| bad("sizes that overflow"))?;
    if start < FIELDS * 4 || data.len() < need {
        return Err(bad(format!(
            "{} bytes where the header says {need}",
            data.len()
        )));
    }
    // pixels are in the image's own byte order: 0 least significant byte first
    let little = f(BYTE_ORDER) == 0;
    let masks = [f(RED_MASK), f(GREEN_MASK), f(BLUE_MASK)];
    if masks.contains(&0) {
        return Err(bad("a colour mask of 0"));
    }
    let shifts = masks.map(|m| m.trailing_zeros());
    let maxes = masks.map(|m| m >> m.trailing_zeros());
    let mut pixels = Vec::with_capacity(width as usize * height as usize * 3);
    for row in data[start..need].chunks_exact(line) {
        for px in row[..width as usize * step].chunks_exact(step) {
            let v = match (step, little) {
                (4, true) => u32::from_le_bytes([px[0], px[1], px[2], px[3]]),
                (4, false) => u32::from_be_bytes([px[0], px[1], px[2], px[3]]),
                (_, true) => u32::from_le_bytes([px[0], px[1], px[2], 0]),
                (_, false) => u32::from_be_bytes([0, px[0], px[1], px[2]]),
            };
            for c in 0..3 {
                let x = u64::from((v & masks[c]) >> shifts[c]);
                pixels.push(if maxes[c] == 255 {
                    x as u8
                } else {
                    (x * 255 / u64::from(maxes[c])) as u8
                });
            }
        }
    }
    Ok(Rgb {
        width,
        height,
        pixels,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An XWD file as Xvfb writes one: big-endian header, little-endian 32-bit pixels.
    pub(crate) fn xwd(width: u32, height: u32, pixel: impl Fn(u32, u32) -> [u8; 3]) -> Vec<u8> {
        let name = b"Xvfb main window\0";
        let header_size = (FIELDS * 4 + name.len()) as u32;
        let mut f = [0u32; FIELDS];
        f[HEADER_SIZE] = header_size;
        f[VERSION] = 7;
        f[FORMAT] = 2;
        f[WIDTH] = width;
        f[HEIGHT] = height;
        f[BYTE_ORDER] = 0;
        f[BITS_PER_PIXEL] = 32;
        f[BYTES_PER_LINE] = width * 4;
        f[VISUAL_CLASS] = TRUE_COLOR;
        f[RED_MASK] = 0xff0000;
        f[GREEN_MASK] = 0xff00;
        f[BLUE_MASK] = 0xff;
        f[NCOLORS] = 2;
        // as Xvfb sets them: depth, bitmap unit, bit order, pad; bits per RGB, colour map
        // entries; the window's size
        (f[3], f[8], f[9], f[10], f[17], f[18]) = (24, 32, 0, 32, 8, 256);
        (f[20], f[21]) = (width, height);
        let mut out: Vec<u8> = f.iter().flat_map(|v| v.to_be_bytes()).collect();
        out.extend_from_slice(name);
        out.extend(std::iter::repeat_n(0u8, 2 * COLOR_ENTRY));
        for y in 0..height {
            for x in 0..width {
                let [r, g, b] = pixel(x, y);
                out.extend_from_slice(&[b, g, r, 0]);
            }
        }
        out
    }

    #[test]
    fn an_xvfb_framebuffer_decodes_to_its_pixels() {
        let file = xwd(3, 2, |x, y| [x as u8 * 100, y as u8 * 200, 7]);
        let rgb = decode(&file).unwrap();
        assert_eq!((rgb.width, rgb.height), (3, 2));
        assert_eq!(&rgb.pixels[..9], &[0, 0, 7, 100, 0, 7, 200, 0, 7]);
        assert_eq!(&rgb.pixels[9..12], &[0, 200, 7]);
        assert_eq!(size(&file[..HEADER]).unwrap(), (3, 2));
        assert!(size(&file[..HEADER - 1]).is_err());
    }

    #[test]
    fn a_gzipped_framebuffer_is_read_and_a_bomb_is_cut() {
        use std::io::Write;
        let file = xwd(64, 48, |x, y| [x as u8, y as u8, 9]);
        let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        z.write_all(&file).unwrap();
        let z = z.finish().unwrap();
        assert_eq!(gunzip(&z, 1 << 20).unwrap(), file);
        let e = gunzip(&z, 100).unwrap_err().to_string();
        assert!(e.contains("over 100 bytes"), "{e}");
        assert!(gunzip(b"plain", 100).is_err());
    }

    /// A file Xvfb has made but not filled (zeros, or shorter than a header) is worth another
    /// read; a written one, or one of another format, is not.
    #[test]
    fn a_file_xvfb_has_not_written_is_told_apart() {
        assert!(unwritten(&[]));
        assert!(unwritten(&[0; HEADER - 1]));
        assert!(unwritten(&[0; 65536]));
        assert!(!unwritten(&xwd(4, 2, |_, _| [0, 0, 0])));
        assert!(!unwritten(&[0xff; 65536]));
        // from its gzip, without inflating the rest
        let gz = |b: &[u8]| {
            use std::io::Write;
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(b).unwrap();
            e.finish().unwrap()
        };
        assert!(unwritten(&gunzip_head(&gz(&[0; 65536]), HEADER)));
        let written = gunzip_head(&gz(&xwd(4, 2, |_, _| [0, 0, 0])), HEADER);
        assert_eq!(written.len(), HEADER);
        assert!(!unwritten(&written));
        assert!(unwritten(&gunzip_head(b"not gzip", HEADER)));
    }

    /// Xvfb writes its header in the host's order, then swaps it field by field to
    /// big-endian: a read at any point of that is worth another, and the same header whole in
    /// either order is read. (CI met a read with the version swapped and the visual class
    /// not: "visual class 67108864".)
    #[test]
    fn a_header_caught_while_xvfb_swaps_it_is_unwritten() {
        let big = xwd(640, 480, |_, _| [1, 2, 3]);
        let mut little = big.clone();
        for w in little[..HEADER].chunks_exact_mut(4) {
            w.reverse();
        }
        for whole in [&big, &little] {
            assert!(!unwritten(whole));
            assert_eq!(decode(whole).unwrap().width, 640);
        }
        for swapped in 1..FIELDS {
            let mut part = little.clone();
            part[..swapped * 4].copy_from_slice(&big[..swapped * 4]);
            if part[..HEADER] == big[..HEADER] {
                // the fields left are zeros, the same in either order
                assert!(!unwritten(&part));
                continue;
            }
            assert!(unwritten(&part), "{swapped} fields swapped");
            let e = decode(&part).unwrap_err().to_string();
            assert!(
                e.contains("two byte orders") || e.contains("not XWD"),
                "{swapped}: {e}"
            );
        }
    }

    #[test]
    fn a_hostile_file_is_an_error_not_a_panic() {
        let good = xwd(4, 4, |_, _| [1, 2, 3]);
        // cut anywhere
        for n in [0, 10, 99, 100, good.len() - 1] {
            assert!(decode(&good[..n]).is_err(), "{n}");
        }
        // each field set to absurd values
        for i in 0..FIELDS {
            for v in [0u32, 1, 0xffff_ffff, 0x8000_0000, MAX_SIDE + 1] {
                let mut f = good.clone();
                f[i * 4..i * 4 + 4].copy_from_slice(&v.to_be_bytes());
                let _ = decode(&f);
            }
        }
        // a mask of 32 bits and a pixel of all ones: no overflow
        let mut wide = good.clone();
        wide[RED_MASK * 4..RED_MASK * 4 + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        let start = good.len() - 16 * 4;
        wide[start..].fill(0xff);
        assert!(decode(&wide).is_ok());
        let mut huge = good.clone();
        huge[WIDTH * 4..WIDTH * 4 + 4].copy_from_slice(&(MAX_SIDE + 1).to_be_bytes());
        assert!(decode(&huge).is_err());
    }
}

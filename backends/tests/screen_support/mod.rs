//! Shared by the tests of VM screens (the qemu and libvirt suites, the contract suite): the
//! pixels of a screendump, keys for a text, and the reader the tests put on the guest's
//! console.
#![allow(dead_code)]

use boxery_backends::{InputEvent, Screen};

/// The screen's pixels (RGB), checked to be a PNG of the size the screen reports.
pub fn pixels(s: &Screen) -> Vec<[u8; 3]> {
    let img = image::load_from_memory_with_format(&s.png, image::ImageFormat::Png)
        .expect("a screendump is a PNG")
        .to_rgb8();
    assert_eq!(
        (img.width(), img.height()),
        (s.width, s.height),
        "the PNG's size is the size reported"
    );
    img.pixels().map(|p| p.0).collect()
}

/// How many colours the screen shows.
pub fn colours(s: &Screen) -> usize {
    let mut seen: Vec<[u8; 3]> = pixels(s);
    seen.sort_unstable();
    seen.dedup();
    seen.len()
}

/// How many pixels differ between two screens of one size.
pub fn differing(a: &Screen, b: &Screen) -> usize {
    assert_eq!((a.width, a.height), (b.width, b.height));
    pixels(a)
        .iter()
        .zip(pixels(b).iter())
        .filter(|(x, y)| x != y)
        .count()
}

/// Each character of `text` (`a-z`, `0-9`, `\n`) pressed and released.
pub fn keys(text: &str) -> Vec<InputEvent> {
    text.chars()
        .flat_map(|c| {
            let qcode = match c {
                '\n' => "ret".to_string(),
                c => c.to_string(),
            };
            [true, false].map(|down| InputEvent::Key {
                qcode: qcode.clone(),
                down,
            })
        })
        .collect()
}

/// A shell command for the guest (over ssh) that puts a reader on the VGA console, tty1 (the
/// tiny guest runs no getty there): the cursor hidden (so the screen changes only with text),
/// the screen cleared, a prompt, then `cat` keeping what is typed in `/tmp/typed`; the line
/// discipline echoes it on the screen.
pub const CONSOLE_READER: &str = "printf '\\033[?25l\\033[2J\\033[Hscreen test, type here: ' > /dev/tty1 && \
     setsid sh -c 'exec cat < /dev/tty1 > /tmp/typed' < /dev/null > /dev/null 2>&1 & \
     sleep 1; ls -l /proc/[0-9]*/fd/0 2>/dev/null | grep -q /dev/tty1 && echo reading";

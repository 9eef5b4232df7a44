//! Computer use: see and drive a VM's screen (`boxery computer`, `boxery screenshot`,
//! `vm_computer`) with the action set computer-use models already speak (Anthropic's:
//! `screenshot`, `left_click`, `type`, `key`, `scroll`, …).
//!
//! A VM's screen is reached one of two ways, and every result says which ([`Path`]):
//! - **desktop**: the X display `:0` the `desktop` layer runs in the guest (Xvfb and a window
//!   manager). Screenshots read Xvfb's framebuffer file over ssh and are decoded here
//!   ([`xwd`]); actions are `xdotool` commands over ssh. Text of any script types exactly.
//! - **console**: the screen the hypervisor draws, with nothing in the guest
//!   ([`Backend::screendump`](boxery_backends::Backend::screendump),
//!   [`send_input`](boxery_backends::Backend::send_input)): the text console of a headless VM,
//!   or any VM's screen when its guest cannot be reached (stuck at boot). Keys go to its
//!   keyboard (a US layout: typed text is ASCII only), the pointer to a tablet.
//!
//! A VM made with the desktop layer uses the desktop unless the console is asked for; any
//! other VM uses the console.
//!
//! Guarantees: every action is checked before anything is sent: coordinates inside the
//! screenshot's size, keys from one table ([`keys`]), text without control characters but
//! newline and tab, sizes and durations bounded; a refused action sends nothing. Screenshots
//! for a model are scaled to its sizes ([`picture::TARGETS`]) and coordinates scaled back
//! ([`picture::Scale`]). Actions (not screenshots) are recorded in the actions log.

pub mod keys;
pub mod picture;
pub mod xwd;

use std::time::Duration;

use std::sync::Arc;

use boxery_backends::{Backend, InputEvent, PointerButton};
use boxery_hands::shell_quote;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use self::picture::Scale;
use crate::{Result, VerbError, Verbs};

/// The longest text `type` takes.
pub const MAX_TEXT: usize = 4096;
/// The longest text `type` takes on the console: its keyboard takes about 40 characters a
/// second, and a batch holds the VM's monitor connection while it types.
pub const MAX_CONSOLE_TEXT: usize = 256;
/// The longest `wait`.
pub const MAX_WAIT: Duration = Duration::from_secs(60);
/// The most notches one `scroll` turns.
pub const MAX_SCROLL: u32 = 50;
/// The framebuffer file Xvfb keeps (`-fbdir`) in a desktop VM.
pub const FRAMEBUFFER: &str = "/run/boxery-desktop/Xvfb_screen0";
/// The most gzipped framebuffer read (a real 7680 × 4320 screen is a few MB of it).
const FRAMEBUFFER_CAP: usize = 32 << 20;
/// The largest framebuffer ungzipped: the desktop layer's largest screen, 7680 × 4320 at 32
/// bits, and its header.
const FRAMEBUFFER_MAX: usize = 7680 * 4320 * 4 + (64 << 10);
/// The desktop layer's exact typist (image/layers/desktop.sh).
const TYPE: &str = "/usr/local/lib/boxery/desktop/type";
/// How long one action may take in the guest.
const ACTION_TIMEOUT: Duration = Duration::from_secs(60);

/// The actions: what `action` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ActionName {
    /// A picture of the screen.
    Screenshot,
    /// Click the left button at `coordinate` (or where the pointer is), with the keys in
    /// `text` held (`shift`, `ctrl+alt`).
    LeftClick,
    /// Click the right button.
    RightClick,
    /// Click the middle button.
    MiddleClick,
    /// Click the left button twice.
    DoubleClick,
    /// Click the left button three times.
    TripleClick,
    /// Move the pointer to `coordinate`.
    MouseMove,
    /// Press the left button at `start_coordinate`, move to `coordinate`, release.
    LeftClickDrag,
    /// Type `text` (newline is Return, tab is Tab).
    Type,
    /// Press keys: `text` is one combination (`ctrl+s`, `Return`) or several separated by
    /// spaces, pressed in turn.
    Key,
    /// Turn the wheel `scroll_amount` notches (default 3) in `scroll_direction` at
    /// `coordinate` (or where the pointer is).
    Scroll,
    /// Where the pointer is.
    CursorPosition,
    /// Wait `duration` seconds (default 1, at most 60), then take a screenshot.
    Wait,
}

/// A scroll direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Up.
    Up,
    /// Down.
    Down,
    /// Left.
    Left,
    /// Right.
    Right,
}

/// One computer-use action, as a model gives it: coordinates are pixels of the last
/// screenshot it was shown.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Action {
    /// What to do.
    pub action: ActionName,
    /// [x, y] in the screenshot's pixels: where to click, move, scroll, or end a drag.
    #[serde(default)]
    pub coordinate: Option<[i64; 2]>,
    /// [x, y] where a left_click_drag starts.
    #[serde(default)]
    pub start_coordinate: Option<[i64; 2]>,
    /// The text to type, the keys to press (key), or the keys held during a click.
    #[serde(default)]
    pub text: Option<String>,
    /// Which way to scroll.
    #[serde(default)]
    pub scroll_direction: Option<Direction>,
    /// Notches to scroll (default 3, at most 50).
    #[serde(default)]
    pub scroll_amount: Option<u32>,
    /// Seconds to wait (wait; default 1, at most 60).
    #[serde(default)]
    pub duration: Option<f64>,
}

/// How a VM's screen is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Path {
    /// The desktop layer's X display in the guest, over ssh.
    Desktop,
    /// The hypervisor's own screen, keyboard and tablet.
    Console,
}

impl Path {
    /// In a sentence's words.
    pub fn describe(self) -> &'static str {
        match self {
            Path::Desktop => "the desktop in the guest (display :0)",
            Path::Console => "the hypervisor's screen (the VM's console)",
        }
    }
}

/// A screenshot.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Shot {
    /// The picture, PNG (not serialized: front ends send it as an image).
    #[serde(skip)]
    pub png: Vec<u8>,
    /// Its width: coordinates are pixels of this picture.
    pub width: u32,
    /// Its height.
    pub height: u32,
    /// The screen's own width.
    pub screen_width: u32,
    /// The screen's own height.
    pub screen_height: u32,
    /// How the screen was reached.
    pub path: Path,
}

/// What an action did.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Done {
    /// The VM.
    pub vm: String,
    /// The action.
    pub action: ActionName,
    /// How the screen was reached.
    pub path: Path,
    /// What was done, in a sentence.
    pub said: String,
    /// The pointer's position (cursor_position), in the screenshot's pixels.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cursor: Option<[u32; 2]>,
    /// A screenshot (screenshot, wait).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shot: Option<Shot>,
}

/// An action checked: nothing in it can fail to be sent for a reason known now.
#[derive(Debug, Clone, PartialEq)]
enum Checked {
    Shot,
    Click {
        at: Option<[i64; 2]>,
        button: PointerButton,
        count: u32,
        held: Vec<keys::Key>,
    },
    Move([i64; 2]),
    Drag([i64; 2], [i64; 2]),
    Type(String),
    Keys(Vec<Vec<keys::Key>>),
    Scroll {
        at: Option<[i64; 2]>,
        button: PointerButton,
        notches: u32,
    },
    Cursor,
    Wait(Duration),
}

fn refuse(msg: impl std::fmt::Display) -> VerbError {
    VerbError::invalid(format!("{msg}; nothing was sent"))
}

/// Keys joined with `+`, checked against the table.
fn combo(text: &str) -> Result<Vec<keys::Key>> {
    let parts: Vec<&str> = if text == "+" {
        vec!["plus"]
    } else {
        text.split('+').collect()
    };
    parts
        .iter()
        .map(|p| {
            keys::lookup(p).ok_or_else(|| {
                refuse(format!(
                    "no key `{}` in `{}`: the keys are {}",
                    boxery_api::name::shown(p),
                    boxery_api::name::shown(text),
                    keys::EXAMPLES
                ))
            })
        })
        .collect()
}

fn check_text(text: &str) -> Result<()> {
    if text.is_empty() {
        return Err(refuse("type needs text"));
    }
    if text.len() > MAX_TEXT {
        return Err(refuse(format!(
            "the text is {} bytes, over the {MAX_TEXT} byte limit of one type: type it in parts",
            text.len()
        )));
    }
    if let Some(c) = text
        .chars()
        .find(|c| c.is_control() && *c != '\n' && *c != '\t')
    {
        return Err(refuse(format!(
            "the text holds the control character U+{:04X}: only newline and tab are typed (press other keys with key)",
            c as u32
        )));
    }
    Ok(())
}

impl Action {
    fn needs<T: Copy>(&self, v: Option<T>, field: &str) -> Result<T> {
        v.ok_or_else(|| refuse(format!("{} needs {field}", self.name())))
    }

    fn name(&self) -> String {
        serde_json::to_value(self.action)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default()
    }

    /// Check the action's fields: those it needs are there, those it does not take are not,
    /// keys and text are ones that can be sent.
    fn check(&self) -> Result<Checked> {
        use ActionName as A;
        let takes: &[&str] = match self.action {
            A::Screenshot | A::CursorPosition => &[],
            A::LeftClick | A::RightClick | A::MiddleClick | A::DoubleClick | A::TripleClick => {
                &["coordinate", "text"]
            }
            A::MouseMove => &["coordinate"],
            A::LeftClickDrag => &["start_coordinate", "coordinate"],
            A::Type | A::Key => &["text"],
            A::Scroll => &["coordinate", "scroll_direction", "scroll_amount"],
            A::Wait => &["duration"],
        };
        let given = [
            ("coordinate", self.coordinate.is_some()),
            ("start_coordinate", self.start_coordinate.is_some()),
            ("text", self.text.is_some()),
            ("scroll_direction", self.scroll_direction.is_some()),
            ("scroll_amount", self.scroll_amount.is_some()),
            ("duration", self.duration.is_some()),
        ];
        if let Some((f, _)) = given.iter().find(|(f, set)| *set && !takes.contains(f)) {
            return Err(refuse(format!(
                "{} does not take {f}{}",
                self.name(),
                if takes.is_empty() {
                    String::new()
                } else {
                    format!(" (it takes {})", takes.join(", "))
                }
            )));
        }
        let click = |button, count| -> Result<Checked> {
            let held = match self.text.as_deref() {
                None | Some("") => vec![],
                Some(t) => {
                    let held = combo(t)?;
                    if let Some(k) = held.iter().find(|k| !k.modifier) {
                        return Err(refuse(format!(
                            "a click holds modifiers only (shift, ctrl, alt, super), not {}",
                            k.keysym
                        )));
                    }
                    held
                }
            };
            Ok(Checked::Click {
                at: self.coordinate,
                button,
                count,
                held,
            })
        };
        Ok(match self.action {
            A::Screenshot => Checked::Shot,
            A::CursorPosition => Checked::Cursor,
            A::LeftClick => click(PointerButton::Left, 1)?,
            A::RightClick => click(PointerButton::Right, 1)?,
            A::MiddleClick => click(PointerButton::Middle, 1)?,
            A::DoubleClick => click(PointerButton::Left, 2)?,
            A::TripleClick => click(PointerButton::Left, 3)?,
            A::MouseMove => Checked::Move(self.needs(self.coordinate, "coordinate")?),
            A::LeftClickDrag => Checked::Drag(
                self.needs(self.start_coordinate, "start_coordinate")?,
                self.needs(self.coordinate, "coordinate")?,
            ),
            A::Type => {
                let t = self.text.clone().unwrap_or_default();
                check_text(&t)?;
                Checked::Type(t)
            }
            A::Key => {
                let t = self.text.as_deref().unwrap_or_default();
                if t.trim().is_empty() {
                    return Err(refuse("key needs text: the keys to press (ctrl+s, Return)"));
                }
                if t.len() > 256 {
                    return Err(refuse("key takes at most 256 bytes of key names"));
                }
                Checked::Keys(t.split_whitespace().map(combo).collect::<Result<_>>()?)
            }
            A::Scroll => {
                let notches = self.scroll_amount.unwrap_or(3);
                if notches == 0 || notches > MAX_SCROLL {
                    return Err(refuse(format!(
                        "scroll_amount {notches} is not 1..{MAX_SCROLL}"
                    )));
                }
                Checked::Scroll {
                    at: self.coordinate,
                    button: match self.needs(self.scroll_direction, "scroll_direction")? {
                        Direction::Up => PointerButton::WheelUp,
                        Direction::Down => PointerButton::WheelDown,
                        Direction::Left => PointerButton::WheelLeft,
                        Direction::Right => PointerButton::WheelRight,
                    },
                    notches,
                }
            }
            A::Wait => {
                let d = self.duration.unwrap_or(1.0);
                if !d.is_finite() || d < 0.0 || d > MAX_WAIT.as_secs_f64() {
                    return Err(refuse(format!(
                        "duration {d} is not 0..{} seconds",
                        MAX_WAIT.as_secs()
                    )));
                }
                Checked::Wait(Duration::from_secs_f64(d))
            }
        })
    }
}

/// Which way a VM's screen is reached, with the backend for the console.
enum Way {
    /// The desktop layer's display, over ssh.
    Desktop,
    /// The hypervisor's screen, through the VM's backend.
    Console(Arc<dyn Backend>),
}

impl Way {
    fn path(&self) -> Path {
        match self {
            Way::Desktop => Path::Desktop,
            Way::Console(_) => Path::Console,
        }
    }
}

/// Whether VM `obj` has the desktop layer.
pub fn has_desktop(obj: &boxery_api::Vm) -> bool {
    super::has_layer(obj, boxery_api::vm::DESKTOP)
}

/// Which way VM `vm`'s screen is reached (it must be in the store): the desktop when it was
/// made with the desktop layer (or had it added) and the console is not asked for.
async fn way(v: &Verbs, vm: &str, console: bool) -> Result<Way> {
    let obj = crate::vm::get_vm(v, vm).await?;
    if has_desktop(&obj) && !console {
        return Ok(Way::Desktop);
    }
    if v.remote_plane().is_some() {
        return Err(VerbError::invalid(
            "the console is reached on the VM's host: run this there, or use a VM with the desktop layer (its desktop is reached through the context)",
        ));
    }
    Ok(Way::Console(v.env.backend_of(&obj)?))
}

/// A screenshot of VM `vm`'s screen, scaled for a model (`for_model`) or whole.
pub async fn screenshot(
    v: &Verbs,
    vm: &str,
    console: bool,
    for_model: bool,
    ct: &CancellationToken,
) -> Result<Shot> {
    let way = way(v, vm, console).await?;
    shoot(v, vm, &way, for_model, ct).await
}

async fn shoot(
    v: &Verbs,
    vm: &str,
    way: &Way,
    for_model: bool,
    ct: &CancellationToken,
) -> Result<Shot> {
    let scale_of = |w, h| {
        if for_model {
            Scale::for_model(w, h)
        } else {
            Scale::none(w, h)
        }
    };
    let path = way.path();
    let (png, scale) = match way {
        Way::Console(backend) => {
            let screen = screendump(backend, vm).await?;
            let scale = scale_of(screen.width, screen.height);
            // the hypervisor's PNG as it is, when it is shown at its own size
            if scale.shown == scale.screen {
                (screen.png, scale)
            } else {
                let png = tokio::task::spawn_blocking(move || {
                    picture::png(picture::from_png(&screen.png)?, scale)
                })
                .await
                .map_err(|e| VerbError::failed(format!("encoding the screenshot: {e}")))??;
                (png, scale)
            }
        }
        Way::Desktop => {
            let rgb = framebuffer(v, vm, ct).await?;
            let scale = scale_of(rgb.width, rgb.height);
            let png = tokio::task::spawn_blocking(move || picture::png(rgb, scale))
                .await
                .map_err(|e| VerbError::failed(format!("encoding the screenshot: {e}")))??;
            (png, scale)
        }
    };
    remember(v, vm, path, scale.screen);
    Ok(shot(png, scale, path))
}

fn shot(png: Vec<u8>, scale: Scale, path: Path) -> Shot {
    Shot {
        png,
        width: scale.shown.0,
        height: scale.shown.1,
        screen_width: scale.screen.0,
        screen_height: scale.screen.1,
        path,
    }
}

/// The size of each screen last shown in this process (by home, VM and path): what a model's
/// coordinates are pixels of. An action on the desktop checks in the guest that the screen is
/// still that size (else it is refused: take a screenshot), so it needs no read of its own.
type Sizes = std::collections::HashMap<(std::path::PathBuf, String, Path), (u32, u32)>;
static SIZES: std::sync::Mutex<Option<Sizes>> = std::sync::Mutex::new(None);

fn remember(v: &Verbs, vm: &str, path: Path, size: (u32, u32)) {
    let mut m = SIZES.lock().unwrap_or_else(|p| p.into_inner());
    m.get_or_insert_with(Default::default)
        .insert((v.env.home.clone(), vm.to_string(), path), size);
}

fn remembered(v: &Verbs, vm: &str, path: Path) -> Option<(u32, u32)> {
    let m = SIZES.lock().unwrap_or_else(|p| p.into_inner());
    m.as_ref()?
        .get(&(v.env.home.clone(), vm.to_string(), path))
        .copied()
}

async fn screendump(backend: &Arc<dyn Backend>, vm: &str) -> Result<boxery_backends::Screen> {
    backend
        .screendump(vm)
        .await
        .map_err(|e| backend_error(vm, e))
}

/// The desktop's pixels, from its framebuffer file.
async fn framebuffer(v: &Verbs, vm: &str, ct: &CancellationToken) -> Result<xwd::Rgb> {
    // gzip -1 in the guest: 25 times fewer bytes through ssh, which costs more under
    // emulation than the compression (docs/benchmarks.md)
    let bytes = read_framebuffer(v, vm, "gzip -1 -c", FRAMEBUFFER_CAP, ct, |b| {
        xwd::unwritten(&xwd::gunzip_head(b, xwd::HEADER))
    })
    .await?;
    tokio::task::spawn_blocking(move || xwd::decode(&xwd::gunzip(&bytes, FRAMEBUFFER_MAX)?))
        .await
        .map_err(|e| VerbError::failed(format!("reading the screenshot: {e}")))?
}

/// What the guest's `read` (at most `cap` bytes) gives of the desktop's framebuffer, read
/// again while the display is starting (at boot, and at each restart for a new
/// `spec.display`): not there yet, gone while it was read ([`framebuffer_script`]), or not
/// written yet (`unwritten` of what was read), for up to [`UNWRITTEN_WAIT`].
async fn read_framebuffer(
    v: &Verbs,
    vm: &str,
    read: &str,
    cap: usize,
    ct: &CancellationToken,
    unwritten: impl Fn(&[u8]) -> bool,
) -> Result<Vec<u8>> {
    let script = framebuffer_script(vm, read);
    let started = std::time::Instant::now();
    loop {
        let again = started.elapsed() < UNWRITTEN_WAIT;
        match super::helper(v, vm, &script, None, cap, ACTION_TIMEOUT, ct).await {
            // between the display's stop and its start
            Err(e) if again && e.kind() == crate::ErrorKind::NotFound => {}
            Ok(b) if again && (b.is_empty() || unwritten(&b)) => {}
            Ok(b) if b.is_empty() => {
                return Err(VerbError::failed(format!(
                    "VM {vm}'s framebuffer vanished each time it was read for {}s: is its display starting again and again? (boxery run {vm} -- journalctl -u boxery-desktop)",
                    UNWRITTEN_WAIT.as_secs()
                )));
            }
            r => return r,
        }
        pause(ct).await?;
    }
}

/// How long a starting display's framebuffer is read again ([`read_framebuffer`]): Xvfb
/// writes it within a second of its start, so this bounds only a broken guest.
const UNWRITTEN_WAIT: Duration = Duration::from_secs(10);

/// A fifth of a second before another read, or the caller's cancel.
async fn pause(ct: &CancellationToken) -> Result<()> {
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(200)) => Ok(()),
        _ = ct.cancelled() => Err(super::cancelled()),
    }
}

/// The guest's shell that waits (at most 45 s) while the desktop is starting: its display
/// comes up some seconds after sshd at boot, and after a restart.
const WAIT_FOR_DESKTOP: &str = "[ -S /tmp/.X11-unix/X0 ] && [ -r /run/boxery-desktop/Xvfb_screen0 ] || { end=$(($(date +%s) + 45)); while [ \"$(date +%s)\" -lt \"$end\" ]; do [ -S /tmp/.X11-unix/X0 ] && [ -r /run/boxery-desktop/Xvfb_screen0 ] && break; case $(systemctl is-active boxery-desktop 2>/dev/null) in activating|reloading|deactivating) sleep 0.2 ;; *) break ;; esac; done; }; ";

/// The guest's script that runs `read` on the desktop's framebuffer file, or says there is
/// none. A read that fails because the file went meanwhile (the display stopping to start
/// again, at a new size) prints nothing and succeeds: the caller reads again, as it does a
/// file not yet written ([`xwd::unwritten`]).
fn framebuffer_script(vm: &str, read: &str) -> String {
    format!(
        "{WAIT_FOR_DESKTOP}f={FRAMEBUFFER}; [ -r \"$f\" ] || {{ echo \"VM {vm} runs no desktop ($f is missing): is its desktop running? (boxery run {vm} -- systemctl status boxery-desktop)\" >&2; exit 3; }}; {read} \"$f\" || {{ s=$?; [ -e \"$f\" ] && exit $s; exit 0; }}"
    )
}

/// The screen's size: the desktop's from its framebuffer's header, the console's from a
/// screendump.
async fn size(v: &Verbs, vm: &str, way: &Way, ct: &CancellationToken) -> Result<(u32, u32)> {
    let size = match way {
        Way::Desktop => {
            let read = format!("head -c {}", xwd::HEADER);
            let head = read_framebuffer(v, vm, &read, xwd::HEADER, ct, xwd::unwritten).await?;
            xwd::size(&head)?
        }
        Way::Console(backend) => {
            let screen = screendump(backend, vm).await?;
            (screen.width, screen.height)
        }
    };
    remember(v, vm, way.path(), size);
    Ok(size)
}

pub(crate) fn backend_error(vm: &str, e: boxery_backends::BackendError) -> VerbError {
    use boxery_backends::BackendError as B;
    match e {
        B::Invalid(m) => VerbError::invalid(m),
        B::NotFound { .. } => VerbError::not_found(format!("VM {vm}: {}", e.chain())),
        B::Unsupported { .. } => {
            VerbError::invalid(format!("{}: use a VM with the desktop layer", e.chain()))
        }
        e => VerbError::failed(e.chain()),
    }
}

/// Do `action` on VM `vm`'s screen: on the console when `console`, else on its desktop if it
/// has one. Coordinates and screenshots are a model's ([`Scale::for_model`]) when
/// `for_model`, else the screen's own pixels (a person's).
pub async fn act(
    v: &Verbs,
    vm: &str,
    action: &Action,
    console: bool,
    for_model: bool,
    ct: &CancellationToken,
) -> Result<Done> {
    let checked = action.check()?;
    let way = way(v, vm, console).await?;
    let path = way.path();
    let done = |said: String| Done {
        vm: vm.to_string(),
        action: action.action,
        path,
        said,
        cursor: None,
        shot: None,
    };
    match checked {
        Checked::Shot => {
            let shot = shoot(v, vm, &way, for_model, ct).await?;
            let said = format!(
                "a screenshot of {}, {}×{}",
                path.describe(),
                shot.width,
                shot.height
            );
            return Ok(Done {
                shot: Some(shot),
                ..done(said)
            });
        }
        Checked::Wait(d) => {
            tokio::select! {
                _ = tokio::time::sleep(d) => {}
                _ = ct.cancelled() => return Err(super::cancelled()),
            }
            let shot = shoot(v, vm, &way, for_model, ct).await?;
            return Ok(Done {
                shot: Some(shot),
                ..done(format!("waited {:.1}s", d.as_secs_f64()))
            });
        }
        _ => {}
    }
    // the screen's size, to check and scale coordinates: the one the last screenshot showed
    // (the desktop checks it still is), else asked of the screen
    let known = remembered(v, vm, path);
    let scale = if needs_scale(&checked) {
        let (w, h) = match known {
            Some(size) => size,
            None => size(v, vm, &way, ct).await?,
        };
        Some(if for_model {
            Scale::for_model(w, h)
        } else {
            Scale::none(w, h)
        })
    } else {
        None
    };
    let doing = v.doing("computer", Some(vm), describe(action));
    let r = match &way {
        Way::Desktop => desktop(v, vm, &checked, scale, known.is_some(), ct).await,
        Way::Console(backend) => console_act(backend, vm, &checked, scale).await,
    };
    match &r {
        Ok(said) => doing.done(said.0.clone(), None),
        Err(_) => doing.ended(&r, None),
    }
    let (said, cursor) = r?;
    Ok(Done {
        cursor,
        ..done(said)
    })
}

fn needs_scale(c: &Checked) -> bool {
    match c {
        Checked::Click { at, .. } | Checked::Scroll { at, .. } => at.is_some(),
        Checked::Move(_) | Checked::Drag(..) | Checked::Cursor => true,
        _ => false,
    }
}

fn describe(a: &Action) -> String {
    let mut s = a.name();
    if let Some([x, y]) = a.start_coordinate {
        s.push_str(&format!(" from ({x}, {y})"));
    }
    if let Some([x, y]) = a.coordinate {
        s.push_str(&format!(" at ({x}, {y})"));
    }
    if let Some(t) = &a.text {
        s.push_str(&format!(": {}", boxery_api::name::shown(t)));
    }
    s
}

fn button_number(b: PointerButton) -> u8 {
    match b {
        PointerButton::Left => 1,
        PointerButton::Middle => 2,
        PointerButton::Right => 3,
        PointerButton::WheelUp => 4,
        PointerButton::WheelDown => 5,
        PointerButton::WheelLeft => 6,
        PointerButton::WheelRight => 7,
    }
}

fn button_word(b: PointerButton) -> &'static str {
    match b {
        PointerButton::Left => "left",
        PointerButton::Middle => "middle",
        PointerButton::Right => "right",
        PointerButton::WheelUp => "up",
        PointerButton::WheelDown => "down",
        PointerButton::WheelLeft => "left",
        PointerButton::WheelRight => "right",
    }
}

/// The shell that runs xdotool on the desktop's display, or says there is none.
pub fn xdotool_preamble(vm: &str) -> String {
    format!(
        "{WAIT_FOR_DESKTOP}export DISPLAY=:0; [ -S /tmp/.X11-unix/X0 ] || {{ echo \"VM {vm} runs no desktop (display :0 is down): is its desktop running? (boxery run {vm} -- systemctl status boxery-desktop)\" >&2; exit 3; }}; command -v xdotool >/dev/null || {{ echo \"VM {vm} has no xdotool: make it with the desktop layer\" >&2; exit 3; }}; "
    )
}

/// The guest's shell that refuses (exit 5) when the desktop is no longer `size` (the size of
/// the screen a model's coordinates are pixels of). The desktop layer's display marks the size
/// it starts at beside the framebuffer (`size-WxH`, in the runtime directory made afresh at
/// each start), which the shell tests without starting a process (a process costs about 50 ms
/// under emulation: docs/benchmarks.md); without that mark (another size, or an image from
/// before it), the framebuffer's header says.
fn same_size(framebuffer: &str, (w, h): (u32, u32)) -> String {
    let dir = framebuffer.rsplit_once('/').map_or(".", |(d, _)| d);
    format!(
        "[ -e {dir}/size-{w}x{h} ] || {{ set -- $(od -An -tu4 -j16 -N8 --endian=big {framebuffer}); [ \"${{1:-0}}\" != 0 ] || {{ echo \"the desktop is starting again: take a screenshot once it is up\" >&2; exit 5; }}; [ \"$1x$2\" = {w}x{h} ] || {{ echo \"the screen is now $1×$2, not the {w}×{h} of the last screenshot: take a screenshot, and use its coordinates\" >&2; exit 5; }}; }}; "
    )
}

/// The xdotool command line for a checked action on the screen's pixels.
fn xdotool(c: &Checked, scale: Option<Scale>) -> Result<(String, String)> {
    let at = |what: &str, p: [i64; 2]| -> Result<(u32, u32)> {
        scale
            .expect("scaled actions have a scale")
            .to_screen(what, p)
    };
    let to = |p: [i64; 2]| format!("({}, {})", p[0], p[1]);
    Ok(match c {
        Checked::Click {
            at: p,
            button,
            count,
            held,
        } => {
            let mut cmd = String::from("xdotool");
            if let Some(p) = p {
                let (x, y) = at("coordinate", *p)?;
                cmd.push_str(&format!(" mousemove {x} {y}"));
            }
            for k in held {
                cmd.push_str(&format!(" keydown {}", k.keysym));
            }
            cmd.push_str(&format!(
                " click --repeat {count} --delay 100 {}",
                button_number(*button)
            ));
            for k in held.iter().rev() {
                cmd.push_str(&format!(" keyup {}", k.keysym));
            }
            let times = match count {
                1 => "clicked",
                2 => "double-clicked",
                _ => "triple-clicked",
            };
            let word = button_word(*button);
            let said = match p {
                Some(p) => format!("{times} the {word} button at {}", to(*p)),
                None => format!("{times} the {word} button where the pointer is"),
            };
            (cmd, said)
        }
        Checked::Move(p) => {
            let (x, y) = at("coordinate", *p)?;
            (
                format!("xdotool mousemove {x} {y}"),
                format!("moved the pointer to {}", to(*p)),
            )
        }
        Checked::Drag(from, p) => {
            let (x0, y0) = at("start_coordinate", *from)?;
            let (x1, y1) = at("coordinate", *p)?;
            (
                format!(
                    "xdotool mousemove {x0} {y0} mousedown 1 sleep 0.1 mousemove {x1} {y1} sleep 0.1 mouseup 1"
                ),
                format!("dragged from {} to {}", to(*from), to(*p)),
            )
        }
        // the desktop layer's `type` binds the characters the keyboard lacks first: xdotool's
        // own remapping races the app (docs/desktop.md)
        Checked::Type(t) => (
            format!(
                "if [ -x {TYPE} ]; then {TYPE} {q}; else xdotool type --delay 12 -- {q}; fi",
                q = shell_quote(t)
            ),
            format!("typed {} characters", t.chars().count()),
        ),
        Checked::Keys(combos) => {
            let names: Vec<String> = combos
                .iter()
                .map(|c| c.iter().map(|k| k.keysym).collect::<Vec<_>>().join("+"))
                .collect();
            (
                format!("xdotool key --delay 50 -- {}", names.join(" ")),
                format!("pressed {}", names.join(" ")),
            )
        }
        Checked::Scroll {
            at: p,
            button,
            notches,
        } => {
            let mut cmd = String::from("xdotool");
            if let Some(p) = p {
                let (x, y) = at("coordinate", *p)?;
                cmd.push_str(&format!(" mousemove {x} {y}"));
            }
            cmd.push_str(&format!(
                " click --repeat {notches} --delay 30 {}",
                button_number(*button)
            ));
            (
                cmd,
                format!("scrolled {} {notches} notches", button_word(*button)),
            )
        }
        Checked::Cursor => (
            "xdotool getmouselocation --shell".into(),
            "the pointer's position".into(),
        ),
        Checked::Shot | Checked::Wait(_) => unreachable!("handled before"),
    })
}

/// Run a checked action on the desktop; `remembered`: its scale is the size the last
/// screenshot showed, which the guest checks first.
async fn desktop(
    v: &Verbs,
    vm: &str,
    c: &Checked,
    scale: Option<Scale>,
    remembered: bool,
    ct: &CancellationToken,
) -> Result<(String, Option<[u32; 2]>)> {
    let (mut cmd, said) = xdotool(c, scale)?;
    if let Some(s) = scale.filter(|_| remembered) {
        cmd = format!("{}{cmd}", same_size(FRAMEBUFFER, s.screen));
    }
    // tagged, so that a call that times out or is cancelled stops typing in the guest
    let id = uuid::Uuid::new_v4().simple().to_string();
    let script = format!(
        "export {}={id}; {}{cmd}",
        super::exec::CALL_TAG,
        xdotool_preamble(vm)
    );
    let timeout = match c {
        // 12 ms a character, 50 ms a key bound, and the guest's own pace under emulation
        Checked::Type(t) => ACTION_TIMEOUT + Duration::from_millis(100) * t.chars().count() as u32,
        _ => ACTION_TIMEOUT,
    };
    let kill = super::exec::kill_script(&id);
    let out = super::helper_stopped(v, vm, &script, None, 4096, timeout, ct, Some(&kill)).await?;
    if let Checked::Cursor = c {
        let out = String::from_utf8_lossy(&out);
        let field = |k: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(k)?.trim().parse::<u32>().ok())
        };
        let (Some(x), Some(y)) = (field("X="), field("Y=")) else {
            return Err(VerbError::failed(format!(
                "VM {vm}'s desktop did not say where the pointer is"
            )));
        };
        let (x, y) = scale.expect("cursor is scaled").to_shown((x, y));
        return Ok((format!("the pointer is at ({x}, {y})"), Some([x, y])));
    }
    Ok((said, None))
}

/// Key events for one combination: held keys down in order, then up in reverse; shift held
/// around a shifted character.
fn key_events(combo: &[keys::Key], out: &mut Vec<InputEvent>) {
    let mut down: Vec<&str> = Vec::new();
    for k in combo {
        if k.shifted && !down.contains(&"shift") {
            down.push("shift");
        }
        down.push(k.qcode);
    }
    for q in &down {
        out.push(InputEvent::Key {
            qcode: (*q).into(),
            down: true,
        });
    }
    for q in down.iter().rev() {
        out.push(InputEvent::Key {
            qcode: (*q).into(),
            down: false,
        });
    }
}

/// The console's events for a checked action.
fn console_events(c: &Checked, scale: Option<Scale>) -> Result<(Vec<InputEvent>, String)> {
    let at = |what: &str, p: [i64; 2]| -> Result<InputEvent> {
        let (x, y) = scale
            .expect("scaled actions have a scale")
            .to_screen(what, p)?;
        Ok(InputEvent::Move { x, y })
    };
    let press = |button, out: &mut Vec<InputEvent>| {
        out.push(InputEvent::Button { button, down: true });
        out.push(InputEvent::Button {
            button,
            down: false,
        });
    };
    let mut ev = Vec::new();
    let said = match c {
        Checked::Type(t) => {
            if t.len() > MAX_CONSOLE_TEXT {
                return Err(refuse(format!(
                    "the console types at most {MAX_CONSOLE_TEXT} characters at a time (its keyboard takes about 40 a second): type it in parts"
                )));
            }
            for ch in t.chars() {
                let k = keys::of_char(ch).ok_or_else(|| {
                    refuse(format!(
                        "the console's keyboard is a US one: it has no key for {ch:?}; type ASCII there, or use a VM with the desktop layer for other text"
                    ))
                })?;
                key_events(&[k], &mut ev);
            }
            format!("typed {} characters", t.chars().count())
        }
        Checked::Keys(combos) => {
            for c in combos {
                key_events(c, &mut ev);
            }
            format!(
                "pressed {}",
                combos
                    .iter()
                    .map(|c| c.iter().map(|k| k.keysym).collect::<Vec<_>>().join("+"))
                    .collect::<Vec<_>>()
                    .join(" ")
            )
        }
        Checked::Click {
            at: p,
            button,
            count,
            held,
        } => {
            if let Some(p) = p {
                ev.push(at("coordinate", *p)?);
            }
            for k in held {
                ev.push(InputEvent::Key {
                    qcode: k.qcode.into(),
                    down: true,
                });
            }
            for _ in 0..*count {
                press(*button, &mut ev);
            }
            for k in held.iter().rev() {
                ev.push(InputEvent::Key {
                    qcode: k.qcode.into(),
                    down: false,
                });
            }
            format!("clicked the {} button {count}×", button_word(*button))
        }
        Checked::Move(p) => {
            ev.push(at("coordinate", *p)?);
            format!("moved the pointer to ({}, {})", p[0], p[1])
        }
        Checked::Drag(from, to) => {
            ev.push(at("start_coordinate", *from)?);
            ev.push(InputEvent::Button {
                button: PointerButton::Left,
                down: true,
            });
            ev.push(at("coordinate", *to)?);
            ev.push(InputEvent::Button {
                button: PointerButton::Left,
                down: false,
            });
            format!(
                "dragged from ({}, {}) to ({}, {})",
                from[0], from[1], to[0], to[1]
            )
        }
        Checked::Scroll {
            at: p,
            button,
            notches,
        } => {
            if let Some(p) = p {
                ev.push(at("coordinate", *p)?);
            }
            for _ in 0..*notches {
                press(*button, &mut ev);
            }
            format!("scrolled {} {notches} notches", button_word(*button))
        }
        Checked::Cursor => {
            return Err(VerbError::invalid(
                "the hypervisor's screen does not report where the guest's pointer is: use a VM with the desktop layer",
            ));
        }
        Checked::Shot | Checked::Wait(_) => unreachable!("handled before"),
    };
    Ok((ev, said))
}

async fn console_act(
    backend: &Arc<dyn Backend>,
    vm: &str,
    c: &Checked,
    scale: Option<Scale>,
) -> Result<(String, Option<[u32; 2]>)> {
    let (events, said) = console_events(c, scale)?;
    backend
        .send_input(vm, &events)
        .await
        .map_err(|e| backend_error(vm, e))?;
    Ok((said, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn action(v: serde_json::Value) -> Result<Checked> {
        serde_json::from_value::<Action>(v)
            .map_err(|e| VerbError::invalid(e.to_string()))?
            .check()
    }

    #[test]
    fn the_action_set_is_anthropics() {
        use serde_json::json;
        assert_eq!(
            action(json!({"action": "screenshot"})).unwrap(),
            Checked::Shot
        );
        assert!(matches!(
            action(json!({"action": "left_click", "coordinate": [10, 20]})).unwrap(),
            Checked::Click {
                at: Some([10, 20]),
                count: 1,
                ..
            }
        ));
        assert!(matches!(
            action(json!({"action": "double_click"})).unwrap(),
            Checked::Click {
                at: None,
                count: 2,
                ..
            }
        ));
        assert!(matches!(
            action(json!({"action": "left_click_drag", "start_coordinate": [1, 2], "coordinate": [3, 4]})).unwrap(),
            Checked::Drag([1, 2], [3, 4])
        ));
        assert!(matches!(
            action(json!({"action": "key", "text": "ctrl+s Return"})).unwrap(),
            Checked::Keys(k) if k.len() == 2 && k[0].len() == 2
        ));
        assert!(matches!(
            action(json!({"action": "scroll", "coordinate": [5, 5], "scroll_direction": "down", "scroll_amount": 2})).unwrap(),
            Checked::Scroll { notches: 2, button: PointerButton::WheelDown, .. }
        ));
        assert!(matches!(
            action(json!({"action": "wait", "duration": 0.5})).unwrap(),
            Checked::Wait(d) if d == Duration::from_millis(500)
        ));
        assert_eq!(
            action(json!({"action": "cursor_position"})).unwrap(),
            Checked::Cursor
        );
    }

    #[test]
    fn bad_actions_are_refused_saying_why_and_that_nothing_was_sent() {
        use serde_json::json;
        for (bad, says) in [
            (json!({"action": "mouse_move"}), "needs coordinate"),
            (
                json!({"action": "left_click_drag", "coordinate": [1, 1]}),
                "needs start_coordinate",
            ),
            (json!({"action": "type"}), "needs text"),
            (json!({"action": "type", "text": "a\u{1b}[2J"}), "U+001B"),
            (
                json!({"action": "type", "text": "x".repeat(MAX_TEXT + 1)}),
                "over the",
            ),
            (json!({"action": "key", "text": "ctrl+Foo"}), "no key `Foo`"),
            (json!({"action": "key", "text": " "}), "key needs text"),
            (
                json!({"action": "left_click", "text": "a"}),
                "modifiers only",
            ),
            (
                json!({"action": "screenshot", "coordinate": [1, 1]}),
                "does not take coordinate",
            ),
            (
                json!({"action": "scroll", "scroll_direction": "up", "scroll_amount": 0}),
                "not 1..",
            ),
            (json!({"action": "scroll"}), "needs scroll_direction"),
            (json!({"action": "wait", "duration": -1.0}), "not 0.."),
            (json!({"action": "wait", "duration": 1e9}), "not 0.."),
        ] {
            let e = action(bad.clone()).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
            assert!(e.contains("nothing was sent"), "{bad}: {e}");
        }
        assert!(action(json!({"action": "fly"})).is_err());
        assert!(action(json!({"action": "screenshot", "extra": 1})).is_err());
    }

    #[test]
    fn desktop_commands_quote_text_and_scale_coordinates() {
        let scale = Some(Scale::for_model(1920, 1080));
        // the text reaches the typist as one argument, whatever it holds (here: xdotool, as a
        // guest without the desktop layer's typist runs it)
        let text = "a'; reboot; '\nb $(id) `id` \"q\" é✓";
        let (cmd, said) = xdotool(&Checked::Type(text.into()), None).unwrap();
        assert_eq!(said, "typed 33 characters");
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("xdotool() {{ printf %s \"$5\"; }}; {cmd}"))
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), text);
        let (cmd, _) = xdotool(
            &Checked::Click {
                at: Some([683, 384]),
                button: PointerButton::Right,
                count: 1,
                held: combo("ctrl+shift").unwrap(),
            },
            scale,
        )
        .unwrap();
        assert_eq!(
            cmd,
            "xdotool mousemove 961 540 keydown Control_L keydown Shift_L click --repeat 1 --delay 100 3 keyup Shift_L keyup Control_L"
        );
        let e = xdotool(&Checked::Move([1365, 0]), scale)
            .unwrap_err()
            .to_string();
        assert!(e.contains("off the screen"), "{e}");
    }

    /// The wait for a starting desktop is valid shell, and ends at once on a machine with none.
    #[test]
    fn the_wait_for_a_desktop_is_shell_and_ends() {
        let t = std::time::Instant::now();
        let o = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("{WAIT_FOR_DESKTOP}echo waited"))
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&o.stdout), "waited\n", "{o:?}");
        assert!(t.elapsed() < Duration::from_secs(10));
    }

    /// A read that fails because the framebuffer went meanwhile prints nothing and succeeds
    /// (read again); any other failure keeps its status.
    #[test]
    fn a_framebuffer_gone_while_read_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let fb = dir.path().join("Xvfb_screen0");
        let run = |read: &str| {
            std::fs::write(&fb, "x").unwrap();
            let script = framebuffer_script("d1", read)
                .replace(FRAMEBUFFER, fb.to_str().unwrap())
                .replace(WAIT_FOR_DESKTOP, "");
            std::process::Command::new("sh")
                .args(["-c", &script])
                .output()
                .unwrap()
        };
        let o = run("cat");
        assert_eq!((o.status.code(), &o.stdout[..]), (Some(0), &b"x"[..]));
        let o = run(&format!("rm -f {}; cat", fb.display()));
        assert_eq!(
            (o.status.code(), &o.stdout[..]),
            (Some(0), &b""[..]),
            "gone: read again"
        );
        let o = run("false");
        assert_eq!(o.status.code(), Some(1), "a failure of its own");
    }

    /// An action checks in the guest that the screen is the size of the last screenshot.
    #[test]
    fn an_action_is_refused_when_the_screen_changed_size() {
        let dir = tempfile::tempdir().unwrap();
        let fb = dir.path().join("Xvfb_screen0");
        std::fs::write(&fb, xwd::tests::xwd(1280, 800, |_, _| [0, 0, 0])).unwrap();
        let run = |size| {
            std::process::Command::new("sh")
                .arg("-c")
                .arg(format!(
                    "{}echo acted",
                    same_size(fb.to_str().unwrap(), size)
                ))
                .output()
                .unwrap()
        };
        let o = run((1280, 800));
        assert_eq!(String::from_utf8_lossy(&o.stdout), "acted\n");
        let o = run((1920, 1080));
        assert_eq!(o.status.code(), Some(5));
        assert!(o.stdout.is_empty());
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains("now 1280×800, not the 1920×1080"), "{e}");
        // a display starting again: Xvfb's new file is zeros until it writes the header
        std::fs::write(&fb, vec![0u8; 4096]).unwrap();
        let o = run((1280, 800));
        assert_eq!(o.status.code(), Some(5));
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains("starting again"), "{e}");
        // the display's mark of its size: believed without reading the framebuffer; another
        // size's mark is not
        std::fs::write(dir.path().join("size-1280x800"), "").unwrap();
        let o = run((1280, 800));
        assert_eq!(String::from_utf8_lossy(&o.stdout), "acted\n");
        let o = run((1024, 768));
        assert_eq!(o.status.code(), Some(5), "the header still says");
    }

    #[test]
    fn console_keys_hold_shift_for_shifted_characters_and_refuse_what_a_us_keyboard_lacks() {
        let (ev, _) = console_events(&Checked::Type("A!".into()), None).unwrap();
        let keys: Vec<String> = ev
            .iter()
            .map(|e| match e {
                InputEvent::Key { qcode, down } => {
                    format!("{}{qcode}", if *down { "+" } else { "-" })
                }
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(
            keys,
            [
                "+shift", "+a", "-a", "-shift", "+shift", "+1", "-1", "-shift"
            ]
        );
        let long = console_events(&Checked::Type("a".repeat(MAX_CONSOLE_TEXT + 1)), None);
        assert!(long.unwrap_err().to_string().contains("at most 256"));
        let e = console_events(&Checked::Type("é".into()), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("US one") && e.contains("nothing was sent"),
            "{e}"
        );
        let (ev, _) = console_events(
            &Checked::Keys(vec![combo("ctrl+alt+Delete").unwrap()]),
            None,
        )
        .unwrap();
        assert_eq!(ev.len(), 6);
    }
}

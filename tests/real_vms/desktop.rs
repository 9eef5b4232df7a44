//! A desktop and computer use (issue 34, docs/desktop.md): a VM made with `headless: false`
//! runs the desktop layer's X display; a small Tk app started in it is found in a screenshot
//! (by its colours, not by asking the guest), clicked through `vm_computer` (the official MCP
//! SDK as the client) so that it writes a file; `type` fills its text field exactly, unicode
//! included; bad actions are refused and change nothing; `boxery screenshot` saves the same
//! screen for a person.

use std::path::Path;
use std::time::Duration;

use super::{Kind, RealHome, bounded, common, repo};

/// The app: a text field (cyan) and a button (magenta) that saves the field's text to
/// /tmp/clicked.txt (written whole, then renamed).
const APP: &str = r##"import os, tkinter as tk
root = tk.Tk()
root.title("boxery-test")
root.geometry("640x360+200+150")
entry = tk.Entry(root, bg="#00ffff", font=("DejaVu Sans", 20))
entry.pack(fill="x", padx=30, pady=30, ipady=12)
def save():
    with open("/tmp/clicked.tmp", "w", encoding="utf-8") as f:
        f.write(entry.get())
    os.replace("/tmp/clicked.tmp", "/tmp/clicked.txt")
button = tk.Button(root, text="Save", bg="#ff00ff", activebackground="#ff00ff",
                   font=("DejaVu Sans", 20), command=save)
button.pack(fill="both", expand=True, padx=30, pady=30)
root.mainloop()
"##;

/// What a test types: accents, a symbol, CJK.
const TEXT: &str = "héllo wörld ✓ 日本 <&>";

/// The centre of the pixels of exactly `rgb` in the PNG at `path`, and how many there are.
fn find(path: &Path, rgb: [u8; 3]) -> Option<([i64; 2], usize)> {
    let img = image::open(path).unwrap().into_rgb8();
    let (mut x0, mut y0, mut x1, mut y1, mut n) = (u32::MAX, u32::MAX, 0, 0, 0usize);
    for (x, y, p) in img.enumerate_pixels() {
        if p.0 == rgb {
            (x0, y0, x1, y1) = (x0.min(x), y0.min(y), x1.max(x), y1.max(y));
            n += 1;
        }
    }
    (n > 0).then(|| ([(x0 + x1) as i64 / 2, (y0 + y1) as i64 / 2], n))
}

/// Run `actions` through `vm_computer` with the official MCP SDK; the results, each with the
/// path of its image.
fn computer(
    h: &RealHome,
    vm: &str,
    out: &Path,
    actions: serde_json::Value,
) -> Vec<serde_json::Value> {
    tool_calls(h, "computer", vm, out, actions)
}

/// Run `actions` through `vm_MODE` (computer, browser) with the official MCP SDK; the results,
/// each with the path of its image.
fn tool_calls(
    h: &RealHome,
    mode: &str,
    vm: &str,
    out: &Path,
    actions: serde_json::Value,
) -> Vec<serde_json::Value> {
    std::fs::create_dir_all(out).unwrap();
    let mut py = std::process::Command::new(common::python_with("mcp"));
    py.arg(repo().join("tests/mcp/client.py"))
        .args([mode, common::bin(), vm])
        .arg(out)
        .arg(actions.to_string());
    for (k, v) in h.home.cmd().get_envs() {
        if let Some(v) = v {
            py.env(k, v);
        }
    }
    py.env("BOXERY_BACKEND", h.kind.name());
    let o = bounded(py, Duration::from_secs(600)).expect("the MCP client finished");
    assert!(
        o.status.success(),
        "vm_{mode}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let r = std::fs::read_to_string(out.join("results.json")).unwrap();
    serde_json::from_str(&r).unwrap()
}

/// The file the app saves, once it is there (at most 60 s).
fn saved(h: &RealHome, vm: &str) -> String {
    h.run(
        vm,
        "for i in $(seq 300); do [ -e /tmp/clicked.txt ] && break; sleep 0.2; done; cat /tmp/clicked.txt && rm /tmp/clicked.txt",
    )
}

pub(super) fn desktop_computer_use(kind: Kind) {
    let h = RealHome::new(kind);
    // (with the API: `boxery desktop` through a context, below)
    let serve = h.serve_args(&["--api-listen", "127.0.0.1:0"], &[]);
    serve.wait_leading();
    // the example in docs/desktop.md, as it is: desk1
    h.apply_file(&repo().join("manifests/examples/desktop-vm.yaml"), "45m");
    // headless: false is the desktop layer
    let layers = h.ok(&["get", "vm", "desk1", "-o", "jsonpath={.spec.layers}"]);
    assert!(layers.contains("desktop"), "{layers}");
    // a person's screenshot straight after the VM is Ready: it waits for the desktop to
    // come up (some seconds after sshd at boot)
    let png = h.home.path().join("screen.png");
    let said = h.ok(&["screenshot", "desk1", png.to_str().unwrap()]);
    assert!(
        said.contains("1280×800") && said.contains("desktop"),
        "{said}"
    );
    // the display unit settles (its start ends once the display answers; slow at boot)
    h.run(
        "desk1",
        "for i in $(seq 600); do systemctl is-active -q boxery-desktop && exit 0; sleep 0.2; done; systemctl status boxery-desktop; exit 1",
    );
    // the app, started as the agent user from an ssh session, on the desktop
    let app = h.home.write("app.py", APP);
    h.ok(&["cp", app.to_str().unwrap(), "desk1:/tmp/app.py"]);
    h.run(
        "desk1",
        "(DISPLAY=:0 setsid nohup python3 /tmp/app.py >/tmp/app.log 2>&1 &); DISPLAY=:0 timeout 120 xdotool search --sync --onlyvisible --name boxery-test >/dev/null",
    );
    // the whole screen again, with the app
    let said = h.ok(&["screenshot", "desk1", png.to_str().unwrap()]);
    assert!(
        said.contains("1280×800") && said.contains("desktop"),
        "{said}"
    );
    let (button, _) = find(&png, [255, 0, 255]).expect("the button (magenta) is on the screen");
    let (field, _) = find(&png, [0, 255, 255]).expect("the text field (cyan) is on the screen");
    // an agent's: vm_computer finds the same, and clicks it
    let out = h.home.path().join("mcp");
    let r = computer(
        &h,
        "desk1",
        &out.join("1"),
        serde_json::json!([
            {"action": "screenshot"},
            {"action": "left_click", "coordinate": button},
            {"action": "screenshot", "console": true},
        ]),
    );
    // the hypervisor's screen of the same VM: its text console
    assert_eq!(r[2]["data"]["path"], "console", "{:?}", r[2]);
    assert_eq!(r[2]["data"]["shot"]["width"], 720, "{:?}", r[2]);
    let console = h.home.path().join("console.png");
    let said = h.ok(&[
        "screenshot",
        "desk1",
        "--console",
        console.to_str().unwrap(),
    ]);
    assert!(
        said.contains("720×400") && said.contains("console"),
        "{said}"
    );
    let shot = Path::new(
        r[0]["image"]
            .as_str()
            .expect("the screenshot is image content"),
    );
    assert_eq!(r[0]["data"]["shot"]["width"], 1280, "{:?}", r[0]);
    assert_eq!(r[0]["data"]["path"], "desktop", "{:?}", r[0]);
    assert_eq!(find(shot, [255, 0, 255]).map(|f| f.0), Some(button));
    assert_eq!(saved(&h, "desk1"), "", "the click saved the empty field");
    // type fills the field exactly; bad actions are refused and send nothing
    let r = computer(
        &h,
        "desk1",
        &out.join("2"),
        serde_json::json!([
            {"action": "left_click", "coordinate": field},
            {"action": "type", "text": TEXT},
            {"action": "left_click", "coordinate": [1280, 10], "expect_error": true},
            {"action": "key", "text": "ctrl+Bogus", "expect_error": true},
            {"action": "type", "text": "no\u{1b}[2J", "expect_error": true},
            {"action": "left_click", "coordinate": button},
            {"action": "mouse_move", "coordinate": [640, 700]},
            {"action": "cursor_position"},
        ]),
    );
    assert!(
        r[2]["text"].as_str().unwrap().contains("off the screen"),
        "{:?}",
        r[2]
    );
    assert!(
        r[3]["text"].as_str().unwrap().contains("no key `Bogus`"),
        "{:?}",
        r[3]
    );
    assert!(
        r[4]["text"].as_str().unwrap().contains("U+001B"),
        "{:?}",
        r[4]
    );
    assert_eq!(
        r[7]["data"]["cursor"],
        serde_json::json!([640, 700]),
        "{:?}",
        r[7]
    );
    assert_eq!(saved(&h, "desk1"), TEXT);
    let took: Vec<f64> = r.iter().map(|a| a["seconds"].as_f64().unwrap()).collect();
    eprintln!("vm_computer actions took {took:?} s");
    watched_live(&h, &png, button);
    watched_through_a_context(&h);
    // another screen size on the running VM (spec.display): the desktop starts again at it,
    // and every screenshot meanwhile is whole, at the old size or the new one
    h.ok(&[
        "patch",
        "vm",
        "desk1",
        "--type=merge",
        "-p",
        r#"{"spec":{"display":{"width":1024,"height":768}}}"#,
    ]);
    let t = std::time::Instant::now();
    loop {
        let said = h.ok(&["screenshot", "desk1", png.to_str().unwrap()]);
        if said.contains("1024×768") {
            break;
        }
        assert!(said.contains("1280×800"), "{said}");
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the display is still not 1024x768: {said}"
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    eprintln!("the display took {:?} to change size", t.elapsed());
    assert_eq!(
        image::open(&png).unwrap().into_rgb8().dimensions(),
        (1024, 768)
    );
    display_health(&h);
    h.ok(&["delete", "vm", "desk1", "--wait", "--timeout", "5m"]);
    drop(serve);
}

/// `DisplayReady` follows the display: `True` at its size; the display stopped, `False`
/// saying the unit's state; started again, `True`; killed, systemd starts it again and the
/// condition is `True` again.
fn display_health(h: &RealHome) {
    let condition = |h: &RealHome| {
        let v = h.vm_json("desk1");
        v["status"]["conditions"]
            .as_array()
            .and_then(|a| a.iter().find(|c| c["type"] == "DisplayReady").cloned())
            .unwrap_or_default()
    };
    let until = |h: &RealHome, status: &str, says: &str| {
        let t = std::time::Instant::now();
        common::eventually(Duration::from_secs(60), || {
            let c = condition(h);
            (c["status"] == status && c["message"].as_str().unwrap_or_default().contains(says))
                .then_some(c)
        })
        .unwrap_or_else(|| panic!("DisplayReady is not {status} ({says}): {}", condition(h)));
        t.elapsed()
    };
    // (asked every 15 s: the new size within that)
    let took = until(h, "True", "answers at 1024x768");
    let c = condition(h);
    assert_eq!(c["reason"], "DisplayAnswers", "{c}");
    h.run("desk1", "sudo systemctl stop boxery-desktop.service");
    let down = until(h, "False", "boxery-desktop.service is inactive");
    let c = condition(h);
    assert_eq!(c["reason"], "DisplayDown", "{c}");
    assert!(
        c["message"]
            .as_str()
            .unwrap()
            .contains("boxery-desktop.service is inactive"),
        "{c}"
    );
    h.run("desk1", "sudo systemctl start boxery-desktop.service");
    let up = until(h, "True", "answers at 1024x768");
    // killed: systemd starts it again (another Xvfb), and the condition is True again
    let pid = |h: &RealHome| {
        h.run(
            "desk1",
            "systemctl show -p MainPID --value boxery-desktop.service",
        )
    };
    let before = pid(h);
    h.run(
        "desk1",
        "sudo kill -KILL \"$(systemctl show -p MainPID --value boxery-desktop.service)\"",
    );
    common::eventually(Duration::from_secs(60), || {
        let now = pid(h);
        (now != before && now != "0").then_some(())
    })
    .expect("systemd starts the killed display again");
    until(h, "True", "answers at 1024x768");
    eprintln!(
        "DisplayReady: True {:.1} s after the size change, False {:.1} s after a stop, True {:.1} s after a start",
        took.as_secs_f64(),
        down.as_secs_f64(),
        up.as_secs_f64()
    );
}

/// `boxery desktop` watched in a real browser (Debian's chromium through Playwright): the
/// canvas shows what a screenshot shows; the link works once and nothing answers without it;
/// view only, a click does nothing; with `--control` the same click reaches the app.
fn watched_live(h: &RealHome, png: &Path, button: [i64; 2]) {
    h.run("desk1", "rm -f /tmp/clicked.txt");
    let shot = h.ok(&["screenshot", "desk1", png.to_str().unwrap()]);
    assert!(shot.contains("1280×800"), "{shot}");
    let (mut server, url) = Desktop::start(h, &[]);
    let port = url
        .strip_prefix("http://127.0.0.1:")
        .and_then(|r| r.split('/').next())
        .expect("a loopback link")
        .to_string();
    let token = url.split("token=").nth(1).expect("a token in the link");
    // nothing without the link's token, nor for another host name
    assert_eq!(http_status(&port, "/vnc.html", "127.0.0.1"), 403);
    assert_eq!(http_status(&port, "/websockify", "127.0.0.1"), 403);
    assert_eq!(http_status(&port, "/?token=0000", "127.0.0.1"), 403);
    let other = format!("/?token={token}");
    assert_eq!(http_status(&port, &other, "rebound.example"), 403);
    // a person's browser: the screen, then a click at the app's button (view only)
    let canvas = png.with_file_name("canvas.png");
    let t = std::time::Instant::now();
    let said = browser(&url, &canvas, Some(button));
    eprintln!("the browser showed the desktop in {:?}", t.elapsed());
    assert_eq!(said["status"], 200, "{said}");
    assert_eq!(
        image::open(&canvas).unwrap().into_rgb8().dimensions(),
        (1280, 800)
    );
    assert_eq!(
        find(&canvas, [255, 0, 255]).map(|f| f.0),
        Some(button),
        "the canvas shows the button where the screenshot does"
    );
    assert_eq!(
        find(&canvas, [0, 255, 255]).map(|f| f.0),
        find(png, [0, 255, 255]).map(|f| f.0)
    );
    // the link was spent; the session lives under a path only the browser learned
    assert_eq!(http_status(&port, &other, "127.0.0.1"), 403);
    let page = said["final"].as_str().unwrap().to_string();
    let session = page
        .split_once(&format!("127.0.0.1:{port}"))
        .and_then(|(_, p)| p.split_once("/vnc.html"))
        .map(|(s, _)| s.to_string())
        .expect("the viewer is under a session path");
    assert!(
        session.starts_with("/s/") && session.len() > 60,
        "{session}"
    );
    assert_eq!(
        http_status(&port, &format!("{session}/vnc.html"), "127.0.0.1"),
        200
    );
    assert_eq!(http_status(&port, "/s/0000/vnc.html", "127.0.0.1"), 403);
    // a websocket from another page is refused
    let upgrade = "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n";
    assert_eq!(
        http_status_with(
            &port,
            &format!("{session}/websockify"),
            "127.0.0.1",
            &format!("{upgrade}Origin: http://evil.example\r\n")
        ),
        403
    );
    std::thread::sleep(Duration::from_secs(2));
    h.run(
        "desk1",
        "test ! -e /tmp/clicked.txt || { echo 'a view-only click reached the app' >&2; exit 1; }",
    );
    server.stop();
    // with control, the same click saves the field
    let (mut server, url) = Desktop::start(h, &["--control"]);
    let said = browser(&url, &canvas, Some(button));
    assert_eq!(said["status"], 200, "{said}");
    assert_eq!(saved(h, "desk1"), TEXT);
    server.stop();
    // every viewer's x11vnc ended with its page
    h.run(
        "desk1",
        "for i in $(seq 100); do pgrep -x x11vnc >/dev/null || exit 0; sleep 0.2; done; pgrep -a x11vnc; exit 1",
    );
}

/// `boxery desktop` on another machine, through a context to this one's API (the way `boxery
/// ssh` goes): the link leads to the viewer, and its websocket carries the guest's VNC server
/// (its RFB greeting).
fn watched_through_a_context(h: &RealHome) {
    let laptop = super::laptop_of(h);
    let mut c = laptop.cmd();
    c.env("BOXERY_CONTEXT", "vmhost");
    let (mut server, url) = Desktop::start_with(c, "desk1", &[]);
    let mut ws = Ws::open(&url);
    assert_eq!(
        ws.read(12),
        b"RFB 003.008\n",
        "the guest VNC server's greeting"
    );
    drop(ws);
    server.stop();
}

/// A VM without a desktop watched live: `boxery desktop` serves its console, QEMU's own screen
/// of it, from the VM's VNC server (qemu: the VM's own socket; libvirt: a socket pair libvirt
/// hands QEMU). A viewer's handshake, the screen's size (the console
/// screenshot's), and a whole picture; view only, the keys and pointer it sends are dropped
/// and the stream goes on; with `--control` the same.
pub(super) fn console_watched_live(kind: Kind) {
    let h = RealHome::new(kind);
    let serve = h.serve_args(&["--api-listen", "127.0.0.1:0"], &[]);
    serve.wait_leading();
    let f = h.home.write("con.yaml", &super::tiny_vm("con1"));
    h.apply_file(&f, "10m");
    let png = h.home.path().join("console.png");
    let said = h.ok(&["screenshot", "con1", "--console", png.to_str().unwrap()]);
    for extra in [&[][..], &["--control"][..]] {
        let (mut server, url) = Desktop::start_with(boxery(&h), "con1", extra);
        let t = std::time::Instant::now();
        let mut ws = Ws::open(&url);
        let (w, ht, bpp) = rfb_handshake(&mut ws);
        assert!(
            said.contains(&format!("{w}×{ht}")),
            "the console's size {w}x{ht}, as its screenshot: {said}"
        );
        // keys and the pointer (dropped unless --control), then a request for the whole screen
        ws.send(&[2, 0, 0, 1, 0, 0, 0, 0]); // raw encoding only
        ws.send(&[4, 1, 0, 0, 0, 0, 0, 0x61]);
        ws.send(&[5, 1, 0, 10, 0, 20]);
        let picture = whole_picture(&mut ws, w, ht, bpp);
        eprintln!(
            "console {w}x{ht} over VNC ({}): a whole picture of {picture} bytes {:.1} s after the link",
            extra.first().unwrap_or(&"view only"),
            t.elapsed().as_secs_f64()
        );
        // and again: the stream goes on
        whole_picture(&mut ws, w, ht, bpp);
        drop(ws);
        server.stop();
    }
    console_through_a_context(&h, &said);
    h.ok(&["delete", "vm", "con1", "--wait", "--timeout", "3m"]);
    drop(serve);
}

/// The console of `con1` watched from another machine through a context (the VM's host makes
/// the viewer at its API's screen endpoint, and filters a view-only one there: what the filter
/// drops is `guest::rfb`'s tests'): view only and with control, the handshake gives the same
/// screen (`said`: its console screenshot's words) and whole pictures come after a key and a
/// pointer event. A token of scope read may not watch it.
fn console_through_a_context(h: &RealHome, said: &str) {
    let laptop = super::laptop_of(h);
    for extra in [&[][..], &["--control"][..]] {
        let mut c = laptop.cmd();
        c.env("BOXERY_CONTEXT", "vmhost");
        let (mut server, url) = Desktop::start_with(c, "con1", extra);
        let mut ws = Ws::open(&url);
        let (w, ht, bpp) = rfb_handshake(&mut ws);
        assert!(
            said.contains(&format!("{w}×{ht}")),
            "the console's size {w}x{ht} through the context, as its screenshot: {said}"
        );
        ws.send(&[2, 0, 0, 1, 0, 0, 0, 0]);
        ws.send(&[4, 1, 0, 0, 0, 0, 0, 0x61]);
        ws.send(&[5, 1, 0, 10, 0, 20]);
        let picture = whole_picture(&mut ws, w, ht, bpp);
        eprintln!(
            "console {w}x{ht} through a context ({}): a whole picture of {picture} bytes",
            extra.first().unwrap_or(&"view only")
        );
        whole_picture(&mut ws, w, ht, bpp);
        drop(ws);
        server.stop();
    }
    let kc = h.home.write(
        "kc-ro.yaml",
        &h.ok(&["kubeconfig", "--scope", "read", "--name", "ro"]),
    );
    let mut c = laptop.cmd();
    c.args(["config", "add-context", "ro", "-f"]).arg(&kc);
    assert!(c.status().unwrap().success());
    let mut c = laptop.cmd();
    c.env("BOXERY_CONTEXT", "ro").args(["desktop", "con1"]);
    let o = super::bounded(c, std::time::Duration::from_secs(120)).expect("boxery desktop ends");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("scope read"),
        "a read token watches no screen: {err}"
    );
}

/// An RFB 3.8 client's handshake (security None, not shared): the screen's width, height and
/// bits per pixel.
fn rfb_handshake(ws: &mut Ws) -> (usize, usize, usize) {
    assert_eq!(ws.read(12), b"RFB 003.008\n");
    ws.send(b"RFB 003.008\n");
    let n = usize::from(ws.read(1)[0]);
    assert!(ws.read(n).contains(&1), "security None offered");
    ws.send(&[1]);
    assert_eq!(ws.read(4), [0, 0, 0, 0], "security result: OK");
    ws.send(&[0]);
    let init = ws.read(24);
    let be16 = |at: usize| usize::from(u16::from_be_bytes([init[at], init[at + 1]]));
    let name = u32::from_be_bytes([init[20], init[21], init[22], init[23]]) as usize;
    ws.read(name);
    (be16(0), be16(2), usize::from(init[4]))
}

/// Ask for the whole screen and read the update (raw rectangles): its pixels' bytes.
fn whole_picture(ws: &mut Ws, w: usize, h: usize, bpp: usize) -> usize {
    let [w1, w0] = (w as u16).to_be_bytes();
    let [h1, h0] = (h as u16).to_be_bytes();
    ws.send(&[3, 0, 0, 0, 0, 0, w1, w0, h1, h0]);
    let head = ws.read(4);
    assert_eq!(head[0], 0, "a framebuffer update");
    let rects = u16::from_be_bytes([head[2], head[3]]);
    let mut bytes = 0;
    for _ in 0..rects {
        let r = ws.read(12);
        let be16 = |at: usize| usize::from(u16::from_be_bytes([r[at], r[at + 1]]));
        assert_eq!(&r[8..12], &[0, 0, 0, 0], "raw encoding");
        let n = be16(4) * be16(6) * bpp / 8;
        ws.read(n);
        bytes += n;
    }
    assert_eq!(bytes, w * h * bpp / 8, "the whole screen");
    bytes
}

/// A websocket client of `boxery desktop`'s viewer, by hand (RFC 6455, binary frames): the
/// link followed (its token spent) to the session's websocket.
struct Ws {
    s: std::net::TcpStream,
    /// Bytes of the server's stream read but not taken.
    got: Vec<u8>,
}

impl Ws {
    fn open(url: &str) -> Ws {
        use std::io::{Read, Write};
        let host = url
            .strip_prefix("http://")
            .and_then(|r| r.split('/').next())
            .expect("a link")
            .to_string();
        let request = |head: &str| -> (std::net::TcpStream, String) {
            let mut s = std::net::TcpStream::connect(&host).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
            s.write_all(head.as_bytes()).unwrap();
            let mut got = Vec::new();
            let mut b = [0u8; 1];
            while !got.ends_with(b"\r\n\r\n") {
                assert_eq!(s.read(&mut b).unwrap(), 1, "a response head");
                got.push(b[0]);
            }
            (s, String::from_utf8_lossy(&got).into_owned())
        };
        let path = url.trim_start_matches(&format!("http://{host}"));
        let (mut s, head) = request(&format!(
            "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        ));
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let mut page = String::new();
        s.read_to_string(&mut page).unwrap();
        let session = page
            .split("\"/s/")
            .nth(1)
            .and_then(|r| r.split("/vnc.html").next())
            .map(|s| format!("/s/{s}"))
            .unwrap_or_else(|| panic!("the page leads to a session: {page}"));
        let (s, head) = request(&format!(
            "GET {session}/websockify HTTP/1.1\r\nHost: {host}\r\nOrigin: http://{host}\r\n\
             Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        ));
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        Ws { s, got: Vec::new() }
    }

    /// One binary frame, masked (as every client's).
    fn send(&mut self, data: &[u8]) {
        use std::io::Write;
        let key = [0x12, 0x34, 0x56, 0x78];
        let mut f = vec![0x82];
        match data.len() {
            n @ 0..=125 => f.push(0x80 | n as u8),
            n => {
                f.push(0x80 | 126);
                f.extend_from_slice(&(n as u16).to_be_bytes());
            }
        }
        f.extend_from_slice(&key);
        f.extend(data.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
        self.s.write_all(&f).unwrap();
    }

    /// The next `n` bytes of the server's stream, across frames.
    fn read(&mut self, n: usize) -> Vec<u8> {
        use std::io::Read;
        while self.got.len() < n {
            let mut h = [0u8; 2];
            self.s.read_exact(&mut h).unwrap();
            assert_eq!(h[0] & 0x0f, 2, "a binary frame: {h:?}");
            let len = match h[1] & 0x7f {
                126 => {
                    let mut l = [0u8; 2];
                    self.s.read_exact(&mut l).unwrap();
                    usize::from(u16::from_be_bytes(l))
                }
                127 => {
                    let mut l = [0u8; 8];
                    self.s.read_exact(&mut l).unwrap();
                    u64::from_be_bytes(l) as usize
                }
                l => usize::from(l),
            };
            let mut payload = vec![0u8; len];
            self.s.read_exact(&mut payload).unwrap();
            self.got.extend(payload);
        }
        self.got.drain(..n).collect()
    }
}

/// `boxery` of `h`'s home and backend, to finish and run.
fn boxery(h: &RealHome) -> std::process::Command {
    let mut c = h.home.cmd();
    c.env("BOXERY_BACKEND", h.kind.name());
    c
}

/// A running `boxery desktop`, stopped (and waited for) when dropped.
struct Desktop(std::process::Child);

impl Desktop {
    /// Start it; it and the link it printed.
    fn start(h: &RealHome, extra: &[&str]) -> (Desktop, String) {
        Self::start_with(boxery(h), "desk1", extra)
    }

    /// Start `boxery desktop VM` with `c` (a `boxery` command of some home); it and the link
    /// it printed.
    fn start_with(mut c: std::process::Command, vm: &str, extra: &[&str]) -> (Desktop, String) {
        use std::io::BufRead;
        c.args(["desktop", vm])
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit());
        let mut child = Desktop(c.spawn().expect("run boxery desktop"));
        let out = child.0.stdout.take().unwrap();
        let mut line = String::new();
        std::io::BufReader::new(out)
            .read_line(&mut line)
            .expect("boxery desktop prints its link");
        let url = line.trim().to_string();
        assert!(url.starts_with("http://127.0.0.1:"), "{url}");
        (child, url)
    }

    fn stop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Desktop {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The status of a GET of `path` at 127.0.0.1:`port`, naming `host` in its Host header.
fn http_status(port: &str, path: &str, host: &str) -> u16 {
    http_status_with(port, path, host, "")
}

/// [`http_status`] with more header lines (each ending in CRLF).
fn http_status_with(port: &str, path: &str, host: &str, headers: &str) -> u16 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(format!("127.0.0.1:{port}")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{headers}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut head = [0u8; 12];
    s.read_exact(&mut head).unwrap();
    String::from_utf8_lossy(&head[9..12]).parse().unwrap()
}

/// tests/desktop/browser.py on `url`: waits for the screen (1280×800, with the app's magenta
/// button), saves the canvas to `out`, clicks at `click` (screen pixels). Its JSON line.
fn browser(url: &str, out: &Path, click: Option<[i64; 2]>) -> serde_json::Value {
    let mut py = std::process::Command::new(common::python_with("playwright"));
    py.arg(repo().join("tests/desktop/browser.py"))
        .arg(url)
        .arg(out)
        .args(["1280x800", "ff00ff"]);
    if let Some([x, y]) = click {
        py.arg(format!("{x},{y}"));
    }
    let o = bounded(py, Duration::from_secs(300)).expect("the browser finished");
    assert!(
        o.status.success(),
        "the browser: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("one JSON line")
}

/// A form served in the guest (127.0.0.1:8000): its POST writes the name sent to
/// /tmp/submitted.txt (whole, then renamed) and answers "thanks NAME".
const FORM_SERVER: &str = r##"import html, http.server, os, urllib.parse
PAGE = '<!doctype html><meta charset="utf-8"><title>Form</title><form method="post" action="/submit"><input id="name" name="name"><button id="go" type="submit">Send</button></form>'
class H(http.server.BaseHTTPRequestHandler):
    def reply(self, body):
        b = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def do_GET(self):
        self.reply(PAGE)
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
        name = urllib.parse.parse_qs(body).get("name", [""])[0]
        with open("/tmp/submitted.tmp", "w", encoding="utf-8") as f:
            f.write(name)
        os.replace("/tmp/submitted.tmp", "/tmp/submitted.txt")
        self.reply('<!doctype html><meta charset="utf-8"><title>Thanks</title><p id="done">thanks %s</p>' % html.escape(name))
# a thread per connection: a browser's idle connection (Chromium opens sockets ahead of
# need) must not hold the page from the next client (it held Firefox's for 10 minutes)
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), H).serve_forever()
"##;

/// What the form is filled with: accents, a symbol, CJK, markup.
const NAME: &str = "Ada Lovelace ✓ 日本 <&>";

/// The agent's browser (`vm_browser`, the browser layer): a form served in the guest is opened,
/// filled and submitted, and the server sees exactly what was typed; a site outside the VM's
/// egress allow list is refused by the egress proxy (403, and why); bad actions send nothing.
pub(super) fn browser_driven_through_vm_browser(kind: Kind) {
    let h = RealHome::new(kind);
    let serve = h.serve();
    serve.wait_leading();
    let f = h.home.write(
        "web.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: web1}\nspec:\n  source: {image: debian-12}\n  layers: [browser]\n  display: {width: 1024, height: 768}\n  resources: {cpus: 1, memory: 2Gi}\n  network:\n    egress: {policy: Allowlist, allow: [allowed.test]}\n",
    );
    h.apply_file(&f, "45m");
    let layers = h.ok(&["get", "vm", "web1", "-o", "jsonpath={.spec.layers}"]);
    assert!(
        layers.contains("desktop") && layers.contains("browser"),
        "{layers}"
    );
    // the first boot's display starts at spec.display (the seed gives it), not at the default
    // and then again at the size the control plane pushes later
    let png = h.home.path().join("first.png");
    let said = h.ok(&["screenshot", "web1", png.to_str().unwrap()]);
    assert!(said.contains("1024×768"), "the first screenshot: {said}");
    // the egress proxy's address reaches the guest before the browser first starts
    common::eventually(Duration::from_secs(120), || {
        let o = h.cmd(&["run", "web1", "--", "grep -q http_proxy /run/boxery/env"]);
        o.status.success().then_some(())
    })
    .expect("the egress proxy settings reach the guest");
    let server = h.home.write("form.py", FORM_SERVER);
    h.ok(&["cp", server.to_str().unwrap(), "web1:/tmp/form.py"]);
    h.run(
        "web1",
        "(setsid nohup python3 /tmp/form.py </dev/null >/tmp/form.log 2>&1 &); for i in $(seq 300); do curl -sf -o /dev/null http://127.0.0.1:8000/ && exit 0; sleep 0.2; done; cat /tmp/form.log; exit 1",
    );
    let out = h.home.path().join("browser");
    let t = std::time::Instant::now();
    let r = tool_calls(
        &h,
        "browser",
        "web1",
        &out,
        serde_json::json!([
            {"action": "open", "url": "http://127.0.0.1:8000/", "timeout_seconds": 240},
            {"action": "fill", "selector": "#name", "text": NAME},
            {"action": "click", "selector": "#go"},
            {"action": "read"},
            {"action": "screenshot"},
            {"action": "evaluate", "expression": "document.querySelector('#done').textContent"},
            {"action": "click", "selector": "#nope", "expect_error": true},
            {"action": "open", "url": "file:///etc/passwd", "expect_error": true},
            {"action": "fill", "selector": "#name", "text": "a\u{1b}[2J", "expect_error": true},
            {"action": "open", "url": "http://blocked.test/"},
            {"action": "open", "url": "https://blocked.test/"},
        ]),
    );
    eprintln!("vm_browser: {} actions in {:?}", r.len(), t.elapsed());
    // minutes after the boot (the control plane's pushes done): the display started once
    let starts = h.run(
        "web1",
        "sudo -n journalctl -b -u boxery-desktop.service -o cat | grep -c '^Starting boxery-desktop' || true",
    );
    assert_eq!(
        starts.trim(),
        "1",
        "the display started again after the first boot"
    );
    let took: Vec<f64> = r.iter().map(|a| a["seconds"].as_f64().unwrap()).collect();
    eprintln!("vm_browser actions took {took:?} s");
    assert_eq!(r[0]["data"]["status"], 200, "{:?}", r[0]);
    assert_eq!(r[0]["data"]["title"], "Form", "{:?}", r[0]);
    assert_eq!(r[1]["data"]["value"], NAME, "{:?}", r[1]);
    // the server saw exactly what was typed
    let sent = h.run("web1", "cat /tmp/submitted.txt");
    assert_eq!(sent, NAME);
    assert_eq!(
        r[2]["data"]["url"], "http://127.0.0.1:8000/submit",
        "{:?}",
        r[2]
    );
    let text = r[3]["text"].as_str().unwrap();
    assert!(text.contains(&format!("thanks {NAME}")), "{text}");
    let shot = r[4]["image"]
        .as_str()
        .expect("a screenshot is image content");
    let (w, h_) = image::open(shot).unwrap().into_rgb8().dimensions();
    assert!(w >= 640 && h_ >= 400, "{w}x{h_}");
    assert_eq!(
        r[5]["data"]["value"],
        format!("thanks {NAME}"),
        "{:?}",
        r[5]
    );
    assert!(
        r[6]["text"]
            .as_str()
            .unwrap()
            .contains("no element matches"),
        "{:?}",
        r[6]
    );
    for i in [7, 8] {
        let t = r[i]["text"].as_str().unwrap();
        assert!(t.contains("nothing was sent"), "{t}");
    }
    // the egress policy applies to the browser: the proxy refuses, saying why
    assert_eq!(r[9]["data"]["status"], 403, "{:?}", r[9]);
    let refused = r[9]["text"].as_str().unwrap();
    assert!(
        refused.contains("blocked.test is not in VM web1's egress allow list"),
        "{refused}"
    );
    // https: Chromium says only that the tunnel failed; the driver asks the proxy why
    let refused = r[10].to_string();
    assert!(
        refused.contains("ERR_TUNNEL_CONNECTION_FAILED")
            && refused.contains("the egress proxy said 403 Forbidden")
            && refused.contains("blocked.test is not in VM web1's egress allow list"),
        "{refused}"
    );
    // and the CLI: the same browser, the page's text on stdout
    let page = h.ok(&["browser", "web1", "open", "http://blocked.test/"]);
    assert!(
        page.contains("not in VM web1's egress allow list"),
        "{page}"
    );
    // Firefox ESR is there too, and renders the guest's page (headless, as an agent's script
    // would run it). Its first start under emulation took 115 to 172 s: started on its own in
    // the guest and its end awaited with a bound of its own, so a slower start is not cut by
    // one command's 360 s bound.
    let t = std::time::Instant::now();
    h.run(
        "web1",
        "rm -f /tmp/ff.png /tmp/ff.rc; setsid -f sh -c 'timeout 900 firefox-esr --headless --window-size 800,600 --screenshot /tmp/ff.png http://127.0.0.1:8000/ >/tmp/ff.log 2>&1; echo $? > /tmp/ff.rc' </dev/null >/dev/null 2>&1",
    );
    let out = common::eventually(Duration::from_secs(960), || {
        let out = h.run(
            "web1",
            "[ -s /tmp/ff.rc ] && { echo rc=$(cat /tmp/ff.rc); stat -c %s /tmp/ff.png 2>/dev/null || tail -5 /tmp/ff.log; }; true",
        );
        if out.is_empty() {
            std::thread::sleep(Duration::from_secs(5));
        }
        (!out.is_empty()).then_some(out)
    })
    .unwrap_or_else(|| {
        panic!(
            "firefox-esr --headless --screenshot did not end within 960 s: {}",
            h.run("web1", "tail -5 /tmp/ff.log; ps -eo pid,etime,cmd | grep -i firef")
        )
    });
    eprintln!(
        "firefox-esr --headless --screenshot took {:?}: {out:?}",
        t.elapsed()
    );
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("rc=0"), "{out}");
    let bytes: u64 = lines.next().and_then(|l| l.parse().ok()).unwrap_or(0);
    assert!(bytes > 2000, "Firefox's screenshot of the form: {out}");
    // last (it leaves the guest busy for minutes): an endless script is stopped at the
    // action's time, and the page answers after it
    let r = tool_calls(
        &h,
        "browser",
        "web1",
        &h.home.path().join("browser-endless"),
        serde_json::json!([
            {"action": "evaluate", "expression": "while (true) {}", "timeout_seconds": 30, "expect_error": true},
            {"action": "evaluate", "expression": "1 + 1"},
        ]),
    );
    let stopped = r[0]["text"].as_str().unwrap_or_default();
    assert!(
        stopped.contains("ran past the action's time and was stopped"),
        "{:?}",
        r[0]
    );
    assert_eq!(r[1]["data"]["value"], 2, "{:?}", r[1]);
    h.ok(&["delete", "vm", "web1", "--wait", "--timeout", "5m"]);
    drop(serve);
}

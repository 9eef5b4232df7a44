//! Computer use (issue 34) against the limits it is built on, measured interleaved in one run
//! so the machine's drift hits both alike:
//!
//! - a desktop screenshot through MCP (`vm_computer` `screenshot`, one `boxery mcp` session:
//!   the framebuffer read gzipped over ssh, decoded, PNG-encoded, base64 in the tool result)
//!   against the bytes alone: a bare `ssh` over the same ControlMaster running the same
//!   `gzip -1 -c` of the framebuffer (and, for scale, a bare `cat` of it);
//! - an action through MCP (`vm_computer` `mouse_move`, coordinates checked against the
//!   screen's size read first) against a bare `ssh … xdotool mousemove`;
//! - the console's screenshot through MCP (`console: true`) against QEMU's own QMP
//!   `screendump` on the VM's monitor socket.
//!
//! qemu backend, `manifests/examples/desktop-vm.yaml` (debian-12 with the desktop layer, 1 vCPU,
//! 1 GiB) under TCG. `cargo bench -p boxery --bench computer` (release);
//! `BOXERY_BENCH_PAIRS=N` (default 20).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

#[path = "support/realvm.rs"]
mod realvm;
use realvm::{Mcp, bench_pairs, ms, pairs, pct, row, serving};

/// QEMU's own `screendump` on the VM's QMP socket (a new connection, as a client would).
fn qmp_screendump(sock: &Path, out: &Path) {
    let s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    let mut line = String::new();
    r.read_line(&mut line).unwrap(); // the greeting
    let mut ask = |cmd: Value| {
        writeln!(w, "{cmd}").unwrap();
        loop {
            let mut l = String::new();
            r.read_line(&mut l).unwrap();
            let v: Value = serde_json::from_str(&l).unwrap();
            if v.get("return").is_some() {
                return;
            }
            assert!(v.get("error").is_none(), "{v}");
        }
    };
    ask(json!({"execute": "qmp_capabilities"}));
    ask(json!({"execute": "screendump",
               "arguments": {"filename": out.to_str().unwrap(), "format": "png"}}));
    let mut png = Vec::new();
    std::fs::File::open(out)
        .unwrap()
        .read_to_end(&mut png)
        .unwrap();
    std::hint::black_box(png.len());
}

fn main() {
    let n = bench_pairs(20);
    // (the directory and `serve` live to the end)
    let (_dir, h, _serve) = serving();
    let manifest =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/examples/desktop-vm.yaml");
    h.apply_wait(&manifest, "45m");
    let vm = "desk1";
    // something on the screen: an xterm
    h.ok(&[
        "run",
        vm,
        "--",
        "(DISPLAY=:0 setsid xterm -geometry 100x30+100+100 </dev/null >/dev/null 2>&1 &); DISPLAY=:0 timeout 60 xdotool search --sync --class xterm >/dev/null",
    ]);
    let mut mcp = Mcp::start(&h);
    let fb = "/run/boxery-desktop/Xvfb_screen0";
    // warm every path
    mcp.tool("vm_computer", json!({"vm": vm, "action": "screenshot"}));
    h.ssh(vm, &format!("gzip -1 -c {fb}"));
    let (mut a, mut b) = pairs(
        n,
        |_| {
            mcp.tool("vm_computer", json!({"vm": vm, "action": "screenshot"}));
        },
        |_| h.ssh(vm, &format!("gzip -1 -c {fb}")),
    );
    let (mut _c, mut raw) = pairs((n / 4).max(2), |_| {}, |_| h.ssh(vm, &format!("cat {fb}")));
    let (mut ma, mut mb) = pairs(
        n,
        |i| {
            mcp.tool(
                "vm_computer",
                json!({"vm": vm, "action": "mouse_move",
                                "coordinate": [300 + (i % 2) * 400, 300]}),
            );
        },
        |i| {
            h.ssh(
                vm,
                &format!("DISPLAY=:0 xdotool mousemove {} 400", 300 + (i % 2) * 400),
            )
        },
    );
    let qmp = h.0.join("qemu/vms").join(vm).join("qmp.sock");
    let dump = h.0.join("qemu/vms").join(vm).join("bench-dump.png");
    let (mut ca, mut cb) = pairs(
        n,
        |_| {
            mcp.tool(
                "vm_computer",
                json!({"vm": vm, "action": "screenshot", "console": true}),
            );
        },
        |_| qmp_screendump(&qmp, &dump),
    );
    let _ = std::fs::remove_file(&dump);
    println!(
        "real VM, qemu backend, debian-12 with the desktop layer (1 vCPU, 1 GiB) under TCG, 2 cores; one `boxery mcp` session; a 1280×800 desktop with an xterm"
    );
    println!("| measure | through MCP, p50 | the floor, p50 | ratio p50 | target |");
    println!("|---|---|---|---|---|");
    row(
        "desktop screenshot",
        n,
        &mut a,
        &mut b,
        "bare `ssh` `gzip -1 -c` of the framebuffer, same ControlMaster",
        "≤ 1.2×, ≤ 500 ms",
    );
    println!(
        "| (for scale: bare `ssh` `cat` of the 4 MB framebuffer, p50) | | {} | | |",
        ms(pct(&mut raw, 0.5))
    );
    row(
        "`mouse_move`",
        n,
        &mut ma,
        &mut mb,
        "bare `ssh` `xdotool mousemove`, same ControlMaster",
        "≤ 1.2×",
    );
    row(
        "console screenshot (`console: true`)",
        n,
        &mut ca,
        &mut cb,
        "QEMU's QMP `screendump` (PNG) on the VM's monitor socket",
        "≤ 1.2×",
    );
    drop(mcp);
    h.ok(&["delete", "vm", vm, "--wait", "--timeout", "5m"]);
}

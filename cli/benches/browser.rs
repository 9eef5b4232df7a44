//! The agent's browser (`vm_browser`, issue 34) against the limit it is built on, measured
//! interleaved in one run so the machine's drift hits both alike: an action through MCP (the
//! request checked, sent as JSON on ssh's stdin to the browser layer's driver, its answer
//! checked and bounded, the call in the actions log) against the same driver run by a bare
//! `ssh` over the same ControlMaster with the same request. Both include the driver's own work
//! (a Python process, the DevTools websocket, the page): what is left is boxery's cost.
//!
//! - `read` of a small page served in the guest (its text and status);
//! - `evaluate` of `1 + 1`.
//!
//! qemu backend, debian-12 with the browser layer (1 vCPU, 2 GiB) under TCG; the first action
//! starts Chromium (1 to 2 minutes) before anything is timed. `cargo bench -p boxery --bench
//! browser` (release); `BOXERY_BENCH_PAIRS=N` (default 10).

use serde_json::json;

#[path = "support/realvm.rs"]
mod realvm;
use realvm::{Home, Mcp, bench_pairs, pairs, row, serving};

const DRIVE: &str = "exec /usr/local/lib/boxery/browser/drive";

fn main() {
    let n = bench_pairs(10);
    // (the directory and `serve` live to the end)
    let (_dir, h, _serve) = serving();
    let manifest = h.write(
        "web.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: web1}\nspec:\n  source: {image: debian-12}\n  layers: [browser]\n  resources: {cpus: 1, memory: 2Gi}\n",
    );
    h.apply_wait(&manifest, "45m");
    let vm = "web1";
    // a page in the guest
    h.ok(&[
        "run",
        vm,
        "--",
        // (the server alone in the background, every descriptor of it away from ssh's)
        "mkdir -p /tmp/site && printf '<title>bench</title><p id=t>hello from the guest</p>' > /tmp/site/index.html && (setsid python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp/site </dev/null >/dev/null 2>&1 &) && sleep 2",
    ]);
    let mut mcp = Mcp::start(&h);
    // the first action starts Chromium
    mcp.tool(
        "vm_browser",
        json!({"vm": vm, "action": "open", "url": "http://127.0.0.1:8000/", "timeout_seconds": 300}),
    );
    let bare = |h: &Home, req: serde_json::Value| {
        let out = h.ssh_in(vm, DRIVE, req.to_string().as_bytes());
        std::hint::black_box(out.len());
    };
    bare(&h, json!({"action": "read", "timeout": 60}));
    let (mut ra, mut rb) = pairs(
        n,
        |_| {
            mcp.tool("vm_browser", json!({"vm": vm, "action": "read"}));
        },
        |_| bare(&h, json!({"action": "read", "timeout": 180})),
    );
    let (mut ea, mut eb) = pairs(
        n,
        |_| {
            mcp.tool(
                "vm_browser",
                json!({"vm": vm, "action": "evaluate", "expression": "1 + 1"}),
            );
        },
        |_| {
            bare(
                &h,
                json!({"action": "evaluate", "expression": "1 + 1", "timeout": 180}),
            )
        },
    );
    println!(
        "real VM, qemu backend, debian-12 with the browser layer (1 vCPU, 2 GiB) under TCG, 2 cores; one `boxery mcp` session; a small page served in the guest"
    );
    println!("| measure | through MCP, p50 | the floor, p50 | ratio p50 | target |");
    println!("|---|---|---|---|---|");
    let floor = "the same driver and request over a bare `ssh`, same ControlMaster";
    row("`vm_browser` `read`", n, &mut ra, &mut rb, floor, "≤ 1.2×");
    row(
        "`vm_browser` `evaluate` `1 + 1`",
        n,
        &mut ea,
        &mut eb,
        floor,
        "≤ 1.2×",
    );
    drop(mcp);
    h.ok(&["delete", "vm", vm, "--wait", "--timeout", "5m"]);
}

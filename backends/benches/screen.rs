//! Benchmarks of a VM's screen (the host path): `screendump` and `send_input` on a running tiny
//! guest under whatever accelerator the host has (TCG here), on the qemu and the libvirt
//! backend, beside QEMU's own `screendump` over its QMP socket (`socat`, a fresh connection
//! each time, as a person would): the floor under the qemu backend's figure.
//!
//! `cargo bench -p boxery-backends --features libvirt --bench screen` (env `RUNS`, default 10).
//! One guest runs at a time; the qemu one is booted, measured and removed, then the libvirt
//! one. Starts libvirtd by `scripts/libvirtd.sh start` when it does not answer; removes every
//! VM, image and pool it made.
//!
//! | figure | what |
//! |---|---|
//! | screendump | `Backend::screendump`: the call, PNG bytes and size in hand |
//! | raw QMP screendump | `socat` to the VM's QMP socket: greeting, `qmp_capabilities`, `screendump` (PNG) answered (qemu backend's VMs) |
//! | floor | the same by the backend's QMP client, in process, the file not read back |
//! | `virsh screenshot` | the same through libvirt's CLI (libvirt backend's VMs) |
//! | keys | `send_input` of `abc⏎` (8 key events: two QMP commands, [`screen::KEYS_PER_COMMAND`]) |
//! | pointer | `send_input` of a move and a click (4 events, the screen's size known) |
//! | 100 characters | `send_input` of 100 letters and ⏎ (202 key events), once |

#[path = "../tests/qemu_support/mod.rs"]
mod qemu_support;
#[path = "../tests/screen_support/mod.rs"]
mod screen_support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use boxery_backends::libvirt::{LibvirtBackend, LibvirtConfig};
use boxery_backends::{Backend, InputEvent, PointerButton, screen};
use qemu_support::stats;
use screen_support::keys;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const URI: &str = "qemu:///system";

#[derive(Default)]
struct Figures {
    screendump: Vec<f64>,
    raw: Vec<f64>,
    qmp: Vec<f64>,
    keys: Vec<f64>,
    pointer: Vec<f64>,
    text: Vec<f64>,
    size: (u32, u32),
    png_bytes: usize,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// One `screendump` of VM `vm`, timed.
async fn screendump(b: &dyn Backend, vm: &str) -> f64 {
    let t = Instant::now();
    let s = b.screendump(vm).await.unwrap();
    let took = ms(t);
    assert!(!s.png.is_empty());
    took
}

/// The input measurements of the running VM `vm` on either backend (its screen's size too).
async fn measure(b: &dyn Backend, vm: &str, runs: usize, f: &mut Figures) {
    let first = b.screendump(vm).await.unwrap(); // warm, and the size known
    f.size = (first.width, first.height);
    f.png_bytes = first.png.len();
    let (w, h) = f.size;
    let pointer = [
        InputEvent::Move { x: w / 2, y: h / 2 },
        InputEvent::Move { x: w - 1, y: h - 1 },
        InputEvent::Button {
            button: PointerButton::Left,
            down: true,
        },
        InputEvent::Button {
            button: PointerButton::Left,
            down: false,
        },
    ];
    for _ in 0..runs {
        let t = Instant::now();
        b.send_input(vm, &keys("abc\n")).await.unwrap();
        f.keys.push(ms(t));
        let t = Instant::now();
        b.send_input(vm, &pointer).await.unwrap();
        f.pointer.push(ms(t));
    }
    let text = keys(&format!("{}\n", "x".repeat(100)));
    let t = Instant::now();
    b.send_input(vm, &text).await.unwrap();
    f.text.push(ms(t));
}

/// QEMU's `screendump` over the QMP socket `sock` by `socat`, as a person would run it: a new
/// connection, the greeting, `qmp_capabilities`, then the dump into `file`, answered.
async fn raw_screendump(sock: &Path, file: &Path) -> f64 {
    let t = Instant::now();
    let mut child = tokio::process::Command::new("socat")
        .arg("-")
        .arg(format!("UNIX-CONNECT:{}", sock.display()))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("socat is installed");
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    answer(&mut lines).await; // the greeting
    stdin
        .write_all(b"{\"execute\": \"qmp_capabilities\"}\n")
        .await
        .unwrap();
    answer(&mut lines).await;
    let dump = serde_json::json!({"execute": "screendump", "arguments": {"filename": file, "format": "png"}});
    stdin
        .write_all(format!("{dump}\n").as_bytes())
        .await
        .unwrap();
    answer(&mut lines).await;
    let took = ms(t);
    drop(stdin);
    let _ = child.kill().await;
    assert!(std::fs::metadata(file).unwrap().len() > 0);
    let _ = std::fs::remove_file(file);
    took
}

/// QEMU's `screendump` through the backend's own QMP client (connect, greeting, capabilities,
/// dump answered), the file neither read nor checked: the floor under `screendump`.
async fn qmp_screendump(sock: &Path, file: &Path) -> f64 {
    use boxery_backends::qemu::qmp::Qmp;
    let t = Instant::now();
    let mut q = Qmp::connect(sock, Duration::from_secs(10)).await.unwrap();
    q.screendump(file, "png").await.unwrap();
    let took = ms(t);
    drop(q);
    let _ = std::fs::remove_file(file);
    took
}

/// The next line of QMP that is not an event: the greeting or a command's answer.
async fn answer(lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>) -> String {
    loop {
        let l = lines.next_line().await.unwrap().expect("QMP answers");
        assert!(!l.contains("\"error\""), "{l}");
        if !l.contains("\"event\"") {
            return l;
        }
    }
}

/// `virsh screenshot` of domain `dom` into `file`: its time, and the type libvirt says it
/// wrote.
fn virsh_screenshot(dom: &str, file: &Path) -> (f64, String) {
    let t = Instant::now();
    let o = std::process::Command::new("virsh")
        .args(["-c", URI, "screenshot", dom])
        .arg(file)
        .output()
        .unwrap();
    let took = ms(t);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let _ = std::fs::remove_file(file);
    let said = String::from_utf8_lossy(&o.stdout);
    let mime = said
        .split("type of ")
        .nth(1)
        .unwrap_or("?")
        .trim()
        .to_string();
    (took, mime)
}

/// The libvirt backend on a temp state dir; undefines its domains and pool when dropped.
struct LibvirtEnv {
    backend: LibvirtBackend,
    tmp: tempfile::TempDir,
}

impl Drop for LibvirtEnv {
    fn drop(&mut self) {
        let virsh = |args: &[&str]| {
            std::process::Command::new("virsh")
                .args(["-q", "-c", URI])
                .args(args)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
                .unwrap_or_default()
        };
        let prefix = self.backend.domain_name("");
        for d in virsh(&["list", "--all", "--name"])
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with(&prefix))
        {
            virsh(&["destroy", d]);
            virsh(&["undefine", "--managed-save", d]);
        }
        let pool = self.backend.pool_name();
        virsh(&["pool-destroy", &pool]);
        virsh(&["pool-undefine", &pool]);
        let _ = std::fs::remove_dir_all(self.backend.pool_dir());
    }
}

fn row(what: &str, q: &[f64], l: &[f64]) {
    let cell = |v: &[f64]| {
        if v.is_empty() {
            "—".to_string()
        } else {
            stats(v, " ms")
        }
    };
    println!("| {what} | {} | {} |", cell(q), cell(l));
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let runs: usize = std::env::var("RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    println!(
        "loadavg before: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );

    // qemu: boot, measure, remove
    let mut qf = Figures::default();
    {
        let q = qemu_support::Env::new().await;
        q.tiny_image("tiny").await;
        q.backend.create(&q.vm("sc", "tiny")).await.unwrap();
        q.wait_ssh("sc", Duration::from_secs(240)).await;
        measure(&q.backend, "sc", runs, &mut qf).await;
        let sock = q.backend.layout().vm_qmp("sc");
        let file = q.backend.layout().vm_dir("sc").join(".bench-raw.png");
        // interleaved, so the three see the same host load
        for _ in 0..runs {
            qf.screendump.push(screendump(&q.backend, "sc").await);
            qf.raw.push(raw_screendump(&sock, &file).await);
            qf.qmp.push(qmp_screendump(&sock, &file).await);
        }
        q.backend.remove("sc").await.unwrap();
    }

    // libvirt: the same
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let st = std::process::Command::new("bash")
        .arg(repo.join("scripts/libvirtd.sh"))
        .arg("start")
        .status()
        .unwrap();
    assert!(st.success(), "scripts/libvirtd.sh start failed");
    let mut lf = Figures::default();
    let mut mime = String::new();
    {
        let tmp = tempfile::Builder::new()
            .prefix("bxls")
            .tempdir_in("/tmp")
            .unwrap();
        let mut cfg = LibvirtConfig::from_env();
        cfg.powerdown_timeout = Duration::from_secs(20);
        let l = LibvirtEnv {
            backend: LibvirtBackend::with_config(tmp.path().join("libvirt"), cfg),
            tmp,
        };
        let b = &l.backend;
        b.init().await.unwrap();
        let p: boxery_backends::Progress = Arc::new(|_l: &str| {});
        b.build_image(
            boxery_backends::Stock {
                layers: &[],
                name: "tiny",
                image: "tiny",
                uid: "uid-tiny",
            },
            p,
        )
        .await
        .unwrap();
        let vm = boxery_backends::NewVm {
            name: "sc".into(),
            uid: "uid-sc".into(),
            source: boxery_backends::DiskSource::Image("tiny".into()),
            cpus: 1,
            memory_mib: 256,
            disk_gib: 1,
            start: true,
            identity: boxery_backends::identity::generate("sc", &[]).unwrap(),
            egress: boxery_api::network::EgressPolicy::Public,
            memory: false,
        };
        b.create(&vm).await.unwrap();
        // up: its serial console says so (the screen is there from the firmware on)
        let serial = b.pool_dir().join("vm-sc-serial.log");
        let t = Instant::now();
        while !std::fs::read_to_string(&serial)
            .unwrap_or_default()
            .contains("READY")
        {
            assert!(
                t.elapsed() < Duration::from_secs(240),
                "the guest did not boot"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        measure(b, "sc", runs, &mut lf).await;
        let file = l.tmp.path().join("virsh-shot");
        for _ in 0..runs {
            lf.screendump.push(screendump(b, "sc").await);
            let (took, m) = virsh_screenshot(&b.domain_name("sc"), &file);
            lf.raw.push(took);
            mime = m;
        }
        b.remove("sc").await.unwrap();
    }

    println!(
        "\n## A VM's screen, tiny guest (VGA text mode), 1 vCPU, 256 MiB, {runs} runs, medians"
    );
    println!(
        "screen: qemu {}x{} ({} bytes of PNG), libvirt {}x{} ({} bytes; libvirt hands over {mime})\n",
        qf.size.0, qf.size.1, qf.png_bytes, lf.size.0, lf.size.1, lf.png_bytes
    );
    println!("| | qemu | libvirt |\n|---|---|---|");
    row("screendump (PNG)", &qf.screendump, &lf.screendump);
    row(
        "raw: QEMU's QMP `screendump` by socat (qemu) / `virsh screenshot` (libvirt)",
        &qf.raw,
        &lf.raw,
    );
    row(
        "floor: QMP connect + `screendump` by the backend's client, not read back",
        &qf.qmp,
        &[],
    );
    row(
        &format!(
            "send_input: `abc⏎` (8 key events, {} QMP commands)",
            8usize.div_ceil(screen::KEYS_PER_COMMAND)
        ),
        &qf.keys,
        &lf.keys,
    );
    row(
        "send_input: move, move, click (4 events)",
        &qf.pointer,
        &lf.pointer,
    );
    row(
        "send_input: 100 letters and ⏎ (202 key events), once",
        &qf.text,
        &lf.text,
    );
    println!(
        "\nloadavg after: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
}

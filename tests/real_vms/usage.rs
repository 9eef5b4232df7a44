//! What `/metrics` says of a real running VM (issue 36, docs/observability.md): its
//! hypervisor's CPU seconds and resident memory, its disk, and its network bytes, sampled from
//! the backend by `serve --metrics-listen`. A megabyte the guest writes to its ssh session is
//! at least a megabyte of `boxery_vm_network_transmit_bytes_total`. The same VM's commands
//! (`run`, an agent's `vm_bash` through `boxery mcp`) are in `boxery audit` with their exit
//! codes, and its vCPU-hours and CPU seconds in `boxery usage`.

use std::io::{Read, Write};
use std::time::Duration;

use super::{Kind, RealHome, common, tiny_vm};

/// GET `/metrics` at `addr`: the body.
fn scrape(addr: &str) -> String {
    let mut c = std::net::TcpStream::connect(addr).expect("the metrics listener answers");
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        c,
        "GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = c.read_to_string(&mut out);
    out
}

/// The value of the series `series` (name and labels, as the exposition writes them).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

pub(super) fn usage_samples(kind: Kind) {
    let h = RealHome::new(kind);
    let serve = h.serve_args(&["--metrics-listen", "127.0.0.1:0"], &[]);
    serve.wait_leading();
    let addr = std::fs::read_to_string(h.home.path().join("metrics.addr"))
        .expect("serve wrote metrics.addr");
    let addr = addr.trim();
    let f = h.home.write("u.yaml", &tiny_vm("u1"));
    h.apply_file(&f, "10m");
    // A megabyte from the guest, over its network (the ssh session's output).
    let out = h.run("u1", "head -c 1048576 /dev/zero | tr '\\0' x");
    assert_eq!(out.len(), 1048576);
    let vm = "{vm=\"u1\"}";
    let text = common::eventually(Duration::from_secs(60), || {
        let text = scrape(addr);
        (value(
            &text,
            &format!("boxery_vm_network_transmit_bytes_total{vm}"),
        )? >= 1048576.0)
            .then_some(text)
    })
    .unwrap_or_else(|| {
        panic!(
            "no megabyte sent by u1 in the samples on {}:\n{}",
            kind.name(),
            scrape(addr)
                .lines()
                .filter(|l| l.starts_with("boxery_vm_"))
                .collect::<Vec<_>>()
                .join("\n")
        )
    });
    let cpu = value(&text, &format!("boxery_vm_cpu_seconds_total{vm}")).expect("CPU seconds");
    let rss = value(&text, &format!("boxery_vm_memory_rss_bytes{vm}")).expect("RSS");
    let disk = value(&text, &format!("boxery_vm_disk_used_bytes{vm}")).expect("disk");
    let rx = value(&text, &format!("boxery_vm_network_receive_bytes_total{vm}")).expect("rx");
    eprintln!(
        "u1 on {}: {cpu:.1} CPU s, RSS {:.0} MiB, disk {:.1} MiB, rx {rx} B",
        kind.name(),
        rss / 1048576.0,
        disk / 1048576.0
    );
    // A booted guest under emulation has used seconds of CPU and tens of MiB of host memory;
    // its overlay holds at least what it wrote at boot; it received the command over ssh.
    assert!(cpu >= 1.0, "{cpu}");
    assert!(rss >= 32.0 * 1048576.0, "{rss}");
    assert!(disk > 0.0, "{disk}");
    assert!(rx > 0.0, "{rx}");
    assert!(
        text.contains("boxery_vm_status_phase{vm=\"u1\",phase=\"Running\"} 1"),
        "{text}"
    );

    // An agent's vm_bash through `boxery mcp`, on this backend.
    let mut env: Vec<(&str, &str)> = vec![("BOXERY_BACKEND", kind.name())];
    env.extend(h.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let mut mcp = common::mcp_stdio::Mcp::start_with(&h.home, &env);
    let (err, out) = mcp.call(
        "vm_bash",
        serde_json::json!({"vm": "u1", "command": "echo from-mcp; exit 3"}),
    );
    assert!(!err && out.contains("from-mcp"), "{out}");
    drop(mcp);
    // The audit: the megabyte's `run`, then the tool call and its command, with exit codes.
    let actions: Vec<serde_json::Value> = h
        .ok(&["audit", "--vm", "u1", "-o", "json"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let find = |action: &str, what: &str| {
        actions
            .iter()
            // the line that says how it ended (a command's start is a line of its own)
            .position(|a| {
                a["action"] == action
                    && a["result"] != "started"
                    && a["what"].as_str().unwrap_or("").contains(what)
            })
            .unwrap_or_else(|| panic!("no {action} {what} in {actions:#?}"))
    };
    let (run, tool, bash) = (
        find("run", "head -c 1048576"),
        find("tool", "vm_bash"),
        find("bash", "echo from-mcp"),
    );
    assert!(run < tool && run < bash, "{actions:#?}");
    assert!(
        actions[..run]
            .iter()
            .any(|a| a["action"] == "run" && a["result"] == "started"),
        "the run's start is recorded before its end: {actions:#?}"
    );
    assert_eq!(actions[run]["result"], "exit 0");
    assert_eq!(actions[bash]["result"], "exit 3");
    assert_eq!(actions[tool]["result"], "ok");
    eprintln!(
        "--- the audit's vm_bash line on {}: {}",
        kind.name(),
        actions[bash]
    );

    // The ledger: vCPU-hours and CPU seconds once two samples have passed.
    let line = common::eventually(Duration::from_secs(60), || {
        let out = h.ok(&["usage", "-o", "json"]);
        let all: serde_json::Value = serde_json::from_str(&out).ok()?;
        let l = all.as_array()?.iter().find(|l| l["name"] == "u1")?.clone();
        (l["vcpuHours"].as_f64()? > 0.0 && l["cpuSeconds"].as_f64()? > 0.0).then_some(l)
    })
    .unwrap_or_else(|| panic!("no compute use of u1: {}", h.ok(&["usage", "-o", "json"])));
    eprintln!("u1's usage on {}: {line}", kind.name());
    eprintln!("--- boxery top on {}:\n{}", kind.name(), h.ok(&["top"]));
    // `boxery top`: the running VM, its host memory and size.
    let top: serde_json::Value = serde_json::from_str(&h.ok(&["top", "--json"])).unwrap();
    let row = top
        .as_array()
        .and_then(|t| t.iter().find(|r| r["vm"] == "u1"))
        .unwrap_or_else(|| panic!("u1 not in top: {top}"));
    assert!(row["rssBytes"].as_u64().unwrap() > 32 << 20, "{row}");
    assert_eq!(row["cpus"], 1);
    // both backends count the guest's network: a rate, not "not counted"
    assert!(
        row["rxPerSecond"].is_number() && row["txPerSecond"].is_number(),
        "{row}"
    );
    h.ok(&["rm", "u1", "--wait", "--timeout", "3m"]);
    // Its samples leave with it.
    common::eventually(Duration::from_secs(30), || {
        (!scrape(addr).contains("vm=\"u1\"")).then_some(())
    })
    .expect("u1's series leave /metrics once it is removed");
    drop(serve);
    h.ok(&["delete", "image", "tiny", "--wait", "--timeout", "1m"]);
    assert!(h.leftovers().is_empty(), "left behind: {:?}", h.leftovers());
}

/// A pool whose leases may run 0.02 vCPU-hours each (72 vCPU-seconds): a leased member is
/// suspended once its lease has used that, with `BudgetExhausted` on the lease and the VM and
/// a Warning; the lease's `status.usage` says what it used. Raising the pool's budget lets the
/// VM run again, resumed where it was (same boot, same processes).
pub(super) fn budget_suspends_a_leased_vm(kind: Kind) {
    let h = RealHome::new(kind);
    let _serve = h.serve();
    let pool = |hours: &str| {
        format!(
            "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {{name: bp}}\nspec:\n  replicas: 1\n  lease:\n    defaultTtlSeconds: 1800\n    maxTtlSeconds: 28800\n    budget: {{vcpuHours: {hours}}}\n  template:\n    spec:\n      source: {{image: tiny}}\n      resources: {{cpus: 1, memory: 256Mi, disk: 1Gi}}\n"
        )
    };
    let f = h.home.write("pool.yaml", &pool("0.02"));
    h.ok(&["apply", "-f", f.to_str().unwrap()]);
    h.ok(&[
        "wait",
        "pool",
        "bp",
        "--for=condition=Ready",
        "--timeout=10m",
    ]);
    h.ok(&[
        "lease",
        "acquire",
        "bp",
        "--holder",
        "agent-1",
        "--name",
        "lb",
        "--wait",
        "--timeout",
        "5m",
    ]);
    // a process that lives through a suspend and resume
    h.run(
        "bp-0",
        "setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $! > /tmp/sleeper",
    );
    // alive after the session that started it
    h.run("bp-0", "kill -0 $(cat /tmp/sleeper)");
    let boot = h.run("bp-0", "cat /proc/sys/kernel/random/boot_id");
    let t = std::time::Instant::now();
    h.ok(&[
        "wait",
        "lease",
        "lb",
        "--for=condition=BudgetExhausted",
        "--timeout=5m",
    ]);
    let held = common::eventually(Duration::from_secs(120), || {
        let vm: serde_json::Value =
            serde_json::from_str(&h.ok(&["get", "vm", "bp-0", "-o", "json"])).ok()?;
        (vm["status"]["phase"] == "Suspended").then_some(vm)
    })
    .unwrap_or_else(|| panic!("bp-0 not suspended: {}", h.ok(&["describe", "vm", "bp-0"])));
    eprintln!(
        "bp-0 on {} held suspended {:.0} s after the lease began to be charged",
        kind.name(),
        t.elapsed().as_secs_f64()
    );
    let cond = budget_condition(&held);
    assert_eq!(cond["status"], "True", "{cond}");
    assert_eq!(cond["reason"], "LeaseBudget", "{cond}");
    let lease: serde_json::Value =
        serde_json::from_str(&h.ok(&["get", "lease", "lb", "-o", "json"])).unwrap();
    let used = lease["status"]["usage"]["vcpuHours"]
        .as_f64()
        .unwrap_or_else(|| panic!("no status.usage on the lease: {lease}"));
    assert!(used >= 0.02, "{lease}");
    assert!(lease["status"]["usage"]["cpuSeconds"].as_f64().unwrap() > 0.0);
    let described = h.ok(&["describe", "lease", "lb"]);
    eprintln!("--- describe lease lb on {}:\n{described}", kind.name());
    assert!(
        described.contains("BudgetExhausted") && described.contains("vcpuHours"),
        "{described}"
    );
    let events = h.ok(&["describe", "vm", "bp-0"]);
    assert!(
        events.contains("BudgetExhausted") && events.contains("suspended"),
        "{events}"
    );
    // A use says why rather than waking it.
    let o = h.cmd(&["run", "bp-0", "--", "true"]);
    let refused = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && refused.contains("is held suspended: lease lb used its vcpuHours budget"),
        "{refused}"
    );
    // A suspended VM is not charged: what the ledger holds for the lease stays put over two
    // samples and more (status.usage is not rewritten that often: the ledger is asked).
    let charged = || -> f64 {
        let all: serde_json::Value =
            serde_json::from_str(&h.ok(&["usage", "--by", "lease", "-o", "json"])).unwrap();
        all.as_array()
            .and_then(|a| a.iter().find(|l| l["name"] == "lb"))
            .and_then(|l| l["vcpuHours"].as_f64())
            .unwrap_or_else(|| panic!("no use of lease lb: {all}"))
    };
    let before = charged();
    assert!(before >= 0.02, "{before}");
    std::thread::sleep(Duration::from_secs(25));
    let after = charged();
    assert!(
        after - before < 1e-6,
        "charged while suspended: {before} then {after}"
    );

    // The owner raises the pool's lease budget: the VM resumes where it was.
    let f = h.home.write("pool.yaml", &pool("1"));
    h.ok(&["apply", "-f", f.to_str().unwrap()]);
    h.ok(&[
        "wait",
        "vm",
        "bp-0",
        "--for=condition=Ready",
        "--timeout=5m",
    ]);
    assert_eq!(h.run("bp-0", "cat /proc/sys/kernel/random/boot_id"), boot);
    h.run("bp-0", "kill -0 $(cat /tmp/sleeper)");
    let lease: serde_json::Value =
        serde_json::from_str(&h.ok(&["get", "lease", "lb", "-o", "json"])).unwrap();
    let c = budget_condition(&lease);
    assert_eq!(c["status"], "False", "{lease}");

    h.ok(&["lease", "release", "lb", "--wait"]);
    h.ok(&["delete", "pool", "bp", "--wait", "--timeout", "3m"]);
    h.ok(&["delete", "image", "tiny", "--wait", "--timeout", "1m"]);
    assert!(h.leftovers().is_empty(), "left behind: {:?}", h.leftovers());
}

/// The `BudgetExhausted` condition of an object read as JSON.
fn budget_condition(obj: &serde_json::Value) -> serde_json::Value {
    obj["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "BudgetExhausted"))
        .unwrap_or_else(|| panic!("no BudgetExhausted condition: {obj}"))
        .clone()
}

//! The CLI end to end on the fake backend: apply → converge → get/describe → snapshot → revert
//! → fork → stop/start → resize → diff → delete, in embedded mode (no daemon) and with `serve`.

mod common;

use std::time::{Duration, Instant};

use common::{Home, vm_yaml};

fn code(home: &Home, args: &[&str]) -> i32 {
    home.run(args).status.code().unwrap_or(-1)
}

#[test]
fn lifecycle_in_embedded_mode() {
    let home = Home::new();
    let fake = home.fake();
    let f = home.write("vm.yaml", &vm_yaml("dev1"));
    let out = home.ok(&[
        "apply",
        "-f",
        f.to_str().unwrap(),
        "--wait",
        "--timeout",
        "30s",
    ]);
    assert!(out.contains("vm/dev1 created"), "{out}");
    assert!(out.contains("vm/dev1 condition met"), "{out}");

    // diff: 0 when the same, 1 when different.
    assert_eq!(code(&home, &["diff", "-f", f.to_str().unwrap()]), 0);
    let f2 = home.write(
        "vm2.yaml",
        &format!("{}  resources:\n    cpus: 2\n", vm_yaml("dev1")),
    );
    let out = home.run(&["diff", "-f", f2.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("+    cpus: 2"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    let table = home.ok(&["get", "vm"]);
    let mut lines = table.lines();
    let header = lines.next().unwrap();
    for col in ["NAME", "STATUS", "READY", "AGE"] {
        assert!(header.contains(col), "{table}");
    }
    let row = lines.next().unwrap();
    assert!(
        row.starts_with("dev1") && row.contains("Running") && row.contains("True"),
        "{table}"
    );
    assert_eq!(
        home.ok(&["get", "vms", "dev1", "-o", "jsonpath={.status.phase}"])
            .trim(),
        "Running"
    );
    assert_eq!(home.ok(&["get", "vm", "-o", "name"]).trim(), "vm/dev1");
    let yaml = home.ok(&["get", "vm", "dev1", "-o", "yaml"]);
    assert!(
        yaml.contains("kind: Vm") && yaml.contains("observedGeneration"),
        "{yaml}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&home.ok(&["get", "vm", "dev1", "-o", "json"])).unwrap();
    assert_eq!(
        json["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap()["status"],
        "True"
    );
    assert!(home.ok(&["get", "vm", "-o", "wide"]).contains("SSH"));
    assert!(
        home.ok(&["get", "img"]).contains("debian-12"),
        "the stock image was made on first use"
    );
    let d = home.ok(&["describe", "vm", "dev1"]);
    assert!(
        d.contains("Conditions:") && d.contains("Ready") && d.contains("Created"),
        "{d}"
    );

    // Snapshot, change, revert: the disk is back.
    fake.write_disk("dev1", b"before").unwrap();
    home.ok(&["snap", "dev1", "s1", "--wait", "--timeout", "30s"]);
    assert_eq!(fake.read_image_disk("dev1.s1").unwrap(), b"before");
    fake.write_disk("dev1", b"after").unwrap();
    home.ok(&["revert", "dev1", "s1", "--wait", "--timeout", "30s"]);
    assert_eq!(fake.read_disk("dev1").unwrap(), b"before");

    // A backend without memory snapshots refuses them up front, saying what it lacks;
    // nothing is made.
    for args in [
        &["snap", "dev1", "m1", "--memory"][..],
        &["fork", "dev1", "devm", "--with-memory"][..],
    ] {
        let out = home.run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("the fake backend, which cannot snapshot or fork a VM's memory"),
            "{err}"
        );
    }
    assert!(!home.ok(&["get", "images"]).contains("dev1.m1"));
    assert!(!home.ok(&["get", "images"]).contains("dev1.fork-"));

    // Fork into two: each has the source's disk as it was.
    fake.write_disk("dev1", b"forked").unwrap();
    home.ok(&["fork", "dev1", "dev2", "dev3", "--wait", "--timeout", "30s"]);
    for n in ["dev2", "dev3"] {
        assert_eq!(fake.read_disk(n).unwrap(), b"forked", "{n}");
    }
    // The fork's capture is removed once the forks exist.
    for n in ["dev2", "dev3"] {
        home.ok(&[
            "wait",
            "image",
            &format!("{n}.fork-source"),
            "--for=delete",
            "--timeout=30s",
        ]);
    }
    // A fork with memory into a name taken is refused before anything is made (its image
    // would otherwise stay, with no child to end it).
    let out = home.run(&["fork", "dev1", "dev9", "dev2", "--with-memory"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("dev2") && err.contains("already exists"),
        "{err}"
    );
    assert!(!home.ok(&["get", "vms"]).contains("dev9"));
    assert!(!home.ok(&["get", "images"]).contains("dev1.fork-"));

    // Stop, start, resize.
    home.ok(&["stop", "dev2", "--wait", "--timeout", "30s"]);
    assert_eq!(
        home.ok(&["get", "vm", "dev2", "-o", "jsonpath={.status.phase}"])
            .trim(),
        "Stopped"
    );
    assert_eq!(
        fake.vm_record("dev2").unwrap().unwrap().state,
        boxery_backends::PowerState::Stopped
    );
    home.ok(&["start", "dev2", "--wait", "--timeout", "30s"]);
    home.ok(&[
        "resize",
        "dev2",
        "--cpus",
        "2",
        "--memory",
        "2Gi",
        "--wait",
        "--timeout",
        "30s",
    ]);
    let rec = fake.vm_record("dev2").unwrap().unwrap();
    assert_eq!((rec.size.cpus, rec.size.memory_mib), (2, 2048));
    // Shrinking a disk is refused with a condition saying what to do.
    home.ok(&["resize", "dev2", "--disk", "1Gi"]);
    home.ok(&[
        "wait",
        "vm",
        "dev2",
        "--for",
        "condition=Resized=False",
        "--timeout",
        "30s",
    ]);
    assert!(
        home.ok(&["describe", "vm", "dev2"])
            .contains("DiskShrinkRefused")
    );
    // A refused spec is not converged: Ready says why, GEN stays behind; the rest of the spec
    // (here: stop it) is still carried out, and fixing the disk converges it.
    home.ok(&[
        "wait",
        "vm",
        "dev2",
        "--for=condition=Ready=False",
        "--timeout=30s",
    ]);
    let jp = |p: &str| {
        home.ok(&["get", "vm", "dev2", "-o", &format!("jsonpath={p}")])
            .trim()
            .to_string()
    };
    assert_eq!(
        jp("{.status.conditions[?(@.type==\"Ready\")].reason}"),
        "DiskShrinkRefused"
    );
    assert_ne!(
        jp("{.status.observedGeneration}"),
        jp("{.metadata.generation}")
    );
    home.ok(&["stop", "dev2", "--wait", "--timeout", "30s"]);
    home.ok(&["resize", "dev2", "--disk", "10Gi"]);
    home.ok(&["start", "dev2", "--wait", "--timeout", "30s"]);
    assert_eq!(
        jp("{.status.observedGeneration}"),
        jp("{.metadata.generation}")
    );
    assert_eq!(
        jp("{.status.conditions[?(@.type==\"Resized\")].status}"),
        "",
        "the refusal is cleared"
    );

    // wait: met, not found (3), timeout (4).
    assert_eq!(
        code(
            &home,
            &[
                "wait",
                "vm",
                "dev1",
                "--for=condition=Ready",
                "--timeout=5s"
            ]
        ),
        0
    );
    assert_eq!(
        code(
            &home,
            &[
                "wait",
                "vm",
                "nope",
                "--for=condition=Ready",
                "--timeout=1s"
            ]
        ),
        3
    );
    assert_eq!(
        code(
            &home,
            &["wait", "vm", "dev1", "--for=condition=Lost", "--timeout=1s"]
        ),
        4
    );
    assert_eq!(code(&home, &["get", "vm", "nope"]), 3);

    // Delete: the VM, its snapshot (owned) and the backend's copies go.
    home.ok(&["rm", "dev1", "--wait", "--timeout", "30s"]);
    assert_eq!(code(&home, &["get", "vm", "dev1"]), 3);
    home.ok(&["wait", "image", "dev1.s1", "--for=delete", "--timeout=30s"]);
    assert!(fake.image_record("dev1.s1").unwrap().is_none());
    assert!(fake.vm_record("dev1").unwrap().is_none());
    // The forks keep working: images are independent.
    assert_eq!(fake.read_disk("dev2").unwrap(), b"forked");
    // Events belong to their object: dev1's went with it, the forks' remain.
    let ev = home.ok(&["events"]);
    assert!(
        ev.contains("vm/dev2") && ev.contains("Created") && !ev.contains("vm/dev1 "),
        "{ev}"
    );
}

#[test]
fn explain_and_schema() {
    let home = Home::new();
    let e = home.ok(&["explain", "Vm.spec.resources"]);
    for w in ["cpus", "memory", "disk", "FIELDS"] {
        assert!(e.contains(w), "{e}");
    }
    assert!(
        home.ok(&["explain", "vm.spec.runStrategy"])
            .contains("Running")
    );
    let s: serde_json::Value = serde_json::from_str(&home.ok(&["schema", "vm"])).unwrap();
    assert_eq!(s["additionalProperties"], false);
    // The exported schema files for editors match the code.
    for k in ["vm", "image", "pool", "lease", "grant"] {
        let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("../manifests/schemas/{k}.json"));
        let on_disk: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display())),
        )
        .unwrap();
        let now: serde_json::Value = serde_json::from_str(&home.ok(&["schema", k])).unwrap();
        assert_eq!(
            on_disk,
            now,
            "{} is stale: run scripts/export-schemas.sh",
            file.display()
        );
    }
}

#[test]
fn examples_apply() {
    let home = Home::new();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/examples");
    home.ok(&[
        "apply",
        "-f",
        dir.join("vm.yaml").to_str().unwrap(),
        "--wait",
        "--timeout",
        "30s",
    ]);
    home.ok(&[
        "apply",
        "-f",
        dir.join("snapshot.yaml").to_str().unwrap(),
        "--wait",
        "--timeout",
        "30s",
    ]);
    home.ok(&[
        "apply",
        "-f",
        dir.join("fork.yaml").to_str().unwrap(),
        "--wait",
        "--timeout",
        "30s",
    ]);
    assert_eq!(home.ok(&["get", "vm", "-o", "name"]).lines().count(), 3);
}

#[test]
fn prune_and_dry_run() {
    let home = Home::new();
    let both = format!(
        "{}  labels: {{set: a}}\n---\n{}",
        vm_yaml("p1"),
        vm_yaml("p2")
    );
    // labels under metadata
    let both = both
        .replace(
            "metadata:\n  name: p1\nspec:",
            "metadata:\n  name: p1\n  labels: {set: a}\nspec:",
        )
        .replace("  labels: {set: a}\n---", "---");
    let both = both.replace(
        "metadata:\n  name: p2\n",
        "metadata:\n  name: p2\n  labels: {set: a}\n",
    );
    let f = home.write("both.yaml", &both);
    let out = home.ok(&["apply", "-f", f.to_str().unwrap(), "--dry-run"]);
    assert!(out.contains("vm/p1 created (dry run)"), "{out}");
    assert_eq!(home.ok(&["get", "vm", "-o", "name"]).trim(), "");
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    // An object created by hand (no last-applied record) is never pruned.
    home.ok(&["new", "byhand"]);
    let one = home.write("one.yaml", both.split("---").next().unwrap());
    let out = home.ok(&[
        "apply",
        "-f",
        one.to_str().unwrap(),
        "--prune",
        "-l",
        "set=a",
    ]);
    assert!(out.contains("vm/p2 pruned"), "{out}");
    let names = home.ok(&["get", "vm", "-o", "name"]);
    assert!(
        names.contains("vm/p1") && names.contains("vm/byhand"),
        "{names}"
    );
}

#[test]
fn serve_and_standby_takeover() {
    let home = Home::new();
    let mut first = home.serve(&[]);
    let f = home.write("a.yaml", &vm_yaml("a"));
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    // `a` becomes Ready only through a leader, and only `first` runs: it leads.
    home.ok(&["wait", "vm", "a", "--for=condition=Ready", "--timeout=30s"]);
    let mut second = home.serve(&[]);
    std::thread::sleep(Duration::from_millis(500));
    assert!(second.alive(), "the standby must wait, not exit");
    first.kill();
    // The standby takes over within two lease periods (4 s each); at once here, as the first's
    // PID is gone.
    let t = Instant::now();
    let f = home.write("b.yaml", &vm_yaml("b"));
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    home.ok(&["wait", "vm", "b", "--for=condition=Ready", "--timeout=30s"]);
    assert!(
        t.elapsed() < Duration::from_secs(4) + Duration::from_secs(2),
        "takeover took {:?}",
        t.elapsed()
    );
    assert!(second.alive());
    // With a serve running, --wait does not start controllers of its own: it just waits.
    home.ok(&["new", "c", "--wait", "--timeout", "30s"]);
}

/// A `serve` whose lead was taken while it could not renew it (stopped here with SIGSTOP, as a
/// host too loaded to write its store within the lease would hold it up) stops its
/// controllers and stands by, then leads again: it neither exits (which took its API and
/// usage sampler with it) nor runs beside the new leader.
#[test]
fn a_serve_that_loses_the_lead_stands_by_and_leads_again() {
    let home = Home::new();
    let mut serve = home.serve(&[]);
    serve.wait_leading();
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &serve.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    };
    signal("-STOP");
    // Past its 4 s lease: the store is unled, and the wait runs the controllers itself.
    std::thread::sleep(Duration::from_secs(5));
    let f = home.write("a.yaml", &vm_yaml("a"));
    let out = home.ok(&[
        "apply",
        "-f",
        f.to_str().unwrap(),
        "--wait",
        "--timeout",
        "30s",
    ]);
    assert!(out.contains("vm/a condition met"), "{out}");
    signal("-CONT");
    let log_file = serve.log.clone();
    let log = || std::fs::read_to_string(&log_file).unwrap_or_default();
    common::eventually(Duration::from_secs(20), || {
        let l = log();
        (l.contains("lost the lead of the store") && l.matches("leading (pid").count() == 2)
            .then_some(())
    })
    .unwrap_or_else(|| panic!("serve did not stand by and lead again:\n{}", log()));
    assert!(serve.alive(), "serve exited:\n{}", log());
    // It leads: a VM applied without --wait (no command runs controllers) becomes Ready.
    let f = home.write("b.yaml", &vm_yaml("b"));
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    common::eventually(Duration::from_secs(30), || {
        let vm: boxery_api::Vm = home.store().get_as("b").unwrap()?;
        vm.status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == boxery_api::meta::ConditionStatus::True)
            .then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "b is not Ready under the serve that leads again:\n{}",
            log()
        )
    });
}

#[test]
fn get_watch_streams_changes() {
    let home = Home::new();
    home.ok(&["new", "w1"]);
    let mut child = home
        .cmd()
        .args(["get", "vm", "-w"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let next = output_until(&mut child, "the watch");
    next("w1");
    home.ok(&["new", "w2"]);
    let got = next("w2");
    let _ = child.kill();
    let _ = child.wait();
    assert!(got.contains("w1") && got.contains("w2"), "{got}");
}

/// What a child prints on stdout, read on a thread: the returned function waits (10 s at most)
/// until the output so far contains a text, and returns it all (`what` names the child in the
/// panic message).
fn output_until(
    child: &mut std::process::Child,
    what: &'static str,
) -> impl Fn(&str) -> String + use<> {
    use std::io::Read;
    let mut stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let mut all = String::new();
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            all.push_str(&String::from_utf8_lossy(&buf[..n]));
            let _ = tx.send(all.clone());
        }
    });
    let last = std::cell::RefCell::new(String::new());
    move |until: &str| -> String {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if let Ok(s) = rx.recv_timeout(Duration::from_millis(200)) {
                *last.borrow_mut() = s;
            }
            if last.borrow().contains(until) {
                return last.borrow().clone();
            }
        }
        panic!("waited for {until:?} from {what}; got {:?}", last.borrow());
    }
}

#[test]
fn docs_cover_every_command() {
    let home = Home::new();
    let help = home.ok(&["--help"]);
    let docs = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/cli.md"),
    )
    .unwrap();
    let mut n = 0;
    for line in help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
    {
        let Some(cmd) = line
            .strip_prefix("  ")
            .and_then(|l| l.split_whitespace().next())
        else {
            break;
        };
        if line.starts_with("   ") || cmd == "help" {
            continue;
        }
        n += 1;
        assert!(
            docs.contains(&format!("`{cmd} ")) || docs.contains(&format!("`{cmd}`")),
            "docs/cli.md does not describe `{cmd}`"
        );
    }
    assert!(n > 15, "parsed only {n} commands from --help");
}

/// A home whose VMs live on one backend refuses to run controllers on another (they would
/// find every VM missing and mark it Lost), says what to do, and changes nothing.
#[test]
fn a_home_drives_one_backend() {
    let home = Home::new();
    let f = home.write("vm.yaml", &vm_yaml("dev1"));
    let f = f.to_str().unwrap();
    home.ok(&["apply", "-f", f, "--wait", "--timeout", "30s"]);
    let before = home.ok(&["get", "vm", "dev1", "-o", "json"]);
    let on_qemu = |args: &[&str]| {
        home.cmd()
            .env("BOXERY_BACKEND", "qemu")
            .args(args)
            .output()
            .unwrap()
    };
    let changed = home.write(
        "changed.yaml",
        &format!("{}  resources:\n    cpus: 2\n", vm_yaml("dev1")),
    );
    for args in [
        &["apply", "-f", f, "--wait", "--timeout", "10s"][..],
        &["apply", "-f", changed.to_str().unwrap(), "--wait"][..],
        &["stop", "dev1", "--wait"][..],
        &["new", "dev2", "--wait"][..],
        &["serve"][..],
        &["delete", "vm", "dev1", "--force"][..],
    ] {
        let o = on_qemu(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("Vm dev1 in") && err.contains("lives on the `fake` backend, not `qemu`"),
            "{args:?}: {err}"
        );
        assert!(err.contains("BOXERY_HOME"), "says what to do: {err}");
    }
    assert_eq!(
        home.ok(&["get", "vm", "dev1", "-o", "json"]),
        before,
        "nothing changed"
    );
    // reading needs no backend
    on_qemu(&["get", "vms"])
        .status
        .success()
        .then_some(())
        .unwrap();
}

#[test]
fn backend_table_in_docs_matches_the_declarations() {
    let home = Home::new();
    let table = home.ok(&["backends"]);
    let docs = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/backends.md"),
    )
    .unwrap();
    assert!(
        docs.contains(&table),
        "docs/backends.md's support table is stale; paste `boxery backends`:\n{table}"
    );
}

/// A reader that leaves early (`boxery get vms | head -1`) ends the command quietly: exit 141
/// (a filter killed by SIGPIPE), nothing on stderr, no panic. The reader here closes its end
/// before the command writes, so every write fails.
#[test]
fn a_closed_pipe_ends_a_command_quietly() {
    let home = Home::new();
    let mut many = String::new();
    for i in 0..50 {
        many.push_str(&vm_yaml(&format!("p{i}")));
        many.push_str("\n---\n");
    }
    let f = home.write("many.yaml", &many);
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    let new = home.write("new.yaml", &vm_yaml("not-yet"));
    for args in [
        &["schema"][..],
        &["get", "vms"],
        &["get", "vms", "-o", "yaml"],
        &["get", "vms", "-o", "json"],
        &["describe", "vm", "p1"],
        &["explain", "vm"],
        &["diff", "-f", new.to_str().unwrap()],
        &["backends"],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = home
            .cmd()
            .args(args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "{args:?}: stderr: {stderr}");
        assert!(stderr.is_empty(), "{args:?} said something: {stderr}");
    }
}

/// Messages name what the reader can type: a Ready VM on a backend with no guest is not
/// "waited for", and the CLI's tool-backed commands (`read`, `jobs`) speak the CLI's words.
#[test]
fn hands_errors_name_what_the_cli_user_can_type() {
    let home = Home::new();
    let f = home.write("vm.yaml", &vm_yaml("dev1"));
    home.ok(&[
        "apply",
        "-f",
        f.to_str().unwrap(),
        "--wait",
        "--timeout",
        "30s",
    ]);
    for args in [
        &["run", "dev1", "--", "true"][..],
        &["read", "dev1", "/etc/hostname"],
        &["jobs", "list", "dev1"],
    ] {
        let o = home.run(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(5), "{args:?}: {err}");
        assert!(err.contains("no guest to reach"), "{args:?}: {err}");
        assert!(!err.contains("wait"), "{args:?} suggests waiting: {err}");
        assert!(!err.contains("vm_"), "{args:?} names a tool: {err}");
    }
    home.ok(&["stop", "dev1", "--wait", "--timeout", "30s"]);
    let o = home.run(&["read", "dev1", "/etc/hostname"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("boxery start dev1"), "{err}");
}

/// A write that does not wait, with nothing reconciling, says so and how to start a control
/// plane; with `serve` leading it says nothing more; `--dry-run` and `--wait` never say it.
#[test]
fn a_write_with_nothing_reconciling_says_so() {
    let home = Home::new();
    let f = home.write("vm.yaml", &vm_yaml("a"));
    let f = f.to_str().unwrap();
    let said = |args: &[&str]| {
        let o = home.run(args);
        assert!(o.status.success(), "{args:?}: {o:?}");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    for args in [&["apply", "-f", f][..], &["new", "b"], &["stop", "b"]] {
        let err = said(args);
        assert!(
            err.contains("nothing reconciles")
                && err.contains("boxery serve")
                && err.contains("--wait"),
            "{args:?}: {err}"
        );
    }
    assert!(!said(&["apply", "-f", f, "--dry-run"]).contains("nothing reconciles"));
    assert!(!said(&["start", "b", "--wait", "--timeout", "30s"]).contains("nothing reconciles"));
    let serve = home.serve(&[]);
    serve.wait_leading();
    for args in [&["new", "c"][..], &["stop", "c"]] {
        let err = said(args);
        assert!(!err.contains("nothing reconciles"), "{args:?}: {err}");
    }
}

/// `apply --wait` waits for every kind it applied: the example pool's own header command
/// returns once all three members are made and free, not at once.
#[test]
fn apply_wait_waits_for_a_pool_to_settle() {
    let home = Home::new();
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../manifests/examples/pool.yaml"
    );
    let out = home.ok(&["apply", "-f", example, "--wait", "--timeout", "60s"]);
    assert!(out.contains("pool/agents condition met"), "{out}");
    let free = home.ok(&["get", "pool", "agents", "-o", "jsonpath={.status.free}"]);
    assert_eq!(
        free.trim(),
        "3",
        "all three members free when --wait returns"
    );
}

/// `service install --print` shows a unit that runs `serve` for this home and backend and
/// leaves VMs running when it stops; bad `serve` arguments are refused before anything is
/// written; `status` says what leads the store. On a host without systemd, `install` says so,
/// prints the command for another supervisor and installs nothing.
#[test]
fn service_unit_and_status() {
    let home = Home::new();
    let unit = home.ok(&[
        "service",
        "install",
        "--user",
        "--print",
        "--",
        "--mcp-listen",
        "127.0.0.1:7380",
    ]);
    let h = home.path().display().to_string();
    for want in [
        format!("Environment=\"BOXERY_HOME={h}\""),
        "Environment=\"BOXERY_BACKEND=fake\"".to_string(),
        " serve \"--mcp-listen\" \"127.0.0.1:7380\"".to_string(),
        "KillMode=process".to_string(),
        "Restart=always".to_string(),
        "WantedBy=default.target".to_string(),
    ] {
        assert!(unit.contains(&want), "the unit lacks {want}:\n{unit}");
    }
    let bad = home.run(&["service", "install", "--print", "--", "--bogus"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("serve arguments"));

    let status = home.ok(&["service", "status", "--user"]);
    assert!(
        status.contains("not installed") && status.contains("nothing reconciles"),
        "{status}"
    );
    let serve = home.serve(&[]);
    serve.wait_leading();
    let status = home.ok(&["service", "status", "--user"]);
    assert!(status.contains("leads the store"), "{status}");

    if !std::path::Path::new("/run/systemd/system").is_dir() {
        let o = home.run(&["service", "install", "--user"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains("does not run systemd"), "{err}");
        let line = String::from_utf8_lossy(&o.stdout);
        assert!(
            line.contains(&format!("BOXERY_HOME={h}")) && line.trim_end().ends_with(" serve"),
            "{line}"
        );
    }
}

/// `wait --for` as a kubectl user types it: a condition's type in any case, `jsonpath=` with and
/// without braces, with a value or alone (the path has a value), and a timeout that says what
/// the path holds instead of "to be Stopped: it is Stopped".
#[test]
fn wait_for_takes_kubectl_forms() {
    let home = Home::new();
    home.ok(&["new", "w1", "--from", "tiny", "--stopped", "--wait"]);
    for f in [
        "--for=jsonpath={.status.phase}=Stopped",
        "--for=jsonpath=.status.phase=Stopped",
        "--for=jsonpath={.status.phase}",
        "--for=condition=ready=false",
        "--for=condition=READY=False",
    ] {
        home.ok(&["wait", "vm", "w1", f, "--timeout", "5s"]);
    }
    let o = home.run(&[
        "wait",
        "vm",
        "w1",
        "--for=jsonpath={.status.phase}=Running",
        "--timeout",
        "1s",
    ]);
    assert_eq!(o.status.code(), Some(4), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("{.status.phase} to be \"Running\"")
            && err.contains("{.status.phase} is \"Stopped\""),
        "{err}"
    );
    let o = home.run(&[
        "wait",
        "vm",
        "w1",
        "--for=jsonpath={.status.phase",
        "--timeout",
        "1s",
    ]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
}

/// Discovery as a kubectl user reaches for it: `api-resources`, `version`, `completion`, and
/// `exec` pointing at `run`.
#[test]
fn discovery_commands() {
    let home = Home::new();
    let kinds = home.ok(&["api-resources"]);
    let mut lines = kinds.lines();
    let head: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        head,
        [
            "NAME",
            "SHORTNAMES",
            "APIVERSION",
            "NAMESPACED",
            "KIND",
            "VERBS"
        ]
    );
    let vms: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        &vms[..5],
        ["vms", "vm", "boxery.dev/v1alpha1", "false", "Vm"]
    );
    assert!(
        kinds
            .lines()
            .any(|l| l.starts_with("events ") && l.ends_with("get,list,watch,describe"))
    );
    assert_eq!(kinds.lines().count(), 1 + boxery_api::validate::KINDS.len());
    let v = home.ok(&["version"]);
    assert!(
        v.contains(&format!("Client Version: {}", env!("CARGO_PKG_VERSION"))),
        "{v}"
    );
    assert!(
        v.contains(&format!("Store Schema:   {}", boxery_store::SCHEMA_VERSION)),
        "{v}"
    );
    assert!(v.contains("Backend:        fake"), "{v}");
    {
        let serve = home.serve(&[]);
        serve.wait_leading();
        let v = home.ok(&["version"]);
        assert!(v.contains("(leading the store)"), "{v}");
    }
    for shell in ["bash", "zsh", "fish"] {
        let s = home.ok(&["completion", shell]);
        assert!(
            s.contains("api-resources") && s.contains("boxery"),
            "{shell}"
        );
    }
    let o = home.run(&["exec", "dev1", "--", "true"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("boxery run dev1 -- CMD"),
        "{o:?}"
    );
}

/// A list as kubectl prints it: `-o json`/`-o yaml` of a list query are one `kind: List` (even
/// of one item) that `apply -f` takes back, and `-o jsonpath` applies to the List
/// (`{.items[*].metadata.name}`); one named object prints as itself.
#[test]
fn lists_print_as_kubectl_lists() {
    let home = Home::new();
    home.ok(&["new", "l1", "--from", "tiny", "--stopped", "--wait"]);
    let one: serde_json::Value =
        serde_json::from_str(&home.ok(&["get", "vms", "-o", "json"])).unwrap();
    assert_eq!(one["kind"], "List");
    assert_eq!(one["items"].as_array().unwrap().len(), 1);
    let named: serde_json::Value =
        serde_json::from_str(&home.ok(&["get", "vm", "l1", "-o", "json"])).unwrap();
    assert_eq!(named["kind"], "Vm");
    home.ok(&["new", "l2", "--from", "tiny", "--stopped", "--wait"]);
    assert_eq!(
        home.ok(&["get", "vms", "-o", "jsonpath={.items[*].metadata.name}"])
            .trim(),
        "l1 l2"
    );
    let yaml = home.ok(&["get", "vms", "-o", "yaml"]);
    assert!(
        yaml.contains("kind: List") && !yaml.contains("---"),
        "{yaml}"
    );
    let f = home.write("list.yaml", &yaml);
    let applied = home.ok(&["apply", "-f", f.to_str().unwrap()]);
    assert!(
        applied.contains("vm/l1") && applied.contains("vm/l2"),
        "{applied}"
    );
}

/// `get`'s table flags as kubectl's: `--no-headers`, `--show-labels`, `-L KEY`, `--sort-by`.
#[test]
fn get_table_flags() {
    let home = Home::new();
    let f = home.write(
        "vms.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: zz, labels: {team: web, app: a}}\nspec: {source: {image: tiny}, resources: {cpus: 1}}\n---\napiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: aa, labels: {team: db}}\nspec: {source: {image: tiny}, resources: {cpus: 2}}\n",
    );
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    let t = home.ok(&["get", "vms", "--no-headers"]);
    assert!(!t.contains("NAME") && t.lines().count() == 2, "{t}");
    let t = home.ok(&["get", "vms", "--show-labels"]);
    let head: Vec<&str> = t.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(head.last(), Some(&"LABELS"), "{t}");
    assert!(
        t.lines()
            .any(|l| l.starts_with("zz ") && l.ends_with("app=a,team=web")),
        "{t}"
    );
    let t = home.ok(&["get", "vms", "-L", "team"]);
    let head: Vec<&str> = t.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(head.last(), Some(&"TEAM"), "{t}");
    assert!(
        t.lines()
            .any(|l| l.starts_with("aa ") && l.ends_with(" db")),
        "{t}"
    );
    // Sorted by a number, then by a name, as kubectl's --sort-by.
    let by = |path: &str| home.ok(&["get", "vms", "--sort-by", path, "-o", "name"]);
    assert_eq!(by("{.spec.resources.cpus}"), "vm/zz\nvm/aa\n");
    assert_eq!(by(".metadata.name"), "vm/aa\nvm/zz\n");
}

/// Selection as kubectl's: `KIND/NAME` wherever a kind and a name are taken, several kinds at
/// once (`vms,images`, `all`), and one kind per command.
#[test]
fn kind_slash_name_and_several_kinds() {
    let home = Home::new();
    home.ok(&["new", "s1", "--from", "tiny", "--stopped", "--wait"]);
    home.ok(&["new", "s2", "--from", "tiny", "--stopped", "--wait"]);
    assert_eq!(home.ok(&["get", "vm/s1", "-o", "name"]), "vm/s1\n");
    assert_eq!(
        home.ok(&["get", "vm/s1", "vms/s2", "-o", "name"]),
        "vm/s1\nvm/s2\n"
    );
    assert!(home.ok(&["describe", "vm/s1"]).contains("Name:         s1"));
    home.ok(&[
        "wait",
        "vm/s2",
        "--for=jsonpath={.status.phase}=Stopped",
        "--timeout",
        "5s",
    ]);
    let t = home.ok(&["get", "vms,images"]);
    assert!(t.contains("vm/s1") && t.contains("image/tiny"), "{t}");
    assert_eq!(
        t.lines().filter(|l| l.starts_with("NAME")).count(),
        2,
        "{t}"
    );
    let names = home.ok(&["get", "all", "-o", "name"]);
    assert!(
        names.contains("vm/s2\n") && names.contains("image/tiny\n"),
        "{names}"
    );
    let list: serde_json::Value =
        serde_json::from_str(&home.ok(&["get", "vms,images", "-o", "json"])).unwrap();
    assert_eq!(list["kind"], "List");
    assert!(list["items"].as_array().unwrap().len() >= 3);
    for bad in [
        vec!["get", "vm/s1", "image/tiny"],
        vec!["get", "vm", "vm/s1"],
        vec!["get", "vms,images", "s1"],
    ] {
        assert_eq!(home.run(&bad).status.code(), Some(2), "{bad:?}");
    }
    home.ok(&["delete", "vm/s1", "vm/s2", "--wait"]);
    assert_eq!(home.ok(&["get", "vms", "-o", "name"]), "");
}

/// `edit` as kubectl's: `$EDITOR` on the YAML, what changed applied on save (a field a
/// controller wrote meanwhile kept), a refused change reopening the file with the reason, the
/// same refused text saved again ending it (exit 2), an unchanged file a no-op; status and the
/// controllers' metadata refused. The guest verb is `file edit` now.
#[test]
fn edit_opens_the_editor_and_applies_on_save() {
    let home = Home::new();
    home.ok(&["new", "e1", "--from", "tiny", "--stopped", "--wait"]);
    // the text a stopped edit keeps goes to TMPDIR: the test's own, not the machine's /tmp
    let tmp = home.path().join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let edit = |editor: &str, args: &[&str]| {
        let mut c = home.cmd();
        c.env("EDITOR", editor)
            .env("TMPDIR", &tmp)
            .env_remove("KUBE_EDITOR")
            .args(args);
        c.output().unwrap()
    };
    // (the spec's cpus, not the status's)
    let o = edit(
        "sed -i '/^spec:/,/^status:/s/cpus: 1/cpus: 2/'",
        &["edit", "vm", "e1"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "vm/e1 edited\n");
    assert_eq!(
        home.ok(&["get", "vm", "e1", "-o", "jsonpath={.spec.resources.cpus}"]),
        "2\n"
    );
    // KUBE_EDITOR wins over EDITOR, as kubectl's
    let mut c = home.cmd();
    c.env("EDITOR", "false")
        .env("KUBE_EDITOR", "true")
        .args(["edit", "vm/e1"]);
    let o = c.output().unwrap();
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no changes"));

    // refused, reopened with the reason, fixed on the second try
    let script = home.write(
        "ed.sh",
        "#!/bin/sh\nif grep -q 'The change was refused' \"$1\"; then sed -i 's/cpus: many/cpus: 3/' \"$1\"; else sed -i '/^spec:/,/^status:/s/cpus: 2/cpus: many/' \"$1\"; fi\n",
    );
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let o = edit(script.to_str().unwrap(), &["edit", "vm", "e1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("expected an integer, got `many`"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        home.ok(&["get", "vm", "e1", "-o", "jsonpath={.spec.resources.cpus}"]),
        "3\n"
    );
    // the same refused text again: stops, exit 2, nothing changed
    for (editor, says) in [
        (
            "sed -i '/^spec:/,/^status:/s/cpus: 3/cpus: many/'",
            "same refused change",
        ),
        ("sed -i 's/name: e1/name: e2/'", "metadata.name"),
        (
            "sed -i 's/phase: Stopped/phase: Running/'",
            "status cannot be changed",
        ),
    ] {
        let o = edit(editor, &["edit", "vm", "e1"]);
        assert_eq!(o.status.code(), Some(2), "{editor}");
        assert!(
            String::from_utf8_lossy(&o.stderr).contains(says),
            "{editor}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // each stopped edit kept the person's text where it said, in TMPDIR
    let kept = std::fs::read_dir(&tmp).unwrap().flatten().count();
    assert_eq!(kept, 3, "one kept text per stopped edit");
    assert_eq!(
        home.ok(&["get", "vm", "e1", "-o", "jsonpath={.spec.resources.cpus}"]),
        "3\n"
    );
    // the guest verb moved: `file edit` (the old `edit VM PATH --old --new` form is refused)
    let help = home.ok(&["file", "--help"]);
    assert!(
        help.contains("edit") && help.contains("read") && help.contains("write"),
        "{help}"
    );
    assert_eq!(
        code(
            &home,
            &["edit", "e1", "/etc/hostname", "--old", "a", "--new", "b"]
        ),
        2
    );
}

/// `patch --type merge|json`, `label`/`annotate` (KEY-, --overwrite, -l), `scale pool`.
#[test]
fn patch_label_annotate_scale() {
    let home = Home::new();
    home.ok(&["new", "p1", "--from", "tiny", "--stopped", "--wait"]);
    home.ok(&["new", "p2", "--from", "tiny", "--stopped", "--wait"]);
    let get = |path: &str| home.ok(&["get", "vm", "p1", "-o", &format!("jsonpath={path}")]);
    assert_eq!(
        home.ok(&[
            "patch",
            "vm",
            "p1",
            "-p",
            r#"{"spec":{"resources":{"cpus":2}}}"#
        ]),
        "vm/p1 patched\n"
    );
    assert_eq!(
        home.ok(&["patch", "vm/p1", "-p", "spec: {resources: {cpus: 2}}"]),
        "vm/p1 patched (no change)\n",
        "YAML patches too, and no change is said"
    );
    home.ok(&[
        "patch",
        "vm",
        "p1",
        "--type",
        "json",
        "-p",
        r#"[{"op":"replace","path":"/spec/resources/cpus","value":4}]"#,
    ]);
    assert_eq!(get("{.spec.resources.cpus}"), "4\n");
    for (bad, exit) in [
        (
            vec![
                "patch",
                "vm",
                "p1",
                "-p",
                r#"{"spec":{"resources":{"cpus":"x"}}}"#,
            ],
            2,
        ),
        (
            vec![
                "patch",
                "vm",
                "p1",
                "--type",
                "json",
                "-p",
                r#"[{"op":"remove","path":"/spec/nothing"}]"#,
            ],
            2,
        ),
        (
            vec![
                "patch",
                "vm",
                "p1",
                "-p",
                r#"{"metadata":{"finalizers":["x"]}}"#,
            ],
            2,
        ),
        (
            vec![
                "patch",
                "vm",
                "p1",
                "-p",
                r#"{"status":{"phase":"Running"}}"#,
            ],
            2,
        ),
        (
            vec![
                "patch",
                "vm",
                "p1",
                "-p",
                r#"{"metadata":{"resourceVersion":"1"}}"#,
            ],
            5,
        ),
        (vec!["patch", "vm", "p1", "--type", "xml", "-p", "{}"], 2),
        (vec!["patch", "vm", "nope", "-p", "{}"], 3),
    ] {
        assert_eq!(code(&home, &bad), exit, "{bad:?}");
    }
    assert_eq!(
        get("{.spec.resources.cpus}"),
        "4\n",
        "refused patches changed nothing"
    );

    // label: set, refuse a different value without --overwrite (as kubectl), remove with KEY-
    assert_eq!(
        home.ok(&["label", "vm", "p1", "p2", "team=web"]),
        "vm/p1 labeled\nvm/p2 labeled\n"
    );
    assert_eq!(code(&home, &["label", "vm", "p1", "team=api"]), 5);
    // several objects, one refused: what changed before it is said, then the error
    home.ok(&["label", "vm", "p1", "x=2"]);
    let o = home.run(&["label", "vm", "p2", "p1", "x=1"]);
    assert_eq!(o.status.code(), Some(5));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "vm/p2 labeled\n");
    home.ok(&["label", "vm", "p1", "p2", "x-"]);
    home.ok(&["label", "vm/p1", "team=api", "--overwrite"]);
    assert_eq!(
        home.ok(&["get", "vms", "-l", "team=web", "-o", "name"]),
        "vm/p2\n"
    );
    home.ok(&["label", "vm", "-l", "team", "tier=db"]);
    assert_eq!(
        home.ok(&["get", "vms", "-l", "tier=db", "-o", "name"]),
        "vm/p1\nvm/p2\n"
    );
    home.ok(&["label", "vm", "--all", "tier-"]);
    assert_eq!(code(&home, &["get", "vms", "-l", "tier", "-o", "name"]), 0);
    assert_eq!(home.ok(&["get", "vms", "-l", "tier", "-o", "name"]), "");
    assert_eq!(code(&home, &["label", "vm", "p1"]), 2, "no change named");
    assert_eq!(
        code(&home, &["label", "vm", "p1", "boxery.dev/x=1"]),
        2,
        "the system's keys"
    );
    // annotate
    home.ok(&["annotate", "vm", "p1", "owner=ana"]);
    assert_eq!(get("{.metadata.annotations.owner}"), "ana\n");
    home.ok(&["annotate", "vm", "p1", "owner-"]);
    assert!(
        !home
            .ok(&["get", "vm", "p1", "-o", "json"])
            .contains("\"owner\"")
    );

    // scale: the pool's replicas, --current-replicas as a precondition, only pools
    home.ok(&["apply", "-f", home.write("pool.yaml", "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: sp}\nspec: {replicas: 1, template: {spec: {source: {image: tiny}}}}\n").to_str().unwrap()]);
    assert_eq!(
        home.ok(&["scale", "pool", "sp", "--replicas", "3"]),
        "pool/sp scaled\n"
    );
    assert_eq!(
        home.ok(&["get", "pool", "sp", "-o", "jsonpath={.spec.replicas}"]),
        "3\n"
    );
    assert_eq!(
        code(
            &home,
            &[
                "scale",
                "pool/sp",
                "--replicas",
                "0",
                "--current-replicas",
                "2"
            ]
        ),
        5
    );
    home.ok(&[
        "scale",
        "pool/sp",
        "--replicas",
        "0",
        "--current-replicas",
        "3",
    ]);
    assert_eq!(code(&home, &["scale", "vm", "p1", "--replicas", "2"]), 2);
}

/// `--dry-run[=server|client]` and `-o yaml|json|name` on patch, label, annotate and scale (as
/// kubectl's), `-o` on edit: a dry run shows the result and writes nothing; server runs the
/// store's checks, client the schema's.
#[test]
fn changes_dry_run_and_output() {
    let home = Home::new();
    home.ok(&["new", "d1", "--from", "tiny", "--stopped", "--wait"]);
    let cpus = || home.ok(&["get", "vm", "d1", "-o", "jsonpath={.spec.resources.cpus}"]);
    let rv = || {
        home.ok(&[
            "get",
            "vm",
            "d1",
            "-o",
            "jsonpath={.metadata.resourceVersion}",
        ])
    };
    let before = rv();
    let p = r#"{"spec":{"resources":{"cpus":3}}}"#;
    for mode in ["--dry-run", "--dry-run=server", "--dry-run=client"] {
        assert_eq!(
            home.ok(&["patch", "vm", "d1", "-p", p, mode]),
            "vm/d1 patched (dry run)\n",
            "{mode}"
        );
        let yaml = home.ok(&["patch", "vm", "d1", "-p", p, mode, "-o", "yaml"]);
        assert!(yaml.contains("cpus: 3"), "{mode}: {yaml}");
        let bad = home.run(&[
            "patch",
            "vm",
            "d1",
            "-p",
            r#"{"spec":{"resources":{"cpus":"x"}}}"#,
            mode,
        ]);
        assert_eq!(
            bad.status.code(),
            Some(2),
            "{mode}: an invalid change is refused"
        );
    }
    assert_eq!(cpus(), "1\n", "dry runs wrote nothing");
    assert_eq!(rv(), before, "not even a new revision");
    // server: the store's own preconditions are checked
    assert_eq!(
        code(
            &home,
            &[
                "patch",
                "vm",
                "d1",
                "--dry-run",
                "-p",
                r#"{"metadata":{"resourceVersion":"1"}}"#
            ]
        ),
        5
    );
    // -o on a real write prints the stored object
    let json = home.ok(&["patch", "vm/d1", "-p", p, "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["spec"]["resources"]["cpus"], 3);
    assert_eq!(
        v["metadata"]["resourceVersion"].as_str().unwrap(),
        rv().trim()
    );

    // label / annotate
    assert_eq!(
        home.ok(&[
            "label",
            "vm",
            "d1",
            "team=web",
            "--dry-run=client",
            "-o",
            "name"
        ]),
        "vm/d1\n"
    );
    assert_eq!(
        home.ok(&["annotate", "vm", "d1", "owner=ana", "--dry-run"]),
        "vm/d1 annotated (dry run)\n"
    );
    assert_eq!(home.ok(&["get", "vms", "-l", "team", "-o", "name"]), "");
    assert!(
        !home
            .ok(&["get", "vm", "d1", "-o", "yaml"])
            .contains("owner")
    );

    // scale
    home.ok(&["apply", "-f", home.write("pool.yaml", "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: dp}\nspec: {replicas: 1, template: {spec: {source: {image: tiny}}}}\n").to_str().unwrap()]);
    let yaml = home.ok(&[
        "scale",
        "pool/dp",
        "--replicas",
        "4",
        "--dry-run",
        "-o",
        "yaml",
    ]);
    assert!(yaml.contains("replicas: 4"), "{yaml}");
    assert_eq!(
        home.ok(&["get", "pool", "dp", "-o", "jsonpath={.spec.replicas}"]),
        "1\n"
    );

    // bad values: said, exit 2
    let o = home.run(&["scale", "pool/dp", "--replicas", "4", "--dry-run=maybe"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("server"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = home.run(&["label", "vm", "d1", "a=b", "-o", "wide"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("[possible values: yaml, json, name]"));
    assert_eq!(
        home.ok(&["get", "vms", "-l", "a", "-o", "name"]),
        "",
        "refused before writing"
    );

    // edit -o name
    let mut c = home.cmd();
    c.env("EDITOR", "sed -i '/^spec:/,/^status:/s/cpus: 3/cpus: 2/'")
        .env_remove("KUBE_EDITOR")
        .args(["edit", "vm", "d1", "-o", "name"]);
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "vm/d1\n");
    assert_eq!(cpus(), "2\n");
}

/// Selection as kubectl's: `delete -f FILE|DIR`, `-k DIR`, `-l`, `--all`, `--ignore-not-found`;
/// `describe -l` and `describe KIND`; `wait -l`/`--all`.
#[test]
fn selection_by_file_label_and_all() {
    let home = Home::new();
    let dir = home.path().join("m");
    std::fs::create_dir_all(&dir).unwrap();
    for n in ["d1", "d2"] {
        std::fs::write(
            dir.join(format!("{n}.yaml")),
            vm_yaml(n).replace("debian-12", "tiny"),
        )
        .unwrap();
    }
    std::fs::write(
        dir.join("kustomization.yaml"),
        "resources: [d1.yaml, d2.yaml]\ncommonLabels: {app: k}\n",
    )
    .unwrap();
    let d = dir.to_str().unwrap();
    let o = home.run(&["apply", "-f", d]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("kustomization.yaml: a kustomization"),
        "a kustomization in a directory is skipped with a note"
    );
    // -k builds it with kubectl kustomize (its labels are there); kubectl is needed for this
    let have_kubectl = std::process::Command::new("kubectl")
        .arg("version")
        .arg("--client")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        have_kubectl,
        "kubectl is not installed: `-k` builds kustomizations with `kubectl kustomize` (scripts/install-deps.sh installs it)"
    );
    home.ok(&["apply", "-k", d]);
    assert_eq!(
        home.ok(&["get", "vms", "-l", "app=k", "-o", "name"]),
        "vm/d1\nvm/d2\n"
    );
    assert_eq!(home.ok(&["diff", "-k", d]), "");
    // diff --prune: what apply --prune would delete, shown as going away
    std::fs::remove_file(dir.join("d2.yaml")).unwrap();
    std::fs::write(
        dir.join("kustomization.yaml"),
        "resources: [d1.yaml]\ncommonLabels: {app: k}\n",
    )
    .unwrap();
    let o = home.run(&["diff", "-k", d, "--prune", "-l", "app=k"]);
    assert_eq!(o.status.code(), Some(1), "differences");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("+++ pruned/vm/d2") && !text.contains("vm/d1"),
        "{text}"
    );
    std::fs::write(
        dir.join("d2.yaml"),
        vm_yaml("d2").replace("debian-12", "tiny"),
    )
    .unwrap();
    std::fs::write(
        dir.join("kustomization.yaml"),
        "resources: [d1.yaml, d2.yaml]\ncommonLabels: {app: k}\n",
    )
    .unwrap();
    assert_eq!(home.ok(&["diff", "-k", d, "--prune", "-l", "app=k"]), "");

    home.ok(&["new", "x1", "--from", "tiny", "--stopped"]);
    home.ok(&["label", "vm", "x1", "team=web"]);
    assert!(
        home.ok(&["describe", "vm", "-l", "team=web"])
            .contains("Name:         x1")
    );
    let all = home.ok(&["describe", "vms"]);
    assert_eq!(all.matches("\nKind:").count(), 3, "{all}");
    home.ok(&[
        "wait",
        "vm",
        "--all",
        "--for=jsonpath={.metadata.name}",
        "--timeout",
        "5s",
    ]);
    home.ok(&[
        "wait",
        "vm",
        "-l",
        "app=k",
        "--for=jsonpath={.kind}=Vm",
        "--timeout",
        "5s",
    ]);

    // Reconciled first, so each carries its finalizer and `delete` marks it (the jsonpath
    // waits above hold at once: whether their embedded controllers got to the VMs before
    // exiting is a race, and a VM no controller has seen is removed outright).
    home.ok(&[
        "wait",
        "vm",
        "d1",
        "d2",
        "--for=condition=Ready",
        "--timeout",
        "60s",
    ]);
    assert_eq!(
        home.ok(&["delete", "-f", d, "--wait"]),
        "vm/d1 deleting\nvm/d2 deleting\nvm/d1 deleted\nvm/d2 deleted\n"
    );
    assert_eq!(
        code(&home, &["delete", "-f", d]),
        3,
        "gone now: not found, as kubectl"
    );
    assert_eq!(home.ok(&["delete", "-f", d, "--ignore-not-found"]), "");
    assert_eq!(home.ok(&["delete", "vm", "zz", "--ignore-not-found"]), "");
    assert_eq!(code(&home, &["delete", "vm", "zz"]), 3);
    home.ok(&["new", "x2", "--from", "tiny", "--stopped"]);
    assert_eq!(
        home.ok(&["delete", "vm", "-l", "team=web"]),
        "vm/x1 deleting\n"
    );
    home.ok(&["wait", "vm/x1", "--for=delete", "--timeout", "60s"]);
    assert_eq!(home.ok(&["delete", "vm", "--all"]), "vm/x2 deleting\n");
    assert_eq!(
        code(&home, &["delete", "vm"]),
        2,
        "a kind alone deletes nothing"
    );
    assert_eq!(code(&home, &["delete", "vm", "x", "-f", d]), 2);
}

/// Manifests as a kubectl user writes them: every bad document reported (not the first only),
/// typos answered with the nearest field or value, `--dry-run=client|server` with `-o yaml`.
#[test]
fn manifest_errors_and_dry_runs() {
    let home = Home::new();
    let dir = home.path().join("m");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("a.yaml"),
        vm_yaml("a1").replace("source:", "resources: {cpu: 2}\n  source:"),
    )
    .unwrap();
    std::fs::write(
        dir.join("b.yaml"),
        vm_yaml("b1").replace("source:", "runStrategy: running\n  source:"),
    )
    .unwrap();
    std::fs::write(dir.join("c.yaml"), "# only a comment\n").unwrap();
    let o = home.run(&["apply", "-f", dir.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("unknown field `cpu`: did you mean `cpus`?"),
        "{err}"
    );
    assert!(
        err.contains(
            "`running` is not one of Running, Stopped, Suspended: did you mean `Running`?"
        ),
        "{err}"
    );
    assert!(err.contains("2 documents are invalid"), "{err}");
    assert!(err.contains("c.yaml: it holds no document"), "{err}");
    assert!(
        home.ok(&["get", "vms", "-o", "name"]).is_empty(),
        "nothing applied"
    );

    std::fs::remove_file(dir.join("a.yaml")).unwrap();
    std::fs::write(
        dir.join("b.yaml"),
        vm_yaml("b1").replace("debian-12", "tiny"),
    )
    .unwrap();
    let d = dir.to_str().unwrap();
    assert_eq!(
        home.ok(&["apply", "-f", d, "--dry-run=client"]),
        "vm/b1 created (dry run)\n"
    );
    let y = home.ok(&["apply", "-f", d, "--dry-run=server", "-o", "yaml"]);
    assert!(
        y.contains("kind: Vm") && y.contains("cpus: 1"),
        "server dry run shows the defaults: {y}"
    );
    assert!(
        home.ok(&["get", "vms", "-o", "name"]).is_empty(),
        "dry runs write nothing"
    );
    assert_eq!(home.ok(&["apply", "-f", d, "-o", "name"]), "vm/b1\n");
    assert_eq!(
        home.ok(&["apply", "-f", d, "--dry-run=client"]),
        "vm/b1 unchanged (dry run)\n"
    );
    assert_eq!(code(&home, &["apply", "-f", d, "--dry-run=maybe"]), 2);
}

/// `kubectl boxery …`: the binary linked as `kubectl-boxery` on PATH is a kubectl plugin.
#[test]
fn works_as_a_kubectl_plugin() {
    let home = Home::new();
    let bin_dir = home.path().join("bin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    std::os::unix::fs::symlink(common::bin(), bin_dir.join("kubectl-boxery")).unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = |args: &[&str]| {
        std::process::Command::new("kubectl")
            .args(args)
            .env("PATH", &path)
            .env("BOXERY_HOME", home.path())
            .env("BOXERY_BACKEND", "fake")
            .output()
            .expect("kubectl is installed (the plugin test needs it)")
    };
    let o = run(&["plugin", "list"]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("kubectl-boxery"),
        "{o:?}"
    );
    home.ok(&["new", "k1", "--from", "tiny", "--stopped"]);
    let o = run(&["boxery", "get", "vms", "-o", "name"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "vm/k1\n");
}

/// `explain` as kubectl's: types in its words (no raw `["integer","null"]`), whole
/// descriptions, lists and variants walked into, `--recursive`, a typo answered.
#[test]
fn explain_reads_as_kubectl() {
    let home = Home::new();
    let spec = home.ok(&["explain", "vm.spec"]);
    for want in [
        "resources\t<Object>",
        "runStrategy\t<string>",
        "headless\t<boolean>",
        "source\t<Object> -required-",
    ] {
        assert!(spec.contains(want), "{want}: {spec}");
    }
    assert!(!spec.contains("null"), "{spec}");
    let res = home.ok(&["explain", "vm.spec.resources"]);
    assert!(
        res.contains("cpus\t<integer>") && res.contains("memory\t<string>"),
        "{res}"
    );
    // a variant's field, and a list's item fields
    let img = home.ok(&["explain", "vm.spec.source.image"]);
    assert!(
        img.contains("FIELD:    Vm.spec.source.image <string>"),
        "{img}"
    );
    let conds = home.ok(&["explain", "vm.status.conditions"]);
    assert!(
        conds.contains("<[]Object>") && conds.contains("reason\t<string>"),
        "{conds}"
    );
    home.ok(&["explain", "vm.status.conditions.lastTransitionTime"]);
    // every line of a description (the layers field's is two sentences over two lines)
    let layers = home.ok(&["explain", "vm.spec.layers"]);
    let schema: serde_json::Value = serde_json::from_str(&home.ok(&["schema", "vm"])).unwrap();
    let full = schema
        .pointer("/$defs/VmSpec/properties/layers/description")
        .and_then(|d| d.as_str())
        .map(str::to_string)
        .expect("the layers field has a description");
    for l in full.lines() {
        assert!(layers.contains(l.trim()), "{l}: {layers}");
    }
    let rec = home.ok(&["explain", "vm.spec", "--recursive"]);
    assert!(
        rec.contains("   resources\t<Object>") && rec.contains("     cpus\t<integer>"),
        "{rec}"
    );
    let o = home.run(&["explain", "vm.spec.resources.cpu"]);
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stderr).contains("did you mean `cpus`?"));
}

/// `get -w` as kubectl users want it: `--watch-only`, `-o custom-columns`, a row only when the
/// object's row changed, columns that stay put; `-o yaml` documents separated by `---`.
#[test]
fn get_watch_without_duplicates() {
    let home = Home::new();
    home.ok(&["new", "w1", "--from", "tiny", "--stopped"]);
    let mut child = home
        .cmd()
        .args([
            "get",
            "vm",
            "-w",
            "--watch-only",
            "-o",
            "custom-columns=NAME:.metadata.name,CPUS:.spec.resources.cpus",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let next = output_until(&mut child, "custom columns");
    let head = next("NAME");
    assert!(!head.contains("w1"), "--watch-only: {head}");
    home.ok(&["annotate", "vm", "w1", "note=x"]); // its row does not change
    home.ok(&["new", "a-much-longer-name", "--from", "tiny", "--stopped"]);
    home.ok(&["patch", "vm", "w1", "-p", "spec: {resources: {cpus: 2}}"]);
    let got = next("w1 ");
    let _ = child.kill();
    let _ = child.wait();
    let lines: Vec<&str> = got.lines().collect();
    assert_eq!(
        lines.len(),
        3,
        "the header, the new VM, w1's change once: {got}"
    );
    assert!(lines[1].starts_with("a-much-longer-name   1"), "{got}");
    assert_eq!(
        lines[2],
        format!("{:<18}   2", "w1"),
        "columns stay put: {got}"
    );

    let mut child = home
        .cmd()
        .args(["get", "vm", "w1", "-w", "-o", "yaml"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let next = output_until(&mut child, "yaml");
    next("name: w1");
    home.ok(&["patch", "vm", "w1", "-p", "spec: {resources: {cpus: 3}}"]);
    let got = next("cpus: 3");
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        got.contains("\n---\napiVersion"),
        "documents separated by ---: {got}"
    );
}

/// Completion of object names (bash, as a person's shell runs it): after `get vm`, and as
/// KIND/NAME; nothing from a home that does not exist, which is not created.
#[test]
fn completion_offers_object_names() {
    let home = Home::new();
    home.ok(&["new", "dev1", "--from", "tiny", "--stopped"]);
    home.ok(&["new", "dev2", "--from", "tiny", "--stopped"]);
    let script = home.write("boxery.bash", &home.ok(&["completion", "bash"]));
    let complete = |words: &str| {
        let o = shell(&home, "bash")
            .arg("-c")
            .arg(format!(
                "source {}; COMP_WORDS=({words}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); _boxery_with_names; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
                script.display()
            ))
            .output()
            .unwrap();
        assert!(o.status.success(), "{o:?}");
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    assert_eq!(complete("boxery get vm d"), "dev1\ndev2\n");
    assert_eq!(complete("boxery describe vm dev2"), "dev2\n");
    assert_eq!(complete("boxery get vm/dev1"), "vm/dev1\n");
    assert_eq!(complete("boxery delete images x"), "\n", "no image x");
    // a home that does not exist: nothing, and it is not made
    let none = home.path().join("none");
    let o = home
        .cmd()
        .env("BOXERY_HOME", &none)
        .args(["__complete-names", "vm"])
        .output()
        .unwrap();
    assert!(o.status.success() && o.stdout.is_empty(), "{o:?}");
    assert!(!none.exists(), "completion made a home");
}

/// A shell with this build's `boxery` first on PATH and the test's home.
fn shell(home: &Home, sh: &str) -> std::process::Command {
    let bin_dir = std::path::Path::new(common::bin())
        .parent()
        .unwrap()
        .to_path_buf();
    let mut c = std::process::Command::new(sh);
    c.env(
        "PATH",
        format!(
            "{}:{}",
            bin_dir.display(),
            std::env::var("PATH").unwrap_or_default()
        ),
    )
    .env("BOXERY_HOME", home.path())
    .env("BOXERY_BACKEND", "fake");
    c
}

/// zsh, as a person's interactive shell completes: `compinit` autoloads the script from
/// `fpath` and TAB is pressed in a real zsh on a pseudo-terminal (zsh's zpty); the line it
/// leaves is read back. Names after a kind and as KIND/NAME; commands and flags still clap's.
#[test]
fn completion_in_zsh_offers_object_names() {
    let home = Home::new();
    home.ok(&["new", "dev1", "--from", "tiny", "--stopped"]);
    home.ok(&["new", "web7", "--from", "tiny", "--stopped"]);
    let fpath = home.path().join("zfunc");
    std::fs::create_dir_all(&fpath).unwrap();
    std::fs::write(fpath.join("_boxery"), home.ok(&["completion", "zsh"])).unwrap();
    // type the words and TAB, then keys that turn the line into `print LINE:…:END` and run it,
    // then `print DONE` (typed as DO""NE, so its echo never matches): zle takes the keys in
    // order, so no sleep is needed and the read ends when the shell has answered
    let driver = home.write(
        "complete.zsh",
        r#"zmodload zsh/zpty
zpty z "zsh -f -i"
zpty -w z "PS1='> '; fpath=($1 \$fpath); autoload -U compinit && compinit -u -D"
zpty -w -n z "$2"$'\t'$'\C-aprint -r -- LINE:\C-e:END\n'
zpty -w z 'print DO""NE'
zpty -r z out '*DONE*'
zpty -d z
print -r -- "$out"
"#,
    );
    let complete = |words: &str| -> String {
        let o = shell(&home, "timeout")
            .args(["60", "zsh", "-f"])
            .arg(&driver)
            .arg(&fpath)
            .arg(words)
            .output()
            .expect("zsh runs (scripts/install-deps.sh installs it)");
        let out = String::from_utf8_lossy(&o.stdout).replace('\r', "");
        out.lines()
            .find_map(|l| l.strip_prefix("LINE:"))
            .and_then(|l| l.strip_suffix(":END"))
            .unwrap_or_else(|| panic!("no completed line for `{words}`: {out:?}"))
            .trim_end()
            .to_string()
    };
    assert_eq!(complete("boxery describe vm w"), "boxery describe vm web7");
    assert_eq!(complete("boxery get vm/d"), "boxery get vm/dev1");
    assert_eq!(complete("boxery ge"), "boxery get", "commands: clap's");
    assert_eq!(
        complete("boxery get --show-la"),
        "boxery get --show-labels",
        "flags: clap's"
    );
}

/// fish, through its own `complete -C`: names after a kind and as KIND/NAME.
#[test]
fn completion_in_fish_offers_object_names() {
    let home = Home::new();
    home.ok(&["new", "dev1", "--from", "tiny", "--stopped"]);
    home.ok(&["new", "dev2", "--from", "tiny", "--stopped"]);
    let script = home.write("boxery.fish", &home.ok(&["completion", "fish"]));
    let complete = |words: &str| -> String {
        let o = shell(&home, "fish")
            .arg("-c")
            .arg(format!(
                "source {}; complete -C '{words}'",
                script.display()
            ))
            .output()
            .expect("fish runs (scripts/install-deps.sh installs it)");
        assert!(o.status.success(), "{o:?}");
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    assert_eq!(complete("boxery get vm d"), "dev1\ndev2\n");
    assert_eq!(complete("boxery describe vm/d"), "vm/dev1\nvm/dev2\n");
    assert!(complete("boxery get vm --show-l").starts_with("--show-labels"));
}

/// `-o jsonpath` takes kubectl's template language (`{range}…{end}`, quoted literals with
/// `\n`, filters); anything it cannot do is an error (exit 2) naming it, with nothing on
/// stdout (issue 30, class 2: `{range}` printed garbage with exit 0).
#[test]
fn jsonpath_ranges_and_unsupported_templates() {
    let home = Home::new();
    home.ok(&["new", "r1", "--from", "tiny", "--stopped", "--wait"]);
    home.ok(&["new", "r2", "--from", "tiny", "--stopped", "--wait"]);
    assert_eq!(
        home.ok(&[
            "get",
            "vms",
            "-o",
            r#"jsonpath={range .items[*]}{.metadata.name}{"\n"}{end}"#,
        ]),
        "r1\nr2\n"
    );
    assert_eq!(
        home.ok(&[
            "get",
            "vms",
            "-o",
            r#"jsonpath={range .items[?(@.metadata.name=="r2")]}{.metadata.name}{"\t"}{.status.phase}{"\n"}{end}"#,
        ]),
        "r2\tStopped\n"
    );
    for (bad, says) in [
        (
            "jsonpath={range .items[*]}{.metadata.name}",
            "without its `{end}`",
        ),
        ("jsonpath={.metadata.name}{end}", "without a `{range"),
        ("jsonpath={if .a}x{end}", "not supported"),
    ] {
        let o = home.run(&["get", "vms", "-o", bad]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{bad}: {err}");
        assert!(o.stdout.is_empty(), "{bad}: printed {:?}", o.stdout);
        assert!(err.contains(says), "{bad}: {err}");
    }
}

/// What `config` prints from a kubeconfig or contexts.yaml (a server, a context's name) goes
/// through the sanitiser: a hostile file's terminal escapes are shown, not run (issue 30,
/// class 3).
#[test]
fn config_contexts_print_no_raw_escapes_from_files() {
    let home = Home::new();
    let kc = home.write(
        "hostile.kubeconfig",
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: \"https://h.example:7443/\\e]52;c;cm0gLXJmIH4K\\a\\e[2J\"\n    certificate-authority-data: UEVN\nusers:\n- name: u\n  user:\n    token: secret\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\n",
    );
    let o = home.run(&[
        "config",
        "add-context",
        "vmhost",
        "-f",
        kc.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "{err:?}");
    assert!(err.contains("\\u{1b}]52"), "{err}");
    // contexts.yaml edited by hand: a context's name, its server and current-context with
    // escapes too.
    let n = "\"vm\\e[31mhost\"";
    std::fs::write(
        home.path().join("contexts.yaml"),
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: {n}\n  cluster:\n    server: \"https://x\\e[2J:1\"\n    certificate-authority-data: UEVN\nusers:\n- name: {n}\n  user:\n    token: secret\ncontexts:\n- name: {n}\n  context:\n    cluster: {n}\n    user: {n}\ncurrent-context: {n}\n"
        ),
    )
    .unwrap();
    for args in [
        &["config", "get-contexts"][..],
        &["config", "current-context"],
    ] {
        let o = home.run(args);
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(
            !all.contains('\u{1b}') && !all.contains('\u{7}'),
            "{args:?}: {all:?}"
        );
        assert!(all.contains("\\u{1b}["), "{args:?}: {all}");
    }
    // The store's leader is text another process wrote: `version` and `service status` show it
    // escaped too.
    home.ok(&["config", "use-context", "local"]);
    let _lead = home
        .store()
        .try_lead(
            boxery_verbs::control::LOCK,
            &boxery_store::Candidate::current("evil\u{1b}]52;c;eA==\u{7}\u{1b}[2J"),
            Duration::from_secs(120),
        )
        .unwrap();
    for args in [&["version"][..], &["service", "status", "--user"]] {
        let o = home.run(args);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            !out.contains('\u{1b}') && !out.contains('\u{7}'),
            "{args:?}: {out:?}"
        );
        assert!(out.contains("evil\\u{1b}]52"), "{args:?}: {out}");
    }
}

/// A home path is written into the unit as systemd reads it: `%` as `%%` (a specifier
/// otherwise), spaces and `$` kept inside the quoted `Environment=` value, and a path with a
/// newline refused with nothing written (it would start a new setting: `ExecStartPre=`) (issue
/// 30, class 4).
#[test]
fn service_unit_escapes_the_home_path_and_refuses_newlines() {
    let home = Home::new();
    let odd = home.path().join("a%h b$X");
    let o = home
        .cmd()
        .env("BOXERY_HOME", &odd)
        .args(["service", "install", "--user", "--print"])
        .output()
        .unwrap();
    let unit = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let h = home.path().display().to_string();
    for want in [
        format!("Environment=\"BOXERY_HOME={h}/a%%h b$X\"\n"),
        format!("Description=boxery control plane for {h}/a%%h b$X\n"),
    ] {
        assert!(unit.contains(&want), "the unit lacks {want:?}:\n{unit}");
    }
    assert!(!unit.contains("a%h"), "an unescaped specifier:\n{unit}");

    let evil = home.path().join("x\nExecStartPre=/bin/touch /tmp/pwned\n#");
    for extra in [&[][..], &["--print"][..]] {
        let o = home
            .cmd()
            .env("BOXERY_HOME", &evil)
            .args(["service", "install", "--user"])
            .args(extra)
            .env("XDG_CONFIG_HOME", home.path().join("config"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains("holds a newline"), "{err}");
        assert!(
            !String::from_utf8_lossy(&o.stdout).contains("ExecStartPre"),
            "{extra:?}: printed a unit"
        );
        assert!(
            !home.path().join("config/systemd").exists(),
            "a unit was written"
        );
    }
}

/// `grant approve --wait` says "in force" only once the controller applied the generation just
/// approved: a status still saying `Applied` for the spec approved before it changed does not
/// end the wait (issue 30, class 5: state reported from a stale status).
#[test]
fn grant_approve_wait_does_not_take_a_stale_applied() {
    let home = Home::new();
    home.ok(&["new", "dev1", "--from", "tiny", "--wait"]);
    let f = home.write(
        "g1.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Grant\nmetadata: {name: g1}\nspec:\n  vm: dev1\n  type: llm\n  target: anthropic\n  valueFrom: {env: STALE_TEST_KEY}\n",
    );
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    // Generation 1 approved and applied, then the spec changed with nothing reconciling: the
    // status still says Applied (for generation 1).
    let store = home.store();
    let mut g = store.get("Grant", "g1").unwrap().unwrap();
    g.rest.insert(
        "status".into(),
        serde_json::json!({"phase": "Applied", "approvedBy": "root", "approvedGeneration": 1,
            "approvedAt": "2026-01-01T00:00:00Z", "observedGeneration": 1, "vm": "dev1",
            "conditions": [{"type": "Ready", "status": "True", "reason": "Applied",
                "message": "in force", "observedGeneration": 1,
                "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
    );
    store.update_status(g).unwrap();
    let mut g = store.get("Grant", "g1").unwrap().unwrap();
    g.rest.get_mut("spec").unwrap()["target"] = serde_json::json!("openai");
    let g = store.update(g).unwrap();
    assert_eq!(g.metadata.generation, Some(2));
    assert_eq!(g.status()["phase"], "Applied");

    let o = common::on_a_terminal(
        &home,
        "yes",
        &["grant", "approve", "g1", "--wait"],
        &[("STALE_TEST_KEY", "v")],
    );
    let shown = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{shown}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(shown.contains("grant/g1 is in force"), "{shown}");
    let g: boxery_api::Grant = home.store().get_as("g1").unwrap().unwrap();
    assert_eq!(
        (
            g.status.phase,
            g.status.observed_generation,
            g.status.approved_generation
        ),
        (boxery_api::grant::GrantPhase::Applied, Some(2), Some(2)),
        "it said in force before the controller applied generation 2: {shown}"
    );
}

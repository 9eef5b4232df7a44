//! The Kubernetes-compatible API (`serve --api-listen`) driven by clients we did not write:
//! kubectl 1.32 and the official Python `kubernetes` client, on the fake backend. A missing
//! kubectl or client is a failure that says how to install it, never a silent pass.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use common::api::{Api, token_of};
use common::{Home, eventually};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

use common::python_with;

fn vm(name: &str, cpus: u32) -> String {
    format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata:\n  name: {name}\n  labels: {{team: a}}\nspec:\n  resources: {{cpus: {cpus}, memory: 512Mi, disk: 1Gi}}\n  source: {{image: tiny}}\n"
    )
}

#[test]
fn kubectl_drives_boxery() {
    let api = Api::start();
    // discovery and OpenAPI
    let res = api.k(&["api-resources", "--api-group", "boxery.dev"]);
    for kind in ["vms", "images", "pools", "leases", "grants"] {
        assert!(res.contains(kind), "api-resources lacks {kind}: {res}");
    }
    let explain = api.k(&["explain", "vm.spec.resources"]);
    assert!(
        explain.contains("cpus") && explain.contains("memory"),
        "{explain}"
    );

    // client-side apply, then server-side apply of a change
    let f = api.home.write("vm.yaml", &vm("dev1", 1));
    let out = api.k(&["apply", "-f", f.to_str().unwrap()]);
    assert!(out.contains("vm.boxery.dev/dev1 created"), "{out}");
    api.k(&["wait", "--for=condition=Ready", "vm/dev1", "--timeout=30s"]);
    let f2 = api.home.write("vm2.yaml", &vm("dev2", 1));
    api.k(&["apply", "--server-side", "-f", f2.to_str().unwrap()]);
    let f2b = api.home.write("vm2b.yaml", &vm("dev2", 2));
    api.k(&["apply", "--server-side", "-f", f2b.to_str().unwrap()]);
    assert_eq!(
        api.k(&["get", "vm", "dev2", "-o", "jsonpath={.spec.resources.cpus}"]),
        "2"
    );

    // the same columns as `boxery get vms`
    let table = api.k(&["get", "vms"]);
    let header = table
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .collect::<Vec<_>>();
    let ours = api.home.ok(&["get", "vms"]);
    let our_header = ours
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .collect::<Vec<_>>();
    assert_eq!(header, our_header, "kubectl:\n{table}\nboxery:\n{ours}");
    assert!(api.k(&["get", "vms", "-o", "wide"]).contains("EGRESS"));
    let y = api.k(&["get", "vm", "dev1", "-o", "yaml"]);
    assert!(y.contains("kind: Vm") && y.contains("uid:"), "{y}");

    // patch (merge and JSON), label, edit with a scripted editor
    api.k(&[
        "patch",
        "vm",
        "dev1",
        "--type=merge",
        "-p",
        r#"{"spec":{"resources":{"cpus":3}}}"#,
    ]);
    api.k(&[
        "patch",
        "vm",
        "dev1",
        "--type=json",
        "-p",
        r#"[{"op":"replace","path":"/spec/resources/cpus","value":4}]"#,
    ]);
    api.k(&["label", "vm", "dev1", "env=x"]);
    assert_eq!(
        api.k(&[
            "get",
            "vm",
            "dev1",
            "-o",
            "jsonpath={.spec.resources.cpus} {.metadata.labels.env}"
        ]),
        "4 x"
    );
    let editor = api.home.write(
        "editor.sh",
        "#!/bin/sh\nsed -i 's/cpus: 4/cpus: 1/' \"$1\"\n",
    );
    std::fs::set_permissions(&editor, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let o = api.kubectl_with(
        &api.kubeconfig,
        &["edit", "vm", "dev1"],
        &[("KUBE_EDITOR", editor.to_str().unwrap())],
    );
    assert!(
        o.status.success(),
        "edit: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        api.k(&["get", "vm", "dev1", "-o", "jsonpath={.spec.resources.cpus}"]),
        "1"
    );

    // a change made with boxery reaches `kubectl get -w` (read as it comes, up to a minute)
    let mut w = Command::new("kubectl")
        .args(["get", "vms", "dev1", "-w", "--output-watch-events"])
        .env("KUBECONFIG", &api.kubeconfig)
        .env("HOME", api.home.path())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let out = w.stdout.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // the watch is up once its first row (the current state) is printed
    let first = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("kubectl get -w printed a row");
    api.home.ok(&["stop", "dev1"]);
    let mut watched = vec![first];
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !watched
        .iter()
        .any(|l| l.contains("MODIFIED") && l.contains("Stopped"))
    {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => watched.push(l),
            Err(_) => panic!("no MODIFIED … Stopped row within a minute: {watched:?}"),
        }
    }
    w.kill().unwrap();
    let _ = w.wait();

    // describe shows the events
    let d = api.k(&["describe", "vm", "dev1"]);
    assert!(d.contains("Events:") && d.contains("Created"), "{d}");

    // a stale update: 409; a bad manifest: 422 naming the field
    let mut cur = api.k(&["get", "vm", "dev1", "-o", "yaml"]);
    let rv = cur
        .lines()
        .find(|l| l.contains("resourceVersion:"))
        .unwrap()
        .to_string();
    cur = cur.replace(&rv, "  resourceVersion: \"2\"");
    let stale = api.home.write("stale.yaml", &cur);
    let e = api.k_err(&["replace", "-f", stale.to_str().unwrap()]);
    assert!(e.contains("Conflict") && e.contains("stale"), "{e}");
    let bad = api
        .home
        .write("bad.yaml", &vm("bad", 1).replace("cpus:", "cpu:"));
    let e = api.k_err(&["apply", "-f", bad.to_str().unwrap()]);
    assert!(
        e.contains("is invalid") && e.contains("spec.resources") && e.contains("cpus"),
        "{e}"
    );

    // delete --wait: gone when it returns
    api.k(&["delete", "vm", "dev2", "--wait", "--timeout=60s"]);
    let e = api.k_err(&["get", "vm", "dev2"]);
    assert!(e.contains("NotFound") && e.contains("dev2"), "{e}");
}

#[test]
fn tokens_and_scopes() {
    let api = Api::start();
    let addr = std::fs::read_to_string(api.home.path().join("api/addr")).unwrap();
    // no token: 401, over TLS with the home's CA
    let ca = api.home.path().join("api/ca.crt");
    let o = Command::new("curl")
        .args([
            "-s",
            "--cacert",
            ca.to_str().unwrap(),
            &format!("https://{}/apis/boxery.dev/v1alpha1/vms", addr.trim()),
        ])
        .output()
        .expect("curl");
    let body = String::from_utf8_lossy(&o.stdout);
    assert!(body.contains("\"code\":401"), "{body}");
    // read-only: reads, and gets 403 on writes
    let ro = api
        .home
        .ok(&["kubeconfig", "--scope", "read", "--name", "ro"]);
    let ro = api.home.write("ro.yaml", &ro);
    let f = api.home.write("vm.yaml", &vm("r1", 1));
    let o = api.kubectl_with(&ro, &["apply", "-f", f.to_str().unwrap()], &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("Forbidden") && err.contains("scope read"),
        "{err}"
    );
    assert!(api.kubectl_with(&ro, &["get", "vms"], &[]).status.success());
    // a status write is refused to everyone (a Grant is approved by a person at a terminal)
    api.k(&["apply", "-f", f.to_str().unwrap()]);
    let e = api.k_err(&[
        "patch",
        "vm",
        "r1",
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"phase":"Running"}}"#,
    ]);
    assert!(e.contains("controllers only"), "{e}");
    // revoked: 401 on the next request
    api.home.ok(&["kubeconfig", "--revoke", "ro"]);
    let o = api.kubectl_with(&ro, &["get", "vms"], &[]);
    assert!(!o.status.success(), "a revoked token still reads");
    assert!(String::from_utf8_lossy(&o.stderr).contains("Unauthorized"));
    // a lease-scoped token: its lease only (the lease does not exist: 403)
    let l = api
        .home
        .ok(&["kubeconfig", "--scope", "lease:nope", "--name", "l"]);
    let l = api.home.write("l.yaml", &l);
    let o = api.kubectl_with(&l, &["get", "vms"], &[]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("Forbidden"));
}

#[test]
fn the_python_client_lists_watches_creates_and_patches() {
    let api = Api::start();
    let python = python_with("kubernetes");
    let o = Command::new(&python)
        .arg(root().join("tests/api/k8s_client.py"))
        .arg(&api.kubeconfig)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for line in [
        "version: v1.32",
        "create again: 409",
        "bad patch: 422",
        "watch live: label seen",
        "delete dry run: kept",
        "delete stale preconditions: 409",
        "delete unsupported options: 422",
        "delete: py1",
    ] {
        assert!(out.contains(line), "{out}");
    }
}

#[test]
fn a_lease_token_reaches_its_lease_and_vm_only() {
    let api = Api::start();
    let pool = api.home.write(
        "pool.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: p}\nspec:\n  replicas: 2\n  template:\n    spec:\n      source: {image: tiny}\n",
    );
    api.home.ok(&["apply", "-f", pool.to_str().unwrap()]);
    api.home
        .ok(&["lease", "acquire", "p", "--name", "mine", "--wait"]);
    let held = eventually(Duration::from_secs(60), || {
        let l: boxery_api::Lease = api.home.store().get_as("mine").ok()??;
        l.status.vm.clone()
    })
    .expect("lease mine holds a VM");
    let kc = api
        .home
        .ok(&["kubeconfig", "--scope", "lease:mine", "--name", "agent"]);
    let kc = api.home.write("agent.yaml", &kc);
    let as_agent = |args: &[&str]| api.kubectl_with(&kc, args, &[]);
    // its VM: listed alone, read and changed
    let o = as_agent(&["get", "vms", "-o", "name"]);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        format!("vm.boxery.dev/{held}")
    );
    let o = as_agent(&["label", "vm", &held, "agent=yes"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // another VM of the pool, a create, a delete: 403
    let all = api.home.ok(&["get", "vms", "-o", "name"]);
    let other = all
        .lines()
        .map(|l| l.trim_start_matches("vm/"))
        .find(|n| *n != held)
        .expect("a second member");
    for args in [vec!["get", "vm", other], vec!["delete", "vm", &held]] {
        let o = as_agent(&args);
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("Forbidden"),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // an agent's token tightens egress, never loosens it
    let o = as_agent(&[
        "patch",
        "vm",
        &held,
        "--type=merge",
        "-p",
        r#"{"spec":{"network":{"egress":{"policy":"Deny"}}}}"#,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = as_agent(&[
        "patch",
        "vm",
        &held,
        "--type=merge",
        "-p",
        r#"{"spec":{"network":{"egress":{"policy":"Public"}}}}"#,
    ]);
    assert!(!o.status.success(), "an agent loosened egress");
    // released: the token reaches nothing, and a watch it holds ends with a 403
    let mut watch = watch_vms(
        &api,
        &token_of(&std::fs::read_to_string(&kc).unwrap()),
        "",
        60,
    );
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(watch.stdout.take().unwrap()));
    let first = lines.next().expect("the watch's first line").unwrap();
    assert!(
        first.contains(r#""type":"ADDED""#) && first.contains(&held),
        "{first}"
    );
    api.home.ok(&["lease", "release", "mine"]);
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let _ = watch.wait();
    assert!(
        rest.last()
            .is_some_and(|l| l.contains(r#""type":"ERROR""#) && l.contains(r#""code":403"#)),
        "the lease's watch went on after its release: {rest:?}"
    );
    let o = as_agent(&["get", "vm", &held]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("Forbidden") && (e.contains("has ended") || e.contains("does not exist")),
        "{e}"
    );
}

/// A raw watch of `vms` over HTTPS with the home's CA and `token`, as a running curl whose
/// stdout gives the event lines; it ends after `secs` seconds at most.
fn watch_vms(api: &Api, token: &str, query: &str, secs: u64) -> std::process::Child {
    let addr = std::fs::read_to_string(api.home.path().join("api/addr")).unwrap();
    Command::new("curl")
        .args([
            "-sN",
            "--max-time",
            &secs.to_string(),
            "--cacert",
            api.home.path().join("api/ca.crt").to_str().unwrap(),
            "-H",
            &format!("Authorization: Bearer {token}"),
            &format!(
                "https://{}/apis/boxery.dev/v1alpha1/vms?watch=1&{query}",
                addr.trim()
            ),
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("curl")
}

/// The lines of a watch with the full token, until `want` lines or `secs` seconds.
fn watch_lines(api: &Api, query: &str, want: usize, secs: u64) -> Vec<serde_json::Value> {
    let token = token_of(&std::fs::read_to_string(&api.kubeconfig).unwrap());
    let o = watch_vms(api, &token, query, secs)
        .wait_with_output()
        .expect("curl");
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .take(want)
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn a_watch_from_a_compacted_revision_is_gone_and_bookmarks_carry_the_revision() {
    let api = Api::start();
    for i in 0..5 {
        let f = api.home.write("v.yaml", &vm(&format!("w{i}"), 1));
        api.home.ok(&["apply", "-f", f.to_str().unwrap()]);
    }
    let store = api.home.store();
    store.compact(1).unwrap();
    assert!(store.compacted().unwrap() > 2, "nothing was compacted");
    // read after the compaction: the controllers keep writing, so a revision read before it
    // may be below the floor it raised
    let now = store.revision().unwrap();
    let lines = watch_lines(&api, "resourceVersion=1", 1, 5);
    assert_eq!(lines[0]["type"], "ERROR", "{lines:?}");
    assert_eq!(lines[0]["object"]["code"], 410, "{lines:?}");
    assert_eq!(lines[0]["object"]["reason"], "Expired");
    // from the current revision with bookmarks: the controllers' changes, then a bookmark at
    // the last revision sent
    let lines = watch_lines(
        &api,
        &format!("resourceVersion={now}&allowWatchBookmarks=true&timeoutSeconds=12"),
        10_000,
        13,
    );
    let b = lines
        .iter()
        .position(|l| l["type"] == "BOOKMARK")
        .unwrap_or_else(|| panic!("no bookmark in {} lines", lines.len()));
    let rv: u64 = lines[b]["object"]["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let sent = lines[..b]
        .iter()
        .map(|l| {
            l["object"]["metadata"]["resourceVersion"]
                .as_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        })
        .max()
        .unwrap_or(now);
    assert!(
        rv >= now && rv >= sent,
        "bookmark {rv}, from {now}, sent up to {sent}"
    );
}

#[test]
fn mcp_is_served_behind_the_api_tokens() {
    let api = Api::start();
    let python = python_with("mcp");
    let addr = std::fs::read_to_string(api.home.path().join("api/addr")).unwrap();
    let full = token_of(&std::fs::read_to_string(&api.kubeconfig).unwrap());
    let read = token_of(
        &api.home
            .ok(&["kubeconfig", "--scope", "read", "--name", "r"]),
    );
    let o = Command::new(&python)
        .arg(root().join("tests/mcp/client.py"))
        .args(["api", &format!("https://{}/mcp", addr.trim()), &full, &read])
        .arg(api.home.path().join("api/ca.crt"))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("api: ok"),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A second home that holds only a context (`boxery config add-context`) works on the first
/// home's `serve` with boxery's own verbs: apply with --wait, get (the same columns), label,
/// stop and a wait that sees it, delete; a read-only context reads and is refused writes;
/// commands that need the VM host say so; a revoked token and a stopped serve are errors that
/// name the context. The second home never gets a store or any of the first's keys.
#[test]
fn a_context_drives_another_home_with_boxerys_own_verbs() {
    let api = Api::start();
    let laptop = Home::new();
    let kc = api.kubeconfig.to_str().unwrap();
    let err_of = |o: &Output| String::from_utf8_lossy(&o.stderr).into_owned();
    let o = laptop.run(&["config", "add-context", "vmhost", "-f", kc, "--use"]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(err_of(&o).contains("(current)"), "{}", err_of(&o));
    let listed = laptop.ok(&["config", "get-contexts"]);
    assert!(
        listed
            .lines()
            .any(|l| l.trim_start().starts_with("* ") && l.contains("vmhost")),
        "{listed}"
    );
    assert_eq!(laptop.ok(&["config", "current-context"]).trim(), "vmhost");

    let f = laptop.write("vm.yaml", &vm("c1", 1));
    laptop.ok(&[
        "apply",
        "-f",
        f.to_str().unwrap(),
        "--wait",
        "--timeout",
        "60s",
    ]);
    // the same store: the VM host sees it, and both print the same table
    assert!(api.home.ok(&["get", "vm", "c1"]).contains("c1"));
    let here = api.home.ok(&["get", "vms"]);
    let there = laptop.ok(&["get", "vms"]);
    assert_eq!(
        here.lines().next(),
        there.lines().next(),
        "the columns differ"
    );
    laptop.ok(&["label", "vm", "c1", "tier=web"]);
    assert!(
        laptop
            .ok(&["get", "vms", "-l", "tier=web", "-o", "name"])
            .contains("vm/c1")
    );
    // a change made on the VM host is seen by a wait through the context
    api.home.ok(&["stop", "c1"]);
    laptop.ok(&[
        "wait",
        "vm",
        "c1",
        "--for=jsonpath={.status.phase}=Stopped",
        "--timeout",
        "60s",
    ]);
    let d = laptop.ok(&["describe", "vm", "c1"]);
    assert!(d.contains("Stopped"), "{d}");

    // read-only: reads; writes refused, naming the scope
    let ro = api
        .home
        .ok(&["kubeconfig", "--scope", "read", "--name", "ro"]);
    let ro = laptop.write("ro.yaml", &ro);
    laptop.ok(&["config", "add-context", "ro", "-f", ro.to_str().unwrap()]);
    assert!(laptop.ok(&["--context", "ro", "get", "vms"]).contains("c1"));
    let o = laptop.run(&["--context", "ro", "delete", "vm", "c1"]);
    assert!(
        !o.status.success() && err_of(&o).contains("scope read"),
        "{}",
        err_of(&o)
    );

    // what needs the VM host says so
    let o = laptop.run(&["orphans"]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("through context vmhost"),
        "{}",
        err_of(&o)
    );
    // ssh to a VM that runs no guest (the fake backend): the VM host's reason
    let o = laptop.run(&["run", "c1", "--", "true"]);
    assert!(
        !o.status.success() && err_of(&o).contains("c1"),
        "{}",
        err_of(&o)
    );

    laptop.ok(&["delete", "vm", "c1", "--wait", "--timeout", "60s"]);
    assert!(!api.home.ok(&["get", "vms", "-o", "name"]).contains("c1"));

    // nothing of the VM host's lives here: no store, no keys but this machine's own
    assert!(!laptop.path().join("store.db").exists());
    assert!(!laptop.path().join("ssh").exists());
    let contexts = std::fs::read_to_string(laptop.path().join("contexts.yaml")).unwrap();
    assert!(contexts.contains("current-context: vmhost"), "{contexts}");

    // a revoked token: the next command says why, naming the context
    api.home.ok(&["kubeconfig", "--revoke", "test"]);
    let o = laptop.run(&["get", "vms"]);
    assert!(
        !o.status.success() && err_of(&o).contains("vmhost") && err_of(&o).contains("401"),
        "{}",
        err_of(&o)
    );
    // `local` is this home's own store
    assert!(laptop.ok(&["--context", "local", "get", "vms"]).is_empty());
    laptop.ok(&["config", "use-context", "local"]);
    laptop.ok(&["config", "delete-context", "vmhost"]);
    assert_eq!(laptop.ok(&["config", "current-context"]).trim(), "local");
    // a serve that is gone: the error says where it looked
    let ro_ctx = laptop.run(&["--context", "ro", "get", "vms"]);
    assert!(ro_ctx.status.success());
    drop(api);
    let o = laptop.run(&["--context", "ro", "get", "vms"]);
    assert!(
        !o.status.success() && err_of(&o).contains("cannot reach the API of context ro"),
        "{}",
        err_of(&o)
    );
}

/// A request with the full token (curl over HTTPS with the home's CA): the answer's JSON.
fn call(api: &Api, method: &str, path: &str, body: Option<&str>) -> serde_json::Value {
    let (_, v) = api.request(&api.kubeconfig, method, path, body);
    assert!(
        !v.is_string(),
        "{method} {path}: the answer is not JSON: {v}"
    );
    v
}

/// The names `kubectl get vms -o name` lists.
fn vm_names(api: &Api) -> Vec<String> {
    api.k(&["get", "vms", "-o", "name"])
        .lines()
        .map(|l| l.trim_start_matches("vm.boxery.dev/").to_string())
        .collect()
}

/// kubectl's delete options travel in a DeleteOptions body: a server dry run (of a delete, of
/// `--all`, of apply's prune) deletes nothing; stale preconditions are a 409; what boxery
/// cannot carry out (orphaning, a grace period) is refused, naming what is served.
#[test]
fn delete_options_in_the_body_are_honoured() {
    let api = Api::start();
    for n in ["d1", "d2"] {
        let f = api.home.write(&format!("{n}.yaml"), &vm(n, 1));
        api.k(&["apply", "-f", f.to_str().unwrap()]);
    }
    let both = vec!["d1".to_string(), "d2".to_string()];
    let out = api.k(&["delete", "vm", "d1", "--dry-run=server"]);
    assert!(out.contains("server dry run"), "{out}");
    let out = api.k(&["delete", "vms", "--all", "--dry-run=server"]);
    assert!(
        out.contains("d2") && out.contains("server dry run"),
        "{out}"
    );
    assert_eq!(vm_names(&api), both, "a server dry run deleted");
    // apply --prune --dry-run=server: d2 would be pruned, and is not
    let d1 = api.home.path().join("d1.yaml");
    let out = api.k(&[
        "apply",
        "--prune",
        "-l",
        "team=a",
        "--prune-allowlist=boxery.dev/v1alpha1/Vm",
        "--dry-run=server",
        "-f",
        d1.to_str().unwrap(),
    ]);
    assert!(out.contains("d2 pruned (server dry run)"), "{out}");
    assert_eq!(vm_names(&api), both, "a server dry run pruned");
    // a deletecollection with a dry run in its body
    let listed = call(
        &api,
        "DELETE",
        "/apis/boxery.dev/v1alpha1/vms",
        Some(r#"{"kind":"DeleteOptions","apiVersion":"v1","dryRun":["All"]}"#),
    );
    assert_eq!(
        listed["items"].as_array().map(Vec::len),
        Some(2),
        "{listed}"
    );
    assert_eq!(vm_names(&api), both, "a dry-run deletecollection deleted");

    // preconditions: a stale resourceVersion or another uid is a 409, and nothing is deleted
    let cur = call(&api, "GET", "/apis/boxery.dev/v1alpha1/vms/d1", None);
    let uid = cur["metadata"]["uid"].as_str().unwrap().to_string();
    for pre in [
        r#"{"resourceVersion":"1"}"#.to_string(),
        format!(r#"{{"uid":"{uid}x"}}"#),
    ] {
        let s = call(
            &api,
            "DELETE",
            "/apis/boxery.dev/v1alpha1/vms/d1",
            Some(&format!(r#"{{"preconditions":{pre}}}"#)),
        );
        assert_eq!(s["code"], 409, "{pre}: {s}");
        assert!(
            s["message"]
                .as_str()
                .unwrap()
                .contains("Precondition failed"),
            "{s}"
        );
    }
    assert_eq!(vm_names(&api), both, "a stale precondition deleted");

    // what boxery cannot do is refused, saying what it can
    for (args, says) in [
        (
            vec!["delete", "vm", "d1", "--cascade=orphan"],
            "cannot orphan",
        ),
        (
            vec!["delete", "vm", "d1", "--grace-period=30"],
            "only 0 or 1",
        ),
        (
            vec!["delete", "vms", "--all", "--cascade=orphan"],
            "cannot orphan",
        ),
    ] {
        let e = api.k_err(&args);
        assert!(
            e.contains(says) && e.contains("not supported"),
            "{args:?}: {e}"
        );
    }
    assert_eq!(vm_names(&api), both, "a refused delete deleted");

    // and what it can is done: the right uid, foreground, now
    let s = call(
        &api,
        "DELETE",
        "/apis/boxery.dev/v1alpha1/vms/d1",
        Some(&format!(
            r#"{{"preconditions":{{"uid":"{uid}"}},"propagationPolicy":"Foreground"}}"#
        )),
    );
    assert!(s["code"].is_null(), "{s}");
    api.k(&["delete", "vm", "d2", "--now", "--wait", "--timeout=60s"]);
    api.k(&["wait", "--for=delete", "vm/d1", "--timeout=60s"]);
    assert!(vm_names(&api).is_empty());
}

/// `method` of `path` on the API with `token` (curl, the home's CA): the status and body.
fn curl_api(
    api: &Api,
    token: &str,
    method: &str,
    path: &str,
    content_type: &str,
    body: &str,
) -> (u16, String) {
    let addr = std::fs::read_to_string(api.home.path().join("api/addr")).unwrap();
    let o = Command::new("curl")
        .args(["-s", "--max-time", "60", "-X", method, "--cacert"])
        .arg(api.home.path().join("api/ca.crt"))
        .args(["-H", &format!("Authorization: Bearer {token}")])
        .args(["-H", &format!("Content-Type: {content_type}")])
        .args(["--data-binary", body, "-w", "\n%{http_code}"])
        .arg(format!("https://{}{path}", addr.trim()))
        .output()
        .expect("curl");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", &out));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// Small input, unbounded work: the reported 3 KB JSON patch from a `lease:` token, whose
/// `copy` operations double its VM at each step, is refused (422) while it is applied, and
/// the same `serve` answers the next request; the VM is unchanged.
#[test]
fn a_self_copying_patch_from_a_lease_token_is_refused_and_serve_lives() {
    let api = Api::start();
    let pool = api.home.write(
        "pool.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: p}\nspec:\n  replicas: 1\n  template:\n    spec:\n      source: {image: tiny}\n",
    );
    api.home.ok(&["apply", "-f", pool.to_str().unwrap()]);
    api.home
        .ok(&["lease", "acquire", "p", "--name", "mine", "--wait"]);
    let held = eventually(Duration::from_secs(60), || {
        let l: boxery_api::Lease = api.home.store().get_as("mine").ok()??;
        l.status.vm.clone()
    })
    .expect("lease mine holds a VM");
    let kc = api
        .home
        .ok(&["kubeconfig", "--scope", "lease:mine", "--name", "agent"]);
    let token = token_of(&kc);
    let labels = serde_json::json!({"op": "add", "path": "/metadata/labels", "value": {}});
    let ops: Vec<serde_json::Value> = std::iter::once(labels)
        .chain((0..48).map(|i| {
            serde_json::json!({"op": "copy", "from": "/metadata", "path": format!("/metadata/labels/x{i}")})
        }))
        .collect();
    let patch = serde_json::Value::Array(ops).to_string();
    assert!(patch.len() < 4096, "{} bytes", patch.len());
    let vm_path = format!("/apis/boxery.dev/v1alpha1/vms/{held}");
    let before = api.k(&["get", "vm", &held, "-o", "jsonpath={.metadata.labels}"]);
    let (code, body) = curl_api(
        &api,
        &token,
        "PATCH",
        &vm_path,
        "application/json-patch+json",
        &patch,
    );
    assert_eq!(code, 422, "{body}");
    assert!(body.contains("at most 1024 KiB"), "{body}");
    // the same serve answers, with the VM as it was
    let (code, body) = curl_api(&api, &token, "GET", &vm_path, "application/json", "");
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        api.k(&["get", "vm", &held, "-o", "jsonpath={.metadata.labels}"]),
        before
    );
}

/// Revoking a token ends the watches it holds, on both watch endpoints (the Kubernetes watch
/// and the store's), within the re-check period, with a last line that says why.
#[test]
fn a_revoked_tokens_watches_end() {
    let api = Api::start();
    api.home.ok(&["new", "w1"]);
    let kc = api
        .home
        .ok(&["kubeconfig", "--scope", "read", "--name", "watcher"]);
    let token = token_of(&kc);
    let addr = std::fs::read_to_string(api.home.path().join("api/addr")).unwrap();
    let store_watch = Command::new("curl")
        .args(["-sN", "--max-time", "60", "--cacert"])
        .arg(api.home.path().join("api/ca.crt"))
        .args(["-H", &format!("Authorization: Bearer {token}")])
        .arg(format!(
            "https://{}/boxery/v1/store/watch?from=0",
            addr.trim()
        ))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("curl");
    let kube_watch = watch_vms(&api, &token, "", 60);
    let mut streams = Vec::new();
    for (what, mut child) in [("store", store_watch), ("kubernetes", kube_watch)] {
        let mut lines =
            std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
        let first = lines.next().expect("the watch's first line").unwrap();
        assert!(first.contains("w1"), "{what}: {first}");
        streams.push((what, child, lines));
    }
    let revoked = std::time::Instant::now();
    api.home.ok(&["kubeconfig", "--revoke", "watcher"]);
    for (what, mut child, lines) in streams {
        let rest: Vec<String> = lines.map_while(Result::ok).collect();
        let _ = child.wait();
        let took = revoked.elapsed();
        assert!(
            took < Duration::from_secs(20),
            "the {what} watch went on {took:?} after its token was revoked"
        );
        let last = rest.last().cloned().unwrap_or_default();
        assert!(last.contains("revoked"), "{what}: {rest:?}");
    }
}

/// Server-side apply owns the fields a manifest names, not the defaults it left out: after
/// `boxery stop` (runStrategy) and `boxery scale` (replicas), applying the same manifest again
/// is no conflict and keeps what they set, as `boxery apply` of the same file does.
#[test]
fn server_side_apply_owns_only_what_the_manifest_names() {
    let api = Api::start();
    let f = api.home.write("s1.yaml", &vm("s1", 1));
    let f = f.to_str().unwrap();
    api.k(&["apply", "--server-side", "-f", f]);
    api.home.ok(&["stop", "s1"]);
    let out = api.k(&["apply", "--server-side", "-f", f]);
    assert!(out.contains("serverside-applied"), "{out}");
    assert_eq!(
        api.k(&["get", "vm", "s1", "-o", "jsonpath={.spec.runStrategy}"]),
        "Stopped"
    );
    let pool = api.home.write(
        "p.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: p}\nspec:\n  template:\n    spec:\n      source: {image: tiny}\n",
    );
    let pool = pool.to_str().unwrap();
    api.k(&["apply", "--server-side", "-f", pool]);
    api.home.ok(&["scale", "pool/p", "--replicas", "1"]);
    api.k(&["apply", "--server-side", "-f", pool]);
    assert_eq!(
        api.k(&["get", "pool", "p", "-o", "jsonpath={.spec.replicas}"]),
        "1"
    );
    // what the manifest does name stays a conflict with whoever set it last
    let running = api.home.write(
        "s1r.yaml",
        &vm("s1", 1).replace("spec:\n", "spec:\n  runStrategy: Running\n"),
    );
    let e = api.k_err(&["apply", "--server-side", "-f", running.to_str().unwrap()]);
    assert!(e.contains("conflict") && e.contains("runStrategy"), "{e}");
}

/// What the API answers as Kubernetes does: discovery with a trailing slash, a namespace in a
/// body refused as `boxery apply` refuses it, a watch or list from a revision the store has
/// not reached answered (504 "Too large resource version") instead of hanging.
#[test]
fn discovery_slashes_namespaces_and_revisions_ahead() {
    let api = Api::start();
    for (path, key) in [
        ("/version/", "gitVersion"),
        ("/apis/", "groups"),
        ("/api/", "versions"),
    ] {
        let v = call(&api, "GET", path, None);
        assert!(v.get(key).is_some(), "{path}: {v}");
    }
    // a namespace: refused by the API and by `boxery apply` alike, naming the field
    let namespaced = vm("ns1", 1).replace("  name: ns1\n", "  name: ns1\n  namespace: default\n");
    let f = api.home.write("ns1.yaml", &namespaced);
    let body = r#"{"apiVersion":"boxery.dev/v1alpha1","kind":"Vm","metadata":{"name":"ns1","namespace":"default"},"spec":{"source":{"image":"tiny"}}}"#;
    let s = call(&api, "POST", "/apis/boxery.dev/v1alpha1/vms", Some(body));
    assert_eq!(s["code"], 422, "{s}");
    assert_eq!(
        s["details"]["causes"][0]["field"], "metadata.namespace",
        "{s}"
    );
    let o = api.home.run(&["apply", "-f", f.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("namespace"), "{e}");
    assert!(vm_names(&api).is_empty());
    // a revision ahead of the store's
    let now = api.home.store().revision().unwrap();
    let ahead = now + 1_000_000;
    for q in [
        format!("watch=1&resourceVersion={ahead}"),
        format!("resourceVersion={ahead}"),
    ] {
        let started = std::time::Instant::now();
        let s = call(
            &api,
            "GET",
            &format!("/apis/boxery.dev/v1alpha1/vms?{q}"),
            None,
        );
        assert_eq!(s["code"], 504, "{q}: {s}");
        assert!(
            s["message"]
                .as_str()
                .unwrap()
                .contains("Too large resource version"),
            "{s}"
        );
        assert_eq!(
            s["details"]["causes"][0]["reason"],
            "ResourceVersionTooLarge"
        );
        assert!(started.elapsed() < Duration::from_secs(20), "{q} hung");
    }
}

/// `kubectl scale` through the Pool's scale subresource (a server dry run changes nothing; a
/// kind without one says so, not that the object is missing), and `kubectl get -o yaml |
/// kubectl apply -f -` of a List, which kubectl checks against `/openapi/v2`.
#[test]
fn kubectl_scales_pools_and_reapplies_what_it_got() {
    let api = Api::start();
    let pool = api.home.write(
        "p.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: p}\nspec:\n  replicas: 1\n  template:\n    spec:\n      source: {image: tiny}\n",
    );
    api.home.ok(&["apply", "-f", pool.to_str().unwrap()]);
    let out = api.k(&["scale", "pool/p", "--replicas=2"]);
    assert!(out.contains("pool.boxery.dev/p scaled"), "{out}");
    let replicas = || api.k(&["get", "pool", "p", "-o", "jsonpath={.spec.replicas}"]);
    assert_eq!(replicas(), "2");
    api.k(&["scale", "pool/p", "--replicas=4", "--dry-run=server"]);
    assert_eq!(replicas(), "2", "a dry-run scale scaled");
    let e = api.k_err(&["scale", "pool/p", "--current-replicas=5", "--replicas=3"]);
    assert!(e.contains("5"), "{e}");
    assert_eq!(replicas(), "2");
    let s = call(&api, "GET", "/apis/boxery.dev/v1alpha1/pools/p/scale", None);
    assert_eq!(
        (s["kind"].as_str(), s["spec"]["replicas"].as_u64()),
        (Some("Scale"), Some(2)),
        "{s}"
    );
    assert_eq!(s["status"]["selector"], "boxery.dev/pool=p");
    let f = api.home.write("v.yaml", &vm("v1", 1));
    api.k(&["apply", "-f", f.to_str().unwrap()]);
    let s = call(&api, "GET", "/apis/boxery.dev/v1alpha1/vms/v1/scale", None);
    assert_eq!(s["code"], 404, "{s}");
    assert!(
        s["message"]
            .as_str()
            .unwrap()
            .contains("no subresource `scale`"),
        "{s}"
    );
    // a List got with -o yaml applies again, once the pool has settled (kubectl's patch of
    // what it got carries its resourceVersion: a status the controllers write meanwhile is a
    // 409, as in Kubernetes)
    api.k(&[
        "wait",
        "--for=jsonpath={.status.conditions[?(@.type==\"Progressing\")].reason}=Settled",
        "pool/p",
        "--timeout=60s",
    ]);
    let o = Command::new("sh")
        .args(["-c", "kubectl get vms,pools -o yaml | kubectl apply -f -"])
        .env("KUBECONFIG", &api.kubeconfig)
        .env("HOME", api.home.path())
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("vm.boxery.dev/v1") && out.contains("pool.boxery.dev/p"),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A snippet run by the official Python client against the API, `api` a `CustomObjectsApi`
/// and `G, V` boxery's group and version; its stdout (a failure shows its stderr).
fn py(api: &Api, snippet: &str) -> String {
    let python = python_with("kubernetes");
    let script = format!(
        "import sys\nfrom kubernetes import client, config\nconfig.load_kube_config(sys.argv[1])\napi = client.CustomObjectsApi()\nG, V = 'boxery.dev', 'v1alpha1'\n{snippet}"
    );
    let o = Command::new(&python)
        .arg("-c")
        .arg(&script)
        .arg(&api.kubeconfig)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// `metadata.managedFields` are served in Kubernetes' shape: kubectl shows them when asked
/// (`--show-managed-fields`) and hides them otherwise; the Python client reads them.
#[test]
fn managed_fields_are_served() {
    let api = Api::start();
    let f = api.home.write("m1.yaml", &vm("m1", 1));
    api.k(&["apply", "--server-side", "-f", f.to_str().unwrap()]);
    api.k(&["label", "vm", "m1", "env=x"]);
    let y = api.k(&["get", "vm", "m1", "-o", "yaml", "--show-managed-fields"]);
    for want in [
        "managedFields:",
        "manager: kubectl",
        "operation: Apply",
        "operation: Update",
        "fieldsType: FieldsV1",
        "f:spec:",
        "f:cpus: {}",
        "f:env: {}",
        "apiVersion: boxery.dev/v1alpha1",
        "time: \"20",
    ] {
        assert!(y.contains(want), "no {want:?} in:\n{y}");
    }
    let plain = api.k(&["get", "vm", "m1", "-o", "yaml"]);
    assert!(!plain.contains("managedFields"), "{plain}");
    let out = py(
        &api,
        "o = api.get_cluster_custom_object(G, V, 'vms', 'm1')\nfor e in o['metadata']['managedFields']:\n    print(e['manager'], e['operation'], e['fieldsType'], sorted(e['fieldsV1']))",
    );
    assert!(
        out.contains("kubectl Apply FieldsV1 ['f:metadata', 'f:spec']")
            && out.contains("Update FieldsV1 ['f:metadata']"),
        "{out}"
    );
}

/// List paging: `limit` and `continue` (kubectl --chunk-size, the Python client's `limit` and
/// `_continue`): each page carries the first page's resourceVersion; a token of a compacted
/// revision is 410 Expired, one that is not ours a 400.
#[test]
fn lists_are_paged_with_limit_and_continue() {
    let api = Api::start();
    for i in 0..5 {
        let f = api.home.write("v.yaml", &vm(&format!("pg{i}"), 1));
        api.home.ok(&["apply", "-f", f.to_str().unwrap()]);
    }
    // kubectl pages (its requests carry limit=2 and continue) and prints every VM once
    let o = api.kubectl(&["get", "vms", "-o", "name", "--chunk-size=2", "-v=6"]);
    assert!(o.status.success());
    let names = String::from_utf8_lossy(&o.stdout);
    let log = String::from_utf8_lossy(&o.stderr);
    assert_eq!(names.lines().count(), 5, "{names}");
    assert!(
        log.matches("limit=2").count() >= 3 && log.matches("continue=").count() >= 2,
        "{log}"
    );
    let table = api.k(&["get", "vms", "--chunk-size=2"]);
    assert_eq!(
        table.lines().filter(|l| l.starts_with("pg")).count(),
        5,
        "{table}"
    );
    // raw: pages of 2, 2, 1 at one resourceVersion
    let base = "/apis/boxery.dev/v1alpha1/vms?limit=2";
    let p1 = call(&api, "GET", base, None);
    let rv = p1["metadata"]["resourceVersion"].clone();
    assert_eq!(p1["items"].as_array().unwrap().len(), 2, "{p1}");
    assert_eq!(p1["metadata"]["remainingItemCount"], 3, "{p1}");
    let token = p1["metadata"]["continue"].as_str().unwrap().to_string();
    // changes while the client pages: the later pages are still the list at the first's
    // revision (one snapshot, read back from the store's history)
    let f = api.home.write("v.yaml", &vm("pg9", 1));
    api.home.ok(&["apply", "-f", f.to_str().unwrap()]);
    api.k(&["label", "vm", "pg2", "late=yes"]);
    let names = |page: &serde_json::Value| -> Vec<String> {
        page["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    };
    let p2 = call(&api, "GET", &format!("{base}&continue={token}"), None);
    assert_eq!(p2["metadata"]["resourceVersion"], rv, "{p2}");
    assert_eq!(names(&p2), ["pg2", "pg3"], "{p2}");
    assert!(
        p2["items"][0]["metadata"]["labels"]["late"].is_null(),
        "{p2}"
    );
    let t2 = p2["metadata"]["continue"].as_str().unwrap();
    let p3 = call(&api, "GET", &format!("{base}&continue={t2}"), None);
    assert_eq!(names(&p3), ["pg4"], "{p3}");
    assert!(p3["metadata"]["continue"].is_null(), "{p3}");
    // the Python client pages too
    let out = py(
        &api,
        "names, cont = [], None\nwhile True:\n    r = api.list_cluster_custom_object(G, V, 'vms', limit=2, _continue=cont)\n    names += [o['metadata']['name'] for o in r['items']]\n    cont = r['metadata'].get('continue')\n    if not cont: break\nprint(' '.join(names))",
    );
    assert_eq!(out.trim(), "pg0 pg1 pg2 pg3 pg4 pg9");
    // not ours: 400; a resourceVersion beside it: 400
    let bad = call(&api, "GET", &format!("{base}&continue=bm90LW91cnM"), None);
    assert_eq!(bad["code"], 400, "{bad}");
    let both = call(
        &api,
        "GET",
        &format!("{base}&continue={token}&resourceVersion=1"),
        None,
    );
    assert_eq!(both["code"], 400, "{both}");
    // compacted: 410 Expired, as Kubernetes answers
    let store = api.home.store();
    store.compact(0).unwrap();
    assert!(store.compacted().unwrap() > rv.as_str().unwrap().parse::<u64>().unwrap());
    let gone = call(&api, "GET", &format!("{base}&continue={token}"), None);
    assert_eq!(
        (gone["code"].clone(), gone["reason"].clone()),
        (410.into(), "Expired".into()),
        "{gone}"
    );
}

/// `kubectl auth can-i` answers from the token's scope, as the requests themselves are
/// answered: a full token may write but not a status, a read token only reads, a lease token
/// reaches its lease and its VM; `--list` lists the same.
#[test]
fn kubectl_auth_can_i_answers_from_the_tokens_scope() {
    let api = Api::start();
    let can = |kc: &Path, args: &[&str]| {
        let mut all = vec!["auth", "can-i"];
        all.extend_from_slice(args);
        let o = api.kubectl_with(kc, &all, &[]);
        let out = String::from_utf8_lossy(&o.stdout).trim().to_string();
        assert_eq!(
            o.status.success(),
            out == "yes",
            "{args:?}: {out} {}",
            String::from_utf8_lossy(&o.stderr)
        );
        out
    };
    let full = api.kubeconfig.clone();
    assert_eq!(can(&full, &["create", "vms"]), "yes");
    assert_eq!(can(&full, &["delete", "pools/p"]), "yes");
    assert_eq!(
        can(&full, &["patch", "pools/p", "--subresource=scale"]),
        "yes"
    );
    let no = can(&full, &["update", "vms/x", "--subresource=status"]);
    assert!(no.starts_with("no") && no.contains("controllers"), "{no}");
    assert!(can(&full, &["create", "events.boxery.dev"]).starts_with("no"));
    assert!(can(&full, &["get", "pods"]).starts_with("no"));
    assert_eq!(can(&full, &["list", "events"]), "yes");
    let ro = api
        .home
        .ok(&["kubeconfig", "--scope", "read", "--name", "ro"]);
    let ro = api.home.write("ro.yaml", &ro);
    assert_eq!(can(&ro, &["get", "vms"]), "yes");
    assert_eq!(can(&ro, &["watch", "leases"]), "yes");
    let no = can(&ro, &["create", "vms"]);
    assert!(no.starts_with("no") && no.contains("scope read"), "{no}");
    assert!(can(&ro, &["delete", "vms/x"]).starts_with("no"));
    // a lease token: its lease and VM
    let pool = api.home.write(
        "pool.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: p}\nspec:\n  replicas: 2\n  template:\n    spec:\n      source: {image: tiny}\n",
    );
    api.home.ok(&["apply", "-f", pool.to_str().unwrap()]);
    api.home
        .ok(&["lease", "acquire", "p", "--name", "mine", "--wait"]);
    let held = eventually(Duration::from_secs(60), || {
        let l: boxery_api::Lease = api.home.store().get_as("mine").ok()??;
        l.status.vm.clone()
    })
    .expect("lease mine holds a VM");
    let kc = api
        .home
        .ok(&["kubeconfig", "--scope", "lease:mine", "--name", "agent"]);
    let kc = api.home.write("agent.yaml", &kc);
    assert_eq!(can(&kc, &["get", &format!("vm/{held}")]), "yes");
    assert_eq!(can(&kc, &["patch", &format!("vm/{held}")]), "yes");
    assert_eq!(can(&kc, &["list", "vms"]), "yes");
    assert_eq!(can(&kc, &["delete", "lease/mine"]), "yes");
    assert!(can(&kc, &["delete", &format!("vm/{held}")]).starts_with("no"));
    assert!(can(&kc, &["get", "vm/someone-else"]).starts_with("no"));
    assert!(can(&kc, &["create", "vms"]).starts_with("no"));
    assert!(can(&kc, &["get", "pools/p"]).starts_with("no"));
    // --list: the same answers as rules
    let list = api.k(&["auth", "can-i", "--list"]);
    let rule = |list: &str, res: &str| {
        list.lines()
            .find(|l| l.split_whitespace().next() == Some(res))
            .map(|l| l.split_once('[').map_or("", |(_, r)| r).to_string())
    };
    assert!(
        rule(&list, "vms.boxery.dev").is_some_and(
            |r| r.ends_with("[get list watch create update patch delete deletecollection]")
        ),
        "{list}"
    );
    assert!(
        rule(&list, "vms.boxery.dev/status").is_some_and(|r| r.ends_with("[get]")),
        "{list}"
    );
    let o = api.kubectl_with(&kc, &["auth", "can-i", "--list"], &[]);
    let list = String::from_utf8_lossy(&o.stdout);
    assert!(
        list.lines().any(|l| l.starts_with("vms.boxery.dev")
            && l.contains(&format!("[{held}]"))
            && l.contains("patch")),
        "{list}"
    );
    assert!(
        !list.lines().any(|l| l.contains("pools.boxery.dev")),
        "{list}"
    );
    // the Python client asks the same
    let out = py(
        &api,
        "a = client.AuthorizationV1Api()\nfor verb in ['create', 'escalate']:\n    r = a.create_self_subject_access_review(client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=client.V1ResourceAttributes(group=G, resource='vms', verb=verb))))\n    print(verb, r.status.allowed)",
    );
    assert_eq!(out.trim(), "create True\nescalate False");
}

/// `metadata.generateName`: a create without a name gets the prefix and 5 random characters,
/// as Kubernetes names it (kubectl create -f, the Python client).
#[test]
fn generate_name_names_a_created_object() {
    let api = Api::start();
    let f = api.home.write(
        "g.yaml",
        &vm("x", 1).replace("  name: x\n", "  generateName: gen-\n"),
    );
    let mut names = Vec::new();
    for _ in 0..2 {
        let out = api.k(&["create", "-f", f.to_str().unwrap(), "-o", "name"]);
        let name = out.trim().trim_start_matches("vm.boxery.dev/").to_string();
        assert!(
            name.len() == 9
                && name.starts_with("gen-")
                && name[4..]
                    .chars()
                    .all(|c| "bcdfghjklmnpqrstvwxz2456789".contains(c)),
            "{out}"
        );
        names.push(name);
    }
    assert_ne!(names[0], names[1]);
    assert_eq!(
        api.k(&[
            "get",
            "vm",
            &names[0],
            "-o",
            "jsonpath={.spec.resources.cpus}"
        ]),
        "1"
    );
    // a prefix that cannot make a valid name is a 422 naming the field
    let bad = api.home.write(
        "b.yaml",
        &vm("x", 1).replace("  name: x\n", "  generateName: Bad_\n"),
    );
    let e = api.k_err(&["create", "-f", bad.to_str().unwrap()]);
    assert!(e.contains("metadata.generateName"), "{e}");
    let out = py(
        &api,
        "o = api.create_cluster_custom_object(G, V, 'vms', {'apiVersion': G + '/' + V, 'kind': 'Vm', 'metadata': {'generateName': 'py-'}, 'spec': {'resources': {'cpus': 1, 'memory': '512Mi', 'disk': '1Gi'}, 'source': {'image': 'tiny'}}})\nprint(o['metadata']['name'])",
    );
    assert!(
        out.trim().starts_with("py-") && out.trim().len() == 8,
        "{out}"
    );
}

/// `kubectl explain` walks every field, the variants of an enum (`vm.spec.source.image`) and
/// lists an enum's values: the OpenAPI schemas served are structural.
#[test]
fn kubectl_explain_walks_variants_and_enums() {
    let api = Api::start();
    let source = api.k(&["explain", "vm.spec.source"]);
    assert!(
        source.contains("image") && source.contains("Exactly one of"),
        "{source}"
    );
    let image = api.k(&["explain", "vm.spec.source.image"]);
    assert!(image.contains("FIELD: image"), "{image}");
    let strategy = api.k(&["explain", "vm.spec.runStrategy"]);
    assert!(
        strategy.contains("ENUM") && strategy.contains("Stopped"),
        "{strategy}"
    );
    let all = api.k(&["explain", "vm", "--recursive"]);
    assert!(all.contains("image"), "{all}");
}

/// A server-side apply (forced or not) or an update that would add a finalizer or an owner
/// reference, which are boxery's controllers', is refused naming the field, and the object is
/// unchanged: never `serverside-applied` while the addition is dropped.
#[test]
fn an_apply_of_a_refused_field_says_so() {
    let api = Api::start();
    let plain = vm("s1", 1);
    let f = api.home.write("s1.yaml", &plain);
    api.k(&["apply", "--server-side", "-f", f.to_str().unwrap()]);
    let rv = || {
        api.k(&[
            "get",
            "vm",
            "s1",
            "-o",
            "jsonpath={.metadata.resourceVersion}",
        ])
    };
    let before = rv();
    for (meta, field) in [
        ("  finalizers: [boxery.dev/pool]\n", "metadata.finalizers"),
        (
            "  ownerReferences: [{apiVersion: boxery.dev/v1alpha1, kind: Pool, name: p, uid: abc}]\n",
            "metadata.ownerReferences",
        ),
    ] {
        let m = api.home.write(
            "s1m.yaml",
            &plain.replace("  name: s1\n", &format!("  name: s1\n{meta}")),
        );
        let m = m.to_str().unwrap();
        let e = api.k_err(&["apply", "--server-side", "--force-conflicts", "-f", m]);
        assert!(
            e.contains(field) && e.contains("nothing was changed"),
            "{e}"
        );
        let e = api.k_err(&["replace", "-f", m]);
        assert!(e.contains(field), "{e}");
        assert_eq!(rv(), before, "the object changed");
    }
    // leaving them out, or naming the ones it has, is no change to them
    let same = api.home.write(
        "s1s.yaml",
        &vm("s1", 2).replace(
            "  name: s1\n",
            "  name: s1\n  finalizers: [boxery.dev/vm]\n",
        ),
    );
    api.k(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        same.to_str().unwrap(),
    ]);
    assert_eq!(
        api.k(&[
            "get",
            "vm",
            "s1",
            "-o",
            "jsonpath={.spec.resources.cpus} {.metadata.finalizers}"
        ]),
        r#"2 ["boxery.dev/vm"]"#
    );
}

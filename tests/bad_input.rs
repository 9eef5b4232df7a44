//! Bad input gets a clear error and changes nothing: each case names the file, the document
//! and the field, exits 2, and leaves every row of the store exactly as it was.

mod common;

use common::{Home, vm_yaml};

/// Every row of every table, in order: equal dumps mean nothing was written.
fn dump(home: &Home) -> String {
    let conn = rusqlite::Connection::open_with_flags(
        home.path().join("store.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let mut tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    tables.retain(|t| !t.starts_with("sqlite_"));
    let mut out = String::new();
    for t in tables {
        let mut stmt = conn.prepare(&format!("SELECT * FROM \"{t}\"")).unwrap();
        let n = stmt.column_count();
        let rows = stmt
            .query_map([], |r| {
                let mut line = Vec::new();
                for i in 0..n {
                    let v: rusqlite::types::Value = r.get(i)?;
                    line.push(format!("{v:?}"));
                }
                Ok(line.join("|"))
            })
            .unwrap();
        out.push_str(&format!("== {t}\n"));
        let mut rows: Vec<String> = rows.map(Result::unwrap).collect();
        rows.sort();
        for r in rows {
            out.push_str(&r);
            out.push('\n');
        }
    }
    let v: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    out.push_str(&format!("user_version {v}\n"));
    out
}

fn case(home: &Home, file: &str, content: &[u8], expect: &[&str]) {
    let path = home.path().join(file);
    std::fs::write(&path, content).unwrap();
    let before = dump(home);
    let out = home.run(&["apply", "-f", path.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{file}: expected exit 2, got {:?}; stderr: {stderr}",
        out.status.code()
    );
    assert!(
        stderr.contains(file),
        "{file}: the error does not name the file: {stderr}"
    );
    for e in expect {
        assert!(
            stderr.contains(e),
            "{file}: the error lacks `{e}`: {stderr}"
        );
    }
    assert!(
        out.stdout.is_empty(),
        "{file}: something was applied: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(before, dump(home), "{file}: the store changed");
}

fn vm_with(spec_extra: &str) -> String {
    format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata:\n  name: bad\nspec:\n  source:\n    image: debian-12\n{spec_extra}"
    )
}

#[test]
fn bad_input_changes_nothing() {
    let home = Home::new();
    // A store with something in it, so "unchanged" means something.
    let good = home.write("good.yaml", &vm_yaml("ok1"));
    home.ok(&["apply", "-f", good.to_str().unwrap()]);
    let good2 = vm_yaml("ok2");

    case(
        &home,
        "malformed.yaml",
        b"apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: [unclosed\n",
        &["invalid YAML"],
    );
    case(
        &home,
        "version.yaml",
        vm_with("").replace("boxery.dev/v1alpha1", "v1").as_bytes(),
        &["document 0", "apiVersion", "unknown apiVersion `v1`"],
    );
    case(
        &home,
        "kind.yaml",
        vm_with("").replace("kind: Vm", "kind: Pod").as_bytes(),
        &["kind", "unknown kind `Pod`"],
    );
    case(
        &home,
        "unknown-field.yaml",
        vm_with("  bogus: 1\n").as_bytes(),
        &["spec", "bogus"],
    );
    case(
        &home,
        "wrong-type.yaml",
        vm_with("  resources:\n    cpus: two\n").as_bytes(),
        &["spec.resources.cpus"],
    );
    for (i, name) in ["../x", "Dev1", &"a".repeat(64), "\"\"", "a_b"]
        .iter()
        .enumerate()
    {
        let y = vm_with("").replace("name: bad", &format!("name: {name}"));
        case(
            &home,
            &format!("name{i}.yaml"),
            y.as_bytes(),
            &["metadata.name"],
        );
    }
    case(
        &home,
        "neg-cpus.yaml",
        vm_with("  resources:\n    cpus: -1\n").as_bytes(),
        &["spec.resources.cpus"],
    );
    case(
        &home,
        "zero-cpus.yaml",
        vm_with("  resources:\n    cpus: 0\n").as_bytes(),
        &["spec.resources.cpus"],
    );
    case(
        &home,
        "many-cpus.yaml",
        vm_with("  resources:\n    cpus: 1000\n").as_bytes(),
        &["spec.resources.cpus"],
    );
    case(
        &home,
        "neg-mem.yaml",
        vm_with("  resources:\n    memory: -1Gi\n").as_bytes(),
        &["spec.resources.memory"],
    );
    case(
        &home,
        "huge-mem.yaml",
        vm_with("  resources:\n    memory: 100Ti\n").as_bytes(),
        &["spec.resources.memory", "out of range"],
    );
    case(
        &home,
        "tiny-disk.yaml",
        vm_with("  resources:\n    disk: 1Mi\n").as_bytes(),
        &["spec.resources.disk"],
    );
    case(
        &home,
        "run.yaml",
        vm_with("  runStrategy: Sometimes\n").as_bytes(),
        &["spec.runStrategy"],
    );
    // A layer nobody knows is refused naming the known ones (issue 33).
    case(
        &home,
        "layers.yaml",
        vm_with("  layers: [gpu]\n").as_bytes(),
        &["spec.layers", "no layer `gpu`", "agents"],
    );
    // A desktop VM below the memory its desktop needs is refused, saying what to set.
    case(
        &home,
        "desktop.yaml",
        vm_with("  headless: false\n  resources: {memory: 512Mi}\n").as_bytes(),
        &["spec.resources.memory", "at least 1024Mi"],
    );
    case(
        &home,
        "build-layers.yaml",
        b"apiVersion: boxery.dev/v1alpha1\nkind: Image\nmetadata:\n  name: mine\nspec:\n  source:\n    build: {base: debian-12, layers: [gpu]}\n",
        &["spec.source.build.layers", "no layer `gpu`", "boxery images layers"],
    );
    case(
        &home,
        "grant.yaml",
        b"apiVersion: boxery.dev/v1alpha1\nkind: Grant\nmetadata:\n  name: g\nspec:\n  vm: dev1\n  type: http\n  target: api.example.com\n  valueFrom: {env: TOKEN}\n",
        &["Grant/g", "spec.header", "names the header"],
    );
    let dup = format!("{}---\n{}", vm_yaml("dup"), vm_yaml("dup"));
    case(
        &home,
        "dup.yaml",
        dup.as_bytes(),
        &["document 1", "dup", "only once"],
    );
    case(&home, "empty.yaml", b"", &["empty"]);
    case(&home, "blank.yaml", b"\n\n---\n", &["no objects"]);
    case(
        &home,
        "garbage.yaml",
        &[0u8, 159, 146, 150, 255, 0, 1, 2],
        &["not a text file"],
    );
    let mut big = vm_with("").into_bytes();
    big.extend(b"  layers:\n");
    while big.len() < 10 << 20 {
        big.extend(b"    - aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n");
    }
    case(&home, "big.yaml", &big, &["too large"]);
    // All or nothing: two good documents and a bad third apply nothing.
    let mixed = format!(
        "{good2}---\n{}---\n{}",
        vm_yaml("ok3"),
        vm_with("  resources:\n    cpus: 0\n")
    );
    case(
        &home,
        "mixed.yaml",
        mixed.as_bytes(),
        &["document 2", "spec.resources.cpus"],
    );
    // A directory with one bad file applies nothing either.
    let dir = home.path().join("dir");
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(dir.join("a.yaml"), vm_yaml("ok4")).unwrap();
    std::fs::write(dir.join("sub/b.yaml"), vm_with("  nope: 1\n")).unwrap();
    let before = dump(&home);
    let out = home.run(&["apply", "-f", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("sub/b.yaml"));
    assert_eq!(before, dump(&home));
    // Same name as an existing object of another kind is fine; the good file still applies.
    home.ok(&["apply", "-f", good.to_str().unwrap()]);
}

#[test]
fn bad_flags_exit_2() {
    let home = Home::new();
    for args in [
        &["get", "pods"][..],
        &["get", "vm", "-o", "xml"],
        &["get", "vm", "-l", "a in b"],
        &["wait", "vm", "x", "--for", "nonsense"],
        &["new", "Bad_Name"],
        &["new", "x", "--memory", "lots"],
        &["explain", "Vm.spec.nope"],
    ] {
        let out = home.run(args);
        assert!(
            matches!(out.status.code(), Some(2) | Some(3)),
            "{args:?}: {:?} {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.stderr.is_empty(), "{args:?} printed no error");
    }
}

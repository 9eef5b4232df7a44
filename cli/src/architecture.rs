//! docs/architecture.md's crate table says what each crate depends on; this test holds it to
//! the Cargo.toml files, and holds the crates to one direction (no loop).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The workspace's crates (short names, `boxery-` dropped) and the boxery crates each one's
/// `[dependencies]` (and target-specific dependencies) name; dev-dependencies are not arrows.
fn from_manifests(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let workspace = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let members = workspace
        .split("members = [")
        .nth(1)
        .and_then(|s| s.split(']').next())
        .expect("the workspace's members");
    let mut crates = BTreeMap::new();
    for dir in members.split(',').map(|m| m.trim().trim_matches('"')) {
        if dir.is_empty() {
            continue;
        }
        let text = std::fs::read_to_string(root.join(dir).join("Cargo.toml")).unwrap();
        let mut name = String::new();
        let mut deps = BTreeSet::new();
        let mut section = String::new();
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                section = line.to_string();
                continue;
            }
            if section == "[package]"
                && let Some(n) = line.strip_prefix("name = ")
            {
                name = n.trim_matches('"').to_string();
            }
            let normal = section == "[dependencies]"
                || (section.starts_with("[target.") && section.ends_with(".dependencies]"));
            if normal && let Some(dep) = line.strip_prefix("boxery-") {
                let dep: String = dep
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                deps.insert(dep);
            }
        }
        let short = name.strip_prefix("boxery-").unwrap_or(&name).to_string();
        crates.insert(short, deps);
    }
    crates
}

/// The crate table of docs/architecture.md: each row's crate and its "depends on" cell, read
/// as the crate names it lists (notes in parentheses dropped). The binary's row says `all`.
fn from_docs(root: &Path, known: &BTreeSet<String>) -> BTreeMap<String, Option<BTreeSet<String>>> {
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let mut rows = BTreeMap::new();
    for line in doc.lines().filter(|l| l.starts_with("| `boxery")) {
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").collect();
        let name = cells[0].trim().trim_matches('`');
        let short = name.strip_prefix("boxery-").unwrap_or(name).to_string();
        let last = cells.last().unwrap().trim();
        if last == "all" {
            rows.insert(short, None);
            continue;
        }
        let mut depth = 0;
        let plain: String = last
            .chars()
            .filter(|c| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => return depth == 0,
                }
                false
            })
            .collect();
        let deps: BTreeSet<String> = plain
            .split(',')
            .map(|d| d.trim().trim_matches('`').to_string())
            .filter(|d| d != "—" && !d.is_empty())
            .collect();
        for d in &deps {
            assert!(
                known.contains(d),
                "docs/architecture.md: {name} depends on `{d}`, which is not a crate"
            );
        }
        rows.insert(short, Some(deps));
    }
    rows
}

#[test]
fn the_crate_table_matches_the_manifests_and_has_no_loop() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let crates = from_manifests(root);
    let known: BTreeSet<String> = crates.keys().cloned().collect();
    let documented = from_docs(root, &known);
    for (name, deps) in &crates {
        let Some(doc) = documented.get(name) else {
            panic!("docs/architecture.md has no row for boxery-{name} (crate table)");
        };
        if let Some(doc) = doc {
            assert_eq!(
                doc, deps,
                "docs/architecture.md's row for {name} says it depends on {doc:?}; its Cargo.toml says {deps:?}"
            );
        }
    }
    for name in documented.keys() {
        assert!(
            crates.contains_key(name),
            "docs/architecture.md has a row for {name}, which is not a workspace member"
        );
    }
    // No loop: a topological order exists.
    let mut left = crates.clone();
    while !left.is_empty() {
        let ready: Vec<String> = left
            .iter()
            .filter(|(_, deps)| deps.iter().all(|d| !left.contains_key(d)))
            .map(|(n, _)| n.clone())
            .collect();
        assert!(
            !ready.is_empty(),
            "the crates depend on each other in a loop: {left:?}"
        );
        for n in ready {
            left.remove(&n);
        }
    }
}

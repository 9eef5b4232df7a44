//! Layers on a Vm (issue 33, docs/images.md): a running `debian-12` VM whose egress is `Deny`
//! gets `agents` added to its `spec.layers` and has the agents' CLIs in place, copied from the
//! layered build on the host (the guest fetches nothing), recorded in its status and its
//! `/etc/boxery/{layers,build-info}`; a second VM asking for `spec.layers: [agents]` is made
//! from that same build; the images' build records are in their status; taking the layer out
//! again is refused, saying what to do.

use std::time::Instant;

use super::{Kind, RealHome};

fn vm_yaml(name: &str, layers: &str) -> String {
    format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {{name: {name}}}\n\
         spec: {{source: {{image: debian-12}}, layers: [{layers}], resources: {{cpus: 1, memory: 1Gi}},\n\
         \x20 network: {{egress: {{policy: Deny}}}}}}\n"
    )
}

/// `boxery patch vm VM` with `spec.layers` = `layers` (a JSON list).
fn set_layers(h: &RealHome, vm: &str, layers: &str) {
    let patch = format!(r#"{{"spec":{{"layers":{layers}}}}}"#);
    h.ok(&["patch", "vm", vm, "--type", "merge", "-p", &patch]);
}

pub(super) fn layers_on_a_vm(kind: Kind) {
    let h = RealHome::new(kind);
    let mut serve = h.serve();
    let f = h.home.write("l1.yaml", &vm_yaml("l1", ""));
    h.apply_file(&f, "30m");
    // (a) the stock image's build record, as the builder wrote it
    let base_layers = h.ok(&[
        "get",
        "image",
        "debian-12",
        "-o",
        "jsonpath={.status.buildInfo.layers}",
    ]);
    assert!(
        base_layers.contains("devtools") && !base_layers.contains("agents"),
        "{base_layers}"
    );
    let wide = h.ok(&["get", "images", "-o", "wide"]);
    assert!(
        wide.contains("LAYERS") && wide.contains("plumbing,devtools"),
        "{wide}"
    );
    assert_eq!(h.run("l1", "command -v claude || echo none"), "none");

    // (c) added while it runs: copied in, no network
    let started = Instant::now();
    set_layers(&h, "l1", r#"["agents"]"#);
    // (b) meanwhile a second VM asks for the same layers from birth
    let f2 = h.home.write("l2.yaml", &vm_yaml("l2", "agents"));
    h.ok(&["apply", "-f", f2.to_str().unwrap()]);
    h.ok(&[
        "wait",
        "vm",
        "l1",
        "--for=condition=LayersApplied",
        "--timeout",
        "40m",
    ]);
    let took = started.elapsed();
    let msg = h.ok(&[
        "get",
        "vm",
        "l1",
        "-o",
        "jsonpath={.status.conditions[?(@.type==\"LayersApplied\")].message}",
    ]);
    eprintln!("layer agents added to running VM l1 in {took:?} (image build included): {msg}");
    let versions = h.run(
        "l1",
        "claude --version; codex --version; node --version; cat /etc/boxery/layers; grep patched_at /etc/boxery/build-info",
    );
    eprintln!("l1 after the layer: {versions}");
    assert!(
        versions.contains("Claude Code")
            && versions.contains("v22.")
            && versions.contains("plumbing devtools agents")
            && versions.contains("patched_at="),
        "{versions}"
    );
    let status = h.ok(&[
        "get",
        "vm",
        "l1",
        "-o",
        "jsonpath={.status.layers} {.status.buildInfo.layers} {.status.buildInfo.patchedAt}",
    ]);
    assert!(
        status.starts_with("[\"agents\"]") || status.starts_with("agents"),
        "{status}"
    );
    // buildInfo.layers names the base's layers too, and patchedAt is a time (the last field)
    let patched = status.split_whitespace().last().unwrap_or("");
    assert!(
        status.contains("devtools")
            && patched.len() >= 20
            && patched.as_bytes()[4] == b'-'
            && patched.as_bytes()[10] == b'T',
        "{status}"
    );
    let img = h.ok(&[
        "get",
        "image",
        "debian-12-agents",
        "-o",
        "jsonpath={.metadata.labels.boxery\\.dev/layers} {.status.buildInfo.layers}",
    ]);
    // the label, then the build record's layers (the base's and agents)
    let (label, recorded) = img.split_once(' ').unwrap_or((&img, ""));
    assert!(
        label == "agents" && recorded.contains("plumbing") && recorded.contains("agents"),
        "{img}"
    );

    // (b) the second VM, made from the same build
    h.ok(&[
        "wait",
        "vm",
        "l2",
        "--for=condition=Ready",
        "--timeout",
        "20m",
    ]);
    let src = h.ok(&["get", "vm", "l2", "-o", "jsonpath={.status.sourceImage}"]);
    assert_eq!(src.trim(), "debian-12-agents");
    assert!(h.run("l2", "claude --version").contains("Claude Code"));

    // taken out again: refused, the layer stays
    set_layers(&h, "l1", r#"[]"#);
    h.ok(&[
        "wait",
        "vm",
        "l1",
        "--for=condition=LayersApplied=False",
        "--timeout",
        "2m",
    ]);
    let refused = h.ok(&[
        "get",
        "vm",
        "l1",
        "-o",
        "jsonpath={.status.conditions[?(@.type==\"LayersApplied\")].reason} {.status.conditions[?(@.type==\"LayersApplied\")].message}",
    ]);
    assert!(
        refused.starts_with("LayerRemovalRefused ")
            && refused.contains("put it back in spec.layers"),
        "{refused}"
    );
    assert!(h.run("l1", "claude --version").contains("Claude Code"));

    h.ok(&["rm", "l1", "l2", "--wait", "--timeout", "5m"]);
    h.ok(&[
        "delete",
        "image",
        "debian-12-agents",
        "--wait",
        "--timeout",
        "2m",
    ]);
    serve.kill();
}

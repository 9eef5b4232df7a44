//! The executor: runs a plan's guest probes in the VM (one ssh session, every probe at once,
//! each within [`PROBE_SECS`]), reads what each found, runs the controls from the host and
//! makes the table's rows.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::Stdio;

use anyhow::{Context, Result, bail};
use boxery_hands::shell_quote;

use super::plan::{Control, Expect, How, Plan, Probe};
use super::standins::host_reaches;
use super::{PROBE_SECS, Row};

/// Run `plan` in VM `vm` (reached by `reach`; its guest reaches the egress and credential
/// proxy at `proxy`): a row per probe, then one per skipped target. `nonce` is what the
/// drill's listeners answer with.
pub(super) fn execute(
    reach: &boxery_hands::Reach,
    vm: &str,
    plan: &Plan,
    proxy: &str,
    nonce: &str,
) -> Result<Vec<Row>> {
    let outputs = run_probes(reach, vm, &plan.probes, proxy)?;
    let got: Vec<Expect> = plan
        .probes
        .iter()
        .enumerate()
        .map(|(i, p)| outcome(outputs.get(&i).map_or("", String::as_str), nonce, &p.how))
        .collect();
    let by_key = |k: &str| {
        plan.probes
            .iter()
            .zip(&got)
            .find(|(p, _)| p.key == k)
            .map(|(p, g)| matches(p.expect, *g) && *g != Expect::Denied && *g != Expect::Blocked)
    };
    let mut rows = Vec::new();
    for (p, g) in plan.probes.iter().zip(&got) {
        let (control, cok) = match &p.control {
            Control::Host(a, ssh) => {
                let ok = host_reaches(*a, *ssh, nonce);
                (
                    format!("host → {a}: {}", if ok { "reached" } else { "NOT reached" }),
                    ok,
                )
            }
            Control::Probe(k) => match by_key(k) {
                Some(true) => (format!("{k}: got through"), true),
                Some(false) => (format!("{k}: did NOT get through"), false),
                None => (format!("{k}: not run"), false),
            },
            Control::None => ("-".into(), true),
        };
        let ok = matches(p.expect, *g) && cok;
        rows.push(Row {
            probe: p.name.clone(),
            expected: p.expect.word().into(),
            result: g.word().into(),
            control,
            ok,
        });
    }
    for (what, why) in &plan.skipped {
        rows.push(Row {
            probe: what.clone(),
            expected: "-".into(),
            result: "skipped".into(),
            control: why.clone(),
            ok: false,
        });
    }
    Ok(rows)
}

/// Every guest probe at once, in one ssh session: each probe's output, by its index.
fn run_probes(
    reach: &boxery_hands::Reach,
    vm: &str,
    probes: &[Probe],
    proxy: &str,
) -> Result<BTreeMap<usize, String>> {
    let script = script(probes, proxy);
    let mut c = reach.std_command();
    c.args(["-T", "--", &format!("{}sh -s", boxery_hands::guest::SOURCE)])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().context("cannot run ssh")?;
    child
        .stdin
        .take()
        .context("no stdin")?
        .write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() && out.stdout.is_empty() {
        bail!(
            "the probes could not run in VM {vm}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut outputs: BTreeMap<usize, String> = BTreeMap::new();
    let mut cur: Option<usize> = None;
    for line in text.lines() {
        if let Some(i) = line.strip_prefix("=== ").and_then(|i| i.parse().ok()) {
            cur = Some(i);
            outputs.insert(i, String::new());
        } else if let Some(i) = cur {
            let o = outputs.entry(i).or_default();
            o.push_str(line);
            o.push('\n');
        }
    }
    Ok(outputs)
}

/// The guest script: every probe at once, each output in its own file, then all of them.
fn script(probes: &[Probe], proxy: &str) -> String {
    let (phost, pport) = split_hostport(proxy);
    let mut s = format!(
        "T={PROBE_SECS}; P={}; PP={}; d=$(mktemp -d); \n\
         tcp() {{ if command -v nc >/dev/null 2>&1; then {{ printf \"$3\"; sleep $T; }} | timeout $T nc -w $T \"$1\" \"$2\" 2>&1 | head -c 600; \
         elif command -v bash >/dev/null 2>&1; then timeout $T bash -c 'exec 3<>/dev/tcp/$0/$1 && printf \"$2\" >&3 && head -c 600 <&3' \"$1\" \"$2\" \"$3\" 2>&1; \
         else echo 'no nc or bash in the guest'; fi; }}\n\
         lookup() {{ if command -v getent >/dev/null 2>&1; then timeout $T getent hosts \"$1\" && echo ANSWERED; \
         else o=$(timeout $T nc -w 1 \"$1\" 9 </dev/null 2>&1); echo \"$o\"; case \"$o\" in *'bad address'*|'') ;; *'('*')'*) echo ANSWERED;; esac; fi; }}\n\
         auth=''; if [ -n \"${{BOXERY_TOKEN:-}}\" ]; then auth=\"Proxy-Authorization: Bearer $BOXERY_TOKEN\\r\\n\"; fi\n",
        shell_quote(phost),
        pport,
    );
    for (i, p) in probes.iter().enumerate() {
        let cmd = match &p.how {
            How::Direct(h, port) => {
                format!("tcp {} {port} 'GET / HTTP/1.0\\r\\n\\r\\n'", shell_quote(h))
            }
            How::Get(h, port) => {
                let hp = hostport(h, *port);
                format!(
                    "tcp \"$P\" \"$PP\" \"GET http://{hp}/ HTTP/1.1\\r\\nHost: {hp}\\r\\n${{auth}}Connection: close\\r\\n\\r\\n\""
                )
            }
            How::Connect(h, port) => {
                let hp = hostport(h, *port);
                format!(
                    "tcp \"$P\" \"$PP\" \"CONNECT {hp} HTTP/1.1\\r\\nHost: {hp}\\r\\n${{auth}}\\r\\nGET / HTTP/1.0\\r\\n\\r\\n\""
                )
            }
            How::Lookup(n) => format!("lookup {}", shell_quote(n)),
            How::Token(with) => {
                let h = if *with {
                    "x-boxery-token: ${BOXERY_TOKEN:-none}\\r\\n"
                } else {
                    ""
                };
                format!(
                    "tcp \"$P\" \"$PP\" \"GET /llm/anthropic/v1/models HTTP/1.1\\r\\nHost: $P\\r\\n{h}Connection: close\\r\\n\\r\\n\""
                )
            }
        };
        s.push_str(&format!("( {cmd} ) > \"$d/{i}\" 2>&1 &\n"));
    }
    s.push_str("wait\n");
    for i in 0..probes.len() {
        s.push_str(&format!(
            "printf '\\n=== {i}\\n'; tr -d '\\r' < \"$d/{i}\"\n"
        ));
    }
    s.push_str("rm -rf \"$d\"\n");
    s
}

fn hostport(h: &str, port: u16) -> String {
    if h.contains(':') {
        format!("[{h}]:{port}")
    } else {
        format!("{h}:{port}")
    }
}

fn split_hostport(url: &str) -> (&str, u16) {
    let hp = url
        .trim_start_matches("http://")
        .rsplit('@')
        .next()
        .unwrap_or_default()
        .trim_end_matches('/');
    match hp.rsplit_once(':') {
        Some((h, p)) => (h, p.parse().unwrap_or(80)),
        None => (hp, 80),
    }
}

/// What a probe's output says.
fn outcome(out: &str, nonce: &str, how: &How) -> Expect {
    let status = out
        .lines()
        .find(|l| l.starts_with("HTTP/1."))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("");
    match how {
        How::Lookup(_) => {
            if out.contains("ANSWERED") {
                Expect::Answer
            } else {
                Expect::NoAnswer
            }
        }
        How::Token(_) => {
            if status == "401" {
                Expect::Unauthorized
            } else if status.is_empty() {
                Expect::Blocked
            } else {
                Expect::Authorized
            }
        }
        _ if out.contains(&format!("boxery-drill-{nonce}")) => Expect::Reached,
        How::Get(..) | How::Connect(..)
            if out.to_ascii_lowercase().contains("x-boxery-egress: denied") =>
        {
            Expect::Denied
        }
        How::Get(..) | How::Connect(..) if !status.is_empty() => Expect::Passed,
        _ => Expect::Blocked,
    }
}

/// Whether `got` satisfies `want`.
fn matches(want: Expect, got: Expect) -> bool {
    match want {
        Expect::Passed => matches!(got, Expect::Passed | Expect::Reached),
        _ => want == got,
    }
}

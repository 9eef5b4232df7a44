//! Files in a VM: `vm_read` (line ranges, refuses binary), `vm_write` (temp file + rename),
//! `vm_edit` (search/replace with an expected count, atomic, refused when the file changed
//! since it was read), and `vm_copy` (streaming tar, local⇄VM and VM⇄VM).
//!
//! A file's version is the sha256 of its bytes, computed in the guest. Writes check the
//! version they expect in the same guest script that renames the temp file into place, so a
//! concurrent change between reading and writing is refused, not overwritten (the window left
//! is the few microseconds between that check and the rename).

use std::sync::Arc;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::exec::helper;
use super::{OUTPUT_CAP, Output, Session, ToolError, ToolResult};
use boxery_api::name::safe;
use boxery_hands::qpath;
use boxery_hands::{Place, Reach, dquoted, shell_quote};

/// The largest file `vm_edit` handles: 8 MiB.
pub const EDIT_CAP: usize = 8 << 20;

const T: Duration = Duration::from_secs(60);

fn check_file(f: &str, shown: &str) -> String {
    let shown = dquoted(shown);
    format!(
        "f={f}; [ -e \"$f\" ] || {{ printf '%s\\n' \"{shown}: no such file\" >&2; exit 3; }}; [ -f \"$f\" ] || {{ printf '%s\\n' \"{shown} is not a regular file (a directory? list it with vm_bash ls)\" >&2; exit 4; }}; "
    )
}

/// A file's version: the sha256 of its bytes, 64 lowercase hex characters.
fn is_version(v: &str) -> bool {
    v.len() == 64 && v.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A version an agent gave (`version`, `--if-version`): 64 hex characters (any case), or
/// `absent` where `absent_ok`. Returns it in lowercase.
fn agent_version(v: &str, absent_ok: bool) -> Result<String, ToolError> {
    let lower = v.trim().to_ascii_lowercase();
    if is_version(&lower) || (absent_ok && lower == "absent") {
        return Ok(lower);
    }
    Err(ToolError::Invalid(format!(
        "`{}` is not a file version: give the 64 hex characters vm_read or vm_write returned{}",
        boxery_api::name::shown(v),
        if absent_ok {
            ", or `absent` (the file must not exist)"
        } else {
            ""
        }
    )))
}

/// A version the guest printed: refused unless it is one (a guest may be compromised).
fn guest_version(vm: &str, out: &str) -> Result<String, ToolError> {
    let v = out.trim();
    if is_version(v) {
        Ok(v.to_string())
    } else {
        Err(ToolError::Failed(format!(
            "VM {vm} answered `{}` where a sha256 was expected",
            boxery_api::name::shown(v)
        )))
    }
}

/// The start of a version, for messages (cut at a character boundary, whatever it holds).
fn short(v: &str) -> String {
    safe(&v.chars().take(16).collect::<String>()).into_owned()
}

/// `vm_read` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadArgs {
    /// The VM (default: the session's VM).
    #[serde(default)]
    pub vm: Option<String>,
    /// The file (absolute, `~/…`, or relative to the home).
    pub path: String,
    /// First line to return, from 1 (default 1).
    #[serde(default)]
    pub offset: Option<u64>,
    /// How many lines (default 2000).
    #[serde(default)]
    pub limit: Option<u64>,
}

/// `vm_read`.
pub async fn read(session: Arc<Session>, a: ReadArgs, ct: CancellationToken) -> ToolResult {
    let vm = session.resolve_vm(a.vm).await?;
    let from = a.offset.unwrap_or(1).max(1);
    let limit = a.limit.unwrap_or(2000).clamp(1, 1_000_000);
    let to = from + limit - 1;
    let script = format!(
        "{}n1=$(head -c 8192 \"$f\" | wc -c); n2=$(head -c 8192 \"$f\" | tr -d '\\000' | wc -c); [ \"$n1\" = \"$n2\" ] || {{ printf '%s\\n' \"{}: binary file ($(wc -c < \"$f\") bytes): not readable as text; fetch it with vm_copy\" >&2; exit 4; }}; sha256sum < \"$f\" | cut -c1-64; wc -l < \"$f\"; sed -n '{from},{to}p' \"$f\"",
        check_file(&qpath(&a.path), &a.path),
        dquoted(&a.path),
    );
    let out = helper(&session, &vm, &script, None, OUTPUT_CAP + 128, T, &ct)
        .await
        .map_err(|e| match e {
            ToolError::Invalid(m) if m.contains("over the") => ToolError::Invalid(format!(
                "{}: lines {from}-{to} are over the 1 MiB cap: ask for fewer lines (limit)",
                safe(&a.path)
            )),
            e => e,
        })?;
    let text = String::from_utf8(out).map_err(|_| {
        ToolError::Invalid(format!(
            "{}: not UTF-8 text (a binary file?); fetch it with vm_copy",
            safe(&a.path)
        ))
    })?;
    let mut parts = text.splitn(3, '\n');
    let version = guest_version(&vm, parts.next().unwrap_or(""))?;
    let total: u64 = parts.next().unwrap_or("0").trim().parse().unwrap_or(0);
    let content = parts.next().unwrap_or("").to_string();
    let n = content.lines().count() as u64;
    session.saw(&vm, &a.path, &version);
    let last = if n == 0 {
        from.saturating_sub(1)
    } else {
        from + n - 1
    };
    let header = format!(
        "{}: lines {from}-{last} of {total} (version {version})",
        safe(&a.path)
    );
    Ok(Output::with_data(
        format!("{header}\n{content}"),
        json!({"vm": vm, "path": a.path, "version": version, "total_lines": total,
               "from": from, "to": last, "content": content}),
    ))
}

/// A guest script that writes stdin to `f` atomically, refusing when the file's version is not
/// `expect` (when given; `absent` means the file must not exist), and prints the new version.
fn write_script(path: &str, shown: &str, expect: Option<&str>) -> String {
    let shown = dquoted(shown);
    let check = match expect {
        None => String::new(),
        Some(v) => format!(
            "cur=$( {{ sha256sum < \"$f\"; }} 2>/dev/null | cut -c1-64); [ -n \"$cur\" ] || cur=absent; if [ \"$cur\" != {} ]; then rm -f \"$t\"; printf '%s\\n' \"{shown} changed since you read it (its version is now $cur): vm_read it again\" >&2; exit 5; fi; ",
            shell_quote(v)
        ),
    };
    format!(
        "f={}; d=$(dirname \"$f\"); mkdir -p \"$d\" || exit 4; t=$(mktemp \"$d/.boxery-write.XXXXXX\") || exit 1; cat > \"$t\" || {{ rm -f \"$t\"; exit 1; }}; {check}if [ -e \"$f\" ]; then chmod \"$(stat -c %a \"$f\")\" \"$t\"; else chmod 644 \"$t\"; fi; mv -f \"$t\" \"$f\" || {{ rm -f \"$t\"; exit 1; }}; sha256sum < \"$f\" | cut -c1-64",
        qpath(path)
    )
}

/// `vm_write` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteArgs {
    /// The VM (default: the session's VM).
    #[serde(default)]
    pub vm: Option<String>,
    /// The file (absolute, `~/…`, or relative to the home). Parent directories are made.
    pub path: String,
    /// The whole new content.
    pub content: String,
    /// Only write if the file is still at this version (the 64 hex characters vm_read returned), or `absent` (the file must not exist).
    #[serde(default)]
    pub version: Option<String>,
}

/// `vm_write`.
pub async fn write(session: Arc<Session>, a: WriteArgs, ct: CancellationToken) -> ToolResult {
    let vm = session.resolve_vm(a.vm).await?;
    let expect = a
        .version
        .as_deref()
        .map(|v| agent_version(v, true))
        .transpose()?;
    let script = write_script(&a.path, &a.path, expect.as_deref());
    let bytes = a.content.len();
    let out = helper(
        &session,
        &vm,
        &script,
        Some(a.content.into_bytes()),
        4096,
        T,
        &ct,
    )
    .await?;
    let version = guest_version(&vm, &String::from_utf8_lossy(&out))?;
    session.saw(&vm, &a.path, &version);
    Ok(Output::with_data(
        format!(
            "wrote {bytes} bytes to {} (version {version})",
            safe(&a.path)
        ),
        json!({"vm": vm, "path": a.path, "bytes": bytes, "version": version}),
    ))
}

/// `vm_edit` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EditArgs {
    /// The VM (default: the session's VM).
    #[serde(default)]
    pub vm: Option<String>,
    /// The file.
    pub path: String,
    /// The exact text to replace (whitespace and newlines included).
    pub old: String,
    /// What to put instead.
    pub new: String,
    /// How many times `old` must occur (default 1); all of them are replaced.
    #[serde(default)]
    pub count: Option<usize>,
    /// The version the edit is based on, 64 hex characters (default: the one this session last read or wrote).
    #[serde(default)]
    pub version: Option<String>,
}

fn line_of(text: &str, byte: usize) -> usize {
    text[..byte].matches('\n').count() + 1
}

/// `vm_edit`.
pub async fn edit(session: Arc<Session>, a: EditArgs, ct: CancellationToken) -> ToolResult {
    let vm = session.resolve_vm(a.vm).await?;
    if a.old.is_empty() {
        return Err(ToolError::Invalid(
            "`old` is empty: give the exact text to replace (use vm_write for a whole file)".into(),
        ));
    }
    let want = a.count.unwrap_or(1);
    let given = a
        .version
        .as_deref()
        .map(|v| agent_version(v, false))
        .transpose()?;
    let script = format!(
        "{}sha256sum < \"$f\" | cut -c1-64; cat \"$f\"",
        check_file(&qpath(&a.path), &a.path)
    );
    let out = helper(&session, &vm, &script, None, EDIT_CAP + 128, T, &ct).await?;
    let (version, body) = match out.iter().position(|b| *b == b'\n') {
        Some(i) => (
            guest_version(&vm, &String::from_utf8_lossy(&out[..i]))?,
            out[i + 1..].to_vec(),
        ),
        None => {
            return Err(ToolError::Failed(format!(
                "reading {} failed",
                safe(&a.path)
            )));
        }
    };
    let expected = given.or_else(|| session.seen(&vm, &a.path));
    if let Some(exp) = &expected
        && *exp != version
    {
        return Err(ToolError::Conflict(format!(
            "{} changed since you read it (version {} now, you had {}): vm_read it again and redo the edit",
            safe(&a.path),
            short(&version),
            short(exp)
        )));
    }
    let text = String::from_utf8(body).map_err(|_| {
        ToolError::Invalid(format!(
            "{} is not UTF-8 text (a binary file?): vm_edit edits text",
            safe(&a.path)
        ))
    })?;
    let found: Vec<usize> = text.match_indices(&a.old).map(|(i, _)| i).collect();
    if found.is_empty() {
        let hint = a
            .old
            .lines()
            .find(|l| !l.trim().is_empty())
            .and_then(|l| text.find(l.trim()).map(|i| line_of(&text, i)))
            .map(|l| format!("; its first line appears near line {l}: check whitespace and the lines around it"))
            .unwrap_or_default();
        return Err(ToolError::NotFound(format!(
            "the search text does not occur in {}{hint}; vm_read the file and copy the text exactly",
            safe(&a.path)
        )));
    }
    if found.len() != want {
        let lines: Vec<String> = found
            .iter()
            .take(20)
            .map(|i| line_of(&text, *i).to_string())
            .collect();
        return Err(ToolError::Conflict(format!(
            "the search text occurs {} times in {} (at lines {}), not {want}: add surrounding lines to make it unique, or set count to {}",
            found.len(),
            safe(&a.path),
            lines.join(", "),
            found.len()
        )));
    }
    let first_line = line_of(&text, found[0]);
    let new_text = text.replace(&a.old, &a.new);
    let script = write_script(&a.path, &a.path, Some(&version));
    let out = helper(
        &session,
        &vm,
        &script,
        Some(new_text.into_bytes()),
        4096,
        T,
        &ct,
    )
    .await?;
    let new_version = guest_version(&vm, &String::from_utf8_lossy(&out))?;
    session.saw(&vm, &a.path, &new_version);
    Ok(Output::with_data(
        format!(
            "replaced {want} occurrence{} in {} (first at line {first_line}); version {new_version}",
            if want == 1 { "" } else { "s" },
            safe(&a.path),
        ),
        json!({"vm": vm, "path": a.path, "replaced": want, "line": first_line, "version": new_version}),
    ))
}

/// `vm_copy` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CopyArgs {
    /// Source: VM:PATH, or local:PATH (a path on the machine running boxery).
    pub src: String,
    /// Destination: VM:PATH, or local:PATH.
    pub dst: String,
}

/// `vm_copy` (and `boxery cp` between two VMs).
pub async fn copy(session: Arc<Session>, a: CopyArgs, _ct: CancellationToken) -> ToolResult {
    let src = Place::parse(&a.src);
    let dst = Place::parse(&a.dst);
    let mut reach = Vec::new();
    for p in [&src, &dst] {
        match p {
            Place::Local(_) if !session.allow_local => {
                return Err(ToolError::Invalid(
                    "local paths are refused over HTTP (they would be the server's files): copy between VMs, or run `boxery mcp` (stdio) on your machine".into(),
                ));
            }
            Place::Vm(vm, _) => reach.push(session.ssh_to(vm).await?),
            Place::Local(_) => {}
        }
    }
    let (s2, d2) = (a.src.clone(), a.dst.clone());
    let res = tokio::task::spawn_blocking(move || match (&src, &dst) {
        (Place::Vm(sv, sp), Place::Vm(dv, dp)) => vm_to_vm(&reach[0], &reach[1], sv, sp, dv, dp),
        _ => {
            // one side is a VM: its way was found above
            let mut ways = reach.into_iter();
            boxery_hands::cp(
                |_| {
                    ways.next().ok_or_else(|| {
                        boxery_hands::HandsError::Invalid("name a VM on one side".into())
                    })
                },
                &s2,
                &d2,
            )
            .map(|_| ())
            .map_err(ToolError::from)
        }
    })
    .await
    .map_err(|e| ToolError::Failed(format!("the copy task failed: {e}")))?;
    res?;
    Ok(Output::with_data(
        format!("copied {} to {}", safe(&a.src), safe(&a.dst)),
        json!({"src": a.src, "dst": a.dst}),
    ))
}

/// Read at most 64 KiB of a child's stderr, in a thread (so a chatty child never blocks).
fn stderr_of(e: Option<std::process::ChildStderr>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        use std::io::Read;
        let mut buf = Vec::new();
        if let Some(e) = e {
            let _ = e.take(64 << 10).read_to_end(&mut buf);
        }
        safe(String::from_utf8_lossy(&buf).trim()).into_owned()
    })
}

/// Stream a copy from one VM into another, through this host and never to disk. The source
/// guest is not trusted by the destination: its archive is checked and re-written here
/// ([`boxery_hands::filter`]: one top, no path out, no special files, no link out), and the
/// destination lands it with the rules of `boxery cp` (a fresh directory beside it, a
/// directory never merged into an existing one, nothing unless the whole archive passed).
fn vm_to_vm(
    from: &Reach,
    to: &Reach,
    sv: &str,
    sp: &str,
    dv: &str,
    dp: &str,
) -> Result<(), ToolError> {
    use std::process::Stdio;
    let (src_script, top) = boxery_hands::send_script(sp);
    let dst_script = boxery_hands::receive_script(dp, &top, &format!("{dv}:{dp}"));
    let (src_shown, dst_shown) = (format!("{sv}:{}", safe(sp)), format!("{dv}:{}", safe(dp)));
    let mut a = from
        .std_command()
        .args(["-T", "-o", "BatchMode=yes", "--", &src_script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| ToolError::Failed(format!("cannot run ssh: {e}")))?;
    let mut b = match to
        .std_command()
        .args(["-T", "-o", "BatchMode=yes", "--", &dst_script])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(b) => b,
        Err(e) => {
            let _ = a.kill();
            let _ = a.wait();
            return Err(ToolError::Failed(format!("cannot run ssh: {e}")));
        }
    };
    let (a_err, b_err) = (stderr_of(a.stderr.take()), stderr_of(b.stderr.take()));
    let mut a_out = a.stdout.take().expect("piped");
    let b_in = b.stdin.take().expect("piped");
    let filtered = boxery_hands::filter(&mut a_out, top, b_in);
    if filtered.is_err() || !boxery_hands::drain(&mut a_out) {
        let _ = a.kill();
    }
    drop(a_out);
    let a_status = a
        .wait()
        .map_err(|e| ToolError::Failed(format!("waiting for ssh failed: {e}")))?;
    let b_status = b
        .wait()
        .map_err(|e| ToolError::Failed(format!("waiting for ssh failed: {e}")))?;
    let (a_msg, b_msg) = (
        a_err.join().unwrap_or_default(),
        b_err.join().unwrap_or_default(),
    );
    if a_status.code() == Some(3) {
        return Err(ToolError::NotFound(format!(
            "{src_shown}: no such file or directory in the VM"
        )));
    }
    // the destination stopped reading: its own message says why
    let dst_gave_up =
        !b_status.success() && matches!(&filtered, Err(boxery_hands::UnpackError::Write { .. }));
    if let Err(e) = filtered
        && !dst_gave_up
    {
        return Err(ToolError::Failed(format!(
            "copying {src_shown}: {}",
            boxery_verbs::error::chain(&e)
        )));
    }
    if !a_status.success() {
        return Err(ToolError::Failed(format!(
            "reading {src_shown} failed: {a_msg}"
        )));
    }
    match b_status.code() {
        Some(0) => Ok(()),
        Some(5) => Err(ToolError::Conflict(b_msg)),
        _ => Err(ToolError::Failed(format!(
            "writing {dst_shown} failed: {b_msg}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str, stdin: &str, home: &std::path::Path) -> std::process::Output {
        use std::io::Write;
        let mut c = std::process::Command::new("sh")
            .env("HOME", home)
            .current_dir(home)
            .args(["-c", script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
        c.wait_with_output().unwrap()
    }

    /// The guest scripts, run by the local sh: atomic write, version check, mode kept.
    #[test]
    fn write_script_checks_the_version() {
        let home = tempfile::tempdir().unwrap();
        let o = sh(
            &write_script("~/d/f.txt", "f", Some("absent")),
            "one\n",
            home.path(),
        );
        assert!(o.status.success(), "{o:?}");
        let v1 = String::from_utf8_lossy(&o.stdout).trim().to_string();
        assert_eq!(v1.len(), 64);
        let o = sh(
            &write_script("d/f.txt", "f", Some("absent")),
            "two\n",
            home.path(),
        );
        assert_eq!(o.status.code(), Some(5), "{o:?}");
        let o = sh(
            &write_script("d/f.txt", "f", Some(&v1)),
            "two\n",
            home.path(),
        );
        assert!(o.status.success(), "{o:?}");
        assert_eq!(
            std::fs::read_to_string(home.path().join("d/f.txt")).unwrap(),
            "two\n"
        );
        let left: Vec<_> = std::fs::read_dir(home.path().join("d")).unwrap().collect();
        assert_eq!(left.len(), 1, "temp files left behind");
    }

    /// Versions an agent gives are 64 hex characters or `absent`; versions a guest prints are
    /// checked too; cutting one for a message never panics, whatever it holds.
    #[test]
    fn versions_are_checked_and_cut_at_characters() {
        let v = "ab".repeat(32);
        assert_eq!(agent_version(&v.to_uppercase(), false).unwrap(), v);
        assert_eq!(agent_version("absent", true).unwrap(), "absent");
        let hostile = format!("a{}", "é".repeat(40));
        for bad in [
            "absent",
            &v[..16],
            "",
            &hostile,
            "\u{1b}[2J",
            &format!("{v}0"),
        ] {
            let e = agent_version(bad, false).unwrap_err();
            assert!(matches!(e, ToolError::Invalid(_)), "{bad:?}");
            assert!(e.to_string().contains("64 hex characters"), "{e}");
            assert!(!e.to_string().contains('\u{1b}'), "{e}");
        }
        assert!(agent_version(&v[..16], true).is_err());
        assert_eq!(guest_version("vm1", &format!(" {v}\n")).unwrap(), v);
        let e = guest_version("vm1", &hostile).unwrap_err();
        assert!(matches!(e, ToolError::Failed(_)), "{e}");
        assert_eq!(short(&hostile), format!("a{}", "é".repeat(15)));
        assert_eq!(short("\u{1b}]52;"), "\\u{1b}]52;");
    }

    /// The guest scripts print messages with `printf '%s'`: a path made of shell syntax,
    /// backslash escapes and control characters is printed as escaped text, on one line, and
    /// never run.
    #[test]
    fn messages_in_guest_scripts_are_inert() {
        let home = tempfile::tempdir().unwrap();
        for path in [
            "$(touch pwned)",
            "a\\0033[2Jb\\c",
            "x\u{1b}]52;c;eA==\u{7}\ny",
        ] {
            let o = sh(&check_file(&qpath(path), path), "", home.path());
            assert_eq!(o.status.code(), Some(3), "{o:?}");
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(err.lines().count(), 1, "{err:?}");
            assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "{err:?}");
            assert!(err.ends_with(": no such file\n"), "{err:?}");
            assert!(!home.path().join("pwned").exists());
        }
    }

    #[test]
    fn lines() {
        assert_eq!(line_of("a\nb\nc", 0), 1);
        assert_eq!(line_of("a\nb\nc", 2), 2);
    }
}

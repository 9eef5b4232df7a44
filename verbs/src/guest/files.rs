//! Files in a VM: [`read`] (line ranges, refuses binary), [`write`] (temp file + rename) and
//! [`edit`] (search/replace with an expected count, atomic, refused when the file changed
//! since it was read); `vm_read`, `vm_write`, `vm_edit` and `boxery file …`.
//!
//! A file's version is the sha256 of its bytes, computed in the guest. Writes check the
//! version they expect in the same guest script that renames the temp file into place, so a
//! concurrent change between reading and writing is refused, not overwritten (the window left
//! is the few microseconds between that check and the rename).

use std::time::Duration;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::{OUTPUT_CAP, helper};
use crate::{Result, VerbError, Verbs};
use boxery_api::name::safe;
use boxery_hands::{dquoted, qpath, shell_quote};

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
fn agent_version(v: &str, absent_ok: bool) -> Result<String> {
    let lower = v.trim().to_ascii_lowercase();
    if is_version(&lower) || (absent_ok && lower == "absent") {
        return Ok(lower);
    }
    Err(VerbError::invalid(format!(
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
fn guest_version(vm: &str, out: &str) -> Result<String> {
    let v = out.trim();
    if is_version(v) {
        Ok(v.to_string())
    } else {
        Err(VerbError::failed(format!(
            "VM {vm} answered `{}` where a sha256 was expected",
            boxery_api::name::shown(v)
        )))
    }
}

/// The start of a version, for messages (cut at a character boundary, whatever it holds).
fn short(v: &str) -> String {
    safe(&v.chars().take(16).collect::<String>()).into_owned()
}

/// Read a text file in a VM (`vm_read`, `boxery file read`).
#[derive(Debug, Clone)]
pub struct ReadFile {
    /// The VM.
    pub vm: String,
    /// The file (absolute, `~/…`, or relative to the home).
    pub path: String,
    /// The first line, from 1.
    pub from: u64,
    /// How many lines at most.
    pub limit: u64,
}

/// Lines of a text file in a VM, and its version.
#[derive(Debug, Clone, Serialize)]
pub struct FileText {
    /// The VM.
    pub vm: String,
    /// The file, as given.
    pub path: String,
    /// Its version: the sha256 of its bytes.
    pub version: String,
    /// How many lines it has.
    pub total_lines: u64,
    /// The first line returned.
    pub from: u64,
    /// The last line returned (`from - 1` when none).
    pub to: u64,
    /// The lines.
    pub content: String,
}

impl FileText {
    /// `PATH: lines FROM-TO of TOTAL (version V)`.
    pub fn header(&self) -> String {
        format!(
            "{}: lines {}-{} of {} (version {})",
            safe(&self.path),
            self.from,
            self.to,
            self.total_lines,
            self.version
        )
    }
}

/// The lines `read` asks for: from `from` (at least 1), `limit` of them (1 to 1,000,000),
/// the last one at most `u64::MAX` (the caller chooses both).
fn line_range(from: u64, limit: u64) -> (u64, u64) {
    let from = from.max(1);
    (from, from.saturating_add(limit.clamp(1, 1_000_000) - 1))
}

/// Read lines of a text file in a VM, with its version; a binary file is refused.
pub async fn read(v: &Verbs, a: &ReadFile, ct: &CancellationToken) -> Result<FileText> {
    let doing = v.doing("read", Some(&a.vm), a.path.clone());
    let r = read_unrecorded(v, a, ct).await;
    doing.ended(&r, None);
    r
}

async fn read_unrecorded(v: &Verbs, a: &ReadFile, ct: &CancellationToken) -> Result<FileText> {
    let vm = &a.vm;
    let (from, to) = line_range(a.from, a.limit);
    let script = format!(
        "{}n1=$(head -c 8192 \"$f\" | wc -c); n2=$(head -c 8192 \"$f\" | tr -d '\\000' | wc -c); [ \"$n1\" = \"$n2\" ] || {{ printf '%s\\n' \"{}: binary file ($(wc -c < \"$f\") bytes): not readable as text; fetch it with vm_copy\" >&2; exit 4; }}; sha256sum < \"$f\" | cut -c1-64; wc -l < \"$f\"; sed -n '{from},{to}p' \"$f\"",
        check_file(&qpath(&a.path), &a.path),
        dquoted(&a.path),
    );
    let out = helper(v, vm, &script, None, OUTPUT_CAP + 128, T, ct)
        .await
        .map_err(|e| match e {
            e if e.kind() == crate::ErrorKind::Invalid && e.to_string().contains("over the") => {
                VerbError::invalid(format!(
                    "{}: lines {from}-{to} are over the 1 MiB cap: ask for fewer lines (limit)",
                    safe(&a.path)
                ))
            }
            e => e,
        })?;
    let text = String::from_utf8(out).map_err(|_| {
        VerbError::invalid(format!(
            "{}: not UTF-8 text (a binary file?); fetch it with vm_copy",
            safe(&a.path)
        ))
    })?;
    let mut parts = text.splitn(3, '\n');
    let version = guest_version(vm, parts.next().unwrap_or(""))?;
    let total: u64 = parts.next().unwrap_or("0").trim().parse().unwrap_or(0);
    let content = parts.next().unwrap_or("").to_string();
    let n = content.lines().count() as u64;
    // n is what the guest printed: it may claim more lines than asked for
    let last = match n {
        0 => from - 1,
        n => from.saturating_add(n - 1),
    };
    Ok(FileText {
        vm: vm.clone(),
        path: a.path.clone(),
        version,
        total_lines: total,
        from,
        to: last,
        content,
    })
}

/// Write a whole file in a VM (`vm_write`, `boxery file write`).
#[derive(Debug, Clone)]
pub struct WriteFile {
    /// The VM.
    pub vm: String,
    /// The file (absolute, `~/…`, or relative to the home); parent directories are made.
    pub path: String,
    /// The whole new content.
    pub content: String,
    /// Only if the file is still at this version (64 hex characters), or `absent`.
    pub version: Option<String>,
}

/// A file written or edited.
#[derive(Debug, Clone, Serialize)]
pub struct Written {
    /// The VM.
    pub vm: String,
    /// The file, as given.
    pub path: String,
    /// The bytes written.
    pub bytes: usize,
    /// Its new version.
    pub version: String,
}

impl Written {
    /// `wrote N bytes to PATH (version V)`.
    pub fn summary(&self) -> String {
        format!(
            "wrote {} bytes to {} (version {})",
            self.bytes,
            safe(&self.path),
            self.version
        )
    }
}

/// Write a whole file in a VM atomically (temp file + rename), refused when it is not at the
/// version given.
pub async fn write(v: &Verbs, a: WriteFile, ct: &CancellationToken) -> Result<Written> {
    let doing = v.doing("write", Some(&a.vm), a.path.clone());
    let bytes = a.content.len() as u64;
    let r = write_unrecorded(v, a, ct).await;
    doing.ended(&r, Some(bytes));
    r
}

async fn write_unrecorded(v: &Verbs, a: WriteFile, ct: &CancellationToken) -> Result<Written> {
    let expect = a
        .version
        .as_deref()
        .map(|v| agent_version(v, true))
        .transpose()?;
    let script = write_script(&a.path, &a.path, expect.as_deref());
    let bytes = a.content.len();
    let out = helper(v, &a.vm, &script, Some(a.content.into_bytes()), 4096, T, ct).await?;
    let version = guest_version(&a.vm, &String::from_utf8_lossy(&out))?;
    Ok(Written {
        vm: a.vm,
        path: a.path,
        bytes,
        version,
    })
}

/// Replace text in a file in a VM (`vm_edit`, `boxery file edit`).
#[derive(Debug, Clone)]
pub struct EditFile {
    /// The VM.
    pub vm: String,
    /// The file.
    pub path: String,
    /// The exact text to replace.
    pub old: String,
    /// What to put instead.
    pub new: String,
    /// How many times `old` must occur; all of them are replaced.
    pub count: usize,
    /// The version the edit is based on: the file must still be at it.
    pub base: Option<String>,
}

/// What an edit did.
#[derive(Debug, Clone, Serialize)]
pub struct Edited {
    /// The VM.
    pub vm: String,
    /// The file, as given.
    pub path: String,
    /// How many occurrences were replaced.
    pub replaced: usize,
    /// The line of the first.
    pub line: usize,
    /// Its new version.
    pub version: String,
}

impl Edited {
    /// `replaced N occurrence(s) in PATH (first at line L); version V`.
    pub fn summary(&self) -> String {
        format!(
            "replaced {} occurrence{} in {} (first at line {}); version {}",
            self.replaced,
            if self.replaced == 1 { "" } else { "s" },
            safe(&self.path),
            self.line,
            self.version
        )
    }
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

fn line_of(text: &str, byte: usize) -> usize {
    text[..byte].matches('\n').count() + 1
}

/// Replace text in a file in a VM: `old` must occur exactly `count` times; atomic, and
/// refused when the file is no longer at the `base` version.
pub async fn edit(v: &Verbs, a: EditFile, ct: &CancellationToken) -> Result<Edited> {
    let doing = v.doing("edit", Some(&a.vm), a.path.clone());
    let r = edit_unrecorded(v, a, ct).await;
    doing.ended(&r, None);
    r
}

async fn edit_unrecorded(v: &Verbs, a: EditFile, ct: &CancellationToken) -> Result<Edited> {
    let vm = &a.vm;
    if a.old.is_empty() {
        return Err(VerbError::invalid(
            "`old` is empty: give the exact text to replace (use vm_write for a whole file)",
        ));
    }
    let want = a.count;
    let expected = a
        .base
        .as_deref()
        .map(|v| agent_version(v, false))
        .transpose()?;
    let script = format!(
        "{}sha256sum < \"$f\" | cut -c1-64; cat \"$f\"",
        check_file(&qpath(&a.path), &a.path)
    );
    let out = helper(v, vm, &script, None, EDIT_CAP + 128, T, ct).await?;
    let (version, body) = match out.iter().position(|b| *b == b'\n') {
        Some(i) => (
            guest_version(vm, &String::from_utf8_lossy(&out[..i]))?,
            out[i + 1..].to_vec(),
        ),
        None => {
            return Err(VerbError::failed(format!(
                "reading {} failed",
                safe(&a.path)
            )));
        }
    };
    if let Some(exp) = &expected
        && *exp != version
    {
        return Err(VerbError::conflict(format!(
            "{} changed since you read it (version {} now, you had {}): vm_read it again and redo the edit",
            safe(&a.path),
            short(&version),
            short(exp)
        )));
    }
    let text = String::from_utf8(body).map_err(|_| {
        VerbError::invalid(format!(
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
        return Err(VerbError::not_found(format!(
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
        return Err(VerbError::conflict(format!(
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
    let out = helper(v, vm, &script, Some(new_text.into_bytes()), 4096, T, ct).await?;
    let new_version = guest_version(vm, &String::from_utf8_lossy(&out))?;
    Ok(Edited {
        vm: a.vm.clone(),
        path: a.path.clone(),
        replaced: want,
        line: first_line,
        version: new_version,
    })
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
            assert_eq!(e.kind(), crate::ErrorKind::Invalid, "{bad:?}");
            assert!(e.to_string().contains("64 hex characters"), "{e}");
            assert!(!e.to_string().contains('\u{1b}'), "{e}");
        }
        assert!(agent_version(&v[..16], true).is_err());
        assert_eq!(guest_version("vm1", &format!(" {v}\n")).unwrap(), v);
        let e = guest_version("vm1", &hostile).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Failed, "{e}");
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

    /// An agent's `offset` and `limit` anywhere in u64 make a range, never an overflow.
    #[test]
    fn line_ranges_saturate() {
        assert_eq!(line_range(0, 0), (1, 1));
        assert_eq!(line_range(5, 10), (5, 14));
        assert_eq!(line_range(1, u64::MAX), (1, 1_000_000));
        assert_eq!(line_range(u64::MAX, 2000), (u64::MAX, u64::MAX));
        assert_eq!(line_range(u64::MAX - 1, 2), (u64::MAX - 1, u64::MAX));
    }

    #[test]
    fn lines() {
        assert_eq!(line_of("a\nb\nc", 0), 1);
        assert_eq!(line_of("a\nb\nc", 2), 2);
    }
}

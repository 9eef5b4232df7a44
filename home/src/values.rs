//! Reading a grant's value where its `valueFrom` says: a variable of this process's
//! environment, a file (never one under `$BOXERY_HOME`), or a command's stdout. Used by the
//! credential proxy (per request) and by the guest push (`env` and `file` grants); whether it
//! can be read ([`available`], without reading it) by the Grant reconciler and the approval
//! path. A value is
//! never logged, put in an error, or written anywhere but where it is granted; errors say
//! what could not be read and why, never what was read.

use std::path::Path;
use std::time::Duration;

use boxery_api::grant::ValueFrom;

/// How long a command may run.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest value read.
pub const MAX_VALUE: usize = 64 * 1024;

/// Whether the control plane can read the value `v` names, without reading it: the variable
/// is set (non-empty) in this process's environment, the file can be opened (and is not one of
/// boxery's own files under `home`), the program exists and is executable. `Err` says why
/// not. Never returns or logs the value.
pub fn available(v: &ValueFrom, home: &Path) -> Result<(), String> {
    match v {
        ValueFrom::Env(name) => {
            if std::env::var_os(name).is_some_and(|v| !v.is_empty()) {
                Ok(())
            } else {
                Err(format!("the environment variable {name} is not set here"))
            }
        }
        ValueFrom::File(path) => {
            let p = Path::new(path);
            let real = p
                .canonicalize()
                .map_err(|e| format!("cannot read {path}: {e}"))?;
            if let Ok(h) = home.canonicalize()
                && real.starts_with(&h)
            {
                return Err(format!(
                    "{path} is inside boxery's home ({}): the control plane's own keys and tokens are never granted",
                    h.display()
                ));
            }
            if !real.is_file() {
                return Err(format!("{path} is not a regular file"));
            }
            std::fs::File::open(&real)
                .map(drop)
                .map_err(|e| format!("cannot read {path}: {e}"))
        }
        ValueFrom::Command(argv) => {
            let program = argv.first().map(String::as_str).unwrap_or("");
            let found = if program.contains('/') {
                Some(std::path::PathBuf::from(program))
            } else {
                std::env::var_os("PATH").and_then(|paths| {
                    std::env::split_paths(&paths)
                        .map(|d| d.join(program))
                        .find(|p| executable(p))
                })
            };
            match found {
                Some(p) if executable(&p) => Ok(()),
                _ => Err(format!(
                    "the program {program} is not found or not executable here"
                )),
            }
        }
    }
}

fn executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The bytes `v` names, as read now (a command is run). `Err`: why not (never the value).
pub async fn read(v: &ValueFrom, home: &Path) -> Result<Vec<u8>, String> {
    match v {
        ValueFrom::Env(name) => std::env::var(name)
            .ok()
            .filter(|s| !s.is_empty())
            .map(String::into_bytes)
            .ok_or_else(|| {
                format!("the environment variable {name} is not set in the control plane")
            }),
        ValueFrom::File(path) => {
            available(v, home)?;
            let bytes = tokio::fs::read(path)
                .await
                .map_err(|e| format!("cannot read {path}: {}", e.kind()))?;
            if bytes.len() > MAX_VALUE {
                return Err(format!("{path} is larger than {MAX_VALUE} bytes"));
            }
            Ok(bytes)
        }
        ValueFrom::Command(argv) => {
            let program = argv.first().ok_or("the command is empty")?;
            let mut cmd = tokio::process::Command::new(program);
            cmd.args(&argv[1..])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .kill_on_drop(true);
            let out = tokio::time::timeout(COMMAND_TIMEOUT, cmd.output())
                .await
                .map_err(|_| format!("the command {program} took longer than {COMMAND_TIMEOUT:?}"))?
                .map_err(|e| format!("cannot run {program}: {}", e.kind()))?;
            if !out.status.success() {
                return Err(format!("the command {program} failed ({})", out.status));
            }
            if out.stdout.len() > MAX_VALUE {
                return Err(format!(
                    "the command {program} printed more than {MAX_VALUE} bytes"
                ));
            }
            Ok(out.stdout)
        }
    }
}

/// The value `v` names as one line of text (UTF-8, surrounding whitespace trimmed, not
/// empty): what a header or an environment variable carries.
pub async fn read_text(v: &ValueFrom, home: &Path) -> Result<String, String> {
    let bytes = read(v, home).await?;
    let text = String::from_utf8(bytes).map_err(|_| "the value is not UTF-8 text".to_string())?;
    let text = text.trim();
    if text.is_empty() {
        return Err("the value is empty".into());
    }
    Ok(text.to_string())
}

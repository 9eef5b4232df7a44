//! Reading a grant's value where its `valueFrom` says: a variable of this process's
//! environment, a file (never one under `$BOXERY_HOME`), or a command's stdout. Used by the
//! credential proxy (per request) and by the guest push (`env` and `file` grants). A value is
//! never logged, put in an error, or written anywhere but where it is granted; errors say
//! what could not be read and why, never what was read.

use std::path::Path;
use std::time::Duration;

use boxery_api::grant::ValueFrom;

/// How long a command may run.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest value read.
pub const MAX_VALUE: usize = 64 * 1024;

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
            crate::grant::value_available(v, home)?;
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

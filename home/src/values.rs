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

/// Whether grant `spec` can be used here, without reading its value: [`available`], or for
/// an `ssh-agent` grant, [`agent_socket`].
pub fn available_for(spec: &boxery_api::grant::GrantSpec, home: &Path) -> Result<(), String> {
    match spec.type_ {
        boxery_api::grant::GrantType::SshAgent => agent_socket(&spec.value_from, home).map(drop),
        _ => available(&spec.value_from, home),
    }
}

/// The ssh-agent socket an `ssh-agent` grant names (`{file: PATH}`, or `{env: NAME}`: the
/// path in this process's variable), checked: an absolute path, not under boxery's `home`, a
/// unix socket (not a symlink to one elsewhere: the path is the one approved), owned by this
/// process's user (the control plane never forwards another user's agent). `Err` says why not.
pub fn agent_socket(v: &ValueFrom, home: &Path) -> Result<std::path::PathBuf, String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let path = match v {
        ValueFrom::File(p) => p.clone(),
        ValueFrom::Env(name) => std::env::var(name)
            .ok()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| format!("the environment variable {name} is not set here"))?,
        ValueFrom::Command(_) => {
            return Err("an ssh-agent grant names a socket, not a command".into());
        }
    };
    boxery_api::grant::check_agent_socket(&ValueFrom::File(path.clone()))?;
    let p = Path::new(&path);
    let meta =
        std::fs::symlink_metadata(p).map_err(|e| format!("no agent socket at {path}: {e}"))?;
    if meta.file_type().is_symlink() {
        let to = std::fs::read_link(p)
            .map(|t| t.display().to_string())
            .unwrap_or_default();
        return Err(format!(
            "{path} is a symbolic link (to {to}): name the socket itself, so that the path approved is the one used"
        ));
    }
    if !meta.file_type().is_socket() {
        return Err(format!(
            "{path} is not a socket (an ssh-agent's socket, as $SSH_AUTH_SOCK names it)"
        ));
    }
    if let (Ok(real), Ok(h)) = (p.canonicalize(), home.canonicalize())
        && real.starts_with(&h)
    {
        return Err(format!(
            "{path} is inside boxery's home ({}): boxery's own sockets are never granted",
            h.display()
        ));
    }
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me {
        return Err(format!(
            "{path} belongs to uid {}, not to the control plane's user (uid {me}): only your own agent is forwarded",
            meta.uid()
        ));
    }
    Ok(p.to_path_buf())
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
            let file = tokio::fs::File::open(path)
                .await
                .map_err(|e| format!("cannot read {path}: {}", e.kind()))?;
            let bytes = at_most(file)
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
            let mut child = cmd
                .spawn()
                .map_err(|e| format!("cannot run {program}: {}", e.kind()))?;
            let stdout = child.stdout.take().expect("stdout is piped");
            // Past the largest value, stop reading: the command is killed (dropped), not waited for.
            let run = async {
                let out = at_most(stdout).await?;
                if out.len() > MAX_VALUE {
                    return Ok((out, None));
                }
                Ok::<_, std::io::Error>((out, Some(child.wait().await?)))
            };
            let (out, status) = tokio::time::timeout(COMMAND_TIMEOUT, run)
                .await
                .map_err(|_| format!("the command {program} took longer than {COMMAND_TIMEOUT:?}"))?
                .map_err(|e| format!("cannot run {program}: {}", e.kind()))?;
            let Some(status) = status else {
                return Err(format!(
                    "the command {program} printed more than {MAX_VALUE} bytes"
                ));
            };
            if !status.success() {
                return Err(format!("the command {program} failed ({status})"));
            }
            Ok(out)
        }
    }
}

/// What `r` gives, up to one byte more than [`MAX_VALUE`] (so that a larger value is known
/// to be one without being held whole).
async fn at_most(r: impl tokio::io::AsyncRead + Unpin) -> std::io::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    r.take(MAX_VALUE as u64 + 1).read_to_end(&mut out).await?;
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_socket_is_a_socket_of_ours_outside_the_home() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home");
        std::fs::create_dir(&home).unwrap();
        let sock = dir.path().join("agent.sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let file = |p: &Path| ValueFrom::File(p.display().to_string());
        assert_eq!(agent_socket(&file(&sock), &home).unwrap(), sock);
        // a regular file, a directory, nothing, a symlink to the socket: refused
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"x").unwrap();
        let e = agent_socket(&file(&plain), &home).unwrap_err();
        assert!(e.contains("not a socket"), "{e}");
        let e = agent_socket(&file(dir.path()), &home).unwrap_err();
        assert!(e.contains("not a socket"), "{e}");
        let e = agent_socket(&file(&dir.path().join("none")), &home).unwrap_err();
        assert!(e.contains("no agent socket"), "{e}");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&sock, &link).unwrap();
        let e = agent_socket(&file(&link), &home).unwrap_err();
        assert!(
            e.contains("symbolic link") && e.contains("agent.sock"),
            "{e}"
        );
        // `..` is refused before anything is looked at
        let dotted = format!("{}/home/../agent.sock", dir.path().display());
        let e = agent_socket(&ValueFrom::File(dotted), &home).unwrap_err();
        assert!(e.contains("plain names"), "{e}");
        // a socket in the home (boxery's own)
        let own = home.join("proxy.sock");
        let _o = std::os::unix::net::UnixListener::bind(&own).unwrap();
        let e = agent_socket(&file(&own), &home).unwrap_err();
        assert!(e.contains("inside boxery's home"), "{e}");
        // a command never names an agent; an unset variable says so
        let e = agent_socket(&ValueFrom::Command(vec!["ssh-agent".into()]), &home).unwrap_err();
        assert!(e.contains("not a command"), "{e}");
        let e =
            agent_socket(&ValueFrom::Env("BOXERY_TEST_NO_SUCH_SOCK".into()), &home).unwrap_err();
        assert!(e.contains("not set"), "{e}");
    }

    #[tokio::test]
    async fn a_file_value_is_read_up_to_the_largest() {
        let d = tempfile::tempdir().unwrap();
        let (home, file) = (d.path().join("home"), d.path().join("v"));
        let v = ValueFrom::File(file.display().to_string());
        std::fs::write(&file, vec![b'x'; MAX_VALUE]).unwrap();
        assert_eq!(read(&v, &home).await.unwrap().len(), MAX_VALUE);
        std::fs::write(&file, vec![b'x'; MAX_VALUE + 1]).unwrap();
        let why = read(&v, &home).await.unwrap_err();
        assert!(why.contains("is larger than"), "{why}");
    }

    /// A command that never stops printing is refused as soon as it has printed more than
    /// the largest value, not held in memory until its time is up.
    #[tokio::test]
    async fn a_command_printing_too_much_is_cut_off() {
        let home = tempfile::tempdir().unwrap();
        let v = ValueFrom::Command(vec!["yes".into()]);
        let why = tokio::time::timeout(COMMAND_TIMEOUT / 2, read(&v, home.path()))
            .await
            .expect("refused before its time is up")
            .unwrap_err();
        assert!(why.contains("printed more than"), "{why}");
        let v = ValueFrom::Command(vec!["sh".into(), "-c".into(), "echo hi; exit 3".into()]);
        let why = read(&v, home.path()).await.unwrap_err();
        assert!(why.contains("failed"), "{why}");
        let v = ValueFrom::Command(vec!["echo".into(), "hi".into()]);
        assert_eq!(read(&v, home.path()).await.unwrap(), b"hi\n");
    }
}

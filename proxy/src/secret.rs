//! Resolving a grant's `valueFrom` at request time ([`boxery_home::values`]): a
//! variable of this process's environment, a file (never one under `$BOXERY_HOME`), or a
//! command's stdout (run at most once a minute per command; the result kept in memory only). The value is never logged,
//! put in an error, or written anywhere; errors say which grant and why, not what.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::HeaderValue;
use boxery_api::grant::ValueFrom;
use boxery_home::values::read_text;

/// How long a command's output is reused.
pub const COMMAND_TTL: Duration = Duration::from_secs(60);

/// Resolves values, caching command outputs.
#[derive(Debug)]
pub struct Secrets {
    home: PathBuf,
    commands: Mutex<HashMap<Vec<String>, (Instant, HeaderValue)>>,
}

impl Secrets {
    /// Values for the control plane whose home is `home`.
    pub fn new(home: &Path) -> Self {
        Secrets {
            home: home.to_path_buf(),
            commands: Mutex::default(),
        }
    }

    /// The value `v` names, as a header value marked sensitive. `Err`: why it is not
    /// available (never the value).
    pub async fn resolve(&self, v: &ValueFrom) -> Result<HeaderValue, String> {
        let ValueFrom::Command(argv) = v else {
            return header(&read_text(v, &self.home).await?);
        };
        if let Some((at, v)) = self.commands.lock().expect("not poisoned").get(argv)
            && at.elapsed() < COMMAND_TTL
        {
            return Ok(v.clone());
        }
        let value = header(&read_text(v, &self.home).await?)?;
        self.commands
            .lock()
            .expect("not poisoned")
            .insert(argv.to_vec(), (Instant::now(), value.clone()));
        Ok(value)
    }
}

/// A sensitive header value from `s`; `Err` when it is empty or not a valid header value.
pub fn header(s: &str) -> Result<HeaderValue, String> {
    if s.is_empty() {
        return Err("the value is empty".into());
    }
    let mut v = HeaderValue::from_str(s).map_err(|_| {
        "the value is not a valid HTTP header value (a control character?)".to_string()
    })?;
    v.set_sensitive(true);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn resolves_each_source_and_never_echoes() {
        let home = tempfile::tempdir().unwrap();
        let s = Secrets::new(home.path());
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), "sk-file\n").unwrap();
        let v = s
            .resolve(&ValueFrom::File(f.path().display().to_string()))
            .await
            .unwrap();
        assert_eq!(v.to_str().unwrap(), "sk-file");
        assert!(v.is_sensitive());
        let v = s
            .resolve(&ValueFrom::Command(vec!["echo".into(), "sk-cmd".into()]))
            .await
            .unwrap();
        assert_eq!(v.to_str().unwrap(), "sk-cmd");
        let e = s
            .resolve(&ValueFrom::Env("BOXERY_TEST_SURELY_UNSET_VAR".into()))
            .await
            .unwrap_err();
        assert!(e.contains("BOXERY_TEST_SURELY_UNSET_VAR"));
        let inside = home.path().join("mgmt-key");
        std::fs::write(&inside, "secret-inside").unwrap();
        let e = s
            .resolve(&ValueFrom::File(inside.display().to_string()))
            .await
            .unwrap_err();
        assert!(e.contains("home") && !e.contains("secret-inside"), "{e}");
        std::fs::write(f.path(), "a\r\nb").unwrap();
        let e = s
            .resolve(&ValueFrom::File(f.path().display().to_string()))
            .await
            .unwrap_err();
        assert!(e.contains("not a valid HTTP header value"), "{e}");
    }
}

//! When each VM was last used: `$BOXERY_HOME/activity/<vm>`, an empty file whose modification
//! time is the last command, file or copy action, interactive session tick or proxied request
//! on the VM (docs/live-memory.md, "Auto-suspend"). Written by whoever does the work (the CLI,
//! the MCP server, the API server, the credential proxy: any process of this home), read by
//! the Vm reconciler to decide when an idle VM is suspended and when a suspended one is woken.
//!
//! A mark, not a log: writing it is one `utimes`, cheap enough for every request; a failure to
//! write it only makes the VM look idle sooner, so it is ignored by the writers.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::layout;

/// VM `vm`'s mark; `None` for a string that is not a VM name (callers pass what an agent or
/// a remote caller typed: it must not reach the filesystem as a path).
fn mark(home: &Path, vm: &str) -> Option<PathBuf> {
    boxery_api::Name::label(vm)
        .ok()
        .map(|_| layout::activity_mark(home, vm))
}

/// Mark VM `vm` used now (`InvalidInput` when `vm` is not a VM name).
pub fn touch(home: &Path, vm: &str) -> std::io::Result<()> {
    let Some(path) = mark(home, vm) else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("`{vm}` is not a VM name"),
        ));
    };
    let file = match std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            crate::private::dir(&layout::activity(home))?;
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)?
        }
        Err(e) => return Err(e),
    };
    file.set_modified(SystemTime::now())
}

/// When VM `vm` was last used, if it ever was (in this home).
pub fn last(home: &Path, vm: &str) -> Option<SystemTime> {
    std::fs::metadata(mark(home, vm)?)
        .and_then(|m| m.modified())
        .ok()
}

/// Marks VM `vm` used every 30 seconds while it lives (an interactive session: its keystrokes
/// are uses the control plane does not see); stops when dropped.
#[derive(Debug)]
pub struct Ticker {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ticker {
    /// Start marking `vm` in `home`, now and every 30 seconds.
    pub fn start(home: &Path, vm: &str) -> Ticker {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (home, vm, flag) = (home.to_path_buf(), vm.to_string(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = touch(&home, &vm);
                std::thread::park_timeout(std::time::Duration::from_secs(30));
            }
        });
        Ticker {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Forget VM `vm`'s mark (it was deleted).
pub fn forget(home: &Path, vm: &str) {
    if let Some(path) = mark(home, vm) {
        let _ = std::fs::remove_file(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touch_moves_the_mark_forward_and_forget_removes_it() {
        let home = tempfile::tempdir().unwrap();
        assert_eq!(last(home.path(), "a"), None);
        touch(home.path(), "a").unwrap();
        let first = last(home.path(), "a").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        touch(home.path(), "a").unwrap();
        assert!(last(home.path(), "a").unwrap() > first);
        assert_eq!(last(home.path(), "b"), None, "per VM");
        forget(home.path(), "a");
        assert_eq!(last(home.path(), "a"), None);
    }

    #[test]
    fn a_name_that_is_not_a_vm_name_never_reaches_the_filesystem() {
        let home = tempfile::tempdir().unwrap();
        let outside = home.path().join("outside");
        std::fs::write(&outside, "").unwrap();
        let before = std::fs::metadata(&outside).unwrap().modified().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        for bad in ["../outside", "a/../../outside", "..", "", "A", "/tmp/x"] {
            let e = touch(home.path(), bad).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{bad}");
            assert_eq!(last(home.path(), bad), None, "{bad}");
            forget(home.path(), bad);
        }
        assert_eq!(
            std::fs::metadata(&outside).unwrap().modified().unwrap(),
            before,
            "nothing outside activity/ was touched"
        );
        assert!(outside.exists());
        assert!(!home.path().join("activity").exists());
    }
}

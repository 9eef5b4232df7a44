//! When each VM was last used: `$BOXERY_HOME/activity/<vm>`, an empty file whose modification
//! time is the last command, file or copy action, interactive session tick or proxied request
//! on the VM (docs/live-memory.md, "Auto-suspend"). Written by whoever does the work (the CLI,
//! the MCP server, the API server, the credential proxy: any process of this home), read by
//! the Vm reconciler to decide when an idle VM is suspended and when a suspended one is woken.
//!
//! A mark, not a log: writing it is one `utimes`, cheap enough for every request; a failure to
//! write it only makes the VM look idle sooner, so it is ignored by the writers.

use std::path::Path;
use std::time::SystemTime;

use crate::layout;

/// Mark VM `vm` used now.
pub fn touch(home: &Path, vm: &str) -> std::io::Result<()> {
    let path = layout::activity_mark(home, vm);
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
    std::fs::metadata(layout::activity_mark(home, vm))
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
    let _ = std::fs::remove_file(layout::activity_mark(home, vm));
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
}

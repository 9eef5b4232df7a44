//! A running VM's screen ([`crate::Backend::screendump`], [`crate::Backend::send_input`]):
//! QMP's `screendump` into a file of the VM's own directory, and `input-send-event`
//! ([`crate::screen`] makes the events).
//!
//! # Guarantees
//! - The picture's file is `vms/NAME/.screen-PID-RANDOM.png`, unique per call, and is removed
//!   once read, also when the dump or the read fails; what a killed control plane left is
//!   removed when the VM's QEMU exits ([`Inner::clear_runtime_files`]).
//! - Every QMP exchange is bounded ([`SCREEN_TIMEOUT`]); the VM's lock is not taken (a
//!   screendump changes nothing of the VM, and must not wait for a capture's stream): a
//!   screendump during an operation that holds the QMP socket waits for it, up to the bound.
//!
//! # Caveats
//! - A VM whose QEMU was started before VMs had a screen has none until it is started
//!   again: `Invalid`, saying so.

use super::*;
use crate::screen;
use crate::{InputEvent, Screen};

/// How long a screen's QMP exchange may take (a screendump under TCG takes milliseconds; the
/// rest is waiting for another client of the socket).
const SCREEN_TIMEOUT: Duration = Duration::from_secs(10);

/// A file QEMU dumps a screen into, removed when dropped.
struct DumpFile(PathBuf);

impl Drop for DumpFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Whether `file` (a name in a VM's directory) is a screendump's.
pub(super) fn is_dump_file(file: &str) -> bool {
    file.starts_with(".screen-") && file.ends_with(".png")
}

impl Inner {
    /// The PID of VM `name`'s QEMU when it runs with a screen; `NotFound` without the VM,
    /// `Invalid` when it is not running or its QEMU has no screen.
    fn screen_pid(&self, name: &str) -> Result<i32> {
        self.check_name("VM", name)?;
        let Some(pid) = self.pid(name) else {
            if self.load_vm(name)?.is_none() {
                return Err(not_found(format!("VM {name}")));
            }
            let state = match self.load_memory(name)? {
                Some(_) => "suspended",
                None => "stopped",
            };
            return Err(BackendError::Invalid(format!(
                "VM {name} is {state}: it has a screen only while it runs (`boxery start {name}`)"
            )));
        };
        let has_screen = process::launched_args(pid).is_some_and(|a| process::had_screen(&a));
        if !has_screen {
            return Err(BackendError::Invalid(format!(
                "VM {name} runs in a QEMU started before boxery gave VMs a screen: stop and start it to give it one"
            )));
        }
        Ok(pid)
    }

    async fn screen_qmp(&self, name: &str) -> Result<Qmp> {
        Qmp::connect(&self.layout.vm_qmp(name), SCREEN_TIMEOUT)
            .await
            .map_err(|e| BackendError::failed(format!("reach the screen of VM {name}"), e))
    }

    /// VM `name`'s screen now, as PNG.
    pub(super) async fn screendump(&self, name: &str) -> Result<Screen> {
        let pid = self.screen_pid(name)?;
        let step = || format!("read the screen of VM {name}");
        let file = DumpFile(self.vm_dir(name).join(format!(
            ".screen-{}-{:016x}.png",
            std::process::id(),
            rand::random::<u64>()
        )));
        let mut q = self.screen_qmp(name).await?;
        q.screendump(&file.0, "png")
            .await
            .map_err(|e| BackendError::failed(step(), e))?;
        drop(q);
        let png = std::fs::read(&file.0).map_err(io(format!("reading {}", file.0.display())))?;
        drop(file);
        let shown = screen::from_png(png, &step())?;
        self.screens.set(name, pid as u64, &shown);
        Ok(shown)
    }

    /// A connection to VM `name`'s VNC server (its QEMU's, on the VM's own socket).
    pub(super) async fn console_vnc(&self, name: &str) -> Result<tokio::net::UnixStream> {
        let pid = self.screen_pid(name)?;
        if !process::launched_args(pid).is_some_and(|a| a.iter().any(|x| x == "-vnc")) {
            return Err(BackendError::Invalid(format!(
                "VM {name} runs in a QEMU started before boxery served its screen over VNC: stop and start it to watch its console"
            )));
        }
        let path = process::vnc_socket(&self.vm_dir(name));
        tokio::net::UnixStream::connect(&path)
            .await
            .map_err(|e| BackendError::failed(format!("reach the screen of VM {name}"), e))
    }

    /// Send `events` to VM `name`'s keyboard and tablet.
    pub(super) async fn send_input(&self, name: &str, events: &[InputEvent]) -> Result<()> {
        let pid = self.screen_pid(name)?;
        if events.is_empty() {
            return Ok(());
        }
        let size = match screen::needs_size(events) {
            false => None,
            true => match self.screens.get(name, pid as u64) {
                Some(size) => Some(size),
                None => {
                    let shown = self.screendump(name).await?;
                    Some((shown.width, shown.height))
                }
            },
        };
        let events = screen::qmp_events(name, events, size)?;
        let mut q = self.screen_qmp(name).await?;
        let mut sent = 0;
        for chunk in screen::chunks(&events) {
            if sent > 0 {
                tokio::time::sleep(screen::CHUNK_PAUSE).await;
            }
            q.input_send_event(chunk).await.map_err(|e| match e {
                // refused whole: a key name QEMU does not know, or a paused guest
                qmp::QmpError::Command { desc, .. } => {
                    screen::refused(name, &desc, sent, events.len())
                }
                e => BackendError::failed(format!("send input to VM {name}"), e),
            })?;
            sent += chunk.len();
        }
        Ok(())
    }
}

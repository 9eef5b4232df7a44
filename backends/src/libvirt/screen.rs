//! A running VM's screen ([`crate::Backend::screendump`], [`crate::Backend::send_input`]).
//!
//! - **Screendump**: `virDomainScreenshot`. libvirt has QEMU dump the screen into libvirt's
//!   own directory and streams the file back, so nothing of ours must be writable by QEMU's
//!   user and no file of ours is made; it needs a video device, not a `<graphics>` listener.
//!   libvirt 11 asks QEMU for PNG; an older one gives PPM, turned into PNG here.
//! - **Input**: QMP's `input-send-event` through libvirt's QEMU monitor passthrough
//!   (`virDomainQemuMonitorCommand`), the same events the qemu backend sends
//!   ([`crate::screen`]). `virDomainSendKey` carries keys only, pressed together and released
//!   together after a hold time: no pointer, no key held across other events, so it cannot
//!   carry a batch. Caveat: libvirt marks a domain that had a passthrough command as tainted
//!   (`custom-monitor`, one line in libvirtd's log); it runs the same.
//!
//! - **Console**: a VNC display with no listener (`<listen type='none'/>`: no port, no
//!   socket); `virDomainOpenGraphics` hands QEMU's VNC server one end of a socket pair we
//!   make and keep the other of ([`crate::Backend::console_vnc`]).
//!
//! Every call is bounded ([`SCREEN_TIMEOUT`]) and runs off the async workers; the VM's lock is
//! not taken (nothing of the VM changes).

use virt::stream::Stream;

use super::*;
use crate::screen;
use crate::{InputEvent, Screen};

/// How long a screen's libvirt call may take (libvirt waits up to 30 s for a domain job
/// another call holds).
const SCREEN_TIMEOUT: Duration = Duration::from_secs(45);
/// `VIR_DOMAIN_QEMU_MONITOR_COMMAND_DEFAULT`: the command is QMP JSON.
const MONITOR_QMP: u32 = 0;
/// `VIR_DOMAIN_OPEN_GRAPHICS_SKIPAUTH`: the client is let in without the display's own
/// authentication.
const OPEN_GRAPHICS_SKIPAUTH: u32 = 1;
/// The largest picture read back (a 4K screen as PPM is 25 MiB).
const MAX_PICTURE: usize = 64 << 20;

impl Inner {
    /// Our domain `name`, running with a screen, and its id (one per start); `NotFound`
    /// without it, `Invalid` when it is not running or was started without a screen.
    fn screen_domain(&self, conn: &Connect, name: &str) -> Result<(Dom, u32)> {
        let d = self.require(conn, name)?;
        if !Self::is_running(&d) {
            let state = match Self::has_memory(&d)? {
                true => "suspended",
                false => "stopped",
            };
            return Err(BackendError::Invalid(format!(
                "VM {name} is {state}: it has a screen only while it runs (`boxery start {name}`)"
            )));
        }
        let live = Self::xml_of(&d, 0)?;
        if !xml::has_screen(&live) {
            return Err(BackendError::Invalid(format!(
                "VM {name} was started from a definition older than boxery's screens: stop and start it to give it one"
            )));
        }
        let id = d.dom.id().unwrap_or(0);
        Ok((d, id))
    }

    /// Run `f` with the connection, bounded by [`SCREEN_TIMEOUT`] (`step` names it when it
    /// is not done in time; its thread finishes in the background).
    async fn screen_call<T: Send + 'static>(
        self: &Arc<Self>,
        step: String,
        f: impl FnOnce(&Inner, &Connect) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        match tokio::time::timeout(SCREEN_TIMEOUT, self.call(f)).await {
            Ok(r) => r,
            Err(_) => Err(BackendError::failed(
                step,
                format!("libvirt did not answer within {SCREEN_TIMEOUT:?}"),
            )),
        }
    }

    /// VM `name`'s screen now, as PNG.
    pub(super) async fn screendump(self: &Arc<Self>, name: &str) -> Result<Screen> {
        self.storage.check_name("VM", name)?;
        let n = name.to_string();
        let step = format!("read the screen of VM {name}");
        let (id, shown) = self
            .screen_call(step.clone(), move |me, conn| {
                let (d, id) = me.screen_domain(conn, &n)?;
                let (mime, bytes) =
                    screenshot(conn, &d.dom).map_err(|e| BackendError::failed(step.clone(), e))?;
                // converting a PPM is CPU work: here, off the async workers
                Ok((id, screen::from_picture(bytes, &mime, &step)?))
            })
            .await?;
        self.screens.set(name, u64::from(id), &shown);
        Ok(shown)
    }

    /// A connection to VM `name`'s VNC display: one end of a socket pair made here, the
    /// other handed to QEMU's VNC server as a client (`virDomainOpenGraphics`, QMP
    /// `add_client` underneath). The display has no listener, so this is the only way to it.
    pub(super) async fn console_vnc(
        self: &Arc<Self>,
        name: &str,
    ) -> Result<tokio::net::UnixStream> {
        use std::os::fd::AsRawFd;
        self.storage.check_name("VM", name)?;
        let n = name.to_string();
        let step = format!("reach the screen of VM {name}");
        let ours = self
            .screen_call(step.clone(), move |me, conn| {
                let (d, _) = me.screen_domain(conn, &n)?;
                if !xml::has_console(&Self::xml_of(&d, 0)?) {
                    return Err(BackendError::Invalid(format!(
                        "VM {n} was started from a definition older than boxery's console over VNC: stop and start it to watch its console"
                    )));
                }
                let (ours, qemus) = std::os::unix::net::UnixStream::pair()
                    .map_err(|e| BackendError::failed(step.clone(), e))?;
                // libvirt passes a copy of `qemus` on; ours is closed when this returns. The
                // caller was checked already: no VNC password or TLS of a host-wide qemu.conf
                // stands between (the display has no listener for anyone else to use).
                d.dom
                    .open_graphics(0, qemus.as_raw_fd(), OPEN_GRAPHICS_SKIPAUTH)
                    .map_err(|e| BackendError::failed(step, e))?;
                Ok(ours)
            })
            .await?;
        ours.set_nonblocking(true)
            .and_then(|()| tokio::net::UnixStream::from_std(ours))
            .map_err(|e| BackendError::failed(format!("reach the screen of VM {name}"), e))
    }

    /// Send `events` to VM `name`'s keyboard and tablet.
    pub(super) async fn send_input(
        self: &Arc<Self>,
        name: &str,
        events: &[InputEvent],
    ) -> Result<()> {
        self.storage.check_name("VM", name)?;
        let n = name.to_string();
        let step = format!("send input to VM {name}");
        let id = self
            .screen_call(step.clone(), move |me, conn| {
                Ok(me.screen_domain(conn, &n)?.1)
            })
            .await?;
        if events.is_empty() {
            return Ok(());
        }
        let size = match screen::needs_size(events) {
            false => None,
            true => match self.screens.get(name, u64::from(id)) {
                Some(size) => Some(size),
                None => {
                    let shown = self.screendump(name).await?;
                    Some((shown.width, shown.height))
                }
            },
        };
        let events = screen::qmp_events(name, events, size)?;
        let n = name.to_string();
        // the batch stops at the deadline, before the call's own limit: nothing is typed after
        // this call has returned
        let deadline = std::time::Instant::now() + SCREEN_TIMEOUT - Duration::from_secs(5);
        self.screen_call(step.clone(), move |me, conn| {
            let (d, now) = me.screen_domain(conn, &n)?;
            if now != id {
                return Err(BackendError::failed(
                    step,
                    format!("VM {n} restarted while its input was prepared: send it again"),
                ));
            }
            let mut sent = 0;
            for chunk in screen::chunks(&events) {
                if sent > 0 {
                    std::thread::sleep(screen::CHUNK_PAUSE);
                }
                if std::time::Instant::now() > deadline {
                    return Err(BackendError::failed(
                        step,
                        format!(
                            "the batch ran out of time: {sent} of its {} QEMU events were sent",
                            events.len()
                        ),
                    ));
                }
                let command = serde_json::json!({
                    "execute": "input-send-event",
                    "arguments": {"events": chunk},
                });
                let reply = d
                    .dom
                    .qemu_monitor_command(&command.to_string(), MONITOR_QMP)
                    .map_err(|e| BackendError::failed(step.clone(), e))?;
                // libvirt hands QEMU's reply over as it is, an error included
                let reply: serde_json::Value = serde_json::from_str(&reply)
                    .map_err(|e| BackendError::failed(step.clone(), e))?;
                if let Some(err) = reply.get("error") {
                    let desc = err["desc"].as_str().unwrap_or("no reason given");
                    return Err(screen::refused(&n, desc, sent, events.len()));
                }
                sent += chunk.len();
            }
            Ok(())
        })
        .await
    }
}

/// `virDomainScreenshot` of `dom`'s first screen: the picture's MIME type and its bytes.
fn screenshot(conn: &Connect, dom: &Domain) -> std::result::Result<(String, Vec<u8>), String> {
    let stream = Stream::new(conn, 0).map_err(|e| e.to_string())?;
    let mime = match dom.screenshot(&stream, 0, 0) {
        Ok(m) => m,
        Err(e) => {
            let _ = stream.abort();
            return Err(e.to_string());
        }
    };
    let mut bytes = Vec::new();
    let mut buf = vec![0u8; 256 << 10];
    loop {
        let got = match stream.recv(&mut buf) {
            Ok(n) => n,
            Err(e) => {
                let _ = stream.abort();
                return Err(format!("reading the picture: {e}"));
            }
        };
        if got <= 0 {
            break;
        }
        bytes.extend_from_slice(&buf[..got as usize]);
        if bytes.len() > MAX_PICTURE {
            let _ = stream.abort();
            return Err(format!("the picture is larger than {MAX_PICTURE} bytes"));
        }
    }
    stream
        .finish()
        .map_err(|e| format!("finishing the picture's stream: {e}"))?;
    Ok((mime, bytes))
}

//! `boxery desktop`: a VM's screen as a VNC stream, for a person's browser (the CLI serves
//! noVNC and carries each of its websockets to one [`Viewer::connect`]).
//!
//! Guarantees: no VNC port is opened anywhere.
//! - A VM with the desktop layer: each connection is one `x11vnc -inetd` in the guest, run as
//!   the login user over the VM's pinned ssh connection (the way [`Verbs::reach`] finds,
//!   through the API under a remote context): the RFB stream is its stdin and stdout, and it
//!   ends when the ssh channel does. It reads the desktop layer's display `:0` with the user's
//!   own cookie; without `control` it is started `-viewonly` (keys and the pointer are dropped
//!   in the guest, whatever the browser sends).
//! - Any other VM: its console, the hypervisor's own screen of it (nothing in the guest),
//!   through the backend's VNC server ([`Backend::console_vnc`]). That server has no
//!   view-only mode: without `control` the client's messages go through
//!   [`super::rfb::ViewOnly`], which passes only what asks for pictures. Under a remote
//!   context, the VM's host does this ([`crate::Remote::screen`]: the API's screen endpoint
//!   makes the viewer there and filters there) and this side carries the bytes.

use std::sync::Arc;

use boxery_backends::Backend;
use boxery_hands::Reach;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::{Result, VerbError, Verbs};

/// The line run in the guest for one viewer (POSIX sh): wait for the display (at most 60 s: it
/// may be starting again, after a new `spec.display`), then x11vnc speaking RFB to one client
/// it is handed (`-inetd`: no listening socket), with the login user's cookie, no password
/// (the stream is the ssh channel's), its log dropped. libvncserver peeks at its client as a
/// socket (a websocket handshake test), so socat (the plumbing layer's) hands it one end of a
/// socket pair and carries the other to ssh's stdin and stdout (the display is in the
/// environment: socat splits its addresses at `:`). When the viewer goes, ssh's stdin ends and
/// socat with it; x11vnc does not always notice, so the pair runs in a session of its own
/// (`setsid`, its stdin kept explicitly: a background job's would be /dev/null) and the whole
/// group is ended after socat: TERM, and KILL 2 s later (an x11vnc whose client went has been
/// seen to outlive a TERM). Failures go to stderr, which the caller shows.
pub fn vnc_line(control: bool) -> String {
    format!(
        "export DISPLAY=:0 XAUTHORITY=\"$HOME/.Xauthority\"; i=0; \
         until xdpyinfo >/dev/null 2>&1; do i=$((i+1)); if [ $i -ge 300 ]; then echo 'the desktop (display :0) is not up: systemctl status boxery-desktop' >&2; exit 1; fi; sleep 0.2; done; \
         setsid socat STDIO EXEC:'x11vnc -inetd -auth '\"$HOME\"'/.Xauthority -nopw -quiet -nolookup -noipv6 -noxrecord{} -o /dev/null' 0<&0 & p=$!; \
         wait \"$p\"; kill -TERM -- -\"$p\" 2>/dev/null; sleep 2; kill -KILL -- -\"$p\" 2>/dev/null; exit 0",
        if control { "" } else { " -viewonly" }
    )
}

/// Which screen a viewer watches.
#[derive(Clone)]
enum Way {
    /// The guest's desktop, through x11vnc over ssh.
    Desktop(Reach),
    /// The hypervisor's own screen of the VM (its console), through the backend's VNC server.
    Console(Arc<dyn Backend>),
    /// The console of a VM of a control plane on another machine, through its API.
    Remote(Arc<dyn crate::Remote>),
}

/// The way to one VM's screen.
#[derive(Clone)]
pub struct Viewer {
    vm: String,
    way: Way,
    control: bool,
}

/// One viewer's VNC stream: `from` gives the server's RFB messages, `to` takes the client's
/// (through `filter`, when there is one: a view-only viewer of a server that has no view-only
/// mode), `why` says why a guest's session failed.
pub struct Session {
    /// The server's side.
    pub from: Box<dyn AsyncRead + Send + Unpin>,
    /// The client's side, to the server.
    pub to: Box<dyn AsyncWrite + Send + Unpin>,
    /// What the client's bytes go through first.
    pub filter: Option<super::rfb::ViewOnly>,
    /// The guest session's stderr.
    pub why: Option<tokio::process::ChildStderr>,
    child: Option<tokio::process::Child>,
}

impl Session {
    /// End it (the guest's session killed and waited for).
    pub async fn end(mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.start_kill();
            let _ = c.wait().await;
        }
    }
}

impl Viewer {
    /// The VM.
    pub fn vm(&self) -> &str {
        &self.vm
    }

    /// Whether viewers may send keys and the pointer.
    pub fn control(&self) -> bool {
        self.control
    }

    /// Whether it watches the VM's console (the hypervisor's screen) rather than a desktop.
    pub fn console(&self) -> bool {
        matches!(self.way, Way::Console(_) | Way::Remote(_))
    }

    /// Start one VNC session: x11vnc in the guest (killed with the session), or a connection
    /// to the hypervisor's VNC server, view-only through [`super::rfb::ViewOnly`] unless
    /// `control`.
    pub async fn connect(&self) -> Result<Session> {
        match &self.way {
            Way::Desktop(reach) => {
                let mut child = reach
                    .command()
                    .args(["-T", "-o", "BatchMode=yes", "--"])
                    .arg(vnc_line(self.control))
                    .stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .kill_on_drop(true)
                    .spawn()
                    .map_err(|e| VerbError::failed(format!("cannot run ssh: {e}")))?;
                let (Some(to), Some(from), why) =
                    (child.stdin.take(), child.stdout.take(), child.stderr.take())
                else {
                    return Err(VerbError::failed("ssh's pipes"));
                };
                Ok(Session {
                    from: Box::new(from),
                    to: Box::new(to),
                    filter: None,
                    why,
                    child: Some(child),
                })
            }
            Way::Console(backend) => {
                let stream = backend
                    .console_vnc(&self.vm)
                    .await
                    .map_err(|e| console_error(&self.vm, e))?;
                let (from, to) = stream.into_split();
                Ok(Session {
                    from: Box::new(from),
                    to: Box::new(to),
                    filter: (!self.control).then(super::rfb::ViewOnly::default),
                    why: None,
                    child: None,
                })
            }
            Way::Remote(remote) => {
                // the far side filters a view-only viewer's messages
                let (from, to) = tokio::io::split(remote.screen(&self.vm, self.control).await?);
                Ok(Session {
                    from: Box::new(from),
                    to: Box::new(to),
                    filter: None,
                    why: None,
                    child: None,
                })
            }
        }
    }
}

fn console_error(vm: &str, e: boxery_backends::BackendError) -> VerbError {
    match e {
        boxery_backends::BackendError::Unsupported { backend, .. } => VerbError::invalid(format!(
            "VM {vm} has no desktop, and the {backend} backend serves no console to watch: make one with `headless: false` (docs/desktop.md)"
        )),
        e => super::computer::backend_error(vm, e),
    }
}

/// The way to VM `vm`'s screen: its desktop when it has the desktop layer (reachable as
/// `boxery ssh` reaches it), else its console, from the hypervisor on the VM's host (this one,
/// or through a context's API).
pub async fn open(v: &Verbs, vm: &str, control: bool) -> Result<Viewer> {
    let obj = crate::vm::get_vm(v, vm).await?;
    let way = if super::computer::has_desktop(&obj) {
        Way::Desktop(v.reach(vm).await?)
    } else if let Some(remote) = v.remote_plane() {
        // reached once now: a VM that is not running, or a token that may not, says so here
        drop(remote.screen(vm, control).await?);
        Way::Remote(remote.clone())
    } else {
        let backend = v.env.backend_of(&obj)?;
        // reached once now: a VM that is not running, or a backend without one, says so here
        drop(
            backend
                .console_vnc(vm)
                .await
                .map_err(|e| console_error(vm, e))?,
        );
        Way::Console(backend)
    };
    Ok(Viewer {
        vm: vm.to_string(),
        way,
        control,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_viewer_is_view_only_unless_given_control() {
        assert!(vnc_line(false).contains(" -viewonly"));
        assert!(!vnc_line(true).contains("-viewonly"));
        // never a listening socket
        for l in [vnc_line(false), vnc_line(true)] {
            assert!(l.contains("-inetd") && !l.contains("-rfbport"), "{l}");
        }
    }
}

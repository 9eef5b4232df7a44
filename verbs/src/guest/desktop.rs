//! `boxery desktop`: a VM's desktop as a VNC stream, for a person's browser (the CLI serves
//! noVNC and carries each of its websockets to one [`Viewer::connect`]).
//!
//! Guarantees: no VNC port is opened anywhere. Each connection is one `x11vnc -inetd` in the
//! guest, run as the login user over the VM's pinned ssh connection (the way [`Verbs::reach`]
//! finds, through the API under a remote context): the RFB stream is its stdin and stdout,
//! and it ends when the ssh channel does. It reads the desktop layer's display `:0` with the
//! user's own cookie; without `control` it is started `-viewonly` (keys and the pointer are
//! dropped in the guest, whatever the browser sends). Only a VM with the desktop layer has
//! one: others are refused with what to use instead.

use boxery_hands::Reach;

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

/// The way to one VM's desktop.
#[derive(Clone)]
pub struct Viewer {
    reach: Reach,
    control: bool,
}

impl Viewer {
    /// The VM.
    pub fn vm(&self) -> &str {
        self.reach.vm()
    }

    /// Whether viewers may send keys and the pointer.
    pub fn control(&self) -> bool {
        self.control
    }

    /// Start one VNC session in the guest: the child's stdin takes the client's RFB messages,
    /// its stdout gives the server's, its stderr says why it failed. It is killed when dropped.
    pub fn connect(&self) -> Result<tokio::process::Child> {
        self.reach
            .command()
            .args(["-T", "-o", "BatchMode=yes", "--"])
            .arg(vnc_line(self.control))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| VerbError::failed(format!("cannot run ssh: {e}")))
    }
}

/// The way to VM `vm`'s desktop: it must have the desktop layer and be reachable.
pub async fn open(v: &Verbs, vm: &str, control: bool) -> Result<Viewer> {
    let obj = crate::vm::get_vm(v, vm).await?;
    if !super::computer::has_desktop(&obj) {
        return Err(VerbError::invalid(format!(
            "VM {vm} has no desktop to watch: make one with `headless: false` (docs/desktop.md); \
             its console is `boxery screenshot {vm} --console FILE`"
        )));
    }
    let reach = v.reach(vm).await?;
    Ok(Viewer { reach, control })
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

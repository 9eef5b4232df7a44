//! A desktop VM's display health, as its `DisplayReady` condition (docs/desktop.md): while a
//! VM with a desktop (`headless: false`) is Ready, the Vm reconciler asks the guest, at most
//! every [`EVERY`] ([`DOWN_EVERY`] while it is down), whether display `:0` answers; systemd
//! restarts the display when it dies (`Restart=always`), and the condition follows.
//!
//! # Guarantees
//! - The question is one ssh command as the VM's login user (over its ControlMaster when one
//!   runs), bounded by [`TIMEOUT`]; its answer is parsed strictly ([`parse`]): a size of two
//!   numbers, or a unit state of lower-case letters and `-`, at most 32 of them. Anything else
//!   (a guest that says something else, an ssh that fails) leaves the condition as it was.
//! - The condition exists only while the VM is Ready and has a desktop: a stopped, suspended
//!   or booting VM, or a headless one, has none.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use boxery_api::conditions::{DISPLAY_READY, reasons};
use boxery_api::{ConditionStatus, Conditions, Vm};

use crate::context::Ctx;

/// How often a display that answers is asked again.
pub const EVERY: Duration = Duration::from_secs(15);
/// How often a display that does not answer is asked again.
pub const DOWN_EVERY: Duration = Duration::from_secs(5);
/// How long one question may take.
pub const TIMEOUT: Duration = Duration::from_secs(20);
/// The longest answer read.
const MAX_ANSWER: usize = 256;

/// What the guest runs: `up WIDTHxHEIGHT` when display `:0` answers, else `down` and the
/// display unit's state.
const PROBE: &str = "s=$(DISPLAY=:0 XAUTHORITY=\"$HOME/.Xauthority\" timeout 10 xdpyinfo 2>/dev/null | \
     sed -n 's/^ *dimensions: *\\([0-9]*x[0-9]*\\) pixels.*/\\1/p'); \
     if [ -n \"$s\" ]; then echo \"up $s\"; else echo \"down $(systemctl is-active boxery-desktop.service 2>/dev/null || true)\"; fi";

/// What the guest said of its display.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Display `:0` answers, at this size.
    Up(u32, u32),
    /// It does not; the display unit's state (`activating`, `failed`, …; empty if unknown).
    Down(String),
}

/// The guest's answer, `None` when it is not one of the two forms.
pub fn parse(out: &str) -> Option<Seen> {
    let line = out.trim_end_matches('\n');
    if line.contains('\n') {
        return None;
    }
    if let Some(size) = line.strip_prefix("up ") {
        let (w, h) = size.split_once('x')?;
        let num = |s: &str| {
            (!s.is_empty() && s.len() <= 5 && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse::<u32>().ok())
                .flatten()
        };
        return Some(Seen::Up(num(w)?, num(h)?));
    }
    let state = line.strip_prefix("down")?.trim_start();
    (state.len() <= 32 && state.bytes().all(|b| b.is_ascii_lowercase() || b == b'-'))
        .then(|| Seen::Down(state.to_string()))
}

/// When each VM's display was last asked about.
#[derive(Debug, Default)]
pub struct Asked(Mutex<HashMap<String, Instant>>);

impl Asked {
    /// Whether `vm`'s display is due a question (`down`: it did not answer last time); marks
    /// it asked when it is.
    fn take(&self, vm: &str, down: bool) -> bool {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let every = if down { DOWN_EVERY } else { EVERY };
        if all.get(vm).is_some_and(|at| at.elapsed() < every) {
            return false;
        }
        all.insert(vm.to_string(), Instant::now());
        true
    }
}

/// Set `vm`'s `DisplayReady` from its guest when due (`vm` is Ready). Returns when the
/// reconciler should look again: `None` for a VM without a desktop.
pub(crate) async fn check(ctx: &Ctx, vm: &mut Vm) -> Option<Duration> {
    if vm.spec.headless {
        vm.status.conditions.remove_condition(DISPLAY_READY);
        return None;
    }
    let known = vm.status.conditions.get_condition(DISPLAY_READY);
    let down = known.is_none_or(|c| c.status != ConditionStatus::True);
    let again = if down { DOWN_EVERY } else { EVERY };
    let ssh = ctx.ssh.as_ref()?;
    let name = vm.metadata.name.clone();
    if !ctx.display.take(&name, down) {
        return Some(again);
    }
    let out = ssh
        .command(&name)
        .args(["-T", "-o", "BatchMode=yes", "--", PROBE])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = match tokio::time::timeout(TIMEOUT, out).await {
        Ok(Ok(o)) if o.status.success() => o.stdout,
        _ => return Some(again), // not answered: the condition stays as it was
    };
    let text = String::from_utf8_lossy(&out[..out.len().min(MAX_ANSWER)]).into_owned();
    let generation = vm.metadata.generation;
    match parse(&text) {
        Some(Seen::Up(w, h)) => {
            vm.status.conditions.set_condition(
                DISPLAY_READY,
                ConditionStatus::True,
                reasons::DISPLAY_ANSWERS,
                &format!("display :0 answers at {w}x{h}"),
                generation,
            );
            Some(EVERY)
        }
        Some(Seen::Down(state)) => {
            let msg = match state.as_str() {
                // running but not answering: systemd sees nothing to restart
                "active" => format!(
                    "display :0 does not answer though boxery-desktop.service runs: \
                     `boxery run {name} -- sudo systemctl restart boxery-desktop` starts it again"
                ),
                "" => format!(
                    "display :0 does not answer; systemd starts it again: \
                     `boxery run {name} -- journalctl -u boxery-desktop` says why"
                ),
                state => format!(
                    "display :0 does not answer (boxery-desktop.service is {state}); systemd \
                     starts it again: `boxery run {name} -- journalctl -u boxery-desktop` says why"
                ),
            };
            vm.status.conditions.set_condition(
                DISPLAY_READY,
                ConditionStatus::False,
                reasons::DISPLAY_DOWN,
                &msg,
                generation,
            );
            Some(DOWN_EVERY)
        }
        None => {
            tracing::debug!(vm = %name, answer = %text.escape_debug(), "a display check's answer is not understood");
            Some(again)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_two_forms_are_understood() {
        assert_eq!(parse("up 1280x800\n"), Some(Seen::Up(1280, 800)));
        assert_eq!(
            parse("down activating\n"),
            Some(Seen::Down("activating".into()))
        );
        assert_eq!(parse("down \n"), Some(Seen::Down(String::new())));
        assert_eq!(parse("down failed"), Some(Seen::Down("failed".into())));
        for bad in [
            "",
            "up",
            "up 1280x",
            "up x800",
            "up 1280x800x2",
            "up 99999999x1",
            "up -1x2",
            "up 1280x800\nup 1x1",
            "down \x1b[31mred",
            "down Failed",
            "down a b",
            "sideways",
            &format!("down {}", "a".repeat(33)),
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_display_is_asked_again_only_when_due() {
        let a = Asked::default();
        assert!(a.take("v", false));
        assert!(!a.take("v", false), "asked just now");
        assert!(!a.take("v", true), "down: sooner, not at once");
        assert!(a.take("w", false), "another VM");
        a.0.lock()
            .unwrap()
            .insert("v".into(), Instant::now() - DOWN_EVERY);
        assert!(a.take("v", true), "down: due after DOWN_EVERY");
        a.0.lock()
            .unwrap()
            .insert("v".into(), Instant::now() - DOWN_EVERY);
        assert!(!a.take("v", false), "up: not yet");
    }
}

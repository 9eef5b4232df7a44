//! Why a running guest does not answer, read from its serial console: a kernel panic, a
//! guest that booted to a login prompt without cloud-init (so the seed's user, keys and host
//! key never arrived) or cloud-init that found no seed; a booted guest whose ssh server does
//! not answer gets a hint, not a verdict.
//! What matters most for images people bring themselves (docs/images.md, "Bring your own
//! image"): without it, such a VM would only say "not reachable yet" until the wait ran out.
//!
//! The console is the guest's own text, so hostile: only fixed phrases are matched, and the
//! one line quoted (a panic's) is cleaned of control characters and cut short.

use boxery_api::{EventType, Resource};

use crate::Ctx;

/// The most of a quoted console line.
const QUOTED: usize = 120;

/// What a console says about a guest that does not answer over ssh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnosis {
    /// What it says, for a person.
    pub text: String,
    /// It will not answer unless someone changes the VM (a wait for Ready may end on it);
    /// otherwise a hint that may still turn out wrong (a slow ssh server).
    pub decisive: bool,
}

/// What a console says about a guest that does not answer over ssh, when it says something;
/// `None` otherwise (still booting, or nothing recognisable). Only the guest's last boot
/// counts: a guest that panicked, rebooted and booted fine is not judged by the panic.
pub fn diagnose(console: &str) -> Option<Diagnosis> {
    let console = console
        .rfind("Linux version ")
        .map_or(console, |at| &console[at..]);
    let said = |text: String, decisive| Some(Diagnosis { text, decisive });
    if let Some(line) = console
        .lines()
        .find(|l| l.contains("Kernel panic - not syncing"))
    {
        return said(
            format!(
                "the guest's kernel panicked (\"{}\"): its image does not boot on this machine",
                quoted(line)
            ),
            true,
        );
    }
    let cloud_init = console.contains("Cloud-init v.");
    let login = console.lines().any(is_login_prompt);
    if login && !cloud_init {
        return said(
            "the guest booted to a login prompt, but cloud-init never ran: boxery gives a VM \
             its user, keys and host key through cloud-init's NoCloud seed, so its image needs \
             cloud-init, enabled (docs/images.md, \"Bring your own image\")"
                .into(),
            true,
        );
    }
    if console.contains("Datasource DataSourceNone") {
        return said(
            "cloud-init ran but did not read boxery's seed (it fell back to no datasource): \
             the image's cloud-init must allow the NoCloud datasource (docs/images.md, \
             \"Bring your own image\")"
                .into(),
            true,
        );
    }
    if login && console.contains("finished at") {
        // a hint only: an ssh server that is merely slow to start looks the same for a while
        return said(
            "the guest booted and cloud-init read its seed, but nothing answers over ssh yet: \
             if this lasts, its image needs OpenSSH's server, started at boot (docs/images.md, \
             \"Bring your own image\")"
                .into(),
            false,
        );
    }
    None
}

/// Why a running VM does not answer yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Explained {
    /// Only the ssh probe's failure: it may still come.
    Booting(String),
    /// Its console says it will not answer (and why).
    NotAnswering(String),
}

/// `why` (the ssh probe's failure), with what the console of VM `vm` says when it is
/// decisive; the first such diagnosis of a VM is also a Warning event.
pub async fn explain(ctx: &Ctx, vm: &boxery_api::Vm, why: String) -> Explained {
    let console = match ctx.backend.console(vm.name()).await {
        Ok(Some(c)) => c,
        _ => return Explained::Booting(why),
    };
    let Some(d) = diagnose(&console) else {
        return Explained::Booting(why);
    };
    if !d.decisive {
        return Explained::Booting(format!("{} ({why})", d.text));
    }
    let d = d.text;
    let uid = vm.metadata.uid.as_deref().unwrap_or("");
    if ctx.first_report(&format!("unfit-guest:{}:{uid}:{d}", vm.name())) {
        ctx.event(vm, EventType::Warning, "GuestNotAnswering", &d)
            .await;
    }
    Explained::NotAnswering(format!("{d} (ssh: {why})"))
}

/// getty's prompt: `HOSTNAME login: ` at the start of a line (kernel messages may follow on
/// the same line).
fn is_login_prompt(line: &str) -> bool {
    let line = line.trim_end();
    let host = line
        .strip_suffix(" login:")
        .or_else(|| line.split_once(" login: ").map(|(h, _)| h));
    host.is_some_and(|host| {
        !host.is_empty()
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
    })
}

/// A console line made safe to quote: printable characters only, at most [`QUOTED`].
fn quoted(line: &str) -> String {
    let clean: String = line
        .chars()
        .filter(|c| !c.is_control())
        .collect::<String>()
        .trim()
        .to_string();
    if clean.chars().count() > QUOTED {
        format!("{}…", clean.chars().take(QUOTED).collect::<String>())
    } else {
        clean
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOOTED: &str = "[    2.1] Run /init as init process\r\n\
        [  OK  ] Started getty@tty1.service\r\n\r\nDebian GNU/Linux 12 c1 ttyS0\r\n\r\nc1 login: ";

    #[test]
    fn a_login_prompt_without_cloud_init_is_named() {
        let d = diagnose(BOOTED).unwrap();
        assert!(d.decisive);
        assert!(d.text.contains("cloud-init never ran"), "{}", d.text);
        assert!(d.text.contains("Bring your own image"));
    }

    #[test]
    fn a_guest_still_booting_says_nothing() {
        assert_eq!(diagnose(""), None);
        assert_eq!(
            diagnose("[    0.0] Linux version 6.1\r\n[    1.0] Run /init"),
            None
        );
        // cloud-init running, no prompt yet
        assert_eq!(
            diagnose("Cloud-init v. 22.4.2 running 'init-local' at Sat"),
            None
        );
        // a boxery guest that booted fine: cloud-init ran, and no datasource complaint
        let fine = format!("Cloud-init v. 22.4.2 running 'init' at Sat\n{BOOTED}");
        assert_eq!(diagnose(&fine), None);
    }

    #[test]
    fn a_booted_guest_without_ssh_or_seed_is_named() {
        let done = format!(
            "Cloud-init v. 22.4.2 running 'init'\nCloud-init v. 22.4.2 finished at Sat, 05 Dec 2026. Datasource DataSourceNoCloud [seed=/dev/vdb].  Up 30.0 seconds\n{BOOTED}"
        );
        // a hint, not a verdict: a slow ssh server looks the same for a while
        let d = diagnose(&done).unwrap();
        assert!(d.text.contains("OpenSSH") && !d.decisive, "{d:?}");
        let none = "Cloud-init v. 22.4.2 finished at Sat. Datasource DataSourceNone.  Up 9 s";
        let d = diagnose(none).unwrap();
        assert!(d.text.contains("NoCloud") && d.decisive, "{d:?}");
    }

    #[test]
    fn a_panic_is_quoted_clean_and_short() {
        let evil = format!(
            "[ 1.2] Kernel panic - not syncing: VFS: Unable to mount root fs\x1b[2J\x07{}",
            "x".repeat(500)
        );
        let d = diagnose(&evil).unwrap();
        assert!(d.decisive);
        let d = d.text;
        assert!(d.contains("Unable to mount root fs"), "{d}");
        assert!(!d.chars().any(|c| c.is_control()), "{d:?}");
        assert!(d.len() < 400, "{}", d.len());
    }

    /// Only the last boot counts: a panic before a reboot that then boots says nothing.
    #[test]
    fn a_panic_before_a_reboot_is_not_held_against_the_next_boot() {
        let rebooted = "[ 0.0] Linux version 6.1\n[ 1.2] Kernel panic - not syncing: oops\n\
                        [ 0.0] Linux version 6.1\nCloud-init v. 22.4.2 running 'init'\n";
        assert_eq!(diagnose(rebooted), None);
        let again = format!("{rebooted}[ 3.0] Kernel panic - not syncing: again\n");
        assert!(diagnose(&again).unwrap().text.contains("again"));
    }

    #[test]
    fn only_getty_prompts_count() {
        assert!(is_login_prompt("c1 login: "));
        assert!(is_login_prompt("debian-12.local login:"));
        assert!(is_login_prompt(
            "debian login: [  159.204924] kvm: Nested Virtualization enabled\r"
        ));
        assert!(!is_login_prompt("login: "));
        assert!(!is_login_prompt("echo 'c1 login:' && rm -rf x login:"));
    }
}

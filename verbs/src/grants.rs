//! Grant verbs: request one (write a Grant, `PendingApproval`), list, revoke (delete: its
//! finalizer revokes it), and the approval path — [`approve`] and [`deny`], for a person. A
//! front end calls them only after a person confirmed (the CLI reads a typed `yes` from the
//! terminal, [`confirmation_required`] saying whether it must); no MCP tool calls them.
//!
//! Approval is bound to what the person saw: the status write carries the resourceVersion of
//! the grant shown, so a grant changed between the prompt and the answer is refused
//! (`Conflict`), and it records the generation approved, which any spec change voids.

use boxery_api::grant::{GrantLimits, GrantPhase, GrantSpec, GrantType, ValueFrom};
use boxery_api::{Grant, Lease, Name, Resource, Vm, now};
use boxery_store::{ObjectRef, ObjectStoreExt, StoreError};

use crate::Verbs;
use crate::error::{ErrorKind, Result, VerbError};
use crate::objects::Deleted;

/// What to grant: everything a Grant's spec says, and its name if chosen.
#[derive(Debug, Clone)]
pub struct Request {
    /// The Grant's name (default: [`default_name`]).
    pub name: Option<Name>,
    /// The VM it is for (or `lease`).
    pub vm: Option<String>,
    /// The lease it is for (or `vm`).
    pub lease: Option<String>,
    /// `TYPE:TARGET` (`llm:anthropic`, `http:api.example.com`, `github:OWNER/REPO`,
    /// `env:NAME`, `file:PATH`).
    pub what: String,
    /// `http`: the header to add.
    pub header: Option<String>,
    /// Where the value comes from.
    pub value_from: ValueFrom,
    /// `llm`: its limits.
    pub limits: Option<GrantLimits>,
}

/// A request in a front end's words: `boxery grant …`'s arguments, and `vm_grant`'s (this is
/// that tool's input schema for them). [`ask`] checks them.
#[derive(Debug, Clone, Default, serde::Deserialize, schemars::JsonSchema)]
pub struct Asked {
    /// request: what to grant, TYPE:TARGET: llm:PROVIDER (e.g. llm:anthropic), http:HOST (with
    /// `header`), github:OWNER/REPO, env:NAME, file:PATH, ssh-agent:all (or
    /// ssh-agent:SHA256:… fingerprints, comma-separated; `from_file` names the agent's socket).
    #[serde(rename = "grant")]
    pub what: Option<String>,
    /// request: the VM it is for (default: this session's VM), unless `lease` is given.
    pub vm: Option<String>,
    /// request: a lease instead of a VM (the grant is revoked when the lease ends).
    pub lease: Option<String>,
    /// request, http grants: the header the proxy adds (e.g. Authorization).
    pub header: Option<String>,
    /// request: the value is this environment variable of the control plane (never the value).
    pub from_env: Option<String>,
    /// request: the value is this file on the control plane (an absolute path).
    pub from_file: Option<String>,
    /// request: the value is this command's output on the control plane (program and arguments).
    pub from_command: Option<Vec<String>>,
    /// request: the grant's name (default VM-TYPE-TARGET); revoke: the grant to revoke.
    pub name: Option<String>,
    /// request, llm grants: at most this many input and output tokens a UTC day (past it
    /// the proxy answers 429 until midnight UTC).
    pub tokens_per_day: Option<u64>,
    /// request, llm grants: at most this many requests in any minute.
    pub requests_per_minute: Option<u32>,
    /// request, llm grants: at most this many dollars a UTC month, at the owner's prices.
    pub dollars_per_month: Option<f64>,
}

/// [`request`] what a front end was asked: the name and where the value comes from checked
/// first, their errors in the words of `v`'s voice (`--from-env` or `from_env`).
pub async fn ask(v: &Verbs, a: Asked) -> Result<(Grant, bool)> {
    let tool = v.voice == crate::Voice::Tool;
    let name = a
        .name
        .map(|n| Name::label(&n))
        .transpose()
        .map_err(|e| VerbError::invalid(if tool { format!("name: {e}") } else { e.0 }))?;
    let value_from =
        value_from(a.from_env, a.from_file, a.from_command).map_err(|e| match tool {
            true => VerbError::invalid(
                e.to_string()
                    .replace("--from-env", "from_env")
                    .replace("--from-file", "from_file")
                    .replace("--from-command", "from_command"),
            ),
            false => e,
        })?;
    let limits = (a.tokens_per_day.is_some()
        || a.requests_per_minute.is_some()
        || a.dollars_per_month.is_some())
    .then_some(GrantLimits {
        tokens_per_day: a.tokens_per_day,
        requests_per_minute: a.requests_per_minute,
        dollars_per_month: a.dollars_per_month,
    });
    let r = Request {
        name,
        vm: a.vm,
        lease: a.lease,
        what: a.what.unwrap_or_default(),
        header: a.header,
        value_from,
        limits,
    };
    request(v, r).await
}

/// Parse `TYPE:TARGET`.
pub fn parse_what(what: &str) -> Result<(GrantType, String)> {
    let (t, target) = what.split_once(':').ok_or_else(|| {
        VerbError::invalid(format!(
            "`{}` is not TYPE:TARGET: write llm:anthropic, http:HOST, github:OWNER/REPO, env:NAME, file:PATH or ssh-agent:all",
            boxery_api::name::shown(what)
        ))
    })?;
    let t: GrantType = t.parse().map_err(VerbError::invalid)?;
    boxery_api::grant::check_target(t, target).map_err(VerbError::invalid)?;
    Ok((t, target.to_string()))
}

/// Exactly one of the three sources.
pub fn value_from(
    env: Option<String>,
    file: Option<String>,
    command: Option<Vec<String>>,
) -> Result<ValueFrom> {
    let v = match (env, file, command) {
        (Some(e), None, None) => ValueFrom::Env(e),
        (None, Some(f), None) => ValueFrom::File(f),
        (None, None, Some(c)) => ValueFrom::Command(c),
        _ => {
            return Err(VerbError::invalid(
                "say where the value comes from with exactly one of --from-env NAME, --from-file PATH, --from-command CMD",
            ));
        }
    };
    boxery_api::grant::check_value_from(&v).map_err(VerbError::invalid)?;
    Ok(v)
}

/// The name a grant gets when none is given: `SUBJECT-TYPE-TARGET`, the target reduced to
/// lowercase letters, digits and dashes, cut to a DNS-1123 label (with a short hash of the
/// target when it had to be changed, so distinct targets keep distinct names).
pub fn default_name(subject: &str, t: GrantType, target: &str) -> String {
    let mut slug = String::new();
    for c in target.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_alphanumeric() {
            slug.push(c);
        } else if !slug.ends_with('-') {
            slug.push('-');
        }
    }
    let slug = slug.trim_matches('-').to_string();
    let exact = slug == target;
    let mut name = format!("{subject}-{t}-{slug}");
    if !exact || name.len() > 63 {
        // FNV-1a: stable across builds and processes.
        let mut h: u32 = 0x811c_9dc5;
        for b in target.bytes() {
            h = (h ^ b as u32).wrapping_mul(0x0100_0193);
        }
        let suffix = format!("-{:06x}", h & 0xff_ffff);
        name.truncate(63 - suffix.len());
        name = name.trim_end_matches('-').to_string() + &suffix;
    }
    name
}

/// `grant VM TYPE:TARGET --from-…` (and `vm_grant {action: request}`): write the Grant. It
/// starts `PendingApproval`; nothing here approves it. An identical grant of that name is
/// returned as it is (`false`: not created); a different one is refused.
pub async fn request(v: &Verbs, r: Request) -> Result<(Grant, bool)> {
    let (type_, target) = parse_what(&r.what)?;
    let subject = match (&r.vm, &r.lease) {
        (Some(vm), None) => {
            let vm = Name::label(vm).map_err(|e| VerbError::invalid(e.0))?;
            if v.store().get_as::<Vm>(&vm).await?.is_none() {
                return Err(v.vm_not_found(&vm).await);
            }
            vm.into_string()
        }
        (None, Some(l)) => {
            let l = Name::label(l).map_err(|e| VerbError::invalid(e.0))?;
            if v.store().get_as::<Lease>(&l).await?.is_none() {
                return Err(VerbError::not_found(format!(
                    "lease {l} not found: `boxery lease ls` lists leases"
                )));
            }
            l.into_string()
        }
        _ => {
            return Err(VerbError::invalid(
                "name the VM the grant is for, or a lease (--lease NAME)",
            ));
        }
    };
    let name = match r.name {
        Some(n) => n.into_string(),
        None => default_name(&subject, type_, &target),
    };
    let spec = GrantSpec {
        limits: r.limits.clone(),
        vm: r.vm.clone(),
        lease: r.lease.clone(),
        type_,
        target,
        header: r.header.clone(),
        value_from: r.value_from.clone(),
    };
    let g = Grant::new(&name, spec.clone());
    match v.store().create_as_by(&g, &v.manager("grant")).await {
        Ok(g) => Ok((g, true)),
        Err(StoreError::AlreadyExists { .. }) => {
            let existing: Grant =
                v.store().get_as(&name).await?.ok_or_else(|| {
                    VerbError::conflict(format!("grant {name} changed: try again"))
                })?;
            if existing.spec == spec && !existing.metadata.is_deleting() {
                return Ok((existing, false));
            }
            Err(VerbError::conflict(format!(
                "grant {name} exists and grants something else: revoke it first (`boxery grant revoke {name}`) or choose another name"
            )))
        }
        Err(StoreError::Invalid(e)) => Err(VerbError::invalid(e)),
        Err(e) => Err(e.into()),
    }
}

/// Every grant, by name.
pub async fn list(v: &Verbs) -> Result<Vec<Grant>> {
    let mut gs = v.store().list_as::<Grant>(&Default::default()).await?;
    gs.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    Ok(gs)
}

/// `grant revoke NAME` (and `vm_grant {action: revoke}`): delete the grant; its finalizer
/// removes it from the grant state before it goes.
pub async fn revoke(v: &Verbs, name: &str) -> Result<Deleted> {
    let info = boxery_api::lookup_kind("grant").expect("a kind");
    let mut done = crate::objects::delete(v, info, &[name.to_string()]).await?;
    Ok(done.pop().expect("one name, one result"))
}

/// The `ssh-agent` grants in force on VM `vm` (`boxery ssh -A`): Applied for their current
/// generation, on this VM. `Err` (invalid) when there is none, saying how to ask for one.
pub async fn agent_grants(v: &Verbs, vm: &str) -> Result<Vec<Grant>> {
    let all = list(v).await?;
    let on_vm = |g: &&Grant| {
        g.spec.type_ == GrantType::SshAgent
            && (g.status.vm.as_deref() == Some(vm) || g.spec.vm.as_deref() == Some(vm))
    };
    let in_force: Vec<Grant> = all
        .iter()
        .filter(on_vm)
        .filter(|g| {
            g.status.phase == GrantPhase::Applied
                && g.status.approved_for(g.metadata.generation)
                && g.status.vm.as_deref() == Some(vm)
                && !g.metadata.is_deleting()
        })
        .cloned()
        .collect();
    if !in_force.is_empty() {
        return Ok(in_force);
    }
    let waiting: Vec<String> = all
        .iter()
        .filter(on_vm)
        .map(|g| format!("{} ({:?})", g.name(), g.status.phase))
        .collect();
    let vm = crate::render::safe(vm);
    Err(VerbError::invalid(if waiting.is_empty() {
        format!(
            "VM {vm} may not use your ssh-agent: no ssh-agent grant is in force on it. Ask for one with \
             `boxery grant {vm} ssh-agent:all` (your $SSH_AUTH_SOCK; or ssh-agent:SHA256:… for some keys, \
             --from-file SOCKET for another agent), which a person approves in a terminal"
        )
    } else {
        format!(
            "VM {vm} may not use your ssh-agent yet: its ssh-agent grants are not in force: {}. \
             `boxery grant approve NAME` in a terminal approves one; `boxery describe grant NAME` says why it waits",
            waiting.join(", ")
        )
    }))
}

/// The grant a person is asked about: it must exist, and not be revoked or being deleted.
pub async fn for_decision(v: &Verbs, name: &str) -> Result<Grant> {
    let name = Name::label(name).map_err(|e| VerbError::invalid(e.0))?;
    let g: Grant = v.store().get_as(&name).await?.ok_or_else(|| {
        VerbError::not_found(format!(
            "grant {name} not found: `boxery grant ls` lists grants"
        ))
    })?;
    if g.metadata.is_deleting() {
        return Err(VerbError::conflict(format!(
            "grant {name} is being deleted (revoked)"
        )));
    }
    if g.status.phase == GrantPhase::Revoked {
        return Err(VerbError::conflict(format!(
            "grant {name} was revoked (its VM or lease is gone), which is final: make a new grant"
        )));
    }
    Ok(g)
}

/// What a person approves or denies, in full: the grant, the VM (or lease) it is for, its
/// type and target, the header, and where the value comes from. Never the value.
pub fn summary(g: &Grant) -> String {
    let s = &g.spec;
    let safe = |t: &str| crate::render::safe(t).into_owned();
    let mut out = format!(
        "Grant {} (generation {}):\n",
        safe(g.name()),
        g.metadata.generation.unwrap_or_default()
    );
    match (&s.vm, &s.lease) {
        (Some(vm), _) => out.push_str(&format!("  for VM:      {}\n", safe(vm))),
        (_, Some(l)) => out.push_str(&format!(
            "  for lease:   {} (its VM{}; revoked when the lease ends)\n",
            safe(l),
            g.status
                .vm
                .as_deref()
                .map(|v| format!(" {}", safe(v)))
                .unwrap_or_default()
        )),
        _ => {}
    }
    let what = match s.type_ {
        GrantType::Llm => "LLM provider (through the credential proxy)",
        GrantType::Http => "HTTP host (the proxy adds a header)",
        GrantType::Github => "GitHub repository (through the proxy)",
        GrantType::Env => "environment variable pushed into the VM",
        GrantType::File => "file pushed into the VM",
        GrantType::SshAgent => {
            "ssh-agent forwarded into the VM (it can sign with the keys, not read them)"
        }
    };
    out.push_str(&format!("  type:        {} — {what}\n", s.type_));
    if s.type_ == GrantType::SshAgent {
        let keys = match boxery_api::grant::agent_keys(&s.target) {
            Ok(None) => "every key the agent holds".to_string(),
            _ => format!("only the keys {}", safe(&s.target)),
        };
        out.push_str(&format!("  keys:        {keys}\n"));
    } else {
        out.push_str(&format!("  target:      {}\n", safe(&s.target)));
    }
    if let Some(h) = &s.header {
        out.push_str(&format!("  header:      {}\n", safe(h)));
    }
    if let Some(l) = &s.limits {
        let mut said = Vec::new();
        if let Some(n) = l.tokens_per_day {
            said.push(format!("{n} tokens a day"));
        }
        if let Some(n) = l.requests_per_minute {
            said.push(format!("{n} requests a minute"));
        }
        if let Some(d) = l.dollars_per_month {
            said.push(format!("${d:.2} a month"));
        }
        out.push_str(&format!("  limits:      {}\n", said.join(", ")));
    }
    if s.type_ == GrantType::SshAgent {
        out.push_str(&format!(
            "  agent:       the socket named by {}\n",
            safe(&s.value_from.describe())
        ));
        out.push_str(
            "  note:        while in force, code in the VM can sign with these keys (log in, push) wherever its network reaches; revoking ends it\n",
        );
    } else {
        out.push_str(&format!(
            "  value from:  {} (the value itself is never shown or stored)\n",
            safe(&s.value_from.describe())
        ));
    }
    if matches!(s.type_, GrantType::Env | GrantType::File) {
        out.push_str(
            "  note:        the VM will hold this value: code in it can read, copy or send it\n",
        );
    }
    out
}

/// Whether approving and denying need a typed `yes`: unless the owner turned it off in
/// `$BOXERY_HOME/config.yaml` (`grants: {confirm: false}`). No flag or variable turns it off.
pub fn confirmation_required(v: &Verbs) -> Result<bool> {
    Ok(crate::env::read_config(v.home())?.grants.confirm)
}

/// The OS user running this process (from its uid, not from `$USER`).
pub fn os_user() -> String {
    use std::os::unix::fs::MetadataExt;
    let Ok(uid) = std::fs::metadata("/proc/self").map(|m| m.uid()) else {
        return "unknown".into();
    };
    std::fs::read_to_string("/etc/passwd")
        .ok()
        .and_then(|p| {
            p.lines().find_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                (f.len() > 2 && f[2] == uid.to_string()).then(|| f[0].to_string())
            })
        })
        .unwrap_or_else(|| format!("uid {uid}"))
}

/// Record a person's approval of the grant `shown` (as it was shown to them): refused when
/// its spec changed since (`Conflict`: another uid or generation), or when its value cannot be
/// read here. `by` is who approved; `how` goes into the event (e.g. "typed yes").
pub async fn approve(v: &Verbs, shown: &Grant, by: &str, how: &str) -> Result<Grant> {
    if let Err(why) = boxery_home::values::available_for(&shown.spec, v.home()) {
        return Err(VerbError::invalid(format!(
            "not approved: {why}. Grant {} needs a value the control plane can read",
            shown.name()
        )));
    }
    let g = decide(v, shown, |st, generation| {
        st.approved_by = Some(by.to_string());
        st.approved_at = Some(now());
        st.approved_generation = generation;
        st.denied_by = None;
        st.denied_at = None;
        st.denied_generation = None;
    })
    .await?;
    let msg = format!(
        "approved by {by} ({how}) for generation {}",
        g.metadata.generation.unwrap_or_default()
    );
    event(v, &g, "Approved", &msg).await;
    Ok(g)
}

/// Record a person's refusal of the grant `shown` (refused when its spec changed since).
pub async fn deny(v: &Verbs, shown: &Grant, by: &str, how: &str) -> Result<Grant> {
    let g = decide(v, shown, |st, generation| {
        st.denied_by = Some(by.to_string());
        st.denied_at = Some(now());
        st.denied_generation = generation;
        st.approved_by = None;
        st.approved_at = None;
        st.approved_generation = None;
    })
    .await?;
    let msg = format!(
        "denied by {by} ({how}) for generation {}",
        g.metadata.generation.unwrap_or_default()
    );
    event(v, &g, "Denied", &msg).await;
    Ok(g)
}

/// The status write of a decision on the grant as it is now, provided it is still the grant
/// that was shown (same uid, generation and spec): the controller may have written its status
/// meanwhile, which does not change what the person decided on. Each write carries the
/// resourceVersion just read as precondition (re-read on a conflict).
async fn decide(
    v: &Verbs,
    shown: &Grant,
    change: impl Fn(&mut boxery_api::grant::GrantStatus, Option<i64>),
) -> Result<Grant> {
    let name = shown.name();
    let changed = || {
        VerbError::new(
            ErrorKind::Conflict,
            format!(
                "grant {name} changed while you were deciding (`boxery describe grant {name}` shows it now): nothing was recorded; run the command again"
            ),
        )
    };
    for _ in 0..20 {
        let Some(mut g) = v.store().get_as::<Grant>(name).await? else {
            return Err(VerbError::not_found(format!(
                "grant {name} was deleted while you were deciding"
            )));
        };
        if g.metadata.uid != shown.metadata.uid
            || g.metadata.generation != shown.metadata.generation
            || g.spec != shown.spec
            || g.metadata.is_deleting()
        {
            return Err(changed());
        }
        change(&mut g.status, shown.metadata.generation);
        match v.store().update_status_as(&g).await {
            Ok(g) => return Ok(g),
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(changed())
}

async fn event(v: &Verbs, g: &Grant, reason: &str, msg: &str) {
    boxery_controller::Recorder::new(v.store_arc(), "boxery-grant")
        .publish(
            &boxery_controller::events::involved(g),
            boxery_api::EventType::Normal,
            reason,
            msg,
        )
        .await;
}

/// The object reference of a grant, for waits.
pub fn object_ref(name: &str) -> ObjectRef {
    ObjectRef::new(Grant::INFO.kind, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An approval binds to the spec the person saw: a change of spec (an agent's `apply`)
    /// between the prompt and the answer makes it fail, and records nothing; a status write
    /// by the controller meanwhile does not.
    #[tokio::test]
    async fn an_approval_is_of_the_spec_shown() {
        let dir = tempfile::tempdir().unwrap();
        let env = crate::Env::new(dir.path().join("home"), "fake");
        let v = Verbs::open(env, crate::Voice::Cli).unwrap();
        let vm: Vm = serde_json::from_value(serde_json::json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Vm", "metadata": {"name": "dev1"},
            "spec": {"source": {"image": "tiny"}}}))
        .unwrap();
        v.store().create_as(&vm).await.unwrap();
        let req = |from: &str| Request {
            limits: None,
            name: None,
            vm: Some("dev1".into()),
            lease: None,
            what: "llm:anthropic".into(),
            header: None,
            value_from: ValueFrom::Env(from.into()),
        };
        let (shown, _) = request(&v, req("PATH")).await.unwrap();
        // The controller writes status meanwhile: still the same grant.
        let mut g = shown.clone();
        g.status.observed_generation = Some(1);
        v.store().update_status_as(&g).await.unwrap();
        let ok = approve(&v, &shown, "me", "test").await.unwrap();
        assert_eq!(ok.status.approved_generation, Some(1));
        // The spec changes between the prompt and the answer: refused, nothing recorded.
        let shown = for_decision(&v, shown.name()).await.unwrap();
        let mut g = shown.clone();
        g.spec.value_from = ValueFrom::Env("HOME".into());
        let g = v.store().update_as(&g).await.unwrap();
        assert_eq!(g.metadata.generation, Some(2));
        let e = deny(&v, &shown, "me", "test").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Conflict, "{e}");
        let now: Grant = v.store().get_as(shown.name()).await.unwrap().unwrap();
        assert!(now.status.denied_generation.is_none());
        assert!(!now.status.approved_for(now.metadata.generation));
        // An unreadable value is not approved.
        let (bad, _) = request(
            &v,
            Request {
                name: Some(Name::label("bad").unwrap()),
                ..req("BOXERY_SURELY_UNSET_VARIABLE_X")
            },
        )
        .await
        .unwrap();
        let e = approve(&v, &bad, "me", "test").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
    }

    /// `ssh -A`'s check: no grant says how to ask; a pending one says it waits; only one in
    /// force on this VM passes. An approval of a socket that is not one is refused.
    #[tokio::test]
    async fn an_agent_needs_a_grant_in_force_on_the_vm() {
        let dir = tempfile::tempdir().unwrap();
        let env = crate::Env::new(dir.path().join("home"), "fake");
        let v = Verbs::open(env, crate::Voice::Cli).unwrap();
        for name in ["dev1", "dev2"] {
            let vm: Vm = serde_json::from_value(serde_json::json!({
                "apiVersion": "boxery.dev/v1alpha1", "kind": "Vm", "metadata": {"name": name},
                "spec": {"source": {"image": "tiny"}}}))
            .unwrap();
            v.store().create_as(&vm).await.unwrap();
        }
        let e = agent_grants(&v, "dev1").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Invalid);
        assert!(
            e.to_string().contains("`boxery grant dev1 ssh-agent:all`"),
            "{e}"
        );
        let sock = dir.path().join("agent.sock");
        let _listening = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let agent = |vm: &str, socket: &std::path::Path| Request {
            limits: None,
            name: None,
            vm: Some(vm.into()),
            lease: None,
            what: "ssh-agent:all".into(),
            header: None,
            value_from: ValueFrom::File(socket.display().to_string()),
        };
        let (g, _) = request(&v, agent("dev1", &sock)).await.unwrap();
        assert_eq!(g.name(), "dev1-ssh-agent-all");
        assert!(summary(&g).contains("every key the agent holds"));
        let e = agent_grants(&v, "dev1").await.unwrap_err();
        assert!(
            e.to_string()
                .contains("dev1-ssh-agent-all (PendingApproval)"),
            "{e}"
        );
        // approved and applied (the controller's part written by hand): in force on dev1 only
        let mut g = approve(&v, &g, "me", "test").await.unwrap();
        g.status.phase = GrantPhase::Applied;
        g.status.vm = Some("dev1".into());
        v.store().update_status_as(&g).await.unwrap();
        assert_eq!(agent_grants(&v, "dev1").await.unwrap().len(), 1);
        assert!(agent_grants(&v, "dev2").await.is_err());
        // a file that is not a socket is not approved
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"x").unwrap();
        let (bad, _) = request(&v, agent("dev2", &plain)).await.unwrap();
        let e = approve(&v, &bad, "me", "test").await.unwrap_err();
        assert!(e.to_string().contains("not a socket"), "{e}");
    }

    #[test]
    fn default_names_are_labels_and_distinct() {
        let cases = [
            ("dev1", GrantType::Llm, "anthropic", "dev1-llm-anthropic"),
            ("dev1", GrantType::Env, "NPM_TOKEN", ""),
            ("dev1", GrantType::Github, "me/repo", ""),
            ("dev1", GrantType::Http, "api.example.com", ""),
        ];
        let mut seen = std::collections::BTreeSet::new();
        for (s, t, target, want) in cases {
            let n = default_name(s, t, target);
            boxery_api::name::check_label_name(&n).unwrap_or_else(|e| panic!("{n}: {e}"));
            if !want.is_empty() {
                assert_eq!(n, want);
            }
            assert!(seen.insert(n));
        }
        let long = default_name(&"a".repeat(63), GrantType::File, &"b/".repeat(300));
        boxery_api::name::check_label_name(&long).unwrap();
        assert_ne!(
            default_name("v", GrantType::File, "a/b"),
            default_name("v", GrantType::File, "a-b")
        );
    }

    #[test]
    fn what_and_value_from_are_checked() {
        assert_eq!(
            parse_what("llm:anthropic").unwrap(),
            (GrantType::Llm, "anthropic".into())
        );
        assert!(parse_what("llm").is_err());
        assert!(parse_what("ssh:x").is_err());
        assert!(parse_what("file:../x").is_err());
        assert!(value_from(None, None, None).is_err());
        assert!(value_from(Some("A".into()), Some("/x".into()), None).is_err());
        assert!(value_from(Some("A B".into()), None, None).is_err());
        assert!(
            value_from(
                None,
                None,
                Some(vec!["gh".into(), "auth".into(), "token".into()])
            )
            .is_ok()
        );
    }
}

//! `vm_grant`: an agent asks for a credential for a VM (`boxery grant VM TYPE:TARGET …`), lists
//! grants, revokes one. No argument approves. When the MCP client supports elicitation, the
//! request asks the client's person (the same summary `boxery grant approve` shows) and
//! records their answer: approved, denied (an explicit no), or left pending (dismissed, no
//! answer within 10 minutes). Without elicitation the grant stays `PendingApproval` until a
//! person runs `boxery grant approve NAME` in a terminal, and the result says so. The owner's
//! `grants: {confirm: false}` never applies here: the person is always asked. The value never
//! passes through the tool: the agent names where the control plane reads it.

use std::sync::Arc;

use boxery_verbs::grants;
use boxery_verbs::objects::Deleted;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::{Output, Session, ToolResult};
use boxery_verbs::VerbError;

/// A `vm_grant` action (each is a `boxery grant` form).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum GrantAction {
    /// Ask for a grant: written PendingApproval; a person must approve it in a terminal.
    Request,
    /// List grants and their phase.
    List,
    /// Revoke (delete) a grant.
    Revoke,
}

/// `vm_grant` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct GrantArgs {
    /// request, list or revoke.
    pub action: GrantAction,
    /// The request (`name` also names the grant to revoke).
    #[serde(flatten)]
    pub asked: grants::Asked,
}

/// `vm_grant`.
pub async fn grant(session: Arc<Session>, a: GrantArgs, ct: CancellationToken) -> ToolResult {
    let v = session.verbs()?;
    match a.action {
        GrantAction::Request => {
            let mut asked = a.asked;
            if asked.what.as_deref().is_none_or(str::is_empty) {
                return Err(VerbError::invalid(
                    "request needs `grant`: TYPE:TARGET, e.g. llm:anthropic or github:OWNER/REPO",
                ));
            }
            asked.vm = match &asked.lease {
                Some(_) => None,
                None => Some(session.resolve_vm(asked.vm).await?),
            };
            let (g, created) = grants::ask(v, asked).await?;
            let name = g.metadata.name.clone();
            let phase = g.status.phase;
            let mut decision = None;
            let decided = g.status.approved_for(g.metadata.generation)
                || g.status.denied_for(g.metadata.generation);
            let asked = match session.asker() {
                Some(peer) if !decided => Some(ask(&peer, &g, &ct).await),
                _ => None,
            };
            let by = grants::os_user();
            let how = "answered in the MCP client (elicitation)";
            let text = if let Some(answer) = asked {
                match answer {
                    Ok(Answer::Approve) => {
                        grants::approve(v, &g, &by, how).await?;
                        decision = Some("approved");
                        format!(
                            "grant/{name} was approved by the person at your MCP client: it is in force once the control plane applies it (vm_grant {{action: list}} shows Applied)"
                        )
                    }
                    Ok(Answer::Deny) => {
                        grants::deny(v, &g, &by, how).await?;
                        decision = Some("denied");
                        format!("grant/{name} was denied by the person at your MCP client")
                    }
                    Ok(Answer::None(why)) | Err(why) => format!(
                        "grant/{name} is PendingApproval: it is NOT in force ({why}). A person can approve it by running `boxery grant approve {name}` in a terminal on the control plane's host."
                    ),
                }
            } else if g.status.approved_for(g.metadata.generation) {
                format!("grant/{name} is already approved")
            } else if g.status.denied_for(g.metadata.generation) {
                format!("grant/{name} was denied by a person; ask them, or request something else")
            } else {
                format!(
                    "grant/{name} {} and is PendingApproval: it is NOT in force. A person must approve it: \
                     they run `boxery grant approve {name}` in a terminal on the control plane's host \
                     (no tool can approve a grant). vm_grant {{action: list}} shows when it is Applied.",
                    if created { "was requested" } else { "exists" }
                )
            };
            Ok(Output::with_data(
                text,
                json!({
                    "grant": name,
                    "phase": format!("{phase:?}"),
                    "decision": decision,
                    "created": created,
                    "approve_with": format!("boxery grant approve {}", g.metadata.name),
                }),
            ))
        }
        GrantAction::List => {
            let gs = grants::list(v).await?;
            let objs: Vec<boxery_api::DynObject> = gs
                .iter()
                .filter_map(|g| boxery_api::DynObject::from_typed(g).ok())
                .collect();
            let text = super::table("grant", &objs, "no grants\n")?;
            let items: Vec<_> = gs
                .iter()
                .map(|g| {
                    json!({
                        "grant": g.metadata.name,
                        "phase": format!("{:?}", g.status.phase),
                        "vm": g.status.vm.clone().or(g.spec.vm.clone()),
                        "lease": g.spec.lease,
                        "type": g.spec.type_.to_string(),
                        "target": g.spec.target,
                    })
                })
                .collect();
            Ok(Output::with_data(text, json!({"grants": items})))
        }
        GrantAction::Revoke => {
            let name = a.asked.name.filter(|n| !n.is_empty()).ok_or_else(|| {
                VerbError::invalid("revoke needs `name` (vm_grant {action: list} lists them)")
            })?;
            let text = match grants::revoke(v, &name).await? {
                Deleted::Removed(n) | Deleted::Deleting(n) => {
                    format!("grant/{n} revoked: no longer in force")
                }
            };
            Ok(Output::with_data(
                text,
                json!({"grant": name, "revoked": true}),
            ))
        }
    }
}

/// What the person at the client answered.
enum Answer {
    /// Approve.
    Approve,
    /// Deny (an explicit no).
    Deny,
    /// No decision (dismissed, cancelled): why, in words.
    None(String),
}

/// How long the person at the client has to answer.
const ASK_FOR: std::time::Duration = std::time::Duration::from_secs(600);

/// Ask the person at the MCP client whether to approve `g` (elicitation: a form with one
/// boolean, `approve`). Accepted with `approve: true`: approve; accepted with false, or
/// declined: deny; dismissed or unanswered: no decision. `Err`: the question could not be
/// asked (said in words).
async fn ask(
    peer: &rmcp::Peer<rmcp::RoleServer>,
    g: &boxery_api::Grant,
    ct: &CancellationToken,
) -> Result<Answer, String> {
    use rmcp::model::{
        ClientResult, ElicitRequest, ElicitRequestParams, ElicitationAction, ElicitationSchema,
        ServerRequest,
    };
    let schema = ElicitationSchema::builder()
        .required_bool("approve")
        .build()
        .map_err(|e| format!("the approval form could not be made: {e}"))?;
    let message = format!(
        "An agent asks for a credential. {}\nApprove it (approve: true)? The value is never shown to the agent or stored; the grant can be revoked with `boxery grant revoke {}`.",
        grants::summary(g),
        g.metadata.name
    );
    let req = ServerRequest::ElicitRequest(ElicitRequest::new(
        ElicitRequestParams::FormElicitationParams {
            meta: None,
            message,
            requested_schema: schema,
        },
    ));
    let sent = tokio::select! {
        r = tokio::time::timeout(ASK_FOR, peer.send_request(req)) => r,
        _ = ct.cancelled() => return Err("the call was cancelled before the person answered".into()),
    };
    let result = match sent {
        Err(_) => {
            return Ok(Answer::None(
                "the person did not answer within 10 minutes".into(),
            ));
        }
        Ok(Err(e)) => return Err(format!("the MCP client could not ask its person: {e}")),
        Ok(Ok(r)) => r,
    };
    let ClientResult::ElicitResult(r) = result else {
        return Err("the MCP client answered the approval question with something else".into());
    };
    Ok(match r.action {
        ElicitationAction::Accept => {
            let yes = r
                .content
                .as_ref()
                .and_then(|c| c.get("approve"))
                .and_then(serde_json::Value::as_bool);
            match yes {
                Some(true) => Answer::Approve,
                Some(false) => Answer::Deny,
                None => Answer::None("the answer carried no `approve`".into()),
            }
        }
        ElicitationAction::Decline => Answer::Deny,
        ElicitationAction::Cancel => Answer::None("the person dismissed the question".into()),
        _ => Answer::None("the person's answer was not understood".into()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn session() -> (tempfile::TempDir, Arc<Session>) {
        let dir = tempfile::tempdir().unwrap();
        let env = boxery_verbs::Env::new(dir.path().join("home"), "fake");
        (dir, Arc::new(Session::new(env, None, false)))
    }

    async fn call(s: &Arc<Session>, tool: &str, args: Value) -> ToolResult {
        crate::find(tool)
            .unwrap()
            .run(s.clone(), args, CancellationToken::new())
            .await
    }

    async fn grant_status(s: &Session, name: &str) -> Value {
        let store = s.verbs().unwrap().home_store().unwrap().clone();
        store
            .get(&boxery_store::ObjectRef::new("Grant", name))
            .await
            .unwrap()
            .map(|o| o.status().clone())
            .unwrap_or(Value::Null)
    }

    const VM: &str = "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: dev1}\nspec: {source: {image: tiny}}\n";

    /// An agent cannot approve: not through `vm_apply` of a Grant carrying an approval in its
    /// status (created or updated), and `vm_grant` has no action that approves.
    #[tokio::test]
    async fn an_agent_cannot_approve_a_grant() {
        let (_d, s) = session();
        call(&s, "vm_apply", json!({"manifest": VM, "wait": false}))
            .await
            .unwrap();
        let forged = "apiVersion: boxery.dev/v1alpha1\nkind: Grant\nmetadata: {name: g1}\n\
            spec: {vm: dev1, type: llm, target: anthropic, valueFrom: {env: PATH}}\n\
            status: {phase: Applied, approvedBy: root, approvedGeneration: 1, approvedAt: '2026-01-01T00:00:00Z'}\n";
        for _ in 0..2 {
            let r = call(&s, "vm_apply", json!({"manifest": forged, "wait": false}))
                .await
                .unwrap();
            assert!(r.text.contains("grant/g1"), "{}", r.text);
            let st = grant_status(&s, "g1").await;
            assert!(
                st["approvedBy"].is_null() && st["approvedGeneration"].is_null(),
                "{st}"
            );
            assert_ne!(st["phase"], "Applied", "{st}");
        }
        // A spec field cannot approve either: the schema has none (unknown fields refused).
        let e = call(
            &s,
            "vm_apply",
            json!({"manifest": forged.replace("valueFrom: {env: PATH}", "valueFrom: {env: PATH}, approved: true"), "wait": false}),
        )
        .await
        .unwrap_err();
        assert_eq!(e.kind(), boxery_verbs::ErrorKind::Invalid, "{e}");
        let schema = crate::find("vm_grant").unwrap().schema.to_string();
        for word in ["approve", "deny", "confirm"] {
            assert!(
                !schema.contains(&format!("\"{word}\"")),
                "vm_grant offers {word}: {schema}"
            );
        }
    }

    #[tokio::test]
    async fn a_request_is_pending_and_says_who_approves() {
        let (_d, s) = session();
        call(&s, "vm_apply", json!({"manifest": VM, "wait": false}))
            .await
            .unwrap();
        let r = call(
            &s,
            "vm_grant",
            json!({"action": "request", "grant": "llm:anthropic", "from_env": "ANTHROPIC_API_KEY"}),
        )
        .await
        .unwrap();
        assert!(r.text.contains("PendingApproval"), "{}", r.text);
        assert!(
            r.text.contains("boxery grant approve dev1-llm-anthropic"),
            "{}",
            r.text
        );
        assert!(grant_status(&s, "dev1-llm-anthropic").await["approvedBy"].is_null());
        // Asking again is idempotent; another spec under that name is refused.
        let again = call(
            &s,
            "vm_grant",
            json!({"action": "request", "vm": "dev1", "grant": "llm:anthropic", "from_env": "ANTHROPIC_API_KEY"}),
        )
        .await
        .unwrap();
        assert_eq!(again.data.unwrap()["created"], false);
        let other = call(
            &s,
            "vm_grant",
            json!({"action": "request", "grant": "llm:anthropic", "from_env": "OTHER_KEY"}),
        )
        .await
        .unwrap_err();
        assert_eq!(other.kind(), boxery_verbs::ErrorKind::Conflict, "{other}");
        // Bad requests name the field.
        let e = call(
            &s,
            "vm_grant",
            json!({"action": "request", "grant": "llm:anthropic"}),
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("from_env"), "{e}");
        let e = call(
            &s,
            "vm_grant",
            json!({"action": "request", "vm": "nope", "grant": "llm:x", "from_env": "K"}),
        )
        .await
        .unwrap_err();
        assert_eq!(e.kind(), boxery_verbs::ErrorKind::NotFound, "{e}");
        let list = call(&s, "vm_grant", json!({"action": "list"}))
            .await
            .unwrap();
        assert!(list.text.contains("dev1-llm-anthropic"), "{}", list.text);
        let r = call(
            &s,
            "vm_grant",
            json!({"action": "revoke", "name": "dev1-llm-anthropic"}),
        )
        .await
        .unwrap();
        assert!(r.text.contains("revoked"), "{}", r.text);
    }
}

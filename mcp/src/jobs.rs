//! `vm_jobs`: background jobs whose state lives in the guest, so they outlive the call, the
//! ssh connection and the MCP server.
//!
//! A job is a directory `~/.boxery/jobs/ID/` holding `cmd`, `started` (epoch seconds), `pid`
//! (the job's process group), `out` (stdout and stderr) and, once it ended, `exit` (its real
//! exit status; 128+N when killed by signal N). A detached wrapper (its own session) waits for
//! the job and writes `exit`; the job itself runs in another session, so `kill` reaches the
//! job's whole process group and never the wrapper. A job whose wrapper vanished (the VM
//! rebooted) is listed as `lost`.

use std::sync::Arc;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::exec::helper;
use super::{OUTPUT_CAP, Output, Session, ToolError, ToolResult, clamp_timeout};
use boxery_api::name::safe;
use boxery_hands::qpath;
use boxery_hands::{dquoted, shell_quote};

/// What to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobAction {
    /// Start `command` in the background; returns the job's id.
    Start,
    /// List the VM's jobs.
    List,
    /// A job's output (`offset` bytes on, or the last `tail_bytes`).
    Logs,
    /// Wait (bounded by `timeout_seconds`) until the job ends; returns its exit code.
    Wait,
    /// Kill the job's process group (TERM, then KILL).
    Kill,
}

/// `vm_jobs` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobsArgs {
    /// start, list, logs, wait or kill.
    pub action: JobAction,
    /// The VM (default: the session's VM).
    #[serde(default)]
    pub vm: Option<String>,
    /// The job (logs, wait, kill).
    #[serde(default)]
    pub id: Option<String>,
    /// The command (start), run by `sh -c`.
    #[serde(default)]
    pub command: Option<String>,
    /// Working directory (start; default: the home).
    #[serde(default)]
    pub cwd: Option<String>,
    /// How long `wait` waits (default 60 s, at most 1800).
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
    /// logs: the byte offset to read from (from a previous `next_offset`).
    #[serde(default)]
    pub offset: Option<u64>,
    /// logs: without `offset`, how many bytes from the end (default 64 KiB).
    #[serde(default)]
    pub tail_bytes: Option<u64>,
}

const JOBS: &str = "\"$HOME/.boxery/jobs\"";

fn job_dir(id: &str) -> Result<String, ToolError> {
    if id.is_empty()
        || id.len() > 40
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(ToolError::Invalid(format!(
            "`{}` is not a job id: ids look like j3f9a2c01 (vm_jobs {{action: list}} shows them)",
            boxery_api::name::shown(id)
        )));
    }
    Ok(format!("{JOBS}/{id}"))
}

fn need_job(id: &str) -> String {
    format!(
        "j={JOBS}/{id}; [ -d \"$j\" ] || {{ echo \"no job {id} in this VM; its jobs: $(ls {JOBS} 2>/dev/null | tr '\\n' ' ')(vm_jobs {{action: list}})\" >&2; exit 3; }}; "
    )
}

/// The guest script that starts a job.
pub fn start_script(id: &str, command: &str, cwd: Option<&str>) -> String {
    let inner = "echo $$ > \"$1/pid.tmp\"; mv \"$1/pid.tmp\" \"$1/pid\"; exec sh -c \"$2\"";
    let wrapper = format!(
        "setsid sh -c {} job \"$1\" \"$2\" > \"$1/out\" 2>&1 < /dev/null & p=$!; wait $p; echo $? > \"$1/exit.tmp\"; mv \"$1/exit.tmp\" \"$1/exit\"",
        shell_quote(inner)
    );
    let cd = match cwd {
        Some(d) => format!(
            "cd {} || {{ printf '%s\\n' \"cannot cd to {}\" >&2; exit 4; }}; ",
            qpath(d),
            dquoted(d)
        ),
        None => "cd \"$HOME\"; ".into(),
    };
    format!(
        "j={JOBS}/{id}; mkdir -p \"$j\" || exit 1; printf '%s' {cmd} > \"$j/cmd\"; date +%s > \"$j/started\"; {cd}setsid sh -c {w} jobwrap \"$j\" {cmd} > /dev/null 2>&1 < /dev/null & i=0; while [ ! -s \"$j/pid\" ] && [ $i -lt 100 ]; do sleep 0.05 2>/dev/null || sleep 1; i=$((i+1)); done; cat \"$j/pid\"",
        cmd = shell_quote(command),
        w = shell_quote(&wrapper),
    )
}

/// The guest script that lists jobs, one per line: id, state, exit, started, command.
pub fn list_script() -> String {
    format!(
        "for d in {JOBS}/*/; do [ -d \"$d\" ] || continue; id=$(basename \"$d\"); e=$(cat \"$d/exit\" 2>/dev/null); p=$(cat \"$d/pid\" 2>/dev/null); if [ -n \"$e\" ]; then s=exited; elif [ -n \"$p\" ] && kill -0 \"$p\" 2>/dev/null; then s=running; else s=lost; fi; printf '%s\\t%s\\t%s\\t%s\\t' \"$id\" \"$s\" \"$e\" \"$(cat \"$d/started\" 2>/dev/null)\"; head -c 200 \"$d/cmd\" | tr '\\n\\t' '  '; echo; done"
    )
}

fn parse_list(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.splitn(5, '\t').collect();
            (f.len() == 5).then(|| {
                json!({
                    "id": f[0],
                    "state": f[1],
                    "exit_code": f[2].parse::<i64>().ok(),
                    "started": f[3].parse::<i64>().ok(),
                    "command": f[4],
                })
            })
        })
        .collect()
}

/// The guest script that waits up to `secs` and prints the job's state line.
pub fn wait_script(id: &str, secs: u64) -> String {
    format!(
        "{}n=$(({secs} * 10)); i=0; while [ ! -e \"$j/exit\" ] && [ $i -lt $n ]; do p=$(cat \"$j/pid\" 2>/dev/null); if [ -n \"$p\" ] && ! kill -0 \"$p\" 2>/dev/null; then sleep 0.2 2>/dev/null; [ -e \"$j/exit\" ] || break; fi; sleep 0.1 2>/dev/null || {{ sleep 1; i=$((i+9)); }}; i=$((i+1)); done; if [ -e \"$j/exit\" ]; then echo \"exited $(cat \"$j/exit\")\"; elif [ -n \"$p\" ] && kill -0 \"$p\" 2>/dev/null; then echo running; else echo lost; fi",
        need_job(id)
    )
}

/// The guest script that kills a job's process group.
pub fn kill_script(id: &str) -> String {
    format!(
        "{}p=$(cat \"$j/pid\" 2>/dev/null); [ -e \"$j/exit\" ] && {{ echo \"exited $(cat \"$j/exit\")\"; exit 0; }}; [ -n \"$p\" ] && kill -TERM -$p 2>/dev/null; i=0; while [ ! -e \"$j/exit\" ] && [ $i -lt 30 ]; do sleep 0.1 2>/dev/null || sleep 1; i=$((i+1)); [ $i -eq 20 ] && kill -KILL -$p 2>/dev/null; done; if [ -e \"$j/exit\" ]; then echo \"exited $(cat \"$j/exit\")\"; else echo lost; fi",
        need_job(id)
    )
}

fn logs_script(id: &str, offset: Option<u64>, tail: u64) -> String {
    let read = match offset {
        Some(o) => format!("tail -c +{} \"$j/out\" | head -c {OUTPUT_CAP}", o + 1),
        None => format!("tail -c {} \"$j/out\"", tail.min(OUTPUT_CAP as u64)),
    };
    format!("{}wc -c < \"$j/out\"; {read}", need_job(id))
}

async fn logs_of(
    session: &Session,
    vm: &str,
    id: &str,
    offset: Option<u64>,
    tail: u64,
    ct: &CancellationToken,
) -> Result<(u64, u64, String), ToolError> {
    let out = helper(
        session,
        vm,
        &logs_script(id, offset, tail),
        None,
        OUTPUT_CAP + 64,
        Duration::from_secs(60),
        ct,
    )
    .await?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let (size, body) = text.split_once('\n').unwrap_or((&text, ""));
    let size: u64 = size.trim().parse().unwrap_or(0);
    let from = match offset {
        Some(o) => o.min(size),
        None => size.saturating_sub(tail.min(OUTPUT_CAP as u64)),
    };
    Ok((from, size, body.to_string()))
}

fn state_data(line: &str) -> (String, Option<i64>) {
    let mut w = line.split_whitespace();
    let state = w.next().unwrap_or("lost").to_string();
    (state, w.next().and_then(|c| c.parse().ok()))
}

/// `vm_jobs`.
pub async fn jobs(session: Arc<Session>, a: JobsArgs, ct: CancellationToken) -> ToolResult {
    let vm = session.resolve_vm(a.vm.clone()).await?;
    let short = Duration::from_secs(60);
    let id = || {
        a.id.clone().filter(|i| !i.is_empty()).ok_or_else(|| {
            ToolError::Invalid("give the job's `id` (vm_jobs {action: list} shows them)".into())
        })
    };
    match a.action {
        JobAction::Start => {
            let command = a
                .command
                .clone()
                .filter(|c| !c.trim().is_empty())
                .ok_or_else(|| ToolError::Invalid("give the `command` to start".into()))?;
            let id = format!("j{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
            job_dir(&id)?;
            let out = helper(
                &session,
                &vm,
                &start_script(&id, &command, a.cwd.as_deref()),
                None,
                4096,
                short,
                &ct,
            )
            .await?;
            let pid = safe(String::from_utf8_lossy(&out).trim()).into_owned();
            Ok(Output::with_data(
                format!(
                    "started job {id} in {vm} (process group {pid}); vm_jobs {{action: wait, id: {id}}} waits for it, logs shows its output"
                ),
                json!({"vm": vm, "id": id, "pgid": pid.parse::<i64>().ok()}),
            ))
        }
        JobAction::List => {
            let out = helper(&session, &vm, &list_script(), None, OUTPUT_CAP, short, &ct).await?;
            let list = parse_list(&String::from_utf8_lossy(&out));
            let mut text = if list.is_empty() {
                format!("no jobs in {vm}\n")
            } else {
                String::from("ID\tSTATE\tEXIT\tCOMMAND\n")
            };
            for j in &list {
                // the guest wrote these: one line per job, no control characters
                text.push_str(&format!(
                    "{}\t{}\t{}\t{}\n",
                    safe(j["id"].as_str().unwrap_or("")),
                    safe(j["state"].as_str().unwrap_or("")),
                    j["exit_code"]
                        .as_i64()
                        .map(|c| c.to_string())
                        .unwrap_or_default(),
                    safe(j["command"].as_str().unwrap_or(""))
                ));
            }
            Ok(Output::with_data(text, json!({"vm": vm, "jobs": list})))
        }
        JobAction::Logs => {
            let id = id()?;
            job_dir(&id)?;
            let tail = a.tail_bytes.unwrap_or(64 << 10);
            let (from, size, body) = logs_of(&session, &vm, &id, a.offset, tail, &ct).await?;
            let next = from + body.len() as u64;
            let note = if from > 0 && a.offset.is_none() {
                format!("[output from byte {from} of {size}; earlier bytes: offset 0]\n")
            } else {
                String::new()
            };
            Ok(Output::with_data(
                format!("{note}{body}"),
                json!({"vm": vm, "id": id, "from": from, "size": size, "next_offset": next, "output": body}),
            ))
        }
        JobAction::Wait | JobAction::Kill => {
            let id = id()?;
            job_dir(&id)?;
            let (script, limit) = if a.action == JobAction::Wait {
                let t = clamp_timeout(a.timeout_seconds, 60);
                (wait_script(&id, t.as_secs()), t + Duration::from_secs(15))
            } else {
                (kill_script(&id), short)
            };
            let out = helper(&session, &vm, &script, None, 4096, limit, &ct).await?;
            let (state, code) = state_data(String::from_utf8_lossy(&out).trim());
            let (_, size, tail) = logs_of(&session, &vm, &id, None, 4096, &ct).await?;
            let text = match (state.as_str(), code) {
                ("exited", Some(c)) => format!(
                    "job {id} exited with code {c}{}; last output:\n{tail}",
                    if c > 128 {
                        format!(" (killed by signal {})", c - 128)
                    } else {
                        String::new()
                    }
                ),
                ("running", _) => format!(
                    "job {id} is still running (waited {}s); output so far ends with:\n{tail}",
                    clamp_timeout(a.timeout_seconds, 60).as_secs()
                ),
                _ => format!(
                    "job {id} was lost (its wrapper is gone, e.g. the VM rebooted); output:\n{tail}"
                ),
            };
            Ok(Output::with_data(
                text,
                json!({"vm": vm, "id": id, "state": state, "exit_code": code, "output_bytes": size}),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(home: &std::path::Path, script: &str) -> String {
        let o = std::process::Command::new("sh")
            .env("HOME", home)
            .args(["-c", script])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// The guest scripts under the local sh: a job records its real exit code, survives the
    /// shell that started it, and kill reaches its whole process group.
    #[test]
    fn jobs_run_detached_and_record_exit_codes() {
        let home = tempfile::tempdir().unwrap();
        let h = home.path();
        let pid = sh(
            h,
            &start_script("ja", "echo out; echo err >&2; exit 7", None),
        );
        assert!(pid.trim().parse::<u32>().is_ok(), "{pid}");
        assert_eq!(sh(h, &wait_script("ja", 10)).trim(), "exited 7");
        assert_eq!(
            std::fs::read_to_string(h.join(".boxery/jobs/ja/out")).unwrap(),
            "out\nerr\n"
        );
        sh(h, &start_script("jb", "sleep 60 & sleep 60", None));
        assert_eq!(sh(h, &wait_script("jb", 1)).trim(), "running");
        let l = parse_list(&sh(h, &list_script()));
        assert_eq!(l.len(), 2, "{l:?}");
        assert_eq!(l[1]["state"], "running");
        let k = sh(h, &kill_script("jb"));
        assert_eq!(k.trim(), "exited 143", "{k}");
        let pgid = std::fs::read_to_string(h.join(".boxery/jobs/jb/pid")).unwrap();
        assert!(
            !crate::group_alive(pgid.trim().parse().unwrap()),
            "the job's process group survived kill"
        );
        let o = std::process::Command::new("sh")
            .env("HOME", h)
            .args(["-c", &wait_script("nope", 1)])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(3));
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("ja jb"),
            "{o:?}"
        );
    }
}

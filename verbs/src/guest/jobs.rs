//! Background jobs whose state lives in the guest, so they outlive the call, the ssh
//! connection and the MCP server: [`start`], [`list`], [`logs`], [`wait`], [`kill`]
//! (`vm_jobs`, `boxery jobs …`).
//!
//! A job is a directory `~/.boxery/jobs/ID/` holding `cmd`, `started` (epoch seconds), `pid`
//! (the job's process group), `out` (stdout and stderr) and, once it ended, `exit` (its real
//! exit status; 128+N when killed by signal N). A detached wrapper (its own session) waits for
//! the job and writes `exit`; the job itself runs in another session, so `kill` reaches the
//! job's whole process group and never the wrapper. A job whose wrapper vanished (the VM
//! rebooted) is listed as `lost`.

use std::time::Duration;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::{OUTPUT_CAP, helper};
use crate::{Result, VerbError, Verbs};
use boxery_api::name::safe;
use boxery_hands::{dquoted, qpath, shell_quote};

const JOBS: &str = "\"$HOME/.boxery/jobs\"";

fn job_dir(id: &str) -> Result<String> {
    if id.is_empty()
        || id.len() > 40
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(VerbError::invalid(format!(
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

/// A job in a VM, as listed.
#[derive(Debug, Clone, Serialize)]
pub struct Job {
    /// Its id (`j3f9a2c01`).
    pub id: String,
    /// `running`, `exited` or `lost` (its wrapper is gone: the VM rebooted).
    pub state: String,
    /// Its exit code, once it exited.
    pub exit_code: Option<i64>,
    /// When it started (epoch seconds).
    pub started: Option<i64>,
    /// Its command (the first 200 bytes, one line).
    pub command: String,
}

fn parse_list(text: &str) -> Vec<Job> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.splitn(5, '\t').collect();
            (f.len() == 5).then(|| Job {
                id: f[0].to_string(),
                state: f[1].to_string(),
                exit_code: f[2].parse::<i64>().ok(),
                started: f[3].parse::<i64>().ok(),
                command: f[4].to_string(),
            })
        })
        .collect()
}

/// A VM's jobs.
#[derive(Debug, Clone, Serialize)]
pub struct Jobs {
    /// The VM.
    pub vm: String,
    /// Its jobs.
    pub jobs: Vec<Job>,
}

impl Jobs {
    /// A table, one line per job (`no jobs in VM` when there are none).
    pub fn table(&self) -> String {
        let mut text = if self.jobs.is_empty() {
            format!("no jobs in {}\n", self.vm)
        } else {
            String::from("ID\tSTATE\tEXIT\tCOMMAND\n")
        };
        for j in &self.jobs {
            // the guest wrote these: one line per job, no control characters
            text.push_str(&format!(
                "{}\t{}\t{}\t{}\n",
                safe(&j.id),
                safe(&j.state),
                j.exit_code.map(|c| c.to_string()).unwrap_or_default(),
                safe(&j.command)
            ));
        }
        text
    }
}

/// A job started.
#[derive(Debug, Clone, Serialize)]
pub struct Started {
    /// The VM.
    pub vm: String,
    /// The job's id.
    pub id: String,
    /// Its process group, as the guest printed it (made safe).
    pub pgid: String,
}

/// A job's output.
#[derive(Debug, Clone, Serialize)]
pub struct Logs {
    /// The VM.
    pub vm: String,
    /// The job.
    pub id: String,
    /// The byte offset `output` starts at.
    pub from: u64,
    /// The whole output's size so far.
    pub size: u64,
    /// Where the next read starts.
    pub next_offset: u64,
    /// The output (lossily UTF-8).
    pub output: String,
}

/// Where a job stands after [`wait`] or [`kill`].
#[derive(Debug, Clone, Serialize)]
pub struct Ended {
    /// The VM.
    pub vm: String,
    /// The job.
    pub id: String,
    /// `exited`, `running` (the wait ran out) or `lost`.
    pub state: String,
    /// Its exit code, once it exited.
    pub exit_code: Option<i64>,
    /// Its output's size.
    pub output_bytes: u64,
    /// The end of its output (4 KiB at most).
    pub tail: String,
    /// How long the call waited at most.
    pub waited: Duration,
}

impl Ended {
    /// `job ID exited with code C…`, `…is still running…` or `…was lost…`, then the end of
    /// its output.
    pub fn text(&self) -> String {
        let (id, tail) = (&self.id, &self.tail);
        match (self.state.as_str(), self.exit_code) {
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
                self.waited.as_secs()
            ),
            _ => format!(
                "job {id} was lost (its wrapper is gone, e.g. the VM rebooted); output:\n{tail}"
            ),
        }
    }
}

const SHORT: Duration = Duration::from_secs(60);

/// Start `command` (run by `sh -c`, in `cwd` or the home) in the background in VM `vm`.
pub async fn start(
    v: &Verbs,
    vm: &str,
    command: &str,
    cwd: Option<&str>,
    ct: &CancellationToken,
) -> Result<Started> {
    let doing = v.doing("job", Some(vm), command);
    let r = start_unrecorded(v, vm, command, cwd, ct).await;
    match &r {
        Ok(s) => doing.done(format!("started {}", s.id), None),
        Err(_) => doing.ended(&r, None),
    }
    r
}

async fn start_unrecorded(
    v: &Verbs,
    vm: &str,
    command: &str,
    cwd: Option<&str>,
    ct: &CancellationToken,
) -> Result<Started> {
    if command.trim().is_empty() {
        return Err(VerbError::invalid("give the `command` to start"));
    }
    let id = format!("j{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    job_dir(&id)?;
    let script = start_script(&id, command, cwd);
    let out = helper(v, vm, &script, None, 4096, SHORT, ct).await?;
    Ok(Started {
        vm: vm.to_string(),
        id,
        pgid: safe(String::from_utf8_lossy(&out).trim()).into_owned(),
    })
}

/// VM `vm`'s jobs.
pub async fn list(v: &Verbs, vm: &str, ct: &CancellationToken) -> Result<Jobs> {
    let out = helper(v, vm, &list_script(), None, OUTPUT_CAP, SHORT, ct).await?;
    Ok(Jobs {
        vm: vm.to_string(),
        jobs: parse_list(&String::from_utf8_lossy(&out)),
    })
}

/// Job `id`'s output: from byte `offset` on, or the last `tail` bytes (at most
/// [`OUTPUT_CAP`]).
pub async fn logs(
    v: &Verbs,
    vm: &str,
    id: &str,
    offset: Option<u64>,
    tail: u64,
    ct: &CancellationToken,
) -> Result<Logs> {
    job_dir(id)?;
    let script = logs_script(id, offset, tail);
    let out = helper(v, vm, &script, None, OUTPUT_CAP + 64, SHORT, ct).await?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let (size, body) = text.split_once('\n').unwrap_or((&text, ""));
    let size: u64 = size.trim().parse().unwrap_or(0);
    let from = match offset {
        Some(o) => o.min(size),
        None => size.saturating_sub(tail.min(OUTPUT_CAP as u64)),
    };
    Ok(Logs {
        vm: vm.to_string(),
        id: id.to_string(),
        from,
        size,
        next_offset: from + body.len() as u64,
        output: body.to_string(),
    })
}

/// Wait (at most `timeout`) until job `id` ends.
pub async fn wait(
    v: &Verbs,
    vm: &str,
    id: &str,
    timeout: Duration,
    ct: &CancellationToken,
) -> Result<Ended> {
    job_dir(id)?;
    let script = wait_script(id, timeout.as_secs());
    ended(
        v,
        vm,
        id,
        &script,
        timeout,
        timeout + Duration::from_secs(15),
        ct,
    )
    .await
}

/// Kill job `id`'s process group (TERM, then KILL).
pub async fn kill(v: &Verbs, vm: &str, id: &str, ct: &CancellationToken) -> Result<Ended> {
    let doing = v.doing("job-kill", Some(vm), id);
    let r = match job_dir(id) {
        Ok(_) => ended(v, vm, id, &kill_script(id), SHORT, SHORT, ct).await,
        Err(e) => Err(e),
    };
    doing.ended(&r, None);
    r
}

async fn ended(
    v: &Verbs,
    vm: &str,
    id: &str,
    script: &str,
    waited: Duration,
    limit: Duration,
    ct: &CancellationToken,
) -> Result<Ended> {
    let out = helper(v, vm, script, None, 4096, limit, ct).await?;
    let line = String::from_utf8_lossy(&out);
    let mut w = line.split_whitespace();
    let state = w.next().unwrap_or("lost").to_string();
    let exit_code = w.next().and_then(|c| c.parse().ok());
    let l = logs(v, vm, id, None, 4096, ct).await?;
    Ok(Ended {
        vm: vm.to_string(),
        id: id.to_string(),
        state,
        exit_code,
        output_bytes: l.size,
        tail: l.output,
        waited,
    })
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
        // tail counts from 1; the caller's offset may be anything
        Some(o) => format!(
            "tail -c +{} \"$j/out\" | head -c {OUTPUT_CAP}",
            o.saturating_add(1)
        ),
        None => format!("tail -c {} \"$j/out\"", tail.min(OUTPUT_CAP as u64)),
    };
    format!("{}wc -c < \"$j/out\"; {read}", need_job(id))
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

    /// An agent's `offset` anywhere in u64 makes a script, never an overflow.
    #[test]
    fn logs_from_any_offset() {
        assert!(logs_script("ja", Some(0), 0).contains("tail -c +1 "));
        let s = logs_script("ja", Some(u64::MAX), 0);
        assert!(s.contains(&format!("tail -c +{} ", u64::MAX)), "{s}");
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
        assert_eq!(l[1].state, "running");
        let k = sh(h, &kill_script("jb"));
        assert_eq!(k.trim(), "exited 143", "{k}");
        let pgid = std::fs::read_to_string(h.join(".boxery/jobs/jb/pid")).unwrap();
        assert!(
            !super::super::group_alive(pgid.trim().parse().unwrap()),
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

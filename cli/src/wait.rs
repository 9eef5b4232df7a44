//! The CLI's waits (`wait`, every `--wait`): the verbs' wait, reporting on the terminal
//! (`kind/name condition met` on stdout, progress on stderr).

use std::time::Duration;

use boxery_verbs::ObjectRef;
use boxery_verbs::Verbs;
use boxery_verbs::vm::Plan;
use boxery_verbs::wait::{Progress, Until, wait_all};

use crate::exit::CliResult;

/// Says each met condition on stdout and where pending objects stand on stderr.
struct Printed;

impl Progress for Printed {
    fn met(&self, t: &ObjectRef) {
        // A reader that left (`… | head -1`) misses the rest; the wait itself goes on.
        let line = format_args!("{}/{} condition met", t.kind.to_lowercase(), t.name);
        let _ = crate::out::write(line, true);
    }
    fn state(&self, line: &str) {
        eprintln!("{line}");
    }
    fn note(&self, line: &str) {
        eprintln!("{line}");
    }
}

/// Says only the notes about the wait itself, on stderr.
struct Notes;

impl Progress for Notes {
    fn note(&self, line: &str) {
        eprintln!("{line}");
    }
}

/// Wait, saying each object's progress.
pub async fn all(v: &Verbs, targets: &[ObjectRef], until: &Until, timeout: Duration) -> CliResult {
    Ok(wait_all(v, targets, until, timeout, &Printed).await?)
}

/// Wait, saying nothing but the notes about the wait itself.
pub async fn quiet(
    v: &Verbs,
    targets: &[ObjectRef],
    until: &Until,
    timeout: Duration,
) -> CliResult {
    Ok(wait_all(v, targets, until, timeout, &Notes).await?)
}

/// With `--wait`: wait for each step of a verb's plan in turn.
pub async fn plan(v: &Verbs, plan: &Plan, wait_for: Option<Duration>) -> CliResult {
    if let Some(t) = wait_for {
        for until in &plan.steps {
            all(v, &plan.targets, until, t).await?;
        }
    }
    Ok(())
}

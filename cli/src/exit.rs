//! Errors at the CLI's edge and the exit codes they map to.
//!
//! | code | meaning |
//! |---|---|
//! | 0 | success (`diff`: no differences) |
//! | 1 | the operation failed (`diff`: differences found) |
//! | 2 | invalid input: bad arguments, a manifest that does not validate; or not the caller's to do |
//! | 3 | not found |
//! | 4 | timed out waiting for a condition |
//! | 5 | conflict: someone else changed the object, or it is being deleted |
//! | 141 | stdout was closed by its reader (`… \| head -1`): the command stopped quietly |

use std::fmt;

/// Exit codes, documented in docs/cli.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// The operation failed.
    Failed = 1,
    /// Invalid input.
    Invalid = 2,
    /// Not found.
    NotFound = 3,
    /// Timed out.
    Timeout = 4,
    /// Conflict.
    Conflict = 5,
    /// Stdout's reader left: the command stops quietly, as a filter killed by `SIGPIPE`
    /// does (128 + 13).
    PipeClosed = 141,
}

/// An error with its exit code.
pub struct CliError {
    /// The code to exit with.
    pub code: Code,
    /// What went wrong (the whole chain is printed once).
    pub error: anyhow::Error,
}

impl fmt::Debug for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {:#}", self.code, self.error)
    }
}

impl CliError {
    /// An error with a code.
    pub fn new(code: Code, error: impl Into<anyhow::Error>) -> Self {
        CliError {
            code,
            error: error.into(),
        }
    }
    /// Invalid input.
    pub fn invalid(msg: impl fmt::Display) -> Self {
        CliError::new(Code::Invalid, anyhow::anyhow!("{msg}"))
    }
    /// Not found.
    pub fn not_found(msg: impl fmt::Display) -> Self {
        CliError::new(Code::NotFound, anyhow::anyhow!("{msg}"))
    }
}

impl From<boxery_verbs::ErrorKind> for Code {
    fn from(k: boxery_verbs::ErrorKind) -> Self {
        use boxery_verbs::ErrorKind as K;
        match k {
            K::Invalid | K::Forbidden => Code::Invalid,
            K::NotFound => Code::NotFound,
            K::NotReady | K::Conflict => Code::Conflict,
            K::Timeout => Code::Timeout,
            K::Cancelled | K::Failed => Code::Failed,
        }
    }
}

impl From<boxery_verbs::VerbError> for CliError {
    fn from(e: boxery_verbs::VerbError) -> Self {
        CliError::new(e.kind().into(), e)
    }
}

impl From<boxery_hands::HandsError> for CliError {
    fn from(e: boxery_hands::HandsError) -> Self {
        boxery_verbs::VerbError::from(e).into()
    }
}

impl From<anyhow::Error> for CliError {
    fn from(e: anyhow::Error) -> Self {
        CliError::new(Code::Failed, e)
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError::new(Code::Failed, e)
    }
}

impl From<serde_json::Error> for CliError {
    fn from(e: serde_json::Error) -> Self {
        CliError::new(Code::Failed, e)
    }
}

/// Result alias for commands.
pub type CliResult<T = ()> = Result<T, CliError>;

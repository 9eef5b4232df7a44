//! The one error type of the verbs. Its [`ErrorKind`] is what a front end decides on: the CLI
//! maps it to an exit code (`cli/src/exit.rs`), the MCP server to a tool error. The message
//! says what failed and what to do next; a cause stays a `#[source]`, and the whole chain is
//! printed once, at the edge ([`chain`]).

use boxery_hands::HandsError;
use boxery_store::StoreError;

/// What kind of failure, for the front ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The input is wrong (arguments, a manifest that does not validate).
    Invalid,
    /// The caller may not do this (a token's scope, a limit only a person lifts); the message
    /// says who may.
    Forbidden,
    /// An object, VM, file or job does not exist.
    NotFound,
    /// The VM exists but cannot be reached now.
    NotReady,
    /// Someone else changed the object, or it is being deleted.
    Conflict,
    /// A wait ran out.
    Timeout,
    /// The caller cancelled.
    Cancelled,
    /// Anything else.
    Failed,
}

/// A verb failed.
#[derive(Debug, thiserror::Error)]
pub enum VerbError {
    /// A failure the verb describes itself.
    #[error("{message}")]
    Said {
        /// Its kind.
        kind: ErrorKind,
        /// What failed and what to do.
        message: String,
    },
    /// A failure with a cause.
    #[error("{message}")]
    Caused {
        /// Its kind.
        kind: ErrorKind,
        /// What failed.
        message: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The store refused or failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A hand (ssh, copy) failed.
    #[error(transparent)]
    Hands(#[from] HandsError),
    /// A local file or process operation failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A value could not be (de)serialized.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

impl VerbError {
    /// A failure of `kind`.
    pub fn new(kind: ErrorKind, message: impl std::fmt::Display) -> VerbError {
        VerbError::Said {
            kind,
            message: message.to_string(),
        }
    }
    /// Invalid input.
    pub fn invalid(message: impl std::fmt::Display) -> VerbError {
        VerbError::new(ErrorKind::Invalid, message)
    }
    /// Not the caller's to do: the message says who may.
    pub fn forbidden(message: impl std::fmt::Display) -> VerbError {
        VerbError::new(ErrorKind::Forbidden, message)
    }
    /// Not found.
    pub fn not_found(message: impl std::fmt::Display) -> VerbError {
        VerbError::new(ErrorKind::NotFound, message)
    }
    /// A conflict.
    pub fn conflict(message: impl std::fmt::Display) -> VerbError {
        VerbError::new(ErrorKind::Conflict, message)
    }
    /// A failure.
    pub fn failed(message: impl std::fmt::Display) -> VerbError {
        VerbError::new(ErrorKind::Failed, message)
    }
    /// A failure with its cause.
    pub fn caused(
        kind: ErrorKind,
        message: impl std::fmt::Display,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> VerbError {
        VerbError::Caused {
            kind,
            message: message.to_string(),
            source: source.into(),
        }
    }

    /// Its kind.
    pub fn kind(&self) -> ErrorKind {
        match self {
            VerbError::Said { kind, .. } | VerbError::Caused { kind, .. } => *kind,
            VerbError::Store(e) => VerbError::kind_of_store(e),
            VerbError::Hands(e) => match e {
                HandsError::Invalid(_) => ErrorKind::Invalid,
                HandsError::NotFound(_) => ErrorKind::NotFound,
                HandsError::NotReady(_) => ErrorKind::NotReady,
                HandsError::Conflict(_) => ErrorKind::Conflict,
                HandsError::Store(s) => VerbError::kind_of_store(s),
                _ => ErrorKind::Failed,
            },
            VerbError::Io(_) | VerbError::Json(_) => ErrorKind::Failed,
        }
    }

    fn kind_of_store(e: &StoreError) -> ErrorKind {
        match e {
            StoreError::NotFound { .. } => ErrorKind::NotFound,
            StoreError::Invalid(_) | StoreError::AlreadyExists { .. } => ErrorKind::Invalid,
            StoreError::Forbidden { .. } => ErrorKind::Forbidden,
            StoreError::Conflict { .. }
            | StoreError::BeingDeleted { .. }
            | StoreError::FieldConflicts { .. } => ErrorKind::Conflict,
            _ => ErrorKind::Failed,
        }
    }

    /// The whole message: this error and its causes, `: `-separated.
    pub fn chain(&self) -> String {
        chain(self)
    }
}

/// An error and its causes, `: `-separated (what anyhow's `{:#}` prints).
pub use boxery_controller::error_chain as chain;

/// Result alias of the verbs.
pub type Result<T = (), E = VerbError> = std::result::Result<T, E>;

//! The reconcilers' error type.

use boxery_backends::BackendError;
use boxery_store::StoreError;

/// Why a reconcile step failed.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// Reading or writing the store failed (a Conflict means someone else moved first: retry).
    #[error("store operation failed")]
    Store(#[from] StoreError),
    /// Adding or removing a finalizer failed (a conflict means the object moved on: retry).
    #[error("finalizer update failed")]
    Finalizer(#[from] boxery_controller::finalizer::FinalizerError),
    /// A backend step failed.
    #[error("backend step `{step}` for {object} failed")]
    Backend {
        /// The step (`create`, `capture`, …).
        step: &'static str,
        /// `Vm/dev1`.
        object: String,
        /// The backend's error.
        #[source]
        source: BackendError,
    },
}

impl ReconcileError {
    /// A backend error with its step.
    pub fn backend(step: &'static str, object: impl Into<String>, source: BackendError) -> Self {
        ReconcileError::Backend {
            step,
            object: object.into(),
            source,
        }
    }

    /// Whether retrying without a spec change cannot help.
    pub fn is_terminal(&self) -> bool {
        match self {
            ReconcileError::Backend { source, .. } => source.is_terminal(),
            ReconcileError::Store(_) | ReconcileError::Finalizer(_) => false,
        }
    }

    /// Whether someone else wrote the object first (retried at once, not recorded as a failure).
    pub fn is_conflict(&self) -> bool {
        match self {
            ReconcileError::Store(StoreError::Conflict { .. }) => true,
            ReconcileError::Finalizer(f) => f.is_conflict(),
            _ => false,
        }
    }

    /// What a failed step records in its object's status: the failure (for the backoff and
    /// `describe`), the `Ready` reason, and one message for the condition and the event.
    pub fn recorded(&self) -> Recorded {
        let step = match self {
            ReconcileError::Backend { step, .. } => step.to_string(),
            ReconcileError::Store(_) | ReconcileError::Finalizer(_) => "store".into(),
        };
        let message = format!("{step} failed: {}", self.chain());
        Recorded {
            failure: boxery_api::vm::Failure {
                step,
                message: self.chain(),
                at: boxery_api::now(),
                terminal: self.is_terminal(),
            },
            reason: if self.is_terminal() {
                boxery_api::conditions::reasons::INVALID_REQUEST
            } else {
                boxery_api::conditions::reasons::STEP_FAILED
            },
            message,
        }
    }

    /// The whole cause chain in one line, for conditions and events.
    pub fn chain(&self) -> String {
        boxery_controller::error_chain(self)
    }
}

/// What a failed step writes into status (see [`ReconcileError::recorded`]).
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The failure, with its time and whether it is terminal.
    pub failure: boxery_api::vm::Failure,
    /// The `Ready` condition's reason: `InvalidRequest` or `StepFailed`.
    pub reason: &'static str,
    /// `STEP failed: CAUSE…`, for the condition and the Warning event.
    pub message: String,
}

impl boxery_controller::ReconcileError for ReconcileError {
    fn is_terminal(&self) -> bool {
        ReconcileError::is_terminal(self)
    }
}

impl From<boxery_controller::finalizer::Error<ReconcileError>> for ReconcileError {
    fn from(e: boxery_controller::finalizer::Error<ReconcileError>) -> Self {
        use boxery_controller::finalizer::Error;
        match e {
            Error::ApplyFailed(e) | Error::CleanupFailed(e) => e,
            Error::Finalizer(f) => ReconcileError::Finalizer(f),
        }
    }
}

//! Errors as Kubernetes `Status` bodies (`kind: Status`, `reason`, `code`, `details.causes`),
//! so clients tell a 404 from a 409 Conflict from a 422 Invalid and name the field.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use boxery_store::StoreError;
use boxery_verbs::{ErrorKind, VerbError};
use serde_json::{Value, json};

use crate::GROUP;

/// A failed request: an HTTP code, a Kubernetes reason and a message (plus what it was about).
#[derive(Debug, Clone)]
pub struct Failure {
    /// The HTTP status.
    pub code: StatusCode,
    /// `NotFound`, `AlreadyExists`, `Conflict`, `Invalid`, `Forbidden`, …
    pub reason: &'static str,
    /// What failed and what to do.
    pub message: String,
    /// `details`: name, group, kind and causes.
    pub details: Option<Value>,
}

impl Failure {
    /// A failure with no details.
    pub fn new(code: StatusCode, reason: &'static str, message: impl Into<String>) -> Failure {
        Failure {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }
    /// 400.
    pub fn bad_request(message: impl Into<String>) -> Failure {
        Failure::new(StatusCode::BAD_REQUEST, "BadRequest", message)
    }
    /// 404 of `plural/name`.
    pub fn not_found(plural: &str, name: &str) -> Failure {
        Failure::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("{plural}.{GROUP} \"{name}\" not found"),
        )
        .about(plural, name)
    }
    /// 403.
    pub fn forbidden(message: impl Into<String>) -> Failure {
        Failure::new(StatusCode::FORBIDDEN, "Forbidden", message)
    }
    /// 405.
    pub fn method_not_allowed(message: impl Into<String>) -> Failure {
        Failure::new(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", message)
    }
    /// 415.
    pub fn unsupported(message: impl Into<String>) -> Failure {
        Failure::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            message,
        )
    }

    /// Say which object it is about (`details.name`, `details.kind`), keeping any causes.
    pub fn about(mut self, plural: &str, name: &str) -> Failure {
        let mut d = self.details.take().unwrap_or_else(|| json!({}));
        d["group"] = json!(GROUP);
        d["kind"] = json!(plural);
        if !name.is_empty() {
            d["name"] = json!(name);
        }
        self.details = Some(d);
        self
    }

    /// The failure a verb's error is.
    pub fn from_verb(e: &VerbError) -> Failure {
        if let VerbError::Store(s) = e {
            return Failure::from_store(s);
        }
        let message = e.chain();
        match e.kind() {
            ErrorKind::Invalid => {
                Failure::new(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", message)
            }
            ErrorKind::Forbidden => Failure::forbidden(message),
            ErrorKind::NotFound => Failure::new(StatusCode::NOT_FOUND, "NotFound", message),
            ErrorKind::Conflict => Failure::new(StatusCode::CONFLICT, "Conflict", message),
            ErrorKind::NotReady => Failure::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                message,
            ),
            ErrorKind::Timeout => Failure::new(StatusCode::GATEWAY_TIMEOUT, "Timeout", message),
            ErrorKind::Cancelled | ErrorKind::Failed => {
                Failure::new(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", message)
            }
        }
    }

    /// The failure a store error is.
    pub fn from_store(e: &StoreError) -> Failure {
        let message = e.to_string();
        match e {
            StoreError::NotFound { plural, name, .. } => Failure::not_found(plural, name),
            StoreError::AlreadyExists { kind, name } => {
                let plural = plural_of(kind);
                Failure::new(
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    format!("{plural}.{GROUP} \"{name}\" already exists"),
                )
                .about(&plural, name)
            }
            StoreError::Conflict { kind, name, .. } | StoreError::BeingDeleted { kind, name } => {
                Failure::new(StatusCode::CONFLICT, "Conflict", message)
                    .about(&plural_of(kind), name)
            }
            StoreError::Invalid(v) => {
                let causes: Vec<Value> = v
                    .errors
                    .iter()
                    .map(|f| {
                        json!({"reason": "FieldValueInvalid", "message": f.message, "field": f.path})
                    })
                    .collect();
                let (kind, name) = v.object.split_once('/').unwrap_or((&v.object, ""));
                // as the Kubernetes API: an Invalid names the Kind, the others the resource
                let mut f = Failure::new(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", message)
                    .about(kind, name);
                if let Some(d) = f.details.as_mut() {
                    d["causes"] = json!(causes);
                }
                f
            }
            StoreError::FieldConflicts {
                object, conflicts, ..
            } => {
                let causes: Vec<Value> = conflicts
                    .iter()
                    .map(|c| {
                        json!({
                            "reason": "FieldManagerConflict",
                            "message": format!("conflict with \"{}\": {}", c.manager, c.field),
                            "field": format!(".{}", c.field),
                        })
                    })
                    .collect();
                let (kind, name) = object.split_once('/').unwrap_or((object, ""));
                let mut f = Failure::new(StatusCode::CONFLICT, "Conflict", message)
                    .about(&plural_of(kind), name);
                if let Some(d) = f.details.as_mut() {
                    d["causes"] = json!(causes);
                }
                f
            }
            StoreError::TooOld { .. } => Failure::new(StatusCode::GONE, "Expired", message),
            StoreError::Forbidden { .. } => Failure::forbidden(message),
            _ => Failure::new(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", message),
        }
    }

    /// The `Status` object.
    pub fn body(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": boxery_verbs::render::safe(&self.message),
            "reason": self.reason,
            "code": self.code.as_u16(),
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s
    }
}

/// The plural of a kind (`Vm` → `vms`), or the kind itself lowercased.
pub fn plural_of(kind: &str) -> String {
    boxery_api::lookup_kind(kind)
        .map(|k| k.plural.to_string())
        .unwrap_or_else(|| kind.to_ascii_lowercase())
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let mut r = crate::resources::json_reply(self.code, &self.body());
        if self.code == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"boxery\""),
            );
        }
        r
    }
}

impl From<VerbError> for Failure {
    fn from(e: VerbError) -> Failure {
        Failure::from_verb(&e)
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Failure {
        Failure::from_store(&e)
    }
}

/// The success `Status` of a delete that removed the object at once.
pub fn success(plural: &str, name: &str, uid: Option<&str>) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": {"name": name, "group": GROUP, "kind": plural, "uid": uid},
    })
}

//! What every resource handler starts from: the shared state, the authenticated caller, the
//! query's parameters and the headers, taken from a request in one extractor.

use std::sync::Arc;

use axum::extract::{FromRequestParts, Query};
use axum::http::HeaderMap;
use axum::http::request::Parts;

use crate::Shared;
use crate::query::Params;
use crate::status::Failure;
use crate::tokens::Caller;

/// A request to the API, as its handlers need it.
pub struct Call {
    /// The shared state.
    pub sh: Arc<Shared>,
    /// Who asks (set by the authentication layer).
    pub caller: Caller,
    /// The query's parameters.
    pub p: Params,
    /// `includeObject` of a Table request.
    pub include: Option<String>,
    /// The request's headers.
    pub headers: HeaderMap,
}

impl FromRequestParts<Arc<Shared>> for Call {
    type Rejection = Failure;

    async fn from_request_parts(parts: &mut Parts, sh: &Arc<Shared>) -> Result<Call, Failure> {
        let caller = parts.extensions.get::<Caller>().cloned().ok_or_else(|| {
            Failure::new(
                axum::http::StatusCode::UNAUTHORIZED,
                "Unauthorized",
                "no caller: the request was not authenticated",
            )
        })?;
        let bad = |e: axum::extract::rejection::QueryRejection| {
            Failure::bad_request(format!("the query: {e}"))
        };
        let Query(mut p) = Query::<Params>::try_from_uri(&parts.uri).map_err(bad)?;
        Ok(Call {
            sh: sh.clone(),
            caller,
            include: p.include_object.take(),
            p,
            headers: parts.headers.clone(),
        })
    }
}

//! HTTPS to one context's API: its CA only (no system roots), its bearer token, and errors
//! that say which context and server failed.

use std::time::Duration;

use boxery_store::StoreError;
use boxery_verbs::{Result, VerbError};

use crate::context::Context;

/// A client of one context's API. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    /// `https://HOST:PORT`.
    pub server: String,
    /// The context's name.
    pub name: String,
    token: String,
}

impl Client {
    /// A client for `ctx`.
    pub fn new(ctx: &Context) -> Result<Client> {
        let ca = reqwest::Certificate::from_pem(&ctx.ca_pem).map_err(|e| {
            VerbError::invalid(format!(
                "context {}: its certificate-authority-data is not a PEM certificate ({e}); add it again from `boxery kubeconfig`",
                ctx.name
            ))
        })?;
        let http = reqwest::Client::builder()
            .tls_built_in_root_certs(false)
            .add_root_certificate(ca)
            .https_only(true)
            .connect_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .user_agent(concat!("boxery/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| VerbError::failed(format!("cannot make an HTTPS client: {e}")))?;
        Ok(Client {
            http,
            server: ctx.server.clone(),
            name: ctx.name.clone(),
            token: ctx.token.clone(),
        })
    }

    /// A request to `path` on the server, with the token.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.server))
            .bearer_auth(&self.token)
    }

    /// The error of a request that did not get an answer.
    pub fn unreachable(&self, e: &reqwest::Error) -> StoreError {
        let mut why = e.to_string();
        let mut cur = std::error::Error::source(e);
        while let Some(c) = cur {
            why.push_str(": ");
            why.push_str(&c.to_string());
            cur = c.source();
        }
        StoreError::Unavailable {
            why: format!(
                "cannot reach the API of context {} at {} ({why}); is `boxery serve --api-listen` running there?",
                self.name, self.server
            ),
        }
    }

    /// The error of an answer that is not the store's: a Kubernetes `Status` (401, 403,
    /// 429, …) or anything else.
    pub async fn refused(&self, r: reqwest::Response) -> StoreError {
        let code = r.status();
        let message = Client::message(r).await;
        StoreError::Unavailable {
            why: format!(
                "the API of context {} at {} answered {}: {}",
                self.name,
                self.server,
                code.as_u16(),
                message
            ),
        }
    }

    /// The message of an answer that is not a success: a `Status`'s `message`, else the
    /// start of the body (made safe to print).
    pub async fn message(r: reqwest::Response) -> String {
        let body = r.text().await.unwrap_or_default();
        let message = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["message"].as_str().map(String::from))
            .unwrap_or_else(|| body.chars().take(300).collect());
        boxery_verbs::render::safe(&message).into_owned()
    }

    /// A verb's error for an answer of the API about one VM (connect, authorize): its own
    /// message, of the kind its status says.
    pub async fn vm_error(&self, r: reqwest::Response) -> VerbError {
        let code = r.status().as_u16();
        let kind = match code {
            400 => boxery_verbs::ErrorKind::Invalid,
            403 => boxery_verbs::ErrorKind::Forbidden,
            404 => boxery_verbs::ErrorKind::NotFound,
            409 | 503 => boxery_verbs::ErrorKind::NotReady,
            _ => return VerbError::from(self.refused(r).await),
        };
        VerbError::new(kind, Client::message(r).await)
    }
}

//! What each route allows: the LLM providers (their default upstream, the header their key
//! goes in, the methods and paths the proxy lets through), the edge hosts, and the checks on
//! a request's path. Pure functions: no I/O.

use axum::http::Method;

/// How a provider takes its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyHeader {
    /// `x-api-key: KEY` (Anthropic).
    XApiKey,
    /// `Authorization: Bearer KEY` (OpenAI and OpenAI-compatible servers, Ollama).
    Bearer,
}

/// An LLM provider the proxy knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provider {
    /// Its name: `/llm/NAME`, and a grant's target.
    pub name: String,
    /// Its base URL (no trailing slash).
    pub upstream: String,
    /// Where the real key goes.
    pub key: KeyHeader,
    /// The path prefixes allowed (each matches itself and what is below it).
    pub paths: &'static [&'static str],
}

const ANTHROPIC_PATHS: &[&str] = &["/v1/messages", "/v1/models", "/v1/complete"];
const OPENAI_PATHS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/models",
];
const OLLAMA_PATHS: &[&str] = &[
    "/api/chat",
    "/api/generate",
    "/api/embed",
    "/api/embeddings",
    "/api/tags",
    "/api/show",
    "/api/version",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
];

/// The built-in providers with their default upstreams.
pub const DEFAULTS: &[(&str, &str)] = &[
    ("anthropic", "https://api.anthropic.com"),
    ("openai", "https://api.openai.com"),
    ("ollama", "http://127.0.0.1:11434"),
];

/// The provider `name`, its upstream from `upstreams` (the config) or the default; a name
/// only the config lists is OpenAI-compatible. `None`: no such provider.
pub fn provider(
    name: &str,
    upstreams: &std::collections::BTreeMap<String, String>,
) -> Option<Provider> {
    let default = DEFAULTS.iter().find(|(n, _)| *n == name).map(|(_, u)| *u);
    let upstream = upstreams.get(name).map(String::as_str).or(default)?;
    let (key, paths) = match name {
        "anthropic" => (KeyHeader::XApiKey, ANTHROPIC_PATHS),
        "ollama" => (KeyHeader::Bearer, OLLAMA_PATHS),
        _ => (KeyHeader::Bearer, OPENAI_PATHS),
    };
    Some(Provider {
        name: name.to_string(),
        upstream: upstream.trim_end_matches('/').to_string(),
        key,
        paths,
    })
}

/// Methods an LLM route lets through.
pub fn llm_method(m: &Method) -> bool {
    m == Method::GET || m == Method::POST
}

/// Methods an edge route lets through (no CONNECT, TRACE).
pub fn edge_method(m: &Method) -> bool {
    [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::PATCH,
        Method::DELETE,
        Method::OPTIONS,
    ]
    .contains(m)
}

/// Whether an LLM path is a batch API's (`/v1/messages/batches…`, `/v1/batches…`): its
/// results are files, not answers the proxy can read usage from.
pub fn batch_path(rest: &str) -> bool {
    let path = rest.split('?').next().unwrap_or(rest);
    path.split('/').any(|seg| seg == "batches")
}

/// Whether `path` is `prefix` or below it.
pub fn under(path: &str, prefix: &str) -> bool {
    path.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// A route, parsed from the request's path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// `/llm/NAME/REST`.
    Llm {
        /// The provider's name.
        provider: String,
        /// The path at the provider.
        rest: String,
    },
    /// `/edge/HOST/REST`.
    Edge {
        /// `host[:port]`, lowercase.
        host: String,
        /// The path at the host.
        rest: String,
    },
}

/// Parse `path` into a route; `Err` says why it is not one. The rest of the path must be
/// plain: no `.`/`..` or empty segments, no encoded `/`, `\`, `.` — so an allowlisted prefix
/// means what it says at the upstream.
pub fn parse(path: &str) -> Result<Route, String> {
    let (kind, tail) = if let Some(t) = path.strip_prefix("/llm/") {
        ("llm", t)
    } else if let Some(t) = path.strip_prefix("/edge/") {
        ("edge", t)
    } else {
        return Err("no such route: the proxy serves /llm/PROVIDER/… and /edge/HOST/…".into());
    };
    let (first, rest) = match tail.find('/') {
        Some(i) => (&tail[..i], &tail[i..]),
        None => (tail, "/"),
    };
    if first.is_empty() {
        return Err(format!(
            "no {} after /{kind}/",
            if kind == "llm" { "provider" } else { "host" }
        ));
    }
    plain_path(rest)?;
    match kind {
        "llm" => {
            if !first
                .bytes()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'_')
            {
                return Err("a provider name is lowercase letters, digits, '-' and '_'".into());
            }
            Ok(Route::Llm {
                provider: first.to_string(),
                rest: rest.to_string(),
            })
        }
        _ => {
            let host = first.to_ascii_lowercase();
            let (name, port) = match host.rsplit_once(':') {
                Some((n, p)) => (n, Some(p)),
                None => (host.as_str(), None),
            };
            let name_ok = !name.is_empty()
                && name.len() <= 253
                && name.split('.').all(|l| {
                    !l.is_empty() && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
                });
            let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|p| p > 0));
            if !name_ok || !port_ok {
                return Err("the host after /edge/ is a DNS name with an optional :port".into());
            }
            Ok(Route::Edge {
                host,
                rest: rest.to_string(),
            })
        }
    }
}

fn plain_path(rest: &str) -> Result<(), String> {
    let lower = rest.to_ascii_lowercase();
    let bad_escape = ["%2f", "%5c", "%2e", "%00"]
        .iter()
        .any(|e| lower.contains(e));
    let segs: Vec<&str> = rest.strip_prefix('/').unwrap_or(rest).split('/').collect();
    let last = segs.len() - 1;
    let bad_segment = segs
        .iter()
        .enumerate()
        .any(|(i, s)| *s == "." || *s == ".." || (s.is_empty() && i != last));
    if bad_escape || bad_segment || rest.contains('\\') {
        return Err(
            "the path has '.', '..' or empty segments, or an encoded '/', '\\' or '.'".into(),
        );
    }
    Ok(())
}

/// Whether `rest` at `host` belongs to GitHub repository `repo` (`OWNER/REPO`): on
/// github.com its pages and git endpoints (`/OWNER/REPO`, `/OWNER/REPO.git/…`), on
/// api.github.com `/repos/OWNER/REPO/…`. Names compare case-insensitively, as GitHub's do.
pub fn github_path(host: &str, rest: &str, repo: &str) -> bool {
    let Some((owner, name)) = repo.split_once('/') else {
        return false;
    };
    let segs: Vec<&str> = rest.trim_start_matches('/').split('/').collect();
    let eq = |a: &str, b: &str| a.eq_ignore_ascii_case(b);
    match host {
        "github.com" => {
            segs.len() >= 2 && eq(segs[0], owner) && {
                let r = segs[1];
                eq(r, name) || r.strip_suffix(".git").is_some_and(|r| eq(r, name))
            }
        }
        "api.github.com" => {
            segs.len() >= 3 && segs[0] == "repos" && eq(segs[1], owner) && eq(segs[2], name)
        }
        _ => false,
    }
}

/// The hosts a `github` grant covers.
pub const GITHUB_HOSTS: &[&str] = &["github.com", "api.github.com"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_routes() {
        assert_eq!(
            parse("/llm/anthropic/v1/messages"),
            Ok(Route::Llm {
                provider: "anthropic".into(),
                rest: "/v1/messages".into()
            })
        );
        assert_eq!(
            parse("/edge/API.example.com:8443/x/y"),
            Ok(Route::Edge {
                host: "api.example.com:8443".into(),
                rest: "/x/y".into()
            })
        );
        assert_eq!(
            parse("/llm/openai"),
            Ok(Route::Llm {
                provider: "openai".into(),
                rest: "/".into()
            })
        );
        for bad in [
            "/",
            "/v1/messages",
            "/llm//v1",
            "/llm/Anthropic/v1",
            "/llm/anthropic/v1/../admin",
            "/llm/anthropic/v1/./messages",
            "/llm/anthropic/v1//messages",
            "/llm/anthropic/v1/%2e%2e/x",
            "/llm/anthropic/v1%2Fmessages",
            "/edge/a..b/x",
            "/edge/host:0/x",
            "/edge/host:99999/x",
            "/edge/ho_st/x",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        // A trailing slash is fine.
        assert!(parse("/edge/github.com/me/repo/").is_ok());
    }

    #[test]
    fn allowlists() {
        let p = provider("anthropic", &Default::default()).unwrap();
        assert!(p.paths.iter().any(|x| under("/v1/messages", x)));
        assert!(
            p.paths
                .iter()
                .any(|x| under("/v1/messages/count_tokens", x))
        );
        assert!(!p.paths.iter().any(|x| under("/v1/messagesX", x)));
        assert!(!p.paths.iter().any(|x| under("/v1/files", x)));
        assert_eq!(p.key, KeyHeader::XApiKey);
        assert!(provider("nope", &Default::default()).is_none());
        let cfg = [("local".to_string(), "http://127.0.0.1:1/".to_string())].into();
        let p = provider("local", &cfg).unwrap();
        assert_eq!(
            (p.upstream.as_str(), p.key),
            ("http://127.0.0.1:1", KeyHeader::Bearer)
        );
        assert!(llm_method(&Method::POST) && !llm_method(&Method::DELETE));
        assert!(!edge_method(&Method::CONNECT) && !edge_method(&Method::TRACE));
    }

    #[test]
    fn github_paths() {
        assert!(github_path(
            "github.com",
            "/me/repo.git/info/refs",
            "me/repo"
        ));
        assert!(github_path(
            "github.com",
            "/Me/Repo/git-upload-pack",
            "me/repo"
        ));
        assert!(github_path(
            "api.github.com",
            "/repos/me/repo/pulls",
            "me/repo"
        ));
        assert!(!github_path(
            "github.com",
            "/me/repo2.git/info/refs",
            "me/repo"
        ));
        assert!(!github_path("github.com", "/me", "me/repo"));
        assert!(!github_path("api.github.com", "/user", "me/repo"));
        assert!(!github_path("api.github.com", "/repos/me/other", "me/repo"));
        assert!(!github_path("example.com", "/me/repo", "me/repo"));
    }
}

//! Admission of a credential-proxy request, one step each: the route, no upgrade, the caller
//! (token, channel), the grants in force for the token's owner, then the route's own checks
//! (provider, grant, method, path; or edge host, grants, repositories) and the credentials to
//! inject. Nothing here sends anything upstream.

use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use boxery_api::grant::GrantType;
use boxery_home::grants::Entry;

use crate::audit::Record;
use crate::routes::{self, KeyHeader, Provider, Route};
use crate::token::token_of;
use crate::usage::Charge;
use crate::{Inner, Refusal, Served, refuse, secret};

/// What a request will do once admitted.
pub(crate) struct Plan {
    pub(crate) vm: String,
    pub(crate) grants: String,
    pub(crate) url: String,
    pub(crate) inject: Vec<(HeaderName, HeaderValue)>,
    /// An LLM request's charge: its response's usage is counted against it.
    pub(crate) charge: Option<Charge>,
}

/// A request whose caller is known: its VM, the grants in force for its token's owner, and
/// the path at the upstream.
struct Caller<'a> {
    p: &'a Inner,
    req: &'a Parts,
    vm: String,
    owner: String,
    entries: Vec<Entry>,
    rest: String,
}

/// Decide: route, token, grant, allowlists. Fills `rec` as it learns.
pub(crate) async fn admit(s: &Served, req: &Parts, rec: &mut Record) -> Result<Plan, Refusal> {
    let p = &s.proxy.inner;
    let route = routes::parse(req.uri.path()).map_err(|m| refuse(StatusCode::NOT_FOUND, m))?;
    no_upgrade(&req.headers)?;
    let (vm, owner) = caller(s, &req.headers)?;
    rec.vm = Some(vm.clone());
    // a request with the VM's own token is a use of the VM (spec.idle); a failed mark only
    // makes it look idle sooner
    let _ = boxery_home::activity::touch(&p.home, &vm);
    let entries = boxery_home::grants::read_state(&p.home, &vm)
        .into_iter()
        .filter(|e| e.owner() == owner)
        .collect();
    let asking = |rest: String| Caller {
        p,
        req,
        vm,
        owner: owner.clone(),
        entries,
        rest,
    };
    match route {
        Route::Llm { provider, rest } => {
            rec.route = Some("llm".into());
            rec.path = rest.clone();
            llm(asking(rest), rec, provider).await
        }
        Route::Edge { host, rest } => {
            rec.route = Some("edge".into());
            rec.host = Some(host.clone());
            rec.path = rest.clone();
            edge(asking(rest), rec, host).await
        }
    }
}

/// WebSocket and other upgrades are refused.
fn no_upgrade(h: &HeaderMap) -> Result<(), Refusal> {
    let upgrade = h.contains_key(header::UPGRADE)
        || h.get_all(header::CONNECTION).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.to_ascii_lowercase().contains("upgrade"))
        });
    if upgrade {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            "WebSocket and other upgrades are refused by the boxery proxy: use plain HTTP or SSE",
        ));
    }
    Ok(())
}

/// The VM and token owner the request's token belongs to, on this listener's channel.
fn caller(s: &Served, h: &HeaderMap) -> Result<(String, String), Refusal> {
    let Some((vm, owner)) = token_of(h).and_then(|t| s.proxy.inner.tokens.lookup(&t)) else {
        return Err(refuse(
            StatusCode::UNAUTHORIZED,
            "no or wrong token: send the VM's boxery token (BOXERY_TOKEN) as x-api-key, Authorization: Bearer or x-boxery-token",
        ));
    };
    if let Some(ch) = &s.channel
        && **ch != *vm
    {
        return Err(refuse(
            StatusCode::UNAUTHORIZED,
            "no or wrong token for this channel",
        ));
    }
    Ok((vm, owner))
}

/// `/llm/PROVIDER/REST`: the provider, its grant, its methods and paths, its key.
async fn llm(c: Caller<'_>, rec: &mut Record, provider: String) -> Result<Plan, Refusal> {
    let rest = &c.rest;
    let prov = known_provider(c.p, &provider)?;
    rec.host = Some(host_of(&prov.upstream));
    let vm = &c.vm;
    let Some(grant) = c
        .entries
        .iter()
        .find(|e| e.spec.type_ == GrantType::Llm && e.spec.target == provider)
    else {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            format!(
                "no llm grant for {provider} on VM {vm}: boxery grant {vm} llm:{provider} --from-env VARIABLE (or --from-file, --from-command), approved by a person"
            ),
        ));
    };
    rec.grant = Some(grant.name.clone());
    llm_allows(&c.req.method, &prov, rest)?;
    // Past a limit, nothing is resolved or sent.
    let limited = grant.spec.limits.is_some();
    if limited && routes::batch_path(rest) {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            format!(
                "{rest}: batch requests are not metered, so grant {} with limits refuses them (a grant without limits allows them)",
                grant.name
            ),
        ));
    }
    c.p.accounting.admit(grant)?;
    let value = resolve(c.p, grant).await?;
    let inject = match prov.key {
        KeyHeader::XApiKey => (HeaderName::from_static("x-api-key"), value),
        KeyHeader::Bearer => (header::AUTHORIZATION, bearer(&value)?),
    };
    Ok(Plan {
        grants: grant.name.clone(),
        url: format!("{}{}", prov.upstream, with_query(rest, c.req)),
        inject: vec![inject],
        // What a POST makes is charged (a GET of a stored answer is not charged again).
        charge: (c.req.method == axum::http::Method::POST).then(|| Charge {
            vm: c.vm.clone(),
            owner: c.owner.clone(),
            grant_uid: grant.uid.clone(),
            grant: grant.name.clone(),
            provider: provider.clone(),
            limited,
            generates: crate::usage::generates(rest),
        }),
        vm: c.vm,
    })
}

/// The provider `name`, built in or in the config.
fn known_provider(p: &Inner, name: &str) -> Result<Provider, Refusal> {
    routes::provider(name, &p.config.upstreams).ok_or_else(|| {
        let mut known: Vec<&str> = routes::DEFAULTS.iter().map(|(n, _)| *n).collect();
        known.extend(p.config.upstreams.keys().map(String::as_str));
        known.sort();
        known.dedup();
        refuse(
            StatusCode::NOT_FOUND,
            format!(
                "no LLM provider {name}: the proxy knows {} (more under proxy: upstreams: in config.yaml)",
                known.join(", ")
            ),
        )
    })
}

/// The provider's methods and paths.
fn llm_allows(method: &axum::http::Method, prov: &Provider, rest: &str) -> Result<(), Refusal> {
    let provider = &prov.name;
    if !routes::llm_method(method) {
        return Err(refuse(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{method} is not allowed on /llm/{provider}: GET and POST are"),
        ));
    }
    if !prov.paths.iter().any(|x| routes::under(rest, x)) {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            format!(
                "{rest} is not an allowed path of /llm/{provider}: allowed are {}",
                prov.paths.join(", ")
            ),
        ));
    }
    Ok(())
}

/// The grants an edge request may use: `http` grants on its host, and `github` grants (all
/// of them on a GitHub host, and those whose repository the path is in).
struct EdgeGrants<'a> {
    http: Vec<&'a Entry>,
    github: Vec<&'a Entry>,
    github_here: Vec<&'a Entry>,
}

impl<'a> EdgeGrants<'a> {
    fn pick(entries: &'a [Entry], host: &str, rest: &str) -> Self {
        let http = entries
            .iter()
            .filter(|e| e.spec.type_ == GrantType::Http && e.spec.target.eq_ignore_ascii_case(host))
            .collect();
        let on_github = routes::GITHUB_HOSTS.contains(&host);
        let github: Vec<&Entry> = entries
            .iter()
            .filter(|e| e.spec.type_ == GrantType::Github && on_github)
            .collect();
        let github_here = github
            .iter()
            .copied()
            .filter(|e| routes::github_path(host, rest, &e.spec.target))
            .collect();
        EdgeGrants {
            http,
            github,
            github_here,
        }
    }

    /// Why none applies.
    fn none(&self, vm: &str, host: &str, rest: &str) -> Refusal {
        refuse(
            StatusCode::FORBIDDEN,
            if self.github.is_empty() {
                format!(
                    "no http grant for {host} on VM {vm}: boxery grant {vm} http:{host} --header NAME --from-env VARIABLE, approved by a person"
                )
            } else {
                format!(
                    "{rest} on {host} is outside the repositories granted to VM {vm} ({})",
                    self.github
                        .iter()
                        .map(|e| e.spec.target.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            },
        )
    }
}

/// `/edge/HOST/REST`: the method, the grants on the host, their headers.
async fn edge(c: Caller<'_>, rec: &mut Record, host: String) -> Result<Plan, Refusal> {
    let rest = &c.rest;
    let method = &c.req.method;
    if !routes::edge_method(method) {
        return Err(refuse(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{method} is not allowed on /edge/"),
        ));
    }
    let grants = EdgeGrants::pick(&c.entries, &host, rest);
    if grants.http.is_empty() && grants.github_here.is_empty() {
        return Err(grants.none(&c.vm, &host, rest));
    }
    let (inject, names) = edge_headers(c.p, &grants, &host).await?;
    let base =
        c.p.config
            .hosts
            .get(&host)
            .map(|u| u.trim_end_matches('/').to_string())
            .unwrap_or_else(|| format!("https://{host}"));
    rec.grant = Some(names.join(","));
    Ok(Plan {
        vm: c.vm.clone(),
        grants: names.join(","),
        url: format!("{base}{}", with_query(rest, c.req)),
        inject,
        charge: None,
    })
}

/// The headers the edge grants add (each `http` grant's header; the first applicable
/// `github` grant's `Authorization`, replacing any other), and the grants used.
async fn edge_headers(
    p: &Inner,
    grants: &EdgeGrants<'_>,
    host: &str,
) -> Result<(Vec<(HeaderName, HeaderValue)>, Vec<String>), Refusal> {
    let mut inject = Vec::new();
    let mut names = Vec::new();
    for e in &grants.http {
        let Some(name) = e
            .spec
            .header
            .as_deref()
            .and_then(|n| HeaderName::try_from(n).ok())
        else {
            continue;
        };
        inject.push((name, resolve(p, e).await?));
        names.push(e.name.clone());
    }
    if let Some(e) = grants.github_here.first() {
        let auth = github_auth(p, e, host).await?;
        inject.retain(|(n, _)| *n != header::AUTHORIZATION);
        inject.push((header::AUTHORIZATION, auth));
        names.push(e.name.clone());
    }
    Ok((inject, names))
}

/// A `github` grant's `Authorization`: Basic `x-access-token` for git on github.com, a bearer
/// token for the API.
async fn github_auth(p: &Inner, e: &Entry, host: &str) -> Result<HeaderValue, Refusal> {
    let v = resolve(p, e).await?;
    if host != "github.com" {
        return bearer(&v);
    }
    use base64::Engine;
    let raw = format!("x-access-token:{}", v.to_str().unwrap_or_default());
    secret::header(&format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(raw)
    ))
    .map_err(|why| unavailable(e, why))
}

/// A grant's value, as a header value, resolved now.
async fn resolve(p: &Inner, e: &Entry) -> Result<HeaderValue, Refusal> {
    p.secrets
        .resolve(&e.spec.value_from)
        .await
        .map_err(|why| unavailable(e, why))
}

fn unavailable(e: &Entry, why: String) -> Refusal {
    refuse(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("grant {}: {why}", e.name),
    )
}

fn bearer(v: &HeaderValue) -> Result<HeaderValue, Refusal> {
    secret::header(&format!("Bearer {}", v.to_str().unwrap_or_default()))
        .map_err(|why| refuse(StatusCode::SERVICE_UNAVAILABLE, why))
}

fn with_query(rest: &str, req: &Parts) -> String {
    match req.uri.query() {
        Some(q) => format!("{rest}?{q}"),
        None => rest.to_string(),
    }
}

fn host_of(url: &str) -> String {
    url.split_once("://")
        .map(|(_, r)| r.split('/').next().unwrap_or(r))
        .unwrap_or(url)
        .to_string()
}

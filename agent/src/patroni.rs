//! Patroni REST API client: who leads the cluster, and who may lead it next.
//!
//! `Client::fetch_cluster` asks the first Patroni member that answers (`--patroni URL[,URL…]`)
//! for `GET {url}/cluster` and `parse_cluster` turns the document into a `Cluster`. The client
//! remembers the URL that answered last and asks it first next time, then the others in their
//! order: a dead first URL costs its timeout once, not every cycle (topology.rs keeps one
//! client for the process).
//!
//! The document is `patroni.utils.cluster_as_json` (Patroni 3.x and 4.x): `members[]` with
//! `name`, `role` (`leader`, `standby_leader`, `sync_standby`, `quorum_standby`, `replica`),
//! `state`, `api_url`, `host`/`port` (PostgreSQL's `connect_address`), `timeline`, `lag`
//! (bytes behind the leader, or the string `"unknown"`) and `tags`. Patroni publishes the
//! boolean tags only when they are set, so a `failover_priority` of 0 or less means "never
//! leader" just as `nofailover` does (Patroni 4's rule for an absent `nofailover`).
//!
//! The client is HTTP/1.1 over hyper's connection API on a tokio `TcpStream`, or for `https`
//! on the agent's own TLS code (tls.rs, as for `sslmode=verify-full`): the REST API's
//! certificate is verified against `patroni_cafile`, else the system's trust store, with its
//! host name; `patroni_certfile` and `patroni_keyfile` (the key may be in the certificate
//! file, as Patroni's own `ctl.certfile` allows) answer a REST API that asks for a client
//! certificate (`restapi.verify_client`). Files are read per request, so renewed ones need no
//! restart. Everything from the network
//! is bounded: each URL gets the whole `timeout` for resolve + connect + TLS + response, the
//! body is capped at `MAX_BODY`, any status but 200 and any malformed document are errors, and
//! the caller's `CancellationToken` ends the call at once. A URL's userinfo becomes a Basic
//! `Authorization` header; the password never appears in a message (`http://user:***@host`).

use std::fmt::{self, Write as _};
use std::io;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, LengthLimitError, Limited};
use hyper::header::{
    HeaderValue, ACCEPT, AUTHORIZATION, CONNECTION, CONTENT_LENGTH, HOST, USER_AGENT,
};
use hyper::{Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use percent_encoding::percent_decode_str;
use serde_json::{Map, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_postgres::config::Host;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::conninfo::{mask_userinfo, split_userinfo, HostSpec};
use crate::tls::{Failure, MakeTls, SslMode, TlsSettings, TlsStream};

/// The largest `/cluster` body accepted; a real one is a few hundred bytes per member.
pub const MAX_BODY: usize = 4 * 1024 * 1024;

/// A member's role as `/cluster` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// `leader`: the primary of a (non-standby) cluster.
    Leader,
    /// `replica`, `sync_standby` or `quorum_standby`.
    Replica,
    /// `standby_leader`: the member of a standby cluster that follows the remote primary.
    StandbyLeader,
    /// Anything else, as sent.
    Other(String),
}

impl Role {
    fn parse(role: &str) -> Role {
        match role {
            // "master"/"primary" never appear in /cluster, but cost nothing to accept.
            "leader" | "master" | "primary" => Role::Leader,
            "replica" | "sync_standby" | "quorum_standby" => Role::Replica,
            "standby_leader" => Role::StandbyLeader,
            other => Role::Other(other.to_string()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            Role::Leader => "leader",
            Role::Replica => "replica",
            Role::StandbyLeader => "standby_leader",
            Role::Other(role) => role,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One entry of `/cluster`'s `members`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    pub role: Role,
    /// `running`, `streaming`, `stopped`, `starting`, … (empty when absent).
    pub state: String,
    /// PostgreSQL's host (`postgresql.connect_address`).
    pub host: Option<String>,
    pub port: Option<u16>,
    pub api_url: Option<String>,
    pub timeline: Option<u32>,
    /// Bytes behind the leader; None when unknown (or for the leader itself).
    pub lag_bytes: Option<u64>,
    pub nofailover: bool,
    /// Default 1; 0 or less means never leader (Patroni 4).
    pub failover_priority: i64,
    pub noloadbalance: bool,
}

impl Member {
    /// Why this member can never be promoted (tags), if it cannot.
    fn never_leader(&self) -> Option<&'static str> {
        if self.nofailover {
            Some("nofailover")
        } else if self.failover_priority <= 0 {
            Some("failover_priority 0")
        } else {
            None
        }
    }

    /// Why the agent could not connect to this member's PostgreSQL, if it could not.
    fn unreachable(&self) -> Option<&'static str> {
        if self.host.is_none() {
            Some("no host")
        } else if self.port.is_none() {
            Some("no port")
        } else {
            None
        }
    }
}

/// The cluster as one Patroni member sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    pub members: Vec<Member>,
    /// The base URL that answered, password masked.
    pub source: String,
}

impl Cluster {
    /// The primary: the member with role `leader`. A standby cluster's `standby_leader` is not
    /// a primary, so such a cluster has none.
    pub fn leader(&self) -> Option<&Member> {
        self.members.iter().find(|m| m.role == Role::Leader)
    }

    /// Members that may become leader, best first: replicas (not the leader) that are not
    /// nofailover and have failover_priority > 0 (unless include_nofailover), ordered by
    /// failover_priority desc, then lag asc (unknown lag last), then name. Members without
    /// host/port are left out.
    pub fn candidates(&self, include_nofailover: bool) -> Vec<&Member> {
        let mut found: Vec<&Member> = self
            .replicas()
            .filter(|m| exclusion(m, include_nofailover).is_none())
            .collect();
        found.sort_by(|a, b| {
            b.failover_priority
                .cmp(&a.failover_priority)
                .then_with(|| a.lag_bytes.is_none().cmp(&b.lag_bytes.is_none()))
                .then_with(|| a.lag_bytes.cmp(&b.lag_bytes))
                .then_with(|| a.name.cmp(&b.name))
        });
        found
    }

    /// Members left out and why ("nofailover", "failover_priority 0", "no host", "no port",
    /// "not a replica"), for logs/status. The leader and a standby leader are not listed.
    pub fn excluded(&self, include_nofailover: bool) -> Vec<(&Member, &'static str)> {
        let odd_roles = self
            .members
            .iter()
            .filter(|m| matches!(m.role, Role::Other(_)))
            .map(|m| (m, "not a replica"));
        let replicas = self
            .replicas()
            .filter_map(|m| exclusion(m, include_nofailover).map(|why| (m, why)));
        odd_roles.chain(replicas).collect()
    }

    fn replicas(&self) -> impl Iterator<Item = &Member> {
        self.members.iter().filter(|m| m.role == Role::Replica)
    }
}

fn exclusion(member: &Member, include_nofailover: bool) -> Option<&'static str> {
    let tags = if include_nofailover {
        None
    } else {
        member.never_leader()
    };
    tags.or_else(|| member.unreachable())
}

/// TLS for `https` URLs, after Patroni's own client settings (`ctl.cacert`, `ctl.certfile`,
/// `ctl.keyfile`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// The CA file the REST API's certificate is verified against (None: the system's).
    pub cafile: Option<PathBuf>,
    /// A client certificate for a REST API that asks for one.
    pub certfile: Option<PathBuf>,
    /// Its key (None: in the certificate file); 0600, or 0640 owned by root, as libpq asks.
    pub keyfile: Option<PathBuf>,
}

impl ClientTls {
    /// The connector for `host`, as `sslmode=verify-full` makes it. Files are read now.
    fn connector(&self, host: &str, port: u16) -> Result<MakeTls, String> {
        if let Some(cert) = &self.certfile {
            // libpq skips a missing certificate file; a configured one must be there.
            std::fs::metadata(cert).map_err(|e| {
                format!(
                    "could not read certificate file \"{}\": {e}",
                    cert.display()
                )
            })?;
        }
        let settings = TlsSettings {
            mode: SslMode::VerifyFull,
            rootcert: Some(match &self.cafile {
                Some(file) => file.display().to_string(),
                None => "system".to_string(),
            }),
            cert: self.certfile.clone(),
            key: self.keyfile.clone().or_else(|| self.certfile.clone()),
            sni: true,
            home: None,
        };
        let host = HostSpec {
            host: Some(Host::Tcp(host.to_string())),
            hostaddr: None,
            port,
        };
        settings
            .connector_with_alpn(&host, b"http/1.1")
            .map_err(|e| patroni_words(&e.to_string()))
    }
}

/// tls.rs speaks of libpq's keys; here the keys are the agent's.
fn patroni_words(message: &str) -> String {
    message.replace("(sslrootcert=system)", "(patroni_cafile not set)")
}

/// Errors of this module. Every message is complete in itself (no `source()`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatroniError {
    #[error("no Patroni REST API URL given")]
    NoUrls,
    #[error("invalid Patroni REST API URL \"{url}\": {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("invalid /cluster document from {url}: {reason}")]
    InvalidDocument { url: String, reason: String },
    /// Every URL failed; one "url: reason" per URL, in the order tried.
    #[error("could not get the cluster state from Patroni: {}", .0.join("; "))]
    Unreachable(Vec<String>),
    #[error("cancelled")]
    Cancelled,
}

/// Parse a `/cluster` document; `source` is the URL it came from (kept in `Cluster::source`,
/// password masked).
pub fn parse_cluster(body: &[u8], source: &str) -> Result<Cluster, PatroniError> {
    let source = mask_url(source);
    match parse_members(body) {
        Ok(members) => Ok(Cluster { members, source }),
        Err(reason) => Err(PatroniError::InvalidDocument {
            url: source,
            reason,
        }),
    }
}

/// Check a `--patroni` URL without using it (for configuration checks at startup).
pub fn validate_url(url: &str) -> Result<(), PatroniError> {
    Target::parse(url)
        .map(|_| ())
        .map_err(|reason| PatroniError::InvalidUrl {
            url: mask_url(url),
            reason,
        })
}

/// A Patroni client that remembers which URL answered last (one per process: topology.rs).
///
/// Patroni's members all serve the same `/cluster`, so any one that answers will do; asking
/// the one that answered last first means a member that is down (the first URL, say) is not
/// waited on every cycle, only when the one that answered stops answering.
#[derive(Debug, Default)]
pub struct Client {
    /// The URL, as configured, that answered last; None before any answer.
    last_answered: Mutex<Option<String>>,
}

impl Client {
    pub const fn new() -> Self {
        Client {
            last_answered: Mutex::new(None),
        }
    }

    /// Asks the URL that answered last, then the others in order, for `/cluster` (see
    /// `fetch_in_order`); the one that answers is asked first next time.
    pub async fn fetch_cluster(
        &self,
        urls: &[String],
        tls: &ClientTls,
        timeout: Duration,
        cancel: &CancellationToken,
    ) -> Result<Cluster, PatroniError> {
        self.fetch_cluster_limited(urls, tls, timeout, cancel, MAX_BODY)
            .await
    }

    async fn fetch_cluster_limited(
        &self,
        urls: &[String],
        tls: &ClientTls,
        timeout: Duration,
        cancel: &CancellationToken,
        limit: usize,
    ) -> Result<Cluster, PatroniError> {
        let last = self.lock().clone();
        let order = last_first(urls, last.as_deref());
        let (answered, cluster) = fetch_in_order(&order, tls, timeout, cancel, limit).await?;
        if last.as_deref() != Some(answered.as_str()) {
            debug!(url = %mask_url(&answered), "asking this Patroni REST API first from now on");
            *self.lock() = Some(answered);
        }
        Ok(cluster)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        // A poisoned lock still holds a URL, or None: either is a fine first guess.
        self.last_answered.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `urls` with `first` (if it is one of them) moved to the front, the others in their order.
fn last_first<'a>(urls: &'a [String], first: Option<&str>) -> Vec<&'a String> {
    let lead = first.and_then(|first| urls.iter().position(|url| url == first));
    let rest = urls
        .iter()
        .enumerate()
        .filter(move |(i, _)| Some(*i) != lead)
        .map(|(_, url)| url);
    lead.map(|i| &urls[i]).into_iter().chain(rest).collect()
}

/// Asks the URLs in the order given for `/cluster`; the first 200 with a valid document wins,
/// and the URL that answered comes with it. Each URL gets `timeout` in all; the failures of
/// every URL, in the order tried, make up the error when none answers.
async fn fetch_in_order(
    urls: &[&String],
    tls: &ClientTls,
    timeout: Duration,
    cancel: &CancellationToken,
    limit: usize,
) -> Result<(String, Cluster), PatroniError> {
    if urls.is_empty() {
        return Err(PatroniError::NoUrls);
    }
    let mut failures = Vec::with_capacity(urls.len());
    for &url in urls {
        if cancel.is_cancelled() {
            return Err(PatroniError::Cancelled);
        }
        let outcome = tokio::select! {
            biased;
            _ = cancel.cancelled() => return Err(PatroniError::Cancelled),
            outcome = try_url(url, tls, timeout, limit) => outcome,
        };
        match outcome {
            Ok(cluster) => return Ok((url.clone(), cluster)),
            Err(failure) => {
                debug!(%failure, "Patroni REST API did not answer");
                failures.push(failure);
            }
        }
    }
    Err(PatroniError::Unreachable(failures))
}

/// One URL, start to end; the error is "url: reason".
async fn try_url(
    url: &str,
    tls: &ClientTls,
    timeout: Duration,
    limit: usize,
) -> Result<Cluster, String> {
    let target =
        Target::parse(url).map_err(|reason| format!("{}: invalid URL: {reason}", mask_url(url)))?;
    let body = match tokio::time::timeout(timeout, get(&target, tls, limit)).await {
        Ok(result) => result,
        Err(_) => Err(format!(
            "timed out after {}",
            humantime::format_duration(timeout)
        )),
    }
    .map_err(|reason| format!("{}: {reason}", target.shown))?;
    parse_cluster(&body, &target.shown).map_err(|error| match error {
        PatroniError::InvalidDocument { url, reason } => {
            format!("{url}: invalid /cluster document: {reason}")
        }
        other => format!("{}: {other}", target.shown),
    })
}

// ---------------------------------------------------------------------------------------------
// URLs

/// A parsed `--patroni` URL, ready to request `/cluster` from.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    tls: bool,
    /// Host name or IP address, without IPv6 brackets.
    host: String,
    port: u16,
    /// The authority without userinfo, for the Host header.
    host_header: String,
    /// The request path: the URL's path without trailing slashes, then `/cluster`.
    path: String,
    /// `Basic …` when the URL has userinfo.
    authorization: Option<String>,
    /// The base URL for messages: no trailing slash, password masked.
    shown: String,
}

impl Target {
    /// Parses with `http::Uri` (RFC 3986). Messages never quote the URL's authority, which may
    /// hold a password; the caller names the URL through `mask_url`.
    fn parse(url: &str) -> Result<Target, String> {
        let url = url.trim();
        let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        if rest[..authority_end].matches('@').count() > 1 || rest[authority_end..].contains('@') {
            // RFC 3986 would end the user info elsewhere than its writer meant (and than
            // mask_url does), sending part of the password as the host or the path.
            return Err(
                "a \"/\", \"?\", \"#\" or \"@\" in the user name or password must be \
                        percent-encoded"
                    .to_string(),
            );
        }
        if rest.contains(['?', '#']) {
            return Err("a query or fragment is not supported".to_string());
        }
        let uri: Uri = url
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| format!("not a valid URL ({e})"))?;
        let tls = match uri.scheme_str() {
            Some(s) if s.eq_ignore_ascii_case("http") => false,
            Some(s) if s.eq_ignore_ascii_case("https") => true,
            Some(other) => {
                return Err(format!(
                    "unsupported scheme \"{other}\" (expected http or https)"
                ))
            }
            None => return Err("expected http://host:port or https://host:port".to_string()),
        };
        let authority = uri
            .authority()
            .ok_or_else(|| "missing host name".to_string())?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        if host.is_empty() {
            return Err("missing host name".to_string());
        }
        let (userinfo, host_header) = match authority.as_str().rsplit_once('@') {
            Some((userinfo, hostport)) => (Some(userinfo), hostport),
            None => (None, authority.as_str()),
        };
        // Read here, not with port_u16(), which takes a port above 65535 for none at all.
        let port_text = match host_header.rfind(']') {
            Some(bracket) => host_header[bracket + 1..].strip_prefix(':'),
            None => host_header.rsplit_once(':').map(|(_, port)| port),
        };
        let port = match port_text {
            None | Some("") => {
                if tls {
                    443
                } else {
                    80
                }
            }
            Some(text) => match text.parse::<u16>() {
                Ok(port) if port != 0 => port,
                _ => return Err("invalid port (expected a number from 1 to 65535)".to_string()),
            },
        };
        let base_path = uri.path().trim_end_matches('/');
        let scheme = if tls { "https" } else { "http" };
        Ok(Target {
            tls,
            host: host.to_string(),
            port,
            host_header: host_header.to_string(),
            path: format!("{base_path}/cluster"),
            authorization: userinfo.map(basic_authorization),
            shown: format!(
                "{scheme}://{}{host_header}{base_path}",
                userinfo
                    .map(|u| format!("{}@", mask_userinfo(u, MASK)))
                    .unwrap_or_default()
            ),
        })
    }
}

/// What stands for a password in messages.
const MASK: &str = "***";

/// The URL with its password (if any) replaced by `***`; safe to log. The user info is read
/// as `conninfo::split_userinfo` reads it, so a password holding "/", "?", "#" or "@" is
/// hidden whole (such a URL is refused by `Target::parse` anyway).
pub fn mask_url(url: &str) -> String {
    let (prefix, rest) = url.split_at(url.find("://").map_or(0, |at| at + 3));
    match split_userinfo(rest) {
        Some((userinfo, after)) => format!("{prefix}{}@{after}", mask_userinfo(userinfo, MASK)),
        None => url.to_string(),
    }
}

/// `Basic base64(user:password)`, both percent-decoded.
fn basic_authorization(userinfo: &str) -> String {
    let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
    let mut credentials: Vec<u8> = percent_decode_str(user).collect();
    credentials.push(b':');
    credentials.extend(percent_decode_str(password));
    format!("Basic {}", BASE64.encode(credentials))
}

// ---------------------------------------------------------------------------------------------
// HTTP

/// GET the target's `/cluster` and return the body of a 200 response.
async fn get(target: &Target, tls: &ClientTls, limit: usize) -> Result<Bytes, String> {
    let tcp = connect(&target.host, target.port).await?;
    if target.tls {
        let tls = tls_handshake(target, tcp, tls).await?;
        exchange(tls, target, limit).await
    } else {
        exchange(tcp, target, limit).await
    }
}

async fn connect(host: &str, port: u16) -> Result<TcpStream, String> {
    let addresses = tokio::net::lookup_host((host, port)).await.map_err(|e| {
        format!(
            "could not resolve host name \"{host}\": {}",
            describe_io(&e)
        )
    })?;
    let mut last_error = None;
    for address in addresses {
        match TcpStream::connect(address).await {
            Ok(stream) => {
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Err(e) => last_error = Some(e),
        }
    }
    Err(match last_error {
        Some(e) => describe_io(&e),
        None => format!("host name \"{host}\" resolved to no address"),
    })
}

/// The TLS session, or why not in libpq's words ("certificate verify failed: ...").
async fn tls_handshake(
    target: &Target,
    tcp: TcpStream,
    tls: &ClientTls,
) -> Result<TlsStream<TcpStream>, String> {
    let mut make = tls.connector(&target.host, target.port)?;
    let connector = <MakeTls as MakeTlsConnect<TcpStream>>::make_tls_connect(&mut make, "")
        .map_err(|e| format!("could not set up TLS: {e}"))?;
    match connector.connect(tcp).await {
        Ok(stream) => Ok(stream),
        Err(e) => Err(patroni_words(&match make.failure() {
            Some(Failure::Verify(reason)) => format!("certificate verify failed: {reason}"),
            Some(Failure::Setup(reason)) => reason,
            None => format!("TLS handshake failed: {}", describe_io(&e)),
        })),
    }
}

/// Aborts the connection task when the request is over, finished or dropped (timeout).
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One request on a fresh connection: status must be 200, body at most `limit` bytes.
async fn exchange<S>(stream: S, target: &Target, limit: usize) -> Result<Bytes, String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
            .await
            .map_err(|e| describe_error(&e))?;
    let _driver = AbortOnDrop(tokio::spawn(async move {
        let _ = connection.await;
    }));
    let response = sender
        .send_request(request(target)?)
        .await
        .map_err(|e| describe_error(&e))?;
    if response.status() != StatusCode::OK {
        return Err(format!("HTTP status {}", response.status()));
    }
    let declared = response
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(too_large(limit));
    }
    match Limited::new(response.into_body(), limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large(limit)),
        Err(e) => Err(format!(
            "could not read the response: {}",
            describe_error(&*e)
        )),
    }
}

fn request(target: &Target) -> Result<Request<Empty<Bytes>>, String> {
    let mut builder = Request::get(target.path.as_str())
        .header(HOST, target.host_header.as_str())
        .header(ACCEPT, "application/json")
        .header(USER_AGENT, concat!("ccm-agent/", env!("CARGO_PKG_VERSION")))
        .header(CONNECTION, "close");
    if let Some(credentials) = &target.authorization {
        let mut value = HeaderValue::from_str(credentials)
            .map_err(|_| "invalid user name or password".to_string())?;
        value.set_sensitive(true);
        builder = builder.header(AUTHORIZATION, value);
    }
    builder
        .body(Empty::new())
        .map_err(|e| format!("could not build the request: {e}"))
}

fn too_large(limit: usize) -> String {
    if limit.is_multiple_of(1024 * 1024) {
        format!("response too large (over {} MiB)", limit / (1024 * 1024))
    } else {
        format!("response too large (over {limit} bytes)")
    }
}

/// An io::Error as a lowercase phrase without "(os error N)".
fn describe_io(error: &io::Error) -> String {
    match error.kind() {
        io::ErrorKind::ConnectionRefused => "connection refused".to_string(),
        io::ErrorKind::ConnectionReset => "connection reset by peer".to_string(),
        io::ErrorKind::TimedOut => "connection timed out".to_string(),
        _ => {
            let text = error.to_string();
            let text = match text.find(" (os error ") {
                Some(at) => text[..at].to_string(),
                None => text,
            };
            lowercase_first(&text)
        }
    }
}

/// An error and its causes, "outer: inner: …", skipping repeats (hyper's errors).
fn describe_error(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = lowercase_first(&error.to_string());
    let mut cause = error.source();
    while let Some(inner) = cause {
        let part = match inner.downcast_ref::<io::Error>() {
            Some(io_error) => describe_io(io_error),
            None => lowercase_first(&inner.to_string()),
        };
        if !text.contains(&part) {
            let _ = write!(text, ": {part}");
        }
        cause = inner.source();
    }
    text
}

fn lowercase_first(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        // Keep acronyms such as "TLS" or "HTTP" as they are.
        Some(first) if !chars.next().is_some_and(|c| c.is_uppercase()) => first
            .to_lowercase()
            .chain(text[first.len_utf8()..].chars())
            .collect(),
        _ => text.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// The /cluster document

fn parse_members(body: &[u8]) -> Result<Vec<Member>, String> {
    let document: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let members = document
        .as_object()
        .ok_or("expected a JSON object")?
        .get("members")
        .ok_or("no \"members\" list")?
        .as_array()
        .ok_or("\"members\" is not a list")?;
    members
        .iter()
        .enumerate()
        .map(|(i, value)| parse_member(value).map_err(|e| format!("member {}: {e}", i + 1)))
        .collect()
}

fn parse_member(value: &Value) -> Result<Member, String> {
    let fields = value.as_object().ok_or("expected a JSON object")?;
    let name = match fields.get("name") {
        Some(Value::String(name)) if !name.is_empty() => name.clone(),
        _ => return Err("no name".to_string()),
    };
    let text = |key: &str| fields.get(key).and_then(Value::as_str).map(str::to_string);
    let empty = Map::new();
    let tags = fields
        .get("tags")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    Ok(Member {
        role: Role::parse(text("role").as_deref().unwrap_or("")),
        state: text("state").unwrap_or_default(),
        host: text("host").filter(|h| !h.is_empty()),
        port: fields
            .get("port")
            .and_then(as_u64)
            .and_then(|p| u16::try_from(p).ok())
            .filter(|&p| p != 0),
        api_url: text("api_url"),
        timeline: fields
            .get("timeline")
            .and_then(as_u64)
            .and_then(|t| u32::try_from(t).ok()),
        lag_bytes: fields.get("lag").and_then(as_u64),
        nofailover: tags.get("nofailover").is_some_and(truthy),
        failover_priority: tags.get("failover_priority").and_then(as_i64).unwrap_or(1),
        noloadbalance: tags.get("noloadbalance").is_some_and(truthy),
        name,
    })
}

/// A non-negative integer given as a number or a numeric string ("unknown" → None). A
/// negative lag (a replica ahead of the leader's last known position) counts as 0.
fn as_u64(value: &Value) -> Option<u64> {
    as_i64(value).map(|n| u64::try_from(n).unwrap_or(0))
}

fn as_i64(value: &Value) -> Option<i64> {
    match value {
        Value::Number(n) => n.as_i64().or_else(|| {
            n.as_f64()
                .filter(|f| f.is_finite() && f.fract() == 0.0 && f.abs() < 9.0e18)
                .map(|f| f as i64)
        }),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// A tag's truth: booleans, numbers, and the strings PostgreSQL and YAML take for booleans;
/// any other non-empty string is true, as Python's `bool()` says.
fn truthy(value: &Value) -> bool {
    match value {
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !matches!(
            s.trim().to_ascii_lowercase().as_str(),
            "" | "false" | "f" | "no" | "n" | "off" | "0"
        ),
        Value::Null => false,
        Value::Array(items) => !items.is_empty(),
        Value::Object(fields) => !fields.is_empty(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::mpsc;

    /// Patroni 3.0.x: three members, synchronous mode, one nofailover replica.
    const PATRONI_3_0: &str = r#"{
      "members": [
        {"name": "pg-a", "role": "leader", "state": "running",
         "api_url": "http://10.0.0.11:8008/patroni", "host": "10.0.0.11", "port": 5432,
         "timeline": 4},
        {"name": "pg-b", "role": "sync_standby", "state": "streaming",
         "api_url": "http://10.0.0.12:8008/patroni", "host": "10.0.0.12", "port": 5432,
         "timeline": 4, "lag": 0},
        {"name": "pg-c", "role": "replica", "state": "streaming",
         "api_url": "http://10.0.0.13:8008/patroni", "host": "10.0.0.13", "port": 5432,
         "timeline": 4, "tags": {"nofailover": true, "noloadbalance": true}, "lag": 16384}
      ],
      "scope": "batman"
    }"#;

    /// Patroni 4.0.x: quorum commit, failover priorities, an unknown lag, a stopped member,
    /// a pending restart and a scheduled switchover.
    const PATRONI_4: &str = r#"{
      "members": [
        {"name": "node1", "role": "leader", "state": "running",
         "api_url": "https://node1.db.internal:8008/patroni", "host": "node1.db.internal",
         "port": 5432, "timeline": 7, "pending_restart": true,
         "pending_restart_reason": {"max_connections": {"old_value": "100", "new_value": "200"}},
         "tags": {"failover_priority": 3}},
        {"name": "node2", "role": "quorum_standby", "state": "streaming",
         "api_url": "https://node2.db.internal:8008/patroni", "host": "node2.db.internal",
         "port": 5432, "timeline": 7, "tags": {"failover_priority": 2},
         "receive_lag": 0, "receive_lsn": "0/5000148", "replay_lag": 1024,
         "replay_lsn": "0/4FFFD48", "lag": 1024, "lsn": "0/4FFFD48"},
        {"name": "node3", "role": "quorum_standby", "state": "streaming",
         "api_url": "https://node3.db.internal:8008/patroni", "host": "node3.db.internal",
         "port": 5433, "timeline": 7, "tags": {"failover_priority": 2},
         "receive_lag": 0, "receive_lsn": "0/5000148", "replay_lag": 0,
         "replay_lsn": "0/5000148", "lag": 0, "lsn": "0/5000148"},
        {"name": "node4", "role": "replica", "state": "stopped",
         "api_url": "https://node4.db.internal:8008/patroni", "host": "node4.db.internal",
         "port": 5432, "tags": {"failover_priority": 0},
         "receive_lag": "unknown", "receive_lsn": "unknown", "replay_lag": "unknown",
         "replay_lsn": "unknown", "lag": "unknown", "lsn": "unknown"},
        {"name": "node5", "role": "replica", "state": "starting",
         "api_url": "https://node5.db.internal:8008/patroni", "host": "node5.db.internal",
         "port": 5432, "receive_lag": "unknown", "receive_lsn": "unknown",
         "replay_lag": "unknown", "replay_lsn": "unknown", "lag": "unknown", "lsn": "unknown"}
      ],
      "scope": "orders",
      "pause": true,
      "scheduled_switchover": {"at": "2025-03-01T03:00:00+00:00", "from": "node1", "to": "node3"}
    }"#;

    /// A standby cluster (Patroni 4): its leader is a standby_leader.
    const STANDBY_CLUSTER: &str = r#"{
      "members": [
        {"name": "dr1", "role": "standby_leader", "state": "streaming",
         "api_url": "http://dr1:8008/patroni", "host": "dr1", "port": 5432, "timeline": 7},
        {"name": "dr2", "role": "replica", "state": "streaming",
         "api_url": "http://dr2:8008/patroni", "host": "dr2", "port": 5432, "timeline": 7,
         "receive_lag": 0, "receive_lsn": "0/5000148", "replay_lag": 0,
         "replay_lsn": "0/5000148", "lag": 0, "lsn": "0/5000148"}
      ],
      "scope": "orders-dr"
    }"#;

    fn names(members: &[&Member]) -> Vec<String> {
        members.iter().map(|m| m.name.clone()).collect()
    }

    fn reasons(cluster: &Cluster, include_nofailover: bool) -> Vec<String> {
        cluster
            .excluded(include_nofailover)
            .iter()
            .map(|(m, why)| format!("{}={why}", m.name))
            .collect()
    }

    #[test]
    fn parses_patroni_3_0() {
        let cluster = parse_cluster(PATRONI_3_0.as_bytes(), "http://pg-a:8008").unwrap();
        assert_eq!(cluster.source, "http://pg-a:8008");
        assert_eq!(cluster.members.len(), 3);
        let leader = cluster.leader().unwrap();
        assert_eq!(leader.name, "pg-a");
        assert_eq!(leader.host.as_deref(), Some("10.0.0.11"));
        assert_eq!(leader.port, Some(5432));
        assert_eq!(leader.timeline, Some(4));
        assert_eq!(leader.lag_bytes, None);
        assert_eq!(leader.failover_priority, 1);
        let b = &cluster.members[1];
        assert_eq!(b.role, Role::Replica);
        assert_eq!(b.state, "streaming");
        assert_eq!(b.lag_bytes, Some(0));
        assert_eq!(b.api_url.as_deref(), Some("http://10.0.0.12:8008/patroni"));
        let c = &cluster.members[2];
        assert!(c.nofailover && c.noloadbalance);
        assert_eq!(c.lag_bytes, Some(16384));
        assert_eq!(names(&cluster.candidates(false)), ["pg-b"]);
        assert_eq!(reasons(&cluster, false), ["pg-c=nofailover"]);
        assert_eq!(names(&cluster.candidates(true)), ["pg-b", "pg-c"]);
        assert!(cluster.excluded(true).is_empty());
    }

    #[test]
    fn parses_patroni_4() {
        let cluster =
            parse_cluster(PATRONI_4.as_bytes(), "https://node1.db.internal:8008").unwrap();
        assert_eq!(cluster.leader().unwrap().name, "node1");
        assert_eq!(cluster.leader().unwrap().failover_priority, 3);
        let node2 = &cluster.members[1];
        assert_eq!(
            (node2.role.clone(), node2.lag_bytes),
            (Role::Replica, Some(1024))
        );
        assert_eq!(node2.failover_priority, 2);
        let node4 = &cluster.members[3];
        assert_eq!(
            (node4.state.as_str(), node4.lag_bytes, node4.timeline),
            ("stopped", None, None)
        );
        // Priority first (node2, node3 before node5), then lag (node3 before node2).
        assert_eq!(
            names(&cluster.candidates(false)),
            ["node3", "node2", "node5"]
        );
        assert_eq!(reasons(&cluster, false), ["node4=failover_priority 0"]);
        // Included on request, last: priority 0, then unknown lag.
        assert_eq!(
            names(&cluster.candidates(true)),
            ["node3", "node2", "node5", "node4"]
        );
    }

    #[test]
    fn standby_cluster_has_no_primary() {
        let cluster = parse_cluster(STANDBY_CLUSTER.as_bytes(), "http://dr1:8008").unwrap();
        assert_eq!(cluster.leader(), None);
        assert_eq!(cluster.members[0].role, Role::StandbyLeader);
        assert_eq!(names(&cluster.candidates(false)), ["dr2"]);
        assert!(cluster.excluded(false).is_empty());
    }

    #[test]
    fn unknown_lag_sorts_last_then_name() {
        let body = r#"{"members": [
            {"name": "z", "role": "replica", "state": "streaming", "host": "z", "port": 5432, "lag": "unknown"},
            {"name": "y", "role": "replica", "state": "streaming", "host": "y", "port": 5432},
            {"name": "b", "role": "replica", "state": "streaming", "host": "b", "port": 5432, "lag": 10},
            {"name": "a", "role": "replica", "state": "streaming", "host": "a", "port": 5432, "lag": 10},
            {"name": "c", "role": "sync_standby", "state": "streaming", "host": "c", "port": 5432, "lag": 0}
        ]}"#;
        let cluster = parse_cluster(body.as_bytes(), "http://x:8008").unwrap();
        assert_eq!(names(&cluster.candidates(false)), ["c", "a", "b", "y", "z"]);
        assert_eq!(cluster.leader(), None);
    }

    #[test]
    fn tolerates_loose_tag_and_number_types() {
        let body = r#"{"members": [
            {"name": "s1", "role": "replica", "state": "streaming", "host": "s1", "port": "5433",
             "timeline": "7", "lag": "2048",
             "tags": {"nofailover": "true", "noloadbalance": "on", "failover_priority": "5"}},
            {"name": "s2", "role": "replica", "state": "streaming", "host": "s2", "port": 5432,
             "lag": 1.0, "tags": {"nofailover": "false", "failover_priority": -1}},
            {"name": "s3", "role": "replica", "state": "streaming", "host": "s3", "port": 70000,
             "tags": {"failover_priority": "high", "nofailover": null}},
            {"name": "s4", "role": "replica", "state": "streaming", "port": 5432, "tags": null},
            {"name": "s5", "role": "uninitialized", "state": "creating replica", "host": "s5", "port": 5432}
        ]}"#;
        let cluster = parse_cluster(body.as_bytes(), "http://x:8008").unwrap();
        let s1 = &cluster.members[0];
        assert_eq!(
            (s1.port, s1.timeline, s1.lag_bytes),
            (Some(5433), Some(7), Some(2048))
        );
        assert!(s1.nofailover && s1.noloadbalance);
        assert_eq!(s1.failover_priority, 5);
        let s2 = &cluster.members[1];
        assert!(!s2.nofailover);
        assert_eq!((s2.failover_priority, s2.lag_bytes), (-1, Some(1)));
        let s3 = &cluster.members[2];
        assert_eq!(
            (s3.port, s3.failover_priority, s3.nofailover),
            (None, 1, false)
        );
        assert_eq!(cluster.members[4].role, Role::Other("uninitialized".into()));
        assert_eq!(cluster.members[4].role.to_string(), "uninitialized");
        assert_eq!(Role::StandbyLeader.to_string(), "standby_leader");
        assert!(cluster.candidates(false).is_empty());
        assert_eq!(
            reasons(&cluster, false),
            [
                "s5=not a replica",
                "s1=nofailover",
                "s2=failover_priority 0",
                "s3=no port",
                "s4=no host"
            ]
        );
        assert_eq!(names(&cluster.candidates(true)), ["s1", "s2"]);
    }

    #[test]
    fn rejects_malformed_documents_without_panicking() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "EOF while parsing a value at line 1 column 0"),
            (
                b"<html>502 Bad Gateway</html>",
                "expected value at line 1 column 1",
            ),
            (b"[]", "expected a JSON object"),
            (b"{}", "no \"members\" list"),
            (br#"{"members": {}}"#, "\"members\" is not a list"),
            (br#"{"members": [1]}"#, "member 1: expected a JSON object"),
            (
                br#"{"members": [{"name": "a"}, {"role": "leader"}]}"#,
                "member 2: no name",
            ),
            (b"\xff\xfe", "expected value at line 1 column 1"),
        ];
        for (body, reason) in cases {
            let error = parse_cluster(body, "http://u:secret@x:8008").unwrap_err();
            assert_eq!(
                error.to_string(),
                format!("invalid /cluster document from http://u:***@x:8008: {reason}")
            );
        }
        let empty = parse_cluster(br#"{"members": []}"#, "http://x:8008").unwrap();
        assert!(empty.members.is_empty() && empty.leader().is_none());
    }

    #[test]
    fn parses_urls() {
        let t = Target::parse("http://node1:8008/").unwrap();
        assert_eq!((t.tls, t.host.as_str(), t.port), (false, "node1", 8008));
        assert_eq!(
            (t.host_header.as_str(), t.path.as_str()),
            ("node1:8008", "/cluster")
        );
        assert_eq!(
            (t.shown.as_str(), t.authorization),
            ("http://node1:8008", None)
        );

        let t = Target::parse(" HTTPS://[fd00::5]/patroni// ").unwrap();
        assert_eq!((t.tls, t.host.as_str(), t.port), (true, "fd00::5", 443));
        assert_eq!(
            (t.host_header.as_str(), t.path.as_str()),
            ("[fd00::5]", "/patroni/cluster")
        );
        assert_eq!(t.shown, "https://[fd00::5]/patroni");

        let t = Target::parse("http://admin:p%40ss:w@10.1.2.3:8008").unwrap();
        assert_eq!(t.host, "10.1.2.3");
        assert_eq!(t.shown, "http://admin:***@10.1.2.3:8008");
        // base64("admin:p@ss:w")
        assert_eq!(t.authorization.as_deref(), Some("Basic YWRtaW46cEBzczp3"));

        for (url, reason) in [
            (
                "node1:8008",
                "expected http://host:port or https://host:port",
            ),
            (
                "ftp://node1",
                "unsupported scheme \"ftp\" (expected http or https)",
            ),
            (
                "http://node1:0",
                "invalid port (expected a number from 1 to 65535)",
            ),
            (
                "http://node1:65536",
                "invalid port (expected a number from 1 to 65535)",
            ),
            (
                "http://node1:8008/cluster?x=1",
                "a query or fragment is not supported",
            ),
        ] {
            assert_eq!(Target::parse(url).unwrap_err(), reason, "{url}");
        }
        for url in [
            "http://:8008",
            "http://[::1:8008",
            "http://node1:8008/a b",
            "http://node1:80a",
        ] {
            assert!(Target::parse(url).is_err(), "{url}");
        }
        let error = validate_url("gopher://u:pw@h").unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid Patroni REST API URL \"gopher://u:***@h\": unsupported scheme \"gopher\" (expected http or https)"
        );
    }

    #[test]
    fn masks_passwords() {
        assert_eq!(mask_url("http://u:p@h:1/x"), "http://u:***@h:1/x");
        assert_eq!(mask_url("http://u@h:1"), "http://u@h:1");
        assert_eq!(mask_url("u:p@h"), "u:***@h");
        assert_eq!(mask_url("http://h/x@y"), "http://h/x@y");
        assert_eq!(mask_url("http://a:b:c@d@h"), "http://a:***@h");
    }

    /// Passwords holding "/", "?", "#" or "@" are hidden whole by mask_url, and such URLs
    /// are refused with a message that quotes none of the authority, in every place a
    /// Patroni URL is printed.
    #[test]
    fn passwords_with_reserved_characters_never_print() {
        for c in ['/', '?', '#', '@', ':'] {
            let url = format!("http://patroni:pa{c}ss9word@10.0.0.1:8008/x");
            assert_eq!(
                mask_url(&url),
                "http://patroni:***@10.0.0.1:8008/x",
                "{url}"
            );
            let shown = validate_url(&url)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(!shown.contains("ss9word"), "{shown}");
            match Target::parse(&url) {
                Ok(target) => assert_eq!(target.shown, "http://patroni:***@10.0.0.1:8008/x"),
                Err(reason) => {
                    assert!(
                        !reason.contains("ss9") && !reason.contains("10.0.0.1"),
                        "{reason}"
                    )
                }
            }
        }
        // Percent-encoded, they work, and the header carries them decoded.
        let target = Target::parse("http://patroni:p%2F%3F%23%40ss@10.0.0.1:8008").unwrap();
        let header = target.authorization.unwrap();
        let decoded = BASE64.decode(header.trim_start_matches("Basic ")).unwrap();
        assert_eq!(decoded, b"patroni:p/?#@ss");
        assert_eq!(target.shown, "http://patroni:***@10.0.0.1:8008");
        // A bad port after a password: the message names neither.
        let reason = Target::parse("http://u:se/cret@h:80a").unwrap_err();
        assert!(
            !reason.contains("cret") && !reason.contains("80a"),
            "{reason}"
        );
        let reason = Target::parse("http://u:secret@h:99999").unwrap_err();
        assert!(
            !reason.contains("secret") && !reason.contains("99999"),
            "{reason}"
        );
    }

    #[test]
    fn encodes_basic_credentials() {
        for (userinfo, credentials) in [
            ("u", "u:"),
            ("u:", "u:"),
            ("admin:p%40ss:w", "admin:p@ss:w"),
            ("%75ser:%zz%4", "user:%zz%4"),
        ] {
            let header = basic_authorization(userinfo);
            let decoded = BASE64.decode(header.trim_start_matches("Basic ")).unwrap();
            assert_eq!(decoded, credentials.as_bytes(), "{userinfo}");
        }
        assert_eq!(basic_authorization("foo:bar"), "Basic Zm9vOmJhcg==");
    }

    #[test]
    fn errors_read_as_postgres_messages() {
        let errors = [
            PatroniError::NoUrls,
            PatroniError::Cancelled,
            PatroniError::Unreachable(vec!["http://a:8008: connection refused".into()]),
            parse_cluster(b"x", "http://a:8008").unwrap_err(),
        ];
        for error in errors {
            let text = error.to_string();
            assert!(text.starts_with(|c: char| c.is_lowercase()), "{text}");
            assert!(!text.ends_with('.'), "{text}");
            assert!(error.source().is_none());
        }
        assert_eq!(lowercase_first("Connection reset"), "connection reset");
        assert_eq!(lowercase_first("TLS alert"), "TLS alert");
        let refused = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert_eq!(describe_io(&refused), "connection refused");
        let other = io::Error::from_raw_os_error(libc::EHOSTUNREACH);
        assert_eq!(describe_io(&other), "no route to host");
    }

    // ----- network tests against a local canned server -----

    /// Serve each accepted connection with the next canned response (the last one repeats),
    /// reporting every request head received. `None` accepts and then never answers.
    async fn serve(responses: Vec<Option<Vec<u8>>>) -> (String, mpsc::UnboundedReceiver<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (heads, received) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut i = 0;
            loop {
                let Ok((mut socket, _)) = listener.accept().await else {
                    return;
                };
                let response = responses[i.min(responses.len() - 1)].clone();
                i += 1;
                let heads = heads.clone();
                tokio::spawn(async move {
                    let head = read_head(&mut socket).await;
                    let _ = heads.send(head);
                    match response {
                        Some(bytes) => {
                            let _ = socket.write_all(&bytes).await;
                            let _ = socket.shutdown().await;
                        }
                        None => tokio::time::sleep(Duration::from_secs(30)).await,
                    }
                });
            }
        });
        (url, received)
    }

    async fn read_head<S: AsyncRead + Unpin>(socket: &mut S) -> String {
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match socket.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&head).into_owned()
    }

    fn http_response(status: &str, body: &str) -> Option<Vec<u8>> {
        Some(
            format!(
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .into_bytes(),
        )
    }

    /// A URL nothing listens on.
    async fn closed_url() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        url
    }

    const SECOND: Duration = Duration::from_secs(1);
    const NO_TLS: ClientTls = ClientTls {
        cafile: None,
        certfile: None,
        keyfile: None,
    };

    /// One call of a new client: the URLs in their order.
    async fn fetch_cluster(
        urls: &[String],
        tls: &ClientTls,
        timeout: Duration,
        cancel: &CancellationToken,
    ) -> Result<Cluster, PatroniError> {
        Client::new()
            .fetch_cluster(urls, tls, timeout, cancel)
            .await
    }

    async fn fetch_cluster_limited(
        urls: &[String],
        tls: &ClientTls,
        timeout: Duration,
        cancel: &CancellationToken,
        limit: usize,
    ) -> Result<Cluster, PatroniError> {
        Client::new()
            .fetch_cluster_limited(urls, tls, timeout, cancel, limit)
            .await
    }

    /// Requests a `serve` server has received so far.
    fn requests(heads: &mut mpsc::UnboundedReceiver<String>) -> usize {
        std::iter::from_fn(|| heads.try_recv().ok()).count()
    }

    #[tokio::test]
    async fn a_dead_first_url_is_waited_on_once_not_on_every_call() {
        // Accepts the connection and never answers: each try of it costs the whole timeout.
        let (silent, mut silent_heads) = serve(vec![None]).await;
        let (good, mut good_heads) = serve(vec![http_response("200 OK", PATRONI_4)]).await;
        let urls = vec![silent.clone(), good.clone()];
        let timeout = Duration::from_millis(300);
        let (client, cancel) = (Client::new(), CancellationToken::new());

        let started = std::time::Instant::now();
        let cluster = client
            .fetch_cluster(&urls, &NO_TLS, timeout, &cancel)
            .await
            .unwrap();
        assert_eq!(cluster.source, good);
        assert!(
            started.elapsed() >= timeout,
            "the first call waits on the dead URL"
        );
        assert_eq!(
            (requests(&mut silent_heads), requests(&mut good_heads)),
            (1, 1)
        );

        for _ in 0..3 {
            let started = std::time::Instant::now();
            let cluster = client
                .fetch_cluster(&urls, &NO_TLS, timeout, &cancel)
                .await
                .unwrap();
            assert_eq!(cluster.source, good);
            assert!(started.elapsed() < timeout, "{:?}", started.elapsed());
        }
        assert_eq!(
            requests(&mut silent_heads),
            0,
            "the dead URL was not asked again"
        );
        assert_eq!(requests(&mut good_heads), 3);
    }

    #[tokio::test]
    async fn the_url_that_answered_last_goes_first_then_the_others_in_order() {
        let ok = || http_response("200 OK", PATRONI_4);
        let busy = || http_response("503 Service Unavailable", "{}");
        // a answers once, then is busy; b and c always answer.
        let (a, a_heads) = serve(vec![ok(), busy()]).await;
        let (b, b_heads) = serve(vec![ok()]).await;
        let (c, c_heads) = serve(vec![ok()]).await;
        let mut heads = [a_heads, b_heads, c_heads];
        let mut asked = || heads.iter_mut().map(requests).collect::<Vec<_>>();
        let (client, cancel) = (Client::new(), CancellationToken::new());
        let urls = vec![a.clone(), b.clone(), c.clone()];
        let source = |answer: Result<Cluster, PatroniError>| answer.unwrap().source;

        assert_eq!(
            source(client.fetch_cluster(&urls, &NO_TLS, SECOND, &cancel).await),
            a
        );
        // a first, busy now, then b.
        assert_eq!(
            source(client.fetch_cluster(&urls, &NO_TLS, SECOND, &cancel).await),
            b
        );
        // b first.
        assert_eq!(
            source(client.fetch_cluster(&urls, &NO_TLS, SECOND, &cancel).await),
            b
        );
        assert_eq!(asked(), [2, 2, 0]);

        // A reload that drops b: the remembered URL is not listed, so the list's order holds.
        let reloaded = vec![c.clone(), a.clone()];
        assert_eq!(
            source(
                client
                    .fetch_cluster(&reloaded, &NO_TLS, SECOND, &cancel)
                    .await
            ),
            c
        );
        // And with b listed again, c, which answered last, goes first.
        assert_eq!(
            source(client.fetch_cluster(&urls, &NO_TLS, SECOND, &cancel).await),
            c
        );
        assert_eq!(asked(), [0, 0, 2]);
    }

    #[tokio::test]
    async fn fetches_from_the_first_url_that_answers() {
        let refused = closed_url().await;
        let (busy, _) = serve(vec![http_response("503 Service Unavailable", "{}")]).await;
        let (good, mut heads) = serve(vec![http_response("200 OK", PATRONI_4)]).await;
        let urls = vec![refused, busy, format!("{good}/")];
        let cluster = fetch_cluster(&urls, &NO_TLS, SECOND, &CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(cluster.source, good);
        assert_eq!(cluster.leader().unwrap().name, "node1");
        let head = heads.recv().await.unwrap().to_ascii_lowercase();
        assert!(head.starts_with("get /cluster http/1.1\r\n"), "{head}");
        let authority = good.trim_start_matches("http://");
        assert!(
            head.contains(&format!("\r\nhost: {authority}\r\n")),
            "{head}"
        );
        assert!(head.contains("\r\naccept: application/json\r\n"), "{head}");
        assert!(!head.contains("authorization"), "{head}");
    }

    #[tokio::test]
    async fn collects_every_failure() {
        let refused = closed_url().await;
        let (busy, _) = serve(vec![http_response("503 Service Unavailable", "{}")]).await;
        let (html, _) = serve(vec![http_response("200 OK", "<html></html>")]).await;
        let (silent, _) = serve(vec![None]).await;
        let urls = vec![refused.clone(), busy.clone(), html.clone(), silent.clone()];
        let timeout = Duration::from_millis(200);
        let error = fetch_cluster(&urls, &NO_TLS, timeout, &CancellationToken::new())
            .await
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "could not get the cluster state from Patroni: {refused}: connection refused; \
                 {busy}: HTTP status 503 Service Unavailable; \
                 {html}: invalid /cluster document: expected value at line 1 column 1; \
                 {silent}: timed out after 200ms"
            )
        );
        assert!(error.source().is_none());
    }

    #[tokio::test]
    async fn sends_basic_auth_and_hides_the_password() {
        let (url, mut heads) = serve(vec![http_response("401 Unauthorized", "no")]).await;
        let with_auth = url.replace("http://", "http://patroni:s3cr%3At@");
        let error = fetch_cluster(&[with_auth], &NO_TLS, SECOND, &CancellationToken::new())
            .await
            .unwrap_err();
        let shown = url.replace("http://", "http://patroni:***@");
        assert_eq!(
            error.to_string(),
            format!("could not get the cluster state from Patroni: {shown}: HTTP status 401 Unauthorized")
        );
        assert!(!error.to_string().contains("s3cr"));
        let head = heads.recv().await.unwrap();
        // base64("patroni:s3cr:t")
        assert!(
            head.contains("\r\nauthorization: Basic cGF0cm9uaTpzM2NyOnQ=\r\n"),
            "{head}"
        );
    }

    #[tokio::test]
    async fn caps_the_body() {
        let big = format!(r#"{{"members": [], "padding": "{}"}}"#, "x".repeat(4096));
        let (declared, _) = serve(vec![http_response("200 OK", &big)]).await;
        let chunked = format!(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{big}\r\n0\r\n\r\n",
            big.len()
        );
        let (streamed, _) = serve(vec![Some(chunked.into_bytes())]).await;
        let cancel = CancellationToken::new();
        for url in [declared, streamed] {
            let error =
                fetch_cluster_limited(std::slice::from_ref(&url), &NO_TLS, SECOND, &cancel, 1024)
                    .await
                    .unwrap_err();
            assert_eq!(
                error.to_string(),
                format!("could not get the cluster state from Patroni: {url}: response too large (over 1024 bytes)")
            );
        }
        assert_eq!(too_large(MAX_BODY), "response too large (over 4 MiB)");
    }

    #[tokio::test]
    async fn survives_garbage_and_early_close() {
        let (garbage, _) = serve(vec![Some(b"SSH-2.0-OpenSSH_9.6\r\n\r\n".to_vec())]).await;
        let (closed, _) = serve(vec![Some(Vec::new())]).await;
        let (short, _) = serve(vec![Some(
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"members\"".to_vec(),
        )])
        .await;
        for url in [garbage, closed, short] {
            let error = fetch_cluster(
                std::slice::from_ref(&url),
                &NO_TLS,
                SECOND,
                &CancellationToken::new(),
            )
            .await
            .unwrap_err();
            let text = error.to_string();
            assert!(
                text.starts_with(&format!(
                    "could not get the cluster state from Patroni: {url}: "
                )),
                "{text}"
            );
            assert!(!text.contains("timed out"), "{text}");
        }
    }

    #[tokio::test]
    async fn https_to_a_plain_server_fails_cleanly() {
        // A plain HTTP server answering whatever arrives (a ClientHello has no "\r\n\r\n").
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let _ = socket.read(&mut [0u8; 4096]).await;
            let reply = http_response("400 Bad Request", "{}").unwrap_or_default();
            let _ = socket.write_all(&reply).await;
            let _ = socket.shutdown().await;
        });
        let error = fetch_cluster(
            std::slice::from_ref(&url),
            &NO_TLS,
            5 * SECOND,
            &CancellationToken::new(),
        )
        .await
        .unwrap_err();
        let text = error.to_string();
        // Either the handshake fails or, on a machine without a trust store, the setup does.
        assert!(
            text.contains(&format!("{url}: TLS handshake failed: "))
                || text.contains(&format!(
                    "{url}: could not load system root certificates (patroni_cafile not set)"
                )),
            "{text}"
        );
    }

    #[tokio::test]
    async fn honours_cancellation() {
        let (silent, _) = serve(vec![None]).await;
        let cancel = CancellationToken::new();
        let canceller = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            canceller.cancel();
        });
        let started = std::time::Instant::now();
        let error = fetch_cluster(&[silent], &NO_TLS, Duration::from_secs(30), &cancel)
            .await
            .unwrap_err();
        assert_eq!(error, PatroniError::Cancelled);
        assert!(started.elapsed() < Duration::from_secs(5));
        let error = fetch_cluster(&["http://x:1".into()], &NO_TLS, SECOND, &cancel)
            .await
            .unwrap_err();
        assert_eq!(error, PatroniError::Cancelled);
        let error = fetch_cluster(&[], &NO_TLS, SECOND, &CancellationToken::new())
            .await
            .unwrap_err();
        assert_eq!(error.to_string(), "no Patroni REST API URL given");
    }

    #[tokio::test]
    async fn invalid_url_is_one_failure_among_others() {
        let (good, _) = serve(vec![http_response("200 OK", STANDBY_CLUSTER)]).await;
        let urls = vec!["node1:8008".to_string(), good.clone()];
        let cluster = fetch_cluster(&urls, &NO_TLS, SECOND, &CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(cluster.source, good);
        let error = fetch_cluster(&urls[..1], &NO_TLS, SECOND, &CancellationToken::new())
            .await
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "could not get the cluster state from Patroni: node1:8008: invalid URL: expected http://host:port or https://host:port"
        );
    }

    // ----- https against a local fake Patroni with a test CA -----

    /// `agent/testdata/tls/`: a CA, a server certificate it signed (DNS:localhost,
    /// IP:127.0.0.1) and a client certificate it signed (CN=ccm-agent), EC P-256 keys.
    const REST_CA: &str = include_str!("../testdata/tls/rest-ca.crt");
    const REST_SERVER_CRT: &str = include_str!("../testdata/tls/rest-server.crt");
    const REST_SERVER_KEY: &str = include_str!("../testdata/tls/rest-server.key");
    const REST_CLIENT_CRT: &str = include_str!("../testdata/tls/rest-client.crt");
    const REST_CLIENT_KEY: &str = include_str!("../testdata/tls/rest-client.key");

    /// An https server answering `GET /cluster` with PATRONI_4; with `client_certificates`
    /// it accepts only clients with a certificate signed by the test CA (Patroni's
    /// `restapi.verify_client: required`).
    async fn serve_https(client_certificates: bool) -> String {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let chain = vec![CertificateDer::from_pem_slice(REST_SERVER_CRT.as_bytes()).unwrap()];
        let key = PrivateKeyDer::from_pem_slice(REST_SERVER_KEY.as_bytes()).unwrap();
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = if client_certificates {
            let mut roots = rustls::RootCertStore::empty();
            roots
                .add(CertificateDer::from_pem_slice(REST_CA.as_bytes()).unwrap())
                .unwrap();
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                std::sync::Arc::new(roots),
                provider,
            )
            .build()
            .unwrap();
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let config = builder.with_single_cert(chain, key).unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(socket).await else {
                        return;
                    };
                    if !read_head(&mut tls).await.contains("\r\n\r\n") {
                        return;
                    }
                    let reply = http_response("200 OK", PATRONI_4).unwrap_or_default();
                    let _ = tls.write_all(&reply).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        url
    }

    /// The test CA's files in a fresh directory, keys 0600 as libpq asks.
    fn rest_files(name: &str) -> (std::path::PathBuf, ClientTls) {
        use std::os::unix::fs::PermissionsExt;
        let dir =
            std::env::temp_dir().join(format!("ccm-agent-patroni-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let both = format!("{REST_CLIENT_CRT}{REST_CLIENT_KEY}");
        for (file, text) in [
            ("ca.crt", REST_CA),
            ("client.crt", REST_CLIENT_CRT),
            ("client.key", REST_CLIENT_KEY),
            ("both.pem", both.as_str()),
        ] {
            std::fs::write(dir.join(file), text).unwrap();
            std::fs::set_permissions(dir.join(file), std::fs::Permissions::from_mode(0o600))
                .unwrap();
        }
        let tls = ClientTls {
            cafile: Some(dir.join("ca.crt")),
            certfile: Some(dir.join("client.crt")),
            keyfile: Some(dir.join("client.key")),
        };
        (dir, tls)
    }

    fn ca_only(files: &ClientTls) -> ClientTls {
        ClientTls {
            cafile: files.cafile.clone(),
            ..ClientTls::default()
        }
    }

    async fn fetch_over(url: &str, tls: &ClientTls) -> Result<Cluster, PatroniError> {
        fetch_cluster(
            &[url.to_string()],
            tls,
            5 * SECOND,
            &CancellationToken::new(),
        )
        .await
    }

    #[tokio::test]
    async fn https_is_verified_against_the_ca_file() {
        let url = serve_https(false).await;
        let (dir, files) = rest_files("ca");
        let with_ca = ca_only(&files);
        let cluster = fetch_over(&url, &with_ca).await.unwrap();
        assert_eq!(cluster.leader().unwrap().name, "node1");
        // By name too: the certificate names localhost.
        let by_name = url.replace("127.0.0.1", "localhost");
        assert!(fetch_over(&by_name, &with_ca).await.is_ok());
        // Without the CA file: the system's roots do not know the test CA.
        let text = fetch_over(&url, &NO_TLS).await.unwrap_err().to_string();
        assert!(
            text.contains(&format!(
                "{url}: certificate verify failed: certificate is not signed by a CA in the \
                 system trust store (patroni_cafile not set)"
            )) || text.contains("could not load system root certificates (patroni_cafile not set)"),
            "{text}"
        );
        // Another CA file: refused, naming the file.
        let other = ClientTls {
            cafile: Some(dir.join("client.crt")),
            ..ClientTls::default()
        };
        let text = fetch_over(&url, &other).await.unwrap_err().to_string();
        assert!(
            text.contains("certificate verify failed") && text.contains("client.crt"),
            "{text}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn https_client_certificates() {
        let url = serve_https(true).await;
        let (dir, files) = rest_files("client");
        // The server asks for a certificate and gets none: no answer.
        let error = fetch_over(&url, &ca_only(&files)).await.unwrap_err();
        assert!(error.to_string().contains(&format!("{url}: ")), "{error}");
        // With the client certificate and its key, in two files or in one.
        let cluster = fetch_over(&url, &files).await.unwrap();
        assert_eq!(cluster.leader().unwrap().name, "node1");
        let combined = ClientTls {
            cafile: files.cafile.clone(),
            certfile: Some(dir.join("both.pem")),
            keyfile: None,
        };
        assert!(fetch_over(&url, &combined).await.is_ok());
        // A configured certificate file that is missing is an error, not a silent skip.
        let missing = ClientTls {
            certfile: Some(dir.join("absent.crt")),
            ..files.clone()
        };
        let text = fetch_over(&url, &missing).await.unwrap_err().to_string();
        assert!(text.contains("could not read certificate file"), "{text}");
        // A key that others may read is refused, as libpq refuses it.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            dir.join("client.key"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let text = fetch_over(&url, &files).await.unwrap_err().to_string();
        assert!(text.contains("has group or world access"), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

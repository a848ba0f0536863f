//! libpq connection strings, including multi-host ones, resolved host by host.
//!
//! tokio-postgres parses both libpq forms (`key=value ...` and `postgresql://` URIs) but only
//! knows `target_session_attrs` any/read-write/read-only, and when given several hosts it
//! connects to the first that answers. The agent needs more: the primary side must land on a
//! node that is not in recovery and the standby side on one that is, so that one string
//! `host=a,b` on both sides follows a failover. So this module
//!
//! 1. strips `target_session_attrs` out of the string itself (both forms) and validates it
//!    against libpq's full list (any, read-write, read-only, primary, standby, prefer-standby),
//! 2. lets tokio-postgres parse the rest (one parser of record for every other key),
//! 3. pairs hosts, hostaddrs and ports exactly as libpq does (no port, one port for all, or
//!    one per host), filling libpq's environment defaults (PGHOST, PGPORT, PGUSER, ...),
//! 4. builds one single-host `tokio_postgres::Config` per candidate, so `node.rs` can connect
//!    to each in turn and ask it `pg_is_in_recovery()`.

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use tokio_postgres::config::{Config as PgConfig, Host};

/// The value libpq calls `target_session_attrs`, all six of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetSessionAttrs {
    Any,
    ReadWrite,
    ReadOnly,
    Primary,
    Standby,
    PreferStandby,
}

impl TargetSessionAttrs {
    pub fn parse(value: &str) -> Option<Self> {
        Some(match value {
            "any" => Self::Any,
            "read-write" => Self::ReadWrite,
            "read-only" => Self::ReadOnly,
            "primary" => Self::Primary,
            "standby" => Self::Standby,
            "prefer-standby" => Self::PreferStandby,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Any => "any",
            Self::ReadWrite => "read-write",
            Self::ReadOnly => "read-only",
            Self::Primary => "primary",
            Self::Standby => "standby",
            Self::PreferStandby => "prefer-standby",
        }
    }

    /// Whether a node that is (or is not) in recovery satisfies this setting. The agent's
    /// own need per side is stricter and applied anyway; this only rejects strings whose
    /// setting contradicts their side, which would never connect.
    pub fn compatible_with_recovery(self, in_recovery: bool) -> bool {
        match self {
            Self::Any => true,
            Self::ReadWrite | Self::Primary => !in_recovery,
            Self::ReadOnly | Self::Standby | Self::PreferStandby => in_recovery,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConnInfoError {
    #[error("{0}")]
    Syntax(String),
    #[error("invalid target_session_attrs value \"{0}\" (expected any, read-write, read-only, primary, standby or prefer-standby)")]
    TargetSessionAttrs(String),
    #[error("{0}")]
    Invalid(String),
    #[error("could not match {ports} port numbers to {hosts} hosts")]
    PortCount { ports: usize, hosts: usize },
    #[error("could not match {hostaddrs} hostaddr values to {hosts} host names")]
    HostaddrCount { hostaddrs: usize, hosts: usize },
}

/// One candidate server of a (possibly multi-host) connection string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSpec {
    /// The host name or socket directory; `None` when only a hostaddr was given.
    pub host: Option<Host>,
    /// The numeric address to connect to instead of resolving `host`.
    pub hostaddr: Option<IpAddr>,
    pub port: u16,
}

impl HostSpec {
    /// The name to show for this host: the host name, else the address.
    pub fn name(&self) -> String {
        match (&self.host, &self.hostaddr) {
            (Some(Host::Tcp(h)), _) => h.clone(),
            #[cfg(unix)]
            (Some(Host::Unix(p)), _) => p.display().to_string(),
            (None, Some(addr)) => addr.to_string(),
            (None, None) => "localhost".to_string(),
        }
    }
}

impl fmt::Display for HostSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.name();
        if name.contains(':') && !name.starts_with('/') {
            write!(f, "[{name}]:{}", self.port)
        } else {
            write!(f, "{name}:{}", self.port)
        }
    }
}

/// A parsed connection string, ready to be tried host by host.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    config: PgConfig,
    target_session_attrs: Option<TargetSessionAttrs>,
    load_balance_random: bool,
    hosts: Vec<HostSpec>,
}

impl ConnInfo {
    /// Parses with libpq's environment defaults taken from the process environment.
    pub fn parse(conninfo: &str) -> Result<Self, ConnInfoError> {
        Self::parse_with_env(conninfo, &|key| {
            std::env::var(key).ok().filter(|v| !v.is_empty())
        })
    }

    /// Parses with environment defaults from `env` (tests pass a fixed map).
    pub fn parse_with_env(
        conninfo: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, ConnInfoError> {
        let (stripped, tsa) = strip_target_session_attrs(conninfo)?;
        let target_session_attrs = match tsa {
            None => None,
            Some(v) => {
                Some(TargetSessionAttrs::parse(&v).ok_or(ConnInfoError::TargetSessionAttrs(v))?)
            }
        };
        let mut config: PgConfig = stripped
            .parse()
            .map_err(|e: tokio_postgres::Error| ConnInfoError::Invalid(e.to_string()))?;
        apply_env_defaults(&mut config, env)?;
        let hosts = pair_hosts(&config)?;
        let load_balance_random = matches!(
            config.get_load_balance_hosts(),
            tokio_postgres::config::LoadBalanceHosts::Random
        );
        Ok(ConnInfo {
            config,
            target_session_attrs,
            load_balance_random,
            hosts,
        })
    }

    /// The candidate hosts in the order to try them (shuffled per call when the string
    /// says `load_balance_hosts=random`, as libpq does).
    pub fn hosts(&self) -> Vec<HostSpec> {
        let mut hosts = self.hosts.clone();
        if self.load_balance_random {
            fastrand::shuffle(&mut hosts);
        }
        hosts
    }

    pub fn target_session_attrs(&self) -> Option<TargetSessionAttrs> {
        self.target_session_attrs
    }

    #[cfg(test)]
    pub fn dbname(&self) -> Option<&str> {
        self.config.get_dbname()
    }

    #[cfg(test)]
    pub fn user(&self) -> Option<&str> {
        self.config.get_user()
    }

    /// A single-host configuration for `host`, carrying every other setting of the string.
    /// `connect_timeout` applies unless the string sets its own; `application_name` always
    /// wins, so the agent's sessions are recognizable in pg_stat_activity.
    pub fn host_config(
        &self,
        host: &HostSpec,
        application_name: &str,
        connect_timeout: Duration,
    ) -> PgConfig {
        let src = &self.config;
        let mut c = PgConfig::new();
        if let Some(user) = src.get_user() {
            c.user(user);
        }
        if let Some(password) = src.get_password() {
            c.password(password);
        }
        if let Some(dbname) = src.get_dbname() {
            c.dbname(dbname);
        }
        if let Some(options) = src.get_options() {
            c.options(options);
        }
        c.application_name(application_name);
        c.ssl_mode(src.get_ssl_mode());
        c.ssl_negotiation(src.get_ssl_negotiation());
        c.channel_binding(src.get_channel_binding());
        c.connect_timeout(
            src.get_connect_timeout()
                .copied()
                .unwrap_or(connect_timeout),
        );
        if let Some(t) = src.get_tcp_user_timeout() {
            c.tcp_user_timeout(*t);
        }
        c.keepalives(src.get_keepalives());
        c.keepalives_idle(src.get_keepalives_idle());
        if let Some(i) = src.get_keepalives_interval() {
            c.keepalives_interval(i);
        }
        if let Some(r) = src.get_keepalives_retries() {
            c.keepalives_retries(r);
        }
        match &host.host {
            Some(Host::Tcp(h)) => {
                c.host(h);
            }
            #[cfg(unix)]
            Some(Host::Unix(p)) => {
                c.host_path(p);
            }
            None => {}
        }
        if let Some(addr) = host.hostaddr {
            c.hostaddr(addr);
        }
        c.port(host.port);
        c
    }
}

/// libpq's environment fallbacks for what the string leaves out. tokio-postgres reads no
/// environment, yet operators expect `PGHOST=... ccm-agent` to behave like psql.
fn apply_env_defaults(
    config: &mut PgConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(), ConnInfoError> {
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
        let hosts = env("PGHOST").unwrap_or_else(|| "localhost".to_string());
        for h in hosts.split(',') {
            config.host(if h.is_empty() { "localhost" } else { h });
        }
    }
    if config.get_ports().is_empty() {
        if let Some(ports) = env("PGPORT") {
            for p in ports.split(',') {
                let port = if p.is_empty() {
                    5432
                } else {
                    p.parse().map_err(|_| {
                        ConnInfoError::Invalid(format!("invalid PGPORT value \"{ports}\""))
                    })?
                };
                config.port(port);
            }
        }
    }
    if config.get_user().is_none() {
        if let Some(user) = env("PGUSER")
            .or_else(|| env("USER"))
            .or_else(|| env("LOGNAME"))
        {
            config.user(user);
        }
    }
    if config.get_dbname().is_none() {
        if let Some(db) = env("PGDATABASE") {
            config.dbname(db);
        }
    }
    if config.get_password().is_none() {
        if let Some(pw) = env("PGPASSWORD") {
            config.password(pw);
        }
    }
    Ok(())
}

/// Pairs hosts, hostaddrs and ports the way libpq does.
fn pair_hosts(config: &PgConfig) -> Result<Vec<HostSpec>, ConnInfoError> {
    let hosts = config.get_hosts();
    let addrs = config.get_hostaddrs();
    if !hosts.is_empty() && !addrs.is_empty() && hosts.len() != addrs.len() {
        return Err(ConnInfoError::HostaddrCount {
            hostaddrs: addrs.len(),
            hosts: hosts.len(),
        });
    }
    let n = hosts.len().max(addrs.len());
    let ports = config.get_ports();
    let port_for = |i: usize| -> Result<u16, ConnInfoError> {
        match ports.len() {
            0 => Ok(5432),
            1 => Ok(ports[0]),
            p if p == n => Ok(ports[i]),
            p => Err(ConnInfoError::PortCount { ports: p, hosts: n }),
        }
    };
    (0..n)
        .map(|i| {
            Ok(HostSpec {
                host: hosts.get(i).cloned().and_then(empty_host_is_none),
                hostaddr: addrs.get(i).copied(),
                port: port_for(i)?,
            })
        })
        .collect()
}

fn empty_host_is_none(h: Host) -> Option<Host> {
    match &h {
        Host::Tcp(s) if s.is_empty() => None,
        _ => Some(h),
    }
}

fn is_uri(s: &str) -> bool {
    let s = s.trim_start();
    s.starts_with("postgresql://") || s.starts_with("postgres://")
}

/// Removes target_session_attrs from a connection string of either form; returns the rest
/// and the removed value (the last one wins, as in libpq).
pub fn strip_target_session_attrs(
    conninfo: &str,
) -> Result<(String, Option<String>), ConnInfoError> {
    if is_uri(conninfo) {
        return Ok(strip_uri_param(conninfo.trim(), "target_session_attrs"));
    }
    let pairs = parse_key_values(conninfo)?;
    let mut found = None;
    let mut kept = Vec::with_capacity(pairs.len());
    for (k, v) in pairs {
        if k == "target_session_attrs" {
            found = Some(v);
        } else {
            kept.push((k, v));
        }
    }
    Ok((join_key_values(&kept), found))
}

/// Removes every `name=...` parameter from a URI's query; returns the URI and the last value.
fn strip_uri_param(uri: &str, name: &str) -> (String, Option<String>) {
    let Some((base, query)) = uri.split_once('?') else {
        return (uri.to_string(), None);
    };
    let mut found = None;
    let mut kept: Vec<&str> = Vec::new();
    for param in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = param.split_once('=').unwrap_or((param, ""));
        if percent_decode(k) == name {
            found = Some(percent_decode(v));
        } else {
            kept.push(param);
        }
    }
    if kept.is_empty() {
        (base.to_string(), found)
    } else {
        (format!("{base}?{}", kept.join("&")), found)
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Splits a `key=value` connection string by libpq's rules: whitespace between pairs and
/// optionally around '=', values optionally in single quotes, backslash escapes either way.
pub fn parse_key_values(s: &str) -> Result<Vec<(String, String)>, ConnInfoError> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(out);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(ConnInfoError::Syntax(format!(
                "missing \"=\" after \"{key}\" in connection info string"
            )));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    None => {
                        return Err(ConnInfoError::Syntax(
                            "unterminated quoted string in connection info string".to_string(),
                        ))
                    }
                    Some('\\') => match chars.next() {
                        Some(c) => value.push(c),
                        None => {
                            return Err(ConnInfoError::Syntax(
                                "unterminated quoted string in connection info string".to_string(),
                            ))
                        }
                    },
                    Some('\'') => break,
                    Some(c) => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    if let Some(escaped) = chars.next() {
                        value.push(escaped);
                    }
                } else {
                    value.push(c);
                }
            }
        }
        out.push((key, value));
    }
}

/// Writes pairs back as a `key=value` string, quoting only what needs it.
pub fn join_key_values(pairs: &[(String, String)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={}", quote_value(v)))
        .collect::<Vec<_>>()
        .join(" ")
}

fn quote_value(v: &str) -> String {
    if !v.is_empty()
        && !v
            .chars()
            .any(|c| c.is_whitespace() || c == '\'' || c == '\\')
    {
        return v.to_string();
    }
    let mut q = String::with_capacity(v.len() + 2);
    q.push('\'');
    for c in v.chars() {
        if c == '\'' || c == '\\' {
            q.push('\\');
        }
        q.push(c);
    }
    q.push('\'');
    q
}

/// The string with any password replaced by `****`, for logs and `check-config`.
pub fn mask_password(conninfo: &str) -> String {
    const MASK: &str = "****";
    if is_uri(conninfo) {
        let uri = conninfo.trim();
        let scheme_end = uri.find("://").map(|i| i + 3).unwrap_or(0);
        let rest = &uri[scheme_end..];
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let authority = &rest[..authority_end];
        let masked_authority = match authority.rfind('@') {
            Some(at) => {
                let userinfo = &authority[..at];
                match userinfo.split_once(':') {
                    Some((user, _)) => format!("{user}:{MASK}{}", &authority[at..]),
                    None => authority.to_string(),
                }
            }
            None => authority.to_string(),
        };
        let tail = &rest[authority_end..];
        let tail = match tail.split_once('?') {
            Some((path, query)) => {
                let params: Vec<String> = query
                    .split('&')
                    .map(|p| match p.split_once('=') {
                        Some((k, _)) if percent_decode(k) == "password" => format!("{k}={MASK}"),
                        _ => p.to_string(),
                    })
                    .collect();
                format!("{path}?{}", params.join("&"))
            }
            None => tail.to_string(),
        };
        return format!("{}{masked_authority}{tail}", &uri[..scheme_end]);
    }
    match parse_key_values(conninfo) {
        Ok(pairs) => {
            let masked: Vec<(String, String)> = pairs
                .into_iter()
                .map(|(k, v)| {
                    if k == "password" {
                        (k, MASK.to_string())
                    } else {
                        (k, v)
                    }
                })
                .collect();
            join_key_values(&masked)
        }
        // Unparseable strings are rejected by validation anyway; never echo a secret.
        Err(_) => "<unparseable connection string>".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn unix(p: &str) -> Host {
        Host::Unix(PathBuf::from(p))
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn parse(s: &str) -> ConnInfo {
        ConnInfo::parse_with_env(s, &no_env).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn labels(s: &str) -> Vec<String> {
        parse(s).hosts.iter().map(|h| h.to_string()).collect()
    }

    #[test]
    fn strips_key_value_forms() {
        let cases: &[(&str, &str, Option<&str>)] = &[
            ("host=a port=5432", "host=a port=5432", None),
            (
                "host=a target_session_attrs=read-write",
                "host=a",
                Some("read-write"),
            ),
            (
                "target_session_attrs=standby host=a",
                "host=a",
                Some("standby"),
            ),
            (
                "host=a target_session_attrs = primary  port=1",
                "host=a port=1",
                Some("primary"),
            ),
            (
                "host=a target_session_attrs='prefer-standby'",
                "host=a",
                Some("prefer-standby"),
            ),
            (
                "  host = a   dbname = 'my db'  ",
                "host=a dbname='my db'",
                None,
            ),
            (
                "host=a target_session_attrs=any target_session_attrs=standby",
                "host=a",
                Some("standby"),
            ),
            ("password='it\\'s' host=a", "password='it\\'s' host=a", None),
            ("host=a password=p\\ w", "host=a password='p w'", None),
            (
                "application_name='' host=a",
                "application_name='' host=a",
                None,
            ),
            ("", "", None),
        ];
        for (input, rest, tsa) in cases {
            let (got_rest, got_tsa) = strip_target_session_attrs(input).unwrap();
            assert_eq!(&got_rest, rest, "rest of {input:?}");
            assert_eq!(got_tsa.as_deref(), *tsa, "tsa of {input:?}");
        }
    }

    #[test]
    fn strips_uri_forms() {
        let cases: &[(&str, &str, Option<&str>)] = &[
            ("postgresql://u@h/db", "postgresql://u@h/db", None),
            ("postgresql://u@h/db?target_session_attrs=read-write", "postgresql://u@h/db", Some("read-write")),
            (
                "postgres://h1:5432,h2:5433/db?sslmode=disable&target_session_attrs=primary&connect_timeout=3",
                "postgres://h1:5432,h2:5433/db?sslmode=disable&connect_timeout=3",
                Some("primary"),
            ),
            ("postgresql://h/db?target%5Fsession%5Fattrs=standby", "postgresql://h/db", Some("standby")),
            ("postgresql://h?target_session_attrs=standby&", "postgresql://h", Some("standby")),
            ("postgresql://h/db?application_name=x", "postgresql://h/db?application_name=x", None),
        ];
        for (input, rest, tsa) in cases {
            let (got_rest, got_tsa) = strip_target_session_attrs(input).unwrap();
            assert_eq!(&got_rest, rest, "rest of {input:?}");
            assert_eq!(got_tsa.as_deref(), *tsa, "tsa of {input:?}");
        }
    }

    #[test]
    fn syntax_errors() {
        assert!(matches!(
            strip_target_session_attrs("host"),
            Err(ConnInfoError::Syntax(_))
        ));
        assert!(matches!(
            strip_target_session_attrs("host=a port"),
            Err(ConnInfoError::Syntax(_))
        ));
        assert!(matches!(
            strip_target_session_attrs("host='a"),
            Err(ConnInfoError::Syntax(_))
        ));
        assert!(ConnInfo::parse_with_env("host=a bogus_key=1", &no_env).is_err());
        assert!(ConnInfo::parse_with_env("host=a port=notaport", &no_env).is_err());
        assert_eq!(
            ConnInfo::parse_with_env("host=a target_session_attrs=sometimes", &no_env).unwrap_err(),
            ConnInfoError::TargetSessionAttrs("sometimes".into())
        );
    }

    #[test]
    fn accepts_all_six_target_session_attrs_even_those_tokio_postgres_lacks() {
        for v in [
            "any",
            "read-write",
            "read-only",
            "primary",
            "standby",
            "prefer-standby",
        ] {
            let c = parse(&format!("host=a target_session_attrs={v}"));
            assert_eq!(c.target_session_attrs().unwrap().as_str(), v);
            let c = parse(&format!("postgresql://a/db?target_session_attrs={v}"));
            assert_eq!(c.target_session_attrs().unwrap().as_str(), v);
        }
    }

    #[test]
    fn pairs_hosts_and_ports_like_libpq() {
        assert_eq!(labels("host=a"), vec!["a:5432"]);
        assert_eq!(labels("host=a port=6000"), vec!["a:6000"]);
        assert_eq!(labels("host=a,b port=5432,5433"), vec!["a:5432", "b:5433"]);
        assert_eq!(
            labels("host=a,b,c port=7000"),
            vec!["a:7000", "b:7000", "c:7000"]
        );
        assert_eq!(labels("host=a,b"), vec!["a:5432", "b:5432"]);
        assert_eq!(labels("host=a,b port=,5433"), vec!["a:5432", "b:5433"]);
        assert_eq!(labels("postgresql://a:1,b:2/db"), vec!["a:1", "b:2"]);
        assert_eq!(labels("postgresql://a,b:2/db"), vec!["a:5432", "b:2"]);
        assert_eq!(labels("postgresql://[::1]:5433/db"), vec!["[::1]:5433"]);
        assert_eq!(labels("host=/tmp port=5433"), vec!["/tmp:5433"]);
        assert_eq!(labels("hostaddr=127.0.0.1 port=1"), vec!["127.0.0.1:1"]);
        assert_eq!(
            labels("host=a,b hostaddr=10.0.0.1,10.0.0.2 port=1,2"),
            vec!["a:1", "b:2"]
        );
        assert_eq!(labels("dbname=x"), vec!["localhost:5432"]);
    }

    #[test]
    fn mismatched_counts_are_errors() {
        assert_eq!(
            ConnInfo::parse_with_env("host=a,b,c port=1,2", &no_env).unwrap_err(),
            ConnInfoError::PortCount { ports: 2, hosts: 3 }
        );
        assert_eq!(
            ConnInfo::parse_with_env("host=a,b hostaddr=127.0.0.1", &no_env).unwrap_err(),
            ConnInfoError::HostaddrCount {
                hostaddrs: 1,
                hosts: 2
            }
        );
    }

    #[test]
    fn hostaddr_is_kept_per_host() {
        let c = parse("host=a,b hostaddr=10.0.0.1,10.0.0.2 port=1,2");
        assert_eq!(c.hosts[1].hostaddr, Some("10.0.0.2".parse().unwrap()));
        assert_eq!(c.hosts[1].host, Some(Host::Tcp("b".into())));
    }

    #[test]
    fn environment_defaults_fill_gaps_only() {
        let env = |k: &str| match k {
            "PGHOST" => Some("h1,h2".to_string()),
            "PGPORT" => Some("6001,6002".to_string()),
            "PGUSER" => Some("envuser".to_string()),
            "PGDATABASE" => Some("envdb".to_string()),
            _ => None,
        };
        let c = ConnInfo::parse_with_env("", &env).unwrap();
        let hosts: Vec<String> = c.hosts().iter().map(|h| h.to_string()).collect();
        assert_eq!(hosts, vec!["h1:6001", "h2:6002"]);
        assert_eq!(c.user(), Some("envuser"));
        assert_eq!(c.dbname(), Some("envdb"));
        let c = ConnInfo::parse_with_env("host=x port=1 user=u dbname=d", &env).unwrap();
        assert_eq!(c.hosts()[0].to_string(), "x:1");
        assert_eq!(c.user(), Some("u"));
        assert_eq!(c.dbname(), Some("d"));
    }

    #[test]
    fn host_config_is_single_host_and_keeps_settings() {
        let c = parse(
            "host=a,b port=1,2 user=u password=secret dbname=d connect_timeout=3 options='-c x=y'",
        );
        let hosts = c.hosts();
        let hc = c.host_config(&hosts[1], "ccm-agent", Duration::from_secs(9));
        assert_eq!(hc.get_hosts(), &[Host::Tcp("b".into())]);
        assert_eq!(hc.get_ports(), &[2]);
        assert_eq!(hc.get_user(), Some("u"));
        assert_eq!(hc.get_password(), Some(&b"secret"[..]));
        assert_eq!(hc.get_dbname(), Some("d"));
        assert_eq!(hc.get_options(), Some("-c x=y"));
        assert_eq!(hc.get_application_name(), Some("ccm-agent"));
        assert_eq!(hc.get_connect_timeout(), Some(&Duration::from_secs(3)));
        let c = parse("host=a");
        let hc = c.host_config(&c.hosts()[0], "ccm-agent", Duration::from_secs(9));
        assert_eq!(hc.get_connect_timeout(), Some(&Duration::from_secs(9)));
    }

    #[test]
    fn uri_with_query_params_parses() {
        let c = parse("postgresql://u:p%40ss@a:1,b:2/db?connect_timeout=2&application_name=x&target_session_attrs=standby");
        assert_eq!(c.user(), Some("u"));
        assert_eq!(c.dbname(), Some("db"));
        assert_eq!(c.target_session_attrs(), Some(TargetSessionAttrs::Standby));
        assert_eq!(c.hosts().len(), 2);
    }

    #[test]
    fn masks_passwords() {
        assert_eq!(
            mask_password("host=a password=secret user=u"),
            "host=a password=**** user=u"
        );
        assert_eq!(
            mask_password("host=a password = 'se cret'"),
            "host=a password=****"
        );
        assert_eq!(
            mask_password("postgresql://u:secret@h:5/db"),
            "postgresql://u:****@h:5/db"
        );
        assert_eq!(mask_password("postgresql://u@h/db"), "postgresql://u@h/db");
        assert_eq!(
            mask_password("postgres://h/db?user=u&password=secret&sslmode=disable"),
            "postgres://h/db?user=u&password=****&sslmode=disable"
        );
        assert!(!mask_password("host='unterminated password=secret").contains("secret"));
    }

    #[test]
    fn compatibility_with_sides() {
        use TargetSessionAttrs::*;
        assert!(Any.compatible_with_recovery(true) && Any.compatible_with_recovery(false));
        assert!(
            ReadWrite.compatible_with_recovery(false) && !ReadWrite.compatible_with_recovery(true)
        );
        assert!(Primary.compatible_with_recovery(false) && !Primary.compatible_with_recovery(true));
        assert!(Standby.compatible_with_recovery(true) && !Standby.compatible_with_recovery(false));
        assert!(PreferStandby.compatible_with_recovery(true));
        assert!(ReadOnly.compatible_with_recovery(true));
    }

    #[test]
    fn unix_host_display() {
        let h = HostSpec {
            host: Some(unix("/var/run/postgresql")),
            hostaddr: None,
            port: 5432,
        };
        assert_eq!(h.to_string(), "/var/run/postgresql:5432");
    }
}

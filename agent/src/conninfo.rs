//! libpq connection strings, including multi-host ones, resolved host by host.
//!
//! tokio-postgres parses both libpq forms (`key=value ...` and `postgresql://` URIs) but only
//! knows `target_session_attrs` any/read-write/read-only, `sslmode` disable/prefer/require,
//! no certificate keys and no environment, and when given several hosts it connects to the
//! first that answers. The agent needs more: the primary side must land on a node that is not
//! in recovery and the standby side on one that is, so that one string `host=a,b` on both
//! sides follows a failover; and connections must follow libpq (DESIGN.md). So this module
//!
//! 1. strips the keys it handles itself out of the string (both forms): `target_session_attrs`
//!    (validated against libpq's six values), `sslmode` (all six), `sslrootcert`, `sslcert`,
//!    `sslkey`, `sslsni`, `passfile`, and in URIs the JDBC-style `ssl=true`,
//! 2. lets tokio-postgres parse the rest (one parser of record for every other key; unknown
//!    keys stay an error),
//! 3. fills what the string leaves out from libpq's environment variables (PGHOST, PGHOSTADDR,
//!    PGPORT, PGUSER, PGDATABASE, PGPASSWORD, PGPASSFILE, PGSSLMODE, PGSSLROOTCERT, PGSSLCERT,
//!    PGSSLKEY, PGSSLSNI, PGCONNECT_TIMEOUT, PGAPPNAME, PGOPTIONS) and libpq's defaults (the
//!    Unix-socket directory as host, `~/.pgpass`, `~/.postgresql/` for certificates),
//! 4. pairs hosts, hostaddrs and ports exactly as libpq does (no port, one port for all, or
//!    one per host),
//! 5. builds one single-host `tokio_postgres::Config` per candidate, so `node.rs` can connect
//!    to each in turn (with `tls::TlsSettings` for its TLS and the password file for its
//!    password) and ask it `pg_is_in_recovery()`.

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use tokio_postgres::config::{Config as PgConfig, Host, SslMode as PgSslMode, SslNegotiation};

use crate::pgpass;
use crate::tls::{SslMode, TlsSettings};

/// The keys this module takes out of a string before tokio-postgres sees it.
const OWN_KEYS: &[&str] = &[
    "target_session_attrs",
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslsni",
    "passfile",
];

/// libpq's smallest connect_timeout: 1 s is taken as 2 s.
const MIN_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The Unix-socket directory used when a string names no host, as libpq's compiled-in
/// default: /var/run/postgresql where it exists (Debian, Ubuntu, Red Hat, the official
/// container images), else /tmp (PostgreSQL's own default).
pub fn default_socket_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let debian = Path::new("/var/run/postgresql");
        if debian.is_dir() {
            debian.to_path_buf()
        } else {
            PathBuf::from("/tmp")
        }
    })
}

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
/// No field holds a secret in clear in `Debug` output: tokio-postgres redacts the password,
/// and the password file is only a path.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    config: PgConfig,
    target_session_attrs: Option<TargetSessionAttrs>,
    load_balance_random: bool,
    hosts: Vec<HostSpec>,
    tls: TlsSettings,
    /// The password file to consult when no password is given (None: no home directory).
    passfile: Option<PathBuf>,
}

/// A password read from the password file, and which file it came from (for libpq's hint
/// on a failed password).
#[derive(Clone, PartialEq, Eq)]
pub struct FilePassword {
    pub password: String,
    pub file: PathBuf,
}

impl fmt::Debug for FilePassword {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FilePassword")
            .field("password", &"****")
            .field("file", &self.file)
            .finish()
    }
}

impl ConnInfo {
    /// Parses with libpq's environment defaults taken from the process environment.
    pub fn parse(conninfo: &str) -> Result<Self, ConnInfoError> {
        Self::parse_with_env(conninfo, &process_env)
    }

    /// Parses with environment defaults from `env` (tests pass a fixed map). `HOME` and
    /// `USER` are asked for too, meaning what libpq takes for them: the process answers
    /// `HOME` from the variable, else the password database, and `USER` with the effective
    /// user's name (never `$USER` or `$LOGNAME`; see `process_env`).
    pub fn parse_with_env(
        conninfo: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, ConnInfoError> {
        let (stripped, own) = strip_keys(conninfo, OWN_KEYS)?;
        let last = |key: &str| -> Option<String> {
            own.iter()
                .rev()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
        };
        // Empty values mean "not set", as in libpq (target_session_attrs excepted: validated).
        let given = |key: &str| last(key).filter(|v| !v.is_empty());
        let target_session_attrs = match last("target_session_attrs") {
            None => None,
            Some(v) => {
                Some(TargetSessionAttrs::parse(&v).ok_or(ConnInfoError::TargetSessionAttrs(v))?)
            }
        };
        let mut config: PgConfig = stripped
            .parse()
            .map_err(|e: tokio_postgres::Error| ConnInfoError::Invalid(e.to_string()))?;
        if is_uri(conninfo)
            && config
                .get_hosts()
                .iter()
                .any(|h| matches!(h, Host::Tcp(h) if h.contains('@')))
        {
            // The user info ends at the first "@": what follows a literal "@" in a password
            // became the host name, which messages would show. Say so without echoing it.
            return Err(ConnInfoError::Invalid(
                "a host name of the URI holds \"@\": an \"@\" in a user name or password must \
                 be percent-encoded as %40"
                    .to_string(),
            ));
        }
        apply_env_defaults(&mut config, env)?;
        let hosts = pair_hosts(&config)?;
        let load_balance_random = matches!(
            config.get_load_balance_hosts(),
            tokio_postgres::config::LoadBalanceHosts::Random
        );
        let home = env("HOME").map(PathBuf::from);
        let tls = tls_settings(&config, &given, env, home.clone())?;
        let passfile = given("passfile")
            .or_else(|| env("PGPASSFILE"))
            .map(PathBuf::from)
            .or_else(|| home.map(|h| h.join(".pgpass")));
        Ok(ConnInfo {
            config,
            target_session_attrs,
            load_balance_random,
            hosts,
            tls,
            passfile,
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

    /// The same settings for one of the hosts only (a standby of a multi-host string).
    pub fn only(&self, host: &HostSpec) -> ConnInfo {
        ConnInfo {
            hosts: vec![host.clone()],
            load_balance_random: false,
            ..self.clone()
        }
    }

    /// The same settings for a server named by someone else (Patroni): `host` is a name or
    /// an address, connected to over TCP.
    pub fn at(&self, host: &str, port: u16) -> ConnInfo {
        let spec = HostSpec {
            host: Some(Host::Tcp(host.to_string())),
            hostaddr: host.parse().ok(),
            port,
        };
        self.only(&spec)
    }

    pub fn target_session_attrs(&self) -> Option<TargetSessionAttrs> {
        self.target_session_attrs
    }

    /// The TLS settings, for every host of the string.
    pub fn tls(&self) -> &TlsSettings {
        &self.tls
    }

    #[cfg(test)]
    pub fn passfile(&self) -> Option<&Path> {
        self.passfile.as_deref()
    }

    /// The password for `host` from the password file, when the string and PGPASSWORD give
    /// none (libpq's order). Reads the file now (call it per connection attempt).
    pub fn passfile_password(&self, host: &HostSpec) -> Option<FilePassword> {
        if self.config.get_password().is_some() {
            return None;
        }
        let file = self.passfile.as_ref()?;
        let user = self.config.get_user()?;
        let database = self.config.get_dbname().unwrap_or(user);
        let host_name = pgpass_host(host);
        let lookup = pgpass::Lookup {
            host: &host_name,
            port: host.port,
            database,
            user,
        };
        pgpass::password_from_file(file, &lookup).map(|password| FilePassword {
            password,
            file: file.clone(),
        })
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
    /// `connect_timeout` applies unless the string (or PGCONNECT_TIMEOUT) sets its own, at
    /// least 2 s as in libpq; `application_name` is the string's (or PGAPPNAME), else
    /// `fallback_application_name` (libpq's fallback_application_name). TLS is off
    /// (`sslmode` disable): the caller sets the mode of each attempt (see node.rs).
    pub fn host_config(
        &self,
        host: &HostSpec,
        fallback_application_name: &str,
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
        c.application_name(
            src.get_application_name()
                .unwrap_or(fallback_application_name),
        );
        c.ssl_mode(PgSslMode::Disable);
        c.ssl_negotiation(src.get_ssl_negotiation());
        c.channel_binding(src.get_channel_binding());
        c.connect_timeout(
            src.get_connect_timeout()
                .copied()
                .unwrap_or(connect_timeout)
                .max(MIN_CONNECT_TIMEOUT),
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
        match (&host.host, host.hostaddr) {
            (Some(Host::Tcp(h)), _) => {
                c.host(h);
            }
            #[cfg(unix)]
            (Some(Host::Unix(p)), _) => {
                c.host_path(p);
            }
            // tokio-postgres needs a host name to start TLS; the address stands in (the
            // verifier knows there is no host name, see tls.rs).
            (None, Some(addr)) => {
                c.host(addr.to_string());
            }
            (None, None) => {}
        }
        if let Some(addr) = host.hostaddr {
            c.hostaddr(addr);
        }
        c.port(host.port);
        c
    }
}

/// The process environment, with libpq's two fallbacks:
/// - `HOME`: the variable, else the password database's entry for the user (libpq's
///   pqGetHomeDirectory; `std::env::home_dir` looks up the real uid where libpq looks up the
///   effective one, which differ only in a setuid program, which the agent is not);
/// - `USER`: the effective user's name from the password database (libpq's
///   pg_fe_getusername(geteuid()), via whoami): the default user name. libpq never reads
///   `$USER` or `$LOGNAME`, which a `su` or `sudo` may have left naming someone else.
fn process_env(key: &str) -> Option<String> {
    match key {
        "HOME" => std::env::home_dir()
            .filter(|home| !home.as_os_str().is_empty())
            .map(|home| home.to_string_lossy().into_owned()),
        "USER" => effective_user_name(),
        _ => std::env::var(key).ok().filter(|v| !v.is_empty()),
    }
}

/// The effective user's name, as libpq takes it for the default user name.
fn effective_user_name() -> Option<String> {
    whoami::username().ok().filter(|name| !name.is_empty())
}

/// libpq's environment fallbacks for what the string leaves out. tokio-postgres reads no
/// environment, yet operators expect `PGHOST=... ccm-agent` to behave like psql.
fn apply_env_defaults(
    config: &mut PgConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(), ConnInfoError> {
    // host and hostaddr fall back separately, as in libpq; entries left empty (or no entry
    // at all) mean the default socket directory (see pair_hosts).
    if config.get_hosts().is_empty() {
        if let Some(hosts) = env("PGHOST") {
            for h in hosts.split(',') {
                config.host(h);
            }
        }
    }
    if config.get_hostaddrs().is_empty() {
        if let Some(addrs) = env("PGHOSTADDR") {
            for a in addrs.split(',') {
                let addr = a.trim().parse().map_err(|_| {
                    ConnInfoError::Invalid(format!("invalid PGHOSTADDR value \"{addrs}\""))
                })?;
                config.hostaddr(addr);
            }
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
        if let Some(user) = env("PGUSER").or_else(|| env("USER")) {
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
    if config.get_connect_timeout().is_none() {
        if let Some(text) = env("PGCONNECT_TIMEOUT") {
            let seconds: i64 = text.trim().parse().map_err(|_| {
                ConnInfoError::Invalid(format!("invalid PGCONNECT_TIMEOUT value \"{text}\""))
            })?;
            if seconds > 0 {
                config.connect_timeout(Duration::from_secs(seconds as u64));
            }
        }
    }
    if config.get_application_name().is_none() {
        if let Some(name) = env("PGAPPNAME") {
            config.application_name(name);
        }
    }
    if config.get_options().is_none() {
        if let Some(options) = env("PGOPTIONS") {
            config.options(options);
        }
    }
    Ok(())
}

/// `sslmode` and friends, from the string, else the environment, else libpq's defaults;
/// with libpq's consistency checks.
fn tls_settings(
    config: &PgConfig,
    given: &dyn Fn(&str) -> Option<String>,
    env: &dyn Fn(&str) -> Option<String>,
    home: Option<PathBuf>,
) -> Result<TlsSettings, ConnInfoError> {
    let setting = |key: &str, var: &str| given(key).or_else(|| env(var));
    let rootcert = setting("sslrootcert", "PGSSLROOTCERT");
    let system = rootcert.as_deref() == Some("system");
    let mode = match setting("sslmode", "PGSSLMODE") {
        Some(text) => SslMode::parse(&text).ok_or_else(|| {
            ConnInfoError::Invalid(format!(
                "invalid sslmode value: \"{text}\" (expected disable, allow, prefer, require, \
                 verify-ca or verify-full)"
            ))
        })?,
        // libpq 16+: the system's roots are only for verify-full, which they then default to.
        None if system => SslMode::VerifyFull,
        None => SslMode::Prefer,
    };
    if system && mode != SslMode::VerifyFull {
        return Err(ConnInfoError::Invalid(format!(
            "weak sslmode \"{mode}\" may not be used with sslrootcert=system (use \"verify-full\")"
        )));
    }
    if config.get_ssl_negotiation() == SslNegotiation::Direct
        && !matches!(
            mode,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    {
        return Err(ConnInfoError::Invalid(format!(
            "weak sslmode \"{mode}\" may not be used with sslnegotiation=direct \
             (use \"require\", \"verify-ca\", or \"verify-full\")"
        )));
    }
    let sni = match setting("sslsni", "PGSSLSNI").as_deref() {
        None | Some("1") => true,
        Some("0") => false,
        Some(other) => {
            return Err(ConnInfoError::Invalid(format!(
                "invalid sslsni value: \"{other}\" (expected 0 or 1)"
            )))
        }
    };
    Ok(TlsSettings {
        mode,
        rootcert,
        cert: setting("sslcert", "PGSSLCERT").map(PathBuf::from),
        key: setting("sslkey", "PGSSLKEY").map(PathBuf::from),
        sni,
        home,
    })
}

/// The host name the password file is searched for (libpq: `host`, else `hostaddr`;
/// `localhost` for the default socket directory).
fn pgpass_host(host: &HostSpec) -> String {
    match (&host.host, host.hostaddr) {
        (Some(Host::Tcp(h)), _) if !h.is_empty() => h.clone(),
        #[cfg(unix)]
        (Some(Host::Unix(p)), _) if p.as_path() != default_socket_dir() => p.display().to_string(),
        (Some(Host::Tcp(_)), Some(addr)) | (None, Some(addr)) => addr.to_string(),
        _ => "localhost".to_string(),
    }
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
    // No host at all stands for one: the default.
    let n = hosts.len().max(addrs.len()).max(1);
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
            let hostaddr = addrs.get(i).copied();
            let host = hosts.get(i).cloned().and_then(empty_host_is_none);
            Ok(HostSpec {
                // Neither host nor hostaddr: libpq's default, the Unix-socket directory.
                host: match (host, hostaddr) {
                    (None, None) => Some(Host::Unix(default_socket_dir().to_path_buf())),
                    (host, _) => host,
                },
                hostaddr,
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
#[cfg(test)]
pub fn strip_target_session_attrs(
    conninfo: &str,
) -> Result<(String, Option<String>), ConnInfoError> {
    let (rest, removed) = strip_keys(conninfo, &["target_session_attrs"])?;
    Ok((rest, removed.into_iter().last().map(|(_, v)| v)))
}

/// Removes every `keys` parameter from a connection string of either form; returns the rest
/// and the removed pairs in order (values unquoted or percent-decoded). In a URI, libpq's
/// JDBC-compatible `ssl=true` is returned as `sslmode=require` where it stands (so the last
/// of the two wins, as in libpq).
pub fn strip_keys(
    conninfo: &str,
    keys: &[&str],
) -> Result<(String, Vec<(String, String)>), ConnInfoError> {
    if is_uri(conninfo) {
        let (uri, mut removed) = strip_uri_params(conninfo.trim(), &[keys, &["ssl"]].concat());
        for (k, v) in removed.iter_mut() {
            if k == "ssl" {
                if v != "true" {
                    return Err(ConnInfoError::Invalid(format!(
                        "invalid URI query parameter ssl={v} \
                         (only ssl=true, meaning sslmode=require, is accepted)"
                    )));
                }
                *k = "sslmode".to_string();
                *v = "require".to_string();
            }
        }
        return Ok((uri, removed));
    }
    let pairs = parse_key_values(conninfo)?;
    let (removed, kept): (Vec<_>, Vec<_>) = pairs
        .into_iter()
        .partition(|(k, _)| keys.contains(&k.as_str()));
    Ok((join_key_values(&kept), removed))
}

/// Where a URI's query begins: at the first "?" after the user info, which tokio-postgres
/// ends at the first "@" (so a password may hold a "?").
fn query_start(uri: &str) -> Option<usize> {
    let scheme_end = uri.find("://").map_or(0, |i| i + 3);
    let after_userinfo = uri[scheme_end..]
        .find('@')
        .map_or(scheme_end, |at| scheme_end + at + 1);
    uri[after_userinfo..].find('?').map(|i| after_userinfo + i)
}

/// Removes every parameter named in `names` from a URI's query; returns the URI and the
/// removed pairs in order.
fn strip_uri_params(uri: &str, names: &[&str]) -> (String, Vec<(String, String)>) {
    let Some(start) = query_start(uri) else {
        return (uri.to_string(), Vec::new());
    };
    let (base, query) = (&uri[..start], &uri[start + 1..]);
    let mut removed = Vec::new();
    let mut kept: Vec<&str> = Vec::new();
    for param in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = param.split_once('=').unwrap_or((param, ""));
        let key = percent_decode(k);
        if names.contains(&key.as_str()) {
            removed.push((key, percent_decode(v)));
        } else {
            kept.push(param);
        }
    }
    if kept.is_empty() {
        (base.to_string(), removed)
    } else {
        (format!("{base}?{}", kept.join("&")), removed)
    }
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
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
            // A word after a secret's value is most likely the rest of an unquoted secret.
            let after = match out.last() {
                Some((previous, _)) if is_secret_key(previous) => format!(
                    "the word after the value of \"{previous}\" (quote a value that holds \
                     spaces)"
                ),
                _ => format!("\"{key}\""),
            };
            return Err(ConnInfoError::Syntax(format!(
                "missing \"=\" after {after} in connection info string"
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

/// Keys whose values are secrets: libpq's `password` and `sslpassword` (the latter is not
/// supported, and so rejected, but must not be echoed either).
fn is_secret_key(key: &str) -> bool {
    key == "password" || key == "sslpassword"
}

/// A URL's user info and what follows it, given the part after `scheme://`, read so that
/// no password is cut short. tokio-postgres (and libpq) end the user info at the first "@",
/// so a password may hold "/", "?" or "#"; and what follows a literal "@" in a password
/// would become the host name. So the user info runs from the start to the last "@" before
/// the first "/" or "?" that follows the first "@". None without any "@".
pub fn split_userinfo(rest: &str) -> Option<(&str, &str)> {
    let first = rest.find('@')?;
    let end = rest[first..]
        .find(['/', '?'])
        .map_or(rest.len(), |i| first + i);
    let last = rest[..end].rfind('@')?;
    Some((&rest[..last], &rest[last + 1..]))
}

/// User info with everything after its first ":" (the password) replaced by `mask`.
pub fn mask_userinfo(userinfo: &str, mask: &str) -> String {
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{user}:{mask}"),
        None => userinfo.to_string(),
    }
}

/// The string with any password replaced by `****`, for logs and `check-config`. The
/// password file is named, never read, by anything that prints.
pub fn mask_password(conninfo: &str) -> String {
    const MASK: &str = "****";
    if is_uri(conninfo) {
        let uri = conninfo.trim();
        let (scheme, rest) = uri.split_at(uri.find("://").map_or(0, |i| i + 3));
        let (userinfo, after) = match split_userinfo(rest) {
            Some((userinfo, after)) => (format!("{}@", mask_userinfo(userinfo, MASK)), after),
            None => (String::new(), rest),
        };
        let after = match after.split_once('?') {
            Some((path, query)) => {
                // A parameter without "=" after a secret one is the rest of its value.
                let mut in_secret = false;
                let params: Vec<String> = query
                    .split('&')
                    .map(|p| match p.split_once('=') {
                        Some((k, _)) if is_secret_key(&percent_decode(k)) => {
                            in_secret = true;
                            format!("{k}={MASK}")
                        }
                        None if in_secret => MASK.to_string(),
                        _ => {
                            in_secret = false;
                            p.to_string()
                        }
                    })
                    .collect();
                format!("{path}?{}", params.join("&"))
            }
            None => after.to_string(),
        };
        return format!("{scheme}{userinfo}{after}");
    }
    match parse_key_values(conninfo) {
        Ok(pairs) => {
            let masked: Vec<(String, String)> = pairs
                .into_iter()
                .map(|(k, v)| {
                    if is_secret_key(&k) {
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
        // No host: libpq's default, the Unix-socket directory.
        assert_eq!(
            labels("dbname=x"),
            vec![format!("{}:5432", default_socket_dir().display())]
        );
        assert_eq!(
            labels("host=a,,b"),
            vec![
                "a:5432".to_string(),
                format!("{}:5432", default_socket_dir().display()),
                "b:5432".to_string()
            ]
        );
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

    /// tokio-postgres ends a URI's user info at the first "@" anywhere, so these connect
    /// with the password `p<c>ss`: it is hidden whole, and the rest of the URI still reads
    /// (the query after the password's "?" included).
    #[test]
    fn masks_passwords_holding_reserved_characters() {
        for c in ['/', '?', '#', ':'] {
            let uri = format!("postgresql://u:p{c}ss@h:5/db?sslmode=disable&application_name=x");
            assert_eq!(
                mask_password(&uri),
                "postgresql://u:****@h:5/db?sslmode=disable&application_name=x",
                "{uri}"
            );
            let info = parse(&uri);
            assert_eq!(info.tls().mode, SslMode::Disable, "{uri}: sslmode stripped");
            let config = info.host_config(&info.hosts()[0], "ccm-agent", Duration::from_secs(1));
            assert_eq!(
                config.get_password(),
                Some(format!("p{c}ss").as_bytes()),
                "{uri}"
            );
            assert_eq!(config.get_hosts(), &[Host::Tcp("h".into())], "{uri}");
        }
        // A literal "@": what follows it would be the host; masked whole, and refused by
        // a message that quotes none of it.
        let uri = "postgresql://u:p@ss9@h:5/db";
        assert_eq!(mask_password(uri), "postgresql://u:****@h:5/db");
        let e = ConnInfo::parse_with_env(uri, &no_env)
            .unwrap_err()
            .to_string();
        assert!(!e.contains("ss9"), "{e}");
        assert!(e.contains("%40"), "{e}");
        // No user info at all, an "@" in a parameter: nothing to hide, nothing hidden.
        assert_eq!(
            mask_password("postgresql://h/db?application_name=a@b"),
            "postgresql://h/db?application_name=a@b"
        );
        // A "&" in an unencoded password parameter: the rest of it is hidden too.
        assert_eq!(
            mask_password("postgresql://h/db?password=se&cret&sslmode=require"),
            "postgresql://h/db?password=****&****&sslmode=require"
        );
        // An unquoted password with a space: the word after it is not echoed.
        let e = ConnInfo::parse_with_env("host=a password=se cret9", &no_env)
            .unwrap_err()
            .to_string();
        assert!(!e.contains("cret9"), "{e}");
        assert!(e.contains("after the value of \"password\""), "{e}");
    }

    #[test]
    fn the_user_info_ends_at_the_last_at_sign_of_the_authority() {
        assert_eq!(split_userinfo("u:p@h/db"), Some(("u:p", "h/db")));
        assert_eq!(split_userinfo("u:p/s@h/db"), Some(("u:p/s", "h/db")));
        assert_eq!(
            split_userinfo("u:p@s@h/db?x=@"),
            Some(("u:p@s", "h/db?x=@"))
        );
        assert_eq!(split_userinfo("h/db"), None);
        assert_eq!(mask_userinfo("u:a:b", "*"), "u:*");
        assert_eq!(mask_userinfo("u", "*"), "u");
    }

    #[test]
    fn the_default_user_is_the_effective_users_name() {
        // libpq: PGUSER, else the effective user's name; never $USER or $LOGNAME.
        static LOGNAME_ONLY: &[(&str, &str)] = &[("LOGNAME", "someone-else")];
        let c = ConnInfo::parse_with_env("host=a", &env_of(LOGNAME_ONLY)).unwrap();
        assert_eq!(c.user(), None);
        static OS_USER: &[(&str, &str)] = &[("USER", "from-passwd")];
        let c = ConnInfo::parse_with_env("host=a", &env_of(OS_USER)).unwrap();
        assert_eq!(c.user(), Some("from-passwd"));
        // The process answers USER from the password database, whatever $USER says.
        assert_eq!(process_env("USER"), effective_user_name());
        assert!(process_env("USER").is_some(), "this test's user has a name");
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

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k: &str| {
            pairs
                .iter()
                .find(|(key, _)| *key == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn tls_keys_in_both_forms() {
        let c = parse(
            "host=a sslmode=verify-full sslrootcert=/etc/ca.crt sslcert=/c.crt sslkey=/c.key sslsni=0",
        );
        let t = c.tls();
        assert_eq!(t.mode, SslMode::VerifyFull);
        assert_eq!(t.rootcert.as_deref(), Some("/etc/ca.crt"));
        assert_eq!(t.cert.as_deref(), Some(Path::new("/c.crt")));
        assert_eq!(t.key.as_deref(), Some(Path::new("/c.key")));
        assert!(!t.sni);
        let c = parse("postgresql://u@a:1,b:2/db?sslmode=verify-ca&sslrootcert=%2Fetc%2Fca.crt&sslsni=1&connect_timeout=3");
        assert_eq!(c.tls().mode, SslMode::VerifyCa);
        assert_eq!(c.tls().rootcert.as_deref(), Some("/etc/ca.crt"));
        assert!(c.tls().sni);
        assert_eq!(c.hosts().len(), 2);
        // Every sslmode libpq knows; the default is prefer.
        for m in [
            "disable",
            "allow",
            "prefer",
            "require",
            "verify-ca",
            "verify-full",
        ] {
            assert_eq!(parse(&format!("host=a sslmode={m}")).tls().mode.as_str(), m);
        }
        assert_eq!(parse("host=a").tls().mode, SslMode::Prefer);
        assert_eq!(parse("host=a sslmode=''").tls().mode, SslMode::Prefer);
        // The last of several wins, as in libpq.
        assert_eq!(
            parse("host=a sslmode=disable sslmode=require").tls().mode,
            SslMode::Require
        );
        // JDBC's ssl=true in URIs means require.
        assert_eq!(
            parse("postgresql://a/db?ssl=true").tls().mode,
            SslMode::Require
        );
        assert_eq!(
            parse("postgresql://a/db?ssl=true&sslmode=verify-full")
                .tls()
                .mode,
            SslMode::VerifyFull
        );
        assert!(ConnInfo::parse_with_env("postgresql://a/db?ssl=yes", &no_env).is_err());
    }

    #[test]
    fn tls_values_are_checked_like_libpq() {
        let err = |s: &str| {
            ConnInfo::parse_with_env(s, &no_env)
                .unwrap_err()
                .to_string()
        };
        assert!(
            err("host=a sslmode=verify_full").contains("invalid sslmode value: \"verify_full\"")
        );
        assert!(err("host=a sslsni=yes").contains("invalid sslsni value"));
        // sslrootcert=system: verify-full by default, and nothing weaker.
        assert_eq!(
            parse("host=a sslrootcert=system").tls().mode,
            SslMode::VerifyFull
        );
        assert!(err("host=a sslrootcert=system sslmode=verify-ca")
            .contains("weak sslmode \"verify-ca\" may not be used with sslrootcert=system"));
        assert!(err("host=a sslnegotiation=direct")
            .contains("weak sslmode \"prefer\" may not be used with sslnegotiation=direct"));
        assert_eq!(
            parse("host=a sslnegotiation=direct sslmode=require")
                .tls()
                .mode,
            SslMode::Require
        );
        // Keys libpq has and the agent does not support stay errors, never silently ignored.
        for key in ["sslcrl=/x", "sslpassword=x", "sslcertmode=allow", "bogus=1"] {
            assert!(
                ConnInfo::parse_with_env(&format!("host=a {key}"), &no_env).is_err(),
                "{key}"
            );
        }
    }

    #[test]
    fn tls_environment_and_home_defaults() {
        static ENV: &[(&str, &str)] = &[
            ("PGSSLMODE", "verify-ca"),
            ("PGSSLROOTCERT", "/env/root.crt"),
            ("PGSSLCERT", "/env/c.crt"),
            ("PGSSLKEY", "/env/c.key"),
            ("PGSSLSNI", "0"),
            ("HOME", "/home/ccm"),
        ];
        let env = env_of(ENV);
        let c = ConnInfo::parse_with_env("host=a", &env).unwrap();
        let t = c.tls();
        assert_eq!(t.mode, SslMode::VerifyCa);
        assert_eq!(t.rootcert.as_deref(), Some("/env/root.crt"));
        assert_eq!(t.cert.as_deref(), Some(Path::new("/env/c.crt")));
        assert_eq!(t.key.as_deref(), Some(Path::new("/env/c.key")));
        assert!(!t.sni);
        assert_eq!(t.home.as_deref(), Some(Path::new("/home/ccm")));
        assert_eq!(c.passfile(), Some(Path::new("/home/ccm/.pgpass")));
        // The string wins over the environment.
        let c =
            ConnInfo::parse_with_env("host=a sslmode=require sslsni=1 passfile=/p", &env).unwrap();
        assert_eq!(c.tls().mode, SslMode::Require);
        assert!(c.tls().sni);
        assert_eq!(c.passfile(), Some(Path::new("/p")));
        // PGSSLMODE counts as set: with sslrootcert=system it must say verify-full.
        static SYSTEM: &[(&str, &str)] = &[("PGSSLMODE", "require"), ("PGSSLROOTCERT", "system")];
        assert!(ConnInfo::parse_with_env("host=a", &env_of(SYSTEM)).is_err());
        // PGPASSFILE over the home directory's .pgpass.
        static PASSFILE: &[(&str, &str)] = &[("PGPASSFILE", "/etc/ccm/pgpass"), ("HOME", "/h")];
        let c = ConnInfo::parse_with_env("host=a", &env_of(PASSFILE)).unwrap();
        assert_eq!(c.passfile(), Some(Path::new("/etc/ccm/pgpass")));
        // No home directory: no default files.
        assert_eq!(parse("host=a").passfile(), None);
    }

    #[test]
    fn other_environment_variables() {
        static ENV: &[(&str, &str)] = &[
            ("PGCONNECT_TIMEOUT", "7"),
            ("PGAPPNAME", "from-env"),
            ("PGOPTIONS", "-c work_mem=1MB"),
            ("PGHOSTADDR", "10.0.0.9"),
            ("PGHOST", "db1"),
        ];
        let env = env_of(ENV);
        let c = ConnInfo::parse_with_env("user=u", &env).unwrap();
        let host = &c.hosts()[0];
        assert_eq!(host.host, Some(Host::Tcp("db1".into())));
        assert_eq!(host.hostaddr, Some("10.0.0.9".parse().unwrap()));
        let hc = c.host_config(host, "ccm-agent", Duration::from_secs(9));
        assert_eq!(hc.get_connect_timeout(), Some(&Duration::from_secs(7)));
        assert_eq!(hc.get_application_name(), Some("from-env"));
        assert_eq!(hc.get_options(), Some("-c work_mem=1MB"));
        // The string's own values win; the agent's name is only the fallback.
        let c = ConnInfo::parse_with_env(
            "host=x user=u connect_timeout=1 application_name=mine options='-c a=b'",
            &env,
        )
        .unwrap();
        let hc = c.host_config(&c.hosts()[0], "ccm-agent", Duration::from_secs(9));
        assert_eq!(hc.get_application_name(), Some("mine"));
        assert_eq!(hc.get_options(), Some("-c a=b"));
        // libpq's minimum connect_timeout is 2 s.
        assert_eq!(hc.get_connect_timeout(), Some(&Duration::from_secs(2)));
        assert_eq!(c.hosts()[0].hostaddr, Some("10.0.0.9".parse().unwrap()));
        static BAD: &[(&str, &str)] = &[("PGCONNECT_TIMEOUT", "soon")];
        assert!(ConnInfo::parse_with_env("host=a", &env_of(BAD)).is_err());
    }

    #[test]
    fn hostaddr_only_gets_a_host_for_tls() {
        let c = parse("hostaddr=127.0.0.1 port=5");
        let hc = c.host_config(&c.hosts()[0], "ccm-agent", Duration::from_secs(9));
        assert_eq!(hc.get_hosts(), &[Host::Tcp("127.0.0.1".into())]);
        assert_eq!(
            hc.get_hostaddrs(),
            &["127.0.0.1".parse::<IpAddr>().unwrap()]
        );
        // The TLS mode of each attempt is the caller's: off until it says otherwise.
        assert_eq!(hc.get_ssl_mode(), PgSslMode::Disable);
    }

    #[test]
    fn password_file_lookups_follow_libpq() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("ccm-agent-conninfo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pgpass");
        std::fs::write(
            &file,
            "db1:5432:app:ccm:by-host\n\
             10.0.0.9:6000:*:ccm:by-hostaddr\n\
             localhost:5432:ccm:ccm:by-socket-and-default-db\n\
             /other/sockets:5432:*:ccm:by-socket-path\n",
        )
        .unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let passfile = format!("passfile={}", file.display());
        let password = |s: &str| -> Option<String> {
            let c = parse(&format!("{s} {passfile}"));
            let host = c.hosts()[0].clone();
            c.passfile_password(&host).map(|p| {
                assert_eq!(p.file, file);
                p.password
            })
        };
        assert_eq!(
            password("host=db1 user=ccm dbname=app").as_deref(),
            Some("by-host")
        );
        // host wins over hostaddr when both are given; hostaddr alone is looked up.
        assert_eq!(
            password("host=db1 hostaddr=10.0.0.9 port=6000 user=ccm dbname=app"),
            None
        );
        assert_eq!(
            password("hostaddr=10.0.0.9 port=6000 user=ccm dbname=app").as_deref(),
            Some("by-hostaddr")
        );
        // The default socket directory is `localhost`; dbname defaults to the user name.
        assert_eq!(
            password("user=ccm").as_deref(),
            Some("by-socket-and-default-db")
        );
        assert_eq!(
            password(&format!("host={} user=ccm", default_socket_dir().display())).as_deref(),
            Some("by-socket-and-default-db")
        );
        assert_eq!(
            password("host=/other/sockets user=ccm dbname=x").as_deref(),
            Some("by-socket-path")
        );
        // A password in the string (or PGPASSWORD) wins: the file is not read.
        assert_eq!(
            password("host=db1 user=ccm dbname=app password=given"),
            None
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn file_passwords_are_not_printed() {
        let p = FilePassword {
            password: "hunter2".into(),
            file: PathBuf::from("/p"),
        };
        assert!(!format!("{p:?}").contains("hunter2"));
        let c = parse("host=a user=u password=hunter2 sslkey=/k");
        assert!(!format!("{c:?}").contains("hunter2"));
        assert_eq!(
            mask_password("host=a sslpassword=hunter2 passfile=/p"),
            "host=a sslpassword=**** passfile=/p"
        );
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

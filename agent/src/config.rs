//! Configuration: flags and `CCM_*` variables (via clap) over a TOML file over defaults,
//! validated into one typed `Config`.
//!
//! Every key is declared once, in the `config_keys!` table below: its name (the TOML key;
//! the flag is the same in kebab-case), type, `--help` text, environment variable, default
//! and whether it is a secret. From that one row come the clap option, the TOML file's
//! field, the merge, the default and the masking in `check-config`'s output. Every source
//! is the same all-`Option` `RawConfig`, so merging is a field-by-field `or` and validation
//! happens once, on the merged result, with errors that name the key the operator has to
//! fix whichever source it came from.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cli::{GlobalArgs, LogFormat};
use crate::conninfo::{mask_password, ConnInfo};
use crate::node::Side;
use crate::walsender::SenderCheck;

/// The default of `log_level`; also what main.rs logs with should a filter not parse.
pub const DEFAULT_LOG_LEVEL: &str = "info";

/// Declares the configuration keys, one row each:
///
/// ```text
/// /// Help text (`--help`, the man page); " [default: …]" is added from the default.
/// name: Type [more clap #[arg] settings, e.g. env = "CCM_NAME"] masked with fn = default,
/// ```
///
/// Every key is a `--name` flag that may follow the subcommand. `masked with f` marks a
/// secret: `--help` does not show its variable's value and `check-config` prints `f(value)`.
/// `= default` is optional; a key without one is required.
macro_rules! config_keys {
    (@default) => { None };
    (@default $default:expr) => { Some(FromDefault::from_default($default)) };
    ($(
        $(#[doc = $doc:literal])+
        $key:ident: $ty:ty [$($arg:tt)*] $(masked with $mask:path)? $(= $default:expr)?,
    )*) => {
        /// One source's settings, every key optional. Also the TOML file's schema: unknown
        /// keys are an error so that a typo (`intervall = "5s"`) is not silently ignored.
        #[derive(Debug, Default, Clone, PartialEq, clap::Args, Deserialize, Serialize)]
        #[serde(deny_unknown_fields)]
        pub struct RawConfig {
            $(
                $(#[doc = $doc])+
                #[arg(
                    long,
                    global = true,
                    help = help_text(&[$($doc),+], RawConfig::defaults().$key.as_ref()),
                    $(hide_env_values = secret($mask),)?
                    $($arg)*
                )]
                pub $key: Option<$ty>,
            )*
        }

        impl RawConfig {
            /// Every key, in declaration order.
            #[cfg_attr(not(test), allow(dead_code))]
            pub const KEYS: &[&str] = &[$(stringify!($key)),*];

            /// The lowest source: the keys that have a default.
            pub fn defaults() -> RawConfig {
                RawConfig { $($key: config_keys!(@default $($default)?),)* }
            }

            /// `self` where set, else `lower`.
            pub fn or(self, lower: RawConfig) -> RawConfig {
                RawConfig { $($key: self.$key.or(lower.$key),)* }
            }

            /// The secrets replaced by their masked form.
            fn masked(mut self) -> RawConfig {
                $($(self.$key = self.$key.as_deref().map($mask);)?)*
                self
            }
        }
    };
}

config_keys! {
    /// Connection string of the primary (libpq key=value or URI; multi-host allowed).
    primary: String [env = "CCM_PRIMARY", value_name = "CONNINFO"] masked with mask_password,
    /// Connection string of the standbys (libpq key=value or URI): every host of it that is a
    /// standby of the primary is warmed, in the order given.
    standby: String [env = "CCM_STANDBY", value_name = "CONNINFO"] masked with mask_password,
    /// Patroni REST API base URLs, comma-separated (instead of primary and standby): the
    /// leader is the primary, the members that may become leader are warmed.
    patroni: String [env = "CCM_PATRONI", value_name = "URL[,URL...]"] masked with mask_urls,
    /// With patroni: libpq options for every member (user, dbname, sslmode, ...); host and
    /// port come from Patroni.
    member_conninfo: String [env = "CCM_MEMBER_CONNINFO", value_name = "CONNINFO"] masked with mask_password = "dbname=postgres",
    /// With patroni: also warm members tagged nofailover (or failover_priority 0).
    warm_nofailover: bool [env = "CCM_WARM_NOFAILOVER", value_name = "BOOL"] = false,
    /// With https patroni URLs: the CA file (PEM) the REST API's certificate is verified
    /// against, as Patroni's ctl.cacert; unset: the system's trust store.
    patroni_cafile: String [env = "CCM_PATRONI_CAFILE", value_name = "FILE"],
    /// With https patroni URLs: a client certificate (PEM) for a REST API that asks for one
    /// (Patroni's restapi.verify_client), as Patroni's ctl.certfile.
    patroni_certfile: String [env = "CCM_PATRONI_CERTFILE", value_name = "FILE"],
    /// The key of patroni_certfile (PEM, not encrypted, mode 0600); unset: in the certificate
    /// file.
    patroni_keyfile: String [env = "CCM_PATRONI_KEYFILE", value_name = "FILE"],
    /// Time between cycle starts.
    interval: String [env = "CCM_INTERVAL", value_name = "DURATION"] = "1s",
    // Not 9187, postgres_exporter's port, which often runs on the same host.
    /// Address for GET /metrics, /healthz and /readyz, or "off".
    metrics_listen: String [env = "CCM_METRICS_LISTEN", value_name = "ADDR"] = "127.0.0.1:9935",
    /// Log format.
    log_format: LogFormat [env = "CCM_LOG_FORMAT", value_enum] = LogFormat::Text,
    /// Log filter, tracing EnvFilter syntax, e.g. "info,ccm_agent=debug".
    log_level: String [env = "CCM_LOG_LEVEL", value_name = "FILTER"] = DEFAULT_LOG_LEVEL,
    /// False positive rate of the standby's bloom filter, 0 < p < 1.
    false_positive_rate: f64 [env = "CCM_FALSE_POSITIVE_RATE", value_name = "P"] = 0.01,
    /// Once a standby holds the whole hot set and still has unused buffers, also send it
    /// colder blocks (usage count from the threshold down to 1, hottest first), as many as its
    /// unused buffers take; it never evicts anything for them.
    fill_room: bool [env = "CCM_FILL_ROOM", value_name = "BOOL"] = true,
    /// With extension 0.5.0 on every node, move only what changed each cycle (the nodes'
    /// change feeds) instead of a bloom filter of all of a standby's buffers; false keeps the
    /// full filter exchange of earlier versions.
    change_feed: bool [env = "CCM_CHANGE_FEED", value_name = "BOOL"] = true,
    /// A standby's replay lag (WAL received but not yet replayed) above which warming it
    /// pauses for the rest of the cycle (one batch per cycle while it lasts), or "off".
    max_replay_lag: String [env = "CCM_MAX_REPLAY_LAG", value_name = "SIZE"] = "16MB",
    /// With extension 0.9.0 on the primary and a standby, also read into the standby's page
    /// cache (not its shared_buffers) the relation-file pages the primary's page cache holds,
    /// after the hot set, only into free memory (the standby's ccm.os_cache_min_free).
    os_cache: bool [env = "CCM_OS_CACHE", value_name = "BOOL"] = true,
    /// After a pass over the primary's page cache that found nothing to read on any
    /// candidate, the next pass waits this long.
    os_cache_pause: String [env = "CCM_OS_CACHE_PAUSE", value_name = "DURATION"] = "2m",
    /// A standby's own readers come first: while at least this many client sessions other
    /// than the agent's run queries on it (pg_stat_activity, eight looks once a cycle;
    /// the agent's role needs pg_read_all_stats, as pg_monitor has, to see other roles'
    /// sessions), nothing is read into its page cache (what it holds is still measured).
    /// 0: never waits.
    os_cache_busy_sessions: u32 [env = "CCM_OS_CACHE_BUSY_SESSIONS", value_name = "N"] = 1,
    /// Blocks per ccm_prewarm call on the standby, 1 to 1048576.
    batch_blocks: u64 [env = "CCM_BATCH_BLOCKS", value_name = "N"] = 4096,
    /// Per-host connect timeout.
    connect_timeout: String [env = "CCM_CONNECT_TIMEOUT", value_name = "DURATION"] = "5s",
    /// statement_timeout of the agent's sessions.
    statement_timeout: String [env = "CCM_STATEMENT_TIMEOUT", value_name = "DURATION"] = "30s",
    /// Cap of the reconnect backoff.
    max_backoff: String [env = "CCM_MAX_BACKOFF", value_name = "DURATION"] = "30s",
    /// A standby whose WAL sender is no node the agent knows (a virtual IP, a Kubernetes
    /// Service, a proxy): warn = warm it and warn once, strict = do not warm it, off = do not
    /// compare senders. A sender that is a known node other than the primary or a warmed
    /// standby is never warmed from.
    wal_sender_check: SenderCheck [env = "CCM_WAL_SENDER_CHECK", value_enum] = SenderCheck::Warn,
}

impl RawConfig {
    pub fn from_toml(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }
}

/// How `config_keys!` writes a default: a `&str` for a `String` key, else the value itself.
trait FromDefault<D> {
    fn from_default(default: D) -> Self;
}

impl<T> FromDefault<T> for T {
    fn from_default(default: T) -> T {
        default
    }
}

impl FromDefault<&str> for String {
    fn from_default(default: &str) -> String {
        default.to_string()
    }
}

/// A key's `--help`: its doc comment as clap shows one (lines joined, no final period),
/// then the default as the TOML file would say it.
fn help_text(doc: &[&str], default: Option<&impl Serialize>) -> String {
    let text = doc.iter().map(|line| line.trim()).collect::<Vec<_>>();
    let text = text.join(" ");
    let text = text.strip_suffix('.').unwrap_or(&text);
    match default {
        Some(value) => format!("{text} [default: {}]", shown(value)),
        None => text.to_string(),
    }
}

/// A value as an operator writes it after `--flag` (strings without their TOML quotes).
fn shown(value: &impl Serialize) -> String {
    match toml::Value::try_from(value) {
        Ok(toml::Value::String(text)) => text,
        Ok(other) => other.to_string(),
        Err(e) => format!("({e})"),
    }
}

/// For `config_keys!`: a key with a masking function is a secret.
fn secret(_mask: fn(&str) -> String) -> bool {
    true
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{key}: missing (set --{flag}, CCM_{env} or `{key}` in the config file)", flag = .key.replace('_', "-"), env = .key.to_uppercase())]
    Missing { key: &'static str },
    #[error("{key}: {message}")]
    Invalid { key: &'static str, message: String },
}

/// The extension's bound on one ccm_prewarm call (2^20 blocks, from 0.7.0 on): a larger
/// batch would be refused by every call, so it is refused here, before any node is asked.
pub const MAX_BATCH_BLOCKS: u64 = 1 << 20;

fn invalid(key: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        message: message.into(),
    }
}

/// `--patroni`: where the topology comes from instead of the two connection strings.
#[derive(Debug, Clone)]
pub struct PatroniSource {
    pub urls: Vec<String>,
    /// For https URLs.
    pub tls: crate::patroni::ClientTls,
    /// Every member's connection options; the host and port come from Patroni.
    pub member: ConnInfo,
    pub warm_nofailover: bool,
}

/// The validated configuration every command runs with.
#[derive(Debug, Clone)]
pub struct Config {
    /// With `patroni`, both are the member options (host and port are Patroni's).
    pub primary: ConnInfo,
    pub standby: ConnInfo,
    /// The connection strings as given (for display, always through `mask_password`); empty
    /// with `patroni`.
    pub primary_conninfo: String,
    pub standby_conninfo: String,
    pub patroni: Option<PatroniSource>,
    pub patroni_urls: Option<String>,
    pub member_conninfo: String,
    pub warm_nofailover: bool,
    pub patroni_cafile: Option<PathBuf>,
    pub patroni_certfile: Option<PathBuf>,
    pub patroni_keyfile: Option<PathBuf>,
    pub interval: Duration,
    /// `None` when metrics are switched off.
    pub metrics_listen: Option<SocketAddr>,
    pub log_format: LogFormat,
    pub log_level: String,
    pub false_positive_rate: f64,
    pub fill_room: bool,
    pub change_feed: bool,
    pub os_cache: bool,
    pub os_cache_pause: Duration,
    pub os_cache_busy_sessions: u32,
    /// In bytes; None: off.
    pub max_replay_lag: Option<u64>,
    pub batch_blocks: u64,
    pub connect_timeout: Duration,
    pub statement_timeout: Duration,
    pub max_backoff: Duration,
    pub wal_sender_check: SenderCheck,
}

impl Config {
    /// Flags and env (already merged by clap) over the file named by `--config` over defaults.
    pub fn load(args: &GlobalArgs) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => RawConfig::default(),
        };
        Config::validate(args.keys.clone().or(file))
    }

    /// `raw` over the defaults, checked and typed.
    pub fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
        let raw = raw.or(RawConfig::defaults());
        // The key's value; only a key without a default can be missing.
        macro_rules! value {
            ($key:ident) => {
                raw.$key.ok_or(ConfigError::Missing {
                    key: stringify!($key),
                })?
            };
        }
        let patroni_tls = patroni_tls(&raw)?;
        let member_conninfo = value!(member_conninfo);
        let warm_nofailover = value!(warm_nofailover);
        let patroni_urls = raw.patroni.clone();
        let (primary_conninfo, standby_conninfo, primary, standby, patroni) = match &patroni_urls {
            Some(urls) => {
                if raw.primary.is_some() || raw.standby.is_some() {
                    return Err(invalid(
                        "patroni",
                        "replaces primary and standby (Patroni names the nodes); give the \
                         connection options in member_conninfo",
                    ));
                }
                let urls = patroni_url_list(urls)?;
                let member = ConnInfo::parse(&member_conninfo)
                    .map_err(|e| invalid("member_conninfo", e.to_string()))?;
                let source = PatroniSource {
                    urls,
                    tls: patroni_tls.clone(),
                    member: member.clone(),
                    warm_nofailover,
                };
                (
                    String::new(),
                    String::new(),
                    member.clone(),
                    member,
                    Some(source),
                )
            }
            None => {
                let primary_conninfo = value!(primary);
                let standby_conninfo = value!(standby);
                let primary = conninfo("primary", &primary_conninfo, Side::Primary)?;
                let standby = conninfo("standby", &standby_conninfo, Side::Standby)?;
                (primary_conninfo, standby_conninfo, primary, standby, None)
            }
        };

        let interval = duration("interval", &value!(interval))?;
        let connect_timeout = duration("connect_timeout", &value!(connect_timeout))?;
        let statement_timeout = duration("statement_timeout", &value!(statement_timeout))?;
        let max_backoff = duration("max_backoff", &value!(max_backoff))?;
        let os_cache_pause = duration("os_cache_pause", &value!(os_cache_pause))?;
        if statement_timeout < Duration::from_millis(1) {
            // PostgreSQL's unit is the millisecond; less would round to 0 = no timeout at all.
            return Err(invalid("statement_timeout", "must be at least 1ms"));
        }

        let metrics_listen = match value!(metrics_listen).trim() {
            "off" => None,
            addr => Some(addr.parse::<SocketAddr>().map_err(|_| {
                invalid(
                    "metrics_listen",
                    format!("\"{addr}\" is neither \"off\" nor an IP:port such as 127.0.0.1:9935"),
                )
            })?),
        };

        let log_level = value!(log_level);
        tracing_subscriber::EnvFilter::try_new(&log_level)
            .map_err(|e| invalid("log_level", format!("\"{log_level}\": {e}")))?;

        let false_positive_rate = value!(false_positive_rate);
        // The extension refuses rates below this (a filter would grow without bound).
        let min_rate = ccm_codec::FILTER_MIN_FALSE_POSITIVE_RATE;
        if !(min_rate..1.0).contains(&false_positive_rate) {
            return Err(invalid(
                "false_positive_rate",
                format!("{false_positive_rate} is not at least {min_rate} and less than 1"),
            ));
        }

        let batch_blocks = value!(batch_blocks);
        if batch_blocks == 0 {
            return Err(invalid("batch_blocks", "must be at least 1"));
        }
        if batch_blocks > MAX_BATCH_BLOCKS {
            return Err(invalid(
                "batch_blocks",
                format!(
                    "{batch_blocks} is more than {MAX_BATCH_BLOCKS}, the most blocks ccm_prewarm \
                     takes in one call"
                ),
            ));
        }

        Ok(Config {
            primary,
            standby,
            primary_conninfo,
            standby_conninfo,
            patroni,
            patroni_urls,
            member_conninfo,
            warm_nofailover,
            patroni_cafile: patroni_tls.cafile,
            patroni_certfile: patroni_tls.certfile,
            patroni_keyfile: patroni_tls.keyfile,
            interval,
            metrics_listen,
            log_format: value!(log_format),
            log_level,
            false_positive_rate,
            fill_room: value!(fill_room),
            change_feed: value!(change_feed),
            os_cache: value!(os_cache),
            os_cache_pause,
            os_cache_busy_sessions: value!(os_cache_busy_sessions),
            max_replay_lag: size("max_replay_lag", &value!(max_replay_lag))?,
            batch_blocks,
            connect_timeout,
            statement_timeout,
            max_backoff,
            wal_sender_check: value!(wal_sender_check),
        })
    }

    /// The effective configuration as a file would say it, every key set, secrets in clear.
    fn effective(&self) -> RawConfig {
        let with_hosts = self.patroni.is_none();
        RawConfig {
            primary: with_hosts.then(|| self.primary_conninfo.clone()),
            standby: with_hosts.then(|| self.standby_conninfo.clone()),
            patroni: self.patroni_urls.clone(),
            member_conninfo: Some(self.member_conninfo.clone()),
            warm_nofailover: Some(self.warm_nofailover),
            patroni_cafile: shown_path(&self.patroni_cafile),
            patroni_certfile: shown_path(&self.patroni_certfile),
            patroni_keyfile: shown_path(&self.patroni_keyfile),
            interval: Some(format_duration(self.interval)),
            metrics_listen: Some(match self.metrics_listen {
                Some(addr) => addr.to_string(),
                None => "off".to_string(),
            }),
            log_format: Some(self.log_format),
            log_level: Some(self.log_level.clone()),
            false_positive_rate: Some(self.false_positive_rate),
            fill_room: Some(self.fill_room),
            change_feed: Some(self.change_feed),
            os_cache: Some(self.os_cache),
            os_cache_pause: Some(format_duration(self.os_cache_pause)),
            os_cache_busy_sessions: Some(self.os_cache_busy_sessions),
            max_replay_lag: Some(
                self.max_replay_lag
                    .map_or_else(|| "off".to_string(), format_size),
            ),
            batch_blocks: Some(self.batch_blocks),
            connect_timeout: Some(format_duration(self.connect_timeout)),
            statement_timeout: Some(format_duration(self.statement_timeout)),
            max_backoff: Some(format_duration(self.max_backoff)),
            wal_sender_check: Some(self.wal_sender_check),
        }
    }

    /// The effective configuration as a TOML file would say it, passwords masked. It reads
    /// back as a valid config file (with the real passwords put back).
    pub fn to_toml_masked(&self) -> String {
        toml::to_string(&self.effective().masked())
            .expect("a flat struct of strings and numbers serializes")
    }
}

impl Config {
    /// The keys whose effective values differ from `self` to `new`, as (key, old, new), in
    /// the words of `to_toml_masked` (passwords masked).
    pub fn changes(&self, new: &Config) -> Vec<(String, String, String)> {
        let table = |config: &Config| -> toml::Table {
            config
                .to_toml_masked()
                .parse()
                .expect("to_toml_masked writes valid TOML")
        };
        let (before, after) = (table(self), table(new));
        let mut keys: Vec<&String> = before.keys().chain(after.keys()).collect();
        keys.sort();
        keys.dedup();
        let shown = |table: &toml::Table, key: &str| {
            table
                .get(key)
                .map_or_else(|| "(unset)".to_string(), |v| v.to_string())
        };
        keys.into_iter()
            .filter(|key| before.get(*key) != after.get(*key))
            .map(|key| (key.clone(), shown(&before, key), shown(&after, key)))
            .collect()
    }
}

fn read_file(path: &Path) -> Result<RawConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    RawConfig::from_toml(&text).map_err(|e| {
        // toml's own rendering draws the line with carets over several lines; one line that
        // names the line number and the key reads better in a log.
        ConfigError::Parse {
            path: path.to_path_buf(),
            message: toml_error_line(&text, &e),
        }
    })
}

/// "line N (`the line`): message", which names the key even when toml's message does not.
fn toml_error_line(text: &str, e: &toml::de::Error) -> String {
    let message = e.message().trim();
    let Some(span) = e.span() else {
        return message.to_string();
    };
    let start = span.start.min(text.len());
    let number = text[..start].matches('\n').count() + 1;
    let line = text.lines().nth(number - 1).unwrap_or("").trim();
    format!("line {number} (`{line}`): {message}")
}

fn conninfo(key: &'static str, value: &str, side: Side) -> Result<ConnInfo, ConfigError> {
    let info = ConnInfo::parse(value).map_err(|e| invalid(key, e.to_string()))?;
    if let Some(tsa) = info.target_session_attrs() {
        if !tsa.compatible_with_recovery(side.wants_recovery()) {
            return Err(invalid(
                key,
                format!(
                    "target_session_attrs={} contradicts the {key} side, which needs a node {}",
                    tsa.as_str(),
                    if side.wants_recovery() {
                        "in recovery (a standby)"
                    } else {
                        "not in recovery (a primary)"
                    }
                ),
            ));
        }
    }
    Ok(info)
}

/// The comma-separated URLs of `patroni`: each http:// or https://, at least one.
fn patroni_url_list(text: &str) -> Result<Vec<String>, ConfigError> {
    let urls: Vec<String> = text
        .split(',')
        .map(|url| url.trim().trim_end_matches('/').to_string())
        .filter(|url| !url.is_empty())
        .collect();
    if urls.is_empty() {
        return Err(invalid("patroni", "names no URL"));
    }
    for url in &urls {
        crate::patroni::validate_url(url).map_err(|e| invalid("patroni", e.to_string()))?;
    }
    Ok(urls)
}

/// `patroni_cafile`, `patroni_certfile` and `patroni_keyfile`: only with `patroni`, the
/// key only with a certificate. The files are read per request (renewals need no restart);
/// a missing one is told then, as for the connection strings' files.
fn patroni_tls(raw: &RawConfig) -> Result<crate::patroni::ClientTls, ConfigError> {
    let path = |value: &Option<String>| {
        value
            .as_deref()
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let tls = crate::patroni::ClientTls {
        cafile: path(&raw.patroni_cafile),
        certfile: path(&raw.patroni_certfile),
        keyfile: path(&raw.patroni_keyfile),
    };
    if raw.patroni.is_none() {
        for (key, set) in [
            ("patroni_cafile", tls.cafile.is_some()),
            ("patroni_certfile", tls.certfile.is_some()),
            ("patroni_keyfile", tls.keyfile.is_some()),
        ] {
            if set {
                return Err(invalid(key, "applies only with patroni"));
            }
        }
    }
    if tls.keyfile.is_some() && tls.certfile.is_none() {
        return Err(invalid(
            "patroni_keyfile",
            "needs patroni_certfile (the certificate the key belongs to)",
        ));
    }
    Ok(tls)
}

fn shown_path(path: &Option<PathBuf>) -> Option<String> {
    path.as_ref().map(|p| p.display().to_string())
}

/// URLs with the password of their user info masked (http://user:****@host:8008).
pub fn mask_urls(text: &str) -> String {
    text.split(',')
        .map(crate::patroni::mask_url)
        .collect::<Vec<_>>()
        .join(",")
}

fn duration(key: &'static str, text: &str) -> Result<Duration, ConfigError> {
    let d = humantime::parse_duration(text.trim()).map_err(|e| {
        invalid(
            key,
            format!("\"{text}\" is not a duration such as 500ms, 1s or 2m ({e})"),
        )
    })?;
    if d.is_zero() {
        return Err(invalid(key, "must be greater than zero"));
    }
    if d > MAX_DURATION {
        return Err(invalid(
            key,
            format!(
                "\"{}\" is more than {}",
                text.trim(),
                format_duration(MAX_DURATION)
            ),
        ));
    }
    Ok(d)
}

/// The longest any duration key may be: far above any sensible value, and low enough that
/// `interval * 3`, `now + interval` and a statement_timeout in milliseconds (PostgreSQL's
/// limit is 2147483647ms, about 24.8 days) cannot overflow (review L1).
const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// A size as PostgreSQL writes one (`16MB`, `512kB`, `1GB`, bytes without a unit; units of
/// 1024), or "off": None.
fn size(key: &'static str, text: &str) -> Result<Option<u64>, ConfigError> {
    let text = text.trim();
    if text == "off" {
        return Ok(None);
    }
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let factor: u64 = match unit.trim() {
        "" | "B" => 1,
        "kB" => 1 << 10,
        "MB" => 1 << 20,
        "GB" => 1 << 30,
        "TB" => 1 << 40,
        _ => 0,
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(factor))
        .filter(|&bytes| bytes > 0)
        .map(Some)
        .ok_or_else(|| {
            invalid(
                key,
                format!("\"{text}\" is neither \"off\" nor a size such as 512kB, 1MB or 1GB"),
            )
        })
}

/// A size in the largest unit of `size()` that divides it.
pub fn format_size(bytes: u64) -> String {
    ["TB", "GB", "MB", "kB"]
        .iter()
        .zip([40, 30, 20, 10])
        .find(|&(_, shift)| bytes.is_multiple_of(1u64 << shift))
        .map_or_else(
            || bytes.to_string(),
            |(unit, shift)| format!("{}{unit}", bytes >> shift),
        )
}

pub fn format_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn base() -> RawConfig {
        RawConfig {
            primary: Some("host=p port=5432 user=postgres password=secret".into()),
            standby: Some("host=s port=5433 user=postgres".into()),
            ..Default::default()
        }
    }

    #[test]
    fn replay_lag_sizes_read_as_postgresql_writes_them() {
        assert_eq!(size("k", "1MB").unwrap(), Some(1 << 20));
        assert_eq!(size("k", "512kB").unwrap(), Some(512 << 10));
        assert_eq!(size("k", "4096").unwrap(), Some(4096));
        assert_eq!(size("k", " off ").unwrap(), None);
        for bad in ["", "0", "1mb", "MB", "-1MB", "99999999999TB", "1.5MB"] {
            assert!(size("k", bad).is_err(), "{bad:?}");
        }
        assert_eq!(format_size(1 << 20), "1MB");
        assert_eq!(format_size(3 << 30), "3GB");
        assert_eq!(format_size(1536), "1536");
    }

    #[test]
    fn changes_name_the_keys_and_mask_passwords() {
        let old = Config::validate(base()).unwrap();
        assert!(old.changes(&old.clone()).is_empty());
        let new = Config::validate(RawConfig {
            primary: Some("host=p2 port=5432 user=postgres password=other".into()),
            interval: Some("200ms".into()),
            ..base()
        })
        .unwrap();
        let changes = old.changes(&new);
        let keys: Vec<&str> = changes.iter().map(|(key, _, _)| key.as_str()).collect();
        assert_eq!(keys, ["interval", "primary"]);
        let text = format!("{changes:?}");
        assert!(
            !text.contains("secret") && !text.contains("other"),
            "{text}"
        );
        assert!(text.contains("host=p2"), "{text}");
    }

    fn key_of(e: ConfigError) -> &'static str {
        match e {
            ConfigError::Invalid { key, .. } | ConfigError::Missing { key } => key,
            other => panic!("not a key error: {other}"),
        }
    }

    /// Passwords holding "/", "?", "#" or "@" never reach check-config's output, the reload
    /// log's list of changes, nor a validation error, for connection URIs and Patroni URLs.
    #[test]
    fn passwords_with_reserved_characters_never_print() {
        for c in ['/', '?', '#', '@'] {
            let secret = format!("p{c}ss9word");
            let uri = |host: &str| format!("postgresql://ccm:{secret}@{host}:5432/postgres");
            let url = format!("http://patroni:{secret}@10.0.0.1:8008");
            let configs = [
                RawConfig {
                    primary: Some(uri("p")),
                    standby: Some(uri("s")),
                    ..Default::default()
                },
                RawConfig {
                    patroni: Some(url.clone()),
                    member_conninfo: Some(format!("user=ccm password='{secret}'")),
                    ..Default::default()
                },
            ];
            for raw in configs {
                let mut printed = Vec::new();
                match Config::validate(raw.clone()) {
                    Ok(config) => {
                        printed.push(config.to_toml_masked());
                        let mut other = raw.clone();
                        other.interval = Some("2s".into());
                        let other = Config::validate(other).unwrap();
                        printed.push(format!("{:?}", other.changes(&config)));
                        printed.push(format!("{:?}", config.changes(&other)));
                    }
                    Err(e) => printed.push(e.to_string()),
                }
                printed.push(toml::to_string(&raw.clone().masked()).unwrap());
                for text in printed {
                    assert!(!text.contains("ss9word"), "{c}: {text}");
                }
            }
        }
        // Between two such passwords, the list of changes shows neither.
        let old = Config::validate(RawConfig {
            primary: Some("postgresql://ccm:a/b@p/postgres".into()),
            standby: Some("host=s".into()),
            ..Default::default()
        })
        .unwrap();
        let new = Config::validate(RawConfig {
            primary: Some("postgresql://ccm:c?d@p/postgres".into()),
            ..RawConfig {
                standby: Some("host=s".into()),
                ..Default::default()
            }
        })
        .unwrap();
        let changes = format!("{:?}", old.changes(&new));
        assert!(
            !changes.contains("a/b") && !changes.contains("c?d"),
            "{changes}"
        );
    }

    #[test]
    fn absurd_durations_are_refused() {
        for key in [
            "interval",
            "connect_timeout",
            "statement_timeout",
            "max_backoff",
        ] {
            let set = |value: &str| {
                let mut table = table(&base());
                table.insert(key.to_string(), toml::Value::String(value.to_string()));
                Config::validate(RawConfig::from_toml(&table.to_string()).unwrap())
            };
            assert!(set("1day").is_ok(), "{key}");
            let err = set("1day 1s").unwrap_err().to_string();
            assert_eq!(err, format!("{key}: \"1day 1s\" is more than 1day"));
            assert!(set("500000000years").is_err(), "{key}");
        }
    }

    #[test]
    fn defaults_apply() {
        let c = Config::validate(base()).unwrap();
        assert_eq!(c.interval, Duration::from_secs(1));
        assert_eq!(c.metrics_listen, Some("127.0.0.1:9935".parse().unwrap()));
        assert_eq!(c.log_format, LogFormat::Text);
        assert_eq!(c.log_level, "info");
        assert_eq!(c.false_positive_rate, 0.01);
        assert_eq!(c.batch_blocks, 4096);
        assert_eq!(c.connect_timeout, Duration::from_secs(5));
        assert_eq!(c.statement_timeout, Duration::from_secs(30));
        assert_eq!(c.max_backoff, Duration::from_secs(30));
    }

    #[test]
    fn higher_source_wins_field_by_field() {
        let file = RawConfig::from_toml(
            r#"
            primary = "host=file-p"
            standby = "host=file-s"
            interval = "5s"
            batch_blocks = 100
            log_format = "json"
            "#,
        )
        .unwrap();
        let cli = RawConfig {
            primary: Some("host=cli-p".into()),
            interval: Some("200ms".into()),
            ..Default::default()
        };
        let c = Config::validate(cli.or(file)).unwrap();
        assert_eq!(c.primary_conninfo, "host=cli-p");
        assert_eq!(c.standby_conninfo, "host=file-s");
        assert_eq!(c.interval, Duration::from_millis(200));
        assert_eq!(c.batch_blocks, 100);
        assert_eq!(c.log_format, LogFormat::Json);
    }

    #[test]
    fn flag_beats_env_beats_file() {
        // Only this test touches CCM_MAX_BACKOFF, so the process-wide variable is safe here.
        std::env::set_var("CCM_MAX_BACKOFF", "7s");
        let file = RawConfig {
            max_backoff: Some("9s".into()),
            ..base()
        };
        let with_flag =
            crate::cli::Cli::try_parse_from(["ccm-agent", "run", "--max-backoff", "3s"]).unwrap();
        let without_flag = crate::cli::Cli::try_parse_from(["ccm-agent", "run"]).unwrap();
        std::env::remove_var("CCM_MAX_BACKOFF");
        let c = Config::validate(with_flag.global.keys.or(file.clone())).unwrap();
        assert_eq!(c.max_backoff, Duration::from_secs(3));
        let c = Config::validate(without_flag.global.keys.or(file.clone())).unwrap();
        assert_eq!(c.max_backoff, Duration::from_secs(7));
        let c = Config::validate(RawConfig::default().or(file)).unwrap();
        assert_eq!(c.max_backoff, Duration::from_secs(9));
    }

    #[test]
    fn validation_names_the_key() {
        let cases: Vec<(RawConfig, &str)> = vec![
            (
                RawConfig {
                    primary: None,
                    ..base()
                },
                "primary",
            ),
            (
                RawConfig {
                    standby: None,
                    ..base()
                },
                "standby",
            ),
            (
                RawConfig {
                    primary: Some("host=a port=x".into()),
                    ..base()
                },
                "primary",
            ),
            (
                RawConfig {
                    standby: Some("host='open".into()),
                    ..base()
                },
                "standby",
            ),
            (
                RawConfig {
                    interval: Some("soon".into()),
                    ..base()
                },
                "interval",
            ),
            (
                RawConfig {
                    interval: Some("0s".into()),
                    ..base()
                },
                "interval",
            ),
            (
                RawConfig {
                    connect_timeout: Some("-1s".into()),
                    ..base()
                },
                "connect_timeout",
            ),
            (
                RawConfig {
                    statement_timeout: Some("10us".into()),
                    ..base()
                },
                "statement_timeout",
            ),
            (
                RawConfig {
                    max_backoff: Some("x".into()),
                    ..base()
                },
                "max_backoff",
            ),
            (
                RawConfig {
                    metrics_listen: Some("localhost".into()),
                    ..base()
                },
                "metrics_listen",
            ),
            (
                RawConfig {
                    log_level: Some("info,[[[".into()),
                    ..base()
                },
                "log_level",
            ),
            (
                RawConfig {
                    false_positive_rate: Some(0.0),
                    ..base()
                },
                "false_positive_rate",
            ),
            (
                RawConfig {
                    false_positive_rate: Some(1.0),
                    ..base()
                },
                "false_positive_rate",
            ),
            (
                RawConfig {
                    false_positive_rate: Some(1e-7),
                    ..base()
                },
                "false_positive_rate",
            ),
            (
                RawConfig {
                    false_positive_rate: Some(f64::NAN),
                    ..base()
                },
                "false_positive_rate",
            ),
            (
                RawConfig {
                    batch_blocks: Some(0),
                    ..base()
                },
                "batch_blocks",
            ),
            (
                RawConfig {
                    batch_blocks: Some(MAX_BATCH_BLOCKS + 1),
                    ..base()
                },
                "batch_blocks",
            ),
            (
                RawConfig {
                    batch_blocks: Some(u64::MAX),
                    ..base()
                },
                "batch_blocks",
            ),
            (
                RawConfig {
                    primary: Some("host=a target_session_attrs=standby".into()),
                    ..base()
                },
                "primary",
            ),
            (
                RawConfig {
                    standby: Some("host=a target_session_attrs=read-write".into()),
                    ..base()
                },
                "standby",
            ),
        ];
        for (raw, key) in cases {
            let shown = format!("{raw:?}");
            let err = Config::validate(raw).expect_err(&shown);
            let message = err.to_string();
            assert!(message.starts_with(key), "{message}");
            assert_eq!(key_of(err), key, "{shown}");
        }
    }

    #[test]
    fn batch_blocks_is_bounded_by_what_ccm_prewarm_takes() {
        let with = |n: u64| {
            Config::validate(RawConfig {
                batch_blocks: Some(n),
                ..base()
            })
        };
        assert_eq!(with(MAX_BATCH_BLOCKS).unwrap().batch_blocks, 1_048_576);
        assert_eq!(
            with(MAX_BATCH_BLOCKS + 1).unwrap_err().to_string(),
            "batch_blocks: 1048577 is more than 1048576, the most blocks ccm_prewarm takes in one call"
        );
    }

    #[test]
    fn missing_key_message_says_where_to_set_it() {
        let err = Config::validate(RawConfig {
            primary: None,
            ..base()
        })
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "primary: missing (set --primary, CCM_PRIMARY or `primary` in the config file)"
        );
    }

    #[test]
    fn compatible_target_session_attrs_are_accepted() {
        let raw = RawConfig {
            primary: Some("host=a,b target_session_attrs=read-write".into()),
            standby: Some("postgresql://a,b/db?target_session_attrs=prefer-standby".into()),
            ..Default::default()
        };
        Config::validate(raw).unwrap();
    }

    #[test]
    fn metrics_can_be_switched_off() {
        let c = Config::validate(RawConfig {
            metrics_listen: Some("off".into()),
            ..base()
        })
        .unwrap();
        assert_eq!(c.metrics_listen, None);
    }

    #[test]
    fn unknown_file_key_is_rejected() {
        let err = RawConfig::from_toml("primary = \"host=a\"\nintervall = \"5s\"\n").unwrap_err();
        assert!(err.to_string().contains("intervall"), "{err}");
        let dir = std::env::temp_dir().join(format!("ccm-agent-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.toml");
        std::fs::write(&path, "primary = \"host=a\"\nbogus = 1\n").unwrap();
        let args = crate::cli::GlobalArgs {
            config: Some(path.clone()),
            ..Default::default()
        };
        let err = Config::load(&args).unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }), "{err}");
        assert!(err.to_string().contains("bogus"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn file_errors_name_line_and_key() {
        let text = "primary = \"x\"\n\nbatch_blocks = \"many\"\n";
        let e = RawConfig::from_toml(text).unwrap_err();
        let message = toml_error_line(text, &e);
        assert!(
            message.starts_with("line 3 (`batch_blocks = \"many\"`): "),
            "{message}"
        );
        let text = "interval = \"2s\"\nbatch_size = 5\n";
        let e = RawConfig::from_toml(text).unwrap_err();
        let message = toml_error_line(text, &e);
        assert!(
            message.starts_with("line 2 (`batch_size = 5`): unknown field `batch_size`"),
            "{message}"
        );
    }

    #[test]
    fn wrong_type_in_file_names_the_key() {
        let err = RawConfig::from_toml("batch_blocks = \"many\"\n").unwrap_err();
        assert!(err.to_string().contains("batch_blocks"), "{err}");
        let err = RawConfig::from_toml("log_format = \"xml\"\n").unwrap_err();
        assert!(err.to_string().contains("log_format"), "{err}");
    }

    #[test]
    fn example_file_is_valid() {
        let raw = RawConfig::from_toml(include_str!("../ccm-agent.example.toml")).unwrap();
        let c = Config::validate(raw).unwrap();
        assert_eq!(c.primary.hosts().len(), 2);
        assert_eq!(Some(c.batch_blocks), RawConfig::defaults().batch_blocks);
    }

    #[test]
    fn missing_file_is_an_error() {
        let args = crate::cli::GlobalArgs {
            config: Some("/nonexistent/ccm-agent.toml".into()),
            ..Default::default()
        };
        assert!(matches!(Config::load(&args), Err(ConfigError::Read { .. })));
    }

    #[test]
    fn effective_config_masks_passwords_and_reads_back() {
        let c = Config::validate(RawConfig {
            interval: Some("1500ms".into()),
            metrics_listen: Some("off".into()),
            ..base()
        })
        .unwrap();
        let text = c.to_toml_masked();
        assert!(!text.contains("secret"), "{text}");
        assert!(text.contains("password=****"), "{text}");
        let back = RawConfig::from_toml(&text).unwrap();
        let c2 = Config::validate(back).unwrap();
        assert_eq!(c2.interval, Duration::from_millis(1500));
        assert_eq!(c2.metrics_listen, None);
        assert_eq!(c2.batch_blocks, c.batch_blocks);
        assert_eq!(c2.statement_timeout, c.statement_timeout);
    }

    /// Every key set, none to its default, each as `to_toml_masked` writes it. A struct
    /// literal without `..`: a new key does not compile until it is given a value here.
    fn every_key() -> RawConfig {
        RawConfig {
            primary: Some("host=p port=5432 user=postgres password=secret".into()),
            standby: Some("postgresql://ccm:hidden@s:5433/postgres".into()),
            interval: Some("2s".into()),
            metrics_listen: Some("off".into()),
            log_format: Some(LogFormat::Json),
            log_level: Some("info,ccm_agent=debug".into()),
            false_positive_rate: Some(0.05),
            fill_room: Some(false),
            change_feed: Some(false),
            os_cache: Some(false),
            os_cache_pause: Some("5m".into()),
            os_cache_busy_sessions: Some(3),
            max_replay_lag: Some("64MB".into()),
            batch_blocks: Some(100),
            connect_timeout: Some("3s".into()),
            statement_timeout: Some("1m".into()),
            max_backoff: Some("2m".into()),
            patroni: Some("http://a:8008,https://patroni:pw@b:8008".into()),
            member_conninfo: Some("user=ccm password=secret dbname=app".into()),
            warm_nofailover: Some(true),
            patroni_cafile: Some("/etc/ccm-agent/rest-ca.crt".into()),
            patroni_certfile: Some("/etc/ccm-agent/agent.crt".into()),
            patroni_keyfile: Some("/etc/ccm-agent/agent.key".into()),
            wal_sender_check: Some(SenderCheck::Strict),
        }
    }

    /// `every_key()` as two valid configurations: with the connection strings, and with
    /// Patroni (which replaces them).
    fn every_key_valid() -> [RawConfig; 2] {
        let given = every_key();
        [
            RawConfig {
                patroni: None,
                patroni_cafile: None,
                patroni_certfile: None,
                patroni_keyfile: None,
                ..given.clone()
            },
            RawConfig {
                primary: None,
                standby: None,
                ..given
            },
        ]
    }

    fn table(raw: &RawConfig) -> toml::Table {
        toml::to_string(raw).unwrap().parse().unwrap()
    }

    #[test]
    fn every_key_reaches_the_masked_toml_and_reads_back() {
        let given = every_key();
        let (set, defaults) = (table(&given), table(&RawConfig::defaults()));
        for key in RawConfig::KEYS {
            assert_ne!(
                set.get(*key),
                defaults.get(*key),
                "{key}: give it a value that is not its default"
            );
        }
        let mut keys: Vec<String> = Vec::new();
        for given in every_key_valid() {
            let text = Config::validate(given.clone()).unwrap().to_toml_masked();
            let written: toml::Table = text.parse().unwrap();
            keys.extend(written.keys().cloned());
            assert!(
                !text.contains("secret") && !text.contains("hidden") && !text.contains(":pw@"),
                "{text}"
            );
            let back = RawConfig::from_toml(&text).unwrap();
            assert_eq!(back, given.masked(), "{text}");
            assert_eq!(Config::validate(back).unwrap().to_toml_masked(), text);
        }
        keys.sort_unstable();
        keys.dedup();
        let mut expected = RawConfig::KEYS.to_vec();
        expected.sort_unstable();
        assert_eq!(keys, expected);
    }

    #[test]
    fn patroni_replaces_the_connection_strings() {
        let err = Config::validate(every_key()).unwrap_err().to_string();
        assert!(
            err.starts_with("patroni: replaces primary and standby"),
            "{err}"
        );
        let [_, patroni] = every_key_valid();
        let c = Config::validate(patroni).unwrap();
        let source = c.patroni.as_ref().unwrap();
        assert_eq!(source.urls, ["http://a:8008", "https://patroni:pw@b:8008"]);
        assert!(source.warm_nofailover);
        assert_eq!(
            source.tls.cafile.as_deref(),
            Some(Path::new("/etc/ccm-agent/rest-ca.crt"))
        );
        assert_eq!(
            source.tls.keyfile.as_deref(),
            Some(Path::new("/etc/ccm-agent/agent.key"))
        );
        // The REST API's TLS files belong to patroni, and a key to its certificate.
        let err = Config::validate(RawConfig {
            patroni_cafile: Some("/ca.crt".into()),
            ..base()
        })
        .unwrap_err()
        .to_string();
        assert_eq!(err, "patroni_cafile: applies only with patroni");
        let [_, patroni] = every_key_valid();
        let err = Config::validate(RawConfig {
            patroni_certfile: None,
            ..patroni
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("patroni_keyfile: needs patroni_certfile"),
            "{err}"
        );
        let bad = RawConfig {
            patroni: Some("node1:8008".into()),
            ..Default::default()
        };
        let err = Config::validate(bad).unwrap_err().to_string();
        assert!(err.starts_with("patroni: "), "{err}");
        // Without Patroni the two strings are required.
        let err = Config::validate(RawConfig::default())
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("primary: missing"), "{err}");
    }

    #[test]
    fn every_key_is_a_flag_and_a_variable() {
        use clap::CommandFactory;
        let given = every_key();
        let (set, masked) = (table(&given), table(&given.clone().masked()));
        let mut argv = vec!["ccm-agent".to_string(), "run".to_string()];
        for (key, value) in &set {
            argv.extend([format!("--{}", key.replace('_', "-")), shown(value)]);
        }
        let cli = crate::cli::Cli::try_parse_from(argv).unwrap();
        assert_eq!(cli.global.keys, given);

        let command = crate::cli::Cli::command();
        let option = |key: &str| {
            command
                .get_arguments()
                .find(|arg| arg.get_id() == key)
                .unwrap_or_else(|| panic!("{key} is no option"))
        };
        for key in RawConfig::KEYS {
            let arg = option(key);
            assert_eq!(arg.get_long(), Some(key.replace('_', "-").as_str()));
            let env = format!("CCM_{}", key.to_uppercase());
            assert_eq!(arg.get_env(), Some(std::ffi::OsStr::new(&env)), "{key}");
            assert!(arg.is_global_set(), "{key}");
            let secret = set.get(*key) != masked.get(*key);
            assert_eq!(arg.is_hide_env_values_set(), secret, "{key}");
        }
        let help = |key: &str| option(key).get_help().unwrap().to_string();
        assert_eq!(help("interval"), "Time between cycle starts [default: 1s]");
        assert_eq!(help("log_format"), "Log format [default: text]");
        assert_eq!(
            help("false_positive_rate"),
            "False positive rate of the standby's bloom filter, 0 < p < 1 [default: 0.01]"
        );
        assert_eq!(
            help("primary"),
            "Connection string of the primary (libpq key=value or URI; multi-host allowed)"
        );
    }
}

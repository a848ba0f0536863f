//! Configuration: flags and `CCM_*` variables (via clap) over a TOML file over defaults,
//! validated into one typed `Config`.
//!
//! Every source is first turned into the same all-`Option` `RawConfig`, so merging is a
//! field-by-field `or` and validation happens once, on the merged result, with errors that
//! name the key the operator has to fix whichever source it came from.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cli::{GlobalArgs, LogFormat};
use crate::conninfo::{mask_password, ConnInfo};
use crate::node::Side;

pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
/// Not 9187, postgres_exporter's port, which often runs on the same host.
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9935";
pub const DEFAULT_LOG_LEVEL: &str = "info";
pub const DEFAULT_FALSE_POSITIVE_RATE: f64 = 0.01;
pub const DEFAULT_BATCH_BLOCKS: u64 = 4096;
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(30);

/// One source's settings, every key optional. Also the TOML file's schema: unknown keys are
/// an error so that a typo (`intervall = "5s"`) is not silently ignored.
#[derive(Debug, Default, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub primary: Option<String>,
    pub standby: Option<String>,
    pub interval: Option<String>,
    pub metrics_listen: Option<String>,
    pub log_format: Option<LogFormat>,
    pub log_level: Option<String>,
    pub false_positive_rate: Option<f64>,
    pub batch_blocks: Option<u64>,
    pub connect_timeout: Option<String>,
    pub statement_timeout: Option<String>,
    pub max_backoff: Option<String>,
}

impl RawConfig {
    pub fn from_args(args: &GlobalArgs) -> Self {
        RawConfig {
            primary: args.primary.clone(),
            standby: args.standby.clone(),
            interval: args.interval.clone(),
            metrics_listen: args.metrics_listen.clone(),
            log_format: args.log_format,
            log_level: args.log_level.clone(),
            false_positive_rate: args.false_positive_rate,
            batch_blocks: args.batch_blocks,
            connect_timeout: args.connect_timeout.clone(),
            statement_timeout: args.statement_timeout.clone(),
            max_backoff: args.max_backoff.clone(),
        }
    }

    pub fn from_toml(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }

    /// `self` where set, else `lower`.
    pub fn or(self, lower: RawConfig) -> RawConfig {
        RawConfig {
            primary: self.primary.or(lower.primary),
            standby: self.standby.or(lower.standby),
            interval: self.interval.or(lower.interval),
            metrics_listen: self.metrics_listen.or(lower.metrics_listen),
            log_format: self.log_format.or(lower.log_format),
            log_level: self.log_level.or(lower.log_level),
            false_positive_rate: self.false_positive_rate.or(lower.false_positive_rate),
            batch_blocks: self.batch_blocks.or(lower.batch_blocks),
            connect_timeout: self.connect_timeout.or(lower.connect_timeout),
            statement_timeout: self.statement_timeout.or(lower.statement_timeout),
            max_backoff: self.max_backoff.or(lower.max_backoff),
        }
    }
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

fn invalid(key: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        message: message.into(),
    }
}

/// The validated configuration every command runs with.
#[derive(Debug, Clone)]
pub struct Config {
    pub primary: ConnInfo,
    pub standby: ConnInfo,
    /// The connection strings as given (for display, always through `mask_password`).
    pub primary_conninfo: String,
    pub standby_conninfo: String,
    pub interval: Duration,
    /// `None` when metrics are switched off.
    pub metrics_listen: Option<SocketAddr>,
    pub log_format: LogFormat,
    pub log_level: String,
    pub false_positive_rate: f64,
    pub batch_blocks: u64,
    pub connect_timeout: Duration,
    pub statement_timeout: Duration,
    pub max_backoff: Duration,
}

impl Config {
    /// Flags and env (already merged by clap) over the file named by `--config` over defaults.
    pub fn load(args: &GlobalArgs) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => RawConfig::default(),
        };
        Config::validate(RawConfig::from_args(args).or(file))
    }

    pub fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
        let primary_conninfo = raw.primary.ok_or(ConfigError::Missing { key: "primary" })?;
        let standby_conninfo = raw.standby.ok_or(ConfigError::Missing { key: "standby" })?;
        let primary = conninfo("primary", &primary_conninfo, Side::Primary)?;
        let standby = conninfo("standby", &standby_conninfo, Side::Standby)?;

        let interval = duration("interval", raw.interval.as_deref(), DEFAULT_INTERVAL)?;
        let connect_timeout = duration(
            "connect_timeout",
            raw.connect_timeout.as_deref(),
            DEFAULT_CONNECT_TIMEOUT,
        )?;
        let statement_timeout = duration(
            "statement_timeout",
            raw.statement_timeout.as_deref(),
            DEFAULT_STATEMENT_TIMEOUT,
        )?;
        let max_backoff = duration(
            "max_backoff",
            raw.max_backoff.as_deref(),
            DEFAULT_MAX_BACKOFF,
        )?;
        if statement_timeout < Duration::from_millis(1) {
            // PostgreSQL's unit is the millisecond; less would round to 0 = no timeout at all.
            return Err(invalid("statement_timeout", "must be at least 1ms"));
        }

        let metrics_listen = match raw
            .metrics_listen
            .as_deref()
            .unwrap_or(DEFAULT_METRICS_LISTEN)
            .trim()
        {
            "off" => None,
            addr => Some(addr.parse::<SocketAddr>().map_err(|_| {
                invalid(
                    "metrics_listen",
                    format!("\"{addr}\" is neither \"off\" nor an IP:port such as 127.0.0.1:9935"),
                )
            })?),
        };

        let log_level = raw
            .log_level
            .unwrap_or_else(|| DEFAULT_LOG_LEVEL.to_string());
        tracing_subscriber::EnvFilter::try_new(&log_level)
            .map_err(|e| invalid("log_level", format!("\"{log_level}\": {e}")))?;

        let false_positive_rate = raw
            .false_positive_rate
            .unwrap_or(DEFAULT_FALSE_POSITIVE_RATE);
        // The extension refuses rates below this (a filter would grow without bound).
        let min_rate = ccm_codec::FILTER_MIN_FALSE_POSITIVE_RATE;
        if !(min_rate..1.0).contains(&false_positive_rate) {
            return Err(invalid(
                "false_positive_rate",
                format!("{false_positive_rate} is not at least {min_rate} and less than 1"),
            ));
        }

        let batch_blocks = raw.batch_blocks.unwrap_or(DEFAULT_BATCH_BLOCKS);
        if batch_blocks == 0 {
            return Err(invalid("batch_blocks", "must be at least 1"));
        }
        if batch_blocks > i64::MAX as u64 {
            return Err(invalid("batch_blocks", "too large"));
        }

        Ok(Config {
            primary,
            standby,
            primary_conninfo,
            standby_conninfo,
            interval,
            metrics_listen,
            log_format: raw.log_format.unwrap_or(LogFormat::Text),
            log_level,
            false_positive_rate,
            batch_blocks,
            connect_timeout,
            statement_timeout,
            max_backoff,
        })
    }

    pub fn conninfo(&self, side: Side) -> &ConnInfo {
        match side {
            Side::Primary => &self.primary,
            Side::Standby => &self.standby,
        }
    }

    /// The effective configuration as a TOML file would say it, passwords masked. It reads
    /// back as a valid config file (with the real passwords put back).
    pub fn to_toml_masked(&self) -> String {
        let effective = RawConfig {
            primary: Some(mask_password(&self.primary_conninfo)),
            standby: Some(mask_password(&self.standby_conninfo)),
            interval: Some(format_duration(self.interval)),
            metrics_listen: Some(match self.metrics_listen {
                Some(addr) => addr.to_string(),
                None => "off".to_string(),
            }),
            log_format: Some(self.log_format),
            log_level: Some(self.log_level.clone()),
            false_positive_rate: Some(self.false_positive_rate),
            batch_blocks: Some(self.batch_blocks),
            connect_timeout: Some(format_duration(self.connect_timeout)),
            statement_timeout: Some(format_duration(self.statement_timeout)),
            max_backoff: Some(format_duration(self.max_backoff)),
        };
        toml::to_string(&effective).expect("a flat struct of strings and numbers serializes")
    }
}

impl Config {
    /// The keys whose effective values differ from `self` to `new`, as (key, old, new), in
    /// the words of `to_toml_masked` (passwords masked).
    pub fn changes(&self, new: &Config) -> Vec<(String, String, String)> {
        let table = |config: &Config| -> toml::Table {
            config.to_toml_masked().parse().expect("to_toml_masked writes valid TOML")
        };
        let (before, after) = (table(self), table(new));
        let mut keys: Vec<&String> = before.keys().chain(after.keys()).collect();
        keys.sort();
        keys.dedup();
        let shown = |table: &toml::Table, key: &str| table.get(key).map_or_else(|| "(unset)".to_string(), |v| v.to_string());
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

fn duration(
    key: &'static str,
    value: Option<&str>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    let Some(text) = value else {
        return Ok(default);
    };
    let d = humantime::parse_duration(text.trim()).map_err(|e| {
        invalid(
            key,
            format!("\"{text}\" is not a duration such as 500ms, 1s or 2m ({e})"),
        )
    })?;
    if d.is_zero() {
        return Err(invalid(key, "must be greater than zero"));
    }
    Ok(d)
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
        assert!(!text.contains("secret") && !text.contains("other"), "{text}");
        assert!(text.contains("host=p2"), "{text}");
    }

    fn key_of(e: ConfigError) -> &'static str {
        match e {
            ConfigError::Invalid { key, .. } | ConfigError::Missing { key } => key,
            other => panic!("not a key error: {other}"),
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
        let c = Config::validate(RawConfig::from_args(&with_flag.global).or(file.clone())).unwrap();
        assert_eq!(c.max_backoff, Duration::from_secs(3));
        let c =
            Config::validate(RawConfig::from_args(&without_flag.global).or(file.clone())).unwrap();
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
        assert_eq!(c.batch_blocks, DEFAULT_BATCH_BLOCKS);
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
}

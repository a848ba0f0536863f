//! SIGHUP: read the configuration again and hand it to the running loop, as PostgreSQL and
//! Patroni do on a reload.
//!
//! Flags and `CCM_*` variables were fixed when the process started and still win over the
//! file, so a reload changes what the file sets (and what they do not override). The
//! changed keys are logged (passwords masked). `metrics_listen` and `log_format` need a
//! restart: a change to them is logged and not applied. An invalid file is an ERROR in the
//! log and changes nothing; the agent keeps running with what it has. Passwords from
//! password files are read at every connection, so they need no reload at all.

use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::cli::GlobalArgs;
use crate::config::Config;

/// Applies a new log filter to the running logger.
pub type SetLogLevel = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// Keys a running agent cannot take over: it keeps its socket and its log format.
const RESTART_ONLY: [&str; 2] = ["metrics_listen", "log_format"];

/// Reloads on every SIGHUP until `cancel`, publishing each new configuration on `tx`.
pub async fn run(
    args: GlobalArgs,
    tx: watch::Sender<Arc<Config>>,
    set_log_level: SetLogLevel,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            received = hangup.recv() => if received.is_none() { return Ok(()) },
        }
        info!("SIGHUP received; reloading the configuration");
        let current = tx.borrow().clone();
        if let Some(next) = reload(&args, &current, &set_log_level) {
            tx.send_replace(Arc::new(next));
        }
    }
}

/// The configuration to run with after a reload, or `None` to keep `current`.
fn reload(args: &GlobalArgs, current: &Config, set_log_level: &SetLogLevel) -> Option<Config> {
    let mut next = match Config::load(args) {
        Ok(next) => next,
        Err(e) => {
            error!("configuration reload failed, keeping the running configuration: {e}");
            return None;
        }
    };
    let changes = current.changes(&next);
    if changes.is_empty() {
        info!("configuration unchanged");
        return None;
    }
    for (key, old, new) in &changes {
        if RESTART_ONLY.contains(&key.as_str()) {
            warn!("{key} changes only with a restart: keeping {old} (the file says {new})");
        } else {
            info!("{key}: {old} -> {new}");
        }
    }
    next.metrics_listen = current.metrics_listen;
    next.log_format = current.log_format;
    if next.log_level != current.log_level {
        if let Err(e) = set_log_level(&next.log_level) {
            error!("cannot apply log_level {}: {e}", next.log_level);
            next.log_level = current.log_level.clone();
        }
    }
    Some(next)
}

/// For the commands that do not reload: a SIGHUP must not kill them (its default action).
pub async fn ignore(cancel: CancellationToken) -> anyhow::Result<()> {
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            received = hangup.recv() => if received.is_none() { return Ok(()) },
        }
        info!("SIGHUP received; this command does not reload");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn restart_only_names_keys() {
        for key in super::RESTART_ONLY {
            assert!(crate::config::RawConfig::KEYS.contains(&key), "{key}");
        }
    }
}

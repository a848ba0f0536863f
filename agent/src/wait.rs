//! `ccm-agent wait`: exits 0 once the standby (every failover candidate, or the one named
//! by `--member`) holds a given share of the primary's hot set; non-zero on timeout.
//!
//! For switchover runbooks and rolling restarts, instead of a fixed sleep: it only looks
//! (the numbers of `status`, asked again every interval) and never warms or locks anything,
//! so it may run next to `ccm-agent run`, which does the warming.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::config::{format_duration, Config};
use crate::status::{self, StatusReport};

/// What one look found: done, or what is still missing.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Warm(String),
    NotYet(String),
}

/// Judges a status report against the target share (0..1). Without `member`, every standby
/// in recovery counts; with `unreachable_count` (Patroni, where every target is a failover
/// candidate) so does one that cannot be reached, while a host of a connection string that
/// is down may be an old primary waiting to rejoin and is passed over.
pub fn judge(
    report: &StatusReport,
    min_coverage: f64,
    member: Option<&str>,
    unreachable_count: bool,
) -> Verdict {
    let pct = |c: f64| format!("{:.1}%", c * 100.0);
    let hot = report.hot_buffers.unwrap_or(0);
    let candidates: Vec<_> = report
        .standbys
        .iter()
        .filter(|s| member.is_none_or(|m| s.name == m))
        .filter(|s| {
            member.is_some()
                || s.node.role == Some("standby")
                || (unreachable_count && s.node.error.is_some())
        })
        .collect();
    if candidates.is_empty() {
        return Verdict::NotYet(match member {
            Some(m) => format!("{m} is not a failover candidate of this cluster"),
            None => "no standby to measure".to_string(),
        });
    }
    let mut short = Vec::new();
    for s in &candidates {
        match s.coverage {
            Some(c) if c >= min_coverage => {}
            Some(c) => short.push(format!("{} holds {} of the hot set", s.name, pct(c))),
            None => {
                let why = s.node.error.clone().unwrap_or_else(|| {
                    report
                        .problems
                        .first()
                        .cloned()
                        .unwrap_or_else(|| "its coverage is unknown".to_string())
                });
                short.push(format!("{}: {why}", s.name));
            }
        }
    }
    if short.is_empty() {
        let names: Vec<_> = candidates
            .iter()
            .map(|s| format!("{} {}", s.name, pct(s.coverage.unwrap_or(1.0))))
            .collect();
        Verdict::Warm(format!(
            "warm: {} of a hot set of {hot} buffers (at least {} wanted)",
            names.join(", "),
            pct(min_coverage)
        ))
    } else {
        Verdict::NotYet(format!(
            "{} (needs {})",
            short.join("; "),
            pct(min_coverage)
        ))
    }
}

/// Looks every `interval` until the verdict is Warm (Ok) or `timeout` passes (Err with the
/// last verdict's reason).
pub async fn wait(
    cfg: Arc<Config>,
    cancel: CancellationToken,
    min_coverage: f64,
    timeout: Duration,
    member: Option<&str>,
) -> Result<String, String> {
    let started = Instant::now();
    let mut last = String::new();
    let unreachable_count = cfg.patroni.is_some();
    loop {
        let report = status::gather(cfg.clone(), cancel.clone()).await;
        match judge(&report, min_coverage, member, unreachable_count) {
            Verdict::Warm(message) => return Ok(message),
            Verdict::NotYet(reason) => {
                if reason != last {
                    info!("waiting: {reason}");
                    last = reason;
                }
            }
        }
        let left = timeout.saturating_sub(started.elapsed());
        if left.is_zero() || cancel.is_cancelled() {
            return Err(format!(
                "timed out after {}: {last}",
                format_duration(timeout)
            ));
        }
        tokio::select! {
            _ = cancel.cancelled() => return Err(format!("interrupted: {last}")),
            _ = tokio::time::sleep(cfg.interval.min(left)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{NodeReport, StandbyStatus};

    fn standby(name: &str, role: &'static str, coverage: Option<f64>) -> StandbyStatus {
        StandbyStatus {
            name: name.into(),
            node: NodeReport {
                role: Some(role),
                ..Default::default()
            },
            missing: None,
            coverage,
        }
    }

    fn report(standbys: Vec<StandbyStatus>) -> StatusReport {
        StatusReport {
            hot_buffers: Some(1000),
            standbys,
            ..Default::default()
        }
    }

    #[test]
    fn every_candidate_must_be_warm() {
        let r = report(vec![
            standby("n2", "standby", Some(0.995)),
            standby("n3", "standby", Some(0.9)),
            // The primary listed among the standbys (libpq mode) is not a candidate.
            standby("n1", "primary", None),
        ]);
        assert_eq!(
            judge(&r, 0.99, None, false),
            Verdict::NotYet("n3 holds 90.0% of the hot set (needs 99.0%)".into())
        );
        assert!(
            matches!(judge(&r, 0.99, Some("n2"), false), Verdict::Warm(m) if m.contains("n2 99.5%"))
        );
        assert!(matches!(judge(&r, 0.8, None, false), Verdict::Warm(_)));
    }

    #[test]
    fn unknown_members_and_errors_are_not_warm() {
        let r = report(vec![standby("n2", "standby", Some(1.0))]);
        assert_eq!(
            judge(&r, 0.99, Some("n9"), false),
            Verdict::NotYet("n9 is not a failover candidate of this cluster".into())
        );
        let mut down = standby("n2", "standby", None);
        down.node.role = None;
        down.node.error = Some("connection refused".into());
        // A Patroni candidate that is down is not warm; a down host of a connection string
        // (an old primary waiting to rejoin) is passed over when another standby is warm.
        let both = report(vec![standby("n3", "standby", Some(1.0)), down.clone()]);
        assert_eq!(
            judge(&both, 0.99, None, true),
            Verdict::NotYet("n2: connection refused (needs 99.0%)".into())
        );
        assert!(matches!(judge(&both, 0.99, None, false), Verdict::Warm(_)));
        assert!(matches!(
            judge(&report(vec![down]), 0.99, None, false),
            Verdict::NotYet(_)
        ));
        assert!(matches!(
            judge(&report(vec![]), 0.5, None, false),
            Verdict::NotYet(_)
        ));
    }
}

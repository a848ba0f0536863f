//! `ccm-agent wait`: exits 0 once the standby (every failover candidate, or the one named
//! by `--member`) holds a given share of the primary's hot set; non-zero on timeout.
//!
//! For switchover runbooks and rolling restarts, instead of a fixed sleep: it only looks
//! (the numbers of `status`) and never warms or locks anything, so it may run next to
//! `ccm-agent run`, which does the warming.
//!
//! It runs for up to its timeout exactly while a switchover waits, so its looks are kept
//! cheap: one session per node kept from look to look (`status::Looker`), and looks at
//! least `MIN_POLL` apart whatever the interval. A look is still not free: the primary
//! counts its hot set (`count(*) FROM ccm_hot_buffers()`, every buffer header read and the
//! hot ones returned as rows) and, per standby, the hot buffers missing from its filter
//! (another sweep), and each standby sweeps its own buffers for that filter. Measured as the
//! CPU time of the sessions' backends (/proc/<pid>/schedstat; bench/wait_look_cost.py) with shared_buffers full of
//! hot pages, on PostgreSQL 15 and 18 at 1 GB and 2 GB, per 8 kB buffer: 2.1-2.2 µs for the
//! hot count, 0.55-0.7 µs per standby for the missing count, 0.4-0.43 µs for the filter; the
//! other statements 0.5 ms together. One look costs about 0.36 s of one core on the primary
//! and 0.055 s on each standby at 1 GB (measured, `wait` end to end: 2.1 s and 0.33 s for
//! 6 looks), and, extrapolated per buffer, about 2.9 s on the primary (0.7 s more per
//! further standby) and 0.45 s on each standby at 8 GB: with a look every 5 s plus its own
//! 3 s or so, a third of a core on the primary for the length of the wait. Before, with a
//! look every second over new sessions, a 1 GB primary spent 7.2 s of CPU in 32 s (21 looks,
//! 21 sessions per node); now 2.1 s in 34 s.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::config::{format_duration, Config};
use crate::status::{Looker, StatusReport};

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
    min_os_coverage: Option<f64>,
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
        let Some(min_os) = min_os_coverage else {
            continue;
        };
        match s.os_coverage {
            Some(c) if c >= min_os => {}
            Some(c) => short.push(format!(
                "{} holds {} of the primary's page cache",
                s.name,
                pct(c)
            )),
            // Not measured, and not for a reason given above.
            None if s.coverage.is_some() => short.push(format!(
                "{}: its page cache is not measured (it needs extension 0.9.0, as the primary)",
                s.name
            )),
            None => {}
        }
    }
    let needs = match min_os_coverage {
        Some(os) => format!("{}, page cache {}", pct(min_coverage), pct(os)),
        None => pct(min_coverage),
    };
    if short.is_empty() {
        let names: Vec<_> = candidates
            .iter()
            .map(|s| format!("{} {}", s.name, pct(s.coverage.unwrap_or(1.0))))
            .collect();
        Verdict::Warm(format!(
            "warm: {} of a hot set of {hot} buffers (at least {needs} wanted)",
            names.join(", "),
        ))
    } else {
        Verdict::NotYet(format!("{} (needs {needs})", short.join("; ")))
    }
}

/// The shortest time between two looks: each costs the primary and every standby a sweep of
/// their buffer headers (see the module header), and the running agent, not `wait`, is what
/// makes the coverage grow between them.
pub const MIN_POLL: Duration = Duration::from_secs(5);

/// How long `wait` sleeps between looks: the configured interval, but at least `MIN_POLL`.
pub fn poll_interval(interval: Duration) -> Duration {
    interval.max(MIN_POLL)
}

/// Looks every `poll_interval` until the verdict is Warm (Ok) or `timeout` passes (Err with
/// the last verdict's reason), over sessions kept from one look to the next.
pub async fn wait(
    cfg: Arc<Config>,
    cancel: CancellationToken,
    min_coverage: f64,
    min_os_coverage: Option<f64>,
    timeout: Duration,
    member: Option<&str>,
) -> Result<String, String> {
    let started = Instant::now();
    let mut last = String::new();
    let unreachable_count = cfg.patroni.is_some();
    let poll = poll_interval(cfg.interval);
    debug!("looking every {}", format_duration(poll));
    let mut looker = Looker::new(cfg, cancel.clone()).measure_page_cache(min_os_coverage.is_some());
    loop {
        let report = looker.gather().await;
        debug!("looked; {} sessions kept for the next look", looker.kept());
        match judge(
            &report,
            min_coverage,
            min_os_coverage,
            member,
            unreachable_count,
        ) {
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
            _ = tokio::time::sleep(poll.min(left)) => {}
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
            os_held_bytes: None,
            os_coverage: None,
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
    fn looks_are_at_least_five_seconds_apart() {
        assert_eq!(poll_interval(Duration::from_secs(1)), MIN_POLL);
        assert_eq!(poll_interval(Duration::from_millis(200)), MIN_POLL);
        assert_eq!(poll_interval(Duration::ZERO), Duration::from_secs(5));
        assert_eq!(
            poll_interval(Duration::from_secs(30)),
            Duration::from_secs(30)
        );
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
            judge(&r, 0.99, None, None, false),
            Verdict::NotYet("n3 holds 90.0% of the hot set (needs 99.0%)".into())
        );
        assert!(
            matches!(judge(&r, 0.99, None, Some("n2"), false), Verdict::Warm(m) if m.contains("n2 99.5%"))
        );
        assert!(matches!(
            judge(&r, 0.8, None, None, false),
            Verdict::Warm(_)
        ));
    }

    #[test]
    fn unknown_members_and_errors_are_not_warm() {
        let r = report(vec![standby("n2", "standby", Some(1.0))]);
        assert_eq!(
            judge(&r, 0.99, None, Some("n9"), false),
            Verdict::NotYet("n9 is not a failover candidate of this cluster".into())
        );
        let mut down = standby("n2", "standby", None);
        down.node.role = None;
        down.node.error = Some("connection refused".into());
        // A Patroni candidate that is down is not warm; a down host of a connection string
        // (an old primary waiting to rejoin) is passed over when another standby is warm.
        let both = report(vec![standby("n3", "standby", Some(1.0)), down.clone()]);
        assert_eq!(
            judge(&both, 0.99, None, None, true),
            Verdict::NotYet("n2: connection refused (needs 99.0%)".into())
        );
        assert!(matches!(
            judge(&both, 0.99, None, None, false),
            Verdict::Warm(_)
        ));
        assert!(matches!(
            judge(&report(vec![down]), 0.99, None, None, false),
            Verdict::NotYet(_)
        ));
        assert!(matches!(
            judge(&report(vec![]), 0.5, None, None, false),
            Verdict::NotYet(_)
        ));
    }

    #[test]
    fn the_page_cache_is_waited_for_only_when_asked() {
        let mut warm = standby("n2", "standby", Some(1.0));
        warm.os_coverage = Some(0.4);
        let unmeasured = standby("n3", "standby", Some(1.0));
        let r = report(vec![warm.clone(), unmeasured]);
        assert!(matches!(
            judge(&r, 0.99, None, None, false),
            Verdict::Warm(_)
        ));
        assert_eq!(
            judge(&r, 0.99, Some(0.9), None, false),
            Verdict::NotYet(
                "n2 holds 40.0% of the primary's page cache; n3: its page cache is not measured \
                 (it needs extension 0.9.0, as the primary) (needs 99.0%, page cache 90.0%)"
                    .into()
            )
        );
        warm.os_coverage = Some(0.95);
        assert!(matches!(
            judge(&report(vec![warm]), 0.99, Some(0.9), None, false),
            Verdict::Warm(m) if m.contains("page cache 90.0%")
        ));
    }
}

//! The sync cycle, the `run` loop around it and the one-shot `sync --once`.
//!
//! A cycle: (1) the standby's bloom filter of what it caches, (2) the primary's hot blocks
//! missing from it, at most the standby's shared_buffers, (3) the list split hottest-first
//! into batches, (4) one short `ccm_prewarm` call per batch on the standby. Short calls keep
//! each statement on the standby brief, so a recovery conflict never waits on us for long,
//! and the hottest blocks land first if the cycle is cut short.
//!
//! Safety is re-checked at every step: each call returns pg_is_in_recovery() in the same
//! statement, so a promotion or demotion is seen before a list is sent, and the pairing's
//! system identifiers are compared whenever either side (re)connects.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ccm_codec::{decode_block_list_header, BlockList};
use indicatif::ProgressBar;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::backoff::Backoff;
use crate::config::{format_duration, Config};
use crate::metrics::{coverage, saturating_i64, Metrics, Stage};
use crate::node::{self, ConnectOptions, Node, NodeError, Side};

/// What one cycle did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct CycleReport {
    /// Hot buffers the primary's scan found before filtering.
    pub hot_buffers: u64,
    pub buffers_scanned: u64,
    /// Blocks in the list, i.e. hot blocks the standby's filter lacked.
    pub sent: u64,
    pub batches: usize,
    pub requested: u64,
    pub loaded: u64,
    pub already_cached: u64,
    pub skipped: u64,
    pub filter_bytes: usize,
    pub list_bytes: usize,
    pub duration: Duration,
}

impl CycleReport {
    /// The standby's share of the hot set at scan time.
    pub fn coverage(&self) -> f64 {
        coverage(self.hot_buffers, self.sent)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CycleError {
    #[error("{error}")]
    Node {
        stage: Stage,
        side: Side,
        #[source]
        error: NodeError,
    },
    /// The pairing is unsafe (different systems): both connections were dropped.
    #[error("{0}")]
    Safety(String),
    /// A node changed role under us (failover): its connection was dropped.
    #[error("{message}")]
    RoleChanged { side: Side, message: String },
    #[error("the primary's hot block list does not decode: {0}")]
    Decode(String),
    #[error("Cluster Cache Manager is disabled on the {side} {host} (ccm.enabled = off)")]
    Disabled { side: Side, host: String },
    #[error("cancelled")]
    Cancelled,
}

impl CycleError {
    /// The `stage` label this error is counted under; none for the non-faults.
    pub fn stage(&self) -> Option<Stage> {
        match self {
            CycleError::Node { stage, .. } => Some(*stage),
            CycleError::Safety(_) | CycleError::RoleChanged { .. } => Some(Stage::Safety),
            CycleError::Decode(_) => Some(Stage::HotBlocks),
            CycleError::Disabled { .. } | CycleError::Cancelled => None,
        }
    }
}

/// The two connections and what the loop remembers between cycles.
pub struct Syncer {
    cfg: Arc<Config>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
    primary: Option<Node>,
    standby: Option<Node>,
    /// The host each side last connected to, to count retargets.
    last_primary_host: Option<String>,
    last_standby_host: Option<String>,
    /// Whether "CCM is disabled" was already logged (it is logged once per episode).
    disabled_logged: bool,
}

impl Syncer {
    pub fn new(cfg: Arc<Config>, metrics: Arc<Metrics>, cancel: CancellationToken) -> Self {
        Syncer {
            cfg,
            metrics,
            cancel,
            primary: None,
            standby: None,
            last_primary_host: None,
            last_standby_host: None,
            disabled_logged: false,
        }
    }

    fn slot(&mut self, side: Side) -> &mut Option<Node> {
        match side {
            Side::Primary => &mut self.primary,
            Side::Standby => &mut self.standby,
        }
    }

    fn node(&mut self, side: Side) -> &mut Node {
        self.slot(side).as_mut().expect("connected by ensure_side")
    }

    fn drop_node(&mut self, side: Side) {
        if self.slot(side).take().is_some() {
            self.metrics.set_node_up(side, false);
        }
    }

    fn options(&self) -> ConnectOptions {
        ConnectOptions {
            connect_timeout: self.cfg.connect_timeout,
            statement_timeout: self.cfg.statement_timeout,
        }
    }

    /// Makes sure `side` has a live connection to a node of the right role.
    async fn ensure_side(&mut self, side: Side) -> Result<(), CycleError> {
        if let Some(node) = self.slot(side) {
            if !node.is_closed() {
                return Ok(());
            }
            warn!(
                "lost the connection to the {side} {}; reconnecting",
                node.label()
            );
            self.drop_node(side);
        }
        let cfg = self.cfg.clone();
        let node = node::resolve(cfg.conninfo(side), side, self.options(), &self.cancel, true)
            .await
            .map_err(|error| match error {
                NodeError::Cancelled => CycleError::Cancelled,
                error => CycleError::Node {
                    stage: Stage::Connect,
                    side,
                    error,
                },
            })?;
        let label = node.label();
        let last = match side {
            Side::Primary => &mut self.last_primary_host,
            Side::Standby => &mut self.last_standby_host,
        };
        if let Some(previous) = last.replace(label.clone()) {
            if previous != label {
                self.metrics.retarget(side);
                warn!("the {side} side moved from {previous} to {label}");
            }
        }
        info!(
            side = side.as_str(),
            host = %label,
            system_identifier = %node.facts.system_identifier,
            server_version = %node.facts.server_version,
            pg_ccm = node.facts.extension_version.as_deref().unwrap_or("?"),
            shared_buffers_blocks = node.facts.shared_buffers,
            "connected to the {side}"
        );
        self.metrics.set_node_up(side, true);
        *self.slot(side) = Some(node);
        Ok(())
    }

    /// Both sides connected and of one system.
    async fn ensure_pair(&mut self) -> Result<(), CycleError> {
        self.ensure_side(Side::Primary).await?;
        self.ensure_side(Side::Standby).await?;
        let (Some(primary), Some(standby)) = (&self.primary, &self.standby) else {
            unreachable!("both sides were just ensured");
        };
        if let Err(message) = node::check_same_system(primary, standby) {
            self.drop_node(Side::Primary);
            self.drop_node(Side::Standby);
            return Err(CycleError::Safety(message));
        }
        Ok(())
    }

    /// Turns a call's error into a cycle error, dropping the connection if it is broken.
    fn call<T>(
        &mut self,
        side: Side,
        stage: Stage,
        result: Result<T, NodeError>,
    ) -> Result<T, CycleError> {
        match result {
            Ok(v) => Ok(v),
            Err(NodeError::Cancelled) => Err(CycleError::Cancelled),
            Err(NodeError::Disabled { host }) => Err(CycleError::Disabled { side, host }),
            Err(error) => {
                let closed = self.slot(side).as_ref().is_some_and(Node::is_closed);
                if error.breaks_connection() || closed {
                    self.drop_node(side);
                }
                Err(CycleError::Node { stage, side, error })
            }
        }
    }

    /// Checks the role a call reported; a changed role ends this side's connection.
    fn check_role(&mut self, side: Side, in_recovery: bool) -> Result<(), CycleError> {
        if in_recovery == side.wants_recovery() {
            return Ok(());
        }
        let host = self.node(side).label();
        let message = match side {
            Side::Standby => format!(
                "standby {host} was promoted (no longer in recovery); looking for a new standby"
            ),
            Side::Primary => {
                format!("primary {host} is in recovery (demoted or replaced); looking for a new primary")
            }
        };
        self.drop_node(side);
        Err(CycleError::RoleChanged { side, message })
    }

    /// One cycle; `progress` (sync --once) counts blocks processed.
    pub async fn cycle(
        &mut self,
        progress: Option<&ProgressBar>,
    ) -> Result<CycleReport, CycleError> {
        self.ensure_pair().await?;
        let started = Instant::now();
        let mut report = CycleReport::default();

        // (1) What the standby already caches.
        let fpr = self.cfg.false_positive_rate;
        let result = self.node(Side::Standby).buffer_filter(fpr).await;
        let (in_recovery, filter) = self.call(Side::Standby, Stage::Filter, result)?;
        self.check_role(Side::Standby, in_recovery)?;
        report.filter_bytes = filter.len();
        self.metrics
            .filter_bytes
            .set(saturating_i64(filter.len() as u64));

        // (2) What the primary has hot that the filter lacks; no more than the standby can hold.
        let max_blocks = self.node(Side::Standby).facts.shared_buffers.max(1);
        let result = self
            .node(Side::Primary)
            .hot_blocks(&filter, max_blocks)
            .await;
        let (in_recovery, list_bytes) = self.call(Side::Primary, Stage::HotBlocks, result)?;
        self.check_role(Side::Primary, in_recovery)?;
        // Both nodes answered the CCM calls, so CCM is on again if it was off.
        self.mark_enabled();
        report.list_bytes = list_bytes.len();
        self.metrics
            .block_list_bytes
            .set(saturating_i64(list_bytes.len() as u64));

        // The primary's logical WAL cache, for the metrics only: a failure here is logged
        // and never stops the cycle.
        match self.node(Side::Primary).wal_cache().await {
            Ok(Some(status)) => self.metrics.wal_cache(&status),
            Ok(None) => {}
            Err(error) => debug!(%error, "reading the logical WAL cache status failed"),
        }

        // (3) Decode and split, hottest first.
        let list = BlockList::decode(&list_bytes).map_err(|e| CycleError::Decode(e.to_string()))?;
        report.hot_buffers = list.header.hot_buffers_found;
        report.buffers_scanned = list.header.buffers_scanned;
        report.sent = list.len() as u64;
        self.metrics.scan(report.hot_buffers, report.sent);
        if let Some(pb) = progress {
            pb.inc_length(report.sent);
        }

        // (4) One short ccm_prewarm per batch.
        if report.sent > 0 {
            let batches = list.split_hottest_first(self.cfg.batch_blocks as usize);
            report.batches = batches.len();
            for batch in &batches {
                let result = self.node(Side::Standby).prewarm(batch).await;
                let done = self.call(Side::Standby, Stage::Prewarm, result)?;
                let blocks = decode_block_list_header(batch)
                    .map(|h| u64::from(h.blocks))
                    .unwrap_or(done.requested.max(0) as u64);
                let (loaded, already, skipped) = (
                    done.loaded.max(0) as u64,
                    done.already_cached.max(0) as u64,
                    done.skipped.max(0) as u64,
                );
                self.metrics.blocks_sent.inc_by(blocks);
                self.metrics.blocks_loaded.inc_by(loaded);
                self.metrics.blocks_already_cached.inc_by(already);
                self.metrics.blocks_skipped.inc_by(skipped);
                report.requested += done.requested.max(0) as u64;
                report.loaded += loaded;
                report.already_cached += already;
                report.skipped += skipped;
                if let Some(pb) = progress {
                    pb.inc(blocks);
                }
            }
        }

        report.duration = started.elapsed();
        self.metrics.cycle_done(report.duration);
        Ok(report)
    }

    fn mark_enabled(&mut self) {
        if self.disabled_logged {
            info!("Cluster Cache Manager is enabled again; syncing");
            self.disabled_logged = false;
        }
        self.metrics.enabled.set(1);
    }

    /// CCM is off on a node: say so once, show it in metrics, keep the connections.
    fn note_disabled(&mut self, side: Side, host: &str) {
        self.metrics.enabled.set(0);
        if !self.disabled_logged {
            warn!(
                "Cluster Cache Manager is disabled on the {side} {host} (ccm.enabled = off); idling, re-checking every {}",
                format_duration(self.cfg.interval)
            );
            self.disabled_logged = true;
        }
    }
}

fn log_cycle(report: &CycleReport) {
    let ms = report.duration.as_secs_f64() * 1000.0;
    debug!(
        hot_buffers = report.hot_buffers,
        buffers_scanned = report.buffers_scanned,
        sent = report.sent,
        batches = report.batches,
        loaded = report.loaded,
        already_cached = report.already_cached,
        skipped = report.skipped,
        filter_bytes = report.filter_bytes,
        list_bytes = report.list_bytes,
        coverage = report.coverage(),
        ms,
        "cycle done"
    );
    if report.loaded > 0 {
        info!(
            loaded = report.loaded,
            sent = report.sent,
            already_cached = report.already_cached,
            skipped = report.skipped,
            hot_buffers = report.hot_buffers,
            ms = format_args!("{ms:.1}"),
            "loaded {} blocks into the standby in {ms:.1} ms",
            report.loaded
        );
    }
}

/// `ccm-agent run`: cycles every interval until `cancel`; faults back off and retry forever.
pub async fn run(
    cfg: Arc<Config>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let mut syncer = Syncer::new(cfg.clone(), metrics.clone(), cancel.clone());
    let mut backoff = Backoff::new(cfg.max_backoff);
    info!(
        interval = %format_duration(cfg.interval),
        batch_blocks = cfg.batch_blocks,
        false_positive_rate = cfg.false_positive_rate,
        "sync loop started"
    );
    while !cancel.is_cancelled() {
        let started = Instant::now();
        let wait = match syncer.cycle(None).await {
            Ok(report) => {
                backoff.reset();
                log_cycle(&report);
                cfg.interval.saturating_sub(started.elapsed())
            }
            Err(CycleError::Cancelled) => break,
            Err(CycleError::Disabled { side, host }) => {
                // Not a fault: the operator switched CCM off. Idle at the normal pace.
                syncer.note_disabled(side, &host);
                backoff.reset();
                cfg.interval
            }
            Err(e) => {
                if let Some(stage) = e.stage() {
                    metrics.cycle_error(stage);
                }
                let delay = backoff.next_delay();
                let retry = format_duration(Duration::from_millis(delay.as_millis() as u64));
                match &e {
                    CycleError::Safety(_) | CycleError::Decode(_) => {
                        error!("{e}; retrying in {retry}")
                    }
                    _ => warn!(
                        stage = e.stage().map(Stage::as_str).unwrap_or(""),
                        attempt = backoff.attempts(),
                        "{e}; retrying in {retry}"
                    ),
                }
                delay
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
    }
    info!("sync loop stopped");
    Ok(())
}

/// The result of `sync --once`.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub struct SyncSummary {
    pub cycles: u32,
    pub sent: u64,
    pub loaded: u64,
    pub already_cached: u64,
    pub skipped: u64,
    /// Hot buffers the primary found in the last cycle's scan.
    pub hot_buffers: u64,
    /// The standby's share of the hot set at the last cycle's scan (0..1).
    pub coverage: f64,
    /// True when the last cycle had nothing left to send.
    pub complete: bool,
}

impl SyncSummary {
    fn add(&mut self, report: &CycleReport) {
        self.cycles += 1;
        self.sent += report.sent;
        self.loaded += report.loaded;
        self.already_cached += report.already_cached;
        self.skipped += report.skipped;
        self.hot_buffers = report.hot_buffers;
        self.coverage = report.coverage();
    }

    pub fn to_text(&self) -> String {
        format!(
            "{} after {} cycle{}: sent {} blocks, loaded {}, already cached {}, skipped {}; \
             hot set {} buffers, coverage {:.1}%",
            if self.complete {
                "standby warm"
            } else {
                "stopped"
            },
            self.cycles,
            if self.cycles == 1 { "" } else { "s" },
            self.sent,
            self.loaded,
            self.already_cached,
            self.skipped,
            self.hot_buffers,
            self.coverage * 100.0
        )
    }
}

/// Whether `sync --once` should run another cycle after `report`.
fn another_cycle(report: &CycleReport) -> bool {
    // Nothing sent: the standby holds the whole hot set. Something sent but nothing loaded:
    // the rest cannot be loaded (dropped relations, a full standby), and the next cycle would
    // send the very same list.
    report.sent > 0 && report.loaded > 0
}

/// `ccm-agent sync --once`: cycles back to back until nothing is left to send (or
/// `max_cycles`). Faults end it with an error: there is no one to retry for.
pub async fn sync_once(
    cfg: Arc<Config>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
    max_cycles: u32,
    progress: &ProgressBar,
) -> Result<SyncSummary, CycleError> {
    let mut syncer = Syncer::new(cfg, metrics, cancel);
    let mut summary = SyncSummary::default();
    while summary.cycles < max_cycles {
        progress.set_message(format!("cycle {}", summary.cycles + 1));
        let report = syncer.cycle(Some(progress)).await?;
        // Logs go to the same stderr as the bar: lift the bar while one is written.
        progress.suspend(|| log_cycle(&report));
        summary.add(&report);
        if report.sent == 0 {
            summary.complete = true;
        }
        if !another_cycle(&report) {
            break;
        }
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(hot: u64, sent: u64, loaded: u64) -> CycleReport {
        CycleReport {
            hot_buffers: hot,
            sent,
            loaded,
            already_cached: sent.saturating_sub(loaded),
            ..Default::default()
        }
    }

    #[test]
    fn cycle_coverage() {
        assert_eq!(report(0, 0, 0).coverage(), 1.0);
        assert_eq!(report(1000, 0, 0).coverage(), 1.0);
        assert_eq!(report(1000, 1000, 0).coverage(), 0.0);
        assert_eq!(report(1000, 100, 0).coverage(), 0.9);
    }

    #[test]
    fn stops_when_nothing_to_send_or_no_progress() {
        assert!(another_cycle(&report(100, 50, 50)));
        assert!(!another_cycle(&report(100, 0, 0)));
        assert!(!another_cycle(&report(100, 50, 0)));
    }

    #[test]
    fn summary_accumulates_and_keeps_the_last_scan() {
        let mut s = SyncSummary::default();
        s.add(&report(1000, 800, 790));
        s.add(&report(1000, 10, 10));
        s.add(&report(1001, 0, 0));
        assert_eq!(s.cycles, 3);
        assert_eq!(s.sent, 810);
        assert_eq!(s.loaded, 800);
        assert_eq!(s.already_cached, 10);
        assert_eq!(s.hot_buffers, 1001);
        assert_eq!(s.coverage, 1.0);
    }

    #[test]
    fn summary_json_shape() {
        let s = SyncSummary {
            cycles: 2,
            sent: 10,
            loaded: 9,
            already_cached: 1,
            skipped: 0,
            hot_buffers: 10,
            coverage: 1.0,
            complete: true,
        };
        let v: serde_json::Value =
            serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        let obj = v.as_object().unwrap();
        for key in [
            "cycles",
            "sent",
            "loaded",
            "already_cached",
            "skipped",
            "hot_buffers",
            "coverage",
        ] {
            assert!(obj[key].is_number(), "{key}: {v}");
        }
        assert_eq!(obj["coverage"].as_f64(), Some(1.0));
        assert_eq!(obj["complete"], serde_json::Value::Bool(true));
        assert!(s
            .to_text()
            .starts_with("standby warm after 2 cycles: sent 10 blocks"));
    }

    #[test]
    fn error_stages() {
        assert_eq!(CycleError::Safety("x".into()).stage(), Some(Stage::Safety));
        assert_eq!(
            CycleError::RoleChanged {
                side: Side::Standby,
                message: "m".into()
            }
            .stage(),
            Some(Stage::Safety)
        );
        assert_eq!(
            CycleError::Decode("x".into()).stage(),
            Some(Stage::HotBlocks)
        );
        assert_eq!(
            CycleError::Disabled {
                side: Side::Primary,
                host: "h".into()
            }
            .stage(),
            None
        );
        assert_eq!(CycleError::Cancelled.stage(), None);
    }
}

//! The sync cycle, the `run` loop around it and the one-shot `sync --once`.
//!
//! A cycle: (1) the standby's bloom filter of what it caches, (2) the primary's hot blocks
//! missing from it, at most the standby's shared_buffers, (3) the list split hottest-first
//! into batches, (4) one short `ccm_prewarm` call per batch on the standby. Short calls keep
//! each statement on the standby brief, so a recovery conflict never waits on us for long,
//! and the hottest blocks land first if the cycle is cut short. ccm_prewarm itself reads the
//! blocks of every database (other databases' through background workers), so each batch
//! goes whole over the one standby session.
//!
//! Safety is re-checked at every step: each call (every prewarm batch included) returns
//! pg_is_in_recovery() in the same statement, and ccm_prewarm itself refuses to run on a
//! node that is not in recovery; so a promotion or demotion is seen before another list is
//! sent, and the pairing's system identifiers are compared whenever either side (re)connects.
//!
//! Not faults: a recovery conflict (the statement cancelled, or the session terminated) ends
//! the cycle without backoff, and what was not loaded comes again next cycle because the
//! standby's filter is rebuilt; a storage error on one page costs its batch only.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ccm_codec::{decode_block_list_header, BlockList};
use indicatif::ProgressBar;
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::backoff::Backoff;
use crate::config::{format_duration, Config};
use crate::metrics::{coverage, saturating_i64, Metrics, Stage};
use crate::node::{self, ConnectOptions, ErrorClass, Node, NodeError, PrewarmResult, Side};
use crate::notify;

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
    /// Skipped by the standby, plus the blocks of batches lost to storage errors.
    pub skipped: u64,
    /// Batches lost to a storage error on the standby.
    pub storage_errors: u64,
    /// Recovery conflicts; one ends the cycle early.
    pub recovery_conflicts: u64,
    pub filter_bytes: usize,
    pub list_bytes: usize,
    pub duration: Duration,
}

impl CycleReport {
    /// The standby's share of the hot set at scan time.
    pub fn coverage(&self) -> f64 {
        coverage(self.hot_buffers, self.sent)
    }

    /// Whether the cycle was cut short by a recovery conflict.
    pub fn interrupted(&self) -> bool {
        self.recovery_conflicts > 0
    }
}

/// Every variant's message is complete (a node error's includes the server's message), and
/// none also returns its cause as `source()`, so `{:#}` prints each message once.
#[derive(Debug, thiserror::Error)]
pub enum CycleError {
    #[error("{error}")]
    Node {
        stage: Stage,
        side: Side,
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

/// What the cycle does after one prewarm call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Next,
    EndCycle,
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

    /// The host a side is (or was last) connected to, for messages.
    fn side_label(&self, side: Side) -> String {
        let (slot, last) = match side {
            Side::Primary => (&self.primary, &self.last_primary_host),
            Side::Standby => (&self.standby, &self.last_standby_host),
        };
        match (slot, last) {
            (Some(node), _) => node.label(),
            (None, Some(host)) => host.clone(),
            (None, None) => "?".to_string(),
        }
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
            Ok(v) => {
                self.metrics.progress();
                Ok(v)
            }
            Err(NodeError::Cancelled) => Err(CycleError::Cancelled),
            Err(NodeError::Disabled { host }) => Err(CycleError::Disabled { side, host }),
            Err(error) => {
                if self.broken(side, &error) {
                    self.drop_node(side);
                }
                Err(CycleError::Node { stage, side, error })
            }
        }
    }

    /// Whether `error` left `side`'s connection useless.
    fn broken(&self, side: Side, error: &NodeError) -> bool {
        let node = match side {
            Side::Primary => &self.primary,
            Side::Standby => &self.standby,
        };
        error.breaks_connection() || node.as_ref().is_some_and(Node::is_closed)
    }

    /// Checks the role a call reported; a changed role ends this side's connection.
    fn check_role(&mut self, side: Side, in_recovery: bool) -> Result<(), CycleError> {
        if in_recovery == side.wants_recovery() {
            return Ok(());
        }
        Err(self.role_changed(side))
    }

    /// A node left the role its side needs: drops its connection and says why.
    fn role_changed(&mut self, side: Side) -> CycleError {
        let host = self.side_label(side);
        let message = match side {
            Side::Standby => format!(
                "standby {host} was promoted (no longer in recovery); looking for a new standby"
            ),
            Side::Primary => {
                format!("primary {host} is in recovery (demoted or replaced); looking for a new primary")
            }
        };
        self.drop_node(side);
        CycleError::RoleChanged { side, message }
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
        let result = match result {
            Err(error) if error.class() == ErrorClass::RecoveryConflict => {
                self.recovery_conflict(&error, &mut report);
                return Ok(self.finish(report, started));
            }
            result => result,
        };
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

        // (3) Decode (no more blocks than asked for) and split, hottest first.
        let limit = u64::try_from(max_blocks).unwrap_or(1);
        let list = BlockList::decode_bounded(&list_bytes, limit)
            .map_err(|e| CycleError::Decode(e.to_string()))?;
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
                let blocks = decode_block_list_header(batch)
                    .map(|h| u64::from(h.blocks))
                    .map_err(|e| CycleError::Decode(format!("a batch of it: {e}")))?;
                let result = self.node(Side::Standby).prewarm(batch).await;
                let flow = self.prewarm_outcome(blocks, result, &mut report)?;
                if let Some(pb) = progress {
                    pb.inc(blocks);
                }
                if flow == Flow::EndCycle {
                    break;
                }
            }
        }

        Ok(self.finish(report, started))
    }

    fn finish(&self, mut report: CycleReport, started: Instant) -> CycleReport {
        report.duration = started.elapsed();
        self.metrics.cycle_done(report.duration);
        report
    }

    /// What one prewarm call's answer means for the cycle.
    fn prewarm_outcome(
        &mut self,
        blocks: u64,
        result: Result<(bool, PrewarmResult), NodeError>,
        report: &mut CycleReport,
    ) -> Result<Flow, CycleError> {
        let error = match result {
            Ok((true, done)) => {
                self.account(blocks, &done, report);
                return Ok(Flow::Next);
            }
            // Promoted during the call: nothing more goes to this server.
            Ok((false, _)) => return Err(self.role_changed(Side::Standby)),
            Err(error) => error,
        };
        match error.class() {
            ErrorClass::NotInRecovery => Err(self.role_changed(Side::Standby)),
            ErrorClass::RecoveryConflict => {
                self.recovery_conflict(&error, report);
                Ok(Flow::EndCycle)
            }
            ErrorClass::Storage if !self.broken(Side::Standby, &error) => {
                let host = self.side_label(Side::Standby);
                // With its DETAIL, which names the database when a prewarm worker hit it.
                let message = error.server_message().unwrap_or_else(|| error.to_string());
                warn!(
                    host = %host,
                    "storage error on the standby {host}: {message}; skipping this batch of \
                     {blocks} blocks and going on with the next"
                );
                self.metrics.prewarm_storage_errors.inc();
                report.storage_errors += 1;
                let lost = PrewarmResult {
                    skipped: blocks,
                    ..PrewarmResult::default()
                };
                self.account(blocks, &lost, report);
                Ok(Flow::Next)
            }
            _ => self.call(Side::Standby, Stage::Prewarm, Err(error)),
        }
    }

    /// Counts what a prewarm call did with `blocks` blocks.
    fn account(&mut self, blocks: u64, done: &PrewarmResult, report: &mut CycleReport) {
        self.metrics.blocks_sent.inc_by(blocks);
        self.metrics.blocks_loaded.inc_by(done.loaded);
        self.metrics
            .blocks_already_cached
            .inc_by(done.already_cached);
        self.metrics.blocks_skipped.inc_by(done.skipped);
        report.requested += done.requested;
        report.loaded += done.loaded;
        report.already_cached += done.already_cached;
        report.skipped += done.skipped;
    }

    /// A recovery conflict: logged (one line, with the server's DETAIL), counted, the
    /// standby's connection dropped if the server ended the session. Not a fault: the cycle
    /// just ends.
    fn recovery_conflict(&mut self, error: &NodeError, report: &mut CycleReport) {
        let host = self.side_label(Side::Standby);
        let message = error.server_message().unwrap_or_else(|| error.to_string());
        info!(
            host = %host,
            "recovery conflict on the standby {host}: {message}; ending this cycle, \
             the blocks not loaded follow in the next one"
        );
        self.metrics.recovery_conflicts.inc();
        report.recovery_conflicts += 1;
        if self.broken(Side::Standby, error) {
            self.drop_node(Side::Standby);
        }
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
        storage_errors = report.storage_errors,
        recovery_conflicts = report.recovery_conflicts,
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

/// How long /readyz tolerates no answer from the nodes: three intervals, plus one call's
/// statement timeout (a batch on a cold standby may take that long).
fn stale_after(cfg: &Config) -> Duration {
    cfg.interval * 3 + cfg.statement_timeout
}

impl Syncer {
    /// A reloaded configuration: a side whose connection string changed reconnects.
    fn reconfigure(&mut self, cfg: Arc<Config>) {
        if cfg.primary_conninfo != self.cfg.primary_conninfo {
            self.drop_node(Side::Primary);
        }
        if cfg.standby_conninfo != self.cfg.standby_conninfo {
            self.drop_node(Side::Standby);
        }
        self.metrics.set_stale_after(stale_after(&cfg));
        self.cfg = cfg;
    }
}

/// `ccm-agent run`: cycles every interval until `cancel`; faults back off and retry forever.
/// A new configuration from `config` (SIGHUP) applies from the next cycle on.
pub async fn run(
    mut config: watch::Receiver<Arc<Config>>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let mut cfg = config.borrow_and_update().clone();
    let mut syncer = Syncer::new(cfg.clone(), metrics.clone(), cancel.clone());
    metrics.set_stale_after(stale_after(&cfg));
    let mut backoff = Backoff::new(cfg.max_backoff);
    info!(
        interval = %format_duration(cfg.interval),
        batch_blocks = cfg.batch_blocks,
        false_positive_rate = cfg.false_positive_rate,
        "sync loop started"
    );
    while !cancel.is_cancelled() {
        metrics.heartbeat();
        // `changed()` below marks a new value as seen, so compare instead of asking
        // `has_changed()`.
        let latest = config.borrow_and_update().clone();
        if !Arc::ptr_eq(&latest, &cfg) {
            cfg = latest;
            syncer.reconfigure(cfg.clone());
            backoff = Backoff::new(cfg.max_backoff);
        }
        let started = Instant::now();
        let wait = match syncer.cycle(None).await {
            Ok(report) => {
                backoff.reset();
                log_cycle(&report);
                notify::notify(&format!(
                    "STATUS=coverage {:.1}% of {} hot blocks, {} loaded in the last cycle",
                    report.coverage() * 100.0,
                    report.hot_buffers,
                    report.loaded
                ));
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
            // A reload (a new interval, a new host) applies at once.
            _ = config.changed() => {}
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
    /// Batches lost to storage errors on the standby.
    pub storage_errors: u64,
    /// Cycles cut short by a recovery conflict (each followed by another cycle).
    pub recovery_conflicts: u64,
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
        self.storage_errors += report.storage_errors;
        self.recovery_conflicts += report.recovery_conflicts;
        self.hot_buffers = report.hot_buffers;
        self.coverage = report.coverage();
    }

    pub fn to_text(&self) -> String {
        let mut notes = String::new();
        if self.storage_errors > 0 {
            notes.push_str(&format!(
                "; {} batches lost to storage errors",
                self.storage_errors
            ));
        }
        if self.recovery_conflicts > 0 {
            notes.push_str(&format!("; {} recovery conflicts", self.recovery_conflicts));
        }
        format!(
            "{} after {} cycle{}: sent {} blocks, loaded {}, already cached {}, skipped {}; \
             hot set {} buffers, coverage {:.1}%{notes}",
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
    // A recovery conflict cut the cycle short: what it did not send comes next cycle.
    // Nothing sent: the standby holds the whole hot set. Something sent but nothing loaded:
    // the rest cannot be loaded (dropped relations, a full standby), and the next cycle would
    // send the very same list.
    report.interrupted() || (report.sent > 0 && report.loaded > 0)
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
    let interval = cfg.interval;
    let mut syncer = Syncer::new(cfg, metrics, cancel.clone());
    let mut summary = SyncSummary::default();
    while summary.cycles < max_cycles {
        progress.set_message(format!("cycle {}", summary.cycles + 1));
        let report = syncer.cycle(Some(progress)).await?;
        // Logs go to the same stderr as the bar: lift the bar while one is written.
        progress.suspend(|| log_cycle(&report));
        summary.add(&report);
        summary.complete = report.sent == 0 && !report.interrupted();
        if !another_cycle(&report) || summary.cycles >= max_cycles {
            break;
        }
        if report.interrupted() {
            // Give replay a moment before asking again.
            tokio::select! {
                _ = cancel.cancelled() => return Err(CycleError::Cancelled),
                _ = tokio::time::sleep(interval) => {}
            }
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
        // A recovery conflict cut the cycle short (before anything loaded, or even before
        // the list was fetched): try again.
        let conflicted = |sent| CycleReport {
            recovery_conflicts: 1,
            ..report(100, sent, 0)
        };
        assert!(another_cycle(&conflicted(50)));
        assert!(another_cycle(&conflicted(0)));
    }

    fn syncer() -> (Syncer, Arc<Metrics>) {
        let cfg = Config::validate(crate::config::RawConfig {
            primary: Some("host=127.0.0.1 port=1 user=u dbname=postgres".into()),
            standby: Some("host=127.0.0.2 port=1 user=u dbname=postgres".into()),
            ..Default::default()
        })
        .unwrap();
        let metrics = Arc::new(Metrics::new());
        let syncer = Syncer::new(Arc::new(cfg), metrics.clone(), CancellationToken::new());
        (syncer, metrics)
    }

    fn metric(metrics: &Metrics, name: &str) -> f64 {
        metrics
            .render()
            .lines()
            .find_map(|l| {
                let (n, v) = l.rsplit_once(' ')?;
                (n == name).then(|| v.parse().ok())?
            })
            .unwrap_or_else(|| panic!("{name} not rendered"))
    }

    #[test]
    fn a_prewarm_reporting_no_recovery_is_a_role_change() {
        let (mut syncer, metrics) = syncer();
        syncer.last_standby_host = Some("s:5432".into());
        let mut report = CycleReport::default();
        let done = PrewarmResult {
            requested: 10,
            loaded: 10,
            ..Default::default()
        };
        let err = syncer
            .prewarm_outcome(10, Ok((false, done)), &mut report)
            .unwrap_err();
        match &err {
            CycleError::RoleChanged { side, message } => {
                assert_eq!(*side, Side::Standby);
                assert!(message.contains("s:5432 was promoted"), "{message}");
            }
            other => panic!("expected RoleChanged, got {other:?}"),
        }
        assert_eq!(err.stage(), Some(Stage::Safety));
        // Nothing from a promoted node is counted as loaded.
        assert_eq!(report.loaded, 0);
        assert_eq!(metric(&metrics, "ccm_agent_blocks_loaded_total"), 0.0);
        assert!(syncer.standby.is_none());
    }

    #[test]
    fn a_prewarm_in_recovery_is_counted() {
        let (mut syncer, metrics) = syncer();
        let mut report = CycleReport::default();
        let done = PrewarmResult {
            requested: 10,
            loaded: 6,
            already_cached: 3,
            skipped: 1,
        };
        let flow = syncer
            .prewarm_outcome(10, Ok((true, done)), &mut report)
            .unwrap();
        assert_eq!(flow, Flow::Next);
        assert_eq!(
            (
                report.requested,
                report.loaded,
                report.already_cached,
                report.skipped
            ),
            (10, 6, 3, 1)
        );
        assert_eq!(metric(&metrics, "ccm_agent_blocks_sent_total"), 10.0);
        assert_eq!(metric(&metrics, "ccm_agent_blocks_skipped_total"), 1.0);
    }

    #[test]
    fn shutdown_and_disabled_pass_through() {
        let (mut syncer, _) = syncer();
        let mut report = CycleReport::default();
        assert!(matches!(
            syncer.prewarm_outcome(1, Err(NodeError::Cancelled), &mut report),
            Err(CycleError::Cancelled)
        ));
        assert!(matches!(
            syncer.prewarm_outcome(
                1,
                Err(NodeError::Disabled { host: "h".into() }),
                &mut report
            ),
            Err(CycleError::Disabled {
                side: Side::Standby,
                ..
            })
        ));
    }

    #[test]
    fn errors_print_their_chain_once() {
        let e = CycleError::Node {
            stage: Stage::Prewarm,
            side: Side::Standby,
            error: NodeError::Unexpected {
                host: "s:5432".into(),
                what: "ccm_prewarm()",
                detail: "an unusable value in column 1".into(),
            },
        };
        let text = format!("{:#}", anyhow::Error::from(e).context("sync failed"));
        assert_eq!(
            text,
            "sync failed: s:5432: ccm_prewarm() returned an unusable value in column 1"
        );
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
            ..Default::default()
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
            "storage_errors",
            "recovery_conflicts",
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

//! What a cycle did, and the one place where it is counted.
//!
//! A cycle and its standbys' tasks fill a [`CycleReport`]: the log's cycle line, `sync
//! --once`'s summary and the tests read it. Everything a cycle does that the metrics count
//! (a scan, a list, a feed answer, a prewarm batch, a storage error, a recovery conflict, a
//! replay-lag pause, the cycle's end) is an [`Event`] given to [`CycleReport::note`], which
//! adds it to the report and to the metrics in the same step, so the two cannot disagree and
//! the block counters stay live batch by batch during a long load. What is not an event of a
//! cycle (a session up or down, the election, the WAL cache's figures, bytes on the wire, an
//! error's stage) is set where that state changes.

use std::time::Duration;

use tracing::info;

use crate::feed::FeedAnswer;
use crate::metrics::{coverage, saturating_i64, Metrics};
use crate::node::PrewarmResult;
use crate::standby::Tier;

/// What one cycle did for one standby.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct StandbyReport {
    pub name: String,
    /// Hot buffers the primary's scan found (the same for every standby of a cycle).
    pub hot_buffers: u64,
    /// Its shared_buffers: the cap of its list, which holds its part of the hot set.
    pub room: u64,
    /// Blocks in its list, i.e. hot blocks (of its hottest part) its filter lacked.
    pub sent: u64,
    /// Blocks it read, hot and colder (filled) ones.
    pub loaded: u64,
    /// Of `loaded`, colder blocks that filled its unused buffers (fill_room).
    pub filled: u64,
    pub recovery_conflicts: u64,
    pub storage_errors: u64,
    /// Its replay lag rose above max_replay_lag: its share of the cycle ended there.
    pub replay_paused: bool,
}

impl StandbyReport {
    /// Hot blocks it lacks: those of its list, and those beyond its room (a standby smaller
    /// than the hot set is sent only the hottest part, the rest counts as missing).
    pub fn missing(&self) -> u64 {
        self.hot_buffers
            .saturating_sub(self.room.min(self.hot_buffers))
            + self.sent
    }

    /// Its share of the hot set at scan time, as `status` and `wait` measure it.
    pub fn coverage(&self) -> f64 {
        coverage(self.hot_buffers, self.missing())
    }
}

/// What one cycle did, summed over the standbys warmed.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct CycleReport {
    /// Hot buffers the primary's scan found before filtering.
    pub hot_buffers: u64,
    pub buffers_scanned: u64,
    /// Blocks in the lists, i.e. hot blocks the standbys' filters lacked.
    pub sent: u64,
    /// Colder blocks sent to fill unused buffers (fill_room); not part of `sent`.
    pub colder_sent: u64,
    pub batches: usize,
    pub requested: u64,
    pub loaded: u64,
    pub already_cached: u64,
    /// Skipped by the standbys, plus the blocks of batches lost to storage errors.
    pub skipped: u64,
    /// Batches lost to a storage error on a standby.
    pub storage_errors: u64,
    /// Recovery conflicts; one ends that standby's share of the cycle.
    pub recovery_conflicts: u64,
    /// Standbys whose share of the cycle ended because their replay lag passed max_replay_lag.
    pub replay_pauses: u64,
    pub filter_bytes: usize,
    pub list_bytes: usize,
    pub duration: Duration,
    /// The standbys warmed this cycle, in order.
    pub standbys: Vec<StandbyReport>,
}

impl CycleReport {
    /// The share of the hot set cached at scan time, on the standby that had the least.
    pub fn coverage(&self) -> f64 {
        match self
            .standbys
            .iter()
            .map(StandbyReport::coverage)
            .reduce(f64::min)
        {
            Some(lowest) => lowest,
            None => coverage(self.hot_buffers, self.sent),
        }
    }

    /// This cycle's report of the standby called `name`.
    pub(crate) fn standby_mut(&mut self, name: &str) -> Option<&mut StandbyReport> {
        self.standbys.iter_mut().rev().find(|r| r.name == name)
    }

    /// Blocks standby `name` loaded this cycle, if its share ran to the end (no recovery
    /// conflict, storage error or replay-lag pause cut it short): fill_room's condition.
    pub(crate) fn loaded_whole_share(&self, name: &str) -> Option<u64> {
        self.standbys
            .iter()
            .find(|r| {
                r.name == name
                    && r.recovery_conflicts == 0
                    && r.storage_errors == 0
                    && !r.replay_paused
            })
            .map(|r| r.loaded)
    }

    /// Adds what a standby's task did (`part`) to this cycle's report.
    pub(crate) fn absorb(&mut self, part: CycleReport) {
        self.hot_buffers = self.hot_buffers.max(part.hot_buffers);
        self.buffers_scanned = self.buffers_scanned.max(part.buffers_scanned);
        self.sent += part.sent;
        self.colder_sent += part.colder_sent;
        self.batches += part.batches;
        self.requested += part.requested;
        self.loaded += part.loaded;
        self.already_cached += part.already_cached;
        self.skipped += part.skipped;
        self.storage_errors += part.storage_errors;
        self.recovery_conflicts += part.recovery_conflicts;
        self.replay_pauses += part.replay_pauses;
        self.filter_bytes += part.filter_bytes;
        self.list_bytes += part.list_bytes;
        self.standbys.extend(part.standbys);
    }

    /// Whether the cycle was cut short by a recovery conflict or by replay lag.
    pub fn interrupted(&self) -> bool {
        self.recovery_conflicts > 0 || self.replay_pauses > 0
    }
}

/// Something a cycle did that the report and the metrics count.
#[derive(Debug)]
pub enum Event<'a> {
    /// Step (2) or (3) for one standby: its part of the hot set (`standby`), the blocks taken
    /// to send it now (`taken`), and with the filter exchange the primary's scan as its list's
    /// header gives it (hot buffers found, buffers scanned).
    Scanned {
        standby: StandbyReport,
        taken: u64,
        scan: Option<(u64, u64)>,
    },
    /// Step (1) with the filter exchange: a standby's bloom filter of `bytes`.
    Filtered { bytes: usize },
    /// Step (1) in feed mode: a standby's change-feed answer.
    StandbyFed {
        standby: &'a str,
        answer: &'a FeedAnswer,
    },
    /// Step (2) with the filter exchange: the primary's hot block lists, `bytes` in all.
    Listed { bytes: usize },
    /// Step (2) in feed mode: the primary's change-feed answer, its hot set then `hot` blocks.
    PrimaryFed { answer: &'a FeedAnswer, hot: u64 },
    /// Step (4): a batch of `blocks` blocks goes to a standby.
    BatchSent { blocks: u64, tier: Tier },
    /// Step (4): what a standby did with a batch of `blocks` blocks.
    BatchDone {
        standby: &'a str,
        blocks: u64,
        tier: Tier,
        done: &'a PrewarmResult,
    },
    /// Step (4): a batch of `blocks` blocks lost to a storage error on a standby.
    StorageError { standby: &'a str, blocks: u64 },
    /// A recovery conflict ended a standby's share of the cycle.
    RecoveryConflict { standby: &'a str },
    /// Replay lag ended a standby's share of the cycle.
    ReplayPaused { standby: &'a str },
}

impl CycleReport {
    /// Adds `event` to this report and to `metrics`.
    pub fn note(&mut self, metrics: &Metrics, event: Event<'_>) {
        match event {
            Event::Scanned {
                standby,
                taken,
                scan,
            } => {
                if let Some((hot, scanned)) = scan {
                    self.hot_buffers = hot;
                    self.buffers_scanned = scanned;
                }
                self.sent += taken;
                metrics.standby_scan(&standby.name, standby.hot_buffers, standby.missing());
                self.standbys.push(standby);
            }
            Event::Filtered { bytes } => {
                self.filter_bytes += bytes;
                metrics.filter_bytes.set(saturating_i64(bytes as u64));
            }
            Event::StandbyFed { standby, answer } => {
                feed_reset(metrics, standby, answer);
                self.filter_bytes += answer_bytes(answer);
            }
            Event::Listed { bytes } => {
                self.list_bytes += bytes;
                metrics.block_list_bytes.set(saturating_i64(bytes as u64));
            }
            Event::PrimaryFed { answer, hot } => {
                feed_reset(metrics, "primary", answer);
                self.buffers_scanned = u64::try_from(answer.visited).unwrap_or(0);
                self.hot_buffers = hot;
                let bytes = answer_bytes(answer);
                self.list_bytes += bytes;
                metrics.block_list_bytes.set(saturating_i64(bytes as u64));
            }
            Event::BatchSent { blocks, tier } => {
                self.batches += 1;
                if tier == Tier::Fill {
                    self.colder_sent += blocks;
                }
            }
            Event::BatchDone {
                standby,
                blocks,
                tier,
                done,
            } => {
                metrics.blocks_sent.inc_by(blocks);
                metrics.blocks_loaded.inc_by(done.loaded);
                if tier == Tier::Fill {
                    metrics.fill_blocks_loaded.inc_by(done.loaded);
                }
                metrics.blocks_already_cached.inc_by(done.already_cached);
                metrics.blocks_skipped.inc_by(done.skipped);
                metrics.standby_loaded(standby, done.loaded);
                self.requested += done.requested;
                self.loaded += done.loaded;
                self.already_cached += done.already_cached;
                self.skipped += done.skipped;
                if let Some(r) = self.standby_mut(standby) {
                    r.loaded += done.loaded;
                    if tier == Tier::Fill {
                        r.filled += done.loaded;
                    }
                }
            }
            Event::StorageError { standby, blocks } => {
                metrics.prewarm_storage_errors.inc();
                self.storage_errors += 1;
                if let Some(r) = self.standby_mut(standby) {
                    r.storage_errors += 1;
                }
                let lost = PrewarmResult {
                    skipped: blocks,
                    ..PrewarmResult::default()
                };
                self.note(
                    metrics,
                    Event::BatchDone {
                        standby,
                        blocks,
                        tier: Tier::Hot,
                        done: &lost,
                    },
                );
            }
            Event::RecoveryConflict { standby } => {
                metrics.recovery_conflicts.inc();
                self.recovery_conflicts += 1;
                if let Some(r) = self.standby_mut(standby) {
                    r.recovery_conflicts += 1;
                }
            }
            Event::ReplayPaused { standby } => {
                metrics.replay_lag_pauses.inc();
                self.replay_pauses += 1;
                if let Some(r) = self.standby_mut(standby) {
                    r.replay_paused = true;
                }
            }
        }
    }

    /// The cycle ended after `duration`; with `lowest` (the least covered standby's share,
    /// those still at work included) when it ran to its end, which sets the hot-set gauges.
    pub fn close(&mut self, metrics: &Metrics, duration: Duration, lowest: Option<f64>) {
        self.duration = duration;
        metrics.cycle_done(duration);
        if let Some(lowest) = lowest {
            metrics.hot_set_blocks.set(saturating_i64(self.hot_buffers));
            metrics.coverage_ratio.set(lowest);
        }
    }
}

/// Most candidates, and longest names in bytes, the primary's report keeps (extension's
/// candidates.rs); the agent stays within them, so that one long name never loses the report.
pub const REPORT_MAX_CANDIDATES: usize = 64;
pub const REPORT_MAX_NAME: usize = 63;
/// Longest delay the extension accepts for the next report (a day).
pub const REPORT_MAX_DUE_MS: i64 = 86_400_000;

/// `text` cut to at most `max` bytes, at a character boundary.
pub fn truncated(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// One failover candidate as the agent tells the primary after a cycle (`ccm_candidates`,
/// extension 0.8.0): its state, and its share of the hot set when it last reported.
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateRow {
    pub member: String,
    pub state: CandidateState,
    pub coverage: Option<f64>,
    pub missing_blocks: Option<i64>,
    pub hot_blocks: Option<i64>,
}

/// A candidate's state in `ccm_candidates`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CandidateState {
    /// Connected; its last share of a cycle ran to the end.
    Up,
    /// Connected; its task is still loading (a cold or large standby).
    Warming,
    /// Connected; its replay lag is above max_replay_lag, so warming waits for replay.
    Paused,
    /// Its task has not heard from it for a while (a partition, a frozen host).
    Silent,
    /// No session: down, refused, or not yet reached.
    Down,
}

impl CandidateState {
    pub fn as_str(self) -> &'static str {
        match self {
            CandidateState::Up => "up",
            CandidateState::Warming => "warming",
            CandidateState::Paused => "paused",
            CandidateState::Silent => "silent",
            CandidateState::Down => "down",
        }
    }
}

impl CandidateRow {
    /// A candidate in `state`, with its figures from `last` (its last share of a cycle) where
    /// they still say something: not for a candidate that is down or silent.
    pub fn new(member: &str, state: CandidateState, last: Option<&StandbyReport>) -> Self {
        let known =
            last.filter(|_| !matches!(state, CandidateState::Down | CandidateState::Silent));
        CandidateRow {
            member: truncated(member, REPORT_MAX_NAME).to_string(),
            state,
            coverage: known.map(StandbyReport::coverage),
            missing_blocks: known.map(|r| saturating_i64(r.missing())),
            hot_blocks: known.map(|r| saturating_i64(r.hot_buffers)),
        }
    }
}

/// Logs (once per reset) and counts a node's feed starting over.
fn feed_reset(metrics: &Metrics, node: &str, answer: &FeedAnswer) {
    if answer.reset {
        metrics.feed_reset(node);
        info!(
            node = %node,
            reason = answer.reset_reason.as_deref().unwrap_or("?"),
            "the change feed of {node} starts over ({}): its blocks are listed again",
            answer.reset_reason.as_deref().unwrap_or("?")
        );
    }
}

/// The lists of a feed answer, in bytes.
pub fn answer_bytes(answer: &FeedAnswer) -> usize {
    let list = |l: &ccm_codec::BlockList| 32 + l.len() * 3;
    list(&answer.added)
        + list(&answer.removed)
        + answer.colder_added.as_ref().map_or(0, list)
        + answer.colder_removed.as_ref().map_or(0, list)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scanned(report: &mut CycleReport, metrics: &Metrics, name: &str, sent: u64) {
        let standby = StandbyReport {
            name: name.into(),
            hot_buffers: 100,
            room: 1000,
            sent,
            ..Default::default()
        };
        let event = Event::Scanned {
            standby,
            taken: sent,
            scan: None,
        };
        report.note(metrics, event);
    }

    #[test]
    fn a_batch_lost_to_a_storage_error_counts_as_skipped_in_the_report_and_the_metrics() {
        let (metrics, mut report) = (Metrics::new(), CycleReport::default());
        scanned(&mut report, &metrics, "a", 40);
        let done = PrewarmResult {
            requested: 20,
            loaded: 15,
            already_cached: 5,
            ..Default::default()
        };
        for event in [
            Event::BatchSent {
                blocks: 20,
                tier: Tier::Hot,
            },
            Event::BatchDone {
                standby: "a",
                blocks: 20,
                tier: Tier::Hot,
                done: &done,
            },
            Event::BatchSent {
                blocks: 20,
                tier: Tier::Hot,
            },
            Event::StorageError {
                standby: "a",
                blocks: 20,
            },
        ] {
            report.note(&metrics, event);
        }
        assert_eq!(
            (
                report.batches,
                report.loaded,
                report.skipped,
                report.storage_errors
            ),
            (2, 15, 20, 1)
        );
        assert_eq!(
            report.loaded_whole_share("a"),
            None,
            "an error cut it short"
        );
        let rendered = metrics.render();
        for line in [
            "ccm_agent_blocks_sent_total 40",
            "ccm_agent_blocks_loaded_total 15",
            "ccm_agent_blocks_skipped_total 20",
            "ccm_agent_prewarm_storage_errors_total 1",
            "ccm_agent_standby_blocks_loaded_total{node=\"a\"} 15",
            "ccm_agent_standby_missing_blocks{node=\"a\"} 40",
        ] {
            assert!(rendered.lines().any(|l| l == line), "{line} in\n{rendered}");
        }
    }

    #[test]
    fn a_candidates_name_is_cut_to_what_the_primary_keeps_at_a_character_boundary() {
        let long = format!("{}é:5432", "r".repeat(REPORT_MAX_NAME - 1));
        let row = CandidateRow::new(&long, CandidateState::Down, None);
        assert_eq!(
            row.member,
            "r".repeat(REPORT_MAX_NAME - 1),
            "é would cross the limit"
        );
        assert_eq!(truncated("db2:5432", REPORT_MAX_NAME), "db2:5432");
    }

    #[test]
    fn a_cycle_cut_short_sets_no_hot_set_gauge() {
        let (metrics, mut report) = (Metrics::new(), CycleReport::default());
        scanned(&mut report, &metrics, "a", 0);
        report.note(&metrics, Event::ReplayPaused { standby: "a" });
        assert!(report.interrupted());
        report.close(&metrics, Duration::from_millis(5), None);
        let rendered = metrics.render();
        assert!(rendered.contains("ccm_agent_cycles_total 1"), "{rendered}");
        assert!(
            rendered.contains("ccm_agent_hot_set_blocks 0"),
            "{rendered}"
        );
        assert!(rendered.contains("ccm_agent_replay_lag_pauses_total 1"));
        report.close(&metrics, Duration::from_millis(5), Some(0.5));
        let rendered = metrics.render();
        assert!(
            rendered.contains("ccm_agent_coverage_ratio 0.5"),
            "{rendered}"
        );
    }
}

//! One failover candidate and the work the cycle gives it, run as a task of its own.
//!
//! The coordinator (sync.rs) owns the primary's session, the topology and the mirror's
//! primary side; each standby's share of a cycle (connect, check, its change feed or filter,
//! then its batches) runs in a tokio task that owns the standby's session for that time, so
//! that one slow or silent standby never holds up another. The coordinator waits for those
//! tasks only up to a deadline; a task still running then keeps its standby busy, and the
//! cycles go on with the others until it ends (its session's own deadlines end it: the
//! statement timeout, then the call's deadline). What it did is counted in the cycle in which
//! it ends.
//!
//! Everything a task needs from the rest of the cycle comes in [`Shared`]: the configuration,
//! the metrics, the mirror (behind a mutex that is never held across an await), what the
//! primary is (system identifier, timeline, addresses) and the other members' endpoints for
//! the WAL-sender check.
//!
//! A standby's change-feed cursor lives here, not in its session, keyed by the node's system
//! identifier: a new session to the same node goes on from the last answer instead of making
//! the node sweep its cache and send everything again.

use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ccm_codec::{decode_block_list_header, BlockList};
use indicatif::ProgressBar;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::backoff::Backoff;
use crate::config::Config;
use crate::conninfo::{ConnInfo, HostSpec};
use crate::feed::{self, Mirror};
use crate::metrics::{Metrics, Stage};
use crate::node::{ConnectOptions, ErrorClass, Node, NodeError, PrewarmResult, Side};
use crate::nodeapi::NodeApi;
use crate::oscache::{readers_first, OsTier, PrefetchResult};
use crate::report::{CycleReport, Event, StandbyReport};
use crate::retry::{self, Episode, Kind, Pace};
use crate::sync::CycleError;
use crate::topology::Target;
use crate::walsender::{self, Endpoint, Sender, Verdict};

/// A standby's change feed: every cached block is in its set.
const EVERY_CACHED_BLOCK: i32 = -1;

/// The longest wait before asking a host that was not in recovery again.
const NOT_A_STANDBY_RECHECK: Duration = Duration::from_secs(10);

/// fill_room leaves this share of a standby's buffers unused (1/64), for replay and the
/// standby's own reads, which would otherwise have to evict to get a buffer.
pub const FILL_RESERVE_DIVISOR: u64 = 64;
/// Fewer unused buffers than this are not worth a scan of the primary.
pub const FILL_MIN_BLOCKS: u64 = 128;
/// At most this many batches of colder blocks per standby and cycle, so that a large room is
/// filled over several cycles and each cycle's hot blocks are not kept waiting behind it.
pub const FILL_MAX_BATCHES: usize = 8;
/// After a look below the threshold that found nothing to send (a standby larger than what
/// the primary caches), the next one waits this long.
pub const FILL_RECHECK: Duration = Duration::from_secs(30);

/// What one prewarm call leaves for the rest of the standby's share of the cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Next,
    /// The batch was read; the share ends there (replay lag).
    EndCycle,
    /// The batch was not read (a recovery conflict cancelled it); the share ends there.
    Unread,
}

/// Which blocks a prewarm call loads: the hot set's, or colder ones filling unused buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Hot,
    Fill,
}

/// A standby's fate in step (1).
#[derive(Debug)]
pub enum Ready {
    /// Its filter (the filter exchange).
    Filter(Vec<u8>),
    /// Its change feed was applied to the mirror.
    Fed,
    /// Not warmed this cycle, and not a fault (waiting out its backoff, a primary listed
    /// among the standbys, a recovery conflict).
    Pass,
}

/// The seq of the last change-feed answer applied from a node, and which node that was.
#[derive(Debug, Clone)]
struct FeedCursor {
    system_identifier: String,
    seq: i64,
}

/// What the primary is, for the checks a standby's task makes.
#[derive(Debug, Clone, Default)]
pub struct PrimaryView {
    pub label: String,
    pub host: Option<HostSpec>,
    pub system_identifier: String,
    /// The timeline it writes (extension 0.4 and later).
    pub timeline: Option<u32>,
}

/// What a standby's task shares with the cycle.
pub struct Shared {
    pub cfg: Arc<Config>,
    pub metrics: Arc<Metrics>,
    pub cancel: CancellationToken,
    pub subscriber: i64,
    pub mirror: Arc<Mutex<Mirror>>,
    pub primary: PrimaryView,
    /// The primary and the standbys being warmed (accepted as WAL senders), and the other
    /// hosts the agent knows (walsender.rs).
    pub members: Vec<Endpoint>,
    pub others: Vec<Endpoint>,
    pub progress: Option<ProgressBar>,
    /// fill_room's colder blocks are loaded only until then (the end of the interval).
    pub fill_until: Instant,
    /// fill_room from the mirror (the primary's feed reports its colder blocks).
    pub colder_feed: bool,
    /// The page-cache tier (oscache.rs), when configured and the primary has it.
    pub os: Option<Arc<Mutex<OsTier>>>,
}

impl Shared {
    pub fn options(&self) -> ConnectOptions {
        ConnectOptions {
            connect_timeout: self.cfg.connect_timeout,
            statement_timeout: self.cfg.statement_timeout,
        }
    }

    pub fn mirror(&self) -> MutexGuard<'_, Mirror> {
        self.mirror
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The page-cache tier's state, locked for a moment (never across an await).
pub fn os_tier(tier: &Mutex<OsTier>) -> MutexGuard<'_, OsTier> {
    tier.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One standby to warm, and what the loop remembers of it between cycles.
pub struct Standby<N: NodeApi = Node> {
    pub name: String,
    pub conninfo: ConnInfo,
    pub node: Option<N>,
    /// Its own backoff, used while other standbys are being warmed.
    backoff: Backoff,
    pub retry_at: Option<Instant>,
    /// Its run of failures: each kind is logged once, when it starts, and the end once.
    episode: Episode,
    /// Connected and found to follow the primary (check_source): only such a standby is
    /// accepted as another standby's WAL sender (a cascade).
    pub verified: bool,
    /// No look below the threshold for it before this (the last one found nothing to send).
    pub fill_idle_until: Option<Instant>,
    /// Its warming waits for replay (max_replay_lag): logged once, when it starts.
    replay_behind: bool,
    /// A ccm_os_prefetch call failed, and that was logged (once per episode).
    os_failing: bool,
    /// Its page-cache reading waits for its own readers, and that was logged (once).
    os_waiting: bool,
    /// Blocks its change feed holds as cached (feed mode), for fill_room's room.
    pub feed_tracked: Option<u64>,
    /// WAL senders of it that are no node the agent knows (walsender.rs).
    unknown_senders: walsender::Unknowns,
    feed_cursor: Option<FeedCursor>,
    /// When it last answered a call (or its task started): the cycle reads it while the
    /// task runs, to tell a standby at work from a silent one.
    pub heard: Arc<Mutex<Instant>>,
}

impl<N: NodeApi> Standby<N> {
    pub fn new(target: Target, max_backoff: Duration) -> Self {
        Standby {
            name: target.name,
            conninfo: target.conninfo,
            node: None,
            backoff: Backoff::new(max_backoff),
            retry_at: None,
            episode: Episode::default(),
            verified: false,
            fill_idle_until: None,
            replay_behind: false,
            os_failing: false,
            os_waiting: false,
            feed_tracked: None,
            unknown_senders: walsender::Unknowns::default(),
            feed_cursor: None,
            heard: Arc::new(Mutex::new(Instant::now())),
        }
    }

    pub fn host(&self) -> Option<HostSpec> {
        self.conninfo.hosts().into_iter().next()
    }

    fn node(&mut self) -> &mut N {
        self.node.as_mut().expect("connected by ensure")
    }

    /// Its shared_buffers, once connected (1 before).
    pub fn buffers(&self) -> i64 {
        self.node
            .as_ref()
            .map_or(1, |n| n.facts().shared_buffers.max(1))
    }

    /// A reloaded max_backoff: its backoff starts afresh under the new ceiling.
    pub fn set_max_backoff(&mut self, max_backoff: Duration) {
        self.backoff = Backoff::new(max_backoff);
    }

    /// Puts it off for its next backoff delay (at most `cap`) because of `problem`, a note
    /// that is no fault (its text is its kind). Returns the delay as the log says it when
    /// the problem is new to this episode: each is logged once.
    pub fn defer(&mut self, cap: Duration, problem: String) -> Option<String> {
        let (retry, tell) = self.put_off(Pace::Fast, cap, Kind::note(problem));
        tell.then_some(retry)
    }

    /// Puts it off after a failure of `kind`: its next delay for `pace`, at most `cap`.
    /// Returns the delay as the log says it, and whether to tell (its kind's first failure
    /// in this episode).
    fn put_off(&mut self, pace: Pace, cap: Duration, kind: Kind) -> (String, bool) {
        let delay = retry::next_delay(&mut self.backoff, pace, cap);
        let now = Instant::now();
        self.retry_at = Some(now + delay);
        (
            retry::when(pace, delay, cap),
            self.episode.failed(kind, now),
        )
    }

    /// Its trouble while the cycle goes on with others: logged when it starts, counted, and
    /// retried after its own backoff.
    pub fn trouble(&mut self, cfg: &Config, metrics: &Metrics, error: &CycleError) {
        if let Some(stage) = error.stage() {
            metrics.cycle_error(stage);
        }
        let cap = error.backoff_cap(cfg);
        let (retry, tell) = self.put_off(error.pace(), cap, error.kind());
        match error {
            _ if !tell => {
                debug!(standby = %self.name, kind = %error.kind(), "{error}; retrying in {retry}")
            }
            CycleError::Safety(_) => {
                error!(standby = %self.name, "{error}; retrying in {retry}")
            }
            _ => {
                warn!(standby = %self.name, "{error}; warming the other standbys, retrying this one in {retry}")
            }
        }
    }

    /// Warmed without trouble: its backoff and problem are over.
    pub fn fine(&mut self) {
        self.backoff.reset();
        self.retry_at = None;
        if let Some(ended) = self.episode.end(Instant::now()) {
            info!(standby = %self.name, "warming the standby {} again, after {ended}", self.name);
        }
    }

    /// Closes its session (counting what it carried) and shows it down.
    pub fn drop_session(&mut self, metrics: &Metrics) {
        count_node_wire(metrics, &self.name, self.node.as_mut());
        self.verified = false;
        if self.node.take().is_some() {
            metrics.set_standby_up(&self.name, false);
        }
    }

    /// Adds what its session carried since the last count to ccm_agent_bytes_total.
    pub fn count_wire(&mut self, metrics: &Metrics) {
        count_node_wire(metrics, &self.name, self.node.as_mut());
    }

    fn broken(&self, error: &NodeError) -> bool {
        error.breaks_connection() || self.node.as_ref().is_some_and(|n| n.is_closed())
    }

    /// Turns a call's error into a cycle error, dropping the session if it is broken.
    fn call<T>(
        &mut self,
        metrics: &Metrics,
        stage: Stage,
        result: Result<T, NodeError>,
    ) -> Result<T, CycleError> {
        match result {
            Ok(v) => {
                metrics.progress();
                self.heard_now();
                Ok(v)
            }
            Err(NodeError::Cancelled) => Err(CycleError::Cancelled),
            Err(NodeError::Disabled { host }) => Err(CycleError::Disabled {
                side: Side::Standby,
                host,
            }),
            Err(error) => {
                if self.broken(&error) {
                    self.drop_session(metrics);
                }
                Err(CycleError::Node {
                    stage,
                    side: Side::Standby,
                    error,
                })
            }
        }
    }

    /// It answered just now.
    pub fn heard_now(&self) {
        *self.heard.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// It was promoted (no longer in recovery): drops it and says so.
    pub fn promoted(&mut self, metrics: &Metrics) -> CycleError {
        let host = self
            .node
            .as_ref()
            .map(|n| n.label())
            .unwrap_or_else(|| self.name.clone());
        self.drop_session(metrics);
        CycleError::RoleChanged {
            side: Side::Standby,
            message: format!(
                "standby {host} was promoted (no longer in recovery); looking for a new standby"
            ),
        }
    }

    // ---- (1) connected, checked, and what it caches -------------------------------------

    /// Connects it if needed. `Ok(false)`: the host is not a standby (a primary listed among
    /// the standbys, or the node just promoted).
    async fn ensure(&mut self, shared: &Shared) -> Result<bool, CycleError> {
        if let Some(node) = &self.node {
            if !node.is_closed() {
                return Ok(true);
            }
            warn!(
                standby = %self.name,
                "lost the connection to the standby {}; reconnecting",
                node.label()
            );
            self.drop_session(&shared.metrics);
        }
        let Some(host) = self.host() else {
            return Ok(false);
        };
        let connected = N::connect(
            &self.conninfo,
            &host,
            Side::Standby,
            shared.options(),
            &shared.cancel,
        )
        .await;
        let mut node = match connected {
            Ok(node) => node,
            Err(NodeError::Cancelled) => return Err(CycleError::Cancelled),
            Err(error) => {
                return Err(CycleError::Node {
                    stage: Stage::Connect,
                    side: Side::Standby,
                    error,
                })
            }
        };
        if !node.facts().in_recovery {
            return Ok(false);
        }
        node.require_extension().map_err(|error| CycleError::Node {
            stage: Stage::Connect,
            side: Side::Standby,
            error,
        })?;
        check_same_system(&shared.primary, &node).map_err(CycleError::Safety)?;
        // The same node as before goes on from its feed's last answer.
        let after = self
            .feed_cursor
            .as_ref()
            .filter(|c| c.system_identifier == node.facts().system_identifier)
            .map_or(0, |c| c.seq);
        node.set_feed_after(after);
        info!(
            side = "standby",
            standby = %self.name,
            host = %node.label(),
            system_identifier = %node.facts().system_identifier,
            server_version = %node.facts().server_version,
            pg_ccm = node.facts().extension_version.as_deref().unwrap_or("?"),
            pg_ccm_library = node.facts().library_version.as_deref().unwrap_or("?"),
            shared_buffers_blocks = node.facts().shared_buffers,
            "connected to the standby {}",
            self.name
        );
        if let Some(warning) = node.catalog_behind() {
            warn!(standby = %self.name, "{warning}");
        }
        shared.metrics.set_standby_up(&self.name, true);
        self.node = Some(node);
        Ok(true)
    }

    /// Checks that it follows the primary: the same timeline, and WAL streamed from the
    /// primary (or from another standby being warmed, a cascade).
    async fn check_source(&mut self, shared: &Shared) -> Result<(), CycleError> {
        self.verified = false;
        let Some(primary_timeline) = shared.primary.timeline else {
            return Ok(());
        };
        let result = self.node().wal_source().await;
        let source = self.call(&shared.metrics, Stage::Safety, result)?;
        if !source.in_recovery {
            return Err(self.promoted(&shared.metrics));
        }
        let name = self.name.clone();
        let primary = &shared.primary.label;
        if let Some(timeline) = source.timeline {
            if timeline != primary_timeline {
                self.drop_session(&shared.metrics);
                return Err(CycleError::Safety(format!(
                    "standby {name} streams timeline {timeline} but the primary {primary} writes \
                     timeline {primary_timeline}: it follows another primary, so it is not warmed"
                )));
            }
        }
        if let (Some(sender), Some(port)) = (source.sender_host.as_deref(), source.sender_port) {
            if !self
                .sender_accepted(shared, Endpoint::new(sender, port))
                .await
            {
                self.drop_session(&shared.metrics);
                return Err(CycleError::Safety(format!(
                    "standby {name} streams its WAL from {sender}:{port}, which is neither the \
                     primary {primary} nor a standby being warmed, so it is not warmed"
                )));
            }
        }
        // A WAL receiver that is not streaming (reconnecting, or no primary_conninfo) names
        // no sender: the timeline and the system identifier are all there is to check.
        self.verified = true;
        Ok(())
    }

    /// Whether it may be warmed given its WAL sender (walsender.rs): a member or, under
    /// `wal_sender_check = warn`, an unknown one (warned about once).
    async fn sender_accepted(&mut self, shared: &Shared, sender: Endpoint) -> bool {
        let check = shared.cfg.wal_sender_check;
        let name = self.name.clone();
        let now = Instant::now();
        let found = if check == walsender::SenderCheck::Off {
            Sender::Member
        } else if self.unknown_senders.recent(&name, &sender, now) {
            Sender::Unknown
        } else {
            classify_sender(shared, sender.clone()).await
        };
        match walsender::verdict(&found, check) {
            Verdict::Warm => {
                self.unknown_senders.forget(&name);
                true
            }
            Verdict::WarmUnknown => {
                if self.unknown_senders.record(&name, &sender, now) {
                    warn!(
                        standby = %name,
                        "standby {name} streams its WAL from {}:{}, which is no node the agent \
                         knows (a virtual IP, a Service or a proxy?); it is warmed on the \
                         strength of its system identifier and timeline \
                         (wal_sender_check = strict refuses it)",
                        sender.name, sender.port
                    );
                }
                true
            }
            Verdict::Refuse => false,
        }
    }

    /// Step (1): connected, checked, and its filter (or its change feed applied).
    pub async fn prepare(
        &mut self,
        shared: &Shared,
        feed: bool,
        report: &mut CycleReport,
    ) -> Result<Ready, CycleError> {
        if self.retry_at.is_some_and(|at| Instant::now() < at) {
            return Ok(Ready::Pass);
        }
        if !self.ensure(shared).await? {
            // A primary listed among the standbys stays one until a failover, when the
            // old primary comes back as a standby: ask again now and then, never rarely.
            let note = format!("{} is not in recovery", self.name);
            if let Some(retry) = self.defer(NOT_A_STANDBY_RECHECK, note.clone()) {
                info!(standby = %self.name, "{note}; not warming it (asking again in {retry})");
            }
            return Ok(Ready::Pass);
        }
        self.check_source(shared).await?;
        if feed {
            return self.feed(shared, report).await;
        }
        let fpr = shared.cfg.false_positive_rate;
        let result = self.node().buffer_filter(fpr).await;
        let Some(filter) = self.in_recovery(shared, result, report)? else {
            return Ok(Ready::Pass);
        };
        report.note(
            &shared.metrics,
            Event::Filtered {
                bytes: filter.len(),
            },
        );
        Ok(Ready::Filter(filter))
    }

    /// A step (1) call's answer, given with the recovery state of the same instant: None after
    /// a recovery conflict (not a fault: its share of the cycle ends), an error if the call
    /// failed or the standby was promoted.
    fn in_recovery<T>(
        &mut self,
        shared: &Shared,
        result: Result<(bool, T), NodeError>,
        report: &mut CycleReport,
    ) -> Result<Option<T>, CycleError> {
        if let Err(error) = &result {
            if error.class() == ErrorClass::RecoveryConflict {
                self.recovery_conflict(&shared.metrics, error, report);
                return Ok(None);
            }
        }
        let (in_recovery, answer) = self.call(&shared.metrics, Stage::Filter, result)?;
        if !in_recovery {
            return Err(self.promoted(&shared.metrics));
        }
        Ok(Some(answer))
    }

    /// Step (1) in feed mode: its change feed's answer, applied to the mirror. A feed that has
    /// not swept all the standby's buffers since its last reset (a restarted standby, a new
    /// agent) is asked once more in the same cycle to sweep all of them, so that the agent
    /// knows what the standby holds, and how much room it has, before it sends (one sweep of
    /// shared_buffers after each reset, instead of a quarter in each of four cycles).
    async fn feed(
        &mut self,
        shared: &Shared,
        report: &mut CycleReport,
    ) -> Result<Ready, CycleError> {
        let name = self.name.clone();
        let buffers = self.node().facts().shared_buffers;
        for budget in [feed::sweep_budget(buffers), buffers] {
            let result = self
                .node()
                .buffer_changes(shared.subscriber, Some(EVERY_CACHED_BLOCK), budget, false)
                .await;
            let Some(answer) = self.in_recovery(shared, result, report)? else {
                return Ok(Ready::Pass);
            };
            report.note(
                &shared.metrics,
                Event::StandbyFed {
                    standby: &name,
                    answer: &answer,
                },
            );
            let complete = {
                let mut mirror = shared.mirror();
                mirror.apply_standby(&name, &answer);
                mirror.standby_complete(&name)
            };
            let node = self.node();
            node.set_feed_after(answer.seq);
            self.feed_cursor = Some(FeedCursor {
                system_identifier: node.facts().system_identifier.clone(),
                seq: answer.seq,
            });
            self.feed_tracked = u64::try_from(answer.tracked).ok();
            if complete {
                break;
            }
        }
        Ok(Ready::Fed)
    }

    // ---- (3), (4), (5): its batches --------------------------------------------------------

    /// Steps (3) and (4) with the filter exchange: its list decoded and loaded in batches.
    pub async fn warm_list(
        &mut self,
        shared: &Shared,
        list_bytes: &[u8],
        report: &mut CycleReport,
    ) -> Result<(), CycleError> {
        let limit = self.buffers();
        let list = BlockList::decode_bounded(list_bytes, u64::try_from(limit).unwrap_or(1))
            .map_err(|e| CycleError::Decode(e.to_string()))?;
        let sent = list.len() as u64;
        let standby = StandbyReport {
            name: self.name.clone(),
            hot_buffers: list.header.hot_buffers_found,
            room: u64::try_from(limit).unwrap_or(1),
            sent,
            ..Default::default()
        };
        let scan = (list.header.hot_buffers_found, list.header.buffers_scanned);
        report.note(
            &shared.metrics,
            Event::Scanned {
                standby,
                taken: sent,
                scan: Some(scan),
            },
        );
        if let Some(pb) = &shared.progress {
            pb.inc_length(sent);
        }
        if sent == 0 {
            return Ok(());
        }
        let batches = list.split_hottest_first(shared.cfg.batch_blocks as usize);
        self.load(shared, &batches, Tier::Hot, None, report)
            .await
            .map(|_| ())
    }

    /// Steps (3) and (4) in feed mode: the hot blocks it lacks, hottest first, at most its
    /// shared_buffers, loaded in batches; then, with fill_room from the mirror, colder blocks
    /// into its unused buffers until `fill_until`. What is sent is confirmed by its feed's
    /// later sweeps.
    pub async fn warm_feed(
        &mut self,
        shared: &Shared,
        report: &mut CycleReport,
    ) -> Result<(), CycleError> {
        let room = self.buffers();
        let name = self.name.clone();
        let unused = self.unused_buffers(shared);
        let (hot, lacking, list) = {
            let mut mirror = shared.mirror();
            let hot = mirror.hot_len() as u64;
            let lacking = mirror.lacking(&name) as u64;
            let list = mirror.take_missing(
                &name,
                feed::Class::Hot,
                usize::try_from(room).unwrap_or(usize::MAX),
            );
            (hot, lacking, list)
        };
        let sent = list.as_ref().map_or(0, |l| l.len() as u64);
        let standby = StandbyReport {
            name: name.clone(),
            hot_buffers: hot,
            room: u64::try_from(room).unwrap_or(1),
            sent: lacking,
            ..Default::default()
        };
        report.note(
            &shared.metrics,
            Event::Scanned {
                standby,
                taken: sent,
                scan: None,
            },
        );
        if let Some(list) = list {
            if let Some(pb) = &shared.progress {
                pb.inc_length(sent);
            }
            let batches = in_load_order(&list, unused, shared.cfg.batch_blocks as usize);
            let loaded = self.load(shared, &batches, Tier::Hot, None, report).await?;
            // A share cut short (replay lag, a recovery conflict) sends the rest next cycle.
            shared.mirror().unsend(&name, &batches[loaded..]);
        }
        if shared.colder_feed && Instant::now() < shared.fill_until {
            self.fill_from_mirror(shared, report).await?;
        }
        Ok(())
    }

    /// fill_room from the mirror (extension 0.6.0), once this cycle loaded its whole share
    /// of hot blocks: the primary's colder blocks it lacks, hottest first, as many as its
    /// unused buffers take less a reserve, at most FILL_MAX_BATCHES batches, until the end of
    /// the interval. Its unused buffers are counted from its feed (once that has swept all of
    /// them since its last reset) less the blocks sent and not reported yet. Asking costs no
    /// call to either node.
    async fn fill_from_mirror(
        &mut self,
        shared: &Shared,
        report: &mut CycleReport,
    ) -> Result<(), CycleError> {
        if self.retry_at.is_some() || !shared.mirror().complete {
            return Ok(());
        }
        let Some(unused) = self.unused_buffers(shared) else {
            return Ok(());
        };
        let name = self.name.clone();
        if report.loaded_whole_share(&name).is_none() {
            return Ok(());
        }
        let buffers = self.buffers();
        let room =
            unused.saturating_sub(u64::try_from(buffers).unwrap_or(0) / FILL_RESERVE_DIVISOR);
        if room < FILL_MIN_BLOCKS {
            return Ok(());
        }
        let batch = shared.cfg.batch_blocks as usize;
        let take = usize::try_from(room)
            .unwrap_or(usize::MAX)
            .min(batch.saturating_mul(FILL_MAX_BATCHES));
        let Some(list) = shared
            .mirror()
            .take_missing(&name, feed::Class::Colder, take)
        else {
            return Ok(());
        };
        debug!(standby = %name, unused, take = list.len(),
            "filling the standby's unused buffers with colder blocks");
        // The hottest `take` were chosen; all of them fit in unused buffers.
        let batches = list.split_in_file_order(batch);
        let loaded = self
            .load(
                shared,
                &batches,
                Tier::Fill,
                Some(shared.fill_until),
                report,
            )
            .await?;
        // Batches the interval left no time for go back to missing.
        shared.mirror().unsend(&name, &batches[loaded..]);
        Ok(())
    }

    /// The page-cache tier, once it read its whole share of the hot set: the batches of the
    /// primary's page cache queued for it (oscache.rs), read into its page cache with
    /// ccm_os_prefetch until the end of the interval, one batch at least, and after each batch
    /// the replay-lag check of the hot set's (max_replay_lag: a batch per cycle while replay
    /// is behind). A standby that cannot read its queue now (no extension 0.9.0, waiting out
    /// a backoff, its hot share cut short, a failed call) gives up its pass, so that the next
    /// slice never waits for it.
    pub async fn warm_os(
        &mut self,
        shared: &Shared,
        report: &mut CycleReport,
    ) -> Result<(), CycleError> {
        let Some(tier) = shared.os.as_ref() else {
            return Ok(());
        };
        let name = self.name.clone();
        let usable = self.node.as_ref().is_some_and(|n| n.has_os_cache());
        if !usable || self.retry_at.is_some() || report.loaded_whole_share(&name).is_none() {
            os_tier(tier).drop_queue(&name);
            return Ok(());
        }
        let mut first = true;
        // Its readers are looked at once per cycle, before its first batch that has blocks:
        // a steady pass of a large page cache is hundreds of batches.
        let mut readers_idle = None;
        loop {
            // Not in the loop's condition: the guard would live across the awaits.
            let next = os_tier(tier).next_batch(&name);
            let Some(batch) = next else {
                break;
            };
            if !first && Instant::now() >= shared.fill_until {
                break;
            }
            first = false;
            let done = if batch.list.is_empty() {
                PrefetchResult::default()
            } else {
                // While its readers are busy the batch is only measured (mincore), so that
                // its coverage stays true and the pass goes on; later cycles and passes read.
                let advise = match readers_idle {
                    Some(idle) => idle,
                    None => {
                        let Some(idle) = self.readers_idle(shared, report).await? else {
                            os_tier(tier).drop_queue(&name);
                            return Ok(());
                        };
                        readers_idle = Some(idle);
                        idle
                    }
                };
                match self.os_batch(shared, &batch.list, advise, report).await? {
                    Some(done) => done,
                    None => {
                        os_tier(tier).drop_queue(&name);
                        return Ok(());
                    }
                }
            };
            shared.metrics.os_cache_read(&name, done.advised);
            let coverage = {
                let mut tier = os_tier(tier);
                tier.done(&name, done);
                batch.ends_pass.and(tier.coverage(&name))
            };
            if let Some(coverage) = coverage {
                shared.metrics.os_cache_coverage(&name, &coverage);
            }
            if self.replay_check(shared, done.replay_lag, report) == Flow::EndCycle {
                break;
            }
        }
        Ok(())
    }

    /// Whether its own readers leave room for reading a batch of the page-cache tier now
    /// (`os_cache_busy_sessions`; a change is told once, and in ccm_agent_os_cache_waiting).
    /// None when the look failed without a fault of the standby (os_failed): its pass ends.
    async fn readers_idle(
        &mut self,
        shared: &Shared,
        report: &mut CycleReport,
    ) -> Result<Option<bool>, CycleError> {
        let limit = shared.cfg.os_cache_busy_sessions;
        if limit == 0 {
            shared.metrics.os_cache_waiting(&self.name, false);
            return Ok(Some(true));
        }
        let busy = match self.node().busy_sessions().await {
            Ok(busy) => busy,
            Err(error) => return self.os_failed(shared, error, report).map(|()| None),
        };
        self.heard_now();
        let waiting = readers_first(busy, limit);
        shared.metrics.os_cache_waiting(&self.name, waiting);
        let name = &self.name;
        if waiting && !std::mem::replace(&mut self.os_waiting, true) {
            info!(
                standby = %name,
                busy_sessions = busy,
                "{busy} client sessions are running queries on the standby {name} \
                 (os_cache_busy_sessions {limit}); reading into its page cache waits for them \
                 (what it holds is still measured)"
            );
        } else if !waiting && std::mem::take(&mut self.os_waiting) {
            info!(standby = %name, "the readers of the standby {name} are idle; reading into its page cache goes on");
        }
        Ok(Some(!waiting))
    }

    /// One ccm_os_prefetch call (`advise` false: measure only). None when its page-cache pass
    /// ends here without a fault of the standby (os_failed).
    async fn os_batch(
        &mut self,
        shared: &Shared,
        list: &[u8],
        advise: bool,
        report: &mut CycleReport,
    ) -> Result<Option<PrefetchResult>, CycleError> {
        match self.node().os_prefetch(list, advise).await {
            Ok((true, done)) => {
                self.heard_now();
                shared.metrics.progress();
                if std::mem::take(&mut self.os_failing) {
                    info!(standby = %self.name, "reading into the page cache of the standby {} works again", self.name);
                }
                Ok(Some(done))
            }
            Ok((false, _)) => Err(self.promoted(&shared.metrics)),
            Err(error) => self.os_failed(shared, error, report).map(|()| None),
        }
    }

    /// A call of the page-cache tier failed. Ok when its pass just ends here without a fault
    /// of the standby: a recovery conflict, or a failed call that left its session open
    /// (logged once per episode; the hot set goes on as before).
    fn os_failed(
        &mut self,
        shared: &Shared,
        error: NodeError,
        report: &mut CycleReport,
    ) -> Result<(), CycleError> {
        let metrics = &shared.metrics;
        match error.class() {
            ErrorClass::NotInRecovery => Err(self.promoted(metrics)),
            ErrorClass::RecoveryConflict => {
                self.recovery_conflict(metrics, &error, report);
                Ok(())
            }
            _ if self.broken(&error)
                || matches!(error, NodeError::Cancelled | NodeError::Disabled { .. }) =>
            {
                self.call::<()>(metrics, Stage::Prewarm, Err(error))
            }
            _ => {
                let name = self.name.clone();
                if std::mem::replace(&mut self.os_failing, true) {
                    debug!(standby = %name, "the page-cache tier's call failed: {error}");
                } else {
                    warn!(
                        standby = %name,
                        "reading into the page cache of the standby {name} failed: {error}; its \
                         page-cache pass ends here, and warming its shared_buffers goes on"
                    );
                }
                Ok(())
            }
        }
    }

    /// Its unused buffers as far as the agent knows: its shared_buffers less the blocks its
    /// feed reports and those sent but not reported yet. None until its feed has swept all its
    /// buffers since its last reset (until then it may hold blocks the feed has not reached).
    pub fn unused_buffers(&self, shared: &Shared) -> Option<u64> {
        let (node, tracked) = (self.node.as_ref()?, self.feed_tracked?);
        let pending = {
            let mirror = shared.mirror();
            if !mirror.standby_complete(&self.name) {
                return None;
            }
            mirror.inflight(&self.name) as u64
        };
        let buffers = u64::try_from(node.facts().shared_buffers).unwrap_or(0);
        Some(buffers.saturating_sub(tracked.saturating_add(pending)))
    }

    /// Step (4): it reads `batches`, one short ccm_prewarm call each, until a recovery
    /// conflict or replay lag ends its share of the cycle, or `until` has passed. Returns how
    /// many batches it read (the rest, and a batch a conflict cancelled, were not).
    pub async fn load(
        &mut self,
        shared: &Shared,
        batches: &[Vec<u8>],
        tier: Tier,
        until: Option<Instant>,
        report: &mut CycleReport,
    ) -> Result<usize, CycleError> {
        let mut called = 0;
        for batch in batches {
            if until.is_some_and(|at| Instant::now() >= at) {
                break;
            }
            let blocks = decode_block_list_header(batch)
                .map(|h| u64::from(h.blocks))
                .map_err(|e| CycleError::Decode(format!("a batch of it: {e}")))?;
            report.note(&shared.metrics, Event::BatchSent { blocks, tier });
            let result = self.node().prewarm(batch).await;
            called += 1;
            let flow = self.prewarm_outcome(shared, blocks, tier, result, report)?;
            if flow == Flow::Unread {
                // It goes out again with the rest, next cycle.
                called -= 1;
                break;
            }
            if let Some(pb) = &shared.progress {
                pb.inc(blocks);
            }
            if flow == Flow::EndCycle {
                break;
            }
        }
        Ok(called)
    }

    /// What one prewarm call's answer means for its share of the cycle.
    pub fn prewarm_outcome(
        &mut self,
        shared: &Shared,
        blocks: u64,
        tier: Tier,
        result: Result<(bool, PrewarmResult), NodeError>,
        report: &mut CycleReport,
    ) -> Result<Flow, CycleError> {
        let metrics = &shared.metrics;
        let error = match result {
            Ok((true, done)) => {
                self.heard_now();
                let standby = &self.name;
                report.note(
                    metrics,
                    Event::BatchDone {
                        standby,
                        blocks,
                        tier,
                        done: &done,
                    },
                );
                return Ok(self.replay_check(shared, done.replay_lag, report));
            }
            // Promoted during the call: nothing more goes to this server.
            Ok((false, _)) => return Err(self.promoted(metrics)),
            Err(error) => error,
        };
        match error.class() {
            ErrorClass::NotInRecovery => Err(self.promoted(metrics)),
            ErrorClass::RecoveryConflict => {
                self.recovery_conflict(metrics, &error, report);
                Ok(Flow::Unread)
            }
            ErrorClass::Storage if !self.broken(&error) => {
                let name = self.name.clone();
                // With its DETAIL, which names the database when a prewarm worker hit it.
                let message = error.server_message().unwrap_or_else(|| error.to_string());
                warn!(
                    standby = %name,
                    "storage error on the standby {name}: {message}; skipping this batch of \
                     {blocks} blocks and going on with the next"
                );
                report.note(
                    metrics,
                    Event::StorageError {
                        standby: &name,
                        blocks,
                    },
                );
                Ok(Flow::Next)
            }
            _ => self.call(metrics, Stage::Prewarm, Err(error)),
        }
    }

    /// After a batch: whether its replay lag leaves room for the next one. Above
    /// max_replay_lag its share of the cycle ends, so that our reads do not keep a failover
    /// candidate's replay behind (promotion waits for replay to finish); the next cycle goes
    /// on where this one stopped, one batch at a time while the lag lasts.
    fn replay_check(
        &mut self,
        shared: &Shared,
        lag: Option<u64>,
        report: &mut CycleReport,
    ) -> Flow {
        let max = shared.cfg.max_replay_lag;
        let Some((lag, max)) = lag.zip(max).filter(|(lag, max)| lag > max) else {
            if std::mem::take(&mut self.replay_behind) {
                info!(standby = %self.name, "replay on the standby {} caught up; warming it again", self.name);
            }
            return Flow::Next;
        };
        if !std::mem::replace(&mut self.replay_behind, true) {
            info!(
                standby = %self.name,
                replay_lag_bytes = lag,
                "replay on the standby {} is {} behind what it received (max_replay_lag {}); \
                 warming it waits for replay, a batch per cycle at most",
                self.name,
                crate::config::format_size(lag),
                crate::config::format_size(max)
            );
        }
        report.note(
            &shared.metrics,
            Event::ReplayPaused {
                standby: &self.name,
            },
        );
        Flow::EndCycle
    }

    /// A recovery conflict: logged (one line, with the server's DETAIL), counted, its session
    /// dropped if the server ended it. Not a fault: its share of the cycle just ends.
    fn recovery_conflict(
        &mut self,
        metrics: &Metrics,
        error: &NodeError,
        report: &mut CycleReport,
    ) {
        let name = self.name.clone();
        let message = error.server_message().unwrap_or_else(|| error.to_string());
        info!(
            standby = %name,
            "recovery conflict on the standby {name}: {message}; ending this cycle for it, \
             the blocks not loaded follow in the next one"
        );
        report.note(metrics, Event::RecoveryConflict { standby: &name });
        if self.broken(error) {
            self.drop_session(metrics);
        }
    }

    /// fill_room with a filter (the filter exchange, or a feed without colder blocks): its
    /// filter, asked for only when its feed says it has unused buffers beyond the reserve.
    pub async fn fill_filter(
        &mut self,
        shared: &Shared,
        report: &CycleReport,
    ) -> Result<Option<Vec<u8>>, CycleError> {
        let (Some(node), Some(tracked)) = (self.node.as_ref(), self.feed_tracked) else {
            return Ok(None);
        };
        if self.fill_idle_until.is_some_and(|at| Instant::now() < at) || self.retry_at.is_some() {
            return Ok(None);
        }
        let loaded = report
            .standbys
            .iter()
            .find(|r| r.name == self.name)
            .map_or(0, |r| r.loaded);
        let buffers = u64::try_from(node.facts().shared_buffers).unwrap_or(0);
        if unused_room(buffers, tracked.saturating_add(loaded)) < FILL_MIN_BLOCKS {
            return Ok(None);
        }
        let fpr = shared.cfg.false_positive_rate;
        let result = self.node().buffer_filter(fpr).await;
        let (in_recovery, filter) = self.call(&shared.metrics, Stage::Filter, result)?;
        if !in_recovery {
            return Err(self.promoted(&shared.metrics));
        }
        Ok(Some(filter))
    }
}

/// What a standby's task returns: the standby, what it did and how it ended.
pub struct Done<T, N: NodeApi = Node> {
    pub standby: Box<Standby<N>>,
    pub report: CycleReport,
    pub result: Result<T, CycleError>,
}

/// Step (1) for one standby, in a task of its own.
pub async fn prepare_task<N: NodeApi>(
    mut standby: Box<Standby<N>>,
    shared: Arc<Shared>,
    feed: bool,
) -> Done<Ready, N> {
    let mut report = CycleReport::default();
    let result = standby.prepare(&shared, feed, &mut report).await;
    Done {
        standby,
        report,
        result,
    }
}

/// Steps (3) to (5) for one standby, in a task of its own: its list (the filter exchange)
/// or what the mirror says it lacks.
pub async fn warm_task<N: NodeApi>(
    mut standby: Box<Standby<N>>,
    shared: Arc<Shared>,
    list: Option<Vec<u8>>,
) -> Done<(), N> {
    let mut report = CycleReport::default();
    let mut result = match list {
        Some(list) => standby.warm_list(&shared, &list, &mut report).await,
        None => standby.warm_feed(&shared, &mut report).await,
    };
    if result.is_ok() {
        result = standby.warm_os(&shared, &mut report).await;
    }
    Done {
        standby,
        report,
        result,
    }
}

/// The pairing check: a list from a primary of another system would prewarm garbage (and
/// read relation files that may not even exist), so both ends must be one cluster.
fn check_same_system<N: NodeApi>(primary: &PrimaryView, standby: &N) -> Result<(), String> {
    if primary.system_identifier.is_empty()
        || primary.system_identifier == standby.facts().system_identifier
    {
        return Ok(());
    }
    Err(format!(
        "system identifier mismatch: primary {} is system {} but standby {} is system {}; \
         they are not the same cluster, so no block list will be sent (check --primary and --standby)",
        primary.label,
        primary.system_identifier,
        standby.label(),
        standby.facts().system_identifier
    ))
}

/// The sender against the primary and the standbys being warmed (members) and the other
/// hosts of the standby string or Patroni members (walsender.rs). Names first; then the
/// addresses, the primary's resolved again (a DNS failure at connect time must not make
/// its standbys strangers).
async fn classify_sender(shared: &Shared, mut sender: Endpoint) -> Sender {
    let mut members = shared.members.clone();
    let mut others = shared.others.clone();
    let by_name = walsender::classify(&sender, &members, &others);
    if by_name != Sender::Unknown || sender.is_socket() {
        return by_name;
    }
    sender.addrs = lookup(&sender.name, sender.port).await;
    if let (Some(host), Some(primary)) = (&shared.primary.host, members.first_mut()) {
        primary.addrs = addresses(host).await;
    }
    for other in others.iter_mut().filter(|o| !o.is_socket()) {
        other.addrs = lookup(&other.name, other.port).await;
    }
    walsender::classify(&sender, &members, &others)
}

/// The addresses a host spec resolves to (none for a Unix socket or a failed lookup).
pub async fn addresses(host: &HostSpec) -> Vec<IpAddr> {
    if let Some(addr) = host.hostaddr {
        return vec![addr];
    }
    let name = host.name();
    if name.starts_with('/') {
        return Vec::new();
    }
    lookup(&name, host.port).await
}

async fn lookup(name: &str, port: u16) -> Vec<IpAddr> {
    if let Ok(addr) = name.parse::<IpAddr>() {
        return vec![addr];
    }
    match tokio::time::timeout(
        Duration::from_secs(2),
        tokio::net::lookup_host((name, port)),
    )
    .await
    {
        Ok(Ok(addrs)) => addrs.map(|a| a.ip()).collect(),
        _ => Vec::new(),
    }
}

/// Adds what `node`'s session (the node called `name`) carried since the last count to
/// ccm_agent_bytes_total.
pub fn count_node_wire<N: NodeApi>(metrics: &Metrics, name: &str, node: Option<&mut N>) {
    if let Some((sent, received)) = node.and_then(|n| n.wire_bytes()) {
        metrics.wire_bytes(name, sent, received);
    }
}

/// How many colder blocks a standby with `buffers` buffers, `cached` of them in use, takes:
/// its unused buffers less a reserve of 1/64 of them.
pub fn unused_room(buffers: u64, cached: u64) -> u64 {
    buffers
        .saturating_sub(cached)
        .saturating_sub(buffers / FILL_RESERVE_DIVISOR)
}

/// `list` split into batches in the order a standby with `unused` unused buffers (None:
/// not known) should read them. When they all fit, nothing the standby caches is evicted
/// whatever the order, so in file order, as autoprewarm reads: each batch a stretch of the
/// files read front to back, which on a cold standby costs the CPU and I/O of pg_prewarm
/// (BENCHMARKS.md, "Cold restart: the read order"). Otherwise hottest first, so that the
/// loads that evict go to the hottest blocks and a cycle cut short has loaded those.
pub fn in_load_order(list: &BlockList, unused: Option<u64>, batch_blocks: usize) -> Vec<Vec<u8>> {
    if unused.is_some_and(|unused| list.len() as u64 <= unused) {
        list.split_in_file_order(batch_blocks)
    } else {
        list.split_hottest_first(batch_blocks)
    }
}

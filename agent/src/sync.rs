//! The sync cycle, the `run` loop around it and the one-shot `sync --once`.
//!
//! A cycle: (0) the topology (topology.rs: the connection strings, or Patroni's leader and
//! failover candidates), (1) each standby's bloom filter of what it caches, (2) one scan of
//! the primary that returns, per standby, the hot blocks its filter lacks, at most its
//! shared_buffers (`ccm_hot_blocks_each`; an extension older than 0.4 gets one
//! `ccm_hot_blocks` call per standby), (3) each list split hottest-first into batches,
//! (4) one short `ccm_prewarm` call per batch, standby after standby in the warming order,
//! (5) with `fill_room`, for a standby that loaded its whole list and has unused buffers
//! left: the primary's colder cached blocks it lacks, hottest first, as many as those
//! buffers take (a second scan, made only while there is such room).
//! With extension 0.5.0 on the nodes (and `change_feed`, the default), steps (1) and (2) are
//! the nodes' change feeds instead (feed.rs): each standby's `ccm_buffer_changes()` reports
//! what it cached and evicted since the last cycle and confirms the blocks sent to it, the
//! primary's reports what entered and left its hot set, and each standby is sent the hot
//! blocks the mirror says it lacks. A steady cycle then moves what changed, not a filter of
//! all of a standby's buffers; `sync --once` and older extensions use the filter exchange.
//! With extension 0.6.0, the primary's feed also reports its colder blocks, so step (5)
//! takes them from the mirror too, with no call to either node when there is no room.
//! Short calls keep each statement on a standby brief, so a recovery conflict never waits
//! on us for long, and the hottest blocks land first if the cycle is cut short.
//!
//! Safety is re-checked at every step: each call (every prewarm batch included) returns
//! pg_is_in_recovery() in the same statement, and ccm_prewarm itself refuses to run on a
//! node that is not in recovery; a standby is warmed only when it shares the primary's
//! system identifier, streams the primary's timeline and streams from the primary (or from
//! another standby being warmed), so a partitioned old primary is never a source.
//!
//! One standby's trouble is its own: a standby that is down, promoted, of another system or
//! following another primary is passed over (with its own backoff, logged once) while the
//! others are warmed. Only when no standby can be warmed, or the primary fails, does the
//! cycle fail and the loop back off.
//!
//! Not faults: a recovery conflict (the statement cancelled, or the session terminated) ends
//! that standby's share of the cycle, and what was not loaded comes again next cycle because
//! its filter is rebuilt; a storage error on one page costs its batch only.

use std::net::IpAddr;
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
use crate::conninfo::{ConnInfo, HostSpec};
use crate::feed::{self, FeedAnswer, Mirror};
use crate::metrics::{coverage, saturating_i64, Metrics, Stage};
use crate::node::{
    self, ConnectOptions, ErrorClass, Node, NodeError, PrewarmResult, Side, WalSource,
};
use crate::notify;
use crate::topology::{self, Target};
use crate::walsender::{self, Endpoint, Sender, Verdict};

/// A standby's change feed: every cached block is in its set.
const EVERY_CACHED_BLOCK: i32 = -1;

/// The longest wait before asking a host that was not in recovery again.
const NOT_A_STANDBY_RECHECK: Duration = Duration::from_secs(10);

/// The longest wait before connecting again to a node that could not be reached (refused,
/// starting up, unreachable), unless the interval is longer: a failed connection attempt
/// costs the node nothing, and a standby that restarted is cold, so it should be warmed as
/// soon as it accepts connections, not a doubled backoff later (which would add about as
/// long again as the restart took). Other faults back off up to max_backoff.
const RECONNECT_CEILING: Duration = Duration::from_secs(1);

/// fill_room leaves this share of a standby's buffers unused (1/64), for replay and the
/// standby's own reads, which would otherwise have to evict to get a buffer.
const FILL_RESERVE_DIVISOR: u64 = 64;
/// Fewer unused buffers than this are not worth a scan of the primary.
const FILL_MIN_BLOCKS: u64 = 128;
/// At most this many batches of colder blocks per standby and cycle, so that a large room is
/// filled over several cycles and each cycle's hot blocks are not kept waiting behind it.
const FILL_MAX_BATCHES: usize = 8;
/// After a look below the threshold that found nothing to send (a standby larger than what
/// the primary caches), the next one waits this long.
const FILL_RECHECK: Duration = Duration::from_secs(30);

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
    fn standby_mut(&mut self, name: &str) -> Option<&mut StandbyReport> {
        self.standbys.iter_mut().rev().find(|r| r.name == name)
    }

    /// Blocks standby `name` loaded this cycle, if its share ran to the end (no recovery
    /// conflict, storage error or replay-lag pause cut it short): fill_room's condition.
    fn loaded_whole_share(&self, name: &str) -> Option<u64> {
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

    /// Whether the cycle was cut short by a recovery conflict or by replay lag.
    pub fn interrupted(&self) -> bool {
        self.recovery_conflicts > 0 || self.replay_pauses > 0
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
    /// The pairing is unsafe (different systems, another primary's WAL): that standby's
    /// connection was dropped.
    #[error("{0}")]
    Safety(String),
    /// A node changed role under us (failover): its connection was dropped.
    #[error("{message}")]
    RoleChanged { side: Side, message: String },
    #[error("the primary's hot block list does not decode: {0}")]
    Decode(String),
    #[error("Cluster Cache Manager is disabled on the {side} {host} (ccm.enabled = off)")]
    Disabled { side: Side, host: String },
    /// Patroni could not be asked, or named no leader.
    #[error("{0}")]
    Topology(String),
    /// Every standby failed, each in its own way (all named in the message).
    #[error("{message}")]
    Standbys { stage: Stage, message: String },
    #[error("cancelled")]
    Cancelled,
}

impl CycleError {
    /// The longest backoff after this error: [`RECONNECT_CEILING`] (or the interval, if
    /// longer) when a node could not be connected to, else `max_backoff`.
    pub fn backoff_cap(&self, cfg: &Config) -> Duration {
        if self.stage() == Some(Stage::Connect) {
            cfg.interval.max(RECONNECT_CEILING).min(cfg.max_backoff)
        } else {
            cfg.max_backoff
        }
    }

    /// The `stage` label this error is counted under; none for the non-faults.
    pub fn stage(&self) -> Option<Stage> {
        match self {
            CycleError::Node { stage, .. } => Some(*stage),
            CycleError::Safety(_) | CycleError::RoleChanged { .. } => Some(Stage::Safety),
            CycleError::Decode(_) => Some(Stage::HotBlocks),
            CycleError::Topology(_) => Some(Stage::Connect),
            CycleError::Standbys { stage, .. } => Some(*stage),
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

/// Which blocks a prewarm call loads: the hot set's, or colder ones filling unused buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tier {
    Hot,
    Fill,
}

/// How many colder blocks a standby with `buffers` buffers, `cached` of them in use, takes:
/// its unused buffers less a reserve of 1/64 of them.
fn unused_room(buffers: u64, cached: u64) -> u64 {
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
fn in_load_order(list: &BlockList, unused: Option<u64>, batch_blocks: usize) -> Vec<Vec<u8>> {
    if unused.is_some_and(|unused| list.len() as u64 <= unused) {
        list.split_in_file_order(batch_blocks)
    } else {
        list.split_hottest_first(batch_blocks)
    }
}

/// One standby to warm, and what the loop remembers of it between cycles.
struct Standby {
    name: String,
    conninfo: ConnInfo,
    node: Option<Node>,
    /// Its own backoff, used while other standbys are being warmed.
    backoff: Backoff,
    retry_at: Option<Instant>,
    /// The problem last logged for it: each is logged once, when it starts.
    problem: Option<String>,
    /// Connected and found to follow the primary (check_source): only such a standby is
    /// accepted as another standby's WAL sender (a cascade).
    verified: bool,
    /// No look below the threshold for it before this (the last one found nothing to send).
    fill_idle_until: Option<Instant>,
    /// Its warming waits for replay (max_replay_lag): logged once, when it starts.
    replay_behind: bool,
    /// Blocks its change feed holds as cached (feed mode), for fill_room's room.
    feed_tracked: Option<u64>,
}

impl Standby {
    fn new(target: Target, max_backoff: Duration) -> Self {
        Standby {
            name: target.name,
            conninfo: target.conninfo,
            node: None,
            backoff: Backoff::new(max_backoff),
            retry_at: None,
            problem: None,
            verified: false,
            fill_idle_until: None,
            replay_behind: false,
            feed_tracked: None,
        }
    }

    fn host(&self) -> Option<HostSpec> {
        self.conninfo.hosts().into_iter().next()
    }

    /// Puts it off for its next backoff delay (at most `cap`) because of `problem`. Returns
    /// the delay as the log says it when the problem is new: each is logged once.
    fn defer(&mut self, cap: Duration, problem: String) -> Option<String> {
        let delay = self.backoff.next_delay().min(cap);
        self.retry_at = Some(Instant::now() + delay);
        if self.problem.as_deref() == Some(problem.as_str()) {
            return None;
        }
        self.problem = Some(problem);
        Some(format_duration(Duration::from_millis(
            delay.as_millis() as u64
        )))
    }
}

/// Whose call a result is.
#[derive(Debug, Clone, Copy)]
enum Who {
    Primary,
    Standby(usize),
}

impl Who {
    fn side(self) -> Side {
        match self {
            Who::Primary => Side::Primary,
            Who::Standby(_) => Side::Standby,
        }
    }
}

/// A standby's fate in step (1).
enum Ready {
    Filter(Vec<u8>),
    /// Not warmed this cycle, and not a fault (waiting out its backoff, a primary listed
    /// among the standbys, a recovery conflict).
    Pass,
}

/// The connections and what the loop remembers between cycles.
pub struct Syncer {
    cfg: Arc<Config>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
    /// The primary's connection string this cycle (from the topology).
    primary_info: Option<ConnInfo>,
    primary: Option<Node>,
    /// Where the primary's WAL goes from: its timeline (extension 0.4 and later).
    primary_source: Option<WalSource>,
    /// The primary's addresses, to recognise it as a standby's WAL sender.
    primary_addrs: Vec<IpAddr>,
    /// WAL senders that are no node the agent knows (walsender.rs).
    unknown_senders: walsender::Unknowns,
    /// The host the primary side last connected to, to count retargets.
    last_primary_host: Option<String>,
    /// Patroni's leader at the last look.
    leader: Option<String>,
    standbys: Vec<Standby>,
    /// Patroni members left out, as last logged.
    excluded: Vec<(String, String)>,
    /// Whether "CCM is disabled" was already logged (it is logged once per episode).
    disabled_logged: bool,
    /// The change feeds' mirror (feed.rs) and this agent's subscriber id on every node.
    mirror: Mirror,
    subscriber: i64,
    /// Use the change feed where every node has it (config change_feed; not for sync --once).
    feed_wanted: bool,
    /// "predates the change feed" was logged for this catalog and library version.
    feed_absent_logged: Option<String>,
    /// The primary's hot set at the last cycle, whichever exchange counted it.
    last_hot_set: u64,
}

impl Syncer {
    pub fn new(cfg: Arc<Config>, metrics: Arc<Metrics>, cancel: CancellationToken) -> Self {
        let cfg_change_feed = cfg.change_feed;
        Syncer {
            cfg,
            metrics,
            cancel,
            primary_info: None,
            primary: None,
            primary_source: None,
            primary_addrs: Vec::new(),
            unknown_senders: walsender::Unknowns::default(),
            last_primary_host: None,
            leader: None,
            standbys: Vec::new(),
            excluded: Vec::new(),
            disabled_logged: false,
            mirror: Mirror::default(),
            subscriber: feed::new_subscriber(),
            feed_wanted: cfg_change_feed,
            feed_absent_logged: None,
            last_hot_set: 0,
        }
    }

    fn options(&self) -> ConnectOptions {
        ConnectOptions {
            connect_timeout: self.cfg.connect_timeout,
            statement_timeout: self.cfg.statement_timeout,
        }
    }

    fn primary(&mut self) -> &mut Node {
        self.primary.as_mut().expect("connected by ensure_primary")
    }

    fn standby(&mut self, i: usize) -> &mut Node {
        self.standbys[i]
            .node
            .as_mut()
            .expect("connected by ensure_standby")
    }

    fn primary_label(&self) -> String {
        match (&self.primary, &self.last_primary_host) {
            (Some(node), _) => node.label(),
            (None, Some(host)) => host.clone(),
            (None, None) => "?".to_string(),
        }
    }

    /// Adds what each live session carried since the last count to ccm_agent_bytes_total.
    fn count_wire(&mut self) {
        count_node_wire(&self.metrics, "primary", self.primary.as_mut());
        for standby in &mut self.standbys {
            count_node_wire(&self.metrics, &standby.name, standby.node.as_mut());
        }
    }

    fn drop_primary(&mut self) {
        count_node_wire(&self.metrics, "primary", self.primary.as_mut());
        if self.primary.take().is_some() {
            self.metrics.set_node_up(Side::Primary, false);
        }
        self.primary_source = None;
        self.primary_addrs.clear();
    }

    fn drop_standby(&mut self, i: usize) {
        let standby = &mut self.standbys[i];
        count_node_wire(&self.metrics, &standby.name, standby.node.as_mut());
        self.standbys[i].verified = false;
        if self.standbys[i].node.take().is_some() {
            self.metrics.set_standby_up(&self.standbys[i].name, false);
        }
        let any = self.standbys.iter().any(|s| s.node.is_some());
        self.metrics.set_node_up(Side::Standby, any);
    }

    // ---- (0) topology -----------------------------------------------------------------

    /// Reads the topology and lines the standbys up in its order, keeping the sessions of
    /// those that stay. A changed leader drops the primary's session.
    async fn refresh_topology(&mut self) -> Result<(), CycleError> {
        let discovered = tokio::select! {
            _ = self.cancel.cancelled() => return Err(CycleError::Cancelled),
            t = topology::discover(&self.cfg, self.cfg.connect_timeout, &self.cancel) => t,
        };
        let topology = match discovered {
            Ok(topology) => topology,
            Err(e) => {
                // Without Patroni's word on who leads, nothing is warmed: the sessions are
                // closed (and shown down) rather than kept on a topology that may be gone,
                // e.g. while the agent itself is cut off from the cluster.
                self.drop_primary();
                for i in 0..self.standbys.len() {
                    self.drop_standby(i);
                }
                return Err(CycleError::Topology(e.to_string()));
            }
        };
        if topology.leader != self.leader {
            // The primary's session goes below, with the leader's host.
            if let (Some(old), Some(new)) = (&self.leader, &topology.leader) {
                warn!("Patroni's leader moved from {old} to {new}; following it");
            }
            self.leader = topology.leader.clone();
        }
        let moved = self
            .primary_info
            .as_ref()
            .is_some_and(|old| old.hosts() != topology.primary.hosts());
        if moved {
            self.drop_primary();
        }
        self.primary_info = Some(topology.primary.clone());

        let mut old = std::mem::take(&mut self.standbys);
        for target in topology.targets {
            match old.iter().position(|s| s.name == target.name) {
                Some(pos) => {
                    let mut standby = old.remove(pos);
                    if standby.conninfo.hosts() != target.conninfo.hosts() {
                        standby.node = None;
                    }
                    standby.conninfo = target.conninfo;
                    self.standbys.push(standby);
                }
                None => {
                    if !self.standbys.is_empty() || self.leader.is_some() {
                        debug!(standby = %target.name, "a standby to warm");
                    }
                    self.standbys
                        .push(Standby::new(target, self.cfg.max_backoff));
                }
            }
        }
        for gone in old {
            info!(
                standby = %gone.name,
                "{} is no longer a failover candidate; not warming it any more",
                gone.name
            );
        }
        if topology.excluded != self.excluded {
            for (name, why) in &topology.excluded {
                info!(member = %name, "not warming the Patroni member {name} ({why})");
            }
            self.excluded = topology.excluded;
        }
        let names: Vec<String> = self.standbys.iter().map(|s| s.name.clone()).collect();
        self.metrics.standbys(&names);
        let any = self.standbys.iter().any(|s| s.node.is_some());
        self.metrics.set_node_up(Side::Standby, any);
        Ok(())
    }

    // ---- the primary ------------------------------------------------------------------

    /// Makes sure the primary side has a live session to a node not in recovery.
    async fn ensure_primary(&mut self) -> Result<(), CycleError> {
        if let Some(node) = &self.primary {
            if !node.is_closed() {
                return Ok(());
            }
            warn!(
                "lost the connection to the primary {}; reconnecting",
                node.label()
            );
            self.drop_primary();
        }
        let info = self.primary_info.clone().expect("set by refresh_topology");
        let connect = |error| match error {
            NodeError::Cancelled => CycleError::Cancelled,
            error => CycleError::Node {
                stage: Stage::Connect,
                side: Side::Primary,
                error,
            },
        };
        let mut node = node::resolve(&info, Side::Primary, self.options(), &self.cancel, true)
            .await
            .map_err(connect)?;
        let source = node.wal_source().await.map_err(connect)?;
        let label = node.label();
        if let Some(previous) = self.last_primary_host.replace(label.clone()) {
            if previous != label {
                self.metrics.retarget(Side::Primary);
                warn!("the primary side moved from {previous} to {label}");
            }
        }
        info!(
            side = "primary",
            host = %label,
            system_identifier = %node.facts.system_identifier,
            server_version = %node.facts.server_version,
            pg_ccm = node.facts.extension_version.as_deref().unwrap_or("?"),
            pg_ccm_library = node.facts.library_version.as_deref().unwrap_or("?"),
            shared_buffers_blocks = node.facts.shared_buffers,
            timeline = source.as_ref().and_then(|s| s.timeline),
            "connected to the primary"
        );
        if let Some(warning) = node.catalog_behind() {
            warn!("{warning}");
        }
        self.primary_addrs = addresses(&node.host).await;
        self.primary_source = source;
        self.metrics.set_node_up(Side::Primary, true);
        self.primary = Some(node);
        Ok(())
    }

    /// Turns a call's error into a cycle error, dropping the session if it is broken.
    fn call<T>(
        &mut self,
        who: Who,
        stage: Stage,
        result: Result<T, NodeError>,
    ) -> Result<T, CycleError> {
        match result {
            Ok(v) => {
                self.metrics.progress();
                Ok(v)
            }
            Err(NodeError::Cancelled) => Err(CycleError::Cancelled),
            Err(NodeError::Disabled { host }) => Err(CycleError::Disabled {
                side: who.side(),
                host,
            }),
            Err(error) => {
                match who {
                    Who::Primary => {
                        if error.breaks_connection()
                            || self.primary.as_ref().is_some_and(Node::is_closed)
                        {
                            self.drop_primary();
                        }
                    }
                    Who::Standby(i) => {
                        if self.standby_broken(i, &error) {
                            self.drop_standby(i);
                        }
                    }
                }
                Err(CycleError::Node {
                    stage,
                    side: who.side(),
                    error,
                })
            }
        }
    }

    /// The primary reported recovery: demoted or replaced.
    fn primary_demoted(&mut self) -> CycleError {
        let host = self.primary_label();
        self.drop_primary();
        CycleError::RoleChanged {
            side: Side::Primary,
            message: format!(
                "primary {host} is in recovery (demoted or replaced); looking for a new primary"
            ),
        }
    }

    // ---- (1) the standbys -------------------------------------------------------------

    /// Connects standby `i` if needed. `Ok(false)`: the host is not a standby (a primary
    /// listed among the standbys, or the node just promoted).
    async fn ensure_standby(&mut self, i: usize) -> Result<bool, CycleError> {
        if let Some(node) = &self.standbys[i].node {
            if !node.is_closed() {
                return Ok(true);
            }
            warn!(
                standby = %self.standbys[i].name,
                "lost the connection to the standby {}; reconnecting",
                node.label()
            );
            self.drop_standby(i);
        }
        let Some(host) = self.standbys[i].host() else {
            return Ok(false);
        };
        let options = self.options();
        let connected = Node::connect(
            &self.standbys[i].conninfo,
            &host,
            Side::Standby,
            options,
            &self.cancel,
        )
        .await;
        let node = match connected {
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
        if !node.facts.in_recovery {
            return Ok(false);
        }
        node.require_extension().map_err(|error| CycleError::Node {
            stage: Stage::Connect,
            side: Side::Standby,
            error,
        })?;
        if let Some(primary) = &self.primary {
            node::check_same_system(primary, &node).map_err(CycleError::Safety)?;
        }
        let standby = &self.standbys[i];
        info!(
            side = "standby",
            standby = %standby.name,
            host = %node.label(),
            system_identifier = %node.facts.system_identifier,
            server_version = %node.facts.server_version,
            pg_ccm = node.facts.extension_version.as_deref().unwrap_or("?"),
            pg_ccm_library = node.facts.library_version.as_deref().unwrap_or("?"),
            shared_buffers_blocks = node.facts.shared_buffers,
            "connected to the standby {}",
            standby.name
        );
        if let Some(warning) = node.catalog_behind() {
            warn!(standby = %standby.name, "{warning}");
        }
        self.metrics.set_standby_up(&standby.name, true);
        self.metrics.set_node_up(Side::Standby, true);
        self.standbys[i].node = Some(node);
        Ok(true)
    }

    fn standby_broken(&self, i: usize, error: &NodeError) -> bool {
        error.breaks_connection() || self.standbys[i].node.as_ref().is_some_and(Node::is_closed)
    }

    /// Standby `i` was promoted (no longer in recovery): drops it and says so.
    fn promoted(&mut self, i: usize) -> CycleError {
        let host = self.standbys[i]
            .node
            .as_ref()
            .map(Node::label)
            .unwrap_or_else(|| self.standbys[i].name.clone());
        self.drop_standby(i);
        CycleError::RoleChanged {
            side: Side::Standby,
            message: format!(
                "standby {host} was promoted (no longer in recovery); looking for a new standby"
            ),
        }
    }

    /// Checks that standby `i` follows this primary: the same timeline, and WAL streamed
    /// from the primary (or from another standby being warmed, a cascade). Skipped with an
    /// extension older than 0.4.
    async fn check_source(&mut self, i: usize) -> Result<(), CycleError> {
        self.standbys[i].verified = false;
        let Some(primary_timeline) = self.primary_source.as_ref().and_then(|s| s.timeline) else {
            return Ok(());
        };
        let result = self.standby(i).wal_source().await;
        let Some(source) = self.call(Who::Standby(i), Stage::Safety, result)? else {
            return Ok(());
        };
        if !source.in_recovery {
            return Err(self.promoted(i));
        }
        let name = self.standbys[i].name.clone();
        let primary = self.primary_label();
        if let Some(timeline) = source.timeline {
            if timeline != primary_timeline {
                self.drop_standby(i);
                return Err(CycleError::Safety(format!(
                    "standby {name} streams timeline {timeline} but the primary {primary} writes \
                     timeline {primary_timeline}: it follows another primary, so it is not warmed"
                )));
            }
        }
        if let (Some(sender), Some(port)) = (source.sender_host.as_deref(), source.sender_port) {
            if !self.sender_accepted(i, Endpoint::new(sender, port)).await {
                self.drop_standby(i);
                return Err(CycleError::Safety(format!(
                    "standby {name} streams its WAL from {sender}:{port}, which is neither the \
                     primary {primary} nor a standby being warmed, so it is not warmed"
                )));
            }
        }
        // A WAL receiver that is not streaming (reconnecting, or no primary_conninfo) names
        // no sender: the timeline and the system identifier are all there is to check.
        self.standbys[i].verified = true;
        Ok(())
    }

    /// Whether standby `i` may be warmed given its WAL sender (walsender.rs): a member or,
    /// under `wal_sender_check = warn`, an unknown one (warned about once).
    async fn sender_accepted(&mut self, i: usize, sender: Endpoint) -> bool {
        let check = self.cfg.wal_sender_check;
        let name = self.standbys[i].name.clone();
        let now = Instant::now();
        let found = if check == walsender::SenderCheck::Off {
            Sender::Member
        } else if self.unknown_senders.recent(&name, &sender, now) {
            Sender::Unknown
        } else {
            self.classify_sender(sender.clone()).await
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

    /// The sender against the primary and the standbys being warmed (members) and the other
    /// hosts of the standby string or Patroni members (walsender.rs). Names first; then the
    /// addresses, the primary's resolved again (a DNS failure at connect time must not make
    /// its standbys strangers).
    async fn classify_sender(&mut self, mut sender: Endpoint) -> Sender {
        let endpoint = |host: &HostSpec| Endpoint::new(host.name(), host.port);
        let member_slot = |s: &Standby| s.verified && s.node.is_some();
        let primary_host = self.primary.as_ref().map(|p| p.host.clone());
        let mut members: Vec<Endpoint> = primary_host.iter().map(endpoint).collect();
        members.extend(
            self.standbys
                .iter()
                .filter(|s| member_slot(s))
                .filter_map(Standby::host)
                .map(|h| endpoint(&h)),
        );
        let mut others: Vec<Endpoint> = self
            .standbys
            .iter()
            .filter(|s| !member_slot(s))
            .filter_map(Standby::host)
            .map(|h| endpoint(&h))
            .collect();
        let by_name = walsender::classify(&sender, &members, &others);
        if by_name != Sender::Unknown || sender.is_socket() {
            return by_name;
        }
        sender.addrs = lookup(&sender.name, sender.port).await;
        if let (Some(host), Some(primary)) = (&primary_host, members.first_mut()) {
            self.primary_addrs = addresses(host).await;
            primary.addrs = self.primary_addrs.clone();
        }
        for other in others.iter_mut().filter(|o| !o.is_socket()) {
            other.addrs = lookup(&other.name, other.port).await;
        }
        walsender::classify(&sender, &members, &others)
    }

    /// Step (1) for standby `i`: connected, checked, and its filter.
    async fn standby_filter(
        &mut self,
        i: usize,
        feed: bool,
        report: &mut CycleReport,
    ) -> Result<Ready, CycleError> {
        if self.standbys[i]
            .retry_at
            .is_some_and(|at| Instant::now() < at)
        {
            return Ok(Ready::Pass);
        }
        if !self.ensure_standby(i).await? {
            // A primary listed among the standbys stays one until a failover, when the
            // old primary comes back as a standby: ask again now and then, never rarely.
            let standby = &mut self.standbys[i];
            let note = format!("{} is not in recovery", standby.name);
            if let Some(retry) = standby.defer(NOT_A_STANDBY_RECHECK, note.clone()) {
                info!(standby = %standby.name, "{note}; not warming it (asking again in {retry})");
            }
            return Ok(Ready::Pass);
        }
        self.check_source(i).await?;
        if feed {
            return self.standby_feed(i, report).await;
        }
        let fpr = self.cfg.false_positive_rate;
        let result = self.standby(i).buffer_filter(fpr).await;
        if let Err(error) = &result {
            if error.class() == ErrorClass::RecoveryConflict {
                self.recovery_conflict(i, error, report);
                return Ok(Ready::Pass);
            }
        }
        let (in_recovery, filter) = self.call(Who::Standby(i), Stage::Filter, result)?;
        if !in_recovery {
            return Err(self.promoted(i));
        }
        report.filter_bytes += filter.len();
        self.metrics
            .filter_bytes
            .set(saturating_i64(filter.len() as u64));
        Ok(Ready::Filter(filter))
    }

    /// Step (1) in feed mode for standby `i`: its change feed's answer, applied to the
    /// mirror. `Ready::Filter` carries no filter then: with extension 0.5.0, fill_room asks
    /// for one only when the standby has room. A feed that has not swept all the standby's
    /// buffers since its last reset (a restarted standby, a new agent) is asked once more
    /// in the same cycle to sweep all of them, so that the agent knows what the standby
    /// holds, and how much room it has, before it sends (one sweep of shared_buffers after
    /// each reset, instead of a quarter in each of four cycles).
    async fn standby_feed(
        &mut self,
        i: usize,
        report: &mut CycleReport,
    ) -> Result<Ready, CycleError> {
        let name = self.standbys[i].name.clone();
        let buffers = self.standby(i).facts.shared_buffers;
        for budget in [feed::sweep_budget(buffers), buffers] {
            let subscriber = self.subscriber;
            let result = self
                .standby(i)
                .buffer_changes(subscriber, Some(EVERY_CACHED_BLOCK), budget, false)
                .await;
            if let Err(error) = &result {
                if error.class() == ErrorClass::RecoveryConflict {
                    self.recovery_conflict(i, error, report);
                    return Ok(Ready::Pass);
                }
            }
            let (in_recovery, answer) = self.call(Who::Standby(i), Stage::Filter, result)?;
            if !in_recovery {
                return Err(self.promoted(i));
            }
            self.note_feed_reset(&name, &answer);
            self.mirror.apply_standby(&name, &answer);
            self.standby(i).feed_after = answer.seq;
            self.standbys[i].feed_tracked = u64::try_from(answer.tracked).ok();
            report.filter_bytes += answer_bytes(&answer);
            if self.mirror.standby_complete(&name) {
                break;
            }
        }
        Ok(Ready::Filter(Vec::new()))
    }

    /// Logs (once per reset) and counts a node's feed starting over.
    fn note_feed_reset(&self, node: &str, answer: &FeedAnswer) {
        if answer.reset {
            self.metrics.feed_reset(node);
            info!(
                node = %node,
                reason = answer.reset_reason.as_deref().unwrap_or("?"),
                "the change feed of {node} starts over ({}): its blocks are listed again",
                answer.reset_reason.as_deref().unwrap_or("?")
            );
        }
    }

    /// Whether this cycle uses the change feed: wanted, and the primary and every connected
    /// standby serve it (their catalog and their loaded library, see `Node::has_change_feed`).
    /// Said once per catalog and library version when the primary does not.
    fn feed_mode(&mut self) -> bool {
        if !self.feed_wanted {
            return false;
        }
        let primary = self.primary.as_ref().expect("connected by ensure_primary");
        if primary.has_change_feed() {
            // A standby too small for the hot set is served by the filter exchange, whose cap
            // keeps it on the hottest part instead of trading blocks back and forth; so is
            // one whose library no longer serves the catalog's feed (0.7.0 under 0.5.0).
            let hot = self.last_hot_set;
            return !self
                .standbys
                .iter()
                .filter_map(|s| s.node.as_ref())
                .any(|n| {
                    u64::try_from(n.facts.shared_buffers).unwrap_or(0) < hot || !n.has_change_feed()
                });
        }
        let facts = &primary.facts;
        let catalog = facts.extension_version.as_deref().unwrap_or("?");
        let library = facts.library_version.as_deref().unwrap_or("?");
        let seen = format!("{catalog} {library}");
        if self.feed_absent_logged.as_deref() != Some(seen.as_str()) {
            if facts.sql_version() < Some(node::CHANGE_FEED_SINCE) {
                info!(
                    "extension {catalog} on {} predates the change feed (0.5.0); using the full filter exchange",
                    primary.label()
                );
            } else {
                info!(
                    "the pg_ccm library {library} on {} does not serve the change feed of the \
                     extension's catalog {catalog}; using the full filter exchange until ALTER \
                     EXTENSION pg_ccm UPDATE",
                    primary.label()
                );
            }
            self.feed_absent_logged = Some(seen);
        }
        false
    }

    /// A standby's trouble while the cycle goes on with others: logged when it starts,
    /// counted, and retried after its own backoff.
    fn standby_trouble(&mut self, i: usize, error: &CycleError) {
        if let Some(stage) = error.stage() {
            self.metrics.cycle_error(stage);
        }
        let cap = error.backoff_cap(&self.cfg);
        let standby = &mut self.standbys[i];
        let text = error.to_string();
        if let Some(retry) = standby.defer(cap, text.clone()) {
            match error {
                CycleError::Safety(_) => {
                    error!(standby = %standby.name, "{text}; retrying in {retry}")
                }
                _ => {
                    warn!(standby = %standby.name, "{text}; warming the other standbys, retrying this one in {retry}")
                }
            }
        }
    }

    /// A standby warmed without trouble: its backoff and problem are over.
    fn standby_fine(&mut self, i: usize) {
        let standby = &mut self.standbys[i];
        standby.backoff.reset();
        standby.retry_at = None;
        if standby.problem.take().is_some() {
            info!(standby = %standby.name, "warming the standby {} again", standby.name);
        }
    }

    // ---- the cycle --------------------------------------------------------------------

    /// One cycle; `progress` (sync --once) counts blocks processed.
    pub async fn cycle(
        &mut self,
        progress: Option<&ProgressBar>,
    ) -> Result<CycleReport, CycleError> {
        self.count_wire();
        self.refresh_topology().await?;
        self.ensure_primary().await?;
        let started = Instant::now();
        let mut report = CycleReport::default();

        // (1) What each standby already caches.
        let feed = self.feed_mode();
        let mut ready: Vec<(usize, Vec<u8>)> = Vec::new();
        let mut troubles: Vec<(usize, CycleError)> = Vec::new();
        for i in 0..self.standbys.len() {
            match self.standby_filter(i, feed, &mut report).await {
                Ok(Ready::Filter(filter)) => ready.push((i, filter)),
                Ok(Ready::Pass) => {}
                Err(CycleError::Cancelled) => return Err(CycleError::Cancelled),
                Err(e @ CycleError::Disabled { .. }) => return Err(e),
                Err(e) => troubles.push((i, e)),
            }
        }
        if ready.is_empty() {
            if report.interrupted() {
                return Ok(self.finish(report, started));
            }
            // Nothing to warm: the first standby's trouble is the cycle's, and the loop backs
            // off as a whole (the standbys' own backoffs start afresh).
            for standby in &mut self.standbys {
                if standby.node.is_none() {
                    standby.retry_at = None;
                }
            }
            let mut troubles = troubles;
            return Err(match troubles.len() {
                0 => self.no_standby(),
                1 => troubles.remove(0).1,
                _ => self.no_standby_of(troubles),
            });
        }
        for (i, e) in troubles {
            self.standby_trouble(i, &e);
        }

        // (2) One scan of the primary: per standby, what it lacks, at most what it holds.
        let lists = if feed {
            self.primary_feed(&mut report).await?;
            Vec::new()
        } else {
            self.hot_lists(&ready).await?
        };
        // Every node answered the CCM calls, so CCM is on again if it was off.
        self.mark_enabled();

        // The primary's logical WAL cache, for the metrics only: a failure here is logged
        // and never stops the cycle.
        match self.primary().wal_cache().await {
            Ok(Some(status)) => self.metrics.wal_cache(&status),
            Ok(None) => {}
            Err(error) => debug!(%error, "reading the logical WAL cache status failed"),
        }

        // (3), (4) Standby after standby, in the warming order.
        let warmed: Vec<_> = if feed {
            ready.iter().map(|(i, _)| (*i, None)).collect()
        } else {
            ready
                .iter()
                .zip(lists)
                .map(|((i, _), list)| (*i, Some(list)))
                .collect()
        };
        for (i, list) in warmed {
            let i = &i;
            let result = match list {
                Some(list) => self.warm(*i, &list, progress, &mut report).await,
                None => self.warm_feed(*i, progress, &mut report).await,
            };
            match result {
                Ok(()) => self.standby_fine(*i),
                Err(
                    e @ (CycleError::Cancelled
                    | CycleError::Decode(_)
                    | CycleError::Disabled { .. }),
                ) => return Err(e),
                Err(e) => self.standby_trouble(*i, &e),
            }
        }
        // (5) Room left: colder blocks for the standbys that loaded their hot blocks, in what
        // is left of the interval, so that the next cycle's hot blocks never wait for them.
        let fill_until = started + self.cfg.interval;
        if self.cfg.fill_room {
            for (i, filter) in &ready {
                if Instant::now() >= fill_until {
                    break;
                }
                let from_mirror = feed && self.colder_feed();
                let batches = if from_mirror {
                    self.fill_from_mirror(*i, &report)
                } else {
                    let fetched;
                    let filter = if feed {
                        match self.fill_filter(*i, &report).await {
                            Ok(Some(f)) => {
                                fetched = f;
                                &fetched
                            }
                            Ok(None) => continue,
                            Err(e @ (CycleError::Cancelled | CycleError::Disabled { .. })) => {
                                return Err(e)
                            }
                            Err(e) => {
                                self.standby_trouble(*i, &e);
                                continue;
                            }
                        }
                    } else {
                        filter
                    };
                    self.fill_batches(*i, filter, &mut report).await?
                };
                let Some(batches) = batches else {
                    continue;
                };
                match self
                    .load(
                        *i,
                        &batches,
                        Tier::Fill,
                        Some(fill_until),
                        progress,
                        &mut report,
                    )
                    .await
                {
                    Ok(loaded) => {
                        if from_mirror {
                            // Batches the interval left no time for go back to missing.
                            let name = &self.standbys[*i].name;
                            self.mirror.unsend(name, &batches[loaded..]);
                        }
                        // A fill that loaded nothing (its blocks all skipped or cached by then)
                        // would be asked for again every cycle: wait as after an empty one.
                        // (The mirror's fill costs nothing when there is nothing to send.)
                        let name = &self.standbys[*i].name;
                        if !from_mirror
                            && report
                                .standbys
                                .iter()
                                .any(|r| &r.name == name && r.filled == 0)
                        {
                            self.standbys[*i].fill_idle_until = Some(Instant::now() + FILL_RECHECK);
                        }
                    }
                    Err(
                        e @ (CycleError::Cancelled
                        | CycleError::Decode(_)
                        | CycleError::Disabled { .. }),
                    ) => return Err(e),
                    Err(e) => self.standby_trouble(*i, &e),
                }
            }
        }
        self.metrics
            .hot_set_blocks
            .set(saturating_i64(report.hot_buffers));
        self.metrics.coverage_ratio.set(report.coverage());
        self.last_hot_set = report.hot_buffers;
        Ok(self.finish(report, started))
    }

    /// Several standbys, each with its own trouble: one error that names them all.
    fn no_standby_of(&self, troubles: Vec<(usize, CycleError)>) -> CycleError {
        let safety = troubles
            .iter()
            .any(|(_, e)| matches!(e, CycleError::Safety(_)));
        let stage = troubles[0].1.stage().unwrap_or(Stage::Connect);
        let message = troubles
            .iter()
            .map(|(i, e)| format!("{}: {e}", self.standbys[*i].name))
            .collect::<Vec<_>>()
            .join("; ");
        CycleError::Standbys {
            stage: if safety { Stage::Safety } else { stage },
            message: format!("no standby can be warmed: {message}"),
        }
    }

    /// The error when no host of the topology is a standby to warm.
    fn no_standby(&self) -> CycleError {
        let tried = self
            .standbys
            .iter()
            .map(|s| format!("{} is not in recovery", s.name))
            .collect::<Vec<_>>();
        let tried = if tried.is_empty() {
            "no failover candidate is listed".to_string()
        } else {
            tried.join("; ")
        };
        CycleError::Node {
            stage: Stage::Connect,
            side: Side::Standby,
            error: NodeError::NoMatch {
                side: Side::Standby,
                tried,
            },
        }
    }

    /// Step (2): the lists, in the order of `ready`, from one scan when the extension can.
    async fn hot_lists(&mut self, ready: &[(usize, Vec<u8>)]) -> Result<Vec<Vec<u8>>, CycleError> {
        let limits: Vec<i64> = ready
            .iter()
            .map(|(i, _)| {
                self.standbys[*i]
                    .node
                    .as_ref()
                    .map_or(1, |n| n.facts.shared_buffers.max(1))
            })
            .collect();
        let mut lists = Vec::with_capacity(ready.len());
        if ready.len() > 1 && self.primary().multi_standby() {
            let filters: Vec<Option<&[u8]>> =
                ready.iter().map(|(_, f)| Some(f.as_slice())).collect();
            let result = self.primary().hot_blocks_each(&filters, &limits).await;
            let (in_recovery, each) = self.call(Who::Primary, Stage::HotBlocks, result)?;
            if in_recovery {
                return Err(self.primary_demoted());
            }
            lists = each;
        } else {
            for ((_, filter), limit) in ready.iter().zip(&limits) {
                let result = self.primary().hot_blocks(filter, *limit).await;
                let (in_recovery, list) = self.call(Who::Primary, Stage::HotBlocks, result)?;
                if in_recovery {
                    return Err(self.primary_demoted());
                }
                lists.push(list);
            }
        }
        let bytes: usize = lists.iter().map(Vec::len).sum();
        self.metrics
            .block_list_bytes
            .set(saturating_i64(bytes as u64));
        Ok(lists)
    }

    /// Step (2) in feed mode: the primary's change feed, applied to the mirror.
    async fn primary_feed(&mut self, report: &mut CycleReport) -> Result<(), CycleError> {
        let budget = feed::sweep_budget(self.primary().facts.shared_buffers);
        let subscriber = self.subscriber;
        let colder = self.colder_feed();
        let result = self
            .primary()
            .buffer_changes(subscriber, None, budget, colder)
            .await;
        let (in_recovery, answer) = self.call(Who::Primary, Stage::HotBlocks, result)?;
        if in_recovery {
            return Err(self.primary_demoted());
        }
        self.note_feed_reset("primary", &answer);
        self.mirror.apply_primary(&answer);
        self.primary().feed_after = answer.seq;
        let names: Vec<String> = self.standbys.iter().map(|s| s.name.clone()).collect();
        self.mirror.retain_standbys(&names);
        report.buffers_scanned = u64::try_from(answer.visited).unwrap_or(0);
        report.hot_buffers = self.mirror.hot_len() as u64;
        let bytes = answer_bytes(&answer);
        report.list_bytes += bytes;
        self.metrics
            .block_list_bytes
            .set(saturating_i64(bytes as u64));
        Ok(())
    }

    /// Steps (3) and (4) in feed mode for standby `i`: the hot blocks it lacks, hottest
    /// first, at most its shared_buffers, loaded in batches. What is sent is confirmed by its
    /// feed's later sweeps.
    async fn warm_feed(
        &mut self,
        i: usize,
        progress: Option<&ProgressBar>,
        report: &mut CycleReport,
    ) -> Result<(), CycleError> {
        let room = self.standbys[i]
            .node
            .as_ref()
            .map_or(1, |n| n.facts.shared_buffers.max(1));
        let name = self.standbys[i].name.clone();
        let hot = self.mirror.hot_len() as u64;
        let lacking = self.mirror.lacking(&name) as u64;
        let unused = self.unused_buffers(i);
        let list = self.mirror.take_missing(
            &name,
            feed::Class::Hot,
            usize::try_from(room).unwrap_or(usize::MAX),
        );
        let sent = list.as_ref().map_or(0, |l| l.len() as u64);
        report.sent += sent;
        let standby = StandbyReport {
            name,
            hot_buffers: hot,
            room: u64::try_from(room).unwrap_or(1),
            sent: lacking,
            ..Default::default()
        };
        self.metrics
            .standby_scan(&standby.name, standby.hot_buffers, standby.missing());
        report.standbys.push(standby);
        let Some(list) = list else { return Ok(()) };
        if let Some(pb) = progress {
            pb.inc_length(sent);
        }
        let batches = in_load_order(&list, unused, self.cfg.batch_blocks as usize);
        let loaded = self
            .load(i, &batches, Tier::Hot, None, progress, report)
            .await?;
        // A cycle cut short (replay lag, a recovery conflict) sends the rest next cycle.
        let name = &self.standbys[i].name;
        self.mirror.unsend(name, &batches[loaded..]);
        Ok(())
    }

    /// Whether the primary's feed reports its colder blocks too, so that fill_room fills from
    /// the mirror (extension 0.6.0) instead of a standby filter and a scan of the primary.
    fn colder_feed(&self) -> bool {
        self.cfg.fill_room && self.primary.as_ref().is_some_and(Node::has_colder_feed)
    }

    /// fill_room from the mirror (extension 0.6.0), for standby `i` once this cycle loaded
    /// its whole share of hot blocks: the primary's colder blocks it lacks, hottest first, as
    /// many as its unused buffers take less a reserve, at most FILL_MAX_BATCHES batches. Its
    /// unused buffers are counted from its feed (once that has swept all of them since its
    /// last reset) less the blocks sent and not reported yet. None when there is no room or
    /// nothing to send; asking costs no call to either node.
    fn fill_from_mirror(&mut self, i: usize, report: &CycleReport) -> Option<Vec<Vec<u8>>> {
        if self.standbys[i].retry_at.is_some() || !self.mirror.complete {
            return None;
        }
        let unused = self.unused_buffers(i)?;
        let name = self.standbys[i].name.clone();
        report.loaded_whole_share(&name)?;
        let buffers = self.standby(i).facts.shared_buffers;
        let room =
            unused.saturating_sub(u64::try_from(buffers).unwrap_or(0) / FILL_RESERVE_DIVISOR);
        if room < FILL_MIN_BLOCKS {
            return None;
        }
        let batch = self.cfg.batch_blocks as usize;
        let take = usize::try_from(room)
            .unwrap_or(usize::MAX)
            .min(batch.saturating_mul(FILL_MAX_BATCHES));
        let list = self.mirror.take_missing(&name, feed::Class::Colder, take)?;
        debug!(standby = %name, unused, take = list.len(),
            "filling the standby's unused buffers with colder blocks");
        // The hottest `take` were chosen; all of them fit in unused buffers.
        Some(list.split_in_file_order(batch))
    }

    /// Standby `i`'s unused buffers as far as the agent knows: its shared_buffers less the
    /// blocks its feed reports and those sent but not reported yet. None until its feed has
    /// swept all its buffers since its last reset (until then it may hold blocks the feed
    /// has not reached).
    fn unused_buffers(&self, i: usize) -> Option<u64> {
        let standby = &self.standbys[i];
        let (node, tracked) = (standby.node.as_ref()?, standby.feed_tracked?);
        if !self.mirror.standby_complete(&standby.name) {
            return None;
        }
        let buffers = u64::try_from(node.facts.shared_buffers).unwrap_or(0);
        let pending = self.mirror.inflight(&standby.name) as u64;
        Some(buffers.saturating_sub(tracked.saturating_add(pending)))
    }

    /// fill_room in feed mode: standby `i`'s filter, asked for only when its feed says it has
    /// unused buffers beyond the reserve (None otherwise).
    async fn fill_filter(
        &mut self,
        i: usize,
        report: &CycleReport,
    ) -> Result<Option<Vec<u8>>, CycleError> {
        let standby = &self.standbys[i];
        let (Some(node), Some(tracked)) = (standby.node.as_ref(), standby.feed_tracked) else {
            return Ok(None);
        };
        if standby
            .fill_idle_until
            .is_some_and(|at| Instant::now() < at)
            || standby.retry_at.is_some()
        {
            return Ok(None);
        }
        let loaded = report
            .standbys
            .iter()
            .find(|r| r.name == standby.name)
            .map_or(0, |r| r.loaded);
        let buffers = u64::try_from(node.facts.shared_buffers).unwrap_or(0);
        if unused_room(buffers, tracked.saturating_add(loaded)) < FILL_MIN_BLOCKS {
            return Ok(None);
        }
        let fpr = self.cfg.false_positive_rate;
        let result = self.standby(i).buffer_filter(fpr).await;
        let (in_recovery, filter) = self.call(Who::Standby(i), Stage::Filter, result)?;
        if !in_recovery {
            return Err(self.promoted(i));
        }
        Ok(Some(filter))
    }

    /// Steps (3) and (4) for standby `i`: its list decoded and loaded in batches.
    async fn warm(
        &mut self,
        i: usize,
        list_bytes: &[u8],
        progress: Option<&ProgressBar>,
        report: &mut CycleReport,
    ) -> Result<(), CycleError> {
        let limit = self.standbys[i]
            .node
            .as_ref()
            .map_or(1, |n| n.facts.shared_buffers.max(1));
        let list = BlockList::decode_bounded(list_bytes, u64::try_from(limit).unwrap_or(1))
            .map_err(|e| CycleError::Decode(e.to_string()))?;
        report.hot_buffers = list.header.hot_buffers_found;
        report.buffers_scanned = list.header.buffers_scanned;
        report.list_bytes += list_bytes.len();
        let sent = list.len() as u64;
        report.sent += sent;
        let name = self.standbys[i].name.clone();
        let standby = StandbyReport {
            name,
            hot_buffers: list.header.hot_buffers_found,
            room: u64::try_from(limit).unwrap_or(1),
            sent,
            ..Default::default()
        };
        self.metrics
            .standby_scan(&standby.name, standby.hot_buffers, standby.missing());
        report.standbys.push(standby);
        if let Some(pb) = progress {
            pb.inc_length(sent);
        }
        if sent == 0 {
            return Ok(());
        }
        let batches = list.split_hottest_first(self.cfg.batch_blocks as usize);
        self.load(i, &batches, Tier::Hot, None, progress, report)
            .await
            .map(|_| ())
    }

    /// Step (4): standby `i` reads `batches`, one short ccm_prewarm call each, until a
    /// recovery conflict or replay lag ends its share of the cycle, or `until` has passed.
    /// Returns how many batches it sent (the rest were not).
    async fn load(
        &mut self,
        i: usize,
        batches: &[Vec<u8>],
        tier: Tier,
        until: Option<Instant>,
        progress: Option<&ProgressBar>,
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
            report.batches += 1;
            if tier == Tier::Fill {
                report.colder_sent += blocks;
            }
            let result = self.standby(i).prewarm(batch).await;
            called += 1;
            let flow = self.prewarm_outcome(i, blocks, tier, result, report)?;
            if let Some(pb) = progress {
                pb.inc(blocks);
            }
            if flow == Flow::EndCycle {
                break;
            }
        }
        Ok(called)
    }

    /// Step (5) for standby `i`, with fill_room: when this cycle loaded its whole list of hot
    /// blocks (no conflict or storage error cut it short) and it still has unused buffers,
    /// the primary's cached blocks it lacks below the hot set's threshold (usage count from
    /// the threshold down to 1; of the primary's as many hottest blocks as the standby has
    /// buffers), hottest first, as many as its unused buffers take less a reserve, at most
    /// FILL_MAX_BATCHES batches (fewer if the cycle's interval runs out first). They go only into buffers nobody uses, so nothing the
    /// standby caches is evicted for them, and they keep their low usage counts, so the
    /// standby's own reads and replay evict them before any hot block. None when there is
    /// nothing to fill. A failure of the primary fails the cycle, as in step (2).
    async fn fill_batches(
        &mut self,
        i: usize,
        filter: &[u8],
        report: &mut CycleReport,
    ) -> Result<Option<Vec<Vec<u8>>>, CycleError> {
        let standby = &self.standbys[i];
        let Some(node) = standby.node.as_ref() else {
            return Ok(None);
        };
        // The hot blocks it read this cycle took unused buffers too.
        let Some(loaded) = report.loaded_whole_share(&standby.name) else {
            return Ok(None);
        };
        let idle = standby
            .fill_idle_until
            .is_some_and(|at| Instant::now() < at);
        if idle || standby.retry_at.is_some() {
            return Ok(None);
        }
        let buffers = u64::try_from(node.facts.shared_buffers).unwrap_or(0);
        let cached = ccm_codec::FilterView::parse(filter).map_or(buffers, |f| f.item_count());
        let room = unused_room(buffers, cached.saturating_add(loaded));
        if room < FILL_MIN_BLOCKS {
            return Ok(None);
        }
        let limit = i64::try_from(buffers).unwrap_or(i64::MAX).max(1);
        let result = self.primary().cached_blocks(filter, limit).await;
        let (in_recovery, bytes) = self.call(Who::Primary, Stage::HotBlocks, result)?;
        if in_recovery {
            return Err(self.primary_demoted());
        }
        let list = BlockList::decode_bounded(&bytes, u64::try_from(limit).unwrap_or(1))
            .map_err(|e| CycleError::Decode(e.to_string()))?;
        if list.is_empty() {
            self.standbys[i].fill_idle_until = Some(Instant::now() + FILL_RECHECK);
            return Ok(None);
        }
        let batch = self.cfg.batch_blocks as usize;
        let take = usize::try_from(room.min(list.len() as u64))
            .unwrap_or(usize::MAX)
            .min(batch.saturating_mul(FILL_MAX_BATCHES));
        debug!(
            standby = %self.standbys[i].name,
            unused = buffers.saturating_sub(cached),
            lacking = list.len(),
            take,
            "filling the standby's unused buffers with colder blocks"
        );
        Ok(Some(list.hottest_batches(batch, take)))
    }

    fn finish(&self, mut report: CycleReport, started: Instant) -> CycleReport {
        report.duration = started.elapsed();
        self.metrics.cycle_done(report.duration);
        report
    }

    /// What one prewarm call's answer means for standby `i`'s share of the cycle.
    fn prewarm_outcome(
        &mut self,
        i: usize,
        blocks: u64,
        tier: Tier,
        result: Result<(bool, PrewarmResult), NodeError>,
        report: &mut CycleReport,
    ) -> Result<Flow, CycleError> {
        let error = match result {
            Ok((true, done)) => {
                self.account(i, blocks, tier, &done, report);
                return Ok(self.replay_check(i, done.replay_lag, report));
            }
            // Promoted during the call: nothing more goes to this server.
            Ok((false, _)) => return Err(self.promoted(i)),
            Err(error) => error,
        };
        match error.class() {
            ErrorClass::NotInRecovery => Err(self.promoted(i)),
            ErrorClass::RecoveryConflict => {
                self.recovery_conflict(i, &error, report);
                Ok(Flow::EndCycle)
            }
            ErrorClass::Storage if !self.standby_broken(i, &error) => {
                let name = self.standbys[i].name.clone();
                // With its DETAIL, which names the database when a prewarm worker hit it.
                let message = error.server_message().unwrap_or_else(|| error.to_string());
                warn!(
                    standby = %name,
                    "storage error on the standby {name}: {message}; skipping this batch of \
                     {blocks} blocks and going on with the next"
                );
                self.metrics.prewarm_storage_errors.inc();
                report.storage_errors += 1;
                if let Some(r) = report.standby_mut(&name) {
                    r.storage_errors += 1;
                }
                let lost = PrewarmResult {
                    skipped: blocks,
                    ..PrewarmResult::default()
                };
                self.account(i, blocks, tier, &lost, report);
                Ok(Flow::Next)
            }
            _ => self.call(Who::Standby(i), Stage::Prewarm, Err(error)),
        }
    }

    /// After a batch: whether standby `i`'s replay lag leaves room for the next one. Above
    /// max_replay_lag its share of the cycle ends, so that our reads do not keep a failover
    /// candidate's replay behind (promotion waits for replay to finish); the next cycle goes
    /// on where this one stopped, one batch at a time while the lag lasts.
    fn replay_check(&mut self, i: usize, lag: Option<u64>, report: &mut CycleReport) -> Flow {
        let max = self.cfg.max_replay_lag;
        let standby = &mut self.standbys[i];
        let Some((lag, max)) = lag.zip(max).filter(|(lag, max)| lag > max) else {
            if std::mem::take(&mut standby.replay_behind) {
                info!(standby = %standby.name, "replay on the standby {} caught up; warming it again", standby.name);
            }
            return Flow::Next;
        };
        if !std::mem::replace(&mut standby.replay_behind, true) {
            info!(
                standby = %standby.name,
                replay_lag_bytes = lag,
                "replay on the standby {} is {} behind what it received (max_replay_lag {}); \
                 warming it waits for replay, a batch per cycle at most",
                standby.name,
                crate::config::format_size(lag),
                crate::config::format_size(max)
            );
        }
        self.metrics.replay_lag_pauses.inc();
        report.replay_pauses += 1;
        if let Some(r) = report.standby_mut(&self.standbys[i].name) {
            r.replay_paused = true;
        }
        Flow::EndCycle
    }

    /// Counts what a prewarm call on standby `i` did with `blocks` blocks.
    fn account(
        &mut self,
        i: usize,
        blocks: u64,
        tier: Tier,
        done: &PrewarmResult,
        report: &mut CycleReport,
    ) {
        self.metrics.blocks_sent.inc_by(blocks);
        self.metrics.blocks_loaded.inc_by(done.loaded);
        if tier == Tier::Fill {
            self.metrics.fill_blocks_loaded.inc_by(done.loaded);
        }
        self.metrics
            .blocks_already_cached
            .inc_by(done.already_cached);
        self.metrics.blocks_skipped.inc_by(done.skipped);
        self.metrics
            .standby_loaded(&self.standbys[i].name, done.loaded);
        report.requested += done.requested;
        report.loaded += done.loaded;
        report.already_cached += done.already_cached;
        report.skipped += done.skipped;
        if let Some(r) = report.standby_mut(&self.standbys[i].name) {
            r.loaded += done.loaded;
            if tier == Tier::Fill {
                r.filled += done.loaded;
            }
        }
    }

    /// A recovery conflict on standby `i`: logged (one line, with the server's DETAIL),
    /// counted, its session dropped if the server ended it. Not a fault: that standby's
    /// share of the cycle just ends.
    fn recovery_conflict(&mut self, i: usize, error: &NodeError, report: &mut CycleReport) {
        let name = self.standbys[i].name.clone();
        let message = error.server_message().unwrap_or_else(|| error.to_string());
        info!(
            standby = %name,
            "recovery conflict on the standby {name}: {message}; ending this cycle for it, \
             the blocks not loaded follow in the next one"
        );
        self.metrics.recovery_conflicts.inc();
        report.recovery_conflicts += 1;
        if let Some(r) = report.standby_mut(&name) {
            r.recovery_conflicts += 1;
        }
        if self.standby_broken(i, error) {
            self.drop_standby(i);
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

/// The addresses a host spec resolves to (none for a Unix socket or a failed lookup).
async fn addresses(host: &HostSpec) -> Vec<IpAddr> {
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
fn count_node_wire(metrics: &Metrics, name: &str, node: Option<&mut Node>) {
    if let Some((sent, received)) = node.and_then(Node::wire_bytes) {
        metrics.wire_bytes(name, sent, received);
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
    // One line per standby that loaded something, with its share of the hot set as the
    // scan found it (the blocks just loaded raise it by the next scan).
    for standby in &report.standbys {
        if standby.loaded == 0 {
            debug!(
                standby = %standby.name,
                sent = standby.sent,
                coverage = standby.coverage(),
                "standby done"
            );
            continue;
        }
        let colder = match standby.filled {
            0 => String::new(),
            filled => format!(", {filled} of them colder blocks into unused buffers"),
        };
        info!(
            standby = %standby.name,
            loaded = standby.loaded,
            filled = standby.filled,
            sent = standby.sent,
            hot_buffers = standby.hot_buffers,
            coverage = format_args!("{:.4}", standby.coverage()),
            "loaded {} blocks into the standby {}{colder} (it held {:.1}% of the hot set of {} buffers)",
            standby.loaded,
            standby.name,
            standby.coverage() * 100.0,
            standby.hot_buffers
        );
    }
    if report.loaded > 0 && report.standbys.len() > 1 {
        info!(
            loaded = report.loaded,
            already_cached = report.already_cached,
            skipped = report.skipped,
            ms = format_args!("{ms:.1}"),
            "cycle loaded {} blocks into {} standbys in {ms:.1} ms",
            report.loaded,
            report.standbys.len()
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
        let source_changed = cfg.patroni_urls != self.cfg.patroni_urls
            || cfg.member_conninfo != self.cfg.member_conninfo;
        if source_changed || cfg.primary_conninfo != self.cfg.primary_conninfo {
            self.drop_primary();
            self.primary_info = None;
        }
        if source_changed || cfg.standby_conninfo != self.cfg.standby_conninfo {
            // Rebuilt from the new topology next cycle.
            self.standbys.clear();
            self.metrics.set_node_up(Side::Standby, false);
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
        fill_room = cfg.fill_room,
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
                let delay = backoff.next_delay().min(e.backoff_cap(&cfg));
                let retry = format_duration(Duration::from_millis(delay.as_millis() as u64));
                match &e {
                    CycleError::Safety(_)
                    | CycleError::Decode(_)
                    | CycleError::Standbys {
                        stage: Stage::Safety,
                        ..
                    } => {
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
    /// Hot blocks sent (as aurora_ccm_status() counts them).
    pub sent: u64,
    /// Colder blocks sent to fill unused buffers (fill_room).
    pub colder_sent: u64,
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
        self.colder_sent += report.colder_sent;
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
        let colder = match self.colder_sent {
            0 => String::new(),
            n => format!(" (and {n} colder ones into unused buffers)"),
        };
        format!(
            "{} after {} cycle{}: sent {} blocks{colder}, loaded {}, already cached {}, skipped {}; \
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

/// The lists of a feed answer, in bytes.
fn answer_bytes(answer: &FeedAnswer) -> usize {
    let list = |l: &BlockList| 32 + l.len() * 3;
    list(&answer.added)
        + list(&answer.removed)
        + answer.colder_added.as_ref().map_or(0, list)
        + answer.colder_removed.as_ref().map_or(0, list)
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
    // One whole warm-up is the filter exchange's job: no feed state to build first.
    syncer.feed_wanted = false;
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

    #[test]
    fn an_unreachable_node_is_tried_again_within_a_second_other_faults_back_off_further() {
        let (syncer, _) = syncer();
        let cfg = &syncer.cfg;
        assert_eq!(cfg.max_backoff, Duration::from_secs(30));
        let unreachable = CycleError::Topology("no leader".into());
        assert_eq!(unreachable.backoff_cap(cfg), RECONNECT_CEILING);
        let corrupt = CycleError::Decode("bad list".into());
        assert_eq!(corrupt.backoff_cap(cfg), cfg.max_backoff);
        // A long interval is not shortened, and max_backoff stays the limit.
        let slow = Config {
            interval: Duration::from_secs(5),
            ..cfg.as_ref().clone()
        };
        assert_eq!(unreachable.backoff_cap(&slow), Duration::from_secs(5));
        let tight = Config {
            max_backoff: Duration::from_millis(500),
            ..cfg.as_ref().clone()
        };
        assert_eq!(unreachable.backoff_cap(&tight), Duration::from_millis(500));
    }

    fn syncer() -> (Syncer, Arc<Metrics>) {
        let cfg = Config::validate(crate::config::RawConfig {
            primary: Some("host=127.0.0.1 port=1 user=u dbname=postgres".into()),
            standby: Some("host=127.0.0.2 port=1 user=u dbname=postgres".into()),
            ..Default::default()
        })
        .unwrap();
        let metrics = Arc::new(Metrics::new());
        let mut syncer = Syncer::new(
            Arc::new(cfg.clone()),
            metrics.clone(),
            CancellationToken::new(),
        );
        for target in topology::from_conninfo(&cfg).targets {
            syncer
                .standbys
                .push(Standby::new(target, Duration::from_secs(1)));
        }
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
        let mut report = CycleReport::default();
        let done = PrewarmResult {
            requested: 10,
            loaded: 10,
            ..Default::default()
        };
        let err = syncer
            .prewarm_outcome(0, 10, Tier::Hot, Ok((false, done)), &mut report)
            .unwrap_err();
        match &err {
            CycleError::RoleChanged { side, message } => {
                assert_eq!(*side, Side::Standby);
                assert!(message.contains("127.0.0.2:1 was promoted"), "{message}");
            }
            other => panic!("expected RoleChanged, got {other:?}"),
        }
        assert_eq!(err.stage(), Some(Stage::Safety));
        // Nothing from a promoted node is counted as loaded.
        assert_eq!(report.loaded, 0);
        assert_eq!(metric(&metrics, "ccm_agent_blocks_loaded_total"), 0.0);
        assert!(syncer.standbys[0].node.is_none());
    }

    /// A cycle's report with the test syncer's standby in it, as `warm` leaves it.
    fn report_of_the_standby() -> CycleReport {
        let mut report = CycleReport::default();
        report.standbys.push(StandbyReport {
            name: "127.0.0.2:1".into(),
            ..Default::default()
        });
        report
    }

    #[test]
    fn a_prewarm_in_recovery_is_counted() {
        let (mut syncer, metrics) = syncer();
        let mut report = report_of_the_standby();
        let done = PrewarmResult {
            requested: 10,
            loaded: 6,
            already_cached: 3,
            skipped: 1,
            replay_lag: Some(0),
        };
        let flow = syncer
            .prewarm_outcome(0, 10, Tier::Hot, Ok((true, done)), &mut report)
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
        assert_eq!(report.standbys[0].loaded, 6);
        assert_eq!(metric(&metrics, "ccm_agent_blocks_sent_total"), 10.0);
        assert_eq!(metric(&metrics, "ccm_agent_blocks_skipped_total"), 1.0);
        assert_eq!(
            metric(
                &metrics,
                "ccm_agent_standby_blocks_loaded_total{node=\"127.0.0.2:1\"}"
            ),
            6.0
        );
    }

    #[test]
    fn replay_lag_above_the_maximum_ends_the_standbys_share_of_the_cycle() {
        let (mut syncer, metrics) = syncer();
        assert_eq!(
            syncer.cfg.max_replay_lag,
            Some(16 << 20),
            "the default, 16MB"
        );
        let mut report = report_of_the_standby();
        let batch = |lag| PrewarmResult {
            requested: 4,
            loaded: 4,
            replay_lag: lag,
            ..Default::default()
        };
        let mut outcome = |lag, report: &mut CycleReport| {
            syncer
                .prewarm_outcome(0, 4, Tier::Hot, Ok((true, batch(lag))), report)
                .unwrap()
        };
        assert_eq!(
            outcome(Some(16 << 20), &mut report),
            Flow::Next,
            "at the maximum"
        );
        assert_eq!(
            outcome(None, &mut report),
            Flow::Next,
            "not streaming: nothing to compare"
        );
        assert_eq!(outcome(Some((16 << 20) + 1), &mut report), Flow::EndCycle);
        // What it loaded counts; the cycle is cut short, as by a recovery conflict.
        assert_eq!(report.standbys[0].loaded, 12);
        assert!(report.standbys[0].replay_paused && report.interrupted());
        assert_eq!(metric(&metrics, "ccm_agent_replay_lag_pauses_total"), 1.0);
        let mut next = report_of_the_standby();
        assert_eq!(outcome(Some(4096), &mut next), Flow::Next);
        assert!(!next.interrupted());
    }

    #[test]
    fn colder_blocks_count_as_loaded_and_as_filled() {
        let (mut syncer, metrics) = syncer();
        let mut report = report_of_the_standby();
        let hot = PrewarmResult {
            requested: 4,
            loaded: 4,
            ..Default::default()
        };
        let cold = PrewarmResult {
            requested: 10,
            loaded: 7,
            already_cached: 3,
            ..Default::default()
        };
        syncer
            .prewarm_outcome(0, 4, Tier::Hot, Ok((true, hot)), &mut report)
            .unwrap();
        syncer
            .prewarm_outcome(0, 10, Tier::Fill, Ok((true, cold)), &mut report)
            .unwrap();
        assert_eq!(
            (report.standbys[0].loaded, report.standbys[0].filled),
            (11, 7)
        );
        assert_eq!(metric(&metrics, "ccm_agent_blocks_loaded_total"), 11.0);
        assert_eq!(metric(&metrics, "ccm_agent_fill_blocks_loaded_total"), 7.0);
    }

    #[test]
    fn shutdown_and_disabled_pass_through() {
        let (mut syncer, _) = syncer();
        let mut report = CycleReport::default();
        assert!(matches!(
            syncer.prewarm_outcome(0, 1, Tier::Hot, Err(NodeError::Cancelled), &mut report),
            Err(CycleError::Cancelled)
        ));
        assert!(matches!(
            syncer.prewarm_outcome(
                0,
                1,
                Tier::Hot,
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
    fn coverage_is_the_least_covered_standby() {
        let mut r = report(1000, 30, 30);
        assert_eq!(r.coverage(), 0.97);
        for (name, sent) in [("a", 0), ("b", 100), ("c", 10)] {
            r.standbys.push(StandbyReport {
                name: name.into(),
                hot_buffers: 1000,
                room: 4096,
                sent,
                ..Default::default()
            });
        }
        assert_eq!(r.coverage(), 0.9);
    }

    #[test]
    fn a_list_that_fits_is_read_in_file_order_else_hottest_first() {
        use ccm_codec::{encode_block_list, BlockAddress, HotBlock};
        let block = |block, usage| HotBlock {
            addr: BlockAddress {
                spc: 1663,
                db: 5,
                rel: 16384,
                fork: 0,
                block,
            },
            usage,
        };
        let mut blocks = vec![block(0, 4), block(1, 5), block(2, 4), block(3, 5)];
        let list = BlockList::decode(&encode_block_list(&mut blocks, 4, 4).unwrap()).unwrap();
        let order = |unused| -> Vec<Vec<u32>> {
            in_load_order(&list, unused, 2)
                .iter()
                .map(|b| {
                    BlockList::decode(b)
                        .unwrap()
                        .iter()
                        .map(|h| h.addr.block)
                        .collect()
                })
                .collect()
        };
        assert_eq!(
            order(Some(4)),
            vec![vec![0, 1], vec![2, 3]],
            "room for all: file order"
        );
        assert_eq!(
            order(Some(3)),
            vec![vec![1, 3], vec![0, 2]],
            "too little room: hottest first"
        );
        assert_eq!(
            order(None),
            vec![vec![1, 3], vec![0, 2]],
            "room not known: hottest first"
        );
    }

    #[test]
    fn filling_leaves_a_reserve_of_unused_buffers() {
        // 16384 buffers, 10000 in use: 6384 unused, less 256 kept for replay and reads.
        assert_eq!(unused_room(16384, 10000), 6128);
        assert_eq!(unused_room(16384, 16200), 0);
        assert_eq!(
            unused_room(16384, 20000),
            0,
            "a filter may count more than the buffers"
        );
        assert_eq!(unused_room(0, 0), 0);
    }

    #[test]
    fn a_standby_smaller_than_the_hot_set_covers_its_room_at_most() {
        // 800 buffers for a hot set of 1000: its list holds what it lacks of the hottest 800,
        // and the 200 it has no room for count as missing, as status and wait count them.
        let small = |sent| StandbyReport {
            name: "small".into(),
            hot_buffers: 1000,
            room: 800,
            sent,
            ..Default::default()
        };
        assert_eq!(small(0).missing(), 200);
        assert_eq!(small(0).coverage(), 0.8);
        assert_eq!(small(80).coverage(), 0.72);
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

//! The sync cycle, the `run` loop around it and the one-shot `sync --once`.
//!
//! A cycle: (0) the topology (topology.rs: the connection strings, or Patroni's leader and
//! failover candidates), (1) each standby's bloom filter of what it caches, (2) one scan of
//! the primary that returns, per standby, the hot blocks its filter lacks, at most its
//! shared_buffers (`ccm_hot_blocks_each`, or `ccm_hot_blocks` for a single standby),
//! (3) each list split hottest-first into batches,
//! (4) one short `ccm_prewarm` call per batch, (5) with `fill_room`, for a standby that loaded its whole list and has unused buffers
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
//! Each standby's steps (1) and (3) to (5) run in a task of its own (standby.rs), which owns
//! that standby's session meanwhile; this module is the coordinator: the topology, the
//! primary's session and feed, and the waiting. It waits for step (1) at most the interval
//! (at least a second), and for the batches until the end of the interval; a standby still
//! at work then (silent, or cold and reading a long list) stays busy in its task while the
//! next cycles serve the others, and what it did is counted in the cycle in which its task
//! ends. A busy standby that has not answered for five seconds (or three intervals) is shown
//! down. `sync --once` waits for every task.
//!
//! One standby's trouble is its own: a standby that is down, silent, promoted, of another
//! system or following another primary is passed over (with its own backoff, logged once)
//! while the others are warmed. Only when no standby can be warmed, or the primary fails,
//! does the cycle fail and the loop back off.
//!
//! Not faults: a recovery conflict (the statement cancelled, or the session terminated) ends
//! that standby's share of the cycle, and what was not loaded comes again next cycle because
//! its filter is rebuilt; a storage error on one page costs its batch only.
//!
//! Only the `run` daemon that holds the cluster's lock on the primary warms (election.rs);
//! the others stop each cycle right after the try, before any call to a node's feed.
//! After each cycle the active daemon writes what it knows of every candidate (state,
//! coverage) to the primary's view `ccm_candidates` (extension 0.8.0), for SQL monitoring.
//! What a cycle did is counted in the report and the metrics together (report.rs).

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ccm_codec::BlockList;
use indicatif::ProgressBar;
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::backoff::Backoff;
use crate::config::{format_duration, Config};
use crate::conninfo::{ConnInfo, HostSpec};
use crate::election::{self, Election};
use crate::feed::{self, Mirror};
use crate::metrics::{Metrics, Stage};
use crate::node::{ConnectOptions, Node, NodeError, Side, WalSource};
use crate::nodeapi::NodeApi;
use crate::notify;
use crate::oscache::{self, OsTier};
use crate::patroni;
use crate::report::{
    CandidateRow, CandidateState, CycleReport, Event, StandbyReport, REPORT_MAX_CANDIDATES,
    REPORT_MAX_DUE_MS,
};
use crate::retry::{self, Episode, Kind, Pace};
use crate::standby::{
    self, addresses, count_node_wire, os_tier, unused_room, Done, PrimaryView, Ready, Shared,
    Standby, Tier, FILL_MAX_BATCHES, FILL_MIN_BLOCKS, FILL_RECHECK,
};
use crate::topology::{self, Target};
use crate::walsender::Endpoint;

/// The longest wait after a fast failure (retry.rs: refused, starting up, unreachable, a
/// broken session), unless the interval is longer: such an attempt costs the node nothing,
/// and a standby that restarted is cold, so it should be warmed as soon as it accepts
/// connections, not a doubled backoff later (which would add about as long again as the
/// restart took). Slow failures (authentication, TLS, the extension) back off to max_backoff.
const RECONNECT_CEILING: Duration = Duration::from_secs(1);

/// This agent in the primary's ccm_candidates: its host's name (at most 40 bytes) and its
/// process id, which tell two agents of one cluster apart.
fn agent_name() -> String {
    let host = whoami::hostname().unwrap_or_else(|_| "?".into());
    format!(
        "{}:{}",
        crate::report::truncated(&host, 40),
        std::process::id()
    )
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
    /// Every standby failed, each in its own way (all named in the message; `each` holds
    /// the errors, which say how soon to try again).
    #[error("{message}")]
    Standbys {
        stage: Stage,
        message: String,
        each: Vec<CycleError>,
    },
    /// Another agent holds the cluster's lock (election.rs): this one warms nothing. Not a
    /// fault.
    #[error("another ccm-agent holds the cluster's lock on the primary ({holder})")]
    StandingBy { holder: String },
    #[error("cancelled")]
    Cancelled,
}

impl CycleError {
    /// The longest backoff after this error: [`RECONNECT_CEILING`] (or the interval, if
    /// longer) for a fast failure, `max_backoff` for a slow one (retry.rs).
    pub fn backoff_cap(&self, cfg: &Config) -> Duration {
        match self.pace() {
            Pace::Fast => cfg.interval.max(RECONNECT_CEILING).min(cfg.max_backoff),
            Pace::Slow => cfg.max_backoff,
        }
    }

    /// How soon this failure is worth trying again.
    pub fn pace(&self) -> Pace {
        retry::cycle_pace(self)
    }

    /// What failed, for logging each kind once per episode.
    pub fn kind(&self) -> Kind {
        retry::cycle_kind(self)
    }

    /// The `stage` label this error is counted under; none for the non-faults.
    pub fn stage(&self) -> Option<Stage> {
        match self {
            CycleError::Node { stage, .. } => Some(*stage),
            CycleError::Safety(_) | CycleError::RoleChanged { .. } => Some(Stage::Safety),
            CycleError::Decode(_) => Some(Stage::HotBlocks),
            CycleError::Topology(_) => Some(Stage::Connect),
            CycleError::Standbys { stage, .. } => Some(*stage),
            CycleError::Disabled { .. } | CycleError::StandingBy { .. } | CycleError::Cancelled => {
                None
            }
        }
    }
}

/// Whose call a result is.
#[derive(Debug, Clone, Copy)]
enum Who {
    Primary,
}

impl Who {
    fn side(self) -> Side {
        match self {
            Who::Primary => Side::Primary,
        }
    }
}

/// How long the cycle waits for the standbys' step (1) at least: a feed or filter call takes
/// milliseconds, a sweep of a large pool after a reset tens of them; a standby that has not
/// answered by then (silent, or far behind) is left to its task and the others go on.
const PREPARE_WAIT_MIN: Duration = Duration::from_secs(1);

/// A busy standby that has not answered for this long is shown down as silent.
const SILENT_AFTER: Duration = Duration::from_secs(5);

/// How long a shutdown waits for the standbys' tasks to cancel their statements.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// A standby's task's end: its step (1), or its warming.
enum Finished<N: NodeApi> {
    Prepared(Done<Ready, N>),
    Warmed(Done<(), N>),
}

/// A standby's place in the topology: idle between its shares of the cycles, or busy in a
/// task of its own (`task`), which has it (`standby` is then None).
struct Slot<N: NodeApi> {
    name: String,
    conninfo: ConnInfo,
    standby: Option<Box<Standby<N>>>,
    task: Option<JoinHandle<Finished<N>>>,
    /// Accepted as a WAL sender of the others (connected and following the primary) when it
    /// was last idle.
    member: bool,
    /// Its share of the hot set when its task last reported (a busy standby's coverage).
    last: Option<StandbyReport>,
    /// When its task last heard from it (the standby's `heard`, shared while busy).
    heard: Option<Arc<Mutex<Instant>>>,
    /// Said to be silent (shown down) since its task stopped hearing from it.
    silent: bool,
}

impl<N: NodeApi> Slot<N> {
    fn new(target: Target, max_backoff: Duration) -> Self {
        Slot {
            name: target.name.clone(),
            conninfo: target.conninfo.clone(),
            standby: Some(Box::new(Standby::new(target, max_backoff))),
            task: None,
            member: false,
            last: None,
            heard: None,
            silent: false,
        }
    }

    fn host(&self) -> Option<HostSpec> {
        self.conninfo.hosts().into_iter().next()
    }

    fn busy(&self) -> bool {
        self.task.is_some()
    }

    /// Connected, as far as the cycle knows (a busy standby was when its task started).
    fn up(&self) -> bool {
        match &self.standby {
            Some(standby) => standby.node.is_some(),
            None => self.task.is_some(),
        }
    }
}

impl<N: NodeApi> Drop for Slot<N> {
    /// A standby no longer in the topology (or replaced) takes its task with it.
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// The seq of the primary's last change-feed answer, and which node gave it.
#[derive(Debug, Clone)]
struct PrimaryCursor {
    label: String,
    system_identifier: String,
    seq: i64,
}

/// The connections and what the loop remembers between cycles.
pub struct Syncer<N: NodeApi = Node> {
    cfg: Arc<Config>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
    /// The primary's connection string this cycle (from the topology).
    primary_info: Option<ConnInfo>,
    primary: Option<N>,
    /// Where the primary's WAL goes from: its timeline (extension 0.4 and later).
    primary_source: Option<WalSource>,
    /// The primary's addresses, to recognise it as a standby's WAL sender.
    primary_addrs: Vec<IpAddr>,
    /// The primary's feed cursor: a new session to the same node goes on from it.
    primary_cursor: Option<PrimaryCursor>,
    /// The host the primary side last connected to, to count retargets.
    last_primary_host: Option<String>,
    /// Patroni's leader at the last look.
    leader: Option<String>,
    /// The REST API client: it asks the Patroni URL that answered last first, so a dead
    /// member costs its timeout once, not every cycle.
    patroni: patroni::Client,
    standbys: Vec<Slot<N>>,
    /// Patroni members left out, as last logged.
    excluded: Vec<(String, String)>,
    /// Whether "CCM is disabled" was already logged (it is logged once per episode).
    disabled_logged: bool,
    /// The change feeds' mirror (feed.rs) and this agent's subscriber id on every node.
    mirror: Arc<Mutex<Mirror>>,
    subscriber: i64,
    /// Use the change feed where every node has it (config change_feed; not for sync --once).
    feed_wanted: bool,
    /// Wait for every standby's task to end (sync --once) instead of going on without it.
    patient: bool,
    /// "does not serve the change feed" was logged for this catalog and library version.
    feed_absent_logged: Option<String>,
    /// The primary's hot set at the last cycle, whichever exchange counted it.
    last_hot_set: u64,
    /// One active agent per cluster (election.rs); None for `sync --once`.
    election: Option<Election>,
    /// Who this agent is in the primary's ccm_candidates: its host and process id.
    agent_name: String,
    /// Writing the candidate report failed, and that was logged (once per episode).
    report_failing: bool,
    /// The page-cache tier (oscache.rs), and the primary (label, system identifier) whose
    /// page cache it walks.
    os: Arc<Mutex<OsTier>>,
    os_primary: Option<(String, String)>,
    /// Reading the primary's page cache failed, and that was logged (once per episode).
    os_failing: bool,
}

impl<N: NodeApi> Syncer<N> {
    pub fn new(cfg: Arc<Config>, metrics: Arc<Metrics>, cancel: CancellationToken) -> Self {
        let cfg_change_feed = cfg.change_feed;
        let cfg_os_pause = cfg.os_cache_pause;
        Syncer {
            cfg,
            metrics,
            cancel,
            primary_info: None,
            primary: None,
            primary_source: None,
            primary_addrs: Vec::new(),
            primary_cursor: None,
            last_primary_host: None,
            leader: None,
            patroni: patroni::Client::new(),
            standbys: Vec::new(),
            excluded: Vec::new(),
            disabled_logged: false,
            mirror: Arc::new(Mutex::new(Mirror::default())),
            subscriber: feed::new_subscriber(),
            feed_wanted: cfg_change_feed,
            patient: false,
            feed_absent_logged: None,
            last_hot_set: 0,
            election: Some(Election::default()),
            agent_name: agent_name(),
            report_failing: false,
            os: Arc::new(Mutex::new(OsTier::new(cfg_os_pause))),
            os_primary: None,
            os_failing: false,
        }
    }

    /// The configuration it runs with.
    #[cfg(test)]
    pub fn config(&self) -> Arc<Config> {
        self.cfg.clone()
    }

    fn options(&self) -> ConnectOptions {
        ConnectOptions {
            connect_timeout: self.cfg.connect_timeout,
            statement_timeout: self.cfg.statement_timeout,
        }
    }

    fn mirror(&self) -> std::sync::MutexGuard<'_, Mirror> {
        self.mirror
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn primary(&mut self) -> &mut N {
        self.primary.as_mut().expect("connected by ensure_primary")
    }

    fn primary_label(&self) -> String {
        match (&self.primary, &self.last_primary_host) {
            (Some(node), _) => node.label(),
            (None, Some(host)) => host.clone(),
            (None, None) => "?".to_string(),
        }
    }

    /// The idle standby of slot `i` (every slot of a ready standby is idle between phases).
    fn standby(&mut self, i: usize) -> &mut Standby<N> {
        self.standbys[i].standby.as_mut().expect("an idle standby")
    }

    /// Adds what each live session carried since the last count to ccm_agent_bytes_total.
    fn count_wire(&mut self) {
        count_node_wire(&self.metrics, "primary", self.primary.as_mut());
        for slot in &mut self.standbys {
            if let Some(standby) = slot.standby.as_mut() {
                standby.count_wire(&self.metrics);
            }
        }
    }

    fn drop_primary(&mut self) {
        let label = self.primary_label();
        if let Some(election) = self.election.as_mut() {
            if let Some(event) = election.session_lost() {
                event.log(&label);
            }
            election.publish(&self.metrics);
        }
        count_node_wire(&self.metrics, "primary", self.primary.as_mut());
        if self.primary.take().is_some() {
            self.metrics.set_node_up(Side::Primary, false);
        }
        self.primary_source = None;
        self.primary_addrs.clear();
    }

    /// Closes every standby's session (a busy one's task ends with it).
    fn drop_standbys(&mut self) {
        for slot in &mut self.standbys {
            if let Some(task) = slot.task.take() {
                task.abort();
                self.metrics.set_standby_up(&slot.name, false);
                let target = Target {
                    name: slot.name.clone(),
                    conninfo: slot.conninfo.clone(),
                };
                slot.standby = Some(Box::new(Standby::new(target, self.cfg.max_backoff)));
            }
            if let Some(standby) = slot.standby.as_mut() {
                standby.drop_session(&self.metrics);
            }
            slot.member = false;
        }
        self.note_standbys_up();
    }

    /// ccm_agent_node_up for the standby side: any standby connected.
    fn note_standbys_up(&self) {
        let any = self.standbys.iter().any(Slot::up);
        self.metrics.set_node_up(Side::Standby, any);
    }

    // ---- (0) topology -----------------------------------------------------------------

    /// Reads the topology and lines the standbys up in its order, keeping the sessions (and
    /// the tasks) of those that stay. A changed leader drops the primary's session.
    async fn refresh_topology(&mut self) -> Result<(), CycleError> {
        let discovered = tokio::select! {
            _ = self.cancel.cancelled() => return Err(CycleError::Cancelled),
            t = topology::discover(&self.cfg, &self.patroni, self.cfg.connect_timeout, &self.cancel) => t,
        };
        let topology = match discovered {
            Ok(topology) => topology,
            Err(e) => {
                // Without Patroni's word on who leads, nothing is warmed: the sessions are
                // closed (and shown down) rather than kept on a topology that may be gone,
                // e.g. while the agent itself is cut off from the cluster. The feeds' cursors
                // stay: the same nodes go on where they were once the topology is back.
                self.drop_primary();
                self.drop_standbys();
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
                    let mut slot = old.remove(pos);
                    if slot.conninfo.hosts() != target.conninfo.hosts() {
                        // Another host under the same name: a new standby, its task gone.
                        self.metrics.set_standby_up(&slot.name, false);
                        slot = Slot::new(target, self.cfg.max_backoff);
                    } else {
                        if let Some(standby) = slot.standby.as_mut() {
                            standby.conninfo = target.conninfo.clone();
                        }
                        slot.conninfo = target.conninfo;
                    }
                    self.standbys.push(slot);
                }
                None => {
                    if !self.standbys.is_empty() || self.leader.is_some() {
                        debug!(standby = %target.name, "a standby to warm");
                    }
                    self.standbys.push(Slot::new(target, self.cfg.max_backoff));
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
        self.note_standbys_up();
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
        let mut node = N::resolve(&info, Side::Primary, self.options(), &self.cancel)
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
        // The same node as before goes on from its feed's last answer.
        let after = self
            .primary_cursor
            .as_ref()
            .filter(|c| c.label == label && c.system_identifier == node.facts().system_identifier)
            .map_or(0, |c| c.seq);
        node.set_feed_after(after);
        info!(
            side = "primary",
            host = %label,
            system_identifier = %node.facts().system_identifier,
            server_version = %node.facts().server_version,
            pg_ccm = node.facts().extension_version.as_deref().unwrap_or("?"),
            pg_ccm_library = node.facts().library_version.as_deref().unwrap_or("?"),
            shared_buffers_blocks = node.facts().shared_buffers,
            timeline = source.timeline,
            "connected to the primary"
        );
        if let Some(warning) = node.catalog_behind() {
            warn!("{warning}");
        }
        let this = (label.clone(), node.facts().system_identifier.clone());
        if self.os_primary.as_ref().is_some_and(|p| *p != this) {
            os_tier(&self.os).reset();
        }
        self.os_primary = Some(this);
        self.primary_addrs = addresses(node.host()).await;
        self.primary_source = Some(source);
        self.metrics.set_node_up(Side::Primary, true);
        self.primary = Some(node);
        Ok(())
    }

    /// The election (election.rs), `run` only: Ok while this agent holds the cluster's lock
    /// on its primary session (a new session tries first thing). Standing by, its standby
    /// sessions are closed (their tasks with them) and the cycle ends here, before any call
    /// that would reset a node's change feed.
    async fn elect(&mut self) -> Result<(), CycleError> {
        let (Some(election), Some(primary)) = (self.election.as_mut(), self.primary.as_mut())
        else {
            return Ok(());
        };
        let result = election.contest(primary, &self.metrics).await;
        if self.call(Who::Primary, Stage::Connect, result)? {
            return Ok(());
        }
        self.drop_standbys();
        let holder = election::describe(self.election.as_ref().and_then(Election::holder));
        Err(CycleError::StandingBy { holder })
    }

    /// Turns a primary call's error into a cycle error, dropping the session if it is broken.
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
                if error.breaks_connection() || self.primary.as_ref().is_some_and(|n| n.is_closed())
                {
                    self.drop_primary();
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
                .filter_map(|s| s.standby.as_ref()?.node.as_ref())
                .any(|n| {
                    u64::try_from(n.facts().shared_buffers).unwrap_or(0) < hot
                        || !n.has_change_feed()
                });
        }
        let facts = primary.facts();
        let catalog = facts.extension_version.as_deref().unwrap_or("?");
        let library = facts.library_version.as_deref().unwrap_or("?");
        let seen = format!("{catalog} {library}");
        if self.feed_absent_logged.as_deref() != Some(seen.as_str()) {
            // Every catalog the agent calls has the feed (node::OLDEST_SUPPORTED): only a
            // 0.7.0 library under the 0.5.0 catalog lacks it.
            info!(
                "the pg_ccm library {library} on {} does not serve the change feed of the \
                 extension's catalog {catalog}; using the full filter exchange until ALTER \
                 EXTENSION pg_ccm UPDATE",
                primary.label()
            );
            self.feed_absent_logged = Some(seen);
        }
        false
    }

    // ---- the standbys' tasks ----------------------------------------------------------

    /// What the standbys' tasks share this cycle.
    fn shared(&self, progress: Option<&ProgressBar>, started: Instant) -> Shared {
        let endpoint = |host: &HostSpec| Endpoint::new(host.name(), host.port);
        let primary = self.primary.as_ref();
        let mut members: Vec<Endpoint> = primary.iter().map(|p| endpoint(p.host())).collect();
        if let Some(first) = members.first_mut() {
            first.addrs = self.primary_addrs.clone();
        }
        let mut others = Vec::new();
        for slot in &self.standbys {
            if let Some(host) = slot.host() {
                if slot.member {
                    members.push(endpoint(&host));
                } else {
                    others.push(endpoint(&host));
                }
            }
        }
        Shared {
            cfg: self.cfg.clone(),
            metrics: self.metrics.clone(),
            cancel: self.cancel.clone(),
            subscriber: self.subscriber,
            mirror: self.mirror.clone(),
            primary: PrimaryView {
                label: self.primary_label(),
                host: primary.map(|p| p.host().clone()),
                system_identifier: primary
                    .map(|p| p.facts().system_identifier.clone())
                    .unwrap_or_default(),
                timeline: self.primary_source.as_ref().and_then(|s| s.timeline),
            },
            members,
            others,
            progress: progress.cloned(),
            fill_until: started + self.cfg.interval,
            colder_feed: self.colder_feed(),
            os: self.os_wanted().then(|| self.os.clone()),
        }
    }

    /// Starts a task for each idle standby of `which` (None: every idle one).
    fn spawn(
        &mut self,
        which: Option<Vec<(usize, Option<Vec<u8>>)>>,
        shared: &Arc<Shared>,
        feed: bool,
    ) -> Vec<usize> {
        let mut started = Vec::new();
        let work: Vec<(usize, Option<Option<Vec<u8>>>)> = match which {
            None => (0..self.standbys.len()).map(|i| (i, None)).collect(),
            Some(lists) => lists.into_iter().map(|(i, l)| (i, Some(l))).collect(),
        };
        for (i, warm) in work {
            let slot = &mut self.standbys[i];
            let Some(standby) = slot.standby.take() else {
                continue;
            };
            slot.member = standby.verified && standby.node.is_some();
            standby.heard_now();
            slot.heard = Some(standby.heard.clone());
            let shared = shared.clone();
            slot.task = Some(tokio::spawn(async move {
                match warm {
                    None => Finished::Prepared(standby::prepare_task(standby, shared, feed).await),
                    Some(list) => Finished::Warmed(standby::warm_task(standby, shared, list).await),
                }
            }));
            started.push(i);
        }
        started
    }

    /// Waits for the tasks of slots `started` until they have ended or `deadline` has passed
    /// (None: until they have ended), and takes back the standbys of those that ended. Those
    /// still running stay busy: the cycle goes on without them.
    async fn gather(
        &mut self,
        started: Vec<usize>,
        deadline: Option<Instant>,
    ) -> Vec<(usize, Finished<N>)> {
        let mut ended = Vec::new();
        for i in started {
            let Some(mut task) = self.standbys[i].task.take() else {
                continue;
            };
            let joined = match deadline {
                None => Some((&mut task).await),
                Some(at) if Instant::now() < at => {
                    tokio::time::timeout_at(at.into(), &mut task).await.ok()
                }
                Some(_) if task.is_finished() => Some((&mut task).await),
                Some(_) => None,
            };
            match joined {
                None => self.standbys[i].task = Some(task),
                Some(Ok(finished)) => ended.push((i, finished)),
                Some(Err(error)) => {
                    // Aborted (never while the slot has it) or panicked: start it afresh.
                    let slot = &mut self.standbys[i];
                    error!(standby = %slot.name, "the task of the standby {} ended: {error}", slot.name);
                    let target = Target {
                        name: slot.name.clone(),
                        conninfo: slot.conninfo.clone(),
                    };
                    slot.standby = Some(Box::new(Standby::new(target, self.cfg.max_backoff)));
                }
            }
        }
        ended
    }

    /// Puts a task's standby back in its slot and counts what it did in `report`.
    fn take_back<T>(
        &mut self,
        i: usize,
        done: Done<T, N>,
        report: &mut CycleReport,
    ) -> Result<T, CycleError> {
        let slot = &mut self.standbys[i];
        slot.member = done.standby.verified && done.standby.node.is_some();
        slot.heard = None;
        if std::mem::take(&mut slot.silent) && done.standby.node.is_some() {
            self.metrics.set_standby_up(&slot.name, true);
        }
        slot.standby = Some(done.standby);
        if let Some(last) = done.report.standbys.last() {
            slot.last = Some(last.clone());
        }
        report.absorb(done.report);
        done.result
    }

    /// The standbys whose task ran past an earlier cycle and has ended since: taken back,
    /// what they did counted in this cycle, their trouble (if any) their own.
    async fn collect_late(&mut self, report: &mut CycleReport) {
        let finished: Vec<usize> = (0..self.standbys.len())
            .filter(|&i| {
                self.standbys[i]
                    .task
                    .as_ref()
                    .is_some_and(|t| t.is_finished())
            })
            .collect();
        for (i, finished) in self.gather(finished, None).await {
            let (result, warmed) = match finished {
                Finished::Prepared(done) => (self.take_back(i, done, report).map(|_| ()), false),
                Finished::Warmed(done) => (self.take_back(i, done, report), true),
            };
            match result {
                Ok(()) if warmed => self.standby(i).fine(),
                Ok(()) => {}
                Err(CycleError::Cancelled | CycleError::Disabled { .. }) => {}
                Err(e) => self.standby_trouble(i, &e),
            }
        }
        self.note_standbys_up();
    }

    /// At shutdown: gives the standbys' tasks, which the cancel has reached, a moment to
    /// cancel their statements on the standbys (as a call of the cycle itself would) before
    /// they are dropped.
    pub async fn finish_tasks(&mut self) {
        let busy: Vec<usize> = (0..self.standbys.len())
            .filter(|&i| self.standbys[i].busy())
            .collect();
        let deadline = Instant::now() + SHUTDOWN_WAIT;
        self.gather(busy, Some(deadline)).await;
    }

    /// Busy standbys that have not answered for SILENT_AFTER (or three intervals, if longer)
    /// are shown down and said to be silent, once; their task goes on until its deadlines end
    /// it or the standby answers.
    fn note_silent(&mut self) {
        let after = SILENT_AFTER.max(self.cfg.interval * 3);
        for slot in &mut self.standbys {
            let Some(heard) = slot.heard.as_ref().filter(|_| slot.task.is_some()) else {
                continue;
            };
            let quiet = heard.lock().unwrap_or_else(|p| p.into_inner()).elapsed();
            if quiet >= after && !slot.silent {
                slot.silent = true;
                self.metrics.set_standby_up(&slot.name, false);
                warn!(
                    standby = %slot.name,
                    "the standby {} has not answered for {}; warming the others without it until it does",
                    slot.name,
                    format_duration(Duration::from_secs(quiet.as_secs()))
                );
            }
        }
    }

    /// A standby's trouble while the cycle goes on with others.
    fn standby_trouble(&mut self, i: usize, error: &CycleError) {
        let (cfg, metrics) = (self.cfg.clone(), self.metrics.clone());
        self.standby(i).trouble(&cfg, &metrics, error);
    }

    // ---- the cycle --------------------------------------------------------------------

    /// Each candidate's state and, where it still says something, its share of the hot set
    /// when it last reported. A standby that keeps its session but waits out a backoff (its
    /// last call failed) is down too. At most the first REPORT_MAX_CANDIDATES, as the view
    /// keeps.
    fn candidate_rows(&self) -> Vec<CandidateRow> {
        let now = Instant::now();
        self.standbys
            .iter()
            .take(REPORT_MAX_CANDIDATES)
            .map(|slot| {
                let paused = slot.last.as_ref().is_some_and(|r| r.replay_paused);
                let backing_off = slot
                    .standby
                    .as_ref()
                    .and_then(|s| s.retry_at)
                    .is_some_and(|at| at > now);
                let state = if slot.silent {
                    CandidateState::Silent
                } else if !slot.up() || backing_off {
                    CandidateState::Down
                } else if paused {
                    CandidateState::Paused
                } else if slot.busy() {
                    CandidateState::Warming
                } else {
                    CandidateState::Up
                };
                CandidateRow::new(&slot.name, state, slot.last.as_ref())
            })
            .collect()
    }

    /// After a cycle, the run loop's: writes the candidates' rows to the primary's
    /// ccm_candidates, while this agent holds the cluster's lock (a standing-by agent's or
    /// `sync --once`'s view is not the cluster's), also after a cycle that failed because no
    /// standby could be warmed, when it matters most. The next report is due after `next_in`
    /// (the interval's rest, or the backoff) and a cycle; the view calls the report stale
    /// when three times that has passed. Under a catalog before 0.8.0 nothing is sent. A
    /// failure is logged once per episode and never stops warming.
    pub async fn report_candidates(&mut self, next_in: Duration) {
        if !self.election.as_ref().is_some_and(Election::is_active) {
            return;
        }
        let rows = self.candidate_rows();
        let due = next_in + self.cfg.interval.max(PREPARE_WAIT_MIN);
        let due_ms = i64::try_from(due.as_millis()).unwrap_or(i64::MAX);
        let Some(primary) = self.primary.as_mut() else {
            return;
        };
        let result = primary
            .report_candidates(&self.agent_name, due_ms.clamp(1, REPORT_MAX_DUE_MS), &rows)
            .await;
        match result {
            Ok(_) => {
                if std::mem::take(&mut self.report_failing) {
                    info!("the candidate report reaches the primary's ccm_candidates again");
                }
            }
            Err(NodeError::Cancelled) => {}
            Err(error) => {
                if error.breaks_connection() {
                    self.drop_primary();
                }
                if std::mem::replace(&mut self.report_failing, true) {
                    debug!("writing the candidate report failed: {error}");
                } else {
                    warn!(
                        "writing the candidate report to the primary's ccm_candidates failed: \
                         {error}; warming goes on"
                    );
                }
            }
        }
    }

    /// One cycle; `progress` (sync --once) counts blocks processed.
    pub async fn cycle(
        &mut self,
        progress: Option<&ProgressBar>,
    ) -> Result<CycleReport, CycleError> {
        self.count_wire();
        self.refresh_topology().await?;
        self.ensure_primary().await?;
        self.elect().await?;
        let started = Instant::now();
        let mut report = CycleReport::default();
        self.collect_late(&mut report).await;
        self.note_silent();

        // (1) What each standby already caches, each in a task of its own.
        let feed = self.feed_mode();
        let shared = Arc::new(self.shared(progress, started));
        let tasks = self.spawn(None, &shared, feed);
        let wait = (!self.patient).then(|| started + self.cfg.interval.max(PREPARE_WAIT_MIN));
        let mut ready: Vec<(usize, Ready)> = Vec::new();
        let mut troubles: Vec<(usize, CycleError)> = Vec::new();
        for (i, finished) in self.gather(tasks, wait).await {
            let Finished::Prepared(done) = finished else {
                continue;
            };
            match self.take_back(i, done, &mut report) {
                Ok(Ready::Pass) => {}
                Ok(r) => ready.push((i, r)),
                Err(CycleError::Cancelled) => return Err(CycleError::Cancelled),
                Err(e @ CycleError::Disabled { .. }) => return Err(e),
                Err(e) => troubles.push((i, e)),
            }
        }
        self.note_standbys_up();
        if ready.is_empty() {
            if report.interrupted() || self.standbys.iter().any(Slot::busy) {
                // A standby still at work is no fault of the cycle.
                for (i, e) in troubles {
                    self.standby_trouble(i, &e);
                }
                report.close(&self.metrics, started.elapsed(), None);
                return Ok(report);
            }
            // Nothing to warm: the first standby's trouble is the cycle's, and the loop backs
            // off as a whole (the standbys' own backoffs start afresh).
            for slot in &mut self.standbys {
                if let Some(standby) = slot.standby.as_mut() {
                    if standby.node.is_none() {
                        standby.retry_at = None;
                    }
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
            self.hot_lists(&ready, &mut report).await?
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

        // The page cache's next slice, if one is due, for the warm tasks to read after the hot
        // set (oscache.rs).
        self.os_slice(&ready).await?;

        // (3), (4) Every standby its batches, each in its task; with the colder feed, (5) too.
        let warm: Vec<(usize, Option<Vec<u8>>)> = if feed {
            ready.iter().map(|(i, _)| (*i, None)).collect()
        } else {
            ready
                .iter()
                .zip(lists)
                .map(|((i, _), list)| (*i, Some(list)))
                .collect()
        };
        let tasks = self.spawn(Some(warm), &shared, feed);
        let wait = (!self.patient)
            .then(|| (started + self.cfg.interval).max(Instant::now() + self.cfg.interval / 2));
        let mut warmed = Vec::new();
        for (i, finished) in self.gather(tasks, wait).await {
            let Finished::Warmed(done) = finished else {
                continue;
            };
            match self.take_back(i, done, &mut report) {
                Ok(()) => {
                    self.standby(i).fine();
                    warmed.push(i);
                }
                Err(
                    e @ (CycleError::Cancelled
                    | CycleError::Decode(_)
                    | CycleError::Disabled { .. }),
                ) => return Err(e),
                Err(e) => self.standby_trouble(i, &e),
            }
        }
        self.note_standbys_up();
        // (5) Room left, without the colder feed: colder blocks from a scan of the primary
        // for the standbys that loaded their hot blocks, in what is left of the interval, so
        // that the next cycle's hot blocks never wait for them.
        if self.cfg.fill_room && !shared.colder_feed {
            self.fill_with_filters(&shared, &ready, &warmed, feed, &mut report)
                .await?;
        }
        // The least covered standby, those still at work included (as they last reported).
        let lowest = self
            .standbys
            .iter()
            .filter(|s| s.busy())
            .filter_map(|s| s.last.as_ref())
            .map(StandbyReport::coverage)
            .fold(report.coverage(), f64::min);
        self.last_hot_set = report.hot_buffers;
        report.close(&self.metrics, started.elapsed(), Some(lowest));
        Ok(report)
    }

    /// Whether this cycle has the page-cache tier: configured, `run` (not sync --once), and
    /// the primary has extension 0.9.0.
    fn os_wanted(&self) -> bool {
        self.cfg.os_cache
            && self.election.is_some()
            && self.primary.as_ref().is_some_and(|p| p.has_os_cache())
    }

    /// Reads the next slice of the primary's page cache when the tier wants one (every
    /// standby of `ready` has read what it was given, and no pause), splits it into batches
    /// and queues them for those standbys; an idle standby not among them loses its queue.
    /// A failure is logged once per episode and never stops the cycle.
    async fn os_slice(&mut self, ready: &[(usize, Ready)]) -> Result<(), CycleError> {
        if !self.os_wanted() {
            return Ok(());
        }
        // Only those that can read it: a standby without extension 0.9.0 would hold its queue.
        let up: Vec<String> = ready
            .iter()
            .map(|(i, _)| &self.standbys[*i])
            .filter(|slot| {
                slot.standby
                    .as_ref()
                    .and_then(|s| s.node.as_ref())
                    .is_some_and(|n| n.has_os_cache())
            })
            .map(|slot| slot.name.clone())
            .collect();
        let up: Vec<&str> = up.iter().map(String::as_str).collect();
        let after = {
            let mut tier = os_tier(&self.os);
            for slot in self.standbys.iter().filter(|s| !s.busy()) {
                if !up.contains(&slot.name.as_str()) {
                    tier.drop_queue(&slot.name);
                }
            }
            tier.wants_slice(Instant::now(), &up)
        };
        let Some(after) = after else {
            return Ok(());
        };
        let result = self
            .primary()
            .os_cached_blocks(after, oscache::SLICE_BLOCKS, oscache::SLICE_FILES)
            .await;
        let answer = match result {
            // In recovery (demoted): the next cycle's checks find out.
            Ok((true, _)) => return Ok(()),
            Ok((false, answer)) => answer,
            Err(NodeError::Cancelled) => return Err(CycleError::Cancelled),
            Err(error) => {
                if error.breaks_connection() {
                    self.drop_primary();
                }
                if std::mem::replace(&mut self.os_failing, true) {
                    debug!("reading the primary's page cache failed: {error}");
                } else {
                    warn!(
                        "reading the primary's page cache (ccm_os_cached_blocks) failed: \
                         {error}; the shared_buffers tier goes on"
                    );
                }
                return Ok(());
            }
        };
        if std::mem::take(&mut self.os_failing) {
            info!("reading the primary's page cache works again");
        }
        let batches = match answer.blocks {
            0 => Vec::new(),
            _ => {
                match BlockList::decode_bounded(&answer.list, oscache::SLICE_BLOCKS as u64) {
                    Ok(list) => list.split_in_file_order(oscache::BATCH_BLOCKS),
                    Err(error) => {
                        warn!("the primary's page cache (ccm_os_cached_blocks) sent a list the agent \
                           refuses: {error}; the shared_buffers tier goes on");
                        return Ok(());
                    }
                }
            }
        };
        let mut tier = os_tier(&self.os);
        if tier.in_play() && !answer.in_play {
            info!(
                "the primary {} reads relation files with direct I/O (debug_io_direct): its \
                 page cache holds no relation data, and only shared_buffers is warmed",
                self.primary_label()
            );
        }
        tier.add_slice(&answer, batches, &up);
        if answer.complete {
            if let Some(blocks) = tier.primary_blocks() {
                self.metrics.os_cache_primary(blocks);
            }
        }
        Ok(())
    }

    /// Step (5) with a standby's filter and a scan of the primary (the filter exchange, or a
    /// feed without colder blocks), standby after standby: the primary has one session.
    async fn fill_with_filters(
        &mut self,
        shared: &Shared,
        ready: &[(usize, Ready)],
        warmed: &[usize],
        feed: bool,
        report: &mut CycleReport,
    ) -> Result<(), CycleError> {
        for (i, r) in ready {
            if !warmed.contains(i) {
                continue;
            }
            if Instant::now() >= shared.fill_until {
                break;
            }
            let fetched;
            let filter = if feed {
                match self.standby(*i).fill_filter(shared, report).await {
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
                match r {
                    Ready::Filter(filter) => filter,
                    _ => continue,
                }
            };
            let Some(batches) = self.fill_batches(*i, filter, report).await? else {
                continue;
            };
            let loaded = self
                .standby(*i)
                .load(
                    shared,
                    &batches,
                    Tier::Fill,
                    Some(shared.fill_until),
                    report,
                )
                .await;
            match loaded {
                Ok(_) => {
                    // A fill that loaded nothing (its blocks all skipped or cached by then)
                    // would be asked for again every cycle: wait as after an empty one.
                    let name = self.standbys[*i].name.clone();
                    if report
                        .standbys
                        .iter()
                        .any(|r| r.name == name && r.filled == 0)
                    {
                        self.standby(*i).fill_idle_until = Some(Instant::now() + FILL_RECHECK);
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
        Ok(())
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
            each: troubles.into_iter().map(|(_, e)| e).collect(),
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
                failures: Vec::new(),
            },
        }
    }

    /// Step (2): the lists, in the order of `ready`, from one scan when the extension can.
    async fn hot_lists(
        &mut self,
        ready: &[(usize, Ready)],
        report: &mut CycleReport,
    ) -> Result<Vec<Vec<u8>>, CycleError> {
        let limits: Vec<i64> = ready
            .iter()
            .map(|(i, _)| {
                self.standbys[*i]
                    .standby
                    .as_ref()
                    .map_or(1, |s| s.buffers())
            })
            .collect();
        let filters: Vec<&[u8]> = ready
            .iter()
            .map(|(_, r)| match r {
                Ready::Filter(f) => f.as_slice(),
                _ => &[],
            })
            .collect();
        let mut lists = Vec::with_capacity(ready.len());
        if ready.len() > 1 {
            let filters: Vec<Option<&[u8]>> = filters.iter().map(|f| Some(*f)).collect();
            let result = self.primary().hot_blocks_each(&filters, &limits).await;
            let (in_recovery, each) = self.call(Who::Primary, Stage::HotBlocks, result)?;
            if in_recovery {
                return Err(self.primary_demoted());
            }
            lists = each;
        } else {
            for (filter, limit) in filters.iter().zip(&limits) {
                let result = self.primary().hot_blocks(filter, *limit).await;
                let (in_recovery, list) = self.call(Who::Primary, Stage::HotBlocks, result)?;
                if in_recovery {
                    return Err(self.primary_demoted());
                }
                lists.push(list);
            }
        }
        let bytes: usize = lists.iter().map(Vec::len).sum();
        report.note(&self.metrics, Event::Listed { bytes });
        Ok(lists)
    }

    /// Step (2) in feed mode: the primary's change feed, applied to the mirror.
    async fn primary_feed(&mut self, report: &mut CycleReport) -> Result<(), CycleError> {
        let budget = feed::sweep_budget(self.primary().facts().shared_buffers);
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
        let names: Vec<String> = self.standbys.iter().map(|s| s.name.clone()).collect();
        let hot = {
            let mut mirror = self.mirror();
            mirror.apply_primary(&answer);
            mirror.retain_standbys(&names);
            mirror.hot_len() as u64
        };
        let node = self.primary();
        node.set_feed_after(answer.seq);
        let cursor = PrimaryCursor {
            label: node.label(),
            system_identifier: node.facts().system_identifier.clone(),
            seq: answer.seq,
        };
        self.primary_cursor = Some(cursor);
        report.note(
            &self.metrics,
            Event::PrimaryFed {
                answer: &answer,
                hot,
            },
        );
        Ok(())
    }

    /// Whether the primary's feed reports its colder blocks too, so that fill_room fills from
    /// the mirror (extension 0.6.0) instead of a standby filter and a scan of the primary.
    fn colder_feed(&self) -> bool {
        self.cfg.fill_room && self.primary.as_ref().is_some_and(|n| n.has_colder_feed())
    }

    /// Step (5) for standby `i`, with fill_room: when this cycle loaded its whole list of hot
    /// blocks (no conflict or storage error cut it short) and it still has unused buffers,
    /// the primary's cached blocks it lacks below the hot set's threshold (usage count from
    /// the threshold down to 1; of the primary's as many hottest blocks as the standby has
    /// buffers), hottest first, as many as its unused buffers take less a reserve, at most
    /// FILL_MAX_BATCHES batches (fewer if the cycle's interval runs out first). They go only
    /// into buffers nobody uses, so nothing the standby caches is evicted for them, and they
    /// keep their low usage counts, so the standby's own reads and replay evict them before
    /// any hot block. None when there is nothing to fill. A failure of the primary fails the
    /// cycle, as in step (2).
    async fn fill_batches(
        &mut self,
        i: usize,
        filter: &[u8],
        report: &mut CycleReport,
    ) -> Result<Option<Vec<Vec<u8>>>, CycleError> {
        let standby = self.standby(i);
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
        let buffers = u64::try_from(node.facts().shared_buffers).unwrap_or(0);
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
            self.standby(i).fill_idle_until = Some(Instant::now() + FILL_RECHECK);
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

impl<N: NodeApi> Syncer<N> {
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
        if cfg.statement_timeout != self.cfg.statement_timeout
            || cfg.connect_timeout != self.cfg.connect_timeout
        {
            // Both are set when a session is made (statement_timeout on the server too): new
            // sessions take them. The feeds' cursors stay, so nothing is swept again.
            info!("statement_timeout or connect_timeout changed; reconnecting to every node");
            self.drop_primary();
            self.drop_standbys();
        }
        if cfg.max_backoff != self.cfg.max_backoff {
            for slot in &mut self.standbys {
                if let Some(standby) = slot.standby.as_mut() {
                    standby.set_max_backoff(cfg.max_backoff);
                }
            }
        }
        if !self.patient {
            self.feed_wanted = cfg.change_feed;
        }
        os_tier(&self.os).set_pause(cfg.os_cache_pause);
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
    let mut syncer = Syncer::<Node>::new(cfg.clone(), metrics.clone(), cancel.clone());
    metrics.set_stale_after(stale_after(&cfg));
    let mut backoff = Backoff::new(cfg.max_backoff);
    let mut episode = Episode::default();
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
            episode.retell();
        }
        let started = Instant::now();
        let wait = match syncer.cycle(None).await {
            Ok(report) => {
                backoff.reset();
                if let Some(ended) = episode.end(Instant::now()) {
                    info!("syncing again, after {ended}");
                }
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
            Err(e @ CycleError::StandingBy { .. }) => {
                // Not a fault: another agent warms the cluster (logged once by the election).
                // Try for the lock again next interval.
                backoff.reset();
                notify::notify(&format!("STATUS=standing by: {e}"));
                cfg.interval
            }
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
                let (pace, cap) = (e.pace(), e.backoff_cap(&cfg));
                let delay = retry::next_delay(&mut backoff, pace, cap);
                let retry = retry::when(pace, delay, cap);
                match &e {
                    _ if !episode.failed(e.kind(), Instant::now()) => debug!(
                        kind = %e.kind(),
                        attempt = backoff.attempts(),
                        "{e}; retrying in {retry}"
                    ),
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
        syncer.report_candidates(wait).await;
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
            // A reload (a new interval, a new host) applies at once.
            _ = config.changed() => {}
        }
    }
    syncer.finish_tasks().await;
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
    /// The `ccm-agent run` that holds the cluster's lock (pid, application_name, client), if
    /// one does: it keeps warming after this.
    pub active_agent: Option<String>,
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
        if let Some(agent) = &self.active_agent {
            notes.push_str(&format!(
                "; a ccm-agent run is active on this cluster ({agent})"
            ));
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
    let mut syncer = Syncer::<Node>::new(cfg, metrics, cancel.clone());
    // One whole warm-up is the filter exchange's job: no feed state to build first.
    syncer.feed_wanted = false;
    // It resets no node's change feed, so it takes no part in the election (election.rs)
    // and runs beside an active agent; it only says so.
    syncer.election = None;
    // And every standby's share of each cycle is waited for.
    syncer.patient = true;
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
    if let Some(primary) = syncer.primary.as_mut() {
        summary.active_agent = election::lookup(primary)
            .await
            .flatten()
            .map(|h| h.to_string());
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::PrewarmResult;
    use crate::standby::{in_load_order, Flow};

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
        // A connection refused is fast; a certificate that does not verify is slow.
        let connect = |error| CycleError::Node {
            stage: Stage::Connect,
            side: Side::Standby,
            error,
        };
        let refused = connect(NodeError::Socket {
            host: "h:1".into(),
            error: std::io::ErrorKind::ConnectionRefused.into(),
        });
        assert_eq!(refused.backoff_cap(cfg), RECONNECT_CEILING);
        let unverified = connect(NodeError::Tls {
            host: "h:1".into(),
            reason: "certificate verify failed: self-signed certificate".into(),
        });
        assert_eq!(unverified.backoff_cap(cfg), cfg.max_backoff);
    }

    fn syncer() -> (Syncer, Arc<Metrics>) {
        let cfg = Config::validate(crate::config::RawConfig {
            primary: Some("host=127.0.0.1 port=1 user=u dbname=postgres".into()),
            standby: Some("host=127.0.0.2 port=1 user=u dbname=postgres".into()),
            ..Default::default()
        })
        .unwrap();
        let metrics = Arc::new(Metrics::new());
        let mut syncer: Syncer = Syncer::new(
            Arc::new(cfg.clone()),
            metrics.clone(),
            CancellationToken::new(),
        );
        for target in topology::from_conninfo(&cfg).targets {
            syncer
                .standbys
                .push(Slot::new(target, Duration::from_secs(1)));
        }
        (syncer, metrics)
    }

    /// The test syncer's standby, on its own, and what its tasks would share.
    fn fixture() -> (Box<Standby>, Shared, Arc<Metrics>) {
        let (mut syncer, metrics) = syncer();
        let standby = syncer.standbys[0].standby.take().unwrap();
        let shared = syncer.shared(None, Instant::now());
        (standby, shared, metrics)
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
        let (mut standby, shared, metrics) = fixture();
        let mut report = CycleReport::default();
        let done = PrewarmResult {
            requested: 10,
            loaded: 10,
            ..Default::default()
        };
        let err = standby
            .prewarm_outcome(&shared, 10, Tier::Hot, Ok((false, done)), &mut report)
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
        assert!(standby.node.is_none());
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
        let (mut standby, shared, metrics) = fixture();
        let mut report = report_of_the_standby();
        let done = PrewarmResult {
            requested: 10,
            loaded: 6,
            already_cached: 3,
            skipped: 1,
            replay_lag: Some(0),
        };
        let flow = standby
            .prewarm_outcome(&shared, 10, Tier::Hot, Ok((true, done)), &mut report)
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
        let (mut standby, shared, metrics) = fixture();
        assert_eq!(
            shared.cfg.max_replay_lag,
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
            standby
                .prewarm_outcome(&shared, 4, Tier::Hot, Ok((true, batch(lag))), report)
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
        let (mut standby, shared, metrics) = fixture();
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
        standby
            .prewarm_outcome(&shared, 4, Tier::Hot, Ok((true, hot)), &mut report)
            .unwrap();
        standby
            .prewarm_outcome(&shared, 10, Tier::Fill, Ok((true, cold)), &mut report)
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
        let (mut standby, shared, _) = fixture();
        let mut report = CycleReport::default();
        assert!(matches!(
            standby.prewarm_outcome(
                &shared,
                1,
                Tier::Hot,
                Err(NodeError::Cancelled),
                &mut report
            ),
            Err(CycleError::Cancelled)
        ));
        assert!(matches!(
            standby.prewarm_outcome(
                &shared,
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
        let standing_by = CycleError::StandingBy {
            holder: "pid 7".into(),
        };
        assert_eq!(standing_by.stage(), None, "standing by is no fault");
        assert_eq!(
            standing_by.to_string(),
            "another ccm-agent holds the cluster's lock on the primary (pid 7)"
        );
    }

    #[test]
    fn sync_once_says_which_agent_is_active() {
        let mut s = SyncSummary {
            cycles: 1,
            complete: true,
            ..Default::default()
        };
        assert!(!s.to_text().contains("active"));
        s.active_agent = Some("pid 7, application_name ccm-agent".into());
        assert!(
            s.to_text().ends_with(
                "; a ccm-agent run is active on this cluster (pid 7, application_name ccm-agent)"
            ),
            "{}",
            s.to_text()
        );
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["active_agent"], "pid 7, application_name ccm-agent");
    }
}

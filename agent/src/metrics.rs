//! Prometheus metrics and the small HTTP server that exposes them.
//!
//! prometheus-client keeps every metric in atomics, so the sync task updates them without
//! locks and the HTTP handler encodes a consistent-enough snapshot on each scrape. What a
//! cycle did is counted in one place, `CycleReport::note` (report.rs), which adds each event
//! to the cycle's report and to these metrics together. The server
//! is bare hyper 1 (HTTP/1 only): three GET routes do not justify a web framework's compile
//! time. /healthz says the process serves; /readyz says it does its job: both sides
//! connected and a call answered recently, with a JSON body that says why not. An agent that
//! stands by (another holds the cluster's lock, election.rs) is not ready, and says so.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::node::{Side, WalCacheStatus};

/// Where in a cycle an error happened; the `stage` label of `ccm_agent_cycle_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    Connect,
    Filter,
    HotBlocks,
    Prewarm,
    Safety,
}

impl Stage {
    pub const ALL: [Stage; 5] = [
        Stage::Connect,
        Stage::Filter,
        Stage::HotBlocks,
        Stage::Prewarm,
        Stage::Safety,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Connect => "connect",
            Stage::Filter => "filter",
            Stage::HotBlocks => "hot_blocks",
            Stage::Prewarm => "prewarm",
            Stage::Safety => "safety",
        }
    }
}

type Labels = [(&'static str, &'static str); 1];
type FloatGauge = Gauge<f64, AtomicU64>;

pub struct Metrics {
    registry: Registry,
    pub cycles: Counter,
    cycle_errors: Family<Labels, Counter>,
    pub blocks_sent: Counter,
    pub blocks_loaded: Counter,
    pub blocks_already_cached: Counter,
    pub fill_blocks_loaded: Counter,
    pub blocks_skipped: Counter,
    pub recovery_conflicts: Counter,
    pub replay_lag_pauses: Counter,
    pub prewarm_storage_errors: Counter,
    pub hot_set_blocks: Gauge,
    pub coverage_ratio: FloatGauge,
    pub last_cycle_duration_seconds: FloatGauge,
    pub last_cycle_timestamp_seconds: FloatGauge,
    node_up: Family<Labels, Gauge>,
    retargets: Family<Labels, Counter>,
    pub enabled: Gauge,
    /// 1 while this agent holds its cluster's lock and warms (election.rs).
    active: Gauge,
    resident_memory_bytes: Gauge,
    pub filter_bytes: Gauge,
    pub block_list_bytes: Gauge,
    pub wal_cache_held_blocks: Gauge,
    pub wal_cache_locked_blocks: Gauge,
    wal_cache_slot_hits: Family<SlotLabels, Gauge>,
    wal_cache_slot_misses: Family<SlotLabels, Gauge>,
    /// Slot names with series, so that dropped slots' series can be removed.
    wal_cache_slots: std::sync::Mutex<Vec<String>>,
    build_info: Family<[(&'static str, &'static str); 1], Gauge>,
    standby_up: Family<NodeLabels, Gauge>,
    standby_coverage: Family<NodeLabels, FloatGauge>,
    standby_missing: Family<NodeLabels, Gauge>,
    standby_loaded: Family<NodeLabels, Counter>,
    feed_resets: Family<NodeLabels, Counter>,
    wire_bytes: Family<WireLabels, Counter>,
    standby_priority: Family<NodeLabels, Gauge>,
    os_cache_coverage: Family<NodeLabels, FloatGauge>,
    os_cache_held_bytes: Family<NodeLabels, Gauge>,
    os_cache_read_bytes: Family<NodeLabels, Counter>,
    os_cache_primary_bytes: Gauge,
    os_cache_waiting: Family<NodeLabels, Gauge>,
    /// Standby names with series, so that members that left lose theirs.
    standby_names: std::sync::Mutex<Vec<String>>,
    readiness: Readiness,
}

type NodeLabels = [(&'static str, String); 1];

/// A PostgreSQL block (BLCKSZ, the default build's 8 kB, as every node's here).
pub const BLOCK_BYTES: u64 = 8192;

/// A node and a direction (sent, received).
type WireLabels = [(&'static str, String); 2];

fn node_label(name: &str) -> NodeLabels {
    [("node", name.to_string())]
}

/// What /readyz judges.
#[derive(Default)]
struct Readiness {
    primary_up: AtomicBool,
    standby_up: AtomicBool,
    /// When a node last answered a call of the loop (a cycle can take long: a cold standby
    /// is warmed in many batches).
    last_progress: Mutex<Option<Instant>>,
    /// How long without progress is not ready (set from the configuration).
    stale_after_ms: AtomicU64,
    /// When the sync loop last went round (also while the nodes are down): the watchdog.
    last_heartbeat: Mutex<Option<Instant>>,
    /// While another agent holds the cluster's lock: that agent, as the primary shows it.
    standing_by: Mutex<Option<String>>,
}

type SlotLabels = [(&'static str, String); 1];

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut root = Registry::default();
        let registry = root.sub_registry_with_prefix("ccm_agent");
        let m = Metrics {
            cycles: Counter::default(),
            cycle_errors: Family::default(),
            blocks_sent: Counter::default(),
            blocks_loaded: Counter::default(),
            blocks_already_cached: Counter::default(),
            fill_blocks_loaded: Counter::default(),
            blocks_skipped: Counter::default(),
            recovery_conflicts: Counter::default(),
            replay_lag_pauses: Counter::default(),
            prewarm_storage_errors: Counter::default(),
            hot_set_blocks: Gauge::default(),
            coverage_ratio: FloatGauge::default(),
            last_cycle_duration_seconds: FloatGauge::default(),
            last_cycle_timestamp_seconds: FloatGauge::default(),
            node_up: Family::default(),
            retargets: Family::default(),
            enabled: Gauge::default(),
            active: Gauge::default(),
            resident_memory_bytes: Gauge::default(),
            filter_bytes: Gauge::default(),
            block_list_bytes: Gauge::default(),
            wal_cache_held_blocks: Gauge::default(),
            wal_cache_locked_blocks: Gauge::default(),
            wal_cache_slot_hits: Family::default(),
            wal_cache_slot_misses: Family::default(),
            wal_cache_slots: std::sync::Mutex::default(),
            build_info: Family::default(),
            standby_up: Family::default(),
            standby_coverage: Family::default(),
            standby_missing: Family::default(),
            standby_loaded: Family::default(),
            feed_resets: Family::default(),
            wire_bytes: Family::default(),
            standby_priority: Family::default(),
            os_cache_coverage: Family::default(),
            os_cache_held_bytes: Family::default(),
            os_cache_read_bytes: Family::default(),
            os_cache_primary_bytes: Gauge::default(),
            os_cache_waiting: Family::default(),
            standby_names: std::sync::Mutex::default(),
            readiness: Readiness::default(),
            registry: Registry::default(),
        };
        registry.register(
            "build_info",
            "The agent's version; always 1",
            m.build_info.clone(),
        );
        m.build_info
            .get_or_create(&[("version", env!("CARGO_PKG_VERSION"))])
            .set(1);
        // Counters get their `_total` suffix from the encoder.
        registry.register("cycles", "Sync cycles completed", m.cycles.clone());
        registry.register(
            "cycle_errors",
            "Cycles that failed, by stage (connect, filter, hot_blocks, prewarm, safety)",
            m.cycle_errors.clone(),
        );
        registry.register(
            "blocks_sent",
            "Blocks sent to the standby in hot block lists",
            m.blocks_sent.clone(),
        );
        registry.register(
            "blocks_loaded",
            "Blocks the standby read into shared_buffers",
            m.blocks_loaded.clone(),
        );
        registry.register(
            "blocks_already_cached",
            "Blocks sent that the standby already had cached",
            m.blocks_already_cached.clone(),
        );
        registry.register(
            "fill_blocks_loaded",
            "Of the blocks loaded, those below the hot set's usage threshold that filled a standby's unused buffers (fill_room)",
            m.fill_blocks_loaded.clone(),
        );
        registry.register(
            "blocks_skipped",
            "Blocks sent that the standby could not or would not load (batches lost to storage errors included)",
            m.blocks_skipped.clone(),
        );
        registry.register(
            "recovery_conflicts",
            "Standby calls (filter, prewarm) cancelled, or sessions terminated, by a recovery conflict; the cycle ends and the rest follows next cycle",
            m.recovery_conflicts.clone(),
        );
        registry.register(
            "replay_lag_pauses",
            "Times a standby's share of a cycle ended because its replay lag was above max_replay_lag",
            m.replay_lag_pauses.clone(),
        );
        registry.register(
            "prewarm_storage_errors",
            "Prewarm batches skipped because the standby hit a storage error (SQLSTATE XX001, 58030, 58P01)",
            m.prewarm_storage_errors.clone(),
        );
        registry.register(
            "hot_set_blocks",
            "Hot buffers the primary's last scan found (before filtering)",
            m.hot_set_blocks.clone(),
        );
        registry.register(
            "coverage_ratio",
            "Share of the primary's hot set already cached at the last scan on the standby that had the least of it (0..1); per standby: standby_coverage_ratio",
            m.coverage_ratio.clone(),
        );
        registry.register(
            "last_cycle_duration_seconds",
            "Duration of the last completed cycle",
            m.last_cycle_duration_seconds.clone(),
        );
        registry.register(
            "last_cycle_timestamp_seconds",
            "Unix time at which the last cycle completed",
            m.last_cycle_timestamp_seconds.clone(),
        );
        registry.register(
            "node_up",
            "1 while the agent holds a working connection to the side",
            m.node_up.clone(),
        );
        registry.register(
            "retargets",
            "Times a side's connection moved to a different host",
            m.retargets.clone(),
        );
        registry.register(
            "enabled",
            "0 while the Cluster Cache Manager is disabled on a node",
            m.enabled.clone(),
        );
        registry.register(
            "active",
            "1 while this agent holds its cluster's lock on the primary and warms; 0 while it stands by (another agent holds the lock) or has no primary session",
            m.active.clone(),
        );
        registry.register(
            "filter_bytes",
            "Size of the standby's last bloom filter",
            m.filter_bytes.clone(),
        );
        registry.register(
            "block_list_bytes",
            "Size of the primary's last hot block list",
            m.block_list_bytes.clone(),
        );

        registry.register(
            "standby_up",
            "1 while the agent holds a working connection to this standby (failover candidate)",
            m.standby_up.clone(),
        );
        registry.register(
            "standby_coverage_ratio",
            "Share of the primary's hot set (its hottest part, up to the standby's shared_buffers) cached on this standby at the last scan (0..1)",
            m.standby_coverage.clone(),
        );
        registry.register(
            "os_cache_coverage_ratio",
            "Share of the primary's page cache of relation files (main forks) that this standby's page cache held in the last complete pass, before that pass read anything (0..1)",
            m.os_cache_coverage.clone(),
        );
        registry.register(
            "os_cache_held_bytes",
            "Bytes of the primary's page cache of relation files that this standby's page cache held in the last complete pass",
            m.os_cache_held_bytes.clone(),
        );
        registry.register(
            "os_cache_read_bytes",
            "Bytes the agent had this standby read into its page cache (posix_fadvise WILLNEED)",
            m.os_cache_read_bytes.clone(),
        );
        registry.register(
            "os_cache_primary_bytes",
            "Bytes of relation files (main forks of permanent relations) in the primary's page cache at its last complete pass",
            m.os_cache_primary_bytes.clone(),
        );
        registry.register(
            "os_cache_waiting",
            "1 while reading into this standby's page cache waits for its own client sessions (os_cache_busy_sessions)",
            m.os_cache_waiting.clone(),
        );
        registry.register(
            "standby_missing_blocks",
            "Hot blocks this standby lacked at the last scan (the list sent to it)",
            m.standby_missing.clone(),
        );
        registry.register(
            "standby_blocks_loaded",
            "Blocks this standby read into shared_buffers",
            m.standby_loaded.clone(),
        );
        registry.register(
            "bytes",
            "Bytes the agent's session with this node carried (direction sent: to the node, acknowledged by it; received: from it), as the kernel counts them on the session's TCP socket, TLS included",
            m.wire_bytes.clone(),
        );
        registry.register(
            "feed_resets",
            "Times this node's change feed started over (first call, restart, lost answer, another agent)",
            m.feed_resets.clone(),
        );
        registry.register(
            "standby_rank",
            "Position of this standby in the warming order (0: warmed first)",
            m.standby_priority.clone(),
        );
        registry.register(
            "wal_cache_held_blocks",
            "WAL pages the primary's logical WAL cache holds in memory",
            m.wal_cache_held_blocks.clone(),
        );
        registry.register(
            "wal_cache_locked_blocks",
            "WAL pages of the logical WAL cache locked in memory (mlock)",
            m.wal_cache_locked_blocks.clone(),
        );
        registry.register(
            "wal_cache_slot_hit_blocks",
            "WAL pages a logical slot consumed from the cache since its last reset (aurora_stat_logical_wal_cache cache_hit)",
            m.wal_cache_slot_hits.clone(),
        );
        registry.register(
            "wal_cache_slot_miss_blocks",
            "WAL pages a logical slot consumed from outside the cache since its last reset (cache_miss)",
            m.wal_cache_slot_misses.clone(),
        );

        // Every label value exists from the start, so dashboards and alerts see zeros rather
        // than absent series before the first fault.
        for stage in Stage::ALL {
            m.cycle_errors
                .get_or_create(&[("stage", stage.as_str())])
                .inc_by(0);
        }
        for side in [Side::Primary, Side::Standby] {
            m.node_up.get_or_create(&side_label(side)).set(0);
            m.retargets.get_or_create(&side_label(side)).inc_by(0);
        }
        m.enabled.set(1);
        // The process's own, under the names Prometheus' client libraries give them (the
        // alert rules read process_resident_memory_bytes).
        root.sub_registry_with_prefix("process").register(
            "resident_memory_bytes",
            "Resident memory size in bytes (VmRSS), read at every round of the agent's loop",
            m.resident_memory_bytes.clone(),
        );
        Metrics {
            registry: root,
            ..m
        }
    }

    pub fn cycle_error(&self, stage: Stage) {
        self.cycle_errors
            .get_or_create(&[("stage", stage.as_str())])
            .inc();
    }

    pub fn set_node_up(&self, side: Side, up: bool) {
        self.node_up
            .get_or_create(&side_label(side))
            .set(i64::from(up));
        let flag = match side {
            Side::Primary => &self.readiness.primary_up,
            Side::Standby => &self.readiness.standby_up,
        };
        flag.store(up, Ordering::Relaxed);
    }

    /// The election's outcome (election.rs): active, or standing by behind `standing_by`.
    pub fn set_election(&self, active: bool, standing_by: Option<String>) {
        self.active.set(i64::from(active));
        *self
            .readiness
            .standing_by
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = standing_by;
    }

    /// A node answered a call of the loop.
    pub fn progress(&self) {
        *self
            .readiness
            .last_progress
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }

    /// The sync loop is alive (called every round, answered or not).
    pub fn heartbeat(&self) {
        if let Some(bytes) = resident_bytes() {
            self.resident_memory_bytes.set(saturating_i64(bytes));
        }
        *self
            .readiness
            .last_heartbeat
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }

    /// Time since the loop last showed life: a round, or a node's answer within a long cycle.
    pub fn since_heartbeat(&self) -> Option<Duration> {
        let r = &self.readiness;
        let beat = *r.last_heartbeat.lock().unwrap_or_else(|e| e.into_inner());
        let answer = *r.last_progress.lock().unwrap_or_else(|e| e.into_inner());
        beat.into_iter().chain(answer).map(|at| at.elapsed()).min()
    }

    /// After how long without progress /readyz says not ready.
    pub fn set_stale_after(&self, after: Duration) {
        let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        self.readiness.stale_after_ms.store(ms, Ordering::Relaxed);
    }

    /// Whether the loop does its job, and the JSON body of /readyz that says so or why not.
    pub fn readiness(&self) -> (bool, serde_json::Value) {
        let r = &self.readiness;
        let primary = r.primary_up.load(Ordering::Relaxed);
        let standby = r.standby_up.load(Ordering::Relaxed);
        let since = r
            .last_progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map(|at| at.elapsed());
        let stale_after = Duration::from_millis(r.stale_after_ms.load(Ordering::Relaxed));
        let standing_by = r
            .standing_by
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut reasons = Vec::new();
        // Standing by, the agent connects no standby on purpose: that is the one reason.
        if let Some(holder) = &standing_by {
            reasons.push(format!(
                "standby: another ccm-agent holds the cluster's lock on the primary ({holder}); \
                 this one warms nothing"
            ));
        }
        if !primary {
            reasons.push("no connection to a primary".to_string());
        }
        if !standby && standing_by.is_none() {
            reasons.push("no connection to a standby".to_string());
        }
        match since {
            None => reasons.push("no call answered yet".to_string()),
            Some(age) if age > stale_after => reasons.push(format!(
                "no call answered for {:.1} s (more than {:.1} s)",
                age.as_secs_f64(),
                stale_after.as_secs_f64()
            )),
            Some(_) => {}
        }
        if self.enabled.get() == 0 {
            reasons.push(
                "Cluster Cache Manager is disabled on a node (ccm.enabled = off)".to_string(),
            );
        }
        let ready = reasons.is_empty();
        let body = serde_json::json!({
            "ready": ready,
            "primary_connected": primary,
            "standby_connected": standby,
            "seconds_since_last_answer": since.map(|age| age.as_secs_f64()),
            "active": self.active.get() == 1,
            "standby": standing_by.is_some(),
            "active_agent": standing_by,
            "reasons": reasons,
        });
        (ready, body)
    }

    pub fn retarget(&self, side: Side) {
        self.retargets.get_or_create(&side_label(side)).inc();
    }

    pub fn cycle_done(&self, duration: Duration) {
        self.cycles.inc();
        self.last_cycle_duration_seconds.set(duration.as_secs_f64());
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        self.last_cycle_timestamp_seconds.set(now.as_secs_f64());
    }

    /// The standbys to warm now, in order; those that left lose their series.
    pub fn standbys(&self, names: &[String]) {
        let mut known = self.standby_names.lock().unwrap_or_else(|e| e.into_inner());
        for gone in known.iter().filter(|name| !names.contains(name)) {
            let label = node_label(gone);
            self.standby_up.remove(&label);
            self.standby_coverage.remove(&label);
            self.standby_missing.remove(&label);
            self.standby_loaded.remove(&label);
            self.standby_priority.remove(&label);
            self.os_cache_coverage.remove(&label);
            self.os_cache_held_bytes.remove(&label);
            self.os_cache_read_bytes.remove(&label);
            self.os_cache_waiting.remove(&label);
        }
        for (rank, name) in names.iter().enumerate() {
            let label = node_label(name);
            let _ = self.standby_up.get_or_create(&label);
            self.standby_loaded.get_or_create(&label).inc_by(0);
            self.standby_priority.get_or_create(&label).set(rank as i64);
        }
        *known = names.to_vec();
    }

    pub fn set_standby_up(&self, name: &str, up: bool) {
        self.standby_up
            .get_or_create(&node_label(name))
            .set(i64::from(up));
    }

    /// One standby's share of the hot set at the last scan.
    pub fn standby_scan(&self, name: &str, hot: u64, missing: u64) {
        let label = node_label(name);
        self.standby_coverage
            .get_or_create(&label)
            .set(coverage(hot, missing));
        self.standby_missing
            .get_or_create(&label)
            .set(saturating_i64(missing));
    }

    /// The change feed of node `name` (a standby's name, or "primary") started over.
    /// Bytes a node's session carried since the last count.
    pub fn wire_bytes(&self, name: &str, sent: u64, received: u64) {
        for (direction, bytes) in [("sent", sent), ("received", received)] {
            if bytes > 0 {
                self.wire_bytes
                    .get_or_create(&[
                        ("node", name.to_string()),
                        ("direction", direction.to_string()),
                    ])
                    .inc_by(bytes);
            }
        }
    }

    /// A standby's page-cache tier: what it held of the primary's in its last complete pass.
    pub fn os_cache_coverage(&self, name: &str, coverage: &crate::oscache::Coverage) {
        let label = node_label(name);
        self.os_cache_coverage
            .get_or_create(&label)
            .set(coverage.share());
        self.os_cache_held_bytes
            .get_or_create(&label)
            .set(saturating_i64(
                coverage.held_blocks.saturating_mul(BLOCK_BYTES),
            ));
    }

    /// Blocks a standby was told to read into its page cache.
    pub fn os_cache_read(&self, name: &str, blocks: u64) {
        self.os_cache_read_bytes
            .get_or_create(&node_label(name))
            .inc_by(blocks.saturating_mul(BLOCK_BYTES));
    }

    /// Whether reading into a standby's page cache waits for its own readers.
    pub fn os_cache_waiting(&self, name: &str, waiting: bool) {
        self.os_cache_waiting
            .get_or_create(&node_label(name))
            .set(i64::from(waiting));
    }

    /// The primary's page cache of relation files at its last complete pass.
    pub fn os_cache_primary(&self, blocks: u64) {
        self.os_cache_primary_bytes
            .set(saturating_i64(blocks.saturating_mul(BLOCK_BYTES)));
    }

    pub fn feed_reset(&self, name: &str) {
        self.feed_resets.get_or_create(&node_label(name)).inc();
    }

    pub fn standby_loaded(&self, name: &str, blocks: u64) {
        self.standby_loaded
            .get_or_create(&node_label(name))
            .inc_by(blocks);
    }

    /// The primary's logical WAL cache; slots that are gone lose their series.
    pub fn wal_cache(&self, status: &WalCacheStatus) {
        self.wal_cache_held_blocks.set(status.held_blocks);
        self.wal_cache_locked_blocks.set(status.locked_blocks);
        let mut known = self
            .wal_cache_slots
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for gone in known
            .iter()
            .filter(|name| !status.slots.iter().any(|s| &s.name == *name))
        {
            self.wal_cache_slot_hits.remove(&[("slot", gone.clone())]);
            self.wal_cache_slot_misses.remove(&[("slot", gone.clone())]);
        }
        known.clear();
        for slot in &status.slots {
            self.wal_cache_slot_hits
                .get_or_create(&[("slot", slot.name.clone())])
                .set(slot.cache_hit);
            self.wal_cache_slot_misses
                .get_or_create(&[("slot", slot.name.clone())])
                .set(slot.cache_miss);
            known.push(slot.name.clone());
        }
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

fn side_label(side: Side) -> Labels {
    [("side", side.as_str())]
}

pub fn saturating_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// 1 - missing/hot, clamped to 0..1; 1 when nothing is hot (nothing to miss). Clamped
/// because the two numbers may come from different moments (status) or the missing count
/// may include blocks that cooled down since the scan.
pub fn coverage(hot: u64, missing: u64) -> f64 {
    if hot == 0 {
        return 1.0;
    }
    (1.0 - missing as f64 / hot as f64).clamp(0.0, 1.0)
}

/// Binds the listener now, so a busy port fails the start-up rather than a background task.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen for metrics on {addr}: {e}"))
}

/// Serves GET /metrics, /healthz and /readyz until `cancel`.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "serving /metrics, /healthz and /readyz");
    }
    loop {
        let (stream, peer) = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // Out of file descriptors and the like: wait a little rather than spin.
                Err(e) => {
                    debug!("metrics accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let metrics = metrics.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let metrics = metrics.clone();
                async move { Ok::<_, Infallible>(respond(&req, &metrics)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = cancel.cancelled() => {}
                r = conn => if let Err(e) = r { debug!(%peer, "metrics connection: {e}") },
            }
        });
    }
}

fn respond(req: &Request<Incoming>, metrics: &Metrics) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.render(),
        ),
        (&Method::GET, "/healthz") => (
            StatusCode::OK,
            "text/plain; charset=utf-8",
            "ok".to_string(),
        ),
        (&Method::GET, "/readyz") => {
            let (ready, body) = metrics.readiness();
            let status = if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (status, "application/json", format!("{body}\n"))
        }
        (_, "/metrics" | "/healthz" | "/readyz") => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "method not allowed\n".to_string(),
        ),
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "not found\n".to_string(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// The process's resident memory from /proc/self/status (VmRSS); None where there is none.
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub const NAMES: &[&str] = &[
        "ccm_agent_cycles_total",
        "ccm_agent_cycle_errors_total{stage=\"connect\"}",
        "ccm_agent_cycle_errors_total{stage=\"filter\"}",
        "ccm_agent_cycle_errors_total{stage=\"hot_blocks\"}",
        "ccm_agent_cycle_errors_total{stage=\"prewarm\"}",
        "ccm_agent_cycle_errors_total{stage=\"safety\"}",
        "ccm_agent_blocks_sent_total",
        "ccm_agent_blocks_loaded_total",
        "ccm_agent_blocks_already_cached_total",
        "ccm_agent_fill_blocks_loaded_total",
        "ccm_agent_blocks_skipped_total",
        "ccm_agent_recovery_conflicts_total",
        "ccm_agent_replay_lag_pauses_total",
        "ccm_agent_prewarm_storage_errors_total",
        "ccm_agent_hot_set_blocks",
        "ccm_agent_coverage_ratio",
        "ccm_agent_last_cycle_duration_seconds",
        "ccm_agent_last_cycle_timestamp_seconds",
        "ccm_agent_node_up{side=\"primary\"}",
        "ccm_agent_node_up{side=\"standby\"}",
        "ccm_agent_retargets_total{side=\"primary\"}",
        "ccm_agent_retargets_total{side=\"standby\"}",
        "ccm_agent_enabled",
        "ccm_agent_active",
        "ccm_agent_filter_bytes",
        "ccm_agent_block_list_bytes",
    ];

    /// Parses the exposition the way the integration harness does: `name{labels} value`.
    fn samples(text: &str) -> std::collections::HashMap<String, f64> {
        text.lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .filter_map(|l| {
                let (name, value) = l.rsplit_once(' ')?;
                Some((name.to_string(), value.parse().ok()?))
            })
            .collect()
    }

    #[test]
    fn every_metric_is_rendered_from_the_start() {
        let m = Metrics::new();
        let s = samples(&m.render());
        for name in NAMES {
            assert!(
                s.contains_key(*name),
                "{name} missing from:\n{}",
                m.render()
            );
        }
        assert_eq!(s["ccm_agent_enabled"], 1.0);
        assert_eq!(s["ccm_agent_cycles_total"], 0.0);
    }

    #[test]
    fn the_agents_memory_is_shown_from_the_first_round() {
        let m = Metrics::new();
        m.heartbeat();
        let rendered = m.render();
        let line = rendered
            .lines()
            .find(|l| l.starts_with("process_resident_memory_bytes "))
            .expect("rendered");
        let bytes: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        // A test process holds a few MB at least, and less than a terabyte.
        assert!(bytes > 1e6 && bytes < 1e12, "{line}");
    }

    #[test]
    fn updates_show_up() {
        let m = Metrics::new();
        m.cycle_error(Stage::HotBlocks);
        m.cycle_error(Stage::HotBlocks);
        m.set_node_up(Side::Standby, true);
        m.retarget(Side::Primary);
        m.blocks_loaded.inc_by(42);
        m.hot_set_blocks.set(200);
        m.coverage_ratio.set(0.75);
        m.standbys(&["a".to_string(), "b".to_string()]);
        m.standby_scan("a", 200, 50);
        m.set_standby_up("a", true);
        m.standby_loaded("b", 7);
        m.cycle_done(Duration::from_millis(1500));
        let s = samples(&m.render());
        assert_eq!(s["ccm_agent_cycle_errors_total{stage=\"hot_blocks\"}"], 2.0);
        assert_eq!(s["ccm_agent_node_up{side=\"standby\"}"], 1.0);
        assert_eq!(s["ccm_agent_node_up{side=\"primary\"}"], 0.0);
        assert_eq!(s["ccm_agent_retargets_total{side=\"primary\"}"], 1.0);
        assert_eq!(s["ccm_agent_blocks_loaded_total"], 42.0);
        assert_eq!(s["ccm_agent_hot_set_blocks"], 200.0);
        assert_eq!(s["ccm_agent_coverage_ratio"], 0.75);
        assert_eq!(s["ccm_agent_cycles_total"], 1.0);
        assert_eq!(s["ccm_agent_standby_coverage_ratio{node=\"a\"}"], 0.75);
        assert_eq!(s["ccm_agent_standby_missing_blocks{node=\"a\"}"], 50.0);
        assert_eq!(s["ccm_agent_standby_up{node=\"a\"}"], 1.0);
        assert_eq!(s["ccm_agent_standby_up{node=\"b\"}"], 0.0);
        assert_eq!(s["ccm_agent_standby_rank{node=\"b\"}"], 1.0);
        assert_eq!(s["ccm_agent_standby_blocks_loaded_total{node=\"b\"}"], 7.0);
        // A member that left loses its series.
        m.standbys(&["b".to_string()]);
        let s = samples(&m.render());
        assert!(!s.contains_key("ccm_agent_standby_up{node=\"a\"}"));
        assert_eq!(s["ccm_agent_standby_rank{node=\"b\"}"], 0.0);
        assert_eq!(s["ccm_agent_last_cycle_duration_seconds"], 1.5);
        assert!(s["ccm_agent_last_cycle_timestamp_seconds"] > 1.6e9);
    }

    #[test]
    fn wal_cache_slots_come_and_go() {
        use crate::node::WalCacheSlot;
        let m = Metrics::new();
        let slot = |name: &str, hit, miss| WalCacheSlot {
            name: name.into(),
            cache_hit: hit,
            cache_miss: miss,
            blks_read: hit + miss,
            ..Default::default()
        };
        let mut status = WalCacheStatus {
            mode: "locked".into(),
            size_blocks: 2048,
            held_blocks: 2048,
            locked_blocks: 1024,
            slots: vec![slot("cdc", 90, 10), slot("old", 1, 2)],
            ..Default::default()
        };
        m.wal_cache(&status);
        let s = samples(&m.render());
        assert_eq!(s["ccm_agent_wal_cache_held_blocks"], 2048.0);
        assert_eq!(s["ccm_agent_wal_cache_locked_blocks"], 1024.0);
        assert_eq!(s["ccm_agent_wal_cache_slot_hit_blocks{slot=\"cdc\"}"], 90.0);
        assert_eq!(s["ccm_agent_wal_cache_slot_miss_blocks{slot=\"old\"}"], 2.0);
        status.slots.pop();
        m.wal_cache(&status);
        let s = samples(&m.render());
        assert!(!s.contains_key("ccm_agent_wal_cache_slot_hit_blocks{slot=\"old\"}"));
        assert_eq!(
            s["ccm_agent_wal_cache_slot_miss_blocks{slot=\"cdc\"}"],
            10.0
        );
    }

    #[test]
    fn coverage_arithmetic() {
        assert_eq!(coverage(0, 0), 1.0);
        assert_eq!(coverage(0, 10), 1.0);
        assert_eq!(coverage(100, 0), 1.0);
        assert_eq!(coverage(100, 100), 0.0);
        assert_eq!(coverage(100, 25), 0.75);
        assert_eq!(coverage(100, 250), 0.0);
        assert!((coverage(3, 1) - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn readiness_needs_both_sides_and_a_recent_answer() {
        let m = Metrics::new();
        m.set_stale_after(Duration::from_secs(60));
        let (ready, body) = m.readiness();
        assert!(!ready);
        assert_eq!(body["reasons"].as_array().unwrap().len(), 3, "{body}");
        m.set_node_up(Side::Primary, true);
        m.set_node_up(Side::Standby, true);
        m.progress();
        let (ready, body) = m.readiness();
        assert!(ready, "{body}");
        assert_eq!(body["reasons"].as_array().unwrap().len(), 0);
        m.set_stale_after(Duration::ZERO);
        std::thread::sleep(Duration::from_millis(5));
        let (ready, body) = m.readiness();
        assert!(
            !ready
                && body["reasons"][0]
                    .as_str()
                    .unwrap()
                    .starts_with("no call answered for"),
            "{body}"
        );
        m.set_stale_after(Duration::from_secs(60));
        m.enabled.set(0);
        assert!(!m.readiness().0);
    }

    #[test]
    fn build_info_carries_the_version() {
        let text = Metrics::new().render();
        let line = format!(
            "ccm_agent_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        assert!(text.contains(&line), "{text}");
    }

    #[tokio::test]
    async fn http_routes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let metrics = Arc::new(Metrics::new());
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cancel = CancellationToken::new();
        let server = tokio::spawn(serve(listener, metrics, cancel.clone()));
        let get = |path: &'static str| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await
            .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        let metrics_response = get("/metrics").await;
        assert!(
            metrics_response.starts_with("HTTP/1.1 200"),
            "{metrics_response}"
        );
        assert!(metrics_response.contains("ccm_agent_cycles_total 0"));
        let health = get("/healthz").await;
        assert!(
            health.starts_with("HTTP/1.1 200") && health.ends_with("\r\n\r\nok"),
            "{health}"
        );
        assert!(get("/nope").await.starts_with("HTTP/1.1 404"));
        let ready = get("/readyz").await;
        assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
        assert!(
            ready.contains("\"ready\":false") && ready.contains("no connection to a primary"),
            "{ready}"
        );
        cancel.cancel();
        tokio::time::timeout(Duration::from_secs(2), server)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}

//! `ccm-agent status` (one screen about the pairing) and the connect part of
//! `check-config --connect`.
//!
//! Status connects leniently: when no host of a side has the expected role it still shows the
//! first reachable one, because "the standby side points at a primary" is exactly what an
//! operator needs to see. Anything that would stop `run` from syncing (a node unreachable, a
//! wrong role, different systems, a missing extension, a library older than the catalog)
//! makes the exit code non-zero.
//!
//! It also names the `ccm-agent run` that is active on the cluster: the session holding the
//! agents' lock on the primary (election.rs), from pg_locks and pg_stat_activity, or none.
//!
//! A `Looker` holds the sessions: `status` looks once, `wait` looks again and again over the
//! same sessions (see wait.rs for what a look costs the nodes).

use std::fmt::Write as _;
use std::sync::Arc;

use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::config::Config;
use crate::conninfo::{ConnInfo, HostSpec};
use crate::election::Holder;
use crate::metrics::{coverage, BLOCK_BYTES};
use crate::node::{self, CcmStatus, ConnectOptions, Node, NodeError, Side, WalCacheStatus};
use crate::oscache::{self, Cursor};
use crate::patroni;
use crate::topology::{self, Topology};

/// The false positive rate of the filter status asks for: lower than the loop's, because
/// here the filter is used once to count, and every false positive hides a missing block.
pub const STATUS_FALSE_POSITIVE_RATE: f64 = 0.001;

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NodeReport {
    pub host: Option<String>,
    pub port: Option<u16>,
    /// "primary" or "standby", as pg_is_in_recovery() says.
    pub role: Option<&'static str>,
    pub system_identifier: Option<String>,
    /// The catalog's version (pg_extension.extversion).
    pub extension_version: Option<String>,
    /// The version of the pg_ccm library the server has loaded; None when it does not tell
    /// (older than 0.7.0, or not preloaded).
    pub library_version: Option<String>,
    pub server_version: Option<String>,
    /// Why the node could not be reached or used, if so.
    pub error: Option<String>,
}

impl NodeReport {
    fn from_node(node: &Node) -> Self {
        NodeReport {
            host: Some(node.host.name()),
            port: Some(node.host.port),
            role: Some(node.role()),
            system_identifier: Some(node.facts.system_identifier.clone()),
            extension_version: node.facts.extension_version.clone(),
            library_version: node.facts.library_version.clone(),
            server_version: Some(node.facts.server_version.clone()),
            error: None,
        }
    }

    fn from_error(info: &ConnInfo, error: &NodeError) -> Self {
        // Show the first candidate host so a single-host string still says where it looked.
        let first = info.hosts().into_iter().next();
        NodeReport {
            host: first.as_ref().map(|h| h.name()),
            port: first.as_ref().map(|h| h.port),
            error: Some(error.to_string()),
            ..Default::default()
        }
    }
}

/// One standby of the topology: the node, and its share of the primary's hot set.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StandbyStatus {
    /// Patroni's member name, else host:port.
    pub name: String,
    #[serde(flatten)]
    pub node: NodeReport,
    /// Hot buffers its filter lacks.
    pub missing: Option<i64>,
    pub coverage: Option<f64>,
    /// What its page cache holds of the primary's page cache of relation files, in bytes and
    /// as a share (extension 0.9.0).
    pub os_held_bytes: Option<u64>,
    pub os_coverage: Option<f64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StatusReport {
    pub primary: NodeReport,
    /// The first standby in the warming order (the tier-0 standby).
    pub standby: NodeReport,
    /// Every standby of the topology, in the warming order.
    pub standbys: Vec<StandbyStatus>,
    /// Patroni's leader (None without Patroni).
    pub leader: Option<String>,
    /// Patroni members that are not warmed, and why.
    pub excluded: Vec<(String, String)>,
    /// The `ccm-agent run` active on the cluster: the primary session holding the agents'
    /// lock (election.rs). None when no agent holds it, or when the primary could not be
    /// asked (`active_agent_checked` false).
    pub active_agent: Option<Holder>,
    pub active_agent_checked: bool,
    /// false when the extension reports the Cluster Cache Manager disabled.
    pub ccm_enabled: Option<bool>,
    /// Hot buffers on the primary (ccm_hot_buffers()).
    pub hot_buffers: Option<i64>,
    /// Hot buffers the first standby's filter lacks.
    pub missing: Option<i64>,
    /// 1 - missing/hot_buffers, 0..1 (1 when nothing is hot), on the first standby.
    pub coverage: Option<f64>,
    /// Bytes of relation files (main forks of permanent relations) in the primary's page
    /// cache (extension 0.9.0).
    pub os_cache_bytes: Option<u64>,
    /// The row of aurora_ccm_status() on the primary.
    pub status: Option<CcmStatus>,
    pub buffers_sent_per_second: Option<f64>,
    pub buffers_found_per_second: Option<f64>,
    /// The primary's logical WAL cache (extension 0.2 and later).
    pub wal_cache: Option<WalCacheStatus>,
    /// True when nothing below stops the agent from syncing.
    pub ok: bool,
    pub problems: Vec<String>,
}

impl StatusReport {
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        if let Some(leader) = &self.leader {
            let _ = writeln!(out, "Patroni  leader {leader}");
        }
        node_line(&mut out, "primary", &self.primary);
        let many = self.standbys.len() > 1;
        for s in &self.standbys {
            node_line(&mut out, "standby", &s.node);
            if many {
                if let (Some(c), Some(missing)) = (s.coverage, s.missing) {
                    let _ = writeln!(
                        out,
                        "         {}: coverage {:.1}% ({missing} hot buffers missing)",
                        s.name,
                        c * 100.0
                    );
                }
            }
            if let (Some(c), Some(held)) = (s.os_coverage, s.os_held_bytes) {
                let _ = writeln!(
                    out,
                    "         {}: page cache holds {:.1}% of the primary's ({})",
                    s.name,
                    c * 100.0,
                    mib_bytes(held)
                );
            }
        }
        if self.standbys.is_empty() {
            node_line(&mut out, "standby", &self.standby);
        }
        for (name, why) in &self.excluded {
            let _ = writeln!(out, "skipped  {name} ({why})");
        }
        match (&self.active_agent, self.active_agent_checked) {
            (Some(holder), _) => {
                let _ = writeln!(out, "agent    active: {holder}");
            }
            (None, true) => {
                let _ = writeln!(
                    out,
                    "agent    active: none (no ccm-agent run holds the cluster's lock)"
                );
            }
            (None, false) => {}
        }
        if self.ccm_enabled == Some(false) {
            let _ = writeln!(out, "CCM      disabled (ccm.enabled = off)");
        }
        if let Some(hot) = self.hot_buffers {
            let _ = writeln!(out, "hot set  {hot} buffers ({})", mib(hot));
        }
        if let (Some(c), Some(missing)) = (self.coverage, self.missing) {
            let _ = writeln!(
                out,
                "coverage {:.1}% of the hot set cached on the standby ({missing} hot buffers missing)",
                c * 100.0
            );
        }
        if let Some(bytes) = self.os_cache_bytes {
            let _ = writeln!(
                out,
                "page cache {} of relation files on the primary",
                mib_bytes(bytes)
            );
        }
        if let Some(s) = &self.status {
            let _ = writeln!(
                out,
                "last scan    sent {} / found {} buffers",
                s.buffers_sent_last_scan, s.buffers_found_last_scan
            );
            let _ = writeln!(
                out,
                "last minute  sent {} ({:.1}/s) / found {} ({:.1}/s) buffers",
                s.buffers_sent_last_minute,
                self.buffers_sent_per_second.unwrap_or(0.0),
                s.buffers_found_last_minute,
                self.buffers_found_per_second.unwrap_or(0.0),
            );
            let _ = writeln!(
                out,
                "this scan    sent {} / found {} buffers, progress {}",
                s.buffers_sent_current_scan, s.buffers_found_current_scan, s.current_scan_progress
            );
        }
        if let Some(w) = &self.wal_cache {
            let _ = writeln!(
                out,
                "WAL cache    {}: {} of {} pages held ({}), {} locked, oldest {}",
                w.mode,
                w.held_blocks,
                w.size_blocks,
                mib(w.held_blocks),
                w.locked_blocks,
                w.oldest_ptr.as_deref().unwrap_or("-"),
            );
            for slot in &w.slots {
                let _ = writeln!(
                    out,
                    "  slot {:<20} hit rate {:>7}  ({} hits, {} misses){}",
                    slot.name,
                    slot.hit_rate.as_deref().unwrap_or("-"),
                    slot.cache_hit,
                    slot.cache_miss,
                    slot.active_pid
                        .map(|pid| format!(", active pid {pid}"))
                        .unwrap_or_default(),
                );
            }
        }
        for p in &self.problems {
            let _ = writeln!(out, "PROBLEM: {p}");
        }
        out
    }
}

fn node_line(out: &mut String, side: &str, n: &NodeReport) {
    let addr = match (&n.host, n.port) {
        (Some(h), Some(p)) => format!("{h}:{p}"),
        _ => "?".to_string(),
    };
    match (&n.error, n.role) {
        (Some(e), None) => {
            let _ = writeln!(out, "{side:<8} {addr}  UNREACHABLE: {e}");
        }
        // Reached: what it said, then why it is not used, if so.
        (error, role) => {
            let _ = writeln!(
                out,
                "{side:<8} {addr}  role {}  system {}  pg_ccm {} (library {})  PostgreSQL {}",
                role.unwrap_or("?"),
                n.system_identifier.as_deref().unwrap_or("?"),
                n.extension_version.as_deref().unwrap_or("not installed"),
                n.library_version.as_deref().unwrap_or("unknown"),
                n.server_version.as_deref().unwrap_or("?"),
            );
            if let Some(e) = error {
                let _ = writeln!(out, "{:<8} {addr}  NOT USED: {e}", "");
            }
        }
    }
}

fn mib_bytes(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn mib(blocks: i64) -> String {
    format!("{:.1} MiB", blocks as f64 * 8192.0 / (1024.0 * 1024.0))
}

fn options(cfg: &Config) -> ConnectOptions {
    ConnectOptions {
        connect_timeout: cfg.connect_timeout,
        statement_timeout: cfg.statement_timeout,
    }
}

/// Records a query error: a disabled CCM is a state, anything else a problem. Returns
/// whether the error broke the session.
fn note_error(report: &mut StatusReport, error: NodeError) -> bool {
    let broken = error.breaks_connection();
    match error {
        NodeError::Disabled { .. } => report.ccm_enabled = Some(false),
        e => report.problems.push(e.to_string()),
    }
    broken
}

/// Sessions to the nodes of the topology, kept from one look to the next.
///
/// `wait` looks again and again for up to its timeout, exactly while a switchover runbook
/// waits on it: a session made afresh for each look would cost every node a backend start, a
/// TLS handshake and a SCRAM exchange each time. A session is made again only when it broke,
/// when the topology moved it (another host, another member), or when its node showed a
/// problem that a fix may clear without a restart (a missing extension, a primary string
/// that led to a standby), so that the fix is seen at the next look.
pub struct Looker {
    cfg: Arc<Config>,
    cancel: CancellationToken,
    /// Kept from look to look, as the sessions are: it asks the Patroni URL that answered last.
    patroni: patroni::Client,
    primary: Option<Kept>,
    standbys: Vec<Kept>,
    /// Measure the page cache too (`status`; `wait` with --min-os-coverage).
    os: bool,
}

/// A kept session, with what it was made for: a standby's name (empty for the primary) and
/// the hosts of its connection string.
struct Kept {
    name: String,
    hosts: Vec<HostSpec>,
    node: Node,
}

/// A standby of this look that answered.
struct Reached {
    /// Its entry in `StatusReport::standbys`.
    entry: usize,
    name: String,
    hosts: Vec<HostSpec>,
    node: Node,
    /// Whether its coverage is measured: in recovery, with a usable library, of the
    /// primary's system.
    measured: bool,
    /// Whether a call broke its session.
    broken: bool,
}

impl Looker {
    pub fn new(cfg: Arc<Config>, cancel: CancellationToken) -> Self {
        Looker {
            cfg,
            cancel,
            patroni: patroni::Client::new(),
            primary: None,
            standbys: Vec::new(),
            os: true,
        }
    }

    /// Whether each look measures the page cache too (a walk of the primary's files).
    pub fn measure_page_cache(mut self, os: bool) -> Self {
        self.os = os;
        self
    }

    /// One look: the topology read again, the sessions it still names reused, the others
    /// made, and the report. Never fails: what could not be learned is a problem in it.
    pub async fn gather(&mut self) -> StatusReport {
        let mut report = StatusReport::default();
        let topology = match topology::discover(
            &self.cfg,
            &self.patroni,
            self.cfg.connect_timeout,
            &self.cancel,
        )
        .await
        {
            Ok(t) => t,
            Err(e) => {
                report.problems.push(format!("topology: {e}"));
                return report;
            }
        };
        report.leader = topology.leader.clone();
        report.excluded = topology.excluded.clone();
        let kept_primary = self.primary.take();
        let kept_standbys = std::mem::take(&mut self.standbys);
        let (primary, standbys) = tokio::join!(
            open_primary(&self.cfg, &topology, kept_primary, &self.cancel),
            connect_standbys(&self.cfg, &topology, kept_standbys, &self.cancel),
        );
        let (primary, standbys) = examine(&mut report, &topology, primary, standbys, self.os).await;
        self.primary = primary.map(|node| Kept {
            name: String::new(),
            hosts: topology.primary.hosts(),
            node,
        });
        self.standbys = standbys;
        report
    }

    /// How many sessions are kept for the next look.
    pub fn kept(&self) -> usize {
        self.standbys.len() + usize::from(self.primary.is_some())
    }
}

/// Gathers the status report once (`status`).
pub async fn gather(cfg: Arc<Config>, cancel: CancellationToken) -> StatusReport {
    Looker::new(cfg, cancel).gather().await
}

/// The kept session made for `name` at `hosts`, if it is still open.
fn take_kept(kept: &mut Vec<Kept>, name: &str, hosts: &[HostSpec]) -> Option<Node> {
    let i = kept
        .iter()
        .position(|k| k.name == name && k.hosts == hosts)?;
    let k = kept.swap_remove(i);
    (!k.node.is_closed()).then_some(k.node)
}

/// Whether a session is worth keeping for the next look: open, unbroken, on a node with
/// the extension whose library may be called, and for the primary, on a primary (a primary
/// only goes into recovery through a restart, which ends the session; a standby may be
/// promoted under a kept session, which its next filter's answer tells).
fn worth_keeping(node: &Node, broken: bool, side: Side) -> bool {
    !broken
        && !node.is_closed()
        && node.require_extension().is_ok()
        && (side == Side::Standby || !node.facts.in_recovery)
}

/// The primary's kept session if the topology still names the same hosts, else a new one.
async fn open_primary(
    cfg: &Config,
    topology: &Topology,
    kept: Option<Kept>,
    cancel: &CancellationToken,
) -> Result<Node, NodeError> {
    let mut kept: Vec<Kept> = kept.into_iter().collect();
    match take_kept(&mut kept, "", &topology.primary.hosts()) {
        Some(node) => Ok(node),
        None => {
            node::resolve(
                &topology.primary,
                Side::Primary,
                options(cfg),
                cancel,
                false,
            )
            .await
        }
    }
}

/// Connects to every standby of the topology (any role, so that it can be shown), reusing
/// the sessions in `kept` made for the same name and host.
async fn connect_standbys(
    cfg: &Config,
    topology: &Topology,
    mut kept: Vec<Kept>,
    cancel: &CancellationToken,
) -> Vec<(String, ConnInfo, Result<Node, NodeError>)> {
    let mut connected = Vec::new();
    for t in &topology.targets {
        let hosts = t.conninfo.hosts();
        let node = match (take_kept(&mut kept, &t.name, &hosts), hosts.first()) {
            (Some(node), _) => Ok(node),
            (None, Some(host)) => {
                Node::connect(&t.conninfo, host, Side::Standby, options(cfg), cancel).await
            }
            (None, None) => Err(NodeError::NoMatch {
                side: Side::Standby,
                tried: "no host".into(),
                failures: Vec::new(),
            }),
        };
        connected.push((t.name.clone(), t.conninfo.clone(), node));
    }
    connected
}

/// Judges the sessions of one look, measures what can be measured, and returns the
/// sessions worth keeping for the next look.
async fn examine(
    report: &mut StatusReport,
    topology: &Topology,
    primary: Result<Node, NodeError>,
    standbys: Vec<(String, ConnInfo, Result<Node, NodeError>)>,
    os: bool,
) -> (Option<Node>, Vec<Kept>) {
    let mut primary = enter_primary(report, topology, primary);
    if let Some(p) = primary.as_mut().filter(|p| !p.facts.in_recovery) {
        active_agent(report, p).await;
    }
    let mut standby_problems = Vec::new();
    let mut reached = reach(report, standbys, &mut standby_problems);
    check_topology(report, primary.as_ref(), &reached);
    // Problems so far concern the primary or the whole topology: without a sound primary
    // no number means anything. A standby that is down or of another system is a problem
    // of its own, and the others are still measured (a rolling restart waits on them).
    let blocked = !report.problems.is_empty();
    pass_over_unusable(
        report,
        primary.as_ref(),
        &mut reached,
        &mut standby_problems,
    );
    let mut primary_broken = false;
    if !blocked {
        if let Some(p) = primary.as_mut() {
            primary_broken = collect_numbers(report, p, &mut reached).await;
            if os && !primary_broken && p.has_os_cache() {
                primary_broken = collect_os_numbers(report, p, &mut reached).await;
            }
        }
    }
    show_first_standby(report, &reached);
    report.problems.extend(standby_problems);
    report.ok = report.problems.is_empty();
    let primary = primary.filter(|p| worth_keeping(p, primary_broken, Side::Primary));
    let kept = reached
        .into_iter()
        .filter(|s| worth_keeping(&s.node, s.broken, Side::Standby))
        .map(|s| Kept {
            name: s.name,
            hosts: s.hosts,
            node: s.node,
        })
        .collect();
    (primary, kept)
}

/// Who holds the agents' lock on the primary. A failed look-up stops nothing `run` does: it
/// is a line of the report, not a problem.
async fn active_agent(report: &mut StatusReport, primary: &mut Node) {
    match primary.agent_lock_holder().await {
        Ok(holder) => {
            report.active_agent = holder;
            report.active_agent_checked = true;
        }
        Err(e) => debug!("looking up the ccm-agent lock's holder failed: {e}"),
    }
}

/// Enters the primary into the report, with what stops it from being used.
fn enter_primary(
    report: &mut StatusReport,
    topology: &Topology,
    primary: Result<Node, NodeError>,
) -> Option<Node> {
    match primary {
        Ok(n) => {
            if n.facts.in_recovery {
                report.problems.push(format!(
                    "the primary connection string leads to {}, which is a standby, not a primary",
                    n.label()
                ));
            }
            report.primary = NodeReport::from_node(&n);
            // Nothing of pg_ccm is called on it then, so no number can be had.
            if let Err(e) = n.require_callable() {
                report.primary.error = Some(e.to_string());
                report.problems.push(format!("primary: {e}"));
            }
            Some(n)
        }
        Err(e) => {
            report.primary = NodeReport::from_error(&topology.primary, &e);
            report.problems.push(format!("primary: {e}"));
            None
        }
    }
}

/// The problems of the whole topology: no standby at all, or no extension.
fn check_topology(report: &mut StatusReport, primary: Option<&Node>, reached: &[Reached]) {
    // A host of the standby string that is the primary is passed over, as `run` does;
    // only a topology without any standby is a problem.
    if !reached.iter().any(|s| s.measured)
        && !report.standbys.iter().all(|s| s.node.error.is_some())
    {
        let shown = report
            .standbys
            .first()
            .map(|s| s.node.host.clone().unwrap_or_default());
        report.problems.push(format!(
            "the standby connection string leads to no standby ({} is a primary)",
            shown.unwrap_or_default()
        ));
    }
    if report.standbys.is_empty() {
        report
            .problems
            .push("no standby to warm: the topology lists none".to_string());
    }
    // The catalog is shared by all nodes: one report of a missing extension is enough.
    let first = reached.iter().find(|s| s.measured).map(|s| &s.node);
    if let Some(Err(e)) = primary.or(first).map(Node::require_catalog) {
        report.problems.push(e.to_string());
    }
}

/// Standbys that are not measured, each a problem of its own: a library older than the
/// catalog (not called, as `run` has it), or another system than the primary's.
fn pass_over_unusable(
    report: &mut StatusReport,
    primary: Option<&Node>,
    reached: &mut [Reached],
    problems: &mut Vec<String>,
) {
    for s in reached.iter_mut().filter(|s| s.measured) {
        if let Err(e) = s.node.require_callable() {
            report.standbys[s.entry].node.error = Some(e.to_string());
            problems.push(format!("standby {}: {e}", s.name));
            s.measured = false;
        }
    }
    let Some(p) = primary else { return };
    for s in reached.iter_mut().filter(|s| s.measured) {
        if let Err(message) = node::check_same_system(p, &s.node) {
            report.standbys[s.entry].node.error = Some(message.clone());
            report.problems.push(message);
            s.measured = false;
        }
    }
}

/// Enters every standby into the report; returns those that answered, the ones in
/// recovery to be measured.
fn reach(
    report: &mut StatusReport,
    standbys: Vec<(String, ConnInfo, Result<Node, NodeError>)>,
    problems: &mut Vec<String>,
) -> Vec<Reached> {
    let mut reached = Vec::new();
    for (name, info, node) in standbys {
        let mut entry = StandbyStatus {
            name: name.clone(),
            ..Default::default()
        };
        match node {
            Ok(n) => {
                entry.node = NodeReport::from_node(&n);
                reached.push(Reached {
                    entry: report.standbys.len(),
                    name,
                    hosts: info.hosts(),
                    measured: n.facts.in_recovery,
                    node: n,
                    broken: false,
                });
            }
            Err(e) => {
                entry.node = NodeReport::from_error(&info, &e);
                problems.push(format!("standby {name}: {e}"));
            }
        }
        report.standbys.push(entry);
    }
    reached
}

/// The first measured standby (the tier-0 one) is `standby` in the report, with its
/// coverage; without one, the first of the topology.
fn show_first_standby(report: &mut StatusReport, reached: &[Reached]) {
    let first = reached
        .iter()
        .find(|s| s.measured)
        .map(|s| report.standbys[s.entry].clone())
        .or_else(|| report.standbys.first().cloned());
    if let Some(s) = first {
        report.standby = s.node;
        report.missing = s.missing;
        report.coverage = s.coverage;
    }
}

/// The primary's counters and hot set, and each measured standby's coverage of it. Returns
/// whether a call broke the primary's session (a standby's is marked in its entry).
async fn collect_numbers(
    report: &mut StatusReport,
    primary: &mut Node,
    standbys: &mut [Reached],
) -> bool {
    report.ccm_enabled = Some(true);
    let mut broken = false;
    match primary.ccm_status().await {
        Ok(s) => {
            report.buffers_sent_per_second = Some(s.buffers_sent_last_minute as f64 / 60.0);
            report.buffers_found_per_second = Some(s.buffers_found_last_minute as f64 / 60.0);
            report.status = Some(s);
        }
        Err(e) => broken |= note_error(report, e),
    }
    match primary.wal_cache().await {
        Ok(w) => report.wal_cache = w,
        Err(e) => broken |= note_error(report, e),
    }
    let hot = match primary.hot_buffers_count(None).await {
        Ok(h) => h,
        Err(e) => return broken | note_error(report, e),
    };
    report.hot_buffers = Some(hot);
    for s in standbys.iter_mut().filter(|s| s.measured) {
        let filter = match s.node.buffer_filter(STATUS_FALSE_POSITIVE_RATE).await {
            Ok((true, f)) => f,
            Ok((false, _)) => {
                promoted(report, s);
                continue;
            }
            Err(e) => {
                s.broken = note_error(report, e);
                continue;
            }
        };
        match primary.hot_buffers_count(Some(&filter)).await {
            Ok(missing) => {
                let entry = &mut report.standbys[s.entry];
                entry.missing = Some(missing);
                entry.coverage = Some(coverage(hot.max(0) as u64, missing.max(0) as u64));
            }
            Err(e) => broken |= note_error(report, e),
        }
    }
    broken
}

/// The most slices of the primary's page cache a look reads (1 GB of cached blocks or
/// 2048 files or 8 GB of files each): a bound, not a figure any real node reaches.
const OS_MAX_SLICES: usize = 65_536;

/// The primary's page cache of relation files (a walk of all its files, in slices), and what
/// each measured standby with extension 0.9.0 holds of it (counted by the standby, nothing
/// read). Returns whether a call broke the primary's session.
async fn collect_os_numbers(
    report: &mut StatusReport,
    primary: &mut Node,
    standbys: &mut [Reached],
) -> bool {
    let mut lists = Vec::new();
    let mut blocks = 0u64;
    let mut after = Cursor::START;
    for _ in 0..OS_MAX_SLICES {
        match primary
            .os_cached_blocks(after, oscache::SLICE_BLOCKS, oscache::SLICE_FILES)
            .await
        {
            Ok((_, answer)) => {
                if !answer.in_play {
                    // Direct I/O: no page cache to hold, every standby holds all of it.
                    lists.clear();
                    blocks = 0;
                    break;
                }
                blocks += answer.blocks;
                if answer.blocks > 0 {
                    lists.push(answer.list);
                }
                if answer.complete {
                    break;
                }
                after = answer.last;
            }
            Err(e) => return note_error(report, e),
        }
    }
    report.os_cache_bytes = Some(blocks.saturating_mul(BLOCK_BYTES));
    for s in standbys
        .iter_mut()
        .filter(|s| s.measured && s.node.has_os_cache())
    {
        let mut held = 0u64;
        let mut counted = true;
        for list in &lists {
            match s.node.os_prefetch(list, false).await {
                Ok((true, done)) => held += done.already_cached,
                Ok((false, _)) => {
                    promoted(report, s);
                    counted = false;
                    break;
                }
                Err(e) => {
                    s.broken = note_error(report, e);
                    counted = false;
                    break;
                }
            }
        }
        if counted {
            let entry = &mut report.standbys[s.entry];
            entry.os_held_bytes = Some(held.saturating_mul(BLOCK_BYTES));
            entry.os_coverage = Some(
                oscache::Coverage {
                    primary_blocks: blocks,
                    held_blocks: held,
                    limited: false,
                }
                .share(),
            );
        }
    }
    false
}

/// A standby promoted since its session was made (the session was kept from an earlier
/// look): a primary now, shown as one and not measured.
fn promoted(report: &mut StatusReport, standby: &mut Reached) {
    standby.node.facts.in_recovery = false;
    standby.measured = false;
    report.standbys[standby.entry].node.role = Some(node::role_name(false));
}

/// `check-config --connect`: both sides strictly resolved and of one system. Returns lines to
/// print, and whether all is well.
pub async fn check_connections(cfg: Arc<Config>, cancel: CancellationToken) -> (Vec<String>, bool) {
    let mut lines = Vec::new();
    let patroni = patroni::Client::new();
    let topology = match topology::discover(&cfg, &patroni, cfg.connect_timeout, &cancel).await {
        Ok(t) => t,
        Err(e) => return (vec![format!("topology: FAILED: {e}")], false),
    };
    if let Some(leader) = &topology.leader {
        lines.push(format!(
            "Patroni: leader {leader}, {} failover candidates",
            topology.targets.len()
        ));
    }
    let primary = node::resolve(
        &topology.primary,
        Side::Primary,
        options(&cfg),
        &cancel,
        true,
    )
    .await;
    let mut ok = true;
    let describe = |n: &Node| {
        format!(
            "{} ok (role {}, system {}, pg_ccm {}, library {}, PostgreSQL {}, shared_buffers {} blocks){}",
            n.label(),
            n.role(),
            n.facts.system_identifier,
            n.facts.extension_version.as_deref().unwrap_or("?"),
            n.facts.library_version.as_deref().unwrap_or("unknown"),
            n.facts.server_version,
            n.facts.shared_buffers,
            n.catalog_behind()
                .map(|w| format!("; warning: {w}"))
                .unwrap_or_default()
        )
    };
    match &primary {
        Ok(n) => lines.push(format!("primary: {}", describe(n))),
        Err(e) => {
            ok = false;
            lines.push(format!("primary: FAILED: {e}"));
        }
    }
    let mut standbys = 0;
    for (name, _, node) in connect_standbys(&cfg, &topology, Vec::new(), &cancel).await {
        // "standby: db2:5432 ok", or with Patroni "standby pg2: db2:5432 ok".
        let side = match &node {
            Ok(n) if n.label() == name => "standby".to_string(),
            _ => format!("standby {name}"),
        };
        let node = match node {
            Ok(n) if !n.facts.in_recovery => {
                lines.push(format!(
                    "{side}: {} is not in recovery, not warmed",
                    n.label()
                ));
                continue;
            }
            Ok(n) => n,
            Err(e) => {
                ok = false;
                lines.push(format!("{side}: FAILED: {e}"));
                continue;
            }
        };
        standbys += 1;
        let pairing = match (&primary, node.require_extension()) {
            (_, Err(e)) => Err(e.to_string()),
            (Ok(p), Ok(())) => node::check_same_system(p, &node),
            (Err(_), Ok(())) => Ok(()),
        };
        match pairing {
            Ok(()) => lines.push(format!("{side}: {}", describe(&node))),
            Err(message) => {
                ok = false;
                lines.push(format!("{side}: FAILED: {message}"));
            }
        }
    }
    if standbys == 0 {
        ok = false;
        lines.push("standby: FAILED: no host of the topology is a standby".to_string());
    } else if ok {
        lines.push("pairing: ok (same system identifier)".to_string());
    }
    (lines, ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StatusReport {
        let node = |role: &'static str, port: u16| NodeReport {
            host: Some("127.0.0.1".into()),
            port: Some(port),
            role: Some(role),
            system_identifier: Some("7312345678901234567".into()),
            extension_version: Some("0.7.0".into()),
            library_version: Some("0.7.0".into()),
            server_version: Some("15.8".into()),
            error: None,
        };
        StatusReport {
            primary: node("primary", 5432),
            standby: node("standby", 5433),
            standbys: vec![StandbyStatus {
                name: "127.0.0.1:5433".into(),
                node: node("standby", 5433),
                missing: Some(20),
                coverage: Some(coverage(1000, 20)),
                os_held_bytes: Some(3 << 30),
                os_coverage: Some(0.75),
            }],
            leader: None,
            excluded: vec![],
            active_agent: Some(Holder {
                pid: 4711,
                application_name: Some("ccm-agent".into()),
                client_addr: Some("10.0.0.7".into()),
                client_port: Some(50432),
            }),
            active_agent_checked: true,
            ccm_enabled: Some(true),
            hot_buffers: Some(1000),
            missing: Some(20),
            coverage: Some(coverage(1000, 20)),
            os_cache_bytes: Some(4 << 30),
            status: Some(CcmStatus {
                buffers_sent_last_minute: 600,
                buffers_found_last_minute: 6000,
                ..Default::default()
            }),
            buffers_sent_per_second: Some(10.0),
            buffers_found_per_second: Some(100.0),
            wal_cache: Some(WalCacheStatus {
                mode: "partly locked".into(),
                size_blocks: 2048,
                held_blocks: 2048,
                locked_blocks: 1024,
                oldest_ptr: Some("0/3000000".into()),
                newest_ptr: Some("0/4000000".into()),
                slots: vec![crate::node::WalCacheSlot {
                    name: "debezium".into(),
                    active_pid: Some(4242),
                    cache_hit: 999,
                    cache_miss: 1,
                    blks_read: 1000,
                    hit_rate: Some("99.90%".into()),
                }],
            }),
            ok: true,
            problems: vec![],
        }
    }

    #[test]
    fn json_shape() {
        let v = serde_json::to_value(sample()).unwrap();
        for side in ["primary", "standby"] {
            for key in [
                "host",
                "port",
                "role",
                "system_identifier",
                "extension_version",
                "library_version",
            ] {
                assert!(v[side].get(key).is_some(), "{side}.{key} missing: {v}");
            }
        }
        assert_eq!(v["primary"]["role"], "primary");
        assert_eq!(v["primary"]["library_version"], "0.7.0");
        assert_eq!(v["standby"]["port"], 5433);
        assert_eq!(v["hot_buffers"], 1000);
        assert_eq!(v["missing"], 20);
        assert_eq!(v["coverage"], 0.98);
        for key in [
            "buffers_sent_last_minute",
            "buffers_found_last_minute",
            "buffers_sent_last_scan",
            "buffers_found_last_scan",
            "buffers_sent_current_scan",
            "buffers_found_current_scan",
            "current_scan_progress",
        ] {
            assert!(v["status"][key].is_i64(), "status.{key}: {v}");
        }
        assert_eq!(v["wal_cache"]["mode"], "partly locked");
        assert_eq!(v["wal_cache"]["slots"][0]["hit_rate"], "99.90%");
        assert_eq!(v["wal_cache"]["slots"][0]["cache_miss"], 1);
        assert_eq!(v["ok"], true);
        assert!(v["problems"].as_array().unwrap().is_empty());
        assert_eq!(v["active_agent"]["pid"], 4711);
        assert_eq!(v["active_agent"]["application_name"], "ccm-agent");
        assert_eq!(v["active_agent"]["client_addr"], "10.0.0.7");
        assert_eq!(v["active_agent_checked"], true);
    }

    #[test]
    fn the_active_agent_is_named_or_none() {
        let mut r = sample();
        let text = r.to_text();
        assert!(
            text.contains(
                "agent    active: pid 4711, application_name ccm-agent, client 10.0.0.7:50432"
            ),
            "{text}"
        );
        r.active_agent = None;
        assert!(
            r.to_text().contains("agent    active: none"),
            "{}",
            r.to_text()
        );
        r.active_agent_checked = false;
        assert!(!r.to_text().contains("agent "), "{}", r.to_text());
        assert!(serde_json::to_value(&r).unwrap()["active_agent"].is_null());
    }

    #[test]
    fn unknown_values_are_null_in_json() {
        let r = StatusReport {
            problems: vec!["primary: down".into()],
            ..Default::default()
        };
        let v = serde_json::to_value(r).unwrap();
        assert!(v["primary"]["host"].is_null());
        assert!(v["primary"]["library_version"].is_null());
        assert!(v["coverage"].is_null());
        assert!(v["status"].is_null());
        assert_eq!(v["ok"], false);
    }

    #[test]
    fn text_mentions_everything() {
        let text = sample().to_text();
        assert!(text.contains("127.0.0.1:5432"), "{text}");
        assert!(text.contains("role standby"), "{text}");
        assert!(text.contains("pg_ccm 0.7.0 (library 0.7.0)"), "{text}");
        assert!(text.contains("coverage 98.0%"), "{text}");
        assert!(text.contains("(10.0/s)"), "{text}");
        assert!(
            text.contains(
                "WAL cache    partly locked: 2048 of 2048 pages held (16.0 MiB), 1024 locked"
            ),
            "{text}"
        );
        assert!(
            text.contains("slot debezium")
                && text.contains("99.90%")
                && text.contains("active pid 4242"),
            "{text}"
        );
        assert!(!text.contains("PROBLEM"), "{text}");
    }

    #[test]
    fn a_node_not_used_is_shown_with_its_reason() {
        let mut r = sample();
        let why = "127.0.0.1:5433: the pg_ccm library this server has loaded (older than \
                   0.7.0) is older than the extension's catalog (0.7.0); install pg_ccm 0.7.0 \
                   on this node and restart it (libraries on every node first, then ALTER \
                   EXTENSION pg_ccm UPDATE)";
        r.standbys[0].node.library_version = None;
        r.standbys[0].node.error = Some(why.into());
        r.standbys[0].coverage = None;
        let text = r.to_text();
        assert!(
            text.contains(
                "role standby  system 7312345678901234567  pg_ccm 0.7.0 (library unknown)"
            ),
            "{text}"
        );
        assert!(
            text.contains(&format!("127.0.0.1:5433  NOT USED: {why}")),
            "{text}"
        );
        assert!(!text.contains("UNREACHABLE"), "{text}");
        let v = serde_json::to_value(&r).unwrap();
        assert!(v["standbys"][0]["library_version"].is_null(), "{v}");
        assert_eq!(v["standbys"][0]["error"], why);
    }

    #[tokio::test]
    async fn unreachable_nodes_make_a_failed_report() {
        let cfg = Config::validate(crate::config::RawConfig {
            primary: Some("host=127.0.0.1 port=1 user=u dbname=d".into()),
            standby: Some("host=127.0.0.1 port=2 user=u dbname=d".into()),
            connect_timeout: Some("2s".into()),
            ..Default::default()
        })
        .unwrap();
        let report = gather(Arc::new(cfg), CancellationToken::new()).await;
        assert!(!report.ok);
        assert_eq!(report.problems.len(), 2, "{:?}", report.problems);
        assert_eq!(report.primary.host.as_deref(), Some("127.0.0.1"));
        assert_eq!(report.primary.port, Some(1));
        assert!(report.primary.error.is_some());
        assert!(report.coverage.is_none());
    }
}

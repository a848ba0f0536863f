//! `ccm-agent status` (one screen about the pairing) and the connect part of
//! `check-config --connect`.
//!
//! Status connects leniently: when no host of a side has the expected role it still shows the
//! first reachable one, because "the standby side points at a primary" is exactly what an
//! operator needs to see. Anything that would stop `run` from syncing (a node unreachable, a
//! wrong role, different systems, a missing extension, a library older than the catalog)
//! makes the exit code non-zero.

use std::fmt::Write as _;
use std::sync::Arc;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::conninfo::ConnInfo;
use crate::metrics::coverage;
use crate::node::{self, CcmStatus, ConnectOptions, Node, NodeError, Side, WalCacheStatus};
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
    /// false when the extension reports the Cluster Cache Manager disabled.
    pub ccm_enabled: Option<bool>,
    /// Hot buffers on the primary (ccm_hot_buffers()).
    pub hot_buffers: Option<i64>,
    /// Hot buffers the first standby's filter lacks.
    pub missing: Option<i64>,
    /// 1 - missing/hot_buffers, 0..1 (1 when nothing is hot), on the first standby.
    pub coverage: Option<f64>,
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
        }
        if self.standbys.is_empty() {
            node_line(&mut out, "standby", &self.standby);
        }
        for (name, why) in &self.excluded {
            let _ = writeln!(out, "skipped  {name} ({why})");
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

fn mib(blocks: i64) -> String {
    format!("{:.1} MiB", blocks as f64 * 8192.0 / (1024.0 * 1024.0))
}

fn options(cfg: &Config) -> ConnectOptions {
    ConnectOptions {
        connect_timeout: cfg.connect_timeout,
        statement_timeout: cfg.statement_timeout,
    }
}

/// Records a query error: a disabled CCM is a state, anything else a problem.
fn note_error(report: &mut StatusReport, error: NodeError) {
    match error {
        NodeError::Disabled { .. } => report.ccm_enabled = Some(false),
        e => report.problems.push(e.to_string()),
    }
}

/// Connects to every standby of the topology (any role, so that it can be shown).
async fn connect_standbys(
    cfg: &Config,
    topology: &Topology,
    cancel: &CancellationToken,
) -> Vec<(String, ConnInfo, Result<Node, NodeError>)> {
    let mut connected = Vec::new();
    for t in &topology.targets {
        let node = match t.conninfo.hosts().first() {
            Some(host) => {
                Node::connect(&t.conninfo, host, Side::Standby, options(cfg), cancel).await
            }
            None => Err(NodeError::NoMatch {
                side: Side::Standby,
                tried: "no host".into(),
            }),
        };
        connected.push((t.name.clone(), t.conninfo.clone(), node));
    }
    connected
}

/// Gathers the status report. Never fails: what could not be learned is a problem in it.
pub async fn gather(cfg: Arc<Config>, cancel: CancellationToken) -> StatusReport {
    let mut report = StatusReport::default();
    let topology = match topology::discover(&cfg, cfg.connect_timeout, &cancel).await {
        Ok(t) => t,
        Err(e) => {
            report.problems.push(format!("topology: {e}"));
            return report;
        }
    };
    report.leader = topology.leader.clone();
    report.excluded = topology.excluded.clone();
    let (primary, standbys) = tokio::join!(
        node::resolve(
            &topology.primary,
            Side::Primary,
            options(&cfg),
            &cancel,
            false
        ),
        connect_standbys(&cfg, &topology, &cancel),
    );
    let mut primary = match primary {
        Ok(n) => {
            if n.facts.in_recovery {
                report.problems.push(format!(
                    "the primary connection string leads to {}, which is a standby, not a primary",
                    n.label()
                ));
            }
            report.primary = NodeReport::from_node(&n);
            // Nothing of pg_ccm is called on it then, so no number can be had.
            if let Err(e) = n.require_library() {
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
    };
    let mut nodes = Vec::new();
    let mut standby_problems = Vec::new();
    for (name, info, node) in standbys {
        let mut entry = StandbyStatus {
            name: name.clone(),
            ..Default::default()
        };
        match node {
            Ok(n) => {
                entry.node = NodeReport::from_node(&n);
                nodes.push((report.standbys.len(), n));
            }
            Err(e) => {
                entry.node = NodeReport::from_error(&info, &e);
                standby_problems.push(format!("standby {name}: {e}"));
            }
        }
        report.standbys.push(entry);
    }
    // A host of the standby string that is the primary is passed over, as `run` does;
    // only a topology without any standby is a problem.
    nodes.retain(|(_, n)| n.facts.in_recovery);
    if nodes.is_empty() && !report.standbys.iter().all(|s| s.node.error.is_some()) {
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
    if let Some(Err(e)) = primary
        .as_ref()
        .or(nodes.first().map(|(_, n)| n))
        .map(Node::require_catalog)
    {
        report.problems.push(e.to_string());
    }
    // Problems so far concern the primary or the whole topology: without a sound primary
    // no number means anything. A standby that is down or of another system is a problem
    // of its own, and the others are still measured (a rolling restart waits on them).
    let blocked = !report.problems.is_empty();
    // A standby whose library is older than the catalog is not called (its coverage stays
    // unknown): a problem of its own, as `run` has it.
    nodes.retain(|(i, s)| match s.require_library() {
        Ok(()) => true,
        Err(e) => {
            let entry = &mut report.standbys[*i];
            entry.node.error = Some(e.to_string());
            standby_problems.push(format!("standby {}: {e}", entry.name));
            false
        }
    });
    if let Some(p) = &primary {
        let mut others = Vec::new();
        nodes.retain(|(i, s)| match node::check_same_system(p, s) {
            Ok(()) => true,
            Err(message) => {
                others.push((*i, message));
                false
            }
        });
        for (i, message) in others {
            report.standbys[i].node.error = Some(message.clone());
            report.problems.push(message);
        }
    }
    report.standby = match nodes.first() {
        Some((i, _)) => report.standbys[*i].node.clone(),
        None => report
            .standbys
            .first()
            .map(|s| s.node.clone())
            .unwrap_or_default(),
    };
    if !blocked {
        if let Some(p) = primary.as_mut() {
            collect_numbers(&mut report, p, &mut nodes).await;
        }
    }
    report.problems.extend(standby_problems);
    report.ok = report.problems.is_empty();
    report
}

async fn collect_numbers(
    report: &mut StatusReport,
    primary: &mut Node,
    standbys: &mut [(usize, Node)],
) {
    report.ccm_enabled = Some(true);
    match primary.ccm_status().await {
        Ok(s) => {
            report.buffers_sent_per_second = Some(s.buffers_sent_last_minute as f64 / 60.0);
            report.buffers_found_per_second = Some(s.buffers_found_last_minute as f64 / 60.0);
            report.status = Some(s);
        }
        Err(e) => note_error(report, e),
    }
    match primary.wal_cache().await {
        Ok(w) => report.wal_cache = w,
        Err(e) => note_error(report, e),
    }
    let hot = match primary.hot_buffers_count(None).await {
        Ok(h) => h,
        Err(e) => {
            note_error(report, e);
            return;
        }
    };
    report.hot_buffers = Some(hot);
    for (first, (i, standby)) in standbys.iter_mut().enumerate() {
        let filter = match standby.buffer_filter(STATUS_FALSE_POSITIVE_RATE).await {
            Ok((_, f)) => f,
            Err(e) => {
                note_error(report, e);
                continue;
            }
        };
        match primary.hot_buffers_count(Some(&filter)).await {
            Ok(missing) => {
                let c = coverage(hot.max(0) as u64, missing.max(0) as u64);
                report.standbys[*i].missing = Some(missing);
                report.standbys[*i].coverage = Some(c);
                if first == 0 {
                    report.missing = Some(missing);
                    report.coverage = Some(c);
                }
            }
            Err(e) => note_error(report, e),
        }
    }
}

/// `check-config --connect`: both sides strictly resolved and of one system. Returns lines to
/// print, and whether all is well.
pub async fn check_connections(cfg: Arc<Config>, cancel: CancellationToken) -> (Vec<String>, bool) {
    let mut lines = Vec::new();
    let topology = match topology::discover(&cfg, cfg.connect_timeout, &cancel).await {
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
    for (name, _, node) in connect_standbys(&cfg, &topology, &cancel).await {
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
            }],
            leader: None,
            excluded: vec![],
            ccm_enabled: Some(true),
            hot_buffers: Some(1000),
            missing: Some(20),
            coverage: Some(coverage(1000, 20)),
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

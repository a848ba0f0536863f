//! One connection to one node, and every SQL call the agent makes.
//!
//! Each session is set up so that it can never get in the way of the node it watches:
//! `statement_timeout` bounds every call, `lock_timeout=1s` and
//! `idle_in_transaction_session_timeout=10s` are a second line of defence (the agent opens no
//! explicit transaction and takes no lock), and `application_name=ccm-agent` makes the
//! sessions easy to find in pg_stat_activity. Every call also has a client-side deadline, so
//! a node that stops answering without closing the socket (a partition, a SIGSTOPped server)
//! is noticed, and every call gives way to shutdown by cancelling its statement server-side.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{AsyncMessage, Client, NoTls, Row, Statement};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::conninfo::{ConnInfo, HostSpec};

pub const APPLICATION_NAME: &str = "ccm-agent";

/// The message the extension raises (SQLSTATE 55000) while `ccm.enabled = off`.
pub const DISABLED_MESSAGE: &str = "Cluster Cache Manager is disabled";

/// How long shutdown waits for a server to acknowledge a cancel request.
const CANCEL_GRACE: Duration = Duration::from_millis(500);

/// Which end of the pairing a connection serves. The primary side is the source of hot
/// blocks and must not be in recovery; the standby side is the target and must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    Primary,
    Standby,
}

impl Side {
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Primary => "primary",
            Side::Standby => "standby",
        }
    }

    pub fn wants_recovery(self) -> bool {
        self == Side::Standby
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The role a node reports through pg_is_in_recovery().
pub fn role_name(in_recovery: bool) -> &'static str {
    if in_recovery {
        "standby"
    } else {
        "primary"
    }
}

/// What a node says about itself right after connecting.
#[derive(Debug, Clone)]
pub struct NodeFacts {
    pub in_recovery: bool,
    pub system_identifier: String,
    /// shared_buffers in 8 kB blocks.
    pub shared_buffers: i64,
    pub database: String,
    pub extension_version: Option<String>,
    pub server_version: String,
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{host}: cannot connect: {}", describe(.source))]
    Connect {
        host: String,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("{host}: connection attempt timed out after {}", humantime::format_duration(*.after))]
    ConnectTimeout { host: String, after: Duration },
    #[error("extension pg_ccm is not installed in database {database} on {host}; run CREATE EXTENSION pg_ccm on the primary")]
    ExtensionMissing { host: String, database: String },
    #[error("Cluster Cache Manager is disabled on {host} (ccm.enabled = off)")]
    Disabled { host: String },
    #[error("{host}: {what} failed: {}", describe(.source))]
    Query {
        host: String,
        what: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("{host}: {what} got no answer within {} (client-side deadline)", humantime::format_duration(*.after))]
    QueryTimeout {
        host: String,
        what: &'static str,
        after: Duration,
    },
    #[error("{host}: {what} returned {detail}")]
    Unexpected {
        host: String,
        what: &'static str,
        detail: String,
    },
    #[error("no {side} found among the hosts of the {side} connection string: {tried}")]
    NoMatch { side: Side, tried: String },
    #[error("cancelled")]
    Cancelled,
}

/// A database error as "ERROR: message (SQLSTATE xxxxx)", other errors as tokio-postgres says.
fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => {
            let mut s = format!(
                "{}: {} (SQLSTATE {})",
                db.severity(),
                db.message(),
                db.code().code()
            );
            if let Some(detail) = db.detail() {
                s.push_str(&format!("; detail: {detail}"));
            }
            s
        }
        None => {
            // tokio-postgres puts the cause (e.g. "Connection refused") in the source chain.
            let mut s = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(cause) = source {
                let text = cause.to_string();
                if !s.contains(&text) {
                    s.push_str(&format!(": {text}"));
                }
                source = cause.source();
            }
            s
        }
    }
}

impl NodeError {
    /// Whether the connection that produced this error is useless now. A server-side ERROR
    /// leaves the session fine (a statement timeout, a recovery conflict); anything on the
    /// wire (closed socket, I/O error, our own deadline) means reconnect.
    pub fn breaks_connection(&self) -> bool {
        match self {
            NodeError::Query { source, .. } => source.as_db_error().is_none() || source.is_closed(),
            NodeError::Disabled { .. } | NodeError::Unexpected { .. } => false,
            _ => true,
        }
    }
}

fn is_disabled(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_some_and(|db| {
        *db.code() == SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE
            && db.message().contains(DISABLED_MESSAGE)
    })
}

#[derive(Debug, Clone, Copy)]
pub struct ConnectOptions {
    pub connect_timeout: Duration,
    pub statement_timeout: Duration,
}

impl ConnectOptions {
    /// The client-side deadline of a call: the server's own timeout plus room for the
    /// network, so the server normally gives up first and says why.
    fn call_deadline(&self) -> Duration {
        self.statement_timeout + self.connect_timeout.max(Duration::from_secs(2))
    }
}

/// Counters returned by `ccm_prewarm`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PrewarmResult {
    pub requested: i64,
    pub loaded: i64,
    pub already_cached: i64,
    pub skipped: i64,
}

/// The one row of `aurora_ccm_status()`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CcmStatus {
    pub buffers_sent_last_minute: i64,
    pub buffers_found_last_minute: i64,
    pub buffers_sent_last_scan: i64,
    pub buffers_found_last_scan: i64,
    pub buffers_sent_current_scan: i64,
    pub buffers_found_current_scan: i64,
    pub current_scan_progress: i64,
}

/// The logical WAL cache of a primary (`ccm_logical_wal_cache_status()`).
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct WalCacheStatus {
    /// off, starting, empty, locked, partly locked or mapped.
    pub mode: String,
    pub size_blocks: i64,
    pub held_blocks: i64,
    pub locked_blocks: i64,
    pub oldest_ptr: Option<String>,
    pub newest_ptr: Option<String>,
    pub slots: Vec<WalCacheSlot>,
}

/// One row of `aurora_stat_logical_wal_cache()`.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct WalCacheSlot {
    pub name: String,
    pub active_pid: Option<i32>,
    pub cache_hit: i64,
    pub cache_miss: i64,
    pub blks_read: i64,
    pub hit_rate: Option<String>,
}

/// The first extension version with the logical WAL cache.
const WAL_CACHE_SINCE: (u32, u32) = (0, 2);

fn has_wal_cache(extension_version: Option<&str>) -> bool {
    let Some(version) = extension_version else {
        return false;
    };
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= WAL_CACHE_SINCE
}

const SQL_FACTS: &str = "SELECT pg_is_in_recovery(), \
     (SELECT system_identifier FROM pg_control_system())::text, \
     (SELECT setting::int8 FROM pg_settings WHERE name = 'shared_buffers'), \
     current_database()::text, \
     (SELECT extversion FROM pg_extension WHERE extname = 'pg_ccm')::text, \
     split_part(current_setting('server_version'), ' ', 1)";
const SQL_FILTER: &str = "SELECT pg_is_in_recovery(), ccm_buffer_filter($1::float8)";
const SQL_HOT_BLOCKS: &str = "SELECT pg_is_in_recovery(), ccm_hot_blocks($1::bytea, $2::int8)";
const SQL_PREWARM: &str =
    "SELECT requested, loaded, already_cached, skipped FROM ccm_prewarm($1::bytea)";
const SQL_STATUS: &str = "SELECT buffers_sent_last_minute, buffers_found_last_minute, \
     buffers_sent_last_scan, buffers_found_last_scan, buffers_sent_current_scan, \
     buffers_found_current_scan, current_scan_progress FROM aurora_ccm_status()";
const SQL_WAL_CACHE: &str = "SELECT mode, size_blocks, held_blocks, locked_blocks, \
     oldest_ptr::text, newest_ptr::text FROM ccm_logical_wal_cache_status()";
const SQL_WAL_CACHE_SLOTS: &str = "SELECT name, active_pid, cache_hit, cache_miss, blks_read, \
     hit_rate FROM aurora_stat_logical_wal_cache() ORDER BY name";
const SQL_HOT_COUNT: &str = "SELECT count(*) FROM ccm_hot_buffers()";
const SQL_MISSING_COUNT: &str = "SELECT count(*) FROM ccm_hot_buffers($1::bytea)";

/// A live session on one node.
pub struct Node {
    pub side: Side,
    pub host: HostSpec,
    pub facts: NodeFacts,
    client: Client,
    options: ConnectOptions,
    cancel: CancellationToken,
    /// Prepared once per session: the loop runs the same few statements every second.
    statements: HashMap<&'static str, Statement>,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node")
            .field("side", &self.side)
            .field("host", &self.host.to_string())
            .field("facts", &self.facts)
            .finish()
    }
}

impl Node {
    /// Connects to one host, sets the session up and reads its facts. The role is not
    /// judged here (see `resolve`).
    pub async fn connect(
        info: &ConnInfo,
        host: &HostSpec,
        side: Side,
        options: ConnectOptions,
        cancel: &CancellationToken,
    ) -> Result<Node, NodeError> {
        let label = host.to_string();
        let config = info.host_config(host, APPLICATION_NAME, options.connect_timeout);
        // NoTls for now: sslmode=require fails to connect; TLS support is an open item.
        let connecting = tokio::time::timeout(options.connect_timeout, config.connect(NoTls));
        let (client, mut connection) = tokio::select! {
            _ = cancel.cancelled() => return Err(NodeError::Cancelled),
            r = connecting => match r {
                Err(_) => return Err(NodeError::ConnectTimeout { host: label, after: options.connect_timeout }),
                Ok(Err(source)) => return Err(NodeError::Connect { host: label, source }),
                Ok(Ok(pair)) => pair,
            },
        };
        // The connection object does the I/O; it ends by itself when the client is dropped.
        let conn_label = label.clone();
        tokio::spawn(async move {
            loop {
                match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                    Some(Ok(AsyncMessage::Notice(n))) => {
                        debug!(host = %conn_label, "server {}: {}", n.severity(), n.message())
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        debug!(host = %conn_label, "connection ended: {e}");
                        break;
                    }
                    None => break,
                }
            }
        });
        let mut node = Node {
            side,
            host: host.clone(),
            facts: NodeFacts {
                in_recovery: false,
                system_identifier: String::new(),
                shared_buffers: 0,
                database: String::new(),
                extension_version: None,
                server_version: String::new(),
            },
            client,
            options,
            cancel: cancel.clone(),
            statements: HashMap::new(),
        };
        // One statement, so no implicit transaction block; values are integers we format.
        let setup = format!(
            "SELECT set_config('statement_timeout', '{}ms', false), \
                    set_config('lock_timeout', '1s', false), \
                    set_config('idle_in_transaction_session_timeout', '10s', false)",
            options.statement_timeout.as_millis().max(1)
        );
        node.guarded("session setup", async {
            node.client.simple_query(&setup).await.map(|_| ())
        })
        .await?;
        let row = node.query_one("node facts query", SQL_FACTS, &[]).await?;
        node.facts = NodeFacts {
            in_recovery: row.get(0),
            system_identifier: row.get::<_, Option<String>>(1).unwrap_or_default(),
            shared_buffers: row.get::<_, Option<i64>>(2).unwrap_or(0),
            database: row.get(3),
            extension_version: row.get(4),
            server_version: row.get(5),
        };
        Ok(node)
    }

    pub fn label(&self) -> String {
        self.host.to_string()
    }

    pub fn role(&self) -> &'static str {
        role_name(self.facts.in_recovery)
    }

    pub fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    /// The error for a node of the right role that lacks the extension.
    pub fn require_extension(&self) -> Result<(), NodeError> {
        match self.facts.extension_version {
            Some(_) => Ok(()),
            None => Err(NodeError::ExtensionMissing {
                host: self.label(),
                database: self.facts.database.clone(),
            }),
        }
    }

    /// Runs one call with the client-side deadline, giving way to shutdown. On either, the
    /// statement is cancelled server-side so the node does not keep working for nobody.
    async fn guarded<T>(
        &self,
        what: &'static str,
        call: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, NodeError> {
        let deadline = self.options.call_deadline();
        let outcome = tokio::select! {
            biased;
            _ = self.cancel.cancelled() => None,
            r = tokio::time::timeout(deadline, call) => Some(r),
        };
        match outcome {
            None => {
                self.cancel_running().await;
                Err(NodeError::Cancelled)
            }
            Some(Err(_)) => {
                self.cancel_running().await;
                Err(NodeError::QueryTimeout {
                    host: self.label(),
                    what,
                    after: deadline,
                })
            }
            Some(Ok(Err(source))) if is_disabled(&source) => {
                Err(NodeError::Disabled { host: self.label() })
            }
            Some(Ok(Err(source))) => Err(NodeError::Query {
                host: self.label(),
                what,
                source,
            }),
            Some(Ok(Ok(v))) => Ok(v),
        }
    }

    async fn cancel_running(&self) {
        let token = self.client.cancel_token();
        match tokio::time::timeout(CANCEL_GRACE, token.cancel_query(NoTls)).await {
            Ok(Ok(())) => debug!(host = %self.label(), "cancelled the running statement"),
            Ok(Err(e)) => debug!(host = %self.label(), "cancel request failed: {e}"),
            Err(_) => debug!(host = %self.label(), "cancel request timed out"),
        }
    }

    async fn statement(
        &mut self,
        what: &'static str,
        sql: &'static str,
    ) -> Result<Statement, NodeError> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        let s = self.guarded(what, self.client.prepare(sql)).await?;
        self.statements.insert(sql, s.clone());
        Ok(s)
    }

    async fn query_one(
        &mut self,
        what: &'static str,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, NodeError> {
        let stmt = self.statement(what, sql).await?;
        let result = self
            .guarded(what, self.client.query_one(&stmt, params))
            .await;
        if matches!(result, Err(NodeError::Query { .. })) {
            // A server error may come from a changed catalog (extension re-created or
            // upgraded): prepare afresh next time.
            self.statements.clear();
        }
        result
    }

    /// Standby: its bloom filter, with its recovery state at the same instant.
    pub async fn buffer_filter(
        &mut self,
        false_positive_rate: f64,
    ) -> Result<(bool, Vec<u8>), NodeError> {
        let row = self
            .query_one("ccm_buffer_filter()", SQL_FILTER, &[&false_positive_rate])
            .await?;
        let filter: Option<Vec<u8>> = row.get(1);
        let filter = filter.ok_or_else(|| NodeError::Unexpected {
            host: self.label(),
            what: "ccm_buffer_filter()",
            detail: "NULL".into(),
        })?;
        Ok((row.get(0), filter))
    }

    /// Primary: its hot blocks missing from `filter`, at most `max_blocks`, with its recovery
    /// state at the same instant.
    pub async fn hot_blocks(
        &mut self,
        filter: &[u8],
        max_blocks: i64,
    ) -> Result<(bool, Vec<u8>), NodeError> {
        let row = self
            .query_one("ccm_hot_blocks()", SQL_HOT_BLOCKS, &[&filter, &max_blocks])
            .await?;
        let list: Option<Vec<u8>> = row.get(1);
        let list = list.ok_or_else(|| NodeError::Unexpected {
            host: self.label(),
            what: "ccm_hot_blocks()",
            detail: "NULL".into(),
        })?;
        Ok((row.get(0), list))
    }

    /// Standby: reads one batch of blocks into shared_buffers.
    pub async fn prewarm(&mut self, list: &[u8]) -> Result<PrewarmResult, NodeError> {
        let row = self
            .query_one("ccm_prewarm()", SQL_PREWARM, &[&list])
            .await?;
        Ok(PrewarmResult {
            requested: row.get::<_, Option<i64>>(0).unwrap_or(0),
            loaded: row.get::<_, Option<i64>>(1).unwrap_or(0),
            already_cached: row.get::<_, Option<i64>>(2).unwrap_or(0),
            skipped: row.get::<_, Option<i64>>(3).unwrap_or(0),
        })
    }

    /// Primary: the row of aurora_ccm_status().
    pub async fn ccm_status(&mut self) -> Result<CcmStatus, NodeError> {
        let row = self
            .query_one("aurora_ccm_status()", SQL_STATUS, &[])
            .await?;
        let v = |i: usize| row.get::<_, Option<i64>>(i).unwrap_or(0);
        Ok(CcmStatus {
            buffers_sent_last_minute: v(0),
            buffers_found_last_minute: v(1),
            buffers_sent_last_scan: v(2),
            buffers_found_last_scan: v(3),
            buffers_sent_current_scan: v(4),
            buffers_found_current_scan: v(5),
            current_scan_progress: v(6),
        })
    }

    /// Primary: its logical WAL cache and the slots' counters; None when the installed
    /// extension predates the cache.
    pub async fn wal_cache(&mut self) -> Result<Option<WalCacheStatus>, NodeError> {
        if !has_wal_cache(self.facts.extension_version.as_deref()) {
            return Ok(None);
        }
        let row = self
            .query_one("ccm_logical_wal_cache_status()", SQL_WAL_CACHE, &[])
            .await?;
        let mut status = WalCacheStatus {
            mode: row.get(0),
            size_blocks: row.get(1),
            held_blocks: row.get(2),
            locked_blocks: row.get(3),
            oldest_ptr: row.get(4),
            newest_ptr: row.get(5),
            slots: Vec::new(),
        };
        let stmt = self
            .statement("aurora_stat_logical_wal_cache()", SQL_WAL_CACHE_SLOTS)
            .await?;
        let rows = self
            .guarded(
                "aurora_stat_logical_wal_cache()",
                self.client.query(&stmt, &[]),
            )
            .await?;
        status.slots = rows
            .iter()
            .map(|r| WalCacheSlot {
                name: r.get(0),
                active_pid: r.get(1),
                cache_hit: r.get(2),
                cache_miss: r.get(3),
                blks_read: r.get(4),
                hit_rate: r.get(5),
            })
            .collect();
        Ok(Some(status))
    }

    /// Primary: hot buffers, all of them or only those `filter` lacks.
    pub async fn hot_buffers_count(&mut self, filter: Option<&[u8]>) -> Result<i64, NodeError> {
        let row = match filter {
            None => {
                self.query_one("ccm_hot_buffers()", SQL_HOT_COUNT, &[])
                    .await?
            }
            Some(f) => {
                self.query_one("ccm_hot_buffers(filter)", SQL_MISSING_COUNT, &[&f])
                    .await?
            }
        };
        Ok(row.get(0))
    }
}

/// The pairing check: a list from a primary of another system would prewarm garbage (and
/// read relation files that may not even exist), so both ends must be one cluster.
pub fn check_same_system(primary: &Node, standby: &Node) -> Result<(), String> {
    if primary.facts.system_identifier == standby.facts.system_identifier {
        return Ok(());
    }
    Err(format!(
        "system identifier mismatch: primary {} is system {} but standby {} is system {}; \
         they are not the same cluster, so no block list will be sent (check --primary and --standby)",
        primary.label(),
        primary.facts.system_identifier,
        standby.label(),
        standby.facts.system_identifier
    ))
}

/// Connects to the hosts of `info` in order and returns the first whose role fits `side`:
/// not in recovery for the primary side, in recovery for the standby side, and that has the
/// extension. With `strict` false (status), a host of the wrong role is returned when none
/// fits, and a missing extension is left for the caller to report, so the node can be shown.
pub async fn resolve(
    info: &ConnInfo,
    side: Side,
    options: ConnectOptions,
    cancel: &CancellationToken,
    strict: bool,
) -> Result<Node, NodeError> {
    let mut tried = Vec::new();
    let mut fallback: Option<Node> = None;
    for host in info.hosts() {
        match Node::connect(info, &host, side, options, cancel).await {
            Ok(node) if node.facts.in_recovery == side.wants_recovery() => {
                // The extension lives in the catalog every node of the cluster shares, so
                // its absence is final for this string: say so plainly instead of trying on.
                if strict {
                    node.require_extension()?;
                }
                return Ok(node);
            }
            Ok(node) => {
                tried.push(format!("{host} is a {}", node.role()));
                if !strict && fallback.is_none() {
                    fallback = Some(node);
                }
            }
            Err(NodeError::Cancelled) => return Err(NodeError::Cancelled),
            Err(e) => tried.push(e.to_string()),
        }
    }
    match fallback {
        Some(node) => Ok(node),
        None => Err(NodeError::NoMatch {
            side,
            tried: tried.join("; "),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wal_cache_needs_extension_0_2() {
        assert!(!has_wal_cache(None));
        assert!(!has_wal_cache(Some("0.1.0")));
        assert!(has_wal_cache(Some("0.2.0")));
        assert!(has_wal_cache(Some("0.10.1")));
        assert!(has_wal_cache(Some("1.0")));
    }

    #[test]
    fn sides() {
        assert!(Side::Standby.wants_recovery());
        assert!(!Side::Primary.wants_recovery());
        assert_eq!(role_name(true), "standby");
        assert_eq!(role_name(false), "primary");
        assert_eq!(Side::Primary.to_string(), "primary");
    }

    #[test]
    fn error_messages() {
        let e = NodeError::ExtensionMissing {
            host: "h:5432".into(),
            database: "postgres".into(),
        };
        assert_eq!(
            e.to_string(),
            "extension pg_ccm is not installed in database postgres on h:5432; run CREATE EXTENSION pg_ccm on the primary"
        );
        let e = NodeError::QueryTimeout {
            host: "h:1".into(),
            what: "ccm_prewarm()",
            after: Duration::from_secs(35),
        };
        assert_eq!(
            e.to_string(),
            "h:1: ccm_prewarm() got no answer within 35s (client-side deadline)"
        );
        assert!(e.breaks_connection());
        assert!(!NodeError::Disabled { host: "h".into() }.breaks_connection());
    }

    #[tokio::test]
    async fn unreachable_hosts_are_all_reported() {
        // Port 1 on loopback: nothing listens there, so both attempts fail fast.
        let info = ConnInfo::parse("host=127.0.0.1,127.0.0.2 port=1 user=u dbname=d").unwrap();
        let options = ConnectOptions {
            connect_timeout: Duration::from_secs(2),
            statement_timeout: Duration::from_secs(1),
        };
        let err = resolve(
            &info,
            Side::Standby,
            options,
            &CancellationToken::new(),
            true,
        )
        .await
        .unwrap_err();
        let message = err.to_string();
        assert!(message.starts_with("no standby found"), "{message}");
        assert!(
            message.contains("127.0.0.1:1") && message.contains("127.0.0.2:1"),
            "{message}"
        );
    }

    #[tokio::test]
    async fn cancellation_stops_connecting() {
        let info = ConnInfo::parse("host=127.0.0.1 port=1 user=u").unwrap();
        let options = ConnectOptions {
            connect_timeout: Duration::from_secs(2),
            statement_timeout: Duration::from_secs(1),
        };
        let cancel = CancellationToken::new();
        cancel.cancel();
        let err = resolve(&info, Side::Primary, options, &cancel, true)
            .await
            .unwrap_err();
        assert!(matches!(err, NodeError::Cancelled));
    }
}

//! One connection to one node, and every SQL call the agent makes.
//!
//! Each session is set up so that it can never get in the way of the node it watches:
//! `statement_timeout` bounds every call, `lock_timeout=1s` and
//! `idle_in_transaction_session_timeout=10s` are a second line of defence (the agent opens no
//! explicit transaction and takes no lock but the `run` daemon's session-level advisory lock
//! on the primary, which nothing of the server's own waits on: election.rs), and `application_name=ccm-agent` makes the
//! sessions easy to find in pg_stat_activity (unless the string or PGAPPNAME names them, as
//! libpq's fallback_application_name). Every call also has a client-side deadline, so a node
//! that stops answering without closing the socket (a partition, a SIGSTOPped server) is
//! noticed, and every call gives way to shutdown by cancelling its statement server-side.
//!
//! Connections follow libpq's `sslmode` (see tls.rs for certificates): `disable` plain;
//! `allow` plain, then TLS if the server refuses the plain session before authentication
//! completes; `prefer` TLS if the server offers it, then plain if the handshake or the
//! authentication over TLS fails; `require`, `verify-ca` and `verify-full` TLS or nothing.
//! Unix sockets never use TLS (the server refuses it there; libpq does not ask). Cancel
//! requests go out with the TLS settings of the session they cancel.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use tokio_postgres::config::{Host, SslMode as PgSslMode};
use tokio_postgres::error::{DbError, Severity, SqlState};
use tokio_postgres::types::ToSql;
use tokio_postgres::{AsyncMessage, Client, Row, Statement};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use ccm_codec::{decode_block_list_header, BlockList};

use crate::conninfo::{ConnInfo, HostSpec};
use crate::election;
use crate::feed::FeedAnswer;
use crate::oscache::{Cursor, PrefetchResult, SliceAnswer};
use crate::report::CandidateRow;
use crate::tls::{Failure, MakeTls, SslMode};
use crate::wire::{self, ConnectError, PgConnection, Wire};

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
    /// The catalog's version (pg_extension.extversion), replicated from the primary.
    pub extension_version: Option<String>,
    pub server_version: String,
    /// The version of the pg_ccm library this server has loaded (ccm.library_version, 0.7.0
    /// on); None when it is older or not preloaded.
    pub library_version: Option<String>,
}

impl NodeFacts {
    /// What this node's library can do under its catalog.
    pub fn skew(&self) -> Skew {
        library_skew(
            self.extension_version.as_deref(),
            self.library_version.as_deref(),
        )
    }

    /// The version whose SQL the agent speaks to this node: every feature gate asks this,
    /// so that the catalog and the library are weighed by one rule (`Skew::sql_version`).
    pub fn sql_version(&self) -> Option<Version> {
        self.skew().sql_version()
    }

    fn supports(&self, since: Version) -> bool {
        self.sql_version().is_some_and(|v| v >= since)
    }

    /// The error for a node whose pg_ccm functions may not be called: its library is older
    /// than its catalog, or its catalog older than [`OLDEST_SUPPORTED`].
    fn require_callable(&self, host: String) -> Result<(), NodeError> {
        match self.skew() {
            Skew::LibraryOlder { catalog, .. } => Err(NodeError::LibraryOlderThanCatalog {
                host,
                library: self.library_version.clone(),
                catalog: self
                    .extension_version
                    .clone()
                    .unwrap_or_else(|| catalog.to_string()),
            }),
            skew => match skew.sql_version() {
                Some(version) if version < OLDEST_SUPPORTED => Err(NodeError::ExtensionTooOld {
                    host,
                    catalog: self
                        .extension_version
                        .clone()
                        .unwrap_or_else(|| version.to_string()),
                    library_current: matches!(skew, Skew::CatalogOlder { .. }),
                }),
                _ => Ok(()),
            },
        }
    }

    /// The warning for a library newer than the catalog: it works (with the catalog's SQL),
    /// but the upgrade is half done. None otherwise.
    fn catalog_behind(&self, host: &str) -> Option<String> {
        match self.skew() {
            Skew::CatalogOlder { .. } => Some(format!(
                "{host}: the extension's catalog ({}) is older than the loaded pg_ccm library \
                 ({}); run ALTER EXTENSION pg_ccm UPDATE on the primary",
                self.extension_version.as_deref().unwrap_or("?"),
                self.library_version.as_deref().unwrap_or("?"),
            )),
            _ => None,
        }
    }
}

/// An extension version, compared part by part as numbers ("0.10.0" is after "0.9.0").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u32, pub u32, pub u32);

impl Version {
    /// One to three dot-separated numbers ("0.7.0", "1.0"); None for anything else, so that
    /// a library version the agent cannot read counts as unknown, never as some guess.
    pub fn parse(text: &str) -> Option<Version> {
        let mut parts = [0u32; 3];
        for (i, part) in text.split('.').enumerate() {
            let slot = parts.get_mut(i)?;
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            *slot = part.parse().ok()?;
        }
        Some(Version(parts[0], parts[1], parts[2]))
    }

    /// The catalog's version, read as the agent always has: a part that is not a number
    /// counts as 0, so an odd extversion turns features off instead of failing the node.
    fn lenient(text: &str) -> Version {
        let mut parts = text.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        let mut next = || parts.next().unwrap_or(0);
        Version(next(), next(), next())
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// The first library that tells its version (ccm.library_version); older ones leave it NULL.
pub const LIBRARY_VERSION_SINCE: Version = Version(0, 7, 0);

/// How a node's loaded library stands against the extension's catalog. During a rolling
/// upgrade they differ: the catalog replicates from the primary at once, while each node
/// loads its library at its own restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skew {
    /// No catalog: the extension is not installed in the database.
    NoCatalog,
    /// A library that does not tell its version under a catalog from before it could: the
    /// catalog decides, as it always did.
    Legacy(Version),
    /// Library and catalog of one version.
    Same(Version),
    /// The library is newer: it still answers the catalog's SQL, which is what the agent
    /// speaks until ALTER EXTENSION pg_ccm UPDATE.
    CatalogOlder { catalog: Version, library: Version },
    /// The library is older than the catalog (None: older than 0.7.0, or not preloaded): the
    /// catalog may name functions or C symbols it lacks, so nothing of pg_ccm is called.
    LibraryOlder {
        catalog: Version,
        library: Option<Version>,
    },
}

impl Skew {
    /// The version whose SQL fits both: the lower of catalog and library.
    pub fn sql_version(self) -> Option<Version> {
        match self {
            Skew::NoCatalog => None,
            Skew::Legacy(v) | Skew::Same(v) => Some(v),
            Skew::CatalogOlder { catalog, .. } => Some(catalog),
            Skew::LibraryOlder { library, .. } => library,
        }
    }
}

/// Pure: the skew of a catalog version (extversion) and a library version
/// (ccm.library_version), both as the node reports them. An unreadable library version
/// counts as unknown.
pub fn library_skew(catalog: Option<&str>, library: Option<&str>) -> Skew {
    let Some(catalog) = catalog.map(Version::lenient) else {
        return Skew::NoCatalog;
    };
    match library.and_then(Version::parse) {
        None if catalog < LIBRARY_VERSION_SINCE => Skew::Legacy(catalog),
        library @ None => Skew::LibraryOlder { catalog, library },
        Some(v) if v < catalog => Skew::LibraryOlder {
            catalog,
            library: Some(v),
        },
        Some(library) if library > catalog => Skew::CatalogOlder { catalog, library },
        Some(_) => Skew::Same(catalog),
    }
}

/// Whether ccm_buffer_changes() can be called. From 0.7.0 on the library refuses the 0.5.0
/// catalog's declaration of it (55000: arguments and columns not the library's), so that
/// pairing keeps to the filter exchange until the catalog is updated.
fn change_feed_works(skew: Skew) -> bool {
    let Some(version) = skew.sql_version() else {
        return false;
    };
    let new_library = match skew {
        Skew::CatalogOlder { library, .. } => library >= LIBRARY_VERSION_SINCE,
        _ => false,
    };
    version >= CHANGE_FEED_SINCE && (version >= COLDER_FEED_SINCE || !new_library)
}

/// Every variant's message is complete on its own (the server's message, SQLSTATE and DETAIL
/// included), so no variant also returns its cause as `source()`: a `{:#}` print (anyhow's
/// chain format) shows each message once.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{host}: cannot connect: {}{}", describe(.error), passfile_hint(.error, .passfile.as_ref()))]
    Connect {
        host: String,
        error: tokio_postgres::Error,
        /// The password file the password came from, if it did (libpq's hint).
        passfile: Option<PathBuf>,
    },
    /// TLS could not be set up (a file), negotiated or verified; the reason says which.
    #[error("{host}: TLS: {reason}")]
    Tls { host: String, reason: String },
    /// `sslmode=prefer` or `allow` tried both ways; both failures are told.
    #[error("{first}; then {then_how}: {then}")]
    Retried {
        first: Box<NodeError>,
        then_how: &'static str,
        then: Box<NodeError>,
    },
    /// The socket could not be opened (resolve, connect, socket options): tokio-postgres'
    /// words for it, "error connecting to server: ...".
    #[error("{host}: cannot connect: error connecting to server: {error}")]
    Socket { host: String, error: std::io::Error },
    #[error("{host}: connection attempt timed out after {}", humantime::format_duration(*.after))]
    ConnectTimeout { host: String, after: Duration },
    #[error("extension pg_ccm is not installed in database {database} on {host}; run CREATE EXTENSION pg_ccm on the primary")]
    ExtensionMissing { host: String, database: String },
    #[error("Cluster Cache Manager is disabled on {host} (ccm.enabled = off)")]
    Disabled { host: String },
    /// Raised after connecting, before any pg_ccm call (see `Skew::LibraryOlder`).
    #[error(
        "{host}: the pg_ccm library this server has loaded ({}) is older than the extension's \
         catalog ({catalog}); install pg_ccm {catalog} on this node and restart it (libraries \
         on every node first, then ALTER EXTENSION pg_ccm UPDATE)",
        .library.as_deref().unwrap_or("older than 0.7.0")
    )]
    LibraryOlderThanCatalog {
        host: String,
        library: Option<String>,
        catalog: String,
    },
    /// Raised after connecting, before any pg_ccm call (see `OLDEST_SUPPORTED`).
    #[error(
        "{host}: extension pg_ccm {catalog} is older than the oldest this agent supports ({}); {}",
        OLDEST_SUPPORTED,
        if *.library_current {
            "run ALTER EXTENSION pg_ccm UPDATE on the primary"
        } else {
            "install this release's pg_ccm on every node and restart it, then run ALTER \
             EXTENSION pg_ccm UPDATE on the primary"
        }
    )]
    ExtensionTooOld {
        host: String,
        catalog: String,
        /// The loaded library is newer than the catalog: the update alone is missing.
        library_current: bool,
    },
    #[error("{host}: {what} failed: {}", describe(.error))]
    Query {
        host: String,
        what: &'static str,
        error: tokio_postgres::Error,
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
    /// `failures` holds each host's error when every host failed (none answered, in either
    /// role): how soon to try again depends on them (retry.rs). Empty otherwise.
    #[error("no {side} found among the hosts of the {side} connection string: {tried}")]
    NoMatch {
        side: Side,
        tried: String,
        failures: Vec<NodeError>,
    },
    #[error("cancelled")]
    Cancelled,
    /// A server error of the given class, raised by the unit tests' fake node (fake.rs).
    #[cfg(test)]
    #[error("{host}: simulated {class:?}")]
    Simulated { host: String, class: ErrorClass },
}

/// libpq's hint when a password from the password file is refused.
fn passfile_hint(error: &tokio_postgres::Error, passfile: Option<&PathBuf>) -> String {
    match (error.code(), passfile) {
        (Some(code), Some(file)) if *code == SqlState::INVALID_PASSWORD => {
            format!(" (password retrieved from file \"{}\")", file.display())
        }
        _ => String::new(),
    }
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
    /// leaves the session fine (a statement timeout, a cancelled statement); a FATAL ends the
    /// session, and anything on the wire (closed socket, I/O error, our own deadline) means
    /// reconnect.
    pub fn breaks_connection(&self) -> bool {
        match self {
            NodeError::Query { error, .. } => match error.as_db_error() {
                None => true,
                Some(db) => error.is_closed() || is_fatal(db),
            },
            // The session is sound; the library only changes with a restart, which ends it.
            NodeError::Disabled { .. }
            | NodeError::Unexpected { .. }
            | NodeError::LibraryOlderThanCatalog { .. } => false,
            #[cfg(test)]
            NodeError::Simulated { .. } => false,
            _ => true,
        }
    }

    /// The server's error, when this is one.
    pub fn db_error(&self) -> Option<&DbError> {
        match self {
            NodeError::Query { error, .. } | NodeError::Connect { error, .. } => {
                error.as_db_error()
            }
            NodeError::Retried { then, .. } => then.db_error(),
            _ => None,
        }
    }

    /// How the sync loop treats this error (see `ErrorClass`).
    pub fn class(&self) -> ErrorClass {
        match self {
            NodeError::Query { .. } => match self.db_error() {
                Some(db) => classify(db.code().code(), db.message()),
                None => ErrorClass::Other,
            },
            #[cfg(test)]
            NodeError::Simulated { class, .. } => *class,
            _ => ErrorClass::Other,
        }
    }

    /// The server's message with its DETAIL, for logs ("message (DETAIL: ...)").
    pub fn server_message(&self) -> Option<String> {
        let db = self.db_error()?;
        Some(match db.detail() {
            Some(detail) => format!("{} (DETAIL: {detail})", db.message()),
            None => db.message().to_string(),
        })
    }
}

/// FATAL (or PANIC): the server ends the session after sending it. The non-localized
/// severity is used when the server sends it (9.6+), the localized one otherwise.
fn is_fatal(db: &DbError) -> bool {
    match db.parsed_severity() {
        Some(severity) => matches!(severity, Severity::Fatal | Severity::Panic),
        None => matches!(db.severity(), "FATAL" | "PANIC"),
    }
}

fn is_disabled(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_some_and(|db| {
        *db.code() == SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE
            && db.message().contains(DISABLED_MESSAGE)
    })
}

/// What a server error from a CCM call means to the sync loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// A recovery conflict cancelled the statement (40001, or 40P01 for a buffer-pin
    /// deadlock) or ended the session (57P04: its database was dropped on the primary). An
    /// ordinary event on a hot standby: retried next cycle. Whether our session survived is
    /// for `NodeError::breaks_connection` (the severity it got) to say, not the message: a
    /// prewarm worker's error, re-raised by ccm_prewarm, keeps the worker's SQLSTATE and
    /// message but leaves the caller's session alive.
    RecoveryConflict,
    /// The node is no longer in recovery: 55000 "recovery is not in progress" (ccm_prewarm on
    /// a promoted standby). Told apart from "Cluster Cache Manager is disabled" (also 55000)
    /// by the message.
    NotInRecovery,
    /// A storage error on a page (XX001 data_corrupted, 58030 io_error, 58P01 undefined_file):
    /// that batch is lost, the next one may be fine.
    Storage,
    /// Anything else: a fault of the cycle.
    Other,
}

/// The message ccm_prewarm raises (SQLSTATE 55000) on a node that is not in recovery.
pub const NOT_IN_RECOVERY_MESSAGE: &str = "recovery is not in progress";

/// Classifies a server error by SQLSTATE and (for the codes that several errors share)
/// message; nothing else, so an error re-raised from a prewarm worker classifies alike.
pub fn classify(sqlstate: &str, message: &str) -> ErrorClass {
    match sqlstate {
        // T_R_SERIALIZATION_FAILURE: what every recovery conflict raises on a standby
        // (snapshot, lock, tablespace, buffer pin), as ERROR or, in a subtransaction or for
        // an idle-in-transaction session, as FATAL "terminating connection due to ...".
        // DATABASE_DROPPED: the session's database was dropped on the primary.
        "40001" | "57P04" => ErrorClass::RecoveryConflict,
        // T_R_DEADLOCK_DETECTED with the recovery-conflict message: a buffer-pin deadlock
        // with the startup process. A real deadlock cannot happen (no transaction is held).
        "40P01" if message.contains("conflict with recovery") => ErrorClass::RecoveryConflict,
        "55000" if message == NOT_IN_RECOVERY_MESSAGE => ErrorClass::NotInRecovery,
        "XX001" | "58030" | "58P01" => ErrorClass::Storage,
        _ => ErrorClass::Other,
    }
}

#[derive(Debug, Clone, Copy)]
pub struct ConnectOptions {
    pub connect_timeout: Duration,
    pub statement_timeout: Duration,
}

impl ConnectOptions {
    /// The client-side deadline of a call: the server's own timeout plus room for the
    /// network, so the server normally gives up first and says why.
    pub fn call_deadline(&self) -> Duration {
        self.statement_timeout + self.connect_timeout.max(Duration::from_secs(2))
    }
}

/// Counters returned by `ccm_prewarm` (negative or NULL values read as 0).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PrewarmResult {
    pub requested: u64,
    pub loaded: u64,
    pub already_cached: u64,
    pub skipped: u64,
    /// The standby's replay lag in bytes right after the call; None when it does not stream.
    pub replay_lag: Option<u64>,
}

/// Reads the columns of a server's row without panicking: a NULL where a value is needed,
/// or a type the agent does not expect, is a `NodeError::Unexpected` naming the call.
struct Columns<'a> {
    host: String,
    what: &'static str,
    row: &'a Row,
}

impl<'a> Columns<'a> {
    fn new(node: &Node, what: &'static str, row: &'a Row) -> Self {
        Columns {
            host: node.label(),
            what,
            row,
        }
    }

    fn get<T: tokio_postgres::types::FromSql<'a>>(&self, index: usize) -> Result<T, NodeError> {
        self.row
            .try_get(index)
            .map_err(|e| self.unexpected(format!("an unusable value in column {}: {e}", index + 1)))
    }

    fn unexpected(&self, detail: String) -> NodeError {
        NodeError::Unexpected {
            host: self.host.clone(),
            what: self.what,
            detail,
        }
    }
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

/// The first with ccm_buffer_changes() (the change feed).
pub const CHANGE_FEED_SINCE: Version = Version(0, 5, 0);
/// The oldest extension catalog this agent calls: 0.5.0, the oldest that a rolling upgrade
/// from either of the two releases before this one (0.5.0, 0.6.0) meets. Everything the agent
/// uses from older catalogs is in it (the WAL cache of 0.2.0, ccm_hot_blocks_each() and
/// ccm_wal_source() of 0.4.0), so no code path serves a catalog without them. A node with an
/// older catalog is named with its version and what to run, and left alone.
pub const OLDEST_SUPPORTED: Version = CHANGE_FEED_SINCE;
/// The first whose change feed reports the colder blocks too (fill_room without filters).
pub const COLDER_FEED_SINCE: Version = Version(0, 6, 0);
/// The first with ccm_report_candidates() and the view ccm_candidates.
pub const CANDIDATE_REPORT_SINCE: Version = Version(0, 8, 0);
/// The first with the page-cache tier: ccm_os_cached_blocks() and ccm_os_prefetch().
pub const OS_CACHE_SINCE: Version = Version(0, 9, 0);

const SQL_FACTS: &str = "SELECT pg_is_in_recovery(), \
     (SELECT system_identifier FROM pg_control_system())::text, \
     (SELECT setting::int8 FROM pg_settings WHERE name = 'shared_buffers'), \
     current_database()::text, \
     (SELECT extversion FROM pg_extension WHERE extname = 'pg_ccm')::text, \
     split_part(current_setting('server_version'), ' ', 1), \
     current_setting('ccm.library_version', true)";
const SQL_FILTER: &str = "SELECT pg_is_in_recovery(), ccm_buffer_filter($1::float8)";
const SQL_HOT_BLOCKS: &str = "SELECT pg_is_in_recovery(), ccm_hot_blocks($1::bytea, $2::int8)";
/// Every cached block (usage count 1 and up): a threshold other than ccm.usage_threshold
/// leaves aurora_ccm_status() alone (extension 0.4.0 as built from 2026-11-24 on).
const SQL_CACHED_BLOCKS: &str =
    "SELECT pg_is_in_recovery(), ccm_hot_blocks($1::bytea, $2::int8, 0)";
const SQL_HOT_BLOCKS_EACH: &str =
    "SELECT pg_is_in_recovery(), ccm_hot_blocks_each($1::bytea[], $2::int8[])";
/// The change feed of extension 0.5.0 (no colder set; the agent sends no probe).
const SQL_CHANGES: &str = "SELECT pg_is_in_recovery(), c.seq, c.reset, c.reset_reason, c.buffers, \
     c.tracked, c.sweeps, c.visited, c.added, c.removed, NULL::bytea, NULL::bytea \
     FROM ccm_buffer_changes($1::int8, $2::int8, $3::int4, $4::int8) c";
/// 0.6.0 on: with or without the colder set.
const SQL_CHANGES_COLDER: &str = "SELECT pg_is_in_recovery(), c.seq, c.reset, c.reset_reason, \
     c.buffers, c.tracked, c.sweeps, c.visited, c.added, c.removed, c.colder_added, \
     c.colder_removed FROM ccm_buffer_changes($1::int8, $2::int8, $3::int4, $4::int8, NULL, $5::bool) c";
const SQL_WAL_SOURCE: &str =
    "SELECT in_recovery, timeline, sender_host, sender_port FROM ccm_wal_source()";
/// pg_is_in_recovery() is evaluated after ccm_prewarm (it is in the target list of the row
/// the function returns), so a promotion during the call is seen in its own answer.
/// With the WAL received but not yet replayed after the batch (NULL when nothing streams).
const SQL_PREWARM: &str = "SELECT pg_is_in_recovery(), requested, loaded, already_cached, \
     skipped, pg_wal_lsn_diff(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())::int8 \
     FROM ccm_prewarm($1::bytea)";
/// A slice of the primary's page cache (oscache.rs), after the cursor.
const SQL_OS_CACHED: &str = "SELECT list, last_spc, last_db, last_rel, last_block, complete, \
     in_play, pg_is_in_recovery() FROM ccm_os_cached_blocks($1::oid, $2::oid, $3::oid, $4::int8, \
     $5::int8, $6::int4)";
/// A batch of it read into a standby's page cache ($2 false: only measured).
/// With the replay lag after the call, as SQL_PREWARM.
const SQL_OS_PREFETCH: &str = "SELECT pg_is_in_recovery(), requested, already_cached, advised, \
     skipped, limited, in_play, \
     pg_wal_lsn_diff(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())::int8 \
     FROM ccm_os_prefetch($1::bytea, $2::bool)";
/// Looks at a standby's sessions before a batch of the page-cache tier, and the time between.
const BUSY_LOOKS: u32 = 8;
const BUSY_LOOK_GAP: Duration = Duration::from_millis(5);
// The agent's sessions carry its application_name; the readers are everyone else's.
const SQL_BUSY_SESSIONS: &str = "SELECT count(*)::int8 FROM pg_stat_activity \
     WHERE backend_type = 'client backend' AND state = 'active' AND pid <> pg_backend_pid() \
     AND application_name IS DISTINCT FROM current_setting('application_name')";
const SQL_STATUS: &str = "SELECT buffers_sent_last_minute, buffers_found_last_minute, \
     buffers_sent_last_scan, buffers_found_last_scan, buffers_sent_current_scan, \
     buffers_found_current_scan, current_scan_progress FROM aurora_ccm_status()";
const SQL_WAL_CACHE: &str = "SELECT mode, size_blocks, held_blocks, locked_blocks, \
     oldest_ptr::text, newest_ptr::text FROM ccm_logical_wal_cache_status()";
const SQL_WAL_CACHE_SLOTS: &str = "SELECT name, active_pid, cache_hit, cache_miss, blks_read, \
     hit_rate FROM aurora_stat_logical_wal_cache() ORDER BY name";
const SQL_CATALOG_VERSION: &str =
    "SELECT extversion::text FROM pg_extension WHERE extname = 'pg_ccm'";
/// How many unsent candidate reports (a catalog before 0.8.0) before the catalog's version is
/// read again: ALTER EXTENSION pg_ccm UPDATE is the last step of an upgrade, and the agent
/// keeps its primary session for days.
const CATALOG_RECHECK_EVERY: u32 = 60;
const SQL_REPORT_CANDIDATES: &str = "SELECT ccm_report_candidates($1::text, $2::int8, \
     $3::text[], $4::text[], $5::float8[], $6::int8[], $7::int8[])";
const SQL_HOT_COUNT: &str = "SELECT count(*) FROM ccm_hot_buffers()";
const SQL_MISSING_COUNT: &str = "SELECT count(*) FROM ccm_hot_buffers($1::bytea)";

/// What ccm_wal_source() says about a node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WalSource {
    pub in_recovery: bool,
    /// The timeline a primary writes, or a standby's WAL receiver streams (None: no
    /// receiver is streaming).
    pub timeline: Option<u32>,
    pub sender_host: Option<String>,
    pub sender_port: Option<u16>,
}

/// A live session on one node.
pub struct Node {
    pub side: Side,
    pub host: HostSpec,
    pub facts: NodeFacts,
    client: Client,
    /// The TLS settings the session was made with, for its cancel requests.
    tls: MakeTls,
    options: ConnectOptions,
    cancel: CancellationToken,
    /// Prepared once per session: the loop runs the same few statements every second.
    statements: HashMap<&'static str, Statement>,
    /// The seq of the last change-feed answer applied from this session (0: none yet). A new
    /// session starts at 0, so its first call resets the node's feed.
    pub feed_after: i64,
    /// The session's socket: the bytes it carried, where its cancel requests go (wire.rs).
    wire: Wire,
    /// Candidate reports not sent because the catalog predates them: every
    /// CATALOG_RECHECK_EVERY of them, the catalog's version is read again.
    reports_skipped: u32,
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

/// A session just made: its client, its connection, the TLS it was made with, its socket.
type Established = (Client, PgConnection, MakeTls, Wire);

/// One host's connection attempts, by libpq's `sslmode` rules.
struct Session<'a> {
    info: &'a ConnInfo,
    host: &'a HostSpec,
    label: &'a str,
    config: tokio_postgres::Config,
    passfile: Option<PathBuf>,
    timeout: Duration,
}

/// SQLSTATEs a server sends before authentication completes (libpq retries only then):
/// pg_hba.conf and authentication failures (class 28), protocol and connection errors
/// (class 08), too many connections (class 53), and the server starting up or shutting
/// down (57P03).
fn refused_before_auth(error: &tokio_postgres::Error) -> bool {
    error.code().is_some_and(|code| {
        let code = code.code();
        code.starts_with("28")
            || code.starts_with("08")
            || code.starts_with("53")
            || code == "57P03"
    })
}

impl Session<'_> {
    async fn establish(&self) -> Result<Established, NodeError> {
        // libpq asks for no TLS over a Unix socket (the server would refuse it anyway).
        let mode = match self.host.host {
            #[cfg(unix)]
            Some(Host::Unix(_)) => SslMode::Disable,
            _ => self.info.tls().mode,
        };
        match mode {
            SslMode::Disable => self.attempt(PgSslMode::Disable, MakeTls::plain()).await,
            SslMode::Allow => match self.attempt(PgSslMode::Disable, MakeTls::plain()).await {
                Err(first) if first.connect_error().is_some_and(refused_before_auth) => {
                    debug!(
                        host = %self.label,
                        "plain session refused ({first}); trying TLS (sslmode=allow)"
                    );
                    self.retry(first, "with TLS (sslmode=allow)", PgSslMode::Require)
                        .await
                }
                r => r,
            },
            SslMode::Prefer => {
                let tls = self.info.tls().connector_deferring_errors(self.host);
                match self.attempt(PgSslMode::Prefer, tls.clone()).await {
                    Err(first)
                        if tls.handshake_failed()
                            || (tls.handshake_started()
                                && first.connect_error().is_some_and(refused_before_auth)) =>
                    {
                        debug!(
                            host = %self.label,
                            "TLS session failed ({first}); trying without TLS (sslmode=prefer)"
                        );
                        self.retry(first, "without TLS (sslmode=prefer)", PgSslMode::Disable)
                            .await
                    }
                    r => r,
                }
            }
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                self.attempt(PgSslMode::Require, self.connector()?).await
            }
        }
    }

    fn connector(&self) -> Result<MakeTls, NodeError> {
        self.info
            .tls()
            .connector(self.host)
            .map_err(|e| NodeError::Tls {
                host: self.label.to_string(),
                reason: e.to_string(),
            })
    }

    async fn retry(
        &self,
        first: NodeError,
        then_how: &'static str,
        mode: PgSslMode,
    ) -> Result<Established, NodeError> {
        let tls = match mode {
            PgSslMode::Disable => MakeTls::plain(),
            _ => self.info.tls().connector_deferring_errors(self.host),
        };
        self.attempt(mode, tls)
            .await
            .map_err(|then| NodeError::Retried {
                first: Box::new(first),
                then_how,
                then: Box::new(then),
            })
    }

    async fn attempt(&self, mode: PgSslMode, tls: MakeTls) -> Result<Established, NodeError> {
        let mut config = self.config.clone();
        config.ssl_mode(mode);
        let label = self.label.to_string();
        match tokio::time::timeout(self.timeout, wire::connect(&config, &tls)).await {
            Err(_) => Err(NodeError::ConnectTimeout {
                host: label,
                after: self.timeout,
            }),
            Ok(Ok((client, connection, wire))) => Ok((client, connection, tls, wire)),
            Ok(Err(ConnectError::Socket(error))) => Err(NodeError::Socket { host: label, error }),
            Ok(Err(ConnectError::Postgres(error))) => Err(attempt_error(
                label,
                error,
                &tls,
                mode,
                self.passfile.clone(),
            )),
        }
    }
}

/// A failed attempt's error, told the way libpq tells it when TLS is the reason.
fn attempt_error(
    host: String,
    error: tokio_postgres::Error,
    tls: &MakeTls,
    mode: PgSslMode,
    passfile: Option<PathBuf>,
) -> NodeError {
    match tls.failure() {
        Some(Failure::Verify(reason)) => {
            return NodeError::Tls {
                host,
                reason: format!("certificate verify failed: {reason}"),
            }
        }
        Some(Failure::Setup(reason)) => return NodeError::Tls { host, reason },
        None => {}
    }
    if tls.handshake_failed() {
        return NodeError::Tls {
            host,
            reason: format!("handshake failed: {}", describe(&error)),
        };
    }
    // tokio-postgres' error when the server answers the SSL request with 'N'.
    if mode == PgSslMode::Require
        && !tls.handshake_started()
        && error.as_db_error().is_none()
        && error
            .to_string()
            .starts_with("error performing TLS handshake")
    {
        return NodeError::Tls {
            host,
            reason: "server does not support SSL, but SSL was required".to_string(),
        };
    }
    NodeError::Connect {
        host,
        error,
        passfile,
    }
}

impl NodeError {
    /// The tokio-postgres error of a failed connection attempt.
    fn connect_error(&self) -> Option<&tokio_postgres::Error> {
        match self {
            NodeError::Connect { error, .. } => Some(error),
            _ => None,
        }
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
        let mut config = info.host_config(host, APPLICATION_NAME, options.connect_timeout);
        let passfile = info.passfile_password(host).map(|p| {
            config.password(p.password);
            p.file
        });
        let session = Session {
            info,
            host,
            label: &label,
            config,
            passfile,
            timeout: options.connect_timeout,
        };
        let (client, mut connection, tls, wire) = tokio::select! {
            _ = cancel.cancelled() => return Err(NodeError::Cancelled),
            r = session.establish() => r?,
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
                library_version: None,
            },
            client,
            tls,
            options,
            cancel: cancel.clone(),
            statements: HashMap::new(),
            feed_after: 0,
            reports_skipped: 0,
            wire,
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
        const WHAT: &str = "node facts query";
        let row = node.query_one(WHAT, SQL_FACTS, &[]).await?;
        let col = Columns::new(&node, WHAT, &row);
        node.facts = NodeFacts {
            in_recovery: col.get(0)?,
            system_identifier: col.get::<Option<String>>(1)?.unwrap_or_default(),
            shared_buffers: col.get::<Option<i64>>(2)?.unwrap_or(0),
            database: col.get::<Option<String>>(3)?.unwrap_or_default(),
            extension_version: col.get(4)?,
            server_version: col.get::<Option<String>>(5)?.unwrap_or_default(),
            library_version: col.get(6)?,
        };
        Ok(node)
    }

    pub fn label(&self) -> String {
        self.host.to_string()
    }

    /// Bytes the session sent and received on its socket since the last call.
    pub fn wire_bytes(&mut self) -> Option<(u64, u64)> {
        Some(self.wire.take())
    }

    pub fn role(&self) -> &'static str {
        role_name(self.facts.in_recovery)
    }

    pub fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    /// The error for a node of the right role that cannot be called: the extension is
    /// missing, its library is older than the catalog, or the catalog older than the oldest
    /// this agent supports.
    pub fn require_extension(&self) -> Result<(), NodeError> {
        self.require_catalog()?;
        self.require_callable()
    }

    /// The catalog alone: the same on every node of a cluster.
    pub fn require_catalog(&self) -> Result<(), NodeError> {
        match self.facts.extension_version {
            Some(_) => Ok(()),
            None => Err(NodeError::ExtensionMissing {
                host: self.label(),
                database: self.facts.database.clone(),
            }),
        }
    }

    /// This node's library against the catalog, and the catalog against the oldest this
    /// agent supports (a missing catalog is not its business).
    pub fn require_callable(&self) -> Result<(), NodeError> {
        self.facts.require_callable(self.label())
    }

    /// The warning for a library newer than the catalog, to log once per connection.
    pub fn catalog_behind(&self) -> Option<String> {
        self.facts.catalog_behind(&self.label())
    }

    /// Runs one call with the client-side deadline, giving way to shutdown. On either, the
    /// statement is cancelled server-side so the node does not keep working for nobody.
    async fn guarded<T>(
        &self,
        what: &'static str,
        call: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, NodeError> {
        let deadline = self.options.call_deadline();
        let mut call = std::pin::pin!(call);
        let outcome = tokio::select! {
            biased;
            _ = self.cancel.cancelled() => None,
            r = tokio::time::timeout(deadline, call.as_mut()) => Some(r),
        };
        match outcome {
            None => {
                self.cancel_running(call).await;
                Err(NodeError::Cancelled)
            }
            Some(Err(_)) => {
                self.cancel_running(call).await;
                Err(NodeError::QueryTimeout {
                    host: self.label(),
                    what,
                    after: deadline,
                })
            }
            Some(Ok(Err(error))) if is_disabled(&error) => {
                Err(NodeError::Disabled { host: self.label() })
            }
            Some(Ok(Err(error))) => Err(NodeError::Query {
                host: self.label(),
                what,
                error,
            }),
            Some(Ok(Ok(v))) => Ok(v),
        }
    }

    /// Cancels the statement server-side, then reads its answer (the cancel's ERROR) for a
    /// moment, so the backend finishes the statement before we may close the connection:
    /// a backend whose client vanished mid-statement ends with FATAL "connection to client
    /// lost" instead.
    async fn cancel_running<T>(&self, call: std::pin::Pin<&mut impl Future<Output = T>>) {
        let token = self.client.cancel_token();
        let cancelled =
            tokio::time::timeout(CANCEL_GRACE, self.wire.cancel(&token, self.tls.clone())).await;
        if matches!(cancelled, Ok(Ok(()))) {
            let _ = tokio::time::timeout(CANCEL_GRACE, call).await;
        }
        match cancelled {
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
        const WHAT: &str = "ccm_buffer_filter()";
        let row = self
            .query_one(WHAT, SQL_FILTER, &[&false_positive_rate])
            .await?;
        let col = Columns::new(self, WHAT, &row);
        Ok((col.get(0)?, col.get(1)?))
    }

    /// Primary: its hot blocks missing from `filter`, at most `max_blocks`, with its recovery
    /// state at the same instant.
    pub async fn hot_blocks(
        &mut self,
        filter: &[u8],
        max_blocks: i64,
    ) -> Result<(bool, Vec<u8>), NodeError> {
        const WHAT: &str = "ccm_hot_blocks()";
        let row = self
            .query_one(WHAT, SQL_HOT_BLOCKS, &[&filter, &max_blocks])
            .await?;
        let col = Columns::new(self, WHAT, &row);
        Ok((col.get(0)?, col.get(1)?))
    }

    /// Primary: of its `max_blocks` hottest cached blocks (usage count 1 and up, not only
    /// the hot set), those missing from `filter`, with its recovery state.
    pub async fn cached_blocks(
        &mut self,
        filter: &[u8],
        max_blocks: i64,
    ) -> Result<(bool, Vec<u8>), NodeError> {
        const WHAT: &str = "ccm_hot_blocks(..., 0)";
        let row = self
            .query_one(WHAT, SQL_CACHED_BLOCKS, &[&filter, &max_blocks])
            .await?;
        let col = Columns::new(self, WHAT, &row);
        Ok((col.get(0)?, col.get(1)?))
    }

    /// Primary: one scan, one list per filter (None: nothing known of that standby), each
    /// of at most its `max_blocks`, with the recovery state at the same instant.
    pub async fn hot_blocks_each(
        &mut self,
        filters: &[Option<&[u8]>],
        max_blocks: &[i64],
    ) -> Result<(bool, Vec<Vec<u8>>), NodeError> {
        const WHAT: &str = "ccm_hot_blocks_each()";
        let row = self
            .query_one(WHAT, SQL_HOT_BLOCKS_EACH, &[&filters, &max_blocks])
            .await?;
        let col = Columns::new(self, WHAT, &row);
        let lists: Vec<Vec<u8>> = col.get(1)?;
        if lists.len() != filters.len() {
            return Err(NodeError::Unexpected {
                host: self.label(),
                what: WHAT,
                detail: format!("{} lists for {} filters", lists.len(), filters.len()),
            });
        }
        Ok((col.get(0)?, lists))
    }

    /// Whether the installed extension has the change feed (ccm_buffer_changes).
    pub fn has_change_feed(&self) -> bool {
        change_feed_works(self.facts.skew())
    }

    /// Whether its change feed reports the colder blocks too (extension 0.6.0).
    pub fn has_colder_feed(&self) -> bool {
        self.facts.supports(COLDER_FEED_SINCE)
    }

    /// The change feed's next answer for `subscriber`, with the recovery state at the same
    /// instant; with `colder` (only where has_colder_feed()), the colder set's changes too.
    /// The session's cursor (`feed_after`) is not advanced here: the caller applies the
    /// answer, then advances it.
    pub async fn buffer_changes(
        &mut self,
        subscriber: i64,
        usage_threshold: Option<i32>,
        max_buffers: i64,
        colder: bool,
    ) -> Result<(bool, FeedAnswer), NodeError> {
        const WHAT: &str = "ccm_buffer_changes()";
        let after = self.feed_after;
        let row = if self.has_colder_feed() {
            self.query_one(
                WHAT,
                SQL_CHANGES_COLDER,
                &[&subscriber, &after, &usage_threshold, &max_buffers, &colder],
            )
            .await?
        } else {
            self.query_one(
                WHAT,
                SQL_CHANGES,
                &[&subscriber, &after, &usage_threshold, &max_buffers],
            )
            .await?
        };
        let col = Columns::new(self, WHAT, &row);
        let buffers: i64 = col.get(4)?;
        let limit = u64::try_from(buffers).unwrap_or(0);
        let list = |bytes: Vec<u8>| {
            BlockList::decode_bounded(&bytes, limit)
                .map_err(|e| col.unexpected(format!("a block list: {e}")))
        };
        let colder_added: Option<Vec<u8>> = col.get(10)?;
        let colder_removed: Option<Vec<u8>> = col.get(11)?;
        let answer = FeedAnswer {
            seq: col.get(1)?,
            reset: col.get(2)?,
            reset_reason: col.get(3)?,
            tracked: col.get(5)?,
            sweeps: col.get(6)?,
            visited: col.get(7)?,
            added: list(col.get(8)?)?,
            removed: list(col.get(9)?)?,
            colder_added: colder_added.map(list).transpose()?,
            colder_removed: colder_removed.map(list).transpose()?,
        };
        Ok((col.get(0)?, answer))
    }

    /// Where this node's WAL comes from: the timeline it writes (a primary) or streams (a
    /// standby), and a standby's WAL sender.
    pub async fn wal_source(&mut self) -> Result<WalSource, NodeError> {
        const WHAT: &str = "ccm_wal_source()";
        let row = self.query_one(WHAT, SQL_WAL_SOURCE, &[]).await?;
        let col = Columns::new(self, WHAT, &row);
        Ok(WalSource {
            in_recovery: col.get::<Option<bool>>(0)?.unwrap_or(false),
            timeline: col
                .get::<Option<i32>>(1)?
                .and_then(|t| u32::try_from(t).ok()),
            sender_host: col.get(2)?,
            sender_port: col
                .get::<Option<i32>>(3)?
                .and_then(|p| u16::try_from(p).ok()),
        })
    }

    /// Standby: reads one batch of blocks into shared_buffers, with its recovery state after
    /// the call.
    pub async fn prewarm(&mut self, list: &[u8]) -> Result<(bool, PrewarmResult), NodeError> {
        const WHAT: &str = "ccm_prewarm()";
        let row = self.query_one(WHAT, SQL_PREWARM, &[&list]).await?;
        let col = Columns::new(self, WHAT, &row);
        let count = |i: usize| -> Result<u64, NodeError> {
            Ok(col.get::<Option<i64>>(i)?.unwrap_or(0).max(0) as u64)
        };
        Ok((
            col.get(0)?,
            PrewarmResult {
                requested: count(1)?,
                loaded: count(2)?,
                already_cached: count(3)?,
                skipped: count(4)?,
                replay_lag: col.get::<Option<i64>>(5)?.map(|lag| lag.max(0) as u64),
            },
        ))
    }

    /// Whether its extension has the page-cache tier (0.9.0, library and catalog).
    pub fn has_os_cache(&self) -> bool {
        self.facts.supports(OS_CACHE_SINCE)
    }

    /// Any node: the slice of its page cache after `after` (oscache.rs), with its recovery
    /// state.
    pub async fn os_cached_blocks(
        &mut self,
        after: Cursor,
        max_blocks: i64,
        max_files: i32,
    ) -> Result<(bool, SliceAnswer), NodeError> {
        const WHAT: &str = "ccm_os_cached_blocks()";
        let row = self
            .query_one(
                WHAT,
                SQL_OS_CACHED,
                &[
                    &after.spc,
                    &after.db,
                    &after.rel,
                    &after.block,
                    &max_blocks,
                    &max_files,
                ],
            )
            .await?;
        let col = Columns::new(self, WHAT, &row);
        let list: Vec<u8> = col.get(0)?;
        let blocks = decode_block_list_header(&list)
            .map(|h| u64::from(h.blocks))
            .map_err(|e| NodeError::Unexpected {
                host: self.label(),
                what: WHAT,
                detail: e.to_string(),
            })?;
        let answer = SliceAnswer {
            list,
            blocks,
            last: Cursor {
                spc: col.get(1)?,
                db: col.get(2)?,
                rel: col.get(3)?,
                block: col.get(4)?,
            },
            complete: col.get(5)?,
            in_play: col.get(6)?,
        };
        Ok((col.get(7)?, answer))
    }

    /// Standby: reads the blocks of `list` it lacks into its page cache (`advise`), or only
    /// counts them; with its recovery state.
    pub async fn os_prefetch(
        &mut self,
        list: &[u8],
        advise: bool,
    ) -> Result<(bool, PrefetchResult), NodeError> {
        const WHAT: &str = "ccm_os_prefetch()";
        let row = self
            .query_one(WHAT, SQL_OS_PREFETCH, &[&list, &advise])
            .await?;
        let col = Columns::new(self, WHAT, &row);
        let count = |i: usize| -> Result<u64, NodeError> {
            Ok(col.get::<Option<i64>>(i)?.unwrap_or(0).max(0) as u64)
        };
        Ok((
            col.get(0)?,
            PrefetchResult {
                requested: count(1)?,
                already_cached: count(2)?,
                advised: count(3)?,
                skipped: count(4)?,
                limited: col.get::<Option<bool>>(5)?.unwrap_or(false),
                in_play: col.get::<Option<bool>>(6)?.unwrap_or(true),
                replay_lag: col.get::<Option<i64>>(7)?.map(|lag| lag.max(0) as u64),
            },
        ))
    }

    /// Standby: its client sessions other than the agent's that are running a query, the
    /// most in `BUSY_LOOKS` looks `BUSY_LOOK_GAP` apart. One look is not enough: a session
    /// running short queries back to back (a read replica's OLTP clients) is between two of
    /// them a good part of the time, and four pgbench -S clients were all found idle at one
    /// look in about one look of four. Sessions of other roles count only when ours may see
    /// their state (pg_read_all_stats).
    pub async fn busy_sessions(&mut self) -> Result<u64, NodeError> {
        const WHAT: &str = "pg_stat_activity";
        let mut most = 0;
        for look in 0..BUSY_LOOKS {
            if look > 0 {
                tokio::time::sleep(BUSY_LOOK_GAP).await;
            }
            // Each query is a transaction of its own: each sees the sessions' state afresh.
            let row = self.query_one(WHAT, SQL_BUSY_SESSIONS, &[]).await?;
            let col = Columns::new(self, WHAT, &row);
            most = most.max(col.get::<Option<i64>>(0)?.unwrap_or(0).max(0) as u64);
        }
        Ok(most)
    }

    /// Primary: the row of aurora_ccm_status().
    pub async fn ccm_status(&mut self) -> Result<CcmStatus, NodeError> {
        const WHAT: &str = "aurora_ccm_status()";
        let row = self.query_one(WHAT, SQL_STATUS, &[]).await?;
        let col = Columns::new(self, WHAT, &row);
        let v =
            |i: usize| -> Result<i64, NodeError> { Ok(col.get::<Option<i64>>(i)?.unwrap_or(0)) };
        Ok(CcmStatus {
            buffers_sent_last_minute: v(0)?,
            buffers_found_last_minute: v(1)?,
            buffers_sent_last_scan: v(2)?,
            buffers_found_last_scan: v(3)?,
            buffers_sent_current_scan: v(4)?,
            buffers_found_current_scan: v(5)?,
            current_scan_progress: v(6)?,
        })
    }

    /// Primary: its logical WAL cache and the slots' counters (always Some: every supported
    /// catalog has the cache; the trait's None is for nodes without one).
    pub async fn wal_cache(&mut self) -> Result<Option<WalCacheStatus>, NodeError> {
        const WHAT: &str = "ccm_logical_wal_cache_status()";
        let row = self.query_one(WHAT, SQL_WAL_CACHE, &[]).await?;
        let col = Columns::new(self, WHAT, &row);
        let mut status = WalCacheStatus {
            mode: col.get::<Option<String>>(0)?.unwrap_or_default(),
            size_blocks: col.get::<Option<i64>>(1)?.unwrap_or(0),
            held_blocks: col.get::<Option<i64>>(2)?.unwrap_or(0),
            locked_blocks: col.get::<Option<i64>>(3)?.unwrap_or(0),
            oldest_ptr: col.get(4)?,
            newest_ptr: col.get(5)?,
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
        for r in &rows {
            let col = Columns::new(self, "aurora_stat_logical_wal_cache()", r);
            status.slots.push(WalCacheSlot {
                name: col.get::<Option<String>>(0)?.unwrap_or_default(),
                active_pid: col.get(1)?,
                cache_hit: col.get::<Option<i64>>(2)?.unwrap_or(0),
                cache_miss: col.get::<Option<i64>>(3)?.unwrap_or(0),
                blks_read: col.get::<Option<i64>>(4)?.unwrap_or(0),
                hit_rate: col.get(5)?,
            });
        }
        Ok(Some(status))
    }

    /// Primary: tries the agents' session-level advisory lock (election.rs) without waiting;
    /// true when this session holds it now.
    pub async fn try_agent_lock(&mut self) -> Result<bool, NodeError> {
        const WHAT: &str = "pg_try_advisory_lock()";
        let row = self
            .query_one(WHAT, election::SQL_TRY_LOCK, &[&election::LOCK_KEY])
            .await?;
        Ok(Columns::new(self, WHAT, &row)
            .get::<Option<bool>>(0)?
            .unwrap_or(false))
    }

    /// Primary: the session holding the agents' lock in this database, if any.
    pub async fn agent_lock_holder(&mut self) -> Result<Option<election::Holder>, NodeError> {
        const WHAT: &str = "the ccm-agent lock's holder query";
        let stmt = self.statement(WHAT, election::SQL_HOLDER).await?;
        let key = election::LOCK_KEY;
        let row = self
            .guarded(WHAT, self.client.query_opt(&stmt, &[&key]))
            .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let col = Columns::new(self, WHAT, &row);
        Ok(Some(election::Holder {
            pid: col.get(0)?,
            application_name: col.get(1)?,
            client_addr: col.get(2)?,
            client_port: col.get(3)?,
        }))
    }

    /// Primary: records the agent's report of the failover candidates in ccm_candidates (one
    /// statement, which replaces the last report); the next is due within `next_report_ms`.
    /// Ok(false) under a catalog before 0.8.0, whose version is read again every
    /// CATALOG_RECHECK_EVERY reports, so that an ALTER EXTENSION UPDATE is seen without a
    /// new session (the primary's library is never older than its catalog).
    pub async fn report_candidates(
        &mut self,
        agent: &str,
        next_report_ms: i64,
        rows: &[CandidateRow],
    ) -> Result<bool, NodeError> {
        if !self.facts.supports(CANDIDATE_REPORT_SINCE) {
            self.reports_skipped += 1;
            if self.reports_skipped < CATALOG_RECHECK_EVERY {
                return Ok(false);
            }
            self.reports_skipped = 0;
            const WHAT: &str = "the extension's version";
            let row = self.query_one(WHAT, SQL_CATALOG_VERSION, &[]).await?;
            let version: Option<String> = Columns::new(self, WHAT, &row).get(0)?;
            if version != self.facts.extension_version {
                info!(
                    "{}: the extension's catalog is now {}",
                    self.label(),
                    version.as_deref().unwrap_or("not installed")
                );
                self.facts.extension_version = version;
            }
            if !self.facts.supports(CANDIDATE_REPORT_SINCE) {
                return Ok(false);
            }
        }
        let members: Vec<&str> = rows.iter().map(|r| r.member.as_str()).collect();
        let states: Vec<&str> = rows.iter().map(|r| r.state.as_str()).collect();
        let coverage: Vec<Option<f64>> = rows.iter().map(|r| r.coverage).collect();
        let missing: Vec<Option<i64>> = rows.iter().map(|r| r.missing_blocks).collect();
        let hot: Vec<Option<i64>> = rows.iter().map(|r| r.hot_blocks).collect();
        self.query_one(
            "ccm_report_candidates()",
            SQL_REPORT_CANDIDATES,
            &[
                &agent,
                &next_report_ms,
                &members,
                &states,
                &coverage,
                &missing,
                &hot,
            ],
        )
        .await?;
        Ok(true)
    }

    /// Primary: hot buffers, all of them or only those `filter` lacks.
    pub async fn hot_buffers_count(&mut self, filter: Option<&[u8]>) -> Result<i64, NodeError> {
        let (what, row) = match filter {
            None => {
                let what = "ccm_hot_buffers()";
                (what, self.query_one(what, SQL_HOT_COUNT, &[]).await?)
            }
            Some(f) => {
                let what = "ccm_hot_buffers(filter)";
                (what, self.query_one(what, SQL_MISSING_COUNT, &[&f]).await?)
            }
        };
        Columns::new(self, what, &row).get(0)
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
    let mut failures = Vec::new();
    let mut answered = false;
    let mut fallback: Option<Node> = None;
    for host in info.hosts() {
        match Node::connect(info, &host, side, options, cancel).await {
            Ok(node) if node.facts.in_recovery == side.wants_recovery() => {
                // The extension lives in the catalog every node of the cluster shares, so
                // its absence is final for this string: say so plainly instead of trying on.
                // So is an old library on the one node of this role.
                if strict {
                    node.require_extension()?;
                }
                return Ok(node);
            }
            Ok(node) => {
                answered = true;
                tried.push(format!("{host} is a {}", node.role()));
                if !strict && fallback.is_none() {
                    fallback = Some(node);
                }
            }
            Err(NodeError::Cancelled) => return Err(NodeError::Cancelled),
            Err(e) => {
                tried.push(e.to_string());
                failures.push(e);
            }
        }
    }
    if answered {
        failures.clear();
    }
    match fallback {
        Some(node) => Ok(node),
        None => Err(NodeError::NoMatch {
            side,
            tried: tried.join("; "),
            failures,
        }),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn facts(catalog: Option<&str>, library: Option<&str>) -> NodeFacts {
        NodeFacts {
            in_recovery: true,
            system_identifier: "1".into(),
            shared_buffers: 16384,
            database: "postgres".into(),
            extension_version: catalog.map(Into::into),
            server_version: "17.2".into(),
            library_version: library.map(Into::into),
        }
    }

    #[test]
    fn versions_compare_as_numbers() {
        assert_eq!(Version::parse("0.7.0"), Some(Version(0, 7, 0)));
        assert_eq!(Version::parse("1.0"), Some(Version(1, 0, 0)));
        assert_eq!(Version::parse("2"), Some(Version(2, 0, 0)));
        assert!(Version::parse("0.10.0") > Version::parse("0.9.0"));
        assert!(Version::parse("1.0") > Version::parse("0.99.99"));
        for bad in [
            "",
            ".",
            "0..1",
            "0.7.",
            "0.7.0.1",
            "0.7.0-dev",
            "v0.7.0",
            " 0.7.0",
            "+1.0",
            "-1.0",
            "0.7.x",
            "99999999999.0",
            "０.７.０",
        ] {
            assert_eq!(Version::parse(bad), None, "{bad:?}");
        }
        // The catalog reads leniently, as it always did: non-numbers count as 0.
        assert_eq!(Version::lenient("0.6.0"), Version(0, 6, 0));
        assert_eq!(Version::lenient("1.0"), Version(1, 0, 0));
        assert_eq!(Version::lenient("weird"), Version(0, 0, 0));
        assert_eq!(Version::lenient(""), Version(0, 0, 0));
    }

    #[test]
    fn library_skew_cases() {
        let v = |s: &str| Version::parse(s).unwrap();
        // No catalog: whatever the library.
        assert_eq!(library_skew(None, None), Skew::NoCatalog);
        assert_eq!(library_skew(None, Some("0.7.0")), Skew::NoCatalog);
        // A library that does not tell, under a catalog from before it could.
        assert_eq!(library_skew(Some("0.6.0"), None), Skew::Legacy(v("0.6.0")));
        assert_eq!(library_skew(Some("0.1.0"), None), Skew::Legacy(v("0.1.0")));
        // ... under a catalog that expects a library that tells: an old library.
        let old = |catalog: &str, library: Option<&str>| Skew::LibraryOlder {
            catalog: v(catalog),
            library: library.map(v),
        };
        assert_eq!(library_skew(Some("0.7.0"), None), old("0.7.0", None));
        assert_eq!(
            library_skew(Some("0.8.0"), Some("0.7.0")),
            old("0.8.0", Some("0.7.0"))
        );
        assert_eq!(
            library_skew(Some("0.10.0"), Some("0.9.0")),
            old("0.10.0", Some("0.9.0"))
        );
        // A library newer than the catalog.
        let newer = |catalog: &str, library: &str| Skew::CatalogOlder {
            catalog: v(catalog),
            library: v(library),
        };
        assert_eq!(
            library_skew(Some("0.6.0"), Some("0.7.0")),
            newer("0.6.0", "0.7.0")
        );
        assert_eq!(
            library_skew(Some("0.9.0"), Some("0.10.0")),
            newer("0.9.0", "0.10.0")
        );
        // Equal, however spelt.
        assert_eq!(
            library_skew(Some("0.7.0"), Some("0.7.0")),
            Skew::Same(v("0.7.0"))
        );
        assert_eq!(
            library_skew(Some("1.0"), Some("1.0.0")),
            Skew::Same(v("1.0"))
        );
        // An unreadable library version is unknown; an odd catalog reads leniently.
        assert_eq!(
            library_skew(Some("0.7.0"), Some("garbage")),
            old("0.7.0", None)
        );
        assert_eq!(
            library_skew(Some("0.7.0"), Some("0.7.0-dev")),
            old("0.7.0", None)
        );
        assert_eq!(
            library_skew(Some("0.6.0"), Some("")),
            Skew::Legacy(v("0.6.0"))
        );
        assert_eq!(
            library_skew(Some("weird"), None),
            Skew::Legacy(Version(0, 0, 0))
        );
    }

    #[test]
    fn gates_use_the_lower_of_catalog_and_library() {
        let sql = |c: Option<&str>, l: Option<&str>| facts(c, l).sql_version();
        let v = |s: &str| Version::parse(s);
        assert_eq!(sql(None, Some("0.7.0")), None);
        assert_eq!(sql(Some("0.6.0"), None), v("0.6.0"));
        assert_eq!(sql(Some("0.6.0"), Some("0.7.0")), v("0.6.0"));
        assert_eq!(sql(Some("0.7.0"), Some("0.7.0")), v("0.7.0"));
        assert_eq!(sql(Some("0.8.0"), Some("0.7.0")), v("0.7.0"));
        assert_eq!(sql(Some("0.7.0"), None), None);

        // Gates ask the older of catalog and library.
        assert!(!facts(None, None).supports(COLDER_FEED_SINCE));
        assert!(facts(Some("0.10.1"), Some("0.10.1")).supports(COLDER_FEED_SINCE));
        assert!(facts(Some("1.0"), Some("1.0")).supports(COLDER_FEED_SINCE));
        // A library that does not tell under a 0.7.0 catalog opens no gate at all.
        assert!(!facts(Some("0.7.0"), None).supports(CHANGE_FEED_SINCE));

        let feed = |c: &str, l: Option<&str>| change_feed_works(facts(Some(c), l).skew());
        let colder = |c: &str, l: Option<&str>| facts(Some(c), l).supports(COLDER_FEED_SINCE);
        assert!(!feed("0.4.0", None));
        assert!(feed("0.5.0", None) && !colder("0.5.0", None));
        assert!(feed("0.6.0", None) && colder("0.6.0", None));
        assert!(feed("0.7.0", Some("0.7.0")) && colder("0.7.0", Some("0.7.0")));
        // The 0.7.0 library answers the 0.6.0 catalog's feed, not the 0.5.0 catalog's.
        assert!(feed("0.6.0", Some("0.7.0")) && colder("0.6.0", Some("0.7.0")));
        assert!(!feed("0.5.0", Some("0.7.0")));
        assert!(!feed("0.7.0", None) && !colder("0.7.0", None));
    }

    #[test]
    fn skew_messages() {
        let err = facts(Some("0.7.0"), None)
            .require_callable("db2:5432".into())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "db2:5432: the pg_ccm library this server has loaded (older than 0.7.0) is older \
             than the extension's catalog (0.7.0); install pg_ccm 0.7.0 on this node and restart \
             it (libraries on every node first, then ALTER EXTENSION pg_ccm UPDATE)"
        );
        assert!(!err.breaks_connection());
        assert_eq!(err.class(), ErrorClass::Other);
        let err = facts(Some("0.10.0"), Some("0.9.0"))
            .require_callable("h:1".into())
            .unwrap_err();
        assert!(
            err.to_string().starts_with(
                "h:1: the pg_ccm library this server has loaded (0.9.0) is older than the \
                 extension's catalog (0.10.0); install pg_ccm 0.10.0"
            ),
            "{err}"
        );
        // A catalog older than the oldest supported, with an old library or a new one.
        let err = facts(Some("0.4.0"), None)
            .require_callable("h:1".into())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "h:1: extension pg_ccm 0.4.0 is older than the oldest this agent supports (0.5.0); \
             install this release's pg_ccm on every node and restart it, then run ALTER \
             EXTENSION pg_ccm UPDATE on the primary"
        );
        assert!(
            err.breaks_connection(),
            "the catalog may change on a live session"
        );
        let err = facts(Some("0.3.0"), Some("0.7.0"))
            .require_callable("h:1".into())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "h:1: extension pg_ccm 0.3.0 is older than the oldest this agent supports (0.5.0); \
             run ALTER EXTENSION pg_ccm UPDATE on the primary"
        );
        for (c, l) in [
            (None, None),
            (Some("0.5.0"), None),
            (Some("0.5.0"), Some("0.7.0")),
            (Some("0.6.0"), None),
            (Some("0.7.0"), Some("0.7.0")),
            (Some("0.6.0"), Some("0.7.0")),
        ] {
            assert!(
                facts(c, l).require_callable("h".into()).is_ok(),
                "{c:?} {l:?}"
            );
        }
        assert_eq!(
            facts(Some("0.6.0"), Some("0.7.0"))
                .catalog_behind("db1:5432")
                .as_deref(),
            Some(
                "db1:5432: the extension's catalog (0.6.0) is older than the loaded pg_ccm \
                 library (0.7.0); run ALTER EXTENSION pg_ccm UPDATE on the primary"
            )
        );
        assert_eq!(
            facts(Some("0.7.0"), Some("0.7.0")).catalog_behind("h"),
            None
        );
        assert_eq!(facts(Some("0.6.0"), None).catalog_behind("h"), None);
    }

    #[test]
    fn facts_query_reads_the_library_version_last() {
        assert!(SQL_FACTS.ends_with(", current_setting('ccm.library_version', true)"));
        assert!(SQL_FACTS.starts_with("SELECT pg_is_in_recovery(), "));
        assert!(!SQL_FACTS.contains(';'), "one statement");
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

    #[test]
    fn sqlstates_are_classified() {
        use ErrorClass::*;
        // Recovery conflicts: cancelled statement, terminated session, dropped database;
        // the same when a prewarm worker's ERROR is re-raised in the caller's session.
        for (code, message) in [
            ("40001", "canceling statement due to conflict with recovery"),
            (
                "40001",
                "terminating connection due to conflict with recovery",
            ),
            (
                "57P04",
                "terminating connection due to conflict with recovery",
            ),
            ("40P01", "canceling statement due to conflict with recovery"),
        ] {
            assert_eq!(
                classify(code, message),
                RecoveryConflict,
                "{code} {message}"
            );
        }
        assert_eq!(classify("40P01", "deadlock detected"), Other);
        // Promoted: told apart from "disabled", which shares the SQLSTATE.
        assert_eq!(classify("55000", NOT_IN_RECOVERY_MESSAGE), NotInRecovery);
        assert_eq!(
            classify("55000", "Cluster Cache Manager is disabled"),
            Other
        );
        // Storage errors on a page.
        for code in ["XX001", "58030", "58P01"] {
            assert_eq!(classify(code, "whatever"), Storage, "{code}");
        }
        // The rest are faults.
        for code in [
            "57014", "22P03", "XX000", "57P01", "08006", "42883", "42501",
        ] {
            assert_eq!(classify(code, "x"), Other, "{code}");
        }
    }

    #[test]
    fn prewarm_selects_the_role_in_the_same_statement() {
        assert!(SQL_PREWARM.starts_with("SELECT pg_is_in_recovery(), requested"));
        assert!(SQL_PREWARM.contains("FROM ccm_prewarm($1::bytea)"));
        assert!(!SQL_PREWARM.contains(';'), "one statement");
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

    #[test]
    fn tls_error_messages() {
        let e = NodeError::Tls {
            host: "db1:5432".into(),
            reason: "certificate verify failed: certificate is not signed by the CA in /r.crt"
                .into(),
        };
        assert_eq!(
            e.to_string(),
            "db1:5432: TLS: certificate verify failed: certificate is not signed by the CA in /r.crt"
        );
        assert!(e.breaks_connection());
        let e = NodeError::Retried {
            first: Box::new(e),
            then_how: "without TLS (sslmode=prefer)",
            then: Box::new(NodeError::ConnectTimeout {
                host: "db1:5432".into(),
                after: Duration::from_secs(2),
            }),
        };
        assert_eq!(
            e.to_string(),
            "db1:5432: TLS: certificate verify failed: certificate is not signed by the CA in \
             /r.crt; then without TLS (sslmode=prefer): db1:5432: connection attempt timed out \
             after 2s"
        );
    }

    /// A server that answers the SSL request with 'N' (ssl=off), then hangs up.
    async fn server_without_ssl() -> (u16, tokio::task::JoinHandle<usize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let mut accepted = 0;
            while let Ok(Ok((mut socket, _))) =
                tokio::time::timeout(Duration::from_millis(500), listener.accept()).await
            {
                accepted += 1;
                let mut request = [0u8; 8];
                if socket.read_exact(&mut request).await.is_ok()
                    && request == [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f]
                {
                    let _ = socket.write_all(b"N").await;
                }
            }
            accepted
        });
        (port, task)
    }

    /// The error of connecting to 127.0.0.1:`port` with `sslmode`.
    pub(crate) async fn connect_error(port: u16, sslmode: &str) -> NodeError {
        let info = ConnInfo::parse_with_env(
            &format!("host=127.0.0.1 port={port} user=u dbname=d sslmode={sslmode}"),
            &|_| None,
        )
        .unwrap();
        let options = ConnectOptions {
            connect_timeout: Duration::from_secs(2),
            statement_timeout: Duration::from_secs(1),
        };
        let host = info.hosts()[0].clone();
        Node::connect(
            &info,
            &host,
            Side::Primary,
            options,
            &CancellationToken::new(),
        )
        .await
        .unwrap_err()
    }

    #[tokio::test]
    async fn a_server_without_ssl_is_refused_when_ssl_is_required() {
        let (port, server) = server_without_ssl().await;
        let err = connect_error(port, "require").await;
        assert_eq!(
            err.to_string(),
            format!("127.0.0.1:{port}: TLS: server does not support SSL, but SSL was required")
        );
        assert_eq!(server.await.unwrap(), 1, "one attempt, no retry");
    }

    #[tokio::test]
    async fn allow_retries_with_tls_only_when_the_server_refuses() {
        // A server that hangs up is no refusal: allow makes one plain attempt only.
        let (port, server) = server_without_ssl().await;
        let err = connect_error(port, "allow").await;
        assert!(matches!(err, NodeError::Connect { .. }), "{err}");
        assert_eq!(server.await.unwrap(), 1);
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

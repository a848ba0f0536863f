//! `ccm_candidates`: the active agent's last report of every failover candidate, on the primary,
//! for monitoring that speaks only SQL (psql in an incident, postgres_exporter's custom
//! queries, pgwatch).
//!
//! After each cycle ccm-agent calls `ccm_report_candidates()` on the primary with one element
//! per candidate in each array. The report replaces the previous one in a fixed area of shared
//! memory: at most `MAX_CANDIDATES` rows, names and states of at most `MAX_NAME` bytes, all of
//! it checked before anything is stored, under one LWLock held for a copy. The view
//! `ccm_candidates` (over `ccm_candidate_reports()`) shows it with the time of the report and
//! whether it is stale: older than `STALE_FACTOR` times the delay within which the agent said
//! its next report is due (its interval, or its backoff after a failure, plus a cycle), which
//! is what an agent that stopped, lost its session or stands by leaves behind. Shared memory is the
//! primary's own (not WAL-logged, not kept across a restart): a standby shows no rows, and a
//! new primary shows its first report one agent cycle after the promotion.

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgLwLock};

use crate::errors;

/// Most candidates one report holds; ccm_hot_blocks_each() serves as many standbys.
const MAX_CANDIDATES: usize = 64;

/// Longest member name, state or agent name, in bytes (NAMEDATALEN - 1).
const MAX_NAME: usize = 63;

/// A report older than this many times the delay its agent announced for the next one is
/// stale.
const STALE_FACTOR: i64 = 3;

/// Longest delay an agent may announce for its next report: a day, in milliseconds.
const MAX_NEXT_REPORT_MS: i64 = 86_400_000;

/// A name of at most MAX_NAME bytes, stored inline (shared memory holds no pointers).
#[derive(Clone, Copy, Debug)]
struct Name {
    len: u8,
    bytes: [u8; MAX_NAME],
}

impl Name {
    const EMPTY: Name = Name { len: 0, bytes: [0; MAX_NAME] };

    /// `text` is already checked to be at most MAX_NAME bytes.
    fn new(text: &str) -> Name {
        let mut name = Name::EMPTY;
        name.bytes[..text.len()].copy_from_slice(text.as_bytes());
        name.len = text.len() as u8;
        name
    }

    fn as_string(&self) -> String {
        String::from_utf8_lossy(&self.bytes[..usize::from(self.len)]).into_owned()
    }
}

/// One candidate as the agent last saw it. Negative numbers stand for NULL.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    member: Name,
    state: Name,
    coverage: f64,
    missing_blocks: i64,
    hot_blocks: i64,
}

impl Candidate {
    const EMPTY: Candidate = Candidate {
        member: Name::EMPTY,
        state: Name::EMPTY,
        coverage: -1.0,
        missing_blocks: -1,
        hot_blocks: -1,
    };
}

/// The last report. Copy and without pointers, as pgrx shared memory requires.
#[derive(Clone, Copy, Debug)]
pub struct Report {
    agent: Name,
    /// When it was written (TimestampTz); 0: never.
    reported_at: i64,
    next_report_ms: i64,
    count: usize,
    candidates: [Candidate; MAX_CANDIDATES],
}

impl Default for Report {
    fn default() -> Self {
        Report {
            agent: Name::EMPTY,
            reported_at: 0,
            next_report_ms: 0,
            count: 0,
            candidates: [Candidate::EMPTY; MAX_CANDIDATES],
        }
    }
}

unsafe impl PGRXSharedMemory for Report {}

static REPORT: PgLwLock<Report> = unsafe { PgLwLock::new(c"pg_ccm candidate report") };

pub fn init() {
    pg_shmem_init!(REPORT);
}

/// Raises the ERROR for a node in recovery: the report belongs to the primary.
fn require_primary() {
    if unsafe { pg_sys::RecoveryInProgress() } {
        errors::raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "recovery is in progress".into(),
            Some("ccm_report_candidates() records the agent's report on the primary.".into()),
            Some("Call it on the primary."),
        );
    }
}

/// `text` as a stored name, or an ERROR naming `what`.
fn checked_name(what: &str, text: Option<&str>) -> Name {
    match text {
        None => errors::invalid_argument(format!("{what} must not be null"), None),
        Some("") => errors::invalid_argument(format!("{what} must not be empty"), None),
        Some(text) if text.len() > MAX_NAME => errors::raise(
            PgSqlErrorCode::ERRCODE_STRING_DATA_RIGHT_TRUNCATION,
            format!("{what} is too long"),
            Some(format!("It has {} bytes; at most {MAX_NAME} are allowed.", text.len())),
            None,
        ),
        Some(text) => Name::new(text),
    }
}

/// A count, or NULL (-1 in shared memory); negative counts are refused.
fn checked_count(what: &str, value: Option<i64>) -> i64 {
    match value {
        None => -1,
        Some(v) if v < 0 => errors::invalid_argument(format!("{what} must not be negative: {v}"), None),
        Some(v) => v,
    }
}

/// Records the agent's report of the failover candidates, replacing the previous one; returns
/// how many candidates it holds. One element per candidate in each array, in the same order.
/// `next_report_ms`: the agent's next report is due within this many milliseconds.
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe)]
fn ccm_report_candidates(
    agent: &str,
    next_report_ms: i64,
    member: Array<'_, &str>,
    state: Array<'_, &str>,
    coverage: Array<'_, f64>,
    missing_blocks: Array<'_, i64>,
    hot_blocks: Array<'_, i64>,
) -> i32 {
    require_primary();
    let agent = checked_name("agent", Some(agent));
    if !(1..=MAX_NEXT_REPORT_MS).contains(&next_report_ms) {
        errors::invalid_argument(
            format!("next_report_ms out of range: {next_report_ms}"),
            Some(format!("The next report is due within 1 to {MAX_NEXT_REPORT_MS} milliseconds.")),
        );
    }
    let count = member.len();
    if count > MAX_CANDIDATES {
        errors::raise(
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            format!("too many candidates: {count}"),
            Some(format!("A report holds at most {MAX_CANDIDATES} candidates.")),
            None,
        );
    }
    let lengths = [state.len(), coverage.len(), missing_blocks.len(), hot_blocks.len()];
    if lengths.iter().any(|&len| len != count) {
        errors::invalid_argument(
            "the arrays of a candidate report differ in length".into(),
            Some(format!(
                "member has {count} elements, state {}, coverage {}, missing_blocks {}, hot_blocks {}.",
                lengths[0], lengths[1], lengths[2], lengths[3]
            )),
        );
    }
    let mut candidates = [Candidate::EMPTY; MAX_CANDIDATES];
    let columns = member.iter().zip(state.iter()).zip(coverage.iter()).zip(missing_blocks.iter()).zip(hot_blocks.iter());
    for (slot, ((((member, state), coverage), missing), hot)) in candidates.iter_mut().zip(columns) {
        let coverage = match coverage {
            None => -1.0,
            Some(c) if (0.0..=1.0).contains(&c) => c,
            Some(c) => errors::invalid_argument(format!("coverage out of range: {c}"), Some("A coverage is from 0 to 1.".into())),
        };
        *slot = Candidate {
            member: checked_name("member", member),
            state: checked_name("state", state),
            coverage,
            missing_blocks: checked_count("missing_blocks", missing),
            hot_blocks: checked_count("hot_blocks", hot),
        };
    }
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    *REPORT.exclusive() = Report { agent, reported_at: now, next_report_ms, count, candidates };
    count as i32
}

fn optional<T>(value: T, null: bool) -> Option<T> {
    (!null).then_some(value)
}

/// The last report, one row per candidate (none before the first report).
#[pg_extern(volatile, parallel_safe)]
fn ccm_candidate_reports() -> TableIterator<
    'static,
    (
        name!(member, String),
        name!(state, String),
        name!(coverage, Option<f64>),
        name!(missing_blocks, Option<i64>),
        name!(hot_blocks, Option<i64>),
        name!(agent, String),
        name!(reported_at, Option<TimestampWithTimeZone>),
        name!(stale, bool),
    ),
> {
    let report = *REPORT.share();
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let age_ms = (now - report.reported_at) / 1000;
    let stale = age_ms > STALE_FACTOR.saturating_mul(report.next_report_ms);
    let reported_at = TimestampWithTimeZone::try_from(report.reported_at).ok();
    let agent = report.agent.as_string();
    let rows: Vec<_> = report.candidates[..report.count.min(MAX_CANDIDATES)]
        .iter()
        .map(|c| {
            (
                c.member.as_string(),
                c.state.as_string(),
                optional(c.coverage, c.coverage < 0.0),
                optional(c.missing_blocks, c.missing_blocks < 0),
                optional(c.hot_blocks, c.hot_blocks < 0),
                agent.clone(),
                reported_at,
                stale,
            )
        })
        .collect();
    TableIterator::new(rows)
}

extension_sql!(
    r#"
CREATE VIEW ccm_candidates AS SELECT * FROM ccm_candidate_reports();
COMMENT ON VIEW ccm_candidates IS 'The active ccm-agent''s last report of each failover candidate (on the primary); stale when older than three times the delay it announced for the next';
"#,
    name = "candidates_view",
    requires = [ccm_candidate_reports],
);

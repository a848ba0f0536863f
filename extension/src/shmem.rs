//! Shared-memory scan counters behind `aurora_ccm_status()`.
//!
//! Every `ccm_hot_blocks()` call is one scan of the buffer headers. A scan reports its
//! progress while it runs ("current scan"), becomes the "last scan" when it completes,
//! and is added to a ring of one-second buckets from which "last minute" is summed.
//! Counters are updated a few dozen times per scan, so one LWLock is plenty.

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgLwLock};

/// Sent and found counts of one scan (or a sum of scans).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScanCounts {
    /// Hot buffers put into the block list (not in the standby's filter).
    pub sent: u64,
    /// Hot buffers found (usage count above the threshold).
    pub found: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct SecondBucket {
    /// Unix time in seconds this bucket counts for.
    second: i64,
    counts: ScanCounts,
}

const WINDOW_SECONDS: usize = 60;

/// The whole shared state. Copy + no pointers, as pgrx shared memory requires.
#[derive(Clone, Copy, Debug)]
pub struct ScanStats {
    current: ScanCounts,
    current_progress: u64,
    last: ScanCounts,
    window: [SecondBucket; WINDOW_SECONDS],
}

impl Default for ScanStats {
    fn default() -> Self {
        ScanStats {
            current: ScanCounts::default(),
            current_progress: 0,
            last: ScanCounts::default(),
            window: [SecondBucket::default(); WINDOW_SECONDS],
        }
    }
}

unsafe impl PGRXSharedMemory for ScanStats {}

static STATS: PgLwLock<ScanStats> = unsafe { PgLwLock::new(c"pg_ccm scan stats") };

pub fn init() {
    pg_shmem_init!(STATS);
}

fn now_seconds() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs() as i64)
}

/// What `aurora_ccm_status()` shows.
#[derive(Clone, Copy, Debug, Default)]
pub struct StatusSnapshot {
    pub last_minute: ScanCounts,
    pub last_scan: ScanCounts,
    pub current_scan: ScanCounts,
    pub current_scan_progress: u64,
}

pub fn snapshot() -> StatusSnapshot {
    let stats = STATS.share();
    let now = now_seconds();
    let mut last_minute = ScanCounts::default();
    for bucket in stats.window.iter().filter(|b| now - b.second < WINDOW_SECONDS as i64) {
        last_minute.sent += bucket.counts.sent;
        last_minute.found += bucket.counts.found;
    }
    StatusSnapshot {
        last_minute,
        last_scan: stats.last,
        current_scan: stats.current,
        current_scan_progress: stats.current_progress,
    }
}

/// Marks the start of a scan: the current counters restart from zero.
pub fn scan_started() {
    let mut stats = STATS.exclusive();
    stats.current = ScanCounts::default();
    stats.current_progress = 0;
}

/// Publishes a running scan's counters (buffers visited so far).
pub fn scan_progress(counts: ScanCounts, visited: u64) {
    let mut stats = STATS.exclusive();
    stats.current = counts;
    stats.current_progress = visited;
}

/// Records a completed scan: it becomes the last scan and counts in the last minute.
pub fn scan_finished(counts: ScanCounts, visited: u64) {
    let now = now_seconds();
    let mut stats = STATS.exclusive();
    stats.current = counts;
    stats.current_progress = visited;
    stats.last = counts;
    let bucket = &mut stats.window[now.rem_euclid(WINDOW_SECONDS as i64) as usize];
    if bucket.second != now {
        *bucket = SecondBucket { second: now, counts: ScanCounts::default() };
    }
    bucket.counts.sent += counts.sent;
    bucket.counts.found += counts.found;
}

//! The background worker behind `ccm.logical_wal_cache`.
//!
//! Every tick (10 ms) it moves the cached window to the newest WAL behind the flush
//! position, then accounts for each logical slot's progress since the previous tick against
//! the window held at that tick, and publishes both. It needs shared memory only: no
//! database connection, no transaction, no lock but the short shared one on the slot array.
//! It starts when recovery has finished (a standby has no logical walsenders in 15), so a
//! promoted standby gets its cache at promotion.
//!
//! Locking a large window (at start, after a timeline switch) goes in bounded steps, and
//! between steps the worker checks for SIGTERM and postmaster death (`stop_requested`), so
//! a fast shutdown never waits for the cache to be read from storage.

use std::time::Duration;

use ccm_walcache::Window;
use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::prelude::*;

use super::segments::{os_page_size, raise_lock_limit, SegmentCache};
use super::shared::{self, CacheView};
use super::slots;
use crate::bgworker::stop_requested;
use crate::compat;

const TICK: Duration = Duration::from_millis(10);

fn kilobytes(bytes: u64) -> String {
    format!("{} kB", bytes / 1024)
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn pg_ccm_wal_cache_main(_argument: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let setting = super::setting_pages();
    let pages = super::cache_pages();
    if pages < setting {
        pgrx::pg_sys::panic::ErrorReport::new(
            PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            format!(
                "ccm.logical_wal_cache ({}) exceeds a quarter of the server's memory, using {}",
                kilobytes(setting * ccm_walcache::WAL_PAGE),
                kilobytes(pages * ccm_walcache::WAL_PAGE)
            ),
            "pg_ccm",
        )
        .set_detail(format!(
            "The server has {} of memory (the host's physical memory, or its cgroup's memory limit if smaller), and locked WAL pages cannot be evicted.",
            kilobytes(super::usable_memory())
        ))
        .set_hint("Lower ccm.logical_wal_cache.")
        .report(PgLogLevel::WARNING);
    }
    let segment_size = unsafe { pg_sys::wal_segment_size } as u64;
    let os_page = os_page_size();
    let granule = ccm_walcache::lock_granule(os_page, segment_size);
    if granule.is_none() {
        log!(
            "pg_ccm logical WAL cache does not lock pages in memory: the OS page size ({} bytes) does not divide the WAL segment size ({} bytes)",
            os_page,
            segment_size
        );
    }
    let lock_limit = raise_lock_limit();
    let mut cache = SegmentCache::new(pages, segment_size, lock_limit, os_page, granule);
    let pid = unsafe { pg_sys::MyProcPid };
    log!(
        "pg_ccm logical WAL cache started: {} kB, memory lock limit {}",
        pages * 8,
        if lock_limit == u64::MAX {
            "unlimited".to_string()
        } else {
            format!("{} kB", lock_limit / 1024)
        }
    );
    let mut held_before = Window::EMPTY;
    while BackgroundWorker::wait_latch(Some(TICK)) {
        if unsafe { pg_sys::RecoveryInProgress() } {
            cache.release();
            continue;
        }
        let (flush, timeline) = compat::wal_flush_position();
        let coverage = cache.advance(flush, timeline, &stop_requested);
        shared::account(&slots::logical_slots(), held_before);
        held_before = coverage.held;
        shared::publish(CacheView {
            worker_pid: pid,
            held: coverage.held,
            locked: coverage.locked,
            lock_limit,
        });
    }
    cache.release();
    shared::publish(CacheView {
        lock_limit,
        ..Default::default()
    });
}

//! The background worker behind `ccm.logical_wal_cache`.
//!
//! Every tick (10 ms) it moves the cached window to the newest WAL behind the flush
//! position, then accounts for each logical slot's progress since the previous tick against
//! the window held at that tick, and publishes both. It needs shared memory only: no
//! database connection, no transaction, no lock but the short shared one on the slot array.
//! It starts when recovery has finished (a standby has no logical walsenders in 15), so a
//! promoted standby gets its cache at promotion.

use std::time::Duration;

use ccm_walcache::Window;
use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::prelude::*;

use super::segments::{raise_lock_limit, SegmentCache};
use super::shared::{self, CacheView};
use super::slots;
use crate::compat;

const TICK: Duration = Duration::from_millis(10);

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn pg_ccm_wal_cache_main(_argument: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let pages = super::cache_pages();
    let segment_size = unsafe { pg_sys::wal_segment_size } as u64;
    let lock_limit = raise_lock_limit();
    let mut cache = SegmentCache::new(pages, segment_size, lock_limit);
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
        let coverage = cache.advance(flush, timeline);
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

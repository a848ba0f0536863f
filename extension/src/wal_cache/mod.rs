//! The logical replication write-through WAL cache (Aurora's `rds.logical_wal_cache`).
//!
//! `ccm.logical_wal_cache` pages of the newest WAL are kept in memory by a background
//! worker (`segments.rs`, `worker.rs`), so that walsenders decoding recent changes read them
//! from memory. Per-slot hits and misses (`shared.rs`, `slots.rs`) and the Aurora functions
//! (`functions.rs`) report what the cache did for each logical slot.

use std::sync::OnceLock;
use std::time::Duration;

use pgrx::bgworkers::{BackgroundWorkerBuilder, BgWorkerStartTime};

mod functions;
mod segments;
mod shared;
pub(crate) mod slots;
mod worker;

/// The `ccm.logical_wal_cache` setting in WAL pages; 0 when the cache is off.
pub fn setting_pages() -> u64 {
    ccm_walcache::effective_cache_pages(crate::gucs::LOGICAL_WAL_CACHE.get()).max(0) as u64
}

/// Bytes of the host's physical memory (0 if unknown).
pub fn physical_memory() -> u64 {
    let (pages, page_size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages > 0 && page_size > 0 {
        (pages as u64).saturating_mul(page_size as u64)
    } else {
        0
    }
}

/// Bytes of memory the server may use (0 if unknown): the host's physical memory, or the
/// memory limit of the server's cgroup (a container's, a systemd unit's) if that is smaller.
/// Read once per process: the postmaster reads it in `_PG_init` and the worker and backends
/// it forks inherit the value, so they all agree on the cache size even if the limit changes
/// (a changed limit applies at the next server start).
pub fn usable_memory() -> u64 {
    static USABLE_MEMORY: OnceLock<u64> = OnceLock::new();
    *USABLE_MEMORY.get_or_init(|| ccm_walcache::usable_memory(physical_memory()))
}

/// The cache size in WAL pages that the worker uses: the setting, at most a quarter of the
/// server's memory (`usable_memory`); 0 when the cache is off.
pub fn cache_pages() -> u64 {
    ccm_walcache::capped_cache_pages(setting_pages(), usable_memory())
}

/// Called from `_PG_init`, after the GUCs are defined.
pub fn init() {
    assert_eq!(pgrx::pg_sys::XLOG_BLCKSZ as u64, ccm_walcache::WAL_PAGE);
    shared::init();
    if cache_pages() == 0 {
        return;
    }
    BackgroundWorkerBuilder::new("pg_ccm logical WAL cache")
        .set_type("pg_ccm logical WAL cache")
        .set_library("pg_ccm")
        .set_function("pg_ccm_wal_cache_main")
        .enable_shmem_access(None)
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(Some(Duration::from_secs(5)))
        .load();
}

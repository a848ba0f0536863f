//! When recovery ends (a standby promoted, or a server started), the WAL of older timelines
//! leaves this node's page cache.
//!
//! A standby's page cache holds the WAL it received: the WAL receiver writes it and the
//! startup process reads it, often twice, which puts it on the kernel's active list. Once
//! the standby is promoted nobody reads that WAL again (the new primary writes a new
//! timeline), but it still takes memory that the new workload needs. Measured with the
//! page-cache tier at shared_buffers = 1/4 of a node's memory: 488 MB of received WAL were
//! cached at the kill, and in its first 7 s the new primary's own WAL and checkpoint pushed
//! 87 MB of relation files out instead, which it then read again (demo/failover_demo.py's
//! memory trace; BENCHMARKS.md).
//!
//! So a background worker registered at server start (when `ccm.os_cache_release_old_wal`
//! is on) starts once recovery has finished, as the logical WAL cache's does, and calls
//! posix_fadvise(POSIX_FADV_DONTNEED) on every segment file in pg_wal whose timeline is
//! older than the one WAL is now written on, then exits for good. PostgreSQL does the same
//! to WAL it will not read again when nobody streams it (xlog.c, XLogFileClose). The advice
//! frees clean pages only, so any dirty ones (fsync = off) are written first
//! (sync_file_range, as pg_flush_data starts writeback); nothing is lost: a later reader of
//! such a file (a walsender serving the old timeline's tail to a rejoining node, pg_rewind)
//! reads it from storage. The worker needs no database
//! connection, takes no lock and touches no shared buffer; it holds one of
//! max_worker_processes' slots from server start until recovery ends, then frees it.

use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags,
};
use pgrx::prelude::*;

use crate::compat;
use crate::gucs;
use crate::os_cache::{Dir, ExternalFd};

/// Called from `_PG_init`, after the GUCs are defined.
pub fn init() {
    if !gucs::OS_CACHE_RELEASE_OLD_WAL.get() {
        return;
    }
    BackgroundWorkerBuilder::new("pg_ccm old WAL release")
        .set_type("pg_ccm old WAL release")
        .set_library("pg_ccm")
        .set_function("pg_ccm_release_old_wal_main")
        .enable_shmem_access(None)
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(None)
        .load();
}

/// What one pass released: segment files advised, and their size.
#[derive(Default)]
struct Released {
    files: u64,
    bytes: u64,
}

/// Advises the kernel to drop every segment file of a timeline before `timeline` in the
/// directory; stops early on SIGTERM. The directory and each file are opened outside fd.c,
/// so two descriptors are reserved with it first, as ccm_os_cached_blocks() does.
fn release_older_than(directory: &str, timeline: u32) -> Released {
    let mut released = Released::default();
    let _reserved = (ExternalFd::reserve(), ExternalFd::reserve());
    let Some(dir) = Dir::open(directory) else {
        return released;
    };
    dir.for_each(|name| {
        if BackgroundWorker::sigterm_received() {
            return;
        }
        if !ccm_walcache::segment_file_timeline(name).is_some_and(|tli| tli < timeline) {
            return;
        }
        // A segment file name is 24 hex digits, at most with ".partial": no NUL inside.
        let mut path = [0u8; 64];
        path[..name.len()].copy_from_slice(name.as_bytes());
        let fd = unsafe {
            libc::openat(
                dir.fd(),
                path.as_ptr().cast(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return; // removed meanwhile by a checkpoint: its pages went with it
        }
        // Dirty pages are not dropped: write them first (none with fsync on, where the WAL
        // receiver flushed them; with fsync off, what the kernel would write within
        // dirty_expire_centisecs anyway), then advise.
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut stat) } == 0
            && unsafe { libc::sync_file_range(fd, 0, 0, flags) } == 0
            && unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) } == 0
        {
            released.files += 1;
            released.bytes += stat.st_size.max(0) as u64;
        }
        unsafe { libc::close(fd) };
    });
    released
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn pg_ccm_release_old_wal_main(_argument: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGTERM);
    let (_, timeline) = compat::wal_flush_position();
    let released = release_older_than("pg_wal", timeline);
    if released.files > 0 {
        log!(
            "pg_ccm dropped {} WAL segment files of timelines before {} ({} MB) from the page cache",
            released.files,
            timeline,
            released.bytes >> 20
        );
    }
}

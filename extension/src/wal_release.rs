//! WAL that every reader has passed leaves this node's page cache.
//!
//! A node's page cache holds the WAL it wrote or received. On a standby the WAL receiver
//! writes it and the startup process reads it, often twice, which puts it on the kernel's
//! active list; on a primary each WAL page is written several times as it fills. Either way it
//! competes with relation pages, and once replayed (a standby) or flushed and sent (a primary)
//! nobody reads it again. Measured with the page-cache tier at shared_buffers = 1/4 of a node's
//! memory: the standby held 627 MB of received WAL at the kill and lacked 108 MB of the
//! relation pages the primary cached, and in its first 30 s the new primary's own WAL (a
//! promotion's checkpoint makes every first change a full-page image) pushed relation pages out
//! that it read back: 47,000 disk reads in 60 s. With WAL dropped as described here (an
//! experiment outside the server): 3 MB lacked, 1,840 reads (BENCHMARKS.md).
//!
//! So a background worker registered at server start (when `ccm.os_cache_release_wal` is on)
//! runs once the node is consistent (a hot standby) or open (a primary), and once a second
//! calls posix_fadvise(POSIX_FADV_DONTNEED) on each segment file in pg_wal that lies wholly
//! below the position every reader has passed (`ccm_walcache::read_by_everyone`): replay on a
//! standby or the flush on a primary, each connected walsender's sent position, and the
//! oldest `restart_lsn` of the logical slots (decoding through one starts reading there), and
//! on a primary the start of the logical WAL cache's window (the newest
//! `ccm.logical_wal_cache` of WAL, which that cache locks in memory for logical walsenders; a
//! page dropped before it is locked would be read back from storage); a segment the archiver
//! has not archived yet (`.ready`) waits. A physical slot bounds nothing
//! by itself: while its standby streams, that walsender's position does, and a standby that
//! is away (or one connecting without a slot, pg_rewind, crash recovery) reads its WAL from
//! storage when it comes, which is sequential and which the relation pages it would otherwise
//! evict are not. PostgreSQL drops WAL the same way when nobody streams it (xlog.c,
//! XLogFileClose, at wal_level minimal); with replication it does not, because walsenders read
//! what was just written, which is why their positions bound it here. The advice frees clean,
//! unmapped pages only: the logical WAL cache's mapped window stays, and dirty pages (with
//! fsync = off) only have their writeback started by it (WB_SYNC_NONE), so files dropped are
//! advised again every 5 s, which drops them once written and any a late reader read back.
//! Nothing here waits for I/O: a first version waited for the writeback (sync_file_range with
//! WAIT_AFTER), which under a loaded disk kept a fast shutdown waiting for it for minutes.
//!
//! Walsenders and slots are read as the logical WAL cache reads them (`wal_cache::slots`:
//! aligned fields with single loads, the slots under ReplicationSlotControlLock in shared
//! mode, for a moment); a walsender that has sent nothing yet (0) holds everything back, and
//! a stale value only keeps more WAL cached. The worker needs no database connection, touches
//! no buffer, and holds one of max_worker_processes' slots. Without hot_standby it starts only
//! when recovery ends. Between the files of its walk it asks whether to stop without consuming
//! the request (`bgworker::stop_requested`), so a fast shutdown never waits for it.

use std::time::Duration;

use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags,
};
use pgrx::prelude::*;

use crate::bgworker::stop_requested;
use crate::compat;
use crate::failpoints;
use crate::gucs;
use crate::os_cache::{Dir, ExternalFd};
use crate::wal_cache::{self, slots};

/// How often the worker looks for WAL to drop.
const NAPTIME: Duration = Duration::from_secs(1);
/// Every this many looks, files dropped before are advised again: pages that were dirty are
/// written by then, and a reader that came later (a standby connecting without a slot) may
/// have read some back.
const LOOKS_PER_REVISIT: u32 = 5;

/// Called from `_PG_init`, after the GUCs are defined.
pub fn init() {
    if !gucs::OS_CACHE_RELEASE_WAL.get() {
        return;
    }
    BackgroundWorkerBuilder::new("pg_ccm WAL release")
        .set_type("pg_ccm WAL release")
        .set_library("pg_ccm")
        .set_function("pg_ccm_release_wal_main")
        .enable_shmem_access(None)
        .set_start_time(BgWorkerStartTime::ConsistentState)
        .set_restart_time(Some(Duration::from_secs(10)))
        .load();
}

/// The position below which every reader has read this node's WAL (`read_by_everyone`).
/// `cache_pages`: the logical WAL cache's size; on a primary it keeps its newest WAL.
fn read_by_everyone(cache_pages: u64) -> Option<u64> {
    let (position, cache_start) = if unsafe { pg_sys::RecoveryInProgress() } {
        let replay = unsafe { pg_sys::GetXLogReplayRecPtr(std::ptr::null_mut()) };
        (replay, None)
    } else {
        let flush = compat::wal_flush_position().0;
        // 0 while less WAL than the cache's size was written: then all of it stays.
        let window = ccm_walcache::Window::newest(flush, cache_pages);
        (flush, (cache_pages > 0).then_some(window.start))
    };
    let walsenders = slots::walsender_positions();
    let logical_restart = slots::logical_restart_minimum();
    ccm_walcache::read_by_everyone(
        position,
        [
            (logical_restart != 0).then_some(logical_restart),
            cache_start,
        ],
        walsenders.iter().map(|&(_, sent)| sent),
    )
}

/// A file name and a suffix in a NUL-terminated buffer on the stack (segment file names are
/// 24 hex digits, at most with ".partial": no NUL inside).
fn c_path(prefix: &str, name: &str, suffix: &str) -> Option<[u8; 96]> {
    let mut path = [0u8; 96];
    let length = prefix.len() + name.len() + suffix.len();
    if length >= path.len() {
        return None;
    }
    path[..prefix.len()].copy_from_slice(prefix.as_bytes());
    path[prefix.len()..prefix.len() + name.len()].copy_from_slice(name.as_bytes());
    path[prefix.len() + name.len()..length].copy_from_slice(suffix.as_bytes());
    Some(path)
}

/// Whether the archiver has yet to archive the segment file.
fn awaiting_archive(dir: &Dir, name: &str) -> bool {
    c_path("archive_status/", name, ".ready").is_some_and(|path| unsafe {
        libc::faccessat(dir.fd(), path.as_ptr().cast(), libc::F_OK, 0) == 0
    })
}

/// Advises the kernel to drop the file (its clean pages; the advice starts writing dirty
/// ones); its size when it did.
fn release(dir: &Dir, name: &str) -> Option<u64> {
    let path = c_path("", name, "")?;
    let fd = unsafe {
        libc::openat(
            dir.fd(),
            path.as_ptr().cast(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return None; // removed meanwhile by a checkpoint: its pages went with it
    }
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    let released = unsafe {
        libc::fstat(fd, &mut stat) == 0
            && libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) == 0
    };
    unsafe { libc::close(fd) };
    released.then_some(stat.st_size.max(0) as u64)
}

/// Drops the segment files numbered from `done_below` up to `below` (not included) that the
/// archiver is done with; returns the number below which every file is done. The directory
/// and each file are opened outside fd.c, so two descriptors are reserved with it first, as
/// ccm_os_cached_blocks() does.
fn release_below(done_below: u64, below: u64, segment_size: u64) -> u64 {
    if below <= done_below {
        return done_below;
    }
    let _reserved = (ExternalFd::reserve(), ExternalFd::reserve());
    let Some(dir) = Dir::open("pg_wal") else {
        return done_below;
    };
    failpoints::wal_release_delay();
    let (mut done, mut files, mut bytes) = (below, 0u64, 0u64);
    dir.for_each(|name| {
        let Some((_, segno)) = ccm_walcache::segment_file(name, segment_size) else {
            return;
        };
        if segno < done_below || segno >= below || stop_requested() {
            return;
        }
        if awaiting_archive(&dir, name) {
            done = done.min(segno);
        } else if let Some(size) = release(&dir, name) {
            files += 1;
            bytes += size;
        }
    });
    if files > 0 {
        debug1!(
            "pg_ccm dropped {} WAL segment files ({} MB) below segment {} from the page cache",
            files,
            bytes >> 20,
            below
        );
    }
    done
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn pg_ccm_release_wal_main(_argument: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGTERM);
    let segment_size = unsafe { pg_sys::wal_segment_size }.max(1) as u64;
    let cache_pages = wal_cache::cache_pages();
    let mut done_below = 0;
    let mut looks_to_revisit = 0;
    loop {
        if looks_to_revisit == 0 {
            (done_below, looks_to_revisit) = (0, LOOKS_PER_REVISIT);
        }
        looks_to_revisit -= 1;
        if let Some(position) = read_by_everyone(cache_pages) {
            done_below = release_below(done_below, position / segment_size, segment_size);
        }
        if !BackgroundWorker::wait_latch(Some(NAPTIME)) {
            return;
        }
    }
}
